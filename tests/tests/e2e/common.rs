//! Helpers shared by the end-to-end modules: the f32 debug model, its training options, and
//! scratch directories that clean up after themselves.

use std::path::{Path, PathBuf};

use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::{DType, Graph};
use titan_passes::TrainOptions;

/// The debug Llama of `cfg` in f32 (every backend computes it the same way up to summation
/// order).
pub fn debug_f32_with(cfg: LlamaConfig) -> Graph {
    build_llama3(&LlamaConfig { dtype: DType::F32, ..cfg }, "llama3_debug").expect("debug model")
}

/// The stock debug Llama in f32.
pub fn debug_f32() -> Graph {
    debug_f32_with(LlamaConfig::preset(Preset::Debug))
}

/// Short warmup and decay, so a few steps see the whole schedule.
pub fn train_options() -> TrainOptions {
    TrainOptions { lr: 3e-3, warmup_steps: 2, decay_steps: 10, ..TrainOptions::default() }
}

/// A directory under the target's temp dir, removed when dropped.
pub struct Scratch(pub PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh (emptied) scratch directory `<module>-<name>-<pid>`.
pub fn scratch(module: &str, name: &str) -> Scratch {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{module}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    Scratch(dir)
}
