//! Passes over the graph IR: mixed precision, autodiff, the optimizer step, the
//! training-step lowering that chains them, per-block fusion into kernels, and the pass
//! manager ([`pipeline`]) that runs them by name. Each pass is a plain function over the graph
//! returning statistics.

pub mod activation_checkpoint;
pub mod adamw;
pub mod async_tp;
pub mod autodiff;
pub mod check_collectives;
pub mod compute_copies;
pub mod cse;
pub mod dce;
pub mod error;
pub mod float8;
pub mod float8_fsdp;
pub mod fuse;
pub mod master_weights;
pub mod model_hash;
pub mod opt;
pub mod pipeline;
pub mod prefetch_gathers;
pub mod prefetch_next_layer;
pub mod shard_dp;
pub mod shard_tp;
pub mod sync_grads;
pub mod train;
pub mod util;

pub use error::{PassDiag, PassErrorKind, PassLoc};
pub use fuse::{FuseStats, FusionReport, fuse, fusion_report};
pub use model_hash::{model_hash, stamp_model_identity};
pub use pipeline::{
    BUILD_PIPELINE, DumpAfter, PassContext, PassFn, PassInfo, PassRecord, PassStats, PipelineOptions, PipelineReport, SPMD_BUILD_PIPELINE, SPMD_TRAIN_PIPELINE,
    TRAIN_PIPELINE, build_pipeline, compile_eval_graph, compile_train_graph, eval_pipeline, lookup_passes, lower_to_eval, pass_table, run_pipeline,
};
pub use train::{TrainOptions, TrainStats, lower_to_train, lower_to_train_casting_copies, lower_to_train_with_stats, train_pipeline};

/// A pass or the pass manager failed; the message says what was wrong and what to change.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PassError {
    /// Pass `pass` refused the graph or failed on it: a [`PassDiag`] with the pass named and
    /// its location described on the graph it failed on.
    #[error("{pass}: {}{message}", at.as_ref().map(|a| format!("{}: ", a.place)).unwrap_or_default())]
    Pass { pass: &'static str, kind: PassErrorKind, message: String, at: Option<PassLoc> },
    /// A pass name (in a pipeline or `--dump-after`) that is not in the table.
    #[error("unknown pass `{name}`; valid passes: {valid}")]
    UnknownPass { name: String, valid: String },
    /// The verifier rejected the graph a pass produced: a bug in pass `after`.
    #[error("the graph does not verify after pass `{after}` (a bug in that pass; rerun with `--dump-after {after}` to see its output):\n{}", indent(errors))]
    Verify { after: &'static str, errors: Vec<String> },
    /// The graph handed to the pipeline does not verify (checked when verifying each pass).
    #[error("the input graph does not verify; fix these errors first:\n{}", indent(errors))]
    InvalidInput { errors: Vec<String> },
}

impl PassError {
    /// An error of `pass` with no location (driver-level checks: options, pipelines).
    pub fn new(pass: &'static str, kind: PassErrorKind, message: impl Into<String>) -> PassError {
        PassError::Pass { pass, kind, message: message.into(), at: None }
    }

    /// `diag` reported by `pass` while working on `g`; `input_ids` says whether `g`'s node ids
    /// are still those of the pipeline's input (see [`PassLoc::input_ids`]).
    pub fn from_diag(pass: &'static str, diag: PassDiag, g: &titan_ir::Graph, input_ids: bool) -> PassError {
        let at = diag.at.map(|loc| PassLoc::new(g, loc, input_ids));
        PassError::Pass { pass, kind: diag.kind, message: diag.message, at }
    }

    /// The kind of a pass's refusal; `None` for pass-manager errors (unknown pass, verifier).
    pub fn kind(&self) -> Option<PassErrorKind> {
        match self {
            PassError::Pass { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// This error as a diagnostic of the pipeline input's source text, when it is a pass
    /// error located on a part of the graph that still has its source ids and `map` is that
    /// input's source map (`file:line:col` and a caret when rendered).
    pub fn source_diagnostic(&self, map: Option<&titan_ir::SourceMap>) -> Option<titan_ir::diag::Diagnostic> {
        match self {
            PassError::Pass { pass, message, at: Some(at), .. } if at.input_ids => map.map(|m| error::pass_diagnostic(&format!("{pass}: {message}"), at, m)),
            _ => None,
        }
    }
}

fn indent(lines: &[String]) -> String {
    lines.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n")
}
