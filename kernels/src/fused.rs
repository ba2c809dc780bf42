//! `fused` kernels: pointwise chains, broadcasts, RoPE and row reductions (rmsnorm, rmsnorm_bwd,
//! reduce over trailing axes, cross_entropy, cross_entropy_bwd, and the vocab-parallel loss's
//! cross_entropy_stats, cross_entropy_stats_bwd, cross_entropy_combine), with cross-block results
//! (full reductions, column sums such as rmsnorm_bwd's `dw`, the mean loss) finished by the last
//! block to arrive.
//!
//! Two shapes of kernel:
//! * flat: a grid-stride loop over vectors of the whole domain (16-byte accesses when the sizes
//!   allow), for groups without row ops;
//! * rows: one CTA per row (a grid-stride loop over rows when cross-block sums need a bounded
//!   grid). The row is read in passes, one per level of dependent reductions; rows of up to
//!   4096 vectors are held in registers across passes (the work items are unrolled), longer rows
//!   (the vocabulary) are looped and recomputed, with an online max/sum-exp for log-sum-exp.
//!   Per-row reductions go lane -> warp (`shfl.bfly`) -> block (shared memory), in a fixed order.
//!
//! Cross-block results go through the workspace: each CTA writes its partial, bumps a counter, and
//! the last CTA sums the partials in CTA order (deterministic), zeroes them and the counter.

use titan_ir::{Graph, Node, Op, ReduceKind, Region, RopeConfig, RopeLayout, Value};

use crate::emit::{Elem, FCmp, Func, ICmp, Ty, Val};
use crate::values::{Body, Eval, Lay, Pos, RopeRow, RowKey, narrow, rope_freqs, storage, vec_align};
use crate::{GenResult, Generated, invalid, math, unsupported};

/// Threads of a flat kernel.
const FLAT_BLOCK: u64 = 256;
/// Grid cap of flat kernels: 8 CTAs of 256 threads on each of 132 SMs.
const FLAT_GRID_CAP: u64 = 1056;
/// Grid cap of kernels with cross-block sums (bounds the workspace: one partial per CTA).
const ACC_GRID_CAP: u64 = 1056;
/// Work items a thread holds in registers across passes.
const UNROLL_MAX: u64 = 4;
const MAX_BLOCK: u64 = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RedOp {
    Sum,
    Max,
    /// Online log-sum-exp: state `(max, sum of exp(x - max))`.
    Lse,
}

impl RedOp {
    fn from_reduce(k: ReduceKind) -> RedOp {
        match k {
            ReduceKind::Max => RedOp::Max,
            ReduceKind::Sum | ReduceKind::Mean => RedOp::Sum,
        }
    }

    fn identity(self) -> Vec<f64> {
        match self {
            RedOp::Sum => vec![0.0],
            RedOp::Max => vec![f64::NEG_INFINITY],
            RedOp::Lse => vec![f64::NEG_INFINITY, 0.0],
        }
    }
}

/// What a row reduction sums per element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Contrib {
    Square(Value),
    /// `dy * w * x` (rmsnorm_bwd's `sum(dn * x)`).
    DyWX {
        x: Value,
        w: Value,
        dy: Value,
    },
    Plain(Value),
    /// `-j` where element `j` of `x` equals the row's max (`RowKey::Max` of node `key`), `-inf`
    /// elsewhere: its max is minus the first position of the maximum (cross_entropy_stats_bwd).
    NegFirstMax {
        x: Value,
        key: usize,
    },
    /// `s * exp(m - max)`, `max` the row's max of `m` (`RowKey::Max` of node `key`):
    /// cross_entropy_combine's rescaled sum of the shards' `sumexp`.
    ShiftedExp {
        s: Value,
        m: Value,
        key: usize,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RowRed {
    level: u32,
    op: RedOp,
    contrib: Contrib,
}

/// A node whose per-element results need row reductions first.
struct RowOp<'g> {
    node: &'g Node,
    key: usize,
    level: u32,
    reds: Vec<usize>,
}

/// Where a cross-block accumulation's contributions come from.
#[derive(Clone, Copy, Debug)]
enum AccSrc {
    /// Every element of a per-element value.
    Elem(Value),
    /// A per-row value, once per row.
    Row(Value),
    /// The row's loss `lse - x[target]` of a cross_entropy node.
    CeLoss { key: usize, logits: Value },
    /// The row's loss `max + ln(sumexp) - target` of a cross_entropy_combine node.
    CeCombine { key: usize },
    /// rmsnorm_bwd's `dy * round(x * inv)` per column.
    RmsDw { key: usize, x: Value, dy: Value },
}

#[derive(Clone, Copy, Debug)]
struct Acc {
    col: bool,
    op: RedOp,
    src: AccSrc,
    level: u32,
    result: Value,
    /// The total is divided by this (means).
    divide: Option<f64>,
}

#[derive(Clone, Copy, Debug)]
struct RopeInfo {
    cfg: RopeConfig,
    seq: u64,
    head_dim: u64,
}

struct Analysis<'g> {
    flat: bool,
    rows: u64,
    d: u64,
    rope: Option<RopeInfo>,
    lay: Vec<Lay>,
    level: Vec<u32>,
    reds: Vec<RowRed>,
    row_ops: Vec<RowOp<'g>>,
    accs: Vec<Acc>,
}

fn shape_str(s: &[u64]) -> String {
    let p: Vec<String> = s.iter().map(|d| d.to_string()).collect();
    format!("[{}]", p.join(", "))
}

/// Find the row structure `(rows, row length)` the row ops agree on, and RoPE's parameters.
/// `(rows, row length)` of a row kernel.
type RowShape = Option<(u64, u64)>;

fn domain(b: &Body) -> GenResult<(RowShape, Option<RopeInfo>)> {
    let mut cand: Option<(u64, u64, String)> = None;
    let mut rope: Option<RopeInfo> = None;
    let mut note = |rows: u64, d: u64, what: &str| -> GenResult<()> {
        match &cand {
            None => {
                cand = Some((rows, d, what.to_string()));
                Ok(())
            }
            Some((r, dd, w)) if (*r, *dd) != (rows, d) => {
                unsupported(format!("`{what}` works on rows of {d} elements but `{w}` on rows of {dd}; split the group so each kernel has one row length"))
            }
            Some(_) => Ok(()),
        }
    };
    for node in b.nodes() {
        match &node.op {
            Op::Unary(_) | Op::Binary(_) | Op::Cast | Op::Constant { .. } | Op::Broadcast { .. } | Op::Reshape => {}
            Op::RmsNorm { .. }
            | Op::RmsNormBwd { .. }
            | Op::CrossEntropy
            | Op::CrossEntropyBwd
            | Op::CrossEntropyStats
            | Op::CrossEntropyStatsBwd
            | Op::CrossEntropyCombine => {
                let s = &b.shape[node.inputs[0].index()];
                let Some(&d) = s.last() else {
                    return invalid(format!("`{}` input must have rank >= 1", node.op.name()));
                };
                if d == 0 {
                    return unsupported(format!("`{}` over empty rows", node.op.name()));
                }
                note(b.numel(node.inputs[0]) / d, d, node.op.name())?;
            }
            Op::Rope(cfg) => {
                let s = &b.shape[node.inputs[0].index()];
                let &[bt, sq, h, hd] = s.as_slice() else {
                    return invalid(format!("rope input must be [batch, seq, heads, head_dim], found {}", shape_str(s)));
                };
                if hd % 2 != 0 || hd == 0 {
                    return invalid(format!("rope head_dim must be even, found {hd}"));
                }
                let info = RopeInfo { cfg: *cfg, seq: sq, head_dim: hd };
                match rope {
                    Some(r) if r.cfg != *cfg || r.seq != sq || r.head_dim != hd => {
                        return unsupported("two ropes with different configs or shapes in one group; split them into separate kernels");
                    }
                    _ => rope = Some(info),
                }
                note(bt * sq, h * hd, "rope")?;
            }
            Op::Reduce { axes, .. } => {
                let s = &b.shape[node.inputs[0].index()];
                let rank = s.len();
                let all = axes.len() == rank;
                let suffix = axes.iter().enumerate().all(|(i, &a)| a == rank - axes.len() + i);
                let prefix = axes.iter().enumerate().all(|(i, &a)| a == i);
                if all {
                    continue;
                }
                let p: u64 = axes.iter().map(|&a| s[a]).product();
                let numel = b.numel(node.inputs[0]);
                if suffix && p > 0 {
                    note(numel / p, p, node.op.name())?;
                } else if prefix && p > 0 {
                    note(p, numel / p, node.op.name())?;
                } else {
                    return unsupported(format!(
                        "`{}` over axes {axes:?} of {}: only trailing axes, leading axes or all axes are supported; transpose so the reduced axes are contiguous",
                        node.op.name(),
                        shape_str(s)
                    ));
                }
            }
            other => {
                return unsupported(format!("`{}` cannot be part of a fused kernel; give it its own kernel kind", other.name()));
            }
        }
    }
    if rope.is_some()
        && b.nodes().any(|n| !matches!(n.op, Op::Rope(_) | Op::Unary(_) | Op::Binary(_) | Op::Cast | Op::Constant { .. } | Op::Broadcast { .. } | Op::Reshape))
    {
        return unsupported("rope fused with a row reduction; keep rope in a group of its own pointwise ops");
    }
    Ok((cand.map(|(r, d, _)| (r, d)), rope))
}

fn analyze<'g>(b: &Body<'g>) -> GenResult<Analysis<'g>> {
    let (rowdef, rope) = domain(b)?;
    let nv = b.r.values.len();
    let (flat, rows, d, n) = match rowdef {
        Some((r, d)) => (false, r, d, r * d),
        None => {
            let n = b.r.values.iter().enumerate().map(|(i, _)| b.numel(Value(i as u32))).max().unwrap_or(1);
            (true, n, 1, n)
        }
    };
    if n == 0 {
        return unsupported("empty tensors in a fused kernel; drop the group");
    }
    let mut lay: Vec<Option<Lay>> = vec![None; nv];
    let mut level = vec![0u32; nv];
    // Flat kernels may cover several element domains (one per tensor size); row kernels one.
    let class = |numel: u64| -> Option<Lay> {
        if numel == 1 {
            Some(Lay::Scalar)
        } else if numel == n || flat {
            Some(Lay::Elem)
        } else if !flat && rows != d && numel == rows {
            Some(Lay::Row)
        } else if !flat && rows != d && numel == d {
            Some(Lay::Col)
        } else {
            None
        }
    };
    let demand = |lay: &mut Vec<Option<Lay>>, v: Value, want: Lay| -> GenResult<()> {
        match lay[v.index()] {
            None => {
                lay[v.index()] = Some(want);
                Ok(())
            }
            Some(l) if l == want => Ok(()),
            Some(l) => unsupported(format!("value {v} is used as {want:?} but computed as {l:?}; the group mixes index spaces")),
        }
    };
    let known = |lay: &Vec<Option<Lay>>, v: Value| -> GenResult<Lay> {
        match lay[v.index()].or_else(|| class(b.numel(v))) {
            Some(l) => Ok(l),
            None => unsupported(format!(
                "cannot tell how {v} ({}) is indexed in a kernel over {} elements; only rows, columns, scalars and whole tensors are supported",
                shape_str(&b.shape[v.index()]),
                n
            )),
        }
    };
    let mut reds: Vec<RowRed> = Vec::new();
    let add_red = |reds: &mut Vec<RowRed>, r: RowRed| -> usize {
        if let Some(i) = reds.iter().position(|x| *x == r) {
            i
        } else {
            reds.push(r);
            reds.len() - 1
        }
    };
    let mut row_ops = Vec::new();
    let mut accs = Vec::new();
    // Results nothing reads need no cross-block sums (rmsnorm_bwd's dw, an unused loss).
    let mut used = vec![false; nv];
    for node in b.nodes() {
        for &i in &node.inputs {
            used[i.index()] = true;
        }
    }
    for o in &b.r.outputs {
        used[o.value.index()] = true;
    }
    for node in b.nodes() {
        let key = b.node_key(node);
        let lv = |level: &Vec<u32>, vs: &[Value]| vs.iter().map(|v| level[v.index()]).max().unwrap_or(0);
        match &node.op {
            Op::Constant { .. } => {
                let r = node.results[0];
                let l = known(&lay, r)?;
                lay[r.index()] = Some(l);
            }
            Op::Unary(_) | Op::Binary(_) | Op::Cast | Op::Reshape => {
                // Operands already known decide unknown arguments of the same size.
                let mut ls = Vec::new();
                for &i in &node.inputs {
                    if lay[i.index()].is_none() {
                        let same = node.inputs.iter().find(|&&o| o != i && b.numel(o) == b.numel(i)).and_then(|o| lay[o.index()]);
                        let l = match same {
                            Some(l) => l,
                            None => known(&lay, i)?,
                        };
                        lay[i.index()] = Some(l);
                    }
                    ls.push(lay[i.index()].unwrap_or(Lay::Scalar));
                }
                let r = node.results[0];
                let l = combine_lays(&ls, r)?;
                let l = if matches!(node.op, Op::Reshape) && l == Lay::Elem && !flat && b.numel(r) != n {
                    return unsupported(format!("reshape of {} elements inside a kernel over {n}", b.numel(r)));
                } else {
                    l
                };
                lay[r.index()] = Some(l);
                level[r.index()] = lv(&level, &node.inputs);
            }
            Op::Broadcast { dims } => {
                let x = node.inputs[0];
                let r = node.results[0];
                let out_shape = &b.shape[r.index()];
                let rl = if b.numel(r) == 1 {
                    Lay::Scalar
                } else if b.numel(r) == n || flat {
                    Lay::Elem
                } else {
                    return unsupported(format!("broadcast to {} inside a kernel over {n} elements", shape_str(out_shape)));
                };
                if b.numel(x) == 1 {
                    let xl = known(&lay, x)?;
                    if xl.is_post() {
                        if rl != Lay::Scalar {
                            return unsupported(format!("broadcast of the cross-block result {x} to every element needs a second kernel; split the group"));
                        }
                        lay[r.index()] = Some(Lay::PostScalar);
                        continue;
                    }
                    demand(&mut lay, x, Lay::Scalar)?;
                } else if flat {
                    if b.arg_index(x).is_none() {
                        return unsupported(format!("broadcast of the computed value {x}; only arguments and scalars can be broadcast in a pointwise kernel"));
                    }
                    demand(&mut lay, x, Lay::Gen)?;
                } else {
                    let xs = &b.shape[x.index()];
                    let k = dims.len();
                    let leading = dims.iter().enumerate().all(|(i, &dd)| dd == i) && out_shape[..k].iter().product::<u64>() == rows && b.numel(x) == rows;
                    let m = out_shape.len().saturating_sub(k);
                    let trailing = dims.iter().enumerate().all(|(i, &dd)| dd == m + i) && out_shape[m..].iter().product::<u64>() == d && b.numel(x) == d;
                    if trailing && xs.iter().zip(&out_shape[m..]).all(|(a, o)| a == o) {
                        demand(&mut lay, x, Lay::Col)?;
                    } else if leading && xs.iter().zip(&out_shape[..k]).all(|(a, o)| a == o) {
                        demand(&mut lay, x, Lay::Row)?;
                    } else {
                        return unsupported(format!(
                            "broadcast of {} along dims {dims:?} to {}: row kernels broadcast only per-row or per-column values",
                            shape_str(xs),
                            shape_str(out_shape)
                        ));
                    }
                }
                lay[r.index()] = Some(rl);
                level[r.index()] = level[x.index()];
            }
            Op::Reduce { kind, axes } => {
                let x = node.inputs[0];
                let r = node.results[0];
                let xl = known(&lay, x)?;
                lay[x.index()] = Some(xl);
                let s = &b.shape[x.index()];
                let count: u64 = axes.iter().map(|&a| s[a]).product();
                let divide = (*kind == ReduceKind::Mean).then_some(count as f64);
                let op = RedOp::from_reduce(*kind);
                if axes.len() == s.len() {
                    let src = match xl {
                        Lay::Elem => AccSrc::Elem(x),
                        Lay::Row => AccSrc::Row(x),
                        other => return unsupported(format!("full reduction of a {other:?} value {x}; reduce whole tensors or per-row values")),
                    };
                    accs.push(Acc { col: false, op, src, level: level[x.index()], result: r, divide });
                    lay[r.index()] = Some(Lay::PostScalar);
                } else if xl == Lay::Elem && axes.first() == Some(&0) && count == rows {
                    accs.push(Acc { col: true, op, src: AccSrc::Elem(x), level: level[x.index()], result: r, divide });
                    lay[r.index()] = Some(Lay::PostCol);
                } else if xl == Lay::Elem && count == d {
                    let i = add_red(&mut reds, RowRed { level: level[x.index()], op, contrib: Contrib::Plain(x) });
                    row_ops.push(RowOp { node, key, level: level[x.index()], reds: vec![i] });
                    lay[r.index()] = Some(Lay::Row);
                    level[r.index()] = level[x.index()] + 1;
                } else {
                    return unsupported(format!("`{}` of the {xl:?} value {x} over axes {axes:?}", node.op.name()));
                }
            }
            Op::RmsNorm { .. } => {
                let (x, w) = (node.inputs[0], node.inputs[1]);
                demand(&mut lay, x, Lay::Elem)?;
                demand(&mut lay, w, if d == 1 { Lay::Scalar } else { Lay::Col })?;
                let l = lv(&level, &node.inputs);
                let i = add_red(&mut reds, RowRed { level: l, op: RedOp::Sum, contrib: Contrib::Square(x) });
                row_ops.push(RowOp { node, key, level: l, reds: vec![i] });
                lay[node.results[0].index()] = Some(Lay::Elem);
                level[node.results[0].index()] = l + 1;
            }
            Op::RmsNormBwd { .. } => {
                let (x, w, dy) = (node.inputs[0], node.inputs[1], node.inputs[2]);
                demand(&mut lay, x, Lay::Elem)?;
                demand(&mut lay, w, if d == 1 { Lay::Scalar } else { Lay::Col })?;
                demand(&mut lay, dy, Lay::Elem)?;
                let l = lv(&level, &node.inputs);
                let i = add_red(&mut reds, RowRed { level: l, op: RedOp::Sum, contrib: Contrib::Square(x) });
                let j = add_red(&mut reds, RowRed { level: l, op: RedOp::Sum, contrib: Contrib::DyWX { x, w, dy } });
                row_ops.push(RowOp { node, key, level: l, reds: vec![i, j] });
                lay[node.results[0].index()] = Some(Lay::Elem);
                level[node.results[0].index()] = l + 1;
                if used[node.results[1].index()] {
                    accs.push(Acc { col: true, op: RedOp::Sum, src: AccSrc::RmsDw { key, x, dy }, level: l + 1, result: node.results[1], divide: None });
                }
                lay[node.results[1].index()] = Some(Lay::PostCol);
            }
            Op::CrossEntropy | Op::CrossEntropyBwd => {
                let (logits, targets) = (node.inputs[0], node.inputs[1]);
                demand(&mut lay, logits, Lay::Elem)?;
                demand(&mut lay, targets, if rows == 1 { Lay::Scalar } else { Lay::Row })?;
                if b.arg_index(targets).is_none() {
                    return unsupported("cross-entropy targets must be a kernel argument");
                }
                let l = level[logits.index()];
                let i = add_red(&mut reds, RowRed { level: l, op: RedOp::Lse, contrib: Contrib::Plain(logits) });
                row_ops.push(RowOp { node, key, level: l, reds: vec![i] });
                if matches!(node.op, Op::CrossEntropy) {
                    if used[node.results[0].index()] {
                        accs.push(Acc {
                            col: false,
                            op: RedOp::Sum,
                            src: AccSrc::CeLoss { key, logits },
                            level: l + 1,
                            result: node.results[0],
                            divide: Some(rows as f64),
                        });
                    }
                    lay[node.results[0].index()] = Some(Lay::PostScalar);
                } else {
                    let dl = node.inputs[2];
                    let dll = known(&lay, dl)?;
                    if dll != Lay::Scalar {
                        return unsupported(format!("cross_entropy_bwd's dloss {dl} must be a plain scalar (it is {dll:?}); compute it in another kernel"));
                    }
                    lay[dl.index()] = Some(Lay::Scalar);
                    lay[node.results[0].index()] = Some(Lay::Elem);
                    level[node.results[0].index()] = l + 1;
                }
            }
            Op::CrossEntropyStats | Op::CrossEntropyStatsBwd => {
                let (logits, targets, shard) = (node.inputs[0], node.inputs[1], node.inputs[2]);
                demand(&mut lay, logits, Lay::Elem)?;
                let per_row = if rows == 1 { Lay::Scalar } else { Lay::Row };
                demand(&mut lay, targets, per_row)?;
                if b.arg_index(targets).is_none() || b.arg_index(shard).is_none() {
                    return unsupported(format!("`{}`'s targets and shard must be kernel arguments", node.op.name()));
                }
                if b.nodes().any(|n| n.inputs.contains(&shard) && !matches!(n.op, Op::CrossEntropyStats | Op::CrossEntropyStatsBwd)) {
                    return unsupported(format!(
                        "the vocabulary shard {shard} is read by an op other than cross_entropy_stats(_bwd); keep that op in another kernel"
                    ));
                }
                // The one-hot shard is read element by element (`RowGen::targets`), never per lane.
                demand(&mut lay, shard, Lay::Gen)?;
                for &dv in node.inputs.get(3..).unwrap_or_default() {
                    demand(&mut lay, dv, per_row)?;
                }
                let l = lv(&level, &node.inputs);
                let i = add_red(&mut reds, RowRed { level: l, op: RedOp::Lse, contrib: Contrib::Plain(logits) });
                row_ops.push(RowOp { node, key, level: l, reds: vec![i] });
                if matches!(node.op, Op::CrossEntropyStats) {
                    for &r in &node.results {
                        lay[r.index()] = Some(per_row);
                        level[r.index()] = l + 1;
                    }
                } else {
                    let j = add_red(&mut reds, RowRed { level: l + 1, op: RedOp::Max, contrib: Contrib::NegFirstMax { x: logits, key } });
                    row_ops.push(RowOp { node, key, level: l + 1, reds: vec![j] });
                    lay[node.results[0].index()] = Some(Lay::Elem);
                    level[node.results[0].index()] = l + 2;
                }
            }
            Op::CrossEntropyCombine => {
                let (m, s, t) = (node.inputs[0], node.inputs[1], node.inputs[2]);
                for x in [m, s, t] {
                    demand(&mut lay, x, Lay::Elem)?;
                }
                let l = lv(&level, &node.inputs);
                let i = add_red(&mut reds, RowRed { level: l, op: RedOp::Max, contrib: Contrib::Plain(m) });
                let j = add_red(&mut reds, RowRed { level: l, op: RedOp::Sum, contrib: Contrib::Plain(t) });
                let k = add_red(&mut reds, RowRed { level: l + 1, op: RedOp::Sum, contrib: Contrib::ShiftedExp { s, m, key } });
                row_ops.push(RowOp { node, key, level: l, reds: vec![i, j] });
                row_ops.push(RowOp { node, key, level: l + 1, reds: vec![k] });
                if used[node.results[0].index()] {
                    accs.push(Acc {
                        col: false,
                        op: RedOp::Sum,
                        src: AccSrc::CeCombine { key },
                        level: l + 2,
                        result: node.results[0],
                        divide: Some(rows as f64),
                    });
                }
                lay[node.results[0].index()] = Some(Lay::PostScalar);
            }
            Op::Rope(_) => {
                let x = node.inputs[0];
                demand(&mut lay, x, Lay::Elem)?;
                lay[node.results[0].index()] = Some(Lay::Elem);
                level[node.results[0].index()] = level[x.index()];
            }
            other => return unsupported(format!("`{}` in a fused kernel", other.name())),
        }
    }
    for o in &b.r.outputs {
        if lay[o.value.index()].is_none() {
            let l = known(&lay, o.value)?;
            lay[o.value.index()] = Some(l);
        }
        if lay[o.value.index()] == Some(Lay::Gen) {
            return unsupported(format!("output {} is a broadcast source; outputs must cover the kernel's domain", o.value));
        }
    }
    let lay: Vec<Lay> = lay.into_iter().map(|l| l.unwrap_or(Lay::Scalar)).collect();
    if rope.is_some() && !accs.is_empty() {
        return unsupported("reductions in a rope kernel; keep rope in a group of its own pointwise ops");
    }
    Ok(Analysis { flat, rows, d, rope, lay, level, reds, row_ops, accs })
}

/// The layout of a pointwise result from its operands'.
fn combine_lays(ls: &[Lay], r: Value) -> GenResult<Lay> {
    let post = ls.iter().any(|l| l.is_post());
    let mut main: Vec<Lay> = ls.iter().copied().filter(|l| !matches!(l, Lay::Scalar) && !l.is_post()).collect();
    main.dedup();
    if post {
        if main.iter().any(|&l| l != Lay::Col) {
            return unsupported(format!("{r} combines a cross-block result with per-element values; that needs a second kernel, split the group"));
        }
        return Ok(if ls.contains(&Lay::PostCol) || main.contains(&Lay::Col) { Lay::PostCol } else { Lay::PostScalar });
    }
    match main.as_slice() {
        [] => Ok(Lay::Scalar),
        [l] => Ok(if *l == Lay::Gen { Lay::Elem } else { *l }),
        _ => unsupported(format!("{r} combines values indexed as {main:?}; broadcast them explicitly")),
    }
}

/// Lanes per work item: the widest of 8, 4, 2, 1 dividing every size in `sizes`.
fn lanes_dividing(sizes: &[u64]) -> u32 {
    [8u32, 4, 2, 1].into_iter().find(|&v| sizes.iter().all(|&s| s.is_multiple_of(u64::from(v)))).unwrap_or(1)
}

/// The state of one reduction of `op` after folding in the lanes of `x`; `valid` (i1) masks
/// the whole work item.
fn update(f: &mut Func, op: RedOp, st: &[Val], x: Val, valid: Option<Val>) -> Vec<Val> {
    let lanes = x.ty.lanes();
    match op {
        RedOp::Sum | RedOp::Max => {
            let id = if op == RedOp::Sum { 0.0 } else { f64::NEG_INFINITY };
            let x = match valid {
                Some(ok) => {
                    let z = f.cf(id, x.ty);
                    f.select(ok, x, z)
                }
                None => x,
            };
            let mut acc = st[0];
            for l in 0..lanes {
                let e = f.extract(x, l);
                acc = if op == RedOp::Sum { f.addf(acc, e) } else { f.maximumf(acc, e) };
            }
            vec![acc]
        }
        RedOp::Lse => {
            let xm = match valid {
                Some(ok) => {
                    let z = f.cf(f64::NEG_INFINITY, x.ty);
                    f.select(ok, x, z)
                }
                None => x,
            };
            let mut m_item = f.extract(xm, 0);
            for l in 1..lanes {
                let e = f.extract(xm, l);
                m_item = f.maximumf(m_item, e);
            }
            let m_new = f.maximumf(st[0], m_item);
            let sc = lse_scale(f, st[0], m_new);
            let mut s = f.mulf(st[1], sc);
            let mv = f.splat(m_new, lanes);
            let dx = f.subf(xm, mv);
            let e = math::exp(f, dx);
            let e = match valid {
                Some(ok) => {
                    let z = f.cf(0.0, e.ty);
                    f.select(ok, e, z)
                }
                None => e,
            };
            for l in 0..lanes {
                let el = f.extract(e, l);
                s = f.addf(s, el);
            }
            vec![m_new, s]
        }
    }
}

/// `exp(m_old - m_new)`, and 1 when both are equal (so two empty states stay empty).
fn lse_scale(f: &mut Func, m_old: Val, m_new: Val) -> Val {
    let eq = f.cmpf(FCmp::Oeq, m_old, m_new);
    let d = f.subf(m_old, m_new);
    let e = math::exp(f, d);
    let one = f.f32c(1.0);
    f.select(eq, one, e)
}

fn combine(f: &mut Func, op: RedOp, a: &[Val], b: &[Val]) -> Vec<Val> {
    match op {
        RedOp::Sum => vec![f.addf(a[0], b[0])],
        RedOp::Max => vec![f.maximumf(a[0], b[0])],
        RedOp::Lse => {
            // Scale the smaller-max side by exp(lo - hi): one exp per combine.
            let m = f.maximumf(a[0], b[0]);
            let ge = f.cmpf(FCmp::Oge, a[0], b[0]);
            let (hs, ls) = (f.select(ge, a[1], b[1]), f.select(ge, b[1], a[1]));
            let (hm, lm) = (f.select(ge, a[0], b[0]), f.select(ge, b[0], a[0]));
            let sc = lse_scale(f, lm, hm);
            let t = f.mulf(ls, sc);
            vec![m, f.addf(hs, t)]
        }
    }
}

/// Reduce per-thread states across the block; every thread gets the totals, computed in the
/// same order everywhere. Warp butterflies first; then lane 0 of each warp publishes its
/// warp's state in shared memory and every warp reduces those states with one more butterfly
/// (lane `l` takes warp `l`'s state).
fn block_reduce(f: &mut Func, ops: &[RedOp], states: Vec<Vec<Val>>, threads: u32, smem: Val, tid: Val) -> Vec<Vec<Val>> {
    let butterfly = |f: &mut Func, states: &mut Vec<Vec<Val>>, width: u32| {
        let mut off = width / 2;
        while off >= 1 {
            for (op, st) in ops.iter().zip(states.iter_mut()) {
                let other: Vec<Val> = st.iter().map(|&x| f.shuffle_xor(x, off)).collect();
                *st = combine(f, *op, st, &other);
            }
            off /= 2;
        }
    };
    let mut states = states;
    butterfly(f, &mut states, threads.min(32));
    let warps = threads.div_ceil(32);
    if warps <= 1 {
        return states;
    }
    let ncomp: usize = states.iter().map(Vec::len).sum();
    let c32 = f.i32c(32);
    let lane = f.remui(tid, c32);
    let warp = f.divui(tid, c32);
    let zero = f.i32c(0);
    let is0 = f.cmpi(ICmp::Eq, lane, zero);
    let flat: Vec<Val> = states.iter().flatten().copied().collect();
    f.if_then(is0, |f| {
        let w = f.extui(warp, Elem::I64);
        let nc = f.i64c(ncomp as i64);
        let base = f.muli(w, nc);
        for (c, &x) in flat.iter().enumerate() {
            let o = f.i64c(c as i64);
            let idx = f.addi(base, o);
            f.store_at(x, smem, idx, 4);
        }
    });
    f.barrier();
    // Within each group of `width` lanes, lane l reads warp l's state (identity past the last
    // warp), so every group, hence every lane, folds the same values in the same order.
    let width = warps.next_power_of_two().min(32);
    let wm = f.i32c(i64::from(width) - 1);
    let slot = f.andi(lane, wm);
    let nw = f.i32c(i64::from(warps));
    let has = f.cmpi(ICmp::Slt, slot, nw);
    let last = f.i32c(i64::from(warps) - 1);
    let src = f.minsi(slot, last);
    let src = f.extui(src, Elem::I64);
    let nc = f.i64c(ncomp as i64);
    let base = f.muli(src, nc);
    let mut c = 0usize;
    let mut cross: Vec<Vec<Val>> = Vec::new();
    for (op, st) in ops.iter().zip(&states) {
        let mut comp = Vec::new();
        for id in op.identity().into_iter().take(st.len()) {
            let o = f.i64c(c as i64);
            let idx = f.addi(base, o);
            let x = f.load_at(smem, idx, Ty::f32(), 4);
            let id = f.f32c(id as f32);
            comp.push(f.select(has, x, id));
            c += 1;
        }
        cross.push(comp);
    }
    butterfly(f, &mut cross, width);
    f.barrier();
    cross
}

/// Identity states of reductions.
fn identities(f: &mut Func, ops: &[RedOp]) -> Vec<Vec<Val>> {
    ops.iter().map(|op| op.identity().into_iter().map(|x| f.f32c(x as f32)).collect()).collect()
}

/// Kernel parameters: args, outputs, then the workspace.
struct Params {
    outs: Vec<Val>,
    ws: Option<Val>,
}

fn params(f: &Func, b: &Body, ws: bool) -> (Vec<Val>, Params) {
    let na = b.r.args.len();
    let no = b.r.outputs.len();
    let args = (0..na).map(|i| f.param(i)).collect();
    let outs = (0..no).map(|i| f.param(na + i)).collect();
    (args, Params { outs, ws: ws.then(|| f.param(na + no)) })
}

/// Store output `oi` (value `v`) at `pos` (its linear index), guarded by `valid`.
fn store_output(f: &mut Func, ev: &mut Eval, p: &Params, oi: usize, v: Value, pos: &Pos, valid: Option<Val>) -> GenResult<()> {
    let at = pos.lin;
    let x = ev.lanes(f, v, pos)?;
    let st = storage(ev.b.dtype(v))?;
    let align = vec_align(st, pos.lanes, ev.b.numel(v));
    let ptr = p.outs[oi];
    match valid {
        Some(ok) => f.if_then(ok, |f| {
            let y = narrow(f, x, st);
            f.store_at(y, ptr, at, align);
        }),
        None => {
            let y = narrow(f, x, st);
            f.store_at(y, ptr, at, align);
        }
    }
    Ok(())
}

/// Store a uniform output value from one thread (`who` is i1).
fn store_uniform(f: &mut Func, ev: &mut Eval, p: &Params, oi: usize, v: Value, at: Val, who: Val) -> GenResult<()> {
    let x = ev.uniform(f, v)?;
    let st = storage(ev.b.dtype(v))?;
    let ptr = p.outs[oi];
    f.if_then(who, |f| {
        let y = narrow(f, x, st);
        f.store_at(y, ptr, at, st.bytes());
    });
    Ok(())
}

pub(crate) fn generate(g: &Graph, r: &Region, entry: &str) -> GenResult<Generated> {
    let b = Body::new(g, r)?;
    if r.outputs.is_empty() {
        return invalid("a fused body needs at least one output");
    }
    let a = analyze(&b)?;
    if a.flat { gen_flat(&b, &a, entry) } else { gen_rows(&b, &a, entry) }
}

/// Evaluate every Scalar value at the top of the kernel (so nested regions may use them) and
/// store Scalar outputs from global thread 0.
fn scalars_at_top(f: &mut Func, ev: &mut Eval, b: &Body, p: &Params, first: Val) -> GenResult<()> {
    for node in b.nodes() {
        for &r in node.inputs.iter().chain(&node.results) {
            if ev.lay[r.index()] == Lay::Scalar {
                ev.uniform(f, r)?;
            }
        }
    }
    for (oi, o) in b.r.outputs.iter().enumerate() {
        if ev.lay[o.value.index()] == Lay::Scalar {
            let z = f.i64c(0);
            store_uniform(f, ev, p, oi, o.value, z, first)?;
        }
    }
    Ok(())
}

/// Cross-block accumulation: per-thread partial states of scalar accs and per-chunk column
/// partials (`col_parts[acc][chunk]`, vectors at column `col_of[chunk]`).
struct Partials {
    scalar: Vec<Vec<Val>>,
    col: Vec<Vec<Val>>,
}

struct Geometry {
    threads: u32,
    grid: u64,
    /// Row kernels: row length, lanes and the column of each chunk with its validity.
    d: u64,
    lanes: u32,
    col_of: Vec<(Val, Option<Val>)>,
    /// The block-reduction scratch, thread and block index.
    smem: Val,
    tid: Val,
    bid: Val,
}

/// CTAs per group of the two-level cross-block finish.
const GROUP: u64 = 32;

fn round4(x: u64) -> u64 {
    x.div_ceil(4) * 4
}

/// Where the cross-block state lives in the workspace (offsets in 4-byte words): arrival
/// counters (the total, then one per group), per-CTA scalar partials `[acc][cta]`, per-group
/// scalar partials `[acc][group]`, per-CTA column partials `[acc][cta][col]`, per-group column
/// partials `[acc][group][col]`. Every region starts 16-byte aligned.
struct WsLayout {
    groups: u64,
    ps: u64,
    gps: u64,
    pc: u64,
    gpc: u64,
    words: u64,
}

impl WsLayout {
    fn new(ns: u64, nc: u64, grid: u64, d: u64) -> WsLayout {
        let groups = grid.div_ceil(GROUP);
        let ps = round4(1 + groups);
        let gps = ps + round4(ns * grid);
        let pc = gps + round4(ns * groups);
        let gpc = pc + nc * grid * d;
        let words = gpc + nc * groups * d;
        WsLayout { groups, ps, gps, pc, gpc, words }
    }
}

/// Workspace bytes for the accumulations of `a` with `grid` CTAs and rows of `d`.
fn workspace_bytes(a: &Analysis, grid: u64, d: u64) -> u64 {
    if a.accs.is_empty() {
        return 0;
    }
    let ns = a.accs.iter().filter(|x| !x.col).count() as u64;
    let nc = a.accs.iter().filter(|x| x.col).count() as u64;
    4 * WsLayout::new(ns, nc, grid, d).words
}

/// Thread 0 bumps counter `idx` and publishes in shared slot `slot` whether it was the
/// `expected`-th (last) arrival; returns that flag (i1) in every thread.
fn arrive(f: &mut Func, ws: Val, idx: Val, expected: Val, slot: i64, is_t0: Val) -> Val {
    let flag = f.shared_array("titan_last", Elem::I32, 2);
    let s = f.i64c(slot);
    f.fence();
    f.barrier();
    f.if_then(is_t0, |f| {
        let cnt = f.gep(ws, idx, Elem::I32);
        let one = f.i32c(1);
        let ticket = f.atomic_add_i32(cnt, one);
        let one = f.i32c(1);
        let last = f.subi(expected, one);
        let is_last = f.cmpi(ICmp::Eq, ticket, last);
        let zero = f.i32c(0);
        let v = f.select(is_last, one, zero);
        f.store_at(v, flag, s, 4);
    });
    f.barrier();
    let v = f.load_at(flag, s, Ty::S(Elem::I32), 4);
    let one = f.i32c(1);
    f.cmpi(ICmp::Eq, v, one)
}

/// Fold `count` consecutive rows of column partials (`src + k * d`, k in order) into `dst`,
/// zeroing what was read; `lanes`-wide, one column vector per thread and step. Returns nothing;
/// `emit` is given each total vector and its column (for the last level).
#[allow(clippy::too_many_arguments)]
fn fold_columns(
    f: &mut Func,
    ws: Val,
    src: Val,
    count: Val,
    d: u64,
    lanes: u32,
    geo: &Geometry,
    op: RedOp,
    mut emit: impl FnMut(&mut Func, Val, Val) -> GenResult<()>,
) -> GenResult<()> {
    let tid64 = f.extui(geo.tid, Elem::I64);
    let l = f.i64c(i64::from(lanes));
    let start = f.muli(tid64, l);
    let end = f.i64c(d as i64);
    let step = f.i64c(i64::from(geo.threads) * i64::from(lanes));
    let vt = Ty::lanes_of(Elem::F32, lanes);
    let align = (lanes * 4).min(16);
    f.try_for_loop(start, end, step, &[], |f, c, _| -> GenResult<Vec<Val>> {
        let init = f.cf(op.identity()[0], vt);
        let lo = f.i64c(0);
        let one = f.i64c(1);
        let dd = f.i64c(d as i64);
        let tot = f.for_loop(lo, count, one, &[init], |f, k, st| {
            let off = f.muli(k, dd);
            let idx = f.addi(src, off);
            let idx = f.addi(idx, c);
            let x = f.load_at(ws, idx, vt, align);
            let zero = f.cf(0.0, vt);
            f.store_at(zero, ws, idx, align);
            vec![if op == RedOp::Max { f.maximumf(st[0], x) } else { f.addf(st[0], x) }]
        });
        emit(f, tot[0], c)?;
        Ok(vec![])
    })?;
    Ok(())
}

/// Finish the cross-block accumulations: each CTA writes its partials; the last CTA of each
/// group of 32 folds the group's partials (in CTA order) into a group partial; the last group
/// folds the group partials (in group order), computes the Post values and stores them. Every
/// partial and counter is zeroed by whoever read it last.
fn finish_accs(f: &mut Func, ev: &mut Eval, a: &Analysis, p: &Params, parts: Partials, geo: &Geometry) -> GenResult<()> {
    let Some(ws) = p.ws else {
        return invalid("cross-block accumulation without a workspace");
    };
    let (smem, tid, bid) = (geo.smem, geo.tid, geo.bid);
    let sacc: Vec<&Acc> = a.accs.iter().filter(|x| !x.col).collect();
    let cacc: Vec<&Acc> = a.accs.iter().filter(|x| x.col).collect();
    let (g, d) = (geo.grid, geo.d);
    let lay = WsLayout::new(sacc.len() as u64, cacc.len() as u64, g, d);
    let bid64 = f.extui(bid, Elem::I64);
    let zero32 = f.i32c(0);
    let is_t0 = f.cmpi(ICmp::Eq, tid, zero32);
    // 1. This CTA's partials.
    if !sacc.is_empty() {
        let ops: Vec<RedOp> = sacc.iter().map(|x| x.op).collect();
        let red = block_reduce(f, &ops, parts.scalar, geo.threads, smem, tid);
        f.if_then(is_t0, |f| {
            for (i, st) in red.iter().enumerate() {
                let base = f.i64c((lay.ps + i as u64 * g) as i64);
                let idx = f.addi(base, bid64);
                f.store_at(st[0], ws, idx, 4);
            }
        });
    }
    for (i, chunks) in parts.col.iter().enumerate() {
        for (c, &v) in chunks.iter().enumerate() {
            let (col, valid) = geo.col_of[c];
            let base = f.i64c((lay.pc + i as u64 * g * d) as i64);
            let dd = f.i64c(d as i64);
            let rowoff = f.muli(bid64, dd);
            let idx = f.addi(base, rowoff);
            let idx = f.addi(idx, col);
            let align = (v.ty.lanes() * 4).min(16);
            match valid {
                Some(ok) => f.if_then(ok, |f| f.store_at(v, ws, idx, align)),
                None => f.store_at(v, ws, idx, align),
            }
        }
    }
    // 2. The last CTA of each group folds the group.
    let gsz = f.i64c(GROUP as i64);
    let grp = f.divui(bid64, gsz);
    let first = f.muli(grp, gsz);
    let gend = f.i64c(g as i64);
    let left = f.subi(gend, first);
    let members = f.minsi(left, gsz);
    let members32 = f.trunci(members, Elem::I32);
    let one64 = f.i64c(1);
    let cidx = f.addi(grp, one64);
    let group_last = arrive(f, ws, cidx, members32, 0, is_t0);
    f.try_if_then(group_last, |f| {
        f.fence();
        f.if_then(is_t0, |f| {
            for (i, acc) in sacc.iter().enumerate() {
                let init = f.f32c(acc.op.identity()[0] as f32);
                let base = f.i64c((lay.ps + i as u64 * g) as i64);
                let src = f.addi(base, first);
                let lo = f.i64c(0);
                let one = f.i64c(1);
                let op = acc.op;
                let tot = f.for_loop(lo, members, one, &[init], |f, k, st| {
                    let idx = f.addi(src, k);
                    let x = f.load_at(ws, idx, Ty::f32(), 4);
                    let zero = f.f32c(0.0);
                    f.store_at(zero, ws, idx, 4);
                    combine(f, op, &[st[0]], &[x])
                });
                let gb = f.i64c((lay.gps + i as u64 * lay.groups) as i64);
                let gidx = f.addi(gb, grp);
                f.store_at(tot[0], ws, gidx, 4);
            }
            let zero = f.i32c(0);
            f.store_at(zero, ws, cidx, 4);
        });
        for (i, acc) in cacc.iter().enumerate() {
            let base = f.i64c((lay.pc + i as u64 * g * d) as i64);
            let dd = f.i64c(d as i64);
            let off = f.muli(first, dd);
            let src = f.addi(base, off);
            let gb = f.i64c((lay.gpc + i as u64 * lay.groups * d) as i64);
            let goff = f.muli(grp, dd);
            let dst = f.addi(gb, goff);
            fold_columns(f, ws, src, members, d, geo.lanes, geo, acc.op, |f, tot, c| {
                let at = f.addi(dst, c);
                let align = (tot.ty.lanes() * 4).min(16);
                f.store_at(tot, ws, at, align);
                Ok(())
            })?;
        }
        // 3. The last group finishes.
        let z = f.i64c(0);
        let ng = f.i32c(lay.groups as i64);
        let last = arrive(f, ws, z, ng, 1, is_t0);
        f.try_if_then(last, |f| last_block(f, ev, p, ws, geo, &lay, &sacc, &cacc))
    })
}

/// The last group's CTA: fold the group partials in group order, zero them, compute and store
/// the Post values, reset the total counter.
#[allow(clippy::too_many_arguments)]
fn last_block(f: &mut Func, ev: &mut Eval, p: &Params, ws: Val, geo: &Geometry, lay: &WsLayout, sacc: &[&Acc], cacc: &[&Acc]) -> GenResult<()> {
    f.fence();
    let zero32 = f.i32c(0);
    let is_t0 = f.cmpi(ICmp::Eq, geo.tid, zero32);
    let ngroups = f.i64c(lay.groups as i64);
    // Every thread folds the (few) scalar group partials itself, so all hold the totals.
    for (i, acc) in sacc.iter().enumerate() {
        let init = f.f32c(acc.op.identity()[0] as f32);
        let base = f.i64c((lay.gps + i as u64 * lay.groups) as i64);
        let lo = f.i64c(0);
        let one = f.i64c(1);
        let op = acc.op;
        let tot = f.for_loop(lo, ngroups, one, &[init], |f, k, st| {
            let idx = f.addi(base, k);
            let x = f.load_at(ws, idx, Ty::f32(), 4);
            combine(f, op, &[st[0]], &[x])
        });
        let mut t = tot[0];
        if let Some(div) = acc.divide {
            let c = f.f32c(div as f32);
            t = f.divf(t, c);
        }
        let t = math::round_to(f, t, storage(ev.b.dtype(acc.result))?);
        ev.uni.insert(acc.result, t);
    }
    f.barrier();
    // Zero the scalar group partials once everyone has read them.
    if !sacc.is_empty() {
        f.if_then(is_t0, |f| {
            for i in 0..sacc.len() {
                let base = (lay.gps + i as u64 * lay.groups) as i64;
                for k in 0..lay.groups as i64 {
                    let idx = f.i64c(base + k);
                    let zero = f.f32c(0.0);
                    f.store_at(zero, ws, idx, 4);
                }
            }
        });
    }
    // Post scalar values and outputs.
    for node in ev.b.nodes() {
        for &r in &node.results {
            if ev.lay[r.index()] == Lay::PostScalar {
                ev.uniform(f, r)?;
            }
        }
    }
    for (oi, o) in ev.b.r.outputs.iter().enumerate() {
        if ev.lay[o.value.index()] == Lay::PostScalar {
            let z = f.i64c(0);
            store_uniform(f, ev, p, oi, o.value, z, is_t0)?;
        }
    }
    // Column totals, Post column values and outputs. With several column sums the first one
    // drives the loop and the others are folded at the same columns.
    if let Some((first, rest)) = cacc.split_first() {
        let d = geo.d;
        let lanes = geo.lanes;
        let base0 = f.i64c(lay.gpc as i64);
        fold_columns(f, ws, base0, ngroups, d, lanes, geo, first.op, |f, tot0, c| {
            let pos = ev.pos(lanes, c, Some(c));
            let mut totals = vec![(first, tot0)];
            for (j, acc) in rest.iter().enumerate() {
                let vt = Ty::lanes_of(Elem::F32, lanes);
                let init = f.cf(acc.op.identity()[0], vt);
                let lo = f.i64c(0);
                let one = f.i64c(1);
                let dd = f.i64c(d as i64);
                let base = f.i64c((lay.gpc + (j as u64 + 1) * lay.groups * d) as i64);
                let op = acc.op;
                let align = (lanes * 4).min(16);
                let tot = f.for_loop(lo, ngroups, one, &[init], |f, k, st| {
                    let off = f.muli(k, dd);
                    let idx = f.addi(base, off);
                    let idx = f.addi(idx, c);
                    let x = f.load_at(ws, idx, vt, align);
                    let zero = f.cf(0.0, vt);
                    f.store_at(zero, ws, idx, align);
                    vec![if op == RedOp::Max { f.maximumf(st[0], x) } else { f.addf(st[0], x) }]
                });
                totals.push((acc, tot[0]));
            }
            for (acc, mut t) in totals {
                if let Some(div) = acc.divide {
                    let dv = f.cf(div, t.ty);
                    t = f.divf(t, dv);
                }
                let t = math::round_to(f, t, storage(ev.b.dtype(acc.result))?);
                ev.memo.insert((pos.id, acc.result), t);
            }
            for (oi, o) in ev.b.r.outputs.iter().enumerate() {
                if ev.lay[o.value.index()] == Lay::PostCol {
                    store_output(f, ev, p, oi, o.value, &pos, None)?;
                }
            }
            ev.forget_items();
            Ok(())
        })?;
    }
    f.if_then(is_t0, |f| {
        let z = f.i64c(0);
        let zero = f.i32c(0);
        f.store_at(zero, ws, z, 4);
    });
    Ok(())
}

/// Shared-memory floats block reductions need: one slot per warp and state component.
fn red_smem(ops_comps: usize) -> u64 {
    32 * ops_comps.max(2) as u64
}

/// One element domain of a flat kernel: the values with `n` elements.
struct Domain {
    n: u64,
    lanes: u32,
    nvec: u64,
}

/// The element domains a flat kernel stores or reduces, each with the widest vector width that
/// divides it and keeps broadcast sources' rows whole.
fn flat_domains(b: &Body, a: &Analysis) -> Vec<Domain> {
    let mut ns: Vec<u64> = b.r.outputs.iter().filter(|o| a.lay[o.value.index()] == Lay::Elem).map(|o| b.numel(o.value)).collect();
    for acc in &a.accs {
        if let AccSrc::Elem(v) = acc.src {
            ns.push(b.numel(v));
        }
    }
    ns.sort_unstable();
    ns.dedup();
    ns.into_iter()
        .map(|n| {
            let mut sizes = vec![n];
            for node in b.nodes() {
                if matches!(node.op, Op::Broadcast { .. }) && a.lay[node.inputs[0].index()] == Lay::Gen && b.numel(node.results[0]) == n {
                    sizes.push(b.shape[node.results[0].index()].last().copied().unwrap_or(1));
                }
            }
            let lanes = lanes_dividing(&sizes);
            Domain { n, lanes, nvec: n / u64::from(lanes) }
        })
        .collect()
}

/// One work item of a flat kernel in domain `dom`: store its outputs, fold its reductions.
#[allow(clippy::too_many_arguments)]
fn flat_item(f: &mut Func, ev: &mut Eval, b: &Body, a: &Analysis, p: &Params, dom: &Domain, i: Val, valid: Option<Val>, st: &[Val]) -> GenResult<Vec<Val>> {
    let l = f.i64c(i64::from(dom.lanes));
    let lin = f.muli(i, l);
    let pos = ev.pos(dom.lanes, lin, None);
    for (oi, o) in b.r.outputs.iter().enumerate() {
        if a.lay[o.value.index()] == Lay::Elem && b.numel(o.value) == dom.n {
            store_output(f, ev, p, oi, o.value, &pos, valid)?;
        }
    }
    let mut next = st.to_vec();
    for (k, acc) in a.accs.iter().filter(|x| !x.col).enumerate() {
        let AccSrc::Elem(v) = acc.src else {
            return invalid("per-row accumulation in a flat kernel");
        };
        if b.numel(v) == dom.n {
            let x = ev.lanes(f, v, &pos)?;
            next[k] = update(f, acc.op, &[st[k]], x, valid)[0];
        }
    }
    Ok(next)
}

fn gen_flat(b: &Body, a: &Analysis, entry: &str) -> GenResult<Generated> {
    if a.accs.iter().any(|x| x.col) {
        return invalid("column sums in a flat kernel");
    }
    let doms = flat_domains(b, a);
    // Work in chunks of one vector per thread; a table of chunk offsets maps a chunk to its domain.
    let single = doms.len() == 1;
    let max_nvec = doms.iter().map(|d| d.nvec).max().unwrap_or(1);
    let threads = if max_nvec <= 1 && doms.len() <= 1 { 32 } else { FLAT_BLOCK };
    let mut first_chunk = Vec::new();
    let mut chunks = 0u64;
    for d in &doms {
        first_chunk.push(chunks);
        chunks += d.nvec.div_ceil(threads);
    }
    if chunks > i32::MAX as u64 {
        return unsupported(format!("a pointwise kernel of {chunks} chunks exceeds the grid limit"));
    }
    let grid = chunks.clamp(1, FLAT_GRID_CAP);
    let ws_bytes = workspace_bytes(a, grid, 1);
    let nparams = b.r.args.len() + b.r.outputs.len() + usize::from(ws_bytes > 0);
    let mut f = Func::new(nparams);
    let (args, p) = params(&f, b, ws_bytes > 0);
    let mut ev = Eval::new(b, a.lay.clone(), args);
    let tid = f.thread_id();
    let bid = f.block_id();
    let zero32 = f.i32c(0);
    let t0 = f.cmpi(ICmp::Eq, tid, zero32);
    let b0 = f.cmpi(ICmp::Eq, bid, zero32);
    let first = f.andi(t0, b0);
    scalars_at_top(&mut f, &mut ev, b, &p, first)?;
    let ops: Vec<RedOp> = a.accs.iter().map(|x| x.op).collect();
    let init: Vec<Val> = identities(&mut f, &ops).into_iter().flatten().collect();
    let tid64 = f.extui(tid, Elem::I64);
    let bid64 = f.extui(bid, Elem::I64);
    let tt = f.i64c(threads as i64);
    let parts = if doms.is_empty() {
        init.clone()
    } else if single {
        // One domain: a plain grid-stride loop over its vectors.
        let dom = &doms[0];
        let start = f.muli(bid64, tt);
        let start = f.addi(start, tid64);
        let end = f.i64c(dom.nvec as i64);
        let step = f.i64c((grid * threads) as i64);
        f.try_for_loop(start, end, step, &init, |f, i, st| {
            let next = flat_item(f, &mut ev, b, a, &p, dom, i, None, st);
            ev.forget_items();
            next
        })?
    } else {
        let end = f.i64c(chunks as i64);
        let step = f.i64c(grid as i64);
        f.try_for_loop(bid64, end, step, &init, |f, c, st| {
            let mut k = f.i32c(0);
            for &fc in &first_chunk[1..] {
                let s = f.i64c(fc as i64);
                let ge = f.cmpi(ICmp::Uge, c, s);
                let one = f.extui(ge, Elem::I32);
                k = f.addi(k, one);
            }
            f.try_switch_values(k, doms.len(), st, |f, di| {
                let dom = &doms[di];
                let fc = f.i64c(first_chunk[di] as i64);
                let local = f.subi(c, fc);
                let base = f.muli(local, tt);
                let i = f.addi(base, tid64);
                let nv = f.i64c(dom.nvec as i64);
                let valid = f.cmpi(ICmp::Slt, i, nv);
                let last = f.i64c(dom.nvec as i64 - 1);
                let ic = f.minsi(i, last);
                let next = flat_item(f, &mut ev, b, a, &p, dom, ic, Some(valid), st);
                ev.forget_items();
                next
            })
        })?
    };
    if !a.accs.is_empty() {
        let smem = f.shared_array("titan_red", Elem::F32, red_smem(1));
        let geo = Geometry { threads: threads as u32, grid, d: 1, lanes: 1, col_of: vec![], smem, tid, bid };
        let parts = Partials { scalar: parts.into_iter().map(|x| vec![x]).collect(), col: vec![] };
        finish_accs(&mut f, &mut ev, a, &p, parts, &geo)?;
    }
    Ok(Generated::new(f.finish(entry, threads as u32, grid as u32), threads as u32, grid as u32, ws_bytes))
}

/// A work item of a row kernel: its positions (two for half-layout RoPE) and validity.
#[derive(Clone)]
struct Item {
    pos: Vec<Pos>,
    valid: Option<Val>,
    chunk: usize,
}

struct RowGeo {
    lanes: u32,
    threads: u64,
    /// Work items per row.
    items: u64,
    chunks: u64,
    unrolled: bool,
}

fn row_geometry(a: &Analysis) -> GenResult<RowGeo> {
    let (lanes, items) = match a.rope {
        Some(r) if r.cfg.layout == RopeLayout::Half => {
            let half = r.head_dim / 2;
            let lanes = lanes_dividing(&[half]);
            (lanes, (a.d / r.head_dim) * (half / u64::from(lanes)))
        }
        Some(r) => {
            let lanes = lanes_dividing(&[r.head_dim]).max(2);
            (lanes, a.d / u64::from(lanes))
        }
        None => {
            let lanes = lanes_dividing(&[a.d]);
            (lanes, a.d / u64::from(lanes))
        }
    };
    if items <= MAX_BLOCK * UNROLL_MAX {
        let threads = (items.div_ceil(2).div_ceil(32) * 32).clamp(32, MAX_BLOCK);
        Ok(RowGeo { lanes, threads, items, chunks: items.div_ceil(threads), unrolled: true })
    } else {
        Ok(RowGeo { lanes, threads: MAX_BLOCK, items, chunks: items.div_ceil(MAX_BLOCK), unrolled: false })
    }
}

struct RowGen<'a, 'b, 'g> {
    b: &'a Body<'g>,
    a: &'a Analysis<'g>,
    ev: Eval<'b, 'g>,
    p: Params,
    geo: RowGeo,
    tid: Val,
    tid64: Val,
    is_t0: Val,
    smem: Val,
}

impl<'g> RowGen<'_, '_, 'g> {
    /// The work item `w` (i64, possibly past the end) of row `row`.
    fn item(&mut self, f: &mut Func, row: Val, w: Val, chunk: usize, may_overhang: bool) -> Item {
        let lanes = self.geo.lanes;
        let (w, valid) = if may_overhang {
            let n = f.i64c(self.geo.items as i64);
            let ok = f.cmpi(ICmp::Slt, w, n);
            let last = f.i64c(self.geo.items as i64 - 1);
            (f.minsi(w, last), Some(ok))
        } else {
            (w, None)
        };
        let d = f.i64c(self.a.d as i64);
        let base = f.muli(row, d);
        let mk = |f: &mut Func, ev: &mut Eval, col: Val| {
            let lin = f.addi(base, col);
            ev.pos(lanes, lin, Some(col))
        };
        match self.a.rope {
            Some(r) if r.cfg.layout == RopeLayout::Half => {
                let half = r.head_dim / 2;
                let per_head = half / u64::from(lanes);
                let ph = f.i64c(per_head as i64);
                let head = f.divui(w, ph);
                let jv = f.remui(w, ph);
                let hd = f.i64c(r.head_dim as i64);
                let l = f.i64c(i64::from(lanes));
                let c0 = f.muli(head, hd);
                let j = f.muli(jv, l);
                let ca = f.addi(c0, j);
                let hh = f.i64c(half as i64);
                let cb = f.addi(ca, hh);
                let pa = mk(f, &mut self.ev, ca);
                let pb = mk(f, &mut self.ev, cb);
                self.ev.partner.insert(pa.id, (pb, true));
                self.ev.partner.insert(pb.id, (pa, false));
                Item { pos: vec![pa, pb], valid, chunk }
            }
            _ => {
                let l = f.i64c(i64::from(lanes));
                let col = f.muli(w, l);
                let p = mk(f, &mut self.ev, col);
                Item { pos: vec![p], valid, chunk }
            }
        }
    }

    /// Pass `k` over one work item: reduction updates, element outputs, accumulations.
    fn visit(&mut self, f: &mut Func, k: u32, it: &Item, red_st: &mut [Vec<Val>], sacc: &mut [Vec<Val>], cacc: &mut [Vec<Val>]) -> GenResult<()> {
        let a = self.a;
        for (ri, red) in a.reds.iter().enumerate() {
            if red.level != k {
                continue;
            }
            for pos in &it.pos {
                let x = match red.contrib {
                    Contrib::Square(v) => {
                        let x = self.ev.lanes(f, v, pos)?;
                        f.mulf(x, x)
                    }
                    Contrib::DyWX { x, w, dy } => {
                        let xv = self.ev.lanes(f, x, pos)?;
                        let wv = self.ev.lanes(f, w, pos)?;
                        let dyv = self.ev.lanes(f, dy, pos)?;
                        let dn = f.mulf(dyv, wv);
                        f.mulf(dn, xv)
                    }
                    Contrib::Plain(v) => self.ev.lanes(f, v, pos)?,
                    Contrib::NegFirstMax { x, key } => {
                        let xv = self.ev.lanes(f, x, pos)?;
                        let m = self.ev.row_result(key, RowKey::Max)?;
                        let Some(col) = pos.col else {
                            return invalid("cross_entropy_stats_bwd outside a row kernel");
                        };
                        let none = f.f32c(f32::NEG_INFINITY);
                        // Columns below 2^24 are exact in f32.
                        let cf = f.sitofp(col, Elem::F32);
                        let base = f.negf(cf);
                        let at: Vec<Val> = (0..pos.lanes)
                            .map(|l| {
                                let o = f.f32c(l as f32);
                                let neg = f.subf(base, o);
                                let xl = f.extract(xv, l);
                                let hit = f.cmpf(FCmp::Oeq, xl, m);
                                f.select(hit, neg, none)
                            })
                            .collect();
                        f.vector_of(&at)
                    }
                    Contrib::ShiftedExp { s, m, key } => {
                        let sv = self.ev.lanes(f, s, pos)?;
                        let mv = self.ev.lanes(f, m, pos)?;
                        let big = self.ev.row_result(key, RowKey::Max)?;
                        let big = f.splat(big, pos.lanes);
                        let d = f.subf(mv, big);
                        let e = math::exp(f, d);
                        f.mulf(sv, e)
                    }
                };
                red_st[ri] = update(f, red.op, &red_st[ri], x, it.valid);
            }
        }
        for (oi, o) in self.b.r.outputs.iter().enumerate() {
            if a.lay[o.value.index()] == Lay::Elem && a.level[o.value.index()] == k {
                for pos in &it.pos {
                    store_output(f, &mut self.ev, &self.p, oi, o.value, pos, it.valid)?;
                }
            }
        }
        let (mut si, mut ci) = (0usize, 0usize);
        for acc in &a.accs {
            let here = acc.level == k;
            if acc.col {
                if here {
                    for pos in &it.pos {
                        let x = match acc.src {
                            AccSrc::Elem(v) => self.ev.lanes(f, v, pos)?,
                            AccSrc::RmsDw { key, x, dy } => {
                                let xv = self.ev.lanes(f, x, pos)?;
                                let dyv = self.ev.lanes(f, dy, pos)?;
                                let inv = self.ev.row_result(key, RowKey::Inv)?;
                                let inv = f.splat(inv, pos.lanes);
                                let n = f.mulf(xv, inv);
                                let n = math::round_to(f, n, storage(self.b.dtype(x))?);
                                f.mulf(dyv, n)
                            }
                            _ => return invalid("column accumulation of a per-row value"),
                        };
                        let x = match it.valid {
                            Some(ok) => {
                                let z = f.cf(acc.op.identity()[0], x.ty);
                                f.select(ok, x, z)
                            }
                            None => x,
                        };
                        let cur = cacc[ci][it.chunk];
                        cacc[ci][it.chunk] = if acc.op == RedOp::Max { f.maximumf(cur, x) } else { f.addf(cur, x) };
                    }
                }
                ci += 1;
            } else {
                if let (true, AccSrc::Elem(v)) = (here, acc.src) {
                    for pos in &it.pos {
                        let x = self.ev.lanes(f, v, pos)?;
                        sacc[si] = update(f, acc.op, &sacc[si], x, it.valid);
                    }
                }
                si += 1;
            }
        }
        Ok(())
    }

    /// Values of the current row known after level `k` (row results, per-row accumulations,
    /// per-row outputs).
    fn row_level(&mut self, f: &mut Func, k: u32, row: Val, sacc: &mut [Vec<Val>]) -> GenResult<()> {
        let a = self.a;
        for node in self.b.nodes() {
            for &r in node.inputs.iter().chain(&node.results) {
                if a.lay[r.index()] == Lay::Row && a.level[r.index()] == k {
                    self.ev.uniform(f, r)?;
                }
            }
        }
        for (oi, o) in self.b.r.outputs.iter().enumerate() {
            if a.lay[o.value.index()] == Lay::Row && a.level[o.value.index()] == k {
                store_uniform(f, &mut self.ev, &self.p, oi, o.value, row, self.is_t0)?;
            }
        }
        let mut si = 0usize;
        for acc in &a.accs {
            if acc.col {
                continue;
            }
            if acc.level == k {
                let x = match acc.src {
                    AccSrc::Row(v) => Some(self.ev.uniform(f, v)?),
                    AccSrc::CeLoss { key, logits } => Some(self.ce_loss(f, key, logits, row)?),
                    AccSrc::CeCombine { key } => {
                        let big = self.ev.row_result(key, RowKey::Max)?;
                        let sum = self.ev.row_result(key, RowKey::SumExp)?;
                        let target = self.ev.row_result(key, RowKey::TargetSum)?;
                        let l = math::log(f, sum);
                        let lse = f.addf(big, l);
                        Some(f.subf(lse, target))
                    }
                    _ => None,
                };
                if let Some(x) = x {
                    // Once per row: only thread 0 contributes.
                    let id = f.f32c(acc.op.identity()[0] as f32);
                    let x = f.select(self.is_t0, x, id);
                    sacc[si] = update(f, acc.op, &sacc[si], x, None);
                }
            }
            si += 1;
        }
        Ok(())
    }

    /// `lse - logits[row, target]` (NaN for a target outside the row).
    fn ce_loss(&mut self, f: &mut Func, key: usize, logits: Value, row: Val) -> GenResult<Val> {
        let lse = self.ev.row_result(key, RowKey::Lse)?;
        let t = self.ev.row_result(key, RowKey::Target)?;
        let zero = f.i64c(0);
        let dmax = f.i64c(self.a.d as i64 - 1);
        let tc = f.maxsi(t, zero);
        let tc = f.minsi(tc, dmax);
        let d = f.i64c(self.a.d as i64);
        let base = f.muli(row, d);
        let lin = f.addi(base, tc);
        let pos = self.ev.pos(1, lin, Some(tc));
        let xt = self.ev.elem(f, logits, &pos)?;
        let loss = f.subf(lse, xt);
        let ok = f.cmpi(ICmp::Eq, tc, t);
        let nan = f.f32c(f32::NAN);
        Ok(f.select(ok, loss, nan))
    }

    /// Finish the reductions of level `k`: block-reduce and compute each row op's row results.
    fn reduce_level(&mut self, f: &mut Func, k: u32, red_st: Vec<Vec<Val>>) -> GenResult<()> {
        let a = self.a;
        let idx: Vec<usize> = (0..a.reds.len()).filter(|&i| a.reds[i].level == k).collect();
        if idx.is_empty() {
            return Ok(());
        }
        let ops: Vec<RedOp> = idx.iter().map(|&i| a.reds[i].op).collect();
        let states: Vec<Vec<Val>> = idx.iter().map(|&i| red_st[i].clone()).collect();
        let totals = block_reduce(f, &ops, states, self.geo.threads as u32, self.smem, self.tid);
        let total = |i: usize| -> &Vec<Val> { &totals[idx.iter().position(|&j| j == i).unwrap_or(0)] };
        let d = self.a.d;
        for rop in &a.row_ops {
            if rop.level != k {
                continue;
            }
            match &rop.node.op {
                Op::RmsNorm { eps } | Op::RmsNormBwd { eps } => {
                    let ss = total(rop.reds[0])[0];
                    let dn = f.f32c(d as f32);
                    let m = f.divf(ss, dn);
                    let e = f.f32c(*eps as f32);
                    let t = f.addf(m, e);
                    let s = f.sqrt(t);
                    let one = f.f32c(1.0);
                    let inv = f.divf(one, s);
                    self.ev.rowres.insert((rop.key, RowKey::Inv), inv);
                    if let Some(&j) = rop.reds.get(1) {
                        let q = total(j)[0];
                        let dot = f.mulf(q, inv);
                        let inv_d = f.f32c((1.0 / d as f64) as f32);
                        let mean = f.mulf(dot, inv_d);
                        self.ev.rowres.insert((rop.key, RowKey::Mean), mean);
                    }
                }
                Op::Reduce { kind, .. } => {
                    let mut x = total(rop.reds[0])[0];
                    if *kind == ReduceKind::Mean {
                        let c = f.f32c(d as f32);
                        x = f.divf(x, c);
                    }
                    let r = rop.node.results[0];
                    let x = math::round_to(f, x, storage(self.b.dtype(r))?);
                    self.ev.rowres.insert((rop.key, RowKey::Reduced), x);
                }
                Op::CrossEntropy | Op::CrossEntropyBwd => {
                    let st = total(rop.reds[0]);
                    let l = math::log(f, st[1]);
                    let lse = f.addf(st[0], l);
                    self.ev.rowres.insert((rop.key, RowKey::Lse), lse);
                }
                // The first reduction of the loss shard: the online (max, sum of exp(x - max)).
                Op::CrossEntropyStats | Op::CrossEntropyStatsBwd if a.reds[rop.reds[0]].op == RedOp::Lse => {
                    let st = total(rop.reds[0]);
                    self.ev.rowres.insert((rop.key, RowKey::Max), st[0]);
                    self.ev.rowres.insert((rop.key, RowKey::SumExp), st[1]);
                }
                Op::CrossEntropyStatsBwd => {
                    self.ev.rowres.insert((rop.key, RowKey::NegArgMax), total(rop.reds[0])[0]);
                }
                Op::CrossEntropyCombine if a.reds[rop.reds[0]].op == RedOp::Max => {
                    self.ev.rowres.insert((rop.key, RowKey::Max), total(rop.reds[0])[0]);
                    self.ev.rowres.insert((rop.key, RowKey::TargetSum), total(rop.reds[1])[0]);
                }
                Op::CrossEntropyCombine => {
                    self.ev.rowres.insert((rop.key, RowKey::SumExp), total(rop.reds[0])[0]);
                }
                other => return invalid(format!("`{}` has no row reductions", other.name())),
            }
        }
        Ok(())
    }

    /// Targets of the cross-entropy nodes for the current row, and the vocabulary shard of the
    /// loss-shard nodes (the index of the one in their one-hot `shard`).
    fn targets(&mut self, f: &mut Func) -> GenResult<()> {
        for rop in &self.a.row_ops {
            // (cross_entropy_stats_bwd has two row ops: one for each of its reductions.)
            if self.ev.rowres.contains_key(&(rop.key, RowKey::Target)) {
                continue;
            }
            if matches!(rop.node.op, Op::CrossEntropy | Op::CrossEntropyBwd | Op::CrossEntropyStats | Op::CrossEntropyStatsBwd) {
                let t = self.ev.uniform(f, rop.node.inputs[1])?;
                let t = f.as_i64(t);
                self.ev.rowres.insert((rop.key, RowKey::Target), t);
            }
            if matches!(rop.node.op, Op::CrossEntropyStats | Op::CrossEntropyStatsBwd) {
                let shard = rop.node.inputs[2];
                let Some(i) = self.b.arg_index(shard) else {
                    return invalid("the vocabulary shard is not a kernel argument");
                };
                let n = self.b.numel(shard);
                if self.b.dtype(shard) != titan_ir::DType::F32 || n == 0 || n > 1024 {
                    return unsupported(format!("the vocabulary shard {shard} must be a one-hot f32[shards] of 1 to 1024 shards"));
                }
                let ptr = self.ev.args[i];
                let mut k = f.f32c(0.0);
                for j in 0..n {
                    let o = f.i64c(j as i64);
                    let x = f.load_at(ptr, o, Ty::S(Elem::F32), 4);
                    let jf = f.f32c(j as f32);
                    let w = f.mulf(x, jf);
                    k = f.addf(k, w);
                }
                let k = f.fptosi(k, Elem::I64);
                self.ev.rowres.insert((rop.key, RowKey::Shard), k);
            }
        }
        Ok(())
    }

    /// Fill the RoPE table for position `row % seq`.
    fn rope_table(&mut self, f: &mut Func, row: Val) -> GenResult<()> {
        let Some(r) = self.a.rope else { return Ok(()) };
        let half = r.head_dim / 2;
        let freqs = rope_freqs(&r.cfg, r.head_dim)?;
        let table = f.shared_array("titan_rope", Elem::F32, 2 * half);
        self.ev.rope = Some(RopeRow { table, head_dim: r.head_dim });
        let freq = f.const_table_f64("titan_rope_freq", &freqs);
        let seq = f.i64c(r.seq as i64);
        let p = f.remui(row, seq);
        let pf = f.sitofp(p, Elem::F64);
        let end = f.i64c(half as i64);
        let step = f.i64c(self.geo.threads as i64);
        let inverse = r.cfg.inverse;
        f.for_loop(self.tid64, end, step, &[], |f, j, _| {
            let fr = f.load_at(freq, j, Ty::S(Elem::F64), 8);
            let a = f.mulf(pf, fr);
            let a = if inverse { f.negf(a) } else { a };
            let (c, s) = math::sincos_f64(f, a);
            let c = f.truncf(c, Elem::F32);
            let s = f.truncf(s, Elem::F32);
            f.store_at(c, table, j, 4);
            let hh = f.i64c(half as i64);
            let js = f.addi(j, hh);
            f.store_at(s, table, js, 4);
            vec![]
        });
        f.barrier();
        Ok(())
    }

    /// One row: targets, RoPE table, then the passes, each followed by its reductions.
    fn row(&mut self, f: &mut Func, row: Val, max_level: u32, grid: u64, sacc: &mut [Vec<Val>], cacc: &mut [Vec<Val>]) -> GenResult<()> {
        let a = self.a;
        let b = self.b;
        let threads = self.geo.threads;
        self.ev.forget_row();
        self.ev.row = Some(row);
        self.targets(f)?;
        self.rope_table(f, row)?;
        self.row_level(f, 0, row, sacc)?;
        // Unrolled rows: the same work items (and their registers) serve every pass.
        let items: Vec<Item> = if self.geo.unrolled {
            (0..self.geo.chunks as usize)
                .map(|c| {
                    let base = f.i64c((c as u64 * threads) as i64);
                    let w = f.addi(base, self.tid64);
                    let overhang = (c as u64 + 1) * threads > self.geo.items;
                    self.item(f, row, w, c, overhang)
                })
                .collect()
        } else {
            Vec::new()
        };
        for k in 0..=max_level {
            let mut red_st: Vec<Vec<Val>> = a.reds.iter().map(|r| r.op.identity().into_iter().map(|x| f.f32c(x as f32)).collect()).collect();
            let needed = a.reds.iter().any(|r| r.level == k)
                || b.r.outputs.iter().any(|o| a.lay[o.value.index()] == Lay::Elem && a.level[o.value.index()] == k)
                || a.accs.iter().any(|x| x.level == k && matches!(x.src, AccSrc::Elem(_) | AccSrc::RmsDw { .. }));
            if needed {
                if self.geo.unrolled {
                    for it in &items {
                        self.visit(f, k, it, &mut red_st, sacc, cacc)?;
                    }
                } else {
                    self.looped_pass(f, k, row, &mut red_st, sacc)?;
                }
            }
            self.reduce_level(f, k, red_st)?;
            self.row_level(f, k + 1, row, sacc)?;
        }
        if a.rope.is_some() && grid < a.rows {
            f.barrier();
        }
        Ok(())
    }

    /// Pass `k` of a row too long to unroll: a loop over its chunks carrying the reduction and
    /// scalar-accumulation states (values are recomputed in every pass).
    fn looped_pass(&mut self, f: &mut Func, k: u32, row: Val, red_st: &mut [Vec<Val>], sacc: &mut [Vec<Val>]) -> GenResult<()> {
        let here: Vec<usize> = (0..self.a.reds.len()).filter(|&i| self.a.reds[i].level == k).collect();
        let mut carry: Vec<Val> = here.iter().flat_map(|&i| red_st[i].clone()).collect();
        carry.extend(sacc.iter().flatten().copied());
        let lo = f.i64c(0);
        let hi = f.i64c(self.geo.chunks as i64);
        let one = f.i64c(1);
        let threads = self.geo.threads;
        let template: Vec<Vec<Val>> = red_st.to_vec();
        let sacc_len: Vec<usize> = sacc.iter().map(Vec::len).collect();
        let out = f.try_for_loop(lo, hi, one, &carry, |f, c, cs| -> GenResult<Vec<Val>> {
            let mut rs = template.clone();
            let mut at = 0;
            for &i in &here {
                let nc = rs[i].len();
                rs[i] = cs[at..at + nc].to_vec();
                at += nc;
            }
            let mut sa: Vec<Vec<Val>> = Vec::new();
            for &nc in &sacc_len {
                sa.push(cs[at..at + nc].to_vec());
                at += nc;
            }
            let t = f.i64c(threads as i64);
            let base = f.muli(c, t);
            let w = f.addi(base, self.tid64);
            let it = self.item(f, row, w, 0, true);
            let mut none: Vec<Vec<Val>> = Vec::new();
            self.visit(f, k, &it, &mut rs, &mut sa, &mut none)?;
            self.ev.forget_items();
            let mut next: Vec<Val> = here.iter().flat_map(|&i| rs[i].clone()).collect();
            next.extend(sa.iter().flatten().copied());
            Ok(next)
        })?;
        let mut at = 0;
        for &i in &here {
            let nc = red_st[i].len();
            red_st[i] = out[at..at + nc].to_vec();
            at += nc;
        }
        for s in sacc.iter_mut() {
            let nc = s.len();
            *s = out[at..at + nc].to_vec();
            at += nc;
        }
        Ok(())
    }
}

fn gen_rows(b: &Body, a: &Analysis, entry: &str) -> GenResult<Generated> {
    let geo = row_geometry(a)?;
    let has_cacc = a.accs.iter().any(|x| x.col);
    if has_cacc && !geo.unrolled {
        return unsupported(format!("column sums over rows of {} elements; rows longer than 32768 elements support only per-row and scalar results", a.d));
    }
    if a.rows > i32::MAX as u64 {
        return unsupported(format!("{} rows exceed the grid limit", a.rows));
    }
    // Looped (vocabulary-long) rows use 1024-thread CTAs: fewer of them keep every SM busy.
    let cap = if geo.unrolled { ACC_GRID_CAP } else { ACC_GRID_CAP / 4 };
    let grid = if a.accs.is_empty() { a.rows } else { a.rows.min(cap) };
    let ws_bytes = workspace_bytes(a, grid, a.d);
    let nparams = b.r.args.len() + b.r.outputs.len() + usize::from(ws_bytes > 0);
    let mut f = Func::new(nparams);
    let (args, p) = params(&f, b, ws_bytes > 0);
    let mut ev = Eval::new(b, a.lay.clone(), args);
    ev.row_len = a.d;
    ev.rows = a.rows;
    let tid = f.thread_id();
    let bid = f.block_id();
    let zero32 = f.i32c(0);
    let is_t0 = f.cmpi(ICmp::Eq, tid, zero32);
    let b0 = f.cmpi(ICmp::Eq, bid, zero32);
    let first = f.andi(is_t0, b0);
    scalars_at_top(&mut f, &mut ev, b, &p, first)?;
    let max_comps = a.reds.iter().map(|r| r.op.identity().len()).sum::<usize>().max(a.accs.len());
    let smem = f.shared_array("titan_red", Elem::F32, red_smem(max_comps));
    let tid64 = f.extui(tid, Elem::I64);
    let bid64 = f.extui(bid, Elem::I64);
    let mut rg = RowGen { b, a, ev, p, geo, tid, tid64, is_t0, smem };
    let threads = rg.geo.threads;
    let chunks = rg.geo.chunks as usize;
    let lanes = rg.geo.lanes;
    let sacc_ops: Vec<RedOp> = a.accs.iter().filter(|x| !x.col).map(|x| x.op).collect();
    let cacc_ops: Vec<RedOp> = a.accs.iter().filter(|x| x.col).map(|x| x.op).collect();
    let max_level =
        a.level.iter().zip(&a.lay).filter(|(_, l)| !l.is_post()).map(|(l, _)| *l).max().unwrap_or(0).max(a.reds.iter().map(|r| r.level).max().unwrap_or(0));
    // Loop-carried: scalar partials, then column partials per chunk.
    let mut init: Vec<Val> = identities(&mut f, &sacc_ops).into_iter().flatten().collect();
    let n_s = init.len();
    for op in &cacc_ops {
        let id = f.cf(op.identity()[0], Ty::lanes_of(Elem::F32, lanes));
        init.extend(std::iter::repeat_n(id, chunks));
    }
    let rows = f.i64c(a.rows as i64);
    let gstep = f.i64c(grid as i64);
    let carried = f.try_for_loop(bid64, rows, gstep, &init, |f, row, st| {
        let mut sacc: Vec<Vec<Val>> = st[..n_s].iter().map(|&x| vec![x]).collect();
        let mut cacc: Vec<Vec<Val>> = (0..cacc_ops.len()).map(|i| st[n_s + i * chunks..n_s + (i + 1) * chunks].to_vec()).collect();
        rg.row(f, row, max_level, grid, &mut sacc, &mut cacc)?;
        let mut next: Vec<Val> = sacc.into_iter().flatten().collect();
        next.extend(cacc.into_iter().flatten());
        Ok(next)
    })?;
    rg.ev.forget_row();
    rg.ev.row = None;
    // Per-column outputs that need no cross-block sum: block 0 writes them.
    if b.r.outputs.iter().any(|o| a.lay[o.value.index()] == Lay::Col) {
        let dend = f.i64c(a.d as i64);
        let tstep = f.i64c(threads as i64);
        let zero = f.i32c(0);
        let isb0 = f.cmpi(ICmp::Eq, bid, zero);
        let ev = &mut rg.ev;
        let pp = &rg.p;
        f.try_if_then(isb0, |f| {
            f.try_for_loop(tid64, dend, tstep, &[], |f, c, _| -> GenResult<Vec<Val>> {
                let pos = ev.pos(1, c, Some(c));
                for (oi, o) in b.r.outputs.iter().enumerate() {
                    if a.lay[o.value.index()] == Lay::Col {
                        store_output(f, ev, pp, oi, o.value, &pos, None)?;
                    }
                }
                ev.forget_items();
                Ok(vec![])
            })
            .map(|_| ())
        })?;
    }
    if !a.accs.is_empty() {
        let scalar: Vec<Vec<Val>> = carried[..n_s].iter().map(|&x| vec![x]).collect();
        let col: Vec<Vec<Val>> = (0..cacc_ops.len()).map(|i| carried[n_s + i * chunks..n_s + (i + 1) * chunks].to_vec()).collect();
        // The column of each chunk of this thread, and whether it lies inside the row.
        let mut col_of = Vec::new();
        for c in 0..chunks {
            let base = f.i64c((c as u64 * threads) as i64);
            let w = f.addi(base, tid64);
            let l = f.i64c(i64::from(lanes));
            let col = f.muli(w, l);
            let valid = if (c as u64 + 1) * threads > rg.geo.items {
                let n = f.i64c(rg.geo.items as i64);
                Some(f.cmpi(ICmp::Slt, w, n))
            } else {
                None
            };
            col_of.push((col, valid));
        }
        let geom = Geometry { threads: threads as u32, grid, d: a.d, lanes, col_of, smem, tid, bid };
        finish_accs(&mut f, &mut rg.ev, a, &rg.p, Partials { scalar, col }, &geom)?;
    }
    Ok(Generated::new(f.finish(entry, threads as u32, grid as u32), threads as u32, grid as u32, ws_bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_divide_every_size() {
        assert_eq!(lanes_dividing(&[64]), 8);
        assert_eq!(lanes_dividing(&[64, 12]), 4);
        assert_eq!(lanes_dividing(&[7]), 1);
    }
}
