//! Checkpoints, token files and the per-step log on hand-built artifacts and small training
//! graphs: save -> load round trips of every tensor, Hugging Face names and the per-layer split,
//! bit-identical resumption (library and `titan-run`), `--init-from` (f32 and bf16/f16 files),
//! the errors a mismatched checkpoint or a bad token file gets, and `--metrics`.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::Command;

use common::{BIGRAM_IR, Scratch, bigram, looped, looped_ir, temp_dir};
use safetensors::{Dtype, tensor::TensorView};
use titan_ir::DType;
use titan_runtime::checkpoint::{self, CHECKPOINT_FORMAT_VERSION, CheckpointError, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, TrainerState};
use titan_runtime::data::{DataFormat, LLMC_MAGIC, load_tokens};
use titan_runtime::{Artifact, BUNDLED_CORPUS, Batcher, CpuArtifactTrainer, CpuTrainer, Trainer, byte_tokens};

/// Every state's bits by checkpoint name.
fn bits(t: &dyn Trainer) -> BTreeMap<String, Vec<u32>> {
    t.states().expect("states").into_iter().map(|(n, s)| (n, s.floats().expect("float state").iter().map(|x| x.to_bits()).collect())).collect()
}

fn batcher(t: &dyn Trainer, seed: u64) -> Batcher {
    Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), t.batch_size(), t.seq_len(), seed).expect("batcher")
}

fn state(step: u64, seed: u64, hash: &str) -> TrainerState {
    TrainerState {
        format_version: CHECKPOINT_FORMAT_VERSION,
        step,
        seed,
        data_position: step,
        data_stream: None,
        content_hash: hash.into(),
        data: "bundled corpus".into(),
        mesh: Default::default(),
        model_hash: None,
        model_config: Default::default(),
    }
}

fn bigram_dir(name: &str) -> Scratch {
    let dir = temp_dir(name);
    bigram().write(&dir, BIGRAM_IR);
    dir
}

/// States named like TorchTitan's Llama (stacked per-layer ones with `{i}`), for the names and
/// the split; the step itself only sums the final norm.
const NAMES_IR: &str = r#"graph @names {
  meta {vocab_size = 256}
  dims {batch = 1, seq = 4}

  func @main {
    input %tokens : i32[batch, seq]
    input %targets : i32[batch, seq]
    input %step : i32[]
    state %emb : f32[256, 4] {name = "tok_embeddings.weight", init = normal(0.02)}
    state %wq : f32[3, 6, 4] {name = "layers.{i}.attention.wq.weight", init = normal(0.02)}
    state %w2 : f32[3, 4, 8] {name = "layers.{i}.feed_forward.w2.weight", init = normal(0.02)}
    state %an : f32[3, 4] {name = "layers.{i}.attention_norm.weight", init = normal(1.0)}
    state %norm : f32[4] {name = "norm.weight", init = normal(1.0)}
    state %out : f32[256, 4] {name = "output.weight", init = normal(0.02)}
    state %out_m : f32[256, 4] {name = "output.weight.exp_avg", init = normal(1.0)}
    state %wq_v : f32[3, 6, 4] {name = "layers.{i}.attention.wq.weight.exp_avg_sq", init = normal(1.0)}
    %loss = reduce_sum(%norm) {axes = [0]} : f32[]
    output loss = %loss
  }
}
"#;

#[test]
fn checkpoints_use_hf_names_and_split_layers() {
    let g = titan_ir::parse_and_verify("names.ir", NAMES_IR).expect("graph");
    let t = CpuTrainer::new(&g, 5).expect("trainer");
    let dir = temp_dir("ckpt-names");
    let written = checkpoint::save(&dir, &t, &state(0, 5, "h")).expect("save");
    assert_eq!(written, dir.join("step-0"));
    let model = checkpoint::read_safetensors(&written.join(MODEL_FILE)).expect("model");
    let mut want: Vec<String> = vec!["model.embed_tokens.weight".into(), "model.norm.weight".into(), "lm_head.weight".into()];
    for l in 0..3 {
        want.push(format!("model.layers.{l}.self_attn.q_proj.weight"));
        want.push(format!("model.layers.{l}.mlp.down_proj.weight"));
        want.push(format!("model.layers.{l}.input_layernorm.weight"));
    }
    want.sort();
    assert_eq!(model.keys().cloned().collect::<Vec<_>>(), want);
    let states: BTreeMap<String, _> = Trainer::states(&t).expect("states").into_iter().collect();
    let wq = &states["layers.{i}.attention.wq.weight"];
    for l in 0..3 {
        let got = &model[&format!("model.layers.{l}.self_attn.q_proj.weight")];
        assert_eq!(got.shape, vec![6, 4]);
        assert_eq!(got.values, wq.floats().expect("floats")[l * 24..(l + 1) * 24], "layer {l} slice");
    }
    assert_eq!(model["model.layers.2.mlp.down_proj.weight"].shape, vec![4, 8]);
    let optimizer = checkpoint::read_safetensors(&written.join(OPTIMIZER_FILE)).expect("optimizer");
    let names: Vec<&String> = optimizer.keys().collect();
    assert_eq!(
        names,
        [
            "lm_head.weight.exp_avg",
            "model.layers.0.self_attn.q_proj.weight.exp_avg_sq",
            "model.layers.1.self_attn.q_proj.weight.exp_avg_sq",
            "model.layers.2.self_attn.q_proj.weight.exp_avg_sq"
        ]
    );
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(written.join(STATE_FILE)).expect("state")).expect("json");
    assert_eq!((json["format_version"].as_u64(), json["seed"].as_u64(), json["content_hash"].as_str()), (Some(1), Some(5), Some("h")));
}

#[test]
fn every_tensor_round_trips_through_a_checkpoint() {
    let g = titan_ir::parse_and_verify("names.ir", NAMES_IR).expect("graph");
    let a = CpuTrainer::new(&g, 1).expect("trainer");
    let mut b = CpuTrainer::new(&g, 2).expect("trainer");
    assert_ne!(bits(&a), bits(&b));
    let dir = temp_dir("ckpt-roundtrip");
    checkpoint::save(&dir, &a, &state(7, 1, "h")).expect("save");
    let (at, st) = checkpoint::resume(&dir, &mut b, "h", false).expect("resume the latest");
    assert_eq!((at, st.step), (dir.join("step-7"), 7));
    assert_eq!(bits(&a), bits(&b));
    assert_eq!(b.steps_done(), 7);

    // The same on an artifact with a stacked state buffer.
    let lp = looped(DType::BF16);
    let adir = temp_dir("ckpt-roundtrip-art");
    lp.fixture.write(&adir, &looped_ir("bf16"));
    let art = Artifact::load(&adir).expect("load");
    let x = CpuArtifactTrainer::new(&art, 3).expect("trainer");
    let mut y = CpuArtifactTrainer::new(&art, 4).expect("trainer");
    checkpoint::save(&dir, &x, &state(2, 3, "h")).expect("save");
    let model = checkpoint::read_safetensors(&dir.join("step-2").join(MODEL_FILE)).expect("model");
    assert!(model.contains_key("layers.0.w") && model.contains_key("layers.2.w") && model.contains_key("emb"), "{:?}", model.keys());
    checkpoint::resume(&dir.join("step-2"), &mut y, "h", false).expect("resume");
    assert_eq!(bits(&x), bits(&y));
}

#[test]
fn a_resumed_run_matches_an_uninterrupted_one_bit_for_bit() {
    let dir = bigram_dir("ckpt-resume");
    let art = Artifact::load(&dir).expect("load");
    let hash = art.manifest.content_hash.clone();
    let seed = 11;
    let mut full = CpuArtifactTrainer::new(&art, seed).expect("trainer");
    let mut data = batcher(&full, seed);
    let want: Vec<f64> = (0..8).map(|_| full.step(&data.next_batch()).expect("step").loss).collect();

    let ckpt = temp_dir("ckpt-resume-out");
    let mut first = CpuArtifactTrainer::new(&art, seed).expect("trainer");
    let mut data = batcher(&first, seed);
    let mut got: Vec<f64> = (0..4).map(|_| first.step(&data.next_batch()).expect("step").loss).collect();
    checkpoint::save(&ckpt, &first, &TrainerState { data_position: data.position(), ..state(4, seed, &hash) }).expect("save");
    drop(first);

    let mut second = CpuArtifactTrainer::new(&art, 999).expect("trainer");
    let (_, st) = checkpoint::resume(&ckpt, &mut second, &hash, false).expect("resume");
    let mut data = batcher(&second, st.seed);
    data.seek(st.data_position);
    got.extend((0..4).map(|_| second.step(&data.next_batch()).expect("step").loss));
    assert_eq!(got, want, "losses");
    assert_eq!(bits(&second), bits(&full), "final states");
}

#[test]
fn init_from_loads_parameters_only() {
    let dir = bigram_dir("ckpt-init");
    let art = Artifact::load(&dir).expect("load");
    let mut a = CpuArtifactTrainer::new(&art, 1).expect("trainer");
    let mut data = batcher(&a, 1);
    for _ in 0..3 {
        a.step(&data.next_batch()).expect("step");
    }
    let ckpt = temp_dir("ckpt-init-out");
    let written = checkpoint::save(&ckpt, &a, &state(3, 1, "h")).expect("save");
    let mut b = CpuArtifactTrainer::new(&art, 2).expect("trainer");
    checkpoint::init_from(&written.join(MODEL_FILE), &mut b).expect("init from");
    let (sa, sb) = (bits(&a), bits(&b));
    assert_eq!(sa["w"], sb["w"], "parameters reproduced");
    assert!(sa["w.exp_avg"].iter().any(|&x| x != 0), "the trained moments are not zero");
    assert!(sb["w.exp_avg"].iter().chain(&sb["w.exp_avg_sq"]).all(|&x| x == 0), "moments start at zero");
    assert_eq!(b.steps_done(), 0);
}

/// Write `tensors` (name, shape, f32 values) to a safetensors file in `dtype`.
fn write_converted(path: &Path, tensors: &[(&str, Vec<usize>, Vec<f32>)], dtype: Dtype) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| match dtype {
            Dtype::BF16 => v.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
            Dtype::F16 => v.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect(),
            Dtype::I32 => v.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect(),
            _ => v.iter().flat_map(|&x| x.to_le_bytes()).collect(),
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> =
        tensors.iter().zip(&bytes).map(|((n, s, _), b)| (n.to_string(), TensorView::new(dtype, s.clone(), b).expect("view"))).collect();
    safetensors::serialize_to_file(views, None::<HashMap<String, String>>, path).expect("write safetensors");
}

#[test]
fn init_from_converts_bf16_and_f16_tensors() {
    let g = titan_ir::parse_and_verify("names.ir", NAMES_IR).expect("graph");
    let src = CpuTrainer::new(&g, 9).expect("trainer");
    let dir = temp_dir("ckpt-convert");
    let written = checkpoint::save(&dir, &src, &state(0, 9, "h")).expect("save");
    let model = checkpoint::read_safetensors(&written.join(MODEL_FILE)).expect("model");
    for (dtype, round) in [(Dtype::BF16, (|x: f32| half::bf16::from_f32(x).to_f32()) as fn(f32) -> f32), (Dtype::F16, |x: f32| half::f16::from_f32(x).to_f32())]
    {
        let tensors: Vec<(&str, Vec<usize>, Vec<f32>)> = model.values().map(|t| (t.name.as_str(), t.shape.clone(), t.values.clone())).collect();
        let path = dir.join(format!("{dtype:?}.safetensors"));
        write_converted(&path, &tensors, dtype);
        let mut dst = CpuTrainer::new(&g, 10).expect("trainer");
        checkpoint::init_from(&path, &mut dst).expect("init from a converted file");
        let got: BTreeMap<String, _> = Trainer::states(&dst).expect("states").into_iter().collect();
        let want: BTreeMap<String, _> = Trainer::states(&src).expect("states").into_iter().collect();
        let n = &got["norm.weight"];
        let expect: Vec<f32> = want["norm.weight"].floats().expect("floats").iter().map(|&x| round(x)).collect();
        assert_eq!(n.floats().expect("floats"), expect.as_slice(), "{dtype:?}");
    }
    let bad = dir.join("ints.safetensors");
    write_converted(&bad, &[("model.norm.weight", vec![4], vec![1.0; 4])], Dtype::I32);
    let mut dst = CpuTrainer::new(&g, 10).expect("trainer");
    let e = checkpoint::init_from(&bad, &mut dst).unwrap_err().to_string();
    assert!(e.contains("tensor `model.norm.weight` is I32") && e.contains("F32, BF16 and F16"), "{e}");
}

#[test]
fn mismatched_checkpoints_are_refused_with_the_tensor_named() {
    let g = titan_ir::parse_and_verify("names.ir", NAMES_IR).expect("graph");
    let t = CpuTrainer::new(&g, 9).expect("trainer");
    let dir = temp_dir("ckpt-mismatch");
    let written = checkpoint::save(&dir, &t, &state(4, 9, "hash-a")).expect("save");
    let model = checkpoint::read_safetensors(&written.join(MODEL_FILE)).expect("model");
    let all: Vec<(&str, Vec<usize>, Vec<f32>)> = model.values().map(|t| (t.name.as_str(), t.shape.clone(), t.values.clone())).collect();
    let init = |tensors: &[(&str, Vec<usize>, Vec<f32>)], name: &str| {
        let path = dir.join(name);
        write_converted(&path, tensors, Dtype::F32);
        let mut dst = CpuTrainer::new(&g, 1).expect("trainer");
        checkpoint::init_from(&path, &mut dst).unwrap_err().to_string()
    };

    let missing: Vec<_> = all.iter().filter(|t| t.0 != "model.layers.1.mlp.down_proj.weight").cloned().collect();
    let e = init(&missing, "missing.safetensors");
    assert!(e.contains("has no tensor `model.layers.1.mlp.down_proj.weight`"), "{e}");

    let mut extra = all.clone();
    extra.push(("model.layers.3.input_layernorm.weight", vec![4], vec![0.0; 4]));
    let e = init(&extra, "extra.safetensors");
    assert!(e.contains("the model does not have, the first `model.layers.3.input_layernorm.weight`"), "{e}");

    let mut shaped = all.clone();
    let i = shaped.iter().position(|t| t.0 == "model.norm.weight").expect("norm");
    shaped[i] = ("model.norm.weight", vec![2, 2], vec![0.0; 4]);
    let e = init(&shaped, "shape.safetensors");
    assert!(e.contains("tensor `model.norm.weight`") && e.contains("has shape [2, 2], the model's is [4]"), "{e}");

    // Another build: refused unless allowed.
    let mut dst = CpuTrainer::new(&g, 1).expect("trainer");
    let e = checkpoint::resume(&written, &mut dst, "hash-b", false).unwrap_err();
    assert!(matches!(e, CheckpointError::DifferentBuild { .. }), "{e}");
    assert!(e.to_string().contains("--allow-different-build") && e.to_string().contains("hash-a"), "{e}");
    checkpoint::resume(&written, &mut dst, "hash-b", true).expect("allowed");

    // Another model: the bigram's `w` is not in it.
    let bdir = bigram_dir("ckpt-mismatch-bigram");
    let art = Artifact::load(&bdir).expect("load");
    let mut other = CpuArtifactTrainer::new(&art, 0).expect("trainer");
    let e = checkpoint::resume(&written, &mut other, "hash-a", false).unwrap_err().to_string();
    assert!(e.contains("has no tensor `w`"), "{e}");

    let empty = temp_dir("ckpt-empty");
    let e = checkpoint::resume(&empty, &mut dst, "h", false).unwrap_err().to_string();
    assert!(e.contains("holds no checkpoint"), "{e}");

    let st = written.join(STATE_FILE);
    std::fs::write(&st, std::fs::read_to_string(&st).expect("read").replace("\"format_version\": 1", "\"format_version\": 9")).expect("write");
    let e = checkpoint::resume(&written, &mut dst, "hash-a", false).unwrap_err().to_string();
    assert!(e.contains("checkpoint format version 9 is not supported"), "{e}");
}

fn llmc_file(version: i32, tokens: &[u32], declared: usize) -> Vec<u8> {
    let mut h = vec![0i32; 256];
    (h[0], h[1], h[2]) = (LLMC_MAGIC, version, declared as i32);
    let mut out: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
    for &t in tokens {
        if version == 1 {
            out.extend((t as u16).to_le_bytes());
        } else {
            out.extend(t.to_le_bytes());
        }
    }
    out
}

#[test]
fn token_files_in_every_format_load_and_batch_alike() {
    let dir = temp_dir("tokens");
    let tokens = byte_tokens(BUNDLED_CORPUS.as_bytes());
    let files = [
        ("t.u16", DataFormat::U16, tokens.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect::<Vec<u8>>()),
        ("t.u32", DataFormat::U32, tokens.iter().flat_map(|&t| t.to_le_bytes()).collect()),
        ("v1.bin", DataFormat::Auto, llmc_file(1, &tokens, tokens.len())),
        ("v2.bin", DataFormat::Llmc, llmc_file(2, &tokens, tokens.len())),
        ("t.txt", DataFormat::Text, BUNDLED_CORPUS.as_bytes().to_vec()),
    ];
    let reference = Batcher::new(tokens.clone(), 4, 16, 3).expect("batcher");
    for (name, format, bytes) in files {
        let path = dir.join(name);
        std::fs::write(&path, bytes).expect("write");
        let got = load_tokens(&path, format).expect(name);
        assert_eq!(got, tokens, "{name}");
        let mut b = Batcher::new(got, 4, 16, 3).expect("batcher");
        b.seek(5);
        assert_eq!(b.next_batch(), reference.batch_at(5), "{name}");
    }
}

fn titan_run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_titan-run")).args(args).output().expect("run titan-run");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

#[test]
fn titan_run_reports_bad_token_files() {
    let art = bigram_dir("cli-tokens");
    let dir = temp_dir("cli-tokens-data");
    let mut ids: Vec<u32> = (0..100).map(|i| i % 200).collect();
    ids[42] = 300;
    let big = dir.join("big.u16");
    std::fs::write(&big, ids.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect::<Vec<u8>>()).expect("write");
    let (ok, _, e) = titan_run(&[p(&art), "--steps", "1", "--data", p(&big), "--data-format", "u16"]);
    assert!(!ok && e.contains("token id 300 at position 42") && e.contains("vocabulary of 256"), "{e}");

    let trunc = dir.join("trunc.bin");
    std::fs::write(&trunc, llmc_file(1, &[1, 2, 3], 10)).expect("write");
    let (ok, _, e) = titan_run(&[p(&art), "--steps", "1", "--data", p(&trunc)]);
    assert!(!ok && e.contains("truncated") && e.contains("declares 10 tokens but the file holds only 3"), "{e}");

    let short = dir.join("short.u32");
    std::fs::write(&short, [1u8, 0, 0]).expect("write");
    let (ok, _, e) = titan_run(&[p(&art), "--steps", "1", "--data", p(&short), "--data-format", "u32"]);
    assert!(!ok && e.contains("too short"), "{e}");

    let few = dir.join("few.u32");
    std::fs::write(&few, [1u32, 2, 3].iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).expect("write");
    let (ok, _, e) = titan_run(&[p(&art), "--steps", "1", "--data", p(&few), "--data-format", "u32"]);
    assert!(!ok && e.contains("the data has 3 tokens"), "{e}");

    let (ok, _, e) = titan_run(&[p(&art), "--steps", "1", "--data", p(&few), "--data-format", "u8"]);
    assert!(!ok && e.contains("unknown data format `u8`"), "{e}");

    let good = dir.join("good.bin");
    let tokens = byte_tokens(BUNDLED_CORPUS.as_bytes());
    std::fs::write(&good, llmc_file(2, &tokens, tokens.len())).expect("write");
    let (ok, out_llmc, e) = titan_run(&[p(&art), "--steps", "2", "--data", p(&good)]);
    assert!(ok, "{e}");
    let (ok, out_text, e) = titan_run(&[p(&art), "--steps", "2"]);
    assert!(ok, "{e}");
    let losses = |s: &str| s.lines().map(|l| l.split("  tps").next().unwrap_or_default().to_string()).collect::<Vec<_>>();
    assert_eq!(losses(&out_llmc), losses(&out_text), "the llm.c file holds the bundled corpus");
}

#[test]
fn titan_run_checkpoints_resumes_and_writes_metrics() {
    let art = bigram_dir("cli-ckpt");
    let out = temp_dir("cli-ckpt-out");
    let (full, resumed) = (out.join("full"), out.join("resumed"));
    let metrics = out.join("m.jsonl");
    let (ok, stdout_full, e) =
        titan_run(&[p(&art), "--steps", "6", "--seed", "4", "--checkpoint-dir", p(&full), "--checkpoint-every", "3", "--metrics", p(&metrics)]);
    assert!(ok, "{e}");
    assert!(full.join("step-3").join(MODEL_FILE).is_file() && full.join("step-6").join(OPTIMIZER_FILE).is_file());
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics).expect("metrics").lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    assert_eq!(lines.len(), 6);
    for key in ["step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "predicted_peak_bytes", "measured_peak_bytes", "wall_s"] {
        assert!(lines[5].get(key).is_some(), "{key} in {}", lines[5]);
    }
    assert_eq!(lines[5]["step"], 6);
    assert!(lines[0]["predicted_peak_bytes"].as_u64().is_some_and(|b| b > 0));
    assert!(stdout_full.lines().next().is_some_and(|l| l.starts_with("step:  1  loss: ") && l.contains("(predicted)  tps: ")), "{stdout_full}");

    // Copy step 3 elsewhere and resume from the checkpoint directory (its latest step).
    std::fs::create_dir_all(resumed.join("step-3")).expect("mkdir");
    for f in [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE] {
        std::fs::copy(full.join("step-3").join(f), resumed.join("step-3").join(f)).expect("copy");
    }
    let (ok, stdout_resumed, e) = titan_run(&[p(&art), "--steps", "6", "--resume", p(&resumed), "--checkpoint-dir", p(&resumed), "--metrics", p(&metrics)]);
    assert!(ok, "{e}");
    assert!(e.contains("resumed from") && e.contains("at step 3"), "{e}");
    let loss =
        |s: &str, step: &str| s.lines().find(|l| l.starts_with(&format!("step: {step:>2} "))).and_then(|l| l.split("  grad_norm").next()).map(str::to_string);
    assert_eq!(loss(&stdout_resumed, "6"), loss(&stdout_full, "6"));
    assert!(loss(&stdout_resumed, "6").is_some(), "{stdout_resumed}");
    for f in [MODEL_FILE, OPTIMIZER_FILE] {
        assert!(std::fs::read(full.join("step-6").join(f)).expect("read") == std::fs::read(resumed.join("step-6").join(f)).expect("read"), "{f} differs");
    }
    assert_eq!(std::fs::read_to_string(&metrics).expect("metrics").lines().count(), 9, "a resumed run appends");

    let (ok, _, e) = titan_run(&[p(&art), "--steps", "6", "--resume", p(&full.join("step-6"))]);
    assert!(!ok && e.contains("at step 6 already"), "{e}");
    let (ok, _, e) = titan_run(&[p(&art), "--steps", "7", "--resume", p(&full), "--seed", "5"]);
    assert!(!ok && e.contains("--seed 5 differs from the checkpoint's seed 4"), "{e}");
    let (ok, _, e) = titan_run(&[p(&art), "--checkpoint-every", "2"]);
    assert!(!ok && e.contains("needs --checkpoint-dir"), "{e}");

    // A checkpoint of another build.
    let st = full.join("step-6").join(STATE_FILE);
    let text = std::fs::read_to_string(&st).expect("read");
    let json: serde_json::Value = serde_json::from_str(&text).expect("json");
    let hash = json["content_hash"].as_str().expect("hash").to_string();
    std::fs::write(&st, text.replace(&hash, "feedface")).expect("write");
    let (ok, _, e) = titan_run(&[p(&art), "--steps", "7", "--resume", p(&full)]);
    assert!(!ok && e.contains("another build") && e.contains("--allow-different-build"), "{e}");
    let (ok, _, e) = titan_run(&[p(&art), "--steps", "7", "--resume", p(&full), "--allow-different-build"]);
    assert!(ok, "{e}");

    // --init-from the step-3 weights: a new run from step 1.
    let (ok, stdout, e) = titan_run(&[p(&art), "--steps", "1", "--init-from", p(&full.join("step-3").join(MODEL_FILE))]);
    assert!(ok && e.contains("optimizer state starts at zero") && stdout.starts_with("step:  1 "), "{e}\n{stdout}");
    let (ok, _, e) = titan_run(&[p(&art), "--steps", "7", "--resume", p(&full), "--init-from", p(&full.join("step-3").join(MODEL_FILE))]);
    assert!(!ok && e.contains("drop --init-from"), "{e}");
}

#[test]
fn graph_mode_counts_flops_from_the_meta() {
    let g = titan_ir::parse_and_verify(
        "names.ir",
        &NAMES_IR.replace("meta {vocab_size = 256}", "meta {vocab_size = 256, n_layers = 3, n_heads = 2, head_dim = 3}"),
    )
    .expect("graph");
    let t = CpuTrainer::new(&g, 0).expect("trainer");
    // Masters other than the embedding: wq 72, w2 96, attention_norm 12, norm 4, output 1024.
    assert_eq!(t.flops_per_token(), Some(6 * (72 + 96 + 12 + 4 + 1024) + 12 * 3 * 2 * 3 * 4));
    let plain = titan_ir::parse_and_verify("names.ir", NAMES_IR).expect("graph");
    assert_eq!(CpuTrainer::new(&plain, 0).expect("trainer").flops_per_token(), None);
}
