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
        if s.len() == 1 || s.len() == len { Ok(()) } else { Err(format!("scaled_matmul {what} has {} elements, expected 1 or {len} for {}", s.len(), shape_str(&acc.shape))) }
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
