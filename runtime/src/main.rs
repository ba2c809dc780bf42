//! `titan-run`: train a model from its training-step graph (`titanc lower --to train`).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::Parser;
use titan_runtime::{Batcher, CpuTrainer, byte_tokens, format_step};

/// Run training steps of a titan training graph.
#[derive(Parser, Debug)]
#[command(name = "titan-run", version, about)]
struct Cli {
    /// The training-step graph (`titanc lower model.ir --to train -o train.ir`).
    graph: PathBuf,
    /// Number of training steps.
    #[arg(long, default_value_t = 100)]
    steps: u64,
    /// Text file tokenized byte by byte; the bundled corpus when omitted.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Seed for parameter initialization and batch sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print every N-th step (the first and last are always printed).
    #[arg(long, default_value_t = 1)]
    log_every: u64,
    /// Execution backend; only the CPU reference backend exists so far.
    #[arg(long, default_value = "cpu")]
    backend: String,
}

fn run(cli: Cli) -> Result<()> {
    if cli.backend != "cpu" {
        bail!("backend `{}` is not supported yet; use --backend cpu", cli.backend);
    }
    let graph = titan_ir::parse::parse_file(&cli.graph).map_err(|e| anyhow::anyhow!("{e}"))?;
    let text = match &cli.data {
        Some(p) => std::fs::read(p).with_context(|| format!("cannot read data file `{}`", p.display()))?,
        None => titan_runtime::BUNDLED_CORPUS.as_bytes().to_vec(),
    };
    let mut trainer = CpuTrainer::new(&graph, cli.seed)?;
    let tokens = byte_tokens(&text);
    let mut batcher = Batcher::new(tokens, trainer.batch_size(), trainer.seq_len(), cli.seed).map_err(anyhow::Error::msg)?;
    if batcher.max_token() as usize >= trainer.vocab_size() {
        bail!("the byte-level data needs a vocabulary of 256, the model has {}; use --vocab-size 256 or more", trainer.vocab_size());
    }
    eprintln!(
        "titan-run: {} on the cpu backend, batch {} x seq {}, {} steps, data {}",
        graph.name,
        trainer.batch_size(),
        trainer.seq_len(),
        cli.steps,
        cli.data.as_ref().map_or("bundled corpus".to_string(), |p| p.display().to_string())
    );
    for s in 1..=cli.steps {
        let batch = batcher.next_batch();
        let m = trainer.step(&batch)?;
        if !m.loss.is_finite() {
            bail!("step {s}: loss is {}; lower the learning rate", m.loss);
        }
        if s == 1 || s == cli.steps || s % cli.log_every.max(1) == 0 {
            println!("{}", format_step(&m));
        }
    }
    Ok(())
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
