//! The GEMMs' operands and algorithms: each GEMM launch's operands checked against what its
//! description addresses, the alignment its cuBLASLt plan is built for, and the autotuning that
//! times each plan's candidate algorithms once per device and caches the choice on disk.

use titan_ir::artifact::{Kernel, Step};
use titan_ir::op::KernelKind;

use super::bad;
use super::driver::{Event, Gpu};
use super::gemm::{operand_bytes, pow2_align};
use super::module::{Loaded, LoadedCode};
use super::unroll::{Arenas, Frame};
use crate::RuntimeError;

/// How the GEMMs' algorithms are chosen: `TITAN_GEMM_AUTOTUNE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TuneMode {
    /// Unset or `0`: cuBLASLt's first heuristic choice, nothing timed. The default: on the H200
    /// under its 700 W cap neither timing picked faster steps (timed over 3 calls: 8b-4l 0.7%
    /// slower, 1B the same; timed sustained at the capped clock: 1B 0.8% slower, 8b-4l the same;
    /// docs/performance.md, session 16), and timing made a machine's first start-up 0.8-1.5 s
    /// longer.
    Off,
    /// `1`: the fastest of the candidates over [`TIMED_CALLS`] calls each.
    Quick,
}

impl TuneMode {
    pub(super) fn from_env() -> Result<TuneMode, RuntimeError> {
        Self::parse(std::env::var("TITAN_GEMM_AUTOTUNE").ok().as_deref())
    }

    fn parse(value: Option<&str>) -> Result<TuneMode, RuntimeError> {
        match value {
            None | Some("0") | Some("") => Ok(TuneMode::Off),
            Some("1") => Ok(TuneMode::Quick),
            Some(v) => Err(bad(format!(
                "TITAN_GEMM_AUTOTUNE={v}: expected 0 (cuBLASLt's first heuristic choice, the default) or 1 (time the candidates, keep the fastest)"
            ))),
        }
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

impl LoadedCode {
    /// Pick each GEMM plan's algorithm among the heuristic's candidates by timing them on the
    /// operands of the plan's first launch (`first`, by kernel position; the arenas hold no
    /// state yet, and GEMMs only write activations and gradients), as `mode` says
    /// ([`TuneMode`]; `Off` keeps the heuristic's first choice and returns `None`). Choices are
    /// cached per device and cuBLASLt version ([`gemm_cache_file`]), so later runs reuse them
    /// and stay bitwise reproducible. Returns a summary line.
    pub(super) fn autotune_gemms(&mut self, gpu: &Gpu, first: &[Option<GemmPtrs>], mode: TuneMode) -> Result<Option<Tuned>, RuntimeError> {
        if mode == TuneMode::Off || self.plans.is_empty() {
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
        // The plans to time get operands of the step's kind first: the arenas hold their fill
        // patterns (NaN activations, zero gradients), and under the power cap a GEMM's clock
        // depends on its operands' values.
        let mut patterns = Vec::new();
        for (i, plan) in self.plans.iter_mut().enumerate() {
            let n = plan.candidates();
            let Some((abc, scales, c_in)) = operands[i] else { continue };
            if n < 2 {
                continue;
            }
            if let Some(&pick) = cache.get(&plan.key).filter(|&&p| p < n) {
                plan.choose(pick);
                cached += 1;
                continue;
            }
            fill_operands(gpu, plan, abc, c_in, scales, &mut patterns)?;
            let mut best: Option<(f32, usize)> = None;
            for cand in 0..n {
                plan.choose(cand);
                // A candidate that fails to run is skipped.
                if plan.run(&self.blas, abc, c_in, scales, self.blas_workspace.ptr, gpu.stream).is_err() {
                    continue;
                }
                gpu.record(&start)?;
                let ok = (0..TIMED_CALLS).all(|_| plan.run(&self.blas, abc, c_in, scales, self.blas_workspace.ptr, gpu.stream).is_ok());
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
        let line = format!(
            "GEMM algorithms: {} plans, {timed} timed ({changed} faster than the heuristic's first choice), {cached} from the cache{}",
            self.plans.len(),
            cache_file.map_or(String::new(), |f| format!(" `{}`", f.display()))
        );
        Ok(Some(Tuned { line, filled: timed > 0 }))
    }
}

/// Back-to-back calls timed per candidate. 40 (candidates timed in the power-capped regime of
/// the step rather than a short burst's clock) picked differently for 23 of 1B's and 8b-4l's
/// 38 shapes and did not change either step rate (docs/performance.md, session 15).
const TIMED_CALLS: usize = 3;

/// What [`LoadedCode::autotune_gemms`] did: its summary line, and whether it wrote timing data
/// into the arenas (the caller restores their fill patterns).
pub(super) struct Tuned {
    pub line: String,
    pub filled: bool,
}

/// Values for timing a GEMM of `dtype`: about normal with unit variance (the sum of four
/// uniforms, fixed seed), encoded; for fp8, random codes with the exponent's top bit cleared
/// (no NaN or infinity: magnitudes up to 1.875 in e4m3 and 1.75 in e5m2), as quantized
/// operands spread over their code range.
fn timing_pattern(dtype: titan_ir::DType, bytes: usize) -> Vec<u8> {
    use titan_ir::DType;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut normal = move || {
        let r = next();
        let sum: f32 = (0..4).map(|i| ((r >> (16 * i)) & 0xffff) as f32 / 65536.0).sum();
        (sum - 2.0) * 1.732_050_8
    };
    let mut out = Vec::with_capacity(bytes);
    while out.len() < bytes {
        match dtype {
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(normal()).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(normal()).to_le_bytes()),
            DType::F32 => out.extend_from_slice(&normal().to_le_bytes()),
            _ => out.push((normal().to_bits() >> 16) as u8 & 0xbf),
        }
    }
    out.truncate(bytes);
    out
}

/// Fill a plan's A, B (and the C input of the residual-add epilogue) with [`timing_pattern`]
/// data (one 16 MiB upload, then doubling copies on the device) and its dequantization scales
/// with 1.0.
fn fill_operands(
    gpu: &Gpu,
    plan: &super::gemm::GemmPlan,
    abc: [u64; 3],
    c_in: u64,
    scales: [u64; 2],
    patterns: &mut Vec<(titan_ir::DType, Vec<u8>)>,
) -> Result<(), RuntimeError> {
    const PATTERN: usize = 16 << 20;
    let c_operand = if plan.accumulate && c_in != 0 { plan.operands[2] } else { (0, plan.operands[2].1) };
    for ((bytes, dtype), ptr) in [plan.operands[0], plan.operands[1], c_operand].into_iter().zip([abc[0], abc[1], c_in]) {
        let first = bytes.min(PATTERN as u64);
        if first == 0 {
            continue;
        }
        let what = || format!("filling an operand of GEMM `{}` to time its algorithms", plan.name);
        let at = match patterns.iter().position(|(d, _)| *d == dtype) {
            Some(i) => i,
            None => {
                patterns.push((dtype, timing_pattern(dtype, PATTERN)));
                patterns.len() - 1
            }
        };
        gpu.upload_sync(ptr, &patterns[at].1[..first as usize], what)?;
        let mut done = first;
        while done < bytes {
            let n = done.min(bytes - done);
            gpu.copy(ptr + done, ptr, n as usize, what)?;
            done += n;
        }
    }
    for (len, ptr) in plan.scale_lens.into_iter().zip(scales) {
        if len > 0 && ptr != 0 {
            let ones: Vec<u8> = (0..len).flat_map(|_| 1.0f32.to_le_bytes()).collect();
            gpu.upload_sync(ptr, &ones, || format!("filling a scale of GEMM `{}` to time its algorithms", plan.name))?;
        }
    }
    Ok(())
}

/// A GEMM launch's device pointers: A, B, C (the output), the scales of A and B (0 when
/// unscaled) and the C input of the residual-add epilogue (0 without one).
pub(super) type GemmPtrs = ([u64; 3], [u64; 2], u64);

/// Check that a GEMM's operands hold what its description addresses (so cuBLASLt never reads or
/// writes outside a buffer), given the byte sizes the schedule binds.
pub(super) fn check_gemm_extent(k: &Kernel, g: &titan_ir::artifact::GemmDesc, bound: [u64; 3]) -> Result<(), RuntimeError> {
    let cols = [if g.transpose_a { g.m } else { g.k }, if g.transpose_b { g.k } else { g.n }, g.n];
    let need = operand_bytes(g);
    for ((((name, ld), cols), need), have) in ["A", "B", "C"].into_iter().zip([g.lda, g.ldb, g.ldc]).zip(cols).zip(need).zip(bound) {
        if ld < cols {
            return Err(bad(format!("GEMM `{}`: operand {name} has leading dimension {ld} below its {cols} columns; rebuild the artifact", k.name)));
        }
        if need.is_none_or(|n| n > have) {
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
                let mut scales = [0u64; 2];
                let mut c_in = 0u64;
                if g.adds_input() {
                    // The residual-add epilogue's C input (input 2) has the output's layout.
                    let r = inputs.get(2).ok_or_else(|| bad(format!("GEMM `{}` adds its input 2, which the schedule does not bind", k.name)))?;
                    let (p, len) = arenas.view(r, frame)?;
                    check_gemm_extent(k, g, [bound[0], bound[1], len])?;
                    align[pos][2] = align[pos][2].min(pow2_align(p));
                    c_in = p;
                } else {
                    // A scaled GEMM's dequantization scales (inputs 2 and 3, or 2 twice).
                    for (j, r) in [inputs.get(2), inputs.get(3).or(inputs.get(2))].into_iter().enumerate() {
                        if let Some(r) = r {
                            scales[j] = arenas.view(r, frame)?.0;
                        }
                    }
                }
                first[pos].get_or_insert((ptrs, scales, c_in));
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

#[cfg(test)]
mod tests {
    use titan_ir::DType;
    use titan_ir::artifact::GemmDesc;

    use super::super::gemm::operand_bytes;
    use super::{TuneMode, timing_pattern};

    /// `TITAN_GEMM_AUTOTUNE`: off by default, `1` times, anything else is refused with the values
    /// it takes.
    #[test]
    fn the_autotune_setting_is_off_unless_asked_for() {
        assert_eq!(TuneMode::parse(None).unwrap(), TuneMode::Off);
        assert_eq!(TuneMode::parse(Some("0")).unwrap(), TuneMode::Off);
        assert_eq!(TuneMode::parse(Some("1")).unwrap(), TuneMode::Quick);
        let e = TuneMode::parse(Some("yes")).unwrap_err().to_string();
        assert!(e.contains("TITAN_GEMM_AUTOTUNE=yes") && e.contains("expected 0"), "{e}");
    }

    /// The values the autotuner times on are finite, about zero-mean and unit-variance in the
    /// float dtypes; fp8 codes are never NaN or infinite.
    #[test]
    fn timing_patterns_are_finite_data() {
        let n = 1 << 16;
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let bytes = timing_pattern(dtype, n * dtype.size_bytes());
            let xs: Vec<f64> = match dtype {
                DType::BF16 => bytes.chunks(2).map(|c| f64::from(half::bf16::from_le_bytes([c[0], c[1]]).to_f32())).collect(),
                DType::F16 => bytes.chunks(2).map(|c| f64::from(half::f16::from_le_bytes([c[0], c[1]]).to_f32())).collect(),
                _ => bytes.chunks(4).map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect(),
            };
            assert!(xs.iter().all(|x| x.is_finite()), "{dtype}");
            let mean = xs.iter().sum::<f64>() / n as f64;
            let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
            assert!(mean.abs() < 0.02 && (0.9..1.1).contains(&var), "{dtype}: mean {mean}, variance {var}");
            let distinct: std::collections::BTreeSet<u64> = xs.iter().map(|x| x.to_bits()).collect();
            assert!(distinct.len() > 1000, "{dtype}: {} distinct values", distinct.len());
        }
        // NaN in e4m3 is S.1111.111; infinity and NaN in e5m2 have the exponent 11111.
        for (dtype, special) in [(DType::F8E4M3, 0x7fu8), (DType::F8E5M2, 0x7c)] {
            let codes = timing_pattern(dtype, n);
            assert!(!codes.iter().any(|&b| b & special == special), "{dtype}: a NaN or infinity code");
            let distinct: std::collections::BTreeSet<u8> = codes.iter().copied().collect();
            assert!(distinct.len() >= 100, "{dtype}: {} distinct codes", distinct.len());
        }
        assert_eq!(timing_pattern(DType::BF16, 7).len(), 7);
    }

    fn desc(m: u64, n: u64, k: u64) -> GemmDesc {
        GemmDesc {
            m,
            n,
            k,
            batch: 1,
            transpose_a: false,
            transpose_b: false,
            lda: k,
            ldb: n,
            ldc: n,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            a_dtype: DType::BF16,
            b_dtype: DType::BF16,
            c_dtype: DType::F32,
            compute: DType::F32,
            epilogue: "none".into(),
            scale_a: Default::default(),
            scale_b: Default::default(),
            fast_accum: false,
        }
    }

    /// What each stored operand spans: rows x leading dimension up to the last row's end, over
    /// the batch, in bytes of its dtype; transposed operands are stored the other way round.
    #[test]
    fn operand_bytes_follow_the_stored_layout() {
        assert_eq!(operand_bytes(&desc(8, 16, 32)), [Some(8 * 32 * 2), Some(32 * 16 * 2), Some(8 * 16 * 4)]);
        // A transposed ([k, m] stored, ld 10 >= m 8), B transposed ([n, k], ld 40), batch 3.
        let g = GemmDesc {
            transpose_a: true,
            transpose_b: true,
            lda: 10,
            ldb: 40,
            ldc: 20,
            batch: 3,
            stride_a: 400,
            stride_b: 1000,
            stride_c: 200,
            ..desc(8, 16, 32)
        };
        assert_eq!(operand_bytes(&g), [Some((2 * 400 + 31 * 10 + 8) * 2), Some((2 * 1000 + 15 * 40 + 32) * 2), Some((2 * 200 + 7 * 20 + 16) * 4)]);
        assert_eq!(operand_bytes(&desc(0, 16, 32))[0], Some(0));
        let huge = GemmDesc { lda: u64::MAX / 2, ..desc(8, 16, 32) };
        assert_eq!(operand_bytes(&huge)[0], None);
    }
}
