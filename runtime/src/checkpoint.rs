//! Checkpoints in safetensors: `CKPT/step-<n>/` holds `model.safetensors` (the fp32 master
//! weights under Hugging Face Llama names, stacked per-layer buffers split into one tensor per
//! layer), `optimizer.safetensors` (the AdamW moments, the parameter's HF name plus `.exp_avg` /
//! `.exp_avg_sq`) and `trainer_state.json` ([`TrainerState`]: step, seed, data position, the
//! artifact's content hash, format version). `docs/checkpoints.md` documents the layout.
//!
//! Restoring is driven by the trainer's own state list: every state buffer must find its
//! tensors (by HF name, per layer for stacked buffers) with the same shape, and a file holding a
//! tensor the model does not have is refused; errors name the tensor.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde::{Deserialize, Serialize};

use crate::RuntimeError;
use crate::backend::Trainer;

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
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
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
    /// The artifact's `content_hash` (graph mode: `graph-fnv1a:` and a hash of the graph text).
    pub content_hash: String,
    /// The data source, for reference.
    #[serde(default)]
    pub data: String,
}

/// A tensor of a checkpoint file: its name, shape and values as f32.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

/// An identity for a graph-mode run (no artifact content hash): FNV-1a of the graph text.
pub fn graph_identity(text: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    format!("graph-fnv1a:{h:016x}")
}

/// Whether a state's checkpoint name is an AdamW moment (stored in `optimizer.safetensors`).
pub fn is_optimizer_state(name: &str) -> bool {
    name.ends_with(".exp_avg") || name.ends_with(".exp_avg_sq")
}

/// The Hugging Face name of a titan (TorchTitan) checkpoint name of one tensor (a per-layer
/// name has its layer index, not `{i}`). Moments keep their suffix after the parameter's HF
/// name. Names outside the Llama scheme are kept as they are.
pub fn hf_name(name: &str) -> String {
    for suffix in [".exp_avg_sq", ".exp_avg"] {
        if let Some(base) = name.strip_suffix(suffix) {
            return format!("{}{suffix}", hf_name(base));
        }
    }
    match name {
        "tok_embeddings.weight" => return "model.embed_tokens.weight".into(),
        "norm.weight" => return "model.norm.weight".into(),
        "output.weight" => return "lm_head.weight".into(),
        _ => {}
    }
    if let Some(rest) = name.strip_prefix("layers.")
        && let Some((layer, tail)) = rest.split_once('.')
        && layer.parse::<u64>().is_ok()
    {
        let mapped = match tail {
            "attention.wq.weight" => "self_attn.q_proj.weight",
            "attention.wk.weight" => "self_attn.k_proj.weight",
            "attention.wv.weight" => "self_attn.v_proj.weight",
            "attention.wo.weight" => "self_attn.o_proj.weight",
            "feed_forward.w1.weight" => "mlp.gate_proj.weight",
            "feed_forward.w2.weight" => "mlp.down_proj.weight",
            "feed_forward.w3.weight" => "mlp.up_proj.weight",
            "attention_norm.weight" => "input_layernorm.weight",
            "ffn_norm.weight" => "post_attention_layernorm.weight",
            _ => return name.to_string(),
        };
        return format!("model.layers.{layer}.{mapped}");
    }
    name.to_string()
}

/// One checkpoint tensor of a state buffer: its HF name, shape and range of the buffer's elements.
type Piece = (String, Vec<usize>, std::ops::Range<usize>);

/// The checkpoint tensors of one state buffer, one per layer for a stacked buffer (a name with
/// `{i}`).
fn pieces(name: &str, shape: &[usize]) -> Result<Vec<Piece>, CheckpointError> {
    let numel: usize = shape.iter().product();
    if !name.contains("{i}") {
        return Ok(vec![(hf_name(name), shape.to_vec(), 0..numel)]);
    }
    let Some((&layers, rest)) = shape.split_first() else {
        return Err(CheckpointError::Mismatch(format!("stacked state `{name}` is a scalar; it needs a leading layer dim")));
    };
    let per: usize = rest.iter().product();
    Ok((0..layers).map(|l| (hf_name(&name.replace("{i}", &l.to_string())), rest.to_vec(), l * per..(l + 1) * per)).collect())
}

/// Split a trainer's states into checkpoint tensors: `(model, optimizer)`, HF names, per layer.
pub fn export_states(trainer: &dyn Trainer) -> Result<(Vec<NamedTensor>, Vec<NamedTensor>), CheckpointError> {
    let (mut model, mut optimizer) = (Vec::new(), Vec::new());
    for (name, t) in trainer.states()? {
        let xs = t.floats().ok_or_else(|| CheckpointError::Mismatch(format!("state `{name}` is not a float tensor")))?;
        let out = if is_optimizer_state(&name) { &mut optimizer } else { &mut model };
        for (hf, shape, range) in pieces(&name, &t.shape)? {
            out.push(NamedTensor { name: hf, shape, values: xs[range].to_vec() });
        }
    }
    Ok((model, optimizer))
}

/// Write `tensors` as f32 to a safetensors file.
pub fn write_safetensors(path: &Path, tensors: &[NamedTensor], metadata: Option<HashMap<String, String>>) -> Result<(), CheckpointError> {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|t| t.values.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let mut views = Vec::with_capacity(tensors.len());
    for (t, b) in tensors.iter().zip(&bytes) {
        let v = TensorView::new(Dtype::F32, t.shape.clone(), b)
            .map_err(|e| CheckpointError::Format { path: path.display().to_string(), message: format!("tensor `{}`: {e}", t.name) })?;
        views.push((t.name.clone(), v));
    }
    safetensors::serialize_to_file(views, metadata, path).map_err(|e| io("write", path, e))
}

/// Read every tensor of a safetensors file, converting bf16, f16 and f32 to f32.
pub fn read_safetensors(path: &Path) -> Result<BTreeMap<String, NamedTensor>, CheckpointError> {
    let bytes = std::fs::read(path).map_err(|e| io("read", path, e))?;
    let p = path.display().to_string();
    let st = SafeTensors::deserialize(&bytes).map_err(|e| CheckpointError::Format { path: p.clone(), message: e.to_string() })?;
    let mut out = BTreeMap::new();
    for (name, view) in st.iter() {
        let data = view.data();
        let values: Vec<f32> = match view.dtype() {
            Dtype::F32 => data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::BF16 => data.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::F16 => data.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            other => {
                return Err(CheckpointError::Format {
                    path: p,
                    message: format!("tensor `{name}` is {other:?}; titan loads F32, BF16 and F16 tensors, convert it to one of those"),
                });
            }
        };
        out.insert(name.to_string(), NamedTensor { name: name.to_string(), shape: view.shape().to_vec(), values });
    }
    Ok(out)
}

/// Load the trainer's states selected by `select` (on titan names) from `tensors` (HF names),
/// which must hold exactly those: a missing tensor, a shape mismatch or a tensor left over is an
/// error naming it. `file` names the source in errors.
pub fn restore_states(
    trainer: &mut dyn Trainer,
    mut tensors: BTreeMap<String, NamedTensor>,
    select: &dyn Fn(&str) -> bool,
    file: &Path,
) -> Result<(), CheckpointError> {
    let f = file.display();
    for (name, t) in trainer.states()? {
        if !select(&name) {
            continue;
        }
        let numel: usize = t.shape.iter().product();
        let mut values = vec![0.0f32; numel];
        for (hf, shape, range) in pieces(&name, &t.shape)? {
            let got = tensors
                .remove(&hf)
                .ok_or_else(|| CheckpointError::Mismatch(format!("`{f}` has no tensor `{hf}`, which the model needs; is it a checkpoint of this model?")))?;
            if got.shape != shape {
                return Err(CheckpointError::Mismatch(format!(
                    "tensor `{hf}` in `{f}` has shape {:?}, the model's is {shape:?}; the checkpoint is of another model",
                    got.shape
                )));
            }
            values[range].copy_from_slice(&got.values);
        }
        trainer.set_state(&name, &values)?;
    }
    if let Some(extra) = tensors.keys().next() {
        return Err(CheckpointError::Mismatch(format!(
            "`{f}` has {} tensor(s) the model does not have, the first `{extra}`; the checkpoint is of another model",
            tensors.len()
        )));
    }
    Ok(())
}

/// The directory of step `step` under `dir`.
pub fn step_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step}"))
}

/// Write the checkpoint of `trainer` after `state.step` steps to `dir/step-<n>/` (written to a
/// temporary directory first and renamed, so a crash never leaves a half-written step).
pub fn save(dir: &Path, trainer: &dyn Trainer, state: &TrainerState) -> Result<PathBuf, CheckpointError> {
    let target = step_dir(dir, state.step);
    let tmp = dir.join(format!(".step-{}.tmp", state.step));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| io("create", &tmp, e))?;
    let (model, optimizer) = export_states(trainer)?;
    // One metadata entry only: safetensors writes the map in its iteration order, and the files
    // of two identical runs must be byte-identical.
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_safetensors(&tmp.join(MODEL_FILE), &model, Some(meta.clone()))?;
    write_safetensors(&tmp.join(OPTIMIZER_FILE), &optimizer, Some(meta))?;
    let json = serde_json::to_string_pretty(state).map_err(|e| CheckpointError::Format { path: STATE_FILE.into(), message: e.to_string() })?;
    let state_path = tmp.join(STATE_FILE);
    std::fs::write(&state_path, json + "\n").map_err(|e| io("write", &state_path, e))?;
    if target.exists() {
        std::fs::remove_dir_all(&target).map_err(|e| io("replace", &target, e))?;
    }
    std::fs::rename(&tmp, &target).map_err(|e| io("create", &target, e))?;
    Ok(target)
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
/// its latest step) into `trainer`: parameters, moments and the step counter. A checkpoint of
/// another build (`content_hash`) is refused unless `allow_different_build`.
pub fn resume(path: &Path, trainer: &mut dyn Trainer, content_hash: &str, allow_different_build: bool) -> Result<(PathBuf, TrainerState), CheckpointError> {
    let dir = resolve(path)?;
    let state = read_state(&dir)?;
    if state.content_hash != content_hash && !allow_different_build {
        return Err(CheckpointError::DifferentBuild { found: state.content_hash, expected: content_hash.to_string() });
    }
    let model = dir.join(MODEL_FILE);
    restore_states(trainer, read_safetensors(&model)?, &|n| !is_optimizer_state(n), &model)?;
    let optimizer = dir.join(OPTIMIZER_FILE);
    restore_states(trainer, read_safetensors(&optimizer)?, &|n| is_optimizer_state(n), &optimizer)?;
    trainer.set_steps_done(state.step)?;
    Ok((dir, state))
}

/// Load the parameters only from a `model.safetensors` (HF names; bf16, f16 or f32); the
/// optimizer moments keep their initial values (zeros) and the step counter stays.
pub fn init_from(path: &Path, trainer: &mut dyn Trainer) -> Result<(), CheckpointError> {
    restore_states(trainer, read_safetensors(path)?, &|n| !is_optimizer_state(n), path)
}

#[cfg(test)]
mod tests {
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
}
