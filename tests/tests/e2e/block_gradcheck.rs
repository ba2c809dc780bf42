//! Whole-model gradient check: the training graph's gradients of a small Llama-3 (two layers
//! of the real block through `repeat`, head and loss) against central finite differences in
//! f64, with no rounding. Tolerance: |analytic - numeric| <= 1e-6 * max(1, |numeric|).

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::interp::{Interpreter, Precision, Tensor};
use titan_ir::{ArgKind, DType, Output};
use titan_passes::autodiff::differentiate_main;
use titan_passes::master_weights::master_weights;

fn tiny(tie_embeddings: bool) -> LlamaConfig {
    let mut c = LlamaConfig::preset(Preset::Debug);
    c.dim = 16;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.ffn_dim = 24;
    c.vocab_size = 11;
    c.seq_len = 5;
    c.batch_size = 2;
    c.dtype = DType::F32;
    c.tie_embeddings = tie_embeddings;
    c
}

fn check_model(cfg: &LlamaConfig) {
    let mut g = build_llama3(cfg, "tiny").expect("model builds");
    master_weights(&mut g).expect("masters");
    let n_args = g.main.args.len();
    let (grads, stats) = differentiate_main(&mut g, "loss").expect("autodiff");
    assert_eq!(stats.blocks_differentiated, 1, "the block is differentiated once for all layers");
    let mut checked_params = Vec::new();
    for (i, gv) in grads.iter().enumerate() {
        if let Some(v) = gv {
            g.main.outputs.push(Output { name: Some(format!("grad{i}")), value: *v });
            checked_params.push(i);
        }
    }
    let errs = titan_ir::verify::verify(&g);
    assert!(errs.is_empty(), "{:?}", errs.iter().map(|e| e.to_string()).collect::<Vec<_>>());
    let n_states = g.main.args.iter().filter(|a| matches!(a.kind, ArgKind::State(_))).count();
    assert_eq!(checked_params.len(), n_states, "every parameter gets a gradient");

    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut args = Vec::new();
    for a in &g.main.args[..n_args] {
        let shape = g.main.ty(a.value).resolve(&g.dims).expect("bound dims");
        let n: usize = shape.iter().product();
        let t = match a.kind {
            ArgKind::Input => Tensor::from_ints(DType::I32, shape, (0..n).map(|_| rng.random_range(0..cfg.vocab_size as i64)).collect()),
            // Weights larger than the real init so every path contributes visibly.
            _ => Tensor::from_vec(DType::F32, shape, (0..n).map(|_| rng.random_range(-0.5..0.5)).collect()),
        };
        args.push(t.expect("tensor"));
    }
    let interp = Interpreter::new(&g, Precision::Exact);
    let base = interp.run::<f64>(&args).expect("run");
    let h = 1e-6;
    let (mut nonzero, mut total) = (0, 0);
    for (k, &i) in checked_params.iter().enumerate() {
        let analytic = base.outputs[1 + k].to_f64_vec();
        let n = analytic.len();
        for _ in 0..6 {
            let j = rng.random_range(0..n);
            let orig = args[i].floats().expect("float")[j];
            args[i].floats_mut().expect("float")[j] = orig + h;
            let lp = interp.run::<f64>(&args).expect("run").outputs[0].to_f64_vec()[0];
            args[i].floats_mut().expect("float")[j] = orig - h;
            let lm = interp.run::<f64>(&args).expect("run").outputs[0].to_f64_vec()[0];
            args[i].floats_mut().expect("float")[j] = orig;
            let numeric = (lp - lm) / (2.0 * h);
            let name = g.main.value(g.main.args[i].value).name.clone().unwrap_or_default();
            total += 1;
            nonzero += usize::from(numeric.abs() > 1e-6);
            assert!((analytic[j] - numeric).abs() <= 1e-6 * numeric.abs().max(1.0), "{name}[{j}]: analytic {} vs numeric {numeric}", analytic[j]);
        }
    }
    // The check is only meaningful if the loss actually depends on what was perturbed.
    assert!(nonzero * 4 >= total * 3, "only {nonzero} of {total} sampled gradients are non-zero");
}

#[test]
fn llama_block_and_head_gradients_match_finite_differences() {
    check_model(&tiny(false));
}

#[test]
fn tied_embeddings_accumulate_both_gradients() {
    check_model(&tiny(true));
}
