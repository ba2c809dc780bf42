//! Element types of tensors and their storage rules.

use std::fmt;
use std::str::FromStr;

/// The closed set of element types a tensor can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    BF16,
    F16,
    F8E4M3,
    F8E5M2,
    I32,
    I64,
}

impl DType {
    pub const ALL: [DType; 7] = [DType::F32, DType::BF16, DType::F16, DType::F8E4M3, DType::F8E5M2, DType::I32, DType::I64];

    /// Bytes one element occupies in device memory.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::I64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        !self.is_int()
    }

    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        DType::ALL.into_iter().find(|d| d.name() == s).ok_or_else(|| format!("unknown dtype `{s}`; expected one of f32, bf16, f16, f8e4m3, f8e5m2, i32, i64"))
    }
}
