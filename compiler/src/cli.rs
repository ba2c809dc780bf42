//! The `titanc` command line: the clap argument definitions and every command, run in-process
//! so tests can call [`execute`] directly. `main.rs` only parses, prints and sets the exit code.

use std::path::{Path, PathBuf};

use clap::{ArgGroup, Args, Parser, Subcommand};
use titan_ir::artifact::Target;
use titan_ir::diag::SourceError;
use titan_ir::print::print_graph;
use titan_ir::{DType, DecayKind, Graph};
use titan_passes::activation_checkpoint::AcPolicy;
use titan_passes::{DumpAfter, PassError, PipelineOptions, TrainOptions, lower_to_train};

use crate::FrontendError;
use crate::build::{BuildError, BuildOptions, TARGETS, build_artifact};
use crate::hf::load_hf_config;
use crate::job_config::{JobConfig, JobConfigError};
use crate::llama::{LlamaConfig, LlamaOverrides, Preset, build_llama3};
use crate::stats::model_stats;

/// Model families `titanc new` can build.
pub const FAMILIES: [&str; 1] = ["llama3"];

/// Targets `titanc lower --to` accepts.
pub const LOWER_TARGETS: [&str; 2] = ["train", "eval"];

#[derive(Debug, Parser)]
#[command(name = "titanc", version, about = "titan: an ahead-of-time compiler for training Llama models")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the graph IR of a new model (`titanc new llama3 --preset debug`)
    New(NewArgs),
    /// Lower a model graph to the training step (`titanc lower model.ir --to train`)
    Lower(LowerArgs),
    /// Parse and verify a graph file, reporting every error
    Verify(FileArgs),
    /// Re-print a graph file in canonical form
    Fmt(FmtArgs),
    /// Print parameter counts and training FLOPs per token of a model graph
    Stats(FileArgs),
    /// Compile a model graph into an artifact directory for titan-run (`titanc build model.ir -o DIR`)
    Build(BuildArgs),
    /// Run named passes on a graph file and print the result (`titanc opt f.ir --passes cse,dce`)
    Opt(OptArgs),
    /// Predict an artifact's step time with the cost model; compare with and calibrate to a measured trace
    Simulate(SimulateArgs),
    /// List the passes `titanc opt --passes` and `--dump-after` take, with their summaries
    Passes,
    /// Training data: `titanc data tokenize PATH --tokenizer tokenizer.json -o DIR` writes llm.c shards
    #[command(subcommand)]
    Data(crate::data_cmd::DataCommand),
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("source").required(true).args(["preset", "from_hf"])))]
pub struct NewArgs {
    /// Model family; only `llama3` for now
    pub family: String,
    /// Built-in size: debug, 1b, 3b, 8b, 70b or 405b
    #[arg(long, value_parser = parse_preset)]
    pub preset: Option<Preset>,
    /// A Hugging Face Llama config.json to take the sizes from
    #[arg(long, value_name = "CONFIG_JSON")]
    pub from_hf: Option<PathBuf>,
    #[command(flatten)]
    pub overrides: OverrideArgs,
    /// Write the IR to FILE instead of stdout
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Also print parameter counts and FLOPs per token to stderr
    #[arg(long)]
    pub summary: bool,
}

/// Values replacing those of the preset or Hugging Face config.
#[derive(Debug, Default, Args)]
pub struct OverrideArgs {
    /// Model dimension
    #[arg(long, value_parser = titan_ir::flags::positive::<u64>, allow_negative_numbers = true)]
    pub dim: Option<u64>,
    /// Number of transformer layers
    #[arg(long, value_parser = titan_ir::flags::positive::<u64>, allow_negative_numbers = true)]
    pub n_layers: Option<u64>,
    /// Number of query heads
    #[arg(long, value_parser = titan_ir::flags::positive::<u64>, allow_negative_numbers = true)]
    pub n_heads: Option<u64>,
    /// Number of key/value heads
    #[arg(long, value_parser = titan_ir::flags::positive::<u64>, allow_negative_numbers = true)]
    pub n_kv_heads: Option<u64>,
    /// Feed-forward hidden dimension
    #[arg(long, value_parser = titan_ir::flags::positive::<u64>, allow_negative_numbers = true)]
    pub ffn_dim: Option<u64>,
    /// Vocabulary size
    #[arg(long, value_parser = titan_ir::flags::positive::<u64>, allow_negative_numbers = true)]
    pub vocab_size: Option<u64>,
    /// Tokens per sequence
    #[arg(long, value_parser = titan_ir::flags::positive::<u64>, allow_negative_numbers = true)]
    pub seq_len: Option<u64>,
    /// Sequences per step
    #[arg(long, value_parser = titan_ir::flags::positive::<u64>, allow_negative_numbers = true)]
    pub batch_size: Option<u64>,
    /// RoPE base frequency
    #[arg(long, allow_hyphen_values = true)]
    pub rope_theta: Option<f64>,
    /// RMSNorm epsilon
    #[arg(long, allow_hyphen_values = true)]
    pub norm_eps: Option<f64>,
    /// Parameter dtype: bf16, f16 or f32
    #[arg(long, value_parser = parse_dtype)]
    pub dtype: Option<DType>,
    /// Share the embedding table with the output head
    #[arg(long, conflicts_with = "no_tie_embeddings")]
    pub tie_embeddings: bool,
    /// Give the output head its own weight
    #[arg(long)]
    pub no_tie_embeddings: bool,
}

impl OverrideArgs {
    pub fn to_overrides(&self) -> LlamaOverrides {
        LlamaOverrides {
            dim: self.dim,
            n_layers: self.n_layers,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            ffn_dim: self.ffn_dim,
            vocab_size: self.vocab_size,
            seq_len: self.seq_len,
            batch_size: self.batch_size,
            rope_theta: self.rope_theta,
            norm_eps: self.norm_eps,
            dtype: self.dtype,
            tie_embeddings: match (self.tie_embeddings, self.no_tie_embeddings) {
                (true, _) => Some(true),
                (false, true) => Some(false),
                (false, false) => None,
            },
        }
    }
}

#[derive(Debug, Args)]
pub struct LowerArgs {
    /// The model graph file
    pub file: PathBuf,
    /// What to lower to: `train` (the training step) or `eval` (forward and loss only, the eval
    /// step an artifact carries for validation, unfused)
    #[arg(long, value_name = "TARGET")]
    pub to: String,
    #[command(flatten)]
    pub train: TrainFlags,
    /// Parallel degrees: with more than one rank the result is an SPMD graph for the simulated mesh
    #[command(flatten)]
    pub parallel: ParallelFlags,
    #[command(flatten)]
    pub ac: AcFlags,
    /// Write the IR to FILE instead of stdout
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

/// The training flags of `titanc build` (the same as `titanc lower`'s); they override the job config.
#[derive(Debug, Default, Clone, Args)]
pub struct TrainFlags {
    /// Peak learning rate [default: 8e-4]
    #[arg(long, allow_hyphen_values = true)]
    pub lr: Option<f64>,
    /// Linear warmup steps [default: 200]
    #[arg(long, value_parser = titan_ir::flags::non_negative::<u64>, allow_negative_numbers = true)]
    pub warmup_steps: Option<u64>,
    /// Decay steps after warmup [default: 800, or training.steps - warmup with a job config]
    #[arg(long, value_parser = titan_ir::flags::non_negative::<u64>, allow_negative_numbers = true)]
    pub decay_steps: Option<u64>,
    /// Decay shape: cosine, linear or constant [default: linear]
    #[arg(long)]
    pub decay: Option<String>,
    /// Final learning rate as a fraction of the peak [default: 0]
    #[arg(long, allow_hyphen_values = true)]
    pub min_lr_ratio: Option<f64>,
    /// AdamW beta1 [default: 0.9]
    #[arg(long, allow_hyphen_values = true)]
    pub beta1: Option<f64>,
    /// AdamW beta2 [default: 0.95]
    #[arg(long, allow_hyphen_values = true)]
    pub beta2: Option<f64>,
    /// AdamW epsilon [default: 1e-8]
    #[arg(long, allow_hyphen_values = true)]
    pub eps: Option<f64>,
    /// AdamW weight decay [default: 0.1]
    #[arg(long, allow_hyphen_values = true)]
    pub weight_decay: Option<f64>,
    /// Clip the global gradient norm to this value; 0 disables clipping [default: 1.0]
    #[arg(long, allow_hyphen_values = true)]
    pub max_norm: Option<f64>,
    /// Float8 training recipe: rowwise, rowwise_with_gw_hp or tensorwise (torchao's recipes)
    #[arg(long, value_name = "RECIPE")]
    pub float8: Option<String>,
    /// With --float8: keep linears whose name contains one of these (comma-separated, e.g.
    /// `output`) in bf16; `auto` also keeps those the cost model finds faster in bf16
    #[arg(long, value_name = "NAME,...", requires = "float8")]
    pub float8_filter: Option<String>,
    /// With --float8 tensorwise and --dp-shard > 1: all-gather FSDP weight shards in fp8 (each
    /// shard quantized with the dp_shard-wide amax; half the bytes of a bf16 gather), as torchao's
    /// `enable_fsdp_float8_all_gather`
    #[arg(long, requires = "float8")]
    pub enable_fsdp_float8_all_gather: bool,
    /// With --enable-fsdp-float8-all-gather: one amax all-reduce for all weights of a block
    /// instead of one per weight (torchao's `precompute_float8_dynamic_scale_for_fsdp`)
    #[arg(long, requires = "enable_fsdp_float8_all_gather")]
    pub precompute_float8_dynamic_scale_for_fsdp: bool,
}

impl TrainFlags {
    /// The training options: these flags where given, else the job config's values, else
    /// titanc's defaults; flag values are checked like `titanc lower`'s.
    pub fn resolve(&self, job: Option<&JobConfig>) -> Result<TrainOptions, CliError> {
        let j = match job {
            Some(j) => j.train_settings(self.warmup_steps)?,
            None => Default::default(),
        };
        let decay_name = |d: DecayKind| match d {
            DecayKind::Constant => "constant",
            DecayKind::Linear => "linear",
            DecayKind::Cosine => "cosine",
        };
        let merged = TrainFlags {
            lr: self.lr.or(j.lr),
            warmup_steps: self.warmup_steps.or(j.warmup_steps),
            decay_steps: self.decay_steps.or(j.decay_steps),
            decay: self.decay.clone().or_else(|| j.decay.map(|d| decay_name(d).to_string())),
            min_lr_ratio: self.min_lr_ratio.or(j.min_lr_ratio),
            beta1: self.beta1.or(j.beta1),
            beta2: self.beta2.or(j.beta2),
            eps: self.eps.or(j.eps),
            weight_decay: self.weight_decay.or(j.weight_decay),
            max_norm: self.max_norm.or(j.max_norm),
            float8: self.float8.clone(),
            float8_filter: self.float8_filter.clone(),
            enable_fsdp_float8_all_gather: self.enable_fsdp_float8_all_gather,
            precompute_float8_dynamic_scale_for_fsdp: self.precompute_float8_dynamic_scale_for_fsdp,
        };
        let mut o = merged.checked()?;
        if o.float8.is_none() {
            o.float8 = j.float8;
        }
        Ok(o)
    }
}

#[derive(Debug, Args)]
pub struct BuildArgs {
    /// The model graph file (from `titanc new`)
    pub file: PathBuf,
    /// The artifact directory to write (replaced if it holds an older artifact)
    #[arg(short, long, value_name = "DIR")]
    pub output: PathBuf,
    /// A TorchTitan-style job config (TOML); command-line flags override its values
    #[arg(long, value_name = "TOML")]
    pub job_config: Option<PathBuf>,
    #[command(flatten)]
    pub train: TrainFlags,
    /// Print the IR after this pass (or after every pass with `all`) to stderr
    #[arg(long, value_name = "PASS")]
    pub dump_after: Option<String>,
    /// Show the time of every pass in the summary
    #[arg(long)]
    pub timings: bool,
    /// Print the fusion report (kernels and memory traffic before and after fusion)
    #[arg(long)]
    pub report: bool,
    /// GPU architecture to generate code for; only sm_90a (H100/H200)
    #[arg(long, default_value = "sm_90a")]
    pub target: String,
    /// Device memory per GPU in GiB that a rank's predicted peak is checked against (a warning
    /// when it does not fit) [default: the target's smallest GPU, 80 for sm_90a; 141 on an H200]
    #[arg(long, value_name = "GIB", allow_hyphen_values = true, value_parser = crate::build::device_memory::parse_gib)]
    pub device_memory: Option<f64>,
    #[command(flatten)]
    pub parallel: ParallelFlags,
    #[command(flatten)]
    pub ac: AcFlags,
    /// With `--ac budget=<GiB>` or `memory_budget`: draw the Pareto frontier (saved activations
    /// vs modeled recompute time) into this SVG file
    #[arg(long, value_name = "FILE.svg")]
    pub ac_pareto: Option<PathBuf>,
    /// Draw the memory plan into this SVG file: every buffer's bytes over the step's schedule,
    /// per arena, with the planned peak marked (hover a buffer for its name)
    #[arg(long, value_name = "FILE.svg")]
    pub memory_svg: Option<PathBuf>,
    /// Verify the graph after every pass; a pass that breaks it is named
    #[arg(long)]
    pub verify_each: bool,
    /// Predict one step's timeline with the cost model, print step time, MFU and the share of
    /// each mesh dim's communication hidden behind compute, and write it as a Chrome/Perfetto trace
    #[arg(long, value_name = "FILE.json")]
    pub trace: Option<PathBuf>,
    /// The cost model `--trace` predicts with: `h100`, `h200` or a JSON file (`titanc simulate
    /// --calibrate` writes one)
    #[arg(long, value_name = "h100|h200|FILE", default_value = "h200")]
    pub cost_model: String,
}

/// `titanc simulate DIR`: predict a built artifact's step, compare it with a measured trace,
/// calibrate the cost model.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// The artifact directory (`titanc build -o DIR`)
    pub artifact: PathBuf,
    /// `h100`, `h200` or a cost model JSON file
    #[arg(long, value_name = "h100|h200|FILE", default_value = "h200")]
    pub cost_model: String,
    /// Write the predicted step as a Chrome/Perfetto trace
    #[arg(long, value_name = "FILE.json")]
    pub trace: Option<PathBuf>,
    /// A measured trace of this artifact (`titan-run --trace`): print predicted against measured
    /// time per kernel and for the step
    #[arg(long, value_name = "MEASURED.json")]
    pub compare: Option<PathBuf>,
    /// With `--compare`: fit the cost model's rates to the measured trace and write the model here
    #[arg(long, value_name = "OUT.json", requires = "compare")]
    pub calibrate: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct OptArgs {
    /// The graph file (a model graph, a training graph or a kernel graph)
    pub file: PathBuf,
    /// Passes to run, in order, separated by commas (`titanc passes` lists them)
    #[arg(long, value_name = "PASS,...", required = true)]
    pub passes: String,
    /// The device mesh to write into the graph's meta first, e.g. `tp=2,dp_shard=2`
    /// (dims dp_replicate, dp_shard, tp; the others are 1)
    #[arg(long, value_name = "DIM=N,...")]
    pub mesh: Option<String>,
    /// Verify the input and the graph after every pass; a pass that breaks it is named
    #[arg(long)]
    pub verify_each: bool,
    /// Print each pass's statistics to stderr
    #[arg(long)]
    pub stats: bool,
    /// Ask the `async-tp` pass to split collective-GEMM pairs (`auto` or `all`, as for `titanc build`)
    #[arg(long, value_name = "auto|all", num_args = 0..=1, default_missing_value = "auto")]
    pub async_tp: Option<String>,
    #[command(flatten)]
    pub train: TrainFlags,
    #[command(flatten)]
    pub ac: AcFlags,
    /// Write the IR to FILE instead of stdout
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

/// Activation checkpointing (they override `[activation_checkpoint]` of the job config).
#[derive(Debug, Default, Clone, Args)]
pub struct AcFlags {
    /// Activation checkpointing: none, full, selective (with --ac-selective-option) or
    /// budget=<GiB> (the per-rank memory the saved activations of all layers may take)
    #[arg(long, value_name = "MODE")]
    pub ac: Option<String>,
    /// With --ac selective: `op` (TorchTitan's op policy) or N (every N-th layer) [default: op]
    #[arg(long, value_name = "op|N")]
    pub ac_selective_option: Option<String>,
}

impl AcFlags {
    /// The policy the flags ask for; `None` when `--ac` is not given.
    pub fn policy(&self) -> Result<Option<AcPolicy>, CliError> {
        let usage = |m: String| CliError::Usage(m);
        let Some(mode) = self.ac.as_deref() else {
            return match &self.ac_selective_option {
                Some(_) => Err(usage("--ac-selective-option needs `--ac selective`".into())),
                None => Ok(None),
            };
        };
        if self.ac_selective_option.is_some() && mode != "selective" {
            return Err(usage(format!("--ac-selective-option only applies to `--ac selective`, not `--ac {mode}`")));
        }
        let policy = match mode {
            "none" => AcPolicy::None,
            "full" => AcPolicy::Full,
            "selective" => {
                AcPolicy::selective(self.ac_selective_option.as_deref().unwrap_or("op")).map_err(|e| usage(format!("--ac-selective-option: {e}")))?
            }
            other => match other.strip_prefix("budget=") {
                Some(g) => AcPolicy::budget_gib(g).map_err(|e| usage(format!("--ac {other}: {e}")))?,
                None => return Err(usage(format!("unknown --ac `{other}`; choose none, full, selective or budget=<GiB>"))),
            },
        };
        Ok(Some(policy))
    }
}

/// TorchTitan's parallel degrees (they override `[parallelism]` of the job config).
#[derive(Debug, Default, Clone, Args)]
pub struct ParallelFlags {
    /// Replicated data-parallel degree (DDP, or HSDP with --dp-shard)
    #[arg(long, allow_hyphen_values = true)]
    pub dp_replicate: Option<i64>,
    /// Sharded data-parallel degree (FSDP); -1 fills the rest of the world
    #[arg(long, allow_hyphen_values = true)]
    pub dp_shard: Option<i64>,
    /// Context-parallel degree
    #[arg(long, allow_hyphen_values = true)]
    pub cp: Option<i64>,
    /// Tensor-parallel degree (with sequence parallelism)
    #[arg(long, allow_hyphen_values = true)]
    pub tp: Option<i64>,
    /// Pipeline-parallel degree
    #[arg(long, allow_hyphen_values = true)]
    pub pp: Option<i64>,
    /// Expert-parallel degree (borrows ranks of dp_shard*cp*tp)
    #[arg(long, allow_hyphen_values = true)]
    pub ep: Option<i64>,
    /// Number of ranks the job runs on [default: the product of the degrees]
    #[arg(long, allow_hyphen_values = true)]
    pub world_size: Option<i64>,
    /// With tp > 1: all-gather the logits and compute the loss whole on every tp rank instead of
    /// the vocab-parallel cross-entropy (TorchTitan's `disable_loss_parallel`)
    #[arg(long)]
    pub disable_loss_parallel: bool,
    /// With dp_shard > 1: gather each layer's weight shards at the top of that layer instead of
    /// during the previous layer (turns the `prefetch-next-layer` pass off; saves one layer's
    /// gathered weights of memory, loses the cross-layer overlap)
    #[arg(long)]
    pub disable_prefetch_next_layer: bool,
    /// With tp > 1: async tensor parallelism (the `async-tp` pass): split the sequence-parallel
    /// all-gather->GEMM and GEMM->reduce-scatter pairs into ring micro-steps that overlap
    /// transfers with chunk GEMMs. `auto` (the default) splits the pairs whose chunks are large
    /// enough to pay; `all` every eligible pair. The build prints the decision for every pair
    #[arg(long, value_name = "auto|all", num_args = 0..=1, default_missing_value = "auto")]
    pub async_tp: Option<String>,
}

/// The mode of `--async-tp[=auto|all]`.
fn async_tp_mode(flag: Option<&str>) -> Result<Option<titan_passes::async_tp::AsyncTpMode>, CliError> {
    flag.map(|m| titan_passes::async_tp::AsyncTpMode::from_name(m).map_err(|e| CliError::Usage(format!("--async-tp: {e}")))).transpose()
}

impl ParallelFlags {
    pub fn request(&self) -> crate::parallel::ParallelRequest {
        crate::parallel::ParallelRequest {
            dp_replicate: self.dp_replicate,
            dp_shard: self.dp_shard,
            cp: self.cp,
            tp: self.tp,
            pp: self.pp,
            ep: self.ep,
            world_size: self.world_size,
            disable_loss_parallel: self.disable_loss_parallel.then_some(true),
            disable_prefetch_next_layer: self.disable_prefetch_next_layer.then_some(true),
        }
    }
}

#[derive(Debug, Args)]
pub struct FileArgs {
    /// The graph file
    pub file: PathBuf,
}

#[derive(Debug, Args)]
pub struct FmtArgs {
    /// The graph file
    pub file: PathBuf,
    /// Write the IR to FILE instead of stdout (may be the input file)
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

fn parse_preset(s: &str) -> Result<Preset, String> {
    s.parse::<Preset>().map_err(|e| e.to_string())
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    s.parse::<DType>()
}

/// Errors of the `titanc` commands.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Frontend(#[from] FrontendError),
    /// Parse or verification errors, already rendered with `file:line:col` and an excerpt.
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error(transparent)]
    Pass(#[from] PassError),
    /// A bad combination or value of command-line options.
    #[error("{0}")]
    Usage(String),
    #[error("cannot write `{file}`: {message}")]
    Write { file: String, message: String },
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(transparent)]
    JobConfig(#[from] JobConfigError),
    #[error(transparent)]
    Parallel(#[from] crate::parallel::ParallelError),
    /// Text, a tokenizer or shards that `titanc data` cannot use.
    #[error(transparent)]
    Data(#[from] titan_data::DataError),
    /// A pass produced a graph that does not verify: a compiler bug, not a user error.
    #[error("internal error: {what} does not verify (please report it):\n{errors}")]
    Internal { what: String, errors: String },
}

impl CliError {
    /// The text printed on stderr: source diagnostics as they are, others after `error: `.
    pub fn render(&self) -> String {
        match self {
            CliError::Source(e) => e.to_string(),
            other => format!("error: {other}"),
        }
    }
}

/// What a command prints.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    pub stdout: String,
    pub stderr: String,
}

/// Run one command.
pub fn execute(cli: &Cli) -> Result<Outcome, CliError> {
    match &cli.command {
        Command::New(a) => cmd_new(a),
        Command::Lower(a) => cmd_lower(a),
        Command::Verify(a) => cmd_verify(&a.file),
        Command::Fmt(a) => cmd_fmt(a),
        Command::Stats(a) => cmd_stats(&a.file),
        Command::Build(a) => cmd_build(a),
        Command::Opt(a) => cmd_opt(a),
        Command::Simulate(a) => cmd_simulate(a),
        Command::Passes => Ok(cmd_passes()),
        Command::Data(c) => crate::data_cmd::cmd_data(c),
    }
}

/// Parse `args` (the first is the program name) and run the command; `Err` for both bad
/// arguments (clap's message) and failed commands.
pub fn run_args<I, T>(args: I) -> Result<Outcome, CliError>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    execute(&parse_args(args)?)
}

/// Parse `args` (the first is the program name) as `titanc`'s command line; clap's message on error.
pub fn parse_args<I, T>(args: I) -> Result<Cli, CliError>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    Cli::try_parse_from(args).map_err(|e| CliError::Usage(e.to_string().trim_end().trim_start_matches("error: ").to_string()))
}

/// The configuration and graph-name suffix `titanc new` builds for these arguments.
pub fn new_config(a: &NewArgs) -> Result<(LlamaConfig, &'static str), CliError> {
    if !FAMILIES.contains(&a.family.to_ascii_lowercase().as_str()) {
        return Err(FrontendError::UnknownFamily(a.family.clone()).into());
    }
    let (mut cfg, name) = match (a.preset, &a.from_hf) {
        (Some(p), None) => (LlamaConfig::preset(p), p.name()),
        (None, Some(path)) => (load_hf_config(path)?, "custom"),
        _ => return Err(CliError::Usage("give exactly one of --preset and --from-hf".into())),
    };
    let overrides = a.overrides.to_overrides();
    overrides.apply(&mut cfg);
    match &a.from_hf {
        Some(path) => crate::hf::validate_hf_config(&cfg, path, !overrides.is_empty())?,
        None => cfg.validate()?,
    }
    Ok((cfg, name))
}

fn cmd_new(a: &NewArgs) -> Result<Outcome, CliError> {
    let (cfg, name) = new_config(a)?;
    let g = build_llama3(&cfg, name)?;
    let mut out = Outcome::default();
    if a.summary {
        out.stderr = model_stats(&g)?.to_string();
    }
    emit(a.output.as_deref(), print_graph(&g), &mut out)?;
    Ok(out)
}

impl LowerArgs {
    /// TorchTitan's defaults with the given flags applied, checked for sane ranges.
    pub fn train_options(&self) -> Result<TrainOptions, CliError> {
        self.train.checked()
    }
}

impl TrainFlags {
    /// TorchTitan's defaults with these flags applied, checked for sane ranges.
    pub fn checked(&self) -> Result<TrainOptions, CliError> {
        let mut o = TrainOptions::default();
        let bad = |m: String| Err(CliError::Usage(m));
        if let Some(lr) = self.lr {
            if !(lr.is_finite() && lr > 0.0) {
                return bad(format!("--lr {lr} must be a positive number such as 8e-4"));
            }
            o.lr = lr;
        }
        if let Some(w) = self.warmup_steps {
            o.warmup_steps = w;
        }
        if let Some(d) = self.decay_steps {
            o.decay_steps = d;
        }
        if let Some(d) = &self.decay {
            o.decay = match d.as_str() {
                "cosine" => DecayKind::Cosine,
                "linear" => DecayKind::Linear,
                "constant" => DecayKind::Constant,
                other => return bad(format!("unknown --decay `{other}`; choose one of: cosine, linear, constant")),
            };
        }
        if let Some(r) = self.min_lr_ratio {
            if !(0.0..=1.0).contains(&r) {
                return bad(format!("--min-lr-ratio {r} must be between 0 and 1"));
            }
            o.min_lr_ratio = r;
        }
        for (flag, v, dst) in [("--beta1", self.beta1, &mut o.beta1), ("--beta2", self.beta2, &mut o.beta2)] {
            if let Some(v) = v {
                if !(0.0..1.0).contains(&v) {
                    return bad(format!("{flag} {v} must be at least 0 and below 1, e.g. 0.9 or 0.95"));
                }
                *dst = v;
            }
        }
        if let Some(e) = self.eps {
            if !(e.is_finite() && e > 0.0) {
                return bad(format!("--eps {e} must be a positive number such as 1e-8"));
            }
            o.eps = e;
        }
        if let Some(w) = self.weight_decay {
            if !(w.is_finite() && w >= 0.0) {
                return bad(format!("--weight-decay {w} must be 0 or more, e.g. 0.1"));
            }
            o.weight_decay = w;
        }
        if let Some(r) = &self.float8 {
            let recipe = titan_ir::Float8Recipe::from_name(r).map_err(|e| CliError::Usage(format!("--float8: {e}")))?;
            let opts = titan_passes::float8::Float8Options::new(recipe);
            let opts = match &self.float8_filter {
                Some(list) => opts.with_filter_list(list),
                None => opts,
            };
            o.float8 = Some(if self.enable_fsdp_float8_all_gather {
                opts.with_fsdp_all_gather(self.precompute_float8_dynamic_scale_for_fsdp)
                    .map_err(|e| CliError::Usage(format!("--enable-fsdp-float8-all-gather: {e}")))?
            } else {
                opts
            });
        }
        if let Some(m) = self.max_norm {
            if !(m.is_finite() && m >= 0.0) {
                return bad(format!("--max-norm {m} must be 0 (no clipping) or a positive number such as 1.0"));
            }
            o.max_norm = if m == 0.0 { None } else { Some(m) };
        }
        Ok(o)
    }
}

fn cmd_lower(a: &LowerArgs) -> Result<Outcome, CliError> {
    if !LOWER_TARGETS.contains(&a.to.as_str()) {
        return Err(CliError::Usage(format!("unknown lowering target `{}`; choose one of: {}", a.to, LOWER_TARGETS.join(", "))));
    }
    let opts = a.train_options()?;
    let mut g = load_graph(&a.file)?;
    crate::build::check_model_graph(&g, &format!("`{}`", a.file.display()))?;
    let request = a.parallel.request();
    let dims = crate::parallel::ParallelDims::resolve(&request)?;
    if dims.world_size > 1 {
        dims.check_model(&g)?;
        dims.spmd_mesh()?.write_meta(&mut g);
        if request.disable_loss_parallel == Some(true) {
            titan_passes::shard_tp::disable_loss_parallel(&mut g);
        }
        if request.disable_prefetch_next_layer == Some(true) {
            titan_passes::prefetch_next_layer::disable_prefetch_next_layer(&mut g);
        }
    }
    if let Some(mode) = async_tp_mode(a.parallel.async_tp.as_deref())? {
        let opts = BuildOptions { mesh: dims.spmd_mesh()?, async_tp: Some(mode), ..BuildOptions::default() };
        crate::build::check_async_tp(&opts)?;
        titan_passes::async_tp::enable_async_tp(&mut g, mode);
    }
    if let Some(policy) = a.ac.policy()? {
        policy.write_meta(&mut g);
    }
    let lowered = if a.to == "eval" { titan_passes::lower_to_eval(&g, &opts)? } else { lower_to_train(&g, &opts)? };
    let errors = titan_ir::verify::verify(&lowered);
    if !errors.is_empty() {
        let errors = errors.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n");
        return Err(CliError::Internal { what: format!("the {} graph", if a.to == "eval" { "eval" } else { "training" }), errors });
    }
    let mut out = Outcome::default();
    emit(a.output.as_deref(), print_graph(&lowered), &mut out)?;
    Ok(out)
}

fn cmd_verify(file: &Path) -> Result<Outcome, CliError> {
    let g = load_graph(file)?;
    let nodes = g.main.order.len();
    let blocks = g.blocks.len();
    let plural = |n: usize, w: &str| if n == 1 { format!("{n} {w}") } else { format!("{n} {w}s") };
    Ok(Outcome { stdout: format!("ok: {} in main, {}\n", plural(nodes, "node"), plural(blocks, "block")), stderr: String::new() })
}

fn cmd_fmt(a: &FmtArgs) -> Result<Outcome, CliError> {
    let g = load_graph(&a.file)?;
    let mut out = Outcome::default();
    emit(a.output.as_deref(), print_graph(&g), &mut out)?;
    Ok(out)
}

fn cmd_stats(file: &Path) -> Result<Outcome, CliError> {
    let g = load_graph(file)?;
    Ok(Outcome { stdout: model_stats(&g)?.to_string(), stderr: String::new() })
}

impl BuildArgs {
    /// The build options these arguments (and the job config, if any) ask for.
    pub fn build_options(&self, job: Option<&JobConfig>) -> Result<BuildOptions, CliError> {
        let train = self.train.resolve(job)?;
        let dump_after = match self.dump_after.as_deref() {
            None => DumpAfter::None,
            Some("all") => DumpAfter::All,
            Some(pass) => {
                titan_passes::lookup_passes(&[pass])?;
                DumpAfter::Pass(pass.to_string())
            }
        };
        let target = match self.target.as_str() {
            "sm_90a" => Target::sm90a(),
            other => {
                return Err(CliError::Usage(format!("unsupported --target `{other}`; titan generates code for {} (H100/H200)", TARGETS.join(", "))));
            }
        };
        Ok(BuildOptions {
            train,
            pipeline: PipelineOptions { verify_each: self.verify_each, dump_after, timings: self.timings },
            target,
            report: self.report,
            mesh: titan_ir::Mesh::new(1, 1, 1),
            loss_parallel: true,
            prefetch_next_layer: true,
            ac: AcPolicy::None,
            async_tp: None,
        })
    }
}

fn cmd_build(a: &BuildArgs) -> Result<Outcome, CliError> {
    let file = a.file.display().to_string();
    let job = a.job_config.as_deref().map(JobConfig::load).transpose()?;
    let request = a.parallel.request().over(job.as_ref().map(|j| j.parallelism).unwrap_or_default());
    let dims = crate::parallel::ParallelDims::resolve(&request)?;
    // The job config's `local_batch_size` is per data-parallel rank.
    let dp = u64::from(dims.dp_replicate) * u64::from(dims.dp_shard);
    let text = match std::fs::read_to_string(&a.file) {
        Ok(text) => text,
        Err(e) => model_of_preset_name(&file, job.as_ref(), dp)?.ok_or_else(|| FrontendError::Io { file: file.clone(), message: e.to_string() })?,
    };
    let (parsed, map) = titan_ir::parse_and_verify_with_map(&file, &text)?;
    let mut model = parsed.clone();
    model.canonicalize();
    // Pass errors can point into the file when the build's graph kept the parsed ids.
    let map = (model == parsed).then_some(map);
    crate::build::check_model_graph(&model, &format!("`{file}`"))?;
    if let Some(j) = &job {
        j.check_model(&model, dp)?;
    }
    dims.check_model(&model)?;
    dims.require_built()?;
    let mut opts = a.build_options(job.as_ref())?;
    opts.mesh = dims.spmd_mesh()?;
    opts.loss_parallel = !request.disable_loss_parallel.unwrap_or(false);
    opts.prefetch_next_layer = !request.disable_prefetch_next_layer.unwrap_or(false);
    opts.async_tp = async_tp_mode(a.parallel.async_tp.as_deref())?;
    // The job config's `enable_async_tensor_parallel = true` is `--async-tp` (auto); like
    // TorchTitan, it does nothing without tensor parallelism (said once, not refused).
    let mut async_tp_note = None;
    if let Some(j) = job.as_ref().filter(|_| opts.async_tp.is_none()) {
        let (mode, note) = j.async_tp(opts.mesh.size(titan_ir::MeshDim::Tp));
        opts.async_tp = mode;
        async_tp_note = note.map(|n| format!("note: {n}\n"));
    }
    opts.ac = a.ac.policy()?.or(job.as_ref().and_then(|j| j.activation_checkpoint)).unwrap_or(AcPolicy::None);
    if a.ac_pareto.is_some() && !matches!(opts.ac, AcPolicy::Budget(_)) {
        return Err(CliError::Usage(format!("--ac-pareto draws the frontier of a memory budget (`--ac budget=<GiB>`), not of `{}`", opts.ac)));
    }
    let summary = build_artifact(&model, &text, &opts, &a.output).map_err(|e| match e {
        crate::build::BuildError::Pass(p) => locate_pass_error(p, &file, &text, map.as_ref()),
        other => other.into(),
    })?;
    let mut out = Outcome { stdout: summary.to_string(), stderr: String::new() };
    out.stderr.extend(crate::build::device_memory::memory_warning(&summary, &a.target, a.device_memory).map(|w| format!("warning: {w}\n")));
    for (pass, ir) in &summary.pipeline.dumps {
        out.stderr.push_str(&format!("// ---- IR after `{pass}` ----\n{ir}"));
    }
    if let Some(path) = &a.ac_pareto {
        let stats = summary.pipeline.stats("activation-checkpoint");
        let frontier =
            stats.and_then(|s| s.series("pareto")).ok_or_else(|| CliError::Usage("--ac-pareto: the model has no repeated block to checkpoint".into()))?;
        let chosen = stats.and_then(|s| s.series("chosen")).and_then(|c| c.first().copied());
        let svg = titan_passes::activation_checkpoint::pareto_svg(frontier, chosen);
        std::fs::write(path, svg).map_err(|e| CliError::Write { file: path.display().to_string(), message: e.to_string() })?;
        out.stdout.push_str(&format!("wrote the Pareto frontier to {}\n", path.display()));
    }
    if let Some(path) = &a.memory_svg {
        let path_json = a.output.join("manifest.json");
        let manifest = std::fs::read_to_string(&path_json)
            .map_err(|e| e.to_string())
            .and_then(|t| titan_ir::artifact::Manifest::from_json(&path_json.display().to_string(), &t).map_err(|e| e.to_string()))
            .map_err(|e| CliError::Usage(format!("--memory-svg: {e}")))?;
        let svg = titan_ir::artifact::memory_svg::memory_svg(&manifest, 0, None);
        std::fs::write(path, svg).map_err(|e| CliError::Write { file: path.display().to_string(), message: e.to_string() })?;
        out.stdout.push_str(&format!("wrote the memory plan to {}\n", path.display()));
    }
    out.stdout.extend(async_tp_note);
    for note in job.iter().flat_map(JobConfig::notes) {
        out.stdout.push_str(&format!("note: {note}\n"));
    }
    if let Some(path) = &a.trace {
        let manifest = read_manifest(&a.output)?;
        out.stdout.push_str(&predict(&manifest, &a.cost_model, Some(path))?);
    }
    Ok(out)
}

fn read_manifest(dir: &std::path::Path) -> Result<titan_ir::artifact::Manifest, CliError> {
    let path = dir.join(titan_ir::artifact::MANIFEST_FILE);
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(&path).map_err(|e| FrontendError::Io { file: shown.clone(), message: e.to_string() })?;
    titan_ir::artifact::Manifest::from_json(&shown, &text).map_err(|e| CliError::Usage(e.to_string()))
}

fn cost_error(e: crate::cost::CostError) -> CliError {
    CliError::Usage(e.to_string())
}

/// The prediction of rank 0's step with `model`, written to `trace` when given.
fn predict(m: &titan_ir::artifact::Manifest, model: &str, trace: Option<&std::path::Path>) -> Result<String, CliError> {
    let c = crate::cost::CostModel::load(model).map_err(cost_error)?;
    let sim = crate::cost::simulate(m, 0, &c).map_err(cost_error)?;
    let mut s = sim.summary(&c.name);
    if let Some(path) = trace {
        crate::cost::write_trace(path, 0, &sim, &c.name).map_err(cost_error)?;
        s.push_str(&format!("wrote the predicted step's trace to {} (open it in Perfetto or chrome://tracing)\n", path.display()));
    }
    Ok(s)
}

fn cmd_simulate(a: &SimulateArgs) -> Result<Outcome, CliError> {
    let m = read_manifest(&a.artifact)?;
    let mut out = Outcome { stdout: predict(&m, &a.cost_model, a.trace.as_deref())?, stderr: String::new() };
    if let Some(path) = &a.compare {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| FrontendError::Io { file: shown.clone(), message: e.to_string() })?;
        let measured = titan_ir::artifact::timeline::read_chrome_trace(&text).map_err(|e| CliError::Usage(format!("`{shown}`: {e}")))?;
        let c = crate::cost::CostModel::load(&a.cost_model).map_err(cost_error)?;
        out.stdout.push_str(&crate::cost::compare(&m, 0, &c, &measured).map_err(cost_error)?.to_string());
        if let Some(dst) = &a.calibrate {
            let fitted = crate::cost::calibrate(&m, 0, &c, &measured).map_err(cost_error)?;
            std::fs::write(dst, fitted.to_json()).map_err(|e| CliError::Write { file: dst.display().to_string(), message: e.to_string() })?;
            out.stdout.push_str(&format!("calibrated:\n{}", crate::cost::compare(&m, 0, &fitted, &measured).map_err(cost_error)?));
            out.stdout.push_str(&format!("wrote the calibrated cost model to {}\n", dst.display()));
        }
    }
    Ok(out)
}

/// `titanc build 8B --job-config ...`: a model file argument that names no file but a flavor or
/// preset (`debugmodel`, `8B`, `70B`, `405B`, or titanc's preset names) builds that preset with
/// the job config's sequence length and its batch per data-parallel rank (`dp` ranks); `None`
/// for any other name.
fn model_of_preset_name(name: &str, job: Option<&JobConfig>, dp: u64) -> Result<Option<String>, CliError> {
    let Some(cfg) = JobConfig::preset_model(name, job, dp) else { return Ok(None) };
    let graph_name = format!("llama3_{}", name.to_ascii_lowercase());
    Ok(Some(crate::llama::model_ir(&cfg, &graph_name)?))
}

fn cmd_opt(a: &OptArgs) -> Result<Outcome, CliError> {
    let file = a.file.display().to_string();
    let text = std::fs::read_to_string(&a.file).map_err(|e| FrontendError::Io { file: file.clone(), message: e.to_string() })?;
    opt_on_text(a, &file, &text)
}

/// `titanc opt` on `text` (named `file` in messages) instead of the file `a` names: the
/// filetests run their cases through this, with the run line parsed as `titanc opt` arguments.
pub fn opt_on_text(a: &OptArgs, file: &str, text: &str) -> Result<Outcome, CliError> {
    use titan_passes::opt::{OptError, OptRequest, parse_mesh_spec, parse_pass_list, run_opt};
    let usage = |e: OptError| CliError::Usage(e.to_string());
    let req = OptRequest {
        passes: parse_pass_list(&a.passes).map_err(usage)?,
        mesh: a.mesh.as_deref().map(parse_mesh_spec).transpose().map_err(usage)?,
        verify_each: a.verify_each,
        train: a.train.checked()?,
        ac: a.ac.policy()?,
        async_tp: async_tp_mode(a.async_tp.as_deref())?,
    };
    let result = run_opt(file, text, &req).map_err(|e| match e {
        OptError::Source(s) => CliError::Source(s),
        OptError::Pass(p) => CliError::Pass(p),
        OptError::Usage(u) => CliError::Usage(u),
    })?;
    let mut out = Outcome::default();
    if a.stats {
        out.stderr = result.report.to_string();
    }
    emit(a.output.as_deref(), result.text, &mut out)?;
    Ok(out)
}

fn cmd_passes() -> Outcome {
    let table = titan_passes::pass_table();
    let width = table.iter().map(|p| p.name.len()).max().unwrap_or(0);
    let stdout = table.iter().map(|p| format!("{:<width$}  {}\n", p.name, p.summary)).collect();
    Outcome { stdout, stderr: String::new() }
}

/// A pass error of a build of `text` (the file `file`), pointing at its source line when it is
/// located on a part of the graph the pass still knew by its source id (`map`: the file's source
/// map, when the built graph kept the parsed ids).
fn locate_pass_error(e: PassError, file: &str, text: &str, map: Option<&titan_ir::SourceMap>) -> CliError {
    match e.source_diagnostic(map) {
        Some(diag) => CliError::Source(SourceError { file: file.to_string(), source_text: text.to_string(), diagnostics: vec![diag] }),
        None => e.into(),
    }
}

/// Read, parse and verify a graph file; every problem comes back rendered with its location.
pub fn load_graph(path: &Path) -> Result<Graph, CliError> {
    Ok(titan_ir::parse::parse_file(path)?)
}

/// Write `text` to `path`, or hand it to stdout.
fn emit(path: Option<&Path>, text: String, out: &mut Outcome) -> Result<(), CliError> {
    match path {
        Some(p) => std::fs::write(p, text).map_err(|e| CliError::Write { file: p.display().to_string(), message: e.to_string() }),
        None => {
            out.stdout = text;
            Ok(())
        }
    }
}
