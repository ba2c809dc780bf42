//! Passes over the graph IR: mixed precision, autodiff, the optimizer step, the
//! training-step lowering that chains them, per-block fusion into kernels, and the pass
//! manager ([`pipeline`]) that runs them by name. Each pass is a plain function over the graph
//! returning statistics.

pub mod autodiff;
pub mod check_collectives;
pub mod cse;
pub mod dce;
pub mod fuse;
pub mod mixed_precision;
pub mod model_hash;
pub mod optimizer;
pub mod pipeline;
pub mod prefetch;
pub mod prefetch_next_layer;
pub mod shard_dp;
pub mod shard_grads;
pub mod shard_tp;
pub mod train;
pub mod util;

pub use fuse::{FuseStats, FusionReport, fuse, fusion_report};
pub use model_hash::{model_hash, stamp_model_identity};
pub use pipeline::{
    BUILD_PIPELINE, DumpAfter, PassContext, PassFn, PassInfo, PassRecord, PassStats, PipelineOptions, PipelineReport, SPMD_BUILD_PIPELINE, SPMD_TRAIN_PIPELINE,
    TRAIN_PIPELINE, build_pipeline, compile_train_graph, lookup_passes, pass_table, run_pipeline,
};
pub use train::{TrainOptions, TrainStats, lower_to_train, lower_to_train_with_stats, train_pipeline};

/// A pass failed; the message says what was wrong and where.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PassError {
    #[error("{pass}: {message}")]
    Failed { pass: &'static str, message: String },
    #[error("{pass}: {what} is not supported yet")]
    Unsupported { pass: &'static str, what: String },
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

fn indent(lines: &[String]) -> String {
    lines.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n")
}
