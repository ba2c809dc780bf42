//! `compute-copies`: the compute-dtype copies of the master weights become state carried across
//! steps, written by the optimizer.
//!
//! After `master-weights` and `adamw`, every step starts with one `cast` per low-precision
//! parameter (reading the fp32 master, writing its bf16 compute copy) and ends with the AdamW
//! update of the master. This pass turns each such cast into a `state` argument
//! (`init = compute_copy`, checkpoint name `<master>.compute`) and appends the cast of the
//! *updated* master as that state's update, so the next step reads the copy the previous step
//! wrote. `fuse` puts the new cast into the optimizer kernel, which then writes the copy from the
//! f32 value it has just computed: the step no longer reads the masters outside the optimizer
//! (4 bytes read and 2 written per parameter per step saved, the optimizer writes the 2 instead).
//!
//! Exact: the copy the step reads is the same cast of the same f32 master as before, computed
//! one step earlier. The runtime writes `cast(master)` into every copy whenever it sets the
//! master (start-up, `--resume`), since checkpoints hold the masters only.
//!
//! A master without an update (no `adamw` ran), an f32 parameter (no cast) and a master read
//! by anything other than its cast and its update keep the graph as it is.
//!
//! A table whose compute copy only `embedding` lookups read, and that has more than 5 rows per
//! looked-up token, gets no copy: each lookup reads the fp32 master and casts the rows it
//! gathered (`embedding(t, cast(W))` becomes `cast(embedding(t, W))`, the same values, since the
//! cast is elementwise). A carried copy of the whole table would be persistent memory (1 GiB for
//! Llama 3's 128256 x 4096) and a full write per step, for the few rows one step reads.

use std::collections::HashMap;

use titan_ir::{ArgKind, COMPUTE_COPY_SUFFIX, Graph, Init, Op, ParamInfo, Update, Value, ValueDef};

use crate::PassDiag;
use crate::util::replace_uses;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ComputeCopiesStats {
    /// Casts at the top of the step turned into carried copies.
    pub copies: usize,
    /// Lookups that now gather fp32 rows and cast them, instead of reading a copy of the table.
    pub lookups_cast: usize,
}

/// Rewrite every `embedding(t, copy)` reading the cast `copy` of a master into
/// `cast(embedding(t, master))`, placed where the lookup was; returns the lookups rewritten (0,
/// nothing changed, if anything other than a lookup's table operand reads `copy`).
fn cast_after_lookups(g: &mut Graph, master: Value, copy: Value) -> Result<usize, PassDiag> {
    let lookups: Vec<titan_ir::NodeId> = g.main.order.iter().copied().filter(|&n| g.main.node(n).inputs.contains(&copy)).collect();
    let only_tables = !lookups.is_empty()
        && lookups.iter().all(|&n| {
            let node = g.main.node(n);
            matches!(node.op, Op::Embedding) && node.inputs[0] != copy && node.inputs[1] == copy
        });
    let read_elsewhere = g.main.outputs.iter().any(|o| o.value == copy) || g.main.updates.iter().any(|u| u.value == copy);
    if !only_tables || read_elsewhere {
        return Ok(0);
    }
    // Per step the rewrite moves 10 more bytes per looked-up element (the lookup writes and the
    // cast reads fp32 rows, 4 + 4, and the lookup reads 2 more per element) and saves the 2 bytes
    // per table element the optimizer would write into the copy: worth it when the table has
    // more than 5 rows per looked-up token (Llama 3: 128256 rows, 8192 tokens per rank and step).
    let rows = g.main.ty(copy).shape.first().and_then(|d| titan_ir::shape::resolve_dim(d, &g.dims));
    let tokens: Option<u64> = lookups.iter().map(|&n| g.main.ty(g.main.node(n).inputs[0]).numel(&g.dims)).sum();
    if !matches!((rows, tokens), (Some(r), Some(t)) if r > 5 * t) {
        return Ok(0);
    }
    for &e in &lookups {
        let (tokens, rows) = (g.main.node(e).inputs[0], g.main.node(e).results[0]);
        let ty = g.main.ty(rows).clone();
        let before = g.main.order.len();
        let mut b = g.main_builder();
        let wide = b.push1(Op::Embedding, &[tokens, master]).map_err(PassDiag::invalid)?;
        let narrow = b.push_typed(Op::Cast, &[wide], ty).map_err(PassDiag::invalid)?;
        replace_uses(&mut g.main, rows, narrow, None);
        g.main.values[narrow.index()].name = g.main.values[rows.index()].name.take();
        // The two new nodes run where the lookup ran; the lookup is left dead for `dce`.
        let added: Vec<titan_ir::NodeId> = g.main.order.drain(before..).collect();
        let at = g.main.order.iter().position(|&n| n == e).expect("the lookup is scheduled") + 1;
        g.main.order.splice(at..at, added);
    }
    Ok(lookups.len())
}

/// Carry the compute copy of every updated master across steps (module documentation).
pub fn compute_copies(g: &mut Graph) -> Result<ComputeCopiesStats, PassDiag> {
    let mut stats = ComputeCopiesStats::default();
    let updates: HashMap<Value, Value> = g.main.updates.iter().map(|u| (u.state, u.value)).collect();
    // Each master's uses: (node, is it a cast).
    let mut readers: HashMap<Value, Vec<(titan_ir::NodeId, bool)>> = HashMap::new();
    for &n in &g.main.order {
        let node = g.main.node(n);
        for &v in &node.inputs {
            readers.entry(v).or_default().push((n, matches!(node.op, Op::Cast)));
        }
    }
    let masters: Vec<(Value, ParamInfo)> = g
        .main
        .args
        .iter()
        .filter_map(|a| match &a.kind {
            ArgKind::State(p) if p.init != Init::ComputeCopy => Some((a.value, p.clone())),
            _ => None,
        })
        .collect();
    let mut new_updates = Vec::new();
    for (master, info) in masters {
        let Some(&updated) = updates.get(&master) else { continue };
        let Some(rs) = readers.get(&master) else { continue };
        // The master's readers: its one cast, and the optimizer that updates it.
        let casts: Vec<titan_ir::NodeId> = rs.iter().filter(|r| r.1).map(|r| r.0).collect();
        let others = rs.iter().filter(|r| !r.1).all(|&(n, _)| matches!(g.main.node(n).op, Op::AdamW(_)));
        let [cast] = casts.as_slice() else { continue };
        if !others {
            continue;
        }
        let from_adamw = match g.main.value(updated).def {
            ValueDef::Result { node, index: 0 } => matches!(g.main.node(node).op, Op::AdamW(_)),
            _ => false,
        };
        if !from_adamw {
            continue;
        }
        let copy_value = g.main.node(*cast).results[0];
        let lookups = cast_after_lookups(g, master, copy_value)?;
        if lookups > 0 {
            stats.lookups_cast += lookups;
            continue;
        }
        let ty = g.main.ty(copy_value).clone();
        // The copy takes the cast's name; the dead cast keeps none.
        let name = g.main.values[copy_value.index()].name.take();
        let placement = g.main.value(master).placement.clone();
        let kind = ArgKind::State(ParamInfo { name: format!("{}{COMPUTE_COPY_SUFFIX}", info.name), init: Init::ComputeCopy });
        let copy = g.main.add_arg(ty.clone(), kind, name.as_deref());
        g.main.values[copy.index()].placement = placement;
        // Every reader of the old cast reads the carried copy; the cast is left dead for `dce`.
        replace_uses(&mut g.main, copy_value, copy, None);
        let next = g.main_builder().push_typed(Op::Cast, &[updated], ty).map_err(PassDiag::invalid)?;
        if let Some(n) = name {
            g.main.values[next.index()].name = Some(format!("{n}.next"));
        }
        new_updates.push(Update { state: copy, value: next });
        stats.copies += 1;
    }
    g.main.updates.extend(new_updates);
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bf16 weight and an f32 one, with the gradient map `autodiff` would leave.
    const MODEL: &str = r#"
graph @g {
  meta {gradients = [grad(1, "d_w"), grad(2, "d_v")]}
  func @main {
    input %x : bf16[2, 4]
    param %w : bf16[4, 4] {name = "w", init = normal(0.02)}
    param %v : f32[4] {name = "v", init = ones}
    %y = linear(%x, %w) : bf16[2, 4]
    %s = cast(%y) : f32[2, 4]
    %gw = cast(%w) : f32[4, 4]
    %loss = reduce_sum(%s) {axes = [0, 1]} : f32[]
    output loss = %loss
    output d_w = %gw
    output d_v = %v
  }
}
"#;

    fn lowered(passes: &[&str]) -> Graph {
        let (mut g, _) = titan_ir::parse(MODEL).expect("parse");
        let passes = crate::pipeline::lookup_passes(passes).expect("passes");
        crate::pipeline::run_pipeline(&mut g, &passes, &crate::TrainOptions::default(), &crate::pipeline::PipelineOptions::default()).expect("pipeline");
        g
    }

    #[test]
    fn the_bf16_copy_becomes_state_updated_by_the_cast_of_the_new_master() {
        let mut g = lowered(&["master-weights", "adamw"]);
        let stats = compute_copies(&mut g).expect("compute-copies");
        assert_eq!(stats.copies, 1, "only the bf16 weight has a copy");
        let copy = g.main.args.iter().find(|a| a.kind.param_info().is_some_and(|p| p.init == Init::ComputeCopy)).expect("a copy state");
        let info = copy.kind.param_info().expect("state");
        assert_eq!(info.name, "w.compute");
        assert_eq!(info.compute_copy_of(), Some("w"));
        assert_eq!(g.main.ty(copy.value).dtype, titan_ir::DType::BF16);
        let u = g.main.updates.iter().find(|u| u.state == copy.value).expect("the copy is updated");
        let ValueDef::Result { node, .. } = g.main.value(u.value).def else { panic!("the update is computed") };
        assert!(matches!(g.main.node(node).op, Op::Cast));
        let master_update = g.main.node(node).inputs[0];
        assert!(g.main.updates.iter().any(|m| m.value == master_update), "the cast reads the updated master");
        // The linear reads the copy, and nothing but the optimizer reads the master.
        let text = titan_ir::print::print_graph(&g);
        assert!(text.contains("linear(%x, %w.bf16"), "{text}");
    }

    /// An embedding table (bf16 compute) read by one lookup, and a bf16 weight.
    const LOOKUP: &str = r#"
graph @g {
  meta {gradients = [grad(1, "d_e")]}
  func @main {
    input %t : i32[2, 3]
    param %e : bf16[64, 4] {name = "e", init = normal(1.0)}
    %x = embedding(%t, %e) : bf16[2, 3, 4]
    %s = cast(%x) : f32[2, 3, 4]
    %loss = reduce_sum(%s) {axes = [0, 1, 2]} : f32[]
    %g16 = scatter_add(%t, %x) : bf16[64, 4]
    %ge = cast(%g16) : f32[64, 4]
    output loss = %loss
    output d_e = %ge
  }
}
"#;

    #[test]
    fn a_table_only_lookups_read_gets_no_copy_and_casts_the_rows() {
        let (mut g, _) = titan_ir::parse(LOOKUP).expect("parse");
        let passes = crate::pipeline::lookup_passes(&["master-weights", "adamw"]).expect("passes");
        crate::pipeline::run_pipeline(&mut g, &passes, &crate::TrainOptions::default(), &crate::pipeline::PipelineOptions::default()).expect("pipeline");
        let stats = compute_copies(&mut g).expect("compute-copies");
        assert_eq!((stats.copies, stats.lookups_cast), (0, 1));
        assert!(titan_ir::verify::verify(&g).is_empty(), "{g}");
        assert!(!g.main.args.iter().any(|a| a.kind.param_info().is_some_and(|p| p.init == Init::ComputeCopy)), "no copy state");
        // The lookup reads the fp32 master and its rows are cast right after it, before the sum.
        let ops: Vec<&str> = g.main.order.iter().map(|&n| g.main.node(n).op.name()).collect();
        let e = ops.iter().rposition(|&o| o == "embedding").expect("lookup");
        let lookup = g.main.node(g.main.order[e]);
        assert_eq!(g.main.ty(lookup.inputs[1]).dtype, titan_ir::DType::F32);
        let rows = g.main.node(g.main.order[e + 1]);
        assert!(matches!(rows.op, Op::Cast) && rows.inputs == lookup.results, "{ops:?}");
        assert_eq!(g.main.ty(rows.results[0]).dtype, titan_ir::DType::BF16);
        assert!(ops.iter().position(|&o| o == "reduce_sum").expect("sum") > e + 1, "{ops:?}");
    }

    /// A table with fewer than 5 rows per looked-up token keeps its carried copy: the fp32 rows
    /// would move more bytes than the copy's update saves.
    #[test]
    fn a_small_table_keeps_its_copy() {
        let (mut g, _) = titan_ir::parse(&LOOKUP.replace("64, 4", "24, 4")).expect("parse");
        let passes = crate::pipeline::lookup_passes(&["master-weights", "adamw"]).expect("passes");
        crate::pipeline::run_pipeline(&mut g, &passes, &crate::TrainOptions::default(), &crate::pipeline::PipelineOptions::default()).expect("pipeline");
        let stats = compute_copies(&mut g).expect("compute-copies");
        assert_eq!((stats.copies, stats.lookups_cast), (1, 0));
    }

    #[test]
    fn without_the_optimizer_nothing_changes() {
        let mut g = lowered(&["master-weights"]);
        let before = titan_ir::print::print_graph(&g);
        assert_eq!(compute_copies(&mut g).expect("pass").copies, 0);
        assert_eq!(titan_ir::print::print_graph(&g), before);
    }
}
