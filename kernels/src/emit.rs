//! A typed builder of MLIR text for one `gpu.func`: SSA values carry their types, so every op
//! prints its own type signature and mismatches are caught in Rust (debug assertions) rather than
//! by the MLIR parser. Constants are hoisted to the entry block and deduplicated.

use std::collections::HashMap;
use std::fmt::Write as _;

/// An element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Elem {
    I1,
    /// PTX's `.b16` registers (packed fp8 pairs); not a tensor dtype.
    I16,
    I32,
    I64,
    Index,
    BF16,
    F16,
    F32,
    F64,
    /// fp8 storage (`f8e4m3`, `f8e5m2`): one byte, an `i8` in MLIR; arithmetic widens it to f32.
    F8E4M3,
    F8E5M2,
}

impl Elem {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Elem::I1 => "i1",
            Elem::I16 => "i16",
            Elem::I32 => "i32",
            Elem::I64 => "i64",
            Elem::Index => "index",
            Elem::BF16 => "bf16",
            Elem::F16 => "f16",
            Elem::F32 => "f32",
            Elem::F64 => "f64",
            Elem::F8E4M3 | Elem::F8E5M2 => "i8",
        }
    }

    pub(crate) fn is_float(self) -> bool {
        matches!(self, Elem::BF16 | Elem::F16 | Elem::F32 | Elem::F64)
    }

    /// Bytes in device memory.
    pub(crate) fn bytes(self) -> u32 {
        match self {
            Elem::I1 | Elem::F8E4M3 | Elem::F8E5M2 => 1,
            Elem::BF16 | Elem::F16 | Elem::I16 => 2,
            Elem::I32 | Elem::F32 => 4,
            Elem::I64 | Elem::Index | Elem::F64 => 8,
        }
    }
}

/// The type of an SSA value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Ty {
    S(Elem),
    /// `vector<N x elem>`, N >= 2.
    V(Elem, u32),
    /// `!llvm.ptr<addrspace>`.
    Ptr(u32),
}

pub(crate) const GLOBAL: u32 = 1;
pub(crate) const SHARED: u32 = 3;

impl Ty {
    pub(crate) fn f32() -> Ty {
        Ty::S(Elem::F32)
    }

    /// `elem` with `lanes` lanes (a scalar for one lane).
    pub(crate) fn lanes_of(elem: Elem, lanes: u32) -> Ty {
        if lanes <= 1 { Ty::S(elem) } else { Ty::V(elem, lanes) }
    }

    pub(crate) fn elem(self) -> Elem {
        match self {
            Ty::S(e) | Ty::V(e, _) => e,
            Ty::Ptr(_) => Elem::I64,
        }
    }

    pub(crate) fn lanes(self) -> u32 {
        match self {
            Ty::V(_, n) => n,
            _ => 1,
        }
    }

    /// The same shape with another element type.
    pub(crate) fn with_elem(self, e: Elem) -> Ty {
        Ty::lanes_of(e, self.lanes())
    }

    pub(crate) fn mlir(self) -> String {
        match self {
            Ty::S(e) => e.name().to_string(),
            Ty::V(e, n) => format!("vector<{n}x{}>", e.name()),
            Ty::Ptr(a) => format!("!llvm.ptr<{a}>"),
        }
    }

    /// LLVM intrinsic suffix: `f32`, `v8f32`.
    pub(crate) fn intr_suffix(self) -> String {
        match self {
            Ty::S(e) => e.name().to_string(),
            Ty::V(e, n) => format!("v{n}{}", e.name()),
            Ty::Ptr(_) => "p".to_string(),
        }
    }
}

/// An SSA value of the function being built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Val {
    id: u32,
    pub(crate) ty: Ty,
}

impl std::fmt::Display for Val {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "%v{}", self.id)
    }
}

/// Float comparison predicates (`arith.cmpf`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum FCmp {
    Oeq,
    Olt,
    Ole,
    Oge,
    Uno,
}

/// Integer comparison predicates (`arith.cmpi`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum ICmp {
    Eq,
    Ne,
    Slt,
    Sgt,
    Sge,
    Uge,
}

/// Formats a float so MLIR parses back exactly `x` (as f64; f32 values are exact in f64).
fn float_literal(x: f64, e: Elem) -> String {
    if x.is_finite() {
        let s = format!("{x:?}");
        let s = if s.contains('.') {
            s
        } else if let Some(pos) = s.find('e') {
            format!("{}.0{}", &s[..pos], &s[pos..])
        } else {
            format!("{s}.0")
        };
        // `1.0e-5` and `100.0` are both valid MLIR float literals.
        s
    } else {
        // Non-finite values print as their bit pattern.
        match e {
            Elem::F64 => format!("0x{:016X}", x.to_bits()),
            Elem::F16 => format!(
                "0x{:04X}",
                if x.is_nan() {
                    0x7E00u16
                } else if x > 0.0 {
                    0x7C00
                } else {
                    0xFC00
                }
            ),
            Elem::BF16 => format!("0x{:04X}", ((x as f32).to_bits() >> 16) as u16 | if x.is_nan() { 0x40 } else { 0 }),
            _ => format!("0x{:08X}", (x as f32).to_bits()),
        }
    }
}

/// One `gpu.func` under construction.
pub(crate) struct Func {
    next: u32,
    params: Vec<Val>,
    consts: String,
    const_map: HashMap<(String, Ty), Val>,
    body: String,
    indent: usize,
    /// Module-level globals (shared memory, constant tables).
    globals: Vec<String>,
    global_names: HashMap<String, ()>,
    /// Extra `gpu.func` attributes (`nvvm.minctasm = 4 : i32`).
    attrs: Vec<String>,
}

impl Func {
    /// A function taking `n_params` global pointers.
    pub(crate) fn new(n_params: usize) -> Func {
        let mut f = Func {
            next: 0,
            params: Vec::new(),
            consts: String::new(),
            const_map: HashMap::new(),
            body: String::new(),
            indent: 3,
            globals: Vec::new(),
            global_names: HashMap::new(),
            attrs: Vec::new(),
        };
        for _ in 0..n_params {
            let v = f.fresh(Ty::Ptr(GLOBAL));
            f.params.push(v);
        }
        f
    }

    pub(crate) fn param(&self, i: usize) -> Val {
        self.params[i]
    }

    fn fresh(&mut self, ty: Ty) -> Val {
        let v = Val { id: self.next, ty };
        self.next += 1;
        v
    }

    fn line(&mut self, s: &str) {
        for _ in 0..self.indent {
            self.body.push_str("  ");
        }
        self.body.push_str(s);
        self.body.push('\n');
    }

    /// Emit `%r = <text> ` with a fresh result of type `ty`.
    fn op(&mut self, ty: Ty, text: &str) -> Val {
        let r = self.fresh(ty);
        self.line(&format!("{r} = {text}"));
        r
    }

    // ---- constants ----

    fn constant(&mut self, literal: String, ty: Ty) -> Val {
        if let Some(v) = self.const_map.get(&(literal.clone(), ty)) {
            return *v;
        }
        let v = self.fresh(ty);
        let text = match ty {
            Ty::V(..) => format!("      {v} = arith.constant dense<{literal}> : {}\n", ty.mlir()),
            // `true`/`false` are i1 literals; MLIR rejects a type after them.
            Ty::S(Elem::I1) => format!("      {v} = arith.constant {literal}\n"),
            _ => format!("      {v} = arith.constant {literal} : {}\n", ty.mlir()),
        };
        self.consts.push_str(&text);
        self.const_map.insert((literal, ty), v);
        v
    }

    /// A float constant of type `ty` (scalar or splat vector of f32/f64/...).
    pub(crate) fn cf(&mut self, x: f64, ty: Ty) -> Val {
        debug_assert!(ty.elem().is_float());
        let lit = float_literal(x, ty.elem());
        self.constant(lit, ty)
    }

    pub(crate) fn f32c(&mut self, x: f32) -> Val {
        self.cf(f64::from(x), Ty::f32())
    }

    pub(crate) fn f64c(&mut self, x: f64) -> Val {
        self.cf(x, Ty::S(Elem::F64))
    }

    /// An integer constant of type `ty`.
    pub(crate) fn ci(&mut self, x: i64, ty: Ty) -> Val {
        debug_assert!(!ty.elem().is_float());
        let lit = if ty.elem() == Elem::I1 { if x != 0 { "true".to_string() } else { "false".to_string() } } else { x.to_string() };
        self.constant(lit, ty)
    }

    pub(crate) fn i32c(&mut self, x: i64) -> Val {
        self.ci(x, Ty::S(Elem::I32))
    }

    pub(crate) fn i64c(&mut self, x: i64) -> Val {
        self.ci(x, Ty::S(Elem::I64))
    }

    // ---- arith ----

    fn bin(&mut self, op: &str, a: Val, b: Val) -> Val {
        debug_assert_eq!(a.ty, b.ty, "{op} operand types differ");
        self.op(a.ty, &format!("arith.{op} {a}, {b} : {}", a.ty.mlir()))
    }

    pub(crate) fn addf(&mut self, a: Val, b: Val) -> Val {
        self.bin("addf", a, b)
    }
    pub(crate) fn subf(&mut self, a: Val, b: Val) -> Val {
        self.bin("subf", a, b)
    }
    pub(crate) fn mulf(&mut self, a: Val, b: Val) -> Val {
        self.bin("mulf", a, b)
    }
    pub(crate) fn divf(&mut self, a: Val, b: Val) -> Val {
        self.bin("divf", a, b)
    }
    /// NaN-propagating maximum (`max.NaN`).
    pub(crate) fn maximumf(&mut self, a: Val, b: Val) -> Val {
        self.bin("maximumf", a, b)
    }
    /// NaN-propagating minimum.
    pub(crate) fn minimumf(&mut self, a: Val, b: Val) -> Val {
        self.bin("minimumf", a, b)
    }
    /// IEEE maxNum: a NaN operand yields the other operand (`max.f32`; `arith.maxnumf` would
    /// become a libdevice call).
    pub(crate) fn maxnumf(&mut self, a: Val, b: Val) -> Val {
        let n = format!("llvm.maxnum.{}", a.ty.intr_suffix());
        self.intr(&n, &[a, b], a.ty)
    }
    pub(crate) fn minnumf(&mut self, a: Val, b: Val) -> Val {
        let n = format!("llvm.minnum.{}", a.ty.intr_suffix());
        self.intr(&n, &[a, b], a.ty)
    }
    pub(crate) fn negf(&mut self, a: Val) -> Val {
        self.op(a.ty, &format!("arith.negf {a} : {}", a.ty.mlir()))
    }
    pub(crate) fn addi(&mut self, a: Val, b: Val) -> Val {
        self.bin("addi", a, b)
    }
    pub(crate) fn subi(&mut self, a: Val, b: Val) -> Val {
        self.bin("subi", a, b)
    }
    pub(crate) fn muli(&mut self, a: Val, b: Val) -> Val {
        self.bin("muli", a, b)
    }
    pub(crate) fn divui(&mut self, a: Val, b: Val) -> Val {
        self.bin("divui", a, b)
    }
    pub(crate) fn remui(&mut self, a: Val, b: Val) -> Val {
        self.bin("remui", a, b)
    }
    pub(crate) fn andi(&mut self, a: Val, b: Val) -> Val {
        self.bin("andi", a, b)
    }
    pub(crate) fn ori(&mut self, a: Val, b: Val) -> Val {
        self.bin("ori", a, b)
    }
    pub(crate) fn xori(&mut self, a: Val, b: Val) -> Val {
        self.bin("xori", a, b)
    }
    pub(crate) fn shli(&mut self, a: Val, b: Val) -> Val {
        self.bin("shli", a, b)
    }
    pub(crate) fn shrsi(&mut self, a: Val, b: Val) -> Val {
        self.bin("shrsi", a, b)
    }
    pub(crate) fn shrui(&mut self, a: Val, b: Val) -> Val {
        self.bin("shrui", a, b)
    }
    pub(crate) fn minsi(&mut self, a: Val, b: Val) -> Val {
        self.bin("minsi", a, b)
    }
    pub(crate) fn maxsi(&mut self, a: Val, b: Val) -> Val {
        self.bin("maxsi", a, b)
    }

    pub(crate) fn cmpf(&mut self, p: FCmp, a: Val, b: Val) -> Val {
        debug_assert_eq!(a.ty, b.ty);
        let p = match p {
            FCmp::Oeq => "oeq",
            FCmp::Olt => "olt",
            FCmp::Ole => "ole",
            FCmp::Oge => "oge",
            FCmp::Uno => "uno",
        };
        self.op(a.ty.with_elem(Elem::I1), &format!("arith.cmpf {p}, {a}, {b} : {}", a.ty.mlir()))
    }

    pub(crate) fn cmpi(&mut self, p: ICmp, a: Val, b: Val) -> Val {
        debug_assert_eq!(a.ty, b.ty);
        let p = match p {
            ICmp::Eq => "eq",
            ICmp::Ne => "ne",
            ICmp::Slt => "slt",
            ICmp::Sgt => "sgt",
            ICmp::Sge => "sge",
            ICmp::Uge => "uge",
        };
        self.op(a.ty.with_elem(Elem::I1), &format!("arith.cmpi {p}, {a}, {b} : {}", a.ty.mlir()))
    }

    /// `c ? a : b`; `c` is i1 (uniform) or a vector of i1 matching the operands.
    pub(crate) fn select(&mut self, c: Val, a: Val, b: Val) -> Val {
        debug_assert_eq!(a.ty, b.ty);
        if c.ty == Ty::S(Elem::I1) {
            self.op(a.ty, &format!("arith.select {c}, {a}, {b} : {}", a.ty.mlir()))
        } else {
            self.op(a.ty, &format!("arith.select {c}, {a}, {b} : {}, {}", c.ty.mlir(), a.ty.mlir()))
        }
    }

    fn conv(&mut self, op: &str, a: Val, to: Elem) -> Val {
        let t = a.ty.with_elem(to);
        self.op(t, &format!("arith.{op} {a} : {} to {}", a.ty.mlir(), t.mlir()))
    }

    /// Widen a float (bf16/f16/f32 -> f32/f64); the identity for the same type.
    pub(crate) fn extf(&mut self, a: Val, to: Elem) -> Val {
        if a.ty.elem() == to { a } else { self.conv("extf", a, to) }
    }
    /// Narrow a float, rounding to nearest even.
    pub(crate) fn truncf(&mut self, a: Val, to: Elem) -> Val {
        if a.ty.elem() == to { a } else { self.conv("truncf", a, to) }
    }
    pub(crate) fn sitofp(&mut self, a: Val, to: Elem) -> Val {
        self.conv("sitofp", a, to)
    }
    pub(crate) fn fptosi(&mut self, a: Val, to: Elem) -> Val {
        self.conv("fptosi", a, to)
    }
    pub(crate) fn extsi(&mut self, a: Val, to: Elem) -> Val {
        if a.ty.elem() == to { a } else { self.conv("extsi", a, to) }
    }
    pub(crate) fn extui(&mut self, a: Val, to: Elem) -> Val {
        if a.ty.elem() == to { a } else { self.conv("extui", a, to) }
    }
    pub(crate) fn trunci(&mut self, a: Val, to: Elem) -> Val {
        if a.ty.elem() == to { a } else { self.conv("trunci", a, to) }
    }
    /// A pointer's address as an i64.
    pub(crate) fn ptr_to_i64(&mut self, p: Val) -> Val {
        self.op(Ty::S(Elem::I64), &format!("llvm.ptrtoint {p} : {} to i64", p.ty.mlir()))
    }
    pub(crate) fn bitcast(&mut self, a: Val, to: Elem) -> Val {
        self.conv("bitcast", a, to)
    }
    pub(crate) fn index_cast(&mut self, a: Val, to: Elem) -> Val {
        self.conv("index_cast", a, to)
    }

    /// A signed integer of any width as i64.
    pub(crate) fn as_i64(&mut self, a: Val) -> Val {
        match a.ty.elem() {
            Elem::I64 => a,
            Elem::Index => self.index_cast(a, Elem::I64),
            _ => self.extsi(a, Elem::I64),
        }
    }

    /// A call of an LLVM intrinsic (e.g. `llvm.fma.f32`) that the NVPTX backend lowers to one
    /// instruction; `convert-gpu-to-nvvm` would otherwise route math ops to libdevice.
    pub(crate) fn intr(&mut self, name: &str, args: &[Val], ret: Ty) -> Val {
        let a: Vec<String> = args.iter().map(|v| v.to_string()).collect();
        let t: Vec<String> = args.iter().map(|v| v.ty.mlir()).collect();
        self.op(ret, &format!("llvm.call_intrinsic \"{name}\"({}) : ({}) -> {}", a.join(", "), t.join(", "), ret.mlir()))
    }

    /// Inline PTX (`llvm.inline_asm`, no side effects): `$0` is the result, `$1..` the
    /// arguments; `constraints` as LLVM writes them (`=h,f,f`).
    pub(crate) fn inline_asm(&mut self, asm: &str, constraints: &str, args: &[Val], ret: Ty) -> Val {
        let a: Vec<String> = args.iter().map(|v| v.to_string()).collect();
        let t: Vec<String> = args.iter().map(|v| v.ty.mlir()).collect();
        self.op(ret, &format!("llvm.inline_asm \"{asm}\", \"{constraints}\" {} : ({}) -> {}", a.join(", "), t.join(", "), ret.mlir()))
    }

    /// Count leading zeros of an i32 (32 for 0).
    pub(crate) fn ctlz(&mut self, a: Val) -> Val {
        let f = self.ci(0, Ty::lanes_of(Elem::I1, 1));
        let n = format!("llvm.ctlz.{}", a.ty.intr_suffix());
        self.intr(&n, &[a, f], a.ty)
    }

    pub(crate) fn fma(&mut self, a: Val, b: Val, c: Val) -> Val {
        let n = format!("llvm.fma.{}", a.ty.intr_suffix());
        self.intr(&n, &[a, b, c], a.ty)
    }

    /// Correctly rounded square root (`sqrt.rn`).
    pub(crate) fn sqrt(&mut self, a: Val) -> Val {
        let n = format!("llvm.sqrt.{}", a.ty.intr_suffix());
        self.intr(&n, &[a], a.ty)
    }

    pub(crate) fn fabs(&mut self, a: Val) -> Val {
        let n = format!("llvm.fabs.{}", a.ty.intr_suffix());
        self.intr(&n, &[a], a.ty)
    }

    /// Round to the nearest integer, ties to even.
    pub(crate) fn rint(&mut self, a: Val) -> Val {
        let n = format!("llvm.rint.{}", a.ty.intr_suffix());
        self.intr(&n, &[a], a.ty)
    }

    // ---- vectors ----

    /// A vector with every lane `a`; `a` itself for one lane.
    pub(crate) fn splat(&mut self, a: Val, lanes: u32) -> Val {
        if lanes <= 1 {
            return a;
        }
        let t = Ty::V(a.ty.elem(), lanes);
        self.op(t, &format!("vector.broadcast {a} : {} to {}", a.ty.mlir(), t.mlir()))
    }

    /// Lane `i` of a vector (the value itself for a scalar).
    pub(crate) fn extract(&mut self, v: Val, i: u32) -> Val {
        match v.ty {
            Ty::V(e, _) => self.op(Ty::S(e), &format!("vector.extract {v}[{i}] : {} from {}", e.name(), v.ty.mlir())),
            _ => v,
        }
    }

    /// A vector of the given scalars (the scalar itself for one).
    pub(crate) fn vector_of(&mut self, xs: &[Val]) -> Val {
        if xs.len() == 1 {
            return xs[0];
        }
        let t = Ty::V(xs[0].ty.elem(), xs.len() as u32);
        let a: Vec<String> = xs.iter().map(|v| v.to_string()).collect();
        self.op(t, &format!("vector.from_elements {} : {}", a.join(", "), t.mlir()))
    }

    /// `vector.shuffle` of one vector with itself.
    pub(crate) fn permute(&mut self, v: Val, mask: &[u32]) -> Val {
        let m: Vec<String> = mask.iter().map(|i| i.to_string()).collect();
        self.op(v.ty, &format!("vector.shuffle {v}, {v} [{}] : {}, {}", m.join(", "), v.ty.mlir(), v.ty.mlir()))
    }

    // ---- memory ----

    /// `ptr + off` elements of `elem`.
    pub(crate) fn gep(&mut self, ptr: Val, off: Val, elem: Elem) -> Val {
        debug_assert_eq!(off.ty, Ty::S(Elem::I64));
        self.op(ptr.ty, &format!("llvm.getelementptr {ptr}[{off}] : ({}, i64) -> {}, {}", ptr.ty.mlir(), ptr.ty.mlir(), elem.name()))
    }

    pub(crate) fn load(&mut self, ptr: Val, ty: Ty, align: u32) -> Val {
        self.op(ty, &format!("llvm.load {ptr} {{alignment = {align} : i64}} : {} -> {}", ptr.ty.mlir(), ty.mlir()))
    }

    pub(crate) fn store(&mut self, v: Val, ptr: Val, align: u32) {
        self.line(&format!("llvm.store {v}, {ptr} {{alignment = {align} : i64}} : {}, {}", v.ty.mlir(), ptr.ty.mlir()));
    }

    /// `ptr[off]` as `ty` (vector loads read consecutive elements).
    pub(crate) fn load_at(&mut self, ptr: Val, off: Val, ty: Ty, align: u32) -> Val {
        let p = self.gep(ptr, off, ty.elem());
        self.load(p, ty, align)
    }

    pub(crate) fn store_at(&mut self, v: Val, ptr: Val, off: Val, align: u32) {
        let p = self.gep(ptr, off, v.ty.elem());
        self.store(v, p, align);
    }

    /// Declare a shared-memory array `name` of `n` elements (once per module).
    pub(crate) fn shared_array(&mut self, name: &str, elem: Elem, n: u64) -> Val {
        if self.global_names.insert(name.to_string(), ()).is_none() {
            self.globals.push(format!(
                "llvm.mlir.global internal @{name}() {{addr_space = {SHARED} : i32, alignment = 16 : i64}} : !llvm.array<{n} x {}>",
                elem.name()
            ));
        }
        self.op(Ty::Ptr(SHARED), &format!("llvm.mlir.addressof @{name} : !llvm.ptr<{SHARED}>"))
    }

    /// Declare a read-only global table of f64 values (once per module).
    pub(crate) fn const_table_f64(&mut self, name: &str, xs: &[f64]) -> Val {
        if self.global_names.insert(name.to_string(), ()).is_none() {
            let lits: Vec<String> = xs.iter().map(|&x| float_literal(x, Elem::F64)).collect();
            self.globals.push(format!(
                "llvm.mlir.global internal constant @{name}(dense<[{}]> : tensor<{}xf64>) {{addr_space = {GLOBAL} : i32}} : !llvm.array<{} x f64>",
                lits.join(", "),
                xs.len(),
                xs.len()
            ));
        }
        self.op(Ty::Ptr(GLOBAL), &format!("llvm.mlir.addressof @{name} : !llvm.ptr<{GLOBAL}>"))
    }

    /// `atomicrmw add` (relaxed, device scope) on an i32; returns the old value.
    pub(crate) fn atomic_add_i32(&mut self, ptr: Val, v: Val) -> Val {
        self.op(Ty::S(Elem::I32), &format!("llvm.atomicrmw add {ptr}, {v} monotonic : {}, i32", ptr.ty.mlir()))
    }

    /// `cp.async.bulk.prefetch.L2`: start bringing `bytes` (a multiple of 16, `ptr` 16-byte
    /// aligned) of global memory into L2 without waiting for it or using registers.
    pub(crate) fn prefetch_l2(&mut self, ptr: Val, bytes: Val) {
        debug_assert_eq!(bytes.ty, Ty::S(Elem::I32));
        self.line(&format!(
            "llvm.inline_asm has_side_effects \"cp.async.bulk.prefetch.L2.global [$0], $1;\", \"l,r\" {ptr}, {bytes} : ({}, i32) -> ()",
            ptr.ty.mlir()
        ));
    }

    /// A device-scope acquire-release fence (`fence.acq_rel.gpu`).
    pub(crate) fn fence(&mut self) {
        self.line("llvm.fence syncscope(\"device\") acq_rel");
    }

    // ---- gpu ----

    fn gpu_id(&mut self, what: &str) -> Val {
        let i = self.op(Ty::S(Elem::Index), &format!("gpu.{what} x"));
        self.index_cast(i, Elem::I32)
    }

    pub(crate) fn thread_id(&mut self) -> Val {
        self.gpu_id("thread_id")
    }

    pub(crate) fn block_id(&mut self) -> Val {
        self.gpu_id("block_id")
    }

    pub(crate) fn barrier(&mut self) {
        self.line("gpu.barrier");
    }

    /// `shfl.sync.bfly` over the full warp.
    pub(crate) fn shuffle_xor(&mut self, v: Val, offset: u32) -> Val {
        let o = self.i32c(i64::from(offset));
        let w = self.i32c(32);
        let r = self.fresh(v.ty);
        let ok = self.fresh(Ty::S(Elem::I1));
        self.line(&format!("{r}, {ok} = gpu.shuffle xor {v}, {o}, {w} : {}", v.ty.mlir()));
        r
    }

    /// `shfl.sync.up` over the full warp (lanes below `offset` get their own value back).
    pub(crate) fn shuffle_up(&mut self, v: Val, offset: u32) -> Val {
        let o = self.i32c(i64::from(offset));
        let w = self.i32c(32);
        let r = self.fresh(v.ty);
        let ok = self.fresh(Ty::S(Elem::I1));
        self.line(&format!("{r}, {ok} = gpu.shuffle up {v}, {o}, {w} : {}", v.ty.mlir()));
        r
    }

    // ---- structured control flow ----

    /// `scf.for iv = lo to hi step st` (all i64) carrying `inits`; `body` gets the induction
    /// variable and the carried values and returns the next ones.
    pub(crate) fn for_loop(&mut self, lo: Val, hi: Val, st: Val, inits: &[Val], body: impl FnOnce(&mut Func, Val, &[Val]) -> Vec<Val>) -> Vec<Val> {
        let iv = self.fresh(lo.ty);
        let args: Vec<Val> = inits.iter().map(|v| self.fresh(v.ty)).collect();
        let results: Vec<Val> = inits.iter().map(|v| self.fresh(v.ty)).collect();
        let mut head = String::new();
        if !results.is_empty() {
            let r: Vec<String> = results.iter().map(|v| v.to_string()).collect();
            let _ = write!(head, "{} = ", r.join(", "));
        }
        let _ = write!(head, "scf.for {iv} = {lo} to {hi} step {st}");
        if !inits.is_empty() {
            let pairs: Vec<String> = args.iter().zip(inits).map(|(a, i)| format!("{a} = {i}")).collect();
            let tys: Vec<String> = inits.iter().map(|v| v.ty.mlir()).collect();
            let _ = write!(head, " iter_args({}) -> ({})", pairs.join(", "), tys.join(", "));
        }
        let _ = write!(head, " : {} {{", lo.ty.mlir());
        self.line(&head);
        self.indent += 1;
        let next = body(self, iv, &args);
        debug_assert_eq!(next.len(), inits.len());
        self.yield_(&next);
        self.indent -= 1;
        self.line("}");
        results
    }

    /// [`Func::for_loop`] with a fallible body; on error the text is abandoned by the caller.
    pub(crate) fn try_for_loop<E>(
        &mut self,
        lo: Val,
        hi: Val,
        st: Val,
        inits: &[Val],
        body: impl FnOnce(&mut Func, Val, &[Val]) -> Result<Vec<Val>, E>,
    ) -> Result<Vec<Val>, E> {
        let mut err = None;
        let out = self.for_loop(lo, hi, st, inits, |f, iv, args| match body(f, iv, args) {
            Ok(next) => next,
            Err(e) => {
                err = Some(e);
                args.to_vec()
            }
        });
        err.map_or(Ok(out), Err)
    }

    /// [`Func::if_then`] with a fallible body.
    pub(crate) fn try_if_then<E>(&mut self, cond: Val, then: impl FnOnce(&mut Func) -> Result<(), E>) -> Result<(), E> {
        let mut res = Ok(());
        self.if_then(cond, |f| res = then(f));
        res
    }

    /// [`Func::switch_values`] with fallible cases.
    pub(crate) fn try_switch_values<E>(
        &mut self,
        sel: Val,
        n: usize,
        passthrough: &[Val],
        mut case: impl FnMut(&mut Func, usize) -> Result<Vec<Val>, E>,
    ) -> Result<Vec<Val>, E> {
        let mut err = None;
        let out = self.switch_values(sel, n, passthrough, |f, k| {
            if err.is_some() {
                return passthrough.to_vec();
            }
            match case(f, k) {
                Ok(v) => v,
                Err(e) => {
                    err = Some(e);
                    passthrough.to_vec()
                }
            }
        });
        err.map_or(Ok(out), Err)
    }

    fn yield_(&mut self, vals: &[Val]) {
        if vals.is_empty() {
            self.line("scf.yield");
        } else {
            let v: Vec<String> = vals.iter().map(|v| v.to_string()).collect();
            let t: Vec<String> = vals.iter().map(|v| v.ty.mlir()).collect();
            self.line(&format!("scf.yield {} : {}", v.join(", "), t.join(", ")));
        }
    }

    /// `scf.if cond` with results of types `tys`, both branches given.
    pub(crate) fn if_else(&mut self, cond: Val, tys: &[Ty], then: impl FnOnce(&mut Func) -> Vec<Val>, els: impl FnOnce(&mut Func) -> Vec<Val>) -> Vec<Val> {
        let results: Vec<Val> = tys.iter().map(|&t| self.fresh(t)).collect();
        let mut head = String::new();
        if !results.is_empty() {
            let r: Vec<String> = results.iter().map(|v| v.to_string()).collect();
            let _ = write!(head, "{} = ", r.join(", "));
        }
        let _ = write!(head, "scf.if {cond}");
        if !tys.is_empty() {
            let t: Vec<String> = tys.iter().map(|t| t.mlir()).collect();
            let _ = write!(head, " -> ({})", t.join(", "));
        }
        head.push_str(" {");
        self.line(&head);
        self.indent += 1;
        let a = then(self);
        self.yield_(&a);
        self.indent -= 1;
        self.line("} else {");
        self.indent += 1;
        let b = els(self);
        self.yield_(&b);
        self.indent -= 1;
        self.line("}");
        results
    }

    /// `scf.if cond { then }` without results.
    pub(crate) fn if_then(&mut self, cond: Val, then: impl FnOnce(&mut Func)) {
        self.line(&format!("scf.if {cond} {{"));
        self.indent += 1;
        then(self);
        self.indent -= 1;
        self.line("}");
    }

    /// `scf.index_switch` on an i32 selector with cases `0..n` yielding values of the types of
    /// `passthrough`, which the default case yields unchanged.
    pub(crate) fn switch_values(&mut self, sel: Val, n: usize, passthrough: &[Val], mut case: impl FnMut(&mut Func, usize) -> Vec<Val>) -> Vec<Val> {
        let idx = self.index_cast(sel, Elem::Index);
        let results: Vec<Val> = passthrough.iter().map(|v| self.fresh(v.ty)).collect();
        let mut head = String::new();
        if !results.is_empty() {
            let r: Vec<String> = results.iter().map(|v| v.to_string()).collect();
            let t: Vec<String> = results.iter().map(|v| v.ty.mlir()).collect();
            let _ = write!(head, "{} = scf.index_switch {idx} -> {}", r.join(", "), t.join(", "));
        } else {
            let _ = write!(head, "scf.index_switch {idx}");
        }
        self.line(&head);
        for k in 0..n {
            self.line(&format!("case {k} {{"));
            self.indent += 1;
            let out = case(self, k);
            self.yield_(&out);
            self.indent -= 1;
            self.line("}");
        }
        self.line("default {");
        self.indent += 1;
        self.yield_(passthrough);
        self.indent -= 1;
        self.line("}");
        results
    }

    /// Ask ptxas for at least `n` resident CTAs per SM (`.minnctapersm`): without it, ptxas may
    /// cap registers to reach the occupancy shared memory allows, and spill.
    pub(crate) fn min_ctas_per_sm(&mut self, n: u32) {
        self.attrs.push(format!("nvvm.minctasm = {n} : i32"));
    }

    /// The whole module: `gpu.module @titan` holding this function as kernel `entry`.
    pub(crate) fn finish(self, entry: &str, block: u32, grid: u32) -> String {
        let mut s = String::with_capacity(self.body.len() + self.consts.len() + 1024);
        s.push_str("module attributes {gpu.container_module} {\n  gpu.module @titan {\n");
        for g in &self.globals {
            let _ = writeln!(s, "    {g}");
        }
        let params: Vec<String> = self.params.iter().map(|p| format!("{p}: {}", p.ty.mlir())).collect();
        let _ = writeln!(
            s,
            "    gpu.func @{entry}({}) kernel attributes {{known_block_size = array<i32: {block}, 1, 1>, known_grid_size = array<i32: {grid}, 1, 1>{}}} {{",
            params.join(", "),
            self.attrs.iter().map(|a| format!(", {a}")).collect::<String>()
        );
        s.push_str(&self.consts);
        s.push_str(&self.body);
        s.push_str("      gpu.return\n    }\n  }\n}\n");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_literals_parse_back_exactly() {
        assert_eq!(float_literal(1.0, Elem::F32), "1.0");
        assert_eq!(float_literal(1e-5, Elem::F64), "1.0e-5");
        assert_eq!(float_literal(f64::from(0.1f32), Elem::F32), "0.10000000149011612");
        assert_eq!(float_literal(f64::INFINITY, Elem::F32), "0x7F800000");
        assert_eq!(float_literal(f64::NEG_INFINITY, Elem::F64), "0xFFF0000000000000");
        assert_eq!(float_literal(3e38, Elem::F32), "3.0e38");
    }

    #[test]
    fn constants_are_hoisted_and_shared() {
        let mut f = Func::new(1);
        let a = f.f32c(2.0);
        let b = f.f32c(2.0);
        assert_eq!(a, b);
        let c = f.mulf(a, b);
        let p = f.param(0);
        let z = f.i64c(0);
        f.store_at(c, p, z, 4);
        let text = f.finish("k", 32, 1);
        assert_eq!(text.matches("arith.constant 2.0 : f32").count(), 1);
        assert!(text.contains("gpu.func @k(%v0: !llvm.ptr<1>) kernel"));
    }
}
