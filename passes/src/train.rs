//! Lowering of a model graph to the training-step graph: forward, backward (autodiff), mixed
//! precision master weights, gradient clipping and AdamW.

use titan_ir::{DecayKind, Graph};

use crate::PassError;

/// Optimizer and schedule settings baked into the training-step graph.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainOptions {
    pub lr: f64,
    pub warmup_steps: u64,
    /// Steps of decay after warmup (TorchTitan: `training.steps - warmup_steps`).
    pub decay_steps: u64,
    pub decay: DecayKind,
    pub min_lr_ratio: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Clip the global gradient norm to this value; `None` disables clipping.
    pub max_norm: Option<f64>,
}

impl Default for TrainOptions {
    /// TorchTitan's Llama-3 defaults: lr 8e-4, warmup 200, AdamW (0.9, 0.95), eps 1e-8, weight decay 0.1, max_norm 1.0.
    fn default() -> TrainOptions {
        TrainOptions {
            lr: 8e-4,
            warmup_steps: 200,
            decay_steps: 800,
            decay: DecayKind::Linear,
            min_lr_ratio: 0.0,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            max_norm: Some(1.0),
        }
    }
}

/// Build the training-step graph of `model`.
pub fn lower_to_train(model: &Graph, opts: &TrainOptions) -> Result<Graph, PassError> {
    let _ = (model, opts);
    Err(PassError::Unsupported { pass: "lower-to-train", what: "the training lowering (being written)".into() })
}
