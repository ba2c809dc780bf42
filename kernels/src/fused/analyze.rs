//! What a fused body computes, before any code is emitted: its row structure and RoPE
//! parameters, the row reductions and the levels of dependent reductions, the cross-block
//! accumulations, and whether it becomes a flat or a row kernel ([`Analysis`]).

use titan_ir::{Node, Op, ReduceKind, RopeConfig, Value};

use crate::values::{Body, Lay};
use crate::{GenResult, invalid, unsupported};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RedOp {
    Sum,
    Max,
    /// Online log-sum-exp: state `(max, sum of exp(x - max))`.
    Lse,
}

impl RedOp {
    pub(super) fn from_reduce(k: ReduceKind) -> RedOp {
        match k {
            ReduceKind::Max => RedOp::Max,
            ReduceKind::Sum | ReduceKind::Mean => RedOp::Sum,
        }
    }

    pub(super) fn identity(self) -> Vec<f64> {
        match self {
            RedOp::Sum => vec![0.0],
            RedOp::Max => vec![f64::NEG_INFINITY],
            RedOp::Lse => vec![f64::NEG_INFINITY, 0.0],
        }
    }
}

/// What a row reduction sums per element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Contrib {
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
pub(super) struct RowRed {
    pub(super) level: u32,
    pub(super) op: RedOp,
    pub(super) contrib: Contrib,
}

/// A node whose per-element results need row reductions first.
pub(super) struct RowOp<'g> {
    pub(super) node: &'g Node,
    pub(super) key: usize,
    pub(super) level: u32,
    pub(super) reds: Vec<usize>,
}

/// Where a cross-block accumulation's contributions come from.
#[derive(Clone, Copy, Debug)]
pub(super) enum AccSrc {
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
pub(super) struct Acc {
    pub(super) col: bool,
    pub(super) op: RedOp,
    pub(super) src: AccSrc,
    pub(super) level: u32,
    pub(super) result: Value,
    /// The total is divided by this (means).
    pub(super) divide: Option<f64>,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct RopeInfo {
    pub(super) cfg: RopeConfig,
    pub(super) seq: u64,
    pub(super) head_dim: u64,
}

pub(super) struct Analysis<'g> {
    pub(super) flat: bool,
    pub(super) rows: u64,
    pub(super) d: u64,
    pub(super) rope: Option<RopeInfo>,
    pub(super) lay: Vec<Lay>,
    pub(super) level: Vec<u32>,
    pub(super) reds: Vec<RowRed>,
    pub(super) row_ops: Vec<RowOp<'g>>,
    pub(super) accs: Vec<Acc>,
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
            Op::Unary(_) | Op::Binary(_) | Op::Cast | Op::Fp8Scale { .. } | Op::Constant { .. } | Op::Broadcast { .. } | Op::Reshape => {}
            Op::Transpose { .. } => {}
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

pub(super) fn analyze<'g>(b: &Body<'g>) -> GenResult<Analysis<'g>> {
    let (rowdef, rope) = domain(b)?;
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
    let mut a = Analyzer::new(b, flat, rows, d, n);
    for node in b.nodes() {
        a.node(node)?;
    }
    a.finish(rope)
}

/// [`analyze`]'s state while it walks the body's nodes in order: the layout and reduction level
/// of every value so far, and the row reductions, row ops and cross-block accumulations found.
struct Analyzer<'a, 'g> {
    b: &'a Body<'g>,
    flat: bool,
    rows: u64,
    d: u64,
    /// Elements of the kernel's domain.
    n: u64,
    lay: Vec<Option<Lay>>,
    level: Vec<u32>,
    reds: Vec<RowRed>,
    row_ops: Vec<RowOp<'g>>,
    accs: Vec<Acc>,
    /// Whether something reads the value: results nothing reads need no cross-block sums
    /// (rmsnorm_bwd's dw, an unused loss).
    used: Vec<bool>,
}

impl<'a, 'g> Analyzer<'a, 'g> {
    fn new(b: &'a Body<'g>, flat: bool, rows: u64, d: u64, n: u64) -> Self {
        let nv = b.r.values.len();
        let mut used = vec![false; nv];
        for node in b.nodes() {
            for &i in &node.inputs {
                used[i.index()] = true;
            }
        }
        for o in &b.r.outputs {
            used[o.value.index()] = true;
        }
        Analyzer { b, flat, rows, d, n, lay: vec![None; nv], level: vec![0u32; nv], reds: Vec::new(), row_ops: Vec::new(), accs: Vec::new(), used }
    }

    /// The layout a value of `numel` elements has, when its size tells. Flat kernels may cover
    /// several element domains (one per tensor size); row kernels one.
    fn class(&self, numel: u64) -> Option<Lay> {
        let (flat, rows, d, n) = (self.flat, self.rows, self.d, self.n);
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
    }

    /// Require `v` to be laid out as `want`, recording it when it is not known yet.
    fn demand(&mut self, v: Value, want: Lay) -> GenResult<()> {
        match self.lay[v.index()] {
            None => {
                self.lay[v.index()] = Some(want);
                Ok(())
            }
            Some(l) if l == want => Ok(()),
            Some(l) => unsupported(format!("value {v} is used as {want:?} but computed as {l:?}; the group mixes index spaces")),
        }
    }

    /// The layout of `v`: the one recorded, else the one its size tells.
    fn known(&self, v: Value) -> GenResult<Lay> {
        let b = self.b;
        match self.lay[v.index()].or_else(|| self.class(b.numel(v))) {
            Some(l) => Ok(l),
            None => unsupported(format!(
                "cannot tell how {v} ({}) is indexed in a kernel over {} elements; only rows, columns, scalars and whole tensors are supported",
                shape_str(&b.shape[v.index()]),
                self.n
            )),
        }
    }

    /// The index of row reduction `r`, added unless an equal one exists.
    fn add_red(&mut self, r: RowRed) -> usize {
        if let Some(i) = self.reds.iter().position(|x| *x == r) {
            i
        } else {
            self.reds.push(r);
            self.reds.len() - 1
        }
    }

    /// The level of an op reading `vs`: the deepest of theirs.
    fn lv(&self, vs: &[Value]) -> u32 {
        vs.iter().map(|v| self.level[v.index()]).max().unwrap_or(0)
    }

    fn node(&mut self, node: &'g Node) -> GenResult<()> {
        let key = self.b.node_key(node);
        match &node.op {
            Op::Constant { .. } => self.constant(node),
            Op::Unary(_) | Op::Binary(_) | Op::Cast | Op::Fp8Scale { .. } | Op::Reshape => self.pointwise(node),
            Op::Transpose { .. } => self.transpose(node),
            Op::Broadcast { dims } => self.broadcast(node, dims),
            Op::Reduce { kind, axes } => self.reduce(node, key, *kind, axes),
            Op::RmsNorm { .. } => self.rmsnorm(node, key),
            Op::RmsNormBwd { .. } => self.rmsnorm_bwd(node, key),
            Op::CrossEntropy | Op::CrossEntropyBwd => self.cross_entropy(node, key),
            Op::CrossEntropyStats | Op::CrossEntropyStatsBwd => self.cross_entropy_stats(node, key),
            Op::CrossEntropyCombine => self.cross_entropy_combine(node, key),
            Op::Rope(_) => self.rope(node),
            other => unsupported(format!("`{}` in a fused kernel", other.name())),
        }
    }

    /// A constant: laid out as its size tells.
    fn constant(&mut self, node: &Node) -> GenResult<()> {
        let r = node.results[0];
        let l = self.known(r)?;
        self.lay[r.index()] = Some(l);
        Ok(())
    }

    /// A pointwise op or a reshape: operands already known decide unknown arguments of the same
    /// size; the result takes the layout of its operands.
    fn pointwise(&mut self, node: &Node) -> GenResult<()> {
        let b = self.b;
        let (flat, n) = (self.flat, self.n);
        let mut ls = Vec::new();
        for &i in &node.inputs {
            if self.lay[i.index()].is_none() {
                let same = node.inputs.iter().find(|&&o| o != i && b.numel(o) == b.numel(i)).and_then(|o| self.lay[o.index()]);
                let l = match same {
                    Some(l) => l,
                    None => self.known(i)?,
                };
                self.lay[i.index()] = Some(l);
            }
            ls.push(self.lay[i.index()].unwrap_or(Lay::Scalar));
        }
        let r = node.results[0];
        let l = combine_lays(&ls, r)?;
        let l = if matches!(node.op, Op::Reshape) && l == Lay::Elem && !flat && b.numel(r) != n {
            return unsupported(format!("reshape of {} elements inside a kernel over {n}", b.numel(r)));
        } else {
            l
        };
        self.lay[r.index()] = Some(l);
        self.level[r.index()] = self.lv(&node.inputs);
        Ok(())
    }

    /// A transpose: a flat kernel stores its operand (a per-element value) at the transposed
    /// positions of an output; nothing in the kernel may read it (the quantizing kernels of
    /// float8's TN GEMMs write the fp8 operand transposed this way).
    fn transpose(&mut self, node: &Node) -> GenResult<()> {
        let (x, r) = (node.inputs[0], node.results[0]);
        if !self.flat {
            return unsupported("`transpose` in a kernel with row reductions; keep it in a pointwise group");
        }
        if self.b.nodes().any(|n| n.inputs.contains(&r)) || !self.b.r.outputs.iter().any(|o| o.value == r) {
            return unsupported(format!("transposed value {r} is read inside its kernel; only a transpose that is stored as an output is supported"));
        }
        let xl = self.known(x)?;
        if xl != Lay::Elem {
            return unsupported(format!("transpose of the {xl:?} value {x}; only per-element values can be stored transposed"));
        }
        self.lay[x.index()] = Some(Lay::Elem);
        self.lay[r.index()] = Some(Lay::Elem);
        self.level[r.index()] = self.level[x.index()];
        Ok(())
    }

    /// A broadcast: of a scalar, of an argument (flat kernels), or of a per-row or per-column
    /// value (row kernels).
    fn broadcast(&mut self, node: &Node, dims: &[usize]) -> GenResult<()> {
        let b = self.b;
        let (flat, rows, d, n) = (self.flat, self.rows, self.d, self.n);
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
            let xl = self.known(x)?;
            if xl.is_post() {
                if rl != Lay::Scalar {
                    return unsupported(format!("broadcast of the cross-block result {x} to every element needs a second kernel; split the group"));
                }
                self.lay[r.index()] = Some(Lay::PostScalar);
                return Ok(());
            }
            self.demand(x, Lay::Scalar)?;
        } else if flat {
            if b.arg_index(x).is_none() {
                return unsupported(format!("broadcast of the computed value {x}; only arguments and scalars can be broadcast in a pointwise kernel"));
            }
            self.demand(x, Lay::Gen)?;
        } else {
            let xs = &b.shape[x.index()];
            let k = dims.len();
            let leading = dims.iter().enumerate().all(|(i, &dd)| dd == i) && out_shape[..k].iter().product::<u64>() == rows && b.numel(x) == rows;
            let m = out_shape.len().saturating_sub(k);
            let trailing = dims.iter().enumerate().all(|(i, &dd)| dd == m + i) && out_shape[m..].iter().product::<u64>() == d && b.numel(x) == d;
            if trailing && xs.iter().zip(&out_shape[m..]).all(|(a, o)| a == o) {
                self.demand(x, Lay::Col)?;
            } else if leading && xs.iter().zip(&out_shape[..k]).all(|(a, o)| a == o) {
                self.demand(x, Lay::Row)?;
            } else {
                return unsupported(format!(
                    "broadcast of {} along dims {dims:?} to {}: row kernels broadcast only per-row or per-column values",
                    shape_str(xs),
                    shape_str(out_shape)
                ));
            }
        }
        self.lay[r.index()] = Some(rl);
        self.level[r.index()] = self.level[x.index()];
        Ok(())
    }

    /// A reduction: over every element (a cross-block accumulation), over the rows (a column
    /// accumulation) or along each row (a row reduction).
    fn reduce(&mut self, node: &'g Node, key: usize, kind: ReduceKind, axes: &[usize]) -> GenResult<()> {
        let b = self.b;
        let (rows, d) = (self.rows, self.d);
        let x = node.inputs[0];
        let r = node.results[0];
        let xl = self.known(x)?;
        self.lay[x.index()] = Some(xl);
        let s = &b.shape[x.index()];
        let count: u64 = axes.iter().map(|&a| s[a]).product();
        let divide = (kind == ReduceKind::Mean).then_some(count as f64);
        let op = RedOp::from_reduce(kind);
        if axes.len() == s.len() {
            let src = match xl {
                Lay::Elem => AccSrc::Elem(x),
                Lay::Row => AccSrc::Row(x),
                other => return unsupported(format!("full reduction of a {other:?} value {x}; reduce whole tensors or per-row values")),
            };
            self.accs.push(Acc { col: false, op, src, level: self.level[x.index()], result: r, divide });
            self.lay[r.index()] = Some(Lay::PostScalar);
        } else if xl == Lay::Elem && axes.first() == Some(&0) && count == rows {
            self.accs.push(Acc { col: true, op, src: AccSrc::Elem(x), level: self.level[x.index()], result: r, divide });
            self.lay[r.index()] = Some(Lay::PostCol);
        } else if xl == Lay::Elem && count == d {
            let i = self.add_red(RowRed { level: self.level[x.index()], op, contrib: Contrib::Plain(x) });
            self.row_ops.push(RowOp { node, key, level: self.level[x.index()], reds: vec![i] });
            self.lay[r.index()] = Some(Lay::Row);
            self.level[r.index()] = self.level[x.index()] + 1;
        } else {
            return unsupported(format!("`{}` of the {xl:?} value {x} over axes {axes:?}", node.op.name()));
        }
        Ok(())
    }

    /// rmsnorm: a row sum of squares.
    fn rmsnorm(&mut self, node: &'g Node, key: usize) -> GenResult<()> {
        let d = self.d;
        let (x, w) = (node.inputs[0], node.inputs[1]);
        self.demand(x, Lay::Elem)?;
        self.demand(w, if d == 1 { Lay::Scalar } else { Lay::Col })?;
        let l = self.lv(&node.inputs);
        let i = self.add_red(RowRed { level: l, op: RedOp::Sum, contrib: Contrib::Square(x) });
        self.row_ops.push(RowOp { node, key, level: l, reds: vec![i] });
        self.lay[node.results[0].index()] = Some(Lay::Elem);
        self.level[node.results[0].index()] = l + 1;
        Ok(())
    }

    /// rmsnorm_bwd: two row sums, and `dw` as a column accumulation when something reads it.
    fn rmsnorm_bwd(&mut self, node: &'g Node, key: usize) -> GenResult<()> {
        let d = self.d;
        let (x, w, dy) = (node.inputs[0], node.inputs[1], node.inputs[2]);
        self.demand(x, Lay::Elem)?;
        self.demand(w, if d == 1 { Lay::Scalar } else { Lay::Col })?;
        self.demand(dy, Lay::Elem)?;
        let l = self.lv(&node.inputs);
        let i = self.add_red(RowRed { level: l, op: RedOp::Sum, contrib: Contrib::Square(x) });
        let j = self.add_red(RowRed { level: l, op: RedOp::Sum, contrib: Contrib::DyWX { x, w, dy } });
        self.row_ops.push(RowOp { node, key, level: l, reds: vec![i, j] });
        self.lay[node.results[0].index()] = Some(Lay::Elem);
        self.level[node.results[0].index()] = l + 1;
        if self.used[node.results[1].index()] {
            self.accs.push(Acc { col: true, op: RedOp::Sum, src: AccSrc::RmsDw { key, x, dy }, level: l + 1, result: node.results[1], divide: None });
        }
        self.lay[node.results[1].index()] = Some(Lay::PostCol);
        Ok(())
    }

    /// cross_entropy and its backward: a row log-sum-exp; the mean loss as a cross-block
    /// accumulation when something reads it.
    fn cross_entropy(&mut self, node: &'g Node, key: usize) -> GenResult<()> {
        let b = self.b;
        let rows = self.rows;
        let (logits, targets) = (node.inputs[0], node.inputs[1]);
        self.demand(logits, Lay::Elem)?;
        self.demand(targets, if rows == 1 { Lay::Scalar } else { Lay::Row })?;
        if b.arg_index(targets).is_none() {
            return unsupported("cross-entropy targets must be a kernel argument");
        }
        let l = self.level[logits.index()];
        let i = self.add_red(RowRed { level: l, op: RedOp::Lse, contrib: Contrib::Plain(logits) });
        self.row_ops.push(RowOp { node, key, level: l, reds: vec![i] });
        if matches!(node.op, Op::CrossEntropy) {
            if self.used[node.results[0].index()] {
                self.accs.push(Acc {
                    col: false,
                    op: RedOp::Sum,
                    src: AccSrc::CeLoss { key, logits },
                    level: l + 1,
                    result: node.results[0],
                    divide: Some(rows as f64),
                });
            }
            self.lay[node.results[0].index()] = Some(Lay::PostScalar);
        } else {
            let dl = node.inputs[2];
            let dll = self.known(dl)?;
            if dll != Lay::Scalar {
                return unsupported(format!("cross_entropy_bwd's dloss {dl} must be a plain scalar (it is {dll:?}); compute it in another kernel"));
            }
            self.lay[dl.index()] = Some(Lay::Scalar);
            self.lay[node.results[0].index()] = Some(Lay::Elem);
            self.level[node.results[0].index()] = l + 1;
        }
        Ok(())
    }

    /// The vocab-parallel loss's per-shard statistics and their backward: a row log-sum-exp
    /// over the shard, and for the backward the first position of the row's maximum.
    fn cross_entropy_stats(&mut self, node: &'g Node, key: usize) -> GenResult<()> {
        let b = self.b;
        let rows = self.rows;
        let (logits, targets, shard) = (node.inputs[0], node.inputs[1], node.inputs[2]);
        self.demand(logits, Lay::Elem)?;
        let per_row = if rows == 1 { Lay::Scalar } else { Lay::Row };
        self.demand(targets, per_row)?;
        if b.arg_index(targets).is_none() || b.arg_index(shard).is_none() {
            return unsupported(format!("`{}`'s targets and shard must be kernel arguments", node.op.name()));
        }
        if b.nodes().any(|n| n.inputs.contains(&shard) && !matches!(n.op, Op::CrossEntropyStats | Op::CrossEntropyStatsBwd)) {
            return unsupported(format!("the vocabulary shard {shard} is read by an op other than cross_entropy_stats(_bwd); keep that op in another kernel"));
        }
        // The one-hot shard is read element by element (`RowGen::targets`), never per lane.
        self.demand(shard, Lay::Gen)?;
        for &dv in node.inputs.get(3..).unwrap_or_default() {
            self.demand(dv, per_row)?;
        }
        let l = self.lv(&node.inputs);
        let i = self.add_red(RowRed { level: l, op: RedOp::Lse, contrib: Contrib::Plain(logits) });
        self.row_ops.push(RowOp { node, key, level: l, reds: vec![i] });
        if matches!(node.op, Op::CrossEntropyStats) {
            for &r in &node.results {
                self.lay[r.index()] = Some(per_row);
                self.level[r.index()] = l + 1;
            }
        } else {
            let j = self.add_red(RowRed { level: l + 1, op: RedOp::Max, contrib: Contrib::NegFirstMax { x: logits, key } });
            self.row_ops.push(RowOp { node, key, level: l + 1, reds: vec![j] });
            self.lay[node.results[0].index()] = Some(Lay::Elem);
            self.level[node.results[0].index()] = l + 2;
        }
        Ok(())
    }

    /// cross_entropy_combine: the shards' statistics combined per row; the mean loss as a
    /// cross-block accumulation when something reads it.
    fn cross_entropy_combine(&mut self, node: &'g Node, key: usize) -> GenResult<()> {
        let rows = self.rows;
        let (m, s, t) = (node.inputs[0], node.inputs[1], node.inputs[2]);
        for x in [m, s, t] {
            self.demand(x, Lay::Elem)?;
        }
        let l = self.lv(&node.inputs);
        let i = self.add_red(RowRed { level: l, op: RedOp::Max, contrib: Contrib::Plain(m) });
        let j = self.add_red(RowRed { level: l, op: RedOp::Sum, contrib: Contrib::Plain(t) });
        let k = self.add_red(RowRed { level: l + 1, op: RedOp::Sum, contrib: Contrib::ShiftedExp { s, m, key } });
        self.row_ops.push(RowOp { node, key, level: l, reds: vec![i, j] });
        self.row_ops.push(RowOp { node, key, level: l + 1, reds: vec![k] });
        if self.used[node.results[0].index()] {
            self.accs.push(Acc {
                col: false,
                op: RedOp::Sum,
                src: AccSrc::CeCombine { key },
                level: l + 2,
                result: node.results[0],
                divide: Some(rows as f64),
            });
        }
        self.lay[node.results[0].index()] = Some(Lay::PostScalar);
        Ok(())
    }

    /// RoPE: per element, at the level of its input.
    fn rope(&mut self, node: &Node) -> GenResult<()> {
        let x = node.inputs[0];
        self.demand(x, Lay::Elem)?;
        self.lay[node.results[0].index()] = Some(Lay::Elem);
        self.level[node.results[0].index()] = self.level[x.index()];
        Ok(())
    }

    /// Every output's layout, which must cover the kernel's domain; the analysis.
    fn finish(mut self, rope: Option<RopeInfo>) -> GenResult<Analysis<'g>> {
        let b = self.b;
        for o in &b.r.outputs {
            if self.lay[o.value.index()].is_none() {
                let l = self.known(o.value)?;
                self.lay[o.value.index()] = Some(l);
            }
            if self.lay[o.value.index()] == Some(Lay::Gen) {
                return unsupported(format!("output {} is a broadcast source; outputs must cover the kernel's domain", o.value));
            }
        }
        let lay: Vec<Lay> = self.lay.into_iter().map(|l| l.unwrap_or(Lay::Scalar)).collect();
        if rope.is_some() && !self.accs.is_empty() {
            return unsupported("reductions in a rope kernel; keep rope in a group of its own pointwise ops");
        }
        Ok(Analysis { flat: self.flat, rows: self.rows, d: self.d, rope, lay, level: self.level, reds: self.reds, row_ops: self.row_ops, accs: self.accs })
    }
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
