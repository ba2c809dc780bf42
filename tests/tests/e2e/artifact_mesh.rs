//! SPMD artifacts: `titanc build` with a mesh (dp_replicate/dp_shard/tp) lowers the SPMD
//! training graph, fuses it with every collective as a schedule step of its own and plans one
//! rank's memory; the CPU simulated mesh runs the one schedule on N ranks (a thread each).
//!
//! The mesh runs must track the single-device *artifact* run of the same model (f32 debug
//! model, as `distributed.rs`) after 5 steps with that module's tolerances: losses within 1e-5,
//! gradient norms within 1e-4 relative, every state element (master weights and AdamW moments,
//! gathered from their shards) within 5e-5. The differences are summation order only (partial
//! sums added across ranks); the artifact executes the same ops as the graph on the same
//! interpreter, so the measured maxima equal graph mode's (printed with `--nocapture`).

use std::path::PathBuf;
use std::time::Instant;

use titan_compiler::build::{BuildOptions, BuildSummary, build_artifact};
use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::artifact::{CollectiveOp, Manifest, Step};
use titan_ir::{DType, Graph, Mesh};
use titan_runtime::{Artifact, ArtifactMeshTrainer, CpuArtifactTrainer, Trainer};

const STEPS: usize = 5;
const LOSS_TOL: f64 = 1e-5;
const STATE_TOL: f32 = 5e-5;

use crate::common::{Run, Scratch, debug_f32, train_options};

fn build(model: &Graph, mesh: Mesh, name: &str) -> (Scratch, BuildSummary) {
    build_with(model, BuildOptions { train: train_options(), mesh, ..BuildOptions::default() }, name)
}

fn build_with(model: &Graph, opts: BuildOptions, name: &str) -> (Scratch, BuildSummary) {
    let dir = crate::common::scratch("artifact-mesh", name);
    let text = titan_ir::print::print_graph(model);
    let summary = build_artifact(model, &text, &opts, dir.as_ref()).unwrap_or_else(|e| panic!("building {name}: {e}"));
    (dir, summary)
}

fn run(t: &mut dyn Trainer) -> Run {
    let (batch, seq) = (t.batch_size(), t.seq_len());
    Run::train(t, batch, seq, STEPS, |t| t.states().expect("states"))
}

fn single_rank_artifact(model: &Graph, name: &str) -> Run {
    let (dir, _) = build(model, Mesh::new(1, 1, 1), &format!("{name}-single"));
    let artifact = Artifact::load(&dir).expect("load");
    let mut t = CpuArtifactTrainer::new(&artifact, 0).expect("trainer");
    run(&mut t)
}

fn check(mesh: Mesh, name: &str) {
    check_model(&debug_f32(), mesh, name);
}

fn check_model(model: &Graph, mesh: Mesh, name: &str) {
    let start = Instant::now();
    let want = single_rank_artifact(model, name);
    let (dir, summary) = build(model, mesh, name);
    assert_eq!(summary.mesh.world_size, mesh.world_size());
    let artifact = Artifact::load(&dir).expect("load");
    assert!(artifact.collectives_per_step() > 0);
    let mut t = ArtifactMeshTrainer::new(&artifact, 0).expect("mesh trainer");
    assert_eq!(t.global_batch(), 8);
    let got = run(&mut t);
    want.assert_close(&got, LOSS_TOL, STATE_TOL, &format!("artifact mesh {:?}", mesh.sizes), start);
}

#[test]
fn tp_2_artifact_matches_single_rank_artifact() {
    check(Mesh::new(1, 1, 2), "tp2");
}

#[test]
fn dp_shard_2_artifact_matches_single_rank_artifact() {
    check(Mesh::new(1, 2, 1), "fsdp2");
}

/// Three layers: an odd count, so the prefetched carries (`prefetch-next-layer`) end in the
/// other ping-pong slot than with two, and the middle layer both reads a prefetched weight and
/// prefetches the next one.
#[test]
fn dp_shard_2_over_3_layers_artifact_matches_single_rank_artifact() {
    let cfg = LlamaConfig { dtype: DType::F32, n_layers: 3, ..LlamaConfig::preset(Preset::Debug) };
    let m = build_llama3(&cfg, "llama3_debug_3l").expect("3-layer debug model");
    check_model(&m, Mesh::new(1, 2, 1), "fsdp2-3l");
}

#[test]
fn dp_shard_2_tp_2_artifact_matches_single_rank_artifact() {
    check(Mesh::new(1, 2, 2), "fsdp2-tp2");
}

/// Every collective step of a schedule, one line each, loops indented (for the snapshot).
fn collective_listing(steps: &[Step], indent: usize, out: &mut String) {
    for s in steps {
        match s {
            Step::Loop { count, reverse, body, prefetch, .. } => {
                out.push_str(&format!("{:indent$}loop count={count} reverse={reverse}\n", ""));
                if !prefetch.is_empty() {
                    out.push_str(&format!(
                        "{:indent$}  prefetch (before the loop: the first layer; then atop every iteration but the last: the next layer)\n",
                        ""
                    ));
                    collective_listing(prefetch, indent + 4, out);
                    out.push_str(&format!("{:indent$}  body\n", ""));
                }
                collective_listing(body, indent + 4, out);
            }
            Step::Collective { collective, mesh_dim, group, dim, reduce, dtype, in_shape, out_shape, send_bytes, .. } => {
                let dim = dim.map_or(String::new(), |d| format!(" dim={d}"));
                let reduce = reduce.map_or(String::new(), |r| format!(" reduce={r:?}").to_lowercase());
                out.push_str(&format!(
                    "{:indent$}{} over {mesh_dim}({group}){dim}{reduce}: {dtype}{in_shape:?} -> {out_shape:?}, sends {send_bytes} B\n",
                    "",
                    collective.name()
                ));
            }
            _ => {}
        }
    }
}

/// The FSDP x TP schedule of the debug model: the collectives are steps between kernel
/// launches (FSDP all-gathers of each layer's weights inside the forward loop, TP's sequence
/// all-gathers and reduce-scatters around the column/row-parallel GEMMs, the reduce-scatters of
/// weight gradients in the backward loop, the gradient-norm and loss all-reduces in `main`).
#[test]
fn fsdp_tp_schedule_has_collective_steps() {
    let (dir, summary) = build(&debug_f32(), Mesh::new(1, 2, 2), "schedule");
    let manifest: Manifest = Artifact::load(&dir).expect("load").manifest;
    assert_eq!(manifest.ranks.len(), 1, "SPMD: one schedule every rank runs");
    let mut listing = String::new();
    collective_listing(&manifest.ranks[0].steps, 0, &mut listing);
    insta::assert_snapshot!("fsdp2_tp2_collective_steps", listing);
    // Ring volumes: all_gather sends (n-1)/n of its output, reduce_scatter of its input,
    // all_reduce 2(n-1)/n of its input.
    fn check_volumes(steps: &[Step]) {
        for s in steps {
            match s {
                Step::Loop { body, prefetch, .. } => {
                    check_volumes(prefetch);
                    check_volumes(body);
                }
                Step::Collective { collective, group, dtype, in_shape, out_shape, send_bytes, .. } => {
                    let bytes = |s: &[u64]| s.iter().product::<u64>() * dtype.size_bytes() as u64;
                    let n = u64::from(*group);
                    let want = match collective {
                        CollectiveOp::AllGather => bytes(out_shape) * (n - 1) / n,
                        CollectiveOp::ReduceScatter => bytes(in_shape) * (n - 1) / n,
                        CollectiveOp::AllReduce => 2 * bytes(in_shape) * (n - 1) / n,
                        CollectiveOp::RingShift => bytes(in_shape),
                        CollectiveOp::TakeShard | CollectiveOp::PlaceShard | CollectiveOp::RingSlice | CollectiveOp::RingConcat => 0,
                    };
                    assert_eq!(*send_bytes, want, "{collective:?}");
                }
                _ => {}
            }
        }
    }
    check_volumes(&manifest.ranks[0].steps);
    let report = manifest.report.expect("an SPMD manifest carries the report");
    assert_eq!(report.comm.iter().map(|c| c.mesh_dim.as_str()).collect::<Vec<_>>(), ["dp_shard", "tp"]);
    assert_eq!(report.memory.peak, manifest.memory.peak_bytes);
    let text = summary.to_string();
    assert!(text.contains("mesh:         world 4 = dp_shard 2 x tp 2"), "{text}");
}

/// Llama-3 70B at tp = 8 x dp_shard = 4 (32 GPUs, seq 8192, local batch 1): the build prints
/// per-rank memory by class and communication per mesh dim, and the numbers follow the
/// arithmetic of `docs/distributed.md`:
/// - fp32 masters: 4 bytes x (every parameter / 32, except `tok_embeddings` (replicated on tp:
///   / 4) and the norms (replicated on tp: / 4)), exactly; AdamW moments twice that, exactly;
/// - no FSDP-gathered weight saved for the backward (reshard after forward: it gathers again);
/// - the peak within 10% of `params x (2 + 2 + 12) / 32 + activations` (it is 8.1% above: the
///   embedding's tp replication and the fp32 gradient copies, less the bf16 weight copies that
///   the formula's `2` counts and the activation arena holds);
/// - `prefetch-next-layer` adds about one layer's gathered weights to the peak, and no
///   communication.
#[test]
fn llama3_70b_tp8_fsdp4_report_follows_the_documented_arithmetic() {
    let start = Instant::now();
    let mut cfg = LlamaConfig::preset(Preset::B70);
    cfg.batch_size = 4;
    let m = build_llama3(&cfg, "70b").expect("70b model");
    let (dir, summary) = build(&m, Mesh::new(1, 4, 8), "70b");
    let secs = start.elapsed().as_secs_f64();
    let text = summary.to_string();
    println!("{text}({secs:.2} s)");
    assert!(text.contains("mesh:         world 32 = dp_shard 4 x tp 8"), "{text}");
    assert!(text.contains("per-rank memory (predicted, each of the 32 ranks):") && text.contains("predicted peak memory: each rank: "), "{text}");
    assert!(text.contains("  dp_shard     ( 4 ranks): ") && text.contains("  tp           ( 8 ranks): "), "{text}");
    let r = Artifact::load(&dir).expect("load").manifest.report.expect("report");
    let (dim, n_layers, vocab, ffn, kv, hd) = (8192u64, 80u64, 128_256u64, 28_672u64, 8u64, 128u64);
    let embedding = vocab * dim;
    let norms = n_layers * 2 * dim + dim;
    let layer_weights = n_layers * (2 * dim * dim + 2 * dim * kv * hd + 3 * dim * ffn);
    let params = embedding + layer_weights + norms + vocab * dim;
    assert_eq!(params, 70_553_706_496);
    let world = 32;
    // Every fp32 master is sharded 32 ways (the embedding by vocabulary rows on tp and by
    // columns on dp_shard) except the norms, replicated on tp; each has its bf16 compute copy
    // next to it (`compute-copies`: the lookup reads the gathered copy on dp_shard).
    let masters = 4 * ((params - norms) / world + norms / 4);
    assert_eq!(r.memory.params, masters + masters / 2);
    assert_eq!(r.memory.optimizer_state, 2 * masters);
    assert_eq!(r.memory.gathered_weights_saved, 0);
    println!("{:?}", r.memory);
    // The peak is the packed arenas plus the one planned arena (the bf16 weight copies, the
    // gradients and the activations; docs/distributed.md has the arithmetic).
    assert_eq!(r.memory.peak, r.memory.params + r.memory.optimizer_state + r.memory.activations + r.memory.inputs);
    // Communication per step: FSDP gathers every bf16 weight shard in the forward, gathers the
    // layers' weights again in the backward (reshard after forward), and reduce-scatters every
    // gradient once: (4-1)/4 of the bf16 weights per tp rank, plus (4-1)/4 of the layer weights.
    let dp = &r.comm[0];
    let weights_per_tp_rank = 2 * ((params - norms) / 8 + norms);
    let layer_weights_per_tp_rank = 2 * (layer_weights / 8 + n_layers * 2 * dim);
    let want_rs = weights_per_tp_rank * 3 / 4;
    let want_ag = want_rs + layer_weights_per_tp_rank * 3 / 4;
    let rel = |got: u64, want: u64| (got as f64 - want as f64) / want as f64;
    assert!(rel(dp.all_gather_bytes, want_ag).abs() < 0.01, "{dp:?} vs all_gather {want_ag}");
    assert!(rel(dp.reduce_scatter_bytes, want_rs).abs() < 0.01, "{dp:?} vs reduce_scatter {want_rs}");
    // tp, exactly: sequence parallelism all-gathers the [seq, dim] bf16 norm outputs (2 per
    // layer and the final norm) and the backward all-gathers the cotangents of the 2 per layer
    // reduce-scatters and re-gathers the 2 saved norm-output shards per layer; loss parallelism
    // adds only 3 all-gathers of per-token f32 statistics [seq, tp] (no logits); the
    // vocab-parallel embedding reduce-scatters its partial [seq, dim] rows and the backward
    // all-gathers their cotangent. The other reduce-scatters are the VJPs of the first kind.
    // 7/8 of each full buffer.
    let tp = &r.comm[1];
    let seq = 8192u64;
    let act = seq * dim * 2 * 7 / 8;
    let stats = 3 * (seq * 8 * 4) * 7 / 8;
    let want_rs = (4 * n_layers + 2) * act + stats;
    assert_eq!((tp.all_gather_bytes, tp.reduce_scatter_bytes), (want_rs + 2 * n_layers * act, want_rs), "{tp:?}");
    // The tp all-reduce is the norms' fp32 gradient shards (dp_shard 4) and scalars only: no
    // embedding gradient.
    let norm_grads = 2 * 4 * (norms / 4) * 7 / 8;
    assert!(tp.all_reduce_bytes >= norm_grads && tp.all_reduce_bytes < norm_grads + 1024, "{tp:?} vs the norms' gradients {norm_grads} B");
    assert!(secs < 60.0, "the 70B SPMD build took {secs:.1} s");
    // `prefetch-next-layer` holds two layers' gathered weights during each loop: the peak is
    // one layer's gathered weights (2 B x (L / 80 / tp + 2 dim) = 204.03 MiB) above the build
    // without it, plus what the planner reused within a layer before (a gathered weight's
    // bytes after its last reader; now its slot lives to the end of the layer), at most a
    // second layer's: 330 MiB since the dp_shard reduce-scatters' operands live across the
    // backward loop (format 10; 328 MiB before, 240.5 MiB with a separate gradient arena), 208.7
    // MiB since residual adds are GEMM epilogues (`fuse` rule 11), 201.4 MiB since the forward's
    // hidden state lives in its stack of saved layer inputs (one slice more, live to the end of
    // the backward, in both builds: the two peaks fall at different moments, so the difference
    // is now slightly below one layer's gathered weights).
    // The communication is the same: no layer is gathered twice.
    let opts = BuildOptions { train: train_options(), mesh: Mesh::new(1, 4, 8), prefetch_next_layer: false, ..BuildOptions::default() };
    let (dir_off, summary_off) = build_with(&m, opts, "70b-no-prefetch");
    println!("without prefetch-next-layer:\n{summary_off}");
    let off = Artifact::load(&dir_off).expect("load").manifest.report.expect("report");
    let one_layer = 2 * (layer_weights / n_layers / 8 + 2 * dim);
    let delta = r.memory.peak - off.memory.peak;
    println!("peak {} without prefetch, {} with (+{delta} B; one layer's gathered weights {one_layer} B)", off.memory.peak, r.memory.peak);
    assert_eq!((off.memory.peak, r.memory.peak), (58_875_278_080, 59_086_435_072), "the numbers docs/distributed.md states");
    assert!(delta >= one_layer * 9 / 10 && delta <= one_layer * 2, "+{delta} B vs {one_layer} B");
    assert_eq!(r.comm, off.comm);
}

/// Unbuilt parallelism and impossible meshes fail the build with the reason.
#[test]
fn unsupported_meshes_fail_the_build_clearly() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("artifact-mesh-bad-{}", std::process::id()));
    let text = titan_ir::print::print_graph(&debug_f32());
    let opts = BuildOptions { train: train_options(), mesh: Mesh::new(1, 3, 1), ..BuildOptions::default() };
    let err = build_artifact(&debug_f32(), &text, &opts, &dir).expect_err("8 rows over 3 ranks").to_string();
    assert!(err.contains("batch = 8 is not divisible by dp_replicate x dp_shard = 3"), "{err}");
    assert!(!dir.exists());
    let dims = |cp: i64, pp: i64| {
        titan_compiler::parallel::ParallelDims::resolve(&titan_compiler::parallel::ParallelRequest {
            cp: Some(cp),
            pp: Some(pp),
            tp: Some(2),
            ..Default::default()
        })
        .expect("degrees")
    };
    assert!(dims(2, 1).require_built().unwrap_err().to_string().contains("context parallelism (cp=2) is not supported yet"));
    assert!(dims(1, 2).require_built().unwrap_err().to_string().contains("pipeline parallelism (pp=2) is not supported yet"));
    dims(1, 1).require_built().expect("tp is built");
}
