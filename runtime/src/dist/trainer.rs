//! This process's rank of an SPMD training graph or SPMD artifact, its collectives over a
//! [`TcpComm`].
//!
//! Every rank reads the whole global batch (same data, same seed) and trains on its part of it
//! ([`rank_batch`], shared with the simulated mesh), starting from its shard of the single-rank
//! initialization: a run of N processes computes what the simulated mesh of N ranks computes.

use std::sync::Arc;

use titan_ir::interp::Tensor;
use titan_ir::{Graph, Mesh};

use super::TcpComm;
use super::rendezvous::ProcessGroup;
use crate::RuntimeError;
use crate::artifact::Artifact;
use crate::backend::cpu_graph::RankContext;
use crate::backend::cuda::{CudaArtifactTrainer, CudaRankSetup};
use crate::backend::sim_mesh::{is_seq_parallel, rank_batch};
use crate::backend::{CpuArtifactTrainer, CpuTrainer, ShardedStates, StateLayout, StepMetrics, Trainer, graph_state_layout};
use crate::data::Batch;

/// One rank of a multi-process mesh run on the CPU.
pub struct ProcessMeshTrainer<'g> {
    mesh: Mesh,
    coords: [usize; 3],
    group: Arc<ProcessGroup>,
    /// A [`CpuTrainer`] (graph) or [`CpuArtifactTrainer`] (artifact) of this rank.
    trainer: Box<dyn Trainer + 'g>,
    local_batch: usize,
    seq_parallel: bool,
    /// Every state's name, placement and per-rank shape (for checkpoints).
    layout: Vec<StateLayout>,
}

impl<'g> ProcessMeshTrainer<'g> {
    /// Prepare rank `group.rank()` of the mesh `graph`'s meta names (its size must be the
    /// group's).
    pub fn new(graph: &'g Graph, seed: u64, group: Arc<ProcessGroup>) -> Result<ProcessMeshTrainer<'g>, RuntimeError> {
        let mesh = Mesh::from_graph(graph)
            .map_err(RuntimeError::Graph)?
            .ok_or_else(|| RuntimeError::Graph("the graph's meta names no device mesh (world_size); a multi-process run needs an SPMD graph".into()))?;
        let comm = Arc::new(TcpComm::new(Arc::clone(&group), mesh)?);
        let coords = comm.coords_of_rank();
        let trainer = CpuTrainer::with_rank(graph, seed, Some(RankContext { mesh, coords, comm }))?;
        let local_batch = trainer.batch_size();
        let layout = graph_state_layout(graph)?;
        Ok(ProcessMeshTrainer { mesh, coords, group, trainer: Box::new(trainer), local_batch, seq_parallel: is_seq_parallel(graph, mesh), layout })
    }

    /// Prepare rank `group.rank()` of an SPMD artifact (the mesh its `graph.ir` meta names,
    /// checked against the manifest's): the artifact's one schedule on the cpu backend, its
    /// `collective` steps over the TCP process group.
    pub fn for_artifact(artifact: &'g Artifact, seed: u64, group: Arc<ProcessGroup>) -> Result<ProcessMeshTrainer<'g>, RuntimeError> {
        let graph = &artifact.graph;
        let mesh = Mesh::from_graph(graph).map_err(RuntimeError::Graph)?.filter(|m| m.world_size() > 1).ok_or_else(|| {
            RuntimeError::Backend("the artifact has no device mesh; a multi-process run needs an SPMD artifact (`titanc build --tp/--dp-shard ...`)".into())
        })?;
        let comm = Arc::new(TcpComm::new(Arc::clone(&group), mesh)?);
        let coords = comm.coords_of_rank();
        let trainer = CpuArtifactTrainer::with_rank(artifact, seed, Some(RankContext { mesh, coords, comm }))?;
        let local_batch = Trainer::batch_size(&trainer);
        let layout = artifact.state_layout()?;
        Ok(ProcessMeshTrainer { mesh, coords, group, trainer: Box::new(trainer), local_batch, seq_parallel: is_seq_parallel(graph, mesh), layout })
    }

    /// Prepare rank `group.rank()` of an SPMD artifact on GPU `device` (`LOCAL_RANK`): the
    /// artifact's one schedule on the cuda backend, its `collective` steps through NCCL (the
    /// communicators are created from the unique id rank 0 sent at the rendezvous).
    pub fn for_cuda_artifact(
        artifact: &'g Artifact,
        seed: u64,
        group: Arc<ProcessGroup>,
        device: usize,
        step_timeout: std::time::Duration,
    ) -> Result<ProcessMeshTrainer<'g>, RuntimeError> {
        let graph = &artifact.graph;
        let mesh = Mesh::from_graph(graph).map_err(RuntimeError::Graph)?.filter(|m| m.world_size() > 1).ok_or_else(|| {
            RuntimeError::Backend("the artifact has no device mesh; a multi-process run needs an SPMD artifact (`titanc build --tp/--dp-shard ...`)".into())
        })?;
        if group.world_size() != mesh.world_size() as usize {
            return Err(RuntimeError::Backend(format!("the run has {} processes but the mesh has {} ranks", group.world_size(), mesh.world_size())));
        }
        let coords = mesh.coords(group.rank());
        let setup = CudaRankSetup { group: &group, mesh, device, step_timeout };
        let trainer = CudaArtifactTrainer::with_rank(artifact, seed, Some(setup))?;
        let local_batch = Trainer::batch_size(&trainer);
        let layout = artifact.state_layout()?;
        Ok(ProcessMeshTrainer { mesh, coords, group, trainer: Box::new(trainer), local_batch, seq_parallel: is_seq_parallel(graph, mesh), layout })
    }

    pub fn mesh(&self) -> Mesh {
        self.mesh
    }

    pub fn group(&self) -> &Arc<ProcessGroup> {
        &self.group
    }

    /// Run this rank's part of one step of the global `batch`. A failure is reported to the
    /// other ranks, whose next collective then fails naming this rank.
    pub fn step(&mut self, batch: &Batch) -> Result<StepMetrics, RuntimeError> {
        let out =
            rank_batch(self.mesh, self.coords, batch, self.local_batch, self.trainer.seq_len(), self.seq_parallel).and_then(|local| self.trainer.step(&local));
        match out {
            Ok(mut m) => {
                m.tokens_per_s *= f64::from(self.mesh.dp());
                Ok(m)
            }
            Err(e) => {
                self.group.abort(&e.to_string());
                Err(e)
            }
        }
    }
}

impl Trainer for ProcessMeshTrainer<'_> {
    fn step(&mut self, batch: &Batch) -> Result<StepMetrics, RuntimeError> {
        ProcessMeshTrainer::step(self, batch)
    }

    /// This rank's part of `batch` through the eval step, whose loss is all-reduced over the
    /// mesh inside it (every rank returns the same value). A failure is reported to the other
    /// ranks, as in [`ProcessMeshTrainer::step`].
    fn eval_loss(&mut self, batch: &Batch) -> Result<f64, RuntimeError> {
        let out = rank_batch(self.mesh, self.coords, batch, self.local_batch, self.trainer.seq_len(), self.seq_parallel)
            .and_then(|local| self.trainer.eval_loss(&local));
        if let Err(e) = &out {
            self.group.abort(&e.to_string());
        }
        out
    }

    fn batch_size(&self) -> usize {
        self.local_batch * self.mesh.dp() as usize
    }

    fn seq_len(&self) -> usize {
        self.trainer.seq_len()
    }

    fn vocab_size(&self) -> usize {
        self.trainer.vocab_size()
    }

    fn steps_done(&self) -> u64 {
        self.trainer.steps_done()
    }

    fn states(&self) -> Result<Vec<(String, Tensor<f32>)>, RuntimeError> {
        Err(RuntimeError::Backend(
            "this process holds one rank's shards; a multi-process run writes and reads checkpoints rank by rank (`checkpoint::save`), not whole states".into(),
        ))
    }

    fn set_steps_done(&mut self, steps: u64) -> Result<(), RuntimeError> {
        self.trainer.set_steps_done(steps)
    }

    fn enable_profile(&mut self) -> Result<(), RuntimeError> {
        self.trainer.enable_profile()
    }

    fn profile_report(&self, full: bool) -> Option<String> {
        self.trainer.profile_report(full)
    }

    fn step_trace(&self) -> Option<Vec<titan_ir::artifact::timeline::Span>> {
        self.trainer.step_trace()
    }

    fn reports_grad_norm(&self) -> bool {
        self.trainer.reports_grad_norm()
    }

    fn sharded(&self) -> Option<&dyn ShardedStates> {
        Some(self)
    }

    fn sharded_mut(&mut self) -> Option<&mut dyn ShardedStates> {
        Some(self)
    }
}

/// This process's rank: its shards through the backend's own `states`/`set_state` (the CPU
/// trainers' arenas, the GPU's buffers), the barrier over the process group.
impl ShardedStates for ProcessMeshTrainer<'_> {
    fn mesh(&self) -> Mesh {
        self.mesh
    }

    fn held_ranks(&self) -> Vec<usize> {
        vec![self.group.rank()]
    }

    fn layout(&self) -> Result<Vec<StateLayout>, RuntimeError> {
        Ok(self.layout.clone())
    }

    fn rank_state(&self, rank: usize, name: &str) -> Result<Tensor<f32>, RuntimeError> {
        self.own(rank)?;
        self.trainer.state(name)
    }

    fn set_rank_state(&mut self, rank: usize, name: &str, values: &[f32]) -> Result<(), RuntimeError> {
        self.own(rank)?;
        self.trainer.set_state(name, values)
    }

    fn barrier(&self) -> Result<(), RuntimeError> {
        Ok(self.group.barrier()?)
    }
}

impl ProcessMeshTrainer<'_> {
    /// Only this process's rank is here.
    fn own(&self, rank: usize) -> Result<(), RuntimeError> {
        if rank != self.group.rank() {
            return Err(RuntimeError::Backend(format!("invariant: rank {} holds the states of no other rank ({rank})", self.group.rank())));
        }
        Ok(())
    }
}
