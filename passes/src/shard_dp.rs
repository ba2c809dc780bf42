//! `shard-dp`: data-parallel partitioning of a MODEL graph whose `meta` names a device mesh
//! (`world_size`, `mesh_dp_replicate`, `mesh_dp_shard`, `mesh_tp`), run before the training
//! lowering so autodiff derives the backward collectives:
//!
//! - the batch is split over `dp_replicate x dp_shard`: the named dim `batch` becomes the
//!   per-rank batch and `tokens`/`targets` are `Shard(0)` on the data-parallel mesh dims (the
//!   runtime feeds each rank its rows, and its `seq` slice of an input that is `Shard(1)` on
//!   `tp`; `shard-tp` leaves both whole on `tp`);
//! - the differentiated loss is the rank's local mean scaled by `1 / world_size`, so that the
//!   sum over ranks (the SPMD cotangent convention, see `autodiff/rules.rs`) is the global
//!   mean; `sync-grads` later reports the all-reduced value;
//! - with `dp_shard > 1` (FSDP) every parameter is sharded along one dim (for a stacked
//!   per-layer parameter a non-layer dim) and all-gathered right before use, inside the block
//!   for per-layer parameters; the VJP of that `all_gather` reduce-scatters the gradient and
//!   AdamW's state takes the parameter's sharded type.
//!
//! Runs after `shard-tp`: FSDP shards the tensor-parallel local parameter along a dim tensor
//! parallelism does not shard, so the two shardings commute.

use crate::PassDiag;
use titan_ir::verify::{Loc, RegionRef};
use titan_ir::{ArgKind, Dim, Graph, Mesh, MeshDim, Op, Placement, Region, TensorType, Value};

use crate::shard_tp::with_placement;
use crate::util::replace_uses;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardDpStats {
    /// Parameters sharded on `dp_shard`.
    pub params_sharded: usize,
    /// `all_gather` nodes inserted.
    pub gathers: usize,
}

fn partial_placement(mesh: &Mesh) -> Vec<Placement> {
    MeshDim::ALL.iter().map(|&m| if mesh.size(m) > 1 { Placement::Partial } else { Placement::Replicate }).collect()
}

/// The dim to shard a parameter of `shape` along: the first (non-layer, for stacked ones)
/// dim divisible by `n`
/// dim that tensor parallelism does not already shard.
fn pick_shard_dim(shape: &[u64], stacked: bool, n: u64, tp_dim: Option<usize>) -> Option<usize> {
    let first = usize::from(stacked);
    (first..shape.len()).find(|&d| Some(d) != tp_dim && shape[d].is_multiple_of(n) && shape[d] >= n)
}

pub fn shard_dp(g: &mut Graph) -> Result<ShardDpStats, PassDiag> {
    let mut stats = ShardDpStats::default();
    let Some(mesh) = Mesh::from_graph(g)? else { return Err(crate::error::no_mesh()) };
    if mesh.world_size() == 1 {
        return Ok(stats);
    }
    if g.main.args.iter().any(|a| matches!(a.kind, ArgKind::State(_))) {
        return Err(PassDiag::precondition("`shard-dp` partitions a model graph (params, no state); run it before the training lowering"));
    }
    split_batch(g, &mesh)?;
    scale_loss(g, &mesh)?;
    let n = mesh.size(MeshDim::DpShard);
    for i in 0..g.main.args.len() {
        let ArgKind::Param(info) = g.main.args[i].kind.clone() else { continue };
        let v = g.main.args[i].value;
        let placement = g.main.value(v).placement.clone();
        if n == 1 {
            g.main.values[v.index()].placement = with_placement(&placement, MeshDim::DpShard, Placement::Replicate);
            continue;
        }
        let tp_dim = match placement.get(MeshDim::Tp.index()) {
            Some(Placement::Shard(d)) => Some(*d as usize),
            _ => None,
        };
        let ty = g.main.ty(v).clone();
        let shape = crate::util::fixed_dims(&ty, &g.dims)?;
        let stacked = info.is_stacked();
        let d = pick_shard_dim(&shape, stacked, u64::from(n), tp_dim).ok_or_else(|| {
            PassDiag::unsupported(format!(
                "parameter `{}` of type {ty} has no {}dim divisible by dp_shard = {n} (choose another dp_shard); uneven FSDP sharding is not supported yet",
                info.name,
                if stacked { "non-layer " } else { "" }
            ))
            .at(Loc::Arg(RegionRef::Main, i))
        })?;
        let mut local = shape.clone();
        local[d] /= u64::from(n);
        g.main.values[v.index()].ty = TensorType::new(ty.dtype, local.iter().map(|&x| Dim::Fixed(x)).collect());
        g.main.values[v.index()].placement = with_placement(&placement, MeshDim::DpShard, Placement::Shard(d as u32));
        stats.params_sharded += 1;
        stats.gathers += gather_uses(g, v, d, stacked, n, &info.name)?;
    }
    Ok(stats)
}

/// Make the named dim `batch` per-rank and mark `tokens`/`targets` as batch-sharded.
fn split_batch(g: &mut Graph, mesh: &Mesh) -> Result<(), String> {
    let dp = u64::from(mesh.dp());
    let mut batch_dim = None;
    for name in ["tokens", "targets"] {
        let v = g.main.find(name).ok_or_else(|| format!("the model has no input `%{name}`; data parallelism splits `tokens` and `targets` by rows"))?;
        match g.main.ty(v).shape.first() {
            Some(Dim::Named(d)) => batch_dim = Some(d.clone()),
            other => {
                return Err(format!(
                    "input `%{name}` must lead with a named batch dim (`i32[batch, seq]`) to be split across ranks, found {}",
                    other.map_or("a scalar".to_string(), |d| d.to_string())
                ));
            }
        }
        let mut placement = g.main.value(v).placement.clone();
        for m in [MeshDim::DpReplicate, MeshDim::DpShard] {
            let p = if mesh.size(m) > 1 { Placement::Shard(0) } else { Placement::Replicate };
            placement = with_placement(&placement, m, p);
        }
        g.main.values[v.index()].placement = placement;
    }
    let name = batch_dim.ok_or("no batch dim")?;
    let global = *g.dims.get(&name).ok_or_else(|| format!("dim `{name}` is not bound in `dims`"))?;
    if !global.is_multiple_of(dp) {
        return Err(format!("batch = {global} is not divisible by dp_replicate x dp_shard = {dp}; choose a batch size that is a multiple of {dp}"));
    }
    g.dims.insert(name, global / dp);
    Ok(())
}

/// Output `loss` becomes `loss * (1 / world_size)`: the rank's share of the global mean.
fn scale_loss(g: &mut Graph, mesh: &Mesh) -> Result<(), String> {
    let pos = g.main.outputs.iter().position(|o| o.name.as_deref() == Some("loss")).ok_or("the model has no `loss` output")?;
    let loss = g.main.outputs[pos].value;
    if g.main.ty(loss).rank() != 0 {
        return Err(format!("output `loss` must be a scalar, found {}", g.main.ty(loss)));
    }
    let dtype = g.main.ty(loss).dtype;
    let mut b = g.main_builder();
    let c = b.push_typed(Op::Constant { value: 1.0 / f64::from(mesh.world_size()) }, &[], TensorType::scalar(dtype))?;
    let scaled = b.push1(Op::Binary(titan_ir::BinaryOp::Mul), &[loss, c])?;
    b.name(scaled, "loss_share");
    g.main.values[scaled.index()].placement = partial_placement(mesh);
    g.main.outputs[pos].value = scaled;
    Ok(())
}

/// Insert an `all_gather` of `region`'s value `v` (sharded along `dim`) before its first user.
fn insert_gather(region: &mut Region, v: Value, dim: usize, n: u32, full: TensorType, name: &str) -> Value {
    let op = Op::AllGather { mesh_dim: MeshDim::DpShard, dim: dim as u32, size: n };
    let node = region.add_node(op, vec![v], vec![full]);
    region.order.pop();
    let r = region.node(node).results[0];
    region.values[r.index()].name = Some(format!("{name}.gathered"));
    region.values[r.index()].placement = with_placement(&region.value(v).placement, MeshDim::DpShard, Placement::Replicate);
    let first_user = region.order.iter().position(|&nid| region.nodes[nid.index()].inputs.contains(&v)).unwrap_or(region.order.len());
    region.order.insert(first_user, node);
    replace_uses(region, v, r, Some(node));
    r
}

/// Gather the sharded parameter `v` where it is used: in `main`, and inside the block of
/// each `repeat` it feeds. Returns the number of gathers inserted.
fn gather_uses(g: &mut Graph, v: Value, d: usize, stacked: bool, n: u32, pname: &str) -> Result<usize, PassDiag> {
    let mut gathers = 0;
    let mut main_users = false;
    let order = g.main.order.clone();
    for nid in order {
        let node = g.main.node(nid).clone();
        let Op::Repeat { block, carry, stacked: ns, .. } = node.op else {
            main_users |= node.inputs.contains(&v);
            continue;
        };
        for (j, _) in node.inputs.iter().enumerate().filter(|(_, x)| **x == v) {
            let per_layer = j >= carry as usize && j < (carry + ns) as usize;
            if per_layer != stacked {
                return Err(PassDiag::unsupported(format!(
                    "passing parameter `{pname}` to a `repeat` {} when it is {}stacked is not supported yet",
                    if per_layer { "per layer" } else { "whole" },
                    if stacked { "" } else { "not " }
                ))
                .at(Loc::Node(RegionRef::Main, nid)));
            }
            let users = g.main.nodes.iter().filter(|m| matches!(m.op, Op::Repeat { block: b, .. } if b == block)).count();
            if users != 1 {
                return Err(PassDiag::unsupported(format!(
                    "sharding parameters of block @{}, run by {users} `repeat` nodes, is not supported yet",
                    g.blocks[block.index()].name
                ))
                .at(Loc::Node(RegionRef::Main, nid)));
            }
            let bd = if per_layer { d - 1 } else { d };
            let region = &mut g.blocks[block.index()];
            let arg = region.args[j].value;
            let full = region.ty(arg).clone();
            let mut local = full.clone();
            let size = titan_ir::shape::resolve_dim(&full.shape[bd], &g.dims).ok_or_else(|| format!("block argument of `{pname}` has an unbound dim"))?;
            local.shape[bd] = Dim::Fixed(size / u64::from(n));
            region.values[arg.index()].ty = local;
            let placement = region.value(arg).placement.clone();
            region.values[arg.index()].placement = with_placement(&placement, MeshDim::DpShard, Placement::Shard(bd as u32));
            let name = region.value(arg).name.clone().unwrap_or_else(|| format!("arg{j}"));
            insert_gather(region, arg, bd, n, full, &name);
            gathers += 1;
        }
    }
    if main_users {
        let ty = g.main.ty(v).clone();
        let mut full = ty.clone();
        let size = titan_ir::shape::resolve_dim(&ty.shape[d], &g.dims).ok_or("unbound dim")?;
        full.shape[d] = Dim::Fixed(size * u64::from(n));
        let name = g.main.value(v).name.clone().unwrap_or_else(|| "param".into());
        // Keep repeat operands on the shard: only non-repeat users read the gathered copy.
        let repeats: Vec<(usize, Vec<usize>)> = g
            .main
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, m)| matches!(m.op, Op::Repeat { .. }))
            .map(|(i, m)| (i, m.inputs.iter().enumerate().filter(|(_, x)| **x == v).map(|(k, _)| k).collect()))
            .collect();
        insert_gather(&mut g.main, v, d, n, full, &name);
        for (i, ks) in repeats {
            for k in ks {
                g.main.nodes[i].inputs[k] = v;
            }
        }
        gathers += 1;
    }
    Ok(gathers)
}
