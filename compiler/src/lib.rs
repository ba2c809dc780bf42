//! titan's frontend and compiler driver: Llama-3 model configurations (presets and Hugging Face
//! `config.json`), the model-graph builder, model statistics, and the `titanc` command line.

pub mod cli;
pub mod error;
pub mod hf;
pub mod llama;
pub mod stats;

pub use error::FrontendError;
pub use hf::{load_hf_config, parse_hf_config};
pub use llama::{LlamaConfig, LlamaOverrides, Preset, build_llama3, model_ir};
pub use stats::{ModelStats, model_stats};
