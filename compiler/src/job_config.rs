//! TorchTitan-style job configurations (`titanc build --job-config job.toml`): the build
//! sections, read on top of `titan_ir::job_config` (the key table, the collecting reader and
//! the runtime sections `titan-run --job-config` honors, which titanc checks too).
//!
//! The file uses TorchTitan's section and key names (its last TOML release, v0.2.2, and
//! v0.1.0), so its llama3 configs build as shipped: every key is applied, checked against the
//! model, read by `titan-run`, accepted with one "not honored" line saying why, or refused
//! ("... is not supported yet" for features titan does not build, such as pipeline parallelism,
//! at any value but the one that turns them off). All problems of a file are reported together.
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

use std::path::Path;

use titan_ir::job_config::{JobFile, NotHonored, RunSettings};
use titan_ir::{ArgKind, DType, DecayKind, Graph};
use titan_passes::TrainOptions;

pub use titan_ir::job_config::JobConfigError;

use crate::llama::{LlamaConfig, Preset};

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
    /// `min_lr_factor`, or `lr_min` in v0.1.0.
    pub min_lr_factor: Option<f64>,
}

/// `[training]`: the keys titanc reads.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainingSection {
    pub local_batch_size: Option<u64>,
    pub seq_len: Option<u64>,
    /// `0` disables clipping.
    pub max_norm: Option<f64>,
    pub steps: Option<u64>,
    pub mixed_precision_param: Option<DType>,
}

/// A parsed and checked job config. Feature sections that can only hold their defaults today
/// are validated while parsing and not kept.
#[derive(Clone, Debug, PartialEq)]
pub struct JobConfig {
    /// The file name used in messages.
    pub file: String,
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
    /// The runtime sections (`titan-run --job-config` applies them; titanc checks them).
    pub run: RunSettings,
    /// Every "not honored" line of the file, of both binaries' keys, in file order.
    pub not_honored: Vec<NotHonored>,
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

/// TorchTitan's llama3 flavors (and titan's preset names) and the preset each one is.
pub const FLAVORS: [(&str, Preset); 4] = [("debugmodel", Preset::Debug), ("8B", Preset::B8), ("70B", Preset::B70), ("405B", Preset::B405)];

/// The preset a `model.flavor` names: TorchTitan's flavor names, or titan's preset names
/// (`debug`, `1b`, `8b`, ..., any case).
pub fn flavor_preset(flavor: &str) -> Option<Preset> {
    FLAVORS.iter().find(|(f, _)| *f == flavor).map(|(_, p)| *p).or_else(|| flavor.parse().ok())
}

/// The dims a flavor fixes, as `titanc new` writes them into the model's `meta`.
const FLAVOR_DIMS: [&str; 5] = ["dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"];

fn flavor_dims(cfg: &LlamaConfig) -> [u64; 5] {
    [cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim]
}

fn show_dims(d: &[u64; 5]) -> String {
    FLAVOR_DIMS.iter().zip(d).map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
}

impl JobConfig {
    /// Read and check a job config file; every problem of the file comes back at once.
    pub fn load(path: &Path) -> Result<JobConfig, JobConfigError> {
        JobConfig::read(JobFile::load(path)?)
    }

    /// Parse and check the text of a job config; `file` names it in messages.
    pub fn parse(file: &str, text: &str) -> Result<JobConfig, JobConfigError> {
        JobConfig::read(JobFile::parse(file, text)?)
    }

    fn read(mut jf: JobFile) -> Result<JobConfig, JobConfigError> {
        let run = RunSettings::read(&mut jf);
        let cfg = JobConfig::read_build(&jf, run);
        // TorchTitan ignores a precomputed fp8 scale without fp8 all-gathers (its
        // `precompute_scale` needs them): say so.
        for section in ["float8", "quantize.linear.float8"] {
            let Some(f8) = cfg.float8.as_ref() else {
                if jf.section(section).bool("enable_fsdp_float8_all_gather") == Some(true) {
                    jf.note(titan_ir::job_config::NotHonored {
                        key: format!("{section}.enable_fsdp_float8_all_gather"),
                        tool: titan_ir::job_config::Tool::Build,
                        why: "no float8 converter in `model.converters`: the model trains in bf16 and gathers bf16 weights, as in TorchTitan".into(),
                    });
                }
                continue;
            };
            // With fp8 all-gathers it is honored: one amax all-reduce per block.
            if f8.fsdp_all_gather || jf.section(section).bool("precompute_float8_dynamic_scale_for_fsdp") != Some(true) {
                continue;
            }
            jf.note(titan_ir::job_config::NotHonored {
                key: format!("{section}.precompute_float8_dynamic_scale_for_fsdp"),
                tool: titan_ir::job_config::Tool::Build,
                why: "it batches the amax all-reduces of fp8 all-gathers, which `enable_fsdp_float8_all_gather = false` leaves off".into(),
            });
        }
        jf.finish()?;
        Ok(JobConfig { not_honored: jf.not_honored(None), ..cfg })
    }

    /// The build sections; problems are recorded on `jf`.
    fn read_build(jf: &JobFile, run: RunSettings) -> JobConfig {
        let file = jf.file.clone();
        let model = jf.section("model");
        let mut float8_converter = None;
        for c in model.strings("converters").unwrap_or_default() {
            match c.as_str() {
                "float8" | "quantize.linear.float8" => float8_converter = Some(c),
                other => model.error(model.unsupported(
                    format!("the model converter `model.converters = [\"{other}\"]`"),
                    "titan converts linears to \"float8\" (or \"quantize.linear.float8\"); remove the others",
                )),
            }
        }
        let flavor = model.string("flavor");
        if let Some(f) = &flavor
            && flavor_preset(f).is_none()
        {
            let known = FLAVORS.iter().map(|(f, _)| format!("\"{f}\"")).collect::<Vec<_>>().join(", ");
            model.error(match f.strip_suffix("_flex_attn") {
                Some(base) => model.unsupported(
                    format!("the flex-attention flavor `model.flavor = \"{f}\"` (document masking)"),
                    &format!("titan's attention is causal over the whole sequence; use \"{base}\""),
                ),
                None => model.invalid(format!("unknown `model.flavor = \"{f}\"`; TorchTitan's llama3 flavors are {known}")),
            });
        }

        let opt = jf.section("optimizer");
        let name = opt.string("name");
        match name.as_deref() {
            None | Some("AdamW") => {}
            Some("Adam") => opt.error(opt.unsupported("`optimizer.name = \"Adam\"`".into(), "use \"AdamW\"")),
            Some(other) => opt.error(opt.invalid(format!("unknown optimizer `optimizer.name = \"{other}\"`; titan trains with \"AdamW\""))),
        }
        let optimizer = OptimizerSection {
            name,
            lr: opt.float_in("lr", "a positive number such as 8e-4", |x| x > 0.0),
            eps: opt.float_in("eps", "a positive number such as 1e-8", |x| x > 0.0),
            beta1: opt.float_in("beta1", "at least 0 and below 1, e.g. 0.9", |x| (0.0..1.0).contains(&x)),
            beta2: opt.float_in("beta2", "at least 0 and below 1, e.g. 0.95", |x| (0.0..1.0).contains(&x)),
            weight_decay: opt.float_in("weight_decay", "0 or more, e.g. 0.1", |x| x >= 0.0),
        };

        let sched = jf.section("lr_scheduler");
        let lr_scheduler = LrSchedulerSection {
            warmup_steps: sched.count("warmup_steps", 0),
            decay_ratio: sched.float_in("decay_ratio", "between 0 and 1", |x| (0.0..=1.0).contains(&x)),
            decay_type: match sched.string("decay_type").as_deref() {
                None => None,
                Some("linear") => Some(DecayKind::Linear),
                Some("cosine") => Some(DecayKind::Cosine),
                Some("sqrt") => {
                    sched.error(sched.unsupported("`lr_scheduler.decay_type = \"sqrt\"`".into(), "use \"linear\" or \"cosine\""));
                    None
                }
                Some(other) => {
                    sched.error(sched.invalid(format!("unknown `lr_scheduler.decay_type = \"{other}\"`; choose \"linear\" or \"cosine\"")));
                    None
                }
            },
            min_lr_factor: sched.alias(["min_lr_factor", "lr_min"]).and_then(|k| sched.float_in(k, "between 0 and 1", |x| (0.0..=1.0).contains(&x))),
        };

        let tr = jf.section("training");
        let training = TrainingSection {
            local_batch_size: tr.count("local_batch_size", 1),
            seq_len: tr.count("seq_len", 1),
            max_norm: tr.float_in("max_norm", "0 (no clipping) or a positive number such as 1.0", |x| x >= 0.0),
            steps: run.steps,
            mixed_precision_param: match tr.string("mixed_precision_param").as_deref() {
                None => None,
                Some("bfloat16") => Some(DType::BF16),
                Some("float32") => Some(DType::F32),
                Some(other) => {
                    tr.error(tr.invalid(format!("`training.mixed_precision_param` must be \"bfloat16\" or \"float32\", found \"{other}\"")));
                    None
                }
            },
        };

        let compile = jf.section("compile");
        if let Some(components) = compile.strings("components") {
            if let Some(bad) = components.iter().find(|c| *c != "model" && *c != "loss") {
                compile.error(compile.invalid(format!("unknown `compile.components` entry \"{bad}\"; the components are \"model\" and \"loss\"")));
            } else if compile.bool("enable") != Some(false) {
                // With `enable = false` TorchTitan compiles nothing, whatever the list says.
                for needed in ["model", "loss"] {
                    if !components.iter().any(|c| c == needed) {
                        compile.error(compile.unsupported(
                            format!("leaving \"{needed}\" out of `compile.components`"),
                            "titan compiles the whole step; set components = [\"model\", \"loss\"]",
                        ));
                    }
                }
            }
        }

        // Float8: TorchTitan's `[float8]` (v0.1.0), or `[quantize.linear.float8]` (v0.2).
        let f8 = if jf.has_section("quantize.linear.float8") {
            if jf.has_section("float8") {
                jf.error(JobConfigError::Invalid { file: file.clone(), message: "both `[float8]` and `[quantize.linear.float8]` are set; keep one".into() });
            }
            jf.section("quantize.linear.float8")
        } else {
            jf.section("float8")
        };
        let fsdp_f8_gather = f8.bool("enable_fsdp_float8_all_gather") == Some(true);
        let precompute_scale = f8.bool("precompute_float8_dynamic_scale_for_fsdp") == Some(true);
        let recipe = f8
            .string("recipe_name")
            .and_then(|r| titan_ir::Float8Recipe::from_name(&r).map_err(|e| f8.error(f8.invalid(format!("`{}.recipe_name`: {e}", f8.name)))).ok());
        let filter = f8.strings("filter_fqns").unwrap_or_default();
        let float8 = match (float8_converter, recipe) {
            // TorchTitan's default recipe is tensorwise scaling.
            (Some(_), r) => {
                let opts =
                    titan_passes::float8::Float8Options { filter, ..titan_passes::float8::Float8Options::new(r.unwrap_or(titan_ir::Float8Recipe::Tensorwise)) };
                // fp8 FSDP all-gathers (tensorwise only, as TorchTitan, which asserts that no
                // `recipe_name` is set with them); the precomputed scale batches their amaxes
                // and, as in TorchTitan, means nothing without them.
                if fsdp_f8_gather {
                    match opts.clone().with_fsdp_all_gather(precompute_scale) {
                        Ok(o) => Some(o),
                        Err(e) => {
                            f8.error(f8.invalid(format!("`{}.enable_fsdp_float8_all_gather = true`: {e}", f8.name)));
                            None
                        }
                    }
                } else {
                    Some(opts)
                }
            }
            (None, Some(r)) => {
                model.error(model.invalid(format!(
                    "`{}.recipe_name = \"{}\"` without a float8 converter: TorchTitan would train in bf16; add `converters = [\"float8\"]` to `[model]` or remove the recipe",
                    f8.name,
                    r.name()
                )));
                None
            }
            (None, None) => None,
        };

        let ac = jf.section("activation_checkpoint");
        let option = ac.string("selective_ac_option");
        let budget = ac.float("memory_budget");
        let activation_checkpoint =
            {
                use titan_passes::activation_checkpoint::AcPolicy;
                match ac.string("mode").as_deref() {
                    None => None,
                    Some("none") => Some(AcPolicy::None),
                    Some("full") => Some(AcPolicy::Full),
                    Some("selective") => match AcPolicy::selective(option.as_deref().unwrap_or("op")) {
                        Ok(p) => Some(p),
                        Err(e) => {
                            ac.error(ac.invalid(format!("`activation_checkpoint.selective_ac_option`: {e}")));
                            None
                        }
                    },
                    Some("memory_budget") => match budget {
                        None => {
                            ac.error(ac.invalid("`activation_checkpoint.mode = \"memory_budget\"` needs `memory_budget` (a fraction in [0, 1])".into()));
                            None
                        }
                        Some(b) => AcPolicy::budget_fraction(b).map_err(|e| ac.error(ac.invalid(format!("activation_checkpoint: {e}")))).ok(),
                    },
                    Some(other) => {
                        ac.error(ac.invalid(format!(
                            "unknown `activation_checkpoint.mode = \"{other}\"`; choose \"none\", \"selective\", \"full\" or \"memory_budget\""
                        )));
                        None
                    }
                }
            };

        // Degrees are resolved and checked (against each other, the world size and the model)
        // by `ParallelDims` when the build knows the model; here only their types.
        let par = jf.section("parallelism");
        let parallelism = crate::parallel::ParallelRequest {
            dp_replicate: par.int("data_parallel_replicate_degree"),
            dp_shard: par.int("data_parallel_shard_degree"),
            cp: par.int("context_parallel_degree"),
            tp: par.int("tensor_parallel_degree"),
            pp: par.int("pipeline_parallel_degree"),
            ep: par.int("expert_parallel_degree"),
            world_size: None,
            disable_loss_parallel: par.bool("disable_loss_parallel"),
            disable_prefetch_next_layer: par.bool("disable_prefetch_next_layer"),
        };
        JobConfig {
            file,
            model_name: model.string("name"),
            model_flavor: flavor,
            optimizer,
            lr_scheduler,
            training,
            parallelism,
            float8,
            activation_checkpoint,
            run,
            not_honored: Vec::new(),
        }
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

    /// Check the keys that describe the model (`model.flavor`, `training.local_batch_size`,
    /// `training.seq_len`, `training.mixed_precision_param`, `model.name`) against the model
    /// graph; every mismatch is reported at once. `dp` is the build's data-parallel degree
    /// (`dp_replicate x dp_shard`): `local_batch_size` is per data-parallel rank, as in
    /// TorchTitan, so the model's (global) batch is `dp` times it.
    pub fn check_model(&self, model: &Graph, dp: u64) -> Result<(), JobConfigError> {
        let mut errors = Vec::new();
        let mut invalid = |message: String| errors.push(JobConfigError::Invalid { file: self.file.clone(), message });
        if let Some((flavor, preset)) = self.model_flavor.as_deref().and_then(|f| Some((f, flavor_preset(f)?))) {
            let meta = |k: &str| model.meta.get(k).and_then(|v| v.as_i64()).and_then(|v| u64::try_from(v).ok());
            let want = flavor_dims(&LlamaConfig::preset(preset));
            let have: Option<Vec<u64>> = FLAVOR_DIMS.iter().map(|k| meta(k)).collect();
            match have {
                None => invalid(format!(
                    "`model.flavor = \"{flavor}\"` cannot be checked: the model's meta does not record {}; remove the key or build the model with `titanc new`",
                    FLAVOR_DIMS.join(", ")
                )),
                Some(have) if have != want => {
                    let have: [u64; 5] = have.try_into().expect("invariant: one value per flavor dim");
                    let matching = FLAVORS.iter().find(|(_, p)| flavor_dims(&LlamaConfig::preset(*p)) == have).map(|(f, _)| *f);
                    let fix = match matching {
                        Some(f) => format!("set `model.flavor = \"{f}\"`, or build the model with `titanc new llama3 --preset {preset}`"),
                        None => format!("build the model with `titanc new llama3 --preset {preset}`, or remove `model.flavor`"),
                    };
                    invalid(format!("`model.flavor = \"{flavor}\"` ({}) does not match the model file ({}); {fix}", show_dims(&want), show_dims(&have)));
                }
                Some(_) => {}
            }
        }
        let dp = dp.max(1);
        for (key, value, dim, flag, per) in
            [("local_batch_size", self.training.local_batch_size, "batch", "--batch-size", dp), ("seq_len", self.training.seq_len, "seq", "--seq-len", 1)]
        {
            let Some(v) = value else { continue };
            let want = v.saturating_mul(per);
            match model.dims.get(dim) {
                Some(&d) if d == want => {}
                Some(&d) if per > 1 => invalid(format!(
                    "`training.{key} = {v}` is per data-parallel rank (as in TorchTitan): with dp_replicate x dp_shard = {per} the model's batch is {want}, but it was built with {dim} = {d}; regenerate the model with `titanc new ... {flag} {want}`{}",
                    if d % per == 0 { format!(" or set `training.{key} = {}`", d / per) } else { String::new() }
                )),
                Some(&d) => invalid(format!(
                    "`training.{key} = {v}` does not match the model, which was built with {dim} = {d}; regenerate the model with `titanc new ... {flag} {v}` or set `training.{key} = {d}`"
                )),
                None => invalid(format!("`training.{key}` is set but the model has no `{dim}` dimension; remove the key")),
            }
        }
        if let Some(want) = self.training.mixed_precision_param {
            let param_dtype = model.main.args.iter().find(|a| matches!(a.kind, ArgKind::Param(_))).map(|a| model.main.ty(a.value).dtype);
            if let Some(have) = param_dtype
                && have != want
            {
                let name = if want == DType::BF16 { "bfloat16" } else { "float32" };
                invalid(format!(
                    "`training.mixed_precision_param = \"{name}\"` does not match the model's {have} parameters; regenerate the model with `titanc new ... --dtype {want}`"
                ));
            }
        }
        if let (Some(name), Some(arch)) = (&self.model_name, model.meta.get("arch").and_then(|a| a.as_str()))
            && name != arch
        {
            invalid(format!("`model.name = \"{name}\"` does not match the model file, a {arch} model; set `model.name = \"{arch}\"`"));
        }
        JobConfigError::collect(&self.file, errors)
    }

    /// The model a preset name stands for when the model file argument is one (`titanc build
    /// 8B --job-config ...`): the preset with the file's `training.seq_len` and a batch of
    /// `training.local_batch_size` per data-parallel rank (`dp` of them). `None` when `name`
    /// is not a flavor or preset name.
    pub fn preset_model(name: &str, job: Option<&JobConfig>, dp: u64) -> Option<LlamaConfig> {
        let preset = flavor_preset(name)?;
        let mut cfg = LlamaConfig::preset(preset);
        if let Some(j) = job {
            cfg.batch_size = j.training.local_batch_size.map_or(cfg.batch_size, |b| b.saturating_mul(dp.max(1)));
            cfg.seq_len = j.training.seq_len.unwrap_or(cfg.seq_len);
        }
        Some(cfg)
    }

    /// The lines for the build summary: every "not honored" key (titanc's and titan-run's),
    /// and that titan-run reads the runtime sections of the same file.
    /// `titanc build --async-tp` as the file asks for it on a mesh of `tp` tensor-parallel
    /// ranks: `auto` when an `enable_async_tensor_parallel` key is true and `tp > 1`; with
    /// `tp = 1` no mode and the "not honored" line instead (TorchTitan warns and goes on).
    pub fn async_tp(&self, tp: u32) -> (Option<titan_passes::async_tp::AsyncTpMode>, Option<String>) {
        match self.run.async_tp.as_ref().filter(|s| s.on) {
            None => (None, None),
            Some(_) if tp > 1 => (Some(titan_passes::async_tp::AsyncTpMode::Auto), None),
            Some(s) => (None, Some(format!("{}: `{} = true` not honored: async tensor parallelism needs tensor_parallel_degree > 1", self.file, s.key))),
        }
    }

    pub fn notes(&self) -> Vec<String> {
        let mut notes: Vec<String> = self.not_honored.iter().map(|n| format!("{}: {n}", self.file)).collect();
        notes.push(format!(
            "{}: titan-run reads the runtime sections ([training] steps, seed and dataset, [checkpoint], [metrics], [profiling], [validation], [comm], job.dump_folder): `titan-run DIR --job-config {}`",
            self.file, self.file
        ));
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
        assert_eq!((c.run.seed, c.run.steps), (Some(42), Some(200)));
        // Relative to the working directory, `compiler/` under `cargo test`: no such file there.
        assert_eq!(c.run.data, None);
        assert_contains(&c.notes().join("\n"), "`training.dataset = \"examples/data/tiny_corpus.txt\"` not honored: titan-run has no dataset registry");
        assert_contains(&c.notes().join("\n"), "titan-run reads the runtime sections");
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
        let e = err("[metric]\nlog_freq = 10\n");
        assert_contains(&e, "job.toml: unknown section `[metric]`; known sections: job, profiling, metrics, model");
        let e = err("[training]\nglobal_batchsize = 8\n");
        assert_contains(&e, "unknown key `training.global_batchsize`; `[training]` takes: dataset, dataset_path, local_batch_size");
        let e = err("steps = 8\n");
        assert_contains(&e, "`steps` is outside any section");
        let e = err("training = 3\n");
        assert_contains(&e, "`training` is outside any section");
    }

    /// One run reports every problem of the file, build and runtime keys alike.
    #[test]
    fn every_problem_comes_back_at_once() {
        let e = err(
            "[optimizer]\nlr = \"fast\"\n[training]\nsteps = 0\nglobal_batch_size = 8\n[checkpoint]\ninterval = 0\n[parallelism]\npipeline_parallel_degree = 2\n[validation]\nsteps = -2\n",
        );
        assert_contains(&e, "job.toml: 5 problems, all listed:");
        for want in [
            "`optimizer.lr` must be a number",
            "`training.steps` must be at least 1, found 0",
            "gradient accumulation (`training.global_batch_size = 8`) is not supported yet; set `training.global_batch_size` to -1",
            "`checkpoint.interval` must be at least 1, found 0",
            "`validation.steps` must be -1 (the whole validation set) or at least 1, found -2",
        ] {
            assert_contains(&e, want);
        }
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
            ("[model]\nconverters = [\"mx\"]\n", "the model converter `model.converters = [\"mx\"]` is not supported yet"),
            ("[model]\nflavor = \"8B_flex_attn\"\n", "the flex-attention flavor `model.flavor = \"8B_flex_attn\"` (document masking) is not supported yet"),
            ("[compile]\ncomponents = [\"model\"]\n", "leaving \"loss\" out of `compile.components` is not supported yet"),
            ("[optimizer]\nname = \"Adam\"\n", "`optimizer.name = \"Adam\"` is not supported yet; use \"AdamW\""),
            ("[lr_scheduler]\ndecay_type = \"sqrt\"\n", "is not supported yet"),
        ];
        for (text, expected) in cases {
            assert_contains(&err(text), expected);
        }
    }

    #[test]
    fn async_tp_keys_are_async_tp_with_tensor_parallelism() {
        use titan_passes::async_tp::AsyncTpMode;
        assert_eq!(ok("[parallelism]\nenable_async_tensor_parallel = false\n").async_tp(2), (None, None));
        for section in ["parallelism", "compile", "experimental"] {
            let j = ok(&format!("[{section}]\nenable_async_tensor_parallel = true\n"));
            assert_eq!(j.async_tp(2), (Some(AsyncTpMode::Auto), None), "{section}");
            let (mode, note) = j.async_tp(1);
            assert_eq!(mode, None);
            assert_eq!(
                note.as_deref(),
                Some(
                    format!("job.toml: `{section}.enable_async_tensor_parallel = true` not honored: async tensor parallelism needs tensor_parallel_degree > 1")
                        .as_str()
                )
            );
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
        // fp8 FSDP all-gathers (tensorwise, TorchTitan's default recipe), with the batched amax.
        let f8 = |text: &str| ok(&format!("[model]\nconverters = [\"float8\"]\n[float8]\n{text}"));
        let j = f8("enable_fsdp_float8_all_gather = true\nprecompute_float8_dynamic_scale_for_fsdp = true\n");
        let o = j.float8.clone().expect("float8 on");
        assert!(o.fsdp_all_gather && o.precompute_scale, "{o:?}");
        assert!(!j.notes().iter().any(|n| n.contains("precompute_float8_dynamic_scale_for_fsdp")), "honored: {:?}", j.notes());
        let j = f8("enable_fsdp_float8_all_gather = true\n");
        assert_eq!(j.float8.as_ref().map(|o| (o.fsdp_all_gather, o.precompute_scale)), Some((true, false)));
        // The precomputed scale without fp8 gathers does nothing, in TorchTitan too: a note.
        let j = f8("precompute_float8_dynamic_scale_for_fsdp = true\n");
        assert_eq!(j.float8.as_ref().map(|o| o.fsdp_all_gather), Some(false));
        assert!(j.notes().iter().any(|n| n.contains("which `enable_fsdp_float8_all_gather = false` leaves off")), "{:?}", j.notes());
        // Without a converter the key gathers nothing (bf16 training): a note.
        let j = ok("[float8]\nenable_fsdp_float8_all_gather = true\n");
        assert!(j.notes().iter().any(|n| n.contains("`float8.enable_fsdp_float8_all_gather` not honored: no float8 converter")), "{:?}", j.notes());
        // TorchTitan asserts no `recipe_name` is set with fp8 gathers; torchao gathers fp8 only with tensorwise scaling.
        assert_contains(
            &err("[model]\nconverters = [\"float8\"]\n[float8]\nrecipe_name = \"rowwise\"\nenable_fsdp_float8_all_gather = true\n"),
            "fp8 FSDP all-gathers need the tensorwise recipe, not `rowwise`",
        );
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
        ok("[training]\nlocal_batch_size = 8\nseq_len = 64\nmixed_precision_param = \"bfloat16\"\n[model]\nname = \"llama3\"\n").check_model(&g, 1).unwrap();
        let e = ok("[training]\nseq_len = 128\n").check_model(&g, 1).unwrap_err().to_string();
        assert_contains(
            &e,
            "`training.seq_len = 128` does not match the model, which was built with seq = 64; regenerate the model with `titanc new ... --seq-len 128`",
        );
        let e = ok("[training]\nlocal_batch_size = 2\n").check_model(&g, 1).unwrap_err().to_string();
        assert_contains(&e, "--batch-size 2");
        let e = ok("[training]\nmixed_precision_param = \"float32\"\n").check_model(&g, 1).unwrap_err().to_string();
        assert_contains(&e, "does not match the model's bf16 parameters; regenerate the model with `titanc new ... --dtype f32`");
        let e = ok("[model]\nname = \"llama4\"\n").check_model(&g, 1).unwrap_err().to_string();
        assert_contains(&e, "set `model.name = \"llama3\"`");
        ok("[model]\nflavor = \"debugmodel\"\n").check_model(&g, 1).unwrap();
        ok("[model]\nflavor = \"debug\"\n").check_model(&g, 1).unwrap();
        let e = ok("[model]\nflavor = \"405B\"\n[training]\nseq_len = 128\n").check_model(&g, 1).unwrap_err().to_string();
        assert_contains(&e, "2 problems");
        assert_contains(
            &e,
            "`model.flavor = \"405B\"` (dim 16384, n_layers 126, n_heads 128, n_kv_heads 8, ffn_dim 53248) does not match the model file (dim 64, n_layers 2, n_heads 4, n_kv_heads 2, ffn_dim 192); set `model.flavor = \"debugmodel\"`, or build the model with `titanc new llama3 --preset 405b`",
        );
        assert_contains(
            &err("[model]\nflavor = \"9B\"\n"),
            "unknown `model.flavor = \"9B\"`; TorchTitan's llama3 flavors are \"debugmodel\", \"8B\", \"70B\", \"405B\"",
        );
        // `local_batch_size` is per data-parallel rank: the debug model's batch 8 is 4 per rank
        // at dp 2.
        ok("[training]\nlocal_batch_size = 4\n").check_model(&g, 2).unwrap();
        let e = ok("[training]\nlocal_batch_size = 8\n").check_model(&g, 2).unwrap_err().to_string();
        assert_contains(
            &e,
            "`training.local_batch_size = 8` is per data-parallel rank (as in TorchTitan): with dp_replicate x dp_shard = 2 the model's batch is 16, but it was built with batch = 8; regenerate the model with `titanc new ... --batch-size 16` or set `training.local_batch_size = 4`",
        );
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
