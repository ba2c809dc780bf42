//! The artifact loader and the CPU artifact backend on hand-built artifacts: results identical to
//! graph mode, loop and carry semantics, memory-plan bugs caught, loading errors, and the
//! `titan-run` binary.

mod common;

use std::path::Path;
use std::process::Command;

use common::{BIGRAM_IR, Fixture, Scratch, bigram, looped, looped_ir, temp_dir, whole};
use titan_ir::DType;
use titan_ir::artifact::{BufRef, CollectiveOp, ReduceOp, Step};
use titan_runtime::{Artifact, BUNDLED_CORPUS, Batcher, CpuArtifactTrainer, CpuTrainer, Trainer, byte_tokens};

fn write(name: &str, f: &Fixture, graph: &str) -> Scratch {
    let dir = temp_dir(name);
    f.write(&dir, graph);
    dir
}

/// Losses of `steps` steps and the final states, from the same seed and batches.
fn train(t: &mut dyn Trainer, steps: usize, seed: u64) -> (Vec<f64>, Vec<(String, Vec<u32>)>) {
    let mut batcher = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), t.batch_size(), t.seq_len(), seed).expect("batcher");
    let losses = (0..steps).map(|_| t.step(&batcher.next_batch()).expect("step").loss).collect();
    let states = t.states().expect("states").into_iter().map(|(n, s)| (n, s.floats().expect("float state").iter().map(|x| x.to_bits()).collect())).collect();
    (losses, states)
}

fn graph_mode(ir: &str, steps: usize, seed: u64) -> (Vec<f64>, Vec<(String, Vec<u32>)>) {
    let g = titan_ir::parse_and_verify("fixture.ir", ir).expect("fixture graph");
    let mut t = CpuTrainer::new(&g, seed).expect("graph trainer");
    let (losses, mut states) = train(&mut t, steps, seed);
    states.sort();
    (losses, states)
}

fn artifact_mode(dir: &Path, steps: usize, seed: u64) -> (Vec<f64>, Vec<(String, Vec<u32>)>) {
    artifact_mode_with(dir, steps, seed, true)
}

fn artifact_mode_with(dir: &Path, steps: usize, seed: u64, streaming: bool) -> (Vec<f64>, Vec<(String, Vec<u32>)>) {
    let a = Artifact::load(dir).expect("load");
    let mut t = CpuArtifactTrainer::new(&a, seed).expect("artifact trainer");
    t.set_streaming(streaming);
    let (losses, mut states) = train(&mut t, steps, seed);
    states.sort();
    (losses, states)
}

#[test]
fn bigram_artifact_matches_graph_mode_bit_for_bit() {
    let dir = write("bigram", &bigram(), BIGRAM_IR);
    let want = graph_mode(BIGRAM_IR, 5, 3);
    for streaming in [true, false] {
        let got = artifact_mode_with(&dir, 5, 3, streaming);
        assert_eq!(got.0, want.0, "losses (streaming {streaming})");
        assert_eq!(got.1.len(), 3);
        assert!(got.1 == want.1, "state buffers differ from graph mode (streaming {streaming})");
    }
}

#[test]
fn bigram_artifact_trains() {
    let dir = write("bigram-trains", &bigram(), BIGRAM_IR);
    let (losses, _) = artifact_mode(&dir, 40, 0);
    let (first, last) = (losses[0], losses[35..].iter().sum::<f64>() / 5.0);
    assert!((first - 256f64.ln()).abs() < 0.1, "untrained loss {first}");
    assert!(last < first - 1.0, "loss did not fall: {losses:?}");
}

#[test]
fn reversed_loop_with_carry_matches_repeat_in_f32_and_bf16() {
    for dtype in [DType::F32, DType::BF16] {
        let l = looped(dtype);
        let ir = looped_ir(dtype.name());
        let dir = write(&format!("looped-{dtype}"), &l.fixture, &ir);
        let want = graph_mode(&ir, 2, 1);
        let got = artifact_mode(&dir, 2, 1);
        assert!(got.0.iter().all(|x| x.is_finite()));
        assert_eq!(got.0, want.0, "{dtype}: losses");
        assert_eq!(got.1, want.1, "{dtype}: states");
    }
}

#[test]
fn the_loop_uses_carries_and_layer_slices_as_documented() {
    let l = looped(DType::F32);
    let dir = write("looped-slices", &l.fixture, &looped_ir("f32"));
    let a = Artifact::load(&dir).expect("load");
    let mut t = CpuArtifactTrainer::new(&a, 0).expect("trainer");
    let mut batcher = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), 2, 8, 0).expect("batcher");
    t.step(&batcher.next_batch()).expect("step");
    // Reverse order: layer 2 runs first (t = 0) reading carry A, layer 0 last (t = 2) writing B.
    // Layer i's `tanh(h)` lands in slice i of `saved`; the last one is tanh of what carry A held
    // after t = 1.
    let a_buf = t.read_buffer(l.carry_a).expect("carry a");
    let saved = t.read_buffer(l.saved).expect("saved");
    let layer0: Vec<f32> = saved.layer(0).floats().expect("floats").to_vec();
    let want: Vec<f32> = a_buf.floats().expect("floats").iter().map(|x| x.tanh()).collect();
    assert_eq!(layer0, want);
}

/// Rewrite the loop body's layer slices of `l` as offset views (format 8) made by `view(buffer,
/// bytes per layer)`.
fn with_views(l: &mut common::Looped, view: impl Fn(u32, u64) -> BufRef) {
    let per = |id: u32| {
        let b = &l.fixture.buffers[id as usize];
        b.bytes / b.shape[0]
    };
    let sizes: Vec<(u32, u64)> = l.fixture.buffers.iter().filter(|b| b.shape.first() == Some(&3)).map(|b| (b.id, per(b.id))).collect();
    for s in &mut l.fixture.steps {
        let Step::Loop { body, .. } = s else { continue };
        for bs in body.iter_mut() {
            let Step::Launch { inputs, outputs, .. } = bs else { continue };
            for r in inputs.iter_mut().chain(outputs.iter_mut()) {
                if let BufRef::Buffer { buffer, layer: true } = *r
                    && let Some(&(_, bytes)) = sizes.iter().find(|(id, _)| *id == buffer)
                {
                    *r = view(buffer, bytes);
                }
            }
        }
    }
}

/// An offset view with the layer's stride addresses exactly what a layer slice does; one whose
/// last iteration would end past its buffer, or that cuts an element, is refused at load.
#[test]
fn offset_views_address_layer_slices_and_are_checked_at_load() {
    let ir = looped_ir("f32");
    let mut l = looped(DType::F32);
    with_views(&mut l, |buffer, bytes| BufRef::View { buffer, offset: 0, bytes, stride: bytes, ring: None });
    let dir = write("views", &l.fixture, &ir);
    assert_eq!(artifact_mode(&dir, 2, 1), graph_mode(&ir, 2, 1), "views equal layer slices");

    let mut l = looped(DType::F32);
    with_views(&mut l, |buffer, bytes| BufRef::View { buffer, offset: 4, bytes, stride: bytes, ring: None });
    let dir = write("views-past", &l.fixture, &ir);
    let e = Artifact::load(&dir).expect_err("a view past its buffer").to_string();
    assert!(e.contains("ends past its"), "{e}");

    let mut l = looped(DType::F32);
    with_views(&mut l, |buffer, bytes| BufRef::View { buffer, offset: 2, bytes: bytes - 4, stride: bytes, ring: None });
    let dir = write("views-cut", &l.fixture, &ir);
    let e = Artifact::load(&dir).expect_err("a view cutting an element").to_string();
    assert!(e.contains("does not fall on f32 elements"), "{e}");
}

/// Two buffers live at the same time on the same bytes (the second carry slot on top of the
/// stacked output, as a broken planner might place them) corrupted the result; the loader now
/// refuses the plan, naming the buffer.
#[test]
fn an_overlapping_memory_plan_is_refused() {
    let mut l = looped(DType::F32);
    let saved_offset = l.fixture.buffers[l.saved as usize].offset;
    l.fixture.buffers[l.carry_b as usize].offset = saved_offset;
    let dir = write("overlap", &l.fixture, &looped_ir("f32"));
    let e = Artifact::load(&dir).expect_err("overlapping live buffers").to_string();
    let later = l.saved.max(l.carry_b);
    assert!(e.contains(&format!("manifest.json: buffers[{later}].offset: bytes ")) && e.contains("while both are live"), "{e}");
}

#[test]
fn reading_memory_nothing_wrote_poisons_the_loss() {
    let mut l = looped(DType::F32);
    l.fixture.steps.retain(|s| !matches!(s, Step::Memset { .. }));
    let dir = write("poison", &l.fixture, &looped_ir("f32"));
    let (losses, _) = artifact_mode(&dir, 1, 1);
    assert!(losses[0].is_nan(), "a bias nobody zeroed must read as NaN, got {}", losses[0]);
}

/// Load a copy of the bigram artifact whose manifest JSON went through `edit`.
fn load_edited(name: &str, edit: impl Fn(&mut serde_json::Value)) -> String {
    let dir = write(name, &bigram(), BIGRAM_IR);
    let path = dir.join("manifest.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    edit(&mut v);
    std::fs::write(&path, serde_json::to_string_pretty(&v).expect("json")).expect("write");
    Artifact::load(&dir).expect_err("must not load").to_string()
}

#[test]
fn loading_errors_say_what_to_do() {
    let missing = temp_dir("missing").join("nope");
    let e = Artifact::load(&missing).expect_err("missing dir").to_string();
    assert!(e.contains("no such directory") && e.contains("titanc build"), "{e}");

    let empty = temp_dir("empty");
    let e = Artifact::load(&empty).expect_err("no manifest").to_string();
    assert!(e.contains("manifest.json") && e.contains("not a titan artifact") && e.contains("titanc build"), "{e}");

    let e = load_edited("version", |v| v["format_version"] = 99.into());
    assert!(e.contains("format version 99") && e.contains("rebuild"), "{e}");
    // The version is checked before anything else: a future manifest with other fields still
    // gets the version message.
    let future = titan_ir::artifact::FORMAT_VERSION + 1;
    let e = load_edited("version-first", |v| {
        v["format_version"] = future.into();
        v["buffers"] = "something new".into();
    });
    assert!(e.contains(&format!("format version {future}")), "{e}");

    let e = load_edited("target", |v| v["target"]["arch"] = "sm_80".into());
    assert!(e.contains("built for sm_80") && e.contains("--target sm_90a"), "{e}");

    let e = load_edited("bufref", |v| v["ranks"][0]["steps"][1]["inputs"][0]["buffer"] = 777.into());
    assert!(e.contains("buffer 777 does not exist") && e.contains("rank 0, step 1"), "{e}");

    let e = load_edited("body", |v| v["kernels"][0]["body"] = "k_gone".into());
    assert!(e.contains("`@k_gone` is not a block of graph.ir"), "{e}");

    let e = load_edited("arena", |v| v["buffers"][3]["offset"] = (1u64 << 40).into());
    assert!(e.contains("outside its arena"), "{e}");

    let e = load_edited("layer-outside-loop", |v| v["ranks"][0]["steps"][0]["inputs"][1]["layer"] = true.into());
    assert!(e.contains("layer slice") && e.contains("outside any loop"), "{e}");

    let e = load_edited("carry-outside-loop", |v| v["ranks"][0]["steps"][0]["inputs"][1] = serde_json::json!({"carry": 0, "out": false}));
    assert!(e.contains("carry 0 outside any loop"), "{e}");

    let e = load_edited("binding", |v| v["ranks"][0]["steps"][0]["inputs"] = serde_json::json!([{"buffer": 1}, {"buffer": 1}]));
    assert!(e.contains("the kernel expects f32[256, 256]"), "{e}");

    let e = load_edited("missing-cubin", |v| {
        v["kernels"][0]["ptx"] = "kernels/k0.ptx".into();
        v["kernels"][0]["cubin"] = "kernels/k0.cubin".into();
    });
    assert!(e.contains("k0.cubin") && e.contains("not found") && e.contains("rebuild"), "{e}");

    let e = load_edited("cubin-without-ptx", |v| v["kernels"][0]["cubin"] = "kernels/k0.cubin".into());
    assert!(e.contains("lists the cubin") && e.contains("no PTX"), "{e}");

    // A listed cubin that exists loads, and the CPU backend ignores it.
    let dir = write("cubin", &bigram(), BIGRAM_IR);
    let path = dir.join("manifest.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    v["kernels"][0]["ptx"] = "kernels/main.k_fwd.ptx".into();
    v["kernels"][0]["cubin"] = "kernels/main.k_fwd.cubin".into();
    v["kernels"][0]["entry"] = "k_fwd".into();
    v["kernels"][0]["launch"] = serde_json::json!({"grid": [1, 1, 1], "block": [128, 1, 1], "shared_bytes": 0});
    std::fs::write(&path, serde_json::to_string_pretty(&v).expect("json")).expect("write");
    std::fs::create_dir_all(dir.join("kernels")).expect("mkdir");
    std::fs::write(dir.join("kernels/main.k_fwd.cubin"), b"\x7fELF").expect("write");
    std::fs::write(dir.join("kernels/main.k_fwd.ptx"), ".version 8.0").expect("write");
    let a = Artifact::load(&dir).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a.manifest.kernels[0].cubin.as_deref(), Some("kernels/main.k_fwd.cubin"));
    let (losses, _) = artifact_mode(&dir, 1, 0);
    assert!(losses[0].is_finite());

    let dir = write("corrupt", &bigram(), BIGRAM_IR);
    std::fs::write(dir.join("manifest.json"), "{\"format_version\": 1, \"buffers\": [").expect("write");
    let e = Artifact::load(&dir).expect_err("corrupt").to_string();
    assert!(e.contains("is not a titan manifest"), "{e}");

    let dir = write("no-graph", &bigram(), BIGRAM_IR);
    std::fs::remove_file(dir.join("graph.ir")).expect("rm");
    let e = Artifact::load(&dir).expect_err("no graph").to_string();
    assert!(e.contains("graph.ir") && e.contains("rebuild"), "{e}");
}

#[test]
fn layer_slices_need_the_loop_count_as_dim_0() {
    let mut l = looped(DType::F32);
    if let Some(Step::Loop { count, .. }) = l.fixture.steps.iter_mut().find(|s| matches!(s, Step::Loop { .. })) {
        *count = 2;
    }
    let dir = write("bad-count", &l.fixture, &looped_ir("f32"));
    let e = Artifact::load(&dir).expect_err("bad count").to_string();
    assert!(e.contains("its dim 0 must be the loop count"), "{e}");
    let mut l = looped(DType::F32);
    l.fixture.steps.push(Step::Memset { dst: BufRef::Buffer { buffer: l.bias, layer: false }, bytes: 1 << 20, stream: 0 });
    let dir = write("bad-memset", &l.fixture, &looped_ir("f32"));
    let e = Artifact::load(&dir).expect_err("bad memset").to_string();
    assert!(e.contains("zeroes 1048576 bytes"), "{e}");
    let _ = whole;
}

/// A collective step in an artifact without a mesh (or over a mesh dim it lacks) is refused at
/// load, naming the step.
#[test]
fn a_collective_step_needs_the_mesh_it_names() {
    let mut l = looped(DType::F32);
    let r = BufRef::Buffer { buffer: l.bias, layer: false };
    l.fixture.steps.push(Step::Collective {
        collective: CollectiveOp::AllReduce,
        mesh_dim: "tp".into(),
        group: 2,
        dim: None,
        reduce: Some(ReduceOp::Sum),
        dtype: DType::F32,
        in_shape: vec![1],
        out_shape: vec![1],
        input: r,
        output: r,
        more_inputs: vec![],
        shift: None,
        send_bytes: 4,
        stream: 0,
    });
    let dir = write("collective-without-mesh", &l.fixture, &looped_ir("f32"));
    let e = Artifact::load(&dir).expect_err("no mesh").to_string();
    assert!(e.contains("manifest.json: ranks[0].steps[5].group: a collective over 2 ranks of `tp`, but the artifact's mesh (world size 1) has 1 there"), "{e}");
}

fn titan_run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_titan-run")).args(args).output().expect("run titan-run");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn titan_run_trains_an_artifact_and_reports_memory() {
    let dir = write("cli", &bigram(), BIGRAM_IR);
    let (ok, stdout, stderr) = titan_run(&[dir.to_str().expect("utf-8 path"), "--steps", "30", "--log-every", "10"]);
    assert!(ok, "{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 4, "steps 1, 10, 20, 30:\n{stdout}");
    assert!(lines.iter().all(|l| l.starts_with("step: ") && l.contains("  tps: ") && l.contains("memory: ") && l.contains("(predicted)")), "{stdout}");
    assert!(stderr.contains("predicted peak memory"), "{stderr}");
    assert!(!stderr.contains('\u{1b}'), "no progress bar when stderr is not a terminal: {stderr:?}");
    let loss = |l: &str| -> f64 { l.split("loss:").nth(1).and_then(|r| r.split("  grad_norm").next()).and_then(|x| x.trim().parse().ok()).expect("loss") };
    assert!(loss(lines[3]) < loss(lines[0]) - 0.5, "{stdout}");

    let graph = dir.join("graph.ir");
    let (ok, stdout, stderr) = titan_run(&[graph.to_str().expect("utf-8 path"), "--steps", "2"]);
    assert!(ok, "graph mode: {stderr}");
    assert!(stderr.contains("graph mode") && !stdout.contains("memory:"), "{stderr}\n{stdout}");

    let (ok, _, stderr) = titan_run(&[dir.to_str().expect("utf-8 path"), "--backend", "cuda"]);
    assert!(!ok && stderr.contains("has no GPU code yet; use --backend cpu"), "{stderr}");

    let missing = dir.join("missing");
    let (ok, _, stderr) = titan_run(&[missing.to_str().expect("utf-8 path")]);
    assert!(!ok && stderr.contains("titanc build"), "{stderr}");
}

const SWAP_IR: &str = r#"graph @swap {
  meta {vocab_size = 256}
  dims {batch = 1, seq = 4}

  block @k_swap(%x: f32[4], %y: f32[4]) {
    %a = neg(%x) : f32[4]
    %b = neg(%y) : f32[4]
    return %b, %a
  }

  block @k_loss(%x: f32[4]) {
    %s = reduce_sum(%x) {axes = [0]} : f32[]
    return %s
  }

  func @main {
    input %tokens : i32[batch, seq]
    input %targets : i32[batch, seq]
    input %step : i32[]
    state %p : f32[4] {name = "p", init = normal(1.0)}
    state %q : f32[4] {name = "q", init = normal(1.0)}
    %loss = kernel(%p) {body = @k_loss, kind = fused} : f32[]
    %np, %nq = kernel(%p, %q) {body = @k_swap, kind = fused} : f32[4], f32[4]
    output loss = %loss
    update %p <- %np
    update %q <- %nq
  }
}
"#;

/// `p, q <- -q, -p` in place: the first result computed (`-p`, bound to `q`'s buffer) must wait
/// until `q` is read.
#[test]
fn streaming_keeps_in_place_updates_exact() {
    use titan_ir::artifact::BufferClass;
    let mut f = Fixture::new(1, 4, 256);
    f.input("tokens", DType::I32, &[1, 4]);
    f.input("targets", DType::I32, &[1, 4]);
    f.input("step", DType::I32, &[]);
    let p = f.state("p", "p", "normal(1.0)", &[4], BufferClass::Param);
    let q = f.state("q", "q", "normal(1.0)", &[4], BufferClass::Param);
    let loss = f.buffer("main.%loss", DType::F32, &[], BufferClass::Activation);
    f.buffers[loss as usize].output = Some("loss".into());
    let (k_swap, k_loss) = (f.kernel("k_swap", titan_ir::KernelKind::Fused), f.kernel("k_loss", titan_ir::KernelKind::Fused));
    f.steps = vec![common::launch(k_loss, vec![whole(p)], vec![whole(loss)]), common::launch(k_swap, vec![whole(p), whole(q)], vec![whole(p), whole(q)])];
    let dir = write("swap", &f, SWAP_IR);
    let want = graph_mode(SWAP_IR, 3, 0);
    assert_eq!(artifact_mode(&dir, 3, 0), want);
    assert_eq!(artifact_mode_with(&dir, 3, 0, false), want);
}
