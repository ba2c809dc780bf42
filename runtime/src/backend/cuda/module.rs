//! Loading an artifact's code onto the GPU: each kernel's module (its cubin, else its PTX
//! JIT-compiled by the driver), function, prologue and workspace, each GEMM's cuBLASLt plan, and
//! launching a loaded kernel with its operands.

use std::sync::atomic::{AtomicUsize, Ordering};

use titan_ir::artifact::Kernel;
use titan_ir::op::KernelKind;

use super::bad;
use super::driver::{CudaError, DeviceBuffer, Function, Gpu, Module};
use super::gemm::{self, Blas, GemmPlan};
use crate::RuntimeError;
use crate::artifact::Artifact;
use crate::init::init_threads;

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

/// A kernel ready to launch.
pub(super) enum Loaded {
    Ptx {
        _module: Module,
        func: Function,
        launch: titan_ir::artifact::Launch,
        /// A first phase launched before `func` with the same arguments.
        prologue: Option<(Function, titan_ir::artifact::Launch)>,
        epilogue: Option<(Function, titan_ir::artifact::Launch)>,
        workspace: Option<DeviceBuffer>,
    },
    Gemm {
        plan: usize,
    },
    /// No GPU code (only in a [`KernelRunner`], which skips such kernels).
    Missing,
}

/// The loaded code of an artifact: modules, functions, workspaces, cuBLASLt plans.
pub(super) struct LoadedCode {
    pub(super) kernels: Vec<Loaded>,
    /// Kernels loaded from their cubin, and from PTX (JIT-compiled by the driver).
    pub(super) from_cubin: usize,
    pub(super) from_ptx: usize,
    pub(super) plans: Vec<GemmPlan>,
    pub(super) blas: Blas,
    pub(super) blas_workspace: DeviceBuffer,
}

impl LoadedCode {
    /// Load every kernel of `kernels_of` (the training step's or the eval step's table of
    /// `artifact`, whose directory holds their files); `gemm_align(pos)` gives the operand alignment of GEMM
    /// kernel `pos`. With `allow_missing`, kernels without GPU code are kept as `Missing`. A
    /// kernel with a cubin loads it when the artifact targets sm_90a and the device is compute
    /// capability 9.0 (no JIT); otherwise, or if the cubin fails to load (with a one-line
    /// warning), its PTX loads and the driver compiles it. Modules load on several threads.
    pub(super) fn load(
        gpu: &Gpu,
        artifact: &Artifact,
        kernels_of: &[Kernel],
        gemm_align: &dyn Fn(usize) -> [u64; 3],
        allow_missing: bool,
    ) -> Result<LoadedCode, RuntimeError> {
        let blas = Blas::new()?;
        let blas_workspace = gpu.alloc(gemm::WORKSPACE_BYTES, 0, "the cuBLASLt workspace")?;
        let mut kernels: Vec<Option<Loaded>> = Vec::new();
        let mut plans: Vec<GemmPlan> = Vec::new();
        let mut plan_keys: Vec<(String, [u64; 3])> = Vec::new();
        let mut ptx_jobs = Vec::new();
        for (pos, k) in kernels_of.iter().enumerate() {
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
            let phase = |p: &Option<titan_ir::artifact::Prologue>| -> Result<_, RuntimeError> {
                let Some(p) = p else { return Ok(None) };
                let f = Gpu::function(&module, &p.entry, &what, "module")?;
                if p.launch.shared_bytes > 48 * 1024 {
                    gpu.allow_shared(&f, p.launch.shared_bytes, &what)?;
                }
                Ok(Some((f, p.launch.clone())))
            };
            let prologue = phase(&k.prologue)?;
            let epilogue = phase(&k.epilogue)?;
            let workspace = if k.workspace_bytes > 0 { Some(gpu.alloc(k.workspace_bytes, 0, &format!("the workspace of kernel `{}`", k.name))?) } else { None };
            Ok(Loaded::Ptx { _module: module, func, launch: launch.clone(), prologue, epilogue, workspace })
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

    /// Enqueue kernel `pos` with its input and output pointers.
    /// `kernels` is the table the code was loaded from.
    pub(super) fn launch(&self, gpu: &Gpu, kernels: &[Kernel], pos: usize, ins: &[u64], outs: &[u64], at: &dyn Fn() -> String) -> Result<(), CudaError> {
        let name = kernels.get(pos).map_or("?", |k| k.name.as_str());
        match &self.kernels[pos] {
            Loaded::Ptx { func, launch, prologue, epilogue, workspace, .. } => {
                let mut ptrs: Vec<u64> = Vec::with_capacity(ins.len() + outs.len() + 1);
                ptrs.extend_from_slice(ins);
                ptrs.extend_from_slice(outs);
                if let Some(w) = workspace {
                    ptrs.push(w.ptr);
                }
                if let Some((f, l)) = prologue {
                    gpu.launch(f, l.grid, l.block, l.shared_bytes, &ptrs, || format!("launching the first phase of kernel `{name}` ({})", at()))?;
                }
                gpu.launch(func, launch.grid, launch.block, launch.shared_bytes, &ptrs, || format!("launching kernel `{name}` ({})", at()))?;
                if let Some((f, l)) = epilogue {
                    gpu.launch(f, l.grid, l.block, l.shared_bytes, &ptrs, || format!("launching the last phase of kernel `{name}` ({})", at()))?;
                }
                Ok(())
            }
            Loaded::Gemm { plan } => {
                // `B` is the second input, or the first again when the body reads one argument twice.
                let (Some(&a), Some(&b), Some(&c)) = (ins.first(), ins.get(1).or(ins.first()), outs.first()) else {
                    return Err(CudaError::Call { what: format!("GEMM `{name}` ({})", at()), message: "needs two inputs and one output".into() });
                };
                // A scaled GEMM's dequantization scales are its inputs 2 and 3, or 2 for both when
                // the body reads one scale twice; the residual-add epilogue's C is input 2.
                let scales = [ins.get(2).copied().unwrap_or(0), ins.get(3).or(ins.get(2)).copied().unwrap_or(0)];
                // (Load checked that an adding GEMM's schedule binds input 2: `gemm_operands`.)
                let c_in = ins.get(2).copied().unwrap_or(0);
                self.plans[*plan]
                    .run(&self.blas, [a, b, c], c_in, scales, self.blas_workspace.ptr, gpu.stream)
                    .map_err(|e| CudaError::Call { what: format!("GEMM `{name}` ({})", at()), message: format!("cublasLtMatmul failed with {:?}", e.0) })
            }
            Loaded::Missing => Err(CudaError::Call { what: format!("kernel `{name}`"), message: "has no GPU code yet; use --backend cpu".into() }),
        }
    }
}
