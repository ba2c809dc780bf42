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
//! still identical on every rank (`check-collectives` runs after this pass). An fp8 gather
//! (`float8-fsdp-gather`: the shard quantized with its all-reduced amax) moves with the nodes it
//! is computed from, when those read only block arguments and constants (its quantization
//! chain, the amax all-reduce included), in their relative order.
//!
//! With async TP the hoisted tp gathers (the backward's re-gathers of saved sequence shards)
//! then move down again, just after the last `ring_shift` that precedes their first reader:
//! the tp collectives run in program order on their stream, and the ring's micro-steps, whose
//! chunk GEMMs come first, would otherwise queue behind them.

use titan_ir::{DType, Graph, NodeId, Op, Region, ValueDef};

/// The nodes to issue first in `r`: its argument-fed gathers, and its fp8 gathers computed from
/// arguments only, with the nodes they are computed from.
fn early_nodes(r: &Region) -> Vec<bool> {
    let mut arg_only = vec![false; r.nodes.len()];
    let from_args = |arg_only: &[bool], v: titan_ir::Value| match r.value(v).def {
        ValueDef::Arg(_) => true,
        ValueDef::Result { node, .. } => arg_only[node.index()],
    };
    for &n in &r.order {
        let node = r.node(n);
        arg_only[n.index()] = !matches!(node.op, Op::Repeat { .. } | Op::Kernel { .. }) && node.inputs.iter().all(|&v| from_args(&arg_only, v));
    }
    let mut early = vec![false; r.nodes.len()];
    let mut stack: Vec<NodeId> = Vec::new();
    for &n in &r.order {
        let node = r.node(n);
        if !matches!(node.op, Op::AllGather { .. }) {
            continue;
        }
        let fed_by_args = node.inputs.iter().all(|&v| matches!(r.value(v).def, ValueDef::Arg(_)));
        let fp8 = node.results.first().is_some_and(|&y| matches!(r.ty(y).dtype, DType::F8E4M3 | DType::F8E5M2));
        if fed_by_args || (fp8 && arg_only[n.index()]) {
            stack.push(n);
        }
    }
    while let Some(n) = stack.pop() {
        if std::mem::replace(&mut early[n.index()], true) {
            continue;
        }
        for &v in &r.node(n).inputs {
            if let ValueDef::Result { node, .. } = r.value(v).def {
                stack.push(node);
            }
        }
    }
    early
}

/// What [`prefetch_gathers`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Gathers moved to the top of their block (fp8 gathers with their quantization).
    pub hoisted: usize,
    /// Synchronous tp gathers then moved after the async-TP ring shifts that precede their
    /// first reader ([`crate::async_tp::order_tp_stream`]).
    pub after_ring_shifts: usize,
}

/// Move every block's argument-fed `all_gather`s to the front of its order (stable).
pub fn prefetch_gathers(g: &mut Graph) -> PrefetchStats {
    let mut stats = PrefetchStats::default();
    for r in &mut g.blocks {
        let early = early_nodes(r);
        let (mut first, rest): (Vec<_>, Vec<_>) = r.order.iter().copied().partition(|n| early[n.index()]);
        let moved = first.iter().zip(&r.order).filter(|(a, b)| a != b).count();
        if moved > 0 {
            stats.hoisted += first.iter().filter(|n| matches!(r.node(**n).op, Op::AllGather { .. })).count();
            first.extend(rest);
            r.order = first;
        }
        // The tp stream runs in program order: a hoisted tp gather must not hold up the ring
        // shifts of async TP's micro-steps that are needed before it.
        stats.after_ring_shifts += crate::async_tp::order_tp_stream(r).len();
    }
    stats
}
