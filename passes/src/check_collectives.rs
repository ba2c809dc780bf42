//! `check-collectives`: the build-time collective safety check of an SPMD graph. Every rank
//! runs the same graph, so the collectives a rank issues on one communicator (the ranks that
//! differ only along one mesh dim) are the same on every rank, in the same order, exactly when
//! no collective sits under rank- or data-dependent control and every collective's group and
//! message size are static. In this IR the only control is `repeat` (a static layer count)
//! and `kernel` (a fused body); this pass checks, collecting every problem:
//!
//! - a graph with collectives names a mesh in its `meta`, and each collective's `mesh_dim`
//!   and `size` match it (also checked for the rank-local `take_shard`/`place_shard`/
//!   `ring_slice`/`ring_concat`); a `ring_shift` is a collective like the others: every rank
//!   of its communicator issues it at the same point, which is what a point-to-point ring
//!   step needs (each rank's send meets its neighbour's receive);
//! - no collective is inside a `kernel` body (fusing collectives is not supported yet);
//! - every collective's operand has a static shape (all ranks send the same number of
//!   elements);
//! - per communicator, the sequence of collectives (in program order, blocks expanded per
//!   `repeat`) is well formed: it is computed, and its length reported. A `repeat` with
//!   prefetched carries (`prefetch-next-layer`) is expanded as it runs: its prefetch nodes
//!   once before the first layer, then each layer's prefetch nodes (for the next layer, none
//!   in the last) before the layer's other nodes; its block must split into prefetch nodes
//!   and the rest (`titan_ir::prefetch`).

use crate::PassDiag;
use titan_ir::verify::{Loc, RegionRef};
use titan_ir::{Graph, Mesh, MeshDim, Op, Region};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckCollectivesStats {
    /// Collectives a rank issues per step (blocks counted once per layer).
    pub collectives: usize,
    /// Communicators (mesh dims) used.
    pub communicators: usize,
}

/// One collective call as every rank of its communicator issues it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectiveCall {
    pub mesh_dim: MeshDim,
    /// `all_gather {mesh_dim = dp_shard, dim = 0, size = 2} (node n3 in @layer)`
    pub what: String,
    pub elems: u64,
}

/// The collectives a rank issues per step, per mesh dim, in issue order.
pub fn collective_schedule(g: &Graph) -> Result<Vec<(MeshDim, Vec<CollectiveCall>)>, String> {
    schedule(g).map_err(|errors| errors.iter().map(|e| e.message.as_str()).collect::<Vec<_>>().join("; "))
}

/// [`collective_schedule`] with every problem found as a typed diagnostic.
fn schedule(g: &Graph) -> Result<Vec<(MeshDim, Vec<CollectiveCall>)>, Vec<PassDiag>> {
    let mesh = Mesh::from_graph(g).map_err(|e| vec![PassDiag::invalid(e)])?;
    let mut errors = Vec::new();
    let mut calls = Vec::new();
    walk(g, &g.main, RegionRef::Main, mesh.as_ref(), &mut calls, &mut errors, false);
    if !errors.is_empty() {
        return Err(errors);
    }
    let mut out: Vec<(MeshDim, Vec<CollectiveCall>)> = Vec::new();
    for m in MeshDim::ALL {
        let seq: Vec<CollectiveCall> = calls.iter().filter(|c: &&CollectiveCall| c.mesh_dim == m).cloned().collect();
        if !seq.is_empty() {
            out.push((m, seq));
        }
    }
    Ok(out)
}

fn describe(op: &Op, g: &Graph, region: &Region, nid: titan_ir::NodeId) -> String {
    let attrs = op.attrs(&|b| g.blocks.get(b.index()).map_or_else(|| "?".to_string(), |r| r.name.clone()));
    format!("`{} {attrs}` (node {nid} in @{})", op.name(), region.name)
}

fn walk(g: &Graph, region: &Region, at: RegionRef, mesh: Option<&Mesh>, calls: &mut Vec<CollectiveCall>, errors: &mut Vec<PassDiag>, in_kernel: bool) {
    let here = |nid| Loc::Node(at, nid);
    const NO_MESH: &str = "needs a device mesh; give the graph `meta` entries world_size, mesh_dp_replicate, mesh_dp_shard and mesh_tp";
    for &nid in &region.order {
        let Some(node) = region.nodes.get(nid.index()) else { continue };
        match &node.op {
            Op::Repeat { block, count, carry, stacked, prefetch, .. } => {
                let Some(b) = g.blocks.get(block.index()) else { continue };
                if *prefetch == 0 {
                    for _ in 0..*count {
                        walk(g, b, RegionRef::Block(*block), mesh, calls, errors, in_kernel);
                    }
                    continue;
                }
                // A prefetching repeat issues its prefetch nodes before the first layer and at
                // the top of every layer but the last (as the artifact's loop does), then the
                // layer's other nodes.
                match titan_ir::prefetch::prefetch_split(b, *carry as usize, *stacked as usize, *prefetch as usize) {
                    Ok(split) => {
                        let mut pre = b.clone();
                        pre.order.retain(|&m| split.contains(m));
                        let mut rest = b.clone();
                        rest.order.retain(|&m| !split.contains(m));
                        let inner = RegionRef::Block(*block);
                        if *count > 0 {
                            walk(g, &pre, inner, mesh, calls, errors, in_kernel);
                        }
                        for t in 0..*count {
                            if t + 1 < *count {
                                walk(g, &pre, inner, mesh, calls, errors, in_kernel);
                            }
                            walk(g, &rest, inner, mesh, calls, errors, in_kernel);
                        }
                    }
                    Err(e) => errors.push(PassDiag::invalid(format!("`repeat` (node {nid} in @{}): {e}", region.name)).at(here(nid))),
                }
            }
            Op::Kernel { body, .. } => {
                if let Some(b) = g.blocks.get(body.index()) {
                    walk(g, b, RegionRef::Block(*body), mesh, calls, errors, true);
                }
            }
            op if op.is_collective() => {
                let what = describe(op, g, region, nid);
                let Some(m) = op.collective_mesh_dim() else { continue };
                if in_kernel {
                    errors.push(PassDiag::unsupported(format!("{what} inside a `kernel` body: fusing collectives is not supported yet")).at(here(nid)));
                }
                let Some(mesh) = mesh else {
                    errors.push(PassDiag::precondition(format!("{what} {NO_MESH}")).at(here(nid)));
                    continue;
                };
                let size = op.group_size();
                if let Some(s) = size
                    && s != mesh.size(m)
                {
                    errors.push(
                        PassDiag::invalid(format!("{what} has size = {s} but mesh dim {m} has {} ranks; set size = {}", mesh.size(m), mesh.size(m)))
                            .at(here(nid)),
                    );
                }
                let elems = node.inputs.first().and_then(|&v| region.values.get(v.index())).and_then(|d| d.ty.numel(&g.dims));
                match elems {
                    Some(elems) => calls.push(CollectiveCall { mesh_dim: m, what, elems }),
                    None => errors.push(
                        PassDiag::invalid(format!("{what} has an operand without a static shape; every rank must send the same number of elements"))
                            .at(here(nid)),
                    ),
                }
            }
            // Rank-local slicing: no communication, but its `size` must match the mesh too.
            Op::TakeShard { mesh_dim, size, .. }
            | Op::PlaceShard { mesh_dim, size, .. }
            | Op::RingSlice { mesh_dim, size, .. }
            | Op::RingConcat { mesh_dim, size, .. } => {
                let what = describe(&node.op, g, region, nid);
                match mesh {
                    None => errors.push(PassDiag::precondition(format!("{what} {NO_MESH}")).at(here(nid))),
                    Some(mesh) if *size != mesh.size(*mesh_dim) => errors.push(
                        PassDiag::invalid(format!(
                            "{what} has size = {size} but mesh dim {mesh_dim} has {} ranks; set size = {}",
                            mesh.size(*mesh_dim),
                            mesh.size(*mesh_dim)
                        ))
                        .at(here(nid)),
                    ),
                    Some(_) => {}
                }
            }
            _ => {}
        }
    }
}

pub fn check_collectives(g: &mut Graph) -> Result<CheckCollectivesStats, PassDiag> {
    let schedule = schedule(g).map_err(|mut errors| {
        let rest: Vec<String> = errors.drain(1..).map(|e| e.message).collect();
        let mut first = errors.remove(0);
        if !rest.is_empty() {
            first.message = format!("{}; {}", first.message, rest.join("; "));
        }
        first
    })?;
    Ok(CheckCollectivesStats { collectives: schedule.iter().map(|(_, s)| s.len()).sum(), communicators: schedule.len() })
}
