//! `prefetch-gathers`: in every block, issue the all-gathers of the block's parameter shards
//! first. FSDP gathers each weight right before its GEMM; on the GPU collectives run on a
//! stream of their own, so gathering all of a layer's weights at the top of the layer lets the
//! later (and largest: the MLP's) gathers run while the attention computes, and the backward's
//! re-gathers while the previous layer's gradients compute. The gathered weights of one layer
//! are then live together (one layer's worth, not the model's).
//!
//! Only `all_gather` nodes whose operand is a block argument move (a parameter shard, or in the
//! backward a saved value): their inputs exist at the block's start, so the order stays a valid
//! topological order, and every rank applies the same permutation, so the collective order is
//! still identical on every rank (`check-collectives` runs after this pass).

use titan_ir::{Graph, Op, ValueDef};

/// What [`prefetch_gathers`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Gathers moved to the top of their block.
    pub hoisted: usize,
}

/// Move every block's argument-fed `all_gather`s to the front of its order (stable).
pub fn prefetch_gathers(g: &mut Graph) -> PrefetchStats {
    let mut stats = PrefetchStats::default();
    for r in &mut g.blocks {
        let early = |n: &titan_ir::NodeId| {
            let node = r.node(*n);
            matches!(node.op, Op::AllGather { .. }) && node.inputs.iter().all(|&v| matches!(r.value(v).def, ValueDef::Arg(_)))
        };
        let (mut first, rest): (Vec<_>, Vec<_>) = r.order.iter().copied().partition(|n| early(n));
        let moved = first.iter().zip(&r.order).filter(|(a, b)| a != b).count();
        if moved > 0 {
            stats.hoisted += first.len();
            first.extend(rest);
            r.order = first;
        }
    }
    stats
}
