//! A [`Communicator`] over a [`ProcessGroup`]: the CPU backend's process group (like gloo).
//!
//! Each exchange along a mesh dim goes to rank 0's hub keyed by (mesh dim, the group's
//! coordinates with that dim zeroed, call number along that dim), exactly the key the simulated
//! mesh uses, and comes back ordered by coordinate along the dim. Floats travel as their bits, so
//! every rank reduces the same values in the same order as on the simulated mesh: the results
//! are bit-identical to it.

use std::sync::{Arc, Mutex};

use titan_ir::interp::Communicator;
use titan_ir::{Mesh, MeshDim};

use super::DistError;
use super::rendezvous::{GroupKey, ProcessGroup};

/// This process's rank of `mesh`, connected to the others through `group`.
pub struct TcpComm {
    group: Arc<ProcessGroup>,
    mesh: Mesh,
    coords: [usize; 3],
    /// Calls issued so far per mesh dim.
    calls: Mutex<[u64; 3]>,
}

impl TcpComm {
    /// The group's rank `r` sits at `mesh.coords(r)` (row-major, `tp` innermost: the simulated
    /// mesh's layout); the group must have exactly the mesh's ranks.
    pub fn new(group: Arc<ProcessGroup>, mesh: Mesh) -> Result<TcpComm, DistError> {
        if group.world_size() != mesh.world_size() as usize {
            let [r, s, t] = mesh.sizes;
            return Err(DistError::Env(format!(
                "the run has {} processes but the graph's mesh has {} ranks (dp_replicate {r} x dp_shard {s} x tp {t}); launch {} processes",
                group.world_size(),
                mesh.world_size(),
                mesh.world_size()
            )));
        }
        let coords = mesh.coords(group.rank());
        Ok(TcpComm { group, mesh, coords, calls: Mutex::new([0; 3]) })
    }

    pub fn group(&self) -> &Arc<ProcessGroup> {
        &self.group
    }

    /// This rank's mesh coordinates.
    pub fn coords_of_rank(&self) -> [usize; 3] {
        self.coords
    }
}

impl Communicator for TcpComm {
    fn sizes(&self) -> [usize; 3] {
        self.mesh.sizes.map(|x| x as usize)
    }

    fn coords(&self) -> [usize; 3] {
        self.coords
    }

    fn exchange(&self, mesh_dim: MeshDim, data: Vec<f64>) -> Result<Vec<Vec<f64>>, String> {
        let m = mesh_dim.index();
        let seq = {
            let mut c = self.calls.lock().map_err(|_| "a thread panicked".to_string())?;
            c[m] += 1;
            c[m]
        };
        let mut key = self.coords.map(|c| c as u32);
        key[m] = 0;
        let size = self.mesh.sizes[m] as usize;
        self.group.exchange(GroupKey { kind: m as u8, key }, self.coords[m], size, seq, data).map_err(|e| format!("{mesh_dim}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::rendezvous::local_groups;

    /// On a 2 x 1 x 2 mesh of processes' groups, an exchange along each dim returns the group's
    /// contributions ordered by coordinate, on every member.
    #[test]
    fn exchanges_follow_the_mesh_layout() {
        let mesh = Mesh::new(2, 1, 2);
        let groups = local_groups(4, "id");
        let out: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = groups
                .into_iter()
                .map(|g| {
                    s.spawn(move || {
                        let r = g.rank();
                        let comm = TcpComm::new(Arc::new(g), mesh).expect("comm");
                        let tp = comm.exchange(MeshDim::Tp, vec![r as f64, 0.5]).expect("tp");
                        let dp = comm.exchange(MeshDim::DpReplicate, vec![10.0 * r as f64]).expect("dp");
                        // A size-1 dim needs no messages.
                        assert_eq!(comm.exchange(MeshDim::DpShard, vec![1.0]).expect("shard"), vec![vec![1.0]]);
                        comm.group().barrier().expect("barrier");
                        (r, tp, dp)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        for (r, tp, dp) in out {
            // Rank r = dp_replicate * 2 + tp.
            let (d, t) = (r / 2, r % 2);
            assert_eq!(tp, vec![vec![(2 * d) as f64, 0.5], vec![(2 * d + 1) as f64, 0.5]], "rank {r}");
            assert_eq!(dp, vec![vec![10.0 * t as f64], vec![10.0 * (2 + t) as f64]], "rank {r}");
        }
    }

    #[test]
    fn a_world_size_that_is_not_the_mesh_size_is_refused() {
        let groups = local_groups(2, "id");
        let e = TcpComm::new(Arc::new(groups.into_iter().next().unwrap()), Mesh::new(1, 2, 2)).err().expect("2 processes for 4 ranks").to_string();
        assert!(e.contains("the run has 2 processes but the graph's mesh has 4 ranks"), "{e}");
    }
}
