//! Result types of every op from its input types: the single source of the typing rules,
//! used by the builder (to create nodes) and the verifier (to check declared types).

use crate::dtype::DType;
use crate::graph::Region;
use crate::op::Op;
use crate::shape::{Dim, DimTable, TensorType, resolve_dim, same_dim, same_shape};

/// What type inference needs to know besides the op and its inputs.
#[derive(Clone, Copy)]
pub struct InferCtx<'a> {
    pub dims: &'a DimTable,
    pub blocks: &'a [Region],
}

fn shape_str(s: &[Dim]) -> String {
    let parts: Vec<String> = s.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

fn need_float(t: &TensorType, what: &str) -> Result<(), String> {
    if t.dtype.is_float() { Ok(()) } else { Err(format!("{what} must be a float tensor, found {t}")) }
}

fn need_int(t: &TensorType, what: &str) -> Result<(), String> {
    if t.dtype.is_int() { Ok(()) } else { Err(format!("{what} must be an integer tensor, found {t}")) }
}

fn need_rank(t: &TensorType, rank: usize, what: &str) -> Result<(), String> {
    if t.rank() == rank { Ok(()) } else { Err(format!("{what} must have rank {rank}, found {t}")) }
}

fn need_same_dtype(a: &TensorType, b: &TensorType, what: &str) -> Result<(), String> {
    if a.dtype == b.dtype { Ok(()) } else { Err(format!("{what}: dtype mismatch, {} vs {}", a.dtype, b.dtype)) }
}

fn need_dim(a: &Dim, b: &Dim, dims: &DimTable, what: &str) -> Result<(), String> {
    if same_dim(a, b, dims) { Ok(()) } else { Err(format!("{what}: {a} vs {b}")) }
}

fn need_same_type(a: &TensorType, b: &TensorType, dims: &DimTable, what: &str) -> Result<(), String> {
    if a.same_as(b, dims) { Ok(()) } else { Err(format!("{what}: {a} vs {b}")) }
}

fn one_declared<'d>(op: &Op, declared: Option<&'d [TensorType]>) -> Result<&'d TensorType, String> {
    match declared {
        Some([t]) => Ok(t),
        Some(ts) => Err(format!("`{}` has one result, {} declared", op.name(), ts.len())),
        None => Err(format!("`{}` needs its result type declared", op.name())),
    }
}

/// Element count, `None` when a dim is unbound or the count overflows.
fn numel(shape: &[Dim], dims: &DimTable) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, d| acc.checked_mul(resolve_dim(d, dims)?))
}

/// The result types of `op` applied to `inputs`. For ops whose result type is declared,
/// `declared` is checked against the inputs and returned.
pub fn infer_types(op: &Op, inputs: &[&TensorType], declared: Option<&[TensorType]>, ctx: &InferCtx) -> Result<Vec<TensorType>, String> {
    if let Some(n) = op.arity()
        && inputs.len() != n
    {
        return Err(format!("`{}` takes {n} operand{}, found {}", op.name(), if n == 1 { "" } else { "s" }, inputs.len()));
    }
    let dims = ctx.dims;
    let out = match op {
        Op::Embedding
        | Op::Linear
        | Op::LinearF8 { .. }
        | Op::RmsNorm { .. }
        | Op::Rope(_)
        | Op::Attention { .. }
        | Op::AttentionBwd { .. }
        | Op::CrossEntropy
        | Op::CrossEntropyBwd
        | Op::CrossEntropyStats
        | Op::CrossEntropyStatsBwd
        | Op::CrossEntropyCombine
        | Op::RmsNormBwd { .. } => model_op_types(op, inputs, ctx)?,
        Op::Unary(_) | Op::Binary(_) | Op::Cast | Op::Reduce { .. } | Op::Reshape | Op::Transpose { .. } | Op::Broadcast { .. } | Op::Matmul { .. } => {
            primitive_types(op, inputs, declared, ctx)?
        }
        Op::Fp8Scale { .. } | Op::ScaledMatmul { .. } => float8_types(op, inputs, declared, ctx)?,
        Op::Gather | Op::GatherShard | Op::ScatterAdd | Op::ScatterAddShard => table_types(op, inputs, declared, ctx)?,
        Op::Constant { .. } | Op::LrSchedule(_) | Op::AdamW(_) => optimizer_types(op, inputs, declared, ctx)?,
        Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::TakeShard { .. }
        | Op::PlaceShard { .. }
        | Op::AllReduce { .. }
        | Op::RingShift { .. }
        | Op::RingSlice { .. }
        | Op::RingConcat { .. } => collective_types(op, inputs, ctx)?,
        Op::Slice { .. } | Op::Concat { .. } => slice_types(op, inputs, ctx)?,
        Op::Repeat { .. } | Op::Kernel { .. } => region_types(op, inputs, ctx)?,
    };
    if let Some(decl) = declared {
        if decl.len() != out.len() {
            return Err(format!("`{}` produces {} result{}, {} declared", op.name(), out.len(), if out.len() == 1 { "" } else { "s" }, decl.len()));
        }
        for (i, (d, o)) in decl.iter().zip(&out).enumerate() {
            if !d.same_as(o, dims) {
                return Err(format!("result {i} of `{}` is {o}, declared {d}", op.name()));
            }
        }
    }
    Ok(out)
}

/// `slice` and `concat`: the result has a fixed size along `axis`.
fn slice_types(op: &Op, inputs: &[&TensorType], ctx: &InferCtx) -> Result<Vec<TensorType>, String> {
    let dims = ctx.dims;
    let size_along = |x: &TensorType, axis: usize| -> Result<u64, String> {
        if axis >= x.rank() {
            return Err(format!("`{}`: axis {axis} is out of range for {x}", op.name()));
        }
        resolve_dim(&x.shape[axis], dims).ok_or_else(|| format!("`{}`: dim {} of {x} is not bound in `dims`", op.name(), x.shape[axis]))
    };
    Ok(match op {
        Op::Slice { axis, start, len } => {
            let x = inputs[0];
            let n = size_along(x, *axis as usize)?;
            if *len == 0 || start.checked_add(*len).is_none_or(|end| end > n) {
                return Err(format!("`slice`: [{start}, {start} + {len}) is not a non-empty range inside dim {axis} of {x} (size {n})"));
            }
            let mut shape = x.shape.clone();
            shape[*axis as usize] = Dim::Fixed(*len);
            vec![TensorType::new(x.dtype, shape)]
        }
        Op::Concat { axis } => {
            let Some(first) = inputs.first() else { return Err("`concat` needs at least one operand".into()) };
            let a = *axis as usize;
            let mut total = 0u64;
            for x in inputs {
                total = total.checked_add(size_along(x, a)?).ok_or("`concat`: the result is too large")?;
                let others_equal = x.rank() == first.rank() && (0..x.rank()).all(|d| d == a || same_dim(&x.shape[d], &first.shape[d], dims));
                if x.dtype != first.dtype || !others_equal {
                    return Err(format!("`concat` along axis {axis}: {x} does not match {first} (one dtype, equal dims off the axis)"));
                }
            }
            let mut shape = first.shape.clone();
            shape[a] = Dim::Fixed(total);
            vec![TensorType::new(first.dtype, shape)]
        }
        _ => unreachable!("invariant: only slice and concat"),
    })
}

/// The result types of the model-level ops and their backward ops (embedding, linear, norms, RoPE, attention, losses).
fn model_op_types(op: &Op, inputs: &[&TensorType], ctx: &InferCtx) -> Result<Vec<TensorType>, String> {
    let dims = ctx.dims;
    Ok(match op {
        Op::Embedding => {
            let (tok, table) = (inputs[0], inputs[1]);
            need_int(tok, "embedding tokens")?;
            need_rank(table, 2, "embedding table")?;
            need_float(table, "embedding table")?;
            let mut s = tok.shape.clone();
            s.push(table.shape[1].clone());
            vec![TensorType::new(table.dtype, s)]
        }
        Op::Linear | Op::LinearF8 { .. } => {
            let (x, w) = (inputs[0], inputs[1]);
            need_float(x, "linear input")?;
            need_rank(w, 2, "linear weight")?;
            need_same_dtype(x, w, "linear")?;
            let last = x.shape.last().ok_or("linear input must have rank >= 1")?;
            need_dim(last, &w.shape[1], dims, "linear: input features do not match weight [out, in]")?;
            let mut s = x.shape.clone();
            *s.last_mut().expect("invariant: rank >= 1") = w.shape[0].clone();
            vec![TensorType::new(x.dtype, s)]
        }
        Op::RmsNorm { .. } => {
            let (x, w) = (inputs[0], inputs[1]);
            need_float(x, "rmsnorm input")?;
            need_float(w, "rmsnorm weight")?;
            need_rank(w, 1, "rmsnorm weight")?;
            let last = x.shape.last().ok_or("rmsnorm input must have rank >= 1")?;
            need_dim(last, &w.shape[0], dims, "rmsnorm: weight size does not match the last dim")?;
            vec![(*x).clone()]
        }
        Op::Rope(_) => {
            let x = inputs[0];
            need_float(x, "rope input")?;
            need_rank(x, 4, "rope input [batch, seq, heads, head_dim]")?;
            match resolve_dim(&x.shape[3], dims) {
                Some(d) if d % 2 == 0 => {}
                _ => return Err(format!("rope: head_dim must be even, found {}", x.shape[3])),
            }
            vec![x.clone()]
        }
        Op::Attention { .. } => {
            let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
            attention_checks(q, k, v, dims)?;
            let lse = TensorType::new(DType::F32, vec![q.shape[0].clone(), q.shape[2].clone(), q.shape[1].clone()]);
            vec![q.clone(), lse]
        }
        Op::AttentionBwd { .. } => {
            let (q, k, v, o, lse, d_o) = (inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5]);
            attention_checks(q, k, v, dims)?;
            need_same_type(o, q, dims, "attention_bwd: out must have the type of q")?;
            need_same_type(d_o, q, dims, "attention_bwd: dout must have the type of q")?;
            let want = TensorType::new(DType::F32, vec![q.shape[0].clone(), q.shape[2].clone(), q.shape[1].clone()]);
            need_same_type(lse, &want, dims, "attention_bwd: lse must be f32[batch, heads, seq]")?;
            vec![q.clone(), k.clone(), v.clone()]
        }
        Op::CrossEntropy => {
            let (logits, targets) = (inputs[0], inputs[1]);
            cross_entropy_checks(logits, targets, dims)?;
            vec![TensorType::scalar(DType::F32)]
        }
        Op::CrossEntropyBwd => {
            let (logits, targets, dloss) = (inputs[0], inputs[1], inputs[2]);
            cross_entropy_checks(logits, targets, dims)?;
            need_same_type(dloss, &TensorType::scalar(DType::F32), dims, "cross_entropy_bwd: dloss must be f32[]")?;
            vec![logits.clone()]
        }
        Op::CrossEntropyStats => {
            let (logits, targets, shard) = (inputs[0], inputs[1], inputs[2]);
            cross_entropy_checks(logits, targets, dims)?;
            shard_checks(shard, "cross_entropy_stats")?;
            let stat = stat_type(targets, Dim::Fixed(1));
            vec![stat.clone(), stat.clone(), stat]
        }
        Op::CrossEntropyStatsBwd => {
            let (logits, targets, shard) = (inputs[0], inputs[1], inputs[2]);
            cross_entropy_checks(logits, targets, dims)?;
            shard_checks(shard, "cross_entropy_stats_bwd")?;
            let stat = stat_type(targets, Dim::Fixed(1));
            for (d, what) in inputs[3..].iter().zip(["dmax", "dsumexp", "dtarget"]) {
                need_same_type(d, &stat, dims, &format!("cross_entropy_stats_bwd: {what} must be {stat}"))?;
            }
            vec![logits.clone()]
        }
        Op::CrossEntropyCombine => {
            let m = inputs[0];
            if m.dtype != DType::F32 || m.rank() == 0 {
                return Err(format!("cross_entropy_combine: max must be f32[..., shards], found {m}"));
            }
            for (x, what) in inputs[1..].iter().zip(["sumexp", "target"]) {
                need_same_type(x, m, dims, &format!("cross_entropy_combine: {what} must have the type of max ({m})"))?;
            }
            vec![TensorType::scalar(DType::F32)]
        }
        Op::RmsNormBwd { .. } => {
            let (x, w, dy) = (inputs[0], inputs[1], inputs[2]);
            need_float(x, "rmsnorm_bwd input")?;
            need_rank(w, 1, "rmsnorm_bwd weight")?;
            let last = x.shape.last().ok_or("rmsnorm_bwd input must have rank >= 1")?;
            need_dim(last, &w.shape[0], dims, "rmsnorm_bwd: weight size does not match the last dim")?;
            need_same_type(dy, x, dims, "rmsnorm_bwd: dy must have the type of x")?;
            vec![x.clone(), w.clone()]
        }
        _ => unreachable!("invariant: `infer_types` routes only its ops to model_op_types"),
    })
}

/// The result types of the pointwise, reduction, layout and matmul primitives.
fn primitive_types(op: &Op, inputs: &[&TensorType], declared: Option<&[TensorType]>, ctx: &InferCtx) -> Result<Vec<TensorType>, String> {
    let dims = ctx.dims;
    Ok(match op {
        Op::Unary(u) => {
            need_float(inputs[0], &format!("`{}` operand", u.name()))?;
            vec![inputs[0].clone()]
        }
        Op::Binary(bo) => {
            let (a, b) = (inputs[0], inputs[1]);
            need_same_dtype(a, b, &format!("`{}`", bo.name()))?;
            if a.dtype.is_int() {
                return Err(format!("`{}` operands must be float tensors, found {a}", bo.name()));
            }
            if same_shape(&a.shape, &b.shape, dims) || b.rank() == 0 {
                vec![a.clone()]
            } else if a.rank() == 0 {
                vec![b.clone()]
            } else {
                return Err(format!("`{}`: shapes {} and {} differ (broadcast one explicitly)", bo.name(), shape_str(&a.shape), shape_str(&b.shape)));
            }
        }
        Op::Cast => {
            let t = one_declared(op, declared)?;
            if !same_shape(&t.shape, &inputs[0].shape, dims) {
                return Err(format!("cast keeps the shape: {} to {}", inputs[0], t));
            }
            vec![t.clone()]
        }
        Op::Reduce { axes, .. } => {
            let x = inputs[0];
            need_float(x, "reduce operand")?;
            if axes.is_empty() {
                return Err("reduce needs at least one axis".into());
            }
            if axes.windows(2).any(|w| w[0] >= w[1]) {
                return Err(format!("reduce axes must be sorted and unique, found {axes:?}"));
            }
            if let Some(&a) = axes.iter().find(|&&a| a >= x.rank()) {
                return Err(format!("reduce axis {a} is out of range for {x}"));
            }
            let s = x.shape.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, d)| d.clone()).collect();
            vec![TensorType::new(x.dtype, s)]
        }
        Op::Reshape => {
            let t = one_declared(op, declared)?;
            let x = inputs[0];
            need_same_dtype(x, t, "reshape")?;
            match (numel(&x.shape, dims), numel(&t.shape, dims)) {
                (Some(a), Some(b)) if a == b => {}
                (Some(a), Some(b)) => return Err(format!("reshape changes the element count: {x} ({a}) to {t} ({b})")),
                _ => return Err(format!("reshape of {x} to {t} has an unbound dimension")),
            }
            vec![t.clone()]
        }
        Op::Transpose { perm } => {
            let x = inputs[0];
            let mut seen = vec![false; x.rank()];
            if perm.len() != x.rank() || perm.iter().any(|&p| p >= x.rank() || std::mem::replace(&mut seen[p], true)) {
                return Err(format!("transpose perm {perm:?} is not a permutation of the {} dims of {x}", x.rank()));
            }
            vec![TensorType::new(x.dtype, perm.iter().map(|&p| x.shape[p].clone()).collect())]
        }
        Op::Broadcast { dims: map } => {
            let t = one_declared(op, declared)?;
            let x = inputs[0];
            need_same_dtype(x, t, "broadcast")?;
            if map.len() != x.rank() {
                return Err(format!("broadcast dims {map:?} must name one output dim per input dim of {x}"));
            }
            if map.windows(2).any(|w| w[0] >= w[1]) || map.iter().any(|&d| d >= t.rank()) {
                return Err(format!("broadcast dims {map:?} must be increasing and below the output rank {}", t.rank()));
            }
            for (i, &o) in map.iter().enumerate() {
                let ok = same_dim(&x.shape[i], &t.shape[o], dims) || resolve_dim(&x.shape[i], dims) == Some(1);
                if !ok {
                    return Err(format!("broadcast: input dim {i} ({}) cannot stretch to output dim {o} ({})", x.shape[i], t.shape[o]));
                }
            }
            vec![t.clone()]
        }
        Op::Matmul { transpose_a, transpose_b } => {
            let (a, b) = (inputs[0], inputs[1]);
            need_float(a, "matmul lhs")?;
            need_same_dtype(a, b, "matmul")?;
            if a.rank() < 2 || b.rank() < 2 {
                return Err(format!("matmul operands must have rank >= 2, found {a} and {b}"));
            }
            let (ra, rb) = (a.rank(), b.rank());
            let (m, ka) = if *transpose_a { (&a.shape[ra - 1], &a.shape[ra - 2]) } else { (&a.shape[ra - 2], &a.shape[ra - 1]) };
            let (kb, n) = if *transpose_b { (&b.shape[rb - 1], &b.shape[rb - 2]) } else { (&b.shape[rb - 2], &b.shape[rb - 1]) };
            need_dim(ka, kb, dims, "matmul: contraction dims differ")?;
            if rb > 2 && !same_shape(&a.shape[..ra - 2], &b.shape[..rb - 2], dims) {
                return Err(format!("matmul: batch dims differ, {a} and {b}"));
            }
            let mut s = a.shape[..ra - 2].to_vec();
            s.push(m.clone());
            s.push(n.clone());
            vec![TensorType::new(a.dtype, s)]
        }
        _ => unreachable!("invariant: `infer_types` routes only its ops to primitive_types"),
    })
}

/// The result types of the float8 primitives: the scale of an amax and the scaled GEMM.
fn float8_types(op: &Op, inputs: &[&TensorType], declared: Option<&[TensorType]>, ctx: &InferCtx) -> Result<Vec<TensorType>, String> {
    let dims = ctx.dims;
    Ok(match op {
        Op::Fp8Scale { .. } => {
            need_float(inputs[0], "fp8_scale amax")?;
            vec![TensorType::new(DType::F32, inputs[0].shape.clone())]
        }
        Op::ScaledMatmul { transpose_a, transpose_b, .. } => {
            let (a, b, sa, sb) = (inputs[0], inputs[1], inputs[2], inputs[3]);
            for (t, what) in [(a, "lhs"), (b, "rhs")] {
                if crate::fp8::fp8_max(t.dtype).is_none() {
                    return Err(format!("scaled_matmul {what} must be f8e4m3 or f8e5m2, found {t}"));
                }
            }
            if a.rank() < 2 || b.rank() != 2 {
                return Err(format!("scaled_matmul takes a lhs of rank >= 2 and a 2-D rhs, found {a} and {b}"));
            }
            if *transpose_a && a.rank() != 2 {
                return Err(format!("scaled_matmul with transpose_a takes a 2-D lhs, found {a}"));
            }
            let ra = a.rank();
            let (m, ka) = if *transpose_a { (&a.shape[1], &a.shape[0]) } else { (&a.shape[ra - 2], &a.shape[ra - 1]) };
            let (kb, n) = if *transpose_b { (&b.shape[1], &b.shape[0]) } else { (&b.shape[0], &b.shape[1]) };
            need_dim(ka, kb, dims, "scaled_matmul: contraction dims differ")?;
            let mut rows = a.shape[..ra - 2].to_vec();
            rows.push(m.clone());
            for (s, want, what) in [(sa, &rows, "row scale sa"), (sb, &vec![n.clone()], "column scale sb")] {
                if s.dtype != DType::F32 || !(s.rank() == 0 || same_shape(&s.shape, want, dims)) {
                    return Err(format!(
                        "scaled_matmul {what} must be f32[] or f32[{}], found {s}",
                        want.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
                    ));
                }
            }
            let t = one_declared(op, declared)?;
            if !matches!(t.dtype, DType::F32 | DType::BF16 | DType::F16) {
                return Err(format!("scaled_matmul produces f32, bf16 or f16, declared {t}"));
            }
            let mut s = rows;
            s.push(n.clone());
            if !same_shape(&t.shape, &s, dims) {
                return Err(format!("scaled_matmul of {a} and {b} is [{}], declared {t}", s.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")));
            }
            vec![t.clone()]
        }
        _ => unreachable!("invariant: `infer_types` routes only its ops to float8_types"),
    })
}

/// The result types of gathers and scatter-adds over a table (whole or a row shard).
fn table_types(op: &Op, inputs: &[&TensorType], declared: Option<&[TensorType]>, ctx: &InferCtx) -> Result<Vec<TensorType>, String> {
    let dims = ctx.dims;
    Ok(match op {
        Op::Gather => vec![gather_type(inputs[0], inputs[1], "gather")?],
        Op::GatherShard => {
            shard_checks(inputs[2], "gather_shard")?;
            vec![gather_type(inputs[0], inputs[1], "gather_shard")?]
        }
        Op::ScatterAdd => vec![scatter_add_type(inputs[0], inputs[1], one_declared(op, declared)?, dims, "scatter_add")?],
        Op::ScatterAddShard => {
            shard_checks(inputs[2], "scatter_add_shard")?;
            vec![scatter_add_type(inputs[0], inputs[1], one_declared(op, declared)?, dims, "scatter_add_shard")?]
        }
        _ => unreachable!("invariant: `infer_types` routes only its ops to table_types"),
    })
}

/// The result types of constants and the optimizer ops.
fn optimizer_types(op: &Op, inputs: &[&TensorType], declared: Option<&[TensorType]>, ctx: &InferCtx) -> Result<Vec<TensorType>, String> {
    let dims = ctx.dims;
    Ok(match op {
        Op::Constant { .. } => vec![one_declared(op, declared)?.clone()],
        Op::LrSchedule(_) => {
            need_int(inputs[0], "lr_schedule step")?;
            need_rank(inputs[0], 0, "lr_schedule step")?;
            vec![TensorType::scalar(DType::F32)]
        }
        Op::AdamW(_) => {
            let (p, g, m, v, lr, step) = (inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5]);
            need_float(p, "adamw param")?;
            need_same_type(g, p, dims, "adamw: grad must have the type of the param")?;
            need_same_type(m, p, dims, "adamw: first moment must have the type of the param")?;
            need_same_type(v, p, dims, "adamw: second moment must have the type of the param")?;
            need_same_type(lr, &TensorType::scalar(DType::F32), dims, "adamw: lr must be f32[]")?;
            need_int(step, "adamw step")?;
            need_rank(step, 0, "adamw step")?;
            vec![p.clone(), p.clone(), p.clone()]
        }
        _ => unreachable!("invariant: `infer_types` routes only its ops to optimizer_types"),
    })
}

/// The result types of collectives and rank-local shard slicing.
fn collective_types(op: &Op, inputs: &[&TensorType], ctx: &InferCtx) -> Result<Vec<TensorType>, String> {
    let dims = ctx.dims;
    Ok(match op {
        Op::AllGather { dim, size, .. }
        | Op::ReduceScatter { dim, size, .. }
        | Op::TakeShard { dim, size, .. }
        | Op::PlaceShard { dim, size, .. }
        | Op::RingSlice { dim, size, .. }
        | Op::RingConcat { dim, size, .. } => {
            let x = inputs[0];
            if let Some(i) = inputs.iter().position(|t| !t.same_as(x, dims)) {
                return Err(format!("{}: operand {i} is {}, operand 0 {x}; every chunk must have the same type", op.name(), inputs[i]));
            }
            if let Op::RingSlice { size, shift, .. } = op
                && shift >= size
            {
                return Err(format!("ring_slice: needs shift < size, found shift = {shift}, size = {size}"));
            }
            need_float(x, &format!("{} operand", op.name()))?;
            let d = *dim as usize;
            if d >= x.rank() {
                return Err(format!("{}: dim {d} is out of range for {x}", op.name()));
            }
            if *size == 0 {
                return Err(format!("{}: size must be at least 1", op.name()));
            }
            let n = resolve_dim(&x.shape[d], dims).ok_or_else(|| format!("{}: dim {} is not bound in `dims`", op.name(), x.shape[d]))?;
            let size = u64::from(*size);
            let mut s = x.shape.clone();
            s[d] = if matches!(op, Op::AllGather { .. } | Op::PlaceShard { .. } | Op::RingConcat { .. }) {
                Dim::Fixed(n.checked_mul(size).ok_or_else(|| format!("{}: dim {d} overflows", op.name()))?)
            } else {
                if !n.is_multiple_of(size) {
                    return Err(format!("{}: dim {d} of {x} is not divisible by size {size}", op.name()));
                }
                Dim::Fixed(n / size)
            };
            vec![TensorType::new(x.dtype, s)]
        }
        Op::RingShift { size, shift, .. } => {
            need_float(inputs[0], "ring_shift operand")?;
            if *size == 0 || shift >= size {
                return Err(format!("ring_shift: needs 0 <= shift < size, found shift = {shift}, size = {size}"));
            }
            vec![inputs[0].clone()]
        }
        Op::AllReduce { .. } => {
            need_float(inputs[0], "all_reduce operand")?;
            vec![inputs[0].clone()]
        }
        _ => unreachable!("invariant: `infer_types` routes only its ops to collective_types"),
    })
}

/// The result types of the ops that run a block: `repeat` and `kernel`.
fn region_types(op: &Op, inputs: &[&TensorType], ctx: &InferCtx) -> Result<Vec<TensorType>, String> {
    let dims = ctx.dims;
    Ok(match op {
        Op::Repeat { block, count, carry, stacked, prefetch, .. } => {
            let region = ctx.blocks.get(block.index()).ok_or_else(|| format!("repeat names block #{} which does not exist", block.0))?;
            let (nc, ns, np) = (*carry as usize, *stacked as usize, *prefetch as usize);
            // The block's arguments are the operands with the `prefetch` prefetched carries
            // (which have no operand) after the carried ones; likewise its outputs and the results.
            if inputs.len() + np != region.args.len() {
                let prefetched = if np > 0 { format!(" (and {np} prefetched carries)") } else { String::new() };
                return Err(format!("repeat passes {} operands{prefetched} to @{} which takes {}", inputs.len(), region.name, region.args.len()));
            }
            if nc + ns > inputs.len() {
                return Err(format!("repeat: carry ({nc}) + stacked ({ns}) exceed the {} operands", inputs.len()));
            }
            if region.outputs.len() < nc + np {
                return Err(format!("repeat: @{} returns {} values, fewer than carry + prefetch = {}", region.name, region.outputs.len(), nc + np));
            }
            let layers = Dim::Fixed(u64::from(*count));
            let arg_of_operand = |i: usize| if i < nc { i } else { i + np };
            for (i, inp) in inputs.iter().enumerate() {
                let arg_ty = region.ty(region.args[arg_of_operand(i)].value);
                if i >= nc && i < nc + ns {
                    if inp.rank() != arg_ty.rank() + 1
                        || !same_dim(&inp.shape[0], &layers, dims)
                        || !same_shape(&inp.shape[1..], &arg_ty.shape, dims)
                        || inp.dtype != arg_ty.dtype
                    {
                        return Err(format!("repeat: stacked operand {i} is {inp}, @{} expects [{count}] + {arg_ty}", region.name));
                    }
                } else if !inp.same_as(arg_ty, dims) {
                    return Err(format!("repeat: operand {i} is {inp}, @{} expects {arg_ty}", region.name));
                }
            }
            let mut out = Vec::new();
            for (i, o) in region.outputs.iter().enumerate() {
                let t = region.ty(o.value);
                if i < nc + np {
                    let carried = region.ty(region.args[i].value);
                    if !t.same_as(carried, dims) {
                        return Err(format!("repeat: @{} returns {t} for carried value {i} of type {carried}", region.name));
                    }
                    if i < nc {
                        out.push(t.clone());
                    }
                } else {
                    let mut s = vec![layers.clone()];
                    s.extend(t.shape.iter().cloned());
                    out.push(TensorType::new(t.dtype, s));
                }
            }
            out
        }
        Op::Kernel { body, .. } => {
            let region = ctx.blocks.get(body.index()).ok_or_else(|| format!("kernel names block #{} which does not exist", body.0))?;
            if inputs.len() != region.args.len() {
                return Err(format!("kernel passes {} operands to @{} which takes {}", inputs.len(), region.name, region.args.len()));
            }
            for (i, (inp, arg)) in inputs.iter().zip(&region.args).enumerate() {
                let arg_ty = region.ty(arg.value);
                if !inp.same_as(arg_ty, dims) {
                    return Err(format!("kernel: operand {i} is {inp}, @{} expects {arg_ty}", region.name));
                }
            }
            region.outputs.iter().map(|o| region.ty(o.value).clone()).collect()
        }
        _ => unreachable!("invariant: `infer_types` routes only its ops to region_types"),
    })
}

fn attention_checks(q: &TensorType, k: &TensorType, v: &TensorType, dims: &DimTable) -> Result<(), String> {
    need_float(q, "attention q")?;
    need_rank(q, 4, "attention q [batch, seq, heads, head_dim]")?;
    need_rank(k, 4, "attention k [batch, seq, kv_heads, head_dim]")?;
    need_same_dtype(q, k, "attention q/k")?;
    need_same_type(k, v, dims, "attention: k and v differ")?;
    need_dim(&q.shape[0], &k.shape[0], dims, "attention: batch of q and k differ")?;
    need_dim(&q.shape[1], &k.shape[1], dims, "attention: seq of q and k differ")?;
    need_dim(&q.shape[3], &k.shape[3], dims, "attention: head_dim of q and k differ")?;
    match (resolve_dim(&q.shape[2], dims), resolve_dim(&k.shape[2], dims)) {
        (Some(hq), Some(hk)) if hk > 0 && hq % hk == 0 => Ok(()),
        _ => Err(format!("attention: query heads ({}) must be a multiple of kv heads ({})", q.shape[2], k.shape[2])),
    }
}

/// Rows `idx` of `table` (`gather`, `gather_shard`): `[idx..., table row...]`.
fn gather_type(table: &TensorType, idx: &TensorType, what: &str) -> Result<TensorType, String> {
    need_int(idx, &format!("{what} indices"))?;
    if table.rank() < 1 {
        return Err(format!("{what} table must have rank >= 1"));
    }
    let mut s = idx.shape.clone();
    s.extend(table.shape[1..].iter().cloned());
    Ok(TensorType::new(table.dtype, s))
}

/// The declared table `t` of a `scatter_add(_shard)` of `src` rows at `idx`, checked.
fn scatter_add_type(idx: &TensorType, src: &TensorType, t: &TensorType, dims: &DimTable, what: &str) -> Result<TensorType, String> {
    need_int(idx, &format!("{what} indices"))?;
    need_float(src, &format!("{what} source"))?;
    need_same_dtype(src, t, what)?;
    let k = idx.rank();
    if src.rank() < k || !same_shape(&src.shape[..k], &idx.shape, dims) {
        return Err(format!("{what}: source {src} must start with the index shape {}", shape_str(&idx.shape)));
    }
    if t.rank() != src.rank() - k + 1 || !same_shape(&t.shape[1..], &src.shape[k..], dims) {
        return Err(format!("{what}: result {t} must be [rows, {}]", shape_str(&src.shape[k..])));
    }
    Ok(t.clone())
}

/// `shard` of the vocabulary-parallel cross-entropy and embedding: the one-hot `f32[n]` of the
/// rank's shard.
fn shard_checks(shard: &TensorType, what: &str) -> Result<(), String> {
    if shard.dtype != DType::F32 || shard.rank() != 1 {
        return Err(format!("{what}: shard must be the one-hot f32[shards] of the vocabulary shard, found {shard}"));
    }
    Ok(())
}

/// `f32[..., last]` for targets `[...]`.
fn stat_type(targets: &TensorType, last: Dim) -> TensorType {
    let mut shape = targets.shape.clone();
    shape.push(last);
    TensorType::new(DType::F32, shape)
}

fn cross_entropy_checks(logits: &TensorType, targets: &TensorType, dims: &DimTable) -> Result<(), String> {
    need_float(logits, "cross_entropy logits")?;
    need_int(targets, "cross_entropy targets")?;
    if logits.rank() != targets.rank() + 1 || !same_shape(&logits.shape[..targets.rank()], &targets.shape, dims) {
        return Err(format!("cross_entropy: logits {logits} must be targets {targets} plus a vocab dim"));
    }
    Ok(())
}
