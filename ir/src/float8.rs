//! What a float8 recipe means, written once as the primitive ops it expands to: the forward of
//! `linear_f8` ([`forward`]) and the two backward GEMMs its VJP emits ([`grad_input`],
//! [`grad_weight`]). The interpreter evaluates `linear_f8` through [`forward`], `autodiff`
//! expands it with [`forward`] and differentiates it with the other two, so the three agree by
//! construction.
//!
//! Shapes: `x [..., M, K]` (tokens × in), `w [N, K]`, `dy [..., M, N]`; the GEMMs are
//! `y = x·wᵀ`, `dx = dy·w`, `dw = dyᵀ·x` (the last over `x` and `dy` flattened to 2-D).
//!
//! | recipe | output (fast accumulation) | grad_input | grad_weight | power-of-2 scales |
//! |---|---|---|---|---|
//! | `rowwise` | x e4m3 per row, w e4m3 per output row | dy e4m3 per row, w e4m3 per input column | dy, x e4m3 per column | yes |
//! | `rowwise_with_gw_hp` | as `rowwise` | dy e4m3 per row, w e4m3 tensorwise | high precision | yes |
//! | `tensorwise` | x, w e4m3, one scale each | dy e5m2, w e4m3 | dy e5m2, x e4m3 | no |
//!
//! Quantizing `x` along `axis` (torchao's `hp_tensor_to_float8_dynamic`):
//! `amax = reduce_max(abs(x))` over `axis` (all axes when tensorwise), `s = fp8_scale(amax)`,
//! `q = cast<f8>(min(max(f32(x) · s, -fp8_max), fp8_max))`; the GEMM receives `recip(s)`.
//!
//! Every `scaled_matmul` this module emits is "TN": `a [M, K]` and `b [N, K]` (contracted over
//! their last axis, `transpose_a = false, transpose_b = true`), the only layout Hopper's fp8
//! tensor-core GEMMs (cuBLASLt) accept. The backward GEMMs contract `w` over its first axis and
//! `dy`, `x` over the tokens, so their quantized operands are transposed after the cast
//! ([`transposed`]): the scales are those of the untransposed operand (per input column of
//! `w` = per row of `wᵀ`), and fusion puts the `transpose` in the quantizing kernel, which
//! stores the fp8 values in the transposed layout; no separate transpose kernel runs.

use crate::dtype::DType;
use crate::graph::{Builder, NodeId, Region, Value, ValueDef};
use crate::op::{BinaryOp, Float8Recipe, Op, ReduceKind, UnaryOp};
use crate::shape::TensorType;

/// Which elements share one scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scaling {
    /// One scale for the whole tensor.
    Tensor,
    /// One scale per slice along every axis but this one: the amax is taken over `axis`.
    Over(usize),
}

/// How one GEMM operand is quantized: the fp8 dtype and the scaling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OperandScaling {
    pub dtype: DType,
    pub scaling: Scaling,
}

/// An fp8 operand and the reciprocal of its scale (what the GEMM multiplies by).
#[derive(Clone, Copy, Debug)]
pub struct Quantized {
    pub q: Value,
    pub inv_scale: Value,
}

/// Whether `recipe` rounds its scales down to a power of two (torchao's
/// `round_scales_to_power_of_2`, on for the rowwise recipes).
pub fn pow2_scales(recipe: Float8Recipe) -> bool {
    !matches!(recipe, Float8Recipe::Tensorwise)
}

fn e4m3(scaling: Scaling) -> OperandScaling {
    OperandScaling { dtype: DType::F8E4M3, scaling }
}

/// The operand scalings of the three GEMMs, for operands of rank `x_rank` (`x`, `dy`) and
/// the 2-D `w`: `(output, grad_input, grad_weight)`, each `(lhs, rhs)`; `grad_weight` is `None`
/// when the recipe keeps it in high precision. The axes of `grad_weight` refer to the 2-D
/// flattened `dy` and `x`.
#[allow(clippy::type_complexity)]
pub fn scalings(
    recipe: Float8Recipe,
    x_rank: usize,
) -> ((OperandScaling, OperandScaling), (OperandScaling, OperandScaling), Option<(OperandScaling, OperandScaling)>) {
    let last = x_rank.saturating_sub(1);
    match recipe {
        Float8Recipe::Rowwise => (
            (e4m3(Scaling::Over(last)), e4m3(Scaling::Over(1))),
            (e4m3(Scaling::Over(last)), e4m3(Scaling::Over(0))),
            Some((e4m3(Scaling::Over(0)), e4m3(Scaling::Over(0)))),
        ),
        Float8Recipe::RowwiseWithGwHp => ((e4m3(Scaling::Over(last)), e4m3(Scaling::Over(1))), (e4m3(Scaling::Over(last)), e4m3(Scaling::Tensor)), None),
        Float8Recipe::Tensorwise => {
            let e5m2 = OperandScaling { dtype: DType::F8E5M2, scaling: Scaling::Tensor };
            ((e4m3(Scaling::Tensor), e4m3(Scaling::Tensor)), (e5m2, e4m3(Scaling::Tensor)), Some((e5m2, e4m3(Scaling::Tensor))))
        }
    }
}

/// Quantize `x` to `how.dtype` with `how.scaling` (see the module documentation).
pub fn quantize(b: &mut Builder, x: Value, how: OperandScaling, pow2: bool) -> Result<Quantized, String> {
    let ty = b.ty(x).clone();
    let max = f64::from(crate::fp8::fp8_max(how.dtype).ok_or_else(|| format!("quantize: {} is not an fp8 dtype", how.dtype))?);
    let rank = ty.rank();
    let abs = b.push1(Op::Unary(UnaryOp::Abs), &[x])?;
    let axes: Vec<usize> = match how.scaling {
        Scaling::Tensor => (0..rank).collect(),
        Scaling::Over(a) if a < rank => vec![a],
        Scaling::Over(a) => return Err(format!("quantize: axis {a} is out of range for {ty}")),
    };
    let amax = b.push1(Op::Reduce { kind: ReduceKind::Max, axes: axes.clone() }, &[abs])?;
    let scale = b.push1(Op::Fp8Scale { dtype: how.dtype, pow2 }, &[amax])?;
    let f32_ty = TensorType::new(DType::F32, ty.shape.clone());
    let xf = if ty.dtype == DType::F32 { x } else { b.push_typed(Op::Cast, &[x], f32_ty.clone())? };
    let wide = match how.scaling {
        Scaling::Tensor => scale,
        Scaling::Over(a) => b.push_typed(Op::Broadcast { dims: (0..rank).filter(|&d| d != a).collect() }, &[scale], f32_ty.clone())?,
    };
    let scaled = b.push1(Op::Binary(BinaryOp::Mul), &[xf, wide])?;
    let lo = b.push_typed(Op::Constant { value: -max }, &[], TensorType::scalar(DType::F32))?;
    let hi = b.push_typed(Op::Constant { value: max }, &[], TensorType::scalar(DType::F32))?;
    let clamped = b.push1(Op::Binary(BinaryOp::Max), &[scaled, lo])?;
    let clamped = b.push1(Op::Binary(BinaryOp::Min), &[clamped, hi])?;
    let q = b.push_typed(Op::Cast, &[clamped], TensorType::new(how.dtype, ty.shape.clone()))?;
    let inv_scale = b.push1(Op::Unary(UnaryOp::Recip), &[scale])?;
    Ok(Quantized { q, inv_scale })
}

/// A tensor-scaled quantization as [`quantize`] emits it, found by [`match_tensor_quantize`]:
/// `amax = reduce_max(abs(x))` over every axis, `scale = fp8_scale(amax)`,
/// `q = cast<dtype>(min(max(f32(x) · scale, lo), hi))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorQuantize {
    /// The high-precision operand.
    pub x: Value,
    /// The `reduce_max` node and its result.
    pub amax_node: NodeId,
    pub amax: Value,
    /// The `fp8_scale` result.
    pub scale: Value,
    /// The clamp bounds (`constant`s).
    pub lo: Value,
    pub hi: Value,
    /// The final `cast` node, its fp8 result and dtype.
    pub cast_node: NodeId,
    pub q: Value,
    pub dtype: DType,
}

/// Any quantization as [`quantize`] emits it, found by [`match_quantize`]: the tensor-scaled
/// fields, the scaling, and every node of the chain from `x` to `q` in order (`abs`,
/// `reduce_max`, `fp8_scale`, the `cast` of `x` to f32 unless `x` is f32, the `broadcast` of
/// the scale unless tensor-scaled, `mul`, `max`, `min`, `cast`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatchedQuantize {
    pub tensor: TensorQuantize,
    pub scaling: Scaling,
    pub nodes: Vec<NodeId>,
}

/// Whether `cast_node` ends a tensor-scaled quantization of the exact shape [`quantize`] emits
/// (what `float8-fsdp-gather` rewrites; keeping the matcher next to the emitter keeps them in
/// step, and a test checks that every tensor-scaled `quantize` is matched).
pub fn match_tensor_quantize(r: &Region, cast_node: NodeId) -> Option<TensorQuantize> {
    match_quantize(r, cast_node).filter(|m| m.scaling == Scaling::Tensor).map(|m| m.tensor)
}

/// Whether `cast_node` ends a quantization of the exact shape [`quantize`] emits, tensor-scaled
/// or along one axis (what `async-tp` moves before a tp all-gather; a test checks that every
/// `quantize` is matched).
pub fn match_quantize(r: &Region, cast_node: NodeId) -> Option<MatchedQuantize> {
    let def = |v: Value| match r.value(v).def {
        ValueDef::Result { node, index: 0 } => Some((node, r.node(node))),
        _ => None,
    };
    let q_node = r.node(cast_node);
    if !matches!(q_node.op, Op::Cast) || q_node.inputs.len() != 1 || q_node.results.len() != 1 {
        return None;
    }
    let q = q_node.results[0];
    let dtype = r.ty(q).dtype;
    crate::fp8::fp8_max(dtype)?;
    let (min_node, min) = def(q_node.inputs[0])?;
    let (max_node, max) = def(min.inputs.first().copied()?)?;
    if min.op != Op::Binary(BinaryOp::Min) || max.op != Op::Binary(BinaryOp::Max) {
        return None;
    }
    let (hi, lo) = (min.inputs[1], max.inputs[1]);
    let is_const = |v: Value| def(v).is_some_and(|(_, n)| matches!(n.op, Op::Constant { .. }));
    if !is_const(hi) || !is_const(lo) {
        return None;
    }
    let (mul_node, mul) = def(max.inputs[0])?;
    if mul.op != Op::Binary(BinaryOp::Mul) {
        return None;
    }
    let (xf, wide) = (mul.inputs[0], mul.inputs[1]);
    // The scale itself (tensor-scaled), or broadcast along every axis but one.
    let (broadcast_node, scale) = match def(wide) {
        Some((n, b)) if matches!(b.op, Op::Broadcast { .. }) => (Some(n), b.inputs[0]),
        _ => (None, wide),
    };
    let (scale_node, sc) = def(scale)?;
    if !matches!(sc.op, Op::Fp8Scale { dtype: d, .. } if d == dtype) {
        return None;
    }
    let amax = sc.inputs[0];
    let (amax_node, red) = def(amax)?;
    let (abs_node, abs) = def(red.inputs[0])?;
    if abs.op != Op::Unary(UnaryOp::Abs) {
        return None;
    }
    let x = abs.inputs[0];
    let rank = r.ty(x).rank();
    let scaling = match (&red.op, broadcast_node.map(|n| &r.node(n).op)) {
        (Op::Reduce { kind: ReduceKind::Max, axes }, None) if *axes == (0..rank).collect::<Vec<_>>() => Scaling::Tensor,
        (Op::Reduce { kind: ReduceKind::Max, axes }, Some(Op::Broadcast { dims })) if axes.len() == 1 && axes[0] < rank => {
            let a = axes[0];
            if *dims != (0..rank).filter(|&d| d != a).collect::<Vec<_>>() {
                return None;
            }
            Scaling::Over(a)
        }
        _ => return None,
    };
    let cast_of_x = def(xf).filter(|(_, n)| n.op == Op::Cast && n.inputs[0] == x).map(|(n, _)| n);
    if !(xf == x && r.ty(x).dtype == DType::F32 || cast_of_x.is_some()) {
        return None;
    }
    let mut nodes = vec![abs_node, amax_node, scale_node];
    nodes.extend(cast_of_x);
    nodes.extend(broadcast_node);
    nodes.extend([mul_node, max_node, min_node, cast_node]);
    Some(MatchedQuantize { tensor: TensorQuantize { x, amax_node, amax, scale, lo, hi, cast_node, q, dtype }, scaling, nodes })
}

/// `q`'s fp8 values transposed (2-D): the K-major copy a TN GEMM reads.
fn transposed(b: &mut Builder, q: Quantized) -> Result<Quantized, String> {
    let t = b.push1(Op::Transpose { perm: vec![1, 0] }, &[q.q])?;
    Ok(Quantized { q: t, inv_scale: q.inv_scale })
}

/// The TN `scaled_matmul` (`a [.., M, K]`, `bq [N, K]`) of two quantized operands, producing
/// `out`'s dtype.
///
/// With power-of-2 scales (`pow2`), per-row or per-column scales are not given to the GEMM:
/// it runs with unit scales in their place and the scales multiply its rounded output
/// afterwards (`y = f32(gemm) · sa[row] · sb[col]`, back to `out`'s dtype), in ops that fusion
/// puts into the kernel consuming the product. Hopper's cuBLASLt takes only scalar fp8 scales
/// (`docs/notes.md`, "Float8"), and a power of two commutes with rounding: `round(acc) · 2^e
/// = round(acc · 2^e)` unless the result leaves the normal range, so the values are the
/// vector-scaled GEMM's. Scalar scales stay in the GEMM.
fn scaled_gemm(b: &mut Builder, a: Quantized, bq: Quantized, fast_accum: bool, pow2: bool, out: TensorType) -> Result<Value, String> {
    let vector = |b: &Builder, s: Value| b.ty(s).rank() > 0;
    let (va, vb) = (vector(b, a.inv_scale), vector(b, bq.inv_scale));
    if !pow2 || !(va || vb) {
        return b.push_typed(Op::ScaledMatmul { transpose_a: false, transpose_b: true, fast_accum }, &[a.q, bq.q, a.inv_scale, bq.inv_scale], out);
    }
    let one = b.push_typed(Op::Constant { value: 1.0 }, &[], TensorType::scalar(DType::F32))?;
    let (sa, sb) = (if va { one } else { a.inv_scale }, if vb { one } else { bq.inv_scale });
    let y = b.push_typed(Op::ScaledMatmul { transpose_a: false, transpose_b: true, fast_accum }, &[a.q, bq.q, sa, sb], out.clone())?;
    let rank = out.rank();
    let wide = TensorType::new(DType::F32, out.shape.clone());
    let mut acc = if out.dtype == DType::F32 { y } else { b.push_typed(Op::Cast, &[y], wide.clone())? };
    if va {
        let rows = b.push_typed(Op::Broadcast { dims: (0..rank - 1).collect() }, &[a.inv_scale], wide.clone())?;
        acc = b.push1(Op::Binary(BinaryOp::Mul), &[acc, rows])?;
    }
    if vb {
        let cols = b.push_typed(Op::Broadcast { dims: vec![rank - 1] }, &[bq.inv_scale], wide)?;
        acc = b.push1(Op::Binary(BinaryOp::Mul), &[acc, cols])?;
    }
    if out.dtype == DType::F32 { Ok(acc) } else { b.push_typed(Op::Cast, &[acc], out) }
}

/// The forward of `linear_f8(x, w)` as primitives: `y [..., N]` in `x`'s dtype.
pub fn forward(b: &mut Builder, x: Value, w: Value, recipe: Float8Recipe) -> Result<Value, String> {
    let (xt, wt) = (b.ty(x).clone(), b.ty(w).clone());
    let ((sx, sw), _, _) = scalings(recipe, xt.rank());
    let pow2 = pow2_scales(recipe);
    let qx = quantize(b, x, sx, pow2)?;
    let qw = quantize(b, w, sw, pow2)?;
    let mut shape = xt.shape.clone();
    *shape.last_mut().ok_or("linear_f8 input must have rank >= 1")? = wt.shape[0].clone();
    scaled_gemm(b, qx, qw, true, pow2, TensorType::new(xt.dtype, shape))
}

/// `grad_input = dy · w` of `linear_f8` under `recipe`: `dx [..., K]` in `dy`'s dtype.
pub fn grad_input(b: &mut Builder, dy: Value, w: Value, recipe: Float8Recipe) -> Result<Value, String> {
    let (dyt, wt) = (b.ty(dy).clone(), b.ty(w).clone());
    let (_, (sdy, sw), _) = scalings(recipe, dyt.rank());
    let pow2 = pow2_scales(recipe);
    let qdy = quantize(b, dy, sdy, pow2)?;
    let qw = quantize(b, w, sw, pow2)?;
    // `dy [.., N] · w [N, K]` as the TN `dy · (wᵀ [K, N])ᵀ`.
    let qwt = transposed(b, qw)?;
    let mut shape = dyt.shape.clone();
    *shape.last_mut().ok_or("linear_f8 gradient must have rank >= 1")? = wt.shape[1].clone();
    scaled_gemm(b, qdy, qwt, false, pow2, TensorType::new(dyt.dtype, shape))
}

/// `grad_weight = dyᵀ · x` of `linear_f8` under `recipe`, from the 2-D `dy [M, N]` and
/// `x [M, K]`: `dw [N, K]` in `x`'s dtype.
pub fn grad_weight(b: &mut Builder, dy: Value, x: Value, recipe: Float8Recipe) -> Result<Value, String> {
    let (dyt, xt) = (b.ty(dy).clone(), b.ty(x).clone());
    if dyt.rank() != 2 || xt.rank() != 2 {
        return Err(format!("linear_f8 grad_weight takes 2-D dy and x, found {dyt} and {xt}"));
    }
    match scalings(recipe, 2).2 {
        None => b.push1(Op::Matmul { transpose_a: true, transpose_b: false }, &[dy, x]),
        Some((sdy, sx)) => {
            let pow2 = pow2_scales(recipe);
            let qdy = quantize(b, dy, sdy, pow2)?;
            let qx = quantize(b, x, sx, pow2)?;
            // `dyᵀ [N, M] · x [M, K]` as the TN `(dyᵀ [N, M]) · (xᵀ [K, M])ᵀ`.
            let (qdyt, qxt) = (transposed(b, qdy)?, transposed(b, qx)?);
            let out = TensorType::new(xt.dtype, vec![dyt.shape[1].clone(), xt.shape[1].clone()]);
            scaled_gemm(b, qdyt, qxt, false, pow2, out)
        }
    }
}

/// `fp8_scale`'s value for one amax: `fp8_max / max(amax, 1e-12)` in f64, rounded to f32, then
/// (with `pow2`) down to a power of two. NaN stays NaN; an infinite amax gives 0.
pub fn scale_of(amax: f64, fp8_max: f32, pow2: bool) -> f32 {
    if amax.is_nan() {
        return f32::NAN;
    }
    let s = (f64::from(fp8_max) / amax.max(1e-12)) as f32;
    if !pow2 || s == 0.0 || !s.is_finite() {
        return s;
    }
    if s.is_normal() {
        // Clearing the mantissa of a positive normal float is exactly 2^floor(log2(s)).
        f32::from_bits(s.to_bits() & 0xff80_0000)
    } else {
        // A subnormal: the largest power of two not above it.
        let mut p = f32::from_bits(1);
        while p * 2.0 <= s {
            p *= 2.0;
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_quantize_is_matched_and_axis_quantize_is_not() {
        use crate::shape::Dim;
        let dims = crate::shape::DimTable::new();
        let mut r = Region::new("r");
        let x = r.add_arg(TensorType::new(DType::BF16, vec![Dim::Fixed(32), Dim::Fixed(16)]), crate::graph::ArgKind::Input, Some("x"));
        let mut b = Builder::new(&mut r, &dims, &[]);
        let tw = quantize(&mut b, x, e4m3(Scaling::Tensor), false).expect("tensorwise");
        let rw = quantize(&mut b, x, e4m3(Scaling::Over(1)), true).expect("rowwise");
        let cast_of = |r: &Region, v: Value| match r.value(v).def {
            ValueDef::Result { node, .. } => node,
            ValueDef::Arg(_) => unreachable!("a quantized value is a node result"),
        };
        let m = match_tensor_quantize(&r, cast_of(&r, tw.q)).expect("the tensor-scaled quantize matches");
        assert_eq!((m.x, m.q, m.dtype), (x, tw.q, DType::F8E4M3));
        let ValueDef::Result { node: recip, .. } = r.value(tw.inv_scale).def else { unreachable!("recip is a node") };
        assert_eq!(r.node(recip).inputs[0], m.scale);
        assert_eq!(match_tensor_quantize(&r, cast_of(&r, rw.q)), None, "a per-row quantize is not tensor-scaled");
        let m = match_quantize(&r, cast_of(&r, rw.q)).expect("the per-row quantize matches");
        assert_eq!((m.tensor.x, m.tensor.q, m.scaling), (x, rw.q, Scaling::Over(1)));
        // abs, reduce_max, fp8_scale, cast to f32, broadcast, mul, max, min, cast.
        assert_eq!(m.nodes.len(), 9);
        assert_eq!(m.nodes.last(), Some(&cast_of(&r, rw.q)));
        assert_eq!(match_quantize(&r, cast_of(&r, tw.q)).map(|m| (m.scaling, m.nodes.len())), Some((Scaling::Tensor, 8)));
    }

    #[test]
    fn scales_follow_torchao() {
        // 448 / 3 = 149.33..: rounded down to 128 with pow2.
        assert_eq!(scale_of(3.0, 448.0, false), (448.0f64 / 3.0) as f32);
        assert_eq!(scale_of(3.0, 448.0, true), 128.0);
        assert_eq!(scale_of(448.0, 448.0, true), 1.0);
        assert_eq!(scale_of(449.0, 448.0, true), 0.5);
        // A zero amax is clamped to 1e-12.
        assert_eq!(scale_of(0.0, 448.0, false), (448.0f64 / 1e-12) as f32);
        assert_eq!(scale_of(0.0, 448.0, true), 2f32.powi(48));
        assert!(scale_of(f64::NAN, 448.0, true).is_nan());
        assert_eq!(scale_of(f64::INFINITY, 57344.0, true), 0.0);
        // pow2 rounding is 2^floor(log2(s)) for every normal scale.
        for amax in [1e-30, 1e-6, 0.37, 1.0, 2.5, 1e3, 7e30, f64::from(f32::MAX)] {
            let s = scale_of(amax, 448.0, false);
            let p = scale_of(amax, 448.0, true);
            assert_eq!(p, 2f64.powi(f64::from(s).log2().floor() as i32) as f32, "amax {amax}");
        }
        // 448 / 1e41 is subnormal in f32: the power of two below it is 2^-128.
        assert_eq!(scale_of(1e41, 448.0, true), f32::from_bits(1 << 21));
    }
}
