//! The schedule of rank 0 and the kernel table.
//!
//! Steps follow `main`'s order: a `kernel` node becomes a `Launch` (inputs bind the body's
//! arguments, outputs its results, as [`BufRef`]s from the memory plan); a `repeat` becomes a
//! `Loop` whose body launches the block's kernels with `Carry` and `layer` references (the
//! block's prefetch nodes, `prefetch-next-layer`'s gathers, go to the loop's `prefetch`); a
//! `reshape` is a view and becomes nothing; a collective (`all_gather`, `reduce_scatter`,
//! `all_reduce`, `take_shard`, `place_shard` of an SPMD graph) becomes a `Collective` step,
//! except async TP's `ring_slice`/`ring_concat` where the plan made them ring views (the chunk
//! GEMMs read and write their rows in place). `Copy` steps appear where the memory plan asks for
//! them (a carried operand still read after its loop, block outputs that are block arguments
//! or already written elsewhere, updates and outputs that could not be written in place). No
//! step zeroes a `scatter_add` table first: its kernel writes every row, zero rows included.
//!
//! Every kernel body block is one entry of the kernel table, numbered in order of first launch.

use std::collections::HashMap;

use titan_ir::artifact::{BufRef, CollectiveOp, CollectiveSpec, Step};
use titan_ir::{BlockId, Graph, KernelKind, Mesh, Node, Op, Region};
use titan_passes::fuse::is_collective_step;

use super::BuildError;
use super::memory::{CopyOp, Storage, bytes_of, internal, shape_of};

/// All steps run on stream 0 for now.
pub const STREAM: u32 = 0;

/// The schedule of one rank and the kernels it launches.
#[derive(Clone, Debug, Default)]
pub struct Schedule {
    pub steps: Vec<Step>,
    /// Kernel bodies in kernel-id order, with their kind.
    pub kernels: Vec<(BlockId, KernelKind)>,
    /// Launches per training step, counting each loop body `count` times.
    pub launches_per_step: u64,
    /// Collective steps per training step (SPMD), counted the same way.
    pub collectives_per_step: u64,
}

struct Table {
    ids: HashMap<BlockId, u32>,
    kernels: Vec<(BlockId, KernelKind)>,
}

impl Table {
    fn id(&mut self, body: BlockId, kind: KernelKind) -> Result<u32, BuildError> {
        if let Some(&id) = self.ids.get(&body) {
            return match self.kernels[id as usize].1 == kind {
                true => Ok(id),
                false => Err(internal(format!("kernel body #{} is launched with two kinds", body.0))),
            };
        }
        let id = self.kernels.len() as u32;
        self.ids.insert(body, id);
        self.kernels.push((body, kind));
        Ok(id)
    }
}

fn copy_step(c: &CopyOp) -> Step {
    Step::Copy { src: c.src, dst: c.dst, bytes: c.bytes, stream: STREAM }
}

/// The step of one `kernel` node: its launch.
fn launch(table: &mut Table, region: &Region, node: &Node, refs: &[Option<BufRef>], out: &mut Vec<Step>) -> Result<(), BuildError> {
    let Op::Kernel { body, kind } = node.op else { return Err(internal("not a kernel node")) };
    let lookup = |v: titan_ir::Value| refs.get(v.index()).copied().flatten().ok_or_else(|| internal(format!("value {v} of @{} has no storage", region.name)));
    let inputs = node.inputs.iter().map(|&v| lookup(v)).collect::<Result<Vec<_>, _>>()?;
    let outputs = node.results.iter().map(|&v| lookup(v)).collect::<Result<Vec<_>, _>>()?;
    out.push(Step::Launch { kernel: table.id(body, kind)?, inputs, outputs, stream: STREAM });
    Ok(())
}

/// The step of a collective (or `take_shard`/`place_shard`) node: the op, its mesh dim and
/// group, the operand and result shapes, the buffers and the ring send volume.
fn collective(g: &Graph, mesh: &Mesh, region: &Region, node: &Node, refs: &[Option<BufRef>]) -> Result<Step, BuildError> {
    let CollectiveSpec { op, shift, mesh_dim, group, dim, reduce } =
        CollectiveOp::of_op(&node.op, mesh).ok_or_else(|| internal(format!("`{}` in @{} is not a collective", node.op.name(), region.name)))?;
    let (Some(&x), Some(&y)) = (node.inputs.first(), node.results.first()) else {
        return Err(internal(format!("`{}` in @{} without operand or result", node.op.name(), region.name)));
    };
    let lookup = |v: titan_ir::Value| refs.get(v.index()).copied().flatten().ok_or_else(|| internal(format!("value {v} of @{} has no storage", region.name)));
    let (in_shape, out_shape) = (shape_of(g, region, x)?, shape_of(g, region, y)?);
    let dtype = region.ty(x).dtype;
    let send_bytes = op.ring_send_bytes(group, bytes_of(dtype, &in_shape), bytes_of(dtype, &out_shape));
    Ok(Step::Collective {
        collective: op,
        mesh_dim: mesh_dim.name().to_string(),
        group,
        dim,
        reduce,
        dtype,
        in_shape,
        out_shape,
        input: lookup(x)?,
        output: lookup(y)?,
        more_inputs: node.inputs[1..].iter().map(|&v| lookup(v)).collect::<Result<_, _>>()?,
        shift,
        send_bytes,
        stream: STREAM,
    })
}

/// Rank 0's steps over the kernel graph `g` with the storage of the memory plan. In an SPMD
/// graph (its meta names a mesh) every rank runs these same steps.
pub fn build_schedule(g: &Graph, storage: &Storage) -> Result<Schedule, BuildError> {
    let main = &g.main;
    let mesh = Mesh::from_graph(g).map_err(BuildError::Invalid)?.unwrap_or(Mesh::new(1, 1, 1));
    let mut table = Table { ids: HashMap::new(), kernels: Vec::new() };
    let mut steps = Vec::new();
    let mut launches = 0u64;
    let mut collectives = 0u64;
    for n in &main.order {
        let node = main.node(*n);
        match &node.op {
            Op::Kernel { .. } => {
                launch(&mut table, main, node, &storage.main, &mut steps)?;
                launches += 1;
            }
            // A `ring_slice`/`ring_concat` the plan resolved as ring views: no step, only the
            // copies of the chunks not computed in place.
            Op::RingSlice { .. } | Op::RingConcat { .. } if storage.ring_views.contains(n) => {
                steps.extend(storage.concat_copies.get(n).into_iter().flatten().map(copy_step));
            }
            op if is_collective_step(op) => {
                steps.push(collective(g, &mesh, main, node, &storage.main)?);
                collectives += 1;
            }
            Op::Reshape | Op::Slice { .. } => {}
            Op::Concat { .. } => steps.extend(storage.concat_copies.get(n).into_iter().flatten().map(copy_step)),
            Op::Repeat { block, count, reverse, carry, stacked, prefetch } => {
                let ls = storage.loops.get(n).ok_or_else(|| internal(format!("repeat {n} has no loop storage")))?;
                let blk = g.blocks.get(block.index()).ok_or_else(|| internal(format!("repeat {n} names a missing block")))?;
                // The prefetch nodes (next layer's gathers) become the loop's `prefetch` steps,
                // which run `count` times in all (once before the loop, then in every
                // iteration but the last).
                let split = titan_ir::prefetch::prefetch_split(blk, *carry as usize, *stacked as usize, *prefetch as usize)
                    .map_err(|e| internal(format!("repeat {n}: {e}")))?;
                steps.extend(ls.copies_before.iter().map(copy_step));
                let mut body: Vec<Step> = ls.copies_at_start.iter().map(copy_step).collect();
                let mut pre: Vec<Step> = Vec::new();
                let mut body_launches = 0u64;
                let mut body_collectives = 0u64;
                for bn in &blk.order {
                    let bnode = blk.node(*bn);
                    let out = if split.contains(*bn) { &mut pre } else { &mut body };
                    match bnode.op {
                        Op::Kernel { .. } => {
                            launch(&mut table, blk, bnode, &ls.values, out)?;
                            body_launches += 1;
                        }
                        Op::RingSlice { .. } | Op::RingConcat { .. } if ls.ring_views.contains(bn) => {}
                        ref op if is_collective_step(op) => {
                            out.push(collective(g, &mesh, blk, bnode, &ls.values)?);
                            body_collectives += 1;
                        }
                        Op::Reshape | Op::Slice { .. } => continue,
                        // Its operands that were not computed in place are copied in after it.
                        Op::Concat { .. } => {}
                        ref other => return Err(internal(format!("`{}` in @{} of the kernel graph", other.name(), blk.name))),
                    }
                    if let Some(copies) = ls.copies_after.get(bn) {
                        out.extend(copies.iter().map(copy_step));
                    }
                }
                launches += body_launches * u64::from(*count);
                collectives += body_collectives * u64::from(*count);
                steps.push(Step::Loop { count: *count, reverse: *reverse, carries: ls.carries.clone(), body, prefetch: pre });
            }
            other => return Err(internal(format!("`{}` in `main` of the kernel graph", other.name()))),
        }
    }
    steps.extend(storage.final_copies.iter().map(copy_step));
    Ok(Schedule { steps, kernels: table.kernels, launches_per_step: launches, collectives_per_step: collectives })
}

/// Ops that say nothing about what a kernel does (left out of its name).
fn is_plumbing(op: &Op) -> bool {
    matches!(op, Op::Reshape | Op::Broadcast { .. } | Op::Constant { .. } | Op::Cast | Op::Transpose { .. })
}

/// A kernel's name: its body block and up to three of its distinct ops, e.g. `layer.k3_rmsnorm`
/// or `main.k9_square_reduce_sum`. Only `[A-Za-z0-9._]` so it is a file name.
pub fn kernel_name(body: &Region) -> String {
    let mut ops: Vec<&'static str> = Vec::new();
    let mut plumbing: Vec<&'static str> = Vec::new();
    for n in &body.order {
        let op = &body.node(*n).op;
        let list = if is_plumbing(op) { &mut plumbing } else { &mut ops };
        if !list.contains(&op.name()) {
            list.push(op.name());
        }
    }
    let picked = if ops.is_empty() { plumbing } else { ops };
    let mut name = body.name.clone();
    for op in picked.iter().take(3) {
        name.push('_');
        name.push_str(op);
    }
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' || c == '_' { c } else { '_' }).collect()
}
