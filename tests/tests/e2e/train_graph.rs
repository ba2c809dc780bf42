//! Snapshot of the debug model's training-step graph (`titanc lower --to train`).

use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_passes::{TrainOptions, lower_to_train_with_stats};

#[test]
fn debug_training_step_graph() {
    let model = build_llama3(&LlamaConfig::preset(Preset::Debug), "llama3_debug").expect("debug model");
    let (train, stats) = lower_to_train_with_stats(&model, &TrainOptions::default()).expect("lowering");
    let errs = titan_ir::verify::verify(&train);
    assert!(errs.is_empty(), "{:?}", errs.iter().map(|e| e.to_string()).collect::<Vec<_>>());
    assert_eq!(stats.params, 12);
    insta::assert_snapshot!(titan_ir::print::print_graph(&train));
}

/// The block and its backward are built once: the training graph of the 70B preset has the
/// same number of nodes as the debug model's.
#[test]
fn training_graph_size_does_not_grow_with_layers() {
    let count = |p: Preset| {
        let model = build_llama3(&LlamaConfig::preset(p), "m").expect("model");
        let (g, _) = lower_to_train_with_stats(&model, &TrainOptions::default()).expect("lowering");
        (g.main.order.len(), g.blocks.iter().map(|b| b.order.len()).sum::<usize>())
    };
    assert_eq!(count(Preset::Debug), count(Preset::B70));
}
