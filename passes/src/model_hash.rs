//! The model hash: what makes two runs' states and training trajectories compatible, so that a
//! checkpoint of one resumes on the other whatever mesh, partitioning toggles or build choices
//! either used (`docs/checkpoints.md`, "Model identity").
//!
//! It is the hex SHA-256 of two length-prefixed parts:
//!
//! - the **model graph before partitioning**, printed in the IR text format (so formatting and
//!   comments of the input file do not count) with its name and its layout `meta` left out
//!   (`titan_ir::identity::LAYOUT_META`: the mesh, `loss_parallel`, `prefetch_next_layer`; and
//!   the records a lowering adds). That is the architecture, every shape and dtype, the named
//!   dims (`batch` is the *global* batch, so the data position means the same batches), the
//!   initializers and the loss;
//! - the **training options** ([`TrainOptions::canonical_lines`]): AdamW's hyperparameters, the
//!   learning-rate schedule and gradient clipping.
//!
//! Not in it: the mesh and parallel degrees, `--disable-loss-parallel`,
//! `--disable-prefetch-next-layer`, the pass pipeline, fusion, code generation, `ptxas`, the
//! target, the artifact format and titan's version (the content hash covers all of those), and
//! the run's seed, data and step count (`titan-run` settings: the checkpoint records the seed
//! and the data position, and a resumed run continues with them).

use sha2::{Digest, Sha256};
use titan_ir::identity::{GLOBAL_DIM_PREFIX, MODEL_HASH_META, is_derived_meta, is_stamped_meta};
use titan_ir::{AttrValue, Graph};

use crate::TrainOptions;

/// The model hash of `model` (a model graph, before partitioning; a layout `meta` written on it
/// is ignored) trained with `opts`.
pub fn model_hash(model: &Graph, opts: &TrainOptions) -> String {
    let mut g = model.clone();
    g.name = "model".into();
    g.meta.entries.retain(|(k, _)| !is_derived_meta(k) && !is_stamped_meta(k));
    let graph = titan_ir::print::print_graph(&g);
    let train: String = opts.canonical_lines().iter().map(|(k, v)| format!("train.{k} = {v}\n")).collect();
    let mut h = Sha256::new();
    h.update(b"titan model 1\n");
    for (label, text) in [("graph", graph.as_str()), ("train", train.as_str())] {
        h.update(format!("{label} {}\n", text.len()).as_bytes());
        h.update(text.as_bytes());
        h.update(b"\n");
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Record on training graph `g` lowered from `model` with `opts` its model hash
/// (`meta model_hash`), the training options (`meta train_lr`, ...: `TRAIN_META`) and the
/// model's named dims before partitioning (`meta global_batch`, `global_seq`), replacing any
/// such entries `model` carried. `titan_ir::identity::model_config` reads them back.
pub fn stamp_model_identity(g: &mut Graph, model: &Graph, opts: &TrainOptions) {
    let hash = model_hash(model, opts);
    g.meta.entries.retain(|(k, _)| !is_stamped_meta(k));
    g.meta.entries.push((MODEL_HASH_META.into(), AttrValue::Str(hash)));
    g.meta.entries.extend(opts.meta_entries());
    for (name, &size) in &model.dims {
        g.meta.entries.push((format!("{GLOBAL_DIM_PREFIX}{name}"), AttrValue::Int(i64::try_from(size).unwrap_or(i64::MAX))));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> Graph {
        titan_ir::parse_file(std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/llama3-debug.ir"))).expect("debug model")
    }

    #[test]
    fn the_layout_meta_and_the_name_do_not_count() {
        let m = model();
        let opts = TrainOptions::default();
        let h = model_hash(&m, &opts);
        assert_eq!(h.len(), 64);
        let mut meshed = m.clone();
        titan_ir::Mesh::new(2, 2, 2).write_meta(&mut meshed);
        crate::shard_tp::disable_loss_parallel(&mut meshed);
        crate::prefetch_next_layer::disable_prefetch_next_layer(&mut meshed);
        crate::activation_checkpoint::AcPolicy::SelectiveOp.write_meta(&mut meshed);
        meshed.name = "renamed".into();
        assert_eq!(model_hash(&meshed, &opts), h);
        assert_eq!(
            titan_ir::identity::LAYOUT_META
                .iter()
                .filter(|k| [crate::shard_tp::LOSS_PARALLEL_META, crate::prefetch_next_layer::PREFETCH_NEXT_LAYER_META].contains(k))
                .count(),
            2
        );
    }

    #[test]
    fn the_model_and_the_training_options_count() {
        let m = model();
        let opts = TrainOptions::default();
        let h = model_hash(&m, &opts);
        assert_ne!(model_hash(&m, &TrainOptions { lr: 1e-3, ..opts.clone() }), h);
        assert_ne!(model_hash(&m, &TrainOptions { max_norm: None, ..opts.clone() }), h);
        assert_ne!(model_hash(&m, &TrainOptions { warmup_steps: 7, ..opts.clone() }), h);
        let mut batch = m.clone();
        batch.dims.insert("batch".into(), 16);
        assert_ne!(model_hash(&batch, &opts), h);
        let mut meta = m.clone();
        meta.meta.entries.push(("note".into(), AttrValue::Str("x".into())));
        assert_ne!(model_hash(&meta, &opts), h);
    }

    #[test]
    fn lowering_stamps_the_hash_and_the_options() {
        let m = model();
        let opts = TrainOptions { lr: 3e-3, ..TrainOptions::default() };
        let g = crate::lower_to_train(&m, &opts).expect("lowering");
        assert_eq!(titan_ir::identity::graph_model_hash(&g), Some(model_hash(&m, &opts)));
        let config = titan_ir::identity::model_config(&g);
        assert_eq!(config.get("train_lr").map(String::as_str), Some("0.003"));
        assert_eq!(config.get("train_decay").map(String::as_str), Some("\"linear\""));
        assert_eq!(config.get("n_layers").map(String::as_str), Some("2"));
        assert_eq!(config.get("global_batch").map(String::as_str), Some("8"));
        // An SPMD lowering records the same: its `dims` are one rank's, its config the model's.
        let mut meshed = m.clone();
        titan_ir::Mesh::new(1, 2, 1).write_meta(&mut meshed);
        let spmd = crate::lower_to_train(&meshed, &opts).expect("spmd lowering");
        assert_eq!(spmd.dims.get("batch"), Some(&4));
        assert_eq!(titan_ir::identity::model_config(&spmd), config);
        assert_eq!(titan_ir::identity::graph_model_hash(&spmd), titan_ir::identity::graph_model_hash(&g));
    }
}
