//! Tensors in device encoding: the bytes a buffer holds in its arena (little endian; f32 4 bytes,
//! bf16/f16 2, f8e4m3/f8e5m2 1, i32 4, i64 8) to and from the interpreter's `Tensor<f32>`.
//! Values the interpreter already rounded to a narrow dtype (Precision::Emulate) encode exactly.

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};
use titan_ir::DType;
use titan_ir::interp::{Data, Tensor};
use zerocopy::IntoBytes;

/// Little-endian bytes to f32 values (one copy on little-endian machines).
fn f32s_from_le(bytes: &[u8]) -> Vec<f32> {
    let mut v = vec![0f32; bytes.len() / 4];
    v.as_mut_bytes().copy_from_slice(bytes);
    if cfg!(target_endian = "big") {
        v.iter_mut().for_each(|x| *x = f32::from_bits(x.to_bits().swap_bytes()));
    }
    v
}

/// Little-endian bytes to u16 values.
fn u16s_from_le(bytes: &[u8]) -> Vec<u16> {
    let mut v = vec![0u16; bytes.len() / 2];
    v.as_mut_bytes().copy_from_slice(bytes);
    if cfg!(target_endian = "big") {
        v.iter_mut().for_each(|x| *x = x.swap_bytes());
    }
    v
}

fn u16s_to_le(bits: &[u16], out: &mut [u8]) {
    out.copy_from_slice(bits.as_bytes());
    if cfg!(target_endian = "big") {
        out.chunks_exact_mut(2).for_each(|c| c.swap(0, 1));
    }
}

/// Decode `bytes` as a `dtype` tensor of `shape`.
pub fn decode(bytes: &[u8], dtype: DType, shape: Vec<usize>) -> Result<Tensor<f32>, String> {
    let n: usize = shape.iter().product();
    if n.checked_mul(dtype.size_bytes()) != Some(bytes.len()) {
        return Err(format!("{} bytes cannot hold a {dtype} tensor of shape {shape:?}", bytes.len()));
    }
    let data = match dtype {
        DType::F32 => Data::Float(f32s_from_le(bytes)),
        DType::BF16 => {
            let mut v = vec![0f32; n];
            u16s_from_le(bytes).reinterpret_cast::<bf16>().convert_to_f32_slice(&mut v);
            Data::Float(v)
        }
        DType::F16 => {
            let mut v = vec![0f32; n];
            u16s_from_le(bytes).reinterpret_cast::<f16>().convert_to_f32_slice(&mut v);
            Data::Float(v)
        }
        DType::F8E4M3 => Data::Float(bytes.iter().map(|&b| e4m3_to_f32(b)).collect()),
        DType::F8E5M2 => Data::Float(bytes.iter().map(|&b| e5m2_to_f32(b)).collect()),
        DType::I32 => Data::Int(bytes.chunks_exact(4).map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect()),
        DType::I64 => Data::Int(bytes.chunks_exact(8).map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect()),
    };
    Ok(Tensor { dtype, shape, data })
}

/// Encode `t` into `out`, which must be exactly its size in `t.dtype`. Floats are rounded to the
/// dtype (round to nearest even), integers must fit it.
pub fn encode(t: &Tensor<f32>, out: &mut [u8]) -> Result<(), String> {
    let size = t.dtype.size_bytes();
    if t.data.len().checked_mul(size) != Some(out.len()) {
        return Err(format!("a {} ({} elements) does not fit {} bytes", t.type_string(), t.data.len(), out.len()));
    }
    match (&t.data, t.dtype) {
        (Data::Float(xs), DType::F32) => {
            out.copy_from_slice(xs.as_bytes());
            if cfg!(target_endian = "big") {
                out.chunks_exact_mut(4).for_each(|c| c.reverse());
            }
        }
        (Data::Float(xs), DType::BF16) => {
            let mut h = vec![bf16::ZERO; xs.len()];
            h.convert_from_f32_slice(xs);
            u16s_to_le(h.reinterpret_cast(), out);
        }
        (Data::Float(xs), DType::F16) => {
            let mut h = vec![f16::ZERO; xs.len()];
            h.convert_from_f32_slice(xs);
            u16s_to_le(h.reinterpret_cast(), out);
        }
        (Data::Float(xs), DType::F8E4M3) => {
            for (o, x) in out.iter_mut().zip(xs) {
                *o = f32_to_e4m3(*x);
            }
        }
        (Data::Float(xs), DType::F8E5M2) => {
            for (o, x) in out.iter_mut().zip(xs) {
                *o = f32_to_e5m2(*x);
            }
        }
        (Data::Int(xs), DType::I32) => {
            for (o, x) in out.chunks_exact_mut(4).zip(xs) {
                let v = i32::try_from(*x).map_err(|_| format!("value {x} does not fit in i32"))?;
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        (Data::Int(xs), DType::I64) => {
            for (o, x) in out.chunks_exact_mut(8).zip(xs) {
                o.copy_from_slice(&x.to_le_bytes());
            }
        }
        _ => return Err(format!("a {} tensor holds {} data", t.dtype, if t.dtype.is_int() { "float" } else { "integer" })),
    }
    Ok(())
}

/// Encode f32 values (rounded to `dtype`) into `out`.
pub fn encode_floats(xs: &[f32], dtype: DType, out: &mut [u8]) -> Result<(), String> {
    let t = Tensor { dtype, shape: vec![xs.len()], data: Data::Float(xs.to_vec()) };
    encode(&t, out)
}

/// Encode integers into `out` as `dtype` (i32 or i64).
pub fn encode_ints(xs: &[i64], dtype: DType, out: &mut [u8]) -> Result<(), String> {
    let t = Tensor { dtype, shape: vec![xs.len()], data: Data::Int(xs.to_vec()) };
    encode(&t, out)
}

/// The fp8 formats' bit encodings are the IR's (`titan_ir::fp8`, tested there on every code).
fn e4m3_to_f32(b: u8) -> f32 {
    titan_ir::fp8::decode(DType::F8E4M3, b).expect("invariant: f8e4m3 is an fp8 dtype")
}

fn f32_to_e4m3(x: f32) -> u8 {
    titan_ir::fp8::encode(DType::F8E4M3, x).expect("invariant: f8e4m3 is an fp8 dtype")
}

fn e5m2_to_f32(b: u8) -> f32 {
    titan_ir::fp8::decode(DType::F8E5M2, b).expect("invariant: f8e5m2 is an fp8 dtype")
}

fn f32_to_e5m2(x: f32) -> u8 {
    titan_ir::fp8::encode(DType::F8E5M2, x).expect("invariant: f8e5m2 is an fp8 dtype")
}

#[cfg(test)]
mod tests {
    use titan_ir::interp::round_to_dtype;

    use super::*;

    #[test]
    fn every_f8_code_round_trips() {
        for b in 0..=255u8 {
            let x = e4m3_to_f32(b);
            if x.is_nan() {
                assert_eq!(f32_to_e4m3(x) & 0x7f, 0x7f);
            } else {
                assert_eq!(f32_to_e4m3(x), b, "e4m3 code {b:#04x} = {x}");
                assert_eq!(round_to_dtype(x, DType::F8E4M3), x);
            }
            let y = e5m2_to_f32(b);
            if y.is_nan() {
                assert!(e5m2_to_f32(f32_to_e5m2(y)).is_nan());
            } else {
                assert_eq!(f32_to_e5m2(y), b, "e5m2 code {b:#04x} = {y}");
            }
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e5m2_to_f32(0x7b), 57344.0);
    }

    #[test]
    fn every_dtype_round_trips_rounded_values() {
        let xs = [0.0f32, -1.5, 3.25, 1e-3, -250.0, 0.1];
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F8E4M3, DType::F8E5M2] {
            let rounded: Vec<f32> = xs.iter().map(|&x| round_to_dtype(x, dtype)).collect();
            let mut bytes = vec![0u8; xs.len() * dtype.size_bytes()];
            encode_floats(&rounded, dtype, &mut bytes).expect("encode");
            let t = decode(&bytes, dtype, vec![2, 3]).expect("decode");
            let back: Vec<u32> = t.floats().expect("floats").iter().map(|x| x.to_bits()).collect();
            assert_eq!(back, rounded.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "{dtype}");
        }
        for dtype in [DType::I32, DType::I64] {
            let mut bytes = vec![0u8; 3 * dtype.size_bytes()];
            encode_ints(&[-7, 0, 1 << 30], dtype, &mut bytes).expect("encode");
            assert_eq!(decode(&bytes, dtype, vec![3]).expect("decode").ints(), Some(&[-7, 0, 1 << 30][..]));
        }
    }

    #[test]
    fn sizes_and_ranges_are_checked() {
        assert!(decode(&[0; 6], DType::F32, vec![2]).is_err());
        let mut out = [0u8; 4];
        assert!(encode_ints(&[1 << 40], DType::I32, &mut out).unwrap_err().contains("does not fit in i32"));
        assert!(encode_floats(&[1.0, 2.0], DType::F32, &mut out).is_err());
    }
}
