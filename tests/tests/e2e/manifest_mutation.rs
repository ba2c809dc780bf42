//! The manifest verifier (`titan_runtime::manifest_check`) against real artifacts and corrupted
//! ones: every artifact the compiler writes loads (the debug model, an SPMD tp 2 x dp_shard 2
//! build, the 8B preset), and every corruption of the debug artifact that a deterministic
//! generator produces (buffers x mutation kinds, kernels x mutation kinds, the header, model,
//! dims, mesh, memory plan and schedule fields, missing files) is refused at load, naming the
//! field by its JSON path, so none of them runs.

use std::path::Path;

use titan_compiler::build::{BuildOptions, build_artifact};
use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::artifact::liveness::buffer_lifetimes;
use titan_ir::artifact::{Arena, BufferClass, CollectiveOp, MANIFEST_FILE, Manifest, MeshDim, Step};
use titan_ir::{DType, KernelKind, Mesh};
use titan_runtime::Artifact;

use crate::common::{Scratch, scratch};

fn build(preset: Preset, mesh: Mesh, name: &str) -> Scratch {
    let dir = scratch("manifest-mutation", name);
    let model = build_llama3(&LlamaConfig::preset(preset), preset.name()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let text = titan_ir::print::print_graph(&model);
    let opts = BuildOptions { mesh, ..BuildOptions::default() };
    build_artifact(&model, &text, &opts, dir.as_ref()).unwrap_or_else(|e| panic!("building {name}: {e}"));
    dir
}

fn read_manifest(dir: &Path) -> Manifest {
    let path = dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Manifest::from_json(&path.display().to_string(), &text).unwrap_or_else(|e| panic!("{e}"))
}

/// One corruption: what it does and the JSON path (prefix) the refusal must name.
struct Case {
    what: String,
    expect: String,
    edit: Edit,
}

enum Edit {
    /// Change the manifest.
    Manifest(Box<dyn Fn(&mut Manifest)>),
    /// Remove a file of the artifact (restored afterwards).
    RemoveFile(String),
}

fn case(what: impl Into<String>, expect: impl Into<String>, f: impl Fn(&mut Manifest) + 'static) -> Case {
    Case { what: what.into(), expect: expect.into(), edit: Edit::Manifest(Box::new(f)) }
}

/// Every corruption of `m`, deterministically enumerated.
fn corruptions(m: &Manifest) -> Vec<Case> {
    let mut cases = Vec::new();
    let lifetimes = buffer_lifetimes(m, 0);
    let arena_bytes = |a: Arena| m.memory.arenas.iter().find(|p| p.arena == a).map_or(0, |p| p.bytes);
    // Buffers x mutation kinds.
    for (i, b) in m.buffers.iter().enumerate() {
        let at = format!("buffers[{i}]");
        cases.push(case(format!("{at}: misaligned offset"), format!("{at}.offset"), move |m| m.buffers[i].offset += 128));
        cases.push(case(format!("{at}: wrong id"), format!("{at}.id"), move |m| m.buffers[i].id += 1000));
        cases.push(case(format!("{at}: wrong byte count"), format!("{at}.bytes"), move |m| m.buffers[i].bytes += 1));
        cases.push(case(format!("{at}: extra dim"), format!("{at}.bytes"), move |m| m.buffers[i].shape.push(3)));
        let other = if b.dtype == DType::BF16 { DType::F32 } else { DType::BF16 };
        cases.push(case(format!("{at}: dtype {other}"), format!("{at}.bytes"), move |m| m.buffers[i].dtype = other));
        let wrong = if b.arena == Arena::Activations { Arena::Params } else { Arena::Activations };
        cases.push(case(format!("{at}: arena"), format!("{at}.arena"), move |m| m.buffers[i].arena = wrong));
        cases.push(case(format!("{at}: empty name"), format!("{at}.name"), move |m| m.buffers[i].name.clear()));
        if b.bytes > 0 {
            let end = arena_bytes(b.arena);
            cases.push(case(format!("{at}: past its arena"), format!("{at}.offset"), move |m| m.buffers[i].offset = end));
            // On top of another buffer of its arena that is live at the same time (any buffer
            // of a packed arena), and at least as large, so it stays inside the arena.
            let planned = b.arena == Arena::Activations;
            let victim = m.buffers.iter().enumerate().find(|&(j, o)| {
                j != i
                    && o.arena == b.arena
                    && o.bytes >= b.bytes
                    && o.offset != b.offset
                    && (!planned || matches!((lifetimes[i], lifetimes[j]), (Some(x), Some(y)) if x.overlaps(&y)))
            });
            if let Some((j, o)) = victim {
                let off = o.offset;
                cases.push(case(format!("{at}: on the bytes of live buffers[{j}]"), "overlap buffers[", move |m| m.buffers[i].offset = off));
            }
        }
        match b.class {
            BufferClass::Param | BufferClass::OptimizerState | BufferClass::ComputeCopy => {
                let other = if b.state.as_ref().is_some_and(|s| s.init == "ones") { "zeros" } else { "ones" };
                for init in [
                    "normal(nan)",
                    "normal(-1.0)",
                    "normal(0.0)",
                    "normal(inf)",
                    "xavier(1.0)",
                    "normal(1.0, 2.0)",
                    "trunc_normal(0.02, 2.0, -2.0)",
                    "normal(",
                    other,
                ] {
                    cases.push(case(format!("{at}: init {init}"), format!("{at}.state.init"), move |m| {
                        if let Some(s) = &mut m.buffers[i].state {
                            s.init = init.into();
                        }
                    }));
                }
                cases.push(case(format!("{at}: unknown state name"), format!("{at}.state.name"), move |m| {
                    if let Some(s) = &mut m.buffers[i].state {
                        s.name.push_str(".renamed");
                    }
                }));
                cases.push(case(format!("{at}: no state"), format!("{at}.state"), move |m| m.buffers[i].state = None));
                cases.push(case(format!("{at}: fed"), format!("{at}.feed"), move |m| m.buffers[i].feed = Some("tokens".into())));
            }
            BufferClass::Input => {
                cases.push(case(format!("{at}: unknown feed"), format!("{at}.feed"), move |m| m.buffers[i].feed = Some("labels".into())));
                cases.push(case(format!("{at}: no feed"), format!("{at}.feed"), move |m| m.buffers[i].feed = None));
                cases.push(case(format!("{at}: input as activation"), format!("{at}."), move |m| {
                    m.buffers[i].class = BufferClass::Activation;
                }));
            }
            BufferClass::Grad | BufferClass::Activation => {
                cases.push(case(format!("{at}: state on a temporary"), format!("{at}.state"), move |m| {
                    m.buffers[i].state = Some(titan_ir::artifact::StateInfo { name: "x".into(), init: "zeros".into() })
                }));
                if b.output.is_none() {
                    cases.push(case(format!("{at}: a second loss"), "].output", move |m| m.buffers[i].output = Some("loss".into())));
                }
            }
        }
        if b.output.is_some() {
            cases.push(case(format!("{at}: unknown output"), format!("{at}.output"), move |m| m.buffers[i].output = Some("accuracy".into())));
        }
    }
    // The case: the loss on top of an activation live at the same time.
    if let Some(loss) = m.buffers.iter().position(|b| b.output.as_deref() == Some("loss")) {
        let live = m.buffers.iter().enumerate().find(|&(j, b)| {
            j != loss
                && b.arena == Arena::Activations
                && b.bytes >= m.buffers[loss].bytes
                && matches!((lifetimes[j], lifetimes[loss]), (Some(x), Some(y)) if x.overlaps(&y))
                && b.offset != m.buffers[loss].offset
        });
        let (j, off) = live.map(|(j, b)| (j, b.offset)).expect("an activation live with the loss");
        cases.push(case(format!("the loss on the bytes of buffers[{j}]"), "overlap buffers[", move |m| m.buffers[loss].offset = off));
    }
    // Kernels x mutation kinds.
    let first_ptx = m.kernels.iter().position(|k| k.ptx.is_some()).expect("a kernel with PTX");
    for (k, kern) in m.kernels.iter().enumerate() {
        let at = format!("kernels[{k}]");
        for kind in KernelKind::ALL.into_iter().filter(|&x| x != kern.kind) {
            cases.push(case(format!("{at}: kind {}", kind.name()), format!("{at}."), move |m| m.kernels[k].kind = kind));
        }
        cases.push(case(format!("{at}: wrong id"), format!("{at}.id"), move |m| m.kernels[k].id += 1));
        if k > 0 {
            let dup = m.kernels[0].name.clone();
            cases.push(case(format!("{at}: duplicate name"), format!("{at}.name"), move |m| m.kernels[k].name = dup.clone()));
        }
        cases.push(case(format!("{at}: path in the name"), format!("{at}.name"), move |m| m.kernels[k].name = format!("../{}", m.kernels[k].name)));
        cases.push(case(format!("{at}: bytes_read"), format!("{at}.bytes_read"), move |m| m.kernels[k].bytes_read += 2));
        cases.push(case(format!("{at}: bytes_written"), format!("{at}.bytes_written"), move |m| m.kernels[k].bytes_written = 0));
        cases.push(case(format!("{at}: unknown body"), format!("{at}.body"), move |m| m.kernels[k].body.push_str("_x")));
        if let Some(ptx) = &kern.ptx {
            cases.push(Case { what: format!("{at}: PTX file missing"), expect: format!("{at}.ptx"), edit: Edit::RemoveFile(ptx.clone()) });
            cases.push(case(format!("{at}: PTX elsewhere"), format!("{at}.ptx"), move |m| m.kernels[k].ptx = Some("kernels/../manifest.json".into())));
            cases.push(case(format!("{at}: no entry"), format!("{at}.entry"), move |m| m.kernels[k].entry = None));
            cases.push(case(format!("{at}: no launch"), format!("{at}.launch"), move |m| m.kernels[k].launch = None));
            cases.push(case(format!("{at}: huge block"), format!("{at}.launch"), move |m| {
                if let Some(l) = &mut m.kernels[k].launch {
                    l.block = [2048, 1, 1];
                }
            }));
            cases.push(case(format!("{at}: empty grid"), format!("{at}.launch"), move |m| {
                if let Some(l) = &mut m.kernels[k].launch {
                    l.grid[0] = 0;
                }
            }));
            cases.push(case(format!("{at}: a GEMM descriptor"), format!("{at}.gemm"), move |m| {
                m.kernels[k].gemm = m.kernels.iter().find_map(|x| x.gemm.clone())
            }));
        }
        if kern.gemm.is_some() {
            cases.push(case(format!("{at}: no descriptor"), format!("{at}.gemm"), move |m| m.kernels[k].gemm = None));
            cases.push(case(format!("{at}: PTX on a GEMM"), format!("{at}.ptx"), move |m| m.kernels[k].ptx = m.kernels[first_ptx].ptx.clone()));
            for field in ["lda", "ldb", "ldc", "m"] {
                cases.push(case(format!("{at}: gemm.{field}"), format!("{at}.gemm."), move |m| {
                    if let Some(g) = &mut m.kernels[k].gemm {
                        match field {
                            "lda" => g.lda += 1,
                            "ldb" => g.ldb += 1,
                            "ldc" => g.ldc += 1,
                            _ => g.m = 0,
                        }
                    }
                }));
            }
            cases.push(case(format!("{at}: gemm.compute"), format!("{at}.gemm.compute"), move |m| {
                if let Some(g) = &mut m.kernels[k].gemm {
                    g.compute = DType::BF16;
                }
            }));
            cases.push(case(format!("{at}: gemm.epilogue unknown"), format!("{at}.gemm.epilogue"), move |m| {
                if let Some(g) = &mut m.kernels[k].gemm {
                    g.epilogue = "relu".into();
                }
            }));
            // The residual-add epilogue must match the body: [product, add] with three arguments.
            cases.push(case(format!("{at}: gemm.epilogue against the body"), format!("{at}.kind"), move |m| {
                if let Some(g) = &mut m.kernels[k].gemm {
                    g.epilogue = if g.epilogue == "add" { "none" } else { "add" }.into();
                }
            }));
        }
    }
    // Header, model, dims, mesh, training, memory plan, schedule.
    cases.push(case("content hash", "content_hash", |m| m.content_hash = "not-a-hash".into()));
    cases.push(case("model hash", "model_hash", |m| m.model_hash = Some("abc".into())));
    cases.push(case("ptx isa", "target.ptx_isa", |m| m.target.ptx_isa = "7.0".into()));
    for key in ["n_layers", "dim", "vocab_size", "n_heads", "n_kv_heads", "ffn_dim"] {
        cases.push(case(format!("model.{key} + 1"), format!("model.{key}"), move |m| {
            let v = m.model.get(key).and_then(serde_json::Value::as_u64).unwrap_or(0);
            m.model.insert(key.into(), serde_json::Value::from(v + 1));
        }));
    }
    cases.push(case("model.n_layers = -1", "model.n_layers", |m| {
        m.model.insert("n_layers".into(), serde_json::Value::from(-1));
    }));
    cases.push(case("model.arch", "model.arch", |m| {
        m.model.insert("arch".into(), serde_json::Value::from("gpt2"));
    }));
    cases.push(case("model.world_size on one device", "model.world_size", |m| {
        m.model.insert("world_size".into(), serde_json::Value::from(2));
    }));
    cases.push(case("model.mesh_tp on one device", "model.mesh_tp", |m| {
        m.model.insert("mesh_tp".into(), serde_json::Value::from(2));
    }));
    cases.push(case("dims.batch + 1", "dims", |m| *m.dims.entry("batch".into()).or_default() += 1));
    cases.push(case("dims.seq x 2", "dims", |m| *m.dims.entry("seq".into()).or_default() *= 2));
    cases.push(case("dims.extra", "dims", |m| {
        m.dims.insert("extra".into(), 3);
    }));
    cases.push(case("training.batch", "training.batch", |m| m.training.batch += 1));
    cases.push(case("training.seq_len", "training.seq_len", |m| m.training.seq_len += 1));
    cases.push(case("training.tokens_per_step", "training.tokens_per_step", |m| m.training.tokens_per_step += 1));
    cases.push(case("training.vocab_size", "training.vocab_size", |m| m.training.vocab_size += 1));
    cases.push(case("mesh.world_size", "mesh.world_size", |m| m.mesh.world_size = 2));
    cases.push(case("mesh.dims tp 2", "model", |m| {
        m.mesh = titan_ir::artifact::Mesh { world_size: 2, dims: vec![MeshDim { name: "tp".into(), size: 2 }] };
    }));
    cases.push(case("mesh.dims cp", "mesh.dims[0].name", |m| {
        m.mesh = titan_ir::artifact::Mesh { world_size: 2, dims: vec![MeshDim { name: "cp".into(), size: 2 }] };
    }));
    cases.push(case("mesh.dims size 1", "mesh.dims[0].size", |m| {
        m.mesh = titan_ir::artifact::Mesh { world_size: 1, dims: vec![MeshDim { name: "tp".into(), size: 1 }] };
    }));
    cases.push(case("memory.peak_bytes", "memory.peak_bytes", |m| m.memory.peak_bytes += 256));
    cases.push(case("memory.activation_bytes_unplanned", "memory.activation_bytes_unplanned", |m| m.memory.activation_bytes_unplanned += 256));
    cases.push(case("memory.arenas[3].bytes misaligned", "memory.arenas[3].bytes", |m| m.memory.arenas[3].bytes += 1));
    cases.push(case("memory.arenas swapped", "memory.arenas[2].arena", |m| m.memory.arenas.swap(2, 3)));
    cases.push(case("memory.arenas one missing", "memory.arenas", |m| {
        m.memory.arenas.pop();
    }));
    cases.push(case("memory.arenas[3] too small", "].offset: bytes ", |m| {
        m.memory.peak_bytes -= m.memory.arenas[3].bytes;
        m.memory.arenas[3].bytes = 0;
    }));
    cases.push(case("ranks twice", "ranks", |m| m.ranks.push(m.ranks[0].clone())));
    cases.push(case("ranks[0].rank", "ranks[0].rank", |m| m.ranks[0].rank = 1));
    cases.push(case("report on one device", "report", |m| {
        m.report = Some(titan_ir::artifact::MeshReport {
            memory: titan_ir::artifact::RankMemory {
                params: 0,
                optimizer_state: 0,
                activations: 0,
                inputs: 0,
                gathered_weights: 0,
                gathered_weights_saved: 0,
                peak: 0,
            },
            comm: Vec::new(),
        })
    }));
    for (s, step) in m.ranks[0].steps.iter().enumerate() {
        let at = format!("ranks[0].steps[{s}]");
        match step {
            Step::Loop { carries, .. } => {
                cases.push(case(format!("{at}: count + 1"), format!("{at}.count"), move |m| {
                    if let Step::Loop { count, .. } = &mut m.ranks[0].steps[s] {
                        *count += 1;
                    }
                }));
                if !carries.is_empty() {
                    cases.push(case(format!("{at}: one slot"), format!("{at}.carries[0]"), move |m| {
                        if let Step::Loop { carries, .. } = &mut m.ranks[0].steps[s] {
                            carries[0][1] = carries[0][0];
                        }
                    }));
                }
                cases.push(case(format!("{at}: body stream"), format!("{at}.body[0].stream"), move |m| {
                    if let Step::Loop { body, .. } = &mut m.ranks[0].steps[s]
                        && let Some(Step::Launch { stream, .. } | Step::Copy { stream, .. } | Step::Memset { stream, .. } | Step::Collective { stream, .. }) =
                            body.first_mut()
                    {
                        *stream = 3;
                    }
                }));
            }
            _ => cases.push(case(format!("{at}: stream"), format!("{at}.stream"), move |m| match &mut m.ranks[0].steps[s] {
                Step::Launch { stream, .. } | Step::Copy { stream, .. } | Step::Memset { stream, .. } | Step::Collective { stream, .. } => *stream = 1,
                Step::Loop { .. } => {}
            })),
        }
    }
    // A launch writing over an operand it reads: a plain `scatter_add` over its last input
    // (only one with its add, fusion rule 12, may), and the first other kernel over its first.
    let kind = |k: u32| m.kernels.get(k as usize).map(|k| k.kind);
    let launches = m.ranks[0].steps.iter().enumerate().filter_map(|(s, step)| match step {
        Step::Launch { kernel, inputs, outputs, .. } if !inputs.is_empty() && !outputs.is_empty() => Some((s, kind(*kernel))),
        _ => None,
    });
    let scatter = launches.clone().find(|&(_, k)| k == Some(KernelKind::ScatterAdd)).map(|(s, _)| (s, true));
    let other = launches.clone().find(|&(_, k)| !matches!(k, Some(KernelKind::ScatterAdd | KernelKind::Optimizer))).map(|(s, _)| (s, false));
    assert!(scatter.is_some() && other.is_some(), "the debug schedule has a scatter_add launch and another");
    for (s, last) in scatter.into_iter().chain(other) {
        let at = format!("ranks[0].steps[{s}]");
        cases.push(case(format!("{at}: output over an input"), format!("{at}.outputs[0]"), move |m| {
            if let Step::Launch { inputs, outputs, .. } = &mut m.ranks[0].steps[s] {
                outputs[0] = if last { inputs[inputs.len() - 1] } else { inputs[0] };
            }
        }));
    }
    cases
}

/// Run every case on a copy of the artifact in `dir`: each must be refused naming its field.
fn refuse_all(dir: &Path, cases: Vec<Case>) -> usize {
    let original = std::fs::read_to_string(dir.join(MANIFEST_FILE)).expect("manifest");
    let manifest = read_manifest(dir);
    let mut accepted = Vec::new();
    let mut misnamed = Vec::new();
    let n = cases.len();
    for c in cases {
        let mut removed = None;
        match &c.edit {
            Edit::Manifest(f) => {
                let mut m = manifest.clone();
                f(&mut m);
                std::fs::write(dir.join(MANIFEST_FILE), m.to_json()).expect("write manifest");
            }
            Edit::RemoveFile(file) => {
                let path = dir.join(file);
                removed = Some((path.clone(), std::fs::read(&path).expect("read file")));
                std::fs::remove_file(&path).expect("remove file");
            }
        }
        match Artifact::load(dir) {
            Ok(_) => accepted.push(c.what.clone()),
            Err(e) => {
                let msg = e.to_string();
                if !msg.contains(&format!("{MANIFEST_FILE}: ")) || !msg.contains(&c.expect) {
                    misnamed.push(format!("{}: expected `{}`, got: {msg}", c.what, c.expect));
                }
            }
        }
        if let Some((path, bytes)) = removed {
            std::fs::write(path, bytes).expect("restore file");
        }
        std::fs::write(dir.join(MANIFEST_FILE), &original).expect("restore manifest");
    }
    assert!(accepted.is_empty(), "{} of {n} corrupted manifests were accepted:\n{}", accepted.len(), accepted.join("\n"));
    assert!(misnamed.is_empty(), "{} of {n} refusals did not name the field:\n{}", misnamed.len(), misnamed.join("\n"));
    n
}

/// Every artifact the compiler writes loads: the debug model, SPMD tp 2 x dp_shard 2, and the
/// 8B preset (all 32 layers).
#[test]
fn real_artifacts_pass_the_manifest_verifier() {
    for (preset, mesh, name) in
        [(Preset::Debug, Mesh::new(1, 1, 1), "debug"), (Preset::Debug, Mesh::new(1, 2, 2), "tp2-dps2"), (Preset::B8, Mesh::new(1, 1, 1), "8b")]
    {
        let dir = build(preset, mesh, name);
        if let Err(e) = Artifact::load(&*dir) {
            panic!("{name}: the compiler's own artifact is refused: {e}");
        }
    }
}

/// Hundreds of corruptions of the debug artifact, every one refused with its JSON path; and a
/// few of the SPMD artifact's mesh fields.
#[test]
fn corrupted_manifests_are_refused_naming_the_field() {
    let dir = build(Preset::Debug, Mesh::new(1, 1, 1), "corrupt-debug");
    let m = read_manifest(&dir);
    let n = refuse_all(&dir, corruptions(&m));
    println!("{n} corrupted debug manifests refused");
    assert!(n >= 500, "only {n} cases");

    let dir = build(Preset::Debug, Mesh::new(1, 2, 2), "corrupt-spmd");
    let m = read_manifest(&dir);
    let mut cases = vec![
        case("mesh without tp", "mesh.world_size", |m| {
            m.mesh.dims.retain(|d| d.name != "tp");
        }),
        case("mesh dims reversed", "mesh.dims[1].name", |m| m.mesh.dims.reverse()),
        case("model.mesh_tp", "model.mesh_tp", |m| {
            m.model.insert("mesh_tp".into(), serde_json::Value::from(4));
        }),
        case("model.world_size", "model.world_size", |m| {
            m.model.insert("world_size".into(), serde_json::Value::from(8));
        }),
        case("no report", "report", |m| m.report = None),
        case("report.memory.peak", "report.memory.peak", |m| {
            if let Some(r) = &mut m.report {
                r.memory.peak += 1;
            }
        }),
        case("report.comm[0]", "report.comm[0]", |m| {
            if let Some(r) = &mut m.report {
                r.comm[0].group = 3;
            }
        }),
    ];
    fn first_collective(steps: &mut [Step]) -> Option<&mut Step> {
        for s in steps {
            match s {
                Step::Collective { collective, .. } if *collective != CollectiveOp::TakeShard && *collective != CollectiveOp::PlaceShard => return Some(s),
                Step::Loop { body, .. } => {
                    if let Some(c) = first_collective(body) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        None
    }
    cases.push(case("collective send_bytes", ".send_bytes", |m| {
        if let Some(Step::Collective { send_bytes, .. }) = first_collective(&mut m.ranks[0].steps) {
            *send_bytes += 2;
        }
    }));
    let n = refuse_all(&dir, cases);
    assert_eq!(n, 8);
    drop(m);
}
