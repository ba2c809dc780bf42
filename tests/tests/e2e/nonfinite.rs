//! A non-finite step is never trained through: `titan-run` (the CPU backend, graph mode) on the
//! debug model started from weights whose `lm_head.weight` holds 1e30 (the gradient norm
//! overflows to inf) stops at step 1 naming it and what to try; with `--skip-nonfinite-steps` it
//! runs on, skipping and counting every such step, and the states it ends with are the ones it
//! started from (the updates were undone), on one device and on the simulated mesh (every rank's
//! shards restored); `--max-consecutive-skips` bounds the skips in a row.

use std::path::Path;
use std::process::{Command, Output};

use crate::common::{Scratch, debug_f32, scratch, train_options};
use titan_runtime::checkpoint::{self, CHECKPOINT_FORMAT_VERSION, MODEL_FILE, TrainerState};
use titan_runtime::{CpuTrainer, Trainer};

const TITAN_RUN: &str = env!("CARGO_BIN_EXE_titan-run-e2e");

fn titan_run(args: &[&str]) -> Output {
    Command::new(TITAN_RUN).args(args).output().expect("run titan-run-e2e")
}

/// What the run printed: the step log (stdout) then the messages (stderr).
fn printed(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// The debug model's training graph in `dir/train.ir` and a checkpoint of its initial states
/// with `output.weight` (`lm_head.weight`) set to 1e30, in `dir/broken/step-0/`.
fn broken_weights(dir: &Scratch) -> (String, String) {
    std::fs::create_dir_all(dir).expect("scratch dir");
    let train = titan_passes::lower_to_train(&debug_f32(), &train_options()).expect("lowering");
    let graph = dir.join("train.ir");
    std::fs::write(&graph, titan_ir::print::print_graph(&train)).expect("write the graph");
    let mut trainer = CpuTrainer::new(&train, 0).expect("trainer");
    let n = trainer.state("output.weight").expect("the head").numel();
    trainer.set_state("output.weight", &vec![1e30; n]).expect("set the head");
    let state = TrainerState {
        format_version: CHECKPOINT_FORMAT_VERSION,
        step: 0,
        seed: 0,
        data_position: 0,
        data_stream: None,
        content_hash: String::new(),
        data: "bundled corpus".into(),
        mesh: Default::default(),
        model_hash: None,
        model_config: Default::default(),
    };
    let written = checkpoint::save(&dir.join("broken"), &trainer, &state).expect("save");
    (graph.display().to_string(), written.join(MODEL_FILE).display().to_string())
}

/// Every tensor of a safetensors file: name, shape and the bits of its values.
fn tensors(path: &Path) -> Vec<(String, Vec<usize>, Vec<u32>)> {
    checkpoint::read_safetensors(path)
        .expect("read safetensors")
        .into_values()
        .map(|t| (t.name, t.shape, t.values.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

#[test]
fn an_infinite_gradient_norm_stops_the_run_naming_the_step() {
    let dir = scratch("nonfinite", "stop");
    let (graph, weights) = broken_weights(&dir);
    let out = titan_run(&[&graph, "--init-from", &weights, "--steps", "3"]);
    let e = printed(&out);
    assert!(!out.status.success(), "a run with an inf gradient norm must fail:\n{e}");
    assert!(e.contains("error: step 1: the gradient norm is inf"), "{e}");
    assert!(e.contains("lower the learning rate") && e.contains("--skip-nonfinite-steps"), "{e}");
}

#[test]
fn skipped_steps_are_undone_counted_and_bounded() {
    let dir = scratch("nonfinite", "skip");
    let (graph, weights) = broken_weights(&dir);
    let ckpt = dir.join("after");
    let ckpt_s = ckpt.display().to_string();
    let out = titan_run(&[&graph, "--init-from", &weights, "--steps", "3", "--skip-nonfinite-steps", "--checkpoint-dir", &ckpt_s]);
    let e = printed(&out);
    assert!(out.status.success(), "{e}");
    for s in 1..=3 {
        assert!(
            e.contains(&format!("titan-run: step {s}: the gradient norm is inf")) && e.contains(&format!("update skipped ({s} in a row, {s} in all)")),
            "{e}"
        );
    }
    assert!(e.contains("3 of 3 steps skipped"), "{e}");
    // Every update was undone: the parameters written after step 3 are the ones loaded.
    assert_eq!(tensors(&ckpt.join("step-3").join(MODEL_FILE)), tensors(Path::new(&weights)));

    let out = titan_run(&[&graph, "--init-from", &weights, "--steps", "3", "--skip-nonfinite-steps", "--max-consecutive-skips", "1"]);
    let e = printed(&out);
    assert!(!out.status.success(), "{e}");
    assert!(e.contains("error: step 2: the gradient norm is inf") && e.contains("2 non-finite steps in a row, more than --max-consecutive-skips 1"), "{e}");
}

#[test]
fn skipping_is_refused_where_it_cannot_be_exact() {
    let out = titan_run(&["no-such-artifact", "--backend", "cuda", "--skip-nonfinite-steps"]);
    let e = printed(&out);
    assert!(!out.status.success() && e.contains("--skip-nonfinite-steps is not supported with --backend cuda"), "{e}");
}

/// The simulated mesh restores every rank's shards: a dp_shard 2 x tp 2 run of the same broken
/// weights skips its steps and ends with the parameters it loaded.
#[test]
fn skipped_steps_are_undone_on_every_rank_of_a_mesh() {
    let dir = scratch("nonfinite", "mesh");
    let (_, weights) = broken_weights(&dir);
    let mut model = debug_f32();
    titan_ir::Mesh::new(1, 2, 2).write_meta(&mut model);
    let train = titan_passes::lower_to_train(&model, &train_options()).expect("spmd lowering");
    let graph = dir.join("spmd.ir");
    std::fs::write(&graph, titan_ir::print::print_graph(&train)).expect("write the graph");
    let ckpt = dir.join("after");
    let (g, c) = (graph.display().to_string(), ckpt.display().to_string());
    let out = titan_run(&[&g, "--init-from", &weights, "--steps", "2", "--skip-nonfinite-steps", "--checkpoint-dir", &c]);
    let e = printed(&out);
    assert!(out.status.success() && e.contains("simulated cpu mesh of 4 ranks") && e.contains("2 of 2 steps skipped"), "{e}");
    assert_eq!(tensors(&ckpt.join("step-2").join(MODEL_FILE)), tensors(Path::new(&weights)));
}
