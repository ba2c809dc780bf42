//! Lowering of a model graph to the training-step graph: fp32 master weights, forward,
//! backward (autodiff, each block once), gradient clipping and AdamW.

use titan_ir::{AttrValue, DecayKind, Graph, Region};

use crate::{PassDiag, PassError};

/// Optimizer and schedule settings baked into the training-step graph.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainOptions {
    pub lr: f64,
    pub warmup_steps: u64,
    /// Steps of decay after warmup (TorchTitan: `training.steps - warmup_steps`).
    pub decay_steps: u64,
    pub decay: DecayKind,
    pub min_lr_ratio: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Clip the global gradient norm to this value; `None` disables clipping.
    pub max_norm: Option<f64>,
    /// Float8 training (`--float8`): the `float8` pass converts linears; `None` leaves them.
    /// Not part of the model hash: a checkpoint trained in bf16 resumes under float8 and back.
    pub float8: Option<crate::float8::Float8Options>,
}

impl Default for TrainOptions {
    /// TorchTitan's Llama-3 defaults: lr 8e-4, warmup 200, AdamW (0.9, 0.95), eps 1e-8, weight decay 0.1, max_norm 1.0.
    fn default() -> TrainOptions {
        TrainOptions {
            lr: 8e-4,
            warmup_steps: 200,
            decay_steps: 800,
            decay: DecayKind::Linear,
            min_lr_ratio: 0.0,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            max_norm: Some(1.0),
            float8: None,
        }
    }
}

impl TrainOptions {
    /// The options as `(key, value)`, floats printed so they read back exactly, in a fixed
    /// order: part of the content hash (`train.<key>`) and of the model hash.
    pub fn canonical_lines(&self) -> Vec<(&'static str, String)> {
        let fl = titan_ir::attr::fmt_float;
        vec![
            ("lr", fl(self.lr)),
            ("warmup_steps", self.warmup_steps.to_string()),
            ("decay_steps", self.decay_steps.to_string()),
            ("decay", decay_name(self.decay).to_string()),
            ("min_lr_ratio", fl(self.min_lr_ratio)),
            ("beta1", fl(self.beta1)),
            ("beta2", fl(self.beta2)),
            ("eps", fl(self.eps)),
            ("weight_decay", fl(self.weight_decay)),
            ("max_norm", self.max_norm.map_or_else(|| "none".to_string(), fl)),
        ]
    }

    /// The options as the training graph's `meta` records them (`train_lr = 0.003`, ...; keys
    /// `titan_ir::identity::TRAIN_META`).
    pub fn meta_entries(&self) -> Vec<(String, AttrValue)> {
        let int = |n: u64| AttrValue::Int(i64::try_from(n).unwrap_or(i64::MAX));
        let values = [
            AttrValue::Float(self.lr),
            int(self.warmup_steps),
            int(self.decay_steps),
            AttrValue::Str(decay_name(self.decay).into()),
            AttrValue::Float(self.min_lr_ratio),
            AttrValue::Float(self.beta1),
            AttrValue::Float(self.beta2),
            AttrValue::Float(self.eps),
            AttrValue::Float(self.weight_decay),
            self.max_norm.map_or_else(|| AttrValue::Str("none".into()), AttrValue::Float),
        ];
        titan_ir::identity::TRAIN_META.iter().map(|k| k.to_string()).zip(values).collect()
    }

    /// Reject settings that would make the step meaningless.
    pub fn validate(&self) -> Result<(), PassError> {
        let bad = |message: String| Err(PassError::new("lower-to-train", crate::PassErrorKind::Invalid, message));
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!("lr must be a positive number, found {}", self.lr));
        }
        for (k, v) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return bad(format!("{k} must be in [0, 1), found {v}"));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad(format!("eps must be positive, found {}", self.eps));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!("weight_decay must be >= 0, found {}", self.weight_decay));
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return bad(format!("min_lr_ratio must be in [0, 1], found {}", self.min_lr_ratio));
        }
        if let Some(m) = self.max_norm
            && !(m.is_finite() && m > 0.0)
        {
            return bad(format!("max_norm must be positive (omit it to disable clipping), found {m}"));
        }
        Ok(())
    }
}

/// Statistics of the whole lowering.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrainStats {
    pub params: usize,
    pub saved_per_layer: usize,
    pub backward_nodes: usize,
    pub dead_nodes_removed: usize,
    pub duplicates_merged: usize,
}

/// Build the training-step graph of `model`: inputs `tokens`, `targets`, `step`; outputs
/// `loss`, `grad_norm`, `lr`; every parameter an fp32 master with AdamW moments, updated in place.
/// Runs [`TRAIN_PIPELINE`](crate::pipeline::TRAIN_PIPELINE) through the pass manager.
pub fn lower_to_train(model: &Graph, opts: &TrainOptions) -> Result<Graph, PassError> {
    lower_to_train_with_stats(model, opts).map(|(g, _)| g)
}

pub fn lower_to_train_with_stats(model: &Graph, opts: &TrainOptions) -> Result<(Graph, TrainStats), PassError> {
    let passes = crate::pipeline::lookup_passes(&train_pipeline(model)?)?;
    let (g, report) = run_on_copy(model, opts, &passes, &crate::pipeline::PipelineOptions::default())?;
    let count = |pass: &str, counter: &str| report.stats(pass).and_then(|s| s.get(counter)).unwrap_or(0) as usize;
    let stats = TrainStats {
        params: count("master-weights", "params"),
        saved_per_layer: count("autodiff", "saved_per_layer"),
        backward_nodes: count("autodiff", "backward_nodes"),
        dead_nodes_removed: count("dce", "removed"),
        duplicates_merged: count("cse", "merged"),
    };
    Ok((g, stats))
}

/// The training step without `compute-copies`: every compute copy is cast from its master at
/// the top of the step, as titanc lowered it before the copies were carried across steps. The
/// reference the tests compare the carried copies against (losses and states bit for bit).
pub fn lower_to_train_casting_copies(model: &Graph, opts: &TrainOptions) -> Result<Graph, PassError> {
    let names: Vec<&str> = train_pipeline(model)?.into_iter().filter(|&p| p != "compute-copies").collect();
    let passes = crate::pipeline::lookup_passes(&names)?;
    run_on_copy(model, opts, &passes, &crate::pipeline::PipelineOptions::default()).map(|(g, _)| g)
}

/// Validate `opts`, copy `model` as `<name>_train` (meta `step = "train"`) and run `passes` on it.
pub(crate) fn run_on_copy(
    model: &Graph,
    opts: &TrainOptions,
    passes: &[crate::pipeline::PassInfo],
    popts: &crate::pipeline::PipelineOptions,
) -> Result<(Graph, crate::pipeline::PipelineReport), PassError> {
    run_on_copy_as("train", model, opts, passes, popts)
}

/// Validate `opts`, copy `model` as `<name>_eval` (meta `step = "eval"`) and run `passes` on it
/// (with `--float8`, the eval pipelines' `float8` and `float8-forward` quantize its linears as the
/// training step does).
pub(crate) fn run_eval_on_copy(
    model: &Graph,
    opts: &TrainOptions,
    passes: &[crate::pipeline::PassInfo],
    popts: &crate::pipeline::PipelineOptions,
) -> Result<(Graph, crate::pipeline::PipelineReport), PassError> {
    run_on_copy_as("eval", model, opts, passes, popts)
}

/// Validate `opts`, copy `model` as `<name>_<step>` (meta `step = "<step>"`) and run `passes`.
fn run_on_copy_as(
    step: &str,
    model: &Graph,
    opts: &TrainOptions,
    passes: &[crate::pipeline::PassInfo],
    popts: &crate::pipeline::PipelineOptions,
) -> Result<(Graph, crate::pipeline::PipelineReport), PassError> {
    opts.validate()?;
    let mut g = model.clone();
    g.name = format!("{}_{step}", model.name);
    g.meta.entries.push(("step".into(), AttrValue::Str(step.into())));
    crate::model_hash::stamp_model_identity(&mut g, model, opts);
    let report = crate::pipeline::run_pipeline(&mut g, passes, opts, popts)?;
    Ok((g, report))
}

/// The lowering for `model`: [`SPMD_TRAIN_PIPELINE`](crate::pipeline::SPMD_TRAIN_PIPELINE)
/// when its `meta` names a mesh of more than one rank, else
/// [`TRAIN_PIPELINE`](crate::pipeline::TRAIN_PIPELINE).
pub fn train_pipeline(model: &Graph) -> Result<Vec<&'static str>, PassError> {
    let mesh = titan_ir::Mesh::from_graph(model).map_err(|message| PassError::new("lower-to-train", crate::PassErrorKind::Invalid, message))?;
    Ok(match mesh {
        Some(m) if m.world_size() > 1 => crate::pipeline::SPMD_TRAIN_PIPELINE.to_vec(),
        _ => crate::pipeline::TRAIN_PIPELINE.to_vec(),
    })
}

/// The `main` output name the `autodiff` pass gives the gradient of argument `arg`:
/// `d_<argument name>`, every character other than a letter, digit or `_` replaced by `_`
/// (`%layers.wq` -> `d_layers_wq`), or `d_arg<arg>` for an unnamed argument. Only a name for
/// readers of the IR: which output holds which gradient is the graph's gradient map
/// ([`record_gradients`]), not this convention.
pub fn grad_output_name(main: &Region, arg: usize) -> String {
    let name = main.args.get(arg).and_then(|a| main.value(a.value).name.as_deref());
    match name {
        Some(n) => format!("d_{}", n.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect::<String>()),
        None => format!("d_arg{arg}"),
    }
}

/// The IR text's name of a decay shape (`--decay`).
fn decay_name(d: DecayKind) -> &'static str {
    match d {
        DecayKind::Constant => "constant",
        DecayKind::Linear => "linear",
        DecayKind::Cosine => "cosine",
    }
}

/// The `meta` key of the gradient map: the link from `autodiff` to `sync-grads` and `adamw`.
pub const GRADIENTS_META: &str = "gradients";

/// Record in `g`'s meta which `main` output holds the gradient of which `main` argument:
/// `gradients = [grad(2, "d_w"), ...]` (argument number, output name), replacing any earlier map.
pub fn record_gradients(g: &mut Graph, grads: &[(usize, String)]) {
    let list = grads.iter().map(|(arg, out)| AttrValue::Call("grad".into(), vec![AttrValue::Int(*arg as i64), AttrValue::Str(out.clone())])).collect();
    g.meta.entries.retain(|(k, _)| k != GRADIENTS_META);
    g.meta.entries.push((GRADIENTS_META.into(), AttrValue::List(list)));
}

/// The gradient map of `g` as `(argument number, output index)` pairs, in map order; `Ok(None)`
/// when the graph has none (autodiff has not run). A map that names a missing argument or
/// output is an error.
pub fn gradient_map(g: &Graph) -> Result<Option<Vec<(usize, usize)>>, PassDiag> {
    let Some(entry) = g.meta.get(GRADIENTS_META) else { return Ok(None) };
    let bad = |what: String| PassDiag::invalid(format!("meta `{GRADIENTS_META}`: {what}; it must list `grad(<argument number>, \"<output name>\")`"));
    let AttrValue::List(items) = entry else { return Err(bad(format!("found {entry}"))) };
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let (arg, name) = match item {
            AttrValue::Call(w, a) if w == "grad" => match a.as_slice() {
                [AttrValue::Int(i), AttrValue::Str(n)] => (*i, n),
                _ => return Err(bad(format!("found {item}"))),
            },
            _ => return Err(bad(format!("found {item}"))),
        };
        let arg = usize::try_from(arg).ok().filter(|&i| i < g.main.args.len()).ok_or_else(|| bad(format!("argument {arg} does not exist")))?;
        let output =
            g.main.outputs.iter().position(|o| o.name.as_deref() == Some(name.as_str())).ok_or_else(|| bad(format!("output `{name}` does not exist")))?;
        out.push((arg, output));
    }
    Ok(Some(out))
}

/// Remove the gradient map from `g`'s meta (the consumer of the gradients took them).
pub fn take_gradient_map(g: &mut Graph) {
    g.meta.entries.retain(|(k, _)| k != GRADIENTS_META);
}
