//! Device memory a run needs besides the memory plan's arenas: the library workspaces. The
//! compiler adds them to the predicted peak it reports, the CUDA backend to the plan's peak when
//! it checks that the run fits the free device memory; both compute them here from the manifest
//! and the constants below, so the manifest format does not change.
//!
//! Not counted: the CUDA context (created before the runtime measures its baseline and reads
//! the free memory, so it is in neither number), loaded kernel code and the captured CUDA graph
//! (a few MiB, driver-dependent).

use super::{CollectiveOp, Manifest, Step};

/// The cuBLASLt workspace every GEMM may use, allocated once by the CUDA backend (NVIDIA
/// recommends 32 MiB on Hopper).
pub const CUBLASLT_WORKSPACE_BYTES: u64 = 32 << 20;

/// Device buffers NCCL allocates for one communicator that runs collectives: an estimate,
/// `NCCL_BUFFSIZE` (4 MiB, the Simple protocol's buffer per channel and peer) times 32
/// channels (NCCL's maximum on NVLink). NCCL sizes them at run time from the topology, so the
/// real figure may be lower; counting the maximum keeps the fit check on the safe side.
pub const NCCL_BYTES_PER_COMMUNICATOR: u64 = 4 * (1 << 20) * 32;

/// The library workspaces of one rank running an artifact, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LibraryWorkspaces {
    /// [`CUBLASLT_WORKSPACE_BYTES`] (allocated whether or not the artifact has GEMMs).
    pub cublaslt: u64,
    /// The kernels' own `workspace_bytes`, each allocated once.
    pub kernels: u64,
    /// The staging buffer of the collectives gathered or scattered along an inner dim (the
    /// largest such step's full tensor; `runtime/src/backend/cuda/collective.rs`).
    pub collective_staging: u64,
    /// [`NCCL_BYTES_PER_COMMUNICATOR`] per mesh dim whose collectives communicate.
    pub nccl: u64,
}

impl LibraryWorkspaces {
    pub fn total(&self) -> u64 {
        self.cublaslt.saturating_add(self.kernels).saturating_add(self.collective_staging).saturating_add(self.nccl)
    }
}

/// The staging bytes a collective step needs on the CUDA backend: an `all_gather` whose
/// gathered dim is not the outermost (more than one row before it) receives into staging as
/// large as its output, a `reduce_scatter` whose scattered dim is not the outermost sends from
/// staging as large as its input; everything else works in place.
pub fn collective_staging_bytes(collective: CollectiveOp, dim: Option<u32>, elem_bytes: u64, in_shape: &[u64], out_shape: &[u64]) -> u64 {
    let outer = |shape: &[u64]| dim.map_or(1, |d| shape.iter().take(d as usize).product::<u64>());
    let bytes = |shape: &[u64]| shape.iter().fold(elem_bytes, |acc, &d| acc.saturating_mul(d));
    match collective {
        CollectiveOp::AllGather if outer(in_shape) != 1 => bytes(out_shape),
        CollectiveOp::ReduceScatter if outer(out_shape) != 1 => bytes(in_shape),
        _ => 0,
    }
}

/// The library workspaces of rank 0's schedule of `m`.
pub fn library_workspaces(m: &Manifest) -> LibraryWorkspaces {
    fn walk(steps: &[Step], staging: &mut u64, dims: &mut Vec<String>) {
        for s in steps {
            match s {
                Step::Loop { body, prefetch, .. } => {
                    walk(prefetch, staging, dims);
                    walk(body, staging, dims);
                }
                Step::Collective { collective, mesh_dim, dim, dtype, in_shape, out_shape, .. } => {
                    *staging = (*staging).max(collective_staging_bytes(*collective, *dim, dtype.size_bytes() as u64, in_shape, out_shape));
                    if !collective.is_rank_local() && !dims.contains(mesh_dim) {
                        dims.push(mesh_dim.clone());
                    }
                }
                _ => {}
            }
        }
    }
    let (mut staging, mut dims) = (0, Vec::new());
    if let Some(r) = m.ranks.first() {
        walk(&r.steps, &mut staging, &mut dims);
    }
    LibraryWorkspaces {
        cublaslt: CUBLASLT_WORKSPACE_BYTES,
        kernels: m.kernels.iter().map(|k| k.workspace_bytes).fold(0, u64::saturating_add),
        collective_staging: staging,
        nccl: NCCL_BYTES_PER_COMMUNICATOR * dims.len() as u64,
    }
}

/// The smallest `dp_shard` degree, doubling from `dp_shard`, at which a rank of a plan like
/// `memory` (built at `dp_shard`) would need at most `budget` bytes with `workspaces` on top:
/// an estimate that divides only the parameters and optimizer state by the degree (FSDP shards
/// them) and keeps the step arena (activations and gradients; gradients shrink with the degree
/// and activations when the batch is split over the new ranks, so this errs on the safe side). `None` when no degree up to 1024 fits: the activations alone are too large.
pub fn dp_shard_to_fit(memory: &super::MemoryPlan, dp_shard: u32, workspaces: u64, budget: u64) -> Option<u32> {
    use super::Arena;
    let arena = |a: Arena| memory.arenas.iter().find(|p| p.arena == a).map_or(0, |p| p.bytes);
    let sharded = arena(Arena::Params).saturating_add(arena(Arena::OptimizerState));
    let rest = memory.peak_bytes.saturating_sub(sharded).saturating_add(workspaces);
    let base = u64::from(dp_shard.max(1));
    let mut d = base;
    while d <= 1024 {
        if rest.saturating_add(sharded.saturating_mul(base) / d) <= budget {
            return u32::try_from(d).ok();
        }
        d *= 2;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::{Arena, ArenaPlan, MemoryPlan};

    #[test]
    fn staging_is_needed_only_for_inner_dims() {
        // all_gather along dim 0: in place; along dim 1 of [4, 8] over 2 ranks: the output.
        assert_eq!(collective_staging_bytes(CollectiveOp::AllGather, Some(0), 2, &[4, 8], &[8, 8]), 0);
        assert_eq!(collective_staging_bytes(CollectiveOp::AllGather, Some(1), 2, &[4, 8], &[4, 16]), 128);
        assert_eq!(collective_staging_bytes(CollectiveOp::ReduceScatter, Some(1), 4, &[4, 16], &[4, 8]), 256);
        assert_eq!(collective_staging_bytes(CollectiveOp::ReduceScatter, Some(0), 4, &[8, 8], &[4, 8]), 0);
        assert_eq!(collective_staging_bytes(CollectiveOp::AllReduce, None, 4, &[8, 8], &[8, 8]), 0);
    }

    #[test]
    fn dp_shard_to_fit_divides_the_sharded_arenas() {
        let gib = 1u64 << 30;
        let plan = |p: u64, o: u64, a: u64| MemoryPlan {
            arenas: vec![
                ArenaPlan { arena: Arena::Inputs, bytes: 0 },
                ArenaPlan { arena: Arena::Params, bytes: p },
                ArenaPlan { arena: Arena::OptimizerState, bytes: o },
                ArenaPlan { arena: Arena::Activations, bytes: a },
            ],
            peak_bytes: p + o + a,
            activation_bytes_unplanned: a,
        };
        // 40 + 80 GiB sharded, a 20 GiB step arena: 8 ranks give 20 + 15 = 35 GiB.
        let m = plan(40 * gib, 80 * gib, 20 * gib);
        assert_eq!(dp_shard_to_fit(&m, 1, 0, 80 * gib), Some(2));
        assert_eq!(dp_shard_to_fit(&m, 1, 0, 40 * gib), Some(8));
        assert_eq!(dp_shard_to_fit(&m, 2, 0, 40 * gib), Some(16));
        assert_eq!(dp_shard_to_fit(&m, 1, 0, 19 * gib), None);
    }
}
