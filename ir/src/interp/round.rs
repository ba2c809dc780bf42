//! Rounding of f32 values to the narrow float formats (bf16, f16, f8e4m3, f8e5m2), round to
//! nearest, ties to even: the emulation of low-precision storage.

use crate::dtype::DType;

/// Round `x` to the nearest value representable in `dtype` (ties to even) and return it as
/// f32. bf16 and f16 follow IEEE (f16 overflows to infinity). f8e4m3 (the OCP `e4m3fn`
/// format: max 448, no infinities) saturates finite and infinite overflow to ±448; f8e5m2
/// (max 57344) saturates finite overflow to ±57344 and keeps infinities. NaN stays NaN and
/// subnormals of every format are produced. Integer dtypes and f32 are the identity.
pub fn round_to_dtype(x: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        DType::F16 => half::f16::from_f32(x).to_f32(),
        DType::F8E4M3 => round_minifloat(x, Minifloat { mantissa_bits: 3, min_exp: -6, max: 448.0, has_inf: false }),
        DType::F8E5M2 => round_minifloat(x, Minifloat { mantissa_bits: 2, min_exp: -14, max: 57344.0, has_inf: true }),
        DType::F32 | DType::I32 | DType::I64 => x,
    }
}

/// Whether values of `dtype` are stored narrower than f32 (and get rounded when emulated).
pub fn is_narrow_float(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16 | DType::F8E4M3 | DType::F8E5M2)
}

/// A small binary float format.
#[derive(Clone, Copy)]
struct Minifloat {
    /// Explicit mantissa bits.
    mantissa_bits: i32,
    /// Exponent of the smallest normal number; subnormals share its quantum.
    min_exp: i32,
    /// Largest finite value; larger magnitudes saturate to it.
    max: f32,
    /// Whether the format has infinities (which then stay infinite).
    has_inf: bool,
}

/// `2^e` for `e` in the normal f32 exponent range.
fn exp2i(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

fn round_minifloat(x: f32, f: Minifloat) -> f32 {
    if x.is_nan() || x == 0.0 {
        return x;
    }
    if x.is_infinite() {
        return if f.has_inf { x } else { f.max.copysign(x) };
    }
    let a = x.abs();
    if a >= 2.0 * f.max {
        return f.max.copysign(x);
    }
    // Exponent of `a` (f32 subnormals fall below `min_exp` and use the subnormal quantum).
    let e = (((a.to_bits() >> 23) & 0xff) as i32 - 127).max(f.min_exp);
    let quantum = exp2i(e - f.mantissa_bits);
    // Scaling by a power of two is exact here, so this is one correctly rounded step.
    let r = (a / quantum).round_ties_even() * quantum;
    r.min(f.max).copysign(x)
}
