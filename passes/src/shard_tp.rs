//! `shard-tp`: tensor and sequence parallelism of a Llama MODEL graph over the mesh dim `tp`
//! (Megatron / TorchTitan plan), run before `shard-dp` and the training
//! lowering so autodiff derives the backward collectives:
//!
//! - `wq`, `wk`, `wv`, `w1`, `w3` are column-parallel (`Shard` on their output dim): each rank
//!   computes its heads / its slice of the hidden units from the replicated activations;
//! - `wo`, `w2` are row-parallel (`Shard` on their input dim): their products are partial
//!   sums, reduce-scattered over `tp` along the sequence;
//! - sequence parallelism: between those, activations hold this rank's slice of `seq`; norms
//!   and residual adds run on the slice, and the input of every column-parallel linear is
//!   all-gathered along `seq` first (their VJPs swap: reduce-scatter of the partial input
//!   cotangent, all-gather of the output cotangent);
//! - `tok_embeddings` is vocab-parallel (TorchTitan's `RowwiseParallel` embedding with
//!   `output_layouts = Shard(1)`): rank `r` holds rows `r V/tp ..` and looks up the whole
//!   `tokens` input in them (`gather_shard`: tokens of other ranks' rows give zero rows), and
//!   the partial embeddings are reduce-scattered over `tp` along `seq`, which starts the
//!   sequence parallelism (see [`vocab_parallel_embedding`]). Its gradient (`scatter_add_shard`
//!   of the all-gathered output cotangent into the rank's rows) needs no `tp` all-reduce;
//! - `output` is vocab-parallel and so is the loss (TorchTitan's `loss_parallel`): each rank
//!   keeps its vocabulary shard of the logits and the cross-entropy exchanges per-token
//!   statistics only (`loss_parallel`); a reader of the logits other than `cross_entropy`
//!   gets them all-gathered over the vocabulary;
//! - norms stay replicated: `sync-grads` all-reduces their gradients over `tp`.
//!
//! The reshapes of the block that split heads follow: their head dim (or last dim) shrinks by
//! the factor their operand shrank. Parameters are recognized by their checkpoint names.
//!
//! **kv-head replication** (`tp > n_kv_heads`, Megatron / TorchTitan): when `tp` is a multiple
//! of `n_kv_heads` (from the graph's `meta`), rank `r` owns query heads
//! `r * n_heads / tp ..` and they all use kv head `r / rep`, `rep = tp / n_kv_heads`. Each rank
//! then needs one whole kv head, shared with the `rep - 1` other ranks of its group. The design:
//! `wk`/`wv` stay **replicated** on `tp` (full type, placement `Replicate`) and each layer
//! slices its kv head locally, in front of the column-parallel linear:
//!
//! ```text
//! reshape [n_kv * hd, in] -> [n_kv, hd, in]; broadcast -> [n_kv, rep, hd, in];
//! reshape -> [tp * hd, in]; take_shard {mesh_dim = tp, dim = 0, size = tp} -> [hd, in]
//! ```
//!
//! (slice `r` of the head-repeated weight is kv head `r / rep`). The gradient then needs no
//! new collective and no subgroup communicator: the VJP of `take_shard` is `place_shard` (the
//! rank's `dW` at its slot, zeros elsewhere), the broadcast's VJP sums the `rep` slots, and
//! because the parameter is replicated on `tp`, `sync-grads` all-reduces its gradient over
//! `tp`, which adds the contributions of exactly the ranks that share each kv head (the others
//! contribute zeros, which add exactly). So every rank holds the same full `wk`/`wv`, equal to
//! the single-rank parameter, and AdamW updates it identically everywhere (the gradient norm
//! counts a gradient replicated on `tp` once). The price: the
//! all-reduce moves all kv heads over all of `tp` (`n_kv_heads` times the bytes of a per-group
//! all-reduce of one head) and every rank keeps the full `wk`/`wv` and their AdamW moments.
//! The alternative, a `Shard`-like placement whose shards repeat across a group plus a
//! subgroup all-reduce, would need a new placement kind in the runtime's init/gather and a
//! communicator per kv group.

use crate::PassDiag;
use titan_ir::infer::{InferCtx, infer_types};
use titan_ir::verify::{Loc, RegionRef};
use titan_ir::{ArgKind, CollectiveReduce, DType, Dim, DimTable, Graph, Mesh, MeshDim, NodeId, Op, Placement, Region, TensorType, Value, ValueDef};

use crate::util::replace_uses;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardTpStats {
    pub column_parallel: usize,
    pub row_parallel: usize,
    /// `wk`/`wv` replicated on `tp` and sliced per kv head (`tp > n_kv_heads`).
    pub kv_replicated: usize,
    /// Embedding tables sharded by vocabulary rows.
    pub vocab_parallel: usize,
    pub collectives: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    Column,
    Row,
    Replicate,
    /// `wk`/`wv` when `tp` is a multiple of `n_kv_heads`: replicated, each rank slices the kv
    /// head its query heads use.
    KvReplicate,
    /// `tok_embeddings`: sharded by vocabulary rows (`Shard(0)`); an output head tied to it is
    /// vocab-parallel like `output`.
    Vocab,
}

const KV: [&str; 2] = [".attention.wk.weight", ".attention.wv.weight"];

/// How `tp` splits the kv heads: `None` when each rank holds `n_kv_heads / tp` whole heads
/// (or the model's `meta` does not say), `Some((n_kv_heads, rep))` when each kv head is
/// replicated on `rep = tp / n_kv_heads` ranks; an error when `tp` is neither.
fn kv_replication(g: &Graph, tp: u32) -> Result<Option<(u64, u64)>, String> {
    let Some(n_kv) = g.meta_i64("n_kv_heads").filter(|&v| v > 0).map(|v| v as u64) else { return Ok(None) };
    let tp = u64::from(tp);
    if n_kv.is_multiple_of(tp) {
        return Ok(None);
    }
    if tp.is_multiple_of(n_kv) {
        return Ok(Some((n_kv, tp / n_kv)));
    }
    let n_heads = g.meta_i64("n_heads").filter(|&v| v > 0).map_or(n_kv, |v| v as u64);
    let ok: Vec<String> =
        (1..=n_heads).filter(|t| n_heads.is_multiple_of(*t) && (n_kv.is_multiple_of(*t) || t.is_multiple_of(n_kv))).map(|t| t.to_string()).collect();
    Err(format!(
        "tp = {tp} neither divides n_kv_heads = {n_kv} nor is a multiple of it: each rank needs whole kv heads (tp divides n_kv_heads) or one kv head shared by tp / n_kv_heads ranks (n_kv_heads divides tp); choose tp in {{{}}}",
        ok.join(", ")
    ))
}

const COLUMN: [&str; 6] =
    [".attention.wq.weight", ".attention.wk.weight", ".attention.wv.weight", ".feed_forward.w1.weight", ".feed_forward.w3.weight", "output.weight"];
const ROW: [&str; 2] = [".attention.wo.weight", ".feed_forward.w2.weight"];
const VOCAB: &str = "tok_embeddings.weight";

fn plan_of(name: &str) -> Plan {
    if name == VOCAB {
        Plan::Vocab
    } else if COLUMN.iter().any(|s| name.ends_with(s)) {
        Plan::Column
    } else if ROW.iter().any(|s| name.ends_with(s)) {
        Plan::Row
    } else {
        Plan::Replicate
    }
}

/// `placement` with mesh dim `m` set to `p` (an empty list is all `Replicate`).
pub(crate) fn with_placement(placement: &[Placement], m: MeshDim, p: Placement) -> Vec<Placement> {
    let mut v: Vec<Placement> = if placement.len() == 3 { placement.to_vec() } else { vec![Placement::Replicate; 3] };
    v[m.index()] = p;
    v
}

fn shrink(ty: &TensorType, d: usize, n: u32, dims: &DimTable, what: &str) -> Result<TensorType, String> {
    let size = titan_ir::shape::resolve_dim(&ty.shape[d], dims).ok_or_else(|| format!("{what}: dim {d} of {ty} is not bound"))?;
    if !size.is_multiple_of(u64::from(n)) {
        return Err(format!("{what}: dim {d} of {ty} is not divisible by tp = {n}; choose a tp that divides it"));
    }
    let mut t = ty.clone();
    t.shape[d] = Dim::Fixed(size / u64::from(n));
    Ok(t)
}

pub fn shard_tp(g: &mut Graph) -> Result<ShardTpStats, PassDiag> {
    let mut stats = ShardTpStats::default();
    let Some(mesh) = Mesh::from_graph(g)? else { return Err(crate::error::no_mesh()) };
    let n = mesh.size(MeshDim::Tp);
    if n == 1 {
        return Ok(stats);
    }
    let kv = kv_replication(g, n)?;
    // Parameters: local types and placements.
    let mut plans: Vec<(Value, Plan, usize)> = Vec::new();
    for i in 0..g.main.args.len() {
        let ArgKind::Param(info) = g.main.args[i].kind.clone() else { continue };
        let v = g.main.args[i].value;
        let plan = if kv.is_some() && KV.iter().any(|s| info.name.ends_with(s)) { Plan::KvReplicate } else { plan_of(&info.name) };
        let ty = g.main.ty(v).clone();
        let first = usize::from(info.is_stacked());
        if ty.rank() != first + 2 && plan != Plan::Replicate {
            return Err(PassDiag::invalid(format!(
                "tensor-parallel parameter `{}` must be a {}matrix, found {ty}",
                info.name,
                if first == 1 { "stacked " } else { "" }
            ))
            .at(Loc::Arg(RegionRef::Main, i)));
        }
        let d = match plan {
            Plan::Column | Plan::KvReplicate | Plan::Vocab => first,
            Plan::Row => first + 1,
            Plan::Replicate => 0,
        };
        let placement = g.main.value(v).placement.clone();
        if matches!(plan, Plan::Replicate | Plan::KvReplicate) {
            g.main.values[v.index()].placement = with_placement(&placement, MeshDim::Tp, Placement::Replicate);
            if plan == Plan::KvReplicate {
                stats.kv_replicated += 1;
                plans.push((v, plan, d));
            }
            continue;
        }
        g.main.values[v.index()].ty = shrink(&ty, d, n, &g.dims, &format!("parameter `{}`", info.name))?;
        g.main.values[v.index()].placement = with_placement(&placement, MeshDim::Tp, Placement::Shard(d as u32));
        match plan {
            Plan::Column => stats.column_parallel += 1,
            Plan::Vocab => stats.vocab_parallel += 1,
            _ => stats.row_parallel += 1,
        }
        plans.push((v, plan, d));
    }
    // Vocabulary-parallel outputs: `output`, or the embedding table an output head is tied to.
    let vocab_sharded = |p: Plan| matches!(p, Plan::Column | Plan::Vocab);
    // Blocks: the arguments the sharded parameters feed, then an all_reduce after each
    // row-parallel product.
    let order = g.main.order.clone();
    for nid in &order {
        let node = g.main.node(*nid).clone();
        let Op::Repeat { block, carry, stacked, .. } = node.op else { continue };
        let mut region = g.blocks[block.index()].clone();
        let (mut rows, mut cols) = (Vec::new(), Vec::new());
        for (j, x) in node.inputs.iter().enumerate() {
            let Some(&(_, plan, d)) = plans.iter().find(|(v, _, _)| v == x) else { continue };
            let per_layer = j >= carry as usize && j < (carry + stacked) as usize;
            let bd = if per_layer { d - 1 } else { d };
            let arg = region.args[j].value;
            if plan == Plan::KvReplicate {
                let (n_kv, rep) = kv.ok_or("invariant: kv-head replication has a layout")?;
                cols.push(slice_kv_head(&mut region, arg, n_kv, rep, n, &g.dims)?);
                continue;
            }
            let ty = region.ty(arg).clone();
            region.values[arg.index()].ty = shrink(&ty, bd, n, &g.dims, &format!("argument {j} of @{}", region.name))?;
            let placement = region.value(arg).placement.clone();
            region.values[arg.index()].placement = with_placement(&placement, MeshDim::Tp, Placement::Shard(bd as u32));
            match plan {
                Plan::Row => rows.push(arg),
                _ => cols.push(arg),
            }
        }
        // Sequence parallelism: the carried activations hold this rank's slice of `seq`.
        for j in 0..carry as usize {
            let arg = region.args[j].value;
            let ty = region.ty(arg).clone();
            if ty.rank() != 3 {
                return Err(PassDiag::invalid(format!("sequence parallelism of @{}: carried value {j} must be [batch, seq, dim], found {ty}", region.name))
                    .at(Loc::Arg(RegionRef::Block(block), j)));
            }
            region.values[arg.index()].ty = shrink(&ty, 1, n, &g.dims, &format!("sequence of @{}", region.name))?;
            let placement = region.value(arg).placement.clone();
            region.values[arg.index()].placement = with_placement(&placement, MeshDim::Tp, Placement::Shard(1));
        }
        let linears: Vec<(usize, Value)> = region
            .order
            .iter()
            .enumerate()
            .filter_map(|(pos, &m)| {
                let nd = region.node(m);
                (matches!(nd.op, Op::Linear) && rows.contains(&nd.inputs[1])).then(|| (pos, nd.results[0]))
            })
            .collect();
        for (k, (pos, r)) in linears.into_iter().enumerate() {
            let ty = region.ty(r).clone();
            let rs = Op::ReduceScatter { mesh_dim: MeshDim::Tp, dim: 1, size: n, reduce: CollectiveReduce::Sum };
            let ar = region.add_node(rs, vec![r], vec![ty]);
            region.order.pop();
            region.order.insert(pos + 1 + k, ar);
            let out = region.node(ar).results[0];
            replace_uses(&mut region, r, out, Some(ar));
            stats.collectives += 1;
        }
        stats.collectives += gather_sequence(&mut region, &cols, n);
        reinfer(&mut region, &g.dims, &g.blocks, n)?;
        g.blocks[block.index()] = region;
    }
    // Main: the vocab-parallel logits feed a vocabulary-parallel cross-entropy (loss
    // parallelism); any other reader gets them all-gathered over the vocabulary.
    let outs: Vec<Value> = g
        .main
        .order
        .iter()
        .filter_map(|&m| {
            let nd = g.main.node(m);
            (matches!(nd.op, Op::Linear) && plans.iter().any(|(v, p, _)| *v == nd.inputs[1] && vocab_sharded(*p))).then_some(nd.results[0])
        })
        .collect();
    let loss_parallel_enabled = g.meta_i64(LOSS_PARALLEL_META) != Some(0);
    for r in outs {
        let losses: Vec<NodeId> =
            g.main.order.iter().copied().filter(|&m| matches!(g.main.node(m).op, Op::CrossEntropy) && g.main.node(m).inputs[0] == r).collect();
        let other_readers =
            g.main.order.iter().any(|&m| !losses.contains(&m) && g.main.node(m).inputs.contains(&r)) || g.main.outputs.iter().any(|o| o.value == r);
        if other_readers || !loss_parallel_enabled {
            let pos = g.main.order.iter().position(|&m| g.main.node(m).results.contains(&r)).ok_or("invariant: the output head's linear is in the order")?;
            let ty = g.main.ty(r).clone();
            let last = ty.rank() - 1;
            let ag = g.main.add_node(Op::AllGather { mesh_dim: MeshDim::Tp, dim: last as u32, size: n }, vec![r], vec![ty]);
            g.main.order.pop();
            g.main.order.insert(pos + 1, ag);
            let out = g.main.node(ag).results[0];
            replace_uses(&mut g.main, r, out, Some(ag));
            // The vocab-parallel losses keep reading the shard.
            if loss_parallel_enabled {
                for &ce in &losses {
                    g.main.nodes[ce.index()].inputs[0] = r;
                }
            }
            stats.collectives += 1;
        }
        if loss_parallel_enabled {
            for ce in losses {
                stats.collectives += loss_parallel(&mut g.main, ce, n)?;
            }
        }
    }
    let out_weights: Vec<Value> = plans.iter().filter(|(_, p, _)| vocab_sharded(*p)).map(|(v, _, _)| *v).collect();
    stats.collectives += gather_sequence(&mut g.main, &out_weights, n);
    // The vocab-parallel embedding reads the whole `tokens` (replicated on `tp`) and
    // reduce-scatters its partial rows along `seq`.
    let tables: Vec<Value> = plans.iter().filter(|(_, p, _)| *p == Plan::Vocab).map(|(v, _, _)| *v).collect();
    let lookups: Vec<NodeId> =
        g.main.order.iter().copied().filter(|&m| matches!(g.main.node(m).op, Op::Embedding) && tables.contains(&g.main.node(m).inputs[1])).collect();
    for emb in lookups {
        stats.collectives += vocab_parallel_embedding(&mut g.main, emb, n, &g.dims)?;
    }
    let blocks = g.blocks.clone();
    reinfer(&mut g.main, &g.dims, &blocks, n)?;
    Ok(stats)
}

/// The meta key that turns loss parallelism off (`0`; TorchTitan's `disable_loss_parallel`):
/// the logits are then all-gathered and the cross-entropy computed whole on every tp rank.
pub const LOSS_PARALLEL_META: &str = "loss_parallel";

/// Record in `g`'s meta that `shard-tp` must not make the loss vocab-parallel.
pub fn disable_loss_parallel(g: &mut Graph) {
    g.meta.entries.retain(|(k, _)| k != LOSS_PARALLEL_META);
    g.meta.entries.push((LOSS_PARALLEL_META.into(), titan_ir::AttrValue::Int(0)));
}

/// Loss parallelism (Megatron's vocab-parallel cross-entropy, TorchTitan's `loss_parallel`):
/// rewrite `cross_entropy(logits, targets)` node `ce`, whose logits are this rank's vocabulary
/// shard `[..., V / n]`, into
///
/// ```text
/// %shard = place_shard(constant 1 : f32[1]) {mesh_dim = tp, dim = 0, size = n}   // one-hot of the rank's shard
/// %max, %sumexp, %target = cross_entropy_stats(%logits, %targets, %shard)      // f32[..., 1] each
/// %X.tp = all_gather(%X) {mesh_dim = tp, dim = last, size = n}                 // f32[..., n], X = each statistic
/// %loss = cross_entropy_combine(%max.tp, %sumexp.tp, %target.tp)               // f32[], the same on every tp rank
/// ```
///
/// Only per-token statistics cross the mesh (3 `f32[..., n]` gathers instead of the logits);
/// the backward (the VJPs: `reduce_scatter` of the statistics' cotangents, then
/// `cross_entropy_stats_bwd`) is `(softmax - onehot) dloss / N` on the shard, with the global
/// log-sum-exp. Returns the number of collectives added.
fn loss_parallel(main: &mut Region, ce: NodeId, n: u32) -> Result<usize, String> {
    let (logits, targets) = (main.node(ce).inputs[0], main.node(ce).inputs[1]);
    let tt = main.ty(targets).clone();
    let stat = |last: u64| {
        let mut shape = tt.shape.clone();
        shape.push(Dim::Fixed(last));
        TensorType::new(DType::F32, shape)
    };
    let mut pos = main.order.iter().position(|&m| m == ce).ok_or("invariant: the cross_entropy is in the order")?;
    let mut insert = |main: &mut Region, op: Op, inputs: Vec<Value>, types: Vec<TensorType>| -> Vec<Value> {
        let node = main.add_node(op, inputs, types);
        main.order.pop();
        main.order.insert(pos, node);
        pos += 1;
        main.node(node).results.clone()
    };
    let one = insert(main, Op::Constant { value: 1.0 }, vec![], vec![TensorType::new(DType::F32, vec![Dim::Fixed(1)])])[0];
    let shard =
        insert(main, Op::PlaceShard { mesh_dim: MeshDim::Tp, dim: 0, size: n }, vec![one], vec![TensorType::new(DType::F32, vec![Dim::Fixed(u64::from(n))])])
            [0];
    let local = insert(main, Op::CrossEntropyStats, vec![logits, targets, shard], vec![stat(1); 3]);
    let base = main.value(logits).name.clone().unwrap_or_else(|| "logits".into());
    main.values[shard.index()].name = Some(format!("{base}.vocab_shard"));
    let mut gathered = Vec::with_capacity(3);
    for (x, what) in local.into_iter().zip(["max", "sumexp", "target"]) {
        main.values[x.index()].name = Some(format!("{base}.{what}"));
        let ag = Op::AllGather { mesh_dim: MeshDim::Tp, dim: tt.rank() as u32, size: n };
        let all = insert(main, ag, vec![x], vec![stat(u64::from(n))])[0];
        main.values[all.index()].name = Some(format!("{base}.{what}.tp"));
        gathered.push(all);
    }
    let node = &mut main.nodes[ce.index()];
    node.op = Op::CrossEntropyCombine;
    node.inputs = gathered;
    Ok(3)
}

/// The vocabulary-parallel embedding (TorchTitan's `RowwiseParallel` for `tok_embeddings`):
/// rewrite `embedding(tokens, table)` node `emb`, whose table is this rank's row shard
/// `[V / n, dim]`, into
///
/// ```text
/// %shard = place_shard(constant 1 : f32[1]) {mesh_dim = tp, dim = 0, size = n}   // one-hot of the rank's rows
/// %x.partial = gather_shard(%table, %tokens, %shard)                            // [batch, seq, dim], zero rows for other ranks' tokens
/// %x = reduce_scatter(%x.partial) {mesh_dim = tp, dim = 1, size = n, reduce = sum}  // [batch, seq / n, dim]
/// ```
///
/// Every token's row is nonzero on exactly one rank, so the sum is exact (any dtype) and `%x`
/// is the sequence shard of the single-rank embedding. Autodiff derives the backward: the
/// reduce-scatter's VJP all-gathers the cotangent along `seq`, `gather_shard`'s
/// (`scatter_add_shard`) sums it into the rank's rows only, in token order like `scatter_add`.
/// Returns the number of collectives added.
fn vocab_parallel_embedding(main: &mut Region, emb: NodeId, n: u32, dims: &DimTable) -> Result<usize, String> {
    let (tokens, table) = (main.node(emb).inputs[0], main.node(emb).inputs[1]);
    let x = main.node(emb).results[0];
    let pos = main.order.iter().position(|&m| m == emb).ok_or("invariant: the embedding is in the order")?;
    let one = main.add_node(Op::Constant { value: 1.0 }, vec![], vec![TensorType::new(DType::F32, vec![Dim::Fixed(1)])]);
    let one_v = main.node(one).results[0];
    let shard = main.add_node(
        Op::PlaceShard { mesh_dim: MeshDim::Tp, dim: 0, size: n },
        vec![one_v],
        vec![TensorType::new(DType::F32, vec![Dim::Fixed(u64::from(n))])],
    );
    let shard_v = main.node(shard).results[0];
    let ty = main.ty(x).clone();
    if ty.rank() != 3 {
        return Err(format!("the vocab-parallel embedding must give [batch, seq, dim], found {ty}"));
    }
    let rs = Op::ReduceScatter { mesh_dim: MeshDim::Tp, dim: 1, size: n, reduce: CollectiveReduce::Sum };
    let scattered = main.add_node(rs, vec![x], vec![shrink(&ty, 1, n, dims, "the embedding's sequence")?]);
    let out = main.node(scattered).results[0];
    main.order.truncate(main.order.len() - 3);
    main.order.splice(pos..pos, [one, shard]);
    main.order.insert(pos + 3, scattered);
    replace_uses(main, x, out, Some(scattered));
    let node = &mut main.nodes[emb.index()];
    node.op = Op::GatherShard;
    node.inputs = vec![table, tokens, shard_v];
    let base = main.value(table).name.clone().unwrap_or_else(|| "tok_embeddings".into());
    main.values[shard_v.index()].name = Some(format!("{base}.vocab_shard"));
    let name = main.value(x).name.clone().unwrap_or_else(|| "x".into());
    main.values[out.index()].name = Some(name.clone());
    main.values[x.index()].name = Some(format!("{name}.partial"));
    let placement = main.value(x).placement.clone();
    main.values[out.index()].placement = with_placement(&placement, MeshDim::Tp, Placement::Shard(1));
    main.values[x.index()].placement = with_placement(&placement, MeshDim::Tp, Placement::Partial);
    Ok(1)
}

/// kv-head replication: slice this rank's kv head out of the replicated block argument `w`
/// (`[n_kv * hd, in]`, see the module doc) right before its first use; every use of `w` reads
/// the slice instead. Returns the slice.
fn slice_kv_head(region: &mut Region, w: Value, n_kv: u64, rep: u64, tp: u32, dims: &DimTable) -> Result<Value, String> {
    let ty = region.ty(w).clone();
    let what = format!("kv-head replication in @{}", region.name);
    if ty.rank() != 2 {
        return Err(format!("{what}: a kv projection must be a matrix, found {ty}"));
    }
    let shape = crate::util::fixed_dims(&ty, dims)?;
    if !shape[0].is_multiple_of(n_kv) {
        return Err(format!("{what}: dim 0 of {ty} is not divisible by n_kv_heads = {n_kv}"));
    }
    let (hd, inner) = (shape[0] / n_kv, shape[1]);
    let fixed = |s: &[u64]| TensorType::new(ty.dtype, s.iter().map(|&x| Dim::Fixed(x)).collect());
    let steps = [
        (Op::Reshape, fixed(&[n_kv, hd, inner])),
        (Op::Broadcast { dims: vec![0, 2, 3] }, fixed(&[n_kv, rep, hd, inner])),
        (Op::Reshape, fixed(&[n_kv * rep * hd, inner])),
        (Op::TakeShard { mesh_dim: MeshDim::Tp, dim: 0, size: tp }, fixed(&[hd, inner])),
    ];
    let name = region.value(w).name.clone();
    let at = region.order.iter().position(|&m| region.node(m).inputs.contains(&w)).unwrap_or(0);
    let mut x = w;
    let mut first = None;
    for (k, (op, out)) in steps.into_iter().enumerate() {
        let node = region.add_node(op, vec![x], vec![out]);
        region.order.pop();
        region.order.insert(at + k, node);
        first.get_or_insert(node);
        x = region.node(node).results[0];
        let suffix = match k {
            2 => "repeated",
            3 => "kv_head",
            _ => continue,
        };
        if let Some(name) = &name {
            region.values[x.index()].name = Some(format!("{name}.{suffix}"));
        }
    }
    let placement = region.value(w).placement.clone();
    region.values[x.index()].placement = with_placement(&placement, MeshDim::Tp, Placement::Shard(0));
    replace_uses(region, w, x, first);
    Ok(x)
}

/// Sequence parallelism: all-gather (over `tp`, along `seq`) the input of every linear whose
/// weight is one of `weights` (column-parallel), once per input, right after it is defined;
/// only those linears read the gathered copy. Returns the number of gathers.
fn gather_sequence(region: &mut Region, weights: &[Value], n: u32) -> usize {
    let is_col = |nd: &titan_ir::Node| matches!(nd.op, Op::Linear) && weights.contains(&nd.inputs[1]);
    let mut xs: Vec<Value> = Vec::new();
    for &nid in &region.order {
        let nd = region.node(nid);
        if is_col(nd) && !xs.contains(&nd.inputs[0]) {
            xs.push(nd.inputs[0]);
        }
    }
    for &x in &xs {
        let ty = region.ty(x).clone();
        let node = region.add_node(Op::AllGather { mesh_dim: MeshDim::Tp, dim: 1, size: n }, vec![x], vec![ty]);
        region.order.pop();
        let pos = match region.value(x).def {
            ValueDef::Arg(_) => 0,
            ValueDef::Result { node: d, .. } => region.order.iter().position(|&m| m == d).map_or(0, |p| p + 1),
        };
        region.order.insert(pos, node);
        let gathered = region.node(node).results[0];
        let placement = region.value(x).placement.clone();
        region.values[gathered.index()].placement = with_placement(&placement, MeshDim::Tp, Placement::Replicate);
        if let Some(name) = region.value(x).name.clone() {
            region.values[gathered.index()].name = Some(format!("{name}.seq"));
        }
        for (i, nd) in region.nodes.iter_mut().enumerate() {
            if i != node.index() && is_col(nd) && nd.inputs[0] == x {
                nd.inputs[0] = gathered;
            }
        }
    }
    xs.len()
}

/// Recompute every result type of `region` after its arguments shrank; a `reshape` that
/// splits (or merges) heads shrinks its head dim (rank 4) or its last dim by the factor its
/// operand shrank (`tp`, or `n_kv_heads` for the kv heads under kv-head replication).
fn reinfer(region: &mut Region, dims: &DimTable, blocks: &[Region], tp: u32) -> Result<(), String> {
    let ctx = InferCtx { dims, blocks };
    for nid in region.order.clone() {
        let node = region.node(nid).clone();
        let ins: Vec<TensorType> = node.inputs.iter().map(|&v| region.ty(v).clone()).collect();
        let refs: Vec<&TensorType> = ins.iter().collect();
        let mut declared: Vec<TensorType> = node.results.iter().map(|&v| region.ty(v).clone()).collect();
        if matches!(node.op, Op::Reshape) {
            let (have, want) = (ins[0].numel(dims), declared[0].numel(dims));
            if have != want {
                let out = &declared[0];
                let d = if out.rank() == 4 { 2 } else { out.rank().saturating_sub(1) };
                let what = format!("reshape in @{}", region.name);
                let factor = match (have, want) {
                    (Some(h), Some(w)) if h > 0 && w % h == 0 && u32::try_from(w / h).is_ok() => (w / h) as u32,
                    _ => return Err(format!("{what}: its operand {} does not split {out} over tp = {tp}", ins[0])),
                };
                declared[0] = shrink(out, d, factor, dims, &what)?;
            }
        }
        let types = if node.op.result_type_declared() { infer_types(&node.op, &refs, Some(&declared), &ctx) } else { infer_types(&node.op, &refs, None, &ctx) }
            .map_err(|e| format!("tensor parallelism of @{}: {e}", region.name))?;
        for (&r, t) in node.results.iter().zip(types) {
            region.values[r.index()].ty = t;
        }
    }
    Ok(())
}
