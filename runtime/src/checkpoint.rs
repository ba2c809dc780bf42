//! Checkpoints in safetensors: `CKPT/step-<n>/` holds `model.safetensors` (the fp32 master
//! weights under Hugging Face Llama names, stacked per-layer buffers split into one tensor per
//! layer), `optimizer.safetensors` (the AdamW moments, the parameter's HF name plus `.exp_avg` /
//! `.exp_avg_sq`) and `trainer_state.json` ([`TrainerState`]: step, seed, data position, the
//! artifact's content hash and model hash, the mesh, format version). `docs/checkpoints.md`
//! documents the layout.
//!
//! A checkpoint resumes on a run of the same build (content hash) or, resharded, on any build
//! of the same model (model hash: the model and training options, not the mesh or build
//! choices; [`RunIdentity`], [`check_identity`]).
//!
//! One format for every run: the files hold the full (unsharded) tensors whatever mesh wrote
//! them. A mesh run writes them in parallel: every tensor's place in the file follows from the
//! names and full shapes alone, so rank 0 writes the headers, each rank writes the bytes of its
//! own shards (one replica per shard) straight into the files at their offsets, and rank 0
//! renames the step directory after a barrier. Loading is the same in reverse: every rank reads
//! the slice of each tensor its placement gives it, so a checkpoint reshards onto any mesh (or
//! one device). A single-device trainer is the mesh of one rank.
//!
//! Restoring is driven by the trainer's own state list: every state buffer must find its
//! tensors (by HF name, per layer for stacked buffers) with the same shape, and a file holding a
//! tensor the model does not have is refused; errors name the tensor.
//!
//! This file holds the format (files, [`TrainerState`], errors) and saving and restoring;
//! `identity.rs` which run a checkpoint belongs to, `hf_names.rs` the tensor names, `shard.rs`
//! the shard geometry and `file.rs` the safetensors files.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use titan_ir::Mesh;
use titan_ir::interp::Tensor;

use crate::RuntimeError;
use crate::backend::{ShardedStates, StateLayout, Trainer};

mod file;
mod hf_names;
mod identity;
mod shard;

use self::file::{TensorFile, f32_file_layout};
use self::hf_names::pieces;
use self::shard::{box_parts, for_each_run};

pub use self::file::{NamedTensor, read_safetensors};
pub use self::hf_names::{hf_name, is_optimizer_state};
pub use self::identity::{CheckpointMesh, RunIdentity, check_identity, graph_identity, run_mesh};
pub use self::shard::{ShardBox, shard_box, shard_values};

/// Bumped on every change an older reader would misread.
pub const CHECKPOINT_FORMAT_VERSION: u32 = 1;
pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "trainer_state.json";

/// Why a checkpoint cannot be written or used.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot {action} `{path}`: {message}")]
    Io { action: &'static str, path: String, message: String },
    #[error("`{path}` is not a usable checkpoint file: {message}")]
    Format { path: String, message: String },
    /// The checkpoint does not fit the model (names, shapes).
    #[error("{0}")]
    Mismatch(String),
    #[error(
        "the checkpoint was written by a run of another build (content hash {found}), this artifact's is {expected}; resume with the artifact that wrote it, use --init-from CKPT/step-<n>/model.safetensors to load the weights only, or pass --allow-different-build"
    )]
    DifferentBuild { found: String, expected: String },
    #[error(
        "the checkpoint was written on {found} and this run is on {expected}, and {}, so titan cannot tell whether the model and training options are the same: pass --allow-different-build to reshard the checkpoint onto this run (tensor names and shapes are still checked), or --init-from CKPT/step-<n>/model.safetensors for the weights only",
        if *checkpoint_has_model_hash { "this run's artifact or graph has no model hash (an older titanc built it)" } else { "the checkpoint records no model hash (an older titan-run, or a build without one, wrote it)" }
    )]
    DifferentMesh { found: CheckpointMesh, expected: CheckpointMesh, checkpoint_has_model_hash: bool },
    #[error(
        "the checkpoint was written by a run of another model or training configuration ({differences}; model hash {} in the checkpoint, {} in this run); resume with the model and training options that wrote it, use --init-from CKPT/step-<n>/model.safetensors to load the weights only, or pass --allow-different-build to force it (tensor names and shapes are still checked)",
        short(found),
        short(expected)
    )]
    DifferentModel { found: String, expected: String, differences: String },
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

/// The first 16 characters of a hash, as the build summary prints it.
fn short(hash: &str) -> &str {
    hash.get(..16).unwrap_or(hash)
}

fn io(action: &'static str, path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io { action, path: path.display().to_string(), message: e.to_string() }
}

/// `trainer_state.json`: what a resumed run needs besides the tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    pub format_version: u32,
    /// Steps completed; the resumed run continues with step `step + 1`.
    pub step: u64,
    /// The run's seed (initialization and batch sampling).
    pub seed: u64,
    /// The index of the next batch to draw (batches are drawn by `(seed, index)`).
    pub data_position: u64,
    /// A run over packed data (`--tokenizer`, llm.c shards): where its next batch starts in the
    /// stream (file, byte offset, document, token, pass; `docs/checkpoints.md`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_stream: Option<titan_data::stream::StreamPosition>,
    /// The artifact's `content_hash` (graph mode: `graph-fnv1a:` and a hash of the graph text).
    pub content_hash: String,
    /// The model hash of the run that wrote it (absent in older checkpoints and for runs of
    /// artifacts or graphs without one: matched on `content_hash` alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_hash: Option<String>,
    /// The model configuration of that run (architecture `meta`, `dims.*`, `train_*`), to name
    /// what differs when the model hashes do.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub model_config: BTreeMap<String, String>,
    /// The data source, for reference.
    #[serde(default)]
    pub data: String,
    /// The mesh of the run that wrote it (absent in checkpoints of runs before meshes wrote
    /// checkpoints: one device). The tensors do not depend on it.
    #[serde(default)]
    pub mesh: CheckpointMesh,
}

/// A single-device trainer seen as the one rank of a one-rank mesh: its states are whole. The
/// states read for the layout are handed out by the writes that follow, so a GPU trainer's
/// states are downloaded once per checkpoint.
struct Whole<'t> {
    trainer: &'t dyn Trainer,
    read: std::cell::RefCell<HashMap<String, Tensor<f32>>>,
}

/// [`Whole`], to restore states.
struct WholeMut<'t>(&'t mut dyn Trainer);

fn layout_of(states: &[(String, Tensor<f32>)]) -> Vec<StateLayout> {
    states.iter().map(|(name, t)| StateLayout { name: name.clone(), placement: Vec::new(), shape: t.shape.clone() }).collect()
}

impl ShardedStates for Whole<'_> {
    fn mesh(&self) -> Mesh {
        Mesh::new(1, 1, 1)
    }
    fn held_ranks(&self) -> Vec<usize> {
        vec![0]
    }
    fn layout(&self) -> Result<Vec<StateLayout>, RuntimeError> {
        let states = self.trainer.states()?;
        let layout = layout_of(&states);
        *self.read.borrow_mut() = states.into_iter().collect();
        Ok(layout)
    }
    fn rank_state(&self, _rank: usize, name: &str) -> Result<Tensor<f32>, RuntimeError> {
        let cached = self.read.borrow_mut().remove(name);
        cached.map_or_else(|| self.trainer.state(name), Ok)
    }
    fn set_rank_state(&mut self, _rank: usize, name: &str, _values: &[f32]) -> Result<(), RuntimeError> {
        Err(RuntimeError::Backend(format!("invariant: state `{name}` is restored through a mutable trainer")))
    }
    fn barrier(&self) -> Result<(), RuntimeError> {
        Ok(())
    }
}

impl ShardedStates for WholeMut<'_> {
    fn mesh(&self) -> Mesh {
        Mesh::new(1, 1, 1)
    }
    fn held_ranks(&self) -> Vec<usize> {
        vec![0]
    }
    fn layout(&self) -> Result<Vec<StateLayout>, RuntimeError> {
        Ok(layout_of(&self.0.states()?))
    }
    fn rank_state(&self, _rank: usize, name: &str) -> Result<Tensor<f32>, RuntimeError> {
        self.0.state(name)
    }
    fn set_rank_state(&mut self, _rank: usize, name: &str, values: &[f32]) -> Result<(), RuntimeError> {
        self.0.set_state(name, values)
    }
    fn barrier(&self) -> Result<(), RuntimeError> {
        Ok(())
    }
}

/// The full checkpoint tensors (HF names, full shapes) of a layout: `(model, optimizer)`.
type FileTensors = (Vec<(String, Vec<usize>)>, Vec<(String, Vec<usize>)>);

fn file_tensors(layout: &[StateLayout], mesh: Mesh) -> Result<FileTensors, CheckpointError> {
    let (mut model, mut optimizer) = (Vec::new(), Vec::new());
    for s in layout {
        let b = shard_box(&s.name, &s.shape, &s.placement, mesh, [0; 3])?;
        let out = if is_optimizer_state(&s.name) { &mut optimizer } else { &mut model };
        for (hf, shape, _) in pieces(&s.name, &b.full)? {
            out.push((hf, shape));
        }
    }
    Ok((model, optimizer))
}

/// Write the checkpoint after `state.step` steps to `dir/step-<n>/`: the full tensors whatever
/// the mesh. Every process of a mesh run calls it (collectively): the process holding rank 0
/// creates the files in a temporary directory, every rank writes its shards (the first replica
/// of each) at their offsets, and after a barrier rank 0 writes `trainer_state.json` and
/// renames the directory, so a crash on any rank never leaves a half-written `step-<n>`.
pub fn save(dir: &Path, trainer: &dyn Trainer, state: &TrainerState) -> Result<PathBuf, CheckpointError> {
    match trainer.sharded() {
        Some(s) => save_shards(dir, s, state),
        None => save_shards(dir, &Whole { trainer, read: std::cell::RefCell::default() }, state),
    }
}

fn save_shards(dir: &Path, view: &dyn ShardedStates, state: &TrainerState) -> Result<PathBuf, CheckpointError> {
    let (mesh, held, layout) = (view.mesh(), view.held_ranks(), view.layout()?);
    let target = step_dir(dir, state.step);
    let tmp = dir.join(format!(".step-{}.tmp", state.step));
    let (model, optimizer) = file_tensors(&layout, mesh)?;
    let files = [(tmp.join(MODEL_FILE), model), (tmp.join(OPTIMIZER_FILE), optimizer)];
    let mut layouts = Vec::new();
    for (path, tensors) in &files {
        layouts.push(f32_file_layout(tensors, path)?);
    }
    let coordinator = held.contains(&0);
    if coordinator {
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| io("create", &tmp, e))?;
        for ((path, _), layout) in files.iter().zip(&layouts) {
            let f = File::create(path).map_err(|e| io("create", path, e))?;
            f.write_all_at(&layout.prefix, 0).map_err(|e| io("write", path, e))?;
            f.set_len(layout.len).map_err(|e| io("write", path, e))?;
        }
    }
    view.barrier()?;
    let mut handles = Vec::new();
    for (path, _) in &files {
        handles.push(std::fs::OpenOptions::new().write(true).open(path).map_err(|e| io("open", path, e))?);
    }
    for &rank in &held {
        let coords = mesh.coords(rank);
        for s in &layout {
            let b = shard_box(&s.name, &s.shape, &s.placement, mesh, coords)?;
            if !b.writer {
                continue;
            }
            // One state at a time: a rank never holds a second copy of all its states.
            let t = view.rank_state(rank, &s.name)?;
            let xs = t.floats().ok_or_else(|| CheckpointError::Mismatch(format!("state `{}` is not a float tensor", s.name)))?;
            if t.shape != b.shape {
                return Err(CheckpointError::Mismatch(format!("rank {rank}'s state `{}` has shape {:?}, its layout says {:?}", s.name, t.shape, b.shape)));
            }
            let k = usize::from(is_optimizer_state(&s.name));
            let ((path, _), (file, offsets)) = (&files[k], (&handles[k], &layouts[k].offsets));
            for (hf, full, offset, shape, at) in box_parts(&s.name, &b)? {
                let base = *offsets.get(&hf).ok_or_else(|| CheckpointError::Mismatch(format!("invariant: `{hf}` is in the file layout")))?;
                let part = &xs[at..at + shape.iter().product::<usize>()];
                let mut bytes = Vec::new();
                for_each_run(&full, &offset, &shape, &mut |src, dst, len| {
                    bytes.clear();
                    bytes.extend(part[dst..dst + len].iter().flat_map(|x| x.to_le_bytes()));
                    file.write_all_at(&bytes, base + 4 * src as u64).map_err(|e| io("write", path, e))
                })?;
            }
        }
    }
    for ((path, _), f) in files.iter().zip(&handles) {
        f.sync_all().map_err(|e| io("write", path, e))?;
    }
    drop(handles);
    // Every rank's bytes are in the files before the step directory appears.
    view.barrier()?;
    if coordinator {
        let json = serde_json::to_string_pretty(state).map_err(|e| CheckpointError::Format { path: STATE_FILE.into(), message: e.to_string() })?;
        let state_path = tmp.join(STATE_FILE);
        std::fs::write(&state_path, json + "\n").map_err(|e| io("write", &state_path, e))?;
        if target.exists() {
            std::fs::remove_dir_all(&target).map_err(|e| io("replace", &target, e))?;
        }
        std::fs::rename(&tmp, &target).map_err(|e| io("create", &target, e))?;
    }
    // No rank goes on (or reports the checkpoint) before it exists.
    view.barrier()?;
    Ok(target)
}

/// Load the states selected by `select` (on titan names) of every rank `view` holds from
/// `file` (HF names, full tensors), each rank reading its own slices. The file must hold exactly
/// those states' tensors: a missing tensor, a shape mismatch or a tensor left over is an error
/// naming it, found before any state is overwritten.
fn restore_shards(view: &mut dyn ShardedStates, file: &TensorFile, select: &dyn Fn(&str) -> bool) -> Result<(), CheckpointError> {
    let (mesh, held) = (view.mesh(), view.held_ranks());
    let layout: Vec<StateLayout> = view.layout()?.into_iter().filter(|s| select(&s.name)).collect();
    let f = file.path.display();
    let mut expected = BTreeSet::new();
    for s in &layout {
        let b = shard_box(&s.name, &s.shape, &s.placement, mesh, [0; 3])?;
        for (hf, shape, _) in pieces(&s.name, &b.full)? {
            let (_, got, _) = file
                .tensors
                .get(&hf)
                .ok_or_else(|| CheckpointError::Mismatch(format!("`{f}` has no tensor `{hf}`, which the model needs; is it a checkpoint of this model?")))?;
            if *got != shape {
                return Err(CheckpointError::Mismatch(format!(
                    "tensor `{hf}` in `{f}` has shape {got:?}, the model's is {shape:?}; the checkpoint is of another model"
                )));
            }
            expected.insert(hf);
        }
    }
    let extra: Vec<&String> = file.tensors.keys().filter(|k| !expected.contains(*k)).collect();
    if let Some(first) = extra.first() {
        return Err(CheckpointError::Mismatch(format!(
            "`{f}` has {} tensor(s) the model does not have, the first `{first}`; the checkpoint is of another model",
            extra.len()
        )));
    }
    for &rank in &held {
        let coords = mesh.coords(rank);
        for s in &layout {
            let b = shard_box(&s.name, &s.shape, &s.placement, mesh, coords)?;
            let mut values = vec![0.0f32; b.shape.iter().product()];
            for (hf, full, offset, shape, at) in box_parts(&s.name, &b)? {
                let n: usize = shape.iter().product();
                file.read_box(&hf, &full, &offset, &shape, &mut values[at..at + n])?;
            }
            view.set_rank_state(rank, &s.name, &values)?;
        }
    }
    Ok(())
}

/// Load the selected states of `trainer` (every rank it holds, on a mesh) from `file`.
fn restore(trainer: &mut dyn Trainer, file: &TensorFile, select: &dyn Fn(&str) -> bool) -> Result<(), CheckpointError> {
    if trainer.sharded().is_some() {
        let view = trainer.sharded_mut().ok_or_else(|| CheckpointError::Mismatch("invariant: a sharded trainer stays sharded".into()))?;
        return restore_shards(view, file, select);
    }
    restore_shards(&mut WholeMut(trainer), file, select)
}

/// The directory of step `step` under `dir`.
pub fn step_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step}"))
}

/// The step directory `path` names: itself when it holds `trainer_state.json`, else its
/// `step-<n>` subdirectory with the largest `n` (the latest checkpoint).
pub fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    if path.join(STATE_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    let entries = std::fs::read_dir(path).map_err(|e| io("read checkpoint directory", path, e))?;
    let mut best: Option<(u64, PathBuf)> = None;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(n) = name.to_str().and_then(|s| s.strip_prefix("step-")).and_then(|s| s.parse::<u64>().ok()) else { continue };
        if e.path().join(STATE_FILE).is_file() && best.as_ref().is_none_or(|(b, _)| n > *b) {
            best = Some((n, e.path()));
        }
    }
    best.map(|(_, p)| p).ok_or_else(|| {
        CheckpointError::Mismatch(format!(
            "`{}` holds no checkpoint (no {STATE_FILE}, no step-<n> directory); pass a --checkpoint-dir a run wrote, or one of its step-<n> directories",
            path.display()
        ))
    })
}

/// Delete all but the newest `keep` step directories of `dir` (TorchTitan's
/// `checkpoint.keep_latest_k`; `0` keeps every one). Returns the directories removed.
pub fn prune(dir: &Path, keep: u64) -> Result<Vec<PathBuf>, CheckpointError> {
    if keep == 0 {
        return Ok(Vec::new());
    }
    let mut steps: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .map_err(|e| io("read checkpoint directory", dir, e))?
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_str()?.strip_prefix("step-")?.parse::<u64>().ok()?;
            e.path().is_dir().then(|| (n, e.path()))
        })
        .collect();
    steps.sort();
    let excess = steps.len().saturating_sub(usize::try_from(keep).unwrap_or(usize::MAX));
    let mut removed = Vec::new();
    for (_, path) in steps.into_iter().take(excess) {
        std::fs::remove_dir_all(&path).map_err(|e| io("remove", &path, e))?;
        removed.push(path);
    }
    Ok(removed)
}

/// The dtype `export_model_only` writes.
pub use titan_ir::job_config::ExportDtype;

/// Turn the checkpoint in `step_dir` into a model-only export (TorchTitan's
/// `checkpoint.last_save_model_only` with `export_dtype`): `model.safetensors` rewritten in
/// `dtype`, the optimizer state and `trainer_state.json` removed, so the directory is no
/// checkpoint to resume from (`--resume CKPT` takes the latest full one) but loads with
/// `--init-from step-<n>/model.safetensors`.
pub fn export_model_only(step_dir: &Path, dtype: ExportDtype) -> Result<(), CheckpointError> {
    use safetensors::Dtype;
    let model = step_dir.join(MODEL_FILE);
    if dtype != ExportDtype::F32 {
        let tensors = file::read_safetensors(&model)?;
        let (st, width) = match dtype {
            ExportDtype::BF16 => (Dtype::BF16, 2),
            ExportDtype::F16 => (Dtype::F16, 2),
            ExportDtype::F32 => (Dtype::F32, 4),
        };
        let bytes: Vec<Vec<u8>> = tensors
            .values()
            .map(|t| {
                let mut b = Vec::with_capacity(t.values.len() * width);
                for &x in &t.values {
                    match dtype {
                        ExportDtype::BF16 => b.extend(half::bf16::from_f32(x).to_le_bytes()),
                        ExportDtype::F16 => b.extend(half::f16::from_f32(x).to_le_bytes()),
                        ExportDtype::F32 => b.extend(x.to_le_bytes()),
                    }
                }
                b
            })
            .collect();
        let mut views = Vec::with_capacity(tensors.len());
        for (t, b) in tensors.values().zip(&bytes) {
            let view = safetensors::tensor::TensorView::new(st, t.shape.clone(), b)
                .map_err(|e| CheckpointError::Format { path: model.display().to_string(), message: e.to_string() })?;
            views.push((t.name.clone(), view));
        }
        let out = safetensors::serialize(views, Some(file::file_metadata()))
            .map_err(|e| CheckpointError::Format { path: model.display().to_string(), message: e.to_string() })?;
        let tmp = step_dir.join(".model.safetensors.tmp");
        std::fs::write(&tmp, out).map_err(|e| io("write", &tmp, e))?;
        std::fs::rename(&tmp, &model).map_err(|e| io("write", &model, e))?;
    }
    for f in [OPTIMIZER_FILE, STATE_FILE] {
        let path = step_dir.join(f);
        std::fs::remove_file(&path).map_err(|e| io("remove", &path, e))?;
    }
    Ok(())
}

/// Read `trainer_state.json` of a step directory, checking its format version.
pub fn read_state(step_dir: &Path) -> Result<TrainerState, CheckpointError> {
    let path = step_dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| io("read", &path, e))?;
    let state: TrainerState = serde_json::from_str(&text).map_err(|e| CheckpointError::Format { path: path.display().to_string(), message: e.to_string() })?;
    if state.format_version != CHECKPOINT_FORMAT_VERSION {
        return Err(CheckpointError::Format {
            path: path.display().to_string(),
            message: format!("checkpoint format version {} is not supported (this titan-run reads version {CHECKPOINT_FORMAT_VERSION})", state.format_version),
        });
    }
    Ok(state)
}

/// Restore everything from checkpoint `path` (a step directory, or a checkpoint directory for
/// its latest step) into `trainer`: parameters, moments and the step counter; on a mesh, every
/// rank `trainer` holds reads its own slices (the checkpoint may come from any mesh). The
/// checkpoint must be of this build or of the same model (see [`check_identity`]; a content
/// hash alone converts into an identity without a model hash), unless `allow_different_build`.
pub fn resume(
    path: &Path,
    trainer: &mut dyn Trainer,
    identity: impl Into<RunIdentity>,
    allow_different_build: bool,
) -> Result<(PathBuf, TrainerState), CheckpointError> {
    let dir = resolve(path)?;
    let state = read_state(&dir)?;
    check_identity(&state, &identity.into(), run_mesh(trainer), allow_different_build)?;
    let model = TensorFile::open(&dir.join(MODEL_FILE))?;
    let optimizer = TensorFile::open(&dir.join(OPTIMIZER_FILE))?;
    restore(trainer, &model, &|n| !is_optimizer_state(n))?;
    restore(trainer, &optimizer, &|n| is_optimizer_state(n))?;
    trainer.set_steps_done(state.step)?;
    Ok((dir, state))
}

/// Load the parameters only from a `model.safetensors` (HF names; bf16, f16 or f32; on a mesh,
/// every rank its slices); the optimizer moments keep their initial values (zeros) and the step
/// counter stays.
pub fn init_from(path: &Path, trainer: &mut dyn Trainer) -> Result<(), CheckpointError> {
    restore(trainer, &TensorFile::open(path)?, &|n| !is_optimizer_state(n))
}

#[cfg(test)]
mod tests {
    use safetensors::Dtype;
    use titan_ir::Placement;

    use super::file::{FileLayout, file_metadata};
    use super::*;

    #[test]
    fn hf_names_follow_the_llama_convention() {
        let cases = [
            ("tok_embeddings.weight", "model.embed_tokens.weight"),
            ("layers.3.attention.wq.weight", "model.layers.3.self_attn.q_proj.weight"),
            ("layers.3.attention.wk.weight", "model.layers.3.self_attn.k_proj.weight"),
            ("layers.3.attention.wv.weight", "model.layers.3.self_attn.v_proj.weight"),
            ("layers.3.attention.wo.weight", "model.layers.3.self_attn.o_proj.weight"),
            ("layers.0.feed_forward.w1.weight", "model.layers.0.mlp.gate_proj.weight"),
            ("layers.0.feed_forward.w2.weight", "model.layers.0.mlp.down_proj.weight"),
            ("layers.0.feed_forward.w3.weight", "model.layers.0.mlp.up_proj.weight"),
            ("layers.12.attention_norm.weight", "model.layers.12.input_layernorm.weight"),
            ("layers.12.ffn_norm.weight", "model.layers.12.post_attention_layernorm.weight"),
            ("norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
            ("output.weight.exp_avg", "lm_head.weight.exp_avg"),
            ("layers.1.attention.wq.weight.exp_avg_sq", "model.layers.1.self_attn.q_proj.weight.exp_avg_sq"),
            ("w", "w"),
            ("layers.x.w", "layers.x.w"),
        ];
        for (titan, hf) in cases {
            assert_eq!(hf_name(titan), hf, "{titan}");
        }
    }

    #[test]
    fn stacked_states_split_per_layer() {
        let p = pieces("layers.{i}.ffn_norm.weight", &[3, 4]).unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!(p[2], ("model.layers.2.post_attention_layernorm.weight".to_string(), vec![4], 8..12));
        assert!(pieces("layers.{i}.x", &[]).is_err());
        assert_eq!(graph_identity("a"), graph_identity("a"));
        assert_ne!(graph_identity("a"), graph_identity("b"));
    }

    /// The header titan writes without the data in memory is the one `safetensors::serialize`
    /// writes for the same tensors (names out of order, scalars and empty tensors included).
    #[test]
    fn file_layout_is_the_safetensors_crate_s() {
        let tensors = vec![
            ("model.norm.weight".to_string(), vec![3]),
            ("lm_head.weight".to_string(), vec![2, 3]),
            ("a.scalar".to_string(), vec![]),
            ("model.embed_tokens.weight".to_string(), vec![5, 3]),
        ];
        let values: Vec<Vec<u8>> =
            tensors.iter().map(|(_, s)| (0..s.iter().product::<usize>()).flat_map(|i| (i as f32 * 0.5).to_le_bytes()).collect()).collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> =
            tensors.iter().zip(&values).map(|((n, s), b)| (n.clone(), safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b).expect("view"))).collect();
        let want = safetensors::serialize(views, Some(file_metadata())).expect("serialize");
        let FileLayout { prefix, offsets, len } = f32_file_layout(&tensors, Path::new("x")).expect("layout");
        assert_eq!(len as usize, want.len());
        assert_eq!(&want[..prefix.len()], prefix.as_slice());
        for ((name, _), b) in tensors.iter().zip(&values) {
            let at = offsets[name] as usize;
            assert_eq!(&want[at..at + b.len()], b.as_slice(), "{name}");
        }
    }

    /// Every rank's box of a state sharded on two mesh dims (one of them twice) is the shard the
    /// initialization takes (`shard_of` outer mesh dim first), and replicas write once.
    #[test]
    fn shard_boxes_follow_the_initialization_rule() {
        let full: Vec<usize> = vec![4, 6, 8];
        let values: Vec<f32> = (0..full.iter().product::<usize>()).map(|i| i as f32).collect();
        let t = titan_ir::interp::Tensor::from_vec(titan_ir::DType::F32, full.clone(), values.clone()).expect("tensor");
        let mesh = Mesh::new(2, 2, 2);
        for (placement, local) in [
            (vec![Placement::Replicate, Placement::Shard(2), Placement::Shard(1)], vec![4, 3, 4]),
            (vec![Placement::Shard(0), Placement::Shard(0), Placement::Replicate], vec![1, 6, 8]),
            (vec![Placement::Replicate, Placement::Replicate, Placement::Replicate], vec![4, 6, 8]),
        ] {
            let mut writers = 0;
            for r in 0..8 {
                let c = mesh.coords(r);
                let b = shard_box("x", &local, &placement, mesh, c).expect("box");
                assert_eq!(b.full, full);
                let mut want = t.clone();
                for (m, pl) in placement.iter().enumerate() {
                    if let Placement::Shard(d) = pl {
                        want = titan_ir::interp::shard_of(&want, *d as usize, 2, c[m]).expect("shard");
                    }
                }
                assert_eq!(shard_values(&b, &values).expect("values"), want.floats().expect("floats"), "{placement:?} rank {r}");
                writers += usize::from(b.writer);
            }
            let shards = placement.iter().filter(|p| matches!(p, Placement::Shard(_))).count();
            assert_eq!(writers, 1 << shards, "{placement:?}: one writer per shard");
        }
        let e = shard_box("x", &[2], &[Placement::Partial, Placement::Replicate, Placement::Replicate], mesh, [0; 3]).unwrap_err();
        assert!(e.to_string().contains("partial sum"), "{e}");
    }

    /// A `trainer_state.json` of a run before meshes wrote checkpoints (no `mesh`) reads as one
    /// device; the mesh reads back as written.
    #[test]
    fn trainer_state_without_a_mesh_is_one_device() {
        let old = r#"{"format_version": 1, "step": 3, "seed": 0, "data_position": 3, "content_hash": "h", "data": "d"}"#;
        let st: TrainerState = serde_json::from_str(old).expect("old state");
        assert_eq!(st.mesh, CheckpointMesh::default());
        assert_eq!(st.mesh.to_string(), "one device");
        assert_eq!(st.data_stream, None, "an old state was not over a stream");
        let st = TrainerState { mesh: Mesh::new(2, 2, 1).into(), ..st };
        let back: TrainerState = serde_json::from_str(&serde_json::to_string_pretty(&st).expect("json")).expect("read");
        assert_eq!(back, st);
        assert_eq!(back.mesh.to_string(), "a mesh of dp_replicate 2 x dp_shard 2");
        assert_eq!((back.model_hash, back.model_config.len()), (None, 0), "an old state has no model hash");
        let json = serde_json::to_string_pretty(&st).expect("json");
        assert!(!json.contains("model_hash") && !json.contains("model_config"), "written only when known: {json}");
    }

    /// The decision table of `check_identity`: the content hash first, then the model hash;
    /// without a model hash on either side, as before (another mesh, another build).
    #[test]
    fn checkpoints_match_on_the_content_hash_then_the_model_hash() {
        let config = |lr: &str| BTreeMap::from([("n_layers".to_string(), "2".to_string()), ("train_lr".to_string(), lr.to_string())]);
        let id = |content: &str, model: Option<&str>, lr: &str| RunIdentity {
            content_hash: content.into(),
            model_hash: model.map(str::to_string),
            model_config: if model.is_some() { config(lr) } else { BTreeMap::new() },
        };
        let state = |i: &RunIdentity, mesh: CheckpointMesh| TrainerState {
            format_version: CHECKPOINT_FORMAT_VERSION,
            step: 2,
            seed: 0,
            data_position: 2,
            data_stream: None,
            content_hash: i.content_hash.clone(),
            data: String::new(),
            mesh,
            model_hash: i.model_hash.clone(),
            model_config: i.model_config.clone(),
        };
        let (one, tp2) = (CheckpointMesh::default(), CheckpointMesh { tp: 2, ..CheckpointMesh::default() });
        let fsdp_tp = CheckpointMesh { dp_replicate: 1, dp_shard: 2, tp: 2 };
        let written = state(&id("c1", Some("m1"), "0.003"), fsdp_tp);
        // The same build.
        assert_eq!(check_identity(&written, &id("c1", Some("m1"), "0.003"), fsdp_tp, false).expect("same build"), None);
        // The same model on another mesh, or another build on the same mesh.
        let note = check_identity(&written, &id("c2", Some("m1"), "0.003"), one, false).expect("same model");
        assert_eq!(note.as_deref(), Some("resharding a checkpoint of dp_shard 2 x tp 2 onto one device"));
        let note = check_identity(&written, &id("c2", Some("m1"), "0.003"), fsdp_tp, false).expect("same model");
        assert_eq!(note.as_deref(), Some("resuming a checkpoint of another build of the same model (content hash c1, this build's c2)"));
        // Another model: refused naming what differs, unless forced.
        let e = check_identity(&written, &id("c2", Some("m2"), "0.001"), tp2, false).unwrap_err().to_string();
        assert!(e.contains("(train_lr 0.003 in the checkpoint, 0.001 in this run; model hash m1 in the checkpoint, m2 in this run)"), "{e}");
        let e = check_identity(&written, &id("c2", Some("m2"), "0.003"), tp2, false).unwrap_err().to_string();
        assert!(e.contains("the same sizes and training options, but the model graphs differ"), "{e}");
        let note = check_identity(&written, &id("c2", Some("m2"), "0.001"), tp2, true).expect("forced");
        assert_eq!(
            note.as_deref(),
            Some(
                "--allow-different-build: resuming a checkpoint of another model or training configuration (train_lr 0.003 in the checkpoint, 0.001 in this run); resharding a checkpoint of dp_shard 2 x tp 2 onto a mesh of tp 2"
            )
        );
        // No model hash on one side: as before the model hash.
        let old = state(&id("c1", None, ""), fsdp_tp);
        let e = check_identity(&old, &id("c2", Some("m1"), "0.003"), one, false).unwrap_err();
        assert!(
            matches!(e, CheckpointError::DifferentMesh { checkpoint_has_model_hash: false, .. })
                && e.to_string().contains("the checkpoint records no model hash"),
            "{e}"
        );
        let e = check_identity(&written, &"c2".into(), one, false).unwrap_err();
        assert!(e.to_string().contains("this run's artifact or graph has no model hash"), "{e}");
        let e = check_identity(&old, &id("c2", Some("m1"), "0.003"), fsdp_tp, false).unwrap_err();
        assert!(matches!(e, CheckpointError::DifferentBuild { .. }), "{e}");
        assert!(check_identity(&old, &"c1".into(), one, false).expect("same content").is_none());
        assert_eq!(
            check_identity(&old, &"c2".into(), one, true).expect("forced").as_deref(),
            Some("--allow-different-build: resuming a checkpoint of another build; resharding a checkpoint of dp_shard 2 x tp 2 onto one device")
        );
    }
}
