//! The CUDA backend: executes an artifact's schedule on one GPU with the same semantics as
//! [`CpuArtifactTrainer`](super::CpuArtifactTrainer), the reference it is tested against.
//!
//! * **Memory.** One `cuMemAlloc` per arena at the planned size; every buffer is its arena's
//!   base plus its offset. Activations and gradients start as NaN bytes (`0xff`), so a kernel
//!   that reads what nothing wrote shows in the loss. Each kernel with `workspace_bytes` gets
//!   its workspace once, zeroed (the kernels leave it zeroed).
//! * **Kernels.** Every PTX file is loaded once at start (one module and function per kernel,
//!   the entry name checked); GEMMs run through cuBLASLt ([`gemm`]) with an algorithm chosen
//!   once per GEMM for the alignment its operands have in the plan. A kernel without PTX (a
//!   body whose pattern has no generator) makes the backend refuse the artifact at load: no
//!   CPU fallback inside a GPU run.
//! * **Schedule.** Loops are unrolled at load into a flat list of launches, copies and memsets
//!   with resolved device pointers (layer slices, carry ping-pong and a loop's `prefetch`
//!   steps, one iteration ahead, exactly as the CPU backend: `titan_ir::artifact::loop_runs`). The first [`WARMUP_STEPS`] steps run it eagerly; the step is then captured into
//!   a CUDA graph once and replayed. Tokens, targets and the step counter are copied into their
//!   fixed input buffers before each step; `loss`, `grad_norm` and `lr` are read back after it.
//! * **Parameters** start from the same values as the CPU backend (the chunks of
//!   [`crate::init`], the same encoding): worker threads draw, encode and copy chunk after
//!   chunk, so no host copy of a whole state exists. States initialized to zeros (the AdamW
//!   moments) are a device memset.
//! * **Start-up and memory.** [`CudaArtifactTrainer::startup`] times the start-up phases; the
//!   measured peak memory is `cuMemGetInfo`'s used bytes above those used before the first
//!   allocation, maxed over the points where it is read (after initialization and after every
//!   step, when the stream is idle: every buffer of a step is preallocated, so nothing is freed
//!   within it). It includes the arenas, the kernel workspaces, the cuBLASLt workspace and
//!   handle, the loaded modules, the CUDA graph once captured, and anything another process
//!   allocates on the same GPU meanwhile.
//!
//! [`KernelRunner`] launches one kernel of an artifact on operands it allocates itself: the
//! kernel-by-kernel differential tests and per-kernel timings use it.
//!
//! Where each part lives: `module.rs` loads the kernels and GEMM plans and launches them,
//! `autotune.rs` checks GEMM operands and picks (and caches) each GEMM's algorithm, `unroll.rs`
//! flattens the schedule into device operations, `trainer.rs` is [`CudaArtifactTrainer`],
//! `kernel_runner.rs` is [`KernelRunner`]; `driver.rs` wraps the driver API, `gemm.rs`
//! cuBLASLt, `collective.rs` plans collective steps as NCCL calls and `comm_profile.rs` reports
//! their `--profile` times.

pub mod collective;
pub mod comm_profile;
pub mod driver;
pub mod gemm;

mod autotune;
mod energy;
mod kernel_runner;
mod module;
mod nvml;
mod trainer;
mod unroll;

use titan_ir::artifact::Arena;

use self::driver::CudaError;
use crate::RuntimeError;

pub use self::kernel_runner::{KernelRun, KernelRunner, Operand};
pub use self::module::check_gpu_code;
pub use self::trainer::{CudaArtifactTrainer, CudaRankSetup};

/// Steps run eagerly before the step is captured into a CUDA graph.
pub const WARMUP_STEPS: u64 = 2;

const ARENAS: [Arena; 4] = [Arena::Inputs, Arena::Params, Arena::OptimizerState, Arena::Activations];

/// The byte an arena starts as: NaN (`0xff`) for activations and gradients, so a kernel that
/// reads what nothing wrote shows it; zeros elsewhere.
fn arena_fill(a: Arena) -> u8 {
    if a == Arena::Activations { 0xff } else { 0 }
}

fn slot(a: Arena) -> usize {
    match a {
        Arena::Inputs => 0,
        Arena::Params => 1,
        Arena::OptimizerState => 2,
        Arena::Activations => 3,
    }
}

impl From<CudaError> for RuntimeError {
    fn from(e: CudaError) -> RuntimeError {
        RuntimeError::Backend(e.to_string())
    }
}

fn bad(message: String) -> RuntimeError {
    RuntimeError::Artifact(titan_ir::artifact::ArtifactError::Invalid(message))
}
