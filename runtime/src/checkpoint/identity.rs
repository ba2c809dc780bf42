//! Which run a checkpoint belongs to: the mesh it was written on ([`CheckpointMesh`]), the
//! identity of a build ([`RunIdentity`]: content hash, model hash, model configuration) and
//! the rule for resuming a checkpoint of another build ([`check_identity`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use titan_ir::Mesh;

use super::{CheckpointError, TrainerState, short};
use crate::backend::Trainer;

/// The mesh a checkpoint was written on, in TorchTitan's degrees (all 1: one device).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointMesh {
    pub dp_replicate: u32,
    pub dp_shard: u32,
    pub tp: u32,
}

impl Default for CheckpointMesh {
    fn default() -> Self {
        CheckpointMesh { dp_replicate: 1, dp_shard: 1, tp: 1 }
    }
}

impl From<Mesh> for CheckpointMesh {
    fn from(m: Mesh) -> Self {
        let [dp_replicate, dp_shard, tp] = m.sizes;
        CheckpointMesh { dp_replicate, dp_shard, tp }
    }
}

impl std::fmt::Display for CheckpointMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dims: Vec<String> = [("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp)]
            .iter()
            .filter(|(_, n)| *n > 1)
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        if dims.is_empty() { f.write_str("one device") } else { write!(f, "a mesh of {}", dims.join(" x ")) }
    }
}

impl CheckpointMesh {
    /// `dp_shard 2 x tp 2`, or `one device`.
    pub fn degrees(&self) -> String {
        let s = self.to_string();
        s.strip_prefix("a mesh of ").map_or(s.clone(), str::to_string)
    }
}

/// What identifies the build a run executes, for matching a checkpoint against it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunIdentity {
    /// The artifact's `content_hash` (graph mode: [`graph_identity`] of the graph text).
    pub content_hash: String,
    /// The model hash (`manifest.json`'s `model_hash`, a training graph's `meta model_hash`);
    /// `None` for artifacts and graphs of titanc before the model hash.
    pub model_hash: Option<String>,
    /// The model configuration (`titan_ir::identity::model_config` of the training graph), to
    /// name what differs; empty without a model hash.
    pub model_config: BTreeMap<String, String>,
}

impl RunIdentity {
    /// An artifact's identity: its content hash, model hash and its graph's model configuration.
    pub fn of_artifact(a: &crate::Artifact) -> RunIdentity {
        let model_hash = a.manifest.model_hash.clone();
        let model_config = if model_hash.is_some() { titan_ir::identity::model_config(&a.graph) } else { BTreeMap::new() };
        RunIdentity { content_hash: a.manifest.content_hash.clone(), model_hash, model_config }
    }

    /// A training graph's identity (graph mode): [`graph_identity`] of its text, and the model
    /// hash and configuration its `meta` records (`titanc lower --to train` writes them).
    pub fn of_graph(text: &str, g: &titan_ir::Graph) -> RunIdentity {
        let model_hash = titan_ir::identity::graph_model_hash(g);
        let model_config = if model_hash.is_some() { titan_ir::identity::model_config(g) } else { BTreeMap::new() };
        RunIdentity { content_hash: graph_identity(text), model_hash, model_config }
    }
}

/// A content hash alone (no model hash): checkpoints match it as before the model hash.
impl From<&str> for RunIdentity {
    fn from(content_hash: &str) -> RunIdentity {
        RunIdentity { content_hash: content_hash.to_string(), ..RunIdentity::default() }
    }
}

impl From<&String> for RunIdentity {
    fn from(content_hash: &String) -> RunIdentity {
        content_hash.as_str().into()
    }
}

impl From<&RunIdentity> for RunIdentity {
    fn from(id: &RunIdentity) -> RunIdentity {
        id.clone()
    }
}

/// The mesh `trainer` runs on (one device when it is not sharded).
pub fn run_mesh(trainer: &dyn Trainer) -> CheckpointMesh {
    trainer.sharded().map_or_else(CheckpointMesh::default, |s| s.mesh().into())
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

/// Whether checkpoint `state` may resume on a run of identity `here` on mesh `here_mesh`, and
/// the line to print about it:
///
/// - the same content hash: `Ok(None)`, the same build;
/// - another content hash but the same model hash: `Ok(Some("resharding a checkpoint of
///   dp_shard 2 x tp 2 onto one device"))` (or "... of another build of the same model" on the
///   same mesh);
/// - another model hash: [`CheckpointError::DifferentModel`], naming the configuration entries
///   that differ; without a model hash on either side (older checkpoints, artifacts or graphs),
///   [`CheckpointError::DifferentMesh`] or [`CheckpointError::DifferentBuild`] as before.
///
/// `allow_different_build` turns every refusal into `Ok(Some(..))` saying what was forced.
pub fn check_identity(
    state: &TrainerState,
    here: &RunIdentity,
    here_mesh: CheckpointMesh,
    allow_different_build: bool,
) -> Result<Option<String>, CheckpointError> {
    if state.content_hash == here.content_hash {
        return Ok(None);
    }
    let reshard = (state.mesh != here_mesh).then(|| format!("resharding a checkpoint of {} onto {}", state.mesh.degrees(), here_mesh));
    let refusal = match (&state.model_hash, &here.model_hash) {
        (Some(found), Some(expected)) if found == expected => {
            return Ok(Some(reshard.unwrap_or_else(|| {
                format!(
                    "resuming a checkpoint of another build of the same model (content hash {}, this build's {})",
                    short(&state.content_hash),
                    short(&here.content_hash)
                )
            })));
        }
        (Some(found), Some(expected)) => CheckpointError::DifferentModel {
            found: found.clone(),
            expected: expected.clone(),
            differences: differences(&state.model_config, &here.model_config),
        },
        (found, _) if state.mesh != here_mesh => {
            CheckpointError::DifferentMesh { found: state.mesh, expected: here_mesh, checkpoint_has_model_hash: found.is_some() }
        }
        _ => CheckpointError::DifferentBuild { found: state.content_hash.clone(), expected: here.content_hash.clone() },
    };
    if !allow_different_build {
        return Err(refusal);
    }
    let what = match &refusal {
        CheckpointError::DifferentModel { differences, .. } => format!("of another model or training configuration ({differences})"),
        _ => "of another build".to_string(),
    };
    Ok(Some(format!("--allow-different-build: resuming a checkpoint {what}{}", reshard.map_or(String::new(), |r| format!("; {r}")))))
}

/// The model configuration entries that differ, `key X in the checkpoint, Y in this run`.
fn differences(found: &BTreeMap<String, String>, expected: &BTreeMap<String, String>) -> String {
    if found.is_empty() || expected.is_empty() {
        return "which settings differ is not recorded".into();
    }
    let d = titan_ir::identity::config_differences(found, expected);
    if d.is_empty() {
        return "the same sizes and training options, but the model graphs differ".into();
    }
    let named: Vec<String> = d.iter().map(|(k, a, b)| format!("{k} {a} in the checkpoint, {b} in this run")).collect();
    named.join("; ")
}
