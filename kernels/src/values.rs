//! The per-element evaluator shared by the generators: resolves a body's shapes, classifies
//! each value by how it is indexed (its [`Lay`]), and emits the f32 arithmetic of an op group at
//! one work item (a [`Pos`]: `lanes` consecutive elements) with memoization, rounding each
//! bf16/f16 result to its dtype exactly where the reference interpreter does.

use std::collections::HashMap;

use titan_ir::infer::{InferCtx, infer_types};
use titan_ir::interp::rope_inv_freq;
use titan_ir::{BinaryOp, DType, Graph, Node, Op, Region, RopeLayout, TensorType, UnaryOp, Value, ValueDef};

use crate::emit::{Elem, FCmp, Func, ICmp, Ty, Val};
use crate::{GenResult, invalid, math, unsupported};

/// How a value is indexed inside a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lay {
    /// One value for the whole launch (rank 0).
    Scalar,
    /// One value per element of the iteration domain, at the element's linear index.
    Elem,
    /// One value per row of a row kernel (the leading dims).
    Row,
    /// One value per column of a row kernel (the last dim), shared by all rows.
    Col,
    /// A broadcast of a small argument, indexed through its strides (flat kernels).
    Gen,
    /// Known only after every block finished: a cross-block scalar reduction and what derives
    /// from it, computed by the last block.
    PostScalar,
    /// Like `PostScalar`, one value per column (rmsnorm_bwd's `dw`, column sums).
    PostCol,
}

impl Lay {
    pub(crate) fn is_post(self) -> bool {
        matches!(self, Lay::PostScalar | Lay::PostCol)
    }
    pub(crate) fn is_uniform(self) -> bool {
        matches!(self, Lay::Scalar | Lay::Row | Lay::PostScalar)
    }
}

/// The element type a dtype is stored as.
pub(crate) fn storage(d: DType) -> GenResult<Elem> {
    match d {
        DType::F32 => Ok(Elem::F32),
        DType::BF16 => Ok(Elem::BF16),
        DType::F16 => Ok(Elem::F16),
        DType::I32 => Ok(Elem::I32),
        DType::I64 => Ok(Elem::I64),
        DType::F8E4M3 => Ok(Elem::F8E4M3),
        DType::F8E5M2 => Ok(Elem::F8E5M2),
    }
}

/// The type arithmetic on a dtype uses: f32 for floats, the integer type itself otherwise.
pub(crate) fn compute(d: DType) -> GenResult<Elem> {
    Ok(match storage(d)? {
        Elem::I32 => Elem::I32,
        Elem::I64 => Elem::I64,
        _ => Elem::F32,
    })
}

/// A body region with every shape resolved.
pub(crate) struct Body<'g> {
    pub(crate) r: &'g Region,
    pub(crate) shape: Vec<Vec<u64>>,
}

impl<'g> Body<'g> {
    pub(crate) fn new(g: &'g Graph, r: &'g Region) -> GenResult<Body<'g>> {
        let mut shape = Vec::with_capacity(r.values.len());
        for (i, v) in r.values.iter().enumerate() {
            match v.ty.resolve(&g.dims) {
                Ok(s) => shape.push(s.into_iter().map(|d| d as u64).collect()),
                Err(e) => return invalid(format!("value %{i} of @{}: {e}; bind it in the graph's `dims`", r.name)),
            }
        }
        // Re-check every node with the IR's typing rules, so a malformed body is an error here
        // rather than an out-of-range index in a generator.
        let ctx = InferCtx { dims: &g.dims, blocks: &g.blocks };
        let nv = r.values.len();
        for &nid in &r.order {
            let Some(node) = r.nodes.get(nid.index()) else {
                return invalid(format!("@{} lists node {nid} which does not exist", r.name));
            };
            if let Some(v) = node.inputs.iter().chain(&node.results).find(|v| v.index() >= nv) {
                return invalid(format!("node {nid} of @{} uses value {v} which does not exist", r.name));
            }
            let ins: Vec<&TensorType> = node.inputs.iter().map(|&v| r.ty(v)).collect();
            let outs: Vec<TensorType> = node.results.iter().map(|&v| r.ty(v).clone()).collect();
            if let Err(e) = infer_types(&node.op, &ins, Some(&outs), &ctx) {
                return invalid(format!("node {nid} (`{}`) of @{}: {e}; run the verifier on the graph", node.op.name(), r.name));
            }
        }
        if let Some(o) = r.outputs.iter().find(|o| o.value.index() >= nv) {
            return invalid(format!("@{} returns value {} which does not exist", r.name, o.value));
        }
        Ok(Body { r, shape })
    }

    pub(crate) fn numel(&self, v: Value) -> u64 {
        self.shape[v.index()].iter().product()
    }

    pub(crate) fn dtype(&self, v: Value) -> DType {
        self.r.ty(v).dtype
    }

    pub(crate) fn nodes(&self) -> impl Iterator<Item = &'g Node> + '_ {
        self.r.order.iter().map(|n| &self.r.nodes[n.index()])
    }

    /// The node defining `v` and the result index, or `None` for an argument.
    pub(crate) fn def(&self, v: Value) -> Option<(&'g Node, usize)> {
        match self.r.value(v).def {
            ValueDef::Arg(_) => None,
            ValueDef::Result { node, index } => Some((&self.r.nodes[node.index()], index as usize)),
        }
    }

    pub(crate) fn arg_index(&self, v: Value) -> Option<usize> {
        match self.r.value(v).def {
            ValueDef::Arg(i) => Some(i as usize),
            ValueDef::Result { .. } => None,
        }
    }

    /// The position of `node` in the region's node table (a stable key).
    pub(crate) fn node_key(&self, node: &Node) -> usize {
        // Result values are unique per node; zero-result nodes do not occur in bodies.
        node.results.first().map_or(usize::MAX, |v| v.index())
    }

    pub(crate) fn name(&self) -> &str {
        &self.r.name
    }
}

/// One work item: `lanes` consecutive elements starting at linear index `lin` of the domain.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pos {
    /// Memo key: values evaluated at the same id are the same SSA values.
    pub(crate) id: u32,
    pub(crate) lanes: u32,
    /// i64 linear index of lane 0 in the iteration domain.
    pub(crate) lin: Val,
    /// i64 column of lane 0 (row kernels).
    pub(crate) col: Option<Val>,
}

/// The RoPE state of a row kernel whose rows are `[heads, head_dim]` at one position.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RopeRow {
    /// Shared-memory table: `cos` at `[j]`, `sin` at `[half + j]`, f32.
    pub(crate) table: Val,
    pub(crate) head_dim: u64,
}

/// A value evaluated at a work item: uniform across lanes (`U`, a scalar) or per lane (`V`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Ev {
    U(Val),
    V(Val),
}

/// Row results a row op needs besides its operands (`inv_rms`, `lse`, ...), per node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum RowKey {
    /// rmsnorm / rmsnorm_bwd: `1 / sqrt(mean(x^2) + eps)`.
    Inv,
    /// rmsnorm_bwd: `mean(dn * n)`.
    Mean,
    /// cross_entropy(_bwd): log-sum-exp of the row.
    Lse,
    /// cross_entropy(_bwd), cross_entropy_stats(_bwd): the row's target index (i64).
    Target,
    /// cross_entropy_stats(_bwd): the index of the vocabulary shard (i64).
    Shard,
    /// cross_entropy_stats(_bwd): the row's max; cross_entropy_combine: the max of the shards'.
    Max,
    /// cross_entropy_stats(_bwd): `sum exp(x - max)`; cross_entropy_combine: the shards'
    /// `sumexp` rescaled to the row's max and summed.
    SumExp,
    /// cross_entropy_stats_bwd: minus the first position of the row's max (f32; `-inf` when no
    /// element equals it, a NaN row).
    NegArgMax,
    /// cross_entropy_combine: the sum of the shards' target logits.
    TargetSum,
    /// reduce over the row: the result.
    Reduced,
}

/// Emits values of one body; see the module docs.
pub(crate) struct Eval<'b, 'g> {
    pub(crate) b: &'b Body<'g>,
    pub(crate) lay: Vec<Lay>,
    /// Pointer of each body argument.
    pub(crate) args: Vec<Val>,
    /// Uniform values (Scalar, Row for the current row, Post).
    pub(crate) uni: HashMap<Value, Val>,
    /// Per-lane values per work item id.
    pub(crate) memo: HashMap<(u32, Value), Val>,
    /// Row results per (node key, what).
    pub(crate) rowres: HashMap<(usize, RowKey), Val>,
    /// Row kernels: the current row (i64) and the row length.
    pub(crate) row: Option<Val>,
    pub(crate) row_len: u64,
    /// Rows of the whole kernel (cross_entropy_bwd divides by it).
    pub(crate) rows: u64,
    pub(crate) rope: Option<RopeRow>,
    /// For a work item id, its RoPE partner (half layout): (partner, this item is the first half).
    pub(crate) partner: HashMap<u32, (Pos, bool)>,
    next_pos: u32,
}

impl<'b, 'g> Eval<'b, 'g> {
    pub(crate) fn new(b: &'b Body<'g>, lay: Vec<Lay>, args: Vec<Val>) -> Eval<'b, 'g> {
        Eval {
            b,
            lay,
            args,
            uni: HashMap::new(),
            memo: HashMap::new(),
            rowres: HashMap::new(),
            row: None,
            row_len: 1,
            rows: 1,
            rope: None,
            partner: HashMap::new(),
            next_pos: 0,
        }
    }

    pub(crate) fn pos(&mut self, lanes: u32, lin: Val, col: Option<Val>) -> Pos {
        let id = self.next_pos;
        self.next_pos += 1;
        Pos { id, lanes, lin, col }
    }

    /// Forget per-lane values (leaving a region where they were defined).
    pub(crate) fn forget_items(&mut self) {
        self.memo.clear();
        self.partner.clear();
    }

    /// Forget the values of the current row.
    pub(crate) fn forget_row(&mut self) {
        let lay = &self.lay;
        self.uni.retain(|v, _| lay[v.index()] != Lay::Row);
        self.rowres.clear();
        self.forget_items();
    }

    fn lay_of(&self, v: Value) -> Lay {
        self.lay[v.index()]
    }

    /// Value of `v` at `pos` as an [`Ev`]. `pos` may be `None` for uniform values.
    pub(crate) fn get(&mut self, f: &mut Func, v: Value, pos: Option<&Pos>) -> GenResult<Ev> {
        if self.lay_of(v).is_uniform() {
            return Ok(Ev::U(self.uniform(f, v)?));
        }
        match pos {
            Some(p) => Ok(Ev::V(self.elem(f, v, p)?)),
            None => invalid(format!("value {v} of @{} is per element but is needed where only uniform values exist", self.b.name())),
        }
    }

    /// `v` at every lane of `pos` (uniform values are splat).
    pub(crate) fn lanes(&mut self, f: &mut Func, v: Value, pos: &Pos) -> GenResult<Val> {
        match self.get(f, v, Some(pos))? {
            Ev::U(x) => Ok(f.splat(x, pos.lanes)),
            Ev::V(x) => Ok(x),
        }
    }

    /// The uniform value of `v` (Scalar, Row or Post layout).
    pub(crate) fn uniform(&mut self, f: &mut Func, v: Value) -> GenResult<Val> {
        if let Some(&x) = self.uni.get(&v) {
            return Ok(x);
        }
        let lay = self.lay_of(v);
        let dt = self.b.dtype(v);
        let x = match self.b.def(v) {
            None => {
                let i = self.b.arg_index(v).unwrap_or(0);
                let ptr = self.args[i];
                let off = match lay {
                    Lay::Row => match self.row {
                        Some(r) => r,
                        None => return invalid(format!("per-row argument {v} used outside a row")),
                    },
                    _ => f.i64c(0),
                };
                let st = storage(dt)?;
                let raw = f.load_at(ptr, off, Ty::S(st), st.bytes());
                widen(f, raw)
            }
            Some((node, idx)) => self.uniform_node(f, node, idx, v)?,
        };
        self.uni.insert(v, x);
        Ok(x)
    }

    fn uniform_node(&mut self, f: &mut Func, node: &'g Node, idx: usize, v: Value) -> GenResult<Val> {
        let dt = self.b.dtype(v);
        let out_st = storage(dt)?;
        let key = self.b.node_key(node);
        let x = match &node.op {
            Op::Constant { value } => {
                if dt.is_int() {
                    f.ci(*value as i64, Ty::S(out_st))
                } else {
                    let c = f.f32c(*value as f32);
                    math::round_to(f, c, out_st)
                }
            }
            Op::Unary(_) | Op::Binary(_) | Op::Cast | Op::Fp8Scale { .. } => {
                let ops: Vec<Val> = node.inputs.iter().map(|&i| self.uniform(f, i)).collect::<GenResult<_>>()?;
                let types: Vec<DType> = node.inputs.iter().map(|&i| self.b.dtype(i)).collect();
                pointwise(f, &node.op, &ops, &types, dt)?
            }
            Op::Broadcast { .. } | Op::Reshape => self.uniform(f, node.inputs[0])?,
            Op::CrossEntropyStats => match idx {
                0 => self.row_result(key, RowKey::Max)?,
                1 => self.row_result(key, RowKey::SumExp)?,
                _ => self.target_logit(f, node, key)?,
            },
            Op::Reduce { .. } => match self.rowres.get(&(key, RowKey::Reduced)) {
                Some(&x) => x,
                None => return invalid(format!("reduction result {v} of @{} is used before its reduction", self.b.name())),
            },
            Op::LrSchedule(cfg) => {
                let step = self.uniform(f, node.inputs[0])?;
                let s = f.as_i64(step);
                lr_schedule(f, cfg, s)
            }
            other => {
                return invalid(format!("`{}` result {idx} ({v}) of @{} cannot be computed as a uniform value", other.name(), self.b.name()));
            }
        };
        Ok(x)
    }

    /// `lanes` consecutive elements of `v`'s storage at element `off` of `ptr`, widened to the
    /// compute type (how an argument is read, and a row kernel's stored output read back).
    pub(crate) fn load_lanes(&self, f: &mut Func, v: Value, ptr: Val, off: Val, lanes: u32) -> GenResult<Val> {
        let st = storage(self.b.dtype(v))?;
        let align = vec_align(st, lanes, self.b.numel(v));
        let raw = f.load_at(ptr, off, Ty::lanes_of(st, lanes), align);
        Ok(widen(f, raw))
    }

    /// The per-lane value of `v` at `pos`.
    pub(crate) fn elem(&mut self, f: &mut Func, v: Value, pos: &Pos) -> GenResult<Val> {
        if let Some(&x) = self.memo.get(&(pos.id, v)) {
            return Ok(x);
        }
        let lay = self.lay_of(v);
        let x = match self.b.def(v) {
            None => {
                let i = self.b.arg_index(v).unwrap_or(0);
                let ptr = self.args[i];
                let off = match lay {
                    Lay::Col => match pos.col {
                        Some(c) => c,
                        None => return invalid(format!("per-column argument {v} used outside a row kernel")),
                    },
                    Lay::Elem => pos.lin,
                    other => return invalid(format!("argument {v} with layout {other:?} evaluated per element")),
                };
                self.load_lanes(f, v, ptr, off, pos.lanes)?
            }
            Some((node, idx)) => self.elem_node(f, node, idx, v, pos)?,
        };
        self.memo.insert((pos.id, v), x);
        Ok(x)
    }

    fn elem_node(&mut self, f: &mut Func, node: &'g Node, idx: usize, v: Value, pos: &Pos) -> GenResult<Val> {
        let dt = self.b.dtype(v);
        let out_st = storage(dt)?;
        let key = self.b.node_key(node);
        let lanes = pos.lanes;
        let x = match &node.op {
            Op::Constant { .. } => {
                let u = self.uniform(f, v)?;
                f.splat(u, lanes)
            }
            Op::Unary(_) | Op::Binary(_) | Op::Cast | Op::Fp8Scale { .. } => {
                let evs: Vec<Ev> = node.inputs.iter().map(|&i| self.get(f, i, Some(pos))).collect::<GenResult<_>>()?;
                let types: Vec<DType> = node.inputs.iter().map(|&i| self.b.dtype(i)).collect();
                let all_uniform: Option<Vec<Val>> = evs
                    .iter()
                    .map(|e| match *e {
                        Ev::U(x) => Some(x),
                        Ev::V(_) => None,
                    })
                    .collect();
                if let Some(ops) = all_uniform {
                    let u = pointwise(f, &node.op, &ops, &types, dt)?;
                    f.splat(u, lanes)
                } else {
                    let ops: Vec<Val> = evs
                        .iter()
                        .map(|e| match *e {
                            Ev::U(x) => f.splat(x, lanes),
                            Ev::V(x) => x,
                        })
                        .collect();
                    pointwise(f, &node.op, &ops, &types, dt)?
                }
            }
            Op::Reshape => self.lanes(f, node.inputs[0], pos)?,
            Op::Broadcast { dims } => self.broadcast(f, node.inputs[0], dims, v, pos)?,
            Op::RmsNorm { .. } => {
                let x = self.lanes(f, node.inputs[0], pos)?;
                let w = self.lanes(f, node.inputs[1], pos)?;
                let inv = self.row_result(key, RowKey::Inv)?;
                let inv = f.splat(inv, lanes);
                let n = f.mulf(x, inv);
                let n = math::round_to(f, n, storage(self.b.dtype(node.inputs[0]))?);
                let y = f.mulf(n, w);
                math::round_to(f, y, out_st)
            }
            Op::RmsNormBwd { .. } => {
                if idx != 0 {
                    return invalid(format!("rmsnorm_bwd's dw ({v}) is a cross-row sum, not a per-element value"));
                }
                let x = self.lanes(f, node.inputs[0], pos)?;
                let w = self.lanes(f, node.inputs[1], pos)?;
                let dy = self.lanes(f, node.inputs[2], pos)?;
                let inv = self.row_result(key, RowKey::Inv)?;
                let inv = f.splat(inv, lanes);
                let mean = self.row_result(key, RowKey::Mean)?;
                let mean = f.splat(mean, lanes);
                let n = f.mulf(x, inv);
                let dn = f.mulf(dy, w);
                let nm = f.mulf(n, mean);
                let d = f.subf(dn, nm);
                let dx = f.mulf(inv, d);
                math::round_to(f, dx, out_st)
            }
            Op::CrossEntropyStatsBwd => {
                // dsumexp exp(x - max) + dtarget [j = target] + (dmax - dsumexp sumexp) [j = argmax]
                let x = self.lanes(f, node.inputs[0], pos)?;
                let Some(col) = pos.col else {
                    return invalid("cross_entropy_stats_bwd outside a row kernel");
                };
                let m = self.row_result(key, RowKey::Max)?;
                let sum = self.row_result(key, RowKey::SumExp)?;
                let neg_at = self.row_result(key, RowKey::NegArgMax)?;
                let t = self.row_result(key, RowKey::Target)?;
                let k = self.row_result(key, RowKey::Shard)?;
                let (dm, ds, dt) = (self.uniform(f, node.inputs[3])?, self.uniform(f, node.inputs[4])?, self.uniform(f, node.inputs[5])?);
                let dc = f.i64c(self.row_len as i64);
                let first = f.muli(k, dc);
                let local = f.subi(t, first);
                // The argmax as an index (-1 when there is none: a NaN row).
                let none = f.f32c(f32::NEG_INFINITY);
                let found = f.cmpf(FCmp::Olt, none, neg_at);
                let at = f.negf(neg_at);
                let minus_one = f.f32c(-1.0);
                let at = f.select(found, at, minus_one);
                let at = f.fptosi(at, Elem::I64);
                // Per lane, compare offsets from this work item's first column with constants.
                let to_t = f.subi(local, col);
                let to_m = f.subi(at, col);
                let dsum = f.mulf(ds, sum);
                let at_max = f.subf(dm, dsum);
                let mv = f.splat(m, lanes);
                let e = f.subf(x, mv);
                let e = math::exp_approx(f, e);
                let dsv = f.splat(ds, lanes);
                let g = f.mulf(dsv, e);
                let zero = f.f32c(0.0);
                let (hot, arg): (Vec<Val>, Vec<Val>) = (0..lanes)
                    .map(|l| {
                        let o = f.i64c(i64::from(l));
                        let is_t = f.cmpi(ICmp::Eq, to_t, o);
                        let is_m = f.cmpi(ICmp::Eq, to_m, o);
                        (f.select(is_t, dt, zero), f.select(is_m, at_max, zero))
                    })
                    .unzip();
                let hot = f.vector_of(&hot);
                let arg = f.vector_of(&arg);
                let g = f.addf(g, hot);
                let g = f.addf(g, arg);
                math::round_to(f, g, out_st)
            }
            Op::CrossEntropyBwd => {
                let x = self.lanes(f, node.inputs[0], pos)?;
                let lse = self.row_result(key, RowKey::Lse)?;
                let t = self.row_result(key, RowKey::Target)?;
                let dloss = self.uniform(f, node.inputs[2])?;
                let rows = f.f32c(self.rows as f32);
                let g = f.divf(dloss, rows);
                let Some(col) = pos.col else {
                    return invalid("cross_entropy_bwd outside a row kernel");
                };
                let lse_v = f.splat(lse, lanes);
                let d = f.subf(x, lse_v);
                let p = math::exp_approx(f, d);
                let cols: Vec<Val> = (0..lanes)
                    .map(|l| {
                        let o = f.i64c(i64::from(l));
                        f.addi(col, o)
                    })
                    .collect();
                let one = f.f32c(1.0);
                let zero = f.f32c(0.0);
                let hot: Vec<Val> = cols
                    .iter()
                    .map(|&c| {
                        let eq = f.cmpi(ICmp::Eq, c, t);
                        f.select(eq, one, zero)
                    })
                    .collect();
                let hot = f.vector_of(&hot);
                let q = f.subf(p, hot);
                let gv = f.splat(g, lanes);
                let r = f.mulf(q, gv);
                math::round_to(f, r, out_st)
            }
            Op::Rope(cfg) => {
                let Some(rope) = self.rope else {
                    return invalid("rope outside a rope row kernel");
                };
                let Some(col) = pos.col else {
                    return invalid("rope outside a row kernel");
                };
                let x = node.inputs[0];
                let half = rope.head_dim / 2;
                let dcol = f.i64c(rope.head_dim as i64);
                let in_head = f.remui(col, dcol);
                match cfg.layout {
                    RopeLayout::Half => {
                        let Some(&(other, first)) = self.partner.get(&pos.id) else {
                            return invalid("rope (half layout) evaluated without its partner lanes");
                        };
                        let (pa, pb) = if first { (*pos, other) } else { (other, *pos) };
                        let xa = self.lanes(f, x, &pa)?;
                        let xb = self.lanes(f, x, &pb)?;
                        // Lane j of the first half pairs with lane j of the second.
                        let hc = f_i64(f, half);
                        let j = if first { in_head } else { f.subi(in_head, hc) };
                        let c = table_load(f, rope.table, j, lanes);
                        let hs = f.i64c(half as i64);
                        let js = f.addi(j, hs);
                        let s = table_load(f, rope.table, js, lanes);
                        let a1 = f.mulf(xa, c);
                        let a2 = f.mulf(xb, s);
                        let oa = f.subf(a1, a2);
                        let b1 = f.mulf(xb, c);
                        let b2 = f.mulf(xa, s);
                        let ob = f.addf(b1, b2);
                        let oa = math::round_to(f, oa, out_st);
                        let ob = math::round_to(f, ob, out_st);
                        self.memo.insert((pa.id, v), oa);
                        self.memo.insert((pb.id, v), ob);
                        if first { oa } else { ob }
                    }
                    RopeLayout::Interleaved => {
                        if !lanes.is_multiple_of(2) {
                            return invalid("interleaved rope needs an even number of lanes");
                        }
                        let xv = self.lanes(f, x, pos)?;
                        let two = f.i64c(2);
                        let j0 = f.divui(in_head, two);
                        let mut cs = Vec::new();
                        let mut ss = Vec::new();
                        for k in 0..lanes / 2 {
                            let o = f.i64c(i64::from(k));
                            let j = f.addi(j0, o);
                            let c = table_load(f, rope.table, j, 1);
                            let hs = f.i64c(half as i64);
                            let js = f.addi(j, hs);
                            let s = table_load(f, rope.table, js, 1);
                            let ns = f.negf(s);
                            cs.push(c);
                            cs.push(c);
                            ss.push(ns);
                            ss.push(s);
                        }
                        let cv = f.vector_of(&cs);
                        let sv = f.vector_of(&ss);
                        let mask: Vec<u32> = (0..lanes).map(|l| l ^ 1).collect();
                        let sw = if lanes == 1 { xv } else { f.permute(xv, &mask) };
                        let a = f.mulf(xv, cv);
                        let b = f.mulf(sw, sv);
                        let o = f.addf(a, b);
                        math::round_to(f, o, out_st)
                    }
                }
            }
            other => {
                return unsupported(format!("`{}` cannot be evaluated per element in this kernel ({v} of @{})", other.name(), self.b.name()));
            }
        };
        Ok(x)
    }

    /// cross_entropy_stats's `target`: the logit of the row's target when it is in this
    /// vocabulary shard, else 0; NaN for a target outside the whole vocabulary.
    fn target_logit(&mut self, f: &mut Func, node: &'g Node, key: usize) -> GenResult<Val> {
        let (logits, shard) = (node.inputs[0], node.inputs[2]);
        let Some(row) = self.row else {
            return invalid("cross_entropy_stats outside a row kernel");
        };
        let t = self.row_result(key, RowKey::Target)?;
        let k = self.row_result(key, RowKey::Shard)?;
        let (d, n) = (self.row_len as i64, self.b.numel(shard) as i64);
        let zero = f.i64c(0);
        let last = f.i64c(n * d - 1);
        let tc = f.maxsi(t, zero);
        let tc = f.minsi(tc, last);
        let valid = f.cmpi(ICmp::Eq, tc, t);
        let dc = f.i64c(d);
        let first = f.muli(k, dc);
        let local = f.subi(t, first);
        let lc = f.maxsi(local, zero);
        let dm = f.i64c(d - 1);
        let lc = f.minsi(lc, dm);
        let here = f.cmpi(ICmp::Eq, lc, local);
        let base = f.muli(row, dc);
        let lin = f.addi(base, lc);
        let pos = self.pos(1, lin, Some(lc));
        let x = self.elem(f, logits, &pos)?;
        let z = f.f32c(0.0);
        let x = f.select(here, x, z);
        let nan = f.f32c(f32::NAN);
        Ok(f.select(valid, x, nan))
    }

    pub(crate) fn row_result(&self, key: usize, what: RowKey) -> GenResult<Val> {
        match self.rowres.get(&(key, what)) {
            Some(&x) => Ok(x),
            None => invalid(format!("row result {what:?} used before it was computed")),
        }
    }

    /// `broadcast(x)` at `pos`.
    fn broadcast(&mut self, f: &mut Func, x: Value, dims: &[usize], out: Value, pos: &Pos) -> GenResult<Val> {
        let lanes = pos.lanes;
        match self.lay_of(x) {
            Lay::Scalar | Lay::Row | Lay::PostScalar => {
                let u = self.uniform(f, x)?;
                Ok(f.splat(u, lanes))
            }
            Lay::Col | Lay::Elem => self.lanes(f, x, pos),
            Lay::Gen => {
                let Some(i) = self.b.arg_index(x) else {
                    return unsupported(format!("broadcast of computed value {x}; only arguments and scalars can be broadcast in a flat kernel"));
                };
                let out_shape = self.b.shape[out.index()].clone();
                let in_shape = self.b.shape[x.index()].clone();
                let src = gen_index(f, pos.lin, &out_shape, &in_shape, dims);
                let contiguous = dims.last().is_some_and(|&d| d + 1 == out_shape.len()) && in_shape.last().copied().unwrap_or(1) > 1;
                let st = storage(self.b.dtype(x))?;
                let ptr = self.args[i];
                if contiguous || lanes == 1 {
                    let align = vec_align(st, lanes, self.b.numel(x));
                    let raw = f.load_at(ptr, src, Ty::lanes_of(st, lanes), align);
                    Ok(widen(f, raw))
                } else {
                    let raw = f.load_at(ptr, src, Ty::S(st), st.bytes());
                    let w = widen(f, raw);
                    Ok(f.splat(w, lanes))
                }
            }
            Lay::PostCol => invalid(format!("broadcast of the cross-row sum {x} inside the main pass")),
        }
    }
}

fn f_i64(f: &mut Func, x: u64) -> Val {
    f.i64c(x as i64)
}

/// Load `lanes` f32 values of the RoPE table starting at index `j` (i64).
fn table_load(f: &mut Func, table: Val, j: Val, lanes: u32) -> Val {
    let align = (lanes * 4).min(16);
    f.load_at(table, j, Ty::lanes_of(Elem::F32, lanes), align)
}

/// Alignment of a `lanes`-wide access of a tensor of `numel` elements of `st` at a multiple of
/// `lanes`: the ABI guarantees `min(16, largest power of two dividing the byte size)`.
pub(crate) fn vec_align(st: Elem, lanes: u32, numel: u64) -> u32 {
    let bytes = numel.saturating_mul(u64::from(st.bytes()));
    let base = if bytes == 0 { 16 } else { 1u64 << bytes.trailing_zeros().min(4) } as u32;
    (lanes * st.bytes()).min(16).min(base).max(1)
}

/// Widen a loaded value to its compute type (bf16/f16/fp8 -> f32; f32 and ints unchanged).
pub(crate) fn widen(f: &mut Func, raw: Val) -> Val {
    match raw.ty.elem() {
        Elem::BF16 | Elem::F16 => f.extf(raw, Elem::F32),
        Elem::F8E4M3 | Elem::F8E5M2 => math::f8_to_f32(f, raw),
        _ => raw,
    }
}

/// Narrow a computed value to its storage type for a store.
pub(crate) fn narrow(f: &mut Func, x: Val, st: Elem) -> Val {
    match st {
        Elem::BF16 | Elem::F16 => f.truncf(x, st),
        Elem::F8E4M3 | Elem::F8E5M2 => math::f32_to_f8(f, x, st),
        Elem::I32 | Elem::I64 if x.ty.elem() != st => {
            if x.ty.elem().bytes() > st.bytes() {
                f.trunci(x, st)
            } else {
                f.extsi(x, st)
            }
        }
        _ => x,
    }
}

/// The index into a broadcast source of shape `in_shape` for output linear index `lin`.
fn gen_index(f: &mut Func, lin: Val, out_shape: &[u64], in_shape: &[u64], dims: &[usize]) -> Val {
    let mut in_strides = vec![1u64; in_shape.len()];
    for i in (0..in_shape.len().saturating_sub(1)).rev() {
        in_strides[i] = in_strides[i + 1] * in_shape[i + 1];
    }
    let mut src = f.i64c(0);
    let mut rest = lin;
    // Walk output dims from the innermost: coordinate = rest % size, rest /= size.
    for od in (0..out_shape.len()).rev() {
        let size = out_shape[od];
        let k = dims.iter().position(|&d| d == od);
        let sz = f.i64c(size as i64);
        if let Some(k) = k.filter(|&k| in_shape[k] != 1) {
            let coord = f.remui(rest, sz);
            let st = f.i64c(in_strides[k] as i64);
            let t = f.muli(coord, st);
            src = f.addi(src, t);
        }
        if od > 0 {
            rest = f.divui(rest, sz);
        }
    }
    src
}

/// One pointwise op (unary, binary, cast) on compute-typed operands (all uniform scalars or all
/// `lanes`-wide), rounded to the result dtype.
pub(crate) fn pointwise(f: &mut Func, op: &Op, x: &[Val], in_types: &[DType], out: DType) -> GenResult<Val> {
    let out_st = storage(out)?;
    let r = match op {
        Op::Unary(u) => {
            let a = x[0];
            match u {
                UnaryOp::Neg => f.negf(a),
                UnaryOp::Exp => math::exp(f, a),
                UnaryOp::Log => math::log(f, a),
                UnaryOp::Sqrt => f.sqrt(a),
                UnaryOp::Rsqrt => {
                    let s = f.sqrt(a);
                    let one = f.cf(1.0, a.ty);
                    f.divf(one, s)
                }
                UnaryOp::Recip => {
                    let one = f.cf(1.0, a.ty);
                    f.divf(one, a)
                }
                UnaryOp::Sigmoid => math::sigmoid(f, a),
                UnaryOp::Silu => {
                    let s = math::sigmoid(f, a);
                    f.mulf(a, s)
                }
                UnaryOp::Tanh => math::tanh(f, a),
                UnaryOp::Abs => f.fabs(a),
                UnaryOp::Square => f.mulf(a, a),
            }
        }
        Op::Binary(bop) => {
            let (a, b) = (x[0], x[1]);
            match bop {
                BinaryOp::Add => f.addf(a, b),
                BinaryOp::Sub => f.subf(a, b),
                BinaryOp::Mul => f.mulf(a, b),
                BinaryOp::Div => f.divf(a, b),
                BinaryOp::Max => f.maximumf(a, b),
                BinaryOp::Min => f.minimumf(a, b),
                BinaryOp::Pow => math::pow(f, a, b),
                BinaryOp::SiluGrad => {
                    // dy * s * (1 + x (1 - s)), in the interpreter's order.
                    let s = math::sigmoid(f, a);
                    let one = f.cf(1.0, a.ty);
                    let ds = f.mulf(b, s);
                    let oms = f.subf(one, s);
                    let xo = f.mulf(a, oms);
                    let t = f.addf(one, xo);
                    f.mulf(ds, t)
                }
            }
        }
        Op::Fp8Scale { dtype, pow2 } => {
            let Some(max) = titan_ir::fp8::fp8_max(*dtype) else {
                return invalid(format!("fp8_scale to {dtype}, which is not an fp8 dtype"));
            };
            math::fp8_scale(f, x[0], max, *pow2)
        }
        Op::Cast => {
            let a = x[0];
            let from = in_types[0];
            match (from.is_int(), out.is_int()) {
                (false, false) => a,
                (true, false) => f.sitofp(a, Elem::F32),
                (true, true) => {
                    let to = compute(out)?;
                    if a.ty.elem().bytes() > to.bytes() { f.trunci(a, to) } else { f.extsi(a, to) }
                }
                (false, true) => {
                    return unsupported(format!("cast from {from} to {out} in a generated kernel; cast floats to integers outside fused groups"));
                }
            }
        }
        other => return invalid(format!("`{}` is not a pointwise op", other.name())),
    };
    Ok(if out.is_int() { r } else { math::round_to(f, r, out_st) })
}

/// The learning rate at 1-based step `s` (i64), computed in f64 like `interp::lr_at`, as f32.
pub(crate) fn lr_schedule(f: &mut Func, cfg: &titan_ir::LrSchedule, s: Val) -> Val {
    let one_i = f.i64c(1);
    let s = f.maxsi(s, one_i);
    let sf = f.sitofp(s, Elem::F64);
    let lr = f.f64c(cfg.lr);
    let w = f.f64c(cfg.warmup_steps as f64);
    let m = f.f64c(cfg.min_lr_ratio);
    let one = f.f64c(1.0);
    let half = f.f64c(0.5);
    let warm = {
        let t = f.mulf(lr, sf);
        f.divf(t, w)
    };
    let sw = f.subf(sf, w);
    let ds = f.f64c(cfg.decay_steps.max(1) as f64);
    let prog = f.divf(sw, ds);
    let prog = f.minnumf(prog, one);
    let factor = match cfg.decay {
        titan_ir::DecayKind::Constant => one,
        titan_ir::DecayKind::Linear => {
            let oml = f.subf(one, m);
            let t = f.mulf(oml, prog);
            f.subf(one, t)
        }
        titan_ir::DecayKind::Cosine => {
            let c = math::cos_pi_f64(f, prog);
            let oml = f.subf(one, m);
            let t = f.mulf(oml, half);
            let opc = f.addf(one, c);
            let t = f.mulf(t, opc);
            f.addf(m, t)
        }
    };
    let decayed = f.mulf(lr, factor);
    let res = if cfg.warmup_steps > 0 {
        let in_warm = f.cmpf(FCmp::Ole, sf, w);
        f.select(in_warm, warm, decayed)
    } else {
        decayed
    };
    f.truncf(res, Elem::F32)
}

/// RoPE inverse frequencies of a config for `head_dim`, as the interpreter computes them.
pub(crate) fn rope_freqs(cfg: &titan_ir::RopeConfig, head_dim: u64) -> GenResult<Vec<f64>> {
    match rope_inv_freq(cfg, head_dim as usize) {
        Ok(v) => Ok(v),
        Err(e) => unsupported(format!("rope: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_follows_the_buffer_size() {
        assert_eq!(vec_align(Elem::BF16, 8, 64), 16);
        assert_eq!(vec_align(Elem::F32, 8, 64), 16);
        assert_eq!(vec_align(Elem::BF16, 8, 4), 8);
        assert_eq!(vec_align(Elem::F32, 1, 1), 4);
        assert_eq!(vec_align(Elem::BF16, 2, 3), 2);
    }
}
