//! Execution backends. Two run on the CPU reference interpreter:
//! [`CpuArtifactTrainer`] executes an artifact's schedule over its memory plan (the reference for
//! the CUDA backend), [`CpuTrainer`] runs an unfused training graph whole (the reference the
//! artifact is compared against). [`cuda::CudaArtifactTrainer`] executes the same schedule on
//! one GPU (PTX kernels, cuBLASLt GEMMs, a CUDA graph per step). [`MeshTrainer`] and
//! [`ArtifactMeshTrainer`] run an SPMD graph or artifact on a simulated mesh of CPU ranks.

pub mod codec;
pub mod cpu_artifact;
pub mod cpu_graph;
pub mod cuda;
pub mod profile;
pub mod sim_mesh;

pub use cpu_artifact::CpuArtifactTrainer;
pub use cpu_graph::{CpuTrainer, RankContext};
pub use sim_mesh::{ArtifactMeshTrainer, MeshTrainer};

use titan_ir::interp::Tensor;
use titan_ir::{Graph, Mesh, Placement};

use crate::RuntimeError;
use crate::data::Batch;

/// The metrics of one training step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepMetrics {
    pub step: u64,
    pub loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub tokens_per_s: f64,
    /// The predicted peak device memory when running an artifact: the memory plan's, plus the
    /// library workspaces on a GPU.
    pub peak_bytes: Option<u64>,
    /// The measured peak device memory so far (the CUDA backend: `cuMemGetInfo` used bytes
    /// above what was used before its first allocation, maxed over steps); `None` elsewhere.
    pub measured_peak_bytes: Option<u64>,
}

/// A backend that runs training steps and keeps the state between them.
pub trait Trainer {
    /// Run one training step on `batch`.
    fn step(&mut self, batch: &Batch) -> Result<StepMetrics, RuntimeError>;
    /// Run the eval step (forward and loss only, the state unchanged) on `batch`; its loss.
    fn eval_loss(&mut self, batch: &Batch) -> Result<f64, RuntimeError> {
        let _ = batch;
        Err(RuntimeError::Backend(
            "validation (--val-data) runs an artifact's eval step; this trainer has none (graph mode: build an artifact with `titanc build`)".into(),
        ))
    }
    fn batch_size(&self) -> usize;
    fn seq_len(&self) -> usize;
    fn vocab_size(&self) -> usize;
    /// Steps taken so far.
    fn steps_done(&self) -> u64;
    /// Every state buffer (master weights, AdamW moments) by checkpoint name (stacked ones
    /// carry `{i}`), in its dtype.
    fn states(&self) -> Result<Vec<(String, Tensor<f32>)>, RuntimeError>;
    /// The state buffer with checkpoint name `name` alone (checkpoints read one at a time, so a
    /// rank never holds a second copy of all its states).
    fn state(&self, name: &str) -> Result<Tensor<f32>, RuntimeError> {
        self.states()?
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
            .ok_or_else(|| RuntimeError::Backend(format!("the model has no state named `{name}`")))
    }
    /// Overwrite the whole state buffer with checkpoint name `name` (stacked ones carry `{i}`)
    /// with `values`, its elements in row-major order (for checkpoints).
    fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), RuntimeError> {
        let _ = values;
        Err(RuntimeError::Backend(format!("restoring state `{name}` is not supported yet on this backend; use --backend cpu")))
    }
    /// Set the number of steps taken (a resumed run continues the learning-rate schedule).
    fn set_steps_done(&mut self, steps: u64) -> Result<(), RuntimeError> {
        let _ = steps;
        Err(RuntimeError::Backend("resuming is not supported yet on this backend; use --backend cpu".into()))
    }
    /// Time every kernel of the following steps (`--profile`).
    fn enable_profile(&mut self) -> Result<(), RuntimeError> {
        Err(RuntimeError::Backend("--profile is not supported on this backend yet".into()))
    }
    /// The `--profile` report of the steps so far: all of it (`full`), or one summary line
    /// (the other ranks of a run); `None` before a counted step.
    fn profile_report(&self, full: bool) -> Option<String> {
        let _ = full;
        None
    }
    /// The measured timeline of the last profiled step (`--trace`), in the operations and names
    /// `titanc simulate` predicts; `None` where the backend does not record one, or before a
    /// profiled step.
    fn step_trace(&self) -> Option<Vec<titan_ir::artifact::timeline::Span>> {
        None
    }
    /// Model FLOPs per token for throughput and MFU, when known.
    fn flops_per_token(&self) -> Option<u64> {
        None
    }
    /// Whether [`StepMetrics::grad_norm`] is the step's gradient norm; `false` for a graph
    /// without a `grad_norm` output, whose steps report NaN.
    fn reports_grad_norm(&self) -> bool {
        true
    }
    /// The per-rank view of a trainer whose states are sharded over a device mesh (the
    /// simulated mesh, a rank of a multi-process run): checkpoints are written and read rank by
    /// rank through it. `None` for a single-device trainer, whose [`Trainer::states`] are whole.
    fn sharded(&self) -> Option<&dyn ShardedStates> {
        None
    }
    /// [`Trainer::sharded`], to restore states.
    fn sharded_mut(&mut self) -> Option<&mut dyn ShardedStates> {
        None
    }
}

/// One state as every rank of a mesh holds it: its checkpoint name, its placement on the mesh
/// and the shape of each rank's shard.
#[derive(Clone, Debug, PartialEq)]
pub struct StateLayout {
    pub name: String,
    pub placement: Vec<Placement>,
    pub shape: Vec<usize>,
}

/// The states of the mesh ranks a process holds (every rank on the simulated mesh, its own in
/// a multi-process run), for checkpoints that every rank writes and reads its own part of
/// (`checkpoint::save`, `checkpoint::resume`).
pub trait ShardedStates {
    fn mesh(&self) -> Mesh;
    /// The (global) ranks held here, in increasing order.
    fn held_ranks(&self) -> Vec<usize>;
    /// Every state's name, placement and per-rank shape (the same on every rank: SPMD).
    fn layout(&self) -> Result<Vec<StateLayout>, RuntimeError>;
    /// Rank `rank`'s shard of state `name`.
    fn rank_state(&self, rank: usize, name: &str) -> Result<Tensor<f32>, RuntimeError>;
    /// Overwrite rank `rank`'s shard of state `name` with `values` (row-major).
    fn set_rank_state(&mut self, rank: usize, name: &str, values: &[f32]) -> Result<(), RuntimeError>;
    /// Wait until every rank of the run got here; fails when one of them failed. A no-op when
    /// this process holds every rank.
    fn barrier(&self) -> Result<(), RuntimeError>;
}

/// The layout of the state arguments (master weights, moments) of `graph`'s `main`, in
/// argument order.
pub(crate) fn graph_state_layout(graph: &Graph) -> Result<Vec<StateLayout>, RuntimeError> {
    let mut out = Vec::new();
    for a in &graph.main.args {
        if let Some(p) = a.kind.param_info().filter(|p| p.compute_copy_of().is_none()) {
            let shape = graph.main.ty(a.value).resolve(&graph.dims).map_err(RuntimeError::Graph)?;
            out.push(StateLayout { name: p.name.clone(), placement: graph.main.value(a.value).placement.clone(), shape });
        }
    }
    Ok(out)
}

/// The placement of the state argument named `name` of `graph`'s `main` (empty when none).
pub(crate) fn state_placement(graph: &Graph, name: &str) -> Vec<Placement> {
    let v = graph.main.args.iter().find(|a| a.kind.param_info().is_some_and(|q| q.name == name)).map(|a| a.value);
    v.map(|v| graph.main.value(v).placement.clone()).unwrap_or_default()
}

/// The state buffer `name` must hold `have` elements to take `given` values.
pub(crate) fn check_state_len(name: &str, have: usize, given: usize) -> Result<(), RuntimeError> {
    if have != given {
        return Err(RuntimeError::Backend(format!("state `{name}` has {have} elements, {given} values were given")));
    }
    Ok(())
}

/// Check that `batch` fits a `[batch, seq]` step and a vocabulary of `vocab` entries, for a rank
/// that reads `tokens_len` tokens per step: `batch * seq`, or with sequence parallelism its slice
/// of every row (its targets are still the whole step's).
pub(crate) fn check_rank_batch(batch: &Batch, b: usize, s: usize, tokens_len: usize, vocab: usize) -> Result<(), RuntimeError> {
    let n = b * s;
    if batch.targets.len() != n {
        return Err(RuntimeError::Data(format!("a batch has {} targets, the step takes batch {b} x seq {s}", batch.targets.len())));
    }
    if batch.tokens.len() != tokens_len {
        return Err(RuntimeError::Data(if tokens_len == n {
            format!("a batch has {} tokens, the step takes batch {b} x seq {s}", batch.tokens.len())
        } else {
            format!("this rank reads {tokens_len} tokens per step (its sequence shard), {} were given", batch.tokens.len())
        }));
    }
    if let Some(&t) = batch.tokens.iter().chain(&batch.targets).find(|&&t| t < 0 || t as usize >= vocab) {
        return Err(RuntimeError::Data(format!("token id {t} is outside the vocabulary of {vocab} entries")));
    }
    Ok(())
}

/// Time spent per kernel, summed over steps (for `--profile`).
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelTime {
    pub launches: u64,
    pub seconds: f64,
}
