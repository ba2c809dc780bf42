//! titan's frontend and compiler driver: Llama-3 model configurations (presets and Hugging Face
//! `config.json`), the model-graph builder, model statistics, TorchTitan-style job configs, the
//! artifact build (`titanc build`: memory plan, schedule, kernel codegen) and the `titanc`
//! command line (`titanc data tokenize` in `data_cmd.rs`, over `titan-data`).

pub mod build;
pub mod cli;
pub mod cost;
pub mod data_cmd;
pub mod error;
pub mod hf;
pub mod job_config;
pub mod llama;
pub mod parallel;
pub mod stats;

pub use build::{BuildError, BuildOptions, BuildSummary, build_artifact};
pub use error::FrontendError;
pub use hf::{load_hf_config, parse_hf_config};
pub use job_config::{JobConfig, JobConfigError};
pub use llama::{LlamaConfig, LlamaOverrides, Preset, build_llama3, model_ir};
pub use parallel::{ParallelDims, ParallelError, ParallelRequest};
pub use stats::{ModelStats, model_stats};
