//! Model-level and optimizer ops on host tensors: rmsnorm (and backward), rope, cross
//! entropy (and backward), the learning-rate schedule and AdamW.

use crate::interp::Precision;
use crate::interp::ops::{ResultType, float_result, floats, ints, round_in};
use crate::interp::tensor::{Real, Tensor, shape_str};
use crate::op::{AdamWConfig, DecayKind, LrSchedule, RopeConfig, RopeLayout};

/// The last dim of `x` and the number of rows before it.
fn rows_of<T: Real>(x: &Tensor<T>, what: &str) -> Result<(usize, usize), String> {
    let Some(&d) = x.shape.last() else {
        return Err(format!("{what} must have rank >= 1"));
    };
    let rows = x.numel().checked_div(d).unwrap_or(0);
    Ok((rows, d))
}

/// `1 / sqrt(mean(row^2) + eps)` in `T`.
fn inv_rms<T: Real>(row: &[T], eps: T) -> T {
    let ss = row.iter().fold(T::zero(), |a, &v| a + v * v);
    let n = T::from_f64(row.len() as f64);
    (ss / n + eps).sqrt().recip()
}

fn check_norm_weight<T: Real>(w: &Tensor<T>, d: usize, what: &str) -> Result<(), String> {
    if w.shape != [d] {
        return Err(format!("{what} weight must be [{d}], found {}", w.type_string()));
    }
    Ok(())
}

/// HF `LlamaRMSNorm`: `n = x * r` rounded to x's dtype, `y = n * w` (rounded as the result).
pub(crate) fn rmsnorm<T: Real>(x: &Tensor<T>, w: &Tensor<T>, eps: f64, rt: &ResultType, precision: Precision) -> Result<Tensor<T>, String> {
    let xs = floats(x, "rmsnorm input")?;
    let ws = floats(w, "rmsnorm weight")?;
    let (rows, d) = rows_of(x, "rmsnorm input")?;
    check_norm_weight(w, d, "rmsnorm")?;
    let eps = T::from_f64(eps);
    let mut out = Vec::with_capacity(xs.len());
    for r in 0..rows {
        let row = &xs[r * d..(r + 1) * d];
        let inv = inv_rms(row, eps);
        out.extend(row.iter().zip(ws).map(|(&v, &g)| round_in(v * inv, x.dtype, precision) * g));
    }
    float_result(rt, x.shape.clone(), out)
}

/// `(x, w, dy) -> (dx, dw)`: `dx = r (dn - n mean(dn n))` with `dn = dy w` and the exact
/// `n = x r`; `dw = sum over rows of dy n` with `n` rounded to x's dtype as the forward
/// stored it (when emulating).
pub(crate) fn rmsnorm_bwd<T: Real>(
    x: &Tensor<T>,
    w: &Tensor<T>,
    dy: &Tensor<T>,
    eps: f64,
    rts: &[ResultType],
    precision: Precision,
) -> Result<Vec<Tensor<T>>, String> {
    let xs = floats(x, "rmsnorm_bwd input")?;
    let ws = floats(w, "rmsnorm_bwd weight")?;
    let dys = floats(dy, "rmsnorm_bwd dy")?;
    let (rows, d) = rows_of(x, "rmsnorm_bwd input")?;
    check_norm_weight(w, d, "rmsnorm_bwd")?;
    if dy.shape != x.shape {
        return Err(format!("rmsnorm_bwd: dy {} must have the shape of x {}", shape_str(&dy.shape), shape_str(&x.shape)));
    }
    let eps = T::from_f64(eps);
    let inv_d = T::from_f64(1.0 / d as f64);
    let mut dx = Vec::with_capacity(xs.len());
    let mut dw = vec![T::zero(); d];
    let mut n = vec![T::zero(); d];
    let mut dn = vec![T::zero(); d];
    for r in 0..rows {
        let row = &xs[r * d..(r + 1) * d];
        let dyr = &dys[r * d..(r + 1) * d];
        let inv = inv_rms(row, eps);
        let mut dot = T::zero();
        for j in 0..d {
            n[j] = row[j] * inv;
            dn[j] = dyr[j] * ws[j];
            dot = dot + dn[j] * n[j];
            dw[j] = dw[j] + dyr[j] * round_in(n[j], x.dtype, precision);
        }
        let mean = dot * inv_d;
        dx.extend((0..d).map(|j| inv * (dn[j] - n[j] * mean)));
    }
    Ok(vec![float_result(&rts[0], x.shape.clone(), dx)?, float_result(&rts[1], w.shape.clone(), dw)?])
}

/// RoPE inverse frequencies `theta^(-2j/d)`, with Llama 3.1 scaling when configured.
pub fn rope_inv_freq(cfg: &RopeConfig, head_dim: usize) -> Result<Vec<f64>, String> {
    if cfg.theta.is_nan() || cfg.theta <= 0.0 {
        return Err(format!("rope theta must be positive, found {}", cfg.theta));
    }
    let half = head_dim / 2;
    let mut inv: Vec<f64> = (0..half).map(|j| cfg.theta.powf(-2.0 * j as f64 / head_dim as f64)).collect();
    if let Some(sc) = cfg.scaling {
        let ok = sc.factor > 0.0 && sc.low_freq_factor > 0.0 && sc.high_freq_factor > sc.low_freq_factor && sc.original_max_position > 0;
        if !ok {
            return Err(format!("rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and original_max_position > 0, found {sc:?}"));
        }
        let l = sc.original_max_position as f64;
        let low_wl = l / sc.low_freq_factor;
        let high_wl = l / sc.high_freq_factor;
        for f in &mut inv {
            let wl = 2.0 * std::f64::consts::PI / *f;
            if wl < high_wl {
                continue;
            }
            if wl > low_wl {
                *f /= sc.factor;
            } else {
                let smooth = (l / wl - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor);
                *f = (1.0 - smooth) * *f / sc.factor + smooth * *f;
            }
        }
    }
    Ok(inv)
}

/// Rotate pairs of the head dim of `x [b, s, h, d]` by `p * inv_freq_j` (`p` = index along
/// dim 1); angles, cos and sin in f64, the rotation in `T`.
pub(crate) fn rope<T: Real>(x: &Tensor<T>, cfg: &RopeConfig, rt: &ResultType) -> Result<Tensor<T>, String> {
    let xs = floats(x, "rope input")?;
    let &[b, s, h, d] = x.shape.as_slice() else {
        return Err(format!("rope input must be [batch, seq, heads, head_dim], found {}", x.type_string()));
    };
    if d % 2 != 0 {
        return Err(format!("rope: head_dim must be even, found {d}"));
    }
    let half = d / 2;
    let inv = rope_inv_freq(cfg, d)?;
    let sign = if cfg.inverse { -1.0 } else { 1.0 };
    let mut cos = Vec::with_capacity(s * half);
    let mut sin = Vec::with_capacity(s * half);
    for p in 0..s {
        for &f in &inv {
            let a = sign * (p as f64 * f);
            cos.push(T::from_f64(a.cos()));
            sin.push(T::from_f64(a.sin()));
        }
    }
    let mut out = vec![T::zero(); xs.len()];
    for bi in 0..b {
        for p in 0..s {
            let (c, sn) = (&cos[p * half..(p + 1) * half], &sin[p * half..(p + 1) * half]);
            for hh in 0..h {
                let base = ((bi * s + p) * h + hh) * d;
                for j in 0..half {
                    let (i0, i1) = match cfg.layout {
                        RopeLayout::Half => (base + j, base + j + half),
                        RopeLayout::Interleaved => (base + 2 * j, base + 2 * j + 1),
                    };
                    let (x0, x1) = (xs[i0], xs[i1]);
                    out[i0] = x0 * c[j] - x1 * sn[j];
                    out[i1] = x1 * c[j] + x0 * sn[j];
                }
            }
        }
    }
    float_result(rt, x.shape.clone(), out)
}

/// Check logits `[..., V]` against targets `[...]`; returns (rows, V).
fn ce_shapes<T: Real>(logits: &Tensor<T>, targets: &Tensor<T>) -> Result<(usize, usize), String> {
    let Some((&v, lead)) = logits.shape.split_last() else {
        return Err("cross_entropy logits must have rank >= 1".into());
    };
    if lead != targets.shape.as_slice() {
        return Err(format!("cross_entropy: logits {} must be targets {} plus a vocab dim", shape_str(&logits.shape), shape_str(&targets.shape)));
    }
    if v == 0 {
        return Err("cross_entropy: the vocab dim is empty".into());
    }
    let rows = targets.numel();
    if rows == 0 {
        return Err("cross_entropy needs at least one target".into());
    }
    Ok((rows, v))
}

fn target_index(t: i64, v: usize) -> Result<usize, String> {
    match usize::try_from(t) {
        Ok(i) if i < v => Ok(i),
        _ => Err(format!("target {t} is out of range for {v} classes")),
    }
}

/// Max and natural-log logsumexp of a row, in `T`.
fn row_lse<T: Real>(row: &[T]) -> (T, T) {
    let mx = row.iter().fold(T::neg_infinity(), |m, &x| if x > m || x.is_nan() { x } else { m });
    let sum = row.iter().fold(T::zero(), |a, &x| a + (x - mx).exp());
    (mx, mx + sum.ln())
}

/// Mean over targets of `logsumexp(row) - row[target]`.
pub(crate) fn cross_entropy<T: Real>(logits: &Tensor<T>, targets: &Tensor<T>, rt: &ResultType) -> Result<Tensor<T>, String> {
    let xs = floats(logits, "cross_entropy logits")?;
    let ts = ints(targets, "cross_entropy targets")?;
    let (rows, v) = ce_shapes(logits, targets)?;
    let mut total = T::zero();
    for (r, &t) in ts.iter().enumerate() {
        let row = &xs[r * v..(r + 1) * v];
        let ti = target_index(t, v)?;
        let (_, lse) = row_lse(row);
        total = total + (lse - row[ti]);
    }
    float_result(rt, Vec::new(), vec![total / T::from_f64(rows as f64)])
}

/// `(softmax(row) - onehot(target)) * dloss / N`.
pub(crate) fn cross_entropy_bwd<T: Real>(logits: &Tensor<T>, targets: &Tensor<T>, dloss: &Tensor<T>, rt: &ResultType) -> Result<Tensor<T>, String> {
    let xs = floats(logits, "cross_entropy_bwd logits")?;
    let ts = ints(targets, "cross_entropy_bwd targets")?;
    let dl = floats(dloss, "cross_entropy_bwd dloss")?;
    if !dloss.shape.is_empty() {
        return Err(format!("cross_entropy_bwd: dloss must be a scalar, found {}", dloss.type_string()));
    }
    let (rows, v) = ce_shapes(logits, targets)?;
    let g = dl[0] / T::from_f64(rows as f64);
    let mut out = Vec::with_capacity(xs.len());
    for (r, &t) in ts.iter().enumerate() {
        let row = &xs[r * v..(r + 1) * v];
        let ti = target_index(t, v)?;
        let (_, lse) = row_lse(row);
        out.extend(row.iter().enumerate().map(|(j, &x)| {
            let p = (x - lse).exp();
            let onehot = if j == ti { T::one() } else { T::zero() };
            (p - onehot) * g
        }));
    }
    float_result(rt, logits.shape.clone(), out)
}

/// The index of the vocabulary shard that the one-hot `shard` (`f32[n]`) names.
pub(crate) fn shard_index<T: Real>(shard: &Tensor<T>, what: &str) -> Result<usize, String> {
    let xs = floats(shard, what)?;
    let ones: Vec<usize> = xs.iter().enumerate().filter(|(_, x)| **x != T::zero()).map(|(i, _)| i).collect();
    match ones.as_slice() {
        [k] if shard.rank() == 1 && xs[*k] == T::one() => Ok(*k),
        _ => Err(format!("{what}: shard must be a one-hot f32[shards] (exactly one 1, zeros elsewhere), found {}", shard.type_string())),
    }
}

/// The class of the row's target inside vocabulary shard `k` of `v` classes, if it is there;
/// the target must be a class of the whole vocabulary (`n` shards).
fn local_target(t: i64, k: usize, v: usize, n: usize) -> Result<Option<usize>, String> {
    let ti = target_index(t, v * n)?;
    Ok((ti / v == k).then_some(ti % v))
}

/// The first position of the row's maximum (the one `row_lse`'s max is).
fn row_argmax<T: Real>(row: &[T]) -> usize {
    let mut best = 0;
    for (j, &x) in row.iter().enumerate() {
        if x > row[best] || (x.is_nan() && !row[best].is_nan()) {
            best = j;
        }
    }
    best
}

/// Per row of one vocabulary shard: the max `m`, `sum exp(x - m)` and the target's logit
/// (0 when the target is in another shard), each `f32[..., 1]`.
pub(crate) fn cross_entropy_stats<T: Real>(logits: &Tensor<T>, targets: &Tensor<T>, shard: &Tensor<T>, rts: &[ResultType]) -> Result<Vec<Tensor<T>>, String> {
    let xs = floats(logits, "cross_entropy_stats logits")?;
    let ts = ints(targets, "cross_entropy_stats targets")?;
    let (rows, v) = ce_shapes(logits, targets)?;
    let (k, n) = (shard_index(shard, "cross_entropy_stats")?, shard.numel());
    let (mut m, mut s, mut t) = (Vec::with_capacity(rows), Vec::with_capacity(rows), Vec::with_capacity(rows));
    for (r, &target) in ts.iter().enumerate() {
        let row = &xs[r * v..(r + 1) * v];
        let (mx, _) = row_lse(row);
        m.push(mx);
        s.push(row.iter().fold(T::zero(), |a, &x| a + (x - mx).exp()));
        t.push(local_target(target, k, v, n)?.map_or(T::zero(), |j| row[j]));
    }
    let mut shape = targets.shape.clone();
    shape.push(1);
    let mut out = Vec::with_capacity(3);
    for (values, rt) in [m, s, t].into_iter().zip(rts) {
        out.push(float_result(rt, shape.clone(), values)?);
    }
    Ok(out)
}

/// The VJP of `cross_entropy_stats`: `dsumexp exp(x - m) + dtarget onehot(target)`, plus
/// `dmax - dsumexp sumexp` at the row's (first) maximum, through `m`.
pub(crate) fn cross_entropy_stats_bwd<T: Real>(x: &[&Tensor<T>], rt: &ResultType) -> Result<Tensor<T>, String> {
    let (logits, targets, shard) = (x[0], x[1], x[2]);
    let xs = floats(logits, "cross_entropy_stats_bwd logits")?;
    let ts = ints(targets, "cross_entropy_stats_bwd targets")?;
    let (rows, v) = ce_shapes(logits, targets)?;
    let (k, n) = (shard_index(shard, "cross_entropy_stats_bwd")?, shard.numel());
    let mut ds = Vec::with_capacity(3);
    for (d, what) in x[3..6].iter().zip(["dmax", "dsumexp", "dtarget"]) {
        let f = floats(d, what)?;
        if f.len() != rows {
            return Err(format!("cross_entropy_stats_bwd: {what} has {} elements for {rows} rows", f.len()));
        }
        ds.push(f);
    }
    let mut out = Vec::with_capacity(xs.len());
    for (r, &target) in ts.iter().enumerate() {
        let row = &xs[r * v..(r + 1) * v];
        let (mx, _) = row_lse(row);
        let (dm, dsum, dt) = (ds[0][r], ds[1][r], ds[2][r]);
        let sum = row.iter().fold(T::zero(), |a, &x| a + (x - mx).exp());
        let at = row_argmax(row);
        let tj = local_target(target, k, v, n)?;
        out.extend(row.iter().enumerate().map(|(j, &x)| {
            let mut g = dsum * (x - mx).exp();
            if Some(j) == tj {
                g = g + dt;
            }
            if j == at {
                g = g + (dm - dsum * sum);
            }
            g
        }));
    }
    float_result(rt, logits.shape.clone(), out)
}

/// The mean over rows of `M + ln(sum_r sumexp_r exp(max_r - M)) - sum_r target_r`, `M` the
/// row's largest `max_r`, from the statistics of the shards (the last dim).
pub(crate) fn cross_entropy_combine<T: Real>(m: &Tensor<T>, s: &Tensor<T>, t: &Tensor<T>, rt: &ResultType) -> Result<Tensor<T>, String> {
    let (ms, ss, tt) = (floats(m, "cross_entropy_combine max")?, floats(s, "cross_entropy_combine sumexp")?, floats(t, "cross_entropy_combine target")?);
    let n = m.shape.last().copied().unwrap_or(0);
    if n == 0 || s.shape != m.shape || t.shape != m.shape {
        return Err(format!(
            "cross_entropy_combine: max, sumexp and target must be one non-empty f32[..., shards], found {}, {}, {}",
            m.type_string(),
            s.type_string(),
            t.type_string()
        ));
    }
    let rows = ms.len() / n;
    let mut total = T::zero();
    for r in 0..rows {
        let (mr, sr, tr) = (&ms[r * n..(r + 1) * n], &ss[r * n..(r + 1) * n], &tt[r * n..(r + 1) * n]);
        let (big, _) = row_lse(mr);
        let sum = mr.iter().zip(sr).fold(T::zero(), |a, (&x, &e)| a + e * (x - big).exp());
        let target = tr.iter().fold(T::zero(), |a, &x| a + x);
        total = total + (big + sum.ln() - target);
    }
    float_result(rt, Vec::new(), vec![total / T::from_f64(rows as f64)])
}

/// The 1-based step held by a rank-0 integer tensor; it must be >= 1.
fn step_of<T: Real>(t: &Tensor<T>, what: &str) -> Result<i64, String> {
    let s = ints(t, what)?;
    match s {
        [s] if t.shape.is_empty() && *s >= 1 => Ok(*s),
        [s] if t.shape.is_empty() => Err(format!("{what} must be >= 1 (steps are 1-based), found {s}")),
        _ => Err(format!("{what} must be a scalar, found {}", t.type_string())),
    }
}

/// The learning rate of the schedule at 1-based step `s`, in f64.
pub fn lr_at(cfg: &LrSchedule, s: u64) -> f64 {
    let (s, w, m) = (s as f64, cfg.warmup_steps as f64, cfg.min_lr_ratio);
    if cfg.warmup_steps > 0 && s <= w {
        return cfg.lr * s / w;
    }
    let progress = ((s - w) / (cfg.decay_steps.max(1) as f64)).min(1.0);
    let factor = match cfg.decay {
        DecayKind::Cosine => m + (1.0 - m) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        DecayKind::Linear => 1.0 - (1.0 - m) * progress,
        DecayKind::Constant => 1.0,
    };
    cfg.lr * factor
}

pub(crate) fn lr_schedule<T: Real>(step: &Tensor<T>, cfg: &LrSchedule, rt: &ResultType) -> Result<Tensor<T>, String> {
    let s = step_of(step, "lr_schedule step")?;
    float_result(rt, Vec::new(), vec![T::from_f64(lr_at(cfg, s as u64))])
}

/// PyTorch AdamW: decoupled weight decay, then the bias-corrected Adam step.
pub(crate) fn adamw<T: Real>(x: &[&Tensor<T>], c: &AdamWConfig, rts: &[ResultType]) -> Result<Vec<Tensor<T>>, String> {
    let (p, g, m, v, lr, step) = (x[0], x[1], x[2], x[3], x[4], x[5]);
    for (t, what) in [(g, "grad"), (m, "first moment"), (v, "second moment")] {
        if t.shape != p.shape {
            return Err(format!("adamw: {what} {} must have the shape of the param {}", shape_str(&t.shape), shape_str(&p.shape)));
        }
    }
    let (ps, gs, ms, vs) = (floats(p, "adamw param")?, floats(g, "adamw grad")?, floats(m, "adamw first moment")?, floats(v, "adamw second moment")?);
    let lrs = floats(lr, "adamw lr")?;
    if !lr.shape.is_empty() {
        return Err(format!("adamw: lr must be a scalar, found {}", lr.type_string()));
    }
    let t = step_of(step, "adamw step")? as f64;
    let lr = lrs[0];
    let one = T::one();
    let (b1, b2) = (T::from_f64(c.beta1), T::from_f64(c.beta2));
    let bc1 = T::from_f64(1.0 - c.beta1.powf(t));
    let bc2 = T::from_f64(1.0 - c.beta2.powf(t));
    let eps = T::from_f64(c.eps);
    let decay = one - lr * T::from_f64(c.weight_decay);
    let n = ps.len();
    let (mut po, mut mo, mut vo) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        let gi = gs[i];
        let mi = b1 * ms[i] + (one - b1) * gi;
        let vi = b2 * vs[i] + (one - b2) * gi * gi;
        let mhat = mi / bc1;
        let vhat = vi / bc2;
        po.push(ps[i] * decay - lr * mhat / (vhat.sqrt() + eps));
        mo.push(mi);
        vo.push(vi);
    }
    Ok(vec![float_result(&rts[0], p.shape.clone(), po)?, float_result(&rts[1], p.shape.clone(), mo)?, float_result(&rts[2], p.shape.clone(), vo)?])
}
