//! Llama-3 configurations (presets, overrides, validation) and the builder of the model graph.
//!
//! The graph follows TorchTitan's Llama-3: `tok_embeddings`, `n_layers` transformer blocks
//! (RMSNorm, grouped-query attention with RoPE, SwiGLU feed-forward), a final `norm` and the
//! `output` head, with TorchTitan's parameter names and initializers. The transformer block is
//! built once as the `@layer` block and run by a single `repeat`, so the graph's size does not
//! depend on the number of layers.

use std::fmt;
use std::str::FromStr;

use titan_ir::shape::DimTable;
use titan_ir::{
    ArgKind, AttrValue, Attrs, BinaryOp, BlockId, Builder, DType, Dim, Graph, Init, Op, Output, ParamInfo, Region, RopeConfig, RopeLayout, RopeScaling,
    TensorType, UnaryOp, Value,
};

use crate::FrontendError;

/// The largest value any single size may take (token ids are `i32`; `repeat` counts are `u32`).
pub const MAX_SIZE: u64 = i32::MAX as u64;

/// The largest element count of one tensor (so that byte sizes of 8-byte elements fit in `i64`).
pub const MAX_ELEMENTS: u128 = 1 << 60;

/// The built-in model sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Preset {
    /// A tiny model (dim 64, 2 layers, byte-level vocab 256) that trains on a CPU.
    Debug,
    /// Llama 3.2 1B (tied embeddings, Llama 3.1 rope scaling with factor 32).
    B1,
    /// Llama 3.2 3B (tied embeddings, rope scaling factor 32).
    B3,
    /// Llama 3 8B (no rope scaling).
    B8,
    /// Llama 3 70B (no rope scaling).
    B70,
    /// Llama 3.1 405B (rope scaling factor 8).
    B405,
}

impl Preset {
    pub const ALL: [Preset; 6] = [Preset::Debug, Preset::B1, Preset::B3, Preset::B8, Preset::B70, Preset::B405];

    /// The name used on the command line and in the graph name (`llama3_8b`).
    pub fn name(self) -> &'static str {
        match self {
            Preset::Debug => "debug",
            Preset::B1 => "1b",
            Preset::B3 => "3b",
            Preset::B8 => "8b",
            Preset::B70 => "70b",
            Preset::B405 => "405b",
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = FrontendError;
    fn from_str(s: &str) -> Result<Preset, FrontendError> {
        let lower = s.to_ascii_lowercase();
        Preset::ALL.into_iter().find(|p| p.name() == lower).ok_or_else(|| FrontendError::UnknownPreset(s.to_string()))
    }
}

/// Everything that determines the shape of a Llama-3 model graph.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Model (hidden) dimension.
    pub dim: u64,
    pub n_layers: u64,
    /// Query heads.
    pub n_heads: u64,
    /// Key/value heads (grouped-query attention); divides `n_heads`.
    pub n_kv_heads: u64,
    /// Hidden dimension of the SwiGLU feed-forward.
    pub ffn_dim: u64,
    pub vocab_size: u64,
    /// Tokens per sequence (the `seq` dimension).
    pub seq_len: u64,
    /// Sequences per step (the `batch` dimension).
    pub batch_size: u64,
    pub rope_theta: f64,
    pub norm_eps: f64,
    /// Llama 3.1 RoPE frequency scaling.
    pub rope_scaling: Option<RopeScaling>,
    /// The output head reuses `tok_embeddings.weight` (Llama 3.2 1B/3B).
    pub tie_embeddings: bool,
    /// Element type of the parameters and activations.
    pub dtype: DType,
}

/// Llama 3.1's rope scaling with the given factor (low 1, high 4, original context 8192).
fn llama31_scaling(factor: f64) -> RopeScaling {
    RopeScaling { factor, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 }
}

impl LlamaConfig {
    /// The configuration of a preset.
    pub fn preset(p: Preset) -> LlamaConfig {
        let base = LlamaConfig {
            dim: 4096,
            n_layers: 32,
            n_heads: 32,
            n_kv_heads: 8,
            ffn_dim: 14336,
            vocab_size: 128256,
            seq_len: 8192,
            batch_size: 1,
            rope_theta: 500000.0,
            norm_eps: 1e-5,
            rope_scaling: None,
            tie_embeddings: false,
            dtype: DType::BF16,
        };
        match p {
            Preset::B8 => base,
            Preset::B70 => LlamaConfig { dim: 8192, n_layers: 80, n_heads: 64, n_kv_heads: 8, ffn_dim: 28672, ..base },
            Preset::B405 => {
                LlamaConfig { dim: 16384, n_layers: 126, n_heads: 128, n_kv_heads: 8, ffn_dim: 53248, rope_scaling: Some(llama31_scaling(8.0)), ..base }
            }
            Preset::B1 => LlamaConfig {
                dim: 2048,
                n_layers: 16,
                n_heads: 32,
                n_kv_heads: 8,
                ffn_dim: 8192,
                rope_scaling: Some(llama31_scaling(32.0)),
                tie_embeddings: true,
                ..base
            },
            Preset::B3 => LlamaConfig {
                dim: 3072,
                n_layers: 28,
                n_heads: 24,
                n_kv_heads: 8,
                ffn_dim: 8192,
                rope_scaling: Some(llama31_scaling(32.0)),
                tie_embeddings: true,
                ..base
            },
            Preset::Debug => LlamaConfig { dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 192, vocab_size: 256, seq_len: 64, batch_size: 8, ..base },
        }
    }

    /// Dimension of one attention head, `dim / n_heads` (0 when `n_heads` is 0).
    pub fn head_dim(&self) -> u64 {
        self.dim.checked_div(self.n_heads).unwrap_or(0)
    }

    /// Check that the configuration describes a buildable model; the error says what to change.
    pub fn validate(&self) -> Result<(), FrontendError> {
        let sizes = [
            ("dim", self.dim),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("ffn_dim", self.ffn_dim),
            ("vocab_size", self.vocab_size),
            ("seq_len", self.seq_len),
            ("batch_size", self.batch_size),
        ];
        for (key, v) in sizes {
            if v == 0 {
                return Err(FrontendError::invalid(format!("{key}=0 must be positive; set {key} to 1 or more")));
            }
            if v > MAX_SIZE {
                return Err(FrontendError::invalid(format!("{key}={v} is too large; choose {key} <= {MAX_SIZE}")));
            }
        }
        if !matches!(self.dtype, DType::BF16 | DType::F16 | DType::F32) {
            return Err(FrontendError::invalid(format!("dtype={} is not supported for model weights; choose dtype bf16, f16 or f32", self.dtype)));
        }
        if !self.dim.is_multiple_of(self.n_heads) {
            return Err(FrontendError::invalid(format!(
                "n_heads={} does not divide dim={}; choose n_heads in {}",
                self.n_heads,
                self.dim,
                choices(&divisors(self.dim), self.n_heads)
            )));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(FrontendError::invalid(format!(
                "n_kv_heads={} does not divide n_heads={}; choose n_kv_heads in {}",
                self.n_kv_heads,
                self.n_heads,
                choices(&divisors(self.n_heads), self.n_kv_heads)
            )));
        }
        let hd = self.head_dim();
        if !hd.is_multiple_of(2) {
            let good: Vec<u64> = divisors(self.dim).into_iter().filter(|d| (self.dim / d).is_multiple_of(2)).collect();
            let fix = if good.is_empty() {
                format!("choose an even dim (dim={} is odd)", self.dim)
            } else {
                format!("choose n_heads in {} so that dim / n_heads is even", choices(&good, self.n_heads))
            };
            return Err(FrontendError::invalid(format!(
                "head_dim = dim / n_heads = {} / {} = {hd} is odd but rope needs an even head_dim; {fix}",
                self.dim, self.n_heads
            )));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(FrontendError::invalid(format!("rope_theta={} must be a positive number such as 500000", self.rope_theta)));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Err(FrontendError::invalid(format!("norm_eps={} must be a positive number such as 1e-5", self.norm_eps)));
        }
        if let Some(s) = &self.rope_scaling {
            for (key, v) in [("factor", s.factor), ("low_freq_factor", s.low_freq_factor), ("high_freq_factor", s.high_freq_factor)] {
                if !(v.is_finite() && v > 0.0) {
                    return Err(FrontendError::invalid(format!("rope scaling {key}={v} must be a positive number")));
                }
            }
            if s.high_freq_factor <= s.low_freq_factor {
                return Err(FrontendError::invalid(format!(
                    "rope scaling high_freq_factor={} must be greater than low_freq_factor={} (Llama 3.1 uses 4 and 1)",
                    s.high_freq_factor, s.low_freq_factor
                )));
            }
            if s.original_max_position == 0 {
                return Err(FrontendError::invalid("rope scaling original_max_position=0 must be positive (Llama 3.1 uses 8192)"));
            }
        }
        self.check_tensor_sizes()
    }

    /// Every tensor of the model must have a representable element count.
    fn check_tensor_sizes(&self) -> Result<(), FrontendError> {
        let c = |x: u64| u128::from(x);
        let (b, s, d, l, f, v) = (c(self.batch_size), c(self.seq_len), c(self.dim), c(self.n_layers), c(self.ffn_dim), c(self.vocab_size));
        let checks = [
            ("batch_size * seq_len * vocab_size (the logits)", b * s * v, "batch_size, seq_len or vocab_size"),
            ("batch_size * seq_len * ffn_dim (the feed-forward activations)", b * s * f, "batch_size, seq_len or ffn_dim"),
            ("batch_size * seq_len * dim (the hidden states)", b * s * d, "batch_size, seq_len or dim"),
            ("vocab_size * dim (the embedding table)", v * d, "vocab_size or dim"),
            ("n_layers * ffn_dim * dim (the stacked feed-forward weights)", l * f * d, "n_layers, ffn_dim or dim"),
            ("n_layers * dim * dim (the stacked attention weights)", l * d * d, "n_layers or dim"),
        ];
        for (what, n, knobs) in checks {
            if n > MAX_ELEMENTS {
                return Err(FrontendError::invalid(format!("{what} = {n} elements exceeds the limit of 2^60; reduce {knobs}")));
            }
        }
        Ok(())
    }

    /// The graph's `meta` dictionary describing this configuration.
    pub fn meta(&self) -> Attrs {
        let int = |x: u64| AttrValue::Int(x as i64);
        let mut e: Vec<(&str, AttrValue)> = vec![
            ("arch", AttrValue::Str("llama3".into())),
            ("dim", int(self.dim)),
            ("n_layers", int(self.n_layers)),
            ("n_heads", int(self.n_heads)),
            ("n_kv_heads", int(self.n_kv_heads)),
            ("head_dim", int(self.head_dim())),
            ("ffn_dim", int(self.ffn_dim)),
            ("vocab_size", int(self.vocab_size)),
            ("seq_len", int(self.seq_len)),
            ("rope_theta", AttrValue::Float(self.rope_theta)),
            ("norm_eps", AttrValue::Float(self.norm_eps)),
            ("tie_embeddings", AttrValue::Bool(self.tie_embeddings)),
        ];
        if let Some(s) = &self.rope_scaling {
            e.push(("rope_scaling_factor", AttrValue::Float(s.factor)));
            e.push(("rope_low_freq_factor", AttrValue::Float(s.low_freq_factor)));
            e.push(("rope_high_freq_factor", AttrValue::Float(s.high_freq_factor)));
            e.push(("rope_original_max_position", int(s.original_max_position)));
        }
        Attrs::new(e.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
    }
}

/// `{1, 2, 4}`; long lists keep the choices closest to `wanted`.
fn choices(options: &[u64], wanted: u64) -> String {
    const MAX: usize = 16;
    let mut shown: Vec<u64> = options.to_vec();
    if shown.len() > MAX {
        shown.sort_by_key(|&x| x.abs_diff(wanted));
        shown.truncate(MAX);
        shown.sort_unstable();
    }
    let mut parts: Vec<String> = shown.iter().map(u64::to_string).collect();
    if shown.first() != options.first() {
        parts.insert(0, "...".into());
    }
    if shown.last() != options.last() {
        parts.push("...".into());
    }
    format!("{{{}}}", parts.join(", "))
}

/// The divisors of `n` in increasing order (`n` > 0).
fn divisors(n: u64) -> Vec<u64> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut i = 1u64;
    while i * i <= n {
        if n.is_multiple_of(i) {
            small.push(i);
            if i != n / i {
                large.push(n / i);
            }
        }
        i += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

/// Values that replace fields of a preset or Hugging Face configuration (`--dim 128`, ...).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LlamaOverrides {
    pub dim: Option<u64>,
    pub n_layers: Option<u64>,
    pub n_heads: Option<u64>,
    pub n_kv_heads: Option<u64>,
    pub ffn_dim: Option<u64>,
    pub vocab_size: Option<u64>,
    pub seq_len: Option<u64>,
    pub batch_size: Option<u64>,
    pub rope_theta: Option<f64>,
    pub norm_eps: Option<f64>,
    pub dtype: Option<DType>,
    pub tie_embeddings: Option<bool>,
}

impl LlamaOverrides {
    /// Replace every field that is set; the result still needs [`LlamaConfig::validate`].
    pub fn apply(&self, cfg: &mut LlamaConfig) {
        fn set<T: Copy>(dst: &mut T, v: Option<T>) {
            if let Some(v) = v {
                *dst = v;
            }
        }
        set(&mut cfg.dim, self.dim);
        set(&mut cfg.n_layers, self.n_layers);
        set(&mut cfg.n_heads, self.n_heads);
        set(&mut cfg.n_kv_heads, self.n_kv_heads);
        set(&mut cfg.ffn_dim, self.ffn_dim);
        set(&mut cfg.vocab_size, self.vocab_size);
        set(&mut cfg.seq_len, self.seq_len);
        set(&mut cfg.batch_size, self.batch_size);
        set(&mut cfg.rope_theta, self.rope_theta);
        set(&mut cfg.norm_eps, self.norm_eps);
        set(&mut cfg.dtype, self.dtype);
        set(&mut cfg.tie_embeddings, self.tie_embeddings);
    }

    pub fn is_empty(&self) -> bool {
        *self == LlamaOverrides::default()
    }
}

/// One per-layer weight: its block argument, its stacked parameter in `main`, its init.
struct LayerWeight {
    /// Block argument name (`wq`); `main` names the stacked parameter `layers.wq`.
    short: &'static str,
    /// Checkpoint name with `{i}` for the layer.
    ckpt: &'static str,
    /// Shape of one layer's slice.
    shape: Vec<u64>,
    init: Init,
}

/// The per-layer weights in the order of the `@layer` block's arguments after `%h`.
fn layer_weights(cfg: &LlamaConfig) -> Vec<LayerWeight> {
    let (d, hd, f) = (cfg.dim, cfg.head_dim(), cfg.ffn_dim);
    let (q, kv) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
    let tn = |depth_scaled| Init::TruncNormal { std: 0.02, lo: -2.0, hi: 2.0, depth_scaled };
    let w = |short, ckpt, shape: &[u64], init| LayerWeight { short, ckpt, shape: shape.to_vec(), init };
    vec![
        w("attention_norm", "layers.{i}.attention_norm.weight", &[d], Init::Ones),
        w("wq", "layers.{i}.attention.wq.weight", &[q, d], tn(false)),
        w("wk", "layers.{i}.attention.wk.weight", &[kv, d], tn(false)),
        w("wv", "layers.{i}.attention.wv.weight", &[kv, d], tn(false)),
        w("wo", "layers.{i}.attention.wo.weight", &[d, q], tn(true)),
        w("ffn_norm", "layers.{i}.ffn_norm.weight", &[d], Init::Ones),
        w("w1", "layers.{i}.feed_forward.w1.weight", &[f, d], tn(false)),
        w("w2", "layers.{i}.feed_forward.w2.weight", &[d, f], tn(true)),
        w("w3", "layers.{i}.feed_forward.w3.weight", &[f, d], tn(true)),
    ]
}

fn fixed(shape: &[u64]) -> Vec<Dim> {
    shape.iter().map(|&n| Dim::Fixed(n)).collect()
}

/// `[batch, seq, rest...]`
fn bs(rest: &[u64]) -> Vec<Dim> {
    let mut s = vec![Dim::named("batch"), Dim::named("seq")];
    s.extend(fixed(rest));
    s
}

/// Build the Llama-3 model graph `llama3_<name>` of `cfg` (validated first).
pub fn build_llama3(cfg: &LlamaConfig, name: &str) -> Result<Graph, FrontendError> {
    cfg.validate()?;
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(FrontendError::invalid(format!("graph name suffix `{name}` must be non-empty and use only letters, digits and `_`; use e.g. `custom`")));
    }
    let mut g = Graph::new(&format!("llama3_{name}"));
    g.meta = cfg.meta();
    g.dims.insert("batch".into(), cfg.batch_size);
    g.dims.insert("seq".into(), cfg.seq_len);
    let layer = build_layer(cfg, &g.dims).map_err(FrontendError::Build)?;
    let layer = g.add_block(layer);
    build_main(cfg, &mut g, layer).map_err(FrontendError::Build)?;
    Ok(g)
}

/// The text of [`build_llama3`]'s graph, as `titanc new` prints it.
pub fn model_ir(cfg: &LlamaConfig, name: &str) -> Result<String, FrontendError> {
    Ok(titan_ir::print::print_graph(&build_llama3(cfg, name)?))
}

/// The `@layer` block: one transformer block, `h -> h'`, over one layer's weights.
fn build_layer(cfg: &LlamaConfig, dims: &DimTable) -> Result<Region, String> {
    let (d, hd, f) = (cfg.dim, cfg.head_dim(), cfg.ffn_dim);
    let (nh, nkv) = (cfg.n_heads, cfg.n_kv_heads);
    let t = |shape: Vec<Dim>| TensorType::new(cfg.dtype, shape);
    let mut r = Region::new("layer");
    let h = r.add_arg(t(bs(&[d])), ArgKind::Block, Some("h"));
    let w: Vec<Value> = layer_weights(cfg).iter().map(|lw| r.add_arg(t(fixed(&lw.shape)), ArgKind::Block, Some(lw.short))).collect();
    let [attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3] = w[..] else {
        return Err(format!("expected 9 layer weights, found {}", w.len()));
    };
    let rope = Op::Rope(RopeConfig { theta: cfg.rope_theta, layout: RopeLayout::Half, scaling: cfg.rope_scaling, inverse: false });
    let eps = cfg.norm_eps;
    let out = {
        let mut b = Builder::new(&mut r, dims, &[]);
        // Attention.
        let xn = b.push1(Op::RmsNorm { eps }, &[h, attention_norm])?;
        b.name(xn, "xn");
        let heads = |b: &mut Builder, w: Value, n: u64, name: &str| -> Result<Value, String> {
            let flat = b.push1(Op::Linear, &[xn, w])?;
            let split = b.push_typed(Op::Reshape, &[flat], t(bs(&[n, hd])))?;
            Ok(b.name(split, name))
        };
        let q = heads(&mut b, wq, nh, "q")?;
        let k = heads(&mut b, wk, nkv, "k")?;
        let v = heads(&mut b, wv, nkv, "v")?;
        let q = b.push1(rope.clone(), &[q])?;
        b.name(q, "q_rot");
        let k = b.push1(rope, &[k])?;
        b.name(k, "k_rot");
        let scale = 1.0 / (hd as f64).sqrt();
        let att = b.push(Op::Attention { causal: true, scale }, &[q, k, v])?;
        let [o, lse] = att[..] else {
            return Err(format!("attention returned {} values, expected 2", att.len()));
        };
        b.name(o, "attn");
        b.name(lse, "lse");
        let o = b.push_typed(Op::Reshape, &[o], t(bs(&[nh * hd])))?;
        let proj = b.push1(Op::Linear, &[o, wo])?;
        let h2 = b.push1(Op::Binary(BinaryOp::Add), &[h, proj])?;
        b.name(h2, "h2");
        // Feed-forward (SwiGLU).
        let xn2 = b.push1(Op::RmsNorm { eps }, &[h2, ffn_norm])?;
        b.name(xn2, "xn2");
        let gate = b.push1(Op::Linear, &[xn2, w1])?;
        let gate = b.push1(Op::Unary(UnaryOp::Silu), &[gate])?;
        b.name(gate, "gate");
        let up = b.push1(Op::Linear, &[xn2, w3])?;
        b.name(up, "up");
        let hidden = b.push1(Op::Binary(BinaryOp::Mul), &[gate, up])?;
        let down = b.push1(Op::Linear, &[hidden, w2])?;
        let out = b.push1(Op::Binary(BinaryOp::Add), &[h2, down])?;
        b.name(out, "out");
        debug_assert_eq!(b.ty(hidden).shape, bs(&[f]));
        out
    };
    r.outputs.push(Output { name: None, value: out });
    Ok(r)
}

/// The output head's init (TorchTitan's): `trunc_normal(dim^-1/2, +-3 std)`. After the final
/// RMSNorm (unit weight) the hidden state has unit RMS, so the logits start with a standard
/// deviation of about 0.99 whatever `dim` is, and the first loss is about `ln(vocab) + 0.49`
/// (`docs/ir.md`, "Initial loss").
fn head_init(dim: u64) -> Init {
    let std = (dim as f64).powf(-0.5);
    Init::TruncNormal { std, lo: -3.0 * std, hi: 3.0 * std, depth_scaled: false }
}

/// The embedding table's init: TorchTitan's `normal(1.0)` for an embedding of its own. A table
/// tied to the output head serves both uses, and `normal(1.0)` as a head starts the logits of a
/// tied 1B model with a standard deviation of `sqrt(dim)` = 45 (a first loss in the thousands).
/// It takes Hugging Face's `initializer_range` of 0.02 (what Llama 3.2 1B/3B were initialized
/// with), capped at the head's `dim^-1/2` so that the logits never start wider than an untied
/// head's (at `dim` 2500 and more), truncated at ±3 std like the head: small enough that the
/// input token's own logit (`|row|² / rms(h)`) stays near 1 on small models too, where the layers
/// add little to the residual stream, and the first layer's RMSNorm makes the attention input
/// independent of the scale (`docs/ir.md`, "Initial loss").
fn embedding_init(cfg: &LlamaConfig) -> Init {
    if !cfg.tie_embeddings {
        return Init::Normal { std: 1.0 };
    }
    let std = (cfg.dim as f64).powf(-0.5).min(0.02);
    Init::TruncNormal { std, lo: -3.0 * std, hi: 3.0 * std, depth_scaled: false }
}

/// The `@main` step function: embedding, the repeated layers, the final norm, head and loss.
fn build_main(cfg: &LlamaConfig, g: &mut Graph, layer: BlockId) -> Result<(), String> {
    let (d, v) = (cfg.dim, cfg.vocab_size);
    let t = |shape: &[u64]| TensorType::new(cfg.dtype, fixed(shape));
    let param = |name: &str, init| ArgKind::Param(ParamInfo { name: name.to_string(), init });
    let Graph { main, dims, blocks, .. } = g;
    let m = main;
    let tokens = m.add_arg(TensorType::new(DType::I32, bs(&[])), ArgKind::Input, Some("tokens"));
    let targets = m.add_arg(TensorType::new(DType::I32, bs(&[])), ArgKind::Input, Some("targets"));
    let emb = m.add_arg(t(&[v, d]), param("tok_embeddings.weight", embedding_init(cfg)), Some("tok_embeddings"));
    let stacked: Vec<Value> = layer_weights(cfg)
        .into_iter()
        .map(|lw| {
            let mut shape = vec![cfg.n_layers];
            shape.extend(&lw.shape);
            m.add_arg(t(&shape), param(lw.ckpt, lw.init), Some(&format!("layers.{}", lw.short)))
        })
        .collect();
    let norm = m.add_arg(t(&[d]), param("norm.weight", Init::Ones), Some("norm"));
    let head = if cfg.tie_embeddings { emb } else { m.add_arg(t(&[v, d]), param("output.weight", head_init(d)), Some("output")) };
    let loss = {
        let mut b = Builder::new(m, dims, blocks);
        let x = b.push1(Op::Embedding, &[tokens, emb])?;
        b.name(x, "x");
        let count = u32::try_from(cfg.n_layers).map_err(|_| format!("n_layers={} does not fit in u32", cfg.n_layers))?;
        let stacked_n = stacked.len() as u32;
        let mut inputs = vec![x];
        inputs.extend(&stacked);
        let h = b.push1(Op::Repeat { block: layer, count, carry: 1, stacked: stacked_n, reverse: false, prefetch: 0 }, &inputs)?;
        b.name(h, "h");
        let hn = b.push1(Op::RmsNorm { eps: cfg.norm_eps }, &[h, norm])?;
        b.name(hn, "h_norm");
        let logits = b.push1(Op::Linear, &[hn, head])?;
        b.name(logits, "logits");
        let loss = b.push1(Op::CrossEntropy, &[logits, targets])?;
        b.name(loss, "loss")
    };
    m.outputs.push(Output { name: Some("loss".into()), value: loss });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisors_are_sorted_and_complete() {
        assert_eq!(divisors(1), vec![1]);
        assert_eq!(divisors(64), vec![1, 2, 4, 8, 16, 32, 64]);
        assert_eq!(divisors(12), vec![1, 2, 3, 4, 6, 12]);
    }

    #[test]
    fn long_choice_lists_are_trimmed_around_the_request() {
        let many: Vec<u64> = (1..=40).collect();
        let s = choices(&many, 20);
        assert!(s.starts_with("{..., ") && s.ends_with(", ...}"), "{s}");
        assert!(s.contains("20"), "{s}");
    }

    #[test]
    fn presets_parse_case_insensitively() {
        assert_eq!("8B".parse::<Preset>(), Ok(Preset::B8));
        assert!(matches!("7b".parse::<Preset>(), Err(FrontendError::UnknownPreset(_))));
    }
}
