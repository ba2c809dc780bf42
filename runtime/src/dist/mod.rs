//! Multi-process runs: one process per rank, launched by torchrun, Slurm (`srun`) or
//! `titan-run --nproc-per-node N`.
//!
//! - [`env`] reads the launch environment (rank, world size, the rendezvous address).
//! - [`rendezvous`] meets every rank at `MASTER_ADDR:MASTER_PORT`: rank 0 listens, checks
//!   that everyone runs the same thing and broadcasts a payload (the NCCL unique id on GPUs).
//!   Its connections stay open as the control plane ([`ProcessGroup`]): a rank that fails or
//!   whose process dies makes every other rank's next collective fail with an error naming it.
//! - [`tcp_comm`] is a [`titan_ir::interp::Communicator`] over that process group for the CPU
//!   backend (a real process group, like gloo): exchanges route through rank 0 and come back
//!   ordered by mesh coordinate, exactly as on the simulated mesh.
//! - [`trainer`] runs this process's rank of an SPMD training graph.
//! - [`launch`] is `titan-run --nproc-per-node N`: N copies of titan-run on this host.
//! - [`nccl`] creates NCCL communicators (world, then one per mesh dim) from the rendezvous
//!   (compiled, untested on multi-GPU: no such machine has run it yet).

pub mod env;
pub mod launch;
pub mod nccl;
pub mod rendezvous;
pub mod tcp_comm;
pub mod trainer;
pub mod watchdog;

pub use env::{DistEnv, Launcher};
pub use rendezvous::{FailureProbe, ProcessGroup, RendezvousOptions};
pub use tcp_comm::TcpComm;
pub use trainer::ProcessMeshTrainer;

/// Why a multi-process run could not start or continue.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// The launch variables are missing, malformed or inconsistent.
    #[error("launch environment: {0}")]
    Env(String),
    /// The ranks did not all meet, or disagree about the run.
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// A collective or barrier failed: another rank failed, exited or timed out.
    #[error("{0}")]
    Collective(String),
    /// Launching or supervising the local ranks failed.
    #[error("launch: {0}")]
    Launch(String),
}
