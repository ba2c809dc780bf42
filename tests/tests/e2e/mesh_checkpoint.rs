//! Checkpoints of mesh (SPMD) runs on the CPU simulated mesh: the f32 debug model's artifact
//! built for tp 2, dp_shard 2 and dp_replicate 2 x dp_shard 2 x tp 2 (and an SPMD graph in graph
//! mode). Every mesh writes the single-device format (full tensors, Hugging Face names), each
//! rank its own shards, and reads back its own slices, so:
//!
//! - 2 steps + checkpoint + resume to 4 gives the losses and states of 4 straight steps, bit for
//!   bit, on each mesh;
//! - a checkpoint reshards: written by dp_shard 2 it resumes on tp 2 and on one device (and one
//!   device's on dp_shard 2), the restored states bit-identical to the written ones, and the
//!   continued runs track the single-device run within the mesh tolerances of
//!   `artifact_mesh.rs` (losses 1e-5, states 5e-5);
//! - the files a mesh writes have exactly the single-device files' headers (names, shapes,
//!   offsets), and tensor values within the same state tolerance of the single-device run at the
//!   same step; resharded onto one device and saved again they are byte-identical;
//! - a checkpoint reshards without `--allow-different-build` when only the mesh (the build)
//!   differs: the model hash (`titan_passes::model_hash`) is the same, so a tp 2 checkpoint
//!   resumes on dp_shard 2 and on one device (and an SPMD graph's on one device), saying so;
//! - a checkpoint of another model or training configuration (another lr, another n_layers) is
//!   refused naming what differs, and with the flag refused with the tensor named, not a panic;
//!   one of a build without a model hash (older checkpoints) is matched on the content hash as
//!   before.
//!
//! The multi-process runs (`--nproc-per-node 2`) are in `launch.rs`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use titan_compiler::build::{BuildOptions, build_artifact};
use titan_compiler::{LlamaConfig, Preset};
use titan_ir::interp::Tensor;
use titan_ir::{Graph, Mesh, Placement};
use titan_passes::{TrainOptions, lower_to_train};
use titan_runtime::checkpoint::{self, CHECKPOINT_FORMAT_VERSION, CheckpointError, CheckpointMesh, MODEL_FILE, OPTIMIZER_FILE, RunIdentity, TrainerState};
use titan_runtime::{Artifact, ArtifactMeshTrainer, BUNDLED_CORPUS, Batcher, CpuArtifactTrainer, CpuTrainer, MeshTrainer, Trainer, byte_tokens};

const SEED: u64 = 3;
/// Tolerances of the mesh runs against the single-device run (`artifact_mesh.rs`).
const LOSS_TOL: f64 = 1e-5;
const STATE_TOL: f32 = 5e-5;

use crate::common::{Scratch, debug_f32, debug_f32_with, train_options};

fn scratch(name: &str) -> Scratch {
    crate::common::scratch("mesh-ckpt", name)
}

/// The debug model's artifact for `mesh` (one device for `Mesh::new(1, 1, 1)`).
fn artifact(mesh: Mesh, name: &str) -> (Scratch, Artifact) {
    artifact_with(debug_f32(), train_options(), mesh, name)
}

/// The artifact of model `m` trained with `train` for `mesh`.
fn artifact_with(m: Graph, train: TrainOptions, mesh: Mesh, name: &str) -> (Scratch, Artifact) {
    let dir = scratch(&format!("artifact-{name}"));
    let opts = BuildOptions { train, mesh, ..BuildOptions::default() };
    build_artifact(&m, &titan_ir::print::print_graph(&m), &opts, &dir.0).unwrap_or_else(|e| panic!("building {name}: {e}"));
    let a = Artifact::load(&dir.0).expect("load");
    (dir, a)
}

/// Run steps `from + 1 ..= to` on batches drawn from position `from`; the losses and the batcher.
fn steps(t: &mut dyn Trainer, seed: u64, from: u64, to: u64) -> (Vec<f64>, Batcher) {
    let mut b = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), t.batch_size(), t.seq_len(), seed).expect("batcher");
    b.seek(from);
    let losses = (from..to).map(|_| t.step(&b.next_batch()).expect("step").loss).collect();
    (losses, b)
}

/// Every state (gathered from its shards on a mesh) by name.
fn states(t: &dyn Trainer) -> BTreeMap<String, Tensor<f32>> {
    t.states().expect("states").into_iter().collect()
}

fn bits(t: &dyn Trainer) -> BTreeMap<String, Vec<u32>> {
    states(t).into_iter().map(|(n, s)| (n, s.floats().expect("float state").iter().map(|x| x.to_bits()).collect())).collect()
}

/// The largest element difference between two sets of states of the same names and shapes.
fn max_diff(a: &BTreeMap<String, Tensor<f32>>, b: &BTreeMap<String, Tensor<f32>>) -> (f32, String) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let mut worst = (0.0f32, String::new());
    for (name, x) in a {
        let y = &b[name];
        assert_eq!(x.shape, y.shape, "{name}");
        let d = x.floats().expect("floats").iter().zip(y.floats().expect("floats")).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
        if d > worst.0 {
            worst = (d, name.clone());
        }
    }
    worst
}

/// Save a checkpoint as `titan-run` does for a run of identity `id` (a content hash alone
/// writes no model hash, as before the model hash).
fn save(dir: &Path, t: &dyn Trainer, step: u64, data: &Batcher, id: impl Into<RunIdentity>) -> PathBuf {
    let id = id.into();
    let state = TrainerState {
        format_version: CHECKPOINT_FORMAT_VERSION,
        step,
        seed: SEED,
        data_position: data.position(),
        data_stream: None,
        content_hash: id.content_hash,
        data: "bundled corpus".into(),
        mesh: checkpoint::run_mesh(t),
        model_hash: id.model_hash,
        model_config: id.model_config,
    };
    checkpoint::save(dir, t, &state).expect("save")
}

/// 4 steps straight == 2 steps, checkpoint, a fresh trainer (another seed) resumed, 2 steps:
/// losses and final states bit for bit. `make` builds a trainer of the run with a seed.
fn check_resume<'a>(name: &str, hash: &RunIdentity, make: &dyn Fn(u64) -> Box<dyn Trainer + 'a>) {
    let mut full = make(SEED);
    let (want, _) = steps(full.as_mut(), SEED, 0, 4);
    let ckpt = scratch(&format!("resume-{name}"));
    let mut first = make(SEED);
    let (mut got, data) = steps(first.as_mut(), SEED, 0, 2);
    let written = save(&ckpt.0, first.as_ref(), 2, &data, hash);
    let at_2 = bits(first.as_ref());
    drop(first);
    let mut second = make(SEED + 1);
    let (_, st) = checkpoint::resume(&written, second.as_mut(), hash, false).expect("resume");
    assert_eq!(st.mesh, checkpoint::run_mesh(second.as_ref()));
    assert!(bits(second.as_ref()) == at_2, "{name}: restored states differ from the written ones");
    assert_eq!(second.steps_done(), 2);
    let (rest, _) = steps(second.as_mut(), st.seed, st.data_position, 4);
    got.extend(rest);
    println!("{name}: losses {got:?}");
    assert_eq!(got, want, "{name}: losses of the resumed run");
    assert!(bits(second.as_ref()) == bits(full.as_ref()), "{name}: final states differ from the uninterrupted run");
}

fn check_artifact_resume(mesh: Mesh, name: &str) {
    let (_dir, art) = artifact(mesh, name);
    let hash = RunIdentity::of_artifact(&art);
    check_resume(name, &hash, &|seed| Box::new(ArtifactMeshTrainer::new(&art, seed).expect("mesh trainer")));
}

#[test]
fn tp_2_artifact_resumes_bit_identically() {
    check_artifact_resume(Mesh::new(1, 1, 2), "tp2");
}

#[test]
fn dp_shard_2_artifact_resumes_bit_identically() {
    check_artifact_resume(Mesh::new(1, 2, 1), "fsdp2");
}

#[test]
fn dp_replicate_2_dp_shard_2_tp_2_artifact_resumes_bit_identically() {
    check_artifact_resume(Mesh::new(2, 2, 2), "hsdp2-fsdp2-tp2");
}

/// Graph mode on the simulated mesh (`MeshTrainer`), dp_shard 2 x tp 2.
#[test]
fn fsdp_tp_graph_resumes_bit_identically() {
    let mut m = debug_f32();
    Mesh::new(1, 2, 2).write_meta(&mut m);
    let g = lower_to_train(&m, &train_options()).expect("lowering");
    let hash = RunIdentity::of_graph(&titan_ir::print::print_graph(&g), &g);
    check_resume("graph-fsdp2-tp2", &hash, &|seed| Box::new(MeshTrainer::new(&g, seed).expect("mesh trainer")));
}

/// The bytes before the tensor data: length prefix and JSON header (names, shapes, offsets).
fn header(path: &Path) -> Vec<u8> {
    let bytes = std::fs::read(path).expect("read");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    bytes[..8 + n].to_vec()
}

#[test]
fn a_dp_shard_2_checkpoint_reshards_onto_tp_2_and_one_device() {
    let (_d1, single) = artifact(Mesh::new(1, 1, 1), "single");
    let (_d2, fsdp) = artifact(Mesh::new(1, 2, 1), "reshard-fsdp2");
    let (_d3, tp) = artifact(Mesh::new(1, 1, 2), "reshard-tp2");
    let hash = RunIdentity::of_artifact;

    // The single-device reference: 4 steps, and its checkpoint at step 2.
    let mut one = CpuArtifactTrainer::new(&single, SEED).expect("trainer");
    let (mut want, data) = steps(&mut one, SEED, 0, 2);
    let one_ckpt = scratch("reshard-one");
    let one_written = save(&one_ckpt.0, &one, 2, &data, hash(&single));
    let one_at_2 = states(&one);
    let (rest, _) = steps(&mut one, SEED, 2, 4);
    want.extend(rest);
    let one_at_4 = states(&one);

    // dp_shard 2: 2 steps and a checkpoint.
    let mut writer = ArtifactMeshTrainer::new(&fsdp, SEED).expect("mesh trainer");
    let (losses, data) = steps(&mut writer, SEED, 0, 2);
    let ckpt = scratch("reshard-fsdp2");
    let written = save(&ckpt.0, &writer, 2, &data, hash(&fsdp));
    let fsdp_at_2 = bits(&writer);
    let fsdp_at_2_states = states(&writer);

    // Its files: the single-device files' headers exactly, values within the mesh tolerance.
    for file in [MODEL_FILE, OPTIMIZER_FILE] {
        assert!(header(&written.join(file)) == header(&one_written.join(file)), "{file}: names, shapes or offsets differ from one device's");
        let (a, b) = (checkpoint::read_safetensors(&written.join(file)).expect("read"), checkpoint::read_safetensors(&one_written.join(file)).expect("read"));
        let d = a.iter().map(|(n, t)| t.values.iter().zip(&b[n].values).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max)).fold(0.0f32, f32::max);
        println!("{file} of dp_shard 2 vs one device at step 2: max |diff| {d:.3e}");
        assert!(d <= STATE_TOL, "{file}: {d}");
    }
    let (d, worst) = max_diff(&fsdp_at_2_states, &one_at_2);
    assert!(d <= STATE_TOL, "dp_shard 2 vs one device at step 2: `{worst}` by {d}");

    // Another mesh is another build of the same model: the model hashes agree.
    assert!(hash(&fsdp).content_hash != hash(&tp).content_hash && hash(&fsdp).model_hash.is_some());
    assert_eq!(hash(&fsdp).model_hash, hash(&tp).model_hash);
    assert_eq!(hash(&fsdp).model_hash, hash(&single).model_hash);
    // Without a model hash (the content hash alone, as before) it is refused, saying why and how.
    let mut on_tp = ArtifactMeshTrainer::new(&tp, SEED + 1).expect("mesh trainer");
    let e = checkpoint::resume(&written, &mut on_tp, &hash(&tp).content_hash, false).unwrap_err();
    assert!(matches!(e, CheckpointError::DifferentMesh { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("written on a mesh of dp_shard 2 and this run is on a mesh of tp 2") && msg.contains("--allow-different-build"), "{msg}");

    // Resharded onto tp 2 and onto one device without the flag: the restored states are the
    // written ones, bit for bit, and the runs go on like the single-device run.
    let mut on_one = CpuArtifactTrainer::new(&single, SEED + 1).expect("trainer");
    let targets: [(&str, &Artifact, &mut dyn Trainer); 2] = [("a mesh of tp 2", &tp, &mut on_tp), ("one device", &single, &mut on_one)];
    for (what, art, t) in targets {
        let (_, st) = checkpoint::resume(&written, t, hash(art), false).expect("resume");
        let note = checkpoint::check_identity(&st, &hash(art), checkpoint::run_mesh(t), false).expect("same model");
        assert_eq!(note, Some(format!("resharding a checkpoint of dp_shard 2 onto {what}")));
        assert_eq!(st.mesh, CheckpointMesh { dp_replicate: 1, dp_shard: 2, tp: 1 });
        assert!(bits(t) == fsdp_at_2, "{what}: the restored states differ from the written ones");
        let (rest, _) = steps(t, st.seed, st.data_position, 4);
        let got: Vec<f64> = losses.iter().copied().chain(rest).collect();
        let dl = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        let (ds, worst) = max_diff(&states(t), &one_at_4);
        println!("dp_shard 2 -> {what}: losses {got:?}; vs one device: max |dloss| {dl:.3e}, max |dstate| {ds:.3e} ({worst})");
        assert!(dl <= LOSS_TOL, "{what}: losses {got:?} vs {want:?}");
        assert!(ds <= STATE_TOL, "{what}: state `{worst}` differs by {ds}");
    }

    // One device's checkpoint on dp_shard 2: every rank takes its slices, exactly.
    let mut on_fsdp = ArtifactMeshTrainer::new(&fsdp, SEED + 1).expect("mesh trainer");
    checkpoint::resume(&one_written, &mut on_fsdp, "another build", true).expect("resume");
    let restored = states(&on_fsdp);
    assert_eq!(max_diff(&restored, &one_at_2).0, 0.0, "one device -> dp_shard 2");

    // The dp_shard 2 files resharded onto one device and saved from there: the same bytes.
    let mut back = CpuArtifactTrainer::new(&single, SEED + 2).expect("trainer");
    let (_, st) = checkpoint::resume(&written, &mut back, "another build", true).expect("resume");
    let again = scratch("reshard-again");
    let state = TrainerState { mesh: CheckpointMesh::default(), ..st };
    let rewritten = checkpoint::save(&again.0, &back, &state).expect("save");
    for file in [MODEL_FILE, OPTIMIZER_FILE] {
        assert!(std::fs::read(written.join(file)).expect("read") == std::fs::read(rewritten.join(file)).expect("read"), "{file} differs");
    }

    // --init-from on a mesh: the parameters only, each rank its slices; the moments stay zero.
    let mut init = ArtifactMeshTrainer::new(&tp, SEED + 3).expect("mesh trainer");
    checkpoint::init_from(&written.join(MODEL_FILE), &mut init).expect("init from");
    for (name, b) in bits(&init) {
        if checkpoint::is_optimizer_state(&name) {
            assert!(b.iter().all(|&x| x == 0), "{name} starts at zero");
        } else {
            assert_eq!(b, fsdp_at_2[&name], "{name}");
        }
    }
    assert_eq!(init.steps_done(), 0);

    // `Trainer::set_state` on a mesh takes the full tensor and gives every rank its slice.
    let (name, t) = one_at_2.iter().find(|(n, _)| n.contains("attention.wq.weight")).expect("wq");
    init.set_state(name, t.floats().expect("floats")).expect("set_state");
    assert_eq!(states(&init)[name].floats(), t.floats(), "{name}");
}

/// The vocab-parallel embedding: on dp_shard 2 x tp 2, `tok_embeddings.weight` is `Shard(0)`
/// on tp (vocabulary rows) and `Shard(1)` on dp_shard, so each rank writes a box of rows x
/// columns. The files are the single-device files (same headers), and one device reads back
/// the full tensors bit for bit.
#[test]
fn a_dp_shard_2_tp_2_checkpoint_holds_the_full_vocab_parallel_embedding() {
    let (_d1, single) = artifact(Mesh::new(1, 1, 1), "emb-single");
    let (_d2, mesh) = artifact(Mesh::new(1, 2, 2), "emb-fsdp2-tp2");
    let emb = mesh.graph.main.find("tok_embeddings").expect("tok_embeddings state");
    assert_eq!(mesh.graph.main.value(emb).placement, vec![Placement::Replicate, Placement::Shard(1), Placement::Shard(0)]);
    let mut one = CpuArtifactTrainer::new(&single, SEED).expect("trainer");
    let (_, data) = steps(&mut one, SEED, 0, 2);
    let one_ckpt = scratch("emb-one");
    let one_written = save(&one_ckpt.0, &one, 2, &data, &single.manifest.content_hash);
    let mut writer = ArtifactMeshTrainer::new(&mesh, SEED).expect("mesh trainer");
    let (_, data) = steps(&mut writer, SEED, 0, 2);
    let ckpt = scratch("emb-fsdp2-tp2");
    let written = save(&ckpt.0, &writer, 2, &data, &mesh.manifest.content_hash);
    for file in [MODEL_FILE, OPTIMIZER_FILE] {
        assert!(header(&written.join(file)) == header(&one_written.join(file)), "{file}: names, shapes or offsets differ from one device's");
    }
    let at_2 = bits(&writer);
    let mut back = CpuArtifactTrainer::new(&single, SEED + 1).expect("trainer");
    checkpoint::resume(&written, &mut back, "another build", true).expect("resume");
    assert!(bits(&back) == at_2, "the full tensors read on one device differ from the mesh's states");
    let (d, worst) = max_diff(&states(&back), &states(&one));
    assert!(d <= STATE_TOL, "dp_shard 2 x tp 2 vs one device at step 2: `{worst}` by {d}");
}

/// A checkpoint of another model (one layer fewer, as a graph-mode run writes it) on a tp 2
/// mesh: refused as another model naming `n_layers`, and with --allow-different-build refused
/// naming the tensor the mesh needs; nothing panics. Without model hashes (content hashes only,
/// as before) it is refused as another mesh.
#[test]
fn a_checkpoint_of_another_model_is_refused_on_a_mesh() {
    let small = debug_f32_with(LlamaConfig { n_layers: 1, ..LlamaConfig::preset(Preset::Debug) });
    let g_small = lower_to_train(&small, &train_options()).expect("lowering");
    let mut t = CpuTrainer::new(&g_small, SEED).expect("trainer");
    let (_, data) = steps(&mut t, SEED, 0, 1);
    let ckpt = scratch("other-model");
    let written = save(&ckpt.0, &t, 1, &data, RunIdentity::of_graph(&titan_ir::print::print_graph(&g_small), &g_small));

    let mut m = debug_f32();
    Mesh::new(1, 1, 2).write_meta(&mut m);
    let g = lower_to_train(&m, &train_options()).expect("lowering");
    let id = RunIdentity::of_graph(&titan_ir::print::print_graph(&g), &g);
    let mut mesh = MeshTrainer::new(&g, SEED).expect("mesh trainer");
    let before = bits(&mesh);
    let e = checkpoint::resume(&written, &mut mesh, &id, false).unwrap_err();
    assert!(matches!(e, CheckpointError::DifferentModel { .. }), "{e}");
    let e = e.to_string();
    assert!(
        e.contains("another model or training configuration (n_layers 1 in the checkpoint, 2 in this run;")
            && e.contains("--allow-different-build to force it"),
        "{e}"
    );
    let e = checkpoint::resume(&written, &mut mesh, "graph-fnv1a:big", false).unwrap_err().to_string();
    assert!(e.contains("written on one device and this run is on a mesh of tp 2") && e.contains("has no model hash"), "{e}");
    let e = checkpoint::resume(&written, &mut mesh, &id, true).unwrap_err().to_string();
    assert!(e.contains("has no tensor `model.layers.1.") && e.contains("is it a checkpoint of this model?"), "{e}");
    let e = checkpoint::init_from(&written.join(MODEL_FILE), &mut mesh).unwrap_err().to_string();
    assert!(e.contains("has no tensor `model.layers.1."), "{e}");
    assert!(bits(&mesh) == before, "a refused checkpoint changed the states");
}

/// A tp 2 checkpoint resumes on dp_shard 2 and on one device without --allow-different-build
/// (the model hashes agree; the content hashes do not), saying which layout it reshards from and
/// to: the states restored bit for bit, the runs tracking the tp 2 run's own continuation within
/// the mesh tolerances.
#[test]
fn a_tp_2_checkpoint_resumes_on_dp_shard_2_and_one_device_without_the_flag() {
    let (_d1, tp) = artifact(Mesh::new(1, 1, 2), "by-model-tp2");
    let (_d2, fsdp) = artifact(Mesh::new(1, 2, 1), "by-model-fsdp2");
    let (_d3, single) = artifact(Mesh::new(1, 1, 1), "by-model-single");
    let id = RunIdentity::of_artifact;
    for a in [&fsdp, &single] {
        assert_ne!(id(a).content_hash, id(&tp).content_hash);
        assert_eq!(id(a).model_hash, id(&tp).model_hash);
    }

    let mut writer = ArtifactMeshTrainer::new(&tp, SEED).expect("mesh trainer");
    let (mut want, data) = steps(&mut writer, SEED, 0, 2);
    let ckpt = scratch("by-model-tp2");
    let written = save(&ckpt.0, &writer, 2, &data, id(&tp));
    let at_2 = bits(&writer);
    let (rest, _) = steps(&mut writer, SEED, 2, 4);
    want.extend(rest);
    let at_4 = states(&writer);
    let json = std::fs::read_to_string(written.join(checkpoint::STATE_FILE)).expect("state");
    assert!(json.contains(&format!("\"model_hash\": \"{}\"", id(&tp).model_hash.expect("model hash"))) && json.contains("\"train_lr\": \"0.003\""), "{json}");

    let mut on_fsdp = ArtifactMeshTrainer::new(&fsdp, SEED + 1).expect("mesh trainer");
    let mut on_one = CpuArtifactTrainer::new(&single, SEED + 1).expect("trainer");
    let targets: [(&str, &Artifact, &mut dyn Trainer); 2] = [("a mesh of dp_shard 2", &fsdp, &mut on_fsdp), ("one device", &single, &mut on_one)];
    for (what, art, t) in targets {
        let (_, st) = checkpoint::resume(&written, t, id(art), false).unwrap_or_else(|e| panic!("{what}: {e}"));
        let note = checkpoint::check_identity(&st, &id(art), checkpoint::run_mesh(t), false).expect("same model");
        assert_eq!(note, Some(format!("resharding a checkpoint of tp 2 onto {what}")));
        assert!(bits(t) == at_2, "{what}: the restored states differ from the written ones");
        let (rest, _) = steps(t, st.seed, st.data_position, 4);
        let got: Vec<f64> = want[..2].iter().copied().chain(rest).collect();
        let dl = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        let (ds, worst) = max_diff(&states(t), &at_4);
        println!("tp 2 -> {what}: losses {got:?}; vs tp 2: max |dloss| {dl:.3e}, max |dstate| {ds:.3e} ({worst})");
        assert!(dl <= LOSS_TOL, "{what}: losses {got:?} vs {want:?}");
        assert!(ds <= STATE_TOL, "{what}: state `{worst}` differs by {ds}");
    }

    // The same checkpoint without the model hash (a trainer_state.json of an older titan-run):
    // matched on the content hash alone, so another mesh is refused as before; the flag forces it.
    let old: serde_json::Value = serde_json::from_str(&json).expect("json");
    let mut old = old.as_object().expect("object").clone();
    old.remove("model_hash");
    old.remove("model_config");
    std::fs::write(written.join(checkpoint::STATE_FILE), serde_json::to_string_pretty(&old).expect("json")).expect("write");
    let mut again = ArtifactMeshTrainer::new(&fsdp, SEED + 2).expect("mesh trainer");
    let e = checkpoint::resume(&written, &mut again, id(&fsdp), false).unwrap_err();
    assert!(matches!(e, CheckpointError::DifferentMesh { .. }), "{e}");
    assert!(
        e.to_string().contains("written on a mesh of tp 2 and this run is on a mesh of dp_shard 2")
            && e.to_string().contains("the checkpoint records no model hash"),
        "{e}"
    );
    let (_, st) = checkpoint::resume(&written, &mut again, id(&fsdp), true).expect("forced");
    let note = checkpoint::check_identity(&st, &id(&fsdp), checkpoint::run_mesh(&again), true).expect("forced");
    assert_eq!(
        note.as_deref(),
        Some("--allow-different-build: resuming a checkpoint of another build; resharding a checkpoint of tp 2 onto a mesh of dp_shard 2")
    );
    assert!(bits(&again) == at_2);
}

/// Graph mode: the SPMD graph of dp_shard 2 x tp 2 and the single-device graph lowered from the
/// same model record the same model hash, so the mesh's checkpoint resumes on one device without
/// the flag, restored bit for bit.
#[test]
fn an_spmd_graph_checkpoint_resumes_on_one_device_without_the_flag() {
    let mut m = debug_f32();
    Mesh::new(1, 2, 2).write_meta(&mut m);
    let spmd = lower_to_train(&m, &train_options()).expect("lowering");
    let one = lower_to_train(&debug_f32(), &train_options()).expect("lowering");
    let id = |g: &Graph| RunIdentity::of_graph(&titan_ir::print::print_graph(g), g);
    assert_eq!(id(&spmd).model_hash, id(&one).model_hash);
    assert_eq!(id(&spmd).model_config, id(&one).model_config);

    let mut writer = MeshTrainer::new(&spmd, SEED).expect("mesh trainer");
    let (_, data) = steps(&mut writer, SEED, 0, 2);
    let ckpt = scratch("graph-by-model");
    let written = save(&ckpt.0, &writer, 2, &data, id(&spmd));
    let mut t = CpuTrainer::new(&one, SEED + 1).expect("trainer");
    let (_, st) = checkpoint::resume(&written, &mut t, id(&one), false).expect("resume");
    let note = checkpoint::check_identity(&st, &id(&one), checkpoint::run_mesh(&t), false).expect("same model");
    assert_eq!(note.as_deref(), Some("resharding a checkpoint of dp_shard 2 x tp 2 onto one device"));
    assert!(bits(&t) == bits(&writer), "the restored states differ from the written ones");
}

/// A checkpoint of a run with another learning rate (same shapes) is refused naming it, and
/// resumes with --allow-different-build; the same model and options on the same mesh but
/// another build resumes as "another build of the same model".
#[test]
fn a_checkpoint_of_another_learning_rate_is_refused_naming_it() {
    let (_d1, a) = artifact(Mesh::new(1, 1, 1), "lr-3e-3");
    let (_d2, b) = artifact_with(debug_f32(), TrainOptions { lr: 1e-3, ..train_options() }, Mesh::new(1, 1, 1), "lr-1e-3");
    let id = RunIdentity::of_artifact;
    assert_ne!(id(&a).model_hash, id(&b).model_hash);
    let mut writer = CpuArtifactTrainer::new(&a, SEED).expect("trainer");
    let (_, data) = steps(&mut writer, SEED, 0, 1);
    let ckpt = scratch("lr");
    let written = save(&ckpt.0, &writer, 1, &data, id(&a));

    let mut t = CpuArtifactTrainer::new(&b, SEED).expect("trainer");
    let before = bits(&t);
    let e = checkpoint::resume(&written, &mut t, id(&b), false).unwrap_err();
    assert!(matches!(e, CheckpointError::DifferentModel { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("(train_lr 0.003 in the checkpoint, 0.001 in this run; model hash ") && msg.contains("pass --allow-different-build to force it"),
        "{msg}"
    );
    assert!(bits(&t) == before, "a refused checkpoint changed the states");
    let (_, st) = checkpoint::resume(&written, &mut t, id(&b), true).expect("forced");
    let note = checkpoint::check_identity(&st, &id(&b), checkpoint::run_mesh(&t), true).expect("forced");
    assert_eq!(
        note.as_deref(),
        Some("--allow-different-build: resuming a checkpoint of another model or training configuration (train_lr 0.003 in the checkpoint, 0.001 in this run)")
    );
    assert!(bits(&t) == bits(&writer));

    // Same model and options, another build (here: another content hash on the same mesh).
    let other = RunIdentity { content_hash: "another build".into(), ..id(&a) };
    let mut u = CpuArtifactTrainer::new(&a, SEED + 1).expect("trainer");
    let (_, st) = checkpoint::resume(&written, &mut u, &other, false).expect("same model");
    let note = checkpoint::check_identity(&st, &other, checkpoint::run_mesh(&u), false).expect("same model");
    assert!(note.as_deref().is_some_and(|n| n.starts_with("resuming a checkpoint of another build of the same model (content hash ")), "{note:?}");
}
