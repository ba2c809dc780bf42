//! MLIR text -> sm_90a PTX through melior: parse and verify the `gpu.module`, run the NVVM
//! lowering pipeline, and read the PTX out of the resulting `gpu.binary` object. One context per
//! thread, reused by every call (a fresh module and pass manager each); no GPU and no CUDA
//! toolkit are needed.

use std::cell::RefCell;
use std::rc::Rc;

use melior::Context;
use melior::dialect::DialectRegistry;
use melior::ir::operation::OperationLike;
use melior::ir::{BlockLike, Module};
use melior::pass::PassManager;
use melior::utility::{parse_pass_pipeline, register_all_dialects, register_all_llvm_translations, register_all_passes};

use crate::KernelError;

/// The lowering: attach the sm_90a target, lower structured control flow and the GPU,
/// arith, vector and LLVM ops to NVVM, then let the NVPTX backend print PTX (`format=isa`).
const PIPELINE: &str = "builtin.module(\
    nvvm-attach-target{chip=sm_90a features=+ptx80 O=3}, \
    gpu.module(canonicalize, cse, convert-scf-to-cf, convert-gpu-to-nvvm), \
    gpu-to-llvm, reconcile-unrealized-casts, \
    gpu-module-to-binary{format=isa})";

/// A context with every dialect, translation and pass registered, collecting diagnostics.
fn context(diags: &Rc<RefCell<Vec<String>>>) -> Context {
    let registry = DialectRegistry::new();
    register_all_dialects(&registry);
    let ctx = Context::new_with_registry(&registry, false);
    ctx.load_all_available_dialects();
    register_all_llvm_translations(&ctx);
    register_all_passes();
    let sink = Rc::clone(diags);
    ctx.attach_diagnostic_handler(move |d| {
        sink.borrow_mut().push(format!("{}: {d}", d.location()));
        true
    });
    ctx
}

fn mlir_error(stage: &str, diags: &Rc<RefCell<Vec<String>>>) -> KernelError {
    let msgs = diags.borrow().join("\n");
    KernelError::Mlir { stage: stage.to_string(), message: if msgs.is_empty() { "no diagnostic".to_string() } else { msgs } }
}

/// Append the generated line a `loc("-":LINE:COL)` diagnostic points at (codegen bugs).
fn with_source_line(e: KernelError, mlir: &str) -> KernelError {
    let KernelError::Mlir { stage, message } = e else { return e };
    let line = message.split("loc(\"-\":").nth(1).and_then(|rest| rest.split(':').next()).and_then(|n| n.parse::<usize>().ok());
    match line.and_then(|n| mlir.lines().nth(n.wrapping_sub(1))) {
        Some(text) => KernelError::Mlir { stage, message: format!("{message}\n  at: {}", text.trim()) },
        None => KernelError::Mlir { stage, message },
    }
}

thread_local! {
    /// This thread's context and the diagnostics it collects. A context with every dialect
    /// loaded per call cost ~3 ms a kernel (the 8B preset's code generation 1.07 -> 0.88 s on a
    /// 2-core machine without it); modules and pass managers are still per call, so a kernel's
    /// PTX does not depend on what was lowered before (`reusing_the_context_changes_no_ptx`;
    /// the debug and 8B artifacts were byte-identical).
    static SHARED: (Context, Rc<RefCell<Vec<String>>>) = {
        let diags = Rc::new(RefCell::new(Vec::new()));
        (context(&diags), diags)
    };
}

/// Parse `mlir` (a module holding one `gpu.module`), verify it, and lower it to PTX.
pub(crate) fn to_ptx(mlir: &str) -> Result<String, KernelError> {
    SHARED.with(|(ctx, diags)| {
        diags.borrow_mut().clear();
        lower(ctx, diags, mlir)
    })
}

fn lower(ctx: &Context, diags: &Rc<RefCell<Vec<String>>>, mlir: &str) -> Result<String, KernelError> {
    let mut module = Module::parse(ctx, mlir).ok_or_else(|| with_source_line(mlir_error("parse", diags), mlir))?;
    if !module.as_operation().verify() {
        return Err(mlir_error("verify", diags));
    }
    let pm = PassManager::new(ctx);
    parse_pass_pipeline(pm.as_operation_pass_manager(), PIPELINE).map_err(|e| KernelError::Mlir { stage: "pipeline".into(), message: e.to_string() })?;
    pm.run(&mut module).map_err(|_| mlir_error("lowering", diags))?;
    let body = module.body();
    let mut op = body.first_operation();
    while let Some(o) = op {
        if o.name().as_string_ref().as_str().is_ok_and(|n| n == "gpu.binary") {
            // The objects array holds one `#gpu.object` (one target).
            let objects = o.attribute("objects").map_err(|e| KernelError::Mlir { stage: "binary".into(), message: e.to_string() })?;
            return assembly_of(&objects.to_string());
        }
        op = o.next_in_block();
    }
    Err(KernelError::Mlir { stage: "binary".into(), message: "the lowering produced no gpu.binary".into() })
}

/// The `assembly = "..."` string of a printed `#gpu.object`, unescaped (MLIR prints
/// non-printable bytes, quotes and backslashes as `\XX`).
fn assembly_of(attr: &str) -> Result<String, KernelError> {
    let bad = |m: &str| KernelError::Mlir { stage: "binary".into(), message: format!("{m} in the gpu.object attribute") };
    let start = attr.find("assembly = \"").ok_or_else(|| bad("no `assembly` string"))? + "assembly = \"".len();
    let bytes = attr.as_bytes();
    let mut out = Vec::with_capacity(attr.len() - start);
    let mut i = start;
    loop {
        match bytes.get(i) {
            None => return Err(bad("an unterminated assembly string")),
            Some(b'"') => break,
            Some(b'\\') => {
                let hex = attr.get(i + 1..i + 3).ok_or_else(|| bad("a truncated escape"))?;
                let b = u8::from_str_radix(hex, 16).map_err(|_| bad("a malformed escape"))?;
                out.push(b);
                i += 3;
            }
            Some(&b) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| bad("non-UTF-8 PTX"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assembly_strings_are_unescaped() {
        let a = r#"#gpu.object<#nvvm.target<chip = "sm_90a">, assembly = "a\0Ab\09\22c\5C">"#;
        assert_eq!(assembly_of(a).expect("parses"), "a\nb\t\"c\\");
    }

    const EMPTY_KERNEL: &str =
        "module attributes {gpu.container_module} {\n  gpu.module @m {\n    gpu.func @k(%p: !llvm.ptr) kernel {\n      gpu.return\n    }\n  }\n}\n";

    #[test]
    fn reusing_the_context_changes_no_ptx() {
        // A fresh thread has a fresh context; this one lowers other modules (and a failing
        // one) first. The PTX must be the same bytes.
        let fresh = std::thread::spawn(|| to_ptx(EMPTY_KERNEL).expect("lowers")).join().expect("no panic");
        assert!(fresh.contains(".entry k("), "{fresh}");
        let other = EMPTY_KERNEL.replace("@k(", "@other(");
        to_ptx(&other).expect("lowers");
        to_ptx("not mlir").expect_err("does not parse");
        assert_eq!(to_ptx(EMPTY_KERNEL).expect("lowers"), fresh);
    }

    #[test]
    fn an_error_names_only_its_own_diagnostics() {
        let first = to_ptx("module { func.func @f() { %0 = arith.constant 1 : i32 } }").expect_err("no terminator");
        let second = to_ptx("module { \"undefined.op\"() : () -> () }").expect_err("unregistered op");
        let (KernelError::Mlir { message: m1, .. }, KernelError::Mlir { message: m2, .. }) = (&first, &second) else {
            panic!("MLIR errors expected: {first:?} / {second:?}");
        };
        assert!(m1.contains("block with no terminator"), "{m1}");
        assert!(m2.contains("unregistered dialect"), "{m2}");
        assert!(!m2.contains("block with no terminator"), "the second error repeats the first's diagnostics:\n{m2}");
    }

    #[test]
    fn a_missing_assembly_is_an_error() {
        assert!(assembly_of("#gpu.object<bin = \"x\">").is_err());
    }
}
