//! `titan-run`: train a model from its artifact (`titanc build model.ir -o DIR`), or from an
//! unfused training graph `.ir` (`titanc lower --to train`) in graph mode.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::Parser;
use titan_runtime::log::{Progress, memory_summary};
use titan_runtime::{Artifact, Batcher, CpuArtifactTrainer, CpuTrainer, Trainer, byte_tokens, format_step};

/// Run training steps of a titan artifact or training graph.
#[derive(Parser, Debug)]
#[command(name = "titan-run", version, about)]
struct Cli {
    /// An artifact directory (`titanc build model.ir -o DIR`), or a training-step graph `.ir`
    /// file (`titanc lower model.ir --to train`) to run unfused in graph mode.
    path: PathBuf,
    /// Number of training steps.
    #[arg(long, default_value_t = 100)]
    steps: u64,
    /// Text file tokenized byte by byte; the bundled corpus when omitted.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Seed for parameter initialization and batch sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print every K-th step (the first and last are always printed).
    #[arg(long, default_value_t = 1)]
    log_every: u64,
    /// Execution backend: `cpu` (the reference executor); `cuda` comes next.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Print the time spent per kernel after the run (artifacts only).
    #[arg(long)]
    profile: bool,
}

fn check_backend(name: &str) -> Result<()> {
    match name {
        "cpu" => Ok(()),
        "cuda" => bail!("the cuda backend is not supported yet; use --backend cpu"),
        other => bail!("unknown backend `{other}`; use --backend cpu"),
    }
}

/// Whether `path` names a graph file rather than an artifact directory.
fn is_graph_file(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "ir") && !path.is_dir()
}

fn run(cli: Cli) -> Result<()> {
    check_backend(&cli.backend)?;
    let text = match &cli.data {
        Some(p) => std::fs::read(p).with_context(|| format!("cannot read data file `{}`", p.display()))?,
        None => titan_runtime::BUNDLED_CORPUS.as_bytes().to_vec(),
    };
    let data_name = cli.data.as_ref().map_or("bundled corpus".to_string(), |p| p.display().to_string());
    if is_graph_file(&cli.path) {
        if cli.profile {
            bail!("--profile times the kernels of an artifact; build one with `titanc build` and pass its directory");
        }
        let graph = titan_ir::parse_file(&cli.path).map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut trainer = CpuTrainer::new(&graph, cli.seed)?;
        eprintln!(
            "titan-run: {} (graph mode, unfused) on the cpu backend, batch {} x seq {}, {} steps, data {data_name}",
            graph.name,
            trainer.batch_size(),
            trainer.seq_len(),
            cli.steps
        );
        return train(&mut trainer, &cli, &text);
    }
    if cli.path.is_file() {
        bail!("`{}` is neither an artifact directory nor a `.ir` training graph; pass the directory `titanc build -o DIR` wrote", cli.path.display());
    }
    let artifact = Artifact::load(&cli.path)?;
    let mut trainer = CpuArtifactTrainer::new(&artifact, cli.seed)?;
    if cli.profile {
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
    eprintln!("titan-run: {}", memory_summary(&artifact));
    train(&mut trainer, &cli, &text)?;
    if let Some(p) = trainer.profile() {
        print_profile(&artifact, p);
    }
    Ok(())
}

fn train(trainer: &mut dyn Trainer, cli: &Cli, text: &[u8]) -> Result<()> {
    let mut batcher = Batcher::new(byte_tokens(text), trainer.batch_size(), trainer.seq_len(), cli.seed).map_err(anyhow::Error::msg)?;
    if batcher.max_token() as usize >= trainer.vocab_size() {
        bail!("the byte-level data needs a vocabulary of 256, the model has {}; build the model with --vocab-size 256 or more", trainer.vocab_size());
    }
    let progress = Progress::new(cli.steps);
    for s in 1..=cli.steps {
        let batch = batcher.next_batch();
        let m = trainer.step(&batch)?;
        progress.step(&m);
        if !m.loss.is_finite() {
            progress.finish();
            bail!("step {s}: loss is {}; lower the learning rate", m.loss);
        }
        if s == 1 || s == cli.steps || s % cli.log_every.max(1) == 0 {
            progress.println(&format_step(&m));
        }
    }
    progress.finish();
    Ok(())
}

fn print_profile(artifact: &Artifact, times: &[titan_runtime::backend::cpu_artifact::KernelTime]) {
    let total: f64 = times.iter().map(|t| t.seconds).sum();
    let mut rows: Vec<_> = artifact.manifest.kernels.iter().zip(times).filter(|(_, t)| t.launches > 0).collect();
    rows.sort_by(|a, b| b.1.seconds.total_cmp(&a.1.seconds));
    eprintln!("titan-run: time per kernel on the cpu backend ({total:.3} s in kernels):");
    for (k, t) in rows.iter().take(20) {
        eprintln!("  {:>8.3} s {:>5.1}% {:>6} launches  {} ({})", t.seconds, 100.0 * t.seconds / total.max(1e-12), t.launches, k.name, k.kind.name());
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
