//! Validation: the eval step `titanc build` puts into the artifact (forward and loss only, its
//! memory plan bound to the training plan's) runs between training steps.
//!
//! - The debug model, its vocabulary raised to a 512-token tokenizer trained here, trains on the
//!   bundled corpus through the tokenizer with `titan-run --val-data --val-every 2 --val-steps 2`:
//!   the validation loss printed and logged at steps 1, 2 and 4 equals, bit for bit (tolerance
//!   0), the mean over the same two batches of the interpreter running the *unfused* eval graph
//!   (`titan_passes::lower_to_eval`) on the masters the artifact holds at that step.
//! - Validation does not change training: the training losses of that run are bitwise those of
//!   the same run without `--val-data`.
//! - `titan-run --job-config` with `[validation] enable, dataset_path, freq, steps` validates
//!   exactly as those flags do; `--val-steps -1` (TorchTitan's `steps = -1`) reads the whole
//!   validation set once, in order, and logs the mean over its whole batches.
//! - A float8 build (`--float8 rowwise`) has an eval step too: its loss equals, bit for bit, the
//!   interpreter on the unfused float8 eval graph (the forward of each `linear_f8` expanded by
//!   `float8-forward`), and differs from the bf16 eval graph's.
//! - On the simulated mesh (dp_shard 2 x tp 2, f32 debug model) the eval step's loss equals the
//!   single-rank artifact's within 1e-5 after the same training steps (summation order only, as
//!   `artifact_mesh.rs`).
//! - A manifest whose eval step reads a master at another offset than the training plan's is
//!   refused at load (on the single-rank artifact of the mesh test, to build one artifact less).

use std::path::Path;
use std::process::Command;

use crate::common::{Scratch, debug_f32, scratch, train_options};
use titan_compiler::build::{BuildOptions, build_artifact};
use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::interp::{Interpreter, Precision, Tensor};
use titan_ir::{Graph, Mesh};
use titan_passes::TrainOptions;
use titan_runtime::data::{PackedBatches, PackedSpec};
use titan_runtime::{Artifact, ArtifactMeshTrainer, BUNDLED_CORPUS, Batch, Batcher, CpuArtifactTrainer, Trainer, byte_tokens};

const TITAN_RUN: &str = env!("CARGO_BIN_EXE_titan-run-e2e");
const VOCAB: u64 = 512;
const STEPS: u64 = 4;
const VAL_EVERY: u64 = 2;
const VAL_STEPS: usize = 2;

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// A scratch directory with `tokenizer.json`, `val.txt` (the corpus's last paragraphs) and the
/// debug model with vocabulary 512 built into `artifact/`; the model graph.
fn setup() -> (Scratch, Graph) {
    let dir = scratch("validation", "tokenizer");
    std::fs::create_dir_all(&*dir).expect("scratch");
    let json = titan_data::testing::train_bpe_json(&[BUNDLED_CORPUS], VOCAB as usize).expect("train the tokenizer");
    std::fs::write(dir.join("tokenizer.json"), json).expect("write the tokenizer");
    let paragraphs: Vec<&str> = BUNDLED_CORPUS.split("\n\n").filter(|p| !p.trim().is_empty()).collect();
    std::fs::write(dir.join("val.txt"), paragraphs[paragraphs.len() - 6..].join("\n\n")).expect("write the validation text");
    let model = build_llama3(&LlamaConfig { vocab_size: VOCAB, ..LlamaConfig::preset(Preset::Debug) }, "llama3_debug").expect("debug model");
    let train = TrainOptions { lr: 3e-3, warmup_steps: 2, decay_steps: 2, ..TrainOptions::default() };
    let summary = build_artifact(&model, &titan_ir::print::print_graph(&model), &BuildOptions { train, ..BuildOptions::default() }, &dir.join("artifact"))
        .expect("build");
    let e = summary.eval.as_ref().expect("the build has an eval step");
    assert!(e.kernels > 0 && e.grew_activations_from.is_none(), "{summary}");
    (dir, model)
}

/// `(training losses, validation losses)` by step, from a `--metrics` file.
type Logged = (Vec<(u64, f64)>, Vec<(u64, f64)>);

fn logged(path: &Path) -> Logged {
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for line in std::fs::read_to_string(path).expect("metrics").lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("json line");
        let step = v["step"].as_u64().expect("step");
        match (v["loss"].as_f64(), v["validation_metrics/loss"].as_f64()) {
            (Some(l), None) => train.push((step, l)),
            (None, Some(l)) => {
                let ppl = v["validation_metrics/perplexity"].as_f64().expect("perplexity");
                assert_eq!(ppl.to_bits(), l.exp().to_bits(), "{line}");
                assert!(v["validation_metrics/throughput(tps)"].as_f64().is_some_and(|t| t > 0.0), "{line}");
                val.push((step, l));
            }
            _ => panic!("neither a step nor a validation record: {line}"),
        }
    }
    (train, val)
}

/// The loss of the unfused eval graph on the interpreter, with `t`'s masters, on `batch`.
fn reference_loss(eval: &Graph, t: &CpuArtifactTrainer<'_>, batch: &Batch) -> f64 {
    let args: Vec<Tensor<f32>> = eval
        .main
        .args
        .iter()
        .map(|a| match a.kind.param_info() {
            Some(p) => t.state(&p.name).expect("state"),
            None => {
                let ty = eval.main.ty(a.value);
                let shape = ty.resolve(&eval.dims).expect("shape");
                let values = match eval.main.value(a.value).name.as_deref() {
                    Some("tokens") => batch.tokens.clone(),
                    Some("targets") => batch.targets.clone(),
                    other => panic!("unexpected eval input {other:?}"),
                };
                Tensor::from_ints(ty.dtype, shape, values).expect("feed")
            }
        })
        .collect();
    let out = Interpreter::new(eval, Precision::Emulate).run(&args).expect("interpreter");
    let i = eval.main.outputs.iter().position(|o| o.name.as_deref() == Some("loss")).expect("loss output");
    assert_eq!(eval.main.outputs.len(), 1, "the eval graph has one output");
    out.outputs[i].to_f64_vec()[0]
}

#[test]
fn validation_loss_equals_the_unfused_eval_graph_and_leaves_training_unchanged() {
    let (dir, model) = setup();
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/data/tiny_corpus.txt");
    let (art, tok, val) = (dir.join("artifact"), dir.join("tokenizer.json"), dir.join("val.txt"));
    let steps = STEPS.to_string();
    let base = [s(&art), "--data".into(), s(&corpus), "--tokenizer".into(), s(&tok), "--steps".into(), steps];
    let run = |extra: &[String], metrics: &Path| {
        let mut args: Vec<String> = base.to_vec();
        args.extend(extra.iter().cloned());
        args.extend(["--metrics".to_string(), s(metrics)]);
        let out = Command::new(TITAN_RUN).args(&args).output().expect("run titan-run-e2e");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{text}");
        text
    };
    let val_args: Vec<String> =
        ["--val-data".into(), s(&val), "--val-every".into(), VAL_EVERY.to_string(), "--val-steps".into(), VAL_STEPS.to_string()].to_vec();
    let printed = run(&val_args, &dir.join("with.jsonl"));
    run(&[], &dir.join("without.jsonl"));
    // The same validation from a job config (its metrics go to `<dump_folder>/metrics.jsonl`).
    let job = dir.join("job.toml");
    let dump = dir.join("job-out");
    std::fs::write(
        &job,
        format!(
            "[job]\ndump_folder = \"{}\"\n[validation]\nenable = true\ndataset_path = \"{}\"\nfreq = {VAL_EVERY}\nsteps = {VAL_STEPS}\nlocal_batch_size = 8\n",
            s(&dump),
            s(&val)
        ),
    )
    .expect("write the job config");
    let mut args: Vec<String> = base.to_vec();
    args.extend(["--job-config".to_string(), s(&job)]);
    let out = Command::new(TITAN_RUN).args(&args).output().expect("run titan-run-e2e");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("`validation.local_batch_size` not honored: titan's eval step runs on the training step's batch"), "{text}");
    let (_, from_job) = logged(&dump.join("metrics.jsonl"));
    // The whole of a validation set once, after the first step (the training corpus, to have
    // several batches).
    let whole = dir.join("whole.jsonl");
    let mut args: Vec<String> = base[..5].to_vec();
    args.extend(["--steps".into(), "1".into(), "--val-data".into(), s(&corpus), "--val-steps".into(), "-1".into(), "--metrics".into(), s(&whole)]);
    let out = Command::new(TITAN_RUN).args(&args).output().expect("run titan-run-e2e");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let whole_record: serde_json::Value = std::fs::read_to_string(&whole)
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .find(|v: &serde_json::Value| v["batches"].is_u64())
        .expect("a validation record");
    let bits = |v: &[(u64, f64)]| v.iter().map(|&(s, l)| (s, l.to_bits())).collect::<Vec<_>>();
    let (train_with, val_logged) = logged(&dir.join("with.jsonl"));
    let (train_without, none) = logged(&dir.join("without.jsonl"));
    assert!(none.is_empty());
    assert_eq!(bits(&train_with), bits(&train_without), "validation changed the training losses");
    assert_eq!(val_logged.iter().map(|&(s, _)| s).collect::<Vec<_>>(), [1, 2, 4], "TorchTitan validates at step 1 and every --val-every steps");
    for (step, loss) in &val_logged {
        let line = format!("validate step: {step:>2}  loss: {loss:>7.4}  perplexity: {:.4}", loss.exp());
        assert!(printed.contains(&line), "missing `{line}` in:\n{printed}");
    }

    // The reference: the same training batches in-process, and at each validated step the
    // interpreter on the unfused eval graph over the same validation batches.
    let artifact = Artifact::load(&art).expect("load");
    let mut t = CpuArtifactTrainer::new(&artifact, 0).expect("trainer");
    let (b, q, v) = (t.batch_size(), t.seq_len(), t.vocab_size());
    let mut train = PackedBatches::open(&PackedSpec::text(&corpus, &tok, "text").expect("spec"), b, q, v, &Default::default()).expect("train data");
    let mut val_data = PackedBatches::open(&PackedSpec::text(&val, &tok, "text").expect("spec"), b, q, v, &Default::default()).expect("val data");
    let val_batches: Vec<Batch> = (0..VAL_STEPS).map(|_| val_data.next_batch().expect("val batch")).collect();
    let eval = titan_passes::lower_to_eval(&model, &TrainOptions { lr: 3e-3, warmup_steps: 2, decay_steps: 2, ..TrainOptions::default() }).expect("eval graph");
    assert_eq!(bits(&from_job), bits(&val_logged), "the job config's [validation] vs the same flags");
    let mut checked = 0;
    for step in 1..=STEPS {
        let m = t.step(&train.next_batch().expect("batch")).expect("step");
        assert_eq!(m.loss.to_bits(), train_with[step as usize - 1].1.to_bits(), "step {step}");
        if step == 1 {
            let mut once = PackedBatches::open_once(&PackedSpec::text(&corpus, &tok, "text").expect("spec"), b, q, v).expect("val data");
            let (mut sum, mut n) = (0.0, 0u64);
            while let Some(vb) = once.try_next_batch().expect("val batch") {
                sum += t.eval_loss(&vb).expect("eval");
                n += 1;
            }
            println!("the whole validation set: {n} batches, mean loss {}", sum / n as f64);
            assert!(n > VAL_STEPS as u64, "the validation set is longer than --val-steps {VAL_STEPS}: {n} batches");
            assert_eq!(whole_record["batches"].as_u64(), Some(n), "{whole_record}");
            assert_eq!(whole_record["validation_metrics/loss"].as_f64().map(f64::to_bits), Some((sum / n as f64).to_bits()), "{whole_record}");
        }
        let Some(&(_, logged)) = val_logged.iter().find(|(s, _)| *s == step) else { continue };
        let reference = val_batches.iter().map(|vb| reference_loss(&eval, &t, vb)).sum::<f64>() / VAL_STEPS as f64;
        let compiled = val_batches.iter().map(|vb| t.eval_loss(vb).expect("eval")).sum::<f64>() / VAL_STEPS as f64;
        println!("step {step}: validation loss {logged} (titan-run), {compiled} (eval step), {reference} (interpreter, unfused)");
        assert_eq!(logged.to_bits(), reference.to_bits(), "step {step}: titan-run's validation loss vs the unfused eval graph");
        assert_eq!(compiled.to_bits(), reference.to_bits(), "step {step}: the eval step vs the unfused eval graph");
        checked += 1;
    }
    assert_eq!(checked, 3);
}

#[test]
fn mesh_eval_step_matches_the_single_rank_one() {
    let model = debug_f32();
    let build = |mesh: Mesh, name: &str| {
        let dir = scratch("validation", name);
        build_artifact(&model, &titan_ir::print::print_graph(&model), &BuildOptions { train: train_options(), mesh, ..BuildOptions::default() }, dir.as_ref())
            .unwrap_or_else(|e| panic!("building {name}: {e}"));
        dir
    };
    let (one_dir, mesh_dir) = (build(Mesh::new(1, 1, 1), "single"), build(Mesh::new(1, 2, 2), "dp2-tp2"));
    let (one, mesh) = (Artifact::load(&one_dir).expect("load"), Artifact::load(&mesh_dir).expect("load"));
    let mut a = CpuArtifactTrainer::new(&one, 0).expect("trainer");
    let mut m = ArtifactMeshTrainer::new(&mesh, 0).expect("mesh trainer");
    let mut batcher = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), a.batch_size(), a.seq_len(), 7).expect("batcher");
    let val = batcher.next_batch();
    for step in 0..2 {
        let b = batcher.next_batch();
        let (la, lm) = (a.step(&b).expect("step").loss, m.step(&b).expect("mesh step").loss);
        assert!((la - lm).abs() <= 1e-5, "training step {step}: {la} vs {lm}");
        let (ea, em) = (a.eval_loss(&val).expect("eval"), m.eval_loss(&val).expect("mesh eval"));
        println!("after step {}: eval loss single {ea}, dp_shard 2 x tp 2 {em}", step + 1);
        assert!((ea - em).abs() <= 1e-5, "after step {}: eval loss {ea} (one rank) vs {em} (mesh)", step + 1);
        assert!(ea.is_finite() && ea > 0.0);
    }
    drop(one);
    an_eval_step_reading_a_master_elsewhere_is_refused(&one_dir);
}

/// The single-rank artifact in `dir`, its eval step made to read a master 256 bytes off the
/// training plan's, is refused at load.
fn an_eval_step_reading_a_master_elsewhere_is_refused(dir: &Path) {
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("manifest")).expect("json");
    let bufs = m["eval"]["buffers"].as_array_mut().expect("eval buffers");
    let i = bufs.iter().position(|b| b["class"] == "param").expect("an eval param buffer");
    let off = bufs[i]["offset"].as_u64().expect("offset");
    bufs[i]["offset"] = serde_json::json!(off + 256);
    std::fs::write(&path, serde_json::to_string_pretty(&m).expect("json")).expect("write");
    let err = Artifact::load(dir).expect_err("a param at another offset").to_string();
    assert!(err.contains(&format!("eval.buffers[{i}].offset")) && err.contains("the training buffer"), "{err}");
}

/// A float8 build's eval step: the debug model (bf16) with `--float8 rowwise`, after a training
/// step, against the interpreter on the unfused float8 eval graph, bit for bit; the bf16 eval
/// graph's loss on the same masters differs (the linears are quantized) but stays close.
#[test]
fn float8_eval_step_equals_the_unfused_float8_eval_graph() {
    use titan_ir::Float8Recipe;
    use titan_passes::float8::Float8Options;
    let model = build_llama3(&LlamaConfig::preset(Preset::Debug), "llama3_debug").expect("debug model");
    let train = TrainOptions { float8: Some(Float8Options::new(Float8Recipe::Rowwise)), ..train_options() };
    let dir = scratch("validation", "float8");
    let summary =
        build_artifact(&model, &titan_ir::print::print_graph(&model), &BuildOptions { train: train.clone(), ..BuildOptions::default() }, dir.as_ref())
            .expect("build");
    assert!(summary.eval.as_ref().is_some_and(|e| e.kernels > 0), "{summary}");
    let artifact = Artifact::load(&dir).expect("load");
    let mut t = CpuArtifactTrainer::new(&artifact, 0).expect("trainer");
    let mut batcher = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), t.batch_size(), t.seq_len(), 7).expect("batcher");
    let val = batcher.next_batch();
    t.step(&batcher.next_batch()).expect("step");
    let compiled = t.eval_loss(&val).expect("eval");
    let eval = titan_passes::lower_to_eval(&model, &train).expect("float8 eval graph");
    assert!(titan_ir::print::print_graph(&eval).contains("scaled_matmul"), "the eval graph's linears are float8");
    let reference = reference_loss(&eval, &t, &val);
    let bf16 = reference_loss(&titan_passes::lower_to_eval(&model, &train_options()).expect("bf16 eval graph"), &t, &val);
    println!("float8 eval loss {compiled} (eval step), {reference} (interpreter, unfused); bf16 eval graph {bf16}");
    assert_eq!(compiled.to_bits(), reference.to_bits(), "the float8 eval step vs the unfused float8 eval graph");
    assert!(compiled != bf16 && (compiled - bf16).abs() < 0.05, "float8 {compiled} vs bf16 {bf16}");
}
