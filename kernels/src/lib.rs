//! Kernel codegen: lowers the op groups the fusion pass outlines (`kernel` node bodies) to MLIR's
//! GPU dialect and, through melior and the NVVM pipeline, to sm_90a PTX. No GPU is needed.
//!
//! Kernel ABI: one global pointer per body argument (in order), then one per body output (in
//! order), then the workspace pointer when `workspace_bytes > 0`. Tensors are row-major and
//! contiguous in their IR dtype (rank-0 values are one-element buffers); every buffer is aligned to
//! at least `min(16, largest power of two dividing its byte size)`. The workspace is zero when the
//! kernel starts and the kernel leaves it zero. Arithmetic is f32; every bf16/f16 op result is
//! rounded to its dtype where the reference interpreter rounds it.

mod attention;
mod attention_bwd;
mod emit;
mod fused;
mod gather;
mod math;
mod optimizer;
mod pipeline;
mod ptxas;
mod scatter;
pub mod switches;
mod values;
mod warp_spec;

use titan_ir::artifact::{Launch, Prologue};
use titan_ir::{BlockId, Graph, KernelKind};

pub use ptxas::{Assembled, CUBIN_FLAGS, PtxasReport, assemble_cubin, assemble_cubin_with, find_ptxas, ptxas_check};

/// Streaming multiprocessors of the GPUs grids are sized for (H100 SXM and H200: 132). Kernels
/// that loop over their work (grid-stride) launch a whole number of resident waves of it.
pub(crate) const SMS: u64 = 132;

/// A generated kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct CompiledKernel {
    /// The PTX entry (the kernel name with characters PTX does not allow replaced by `_`).
    pub entry: String,
    pub ptx: String,
    /// The `gpu.module` before lowering, for snapshots and debugging.
    pub mlir: String,
    pub launch: Launch,
    /// A first phase launched before `entry` with the same arguments.
    pub prologue: Option<Prologue>,
    /// A last phase launched after `entry` with the same arguments.
    pub epilogue: Option<Prologue>,
    /// Zeroed scratch the kernel needs; passed as the last pointer.
    pub workspace_bytes: u64,
    /// The kernel writes every workspace byte before reading it: no zeroing needed, none left.
    pub workspace_scratch: bool,
    /// Two launches on the same inputs write the same bits (false: floating-point sums in
    /// arrival order, as the five-product attention backward's dQ).
    pub deterministic: bool,
}

/// Why a kernel could not be generated.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The body is valid IR but has a pattern this code generator does not handle (yet).
    #[error("kernel `{kernel}` ({kind}): {message}")]
    Unsupported { kernel: String, kind: &'static str, message: String },
    /// The body does not match what its kind promises (a fusion bug).
    #[error("kernel `{kernel}` ({kind}) has an invalid body: {message}")]
    InvalidBody { kernel: String, kind: &'static str, message: String },
    /// MLIR rejected the generated module or its lowering failed (a code generator bug).
    #[error("kernel codegen bug, the MLIR {stage} step failed (report it with the kernel's body): {message}")]
    Mlir { stage: String, message: String },
    /// `ptxas` is missing or rejected the PTX.
    #[error("{0}")]
    Ptxas(String),
}

/// What a generator produces before lowering.
pub(crate) struct Generated {
    pub(crate) mlir: String,
    pub(crate) block: u32,
    pub(crate) grid: u32,
    /// Dynamic shared memory per block.
    pub(crate) shared_bytes: u32,
    /// A first phase: (entry suffix, grid, block, dynamic shared bytes) of a second `gpu.func`
    /// of the module, named `<entry><suffix>`.
    pub(crate) prologue: Option<(&'static str, u32, u32, u32)>,
    /// A last phase, as `prologue`, launched after the entry.
    pub(crate) epilogue: Option<(&'static str, u32, u32, u32)>,
    pub(crate) workspace_bytes: u64,
    pub(crate) workspace_scratch: bool,
    pub(crate) deterministic: bool,
}

impl Generated {
    /// One launch, no dynamic shared memory, a zeroed workspace of `workspace_bytes`.
    pub(crate) fn new(mlir: String, block: u32, grid: u32, workspace_bytes: u64) -> Generated {
        Generated { mlir, block, grid, shared_bytes: 0, prologue: None, epilogue: None, workspace_bytes, workspace_scratch: false, deterministic: true }
    }
}

/// Internal generator errors, given the kernel's name and kind by [`compile_kernel`].
#[derive(Debug)]
pub(crate) enum GenError {
    Unsupported(String),
    Invalid(String),
}

pub(crate) type GenResult<T> = Result<T, GenError>;

pub(crate) fn unsupported<T>(msg: impl Into<String>) -> GenResult<T> {
    Err(GenError::Unsupported(msg.into()))
}

pub(crate) fn invalid<T>(msg: impl Into<String>) -> GenResult<T> {
    Err(GenError::Invalid(msg.into()))
}

/// The PTX entry name for a kernel name: `[A-Za-z0-9_]`, not starting with a digit.
pub fn entry_name(name: &str) -> String {
    let mut s: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect();
    if s.is_empty() || s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert_str(0, "k_");
    }
    s
}

/// Generate the kernel for `body` (a block of `graph`) of kind `kind`. `None` for `gemm`, which
/// runs on cuBLASLt.
pub fn compile_kernel(graph: &Graph, body: BlockId, kind: KernelKind, name: &str) -> Result<Option<CompiledKernel>, KernelError> {
    compile_kernel_cached(graph, body, kind, name, &Lowered::default())
}

/// The symbol a kernel is generated and lowered under before it gets its own entry name (a
/// textual rename of the MLIR and PTX: every symbol of a module is the entry or the entry and a
/// suffix, and nothing else in them contains this string).
const PLACEHOLDER: &str = "titan__entry";

/// The PTX of the modules one build has lowered, by their MLIR text (generated under
/// [`PLACEHOLDER`]). Kernels that generate the same module, as the eval step's forward kernels
/// and the training step's do, are lowered once (or, on threads racing for it, a few times, all
/// giving the same PTX); lowering (MLIR -> LLVM -> PTX) is nearly all of a kernel's code
/// generation time. Shared by the code generator's threads.
#[derive(Debug, Default)]
pub struct Lowered {
    ptx: std::sync::Mutex<std::collections::HashMap<String, String>>,
}

impl Lowered {
    /// Modules lowered so far (distinct MLIR texts).
    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.map().is_empty()
    }

    fn map(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, String>> {
        // A panic while holding the lock cannot leave the map half-written (one insert).
        self.ptx.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// [`compile_kernel`], reusing the PTX of a module `lowered` already holds.
pub fn compile_kernel_cached(graph: &Graph, body: BlockId, kind: KernelKind, name: &str, lowered: &Lowered) -> Result<Option<CompiledKernel>, KernelError> {
    let kind_name = kind.name();
    let wrap = |e: GenError| match e {
        GenError::Unsupported(message) => KernelError::Unsupported { kernel: name.to_string(), kind: kind_name, message },
        GenError::Invalid(message) => KernelError::InvalidBody { kernel: name.to_string(), kind: kind_name, message },
    };
    let Some(region) = graph.blocks.get(body.index()) else {
        return Err(wrap(GenError::Invalid(format!("body block #{} does not exist", body.0))));
    };
    let generated = match kind {
        KernelKind::Gemm => return Ok(None),
        KernelKind::Attention => attention::generate(graph, region, PLACEHOLDER),
        KernelKind::AttentionBwd => attention_bwd::generate(graph, region, PLACEHOLDER),
        KernelKind::Fused => fused::generate(graph, region, PLACEHOLDER),
        KernelKind::Gather => gather::generate(graph, region, PLACEHOLDER),
        KernelKind::ScatterAdd => scatter::generate(graph, region, PLACEHOLDER),
        KernelKind::Optimizer => optimizer::generate(graph, region, PLACEHOLDER),
    }
    .map_err(wrap)?;
    lower(entry_name(name), generated, lowered).map(Some)
}

/// Lower a generated module to PTX (or take the PTX `lowered` has for it) and name its entry.
fn lower(entry: String, generated: Generated, lowered: &Lowered) -> Result<CompiledKernel, KernelError> {
    let named = |text: &str| text.replace(PLACEHOLDER, &entry);
    let known = lowered.map().get(&generated.mlir).map(|ptx| named(ptx));
    let ptx = match known {
        Some(ptx) => ptx,
        None => {
            let ptx = pipeline::to_ptx(&generated.mlir).map_err(|e| match e {
                KernelError::Mlir { stage, message } => KernelError::Mlir { stage, message: named(&message) },
                other => other,
            })?;
            let out = named(&ptx);
            lowered.map().insert(generated.mlir.clone(), ptx);
            out
        }
    };
    let phase = |(suffix, grid, block, shared_bytes): (&str, u32, u32, u32)| Prologue {
        entry: format!("{entry}{suffix}"),
        launch: Launch { grid: [grid, 1, 1], block: [block, 1, 1], shared_bytes },
    };
    let prologue = generated.prologue.map(phase);
    let epilogue = generated.epilogue.map(phase);
    Ok(CompiledKernel {
        mlir: named(&generated.mlir),
        ptx,
        entry,
        launch: Launch { grid: [generated.grid, 1, 1], block: [generated.block, 1, 1], shared_bytes: generated.shared_bytes },
        prologue,
        epilogue,
        workspace_bytes: generated.workspace_bytes,
        workspace_scratch: generated.workspace_scratch,
        deterministic: generated.deterministic,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_names_are_ptx_identifiers() {
        assert_eq!(entry_name("layer.k3"), "layer_k3");
        assert_eq!(entry_name("3x"), "k_3x");
        assert_eq!(entry_name(""), "k_");
        assert_eq!(entry_name("main.k12_rmsnorm"), "main_k12_rmsnorm");
    }
}
