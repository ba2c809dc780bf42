//! Float8 training on the CPU reference: the straight-through gradient of `linear_f8`, the debug
//! model trained with each recipe against its bf16 run, and the recipe on a simulated mesh
//! against the single-rank float8 run.
//!
//! Tolerances (measured maxima printed with `--nocapture`):
//! - gradients of one linear (f32 operands) against the exact gradient: relative Frobenius error
//!   below 5% with e4m3 operands (3 mantissa bits: ~2.5% RMS rounding per operand, ~3.5% for
//!   the product of two; measured 3.4% for rowwise), 10% when the gradient is e5m2 (2 mantissa
//!   bits; measured 5.8% for tensorwise);
//! - the bf16 debug model over 10 steps: every loss within 0.03 of the bf16 run's (measured at
//!   most 0.018 over 20 steps);
//! - a mesh run over 5 steps: losses within 1e-3 of the single-rank float8 run's (scales are
//!   taken over each rank's shard, so quantization differs slightly from the single rank's;
//!   measured 2.1e-4 at tp 4, 2.8e-4 at dp_shard 2 × tp 2).

use std::time::Instant;

use titan_compiler::build::{BuildOptions, build_artifact};
use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::interp::{Interpreter, Precision, Tensor};
use titan_ir::{Float8Recipe, Graph, Mesh};
use titan_passes::float8::Float8Options;
use titan_passes::{PipelineOptions, TrainOptions, lookup_passes, run_pipeline};
use titan_runtime::{Artifact, ArtifactMeshTrainer, BUNDLED_CORPUS, Batch, Batcher, CpuArtifactTrainer, MeshTrainer, Trainer, byte_tokens};

use crate::common::{Scratch, debug_f32, train_options};

/// Deterministic values in [-1, 1) times 2^(e - 3) for small `e`, so rows span a few binades.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let u = ((s >> 40) as f64) / f64::from(1u32 << 24);
            ((u * 2.0 - 1.0) * 2f64.powi(((s >> 20) % 4) as i32 - 2)) as f32
        })
        .collect()
}

fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(g, w)| (f64::from(*g) - w).powi(2)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

/// `loss = sum(linear_f8(x, w) * r)`: dL/dx = r·w and dL/dw = rᵀ·x exactly (the straight-through
/// estimator: quantization is the identity for the gradient). The float8 VJP computes both with
/// fp8 GEMMs; they must match the exact products within fp8 precision, and the exact products
/// must match central finite differences of the unquantized loss.
#[test]
fn linear_f8_gradient_is_straight_through() {
    let (m, k, n) = (32usize, 32usize, 16usize);
    let (xs, ws, rs) = (values(m * k, 1), values(n * k, 2), values(m * n, 3));
    // The exact gradients in f64.
    let mut dx = vec![0f64; m * k];
    let mut dw = vec![0f64; n * k];
    for i in 0..m {
        for j in 0..n {
            let r = f64::from(rs[i * n + j]);
            for kk in 0..k {
                dx[i * k + kk] += r * f64::from(ws[j * k + kk]);
                dw[j * k + kk] += r * f64::from(xs[i * k + kk]);
            }
        }
    }
    // Finite differences of the unquantized loss agree with them (a linear loss: exact up to
    // rounding of the f64 sums).
    let loss = |x: &[f32], w: &[f32]| -> f64 {
        let mut l = 0.0;
        for i in 0..m {
            for j in 0..n {
                let y: f64 = (0..k).map(|kk| f64::from(x[i * k + kk]) * f64::from(w[j * k + kk])).sum();
                l += y * f64::from(rs[i * n + j]);
            }
        }
        l
    };
    for idx in [0, 17, m * k - 1] {
        let h = 2f32.powi(-6);
        let (mut xp, mut xm) = (xs.clone(), xs.clone());
        xp[idx] += h;
        xm[idx] -= h;
        let fd = (loss(&xp, &ws) - loss(&xm, &ws)) / (2.0 * f64::from(h));
        assert!((fd - dx[idx]).abs() <= 1e-9 * dx[idx].abs().max(1.0), "dx[{idx}]: fd {fd} vs {}", dx[idx]);
    }
    for recipe in Float8Recipe::ALL {
        let text = format!(
            "graph @g {{\n  func @main {{\n    input %r : f32[{m}, {n}]\n    state %x : f32[{m}, {k}] {{name = \"x\", init = zeros}}\n    state %w : f32[{n}, {k}] {{name = \"w\", init = zeros}}\n    %y = linear_f8(%x, %w) {{recipe = {}}} : f32[{m}, {n}]\n    %p = mul(%y, %r) : f32[{m}, {n}]\n    %loss = reduce_sum(%p) {{axes = [0, 1]}} : f32[]\n    output loss = %loss\n  }}\n}}\n",
            recipe.name()
        );
        let mut g = titan_ir::parse_and_verify("f8.ir", &text).unwrap_or_else(|e| panic!("{e}"));
        let passes = lookup_passes(&["autodiff"]).expect("autodiff");
        run_pipeline(&mut g, &passes, &TrainOptions::default(), &PipelineOptions { verify_each: true, ..PipelineOptions::default() })
            .unwrap_or_else(|e| panic!("{e}"));
        let args = vec![
            Tensor::from_vec(titan_ir::DType::F32, vec![m, n], rs.clone()).unwrap(),
            Tensor::from_vec(titan_ir::DType::F32, vec![m, k], xs.clone()).unwrap(),
            Tensor::from_vec(titan_ir::DType::F32, vec![n, k], ws.clone()).unwrap(),
        ];
        let out = Interpreter::new(&g, Precision::Emulate).run(&args).unwrap_or_else(|e| panic!("{e}")).outputs;
        let grad = |name: &str| {
            let i = g.main.outputs.iter().position(|o| o.name.as_deref() == Some(name)).unwrap_or_else(|| panic!("no output {name}"));
            out[i].floats().expect("floats").to_vec()
        };
        let (ex, ew) = (rel_err(&grad("d_x"), &dx), rel_err(&grad("d_w"), &dw));
        println!("{}: relative error of dx {ex:.4}, dw {ew:.4}", recipe.name());
        // tensorwise quantizes the gradient to e5m2; rowwise_with_gw_hp keeps dw exact.
        let tol = if recipe == Float8Recipe::Tensorwise { 0.10 } else { 0.05 };
        assert!(ex < tol && ew < tol, "{}: dx {ex}, dw {ew}", recipe.name());
        assert!(ex > 1e-4, "{}: dx is exact, so it was not quantized", recipe.name());
        if recipe == Float8Recipe::RowwiseWithGwHp {
            assert!(ew < 1e-6, "rowwise_with_gw_hp computes grad_weight in high precision: {ew}");
        }
    }
}

fn build(model: &Graph, train: TrainOptions, mesh: Mesh, name: &str) -> Scratch {
    let dir = crate::common::scratch("float8", name);
    let text = titan_ir::print::print_graph(model);
    build_artifact(model, &text, &BuildOptions { train, mesh, ..BuildOptions::default() }, dir.as_ref()).unwrap_or_else(|e| panic!("building {name}: {e}"));
    dir
}

fn losses(t: &mut dyn Trainer, steps: usize) -> Vec<f64> {
    let mut batcher = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), t.batch_size(), t.seq_len(), 7).expect("batcher");
    let batches: Vec<Batch> = (0..steps).map(|_| batcher.next_batch()).collect();
    batches.iter().map(|b| t.step(b).expect("step").loss).collect()
}

fn single_rank(model: &Graph, train: TrainOptions, name: &str, steps: usize) -> Vec<f64> {
    let dir = build(model, train, Mesh::new(1, 1, 1), name);
    let artifact = Artifact::load(&dir).expect("load");
    let mut t = CpuArtifactTrainer::new(&artifact, 0).expect("trainer");
    losses(&mut t, steps)
}

fn with_float8(recipe: Float8Recipe) -> TrainOptions {
    TrainOptions { float8: Some(Float8Options::new(recipe)), ..train_options() }
}

/// The bf16 debug model with each recipe against its bf16 run, from the same initial weights
/// and batches; and each recipe's artifact (fused, memory-planned) against its unfused training
/// graph, bit for bit, which checks every fusion rule's rewrite of the quantizing kernels (rule
/// 10's recomputed casts included) exactly.
#[test]
fn each_recipe_tracks_the_bf16_run() {
    const STEPS: usize = 10;
    let model = build_llama3(&LlamaConfig::preset(Preset::Debug), "llama3_debug").expect("debug model");
    let start = Instant::now();
    let bf16 = single_rank(&model, train_options(), "bf16", STEPS);
    for recipe in Float8Recipe::ALL {
        let got = single_rank(&model, with_float8(recipe), recipe.name(), STEPS);
        let diff = bf16.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        println!("{}: losses {:?}; max |dloss| vs bf16 {diff:.4} ({:.1} s so far)", recipe.name(), got, start.elapsed().as_secs_f64());
        assert!(got.iter().all(|l| l.is_finite()));
        assert!(diff <= 0.03, "{}: losses {got:?} drift from bf16 {bf16:?} by {diff}", recipe.name());
        assert!(got[STEPS - 1] < got[0] - 0.5, "{}: the loss does not fall: {got:?}", recipe.name());
        let g = titan_passes::lower_to_train(&model, &with_float8(recipe)).unwrap_or_else(|e| panic!("{e}"));
        let mut t = titan_runtime::CpuTrainer::new(&g, 0).expect("graph-mode trainer");
        assert_eq!(bits(&got), bits(&losses(&mut t, STEPS)), "{}: artifact vs graph mode", recipe.name());
    }
}

/// `--tp 4 --float8 rowwise` and `--dp-shard 2 --tp 2 --float8 rowwise` on the simulated mesh
/// against the single-rank float8 run (f32 debug model).
#[test]
fn rowwise_on_a_mesh_tracks_the_single_rank_run() {
    const STEPS: usize = 5;
    let model = debug_f32();
    let want = single_rank(&model, with_float8(Float8Recipe::Rowwise), "rowwise-single", STEPS);
    for mesh in [Mesh::new(1, 1, 4), Mesh::new(1, 2, 2)] {
        let dir = build(&model, with_float8(Float8Recipe::Rowwise), mesh, &format!("rowwise-{}x{}", mesh.sizes[1], mesh.sizes[2]));
        let artifact = Artifact::load(&dir).expect("load");
        let mut t = ArtifactMeshTrainer::new(&artifact, 0).expect("mesh trainer");
        let got = losses(&mut t, STEPS);
        let diff = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        println!("rowwise on mesh {:?}: losses {got:?}, single rank {want:?}: max |dloss| {diff:.2e}", mesh.sizes);
        assert!(diff <= 1e-3, "mesh {:?}: {got:?} vs {want:?}", mesh.sizes);
    }
}

fn fp8_gathers(precompute: bool) -> TrainOptions {
    let f8 = Float8Options::new(Float8Recipe::Tensorwise).with_fsdp_all_gather(precompute).expect("tensorwise gathers fp8");
    TrainOptions { float8: Some(f8), ..train_options() }
}

/// The training graph of the bf16 debug model on `mesh`, run unfused on the simulated mesh.
fn graph_mesh_losses(model: &Graph, train: &TrainOptions, mesh: Mesh, steps: usize) -> Vec<f64> {
    let mut m = model.clone();
    mesh.write_meta(&mut m);
    let g = titan_passes::lower_to_train(&m, train).unwrap_or_else(|e| panic!("{e}"));
    let mut t = MeshTrainer::new(&g, 0).expect("mesh trainer");
    losses(&mut t, steps)
}

fn bits(l: &[f64]) -> Vec<u64> {
    l.iter().map(|x| x.to_bits()).collect()
}

/// fp8 FSDP all-gathers (`--enable-fsdp-float8-all-gather`, tensorwise) give bit-identical
/// losses to gathering bf16 weights and quantizing after the gather: the shard amaxes' maximum
/// is the gathered weight's amax, the cast is elementwise, and both quantize the same bf16
/// compute copy. Training graphs (unfused) of the bf16 debug model at dp_shard 2 and dp_shard 2 ×
/// tp 2, 3 steps, with and without the batched amax all-reduce (`precompute`).
#[test]
fn fsdp_float8_all_gathers_match_bf16_gathers_bitwise() {
    const STEPS: usize = 3;
    let model = build_llama3(&LlamaConfig::preset(Preset::Debug), "llama3_debug").expect("debug model");
    for mesh in [Mesh::new(1, 2, 1), Mesh::new(1, 2, 2)] {
        let want = graph_mesh_losses(&model, &with_float8(Float8Recipe::Tensorwise), mesh, STEPS);
        for precompute in [false, true] {
            let got = graph_mesh_losses(&model, &fp8_gathers(precompute), mesh, STEPS);
            println!("mesh {:?}, precompute {precompute}: losses {got:?} (bf16 gathers {want:?})", mesh.sizes);
            assert_eq!(bits(&got), bits(&want), "mesh {:?}, precompute {precompute}: {got:?} vs {want:?}", mesh.sizes);
        }
    }
}

/// The artifact at `--dp-shard 2 --tp 2`: the same losses as with bf16 gathers, bit for bit, and
/// the per-rank report's dp_shard all-gather bytes fall by half of what the converted weights
/// took: every linear weight of the block (gathered in the forward and again in the backward of
/// each layer) and the head (once) moves one byte per element instead of two; the norms and the
/// embedding stay bf16.
#[test]
fn fsdp_float8_all_gathers_halve_the_weight_gather_bytes() {
    const STEPS: usize = 2;
    let cfg = LlamaConfig::preset(Preset::Debug);
    let model = build_llama3(&cfg, "llama3_debug").expect("debug model");
    let (mesh, tp) = (Mesh::new(1, 2, 2), 2);
    let run = |train: TrainOptions, name: &str| {
        let dir = build(&model, train, mesh, name);
        let artifact = Artifact::load(&dir).expect("load");
        let report = artifact.manifest.report.clone().expect("an SPMD artifact has a mesh report");
        let dp = report.comm.iter().find(|c| c.mesh_dim == "dp_shard").expect("dp_shard communication").clone();
        let mut t = ArtifactMeshTrainer::new(&artifact, 0).expect("mesh trainer");
        (losses(&mut t, STEPS), dp)
    };
    let (want, bf16_dp) = run(with_float8(Float8Recipe::Tensorwise), "bf16-gathers");
    let (got, f8_dp) = run(fp8_gathers(false), "fp8-gathers");
    println!("losses {got:?} (bf16 gathers {want:?}); dp_shard all_gather bytes per rank {} -> {}", bf16_dp.all_gather_bytes, f8_dp.all_gather_bytes);
    assert_eq!(bits(&got), bits(&want), "{got:?} vs {want:?}");
    let (dim, ffn, kv, vocab, layers) = (cfg.dim, cfg.ffn_dim, cfg.n_kv_heads * cfg.dim / cfg.n_heads, cfg.vocab_size, cfg.n_layers);
    let block_elems = (2 * dim * dim + 2 * kv * dim + 3 * ffn * dim) / tp;
    let head_elems = vocab * dim / tp;
    // A ring all-gather over 2 ranks sends half the gathered tensor: bf16 sends one byte per
    // gathered element, fp8 half a byte.
    let bf16_sent = 2 * layers * block_elems + head_elems;
    assert_eq!(bf16_dp.all_gather_bytes - f8_dp.all_gather_bytes, bf16_sent / 2, "{bf16_dp:?} vs {f8_dp:?}");
}

/// The rowwise recipes gather bf16 weights and quantize them after the gather (torchao gathers
/// fp8 only with tensorwise scaling): asking for fp8 gathers with them is refused.
#[test]
fn fsdp_float8_all_gathers_need_tensorwise() {
    for recipe in [Float8Recipe::Rowwise, Float8Recipe::RowwiseWithGwHp] {
        let e = Float8Options::new(recipe).with_fsdp_all_gather(false).expect_err("rowwise");
        assert!(e.contains(&format!("fp8 FSDP all-gathers need the tensorwise recipe, not `{}`", recipe.name())), "{e}");
    }
}
