//! Vector-Jacobian products of every differentiable op, emitted as IR ops.

use crate::PassDiag;
use titan_ir::{BinaryOp, Builder, CollectiveReduce, DType, Op, ReduceKind, RopeConfig, TensorType, UnaryOp, Value};

use crate::util::{flatten_leading, scalar};

/// Which primal values a rule reads: inputs by position, results by position.
pub struct Needs {
    pub inputs: Vec<bool>,
    pub results: Vec<bool>,
}

fn needs(n_in: usize, n_out: usize, inputs: &[usize], results: &[usize]) -> Needs {
    Needs { inputs: (0..n_in).map(|i| inputs.contains(&i)).collect(), results: (0..n_out).map(|i| results.contains(&i)).collect() }
}

/// The primal values the VJP of `op` reads (so a block saves only those for the backward).
pub fn vjp_needs(op: &Op, n_in: usize, n_out: usize) -> Needs {
    match op {
        Op::Embedding | Op::Gather => needs(n_in, n_out, &[if matches!(op, Op::Embedding) { 0 } else { 1 }], &[]),
        Op::ScatterAdd => needs(n_in, n_out, &[0], &[]),
        Op::GatherShard => needs(n_in, n_out, &[1, 2], &[]),
        Op::ScatterAddShard => needs(n_in, n_out, &[0, 2], &[]),
        Op::Linear | Op::LinearF8 { .. } | Op::RmsNorm { .. } | Op::CrossEntropy | Op::Matmul { .. } | Op::CrossEntropyCombine => {
            needs(n_in, n_out, &[0, 1], &[])
        }
        Op::CrossEntropyStats => needs(n_in, n_out, &[0, 1, 2], &[]),
        Op::Attention { .. } => needs(n_in, n_out, &[0, 1, 2], &[0, 1]),
        Op::Unary(u) => match u {
            UnaryOp::Neg => needs(n_in, n_out, &[], &[]),
            UnaryOp::Log | UnaryOp::Silu | UnaryOp::Square => needs(n_in, n_out, &[0], &[]),
            UnaryOp::Abs => needs(n_in, n_out, &[0], &[0]),
            _ => needs(n_in, n_out, &[], &[0]),
        },
        Op::Binary(bo) => match bo {
            BinaryOp::Add | BinaryOp::Sub => needs(n_in, n_out, &[], &[]),
            BinaryOp::Mul => needs(n_in, n_out, &[0, 1], &[]),
            BinaryOp::Div => needs(n_in, n_out, &[1], &[0]),
            BinaryOp::Pow => needs(n_in, n_out, &[0, 1], &[0]),
            _ => needs(n_in, n_out, &[], &[]),
        },
        _ => needs(n_in, n_out, &[], &[]),
    }
}

/// Inputs of a VJP: primal values (where [`vjp_needs`] asked for them), primal types, and the
/// cotangents of the results.
pub struct VjpArgs<'a> {
    pub x: &'a [Option<Value>],
    pub y: &'a [Option<Value>],
    pub x_ty: &'a [TensorType],
    pub y_ty: &'a [TensorType],
    pub dy: &'a [Option<Value>],
}

impl VjpArgs<'_> {
    fn x(&self, i: usize) -> Value {
        self.x[i].expect("invariant: vjp_needs lists every primal input a rule reads")
    }
    fn y(&self, i: usize) -> Value {
        self.y[i].expect("invariant: vjp_needs lists every primal result a rule reads")
    }
}

fn un(b: &mut Builder, u: UnaryOp, x: Value) -> Result<Value, String> {
    b.push1(Op::Unary(u), &[x])
}

fn bin(b: &mut Builder, op: BinaryOp, x: Value, y: Value) -> Result<Value, String> {
    b.push1(Op::Binary(op), &[x, y])
}

/// Sum `g` (shaped like the result) down to a rank-0 operand's shape when it was broadcast.
fn unbroadcast(b: &mut Builder, g: Value, operand: &TensorType) -> Result<Value, String> {
    let rank = b.ty(g).rank();
    if operand.rank() == 0 && rank > 0 { b.push1(Op::Reduce { kind: ReduceKind::Sum, axes: (0..rank).collect() }, &[g]) } else { Ok(g) }
}

/// `x [..., in]` and `dy [..., out]` of a linear as 2-D `[tokens, features]` (views), for the
/// weight gradient `dyᵀ · x`.
fn tokens_by_features(b: &mut Builder, x: Value, x_ty: &TensorType, dy: Value, dims: &titan_ir::DimTable) -> Result<(Value, Value), String> {
    if x_ty.rank() == 2 {
        return Ok((x, dy));
    }
    let x2 = b.push_typed(Op::Reshape, &[x], flatten_leading(x_ty, dims)?)?;
    let dy_ty = b.ty(dy).clone();
    let dy2 = b.push_typed(Op::Reshape, &[dy], flatten_leading(&dy_ty, dims)?)?;
    Ok((x2, dy2))
}

/// Emit the VJP of one node. Returns one cotangent per input (`None`: no gradient flows).
pub fn vjp(op: &Op, a: &VjpArgs, b: &mut Builder) -> Result<Vec<Option<Value>>, PassDiag> {
    match op {
        Op::Embedding
        | Op::Gather
        | Op::ScatterAdd
        | Op::GatherShard
        | Op::ScatterAddShard
        | Op::Linear
        | Op::LinearF8 { .. }
        | Op::RmsNorm { .. }
        | Op::Rope(_)
        | Op::Attention { .. }
        | Op::CrossEntropy
        | Op::CrossEntropyStats
        | Op::CrossEntropyCombine => model_op_vjp(op, a, b),
        // A scale is a function of the amax only: no gradient flows through it (the
        // straight-through estimator of float8 training differentiates `linear_f8` whole).
        Op::Fp8Scale { .. } => Ok(vec![None]),
        Op::ScaledMatmul { .. } => Err(PassDiag::unsupported(
            "differentiating `scaled_matmul` is not supported: differentiate `linear_f8`, whose VJP quantizes the backward GEMMs from the high-precision operands",
        )),
        Op::Unary(_) | Op::Binary(_) | Op::Cast => pointwise_vjp(op, a, b),
        Op::Reshape | Op::Transpose { .. } | Op::Reduce { .. } | Op::Broadcast { .. } | Op::Slice { .. } | Op::Concat { .. } => layout_vjp(op, a, b),
        Op::Matmul { .. } => matmul_vjp(op, a, b),
        Op::AllGather { .. } | Op::ReduceScatter { .. } | Op::AllReduce { .. } | Op::TakeShard { .. } | Op::PlaceShard { .. } => collective_vjp(op, a, b),
        Op::RingShift { .. } | Op::RingSlice { .. } | Op::RingConcat { .. } => Err(PassDiag::unsupported(format!(
            "differentiating `{}` is not supported yet; `async-tp` writes it after `autodiff`, which differentiates the synchronous collectives",
            op.name()
        ))),
        Op::Constant { .. } => Ok(vec![]),
        Op::RmsNormBwd { .. } | Op::AttentionBwd { .. } | Op::CrossEntropyBwd | Op::CrossEntropyStatsBwd | Op::LrSchedule(_) | Op::AdamW(_) => {
            Err(PassDiag::unsupported(format!("differentiating `{}` is not supported", op.name())))
        }
        Op::Repeat { .. } => Err("invariant: repeat is differentiated by the region driver".into()),
        Op::Kernel { .. } => Err(PassDiag::precondition("differentiating a fused graph (`kernel` nodes) is not supported; differentiate before fusion")),
    }
}

/// The VJPs of the model-level ops (embedding, linear, norms, RoPE, attention, losses).
fn model_op_vjp(op: &Op, a: &VjpArgs, b: &mut Builder) -> Result<Vec<Option<Value>>, PassDiag> {
    let dims = b.ctx.dims;
    let none = |n: usize| vec![None; n];
    // Most rules need the cotangent of result 0.
    let dy0 = a.dy.first().copied().flatten();
    Ok(match op {
        Op::Embedding => {
            let Some(dy) = dy0 else { return Ok(none(2)) };
            let table = b.push_typed(Op::ScatterAdd, &[a.x(0), dy], a.x_ty[1].clone())?;
            vec![None, Some(table)]
        }
        Op::Gather => {
            let Some(dy) = dy0 else { return Ok(none(2)) };
            let table = b.push_typed(Op::ScatterAdd, &[a.x(1), dy], a.x_ty[0].clone())?;
            vec![Some(table), None]
        }
        Op::ScatterAdd => {
            let Some(dy) = dy0 else { return Ok(none(2)) };
            vec![None, Some(b.push1(Op::Gather, &[dy, a.x(0)])?)]
        }
        // The row shard's gather and scatter are each other's transposes, as the whole table's.
        Op::GatherShard => {
            let Some(dy) = dy0 else { return Ok(none(3)) };
            let table = b.push_typed(Op::ScatterAddShard, &[a.x(1), dy, a.x(2)], a.x_ty[0].clone())?;
            vec![Some(table), None, None]
        }
        Op::ScatterAddShard => {
            let Some(dy) = dy0 else { return Ok(none(3)) };
            vec![None, Some(b.push1(Op::GatherShard, &[dy, a.x(0), a.x(2)])?), None]
        }
        Op::Linear => {
            let Some(dy) = dy0 else { return Ok(none(2)) };
            let (x, w) = (a.x(0), a.x(1));
            let dx = b.push1(Op::Matmul { transpose_a: false, transpose_b: false }, &[dy, w])?;
            let (x2, dy2) = tokens_by_features(b, x, &a.x_ty[0], dy, dims)?;
            let dw = b.push1(Op::Matmul { transpose_a: true, transpose_b: false }, &[dy2, x2])?;
            vec![Some(dx), Some(dw)]
        }
        // Straight-through: the backward GEMMs quantize `dy` and the saved high-precision `x`
        // and `w` as the recipe says (see `titan_ir::float8`).
        Op::LinearF8 { recipe } => {
            let Some(dy) = dy0 else { return Ok(none(2)) };
            let (x, w) = (a.x(0), a.x(1));
            let dx = titan_ir::float8::grad_input(b, dy, w, *recipe)?;
            let (x2, dy2) = tokens_by_features(b, x, &a.x_ty[0], dy, dims)?;
            let dw = titan_ir::float8::grad_weight(b, dy2, x2, *recipe)?;
            vec![Some(dx), Some(dw)]
        }
        Op::RmsNorm { eps } => {
            let Some(dy) = dy0 else { return Ok(none(2)) };
            let r = b.push(Op::RmsNormBwd { eps: *eps }, &[a.x(0), a.x(1), dy])?;
            vec![Some(r[0]), Some(r[1])]
        }
        Op::Rope(cfg) => {
            let Some(dy) = dy0 else { return Ok(none(1)) };
            let inv = RopeConfig { inverse: !cfg.inverse, ..*cfg };
            vec![Some(b.push1(Op::Rope(inv), &[dy])?)]
        }
        Op::Attention { causal, scale } => {
            if a.dy.get(1).copied().flatten().is_some() {
                return Err(PassDiag::unsupported("differentiating through attention's logsumexp result is not supported yet"));
            }
            let Some(d_out) = dy0 else { return Ok(none(3)) };
            let r = b.push(Op::AttentionBwd { causal: *causal, scale: *scale }, &[a.x(0), a.x(1), a.x(2), a.y(0), a.y(1), d_out])?;
            vec![Some(r[0]), Some(r[1]), Some(r[2])]
        }
        Op::CrossEntropy => {
            let Some(dl) = dy0 else { return Ok(none(2)) };
            vec![Some(b.push1(Op::CrossEntropyBwd, &[a.x(0), a.x(1), dl])?), None]
        }
        // Vocabulary-parallel cross-entropy: the statistics' VJP is one op over the logits
        // shard (a result without a cotangent contributes zeros); `shard` is a constant one-hot.
        Op::CrossEntropyStats => {
            if a.dy.iter().all(Option::is_none) {
                return Ok(none(3));
            }
            let mut ds = Vec::with_capacity(3);
            for (d, ty) in a.dy.iter().zip(a.y_ty) {
                ds.push(match d {
                    Some(d) => *d,
                    None => b.push_typed(Op::Constant { value: 0.0 }, &[], ty.clone())?,
                });
            }
            let dx = b.push1(Op::CrossEntropyStatsBwd, &[a.x(0), a.x(1), a.x(2), ds[0], ds[1], ds[2]])?;
            vec![Some(dx), None, None]
        }
        // loss = mean over rows of `M + ln S - sum_r target_r` with `S = sum_r sumexp_r exp(max_r - M)`:
        // with `g = dloss / rows` and `q_r = exp(max_r - M) / S`, dsumexp = g q, dmax = g sumexp q
        // (the path through `M` is identically zero), dtarget = -g.
        Op::CrossEntropyCombine => {
            let Some(dl) = dy0 else { return Ok(none(3)) };
            let ty = a.x_ty[0].clone();
            let last = ty.rank().checked_sub(1).ok_or("cross_entropy_combine: the statistics must have a shard dim")?;
            let rows: u64 = ty.shape[..last]
                .iter()
                .map(|d| titan_ir::shape::resolve_dim(d, dims).ok_or_else(|| format!("unbound dimension `{d}`")))
                .product::<Result<u64, String>>()?;
            let lead: Vec<usize> = (0..last).collect();
            let (m, s) = (a.x(0), a.x(1));
            let big = b.push1(Op::Reduce { kind: ReduceKind::Max, axes: vec![last] }, &[m])?;
            let big = b.push_typed(Op::Broadcast { dims: lead.clone() }, &[big], ty.clone())?;
            let shifted = bin(b, BinaryOp::Sub, m, big)?;
            let e = un(b, UnaryOp::Exp, shifted)?;
            let w = bin(b, BinaryOp::Mul, s, e)?;
            let total = b.push1(Op::Reduce { kind: ReduceKind::Sum, axes: vec![last] }, &[w])?;
            let total = b.push_typed(Op::Broadcast { dims: lead }, &[total], ty.clone())?;
            let q = bin(b, BinaryOp::Div, e, total)?;
            let per_row = scalar(b, 1.0 / rows.max(1) as f64, DType::F32)?;
            let g = bin(b, BinaryOp::Mul, dl, per_row)?;
            let ds = bin(b, BinaryOp::Mul, q, g)?;
            let dm = bin(b, BinaryOp::Mul, s, ds)?;
            let neg = un(b, UnaryOp::Neg, g)?;
            let dt = b.push_typed(Op::Broadcast { dims: vec![] }, &[neg], ty)?;
            vec![Some(dm), Some(ds), Some(dt)]
        }
        _ => unreachable!("invariant: `vjp` routes only its ops to model_op_vjp"),
    })
}

/// The VJPs of elementwise ops and casts.
fn pointwise_vjp(op: &Op, a: &VjpArgs, b: &mut Builder) -> Result<Vec<Option<Value>>, PassDiag> {
    let none = |n: usize| vec![None; n];
    // Most rules need the cotangent of result 0.
    let dy0 = a.dy.first().copied().flatten();
    Ok(match op {
        Op::Unary(u) => {
            let Some(dy) = dy0 else { return Ok(none(1)) };
            let dt = a.x_ty[0].dtype;
            let dx = match u {
                UnaryOp::Neg => un(b, UnaryOp::Neg, dy)?,
                UnaryOp::Exp => bin(b, BinaryOp::Mul, dy, a.y(0))?,
                UnaryOp::Log => bin(b, BinaryOp::Div, dy, a.x(0))?,
                UnaryOp::Sqrt => {
                    let q = bin(b, BinaryOp::Div, dy, a.y(0))?;
                    let half = scalar(b, 0.5, dt)?;
                    bin(b, BinaryOp::Mul, q, half)?
                }
                UnaryOp::Rsqrt => {
                    // d/dx x^-1/2 = -1/2 y^3
                    let y = a.y(0);
                    let y2 = un(b, UnaryOp::Square, y)?;
                    let y3 = bin(b, BinaryOp::Mul, y2, y)?;
                    let c = scalar(b, -0.5, dt)?;
                    let s = bin(b, BinaryOp::Mul, y3, c)?;
                    bin(b, BinaryOp::Mul, dy, s)?
                }
                UnaryOp::Recip => {
                    let y2 = un(b, UnaryOp::Square, a.y(0))?;
                    let t = bin(b, BinaryOp::Mul, dy, y2)?;
                    un(b, UnaryOp::Neg, t)?
                }
                UnaryOp::Sigmoid => {
                    let y = a.y(0);
                    let one = scalar(b, 1.0, dt)?;
                    let om = bin(b, BinaryOp::Sub, one, y)?;
                    let s = bin(b, BinaryOp::Mul, y, om)?;
                    bin(b, BinaryOp::Mul, dy, s)?
                }
                UnaryOp::Silu => bin(b, BinaryOp::SiluGrad, a.x(0), dy)?,
                UnaryOp::Tanh => {
                    let y2 = un(b, UnaryOp::Square, a.y(0))?;
                    let one = scalar(b, 1.0, dt)?;
                    let s = bin(b, BinaryOp::Sub, one, y2)?;
                    bin(b, BinaryOp::Mul, dy, s)?
                }
                UnaryOp::Abs => {
                    // sign(x) = x / max(|x|, tiny): 0 at 0
                    let tiny = scalar(b, 1e-30, dt)?;
                    let den = bin(b, BinaryOp::Max, a.y(0), tiny)?;
                    let sign = bin(b, BinaryOp::Div, a.x(0), den)?;
                    bin(b, BinaryOp::Mul, dy, sign)?
                }
                UnaryOp::Square => {
                    let two = scalar(b, 2.0, dt)?;
                    let t = bin(b, BinaryOp::Mul, a.x(0), two)?;
                    bin(b, BinaryOp::Mul, dy, t)?
                }
            };
            vec![Some(dx)]
        }
        Op::Binary(bo) => {
            let Some(dy) = dy0 else { return Ok(none(2)) };
            let (ta, tb) = (&a.x_ty[0], &a.x_ty[1]);
            let (da, db) = match bo {
                BinaryOp::Add => (dy, dy),
                BinaryOp::Sub => (dy, un(b, UnaryOp::Neg, dy)?),
                BinaryOp::Mul => (bin(b, BinaryOp::Mul, dy, a.x(1))?, bin(b, BinaryOp::Mul, dy, a.x(0))?),
                BinaryOp::Div => {
                    let da = bin(b, BinaryOp::Div, dy, a.x(1))?;
                    let t = bin(b, BinaryOp::Mul, dy, a.y(0))?;
                    let t = bin(b, BinaryOp::Div, t, a.x(1))?;
                    (da, un(b, UnaryOp::Neg, t)?)
                }
                BinaryOp::Pow => {
                    // d/da = b * y / a ; d/db = y * log(a)
                    let t = bin(b, BinaryOp::Mul, a.y(0), a.x(1))?;
                    let t = bin(b, BinaryOp::Div, t, a.x(0))?;
                    let da = bin(b, BinaryOp::Mul, dy, t)?;
                    let la = un(b, UnaryOp::Log, a.x(0))?;
                    let t = bin(b, BinaryOp::Mul, a.y(0), la)?;
                    (da, bin(b, BinaryOp::Mul, dy, t)?)
                }
                BinaryOp::Max | BinaryOp::Min | BinaryOp::SiluGrad => {
                    return Err(PassDiag::unsupported(format!("differentiating `{}` is not supported yet", bo.name())));
                }
            };
            vec![Some(unbroadcast(b, da, ta)?), Some(unbroadcast(b, db, tb)?)]
        }
        Op::Cast => {
            let Some(dy) = dy0 else { return Ok(none(1)) };
            if a.x_ty[0].dtype.is_int() {
                return Ok(none(1));
            }
            vec![Some(b.push_typed(Op::Cast, &[dy], a.x_ty[0].clone())?)]
        }
        _ => unreachable!("invariant: `vjp` routes only its ops to pointwise_vjp"),
    })
}

/// The VJPs of reshapes, transposes, reductions and broadcasts.
fn layout_vjp(op: &Op, a: &VjpArgs, b: &mut Builder) -> Result<Vec<Option<Value>>, PassDiag> {
    let dims = b.ctx.dims;
    let none = |n: usize| vec![None; n];
    // Most rules need the cotangent of result 0.
    let dy0 = a.dy.first().copied().flatten();
    Ok(match op {
        Op::Reshape => {
            let Some(dy) = dy0 else { return Ok(none(1)) };
            vec![Some(b.push_typed(Op::Reshape, &[dy], a.x_ty[0].clone())?)]
        }
        // The VJP of a slice places `dy` between zeros; the VJP of a concat slices `dy`.
        Op::Slice { axis, start, len } => {
            let Some(dy) = dy0 else { return Ok(none(1)) };
            let x_ty = &a.x_ty[0];
            let ax = *axis as usize;
            let n = titan_ir::shape::resolve_dim(&x_ty.shape[ax], dims).ok_or_else(|| format!("unbound dimension `{}`", x_ty.shape[ax]))?;
            let mut parts = Vec::new();
            for (from, size) in [(0, *start), (*start, *len), (start + len, n - start - len)] {
                if size == 0 {
                    continue;
                }
                if from == *start {
                    parts.push(dy);
                } else {
                    let mut zeros_ty = x_ty.clone();
                    zeros_ty.shape[ax] = titan_ir::Dim::Fixed(size);
                    parts.push(b.push_typed(Op::Constant { value: 0.0 }, &[], zeros_ty)?);
                }
            }
            vec![Some(if parts.len() == 1 { dy } else { b.push1(Op::Concat { axis: *axis }, &parts)? })]
        }
        Op::Concat { axis } => {
            let Some(dy) = dy0 else { return Ok(none(a.x_ty.len())) };
            let ax = *axis as usize;
            let mut start = 0;
            let mut out = Vec::with_capacity(a.x_ty.len());
            for t in a.x_ty {
                let len = titan_ir::shape::resolve_dim(&t.shape[ax], dims).ok_or_else(|| format!("unbound dimension `{}`", t.shape[ax]))?;
                out.push(Some(b.push1(Op::Slice { axis: *axis, start, len }, &[dy])?));
                start += len;
            }
            out
        }
        Op::Transpose { perm } => {
            let Some(dy) = dy0 else { return Ok(none(1)) };
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            vec![Some(b.push1(Op::Transpose { perm: inv }, &[dy])?)]
        }
        Op::Reduce { kind, axes } => {
            let Some(dy) = dy0 else { return Ok(none(1)) };
            let x_ty = &a.x_ty[0];
            let keep: Vec<usize> = (0..x_ty.rank()).filter(|i| !axes.contains(i)).collect();
            let g = match kind {
                ReduceKind::Sum => dy,
                ReduceKind::Mean => {
                    let n: u64 = axes
                        .iter()
                        .map(|&ax| titan_ir::shape::resolve_dim(&x_ty.shape[ax], dims).ok_or_else(|| format!("unbound dimension `{}`", x_ty.shape[ax])))
                        .product::<Result<u64, String>>()?;
                    let c = scalar(b, 1.0 / n as f64, x_ty.dtype)?;
                    bin(b, BinaryOp::Mul, dy, c)?
                }
                ReduceKind::Max => return Err(PassDiag::unsupported("differentiating `reduce_max` is not supported yet")),
            };
            vec![Some(b.push_typed(Op::Broadcast { dims: keep }, &[g], x_ty.clone())?)]
        }
        Op::Broadcast { dims: map } => {
            let Some(dy) = dy0 else { return Ok(none(1)) };
            let x_ty = &a.x_ty[0];
            let out_ty = &a.y_ty[0];
            let mut axes = Vec::new();
            for o in 0..out_ty.rank() {
                match map.iter().position(|&m| m == o) {
                    None => axes.push(o),
                    Some(i) => {
                        let xi = titan_ir::shape::resolve_dim(&x_ty.shape[i], dims);
                        let oi = titan_ir::shape::resolve_dim(&out_ty.shape[o], dims);
                        if xi == Some(1) && oi != Some(1) {
                            axes.push(o);
                        }
                    }
                }
            }
            let r = if axes.is_empty() { dy } else { b.push1(Op::Reduce { kind: ReduceKind::Sum, axes }, &[dy])? };
            vec![Some(b.push_typed(Op::Reshape, &[r], x_ty.clone())?)]
        }
        _ => unreachable!("invariant: `vjp` routes only its ops to layout_vjp"),
    })
}

/// The VJPs of `matmul` (either operand transposed, batched or shared).
fn matmul_vjp(op: &Op, a: &VjpArgs, b: &mut Builder) -> Result<Vec<Option<Value>>, PassDiag> {
    let dims = b.ctx.dims;
    let none = |n: usize| vec![None; n];
    // Most rules need the cotangent of result 0.
    let dy0 = a.dy.first().copied().flatten();
    Ok(match op {
        Op::Matmul { transpose_a: ta, transpose_b: tb } => {
            let Some(dy) = dy0 else { return Ok(none(2)) };
            let (ra, rb) = (a.x_ty[0].rank(), a.x_ty[1].rank());
            let (x, w) = (a.x(0), a.x(1));
            let mm = |b: &mut Builder, ta: bool, tb: bool, l: Value, r: Value| b.push1(Op::Matmul { transpose_a: ta, transpose_b: tb }, &[l, r]);
            let da = if !*ta {
                mm(b, false, !*tb, dy, w)?
            } else if ra == 2 || rb > 2 {
                mm(b, *tb, true, w, dy)?
            } else {
                return Err(PassDiag::unsupported("differentiating a transposed batched matmul with a shared 2-d rhs is not supported yet"));
            };
            let db = if rb > 2 || ra == 2 {
                if *tb { mm(b, true, *ta, dy, x)? } else { mm(b, !*ta, false, x, dy)? }
            } else if !*ta {
                // 2-d rhs shared across the batch: flatten the batch into rows.
                let x2 = b.push_typed(Op::Reshape, &[x], flatten_leading(&a.x_ty[0], dims)?)?;
                let dy_ty = b.ty(dy).clone();
                let dy2 = b.push_typed(Op::Reshape, &[dy], flatten_leading(&dy_ty, dims)?)?;
                if *tb { mm(b, true, false, dy2, x2)? } else { mm(b, true, false, x2, dy2)? }
            } else {
                return Err(PassDiag::unsupported("differentiating a transposed batched matmul with a shared 2-d rhs is not supported yet"));
            };
            vec![Some(da), Some(db)]
        }
        _ => unreachable!("invariant: `vjp` routes only its ops to matmul_vjp"),
    })
}

/// The VJPs of collectives and rank-local shard slicing (the SPMD cotangent convention of docs/ir.md).
fn collective_vjp(op: &Op, a: &VjpArgs, b: &mut Builder) -> Result<Vec<Option<Value>>, PassDiag> {
    let none = |n: usize| vec![None; n];
    // Most rules need the cotangent of result 0.
    let dy0 = a.dy.first().copied().flatten();
    Ok(match op {
        // Collectives, with the SPMD cotangent convention: a rank's cotangent of a value is its
        // contribution to the true gradient, which is the sum over ranks (a replicated value's
        // cotangent is `Partial`). So all_gather and reduce_scatter are each other's VJP and
        // the VJP of a sum all-reduce is a sum all-reduce.
        Op::AllGather { mesh_dim, dim, size } => {
            let Some(dy) = dy0 else { return Ok(none(1)) };
            let rs = Op::ReduceScatter { mesh_dim: *mesh_dim, dim: *dim, size: *size, reduce: CollectiveReduce::Sum };
            vec![Some(b.push1(rs, &[dy])?)]
        }
        Op::ReduceScatter { mesh_dim, dim, size, .. } => {
            let Some(dy) = dy0 else { return Ok(none(1)) };
            vec![Some(b.push1(Op::AllGather { mesh_dim: *mesh_dim, dim: *dim, size: *size }, &[dy])?)]
        }
        Op::AllReduce { mesh_dim, reduce: CollectiveReduce::Sum } => {
            let Some(dy) = dy0 else { return Ok(none(1)) };
            vec![Some(b.push1(Op::AllReduce { mesh_dim: *mesh_dim, reduce: CollectiveReduce::Sum }, &[dy])?)]
        }
        // Rank-local slicing is linear and local: its VJP is its adjoint on the same rank.
        Op::TakeShard { mesh_dim, dim, size } => {
            let Some(dy) = dy0 else { return Ok(none(1)) };
            vec![Some(b.push1(Op::PlaceShard { mesh_dim: *mesh_dim, dim: *dim, size: *size }, &[dy])?)]
        }
        Op::PlaceShard { mesh_dim, dim, size } => {
            let Some(dy) = dy0 else { return Ok(none(1)) };
            vec![Some(b.push1(Op::TakeShard { mesh_dim: *mesh_dim, dim: *dim, size: *size }, &[dy])?)]
        }
        Op::AllReduce { reduce: CollectiveReduce::Max, .. } => {
            return Err(PassDiag::unsupported("differentiating `all_reduce` with `reduce = max` is not supported yet"));
        }
        _ => unreachable!("invariant: `vjp` routes only its ops to collective_vjp"),
    })
}

/// Whether gradients flow into values of this dtype.
pub fn differentiable(dt: DType) -> bool {
    dt.is_float()
}
