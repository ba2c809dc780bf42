//! The CUDA backend: executes an artifact's schedule on one GPU with the same semantics as
//! [`CpuArtifactTrainer`](super::CpuArtifactTrainer), the reference it is tested against.
//!
//! * **Memory.** One `cuMemAlloc` per arena at the planned size; every buffer is its arena's
//!   base plus its offset. Activations and gradients start as NaN bytes (`0xff`), so a kernel
//!   that reads what nothing wrote shows in the loss. Each kernel with `workspace_bytes` gets
//!   its workspace once, zeroed (the kernels leave it zeroed).
//! * **Kernels.** Every PTX file is loaded once at start (one module and function per kernel,
//!   the entry name checked); GEMMs run through cuBLASLt ([`gemm`]) with an algorithm chosen
//!   once per GEMM for the alignment its operands have in the plan. Kinds without PTX
//!   (attention until its generator lands) make the backend refuse the artifact at load: no CPU
//!   fallback inside a GPU run.
//! * **Schedule.** Loops are unrolled at load into a flat list of launches, copies and memsets
//!   with resolved device pointers (layer slices, carry ping-pong and a loop's `prefetch`
//!   steps, one iteration ahead, exactly as the CPU backend: `titan_ir::artifact::loop_runs`). The first [`WARMUP_STEPS`] steps run it eagerly; the step is then captured into
//!   a CUDA graph once and replayed. Tokens, targets and the step counter are copied into their
//!   fixed input buffers before each step; `loss`, `grad_norm` and `lr` are read back after it.
//! * **Parameters** start from the same values as the CPU backend (the chunks of
//!   [`crate::init`], the same encoding): worker threads draw, encode and copy chunk after
//!   chunk, so no host copy of a whole state exists. States initialized to zeros (the AdamW
//!   moments) are a device memset.
//! * **Start-up and memory.** [`CudaArtifactTrainer::startup`] times the start-up phases; the
//!   measured peak memory is `cuMemGetInfo`'s used bytes above those used before the first
//!   allocation, maxed over the points where it is read (after initialization and after every
//!   step, when the stream is idle: every buffer of a step is preallocated, so nothing is freed
//!   within it). It includes the arenas, the kernel workspaces, the cuBLASLt workspace and
//!   handle, the loaded modules, the CUDA graph once captured, and anything another process
//!   allocates on the same GPU meanwhile.
//!
//! [`KernelRunner`] launches one kernel of an artifact on operands it allocates itself: the
//! kernel-by-kernel differential tests and per-kernel timings use it.

pub mod collective;
pub mod comm_profile;
pub mod driver;
pub mod gemm;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use titan_ir::DType;
use titan_ir::artifact::{Arena, BufRef, Buffer, BufferClass, Kernel, Step};
use titan_ir::interp::Tensor;
use titan_ir::op::KernelKind;

use self::collective::{Action, Loc};
use self::driver::{CudaError, DeviceBuffer, Event, Function, Gpu, Graph, Module};
use self::gemm::{Blas, GemmPlan, pow2_align};
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

/// Steps run eagerly before the step is captured into a CUDA graph.
pub const WARMUP_STEPS: u64 = 2;

const ARENAS: [Arena; 5] = [Arena::Inputs, Arena::Params, Arena::OptimizerState, Arena::Grads, Arena::Activations];

fn slot(a: Arena) -> usize {
    match a {
        Arena::Inputs => 0,
        Arena::Params => 1,
        Arena::OptimizerState => 2,
        Arena::Grads => 3,
        Arena::Activations => 4,
    }
}

impl From<CudaError> for RuntimeError {
    fn from(e: CudaError) -> RuntimeError {
        RuntimeError::Backend(e.to_string())
    }
}

fn bad(message: String) -> RuntimeError {
    RuntimeError::Artifact(titan_ir::artifact::ArtifactError::Invalid(message))
}

/// Refuse an artifact with a kernel the GPU cannot run (no PTX for a non-GEMM kind, or a GEMM
/// without its description). Checked before the GPU is touched.
pub fn check_gpu_code(artifact: &Artifact) -> Result<(), RuntimeError> {
    for k in &artifact.manifest.kernels {
        gpu_code(k)?;
    }
    Ok(())
}

/// What runs a kernel on the GPU.
enum Code<'k> {
    Ptx { file: &'k str, cubin: Option<&'k str>, entry: &'k str, launch: &'k titan_ir::artifact::Launch },
    Gemm(&'k titan_ir::artifact::GemmDesc),
}

fn gpu_code(k: &Kernel) -> Result<Code<'_>, RuntimeError> {
    if k.kind == KernelKind::Gemm {
        return k.gemm.as_ref().map(Code::Gemm).ok_or_else(|| bad(format!("GEMM kernel `{}` has no `gemm` description; rebuild the artifact", k.name)));
    }
    match (&k.ptx, &k.entry, &k.launch) {
        (Some(file), Some(entry), Some(launch)) => Ok(Code::Ptx { file, cubin: k.cubin.as_deref(), entry, launch }),
        (None, _, _) => Err(RuntimeError::Backend(format!("kernel `{}` ({}) has no GPU code yet; use --backend cpu", k.name, k.kind.name()))),
        _ => Err(bad(format!("kernel `{}` has a PTX file but no entry or launch dimensions; rebuild the artifact", k.name))),
    }
}

/// The GEMM algorithm cache of device `name`: `$TITAN_CACHE_DIR`, else `$XDG_CACHE_HOME/titan`,
/// else `~/.cache/titan`; `gemm-<device>.json` (`None` without any of them).
fn gemm_cache_file(name: &str) -> Option<std::path::PathBuf> {
    let dir = std::env::var_os("TITAN_CACHE_DIR")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| std::path::PathBuf::from(d).join("titan")))
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache").join("titan")))?;
    let device: String = name.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    Some(dir.join(format!("gemm-{device}.json")))
}

/// A kernel ready to launch.
enum Loaded {
    Ptx {
        _module: Module,
        func: Function,
        launch: titan_ir::artifact::Launch,
        /// A first phase launched before `func` with the same arguments.
        prologue: Option<(Function, titan_ir::artifact::Launch)>,
        workspace: Option<DeviceBuffer>,
    },
    Gemm {
        plan: usize,
    },
    /// No GPU code (only in a [`KernelRunner`], which skips such kernels).
    Missing,
}

/// The loaded code of an artifact: modules, functions, workspaces, cuBLASLt plans.
struct LoadedCode {
    kernels: Vec<Loaded>,
    /// Kernels loaded from their cubin, and from PTX (JIT-compiled by the driver).
    from_cubin: usize,
    from_ptx: usize,
    plans: Vec<GemmPlan>,
    blas: Blas,
    blas_workspace: DeviceBuffer,
}

impl LoadedCode {
    /// Load every kernel of `artifact`; `gemm_align(pos)` gives the operand alignment of GEMM
    /// kernel `pos`. With `allow_missing`, kernels without GPU code are kept as `Missing`. A
    /// kernel with a cubin loads it when the artifact targets sm_90a and the device is compute
    /// capability 9.0 (no JIT); otherwise, or if the cubin fails to load (with a one-line
    /// warning), its PTX loads and the driver compiles it. Modules load on several threads.
    fn load(gpu: &Gpu, artifact: &Artifact, gemm_align: &dyn Fn(usize) -> [u64; 3], allow_missing: bool) -> Result<LoadedCode, RuntimeError> {
        let blas = Blas::new()?;
        let blas_workspace = gpu.alloc(gemm::WORKSPACE_BYTES, 0, "the cuBLASLt workspace")?;
        let mut kernels: Vec<Option<Loaded>> = Vec::new();
        let mut plans: Vec<GemmPlan> = Vec::new();
        let mut plan_keys: Vec<(String, [u64; 3])> = Vec::new();
        let mut ptx_jobs = Vec::new();
        for (pos, k) in artifact.manifest.kernels.iter().enumerate() {
            let code = match gpu_code(k) {
                Ok(c) => c,
                Err(_) if allow_missing && k.ptx.is_none() && k.kind != KernelKind::Gemm => {
                    kernels.push(Some(Loaded::Missing));
                    continue;
                }
                Err(e) => return Err(e),
            };
            match code {
                Code::Gemm(g) => {
                    let align = gemm_align(pos);
                    let key = (format!("{g:?}"), align);
                    let plan = match plan_keys.iter().position(|p| *p == key) {
                        Some(i) => i,
                        None => {
                            plans.push(GemmPlan::new(&blas, &k.name, g, align)?);
                            plan_keys.push(key);
                            plans.len() - 1
                        }
                    };
                    kernels.push(Some(Loaded::Gemm { plan }));
                }
                Code::Ptx { file, cubin, entry, launch } => {
                    ptx_jobs.push((pos, k, file, cubin, entry, launch));
                    kernels.push(None);
                }
            }
        }
        let cubins_fit = artifact.manifest.target.arch == "sm_90a" && gpu.capability()? == (9, 0);
        let from_cubin = AtomicUsize::new(0);
        let load_one = |k: &Kernel, file: &str, cubin: Option<&str>, entry: &str, launch: &titan_ir::artifact::Launch| -> Result<Loaded, RuntimeError> {
            let what = format!("kernel `{}`", k.name);
            let from_image = match cubin.filter(|_| cubins_fit) {
                Some(cubin) => {
                    let path = artifact.dir.join(cubin);
                    let loaded = std::fs::read(&path)
                        .map_err(|e| format!("cannot read `{}`: {e}", path.display()))
                        .and_then(|image| gpu.load_cubin(&image, entry, &what).map_err(|e| e.to_string()));
                    match loaded {
                        Ok(l) => {
                            from_cubin.fetch_add(1, Ordering::Relaxed);
                            Some(l)
                        }
                        Err(e) => {
                            eprintln!("titan-run: warning: {what}: the cubin did not load ({e}); using its PTX");
                            None
                        }
                    }
                }
                None => None,
            };
            let (module, func) = match from_image {
                Some(l) => l,
                None => {
                    let path = artifact.dir.join(file);
                    let ptx = std::fs::read_to_string(&path).map_err(|e| {
                        RuntimeError::Backend(format!("kernel `{}`: cannot read `{}`: {e}; the artifact is incomplete, rebuild it", k.name, path.display()))
                    })?;
                    gpu.load_function(&ptx, entry, &what)?
                }
            };
            if launch.shared_bytes > 48 * 1024 {
                gpu.allow_shared(&func, launch.shared_bytes, &what)?;
            }
            let prologue = match &k.prologue {
                Some(p) => {
                    let f = Gpu::function(&module, &p.entry, &what, "module")?;
                    if p.launch.shared_bytes > 48 * 1024 {
                        gpu.allow_shared(&f, p.launch.shared_bytes, &what)?;
                    }
                    Some((f, p.launch.clone()))
                }
                None => None,
            };
            let workspace = if k.workspace_bytes > 0 { Some(gpu.alloc(k.workspace_bytes, 0, &format!("the workspace of kernel `{}`", k.name))?) } else { None };
            Ok(Loaded::Ptx { _module: module, func, launch: launch.clone(), prologue, workspace })
        };
        let threads = init_threads().clamp(1, ptx_jobs.len().max(1));
        let next = AtomicUsize::new(0);
        let loaded: Vec<Result<Vec<(usize, Loaded)>, RuntimeError>> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    let (next, jobs, load_one) = (&next, &ptx_jobs, &load_one);
                    s.spawn(move || -> Result<Vec<(usize, Loaded)>, RuntimeError> {
                        gpu.bind()?;
                        let mut out = Vec::new();
                        while let Some(&(pos, k, file, cubin, entry, launch)) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                            match load_one(k, file, cubin, entry, launch) {
                                Ok(l) => out.push((pos, l)),
                                Err(e) => {
                                    // Let the other workers stop at their next kernel.
                                    next.store(jobs.len(), Ordering::Relaxed);
                                    return Err(e);
                                }
                            }
                        }
                        Ok(out)
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        });
        for part in loaded {
            for (pos, l) in part? {
                kernels[pos] = Some(l);
            }
        }
        let kernels = kernels
            .into_iter()
            .enumerate()
            .map(|(pos, k)| k.ok_or_else(|| RuntimeError::Backend(format!("kernel {pos} was not loaded"))))
            .collect::<Result<Vec<_>, _>>()?;
        let from_cubin = from_cubin.into_inner();
        let from_ptx = ptx_jobs.len() - from_cubin;
        Ok(LoadedCode { kernels, from_cubin, from_ptx, plans, blas, blas_workspace })
    }

    /// Pick each GEMM plan's algorithm among the heuristic's candidates by timing them on the
    /// operands of the plan's first launch (`first`, by kernel position; the arenas hold no
    /// state yet, and GEMMs only write activations and gradients), fastest of 3 calls after a
    /// warm-up. Choices are cached per device and cuBLASLt version
    /// ([`gemm_cache_file`]), so later runs reuse them and stay bitwise reproducible.
    /// `TITAN_GEMM_AUTOTUNE=0` keeps the heuristic's first choice. Returns a summary line.
    fn autotune_gemms(&mut self, gpu: &Gpu, first: &[Option<[u64; 3]>]) -> Result<Option<String>, RuntimeError> {
        if std::env::var("TITAN_GEMM_AUTOTUNE").is_ok_and(|v| v == "0") || self.plans.is_empty() {
            return Ok(None);
        }
        let cache_file = gemm_cache_file(&gpu.name);
        let mut cache: std::collections::BTreeMap<String, usize> =
            cache_file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()).and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
        // The operands of each plan's first launch.
        let mut operands: Vec<Option<[u64; 3]>> = vec![None; self.plans.len()];
        for (pos, k) in self.kernels.iter().enumerate() {
            if let (Loaded::Gemm { plan }, Some(p)) = (k, first.get(pos).copied().flatten()) {
                operands[*plan].get_or_insert(p);
            }
        }
        let (start, stop) = (Event::new()?, Event::new()?);
        let (mut timed, mut cached, mut changed) = (0, 0, 0);
        for (i, plan) in self.plans.iter_mut().enumerate() {
            let n = plan.candidates();
            let Some([a, b, c]) = operands[i] else { continue };
            if n < 2 {
                continue;
            }
            if let Some(&pick) = cache.get(&plan.key).filter(|&&p| p < n) {
                plan.choose(pick);
                cached += 1;
                continue;
            }
            let mut best: Option<(f32, usize)> = None;
            for cand in 0..n {
                plan.choose(cand);
                // A candidate that fails to run is skipped.
                if plan.run(&self.blas, a, b, c, self.blas_workspace.ptr, gpu.stream).is_err() {
                    continue;
                }
                gpu.record(&start)?;
                let ok = (0..3).all(|_| plan.run(&self.blas, a, b, c, self.blas_workspace.ptr, gpu.stream).is_ok());
                gpu.record(&stop)?;
                let ms = start.elapsed_ms(&stop)?;
                if ok && best.is_none_or(|(t, _)| ms < t) {
                    best = Some((ms, cand));
                }
            }
            gpu.sync(|| format!("timing the algorithms of GEMM `{}`", plan.name))?;
            let pick = best.map_or(0, |(_, c)| c);
            plan.choose(pick);
            cache.insert(plan.key.clone(), pick);
            timed += 1;
            changed += usize::from(pick != 0);
        }
        if let (Some(f), true) = (&cache_file, timed > 0) {
            let written = f.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|()| {
                let text = serde_json::to_string_pretty(&cache).map_err(std::io::Error::other)?;
                std::fs::write(f, text)
            });
            if let Err(e) = written {
                eprintln!("titan-run: warning: cannot write the GEMM algorithm cache `{}`: {e}", f.display());
            }
        }
        Ok(Some(format!(
            "GEMM algorithms: {} plans, {timed} timed ({changed} faster than the heuristic's first choice), {cached} from the cache{}",
            self.plans.len(),
            cache_file.map_or(String::new(), |f| format!(" `{}`", f.display()))
        )))
    }

    /// Enqueue kernel `pos` with its input and output pointers.
    fn launch(&self, gpu: &Gpu, artifact: &Artifact, pos: usize, ins: &[u64], outs: &[u64], at: &dyn Fn() -> String) -> Result<(), CudaError> {
        let name = &artifact.manifest.kernels[pos].name;
        match &self.kernels[pos] {
            Loaded::Ptx { func, launch, prologue, workspace, .. } => {
                let mut ptrs: Vec<u64> = Vec::with_capacity(ins.len() + outs.len() + 1);
                ptrs.extend_from_slice(ins);
                ptrs.extend_from_slice(outs);
                if let Some(w) = workspace {
                    ptrs.push(w.ptr);
                }
                if let Some((f, l)) = prologue {
                    gpu.launch(f, l.grid, l.block, l.shared_bytes, &ptrs, || format!("launching the first phase of kernel `{name}` ({})", at()))?;
                }
                gpu.launch(func, launch.grid, launch.block, launch.shared_bytes, &ptrs, || format!("launching kernel `{name}` ({})", at()))
            }
            Loaded::Gemm { plan } => {
                // `B` is the second input, or the first again when the body reads one argument twice.
                let (Some(&a), Some(&b), Some(&c)) = (ins.first(), ins.get(1).or(ins.first()), outs.first()) else {
                    return Err(CudaError::Call { what: format!("GEMM `{name}` ({})", at()), message: "needs two inputs and one output".into() });
                };
                self.plans[*plan]
                    .run(&self.blas, a, b, c, self.blas_workspace.ptr, gpu.stream)
                    .map_err(|e| CudaError::Call { what: format!("GEMM `{name}` ({})", at()), message: format!("cublasLtMatmul failed with {:?}", e.0) })
            }
            Loaded::Missing => Err(CudaError::Call { what: format!("kernel `{name}`"), message: "has no GPU code yet; use --backend cpu".into() }),
        }
    }
}

/// One entry of the unrolled schedule.
enum Op {
    Launch {
        kernel: usize,
        ins: Vec<u64>,
        outs: Vec<u64>,
        at: String,
    },
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
        at: String,
    },
    Memset {
        dst: u64,
        bytes: usize,
        at: String,
    },
    /// A collective step (or a rank-local `take_shard`/`place_shard`): its planned actions on
    /// `input`/`output` (and the shared staging buffer) over mesh dim `mesh_dim`.
    Collective {
        plan: collective::Plan,
        input: u64,
        output: u64,
        mesh_dim: usize,
        dtype: DType,
        at: String,
        /// For `--profile`: what it moves.
        info: comm_profile::CollectiveInfo,
    },
}

/// Where a step sits: `step 4.2 (layer 1)`.
fn loc(path: &[usize], layer: Option<usize>) -> String {
    let p: Vec<String> = path.iter().map(|i| i.to_string()).collect();
    match layer {
        Some(l) => format!("schedule step {}, layer {l}", p.join(".")),
        None => format!("schedule step {}", p.join(".")),
    }
}

/// The loop iteration a step runs in.
#[derive(Clone, Copy)]
struct Frame<'s> {
    layer: usize,
    t: usize,
    carries: &'s [[u32; 2]],
}

/// Device addresses of the arenas, resolving buffer references like the CPU backend.
struct Arenas<'a> {
    artifact: &'a Artifact,
    base: [u64; 5],
    bytes: [u64; 5],
    /// This rank's coordinates in the mesh (zeros on one GPU).
    coords: [usize; 3],
}

impl Arenas<'_> {
    /// `(address, bytes)` of the whole of buffer `b`.
    fn whole(&self, b: &Buffer) -> Result<(u64, u64), RuntimeError> {
        let a = slot(b.arena);
        if b.offset.checked_add(b.bytes).is_none_or(|end| end > self.bytes[a]) {
            return Err(bad(format!("buffer {} (`{}`) lies outside its arena", b.id, b.name)));
        }
        Ok((self.base[a] + b.offset, b.bytes))
    }

    fn view(&self, r: &BufRef, frame: Option<Frame<'_>>) -> Result<(u64, u64), RuntimeError> {
        let buffer = |id: u32| self.artifact.buffer(id).ok_or_else(|| bad(format!("buffer {id} does not exist")));
        match *r {
            BufRef::Buffer { buffer: id, layer: false } => self.whole(buffer(id)?),
            BufRef::Buffer { buffer: id, layer: true } => {
                let b = buffer(id)?;
                let f = frame.ok_or_else(|| bad(format!("a layer slice of buffer {id} outside any loop")))?;
                let (p, len) = self.whole(b)?;
                let layers = b.shape.first().copied().unwrap_or(0);
                if f.layer as u64 >= layers {
                    return Err(bad(format!("layer {} of buffer {id}, which has {layers}", f.layer)));
                }
                let per = len / layers;
                Ok((p + f.layer as u64 * per, per))
            }
            BufRef::Carry { carry, out } => {
                let f = frame.ok_or_else(|| bad(format!("carry {carry} outside any loop")))?;
                let pair = f.carries.get(carry as usize).ok_or_else(|| bad(format!("carry {carry} does not exist")))?;
                self.whole(buffer(pair[(f.t + usize::from(out)) % 2])?)
            }
        }
    }

    /// Unroll `steps` into `ops`.
    /// `ext` gets, per op, the byte ranges it reads or writes (for ordering collectives).
    fn unroll(
        &self,
        steps: &[Step],
        frame: Option<Frame<'_>>,
        path: &mut Vec<usize>,
        ops: &mut Vec<Op>,
        ext: &mut Vec<Vec<(u64, u64)>>,
    ) -> Result<(), RuntimeError> {
        for (i, step) in steps.iter().enumerate() {
            path.push(i);
            let at = loc(path, frame.map(|f| f.layer));
            match step {
                Step::Launch { kernel, inputs, outputs, .. } => {
                    let pos = self.artifact.kernel_pos(*kernel).ok_or_else(|| bad(format!("{at}: kernel {kernel} does not exist")))?;
                    let ins = inputs.iter().map(|r| self.view(r, frame)).collect::<Result<Vec<_>, _>>()?;
                    let outs = outputs.iter().map(|r| self.view(r, frame)).collect::<Result<Vec<_>, _>>()?;
                    ext.push(ins.iter().chain(&outs).copied().collect());
                    ops.push(Op::Launch { kernel: pos, ins: ins.iter().map(|v| v.0).collect(), outs: outs.iter().map(|v| v.0).collect(), at });
                }
                Step::Copy { src, dst, bytes, .. } => {
                    let (s, d) = (self.view(src, frame)?, self.view(dst, frame)?);
                    if *bytes > s.1 || *bytes > d.1 {
                        return Err(bad(format!("{at}: a copy of {bytes} bytes between buffers of {} and {} bytes", s.1, d.1)));
                    }
                    let bytes = usize::try_from(*bytes).map_err(|_| bad(format!("{at}: copy too large")))?;
                    if bytes > 0 {
                        ext.push(vec![(s.0, bytes as u64), (d.0, bytes as u64)]);
                        ops.push(Op::Copy { dst: d.0, src: s.0, bytes, at });
                    }
                }
                Step::Memset { dst, bytes, .. } => {
                    let d = self.view(dst, frame)?;
                    if *bytes > d.1 {
                        return Err(bad(format!("{at}: a memset of {bytes} bytes on a buffer of {} bytes", d.1)));
                    }
                    let bytes = usize::try_from(*bytes).map_err(|_| bad(format!("{at}: memset too large")))?;
                    if bytes > 0 {
                        ext.push(vec![(d.0, bytes as u64)]);
                        ops.push(Op::Memset { dst: d.0, bytes, at });
                    }
                }
                Step::Collective { collective, mesh_dim, group, dim, reduce, dtype, in_shape, out_shape, input, output, .. } => {
                    let m = titan_ir::MeshDim::from_name(mesh_dim).ok_or_else(|| bad(format!("{at}: unknown mesh dim `{mesh_dim}`")))?.index();
                    let shape = collective::StepShape {
                        collective: *collective,
                        group: u64::from(*group),
                        dim: *dim,
                        reduce: *reduce,
                        dtype: *dtype,
                        in_shape,
                        out_shape,
                    };
                    let plan =
                        collective::plan(&shape, self.coords[m] as u64).map_err(|e| bad(format!("{at}: `{}` over {mesh_dim}: {e}", collective.name())))?;
                    let (i, o) = (self.view(input, frame)?, self.view(output, frame)?);
                    let e = dtype.size_bytes() as u64;
                    let (ni, no) = (in_shape.iter().product::<u64>() * e, out_shape.iter().product::<u64>() * e);
                    if ni > i.1 || no > o.1 {
                        return Err(bad(format!("{at}: `{}` reads {ni} and writes {no} bytes, its buffers hold {} and {}", collective.name(), i.1, o.1)));
                    }
                    ext.push(vec![(i.0, ni), (o.0, no)]);
                    let dim_name = titan_ir::MeshDim::from_name(mesh_dim).map_or("?", titan_ir::MeshDim::name);
                    let info = comm_profile::CollectiveInfo { op: collective.name(), dim: dim_name, bytes: ni.max(no), at: at.clone() };
                    ops.push(Op::Collective { plan, input: i.0, output: o.0, mesh_dim: m, dtype: *dtype, at, info });
                }
                Step::Loop { count, reverse, carries, body, prefetch } => {
                    // The next layer's gathers are unrolled at the top of each iteration, so
                    // the comm stream runs them while this layer computes.
                    for run in titan_ir::artifact::loop_runs(*count, *reverse, !prefetch.is_empty()) {
                        let steps = if run.prefetch { prefetch } else { body };
                        self.unroll(steps, Some(Frame { layer: run.layer, t: run.t, carries }), path, ops, ext)?;
                    }
                }
            }
            path.pop();
        }
        Ok(())
    }
}

/// Check that a GEMM's operands hold what its description addresses (so cuBLASLt never reads or
/// writes outside a buffer), given the byte sizes the schedule binds.
fn check_gemm_extent(k: &Kernel, g: &titan_ir::artifact::GemmDesc, bound: [u64; 3]) -> Result<(), RuntimeError> {
    let batch = g.batch.max(1);
    // Stored (rows, cols, ld, stride, dtype) of A, B, C (row-major).
    let (ar, ac) = if g.transpose_a { (g.k, g.m) } else { (g.m, g.k) };
    let (br, bc) = if g.transpose_b { (g.n, g.k) } else { (g.k, g.n) };
    let specs = [(ar, ac, g.lda, g.stride_a, g.a_dtype, "A"), (br, bc, g.ldb, g.stride_b, g.b_dtype, "B"), (g.m, g.n, g.ldc, g.stride_c, g.c_dtype, "C")];
    for ((rows, cols, ld, stride, dtype, name), have) in specs.into_iter().zip(bound) {
        if ld < cols {
            return Err(bad(format!("GEMM `{}`: operand {name} has leading dimension {ld} below its {cols} columns; rebuild the artifact", k.name)));
        }
        let need = (batch - 1)
            .checked_mul(stride)
            .and_then(|x| x.checked_add(rows.saturating_sub(1).checked_mul(ld)?))
            .and_then(|x| x.checked_add(cols))
            .and_then(|x| x.checked_mul(dtype.size_bytes() as u64));
        if rows > 0 && need.is_none_or(|n| n > have) {
            return Err(bad(format!(
                "GEMM `{}`: operand {name} needs {} bytes, the schedule binds {have}; the GEMM description and the plan disagree, rebuild the artifact",
                k.name,
                need.map_or("too many".into(), |n| n.to_string())
            )));
        }
    }
    Ok(())
}

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
    code: LoadedCode,
    _memory: Vec<DeviceBuffer>,
    gpu: Gpu,
}

/// Ordering of the collectives' stream against the compute stream: each collective starts
/// after the compute enqueued before it (`fork`), records `done[c]` when it ends, and the
/// compute stream waits for it only before the first later op that touches its buffers
/// ([`collective::join_points`]), so a prefetched gather overlaps the compute in between.
struct CommEvents {
    fork: Event,
    done: Vec<Event>,
    joins: collective::Joins,
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
        let mut base = [0u64; 5];
        let mut bytes = [0u64; 5];
        for a in ARENAS {
            let n = artifact.arena_bytes(a);
            let fill = if matches!(a, Arena::Grads | Arena::Activations) { 0xff } else { 0 };
            let buf = gpu.alloc(n, fill, &format!("the `{}` arena", arena_name(a)))?;
            base[slot(a)] = buf.ptr;
            bytes[slot(a)] = n;
            memory.push(buf);
        }
        let arenas = Arenas { artifact, base, bytes, coords };
        startup.alloc_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let (mut ops, mut ext) = (Vec::new(), Vec::new());
        arenas.unroll(&m.ranks[0].steps, None, &mut Vec::new(), &mut ops, &mut ext)?;
        let comm: Vec<bool> = ops.iter().map(|o| matches!(o, Op::Collective { plan, .. } if plan.communicates)).collect();
        let joins = collective::join_points(&comm, &ext);
        let staging_bytes = ops.iter().map(|o| if let Op::Collective { plan, .. } = o { plan.staging_bytes } else { 0 }).max().unwrap_or(0);
        let staging = if staging_bytes > 0 { Some(gpu.alloc(staging_bytes, 0, "the collectives' staging buffer")?) } else { None };
        let has_collectives = ops.iter().any(|o| matches!(o, Op::Collective { plan, .. } if plan.communicates));
        if has_collectives && nccl.is_none() {
            return Err(RuntimeError::Backend("the schedule has collectives but this process has no NCCL communicators".into()));
        }
        let comm_events = if has_collectives {
            Some(CommEvents { fork: Event::new()?, done: comm.iter().filter(|&&c| c).map(|_| Event::new()).collect::<Result<Vec<_>, _>>()?, joins })
        } else {
            None
        };
        // Per GEMM kernel: the alignment of its operands over every launch, and their extents.
        let mut align = vec![[256u64; 3]; m.kernels.len()];
        let mut first = vec![None; m.kernels.len()];
        Self::gemm_operands(artifact, &arenas, &m.ranks[0].steps, None, &mut align, &mut first)?;
        startup.plan_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut code = LoadedCode::load(&gpu, artifact, &|pos| align[pos], false)?;
        startup.load_s += t.elapsed().as_secs_f64();
        eprintln!("titan-run: loaded {} kernels from cubins and {} from PTX (JIT) in {:.1} s", code.from_cubin, code.from_ptx, t.elapsed().as_secs_f64());
        let t = Instant::now();
        if let Some(line) = code.autotune_gemms(&gpu, &first)? {
            eprintln!("titan-run: {line} in {:.1} s", t.elapsed().as_secs_f64());
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

    /// Walk the schedule's GEMM launches: check their extents and record the smallest
    /// power-of-two alignment of each operand.
    fn gemm_operands(
        artifact: &Artifact,
        arenas: &Arenas<'_>,
        steps: &[Step],
        frame: Option<Frame<'_>>,
        align: &mut [[u64; 3]],
        first: &mut [Option<[u64; 3]>],
    ) -> Result<(), RuntimeError> {
        for step in steps {
            match step {
                Step::Launch { kernel, inputs, outputs, .. } => {
                    let Some(pos) = artifact.kernel_pos(*kernel) else { continue };
                    let k = &artifact.manifest.kernels[pos];
                    let Some(g) = k.gemm.as_ref().filter(|_| k.kind == KernelKind::Gemm) else { continue };
                    let refs = [inputs.first(), inputs.get(1).or(inputs.first()), outputs.first()];
                    let mut bound = [0u64; 3];
                    let mut ptrs = [0u64; 3];
                    for (j, r) in refs.into_iter().enumerate() {
                        let r = r.ok_or_else(|| bad(format!("GEMM `{}` needs two inputs and one output", k.name)))?;
                        let (p, len) = arenas.view(r, frame)?;
                        align[pos][j] = align[pos][j].min(pow2_align(p));
                        bound[j] = len;
                        ptrs[j] = p;
                    }
                    check_gemm_extent(k, g, bound)?;
                    first[pos].get_or_insert(ptrs);
                }
                Step::Loop { count, reverse, carries, body, prefetch } => {
                    for run in titan_ir::artifact::loop_runs(*count, *reverse, !prefetch.is_empty()) {
                        let steps = if run.prefetch { prefetch } else { body };
                        Self::gemm_operands(artifact, arenas, steps, Some(Frame { layer: run.layer, t: run.t, carries }), align, first)?;
                    }
                }
                _ => {}
            }
        }
        Ok(())
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
        }
        Ok(())
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
            if p.init == titan_ir::Init::Zeros {
                let bytes = usize::try_from(len).map_err(|_| bad(format!("state `{}` is too large", p.name)))?;
                self.gpu.memset(ptr, 0, bytes, || format!("zeroing state `{}`", p.name))?;
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
                    jobs.push(InitJob { ptr: ptr + (first * size) as u64, elems, layer: l, chunk: c, init: p.init, dtype: b.dtype, name: names.len() - 1 });
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
                        let (mut scratch, mut bytes) = (Vec::with_capacity(CHUNK_ELEMS), Vec::new());
                        let (mut draw_s, mut copy_s) = (0.0, 0.0);
                        while let Some(j) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                            let t = Instant::now();
                            let name = &names[j.name];
                            let r = Self::draw_chunk(seed, j, name, &mut scratch, &mut bytes);
                            let t1 = Instant::now();
                            let r = r.and_then(|()| Ok(gpu.upload_sync(j.ptr, &bytes, || format!("uploading the initial values of `{name}`"))?));
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

    fn enqueue_ops(&self) -> Result<(), CudaError> {
        let events = self.profile.as_ref().map(|p| &p.events);
        let before_waits = self.profile.as_ref().and_then(|p| p.comm.as_ref()).map(|c| &c.before_waits);
        let mut nth_collective = 0;
        for (i, op) in self.ops.iter().enumerate() {
            if let Some(ev) = before_waits {
                self.gpu.record(&ev[i])?;
            }
            if let Some(ce) = &self.comm_events {
                for &c in &ce.joins.before[i] {
                    self.gpu.wait_for(&ce.done[c])?;
                }
            }
            if let Some(ev) = events {
                self.gpu.record(&ev[i])?;
            }
            match op {
                Op::Launch { kernel, ins, outs, at } => self.code.launch(&self.gpu, self.artifact, *kernel, ins, outs, &|| at.clone())?,
                Op::Copy { dst, src, bytes, at } => self.gpu.copy(*dst, *src, *bytes, || format!("copy of {bytes} bytes ({at})"))?,
                Op::Memset { dst, bytes, at } => self.gpu.memset(*dst, 0, *bytes, || format!("memset of {bytes} bytes ({at})"))?,
                Op::Collective { plan, input, output, mesh_dim, dtype, at, .. } => {
                    self.enqueue_collective(plan, *input, *output, *mesh_dim, *dtype, nth_collective, at)?;
                    nth_collective += usize::from(plan.communicates);
                }
            }
        }
        if let Some(ev) = before_waits {
            self.gpu.record(&ev[self.ops.len()])?;
        }
        if let Some(ce) = &self.comm_events {
            for &c in &ce.joins.at_end {
                self.gpu.wait_for(&ce.done[c])?;
            }
        }
        if let Some(ev) = events {
            self.gpu.record(&ev[self.ops.len()])?;
        }
        Ok(())
    }

    /// Enqueue one collective step (the `nth` communicating one): its copies and NCCL calls on
    /// the collectives' stream after the compute enqueued so far, recording `done[nth]` at its
    /// end (rank-local `take_shard`/`place_shard` copies stay on the compute stream).
    #[allow(clippy::too_many_arguments)]
    fn enqueue_collective(
        &self,
        plan: &collective::Plan,
        input: u64,
        output: u64,
        mesh_dim: usize,
        dtype: DType,
        nth: usize,
        at: &str,
    ) -> Result<(), CudaError> {
        let staging = self.staging.as_ref().map_or(0, |b| b.ptr);
        let addr = |l: Loc| match l {
            Loc::Input(o) => input + o,
            Loc::Output(o) => output + o,
            Loc::Staging(o) => staging + o,
        };
        let stream = self.gpu.stream_for(plan.communicates);
        let events = self.comm_events.as_ref().filter(|_| plan.communicates);
        if let Some(ce) = events {
            self.gpu.fork_to_comm(&ce.fork)?;
            if let Some(c) = self.profile.as_ref().and_then(|p| p.comm.as_ref()) {
                self.gpu.record_on_comm(&c.start[nth])?;
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
                    self.gpu.copy_2d(plan.communicates, addr(dst), dst_pitch, addr(src), src_pitch, width, height, || {
                        format!("a strided copy of a collective ({at})")
                    })?
                }
                Action::Zero { dst, bytes } => {
                    let n = usize::try_from(bytes).map_err(|_| CudaError::Call { what: at.to_string(), message: "memset too large".into() })?;
                    self.gpu.memset_on(plan.communicates, addr(dst), 0, n, || format!("zeroing the output of a collective ({at})"))?
                }
            }
        }
        if let Some(ce) = events {
            self.gpu.record_on_comm(&ce.done[nth])?;
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
        self.profile = Some(Profile { events, kernels, other: KernelTime::default(), steps: 0, comm });
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

    /// Add the event times of the step that just finished to the profile.
    fn collect_profile(&mut self) -> Result<(), RuntimeError> {
        let warm = self.steps_run <= 1;
        let Some(p) = self.profile.as_mut() else { return Ok(()) };
        if warm {
            return Ok(());
        }
        for (i, op) in self.ops.iter().enumerate() {
            // On a mesh an op's time ends where the waits before the next op begin.
            let end = p.comm.as_ref().map_or(&p.events[i + 1], |c| &c.before_waits[i + 1]);
            let secs = f64::from(p.events[i].elapsed_ms(end)?) * 1e-3;
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
        Ok(self.gpu.sync(|| format!("uploading state `{name}`"))?)
    }

    /// Decode any buffer (for tests and debugging).
    pub fn read_buffer(&self, id: u32) -> Result<Tensor<f32>, RuntimeError> {
        self.gpu.bind()?;
        let b = self.artifact.buffer(id).ok_or_else(|| bad(format!("buffer {id} does not exist")))?;
        self.read(b)
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

    fn profile_report(&self, full: bool) -> Option<String> {
        CudaArtifactTrainer::profile_report(self, full)
    }

    fn step(&mut self, batch: &Batch) -> Result<StepMetrics, RuntimeError> {
        CudaArtifactTrainer::step(self, batch)
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

/// The type of one kernel operand.
#[derive(Clone, Debug, PartialEq)]
pub struct Operand {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl Operand {
    pub fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size_bytes()
    }
}

/// Device inputs, device outputs and the outputs' types of one kernel.
type Operands = (Vec<DeviceBuffer>, Vec<DeviceBuffer>, Vec<Operand>);

/// What one launch of [`KernelRunner::run`] left behind.
pub struct KernelRun {
    /// Each output's bytes.
    pub outputs: Vec<Vec<u8>>,
    /// Whether the kernel's workspace is all zero again (true when it has none or it is scratch).
    pub workspace_zeroed: bool,
}

/// Launches single kernels of an artifact on operands it allocates (each its own
/// `cuMemAlloc`, so 256-byte aligned): the kernel-by-kernel differential tests and timings.
pub struct KernelRunner<'a> {
    artifact: &'a Artifact,
    code: LoadedCode,
    gpu: Gpu,
}

impl<'a> KernelRunner<'a> {
    /// Open the GPU and load every kernel that has GPU code (the others are reported by
    /// [`KernelRunner::has_gpu_code`]).
    pub fn new(artifact: &'a Artifact) -> Result<KernelRunner<'a>, RuntimeError> {
        let gpu = Gpu::open()?;
        let code = LoadedCode::load(&gpu, artifact, &|_| [256; 3], true)?;
        Ok(KernelRunner { artifact, code, gpu })
    }

    pub fn device_name(&self) -> &str {
        &self.gpu.name
    }

    /// Compute capability of the GPU.
    pub fn capability(&self) -> Result<(i32, i32), RuntimeError> {
        Ok(self.gpu.capability()?)
    }

    /// Whether kernel `pos` (index in `manifest.kernels`) runs on the GPU.
    pub fn has_gpu_code(&self, pos: usize) -> bool {
        !matches!(self.code.kernels.get(pos), Some(Loaded::Missing) | None)
    }

    /// The argument and result types of kernel `pos`'s body.
    pub fn operands(&self, pos: usize) -> Result<(Vec<Operand>, Vec<Operand>), RuntimeError> {
        let k = self.artifact.manifest.kernels.get(pos).ok_or_else(|| bad(format!("kernel {pos} does not exist")))?;
        let (_, body) = self.artifact.kernel(k.id).ok_or_else(|| bad(format!("kernel `{}` has no body", k.name)))?;
        let dims = &self.artifact.graph.dims;
        let spec = |v| {
            let ty = body.ty(v);
            ty.resolve(dims).map(|shape| Operand { dtype: ty.dtype, shape }).map_err(|e| bad(format!("kernel `{}`: {e}", k.name)))
        };
        let ins = body.args.iter().map(|a| spec(a.value)).collect::<Result<Vec<_>, _>>()?;
        let outs = body.outputs.iter().map(|o| spec(o.value)).collect::<Result<Vec<_>, _>>()?;
        Ok((ins, outs))
    }

    fn alloc_operands(
        &self,
        pos: usize,
        out_fill: u8,
        fill_in: &mut dyn FnMut(usize, &Operand, u64) -> Result<(), RuntimeError>,
    ) -> Result<Operands, RuntimeError> {
        let name = &self.artifact.manifest.kernels[pos].name;
        let (ins, outs) = self.operands(pos)?;
        let mut din = Vec::new();
        for (i, o) in ins.iter().enumerate() {
            let b = self.gpu.alloc(o.bytes() as u64, 0, &format!("input {i} of kernel `{name}`"))?;
            fill_in(i, o, b.ptr)?;
            din.push(b);
        }
        let mut dout = Vec::new();
        for (i, o) in outs.iter().enumerate() {
            dout.push(self.gpu.alloc(o.bytes() as u64, out_fill, &format!("output {i} of kernel `{name}`"))?);
        }
        Ok((din, dout, outs))
    }

    /// For a GEMM, check that its operands hold what the description addresses.
    fn check_extent(&self, pos: usize, din: &[DeviceBuffer], dout: &[DeviceBuffer]) -> Result<(), RuntimeError> {
        let k = &self.artifact.manifest.kernels[pos];
        if let (KernelKind::Gemm, Some(g)) = (k.kind, &k.gemm) {
            let (Some(a), Some(c)) = (din.first(), dout.first()) else { return Err(bad(format!("GEMM `{}` needs two inputs and one output", k.name))) };
            let b = din.get(1).unwrap_or(a);
            check_gemm_extent(k, g, [a.bytes, b.bytes, c.bytes])?;
        }
        Ok(())
    }

    /// Launch kernel `pos` once on `inputs` (bytes in each argument's dtype), every output byte
    /// set to `fill` first (`0xff`, NaN, to catch unwritten elements; 0 for a `scatter_add`,
    /// which sums into the table the schedule zeroes), and read back the outputs and the
    /// workspace.
    pub fn run(&self, pos: usize, inputs: &[Vec<u8>], fill: u8) -> Result<KernelRun, RuntimeError> {
        self.gpu.bind()?;
        let name = self.artifact.manifest.kernels.get(pos).map(|k| k.name.clone()).unwrap_or_default();
        let (ins, _) = self.operands(pos)?;
        if inputs.len() != ins.len() || inputs.iter().zip(&ins).any(|(b, o)| b.len() != o.bytes()) {
            return Err(bad(format!("kernel `{name}`: the inputs do not match its {} arguments", ins.len())));
        }
        let (din, dout, outs) = self.alloc_operands(pos, fill, &mut |i, _, ptr| {
            self.gpu.upload(ptr, &inputs[i], || format!("copying input {i} of kernel `{name}`"))?;
            Ok(self.gpu.sync(|| format!("copying input {i} of kernel `{name}`"))?)
        })?;
        self.check_extent(pos, &din, &dout)?;
        let ip: Vec<u64> = din.iter().map(|b| b.ptr).collect();
        let op: Vec<u64> = dout.iter().map(|b| b.ptr).collect();
        let scratch = self.artifact.manifest.kernels[pos].workspace_scratch;
        if let (true, Loaded::Ptx { workspace: Some(w), .. }) = (scratch, &self.code.kernels[pos]) {
            // A scratch workspace may hold anything: poison it so a read before write shows.
            self.gpu.memset(w.ptr, fill, w.bytes as usize, || format!("poisoning the workspace of kernel `{name}`"))?;
        }
        self.code.launch(&self.gpu, self.artifact, pos, &ip, &op, &|| "differential test".into())?;
        self.gpu.sync(|| format!("running kernel `{name}`"))?;
        let mut outputs = Vec::new();
        for (i, (b, o)) in dout.iter().zip(&outs).enumerate() {
            let mut host = vec![0u8; o.bytes()];
            self.gpu.download(&mut host, b.ptr, || format!("reading output {i} of kernel `{name}`"))?;
            outputs.push(host);
        }
        let workspace_zeroed = match &self.code.kernels[pos] {
            Loaded::Ptx { workspace: Some(w), .. } if !scratch => {
                let mut host = vec![0u8; w.bytes as usize];
                self.gpu.download(&mut host, w.ptr, || format!("reading the workspace of kernel `{name}`"))?;
                host.iter().all(|&b| b == 0)
            }
            _ => true,
        };
        Ok(KernelRun { outputs, workspace_zeroed })
    }

    /// Median milliseconds of one launch of kernel `pos` over `iters` launches (after a
    /// warm-up launch), on inputs tiled from `block(operand)` (a few KiB of valid values per
    /// operand, repeated over the whole buffer by device copies).
    pub fn time(&self, pos: usize, iters: usize, block: &mut dyn FnMut(&Operand) -> Vec<u8>) -> Result<f64, RuntimeError> {
        self.gpu.bind()?;
        let name = self.artifact.manifest.kernels.get(pos).map(|k| k.name.clone()).unwrap_or_default();
        let (din, dout, _) = self.alloc_operands(pos, 0, &mut |i, o, ptr| {
            let total = o.bytes();
            let mut b = block(o);
            let unit = o.dtype.size_bytes().max(1);
            b.truncate(total.min(b.len()) / unit * unit);
            if b.is_empty() {
                return Ok(());
            }
            self.gpu.upload(ptr, &b, || format!("filling input {i} of kernel `{name}`"))?;
            self.gpu.sync(|| format!("filling input {i} of kernel `{name}`"))?;
            // Double the filled prefix until the buffer is full.
            let mut filled = b.len();
            while filled < total {
                let n = filled.min(total - filled);
                self.gpu.copy(ptr + filled as u64, ptr, n, || format!("filling input {i} of kernel `{name}`"))?;
                filled += n;
            }
            Ok(self.gpu.sync(|| format!("filling input {i} of kernel `{name}`"))?)
        })?;
        self.check_extent(pos, &din, &dout)?;
        let ip: Vec<u64> = din.iter().map(|b| b.ptr).collect();
        let op: Vec<u64> = dout.iter().map(|b| b.ptr).collect();
        let at = || "timing".to_string();
        self.code.launch(&self.gpu, self.artifact, pos, &ip, &op, &at)?;
        self.gpu.sync(|| format!("warming up kernel `{name}`"))?;
        let (e0, e1) = (Event::new()?, Event::new()?);
        let mut ms = Vec::with_capacity(iters.max(1));
        for _ in 0..iters.max(1) {
            self.gpu.record(&e0)?;
            self.code.launch(&self.gpu, self.artifact, pos, &ip, &op, &at)?;
            self.gpu.record(&e1)?;
            ms.push(f64::from(e0.elapsed_ms(&e1)?));
        }
        ms.sort_by(f64::total_cmp);
        Ok(ms[ms.len() / 2])
    }
}
