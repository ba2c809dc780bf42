//! Steps whose loss or gradient norm is not finite. By default such a step stops the run with
//! an error naming the step and what to try; with `--skip-nonfinite-steps` the step is undone
//! and counted, TorchTitan-style: the optimizer update is part of the compiled step, so the
//! runtime keeps a copy of every state (master weights, AdamW moments) from before each step and
//! restores it when the step turns out non-finite. The step still counts: its batch is consumed
//! and the step number (the learning-rate schedule's and AdamW's bias correction's) moves on, as
//! a scheduler does over a skipped `optimizer.step()`. Too many skipped steps in a row stop the
//! run as well.

use titan_ir::interp::Tensor;

use crate::RuntimeError;
use crate::backend::{StepMetrics, Trainer};

/// The consecutive-skip limit `--skip-nonfinite-steps` uses unless `--max-consecutive-skips`
/// says otherwise.
pub const DEFAULT_MAX_CONSECUTIVE_SKIPS: u64 = 10;

/// Why a run stops at a non-finite step.
#[derive(Debug, thiserror::Error)]
pub enum NonFiniteError {
    #[error(
        "step {step}: {what}; the run stops rather than train on it: lower the learning rate (--lr of titanc build or lower), check the data and the checkpoint or --init-from weights for inf/nan values, or pass --skip-nonfinite-steps to skip such steps"
    )]
    Stop { step: u64, what: String },
    #[error(
        "step {step}: {what}: {in_a_row} non-finite steps in a row, more than --max-consecutive-skips {limit}; the run diverged or the weights are broken: lower the learning rate or check the data and the checkpoint"
    )]
    TooManySkips { step: u64, what: String, in_a_row: u64, limit: u64 },
    /// Saving or restoring the states around a step failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

/// What is not finite about a step, `None` when it is fine. `grad_norm` counts only where the
/// trainer reports one (a graph without a `grad_norm` output reports NaN).
pub fn nonfinite_reason(m: &StepMetrics, has_grad_norm: bool) -> Option<String> {
    let loss_bad = !m.loss.is_finite();
    let norm_bad = has_grad_norm && !m.grad_norm.is_finite();
    match (loss_bad, norm_bad) {
        (false, false) => None,
        (true, false) => Some(format!("the loss is {} (grad_norm {})", m.loss, m.grad_norm)),
        (false, true) => Some(format!("the gradient norm is {} (loss {:.4})", m.grad_norm, m.loss)),
        (true, true) => Some(format!("the loss is {} and the gradient norm is {}", m.loss, m.grad_norm)),
    }
}

/// Every state of a trainer as it was before a step.
enum Saved {
    /// A single-device trainer's whole states, by checkpoint name.
    Whole(Vec<(String, Vec<f32>)>),
    /// A mesh trainer's shards: (rank, checkpoint name, values) for each rank held here.
    Shards(Vec<(usize, String, Vec<f32>)>),
}

fn values(t: &Tensor<f32>, name: &str) -> Result<Vec<f32>, RuntimeError> {
    t.floats().map(<[f32]>::to_vec).ok_or_else(|| RuntimeError::Backend(format!("state `{name}` holds integers; it cannot be saved before a step")))
}

impl Saved {
    fn take(trainer: &dyn Trainer) -> Result<Saved, RuntimeError> {
        if let Some(sh) = trainer.sharded() {
            let layout = sh.layout()?;
            let mut out = Vec::new();
            for rank in sh.held_ranks() {
                for l in &layout {
                    out.push((rank, l.name.clone(), values(&sh.rank_state(rank, &l.name)?, &l.name)?));
                }
            }
            return Ok(Saved::Shards(out));
        }
        let mut out = Vec::new();
        for (name, t) in trainer.states()? {
            let v = values(&t, &name)?;
            out.push((name, v));
        }
        Ok(Saved::Whole(out))
    }

    fn restore(&self, trainer: &mut dyn Trainer) -> Result<(), RuntimeError> {
        match self {
            Saved::Whole(states) => states.iter().try_for_each(|(n, v)| trainer.set_state(n, v)),
            Saved::Shards(shards) => {
                let sh =
                    trainer.sharded_mut().ok_or_else(|| RuntimeError::Backend("invariant: a trainer whose states were saved by shard has shards".into()))?;
                shards.iter().try_for_each(|(rank, n, v)| sh.set_rank_state(*rank, n, v))
            }
        }
    }
}

/// Checks every step; with skipping on, saves the states before each step and restores them
/// after a non-finite one.
pub struct NonFiniteGuard {
    /// `Some(limit)`: skip non-finite steps, at most `limit` in a row.
    skip_limit: Option<u64>,
    saved: Option<Saved>,
    in_a_row: u64,
    skipped: u64,
}

/// What became of a step.
#[derive(Clone, Debug, PartialEq)]
pub enum StepOutcome {
    Applied,
    /// Not finite and undone: why, and how many steps were skipped in a row and in all.
    Skipped {
        what: String,
        in_a_row: u64,
        total: u64,
    },
}

impl NonFiniteGuard {
    /// `skip_limit`: `None` stops at the first non-finite step; `Some(n)` skips up to `n` in a row.
    pub fn new(skip_limit: Option<u64>) -> NonFiniteGuard {
        NonFiniteGuard { skip_limit, saved: None, in_a_row: 0, skipped: 0 }
    }

    /// Call before each step: saves the states when skipping is on.
    pub fn before_step(&mut self, trainer: &dyn Trainer) -> Result<(), NonFiniteError> {
        if self.skip_limit.is_some() {
            self.saved = Some(Saved::take(trainer)?);
        }
        Ok(())
    }

    /// Call after step `step` with its metrics: `Applied`, `Skipped` (the states restored), or
    /// the error that stops the run.
    pub fn after_step(&mut self, trainer: &mut dyn Trainer, step: u64, m: &StepMetrics) -> Result<StepOutcome, NonFiniteError> {
        let Some(what) = nonfinite_reason(m, trainer.reports_grad_norm()) else {
            self.in_a_row = 0;
            return Ok(StepOutcome::Applied);
        };
        let Some(limit) = self.skip_limit else {
            return Err(NonFiniteError::Stop { step, what });
        };
        self.in_a_row += 1;
        if self.in_a_row > limit {
            return Err(NonFiniteError::TooManySkips { step, what, in_a_row: self.in_a_row, limit });
        }
        let saved = self.saved.take().ok_or_else(|| RuntimeError::Backend("invariant: the states are saved before every step when skipping".into()))?;
        saved.restore(trainer)?;
        self.skipped += 1;
        Ok(StepOutcome::Skipped { what, in_a_row: self.in_a_row, total: self.skipped })
    }

    /// Steps skipped so far.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(loss: f64, grad_norm: f64) -> StepMetrics {
        StepMetrics { step: 1, loss, grad_norm, lr: 1e-3, tokens_per_s: 0.0, peak_bytes: None, measured_peak_bytes: None }
    }

    #[test]
    fn a_step_is_non_finite_when_its_loss_or_reported_grad_norm_is() {
        assert_eq!(nonfinite_reason(&metrics(2.0, 0.5), true), None);
        assert_eq!(nonfinite_reason(&metrics(0.0, f64::INFINITY), true).as_deref(), Some("the gradient norm is inf (loss 0.0000)"));
        assert_eq!(nonfinite_reason(&metrics(f64::NAN, 0.5), true).as_deref(), Some("the loss is NaN (grad_norm 0.5)"));
        // A graph without a grad_norm output reports NaN: not a failure.
        assert_eq!(nonfinite_reason(&metrics(2.0, f64::NAN), false), None);
    }
}
