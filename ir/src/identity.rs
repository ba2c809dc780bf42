//! The model identity shared by the compiler and the runtime: which `meta` keys describe the
//! layout of a run (the mesh and the partitioning toggles) rather than the model, the `meta` key
//! a training graph records its model hash under, and the model configuration a checkpoint
//! records so that a refusal can name what differs.
//!
//! The hash itself is computed where the model graph and the training options meet
//! (`titan_passes::model_hash`, when a model is lowered to its training step); the runtime only
//! reads it back (`docs/checkpoints.md`, "Model identity").

use std::collections::BTreeMap;

use crate::Graph;

/// The `meta` key under which a training graph records the hash of the model graph and training
/// options it was lowered from.
pub const MODEL_HASH_META: &str = "model_hash";

/// The `meta` keys a training graph records its optimizer and learning-rate schedule under
/// (the values of `titan_passes::TrainOptions`), so that a graph names them without its ops
/// being read.
pub const TRAIN_META: [&str; 10] = [
    "train_lr",
    "train_warmup_steps",
    "train_decay_steps",
    "train_decay",
    "train_min_lr_ratio",
    "train_beta1",
    "train_beta2",
    "train_eps",
    "train_weight_decay",
    "train_max_norm",
];

/// The prefix of the `meta` keys a training graph records the model's named dims under, before
/// partitioning (`global_batch = 8`, `global_seq = 64`): an SPMD graph's own `dims` are one
/// rank's (its `batch` is the global batch over the data-parallel degrees).
pub const GLOBAL_DIM_PREFIX: &str = "global_";

/// Whether `key` is one the lowering records on a training graph: the model hash, the training
/// options ([`TRAIN_META`]) and the global dims ([`GLOBAL_DIM_PREFIX`]).
pub fn is_stamped_meta(key: &str) -> bool {
    key == MODEL_HASH_META || TRAIN_META.contains(&key) || key.starts_with(GLOBAL_DIM_PREFIX)
}

/// `meta` keys that describe how a run is laid out, not what it trains: the mesh
/// (`Mesh::write_meta`) and the partitioning toggles (`--disable-loss-parallel`,
/// `--disable-prefetch-next-layer`) and the activation-checkpointing policy (`--ac`: it changes
/// what is recomputed, not what is computed). They are left out of the model hash.
pub const LAYOUT_META: [&str; 7] =
    ["world_size", "mesh_dp_replicate", "mesh_dp_shard", "mesh_tp", "loss_parallel", "prefetch_next_layer", "activation_checkpoint"];

/// Whether `key` is a layout key ([`LAYOUT_META`]) or a record the lowering adds (the model
/// hash itself, `step = "train"`): keys a model graph's identity does not depend on.
pub fn is_derived_meta(key: &str) -> bool {
    LAYOUT_META.contains(&key) || key == MODEL_HASH_META || key == "step"
}

/// The model hash a training graph records (`meta model_hash`), if any.
pub fn graph_model_hash(g: &Graph) -> Option<String> {
    match g.meta.get(MODEL_HASH_META)? {
        crate::AttrValue::Str(s) | crate::AttrValue::Ident(s) => Some(s.clone()),
        _ => None,
    }
}

/// The model configuration of a training graph, by name: every `meta` entry but the layout, the
/// model hash and `step` (so the architecture, the training options of [`TRAIN_META`] and the
/// global dims), values in the IR text's spelling. A summary of what the model hash covers, for
/// naming what differs; the same for every mesh the model is lowered for.
pub fn model_config(g: &Graph) -> BTreeMap<String, String> {
    g.meta.entries.iter().filter(|(k, _)| !is_derived_meta(k)).map(|(k, v)| (k.clone(), v.to_string())).collect()
}

/// The entries in which two model configurations differ, one `key a vs b` each (`-` where one
/// side lacks the key), in key order. Empty when they agree.
pub fn config_differences(a: &BTreeMap<String, String>, b: &BTreeMap<String, String>) -> Vec<(String, String, String)> {
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter_map(|k| {
            let (x, y) = (a.get(k), b.get(k));
            (x != y).then(|| (k.clone(), x.cloned().unwrap_or_else(|| "-".into()), y.cloned().unwrap_or_else(|| "-".into())))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_leaves_out_the_layout_and_names_the_dims() {
        let text = "graph @m {\n  meta {n_layers = 2, world_size = 2, mesh_dp_replicate = 1, mesh_dp_shard = 1, mesh_tp = 2, loss_parallel = 0, step = \"train\", model_hash = \"ab\", train_lr = 0.003, global_batch = 8}\n  dims {batch = 4, seq = 8}\n\n  func @main {\n    input %x : f32[batch, seq]\n    output y = %x\n  }\n}\n";
        let g = match crate::parse(text) {
            Ok((g, _)) => g,
            Err(e) => panic!("{e:?}"),
        };
        let c = model_config(&g);
        let keys: Vec<&str> = c.keys().map(String::as_str).collect();
        assert_eq!(keys, ["global_batch", "n_layers", "train_lr"]);
        assert!(is_stamped_meta("global_batch") && is_stamped_meta("train_lr") && is_stamped_meta("model_hash") && !is_stamped_meta("n_layers"));
        assert_eq!(graph_model_hash(&g).as_deref(), Some("ab"));
        let mut other = c.clone();
        other.insert("n_layers".into(), "3".into());
        other.remove("train_lr");
        assert_eq!(config_differences(&c, &other), vec![("n_layers".into(), "2".into(), "3".into()), ("train_lr".into(), "0.003".into(), "-".into())]);
    }
}
