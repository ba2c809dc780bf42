//! Transcendental functions built from arith ops, `fma`/`rint`/`sqrt` intrinsics and bit
//! manipulation, scalar or lane-wise on vectors. `convert-gpu-to-nvvm` lowers `math.exp` and
//! friends to libdevice calls, which would make every build need CUDA's `libdevice.10.bc`; these
//! expansions keep codegen self-contained and are accurate to about one ulp in f32 (f64 helpers
//! are used where the reference interpreter computes in f64: RoPE angles, the learning-rate
//! schedule and AdamW's bias corrections). The one exception is [`exp_approx`], the PTX
//! special-function `ex2.approx` for softmax-style exponentials, about 1e-6 relative.

use crate::emit::{Elem, FCmp, Func, ICmp, Ty, Val};

/// `exp(x)` in f32: `x = k ln2 + r` (Cody-Waite), a degree-7 Taylor polynomial for `exp(r)`
/// with `|r| <= ln2/2`, and `2^k` applied as two exact power-of-two factors.
pub(crate) fn exp(f: &mut Func, x: Val) -> Val {
    let t = x.ty;
    let lo = f.cf(-104.0, t);
    let hi = f.cf(89.0, t);
    // maxnum/minnum turn NaN into a finite value here, so the integer path below is defined;
    // NaN is restored at the end.
    let xc = f.maxnumf(x, lo);
    let xc = f.minnumf(xc, hi);
    let log2e = f.cf(std::f64::consts::LOG2_E, t);
    let y = f.mulf(xc, log2e);
    let k = f.rint(y);
    let nk = f.negf(k);
    // ln 2 split so `k * ln2_hi` is exact for the k that occur.
    let ln2_hi = f.cf(f64::from(f32::from_bits(0x3f31_7200)), t);
    let ln2_lo = f.cf(f64::from(f32::from_bits(0x35bf_be8e)), t);
    let r = f.fma(nk, ln2_hi, xc);
    let r = f.fma(nk, ln2_lo, r);
    // Horner: 1 + r (1 + r (1/2 + r (1/6 + ... + r / 5040)))
    let coeffs = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];
    let mut p = f.cf(f64::from(coeffs[0] as f32), t);
    for &c in &coeffs[1..] {
        let cc = f.cf(f64::from(c as f32), t);
        p = f.fma(p, r, cc);
    }
    // 2^k = 2^k1 * 2^k2 with k1 = k >> 1: both factors stay normal for k in [-151, 129].
    let ti = t.with_elem(Elem::I32);
    let ki = f.fptosi(k, Elem::I32);
    let one_i = f.ci(1, ti);
    let k1 = f.shrsi(ki, one_i);
    let k2 = f.subi(ki, k1);
    let bias = f.ci(127, ti);
    let sh = f.ci(23, ti);
    let e1 = f.addi(k1, bias);
    let e1 = f.shli(e1, sh);
    let s1 = f.bitcast(e1, Elem::F32);
    let e2 = f.addi(k2, bias);
    let e2 = f.shli(e2, sh);
    let s2 = f.bitcast(e2, Elem::F32);
    let r = f.mulf(p, s1);
    let r = f.mulf(r, s2);
    let nan = f.cmpf(FCmp::Uno, x, x);
    f.select(nan, x, r)
}

/// `exp(x)` by the special-function unit: `ex2.approx.ftz.f32` of `x log2(e)` (inline PTX), two
/// PTX instructions per lane against [`exp`]'s ~23. For the softmax-style exponentials of
/// non-positive arguments whose results are summed or rounded to bf16 (the log-sum-exp and
/// gradient of the cross entropy, the rescale of an online maximum, sigmoid's `e^-|x|`): there
/// it is within ~1e-6 relative of `exp` for `x >= -20` (by arithmetic: `ex2.approx`'s ~2^-22 plus
/// the rounding of `x log2(e)`, which grows with `|x|`: ~5e-6 near -87), results below 2^-126 flush to zero (`exp(x)` for `x < -87.3`), and NaN
/// and infinities map as `exp` maps them. [`exp`] stays for `exp`, `pow` and `tanh` ops, whose
/// f32 results may be used as they are. PyTorch's generated (Triton) kernels compute `exp` the
/// same way. On the H200 it took the cross entropy and its gradient over 4096 x 128256 bf16
/// logits from 1,226 to 726 us (`gpu_check.py perf`), the kernels' GPU reference cases within
/// their tolerances (`docs/performance.md`).
pub(crate) fn exp_approx(f: &mut Func, x: Val) -> Val {
    let log2e = f.cf(std::f64::consts::LOG2_E, x.ty);
    let y = f.mulf(x, log2e);
    let lanes: Vec<Val> = (0..x.ty.lanes())
        .map(|l| {
            let e = f.extract(y, l);
            f.inline_asm("ex2.approx.ftz.f32 $0, $1;", "=f,f", &[e], Ty::S(Elem::F32))
        })
        .collect();
    f.vector_of(&lanes)
}

/// Natural log in f32: `x = 2^k m` with `m` in `[sqrt(1/2), sqrt(2))`, `log(m)` from the
/// `atanh` series in `s = (m-1)/(m+1)` (fdlibm's coefficients), subnormals rescaled first.
pub(crate) fn log(f: &mut Func, x: Val) -> Val {
    let t = x.ty;
    let ti = t.with_elem(Elem::I32);
    let min_normal = f.cf(f64::from(f32::MIN_POSITIVE), t);
    let sub = f.cmpf(FCmp::Olt, x, min_normal);
    let scale = f.cf(8_388_608.0, t); // 2^23
    let xs0 = f.mulf(x, scale);
    let xs = f.select(sub, xs0, x);
    let k_sub = f.ci(-23, ti);
    let zero_i = f.ci(0, ti);
    let ks = f.select(sub, k_sub, zero_i);
    let ix = f.bitcast(xs, Elem::I32);
    let off = f.ci(0x3f80_0000 - 0x3f35_04f3, ti);
    let ix = f.addi(ix, off);
    let sh = f.ci(23, ti);
    let e = f.shrsi(ix, sh);
    let bias = f.ci(127, ti);
    let k = f.subi(e, bias);
    let k = f.addi(k, ks);
    let mant = f.ci(0x007f_ffff, ti);
    let m = f.andi(ix, mant);
    let base = f.ci(0x3f35_04f3, ti);
    let m = f.addi(m, base);
    let m = f.bitcast(m, Elem::F32);
    let one = f.cf(1.0, t);
    let two = f.cf(2.0, t);
    let half = f.cf(0.5, t);
    let fm = f.subf(m, one);
    let den = f.addf(two, fm);
    let s = f.divf(fm, den);
    let z = f.mulf(s, s);
    let w = f.mulf(z, z);
    let lg1 = f.cf(f64::from(f32::from_bits(0x3f2a_aaaa)), t);
    let lg2 = f.cf(f64::from(f32::from_bits(0x3ecc_cce1)), t);
    let lg3 = f.cf(f64::from(f32::from_bits(0x3e91_e9ee)), t);
    let lg4 = f.cf(f64::from(f32::from_bits(0x3e78_9e26)), t);
    let t1 = f.fma(w, lg4, lg2);
    let t1 = f.mulf(w, t1);
    let t2 = f.fma(w, lg3, lg1);
    let t2 = f.mulf(z, t2);
    let r = f.addf(t2, t1);
    let hfsq = f.mulf(half, fm);
    let hfsq = f.mulf(hfsq, fm);
    let dk = f.sitofp(k, Elem::F32);
    let ln2_hi = f.cf(f64::from(f32::from_bits(0x3f31_7180)), t);
    let ln2_lo = f.cf(f64::from(f32::from_bits(0x3717_f7d1)), t);
    let a = f.addf(hfsq, r);
    let a = f.mulf(s, a);
    let b = f.mulf(dk, ln2_lo);
    let a = f.addf(a, b);
    let a = f.subf(a, hfsq);
    let a = f.addf(a, fm);
    let c = f.mulf(dk, ln2_hi);
    let res = f.addf(a, c);
    // Special values: +inf -> +inf, 0 -> -inf, negative or NaN -> NaN.
    let inf = f.cf(f64::INFINITY, t);
    let ninf = f.cf(f64::NEG_INFINITY, t);
    let nan = f.cf(f64::NAN, t);
    let zero = f.cf(0.0, t);
    let is_inf = f.cmpf(FCmp::Oeq, x, inf);
    let res = f.select(is_inf, inf, res);
    let is_zero = f.cmpf(FCmp::Oeq, x, zero);
    let res = f.select(is_zero, ninf, res);
    let is_neg = f.cmpf(FCmp::Olt, x, zero);
    let res = f.select(is_neg, nan, res);
    let is_nan = f.cmpf(FCmp::Uno, x, x);
    f.select(is_nan, x, res)
}

/// `sigmoid(x)` by the interpreter's formula: `1 / (1 + e^-x)` for `x >= 0`, `e^x / (1 + e^x)`
/// otherwise (one exp of `-|x|`, by [`exp_approx`]).
pub(crate) fn sigmoid(f: &mut Func, x: Val) -> Val {
    let t = x.ty;
    let a = f.fabs(x);
    let na = f.negf(a);
    let e = exp_approx(f, na);
    let one = f.cf(1.0, t);
    let den = f.addf(one, e);
    let zero = f.cf(0.0, t);
    let ge = f.cmpf(FCmp::Oge, x, zero);
    // One division: the numerator picks the branch (1 for x >= 0, e^x otherwise).
    let num = f.select(ge, one, e);
    f.divf(num, den)
}

/// `exp(t) - 1` without cancellation: a Taylor polynomial for `|t| < 1/2`, `exp(t) - 1` beyond.
pub(crate) fn expm1(f: &mut Func, t: Val) -> Val {
    let ty = t.ty;
    // t (1 + t/2 (1 + t/3 (1 + ... (1 + t/11)))): 11 terms reach f32 precision for |t| < 1/2.
    let mut p = f.cf(1.0, ty);
    for k in (2..=11).rev() {
        let c = f.cf(1.0 / f64::from(k), ty);
        let tk = f.mulf(t, c);
        let one = f.cf(1.0, ty);
        p = f.fma(tk, p, one);
    }
    let small = f.mulf(t, p);
    let e = exp(f, t);
    let one = f.cf(1.0, ty);
    let big = f.subf(e, one);
    let a = f.fabs(t);
    let half = f.cf(0.5, ty);
    let is_small = f.cmpf(FCmp::Olt, a, half);
    f.select(is_small, small, big)
}

/// `tanh(x) = -expm1(-2|x|) / (2 + expm1(-2|x|))` with the sign of `x` (a few ulp everywhere).
pub(crate) fn tanh(f: &mut Func, x: Val) -> Val {
    let t = x.ty;
    let a = f.fabs(x);
    let m2 = f.cf(-2.0, t);
    let y = f.mulf(a, m2);
    let em = expm1(f, y);
    let two = f.cf(2.0, t);
    let den = f.addf(two, em);
    let num = f.negf(em);
    let r = f.divf(num, den);
    let zero = f.cf(0.0, t);
    let is_neg = f.cmpf(FCmp::Olt, x, zero);
    let nr = f.negf(r);
    f.select(is_neg, nr, r)
}

/// `a^b` like `f32::powf` for the cases that matter: `exp(b log|a|)`, with the sign of odd
/// integer powers of negative bases, NaN for other negative bases, and `x^0 = 1^y = 1`.
pub(crate) fn pow(f: &mut Func, a: Val, b: Val) -> Val {
    let t = a.ty;
    let abs = f.fabs(a);
    let l = log(f, abs);
    let y = f.mulf(b, l);
    let r = exp(f, y);
    let zero = f.cf(0.0, t);
    let one = f.cf(1.0, t);
    let half = f.cf(0.5, t);
    let nan = f.cf(f64::NAN, t);
    let rb = f.rint(b);
    let is_int = f.cmpf(FCmp::Oeq, rb, b);
    let hb = f.mulf(b, half);
    let rhb = f.rint(hb);
    let is_even = f.cmpf(FCmp::Oeq, rhb, hb);
    let neg_r = f.negf(r);
    let signed = f.select(is_even, r, neg_r);
    let neg_res = f.select(is_int, signed, nan);
    let a_neg = f.cmpf(FCmp::Olt, a, zero);
    let r = f.select(a_neg, neg_res, r);
    let b_zero = f.cmpf(FCmp::Oeq, b, zero);
    let r = f.select(b_zero, one, r);
    let a_one = f.cmpf(FCmp::Oeq, a, one);
    f.select(a_one, one, r)
}

/// `(cos a, sin a)` in f64 for a scalar f64 `a`: reduction by `2 pi` (two-constant Cody-Waite
/// with fma), then Taylor polynomials on `[-pi, pi]` accurate far below f32 resolution.
pub(crate) fn sincos_f64(f: &mut Func, a: Val) -> (Val, Val) {
    let t = a.ty;
    let inv_2pi = f.cf(1.0 / std::f64::consts::TAU, t);
    let q = f.mulf(a, inv_2pi);
    let k = f.rint(q);
    let nk = f.negf(k);
    let tau_hi = f.cf(std::f64::consts::TAU, t);
    let tau_lo = f.cf(2.449_293_598_294_706_4e-16, t);
    let r = f.fma(nk, tau_hi, a);
    let r = f.fma(nk, tau_lo, r);
    let r2 = f.mulf(r, r);
    // sin r = r (1 - r^2/3! + r^4/5! - ... - r^24/25!), cos r = 1 - r^2/2! + ... + r^26/26!
    let mut sin_c = Vec::new();
    let mut cos_c = Vec::new();
    let mut fact = 1.0f64;
    for n in 1..=27u32 {
        fact *= f64::from(n);
        let sign = if (n / 2) % 2 == 0 { 1.0 } else { -1.0 };
        if n % 2 == 1 {
            sin_c.push(sign / fact);
        } else {
            cos_c.push(sign / fact);
        }
    }
    let horner = |f: &mut Func, cs: &[f64]| -> Val {
        let mut p = f.cf(cs[cs.len() - 1], t);
        for &c in cs[..cs.len() - 1].iter().rev() {
            let cc = f.cf(c, t);
            p = f.fma(p, r2, cc);
        }
        p
    };
    let sp = horner(f, &sin_c);
    let sin = f.mulf(sp, r);
    let mut cos_all = vec![1.0];
    cos_all.extend(cos_c);
    let cos = horner(f, &cos_all);
    (cos, sin)
}

/// `cos(pi p)` in f64 for `p` in `[0, 1]`: `-sin(pi (p - 1/2))` by its Taylor series.
pub(crate) fn cos_pi_f64(f: &mut Func, p: Val) -> Val {
    let t = p.ty;
    let half = f.cf(0.5, t);
    let pi = f.cf(std::f64::consts::PI, t);
    let d = f.subf(p, half);
    let x = f.mulf(d, pi);
    let x2 = f.mulf(x, x);
    let mut cs = Vec::new();
    let mut fact = 1.0f64;
    for n in 1..=23u32 {
        fact *= f64::from(n);
        if n % 2 == 1 {
            cs.push(if (n / 2) % 2 == 0 { 1.0 / fact } else { -1.0 / fact });
        }
    }
    let mut acc = f.cf(cs[cs.len() - 1], t);
    for &c in cs[..cs.len() - 1].iter().rev() {
        let cc = f.cf(c, t);
        acc = f.fma(acc, x2, cc);
    }
    let s = f.mulf(acc, x);
    f.negf(s)
}

/// `base^n` in f64 for a constant `base` and an i64 `n >= 0`, by binary exponentiation over
/// the 32 low bits of `n`.
pub(crate) fn powi_f64(f: &mut Func, base: f64, n: Val) -> Val {
    let one = f.f64c(1.0);
    let b = f.f64c(base);
    let lo = f.i64c(0);
    let hi = f.i64c(32);
    let st = f.i64c(1);
    let out = f.for_loop(lo, hi, st, &[one, b], |f, i, c| {
        let (acc, sq) = (c[0], c[1]);
        let sh = f.shrui(n, i);
        let one_i = f.i64c(1);
        let bit = f.andi(sh, one_i);
        let set = f.cmpi(ICmp::Ne, bit, lo);
        let m = f.mulf(acc, sq);
        let acc = f.select(set, m, acc);
        let sq = f.mulf(sq, sq);
        vec![acc, sq]
    });
    out[0]
}

/// `x` rounded to the storage precision of `e` and widened back to f32 (`e` = f32: identity).
pub(crate) fn round_to(f: &mut Func, x: Val, e: Elem) -> Val {
    match e {
        Elem::BF16 | Elem::F16 => {
            let n = f.truncf(x, e);
            f.extf(n, Elem::F32)
        }
        Elem::F8E4M3 | Elem::F8E5M2 => {
            let pairs = f8_pairs(f, x, e);
            let mut out = Vec::with_capacity(pairs.len() * 2);
            for p in pairs {
                let (lo, hi) = f8_pair_to_f32(f, p, e);
                out.push(lo);
                out.push(hi);
            }
            out.truncate(x.ty.lanes() as usize);
            f.vector_of(&out)
        }
        _ => x,
    }
}

/// The PTX name of an fp8 storage type.
fn f8_ptx(e: Elem) -> &'static str {
    match e {
        Elem::F8E5M2 => "e5m2",
        _ => "e4m3",
    }
}

/// The f32 lanes of `x` converted to fp8 `e` in pairs (`cvt.rn.satfinite.e4m3x2.f32`: round to
/// nearest even, ±inf and finite overflow saturate to ±max, NaN stays NaN), one `.b16` per pair
/// with lane `2k` in the low byte; an odd last lane is paired with 0.
pub(crate) fn f8_pairs(f: &mut Func, x: Val, e: Elem) -> Vec<Val> {
    let xs: Vec<Val> = (0..x.ty.lanes()).map(|l| f.extract(x, l)).collect();
    let asm = format!("cvt.rn.satfinite.{}x2.f32 $0, $1, $2;", f8_ptx(e));
    let zero = f.f32c(0.0);
    xs.chunks(2)
        .map(|p| {
            let hi = p.get(1).copied().unwrap_or(zero);
            f.inline_asm(&asm, "=h,f,f", &[hi, p[0]], Ty::S(Elem::I16))
        })
        .collect()
}

/// Two fp8 values packed in a `.b16` (low byte first) as f32 (`cvt.rn.f16x2.e4m3x2`, exact).
fn f8_pair_to_f32(f: &mut Func, pair: Val, e: Elem) -> (Val, Val) {
    let asm = format!("cvt.rn.f16x2.{}x2 $0, $1;", f8_ptx(e));
    let h2 = f.inline_asm(&asm, "=r,h", &[pair], Ty::S(Elem::I32));
    let lo = f.trunci(h2, Elem::I16);
    let lo = f.bitcast(lo, Elem::F16);
    let sixteen = f.i32c(16);
    let hi = f.shrui(h2, sixteen);
    let hi = f.trunci(hi, Elem::I16);
    let hi = f.bitcast(hi, Elem::F16);
    (f.extf(lo, Elem::F32), f.extf(hi, Elem::F32))
}

/// f32 lanes to fp8 `e` bytes (lanes of `e`, an `i8` in MLIR) for a store.
pub(crate) fn f32_to_f8(f: &mut Func, x: Val, e: Elem) -> Val {
    let eight = f.ci(8, Ty::S(Elem::I16));
    let mut bytes = Vec::new();
    for p in f8_pairs(f, x, e) {
        bytes.push(f.trunci(p, e));
        let hi = f.shrui(p, eight);
        bytes.push(f.trunci(hi, e));
    }
    bytes.truncate(x.ty.lanes() as usize);
    f.vector_of(&bytes)
}

/// Loaded fp8 bytes (lanes of an fp8 elem) as f32 lanes.
pub(crate) fn f8_to_f32(f: &mut Func, raw: Val) -> Val {
    let e = raw.ty.elem();
    let bs: Vec<Val> = (0..raw.ty.lanes()).map(|l| f.extract(raw, l)).collect();
    let eight = f.ci(8, Ty::S(Elem::I16));
    let mut out = Vec::with_capacity(bs.len() + 1);
    for p in bs.chunks(2) {
        let lo = f.extui(p[0], Elem::I16);
        let pair = match p.get(1) {
            Some(&h) => {
                let h = f.extui(h, Elem::I16);
                let h = f.shli(h, eight);
                f.ori(lo, h)
            }
            None => lo,
        };
        let (a, b) = f8_pair_to_f32(f, pair, e);
        out.push(a);
        out.push(b);
    }
    out.truncate(bs.len());
    f.vector_of(&out)
}

/// `fp8_scale` of f32 `amax` lanes, exactly `titan_ir::float8::scale_of`: `fp8_max / max(amax,
/// 1e-12)` in f64 (NaN propagates; the clamp constant is the f64 `1e-12`), rounded to f32 to
/// nearest even, then with `pow2` rounded down to a power of two: a normal scale keeps its
/// exponent bits (the mantissa cleared), a subnormal its highest set bit; 0, inf and NaN stay.
pub(crate) fn fp8_scale(f: &mut Func, amax: Val, fp8_max: f32, pow2: bool) -> Val {
    let t64 = amax.ty.with_elem(Elem::F64);
    let a = f.extf(amax, Elem::F64);
    let tiny = f.cf(1e-12, t64);
    let a = f.maximumf(a, tiny);
    let m = f.cf(f64::from(fp8_max), t64);
    let s = f.divf(m, a);
    let s = f.truncf(s, Elem::F32);
    if !pow2 {
        return s;
    }
    let ti = s.ty.with_elem(Elem::I32);
    let bits = f.bitcast(s, Elem::I32);
    let exp_mask = f.ci(0x7f80_0000, ti);
    let exp = f.andi(bits, exp_mask);
    let zero = f.ci(0, ti);
    let special = f.cmpi(ICmp::Eq, exp, exp_mask);
    let subnormal = f.cmpi(ICmp::Eq, exp, zero);
    let keep = f.ci(0xff80_0000u32 as i32 as i64, ti);
    let normal = f.andi(bits, keep);
    // The highest set bit of a subnormal (or 0 for 0): 1 << (31 - clz), with clz = 32 for 0.
    let lz = f.ctlz(bits);
    let c31 = f.ci(31, ti);
    let sh = f.subi(c31, lz);
    let one = f.ci(1, ti);
    let top = f.shli(one, sh);
    let is_zero = f.cmpi(ICmp::Eq, bits, zero);
    let top = f.select(is_zero, zero, top);
    let r = f.select(subnormal, top, normal);
    let r = f.select(special, bits, r);
    f.bitcast(r, Elem::F32)
}
