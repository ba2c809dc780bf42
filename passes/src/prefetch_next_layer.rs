//! `prefetch-next-layer`: FSDP's cross-layer prefetch. Gather layer `l + 1`'s weights while
//! layer `l` computes (in a reversed `repeat`, the backward, layer `l - 1`'s), instead of at
//! the top of layer `l + 1` (`prefetch-gathers`), where they would wait for layer `l` to have
//! issued all its work.
//!
//! In every repeated block, each `all_gather` over `dp_shard` whose operand is a stacked block
//! argument read by nothing else (a parameter shard) becomes a **prefetched carry** of the
//! `repeat` (`prefetch = P`, [`titan_ir::Op::Repeat`], [`titan_ir::prefetch`]): the block gets
//! a carried argument holding this layer's gathered weight, which replaces the gather's
//! result for every reader, and returns the gather (now of the next layer's shard) as the
//! carry for the next layer. The repeat runs the gathers once before the first layer (its
//! weights) and during every layer but the last, so each layer's weights are gathered exactly
//! once, as before, and no nonexistent layer is gathered. The price is memory: two layers'
//! gathered weights are live during the loop (the carry's two slots) instead of one.
//!
//! ```text
//! block @layer(%h, %wq.gathered: bf16[64, 64], %wq: bf16[32, 64]) {   // before: %wq.gathered = all_gather(%wq)
//!   %wq.gathered.next = all_gather(%wq) {mesh_dim = dp_shard, ...}    // %wq is read at layer l + 1
//!   ... linear(%xn, %wq.gathered) ...
//!   return %h2, %wq.gathered.next
//! }
//! %h = repeat(%x, %layers.wq) {block = @layer, ..., prefetch = 1}
//! ```
//!
//! Every rank rewrites the same graph the same way, so collectives stay in the same order on
//! every rank; `check-collectives` expands the prologue and the skipped last prefetch. Off
//! when the graph's meta has `prefetch_next_layer = 0` (`titanc build
//! --disable-prefetch-next-layer`). Runs after autodiff (which does not differentiate a
//! prefetching `repeat`).

use crate::PassDiag;
use titan_ir::{Arg, ArgKind, Graph, MeshDim, Op, Output, Value, ValueDef};

/// The meta key that turns the pass off (`0`).
pub const PREFETCH_NEXT_LAYER_META: &str = "prefetch_next_layer";

/// Record in `g`'s meta that `prefetch-next-layer` must leave the graph alone.
pub fn disable_prefetch_next_layer(g: &mut Graph) {
    g.meta.entries.retain(|(k, _)| k != PREFETCH_NEXT_LAYER_META);
    g.meta.entries.push((PREFETCH_NEXT_LAYER_META.into(), titan_ir::AttrValue::Int(0)));
}

/// What [`prefetch_next_layer`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchNextLayerStats {
    /// `repeat`s that now prefetch.
    pub loops: usize,
    /// Gathers that now fetch the next layer's shard.
    pub gathers: usize,
}

/// Make each repeated block's parameter all-gathers over `dp_shard` fetch the next layer.
pub fn prefetch_next_layer(g: &mut Graph) -> Result<PrefetchNextLayerStats, PassDiag> {
    let mut stats = PrefetchNextLayerStats::default();
    if g.meta_i64(PREFETCH_NEXT_LAYER_META) == Some(0) {
        return Ok(stats);
    }
    let order = g.main.order.clone();
    for n in order {
        let Op::Repeat { block, carry, stacked, prefetch: 0, count, .. } = g.main.node(n).op else { continue };
        // A block run by two repeats would change under both; the Llama graphs have none.
        let users =
            g.main.order.iter().filter(|&&m| matches!(g.main.node(m).op, Op::Repeat { block: b, .. } | Op::Kernel { body: b, .. } if b == block)).count();
        if users != 1 || count < 2 {
            continue;
        }
        let (nc, ns) = (carry as usize, stacked as usize);
        let blk = &mut g.blocks[block.index()];
        let reads = |v: Value| blk.order.iter().map(|&m| blk.node(m).inputs.iter().filter(|&&i| i == v).count()).sum::<usize>();
        let is_output = |v: Value| blk.outputs.iter().any(|o| o.value == v);
        let mut gathers = Vec::new();
        for &m in &blk.order {
            let node = blk.node(m);
            if !matches!(node.op, Op::AllGather { mesh_dim: MeshDim::DpShard, .. }) {
                continue;
            }
            let (Some(&x), Some(&y)) = (node.inputs.first(), node.results.first()) else { continue };
            let stacked_arg = matches!(blk.value(x).def, ValueDef::Arg(i) if (i as usize) >= nc && (i as usize) < nc + ns);
            if stacked_arg && reads(x) == 1 && !is_output(x) && !is_output(y) {
                gathers.push((m, y));
            }
        }
        if gathers.is_empty() {
            continue;
        }
        let np = gathers.len();
        for (k, &(_, y)) in gathers.iter().enumerate() {
            // This layer's gathered weight: a carried argument that takes the gather's name;
            // the gather (of the next layer) becomes `<name>.next`.
            let ty = blk.ty(y).clone();
            let name = blk.value(y).name.clone();
            let placement = blk.value(y).placement.clone();
            let cur = blk.add_arg(ty, ArgKind::Block, None);
            blk.values[cur.index()].placement = placement;
            if let Some(name) = name {
                blk.values[y.index()].name = Some(format!("{name}.next"));
                blk.values[cur.index()].name = Some(name);
            }
            let arg = blk.args.pop().expect("invariant: the argument was just added");
            blk.args.insert(nc + k, arg);
            for node in &mut blk.nodes {
                for i in &mut node.inputs {
                    if *i == y {
                        *i = cur;
                    }
                }
            }
            blk.outputs.insert(nc + k, Output { name: None, value: y });
        }
        for (i, Arg { value, .. }) in blk.args.iter().enumerate() {
            blk.values[value.index()].def = ValueDef::Arg(i as u32);
        }
        // The prefetch nodes first: they are issued at the top of each layer.
        let first: Vec<_> = gathers.iter().map(|&(m, _)| m).collect();
        blk.order.retain(|m| !first.contains(m));
        let mut order = first;
        order.append(&mut blk.order);
        blk.order = order;
        titan_ir::prefetch::prefetch_split(blk, nc, ns, np).map_err(|e| format!("invariant: the rewritten block splits: {e}"))?;
        if let Op::Repeat { prefetch, .. } = &mut g.main.nodes[n.index()].op {
            *prefetch = np as u32;
        }
        stats.loops += 1;
        stats.gathers += np;
    }
    Ok(stats)
}
