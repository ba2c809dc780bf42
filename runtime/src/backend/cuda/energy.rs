//! `titan-run --kernel-energy`: each kernel that matters run back to back at the GPU's power cap,
//! with its time, energy and clock there.
//!
//! Why: the H100 and H200 run the training step at their 700 W cap (docs/notes.md, Runtime), so
//! the limiter sets the clock and a kernel's share of the step follows its energy more than its
//! latency on a cool GPU (what `--profile`'s eager step and a 20-launch burst measure). Sustained,
//! every kernel runs at the cap (or at its own clock limit, if it draws less), so joules per launch
//! say what it costs the step and compare across kernels and frameworks
//! (`bench/attention_table.py --sustain` does the same for the attention kernels against PyTorch's,
//! with the same protocol: 1 s to settle, then the window measured).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use titan_ir::KernelKind;

use super::driver::{CudaError, Gpu};
use super::nvml::Nvml;
use crate::artifact::Artifact;
use crate::backend::KernelTime;

/// Seconds a kernel runs back to back before its window, for the limiter to settle.
const SETTLE_S: f64 = 1.0;

/// One kernel sustained: time and energy per launch, mean power, median SM clock.
#[derive(Clone, Copy, Debug)]
pub struct Held {
    pub seconds: f64,
    pub joules: f64,
    pub watts: f64,
    pub mhz: f64,
}

/// Run `launch` back to back: [`SETTLE_S`] (sized by `burst_s`, a launch's time in the profile),
/// a drain of the queue, then `window_s` between two readings of the energy counter while a
/// thread samples the SM clock every 50 ms.
pub fn sustain(gpu: &Gpu, nvml: &Nvml, burst_s: f64, window_s: f64, launch: &dyn Fn() -> Result<(), CudaError>) -> Result<Held, CudaError> {
    let burst_s = burst_s.max(1e-6);
    for _ in 0..(SETTLE_S / burst_s).ceil().max(1.0) as u64 {
        launch()?;
    }
    gpu.sync(|| "settling a kernel for --kernel-energy".into())?;
    let n = (window_s / burst_s).ceil().max(4.0) as u64;
    let stop = AtomicBool::new(false);
    std::thread::scope(|sc| {
        let sampler = sc.spawn(|| {
            let mut clocks = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                if let Ok(c) = nvml.sm_mhz() {
                    clocks.push(c);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            clocks
        });
        let measured = (|| {
            let e0 = nvml.energy_mj()?;
            let t0 = Instant::now();
            for _ in 0..n {
                launch()?;
            }
            gpu.sync(|| "a kernel's --kernel-energy window".into())?;
            Ok::<_, CudaError>((nvml.energy_mj()? - e0, t0.elapsed().as_secs_f64()))
        })();
        stop.store(true, Ordering::Relaxed);
        let mut clocks = sampler.join().unwrap_or_default();
        let (mj, wall) = measured?;
        clocks.sort_unstable();
        let mhz = match clocks.get(clocks.len() / 2) {
            Some(&c) => f64::from(c),
            None => f64::from(nvml.sm_mhz()?),
        };
        let joules = mj as f64 / 1e3;
        Ok(Held { seconds: wall / n as f64, joules: joules / n as f64, watts: joules / wall, mhz })
    })
}

/// The class a kernel's time counts under in the benchmarks' per-class breakdown
/// (`bench/torch/llama_baseline.py`'s `kernel_group`).
pub fn class(k: &titan_ir::artifact::Kernel) -> &'static str {
    match k.kind {
        _ if k.gemm.is_some() => "gemm",
        KernelKind::Gemm => "gemm",
        KernelKind::Attention | KernelKind::AttentionBwd => "attention",
        KernelKind::Optimizer => "optimizer",
        _ => "other",
    }
}

/// The kernels to measure: the most expensive first until `share` of the profiled kernel time.
pub fn chosen(times: &[KernelTime], share: f64) -> Vec<usize> {
    let total: f64 = times.iter().map(|t| t.seconds).sum();
    let mut order: Vec<usize> = (0..times.len()).filter(|&k| times[k].launches > 0).collect();
    order.sort_by(|a, b| times[*b].seconds.total_cmp(&times[*a].seconds));
    let mut covered = 0.0;
    order
        .into_iter()
        .take_while(|&k| {
            let take = covered < share * total;
            covered += times[k].seconds;
            take
        })
        .collect()
}

/// The report: per kernel, its joules per step (launches per step x joules per launch), burst and
/// sustained milliseconds per launch, watts, MHz; then per class.
pub fn report(artifact: &Artifact, times: &[KernelTime], steps: u64, window_s: f64, held: &[(usize, Held)]) -> String {
    use std::fmt::Write;
    let steps = steps.max(1) as f64;
    let total_ms: f64 = 1e3 * times.iter().map(|t| t.seconds).sum::<f64>() / steps;
    let kernels = &artifact.manifest.kernels;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "titan-run: --kernel-energy: the kernels of {:.0}% of the profiled kernel time, each back to back ({SETTLE_S} s to settle, {window_s} s measured; NVML's energy counter, median SM clock):",
        100.0 * held.iter().map(|(k, _)| times[*k].seconds).sum::<f64>() / steps / (total_ms / 1e3).max(1e-12)
    );
    let _ = writeln!(out, "  {:>8} {:>8} {:>10} {:>10} {:>10} {:>6} {:>6}  kernel (kind)", "J/step", "launches", "burst ms", "held ms", "J/launch", "W", "MHz");
    let mut by_class: Vec<(&str, f64, f64, f64)> = Vec::new();
    for (k, h) in held {
        let per_step = times[*k].launches as f64 / steps;
        let burst_ms = 1e3 * times[*k].seconds / times[*k].launches.max(1) as f64;
        let _ = writeln!(
            out,
            "  {:>8.2} {:>8.0} {:>10.3} {:>10.3} {:>10.4} {:>6.0} {:>6.0}  {} ({})",
            h.joules * per_step,
            per_step,
            burst_ms,
            1e3 * h.seconds,
            h.joules,
            h.watts,
            h.mhz,
            kernels[*k].name,
            kernels[*k].kind.name()
        );
        let c = class(&kernels[*k]);
        let row = match by_class.iter_mut().find(|r| r.0 == c) {
            Some(r) => r,
            None => {
                by_class.push((c, 0.0, 0.0, 0.0));
                by_class.last_mut().expect("just pushed")
            }
        };
        row.1 += h.joules * per_step;
        row.2 += 1e3 * h.seconds * per_step;
        row.3 += burst_ms * per_step;
    }
    by_class.sort_by(|a, b| b.1.total_cmp(&a.1));
    let joules: f64 = by_class.iter().map(|r| r.1).sum();
    let held_ms: f64 = by_class.iter().map(|r| r.2).sum();
    let burst_ms: f64 = by_class.iter().map(|r| r.3).sum();
    let parts: Vec<String> = by_class.iter().map(|(c, j, ms, b)| format!("{c} {j:.2} J ({ms:.1} ms held, {b:.1} ms burst)")).collect();
    let _ = writeln!(
        out,
        "titan-run: --kernel-energy: measured kernels {joules:.2} J per step, {held_ms:.1} ms held ({burst_ms:.1} ms in the profile of {total_ms:.1}): {}",
        parts.join(", ")
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chosen_takes_the_most_expensive_until_the_share() {
        let t = |s: f64, l: u64| KernelTime { seconds: s, launches: l };
        let times = [t(1.0, 1), t(5.0, 2), t(0.0, 0), t(3.0, 1), t(1.0, 4)];
        // 10 s in all: 5 (50%), then 3 (80%), then the first 1 s kernel reaches 90%.
        assert_eq!(chosen(&times, 0.85), vec![1, 3, 0]);
        assert_eq!(chosen(&times, 0.5), vec![1]);
        assert_eq!(chosen(&times, 1.0), vec![1, 3, 0, 4]);
        assert!(chosen(&[t(0.0, 0)], 0.99).is_empty());
    }
}
