//! The runtime: loads a training step and executes it. The main path is an artifact directory
//! (`titanc build`): [`Artifact::load`] reads and checks it and [`CpuArtifactTrainer`] executes
//! its schedule over its memory plan on the CPU reference interpreter. Graph mode
//! ([`CpuTrainer`]) runs an unfused training graph `.ir` whole, the reference both are compared
//! against. `backend::cuda` runs the same schedule on one GPU (cudarc: driver, cuBLASLt for GEMMs,
//! a CUDA graph per step after warm-up); it refuses artifacts with kernels that have no GPU code.
//!
//! **Architecture Invariant:** this crate never depends on `titan-passes`, `titan-kernels` or MLIR.

pub mod artifact;
pub mod backend;
pub mod checkpoint;
pub mod cli;
pub mod data;
pub mod dist;
pub mod init;
pub mod log;
pub mod manifest_check;
pub mod memory_fit;
pub mod nonfinite;

pub use artifact::{Artifact, KNOWN_TARGETS, format_bytes};
pub use backend::{ArtifactMeshTrainer, CpuArtifactTrainer, CpuTrainer, MeshTrainer, StepMetrics, Trainer};
pub use data::{BUNDLED_CORPUS, Batch, Batcher, DataFormat, byte_tokens};
pub use log::{LogContext, format_step, format_step_with};

/// Why a run could not proceed.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("{0}")]
    Graph(String),
    #[error("data: {0}")]
    Data(String),
    /// The backend cannot run this artifact here (too little memory, a multi-rank schedule).
    #[error("{0}")]
    Backend(String),
    #[error(transparent)]
    Artifact(#[from] titan_ir::artifact::ArtifactError),
    #[error(transparent)]
    Interp(#[from] titan_ir::interp::InterpError),
    /// A multi-process run could not start or a rank failed.
    #[error(transparent)]
    Dist(#[from] dist::DistError),
}
