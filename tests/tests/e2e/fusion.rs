//! Fusion of the Llama-3 training step (`titanc build`'s pipeline: the training lowering, then
//! `fuse`): the kernel graph verifies, reads back from its text, has the expected kernels, and
//! computes the same step as the unfused graph on the reference interpreter.
//!
//! Differential tests run one step of the unfused and the fused graph on the same random
//! tokens, targets, step and states (master weights and both AdamW moments), with
//! `Precision::Emulate`. Tolerance: none. Every output (`loss`, `grad_norm`, `lr`) and every
//! updated state must be bit-identical (f32 bit patterns compared with `assert_eq`): a kernel
//! body runs the same ops in the same order as the unfused region, and rounding to bf16 happens
//! per op, so nothing may differ. Models:
//! - the debug preset, with bf16 and with f32 parameters;
//!
//! The 8B-shaped model (2 layers, tiny seq) is checked structurally here (it fuses exactly like
//! the debug model); its numerics after fusion are checked end to end by `artifact_cpu`, which
//! runs the fused artifact against the unfused graph, so the suite runs that 12 GB step once.
//!
//! Snapshots: the fused `@layer`/`@layer_bwd` blocks with their kernel bodies, and the fusion
//! report, of the debug model.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::interp::{Interpreter, Precision, Tensor};
use titan_ir::{ArgKind, DType, Graph, Init, KernelKind, Op};
use titan_passes::fuse::check_kernel_graph;
use titan_passes::{PipelineOptions, TrainOptions, compile_train_graph, fusion_report, lower_to_train};

/// The debug preset with parameters of `dtype`.
fn debug_config(dtype: DType) -> LlamaConfig {
    LlamaConfig { dtype, ..LlamaConfig::preset(Preset::Debug) }
}

/// Llama 3 8B's layer shapes, 2 layers, seq 4, batch 1, vocab 512.
fn b8_shaped_config() -> LlamaConfig {
    LlamaConfig { n_layers: 2, seq_len: 4, batch_size: 1, vocab_size: 512, ..LlamaConfig::preset(Preset::B8) }
}

/// The unfused training step and the kernel graph of `cfg`, the latter built with verification
/// after every pass.
fn unfused_and_fused(cfg: &LlamaConfig, name: &str) -> (Graph, Graph) {
    let model = build_llama3(cfg, name).expect("model");
    let opts = TrainOptions::default();
    let unfused = lower_to_train(&model, &opts).expect("lowering");
    let (fused, _) = compile_train_graph(&model, &opts, &PipelineOptions { verify_each: true, ..PipelineOptions::default() }).expect("fusion");
    (unfused, fused)
}

/// Random arguments of `main`: tokens and targets below `vocab`, step 7, states drawn around
/// their initializers' scale, moments small (the second moment positive).
fn random_args(g: &Graph, seed: u64) -> Vec<Tensor<f32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let vocab = g.meta_i64("vocab_size").expect("vocab_size in meta");
    let mut args = Vec::new();
    for a in &g.main.args {
        let ty = g.main.ty(a.value);
        let shape = ty.resolve(&g.dims).expect("bound dims");
        let n: usize = shape.iter().product();
        let name = g.main.value(a.value).name.clone().unwrap_or_default();
        let t = match &a.kind {
            ArgKind::Input if name == "step" => Tensor::scalar(ty.dtype, 7.0),
            ArgKind::Input => Tensor::from_ints(ty.dtype, shape, (0..n).map(|_| rng.random_range(0..vocab)).collect()).expect("ints"),
            ArgKind::State(p) | ArgKind::Param(p) => {
                let (lo, hi) = if p.name.ends_with(".exp_avg_sq") {
                    (0.0, 1e-4)
                } else if p.name.ends_with(".exp_avg") {
                    (-1e-2, 1e-2)
                } else {
                    match p.init {
                        Init::Ones => (0.9, 1.1),
                        Init::Zeros => (-0.01, 0.01),
                        Init::Normal { std } | Init::TruncNormal { std, .. } => (-2.0 * std as f32, 2.0 * std as f32),
                        // Any values do: the fused and unfused graphs read the same ones.
                        Init::ComputeCopy => (-0.05, 0.05),
                    }
                };
                Tensor::from_vec(ty.dtype, shape, (0..n).map(|_| rng.random_range(lo..=hi)).collect()).expect("floats")
            }
            ArgKind::Block => panic!("main has a block argument"),
        };
        args.push(t);
    }
    args
}

/// `(name, tensor)` of every output and update of one step.
fn run_step(g: &Graph, args: &[Tensor<f32>]) -> Vec<(String, Tensor<f32>)> {
    let r = Interpreter::new(g, Precision::Emulate).run(args).unwrap_or_else(|e| panic!("{} does not run: {e}", g.name));
    let names = g
        .main
        .outputs
        .iter()
        .map(|o| o.name.clone().unwrap_or_default())
        .chain(g.main.updates.iter().map(|u| format!("{} <-", g.main.value(u.state).name.clone().unwrap_or_default())));
    names.zip(r.outputs.into_iter().chain(r.updates)).collect()
}

fn bits(t: &Tensor<f32>) -> Vec<u32> {
    t.to_f64_vec().iter().map(|&x| (x as f32).to_bits()).collect()
}

/// One step of both graphs on the same random arguments; every result bit-identical.
fn assert_same_step(unfused: &Graph, fused: &Graph, seed: u64) {
    let args = random_args(unfused, seed);
    let want = run_step(unfused, &args);
    let got = run_step(fused, &args);
    assert_eq!(want.len(), got.len(), "the graphs return different numbers of results");
    for ((name, w), (gname, g)) in want.iter().zip(&got) {
        assert_eq!(name, gname, "results are in a different order");
        assert_eq!((w.dtype, &w.shape), (g.dtype, &g.shape), "`{name}` has a different type");
        let (wb, gb) = (bits(w), bits(g));
        if let Some(i) = wb.iter().zip(&gb).position(|(a, b)| a != b) {
            panic!("`{name}` differs at element {i}: unfused {} vs fused {}", f32::from_bits(wb[i]), f32::from_bits(gb[i]));
        }
    }
    let loss = &want[0].1;
    assert!(loss.to_f64_vec()[0].is_finite() && loss.to_f64_vec()[0] > 0.0, "the step computed a meaningful loss");
}

#[test]
fn debug_bf16_step_is_bit_identical_after_fusion() {
    let (unfused, fused) = unfused_and_fused(&debug_config(DType::BF16), "debug");
    assert_same_step(&unfused, &fused, 1);
}

#[test]
fn debug_f32_step_is_bit_identical_after_fusion() {
    let (unfused, fused) = unfused_and_fused(&debug_config(DType::F32), "debug_f32");
    assert_same_step(&unfused, &fused, 2);
}

/// `(kind, ops of the body)` of every kernel of region `name`, in order.
fn kernel_list(g: &Graph, name: &str) -> Vec<(KernelKind, String)> {
    let r = if name == "main" { &g.main } else { g.block(g.block_by_name(name).expect("region")) };
    r.order
        .iter()
        .filter_map(|&n| match r.node(n).op {
            Op::Kernel { body, kind } => {
                let b = g.block(body);
                Some((kind, b.order.iter().map(|&m| b.node(m).op.name()).collect::<Vec<_>>().join(" ")))
            }
            _ => None,
        })
        .collect()
}

fn expect(list: &[(KernelKind, &str)]) -> Vec<(KernelKind, String)> {
    list.iter().map(|&(k, ops)| (k, ops.to_string())).collect()
}

/// The invariants of a kernel graph, and every block fused once: one `@layer` and one
/// `@layer_bwd`, whatever the layer count.
fn assert_kernel_graph(g: &Graph) {
    assert_eq!(check_kernel_graph(g), Vec::<String>::new());
    assert_eq!(g.blocks.iter().filter(|b| b.name == "layer" || b.name == "layer_bwd").count(), 2);
}

use KernelKind::{Attention, AttentionBwd, Fused, Gather, Gemm, Optimizer, ScatterAdd};

#[test]
fn debug_model_kernels() {
    let (_, g) = unfused_and_fused(&debug_config(DType::BF16), "debug");
    assert_kernel_graph(&g);
    #[rustfmt::skip]
    let layer = expect(&[
        (Fused, "rmsnorm"), (Gemm, "linear"), (Gemm, "linear"), (Gemm, "linear"), (Fused, "rope"), (Fused, "rope"),
        (Attention, "attention"), (Gemm, "linear add"), (Fused, "rmsnorm"), (Gemm, "linear"), (Gemm, "linear"),
        (Fused, "silu mul"), (Gemm, "linear add"),
    ]);
    assert_eq!(kernel_list(&g, "layer"), layer);
    #[rustfmt::skip]
    let layer_bwd = expect(&[
        (Gemm, "matmul"), (Gemm, "matmul"), (Fused, "mul silu mul silu_grad"), (Gemm, "matmul"), (Gemm, "matmul"), (Gemm, "matmul add"),
        (Gemm, "matmul"), (Fused, "rmsnorm_bwd add"), (Gemm, "matmul"), (Gemm, "matmul"), (AttentionBwd, "attention_bwd"),
        (Fused, "rope"), (Fused, "rope"), (Gemm, "matmul"), (Gemm, "matmul"), (Gemm, "matmul add"), (Gemm, "matmul"), (Gemm, "matmul add"),
        (Gemm, "matmul"), (Fused, "rmsnorm_bwd add"),
    ]);
    assert_eq!(kernel_list(&g, "layer_bwd"), layer_bwd);
    let main = kernel_list(&g, "main");
    let count = |k: KernelKind, ops: &str| main.iter().filter(|(kk, o)| *kk == k && o == ops).count();
    // `compute-copies`: no master->bf16 cast kernels; the optimizer writes the copies (the debug
    // model's table is small: its lookup reads the copy too).
    assert_eq!(count(Fused, "cast"), 0, "parameter casts: {main:?}");
    assert_eq!(count(Fused, "cast square reduce_sum"), 12, "per-gradient norms: {main:?}");
    assert_eq!(count(Fused, "cross_entropy constant cross_entropy_bwd"), 1, "loss and its gradient read the logits once: {main:?}");
    assert_eq!((count(Gather, "embedding"), count(ScatterAdd, "scatter_add"), count(Fused, "rmsnorm"), count(Fused, "rmsnorm_bwd")), (1, 1, 1, 1));
    assert_eq!(main.iter().filter(|(k, _)| *k == Gemm).count(), 3);
    let opt: Vec<&String> = main.iter().filter(|(k, _)| *k == Optimizer).map(|(_, o)| o).collect();
    assert_eq!(opt.len(), 1, "one optimizer kernel");
    assert_eq!(opt[0].matches("adamw").count(), 12);
    assert_eq!(opt[0].matches("mul").count(), 12, "the clip multiplies run in the optimizer");
    assert_eq!(opt[0].matches("cast").count(), 24, "gradient casts and the compute copies of the new masters");
    assert!(opt[0].contains("lr_schedule"));
    let scalar = main.iter().find(|(_, o)| o.contains("sqrt")).expect("the grad-norm kernel");
    assert_eq!(scalar.1, "add add add add add add add add add add add sqrt constant add constant div min");
    assert_eq!(main.len(), 22);
}

/// Fusion decisions depend on shapes only through the rules; the 8B-shaped model fuses the
/// same way as the debug model, but for its embedding table (512 rows for 4 tokens, where the
/// debug model has 256 for 512), which `compute-copies` leaves without a copy: the lookup's
/// rows are cast after it, and the optimizer writes one compute copy fewer.
#[test]
fn b8_shaped_model_fuses_like_the_debug_model() {
    let (_, debug) = unfused_and_fused(&debug_config(DType::BF16), "debug");
    let (_, b8) = unfused_and_fused(&b8_shaped_config(), "8b_2l");
    assert_kernel_graph(&b8);
    for region in ["layer", "layer_bwd"] {
        assert_eq!(kernel_list(&b8, region), kernel_list(&debug, region), "@{region}");
    }
    let mut want = kernel_list(&debug, "main");
    want.insert(1, (KernelKind::Fused, "cast".to_string()));
    let opt = want.last_mut().expect("the optimizer kernel");
    opt.1 = opt.1.strip_suffix(" cast").expect("the optimizer writes compute copies").to_string();
    assert_eq!(kernel_list(&b8, "main"), want, "@main");
}

#[test]
fn the_kernel_graph_reads_back_from_its_text() {
    let (_, g) = unfused_and_fused(&debug_config(DType::BF16), "debug");
    let text = titan_ir::print::print_graph(&g);
    let back = titan_ir::parse_and_verify("fused.ir", &text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(titan_ir::print::print_graph(&back), text);
}

/// The text of the blocks named `layer*` (the fused blocks and their kernel bodies).
fn layer_blocks(text: &str) -> String {
    let mut out = String::new();
    let mut keep = false;
    for line in text.lines() {
        if line.starts_with("  block @") {
            keep = line.starts_with("  block @layer");
        }
        if keep {
            out.push_str(line);
            out.push('\n');
        }
        if line == "  }" {
            if keep {
                out.push('\n');
            }
            keep = false;
        }
    }
    out
}

#[test]
fn debug_fused_layer_blocks_snapshot() {
    let (_, g) = unfused_and_fused(&debug_config(DType::BF16), "debug");
    insta::assert_snapshot!(layer_blocks(&titan_ir::print::print_graph(&g)));
}

#[test]
fn debug_fusion_report_snapshot() {
    let (unfused, fused) = unfused_and_fused(&debug_config(DType::BF16), "debug");
    let report = fusion_report(&unfused, &fused);
    assert!(report.bytes_after < report.bytes_before, "fusion saves memory traffic");
    assert_eq!(report.region("layer").map(|r| (r.runs, r.kernels.len())), Some((2, 13)));
    insta::assert_snapshot!(report.to_string());
}

/// The report of the 8B-shaped test model and of the real 8B preset (32 layers, seq 8192,
/// vocab 128256; graphs only, nothing runs). Printed with `--nocapture`.
#[test]
fn b8_fusion_reports() {
    for (cfg, name) in [(b8_shaped_config(), "8b_2l"), (LlamaConfig::preset(Preset::B8), "8b")] {
        let (unfused, fused) = unfused_and_fused(&cfg, name);
        let report = fusion_report(&unfused, &fused);
        println!("{report}");
        assert!(report.bytes_after < report.bytes_before, "fusion saves memory traffic");
        assert_eq!(
            report.kernel_count(),
            56,
            "68 before `compute-copies` (12 parameter casts; the embedding's rows are cast after the lookup), 57 before the GEMMs took their residual adds"
        );
        assert_eq!(report.region("layer_bwd").map(|r| r.runs), Some(cfg.n_layers));
    }
}
