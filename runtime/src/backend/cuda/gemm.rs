//! GEMMs through cuBLASLt from a [`GemmDesc`]: `C[m, n] = op(A) @ op(B)` row-major, bf16/f16 in,
//! fp32 compute, `batch` times with element strides.
//!
//! cuBLASLt is column-major. A row-major `X` with leading dimension `ld` is the column-major
//! `X^T` with the same `ld`, so the row-major product is computed as the column-major
//! `C^T[n, m] = op(B)^T @ op(A)^T`: the stored `B` is cuBLASLt's `A` (transposed when
//! `transpose_b`), the stored `A` its `B` (transposed when `transpose_a`), and `m`/`n` swap.
//! The algorithm is picked by the heuristic once per plan (one plan per GEMM kernel, shared
//! between kernels of the same shape) for the pointer alignment the schedule guarantees, with
//! one library workspace shared by every GEMM on the stream.
//!
//! Scaled fp8 GEMMs (`scaled_matmul`, float8 training): e4m3/e5m2 inputs, f32 compute, bf16
//! output, each operand's dequantization scale a device pointer set on the descriptor before
//! every call (tensor: one f32, `SCALAR_32F`; vector: one f32 per row of A / column of B,
//! `OUTER_VEC_32F`, cuBLAS >= 12.9), Hopper's fast accumulation only when the GEMM asks for it.
//! Hopper's fp8 GEMMs take only the "TN" layout: row-major `A [m, k]` and `B [n, k]`
//! (`transpose_b`), i.e. cuBLASLt's `A` transposed and `B` not; the float8 expansion emits
//! every `scaled_matmul` in that form (the quantizing kernels store transposed operands), and
//! anything else is refused here.

use std::ffi::c_void;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use titan_ir::DType;
use titan_ir::artifact::{GemmDesc, GemmScale};

use super::driver::CudaError;

/// Algorithms asked of the heuristic per GEMM shape by default; the CUDA backend runs the first,
/// or with `TITAN_GEMM_AUTOTUNE` times them once per device and library version and keeps the
/// fastest (`autotune.rs`).
pub const MAX_CANDIDATES: usize = 6;

/// Algorithms asked of the heuristic per GEMM shape: `TITAN_GEMM_CANDIDATES` (1 to 64), else
/// [`MAX_CANDIDATES`].
pub fn max_candidates() -> usize {
    std::env::var("TITAN_GEMM_CANDIDATES").ok().and_then(|v| v.parse::<usize>().ok()).filter(|n| (1..=64).contains(n)).unwrap_or(MAX_CANDIDATES)
}

/// The cuBLASLt workspace every GEMM may use (NVIDIA recommends 32 MiB on Hopper).
pub const WORKSPACE_BYTES: u64 = titan_ir::artifact::workspace::CUBLASLT_WORKSPACE_BYTES;

fn lt_err(what: &str, doing: &str, e: lt::CublasError) -> CudaError {
    CudaError::Call { what: what.into(), message: format!("cuBLASLt {doing} failed with {:?}", e.0) }
}

/// Whether the cuBLASLt library can be loaded here.
pub fn cublaslt_present() -> bool {
    // SAFETY: only tries to open the library by name.
    unsafe { sys::is_culib_present() }
}

/// A cuBLASLt handle.
pub struct Blas {
    handle: sys::cublasLtHandle_t,
}

impl Blas {
    pub fn new() -> Result<Blas, CudaError> {
        if !cublaslt_present() {
            return Err(CudaError::NoDevice(
                "the cuBLASLt library (libcublasLt.so) is not found; add the CUDA toolkit's lib directory to LD_LIBRARY_PATH".into(),
            ));
        }
        Ok(Blas { handle: lt::create_handle().map_err(|e| lt_err("cuBLASLt", "handle creation", e))? })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

fn data_type(d: DType, what: &str, operand: &str) -> Result<sys::cudaDataType, CudaError> {
    match d {
        DType::BF16 => Ok(sys::cudaDataType::CUDA_R_16BF),
        DType::F16 => Ok(sys::cudaDataType::CUDA_R_16F),
        DType::F32 => Ok(sys::cudaDataType::CUDA_R_32F),
        DType::F8E4M3 => Ok(sys::cudaDataType::CUDA_R_8F_E4M3),
        DType::F8E5M2 => Ok(sys::cudaDataType::CUDA_R_8F_E5M2),
        other => Err(CudaError::Call { what: what.into(), message: format!("operand {operand} is {other}; cuBLASLt GEMMs on {other} are not supported yet") }),
    }
}

/// One GEMM shape with its descriptors and chosen algorithm.
pub struct GemmPlan {
    pub name: String,
    desc: sys::cublasLtMatmulDesc_t,
    /// cuBLASLt's A (the stored B), B (the stored A), C/D.
    la: sys::cublasLtMatrixLayout_t,
    lb: sys::cublasLtMatrixLayout_t,
    lc: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    /// The heuristic's candidates, best-ranked first (`algo` is one of them).
    candidates: Vec<sys::cublasLtMatmulAlgo_t>,
    /// The shape, alignment and library version: the key of the autotuning cache.
    pub key: String,
    /// FLOPs of one call (`2 m n k batch`).
    pub flops: f64,
    /// A scaled fp8 GEMM: the scale pointers are set before each call.
    scaled: bool,
    /// The residual-add epilogue: `D = A B + C` (`beta = 1`), C a separate input with D's layout.
    pub accumulate: bool,
    /// Bytes the stored A, B and C span and their dtypes, and the element counts of the two
    /// dequantization scales (0 when unscaled): what the autotuner fills before timing.
    pub operands: [(u64, DType); 3],
    pub scale_lens: [u64; 2],
}

/// Bytes each stored operand (A, B, C, row-major) of `g` spans, `None` where that overflows.
pub fn operand_bytes(g: &GemmDesc) -> [Option<u64>; 3] {
    let batch = g.batch.max(1);
    let (ar, ac) = if g.transpose_a { (g.k, g.m) } else { (g.m, g.k) };
    let (br, bc) = if g.transpose_b { (g.n, g.k) } else { (g.k, g.n) };
    [(ar, ac, g.lda, g.stride_a, g.a_dtype), (br, bc, g.ldb, g.stride_b, g.b_dtype), (g.m, g.n, g.ldc, g.stride_c, g.c_dtype)].map(
        |(rows, cols, ld, stride, dtype)| {
            if rows == 0 || cols == 0 {
                return Some(0);
            }
            (batch - 1)
                .checked_mul(stride)
                .and_then(|x| x.checked_add((rows - 1).checked_mul(ld)?))
                .and_then(|x| x.checked_add(cols))
                .and_then(|x| x.checked_mul(dtype.size_bytes() as u64))
        },
    )
}

fn scale_mode(s: GemmScale) -> i32 {
    match s {
        GemmScale::Vector => sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F as i32,
        _ => sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F as i32,
    }
}

impl GemmPlan {
    /// Build the descriptors of `g` and pick an algorithm that works for pointers aligned to
    /// `align` bytes (A, B, C).
    pub fn new(blas: &Blas, name: &str, g: &GemmDesc, align: [u64; 3]) -> Result<GemmPlan, CudaError> {
        let what = format!("GEMM `{name}`");
        let accumulate = match g.epilogue.as_str() {
            "none" => false,
            GemmDesc::ADD => true,
            other => return Err(CudaError::Call { what, message: format!("epilogue `{other}` is not supported (`none` or `add`); rebuild the artifact") }),
        };
        if g.compute != DType::F32 {
            return Err(CudaError::Call { what, message: format!("compute {} is not supported yet (f32 compute)", g.compute) });
        }
        let fp8 = |d: DType| matches!(d, DType::F8E4M3 | DType::F8E5M2);
        let scaled = !g.scale_a.is_none() || !g.scale_b.is_none();
        if scaled || fp8(g.a_dtype) || fp8(g.b_dtype) {
            if g.scale_a.is_none() || g.scale_b.is_none() || !fp8(g.a_dtype) || !fp8(g.b_dtype) {
                return Err(CudaError::Call {
                    what,
                    message: format!(
                        "an fp8 GEMM needs fp8 inputs with a scale each, found {} x {} with scales {:?} x {:?}; rebuild the artifact",
                        g.a_dtype, g.b_dtype, g.scale_a, g.scale_b
                    ),
                });
            }
            if g.transpose_a || !g.transpose_b {
                return Err(CudaError::Call {
                    what,
                    message: format!(
                        "fp8 GEMMs must be TN (A [m, k], B [n, k]: transpose_a = false, transpose_b = true) on Hopper, found transpose_a {} transpose_b {}; rebuild the artifact with this titanc",
                        g.transpose_a, g.transpose_b
                    ),
                });
            }
            if g.a_dtype == DType::F8E5M2 && g.b_dtype == DType::F8E5M2 {
                return Err(CudaError::Call { what, message: "cuBLASLt has no e5m2 x e5m2 GEMM; quantize one operand to e4m3".into() });
            }
            if g.batch > 1 {
                return Err(CudaError::Call { what, message: format!("batched fp8 GEMMs (batch {}) are not supported yet", g.batch) });
            }
        } else if g.a_dtype != g.b_dtype {
            return Err(CudaError::Call { what, message: format!("mixed inputs {} x {} are not supported yet", g.a_dtype, g.b_dtype) });
        }
        let (ta, tb, tc) = (data_type(g.a_dtype, &what, "A")?, data_type(g.b_dtype, &what, "B")?, data_type(g.c_dtype, &what, "C")?);
        let i64_of =
            |x: u64, f: &str| i64::try_from(x).map_err(|_| CudaError::Call { what: what.clone(), message: format!("`{f}` = {x} is out of cuBLASLt's range") });
        let err = |doing: &str| {
            let what = what.clone();
            let doing = doing.to_string();
            move |e| lt_err(&what, &doing, e)
        };
        // cuBLASLt's A = stored B: [k rows, n cols] col-major when transposed, else [n, k].
        let (ar, ac) = if g.transpose_b { (g.k, g.n) } else { (g.n, g.k) };
        let (br, bc) = if g.transpose_a { (g.m, g.k) } else { (g.k, g.m) };
        let la = lt::create_matrix_layout(tb, ar, ac, i64_of(g.ldb, "ldb")?).map_err(err("layout A"))?;
        let lb = lt::create_matrix_layout(ta, br, bc, i64_of(g.lda, "lda")?).map_err(err("layout B"))?;
        let lc = lt::create_matrix_layout(tc, g.n, g.m, i64_of(g.ldc, "ldc")?).map_err(err("layout C"))?;
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F).map_err(err("matmul descriptor"))?;
        // SAFETY: takes no arguments.
        let version = unsafe { sys::cublasLtGetVersion() };
        // "timed on data": choices timed on random operands (earlier caches timed the arenas'
        // fill patterns, NaN and zeros, whose power draw is not the step's).
        let key = format!("{g:?} align {align:?} cublasLt {version} timed on data");
        let bytes = operand_bytes(g);
        let scale_len = |s: GemmScale, rows: u64| match s {
            GemmScale::None => 0,
            GemmScale::Tensor => 1,
            GemmScale::Vector => rows * g.batch.max(1),
        };
        let mut plan = GemmPlan {
            name: name.to_string(),
            desc,
            la,
            lb,
            lc,
            algo: unsafe_zeroed_algo(),
            candidates: Vec::new(),
            key,
            flops: 2.0 * (g.m * g.n * g.k * g.batch.max(1)) as f64,
            scaled,
            accumulate,
            operands: [(bytes[0].unwrap_or(0), g.a_dtype), (bytes[1].unwrap_or(0), g.b_dtype), (bytes[2].unwrap_or(0), g.c_dtype)],
            scale_lens: [scale_len(g.scale_a, g.m), scale_len(g.scale_b, g.n)],
        };
        let batch = i32::try_from(g.batch.max(1)).map_err(|_| CudaError::Call { what: what.clone(), message: format!("batch {} is too large", g.batch) })?;
        // SAFETY: every descriptor was just created; attribute buffers match their documented types.
        unsafe {
            let op = |t: bool| if t { 1i32 } else { 0i32 };
            let set_op = |attr, v: i32| lt::set_matmul_desc_attribute(desc, attr, &v as *const i32 as *const c_void, 4);
            set_op(sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, op(g.transpose_b)).map_err(err("setting TRANSA"))?;
            set_op(sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, op(g.transpose_a)).map_err(err("setting TRANSB"))?;
            if scaled {
                use sys::cublasLtMatmulDescAttributes_t as D;
                // cuBLASLt's A is the stored B (scaled per column of C), its B the stored A.
                set_op(D::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, scale_mode(g.scale_b)).map_err(err("setting the A scale mode"))?;
                set_op(D::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, scale_mode(g.scale_a)).map_err(err("setting the B scale mode"))?;
                let fast = i8::from(g.fast_accum);
                lt::set_matmul_desc_attribute(desc, D::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast as *const i8 as *const c_void, 1)
                    .map_err(err("setting fast accumulation"))?;
            }
            for (l, stride) in [(la, g.stride_b), (lb, g.stride_a), (lc, g.stride_c)] {
                lt::set_matrix_layout_attribute(
                    l,
                    sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                    &batch as *const i32 as *const c_void,
                    4,
                )
                .map_err(err("setting the batch count"))?;
                let s = i64_of(stride, "stride")?;
                lt::set_matrix_layout_attribute(
                    l,
                    sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                    &s as *const i64 as *const c_void,
                    8,
                )
                .map_err(err("setting the batch stride"))?;
            }
            let pref = lt::create_matmul_pref().map_err(err("preference creation"))?;
            let ws: u64 = WORKSPACE_BYTES;
            let r = (|| {
                lt::set_matmul_pref_attribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &ws as *const u64 as *const c_void,
                    8,
                )
                .map_err(err("setting the workspace size"))?;
                use sys::cublasLtMatmulPreferenceAttributes_t as P;
                // cuBLASLt's A is the stored B, its B the stored A.
                for (attr, a) in [
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align[1]),
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align[0]),
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align[2]),
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align[2]),
                ] {
                    let a = a.clamp(1, 256) as u32;
                    lt::set_matmul_pref_attribute(pref, attr, &a as *const u32 as *const c_void, 4).map_err(err("setting an alignment"))?;
                }
                let want = max_candidates();
                let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> = (0..want).map(|_| std::mem::zeroed()).collect();
                let mut found = 0i32;
                let r = sys::cublasLtMatmulAlgoGetHeuristic(blas.handle, desc, la, lb, lc, lc, pref, want as i32, results.as_mut_ptr(), &mut found).result();
                let algos: Vec<sys::cublasLtMatmulAlgo_t> =
                    results.iter().take(found.max(0) as usize).filter(|h| h.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS).map(|h| h.algo).collect();
                if r.is_err() || algos.is_empty() {
                    return Err(CudaError::Call {
                        what: what.clone(),
                        message: format!(
                            "cuBLASLt has no algorithm for m {} n {} k {} batch {} ({} x {} -> {}, transpose_a {}, transpose_b {}, alignment {:?}): {:?}",
                            g.m,
                            g.n,
                            g.k,
                            g.batch,
                            g.a_dtype,
                            g.b_dtype,
                            g.c_dtype,
                            g.transpose_a,
                            g.transpose_b,
                            align,
                            r.err().map(|e| e.0)
                        ),
                    });
                }
                Ok(algos)
            })();
            let _ = lt::destroy_matmul_pref(pref);
            // A refused fp8 GEMM says which scale modes and accumulation cuBLASLt does accept
            // for this shape, so one run on the device tells what to change.
            let r = match r {
                Err(CudaError::Call { what, message }) if scaled => {
                    Err(CudaError::Call { what, message: format!("{message}; {}", fp8_probe(blas, la, lb, lc, g)) })
                }
                other => other,
            };
            plan.candidates = r?;
            plan.algo = plan.candidates[0];
        }
        Ok(plan)
    }

    /// How many algorithms the heuristic offered (at most [`max_candidates`]).
    pub fn candidates(&self) -> usize {
        self.candidates.len()
    }

    /// Use candidate `i` (0 is the heuristic's first choice).
    pub fn choose(&mut self, i: usize) {
        if let Some(a) = self.candidates.get(i) {
            self.algo = *a;
        }
    }

    /// Enqueue `C = A @ B` on `stream` (device pointers), or `C = A @ B + c_in` for the
    /// residual-add epilogue (`c_in` then holds a matrix of C's layout; ignored otherwise);
    /// `scales` are the dequantization scales of A and B for a scaled fp8 GEMM (ignored
    /// otherwise).
    pub fn run(
        &self,
        blas: &Blas,
        [a, b, c]: [u64; 3],
        c_in: u64,
        scales: [u64; 2],
        workspace: u64,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), lt::CublasError> {
        let (alpha, beta) = (1.0f32, if self.accumulate { 1.0f32 } else { 0.0f32 });
        let c_src = if self.accumulate { c_in } else { c };
        // SAFETY: the descriptors are alive, the pointers hold the shapes the plan was made for
        // (checked against the kernel's body types when the artifact was loaded); a scale
        // pointer attribute is a `void*` (8 bytes) read when the call is enqueued.
        unsafe {
            if self.scaled {
                use sys::cublasLtMatmulDescAttributes_t as D;
                for (attr, p) in [(D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scales[1]), (D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, scales[0])] {
                    lt::set_matmul_desc_attribute(self.desc, attr, &p as *const u64 as *const c_void, 8)?;
                }
            }
            lt::matmul(
                blas.handle,
                self.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                b as *const c_void,
                self.la,
                a as *const c_void,
                self.lb,
                c_src as *const c_void,
                self.lc,
                c as *mut c_void,
                self.lc,
                &self.algo,
                workspace as *mut c_void,
                WORKSPACE_BYTES as usize,
                stream as sys::cudaStream_t,
            )
        }
    }
}

/// Which of {scalar, outer-vector} scales x {fast accumulation on, off} the heuristic finds an
/// algorithm for, on `g`'s layouts with a bare TN descriptor (no alignment preferences).
fn fp8_probe(blas: &Blas, la: sys::cublasLtMatrixLayout_t, lb: sys::cublasLtMatrixLayout_t, lc: sys::cublasLtMatrixLayout_t, g: &GemmDesc) -> String {
    use sys::cublasLtMatmulDescAttributes_t as D;
    let mut out = Vec::new();
    for (mode_name, mode) in [("scalar", GemmScale::Tensor), ("outer-vector", GemmScale::Vector)] {
        for fast in [true, false] {
            // SAFETY: a descriptor and preference created, used and destroyed here; attribute
            // buffers match their documented types.
            let found = unsafe {
                let Ok(desc) = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F) else {
                    return "cuBLASLt could not create a probe descriptor".into();
                };
                let set = |attr, v: i32| lt::set_matmul_desc_attribute(desc, attr, &v as *const i32 as *const c_void, 4);
                let fast_v = i8::from(fast);
                let ok = set(D::CUBLASLT_MATMUL_DESC_TRANSA, i32::from(g.transpose_b)).is_ok()
                    && set(D::CUBLASLT_MATMUL_DESC_TRANSB, i32::from(g.transpose_a)).is_ok()
                    && set(D::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, scale_mode(mode)).is_ok()
                    && set(D::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, scale_mode(mode)).is_ok()
                    && lt::set_matmul_desc_attribute(desc, D::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_v as *const i8 as *const c_void, 1).is_ok();
                let mut found = -1i32;
                if ok && let Ok(pref) = lt::create_matmul_pref() {
                    let ws: u64 = WORKSPACE_BYTES;
                    let _ = lt::set_matmul_pref_attribute(
                        pref,
                        sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        &ws as *const u64 as *const c_void,
                        8,
                    );
                    let mut res: sys::cublasLtMatmulHeuristicResult_t = std::mem::zeroed();
                    let mut n = 0i32;
                    let st = sys::cublasLtMatmulAlgoGetHeuristic(blas.handle, desc, la, lb, lc, lc, pref, 1, &mut res, &mut n).result();
                    found = if st.is_ok() { n } else { -1 };
                    let _ = lt::destroy_matmul_pref(pref);
                }
                let _ = lt::destroy_matmul_desc(desc);
                found
            };
            let verdict = if found > 0 { "ok" } else { "refused" };
            out.push(format!("{mode_name} scales, fast accumulation {}: {verdict}", if fast { "on" } else { "off" }));
        }
    }
    format!("probe: {}", out.join(", "))
}

fn unsafe_zeroed_algo() -> sys::cublasLtMatmulAlgo_t {
    // SAFETY: a plain-data struct of integers; overwritten by the heuristic before any use.
    unsafe { std::mem::zeroed() }
}

impl Drop for GemmPlan {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.la);
            let _ = lt::destroy_matrix_layout(self.lb);
            let _ = lt::destroy_matrix_layout(self.lc);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// The largest power of two (at most 256) dividing `x` (256 for 0).
pub fn pow2_align(x: u64) -> u64 {
    if x == 0 { 256 } else { (1u64 << x.trailing_zeros()).min(256) }
}
