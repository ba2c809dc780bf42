//! `eval_op`: the semantics of every op except `repeat` on host tensors, with the primitive
//! ops (pointwise, cast, reduce, reshape, transpose, broadcast, gather/scatter, constants)
//! implemented here and the model-level ops dispatched to their own modules.

use crate::dtype::DType;
use crate::interp::Precision;
use crate::interp::attention;
use crate::interp::float8;
use crate::interp::linalg;
use crate::interp::model;
use crate::interp::round::{is_narrow_float, round_to_dtype};
use crate::interp::tensor::{Data, Real, Tensor, shape_str};
use crate::op::{BinaryOp, Op, ReduceKind, UnaryOp};
use crate::shape::{DimTable, TensorType};

/// The dtype and concrete shape of one result.
pub(crate) type ResultType = (DType, Vec<usize>);

/// Evaluate `op` on `inputs`. `result_types` are the node's declared result types (resolved
/// with `dims`); declared-type ops (cast, reshape, broadcast, scatter_add, constant) take
/// their result shape from them, every other op checks its computed shape against them.
/// With [`Precision::Emulate`] every result of a bf16/f16/f8 dtype is rounded to it.
/// `repeat` is not an op on tensors but on a block: it is an error here (see
/// [`crate::interp::Interpreter::run_region`]).
pub fn eval_op<T: Real>(op: &Op, inputs: &[&Tensor<T>], result_types: &[TensorType], dims: &DimTable, precision: Precision) -> Result<Vec<Tensor<T>>, String> {
    if matches!(op, Op::Repeat { .. }) {
        return Err("`repeat` runs a block and is executed by the interpreter, not by eval_op".into());
    }
    if let Some(n) = op.arity()
        && inputs.len() != n
    {
        return Err(format!("`{}` takes {n} operand{}, {} given", op.name(), plural(n), inputs.len()));
    }
    for (i, t) in inputs.iter().enumerate() {
        t.validate().map_err(|e| format!("operand {i}: {e}"))?;
    }
    let rts: Vec<ResultType> = result_types.iter().map(|t| Ok((t.dtype, t.resolve(dims)?))).collect::<Result<_, String>>()?;
    if let Some(n) = op.num_results()
        && rts.len() != n
    {
        return Err(format!("`{}` has {n} result{}, {} declared", op.name(), plural(n), rts.len()));
    }
    let mut out = dispatch(op, inputs, &rts, precision)?;
    if out.len() != rts.len() {
        return Err(format!("`{}` produced {} results, {} declared", op.name(), out.len(), rts.len()));
    }
    for (i, (t, (dtype, shape))) in out.iter_mut().zip(&rts).enumerate() {
        if t.dtype != *dtype || t.shape != *shape {
            return Err(format!("result {i} is {}, declared {dtype}{}", t.type_string(), shape_str(shape)));
        }
        t.validate().map_err(|e| format!("result {i}: {e}"))?;
        if precision == Precision::Emulate {
            round_tensor(t);
        }
    }
    Ok(out)
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// Round every element of a narrow-float tensor to its dtype.
pub(crate) fn round_tensor<T: Real>(t: &mut Tensor<T>) {
    let dtype = t.dtype;
    if !is_narrow_float(dtype) {
        return;
    }
    if let Some(v) = t.floats_mut() {
        for x in v {
            *x = round_value(*x, dtype);
        }
    }
}

/// `x` rounded to `dtype` (through f32).
pub(crate) fn round_value<T: Real>(x: T, dtype: DType) -> T {
    T::from_f64(f64::from(round_to_dtype(x.to_f64() as f32, dtype)))
}

/// `x` rounded to `dtype` when emulating low precision, unchanged when exact.
pub(crate) fn round_in<T: Real>(x: T, dtype: DType, precision: Precision) -> T {
    if precision == Precision::Emulate && is_narrow_float(dtype) { round_value(x, dtype) } else { x }
}

/// The float elements of an operand, or an error naming it.
pub(crate) fn floats<'a, T: Real>(t: &'a Tensor<T>, what: &str) -> Result<&'a [T], String> {
    t.floats().ok_or_else(|| format!("{what} must be a float tensor, found {}", t.type_string()))
}

/// The integer elements of an operand, or an error naming it.
pub(crate) fn ints<'a, T: Real>(t: &'a Tensor<T>, what: &str) -> Result<&'a [i64], String> {
    t.ints().ok_or_else(|| format!("{what} must be an integer tensor, found {}", t.type_string()))
}

/// A float result tensor; an error if the declared dtype is an integer type.
pub(crate) fn float_result<T: Real>(rt: &ResultType, shape: Vec<usize>, data: Vec<T>) -> Result<Tensor<T>, String> {
    if rt.0.is_int() {
        return Err(format!("the result is declared {}, this op produces floats", rt.0));
    }
    Ok(Tensor { dtype: rt.0, shape, data: Data::Float(data) })
}

/// 2^63: integers cast from floats must lie in `[-2^63, 2^63)`.
const TWO_POW_63: f64 = 9_223_372_036_854_775_808.0;

/// Row-major strides of `shape`.
pub(crate) fn strides_of(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Visit every index of `shape` in row-major order, calling `f` with its offset under
/// `strides`.
pub(crate) fn walk(shape: &[usize], strides: &[usize], mut f: impl FnMut(usize)) {
    if shape.contains(&0) {
        return;
    }
    let Some((&inner, outer)) = shape.split_last() else {
        f(0);
        return;
    };
    let inner_stride = strides[outer.len()];
    let mut idx = vec![0usize; outer.len()];
    let mut base = 0usize;
    loop {
        for j in 0..inner {
            f(base + j * inner_stride);
        }
        let mut d = outer.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            base += strides[d];
            if idx[d] < outer[d] {
                break;
            }
            base -= strides[d] * outer[d];
            idx[d] = 0;
        }
    }
}

/// The elements of `src` read at the offsets `walk(shape, strides)` visits, in order.
fn strided_copy<E: Copy>(src: &[E], shape: &[usize], strides: &[usize]) -> Vec<E> {
    let mut out = Vec::with_capacity(shape.iter().product());
    walk(shape, strides, |o| out.push(src[o]));
    out
}

fn map_data<T: Copy>(data: &Data<T>, f: impl Fn(&[T]) -> Vec<T>, g: impl Fn(&[i64]) -> Vec<i64>) -> Data<T> {
    match data {
        Data::Float(v) => Data::Float(f(v)),
        Data::Int(v) => Data::Int(g(v)),
    }
}

fn dispatch<T: Real>(op: &Op, x: &[&Tensor<T>], rts: &[ResultType], precision: Precision) -> Result<Vec<Tensor<T>>, String> {
    let rt = &rts[0];
    let one = |t: Tensor<T>| Ok(vec![t]);
    match op {
        Op::Embedding => one(gather(x[1], x[0], None, rt, "token id")?),
        Op::Gather => one(gather(x[0], x[1], None, rt, "index")?),
        Op::ScatterAdd => one(scatter_add(x[0], x[1], None, rt)?),
        Op::GatherShard => one(gather(x[0], x[1], Some(row_shard(x[2], "gather_shard")?), rt, "index")?),
        Op::ScatterAddShard => one(scatter_add(x[0], x[1], Some(row_shard(x[2], "scatter_add_shard")?), rt)?),
        Op::Linear => one(linalg::linear(x[0], x[1], rt)?),
        Op::Matmul { transpose_a, transpose_b } => one(linalg::matmul(x[0], x[1], *transpose_a, *transpose_b, rt)?),
        Op::LinearF8 { recipe } => float8::linear_f8(x[0], x[1], *recipe, precision),
        Op::Fp8Scale { dtype, pow2 } => one(float8::fp8_scale(x[0], *dtype, *pow2, rt)?),
        Op::ScaledMatmul { transpose_a, transpose_b, .. } => one(float8::scaled_matmul(x, *transpose_a, *transpose_b, rt)?),
        Op::RmsNorm { eps } => one(model::rmsnorm(x[0], x[1], *eps, rt, precision)?),
        Op::RmsNormBwd { eps } => model::rmsnorm_bwd(x[0], x[1], x[2], *eps, rts, precision),
        Op::Rope(cfg) => one(model::rope(x[0], cfg, rt)?),
        Op::Attention { causal, scale } => attention::attention(x[0], x[1], x[2], *causal, *scale, rts),
        Op::AttentionBwd { causal, scale } => attention::attention_bwd(x, *causal, *scale, rts),
        Op::CrossEntropy => one(model::cross_entropy(x[0], x[1], rt)?),
        Op::CrossEntropyBwd => one(model::cross_entropy_bwd(x[0], x[1], x[2], rt)?),
        Op::CrossEntropyStats => model::cross_entropy_stats(x[0], x[1], x[2], rts),
        Op::CrossEntropyStatsBwd => one(model::cross_entropy_stats_bwd(x, rt)?),
        Op::CrossEntropyCombine => one(model::cross_entropy_combine(x[0], x[1], x[2], rt)?),
        Op::Unary(u) => one(unary(*u, x[0], rt)?),
        Op::Binary(b) => one(binary(*b, x[0], x[1], rt)?),
        Op::Cast => one(cast(x[0], rt)?),
        Op::Reduce { kind, axes } => one(reduce(*kind, axes, x[0], rt)?),
        Op::Reshape => one(reshape(x[0], rt)?),
        Op::Transpose { perm } => one(transpose(x[0], perm)?),
        Op::Slice { axis, start, len } => one(slice(x[0], *axis as usize, *start, *len)?),
        Op::Concat { axis } => one(concat(x, *axis as usize)?),
        Op::Broadcast { dims } => one(broadcast(x[0], dims, rt)?),
        Op::Constant { value } => one(constant(*value, rt)?),
        Op::LrSchedule(s) => one(model::lr_schedule(x[0], s, rt)?),
        Op::AdamW(c) => model::adamw(x, c, rts),
        Op::Repeat { .. } => Err("`repeat` runs a block and is executed by the interpreter, not by eval_op".into()),
        Op::Kernel { .. } => Err("`kernel` runs a block and is executed by the interpreter, not by eval_op".into()),
        Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::AllReduce { .. }
        | Op::TakeShard { .. }
        | Op::PlaceShard { .. }
        | Op::RingShift { .. }
        | Op::RingSlice { .. }
        | Op::RingConcat { .. } => Err(format!("`{}` needs a device mesh; run the graph with a communicator (the simulated mesh of titan-run)", op.name())),
    }
}

pub(crate) fn sigmoid<T: Real>(x: T) -> T {
    if x >= T::zero() {
        T::one() / (T::one() + (-x).exp())
    } else {
        let e = x.exp();
        e / (T::one() + e)
    }
}

fn unary<T: Real>(u: UnaryOp, x: &Tensor<T>, rt: &ResultType) -> Result<Tensor<T>, String> {
    let xs = floats(x, &format!("`{}` operand", u.name()))?;
    let f: fn(T) -> T = match u {
        UnaryOp::Neg => |v| -v,
        UnaryOp::Exp => |v| v.exp(),
        UnaryOp::Log => |v| v.ln(),
        UnaryOp::Sqrt => |v| v.sqrt(),
        UnaryOp::Rsqrt => |v| v.sqrt().recip(),
        UnaryOp::Recip => |v| v.recip(),
        UnaryOp::Sigmoid => sigmoid,
        UnaryOp::Silu => |v| v * sigmoid(v),
        UnaryOp::Tanh => |v| v.tanh(),
        UnaryOp::Abs => |v| v.abs(),
        UnaryOp::Square => |v| v * v,
    };
    float_result(rt, x.shape.clone(), xs.iter().map(|&v| f(v)).collect())
}

fn binary_fn<T: Real>(b: BinaryOp) -> fn(T, T) -> T {
    match b {
        BinaryOp::Add => |a, b| a + b,
        BinaryOp::Sub => |a, b| a - b,
        BinaryOp::Mul => |a, b| a * b,
        BinaryOp::Div => |a, b| a / b,
        // NaN-propagating like torch.maximum / torch.minimum.
        BinaryOp::Max => |a, b| if a.is_nan() || b.is_nan() { T::nan() } else { a.max(b) },
        BinaryOp::Min => |a, b| if a.is_nan() || b.is_nan() { T::nan() } else { a.min(b) },
        BinaryOp::Pow => |a, b| a.powf(b),
        BinaryOp::SiluGrad => |x, dy| {
            let s = sigmoid(x);
            dy * s * (T::one() + x * (T::one() - s))
        },
    }
}

fn binary<T: Real>(b: BinaryOp, x: &Tensor<T>, y: &Tensor<T>, rt: &ResultType) -> Result<Tensor<T>, String> {
    let xs = floats(x, &format!("`{}` lhs", b.name()))?;
    let ys = floats(y, &format!("`{}` rhs", b.name()))?;
    let f = binary_fn::<T>(b);
    let (shape, data): (Vec<usize>, Vec<T>) = if x.shape == y.shape {
        (x.shape.clone(), xs.iter().zip(ys).map(|(&a, &c)| f(a, c)).collect())
    } else if y.shape.is_empty() {
        let c = ys[0];
        (x.shape.clone(), xs.iter().map(|&a| f(a, c)).collect())
    } else if x.shape.is_empty() {
        let a = xs[0];
        (y.shape.clone(), ys.iter().map(|&c| f(a, c)).collect())
    } else {
        return Err(format!("`{}`: shapes {} and {} differ and neither is a scalar", b.name(), shape_str(&x.shape), shape_str(&y.shape)));
    };
    float_result(rt, shape, data)
}

fn cast<T: Real>(x: &Tensor<T>, rt: &ResultType) -> Result<Tensor<T>, String> {
    let to = rt.0;
    let data = match (&x.data, to.is_int()) {
        (Data::Float(v), false) => Data::Float(v.clone()),
        (Data::Float(v), true) => {
            let mut out = Vec::with_capacity(v.len());
            for &f in v {
                let t = f.to_f64().trunc();
                // i64 covers [-2^63, 2^63); i32 range is checked on the result.
                if !t.is_finite() || !(-TWO_POW_63..TWO_POW_63).contains(&t) {
                    return Err(format!("cannot cast {} to {to}: out of range", f.to_f64()));
                }
                out.push(t as i64);
            }
            Data::Int(out)
        }
        (Data::Int(v), false) => Data::Float(v.iter().map(|&i| T::from_f64(i as f64)).collect()),
        (Data::Int(v), true) => Data::Int(v.clone()),
    };
    if to == DType::I32
        && let Data::Int(v) = &data
        && let Some(bad) = v.iter().find(|&&i| i32::try_from(i).is_err())
    {
        return Err(format!("cannot cast {bad} to i32: out of range"));
    }
    if x.shape != rt.1 {
        return Err(format!("cast keeps the shape: {} to {to}{}", x.type_string(), shape_str(&rt.1)));
    }
    Ok(Tensor { dtype: to, shape: x.shape.clone(), data })
}

fn reduce<T: Real>(kind: ReduceKind, axes: &[usize], x: &Tensor<T>, rt: &ResultType) -> Result<Tensor<T>, String> {
    let xs = floats(x, "reduce operand")?;
    if axes.is_empty() || axes.windows(2).any(|w| w[0] >= w[1]) || axes.iter().any(|&a| a >= x.rank()) {
        return Err(format!("reduce axes {axes:?} must be sorted, unique and below the rank of {}", x.type_string()));
    }
    let out_shape: Vec<usize> = x.shape.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, &d)| d).collect();
    let out_strides = strides_of(&out_shape);
    // Stride of each input dim in the output: 0 for the reduced ones.
    let mut in_to_out = Vec::with_capacity(x.rank());
    let mut k = 0;
    for i in 0..x.rank() {
        if axes.contains(&i) {
            in_to_out.push(0);
        } else {
            in_to_out.push(out_strides[k]);
            k += 1;
        }
    }
    let n_out: usize = out_shape.iter().product();
    let init = match kind {
        ReduceKind::Max => T::neg_infinity(),
        ReduceKind::Sum | ReduceKind::Mean => T::zero(),
    };
    let mut acc = vec![init; n_out];
    let mut i = 0;
    match kind {
        ReduceKind::Max => walk(&x.shape, &in_to_out, |o| {
            let v = xs[i];
            i += 1;
            if v.is_nan() || v > acc[o] {
                acc[o] = if acc[o].is_nan() { acc[o] } else { v };
            }
        }),
        ReduceKind::Sum | ReduceKind::Mean => walk(&x.shape, &in_to_out, |o| {
            acc[o] = acc[o] + xs[i];
            i += 1;
        }),
    }
    if kind == ReduceKind::Mean {
        let count: usize = axes.iter().map(|&a| x.shape[a]).product();
        let c = T::from_f64(count as f64);
        for a in &mut acc {
            *a = *a / c;
        }
    }
    float_result(rt, out_shape, acc)
}

fn reshape<T: Real>(x: &Tensor<T>, rt: &ResultType) -> Result<Tensor<T>, String> {
    let n: usize = rt.1.iter().product();
    if n != x.numel() {
        return Err(format!("reshape changes the element count: {} to {}", x.type_string(), shape_str(&rt.1)));
    }
    Ok(Tensor { dtype: rt.0, shape: rt.1.clone(), data: x.data.clone() })
}

fn transpose<T: Real>(x: &Tensor<T>, perm: &[usize]) -> Result<Tensor<T>, String> {
    let mut seen = vec![false; x.rank()];
    if perm.len() != x.rank() || perm.iter().any(|&p| p >= x.rank() || std::mem::replace(&mut seen[p], true)) {
        return Err(format!("transpose perm {perm:?} is not a permutation of the dims of {}", x.type_string()));
    }
    let in_strides = strides_of(&x.shape);
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let strides: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
    let data = map_data(&x.data, |v| strided_copy(v, &shape, &strides), |v| strided_copy(v, &shape, &strides));
    Ok(Tensor { dtype: x.dtype, shape, data })
}

/// `(outer, size along axis, inner)` of a row-major shape.
fn split_at_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (shape[..axis].iter().product(), shape[axis], shape[axis + 1..].iter().product())
}

fn slice<T: Real>(x: &Tensor<T>, axis: usize, start: u64, len: u64) -> Result<Tensor<T>, String> {
    let bad = || format!("slice [{start}, {start} + {len}) of axis {axis} is out of range for {}", x.type_string());
    if axis >= x.rank() {
        return Err(bad());
    }
    let (start, len) = (usize::try_from(start).map_err(|_| bad())?, usize::try_from(len).map_err(|_| bad())?);
    let (outer, n, inner) = split_at_axis(&x.shape, axis);
    if len == 0 || start.checked_add(len).is_none_or(|end| end > n) {
        return Err(bad());
    }
    fn cut<E: Copy>(v: &[E], outer: usize, n: usize, inner: usize, start: usize, len: usize) -> Vec<E> {
        (0..outer).flat_map(|o| v[(o * n + start) * inner..(o * n + start + len) * inner].iter().copied()).collect()
    }
    let mut shape = x.shape.clone();
    shape[axis] = len;
    let data = match &x.data {
        Data::Float(v) => Data::Float(cut(v, outer, n, inner, start, len)),
        Data::Int(v) => Data::Int(cut(v, outer, n, inner, start, len)),
    };
    Ok(Tensor { dtype: x.dtype, shape, data })
}

fn concat<T: Real>(parts: &[&Tensor<T>], axis: usize) -> Result<Tensor<T>, String> {
    let first = parts.first().ok_or("`concat` needs at least one operand")?;
    let off_axis = |t: &Tensor<T>| (axis < t.rank()).then(|| (t.shape[..axis].to_vec(), t.shape[axis + 1..].to_vec()));
    let key = off_axis(first).ok_or_else(|| format!("concat: axis {axis} is out of range for {}", first.type_string()))?;
    for p in parts {
        if p.dtype != first.dtype || off_axis(p).as_ref() != Some(&key) {
            return Err(format!("concat along axis {axis}: {} does not match {}", p.type_string(), first.type_string()));
        }
    }
    let (outer, _, inner) = split_at_axis(&first.shape, axis);
    let total: usize = parts.iter().map(|p| p.shape[axis]).sum();
    let mut shape = first.shape.clone();
    shape[axis] = total;
    let data = match &first.data {
        Data::Float(_) => {
            let mut out = Vec::with_capacity(outer * total * inner);
            for o in 0..outer {
                for p in parts {
                    let v = p.floats().ok_or("concat: operands of one dtype")?;
                    let w = p.shape[axis] * inner;
                    out.extend_from_slice(&v[o * w..(o + 1) * w]);
                }
            }
            Data::Float(out)
        }
        Data::Int(_) => {
            let mut out = Vec::with_capacity(outer * total * inner);
            for o in 0..outer {
                for p in parts {
                    let Data::Int(v) = &p.data else { return Err("concat: operands of one dtype".into()) };
                    let w = p.shape[axis] * inner;
                    out.extend_from_slice(&v[o * w..(o + 1) * w]);
                }
            }
            Data::Int(out)
        }
    };
    Ok(Tensor { dtype: first.dtype, shape, data })
}

fn broadcast<T: Real>(x: &Tensor<T>, map: &[usize], rt: &ResultType) -> Result<Tensor<T>, String> {
    let out = &rt.1;
    if map.len() != x.rank() || map.windows(2).any(|w| w[0] >= w[1]) || map.iter().any(|&d| d >= out.len()) {
        return Err(format!("broadcast dims {map:?} must be increasing, one per input dim of {}, below the output rank {}", x.type_string(), out.len()));
    }
    let in_strides = strides_of(&x.shape);
    let mut strides = vec![0usize; out.len()];
    for (i, &o) in map.iter().enumerate() {
        if x.shape[i] == out[o] {
            strides[o] = in_strides[i];
        } else if x.shape[i] != 1 {
            return Err(format!("broadcast: input dim {i} ({}) cannot stretch to output dim {o} ({})", x.shape[i], out[o]));
        }
    }
    let data = map_data(&x.data, |v| strided_copy(v, out, &strides), |v| strided_copy(v, out, &strides));
    Ok(Tensor { dtype: rt.0, shape: out.clone(), data })
}

fn constant<T: Real>(value: f64, rt: &ResultType) -> Result<Tensor<T>, String> {
    let n: usize = rt.1.iter().product();
    let data = if rt.0.is_int() {
        if !value.is_finite() || value.trunc() != value || !(-TWO_POW_63..TWO_POW_63).contains(&value) {
            return Err(format!("constant {value} is not a valid {}", rt.0));
        }
        Data::Int(vec![value as i64; n])
    } else {
        Data::Float(vec![T::from_f64(value); n])
    };
    Ok(Tensor { dtype: rt.0, shape: rt.1.clone(), data })
}

/// Check an index against the row count; `what` names it in the error.
fn row_index(id: i64, rows: usize, what: &str) -> Result<usize, String> {
    match usize::try_from(id) {
        Ok(r) if r < rows => Ok(r),
        _ => Err(format!("{what} {id} is out of range for {rows} rows")),
    }
}

/// Row shard `k` of `n` of a table whose shards have `rows` rows each (`None`: the whole table).
#[derive(Clone, Copy)]
struct RowShard {
    k: usize,
    n: usize,
}

/// The row of a table shard of `rows` rows that index `id` names, `None` when the row is in
/// another shard; `id` must be a row of the whole table (`rows x n`).
fn shard_row(id: i64, rows: usize, shard: Option<RowShard>, what: &str) -> Result<Option<usize>, String> {
    let Some(RowShard { k, n }) = shard else { return row_index(id, rows, what).map(Some) };
    let r = row_index(id, rows * n, what)?;
    Ok((r / rows == k).then_some(r % rows))
}

fn gather_rows<E: Copy + Default>(table: &[E], row_len: usize, rows: usize, idx: &[i64], shard: Option<RowShard>, what: &str) -> Result<Vec<E>, String> {
    let mut out = Vec::with_capacity(idx.len() * row_len);
    for &id in idx {
        match shard_row(id, rows, shard, what)? {
            Some(r) => out.extend_from_slice(&table[r * row_len..(r + 1) * row_len]),
            None => out.resize(out.len() + row_len, E::default()),
        }
    }
    Ok(out)
}

/// Rows of `table` at `idx`; `what` names an index in errors (`token id` for embedding). With
/// `shard`, `table` is that row shard and indices of other shards give zero rows.
fn gather<T: Real>(table: &Tensor<T>, idx: &Tensor<T>, shard: Option<RowShard>, rt: &ResultType, what: &str) -> Result<Tensor<T>, String> {
    let ids = ints(idx, "indices")?;
    let Some((&rows, rest)) = table.shape.split_first() else {
        return Err(format!("the table must have rank >= 1, found {}", table.type_string()));
    };
    let row_len: usize = rest.iter().product();
    let data = match &table.data {
        Data::Float(v) => Data::Float(gather_rows(v, row_len, rows, ids, shard, what)?),
        Data::Int(v) => Data::Int(gather_rows(v, row_len, rows, ids, shard, what)?),
    };
    let mut shape = idx.shape.clone();
    shape.extend_from_slice(rest);
    Ok(Tensor { dtype: rt.0, shape, data })
}

/// `scatter_add`; with `shard`, the result is that row shard of the table and sources whose
/// index lies in another shard are dropped.
fn scatter_add<T: Real>(idx: &Tensor<T>, src: &Tensor<T>, shard: Option<RowShard>, rt: &ResultType) -> Result<Tensor<T>, String> {
    let ids = ints(idx, "scatter_add indices")?;
    let s = floats(src, "scatter_add source")?;
    let out = &rt.1;
    let k = idx.rank();
    let Some((&rows, row_shape)) = out.split_first() else {
        return Err("scatter_add result must have rank >= 1".into());
    };
    if src.rank() < k || src.shape[..k] != idx.shape[..] || src.shape[k..] != *row_shape {
        return Err(format!(
            "scatter_add: source {} must be the index shape {} followed by the row shape {}",
            src.type_string(),
            shape_str(&idx.shape),
            shape_str(row_shape)
        ));
    }
    let row_len: usize = row_shape.iter().product();
    let mut acc = vec![T::zero(); rows * row_len];
    for (j, &id) in ids.iter().enumerate() {
        let Some(r) = shard_row(id, rows, shard, "index")? else { continue };
        let dst = &mut acc[r * row_len..(r + 1) * row_len];
        for (d, &v) in dst.iter_mut().zip(&s[j * row_len..(j + 1) * row_len]) {
            *d = *d + v;
        }
    }
    float_result(rt, out.clone(), acc)
}

/// The row shard named by the one-hot `shard` (`f32[n]`) of a `gather_shard`/`scatter_add_shard`.
fn row_shard<T: Real>(shard: &Tensor<T>, what: &str) -> Result<RowShard, String> {
    Ok(RowShard { k: model::shard_index(shard, what)?, n: shard.numel() })
}
