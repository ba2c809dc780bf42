//! The trainer: [`CudaArtifactTrainer`] opens the GPU (and, on a mesh, the rank's NCCL
//! communicators and watchdog), allocates the arenas, initializes the state, runs the unrolled
//! schedule eagerly then as a captured CUDA graph, and profiles it with `--profile`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use titan_ir::DType;
use titan_ir::artifact::timeline::{COMM_STREAMS, comm_stream};
use titan_ir::artifact::{Buffer, BufferClass, Kernel};
use titan_ir::interp::Tensor;

use super::autotune::{TuneMode, gemm_operands};
use super::collective::{self, Action, Loc};
use super::driver::{CudaError, DeviceBuffer, Event, Gpu, Graph};
use super::energy;
use super::module::{LoadedCode, check_gpu_code};
use super::nvml::Nvml;
use super::unroll::{Arenas, Op, Table};
use super::{ARENAS, WARMUP_STEPS, arena_fill, bad, comm_profile, slot};
use crate::RuntimeError;
use crate::artifact::{Artifact, StepFeeds, arena_name};
use crate::backend::KernelTime;
use crate::backend::codec::{decode, encode_floats, encode_ints};
use crate::backend::cpu_graph::init_state_shard;
use crate::backend::{StepMetrics, Trainer, check_rank_batch};
use crate::data::Batch;
use crate::dist::nccl::NcclMesh;
use crate::dist::rendezvous::ProcessGroup;
use crate::dist::watchdog::{Checks, Watchdog};
use crate::init::{CHUNK_ELEMS, check_init, chunks_per_layer, fill_chunk, init_threads};
use crate::log::StartupTimes;

/// What one rank of an SPMD artifact needs: the process group (its rendezvous carried the NCCL
/// unique id), the mesh, and the GPU (`LOCAL_RANK`).
pub struct CudaRankSetup<'p> {
    pub group: &'p ProcessGroup,
    pub mesh: titan_ir::Mesh,
    pub device: usize,
    /// A step running longer than this means a peer failed or hangs: the watchdog aborts the
    /// communicators and ends the process.
    pub step_timeout: std::time::Duration,
}

/// Runs an artifact's schedule on one GPU (one rank of it on a mesh). Field order matters: everything device-side
/// is dropped before the context.
pub struct CudaArtifactTrainer<'a> {
    artifact: &'a Artifact,
    ops: Vec<Op>,
    graph: Option<Graph>,
    use_graph: bool,
    /// With `--profile`: one event before each op and one after the last (steps then run
    /// eagerly), and the time per kernel of the profiled steps.
    profile: Option<Profile>,
    /// Host staging of the fed inputs (alive until the stream has copied them).
    feed_tokens: Vec<u8>,
    feed_targets: Vec<u8>,
    feed_step: Vec<u8>,
    tokens: (u64, &'a Buffer),
    targets: (u64, &'a Buffer),
    step_buf: (u64, &'a Buffer),
    outputs: [Option<(u64, &'a Buffer)>; 3],
    arenas: Arenas<'a>,
    batch: usize,
    seq: usize,
    /// Elements of `tokens`: `batch * seq`, or this rank's share with sequence parallelism.
    tokens_len: usize,
    vocab: usize,
    step: u64,
    /// Steps run by this process (the warm-up before capture counts these, not resumed ones).
    steps_run: u64,
    /// Seconds of each start-up phase.
    startup: StartupTimes,
    /// Seconds the CUDA graph capture (and instantiation) took, once it happened.
    capture_s: Option<f64>,
    /// Print a line on stderr when the step is captured into a CUDA graph.
    log_capture: bool,
    /// The thread that aborts the communicators when NCCL reports an error or a step hangs
    /// (stopped before they are dropped).
    watchdog: Option<Watchdog>,
    /// This rank's NCCL communicators on a mesh (dropped before the context).
    nccl: Option<NcclMesh>,
    /// Staging for collectives along inner dims, and the events ordering the collectives'
    /// stream against the compute stream.
    staging: Option<DeviceBuffer>,
    comm_events: Option<CommEvents>,
    /// Device memory in use before the first allocation (`cuMemGetInfo`).
    mem_baseline: u64,
    /// The largest used-bytes delta read so far.
    measured_peak: u64,
    /// The eval step (`--val-data`), loaded at its first use.
    eval: Option<EvalCode<'a>>,
    code: LoadedCode,
    _memory: Vec<DeviceBuffer>,
    gpu: Gpu,
}

/// Ordering of the collectives streams against the compute stream: each collective runs on
/// its mesh dim's stream (`stream[c]`, `tp` apart from the data-parallel dims) and starts after
/// the compute enqueued before it (`fork`) and after the collectives of the other stream it
/// touches the bytes of (`joins.comm_waits`), records `done[c]` when it ends, and the compute
/// stream waits for it only before the first later op that touches its buffers
/// ([`collective::join_points`]), so a prefetched gather overlaps the compute in between.
/// Each stream stages its collectives in its own part of the staging buffer
/// (`staging_offset[s]`), since two streams' collectives may run at once.
struct CommEvents {
    fork: Event,
    done: Vec<Event>,
    joins: collective::Joins,
    stream: Vec<usize>,
    staging_offset: [u64; COMM_STREAMS],
}

/// The artifact's eval step on this GPU: its kernels loaded like the training step's, its
/// schedule unrolled over the same arenas (its params are the training masters, its inputs the
/// training `tokens`/`targets`, its activations in the `activations` arena, which holds nothing
/// live between training steps), run eagerly between training steps.
struct EvalCode<'a> {
    ops: Vec<Op>,
    comm_events: Option<CommEvents>,
    /// Staging for its collectives along inner dims.
    staging: Option<DeviceBuffer>,
    loss: &'a Buffer,
    code: LoadedCode,
}

/// One unrolled schedule to enqueue: the training step's or the eval step's.
struct Sched<'s> {
    ops: &'s [Op],
    code: &'s LoadedCode,
    kernels: &'s [Kernel],
    comm_events: Option<&'s CommEvents>,
    staging: Option<&'s DeviceBuffer>,
    /// Timing events (`--profile`, the training step only).
    profile: Option<&'s Profile>,
}

/// Per-op timing events and the accumulated time per kernel.
struct Profile {
    /// Recorded on the compute stream just before op `i` (after its waits for collectives), and
    /// at the end.
    events: Vec<Event>,
    kernels: Vec<KernelTime>,
    /// Time in copies and memsets of the schedule.
    other: KernelTime,
    steps: u64,
    /// On a mesh: the collectives' side of the profile.
    comm: Option<CommTiming>,
    /// `(start, seconds)` of every op of the last counted step, relative to its first event
    /// (`--trace`); a communicating collective's is its span on the collectives' stream.
    last: Vec<(f64, f64)>,
}

/// `--profile` events of a mesh rank: the compute stream before its waits for collectives (per
/// op, and at the end), and each communicating collective's start on the collectives' stream
/// (its end is the `done` event the compute stream waits on).
struct CommTiming {
    before_waits: Vec<Event>,
    start: Vec<Event>,
    infos: Vec<comm_profile::CollectiveInfo>,
    /// The wait points: per op index (and `ops.len()` for the end), its index in `waits`.
    wait_at: Vec<Option<usize>>,
    waits: Vec<comm_profile::WaitPoint>,
    sums: comm_profile::CommProfile,
}

/// One chunk of a state's initial values.
struct InitJob {
    /// Device address of the chunk.
    ptr: u64,
    elems: usize,
    layer: usize,
    chunk: usize,
    init: titan_ir::Init,
    dtype: DType,
    /// Index into the layer names.
    name: usize,
    /// The same chunk of the state's compute copy (device address and dtype), written with
    /// the cast of the drawn values (`compute-copies`).
    copy: Option<(u64, DType)>,
}

impl<'a> CudaArtifactTrainer<'a> {
    /// Check that every kernel has GPU code, open the GPU, load every kernel, allocate the
    /// arenas and initialize the state from `seed` (the CPU backend's values).
    pub fn new(artifact: &'a Artifact, seed: u64) -> Result<CudaArtifactTrainer<'a>, RuntimeError> {
        Self::with_rank(artifact, seed, None)
    }

    /// [`CudaArtifactTrainer::new`] for one rank of an SPMD artifact (`rank`: `None` on one
    /// GPU): opens GPU `rank.device`, creates the rank's NCCL communicators (collectively with
    /// the other ranks of `rank.group`), starts each state as this rank's shard of the
    /// single-rank initialization, and runs the schedule's collective steps through NCCL on a
    /// stream of their own.
    pub fn with_rank(artifact: &'a Artifact, seed: u64, rank: Option<CudaRankSetup<'_>>) -> Result<CudaArtifactTrainer<'a>, RuntimeError> {
        let m = &artifact.manifest;
        if m.ranks.len() != 1 {
            return Err(RuntimeError::Backend(format!(
                "the artifact has {} schedules; titan artifacts carry one (SPMD), rebuild it with `titanc build`",
                m.ranks.len()
            )));
        }
        match &rank {
            None if m.mesh.world_size > 1 => {
                return Err(RuntimeError::Backend(format!(
                    "the artifact is built for a mesh of {} ranks: run one process per GPU (`titan-run DIR --backend cuda --nproc-per-node {}`, torchrun or srun), or run it with --backend cpu (simulated mesh)",
                    m.mesh.world_size, m.mesh.world_size
                )));
            }
            Some(r) => artifact.check_rank_mesh(&r.mesh)?,
            None => {}
        }
        check_gpu_code(artifact)?;
        let feeds = artifact.step_feeds(rank.as_ref().map_or(1, |r| r.mesh.sizes[2]))?;
        let StepFeeds { tokens, targets, step: step_buf, .. } = feeds;
        let loss = artifact.output_buffer("loss").ok_or_else(|| bad("no buffer holds the `loss` output".into()))?;
        let mut startup = StartupTimes::default();
        let t = Instant::now();
        let gpu = Gpu::open_device(rank.as_ref().map_or(0, |r| r.device))?;
        let (free, total) = gpu.mem_info()?;
        let mem_baseline = total.saturating_sub(free);
        crate::memory_fit::check_manifest_fits(m, free).map_err(|e| RuntimeError::Backend(e.to_string()))?;
        let nccl = match &rank {
            Some(r) => Some(NcclMesh::new(r.group, r.mesh).map_err(|e| RuntimeError::Backend(format!("creating the NCCL communicators: {e}")))?),
            None => None,
        };
        let coords = rank.as_ref().map_or([0; 3], |r| r.mesh.coords(r.group.rank()));
        let watchdog = match (&nccl, &rank) {
            (Some(n), Some(r)) => {
                let (h, who, probe) = (n.handles(), r.group.rank(), r.group.failure_probe());
                let poll = {
                    let h = h.clone();
                    Box::new(move || h.async_error())
                };
                // NCCL reports its own errors; a peer process that died shows up on the control
                // plane only (NCCL's kernels would wait for it forever).
                let peers: Box<dyn Fn() -> Option<String> + Send> = Box::new(move || probe.check());
                let fail = Box::new(move |why: String| {
                    eprintln!("error: rank {who}: {why}; aborting the NCCL communicators and exiting");
                    // Aborting unblocks NCCL's kernels, but it can itself wait on a stream stuck
                    // behind a dead peer: give it a few seconds, then exit regardless (the
                    // driver reclaims the context).
                    let (done, wait) = std::sync::mpsc::channel();
                    let h = h.clone();
                    let _ = std::thread::Builder::new().name("titan-nccl-abort".into()).spawn(move || {
                        h.abort_all();
                        let _ = done.send(());
                    });
                    let _ = wait.recv_timeout(std::time::Duration::from_secs(10));
                    // Not `exit`: its atexit handlers include the CUDA teardown, which waits for
                    // the kernels stuck on the dead peer (seen on the H200: the rank hung there).
                    // SAFETY: `_exit` ends the process at once; nothing of ours needs flushing
                    // (stderr is unbuffered and the reason is already written).
                    unsafe { libc::_exit(1) }
                });
                Some(Watchdog::start(Checks { poll, peers: Some(peers), fail }, std::time::Duration::from_millis(100), r.step_timeout))
            }
            _ => None,
        };
        startup.load_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut memory = Vec::new();
        let mut base = [0u64; ARENAS.len()];
        let mut bytes = [0u64; ARENAS.len()];
        for a in ARENAS {
            let n = artifact.arena_bytes(a);
            let buf = gpu.alloc(n, arena_fill(a), &format!("the `{}` arena", arena_name(a)))?;
            base[slot(a)] = buf.ptr;
            bytes[slot(a)] = n;
            memory.push(buf);
        }
        let arenas = Arenas { artifact, base, bytes, coords, table: Table::Train };
        startup.alloc_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let (mut ops, mut ext) = (Vec::new(), Vec::new());
        arenas.unroll(&m.ranks[0].steps, None, &mut Vec::new(), &mut ops, &mut ext)?;
        let (staging, comm_events) = collective_setup(&gpu, &ops, &ext, nccl.is_some(), "the collectives' staging buffer")?;
        // Per GEMM kernel: the alignment of its operands over every launch, and their extents.
        let mut align = vec![[256u64; 3]; m.kernels.len()];
        let mut first = vec![None; m.kernels.len()];
        gemm_operands(&arenas, &m.ranks[0].steps, None, &mut align, &mut first)?;
        startup.plan_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut code = LoadedCode::load(&gpu, artifact, &m.kernels, &|pos| align[pos], false)?;
        startup.load_s += t.elapsed().as_secs_f64();
        eprintln!("titan-run: loaded {} kernels from cubins and {} from PTX (JIT) in {:.1} s", code.from_cubin, code.from_ptx, t.elapsed().as_secs_f64());
        let t = Instant::now();
        if let Some(tuned) = code.autotune_gemms(&gpu, &first, TuneMode::from_env()?)? {
            if tuned.filled {
                // Back to the arenas' fill patterns (the timing data is no training state).
                for (a, buf) in ARENAS.into_iter().zip(&memory) {
                    gpu.memset(buf.ptr, arena_fill(a), buf.bytes as usize, || format!("restoring the `{}` arena after timing GEMMs", arena_name(a)))?;
                }
                gpu.sync(|| "restoring the arenas after timing GEMMs".into())?;
            }
            eprintln!("titan-run: {} in {:.1} s", tuned.line, t.elapsed().as_secs_f64());
        }
        startup.load_s += t.elapsed().as_secs_f64();
        let usize_of = |x: u64, what: &str| usize::try_from(x).map_err(|_| bad(format!("{what} {x} does not fit this machine")));
        let whole = |b: &'a Buffer| arenas.whole(b).map(|(p, _)| (p, b));
        let mut trainer = CudaArtifactTrainer {
            artifact,
            ops,
            graph: None,
            use_graph: true,
            profile: None,
            feed_tokens: vec![0; usize_of(tokens.bytes, "tokens")?],
            feed_targets: vec![0; usize_of(targets.bytes, "targets")?],
            feed_step: vec![0; usize_of(step_buf.bytes, "step")?],
            tokens: whole(tokens)?,
            targets: whole(targets)?,
            step_buf: whole(step_buf)?,
            outputs: [Some(whole(loss)?), artifact.output_buffer("grad_norm").map(whole).transpose()?, artifact.output_buffer("lr").map(whole).transpose()?],
            batch: feeds.batch,
            seq: feeds.seq,
            tokens_len: feeds.tokens_len,
            vocab: usize_of(m.training.vocab_size, "vocab_size")?,
            arenas,
            step: 0,
            steps_run: 0,
            startup,
            capture_s: None,
            log_capture: false,
            watchdog,
            nccl,
            staging,
            comm_events,
            mem_baseline,
            measured_peak: 0,
            eval: None,
            code,
            _memory: memory,
            gpu,
        };
        match &rank {
            Some(r) => trainer.init_state_shards(seed, (coords, r.mesh))?,
            None => trainer.init_state(seed)?,
        }
        trainer.measure_memory()?;
        Ok(trainer)
    }

    /// Fill every persistent buffer with this rank's shard (by the placement of its `graph.ir`
    /// state argument) of the single-rank initialization: drawn on the host whole, sliced,
    /// encoded and copied (the CPU backend's [`init_state_shard`]).
    fn init_state_shards(&mut self, seed: u64, rank: ([usize; 3], titan_ir::Mesh)) -> Result<(), RuntimeError> {
        self.gpu.bind()?;
        for slot in self.artifact.state_slots()? {
            let (b, p) = (slot.buffer, slot.info);
            let t = init_state_shard(p, &slot.shape, slot.placement, Some(rank), seed)?;
            let values = t.floats().ok_or_else(|| bad(format!("state `{}` is not a float tensor", p.name)))?;
            let (ptr, len) = self.arenas.whole(b)?;
            let mut bytes = vec![0u8; values.len() * b.dtype.size_bytes()];
            if bytes.len() as u64 > len {
                return Err(bad(format!("state `{}` has {} bytes, its buffer only {len}", p.name, bytes.len())));
            }
            encode_floats(values, b.dtype, &mut bytes).map_err(|e| bad(format!("state `{}`: {e}", p.name)))?;
            self.gpu.upload_sync(ptr, &bytes, || format!("copying state `{}` to the GPU", p.name))?;
            self.upload_copies(b, values)?;
        }
        Ok(())
    }

    /// The compute copy of master buffer `master`, if it has one (`compute-copies`).
    fn copy_of(&self, master: &Buffer) -> Result<Option<&'a Buffer>, RuntimeError> {
        let artifact: &'a Artifact = self.artifact;
        Ok(artifact.compute_copies().map_err(|e| bad(e.to_string()))?.into_iter().find(|(_, m)| m.id == master.id).map(|(c, _)| c))
    }

    /// Write the cast of `values` (master `master`'s new contents) into its compute copy, as the
    /// optimizer kernel writes it after each update.
    fn upload_copies(&self, master: &Buffer, values: &[f32]) -> Result<(), RuntimeError> {
        let Some(copy) = self.copy_of(master)? else { return Ok(()) };
        let (ptr, len) = self.arenas.whole(copy)?;
        let mut bytes = vec![0u8; values.len() * copy.dtype.size_bytes()];
        if bytes.len() as u64 > len {
            return Err(bad(format!("compute copy `{}` has {len} bytes, its master {} values", copy.name, values.len())));
        }
        encode_floats(values, copy.dtype, &mut bytes).map_err(|e| bad(format!("compute copy `{}`: {e}", copy.name)))?;
        Ok(self.gpu.upload_sync(ptr, &bytes, || format!("copying the compute copy `{}` to the GPU", copy.name))?)
    }

    /// Fill every persistent buffer with the values the CPU backend starts from: the same
    /// [`crate::init`] chunks per state argument of `graph.ir`'s `main`, the same encoding.
    /// Zero states are memset on the device; the others are drawn, encoded and copied chunk by
    /// chunk on [`init_threads`] threads.
    fn init_state(&mut self, seed: u64) -> Result<(), RuntimeError> {
        self.gpu.bind()?;
        let start = Instant::now();
        let mut jobs: Vec<InitJob> = Vec::new();
        let mut names: Vec<String> = Vec::new();
        for slot in self.artifact.state_slots()? {
            let (b, p) = (slot.buffer, slot.info);
            let (layers, per_layer) = (slot.layers, slot.per_layer);
            let (ptr, len) = self.arenas.whole(b)?;
            let size = b.dtype.size_bytes();
            if (layers * per_layer) as u64 * size as u64 > len {
                return Err(bad(format!("state `{}` has {} elements, its buffer only {len} bytes", p.name, layers * per_layer)));
            }
            check_init(p.init).map_err(|e| RuntimeError::Graph(format!("initializing `{}`: {e}", p.name)))?;
            let copy = match self.copy_of(b)? {
                Some(c) => Some((self.arenas.whole(c)?, c.dtype)),
                None => None,
            };
            if p.init == titan_ir::Init::Zeros {
                for (ptr, len) in std::iter::once((ptr, len)).chain(copy.map(|c| c.0)) {
                    let bytes = usize::try_from(len).map_err(|_| bad(format!("state `{}` is too large", p.name)))?;
                    self.gpu.memset(ptr, 0, bytes, || format!("zeroing state `{}`", p.name))?;
                }
                continue;
            }
            for l in 0..layers {
                names.push(p.layer_name(l));
                for c in 0..chunks_per_layer(per_layer) {
                    let done = (c * CHUNK_ELEMS).min(per_layer);
                    let elems = CHUNK_ELEMS.min(per_layer - done);
                    if elems == 0 {
                        continue;
                    }
                    let first = l * per_layer + done;
                    let copy = copy.map(|((cptr, _), cdt)| (cptr + (first * cdt.size_bytes()) as u64, cdt));
                    jobs.push(InitJob {
                        ptr: ptr + (first * size) as u64,
                        elems,
                        layer: l,
                        chunk: c,
                        init: p.init,
                        dtype: b.dtype,
                        name: names.len() - 1,
                        copy,
                    });
                }
            }
        }
        let prepared = start.elapsed().as_secs_f64();
        let (init_s, upload_s) = self.upload_chunks(seed, &jobs, &names)?;
        let tail = Instant::now();
        self.gpu.sync_all(|| "copying the initial values to the GPU".into())?;
        self.startup.init_s = prepared + init_s;
        self.startup.upload_s = upload_s + tail.elapsed().as_secs_f64();
        Ok(())
    }

    /// Draw, encode and copy `jobs` to the GPU on [`init_threads`] worker threads, each
    /// reusing one chunk buffer (so the host holds one chunk per thread, never a whole state);
    /// the driver stages the pageable copies of several threads at once. Returns the phase's
    /// wall time split in proportion to the workers' busy time `(drawing and encoding, copying)`.
    fn upload_chunks(&self, seed: u64, jobs: &[InitJob], names: &[String]) -> Result<(f64, f64), RuntimeError> {
        if jobs.is_empty() {
            return Ok((0.0, 0.0));
        }
        let start = Instant::now();
        let threads = init_threads().clamp(1, jobs.len());
        let next = AtomicUsize::new(0);
        let gpu = &self.gpu;
        let results: Vec<Result<(f64, f64), RuntimeError>> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    let next = &next;
                    s.spawn(move || -> Result<(f64, f64), RuntimeError> {
                        gpu.bind()?;
                        let (mut scratch, mut bytes, mut copy_bytes) = (Vec::with_capacity(CHUNK_ELEMS), Vec::new(), Vec::new());
                        let (mut draw_s, mut copy_s) = (0.0, 0.0);
                        while let Some(j) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                            let t = Instant::now();
                            let name = &names[j.name];
                            let r = Self::draw_chunk(seed, j, name, &mut scratch, &mut bytes);
                            let t1 = Instant::now();
                            let r = r.and_then(|()| Ok(gpu.upload_sync(j.ptr, &bytes, || format!("uploading the initial values of `{name}`"))?));
                            // The compute copy's chunk: the cast of the same values.
                            let r = r.and_then(|()| match j.copy {
                                Some((cptr, cdt)) => {
                                    copy_bytes.resize(j.elems * cdt.size_bytes(), 0);
                                    encode_floats(&scratch, cdt, &mut copy_bytes).map_err(|e| bad(format!("compute copy of `{name}`: {e}")))?;
                                    Ok(gpu.upload_sync(cptr, &copy_bytes, || format!("uploading the compute copy of `{name}`"))?)
                                }
                                None => Ok(()),
                            });
                            if r.is_err() {
                                // Let the other workers stop at their next chunk.
                                next.store(jobs.len(), Ordering::Relaxed);
                                r?;
                            }
                            draw_s += t1.duration_since(t).as_secs_f64();
                            copy_s += t1.elapsed().as_secs_f64();
                        }
                        Ok((draw_s, copy_s))
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        });
        let (mut draw, mut copy) = (0.0, 0.0);
        for r in results {
            let (d, c) = r?;
            draw += d;
            copy += c;
        }
        let wall = start.elapsed().as_secs_f64();
        let share = if draw + copy > 0.0 { draw / (draw + copy) } else { 1.0 };
        Ok((wall * share, wall * (1.0 - share)))
    }

    /// Draw chunk `j` of state layer `name` and encode it into `bytes`.
    fn draw_chunk(seed: u64, j: &InitJob, name: &str, scratch: &mut Vec<f32>, bytes: &mut Vec<u8>) -> Result<(), RuntimeError> {
        scratch.resize(j.elems, 0.0);
        fill_chunk(j.init, j.layer, seed, name, j.chunk, scratch).map_err(|e| RuntimeError::Graph(format!("initializing `{name}`: {e}")))?;
        bytes.resize(j.elems * j.dtype.size_bytes(), 0);
        encode_floats(scratch, j.dtype, bytes).map_err(|e| bad(format!("state `{name}`: {e}")))
    }

    /// Read the device memory in use and raise the measured peak.
    fn measure_memory(&mut self) -> Result<(), RuntimeError> {
        let (free, total) = self.gpu.mem_info()?;
        self.measured_peak = self.measured_peak.max(total.saturating_sub(free).saturating_sub(self.mem_baseline));
        Ok(())
    }

    /// Seconds of each start-up phase (opening the GPU and loading code count as `load`).
    pub fn startup(&self) -> StartupTimes {
        self.startup
    }

    /// Print `titan-run: step 3 captured into a CUDA graph in 0.2 s ...` on stderr when the
    /// capture happens (titan-run turns it on; off by default).
    pub fn set_log_capture(&mut self, on: bool) {
        self.log_capture = on;
    }

    /// Seconds the capture of the step into a CUDA graph took, once it happened.
    pub fn capture_seconds(&self) -> Option<f64> {
        self.capture_s
    }

    /// The measured peak device memory so far (see the module docs for what it counts).
    pub fn measured_peak_bytes(&self) -> u64 {
        self.measured_peak
    }

    /// Capture the step into a CUDA graph after the warm-up steps (on by default); off runs
    /// every step eagerly.
    pub fn set_graphs(&mut self, on: bool) {
        self.use_graph = on;
        if !on {
            self.graph = None;
        }
    }

    /// Whether the steps now replay a captured graph.
    pub fn replaying(&self) -> bool {
        self.graph.is_some()
    }

    /// The GPU's name.
    pub fn device_name(&self) -> &str {
        &self.gpu.name
    }

    /// The training step as a [`Sched`].
    fn train_sched(&self) -> Sched<'_> {
        Sched {
            ops: &self.ops,
            code: &self.code,
            kernels: &self.artifact.manifest.kernels,
            comm_events: self.comm_events.as_ref(),
            staging: self.staging.as_ref(),
            profile: self.profile.as_ref(),
        }
    }

    fn enqueue_ops(&self) -> Result<(), CudaError> {
        self.enqueue(&self.train_sched())
    }

    /// Enqueue every op of `s` on the compute stream (its collectives on the collectives'
    /// stream, ordered by its events).
    fn enqueue(&self, s: &Sched<'_>) -> Result<(), CudaError> {
        let events = s.profile.map(|p| &p.events);
        let before_waits = s.profile.and_then(|p| p.comm.as_ref()).map(|c| &c.before_waits);
        let mut nth_collective = 0;
        for (i, op) in s.ops.iter().enumerate() {
            if let Some(ev) = before_waits {
                self.gpu.record(&ev[i])?;
            }
            if let Some(ce) = s.comm_events {
                for &c in &ce.joins.before[i] {
                    self.gpu.wait_for(&ce.done[c])?;
                }
            }
            if let Some(ev) = events {
                self.gpu.record(&ev[i])?;
            }
            match op {
                Op::Launch { kernel, ins, outs, at } => s.code.launch(&self.gpu, s.kernels, *kernel, ins, outs, &|| at.clone())?,
                Op::Copy { dst, src, bytes, at } => self.gpu.copy(*dst, *src, *bytes, || format!("copy of {bytes} bytes ({at})"))?,
                Op::Memset { dst, bytes, at } => self.gpu.memset(*dst, 0, *bytes, || format!("memset of {bytes} bytes ({at})"))?,
                Op::Collective { plan, input, output, more, mesh_dim, dtype, at, .. } => {
                    self.enqueue_collective(s, plan, (*input, more), *output, *mesh_dim, *dtype, nth_collective, at)?;
                    nth_collective += usize::from(plan.communicates);
                }
            }
        }
        if let Some(ev) = before_waits {
            self.gpu.record(&ev[s.ops.len()])?;
        }
        if let Some(ce) = s.comm_events {
            for &c in &ce.joins.at_end {
                self.gpu.wait_for(&ce.done[c])?;
            }
        }
        if let Some(ev) = events {
            self.gpu.record(&ev[s.ops.len()])?;
        }
        Ok(())
    }

    /// Enqueue one collective step (the `nth` communicating one): its copies and NCCL calls on
    /// the collectives' stream after the compute enqueued so far, recording `done[nth]` at its
    /// end (rank-local `take_shard`/`place_shard` copies stay on the compute stream).
    #[allow(clippy::too_many_arguments)]
    fn enqueue_collective(
        &self,
        s: &Sched<'_>,
        plan: &collective::Plan,
        (input, more): (u64, &[u64]),
        output: u64,
        mesh_dim: usize,
        dtype: DType,
        nth: usize,
        at: &str,
    ) -> Result<(), CudaError> {
        let events = s.comm_events.filter(|_| plan.communicates);
        let comm = events.map(|ce| ce.stream[nth]);
        let staging = s.staging.map_or(0, |b| b.ptr) + events.zip(comm).map_or(0, |(ce, c)| ce.staging_offset[c]);
        let addr = |l: Loc| match l {
            Loc::Input(o) => input + o,
            Loc::Output(o) => output + o,
            Loc::Staging(o) => staging + o,
            // The unroll resolved `more` from the step's `more_inputs`, whose count the plan
            // checked against the operands it reads.
            Loc::More(j, o) => more[j as usize] + o,
        };
        if plan.communicates && comm.is_none() {
            return Err(CudaError::Call { what: at.to_string(), message: "a collective without stream-ordering events".into() });
        }
        let stream = self.gpu.stream_for(comm);
        if let (Some(ce), Some(c)) = (events, comm) {
            self.gpu.fork_to_comm(c, &ce.fork)?;
            for &d in &ce.joins.comm_waits[nth] {
                self.gpu.comm_wait_for(c, &ce.done[d])?;
            }
            if let Some(t) = s.profile.and_then(|p| p.comm.as_ref()) {
                self.gpu.record_on_comm(c, &t.start[nth])?;
            }
        }
        for a in &plan.actions {
            match *a {
                Action::Nccl { kind, send, recv, count, reduce } => {
                    let comm = self
                        .nccl
                        .as_ref()
                        .and_then(|n| n.dims[mesh_dim].as_ref())
                        .ok_or_else(|| CudaError::Call { what: at.to_string(), message: format!("no NCCL communicator for mesh dim {mesh_dim}") })?;
                    let count = usize::try_from(count).map_err(|_| CudaError::Call { what: at.to_string(), message: "collective too large".into() })?;
                    // SAFETY: the operands were checked against their buffers at unroll; the
                    // staging buffer holds the largest plan's staging bytes.
                    unsafe { comm.run(kind, addr(send), addr(recv), count, dtype, reduce, stream) }
                        .map_err(|e| CudaError::Call { what: at.to_string(), message: e.to_string() })?;
                }
                Action::Copy2d { dst, dst_pitch, src, src_pitch, width, height } => {
                    self.gpu.copy_2d(comm, addr(dst), dst_pitch, addr(src), src_pitch, width, height, || format!("a strided copy of a collective ({at})"))?
                }
                Action::Zero { dst, bytes } => {
                    let n = usize::try_from(bytes).map_err(|_| CudaError::Call { what: at.to_string(), message: "memset too large".into() })?;
                    self.gpu.memset_on(comm, addr(dst), 0, n, || format!("zeroing the output of a collective ({at})"))?
                }
            }
        }
        if let (Some(ce), Some(c)) = (events, comm) {
            self.gpu.record_on_comm(c, &ce.done[nth])?;
        }
        Ok(())
    }

    /// Time every op of the following steps with CUDA events (the steps then run eagerly, not
    /// from a CUDA graph; the first step after this is a warm-up and is not counted). The times
    /// include the launch gaps between ops, which a graph replay mostly hides.
    pub fn enable_profile(&mut self) -> Result<(), RuntimeError> {
        self.gpu.bind()?;
        let events = (0..=self.ops.len()).map(|_| Event::new()).collect::<Result<Vec<_>, _>>()?;
        let kernels = vec![KernelTime::default(); self.artifact.manifest.kernels.len()];
        let comm = match &self.comm_events {
            Some(ce) => {
                let infos: Vec<comm_profile::CollectiveInfo> = self
                    .ops
                    .iter()
                    .filter_map(|o| match o {
                        Op::Collective { plan, info, .. } if plan.communicates => Some(info.clone()),
                        _ => None,
                    })
                    .collect();
                let label = |i: usize| match self.ops.get(i) {
                    Some(Op::Launch { kernel, at, .. }) => format!("kernel `{}` ({at})", self.artifact.manifest.kernels[*kernel].name),
                    Some(Op::Copy { at, .. } | Op::Memset { at, .. } | Op::Collective { at, .. }) => at.clone(),
                    None => "the end of the step".into(),
                };
                let mut waits = Vec::new();
                let mut wait_at = vec![None; self.ops.len() + 1];
                for (i, joined) in ce.joins.before.iter().chain(std::iter::once(&ce.joins.at_end)).enumerate() {
                    if !joined.is_empty() {
                        wait_at[i] = Some(waits.len());
                        waits.push(comm_profile::WaitPoint { before: label(i), collectives: joined.clone() });
                    }
                }
                let sums = comm_profile::CommProfile::new(infos.len(), waits.len());
                Some(CommTiming {
                    before_waits: (0..=self.ops.len()).map(|_| Event::new()).collect::<Result<Vec<_>, _>>()?,
                    start: (0..infos.len()).map(|_| Event::new()).collect::<Result<Vec<_>, _>>()?,
                    infos,
                    wait_at,
                    waits,
                    sums,
                })
            }
            None => None,
        };
        self.profile = Some(Profile { events, kernels, other: KernelTime::default(), steps: 0, comm, last: Vec::new() });
        self.set_graphs(false);
        Ok(())
    }

    /// The `--profile` report: the kernel table and, on a mesh, the collectives' (`full`), or
    /// one summary line (`!full`, for the ranks other than 0). `None` before a counted step.
    pub fn profile_report(&self, full: bool) -> Option<String> {
        let p = self.profile.as_ref().filter(|p| p.steps > 0)?;
        let compute: f64 = p.kernels.iter().map(|k| k.seconds).sum::<f64>() + p.other.seconds;
        let comm = p.comm.as_ref();
        if !full {
            let line = match comm {
                Some(c) => comm_profile::summary(&c.sums, compute, p.steps),
                None => format!("{:.3} ms per step in kernels and copies", 1e3 * compute / p.steps as f64),
            };
            return Some(format!("titan-run: --profile: {line}\n"));
        }
        let mut out = crate::backend::profile::kernel_table(self.artifact, &p.kernels, Some(p.other), p.steps, "cuda");
        if let Some(c) = comm {
            out.push_str("titan-run: ");
            out.push_str(&comm_profile::report(&c.infos, &c.waits, &c.sums, compute, p.steps, 10));
        }
        Some(out)
    }

    /// `--kernel-energy`: the kernels of 99% of the profiled kernel time, each run back to back
    /// at its first launch in the step for `window_s` after a settling second; the report of
    /// [`energy::report`]. A kernel's power depends on its operands' bits (zeros draw far less),
    /// so before each the step is replayed up to that launch: it runs on the values it read in
    /// the step, not on whatever the arenas' reuse left there. (After the run: in-place kernels
    /// change the state, which is not used again.)
    pub fn kernel_energy(&self, window_s: f64) -> Result<String, RuntimeError> {
        let p = self.profile.as_ref().filter(|p| p.steps > 0).ok_or_else(|| {
            bad("--kernel-energy: no profiled step to take the kernels from (the GPU does not count the first step); run at least 2 steps".into())
        })?;
        let nvml = Nvml::open(&self.gpu.pci_bus_id()?)?;
        let s = self.train_sched();
        let mut held = Vec::new();
        for k in energy::chosen(&p.kernels, 0.99) {
            let Some(i) = self.ops.iter().position(|op| matches!(op, Op::Launch { kernel, .. } if *kernel == k)) else {
                continue;
            };
            let Op::Launch { kernel, ins, outs, at } = &self.ops[i] else { unreachable!("found as a launch") };
            for op in &self.ops[..i] {
                match op {
                    Op::Launch { kernel, ins, outs, at } => s.code.launch(&self.gpu, s.kernels, *kernel, ins, outs, &|| at.clone())?,
                    Op::Copy { dst, src, bytes, at } => self.gpu.copy(*dst, *src, *bytes, || format!("copy of {bytes} bytes ({at})"))?,
                    Op::Memset { dst, bytes, at } => self.gpu.memset(*dst, 0, *bytes, || format!("memset of {bytes} bytes ({at})"))?,
                    Op::Collective { .. } => return Err(bad("--kernel-energy: the step has collectives; measure an artifact built for one GPU".into())),
                }
            }
            let launch = || s.code.launch(&self.gpu, s.kernels, *kernel, ins, outs, &|| at.clone());
            let burst = p.kernels[k].seconds / p.kernels[k].launches.max(1) as f64;
            held.push((k, energy::sustain(&self.gpu, &nvml, burst, window_s, &launch)?));
        }
        Ok(energy::report(self.artifact, &p.kernels, p.steps, window_s, &held))
    }

    /// Add the event times of the step that just finished to the profile.
    fn collect_profile(&mut self) -> Result<(), RuntimeError> {
        let warm = self.steps_run <= 1;
        let Some(p) = self.profile.as_mut() else { return Ok(()) };
        if warm {
            return Ok(());
        }
        p.last.clear();
        let mut nth = 0;
        for (i, op) in self.ops.iter().enumerate() {
            // On a mesh an op's time ends where the waits before the next op begin.
            let end = p.comm.as_ref().map_or(&p.events[i + 1], |c| &c.before_waits[i + 1]);
            let secs = f64::from(p.events[i].elapsed_ms(end)?) * 1e-3;
            match (op, p.comm.as_ref(), &self.comm_events) {
                (Op::Collective { plan, .. }, Some(c), Some(ce)) if plan.communicates => {
                    let start = f64::from(p.events[0].elapsed_ms(&c.start[nth])?) * 1e-3;
                    p.last.push((start, f64::from(c.start[nth].elapsed_ms(&ce.done[nth])?) * 1e-3));
                    nth += 1;
                }
                _ => p.last.push((f64::from(p.events[0].elapsed_ms(&p.events[i])?) * 1e-3, secs)),
            }
            let t = match op {
                Op::Launch { kernel, .. } => &mut p.kernels[*kernel],
                Op::Copy { .. } | Op::Memset { .. } | Op::Collective { .. } => &mut p.other,
            };
            t.launches += 1;
            t.seconds += secs;
        }
        if let (Some(c), Some(ce)) = (p.comm.as_mut(), &self.comm_events) {
            for (i, w) in c.wait_at.iter().enumerate() {
                if let Some(w) = *w {
                    c.sums.waited[w] += f64::from(c.before_waits[i].elapsed_ms(&p.events[i])?) * 1e-3;
                }
            }
            for (n, start) in c.start.iter().enumerate() {
                c.sums.busy[n] += f64::from(start.elapsed_ms(&ce.done[n])?) * 1e-3;
            }
        }
        p.steps += 1;
        Ok(())
    }

    /// Decode a buffer read back from the device.
    fn read(&self, b: &Buffer) -> Result<Tensor<f32>, RuntimeError> {
        let (ptr, len) = self.arenas.whole(b)?;
        let mut host = vec![0u8; usize::try_from(len).map_err(|_| bad(format!("buffer `{}` is too large", b.name)))?];
        self.gpu.download(&mut host, ptr, || format!("reading back buffer {} (`{}`)", b.id, b.name))?;
        decode(&host, b.dtype, b.shape.iter().map(|&d| d as usize).collect()).map_err(|e| bad(format!("buffer {} (`{}`): {e}", b.id, b.name)))
    }

    /// Run one training step on `batch`.
    pub fn step(&mut self, batch: &Batch) -> Result<StepMetrics, RuntimeError> {
        check_rank_batch(batch, self.batch, self.seq, self.tokens_len, self.vocab)?;
        self.gpu.bind()?;
        self.step += 1;
        self.steps_run += 1;
        let start = Instant::now();
        let n = self.step;
        encode_ints(&batch.tokens, self.tokens.1.dtype, &mut self.feed_tokens).map_err(|e| RuntimeError::Data(format!("feeding tokens: {e}")))?;
        encode_ints(&batch.targets, self.targets.1.dtype, &mut self.feed_targets).map_err(|e| RuntimeError::Data(format!("feeding targets: {e}")))?;
        let s = i64::try_from(n).map_err(|_| RuntimeError::Data("the step counter overflowed".into()))?;
        encode_ints(&[s], self.step_buf.1.dtype, &mut self.feed_step).map_err(|e| RuntimeError::Data(format!("feeding the step: {e}")))?;
        self.gpu.upload(self.tokens.0, &self.feed_tokens, || format!("step {n}: copying the tokens to the GPU"))?;
        self.gpu.upload(self.targets.0, &self.feed_targets, || format!("step {n}: copying the targets to the GPU"))?;
        self.gpu.upload(self.step_buf.0, &self.feed_step, || format!("step {n}: copying the step counter to the GPU"))?;
        let mut capture_s = 0.0;
        if self.graph.is_none() && self.use_graph && self.steps_run > WARMUP_STEPS {
            self.gpu.sync(|| format!("step {n}: before capturing the CUDA graph"))?;
            let t = Instant::now();
            self.gpu.begin_capture()?;
            let r = self.enqueue_ops();
            // End the capture even when an op failed, so the stream is usable again.
            let g = self.gpu.end_capture();
            r.map_err(|e| match e {
                CudaError::Call { what, message } => CudaError::Call { what: format!("step {n}, capturing {what}"), message },
                other => other,
            })?;
            self.graph = Some(g?);
            capture_s = t.elapsed().as_secs_f64();
            self.capture_s = Some(capture_s);
            if self.log_capture {
                eprintln!("titan-run: step {n} captured into a CUDA graph in {capture_s:.1} s (after {WARMUP_STEPS} warm-up steps; not counted in its tps)");
            }
        }
        if let Some(w) = &self.watchdog {
            w.step_started();
        }
        match &self.graph {
            Some(g) => self.gpu.replay(g).map_err(|e| with_step(e, n))?,
            None => self.enqueue_ops().map_err(|e| with_step(e, n))?,
        }
        self.gpu.sync(|| format!("step {n}: waiting for the step to finish (an asynchronous error from an earlier kernel shows here; rerun with CUDA_LAUNCH_BLOCKING=1 to find it)"))?;
        if let Some(w) = &self.watchdog {
            w.step_done();
        }
        // The capture is reported on its own ([`CudaArtifactTrainer::capture_seconds`]).
        let secs = start.elapsed().as_secs_f64() - capture_s;
        self.collect_profile()?;
        self.measure_memory()?;
        let mut vals = [f64::NAN; 3];
        for (v, o) in vals.iter_mut().zip(&self.outputs) {
            if let Some((_, b)) = o {
                *v = self.read(b)?.to_f64_vec().first().copied().unwrap_or(f64::NAN);
            }
        }
        Ok(StepMetrics {
            step: n,
            loss: vals[0],
            grad_norm: vals[1],
            lr: vals[2],
            tokens_per_s: (self.batch * self.seq) as f64 / secs.max(1e-9),
            peak_bytes: Some(crate::memory_fit::predicted_device_bytes(&self.artifact.manifest)),
            measured_peak_bytes: Some(self.measured_peak),
        })
    }

    /// Load the eval step: unroll its schedule over the arenas (its buffer ids are
    /// `manifest.eval`'s), check its GEMMs' operands and load its kernels (their cubins or PTX,
    /// files of the artifact like the training kernels'; GEMMs keep the heuristic's first
    /// algorithm, untimed).
    fn load_eval(&self) -> Result<EvalCode<'a>, RuntimeError> {
        let artifact = self.artifact;
        let e = artifact.manifest.eval.as_ref().ok_or_else(crate::backend::cpu_artifact::no_eval_step)?;
        let loss = e.buffers.iter().find(|b| b.output.as_deref() == Some("loss")).ok_or_else(|| bad("the eval step has no `loss` buffer".into()))?;
        let t = Instant::now();
        let arenas = self.arenas.with_table(Table::Eval);
        let (mut ops, mut ext) = (Vec::new(), Vec::new());
        arenas.unroll(&e.steps, None, &mut Vec::new(), &mut ops, &mut ext)?;
        let (staging, comm_events) = collective_setup(&self.gpu, &ops, &ext, self.nccl.is_some(), "the eval step's collective staging buffer")?;
        let mut align = vec![[256u64; 3]; e.kernels.len()];
        let mut first = vec![None; e.kernels.len()];
        gemm_operands(&arenas, &e.steps, None, &mut align, &mut first)?;
        let code = LoadedCode::load(&self.gpu, artifact, &e.kernels, &|pos| align[pos], false)?;
        eprintln!(
            "titan-run: loaded the eval step ({} kernels: {} from cubins, {} from PTX; {} operations) in {:.1} s",
            e.kernels.len(),
            code.from_cubin,
            code.from_ptx,
            ops.len(),
            t.elapsed().as_secs_f64()
        );
        Ok(EvalCode { ops, comm_events, staging, loss, code })
    }

    /// Run the artifact's eval step (forward and loss, no update) on `batch`, eagerly on the
    /// compute stream between training steps, and return its loss. It reads the masters in place
    /// and writes only the `activations` arena (and the fed `tokens`/`targets`, which every
    /// training step overwrites first), so training continues as it would without it.
    pub fn eval_loss(&mut self, batch: &Batch) -> Result<f64, RuntimeError> {
        check_rank_batch(batch, self.batch, self.seq, self.tokens_len, self.vocab)?;
        self.gpu.bind()?;
        if self.eval.is_none() {
            self.eval = Some(self.load_eval()?);
        }
        encode_ints(&batch.tokens, self.tokens.1.dtype, &mut self.feed_tokens).map_err(|e| RuntimeError::Data(format!("feeding validation tokens: {e}")))?;
        encode_ints(&batch.targets, self.targets.1.dtype, &mut self.feed_targets)
            .map_err(|e| RuntimeError::Data(format!("feeding validation targets: {e}")))?;
        self.gpu.upload(self.tokens.0, &self.feed_tokens, || "validation: copying the tokens to the GPU".into())?;
        self.gpu.upload(self.targets.0, &self.feed_targets, || "validation: copying the targets to the GPU".into())?;
        let e = self.eval.as_ref().expect("invariant: the eval step was loaded above");
        let sched = Sched {
            ops: &e.ops,
            code: &e.code,
            kernels: self.arenas.with_table(Table::Eval).kernels(),
            comm_events: e.comm_events.as_ref(),
            staging: e.staging.as_ref(),
            profile: None,
        };
        if let Some(w) = &self.watchdog {
            w.step_started();
        }
        self.enqueue(&sched).map_err(in_validation)?;
        self.gpu.sync(|| "validation: waiting for the eval step to finish (an asynchronous error from an earlier kernel shows here; rerun with CUDA_LAUNCH_BLOCKING=1 to find it)".into())?;
        if let Some(w) = &self.watchdog {
            w.step_done();
        }
        let loss = e.loss;
        self.measure_memory()?;
        Ok(self.read(loss)?.to_f64_vec().first().copied().unwrap_or(f64::NAN))
    }

    /// Every state buffer by checkpoint name, in manifest order (read back from the GPU).
    pub fn states(&self) -> Result<Vec<(String, Tensor<f32>)>, RuntimeError> {
        self.gpu.bind()?;
        let mut out = Vec::new();
        for b in &self.artifact.manifest.buffers {
            if let (BufferClass::Param | BufferClass::OptimizerState, Some(s)) = (b.class, &b.state) {
                out.push((s.name.clone(), self.read(b)?));
            }
        }
        Ok(out)
    }

    /// The state buffer with checkpoint name `name` (downloaded alone).
    pub fn state(&self, name: &str) -> Result<Tensor<f32>, RuntimeError> {
        self.gpu.bind()?;
        self.read(crate::backend::cpu_artifact::state_buffer(self.artifact, name)?)
    }

    /// Overwrite the state buffer with checkpoint name `name` with `values` (row-major).
    pub fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), RuntimeError> {
        self.gpu.bind()?;
        let b = crate::backend::cpu_artifact::state_buffer(self.artifact, name)?;
        let numel = usize::try_from(b.shape.iter().product::<u64>()).map_err(|_| bad(format!("state `{name}` is too large")))?;
        crate::backend::check_state_len(name, numel, values.len())?;
        let (ptr, len) = self.arenas.whole(b)?;
        let mut host = vec![0u8; len as usize];
        encode_floats(values, b.dtype, &mut host).map_err(|e| bad(format!("state `{name}`: {e}")))?;
        self.gpu.upload(ptr, &host, || format!("uploading state `{name}`"))?;
        self.gpu.sync(|| format!("uploading state `{name}`"))?;
        self.upload_copies(b, values)
    }

    /// Decode any buffer (for tests and debugging).
    pub fn read_buffer(&self, id: u32) -> Result<Tensor<f32>, RuntimeError> {
        self.gpu.bind()?;
        let b = self.artifact.buffer(id).ok_or_else(|| bad(format!("buffer {id} does not exist")))?;
        self.read(b)
    }
}

/// The staging buffer and the stream-ordering events of the collectives of `ops` (`ext`: the
/// byte ranges each op touches); `None`s for a schedule without communicating collectives.
fn collective_setup(
    gpu: &Gpu,
    ops: &[Op],
    ext: &[(Vec<(u64, u64)>, usize)],
    has_nccl: bool,
    what: &str,
) -> Result<(Option<DeviceBuffer>, Option<CommEvents>), RuntimeError> {
    let stream: Vec<Option<usize>> = ops
        .iter()
        .map(|o| match o {
            Op::Collective { plan, mesh_dim, .. } if plan.communicates => Some(comm_stream(titan_ir::MeshDim::ALL.get(*mesh_dim).map_or("?", |d| d.name()))),
            _ => None,
        })
        .collect();
    // Per stream, the largest staging one of its collectives needs (rank-local steps stage
    // nothing); the streams' parts lie one after the other.
    let mut need = [0u64; COMM_STREAMS];
    for (o, s) in ops.iter().zip(&stream) {
        if let Op::Collective { plan, .. } = o {
            let k = s.unwrap_or(0);
            need[k] = need[k].max(plan.staging_bytes);
        }
    }
    let mut staging_offset = [0u64; COMM_STREAMS];
    for k in 1..COMM_STREAMS {
        staging_offset[k] = staging_offset[k - 1] + need[k - 1];
    }
    let staging_bytes = staging_offset[COMM_STREAMS - 1] + need[COMM_STREAMS - 1];
    let staging = if staging_bytes > 0 { Some(gpu.alloc(staging_bytes, 0, what)?) } else { None };
    if stream.iter().all(Option::is_none) {
        return Ok((staging, None));
    }
    if !has_nccl {
        return Err(RuntimeError::Backend("the schedule has collectives but this process has no NCCL communicators".into()));
    }
    let ranges: Vec<Vec<(u64, u64)>> = ext.iter().map(|e| e.0.clone()).collect();
    let reads: Vec<usize> = ext.iter().map(|e| e.1).collect();
    let joins = collective::join_points(&stream, &ranges, &reads);
    let done = stream.iter().flatten().map(|_| Event::new()).collect::<Result<Vec<_>, _>>()?;
    let stream = stream.into_iter().flatten().collect();
    Ok((staging, Some(CommEvents { fork: Event::new()?, done, joins, stream, staging_offset })))
}

fn in_validation(e: CudaError) -> CudaError {
    match e {
        CudaError::Call { what, message } => CudaError::Call { what: format!("validation: {what}"), message },
        other => other,
    }
}

fn with_step(e: CudaError, n: u64) -> CudaError {
    match e {
        CudaError::Call { what, message } => CudaError::Call { what: format!("step {n}: {what}"), message },
        other => other,
    }
}

impl Trainer for CudaArtifactTrainer<'_> {
    fn enable_profile(&mut self) -> Result<(), RuntimeError> {
        CudaArtifactTrainer::enable_profile(self)
    }

    fn step_trace(&self) -> Option<Vec<titan_ir::artifact::timeline::Span>> {
        let p = self.profile.as_ref().filter(|p| p.steps > 0)?;
        // One schedule (`ranks[0]`) serves every rank.
        crate::backend::profile::measured_spans(self.artifact, 0, &p.last)
    }

    fn profile_report(&self, full: bool) -> Option<String> {
        CudaArtifactTrainer::profile_report(self, full)
    }

    fn step(&mut self, batch: &Batch) -> Result<StepMetrics, RuntimeError> {
        CudaArtifactTrainer::step(self, batch)
    }

    fn eval_loss(&mut self, batch: &Batch) -> Result<f64, RuntimeError> {
        CudaArtifactTrainer::eval_loss(self, batch)
    }

    fn batch_size(&self) -> usize {
        self.batch
    }

    fn seq_len(&self) -> usize {
        self.seq
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn steps_done(&self) -> u64 {
        self.step
    }

    fn states(&self) -> Result<Vec<(String, Tensor<f32>)>, RuntimeError> {
        CudaArtifactTrainer::states(self)
    }

    fn state(&self, name: &str) -> Result<Tensor<f32>, RuntimeError> {
        CudaArtifactTrainer::state(self, name)
    }

    fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), RuntimeError> {
        CudaArtifactTrainer::set_state(self, name, values)
    }

    fn set_steps_done(&mut self, steps: u64) -> Result<(), RuntimeError> {
        self.step = steps;
        Ok(())
    }

    fn flops_per_token(&self) -> Option<u64> {
        Some(self.artifact.manifest.training.flops_per_token).filter(|&f| f > 0)
    }
}
