//! Shapes: static dimensions, some of them named (`batch`, `seq`) and bound once per graph.

use std::collections::BTreeMap;
use std::fmt;

use crate::dtype::DType;

/// One dimension of a shape: a number, or a name bound in the graph's `dims` table.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    Fixed(u64),
    Named(String),
}

impl Dim {
    pub fn named(name: &str) -> Dim {
        Dim::Named(name.to_string())
    }
}

impl From<u64> for Dim {
    fn from(n: u64) -> Dim {
        Dim::Fixed(n)
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Named(s) => f.write_str(s),
        }
    }
}

/// The named dimensions of a graph and the values they are bound to (e.g. `batch = 8`).
pub type DimTable = BTreeMap<String, u64>;

/// Resolve one dimension against the graph's table; `None` if the name is unbound.
pub fn resolve_dim(d: &Dim, dims: &DimTable) -> Option<u64> {
    match d {
        Dim::Fixed(n) => Some(*n),
        Dim::Named(s) => dims.get(s).copied(),
    }
}

/// The type of a value: element type and shape. Rank 0 is a scalar.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Vec<Dim>,
}

impl TensorType {
    pub fn new(dtype: DType, shape: Vec<Dim>) -> TensorType {
        TensorType { dtype, shape }
    }

    /// A type with only fixed dimensions.
    pub fn fixed(dtype: DType, shape: &[u64]) -> TensorType {
        TensorType { dtype, shape: shape.iter().map(|&n| Dim::Fixed(n)).collect() }
    }

    pub fn scalar(dtype: DType) -> TensorType {
        TensorType { dtype, shape: Vec::new() }
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    pub fn with_dtype(&self, dtype: DType) -> TensorType {
        TensorType { dtype, shape: self.shape.clone() }
    }

    /// Concrete dimensions, or the first unbound name.
    pub fn resolve(&self, dims: &DimTable) -> Result<Vec<usize>, String> {
        self.shape.iter().map(|d| resolve_dim(d, dims).map(|n| n as usize).ok_or_else(|| format!("unbound dimension `{d}`"))).collect()
    }

    /// Number of elements, if every dimension is bound and the count fits in a u64.
    pub fn numel(&self, dims: &DimTable) -> Option<u64> {
        self.shape.iter().try_fold(1u64, |acc, d| acc.checked_mul(resolve_dim(d, dims)?))
    }

    /// Bytes the value occupies, if every dimension is bound and the size fits in a u64.
    pub fn size_bytes(&self, dims: &DimTable) -> Option<u64> {
        self.numel(dims)?.checked_mul(self.dtype.size_bytes() as u64)
    }

    /// Two types are the same when dtypes match and every dimension resolves to the same size.
    pub fn same_as(&self, other: &TensorType, dims: &DimTable) -> bool {
        self.dtype == other.dtype && same_shape(&self.shape, &other.shape, dims)
    }
}

/// Shapes are equal when their ranks match and each pair of dimensions resolves to one size.
pub fn same_shape(a: &[Dim], b: &[Dim], dims: &DimTable) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same_dim(x, y, dims))
}

pub fn same_dim(a: &Dim, b: &Dim, dims: &DimTable) -> bool {
    a == b || matches!((resolve_dim(a, dims), resolve_dim(b, dims)), (Some(x), Some(y)) if x == y)
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.shape.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}
