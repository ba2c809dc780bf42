//! Placements of a value on each dimension of the device mesh (filled in by the sharding passes).

use std::fmt;

/// How a value is laid out across one mesh dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Placement {
    /// Every rank holds the whole value.
    Replicate,
    /// Each rank holds one slice of tensor dimension `d`.
    Shard(u32),
    /// Each rank holds a partial sum; the value is the sum over ranks.
    Partial,
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Replicate => f.write_str("Replicate"),
            Placement::Shard(d) => write!(f, "Shard({d})"),
            Placement::Partial => f.write_str("Partial"),
        }
    }
}
