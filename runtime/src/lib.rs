//! The runtime: loads a training step and executes it. For now the CPU backend runs the
//! training-step graph on the reference interpreter; the artifact loader and the CUDA backend
//! come with later issues.
//!
//! **Architecture Invariant:** this crate never depends on `titan-passes`, `titan-kernels` or MLIR.

pub mod cpu;
pub mod data;
pub mod init;

pub use cpu::{CpuTrainer, StepMetrics};
pub use data::{BUNDLED_CORPUS, Batch, Batcher, byte_tokens};

/// Why a run could not proceed.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("{0}")]
    Graph(String),
    #[error("data: {0}")]
    Data(String),
    #[error(transparent)]
    Interp(#[from] titan_ir::interp::InterpError),
}

/// Format one step's metrics as the per-step log line.
pub fn format_step(m: &StepMetrics) -> String {
    format!("step {:>5} | loss {:>8.4} | grad_norm {:>8.4} | lr {:.3e} | {:>9.0} tok/s", m.step, m.loss, m.grad_norm, m.lr, m.tokens_per_s)
}
