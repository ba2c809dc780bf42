//! Distributed training on the CPU simulated mesh: the debug model (f32) lowered with a mesh in
//! its meta (`shard-dp`, autodiff, `sync-grads`, AdamW, `check-collectives`) and run by one
//! thread per rank must track the single-rank run step for step: losses, gradient norms and
//! every state buffer (master weights and AdamW moments, gathered from their shards).
//!
//! Tolerance: the mesh run is not bit-identical to the single-rank run because the sums are
//! taken in a different order: the loss mean and every gradient are per-rank partial sums
//! added across ranks, and the gradient norm sums per-group squares before the all-reduce.
//! These are f32 rounding differences (relative ~1e-6 in losses and gradient norms), which
//! AdamW's `m / sqrt(v)` amplifies for elements whose gradient is near zero: the largest state
//! difference measured is 1.1e-5 (tp = 4, a `w1` weight; lr 3e-3); the others are below 5e-6
//! (the measured maxima are printed with `--nocapture`).

use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::interp::Tensor;
use titan_ir::{DType, Graph, Mesh, MeshDim, Op, Placement, TensorType};
use titan_passes::lower_to_train;
use titan_runtime::{BUNDLED_CORPUS, Batch, Batcher, CpuTrainer, MeshTrainer, byte_tokens};

const STEPS: usize = 5;
/// Max |loss difference| over the steps.
const LOSS_TOL: f64 = 1e-5;
/// Max |difference| of any state element (weights and moments), after 5 steps.
const STATE_TOL: f32 = 5e-5;

use crate::common::debug_f32;

/// The debug model with as many kv heads as query heads (4), so tp = 4 splits whole heads.
fn mha_model() -> Graph {
    let cfg = LlamaConfig { dtype: DType::F32, n_kv_heads: 4, ..LlamaConfig::preset(Preset::Debug) };
    build_llama3(&cfg, "llama3_debug_mha").expect("debug model")
}

/// The debug model with the output head tied to `tok_embeddings` (Llama 3.2 1B/3B).
fn tied_model() -> Graph {
    let cfg = LlamaConfig { dtype: DType::F32, tie_embeddings: true, ..LlamaConfig::preset(Preset::Debug) };
    build_llama3(&cfg, "llama3_debug_tied").expect("debug model")
}

use crate::common::train_options;

fn batches(batch: usize, seq: usize) -> Vec<Batch> {
    let mut b = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), batch, seq, 7).expect("batcher");
    (0..STEPS).map(|_| b.next_batch()).collect()
}

struct Run {
    losses: Vec<f64>,
    grad_norms: Vec<f64>,
    states: Vec<(String, Tensor<f32>)>,
}

fn single_rank(model: fn() -> Graph) -> Run {
    let g = lower_to_train(&model(), &train_options()).expect("lowering");
    let mut t = CpuTrainer::new(&g, 0).expect("trainer");
    let (mut losses, mut grad_norms) = (Vec::new(), Vec::new());
    for b in batches(t.batch_size(), t.seq_len()) {
        let m = t.step(&b).expect("step");
        losses.push(m.loss);
        grad_norms.push(m.grad_norm);
    }
    let states = t.states().map(|(p, t)| (p.name.clone(), t.clone())).collect();
    Run { losses, grad_norms, states }
}

fn spmd_graph(mesh: Mesh) -> Result<Graph, String> {
    spmd_graph_of(mesh, debug_f32)
}

fn spmd_graph_of(mesh: Mesh, model: fn() -> Graph) -> Result<Graph, String> {
    let mut m = model();
    mesh.write_meta(&mut m);
    lower_to_train(&m, &train_options()).map_err(|e| e.to_string())
}

fn mesh_run(mesh: Mesh, model: fn() -> Graph) -> Run {
    let g = spmd_graph_of(mesh, model).expect("spmd lowering");
    let errs = titan_ir::verify::verify(&g);
    assert!(errs.is_empty(), "{:?}", errs.iter().map(|e| e.to_string()).collect::<Vec<_>>());
    let mut t = MeshTrainer::new(&g, 0).expect("mesh trainer");
    assert_eq!(t.global_batch(), 8);
    let (mut losses, mut grad_norms) = (Vec::new(), Vec::new());
    for b in batches(t.global_batch(), 64) {
        let m = t.step(&b).expect("step");
        losses.push(m.loss);
        grad_norms.push(m.grad_norm);
    }
    Run { losses, grad_norms, states: t.gathered_states().expect("gather") }
}

fn check(mesh: Mesh) {
    check_model(mesh, debug_f32);
}

fn check_model(mesh: Mesh, model: fn() -> Graph) {
    check_model_with(mesh, model, LOSS_TOL);
}

/// [`check_model`] with another bound on |loss difference|.
fn check_model_with(mesh: Mesh, model: fn() -> Graph, loss_tol: f64) {
    let want = single_rank(model);
    let got = mesh_run(mesh, model);
    let loss_diff = want.losses.iter().zip(&got.losses).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    let norm_diff = want.grad_norms.iter().zip(&got.grad_norms).map(|(a, b)| (a - b).abs() / a.abs()).fold(0.0, f64::max);
    assert_eq!(want.states.len(), got.states.len());
    let mut state_diff = 0.0f32;
    let mut worst = String::new();
    for ((n1, t1), (n2, t2)) in want.states.iter().zip(&got.states) {
        assert_eq!(n1, n2);
        assert_eq!(t1.shape, t2.shape, "{n1}");
        let (a, b) = (t1.floats().expect("float"), t2.floats().expect("float"));
        let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        if d > state_diff {
            state_diff = d;
            worst = n1.clone();
        }
    }
    println!(
        "mesh {:?}: losses {:?}; max |dloss| {loss_diff:.3e}, max rel dgrad_norm {norm_diff:.3e}, max |dstate| {state_diff:.3e} ({worst})",
        mesh.sizes, got.losses
    );
    assert!(loss_diff <= loss_tol, "losses differ by {loss_diff}: {:?} vs {:?}", want.losses, got.losses);
    assert!(norm_diff <= 1e-4, "grad norms differ: {:?} vs {:?}", want.grad_norms, got.grad_norms);
    assert!(state_diff <= STATE_TOL, "state `{worst}` differs by {state_diff}");
}

/// `--disable-loss-parallel` (TorchTitan's `disable_loss_parallel`): the logits are all-gathered
/// and the cross-entropy computed whole on each tp rank; still the single-rank run.
#[test]
fn tp_2_without_loss_parallel_matches_single_rank() {
    fn whole_loss() -> Graph {
        let mut g = debug_f32();
        titan_passes::shard_tp::disable_loss_parallel(&mut g);
        g
    }
    let g = spmd_graph_of(Mesh::new(1, 1, 2), whole_loss).expect("spmd lowering");
    let text = titan_ir::print::print_graph(&g);
    assert!(!text.contains("cross_entropy_stats") && text.contains("= cross_entropy("), "the loss is computed whole");
    check_model(Mesh::new(1, 1, 2), whole_loss);
}

#[test]
fn dp_shard_2_matches_single_rank() {
    check(Mesh::new(1, 2, 1));
}

#[test]
fn dp_shard_4_matches_single_rank() {
    check(Mesh::new(1, 4, 1));
}

#[test]
fn dp_replicate_2_matches_single_rank() {
    check(Mesh::new(2, 1, 1));
}

#[test]
fn hsdp_dp_replicate_2_dp_shard_2_matches_single_rank() {
    check(Mesh::new(2, 2, 1));
}

#[test]
fn tp_2_matches_single_rank() {
    check(Mesh::new(1, 1, 2));
}

/// tp = 4 with 4 kv heads: each rank owns one whole query head and its kv head (the debug
/// model with `n_kv_heads = 4` for both the single-rank and the mesh run).
#[test]
fn tp_4_with_four_kv_heads_matches_single_rank() {
    check_model(Mesh::new(1, 1, 4), mha_model);
}

/// tp = 4 on the stock debug model (2 kv heads): kv-head replication. Ranks 0, 1 use kv head
/// 0 and ranks 2, 3 kv head 1; `wk`/`wv` stay replicated on `tp` and their gradients are
/// summed over the ranks, so they match the single-rank parameters.
#[test]
fn tp_4_with_two_kv_heads_matches_single_rank() {
    check(Mesh::new(1, 1, 4));
}

/// FSDP x TP with kv-head replication (world 8): `wk`/`wv` sharded on `dp_shard`, replicated
/// on `tp`.
#[test]
fn fsdp_dp_shard_2_tp_4_matches_single_rank() {
    check(Mesh::new(1, 2, 4));
}

/// Tied embeddings on dp_shard 2 x tp 2: the one table is vocab-parallel for both readers
/// (`gather_shard` for the embedding, the vocab-parallel logits and loss for the head), and
/// its gradient sums both uses on each rank's rows.
#[test]
fn fsdp_dp_shard_2_tp_2_with_tied_embeddings_matches_single_rank() {
    let g = spmd_graph_of(Mesh::new(1, 2, 2), tied_model).expect("spmd lowering");
    let ops: Vec<&Op> = g.main.order.iter().map(|&n| &g.main.node(n).op).collect();
    assert!(ops.contains(&&Op::GatherShard) && ops.contains(&&Op::CrossEntropyStats), "{ops:?}");
    assert!(g.main.find("output").is_none(), "one table");
    check_model_with(Mesh::new(1, 2, 2), tied_model, LOSS_TOL);
}

#[test]
fn fsdp_dp_shard_2_tp_2_matches_single_rank() {
    check(Mesh::new(1, 2, 2));
}

#[test]
fn hsdp_dp_replicate_2_dp_shard_2_tp_2_matches_single_rank() {
    check(Mesh::new(2, 2, 2));
}

/// The `repeat` of `block` in `main`: (carry, prefetch).
fn repeat_of(g: &Graph, block: &str) -> (usize, usize) {
    let id = g.block_by_name(block).expect("block");
    g.main
        .order
        .iter()
        .find_map(|&n| match g.main.node(n).op {
            Op::Repeat { block: b, carry, prefetch, .. } if b == id => Some((carry as usize, prefetch as usize)),
            _ => None,
        })
        .expect("repeat")
}

/// FSDP reshards after the forward: the layer's forward saves no gathered weight for the
/// backward (the 9 per-layer parameter gathers are not among its stacked outputs; with
/// `prefetch-next-layer` they are its prefetched carries, the next layer's weights), and the
/// backward block gathers them again itself; both blocks issue those gathers at their top.
#[test]
fn fsdp_regathers_the_weights_in_the_backward() {
    let g = spmd_graph(Mesh::new(1, 2, 1)).expect("spmd lowering");
    let fwd = g.block(g.block_by_name("layer").expect("layer block"));
    let (carry, prefetch) = repeat_of(&g, "layer");
    assert_eq!((carry, prefetch), (1, 9));
    let gathered: Vec<_> = fwd.outputs[carry + prefetch..]
        .iter()
        .filter(|o| matches!(fwd.value(o.value).def, titan_ir::ValueDef::Result { node, .. } if matches!(fwd.node(node).op, titan_ir::Op::AllGather { .. })))
        .collect();
    assert!(gathered.is_empty(), "the forward saves {} gathered values", gathered.len());
    let bwd = g.blocks.iter().find(|b| b.name.starts_with("layer") && b.name != "layer").expect("backward block");
    let regathers = bwd.order.iter().filter(|&&n| matches!(bwd.node(n).op, titan_ir::Op::AllGather { .. })).count();
    assert_eq!(regathers, 9, "one gather per layer parameter in `{}`", bwd.name);
    // Prefetch (`prefetch-gathers`): both blocks issue their 9 parameter gathers first.
    for b in [fwd, bwd] {
        let leading = b.order.iter().take_while(|&&n| matches!(b.node(n).op, titan_ir::Op::AllGather { .. })).count();
        assert_eq!(leading, 9, "`{}` starts with its parameter gathers", b.name);
    }
}

/// `prefetch-next-layer`: in both loops each parameter gather reads the *next* layer's shard
/// and is returned as a prefetched carry; the layer computes with the carried-in weights that
/// the previous layer (or, for the first, the loop's prologue) gathered. The snapshot is the
/// forward block and the two `repeat`s of the FSDP (dp_shard 2) training graph.
#[test]
fn fsdp_prefetches_the_next_layers_weights() {
    let g = spmd_graph(Mesh::new(1, 2, 1)).expect("spmd lowering");
    let text = titan_ir::print::print_graph(&g);
    let start = text.find("block @layer(").expect("block");
    let end = text[start..].find("\n  }\n").expect("block end") + start + 4;
    let repeats: Vec<&str> = text.lines().filter(|l| l.contains("= repeat(")).collect();
    insta::assert_snapshot!("fsdp2_prefetch_next_layer", format!("{}\n{}\n", &text[start..end], repeats.join("\n")));
    for name in ["layer", "layer_bwd"] {
        let b = g.block(g.block_by_name(name).expect("block"));
        let (carry, prefetch) = repeat_of(&g, name);
        assert_eq!(prefetch, 9, "@{name}");
        let split = titan_ir::prefetch::prefetch_split(b, carry, b.args.len() - carry - prefetch, prefetch).expect("splits");
        // Only the 9 gathers run ahead; each is read by nothing but the prefetched output.
        let ahead: Vec<_> = b.order.iter().filter(|&&n| split.contains(n)).collect();
        assert_eq!(ahead.len(), 9);
        for (k, &&n) in ahead.iter().enumerate() {
            let node = b.node(n);
            assert!(matches!(node.op, Op::AllGather { mesh_dim: MeshDim::DpShard, .. }), "@{name}: {:?}", node.op);
            assert_eq!(b.outputs[carry + k].value, node.results[0]);
            assert!(b.order.iter().all(|&m| !b.node(m).inputs.contains(&node.results[0])), "@{name}: the next layer's weight is read in this layer");
            // The carried-in weight of the same parameter is what the layer reads.
            let cur = b.args[carry + k].value;
            assert!(b.order.iter().any(|&m| b.node(m).inputs.contains(&cur)), "@{name}: carried weight {k} is unused");
        }
    }
    // The same collectives on every communicator, reordered: each loop gathers layer l + 1
    // before the rest of layer l (in the backward, before its gradient reduce-scatters).
    let mut off = debug_f32();
    Mesh::new(1, 2, 1).write_meta(&mut off);
    titan_passes::prefetch_next_layer::disable_prefetch_next_layer(&mut off);
    let off = lower_to_train(&off, &train_options()).expect("lowering without prefetch");
    assert!(!titan_ir::print::print_graph(&off).contains("prefetch ="));
    let calls = |g: &Graph| -> Vec<String> {
        let sched = titan_passes::check_collectives::collective_schedule(g).expect("schedule");
        assert_eq!(sched.len(), 1, "dp_shard only");
        sched[0].1.iter().map(|c| c.what.split(" (node").next().unwrap_or_default().trim_matches('`').to_string()).collect()
    };
    let (on_calls, off_calls) = (calls(&g), calls(&off));
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    assert_eq!(sorted(on_calls.clone()), sorted(off_calls.clone()), "the same collectives");
    // The backward loop (2 layers): without prefetch each layer gathers its weights, then
    // reduce-scatters its gradients; with it, the last layer's 9 gathers run before the loop
    // (prologue) and layer 0's during layer 1, before layer 1's reduce-scatters.
    let kinds = |calls: &[String]| -> Vec<String> { calls.iter().map(|c| c.split(' ').next().unwrap_or_default().to_string()).collect() };
    let run = |parts: &[(&str, usize)]| -> Vec<String> { parts.iter().flat_map(|&(k, n)| std::iter::repeat_n(k.to_string(), n)).collect() };
    let has = |calls: &[String], pattern: &[String]| kinds(calls).windows(pattern.len()).any(|w| w == pattern);
    let prefetched = run(&[("all_gather", 18), ("reduce_scatter", 18)]);
    let per_layer = run(&[("all_gather", 9), ("reduce_scatter", 9), ("all_gather", 9), ("reduce_scatter", 9)]);
    assert!(has(&on_calls, &prefetched) && !has(&on_calls, &per_layer), "{on_calls:#?}");
    assert!(has(&off_calls, &per_layer) && !has(&off_calls, &prefetched), "{off_calls:#?}");
}

/// Without `prefetch-next-layer` (`--disable-prefetch-next-layer`), FSDP still tracks the
/// single-rank run (each layer gathers its own weights at its top).
#[test]
fn dp_shard_2_without_prefetch_matches_single_rank() {
    fn no_prefetch() -> Graph {
        let mut g = debug_f32();
        titan_passes::prefetch_next_layer::disable_prefetch_next_layer(&mut g);
        g
    }
    check_model(Mesh::new(1, 2, 1), no_prefetch);
}

/// The layer block under kv-head replication: each rank slices its kv head out of the
/// replicated `wk`/`wv` (`take_shard` of the head-repeated weight) and the backward places
/// the weight gradient back (`place_shard`) for `sync-grads` to all-reduce over `tp`.
#[test]
fn kv_head_replication_slices_the_replicated_kv_weights() {
    let g = spmd_graph(Mesh::new(1, 1, 4)).expect("spmd lowering");
    let text = titan_ir::print::print_graph(&g);
    assert!(text.contains("= take_shard(%wk.repeated) {mesh_dim = tp, dim = 0, size = 4} : f32[16, 64] #[Replicate, Replicate, Shard(0)]"), "{text}");
    assert!(text.contains("= take_shard(%wv.repeated) {mesh_dim = tp, dim = 0, size = 4} : f32[16, 64]"), "{text}");
    // The backward's two, and the one-hot of the rank's vocabulary shard (one for the embedding
    // and the loss after `cse`).
    assert_eq!(text.matches("place_shard(").count(), 3, "{text}");
    assert!(text.contains("%k = reshape(%") && text.contains(": f32[batch, seq, 1, 16]"), "{text}");
}

/// Loss parallelism: the vocab-parallel logits are never gathered. Each tp rank computes the
/// cross-entropy statistics of its vocabulary shard; the only tp collectives of the loss are
/// three all-gathers of per-token statistics (`f32[batch, seq, 1]` -> `[batch, seq, tp]`) and,
/// in the backward, their three reduce-scatters, which feed `cross_entropy_stats_bwd`.
#[test]
fn loss_parallel_exchanges_per_token_statistics_not_the_logits() {
    let g = spmd_graph(Mesh::new(1, 2, 2)).expect("spmd lowering");
    let main = &g.main;
    assert_eq!(g.dims.get("batch"), Some(&4), "8 rows over dp_shard 2");
    let logits = main.find("logits").expect("%logits");
    assert_eq!(main.ty(logits).to_string(), "f32[batch, 64, 128]", "this rank's half of the 256-word vocabulary");
    let readers: Vec<&str> = main.order.iter().map(|&n| main.node(n)).filter(|nd| nd.inputs.contains(&logits)).map(|nd| nd.op.name()).collect();
    assert_eq!(readers, ["cross_entropy_stats", "cross_entropy_stats_bwd"]);
    // No tp collective moves logits (a last dim of 128 or 256 words) anywhere.
    for r in std::iter::once(main).chain(&g.blocks) {
        for nd in r.order.iter().map(|&n| r.node(n)).filter(|nd| nd.op.collective_mesh_dim() == Some(MeshDim::Tp)) {
            let tys = [r.ty(nd.inputs[0]), r.ty(nd.results[0])];
            let vocab = |t: &&TensorType| matches!(t.shape.last(), Some(titan_ir::Dim::Fixed(128 | 256)));
            assert!(!tys.iter().any(vocab), "`{}` {tys:?} in @{}", nd.op.name(), r.name);
        }
    }
    let stats_node = main.order.iter().map(|&n| main.node(n)).find(|nd| matches!(nd.op, Op::CrossEntropyStats)).expect("cross_entropy_stats");
    let describe = |v: titan_ir::Value| -> String {
        let titan_ir::ValueDef::Result { node, .. } = main.value(v).def else { return "an argument".into() };
        let nd = main.node(node);
        format!("{:?} {} -> {}", nd.op, main.ty(nd.inputs[0]), main.ty(v))
    };
    let mut gathers = Vec::new();
    for &x in &stats_node.results {
        assert_eq!(main.ty(x).to_string(), "f32[batch, seq, 1]");
        let users: Vec<_> = main.order.iter().map(|&n| main.node(n)).filter(|nd| nd.inputs.contains(&x)).collect();
        assert_eq!(users.len(), 1, "each statistic is read by its all_gather only");
        gathers.push(describe(users[0].results[0]));
    }
    let gather = "AllGather { mesh_dim: Tp, dim: 2, size: 2 } f32[batch, seq, 1] -> f32[batch, seq, 2]";
    assert_eq!(gathers, [gather; 3]);
    let combine = main.order.iter().map(|&n| main.node(n)).find(|nd| matches!(nd.op, Op::CrossEntropyCombine)).expect("cross_entropy_combine");
    assert!(combine.inputs.iter().all(|&v| describe(v) == gather), "the loss combines the gathered statistics");
    let bwd = main.order.iter().map(|&n| main.node(n)).find(|nd| matches!(nd.op, Op::CrossEntropyStatsBwd)).expect("cross_entropy_stats_bwd");
    let scatter = "ReduceScatter { mesh_dim: Tp, dim: 2, size: 2, reduce: Sum } f32[batch, seq, 2] -> f32[batch, seq, 1]";
    let cotangents: Vec<String> = bwd.inputs[3..].iter().map(|&v| describe(v)).collect();
    assert_eq!(cotangents, [scatter; 3]);
}

/// The vocab-parallel embedding (TorchTitan's `RowwiseParallel`): each tp rank holds its rows
/// of `tok_embeddings` (and their AdamW moments), looks up the whole `tokens` (replicated on
/// tp, no longer sequence-sharded) with `gather_shard`, and reduce-scatters the partial rows
/// along seq into the sequence-parallel carry. Its gradient is the `scatter_add_shard` of the
/// all-gathered cotangent into the rank's rows: no tp all-reduce.
#[test]
fn the_embedding_is_sharded_by_vocabulary_rows_over_tp() {
    let g = spmd_graph(Mesh::new(1, 1, 2)).expect("spmd lowering");
    let main = &g.main;
    let tp = MeshDim::Tp.index();
    for name in ["tok_embeddings", "tok_embeddings.exp_avg", "tok_embeddings.exp_avg_sq"] {
        let v = main.find(name).expect(name);
        assert_eq!(main.ty(v).to_string(), "f32[128, 64]", "{name}: half of the 256-word vocabulary");
        assert_eq!(main.value(v).placement[tp], Placement::Shard(0), "{name}");
    }
    let tokens = main.find("tokens").expect("%tokens");
    assert_eq!(main.ty(tokens).to_string(), "i32[batch, seq]", "whole sequences on every tp rank");
    assert_eq!(main.value(tokens).placement[tp], Placement::Replicate);
    let nodes: Vec<&titan_ir::Node> = main.order.iter().map(|&n| main.node(n)).collect();
    let lookup = nodes.iter().find(|nd| matches!(nd.op, Op::GatherShard)).expect("gather_shard");
    assert_eq!(lookup.inputs[1], tokens);
    assert!(!nodes.iter().any(|nd| matches!(nd.op, Op::Embedding | Op::ScatterAdd)), "no whole-table lookup or gradient");
    let users: Vec<&Op> = nodes.iter().filter(|nd| nd.inputs.contains(&lookup.results[0])).map(|nd| &nd.op).collect();
    assert_eq!(users, [&Op::ReduceScatter { mesh_dim: MeshDim::Tp, dim: 1, size: 2, reduce: titan_ir::CollectiveReduce::Sum }]);
    let x = main.find("x").expect("%x");
    assert_eq!(main.ty(x).to_string(), "f32[batch, 32, 64]", "this rank's half of the sequence");
    let grad = nodes.iter().find(|nd| matches!(nd.op, Op::ScatterAddShard)).expect("scatter_add_shard");
    assert_eq!(main.ty(grad.results[0]).to_string(), "f32[128, 64]");
    let titan_ir::ValueDef::Result { node, .. } = main.value(grad.inputs[1]).def else { panic!("the cotangent is computed") };
    assert_eq!(main.node(node).op, Op::AllGather { mesh_dim: MeshDim::Tp, dim: 1, size: 2 }, "the carry's cotangent, all-gathered along seq");
    // tp all-reduces only the norms' gradients and scalars (loss, gradient-norm partial sums).
    let mut reduced: Vec<String> =
        nodes.iter().filter(|nd| matches!(nd.op, Op::AllReduce { mesh_dim: MeshDim::Tp, .. })).map(|nd| main.ty(nd.inputs[0]).to_string()).collect();
    reduced.sort();
    reduced.dedup();
    assert_eq!(reduced, ["f32[2, 64]", "f32[64]", "f32[]"]);
}

/// A tp that neither divides the kv heads nor is a multiple of them cannot give every rank
/// whole kv heads: n_heads 6, n_kv_heads 2, tp 3.
#[test]
fn a_tp_that_splits_a_kv_head_is_rejected() {
    fn six_heads() -> Graph {
        let cfg = LlamaConfig { dtype: DType::F32, dim: 96, n_heads: 6, n_kv_heads: 2, seq_len: 96, vocab_size: 258, ..LlamaConfig::preset(Preset::Debug) };
        build_llama3(&cfg, "llama3_debug_6h").expect("debug model")
    }
    let err = spmd_graph_of(Mesh::new(1, 1, 3), six_heads).expect_err("2 kv heads over 3 ranks");
    assert!(err.contains("tp = 3 neither divides n_kv_heads = 2 nor is a multiple of it") && err.ends_with("choose tp in {1, 2, 6}"), "{err}");
    spmd_graph_of(Mesh::new(1, 1, 6), six_heads).expect("tp = 6: three ranks per kv head");
}

#[test]
fn a_batch_not_divisible_by_the_data_parallel_degree_is_rejected() {
    let err = spmd_graph(Mesh::new(1, 3, 1)).expect_err("8 rows over 3 ranks");
    assert!(err.contains("batch = 8 is not divisible by dp_replicate x dp_shard = 3"), "{err}");
}

#[test]
fn a_mesh_meta_that_disagrees_with_world_size_is_rejected() {
    let mut m = debug_f32();
    Mesh::new(1, 2, 1).write_meta(&mut m);
    for (k, v) in &mut m.meta.entries {
        if k == "world_size" {
            *v = titan_ir::AttrValue::Int(4);
        }
    }
    let err = lower_to_train(&m, &train_options()).expect_err("inconsistent mesh").to_string();
    assert!(err.contains("meta world_size = 4 but the mesh"), "{err}");
}

/// The HSDP x TP graph: every parameter is sharded on `dp_shard` and all-gathered inside the
/// block (per-layer weights) or before its use in `main`; block weights are column- or
/// row-parallel on `tp` with a reduce-scatter along the sequence after each row-parallel
/// product (sequence parallelism).
#[test]
fn partitioned_debug_block() {
    let g = spmd_graph(Mesh::new(2, 2, 2)).expect("spmd lowering");
    let text = titan_ir::print::print_graph(&g);
    let block = |name: &str| -> String {
        let start = text.find(&format!("block @{name}(")).expect("block");
        let end = text[start..].find("\n  }\n").expect("block end") + start + 4;
        text[start..end].to_string()
    };
    insta::assert_snapshot!("hsdp_tp_layer_block", block("layer"));
    // The partitioned main: the vocab-parallel embedding (`gather_shard` of the whole tokens,
    // reduce-scattered along seq; `scatter_add_shard` of the all-gathered cotangent, no tp
    // all-reduce of its gradient), the vocab-parallel loss, gradient sync and AdamW.
    let start = text.find("  func @main {").expect("main");
    insta::assert_snapshot!("hsdp_tp_main", &text[start..]);
    let sched = titan_passes::check_collectives::collective_schedule(&g).expect("schedule");
    let counts: Vec<(String, usize)> = sched.iter().map(|(m, s)| (m.to_string(), s.len())).collect();
    insta::assert_debug_snapshot!("hsdp_tp_collective_counts", counts);
}

/// Fusion keeps every collective out of the kernels: the fused SPMD graph is a kernel graph
/// whose regions hold the collectives as nodes of their own (each one schedule step of
/// `titanc build`), as many as before fusion.
#[test]
fn fusing_an_spmd_graph_keeps_collectives_as_their_own_nodes() {
    let mut g = spmd_graph(Mesh::new(1, 2, 2)).expect("spmd lowering");
    let count = |g: &Graph| {
        std::iter::once(&g.main)
            .chain(&g.blocks)
            .flat_map(|r| r.order.iter().map(move |n| &r.node(*n).op))
            .filter(|op| titan_passes::fuse::is_collective_step(op))
            .count()
    };
    let before = count(&g);
    titan_passes::fuse(&mut g).expect("fusion");
    assert!(titan_passes::fuse::check_kernel_graph(&g).is_empty(), "{:?}", titan_passes::fuse::check_kernel_graph(&g));
    assert!(before > 0);
    assert_eq!(count(&g), before);
    let bodies = titan_passes::fuse::kernel_bodies(&g);
    for b in bodies {
        assert!(!g.blocks[b.index()].order.iter().any(|n| titan_passes::fuse::is_collective_step(&g.blocks[b.index()].node(*n).op)));
    }
}

/// The collective safety check names the offending ops: sizes that disagree with the mesh,
/// and collectives in a graph without one.
#[test]
fn collective_check_names_the_ops_it_rejects() {
    let g = spmd_graph(Mesh::new(1, 2, 1)).expect("spmd lowering");
    let mut wrong = g.clone();
    Mesh::new(1, 4, 1).write_meta(&mut wrong);
    let err = titan_passes::check_collectives::check_collectives(&mut wrong).expect_err("size 2 on a mesh of 4");
    assert_eq!(err.kind, titan_passes::PassErrorKind::Invalid);
    let err = err.message;
    assert!(
        err.contains("`all_gather {mesh_dim = dp_shard, dim = 0, size = 2}` (node")
            && err.contains("in @layer) has size = 2 but mesh dim dp_shard has 4 ranks; set size = 4"),
        "{err}"
    );
    let mut none = g.clone();
    none.meta.entries.retain(|(k, _)| k != "world_size");
    let err = titan_passes::check_collectives::check_collectives(&mut none).expect_err("no mesh");
    assert_eq!(err.kind, titan_passes::PassErrorKind::Precondition);
    assert!(err.message.contains("needs a device mesh"), "{err}");
    let mut ok = g;
    let stats = titan_passes::check_collectives::check_collectives(&mut ok).expect("consistent");
    assert_eq!(stats.communicators, 1);
}

/// `titanc lower --to train --dp-shard 2` writes the mesh into the graph's meta and runs the
/// SPMD pipeline; the printed graph parses back to the same text.
#[test]
fn spmd_training_graph_round_trips_through_text() {
    let g = spmd_graph(Mesh::new(2, 2, 1)).expect("spmd lowering");
    let text = titan_ir::print::print_graph(&g);
    assert!(text.contains("world_size = 4, mesh_dp_replicate = 2, mesh_dp_shard = 2, mesh_tp = 1"));
    let back = titan_ir::parse::parse_and_verify("spmd.ir", &text).expect("parses");
    assert_eq!(titan_ir::print::print_graph(&back), text);
}
