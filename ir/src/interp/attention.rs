//! Scaled dot-product attention (causal or not, grouped-query) and its backward on host
//! tensors: per (batch, head) strided GEMMs straight on the `[b, s, h, d]` layout.

use crate::interp::ops::{ResultType, float_result, floats};
use crate::interp::tensor::{MatMut, MatRef, Real, Tensor, gemm, shape_str};

/// Sizes of one attention problem.
#[derive(Clone, Copy)]
struct Sizes {
    b: usize,
    s: usize,
    hq: usize,
    hkv: usize,
    d: usize,
}

impl Sizes {
    /// Offset of query head `h` of batch `bi` in a `[b, s, hq, d]` tensor; rows step by `hq * d`.
    fn q_off(&self, bi: usize, h: usize) -> usize {
        bi * self.s * self.hq * self.d + h * self.d
    }

    /// Offset of the kv head that query head `h` reads (GQA) in a `[b, s, hkv, d]` tensor.
    fn kv_off(&self, bi: usize, h: usize) -> usize {
        let kh = h / (self.hq / self.hkv);
        bi * self.s * self.hkv * self.d + kh * self.d
    }

    /// Offset of row 0 of (batch, head) in the `[b, hq, s]` logsumexp.
    fn lse_off(&self, bi: usize, h: usize) -> usize {
        (bi * self.hq + h) * self.s
    }
}

fn sizes<T: Real>(q: &Tensor<T>, k: &Tensor<T>, v: &Tensor<T>) -> Result<Sizes, String> {
    let &[b, s, hq, d] = q.shape.as_slice() else {
        return Err(format!("attention q must be [batch, seq, heads, head_dim], found {}", q.type_string()));
    };
    let &[kb, ks, hkv, kd] = k.shape.as_slice() else {
        return Err(format!("attention k must be [batch, seq, kv_heads, head_dim], found {}", k.type_string()));
    };
    if (kb, ks, kd) != (b, s, d) {
        return Err(format!("attention: k {} does not match q {}", shape_str(&k.shape), shape_str(&q.shape)));
    }
    if v.shape != k.shape {
        return Err(format!("attention: v {} does not match k {}", shape_str(&v.shape), shape_str(&k.shape)));
    }
    if hkv == 0 || hq % hkv != 0 {
        return Err(format!("attention: query heads ({hq}) must be a multiple of kv heads ({hkv})"));
    }
    Ok(Sizes { b, s, hq, hkv, d })
}

/// `scale * Q K^T` for (batch `bi`, query head `h`) into the `s x s` scratch `sc`.
fn scores<T: Real>(z: &Sizes, q: &[T], k: &[T], bi: usize, h: usize, scale: T, sc: &mut [T]) {
    let s = z.s;
    gemm(
        s,
        z.d,
        s,
        scale,
        MatRef { data: q, off: z.q_off(bi, h), rs: z.hq * z.d, cs: 1 },
        MatRef { data: k, off: z.kv_off(bi, h), rs: 1, cs: z.hkv * z.d },
        T::zero(),
        MatMut { data: sc, off: 0, rs: s, cs: 1 },
    );
}

/// `(q, k, v) -> (out, lse)`: softmax with max subtraction in `T`; `lse` is the natural-log
/// logsumexp of the scaled, masked scores.
pub(crate) fn attention<T: Real>(q: &Tensor<T>, k: &Tensor<T>, v: &Tensor<T>, causal: bool, scale: f64, rts: &[ResultType]) -> Result<Vec<Tensor<T>>, String> {
    let z = sizes(q, k, v)?;
    let (qs, ks, vs) = (floats(q, "attention q")?, floats(k, "attention k")?, floats(v, "attention v")?);
    let s = z.s;
    let scale = T::from_f64(scale);
    let mut out = vec![T::zero(); qs.len()];
    let mut lse = vec![T::zero(); z.b * z.hq * s];
    let mut sc = vec![T::zero(); s * s];
    for bi in 0..z.b {
        for h in 0..z.hq {
            scores(&z, qs, ks, bi, h, scale, &mut sc);
            let lo = z.lse_off(bi, h);
            for i in 0..s {
                let row = &mut sc[i * s..(i + 1) * s];
                let valid = if causal { i + 1 } else { s };
                let mx = row[..valid].iter().fold(T::neg_infinity(), |m, &x| if x > m || x.is_nan() { x } else { m });
                let mut sum = T::zero();
                for x in &mut row[..valid] {
                    *x = (*x - mx).exp();
                    sum = sum + *x;
                }
                for x in &mut row[valid..] {
                    *x = T::zero();
                }
                let inv = sum.recip();
                for x in &mut row[..valid] {
                    *x = *x * inv;
                }
                lse[lo + i] = mx + sum.ln();
            }
            gemm(
                s,
                s,
                z.d,
                T::one(),
                MatRef { data: &sc, off: 0, rs: s, cs: 1 },
                MatRef { data: vs, off: z.kv_off(bi, h), rs: z.hkv * z.d, cs: 1 },
                T::zero(),
                MatMut { data: &mut out, off: z.q_off(bi, h), rs: z.hq * z.d, cs: 1 },
            );
        }
    }
    Ok(vec![float_result(&rts[0], q.shape.clone(), out)?, float_result(&rts[1], vec![z.b, z.hq, s], lse)?])
}

/// `(q, k, v, out, lse, dout) -> (dq, dk, dv)`, the softmax recomputed from `lse`.
pub(crate) fn attention_bwd<T: Real>(x: &[&Tensor<T>], causal: bool, scale: f64, rts: &[ResultType]) -> Result<Vec<Tensor<T>>, String> {
    let (q, k, v, o, lse, dout) = (x[0], x[1], x[2], x[3], x[4], x[5]);
    let z = sizes(q, k, v)?;
    if o.shape != q.shape || dout.shape != q.shape {
        return Err(format!("attention_bwd: out {} and dout {} must have the shape of q {}", shape_str(&o.shape), shape_str(&dout.shape), shape_str(&q.shape)));
    }
    if lse.shape != [z.b, z.hq, z.s] {
        return Err(format!("attention_bwd: lse must be [{}, {}, {}], found {}", z.b, z.hq, z.s, shape_str(&lse.shape)));
    }
    let (qs, ks, vs) = (floats(q, "attention q")?, floats(k, "attention k")?, floats(v, "attention v")?);
    let (os, ls, dos) = (floats(o, "attention out")?, floats(lse, "attention lse")?, floats(dout, "attention dout")?);
    let s = z.s;
    let scale = T::from_f64(scale);
    let mut dq = vec![T::zero(); qs.len()];
    let mut dk = vec![T::zero(); ks.len()];
    let mut dv = vec![T::zero(); vs.len()];
    let mut p = vec![T::zero(); s * s];
    let mut ds = vec![T::zero(); s * s];
    let (qrs, kvrs) = (z.hq * z.d, z.hkv * z.d);
    for bi in 0..z.b {
        for h in 0..z.hq {
            let (qo, ko, lo) = (z.q_off(bi, h), z.kv_off(bi, h), z.lse_off(bi, h));
            scores(&z, qs, ks, bi, h, scale, &mut p);
            for i in 0..s {
                let l = ls[lo + i];
                for (j, x) in p[i * s..(i + 1) * s].iter_mut().enumerate() {
                    *x = if causal && j > i { T::zero() } else { (*x - l).exp() };
                }
            }
            // dv += P^T dout
            gemm(
                s,
                s,
                z.d,
                T::one(),
                MatRef { data: &p, off: 0, rs: 1, cs: s },
                MatRef { data: dos, off: qo, rs: qrs, cs: 1 },
                T::one(),
                MatMut { data: &mut dv, off: ko, rs: kvrs, cs: 1 },
            );
            // dP = dout V^T
            gemm(
                s,
                z.d,
                s,
                T::one(),
                MatRef { data: dos, off: qo, rs: qrs, cs: 1 },
                MatRef { data: vs, off: ko, rs: 1, cs: kvrs },
                T::zero(),
                MatMut { data: &mut ds, off: 0, rs: s, cs: 1 },
            );
            // dS = P (dP - D), D_i = dout_i . out_i
            for i in 0..s {
                let r = qo + i * qrs;
                let di = dos[r..r + z.d].iter().zip(&os[r..r + z.d]).fold(T::zero(), |acc, (&a, &b)| acc + a * b);
                for (dsx, &px) in ds[i * s..(i + 1) * s].iter_mut().zip(&p[i * s..(i + 1) * s]) {
                    *dsx = px * (*dsx - di);
                }
            }
            // dq = scale dS K
            gemm(
                s,
                s,
                z.d,
                scale,
                MatRef { data: &ds, off: 0, rs: s, cs: 1 },
                MatRef { data: ks, off: ko, rs: kvrs, cs: 1 },
                T::zero(),
                MatMut { data: &mut dq, off: qo, rs: qrs, cs: 1 },
            );
            // dk += scale dS^T Q
            gemm(
                s,
                s,
                z.d,
                scale,
                MatRef { data: &ds, off: 0, rs: 1, cs: s },
                MatRef { data: qs, off: qo, rs: qrs, cs: 1 },
                T::one(),
                MatMut { data: &mut dk, off: ko, rs: kvrs, cs: 1 },
            );
        }
    }
    Ok(vec![float_result(&rts[0], q.shape.clone(), dq)?, float_result(&rts[1], k.shape.clone(), dk)?, float_result(&rts[2], v.shape.clone(), dv)?])
}
