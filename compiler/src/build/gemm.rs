//! cuBLASLt descriptions of `gemm` kernels.
//!
//! A `gemm` body holds one `linear` or `matmul` (and possibly views), and with the residual-add
//! epilogue (`fuse` rule 11) the `add` of its product and the body's argument 2: `epilogue =
//! "add"`, `D = A B + C` with that argument as C (cuBLASLt's `beta = 1`), typed like the
//! product. Shapes are row-major; the body's argument feeding the op's first operand is `A`, the
//! second `B`, the result `C` (written as D when there is an epilogue).
//!
//! - `linear(x [..., K], w [N, K])`: `C[M, N] = A[M, K] @ B[N, K]^T` with `M` the product of
//!   `x`'s leading dims, `batch = 1`.
//! - `matmul(a, b)` with `transpose_a`/`transpose_b`: `a` is `[..., m, k]` (or `[..., k, m]`
//!   transposed), `b` is `[k, n]` or `[..., k, n]` (or `[n, k]` transposed). With a 2-D `b`
//!   and no `transpose_a`, `a`'s batch dims fold into `m`; otherwise `batch` is the product of
//!   `a`'s batch dims, and a 2-D `b` is shared by every batch (`stride_b = 0`).
//!
//! Leading dimensions are those of the stored (untransposed) row-major matrices: `lda = k`
//! (`m` when `transpose_a`), `ldb = n` (`k` when `transpose_b`), `ldc = n`. Strides are in
//! elements between consecutive batch matrices.

use titan_ir::artifact::{GemmDesc, GemmScale};
use titan_ir::{BinaryOp, DType, Graph, Op, Region, Value, ValueDef};

use super::BuildError;
use super::memory::{internal, shape_of};

/// The argument index a body value comes from through views, if any.
fn arg_index(body: &Region, mut v: Value) -> Option<usize> {
    loop {
        match body.values.get(v.index())?.def {
            ValueDef::Arg(i) => return Some(i as usize),
            ValueDef::Result { node, .. } => {
                let n = body.nodes.get(node.index())?;
                match n.op {
                    Op::Reshape => v = *n.inputs.first()?,
                    _ => return None,
                }
            }
        }
    }
}

fn prod(xs: &[u64]) -> u64 {
    xs.iter().product()
}

/// The GEMM of the `gemm` kernel body `body`.
pub fn gemm_desc(g: &Graph, body: &Region) -> Result<GemmDesc, BuildError> {
    let mut found = None;
    let mut epilogue = None;
    for n in &body.order {
        let node = body.node(*n);
        match node.op {
            Op::Linear | Op::Matmul { .. } | Op::ScaledMatmul { .. } => {
                if found.is_some() {
                    return Err(internal(format!("gemm kernel @{} has more than one linear/matmul", body.name)));
                }
                found = Some(node);
            }
            Op::Binary(BinaryOp::Add) if found.is_some() && epilogue.is_none() => epilogue = Some(node),
            Op::Reshape => {}
            ref other => return Err(internal(format!("gemm kernel @{} holds `{}`", body.name, other.name()))),
        }
    }
    let node = found.ok_or_else(|| internal(format!("gemm kernel @{} has no linear or matmul", body.name)))?;
    let (&a, &b, &c) = match (node.inputs.first(), node.inputs.get(1), node.results.first()) {
        (Some(a), Some(b), Some(c)) => (a, b, c),
        _ => return Err(internal(format!("gemm kernel @{}: malformed op", body.name))),
    };
    // The residual-add epilogue (`fuse` rule 11): `D = A B + C`, C the body's argument 2 with
    // D's type, the product read by the add only.
    if let Some(add) = epilogue {
        let other = match add.inputs.as_slice() {
            [x, y] if *x == c && *y != c => *y,
            [x, y] if *y == c && *x != c => *x,
            _ => return Err(internal(format!("gemm kernel @{}: the epilogue add must read the product once and one argument", body.name))),
        };
        let d = add.results.first().copied().ok_or_else(|| internal(format!("gemm kernel @{}: malformed add", body.name)))?;
        if matches!(node.op, Op::ScaledMatmul { .. }) || arg_index(body, other) != Some(2) || body.ty(other) != body.ty(c) || body.ty(d) != body.ty(c) {
            return Err(internal(format!("gemm kernel @{}: the epilogue add's C must be argument 2, typed like the product", body.name)));
        }
        if body.outputs.iter().any(|o| o.value == c) {
            return Err(internal(format!("gemm kernel @{}: with an add epilogue the product is not an output", body.name)));
        }
    }
    // The runtime binds A and B to the body's arguments 0 and 1 (or 0 twice).
    match (arg_index(body, a), arg_index(body, b)) {
        (Some(0), Some(1)) | (Some(0), Some(0)) => {}
        _ => return Err(internal(format!("gemm kernel @{}: A and B must be the body's first two arguments", body.name))),
    }
    // A scaled GEMM's dequantization scales are arguments 2 (rows of A) and 3 (columns of B),
    // or 2 for both when they are one value (the unit scales of `titan_ir::float8`).
    let scales = match node.op {
        Op::ScaledMatmul { fast_accum, .. } => {
            let mut modes = [GemmScale::None; 2];
            let shared = node.inputs[2] == node.inputs[3];
            for (i, mode) in modes.iter_mut().enumerate() {
                let s = node.inputs[2 + i];
                let want = if shared { 2 } else { 2 + i };
                if arg_index(body, s) != Some(want) {
                    return Err(internal(format!("gemm kernel @{}: scale {} must be the body's argument {}", body.name, i, want)));
                }
                *mode = if body.ty(s).rank() == 0 { GemmScale::Tensor } else { GemmScale::Vector };
            }
            Some((modes, fast_accum))
        }
        _ => None,
    };
    let sa = shape_of(g, body, a)?;
    let sb = shape_of(g, body, b)?;
    let (a_dtype, b_dtype, c_dtype): (DType, DType, DType) = (body.ty(a).dtype, body.ty(b).dtype, body.ty(c).dtype);
    let desc = |m: u64, n: u64, k: u64, batch: u64, ta: bool, tb: bool, stride_b: u64| GemmDesc {
        m,
        n,
        k,
        batch,
        transpose_a: ta,
        transpose_b: tb,
        lda: if ta { m } else { k },
        ldb: if tb { k } else { n },
        ldc: n,
        stride_a: m * k,
        stride_b,
        stride_c: m * n,
        a_dtype,
        b_dtype,
        c_dtype,
        compute: DType::F32,
        epilogue: if epilogue.is_some() { GemmDesc::ADD } else { "none" }.into(),
        scale_a: scales.map_or(GemmScale::None, |s| s.0[0]),
        scale_b: scales.map_or(GemmScale::None, |s| s.0[1]),
        fast_accum: scales.is_some_and(|s| s.1),
    };
    match node.op {
        Op::Linear => {
            let (Some((&k, lead)), Some(&n)) = (sa.split_last(), sb.first()) else {
                return Err(internal(format!("gemm kernel @{}: linear operands have rank 0", body.name)));
            };
            let m = prod(lead);
            Ok(desc(m, n, k, 1, false, true, n * k))
        }
        Op::Matmul { transpose_a, transpose_b } | Op::ScaledMatmul { transpose_a, transpose_b, .. } => {
            if sa.len() < 2 || sb.len() < 2 {
                return Err(internal(format!("gemm kernel @{}: matmul operands must have rank 2 or more", body.name)));
            }
            let (batch_dims, a2) = sa.split_at(sa.len() - 2);
            let (m, k) = if transpose_a { (a2[1], a2[0]) } else { (a2[0], a2[1]) };
            let b2 = &sb[sb.len() - 2..];
            let n = if transpose_b { b2[0] } else { b2[1] };
            let batch = prod(batch_dims);
            if sb.len() == 2 {
                if transpose_a { Ok(desc(m, n, k, batch, true, transpose_b, 0)) } else { Ok(desc(batch * m, n, k, 1, false, transpose_b, k * n)) }
            } else {
                Ok(desc(m, n, k, batch, transpose_a, transpose_b, k * n))
            }
        }
        _ => Err(internal("unreachable gemm op")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use titan_ir::parse::parse_and_verify;

    fn body_gemm(text: &str) -> GemmDesc {
        let g = parse_and_verify("gemm.ir", text).unwrap_or_else(|e| panic!("{e}"));
        gemm_desc(&g, &g.blocks[0]).unwrap_or_else(|e| panic!("{e}"))
    }

    const HEAD: &str = "graph @t {\n  dims {batch = 2, seq = 8}\n";

    #[test]
    fn linear_folds_leading_dims_into_m() {
        let d = body_gemm(&format!(
            "{HEAD}  block @k(%x: bf16[batch, seq, 16], %w: bf16[32, 16]) {{\n    %y = linear(%x, %w) : bf16[batch, seq, 32]\n    return %y\n  }}\n  func @main {{\n    input %x : bf16[batch, seq, 16]\n    input %w : bf16[32, 16]\n    %y = kernel(%x, %w) {{body = @k, kind = gemm}} : bf16[batch, seq, 32]\n    output y = %y\n  }}\n}}\n"
        ));
        assert_eq!((d.m, d.n, d.k, d.batch), (16, 32, 16, 1));
        assert!(!d.transpose_a && d.transpose_b);
        assert_eq!((d.lda, d.ldb, d.ldc), (16, 16, 32));
        assert_eq!((d.a_dtype, d.c_dtype, d.compute), (DType::BF16, DType::BF16, DType::F32));
    }

    #[test]
    fn weight_gradient_matmul_transposes_a() {
        let d = body_gemm(&format!(
            "{HEAD}  block @k(%dy: bf16[16, 32], %x: bf16[16, 64]) {{\n    %dw = matmul(%dy, %x) {{transpose_a = true, transpose_b = false}} : bf16[32, 64]\n    return %dw\n  }}\n  func @main {{\n    input %dy : bf16[16, 32]\n    input %x : bf16[16, 64]\n    %dw = kernel(%dy, %x) {{body = @k, kind = gemm}} : bf16[32, 64]\n    output dw = %dw\n  }}\n}}\n"
        ));
        assert_eq!((d.m, d.n, d.k, d.batch), (32, 64, 16, 1));
        assert!(d.transpose_a && !d.transpose_b);
        assert_eq!((d.lda, d.ldb, d.ldc), (32, 64, 64));
    }

    #[test]
    fn batched_matmul_with_a_shared_b() {
        let d = body_gemm(&format!(
            "{HEAD}  block @k(%a: bf16[batch, 16, 8], %b: bf16[16, 4]) {{\n    %c = matmul(%a, %b) {{transpose_a = true, transpose_b = false}} : bf16[batch, 8, 4]\n    return %c\n  }}\n  func @main {{\n    input %a : bf16[batch, 16, 8]\n    input %b : bf16[16, 4]\n    %c = kernel(%a, %b) {{body = @k, kind = gemm}} : bf16[batch, 8, 4]\n    output c = %c\n  }}\n}}\n"
        ));
        assert_eq!((d.m, d.n, d.k, d.batch), (8, 4, 16, 2));
        assert_eq!((d.stride_a, d.stride_b, d.stride_c), (128, 0, 32));
    }
}
