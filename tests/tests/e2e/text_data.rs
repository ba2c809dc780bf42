//! Text through a tokenizer, end to end on the CPU backend: the debug model with its vocabulary
//! raised to a tokenizer trained here (`titan_data::testing`, 512 tokens) trains on the bundled
//! corpus through `titan-run --tokenizer`; a run resumed from a checkpoint continues with the
//! same tokens as an uninterrupted one (the stream position in `trainer_state.json`); shards
//! written by `titanc data tokenize` train exactly as the text they came from; a model whose
//! vocabulary is smaller than the tokenizer's is refused.

use std::path::Path;
use std::process::{Command, Output};

use crate::common::{Scratch, scratch};
use titan_compiler::build::{BuildOptions, build_artifact};
use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_passes::TrainOptions;
use titan_runtime::BUNDLED_CORPUS;

const TITAN_RUN: &str = env!("CARGO_BIN_EXE_titan-run-e2e");
const VOCAB: u64 = 512;

fn titan_run(args: &[&str]) -> Output {
    Command::new(TITAN_RUN).args(args).output().expect("run titan-run-e2e")
}

fn printed(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A scratch directory with `tokenizer.json` (trained on the bundled corpus), `corpus.jsonl`
/// (the corpus's paragraphs, one document each) and the debug model's artifact with vocabulary
/// `vocab` in `artifact/`.
fn setup(name: &str, vocab: u64, steps: u64) -> Scratch {
    let dir = scratch("text-data", name);
    std::fs::create_dir_all(dir.join("text")).expect("scratch");
    let json = titan_data::testing::train_bpe_json(&[BUNDLED_CORPUS], VOCAB as usize).expect("train the tokenizer");
    std::fs::write(dir.join("tokenizer.json"), json).expect("write the tokenizer");
    let docs: String = BUNDLED_CORPUS.split("\n\n").filter(|p| !p.trim().is_empty()).map(|p| format!("{}\n", serde_json::json!({ "text": p }))).collect();
    std::fs::write(dir.join("text").join("corpus.jsonl"), docs).expect("write the corpus");
    let model = build_llama3(&LlamaConfig { vocab_size: vocab, ..LlamaConfig::preset(Preset::Debug) }, "llama3_debug").expect("debug model");
    let train = TrainOptions {
        lr: 3e-3,
        warmup_steps: 5,
        decay_steps: steps - 5,
        decay: titan_ir::DecayKind::Cosine,
        min_lr_ratio: 0.1,
        weight_decay: 0.01,
        ..TrainOptions::default()
    };
    let opts = BuildOptions { train, ..BuildOptions::default() };
    build_artifact(&model, &titan_ir::print::print_graph(&model), &opts, &dir.join("artifact")).expect("build");
    dir
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// The losses of a `--metrics` file, by step.
fn losses(path: &Path) -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string(path).expect("read metrics");
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json line");
            (v["step"].as_u64().expect("step"), v["loss"].as_f64().expect("loss").to_bits())
        })
        .collect()
}

#[test]
fn debug_model_trains_on_the_bundled_corpus_through_a_tokenizer() {
    let steps = 60;
    let dir = setup("train", VOCAB, steps);
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/data/tiny_corpus.txt");
    let metrics = dir.join("m.jsonl");
    let args = [&s(&dir.join("artifact")), "--data", &s(&corpus), "--tokenizer", &s(&dir.join("tokenizer.json")), "--steps", "60", "--metrics", &s(&metrics)];
    let out = titan_run(&args);
    let e = printed(&out);
    assert!(out.status.success(), "{e}");
    assert!(e.contains("tokenizer") && e.contains("(512 tokens, BOS <|begin_of_text|> (0), EOS <|end_of_text|> (1))"), "{e}");
    assert!(e.contains("packed in order into windows of seq + 1 = 65 tokens"), "{e}");
    let l: Vec<f64> = losses(&metrics).iter().map(|&(_, b)| f64::from_bits(b)).collect();
    let ln_vocab = (VOCAB as f64).ln();
    let last10 = l[l.len() - 10..].iter().sum::<f64>() / 10.0;
    println!("loss: first {:.4}, mean of the last 10 {last10:.4}, ln(512) = {ln_vocab:.4}", l[0]);
    assert!((l[0] - ln_vocab).abs() < 1.0, "the untrained model starts near ln(vocab): {}", l[0]);
    // 6.72 -> 4.91 when written: a 512-token BPE token carries ~3.4 bytes, so the loss per token
    // stays well above the byte-level model's (`train_debug.rs`).
    assert!(last10 < l[0] - 1.5, "the loss did not fall by 1.5: first {:.4}, last 10 {last10:.4}", l[0]);
}

/// 16 steps with a checkpoint at 8, then a run resumed from it: steps 9 to 16 have bit-identical
/// losses, because the checkpoint names the stream position (file, byte offset, document).
#[test]
fn a_resumed_run_continues_with_the_same_tokens() {
    let dir = setup("resume", VOCAB, 16);
    let (art, tok, text) = (s(&dir.join("artifact")), s(&dir.join("tokenizer.json")), s(&dir.join("text")));
    let (full, first, second, ckpt) = (dir.join("full.jsonl"), dir.join("first.jsonl"), dir.join("second.jsonl"), dir.join("ckpt"));
    let base = ["--data", &text, "--tokenizer", &tok, "--seed", "3"];
    let run = |extra: &[&str]| {
        let out = titan_run(&[&[art.as_str()], &base[..], extra].concat());
        assert!(out.status.success(), "{}", printed(&out));
    };
    run(&["--steps", "16", "--metrics", &s(&full)]);
    run(&["--steps", "8", "--metrics", &s(&first), "--checkpoint-dir", &s(&ckpt)]);
    let state: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ckpt.join("step-8/trainer_state.json")).expect("state")).expect("json");
    let pos = &state["data_stream"];
    assert!(pos["path"].as_str().expect("path").ends_with("corpus.jsonl"), "{state}");
    assert!(pos["offset"].as_u64().expect("offset") > 0 && pos["document"].as_u64().expect("document") > 0, "{state}");
    assert_eq!(state["data_position"], 8);
    run(&["--steps", "16", "--metrics", &s(&second), "--resume", &s(&ckpt)]);
    let want = losses(&full);
    assert_eq!(losses(&first), want[..8]);
    assert_eq!(losses(&second), want[8..], "the resumed steps see the uninterrupted run's tokens");

    // Resuming over other data is refused, naming the recorded file.
    let out = titan_run(&[art.as_str(), "--steps", "16", "--resume", &s(&ckpt)]);
    let e = printed(&out);
    assert!(!out.status.success() && e.contains("the checkpoint was written by a run over packed data, next at `"), "{e}");
}

/// `titanc data tokenize` then `titan-run --data SHARDS`: the same losses as the text itself.
#[test]
fn tokenized_shards_train_as_the_text_they_came_from() {
    let dir = setup("shards", VOCAB, 10);
    let (art, tok, text, shards) = (s(&dir.join("artifact")), s(&dir.join("tokenizer.json")), s(&dir.join("text")), s(&dir.join("shards")));
    let out =
        titan_compiler::cli::run_args(["titanc", "data", "tokenize", &text, "--tokenizer", &tok, "-o", &shards, "--shard-tokens", "2000"]).expect("tokenize");
    assert!(out.stdout.contains(" documents, ") && out.stdout.contains("tokens per document") && out.stdout.contains("tokens/s"), "{}", out.stdout);
    assert!(std::fs::metadata(dir.join("shards/train_000001.bin")).is_ok(), "several shards: {}", out.stdout);
    let (a, b) = (dir.join("a.jsonl"), dir.join("b.jsonl"));
    let ok = |o: Output| assert!(o.status.success(), "{}", printed(&o));
    ok(titan_run(&[&art, "--data", &text, "--tokenizer", &tok, "--steps", "10", "--metrics", &s(&a)]));
    ok(titan_run(&[&art, "--data", &shards, "--steps", "10", "--metrics", &s(&b)]));
    assert_eq!(losses(&a), losses(&b));
}

#[test]
fn a_model_vocabulary_smaller_than_the_tokenizer_is_refused() {
    let dir = setup("vocab", 256, 10);
    let tok = dir.join("tokenizer.json");
    let out = titan_run(&[&s(&dir.join("artifact")), "--data", &s(&dir.join("text")), "--tokenizer", &s(&tok), "--steps", "2"]);
    let e = printed(&out);
    assert!(!out.status.success(), "{e}");
    assert!(e.contains(&format!("the tokenizer `{}` has 512 tokens but the model's vocabulary has 256", tok.display())), "{e}");
    // JSON Lines without a tokenizer would train on the JSON syntax byte by byte: refused.
    let out = titan_run(&[&s(&dir.join("artifact")), "--data", &s(&dir.join("text/corpus.jsonl")), "--steps", "2"]);
    let e = printed(&out);
    assert!(!out.status.success() && e.contains("is JSON Lines: pass --tokenizer tokenizer.json"), "{e}");
}
