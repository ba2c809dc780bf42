//! `titan-run`: train a model from its artifact (`titanc build model.ir -o DIR`), or from an
//! unfused training graph `.ir` (`titanc lower --to train`) in graph mode. The command line
//! lives in the library so the end-to-end tests can build the same program (`titan-run-e2e`)
//! and launch it as separate processes.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::checkpoint::{self, RunIdentity, TrainerState};
use crate::data::{Batch, Batches, DataSource, PackedBatches, PackedSpec, check_vocab, load_tokens};
use crate::dist::{DistEnv, ProcessGroup, ProcessMeshTrainer, RendezvousOptions};
use crate::log::{H200_MEMORY_BYTES, MetricsRecord, MetricsWriter, Progress, format_memory_check, format_startup, memory_summary};
use crate::nonfinite::{NonFiniteGuard, StepOutcome};
use crate::{
    Artifact, ArtifactMeshTrainer, Batcher, CpuArtifactTrainer, CpuTrainer, DataFormat, LogContext, MeshTrainer, Trainer, byte_tokens, format_step_with,
};
use anyhow::{Context, Result, bail};
use clap::Parser;

/// Run training steps of a titan artifact or training graph.
#[derive(Parser, Debug)]
#[command(name = "titan-run", version, about)]
struct Cli {
    /// An artifact directory (`titanc build model.ir -o DIR`), or a training-step graph `.ir`
    /// file (`titanc lower model.ir --to train`) to run unfused in graph mode.
    path: PathBuf,
    /// Total number of training steps (a resumed run continues up to it).
    #[arg(long, default_value_t = 100, value_parser = titan_ir::flags::positive::<u64>, allow_negative_numbers = true)]
    steps: u64,
    /// Data: a file of text tokenized byte by byte or of pre-tokenized tokens (see
    /// --data-format), batches sampled by seed; with --tokenizer, `.txt`/`.jsonl` text (a file, a
    /// directory or a glob); a directory or glob of llm.c `.bin` shards (`titanc data
    /// tokenize`). Tokenized text and shards are streamed and packed in order. The bundled
    /// corpus when omitted.
    #[arg(long)]
    data: Option<PathBuf>,
    /// A Hugging Face tokenizer.json to tokenize --data with; each document is put between the
    /// tokenizer's BOS and EOS.
    #[arg(long, value_name = "FILE", requires = "data")]
    tokenizer: Option<PathBuf>,
    /// With --tokenizer: the field of each `.jsonl` line that holds its text.
    #[arg(long, value_name = "NAME", default_value = "text", requires = "tokenizer")]
    text_field: String,
    /// How --data encodes its tokens: `auto` (llm.c when the file starts with its magic, else
    /// text), `text` (bytes), `u16` / `u32` (raw little-endian arrays, nanoGPT), `llmc`.
    #[arg(long, default_value = "auto")]
    data_format: String,
    /// Seed for parameter initialization and batch sampling (default 0; a resumed run uses the
    /// checkpoint's).
    #[arg(long, value_parser = titan_ir::flags::non_negative::<u64>, allow_negative_numbers = true)]
    seed: Option<u64>,
    /// Write one JSON object per step to this `.jsonl` file (appended to on --resume).
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Write checkpoints to CKPT/step-<n>/ (model.safetensors, optimizer.safetensors,
    /// trainer_state.json), after the last step and every --checkpoint-every steps.
    #[arg(long, value_name = "CKPT")]
    checkpoint_dir: Option<PathBuf>,
    /// Also write a checkpoint every K steps.
    #[arg(long, value_name = "K", value_parser = titan_ir::flags::positive::<u64>, allow_negative_numbers = true)]
    checkpoint_every: Option<u64>,
    /// Resume from a checkpoint: CKPT/step-<n>, or CKPT for its latest step.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Start from the parameters of a model.safetensors (Hugging Face Llama names; bf16, f16 or
    /// f32); the optimizer state starts at zero.
    #[arg(long, value_name = "FILE")]
    init_from: Option<PathBuf>,
    /// Resume from a checkpoint whose model hash differs from this run's (another model or
    /// training configuration with the same tensor shapes), or that has none; a checkpoint of the
    /// same model on another mesh or build resumes without it.
    #[arg(long)]
    allow_different_build: bool,
    /// Print every K-th step (the first and last are always printed).
    #[arg(long, default_value_t = 1, value_parser = titan_ir::flags::positive::<u64>, allow_negative_numbers = true)]
    log_every: u64,
    /// Execution backend: `cpu` (the reference executor) or `cuda` (one GPU, artifacts only).
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Print the time spent per kernel after the run (artifacts only).
    #[arg(long)]
    profile: bool,
    /// Write the measured timeline of the last profiled step to FILE as a Chrome/Perfetto trace,
    /// in the operations and names `titanc simulate --compare` reads (implies --profile;
    /// artifacts only). On a mesh of processes each rank writes `FILE` with `.rank<N>` before
    /// its extension.
    #[arg(long, value_name = "FILE.json")]
    trace: Option<PathBuf>,
    /// Write every step's tokens and targets to FILE: int32 little-endian, per step
    /// `[batch, seq]` tokens then `[batch, seq]` targets (see docs/checkpoints.md).
    #[arg(long, value_name = "FILE")]
    dump_batches: Option<PathBuf>,
    /// Run N processes on this host, one per rank of the SPMD graph (its mesh must have N
    /// ranks), torchrun-style; only rank 0 prints the step log. Under torchrun or Slurm
    /// (`WORLD_SIZE` / `SLURM_NTASKS` > 1) titan-run runs its own rank without this flag.
    #[arg(long, value_name = "N", value_parser = titan_ir::flags::positive::<usize>, allow_negative_numbers = true)]
    nproc_per_node: Option<usize>,
    /// With --nproc-per-node: the number of nodes of the run (torchrun's --nnodes); launch
    /// titan-run once on every node with its --node-rank and the same --master-addr/-port.
    #[arg(long, value_name = "M", requires = "nproc_per_node", value_parser = titan_ir::flags::positive::<usize>, allow_negative_numbers = true)]
    nnodes: Option<usize>,
    /// With --nnodes: this node's index, 0 to M-1 (node 0 runs rank 0, which listens at the
    /// master address).
    #[arg(long, value_name = "K", requires = "nnodes", value_parser = titan_ir::flags::non_negative::<usize>, allow_negative_numbers = true)]
    node_rank: Option<usize>,
    /// With --nnodes: the host of node 0, as the other nodes reach it.
    #[arg(long, value_name = "HOST", requires = "nnodes")]
    master_addr: Option<String>,
    /// With --nnodes: the port rank 0 listens on.
    #[arg(long, value_name = "PORT", requires = "nnodes", value_parser = titan_ir::flags::positive::<u16>, allow_negative_numbers = true)]
    master_port: Option<u16>,
    /// Skip a step whose loss or gradient norm is not finite instead of stopping: its update is
    /// undone (the states from before it are restored; cpu backend only) and it is counted and
    /// logged. Without it such a step stops the run with an error.
    #[arg(long)]
    skip_nonfinite_steps: bool,
    /// With --skip-nonfinite-steps: stop when more than this many steps in a row are skipped.
    #[arg(long, value_name = "N", requires = "skip_nonfinite_steps", default_value_t = crate::nonfinite::DEFAULT_MAX_CONSECUTIVE_SKIPS, value_parser = titan_ir::flags::non_negative::<u64>, allow_negative_numbers = true)]
    max_consecutive_skips: u64,
    /// Validation data, read like --data (with --tokenizer: text; a directory or glob: llm.c
    /// shards; one token file: batches sampled by seed): the artifact's eval step (forward and
    /// loss, no update) runs on --val-steps batches of it, from its start each time, at step 1
    /// and every --val-every steps. Job config: `[validation] dataset_path`.
    #[arg(long, value_name = "PATH")]
    val_data: Option<PathBuf>,
    /// Validate at step 1 and every N steps (`[validation] freq`).
    #[arg(long, value_name = "N", default_value_t = 10, requires = "val_data", value_parser = titan_ir::flags::positive::<u64>, allow_negative_numbers = true)]
    val_every: u64,
    /// Batches per validation, the validation loss being their mean; -1: the whole validation
    /// set once, read in order (`[validation] steps`, TorchTitan's -1).
    #[arg(long, value_name = "K", default_value = "1", requires = "val_data", value_parser = val_steps_flag, allow_negative_numbers = true)]
    val_steps: ValSteps,
    /// Seconds every rank waits for the others at the rendezvous of a multi-process run.
    #[arg(long, value_name = "SECS", default_value_t = 300, value_parser = titan_ir::flags::positive::<u64>, allow_negative_numbers = true)]
    rendezvous_timeout: u64,
    /// A TorchTitan job config (TOML): its runtime sections set the run ([training] steps, seed
    /// and dataset_path, [checkpoint], [metrics] log_freq, [profiling], [validation], [comm] timeouts, with
    /// job.dump_folder the root of the checkpoint folder and of metrics.jsonl); flags given on
    /// the command line override the file.
    #[arg(long, value_name = "TOML")]
    job_config: Option<PathBuf>,
    /// Keep only the newest K step directories of --checkpoint-dir (0 keeps all).
    #[arg(long, value_name = "K", requires = "checkpoint_dir", value_parser = titan_ir::flags::non_negative::<u64>, allow_negative_numbers = true)]
    keep_latest_k: Option<u64>,
    /// Make the last checkpoint a model-only export (no optimizer state, no trainer state; load
    /// it with --init-from), in --export-dtype.
    #[arg(long, requires = "checkpoint_dir")]
    last_save_model_only: bool,
    /// With --last-save-model-only: the dtype of the exported weights, `float32` (default),
    /// `bfloat16` or `float16`.
    #[arg(long, value_name = "DTYPE", requires = "last_save_model_only")]
    export_dtype: Option<String>,
    /// Seconds a collective (and, on the GPU, the watchdog's step) may take in a multi-process
    /// run before it fails [default: 600].
    #[arg(long, value_name = "SECS", value_parser = titan_ir::flags::positive::<u64>, allow_negative_numbers = true)]
    train_timeout: Option<u64>,
    /// After the run, draw the artifact's memory plan into this SVG file with the measured
    /// peak over it (the GPU's measured peak; on the cpu backend, the bytes its arenas allocate).
    #[arg(long, value_name = "FILE.svg")]
    memory_svg: Option<PathBuf>,
    /// After the run (and its checkpoints), run each kernel of 99% of the profiled step time back
    /// to back on the GPU, 1 s to settle then SECONDS measured, and print its time, energy (NVML's
    /// counter) and SM clock there: at a power cap a kernel's energy, not its burst time, is what
    /// it costs the step (implies --profile; one GPU, `--backend cuda`; before each kernel the step
    /// is replayed up to its first launch, so it runs on the operands it had in the step; the
    /// run's state is not used after).
    #[arg(long, value_name = "SECONDS", value_parser = positive_seconds, allow_negative_numbers = true)]
    kernel_energy: Option<f64>,
}

/// How much of the validation set one validation reads (`--val-steps`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ValSteps {
    /// The first K batches.
    Batches(u64),
    /// Every whole batch of the set, once, in order (`--val-steps -1`).
    All,
}

/// `--val-steps`: -1 or a count of at least 1.
fn val_steps_flag(s: &str) -> Result<ValSteps, String> {
    if s.trim() == "-1" {
        return Ok(ValSteps::All);
    }
    titan_ir::flags::positive::<u64>(s).map(ValSteps::Batches).map_err(|e| format!("{e}, or -1 for the whole validation set"))
}

/// `--memory-svg`: the plan of `artifact` with `measured` (bytes, what they are) over it.
fn write_memory_svg(cli: &Cli, artifact: &Artifact, bytes: u64, what: &str) -> Result<()> {
    let Some(path) = &cli.memory_svg else { return Ok(()) };
    let measured = titan_ir::artifact::memory_svg::MeasuredPeak { bytes, what: what.into() };
    let svg = titan_ir::artifact::memory_svg::memory_svg(&artifact.manifest, 0, Some(&measured));
    std::fs::write(path, svg).with_context(|| format!("cannot write --memory-svg `{}`", path.display()))?;
    eprintln!("titan-run: wrote the memory plan with the {what} to {}", path.display());
    Ok(())
}

/// `--export-dtype`'s value.
fn export_dtype(cli: &Cli) -> Result<checkpoint::ExportDtype> {
    Ok(match cli.export_dtype.as_deref() {
        None | Some("float32") => checkpoint::ExportDtype::F32,
        Some("bfloat16") => checkpoint::ExportDtype::BF16,
        Some("float16") => checkpoint::ExportDtype::F16,
        Some(other) => bail!("unknown --export-dtype `{other}`; choose float32, bfloat16 or float16"),
    })
}

/// The rendezvous options of a multi-process run: `--rendezvous-timeout` and `--train-timeout`.
fn rendezvous_options(cli: &Cli) -> RendezvousOptions {
    let d = RendezvousOptions::default();
    RendezvousOptions {
        join_timeout: std::time::Duration::from_secs(cli.rendezvous_timeout),
        collective_timeout: cli.train_timeout.map_or(d.collective_timeout, std::time::Duration::from_secs),
    }
}

/// Apply `--job-config`: every runtime setting of the file that no command-line flag (`given`)
/// sets. Prints the file's description and titan-run's "not honored" lines when `announce`.
fn apply_job_config(mut cli: Cli, given: &dyn Fn(&str) -> bool, announce: bool) -> Result<Cli> {
    let Some(path) = cli.job_config.clone() else { return Ok(cli) };
    let (job, notes) = titan_ir::job_config::RunSettings::load(&path).map_err(|e| anyhow::anyhow!("{e}"))?;
    if announce {
        if let Some(d) = &job.description {
            eprintln!("titan-run: job: {d} ({})", path.display());
        }
        for n in &notes {
            eprintln!("titan-run: note: {}: {n}", path.display());
        }
    }
    if !given("steps")
        && let Some(s) = job.steps
    {
        cli.steps = s;
    }
    if !given("seed") && job.seed.is_some() {
        cli.seed = job.seed;
    }
    if !given("data") && job.data.is_some() {
        cli.data = job.data.clone();
    }
    if !given("log_every")
        && let Some(f) = job.log_freq
    {
        cli.log_every = f;
    }
    if !given("profile") && job.profile {
        cli.profile = true;
    }
    if !given("rendezvous_timeout")
        && let Some(t) = job.init_timeout_s
    {
        cli.rendezvous_timeout = t;
    }
    if !given("train_timeout") && job.train_timeout_s.is_some() {
        cli.train_timeout = job.train_timeout_s;
    }
    if !given("metrics") {
        std::fs::create_dir_all(&job.dump_folder).with_context(|| format!("cannot create job.dump_folder `{}`", job.dump_folder.display()))?;
        cli.metrics = Some(job.metrics_file());
    }
    let v = &job.validation;
    if v.enable {
        if !given("val_data") {
            let data = v.data.clone().ok_or_else(|| {
                anyhow::anyhow!(
                    "{}: `validation.enable = true` needs a validation set titan-run can read: set `validation.dataset_path` (text or JSONL with --tokenizer, llm.c shards, or a token file) or pass --val-data",
                    path.display()
                )
            })?;
            cli.val_data = Some(data);
        }
        if !given("val_every") {
            cli.val_every = v.freq;
        }
        if !given("val_steps") {
            cli.val_steps = v.steps.map_or(ValSteps::All, ValSteps::Batches);
        }
    }
    let ck = &job.checkpoint;
    if ck.enable {
        // `--checkpoint-dir` replaces the folder only; the other keys still apply.
        let dir = match &cli.checkpoint_dir {
            Some(d) if given("checkpoint_dir") => d.clone(),
            _ => job.checkpoint_dir(),
        };
        // TorchTitan's interval default.
        if !given("checkpoint_every") {
            cli.checkpoint_every = Some(ck.interval.unwrap_or(500));
        }
        if !given("keep_latest_k") {
            cli.keep_latest_k = Some(ck.keep_latest_k);
        }
        if !given("last_save_model_only") && ck.last_save_model_only {
            cli.last_save_model_only = true;
            if !given("export_dtype") {
                cli.export_dtype = Some(
                    match ck.export_dtype {
                        checkpoint::ExportDtype::F32 => "float32",
                        checkpoint::ExportDtype::BF16 => "bfloat16",
                        checkpoint::ExportDtype::F16 => "float16",
                    }
                    .into(),
                );
            }
        }
        // TorchTitan loads `load_step`, or else the latest checkpoint of the folder if any.
        if !given("resume") && !given("init_from") {
            match ck.load_step {
                Some(n) => {
                    let step = checkpoint::step_dir(&dir, n);
                    if !step.join(checkpoint::STATE_FILE).is_file() {
                        bail!(
                            "{}: `checkpoint.load_step = {n}` but `{}` holds no checkpoint; use a step the run saved, or -1 for the latest",
                            path.display(),
                            step.display()
                        );
                    }
                    cli.resume = Some(step);
                }
                None if checkpoint::resolve(&dir).is_ok() => cli.resume = Some(dir.clone()),
                None => {}
            }
        }
        cli.checkpoint_dir = Some(dir);
    }
    Ok(cli)
}

/// `--kernel-energy`'s window: a finite number of seconds above zero, at most 60.
fn positive_seconds(s: &str) -> std::result::Result<f64, String> {
    let x: f64 = s.parse().map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !(x > 0.0 && x <= 60.0) {
        return Err(format!("{s} s: give a window above 0 and at most 60 seconds (1-2 s measures a kernel to about 1%)"));
    }
    Ok(x)
}

/// `--kernel-energy` runs kernels on one GPU only.
fn check_kernel_energy(cli: &Cli) -> Result<()> {
    if cli.kernel_energy.is_none() {
        return Ok(());
    }
    if cli.backend != "cuda" {
        bail!("--kernel-energy measures GPU kernels at the power cap; run with --backend cuda on a machine with an NVIDIA GPU");
    }
    if cli.nproc_per_node.is_some() {
        bail!("--kernel-energy is not supported yet on a mesh of processes; build the artifact for one GPU to measure its kernels");
    }
    Ok(())
}

fn check_backend(name: &str) -> Result<()> {
    match name {
        "cpu" => Ok(()),
        "cuda" => Ok(()),
        other => bail!("unknown backend `{other}`; use --backend cpu or --backend cuda"),
    }
}

/// Whether `path` names a graph file rather than an artifact directory.
fn is_graph_file(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "ir") && !path.is_dir()
}

/// The memory denominator of the log line: the device's memory on a GPU backend, none on the CPU.
fn log_context(trainer: &dyn Trainer, backend: &str) -> LogContext {
    LogContext { flops_per_token: trainer.flops_per_token(), device_memory_bytes: (backend != "cpu").then_some(H200_MEMORY_BYTES) }
}

/// `--skip-nonfinite-steps` restores every state after a skipped step, from a copy taken before
/// each step: on the cpu backends a copy in host memory; the cuda backend would copy every state
/// to the host and back around each step, so it refuses the flag rather than skip inexactly.
fn check_skip_flags(cli: &Cli) -> Result<()> {
    if cli.skip_nonfinite_steps && cli.backend == "cuda" {
        bail!(
            "--skip-nonfinite-steps is not supported with --backend cuda yet: undoing a step there would copy every state to the host before each step; drop the flag (a non-finite step then stops the run) or run on --backend cpu"
        );
    }
    Ok(())
}

/// Check the checkpoint flags before any work is done.
fn check_checkpoint_flags(cli: &Cli) -> Result<()> {
    export_dtype(cli)?;
    if cli.memory_svg.is_some() && (is_graph_file(&cli.path) || cli.nproc_per_node.is_some()) {
        bail!(
            "--memory-svg draws the memory plan of a single-device artifact; a training graph has no plan, and on a mesh it is not supported yet (use `titanc build --memory-svg` for the plan)"
        );
    }
    if cli.resume.is_some() && cli.init_from.is_some() {
        bail!("--resume restores the parameters already; drop --init-from (or --resume to start a new run from the weights)");
    }
    match (cli.checkpoint_every, &cli.checkpoint_dir) {
        (Some(0), _) => bail!("--checkpoint-every must be at least 1"),
        (Some(_), None) => bail!("--checkpoint-every needs --checkpoint-dir CKPT to write to"),
        _ => Ok(()),
    }
}

/// `--nproc-per-node N`: launch N copies of this program as the ranks of one host.
fn launch_local(n: usize, cli: &Cli) -> Result<()> {
    let env = DistEnv::from_process_env()?;
    if env.is_distributed() {
        bail!(
            "--nproc-per-node launches its own ranks, but this process is already rank {} of {} ({}); drop --nproc-per-node",
            env.rank,
            env.world_size,
            env.launcher.name()
        );
    }
    let nodes = match cli.nnodes {
        None | Some(1) if cli.node_rank.unwrap_or(0) == 0 => None,
        None | Some(1) => bail!("--node-rank {} needs --nnodes above it", cli.node_rank.unwrap_or(0)),
        Some(0) => bail!("--nnodes must be at least 1"),
        Some(nnodes) => {
            let (Some(node_rank), Some(addr), Some(port)) = (cli.node_rank, cli.master_addr.clone(), cli.master_port) else {
                bail!(
                    "--nnodes {nnodes} needs --node-rank (this node, 0 to {}), --master-addr (node 0's host) and --master-port, the same on every node",
                    nnodes - 1
                );
            };
            Some(crate::dist::launch::Nodes { nnodes, node_rank, master: (addr, port) })
        }
    };
    let program = std::env::current_exe().context("cannot find the titan-run executable to launch")?;
    // The same arguments, less the launcher's own (the children run one rank each).
    const LAUNCHER: [&str; 5] = ["--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port"];
    let mut args = Vec::new();
    let mut it = std::env::args_os().skip(1);
    while let Some(a) = it.next() {
        let text = a.to_string_lossy();
        if LAUNCHER.contains(&text.as_ref()) {
            it.next();
        } else if !LAUNCHER.iter().any(|f| text.starts_with(&format!("{f}="))) {
            args.push(a);
        }
    }
    crate::dist::launch::launch_local(n, nodes.as_ref(), &program, &args)?;
    Ok(())
}

/// Fingerprint of the run every rank must share: this build, the graph, the data and the seed.
fn run_identity(graph_identity: &str, data: &DataSource, seed: u64) -> String {
    let data = match data {
        DataSource::Sampled(tokens) => {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for t in tokens {
                for b in t.to_le_bytes() {
                    h ^= u64::from(b);
                    h = h.wrapping_mul(0x100_0000_01b3);
                }
            }
            format!("data-fnv1a:{h:016x} ({} tokens)", tokens.len())
        }
        DataSource::Packed(spec) => format!("data {}", spec.fingerprint()),
    };
    format!("titan-run {} {graph_identity} {data} seed {seed}", env!("CARGO_PKG_VERSION"))
}

/// This process is one rank of a multi-process run (torchrun, Slurm, `--nproc-per-node`): join
/// the rendezvous and run its rank of the SPMD graph (or artifact) with the TCP process group.
fn run_rank(cli: &Cli, env: &DistEnv, data: DataSource, data_name: &str) -> Result<()> {
    let (rank, world) = (env.rank, env.world_size);
    if cli.memory_svg.is_some() {
        bail!("--memory-svg is not supported yet on a mesh; `titanc build --memory-svg` draws the plan every rank runs");
    }
    if cli.backend != "cpu" && is_graph_file(&cli.path) {
        bail!(
            "graph mode (a `.ir` file) runs on the cpu backend only; build an SPMD artifact (`titanc build --tp/--dp-shard ...`) for --backend {}",
            cli.backend
        );
    }
    if !is_graph_file(&cli.path) {
        return run_artifact_rank(cli, env, data, data_name);
    }
    if cli.profiling() {
        bail!("--profile and --trace time the kernels of an artifact; build one with `titanc build --tp/--dp-shard ...` and pass its directory");
    }
    let graph_text = std::fs::read_to_string(&cli.path).with_context(|| format!("cannot read `{}`", cli.path.display()))?;
    let graph = titan_ir::parse_file(&cli.path).map_err(|e| anyhow::anyhow!("{e}"))?;
    let Some(mesh) = titan_ir::Mesh::from_graph(&graph).map_err(|e| anyhow::anyhow!("{e}"))? else {
        bail!(
            "WORLD_SIZE={world} but `{}` is a single-rank graph (no mesh in its meta); lower it with a mesh (`titanc lower --to train --tp N ...`) or run one process",
            cli.path.display()
        );
    };
    let [r, s, t] = mesh.sizes;
    if mesh.world_size() as usize != world {
        bail!(
            "WORLD_SIZE={world} but the graph's mesh has {} ranks (dp_replicate {r} x dp_shard {s} x tp {t}); launch {} processes",
            mesh.world_size(),
            mesh.world_size()
        );
    }
    let (addr, port) = env.master.clone().ok_or_else(|| anyhow::anyhow!("a multi-process run needs MASTER_ADDR and MASTER_PORT"))?;
    let seed = cli.seed.unwrap_or(0);
    let identity = run_identity(&checkpoint::graph_identity(&graph_text), &data, seed);
    let opts = rendezvous_options(cli);
    let group = std::sync::Arc::new(ProcessGroup::rendezvous(rank, world, (&addr, port), &identity, Vec::new(), opts)?);
    let made = ProcessMeshTrainer::new(&graph, seed, std::sync::Arc::clone(&group));
    let announce = |trainer: &ProcessMeshTrainer<'_>| {
        eprintln!(
            "titan-run: {} (graph mode, SPMD) on {world} cpu processes ({}, rendezvous {addr}:{port}; dp_replicate {r} x dp_shard {s} x tp {t}), global batch {} x seq {}, {} steps, data {data_name}",
            graph.name,
            env.launcher.name(),
            trainer.batch_size(),
            Trainer::seq_len(trainer),
            cli.steps
        )
    };
    run_in_group(&group, made, announce, cli, data, data_name, &RunIdentity::of_graph(&graph_text, &graph))
}

/// Run this rank (`made`) through the training: a failure is first told to the other ranks
/// (their next collective fails naming this rank), a clean end leaves the group; rank 0 logs,
/// and `announce`s the run.
fn run_in_group(
    group: &ProcessGroup,
    made: std::result::Result<ProcessMeshTrainer<'_>, crate::RuntimeError>,
    announce: impl FnOnce(&ProcessMeshTrainer<'_>),
    cli: &Cli,
    data: DataSource,
    data_name: &str,
    identity: &RunIdentity,
) -> Result<()> {
    let mut trainer = match made {
        Ok(t) => t,
        Err(e) => {
            group.abort(&e.to_string());
            return Err(e.into());
        }
    };
    let logger = group.rank() == 0;
    if cli.profiling()
        && let Err(e) = trainer.enable_profile()
    {
        group.abort(&e.to_string());
        return Err(e.into());
    }
    if logger {
        announce(&trainer);
        if cli.profiling() {
            eprintln!("titan-run: --profile: every rank times its kernels; rank 0 reports in full, the others in one line");
        }
    }
    if let Err(e) = train(&mut trainer, cli, data, data_name, identity, logger) {
        group.abort(&format!("{e:#}"));
        return Err(e);
    }
    if cli.profiling() {
        print_profile(&trainer, logger);
        write_trace(&trainer, cli, group.rank(), group.world_size())?;
    }
    group.finish()?;
    Ok(())
}

/// This process is one rank of a multi-process run of an SPMD artifact: the artifact's one
/// schedule on the cpu backend, its collective steps over the TCP process group.
fn run_artifact_rank(cli: &Cli, env: &DistEnv, data: DataSource, data_name: &str) -> Result<()> {
    let (rank, world) = (env.rank, env.world_size);
    let artifact = Artifact::load(&cli.path)?;
    let m = &artifact.manifest;
    if m.mesh.world_size as usize != world {
        let dims: Vec<String> = m.mesh.dims.iter().map(|d| format!("{} {}", d.name, d.size)).collect();
        bail!(
            "WORLD_SIZE={world} but the artifact is built for {} rank(s){}; launch {} processes (or rebuild it with `titanc build --tp/--dp-shard ...` for {world})",
            m.mesh.world_size,
            if dims.is_empty() { String::new() } else { format!(" ({})", dims.join(" x ")) },
            m.mesh.world_size
        );
    }
    let (addr, port) = env.master.clone().ok_or_else(|| anyhow::anyhow!("a multi-process run needs MASTER_ADDR and MASTER_PORT"))?;
    let seed = cli.seed.unwrap_or(0);
    let identity = run_identity(&format!("artifact {}", m.content_hash), &data, seed);
    let opts = rendezvous_options(cli);
    let step_timeout = opts.collective_timeout;
    let cuda = cli.backend == "cuda";
    // On the GPU, rank 0 hands every rank the NCCL unique id through the rendezvous.
    let payload = if cuda && rank == 0 { crate::dist::nccl::unique_id_payload()? } else { Vec::new() };
    let group = std::sync::Arc::new(ProcessGroup::rendezvous(rank, world, (&addr, port), &identity, payload, opts)?);
    let made = if cuda {
        ProcessMeshTrainer::for_cuda_artifact(&artifact, seed, std::sync::Arc::clone(&group), env.local_rank, step_timeout)
    } else {
        ProcessMeshTrainer::for_artifact(&artifact, seed, std::sync::Arc::clone(&group))
    };
    let announce = |trainer: &ProcessMeshTrainer<'_>| {
        eprintln!(
            "titan-run: artifact {} (SPMD, {} launches and {} collectives per step per rank) on {world} {} processes ({}, rendezvous {addr}:{port}), global batch {} x seq {}, {} steps, data {data_name}",
            cli.path.display(),
            artifact.launches_per_step(),
            artifact.collectives_per_step(),
            cli.backend,
            env.launcher.name(),
            trainer.batch_size(),
            Trainer::seq_len(trainer),
            cli.steps
        )
    };
    run_in_group(&group, made, announce, cli, data, data_name, &RunIdentity::of_artifact(&artifact))
}

/// What `--data`, `--data-format`, `--tokenizer` and `--text-field` name.
fn data_source(cli: &Cli) -> Result<DataSource> {
    data_source_at(cli, cli.data.as_deref())
}

/// [`data_source`] for the data at `data` (`--data`, or `--val-data`).
fn data_source_at(cli: &Cli, data: Option<&Path>) -> Result<DataSource> {
    let format = DataFormat::parse(&cli.data_format)?;
    if let Some(tokenizer) = &cli.tokenizer {
        if format != DataFormat::Auto {
            bail!("--data-format {} says how a token file is encoded; text read with --tokenizer takes none, drop it", format.name());
        }
        let data = data.expect("invariant: clap requires --data with --tokenizer");
        return Ok(DataSource::Packed(PackedSpec::text(data, tokenizer, &cli.text_field)?));
    }
    Ok(match data {
        Some(p) if p.is_dir() || p.to_string_lossy().contains(['*', '?', '[']) => {
            if !matches!(format, DataFormat::Auto | DataFormat::Llmc) {
                bail!("a directory or glob of --data is read as llm.c token shards; --data-format {} applies to one file only", format.name());
            }
            DataSource::Packed(PackedSpec::Shards { path: p.to_path_buf() })
        }
        Some(p) if p.extension().is_some_and(|e| e == "jsonl") => {
            bail!(
                "`{}` is JSON Lines: pass --tokenizer tokenizer.json to tokenize its `text` field (byte-level training would read the JSON syntax as text)",
                p.display()
            )
        }
        Some(p) => DataSource::Sampled(load_tokens(p, format)?),
        None => DataSource::Sampled(byte_tokens(crate::BUNDLED_CORPUS.as_bytes())),
    })
}

/// `--val-data` runs an artifact's eval step (every backend, one device, the simulated mesh or
/// one process per rank); a training graph has none: refuse it before anything starts.
fn check_val_flags(cli: &Cli) -> Result<()> {
    if cli.val_data.is_some() && is_graph_file(&cli.path) {
        bail!("--val-data runs the eval step of an artifact; graph mode (a training graph .ir) has none: build an artifact with `titanc build` and run that");
    }
    Ok(())
}

/// Validation: the eval step on `--val-steps` batches of `--val-data`, from its start (or on
/// every whole batch of it, in order, with `--val-steps -1`).
struct Validator {
    source: DataSource,
    every: u64,
    steps: ValSteps,
    seed: u64,
}

/// One validation's result, in TorchTitan's metric names (plus the perplexity).
#[derive(serde::Serialize)]
struct ValidationRecord {
    step: u64,
    #[serde(rename = "validation_metrics/loss")]
    loss: f64,
    #[serde(rename = "validation_metrics/perplexity")]
    perplexity: f64,
    #[serde(rename = "validation_metrics/throughput(tps)")]
    tokens_per_s: f64,
    /// Batches the loss is the mean of.
    batches: u64,
    wall_s: f64,
}

/// The validation batches of one validation: sampled by seed, packed in order, or (the whole
/// set) consecutive windows read once.
enum ValBatches {
    Sampled(Batcher),
    Packed(Box<PackedBatches>),
    /// `--val-steps -1` on tokens held in memory: non-overlapping windows of `seq + 1` tokens
    /// in order, `batch` per batch, the last partial batch dropped.
    InOrder {
        tokens: Vec<u32>,
        batch: usize,
        seq: usize,
        next: usize,
    },
}

impl ValBatches {
    fn next(&mut self) -> Result<Option<Batch>> {
        Ok(match self {
            ValBatches::Sampled(b) => Some(b.next_batch()),
            ValBatches::Packed(p) => p.try_next_batch()?,
            ValBatches::InOrder { tokens, batch, seq, next } => {
                let w = *seq + 1;
                if (*next + *batch) * w > tokens.len() {
                    return Ok(None);
                }
                let (mut t, mut y) = (Vec::with_capacity(*batch * *seq), Vec::with_capacity(*batch * *seq));
                for r in *next..*next + *batch {
                    let win = &tokens[r * w..(r + 1) * w];
                    t.extend(win[..*seq].iter().map(|&x| i64::from(x)));
                    y.extend(win[1..].iter().map(|&x| i64::from(x)));
                }
                *next += *batch;
                Some(Batch { tokens: t, targets: y })
            }
        })
    }
}

impl Validator {
    /// TorchTitan's rule: step 1 and every `freq` steps.
    fn due(&self, step: u64) -> bool {
        step == 1 || step.is_multiple_of(self.every)
    }

    /// The mean eval loss over the validation batches.
    fn run(&self, trainer: &mut dyn Trainer, step: u64, wall_s: f64) -> Result<ValidationRecord> {
        let started = std::time::Instant::now();
        let (b, q, v) = (trainer.batch_size(), trainer.seq_len(), trainer.vocab_size());
        let whole = self.steps == ValSteps::All;
        let mut batches = match (&self.source, whole) {
            (DataSource::Sampled(tokens), false) => ValBatches::Sampled(Batcher::new(tokens.clone(), b, q, self.seed).map_err(anyhow::Error::msg)?),
            (DataSource::Sampled(tokens), true) => ValBatches::InOrder { tokens: tokens.clone(), batch: b, seq: q, next: 0 },
            (DataSource::Packed(spec), false) => ValBatches::Packed(Box::new(PackedBatches::open(spec, b, q, v, &Default::default())?)),
            (DataSource::Packed(spec), true) => ValBatches::Packed(Box::new(PackedBatches::open_once(spec, b, q, v)?)),
        };
        let (mut sum, mut n) = (0.0, 0u64);
        loop {
            if let ValSteps::Batches(k) = self.steps
                && n >= k
            {
                break;
            }
            let Some(batch) = batches.next()? else { break };
            sum += trainer.eval_loss(&batch).context("validation")?;
            n += 1;
        }
        if n == 0 {
            bail!("--val-data holds less than one batch of {b} x (seq_len {q} + 1) tokens; use a larger validation set");
        }
        let loss = sum / n as f64;
        let tokens = n as f64 * (b * q) as f64;
        Ok(ValidationRecord { step, loss, perplexity: loss.exp(), tokens_per_s: tokens / started.elapsed().as_secs_f64().max(1e-9), batches: n, wall_s })
    }
}

/// The validation line in TorchTitan's shape: `validate step:  10  loss:  2.4521  perplexity: 11.6  memory: ...  tps: ...`.
fn format_validation(r: &ValidationRecord, peak_bytes: Option<u64>) -> String {
    let mut line = format!("validate step: {:>2}  loss: {:>7.4}  perplexity: {:.4}", r.step, r.loss, r.perplexity);
    if let Some(p) = peak_bytes {
        line.push_str(&format!("  memory: {}(predicted)", crate::artifact::format_bytes(p).replace(' ', "")));
    }
    line.push_str(&format!("  tps: {}", crate::log::with_commas(r.tokens_per_s)));
    line
}

fn run(cli: Cli) -> Result<()> {
    let started = std::time::Instant::now();
    check_backend(&cli.backend)?;
    check_checkpoint_flags(&cli)?;
    check_skip_flags(&cli)?;
    check_val_flags(&cli)?;
    check_kernel_energy(&cli)?;
    if let Some(n) = cli.nproc_per_node {
        return launch_local(n, &cli);
    }
    let env = DistEnv::from_process_env()?;
    let data = data_source(&cli)?;
    let data_name = cli.data.as_ref().map_or("bundled corpus".to_string(), |p| p.display().to_string());
    if env.is_distributed() {
        if cli.kernel_energy.is_some() {
            bail!("--kernel-energy is not supported yet on a mesh of processes; build the artifact for one GPU to measure its kernels");
        }
        return run_rank(&cli, &env, data, &data_name);
    }
    let seed = cli.seed.unwrap_or(0);
    if is_graph_file(&cli.path) {
        if cli.backend == "cuda" {
            bail!("graph mode (a `.ir` file) runs on the cpu backend only; build an artifact with `titanc build` for --backend cuda");
        }
        if cli.profiling() {
            bail!("--profile and --trace time the kernels of an artifact; build one with `titanc build` and pass its directory");
        }
        let graph_text = std::fs::read_to_string(&cli.path).with_context(|| format!("cannot read `{}`", cli.path.display()))?;
        let graph = titan_ir::parse_file(&cli.path).map_err(|e| anyhow::anyhow!("{e}"))?;
        if let Some(mesh) = titan_ir::Mesh::from_graph(&graph).map_err(|e| anyhow::anyhow!("{e}"))?
            && mesh.world_size() > 1
        {
            let mut trainer = MeshTrainer::new(&graph, seed)?;
            let [r, s, t] = mesh.sizes;
            eprintln!(
                "titan-run: {} (graph mode, SPMD) on a simulated cpu mesh of {} ranks (dp_replicate {r} x dp_shard {s} x tp {t}), global batch {} x seq {}, {} steps, data {data_name}",
                graph.name,
                mesh.world_size(),
                trainer.batch_size(),
                Trainer::seq_len(&trainer),
                cli.steps
            );
            return train(&mut trainer, &cli, data, &data_name, &RunIdentity::of_graph(&graph_text, &graph), true);
        }
        let mut trainer = CpuTrainer::new(&graph, seed)?;
        eprintln!(
            "titan-run: {} (graph mode, unfused) on the cpu backend, batch {} x seq {}, {} steps, data {data_name}",
            graph.name,
            trainer.batch_size(),
            trainer.seq_len(),
            cli.steps
        );
        return train(&mut trainer, &cli, data, &data_name, &RunIdentity::of_graph(&graph_text, &graph), true);
    }
    if cli.path.is_file() {
        bail!("`{}` is neither an artifact directory nor a `.ir` training graph; pass the directory `titanc build -o DIR` wrote", cli.path.display());
    }
    let loading = std::time::Instant::now();
    let artifact = Artifact::load(&cli.path)?;
    let load_s = loading.elapsed().as_secs_f64();
    let m = &artifact.manifest;
    if m.mesh.world_size > 1 {
        let dims: Vec<String> = m.mesh.dims.iter().map(|d| format!("{} {}", d.name, d.size)).collect();
        if cli.backend == "cuda" {
            bail!(
                "the artifact is built for a mesh of {} ranks ({}): on the GPU it runs one process per GPU, `titan-run {} --backend cuda --nproc-per-node {}` (or torchrun / srun); --backend cpu runs it on the simulated mesh",
                m.mesh.world_size,
                dims.join(" x "),
                cli.path.display(),
                m.mesh.world_size
            );
        }
        if cli.profiling() {
            bail!("--profile is not supported yet on a simulated mesh; build the artifact without a mesh to profile its kernels");
        }
        if cli.memory_svg.is_some() {
            bail!("--memory-svg is not supported yet on a mesh; `titanc build --memory-svg` draws the plan every rank runs");
        }
        let mut trainer = ArtifactMeshTrainer::new(&artifact, seed)?;
        eprintln!(
            "titan-run: artifact {} ({} kernels, {} launches and {} collectives per step per rank, target {}) on a simulated cpu mesh of {} ranks ({}), global batch {} x seq {}, {} steps, data {data_name}",
            cli.path.display(),
            m.kernels.len(),
            artifact.launches_per_step(),
            artifact.collectives_per_step(),
            m.target.arch,
            m.mesh.world_size,
            dims.join(" x "),
            trainer.batch_size(),
            Trainer::seq_len(&trainer),
            cli.steps
        );
        eprintln!("titan-run: per rank: {}", memory_summary(&artifact));
        return train(&mut trainer, &cli, data, &data_name, &RunIdentity::of_artifact(&artifact), true);
    }
    if cli.backend == "cuda" {
        return run_cuda(&cli, &artifact, data, &data_name, started, load_s);
    }
    let mut trainer = CpuArtifactTrainer::new(&artifact, seed)?;
    if cli.profiling() {
        trainer.enable_profile();
    }
    let m = &artifact.manifest;
    eprintln!(
        "titan-run: artifact {} ({} kernels, {} launches per step, target {}) on the cpu backend, batch {} x seq {}, {} steps, data {data_name}",
        cli.path.display(),
        m.kernels.len(),
        artifact.launches_per_step(),
        m.target.arch,
        trainer.batch_size(),
        trainer.seq_len(),
        cli.steps
    );
    if let Some(line) = crate::log::switches_summary(m) {
        eprintln!("titan-run: {line}");
    }
    eprintln!("titan-run: {}", memory_summary(&artifact));
    train(&mut trainer, &cli, data, &data_name, &RunIdentity::of_artifact(&artifact), true)?;
    if cli.profiling() {
        print_profile(&trainer, true);
        write_trace(&trainer, &cli, 0, 1)?;
    }
    write_memory_svg(&cli, &artifact, trainer.allocated_bytes(), "bytes the cpu backend allocated for the arenas")?;
    Ok(())
}

/// After a `--profile` run: the backend's report (`full` in a single process and on rank 0; one
/// line on the other ranks), or why there is none.
fn print_profile(trainer: &dyn Trainer, full: bool) {
    match trainer.profile_report(full) {
        Some(r) => eprint!("{r}"),
        None if full => eprintln!("titan-run: --profile: no profiled step to report (the GPU does not count the first); run at least 2 steps"),
        None => {}
    }
}

/// Run steps up to `--steps`, resuming or loading weights first, logging every step and
/// writing checkpoints. `identity` is the build's (checked on resume, written into checkpoints). Only the
/// `logger` prints steps and writes metrics and batch dumps (rank 0 of a multi-process run).
fn train(trainer: &mut dyn Trainer, cli: &Cli, data: DataSource, data_name: &str, identity: &RunIdentity, logger: bool) -> Result<()> {
    match &data {
        DataSource::Sampled(tokens) => check_vocab(tokens, trainer.vocab_size())?,
        DataSource::Packed(spec) => spec.check_vocab(trainer.vocab_size())?,
    }
    let mut seed = cli.seed.unwrap_or(0);
    let mut data_position = 0;
    let mut data_stream = None;
    if let Some(path) = &cli.resume {
        let (dir, state) = checkpoint::resume(path, trainer, identity, cli.allow_different_build)?;
        if let Some(s) = cli.seed
            && s != state.seed
        {
            bail!("--seed {s} differs from the checkpoint's seed {}; drop --seed to resume the same run", state.seed);
        }
        if state.step >= cli.steps {
            bail!("the checkpoint is at step {} already; pass --steps with the total number of steps, more than {}", state.step, state.step);
        }
        seed = state.seed;
        data_position = state.data_position;
        data_stream = state.data_stream.clone();
        match (&data, &data_stream) {
            (DataSource::Packed(_), None) => bail!(
                "the checkpoint was written by a run whose batches were sampled by seed (byte-level text or one token file), not packed from a stream; resume with the data it was written with ({})",
                state.data
            ),
            (DataSource::Sampled(_), Some(p)) => {
                bail!("the checkpoint was written by a run over packed data, next at {p}; resume with the same --data and --tokenizer ({})", state.data)
            }
            _ => {}
        }
        if logger {
            // Checked by `resume` already: this only says what was resumed across.
            if let Ok(Some(note)) = checkpoint::check_identity(&state, identity, checkpoint::run_mesh(trainer), cli.allow_different_build) {
                eprintln!("titan-run: {note}");
            }
            eprintln!("titan-run: resumed from {} at step {}", dir.display(), state.step);
        }
    }
    if let Some(path) = &cli.init_from {
        checkpoint::init_from(path, trainer)?;
        if logger {
            eprintln!("titan-run: parameters loaded from {}; optimizer state starts at zero", path.display());
        }
    }
    let mut batches = match data {
        DataSource::Sampled(tokens) => {
            let mut batcher = Batcher::new(tokens, trainer.batch_size(), trainer.seq_len(), seed).map_err(anyhow::Error::msg)?;
            batcher.seek(data_position);
            Batches::Sampled(batcher)
        }
        DataSource::Packed(spec) => {
            let start = data_stream.unwrap_or_default();
            let packed = PackedBatches::open(&spec, trainer.batch_size(), trainer.seq_len(), trainer.vocab_size(), &start)?;
            if logger {
                eprintln!("titan-run: data: {}", packed.describe());
            }
            Batches::Packed(Box::new(packed))
        }
    };
    let mut batch_index = data_position;
    let ctx = log_context(trainer, &cli.backend);
    let mut metrics = match &cli.metrics {
        Some(p) if logger => Some(MetricsWriter::create(p, cli.resume.is_some())?),
        _ => None,
    };
    let mut dump = cli.dump_batches.as_deref().filter(|_| logger).map(crate::data::BatchDump::create).transpose()?;
    let first = trainer.steps_done() + 1;
    let steps = cli.steps + 1 - first.min(cli.steps + 1);
    let progress = if logger { Progress::new(steps) } else { Progress::with_visibility(steps, false) };
    let started = std::time::Instant::now();
    let mut guard = NonFiniteGuard::new(cli.skip_nonfinite_steps.then_some(cli.max_consecutive_skips));
    let validator = match &cli.val_data {
        Some(p) => {
            let source = data_source_at(cli, Some(p)).context("--val-data")?;
            match &source {
                DataSource::Sampled(tokens) => check_vocab(tokens, trainer.vocab_size()).context("--val-data")?,
                DataSource::Packed(spec) => spec.check_vocab(trainer.vocab_size()).context("--val-data")?,
            }
            Some(Validator { source, every: cli.val_every, steps: cli.val_steps, seed })
        }
        None => None,
    };
    for s in first..=cli.steps {
        let batch = batches.next_batch()?;
        batch_index += 1;
        if let Some(d) = dump.as_mut() {
            d.write(&batch)?;
        }
        guard.before_step(trainer)?;
        let m = trainer.step(&batch)?;
        progress.step(&m);
        if let Some(w) = metrics.as_mut() {
            w.write(&MetricsRecord::new(&m, &ctx, m.measured_peak_bytes, started.elapsed().as_secs_f64()))?;
        }
        match guard.after_step(trainer, s, &m) {
            Ok(StepOutcome::Applied) => {}
            Ok(StepOutcome::Skipped { what, in_a_row, total }) if logger => {
                progress.println(&format!("titan-run: step {s}: {what}; update skipped ({in_a_row} in a row, {total} in all)"));
            }
            Ok(StepOutcome::Skipped { .. }) => {}
            Err(e) => {
                progress.finish();
                return Err(e.into());
            }
        }
        if logger && (s == first || s == cli.steps || s % cli.log_every.max(1) == 0) {
            progress.println(&format_step_with(&m, &ctx));
        }
        if let Some(v) = validator.as_ref().filter(|v| v.due(s)) {
            let r = v.run(trainer, s, started.elapsed().as_secs_f64())?;
            if logger {
                progress.println(&format_validation(&r, m.peak_bytes));
            }
            if let Some(w) = metrics.as_mut() {
                w.write_json(&r)?;
            }
        }
        if let Some(dir) = &cli.checkpoint_dir
            && (s == cli.steps || cli.checkpoint_every.is_some_and(|k| s % k == 0))
        {
            let state = TrainerState {
                format_version: checkpoint::CHECKPOINT_FORMAT_VERSION,
                step: s,
                seed,
                data_position: batch_index,
                data_stream: match &mut batches {
                    Batches::Sampled(_) => None,
                    Batches::Packed(p) => Some(p.position()?),
                },
                content_hash: identity.content_hash.clone(),
                model_hash: identity.model_hash.clone(),
                model_config: identity.model_config.clone(),
                data: data_name.to_string(),
                mesh: checkpoint::run_mesh(trainer),
            };
            // On a mesh every rank writes its own shards (a collective call).
            let written = checkpoint::save(dir, trainer, &state)?;
            if logger {
                progress.println(&format!("titan-run: checkpoint written to {}", written.display()));
                if cli.last_save_model_only && s == cli.steps {
                    let dtype = export_dtype(cli)?;
                    checkpoint::export_model_only(&written, dtype)?;
                    progress.println(&format!(
                        "titan-run: {} is a model-only export in {} (load it with --init-from {})",
                        written.display(),
                        cli.export_dtype.as_deref().unwrap_or("float32"),
                        written.join(checkpoint::MODEL_FILE).display()
                    ));
                }
                if let Some(k) = cli.keep_latest_k {
                    for old in checkpoint::prune(dir, k)? {
                        progress.println(&format!("titan-run: removed {} (keep_latest_k {k})", old.display()));
                    }
                }
            }
        }
    }
    progress.finish();
    if let Batches::Packed(p) = &mut batches
        && logger
    {
        let (bytes, tokens) = p.counts();
        let elapsed = started.elapsed().as_secs_f64().max(1e-9);
        eprintln!(
            "titan-run: data: {} batches; {:.2} MB of text read, {tokens} tokens made ({:.0} tokens/s of the run); next at {}",
            batch_index - data_position,
            bytes as f64 / 1e6,
            tokens as f64 / elapsed,
            p.position()?
        );
    }
    if logger && guard.skipped() > 0 {
        eprintln!("titan-run: {} of {steps} steps skipped (non-finite loss or gradient norm)", guard.skipped());
    }
    Ok(())
}

/// `--backend cuda`: the schedule on one GPU.
/// `started` is when titan-run started, `load_s` the seconds reading the artifact took.
fn run_cuda(cli: &Cli, artifact: &Artifact, data: DataSource, data_name: &str, started: std::time::Instant, load_s: f64) -> Result<()> {
    let mut trainer = crate::backend::cuda::CudaArtifactTrainer::new(artifact, cli.seed.unwrap_or(0))?;
    if cli.profiling() {
        trainer.enable_profile()?;
        eprintln!("titan-run: --profile: steps run eagerly with a timing event around every launch (no CUDA graph); the first step is not counted");
    }
    let m = &artifact.manifest;
    eprintln!(
        "titan-run: artifact {} ({} kernels, {} launches per step, target {}) on the cuda backend ({}), batch {} x seq {}, {} steps, data {data_name}",
        cli.path.display(),
        m.kernels.len(),
        artifact.launches_per_step(),
        m.target.arch,
        trainer.device_name(),
        trainer.batch_size(),
        trainer.seq_len(),
        cli.steps
    );
    if let Some(line) = crate::log::switches_summary(m) {
        eprintln!("titan-run: {line}");
    }
    eprintln!("titan-run: {}", memory_summary(artifact));
    let mut startup = trainer.startup();
    startup.load_s += load_s;
    eprintln!("titan-run: {}", format_startup(started.elapsed().as_secs_f64(), &startup));
    trainer.set_log_capture(true);
    train(&mut trainer, cli, data, data_name, &RunIdentity::of_artifact(artifact), true)?;
    eprintln!("titan-run: {}", format_memory_check(crate::memory_fit::predicted_device_bytes(m), trainer.measured_peak_bytes()));
    write_memory_svg(cli, artifact, trainer.measured_peak_bytes(), "measured peak on the GPU (arenas and library workspaces)")?;
    if cli.profiling() {
        print_profile(&trainer, true);
        write_trace(&trainer, cli, 0, 1)?;
    }
    if let Some(seconds) = cli.kernel_energy {
        eprint!("{}", trainer.kernel_energy(seconds)?);
    }
    Ok(())
}

impl Cli {
    /// `--profile`, or `--trace` (which needs the profile's events), or `--kernel-energy`
    /// (which measures the kernels the profile found the time in).
    fn profiling(&self) -> bool {
        self.profile || self.trace.is_some() || self.kernel_energy.is_some()
    }
}

/// `--trace FILE`: the last profiled step's measured timeline (`FILE.rank<N>.<ext>` on a mesh
/// of processes).
fn write_trace(trainer: &dyn Trainer, cli: &Cli, rank: usize, world: usize) -> Result<()> {
    let Some(path) = &cli.trace else { return Ok(()) };
    let path = if world > 1 {
        let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let ext = path.extension().map(|e| format!(".{}", e.to_string_lossy())).unwrap_or_default();
        path.with_file_name(format!("{stem}.rank{rank}{ext}"))
    } else {
        path.clone()
    };
    let Some(spans) = trainer.step_trace() else {
        bail!("--trace: no profiled step to write (the GPU does not count the first step); run at least 2 steps");
    };
    let text = titan_ir::artifact::timeline::chrome_trace(rank, "measured", &spans);
    std::fs::write(&path, text).with_context(|| format!("cannot write the trace `{}`", path.display()))?;
    if rank == 0 {
        eprintln!("titan-run: wrote the measured step's timeline to {} (compare: `titanc simulate ARTIFACT --compare {}`)", path.display(), path.display());
    }
    Ok(())
}

/// `titan-run`'s `main`.
pub fn main() -> ExitCode {
    use clap::{CommandFactory, FromArgMatches};
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let given = |id: &str| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
    // The launcher of --nproc-per-node leaves the notes to rank 0.
    let announce = cli.nproc_per_node.is_none() && DistEnv::from_process_env().map_or(true, |e| e.rank == 0);
    match apply_job_config(cli, &given, announce).and_then(run) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// The message of the command line `titan-run ARGS...` clap refuses.
    fn refused(args: &[&str]) -> String {
        match Cli::try_parse_from(std::iter::once("titan-run").chain(args.iter().copied())) {
            Ok(cli) => panic!("{args:?} parsed: {cli:?}"),
            Err(e) => e.to_string(),
        }
    }

    /// Every unsigned flag refuses a negative number saying the bound, rather than taking `-1`
    /// for an unknown argument.
    #[test]
    fn every_unsigned_flag_says_its_bound_for_a_negative_number() {
        use std::any::TypeId;
        let unsigned = [TypeId::of::<u64>(), TypeId::of::<u32>(), TypeId::of::<u16>(), TypeId::of::<usize>()];
        let mut checked = Vec::new();
        for arg in Cli::command().get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if !unsigned.iter().any(|t| arg.get_value_parser().type_id() == *t) {
                continue;
            }
            let flag = format!("--{long}");
            let e = refused(&["DIR", &flag, "-1"]);
            assert!(e.contains(&format!("invalid value '-1' for '{flag}")), "{e}");
            assert!(e.contains("-1 is negative; the value must be at least 1") || e.contains("-1 is negative; the value must be 0 or more"), "{e}");
            checked.push(flag);
        }
        for want in ["--steps", "--seed", "--log-every", "--nproc-per-node", "--master-port", "--max-consecutive-skips"] {
            assert!(checked.iter().any(|c| c == want), "{want} not checked: {checked:?}");
        }
    }

    /// `--steps 0` would run nothing and write no checkpoint: it is refused before any work.
    #[test]
    fn zero_steps_are_refused() {
        let e = refused(&["DIR", "--steps", "0", "--checkpoint-dir", "CKPT"]);
        assert!(e.contains("invalid value '0' for '--steps <STEPS>': the value must be at least 1"), "{e}");
    }

    /// `--tokenizer` reads `--data`; `--text-field` only means something with `--tokenizer`.
    #[test]
    fn tokenizer_flags_need_their_partners() {
        let e = refused(&["DIR", "--tokenizer", "tokenizer.json"]);
        assert!(e.contains("--data <DATA>"), "{e}");
        let e = refused(&["DIR", "--data", "corpus.jsonl", "--text-field", "body"]);
        assert!(e.contains("--tokenizer <FILE>"), "{e}");
        let cli = Cli::try_parse_from(["titan-run", "DIR", "--data", "d.jsonl", "--tokenizer", "t.json"]).expect("parses");
        assert_eq!(cli.text_field, "text");
        Cli::try_parse_from(["titan-run", "DIR"]).expect("the default --text-field needs no --tokenizer");
    }

    #[test]
    fn the_help_names_both_backends() {
        let help = Cli::command().render_help().to_string();
        assert!(!help.contains("for now"), "{help}");
        assert!(help.contains("CPU reference backend or NVIDIA GPUs (--backend cuda)"), "{help}");
    }
}
