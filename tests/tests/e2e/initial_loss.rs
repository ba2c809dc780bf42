//! Every preset starts near a sane loss on uniform random tokens: `ln(vocab) + σ²/2` within
//! [`MARGIN`] nats, `σ²` the variance of the first logits (`docs/ir.md`, "Initial loss").
//! The expectation is computed from each preset's model graph (the head's init and its dims);
//! the forward runs for real on the CPU where it is cheap: the debug preset (untied and tied) and
//! the tied 1B and 3B with one layer and 16 tokens (one layer is the tied table's worst case: the
//! fewer layers add to the residual stream, the more the input token's own logit stands out).

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::interp::{Interpreter, Precision, Tensor};
use titan_ir::shape::resolve_dim;
use titan_ir::{ArgKind, DType, Graph, Init, Op, Region, Value, ValueDef};

/// How far (in nats) the first loss may be from `ln(vocab)`: the head's logits add `σ²/2 ≈ 0.49`,
/// the sample mean over 16 tokens varies by about 0.25.
const MARGIN: f64 = 1.0;

/// What the model graph says about its first loss.
#[derive(Debug)]
struct Expected {
    ln_vocab: f64,
    /// Variance of one logit: `dim × Var(head entry)` (the final norm's output has unit RMS).
    logit_var: f64,
}

impl Expected {
    /// `E[loss] ≈ ln V + σ²/2` for Gaussian logits with `σ² ≪ ln V`.
    fn loss(&self) -> f64 {
        self.ln_vocab + self.logit_var / 2.0
    }
}

/// The node that computes `v` in `r`, if any.
fn def_op(r: &Region, v: Value) -> Option<(&Op, &[Value])> {
    match r.value(v).def {
        ValueDef::Result { node, .. } => {
            let n = r.node(node);
            Some((&n.op, &n.inputs))
        }
        ValueDef::Arg(_) => None,
    }
}

/// The initializer of the parameter `v` of `r`.
fn param_init(r: &Region, v: Value) -> Result<Init, String> {
    r.arg_of(v).and_then(|a| a.kind.param_info()).map(|p| p.init).ok_or_else(|| format!("{v} is not a parameter"))
}

/// The variance of one entry drawn by `init` (layer 0 of a depth-scaled init).
fn init_variance(init: Init) -> Result<f64, String> {
    match init {
        Init::Normal { std } => Ok(std * std),
        Init::TruncNormal { std, lo, hi, depth_scaled: false } => Ok(std * std * truncated_variance_factor(lo / std, hi / std)),
        other => Err(format!("no variance rule for the head init {other:?}")),
    }
}

/// `Var(X | a <= X <= b) / Var(X)` for a standard normal `X` (Simpson's rule over `[a, b]`,
/// assuming `a = -b`, so the mean is 0).
fn truncated_variance_factor(a: f64, b: f64) -> f64 {
    let n = 2000;
    let h = (b - a) / n as f64;
    let phi = |x: f64| (-x * x / 2.0).exp();
    let (mut mass, mut second) = (0.0, 0.0);
    for i in 0..=n {
        let x = a + h * i as f64;
        let w = if i == 0 || i == n {
            1.0
        } else if i % 2 == 1 {
            4.0
        } else {
            2.0
        };
        mass += w * phi(x);
        second += w * x * x * phi(x);
    }
    second / mass
}

/// The expected first loss of a model graph: `loss = cross_entropy(linear(rmsnorm(h, norm),
/// head), targets)`, the norm's weight initialized to ones, the head `[vocab, dim]`.
fn expected_initial_loss(g: &Graph) -> Result<Expected, String> {
    let m = &g.main;
    let loss = m.outputs.iter().find(|o| o.name.as_deref() == Some("loss")).ok_or("no `loss` output")?.value;
    let Some((Op::CrossEntropy, [logits, _])) = def_op(m, loss) else { return Err("the loss is not a cross_entropy".into()) };
    let Some((Op::Linear, [hn, head])) = def_op(m, *logits) else { return Err("the logits are not a linear".into()) };
    let Some((Op::RmsNorm { .. }, [_, norm])) = def_op(m, *hn) else { return Err("the head's input is not an rmsnorm".into()) };
    if param_init(m, *norm)? != Init::Ones {
        return Err("the final norm's weight does not start at ones".into());
    }
    let shape: Vec<u64> = m.ty(*head).shape.iter().map(|d| resolve_dim(d, &g.dims).ok_or("the head has an unbound dim")).collect::<Result<_, _>>()?;
    let [vocab, dim] = shape[..] else { return Err(format!("the head has shape {shape:?}, expected [vocab, dim]")) };
    Ok(Expected { ln_vocab: (vocab as f64).ln(), logit_var: dim as f64 * init_variance(param_init(m, *head)?)? })
}

/// The loss of the model graph's forward (bf16 emulated) with its initial parameters (seed 0)
/// on uniform random tokens and targets.
fn first_loss(g: &Graph) -> f64 {
    let vocab = g.meta_i64("vocab_size").expect("invariant: a llama graph records vocab_size");
    let (batch, seq) = (g.dims["batch"] as usize, g.dims["seq"] as usize);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut args = Vec::new();
    for a in &g.main.args {
        let ty = g.main.ty(a.value);
        let t = match &a.kind {
            ArgKind::Input => {
                let ids: Vec<i64> = (0..batch * seq).map(|_| rng.random_range(0..vocab)).collect();
                Tensor::from_ints(DType::I32, [batch, seq], ids).expect("token tensor")
            }
            ArgKind::Param(p) => {
                let shape: Vec<usize> = ty.shape.iter().map(|d| resolve_dim(d, &g.dims).expect("param dims are bound") as usize).collect();
                let (layers, per_layer) = if p.is_stacked() { (shape[0], shape[1..].iter().product()) } else { (1, shape.iter().product()) };
                let values = titan_runtime::init::init_values(p.init, layers, per_layer, 0, &|l| p.layer_name(l)).expect("init");
                Tensor::from_vec(ty.dtype, shape, values).expect("param tensor")
            }
            other => panic!("unexpected argument kind {other:?} in a model graph"),
        };
        args.push(t);
    }
    let out = Interpreter::new(g, Precision::Emulate).run::<f32>(&args).expect("forward");
    out.outputs[0].to_f64_vec()[0]
}

fn check(what: &str, got: f64, e: &Expected) {
    eprintln!("{what}: first loss {got:.3}, ln(vocab) {:.3}, ln(vocab) + σ²/2 = {:.3}", e.ln_vocab, e.loss());
    assert!(
        (got - e.ln_vocab).abs() <= MARGIN,
        "{what}: first loss {got:.3} is not within {MARGIN} of ln(vocab) = {:.3} (logit variance {:.3}); is the output head (or the embedding tied to it) initialized too wide?",
        e.ln_vocab,
        e.logit_var
    );
}

#[test]
fn every_preset_expects_a_first_loss_near_ln_vocab() {
    for p in Preset::ALL {
        for tie in [false, true] {
            let cfg = LlamaConfig { tie_embeddings: tie, ..LlamaConfig::preset(p) };
            let g = build_llama3(&cfg, p.name()).expect("preset builds");
            let e = expected_initial_loss(&g).unwrap_or_else(|err| panic!("{p}: {err}"));
            check(&format!("{p} (tie_embeddings {tie}, expected)"), e.loss(), &e);
        }
    }
}

/// The rule behind the expectation: the untied head's init gives logits of variance 0.973 at
/// every width (a normal truncated at ±3 std keeps 97.3% of the variance); a tied table's no more.
#[test]
fn the_head_init_gives_unit_logits_at_every_width() {
    assert!((truncated_variance_factor(-3.0, 3.0) - 0.9733).abs() < 1e-4);
    for p in Preset::ALL {
        for tie in [false, true] {
            let g = build_llama3(&LlamaConfig { tie_embeddings: tie, ..LlamaConfig::preset(p) }, p.name()).expect("preset builds");
            let e = expected_initial_loss(&g).expect("expectation");
            if tie {
                assert!(e.logit_var <= 0.9734, "{p} tied: logit variance {}", e.logit_var);
            } else {
                assert!((e.logit_var - 0.9733).abs() < 1e-3, "{p}: logit variance {}", e.logit_var);
            }
        }
    }
}

#[test]
fn the_debug_preset_starts_at_its_expected_loss() {
    for tie in [false, true] {
        let cfg = LlamaConfig { tie_embeddings: tie, ..LlamaConfig::preset(Preset::Debug) };
        let g = build_llama3(&cfg, "debug").expect("debug builds");
        let e = expected_initial_loss(&g).expect("expectation");
        let got = first_loss(&g);
        check(&format!("debug (tie_embeddings {tie})"), got, &e);
        assert!((got - e.loss()).abs() <= MARGIN, "debug (tie_embeddings {tie}): first loss {got:.3}, expected {:.3}", e.loss());
    }
}

/// The tied presets for real, with one layer, one sequence of 16 tokens.
#[test]
fn the_tied_1b_and_3b_start_near_ln_vocab() {
    for p in [Preset::B1, Preset::B3] {
        let cfg = LlamaConfig { n_layers: 1, seq_len: 16, batch_size: 1, ..LlamaConfig::preset(p) };
        assert!(cfg.tie_embeddings, "{p} is a tied preset");
        let g = build_llama3(&cfg, p.name()).expect("preset builds");
        let e = expected_initial_loss(&g).expect("expectation");
        check(&format!("{p} with one layer"), first_loss(&g), &e);
    }
}
