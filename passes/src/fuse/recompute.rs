//! Recomputation (rule 10 of the [module documentation](super)): a cheap pointwise node whose
//! result kernels other than its own read is computed again inside each of them, from its
//! already-materialized operands, instead of being written out once and read back. The
//! motivating case is the fp32 cast of each bf16 gradient: the grad-norm kernel and the
//! optimizer both read it, so without this rule the grad-norm kernel writes a full fp32 copy of
//! every gradient for the optimizer (about 30 GiB of the 8B preset's peak).
//!
//! The rewrite is exact by construction: a clone is the same op on the same operands, and every
//! backend computes an op the same way wherever it runs (the interpreter rounds each result to
//! its dtype, as the generated kernels do).

use std::collections::HashSet;

use titan_ir::{BinaryOp, DimTable, KernelKind, Node, NodeId, Op, Region, UnaryOp, Value, ValueDef};

use super::group::{Grouping, group_region_with, is_scalar_constant};
use crate::PassDiag;

/// A region after recomputation, with its grouping.
pub struct Recomputed {
    /// The rewritten region (`None`: nothing was recomputed; group the original).
    pub region: Option<Region>,
    pub grouping: Grouping,
    /// Clones placed in consumer kernels.
    pub clones: usize,
}

/// Whether `node` is cheap enough to compute again in every kernel that reads it, and reading
/// its operand is no more bytes than reading its result: a cast to a dtype at least as wide,
/// an arithmetic op of one tensor with scalars (e.g. the clip multiply `g * clip_coef`) whose
/// result has the tensor's dtype, or an exact sign op (`abs`, `neg`) keeping the dtype (float8
/// takes the absolute value of a weight for its row amax in one kernel and its column amax in
/// another).
fn cheap(region: &Region, node: &Node) -> bool {
    let [r] = node.results.as_slice() else { return false };
    let out = region.ty(*r);
    if out.rank() == 0 {
        return false;
    }
    let tensors: Vec<Value> = node.inputs.iter().copied().filter(|&v| region.ty(v).rank() > 0).collect();
    let [x] = tensors.as_slice() else { return false };
    let x = region.ty(*x);
    match node.op {
        Op::Cast => x.shape == out.shape && out.dtype.size_bytes() >= x.dtype.size_bytes(),
        Op::Binary(BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Div | BinaryOp::Max | BinaryOp::Min) | Op::Unary(UnaryOp::Abs | UnaryOp::Neg) => {
            x.shape == out.shape && x.dtype == out.dtype
        }
        _ => false,
    }
}

/// Whether `node` is a strictly widening cast of a tensor made by a node `in_home` says is in
/// its own kernel. Recomputing it elsewhere makes that kernel write the narrower operand (e.g.
/// bf16) in place of the wide result (f32): fewer bytes written, and each consumer reads fewer.
fn widens_a_value_of(region: &Region, node: &Node, in_home: impl Fn(NodeId) -> bool) -> bool {
    let (Op::Cast, [x], [r]) = (&node.op, node.inputs.as_slice(), node.results.as_slice()) else { return false };
    let made_home = matches!(region.value(*x).def, ValueDef::Result { node: p, .. } if in_home(p));
    made_home && region.ty(*x).rank() > 0 && region.ty(*r).dtype.size_bytes() > region.ty(*x).dtype.size_bytes()
}

/// A node to recompute and the groups (of the first grouping) that read its result.
struct Candidate {
    node: NodeId,
    /// Per consumer group: its members that read the node's result, in program order.
    consumers: Vec<Vec<NodeId>>,
    /// Whether the node's own group reads the result too (else the original goes).
    keep_original: bool,
}

fn candidates(region: &Region, grouping: &Grouping) -> Vec<Candidate> {
    let mut users: Vec<Vec<NodeId>> = vec![Vec::new(); region.values.len()];
    for &n in &region.order {
        for &v in &region.nodes[n.index()].inputs {
            if users[v.index()].last() != Some(&n) {
                users[v.index()].push(n);
            }
        }
    }
    let escapes: HashSet<Value> = region.outputs.iter().map(|o| o.value).chain(region.updates.iter().map(|u| u.value)).collect();
    let group_of = |n: NodeId| grouping.group_of.get(n.index()).copied().flatten();
    let mut out = Vec::new();
    for &n in &region.order {
        let node = &region.nodes[n.index()];
        let Some(home) = group_of(n) else { continue };
        if grouping.groups[home].kind != KernelKind::Fused || !cheap(region, node) {
            continue;
        }
        let r = node.results[0];
        if escapes.contains(&r) {
            continue;
        }
        // Its operands must be materialized anyway: made outside its kernel (or arguments, or
        // scalar constants, which every kernel copies). Or it widens a value of its own kernel,
        // which then writes that narrower value instead of the wide one.
        let operands_outside = node.inputs.iter().all(|&v| match region.value(v).def {
            ValueDef::Arg(_) => true,
            ValueDef::Result { node: p, .. } => group_of(p) != Some(home) || is_scalar_constant(region, v).is_some(),
        });
        if !operands_outside && !widens_a_value_of(region, node, |p| group_of(p) == Some(home)) {
            continue;
        }
        let mut keep_original = false;
        let mut groups: Vec<usize> = Vec::new();
        let mut consumers: Vec<Vec<NodeId>> = Vec::new();
        let mut eligible = true;
        for &u in &users[r.index()] {
            match group_of(u) {
                Some(g) if g == home => keep_original = true,
                Some(g) if matches!(grouping.groups[g].kind, KernelKind::Fused | KernelKind::Optimizer) => match groups.iter().position(|&x| x == g) {
                    Some(i) => consumers[i].push(u),
                    None => {
                        groups.push(g);
                        consumers.push(vec![u]);
                    }
                },
                // Read by a GEMM, a collective, a view...: written out anyway.
                _ => eligible = false,
            }
        }
        if eligible && !consumers.is_empty() {
            out.push(Candidate { node: n, consumers, keep_original });
        }
    }
    out
}

/// `region` with each candidate cloned into its consumer groups; returns the clones (with the
/// candidate each belongs to) and the consumers each clone feeds.
fn rewrite(region: &Region, cands: &[&Candidate]) -> (Region, Vec<(usize, NodeId, Vec<NodeId>)>) {
    let mut r = region.clone();
    let mut clones = Vec::new();
    let mut dead: HashSet<NodeId> = HashSet::new();
    let mut before: Vec<(NodeId, NodeId)> = Vec::new();
    for (ci, c) in cands.iter().enumerate() {
        let orig = r.nodes[c.node.index()].clone();
        let res = orig.results[0];
        for users in &c.consumers {
            let id = NodeId(r.nodes.len() as u32);
            let v = Value(r.values.len() as u32);
            let mut data = r.values[res.index()].clone();
            data.def = ValueDef::Result { node: id, index: 0 };
            data.name = None;
            r.values.push(data);
            r.nodes.push(Node { op: orig.op.clone(), inputs: orig.inputs.clone(), results: vec![v] });
            for &u in users {
                for i in r.nodes[u.index()].inputs.iter_mut().filter(|i| **i == res) {
                    *i = v;
                }
            }
            before.push((id, users[0]));
            clones.push((ci, id, users.clone()));
        }
        if !c.keep_original {
            dead.insert(c.node);
        }
    }
    // Each clone runs right before its first consumer, so that rule 1 pulls it into that
    // consumer's kernel rather than rule 2 into its operand's other readers.
    let mut order = Vec::with_capacity(r.order.len() + before.len());
    for &n in &r.order {
        for &(clone, _) in before.iter().filter(|(_, first)| *first == n) {
            order.push(clone);
        }
        if !dead.contains(&n) {
            order.push(n);
        }
    }
    r.order = order;
    (r, clones)
}

/// Apply rule 10 to `region` given its first grouping. A candidate whose clones do not all land
/// in their consumers' kernels (a merge the other rules refuse) is left materialized.
pub fn recompute(region: &Region, first: Grouping, dims: &DimTable) -> Result<Recomputed, PassDiag> {
    let all = candidates(region, &first);
    let mut active: Vec<&Candidate> = all.iter().collect();
    while !active.is_empty() {
        let (r, clones) = rewrite(region, &active);
        let pulled: HashSet<NodeId> = clones.iter().map(|&(_, id, _)| id).collect();
        let grouping = group_region_with(&r, dims, &pulled)?;
        let misplaced: HashSet<usize> = clones
            .iter()
            .filter(|(_, id, users)| {
                let g = grouping.group_of[id.index()];
                g.is_none() || users.iter().any(|u| grouping.group_of[u.index()] != g)
            })
            .map(|&(ci, _, _)| ci)
            .collect();
        if misplaced.is_empty() {
            return Ok(Recomputed { region: Some(r), grouping, clones: clones.len() });
        }
        active = active.iter().enumerate().filter(|(i, _)| !misplaced.contains(i)).map(|(_, c)| *c).collect();
    }
    Ok(Recomputed { region: None, grouping: first, clones: 0 })
}
