//! NCCL communicators for the CUDA backend: the world communicator from the unique id rank 0
//! shares through the rendezvous, split into one communicator per mesh dim whose ranks are the
//! same groups the TCP process group and the simulated mesh use.
//!
//! **Run on two GPUs, not more:** the debug model's tp 2, dp_shard 2 and dp_replicate 2
//! artifacts trained on two H200s, one process each, tracking one GPU and the CPU simulated mesh
//! (`tools/cuda_check.sh mesh`, `docs/distributed.md`); no run has used more GPUs or several
//! nodes. It is compiled against cudarc's NCCL bindings (loaded at run time); the pure parts
//! (the id payload, the split colors) are unit-tested, a one-rank communicator and its
//! collectives run on one GPU (`runtime/tests/cuda.rs`), and the CUDA backend's collective steps
//! (`backend/cuda/collective.rs`) call [`NcclComm::run`].

use std::ffi::{c_int, c_void};

use cudarc::driver::sys::CUstream;
use cudarc::nccl::result;
use cudarc::nccl::sys;
use titan_ir::artifact::ReduceOp;
use titan_ir::{DType, Mesh};

pub use crate::backend::cuda::collective::NcclKind;

use super::DistError;
use super::rendezvous::ProcessGroup;

/// Bytes of an NCCL unique id (`ncclUniqueId`), the rendezvous payload of a GPU run.
pub const NCCL_ID_BYTES: usize = 128;

/// The oldest NCCL with `ncclCommSplit` (2.18).
const MIN_NCCL_VERSION: c_int = 21800;

fn nccl_err(what: &str, e: result::NcclError) -> DistError {
    DistError::Collective(format!("NCCL {what} failed: {:?}", e.0))
}

/// Check that libnccl can be loaded and is new enough (cudarc panics on a missing library or
/// symbol; this turns that into an error first).
pub fn check_nccl() -> Result<c_int, DistError> {
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(DistError::Collective("NCCL (libnccl.so.2) is not installed or not on the library path; a multi-GPU run needs it".into()));
    }
    let v = result::get_nccl_version().map_err(|e| nccl_err("ncclGetVersion", e))?;
    if v < MIN_NCCL_VERSION {
        return Err(DistError::Collective(format!("NCCL {v} is too old: splitting communicators per mesh dim needs NCCL 2.18 or newer")));
    }
    Ok(v)
}

/// Rank 0: a fresh unique id as the rendezvous payload.
pub fn unique_id_payload() -> Result<Vec<u8>, DistError> {
    check_nccl()?;
    let id = result::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// The unique id in a rendezvous payload.
pub fn id_from_payload(payload: &[u8]) -> Result<sys::ncclUniqueId, DistError> {
    let bytes: [u8; NCCL_ID_BYTES] = payload.try_into().map_err(|_| {
        DistError::Rendezvous(format!("the NCCL unique id from rank 0 has {} bytes, not {NCCL_ID_BYTES} (was rank 0 started for a GPU run?)", payload.len()))
    })?;
    Ok(sys::ncclUniqueId { internal: bytes.map(|b| b as std::ffi::c_char) })
}

/// `ncclCommSplit`'s `(color, key)` for the group along mesh dim `m` of the rank at `coords`:
/// the color numbers the group (its coordinates with `m` zeroed, row-major), the key orders
/// the members by their coordinate along `m`, as the TCP process group orders contributions.
pub fn split_color(mesh: Mesh, coords: [usize; 3], m: usize) -> (c_int, c_int) {
    let sizes = mesh.sizes.map(|s| s as usize);
    let mut c = coords;
    c[m] = 0;
    let color = (c[0] * sizes[1] + c[1]) * sizes[2] + c[2];
    (color as c_int, coords[m] as c_int)
}

/// One NCCL communicator, destroyed on drop.
pub struct NcclComm {
    raw: sys::ncclComm_t,
    rank: usize,
    size: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time (`&mut`/ownership).
unsafe impl Send for NcclComm {}

impl NcclComm {
    pub fn raw(&self) -> sys::ncclComm_t {
        self.raw
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Enqueue one collective on `stream` (a CUDA driver stream of the communicator's device):
    /// `send` and `recv` are device pointers, `count` elements of `dtype` (per rank for
    /// all-gather, of the result for reduce-scatter).
    ///
    /// # Safety
    /// The pointers must be valid device memory of the communicator's GPU, at least as large as
    /// the collective reads and writes, and stay alive until the stream has run it.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(&self, kind: NcclKind, send: u64, recv: u64, count: usize, dtype: DType, reduce: ReduceOp, stream: CUstream) -> Result<(), DistError> {
        if let NcclKind::SendRecv { to, from } = kind {
            // Raw bytes: a ring shift moves values unchanged, fp8 chunks and f32 scales alike.
            let bytes = count * dtype.size_bytes();
            let (s, r, st) = (send as *const c_void, recv as *mut c_void, stream.cast::<sys::CUstream_st>());
            let (u8t, to, from) = (sys::ncclDataType_t::ncclUint8, to as c_int, from as c_int);
            // SAFETY: the caller's contract; one group so the pair cannot deadlock against the
            // peers' pairs (every rank sends and receives in the same call).
            let res = unsafe {
                sys::ncclGroupStart()
                    .result()
                    .and_then(|_| sys::ncclSend(s, bytes, u8t, to, self.raw, st).result())
                    .and_then(|_| sys::ncclRecv(r, bytes, u8t, from, self.raw, st).result())
                    .and_then(|_| sys::ncclGroupEnd().result())
            };
            return res.map(|_| ()).map_err(|e| nccl_err(&format!("a ring shift of {bytes} bytes to rank {to}, from rank {from}"), e));
        }
        let ty = match dtype {
            DType::F32 => sys::ncclDataType_t::ncclFloat32,
            DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
            DType::F16 => sys::ncclDataType_t::ncclFloat16,
            // fp8 FSDP weight gathers move bytes; NCCL never reduces fp8 here.
            DType::F8E4M3 | DType::F8E5M2 if kind == NcclKind::AllGather => sys::ncclDataType_t::ncclUint8,
            other => return Err(DistError::Collective(format!("NCCL collectives of {other:?} are not supported"))),
        };
        let op = match reduce {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        };
        let (s, r, st) = (send as *const c_void, recv as *mut c_void, stream.cast::<sys::CUstream_st>());
        // SAFETY: the caller's contract; `self.raw` is a live communicator.
        let res = unsafe {
            match kind {
                NcclKind::AllGather => sys::ncclAllGather(s, r, count, ty, self.raw, st),
                NcclKind::ReduceScatter => sys::ncclReduceScatter(s, r, count, ty, op, self.raw, st),
                NcclKind::AllReduce => sys::ncclAllReduce(s, r, count, ty, op, self.raw, st),
                // Returned above; never reduced or gathered.
                NcclKind::SendRecv { .. } => sys::ncclResult_t::ncclInvalidUsage,
            }
        };
        res.result().map(|_| ()).map_err(|e| nccl_err(&format!("{kind:?} of {count} {dtype:?} elements"), e))
    }

    /// Check NCCL's view of this communicator against the expected rank and size.
    fn checked(self, what: &str) -> Result<NcclComm, DistError> {
        let (mut n, mut r): (c_int, c_int) = (0, 0);
        // SAFETY: `raw` is a live communicator; the out-pointers are valid.
        unsafe {
            sys::ncclCommCount(self.raw, &mut n).result().map_err(|e| nccl_err("ncclCommCount", e))?;
            sys::ncclCommUserRank(self.raw, &mut r).result().map_err(|e| nccl_err("ncclCommUserRank", e))?;
        }
        if n as usize != self.size || r as usize != self.rank {
            return Err(DistError::Collective(format!("the {what} communicator is rank {r} of {n}, expected rank {} of {}", self.rank, self.size)));
        }
        Ok(self)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: `raw` came from ncclCommInitRank / ncclCommSplit and is dropped once. Abort
        // rather than destroy: it does not wait for peers that may have failed.
        unsafe {
            let _ = result::comm_abort(self.raw);
        }
    }
}

/// Raw handles of a rank's communicators for its watchdog thread (see
/// [`crate::dist::watchdog`]): polling their asynchronous errors and aborting them are the two
/// NCCL calls documented as safe from another thread while a collective blocks.
#[derive(Clone)]
pub struct NcclHandles(Vec<sys::ncclComm_t>);

// SAFETY: only `ncclCommGetAsyncError` and `ncclCommAbort` are called through these, which NCCL
// allows from any thread; the communicators outlive the watchdog (it aborts them then exits).
unsafe impl Send for NcclHandles {}

impl NcclHandles {
    /// The first asynchronous error a communicator reports (a peer died, a network failure).
    pub fn async_error(&self) -> Option<String> {
        for &c in &self.0 {
            let mut err = sys::ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator and a valid out-pointer.
            let r = unsafe { sys::ncclCommGetAsyncError(c, &mut err) };
            if r != sys::ncclResult_t::ncclSuccess {
                return Some(format!("ncclCommGetAsyncError failed: {r:?}"));
            }
            if err != sys::ncclResult_t::ncclSuccess && err != sys::ncclResult_t::ncclInProgress {
                return Some(format!("NCCL reported {err:?} (a peer rank failed or the network broke)"));
            }
        }
        None
    }

    /// Abort every communicator: blocked collectives return, the handles are dead afterwards.
    pub fn abort_all(&self) {
        for &c in &self.0 {
            // SAFETY: a live communicator, aborted once (the process exits right after).
            unsafe {
                let _ = result::comm_abort(c);
            }
        }
    }
}

/// The NCCL communicators of one rank: the world, and one per mesh dim of size > 1.
pub struct NcclMesh {
    pub world: NcclComm,
    /// By mesh dim index; `None` where the dim has one rank.
    pub dims: [Option<NcclComm>; 3],
    pub coords: [usize; 3],
}

impl NcclMesh {
    /// Create this rank's communicators on the current thread's GPU (its context made current
    /// by the caller) from the unique id rank 0 sent at the rendezvous (`group.payload()`, made
    /// with [`unique_id_payload`]). Every rank of the group must call this (the init and the
    /// splits are collective).
    pub fn new(group: &ProcessGroup, mesh: Mesh) -> Result<NcclMesh, DistError> {
        let (rank, world) = (group.rank(), group.world_size());
        if world != mesh.world_size() as usize {
            return Err(DistError::Env(format!("the run has {world} processes but the mesh has {} ranks", mesh.world_size())));
        }
        check_nccl()?;
        let id = id_from_payload(group.payload())?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the id is what rank 0's ncclGetUniqueId wrote.
        unsafe { result::comm_init_rank(&mut raw, world as c_int, id, rank as c_int) }.map_err(|e| nccl_err("ncclCommInitRank", e))?;
        let world_comm = NcclComm { raw, rank, size: world }.checked("world")?;
        let coords = mesh.coords(rank);
        let mut dims = [None, None, None];
        for (m, slot) in dims.iter_mut().enumerate() {
            let size = mesh.sizes[m] as usize;
            if size == 1 {
                continue;
            }
            let (color, key) = split_color(mesh, coords, m);
            let mut raw = std::ptr::null_mut();
            // SAFETY: a live parent communicator, a valid out-pointer; a null config inherits
            // the parent's.
            unsafe { sys::ncclCommSplit(world_comm.raw, color, key, &mut raw, std::ptr::null_mut()).result() }.map_err(|e| nccl_err("ncclCommSplit", e))?;
            *slot = Some(NcclComm { raw, rank: coords[m], size }.checked(&format!("mesh dim {m}"))?);
        }
        Ok(NcclMesh { world: world_comm, dims, coords })
    }

    /// The handles the watchdog polls and aborts.
    pub fn handles(&self) -> NcclHandles {
        NcclHandles(std::iter::once(&self.world).chain(self.dims.iter().flatten()).map(|c| c.raw).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_id_travels_as_128_bytes() {
        let bytes: Vec<u8> = (0..128u8).map(|b| b.wrapping_mul(7)).collect();
        let id = id_from_payload(&bytes).expect("id");
        assert_eq!(id.internal.iter().map(|&c| c as u8).collect::<Vec<_>>(), bytes);
        let e = id_from_payload(&[]).expect_err("empty").to_string();
        assert!(e.contains("has 0 bytes, not 128"), "{e}");
    }

    /// Split groups are exactly the TCP process group's: same members (same color), ordered by
    /// coordinate (key), one color per group.
    #[test]
    fn split_colors_match_the_mesh_groups() {
        let mesh = Mesh::new(2, 2, 2);
        let n = mesh.world_size() as usize;
        for m in 0..3 {
            for a in 0..n {
                for b in 0..n {
                    let (ca, cb) = (mesh.coords(a), mesh.coords(b));
                    let same_group = (0..3).all(|d| d == m || ca[d] == cb[d]);
                    assert_eq!(split_color(mesh, ca, m).0 == split_color(mesh, cb, m).0, same_group, "dim {m}, ranks {a} {b}");
                }
                assert_eq!(split_color(mesh, mesh.coords(a), m).1 as usize, mesh.coords(a)[m]);
            }
        }
    }
}
