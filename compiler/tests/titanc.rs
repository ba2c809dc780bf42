//! End-to-end tests of the `titanc` binary: exit codes, files, and errors without panics.

use std::path::PathBuf;
use std::process::{Command, Output};

fn titanc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_titanc")).args(args).output().expect("titanc runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A fresh scratch directory for one test.
fn scratch(test: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("titanc-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

fn assert_no_panic(out: &Output) {
    let err = text(&out.stderr);
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "titanc panicked:\n{err}");
}

#[test]
fn new_then_verify_and_fmt() {
    let dir = scratch("new");
    let model = dir.join("model.ir");
    let m = model.to_str().unwrap();
    let out = titanc(&["new", "llama3", "--preset", "debug", "-o", m]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(out.stdout.is_empty(), "-o writes the file, not stdout");
    let written = std::fs::read_to_string(&model).unwrap();
    assert!(written.starts_with("graph @llama3_debug {"), "{written}");

    let out = titanc(&["verify", m]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "ok: 5 nodes in main, 1 block\n");

    let out = titanc(&["fmt", m]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), written, "fmt of printed IR is the identity");

    let out = titanc(&["stats", m]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("parameters:"), "{}", text(&out.stdout));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn new_prints_to_stdout_and_summary_to_stderr() {
    let out = titanc(&["new", "llama3", "--preset", "8b", "--summary"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("graph @llama3_8b {"));
    assert!(text(&out.stderr).contains("8,030,261,248"), "{}", text(&out.stderr));
}

#[test]
fn malformed_file_reports_location_and_exits_1() {
    let dir = scratch("bad");
    // A syntax error (unknown op) and a typing error (declared type disagrees), both on line 4.
    let files = [
        ("syntax.ir", "graph @g {\n  func @main {\n    input %x : f32[4]\n    %y = frobnicate(%x) : f32[4]\n    output loss = %y\n  }\n}\n"),
        ("types.ir", "graph @g {\n  func @main {\n    input %x : f32[4]\n    %y = exp(%x) : f32[5]\n    output loss = %y\n  }\n}\n"),
    ];
    for (name, src) in files {
        let bad = dir.join(name);
        std::fs::write(&bad, src).unwrap();
        for cmd in ["verify", "fmt", "stats"] {
            let out = titanc(&[cmd, bad.to_str().unwrap()]);
            assert_eq!(out.status.code(), Some(1), "{cmd} {name}: {}", text(&out.stderr));
            assert_no_panic(&out);
            let err = text(&out.stderr);
            assert!(err.contains(&format!("{name}:4:")), "{cmd}: expected {name}:4:col in\n{err}");
            assert!(out.stdout.is_empty());
        }
        let out = titanc(&["lower", bad.to_str().unwrap(), "--to", "train"]);
        assert_eq!(out.status.code(), Some(1));
        assert_no_panic(&out);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn user_errors_exit_1_without_panicking() {
    let cases: &[(&[&str], &str)] = &[
        (&["new", "llama3", "--preset", "debug", "--n-heads", "6"], "n_heads=6 does not divide dim=64"),
        (&["new", "llama4", "--preset", "debug"], "choose one of: llama3"),
        (&["new", "llama3", "--from-hf", "no/such/config.json"], "cannot read `no/such/config.json`"),
        (&["new", "llama3", "--preset", "8b", "--from-hf", "x.json"], "cannot be used with"),
        (&["new", "llama3", "--preset", "7b"], "unknown preset `7b`"),
        (&["verify", "no/such/model.ir"], "no/such/model.ir"),
        (&["lower", "no/such/model.ir", "--to", "serve"], "choose one of: train"),
        (&["new", "llama3", "--preset", "debug", "--seq-len", "99999999999999"], "seq_len=99999999999999 is too large"),
    ];
    for (args, needle) in cases {
        let out = titanc(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out.stderr));
        assert_no_panic(&out);
        assert!(text(&out.stderr).contains(needle), "{args:?}: expected `{needle}` in\n{}", text(&out.stderr));
    }
}

#[test]
fn lower_to_train_runs_or_reports_an_error() {
    let dir = scratch("lower");
    let model = dir.join("model.ir");
    let m = model.to_str().unwrap();
    assert!(titanc(&["new", "llama3", "--preset", "debug", "-o", m]).status.success());
    let train = dir.join("train.ir");
    let out = titanc(&["lower", m, "--to", "train", "--lr", "1e-3", "--max-norm", "0", "-o", train.to_str().unwrap()]);
    assert_no_panic(&out);
    if out.status.success() {
        // The lowered graph is valid IR.
        let v = titanc(&["verify", train.to_str().unwrap()]);
        assert!(v.status.success(), "{}", text(&v.stderr));
        let lowered = std::fs::read_to_string(&train).unwrap();
        assert!(lowered.contains("adamw(") && lowered.contains("lr = 0.001"), "{lowered}");
        // Stats want the model graph: the training step keeps weights as state.
        let s = titanc(&["stats", train.to_str().unwrap()]);
        assert_eq!(s.status.code(), Some(1));
        assert!(text(&s.stderr).contains("run stats on the model graph"), "{}", text(&s.stderr));
    } else {
        assert_eq!(out.status.code(), Some(1));
        assert!(text(&out.stderr).starts_with("error: "), "{}", text(&out.stderr));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn help_succeeds() {
    let out = titanc(&["--help"]);
    assert!(out.status.success());
    assert!(text(&out.stdout).contains("lower"));
}

fn workspace_file(rel: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(rel).to_str().unwrap().to_string()
}

#[test]
fn build_writes_an_artifact_and_prints_the_peak() {
    let dir = scratch("build");
    let out_dir = dir.join("debug");
    let o = out_dir.to_str().unwrap();
    let model = workspace_file("examples/llama3-debug.ir");
    let out = titanc(&["build", &model, "-o", o]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let summary = text(&out.stdout);
    assert!(summary.contains("predicted peak memory: rank 0:"), "{summary}");
    assert!(summary.contains("kernels:") && summary.contains("gemm"), "{summary}");
    for f in ["manifest.json", "graph.ir"] {
        assert!(out_dir.join(f).is_file(), "{f} missing");
    }
    assert!(out_dir.join("kernels").is_dir());
    // The fused graph is valid IR.
    let v = titanc(&["verify", out_dir.join("graph.ir").to_str().unwrap()]);
    assert!(v.status.success(), "{}", text(&v.stderr));

    // With the example job config, timings and the fusion report; building again replaces it.
    let job = workspace_file("examples/job/debug.toml");
    let out = titanc(&["build", &model, "-o", o, "--job-config", &job, "--timings", "--report", "--lr", "2e-3"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let summary = text(&out.stdout);
    for needle in ["passes:", "fuse", "fusion report", "note: ", "titan-run reads the runtime sections"] {
        assert!(summary.contains(needle), "expected `{needle}` in\n{summary}");
    }
    let out = titanc(&["build", &model, "-o", o, "--dump-after", "fuse"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("// ---- IR after `fuse` ----\ngraph @llama3_debug_train {"), "{}", text(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A build-time switch (an environment variable that changes generated kernels, for
/// comparisons) is named in the summary, recorded in the manifest and changes the content hash;
/// without one the manifest has no `build_switches` and the hash is the default build's.
#[test]
fn build_time_switches_are_hashed_and_recorded() {
    let dir = scratch("switches");
    let model = workspace_file("examples/llama3-debug.ir");
    let build = |name: &str, env: &[(&str, &str)]| {
        let out_dir = dir.join(name);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_titanc"));
        cmd.args(["build", &model, "-o", out_dir.to_str().unwrap()]);
        for s in titan_kernels::switches::Switch::ALL {
            cmd.env_remove(s.name());
        }
        let out = cmd.envs(env.iter().copied()).output().expect("titanc runs");
        assert!(out.status.success(), "{}", text(&out.stderr));
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out_dir.join("manifest.json")).unwrap()).unwrap();
        (text(&out.stdout), json)
    };
    let (plain_summary, plain) = build("plain", &[]);
    let (summary, switched) = build("switched", &[("TITAN_SCATTER_SPLIT", "1"), ("TITAN_ATT_FWD_EX2", "full"), ("TITAN_ATT_FWD_EXP2", "full")]);
    assert!(plain.get("build_switches").is_none(), "{plain}");
    assert!(!plain_summary.contains("build-time switches"), "{plain_summary}");
    assert_eq!(switched["build_switches"], serde_json::json!({"TITAN_ATT_FWD_EX2": "full", "TITAN_SCATTER_SPLIT": "1"}));
    assert!(summary.contains("built with build-time switches TITAN_ATT_FWD_EX2=full TITAN_SCATTER_SPLIT=1"), "{summary}");
    assert!(summary.contains("`TITAN_ATT_FWD_EXP2` is set but is not a build-time switch, so it changed nothing"), "{summary}");
    assert!(!plain_summary.contains("is not a build-time switch"), "{plain_summary}");
    assert_ne!(plain["content_hash"], switched["content_hash"]);
    assert_eq!(plain["model_hash"], switched["model_hash"], "a switch changes kernels, not the model");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn build_errors_say_what_to_change() {
    let dir = scratch("build-errors");
    let model = workspace_file("examples/llama3-debug.ir");
    let o = dir.join("out");
    let o = o.to_str().unwrap();
    let job = dir.join("job.toml");
    std::fs::write(&job, "[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"0\"\n").unwrap();
    let j8b = workspace_file("examples/job/llama3_8b.toml");
    let par = dir.join("par.toml");
    std::fs::write(&par, "[parallelism]\npipeline_parallel_degree = 2\n").unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["build", &model, "-o", o, "--target", "sm_80"], "unsupported --target `sm_80`"),
        (&["build", &model, "-o", o, "--dump-after", "fusion"], "unknown pass `fusion`"),
        (&["build", &model, "-o", o, "--job-config", job.to_str().unwrap()], "option `0` is neither `op` nor a positive number of layers"),
        (&["build", &model, "-o", o, "--job-config", &j8b], "regenerate the model with `titanc new ... --batch-size 1`"),
        (&["build", &model, "-o", o, "--job-config", "no/such/job.toml"], "cannot read `no/such/job.toml`"),
        (&["build", "no/such/model.ir", "-o", o], "cannot read `no/such/model.ir`"),
        (&["build", &model, "-o", o, "--beta2", "1.5"], "--beta2 1.5 must be at least 0 and below 1"),
        (&["build", &model], "--output <DIR>"),
        // ParallelDims: invalid configs say what to change; valid ones not built yet say so.
        (&["build", &model, "-o", o, "--tp", "3"], "tp=3 does not divide n_heads=4; choose tp in {1, 2, 4}"),
        (&["build", &model, "-o", o, "--tp", "0"], "tp must be a degree >= 1, found 0"),
        (&["build", &model, "-o", o, "--dp-shard", "2", "--world-size", "8"], "= 2 does not match world size 8"),
        (&["build", &model, "-o", o, "--tp", "4", "--dp-shard", "-1", "--world-size", "6"], "world size 6 is not divisible by"),
        (&["build", &model, "-o", o, "--dp-shard", "-1", "--world-size", "16"], "batch = 8 is not divisible by dp_replicate x dp_shard = 16"),
        (&["build", &model, "-o", o, "--tp", "2", "--cp", "2"], "context parallelism (cp=2) is not supported yet"),
        (&["build", &model, "-o", o, "--job-config", par.to_str().unwrap()], "pipeline parallelism (pp=2) is not supported yet"),
    ];
    for (args, needle) in cases {
        let out = titanc(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out.stderr));
        assert_no_panic(&out);
        assert!(text(&out.stderr).contains(needle), "{args:?}: expected `{needle}` in\n{}", text(&out.stderr));
        assert!(!dir.join("out").exists(), "{args:?} left a partial artifact");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `titanc build --tp 2 --dp-shard 2` builds an SPMD artifact and prints the per-rank memory and
/// the communication per mesh dim.
#[test]
fn build_with_parallel_degrees_prints_the_mesh_report() {
    let dir = scratch("build-spmd");
    let o = dir.join("out");
    let model = workspace_file("examples/llama3-debug.ir");
    let out = titanc(&["build", &model, "-o", o.to_str().unwrap(), "--tp", "2", "--dp-shard", "2"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    assert!(s.contains("mesh:         world 4 = dp_shard 2 x tp 2 (SPMD: every rank runs this schedule on its shards;"), "{s}");
    assert!(s.contains("per-rank memory (predicted, each of the 4 ranks):") && s.contains("predicted peak memory: each rank: "), "{s}");
    assert!(s.contains("  dp_shard     ( 2 ranks): ") && s.contains("  tp           ( 2 ranks): "), "{s}");
    let manifest = std::fs::read_to_string(o.join("manifest.json")).unwrap();
    assert!(manifest.contains("\"op\": \"collective\"") && manifest.contains("\"report\": {"), "{manifest}");
    // Every kernel has GPU code, the vocab-parallel loss's too; --disable-loss-parallel builds
    // the whole loss instead.
    assert!(!s.contains("no GPU code"), "{s}");
    assert!(manifest.contains("cross_entropy_stats"), "the loss is vocab-parallel");
    let o2 = dir.join("whole-loss");
    let out = titanc(&["build", &model, "-o", o2.to_str().unwrap(), "--tp", "2", "--dp-shard", "2", "--disable-loss-parallel"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    assert!(!s.contains("no GPU code"), "{s}");
    let manifest = std::fs::read_to_string(o2.join("manifest.json")).unwrap();
    assert!(!manifest.contains("cross_entropy_stats"), "{manifest}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// FSDP builds prefetch the next layer's weights by default (`prefetch = 9` on both loops of the
/// training graph, `prefetch` steps in the artifact's loops); `--disable-prefetch-next-layer`
/// and the job config's `parallelism.disable_prefetch_next_layer = true` turn it off, and change
/// the content hash but not the model hash (neither does the mesh; another `--lr` does, in the
/// manifest and in the lowered graph's `meta`).
#[test]
fn prefetch_next_layer_is_on_for_fsdp_and_can_be_turned_off() {
    let dir = scratch("prefetch");
    let model = workspace_file("examples/llama3-debug.ir");
    let lowered = |extra: &[&str]| {
        let out = titanc(&[&["lower", model.as_str(), "--to", "train", "--dp-shard", "2"], extra].concat());
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout).matches("prefetch = 9}").count()
    };
    assert_eq!(lowered(&[]), 2, "the forward and the backward loop");
    assert_eq!(lowered(&["--disable-prefetch-next-layer"]), 0);
    let job = dir.join("job.toml");
    std::fs::write(&job, "[parallelism]\ndisable_prefetch_next_layer = true\n").unwrap();
    let built = |name: &str, extra: &[&str]| {
        let o = dir.join(name);
        let out = titanc(&[&["build", model.as_str(), "-o", o.to_str().unwrap(), "--dp-shard", "2"], extra].concat());
        assert!(out.status.success(), "{}", text(&out.stderr));
        let manifest = std::fs::read_to_string(o.join("manifest.json")).unwrap();
        let line = |key: &str| manifest.lines().find(|l| l.contains(&format!("\"{key}\""))).unwrap_or_default().trim().to_string();
        (manifest.contains("\"prefetch\": ["), line("content_hash"), line("model_hash"), text(&out.stdout))
    };
    let (on, hash_on, model_on, stdout) = built("on", &[]);
    let (flag, hash_off, model_off, _) = built("flag", &["--disable-prefetch-next-layer"]);
    let (file, hash_file, model_file, _) = built("file", &["--job-config", job.to_str().unwrap()]);
    assert_eq!((on, flag, file), (true, false, false));
    assert_ne!(hash_on, hash_off);
    assert_eq!(hash_off, hash_file);
    let full = model_on.trim_start_matches("\"model_hash\": \"").trim_end_matches([',', '"']).to_string();
    assert_eq!(full.len(), 64, "{model_on}");
    assert_eq!((&model_on, &model_on), (&model_off, &model_file));
    assert!(stdout.contains(&format!(", model hash {})", &full[..16])), "{stdout}");
    let (_, _, model_lr, _) = built("lr", &["--lr", "1e-3"]);
    assert_ne!(model_lr, model_on);
    // The lowered graphs record the same hash in their meta, whatever the mesh.
    let meta_hash = |extra: &[&str]| {
        let out = titanc(&[&["lower", model.as_str(), "--to", "train"], extra].concat());
        assert!(out.status.success(), "{}", text(&out.stderr));
        let g = text(&out.stdout);
        let at = g.find("model_hash = \"").map(|i| i + "model_hash = \"".len()).unwrap_or_default();
        g[at..at + 64].to_string()
    };
    assert_eq!(meta_hash(&[]), full);
    assert_eq!(meta_hash(&["--tp", "2", "--disable-loss-parallel"]), meta_hash(&[]));
    assert_ne!(meta_hash(&["--lr", "1e-3"]), meta_hash(&[]));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `titanc lower --to train` with parallel degrees writes an SPMD graph for the simulated mesh;
/// degrees the partitioning passes do not handle are refused with what to change.
#[test]
fn lower_with_parallel_degrees_writes_an_spmd_graph_or_says_what_is_missing() {
    let dir = scratch("lower-spmd");
    let model = dir.join("model.ir");
    let m = model.to_str().unwrap();
    assert!(titanc(&["new", "llama3", "--preset", "debug", "-o", m]).status.success());
    let out = titanc(&["lower", m, "--to", "train", "--dp-replicate", "2", "--dp-shard", "2"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let g = text(&out.stdout);
    assert!(g.contains("world_size = 4, mesh_dp_replicate = 2, mesh_dp_shard = 2, mesh_tp = 1"), "{g}");
    assert!(g.contains("reduce_scatter(") && g.contains("all_gather(") && g.contains("all_reduce("), "{g}");
    assert!(g.contains("#[Replicate, Shard(1), Replicate]"), "{g}");
    let out = titanc(&["lower", m, "--to", "train", "--tp", "2", "--dp-shard", "2"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let g = text(&out.stdout);
    assert!(g.contains("all_reduce(") && g.contains("mesh_dim = tp") && g.contains("#[Replicate, Shard(2), Shard(1)]"), "{g}");
    // tp = 4 over the debug model's 2 kv heads: kv-head replication.
    let out = titanc(&["lower", m, "--to", "train", "--tp", "4"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("take_shard(%wk.repeated) {mesh_dim = tp, dim = 0, size = 4}"), "{}", text(&out.stdout));
    for (args, needle) in [
        (vec!["--tp", "3"], "tp=3 does not divide n_heads=4; choose tp in {1, 2, 4}"),
        (vec!["--pp", "2"], "pipeline parallelism (pp=2) is not supported yet"),
        (vec!["--dp-shard", "3"], "dp_shard"),
    ] {
        let mut all = vec!["lower", m, "--to", "train"];
        all.extend(args.iter().copied());
        let out = titanc(&all);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert_no_panic(&out);
        assert!(text(&out.stderr).contains(needle), "{args:?}: expected `{needle}` in\n{}", text(&out.stderr));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `titanc passes` lists the table; `titanc opt` runs named passes on a file, prints the IR to
/// stdout and, with `--stats`, each pass's counters to stderr; errors point into the file.
#[test]
fn opt_runs_named_passes_and_points_at_failing_nodes() {
    let out = titanc(&["passes"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listing = text(&out.stdout);
    for name in ["shard-tp", "master-weights", "autodiff", "adamw", "cse", "dce", "fuse", "check-collectives"] {
        assert!(listing.lines().any(|l| l.starts_with(name)), "{name} missing from:\n{listing}");
    }

    let dir = scratch("opt");
    let file = dir.join("g.ir");
    let f = file.to_str().unwrap();
    std::fs::write(
        &file,
        "graph @g {\n  func @main {\n    input %x : f32[4]\n    state %w : f32[4] {name = \"w\", init = ones}\n    %a = mul(%x, %w) : f32[4]\n    %b = mul(%x, %w) : f32[4]\n    %c = add(%a, %b) : f32[4]\n    %loss = reduce_max(%c) {axes = [0]} : f32[]\n    output loss = %loss\n  }\n}\n",
    )
    .unwrap();
    let out = titanc(&["opt", f, "--passes", "cse,dce", "--stats", "--verify-each"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("%c = add(%a, %a)"), "{}", text(&out.stdout));
    assert!(text(&out.stderr).starts_with("cse    merged 1\ndce    removed 0"), "{}", text(&out.stderr));

    // autodiff has no VJP for reduce_max: the error names the pass and points at line 8.
    let out = titanc(&["opt", f, "--passes", "autodiff"]);
    assert_no_panic(&out);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("g.ir:8:5: error: autodiff: backward of node n3 (`reduce_max`): differentiating `reduce_max` is not supported yet"), "{err}");
    assert!(err.contains("8 |     %loss = reduce_max(%c)") && err.contains("^^^^"), "{err}");

    // A pass whose precondition fails says which; bad pass lists and meshes are usage errors.
    let out = titanc(&["opt", f, "--passes", "shard-tp"]);
    assert!(text(&out.stderr).contains("shard-tp: the graph's meta names no device mesh"), "{}", text(&out.stderr));
    let out = titanc(&["opt", f, "--passes", "cse,,dce"]);
    assert!(text(&out.stderr).contains("give pass names separated by commas"), "{}", text(&out.stderr));
    let out = titanc(&["opt", f, "--passes", "cse", "--mesh", "pp=2"]);
    assert!(text(&out.stderr).contains("unknown mesh dim `pp`"), "{}", text(&out.stderr));
    let out = titanc(&["opt", f, "--passes", "fusion"]);
    assert!(text(&out.stderr).contains("unknown pass `fusion`; valid passes: shard-tp,"), "{}", text(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `titanc build` verifies after every pass with `--verify-each`, and a pass error on a model
/// file points at the line of the node it is about.
#[test]
fn build_verify_each_and_located_pass_errors() {
    let dir = scratch("build-verify");
    let model = dir.join("model.ir");
    let m = model.to_str().unwrap();
    assert!(titanc(&["new", "llama3", "--preset", "debug", "-o", m]).status.success());
    let out = titanc(&["build", m, "-o", dir.join("out").to_str().unwrap(), "--verify-each"]);
    assert!(out.status.success(), "{}", text(&out.stderr));

    let text_ir = std::fs::read_to_string(&model).unwrap().replace("%gate = silu(%25)", "%gate = sigmoid(%25)").replace(
        "%28 = mul(%gate, %up) : bf16[batch, seq, 192]",
        "%m = max(%gate, %up) : bf16[batch, seq, 192]\n    %28 = mul(%m, %up) : bf16[batch, seq, 192]",
    );
    let bad = dir.join("bad.ir");
    std::fs::write(&bad, &text_ir).unwrap();
    let out = titanc(&["build", bad.to_str().unwrap(), "-o", dir.join("bad").to_str().unwrap()]);
    assert_no_panic(&out);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    let line = text_ir.lines().position(|l| l.contains("%m = max(")).unwrap() + 1;
    assert!(err.contains(&format!("bad.ir:{line}:5: error: autodiff: @layer: backward of node")), "{err}");
    assert!(err.contains("differentiating `max` is not supported yet"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
