//! `async-tp`: micro-pipelined tensor parallelism (PyTorch's `fused_all_gather_matmul` /
//! `fused_matmul_reduce_scatter` and inductor's `micro_pipeline_tp` pass). Every
//! collective–GEMM pair on the `tp` mesh dim is split into per-chunk GEMMs and point-to-point
//! ring transfers, so that each transfer can run while the previous chunk's GEMM computes:
//!
//! - **all-gather → GEMM** (`all_gather` along a row dim of a `linear`/`matmul` operand): rank
//!   `r` multiplies its own shard first; for step `s = 1 .. tp-1` it receives shard
//!   `(r + s) mod tp` from its neighbour (`ring_shift {shift = 1}` of the shard it holds) while
//!   it multiplies the previous one. GEMMs that read the same gathered value share one loop;
//!   each GEMM's chunks are put back in rank order by `ring_concat`, and where something else
//!   still reads the gathered value (the weight gradient, which contracts over the gathered
//!   rows) it is assembled from the received shards the same way, as a by-product.
//! - **GEMM → reduce-scatter** (`reduce_scatter` of a `linear`/`matmul` result along a row
//!   dim): for `s = 1 .. tp-1` the rank computes the partial of the rows of peer `(r + s) mod
//!   tp` (`ring_slice` of the GEMM operand, then the GEMM) and sends it there
//!   (`ring_shift {shift = tp - s}`) while it computes the next; its own chunk comes last,
//!   and the `tp` partials are summed once, in f32. The producer may also be an `add` of
//!   such GEMMs (the backward's input cotangents of `wq`+`wk`+`wv` and `w1`+`w3`): each
//!   micro-step then runs every GEMM's chunk and the adds on the chunks.
//!
//! The chunk GEMMs read and write their rows in place: the memory plan makes a `ring_slice` a
//! view of its source and computes each `ring_concat` operand into its chunk of the result
//! (ring views), which needs every chunk to be one contiguous run of the value. With several
//! batch rows per rank the pass therefore splits each chunk GEMM per batch row (a leading-axis
//! `slice` of the shard) and assembles per row (`ring_concat` per row, then `concat`); a loop
//! carry, which has no views, is read whole and its chunk copied. The report says which.
//!
//! The pass runs after `autodiff` (and `cse`/`dce`), on the joint forward and backward
//! graph, as inductor's pass does: the backward's collective–GEMM pairs (the all-gathered
//! output cotangent of `wo`/`w2` times the weight) are split like the forward's, and the new
//! ops need no derivative. Every pair is decided and reported (`PassStats::notes`): split, or
//! kept synchronous and why (the consumer or producer is not a GEMM over the collective's
//! rows, the value has other readers, the chunk is below [`worth_splitting`]'s threshold).
//!
//! The pass only acts when the graph's meta asks for it (`async_tp`, written by
//! `--async-tp`); it then needs `tp > 1` with sequence parallelism and fails otherwise.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

use titan_ir::float8::{MatchedQuantize, Scaling, match_quantize};
use titan_ir::shape::resolve_dim;
use titan_ir::{BinaryOp, CollectiveReduce, DType, Dim, DimTable, Graph, Mesh, MeshDim, NodeId, Op, Region, TensorType, UnaryOp, Value};

use crate::PassDiag;
use crate::util::replace_uses;

/// The meta key `--async-tp` writes: `1` splits the pairs [`worth_splitting`] accepts, `2`
/// every eligible pair (`--async-tp=all`, for tests and small models).
pub const ASYNC_TP_META: &str = "async_tp";

/// Which pairs `async-tp` splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AsyncTpMode {
    /// Those whose chunks are large enough to hide a micro-step's overhead ([`worth_splitting`]).
    Auto,
    /// Every eligible pair, whatever its size.
    All,
}

impl AsyncTpMode {
    pub fn name(self) -> &'static str {
        match self {
            AsyncTpMode::Auto => "auto",
            AsyncTpMode::All => "all",
        }
    }

    /// `auto` or `all`.
    pub fn from_name(s: &str) -> Result<AsyncTpMode, String> {
        match s {
            "auto" => Ok(AsyncTpMode::Auto),
            "all" => Ok(AsyncTpMode::All),
            other => Err(format!("unknown async TP mode `{other}`; expected `auto` (split the pairs the cost threshold accepts) or `all`")),
        }
    }
}

/// Record in `g`'s meta that `async-tp` must split its collective–GEMM pairs.
pub fn enable_async_tp(g: &mut Graph, mode: AsyncTpMode) {
    g.meta.entries.retain(|(k, _)| k != ASYNC_TP_META);
    let v = match mode {
        AsyncTpMode::Auto => 1,
        AsyncTpMode::All => 2,
    };
    g.meta.entries.push((ASYNC_TP_META.into(), titan_ir::AttrValue::Int(v)));
}

/// The mode `g`'s meta asks for; `None` when async TP is off.
pub fn async_tp_mode(g: &Graph) -> Result<Option<AsyncTpMode>, String> {
    match g.meta_i64(ASYNC_TP_META) {
        None | Some(0) => Ok(None),
        Some(1) => Ok(Some(AsyncTpMode::Auto)),
        Some(2) => Ok(Some(AsyncTpMode::All)),
        Some(v) => Err(format!("meta `{ASYNC_TP_META} = {v}`: expected 0 (off), 1 (auto) or 2 (all)")),
    }
}

/// Link bandwidth of the threshold: NVLink 4 on H100/H200, per direction (bytes/s).
pub const LINK_BYTES_PER_S: f64 = 450e9;
/// Dense bf16 GEMM rate of the threshold (FLOP/s), about what an H100/H200 sustains.
pub const GEMM_FLOPS_PER_S: f64 = 700e12;
/// Fixed cost of one micro-step: a transfer's latency plus a GEMM launch (seconds).
pub const MICRO_STEP_OVERHEAD_S: f64 = 10e-6;

/// Whether splitting a pair pays, by a deliberately small model (to be replaced by the step
/// simulator's): each micro-step moves `chunk_bytes` and runs `chunk_flops` of GEMM, and at
/// best hides the shorter of the two, `min(bytes / link, flops / rate)`; the split adds a
/// fixed [`MICRO_STEP_OVERHEAD_S`] per step. Split when the hidden time covers it. At 70B
/// (tp 8, seq 8192, dim 8192, bf16) a chunk is 16 MiB (37 µs on the link): split; on the
/// debug model (KiB chunks) nothing is, unless `--async-tp=all`.
pub fn worth_splitting(chunk_bytes: u64, chunk_flops: u64) -> bool {
    hidden_seconds(chunk_bytes, chunk_flops) >= MICRO_STEP_OVERHEAD_S
}

fn hidden_seconds(chunk_bytes: u64, chunk_flops: u64) -> f64 {
    (chunk_bytes as f64 / LINK_BYTES_PER_S).min(chunk_flops as f64 / GEMM_FLOPS_PER_S)
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AsyncTpStats {
    /// all-gather → GEMM pairs split (one per gathered value, whatever its GEMM count).
    pub gathers_split: usize,
    /// GEMM → reduce-scatter pairs split.
    pub scatters_split: usize,
    /// tp all-gathers and reduce-scatters left synchronous.
    pub kept: usize,
    /// `ring_shift` micro-steps written (per block, not per layer).
    pub ring_shifts: usize,
    /// Chunk GEMMs written.
    pub chunk_gemms: usize,
    /// The decision report: one line per tp all-gather or reduce-scatter.
    pub decisions: Vec<String>,
}

/// A GEMM that consumes (or produces) a value along a row dim: `linear(x, w)`, or
/// `matmul(x, w)` / `scaled_matmul(x, w, sa, sb)` without `transpose_a`, with `x` the value
/// and `w` a matrix (and, scaled, one scalar scale for `x`: a per-row one would need slicing
/// too). Its chunk GEMMs are the same op with `x` replaced by a chunk of rows.
fn row_gemm(region: &Region, node: &titan_ir::Node, x: Value, dim: usize) -> Result<(), String> {
    let ok_op = match node.op {
        Op::Linear => true,
        Op::Matmul { transpose_a, .. } => !transpose_a && region.ty(node.inputs[1]).rank() == 2,
        Op::ScaledMatmul { transpose_a, .. } => !transpose_a && region.ty(node.inputs[1]).rank() == 2 && region.ty(node.inputs[2]).rank() == 0,
        _ => false,
    };
    if !ok_op {
        return Err(format!("`{}` is not a GEMM over its operand's rows", node.op.name()));
    }
    if node.inputs[0] != x || node.inputs[1] == x {
        return Err(format!("`{}` reads the value as its weight operand", node.op.name()));
    }
    if dim + 1 >= region.ty(x).rank() {
        return Err(format!("`{}` contracts over dim {dim}", node.op.name()));
    }
    Ok(())
}

/// A row GEMM's operands with its rows operand (the first) replaced by `rows`.
fn with_rows(inputs: &[Value], rows: Value) -> Vec<Value> {
    let mut v = inputs.to_vec();
    v[0] = rows;
    v
}

fn numel(ty: &TensorType, dims: &DimTable) -> Result<u64, String> {
    ty.numel(dims).ok_or_else(|| format!("{ty} has an unbound dim"))
}

fn bytes(ty: &TensorType, dims: &DimTable) -> Result<u64, String> {
    Ok(numel(ty, dims)? * ty.dtype.size_bytes() as u64)
}

fn divided(ty: &TensorType, d: usize, n: u32, dims: &DimTable) -> Result<TensorType, String> {
    let size = resolve_dim(&ty.shape[d], dims).ok_or_else(|| format!("dim {d} of {ty} is not bound"))?;
    if !size.is_multiple_of(u64::from(n)) {
        return Err(format!("dim {d} of {ty} is not divisible by tp = {n}"));
    }
    let mut t = ty.clone();
    t.shape[d] = Dim::Fixed(size / u64::from(n));
    Ok(t)
}

/// `ty` with dim 0 set to 1: one batch row.
fn one_row(ty: &TensorType) -> TensorType {
    let mut t = ty.clone();
    t.shape[0] = Dim::Fixed(1);
    t
}

/// How a micro-step's chunk along dim `d` of a value of type `ty` lies in memory: `Rows(1)` when
/// every dim before `d` is 1 (the chunk is one contiguous run of the value's bytes), `Rows(b)`
/// when only dim 0 (`b` batch rows) precedes `d` (the chunk is `b` runs, one per batch row: the
/// pass splits each chunk GEMM per row), `Strided` otherwise. Contiguous chunks are read and
/// written in place by the memory plan (ring views); strided ones are copied by the
/// `ring_slice`/`ring_concat` steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    Rows(u64),
    Strided,
}

fn layout(ty: &TensorType, d: usize, dims: &DimTable) -> Layout {
    let lead: Option<Vec<u64>> = ty.shape[..d.min(ty.rank())].iter().map(|x| resolve_dim(x, dims)).collect();
    match lead.as_deref() {
        Some(l) if l.iter().all(|&x| x == 1) => Layout::Rows(1),
        Some(&[b]) if b > 0 => Layout::Rows(b),
        _ => Layout::Strided,
    }
}

impl Layout {
    /// The batch rows each chunk GEMM is split into (1: not split).
    fn rows(self) -> u64 {
        match self {
            Layout::Rows(b) => b,
            Layout::Strided => 1,
        }
    }

    /// The report's words for it.
    fn note(self) -> String {
        match self {
            Layout::Rows(1) => "; chunks read and written in place".into(),
            Layout::Rows(b) => format!("; chunks read and written in place, each chunk GEMM split over the {b} batch rows"),
            Layout::Strided => {
                "; a chunk's rows are strided (more than one dim before the sequence), so `ring_slice`/`ring_concat` copy them: in place is not supported yet"
                    .into()
            }
        }
    }
}

fn human(b: u64) -> String {
    if b >= 1 << 20 { format!("{:.2} MiB", b as f64 / f64::from(1u32 << 20)) } else { format!("{:.2} KiB", b as f64 / 1024.0) }
}

fn name_of(region: &Region, v: Value) -> String {
    region.value(v).name.as_ref().map_or_else(|| format!("{v}"), |n| format!("%{n}"))
}

/// A GEMM's weight operand by name; a quantized weight by its high-precision name.
fn weight_name(region: &Region, v: Value) -> String {
    match region.value(v).def {
        titan_ir::ValueDef::Result { node, .. } => match_quantize(region, node).map_or_else(|| name_of(region, v), |m| name_of(region, m.tensor.x)),
        titan_ir::ValueDef::Arg(_) => name_of(region, v),
    }
}

/// Whether `v` is a scaled GEMM's result through its epilogue (`cast`s and `mul`s by the
/// broadcast row and column scales of the rowwise recipes).
fn scaled_gemm_epilogue(region: &Region, mut v: Value) -> bool {
    for _ in 0..5 {
        let titan_ir::ValueDef::Result { node, .. } = region.value(v).def else { return false };
        let n = region.node(node);
        match n.op {
            Op::ScaledMatmul { .. } => return true,
            Op::Cast | Op::Binary(BinaryOp::Mul) => v = n.inputs[0],
            _ => return false,
        }
    }
    false
}

/// Nodes of `region` (in order) that read `v`, and whether a region output or update does.
fn readers(region: &Region, v: Value) -> (Vec<NodeId>, bool) {
    let nodes = region.order.iter().copied().filter(|&m| region.node(m).inputs.contains(&v)).collect();
    let out = region.outputs.iter().any(|o| o.value == v) || region.updates.iter().any(|u| u.value == v);
    (nodes, out)
}

/// Builds the new nodes of one rewrite; they all take the place (the order key) of `at`.
struct Emit<'r> {
    region: &'r mut Region,
    new: Vec<NodeId>,
}

impl Emit<'_> {
    fn push(&mut self, op: Op, inputs: Vec<Value>, ty: TensorType, name: Option<String>) -> Value {
        let n = self.region.add_node(op, inputs, vec![ty]);
        self.region.order.pop();
        self.new.push(n);
        let v = self.region.node(n).results[0];
        self.region.values[v.index()].name = name;
        v
    }
}

impl Emit<'_> {
    /// Batch row `b` of `v` (a leading-axis `slice`, a view).
    fn row(&mut self, v: Value, b: u64) -> Value {
        let ty = one_row(self.region.ty(v));
        self.push(Op::Slice { axis: 0, start: b, len: 1 }, vec![v], ty, None)
    }

    /// The value of type `ty` whose chunks along `dim` are `pieces[b][s]` (batch row `b`, ring
    /// order `s`): one `ring_concat` of the chunks, or with several batch rows one per row
    /// (each a contiguous run of the result) joined by a `concat` along dim 0.
    fn assemble(&mut self, pieces: Vec<Vec<Value>>, ty: TensorType, dim: u32, n: u32, name: Option<String>) -> Value {
        let op = Op::RingConcat { mesh_dim: MeshDim::Tp, dim, size: n };
        if pieces.len() == 1 {
            let [p] = <[Vec<Value>; 1]>::try_from(pieces).expect("invariant: one row");
            return self.push(op, p, ty, name);
        }
        let row_ty = one_row(&ty);
        let rows: Vec<Value> = pieces.into_iter().map(|p| self.push(op.clone(), p, row_ty.clone(), None)).collect();
        self.push(Op::Concat { axis: 0 }, rows, ty, name)
    }
}

/// Re-sort `region.order` topologically, keeping each node as close to its key as its
/// operands allow (smallest key first among the ready nodes).
fn stable_topo(region: &mut Region, keys: &HashMap<NodeId, (usize, usize)>) -> Result<(), String> {
    let def: HashMap<Value, NodeId> = region.order.iter().flat_map(|&m| region.node(m).results.iter().map(move |&r| (r, m))).collect();
    let mut waiting: HashMap<NodeId, usize> = HashMap::new();
    let mut users: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
    let mut heap = BinaryHeap::new();
    for &m in &region.order {
        let mut deps: Vec<NodeId> = region.node(m).inputs.iter().filter_map(|v| def.get(v).copied()).collect();
        deps.sort_unstable();
        deps.dedup();
        for d in &deps {
            users.entry(*d).or_default().push(m);
        }
        waiting.insert(m, deps.len());
        if deps.is_empty() {
            heap.push(Reverse((keys[&m], m)));
        }
    }
    let mut order = Vec::with_capacity(region.order.len());
    while let Some(Reverse((_, m))) = heap.pop() {
        order.push(m);
        for u in users.remove(&m).unwrap_or_default() {
            let w = waiting.get_mut(&u).ok_or("invariant: every user is in the order")?;
            *w -= 1;
            if *w == 0 {
                heap.push(Reverse((keys[&u], u)));
            }
        }
    }
    if order.len() != region.order.len() {
        return Err(format!("@{}: the rewritten nodes form a cycle", region.name));
    }
    region.order = order;
    Ok(())
}

/// Replace the nodes `gone` by `new` (at the order position of `at`) and re-sort.
fn splice(region: &mut Region, gone: &[NodeId], at: NodeId, new: &[NodeId]) -> Result<(), String> {
    let pos = region.order.iter().position(|&m| m == at).ok_or("invariant: the anchor is in the order")?;
    let mut keys: HashMap<NodeId, (usize, usize)> = region.order.iter().enumerate().map(|(p, &m)| (m, (p, 0))).collect();
    for (j, &n) in new.iter().enumerate() {
        keys.insert(n, (pos, j + 1));
    }
    region.order.retain(|m| !gone.contains(m));
    region.order.extend_from_slice(new);
    stable_topo(region, &keys)
}

struct Ctx<'a> {
    dims: &'a DimTable,
    tp: u32,
    mode: AsyncTpMode,
    /// The region's arguments carried between loop iterations (a `repeat`'s carries and
    /// prefetched carries): the memory plan has no view of a row of one, so a chunk GEMM reads
    /// such a shard whole.
    carried: HashSet<Value>,
}

impl Ctx<'_> {
    fn threshold(&self, chunk_bytes: u64, chunk_flops: u64) -> Result<(), String> {
        if self.mode == AsyncTpMode::All || worth_splitting(chunk_bytes, chunk_flops) {
            return Ok(());
        }
        Err(format!(
            "chunk of {} and {:.3} GFLOP hides {:.2} us per micro-step, below the {:.0} us overhead (`--async-tp=all` splits it anyway)",
            human(chunk_bytes),
            chunk_flops as f64 / 1e9,
            hidden_seconds(chunk_bytes, chunk_flops) * 1e6,
            MICRO_STEP_OVERHEAD_S * 1e6
        ))
    }
}

/// The ring loop of a split all-gather: rank `r` starts from its shard `start.0` (and a
/// companion that travels with it, `start.1`: rowwise float8's row scales), multiplies each
/// shard it holds by every GEMM of `gemm_nodes` (at their rows operand) while the next one is
/// shifted in from rank `r + 1`, and puts each GEMM's chunks back in rank order
/// (`ring_concat`), which replaces the GEMM's result. Returns the shards and the companions, in
/// ring order (the companions empty without one).
#[allow(clippy::too_many_arguments)]
fn ring_gather_gemms(
    e: &mut Emit<'_>,
    start: (Value, Option<Value>),
    gemm_nodes: &[titan_ir::Node],
    dim: u32,
    n: u32,
    ctx: &Ctx,
    name: Option<&str>,
    stats: &mut AsyncTpStats,
) -> Result<(Vec<Value>, Vec<Value>), String> {
    let d = dim as usize;
    let lay = layout(e.region.ty(start.0), d, ctx.dims);
    let rows = lay.rows();
    let mut shards = vec![start.0];
    let mut companions: Vec<Value> = start.1.into_iter().collect();
    // chunks[c][b][s]: GEMM `c`'s rows of batch row `b` at micro-step `s`.
    let mut chunks: Vec<Vec<Vec<Value>>> = vec![vec![Vec::new(); rows as usize]; gemm_nodes.len()];
    for s in 0..n as usize {
        let cur = shards[s];
        if s + 1 < n as usize {
            let shift = Op::RingShift { mesh_dim: MeshDim::Tp, size: n, shift: 1 };
            let ty = e.region.ty(cur).clone();
            shards.push(e.push(shift.clone(), vec![cur], ty, name.map(|b| format!("{b}.ring{}", s + 1))));
            stats.ring_shifts += 1;
            if let Some(&c) = companions.get(s) {
                let ty = e.region.ty(c).clone();
                companions.push(e.push(shift, vec![c], ty, None));
                stats.ring_shifts += 1;
            }
        }
        // A carried shard has no row views: its chunk GEMM reads it whole, and the rows of
        // the result are copied into place.
        let whole = rows == 1 || ctx.carried.contains(&cur);
        let cur_rows: Vec<Value> = if whole { vec![cur] } else { (0..rows).map(|b| e.row(cur, b)).collect() };
        for (c, gn) in gemm_nodes.iter().enumerate() {
            let ty = divided(e.region.ty(gn.results[0]), d, n, ctx.dims)?;
            let ty = if whole { ty } else { one_row(&ty) };
            for (b, &r) in cur_rows.iter().enumerate() {
                let name = e.region.value(gn.results[0]).name.as_ref().map(|x| if whole { format!("{x}.chunk{s}") } else { format!("{x}.chunk{s}.row{b}") });
                let y = e.push(gn.op.clone(), with_rows(&gn.inputs, r), ty.clone(), name);
                stats.chunk_gemms += 1;
                if rows == 1 {
                    chunks[c][0].push(y);
                } else if whole {
                    for (b, piece) in chunks[c].iter_mut().enumerate() {
                        piece.push(e.row(y, b as u64));
                    }
                } else {
                    chunks[c][b].push(y);
                }
            }
        }
    }
    for (c, gn) in gemm_nodes.iter().enumerate() {
        let y = gn.results[0];
        let ty = e.region.ty(y).clone();
        let name = e.region.value(y).name.clone();
        let assembled = e.assemble(std::mem::take(&mut chunks[c]), ty, dim, n, name);
        replace_uses(e.region, y, assembled, None);
    }
    Ok((shards, companions))
}

/// The gathered value assembled from the `shards` (ring order) a ring loop received: in place
/// from the received shards (one row of each per batch row when there are several).
fn assemble_shards(e: &mut Emit<'_>, shards: &[Value], ty: TensorType, dim: u32, n: u32, ctx: &Ctx, name: Option<String>) -> Value {
    let rows = layout(&ty, dim as usize, ctx.dims).rows();
    // A carried shard has no row views: one `ring_concat` step copies the shards.
    let rows = if shards.iter().any(|v| ctx.carried.contains(v)) { 1 } else { rows };
    let pieces: Vec<Vec<Value>> = if rows == 1 { vec![shards.to_vec()] } else { (0..rows).map(|b| shards.iter().map(|&x| e.row(x, b)).collect()).collect() };
    e.assemble(pieces, ty, dim, n, name)
}

/// Decide and (maybe) split the all-gather `ag`; returns the report line.
fn all_gather_pair(region: &mut Region, ag: NodeId, ctx: &Ctx, stats: &mut AsyncTpStats) -> Result<String, String> {
    let node = region.node(ag).clone();
    let Op::AllGather { dim, size, .. } = node.op else { return Err("invariant: an all_gather".into()) };
    let (x, g) = (node.inputs[0], node.results[0]);
    let d = dim as usize;
    let head = format!("@{}: all_gather({}) {{dim = {d}}}", region.name, name_of(region, x));
    let (users, used_outside) = readers(region, g);
    let mut gemms = Vec::new();
    let mut why_not = Vec::new();
    for &u in &users {
        match row_gemm(region, region.node(u), g, d) {
            Ok(()) => gemms.push(u),
            Err(e) => why_not.push(e),
        }
    }
    if gemms.is_empty() {
        let why = if why_not.is_empty() { "nothing reads it but the region's outputs".to_string() } else { why_not.join("; ") };
        return Ok(format!("{head}: synchronous: no consumer is a GEMM over the gathered rows ({why})"));
    }
    let names: Vec<String> = gemms.iter().map(|&u| format!("{}({})", region.node(u).op.name(), name_of(region, region.node(u).inputs[1]))).collect();
    let chunk_bytes = bytes(region.ty(x), ctx.dims)?;
    let k = resolve_dim(region.ty(g).shape.last().ok_or("a scalar gathered")?, ctx.dims).ok_or("unbound contraction dim")?;
    let mut flops = 0;
    for &u in &gemms {
        flops += 2 * numel(region.ty(region.node(u).results[0]), ctx.dims)? / u64::from(size) * k;
    }
    if let Err(e) = ctx.threshold(chunk_bytes, flops) {
        return Ok(format!("{head} -> {}: synchronous: {e}", names.join(", ")));
    }
    // The rewrite.
    let n = size;
    let xname = region.value(x).name.clone();
    let gemm_nodes: Vec<titan_ir::Node> = gemms.iter().map(|&u| region.node(u).clone()).collect();
    let at = *gemms.last().ok_or("invariant: a GEMM")?;
    let mut e = Emit { region, new: Vec::new() };
    let (shards, _) = ring_gather_gemms(&mut e, (x, None), &gemm_nodes, dim, n, ctx, xname.as_deref(), stats)?;
    let mut gone = vec![ag];
    gone.extend(&gemms);
    let byproduct = users.len() > gemms.len() || used_outside;
    if byproduct {
        let ty = e.region.ty(g).clone();
        let name = e.region.value(g).name.clone();
        let full = assemble_shards(&mut e, &shards, ty, dim, n, ctx, name);
        replace_uses(e.region, g, full, None);
    }
    let new = std::mem::take(&mut e.new);
    splice(region, &gone, at, &new)?;
    stats.gathers_split += 1;
    Ok(format!(
        "{head} -> {}: split into {n} micro-steps ({} ring shifts of {} each){}{}",
        names.join(", "),
        n - 1,
        human(chunk_bytes),
        {
            let lay = layout(region.ty(x), d, ctx.dims);
            let carried = if ctx.carried.contains(&x) && lay.rows() > 1 {
                " (but the own shard, a loop carry, which has no row views: its chunk GEMMs read it whole and their rows are copied into place)"
            } else {
                ""
            };
            format!("{}{carried}", lay.note())
        },
        if byproduct {
            let copied = if ctx.carried.contains(&x) && layout(region.ty(x), d, ctx.dims).rows() > 1 {
                " (copied by one `ring_concat` step: its own shard is a loop carry, which has no row views)"
            } else {
                ""
            };
            format!("; the gathered value is assembled for its other readers ({}){copied}", why_not.join("; "))
        } else {
            String::new()
        }
    ))
}

/// The all-gather `ag` of a value that is quantized to fp8 (float8 training; `None` when it is
/// not: the bf16 rule applies). The quantization moves before the gather, onto the rank's
/// shard: rowwise (one scale per row, the amax over the features, local to a row) the shard's
/// fp8 values and row scales are the gathered tensor's rows; tensorwise the shard is quantized
/// with the tp-wide amax (one scalar max `all_reduce`, exact), so every rank's fp8 values are
/// the gathered tensor's. The ring then moves fp8 chunks and, rowwise, their row scales with
/// them (`ring_shift` of both per micro-step; the scales are put back in rank order by
/// `ring_concat` for the GEMMs' epilogue, which multiplies them in after the GEMM); each
/// `scaled_matmul` reading the fp8 tensor is split into chunk GEMMs. Bit for bit the
/// synchronous float8 step: the same fp8 values, scales and per-row products.
fn float8_gather_pair(region: &mut Region, ag: NodeId, ctx: &Ctx, stats: &mut AsyncTpStats) -> Result<Option<String>, String> {
    let node = region.node(ag).clone();
    let Op::AllGather { dim, size, .. } = node.op else { return Err("invariant: an all_gather".into()) };
    let (x, g) = (node.inputs[0], node.results[0]);
    let d = dim as usize;
    let quants: Vec<MatchedQuantize> = region.order.iter().filter_map(|&m| match_quantize(region, m)).filter(|q| q.tensor.x == g).collect();
    let Some(quant) = quants.first() else { return Ok(None) };
    let head = format!("@{}: all_gather({}) {{dim = {d}}} -> float8 quantization", region.name, name_of(region, x));
    let sync = |why: String| Ok(Some(format!("{head}: synchronous: {why}")));
    if quants.len() > 1 {
        return sync(format!("the gathered value is quantized {} ways; not supported yet", quants.len()));
    }
    let rank = region.ty(g).rank();
    let rowwise = match quant.scaling {
        Scaling::Tensor => false,
        Scaling::Over(a) if a + 1 == rank && a != d => true,
        Scaling::Over(a) => {
            return sync(format!("its scales are taken over axis {a}, not the features (only rowwise and tensorwise scales travel with their chunks)"));
        }
    };
    let chain: Vec<NodeId> = quant.nodes.clone();
    let (scale, q) = (quant.tensor.scale, quant.tensor.q);
    let recips: Vec<NodeId> =
        region.order.iter().copied().filter(|&m| region.node(m).op == Op::Unary(UnaryOp::Recip) && region.node(m).inputs == [scale]).collect();
    let [recip] = recips[..] else { return sync(format!("its scale has {} reciprocals (expected the one the GEMM epilogue reads)", recips.len())) };
    let inv = region.node(recip).results[0];
    // Nothing but the chain may read the gathered value or the chain's intermediates.
    let mut own: Vec<NodeId> = chain.clone();
    own.push(recip);
    let (g_users, g_out) = readers(region, g);
    if g_out || g_users.iter().any(|u| !own.contains(u)) {
        let other: Vec<String> = g_users.iter().filter(|u| !own.contains(u)).map(|&u| format!("`{}`", region.node(u).op.name())).collect();
        return sync(format!(
            "the gathered value is also read outside its quantization ({}); not supported yet",
            if other.is_empty() { "a region output".to_string() } else { other.join(", ") }
        ));
    }
    for &m in &chain {
        let v = region.node(m).results[0];
        if v == q {
            continue;
        }
        let (us, out) = readers(region, v);
        if out || us.iter().any(|u| !own.contains(u)) {
            return sync("a value inside its quantization has other readers; not supported yet".into());
        }
    }
    let (q_users, q_out) = readers(region, q);
    let gemm_ok = |u: NodeId| {
        let n = region.node(u);
        matches!(n.op, Op::ScaledMatmul { transpose_a: false, .. })
            && n.inputs[0] == q
            && n.inputs[1] != q
            && region.ty(n.inputs[1]).rank() == 2
            && region.ty(n.inputs[2]).rank() == 0
    };
    if q_out || q_users.is_empty() || !q_users.iter().all(|&u| gemm_ok(u)) {
        return sync("its fp8 values are read by something other than a scaled GEMM over their rows with a scalar row scale".into());
    }
    let n = size;
    let fp8_chunk = divided(region.ty(q), d, n, ctx.dims)?;
    let inv_chunk = if rowwise { Some(divided(region.ty(inv), d, n, ctx.dims)?) } else { None };
    let chunk_bytes = bytes(&fp8_chunk, ctx.dims)? + inv_chunk.as_ref().map_or(Ok(0), |t| bytes(t, ctx.dims))?;
    let k = resolve_dim(region.ty(q).shape.last().ok_or("a scalar quantized")?, ctx.dims).ok_or("unbound contraction dim")?;
    let mut flops = 0;
    for &u in &q_users {
        flops += 2 * numel(region.ty(region.node(u).results[0]), ctx.dims)? / u64::from(n) * k;
    }
    let names: Vec<String> = q_users.iter().map(|&u| format!("scaled_matmul({})", weight_name(region, region.node(u).inputs[1]))).collect();
    if let Err(e) = ctx.threshold(chunk_bytes, flops) {
        return sync(format!("{} ({e})", names.join(", ")));
    }
    // The quantization, cloned onto the shard (in chain order; `recip` last).
    let gemm_nodes: Vec<titan_ir::Node> = q_users.iter().map(|&u| region.node(u).clone()).collect();
    let at = *q_users.iter().max_by_key(|&&u| region.order.iter().position(|&m| m == u)).ok_or("invariant: a GEMM")?;
    let amax_node = quant.tensor.amax_node;
    let mut e = Emit { region, new: Vec::new() };
    let mut map: HashMap<Value, Value> = HashMap::from([(g, x)]);
    for &m in &own {
        let orig = e.region.node(m).clone();
        let r = orig.results[0];
        let ty = e.region.ty(r).clone();
        let ty = if ty.rank() > d { divided(&ty, d, n, ctx.dims)? } else { ty };
        let inputs = orig.inputs.iter().map(|v| map.get(v).copied().unwrap_or(*v)).collect();
        let name = e.region.value(r).name.clone();
        let mut v = e.push(orig.op.clone(), inputs, ty.clone(), name);
        if m == amax_node && !rowwise {
            // Tensorwise: the tp-wide amax, so every shard is quantized with the gathered
            // tensor's scale.
            v = e.push(Op::AllReduce { mesh_dim: MeshDim::Tp, reduce: CollectiveReduce::Max }, vec![v], ty, None);
        }
        map.insert(r, v);
    }
    let (q_s, inv_s) = (map[&q], map[&inv]);
    let qname = e.region.value(q).name.clone().or_else(|| e.region.value(x).name.as_ref().map(|b| format!("{b}.fp8")));
    let (_, scales) = ring_gather_gemms(&mut e, (q_s, inv_chunk.is_some().then_some(inv_s)), &gemm_nodes, dim, n, ctx, qname.as_deref(), stats)?;
    let mut gone = vec![ag];
    gone.extend(&own);
    gone.extend(&q_users);
    let inv_full = if rowwise {
        let ty = e.region.ty(inv).clone();
        assemble_shards(&mut e, &scales, ty, dim, n, ctx, None)
    } else {
        inv_s
    };
    replace_uses(e.region, inv, inv_full, None);
    let new = std::mem::take(&mut e.new);
    splice(region, &gone, at, &new)?;
    stats.gathers_split += 1;
    let fp8_bytes = bytes(&fp8_chunk, ctx.dims)?;
    let moved = match &inv_chunk {
        Some(_) => format!("each ring-shifting a {} fp8 chunk and its {} of row scales", human(fp8_bytes), human(chunk_bytes - fp8_bytes)),
        None => format!("each ring-shifting a {} fp8 chunk; the scale comes from a tp max all_reduce of the amax", human(fp8_bytes)),
    };
    Ok(Some(format!(
        "{head} -> {}: quantized before the gather ({}), split into {n} micro-steps ({} transfers, {moved}){}",
        names.join(", "),
        if rowwise { "rowwise" } else { "tensorwise" },
        n - 1,
        layout(region.ty(x), d, ctx.dims).note()
    )))
}

/// The producer of a reduce-scatter's operand as the pass splits it: a GEMM over the scattered
/// rows, or an elementwise `add` of such trees (the input cotangent of `w1`/`w3` or of
/// `wq`/`wk`/`wv` in the backward) whose every intermediate value only the tree reads.
enum Tree {
    Gemm(titan_ir::Node),
    Add(Box<Tree>, Box<Tree>),
}

impl Tree {
    fn gemms(&self) -> Vec<&titan_ir::Node> {
        match self {
            Tree::Gemm(n) => vec![n],
            Tree::Add(a, b) => a.gemms().into_iter().chain(b.gemms()).collect(),
        }
    }
}

/// The [`Tree`] computing `v` (`nodes` collects its nodes), or why it is not one.
fn row_tree(region: &Region, v: Value, d: usize, nodes: &mut Vec<NodeId>) -> Result<Tree, String> {
    let Some(m) = region.order.iter().copied().find(|&m| region.node(m).results.contains(&v)) else {
        return Err("an argument of the region is not a GEMM".into());
    };
    let node = region.node(m);
    nodes.push(m);
    if node.op == Op::Binary(BinaryOp::Add) && node.inputs.len() == 2 && node.inputs.iter().all(|&x| region.ty(x) == region.ty(v)) {
        let mut kids = Vec::new();
        for &x in &node.inputs {
            let (us, out) = readers(region, x);
            if out || us != [m] || node.inputs[0] == node.inputs[1] {
                return Err("`add` of a GEMM read elsewhere too".into());
            }
            kids.push(row_tree(region, x, d, nodes)?);
        }
        let [a, b] = <[Tree; 2]>::try_from(kids).map_err(|_| "invariant: two operands")?;
        return Ok(Tree::Add(Box::new(a), Box::new(b)));
    }
    let h = *node.inputs.first().ok_or_else(|| format!("`{}` has no operand", node.op.name()))?;
    row_gemm(region, node, h, d)?;
    Ok(Tree::Gemm(node.clone()))
}

/// Decide and (maybe) split the reduce-scatter `rs`; returns the report line.
fn reduce_scatter_pair(region: &mut Region, rs: NodeId, ctx: &Ctx, stats: &mut AsyncTpStats) -> Result<String, String> {
    let node = region.node(rs).clone();
    let Op::ReduceScatter { dim, size, reduce, .. } = node.op else { return Err("invariant: a reduce_scatter".into()) };
    let (p, out) = (node.inputs[0], node.results[0]);
    let d = dim as usize;
    let head = format!("@{}: reduce_scatter({}) {{dim = {d}}}", region.name, name_of(region, p));
    let producer = region.order.iter().copied().find(|&m| region.node(m).results.contains(&p));
    let Some(prod) = producer else {
        return Ok(format!("{head}: synchronous: its operand is an argument of the region, not a GEMM"));
    };
    let pn = region.node(prod).clone();
    if reduce != CollectiveReduce::Sum {
        return Ok(format!("{head}: synchronous: only sum reductions are split"));
    }
    let mut tree_nodes = Vec::new();
    let tree = match row_tree(region, p, d, &mut tree_nodes) {
        Ok(t) => t,
        Err(e) => {
            if pn.op != Op::Cast && scaled_gemm_epilogue(region, p) {
                return Ok(format!(
                    "{head}: synchronous: the producer is the row and column scaling after a float8 scaled GEMM (rowwise); splitting it with its epilogue is not supported yet"
                ));
            }
            let why = match row_gemm(region, &pn, pn.inputs.first().copied().unwrap_or(p), d) {
                Err(first) if pn.op != Op::Binary(BinaryOp::Add) => first,
                _ => e,
            };
            return Ok(format!("{head}: synchronous: the producer is not a GEMM over the scattered rows, nor an `add` of such GEMMs ({why})"));
        }
    };
    let (users, used_outside) = readers(region, p);
    if users.len() != 1 || used_outside {
        return Ok(format!("{head}: synchronous: the GEMM's full partial result has other readers"));
    }
    let gemms = tree.gemms();
    let wname = gemms.iter().map(|g| format!("{}({})", g.op.name(), weight_name(region, g.inputs[1]))).collect::<Vec<_>>().join(" + ");
    let n = size;
    let out_ty = region.ty(out).clone();
    let chunk_bytes = bytes(&out_ty, ctx.dims)?;
    let mut flops = 0;
    for g in &gemms {
        let k = resolve_dim(region.ty(g.inputs[0]).shape.last().ok_or("a scalar operand")?, ctx.dims).ok_or("unbound contraction dim")?;
        flops += 2 * numel(&out_ty, ctx.dims)? * k;
    }
    if let Err(e) = ctx.threshold(chunk_bytes, flops) {
        return Ok(format!("{head} <- {wname}: synchronous: {e}"));
    }
    let pname = region.value(p).name.clone();
    let part_ty = divided(region.ty(p), d, n, ctx.dims)?;
    let lay = layout(region.ty(p), d, ctx.dims);
    // A carried rows operand has no row views: its GEMMs read the ring slices whole.
    let rows = if gemms.iter().any(|g| ctx.carried.contains(&g.inputs[0])) { 1 } else { lay.rows() };
    let gemm_nodes: Vec<titan_ir::Node> = gemms.iter().map(|&g| g.clone()).collect();
    let mut e = Emit { region, new: Vec::new() };
    // The rows operand of each GEMM, per batch row.
    let mut h_rows: HashMap<(Value, u64), Value> = HashMap::new();
    for g in &gemm_nodes {
        let h = g.inputs[0];
        for b in 0..rows {
            h_rows.entry((h, b)).or_insert_with(|| if rows == 1 { h } else { e.row(h, b) });
        }
    }
    let mut received = Vec::new();
    // Peers' partials first (each sent while the next is computed), this rank's own last.
    for s in (1..n).chain([0]) {
        let mut parts = Vec::new();
        for b in 0..rows {
            let suffix = if rows == 1 { format!("{s}") } else { format!("{s}.row{b}") };
            let pty = if rows == 1 { part_ty.clone() } else { one_row(&part_ty) };
            // Each GEMM's chunk, on its rows of peer `s` (one ring slice per rows operand).
            let mut slices: HashMap<Value, Value> = HashMap::new();
            let mut chunk_of: Vec<Value> = Vec::new();
            for g in &gemm_nodes {
                let hb = h_rows[&(g.inputs[0], b)];
                let hs = match slices.get(&hb) {
                    Some(&v) => v,
                    None => {
                        let hty = divided(e.region.ty(hb), d, n, ctx.dims)?;
                        let name = e.region.value(g.inputs[0]).name.as_ref().map(|x| format!("{x}.rows{suffix}"));
                        let v = e.push(Op::RingSlice { mesh_dim: MeshDim::Tp, dim, size: n, shift: s }, vec![hb], hty, name);
                        slices.insert(hb, v);
                        v
                    }
                };
                let gty = if rows == 1 { divided(e.region.ty(g.results[0]), d, n, ctx.dims)? } else { pty.clone() };
                let name = e.region.value(g.results[0]).name.as_ref().map(|x| format!("{x}.chunk{suffix}"));
                chunk_of.push(e.push(g.op.clone(), with_rows(&g.inputs, hs), gty, name));
                stats.chunk_gemms += 1;
            }
            // The tree's adds on the chunks, in the tree's order (the same element values).
            fn fold(e: &mut Emit<'_>, t: &Tree, chunks: &mut std::slice::Iter<'_, Value>, ty: &TensorType) -> Result<Value, String> {
                match t {
                    Tree::Gemm(_) => chunks.next().copied().ok_or_else(|| "invariant: a chunk per GEMM".to_string()),
                    Tree::Add(a, b) => {
                        let x = fold(e, a, chunks, ty)?;
                        let y = fold(e, b, chunks, ty)?;
                        Ok(e.push(Op::Binary(BinaryOp::Add), vec![x, y], ty.clone(), None))
                    }
                }
            }
            let part = fold(&mut e, &tree, &mut chunk_of.iter(), &pty)?;
            if let Some(x) = pname.as_ref().filter(|_| rows == 1) {
                e.region.values[part.index()].name = Some(format!("{x}.chunk{suffix}"));
            }
            parts.push(part);
        }
        let ps = if rows == 1 { parts[0] } else { e.push(Op::Concat { axis: 0 }, parts, part_ty.clone(), pname.as_ref().map(|x| format!("{x}.chunk{s}"))) };
        if s == 0 {
            received.push(ps);
        } else {
            let name = pname.as_ref().map(|b| format!("{b}.from{s}"));
            received.push(e.push(Op::RingShift { mesh_dim: MeshDim::Tp, size: n, shift: n - s }, vec![ps], part_ty.clone(), name));
            stats.ring_shifts += 1;
        }
    }
    // One f32 reduction of the tp partials.
    let wide = out_ty.dtype != DType::F32;
    let f32_ty = TensorType::new(DType::F32, out_ty.shape.clone());
    let mut acc: Option<Value> = None;
    for r in received {
        let r = if wide { e.push(Op::Cast, vec![r], f32_ty.clone(), None) } else { r };
        acc = Some(match acc {
            None => r,
            Some(a) => e.push(Op::Binary(BinaryOp::Add), vec![a, r], f32_ty.clone(), None),
        });
    }
    let acc = acc.ok_or("invariant: tp > 1 partials")?;
    let result = if wide { e.push(Op::Cast, vec![acc], out_ty.clone(), None) } else { acc };
    e.region.values[result.index()].name = e.region.value(out).name.clone();
    replace_uses(e.region, out, result, None);
    let new = std::mem::take(&mut e.new);
    let mut gone = tree_nodes;
    gone.push(rs);
    splice(region, &gone, rs, &new)?;
    stats.scatters_split += 1;
    Ok(format!(
        "{head} <- {wname}: split into {n} micro-steps ({} ring shifts of {} each, own chunk last, one f32 reduction){}",
        n - 1,
        human(chunk_bytes),
        if rows == 1 && lay.rows() > 1 { Layout::Strided.note() } else { lay.note() }
    ))
}

fn rewrite_region(region: &mut Region, ctx: &Ctx, stats: &mut AsyncTpStats) -> Result<(), String> {
    let candidates: Vec<NodeId> = region
        .order
        .iter()
        .copied()
        .filter(|&m| matches!(region.node(m).op, Op::AllGather { mesh_dim: MeshDim::Tp, .. } | Op::ReduceScatter { mesh_dim: MeshDim::Tp, .. }))
        .collect();
    for c in candidates {
        let line = if matches!(region.node(c).op, Op::AllGather { .. }) {
            match float8_gather_pair(region, c, ctx, stats)? {
                Some(line) => line,
                None => all_gather_pair(region, c, ctx, stats)?,
            }
        } else {
            reduce_scatter_pair(region, c, ctx, stats)?
        };
        if line.contains(": synchronous: ") {
            stats.kept += 1;
        }
        stats.decisions.push(line);
    }
    Ok(())
}

/// The tp collectives run in program order on their stream. A synchronous tp all-gather of a
/// region argument sits at the region's top (`prefetch-gathers`, which calls this after it
/// hoists, puts the backward's re-gathers of saved shards there), so the ring shifts of the pairs split after it would queue behind it
/// although their chunk GEMMs come first: move each such gather after the last `ring_shift`
/// that precedes its first reader (still before that reader, and after its operand, an
/// argument). Returns the gathers moved, with the ring shifts they now follow.
pub fn order_tp_stream(region: &mut Region) -> Vec<(NodeId, usize)> {
    let is_arg = |r: &Region, v: Value| matches!(r.value(v).def, titan_ir::ValueDef::Arg(_));
    let gathers: Vec<NodeId> = region
        .order
        .iter()
        .copied()
        .filter(|&m| {
            let n = region.node(m);
            matches!(n.op, Op::AllGather { mesh_dim: MeshDim::Tp, .. }) && n.inputs.iter().all(|&v| is_arg(region, v))
        })
        .collect();
    let mut moved = Vec::new();
    for m in gathers {
        let Some(at) = region.order.iter().position(|&x| x == m) else { continue };
        let results = region.node(m).results.clone();
        let first_reader = region.order.iter().position(|&x| region.node(x).inputs.iter().any(|v| results.contains(v))).unwrap_or(region.order.len());
        let shifts: Vec<usize> =
            (at + 1..first_reader).filter(|&q| matches!(region.node(region.order[q]).op, Op::RingShift { mesh_dim: MeshDim::Tp, .. })).collect();
        let Some(&last) = shifts.last() else { continue };
        region.order.remove(at);
        // `last` moved one place up with the removal; insert right after it.
        region.order.insert(last, m);
        moved.push((m, shifts.len()));
    }
    moved
}

pub fn async_tp(g: &mut Graph) -> Result<AsyncTpStats, PassDiag> {
    let mut stats = AsyncTpStats::default();
    let Some(mode) = async_tp_mode(g)? else { return Ok(stats) };
    let tp = Mesh::from_graph(g)?.map_or(1, |m| m.size(MeshDim::Tp));
    if tp < 2 {
        return Err(PassDiag::precondition(format!(
            "async tensor parallelism needs tp > 1 with sequence parallelism; this mesh has tp = {tp}: add `--tp N` or drop `--async-tp`"
        )));
    }
    let sequence_parallel = std::iter::once(&g.main)
        .chain(&g.blocks)
        .flat_map(|r| r.order.iter().map(move |&m| &r.node(m).op))
        .any(|op| matches!(op, Op::AllGather { mesh_dim: MeshDim::Tp, dim: 1, .. }));
    if !sequence_parallel {
        return Err(PassDiag::precondition(
            "async tensor parallelism needs sequence parallelism (the tp all-gather of the sequence before the column-parallel GEMMs), and this graph has none; run `shard-tp` first",
        ));
    }
    // Per block, the arguments a `repeat` carries.
    let mut carried: Vec<HashSet<Value>> = vec![HashSet::new(); g.blocks.len()];
    for r in std::iter::once(&g.main).chain(&g.blocks) {
        for &m in &r.order {
            if let Op::Repeat { block, carry, prefetch, .. } = r.node(m).op
                && let (Some(set), Some(b)) = (carried.get_mut(block.index()), g.blocks.get(block.index()))
            {
                set.extend(b.args.iter().take((carry + prefetch) as usize).map(|a| a.value));
            }
        }
    }
    let ctx = Ctx { dims: &g.dims, tp, mode, carried: HashSet::new() };
    debug_assert!(ctx.tp >= 2);
    rewrite_region(&mut g.main, &ctx, &mut stats)?;
    for (b, carried) in g.blocks.iter_mut().zip(carried) {
        let ctx = Ctx { dims: &g.dims, tp, mode, carried };
        rewrite_region(b, &ctx, &mut stats)?;
    }
    Ok(stats)
}
