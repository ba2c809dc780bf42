//! Passes over the graph IR: mixed precision, autodiff, the optimizer step and the
//! training-step lowering that chains them (later: fusion and sharding). Each pass is a plain
//! function over the graph returning statistics.

pub mod autodiff;
pub mod cse;
pub mod dce;
pub mod mixed_precision;
pub mod optimizer;
pub mod train;
pub mod util;

pub use train::{TrainOptions, TrainStats, lower_to_train, lower_to_train_with_stats};

/// A pass failed; the message says what was wrong and where.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PassError {
    #[error("{pass}: {message}")]
    Failed { pass: &'static str, message: String },
    #[error("{pass}: {what} is not supported yet")]
    Unsupported { pass: &'static str, what: String },
}
