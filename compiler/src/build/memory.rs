//! The static memory plan: which buffer holds every value of the kernel graph, and where each
//! buffer lives in its arena.
//!
//! # Storage
//!
//! [`assign_storage`] gives every value that needs bytes a [`BufRef`]:
//!
//! - `main` arguments: `input`s (class `Input`, with their `feed` name) and `state`s (fp32
//!   masters are `Param`, the AdamW moments `.exp_avg`/`.exp_avg_sq` are `OptimizerState`).
//! - collective results (`all_gather`, `reduce_scatter`, `all_reduce`, `take_shard`,
//!   `place_shard` of an SPMD graph): one buffer each, like kernel results (in `main` never
//!   in place; inside a repeated block they may be written straight into a block output).
//! - `kernel` results of `main`: one buffer each, except an `update %p <- %v` whose `%v` is
//!   written in place into `%p`'s buffer (AdamW is elementwise); when that is not safe (`%p` is
//!   read after `%v` is computed) the schedule copies `%v` into `%p` at the end of the step.
//! - `reshape` results are views: the same [`BufRef`] as their source (a layer slice stays a
//!   layer slice).
//! - `repeat`: a carried value that the block also outputs as a stacked result (a forward
//!   loop saving its layer inputs for the backward) lives in one buffer of `count + 1` slices,
//!   the carry's stack: iteration `i` reads slice `i` and writes slice `i + 1` (views of stride
//!   one slice), the first `count` slices are the stacked result and the last the final
//!   carried value; the operand is copied into slice 0 before the loop. Every other carried
//!   value gets two buffers, the loop's ping-pong slots (the carried
//!   operand's own buffer serves as slot 0 when nothing reads it after the loop starts, else it
//!   is copied in); the final carried result is slot `count % 2`. A prefetched carry
//!   (`prefetch-next-layer`) has no operand and no result: two fresh slots, which the loop's
//!   `prefetch` steps write one iteration ahead. Each stacked result gets a
//!   buffer with the leading `count` dimension; stacked results that are views of one block
//!   value share one buffer.
//! - Inside the repeated block: carried arguments/outputs are `Carry` slots, stacked arguments
//!   and outputs `layer` slices of the main buffers, other arguments the main buffers
//!   themselves. A kernel result that is (a view of) a block output is written straight into
//!   the output's slot or slice; an output that is a block argument, or a value already
//!   written to another destination, is copied there after it is computed. Every other block
//!   value is a temporary of the loop, reused by every iteration.
//!
//! Classes: `Grad` for the `main` values the optimizer kernel reads as gradients, traced back
//! through pointwise kernels, views and collectives (the gradient all-reduce or reduce-scatter
//! and its operand) to the GEMM, `scatter_add` and backward-`repeat` results that produce them;
//! `Activation` for everything else computed in the step. Both classes live in the
//! `Activations` arena: the class is for reports, the arena for lifetimes, and a gradient
//! produced late in the backward reuses the bytes of activations freed earlier (two arenas
//! would add their high-water marks, which fall at different times: 8.4 GiB on the 8B-dims
//! 4-layer model).
//!
//! # Placement
//!
//! [`place`] linearizes the schedule (a loop's body once, inside the loop's span) and gives each
//! buffer a lifetime: the first and last step that touch it. A loop's temporaries live within
//! the steps of an iteration; any other buffer a loop touches lives across the whole loop;
//! buffers holding a step output live to the end. `Inputs`, `Params` and `OptimizerState` are
//! packed in buffer order; `Activations` is placed by a best-fit heap simulation
//! over the lifetimes (buffers in order of first use, larger first; a buffer is freed after
//! its last use; the smallest free hole that fits wins, else the heap grows). Offsets and
//! sizes are 256-byte aligned.

use std::collections::{BTreeMap, HashMap, HashSet};

use titan_ir::artifact::liveness::{self, Lifetime};
use titan_ir::artifact::{Arena, ArenaPlan, BufRef, Buffer, BufferClass, MemoryPlan, RingOffset, StateInfo, Step};
use titan_ir::print::ValueNames;
use titan_ir::{ArgKind, DType, Graph, KernelKind, NodeId, Op, Region, Value, ValueDef};

use titan_passes::fuse::is_collective_step;

use super::BuildError;

/// Alignment of every buffer offset and size.
pub const ALIGN: u64 = 256;

/// The arenas in manifest order.
pub const ARENAS: [Arena; 4] = [Arena::Inputs, Arena::Params, Arena::OptimizerState, Arena::Activations];

pub use titan_ir::artifact::{arena_name, arena_of};

/// A copy the schedule must perform.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyOp {
    pub src: BufRef,
    pub dst: BufRef,
    pub bytes: u64,
}

/// Storage of one `repeat` node's block.
#[derive(Clone, Debug, Default)]
pub struct LoopStorage {
    /// Index of this loop among the loops of the schedule (in `main` order).
    pub index: u32,
    /// The two slot buffers of each carried value.
    pub carries: Vec<[u32; 2]>,
    /// Copies into slot 0 before the loop (a carried operand still read after the loop starts).
    pub copies_before: Vec<CopyOp>,
    /// Per value of the block.
    pub values: Vec<Option<BufRef>>,
    /// Copies at the start of the body (outputs that are block arguments).
    pub copies_at_start: Vec<CopyOp>,
    /// Copies right after the kernel node that computes their source.
    pub copies_after: HashMap<NodeId, Vec<CopyOp>>,
    /// `ring_slice`/`ring_concat` nodes of the block resolved as ring views ([`ring_chunk`]):
    /// they become no step (only the copies of unclaimed `ring_concat` operands).
    pub ring_views: HashSet<NodeId>,
}

/// Where every value of the kernel graph lives.
#[derive(Clone, Debug, Default)]
pub struct Storage {
    /// Buffers with `offset` 0 until [`place`] runs.
    pub buffers: Vec<Buffer>,
    /// The loop whose temporary a buffer is (`None` for `main` buffers), by buffer id.
    pub scope: Vec<Option<u32>>,
    /// Per value of `main`.
    pub main: Vec<Option<BufRef>>,
    /// Per `repeat` node of `main`.
    pub loops: HashMap<NodeId, LoopStorage>,
    /// Copies at the end of the step (updates and outputs that could not be placed in place).
    pub final_copies: Vec<CopyOp>,
    /// Copies at a `concat` (or a viewed `ring_concat`) node of `main`: its operands that could
    /// not be computed in place.
    pub concat_copies: HashMap<NodeId, Vec<CopyOp>>,
    /// `ring_slice`/`ring_concat` nodes of `main` resolved as ring views.
    pub ring_views: HashSet<NodeId>,
}

pub(crate) fn internal(message: impl Into<String>) -> BuildError {
    BuildError::Internal(message.into())
}

/// The resolved shape of a type; an unbound dimension is an error naming the value.
pub(crate) fn shape_of(g: &Graph, r: &Region, v: Value) -> Result<Vec<u64>, BuildError> {
    let d = r.values.get(v.index()).ok_or_else(|| internal(format!("@{} has no value {v}", r.name)))?;
    d.ty.resolve(&g.dims)
        .map(|s| s.into_iter().map(|x| x as u64).collect())
        .map_err(|e| BuildError::Invalid(format!("value {v} of @{} has an {e}; bind it in the graph's `dims`", r.name)))
}

pub(crate) fn bytes_of(dtype: DType, shape: &[u64]) -> u64 {
    shape.iter().product::<u64>().saturating_mul(dtype.size_bytes() as u64)
}

fn align(x: u64) -> u64 {
    x.div_ceil(ALIGN).saturating_mul(ALIGN)
}

fn layer_bytes(b: &Buffer) -> u64 {
    match b.shape.first() {
        Some(&n) if n > 0 => b.bytes / n,
        _ => 0,
    }
}

/// Bytes a reference covers: a whole buffer, or one layer's slice of it.
pub fn ref_bytes(buffers: &[Buffer], carries: &[[u32; 2]], r: BufRef) -> u64 {
    match r {
        BufRef::Buffer { buffer, layer } => buffers.get(buffer as usize).map_or(0, |b| if layer { layer_bytes(b) } else { b.bytes }),
        BufRef::View { bytes, .. } => bytes,
        BufRef::Carry { carry, .. } => carries.get(carry as usize).and_then(|c| buffers.get(c[0] as usize)).map_or(0, |b| b.bytes),
    }
}

/// The view of bytes `offset .. offset + bytes` of what `r` addresses (a whole buffer, a layer
/// slice or a view); a loop carry has no fixed bytes to cut.
pub fn sub_view(buffers: &[Buffer], r: BufRef, offset: u64, bytes: u64) -> Result<BufRef, BuildError> {
    match r {
        BufRef::Buffer { buffer, layer: false } => Ok(BufRef::View { buffer, offset, bytes, stride: 0, ring: None }),
        BufRef::Buffer { buffer, layer: true } => {
            let stride = buffers.get(buffer as usize).map_or(0, layer_bytes);
            Ok(BufRef::View { buffer, offset, bytes, stride, ring: None })
        }
        BufRef::View { buffer, offset: o, stride, ring, .. } => Ok(BufRef::View { buffer, offset: o + offset, bytes, stride, ring }),
        BufRef::Carry { .. } => Err(BuildError::Invalid(
            "a `slice` or `concat` of a value carried between loop iterations is not supported yet (only of stacked or loop-invariant values)".into(),
        )),
    }
}

/// Chunk `(c + shift) mod ring.size` (`c` the rank's tp coordinate) of `ring.step` bytes of
/// what `r` addresses: one micro-step's rows of a tp-sharded value. `None` where `r` cannot
/// take a ring offset (a carry, or a view that already has one).
fn ring_view(buffers: &[Buffer], r: BufRef, ring: RingOffset) -> Option<BufRef> {
    if matches!(r, BufRef::View { ring: Some(_), .. }) {
        return None;
    }
    match sub_view(buffers, r, 0, ring.step).ok()? {
        BufRef::View { buffer, offset, bytes, stride, .. } => Some(BufRef::View { buffer, offset, bytes, stride, ring: Some(ring) }),
        _ => None,
    }
}

/// For a `ring_slice` or `ring_concat` node of `r`: the ring offset of its chunk `shift`
/// (`ring_slice`'s own shift; `ring_concat`'s operand number) when each chunk is a contiguous
/// run of bytes of the whole value (the dims before the ring's `dim` are all 1, as a
/// leading-axis slice), else `None`: the node stays a rank-local copy step.
fn ring_chunk(g: &Graph, r: &Region, node: &titan_ir::Node, shift: u32) -> Result<Option<RingOffset>, BuildError> {
    let (whole, dim, size) = match node.op {
        Op::RingSlice { dim, size, .. } => (node.inputs.first(), dim, size),
        Op::RingConcat { dim, size, .. } => (node.results.first(), dim, size),
        _ => return Ok(None),
    };
    let whole = *whole.ok_or_else(|| internal(format!("`{}` without its whole value", node.op.name())))?;
    let shape = shape_of(g, r, whole)?;
    let d = dim as usize;
    if size == 0 || d >= shape.len() || shape[..d].iter().any(|&x| x != 1) || !shape[d].is_multiple_of(u64::from(size)) {
        return Ok(None);
    }
    let step = bytes_of(r.ty(whole).dtype, &shape) / u64::from(size);
    Ok(Some(RingOffset { size, shift, step }))
}

/// Iteration `i`'s share of `r` (a `main` value with the leading `count` dimension) inside a
/// loop of `count` iterations.
fn layer_view(r: BufRef, count: u32) -> Result<BufRef, BuildError> {
    match r {
        BufRef::Buffer { buffer, layer: false } => Ok(BufRef::Buffer { buffer, layer: true }),
        BufRef::View { buffer, offset, bytes, stride: 0, ring: None } if count > 0 => {
            let per = bytes / u64::from(count);
            Ok(BufRef::View { buffer, offset, bytes: per, stride: per, ring: None })
        }
        other => Err(internal(format!("a stacked loop operand with storage {other:?}, which has no layer slices"))),
    }
}

/// Byte offset and length of a leading-axis `slice {axis, start, len}` of a value of `shape`
/// (the dims before `axis` are 1: `fuse` refuses other slices).
fn slice_range(dtype: DType, shape: &[u64], axis: u32, start: u64, len: u64) -> Result<(u64, u64), BuildError> {
    let a = axis as usize;
    if a >= shape.len() || shape[..a].iter().any(|&d| d != 1) || start + len > shape[a] {
        return Err(internal(format!("`slice` {{axis = {axis}, start = {start}, len = {len}}} of {shape:?} is not a leading-axis slice")));
    }
    let row = bytes_of(dtype, &shape[a + 1..]);
    Ok((start * row, len * row))
}

/// For each operand of a `concat` node of `r`: its byte offset and length in the result.
fn concat_parts(g: &Graph, r: &Region, node: &titan_ir::Node) -> Result<Vec<(u64, u64)>, BuildError> {
    let mut off = 0;
    let mut parts = Vec::new();
    for &v in &node.inputs {
        let n = bytes_of(r.ty(v).dtype, &shape_of(g, r, v)?);
        parts.push((off, n));
        off += n;
    }
    Ok(parts)
}

/// The buffer a `scatter_add` kernel with its add (fusion rule 12) writes its sum over: that of
/// the tensor it adds to, when the tensor is a whole buffer of its own that a `main` kernel
/// computed (not an argument or state, not a part of a concatenation) and nothing reads it
/// after this kernel (a step output is read at the end). The kernel then touches only the rows an index hits.
fn scatter_over(
    b: &Builder,
    groups: &mut Groups,
    used_after: &dyn Fn(&mut Groups, Value, usize) -> bool,
    node: &titan_ir::Node,
    p: usize,
) -> Result<Option<BufRef>, BuildError> {
    let main = &b.g.main;
    let Op::Kernel { body, kind: KernelKind::ScatterAdd } = node.op else { return Ok(None) };
    let blk = b.g.block(body);
    let ops: Vec<&titan_ir::Node> = blk.order.iter().map(|&n| blk.node(n)).collect();
    let [scatter, add] = ops.as_slice() else { return Ok(None) };
    let (Some(&table), [u, v]) = (scatter.results.first(), add.inputs.as_slice()) else { return Ok(None) };
    let x = if *u == table { *v } else { *u };
    let Some(k) = blk.args.iter().position(|a| a.value == x) else { return Ok(None) };
    let Some(&operand) = node.inputs.get(k) else { return Ok(None) };
    let owner = root(main, operand);
    let computed =
        matches!(main.values.get(owner.index()).map(|d| d.def), Some(ValueDef::Result { node, .. }) if matches!(main.node(node).op, Op::Kernel { .. }));
    let x_group = groups.find(operand.index());
    let read_twice = node.inputs.iter().enumerate().any(|(i, &w)| i != k && groups.find(w.index()) == x_group);
    if !computed || b.claim.contains_key(&owner) || read_twice || used_after(groups, operand, p) {
        return Ok(None);
    }
    let rf = b.main_ref(operand)?;
    let whole = matches!(rf, BufRef::Buffer { buffer, layer: false } if !b.concat_buffers.contains(&buffer));
    let [r] = node.results.as_slice() else { return Ok(None) };
    let same_type = main.ty(*r).dtype == main.ty(operand).dtype && shape_of(b.g, main, *r)? == shape_of(b.g, main, operand)?;
    Ok((whole && same_type).then_some(rf))
}

/// Follows `reshape` chains to the value that owns the bytes.
fn root(r: &Region, mut v: Value) -> Value {
    loop {
        match r.values.get(v.index()).map(|d| d.def) {
            Some(ValueDef::Result { node, .. }) => match r.nodes.get(node.index()) {
                Some(n) if matches!(n.op, Op::Reshape) && !n.inputs.is_empty() => v = n.inputs[0],
                _ => return v,
            },
            _ => return v,
        }
    }
}

/// Body argument indices that the body value `start` is computed from through pointwise ops,
/// casts and views, following only operands of the result's shape (not scalar factors).
fn trace_pointwise(g: &Graph, body: &Region, start: Value) -> Vec<usize> {
    let mut out = Vec::new();
    let mut stack = vec![start];
    let mut seen = HashSet::new();
    while let Some(v) = stack.pop() {
        if !seen.insert(v) {
            continue;
        }
        match body.values.get(v.index()).map(|d| d.def) {
            Some(ValueDef::Arg(i)) => out.push(i as usize),
            Some(ValueDef::Result { node, .. }) => {
                let Some(n) = body.nodes.get(node.index()) else { continue };
                if !(n.op.is_pointwise() || matches!(n.op, Op::Reshape)) {
                    continue;
                }
                let numel = body.ty(v).numel(&g.dims);
                let rank = body.ty(v).rank();
                for &i in &n.inputs {
                    let t = body.ty(i);
                    if t.numel(&g.dims) == numel && (t.rank() > 0 || rank == 0) {
                        stack.push(i);
                    }
                }
            }
            None => {}
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The `main` values holding parameter gradients (see the module documentation).
pub fn grad_values(g: &Graph) -> HashSet<Value> {
    let main = &g.main;
    let mut work = Vec::new();
    for n in &main.order {
        let node = main.node(*n);
        let Op::Kernel { body, kind: KernelKind::Optimizer } = node.op else { continue };
        let Some(b) = g.blocks.get(body.index()) else { continue };
        for bn in &b.order {
            let bnode = b.node(*bn);
            if let (Op::AdamW(_), Some(&grad)) = (&bnode.op, bnode.inputs.get(1)) {
                for i in trace_pointwise(g, b, grad) {
                    if let Some(&v) = node.inputs.get(i) {
                        work.push(v);
                    }
                }
            }
        }
    }
    let mut grads = HashSet::new();
    while let Some(v) = work.pop() {
        let Some(ValueDef::Result { node, index }) = main.values.get(v.index()).map(|d| d.def) else { continue };
        if !grads.insert(v) {
            continue;
        }
        let n = main.node(node);
        match n.op {
            Op::Reshape => work.extend(n.inputs.first().copied()),
            // Per-layer gradients concatenated (every-N-th layer checkpointing).
            Op::Concat { .. } => work.extend(n.inputs.iter().copied()),
            // A gradient reduced (or scattered) across ranks: its operand is the rank's partial gradient.
            ref op if is_collective_step(op) => work.extend(n.inputs.first().copied()),
            Op::Kernel { body, kind: KernelKind::Fused } => {
                let Some(b) = g.blocks.get(body.index()) else { continue };
                let Some(out) = b.outputs.get(index as usize) else { continue };
                for i in trace_pointwise(g, b, out.value) {
                    work.extend(n.inputs.get(i).copied());
                }
            }
            _ => {}
        }
    }
    grads
}

/// Union-find over `main` values: views share their source's group; stacked results of one
/// `repeat` that are views of the same block value share a group (and a buffer).
struct Groups {
    parent: Vec<usize>,
}

impl Groups {
    fn find(&mut self, mut x: usize) -> usize {
        while self.parent[x] != x {
            self.parent[x] = self.parent[self.parent[x]];
            x = self.parent[x];
        }
        x
    }

    fn union(&mut self, a: usize, b: usize) {
        let (ra, rb) = (self.find(a), self.find(b));
        if ra != rb {
            self.parent[ra.max(rb)] = ra.min(rb);
        }
    }
}

/// For each stacked result of a `repeat` (index into its results), the earlier stacked result
/// whose buffer it shares, if both are views of one block value.
fn shared_stacked(g: &Graph, node: &titan_ir::Node) -> Vec<Option<usize>> {
    let mut out = vec![None; node.results.len()];
    let Op::Repeat { block, carry, prefetch, .. } = node.op else { return out };
    let Some(b) = g.blocks.get(block.index()) else { return out };
    let mut first: HashMap<Value, usize> = HashMap::new();
    // Block output `carry + prefetch + k` is stacked result `carry + k`.
    for (j, o) in b.outputs.iter().enumerate().skip((carry + prefetch) as usize).map(|(j, o)| (j - prefetch as usize, o)) {
        let r = root(b, o.value);
        // An output rooted at a block argument is copied per layer; keep it separate.
        if matches!(b.values.get(r.index()).map(|d| d.def), Some(ValueDef::Arg(_))) {
            continue;
        }
        match first.get(&r) {
            Some(&k) if j < out.len() => out[j] = Some(k),
            _ => {
                first.insert(r, j);
            }
        }
    }
    out
}

struct Builder<'g> {
    g: &'g Graph,
    grads: HashSet<Value>,
    s: Storage,
    names: ValueNames,
    /// `main` values computed straight into their place in a `concat` result.
    claim: HashMap<Value, BufRef>,
    /// Buffers of `concat` results of `main` (never reused as a loop's carry slot).
    concat_buffers: HashSet<u32>,
}

impl Builder<'_> {
    fn label(&self, region: &Region, names: &ValueNames, v: Value) -> String {
        format!("{}.{}", region.name, names.get(v))
    }

    fn add(&mut self, name: String, dtype: DType, shape: Vec<u64>, class: BufferClass, scope: Option<u32>) -> u32 {
        let id = self.s.buffers.len() as u32;
        let bytes = bytes_of(dtype, &shape);
        self.s.buffers.push(Buffer { id, name, dtype, shape, bytes, class, arena: arena_of(class), offset: 0, state: None, feed: None, output: None });
        self.s.scope.push(scope);
        id
    }

    fn add_value(&mut self, v: Value, scope: Option<u32>) -> Result<u32, BuildError> {
        let main = &self.g.main;
        let class = if self.grads.contains(&v) { BufferClass::Grad } else { BufferClass::Activation };
        let shape = shape_of(self.g, main, v)?;
        let name = self.label(main, &self.names, v);
        Ok(self.add(name, main.ty(v).dtype, shape, class, scope))
    }

    fn main_ref(&self, v: Value) -> Result<BufRef, BuildError> {
        self.s.main.get(v.index()).copied().flatten().ok_or_else(|| internal(format!("main value {} is used before it has storage", self.names.get(v))))
    }

    fn main_buffer(&self, v: Value) -> Result<u32, BuildError> {
        match self.main_ref(v)? {
            BufRef::Buffer { buffer, layer: false } => Ok(buffer),
            other => Err(internal(format!("main value {} has storage {other:?}, not a whole buffer", self.names.get(v)))),
        }
    }
}

/// Give every value of the kernel graph `g` its storage (see the module documentation).
pub fn assign_storage(g: &Graph) -> Result<Storage, BuildError> {
    let main = &g.main;
    let mut b =
        Builder { g, grads: grad_values(g), s: Storage::default(), names: ValueNames::new(main), claim: HashMap::new(), concat_buffers: HashSet::new() };
    b.s.main = vec![None; main.values.len()];

    // Positions in main's order; outputs and updates read at the end.
    let end = main.order.len();
    let mut pos_of = HashMap::new();
    for (p, n) in main.order.iter().enumerate() {
        pos_of.insert(*n, p);
    }
    let mut groups = Groups { parent: (0..main.values.len()).collect() };
    for n in &main.order {
        let node = main.node(*n);
        match &node.op {
            Op::Reshape | Op::Slice { .. } => {
                if let (Some(&src), Some(&dst)) = (node.inputs.first(), node.results.first()) {
                    groups.union(src.index(), dst.index());
                }
            }
            Op::Repeat { .. } => {
                for (j, share) in shared_stacked(g, node).into_iter().enumerate() {
                    if let Some(k) = share {
                        groups.union(node.results[k].index(), node.results[j].index());
                    }
                }
            }
            _ => {}
        }
    }
    let mut last_use: HashMap<usize, usize> = HashMap::new();
    let mut touch = |groups: &mut Groups, v: Value, p: usize| {
        let r = groups.find(v.index());
        let e = last_use.entry(r).or_insert(p);
        *e = (*e).max(p);
    };
    for (p, n) in main.order.iter().enumerate() {
        for &v in &main.node(*n).inputs {
            touch(&mut groups, v, p);
        }
    }
    for o in &main.outputs {
        touch(&mut groups, o.value, end);
    }
    for u in &main.updates {
        touch(&mut groups, u.value, end);
        touch(&mut groups, u.state, end);
    }
    let used_after = |groups: &mut Groups, v: Value, p: usize| last_use.get(&groups.find(v.index())).is_some_and(|&l| l > p);

    // Arguments.
    for (i, a) in main.args.iter().enumerate() {
        let v = a.value;
        let shape = shape_of(g, main, v)?;
        let dtype = main.ty(v).dtype;
        let name = b.label(main, &b.names, v);
        let id = match &a.kind {
            ArgKind::Input => {
                let id = b.add(name, dtype, shape, BufferClass::Input, None);
                b.s.buffers[id as usize].feed = Some(main.value(v).name.clone().unwrap_or_else(|| format!("input{i}")));
                id
            }
            ArgKind::State(info) | ArgKind::Param(info) => {
                let optimizer = info.name.ends_with(".exp_avg") || info.name.ends_with(".exp_avg_sq");
                let class = if info.init == titan_ir::Init::ComputeCopy {
                    BufferClass::ComputeCopy
                } else if optimizer {
                    BufferClass::OptimizerState
                } else {
                    BufferClass::Param
                };
                let id = b.add(name, dtype, shape, class, None);
                b.s.buffers[id as usize].state = Some(StateInfo { name: info.name.clone(), init: info.init.to_attr().to_string() });
                id
            }
            ArgKind::Block => return Err(internal("`main` has a block argument")),
        };
        b.s.main[v.index()] = Some(BufRef::Buffer { buffer: id, layer: false });
    }

    // Concatenations, outermost first: each result gets a buffer (or its place in an enclosing
    // concat's), and an operand computed by a kernel or a loop, read by nothing else of the
    // concat, is written straight into its place there; the others are copied at the concat.
    let updated: HashSet<Value> = main.updates.iter().map(|u| u.value).collect();
    let outputs: HashSet<Value> = main.outputs.iter().map(|o| o.value).collect();
    let mut concat_dst: HashMap<Value, BufRef> = HashMap::new();
    let mut ring_parts: HashMap<NodeId, Vec<BufRef>> = HashMap::new();
    for n in main.order.iter().rev() {
        let node = main.node(*n);
        if let Op::RingConcat { .. } = node.op {
            // Async TP's chunks in ring order: each computed straight into its rows of the
            // assembled value (a ring view) where the layout allows it.
            let Some(ring) = ring_chunk(g, main, node, 0)? else { continue };
            let &res = node.results.first().ok_or_else(|| internal("`ring_concat` without a result"))?;
            let dst = match b.claim.get(&res) {
                Some(&d) => d,
                None => BufRef::Buffer { buffer: b.add_value(res, None)?, layer: false },
            };
            let parts: Option<Vec<BufRef>> = (0..ring.size).map(|k| ring_view(&b.s.buffers, dst, RingOffset { shift: k, ..ring })).collect();
            let Some(parts) = parts else { continue };
            b.s.ring_views.insert(*n);
            concat_dst.insert(res, dst);
            for (k, &v) in node.inputs.iter().enumerate() {
                let r = root(main, v);
                let twice = node.inputs.iter().enumerate().any(|(j, &w)| j != k && root(main, w) == r);
                if !twice && !b.claim.contains_key(&r) && !updated.contains(&r) && !outputs.contains(&r) && computed_in_place(g, r) {
                    b.claim.insert(r, parts[k]);
                }
            }
            ring_parts.insert(*n, parts);
            continue;
        }
        if !matches!(node.op, Op::Concat { .. }) {
            continue;
        }
        let &res = node.results.first().ok_or_else(|| internal("`concat` without a result"))?;
        let dst = match b.claim.get(&res) {
            Some(&d) => d,
            None => {
                let id = b.add_value(res, None)?;
                b.concat_buffers.insert(id);
                BufRef::Buffer { buffer: id, layer: false }
            }
        };
        concat_dst.insert(res, dst);
        for (k, (&v, (off, len))) in node.inputs.iter().zip(concat_parts(g, main, node)?).enumerate() {
            let r = root(main, v);
            let twice = node.inputs.iter().enumerate().any(|(j, &w)| j != k && root(main, w) == r);
            if !twice && !b.claim.contains_key(&r) && !updated.contains(&r) && !outputs.contains(&r) && computed_in_place(g, r) {
                let part = sub_view(&b.s.buffers, dst, off, len)?;
                b.claim.insert(r, part);
            }
        }
    }

    // In-place updates: `%v` is written into `%p`'s buffer when `%v` is a kernel result and
    // nothing reads `%p` after that kernel.
    let mut in_place: HashMap<Value, Value> = HashMap::new();
    let mut late_updates = Vec::new();
    for u in &main.updates {
        let ok = match main.values.get(u.value.index()).map(|d| d.def) {
            Some(ValueDef::Result { node, .. }) => {
                let is_kernel = matches!(main.node(node).op, Op::Kernel { .. });
                let p = pos_of.get(&node).copied().unwrap_or(end);
                let state_read_after =
                    main.order.iter().skip(p + 1).any(|n| main.node(*n).inputs.iter().any(|&i| groups.find(i.index()) == groups.find(u.state.index())))
                        || main.outputs.iter().any(|o| groups.find(o.value.index()) == groups.find(u.state.index()));
                is_kernel && !state_read_after && !in_place.contains_key(&u.value) && groups.find(u.value.index()) == u.value.index()
            }
            _ => false,
        };
        if ok {
            in_place.insert(u.value, u.state);
        } else {
            late_updates.push(u.clone());
        }
    }

    let mut loop_index = 0u32;
    for (p, n) in main.order.iter().enumerate() {
        let node = main.node(*n);
        match &node.op {
            Op::RingConcat { .. } if b.s.ring_views.contains(n) => {
                let &res = node.results.first().ok_or_else(|| internal("`ring_concat` without a result"))?;
                let dst = *concat_dst.get(&res).ok_or_else(|| internal("`ring_concat` result without a buffer"))?;
                let parts = ring_parts.get(n).ok_or_else(|| internal("`ring_concat` without its ring views"))?;
                for (&v, &part) in node.inputs.iter().zip(parts) {
                    let src = b.main_ref(v)?;
                    if src != part {
                        let bytes = ref_bytes(&b.s.buffers, &[], part);
                        b.s.concat_copies.entry(*n).or_default().push(CopyOp { src, dst: part, bytes });
                    }
                }
                b.s.main[res.index()] = Some(dst);
            }
            Op::RingSlice { shift, .. }
                if ring_chunk(g, main, node, *shift)?.and_then(|ring| ring_view(&b.s.buffers, b.main_ref(node.inputs[0]).ok()?, ring)).is_some() =>
            {
                let ring = ring_chunk(g, main, node, *shift)?.ok_or_else(|| internal("a ring view"))?;
                let rf = ring_view(&b.s.buffers, b.main_ref(node.inputs[0])?, ring).ok_or_else(|| internal("a ring view"))?;
                let &dst = node.results.first().ok_or_else(|| internal("`ring_slice` without a result"))?;
                b.s.main[dst.index()] = Some(rf);
                b.s.ring_views.insert(*n);
            }
            op if is_collective_step(op) => {
                // A collective writes a fresh buffer (never its operand's: ranks read it); a
                // rank-local `ring_concat` may write its place in a `concat`.
                for &r in &node.results {
                    let rf = match b.claim.get(&r) {
                        Some(&part) if matches!(op, Op::RingConcat { .. }) => part,
                        _ => BufRef::Buffer { buffer: b.add_value(r, None)?, layer: false },
                    };
                    b.s.main[r.index()] = Some(rf);
                }
            }
            Op::Kernel { .. } => {
                let over = scatter_over(&b, &mut groups, &used_after, node, p)?;
                for &r in &node.results {
                    let rf = match (in_place.get(&r), b.claim.get(&r), over) {
                        (Some(&state), _, _) => b.main_ref(state)?,
                        (None, Some(&part), _) => part,
                        (None, None, Some(x)) => x,
                        (None, None, None) => BufRef::Buffer { buffer: b.add_value(r, None)?, layer: false },
                    };
                    b.s.main[r.index()] = Some(rf);
                }
            }
            Op::Slice { axis, start, len } => {
                let (Some(&src), Some(&dst)) = (node.inputs.first(), node.results.first()) else {
                    return Err(internal("`slice` without operand or result"));
                };
                let (off, n) = slice_range(main.ty(src).dtype, &shape_of(g, main, src)?, *axis, *start, *len)?;
                let rf = sub_view(&b.s.buffers, b.main_ref(src)?, off, n)?;
                b.s.main[dst.index()] = Some(rf);
            }
            Op::Concat { .. } => {
                let &res = node.results.first().ok_or_else(|| internal("`concat` without a result"))?;
                let dst = *concat_dst.get(&res).ok_or_else(|| internal("`concat` result without a buffer"))?;
                for (&v, (off, len)) in node.inputs.iter().zip(concat_parts(g, main, node)?) {
                    let part = sub_view(&b.s.buffers, dst, off, len)?;
                    let src = b.main_ref(v)?;
                    if src != part {
                        b.s.concat_copies.entry(*n).or_default().push(CopyOp { src, dst: part, bytes: len });
                    }
                }
                b.s.main[res.index()] = Some(dst);
            }
            Op::Reshape => {
                let (Some(&src), Some(&dst)) = (node.inputs.first(), node.results.first()) else {
                    return Err(internal("`reshape` without operand or result"));
                };
                let rf = b.main_ref(src)?;
                b.s.main[dst.index()] = Some(rf);
            }
            Op::Repeat { block, count, carry, stacked, prefetch, .. } => {
                let shape = LoopShape { block: *block, count: *count, carry: *carry, stacked: *stacked, prefetch: *prefetch };
                let ls = assign_loop(&mut b, &mut groups, &used_after, *n, node, p, shape, loop_index)?;
                loop_index += 1;
                b.s.loops.insert(*n, ls);
            }
            other => {
                return Err(internal(format!("`{}` in `main` of the kernel graph; the fusion pass should have put it into a kernel", other.name())));
            }
        }
    }

    for u in late_updates {
        let src = b.main_ref(u.value)?;
        let dst = b.main_ref(u.state)?;
        let bytes = ref_bytes(&b.s.buffers, &[], dst);
        b.s.final_copies.push(CopyOp { src, dst, bytes });
    }
    for o in &main.outputs {
        let Some(name) = &o.name else { continue };
        let id = b.main_buffer(o.value)?;
        if b.s.buffers[id as usize].output.is_none() {
            b.s.buffers[id as usize].output = Some(name.clone());
        } else {
            let copy = b.add_value(o.value, None)?;
            b.s.buffers[copy as usize].name = format!("main.output.{name}");
            b.s.buffers[copy as usize].output = Some(name.clone());
            let bytes = b.s.buffers[id as usize].bytes;
            b.s.final_copies.push(CopyOp { src: BufRef::Buffer { buffer: id, layer: false }, dst: BufRef::Buffer { buffer: copy, layer: false }, bytes });
        }
    }
    Ok(b.s)
}

/// Whether `main` value `v` is a result a step computes into a buffer of the plan's choosing: a
/// kernel or `ring_concat` result, or a stacked result of a loop that no other stacked result
/// shares.
fn computed_in_place(g: &Graph, v: Value) -> bool {
    let main = &g.main;
    let Some(ValueDef::Result { node, index }) = main.values.get(v.index()).map(|d| d.def) else { return false };
    let n = main.node(node);
    match n.op {
        // A `ring_concat` writes its result (as a step, or through its chunks' ring views).
        Op::Kernel { .. } | Op::RingConcat { .. } => true,
        Op::Repeat { carry, .. } => {
            let shares = shared_stacked(g, n);
            let j = index as usize;
            j >= carry as usize && shares.get(j).is_some_and(Option::is_none) && !shares.contains(&Some(j))
        }
        _ => false,
    }
}

/// The attributes of a `repeat` node.
#[derive(Clone, Copy)]
struct LoopShape {
    block: titan_ir::BlockId,
    count: u32,
    carry: u32,
    stacked: u32,
    prefetch: u32,
}

/// The buffer a loop block's `concat` or `ring_concat` result `res` is assembled in: the output
/// slot that claimed it, else a temporary of the loop named `name`.
fn concat_buffer(
    b: &mut Builder<'_>,
    g: &Graph,
    blk: &Region,
    claim: &HashMap<Value, BufRef>,
    res: Value,
    name: String,
    scope: Option<u32>,
) -> Result<BufRef, BuildError> {
    Ok(match claim.get(&res) {
        Some(&d) => d,
        None => BufRef::Buffer { buffer: b.add(name, blk.ty(res).dtype, shape_of(g, blk, res)?, BufferClass::Activation, scope), layer: false },
    })
}

/// A carried value the block also saves (stacked output `saved`, a result index): the layer
/// inputs of a forward loop, which the backward reads. Such a carry lives in one buffer of
/// `count + 1` slices (`shape`): iteration `i` reads slice `i` and writes slice `i + 1`, the
/// first `count` slices are the saved result and the last the final carried value. Ping-pong
/// slots would need a copy of the carry into the saved slice every iteration (16 copies of the
/// residual stream a step on Llama-3.2 1B).
#[derive(Clone, Debug)]
struct CarryStack {
    saved: usize,
    slice: u64,
    shape: Vec<u64>,
}

/// For each carried argument of a `repeat`, its [`CarryStack`] if it has one: a forward loop
/// (not reversed) whose block outputs the argument itself as a stacked output that no other
/// stacked result shares or a `concat` claims, of `count` slices of the carry's type.
fn carry_stacks(
    b: &Builder<'_>,
    blk: &Region,
    node: &titan_ir::Node,
    shape: LoopShape,
    shares: &[Option<usize>],
) -> Result<Vec<Option<CarryStack>>, BuildError> {
    let (g, main) = (b.g, &b.g.main);
    let (carry, np) = (shape.carry as usize, shape.prefetch as usize);
    let reverse = matches!(node.op, Op::Repeat { reverse: true, .. });
    let mut out = vec![None; carry];
    if reverse {
        return Ok(out);
    }
    for (c, slot) in out.iter_mut().enumerate() {
        let arg = blk.args[c].value;
        let result = node.results[c];
        let dims = shape_of(g, main, result)?;
        let slice = bytes_of(main.ty(result).dtype, &dims);
        let saved = (carry..node.results.len()).find(|&j| {
            let r = node.results[j];
            root(blk, blk.outputs[j + np].value) == arg
                && shares.get(j).is_some_and(Option::is_none)
                && !shares.contains(&Some(j))
                && !b.claim.contains_key(&r)
                && main.ty(r).dtype == main.ty(result).dtype
                && shape_of(g, main, r).is_ok_and(|s| s.first() == Some(&u64::from(shape.count)) && s[1..] == dims[..])
        });
        if let Some(saved) = saved {
            let mut shape = vec![u64::from(shape.count) + 1];
            shape.extend(&dims);
            *slot = Some(CarryStack { saved, slice, shape });
        }
    }
    // Two carries saved into one stacked output would share it.
    let saved: Vec<usize> = out.iter().flatten().map(|s| s.saved).collect();
    for s in out.iter_mut() {
        if s.as_ref().is_some_and(|st| saved.iter().filter(|&&x| x == st.saved).count() > 1) {
            *s = None;
        }
    }
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn assign_loop(
    b: &mut Builder<'_>,
    groups: &mut Groups,
    used_after: &dyn Fn(&mut Groups, Value, usize) -> bool,
    nid: NodeId,
    node: &titan_ir::Node,
    p: usize,
    shape: LoopShape,
    index: u32,
) -> Result<LoopStorage, BuildError> {
    let LoopShape { block, count, carry, stacked, prefetch } = shape;
    let g = b.g;
    let main = &g.main;
    let blk = g.blocks.get(block.index()).ok_or_else(|| internal(format!("repeat {nid} names a missing block")))?;
    let (carry, stacked, np) = (carry as usize, stacked as usize, prefetch as usize);
    if node.inputs.len() + np != blk.args.len()
        || node.results.len() + np != blk.outputs.len()
        || carry > node.results.len()
        || carry + stacked > node.inputs.len()
    {
        return Err(internal(format!("repeat of @{} does not match the block's arguments and outputs", blk.name)));
    }
    let mut ls = LoopStorage { index, values: vec![None; blk.values.len()], ..LoopStorage::default() };
    let mut claimed_slot0: HashSet<u32> = HashSet::new();
    let shares = shared_stacked(g, node);
    let stacks = carry_stacks(b, blk, node, shape, &shares)?;
    let mut stack_buffers: HashMap<usize, u32> = HashMap::new();
    // Slot pairs in `ls.carries` of the block's carried arguments (stacked carries have none).
    let mut slots = 0u32;
    let slot_of: Vec<u32> = (0..carry + np)
        .map(|i| match stacks.get(i) {
            Some(Some(_)) => u32::MAX,
            _ => {
                slots += 1;
                slots - 1
            }
        })
        .collect();

    // Carried values: two slots each, or a stack (see [`carry_stacks`]).
    for (c, stack) in stacks.iter().enumerate() {
        let operand = node.inputs[c];
        let result = node.results[c];
        let src = b.main_ref(operand)?;
        if let Some(st) = stack {
            let id = b.add(format!("{}.stack", b.label(main, &b.names, result)), main.ty(result).dtype, st.shape.clone(), BufferClass::Activation, None);
            stack_buffers.insert(c, id);
            let first = BufRef::View { buffer: id, offset: 0, bytes: st.slice, stride: 0, ring: None };
            ls.copies_before.push(CopyOp { src, dst: first, bytes: st.slice });
            let last = BufRef::View { buffer: id, offset: u64::from(count) * st.slice, bytes: st.slice, stride: 0, ring: None };
            b.s.main[result.index()] = Some(last);
            continue;
        }
        let reuse = match src {
            BufRef::Buffer { buffer, layer: false } => {
                let buf = &b.s.buffers[buffer as usize];
                let class_ok = matches!(buf.class, BufferClass::Activation) && buf.output.is_none();
                let is_arg = matches!(main.values.get(operand.index()).map(|d| d.def), Some(ValueDef::Arg(_)));
                let same_size = buf.bytes == bytes_of(main.ty(result).dtype, &shape_of(g, main, result)?);
                // The loop must not read the operand any other way: iteration 1 overwrites slot 0.
                let g_op = groups.find(operand.index());
                let other_use = node.inputs.iter().enumerate().any(|(i, &v)| i != c && groups.find(v.index()) == g_op);
                let concat = b.concat_buffers.contains(&buffer);
                (class_ok && !is_arg && !concat && same_size && !other_use && !used_after(groups, operand, p) && claimed_slot0.insert(buffer)).then_some(buffer)
            }
            _ => None,
        };
        let slot0 = match reuse {
            Some(id) => id,
            None => {
                let id = b.add_value(result, None)?;
                b.s.buffers[id as usize].class = BufferClass::Activation;
                b.s.buffers[id as usize].arena = Arena::Activations;
                b.s.buffers[id as usize].name.push_str(".slot0");
                let bytes = b.s.buffers[id as usize].bytes;
                ls.copies_before.push(CopyOp { src, dst: BufRef::Buffer { buffer: id, layer: false }, bytes });
                id
            }
        };
        let slot1 = b.add_value(result, None)?;
        b.s.buffers[slot1 as usize].class = BufferClass::Activation;
        b.s.buffers[slot1 as usize].arena = Arena::Activations;
        b.s.buffers[slot1 as usize].name.push_str(".slot1");
        let slots = [slot0, slot1];
        ls.carries.push(slots);
        b.s.main[result.index()] = Some(BufRef::Buffer { buffer: slots[(count % 2) as usize], layer: false });
    }
    // Prefetched carries (the next layer's gathered weights): two fresh slots each, written
    // first by the loop's prologue, never read after the loop.
    let bnames = ValueNames::new(blk);
    for k in 0..np {
        let arg = blk.args[carry + k].value;
        let shape = shape_of(g, blk, arg)?;
        let slots = [0, 1].map(|s| {
            let name = format!("{}.{}.slot{s}", blk.name, bnames.get(arg));
            b.add(name, blk.ty(arg).dtype, shape.clone(), BufferClass::Activation, None)
        });
        ls.carries.push(slots);
    }

    // Stacked results.
    for (j, share) in shares.iter().enumerate().skip(carry) {
        // Result `j` is block output `j + np`.
        let r = node.results[j];
        if let Some(c) = (0..carry).find(|&c| stacks[c].as_ref().is_some_and(|st| st.saved == j)) {
            // A carry's stack: its first `count` slices are the layers' inputs.
            let st = stacks[c].as_ref().ok_or_else(|| internal("a carry stack"))?;
            let id = *stack_buffers.get(&c).ok_or_else(|| internal("a carry stack without its buffer"))?;
            b.s.main[r.index()] = Some(BufRef::View { buffer: id, offset: 0, bytes: u64::from(count) * st.slice, stride: 0, ring: None });
            continue;
        }
        let rf = match (*share, b.claim.get(&r)) {
            (Some(k), _) => b.main_ref(node.results[k])?,
            (None, Some(&part)) => part,
            (None, None) => BufRef::Buffer { buffer: b.add_value(r, None)?, layer: false },
        };
        b.s.main[r.index()] = Some(rf);
    }

    // Block arguments.
    for (i, a) in blk.args.iter().enumerate() {
        // Block argument `i >= carry + np` is operand `i - np`.
        let rf = if let Some(&id) = stack_buffers.get(&i) {
            let slice = stacks[i].as_ref().map_or(0, |st| st.slice);
            BufRef::View { buffer: id, offset: 0, bytes: slice, stride: slice, ring: None }
        } else if i < carry + np {
            BufRef::Carry { carry: slot_of[i], out: false }
        } else if i < carry + np + stacked {
            layer_view(b.main_ref(node.inputs[i - np])?, count)?
        } else {
            b.main_ref(node.inputs[i - np])?
        };
        ls.values[a.value.index()] = Some(rf);
    }

    // Block outputs: the first output rooted at a kernel result claims it; the rest copy.
    let out_ref = |j: usize| -> Result<BufRef, BuildError> {
        if let Some(&id) = stack_buffers.get(&j) {
            let slice = stacks[j].as_ref().map_or(0, |st| st.slice);
            Ok(BufRef::View { buffer: id, offset: slice, bytes: slice, stride: slice, ring: None })
        } else if j < carry + np {
            Ok(BufRef::Carry { carry: slot_of[j], out: true })
        } else {
            match b.s.main[node.results[j - np].index()] {
                Some(r) => layer_view(r, count),
                None => Err(internal("stacked result without a buffer")),
            }
        }
    };
    let mut claim: HashMap<Value, BufRef> = HashMap::new();
    let mut pending: Vec<(Value, BufRef)> = Vec::new();
    let mut seen_dst: Vec<BufRef> = Vec::new();
    for (j, o) in blk.outputs.iter().enumerate() {
        let dst = out_ref(j)?;
        if seen_dst.contains(&dst) {
            // A stacked output sharing an earlier one's buffer: already written.
            continue;
        }
        seen_dst.push(dst);
        let r = root(blk, o.value);
        // An argument, or a slice (a view of other bytes), is copied into the output.
        let is_arg = match blk.values.get(r.index()).map(|d| d.def) {
            Some(ValueDef::Arg(_)) => true,
            Some(ValueDef::Result { node, .. }) => matches!(blk.node(node).op, Op::Slice { .. }),
            None => false,
        };
        if !is_arg && !claim.contains_key(&r) {
            claim.insert(r, dst);
        } else {
            pending.push((r, dst));
        }
    }

    let scope = Some(index);
    // Concatenations of the block, outermost first, as in `main`: a result claimed by an
    // output is built in the output's slot or slice, else in a temporary of the loop.
    let mut concat_dst: HashMap<Value, BufRef> = HashMap::new();
    let mut ring_parts: HashMap<NodeId, Vec<BufRef>> = HashMap::new();
    for n in blk.order.iter().rev() {
        let bn = blk.node(*n);
        if let Op::RingConcat { .. } = bn.op {
            // As in `main`: the chunks are computed into their rows of the assembled value.
            let Some(ring) = ring_chunk(g, blk, bn, 0)? else { continue };
            let &res = bn.results.first().ok_or_else(|| internal("`ring_concat` without a result"))?;
            let dst = concat_buffer(b, g, blk, &claim, res, format!("{}.{}", blk.name, bnames.get(res)), scope)?;
            let parts: Option<Vec<BufRef>> = (0..ring.size).map(|k| ring_view(&b.s.buffers, dst, RingOffset { shift: k, ..ring })).collect();
            let Some(parts) = parts else { continue };
            ls.ring_views.insert(*n);
            concat_dst.insert(res, dst);
            for (k, &v) in bn.inputs.iter().enumerate() {
                let r = root(blk, v);
                let twice = bn.inputs.iter().enumerate().any(|(j, &w)| j != k && root(blk, w) == r);
                let computed = match blk.values.get(r.index()).map(|d| d.def) {
                    Some(ValueDef::Result { node, .. }) => {
                        let op = &blk.node(node).op;
                        matches!(op, Op::Kernel { .. }) || (is_collective_step(op) && !matches!(op, Op::RingSlice { .. } | Op::RingConcat { .. }))
                    }
                    _ => false,
                };
                if computed && !twice && !claim.contains_key(&r) {
                    claim.insert(r, parts[k]);
                }
            }
            ring_parts.insert(*n, parts);
            continue;
        }
        if !matches!(bn.op, Op::Concat { .. }) {
            continue;
        }
        let &res = bn.results.first().ok_or_else(|| internal("`concat` without a result"))?;
        let dst = concat_buffer(b, g, blk, &claim, res, format!("{}.{}", blk.name, bnames.get(res)), scope)?;
        concat_dst.insert(res, dst);
        for (k, (&v, (off, len))) in bn.inputs.iter().zip(concat_parts(g, blk, bn)?).enumerate() {
            let r = root(blk, v);
            let twice = bn.inputs.iter().enumerate().any(|(j, &w)| j != k && root(blk, w) == r);
            let computed = match blk.values.get(r.index()).map(|d| d.def) {
                Some(ValueDef::Result { node, .. }) => matches!(blk.node(node).op, Op::Kernel { .. }) || is_collective_step(&blk.node(node).op),
                _ => false,
            };
            if computed && !twice && !claim.contains_key(&r) {
                claim.insert(r, sub_view(&b.s.buffers, dst, off, len)?);
            }
        }
    }
    let mut producer: HashMap<Value, NodeId> = HashMap::new();
    for n in &blk.order {
        let bn = blk.node(*n);
        match &bn.op {
            Op::RingConcat { .. } if ls.ring_views.contains(n) => {
                let &res = bn.results.first().ok_or_else(|| internal("`ring_concat` without a result"))?;
                let dst = *concat_dst.get(&res).ok_or_else(|| internal("`ring_concat` result without storage"))?;
                let parts = ring_parts.get(n).ok_or_else(|| internal("`ring_concat` without its ring views"))?;
                for (&v, &part) in bn.inputs.iter().zip(parts) {
                    let src = ls.values[v.index()].ok_or_else(|| internal(format!("a `ring_concat` operand of @{} has no storage", blk.name)))?;
                    if src != part {
                        let bytes = ref_bytes(&b.s.buffers, &ls.carries, part);
                        ls.copies_after.entry(*n).or_default().push(CopyOp { src, dst: part, bytes });
                    }
                }
                ls.values[res.index()] = Some(dst);
                producer.insert(res, *n);
            }
            Op::RingSlice { shift, .. }
                if ring_chunk(g, blk, bn, *shift)?.and_then(|ring| ring_view(&b.s.buffers, ls.values[bn.inputs[0].index()]?, ring)).is_some() =>
            {
                let ring = ring_chunk(g, blk, bn, *shift)?.ok_or_else(|| internal("a ring view"))?;
                let whole = ls.values[bn.inputs[0].index()].ok_or_else(|| internal(format!("a `ring_slice` operand of @{} has no storage", blk.name)))?;
                let rf = ring_view(&b.s.buffers, whole, ring).ok_or_else(|| internal("a ring view"))?;
                let &dst = bn.results.first().ok_or_else(|| internal("`ring_slice` without a result"))?;
                ls.values[dst.index()] = Some(rf);
                ls.ring_views.insert(*n);
                if let Some(&p) = producer.get(&root(blk, bn.inputs[0])) {
                    producer.insert(dst, p);
                }
            }
            op if matches!(op, Op::Kernel { .. }) || is_collective_step(op) => {
                for &r in &bn.results {
                    producer.insert(r, *n);
                    let rf = match claim.get(&r) {
                        Some(&dst) => dst,
                        None => {
                            let shape = shape_of(g, blk, r)?;
                            let name = format!("{}.{}", blk.name, bnames.get(r));
                            BufRef::Buffer { buffer: b.add(name, blk.ty(r).dtype, shape, BufferClass::Activation, scope), layer: false }
                        }
                    };
                    ls.values[r.index()] = Some(rf);
                }
            }
            Op::Reshape => {
                let (Some(&src), Some(&dst)) = (bn.inputs.first(), bn.results.first()) else {
                    return Err(internal("`reshape` without operand or result"));
                };
                ls.values[dst.index()] = ls.values[src.index()];
            }
            Op::Slice { axis, start, len } => {
                let (Some(&src), Some(&dst)) = (bn.inputs.first(), bn.results.first()) else {
                    return Err(internal("`slice` without operand or result"));
                };
                let (off, n) = slice_range(blk.ty(src).dtype, &shape_of(g, blk, src)?, *axis, *start, *len)?;
                let whole = ls.values[src.index()].ok_or_else(|| internal(format!("a `slice` operand of @{} has no storage", blk.name)))?;
                ls.values[dst.index()] = Some(sub_view(&b.s.buffers, whole, off, n)?);
                if let Some(&p) = producer.get(&root(blk, src)) {
                    producer.insert(dst, p);
                }
            }
            Op::Concat { .. } => {
                let &res = bn.results.first().ok_or_else(|| internal("`concat` without a result"))?;
                let dst = *concat_dst.get(&res).ok_or_else(|| internal("`concat` result without storage"))?;
                for (&v, (off, len)) in bn.inputs.iter().zip(concat_parts(g, blk, bn)?) {
                    let part = sub_view(&b.s.buffers, dst, off, len)?;
                    let src = ls.values[v.index()].ok_or_else(|| internal(format!("a `concat` operand of @{} has no storage", blk.name)))?;
                    if src != part {
                        ls.copies_after.entry(*n).or_default().push(CopyOp { src, dst: part, bytes: len });
                    }
                }
                ls.values[res.index()] = Some(dst);
                producer.insert(res, *n);
            }
            other => {
                return Err(internal(format!("`{}` in @{} of the kernel graph; the fusion pass should have put it into a kernel", other.name(), blk.name)));
            }
        }
    }
    for (r, dst) in pending {
        let src = ls.values.get(r.index()).copied().flatten().ok_or_else(|| internal(format!("output of @{} has no storage", blk.name)))?;
        if src == dst {
            // A carry's stack: the layer's input is already its saved slice.
            continue;
        }
        let bytes = ref_bytes(&b.s.buffers, &ls.carries, dst);
        let op = CopyOp { src, dst, bytes };
        match producer.get(&r) {
            Some(n) => ls.copies_after.entry(*n).or_default().push(op),
            None => ls.copies_at_start.push(op),
        }
    }
    Ok(ls)
}

/// The lifetime of every buffer over the linearized `steps` (`None`: never touched): the rule
/// of `titan_ir::artifact::liveness` (which the loader checks plans against), over the planner's
/// own loop scopes.
pub fn lifetimes(storage: &Storage, steps: &[Step]) -> Vec<Option<Lifetime>> {
    let pinned = liveness::pinned_in_loops(steps);
    let temporary_of = |id: u32| {
        if pinned.binary_search(&id).is_ok() {
            return None;
        }
        storage.scope.get(id as usize).copied().flatten().map(|l| l as usize)
    };
    liveness::lifetimes(storage.buffers.len(), steps, temporary_of, |i| storage.buffers[i].output.is_some())
}

/// Best-fit placement of buffers with lifetimes in one arena; returns the arena size.
fn best_fit(buffers: &mut [Buffer], ids: &[usize], lt: &[Option<Lifetime>]) -> u64 {
    let mut order: Vec<usize> = ids.to_vec();
    let life = |i: usize| lt[i].unwrap_or(Lifetime { start: 0, end: 0 });
    order.sort_by_key(|&i| (life(i).start, std::cmp::Reverse(align(buffers[i].bytes)), i));
    // Free holes: offset -> size, adjacent holes merged; `top` is the heap's end.
    let mut holes: BTreeMap<u64, u64> = BTreeMap::new();
    let mut top = 0u64;
    let mut high = 0u64;
    // Live buffers ordered by end: (end, offset, size).
    let mut live: Vec<(u32, u64, u64)> = Vec::new();
    for i in order {
        let l = life(i);
        let size = align(buffers[i].bytes);
        // Free everything whose last use is before this buffer's first.
        live.sort_unstable();
        let split = live.partition_point(|&(e, _, _)| e < l.start);
        for (_, off, sz) in live.drain(..split) {
            free(&mut holes, &mut top, off, sz);
        }
        if size == 0 {
            buffers[i].offset = 0;
            continue;
        }
        let best = holes.iter().filter(|&(_, &s)| s >= size).min_by_key(|&(&o, &s)| (s, o)).map(|(&o, &s)| (o, s));
        let off = match best {
            Some((o, s)) => {
                holes.remove(&o);
                if s > size {
                    holes.insert(o + size, s - size);
                }
                o
            }
            None => match holes.iter().next_back().map(|(&o, &s)| (o, s)) {
                // The last hole touches the top: grow the heap from there.
                Some((o, s)) if o + s == top => {
                    holes.remove(&o);
                    top = o + size;
                    o
                }
                _ => {
                    let o = top;
                    top += size;
                    o
                }
            },
        };
        high = high.max(top);
        buffers[i].offset = off;
        live.push((l.end, off, size));
    }
    high
}

fn free(holes: &mut BTreeMap<u64, u64>, top: &mut u64, off: u64, size: u64) {
    let mut start = off;
    let mut len = size;
    if let Some((&po, &ps)) = holes.range(..off).next_back()
        && po + ps == off
    {
        holes.remove(&po);
        start = po;
        len += ps;
    }
    if let Some(&ns) = holes.get(&(off + size)) {
        holes.remove(&(off + size));
        len += ns;
    }
    if start + len == *top {
        *top = start;
    } else {
        holes.insert(start, len);
    }
}

/// Assign offsets to every buffer and size the arenas (see the module documentation).
pub fn place(buffers: &mut [Buffer], lt: &[Option<Lifetime>]) -> MemoryPlan {
    let mut arenas = Vec::new();
    for a in ARENAS {
        let ids: Vec<usize> = (0..buffers.len()).filter(|&i| buffers[i].arena == a).collect();
        let bytes = match a {
            Arena::Activations => best_fit(buffers, &ids, lt),
            _ => {
                let mut off = 0;
                for &i in &ids {
                    buffers[i].offset = off;
                    off += align(buffers[i].bytes);
                }
                off
            }
        };
        arenas.push(ArenaPlan { arena: a, bytes });
    }
    let peak_bytes = arenas.iter().map(|a| a.bytes).sum();
    let activation_bytes_unplanned = buffers.iter().filter(|b| b.arena == Arena::Activations).map(|b| align(b.bytes)).sum();
    MemoryPlan { arenas, peak_bytes, activation_bytes_unplanned }
}

/// Pairs of distinct buffers of one arena whose lifetimes overlap and whose bytes intersect
/// (empty for a correct plan). Buffers without a lifetime count as live for the whole step in
/// the packed arenas.
pub fn overlapping_buffers(buffers: &[Buffer], lt: &[Option<Lifetime>]) -> Vec<(u32, u32)> {
    let mut bad = Vec::new();
    let always = Lifetime { start: 0, end: u32::MAX };
    for a in ARENAS {
        let mut ids: Vec<usize> = (0..buffers.len()).filter(|&i| buffers[i].arena == a && buffers[i].bytes > 0).collect();
        ids.sort_by_key(|&i| buffers[i].offset);
        for (k, &i) in ids.iter().enumerate() {
            let end_i = buffers[i].offset + buffers[i].bytes;
            for &j in &ids[k + 1..] {
                if buffers[j].offset >= end_i {
                    break;
                }
                let packed = a != Arena::Activations;
                let li = if packed { always } else { lt[i].unwrap_or(always) };
                let lj = if packed { always } else { lt[j].unwrap_or(always) };
                if li.overlaps(&lj) {
                    bad.push((buffers[i].id, buffers[j].id));
                }
            }
        }
    }
    bad
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(id: u32, bytes: u64) -> Buffer {
        Buffer {
            id,
            name: format!("b{id}"),
            dtype: DType::F32,
            shape: vec![bytes / 4],
            bytes,
            class: BufferClass::Activation,
            arena: Arena::Activations,
            offset: 0,
            state: None,
            feed: None,
            output: None,
        }
    }

    #[test]
    fn best_fit_reuses_freed_holes() {
        // b0 [0,1] 1 KiB, b1 [0,3] 256 B, b2 [2,3] 512 B fits into b0's hole; b3 [2,3] 1 KiB
        // does not fit in what is left and grows the heap.
        let mut bs = vec![buf(0, 1024), buf(1, 256), buf(2, 512), buf(3, 1024)];
        let lt = vec![
            Some(Lifetime { start: 0, end: 1 }),
            Some(Lifetime { start: 0, end: 3 }),
            Some(Lifetime { start: 2, end: 3 }),
            Some(Lifetime { start: 2, end: 3 }),
        ];
        let plan = place(&mut bs, &lt);
        assert!(overlapping_buffers(&bs, &lt).is_empty());
        assert_eq!(bs[0].offset, 0);
        assert_eq!(bs[1].offset, 1024);
        // b3 (larger) is placed first at time 2 and takes b0's 1 KiB hole exactly; b2 grows.
        assert_eq!(bs[3].offset, 0);
        assert_eq!(bs[2].offset, 1280);
        assert_eq!(plan.arenas[3].bytes, 1792);
        assert_eq!(plan.activation_bytes_unplanned, 2816);
        assert_eq!(plan.peak_bytes, 1792);
    }

    #[test]
    fn a_buffer_dying_at_a_step_does_not_share_with_one_born_there() {
        let mut bs = vec![buf(0, 256), buf(1, 256)];
        let lt = vec![Some(Lifetime { start: 0, end: 1 }), Some(Lifetime { start: 1, end: 2 })];
        place(&mut bs, &lt);
        assert_ne!(bs[0].offset, bs[1].offset);
        assert!(overlapping_buffers(&bs, &lt).is_empty());
    }

    #[test]
    fn the_overlap_check_finds_a_bad_plan() {
        let bs = vec![buf(0, 512), buf(1, 512)];
        let lt = vec![Some(Lifetime { start: 0, end: 1 }), Some(Lifetime { start: 1, end: 2 })];
        assert_eq!(overlapping_buffers(&bs, &lt), vec![(0, 1)]);
    }
}
