//! TorchTitan job config files (TOML) as both binaries read them: the table of every key
//! TorchTitan's `JobConfig` knows (its last TOML release, v0.2.2, and v0.1.0) with what titan
//! does with it, the typed reading that collects every problem of a file instead of stopping
//! at the first, and the runtime sections `titan-run --job-config` honors ([`RunSettings`]).
//! `titanc build --job-config` reads the build sections on top of this (`titan-compiler`'s
//! `job_config.rs`) and checks the runtime ones too, so one run reports the whole file.
//!
//! Every key is one of: read by titanc or titan-run ([`Disposition::Read`]); accepted with one
//! "not honored" line saying why ([`Disposition::Note`], [`Disposition::NoteUnless`],
//! [`Disposition::Gated`]); accepted only at the value that means the feature is off, any
//! other value being "not supported yet" ([`Disposition::Only`]); or inert, read by TorchTitan
//! only when a key that titan refuses is set ([`Disposition::Inert`]).

use std::cell::RefCell;
use std::path::{Path, PathBuf};

/// Which binary acts on a key (and prints its "not honored" line: titanc prints every line,
/// titan-run those of its own keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tool {
    Build,
    Run,
}

/// The value at which a feature titan lacks is off.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Accept {
    Bool(bool),
    Int(i64),
    /// One of these strings.
    Str(&'static [&'static str]),
    /// An empty array.
    EmptyList,
    /// No value at all: TorchTitan's default is `None`, which TOML cannot write.
    Absent,
}

impl Accept {
    fn accepts(self, v: &toml::Value) -> bool {
        match (self, v) {
            (Accept::Bool(b), toml::Value::Boolean(x)) => b == *x,
            (Accept::Int(i), toml::Value::Integer(x)) => i == *x,
            (Accept::Str(ss), toml::Value::String(s)) => ss.contains(&s.as_str()),
            (Accept::EmptyList, toml::Value::Array(a)) => a.is_empty(),
            _ => false,
        }
    }

    fn describe(self) -> String {
        match self {
            Accept::Bool(b) => b.to_string(),
            Accept::Int(i) => i.to_string(),
            Accept::Str(ss) => ss.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(" or "),
            Accept::EmptyList => "[]".into(),
            Accept::Absent => "left out".into(),
        }
    }
}

/// What titan does with one key.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Disposition {
    /// Read (and its value checked) by this binary.
    Read(Tool),
    /// Accepted whatever its value, with a "not honored" line giving the reason.
    Note(Tool, &'static str),
    /// Honored at this value; any other value gets a "not honored" line with the reason.
    NoteUnless(Tool, Accept, &'static str),
    /// A "not honored" line only when the bool key `gate` of the same section is true.
    Gated(Tool, &'static str, &'static str),
    /// Only this value is accepted; another one is "<what> is not supported yet".
    Only(Accept, &'static str),
    /// TorchTitan reads it only when another key is set that titan refuses (named here);
    /// accepted silently.
    Inert(&'static str),
}

use Disposition::{Gated, Inert, Note, NoteUnless, Only, Read};
use Tool::{Build, Run};

const NO_COLOR: &str = "titan-run prints no colors";
const TRACES: &str = "titan-run --profile prints a per-kernel time table at the end instead of writing trace files";
const TOKENIZER: &str =
    "titan's vocabulary comes from the model file (`titanc new --vocab-size`/`--from-hf`) and its tokenizer from `titan-run --tokenizer tokenizer.json`";
const COMPILED: &str = "titan always compiles the whole step ahead of time (fusion does not change the results)";
const LOADER: &str = "titan-run reads and packs data in its own process";
const PP: &str = "pipeline_parallel_degree > 1 (not supported yet)";
const CP: &str = "context_parallel_degree > 1 (not supported yet)";
const EP: &str = "expert_parallel_degree > 1 (not supported yet; Llama 3 has no experts)";
const FT: &str = "fault_tolerance.enable = true (not supported yet)";
const VAL_SHAPE: &str = "titan's eval step runs on the training step's batch and seq_len (the artifact's shape), not on a validation shape of its own";
const MX: &str = "the \"mx\" converter (not supported yet)";
const MOE: &str = "MoE grouped GEMMs (Llama 3 has none)";
const INITIAL_LOAD: &str = "checkpoint.initial_load_path (not supported yet)";
const FLOAT8_KEYS: &[(&str, Disposition)] = &[
    ("recipe_name", Read(Build)),
    ("enable_fsdp_float8_all_gather", Read(Build)),
    ("precompute_float8_dynamic_scale_for_fsdp", Read(Build)),
    ("filter_fqns", Read(Build)),
    ("force_recompute_fp8_weight_in_bwd", Only(Accept::Bool(false), "recomputing the fp8 weights in the backward")),
    ("emulate", Note(Build, "titan emulates fp8 on the CPU backend and runs it natively on sm_90 GPUs, whatever this says")),
];
const MX_KEYS: &[(&str, Disposition)] =
    &[("use_fp8_dim1_cast_triton_kernel", Inert(MX)), ("mxfp8_dim1_cast_kernel_choice", Inert(MX)), ("recipe_name", Inert(MX)), ("filter_fqns", Inert(MX))];
const DATALOADER_KEYS: &[(&str, Disposition)] =
    &[("num_workers", Note(Run, LOADER)), ("persistent_workers", Note(Run, LOADER)), ("pin_memory", Note(Run, LOADER)), ("prefetch_factor", Note(Run, LOADER))];

/// Every section of TorchTitan's `JobConfig` (v0.1.0 and v0.2.2; nested sections are dotted)
/// and titan's own additions, with every key and its [`Disposition`].
pub const KEYS: &[(&str, &[(&str, Disposition)])] = &[
    (
        "job",
        &[
            ("config_file", Note(Build, "the file is the one `--job-config` names")),
            ("dump_folder", Read(Run)),
            ("description", Read(Run)),
            ("print_config", NoteUnless(Build, Accept::Bool(false), "titanc build prints the settings it applies in its summary")),
            ("print_args", NoteUnless(Build, Accept::Bool(false), "titanc build prints the settings it applies in its summary")),
            ("save_config_file", Note(Build, "titanc does not write the merged config back")),
            ("custom_config_module", Only(Accept::Str(&[""]), "a custom Python config module")),
            ("use_for_integration_test", Note(Build, "a marker for TorchTitan's own CI")),
        ],
    ),
    (
        "profiling",
        &[
            ("enable_profiling", Read(Run)),
            ("save_traces_folder", Gated(Run, "enable_profiling", TRACES)),
            ("profile_freq", Gated(Run, "enable_profiling", "titan-run --profile times every step but the first and reports once at the end")),
            ("profiler_active", Gated(Run, "enable_profiling", "titan-run --profile times every step but the first")),
            ("profiler_warmup", Gated(Run, "enable_profiling", "titan-run --profile times every step but the first")),
            (
                "enable_memory_snapshot",
                NoteUnless(
                    Run,
                    Accept::Bool(false),
                    "titan's memory is planned before launch: `titanc build --memory-svg FILE` draws it and titan-run prints the measured peak",
                ),
            ),
            ("save_memory_snapshot_folder", Gated(Run, "enable_memory_snapshot", "no memory snapshots are written (see `enable_memory_snapshot`)")),
        ],
    ),
    (
        "metrics",
        &[
            ("log_freq", Read(Run)),
            (
                "enable_tensorboard",
                NoteUnless(Run, Accept::Bool(false), "titan-run writes its metrics as JSON lines (<dump_folder>/metrics.jsonl), not TensorBoard events"),
            ),
            ("disable_color_printing", NoteUnless(Run, Accept::Bool(true), NO_COLOR)),
            ("save_tb_folder", Gated(Run, "enable_tensorboard", "no TensorBoard events are written (see `enable_tensorboard`)")),
            ("save_for_all_ranks", NoteUnless(Run, Accept::Bool(false), "rank 0 alone logs and writes metrics")),
            (
                "enable_wandb",
                NoteUnless(Run, Accept::Bool(false), "titan-run does not report to Weights & Biases; its metrics are in <dump_folder>/metrics.jsonl"),
            ),
        ],
    ),
    (
        "model",
        &[
            ("name", Read(Build)),
            ("flavor", Read(Build)),
            ("hf_assets_path", Note(Build, TOKENIZER)),
            ("tokenizer_path", Note(Build, TOKENIZER)),
            ("converters", Read(Build)),
            ("print_after_conversion", NoteUnless(Build, Accept::Bool(false), "titanc build lists every linear's float8 decision in its summary")),
        ],
    ),
    (
        "optimizer",
        &[
            ("name", Read(Build)),
            ("lr", Read(Build)),
            ("beta1", Read(Build)),
            ("beta2", Read(Build)),
            ("eps", Read(Build)),
            ("weight_decay", Read(Build)),
            ("implementation", Note(Build, "titan fuses AdamW into its own multi-tensor kernels")),
            ("early_step_in_backward", Only(Accept::Bool(false), "the optimizer step inside the backward")),
        ],
    ),
    (
        "lr_scheduler",
        &[
            ("warmup_steps", Read(Build)),
            ("total_steps", Only(Accept::Absent, "a schedule length other than `training.steps`")),
            ("decay_ratio", Read(Build)),
            ("decay_type", Read(Build)),
            ("min_lr_factor", Read(Build)),
            ("lr_min", Read(Build)),
        ],
    ),
    (
        "training",
        &[
            ("dataset", Read(Run)),
            ("dataset_path", Read(Run)),
            ("local_batch_size", Read(Build)),
            ("global_batch_size", Only(Accept::Int(-1), "gradient accumulation")),
            ("seq_len", Read(Build)),
            ("max_norm", Read(Build)),
            ("steps", Read(Run)),
            ("enable_cpu_offload", Only(Accept::Bool(false), "CPU offload")),
            ("dtype", Only(Accept::Str(&["float32"]), "training without fp32 master weights")),
            ("mixed_precision_param", Read(Build)),
            ("mixed_precision_reduce", Only(Accept::Str(&["float32"]), "gradient reductions in low precision")),
            ("compile", NoteUnless(Build, Accept::Bool(true), COMPILED)),
            ("gc_freq", Note(Run, "titan-run has no garbage collector to schedule")),
            ("gc_debug", NoteUnless(Run, Accept::Bool(false), "titan-run has no garbage collector")),
            ("seed", Read(Run)),
            ("deterministic", Only(Accept::Bool(false), "deterministic-algorithm mode")),
        ],
    ),
    ("training.dataloader", DATALOADER_KEYS),
    (
        "parallelism",
        &[
            ("data_parallel_replicate_degree", Read(Build)),
            ("data_parallel_shard_degree", Read(Build)),
            ("fsdp_reshard_after_forward", Only(Accept::Str(&["default", "always"]), "keeping gathered parameters from the forward to the backward")),
            ("tensor_parallel_degree", Read(Build)),
            ("disable_loss_parallel", Read(Build)),
            ("disable_prefetch_next_layer", Read(Build)),
            ("enable_async_tensor_parallel", Read(Build)),
            ("enable_compiled_autograd", Note(Build, "titan derives the backward ahead of time")),
            ("pipeline_parallel_degree", Read(Build)),
            ("pipeline_parallel_split_points", Inert(PP)),
            ("module_fqns_per_model_part", Inert(PP)),
            ("pipeline_parallel_first_stage_less_layers", Inert(PP)),
            ("pipeline_parallel_last_stage_less_layers", Inert(PP)),
            ("pipeline_parallel_layers_per_stage", Inert(PP)),
            ("pipeline_parallel_schedule", Inert(PP)),
            ("pipeline_parallel_schedule_csv", Inert(PP)),
            ("pipeline_parallel_microbatch_size", Inert(PP)),
            ("pipeline_parallel_expert_parallel_overlap", Inert(PP)),
            ("context_parallel_degree", Read(Build)),
            ("context_parallel_load_balancer", Inert(CP)),
            ("context_parallel_rotate_method", Inert(CP)),
            ("expert_parallel_degree", Read(Build)),
            ("expert_tensor_parallel_degree", Inert(EP)),
            ("expert_parallel_comm_backend", Inert(EP)),
        ],
    ),
    (
        "checkpoint",
        &[
            ("enable", Read(Run)),
            ("enable_checkpoint", Read(Run)),
            ("enable_ft_dataloader_checkpoints", Inert(FT)),
            ("folder", Read(Run)),
            ("interval", Read(Run)),
            ("initial_load_path", Only(Accept::Absent, "loading a DCP checkpoint at start (use `titan-run --init-from model.safetensors`)")),
            ("initial_load_model_only", Inert(INITIAL_LOAD)),
            ("initial_load_model_weights_only", Inert(INITIAL_LOAD)),
            ("initial_load_in_hf", Inert(INITIAL_LOAD)),
            ("initial_load_in_hf_quantized", Inert(INITIAL_LOAD)),
            ("last_save_model_only", Read(Run)),
            ("last_save_model_weights_only", Read(Run)),
            ("last_save_in_hf", Note(Run, "titan's checkpoints always hold safetensors with Hugging Face names")),
            ("export_dtype", Read(Run)),
            ("async_mode", NoteUnless(Run, Accept::Str(&["disabled"]), "titan-run writes checkpoints synchronously (the same files)")),
            ("keep_latest_k", Read(Run)),
            ("load_step", Read(Run)),
            ("exclude_from_loading", Only(Accept::EmptyList, "leaving states out of a resume")),
            ("enable_first_step_checkpoint", Only(Accept::Bool(false), "a checkpoint after the first step")),
            ("create_seed_checkpoint", Only(Accept::Bool(false), "seed checkpoints")),
            ("load_only", Only(Accept::Bool(false), "loading without saving")),
        ],
    ),
    (
        "activation_checkpoint",
        &[
            ("mode", Read(Build)),
            ("selective_ac_option", Read(Build)),
            ("per_op_sac_force_recompute_mm_shapes_by_fqns", Note(Build, "titan's op policy recomputes no GEMM by shape (Llama 3 has no MoE router)")),
            ("early_stop", Only(Accept::Bool(false), "early-stopping recompute")),
            ("memory_budget", Read(Build)),
            ("visualize_memory_budget_pareto", NoteUnless(Build, Accept::Bool(false), "use `titanc build --ac-pareto FILE.svg`")),
            ("preserve_rng_state", Note(Build, "titan's recompute draws no random numbers (no dropout), so there is no RNG state to keep")),
            ("determinism_check", Note(Build, "titan's recompute is bit-identical to the saved values by construction")),
            ("debug", NoteUnless(Build, Accept::Bool(false), "titanc build prints what each layer saves")),
        ],
    ),
    (
        "compile",
        &[
            ("enable", NoteUnless(Build, Accept::Bool(true), COMPILED)),
            ("components", Read(Build)),
            ("backend", Note(Build, "titan generates its own kernels (no inductor)")),
            ("enable_async_tensor_parallel", Read(Build)),
        ],
    ),
    ("float8", FLOAT8_KEYS),
    ("mx", MX_KEYS),
    ("quantize.linear.float8", FLOAT8_KEYS),
    ("quantize.linear.mx", MX_KEYS),
    ("quantize.grouped_mm.float8", &[("fqns", Inert(MOE))]),
    ("quantize.grouped_mm.mx", &[("recipe_name", Inert(MOE)), ("fqns", Inert(MOE))]),
    (
        "comm",
        &[
            ("init_timeout_seconds", Read(Run)),
            ("train_timeout_seconds", Read(Run)),
            ("trace_buf_size", Note(Run, "titan-run keeps no flight-recorder trace of collectives")),
            ("save_traces_folder", Note(Run, "titan-run keeps no flight-recorder trace of collectives")),
            ("save_traces_file_prefix", Note(Run, "titan-run keeps no flight-recorder trace of collectives")),
            ("mode", Only(Accept::Str(&["default"]), "a fake or local-tensor communication backend")),
        ],
    ),
    (
        "memory_estimation",
        &[
            ("enable", NoteUnless(Build, Accept::Bool(false), "titanc build always prints the planned peak memory per rank")),
            ("enabled", NoteUnless(Build, Accept::Bool(false), "titanc build always prints the planned peak memory per rank")),
            ("disable_fake_mode", Note(Build, "titanc plans memory without running the model")),
        ],
    ),
    (
        "fault_tolerance",
        &[
            ("enable", Only(Accept::Bool(false), "TorchFT fault tolerance")),
            ("process_group", Inert(FT)),
            ("process_group_timeout_ms", Inert(FT)),
            ("replica_id", Inert(FT)),
            ("group_size", Inert(FT)),
            ("min_replica_size", Inert(FT)),
            ("semi_sync_method", Inert(FT)),
            ("sync_steps", Inert(FT)),
            ("should_quantize", Inert(FT)),
            ("fragment_sync_delay", Inert(FT)),
            ("fragment_update_alpha", Inert(FT)),
        ],
    ),
    (
        "experimental",
        &[
            ("custom_import", Only(Accept::Str(&[""]), "importing a custom Python module")),
            ("custom_args_module", Only(Accept::Str(&[""]), "a custom Python args module")),
            ("enable_async_tensor_parallel", Read(Build)),
        ],
    ),
    (
        "validation",
        &[
            ("enable", Read(Run)),
            ("enabled", Read(Run)),
            ("dataset", Read(Run)),
            ("dataset_path", Read(Run)),
            ("local_batch_size", Gated(Run, "enable", VAL_SHAPE)),
            ("seq_len", Gated(Run, "enable", VAL_SHAPE)),
            ("freq", Read(Run)),
            ("steps", Read(Run)),
        ],
    ),
    ("validation.dataloader", DATALOADER_KEYS),
    (
        "debug",
        &[
            ("seed", Read(Run)),
            ("deterministic", Only(Accept::Bool(false), "deterministic-algorithm mode")),
            ("deterministic_warn_only", Inert("debug.deterministic = true (not supported yet)")),
            ("moe_force_load_balance", Inert("MoE layers (Llama 3 has none)")),
        ],
    ),
];

/// The disposition of `section.key`, if titan knows the key.
pub fn disposition(section: &str, key: &str) -> Option<Disposition> {
    KEYS.iter().find(|(s, _)| *s == section)?.1.iter().find(|(k, _)| *k == key).map(|(_, d)| *d)
}

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
    /// Every problem of one file, in file order.
    #[error("{file}: {} problems, all listed:\n{}", errors.len(), errors.iter().map(|e| format!("  - {e}")).collect::<Vec<_>>().join("\n"))]
    Many { file: String, errors: Vec<JobConfigError> },
}

impl JobConfigError {
    /// One error for `errors` (none: `Ok`).
    pub fn collect(file: &str, mut errors: Vec<JobConfigError>) -> Result<(), JobConfigError> {
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.pop().expect("invariant: one error")),
            _ => Err(JobConfigError::Many { file: file.into(), errors }),
        }
    }

    /// The single errors this one stands for.
    pub fn flatten(self) -> Vec<JobConfigError> {
        match self {
            JobConfigError::Many { errors, .. } => errors,
            e => vec![e],
        }
    }
}

/// A "not honored" line: `section.key` and why.
#[derive(Clone, Debug, PartialEq)]
pub struct NotHonored {
    pub key: String,
    pub tool: Tool,
    pub why: String,
}

impl std::fmt::Display for NotHonored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` not honored: {}", self.key, self.why)
    }
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

fn show(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => format!("\"{s}\""),
        other => other.to_string(),
    }
}

/// A parsed job config file: its sections by dotted name, the problems found so far and the
/// "not honored" lines. Readers take typed values through [`JobFile::section`]; a value of the
/// wrong type or range is recorded and reads as absent, so reading goes on to the end.
#[derive(Debug)]
pub struct JobFile {
    /// The file name used in messages.
    pub file: String,
    sections: Vec<(String, toml::Table)>,
    errors: RefCell<Vec<JobConfigError>>,
    notes: Vec<NotHonored>,
}

impl JobFile {
    /// Read a job config file; only an unreadable file or invalid TOML fails here.
    pub fn load(path: &Path) -> Result<JobFile, JobConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| JobConfigError::Io { file: file.clone(), message: e.to_string() })?;
        JobFile::parse(&file, &text)
    }

    /// Parse `text` (named `file` in messages) and check every key against [`KEYS`].
    pub fn parse(file: &str, text: &str) -> Result<JobFile, JobConfigError> {
        let root: toml::Table =
            text.parse().map_err(|e: toml::de::Error| JobConfigError::Syntax { file: file.into(), message: e.message().trim_end().to_string() })?;
        let mut jf = JobFile { file: file.into(), sections: Vec::new(), errors: RefCell::default(), notes: Vec::new() };
        for (name, v) in &root {
            match v {
                toml::Value::Table(t) => jf.walk(name, t),
                _ => jf.error(JobConfigError::Invalid {
                    file: file.into(),
                    message: format!("`{name}` is outside any section; put it under its section, e.g. `[training]` for `steps`"),
                }),
            }
        }
        Ok(jf)
    }

    /// Check the table of section `name` (and its nested sections).
    fn walk(&mut self, name: &str, t: &toml::Table) {
        let file = self.file.clone();
        let known = KEYS.iter().find(|(s, _)| *s == name).map(|(_, k)| *k);
        let nested = |k: &str| format!("{name}.{k}");
        let has_nested = |k: &str| KEYS.iter().any(|(s, _)| s.starts_with(&format!("{}.", nested(k))) || *s == nested(k));
        if known.is_none() && !KEYS.iter().any(|(s, _)| s.starts_with(&format!("{name}."))) {
            let top: Vec<&str> = KEYS.iter().map(|(s, _)| *s).filter(|s| !s.contains('.')).collect();
            let err = match name.rsplit_once('.') {
                None => JobConfigError::UnknownSection { file, section: name.into(), known: top.join(", ") },
                Some((parent, _)) => JobConfigError::UnknownKey {
                    file,
                    key: name.into(),
                    section: parent.into(),
                    known: KEYS.iter().filter_map(|(s, _)| s.strip_prefix(&format!("{parent}."))).collect::<Vec<_>>().join(", "),
                },
            };
            self.error(err);
            return;
        }
        let mut own = toml::Table::new();
        for (k, v) in t {
            let disposition = known.and_then(|keys| keys.iter().find(|(key, _)| key == k).map(|(_, d)| *d));
            match (disposition, v) {
                (None, toml::Value::Table(sub)) if has_nested(k) => self.walk(&nested(k), sub),
                (None, _) => {
                    let mut names: Vec<String> = known.unwrap_or_default().iter().map(|(k, _)| k.to_string()).collect();
                    names.extend(KEYS.iter().filter_map(|(s, _)| s.strip_prefix(&format!("{name}."))).filter(|s| !s.contains('.')).map(String::from));
                    self.error(JobConfigError::UnknownKey { file: file.clone(), key: nested(k), section: name.into(), known: names.join(", ") });
                }
                (Some(d), v) => {
                    self.dispose(name, k, d, v, t);
                    own.insert(k.clone(), v.clone());
                }
            }
        }
        self.sections.push((name.into(), own));
    }

    fn dispose(&mut self, section: &str, key: &str, d: Disposition, v: &toml::Value, table: &toml::Table) {
        let full = format!("{section}.{key}");
        let accept = match d {
            NoteUnless(_, a, _) | Only(a, _) => Some(a),
            _ => None,
        };
        let expected = match accept {
            Some(Accept::Bool(_)) => Some(("a bool (true or false)", v.is_bool())),
            Some(Accept::Int(_)) => Some(("an integer", v.is_integer())),
            Some(Accept::Str(_)) => Some(("a string", v.is_str())),
            Some(Accept::EmptyList) => Some(("an array", v.is_array())),
            Some(Accept::Absent) | None => None,
        };
        if let Some((expected, false)) = expected {
            self.error(JobConfigError::Type { file: self.file.clone(), key: full, expected, found: describe(v) });
            return;
        }
        let note = |tool: Tool, why: &str| NotHonored { key: full.clone(), tool, why: why.into() };
        match d {
            Read(_) | Inert(_) => {}
            Note(tool, why) => self.notes.push(note(tool, why)),
            NoteUnless(tool, accept, why) => {
                if !accept.accepts(v) {
                    self.notes.push(NotHonored { key: format!("{full} = {}", show(v)), tool, why: why.into() });
                }
            }
            Gated(tool, gate, why) => {
                if table.get(gate).and_then(toml::Value::as_bool) == Some(true) {
                    self.notes.push(note(tool, why));
                }
            }
            Only(accept, what) => {
                if !accept.accepts(v) {
                    let fix = match accept {
                        Accept::Absent => format!("remove `{full}`"),
                        a => format!("set `{full}` to {}", a.describe()),
                    };
                    self.error(JobConfigError::Unsupported { file: self.file.clone(), what: format!("{what} (`{full} = {}`)", show(v)), fix });
                }
            }
        }
    }

    /// Record a problem; reading goes on.
    pub fn error(&self, e: JobConfigError) {
        self.errors.borrow_mut().extend(e.flatten());
    }

    /// Whether the file has section `name` (dotted for nested ones).
    pub fn has_section(&self, name: &str) -> bool {
        self.sections.iter().any(|(s, _)| s == name)
    }

    /// Typed access to section `name`: a [`KEYS`] name, so messages name `section.key`.
    pub fn section(&self, name: &'static str) -> Section<'_> {
        Section { jf: self, name, table: self.sections.iter().find(|(s, _)| s == name).map(|(_, t)| t) }
    }

    /// The "not honored" lines; `tool` keeps those of one binary's keys.
    pub fn not_honored(&self, tool: Option<Tool>) -> Vec<NotHonored> {
        self.notes.iter().filter(|n| tool.is_none_or(|t| n.tool == t)).cloned().collect()
    }

    /// Add a "not honored" line found by a reader (e.g. a dataset name titan-run cannot resolve).
    pub fn note(&mut self, n: NotHonored) {
        self.notes.push(n);
    }

    /// Every problem recorded, as one error (`Ok` when there is none).
    pub fn finish(&self) -> Result<(), JobConfigError> {
        JobConfigError::collect(&self.file, self.errors.borrow().clone())
    }
}

/// One section of a [`JobFile`] with typed accessors: a wrong type or range is recorded on the
/// file (naming `section.key`) and reads as `None`.
pub struct Section<'a> {
    jf: &'a JobFile,
    pub name: &'static str,
    table: Option<&'a toml::Table>,
}

impl<'a> Section<'a> {
    pub fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.name)
    }

    pub fn file(&self) -> &str {
        &self.jf.file
    }

    pub fn get(&self, k: &str) -> Option<&'a toml::Value> {
        self.table.and_then(|t| t.get(k))
    }

    /// Record a problem on the file.
    pub fn error(&self, e: JobConfigError) {
        self.jf.error(e);
    }

    pub fn invalid(&self, message: String) -> JobConfigError {
        JobConfigError::Invalid { file: self.jf.file.clone(), message }
    }

    pub fn unsupported(&self, what: String, fix: &str) -> JobConfigError {
        JobConfigError::Unsupported { file: self.jf.file.clone(), what, fix: fix.into() }
    }

    fn type_error<T>(&self, k: &str, expected: &'static str, v: &toml::Value) -> Option<T> {
        self.error(JobConfigError::Type { file: self.jf.file.clone(), key: self.key(k), expected, found: describe(v) });
        None
    }

    pub fn string(&self, k: &str) -> Option<String> {
        match self.get(k)? {
            toml::Value::String(s) => Some(s.clone()),
            v => self.type_error(k, "a string", v),
        }
    }

    /// A float; integers are accepted (`weight_decay = 0`).
    pub fn float(&self, k: &str) -> Option<f64> {
        match self.get(k)? {
            toml::Value::Float(x) => Some(*x),
            toml::Value::Integer(i) => Some(*i as f64),
            v => self.type_error(k, "a number", v),
        }
    }

    pub fn int(&self, k: &str) -> Option<i64> {
        match self.get(k)? {
            toml::Value::Integer(i) => Some(*i),
            v => self.type_error(k, "an integer", v),
        }
    }

    /// An integer of at least `min`.
    pub fn count(&self, k: &str, min: u64) -> Option<u64> {
        let i = self.int(k)?;
        match u64::try_from(i) {
            Ok(u) if u >= min => Some(u),
            _ => {
                self.error(self.invalid(format!("`{}` must be at least {min}, found {i}", self.key(k))));
                None
            }
        }
    }

    pub fn bool(&self, k: &str) -> Option<bool> {
        match self.get(k)? {
            toml::Value::Boolean(b) => Some(*b),
            v => self.type_error(k, "a bool (true or false)", v),
        }
    }

    /// An array of strings; a single string (older TorchTitan configs, e.g. `filter_fqns =
    /// "output"`) is a one-element array.
    pub fn strings(&self, k: &str) -> Option<Vec<String>> {
        match self.get(k)? {
            toml::Value::String(s) => Some(vec![s.clone()]),
            toml::Value::Array(items) => {
                let mut out = Vec::with_capacity(items.len());
                for item in items {
                    match item {
                        toml::Value::String(s) => out.push(s.clone()),
                        other => return self.type_error(k, "a string or an array of strings", other),
                    }
                }
                Some(out)
            }
            v => self.type_error(k, "a string or an array of strings", v),
        }
    }

    /// A float checked by `ok`, with `range` describing the accepted values.
    pub fn float_in(&self, k: &str, range: &str, ok: impl Fn(f64) -> bool) -> Option<f64> {
        let x = self.float(k)?;
        if x.is_finite() && ok(x) {
            Some(x)
        } else {
            self.error(self.invalid(format!("`{}` must be {range}, found {x}", self.key(k))));
            None
        }
    }

    /// The first of `keys` (a key and its older spelling) the section sets; both set is an error.
    pub fn alias(&self, keys: [&'static str; 2]) -> Option<&'static str> {
        match (self.get(keys[0]).is_some(), self.get(keys[1]).is_some()) {
            (true, true) => {
                self.error(self.invalid(format!("both `{}` and `{}` are set (the older spelling); keep one", self.key(keys[0]), self.key(keys[1]))));
                None
            }
            (true, false) => Some(keys[0]),
            (false, true) => Some(keys[1]),
            (false, false) => None,
        }
    }
}

/// The dtype of the last checkpoint's exported weights (`checkpoint.export_dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportDtype {
    F32,
    BF16,
    F16,
}

/// `[checkpoint]` as titan-run honors it.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointSettings {
    pub enable: bool,
    /// Relative to `job.dump_folder`, as TorchTitan joins them.
    pub folder: String,
    pub interval: Option<u64>,
    /// `None`: the latest checkpoint in the folder, if any (TorchTitan's `-1`).
    pub load_step: Option<u64>,
    /// `0` keeps every checkpoint.
    pub keep_latest_k: u64,
    pub last_save_model_only: bool,
    pub export_dtype: ExportDtype,
}

/// `[validation]` as titan-run honors it (its `--val-data`, `--val-every`, `--val-steps`).
#[derive(Clone, Debug, PartialEq)]
pub struct ValidationSettings {
    /// `enable` (`enabled` in older releases).
    pub enable: bool,
    /// `dataset_path`, or `dataset` when it names an existing file or directory.
    pub data: Option<PathBuf>,
    /// `dataset` when it is not a path (one of TorchTitan's registered names, e.g. its default
    /// `"c4_validation"`), which titan-run cannot resolve.
    pub dataset_name: Option<String>,
    /// Validate at step 1 and every `freq` steps (TorchTitan's default: 10).
    pub freq: u64,
    /// Batches per validation; `None` is TorchTitan's `-1` (its default): the whole validation
    /// set once.
    pub steps: Option<u64>,
}

/// The keys that ask for async tensor parallelism: TorchTitan's `[parallelism]` one, the newer
/// `[compile]` one and the older `[experimental]` one.
pub const ASYNC_TP_KEYS: [&str; 3] = ["parallelism", "compile", "experimental"];

/// Async TP as a job config asks for it: the key that set it and its value.
#[derive(Clone, Debug, PartialEq)]
pub struct AsyncTpSetting {
    /// `section.enable_async_tensor_parallel`.
    pub key: String,
    pub on: bool,
}

/// The runtime sections of a job config, as `titan-run --job-config` applies them (its
/// command-line flags override each).
#[derive(Clone, Debug, PartialEq)]
pub struct RunSettings {
    pub description: Option<String>,
    /// `job.dump_folder`: the root of the checkpoint folder and the metrics file.
    pub dump_folder: PathBuf,
    pub steps: Option<u64>,
    /// `training.seed` (v0.1.0) or `debug.seed` (v0.2).
    pub seed: Option<u64>,
    /// `training.dataset_path`, or `training.dataset` when it names an existing file or
    /// directory; `None` when the dataset is one of TorchTitan's registered names.
    pub data: Option<PathBuf>,
    pub checkpoint: CheckpointSettings,
    pub log_freq: Option<u64>,
    pub profile: bool,
    pub init_timeout_s: Option<u64>,
    pub train_timeout_s: Option<u64>,
    pub validation: ValidationSettings,
    /// `enable_async_tensor_parallel` of [`ASYNC_TP_KEYS`] (a build key: `titanc build` maps it
    /// to `--async-tp`; read here, once, because titan-run's CUDA backend refuses such artifacts
    /// and names the key).
    pub async_tp: Option<AsyncTpSetting>,
}

impl RunSettings {
    /// The file's metrics file: `<dump_folder>/metrics.jsonl`.
    pub fn metrics_file(&self) -> PathBuf {
        self.dump_folder.join("metrics.jsonl")
    }

    /// The checkpoint folder, `<dump_folder>/<checkpoint.folder>`.
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.dump_folder.join(&self.checkpoint.folder)
    }

    /// Read the runtime sections of `jf` (problems are recorded on it). A `training.dataset`
    /// that is neither an existing path nor set alongside `dataset_path` adds a "not honored"
    /// line.
    pub fn read(jf: &mut JobFile) -> RunSettings {
        let s = RunSettings::read_typed(jf);
        if s.data.is_none()
            && let Some(name) = jf.section("training").string("dataset")
        {
            jf.note(NotHonored {
                key: format!("training.dataset = \"{name}\""),
                tool: Tool::Run,
                why: "titan-run has no dataset registry; it trains on `training.dataset_path`, `--data` or the bundled corpus".into(),
            });
        }
        if let (true, Some(name)) = (s.validation.enable, &s.validation.dataset_name) {
            jf.note(NotHonored {
                key: format!("validation.dataset = \"{name}\""),
                tool: Tool::Run,
                why: "titan-run has no dataset registry; it validates on `validation.dataset_path` or `--val-data`".into(),
            });
        }
        s
    }

    fn read_typed(jf: &JobFile) -> RunSettings {
        let job = jf.section("job");
        let tr = jf.section("training");
        let dbg = jf.section("debug");
        let seed = match (tr.count("seed", 0), dbg.count("seed", 0)) {
            (Some(a), Some(b)) if a != b => {
                tr.error(tr.invalid(format!("`training.seed = {a}` and `debug.seed = {b}` differ; keep one")));
                None
            }
            (a, b) => a.or(b),
        };
        let data = tr.string("dataset_path").map(PathBuf::from).or_else(|| tr.string("dataset").map(PathBuf::from).filter(|p| p.exists()));
        let ck = jf.section("checkpoint");
        let enable = ck.alias(["enable", "enable_checkpoint"]).and_then(|k| ck.bool(k)).unwrap_or(false);
        let load_step = match ck.int("load_step") {
            None | Some(-1) => None,
            Some(n) if n >= 0 => Some(n as u64),
            Some(n) => {
                ck.error(ck.invalid(format!("`checkpoint.load_step` must be -1 (the latest) or a step, found {n}")));
                None
            }
        };
        let export_dtype = match ck.string("export_dtype").as_deref() {
            None | Some("float32") => ExportDtype::F32,
            Some("bfloat16") => ExportDtype::BF16,
            Some("float16") => ExportDtype::F16,
            Some(other) => {
                ck.error(ck.invalid(format!("`checkpoint.export_dtype` must be \"float32\", \"bfloat16\" or \"float16\", found \"{other}\"")));
                ExportDtype::F32
            }
        };
        let checkpoint = CheckpointSettings {
            enable,
            folder: ck.string("folder").unwrap_or_else(|| "checkpoint".into()),
            interval: ck.count("interval", 1),
            load_step,
            keep_latest_k: ck.count("keep_latest_k", 0).unwrap_or(10),
            last_save_model_only: ck.alias(["last_save_model_only", "last_save_model_weights_only"]).and_then(|k| ck.bool(k)).unwrap_or(false),
            export_dtype,
        };
        if checkpoint.keep_latest_k == 1 {
            ck.error(ck.invalid("`checkpoint.keep_latest_k = 1` could delete the only good checkpoint while the next one is written (TorchTitan refuses it too); use 0 (keep all) or 2 or more".into()));
        }
        let comm = jf.section("comm");
        let val = jf.section("validation");
        let val_path = val.string("dataset_path").map(PathBuf::from);
        let val_name = val.string("dataset");
        let validation = ValidationSettings {
            enable: val.alias(["enable", "enabled"]).and_then(|k| val.bool(k)).unwrap_or(false),
            data: val_path.clone().or_else(|| val_name.as_ref().map(PathBuf::from).filter(|p| p.exists())),
            dataset_name: val_name.filter(|n| val_path.is_none() && !Path::new(n).exists()),
            freq: val.count("freq", 1).unwrap_or(10),
            steps: match val.int("steps") {
                None | Some(-1) => None,
                Some(n) if n >= 1 => Some(n as u64),
                Some(n) => {
                    val.error(val.invalid(format!("`validation.steps` must be -1 (the whole validation set) or at least 1, found {n}")));
                    None
                }
            },
        };
        let mut async_tp: Option<AsyncTpSetting> = None;
        for section in ASYNC_TP_KEYS {
            let sec = jf.section(section);
            let Some(on) = sec.bool("enable_async_tensor_parallel") else { continue };
            let key = sec.key("enable_async_tensor_parallel");
            match &async_tp {
                Some(first) if first.on != on => {
                    sec.error(sec.invalid(format!("`{} = {}` and `{key} = {on}` differ; keep one", first.key, first.on)));
                }
                Some(_) => {}
                None => async_tp = Some(AsyncTpSetting { key, on }),
            }
        }
        RunSettings {
            description: job.string("description"),
            dump_folder: PathBuf::from(job.string("dump_folder").unwrap_or_else(|| "./outputs".into())),
            steps: tr.count("steps", 1),
            seed,
            data,
            checkpoint,
            log_freq: jf.section("metrics").count("log_freq", 1),
            profile: jf.section("profiling").bool("enable_profiling").unwrap_or(false),
            init_timeout_s: comm.count("init_timeout_seconds", 1),
            train_timeout_s: comm.count("train_timeout_seconds", 1),
            validation,
            async_tp,
        }
    }

    /// Load `path` for titan-run: the runtime settings and titan-run's "not honored" lines, or
    /// every problem of the file at once. Build keys are checked by titanc, not here.
    pub fn load(path: &Path) -> Result<(RunSettings, Vec<NotHonored>), JobConfigError> {
        let mut jf = JobFile::load(path)?;
        let s = RunSettings::read(&mut jf);
        jf.finish()?;
        Ok((s, jf.not_honored(Some(Tool::Run))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(text: &str) -> Result<(RunSettings, Vec<String>), String> {
        let mut jf = JobFile::parse("job.toml", text).map_err(|e| e.to_string())?;
        let s = RunSettings::read(&mut jf);
        jf.finish().map_err(|e| e.to_string())?;
        Ok((s, jf.not_honored(None).iter().map(ToString::to_string).collect()))
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let e = run("[metrics]\nlog_freq = 0\nfoo = 1\n[checkpoint]\nload_only = true\nexport_dtype = \"fp8\"\n[bogus]\nx = 1\n").unwrap_err();
        assert!(e.starts_with("job.toml: 5 problems, all listed:"), "{e}");
        for want in [
            "unknown section `[bogus]`",
            "unknown key `metrics.foo`",
            "`metrics.log_freq` must be at least 1, found 0",
            "loading without saving (`checkpoint.load_only = true`) is not supported yet; set `checkpoint.load_only` to false",
            "`checkpoint.export_dtype` must be \"float32\", \"bfloat16\" or \"float16\", found \"fp8\"",
        ] {
            assert!(e.contains(want), "`{want}` missing from:\n{e}");
        }
    }

    #[test]
    fn runtime_sections_are_read() {
        let (s, notes) = run(
            "[job]\ndump_folder = \"out\"\n[training]\nsteps = 7\nseed = 3\ndataset = \"c4\"\n[checkpoint]\nenable_checkpoint = true\nfolder = \"ck\"\ninterval = 2\nload_step = 4\nkeep_latest_k = 3\nlast_save_model_weights_only = true\nexport_dtype = \"bfloat16\"\nasync_mode = \"async\"\n[metrics]\nlog_freq = 5\nenable_tensorboard = true\nsave_tb_folder = \"tb\"\n[profiling]\nenable_profiling = true\nprofile_freq = 10\n[comm]\ninit_timeout_seconds = 30\ntrain_timeout_seconds = 20\n",
        )
        .unwrap();
        assert_eq!((s.steps, s.seed, s.log_freq, s.profile), (Some(7), Some(3), Some(5), true));
        assert_eq!(s.checkpoint_dir(), PathBuf::from("out/ck"));
        assert_eq!(s.metrics_file(), PathBuf::from("out/metrics.jsonl"));
        let c = &s.checkpoint;
        assert_eq!((c.enable, c.interval, c.load_step, c.keep_latest_k, c.last_save_model_only), (true, Some(2), Some(4), 3, true));
        assert_eq!(c.export_dtype, ExportDtype::BF16);
        assert_eq!((s.init_timeout_s, s.train_timeout_s), (Some(30), Some(20)));
        assert_eq!(s.data, None);
        let keys: Vec<&str> = notes.iter().map(|n| n.split(" not honored").next().unwrap_or("")).collect();
        assert_eq!(
            keys,
            [
                "`checkpoint.async_mode = \"async\"`",
                "`metrics.enable_tensorboard = true`",
                "`metrics.save_tb_folder`",
                "`profiling.profile_freq`",
                "`training.dataset = \"c4\"`"
            ]
        );
    }

    #[test]
    fn features_titan_lacks_are_refused_only_when_on() {
        run("[parallelism]\npipeline_parallel_schedule = \"Interleaved1F1B\"\nenable_async_tensor_parallel = false\n[fault_tolerance]\nenable = false\nreplica_id = 3\n")
            .unwrap();
        let e = run("[lr_scheduler]\ntotal_steps = 10\n").unwrap_err();
        assert!(e.contains("is not supported yet; remove `lr_scheduler.total_steps`"), "{e}");
        let e = run("[quantize.linear.int4]\nx = 1\n").unwrap_err();
        assert!(e.contains("unknown key `quantize.linear.int4`; `[quantize.linear]` takes: float8, mx"), "{e}");
        let e = run("[checkpoint]\nkeep_latest_k = 1\n").unwrap_err();
        assert!(e.contains("keep_latest_k = 1"), "{e}");
        let e = run("[checkpoint]\nenable = true\nenable_checkpoint = true\n").unwrap_err();
        assert!(e.contains("keep one"), "{e}");
    }

    #[test]
    fn async_tp_is_read_from_any_of_its_three_keys() {
        let on = |t: &str| run(t).unwrap().0.async_tp;
        assert_eq!(on(""), None);
        for section in ASYNC_TP_KEYS {
            let s = on(&format!("[{section}]\nenable_async_tensor_parallel = true\n")).expect("read");
            assert_eq!((s.key.as_str(), s.on), (format!("{section}.enable_async_tensor_parallel").as_str(), true));
        }
        assert_eq!(on("[parallelism]\nenable_async_tensor_parallel = false\n").map(|s| s.on), Some(false));
        let e = run("[parallelism]\nenable_async_tensor_parallel = false\n[compile]\nenable_async_tensor_parallel = true\n").unwrap_err();
        assert!(e.contains("`parallelism.enable_async_tensor_parallel = false` and `compile.enable_async_tensor_parallel = true` differ; keep one"), "{e}");
    }

    #[test]
    fn validation_is_read_with_torchtitan_defaults() {
        let (s, notes) = run("[validation]\nenable = true\nlocal_batch_size = 8\n").unwrap();
        let v = &s.validation;
        assert_eq!((v.enable, v.freq, v.steps, v.data.as_ref(), v.dataset_name.as_ref()), (true, 10, None, None, None));
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].starts_with("`validation.local_batch_size` not honored: titan's eval step runs on the training step's batch"), "{notes:?}");
        let (s, notes) = run("[validation]\nenabled = true\ndataset = \"c4_validation\"\nfreq = 4\nsteps = 3\n").unwrap();
        let v = &s.validation;
        assert_eq!((v.enable, v.freq, v.steps, v.data.as_ref()), (true, 4, Some(3), None));
        assert_eq!(v.dataset_name.as_deref(), Some("c4_validation"));
        assert!(notes.iter().any(|n| n.starts_with("`validation.dataset = \"c4_validation\"` not honored: titan-run has no dataset registry")), "{notes:?}");
        let (s, _) = run("[validation]\nenable = true\ndataset = \"c4_validation\"\ndataset_path = \"val.txt\"\nsteps = -1\n").unwrap();
        assert_eq!((s.validation.data, s.validation.dataset_name, s.validation.steps), (Some(PathBuf::from("val.txt")), None, None));
        // Off, the section's keys are accepted silently (TorchTitan's shipped configs carry them).
        let (s, notes) = run("[validation]\nenable = false\nlocal_batch_size = 8\nseq_len = 2048\nfreq = 10\n").unwrap();
        assert!(!s.validation.enable && notes.is_empty(), "{notes:?}");
        let e = run("[validation]\nsteps = 0\nfreq = 0\n").unwrap_err();
        assert!(
            e.contains("`validation.steps` must be -1 (the whole validation set) or at least 1, found 0") && e.contains("`validation.freq` must be at least 1"),
            "{e}"
        );
    }

    /// Every key the table names is reachable: no section is shadowed by a nested one.
    #[test]
    fn the_key_table_has_no_duplicates() {
        let mut seen = std::collections::HashSet::new();
        for (s, keys) in KEYS {
            for (k, _) in *keys {
                assert!(seen.insert(format!("{s}.{k}")), "{s}.{k} twice");
                assert!(!KEYS.iter().any(|(t, _)| *t == format!("{s}.{k}")), "{s}.{k} is both a key and a section");
            }
        }
    }
}
