//! `linear` and `matmul` on host tensors: strided `matrixmultiply` GEMMs (transposes are
//! strides, never copies), one call when the right operand is shared across the batch.

use crate::interp::ops::{ResultType, float_result, floats};
use crate::interp::tensor::{MatMut, MatRef, Real, Tensor, gemm, shape_str};

/// `x [..., in] @ w[out, in]^T -> [..., out]`: one GEMM over all leading dims.
pub(crate) fn linear<T: Real>(x: &Tensor<T>, w: &Tensor<T>, rt: &ResultType) -> Result<Tensor<T>, String> {
    let xs = floats(x, "linear input")?;
    let ws = floats(w, "linear weight")?;
    let &[out_f, in_f] = w.shape.as_slice() else {
        return Err(format!("linear weight must be [out, in], found {}", w.type_string()));
    };
    let Some((&k, lead)) = x.shape.split_last() else {
        return Err("linear input must have rank >= 1".into());
    };
    if k != in_f {
        return Err(format!("linear: input features {k} do not match the weight {}", shape_str(&w.shape)));
    }
    let rows: usize = lead.iter().product();
    let mut out = vec![T::zero(); rows * out_f];
    gemm(
        rows,
        k,
        out_f,
        T::one(),
        MatRef { data: xs, off: 0, rs: k, cs: 1 },
        // B(kk, j) = w[j, kk]
        MatRef { data: ws, off: 0, rs: 1, cs: in_f },
        T::zero(),
        MatMut { data: &mut out, off: 0, rs: out_f, cs: 1 },
    );
    let mut shape = lead.to_vec();
    shape.push(out_f);
    float_result(rt, shape, out)
}

/// `a [..., m, k] (or [..., k, m]) @ b [k, n] (or [n, k]) or batched b [..., k, n]`.
pub(crate) fn matmul<T: Real>(a: &Tensor<T>, b: &Tensor<T>, ta: bool, tb: bool, rt: &ResultType) -> Result<Tensor<T>, String> {
    let xa = floats(a, "matmul lhs")?;
    let xb = floats(b, "matmul rhs")?;
    let (ra, rb) = (a.rank(), b.rank());
    if ra < 2 || rb < 2 {
        return Err(format!("matmul operands must have rank >= 2, found {} and {}", a.type_string(), b.type_string()));
    }
    let (a0, a1) = (a.shape[ra - 2], a.shape[ra - 1]);
    let (b0, b1) = (b.shape[rb - 2], b.shape[rb - 1]);
    let (m, k) = if ta { (a1, a0) } else { (a0, a1) };
    let (kb, n) = if tb { (b1, b0) } else { (b0, b1) };
    if k != kb {
        return Err(format!("matmul: contraction dims differ, {} and {}", a.type_string(), b.type_string()));
    }
    let batch_shape = &a.shape[..ra - 2];
    if rb > 2 && b.shape[..rb - 2] != *batch_shape {
        return Err(format!("matmul: batch dims differ, {} and {}", a.type_string(), b.type_string()));
    }
    let batch: usize = batch_shape.iter().product();
    let mut out = vec![T::zero(); batch * m * n];
    // Strides of A (m x k) and B (k x n) inside one matrix of the stored layouts.
    let (rsa, csa) = if ta { (1, m) } else { (k, 1) };
    let (rsb, csb) = if tb { (1, k) } else { (n, 1) };
    if rb == 2 && !ta {
        // The rows of every batch are contiguous: one GEMM of (batch * m) rows.
        gemm(
            batch * m,
            k,
            n,
            T::one(),
            MatRef { data: xa, off: 0, rs: rsa, cs: csa },
            MatRef { data: xb, off: 0, rs: rsb, cs: csb },
            T::zero(),
            MatMut { data: &mut out, off: 0, rs: n, cs: 1 },
        );
    } else {
        let b_step = if rb > 2 { k * n } else { 0 };
        for i in 0..batch {
            gemm(
                m,
                k,
                n,
                T::one(),
                MatRef { data: xa, off: i * m * k, rs: rsa, cs: csa },
                MatRef { data: xb, off: i * b_step, rs: rsb, cs: csb },
                T::zero(),
                MatMut { data: &mut out, off: i * m * n, rs: n, cs: 1 },
            );
        }
    }
    let mut shape = batch_shape.to_vec();
    shape.push(m);
    shape.push(n);
    float_result(rt, shape, out)
}
