//! TorchTitan-style job configurations (`titanc build --job-config job.toml`).
//!
//! The file uses TorchTitan's section and key names so an existing job config mostly carries
//! over. Every key is either applied, checked against the model, recorded as a note for
//! `titan-run`, or rejected: unknown sections and keys are errors naming `section.key`, values
//! of the wrong type name the key and the expected type, and features titan does not build yet
//! (float8, async tensor parallelism, any parallel degree but 1, ...)
//! fail with "... is not supported yet" instead of being ignored.
//!
//! Learning-rate schedule mapping (TorchTitan's `build_lr_schedulers`), with `S =
//! training.steps` and `W = lr_scheduler.warmup_steps`:
//!
//! - without `decay_ratio`: `decay_steps = S - W`;
//! - with `decay_ratio = r`: `decay_steps = round(S * r)`, lowered to `S - W` when `W +
//!   decay_steps > S` (TorchTitan does the same); a schedule with a stable phase (`W +
//!   decay_steps < S`) is not supported yet.
//!
//! Without `training.steps` the schedule keeps titanc's defaults (or the command-line flags).
//! Command-line flags override everything the file sets.

use std::fmt::Write as _;
use std::path::Path;

use titan_ir::{ArgKind, DType, DecayKind, Graph};
use titan_passes::TrainOptions;

/// Sections and their keys, in the order the documentation lists them.
pub const SECTIONS: [(&str, &[&str]); 12] = [
    ("job", &["description", "dump_folder"]),
    ("model", &["name", "flavor", "converters"]),
    ("optimizer", &["name", "lr", "eps", "beta1", "beta2", "weight_decay"]),
    ("lr_scheduler", &["warmup_steps", "decay_ratio", "decay_type", "min_lr_factor"]),
    ("training", &["local_batch_size", "seq_len", "max_norm", "steps", "mixed_precision_param", "dataset", "seed"]),
    ("compile", &["enable", "components"]),
    ("float8", &["recipe_name", "enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp", "filter_fqns"]),
    ("quantize", &["linear"]),
    ("activation_checkpoint", &["mode", "selective_ac_option", "memory_budget"]),
    ("experimental", &["enable_async_tensor_parallel"]),
    ("validation", &["enable", "freq", "steps", "dataset", "dataset_path"]),
    (
        "parallelism",
        &[
            "data_parallel_replicate_degree",
            "data_parallel_shard_degree",
            "tensor_parallel_degree",
            "context_parallel_degree",
            "pipeline_parallel_degree",
            "expert_parallel_degree",
            "disable_loss_parallel",
            "disable_prefetch_next_layer",
        ],
    ),
];

/// Why a job config cannot be used; every message names the file and the key to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum JobConfigError {
    #[error("cannot read `{file}`: {message}")]
    Io { file: String, message: String },
    /// Not valid TOML.
    #[error("{file}: invalid TOML: {message}")]
    Syntax { file: String, message: String },
    #[error("{file}: unknown section `[{section}]`; known sections: {known}")]
    UnknownSection { file: String, section: String, known: String },
    #[error("{file}: unknown key `{key}`; `[{section}]` takes: {known}")]
    UnknownKey { file: String, key: String, section: String, known: String },
    #[error("{file}: `{key}` must be {expected}, found {found}")]
    Type { file: String, key: String, expected: &'static str, found: String },
    /// A feature titan does not build yet.
    #[error("{file}: {what} is not supported yet; {fix}")]
    Unsupported { file: String, what: String, fix: String },
    /// A value out of range, or inconsistent with the model or another key.
    #[error("{file}: {message}")]
    Invalid { file: String, message: String },
}

/// `[optimizer]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OptimizerSection {
    pub name: Option<String>,
    pub lr: Option<f64>,
    pub eps: Option<f64>,
    pub beta1: Option<f64>,
    pub beta2: Option<f64>,
    pub weight_decay: Option<f64>,
}

/// `[lr_scheduler]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LrSchedulerSection {
    pub warmup_steps: Option<u64>,
    pub decay_ratio: Option<f64>,
    pub decay_type: Option<DecayKind>,
    pub min_lr_factor: Option<f64>,
}

/// `[training]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainingSection {
    pub local_batch_size: Option<u64>,
    pub seq_len: Option<u64>,
    /// `0` disables clipping.
    pub max_norm: Option<f64>,
    pub steps: Option<u64>,
    pub mixed_precision_param: Option<DType>,
    pub dataset: Option<String>,
    pub seed: Option<u64>,
}

/// A parsed and checked job config. Feature sections that can only hold their defaults today
/// (`float8`, `activation_checkpoint`, `experimental`, `parallelism`, `compile`) are validated
/// while parsing and not kept.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobConfig {
    /// The file name used in messages.
    pub file: String,
    pub description: Option<String>,
    pub dump_folder: Option<String>,
    pub model_name: Option<String>,
    pub model_flavor: Option<String>,
    pub optimizer: OptimizerSection,
    pub lr_scheduler: LrSchedulerSection,
    pub training: TrainingSection,
    /// `[parallelism]` degrees, unresolved (see `crate::parallel`).
    pub parallelism: crate::parallel::ParallelRequest,
    /// Float8 training: `model.converters` names `float8` (or `quantize.linear.float8`), with
    /// the recipe and filter of `[float8]` (or `[quantize.linear.float8]`).
    pub float8: Option<titan_passes::float8::Float8Options>,
    /// `[activation_checkpoint]`: `None` when the file does not set `mode`.
    pub activation_checkpoint: Option<titan_passes::activation_checkpoint::AcPolicy>,
}

/// The training settings a job config sets, named like `titanc lower`'s flags; `None` where
/// the file is silent. Values are already checked.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobTrainSettings {
    pub lr: Option<f64>,
    pub warmup_steps: Option<u64>,
    pub decay_steps: Option<u64>,
    pub decay: Option<DecayKind>,
    pub min_lr_ratio: Option<f64>,
    pub beta1: Option<f64>,
    pub beta2: Option<f64>,
    pub eps: Option<f64>,
    pub weight_decay: Option<f64>,
    /// `Some(0.0)` disables clipping.
    pub max_norm: Option<f64>,
    pub float8: Option<titan_passes::float8::Float8Options>,
}

fn describe(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => format!("the string \"{s}\""),
        toml::Value::Integer(i) => format!("the integer {i}"),
        toml::Value::Float(x) => format!("the float {x}"),
        toml::Value::Boolean(b) => format!("the bool {b}"),
        toml::Value::Datetime(d) => format!("the date {d}"),
        toml::Value::Array(_) => "an array".into(),
        toml::Value::Table(_) => "a table".into(),
    }
}

/// One section of the file with typed accessors that name `section.key` in errors.
struct Section<'a> {
    file: &'a str,
    name: &'static str,
    table: Option<&'a toml::Table>,
}

impl<'a> Section<'a> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.name)
    }

    fn get(&self, k: &str) -> Option<&'a toml::Value> {
        self.table.and_then(|t| t.get(k))
    }

    fn type_error(&self, k: &str, expected: &'static str, v: &toml::Value) -> JobConfigError {
        JobConfigError::Type { file: self.file.into(), key: self.key(k), expected, found: describe(v) }
    }

    fn invalid(&self, message: String) -> JobConfigError {
        JobConfigError::Invalid { file: self.file.into(), message }
    }

    fn unsupported(&self, what: String, fix: &str) -> JobConfigError {
        JobConfigError::Unsupported { file: self.file.into(), what, fix: fix.into() }
    }

    fn string(&self, k: &str) -> Result<Option<String>, JobConfigError> {
        match self.get(k) {
            None => Ok(None),
            Some(toml::Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(self.type_error(k, "a string", v)),
        }
    }

    /// A float; integers are accepted (`weight_decay = 0`).
    fn float(&self, k: &str) -> Result<Option<f64>, JobConfigError> {
        match self.get(k) {
            None => Ok(None),
            Some(toml::Value::Float(x)) => Ok(Some(*x)),
            Some(toml::Value::Integer(i)) => Ok(Some(*i as f64)),
            Some(v) => Err(self.type_error(k, "a number", v)),
        }
    }

    fn int(&self, k: &str) -> Result<Option<i64>, JobConfigError> {
        match self.get(k) {
            None => Ok(None),
            Some(toml::Value::Integer(i)) => Ok(Some(*i)),
            Some(v) => Err(self.type_error(k, "an integer", v)),
        }
    }

    /// An integer of at least `min`.
    fn count(&self, k: &str, min: u64) -> Result<Option<u64>, JobConfigError> {
        match self.int(k)? {
            None => Ok(None),
            Some(i) => match u64::try_from(i) {
                Ok(u) if u >= min => Ok(Some(u)),
                _ => Err(self.invalid(format!("`{}` must be at least {min}, found {i}", self.key(k)))),
            },
        }
    }

    fn bool(&self, k: &str) -> Result<Option<bool>, JobConfigError> {
        match self.get(k) {
            None => Ok(None),
            Some(toml::Value::Boolean(b)) => Ok(Some(*b)),
            Some(v) => Err(self.type_error(k, "a bool (true or false)", v)),
        }
    }

    /// An array of strings; a single string (older TorchTitan configs, e.g. `filter_fqns =
    /// "output"`) is a one-element array.
    fn strings(&self, k: &str) -> Result<Option<Vec<String>>, JobConfigError> {
        match self.get(k) {
            None => Ok(None),
            Some(toml::Value::String(s)) => Ok(Some(vec![s.clone()])),
            Some(toml::Value::Array(items)) => {
                let mut out = Vec::with_capacity(items.len());
                for item in items {
                    match item {
                        toml::Value::String(s) => out.push(s.clone()),
                        other => return Err(self.type_error(k, "a string or an array of strings", other)),
                    }
                }
                Ok(Some(out))
            }
            Some(v) => Err(self.type_error(k, "a string or an array of strings", v)),
        }
    }

    /// A float checked by `ok`, with `range` describing the accepted values.
    fn float_in(&self, k: &str, range: &str, ok: impl Fn(f64) -> bool) -> Result<Option<f64>, JobConfigError> {
        match self.float(k)? {
            Some(x) if !(x.is_finite() && ok(x)) => Err(self.invalid(format!("`{}` must be {range}, found {x}", self.key(k)))),
            other => Ok(other),
        }
    }
}

impl JobConfig {
    /// Read and check a job config file.
    pub fn load(path: &Path) -> Result<JobConfig, JobConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| JobConfigError::Io { file: file.clone(), message: e.to_string() })?;
        JobConfig::parse(&file, &text)
    }

    /// Parse and check the text of a job config; `file` names it in messages.
    pub fn parse(file: &str, text: &str) -> Result<JobConfig, JobConfigError> {
        let root: toml::Table =
            text.parse().map_err(|e: toml::de::Error| JobConfigError::Syntax { file: file.into(), message: e.message().trim_end().to_string() })?;
        let known_sections = SECTIONS.iter().map(|(s, _)| *s).collect::<Vec<_>>().join(", ");
        let mut names: Vec<&String> = root.keys().collect();
        names.sort();
        for name in names {
            let Some((_, keys)) = SECTIONS.iter().find(|(s, _)| s == name) else {
                return Err(match &root[name] {
                    toml::Value::Table(_) => JobConfigError::UnknownSection { file: file.into(), section: name.clone(), known: known_sections },
                    _ => JobConfigError::Invalid {
                        file: file.into(),
                        message: format!("`{name}` is outside any section; put it under its section, e.g. `[training]` for `steps`"),
                    },
                });
            };
            let toml::Value::Table(t) = &root[name] else {
                return Err(JobConfigError::Type { file: file.into(), key: name.clone(), expected: "a section (`[name]`)", found: describe(&root[name]) });
            };
            let mut ks: Vec<&String> = t.keys().collect();
            ks.sort();
            for k in ks {
                if !keys.contains(&k.as_str()) {
                    return Err(JobConfigError::UnknownKey { file: file.into(), key: format!("{name}.{k}"), section: name.clone(), known: keys.join(", ") });
                }
            }
        }
        let section = |name: &'static str| Section {
            file,
            name,
            table: match root.get(name) {
                Some(toml::Value::Table(t)) => Some(t),
                _ => None,
            },
        };
        let mut cfg = JobConfig { file: file.into(), ..JobConfig::default() };

        let job = section("job");
        cfg.description = job.string("description")?;
        cfg.dump_folder = job.string("dump_folder")?;

        let model = section("model");
        cfg.model_name = model.string("name")?;
        cfg.model_flavor = model.string("flavor")?;
        let mut float8_converter = None;
        for c in model.strings("converters")?.unwrap_or_default() {
            match c.as_str() {
                "float8" | "quantize.linear.float8" => float8_converter = Some(c),
                other => {
                    return Err(model.unsupported(
                        format!("the model converter `model.converters = [\"{other}\"]`"),
                        "titan converts linears to \"float8\" (or \"quantize.linear.float8\"); remove the others",
                    ));
                }
            }
        }

        let opt = section("optimizer");
        cfg.optimizer.name = opt.string("name")?;
        match cfg.optimizer.name.as_deref() {
            None | Some("AdamW") => {}
            Some("Adam") => return Err(opt.unsupported("`optimizer.name = \"Adam\"`".into(), "use \"AdamW\"")),
            Some(other) => return Err(opt.invalid(format!("unknown optimizer `optimizer.name = \"{other}\"`; titan trains with \"AdamW\""))),
        }
        cfg.optimizer.lr = opt.float_in("lr", "a positive number such as 8e-4", |x| x > 0.0)?;
        cfg.optimizer.eps = opt.float_in("eps", "a positive number such as 1e-8", |x| x > 0.0)?;
        cfg.optimizer.beta1 = opt.float_in("beta1", "at least 0 and below 1, e.g. 0.9", |x| (0.0..1.0).contains(&x))?;
        cfg.optimizer.beta2 = opt.float_in("beta2", "at least 0 and below 1, e.g. 0.95", |x| (0.0..1.0).contains(&x))?;
        cfg.optimizer.weight_decay = opt.float_in("weight_decay", "0 or more, e.g. 0.1", |x| x >= 0.0)?;

        let sched = section("lr_scheduler");
        cfg.lr_scheduler.warmup_steps = sched.count("warmup_steps", 0)?;
        cfg.lr_scheduler.decay_ratio = sched.float_in("decay_ratio", "between 0 and 1", |x| (0.0..=1.0).contains(&x))?;
        cfg.lr_scheduler.decay_type = match sched.string("decay_type")?.as_deref() {
            None => None,
            Some("linear") => Some(DecayKind::Linear),
            Some("cosine") => Some(DecayKind::Cosine),
            Some("sqrt") => return Err(sched.unsupported("`lr_scheduler.decay_type = \"sqrt\"`".into(), "use \"linear\" or \"cosine\"")),
            Some(other) => return Err(sched.invalid(format!("unknown `lr_scheduler.decay_type = \"{other}\"`; choose \"linear\" or \"cosine\""))),
        };
        cfg.lr_scheduler.min_lr_factor = sched.float_in("min_lr_factor", "between 0 and 1", |x| (0.0..=1.0).contains(&x))?;

        let tr = section("training");
        cfg.training.local_batch_size = tr.count("local_batch_size", 1)?;
        cfg.training.seq_len = tr.count("seq_len", 1)?;
        cfg.training.max_norm = tr.float_in("max_norm", "0 (no clipping) or a positive number such as 1.0", |x| x >= 0.0)?;
        cfg.training.steps = tr.count("steps", 1)?;
        cfg.training.mixed_precision_param = match tr.string("mixed_precision_param")?.as_deref() {
            None => None,
            Some("bfloat16") => Some(DType::BF16),
            Some("float32") => Some(DType::F32),
            Some(other) => return Err(tr.invalid(format!("`training.mixed_precision_param` must be \"bfloat16\" or \"float32\", found \"{other}\""))),
        };
        cfg.training.dataset = tr.string("dataset")?;
        cfg.training.seed = tr.count("seed", 0)?;

        let compile = section("compile");
        if compile.bool("enable")? == Some(false) {
            return Err(
                compile.unsupported("`compile.enable = false` (running without fusion)".into(), "titan always compiles; remove the key or set it to true")
            );
        }
        if let Some(components) = compile.strings("components")? {
            if let Some(bad) = components.iter().find(|c| *c != "model" && *c != "loss") {
                return Err(compile.invalid(format!("unknown `compile.components` entry \"{bad}\"; the components are \"model\" and \"loss\"")));
            }
            for needed in ["model", "loss"] {
                if !components.iter().any(|c| c == needed) {
                    return Err(compile.unsupported(
                        format!("leaving \"{needed}\" out of `compile.components`"),
                        "titan compiles the whole step; set components = [\"model\", \"loss\"]",
                    ));
                }
            }
        }

        // Float8: TorchTitan's `[float8]`, or `[quantize.linear.float8]` of its newer configs.
        let nested = match root.get("quantize") {
            None => None,
            Some(toml::Value::Table(q)) => match q.get("linear") {
                None => None,
                Some(toml::Value::Table(l)) => {
                    if let Some(k) = l.keys().find(|k| k.as_str() != "float8") {
                        return Err(JobConfigError::UnknownKey {
                            file: file.into(),
                            key: format!("quantize.linear.{k}"),
                            section: "quantize.linear".into(),
                            known: "float8".into(),
                        });
                    }
                    match l.get("float8") {
                        None => None,
                        Some(toml::Value::Table(t)) => Some(t),
                        Some(v) => {
                            return Err(JobConfigError::Type {
                                file: file.into(),
                                key: "quantize.linear.float8".into(),
                                expected: "a section",
                                found: describe(v),
                            });
                        }
                    }
                }
                Some(v) => return Err(JobConfigError::Type { file: file.into(), key: "quantize.linear".into(), expected: "a section", found: describe(v) }),
            },
            Some(_) => None,
        };
        let f8_keys = ["recipe_name", "enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp", "filter_fqns"];
        if let Some(t) = nested
            && let Some(k) = t.keys().find(|k| !f8_keys.contains(&k.as_str()))
        {
            return Err(JobConfigError::UnknownKey {
                file: file.into(),
                key: format!("quantize.linear.float8.{k}"),
                section: "quantize.linear.float8".into(),
                known: f8_keys.join(", "),
            });
        }
        let f8 = match nested {
            Some(t) => {
                if root.get("float8").is_some() {
                    return Err(JobConfigError::Invalid {
                        file: file.into(),
                        message: "both `[float8]` and `[quantize.linear.float8]` are set; keep one".into(),
                    });
                }
                Section { file, name: "quantize.linear.float8", table: Some(t) }
            }
            None => section("float8"),
        };
        for k in ["enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp"] {
            if f8.bool(k)? == Some(true) {
                return Err(f8.unsupported(
                    format!("fp8 FSDP weight gathers (`{}.{k} = true`)", f8.name),
                    "set it to false (weights are gathered in bf16 and quantized after the gather)",
                ));
            }
        }
        let recipe = match f8.string("recipe_name")? {
            None => None,
            Some(r) => Some(titan_ir::Float8Recipe::from_name(&r).map_err(|e| f8.invalid(format!("`{}.recipe_name`: {e}", f8.name)))?),
        };
        let filter = f8.strings("filter_fqns")?.unwrap_or_default();
        cfg.float8 = match (float8_converter, recipe) {
            // TorchTitan's default recipe is tensorwise scaling.
            (Some(_), r) => Some(titan_passes::float8::Float8Options { recipe: r.unwrap_or(titan_ir::Float8Recipe::Tensorwise), filter, auto: false }),
            (None, Some(r)) => {
                return Err(model.invalid(format!(
                    "`{}.recipe_name = \"{}\"` without a float8 converter: TorchTitan would train in bf16; add `converters = [\"float8\"]` to `[model]` or remove the recipe",
                    f8.name,
                    r.name()
                )));
            }
            (None, None) => None,
        };

        let ac = section("activation_checkpoint");
        let option = ac.string("selective_ac_option")?;
        let budget = ac.float("memory_budget")?;
        {
            use titan_passes::activation_checkpoint::AcPolicy;
            cfg.activation_checkpoint = match ac.string("mode")?.as_deref() {
                None => None,
                Some("none") => Some(AcPolicy::None),
                Some("full") => Some(AcPolicy::Full),
                Some("selective") => Some(
                    AcPolicy::selective(option.as_deref().unwrap_or("op"))
                        .map_err(|e| ac.invalid(format!("`activation_checkpoint.selective_ac_option`: {e}")))?,
                ),
                Some("memory_budget") => {
                    let b = budget
                        .ok_or_else(|| ac.invalid("`activation_checkpoint.mode = \"memory_budget\"` needs `memory_budget` (a fraction in [0, 1])".into()))?;
                    Some(AcPolicy::budget_fraction(b).map_err(|e| ac.invalid(format!("activation_checkpoint: {e}")))?)
                }
                Some(other) => {
                    return Err(ac.invalid(format!(
                        "unknown `activation_checkpoint.mode = \"{other}\"`; choose \"none\", \"selective\", \"full\" or \"memory_budget\""
                    )));
                }
            };
        }

        let val = section("validation");
        if val.bool("enable")? == Some(true) {
            return Err(val.unsupported("a validation loss (`validation.enable = true`)".into(), "set it to false"));
        }
        // Only read with enable = true, which is rejected above; check their types.
        val.count("freq", 1)?;
        val.int("steps")?;
        val.string("dataset")?;
        val.string("dataset_path")?;

        let exp = section("experimental");
        if exp.bool("enable_async_tensor_parallel")? == Some(true) {
            return Err(exp.unsupported("async tensor parallelism (`experimental.enable_async_tensor_parallel = true`)".into(), "set it to false"));
        }

        // Degrees are resolved and checked (against each other, the world size and the model)
        // by `ParallelDims` when the build knows the model; here only their types.
        let par = section("parallelism");
        cfg.parallelism = crate::parallel::ParallelRequest {
            dp_replicate: par.int("data_parallel_replicate_degree")?,
            dp_shard: par.int("data_parallel_shard_degree")?,
            cp: par.int("context_parallel_degree")?,
            tp: par.int("tensor_parallel_degree")?,
            pp: par.int("pipeline_parallel_degree")?,
            ep: par.int("expert_parallel_degree")?,
            world_size: None,
            disable_loss_parallel: par.bool("disable_loss_parallel")?,
            disable_prefetch_next_layer: par.bool("disable_prefetch_next_layer")?,
        };
        Ok(cfg)
    }

    /// The training settings the file sets, with `decay_steps` derived from `training.steps`
    /// (see the module documentation). `cli_warmup` (`--warmup-steps`) overrides the file's
    /// warmup in that derivation; without either, titanc's default warmup applies.
    pub fn train_settings(&self, cli_warmup: Option<u64>) -> Result<JobTrainSettings, JobConfigError> {
        let invalid = |message: String| JobConfigError::Invalid { file: self.file.clone(), message };
        let decay_steps = match (self.training.steps, self.lr_scheduler.decay_ratio) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(invalid("`lr_scheduler.decay_ratio` needs `training.steps` to compute the decay steps; add `training.steps`".into()));
            }
            (Some(steps), ratio) => {
                let warmup = cli_warmup.or(self.lr_scheduler.warmup_steps).unwrap_or(TrainOptions::default().warmup_steps);
                if warmup > steps {
                    return Err(invalid(format!(
                        "`lr_scheduler.warmup_steps` ({warmup}) exceeds `training.steps` ({steps}); lower the warmup or train longer"
                    )));
                }
                let after_warmup = steps - warmup;
                match ratio {
                    None => Some(after_warmup),
                    Some(r) => {
                        let d = ((steps as f64) * r).round() as u64;
                        let d = d.min(after_warmup);
                        if d < after_warmup {
                            return Err(JobConfigError::Unsupported {
                                file: self.file.clone(),
                                what: format!(
                                    "a constant learning-rate phase between warmup and decay (`lr_scheduler.decay_ratio = {r}` decays over {d} of the {after_warmup} steps after warmup)"
                                ),
                                fix: format!("remove `lr_scheduler.decay_ratio` or set it to at least {}", after_warmup as f64 / steps as f64),
                            });
                        }
                        Some(d)
                    }
                }
            }
        };
        Ok(JobTrainSettings {
            lr: self.optimizer.lr,
            warmup_steps: self.lr_scheduler.warmup_steps,
            decay_steps,
            decay: self.lr_scheduler.decay_type,
            min_lr_ratio: self.lr_scheduler.min_lr_factor,
            beta1: self.optimizer.beta1,
            beta2: self.optimizer.beta2,
            eps: self.optimizer.eps,
            weight_decay: self.optimizer.weight_decay,
            max_norm: self.training.max_norm,
            float8: self.float8.clone(),
        })
    }

    /// Check the keys that describe the model (`training.local_batch_size`, `training.seq_len`,
    /// `training.mixed_precision_param`, `model.name`) against the model graph.
    pub fn check_model(&self, model: &Graph) -> Result<(), JobConfigError> {
        let invalid = |message: String| JobConfigError::Invalid { file: self.file.clone(), message };
        for (key, value, dim, flag) in
            [("local_batch_size", self.training.local_batch_size, "batch", "--batch-size"), ("seq_len", self.training.seq_len, "seq", "--seq-len")]
        {
            let Some(v) = value else { continue };
            match model.dims.get(dim) {
                Some(&d) if d == v => {}
                Some(&d) => {
                    return Err(invalid(format!(
                        "`training.{key} = {v}` does not match the model, which was built with {dim} = {d}; regenerate the model with `titanc new ... {flag} {v}` or set `training.{key} = {d}`"
                    )));
                }
                None => {
                    return Err(invalid(format!("`training.{key}` is set but the model has no `{dim}` dimension; remove the key")));
                }
            }
        }
        if let Some(want) = self.training.mixed_precision_param {
            let param_dtype = model.main.args.iter().find(|a| matches!(a.kind, ArgKind::Param(_))).map(|a| model.main.ty(a.value).dtype);
            if let Some(have) = param_dtype
                && have != want
            {
                let name = if want == DType::BF16 { "bfloat16" } else { "float32" };
                return Err(invalid(format!(
                    "`training.mixed_precision_param = \"{name}\"` does not match the model's {have} parameters; regenerate the model with `titanc new ... --dtype {want}`"
                )));
            }
        }
        if let (Some(name), Some(arch)) = (&self.model_name, model.meta.get("arch").and_then(|a| a.as_str()))
            && name != arch
        {
            return Err(invalid(format!("`model.name = \"{name}\"` does not match the model file, a {arch} model; set `model.name = \"{arch}\"`")));
        }
        Ok(())
    }

    /// Settings the file carries that `titan-run` (not titanc) applies, as notes for the build
    /// summary so they are never silently dropped.
    pub fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        let mut run_flags = String::new();
        if let Some(seed) = self.training.seed {
            let _ = write!(run_flags, " --seed {seed}");
        }
        if let Some(d) = &self.training.dataset {
            let _ = write!(run_flags, " --data {d}");
        }
        if let Some(s) = self.training.steps {
            let _ = write!(run_flags, " --steps {s}");
        }
        if !run_flags.is_empty() {
            notes.push(format!("{}: titan-run takes the step count, seed and data from its own flags; run it with{run_flags}", self.file));
        }
        notes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        match JobConfig::parse("job.toml", text) {
            Ok(c) => panic!("expected an error for:\n{text}\ngot {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn ok(text: &str) -> JobConfig {
        JobConfig::parse("job.toml", text).unwrap_or_else(|e| panic!("{e}"))
    }

    fn assert_contains(haystack: &str, needle: &str) {
        assert!(haystack.contains(needle), "expected `{needle}` in:\n{haystack}");
    }

    #[test]
    fn reads_every_supported_key() {
        let c = ok(r#"
[job]
description = "debug run"
dump_folder = "./outputs"
[model]
name = "llama3"
flavor = "debugmodel"
converters = []
[optimizer]
name = "AdamW"
lr = 3e-3
eps = 1e-8
beta1 = 0.9
beta2 = 0.95
weight_decay = 0
[lr_scheduler]
warmup_steps = 10
decay_ratio = 0.95
decay_type = "cosine"
min_lr_factor = 0.1
[training]
local_batch_size = 8
seq_len = 64
max_norm = 1.0
steps = 200
mixed_precision_param = "bfloat16"
dataset = "examples/data/tiny_corpus.txt"
seed = 42
[compile]
enable = true
components = ["model", "loss"]
[float8]
enable_fsdp_float8_all_gather = false
filter_fqns = ["output"]
[activation_checkpoint]
mode = "none"
selective_ac_option = "op"
[experimental]
enable_async_tensor_parallel = false
[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
context_parallel_degree = 1
pipeline_parallel_degree = 1
expert_parallel_degree = 1
"#);
        assert_eq!(c.optimizer.lr, Some(3e-3));
        assert_eq!(c.optimizer.weight_decay, Some(0.0), "integers are accepted for floats");
        assert_eq!(c.lr_scheduler.decay_type, Some(DecayKind::Cosine));
        assert_eq!(c.training.mixed_precision_param, Some(DType::BF16));
        let s = c.train_settings(None).unwrap();
        assert_eq!(s.decay_steps, Some(190), "round(200 * 0.95) = 190 = 200 - 10");
        assert_eq!(s.min_lr_ratio, Some(0.1));
        assert_eq!(s.warmup_steps, Some(10));
        assert_contains(&c.notes().join("\n"), "--seed 42 --data examples/data/tiny_corpus.txt --steps 200");
    }

    #[test]
    fn decay_steps_follow_torchtitan() {
        let steps = |text: &str| ok(text).train_settings(None).unwrap().decay_steps;
        assert_eq!(steps(""), None, "no training.steps keeps the defaults");
        assert_eq!(steps("[training]\nsteps = 1000\n[lr_scheduler]\nwarmup_steps = 100\n"), Some(900));
        assert_eq!(steps("[training]\nsteps = 1000\n"), Some(800), "the default warmup applies");
        assert_eq!(steps("[training]\nsteps = 1000\n[lr_scheduler]\nwarmup_steps = 100\ndecay_ratio = 1.0\n"), Some(900), "capped at steps - warmup");
        let e = ok("[training]\nsteps = 1000\n[lr_scheduler]\nwarmup_steps = 100\ndecay_ratio = 0.5\n").train_settings(None).unwrap_err().to_string();
        assert_contains(&e, "constant learning-rate phase between warmup and decay");
        assert_contains(&e, "is not supported yet; remove `lr_scheduler.decay_ratio` or set it to at least 0.9");
        let e = ok("[lr_scheduler]\ndecay_ratio = 0.5\n").train_settings(None).unwrap_err().to_string();
        assert_contains(&e, "`lr_scheduler.decay_ratio` needs `training.steps`");
        let e = ok("[training]\nsteps = 10\n").train_settings(None).unwrap_err().to_string();
        assert_contains(&e, "`lr_scheduler.warmup_steps` (200) exceeds `training.steps` (10)");
    }

    #[test]
    fn syntax_errors_name_the_file() {
        assert_contains(&err("[training\nsteps = 1"), "job.toml: invalid TOML:");
    }

    #[test]
    fn unknown_sections_and_keys_are_named() {
        let e = err("[metrics]\nlog_freq = 10\n");
        assert_contains(&e, "job.toml: unknown section `[metrics]`; known sections: job, model, optimizer");
        let e = err("[training]\nglobal_batch_size = 8\n");
        assert_contains(&e, "unknown key `training.global_batch_size`; `[training]` takes: local_batch_size, seq_len");
        let e = err("steps = 8\n");
        assert_contains(&e, "`steps` is outside any section");
        let e = err("training = 3\n");
        assert_contains(&e, "`training` must be a section");
    }

    #[test]
    fn wrong_types_name_the_key_and_the_expected_type() {
        assert_contains(&err("[optimizer]\nlr = \"fast\"\n"), "`optimizer.lr` must be a number, found the string \"fast\"");
        assert_contains(&err("[training]\nsteps = 1.5\n"), "`training.steps` must be an integer, found the float 1.5");
        assert_contains(&err("[compile]\nenable = 1\n"), "`compile.enable` must be a bool (true or false), found the integer 1");
        assert_contains(&err("[compile]\ncomponents = 3\n"), "`compile.components` must be a string or an array of strings, found the integer 3");
        assert_contains(&err("[float8]\nfilter_fqns = [1]\n"), "`float8.filter_fqns` must be a string or an array of strings, found the integer 1");
        assert_contains(&err("[job]\ndescription = true\n"), "`job.description` must be a string, found the bool true");
    }

    #[test]
    fn bad_values_say_what_is_accepted() {
        assert_contains(&err("[optimizer]\nlr = -1.0\n"), "`optimizer.lr` must be a positive number such as 8e-4, found -1");
        assert_contains(&err("[optimizer]\nbeta2 = 1.0\n"), "`optimizer.beta2` must be at least 0 and below 1");
        assert_contains(&err("[optimizer]\nname = \"SGD\"\n"), "unknown optimizer `optimizer.name = \"SGD\"`");
        assert_contains(&err("[training]\nsteps = 0\n"), "`training.steps` must be at least 1, found 0");
        assert_contains(&err("[training]\nmixed_precision_param = \"float16\"\n"), "must be \"bfloat16\" or \"float32\"");
        assert_contains(&err("[lr_scheduler]\ndecay_type = \"step\"\n"), "choose \"linear\" or \"cosine\"");
        assert_contains(&err("[activation_checkpoint]\nmode = \"some\"\n"), "choose \"none\", \"selective\", \"full\" or \"memory_budget\"");
        assert_contains(&err("[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"every\"\n"), "neither `op` nor a positive number");
        assert_contains(&err("[activation_checkpoint]\nmode = \"memory_budget\"\n"), "needs `memory_budget`");
        {
            use titan_passes::activation_checkpoint::{AcPolicy, Budget};
            let ac = |text: &str| ok(&format!("[activation_checkpoint]\n{text}")).activation_checkpoint;
            assert_eq!(ac("mode = \"selective\"\nselective_ac_option = \"op\"\n"), Some(AcPolicy::SelectiveOp));
            assert_eq!(ac("mode = \"selective\"\nselective_ac_option = \"2\"\n"), Some(AcPolicy::SelectiveEvery(2)));
            assert_eq!(ac("mode = \"full\"\n"), Some(AcPolicy::Full));
            assert_eq!(ac("mode = \"memory_budget\"\nmemory_budget = 0.5\n"), Some(AcPolicy::Budget(Budget::Fraction(0.5))));
            assert_eq!(ac("selective_ac_option = \"op\"\n"), None);
        }
        assert_contains(&err("[activation_checkpoint]\nmode = \"memory_budget\"\nmemory_budget = 1.5\n"), "must be a fraction in [0, 1]");
        assert_contains(&err("[compile]\ncomponents = [\"model\", \"optimizer\"]\n"), "unknown `compile.components` entry \"optimizer\"");
        assert_contains(&err("[parallelism]\ntensor_parallel_degree = 2.5\n"), "`parallelism.tensor_parallel_degree` must be an integer");
    }

    #[test]
    fn unbuilt_features_are_rejected_not_ignored() {
        let cases = [
            ("[float8]\nenable_fsdp_float8_all_gather = true\n", "`float8.enable_fsdp_float8_all_gather = true`) is not supported yet; set it to false"),
            ("[model]\nconverters = [\"mx\"]\n", "the model converter `model.converters = [\"mx\"]` is not supported yet"),
            ("[experimental]\nenable_async_tensor_parallel = true\n", "async tensor parallelism"),
            ("[validation]\nenable = true\nfreq = 10\n", "a validation loss (`validation.enable = true`) is not supported yet; set it to false"),
            ("[compile]\nenable = false\n", "`compile.enable = false` (running without fusion) is not supported yet"),
            ("[compile]\ncomponents = [\"model\"]\n", "leaving \"loss\" out of `compile.components` is not supported yet"),
            ("[optimizer]\nname = \"Adam\"\n", "`optimizer.name = \"Adam\"` is not supported yet; use \"AdamW\""),
            ("[lr_scheduler]\ndecay_type = \"sqrt\"\n", "is not supported yet"),
        ];
        for (text, expected) in cases {
            assert_contains(&err(text), expected);
        }
    }

    #[test]
    fn float8_follows_torchtitans_converters_and_sections() {
        use titan_ir::Float8Recipe;
        // No converter: TorchTitan's shipped configs carry `[float8]` settings and train in bf16.
        assert_eq!(ok("[float8]\nenable_fsdp_float8_all_gather = false\nfilter_fqns = [\"output\"]\n").float8, None);
        // The converter alone: TorchTitan's default recipe (tensorwise), empty filter.
        let j = ok("[model]\nconverters = [\"float8\"]\n");
        assert_eq!(j.float8, Some(titan_passes::float8::Float8Options::new(Float8Recipe::Tensorwise)));
        let j = ok("[model]\nconverters = [\"float8\"]\n[float8]\nrecipe_name = \"rowwise\"\nfilter_fqns = [\"output\"]\n");
        let f8 = j.float8.expect("float8 on");
        assert_eq!((f8.recipe, f8.filter), (Float8Recipe::Rowwise, vec!["output".to_string()]));
        // The newer spelling.
        let j = ok("[model]\nconverters = [\"quantize.linear.float8\"]\n[quantize.linear.float8]\nrecipe_name = \"rowwise_with_gw_hp\"\n");
        assert_eq!(j.float8.as_ref().map(|f| f.recipe), Some(Float8Recipe::RowwiseWithGwHp));
        assert_eq!(j.train_settings(None).unwrap().float8.map(|f| f.recipe), Some(Float8Recipe::RowwiseWithGwHp));
        // A recipe without the converter would silently train in bf16: refused.
        assert_contains(&err("[float8]\nrecipe_name = \"rowwise\"\n"), "without a float8 converter");
        assert_contains(&err("[model]\nconverters = [\"float8\"]\n[float8]\nrecipe_name = \"rows\"\n"), "unknown float8 recipe `rows`");
        assert_contains(&err("[quantize.linear.float8]\nrecipe = \"rowwise\"\n"), "quantize.linear.float8.recipe");
        assert_contains(&err("[quantize.linear.mx]\nx = 1\n"), "quantize.linear.mx");
        assert_contains(&err("[model]\nconverters = [\"float8\"]\n[float8]\n[quantize.linear.float8]\n"), "keep one");
    }

    #[test]
    fn parallelism_degrees_are_read_for_parallel_dims() {
        let j = ok("[parallelism]\ndata_parallel_replicate_degree = 2\ndata_parallel_shard_degree = -1\ntensor_parallel_degree = 4\n");
        let want = crate::parallel::ParallelRequest { dp_replicate: Some(2), dp_shard: Some(-1), tp: Some(4), ..Default::default() };
        assert_eq!(j.parallelism, want);
    }

    #[test]
    fn model_keys_must_match_the_model() {
        let cfg = crate::LlamaConfig::preset(crate::Preset::Debug);
        let g = crate::build_llama3(&cfg, "debug").unwrap();
        ok("[training]\nlocal_batch_size = 8\nseq_len = 64\nmixed_precision_param = \"bfloat16\"\n[model]\nname = \"llama3\"\n").check_model(&g).unwrap();
        let e = ok("[training]\nseq_len = 128\n").check_model(&g).unwrap_err().to_string();
        assert_contains(
            &e,
            "`training.seq_len = 128` does not match the model, which was built with seq = 64; regenerate the model with `titanc new ... --seq-len 128`",
        );
        let e = ok("[training]\nlocal_batch_size = 2\n").check_model(&g).unwrap_err().to_string();
        assert_contains(&e, "--batch-size 2");
        let e = ok("[training]\nmixed_precision_param = \"float32\"\n").check_model(&g).unwrap_err().to_string();
        assert_contains(&e, "does not match the model's bf16 parameters; regenerate the model with `titanc new ... --dtype f32`");
        let e = ok("[model]\nname = \"llama4\"\n").check_model(&g).unwrap_err().to_string();
        assert_contains(&e, "set `model.name = \"llama3\"`");
    }

    #[test]
    fn example_job_configs_parse() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/job");
        for name in ["debug.toml", "llama3_8b.toml"] {
            let c = JobConfig::load(&root.join(name)).unwrap_or_else(|e| panic!("{e}"));
            c.train_settings(None).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}
