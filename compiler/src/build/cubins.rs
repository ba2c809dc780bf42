//! `ptxas` beside code generation: each kernel is sent to a pool of worker threads as soon as
//! its PTX exists, and a worker takes its cubin from the cache ([`super::cubin_cache`]) or runs
//! `ptxas` on it (a separate process) while the generator goes on with the next kernel. The
//! generator sends the kernels `ptxas` is slowest on first (see `super::codegen`), so the
//! multi-tensor AdamW kernel (about 0.9 s of `ptxas` at 8B) no longer starts after everything
//! else. Which kernel finishes first never shows: results are attached in kernel order, and
//! each cubin is a pure function of its PTX.

use std::path::Path;
use std::sync::{Arc, Mutex, mpsc};
use std::thread::{Scope, ScopedJoinHandle};

use titan_ir::artifact::Kernel;
use titan_kernels::{Assembled, KernelError, PtxasReport};

use super::KERNEL_DIR;
use super::cubin_cache::CubinCache;

/// A kernel of one of the build's kernel tables: `(table, index)` (the training step's is 0,
/// the eval step's 1).
pub(super) type Key = (usize, usize);

/// A kernel table and its PTX files, `(path, text)`.
pub(super) type KernelSet<'a> = (&'a mut [Kernel], &'a [(String, String)]);

struct Job {
    key: Key,
    ptx: String,
    entry: String,
}

/// A kernel's cubin, or why `ptxas` refused it.
pub(super) struct Done {
    key: Key,
    result: Result<Assembled, KernelError>,
}

/// Worker threads assembling the kernels sent to them.
pub(super) struct Pool<'scope> {
    tx: mpsc::Sender<Job>,
    workers: Vec<ScopedJoinHandle<'scope, Vec<Done>>>,
}

impl<'scope> Pool<'scope> {
    /// Up to four workers (one `ptxas` process each), fewer on a machine with fewer cores.
    pub(super) fn start<'env>(s: &'scope Scope<'scope, 'env>, ptxas: &'env Path, cache: Option<&'env CubinCache>) -> Pool<'scope> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 4);
        let workers = (0..threads)
            .map(|_| {
                let rx = Arc::clone(&rx);
                s.spawn(move || {
                    let mut out = Vec::new();
                    // The lock is held only while taking a job; `recv` fails once every sender
                    // is gone (the generator finished or failed).
                    while let Ok(job) = rx.lock().map_err(|_| ()).and_then(|r| r.recv().map_err(|_| ())) {
                        let result = match cache.and_then(|c| c.get(&job.ptx)) {
                            Some(a) => Ok(a),
                            None => {
                                let r = titan_kernels::assemble_cubin_with(ptxas, &job.ptx, &job.entry);
                                if let (Some(c), Ok(a)) = (cache, &r) {
                                    c.put(&job.ptx, a);
                                }
                                r
                            }
                        };
                        out.push(Done { key: job.key, result });
                    }
                    out
                })
            })
            .collect();
        Pool { tx, workers }
    }

    /// Queue a kernel's PTX.
    pub(super) fn send(&self, key: Key, ptx: &str, entry: &str) {
        // The workers outlive every send (they stop only when the sender is dropped), so this
        // cannot fail unless one panicked, which `finish` reports.
        let _ = self.tx.send(Job { key, ptx: ptx.to_string(), entry: entry.to_string() });
    }

    /// Wait for every queued kernel; the results in kernel order.
    pub(super) fn finish(self) -> Vec<Done> {
        drop(self.tx);
        let mut done: Vec<Done> = self.workers.into_iter().flat_map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect();
        done.sort_by_key(|d| d.key);
        done
    }
}

/// Record each assembled cubin in its kernel's entry (`sets[table].0[index]`); returns the cubin
/// files, `(path, image)`, in kernel order, and appends ptxas's report on each to `reports`. A
/// kernel ptxas rejects keeps its PTX only, with a note: the loader then JIT-compiles the PTX,
/// which reports the problem on the GPU. If every kernel fails (a `ptxas` that cannot run), one
/// note says so.
pub(super) fn attach(sets: &mut [KernelSet], done: Vec<Done>, notes: &mut Vec<String>, reports: &mut Vec<(String, PtxasReport)>) -> Vec<(String, Vec<u8>)> {
    if !done.is_empty() && done.iter().all(|d| d.result.is_err()) {
        // Typically a `ptxas` that cannot run at all: one note, not one per kernel.
        if let Some(Err(e)) = done.first().map(|d| &d.result) {
            notes.push(format!("no cubins (the runtime JIT-compiles the PTX at start-up): {e}"));
        }
        return Vec::new();
    }
    let mut cubins = Vec::new();
    for Done { key: (set, i), result } in done {
        let k = &mut sets[set].0[i];
        match result {
            Ok(a) => {
                let path = format!("{KERNEL_DIR}/{}.cubin", k.name);
                k.cubin = Some(path.clone());
                cubins.push((path, a.cubin));
                reports.push((k.name.clone(), a.report));
            }
            Err(e) => notes.push(format!("no cubin for `{KERNEL_DIR}/{}.ptx` (the runtime JIT-compiles its PTX): {e}", k.name)),
        }
    }
    cubins
}
