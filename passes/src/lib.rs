//! Passes over the graph IR: autodiff, the training-step lowering, and (later) fusion and
//! sharding. Each pass is a plain function over the graph returning statistics.

pub mod train;

pub use train::{TrainOptions, lower_to_train};

/// A pass failed; the message says what was wrong and where.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PassError {
    #[error("{pass}: {message}")]
    Failed { pass: &'static str, message: String },
    #[error("{pass}: {what} is not supported yet")]
    Unsupported { pass: &'static str, what: String },
}
