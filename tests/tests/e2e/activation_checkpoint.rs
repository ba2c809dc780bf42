//! Activation checkpointing (`activation-checkpoint` pass, `--ac`): every policy computes the
//! same step bit for bit, and trades memory for recompute as it should.
//!
//! The recompute clones the forward's own ops on the same operands, so a recomputed value has
//! the bits the saved one had, and losses, gradient norms and every state after a few steps are
//! identical to `none` (f32 here; in bf16 the same holds because the interpreter rounds each
//! recomputed op result exactly as it rounded the original, and the tests of the artifact below
//! run in bf16 too). On the simulated mesh the recompute re-issues the block's collectives,
//! whose rank-order reductions are deterministic, so the mesh runs are bit-identical across
//! policies as well.

use titan_compiler::build::{BuildOptions, build_artifact, plan_kernel_graph};
use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::interp::Tensor;
use titan_ir::{DType, Graph, Mesh};
use titan_passes::activation_checkpoint::{AcPolicy, Budget};
use titan_passes::{PipelineOptions, compile_train_graph, lower_to_train};
use titan_runtime::{Artifact, ArtifactMeshTrainer, BUNDLED_CORPUS, Batcher, CpuArtifactTrainer, CpuTrainer, MeshTrainer, Trainer, byte_tokens};

use crate::common::{debug_f32, debug_f32_with, scratch, train_options};

const STEPS: usize = 3;

/// The policies every equality test runs.
fn policies() -> Vec<AcPolicy> {
    vec![AcPolicy::None, AcPolicy::Full, AcPolicy::SelectiveOp, AcPolicy::SelectiveEvery(2), AcPolicy::Budget(Budget::Fraction(0.5))]
}

fn with_policy(mut model: Graph, policy: AcPolicy) -> Graph {
    policy.write_meta(&mut model);
    model
}

/// Losses, gradient norms and every state's bits after [`STEPS`] steps.
#[derive(Debug, PartialEq)]
struct Run {
    losses: Vec<u64>,
    grad_norms: Vec<u64>,
    states: Vec<(String, Vec<u32>)>,
}

fn bits(states: impl IntoIterator<Item = (String, Tensor<f32>)>) -> Vec<(String, Vec<u32>)> {
    let mut v: Vec<(String, Vec<u32>)> = states.into_iter().map(|(n, t)| (n, t.floats().expect("float state").iter().map(|x| x.to_bits()).collect())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// `STEPS` steps on the bundled corpus (seed 3): the losses' and gradient norms' bits.
fn metric_bits(t: &mut dyn Trainer, batch: usize, seq: usize) -> (Vec<u64>, Vec<u64>) {
    let mut batcher = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), batch, seq, 3).expect("batcher");
    (0..STEPS)
        .map(|_| {
            let m = t.step(&batcher.next_batch()).expect("step");
            (m.loss.to_bits(), m.grad_norm.to_bits())
        })
        .unzip()
}

fn single_rank(model: &Graph) -> Run {
    let g = lower_to_train(model, &train_options()).expect("lowering");
    let mut t = CpuTrainer::new(&g, 0).expect("trainer");
    let (batch, seq) = (t.batch_size(), t.seq_len());
    let (losses, grad_norms) = metric_bits(&mut t, batch, seq);
    Run { losses, grad_norms, states: bits(t.states().map(|(p, t)| (p.name.clone(), t.clone()))) }
}

fn mesh_run(model: &Graph, mesh: Mesh) -> Run {
    let mut m = model.clone();
    mesh.write_meta(&mut m);
    if AcPolicy::from_graph(&m).expect("policy") != AcPolicy::None {
        assert!(ac_counters(&m).1 > 0, "the policy recomputes on the mesh");
    }
    let g = lower_to_train(&m, &train_options()).expect("spmd lowering");
    let errs = titan_ir::verify::verify(&g);
    assert!(errs.is_empty(), "{:?}", errs.iter().map(ToString::to_string).collect::<Vec<_>>());
    let mut t = MeshTrainer::new(&g, 0).expect("mesh trainer");
    let (batch, seq) = (t.global_batch(), 64);
    let (losses, grad_norms) = metric_bits(&mut t, batch, seq);
    Run { losses, grad_norms, states: bits(t.gathered_states().expect("gather")) }
}

fn assert_same(what: &str, want: &Run, got: &Run) {
    assert_eq!(want.losses, got.losses, "{what}: losses");
    assert_eq!(want.grad_norms, got.grad_norms, "{what}: gradient norms");
    let differing: Vec<&str> = want.states.iter().zip(&got.states).filter(|(a, b)| a != b).map(|(a, _)| a.0.as_str()).collect();
    assert_eq!(want.states.len(), got.states.len(), "{what}: state count");
    assert!(differing.is_empty(), "{what}: states differ: {differing:?}");
}

/// The saved/recomputed counters of the pass on `model` (lowered with its policy).
fn ac_counters(model: &Graph) -> (u64, u64) {
    let passes = titan_passes::lookup_passes(&titan_passes::train_pipeline(model).expect("pipeline")).expect("names");
    let mut g = model.clone();
    let report = titan_passes::run_pipeline(&mut g, &passes, &train_options(), &PipelineOptions::default()).expect("lowering");
    let s = report.stats("activation-checkpoint").expect("the pass ran");
    (s.get("saved_after").unwrap_or(0), s.get("recomputed").unwrap_or(0))
}

#[test]
fn every_policy_trains_the_debug_model_bit_identically() {
    let want = single_rank(&debug_f32());
    for policy in policies().into_iter().skip(1) {
        let model = with_policy(debug_f32(), policy);
        let (saved, recomputed) = ac_counters(&model);
        println!("{policy}: saves {saved} values per layer, recomputes {recomputed}");
        assert!(recomputed > 0, "{policy} recomputes something");
        assert_same(&policy.to_string(), &want, &single_rank(&model));
    }
}

#[test]
fn every_policy_is_bit_identical_on_the_simulated_mesh() {
    for mesh in [Mesh::new(1, 1, 2), Mesh::new(1, 2, 1), Mesh::new(1, 2, 2)] {
        let want = mesh_run(&debug_f32(), mesh);
        for policy in policies().into_iter().skip(1) {
            assert_same(&format!("mesh {:?}, {policy}", mesh.sizes), &want, &mesh_run(&with_policy(debug_f32(), policy), mesh));
        }
    }
}

/// `selective(2)` on 3 layers: one group of 2 (its second layer recomputed) and the third layer
/// alone in the plain blocks, its weights a `slice` of the stacked ones and its gradients
/// concatenated back; bit-identical to `none` on one rank and on a tp x dp_shard mesh.
#[test]
fn every_second_layer_with_a_remainder_is_bit_identical() {
    let three = || debug_f32_with(LlamaConfig { n_layers: 3, ..LlamaConfig::preset(Preset::Debug) });
    let model = with_policy(three(), AcPolicy::SelectiveEvery(2));
    let (_, recomputed) = ac_counters(&model);
    assert!(recomputed > 0, "selective(2) recomputes the group's second layer");
    let g = lower_to_train(&model, &train_options()).expect("lowering");
    let errs = titan_ir::verify::verify(&g);
    assert!(errs.is_empty(), "{:?}", errs.iter().map(ToString::to_string).collect::<Vec<_>>());
    let text = titan_ir::print::print_graph(&g);
    assert!(text.contains("{block = @layer_x2, count = 1") && text.contains("{block = @layer, count = 1"), "{text}");
    assert_same("3 layers, selective(2)", &single_rank(&three()), &single_rank(&model));
    let mesh = Mesh::new(1, 2, 2);
    assert_same("3 layers, selective(2), mesh [1, 2, 2]", &mesh_run(&three(), mesh), &mesh_run(&model, mesh));
    // bf16 (every op result rounded to bf16 by the interpreter): the recompute rounds each value
    // exactly as the forward did, so no value rounds differently.
    let three_bf16 = || build_llama3(&LlamaConfig { dtype: DType::BF16, n_layers: 3, ..LlamaConfig::preset(Preset::Debug) }, "llama3_debug").expect("bf16");
    assert_same("3 layers bf16, selective(2)", &single_rank(&three_bf16()), &single_rank(&with_policy(three_bf16(), AcPolicy::SelectiveEvery(2))));
}

/// Saved activations over all layers per rank (the pass's `saved_bytes_total_after`) and
/// recompute FLOPs, from the graph-mode pipeline.
fn saved_total(model: &Graph, mesh: Mesh, policy: AcPolicy) -> (u64, u64) {
    let mut m = with_policy(model.clone(), policy);
    if mesh.world_size() > 1 {
        mesh.write_meta(&mut m);
    }
    let passes = titan_passes::lookup_passes(&titan_passes::train_pipeline(&m).expect("pipeline")).expect("names");
    let report = titan_passes::run_pipeline(&mut m, &passes, &train_options(), &PipelineOptions::default()).expect("lowering");
    let s = report.stats("activation-checkpoint");
    (s.and_then(|s| s.get("saved_bytes_total_after")).unwrap_or(0), s.and_then(|s| s.get("recompute_flops")).unwrap_or(0))
}

/// `selective(2)` saves less than `none` and more than `full` (saved activations per rank, the
/// part of the peak checkpointing controls), on the debug model and, printed for
/// `docs/performance.md` (`--nocapture`), on 8B and 70B at tp 8 x dp_shard 4.
#[test]
fn every_second_layer_saves_between_none_and_full() {
    let b8 = build_llama3(&LlamaConfig::preset(Preset::B8), "llama3_8b").expect("8b");
    let b70 = build_llama3(&LlamaConfig { batch_size: 4, ..LlamaConfig::preset(Preset::B70) }, "llama3_70b").expect("70b");
    let debug = debug_f32();
    println!("| model | mesh | policy | saved activations per rank | recompute per step |");
    for (name, model, mesh) in [("debug", &debug, Mesh::new(1, 1, 1)), ("8B", &b8, Mesh::new(1, 1, 1)), ("70B", &b70, Mesh::new(1, 4, 8))] {
        let mut saved = Vec::new();
        for policy in [AcPolicy::None, AcPolicy::SelectiveOp, AcPolicy::SelectiveEvery(2), AcPolicy::Full] {
            // `none` does not run the pass: its saved set is what the others started from.
            let (bytes, flops) = if policy == AcPolicy::None { (saved_before(model, mesh), 0) } else { saved_total(model, mesh, policy) };
            println!("| {name} | {:?} | {policy} | {:.2} GiB | {:.1} TFLOP |", mesh.sizes, gib(bytes), flops as f64 / 1e12);
            saved.push((policy, bytes));
        }
        let (none, every2, full) = (saved[0].1, saved[2].1, saved[3].1);
        assert!(none > every2 && every2 > full, "{name}: none > selective(2) > full, got {saved:?}");
    }
}

fn saved_before(model: &Graph, mesh: Mesh) -> u64 {
    let mut m = with_policy(model.clone(), AcPolicy::Full);
    if mesh.world_size() > 1 {
        mesh.write_meta(&mut m);
    }
    let passes = titan_passes::lookup_passes(&titan_passes::train_pipeline(&m).expect("pipeline")).expect("names");
    let report = titan_passes::run_pipeline(&mut m, &passes, &train_options(), &PipelineOptions::default()).expect("lowering");
    report.stats("activation-checkpoint").and_then(|s| s.get("saved_bytes_total_before")).expect("the pass ran")
}

/// The artifact of `model` under `policy` on `mesh` (one device for `Mesh::new(1, 1, 1)`): built
/// into a scratch directory, run [`STEPS`] steps on the CPU backend (the simulated mesh for
/// more ranks).
fn artifact_run(model: &Graph, policy: AcPolicy, mesh: Mesh, name: &str) -> Run {
    let dir = scratch("ac", &format!("{name}-{}", policy.to_string().replace(['(', ')'], "-")));
    let text = titan_ir::print::print_graph(model);
    let opts = BuildOptions { train: train_options(), ac: policy, mesh, ..BuildOptions::default() };
    build_artifact(model, &text, &opts, &dir).unwrap_or_else(|e| panic!("building {name}, {policy}: {e}"));
    let a = Artifact::load(&dir).expect("load artifact");
    let mut t: Box<dyn Trainer> = if mesh.world_size() > 1 {
        Box::new(ArtifactMeshTrainer::new(&a, 0).expect("mesh trainer"))
    } else {
        Box::new(CpuArtifactTrainer::new(&a, 0).expect("trainer"))
    };
    let (batch, seq) = (t.batch_size(), t.seq_len());
    let (losses, grad_norms) = metric_bits(t.as_mut(), batch, seq);
    Run { losses, grad_norms, states: bits(t.states().expect("states")) }
}

/// `selective(2)` on 3 layers builds into an artifact (a group of 2 whose weights are offset
/// views of the stacked parameters, a remainder layer, gradients concatenated in place) that
/// trains bit-identically to `--ac none`'s artifact and to graph mode, in f32 and bf16; its
/// predicted peak lies between `none`'s and `full`'s.
#[test]
fn every_second_layer_artifacts_match_none_bit_for_bit() {
    let three = |dtype| build_llama3(&LlamaConfig { dtype, n_layers: 3, ..LlamaConfig::preset(Preset::Debug) }, "llama3_debug").expect("3 layers");
    let one = Mesh::new(1, 1, 1);
    let f32_model = three(DType::F32);
    let none = artifact_run(&f32_model, AcPolicy::None, one, "three-f32");
    assert_same("3 layers f32: none artifact vs graph mode", &single_rank(&f32_model), &none);
    assert_same("3 layers f32: selective(2) artifact vs none artifact", &none, &artifact_run(&f32_model, AcPolicy::SelectiveEvery(2), one, "three-f32"));
    let bf16_model = three(DType::BF16);
    assert_same(
        "3 layers bf16: selective(2) artifact vs graph mode",
        &single_rank(&bf16_model),
        &artifact_run(&bf16_model, AcPolicy::SelectiveEvery(2), one, "three-bf16"),
    );
    let peaks: Vec<u64> = [AcPolicy::None, AcPolicy::SelectiveEvery(2), AcPolicy::Full].into_iter().map(|p| predicted(&bf16_model, one, p).0).collect();
    assert!(peaks[0] > peaks[1] && peaks[1] > peaks[2], "none > selective(2) > full in predicted peak, got {peaks:?}");
}

/// The same on the simulated mesh (tp 2, dp_shard 2): the views cut the rank's weight shards
/// and the gathered weights alike.
#[test]
fn every_second_layer_artifact_matches_none_on_the_simulated_mesh() {
    let model = debug_f32_with(LlamaConfig { n_layers: 3, ..LlamaConfig::preset(Preset::Debug) });
    let mesh = Mesh::new(1, 2, 2);
    let none = artifact_run(&model, AcPolicy::None, mesh, "mesh-three");
    assert_same("mesh [1, 2, 2]: none artifact vs graph mode", &mesh_run(&model, mesh), &none);
    assert_same("mesh [1, 2, 2]: selective(2) artifact vs none artifact", &none, &artifact_run(&model, AcPolicy::SelectiveEvery(2), mesh, "mesh-three"));
}

/// The artifact (fused, memory-planned, poisoned activations between steps) of each policy
/// trains exactly like the unfused graph without checkpointing, in bf16.
#[test]
fn checkpointed_artifacts_match_graph_mode_bit_for_bit() {
    let model = build_llama3(&LlamaConfig { dtype: DType::BF16, ..LlamaConfig::preset(Preset::Debug) }, "llama3_debug").expect("debug model");
    let want = single_rank(&model);
    assert_same("bf16 artifact, selective(2)", &want, &artifact_run(&model, AcPolicy::SelectiveEvery(2), Mesh::new(1, 1, 1), "two-bf16"));
    for policy in [AcPolicy::Full, AcPolicy::SelectiveOp] {
        let dir = scratch("ac", &policy.to_string().replace(['(', ')'], "-"));
        let text = titan_ir::print::print_graph(&model);
        let opts = BuildOptions { train: train_options(), ac: policy, ..BuildOptions::default() };
        let summary = build_artifact(&model, &text, &opts, &dir).unwrap_or_else(|e| panic!("building {policy}: {e}"));
        let recomputed = summary.pipeline.stats("activation-checkpoint").and_then(|s| s.get("recomputed"));
        assert!(recomputed.is_some_and(|n| n > 0), "{policy}: the build recomputes ({recomputed:?})");
        assert!(summary.to_string().contains("activation checkpointing:\n  @layer: saves %"), "{policy}: the summary reports the policy");
        let text = summary.to_string();
        assert!(
            text.contains("recomputed @layer_bwd: ") && text.contains("%gate in @layer_bwd.k"),
            "{policy}: the summary says where the recompute went:\n{text}"
        );
        let a = Artifact::load(&dir).expect("load artifact");
        let mut t = CpuArtifactTrainer::new(&a, 0).expect("artifact trainer");
        let (batch, seq) = (t.batch_size(), t.seq_len());
        let (losses, grad_norms) = metric_bits(&mut t, batch, seq);
        let got = Run { losses, grad_norms, states: bits(t.states().expect("states")) };
        assert_same(&format!("bf16 artifact, {policy}"), &want, &got);
    }
}

/// Predicted peak memory of one rank (the build's memory plan) and the pass's recompute FLOPs.
fn predicted(model: &Graph, mesh: Mesh, policy: AcPolicy) -> (u64, u64) {
    let mut m = with_policy(model.clone(), policy);
    if mesh.world_size() > 1 {
        mesh.write_meta(&mut m);
    }
    let (fused, report) = compile_train_graph(&m, &train_options(), &PipelineOptions::default()).expect("compile");
    let plan = plan_kernel_graph(&fused).expect("plan");
    let flops = report.stats("activation-checkpoint").and_then(|s| s.get("recompute_flops")).unwrap_or(0);
    (plan.memory.peak_bytes, flops)
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// none > selective(op) > full in predicted peak memory, on the debug and the 8B presets; prints
/// the table of `docs/performance.md` (run with `--nocapture`).
#[test]
fn predicted_peak_falls_from_none_to_selective_to_full() {
    let b8 = build_llama3(&LlamaConfig::preset(Preset::B8), "llama3_8b").expect("8b");
    let debug = build_llama3(&LlamaConfig::preset(Preset::Debug), "llama3_debug").expect("debug");
    for (name, model) in [("debug", &debug), ("8b", &b8)] {
        let mut peaks = Vec::new();
        for policy in [AcPolicy::None, AcPolicy::SelectiveOp, AcPolicy::Full] {
            let (peak, flops) = predicted(model, Mesh::new(1, 1, 1), policy);
            println!("| {name} | {policy} | {:.2} GiB | {:.3} TFLOP |", gib(peak), flops as f64 / 1e12);
            peaks.push(peak);
        }
        assert!(peaks[0] > peaks[1] && peaks[1] > peaks[2], "{name}: none > selective(op) > full, got {peaks:?}");
    }
}

/// `titanc build --ac budget=<GiB>` prints the Pareto frontier; the job config's
/// `[activation_checkpoint]` is honored and the flags override it.
#[test]
fn titanc_build_takes_ac_flags_and_the_job_config() {
    let dir = scratch("ac", "cli");
    let out = dir.join("out");
    let model = "examples/llama3-debug.ir";
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let model = format!("{root}/{model}");
    let build = |extra: &[&str]| {
        let mut args = vec!["titanc", "build", model.as_str(), "-o", out.to_str().expect("utf-8")];
        args.extend(extra);
        titan_compiler::cli::run_args(&args).map(|o| o.stdout).map_err(|e| e.to_string())
    };
    let svg = dir.join("pareto.svg");
    let text = build(&["--ac", "budget=0.001", "--ac-pareto", svg.to_str().expect("utf-8")]).expect("budget build");
    assert!(text.contains("Pareto frontier"), "{text}");
    let drawn = std::fs::read_to_string(&svg).expect("the svg");
    assert!(drawn.starts_with("<svg ") && drawn.contains("chosen: "), "{drawn}");
    let err = build(&["--ac", "full", "--ac-pareto", svg.to_str().expect("utf-8")]).expect_err("pareto without a budget");
    assert!(err.contains("--ac-pareto draws the frontier of a memory budget"), "{err}");
    let err = build(&["--ac", "budget=0"]).expect_err("infeasible");
    assert!(err.contains("raise the budget to at least"), "{err}");
    // Every N-th layer builds (the artifact tests above and `job_config.rs`, whose TorchTitan
    // debug configs set it, build it; one build fewer here): the flag reaches the pass.
    let lowered = titan_compiler::cli::run_args(["titanc", "lower", model.as_str(), "--to", "train", "--ac", "selective", "--ac-selective-option", "2"])
        .map(|o| o.stdout)
        .expect("every-N lowers in graph mode");
    assert!(lowered.contains("block = @layer_x2, count = 1") && lowered.contains("activation_checkpoint = \"selective(2)\""), "{lowered}");
    let err = build(&["--ac", "some"]).expect_err("unknown mode");
    assert!(err.contains("choose none, full, selective or budget=<GiB>"), "{err}");
    let job = dir.join("job.toml");
    std::fs::write(&job, "[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"op\"\n").expect("write job");
    let text = build(&["--job-config", job.to_str().expect("utf-8")]).expect("job config build");
    assert!(text.contains("@layer: saves %25 %h %attn %11 %15 %lse"), "{text}");
    let text = build(&["--job-config", job.to_str().expect("utf-8"), "--ac", "full"]).expect("flag over job config");
    assert!(text.contains("@layer: saves %h;"), "{text}");
    // `selective_ac_option = "2"` from a job config: `job_config.rs` builds TorchTitan's debug
    // configs, which set it.
}

/// The table of `docs/performance.md`: predicted peak per rank and recompute FLOPs per step of
/// each policy (`selective(2)` between `none` and `full`), for the 8B preset (32 layers, seq 8192) on one rank and 70B at tp 8 x dp_shard 4
/// (run with `--nocapture`).
#[test]
fn policy_table_for_8b_and_70b_tp8_dp_shard4() {
    let b8 = build_llama3(&LlamaConfig::preset(Preset::B8), "llama3_8b").expect("8b");
    let b70 = build_llama3(&LlamaConfig { batch_size: 4, ..LlamaConfig::preset(Preset::B70) }, "llama3_70b").expect("70b");
    let policies = [AcPolicy::None, AcPolicy::SelectiveOp, AcPolicy::SelectiveEvery(2), AcPolicy::Full, AcPolicy::Budget(Budget::Fraction(0.5))];
    println!("| model | mesh | policy | predicted peak per rank | recompute per step |");
    for (name, model, mesh) in [("8B", &b8, Mesh::new(1, 1, 1)), ("70B", &b70, Mesh::new(1, 4, 8))] {
        let mut peaks = Vec::new();
        for policy in policies {
            let (peak, flops) = predicted(model, mesh, policy);
            println!("| {name} | {:?} | {policy} | {:.2} GiB | {:.1} TFLOP |", mesh.sizes, gib(peak), flops as f64 / 1e12);
            peaks.push(peak);
        }
        assert!(peaks[0] > peaks[1] && peaks[1] > peaks[3], "{name}: none > selective(op) > full, got {peaks:?}");
        assert!(peaks[0] > peaks[2] && peaks[2] > peaks[3], "{name}: none > selective(2) > full, got {peaks:?}");
    }
}
