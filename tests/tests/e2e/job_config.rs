//! TorchTitan's llama3 job configs as shipped (`tests/job_configs/torchtitan-<release>/`, the
//! sections, keys and values of its last TOML release, v0.2.2, and of v0.1.0): `titanc build
//! --job-config` against the matching model (the flavor's preset with the file's batch and
//! sequence length) reads the whole file in one run and either builds, printing the exact list
//! of keys it does not honor, or refuses with the exact list of what is not supported yet.
//! `titan-run --job-config` writes checkpoints at the interval and into the folder the file
//! names, keeps the newest `keep_latest_k`, exports the last one model-only in `export_dtype`,
//! writes `<dump_folder>/metrics.jsonl` and resumes from `load_step`. `--memory-svg` draws the
//! plan as well-formed SVG whose marked peak is the plan's.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::{debug_f32, scratch, train_options};

const TITAN_RUN: &str = env!("CARGO_BIN_EXE_titan-run-e2e");
const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

fn config(release: &str, name: &str) -> PathBuf {
    Path::new(ROOT).join(format!("tests/job_configs/torchtitan-{release}/{name}.toml"))
}

fn titanc(args: &[&str]) -> Result<String, String> {
    titan_compiler::cli::run_args(std::iter::once("titanc").chain(args.iter().copied())).map(|o| o.stdout).map_err(|e| e.to_string())
}

/// The `note:` lines of a build's output, without the file name.
fn notes(stdout: &str, file: &Path) -> Vec<String> {
    let prefix = format!("note: {}: ", file.display());
    stdout.lines().filter_map(|l| l.strip_prefix(&prefix)).map(String::from).collect()
}

/// The not-honored lines every v0.2.2 config shares with its release's debug config.
const V022_COMMON: [&str; 2] = [
    "`compile.enable = false` not honored: titan always compiles the whole step ahead of time (fusion does not change the results)",
    "`model.hf_assets_path` not honored: titan's vocabulary comes from the model file (`titanc new --vocab-size`/`--from-hf`) and its tokenizer from `titan-run --tokenizer tokenizer.json`",
];

/// The debug configs build as shipped, `selective_ac_option = '2'` (every 2nd layer fully
/// recomputed) included, each not-honored key printed once (v0.2.2's through a whole `titanc
/// build`; v0.1.0's checked in-process, to build the artifact once).
#[test]
fn torchtitan_debug_configs_build_as_shipped() {
    let dir = scratch("job_config", "debug");
    std::fs::create_dir_all(&dir).expect("scratch");
    let model = dir.join("debug2048.ir");
    titanc(&["new", "llama3", "--preset", "debug", "--seq-len", "2048", "-o", model.to_str().expect("utf-8")]).expect("new");
    let colors = "`metrics.disable_color_printing = false` not honored: titan-run prints no colors";
    let dataset =
        "`training.dataset = \"c4_test\"` not honored: titan-run has no dataset registry; it trains on `training.dataset_path`, `--data` or the bundled corpus";
    let expected: [(&str, Vec<&str>); 2] = [
        (
            "v0.1.0",
            vec![
                "`job.use_for_integration_test` not honored: a marker for TorchTitan's own CI",
                colors,
                "`model.tokenizer_path` not honored: titan's vocabulary comes from the model file (`titanc new --vocab-size`/`--from-hf`) and its tokenizer from `titan-run --tokenizer tokenizer.json`",
                "`training.compile = false` not honored: titan always compiles the whole step ahead of time (fusion does not change the results)",
                dataset,
            ],
        ),
        ("v0.2.2", vec![V022_COMMON[0], colors, V022_COMMON[1], dataset]),
    ];
    for (release, want) in expected {
        let cfg = config(release, "debug_model");
        if release == "v0.1.0" {
            let j = titan_compiler::JobConfig::load(&cfg).unwrap_or_else(|e| panic!("{release}: {e}"));
            let m = titan_ir::parse::parse(&std::fs::read_to_string(&model).expect("model")).map_err(|e| format!("{e:?}")).expect("parse").0;
            j.check_model(&m, 1).unwrap_or_else(|e| panic!("{release}: {e}"));
            let mut got: Vec<String> = j.notes().iter().map(|n| n.strip_prefix(&format!("{}: ", cfg.display())).unwrap_or(n).to_string()).collect();
            assert!(got.pop().is_some_and(|l| l.starts_with("titan-run reads the runtime sections")), "{release}");
            assert_eq!(got, want, "{release}");
            continue;
        }
        let out = dir.join(release);
        let stdout = titanc(&["build", model.to_str().expect("utf-8"), "-o", out.to_str().expect("utf-8"), "--job-config", cfg.to_str().expect("utf-8")])
            .unwrap_or_else(|e| panic!("{release}: {e}"));
        assert!(stdout.contains("@layer_x2: saves %"), "{release}: every second layer is recomputed:\n{stdout}");
        let graph = std::fs::read_to_string(out.join("graph.ir")).expect("graph.ir");
        assert!(graph.contains("block @layer_x2(") && !graph.contains("block @layer("), "{release}: the unused layer blocks are removed");
        let mut got = notes(&stdout, &cfg);
        assert!(got.pop().is_some_and(|l| l.starts_with("titan-run reads the runtime sections")), "{release}");
        assert_eq!(got, want, "{release}");
    }
}

/// The 8B configs of both releases build as shipped against `titanc new llama3 --preset 8b`
/// (given here by its flavor name), each not-honored key printed once (v0.2.2's through a
/// whole `titanc build`, whose plan is drawn; v0.1.0's checked in-process, to build 8B once).
#[test]
fn torchtitan_8b_configs_build_as_shipped() {
    let dir = scratch("job_config", "8b");
    let expected: [(&str, Vec<&str>); 2] = [
        (
            "v0.1.0",
            vec![
                "`metrics.enable_tensorboard = true` not honored: titan-run writes its metrics as JSON lines (<dump_folder>/metrics.jsonl), not TensorBoard events",
                "`metrics.save_tb_folder` not honored: no TensorBoard events are written (see `enable_tensorboard`)",
                "`model.tokenizer_path` not honored: titan's vocabulary comes from the model file (`titanc new --vocab-size`/`--from-hf`) and its tokenizer from `titan-run --tokenizer tokenizer.json`",
                "`profiling.profile_freq` not honored: titan-run --profile times every step but the first and reports once at the end",
                "`profiling.save_traces_folder` not honored: titan-run --profile prints a per-kernel time table at the end instead of writing trace files",
                "`training.compile = false` not honored: titan always compiles the whole step ahead of time (fusion does not change the results)",
                "`training.dataset = \"c4\"` not honored: titan-run has no dataset registry; it trains on `training.dataset_path`, `--data` or the bundled corpus",
            ],
        ),
        (
            "v0.2.2",
            vec![
                V022_COMMON[0],
                "`metrics.enable_tensorboard = true` not honored: titan-run writes its metrics as JSON lines (<dump_folder>/metrics.jsonl), not TensorBoard events",
                "`metrics.save_tb_folder` not honored: no TensorBoard events are written (see `enable_tensorboard`)",
                V022_COMMON[1],
                "`profiling.profile_freq` not honored: titan-run --profile times every step but the first and reports once at the end",
                "`profiling.save_traces_folder` not honored: titan-run --profile prints a per-kernel time table at the end instead of writing trace files",
                "`training.dataset = \"c4\"` not honored: titan-run has no dataset registry; it trains on `training.dataset_path`, `--data` or the bundled corpus",
            ],
        ),
    ];
    for (release, want) in expected {
        let cfg = config(release, "llama3_8b");
        let out = dir.join(release);
        if release == "v0.1.0" {
            // One 8B build per test run: the older file is checked against the model in-process.
            let j = titan_compiler::JobConfig::load(&cfg).unwrap_or_else(|e| panic!("{release}: {e}"));
            let model = titan_compiler::build_llama3(&titan_compiler::LlamaConfig::preset(titan_compiler::Preset::B8), "m").expect("8b");
            j.check_model(&model, 1).unwrap_or_else(|e| panic!("{release}: {e}"));
            let mut got: Vec<String> = j.notes().iter().map(|n| n.strip_prefix(&format!("{}: ", cfg.display())).unwrap_or(n).to_string()).collect();
            assert!(got.pop().is_some_and(|l| l.starts_with("titan-run reads the runtime sections")), "{release}");
            assert_eq!(got, want, "{release}");
            continue;
        }
        let svg = dir.join(format!("{release}.svg"));
        let stdout = titanc(&[
            "build",
            "8B",
            "-o",
            out.to_str().expect("utf-8"),
            "--job-config",
            cfg.to_str().expect("utf-8"),
            "--memory-svg",
            svg.to_str().expect("utf-8"),
        ])
        .unwrap_or_else(|e| panic!("{release}: {e}"));
        check_memory_svg(&svg, &out, "memory-8b.svg");
        let mut got = notes(&stdout, &cfg);
        assert!(got.pop().is_some_and(|l| l.starts_with("titan-run reads the runtime sections")), "{release}: {stdout}");
        assert_eq!(got, want, "{release}:\n{stdout}");
        assert!(stdout.contains("@layer: saves"), "selective op checkpointing is applied: {stdout}");
    }
}

/// 70B (tp 8) and 405B (tp 8, float8 with fp8 all-gathers, async TP) read in full and accepted
/// as shipped (async TP is `--async-tp`; fp8 all-gathers are `float8-fsdp-gather`).
#[test]
fn torchtitan_70b_and_405b_configs_are_read_in_one_run() {
    let model = |preset: &str, batch: u64| {
        let mut cfg = titan_compiler::LlamaConfig::preset(preset.parse().expect("preset"));
        cfg.batch_size = batch;
        titan_compiler::build_llama3(&cfg, "m").expect("model")
    };
    for release in ["v0.1.0", "v0.2.2"] {
        // 70B: the file is accepted and matches the model; tp 8 over dp_shard -1 is an 8-rank mesh.
        let j = titan_compiler::JobConfig::load(&config(release, "llama3_70b")).unwrap_or_else(|e| panic!("{release}: {e}"));
        j.check_model(&model("70b", 8), 1).unwrap_or_else(|e| panic!("{release}: {e}"));
        assert_eq!(j.parallelism.tp, Some(8));
        assert_eq!(j.activation_checkpoint, Some(titan_passes::activation_checkpoint::AcPolicy::Full));
        // 405B: accepted as shipped, async TP and fp8 all-gathers on.
        let cfg = config(release, "llama3_405b");
        let async_tp = titan_ir::job_config::RunSettings::load(&cfg).map(|(s, _)| s.async_tp).unwrap_or_else(|e| panic!("{release}: {e}"));
        assert_eq!(async_tp.map(|a| (a.key, a.on)), Some(("parallelism.enable_async_tensor_parallel".to_string(), true)), "{release}");
        let j = titan_compiler::JobConfig::load(&cfg).unwrap_or_else(|e| panic!("{release}: {e}"));
        j.check_model(&model("405b", 2), 1).unwrap_or_else(|e| panic!("{release}: {e}"));
        assert_eq!(j.parallelism.tp, Some(8));
        assert_eq!(j.async_tp(8).0, Some(titan_passes::async_tp::AsyncTpMode::Auto), "{release}");
        assert!(j.float8.as_ref().is_some_and(|f| f.fsdp_all_gather), "{release}");
    }
}

/// TorchTitan's 405B float8 section (both releases) turns on fp8 FSDP all-gathers with the
/// tensorwise default recipe and the head filtered, and the precomputed scale (one amax
/// all-reduce per block) is honored.
#[test]
fn torchtitan_405b_float8_section_turns_on_fp8_all_gathers() {
    for release in ["v0.1.0", "v0.2.2"] {
        let cfg = config(release, "llama3_405b");
        let j = titan_compiler::JobConfig::load(&cfg).unwrap_or_else(|e| panic!("{release}: {e}"));
        let f8 = j.float8.clone().expect("float8 on");
        assert_eq!((f8.recipe, f8.fsdp_all_gather, f8.precompute_scale), (titan_ir::Float8Recipe::Tensorwise, true, true), "{release}");
        assert_eq!(f8.filter, vec!["output".to_string()], "{release}");
        let notes = j.notes();
        assert!(!notes.iter().any(|n| n.contains("precompute_float8_dynamic_scale_for_fsdp")), "{release}: {notes:?}");
    }
}

/// `training.local_batch_size` is per data-parallel rank, as in TorchTitan: a preset built from
/// the debug config at dp_shard 2 has twice its batch, and a model file built for one rank is
/// refused at dp_shard 2 with the batch it needs.
#[test]
fn local_batch_size_is_per_data_parallel_rank() {
    let dir = scratch("job_config", "local_batch");
    std::fs::create_dir_all(&dir).expect("scratch");
    let cfg = config("v0.2.2", "debug_model");
    let cfg = cfg.to_str().expect("utf-8");
    let out = dir.join("dp2");
    titanc(&["build", "debugmodel", "-o", out.to_str().expect("utf-8"), "--dp-shard", "2", "--world-size", "2", "--job-config", cfg]).expect("build");
    let graph = std::fs::read_to_string(out.join("graph.ir")).expect("graph.ir");
    assert!(graph.contains("batch = 16"), "8 per rank over dp_shard 2: {}", &graph[..graph.len().min(400)]);
    let model = dir.join("debug2048.ir");
    titanc(&["new", "llama3", "--preset", "debug", "--seq-len", "2048", "-o", model.to_str().expect("utf-8")]).expect("new");
    let err = titanc(&[
        "build",
        model.to_str().expect("utf-8"),
        "-o",
        dir.join("no").to_str().expect("utf-8"),
        "--dp-shard",
        "2",
        "--world-size",
        "2",
        "--job-config",
        cfg,
    ])
    .expect_err("batch 8 at dp_shard 2");
    assert!(err.contains("`training.local_batch_size = 8` is per data-parallel rank (as in TorchTitan): with dp_replicate x dp_shard = 2 the model's batch is 16, but it was built with batch = 8"), "{err}");
}

/// A flavor that does not match the model is refused naming both.
#[test]
fn a_flavor_mismatch_is_refused() {
    let dir = scratch("job_config", "flavor");
    std::fs::create_dir_all(&dir).expect("scratch");
    let job = dir.join("job.toml");
    std::fs::write(&job, "[model]\nname = \"llama3\"\nflavor = \"405B\"\n").expect("write");
    let model = format!("{ROOT}/examples/llama3-debug.ir");
    let err = titanc(&["build", &model, "-o", dir.join("out").to_str().expect("utf-8"), "--job-config", job.to_str().expect("utf-8")]).expect_err("mismatch");
    assert!(err.contains("`model.flavor = \"405B\"` (dim 16384, n_layers 126, n_heads 128, n_kv_heads 8, ffn_dim 53248) does not match the model file (dim 64, n_layers 2, n_heads 4, n_kv_heads 2, ffn_dim 192)"), "{err}");
}

fn titan_run(args: &[&str]) -> Output {
    Command::new(TITAN_RUN).args(args).output().expect("run titan-run-e2e")
}

fn printed(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn step_dirs(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir).map(|r| r.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect()).unwrap_or_default();
    v.sort();
    v
}

/// `titan-run --job-config` on a debug job: checkpoints every `interval` steps into
/// `<dump_folder>/<folder>`, the newest `keep_latest_k` kept, the last one a bf16 model-only
/// export; metrics every step into `<dump_folder>/metrics.jsonl`; a second run with
/// `load_step` resumes there; flags override the file.
#[test]
fn titan_run_takes_the_runtime_sections() {
    let dir = scratch("job_config", "run");
    std::fs::create_dir_all(&dir).expect("scratch");
    let train = titan_passes::lower_to_train(&debug_f32(), &train_options()).expect("lowering");
    let graph = dir.join("train.ir");
    std::fs::write(&graph, titan_ir::print::print_graph(&train)).expect("write the graph");
    let dump = dir.join("outputs");
    let job = |steps: u64, load_step: i64, model_only: bool| {
        let path = dir.join(format!("job-{steps}.toml"));
        let text = format!(
            "[job]\ndump_folder = \"{}\"\ndescription = \"debug job\"\n[metrics]\nlog_freq = 2\nenable_tensorboard = false\n[training]\nsteps = {steps}\nseed = 5\ndataset = \"c4_test\"\n[checkpoint]\nenable = true\nfolder = \"ck\"\ninterval = 2\nkeep_latest_k = 2\nload_step = {load_step}\nlast_save_model_only = {model_only}\nexport_dtype = \"bfloat16\"\nasync_mode = \"disabled\"\n",
            dump.display()
        );
        std::fs::write(&path, text).expect("write the job");
        path
    };
    let first = job(6, -1, false);
    let o = titan_run(&[graph.to_str().expect("utf-8"), "--job-config", first.to_str().expect("utf-8")]);
    let text = printed(&o);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("titan-run: job: debug job"), "{text}");
    assert!(text.contains("not honored: titan-run has no dataset registry"), "{text}");
    let ck = dump.join("ck");
    assert_eq!(step_dirs(&ck), ["step-4", "step-6"], "interval 2, the newest 2 kept: {text}");
    assert!(text.contains(&format!("removed {}", ck.join("step-2").display())), "{text}");
    let metrics = std::fs::read_to_string(dump.join("metrics.jsonl")).expect("metrics.jsonl");
    assert_eq!(metrics.lines().count(), 6, "{metrics}");
    // log_freq 2: steps 1 (the first), 2, 4 and 6.
    assert_eq!(text.lines().filter(|l| l.starts_with("step")).count(), 4, "{text}");

    // load_step = 4: resume there (not at the latest, 6) and train to 8; the last checkpoint
    // is a model-only bf16 export.
    let second = job(8, 4, true);
    let o = titan_run(&[graph.to_str().expect("utf-8"), "--job-config", second.to_str().expect("utf-8")]);
    let text = printed(&o);
    assert!(o.status.success(), "{text}");
    assert!(text.contains(&format!("resumed from {} at step 4", ck.join("step-4").display())), "{text}");
    assert_eq!(step_dirs(&ck), ["step-6", "step-8"], "{text}");
    let export = ck.join("step-8");
    assert_eq!(step_dirs(&export), ["model.safetensors"], "model only: {text}");
    let bytes = std::fs::read(export.join("model.safetensors")).expect("export");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header = String::from_utf8_lossy(&bytes[8..8 + header_len]);
    assert!(header.contains("\"BF16\"") && !header.contains("\"F32\""), "{header}");
    // Appended: six lines of the first run, steps 5 to 8 of the second.
    assert_eq!(std::fs::read_to_string(dump.join("metrics.jsonl")).expect("metrics").lines().count(), 10);

    // Flags override the file: --steps, and --checkpoint-dir for the folder.
    let other = dir.join("other");
    let o = titan_run(&[
        graph.to_str().expect("utf-8"),
        "--job-config",
        first.to_str().expect("utf-8"),
        "--steps",
        "3",
        "--checkpoint-dir",
        other.to_str().expect("utf-8"),
    ]);
    let text = printed(&o);
    assert!(o.status.success(), "{text}");
    assert_eq!(step_dirs(&other), ["step-2", "step-3"], "the file's interval still applies: {text}");

    // A load_step the folder does not hold is refused.
    let missing = job(8, 3, false);
    let o = titan_run(&[graph.to_str().expect("utf-8"), "--job-config", missing.to_str().expect("utf-8")]);
    assert!(printed(&o).contains("`checkpoint.load_step = 3` but"), "{}", printed(&o));
}

/// The root and the element of class `class` of an SVG file, parsed as XML.
fn svg_attr(svg: &str, class: &str, attr: &str) -> Option<u64> {
    let doc = roxmltree::Document::parse(svg).expect("well-formed XML");
    doc.descendants().find(|n| n.attribute("class") == Some(class)).and_then(|n| n.attribute(attr)).and_then(|v| v.parse().ok())
}

/// The SVG at `svg` parses as XML and marks the peak of the plan in `artifact`; with
/// `TITAN_WRITE_DOCS_IMAGES` set it is copied to `docs/images/<name>` (how those are made).
fn check_memory_svg(svg: &Path, artifact: &Path, name: &str) {
    let text = std::fs::read_to_string(svg).expect("svg");
    let manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(artifact.join("manifest.json")).expect("manifest")).expect("json");
    let peak = manifest["memory"]["peak_bytes"].as_u64().expect("peak");
    assert_eq!(svg_attr(&text, "peak", "data-bytes"), Some(peak), "{name}: the marked peak is the plan's");
    if std::env::var_os("TITAN_WRITE_DOCS_IMAGES").is_some() {
        std::fs::write(Path::new(ROOT).join("docs/images").join(name), &text).expect("write the docs image");
    }
}

/// `titanc build --memory-svg` draws the debug plan: well-formed SVG, its marked peak the
/// manifest's, every buffer the schedule touches a rectangle with its name in a `<title>`;
/// `titan-run --memory-svg` overlays the bytes the cpu backend allocated (the plan's arenas).
#[test]
fn the_memory_plan_is_drawn_with_its_peak() {
    let dir = scratch("job_config", "svg");
    std::fs::create_dir_all(&dir).expect("scratch");
    let out = dir.join("out");
    let svg = dir.join("plan.svg");
    let model = format!("{ROOT}/examples/llama3-debug.ir");
    let stdout = titanc(&["build", &model, "-o", out.to_str().expect("utf-8"), "--memory-svg", svg.to_str().expect("utf-8")]).expect("build");
    assert!(stdout.contains("wrote the memory plan to"), "{stdout}");
    check_memory_svg(&svg, &out, "memory-debug.svg");
    let text = std::fs::read_to_string(&svg).expect("svg");
    let manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).expect("manifest")).expect("json");
    let peak = manifest["memory"]["peak_bytes"].as_u64().expect("peak");
    let doc = roxmltree::Document::parse(&text).expect("well-formed XML");
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    assert_eq!(root.attribute("data-peak-bytes").and_then(|v| v.parse().ok()), Some(peak));
    assert_eq!(svg_attr(&text, "peak", "data-bytes"), Some(peak), "the marked peak is the plan's");
    let arenas: u64 = doc.descendants().filter(|n| n.attribute("class") == Some("arena")).filter_map(|n| n.attribute("data-bytes")?.parse::<u64>().ok()).sum();
    assert_eq!(arenas, peak, "the arena bands add up to the peak");
    let titles: Vec<&str> = doc
        .descendants()
        .filter(|n| n.has_tag_name("rect") && n.parent().is_some_and(|p| p.attribute("class") == Some("buffers")))
        .filter_map(|r| r.children().find(|c| c.has_tag_name("title"))?.text())
        .collect();
    let buffers = manifest["buffers"].as_array().expect("buffers");
    assert!(titles.len() > buffers.len() / 2 && titles.len() <= buffers.len(), "{} rects for {} buffers", titles.len(), buffers.len());
    for name in ["main.%tok_embeddings", "main.%tokens", "main.%logits"] {
        assert!(titles.iter().any(|t| t.starts_with(&format!("{name}: "))), "{name} not drawn: {titles:?}");
    }

    let overlay = dir.join("run.svg");
    let o = titan_run(&[out.to_str().expect("utf-8"), "--steps", "1", "--memory-svg", overlay.to_str().expect("utf-8")]);
    assert!(o.status.success(), "{}", printed(&o));
    let text = std::fs::read_to_string(&overlay).expect("overlay");
    assert_eq!(svg_attr(&text, "measured", "data-bytes"), Some(peak), "the cpu backend allocates the plan's arenas");
    assert!(text.contains("bytes the cpu backend allocated for the arenas"), "{text}");
}

/// `enable_async_tensor_parallel = true` (here the newer `[compile]` key) is `titanc build
/// --async-tp`: with tp 2 the build runs the `async-tp` pass and prints its decisions (tp 1, a
/// "not honored" line instead, is `JobConfig::async_tp`'s unit test).
#[test]
fn the_async_tp_key_is_titanc_build_async_tp() {
    let dir = scratch("job_config", "async-tp");
    std::fs::create_dir_all(&dir).expect("scratch");
    let model = dir.join("debug.ir");
    std::fs::write(&model, titan_ir::print::print_graph(&debug_f32())).expect("write");
    let job = dir.join("tp2.toml");
    std::fs::write(&job, "[parallelism]\ntensor_parallel_degree = 2\n[compile]\nenable_async_tensor_parallel = true\n").expect("write");
    let out = dir.join("tp2");
    let stdout = titanc(&["build", model.to_str().expect("utf-8"), "-o", out.to_str().expect("utf-8"), "--job-config", job.to_str().expect("utf-8")])
        .expect("tp 2 with async TP builds");
    assert!(stdout.contains("async-tp:\n") && stdout.contains("synchronous: chunk of"), "{stdout}");
    assert!(!stdout.contains("not honored: async"), "{stdout}");
}
