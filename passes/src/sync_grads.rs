//! `sync-grads`: after autodiff of an SPMD graph, make every gradient output (the graph's
//! gradient map, meta `gradients`) the
//! true gradient of the rank's local parameter, and report the global loss.
//!
//! With the SPMD cotangent convention (a rank's cotangent is its contribution to a sum over
//! ranks) a parameter replicated on a mesh dim has a `Partial` gradient there, so it is
//! all-reduced (sum) over every such mesh dim: data parallelism's gradient averaging (the
//! `1 / world_size` is already in the loss) and HSDP's all-reduce across `dp_replicate`.
//! Gradients of `Shard`ed parameters were reduce-scattered by the VJP of their `all_gather`.
//! Output `loss` (the rank's share) becomes the sum over all ranks: the global mean.

use crate::PassDiag;
use titan_ir::{CollectiveReduce, Graph, Mesh, MeshDim, Op, Placement, Value};

use crate::train::gradient_map;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncGradsStats {
    /// `all_reduce` nodes inserted for gradients.
    pub grad_all_reduces: usize,
}

pub fn sync_grads(g: &mut Graph) -> Result<SyncGradsStats, PassDiag> {
    let mut stats = SyncGradsStats::default();
    let Some(mesh) = Mesh::from_graph(g)? else { return Err(crate::error::no_mesh()) };
    if mesh.world_size() == 1 {
        return Ok(stats);
    }
    let map = gradient_map(g)?.ok_or_else(|| PassDiag::precondition("the graph has no gradient map (meta `gradients`); run `autodiff` before `sync-grads`"))?;
    let mut todo: Vec<(usize, Vec<MeshDim>)> = Vec::new();
    for (i, k) in map {
        let placement = &g.main.value(g.main.args[i].value).placement;
        let dims: Vec<MeshDim> =
            MeshDim::ALL.into_iter().filter(|&m| mesh.size(m) > 1 && placement.get(m.index()).is_none_or(|p| *p == Placement::Replicate)).collect();
        todo.push((k, dims));
    }
    for (k, dims) in todo {
        let mut v = g.main.outputs[k].value;
        for m in dims {
            v = all_reduce(g, v, m)?;
            stats.grad_all_reduces += 1;
        }
        g.main.outputs[k].value = v;
    }
    reduce_loss(g, &mesh)?;
    Ok(stats)
}

/// Make output `loss` (a rank's share of the mean) the sum over every mesh dim of more than one
/// rank: the global mean on every rank. The training step gets it from [`sync_grads`], the
/// eval step from the `reduce-loss` pass. Returns the number of `all_reduce`s inserted.
pub fn reduce_loss(g: &mut Graph, mesh: &Mesh) -> Result<usize, PassDiag> {
    let pos = g.main.outputs.iter().position(|o| o.name.as_deref() == Some("loss")).ok_or_else(|| PassDiag::precondition("the graph has no `loss` output"))?;
    let mut loss = g.main.outputs[pos].value;
    let mut n = 0;
    for m in [MeshDim::Tp, MeshDim::DpShard, MeshDim::DpReplicate] {
        if mesh.size(m) > 1 {
            loss = all_reduce(g, loss, m)?;
            n += 1;
        }
    }
    g.main.values[loss.index()].placement = vec![Placement::Replicate; 3];
    g.main.outputs[pos].value = loss;
    Ok(n)
}

/// The `reduce-loss` pass: [`reduce_loss`] on a graph whose meta names a mesh.
pub fn reduce_loss_pass(g: &mut Graph) -> Result<usize, PassDiag> {
    let Some(mesh) = Mesh::from_graph(g)? else { return Err(crate::error::no_mesh()) };
    reduce_loss(g, &mesh)
}

fn all_reduce(g: &mut Graph, v: Value, m: MeshDim) -> Result<Value, String> {
    let mut b = g.main_builder();
    b.push1(Op::AllReduce { mesh_dim: m, reduce: CollectiveReduce::Sum }, &[v])
}
