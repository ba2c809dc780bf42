//! The GEMMs' operands and algorithms: each GEMM launch's operands checked against what its
//! description addresses, the alignment its cuBLASLt plan is built for, and the autotuning that
//! times each plan's candidate algorithms once per device and caches the choice on disk.

use titan_ir::artifact::{Kernel, Step};
use titan_ir::op::KernelKind;

use super::bad;
use super::driver::{Event, Gpu};
use super::gemm::pow2_align;
use super::module::{Loaded, LoadedCode};
use super::unroll::{Arenas, Frame};
use crate::RuntimeError;

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

impl LoadedCode {
    /// Pick each GEMM plan's algorithm among the heuristic's candidates by timing them on the
    /// operands of the plan's first launch (`first`, by kernel position; the arenas hold no
    /// state yet, and GEMMs only write activations and gradients), fastest of 3 calls after a
    /// warm-up. Choices are cached per device and cuBLASLt version
    /// ([`gemm_cache_file`]), so later runs reuse them and stay bitwise reproducible.
    /// `TITAN_GEMM_AUTOTUNE=0` keeps the heuristic's first choice. Returns a summary line.
    pub(super) fn autotune_gemms(&mut self, gpu: &Gpu, first: &[Option<GemmPtrs>]) -> Result<Option<String>, RuntimeError> {
        if std::env::var("TITAN_GEMM_AUTOTUNE").is_ok_and(|v| v == "0") || self.plans.is_empty() {
            return Ok(None);
        }
        let cache_file = gemm_cache_file(&gpu.name);
        let mut cache: std::collections::BTreeMap<String, usize> =
            cache_file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()).and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
        // The operands of each plan's first launch.
        let mut operands: Vec<Option<GemmPtrs>> = vec![None; self.plans.len()];
        for (pos, k) in self.kernels.iter().enumerate() {
            if let (Loaded::Gemm { plan }, Some(p)) = (k, first.get(pos).copied().flatten()) {
                operands[*plan].get_or_insert(p);
            }
        }
        let (start, stop) = (Event::new()?, Event::new()?);
        let (mut timed, mut cached, mut changed) = (0, 0, 0);
        for (i, plan) in self.plans.iter_mut().enumerate() {
            let n = plan.candidates();
            let Some((abc, scales)) = operands[i] else { continue };
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
                if plan.run(&self.blas, abc, scales, self.blas_workspace.ptr, gpu.stream).is_err() {
                    continue;
                }
                gpu.record(&start)?;
                let ok = (0..3).all(|_| plan.run(&self.blas, abc, scales, self.blas_workspace.ptr, gpu.stream).is_ok());
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
}

/// A GEMM launch's device pointers: A, B, C and the scales of A and B (0 when unscaled).
pub(super) type GemmPtrs = ([u64; 3], [u64; 2]);

/// Check that a GEMM's operands hold what its description addresses (so cuBLASLt never reads or
/// writes outside a buffer), given the byte sizes the schedule binds.
pub(super) fn check_gemm_extent(k: &Kernel, g: &titan_ir::artifact::GemmDesc, bound: [u64; 3]) -> Result<(), RuntimeError> {
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

/// Walk the schedule's GEMM launches: check their extents and record the smallest
/// power-of-two alignment of each operand.
pub(super) fn gemm_operands(
    arenas: &Arenas<'_>,
    steps: &[Step],
    frame: Option<Frame<'_>>,
    align: &mut [[u64; 3]],
    first: &mut [Option<GemmPtrs>],
) -> Result<(), RuntimeError> {
    for step in steps {
        match step {
            Step::Launch { kernel, inputs, outputs, .. } => {
                let Some(pos) = arenas.kernel_pos(*kernel) else { continue };
                let k = &arenas.kernels()[pos];
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
                // A scaled GEMM's dequantization scales (inputs 2 and 3, or 2 twice).
                let mut scales = [0u64; 2];
                for (j, r) in [inputs.get(2), inputs.get(3).or(inputs.get(2))].into_iter().enumerate() {
                    if let Some(r) = r {
                        scales[j] = arenas.view(r, frame)?.0;
                    }
                }
                first[pos].get_or_insert((ptrs, scales));
            }
            Step::Loop { count, reverse, carries, body, prefetch } => {
                for run in titan_ir::artifact::loop_runs(*count, *reverse, !prefetch.is_empty()) {
                    let steps = if run.prefetch { prefetch } else { body };
                    gemm_operands(arenas, steps, Some(Frame { layer: run.layer, t: run.t, carries }), align, first)?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}
