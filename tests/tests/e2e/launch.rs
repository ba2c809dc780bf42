//! Multi-process runs: `titan-run --nproc-per-node N` launches one process per rank of an SPMD
//! graph (or SPMD artifact), which meet at a TCP rendezvous and exchange their collectives over TCP. The losses
//! must be exactly the simulated mesh's (same reductions, same order) and match the
//! single-rank run within the distributed tolerance; bad launches fail with clear errors, and a
//! rank that dies makes the others fail instead of hanging.
//!
//! The program under test is `titan-run-e2e`, this package's build of `titan_runtime::cli`
//! (Cargo gives tests the path of their own package's binaries only).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::{DType, Graph, Mesh};
use titan_passes::{TrainOptions, lower_to_train};

const TITAN_RUN: &str = env!("CARGO_BIN_EXE_titan-run-e2e");
const STEPS: usize = 4;
/// The single-rank run sums in a different order (see `distributed.rs`).
const LOSS_TOL: f64 = 1e-5;

fn train_options() -> TrainOptions {
    TrainOptions { lr: 3e-3, warmup_steps: 2, decay_steps: 10, ..TrainOptions::default() }
}

/// The debug model (f32), lowered with `mesh` in its meta (or single-rank), written to a file.
fn graph_file(name: &str, mesh: Option<Mesh>) -> PathBuf {
    graph_file_with(name, mesh, &train_options())
}

/// [`graph_file`] with training options `opts`.
fn graph_file_with(name: &str, mesh: Option<Mesh>, opts: &TrainOptions) -> PathBuf {
    let cfg = LlamaConfig { dtype: DType::F32, ..LlamaConfig::preset(Preset::Debug) };
    let mut m: Graph = build_llama3(&cfg, "llama3_debug").expect("debug model");
    if let Some(mesh) = mesh {
        mesh.write_meta(&mut m);
    }
    let g = lower_to_train(&m, opts).expect("lowering");
    let dir = std::env::temp_dir().join(format!("titan-e2e-launch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(format!("{name}.ir"));
    std::fs::write(&path, titan_ir::print::print_graph(&g)).expect("write graph");
    path
}

fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

fn titan_run(args: &[&str]) -> Output {
    Command::new(TITAN_RUN).args(args).output().expect("run titan-run-e2e")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The `loss` of every line of a metrics `.jsonl` (printed exactly by serde_json).
fn losses(metrics: &Path) -> Vec<f64> {
    let s = std::fs::read_to_string(metrics).expect("metrics file");
    s.lines()
        .map(|l| {
            let at = l.find("\"loss\":").expect("a loss field") + 7;
            let rest = &l[at..];
            let end = rest.find([',', '}']).expect("end of the loss");
            rest[..end].parse::<f64>().expect("a number")
        })
        .collect()
}

/// Train `graph` for STEPS steps with `extra` arguments; returns the losses and stdout, stderr.
fn train(graph: &Path, tag: &str, extra: &[&str]) -> (Vec<f64>, String, String) {
    let metrics = graph.with_file_name(format!("{tag}.jsonl"));
    let _ = std::fs::remove_file(&metrics);
    let steps = STEPS.to_string();
    let mut args = vec![p(graph), "--steps", &steps, "--metrics", p(&metrics)];
    args.extend_from_slice(extra);
    let out = titan_run(&args);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "titan-run {args:?} failed:\n{stderr}");
    (losses(&metrics), stdout, stderr)
}

/// `--nproc-per-node 2` on the SPMD graph of `mesh` matches the simulated mesh exactly and the
/// single-rank run within tolerance; only rank 0 prints the step log.
fn check_two_processes(mesh: Mesh, name: &str) {
    let spmd = graph_file(name, Some(mesh));
    let started = Instant::now();
    let (procs, stdout, stderr) = train(&spmd, &format!("{name}-procs"), &["--nproc-per-node", "2"]);
    let procs_s = started.elapsed().as_secs_f64();
    let (sim, sim_stdout, _) = train(&spmd, &format!("{name}-sim"), &[]);
    let single = graph_file(&format!("{name}-single"), None);
    let (one, _, _) = train(&single, &format!("{name}-single"), &[]);
    println!("{name}: 2 processes {procs:?} ({procs_s:.2} s); simulated mesh {sim:?}; single rank {one:?}");
    assert_eq!(procs.len(), STEPS, "{stdout}\n{stderr}");
    // Bit-identical to the simulated mesh: the same exchanges, reduced in the same order.
    assert_eq!(procs, sim, "the processes and the simulated mesh differ");
    let diff = procs.iter().zip(&one).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(diff <= LOSS_TOL, "losses differ from the single-rank run by {diff}: {procs:?} vs {one:?}");
    // The step log is rank 0's alone, and prints what the simulated mesh prints.
    assert_eq!(stdout.lines().filter(|l| l.starts_with("step:")).count(), STEPS, "{stdout}");
    let loss_cols = |s: &str| s.lines().map(|l| l.split("tps:").next().unwrap_or("").to_string()).collect::<Vec<_>>();
    assert_eq!(loss_cols(&stdout), loss_cols(&sim_stdout));
    assert!(!stdout.contains("[rank 1]") && !stderr.contains("[rank 1]"), "rank 1 printed:\n{stdout}\n{stderr}");
    assert!(stderr.contains("on 2 cpu processes"), "{stderr}");
}

#[test]
fn two_processes_tp_2_match_the_simulated_mesh() {
    check_two_processes(Mesh::new(1, 1, 2), "tp2");
}

#[test]
fn two_processes_dp_shard_2_match_the_simulated_mesh() {
    check_two_processes(Mesh::new(1, 2, 1), "fsdp2");
}

/// `--nproc-per-node 2` on an SPMD *artifact* (`titanc build --tp 2`): the processes run the
/// artifact's schedule with their collective steps over TCP and match the artifact on the
/// simulated mesh bit for bit.
#[test]
fn two_processes_run_an_spmd_artifact_like_the_simulated_mesh() {
    let cfg = LlamaConfig { dtype: DType::F32, ..LlamaConfig::preset(Preset::Debug) };
    let m: Graph = build_llama3(&cfg, "llama3_debug").expect("debug model");
    let train_opts = TrainOptions { lr: 3e-3, warmup_steps: 2, decay_steps: 10, ..TrainOptions::default() };
    let opts = titan_compiler::build::BuildOptions { train: train_opts, mesh: Mesh::new(1, 1, 2), ..Default::default() };
    let dir = std::env::temp_dir().join(format!("titan-e2e-launch-{}", std::process::id())).join("tp2-artifact");
    titan_compiler::build::build_artifact(&m, &titan_ir::print::print_graph(&m), &opts, &dir).expect("build");
    let ckpt = dir.with_file_name("tp2-artifact-ckpt");
    let sim_ckpt = dir.with_file_name("tp2-artifact-sim-ckpt");
    let (procs, stdout, stderr) = train(&dir, "tp2-artifact-procs", &["--nproc-per-node", "2", "--checkpoint-dir", p(&ckpt)]);
    let (sim, _, sim_stderr) = train(&dir, "tp2-artifact-sim", &["--checkpoint-dir", p(&sim_ckpt)]);
    println!("tp2 artifact: 2 processes {procs:?}; simulated mesh {sim:?}");
    assert_eq!(procs.len(), STEPS, "{stdout}\n{stderr}");
    assert_eq!(procs, sim, "the processes and the simulated mesh differ");
    // Their checkpoints (each process wrote its tp shards) are the same bytes.
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let at = |d: &Path| std::fs::read(d.join(format!("step-{STEPS}")).join(file)).expect("checkpoint file");
        assert!(at(&ckpt) == at(&sim_ckpt), "{file}: the processes' checkpoint differs from the simulated mesh's");
    }
    // The artifact of one device has another content hash and the same model hash (both in the
    // manifest and the checkpoint): the processes' checkpoint resumes on it without the flag.
    let one = dir.with_file_name("one-device-artifact");
    let one_opts = titan_compiler::build::BuildOptions { mesh: Mesh::new(1, 1, 1), ..opts.clone() };
    titan_compiler::build::build_artifact(&m, &titan_ir::print::print_graph(&m), &one_opts, &one).expect("build");
    let steps = (STEPS + 1).to_string();
    let out = titan_run(&[p(&one), "--steps", &steps, "--resume", p(&ckpt)]);
    let e = text(&out.stderr);
    assert!(out.status.success() && e.contains("titan-run: resharding a checkpoint of tp 2 onto one device\n"), "{e}");
    let state = std::fs::read_to_string(ckpt.join(format!("step-{STEPS}")).join("trainer_state.json")).expect("state");
    let manifest = std::fs::read_to_string(one.join("manifest.json")).expect("manifest");
    let model_hash = |t: &str| t.lines().find(|l| l.contains("\"model_hash\"")).map(str::trim).map(|l| l.trim_end_matches(',').to_string());
    assert!(model_hash(&state).is_some() && model_hash(&state) == model_hash(&manifest), "{state}\n{manifest}");
    let _ = std::fs::remove_dir_all(&one);
    for d in [&ckpt, &sim_ckpt] {
        let _ = std::fs::remove_dir_all(d);
    }
    assert!(stderr.contains("on 2 cpu processes") && stderr.contains("collectives per step per rank"), "{stderr}");
    assert!(sim_stderr.contains("on a simulated cpu mesh of 2 ranks (tp 2)"), "{sim_stderr}");
    // --val-data: every process runs the eval step on its part of the validation batches, the
    // loss all-reduced inside it; rank 0 logs it, bit for bit the simulated mesh's.
    let corpus = format!("{}/../examples/data/tiny_corpus.txt", env!("CARGO_MANIFEST_DIR"));
    let val = |tag: &str, extra: &[&str]| {
        let metrics = dir.with_file_name(format!("{tag}.jsonl"));
        let mut args = vec![p(&dir), "--steps", "2", "--val-data", corpus.as_str(), "--val-every", "2", "--val-steps", "2", "--metrics", p(&metrics)];
        args.extend_from_slice(extra);
        let out = titan_run(&args);
        assert!(out.status.success(), "{tag}: {}", text(&out.stderr));
        let records: Vec<(u64, f64)> = std::fs::read_to_string(&metrics)
            .expect("metrics")
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json"))
            .filter_map(|v| Some((v["step"].as_u64()?, v["validation_metrics/loss"].as_f64()?)))
            .collect();
        (records, text(&out.stdout))
    };
    let (procs_val, procs_out) = val("val-procs", &["--nproc-per-node", "2"]);
    let (sim_val, _) = val("val-sim", &[]);
    println!("validation: 2 processes {procs_val:?}; simulated mesh {sim_val:?}");
    assert_eq!(procs_val.iter().map(|r| r.0).collect::<Vec<_>>(), [1, 2], "{procs_out}");
    assert!(procs_val.iter().all(|r| r.1.is_finite() && r.1 > 0.0), "{procs_val:?}");
    assert_eq!(procs_val, sim_val, "the processes' validation losses vs the simulated mesh's");
    assert_eq!(procs_out.lines().filter(|l| l.starts_with("validate step:")).count(), 2, "rank 0 alone prints validation:\n{procs_out}");
    // --profile: rank 0 prints its kernel table, the other rank one line.
    let out = titan_run(&[p(&dir), "--steps", "3", "--nproc-per-node", "2", "--profile"]);
    let e = text(&out.stderr);
    assert!(out.status.success(), "{e}");
    assert!(e.contains("titan-run: time per kernel on the cpu backend, mean of 3 profiled step(s)"), "{e}");
    assert!(e.contains("[rank 1] titan-run: --profile: ") && e.contains("ms per step in kernels"), "{e}");
    // --trace: every rank writes its measured step, in the operations `titanc simulate`
    // predicts, so the two compare kernel by kernel and calibrate the cost model.
    let trace = dir.with_file_name("launch-trace.json");
    let out = titan_run(&[p(&dir), "--steps", "2", "--nproc-per-node", "2", "--trace", p(&trace)]);
    let e = text(&out.stderr);
    assert!(out.status.success() && e.contains("wrote the measured step's timeline to"), "{e}");
    let rank_trace = |r: usize| trace.with_file_name(format!("launch-trace.rank{r}.json"));
    assert!(rank_trace(0).exists() && rank_trace(1).exists());
    let cost = dir.with_file_name("launch-cost.json");
    let sim = titan_compiler::cli::run_args(["titanc", "simulate", p(&dir), "--compare", p(&rank_trace(1)), "--calibrate", p(&cost)]).expect("simulate");
    assert!(sim.stdout.contains("predicted step:") && sim.stdout.contains("step: predicted") && sim.stdout.contains("all_gather(tp)"), "{}", sim.stdout);
    let fitted = titan_compiler::cost::CostModel::load(p(&cost)).expect("the calibrated model loads");
    assert!(fitted.name.ends_with("calibrated") && fitted.memory_gbps < 1000.0, "a CPU runs memory-bound kernels far below an H200: {}", fitted.memory_gbps);
    for f in [rank_trace(0), rank_trace(1), cost] {
        let _ = std::fs::remove_file(f);
    }
    // On the GPU an SPMD artifact runs one process per GPU: a single process says how, and a
    // graph file (not an artifact) is refused on --backend cuda before any GPU work.
    let out = titan_run(&[dir.to_str().expect("utf-8"), "--backend", "cuda", "--steps", "1"]);
    let e = text(&out.stderr);
    assert!(!out.status.success() && e.contains("--backend cuda --nproc-per-node 2") && e.contains("--backend cpu runs it on the simulated mesh"), "{e}");
    let spmd = graph_file("cuda-graph-tp2", Some(Mesh::new(1, 1, 2)));
    let out = Command::new(TITAN_RUN).args([p(&spmd), "--backend", "cuda", "--nproc-per-node", "2", "--steps", "1"]).output().expect("run");
    let e = text(&out.stderr);
    assert!(!out.status.success() && e.contains("graph mode (a `.ir` file) runs on the cpu backend only"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Checkpoints of a multi-process run (dp_shard 2 over TCP): every rank writes its own shards
/// into the single-device format. 4 steps straight == 2 steps + checkpoint + `--resume` to 4
/// (the losses bit for bit); the files are byte-identical to those the simulated mesh writes
/// (the processes compute the same bits); the checkpoint resumes in the simulated mesh too, and
/// on one device without --allow-different-build (the same model hash; titan-run says it
/// reshards), tracking the run within the distributed tolerance; a graph of another learning
/// rate refuses it naming `train_lr`, unless --allow-different-build.
#[test]
fn two_processes_checkpoint_and_resume_bit_identically() {
    let spmd = graph_file("ckpt-fsdp2", Some(Mesh::new(1, 2, 1)));
    let ckpt = spmd.with_file_name("ckpt-fsdp2-procs");
    let sim_ckpt = spmd.with_file_name("ckpt-fsdp2-sim");
    for d in [&ckpt, &sim_ckpt] {
        let _ = std::fs::remove_dir_all(d);
    }
    let (straight, _, _) = train(&spmd, "ckpt-fsdp2-straight", &["--nproc-per-node", "2"]);
    // 2 steps with a checkpoint, then resumed to 4, appending to the same metrics file.
    let metrics = spmd.with_file_name("ckpt-fsdp2-resumed.jsonl");
    let _ = std::fs::remove_file(&metrics);
    let run = |args: &[&str]| {
        let out = titan_run(args);
        let stderr = text(&out.stderr);
        assert!(out.status.success(), "titan-run {args:?} failed:\n{stderr}");
        (text(&out.stdout), stderr)
    };
    let (stdout, _) = run(&[p(&spmd), "--steps", "2", "--nproc-per-node", "2", "--checkpoint-dir", p(&ckpt), "--metrics", p(&metrics)]);
    assert_eq!(stdout.matches("checkpoint written to").count(), 1, "rank 0 alone reports it:\n{stdout}");
    let (_, stderr) = run(&[p(&spmd), "--steps", "4", "--nproc-per-node", "2", "--resume", p(&ckpt), "--metrics", p(&metrics)]);
    assert!(stderr.contains("resumed from") && stderr.contains("at step 2") && !stderr.contains("[rank 1] titan-run: resumed"), "{stderr}");
    let resumed = losses(&metrics);
    println!("dp_shard 2 on 2 processes: straight {straight:?}, resumed {resumed:?}");
    assert_eq!(resumed, straight, "losses of the resumed multi-process run");

    // The simulated mesh writes the same bytes at step 2.
    run(&[p(&spmd), "--steps", "2", "--checkpoint-dir", p(&sim_ckpt)]);
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let a = std::fs::read(ckpt.join("step-2").join(file)).expect("read");
        let b = std::fs::read(sim_ckpt.join("step-2").join(file)).expect("read");
        assert!(a == b, "{file}: the processes' checkpoint differs from the simulated mesh's");
    }
    let state = std::fs::read_to_string(ckpt.join("step-2").join("trainer_state.json")).expect("state");
    assert!(state.contains("\"dp_shard\": 2"), "{state}");

    // The processes' checkpoint resumed in one process on the simulated mesh: the same losses.
    let (sim, _, _) = train(&spmd, "ckpt-fsdp2-sim-resumed", &["--resume", p(&ckpt)]);
    assert_eq!(sim, straight[2..].to_vec(), "resumed on the simulated mesh");

    // --init-from on 2 processes: each rank loads its slices of the parameters; the step-3 loss
    // differs from the resumed run's (the moments start at zero), and rank 0 alone says so.
    let (init, _, stderr) = train(&spmd, "ckpt-fsdp2-init", &["--nproc-per-node", "2", "--init-from", p(&ckpt.join("step-2").join("model.safetensors"))]);
    assert_eq!(stderr.matches("parameters loaded from").count(), 1, "{stderr}");
    assert_eq!(init.len(), STEPS);
    assert!(init[0] < straight[0], "training starts from the step-2 weights: {init:?} vs {straight:?}");

    // On one device: the same model, resharded without the flag, said so; it tracks the mesh run.
    let single = graph_file("ckpt-single", None);
    let (one, _, stderr) = train(&single, "ckpt-single-resumed", &["--resume", p(&ckpt)]);
    assert!(stderr.contains("titan-run: resharding a checkpoint of dp_shard 2 onto one device\n"), "{stderr}");
    let diff = one.iter().zip(&straight[2..]).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(diff <= LOSS_TOL, "one device resumed from the processes' checkpoint: {one:?} vs {straight:?}");
    // Another learning rate is another model: refused naming it; the flag forces it.
    let other = graph_file_with("ckpt-single-lr", None, &TrainOptions { lr: 1e-3, ..train_options() });
    let out = titan_run(&[p(&other), "--steps", "4", "--resume", p(&ckpt)]);
    let e = text(&out.stderr);
    assert!(!out.status.success() && e.contains("another model or training configuration (train_lr 0.003 in the checkpoint, 0.001 in this run;"), "{e}");
    let (_, _, stderr) = train(&other, "ckpt-single-lr-forced", &["--resume", p(&ckpt), "--allow-different-build"]);
    assert!(
        stderr.contains("--allow-different-build: resuming a checkpoint of another model or training configuration (train_lr 0.003 in the checkpoint, 0.001 in this run); resharding a checkpoint of dp_shard 2 onto one device"),
        "{stderr}"
    );
    for d in [&ckpt, &sim_ckpt] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Two nodes of two ranks each (`--nnodes 2 --node-rank K --master-addr --master-port`, two
/// launches on this host): dp_replicate 2 x tp 2 runs exactly as the simulated mesh, rank 0's
/// node prints the step log and the other node's lines name their global ranks.
#[test]
fn two_nodes_of_two_processes_match_the_simulated_mesh() {
    let spmd = graph_file("nodes-hsdp-tp", Some(Mesh::new(2, 1, 2)));
    let (sim, _, _) = train(&spmd, "nodes-sim", &[]);
    let port = free_port();
    let steps = STEPS.to_string();
    let metrics = spmd.with_file_name("nodes-procs.jsonl");
    let _ = std::fs::remove_file(&metrics);
    let node = |k: &str| {
        let mut args = vec![p(&spmd), "--steps", &steps, "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", k];
        args.extend(["--master-addr", "127.0.0.1", "--master-port", &port, "--metrics", p(&metrics)]);
        Command::new(TITAN_RUN).args(&args).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().expect("launch a node")
    };
    // Node 1 first: its ranks wait for rank 0 at the rendezvous.
    let (n1, n0) = (node("1"), node("0"));
    let (o0, o1) = (n0.wait_with_output().expect("node 0"), n1.wait_with_output().expect("node 1"));
    let (e0, e1) = (text(&o0.stderr), text(&o1.stderr));
    assert!(o0.status.success() && o1.status.success(), "node 0:\n{e0}\nnode 1:\n{e1}");
    assert_eq!(losses(&metrics), sim, "two nodes and the simulated mesh differ");
    assert_eq!(text(&o0.stdout).lines().filter(|l| l.starts_with("step:")).count(), STEPS);
    assert!(e0.contains("on 4 cpu processes"), "{e0}");
    assert!(text(&o1.stdout).trim().is_empty() && !e1.contains("[rank 1]") && !e1.contains("step:"), "node 1 runs ranks 2 and 3:\n{e1}");
    // A node number out of range, and a multi-node launch without its rendezvous address.
    let e = text(&titan_run(&[p(&spmd), "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "1"]).stderr);
    assert!(e.contains("--node-rank 2 is not below --nnodes 2"), "{e}");
    let e = text(&titan_run(&[p(&spmd), "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1"]).stderr);
    assert!(e.contains("--nnodes 2 needs --node-rank") && e.contains("--master-addr"), "{e}");
    let e = text(&titan_run(&[p(&spmd), "--nnodes", "2"]).stderr);
    assert!(e.contains("--nproc-per-node"), "clap says --nnodes needs --nproc-per-node: {e}");
}

#[test]
fn bad_launches_are_refused_clearly() {
    let spmd = graph_file("bad-tp2", Some(Mesh::new(1, 1, 2)));
    let single = graph_file("bad-single", None);
    let err = |args: &[&str], envs: &[(&str, &str)]| -> String {
        let out = Command::new(TITAN_RUN).args(args).envs(envs.iter().copied()).output().expect("run");
        assert!(!out.status.success(), "{args:?} {envs:?} should fail");
        text(&out.stderr)
    };
    let e = err(&[p(&spmd), "--nproc-per-node", "0"], &[]);
    assert!(e.contains("invalid value '0' for '--nproc-per-node <N>': the value must be at least 1"), "{e}");
    // Every rank says why, rank 0 plainly, the others prefixed; the launch names the first.
    let e = err(&[p(&spmd), "--steps", "2", "--nproc-per-node", "3"], &[]);
    assert!(e.contains("WORLD_SIZE=3 but the graph's mesh has 2 ranks (dp_replicate 1 x dp_shard 1 x tp 2); launch 2 processes"), "{e}");
    assert!(e.contains("[rank 2] error: WORLD_SIZE=3"), "{e}");
    assert!(e.contains("error: launch: rank "), "{e}");
    let e = err(&[p(&single), "--steps", "2", "--nproc-per-node", "2"], &[]);
    assert!(e.contains("is a single-rank graph (no mesh in its meta)"), "{e}");
    // Under a launcher's variables.
    let e = err(&[p(&spmd), "--steps", "2"], &[("RANK", "0"), ("WORLD_SIZE", "2")]);
    assert!(e.contains("WORLD_SIZE=2 needs MASTER_ADDR"), "{e}");
    let e = err(&[p(&spmd), "--steps", "2"], &[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")]);
    assert!(e.contains("RANK=2 is not below WORLD_SIZE=2"), "{e}");
    let e = err(&[p(&spmd), "--steps", "2", "--nproc-per-node", "2"], &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "9")]);
    assert!(e.contains("--nproc-per-node launches its own ranks"), "{e}");
    let e = err(&[p(&spmd), "--steps", "2", "--nproc-per-node", "2", "--profile"], &[]);
    assert!(e.contains("--profile and --trace time the kernels of an artifact") && e.contains("titanc build --tp/--dp-shard"), "{e}");
    // --kernel-energy: GPU kernels of one process only, a window of 0-60 s.
    let e = err(&[p(&single), "--steps", "2", "--kernel-energy", "1"], &[]);
    assert!(e.contains("--kernel-energy measures GPU kernels at the power cap; run with --backend cuda"), "{e}");
    let e = err(&[p(&spmd), "--steps", "2", "--backend", "cuda", "--nproc-per-node", "2", "--kernel-energy", "1"], &[]);
    assert!(e.contains("--kernel-energy is not supported yet on a mesh of processes"), "{e}");
    for bad in ["0", "-1", "61", "nan", "x"] {
        let e = err(&[p(&single), "--backend", "cuda", "--kernel-energy", bad], &[]);
        assert!(e.contains("--kernel-energy <SECONDS>") && (e.contains("window above 0") || e.contains("not a number")), "{bad}: {e}");
    }
    // Slurm: the rendezvous host is the first of the nodelist; rank 0 not there times out, naming it.
    let e = err(
        &[p(&spmd), "--steps", "2", "--rendezvous-timeout", "1"],
        &[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "0"), ("SLURM_JOB_NODELIST", "localhost,gpu[2-3]"), ("MASTER_PORT", "1")],
    );
    assert!(e.contains("could not reach rank 0 at localhost:1"), "{e}");
    // Rank 0 alone: the missing rank is named.
    let port = free_port();
    let e = err(
        &[p(&spmd), "--steps", "2", "--rendezvous-timeout", "1"],
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", &port)],
    );
    assert!(e.contains("rank 1 of 2 did not show up (joined: 0)"), "{e}");
}

fn free_port() -> String {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0)).expect("bind");
    l.local_addr().expect("addr").port().to_string()
}

/// Start rank `rank` of 2 on `port` for many steps, output piped.
fn start_rank(graph: &Path, rank: usize, port: &str) -> Child {
    Command::new(TITAN_RUN)
        .args([p(graph), "--steps", "100000"])
        .envs([("RANK", rank.to_string().as_str()), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port)])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start a rank")
}

/// Wait for `child` to exit, at most `limit`; kill it and fail the test if it hangs.
fn wait_at_most(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().expect("wait") {
            return s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("the rank still runs {limit:?} after the other died: it hangs");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Read `child`'s stdout until its first step line.
fn wait_for_first_step(child: &mut Child) {
    let out = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(out).lines();
    let first = lines.next().expect("a line").expect("utf-8");
    assert!(first.starts_with("step:  1"), "{first}");
    // Keep draining so the rank never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
}

#[test]
fn a_killed_rank_makes_the_other_exit_with_an_error() {
    let spmd = graph_file("kill-tp2", Some(Mesh::new(1, 1, 2)));
    for victim in [1, 0] {
        let port = free_port();
        let mut r0 = start_rank(&spmd, 0, &port);
        let mut r1 = start_rank(&spmd, 1, &port);
        wait_for_first_step(&mut r0);
        let (dead, survivor) = if victim == 1 { (&mut r1, &mut r0) } else { (&mut r0, &mut r1) };
        dead.kill().expect("kill");
        let _ = dead.wait();
        let killed = Instant::now();
        let status = wait_at_most(survivor, Duration::from_secs(30));
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut survivor.stderr.take().expect("stderr"), &mut stderr).expect("stderr");
        println!("rank {victim} killed: the other exited after {:.2} s: {stderr}", killed.elapsed().as_secs_f64());
        assert!(!status.success());
        let want = if victim == 1 { "rank 1 failed: its process exited or lost its connection" } else { "lost the connection to rank 0" };
        assert!(stderr.contains(want), "{stderr}");
    }
}

/// Under the launcher: a rank killed from outside fails the launch (the other rank exits on
/// its own through the control plane), naming the rank.
#[test]
fn the_launcher_fails_when_a_rank_dies() {
    let spmd = graph_file("launch-kill-tp2", Some(Mesh::new(1, 1, 2)));
    let mut launcher = Command::new(TITAN_RUN)
        .args([p(&spmd), "--steps", "100000", "--nproc-per-node", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the launcher");
    wait_for_first_step(&mut launcher);
    // The launcher's children (Linux: /proc/PID/task/PID/children).
    let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", launcher.id())).expect("children of the launcher");
    let pids: Vec<&str> = children.split_whitespace().collect();
    assert_eq!(pids.len(), 2, "{children}");
    let status = Command::new("kill").args(["-9", pids[1]]).status().expect("kill");
    assert!(status.success());
    let status = wait_at_most(&mut launcher, Duration::from_secs(30));
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut launcher.stderr.take().expect("stderr"), &mut stderr).expect("stderr");
    println!("{stderr}");
    assert!(!status.success());
    assert!(stderr.contains("was killed by signal 9"), "{stderr}");
    assert!(stderr.contains("error: launch: rank "), "{stderr}");
}

/// Async TP (`--async-tp=all`: every eligible pair split into ring micro-steps) as processes
/// over TCP, tp 2, 4 and 8 and dp_shard 2 x tp 2, 5 steps in graph mode: each `ring_shift`
/// is an exchange of the process group. The processes give the simulated mesh's losses bit for
/// bit and write the same checkpoint bytes (so the same parameters and moments); the simulated
/// mesh's async run tracks the synchronous one within `LOSS_TOL` (its parameters within 5e-5:
/// `async_tp.rs`).
#[test]
fn async_tp_over_processes_matches_the_simulated_mesh_and_the_synchronous_run() {
    for (mesh, n_heads) in [(Mesh::new(1, 1, 2), 4), (Mesh::new(1, 2, 2), 4), (Mesh::new(1, 1, 4), 4), (Mesh::new(1, 1, 8), 8)] {
        async_tp_over_processes(mesh, n_heads, &train_options(), "bf16", LOSS_TOL);
    }
}

/// float8 rowwise with async TP as processes, tp 2 and dp_shard 2 x tp 2: the fp8 chunks and
/// their row scales cross the process group; the losses equal the simulated mesh's and the
/// synchronous float8 run's bit for bit (`async_tp.rs` says why).
#[test]
fn float8_async_tp_over_processes_matches_the_synchronous_run_bitwise() {
    let train = TrainOptions { float8: Some(titan_passes::float8::Float8Options::new(titan_ir::Float8Recipe::Rowwise)), ..train_options() };
    for mesh in [Mesh::new(1, 1, 2), Mesh::new(1, 2, 2)] {
        async_tp_over_processes(mesh, 4, &train, "f8", 0.0);
    }
}

/// The debug model (f32, `n_heads`) on `mesh` with `--async-tp=all`: as processes, on the
/// simulated mesh (the same bits and checkpoint bytes), and synchronous on the simulated mesh
/// (losses within `tol`).
fn async_tp_over_processes(mesh: Mesh, n_heads: u64, train: &TrainOptions, tag: &str, tol: f64) {
    let dir = std::env::temp_dir().join(format!("titan-e2e-launch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let [_, d, t] = mesh.sizes;
    let name = format!("async-tp-{tag}-dp{d}-tp{t}");
    let file = |async_tp: bool| {
        let cfg = LlamaConfig { dtype: DType::F32, n_heads, ..LlamaConfig::preset(Preset::Debug) };
        let mut m: Graph = build_llama3(&cfg, "llama3_debug").expect("debug model");
        mesh.write_meta(&mut m);
        if async_tp {
            titan_passes::async_tp::enable_async_tp(&mut m, titan_passes::async_tp::AsyncTpMode::All);
        }
        let g = lower_to_train(&m, train).expect("lowering");
        let path = dir.join(format!("{name}-{async_tp}.ir"));
        std::fs::write(&path, titan_ir::print::print_graph(&g)).expect("write graph");
        path
    };
    let (asynchronous, synchronous) = (file(true), file(false));
    let run = |graph: &Path, tag: &str, extra: &[&str]| {
        let (metrics, ckpt) = (dir.join(format!("{name}-{tag}.jsonl")), dir.join(format!("{name}-{tag}-ckpt")));
        let _ = std::fs::remove_file(&metrics);
        let _ = std::fs::remove_dir_all(&ckpt);
        let mut args = vec![p(graph), "--steps", "5", "--metrics", p(&metrics), "--checkpoint-dir", p(&ckpt)];
        args.extend_from_slice(extra);
        let out = titan_run(&args);
        assert!(out.status.success(), "titan-run {args:?} failed:\n{}", text(&out.stderr));
        let model = std::fs::read(ckpt.join("step-5").join("model.safetensors")).expect("checkpoint");
        let _ = std::fs::remove_dir_all(&ckpt);
        (losses(&metrics), model)
    };
    let n = mesh.world_size().to_string();
    let started = Instant::now();
    let (procs, procs_model) = run(&asynchronous, "procs", &["--nproc-per-node", &n]);
    let procs_s = started.elapsed().as_secs_f64();
    let (sim, sim_model) = run(&asynchronous, "sim", &[]);
    let (sync, _) = run(&synchronous, "sync", &[]);
    let diff = sim.iter().zip(&sync).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    println!("{name}: {n} processes {procs:?} ({procs_s:.2} s); simulated mesh identical: {}; vs synchronous max |dloss| {diff:.3e}", procs == sim);
    assert_eq!(procs.len(), 5);
    assert_eq!(procs, sim, "{name}: the processes and the simulated mesh differ");
    assert!(procs_model == sim_model, "{name}: the processes' parameters differ from the simulated mesh's");
    assert!(diff <= tol, "{name}: async {sim:?} vs synchronous {sync:?}");
}
