//! Helpers shared by the end-to-end modules: the f32 debug model, its training options, and
//! scratch directories that clean up after themselves.

use std::path::{Path, PathBuf};
use std::time::Instant;

use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::interp::Tensor;
use titan_ir::{DType, Graph};
use titan_passes::TrainOptions;
use titan_runtime::{BUNDLED_CORPUS, Batcher, Trainer, byte_tokens};

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

/// Losses, gradient norms and final states of a few training steps.
pub struct Run {
    pub losses: Vec<f64>,
    pub grad_norms: Vec<f64>,
    pub states: Vec<(String, Tensor<f32>)>,
}

impl Run {
    /// `steps` training steps of `t` on the bundled corpus in batches of `batch` x `seq` (seed 7:
    /// the same batches for every backend), with `states` read from the trainer afterwards.
    pub fn train<T: Trainer + ?Sized>(t: &mut T, batch: usize, seq: usize, steps: usize, states: impl FnOnce(&mut T) -> Vec<(String, Tensor<f32>)>) -> Run {
        Run::train_from(t, batch, seq, 0, steps, states)
    }

    /// [`Run::train`] from batch `from` of the same sequence (a resumed run's batches).
    pub fn train_from<T: Trainer + ?Sized>(
        t: &mut T,
        batch: usize,
        seq: usize,
        from: u64,
        steps: usize,
        states: impl FnOnce(&mut T) -> Vec<(String, Tensor<f32>)>,
    ) -> Run {
        let mut batcher = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), batch, seq, 7).expect("batcher");
        batcher.seek(from);
        let (mut losses, mut grad_norms) = (Vec::new(), Vec::new());
        for _ in 0..steps {
            let m = t.step(&batcher.next_batch()).expect("step");
            losses.push(m.loss);
            grad_norms.push(m.grad_norm);
        }
        Run { losses, grad_norms, states: states(t) }
    }

    /// Assert `got` equal to `self` bit for bit: losses, gradient norms and every state (the
    /// same names in the same order).
    pub fn assert_bitwise(&self, got: &Run, label: &str) {
        println!("{label}: losses {:?}", got.losses);
        let bits = |xs: &[f64]| xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&self.losses), bits(&got.losses), "{label}: losses {:?} vs {:?}", self.losses, got.losses);
        assert_eq!(bits(&self.grad_norms), bits(&got.grad_norms), "{label}: gradient norms");
        let names = |r: &Run| r.states.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(self), names(got), "{label}: the same states");
        let state_bits = |t: &Tensor<f32>| t.floats().expect("float state").iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let differing: Vec<&str> =
            self.states.iter().zip(&got.states).filter(|(a, b)| state_bits(&a.1) != state_bits(&b.1)).map(|(a, _)| a.0.as_str()).collect();
        assert!(differing.is_empty(), "{label}: states differ: {differing:?}");
    }

    /// Assert `got` within `loss_tol` (absolute loss), 1e-4 (relative gradient norm) and
    /// `state_tol` (absolute, every state) of `self`, printing the differences under `label`.
    pub fn assert_close(&self, got: &Run, loss_tol: f64, state_tol: f32, label: &str, start: Instant) {
        let loss_diff = self.losses.iter().zip(&got.losses).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        let norm_diff = self.grad_norms.iter().zip(&got.grad_norms).map(|(a, b)| (a - b).abs() / a.abs()).fold(0.0, f64::max);
        assert_eq!(self.states.len(), got.states.len());
        let (mut state_diff, mut worst) = (0.0f32, String::new());
        for ((n1, t1), (n2, t2)) in self.states.iter().zip(&got.states) {
            assert_eq!(n1, n2);
            assert_eq!(t1.shape, t2.shape, "{n1}");
            let d = t1.floats().expect("float").iter().zip(t2.floats().expect("float")).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            if d > state_diff {
                (state_diff, worst) = (d, n1.clone());
            }
        }
        println!(
            "{label}: losses {:?}; max |dloss| {loss_diff:.3e}, max rel dgrad_norm {norm_diff:.3e}, max |dstate| {state_diff:.3e} ({worst}); {:.2} s",
            got.losses,
            start.elapsed().as_secs_f64()
        );
        assert!(loss_diff <= loss_tol, "losses differ by {loss_diff}: {:?} vs {:?}", self.losses, got.losses);
        assert!(norm_diff <= 1e-4, "grad norms differ: {:?} vs {:?}", self.grad_norms, got.grad_norms);
        assert!(state_diff <= state_tol, "state `{worst}` differs by {state_diff}");
    }
}
