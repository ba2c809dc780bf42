//! `build-time`: builds the debug, 8B and 70B Llama-3 presets (`titanc new` defaults: sequence
//! length 8192 for 8B and 70B) through `build_artifact` into temporary directories and prints a
//! table of kernels, PTX files, predicted peak memory per rank and build time per phase. Each
//! preset is built `--runs` times; the table shows the run with the median total time.
//!
//! `cargo run --release -p titan-bench --bin build-time`; `docs/performance.md` records results.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use titan_compiler::build::{BuildOptions, BuildSummary, build_artifact, human_bytes};
use titan_compiler::{LlamaConfig, Preset, model_ir};

#[derive(Debug, Parser)]
#[command(name = "build-time", about = "Time `titanc build` on the Llama-3 presets")]
struct Args {
    /// Builds per preset; the median run is reported
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Presets to build, comma separated
    #[arg(long, value_delimiter = ',', default_value = "debug,8b,70b")]
    presets: Vec<String>,
}

struct Row {
    preset: String,
    parse: Duration,
    wall: Duration,
    summary: BuildSummary,
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}

fn build_preset(p: Preset, runs: usize, scratch: &std::path::Path) -> Result<Row> {
    let cfg = LlamaConfig::preset(p);
    let text = model_ir(&cfg, p.name()).with_context(|| format!("preset {p}"))?;
    let mut samples = Vec::with_capacity(runs);
    for i in 0..runs {
        let out = scratch.join(format!("{}-{i}", p.name()));
        let t = Instant::now();
        let model = titan_ir::parse::parse_and_verify(&format!("{}.ir", p.name()), &text).map_err(|e| anyhow::anyhow!("{e}"))?;
        let parse = t.elapsed();
        let t = Instant::now();
        let summary = build_artifact(&model, &text, &BuildOptions::default(), &out).with_context(|| format!("building preset {p}"))?;
        let wall = t.elapsed();
        let _ = std::fs::remove_dir_all(&out);
        samples.push(Row { preset: p.name().to_string(), parse, wall, summary });
    }
    samples.sort_by_key(|r| r.wall);
    let mid = samples.len() / 2;
    samples.into_iter().nth(mid).context("no runs")
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let presets = args.presets.iter().map(|s| s.parse::<Preset>().map_err(|e| anyhow::anyhow!("{e}"))).collect::<Result<Vec<_>>>()?;
    let scratch: PathBuf = std::env::temp_dir().join(format!("titan-build-time-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).with_context(|| format!("cannot create {}", scratch.display()))?;
    let mut rows = Vec::new();
    for p in presets {
        rows.push(build_preset(p, args.runs, &scratch)?);
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("titanc build, median of {} runs, {cores} cores, times in ms", args.runs);
    println!("| preset | kernels | PTX files | cubins | peak per rank | total | parse | pipeline | plan | codegen | ptxas | eval step | write |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        let s = &r.summary;
        let peak = s.peak_bytes_per_rank.first().copied().unwrap_or(0);
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.preset,
            s.kernels,
            s.ptx_files,
            s.cubin_files,
            human_bytes(peak),
            ms(r.wall),
            ms(r.parse),
            ms(s.phases.pipeline),
            ms(s.phases.plan),
            ms(s.phases.codegen),
            ms(s.phases.ptxas),
            ms(s.phases.eval),
            ms(s.phases.write)
        );
    }
    Ok(())
}
