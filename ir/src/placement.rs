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

/// A dimension of the device mesh, in TorchTitan's order (`dp_replicate`, `dp_shard`, `tp`):
/// a value's placement list and a rank's coordinates are indexed by [`MeshDim::index`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MeshDim {
    DpReplicate,
    DpShard,
    Tp,
}

impl MeshDim {
    pub const ALL: [MeshDim; 3] = [MeshDim::DpReplicate, MeshDim::DpShard, MeshDim::Tp];

    /// The name used by collective attributes (`mesh_dim = dp_shard`) and graph meta
    /// (`mesh_dp_shard = 2`).
    pub fn name(self) -> &'static str {
        match self {
            MeshDim::DpReplicate => "dp_replicate",
            MeshDim::DpShard => "dp_shard",
            MeshDim::Tp => "tp",
        }
    }

    /// Position in placement lists and rank coordinates.
    pub fn index(self) -> usize {
        match self {
            MeshDim::DpReplicate => 0,
            MeshDim::DpShard => 1,
            MeshDim::Tp => 2,
        }
    }

    pub fn from_name(s: &str) -> Option<MeshDim> {
        MeshDim::ALL.into_iter().find(|m| m.name() == s)
    }
}

impl fmt::Display for MeshDim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The device mesh an SPMD graph runs on, recorded in the graph's `meta` as `world_size`,
/// `mesh_dp_replicate`, `mesh_dp_shard` and `mesh_tp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    /// Ranks along each mesh dimension, indexed by [`MeshDim::index`].
    pub sizes: [u32; 3],
}

impl Mesh {
    pub fn new(dp_replicate: u32, dp_shard: u32, tp: u32) -> Mesh {
        Mesh { sizes: [dp_replicate, dp_shard, tp] }
    }

    pub fn size(&self, m: MeshDim) -> u32 {
        self.sizes[m.index()]
    }

    pub fn world_size(&self) -> u32 {
        self.sizes.iter().product()
    }

    /// The ranks that hold different batch rows: `dp_replicate * dp_shard`.
    pub fn dp(&self) -> u32 {
        self.sizes[0] * self.sizes[1]
    }

    /// Coordinates of `rank`, row-major with `tp` innermost (TorchTitan's mesh layout).
    pub fn coords(&self, rank: usize) -> [usize; 3] {
        let [_, s, t] = self.sizes.map(|x| x as usize);
        [rank / (s * t), (rank / t) % s, rank % t]
    }

    /// The meta entries describing this mesh.
    pub fn meta_entries(&self) -> Vec<(String, crate::AttrValue)> {
        let mut v = vec![("world_size".to_string(), crate::AttrValue::Int(i64::from(self.world_size())))];
        for m in MeshDim::ALL {
            v.push((format!("mesh_{}", m.name()), crate::AttrValue::Int(i64::from(self.size(m)))));
        }
        v
    }

    /// The mesh a graph's meta describes; `Ok(None)` when it has none (a single-rank graph).
    pub fn from_graph(g: &crate::Graph) -> Result<Option<Mesh>, String> {
        if g.meta.get("world_size").is_none() {
            return Ok(None);
        }
        let get = |k: &str| -> Result<u32, String> {
            match g.meta_i64(k) {
                Some(x) if x >= 1 => u32::try_from(x).map_err(|_| format!("meta `{k}` = {x} is too large")),
                Some(x) => Err(format!("meta `{k}` must be at least 1, found {x}")),
                None => Err(format!("meta has `world_size` but no integer `{k}`; give all of world_size, mesh_dp_replicate, mesh_dp_shard and mesh_tp")),
            }
        };
        let mesh = Mesh::new(get("mesh_dp_replicate")?, get("mesh_dp_shard")?, get("mesh_tp")?);
        let world = get("world_size")?;
        if mesh.world_size() != world {
            return Err(format!(
                "meta world_size = {world} but the mesh dp_replicate x dp_shard x tp = {} x {} x {} has {} ranks",
                mesh.sizes[0],
                mesh.sizes[1],
                mesh.sizes[2],
                mesh.world_size()
            ));
        }
        Ok(Some(mesh))
    }
}

impl Mesh {
    /// Record this mesh in `g`'s meta (replacing any earlier mesh entries).
    pub fn write_meta(&self, g: &mut crate::Graph) {
        let entries = self.meta_entries();
        g.meta.entries.retain(|(k, _)| !entries.iter().any(|(e, _)| e == k));
        g.meta.entries.extend(entries);
    }
}
