//! The bit encodings of the two 8-bit float formats (OCP FP8): `f8e4m3` is E4M3FN (bias 7, no
//! infinities, NaN `S.1111.111`, largest finite 448) and `f8e5m2` is E5M2 (bias 15, IEEE-like:
//! infinities `S.11111.00`, NaNs `S.11111.xx` with `xx != 0`, largest finite 57344). Encoding
//! rounds with [`round_to_dtype`] (nearest, ties to even, saturating finite overflow), so the
//! interpreter's emulated fp8 values and the bytes an fp8 buffer holds always agree.

use crate::dtype::DType;
use crate::interp::round_to_dtype;

/// Exponent bits, mantissa bits and bias of an fp8 format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    mantissa_bits: u32,
    bias: i32,
    /// E5M2 reserves its top exponent for infinities and NaNs; E4M3FN only its all-ones code.
    ieee_specials: bool,
}

fn layout(dtype: DType) -> Option<Layout> {
    match dtype {
        DType::F8E4M3 => Some(Layout { mantissa_bits: 3, bias: 7, ieee_specials: false }),
        DType::F8E5M2 => Some(Layout { mantissa_bits: 2, bias: 15, ieee_specials: true }),
        _ => None,
    }
}

/// The largest finite value of an fp8 dtype (448 or 57344); `None` for other dtypes.
pub fn fp8_max(dtype: DType) -> Option<f32> {
    match dtype {
        DType::F8E4M3 => Some(448.0),
        DType::F8E5M2 => Some(57344.0),
        _ => None,
    }
}

/// The value of the fp8 code `bits`; `None` when `dtype` is not an fp8 dtype.
pub fn decode(dtype: DType, bits: u8) -> Option<f32> {
    let l = layout(dtype)?;
    let sign = if bits & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp_field = u32::from(bits & 0x7f) >> l.mantissa_bits;
    let mant = u32::from(bits) & ((1 << l.mantissa_bits) - 1);
    let exp_max = (0x7f_u32) >> l.mantissa_bits;
    if l.ieee_specials && exp_field == exp_max {
        return Some(if mant == 0 { sign * f32::INFINITY } else { f32::NAN });
    }
    if !l.ieee_specials && exp_field == exp_max && mant == (1 << l.mantissa_bits) - 1 {
        return Some(f32::NAN);
    }
    let scale = (1u32 << l.mantissa_bits) as f32;
    let value = if exp_field == 0 {
        // Subnormal: the smallest normal exponent, no implicit one.
        mant as f32 / scale * 2f32.powi(1 - l.bias)
    } else {
        (1.0 + mant as f32 / scale) * 2f32.powi(exp_field as i32 - l.bias)
    };
    Some(sign * value)
}

/// The fp8 code of `x` rounded to `dtype` (nearest, ties to even; finite overflow saturates to
/// the largest finite value, E4M3FN also saturates infinities, E5M2 keeps them; NaN gives the
/// canonical NaN `0x7f`, sign cleared). `None` when `dtype` is not an fp8 dtype.
pub fn encode(dtype: DType, x: f32) -> Option<u8> {
    let l = layout(dtype)?;
    if x.is_nan() {
        return Some(0x7f);
    }
    let r = round_to_dtype(x, dtype);
    let sign: u8 = if r.is_sign_negative() { 0x80 } else { 0 };
    let a = r.abs();
    if a.is_infinite() {
        return Some(sign | (0x7f_u8 >> l.mantissa_bits << l.mantissa_bits));
    }
    if a == 0.0 {
        return Some(sign);
    }
    let min_normal_exp = 1 - l.bias;
    // `a` is exactly representable: read its exponent and mantissa off the f32 bits.
    let e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
    let code = if e < min_normal_exp {
        // Subnormal: a multiple of the smallest subnormal 2^(min_normal_exp - mantissa_bits).
        let quanta = a / 2f32.powi(min_normal_exp - l.mantissa_bits as i32);
        quanta as u32
    } else {
        let mant = (a.to_bits() & 0x7f_ffff) >> (23 - l.mantissa_bits);
        (((e + l.bias) as u32) << l.mantissa_bits) | mant
    };
    Some(sign | code as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMATS: [DType; 2] = [DType::F8E4M3, DType::F8E5M2];

    fn is_nan_code(dtype: DType, c: u8) -> bool {
        decode(dtype, c).expect("fp8").is_nan()
    }

    /// Every one of the 256 codes decodes, and every non-NaN code re-encodes to itself.
    #[test]
    fn every_code_round_trips() {
        for dtype in FORMATS {
            let mut nans = 0;
            for c in 0..=255u8 {
                let v = decode(dtype, c).expect("fp8");
                if v.is_nan() {
                    nans += 1;
                    assert_eq!(encode(dtype, v), Some(0x7f), "{dtype} NaN code {c:#04x}");
                    continue;
                }
                assert_eq!(encode(dtype, v), Some(c), "{dtype} code {c:#04x} = {v}");
                assert_eq!(round_to_dtype(v, dtype).to_bits(), v.to_bits(), "{dtype} {v} is on the grid");
            }
            // E4M3FN: only S.1111.111 is NaN; E5M2: S.11111.{01,10,11}.
            assert_eq!(nans, if dtype == DType::F8E4M3 { 2 } else { 6 }, "{dtype}");
        }
    }

    #[test]
    fn known_codes_have_known_values() {
        let d = |dt, c| decode(dt, c).expect("fp8");
        assert_eq!(d(DType::F8E4M3, 0x7e), 448.0);
        assert_eq!(d(DType::F8E4M3, 0x08), 2f32.powi(-6), "smallest normal");
        assert_eq!(d(DType::F8E4M3, 0x01), 2f32.powi(-9), "smallest subnormal");
        assert_eq!(d(DType::F8E4M3, 0x07), 7.0 * 2f32.powi(-9), "largest subnormal");
        assert_eq!(d(DType::F8E4M3, 0x38), 1.0);
        assert_eq!(d(DType::F8E4M3, 0xb8), -1.0);
        assert_eq!(d(DType::F8E4M3, 0x80).to_bits(), (-0.0f32).to_bits());
        assert_eq!(d(DType::F8E5M2, 0x7b), 57344.0);
        assert_eq!(d(DType::F8E5M2, 0x7c), f32::INFINITY);
        assert_eq!(d(DType::F8E5M2, 0xfc), f32::NEG_INFINITY);
        assert_eq!(d(DType::F8E5M2, 0x04), 2f32.powi(-14), "smallest normal");
        assert_eq!(d(DType::F8E5M2, 0x01), 2f32.powi(-16), "smallest subnormal");
        assert_eq!(d(DType::F8E5M2, 0x3c), 1.0);
        assert_eq!(fp8_max(DType::F8E4M3), Some(448.0));
        assert_eq!(fp8_max(DType::F8E5M2), Some(57344.0));
        assert_eq!(decode(DType::BF16, 0), None);
        assert_eq!(encode(DType::F32, 1.0), None);
    }

    /// The positive finite codes, in increasing order of value (codes are monotonic).
    fn ladder(dtype: DType) -> Vec<(u8, f32)> {
        let l: Vec<(u8, f32)> = (0..=0x7fu8).map(|c| (c, decode(dtype, c).expect("fp8"))).filter(|(_, v)| v.is_finite()).collect();
        assert!(l.windows(2).all(|w| w[0].1 < w[1].1), "{dtype}: codes increase with their value");
        l
    }

    /// Halfway between two neighbours rounds to the one with an even mantissa (even code);
    /// a hair off the midpoint rounds to the nearer one. Checked at every pair of neighbours,
    /// subnormals included, in both signs.
    #[test]
    fn ties_round_to_even_and_the_rest_to_nearest() {
        for dtype in FORMATS {
            for w in ladder(dtype).windows(2) {
                let ((lo_c, lo), (hi_c, hi)) = (w[0], w[1]);
                let mid = ((f64::from(lo) + f64::from(hi)) / 2.0) as f32;
                assert_eq!(f64::from(mid), (f64::from(lo) + f64::from(hi)) / 2.0, "the midpoint is an f32");
                let even = if lo_c % 2 == 0 { lo_c } else { hi_c };
                assert_eq!(encode(dtype, mid), Some(even), "{dtype}: tie between {lo} and {hi}");
                assert_eq!(encode(dtype, -mid), Some(0x80 | even), "{dtype}: tie between -{lo} and -{hi}");
                let below = f32::from_bits(mid.to_bits() - 1);
                let above = f32::from_bits(mid.to_bits() + 1);
                assert_eq!(encode(dtype, below), Some(lo_c), "{dtype}: just below the midpoint of {lo} and {hi}");
                assert_eq!(encode(dtype, above), Some(hi_c), "{dtype}: just above the midpoint of {lo} and {hi}");
            }
        }
    }

    #[test]
    fn overflow_saturates_and_specials_are_kept() {
        // E4M3FN has no infinity: finite overflow and infinities saturate to +-448.
        for x in [449.0, 464.0, 1e6, f32::MAX, f32::INFINITY] {
            assert_eq!(encode(DType::F8E4M3, x), Some(0x7e), "{x}");
            assert_eq!(encode(DType::F8E4M3, -x), Some(0xfe), "-{x}");
        }
        // E5M2: finite overflow saturates to +-57344, infinities stay infinite.
        for x in [57345.0, 61440.0, 1e9, f32::MAX] {
            assert_eq!(encode(DType::F8E5M2, x), Some(0x7b), "{x}");
            assert_eq!(encode(DType::F8E5M2, -x), Some(0xfb), "-{x}");
        }
        assert_eq!(encode(DType::F8E5M2, f32::INFINITY), Some(0x7c));
        assert_eq!(encode(DType::F8E5M2, f32::NEG_INFINITY), Some(0xfc));
        for dtype in FORMATS {
            assert!(is_nan_code(dtype, encode(dtype, f32::NAN).expect("fp8")));
            assert!(is_nan_code(dtype, encode(dtype, -f32::NAN).expect("fp8")));
            assert_eq!(encode(dtype, 0.0), Some(0x00));
            assert_eq!(encode(dtype, -0.0), Some(0x80));
        }
    }

    /// Below the smallest subnormal: half of it or less flushes to zero (the tie goes to the
    /// even code 0), more rounds up to it; f32 subnormals flush too.
    #[test]
    fn underflow_rounds_to_zero_or_the_smallest_subnormal() {
        for (dtype, tiny) in [(DType::F8E4M3, 2f32.powi(-9)), (DType::F8E5M2, 2f32.powi(-16))] {
            assert_eq!(encode(dtype, tiny / 2.0), Some(0x00), "{dtype}");
            assert_eq!(encode(dtype, -tiny / 2.0), Some(0x80), "{dtype}");
            assert_eq!(encode(dtype, tiny * 0.5000001), Some(0x01), "{dtype}");
            assert_eq!(encode(dtype, f32::from_bits(1)), Some(0x00), "{dtype}: an f32 subnormal");
        }
    }

    /// Encoding agrees with the interpreter's rounding on every bf16 value (all 65,536 bit
    /// patterns as f32): the emulated value and the stored byte are the same number.
    #[test]
    fn encode_matches_the_interpreters_rounding_on_every_bf16() {
        for dtype in FORMATS {
            for bits in 0..=u16::MAX {
                let x = half::bf16::from_bits(bits).to_f32();
                let code = encode(dtype, x).expect("fp8");
                let back = decode(dtype, code).expect("fp8");
                let want = round_to_dtype(x, dtype);
                if want.is_nan() {
                    assert!(back.is_nan(), "{dtype} {x}");
                } else {
                    assert_eq!(back.to_bits(), want.to_bits(), "{dtype}: {x} encodes to {code:#04x} = {back}, rounding gives {want}");
                }
            }
        }
    }
}
