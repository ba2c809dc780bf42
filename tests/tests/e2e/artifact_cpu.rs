//! Artifacts built by `titanc build` (through `build_artifact`) run on the runtime's CPU backend
//! and match the unfused training graph run whole on the interpreter (graph mode): same
//! initialization, same batches, the losses of 5 steps (2 for the 8B-shaped model) and every
//! state buffer after them.
//!
//! Both run the same ops in the same order on the same interpreter (`eval_op` with bf16
//! rounding emulated), and the artifact stores every value in its own dtype, which holds the
//! values the interpreter produced exactly (bf16 results are already rounded to bf16). So the
//! expected difference is zero, in f32 and in bf16; the tests demand identical bits and print
//! the largest difference they measured.

use std::path::Path;
use std::time::Instant;

use crate::common::{Scratch, scratch};
use titan_compiler::build::{BuildOptions, build_artifact};
use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::artifact::{BufRef, EVAL_GRAPH_FILE, GRAPH_FILE, MANIFEST_FILE, Manifest, Step};
use titan_ir::{DType, DecayKind, Graph};
use titan_passes::{TrainOptions, lower_to_train};
use titan_runtime::{Artifact, BUNDLED_CORPUS, Batcher, CpuArtifactTrainer, CpuTrainer, Trainer, byte_tokens};

/// The training settings of `scripts/demo.sh` for `steps` steps.
fn demo_options(steps: u64) -> TrainOptions {
    TrainOptions {
        lr: 3e-3,
        warmup_steps: 10,
        decay_steps: steps - 10,
        decay: DecayKind::Cosine,
        min_lr_ratio: 0.1,
        weight_decay: 0.01,
        ..TrainOptions::default()
    }
}

fn out_dir(name: &str) -> Scratch {
    scratch("artifact-cpu", name)
}

/// `titanc build` of `model` into a fresh directory.
fn build(model: &Graph, train: &TrainOptions, name: &str) -> Scratch {
    let dir = out_dir(name);
    let text = titan_ir::print::print_graph(model);
    let opts = BuildOptions { train: train.clone(), ..BuildOptions::default() };
    build_artifact(model, &text, &opts, &dir).unwrap_or_else(|e| panic!("building {name}: {e}"));
    dir
}

fn debug_model(dtype: DType) -> Graph {
    build_llama3(&LlamaConfig { dtype, ..LlamaConfig::preset(Preset::Debug) }, "llama3_debug").expect("debug model")
}

/// A state buffer after training: its values' bits, or only a fingerprint of them when the
/// model is too large to keep two copies around.
#[derive(Debug, PartialEq)]
enum Snapshot {
    Bits(Vec<u32>),
    Fingerprint { len: usize, fnv: u64 },
}

fn fnv(bits: impl Iterator<Item = u32>) -> (usize, u64) {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut n = 0;
    for b in bits {
        for byte in b.to_le_bytes() {
            h ^= u64::from(byte);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
        n += 1;
    }
    (n, h)
}

/// The losses of `steps` steps and every state afterwards, by checkpoint name.
struct Run {
    losses: Vec<f64>,
    states: Vec<(String, Snapshot)>,
    secs_per_step: f64,
}

fn run(t: &mut dyn Trainer, steps: usize, seed: u64, fingerprint: bool) -> Run {
    let mut batcher = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), t.batch_size(), t.seq_len(), seed).expect("batcher");
    let start = Instant::now();
    let losses = (0..steps).map(|_| t.step(&batcher.next_batch()).expect("step").loss).collect();
    let secs = start.elapsed().as_secs_f64();
    let mut states: Vec<(String, Snapshot)> = t
        .states()
        .expect("states")
        .into_iter()
        .map(|(name, s)| {
            let xs = s.floats().expect("float state");
            let snap = if fingerprint {
                let (len, fnv) = fnv(xs.iter().map(|x| x.to_bits()));
                Snapshot::Fingerprint { len, fnv }
            } else {
                Snapshot::Bits(xs.iter().map(|x| x.to_bits()).collect())
            };
            (name, snap)
        })
        .collect();
    states.sort_by(|a, b| a.0.cmp(&b.0));
    Run { losses, states, secs_per_step: secs / steps.max(1) as f64 }
}

/// Graph mode on the unfused training graph of `model`.
fn graph_mode(model: &Graph, train: &TrainOptions, steps: usize, seed: u64, fingerprint: bool) -> Run {
    let g = lower_to_train(model, train).expect("lowering");
    let mut t = CpuTrainer::new(&g, seed).expect("graph trainer");
    run(&mut t, steps, seed, fingerprint)
}

fn artifact_mode(dir: &Path, steps: usize, seed: u64, fingerprint: bool) -> Run {
    let a = Artifact::load(dir).expect("load artifact");
    let mut t = CpuArtifactTrainer::new(&a, seed).expect("artifact trainer");
    run(&mut t, steps, seed, fingerprint)
}

/// The largest relative difference between two bit vectors of f32 values (0 when identical).
fn max_rel_diff(a: &[u32], b: &[u32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| {
            let (x, y) = (f64::from(f32::from_bits(x)), f64::from(f32::from_bits(y)));
            if x == y { 0.0 } else { (x - y).abs() / x.abs().max(y.abs()).max(1e-30) }
        })
        .fold(0.0, f64::max)
}

/// Compare two runs: identical losses and identical state bits, with a report of what differs.
fn assert_identical(what: &str, want: &Run, got: &Run) {
    let loss_diff = want.losses.iter().zip(&got.losses).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    println!("{what}: losses {:?}", got.losses);
    println!("{what}: {:.3} s/step in graph mode, {:.3} s/step on the artifact", want.secs_per_step, got.secs_per_step);
    println!("{what}: max |loss difference| {loss_diff:e}");
    assert_eq!(want.states.len(), got.states.len(), "{what}: number of state buffers");
    let mut differing = Vec::new();
    let mut worst = 0.0f64;
    for ((n1, s1), (n2, s2)) in want.states.iter().zip(&got.states) {
        assert_eq!(n1, n2, "{what}: the same state names");
        if s1 != s2 {
            if let (Snapshot::Bits(a), Snapshot::Bits(b)) = (s1, s2) {
                worst = worst.max(max_rel_diff(a, b));
            }
            differing.push(n1.clone());
        }
    }
    println!("{what}: {} state buffers, {} differ, max relative difference {worst:e}", want.states.len(), differing.len());
    assert_eq!(want.losses, got.losses, "{what}: losses differ from graph mode");
    assert!(differing.is_empty(), "{what}: state buffers differ from graph mode (max relative difference {worst:e}): {differing:?}");
}

#[test]
fn debug_f32_artifact_matches_graph_mode_bit_for_bit() {
    let model = debug_model(DType::F32);
    let train = demo_options(200);
    let dir = build(&model, &train, "debug-f32");
    let want = graph_mode(&model, &train, 5, 7, false);
    let got = artifact_mode(&dir, 5, 7, false);
    assert_identical("debug f32", &want, &got);
}

#[test]
fn debug_bf16_artifact_matches_graph_mode_bit_for_bit() {
    let model = debug_model(DType::BF16);
    let train = demo_options(200);
    let dir = build(&model, &train, "debug-bf16");
    let want = graph_mode(&model, &train, 5, 11, false);
    let got = artifact_mode(&dir, 5, 11, false);
    assert_identical("debug bf16", &want, &got);
}

/// Tied embeddings: the table's gradient is the head's weight gradient plus the embedding's
/// `scatter_add`, one kernel writing over the head gradient's buffer (fusion rule 12).
#[test]
fn tied_debug_bf16_artifact_matches_graph_mode_bit_for_bit() {
    let model =
        build_llama3(&LlamaConfig { dtype: DType::BF16, tie_embeddings: true, ..LlamaConfig::preset(Preset::Debug) }, "llama3_debug_tied").expect("tied model");
    let train = demo_options(200);
    let dir = build(&model, &train, "debug-tied-bf16");
    let want = graph_mode(&model, &train, 5, 13, false);
    let got = artifact_mode(&dir, 5, 13, false);
    assert_identical("tied debug bf16", &want, &got);
}

/// A layer of Llama-3 8B's shape (dim 4096, 32 heads, 8 kv heads, ffn 14336) on 4 tokens and a
/// 512-entry vocabulary: 218M parameters, so the states are compared by fingerprint (FNV-1a of
/// their bits) rather than kept twice. One layer gives every kernel the 8B shapes; the layer
/// loop over several layers is the debug model's tests' (two layers here cost CI minutes).
#[test]
fn an_8b_layer_f32_artifact_matches_graph_mode_bit_for_bit() {
    let cfg = LlamaConfig { n_layers: 1, seq_len: 4, batch_size: 1, vocab_size: 512, dtype: DType::F32, ..LlamaConfig::preset(Preset::B8) };
    let model = build_llama3(&cfg, "llama3_8b_1l").expect("8b-shaped model");
    let train = TrainOptions::default();
    let dir = build(&model, &train, "8b-1l");
    // Two steps: the second reads the AdamW moments the first wrote.
    let want = graph_mode(&model, &train, 2, 1, true);
    let got = artifact_mode(&dir, 2, 1, true);
    assert_identical("8b-shaped layer f32", &want, &got);
}

#[test]
fn debug_artifact_trains_for_200_steps() {
    let steps = 200;
    let dir = build(&debug_model(DType::BF16), &demo_options(steps), "debug-200");
    let a = Artifact::load(&dir).expect("load");
    let mut t = CpuArtifactTrainer::new(&a, 0).expect("trainer");
    let mut batcher = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), t.batch_size(), t.seq_len(), 0).expect("batcher");
    let losses: Vec<f64> = (0..steps).map(|_| t.step(&batcher.next_batch()).expect("step").loss).collect();
    let first = losses[0];
    let last10 = losses[190..].iter().sum::<f64>() / 10.0;
    println!("debug artifact: first loss {first:.4}, mean of the last 10 {last10:.4}");
    assert!(losses.iter().all(|l| l.is_finite()));
    assert!((first - 256f64.ln()).abs() < 1.0, "the untrained model should be near ln(256): {first}");
    assert!(last10 < 0.5 * 256f64.ln(), "loss did not fall below half of ln(256): first {first:.4}, last 10 {last10:.4}");
}

/// Load a copy of the artifact in `base` whose manifest went through `edit`.
fn load_edited(base: &Path, name: &str, edit: impl Fn(&mut Manifest)) -> String {
    let dir = out_dir(name);
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::copy(base.join(GRAPH_FILE), dir.join(GRAPH_FILE)).expect("copy graph.ir");
    std::fs::copy(base.join(EVAL_GRAPH_FILE), dir.join(EVAL_GRAPH_FILE)).expect("copy eval.ir");
    // The kernels too (PTX and cubins), so only the edit can make the load fail.
    let kernels = base.join(titan_ir::artifact::KERNEL_DIR);
    if kernels.is_dir() {
        std::fs::create_dir_all(dir.join(titan_ir::artifact::KERNEL_DIR)).expect("mkdir kernels");
        for f in std::fs::read_dir(&kernels).expect("list kernels") {
            let f = f.expect("entry").path();
            std::fs::copy(&f, dir.join(titan_ir::artifact::KERNEL_DIR).join(f.file_name().expect("name"))).expect("copy kernel");
        }
    }
    let text = std::fs::read_to_string(base.join(MANIFEST_FILE)).expect("read manifest");
    let mut m = Manifest::from_json("manifest.json", &text).expect("the real manifest parses");
    edit(&mut m);
    std::fs::write(dir.join(MANIFEST_FILE), m.to_json()).expect("write manifest");
    Artifact::load(&dir).expect_err("the edited artifact must not load").to_string()
}

/// The first launch step of rank 0.
fn first_launch(m: &mut Manifest) -> &mut Vec<BufRef> {
    m.ranks[0]
        .steps
        .iter_mut()
        .find_map(|s| match s {
            Step::Launch { inputs, .. } => Some(inputs),
            _ => None,
        })
        .expect("a launch step")
}

#[test]
fn loading_a_real_artifact_reports_each_problem() {
    let base = build(&debug_model(DType::BF16), &demo_options(200), "debug-errors");
    Artifact::load(&base).expect("the real artifact loads");

    let e = Artifact::load(base.join("missing")).expect_err("missing dir").to_string();
    assert!(e.contains("no such directory") && e.contains("titanc build"), "{e}");

    let e = load_edited(&base, "version", |m| m.format_version = 42);
    assert!(e.contains("format version 42 is not supported") && e.contains("rebuild"), "{e}");

    let e = load_edited(&base, "target", |m| m.target.arch = "sm_100a".into());
    assert!(e.contains("built for sm_100a") && e.contains("titanc build --target sm_90a"), "{e}");

    let e = load_edited(&base, "bufref", |m| first_launch(m)[0] = BufRef::Buffer { buffer: 999_999, layer: false });
    assert!(e.contains("buffer 999999 does not exist"), "{e}");

    let dir = out_dir("corrupt");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::copy(base.join(GRAPH_FILE), dir.join(GRAPH_FILE)).expect("copy");
    let text = std::fs::read_to_string(base.join(MANIFEST_FILE)).expect("read");
    std::fs::write(dir.join(MANIFEST_FILE), &text[..text.len() / 2]).expect("write");
    let e = Artifact::load(&dir).expect_err("corrupt json").to_string();
    assert!(e.contains("is not a titan manifest"), "{e}");
}
