//! Library-level tests of the Llama-3 frontend: presets, validation, Hugging Face configs, the
//! built graph (snapshot, verification, parameter counts) and in-process CLI commands.

use std::path::{Path, PathBuf};

use titan_compiler::cli::run_args;
use titan_compiler::{FrontendError, LlamaConfig, LlamaOverrides, Preset, build_llama3, load_hf_config, model_ir, model_stats, parse_hf_config};
use titan_ir::{ArgKind, DType, Graph, Op, RopeScaling};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("compiler/ has a parent").to_path_buf()
}

fn preset_graph(p: Preset) -> Graph {
    build_llama3(&LlamaConfig::preset(p), p.name()).unwrap_or_else(|e| panic!("preset {p} does not build: {e}"))
}

fn invalid(cfg: &LlamaConfig) -> String {
    match cfg.validate() {
        Ok(()) => panic!("expected {cfg:?} to be rejected"),
        Err(e) => e.to_string(),
    }
}

fn assert_contains(haystack: &str, needle: &str) {
    assert!(haystack.contains(needle), "expected `{needle}` in:\n{haystack}");
}

// ---- the graph ----

#[test]
fn debug_preset_ir_snapshot() {
    let text = model_ir(&LlamaConfig::preset(Preset::Debug), "debug").unwrap();
    insta::assert_snapshot!("debug_preset_ir", text);
}

#[test]
fn example_file_is_the_debug_preset() {
    let expected = model_ir(&LlamaConfig::preset(Preset::Debug), "debug").unwrap();
    let path = workspace().join("examples/llama3-debug.ir");
    let actual = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        actual == expected,
        "{} is out of date with the debug preset; regenerate it with\n  cargo run -p titan-compiler --bin titanc -- new llama3 --preset debug -o examples/llama3-debug.ir",
        path.display()
    );
}

#[test]
fn every_preset_builds_and_verifies() {
    for p in Preset::ALL {
        let g = preset_graph(p);
        let errors = titan_ir::verify::verify(&g);
        assert!(errors.is_empty(), "preset {p} does not verify: {errors:?}");
        assert_eq!(g.name, format!("llama3_{p}"));
        assert_eq!(g.meta_i64("n_layers"), Some(LlamaConfig::preset(p).n_layers as i64));
    }
}

#[test]
fn printed_presets_parse_back() {
    for p in [Preset::Debug, Preset::B1, Preset::B405] {
        let text = titan_ir::print::print_graph(&preset_graph(p));
        let g = titan_ir::parse::parse_and_verify(&format!("{p}.ir"), &text).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(titan_ir::print::print_graph(&g), text, "printing {p} is not a fixed point");
    }
}

#[test]
fn graph_size_does_not_depend_on_n_layers() {
    let sizes: Vec<(Preset, usize, usize, usize, usize)> = Preset::ALL
        .into_iter()
        .map(|p| {
            let g = preset_graph(p);
            (p, g.blocks.len(), g.blocks[0].order.len(), g.main.order.len(), g.main.args.len())
        })
        .collect();
    let (_, blocks, block_nodes, main_nodes, _) = sizes[0];
    for &(p, b, bn, mn, _) in &sizes {
        assert_eq!((b, bn, mn), (blocks, block_nodes, main_nodes), "preset {p} differs in graph size");
    }
    assert_eq!(blocks, 1);
    assert_eq!(main_nodes, 5, "embedding, repeat, rmsnorm, linear, cross_entropy");
    // The 405B text stays small: the block is printed once.
    let text = model_ir(&LlamaConfig::preset(Preset::B405), "405b").unwrap();
    assert!(text.len() < 16_000, "405b prints {} bytes", text.len());
}

#[test]
fn repeat_runs_the_layer_block_n_layers_times() {
    let g = preset_graph(Preset::B70);
    let repeat = g.main.order.iter().map(|&n| &g.main.node(n).op).find(|op| matches!(op, Op::Repeat { .. }));
    match repeat {
        Some(Op::Repeat { count, carry, stacked, reverse, block, .. }) => {
            assert_eq!((*count, *carry, *stacked, *reverse), (80, 1, 9, false));
            assert_eq!(g.block(*block).name, "layer");
        }
        other => panic!("expected a repeat in main, found {other:?}"),
    }
}

fn param_count(g: &Graph) -> f64 {
    g.main.args.iter().filter(|a| matches!(a.kind, ArgKind::Param(_))).map(|a| g.main.ty(a.value).numel(&g.dims).expect("param dims are bound") as f64).sum()
}

#[test]
fn parameter_counts_match_the_published_sizes() {
    for (p, expected) in [(Preset::B8, 8.03e9), (Preset::B70, 70.55e9), (Preset::B405, 405.85e9), (Preset::B1, 1.236e9), (Preset::B3, 3.21e9)] {
        let n = param_count(&preset_graph(p));
        let err = (n - expected).abs() / expected;
        assert!(err < 0.005, "preset {p}: {n:.4e} parameters, expected about {expected:.4e}");
    }
}

#[test]
fn stats_follow_torchtitan() {
    let s = model_stats(&preset_graph(Preset::B8)).unwrap();
    assert_eq!(s.params, 8_030_261_248);
    assert_eq!(s.embedding_params, 128_256 * 4096);
    assert_eq!(s.non_embedding_params, s.params - s.embedding_params);
    let flops = 6.0 * s.non_embedding_params as f64 + 12.0 * 32.0 * 32.0 * 128.0 * 8192.0;
    assert_eq!(s.flops_per_token, Some(flops));
    // Tied: the table is counted once and there is no output.weight.
    let tied = preset_graph(Preset::B1);
    let names: Vec<&str> = tied.main.args.iter().filter_map(|a| a.kind.param_info()).map(|p| p.name.as_str()).collect();
    assert!(!names.contains(&"output.weight"), "{names:?}");
    assert_eq!(model_stats(&tied).unwrap().param_tensors, 11);
}

#[test]
fn params_use_torchtitan_names_and_inits() {
    let g = preset_graph(Preset::B8);
    let names: Vec<&str> = g.main.args.iter().filter_map(|a| a.kind.param_info()).map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "tok_embeddings.weight",
            "layers.{i}.attention_norm.weight",
            "layers.{i}.attention.wq.weight",
            "layers.{i}.attention.wk.weight",
            "layers.{i}.attention.wv.weight",
            "layers.{i}.attention.wo.weight",
            "layers.{i}.ffn_norm.weight",
            "layers.{i}.feed_forward.w1.weight",
            "layers.{i}.feed_forward.w2.weight",
            "layers.{i}.feed_forward.w3.weight",
            "norm.weight",
            "output.weight",
        ]
    );
    let out = g.main.args.iter().filter_map(|a| a.kind.param_info()).find(|p| p.name == "output.weight").unwrap();
    let std = 4096f64.powf(-0.5);
    assert_eq!(out.init, titan_ir::Init::TruncNormal { std, lo: -3.0 * std, hi: 3.0 * std, depth_scaled: false });
}

// ---- validation ----

#[test]
fn overrides_apply_on_top_of_a_preset() {
    let mut cfg = LlamaConfig::preset(Preset::Debug);
    let o = LlamaOverrides { n_layers: Some(4), dim: Some(128), dtype: Some(DType::F32), tie_embeddings: Some(true), ..Default::default() };
    o.apply(&mut cfg);
    assert_eq!((cfg.n_layers, cfg.dim, cfg.dtype, cfg.tie_embeddings, cfg.n_heads), (4, 128, DType::F32, true, 4));
    assert_eq!(cfg.head_dim(), 32);
    cfg.validate().unwrap();
}

#[test]
fn invalid_configs_say_what_to_change() {
    let base = LlamaConfig::preset(Preset::Debug);
    assert_eq!(invalid(&LlamaConfig { n_heads: 6, ..base.clone() }), "n_heads=6 does not divide dim=64; choose n_heads in {1, 2, 4, 8, 16, 32, 64}");
    assert_eq!(invalid(&LlamaConfig { n_kv_heads: 3, ..base.clone() }), "n_kv_heads=3 does not divide n_heads=4; choose n_kv_heads in {1, 2, 4}");
    // dim 96 / 32 heads = 3: odd.
    let odd = invalid(&LlamaConfig { dim: 96, n_heads: 32, n_kv_heads: 8, ..base.clone() });
    assert_contains(&odd, "head_dim = dim / n_heads = 96 / 32 = 3 is odd");
    assert_contains(&odd, "choose n_heads in {1, 2, 3, 4, 6, 8, 12, 16, 24, 48}");
    for key in ["dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "seq_len", "batch_size"] {
        let mut cfg = base.clone();
        let o = LlamaOverrides {
            dim: (key == "dim").then_some(0),
            n_layers: (key == "n_layers").then_some(0),
            n_heads: (key == "n_heads").then_some(0),
            n_kv_heads: (key == "n_kv_heads").then_some(0),
            ffn_dim: (key == "ffn_dim").then_some(0),
            vocab_size: (key == "vocab_size").then_some(0),
            seq_len: (key == "seq_len").then_some(0),
            batch_size: (key == "batch_size").then_some(0),
            ..Default::default()
        };
        o.apply(&mut cfg);
        assert_eq!(invalid(&cfg), format!("{key}=0 must be positive; set {key} to 1 or more"));
    }
    assert_contains(
        &invalid(&LlamaConfig { dtype: DType::I32, ..base.clone() }),
        "dtype=i32 is not supported for model weights; choose dtype bf16, f16 or f32",
    );
    assert_contains(&invalid(&LlamaConfig { rope_theta: -1.0, ..base.clone() }), "rope_theta=-1 must be a positive number");
    assert_contains(&invalid(&LlamaConfig { norm_eps: 0.0, ..base.clone() }), "norm_eps=0 must be a positive number");
    assert_contains(&invalid(&LlamaConfig { vocab_size: 1 << 40, ..base.clone() }), "vocab_size=1099511627776 is too large");
    let huge = LlamaConfig { batch_size: 1 << 30, seq_len: 1 << 30, vocab_size: 1 << 30, ..base.clone() };
    assert_contains(&invalid(&huge), "(the logits)");
    let flat =
        LlamaConfig { rope_scaling: Some(RopeScaling { factor: 8.0, low_freq_factor: 4.0, high_freq_factor: 4.0, original_max_position: 8192 }), ..base };
    assert_contains(&invalid(&flat), "high_freq_factor=4 must be greater than low_freq_factor=4");
}

#[test]
fn build_rejects_invalid_configs_and_names() {
    let bad = LlamaConfig { n_heads: 5, ..LlamaConfig::preset(Preset::Debug) };
    assert!(matches!(build_llama3(&bad, "x"), Err(FrontendError::InvalidConfig(_))));
    assert!(matches!(build_llama3(&LlamaConfig::preset(Preset::Debug), "has space"), Err(FrontendError::InvalidConfig(_))));
}

// ---- Hugging Face configs ----

fn sample(name: &str) -> LlamaConfig {
    load_hf_config(&workspace().join("examples/hf").join(name)).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn hf_llama_3_2_1b_is_the_1b_preset() {
    assert_eq!(sample("llama-3.2-1b.json"), LlamaConfig::preset(Preset::B1));
}

#[test]
fn hf_llama_3_1_8b_is_the_8b_preset_with_rope_scaling() {
    let hf = sample("llama-3.1-8b.json");
    let p = LlamaConfig::preset(Preset::B8);
    assert_eq!(
        (hf.dim, hf.n_layers, hf.n_heads, hf.n_kv_heads, hf.ffn_dim, hf.vocab_size, hf.seq_len, hf.batch_size),
        (p.dim, p.n_layers, p.n_heads, p.n_kv_heads, p.ffn_dim, p.vocab_size, p.seq_len, p.batch_size)
    );
    assert_eq!((hf.rope_theta, hf.norm_eps, hf.tie_embeddings, hf.dtype), (p.rope_theta, p.norm_eps, p.tie_embeddings, p.dtype));
    // Llama 3 8B has no scaling; Llama 3.1 8B has the same scaling as 405B.
    assert_eq!(p.rope_scaling, None);
    assert_eq!(hf.rope_scaling, Some(RopeScaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 }));
    assert_eq!(hf.rope_scaling, LlamaConfig::preset(Preset::B405).rope_scaling);
}

/// The 1B sample with `edit` applied to its JSON object.
fn edited(edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> String {
    let text = std::fs::read_to_string(workspace().join("examples/hf/llama-3.2-1b.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(v.as_object_mut().unwrap());
    v.to_string()
}

fn hf_error(text: &str) -> String {
    match parse_hf_config("bad/config.json", text) {
        Ok(cfg) => panic!("expected an error, got {cfg:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_hf_configs_give_specific_messages() {
    use serde_json::json;
    let e = hf_error(&edited(|o| {
        o.remove("hidden_size");
    }));
    assert_contains(&e, "bad/config.json: missing key `hidden_size`");
    let e = hf_error(&edited(|o| {
        o.insert("num_hidden_layers".into(), json!("16"));
    }));
    assert_contains(&e, "bad/config.json: key `num_hidden_layers` must be a non-negative integer, found a string `\"16\"`");
    let e = hf_error(&edited(|o| {
        o.insert("rope_scaling".into(), json!({"type": "linear", "factor": 2.0}));
    }));
    assert_contains(&e, "rope_scaling type `linear` is not supported yet");
    let e = hf_error(&edited(|o| {
        o.insert("attention_bias".into(), json!(true));
    }));
    assert_contains(&e, "attention_bias=true is not supported yet");
    let e = hf_error(&edited(|o| {
        o.insert("mlp_bias".into(), json!(true));
    }));
    assert_contains(&e, "mlp_bias=true is not supported yet");
    let e = hf_error(&edited(|o| {
        o.insert("hidden_act".into(), json!("gelu"));
    }));
    assert_contains(&e, "hidden_act `gelu` is not supported; Llama's feed-forward uses `silu`");
    let e = hf_error(&edited(|o| {
        o.insert("model_type".into(), json!("mistral"));
    }));
    assert_contains(&e, "model_type `mistral` is not supported");
    let e = hf_error(&edited(|o| {
        o.insert("head_dim".into(), json!(128));
    }));
    assert_contains(&e, "head_dim=128 differs from hidden_size / num_attention_heads = 2048 / 32");
    let e = hf_error(&edited(|o| {
        o.insert("torch_dtype".into(), json!("float64"));
    }));
    assert_contains(&e, "torch_dtype `float64` is not supported; use bfloat16, float16 or float32");
    let e = hf_error(&edited(|o| {
        o["rope_scaling"].as_object_mut().unwrap().remove("factor");
    }));
    assert_contains(&e, "missing key `rope_scaling.factor`");
    let e = hf_error(&edited(|o| {
        o.insert("rope_theta".into(), json!([1]));
    }));
    assert_contains(&e, "key `rope_theta` must be a number, found an array");
    assert_contains(&hf_error("{\"hidden_size\": 4096,"), "bad/config.json: invalid JSON: EOF while parsing");
    assert_contains(&hf_error("[1, 2]"), "expected a JSON object at the top level, found an array");
    let missing = load_hf_config(Path::new("no/such/config.json")).unwrap_err().to_string();
    assert_contains(&missing, "cannot read `no/such/config.json`");
}

#[test]
fn hf_rope_scaling_null_and_seq_len_default() {
    let text = edited(|o| {
        o.insert("rope_scaling".into(), serde_json::Value::Null);
        o.insert("max_position_embeddings".into(), serde_json::json!(4096));
        o.remove("num_key_value_heads");
    });
    let cfg = parse_hf_config("c.json", &text).unwrap();
    assert_eq!((cfg.rope_scaling, cfg.seq_len, cfg.n_kv_heads), (None, 4096, 32));
}

// ---- the CLI, in process ----

#[test]
fn cli_new_applies_overrides_after_the_hf_config() {
    let hf = workspace().join("examples/hf/llama-3.2-1b.json");
    let out = run_args(["titanc", "new", "llama3", "--from-hf", hf.to_str().unwrap(), "--seq-len", "128", "--n-layers", "2", "--no-tie-embeddings"]).unwrap();
    assert_contains(&out.stdout, "graph @llama3_custom {");
    assert_contains(&out.stdout, "dims {batch = 1, seq = 128}");
    assert_contains(&out.stdout, "count = 2");
    assert_contains(&out.stdout, "output.weight");
    assert_contains(&out.stdout, "rope_scaling_factor = 32.0");
}

#[test]
fn cli_errors_are_specific() {
    let err = |args: &[&str]| run_args(args.iter().copied()).unwrap_err().render();
    assert_contains(&err(&["titanc", "new", "gpt2", "--preset", "debug"]), "unknown model family `gpt2`; choose one of: llama3");
    assert_contains(&err(&["titanc", "new", "llama3", "--preset", "debug", "--n-kv-heads", "3"]), "n_kv_heads=3 does not divide n_heads=4");
    assert_contains(&err(&["titanc", "new", "llama3", "--preset", "debug", "--dim", "0"]), "invalid value '0' for '--dim <DIM>': the value must be at least 1");
    assert_contains(&err(&["titanc", "new", "llama3", "--preset", "debug", "--dtype", "f64"]), "unknown dtype `f64`");
    assert_contains(&err(&["titanc", "new", "llama3"]), "--preset <PRESET>|--from-hf <CONFIG_JSON>");
    assert_contains(&err(&["titanc", "lower", "m.ir", "--to", "inference"]), "unknown lowering target `inference`; choose one of: train");
    assert_contains(&err(&["titanc", "lower", "m.ir", "--to", "train", "--decay", "step"]), "unknown --decay `step`; choose one of: cosine, linear, constant");
    assert_contains(&err(&["titanc", "lower", "m.ir", "--to", "train", "--beta2", "1"]), "--beta2 1 must be at least 0 and below 1");
    assert_contains(&err(&["titanc", "lower", "m.ir", "--to", "train", "--lr", "-1"]), "--lr -1 must be a positive number such as 8e-4");
    assert_contains(&err(&["titanc", "new", "llama3", "--preset", "debug", "--norm-eps", "-1e-5"]), "norm_eps=-0.00001 must be a positive number");
}

#[test]
fn cli_lower_options_map_to_train_options() {
    use clap::Parser;
    use titan_compiler::cli::{Cli, Command};
    let cli = Cli::try_parse_from(["titanc", "lower", "m.ir", "--to", "train", "--lr", "3e-4", "--max-norm", "0", "--decay", "cosine", "--warmup-steps", "10"])
        .unwrap();
    let Command::Lower(a) = &cli.command else { panic!("expected lower") };
    let o = a.train_options().unwrap();
    assert_eq!((o.lr, o.max_norm, o.decay, o.warmup_steps), (3e-4, None, titan_ir::DecayKind::Cosine, 10));
    assert_eq!(o.beta2, 0.95, "unset flags keep TorchTitan's defaults");
}

#[test]
fn cli_build_flags_override_the_job_config() {
    use clap::Parser;
    use titan_compiler::JobConfig;
    use titan_compiler::cli::{Cli, Command};
    let job = JobConfig::parse(
        "job.toml",
        "[optimizer]\nlr = 3e-3\nweight_decay = 0.01\n[lr_scheduler]\nwarmup_steps = 10\ndecay_type = \"cosine\"\n[training]\nsteps = 200\nmax_norm = 0\n",
    )
    .unwrap();
    let options = |args: &[&str]| {
        let cli = Cli::try_parse_from(args).unwrap();
        let Command::Build(a) = &cli.command else { panic!("expected build") };
        a.build_options(Some(&job)).unwrap().train
    };
    let o = options(&["titanc", "build", "m.ir", "-o", "out"]);
    assert_eq!((o.lr, o.weight_decay, o.warmup_steps, o.decay_steps, o.max_norm), (3e-3, 0.01, 10, 190, None));
    assert_eq!(o.decay, titan_ir::DecayKind::Cosine);
    assert_eq!(o.beta1, 0.9, "keys the file leaves out keep titanc's defaults");
    // Flags win; --warmup-steps also moves the decay derived from training.steps.
    let o = options(&["titanc", "build", "m.ir", "-o", "out", "--lr", "1e-3", "--warmup-steps", "50", "--max-norm", "2"]);
    assert_eq!((o.lr, o.warmup_steps, o.decay_steps, o.max_norm), (1e-3, 50, 150, Some(2.0)));
    let o = options(&["titanc", "build", "m.ir", "-o", "out", "--decay-steps", "7", "--decay", "linear"]);
    assert_eq!((o.decay_steps, o.decay), (7, titan_ir::DecayKind::Linear));
}

/// A scratch directory under the target's temp dir for one test.
fn scratch(test: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("frontend-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

/// Every unsigned flag of every command refuses a negative number saying the bound, rather than
/// taking `-1` for an unknown argument.
#[test]
fn every_unsigned_flag_says_its_bound_for_a_negative_number() {
    use clap::CommandFactory;
    use std::any::TypeId;
    let cmd = titan_compiler::cli::Cli::command();
    let unsigned = [TypeId::of::<u64>(), TypeId::of::<u32>(), TypeId::of::<u16>(), TypeId::of::<usize>()];
    let mut checked = Vec::new();
    for sub in cmd.get_subcommands() {
        for arg in sub.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if !unsigned.iter().any(|t| arg.get_value_parser().type_id() == *t) {
                continue;
            }
            let flag = format!("--{long}");
            let e = run_args(["titanc", sub.get_name(), &flag, "-1"]).unwrap_err().render();
            assert_contains(&e, &format!("invalid value '-1' for '{flag}"));
            assert!(e.contains("-1 is negative; the value must be at least 1") || e.contains("-1 is negative; the value must be 0 or more"), "{e}");
            checked.push(format!("{} {flag}", sub.get_name()));
        }
    }
    for want in ["new --dim", "new --batch-size", "lower --warmup-steps", "build --decay-steps"] {
        assert!(checked.iter().any(|c| c == want), "{want} not checked: {checked:?}");
    }
}

/// `titanc lower --to train` and `titanc build` of a training graph say what it is and what to do.
#[test]
fn a_training_graph_is_refused_where_a_model_graph_is_expected() {
    let dir = scratch("train-graph");
    let model = dir.join("model.ir");
    let train = dir.join("train.ir");
    let (m, t) = (model.to_str().unwrap(), train.to_str().unwrap());
    run_args(["titanc", "new", "llama3", "--preset", "debug", "-o", m]).unwrap();
    run_args(["titanc", "lower", m, "--to", "train", "-o", t]).unwrap();
    let out = dir.join("out");
    for args in [vec!["titanc", "lower", t, "--to", "train"], vec!["titanc", "build", t, "-o", out.to_str().unwrap()]] {
        let e = run_args(args.iter().copied()).unwrap_err().render();
        assert_contains(&e, &format!("`{t}` is already a training-step graph (its meta has step = \"train\")"));
        assert_contains(&e, "take the model graph (`titanc new ...`)");
        assert_contains(&e, "titan-run runs a training graph directly");
        assert!(!e.contains("autodiff"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn hf_configs_accept_a_byte_order_mark_and_name_the_file_in_every_error() {
    let text = std::fs::read_to_string(workspace().join("examples/hf/llama-3.2-1b.json")).unwrap();
    let with_bom = parse_hf_config("bom/config.json", &format!("\u{feff}{text}")).expect("a UTF-8 BOM is accepted");
    assert_eq!(with_bom, LlamaConfig::preset(Preset::B1));
    let e = hf_error(&edited(|o| {
        o.insert("num_attention_heads".into(), serde_json::json!(0));
    }));
    assert_contains(&e, "bad/config.json: num_attention_heads=0 must be at least 1");
    // Errors found when validating the configuration name the file too.
    let dir = scratch("hf");
    let file = dir.join("config.json");
    let f = file.to_str().unwrap();
    std::fs::write(
        &file,
        edited(|o| {
            o.insert("num_key_value_heads".into(), serde_json::json!(3));
        }),
    )
    .unwrap();
    let e = run_args(["titanc", "new", "llama3", "--from-hf", f]).unwrap_err().render();
    assert_contains(&e, &format!("error: {f}: n_kv_heads=3 does not divide n_heads=32"));
    std::fs::write(&file, format!("\u{feff}{text}")).unwrap();
    run_args(["titanc", "new", "llama3", "--from-hf", f, "--n-layers", "1"]).expect("a file with a BOM builds");
    let e = run_args(["titanc", "new", "llama3", "--from-hf", f, "--n-kv-heads", "5"]).unwrap_err().render();
    assert_contains(&e, &format!("error: {f}: n_kv_heads=5 does not divide n_heads=32"));
    assert_contains(&e, "(with the command-line overrides applied)");
    let _ = std::fs::remove_dir_all(&dir);
}
