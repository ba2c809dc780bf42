//! Tests of the reference interpreter: every op against naive loops written here in f64,
//! backward ops against central finite differences, rounding against hand-worked values,
//! and the region machinery (`repeat`, argument checks, precision modes).

use std::f64::consts::PI;
use std::time::Instant;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use titan_ir::interp::{Data, InterpError, Interpreter, MainResult, Precision, Real, Tensor, eval_op, lr_at, rope_inv_freq, round_to_dtype};
use titan_ir::{
    AdamWConfig, ArgKind, BinaryOp, Builder, DType, DecayKind, Dim, Graph, LrSchedule, Op, Output, ReduceKind, Region, RopeConfig, RopeLayout, RopeScaling,
    TensorType, UnaryOp, Update, Value,
};

// ---------------------------------------------------------------- helpers

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

fn rand_vec(r: &mut ChaCha8Rng, n: usize) -> Vec<f64> {
    (0..n).map(|_| r.random_range(-1.0..1.0)).collect()
}

fn tf(dtype: DType, shape: &[usize], data: &[f64]) -> Tensor<f64> {
    Tensor::from_f64s(dtype, shape, data).expect("test tensor")
}

fn ti(dtype: DType, shape: &[usize], data: &[i64]) -> Tensor<f64> {
    Tensor::from_ints(dtype, shape, data.to_vec()).expect("test tensor")
}

fn fixed(dtype: DType, shape: &[usize]) -> TensorType {
    TensorType::fixed(dtype, &shape.iter().map(|&d| d as u64).collect::<Vec<_>>())
}

/// A graph whose `main` applies `op` to one argument per tensor in `args` and returns every
/// result of the op.
fn op_graph<T: Real>(op: Op, args: &[&Tensor<T>], declared: Option<TensorType>) -> Graph {
    let mut g = Graph::new("test");
    let vals: Vec<Value> = args.iter().enumerate().map(|(i, a)| g.main.add_arg(fixed(a.dtype, &a.shape), ArgKind::Input, Some(&format!("a{i}")))).collect();
    let results = {
        let mut b = g.main_builder();
        match declared {
            Some(t) => vec![b.push_typed(op, &vals, t).expect("typed op")],
            None => b.push(op, &vals).expect("op"),
        }
    };
    for r in results {
        g.main.outputs.push(Output { name: None, value: r });
    }
    g
}

fn run_op_p<T: Real>(op: Op, args: &[&Tensor<T>], declared: Option<TensorType>, precision: Precision) -> Result<Vec<Tensor<T>>, InterpError> {
    let g = op_graph(op, args, declared);
    let owned: Vec<Tensor<T>> = args.iter().map(|t| (*t).clone()).collect();
    Interpreter::new(&g, precision).run(&owned).map(|r| r.outputs)
}

/// Run one op exactly in f64.
fn run_op(op: Op, args: &[&Tensor<f64>], declared: Option<TensorType>) -> Vec<Tensor<f64>> {
    run_op_p(op, args, declared, Precision::Exact).expect("op runs")
}

fn vals(t: &Tensor<f64>) -> Vec<f64> {
    t.to_f64_vec()
}

#[track_caller]
fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs() / (1.0 + w.abs());
        assert!(err <= tol, "element {i}: got {g}, want {w} (relative error {err:e} > {tol:e})");
    }
}

/// Central finite differences of `f` at `x`.
fn fd_grad(x: &[f64], h: f64, f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let mut xs = x.to_vec();
    (0..x.len())
        .map(|i| {
            let x0 = xs[i];
            xs[i] = x0 + h;
            let up = f(&xs);
            xs[i] = x0 - h;
            let down = f(&xs);
            xs[i] = x0;
            (up - down) / (2.0 * h)
        })
        .collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

// ---------------------------------------------------------------- matmul and linear

/// Naive `[batch, m, k] x [batch or shared, k, n]` from logical (untransposed) operands.
fn naive_matmul(a: &[f64], b: &[f64], batch: usize, m: usize, k: usize, n: usize, b_batched: bool) -> Vec<f64> {
    let mut c = vec![0.0; batch * m * n];
    for bi in 0..batch {
        let bo = if b_batched { bi * k * n } else { 0 };
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for kk in 0..k {
                    s += a[bi * m * k + i * k + kk] * b[bo + kk * n + j];
                }
                c[bi * m * n + i * n + j] = s;
            }
        }
    }
    c
}

/// Transpose the last two dims of `[batch, r, c]` stored row-major.
fn transpose_last2(x: &[f64], batch: usize, r: usize, c: usize) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    for bi in 0..batch {
        for i in 0..r {
            for j in 0..c {
                out[bi * r * c + j * r + i] = x[bi * r * c + i * c + j];
            }
        }
    }
    out
}

#[test]
fn matmul_all_transpose_combos_batched_and_shared() {
    let mut r = rng(1);
    let (batch, m, k, n) = (3, 5, 4, 6);
    let a = rand_vec(&mut r, batch * m * k);
    for b_batched in [false, true] {
        let nb = if b_batched { batch } else { 1 };
        let b = rand_vec(&mut r, nb * k * n);
        let want = naive_matmul(&a, &b, batch, m, k, n, b_batched);
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let (a_data, a_shape) = if ta { (transpose_last2(&a, batch, m, k), vec![batch, k, m]) } else { (a.clone(), vec![batch, m, k]) };
            let b_data = if tb { transpose_last2(&b, nb, k, n) } else { b.clone() };
            let last2 = if tb { [n, k] } else { [k, n] };
            let b_shape: Vec<usize> = if b_batched { vec![batch, last2[0], last2[1]] } else { last2.to_vec() };
            let at = tf(DType::F32, &a_shape, &a_data);
            let bt = tf(DType::F32, &b_shape, &b_data);
            let out = run_op(Op::Matmul { transpose_a: ta, transpose_b: tb }, &[&at, &bt], None);
            assert_eq!(out[0].shape, vec![batch, m, n], "ta={ta} tb={tb} batched={b_batched}");
            assert_close(&vals(&out[0]), &want, 1e-12);
        }
    }
}

#[test]
fn matmul_f32_matches_f64_reference() {
    let mut r = rng(2);
    let (m, k, n) = (7, 9, 5);
    let a = rand_vec(&mut r, m * k);
    let b = rand_vec(&mut r, k * n);
    let want = naive_matmul(&a, &b, 1, m, k, n, false);
    let at: Tensor<f32> = tf(DType::F32, &[m, k], &a).convert();
    let bt: Tensor<f32> = tf(DType::F32, &[k, n], &b).convert();
    let out = run_op_p(Op::Matmul { transpose_a: false, transpose_b: false }, &[&at, &bt], None, Precision::Emulate).expect("runs");
    assert!(out[0].floats().is_some());
    assert_close(&out[0].to_f64_vec(), &want, 1e-5);
}

#[test]
fn linear_is_x_times_w_transposed() {
    let mut r = rng(3);
    let (b, s, fin, fout) = (2, 3, 4, 5);
    let x = rand_vec(&mut r, b * s * fin);
    let w = rand_vec(&mut r, fout * fin);
    let mut want = vec![0.0; b * s * fout];
    for row in 0..b * s {
        for o in 0..fout {
            want[row * fout + o] = (0..fin).map(|i| x[row * fin + i] * w[o * fin + i]).sum();
        }
    }
    let out = run_op(Op::Linear, &[&tf(DType::F32, &[b, s, fin], &x), &tf(DType::F32, &[fout, fin], &w)], None);
    assert_eq!(out[0].shape, vec![b, s, fout]);
    assert_close(&vals(&out[0]), &want, 1e-12);
}

#[test]
fn transformer_sized_gemms_and_attention_are_fast() {
    // [8 * 64, 64] x [64, 192]: the leading dims flatten into one GEMM.
    let mut r = rng(4);
    let x: Tensor<f32> = tf(DType::F32, &[8, 64, 64], &rand_vec(&mut r, 8 * 64 * 64)).convert();
    let w: Tensor<f32> = tf(DType::F32, &[64, 192], &rand_vec(&mut r, 64 * 192)).convert();
    let g = op_graph(Op::Matmul { transpose_a: false, transpose_b: false }, &[&x, &w], None);
    let interp = Interpreter::new(&g, Precision::Emulate);
    let args = vec![x, w];
    let t0 = Instant::now();
    for _ in 0..20 {
        let out = interp.run(&args).expect("runs");
        assert_eq!(out.outputs[0].shape, vec![8, 64, 192]);
    }
    let per = t0.elapsed().as_secs_f64() / 20.0;
    eprintln!("matmul [512, 64] x [64, 192]: {:.3} ms", per * 1e3);
    assert!(per < 0.05, "a [512, 64] x [64, 192] matmul took {per:.4} s");

    // Attention forward + backward at seq 256, 4 heads of 64.
    let (b, s, h, d) = (1, 256, 4, 64);
    let q: Tensor<f32> = tf(DType::F32, &[b, s, h, d], &rand_vec(&mut r, b * s * h * d)).convert();
    let k: Tensor<f32> = tf(DType::F32, &[b, s, h, d], &rand_vec(&mut r, b * s * h * d)).convert();
    let v: Tensor<f32> = tf(DType::F32, &[b, s, h, d], &rand_vec(&mut r, b * s * h * d)).convert();
    let t0 = Instant::now();
    let fwd_types = [fixed(DType::F32, &[b, s, h, d]), fixed(DType::F32, &[b, h, s])];
    let att = Op::Attention { causal: true, scale: 0.125 };
    let fwd = eval_op(&att, &[&q, &k, &v], &fwd_types, &Default::default(), Precision::Emulate).expect("attention");
    let bwd_types = [fixed(DType::F32, &[b, s, h, d]), fixed(DType::F32, &[b, s, h, d]), fixed(DType::F32, &[b, s, h, d])];
    let bwd = Op::AttentionBwd { causal: true, scale: 0.125 };
    let grads = eval_op(&bwd, &[&q, &k, &v, &fwd[0], &fwd[1], &q], &bwd_types, &Default::default(), Precision::Emulate).expect("attention_bwd");
    assert_eq!(grads.len(), 3);
    let secs = t0.elapsed().as_secs_f64();
    eprintln!("attention fwd + bwd, seq 256, 4 heads of 64: {:.3} ms", secs * 1e3);
    assert!(secs < 1.0, "attention fwd + bwd at seq 256 took {secs:.3} s");
}

// ---------------------------------------------------------------- rmsnorm

fn naive_rmsnorm(x: &[f64], w: &[f64], d: usize, eps: f64) -> Vec<f64> {
    let mut out = Vec::new();
    for row in x.chunks(d) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
        let r = 1.0 / (ms + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(v, g)| v * r * g));
    }
    out
}

#[test]
fn rmsnorm_matches_naive() {
    let mut r = rng(5);
    let (rows, d, eps) = (6, 8, 1e-5);
    let x = rand_vec(&mut r, rows * d);
    let w = rand_vec(&mut r, d);
    let out = run_op(Op::RmsNorm { eps }, &[&tf(DType::F32, &[2, 3, d], &x), &tf(DType::F32, &[d], &w)], None);
    assert_close(&vals(&out[0]), &naive_rmsnorm(&x, &w, d, eps), 1e-13);
}

#[test]
fn rmsnorm_bwd_matches_finite_differences() {
    let mut r = rng(6);
    let (rows, d, eps) = (3, 5, 1e-6);
    let x = rand_vec(&mut r, rows * d);
    let w = rand_vec(&mut r, d);
    let c = rand_vec(&mut r, rows * d);
    let loss = |x: &[f64], w: &[f64]| dot(&naive_rmsnorm(x, w, d, eps), &c);
    let out = run_op(Op::RmsNormBwd { eps }, &[&tf(DType::F32, &[rows, d], &x), &tf(DType::F32, &[d], &w), &tf(DType::F32, &[rows, d], &c)], None);
    let dx_fd = fd_grad(&x, 1e-6, |xs| loss(xs, &w));
    let dw_fd = fd_grad(&w, 1e-6, |ws| loss(&x, ws));
    assert_close(&vals(&out[0]), &dx_fd, 1e-7);
    assert_close(&vals(&out[1]), &dw_fd, 1e-7);
    // The forward through the interpreter agrees with the naive loss too.
    let y = run_op(Op::RmsNorm { eps }, &[&tf(DType::F32, &[rows, d], &x), &tf(DType::F32, &[d], &w)], None);
    assert_close(&[dot(&vals(&y[0]), &c)], &[loss(&x, &w)], 1e-13);
}

#[test]
fn rmsnorm_emulate_rounds_the_normalized_value_before_the_weight() {
    // x in bf16 with a weight of 3: y = round(round(x r) * 3), not round(x r * 3).
    let x = [1.0, 1.0 + 2f64.powi(-7), 1.0, 1.0];
    let w = [3.0, 3.0, 3.0, 3.0];
    let xt: Tensor<f64> = tf(DType::BF16, &[1, 4], &x);
    let wt: Tensor<f64> = tf(DType::BF16, &[4], &w);
    let out = run_op_p(Op::RmsNorm { eps: 0.0 }, &[&xt, &wt], None, Precision::Emulate).expect("runs");
    let want: Vec<f64> =
        naive_rmsnorm(&x, &[1.0; 4], 4, 0.0).iter().map(|&n| f64::from(round_to_dtype(round_to_dtype(n as f32, DType::BF16) * 3.0, DType::BF16))).collect();
    assert_eq!(vals(&out[0]), want);
}

// ---------------------------------------------------------------- rope

fn rope_cfg(theta: f64, layout: RopeLayout, inverse: bool) -> RopeConfig {
    RopeConfig { theta, layout, scaling: None, inverse }
}

fn head_norms(x: &[f64], d: usize) -> Vec<f64> {
    x.chunks(d).map(|h| h.iter().map(|v| v * v).sum::<f64>().sqrt()).collect()
}

#[test]
fn rope_preserves_norms_and_inverse_undoes_it() {
    let mut r = rng(7);
    let (b, s, h, d) = (2, 5, 3, 8);
    let x = rand_vec(&mut r, b * s * h * d);
    let xt = tf(DType::F32, &[b, s, h, d], &x);
    for layout in [RopeLayout::Half, RopeLayout::Interleaved] {
        let y = run_op(Op::Rope(rope_cfg(10000.0, layout, false)), &[&xt], None);
        assert_close(&head_norms(&vals(&y[0]), d), &head_norms(&x, d), 1e-13);
        // Position 0 is not rotated, later positions are.
        assert_close(&vals(&y[0])[..h * d], &x[..h * d], 0.0);
        assert!(vals(&y[0])[h * d..2 * h * d].iter().zip(&x[h * d..2 * h * d]).any(|(a, b)| (a - b).abs() > 1e-3));
        let back = run_op(Op::Rope(rope_cfg(10000.0, layout, true)), &[&y[0]], None);
        assert_close(&vals(&back[0]), &x, 1e-13);
    }
}

#[test]
fn rope_hand_computed_values_at_position_one() {
    // d = 4, theta = 100: inv_freq = [1, 0.1].
    let x = [0.5, -0.25, 2.0, 1.0, 1.0, 2.0, 3.0, 4.0];
    let xt = tf(DType::F32, &[1, 2, 1, 4], &x);
    let (c1, s1, c2, s2) = (1f64.cos(), 1f64.sin(), 0.1f64.cos(), 0.1f64.sin());
    let half = run_op(Op::Rope(rope_cfg(100.0, RopeLayout::Half, false)), &[&xt], None);
    let want_half = [0.5, -0.25, 2.0, 1.0, 1.0 * c1 - 3.0 * s1, 2.0 * c2 - 4.0 * s2, 3.0 * c1 + 1.0 * s1, 4.0 * c2 + 2.0 * s2];
    assert_close(&vals(&half[0]), &want_half, 1e-15);
    let inter = run_op(Op::Rope(rope_cfg(100.0, RopeLayout::Interleaved, false)), &[&xt], None);
    let want_inter = [0.5, -0.25, 2.0, 1.0, 1.0 * c1 - 2.0 * s1, 2.0 * c1 + 1.0 * s1, 3.0 * c2 - 4.0 * s2, 4.0 * c2 + 3.0 * s2];
    assert_close(&vals(&inter[0]), &want_inter, 1e-15);
}

#[test]
fn rope_llama3_scaling_changes_only_low_frequencies() {
    let d = 128;
    let scaling = RopeScaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 };
    let plain = rope_inv_freq(&rope_cfg(500000.0, RopeLayout::Half, false), d).expect("inv freq");
    let scaled_cfg = RopeConfig { scaling: Some(scaling), ..rope_cfg(500000.0, RopeLayout::Half, false) };
    let scaled = rope_inv_freq(&scaled_cfg, d).expect("inv freq");
    let (high_wl, low_wl) = (8192.0 / 4.0, 8192.0 / 1.0);
    let (mut kept, mut divided, mut smoothed) = (0, 0, 0);
    for (j, (&p, &s)) in plain.iter().zip(&scaled).enumerate() {
        assert_close(&[p], &[500000f64.powf(-2.0 * j as f64 / d as f64)], 1e-15);
        let wl = 2.0 * PI / p;
        if wl < high_wl {
            assert_eq!(p, s, "high frequency {j} must be kept");
            kept += 1;
        } else if wl > low_wl {
            assert_close(&[s], &[p / 8.0], 1e-15);
            divided += 1;
        } else {
            assert!(s < p && s > p / 8.0, "medium frequency {j} must be between");
            smoothed += 1;
        }
    }
    assert!(kept > 0 && divided > 0 && smoothed > 0, "{kept} {divided} {smoothed}");
    // Through the op: the first pair (highest frequency) is unchanged, the last pair changes.
    let mut r = rng(8);
    let s = 64;
    let x = rand_vec(&mut r, s * d);
    let xt = tf(DType::F32, &[1, s, 1, d], &x);
    let a = vals(&run_op(Op::Rope(rope_cfg(500000.0, RopeLayout::Half, false)), &[&xt], None)[0]);
    let b = vals(&run_op(Op::Rope(scaled_cfg), &[&xt], None)[0]);
    for p in 0..s {
        let (i0, i1) = (p * d, p * d + d / 2);
        assert_eq!(a[i0], b[i0]);
        assert_eq!(a[i1], b[i1]);
    }
    let last = (s - 1) * d + d / 2 - 1;
    assert!((a[last] - b[last]).abs() > 1e-6);
}

// ---------------------------------------------------------------- attention

struct AttnDims {
    b: usize,
    s: usize,
    hq: usize,
    hkv: usize,
    d: usize,
}

/// Naive attention in f64: (out [b, s, hq, d], lse [b, hq, s]).
fn naive_attention(q: &[f64], k: &[f64], v: &[f64], z: &AttnDims, causal: bool, scale: f64) -> (Vec<f64>, Vec<f64>) {
    let AttnDims { b, s, hq, hkv, d } = *z;
    let mut out = vec![0.0; b * s * hq * d];
    let mut lse = vec![0.0; b * hq * s];
    let qi = |bi: usize, i: usize, h: usize, c: usize| ((bi * s + i) * hq + h) * d + c;
    let ki = |bi: usize, j: usize, h: usize, c: usize| ((bi * s + j) * hkv + h) * d + c;
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / (hq / hkv);
            for i in 0..s {
                let keys: Vec<usize> = (0..s).filter(|&j| !causal || j <= i).collect();
                let sc: Vec<f64> = keys.iter().map(|&j| scale * (0..d).map(|c| q[qi(bi, i, h, c)] * k[ki(bi, j, kh, c)]).sum::<f64>()).collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                lse[(bi * hq + h) * s + i] = m + z.ln();
                for (&j, x) in keys.iter().zip(&sc) {
                    let p = (x - m).exp() / z;
                    for c in 0..d {
                        out[qi(bi, i, h, c)] += p * v[ki(bi, j, kh, c)];
                    }
                }
            }
        }
    }
    (out, lse)
}

#[test]
fn attention_matches_naive_with_causal_mask_and_gqa() {
    let mut r = rng(9);
    let z = AttnDims { b: 2, s: 5, hq: 4, hkv: 2, d: 3 };
    let q = rand_vec(&mut r, z.b * z.s * z.hq * z.d);
    let k = rand_vec(&mut r, z.b * z.s * z.hkv * z.d);
    let v = rand_vec(&mut r, z.b * z.s * z.hkv * z.d);
    let qt = tf(DType::F32, &[z.b, z.s, z.hq, z.d], &q);
    let kt = tf(DType::F32, &[z.b, z.s, z.hkv, z.d], &k);
    let vt = tf(DType::F32, &[z.b, z.s, z.hkv, z.d], &v);
    for causal in [true, false] {
        let scale = 0.7;
        let out = run_op(Op::Attention { causal, scale }, &[&qt, &kt, &vt], None);
        let (want_out, want_lse) = naive_attention(&q, &k, &v, &z, causal, scale);
        assert_eq!(out[1].shape, vec![z.b, z.hq, z.s]);
        assert_eq!(out[1].dtype, DType::F32);
        assert_close(&vals(&out[0]), &want_out, 1e-13);
        assert_close(&vals(&out[1]), &want_lse, 1e-13);
    }
    // Causal row 0 attends only to key 0: out = v of the mapped kv head, lse = scale * q.k.
    let out = run_op(Op::Attention { causal: true, scale: 0.7 }, &[&qt, &kt, &vt], None);
    let o = vals(&out[0]);
    for h in 0..z.hq {
        let kh = h / 2;
        for c in 0..z.d {
            assert_close(&[o[h * z.d + c]], &[v[kh * z.d + c]], 1e-14);
        }
    }
}

#[test]
fn attention_bwd_matches_finite_differences() {
    let mut r = rng(10);
    let z = AttnDims { b: 1, s: 4, hq: 4, hkv: 2, d: 3 };
    let nq = z.b * z.s * z.hq * z.d;
    let nk = z.b * z.s * z.hkv * z.d;
    let q = rand_vec(&mut r, nq);
    let k = rand_vec(&mut r, nk);
    let v = rand_vec(&mut r, nk);
    let dout = rand_vec(&mut r, nq);
    let scale = 0.6;
    for causal in [true, false] {
        let loss = |q: &[f64], k: &[f64], v: &[f64]| dot(&naive_attention(q, k, v, &z, causal, scale).0, &dout);
        let qs = [z.b, z.s, z.hq, z.d];
        let ks = [z.b, z.s, z.hkv, z.d];
        let (qt, kt, vt) = (tf(DType::F32, &qs, &q), tf(DType::F32, &ks, &k), tf(DType::F32, &ks, &v));
        let fwd = run_op(Op::Attention { causal, scale }, &[&qt, &kt, &vt], None);
        let dt = tf(DType::F32, &qs, &dout);
        let g = run_op(Op::AttentionBwd { causal, scale }, &[&qt, &kt, &vt, &fwd[0], &fwd[1], &dt], None);
        assert_close(&vals(&g[0]), &fd_grad(&q, 1e-6, |x| loss(x, &k, &v)), 1e-7);
        assert_close(&vals(&g[1]), &fd_grad(&k, 1e-6, |x| loss(&q, x, &v)), 1e-7);
        assert_close(&vals(&g[2]), &fd_grad(&v, 1e-6, |x| loss(&q, &k, x)), 1e-7);
    }
}

// ---------------------------------------------------------------- cross entropy

fn naive_ce(logits: &[f64], targets: &[i64], v: usize) -> f64 {
    let mut total = 0.0;
    for (row, &t) in logits.chunks(v).zip(targets) {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        total += lse - row[t as usize];
    }
    total / targets.len() as f64
}

#[test]
fn cross_entropy_known_values_and_naive() {
    let v = 7;
    let uniform = tf(DType::F32, &[2, 3, v], &[0.3; 2 * 3 * 7]);
    let targets = ti(DType::I32, &[2, 3], &[0, 1, 2, 3, 4, 6]);
    let out = run_op(Op::CrossEntropy, &[&uniform, &targets], None);
    assert!(out[0].shape.is_empty());
    assert_close(&vals(&out[0]), &[(v as f64).ln()], 1e-15);

    let mut r = rng(11);
    let logits = rand_vec(&mut r, 6 * v).iter().map(|x| 4.0 * x).collect::<Vec<_>>();
    let t = [6, 0, 3, 3, 1, 5];
    let out = run_op(Op::CrossEntropy, &[&tf(DType::F32, &[6, v], &logits), &ti(DType::I64, &[6], &t)], None);
    assert_close(&vals(&out[0]), &[naive_ce(&logits, &t, v)], 1e-14);
}

#[test]
fn cross_entropy_bwd_matches_finite_differences() {
    let mut r = rng(12);
    let (n, v) = (5, 6);
    let logits = rand_vec(&mut r, n * v);
    let t = [0, 5, 2, 2, 4];
    let dloss = 0.7;
    let g = run_op(Op::CrossEntropyBwd, &[&tf(DType::F32, &[n, v], &logits), &ti(DType::I32, &[n], &t), &tf(DType::F32, &[], &[dloss])], None);
    let fd = fd_grad(&logits, 1e-6, |x| dloss * naive_ce(x, &t, v));
    assert_close(&vals(&g[0]), &fd, 1e-8);
}

#[test]
fn cross_entropy_rejects_out_of_range_targets() {
    let logits = tf(DType::F32, &[2, 4], &[0.0; 8]);
    let targets = ti(DType::I32, &[2], &[1, 4]);
    let e = run_op_p(Op::CrossEntropy, &[&logits, &targets], None, Precision::Exact).expect_err("target 4 is out of range");
    assert_eq!(e.to_string(), "in @main, node n0 (`cross_entropy`): target 4 is out of range for 4 classes");
}

/// `[rows, n * v]` logits as shard `k` of `n`: columns `k v .. (k + 1) v`.
fn vocab_shard(logits: &[f64], rows: usize, v: usize, k: usize, n: usize) -> Vec<f64> {
    (0..rows).flat_map(|r| logits[r * n * v + k * v..r * n * v + (k + 1) * v].to_vec()).collect()
}

fn one_hot(k: usize, n: usize) -> Tensor<f64> {
    tf(DType::F32, &[n], &(0..n).map(|i| if i == k { 1.0 } else { 0.0 }).collect::<Vec<_>>())
}

#[test]
fn vocab_parallel_cross_entropy_matches_cross_entropy() {
    // Statistics of each of 3 shards, concatenated along the last dim like the all_gather over
    // tp, then combined: the cross-entropy of the whole vocabulary.
    let mut r = rng(13);
    let (rows, v, n) = (6, 5, 3);
    let logits = rand_vec(&mut r, rows * n * v).iter().map(|x| 4.0 * x).collect::<Vec<_>>();
    let t = [0, 14, 7, 5, 9, 10];
    let targets = ti(DType::I32, &[2, 3], &t);
    let mut stats = vec![Vec::new(); 3];
    for k in 0..n {
        let shard = tf(DType::F32, &[2, 3, v], &vocab_shard(&logits, rows, v, k, n));
        let out = run_op(Op::CrossEntropyStats, &[&shard, &targets, &one_hot(k, n)], None);
        for (s, o) in stats.iter_mut().zip(&out) {
            assert_eq!(o.shape, vec![2, 3, 1]);
            s.push(vals(o));
        }
        // The target logit is the shard's when the target is in its range, else 0.
        let want: Vec<f64> = t.iter().enumerate().map(|(i, &j)| if j as usize / v == k { logits[i * n * v + j as usize] } else { 0.0 }).collect();
        assert_close(&vals(&out[2]), &want, 0.0);
    }
    let gathered: Vec<Tensor<f64>> =
        stats.iter().map(|s| tf(DType::F32, &[2, 3, n], &(0..rows).flat_map(|i| (0..n).map(move |k| s[k][i])).collect::<Vec<_>>())).collect();
    let out = run_op(Op::CrossEntropyCombine, &[&gathered[0], &gathered[1], &gathered[2]], None);
    assert!(out[0].shape.is_empty());
    assert_close(&vals(&out[0]), &[naive_ce(&logits, &t, n * v)], 1e-14);
}

#[test]
fn cross_entropy_stats_bwd_matches_finite_differences() {
    let mut r = rng(14);
    let (rows, v, n, k) = (5, 6, 2, 1);
    let logits = rand_vec(&mut r, rows * v);
    let t = [6, 11, 2, 7, 0];
    let d = [rand_vec(&mut r, rows), rand_vec(&mut r, rows), rand_vec(&mut r, rows)];
    let dt = |x: &[f64]| tf(DType::F32, &[rows, 1], x);
    let args = [&tf(DType::F32, &[rows, v], &logits), &ti(DType::I32, &[rows], &t), &one_hot(k, n), &dt(&d[0]), &dt(&d[1]), &dt(&d[2])];
    let g = run_op(Op::CrossEntropyStatsBwd, &args, None);
    let fd = fd_grad(&logits, 1e-6, |x| {
        (0..rows)
            .map(|i| {
                let row = &x[i * v..(i + 1) * v];
                let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let s: f64 = row.iter().map(|y| (y - m).exp()).sum();
                let tl = if t[i] as usize / v == k { row[t[i] as usize % v] } else { 0.0 };
                d[0][i] * m + d[1][i] * s + d[2][i] * tl
            })
            .sum()
    });
    assert_close(&vals(&g[0]), &fd, 1e-8);
}

#[test]
fn cross_entropy_stats_rejects_a_bad_shard_and_out_of_range_targets() {
    let logits = tf(DType::F32, &[2, 4], &[0.0; 8]);
    let targets = ti(DType::I32, &[2], &[1, 8]);
    let e = run_op_p(Op::CrossEntropyStats, &[&logits, &targets, &one_hot(0, 2)], None, Precision::Exact).expect_err("target 8 is out of range");
    assert_eq!(e.to_string(), "in @main, node n0 (`cross_entropy_stats`): target 8 is out of range for 8 classes");
    let two = tf(DType::F32, &[2], &[1.0, 1.0]);
    let e = run_op_p(Op::CrossEntropyStats, &[&logits, &ti(DType::I32, &[2], &[1, 2]), &two], None, Precision::Exact).expect_err("not one-hot");
    assert!(e.to_string().contains("shard must be a one-hot f32[shards]"), "{e}");
}

// ---------------------------------------------------------------- embedding, gather, scatter_add

#[test]
fn embedding_and_gather_pick_rows() {
    let table: Vec<f64> = (0..12).map(f64::from).collect();
    let tt = tf(DType::F32, &[4, 3], &table);
    let tok = ti(DType::I32, &[2, 2], &[3, 0, 1, 3]);
    let out = run_op(Op::Embedding, &[&tok, &tt], None);
    assert_eq!(out[0].shape, vec![2, 2, 3]);
    assert_eq!(vals(&out[0]), vec![9.0, 10.0, 11.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 9.0, 10.0, 11.0]);
    let out = run_op(Op::Gather, &[&tt, &ti(DType::I64, &[3], &[2, 2, 0])], None);
    assert_eq!(vals(&out[0]), vec![6.0, 7.0, 8.0, 6.0, 7.0, 8.0, 0.0, 1.0, 2.0]);
}

#[test]
fn embedding_out_of_range_and_negative_ids_are_errors() {
    let table = Tensor::<f64>::zeros(DType::BF16, vec![256, 4]);
    let tok = ti(DType::I32, &[3], &[1, 300, 2]);
    let e = run_op_p(Op::Embedding, &[&tok, &table], None, Precision::Emulate).expect_err("id 300 is out of range");
    assert_eq!(e.to_string(), "in @main, node n0 (`embedding`): token id 300 is out of range for 256 rows");
    assert_eq!(e.node.map(|n| n.0), Some(0));
    assert_eq!(e.op, Some("embedding"));
    let tok = ti(DType::I32, &[1], &[-1]);
    let e = run_op_p(Op::Embedding, &[&tok, &table], None, Precision::Emulate).expect_err("id -1 is negative");
    assert!(e.message.contains("token id -1 is out of range for 256 rows"), "{e}");
    let e = run_op_p(Op::Gather, &[&table, &ti(DType::I64, &[1], &[256])], None, Precision::Emulate).expect_err("index 256");
    assert!(e.message.contains("index 256 is out of range for 256 rows"), "{e}");
}

#[test]
fn scatter_add_sums_rows_into_a_zero_table() {
    let idx = ti(DType::I32, &[2, 2], &[1, 3, 1, 0]);
    let src = tf(DType::F32, &[2, 2, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    let out = run_op(Op::ScatterAdd, &[&idx, &src], Some(fixed(DType::F32, &[5, 2])));
    assert_eq!(vals(&out[0]), vec![7.0, 8.0, 6.0, 8.0, 0.0, 0.0, 3.0, 4.0, 0.0, 0.0]);
    let bad = ti(DType::I32, &[2, 2], &[1, 5, 1, 0]);
    let e = run_op_p(Op::ScatterAdd, &[&bad, &src], Some(fixed(DType::F32, &[5, 2])), Precision::Exact).expect_err("index 5");
    assert_eq!(e.message, "index 5 is out of range for 5 rows");
    // scatter_add is the adjoint of gather: <gather(T, i), S> = <T, scatter_add(i, S)>.
    let mut r = rng(13);
    let table = rand_vec(&mut r, 10);
    let s = rand_vec(&mut r, 8);
    let g = run_op(Op::Gather, &[&tf(DType::F32, &[5, 2], &table), &idx], None);
    let sc = run_op(Op::ScatterAdd, &[&idx, &tf(DType::F32, &[2, 2, 2], &s)], Some(fixed(DType::F32, &[5, 2])));
    assert_close(&[dot(&vals(&g[0]), &s)], &[dot(&table, &vals(&sc[0]))], 1e-14);
}

/// The row shards of the vocab-parallel embedding: summed over the shards, `gather_shard` is
/// `gather` of the whole table (each index's row is in exactly one shard, the others give
/// zero rows), and the shards' `scatter_add_shard`s stacked are `scatter_add` of the whole
/// table, bit for bit (each row sums the same sources in the same order).
#[test]
fn row_shards_of_gather_and_scatter_add_make_up_the_whole_table() {
    let mut r = rng(17);
    let (rows, d, n) = (6, 3, 3);
    let table = rand_vec(&mut r, rows * d);
    let idx = ti(DType::I32, &[2, 4], &[5, 0, 2, 2, 3, 1, 4, 5]);
    let src = rand_vec(&mut r, 8 * d);
    let whole = run_op(Op::Gather, &[&tf(DType::F32, &[rows, d], &table), &idx], None);
    let whole_grad = run_op(Op::ScatterAdd, &[&idx, &tf(DType::F32, &[2, 4, d], &src)], Some(fixed(DType::F32, &[rows, d])));
    let per = rows / n;
    let mut sum = vec![0.0; 8 * d];
    let mut stacked = Vec::new();
    for k in 0..n {
        let shard = tf(DType::F32, &[per, d], &table[k * per * d..(k + 1) * per * d]);
        let out = run_op(Op::GatherShard, &[&shard, &idx, &one_hot(k, n)], None);
        assert_eq!(out[0].shape, vec![2, 4, d]);
        for (j, x) in vals(&out[0]).into_iter().enumerate() {
            // Every row is either this shard's row or zeros.
            if x != 0.0 {
                assert_eq!(sum[j], 0.0, "index {j} found in two shards");
            }
            sum[j] += x;
        }
        let g = run_op(Op::ScatterAddShard, &[&idx, &tf(DType::F32, &[2, 4, d], &src), &one_hot(k, n)], Some(fixed(DType::F32, &[per, d])));
        stacked.extend(vals(&g[0]));
    }
    assert_eq!(sum, vals(&whole[0]));
    assert_eq!(stacked, vals(&whole_grad[0]));
}

#[test]
fn row_shard_ops_check_their_indices_and_shard() {
    let shard = Tensor::<f64>::zeros(DType::F32, vec![4, 2]);
    let src = Tensor::<f64>::zeros(DType::F32, vec![2, 2]);
    // Indices address the whole table (2 shards of 4 rows).
    let bad = ti(DType::I32, &[2], &[7, 8]);
    let e = run_op_p(Op::GatherShard, &[&shard, &bad, &one_hot(1, 2)], None, Precision::Exact).expect_err("index 8");
    assert!(e.message.contains("index 8 is out of range for 8 rows"), "{e}");
    let e = run_op_p(Op::ScatterAddShard, &[&bad, &src, &one_hot(0, 2)], Some(fixed(DType::F32, &[4, 2])), Precision::Exact).expect_err("index 8");
    assert!(e.message.contains("index 8 is out of range for 8 rows"), "{e}");
    let two = tf(DType::F32, &[2], &[1.0, 1.0]);
    let e = run_op_p(Op::GatherShard, &[&shard, &ti(DType::I32, &[1], &[0]), &two], None, Precision::Exact).expect_err("not one-hot");
    assert!(e.message.contains("shard must be a one-hot f32[shards]"), "{e}");
}

// ---------------------------------------------------------------- pointwise, reduce, layout

type UnaryFn = fn(f64) -> f64;
type BinaryFn = fn(f64, f64) -> f64;

#[test]
fn unary_and_binary_ops_match_scalar_math() {
    let x = [-2.5, -0.3, 0.2, 1.7];
    let xt = tf(DType::F32, &[2, 2], &x);
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    let cases: [(UnaryOp, UnaryFn); 11] = [
        (UnaryOp::Neg, |v| -v),
        (UnaryOp::Exp, f64::exp),
        (UnaryOp::Log, |v| v.abs().ln()),
        (UnaryOp::Sqrt, |v| v.abs().sqrt()),
        (UnaryOp::Rsqrt, |v| 1.0 / v.abs().sqrt()),
        (UnaryOp::Recip, |v| 1.0 / v),
        (UnaryOp::Sigmoid, |v| 1.0 / (1.0 + (-v).exp())),
        (UnaryOp::Silu, |v| v / (1.0 + (-v).exp())),
        (UnaryOp::Tanh, f64::tanh),
        (UnaryOp::Abs, f64::abs),
        (UnaryOp::Square, |v| v * v),
    ];
    for (u, f) in cases {
        let input = if matches!(u, UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt) { tf(DType::F32, &[2, 2], &x.map(f64::abs)) } else { xt.clone() };
        let out = run_op(Op::Unary(u), &[&input], None);
        assert_close(&vals(&out[0]), &x.map(f), 1e-15);
    }
    let y = [0.5, 2.0, -1.5, 3.0];
    let yt = tf(DType::F32, &[2, 2], &y);
    let pos = tf(DType::F32, &[2, 2], &x.map(f64::abs));
    let bcases: [(BinaryOp, BinaryFn); 6] = [
        (BinaryOp::Add, |a, b| a + b),
        (BinaryOp::Sub, |a, b| a - b),
        (BinaryOp::Mul, |a, b| a * b),
        (BinaryOp::Div, |a, b| a / b),
        (BinaryOp::Max, f64::max),
        (BinaryOp::Min, f64::min),
    ];
    for (bo, f) in bcases {
        let out = run_op(Op::Binary(bo), &[&xt, &yt], None);
        let want: Vec<f64> = x.iter().zip(&y).map(|(&a, &b)| f(a, b)).collect();
        assert_close(&vals(&out[0]), &want, 1e-15);
    }
    let out = run_op(Op::Binary(BinaryOp::Pow), &[&pos, &yt], None);
    let want: Vec<f64> = x.iter().zip(&y).map(|(a, b)| a.abs().powf(*b)).collect();
    assert_close(&vals(&out[0]), &want, 1e-14);
    // A rank-0 operand broadcasts on either side.
    let two = tf(DType::F32, &[], &[2.0]);
    let out = run_op(Op::Binary(BinaryOp::Sub), &[&xt, &two], None);
    assert_close(&vals(&out[0]), &x.map(|v| v - 2.0), 1e-15);
    let out = run_op(Op::Binary(BinaryOp::Sub), &[&two, &xt], None);
    assert_eq!(out[0].shape, vec![2, 2]);
    assert_close(&vals(&out[0]), &x.map(|v| 2.0 - v), 1e-15);
    // silu_grad(x, dy) = dy * d silu / dx.
    let dy = [0.3, -1.2, 2.0, 0.9];
    let out = run_op(Op::Binary(BinaryOp::SiluGrad), &[&xt, &tf(DType::F32, &[2, 2], &dy)], None);
    let silu = |v: f64| v * sig(v);
    let want: Vec<f64> = x.iter().zip(&dy).map(|(&v, &d)| d * (silu(v + 1e-6) - silu(v - 1e-6)) / 2e-6).collect();
    assert_close(&vals(&out[0]), &want, 1e-8);
}

#[test]
fn reduce_ops_match_naive() {
    let mut r = rng(14);
    let (a, b, c) = (2, 3, 4);
    let x = rand_vec(&mut r, a * b * c);
    let xt = tf(DType::F32, &[a, b, c], &x);
    let at = |i: usize, j: usize, k: usize| x[(i * b + j) * c + k];
    // axes [1]: [a, c]
    let mut sum1 = vec![0.0; a * c];
    let mut max1 = vec![f64::NEG_INFINITY; a * c];
    for i in 0..a {
        for j in 0..b {
            for k in 0..c {
                sum1[i * c + k] += at(i, j, k);
                max1[i * c + k] = max1[i * c + k].max(at(i, j, k));
            }
        }
    }
    let out = run_op(Op::Reduce { kind: ReduceKind::Sum, axes: vec![1] }, &[&xt], None);
    assert_eq!(out[0].shape, vec![a, c]);
    assert_close(&vals(&out[0]), &sum1, 1e-14);
    let out = run_op(Op::Reduce { kind: ReduceKind::Max, axes: vec![1] }, &[&xt], None);
    assert_close(&vals(&out[0]), &max1, 0.0);
    let out = run_op(Op::Reduce { kind: ReduceKind::Mean, axes: vec![1] }, &[&xt], None);
    assert_close(&vals(&out[0]), &sum1.iter().map(|s| s / b as f64).collect::<Vec<_>>(), 1e-14);
    // axes [0, 2]: [b]
    let sum02: Vec<f64> = (0..b).map(|j| (0..a).flat_map(|i| (0..c).map(move |k| (i, k))).map(|(i, k)| at(i, j, k)).sum()).collect();
    let out = run_op(Op::Reduce { kind: ReduceKind::Mean, axes: vec![0, 2] }, &[&xt], None);
    assert_close(&vals(&out[0]), &sum02.iter().map(|s| s / (a * c) as f64).collect::<Vec<_>>(), 1e-14);
    // All axes: a scalar.
    let out = run_op(Op::Reduce { kind: ReduceKind::Sum, axes: vec![0, 1, 2] }, &[&xt], None);
    assert!(out[0].shape.is_empty());
    assert_close(&vals(&out[0]), &[x.iter().sum()], 1e-14);
    let out = run_op(Op::Reduce { kind: ReduceKind::Max, axes: vec![2] }, &[&xt], None);
    let want: Vec<f64> = x.chunks(c).map(|row| row.iter().cloned().fold(f64::NEG_INFINITY, f64::max)).collect();
    assert_close(&vals(&out[0]), &want, 0.0);
}

#[test]
fn transpose_permutes_dims() {
    let (a, b, c) = (2, 3, 4);
    let x: Vec<f64> = (0..a * b * c).map(|i| i as f64).collect();
    let xt = tf(DType::F32, &[a, b, c], &x);
    let out = run_op(Op::Transpose { perm: vec![2, 0, 1] }, &[&xt], None);
    assert_eq!(out[0].shape, vec![c, a, b]);
    let o = vals(&out[0]);
    for i in 0..a {
        for j in 0..b {
            for k in 0..c {
                // out[k, i, j] = in[i, j, k]
                assert_eq!(o[(k * a + i) * b + j], x[(i * b + j) * c + k]);
            }
        }
    }
    // Integer tensors transpose too.
    let it = ti(DType::I64, &[2, 3], &[0, 1, 2, 3, 4, 5]);
    let out = run_op(Op::Transpose { perm: vec![1, 0] }, &[&it], None);
    assert_eq!(out[0].ints(), Some(&[0, 3, 1, 4, 2, 5][..]));
}

#[test]
fn slice_cuts_one_axis_and_concat_joins_along_it() {
    // [2, 3, 2]: slice axis 1 at [1, 3).
    let x: Vec<f64> = (0..12).map(f64::from).collect();
    let xt = tf(DType::F32, &[2, 3, 2], &x);
    let out = run_op(Op::Slice { axis: 1, start: 1, len: 2 }, &[&xt], None);
    assert_eq!(out[0].shape, vec![2, 2, 2]);
    assert_eq!(vals(&out[0]), vec![2.0, 3.0, 4.0, 5.0, 8.0, 9.0, 10.0, 11.0]);
    // Concatenating the pieces of a split gives the tensor back.
    let a = run_op(Op::Slice { axis: 1, start: 0, len: 1 }, &[&xt], None);
    let both = run_op(Op::Concat { axis: 1 }, &[&a[0], &out[0]], None);
    assert_eq!(both[0].shape, vec![2, 3, 2]);
    assert_eq!(vals(&both[0]), x);
    // Leading axis, integers.
    let it = ti(DType::I64, &[3, 2], &[0, 1, 2, 3, 4, 5]);
    let out = run_op(Op::Slice { axis: 0, start: 2, len: 1 }, &[&it], None);
    assert_eq!(out[0].ints(), Some(&[4, 5][..]));
    let out = run_op(Op::Concat { axis: 0 }, &[&it, &it], None);
    assert_eq!(out[0].ints(), Some(&[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5][..]));
}

#[test]
fn bad_slices_and_concats_are_type_errors() {
    let mut g = titan_ir::Graph::new("g");
    let x = g.main.add_arg(TensorType::fixed(DType::F32, &[4, 3]), titan_ir::ArgKind::Input, Some("x"));
    let y = g.main.add_arg(TensorType::fixed(DType::F32, &[2, 2]), titan_ir::ArgKind::Input, Some("y"));
    let mut b = g.main_builder();
    let err = b.push(Op::Slice { axis: 0, start: 3, len: 2 }, &[x]).expect_err("past the end");
    assert!(err.contains("is not a non-empty range inside dim 0"), "{err}");
    let err = b.push(Op::Slice { axis: 2, start: 0, len: 1 }, &[x]).expect_err("no such axis");
    assert!(err.contains("axis 2 is out of range"), "{err}");
    let err = b.push(Op::Concat { axis: 0 }, &[x, y]).expect_err("other dims differ");
    assert!(err.contains("does not match"), "{err}");
    let err = b.push(Op::Concat { axis: 0 }, &[]).expect_err("nothing to join");
    assert!(err.contains("at least one operand"), "{err}");
    let ok = b.push(Op::Concat { axis: 1 }, &[x, x]).expect("[4, 6]");
    assert_eq!(b.ty(ok[0]), &TensorType::fixed(DType::F32, &[4, 6]));
}

#[test]
fn broadcast_maps_and_stretches_dims() {
    // [3] -> [2, 3] along dim 1.
    let xt = tf(DType::F32, &[3], &[1.0, 2.0, 3.0]);
    let out = run_op(Op::Broadcast { dims: vec![1] }, &[&xt], Some(fixed(DType::F32, &[2, 3])));
    assert_eq!(vals(&out[0]), vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
    // [2] -> [2, 3] along dim 0.
    let yt = tf(DType::F32, &[2], &[5.0, 7.0]);
    let out = run_op(Op::Broadcast { dims: vec![0] }, &[&yt], Some(fixed(DType::F32, &[2, 3])));
    assert_eq!(vals(&out[0]), vec![5.0, 5.0, 5.0, 7.0, 7.0, 7.0]);
    // [2, 1] -> [2, 2, 3]: dim 0 -> 0, dim 1 (size 1) stretched to output dim 2.
    let zt = tf(DType::F32, &[2, 1], &[1.0, -1.0]);
    let out = run_op(Op::Broadcast { dims: vec![0, 2] }, &[&zt], Some(fixed(DType::F32, &[2, 2, 3])));
    assert_eq!(vals(&out[0]), [[1.0; 6], [-1.0; 6]].concat());
    // A scalar fills everything.
    let st = tf(DType::F32, &[], &[4.0]);
    let out = run_op(Op::Broadcast { dims: vec![] }, &[&st], Some(fixed(DType::F32, &[2, 2])));
    assert_eq!(vals(&out[0]), vec![4.0; 4]);
}

#[test]
fn reshape_and_constant() {
    let xt = tf(DType::F32, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let out = run_op(Op::Reshape, &[&xt], Some(fixed(DType::F32, &[3, 1, 2])));
    assert_eq!(out[0].shape, vec![3, 1, 2]);
    assert_eq!(vals(&out[0]), vals(&xt));
    let out = run_op(Op::Constant { value: 0.25 }, &[], Some(fixed(DType::F32, &[2, 2])));
    assert_eq!(vals(&out[0]), vec![0.25; 4]);
    let out = run_op(Op::Constant { value: 3.0 }, &[], Some(fixed(DType::I32, &[3])));
    assert_eq!(out[0].ints(), Some(&[3, 3, 3][..]));
    let e = run_op_p::<f64>(Op::Constant { value: 3.5 }, &[], Some(fixed(DType::I64, &[1])), Precision::Exact).expect_err("3.5 is not an integer");
    assert!(e.message.contains("3.5"), "{e}");
}

// ---------------------------------------------------------------- rounding and cast

fn p2(e: i32) -> f32 {
    2f32.powi(e)
}

#[test]
fn bf16_and_f16_round_to_nearest_even() {
    assert_eq!(round_to_dtype(1.0 + p2(-8), DType::BF16), 1.0);
    assert_eq!(round_to_dtype(1.0 + 3.0 * p2(-8), DType::BF16), 1.0 + p2(-6));
    assert_eq!(round_to_dtype(1.0 + p2(-8) + p2(-20), DType::BF16), 1.0 + p2(-7));
    assert_eq!(round_to_dtype(-(1.0 + 3.0 * p2(-8)), DType::BF16), -(1.0 + p2(-6)));
    assert!(round_to_dtype(f32::NAN, DType::BF16).is_nan());
    assert_eq!(round_to_dtype(1.0 + p2(-11), DType::F16), 1.0);
    assert_eq!(round_to_dtype(1.0 + 3.0 * p2(-11), DType::F16), 1.0 + p2(-9));
    assert_eq!(round_to_dtype(70000.0, DType::F16), f32::INFINITY);
    assert_eq!(round_to_dtype(p2(-24), DType::F16), p2(-24));
    assert_eq!(round_to_dtype(p2(-25), DType::F16), 0.0);
    assert_eq!(round_to_dtype(1.1, DType::F32), 1.1);
    assert_eq!(round_to_dtype(7.5, DType::I32), 7.5);
}

#[test]
fn f8e4m3_saturates_and_rounds() {
    let r = |x: f32| round_to_dtype(x, DType::F8E4M3);
    assert_eq!(r(1000.0), 448.0);
    assert_eq!(r(-1000.0), -448.0);
    assert_eq!(r(464.0), 448.0);
    assert_eq!(r(f32::INFINITY), 448.0);
    assert_eq!(r(f32::NEG_INFINITY), -448.0);
    assert!(r(f32::NAN).is_nan());
    assert_eq!(r(448.0), 448.0);
    assert_eq!(r(300.0), 288.0);
    assert_eq!(r(1.0 + p2(-4)), 1.0);
    assert_eq!(r(1.0 + 3.0 * p2(-4)), 1.25);
    assert_eq!(r(1.0 + p2(-4) + p2(-10)), 1.125);
    // Subnormals: quantum 2^-9.
    assert_eq!(r(p2(-9)), p2(-9));
    assert_eq!(r(p2(-10)), 0.0);
    assert_eq!(r(3.0 * p2(-10)), p2(-8));
    assert_eq!(r(5.0 * p2(-11)), p2(-9));
    assert_eq!(r(0.0), 0.0);
}

#[test]
fn f8e5m2_saturates_and_rounds() {
    let r = |x: f32| round_to_dtype(x, DType::F8E5M2);
    assert_eq!(r(100000.0), 57344.0);
    assert_eq!(r(-60000.0), -57344.0);
    assert_eq!(r(57344.0), 57344.0);
    assert_eq!(r(f32::INFINITY), f32::INFINITY);
    assert!(r(f32::NAN).is_nan());
    assert_eq!(r(1.0 + p2(-3)), 1.0);
    assert_eq!(r(1.0 + 3.0 * p2(-3)), 1.5);
    assert_eq!(r(3.0), 3.0);
    assert_eq!(r(p2(-16)), p2(-16));
    assert_eq!(r(p2(-17)), 0.0);
    assert_eq!(r(3.0 * p2(-17)), p2(-15));
}

#[test]
fn cast_rounds_truncates_and_converts() {
    let x = tf(DType::F32, &[4], &[1.0 + 2f64.powi(-8), -2.7, 2.7, 1000.0]);
    let out = run_op_p(Op::Cast, &[&x], Some(fixed(DType::BF16, &[4])), Precision::Emulate).expect("cast");
    assert_eq!(vals(&out[0]), vec![1.0, -2.703125, 2.703125, 1000.0]);
    let out = run_op_p(Op::Cast, &[&x], Some(fixed(DType::F8E4M3, &[4])), Precision::Emulate).expect("cast");
    assert_eq!(vals(&out[0]), vec![1.0, -2.75, 2.75, 448.0]);
    // Exact does not round.
    let out = run_op(Op::Cast, &[&x], Some(fixed(DType::BF16, &[4])));
    assert_eq!(vals(&out[0]), vals(&x));
    let out = run_op(Op::Cast, &[&x], Some(fixed(DType::I32, &[4])));
    assert_eq!(out[0].ints(), Some(&[1, -2, 2, 1000][..]));
    let ints = ti(DType::I64, &[2], &[-3, 5_000_000_000]);
    let out = run_op(Op::Cast, &[&ints], Some(fixed(DType::F32, &[2])));
    assert_eq!(vals(&out[0]), vec![-3.0, 5e9]);
    let e = run_op_p(Op::Cast, &[&ints], Some(fixed(DType::I32, &[2])), Precision::Exact).expect_err("5e9 does not fit i32");
    assert!(e.message.contains("5000000000"), "{e}");
    let big = tf(DType::F32, &[1], &[3e9]);
    assert!(run_op_p(Op::Cast, &[&big], Some(fixed(DType::I32, &[1])), Precision::Exact).is_err());
    let nan = tf(DType::F32, &[1], &[f64::NAN]);
    assert!(run_op_p(Op::Cast, &[&nan], Some(fixed(DType::I64, &[1])), Precision::Exact).is_err());
}

// ---------------------------------------------------------------- optimizer

fn lr_value(cfg: LrSchedule, step: i64) -> Result<f64, InterpError> {
    let st = ti(DType::I64, &[], &[step]);
    run_op_p(Op::LrSchedule(cfg), &[&st], None, Precision::Exact).map(|o| vals(&o[0])[0])
}

#[test]
fn lr_schedule_warmup_and_every_decay() {
    let base = LrSchedule { lr: 1e-3, warmup_steps: 10, decay_steps: 100, decay: DecayKind::Cosine, min_lr_ratio: 0.1 };
    let at = |decay, s| lr_value(LrSchedule { decay, ..base }, s).expect("lr");
    for decay in [DecayKind::Cosine, DecayKind::Linear, DecayKind::Constant] {
        assert_close(&[at(decay, 1)], &[1e-4], 1e-15);
        assert_close(&[at(decay, 5)], &[5e-4], 1e-15);
        assert_close(&[at(decay, 10)], &[1e-3], 1e-15);
    }
    // Mid: step 35 is a quarter into the decay, step 60 half.
    assert_close(&[at(DecayKind::Cosine, 35)], &[1e-3 * (0.1 + 0.9 * 0.5 * (1.0 + (PI / 4.0).cos()))], 1e-14);
    assert_close(&[at(DecayKind::Linear, 35)], &[1e-3 * (1.0 - 0.9 * 0.25)], 1e-14);
    assert_close(&[at(DecayKind::Cosine, 60)], &[0.55e-3], 1e-14);
    assert_close(&[at(DecayKind::Constant, 60)], &[1e-3], 1e-15);
    // End and beyond: min_lr_ratio * lr, or lr when constant.
    for s in [110, 500] {
        assert_close(&[at(DecayKind::Cosine, s)], &[1e-4], 1e-14);
        assert_close(&[at(DecayKind::Linear, s)], &[1e-4], 1e-14);
        assert_close(&[at(DecayKind::Constant, s)], &[1e-3], 1e-15);
    }
    // No warmup: step 1 is already 1/decay_steps into the decay.
    let nw = LrSchedule { warmup_steps: 0, decay: DecayKind::Linear, ..base };
    assert_close(&[lr_value(nw, 1).expect("lr")], &[1e-3 * (1.0 - 0.9 * 0.01)], 1e-14);
    assert_eq!(lr_at(&nw, 1), lr_value(nw, 1).expect("lr"));
    let e = lr_value(base, 0).expect_err("steps are 1-based");
    assert!(e.message.contains(">= 1"), "{e}");
}

/// One PyTorch AdamW step by hand.
fn adamw_ref(p: &[f64], g: &[f64], m: &[f64], v: &[f64], lr: f64, t: i32, c: &AdamWConfig) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut out = (vec![], vec![], vec![]);
    for i in 0..p.len() {
        let pd = p[i] * (1.0 - lr * c.weight_decay);
        let m2 = c.beta1 * m[i] + (1.0 - c.beta1) * g[i];
        let v2 = c.beta2 * v[i] + (1.0 - c.beta2) * g[i] * g[i];
        let mh = m2 / (1.0 - c.beta1.powi(t));
        let vh = v2 / (1.0 - c.beta2.powi(t));
        out.0.push(pd - lr * mh / (vh.sqrt() + c.eps));
        out.1.push(m2);
        out.2.push(v2);
    }
    out
}

#[test]
fn adamw_one_and_two_steps_match_the_formula() {
    let c = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
    let mut r = rng(15);
    let n = 6;
    let p = rand_vec(&mut r, n);
    let g1 = rand_vec(&mut r, n);
    let g2 = rand_vec(&mut r, n);
    let zeros = vec![0.0; n];
    let lr = 3e-3;
    let step = |p: &[f64], g: &[f64], m: &[f64], v: &[f64], t: i64| {
        let ts = |x: &[f64]| tf(DType::F32, &[2, 3], x);
        run_op(Op::AdamW(c), &[&ts(p), &ts(g), &ts(m), &ts(v), &tf(DType::F32, &[], &[lr]), &ti(DType::I64, &[], &[t])], None)
    };
    let o1 = step(&p, &g1, &zeros, &zeros, 1);
    let w1 = adamw_ref(&p, &g1, &zeros, &zeros, lr, 1, &c);
    assert_close(&vals(&o1[0]), &w1.0, 1e-14);
    assert_close(&vals(&o1[1]), &w1.1, 1e-15);
    assert_close(&vals(&o1[2]), &w1.2, 1e-15);
    // Step 1 of Adam moves each weight by about lr (|m_hat / sqrt(v_hat)| = 1).
    for (p0, p1) in p.iter().zip(vals(&o1[0])) {
        let moved = p0 * (1.0 - lr * 0.1) - p1;
        assert_close(&[moved.abs()], &[lr], 1e-5);
    }
    let o2 = step(&vals(&o1[0]), &g2, &vals(&o1[1]), &vals(&o1[2]), 2);
    let w2 = adamw_ref(&w1.0, &g2, &w1.1, &w1.2, lr, 2, &c);
    assert_close(&vals(&o2[0]), &w2.0, 1e-14);
    assert_close(&vals(&o2[1]), &w2.1, 1e-15);
    assert_close(&vals(&o2[2]), &w2.2, 1e-15);
    let e = run_op_p(
        Op::AdamW(c),
        &[
            &tf(DType::F32, &[1], &[1.0]),
            &tf(DType::F32, &[1], &[1.0]),
            &tf(DType::F32, &[1], &[0.0]),
            &tf(DType::F32, &[1], &[0.0]),
            &tf(DType::F32, &[], &[lr]),
            &ti(DType::I64, &[], &[0]),
        ],
        None,
        Precision::Exact,
    )
    .expect_err("step 0");
    assert!(e.message.contains("adamw step must be >= 1"), "{e}");
}

// ---------------------------------------------------------------- repeat and regions

/// main(h f32[2], ws f32[3, 2], c f32[2]) = repeat @layer(h; ws; c) with
/// `layer(h, w, c) = (h * w + c, h * w)`: one carry, one stacked input, one invariant,
/// one stacked output.
fn repeat_graph(reverse: bool) -> Graph {
    let mut g = Graph::new("rep");
    let mut blk = Region::new("layer");
    let h = blk.add_arg(fixed(DType::F32, &[2]), ArgKind::Block, Some("h"));
    let w = blk.add_arg(fixed(DType::F32, &[2]), ArgKind::Block, Some("w"));
    let c = blk.add_arg(fixed(DType::F32, &[2]), ArgKind::Block, Some("c"));
    {
        let mut b = Builder::new(&mut blk, &g.dims, &g.blocks);
        let hw = b.push1(Op::Binary(BinaryOp::Mul), &[h, w]).expect("mul");
        let next = b.push1(Op::Binary(BinaryOp::Add), &[hw, c]).expect("add");
        b.region.outputs.push(Output { name: None, value: next });
        b.region.outputs.push(Output { name: None, value: hw });
    }
    let block = g.add_block(blk);
    let h0 = g.main.add_arg(fixed(DType::F32, &[2]), ArgKind::Input, Some("h0"));
    let ws = g.main.add_arg(TensorType::new(DType::F32, vec![Dim::named("layers"), Dim::Fixed(2)]), ArgKind::Input, Some("ws"));
    let cc = g.main.add_arg(fixed(DType::F32, &[2]), ArgKind::Input, Some("c"));
    g.dims.insert("layers".into(), 3);
    let res = g.main_builder().push(Op::Repeat { block, count: 3, carry: 1, stacked: 1, reverse, prefetch: 0 }, &[h0, ws, cc]).expect("repeat");
    g.main.outputs.push(Output { name: Some("h".into()), value: res[0] });
    g.main.outputs.push(Output { name: Some("hw".into()), value: res[1] });
    g
}

#[test]
fn repeat_carries_slices_and_stacks_forward_and_reverse() {
    let h0 = [1.0, 2.0];
    let ws = [[2.0, 3.0], [0.5, -1.0], [4.0, 0.25]];
    let c = [1.0, -1.0];
    let args = [tf(DType::F32, &[2], &h0), tf(DType::F32, &[3, 2], &ws.concat()), tf(DType::F32, &[2], &c)];
    for reverse in [false, true] {
        let g = repeat_graph(reverse);
        let out = Interpreter::new(&g, Precision::Exact).run(&args).expect("runs");
        // Reference: walk the layers in order, recording each layer's h * w at its index.
        let mut h = h0.to_vec();
        let mut hw = [[0.0; 2]; 3];
        let layers: Vec<usize> = if reverse { vec![2, 1, 0] } else { vec![0, 1, 2] };
        for &i in &layers {
            for j in 0..2 {
                hw[i][j] = h[j] * ws[i][j];
                h[j] = hw[i][j] + c[j];
            }
        }
        assert_eq!(vals(&out.outputs[0]), h, "reverse={reverse}");
        assert_eq!(out.outputs[1].shape, vec![3, 2]);
        assert_eq!(vals(&out.outputs[1]), hw.concat(), "reverse={reverse}");
        for (i, row) in hw.iter().enumerate() {
            assert_eq!(vals(&out.outputs[1].layer(i)), row.to_vec());
        }
    }
    // The block also runs on its own.
    let g = repeat_graph(false);
    let blk = &g.blocks[0];
    let outs = Interpreter::new(&g, Precision::Exact)
        .run_region(blk, &[tf(DType::F32, &[2], &h0), tf(DType::F32, &[2], &ws[1]), tf(DType::F32, &[2], &c)])
        .expect("block runs");
    assert_eq!(vals(&outs[0]), vec![1.5, -3.0]);
    assert_eq!(vals(&outs[1]), vec![0.5, -2.0]);
}

/// `repeat_graph` with `exp(w)` for `w`, written both ways: plain (`h * exp(w) + c`), or with
/// `exp(w)` a prefetched carry (`prefetch = 1`) computed from the next layer's slice:
/// `layer(h, p; w; c) = (h * p + c, exp(w), h * p)` where `w` is read at the next layer.
fn prefetch_repeat_graph(reverse: bool, prefetch: bool) -> Graph {
    let mut g = Graph::new("rep");
    g.dims.insert("layers".into(), 3);
    let mut blk = Region::new("layer");
    let h = blk.add_arg(fixed(DType::F32, &[2]), ArgKind::Block, Some("h"));
    let p = prefetch.then(|| blk.add_arg(fixed(DType::F32, &[2]), ArgKind::Block, Some("p")));
    let w = blk.add_arg(fixed(DType::F32, &[2]), ArgKind::Block, Some("w"));
    let c = blk.add_arg(fixed(DType::F32, &[2]), ArgKind::Block, Some("c"));
    {
        let mut b = Builder::new(&mut blk, &g.dims, &g.blocks);
        let ew = b.push1(Op::Unary(UnaryOp::Exp), &[w]).expect("exp");
        let hw = b.push1(Op::Binary(BinaryOp::Mul), &[h, p.unwrap_or(ew)]).expect("mul");
        let next = b.push1(Op::Binary(BinaryOp::Add), &[hw, c]).expect("add");
        b.region.outputs.push(Output { name: None, value: next });
        if prefetch {
            b.region.outputs.push(Output { name: None, value: ew });
        }
        b.region.outputs.push(Output { name: None, value: hw });
    }
    let block = g.add_block(blk);
    let h0 = g.main.add_arg(fixed(DType::F32, &[2]), ArgKind::Input, Some("h0"));
    let ws = g.main.add_arg(TensorType::new(DType::F32, vec![Dim::named("layers"), Dim::Fixed(2)]), ArgKind::Input, Some("ws"));
    let cc = g.main.add_arg(fixed(DType::F32, &[2]), ArgKind::Input, Some("c"));
    let op = Op::Repeat { block, count: 3, carry: 1, stacked: 1, reverse, prefetch: u32::from(prefetch) };
    let res = g.main_builder().push(op, &[h0, ws, cc]).expect("repeat");
    assert_eq!(res.len(), 2, "a prefetched carry has no result");
    g.main.outputs.push(Output { name: Some("h".into()), value: res[0] });
    g.main.outputs.push(Output { name: Some("hw".into()), value: res[1] });
    g
}

/// A `repeat` with a prefetched carry computes what the plain one does: layer `l` reads the
/// value the prologue (`l` first) or layer `l - 1` (`l + 1` when reversed) computed from its
/// slice, and the last layer computes no prefetch (there is no next slice). It prints with
/// `prefetch = 1`, parses back and verifies.
#[test]
fn repeat_with_a_prefetched_carry_matches_the_plain_repeat() {
    let args = [tf(DType::F32, &[2], &[1.0, 2.0]), tf(DType::F32, &[3, 2], &[0.5, -1.0, 0.25, 0.75, -0.5, 1.5]), tf(DType::F32, &[2], &[1.0, -1.0])];
    for reverse in [false, true] {
        let want = Interpreter::new(&prefetch_repeat_graph(reverse, false), Precision::Exact).run(&args).expect("plain runs");
        let g = prefetch_repeat_graph(reverse, true);
        let errors = titan_ir::verify::verify(&g);
        assert!(errors.is_empty(), "{errors:?}");
        let got = Interpreter::new(&g, Precision::Exact).run(&args).expect("prefetching runs");
        assert_eq!(got.outputs, want.outputs, "reverse={reverse}");
        let text = titan_ir::print::print_graph(&g);
        assert!(text.contains(&format!("reverse = {reverse}, prefetch = 1}}")), "{text}");
        let back: Graph = text.parse().expect("parses back");
        assert_eq!(titan_ir::print::print_graph(&back), text);
    }
}

/// The verifier rejects a prefetched carry computed from something other than stacked and
/// whole arguments (it could not run before the first layer), and a value of the prefetch
/// nodes read by the rest of the layer (it would be the next layer's).
#[test]
fn the_verifier_rejects_prefetch_nodes_that_cannot_run_ahead() {
    let mut g = prefetch_repeat_graph(false, true);
    let blk = &mut g.blocks[0];
    // exp(w) -> exp(h): reads the carried argument.
    blk.nodes[0].inputs[0] = blk.args[0].value;
    let msgs: Vec<String> = titan_ir::verify::verify(&g).iter().map(ToString::to_string).collect();
    assert!(msgs.iter().any(|m| m.contains("a prefetch node of @layer reads carried argument 0")), "{msgs:#?}");

    let mut g = prefetch_repeat_graph(false, true);
    let blk = &mut g.blocks[0];
    // h * p -> h * exp(w): the layer reads the next layer's value.
    let ew = blk.nodes[0].results[0];
    blk.nodes[1].inputs[1] = ew;
    let msgs: Vec<String> = titan_ir::verify::verify(&g).iter().map(ToString::to_string).collect();
    assert!(msgs.iter().any(|m| m.contains("which a prefetch node computes or reads at the next layer")), "{msgs:#?}");
}

#[test]
fn errors_inside_a_repeat_name_the_block_and_layer() {
    let mut g = Graph::new("rep_err");
    let mut blk = Region::new("layer");
    let x = blk.add_arg(fixed(DType::F32, &[2]), ArgKind::Block, Some("x"));
    let tok = blk.add_arg(fixed(DType::I32, &[1]), ArgKind::Block, Some("tok"));
    let table = blk.add_arg(fixed(DType::F32, &[4, 2]), ArgKind::Block, Some("table"));
    {
        let mut b = Builder::new(&mut blk, &g.dims, &g.blocks);
        let e = b.push1(Op::Embedding, &[tok, table]).expect("embedding");
        let e = b.push_typed(Op::Reshape, &[e], fixed(DType::F32, &[2])).expect("reshape");
        let y = b.push1(Op::Binary(BinaryOp::Add), &[x, e]).expect("add");
        b.region.outputs.push(Output { name: None, value: y });
    }
    let block = g.add_block(blk);
    let x0 = g.main.add_arg(fixed(DType::F32, &[2]), ArgKind::Input, Some("x0"));
    let toks = g.main.add_arg(fixed(DType::I32, &[3, 1]), ArgKind::Input, Some("toks"));
    let table = g.main.add_arg(fixed(DType::F32, &[4, 2]), ArgKind::Input, Some("table"));
    let res = g.main_builder().push(Op::Repeat { block, count: 3, carry: 1, stacked: 1, reverse: false, prefetch: 0 }, &[x0, toks, table]).expect("repeat");
    g.main.outputs.push(Output { name: None, value: res[0] });
    let table_t = tf(DType::F32, &[4, 2], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    let interp = Interpreter::new(&g, Precision::Exact);
    let ok = interp.run(&[tf(DType::F32, &[2], &[0.0, 0.0]), ti(DType::I32, &[3, 1], &[1, 3, 0]), table_t.clone()]).expect("runs");
    assert_eq!(vals(&ok.outputs[0]), vec![8.0, 11.0]);
    let e = interp.run(&[tf(DType::F32, &[2], &[0.0, 0.0]), ti(DType::I32, &[3, 1], &[1, 9, 0]), table_t]).expect_err("id 9");
    assert_eq!(e.region, "layer");
    assert_eq!(e.op, Some("embedding"));
    assert_eq!(e.to_string(), "in @layer, node n0 (`embedding`): token id 9 is out of range for 4 rows (layer 1 of `repeat` node n0 in @main)");
}

/// main(x, y) = (x * y, x + y) with an update of the state `y` to `x * y`.
fn mul_graph(dtype: DType) -> Graph {
    let mut g = Graph::new("mul");
    let x = g.main.add_arg(fixed(dtype, &[4]), ArgKind::Input, Some("x"));
    let y = g.main.add_arg(fixed(dtype, &[4]), ArgKind::Input, Some("y"));
    let (p, s) = {
        let mut b = g.main_builder();
        let p = b.push1(Op::Binary(BinaryOp::Mul), &[x, y]).expect("mul");
        let s = b.push1(Op::Binary(BinaryOp::Add), &[x, y]).expect("add");
        (p, s)
    };
    g.main.outputs.push(Output { name: Some("p".into()), value: p });
    g.main.outputs.push(Output { name: Some("s".into()), value: s });
    g.main.updates.push(Update { state: y, value: p });
    g
}

#[test]
fn emulate_and_exact_differ_for_bf16_and_agree_for_f32() {
    let x = [1.0 + 2f64.powi(-7), 3.0, 1.0 / 3.0, 1.5];
    let y = [1.0 + 2f64.powi(-7), 1.0 / 3.0, 3.0, 1.0 + 2f64.powi(-6)];
    // bf16 inputs must be representable: round them first.
    let rb = |v: &[f64]| v.iter().map(|&a| f64::from(round_to_dtype(a as f32, DType::BF16))).collect::<Vec<_>>();
    let (xb, yb) = (rb(&x), rb(&y));
    let g = mul_graph(DType::BF16);
    let args = [tf(DType::BF16, &[4], &xb), tf(DType::BF16, &[4], &yb)];
    let em: MainResult<f64> = Interpreter::new(&g, Precision::Emulate).run(&args).expect("runs");
    let ex: MainResult<f64> = Interpreter::new(&g, Precision::Exact).run(&args).expect("runs");
    let exact: Vec<f64> = xb.iter().zip(&yb).map(|(a, b)| a * b).collect();
    assert_eq!(vals(&ex.outputs[0]), exact);
    assert_eq!(vals(&em.outputs[0]), rb(&exact));
    assert_ne!(vals(&em.outputs[0]), vals(&ex.outputs[0]));
    assert_eq!(em.updates.len(), 1);
    assert_eq!(em.updates[0], em.outputs[0]);
    // f32 graphs: no rounding in either mode, whatever T is.
    let g = mul_graph(DType::F32);
    let args = [tf(DType::F32, &[4], &x), tf(DType::F32, &[4], &y)];
    let em = Interpreter::new(&g, Precision::Emulate).run(&args).expect("runs");
    let ex = Interpreter::new(&g, Precision::Exact).run(&args).expect("runs");
    assert_eq!(em, ex);
    let args32: Vec<Tensor<f32>> = args.iter().map(Tensor::convert).collect();
    let em32 = Interpreter::new(&g, Precision::Emulate).run(&args32).expect("runs");
    let ex32 = Interpreter::new(&g, Precision::Exact).run(&args32).expect("runs");
    assert_eq!(em32, ex32);
}

#[test]
fn run_checks_argument_types() {
    let g = mul_graph(DType::F32);
    let interp = Interpreter::new(&g, Precision::Exact);
    let good = tf(DType::F32, &[4], &[1.0; 4]);
    let e = interp.run(&[good.clone(), tf(DType::F32, &[5], &[1.0; 5])]).expect_err("shape mismatch");
    assert_eq!(e.to_string(), "in @main: argument 1 (%y) is f32[5], expected f32[4]");
    assert_eq!(e.node, None);
    let e = interp.run(&[Tensor::zeros(DType::BF16, vec![4]), good.clone()]).expect_err("dtype mismatch");
    assert_eq!(e.to_string(), "in @main: argument 0 (%x) is bf16[4], expected f32[4]");
    let e = interp.run(std::slice::from_ref(&good)).expect_err("missing argument");
    assert!(e.message.contains("takes 2 arguments, 1 given"), "{e}");
    // A tensor whose data does not match its shape is rejected, not indexed out of bounds.
    let broken = Tensor { dtype: DType::F32, shape: vec![4], data: Data::Float(vec![1.0; 3]) };
    let e = interp.run(&[good, broken]).expect_err("short data");
    assert!(e.message.contains("holds 3 elements"), "{e}");
}

#[test]
fn tensor_constructors_validate() {
    assert!(Tensor::<f32>::from_vec(DType::F32, vec![2, 2], vec![1.0; 3]).is_err());
    assert!(Tensor::<f32>::from_vec(DType::I32, vec![1], vec![1.0]).is_err());
    assert!(Tensor::<f32>::from_ints(DType::I32, vec![1], vec![1 << 40]).is_err());
    assert!(Tensor::<f32>::from_ints(DType::I64, vec![1], vec![1 << 40]).is_ok());
    let s = Tensor::<f64>::scalar(DType::I64, 7.9);
    assert_eq!(s.ints(), Some(&[7][..]));
    let t = Tensor::<f64>::from_f64s(DType::F32, [2, 2], &[1.0, 2.0, 3.0, 4.0]).expect("tensor");
    assert_eq!(t.layer(1).to_f64_vec(), vec![3.0, 4.0]);
    assert!(t.try_layer(2).is_err());
    assert_eq!(t.convert::<f32>().floats(), Some(&[1.0f32, 2.0, 3.0, 4.0][..]));
    assert_eq!(t.numel(), 4);
    let e = eval_op::<f64>(
        &Op::Repeat { block: titan_ir::BlockId(0), count: 1, carry: 0, stacked: 0, reverse: false, prefetch: 0 },
        &[],
        &[],
        &Default::default(),
        Precision::Exact,
    );
    assert!(e.is_err());
}
