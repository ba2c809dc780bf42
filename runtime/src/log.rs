//! What `titan-run` prints: the per-step log line (stdout), the start-up summary and, for long
//! runs on a terminal, a progress bar on stderr (hidden when stderr is not a terminal, so logs
//! and tests stay clean).

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::artifact::{Artifact, arena_name, format_bytes};
use crate::backend::StepMetrics;

/// Runs of at least this many steps get a progress bar.
pub const LONG_RUN_STEPS: u64 = 10;

/// The per-step log line: step, loss, grad norm, learning rate, throughput and, for an
/// artifact, the memory plan's predicted peak.
pub fn format_step(m: &StepMetrics) -> String {
    let tps = m.tokens_per_s;
    // Keep a few significant digits for slow steps (a large model on the CPU backend).
    let digits = if tps >= 100.0 {
        0
    } else if tps >= 1.0 {
        2
    } else {
        4
    };
    let mut line = format!("step {:>5} | loss {:>8.4} | grad_norm {:>8.4} | lr {:.3e} | {tps:>9.digits$} tok/s", m.step, m.loss, m.grad_norm, m.lr);
    if let Some(p) = m.peak_bytes {
        line.push_str(&format!(" | peak mem {:>9}", format_bytes(p)));
    }
    line
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
    s
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
        StepMetrics { step: 3, loss: 2.5, grad_norm: 0.75, lr: 3e-3, tokens_per_s: 1234.4, peak_bytes: peak }
    }

    #[test]
    fn step_line_has_every_metric() {
        assert_eq!(format_step(&metrics(None)), "step     3 | loss   2.5000 | grad_norm   0.7500 | lr 3.000e-3 |      1234 tok/s");
        assert_eq!(format_step(&metrics(Some(3 << 20))).rsplit(" | ").next(), Some("peak mem  3.00 MiB"));
        let slow = StepMetrics { tokens_per_s: 0.15, ..metrics(None) };
        assert!(format_step(&slow).ends_with("|    0.1500 tok/s"), "{}", format_step(&slow));
    }

    #[test]
    fn a_hidden_bar_prints_nothing_extra() {
        let p = Progress::with_visibility(5, false);
        p.step(&metrics(None));
        p.finish();
    }
}
