//! What `titan-run` prints: the per-step log line in TorchTitan's shape (stdout), the `--metrics`
//! JSON lines, the start-up summary and, for long runs on a terminal, a progress bar on stderr
//! (hidden when stderr is not a terminal, so logs and tests stay clean).

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::artifact::{Artifact, arena_name, format_bytes};
use crate::backend::StepMetrics;

/// Runs of at least this many steps get a progress bar.
pub const LONG_RUN_STEPS: u64 = 10;

/// Peak dense bf16 throughput of an H100/H200 SXM in TFLOP/s, the MFU denominator (as
/// TorchTitan uses).
pub const PEAK_BF16_TFLOPS: f64 = 989.0;

/// Device memory of one H200 in bytes (141 GB), the denominator of the memory percentage.
pub const H200_MEMORY_BYTES: u64 = 141_000_000_000;

/// What the per-step line needs beyond the step's own metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LogContext {
    /// Model FLOPs per token (`6 N + 12 L H Dh T`); without it the line has no tflops or mfu.
    pub flops_per_token: Option<u64>,
    /// The device's memory in bytes when the backend runs on a GPU: the peak is printed as a
    /// percentage of it. `None` on the CPU backend, where the peak is the plan's prediction.
    pub device_memory_bytes: Option<u64>,
}

impl LogContext {
    /// Model TFLOP/s at `tokens_per_s`.
    pub fn tflops(&self, tokens_per_s: f64) -> Option<f64> {
        self.flops_per_token.map(|f| f as f64 * tokens_per_s / 1e12)
    }

    /// Model FLOPs utilization in percent of [`PEAK_BF16_TFLOPS`].
    pub fn mfu_percent(&self, tokens_per_s: f64) -> Option<f64> {
        self.tflops(tokens_per_s).map(|t| 100.0 * t / PEAK_BF16_TFLOPS)
    }
}

/// `21345.4` as `21,345`.
pub fn with_commas(x: f64) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    let s = format!("{:.0}", x.abs());
    let mut out = String::with_capacity(s.len() + s.len() / 3 + 1);
    if x < -0.5 {
        out.push('-');
    }
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The per-step log line in TorchTitan's shape without FLOPs (see [`format_step_with`]).
pub fn format_step(m: &StepMetrics) -> String {
    format_step_with(m, &LogContext::default())
}

/// The per-step log line in TorchTitan's shape:
/// `step: 10  loss:  2.4521  grad_norm:  0.4300  memory: 5.42MiB(3.83%)  tps: 21,345  tflops: 0.01  mfu: 0.00%`.
/// Memory is the measured peak device memory when the backend measures one (a GPU:
/// `memory: 61.20GiB(43.41%, predicted 58.00GiB)`), else the memory plan's predicted peak: as a
/// share of the device on a GPU, marked `(predicted)` on the CPU backend; absent in graph mode.
/// tflops and mfu need FLOPs per token.
/// Slow steps (under 100 tokens/s) keep a few decimals of tps.
pub fn format_step_with(m: &StepMetrics, ctx: &LogContext) -> String {
    let mut line = format!("step: {:>2}  loss: {:>7.4}  grad_norm: {:>7.4}", m.step, m.loss, m.grad_norm);
    if let (Some(measured), Some(total)) = (m.measured_peak_bytes, ctx.device_memory_bytes.filter(|&t| t > 0)) {
        let mem = format_bytes(measured).replace(' ', "");
        let predicted = m.peak_bytes.map(|p| format!(", predicted {}", format_bytes(p).replace(' ', ""))).unwrap_or_default();
        line.push_str(&format!("  memory: {mem}({:.2}%{predicted})", 100.0 * measured as f64 / total as f64));
    } else if let Some(p) = m.peak_bytes {
        let mem = format_bytes(p).replace(' ', "");
        match ctx.device_memory_bytes {
            Some(total) if total > 0 => line.push_str(&format!("  memory: {mem}({:.2}%)", 100.0 * p as f64 / total as f64)),
            _ => line.push_str(&format!("  memory: {mem}(predicted)")),
        }
    }
    let tps = m.tokens_per_s;
    if tps >= 100.0 || !tps.is_finite() {
        line.push_str(&format!("  tps: {}", with_commas(tps)));
    } else if tps >= 1.0 {
        line.push_str(&format!("  tps: {tps:.2}"));
    } else {
        line.push_str(&format!("  tps: {tps:.4}"));
    }
    if let (Some(t), Some(mfu)) = (ctx.tflops(tps), ctx.mfu_percent(tps)) {
        line.push_str(&format!("  tflops: {t:.2}  mfu: {mfu:.2}%"));
    }
    line
}

/// One line of `--metrics FILE.jsonl`: a step's metrics as a JSON object. Unknown values
/// (no FLOPs count, no measured peak, a graph without a `grad_norm` output) are `null`.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MetricsRecord {
    pub step: u64,
    pub loss: f64,
    pub grad_norm: Option<f64>,
    pub lr: Option<f64>,
    pub tokens_per_s: f64,
    pub tflops: Option<f64>,
    pub mfu: Option<f64>,
    pub predicted_peak_bytes: Option<u64>,
    pub measured_peak_bytes: Option<u64>,
    /// Seconds since the run started (after loading and initialization).
    pub wall_s: f64,
}

impl MetricsRecord {
    /// The record of step `m`; `mfu` is in percent, like the log line.
    pub fn new(m: &StepMetrics, ctx: &LogContext, measured_peak_bytes: Option<u64>, wall_s: f64) -> MetricsRecord {
        let finite = |x: f64| x.is_finite().then_some(x);
        MetricsRecord {
            step: m.step,
            loss: m.loss,
            grad_norm: finite(m.grad_norm),
            lr: finite(m.lr),
            tokens_per_s: m.tokens_per_s,
            tflops: ctx.tflops(m.tokens_per_s),
            mfu: ctx.mfu_percent(m.tokens_per_s),
            predicted_peak_bytes: m.peak_bytes,
            measured_peak_bytes,
            wall_s,
        }
    }
}

/// Appends one JSON object per step to a `.jsonl` file.
pub struct MetricsWriter {
    out: std::io::BufWriter<std::fs::File>,
    path: String,
}

/// Why the metrics file cannot be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot write metrics file `{path}`: {message}; pass a writable --metrics path")]
pub struct MetricsError {
    pub path: String,
    pub message: String,
}

impl MetricsWriter {
    /// Create (or truncate) `path`; with `append`, keep what it holds (a resumed run).
    pub fn create(path: &std::path::Path, append: bool) -> Result<MetricsWriter, MetricsError> {
        let name = path.display().to_string();
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(|e| MetricsError { path: name.clone(), message: e.to_string() })?;
        Ok(MetricsWriter { out: std::io::BufWriter::new(file), path: name })
    }

    /// Write one record as a line, flushed so a crashed run keeps its steps.
    pub fn write(&mut self, r: &MetricsRecord) -> Result<(), MetricsError> {
        self.write_json(r)
    }

    /// Write any serializable record (a validation's) as a line, flushed.
    pub fn write_json(&mut self, r: &impl serde::Serialize) -> Result<(), MetricsError> {
        use std::io::Write;
        let err = |e: String| MetricsError { path: self.path.clone(), message: e };
        let line = serde_json::to_string(r).map_err(|e| err(e.to_string()))?;
        writeln!(self.out, "{line}").and_then(|()| self.out.flush()).map_err(|e| err(e.to_string()))
    }
}

/// A line naming the build-time switches the artifact was built with (kernel variants for
/// comparisons, `docs/artifact.md`), printed once at start; `None` for an ordinary build.
pub fn switches_summary(m: &titan_ir::artifact::Manifest) -> Option<String> {
    (!m.build_switches.is_empty()).then(|| {
        let list: Vec<String> = m.build_switches.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!("built with build-time switches {}: its kernels are a variant for comparison, not the default build's", list.join(" "))
    })
}

/// The predicted peak memory with its split over arenas, printed once at start.
pub fn memory_summary(a: &Artifact) -> String {
    let parts: Vec<String> =
        a.manifest.memory.arenas.iter().filter(|p| p.bytes > 0).map(|p| format!("{} {}", arena_name(p.arena), format_bytes(p.bytes))).collect();
    let unplanned = a.manifest.memory.activation_bytes_unplanned;
    let mut s = format!("predicted peak memory {} ({})", format_bytes(a.manifest.memory.peak_bytes), parts.join(", "));
    if unplanned > 0 {
        s.push_str(&format!("; activations {} without reuse", format_bytes(unplanned)));
    }
    let w = titan_ir::artifact::workspace::library_workspaces(&a.manifest);
    s.push_str(&format!(
        "; on a GPU also library workspaces {} (cuBLASLt {}, kernel workspaces {}, collective staging {}, NCCL {}): {} in all",
        format_bytes(w.total()),
        format_bytes(w.cublaslt),
        format_bytes(w.kernels),
        format_bytes(w.collective_staging),
        format_bytes(w.nccl),
        format_bytes(crate::memory_fit::predicted_device_bytes(&a.manifest))
    ));
    s
}

/// Wall-clock seconds of the start-up phases of a GPU run, in the order they happen.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StartupTimes {
    /// Reading the artifact, opening the GPU, loading the PTX modules, cuBLASLt plans.
    pub load_s: f64,
    /// Unrolling the schedule into launches with resolved device pointers.
    pub plan_s: f64,
    /// Allocating (and filling) the arenas.
    pub alloc_s: f64,
    /// Drawing and encoding the initial parameters. The worker threads interleave drawing and
    /// copying, so the phase's wall time is split between `init` and `upload` in proportion to
    /// their busy time in each.
    pub init_s: f64,
    /// Copying the initial parameters to the device (and waiting for the last copies).
    pub upload_s: f64,
}

/// `start-up 3.2 s (load 0.1 s, plan 0.0 s, alloc 0.2 s, init 2.1 s, upload 0.6 s)`: `total_s`
/// runs from the start of `titan-run` to the first step; what the phases leave out is reading
/// the data.
pub fn format_startup(total_s: f64, t: &StartupTimes) -> String {
    format!(
        "start-up {total_s:.1} s (load {:.1} s, plan {:.1} s, alloc {:.1} s, init {:.1} s, upload {:.1} s)",
        t.load_s, t.plan_s, t.alloc_s, t.init_s, t.upload_s
    )
}

/// `predicted 58.00 GiB, measured 61.20 GiB (Δ +5.5%)`, printed at the end of a GPU run.
pub fn format_memory_check(predicted: u64, measured: u64) -> String {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let delta = if predicted > 0 { format!("{:+.1}%", 100.0 * (measured as f64 - predicted as f64) / predicted as f64) } else { "n/a".into() };
    format!("peak memory: predicted {:.2} GiB, measured {:.2} GiB (Δ {delta})", gib(predicted), gib(measured))
}

/// A progress bar over the steps of a run, drawn on stderr only when it is a terminal.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    pub fn new(steps: u64) -> Progress {
        let visible = std::io::stderr().is_terminal() && steps >= LONG_RUN_STEPS;
        Progress::with_visibility(steps, visible)
    }

    /// A bar that draws only when `visible`.
    pub fn with_visibility(steps: u64, visible: bool) -> Progress {
        if !visible {
            return Progress { bar: ProgressBar::hidden() };
        }
        let bar = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template("{bar:40.cyan/blue} {pos}/{len} steps [{elapsed_precise} < {eta_precise}] {msg}") {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.enable_steady_tick(Duration::from_millis(200));
        Progress { bar }
    }

    /// Print a log line on stdout without tearing the bar.
    pub fn println(&self, line: &str) {
        self.bar.suspend(|| println!("{line}"));
    }

    /// Advance by one finished step.
    pub fn step(&self, m: &StepMetrics) {
        self.bar.set_message(format!("loss {:.4}", m.loss));
        self.bar.inc(1);
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(peak: Option<u64>) -> StepMetrics {
        StepMetrics { step: 3, loss: 2.5, grad_norm: 0.75, lr: 3e-3, tokens_per_s: 1234.4, peak_bytes: peak, measured_peak_bytes: None }
    }

    #[test]
    fn switches_are_named_only_when_set() {
        let json = r#"{"format_version": 1, "titan_version": "t", "content_hash": "0", "target": {"arch": "sm_90a", "ptx_isa": "8.0"},
            "model": {}, "dims": {}, "mesh": {"world_size": 1, "dims": []}, "training": {"batch": 1, "seq_len": 1, "vocab_size": 1, "tokens_per_step": 1, "flops_per_token": 0},
            "buffers": [], "memory": {"arenas": [], "peak_bytes": 0, "activation_bytes_unplanned": 0}, "kernels": [], "ranks": []}"#;
        let mut m: titan_ir::artifact::Manifest = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(switches_summary(&m), None);
        m.build_switches.insert("TITAN_SCATTER_SPLIT".into(), "1".into());
        m.build_switches.insert("TITAN_ATT_FWD_WS".into(), "0".into());
        let line = switches_summary(&m).unwrap_or_default();
        assert!(line.starts_with("built with build-time switches TITAN_ATT_FWD_WS=0 TITAN_SCATTER_SPLIT=1:"), "{line}");
    }

    #[test]
    fn step_line_has_torchtitans_shape() {
        assert_eq!(format_step(&metrics(None)), "step:  3  loss:  2.5000  grad_norm:  0.7500  tps: 1,234");
        let ctx = LogContext { flops_per_token: Some(8_000_000_000), device_memory_bytes: None };
        let m = StepMetrics { tokens_per_s: 21345.4, peak_bytes: Some(3 << 20), ..metrics(None) };
        assert_eq!(
            format_step_with(&m, &ctx),
            "step:  3  loss:  2.5000  grad_norm:  0.7500  memory: 3.00MiB(predicted)  tps: 21,345  tflops: 170.76  mfu: 17.27%"
        );
        let gpu = LogContext { device_memory_bytes: Some(H200_MEMORY_BYTES), ..ctx };
        assert!(format_step_with(&m, &gpu).contains("memory: 3.00MiB(0.00%)"), "{}", format_step_with(&m, &gpu));
        let measured = StepMetrics { measured_peak_bytes: Some(4 << 20), ..m.clone() };
        assert!(format_step_with(&measured, &gpu).contains("memory: 4.00MiB(0.00%, predicted 3.00MiB)"), "{}", format_step_with(&measured, &gpu));
        let slow = StepMetrics { tokens_per_s: 0.15, ..metrics(None) };
        assert!(format_step(&slow).ends_with("tps: 0.1500"), "{}", format_step(&slow));
        assert_eq!(with_commas(1234567.0), "1,234,567");
        assert_eq!(with_commas(12.0), "12");
    }

    #[test]
    fn metrics_records_are_json_lines() {
        let path = std::env::temp_dir().join(format!("titan-metrics-{}.jsonl", std::process::id()));
        let ctx = LogContext { flops_per_token: Some(1_000_000), device_memory_bytes: None };
        let m = StepMetrics { grad_norm: f64::NAN, ..metrics(Some(1024)) };
        {
            let mut w = MetricsWriter::create(&path, false).expect("create");
            w.write(&MetricsRecord::new(&m, &ctx, None, 0.5)).expect("write");
            w.write(&MetricsRecord::new(&m, &LogContext::default(), Some(7), 1.0)).expect("write");
        }
        let text = std::fs::read_to_string(&path).expect("read");
        let _ = std::fs::remove_file(&path);
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).expect("json")).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["step"], 3);
        assert_eq!(lines[0]["grad_norm"], serde_json::Value::Null);
        assert_eq!(lines[0]["predicted_peak_bytes"], 1024);
        assert!((lines[0]["tflops"].as_f64().unwrap() - 1234.4e-6).abs() < 1e-12);
        assert_eq!(lines[1]["mfu"], serde_json::Value::Null);
        assert_eq!(lines[1]["measured_peak_bytes"], 7);
        assert_eq!(lines[1]["wall_s"], 1.0);
    }

    #[test]
    fn startup_and_memory_lines() {
        let t = StartupTimes { load_s: 0.12, plan_s: 0.01, alloc_s: 0.2, init_s: 2.1, upload_s: 0.64 };
        assert_eq!(format_startup(3.2, &t), "start-up 3.2 s (load 0.1 s, plan 0.0 s, alloc 0.2 s, init 2.1 s, upload 0.6 s)");
        assert_eq!(format_memory_check(4 << 30, 5 << 30), "peak memory: predicted 4.00 GiB, measured 5.00 GiB (Δ +25.0%)");
        assert!(format_memory_check(0, 1).ends_with("(Δ n/a)"));
    }

    #[test]
    fn a_hidden_bar_prints_nothing_extra() {
        let p = Progress::with_visibility(5, false);
        p.step(&metrics(None));
        p.finish();
    }
}
