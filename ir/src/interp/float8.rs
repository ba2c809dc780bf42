//! The float8 ops on host tensors: `fp8_scale`, `scaled_matmul`, and `linear_f8`, which is
//! evaluated as the primitives [`crate::float8::forward`] expands it to (so the reference and
//! the expanded graph compute the same values by construction).

use crate::dtype::DType;
use crate::graph::{ArgKind, Builder, Region, ValueDef};
use crate::interp::Precision;
use crate::interp::linalg;
use crate::interp::ops::{ResultType, eval_op, float_result, floats};
use crate::interp::tensor::{Real, Tensor, shape_str};
use crate::op::Float8Recipe;
use crate::shape::{Dim, DimTable, TensorType};

/// `fp8_max(dtype) / max(amax, 1e-12)` per element (see [`crate::float8::scale_of`]).
pub(crate) fn fp8_scale<T: Real>(amax: &Tensor<T>, dtype: DType, pow2: bool, rt: &ResultType) -> Result<Tensor<T>, String> {
    let xs = floats(amax, "fp8_scale amax")?;
    let max = crate::fp8::fp8_max(dtype).ok_or_else(|| format!("fp8_scale: {dtype} is not an fp8 dtype"))?;
    let out = xs.iter().map(|&a| T::from_f64(f64::from(crate::float8::scale_of(a.to_f64(), max, pow2)))).collect();
    float_result(rt, amax.shape.clone(), out)
}

/// `(a · b) * sa[row] * sb[col]`: the product accumulated in `T` (f32 for the reference), then
/// the row scale, then the column scale, each a rounding in `T`.
pub(crate) fn scaled_matmul<T: Real>(x: &[&Tensor<T>], ta: bool, tb: bool, rt: &ResultType) -> Result<Tensor<T>, String> {
    let (a, b, sa, sb) = (x[0], x[1], x[2], x[3]);
    let wide: ResultType = (DType::F32, rt.1.clone());
    let acc = linalg::matmul(a, b, ta, tb, &wide)?;
    let mut data = floats(&acc, "scaled_matmul product")?.to_vec();
    let n = *acc.shape.last().ok_or("scaled_matmul result has rank 0")?;
    let rows = data.len() / n.max(1);
    let (sa, sb) = (floats(sa, "scaled_matmul sa")?, floats(sb, "scaled_matmul sb")?);
    let per = |s: &[T], len: usize, what: &str| -> Result<(), String> {
        if s.len() == 1 || s.len() == len {
            Ok(())
        } else {
            Err(format!("scaled_matmul {what} has {} elements, expected 1 or {len} for {}", s.len(), shape_str(&acc.shape)))
        }
    };
    per(sa, rows, "sa")?;
    per(sb, n, "sb")?;
    for (i, row) in data.chunks_mut(n.max(1)).enumerate() {
        let r = if sa.len() == 1 { sa[0] } else { sa[i] };
        for (j, v) in row.iter_mut().enumerate() {
            let c = if sb.len() == 1 { sb[0] } else { sb[j] };
            *v = *v * r * c;
        }
    }
    float_result(rt, acc.shape.clone(), data)
}

/// `linear_f8(x, w)`: build [`crate::float8::forward`] over `x` and `w`'s concrete shapes in a
/// scratch region and run its nodes in order.
pub(crate) fn linear_f8<T: Real>(x: &Tensor<T>, w: &Tensor<T>, recipe: Float8Recipe, precision: Precision) -> Result<Vec<Tensor<T>>, String> {
    let fixed = |t: &Tensor<T>| TensorType::new(t.dtype, t.shape.iter().map(|&d| Dim::Fixed(d as u64)).collect());
    let dims = DimTable::new();
    let mut region = Region::new("linear_f8");
    let xa = region.add_arg(fixed(x), ArgKind::Block, None);
    let wa = region.add_arg(fixed(w), ArgKind::Block, None);
    let y = {
        let mut b = Builder::new(&mut region, &dims, &[]);
        crate::float8::forward(&mut b, xa, wa, recipe)?
    };
    let mut values: Vec<Option<Tensor<T>>> = vec![None; region.values.len()];
    values[xa.index()] = Some(x.clone());
    values[wa.index()] = Some(w.clone());
    for &n in &region.order {
        let node = region.node(n);
        let inputs: Vec<&Tensor<T>> =
            node.inputs.iter().map(|v| values[v.index()].as_ref().ok_or("linear_f8: an operand is used before it is computed")).collect::<Result<_, _>>()?;
        let types: Vec<TensorType> = node.results.iter().map(|&r| region.ty(r).clone()).collect();
        let out = eval_op(&node.op, &inputs, &types, &dims, precision)?;
        for (r, t) in node.results.iter().zip(out) {
            values[r.index()] = Some(t);
        }
    }
    debug_assert!(matches!(region.value(y).def, ValueDef::Result { .. }));
    Ok(vec![values[y.index()].take().ok_or("linear_f8: the expansion computed no result")?])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::Op;

    /// Deterministic values spanning several binades, some negative, rounded to bf16.
    fn bf16_values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(12345);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1_103_515_245).wrapping_add(12345);
                let u = f64::from(s >> 8) / f64::from(1u32 << 24);
                let v = (u - 0.5) * 2f64.powi((s % 7) as i32 - 3);
                half::bf16::from_f64(v).to_f32()
            })
            .collect()
    }

    /// The quantized value of `x` with scale `s` by the encoder alone: `decode(encode(clamp(x * s)))`.
    fn q(x: f32, s: f32, dtype: DType) -> f32 {
        let m = crate::fp8::fp8_max(dtype).expect("fp8");
        let bits = crate::fp8::encode(dtype, (x * s).clamp(-m, m)).expect("fp8");
        crate::fp8::decode(dtype, bits).expect("fp8")
    }

    /// `linear_f8 {recipe = rowwise}` against a direct scalar implementation of torchao's
    /// rowwise forward: per-row power-of-2 scales from the amax, saturating RNE quantization,
    /// products summed in f64 (exact for fp8 products), the reciprocal scales applied, bf16 out.
    #[test]
    fn rowwise_forward_matches_a_scalar_reference() {
        let (m, k, n) = (8usize, 32usize, 16usize);
        let xs = bf16_values(m * k, 1);
        let ws = bf16_values(n * k, 2);
        let x = Tensor::from_vec(DType::BF16, vec![m, k], xs.clone()).unwrap();
        let w = Tensor::from_vec(DType::BF16, vec![n, k], ws.clone()).unwrap();
        let out = linear_f8(&x, &w, Float8Recipe::Rowwise, Precision::Emulate).unwrap().remove(0);
        let y = out.floats().unwrap();
        let row_scale = |v: &[f32]| crate::float8::scale_of(f64::from(v.iter().fold(0f32, |a, b| a.max(b.abs()))), 448.0, true);
        for i in 0..m {
            let sx = row_scale(&xs[i * k..(i + 1) * k]);
            for j in 0..n {
                let sw = row_scale(&ws[j * k..(j + 1) * k]);
                let dot: f64 = (0..k).map(|kk| f64::from(q(xs[i * k + kk], sx, DType::F8E4M3)) * f64::from(q(ws[j * k + kk], sw, DType::F8E4M3))).sum();
                let want = half::bf16::from_f32(dot as f32 * (1.0 / sx) * (1.0 / sw)).to_f32();
                let got = y[i * n + j];
                // The f32 sum may differ from the f64 one in its last bit, which can move the
                // bf16 rounding by one ulp.
                assert!((got - want).abs() <= want.abs() * 2f32.powi(-7) + 1e-30, "y[{i},{j}] = {got}, want {want}");
            }
        }
    }

    #[test]
    fn scaled_matmul_applies_row_then_column_scales() {
        let a = Tensor::from_vec(DType::F8E4M3, vec![2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        let b = Tensor::from_vec(DType::F8E4M3, vec![2, 2], vec![1.0, 0.0, 0.0, 1.0]).unwrap();
        let sa = Tensor::from_vec(DType::F32, vec![2], vec![0.5, 2.0]).unwrap();
        let sb = Tensor::from_vec(DType::F32, vec![2], vec![1.0, 0.25]).unwrap();
        let out = scaled_matmul(&[&a, &b, &sa, &sb], false, false, &(DType::F32, vec![2, 2])).unwrap();
        assert_eq!(out.floats().unwrap(), &[0.5, 0.25, 6.0, 2.0]);
        // Tensor scales, the transposed lhs.
        let one = Tensor::from_vec(DType::F32, vec![], vec![3.0]).unwrap();
        let out = scaled_matmul(&[&a, &b, &one, &one], true, false, &(DType::F32, vec![2, 2])).unwrap();
        assert_eq!(out.floats().unwrap(), &[9.0, 27.0, 18.0, 36.0]);
    }

    /// What `crate::float8::forward` relies on for the rowwise recipes: a GEMM with unit scales,
    /// rounded to bf16, then multiplied by power-of-2 row and column scales, equals the
    /// vector-scaled GEMM rounded once, bit for bit.
    #[test]
    fn power_of_2_vector_scales_commute_with_the_bf16_rounding() {
        let (m, k, n) = (16usize, 64usize, 24usize);
        let fp8 = |v: Vec<f32>| v.into_iter().map(|x| q(x * 64.0, 1.0, DType::F8E4M3)).collect::<Vec<f32>>();
        let a = Tensor::from_vec(DType::F8E4M3, vec![m, k], fp8(bf16_values(m * k, 3))).unwrap();
        let b = Tensor::from_vec(DType::F8E4M3, vec![n, k], fp8(bf16_values(n * k, 4))).unwrap();
        let pow2 = |len: usize, seed: usize| (0..len).map(|i| 2f32.powi(((i * 7 + seed) % 29) as i32 - 20)).collect::<Vec<f32>>();
        let (ra, rb) = (pow2(m, 1), pow2(n, 5));
        let sa = Tensor::from_vec(DType::F32, vec![m], ra.clone()).unwrap();
        let sb = Tensor::from_vec(DType::F32, vec![n], rb.clone()).unwrap();
        let one = Tensor::from_vec(DType::F32, vec![], vec![1.0]).unwrap();
        let out = (DType::BF16, vec![m, n]);
        let scaled = scaled_matmul(&[&a, &b, &sa, &sb], false, true, &out).unwrap();
        let unit = scaled_matmul(&[&a, &b, &one, &one], false, true, &out).unwrap();
        let (scaled, unit) = (scaled.floats().unwrap(), unit.floats().unwrap());
        for i in 0..m {
            for j in 0..n {
                // `scaled_matmul` leaves the rounding to the result dtype to its caller.
                let bf16 = |x: f32| half::bf16::from_f32(x).to_f32();
                let after = bf16(bf16(unit[i * n + j]) * ra[i] * rb[j]);
                assert_eq!(after.to_bits(), bf16(scaled[i * n + j]).to_bits(), "[{i},{j}]");
            }
        }
    }

    #[test]
    fn fp8_scale_op_saturates_and_rounds() {
        let amax = Tensor::from_vec(DType::F32, vec![3], vec![0.0, 3.0, 1e9]).unwrap();
        let ty = [crate::shape::TensorType::new(DType::F32, vec![crate::shape::Dim::Fixed(3)])];
        let op = Op::Fp8Scale { dtype: DType::F8E5M2, pow2: true };
        let out = eval_op(&op, &[&amax], &ty, &DimTable::new(), Precision::Emulate).unwrap().remove(0);
        assert_eq!(out.floats().unwrap(), &[2f32.powi(55), 16384.0, 2f32.powi(-15)]);
    }
}
