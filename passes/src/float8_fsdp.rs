//! `float8-fsdp-gather`: float8 FSDP weight all-gathers (torchao's
//! `enable_fsdp_float8_all_gather`, TorchTitan's `[quantize.linear.float8]` key of that name).
//!
//! A `tensorwise` float8 build quantizes each FSDP-gathered weight `g = all_gather(s)` with one
//! scale: `amax = reduce_max(abs(g))`, `scale = fp8_scale(amax)`,
//! `q = cast<f8>(clamp(f32(g) · scale))`. This pass moves the quantization before the gather:
//! every rank takes the amax of its shard `s`, the amaxes are max-reduced over `dp_shard` (a
//! scalar `all_reduce {reduce = max}`), the shard is quantized with that shared scale, and the
//! one-byte fp8 shard is all-gathered: half the bytes of the bf16 gather. The maximum is exact and
//! the quantization is elementwise, so the gathered fp8 weight and its scale equal those of the
//! bf16-gather-then-quantize graph bit for bit (both quantize the same bf16 compute copy; see
//! docs/notes.md, "Float8 FSDP all-gathers", for why not the fp32 master as torchao does).
//!
//! With `precompute` (torchao's `precompute_float8_dynamic_scale_for_fsdp`) the amaxes of every
//! weight the region gathers in fp8 travel in one all-reduce (a vector of amaxes), issued where
//! the first of them is needed; torchao batches all weights of the model once per step, titan
//! those of one block (once per layer, forward and backward) and those of `main`.
//!
//! The pass runs after `cse` (so the head's forward and `grad_input` quantizations of one gathered
//! weight are already one) and before `dce`, which drops the bf16 gathers nothing reads any more.
//! It matches the exact op sequence [`titan_ir::float8::quantize`] emits for a tensor-scaled
//! operand ([`titan_ir::float8::match_tensor_quantize`]); a weight quantized any other way (the
//! rowwise recipes, a `take_shard` of the gathered weight as with kv-head replication) keeps its
//! bf16 gather, and the report says which weights were converted.

use titan_ir::float8::{TensorQuantize, match_tensor_quantize};
use titan_ir::{Builder, CollectiveReduce, DType, Graph, MeshDim, NodeId, Op, Region, TensorType, Value, ValueDef};

use crate::PassDiag;
use crate::util::replace_uses;

/// What the pass did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Float8GatherStats {
    /// Weight gathers now in fp8 (each block's once, for every layer).
    pub gathers: usize,
    /// The amax all-reduces it added.
    pub all_reduces: usize,
    /// One line per converted gather: region, weight, bytes per call before and after.
    pub notes: Vec<String>,
}

/// One tensor-scaled quantization of a `dp_shard`-gathered value.
struct Site {
    m: TensorQuantize,
    /// The shard the gather reads and the gather's op.
    shard: Value,
    gather: Op,
}

fn def_node(r: &Region, v: Value) -> Option<NodeId> {
    match r.value(v).def {
        ValueDef::Result { node, .. } => Some(node),
        ValueDef::Arg(_) => None,
    }
}

fn sites(r: &Region) -> Vec<Site> {
    let mut out = Vec::new();
    for &n in &r.order {
        let Some(m) = match_tensor_quantize(r, n) else { continue };
        let Some(gn) = def_node(r, m.x) else { continue };
        let gather = &r.node(gn).op;
        if matches!(gather, Op::AllGather { mesh_dim: MeshDim::DpShard, .. }) {
            out.push(Site { m, shard: r.node(gn).inputs[0], gather: gather.clone() });
        }
    }
    out
}

fn err(e: String) -> PassDiag {
    PassDiag::invalid(e)
}

/// Local amax of `shard` over all its axes: `reduce_max(abs(shard))`.
fn local_amax(b: &mut Builder, shard: Value) -> Result<Value, String> {
    let rank = b.ty(shard).rank();
    let abs = b.push1(Op::Unary(titan_ir::UnaryOp::Abs), &[shard])?;
    b.push1(Op::Reduce { kind: titan_ir::ReduceKind::Max, axes: (0..rank).collect() }, &[abs])
}

fn max_all_reduce(b: &mut Builder, v: Value) -> Result<Value, String> {
    b.push1(Op::AllReduce { mesh_dim: MeshDim::DpShard, reduce: CollectiveReduce::Max }, &[v])
}

/// The shard quantized with `scale` (as the matched quantization does it) and all-gathered.
fn quantize_and_gather(b: &mut Builder, site: &Site) -> Result<Value, String> {
    let s = site.shard;
    let sty = b.ty(s).clone();
    let sf = if sty.dtype == DType::F32 { s } else { b.push_typed(Op::Cast, &[s], TensorType::new(DType::F32, sty.shape.clone()))? };
    let scaled = b.push1(Op::Binary(titan_ir::BinaryOp::Mul), &[sf, site.m.scale])?;
    let lo = b.push1(Op::Binary(titan_ir::BinaryOp::Max), &[scaled, site.m.lo])?;
    let hi = b.push1(Op::Binary(titan_ir::BinaryOp::Min), &[lo, site.m.hi])?;
    let q = b.push_typed(Op::Cast, &[hi], TensorType::new(site.m.dtype, sty.shape.clone()))?;
    b.push1(site.gather.clone(), &[q])
}

fn bytes(r: &Region, v: Value, dims: &titan_ir::DimTable) -> u64 {
    let t = r.ty(v);
    crate::util::fixed_dims(t, dims).map(|d| d.iter().product::<u64>()).unwrap_or(0) * t.dtype.size_bytes() as u64
}

/// Rewrite one region; returns its statistics.
fn rewrite_region(r: &mut Region, dims: &titan_ir::DimTable, blocks: &[Region], name: &str, precompute: bool) -> Result<Float8GatherStats, PassDiag> {
    let sites = sites(r);
    let mut stats = Float8GatherStats::default();
    if sites.is_empty() {
        return Ok(stats);
    }
    let pos = |r: &Region, n: NodeId| r.order.iter().position(|&m| m == n);
    // Batch the amaxes (precompute) when every shard exists before the first amax is needed and
    // they share a dtype (one vector all-reduce).
    let first_amax = sites.iter().filter_map(|s| pos(r, s.m.amax_node)).min().unwrap_or(0);
    let defined_before = |v: Value| def_node(r, v).is_none_or(|n| pos(r, n).is_some_and(|p| p < first_amax));
    let dtype0 = r.ty(sites[0].m.amax).dtype;
    let batch = precompute && sites.len() > 1 && sites.iter().all(|s| defined_before(s.shard) && r.ty(s.m.amax).dtype == dtype0);
    for s in &sites {
        let wname = r.value(s.shard).name.clone().unwrap_or_else(|| format!("%{}", s.shard.0));
        let wname = wname.strip_suffix(".bf16").unwrap_or(&wname).to_string();
        let gathered = def_node(r, s.m.x).map(|n| r.node(n).results[0]).unwrap_or(s.m.x);
        let before = bytes(r, gathered, dims);
        let after = before / r.ty(gathered).dtype.size_bytes() as u64 * s.m.dtype.size_bytes() as u64;
        stats.notes.push(format!("{name}: {wname} gathered as {} ({before} -> {after} bytes per gather)", s.m.dtype));
    }
    let old = std::mem::take(&mut r.order);
    let mut batched_done = false;
    for n in old {
        if batch && !batched_done && pos_is(n, &sites, |s| s.m.amax_node) {
            batched_done = true;
            let mut b = Builder::new(r, dims, blocks);
            let mut parts = Vec::new();
            for s in &sites {
                let a = local_amax(&mut b, s.shard).map_err(err)?;
                let one = TensorType::new(b.ty(a).dtype, vec![titan_ir::Dim::Fixed(1)]);
                parts.push(b.push_typed(Op::Reshape, &[a], one).map_err(err)?);
            }
            let cat = b.push1(Op::Concat { axis: 0 }, &parts).map_err(err)?;
            let all = max_all_reduce(&mut b, cat).map_err(err)?;
            let mut shared = Vec::new();
            for (i, s) in sites.iter().enumerate() {
                let one = b.push1(Op::Slice { axis: 0, start: i as u64, len: 1 }, &[all]).map_err(err)?;
                let scalar = TensorType::scalar(b.ty(one).dtype);
                let v = b.push_typed(Op::Reshape, &[one], scalar).map_err(err)?;
                name_new(b.region, v, s.shard, "amax");
                shared.push((s.m.amax, v));
            }
            stats.all_reduces += 1;
            for (old_v, new_v) in shared {
                replace_uses(r, old_v, new_v, None);
            }
        }
        if !batch && let Some(s) = sites.iter().find(|s| s.m.amax_node == n) {
            let mut b = Builder::new(r, dims, blocks);
            let a = local_amax(&mut b, s.shard).map_err(err)?;
            let all = max_all_reduce(&mut b, a).map_err(err)?;
            name_new(b.region, all, s.shard, "amax");
            stats.all_reduces += 1;
            replace_uses(r, s.m.amax, all, None);
        }
        r.order.push(n);
        if let Some(s) = sites.iter().find(|s| s.m.cast_node == n) {
            let mut b = Builder::new(r, dims, blocks);
            let q = quantize_and_gather(&mut b, s).map_err(err)?;
            name_new(b.region, q, s.shard, "f8.gathered");
            replace_uses(r, s.m.q, q, None);
            stats.gathers += 1;
        }
    }
    Ok(stats)
}

/// Name `v` `<shard's name>.<suffix>` when the shard has a name no value of `r` has taken.
fn name_new(r: &mut Region, v: Value, shard: Value, suffix: &str) {
    if let Some(base) = r.value(shard).name.clone() {
        let name = format!("{}.{suffix}", base.strip_suffix(".bf16").unwrap_or(&base));
        if r.find(&name).is_none() {
            r.values[v.index()].name = Some(name);
        }
    }
}

fn pos_is(n: NodeId, sites: &[Site], f: impl Fn(&Site) -> NodeId) -> bool {
    sites.iter().any(|s| f(s) == n)
}

/// Gather the tensor-scaled fp8 weights of every region in fp8 (see the module documentation).
pub fn float8_fsdp_gather(g: &mut Graph, precompute: bool) -> Result<Float8GatherStats, PassDiag> {
    let mut total = Float8GatherStats::default();
    let mut add = |s: Float8GatherStats| {
        total.gathers += s.gathers;
        total.all_reduces += s.all_reduces;
        total.notes.extend(s.notes);
    };
    for i in 0..g.blocks.len() {
        let mut r = std::mem::take(&mut g.blocks[i]);
        let name = format!("@{}", r.name);
        let res = rewrite_region(&mut r, &g.dims, &g.blocks, &name, precompute);
        g.blocks[i] = r;
        add(res?);
    }
    let mut main = std::mem::take(&mut g.main);
    let res = rewrite_region(&mut main, &g.dims, &g.blocks, "main", precompute);
    g.main = main;
    add(res?);
    Ok(total)
}
