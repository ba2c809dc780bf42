//! The CPU simulated mesh: an SPMD training graph ([`MeshTrainer`], every rank a
//! [`CpuTrainer`]) or an SPMD artifact ([`ArtifactMeshTrainer`], every rank a
//! [`CpuArtifactTrainer`] running the artifact's one schedule) run by N ranks, one thread each,
//! each on its shard of the data and of the parameters. Collectives meet at a shared
//! rendezvous; each rank reduces the contributions itself in rank order, so results are
//! deterministic and identical on every rank.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use titan_ir::interp::{Communicator, Tensor, concat};
use titan_ir::{Graph, Mesh, MeshDim, Placement};

use crate::RuntimeError;
use crate::artifact::Artifact;
use crate::backend::cpu_graph::RankContext;
use crate::backend::{CpuArtifactTrainer, CpuTrainer, ShardedStates, StateLayout, StepMetrics, Trainer, graph_state_layout, state_placement};
use crate::checkpoint;
use crate::data::Batch;

/// How long a rank waits for the others at a collective before the run is declared stuck.
const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(120);

/// One collective call in progress: the contributions so far and how many ranks have read it.
#[derive(Default)]
struct Meeting {
    parts: Vec<Option<Vec<f64>>>,
    readers: usize,
}

/// A collective call: (mesh dim, the group's coordinates with that dim zeroed, call number).
type MeetingKey = (usize, [usize; 3], u64);

/// The rendezvous shared by every rank of the mesh.
struct Rendezvous {
    mesh: Mesh,
    /// The calls in progress, and whether a rank failed (every wait then ends).
    meetings: Mutex<(HashMap<MeetingKey, Meeting>, bool)>,
    arrived: Condvar,
}

impl Rendezvous {
    /// Wake every waiting rank and make further collectives fail (a rank has failed).
    fn abort(&self) {
        if let Ok(mut g) = self.meetings.lock() {
            g.1 = true;
        }
        self.arrived.notify_all();
    }
}

/// One rank's handle on the rendezvous.
struct RankComm {
    rv: Arc<Rendezvous>,
    coords: [usize; 3],
    /// Calls issued so far per mesh dim.
    calls: Mutex<[u64; 3]>,
}

impl Communicator for RankComm {
    fn sizes(&self) -> [usize; 3] {
        self.rv.mesh.sizes.map(|x| x as usize)
    }

    fn coords(&self) -> [usize; 3] {
        self.coords
    }

    fn exchange(&self, mesh_dim: MeshDim, data: Vec<f64>) -> Result<Vec<Vec<f64>>, String> {
        let m = mesh_dim.index();
        let n = self.rv.mesh.sizes[m] as usize;
        let seq = {
            let mut c = self.calls.lock().map_err(|_| "a rank panicked".to_string())?;
            c[m] += 1;
            c[m]
        };
        let mut group = self.coords;
        group[m] = 0;
        let key = (m, group, seq);
        let me = self.coords[m];
        let mut guard = self.rv.meetings.lock().map_err(|_| "a rank panicked".to_string())?;
        {
            let meeting = guard.0.entry(key).or_default();
            if meeting.parts.is_empty() {
                meeting.parts = vec![None; n];
            }
            meeting.parts[me] = Some(data);
        }
        self.rv.arrived.notify_all();
        loop {
            if guard.1 {
                return Err("another rank failed; collective abandoned".into());
            }
            let ready = guard.0.get(&key).is_some_and(|mt| mt.parts.iter().all(Option::is_some));
            if ready {
                break;
            }
            let (g, timeout) = self.rv.arrived.wait_timeout(guard, COLLECTIVE_TIMEOUT).map_err(|_| "a rank panicked".to_string())?;
            guard = g;
            if timeout.timed_out() {
                return Err(format!("collective #{seq} on {mesh_dim} timed out waiting for the other ranks (ranks issued different collectives)"));
            }
        }
        let meeting = guard.0.get_mut(&key).ok_or("meeting vanished")?;
        let parts: Vec<Vec<f64>> = meeting.parts.iter().map(|p| p.clone().unwrap_or_default()).collect();
        meeting.readers += 1;
        if meeting.readers == n {
            guard.0.remove(&key);
        }
        Ok(parts)
    }
}

/// Whether `graph` shards `tokens` along `seq` on `tp` (sequence parallelism).
pub fn is_seq_parallel(graph: &Graph, mesh: Mesh) -> bool {
    graph
        .main
        .find("tokens")
        .is_some_and(|v| matches!(graph.main.value(v).placement.get(MeshDim::Tp.index()), Some(Placement::Shard(1))) && mesh.size(MeshDim::Tp) > 1)
}

/// The part of the global `batch` the rank at `coords` trains on: data-parallel index
/// `i = dp_replicate coord * dp_shard + dp_shard coord` takes rows `i * b .. (i + 1) * b`
/// (`b = local_batch`), and with sequence parallelism its `tp` slice of each row's tokens.
/// Shared by the simulated mesh and the multi-process run, so both feed every rank alike.
pub fn rank_batch(mesh: Mesh, coords: [usize; 3], batch: &Batch, local_batch: usize, seq: usize, seq_parallel: bool) -> Result<Batch, RuntimeError> {
    let rows = local_batch * seq;
    if batch.tokens.len() != rows * mesh.dp() as usize || batch.targets.len() != batch.tokens.len() {
        return Err(RuntimeError::Data(format!(
            "a batch has {} tokens, the mesh step takes global batch {} x seq {seq}",
            batch.tokens.len(),
            local_batch * mesh.dp() as usize
        )));
    }
    let c = coords;
    let i = c[0] * mesh.sizes[1] as usize + c[1];
    let targets = batch.targets[i * rows..(i + 1) * rows].to_vec();
    let mut tokens = batch.tokens[i * rows..(i + 1) * rows].to_vec();
    if seq_parallel {
        // `tokens` is `Shard(1)` on `tp`: this rank's slice of every row.
        let (tp, t) = (mesh.sizes[2] as usize, c[2]);
        let part = seq / tp;
        tokens = tokens.chunks(seq).flat_map(|row| row[t * part..(t + 1) * part].to_vec()).collect();
    }
    Ok(Batch { tokens, targets })
}

/// Runs an SPMD training graph on a simulated mesh of `world_size` CPU ranks.
pub struct MeshTrainer<'g> {
    mesh: Mesh,
    rv: Arc<Rendezvous>,
    ranks: Vec<CpuTrainer<'g>>,
    /// Per-rank batch rows.
    local_batch: usize,
    /// Whether `tokens` is sharded along `seq` on `tp` (sequence parallelism).
    seq_parallel: bool,
    layout: Vec<StateLayout>,
}

impl<'g> MeshTrainer<'g> {
    /// Prepare every rank of the mesh `graph`'s meta names.
    pub fn new(graph: &'g Graph, seed: u64) -> Result<MeshTrainer<'g>, RuntimeError> {
        let mesh = Mesh::from_graph(graph)
            .map_err(RuntimeError::Graph)?
            .ok_or_else(|| RuntimeError::Graph("the graph's meta names no device mesh (world_size); run it with the single-rank graph mode".into()))?;
        let (rv, contexts) = rank_contexts(mesh);
        let ranks = contexts.into_iter().map(|c| CpuTrainer::with_rank(graph, seed, Some(c))).collect::<Result<Vec<_>, _>>()?;
        let local_batch = ranks.first().map_or(0, CpuTrainer::batch_size);
        let seq_parallel = is_seq_parallel(graph, mesh);
        Ok(MeshTrainer { mesh, rv, ranks, local_batch, seq_parallel, layout: graph_state_layout(graph)? })
    }

    pub fn mesh(&self) -> Mesh {
        self.mesh
    }

    /// The global batch: per-rank rows times `dp_replicate x dp_shard`.
    pub fn global_batch(&self) -> usize {
        self.local_batch * self.mesh.dp() as usize
    }

    /// Run one step: rank `r` with data-parallel index `i` takes rows `i * b .. (i + 1) * b`
    /// of the global batch.
    pub fn step(&mut self, batch: &Batch) -> Result<StepMetrics, RuntimeError> {
        mesh_throughput(self.mesh, on_every_rank(self.mesh, &self.rv, &mut self.ranks, batch, self.local_batch, self.seq_parallel, |t, b| t.step(b)))
    }

    /// Every state buffer, gathered from its shards into the single-rank tensor.
    pub fn gathered_states(&self) -> Result<Vec<(String, Tensor<f32>)>, RuntimeError> {
        let first = self.ranks.first().ok_or_else(|| RuntimeError::Backend("the mesh has no ranks".into()))?;
        let graph = first.graph();
        let state = |r: usize, k: usize| self.ranks.get(r).and_then(|t| t.states().nth(k)).map(|(_, t)| t.clone());
        let mut out = Vec::new();
        for (k, (p, _)) in first.states().enumerate() {
            let sharded = sharded_dims(self.mesh, &state_placement(graph, &p.name));
            let full = gather(self.mesh, &state, k, [0; 3], &sharded).map_err(|e| RuntimeError::Backend(format!("gathering `{}`: {e}", p.name)))?;
            out.push((p.name.clone(), full));
        }
        Ok(out)
    }
}

/// State `k` reassembled over the mesh dims in `sharded` (`(mesh dim, tensor dim)`, on
/// distinct tensor dims), starting from the rank at `coords`; `state(r, k)` is rank `r`'s shard.
fn gather(
    mesh: Mesh,
    state: &dyn Fn(usize, usize) -> Option<Tensor<f32>>,
    k: usize,
    coords: [usize; 3],
    sharded: &[(usize, u32)],
) -> Result<Tensor<f32>, String> {
    let Some((&(m, d), rest)) = sharded.split_first() else {
        let r = (0..mesh.world_size() as usize).find(|&r| mesh.coords(r) == coords).ok_or("rank not found")?;
        return state(r, k).ok_or_else(|| "the ranks disagree on their states".to_string());
    };
    let mut parts = Vec::new();
    for c in 0..mesh.sizes[m] as usize {
        let mut at = coords;
        at[m] = c;
        parts.push(gather(mesh, state, k, at, rest)?);
    }
    concat(&parts, d as usize)
}

/// The (mesh dim, tensor dim) pairs along which a state with `placement` is sharded on `mesh`.
fn sharded_dims(mesh: Mesh, placement: &[Placement]) -> Vec<(usize, u32)> {
    placement
        .iter()
        .enumerate()
        .filter_map(|(m, pl)| match pl {
            Placement::Shard(d) if mesh.sizes[m] > 1 => Some((m, *d)),
            _ => None,
        })
        .collect()
}

/// Rank 0's metrics of a step run on every rank, with the throughput of the whole mesh.
fn mesh_throughput(mesh: Mesh, m: Result<StepMetrics, RuntimeError>) -> Result<StepMetrics, RuntimeError> {
    let mut m = m?;
    m.tokens_per_s *= f64::from(mesh.dp());
    Ok(m)
}

/// Run `f` on every rank, each on its part of `batch` (see [`rank_batch`]), one thread each;
/// rank 0's result.
fn on_every_rank<T: Trainer + Send, R: Send>(
    mesh: Mesh,
    rv: &Rendezvous,
    ranks: &mut [T],
    batch: &Batch,
    local_batch: usize,
    seq_parallel: bool,
    f: impl Fn(&mut T, &Batch) -> Result<R, RuntimeError> + Sync,
) -> Result<R, RuntimeError> {
    let seq = ranks.first().map_or(0, |t| t.seq_len());
    let locals = (0..ranks.len()).map(|r| rank_batch(mesh, mesh.coords(r), batch, local_batch, seq, seq_parallel)).collect::<Result<Vec<_>, _>>()?;
    let f = &f;
    let results: Vec<Result<R, RuntimeError>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter_mut()
            .zip(locals)
            .map(|(trainer, local)| {
                s.spawn(move || {
                    let out = f(trainer, &local);
                    if out.is_err() {
                        rv.abort();
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(RuntimeError::Backend("a rank thread panicked".into())))).collect()
    });
    let mut first = None;
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(m) if r == 0 => first = Some(m),
            Ok(_) => {}
            Err(e) => return Err(RuntimeError::Backend(format!("rank {r}: {e}"))),
        }
    }
    first.ok_or_else(|| RuntimeError::Backend("the mesh has no ranks".into()))
}

/// The shared rendezvous of `mesh` and one rank context per rank, in rank order.
fn rank_contexts(mesh: Mesh) -> (Arc<Rendezvous>, Vec<RankContext>) {
    let rv = Arc::new(Rendezvous { mesh, meetings: Mutex::new((HashMap::new(), false)), arrived: Condvar::new() });
    let ranks = (0..mesh.world_size() as usize)
        .map(|r| {
            let coords = mesh.coords(r);
            let comm: Arc<dyn Communicator> = Arc::new(RankComm { rv: Arc::clone(&rv), coords, calls: Mutex::new([0; 3]) });
            RankContext { mesh, coords, comm }
        })
        .collect();
    (rv, ranks)
}

/// Runs an SPMD artifact (a mesh in its manifest) on a simulated mesh of CPU ranks: every rank
/// a [`CpuArtifactTrainer`] executing the artifact's one schedule over its own arenas, its
/// `collective` steps meeting at the shared rendezvous. Ranks, data and parameter shards are
/// laid out exactly as in [`MeshTrainer`], so the artifact run tracks the graph run and the
/// single-rank runs.
pub struct ArtifactMeshTrainer<'a> {
    artifact: &'a Artifact,
    mesh: Mesh,
    rv: Arc<Rendezvous>,
    ranks: Vec<CpuArtifactTrainer<'a>>,
    local_batch: usize,
    seq_parallel: bool,
    layout: Vec<StateLayout>,
}

impl<'a> ArtifactMeshTrainer<'a> {
    /// Prepare every rank of the mesh the artifact's `graph.ir` meta names (checked against the
    /// manifest's mesh by each rank).
    pub fn new(artifact: &'a Artifact, seed: u64) -> Result<ArtifactMeshTrainer<'a>, RuntimeError> {
        let graph = &artifact.graph;
        let mesh = Mesh::from_graph(graph)
            .map_err(RuntimeError::Graph)?
            .filter(|m| m.world_size() > 1)
            .ok_or_else(|| RuntimeError::Backend("the artifact's graph.ir names no device mesh; run it with the single-device cpu backend".into()))?;
        let (rv, contexts) = rank_contexts(mesh);
        let ranks = contexts.into_iter().map(|c| CpuArtifactTrainer::with_rank(artifact, seed, Some(c))).collect::<Result<Vec<_>, _>>()?;
        let local_batch = ranks.first().map_or(0, |r| r.batch_size());
        let seq_parallel = is_seq_parallel(graph, mesh);
        Ok(ArtifactMeshTrainer { artifact, mesh, rv, ranks, local_batch, seq_parallel, layout: artifact.state_layout()? })
    }

    pub fn mesh(&self) -> Mesh {
        self.mesh
    }

    /// The global batch: per-rank rows times `dp_replicate x dp_shard`.
    pub fn global_batch(&self) -> usize {
        self.local_batch * self.mesh.dp() as usize
    }

    /// Run one step: rank `r` with data-parallel index `i` takes rows `i * b .. (i + 1) * b`
    /// of the global batch.
    pub fn step(&mut self, batch: &Batch) -> Result<StepMetrics, RuntimeError> {
        mesh_throughput(self.mesh, on_every_rank(self.mesh, &self.rv, &mut self.ranks, batch, self.local_batch, self.seq_parallel, |t, b| t.step(b)))
    }

    /// Turn the NaN poisoning of every rank's activation and gradient arenas on or off.
    pub fn set_poison(&mut self, on: bool) {
        for r in &mut self.ranks {
            r.set_poison(on);
        }
    }

    /// Every state buffer, gathered from its shards into the single-rank tensor.
    pub fn gathered_states(&self) -> Result<Vec<(String, Tensor<f32>)>, RuntimeError> {
        let per_rank = self.ranks.iter().map(CpuArtifactTrainer::states).collect::<Result<Vec<_>, _>>()?;
        let first = per_rank.first().ok_or_else(|| RuntimeError::Backend("the mesh has no ranks".into()))?;
        let state = |r: usize, k: usize| per_rank.get(r).and_then(|s| s.get(k)).map(|(_, t)| t.clone());
        let mut out = Vec::new();
        for (k, (name, _)) in first.iter().enumerate() {
            let sharded = sharded_dims(self.mesh, &state_placement(&self.artifact.graph, name));
            let full = gather(self.mesh, &state, k, [0; 3], &sharded).map_err(|e| RuntimeError::Backend(format!("gathering `{name}`: {e}")))?;
            out.push((name.clone(), full));
        }
        Ok(out)
    }
}

impl Trainer for ArtifactMeshTrainer<'_> {
    fn step(&mut self, batch: &Batch) -> Result<StepMetrics, RuntimeError> {
        ArtifactMeshTrainer::step(self, batch)
    }

    /// The eval step on every rank (sharded like the training step, the loss all-reduced in it):
    /// rank 0's loss, which every rank holds.
    fn eval_loss(&mut self, batch: &Batch) -> Result<f64, RuntimeError> {
        on_every_rank(self.mesh, &self.rv, &mut self.ranks, batch, self.local_batch, self.seq_parallel, |t, b| t.eval_loss(b))
    }

    fn batch_size(&self) -> usize {
        self.global_batch()
    }

    fn seq_len(&self) -> usize {
        self.ranks.first().map_or(0, |r| r.seq_len())
    }

    fn vocab_size(&self) -> usize {
        self.ranks.first().map_or(0, |r| r.vocab_size())
    }

    fn steps_done(&self) -> u64 {
        self.ranks.first().map_or(0, |r| r.steps_done())
    }

    fn states(&self) -> Result<Vec<(String, Tensor<f32>)>, RuntimeError> {
        self.gathered_states()
    }

    fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), RuntimeError> {
        scatter_state(self, name, values)
    }

    fn set_steps_done(&mut self, steps: u64) -> Result<(), RuntimeError> {
        for r in &mut self.ranks {
            r.set_steps_done(steps);
        }
        Ok(())
    }

    fn sharded(&self) -> Option<&dyn ShardedStates> {
        Some(self)
    }

    fn sharded_mut(&mut self) -> Option<&mut dyn ShardedStates> {
        Some(self)
    }

    fn flops_per_token(&self) -> Option<u64> {
        Some(self.artifact.manifest.training.flops_per_token).filter(|&f| f > 0)
    }

    fn reports_grad_norm(&self) -> bool {
        self.ranks.first().is_none_or(|r| r.reports_grad_norm())
    }
}

impl Trainer for MeshTrainer<'_> {
    fn step(&mut self, batch: &Batch) -> Result<StepMetrics, RuntimeError> {
        MeshTrainer::step(self, batch)
    }

    fn batch_size(&self) -> usize {
        self.global_batch()
    }

    fn seq_len(&self) -> usize {
        self.ranks.first().map_or(0, CpuTrainer::seq_len)
    }

    fn vocab_size(&self) -> usize {
        self.ranks.first().map_or(0, CpuTrainer::vocab_size)
    }

    fn reports_grad_norm(&self) -> bool {
        self.ranks.first().is_none_or(Trainer::reports_grad_norm)
    }

    fn steps_done(&self) -> u64 {
        self.ranks.first().map_or(0, CpuTrainer::steps_done)
    }

    fn states(&self) -> Result<Vec<(String, Tensor<f32>)>, RuntimeError> {
        self.gathered_states()
    }

    fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), RuntimeError> {
        scatter_state(self, name, values)
    }

    fn set_steps_done(&mut self, steps: u64) -> Result<(), RuntimeError> {
        for r in &mut self.ranks {
            r.set_steps_done(steps);
        }
        Ok(())
    }

    fn sharded(&self) -> Option<&dyn ShardedStates> {
        Some(self)
    }

    fn sharded_mut(&mut self) -> Option<&mut dyn ShardedStates> {
        Some(self)
    }
}

/// Overwrite every rank's shard of state `name` with its part of the full tensor `values`.
fn scatter_state(view: &mut dyn ShardedStates, name: &str, values: &[f32]) -> Result<(), RuntimeError> {
    let mesh = view.mesh();
    let s = view.layout()?.into_iter().find(|s| s.name == name).ok_or_else(|| RuntimeError::Backend(format!("the model has no state named `{name}`")))?;
    for rank in view.held_ranks() {
        let b = checkpoint::shard_box(name, &s.shape, &s.placement, mesh, mesh.coords(rank)).map_err(|e| RuntimeError::Backend(e.to_string()))?;
        let shard = checkpoint::shard_values(&b, values).map_err(|e| RuntimeError::Backend(e.to_string()))?;
        view.set_rank_state(rank, name, &shard)?;
    }
    Ok(())
}

impl ShardedStates for MeshTrainer<'_> {
    fn mesh(&self) -> Mesh {
        self.mesh
    }

    fn held_ranks(&self) -> Vec<usize> {
        (0..self.ranks.len()).collect()
    }

    fn layout(&self) -> Result<Vec<StateLayout>, RuntimeError> {
        Ok(self.layout.clone())
    }

    fn rank_state(&self, rank: usize, name: &str) -> Result<Tensor<f32>, RuntimeError> {
        Trainer::state(self.ranks.get(rank).ok_or_else(|| RuntimeError::Backend(format!("the mesh has no rank {rank}")))?, name)
    }

    fn set_rank_state(&mut self, rank: usize, name: &str, values: &[f32]) -> Result<(), RuntimeError> {
        self.ranks.get_mut(rank).ok_or_else(|| RuntimeError::Backend(format!("the mesh has no rank {rank}")))?.set_state(name, values)
    }

    fn barrier(&self) -> Result<(), RuntimeError> {
        Ok(())
    }
}

impl ShardedStates for ArtifactMeshTrainer<'_> {
    fn mesh(&self) -> Mesh {
        self.mesh
    }

    fn held_ranks(&self) -> Vec<usize> {
        (0..self.ranks.len()).collect()
    }

    fn layout(&self) -> Result<Vec<StateLayout>, RuntimeError> {
        Ok(self.layout.clone())
    }

    fn rank_state(&self, rank: usize, name: &str) -> Result<Tensor<f32>, RuntimeError> {
        self.ranks.get(rank).ok_or_else(|| RuntimeError::Backend(format!("the mesh has no rank {rank}")))?.state(name)
    }

    fn set_rank_state(&mut self, rank: usize, name: &str, values: &[f32]) -> Result<(), RuntimeError> {
        self.ranks.get_mut(rank).ok_or_else(|| RuntimeError::Backend(format!("the mesh has no rank {rank}")))?.set_state(name, values)
    }

    fn barrier(&self) -> Result<(), RuntimeError> {
        Ok(())
    }
}
