//! Per-block fusion: groups the ops of every region (`main` and each block, each block once
//! however many layers repeat it) into kernels, the torch.compile analogue. The result is the
//! *kernel graph*: every region holds only `kernel` nodes, `reshape` nodes (views, left between
//! kernels), collectives (`all_gather`, `reduce_scatter`, `all_reduce` and the rank-local
//! `take_shard`/`place_shard` of an SPMD graph: each one step of the schedule, never inside a
//! kernel) and, in `main`, `repeat` nodes. Each kernel's body is a new block
//! `@<region>.k<N>`, numbered in program order, whose arguments are the group's external
//! inputs and whose results are the group's values read outside it (or region results).
//!
//! # Kernels
//!
//! - `gemm`: one `linear` or `matmul`, and by rule 11 the `add` of its product (the
//!   residual add as the GEMM's epilogue). `attention`, `attention_bwd`: one node.
//!   `gather`: one `embedding` or `gather`. `scatter_add`: one `scatter_add`, and by rule 12
//!   the `add` of its table to a tensor made before it.
//! - `optimizer`: every `adamw` and `lr_schedule` of the region in one multi-tensor kernel,
//!   plus the pointwise producers of each `adamw` gradient operand whose results nothing else
//!   reads (the clip multiply `g * clip_coef`, and by rule 10 the fp32 cast of a bf16
//!   gradient), so the optimizer reads each gradient as the backward produced it; and the
//!   `cast` of each new master to its compute dtype (`compute-copies`), so the kernel writes
//!   the compute copy from the f32 value it has just computed.
//! - `fused`: connected groups of the fusible ops: unary, binary, `cast`, `broadcast`,
//!   `transpose`, `constant`, `reduce_*`, `rmsnorm`, `rmsnorm_bwd`, `rope`, `cross_entropy`,
//!   `cross_entropy_bwd`.
//!
//! # Fusion rules
//!
//! Every fusible op has an *iteration space*: its element count (of the result for pointwise
//! ops and `broadcast`/`transpose`; of the input for reductions and row ops) and, for row ops
//! (`rmsnorm*`, `rope`, `cross_entropy*`, a reduction over the last axis only), the row length
//! (last dim; `head_dim` for rope). An op whose operands and result are rank 0 is *scalar*.
//! Ops are visited in program order; each starts a group and then:
//!
//! 1. **Producer -> consumer.** It joins the group of each operand's producer (in operand
//!    order), merging those groups, when the merge keeps the rules below.
//! 2. **Siblings.** It may then join one group that already reads one of its non-scalar
//!    operands (one not made inside its own group), so the shared tensor is read once (SwiGLU
//!    backward's two multiplies of `dy`; `cross_entropy` and `cross_entropy_bwd` of the
//!    logits). A node that joined its producers' group brings that group along (the backward's
//!    `dy * silu(gate)`, whose `silu` activation checkpointing recomputes there). A group with
//!    a `reduce` across rows (to a scalar, or over the leading axes, rule 3) takes no siblings:
//!    the other readers of its operand (float8's quantizing cast) need the reduced value, so
//!    they run after it anyway and would only make it write out a copy of the operand for them.
//! 3. **Compatible spaces.** Two groups merge only if their element counts are equal and their
//!    row lengths (where both have one) are equal, or if one has a row length `r` and the
//!    other (without rows) has `1/r` of its elements: per-row values such as a row amax and
//!    the float8 scale computed from it, which the row kernel keeps between its passes over
//!    the row (so RMSNorm, the amax, the scale and the quantized rows are one kernel). A
//!    scalar group fits any group. A reduction over the leading axes (one result per column:
//!    float8's per-column amax over the tokens) has a column space (its operand's elements and
//!    row length): it joins pointwise groups of as many elements and never a group with row
//!    ops, so that it becomes a column kernel, which reads at bandwidth for any row length.
//! 4. **Convexity.** The merged group must have no path that leaves it and comes back through
//!    other nodes or kernels; otherwise the kernel graph would have a cycle (the block's final
//!    residual add is not fused into the earlier `[add, rmsnorm]` because the MLP's GEMMs
//!    sit between them).
//! 5. **Grid reductions end a kernel.** A value that reduces across rows (a reduction to a
//!    scalar or over the leading axes, `cross_entropy`'s loss, `rmsnorm_bwd`'s weight
//!    gradient) is complete only when its kernel ends, so no op of the same kernel reads it.
//!    Each gradient's `reduce_sum(square(g))` is therefore its own small group, and the
//!    scalar ops that add the partial sums (and compute the clip coefficient) form one scalar
//!    kernel after them. The exception is a column kernel's per-column values: ops over as many
//!    elements as its rows are long, reading only what it reduces over the rows (and values
//!    computed from that, and scalars), join it, and the CTA that finishes each column tile
//!    computes them (float8's `fp8_scale` of a column amax and its `recip`: 18 kernels of a
//!    few thousand elements per rowwise layer no longer launch on their own). What reads
//!    those values per element (the quantizing cast) still runs after the kernel.
//! 6. **Constants.** A rank-0 `constant` is copied into every fused or optimizer kernel that
//!    reads it (no buffer); read by anything else it also becomes a one-op fused kernel. A
//!    non-scalar constant is a fused kernel of its own (a fill). Reductions over inner axes
//!    (neither the last nor the leading ones) are kernels of their own.
//! 7. `reshape` is never inside a kernel, so fusion does not cross views.
//! 8. Collectives and `take_shard`/`place_shard` are never inside a kernel: they split groups
//!    like any node left in place, and rule 4 sees the paths through them (a producer of an
//!    `all_gather` operand never merges with a consumer of its result).
//! 9. **Broadcasts go with their consumers.** An expanding `broadcast` (a row scale widened
//!    to the rows' shape) joins no producer when visited; the consumer that reads it pulls it
//!    in (rule 1), so the small tensor crosses kernels and is widened where it is used. Only a
//!    broadcast that no consumer took joins its producer's group afterwards (as rule 1 would
//!    have had it). Without this, the float8 GEMMs' row scales were written out as full f32
//!    tensors by the kernel that computed them.
//!
//! 10. **Cheap producers are recomputed, not written out.** After grouping, a node that is a
//!     cast to a dtype at least as wide as its operand, `add`/`sub`/`mul`/`div`/`min`/`max`
//!     of one tensor with scalars keeping the tensor's dtype, or `abs`/`neg` of a tensor (the
//!     float8 head weight's `abs`, reduced along rows in one kernel and along columns in
//!     another, is no longer written for the second), whose operands are made outside
//!     its kernel (so they are in memory anyway) and whose result kernels other than its own
//!     read, all of them `fused` or `optimizer` kernels, is cloned into each of those kernels
//!     (`recompute.rs`; stat `recomputed`). Each consumer then reads the operand (no more bytes
//!     than the result) and the result is never written: the grad-norm kernel reads a bf16
//!     gradient and writes only its partial sum, and the optimizer reads the same bf16 gradient
//!     and casts it itself, instead of an fp32 copy written by the one for the other. The
//!     region is grouped again with the clones, which join their consumer (as rule 9's
//!     broadcasts do); a node whose clones do not all land in their consumers' kernels stays
//!     materialized. A result read by a GEMM, a collective or a view is written anyway, and a
//!     narrowing cast (f32 -> bf16 read twice) would read more bytes than it saves, so neither
//!     is recomputed. A widening cast whose operand is made inside its own kernel is
//!     recomputed too: that kernel then writes the narrower operand instead of the wide result
//!     (the float8 head's weight gradient after its scale epilogue is written in bf16 and
//!     widened by the optimizer; the head weight's bf16 copy, not an f32 cast of it, is what the
//!     column quantization reads). Recomputing is exact: a clone is the same op on the same
//!     operands.
//! 11. **Residual adds are GEMM epilogues.** Before pointwise grouping, an `add` of two tensors
//!     of one type, one of them the product of a `linear`/`matmul` that nothing else reads and
//!     whose operands the add's other operand is not, joins that GEMM's kernel: the body is
//!     `[linear | matmul, add]` with the other operand as argument 2, which cuBLASLt runs as
//!     `D = A B + C` (`beta = 1`), so the product is never written and read back (a block's two
//!     residual adds; in the backward the sums of the q/k/v and w1/w3 input gradients). Where
//!     both operands are such products the later GEMM takes the add, the earlier product being
//!     its `C`. The other operand must be made before the GEMM in program order, so that no
//!     GEMM waits for its `C` (which would stretch its operands' lifetimes: the tied embedding's
//!     head gradient, added to the embedding's `scatter_add` after the whole backward, stays a
//!     plain GEMM). The interpreter runs the body op by op (the product rounded to its dtype, then the
//!     add); cuBLASLt adds C to the f32 accumulator and rounds once, which is closer to the
//!     exact sum, within the tolerance every GEMM already has against the reference
//!     (accumulation order). Scaled fp8 GEMMs keep their epilogue-free form.
//! 12. **A scatter's add is its epilogue.** An `add` of a `scatter_add`'s table (read by nothing
//!     else) and a tensor of the same type made before the scatter joins the scatter's kernel:
//!     the body is `[scatter_add, add]`, a scatter into that tensor instead of into zeros (the
//!     tied embedding's gradient, the head's weight gradient plus the embedding's). Each hit
//!     row is summed and rounded as the table would be, then added, so the kernel computes
//!     the body's values; the memory plan writes the sum over the tensor when nothing reads the
//!     tensor after it, and the kernel then stores only the rows an index hits (a row no index
//!     hits keeps the tensor's bits, where the interpreter's `x + 0` would turn a -0 into +0).
//!
//! Kernels are scheduled in a topological order, earliest first op first. The interpreter runs
//! a kernel's body op by op, so the fused graph computes bit-identical results.
//! Fusing a graph whose regions hold only kernels, views and repeats changes nothing.

mod group;
mod outline;
mod recompute;
mod report;

use std::collections::HashSet;

use titan_ir::{BlockId, Graph, KernelKind, Op, Region};

pub use group::{Class, Space, classify};
pub use report::{FusionReport, KernelInfo, RegionReport, fusion_report};

use crate::PassDiag;

/// What the fusion pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FuseStats {
    /// Regions rewritten (a region already made of kernels is left alone).
    pub regions: usize,
    pub kernels: usize,
    /// Kernels of kind `fused`.
    pub fused_kernels: usize,
    /// Ops moved into kernel bodies.
    pub ops_outlined: usize,
    /// Rank-0 constants copied into kernel bodies.
    pub constants_copied: usize,
    /// Pointwise nodes computed again inside a consumer kernel instead of read back (rule 10).
    pub recomputed: usize,
}

/// Whether `op` stays a region-level step of the kernel graph besides kernels, views and
/// repeats: a collective or a rank-local shard op.
pub fn is_collective_step(op: &Op) -> bool {
    op.is_collective() || op.is_rank_local()
}

/// Whether `op` stays a region-level node of the kernel graph that the memory plan turns into
/// views: `reshape`, and leading-axis `slice` and `concat` (`fuse` refuses them along inner axes).
pub fn is_view_step(op: &Op) -> bool {
    matches!(op, Op::Reshape | Op::Slice { .. } | Op::Concat { .. })
}

/// Whether a region is already a kernel region: only kernels, views, collectives and repeats.
fn is_kernel_region(r: &Region) -> bool {
    r.order.iter().all(|n| {
        r.nodes
            .get(n.index())
            .is_some_and(|node| matches!(node.op, Op::Kernel { .. } | Op::Repeat { .. }) || is_view_step(&node.op) || is_collective_step(&node.op))
    })
}

/// The blocks that are bodies of `kernel` nodes.
pub fn kernel_bodies(g: &Graph) -> HashSet<BlockId> {
    std::iter::once(&g.main)
        .chain(&g.blocks)
        .flat_map(|r| r.order.iter().filter_map(|n| r.nodes.get(n.index())))
        .filter_map(|node| match node.op {
            Op::Kernel { body, .. } => Some(body),
            _ => None,
        })
        .collect()
}

/// Check the shape of a kernel graph: regions (other than kernel bodies) hold only `kernel`,
/// view (`reshape`, `slice`, `concat`) and collective nodes, plus `repeat` in `main`; bodies hold no `kernel`, `reshape`,
/// `repeat` or collective; a `gemm`, `attention`, `attention_bwd`, `gather` or `scatter_add` kernel holds
/// exactly its one op (a `gemm` may add its residual-add epilogue, rule 11). Returns every
/// violation.
pub fn check_kernel_graph(g: &Graph) -> Vec<String> {
    let bodies = kernel_bodies(g);
    let mut errors = Vec::new();
    let regions = std::iter::once((None, &g.main)).chain(g.blocks.iter().enumerate().map(|(i, b)| (Some(BlockId(i as u32)), b)));
    for (id, r) in regions {
        let is_body = id.is_some_and(|b| bodies.contains(&b));
        for node in r.order.iter().filter_map(|n| r.nodes.get(n.index())) {
            let op = &node.op;
            let allowed = if is_body {
                !matches!(op, Op::Kernel { .. } | Op::Repeat { .. }) && !is_view_step(op) && !is_collective_step(op)
            } else {
                matches!(op, Op::Kernel { .. }) || is_view_step(op) || is_collective_step(op) || (id.is_none() && matches!(op, Op::Repeat { .. }))
            };
            if !allowed && is_body {
                errors.push(format!("@{}: a kernel body cannot hold `{}`", r.name, op.name()));
            } else if !allowed {
                errors.push(format!("@{}: `{}` is outside any kernel; run the `fuse` pass", r.name, op.name()));
            }
            let Op::Kernel { body, kind } = *op else { continue };
            let Some(b) = g.blocks.get(body.index()) else {
                errors.push(format!("@{}: a kernel names block #{} which does not exist", r.name, body.0));
                continue;
            };
            let ops: Vec<&Op> = b.order.iter().filter_map(|n| b.nodes.get(n.index())).map(|n| &n.op).collect();
            let single = match kind {
                KernelKind::Gemm => matches!(
                    ops.as_slice(),
                    [Op::Linear | Op::Matmul { .. } | Op::ScaledMatmul { .. }] | [Op::Linear | Op::Matmul { .. }, Op::Binary(titan_ir::BinaryOp::Add)]
                ),
                KernelKind::Attention => matches!(ops.as_slice(), [Op::Attention { .. }]),
                KernelKind::AttentionBwd => matches!(ops.as_slice(), [Op::AttentionBwd { .. }]),
                KernelKind::Gather => matches!(ops.as_slice(), [Op::Embedding | Op::Gather | Op::GatherShard]),
                KernelKind::ScatterAdd => matches!(
                    ops.as_slice(),
                    [Op::ScatterAdd | Op::ScatterAddShard] | [Op::ScatterAdd | Op::ScatterAddShard, Op::Binary(titan_ir::BinaryOp::Add)]
                ),
                KernelKind::Fused | KernelKind::Optimizer => true,
            };
            if !single {
                let names: Vec<&str> = ops.iter().map(|o| o.name()).collect();
                errors.push(format!("@{} is a `{}` kernel but holds {}", b.name, kind.name(), names.join(", ")));
            }
        }
    }
    errors
}

/// Fuse every region of `g` into kernels (see the module documentation). On error `g` is
/// unchanged.
pub fn fuse(g: &mut Graph) -> Result<FuseStats, PassDiag> {
    let bodies = kernel_bodies(g);
    let base = g.blocks.len() as u32;
    let mut new_blocks: Vec<Region> = Vec::new();
    let mut stats = FuseStats::default();
    // `None` is main.
    let mut rewritten: Vec<(Option<usize>, Region)> = Vec::new();
    let targets = (0..g.blocks.len()).filter(|&i| !bodies.contains(&BlockId(i as u32))).map(Some).chain([None]);
    for t in targets {
        let region = match t {
            Some(i) => &g.blocks[i],
            None => &g.main,
        };
        if is_kernel_region(region) {
            continue;
        }
        let grouping = group::group_region(region, &g.dims)?;
        let rc = recompute::recompute(region, grouping, &g.dims)?;
        let o = outline::outline(rc.region.as_ref().unwrap_or(region), &rc.grouping, base + new_blocks.len() as u32)?;
        stats.recomputed += rc.clones;
        stats.regions += 1;
        stats.kernels += o.bodies.len();
        stats.fused_kernels += o.region.nodes.iter().filter(|n| matches!(n.op, Op::Kernel { kind: KernelKind::Fused, .. })).count();
        stats.ops_outlined += o.ops_outlined;
        stats.constants_copied += o.constants_copied;
        rewritten.push((t, o.region));
        new_blocks.extend(o.bodies);
    }
    let mut names: HashSet<&str> = g.blocks.iter().map(|b| b.name.as_str()).collect();
    if let Some(b) = new_blocks.iter().find(|b| !names.insert(b.name.as_str())) {
        return Err(PassDiag::invalid(format!("kernel body `@{}` would reuse the name of an existing block; rename that block", b.name)));
    }
    for (t, region) in rewritten {
        match t {
            Some(i) => g.blocks[i] = region,
            None => g.main = region,
        }
    }
    g.blocks.extend(new_blocks);
    Ok(stats)
}

#[cfg(test)]
mod tests;
