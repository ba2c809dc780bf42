//! Training the debug model end to end on the CPU reference backend: the frontend's model,
//! lowered by the passes, run by the runtime on the bundled corpus.

use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_passes::{TrainOptions, lower_to_train};
use titan_runtime::{BUNDLED_CORPUS, Batcher, CpuTrainer, byte_tokens};

/// The settings `scripts/demo.sh` uses, for a 100-step run.
fn demo_options(steps: u64) -> TrainOptions {
    TrainOptions {
        lr: 3e-3,
        warmup_steps: 10,
        decay_steps: steps - 10,
        decay: titan_ir::DecayKind::Cosine,
        min_lr_ratio: 0.1,
        weight_decay: 0.01,
        ..TrainOptions::default()
    }
}

fn train(steps: u64, seed: u64) -> Vec<f64> {
    let model = build_llama3(&LlamaConfig::preset(Preset::Debug), "llama3_debug").expect("debug model");
    let train = lower_to_train(&model, &demo_options(steps)).expect("lowering");
    let mut trainer = CpuTrainer::new(&train, seed).expect("trainer");
    let mut batcher = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), trainer.batch_size(), trainer.seq_len(), seed).expect("batcher");
    (0..steps).map(|_| trainer.step(&batcher.next_batch()).expect("step").loss).collect()
}

#[test]
fn debug_model_loss_falls_below_half_of_ln_vocab_in_100_steps() {
    let losses = train(100, 0);
    let ln_vocab = 256f64.ln();
    let first = losses[0];
    let last10 = losses[90..].iter().sum::<f64>() / 10.0;
    println!("loss: first {first:.4}, mean of last 10 {last10:.4}, ln(256) = {ln_vocab:.4}");
    assert!((first - ln_vocab).abs() < 1.0, "the untrained model should be near ln(vocab): {first}");
    assert!(losses.iter().all(|l| l.is_finite()), "every loss is finite");
    assert!(last10 < 0.5 * ln_vocab, "loss did not fall below half of ln(vocab): first {first:.4}, last 10 steps {last10:.4}");
}

#[test]
fn training_is_deterministic_for_a_seed() {
    assert_eq!(train(12, 5), train(12, 5));
    assert_ne!(train(12, 5), train(12, 6));
}
