//! Outlining: turns a region and its [`Grouping`] into the kernel region (kernel, reshape and
//! repeat nodes) plus one body block per kernel, `@<region>.k<N>` in program order.

use std::collections::{HashMap, HashSet};

use titan_ir::{Arg, ArgKind, BlockId, KernelKind, Node, NodeId, Op, Output, Region, Update, Value, ValueData, ValueDef};

use super::group::{Grouping, Unit, is_scalar_constant};

/// A region rewritten into kernels, and the new kernel bodies.
pub struct Outlined {
    pub region: Region,
    pub bodies: Vec<Region>,
    /// Rank-0 constants copied into kernel bodies.
    pub constants_copied: usize,
    /// Ops moved into kernel bodies (copied constants not counted).
    pub ops_outlined: usize,
}

/// Append a node to `region` with results of the given value data (types, names, placement).
fn push_node(region: &mut Region, op: Op, inputs: Vec<Value>, results: &[&ValueData]) -> Vec<Value> {
    let id = NodeId(region.nodes.len() as u32);
    let mut out = Vec::with_capacity(results.len());
    for (i, d) in results.iter().enumerate() {
        let v = Value(region.values.len() as u32);
        region.values.push(ValueData {
            ty: d.ty.clone(),
            def: ValueDef::Result { node: id, index: i as u32 },
            name: d.name.clone(),
            placement: d.placement.clone(),
        });
        out.push(v);
    }
    region.nodes.push(Node { op, inputs, results: out.clone() });
    region.order.push(id);
    out
}

/// Build the kernel region of `src`. Body blocks get ids from `first_block` on.
/// Whether any result of node `m` is read outside its group or escapes the region.
fn users_outside_any(src: &Region, m: titan_ir::NodeId, users_outside: &HashSet<Value>, escapes: &[Value]) -> bool {
    src.nodes[m.index()].results.iter().any(|r| users_outside.contains(r) || escapes.contains(r))
}

pub fn outline(src: &Region, grouping: &Grouping, first_block: u32) -> Result<Outlined, String> {
    let mut region =
        Region { name: src.name.clone(), args: Vec::new(), values: Vec::new(), nodes: Vec::new(), order: Vec::new(), outputs: Vec::new(), updates: Vec::new() };
    let mut map: HashMap<Value, Value> = HashMap::new();
    for (i, a) in src.args.iter().enumerate() {
        let v = Value(region.values.len() as u32);
        let mut d = src.value(a.value).clone();
        d.def = ValueDef::Arg(i as u32);
        region.values.push(d);
        region.args.push(Arg { value: v, kind: a.kind.clone() });
        map.insert(a.value, v);
    }
    let escapes: Vec<Value> = src.outputs.iter().map(|o| o.value).chain(src.updates.iter().map(|u| u.value)).collect();
    let mut users_outside: HashSet<Value> = HashSet::new();
    for &n in &src.order {
        let gid = grouping.group_of[n.index()];
        for &v in &src.nodes[n.index()].inputs {
            if let ValueDef::Result { node, .. } = src.value(v).def
                && (gid.is_none() || grouping.group_of[node.index()] != gid)
            {
                users_outside.insert(v);
            }
        }
    }
    let lookup = |map: &HashMap<Value, Value>, v: Value| {
        map.get(&v).copied().ok_or_else(|| format!("@{}: value #{} is used before the kernel that makes it", src.name, v.0))
    };
    let mut out = Outlined { region, bodies: Vec::new(), constants_copied: 0, ops_outlined: 0 };
    for unit in &grouping.units {
        match *unit {
            Unit::Keep(n) => {
                let node = &src.nodes[n.index()];
                let inputs = node.inputs.iter().map(|&v| lookup(&map, v)).collect::<Result<Vec<_>, _>>()?;
                let datas: Vec<&ValueData> = node.results.iter().map(|&r| src.value(r)).collect();
                let results = push_node(&mut out.region, node.op.clone(), inputs, &datas);
                for (&old, new) in node.results.iter().zip(results) {
                    map.insert(old, new);
                }
            }
            Unit::Group(g) => {
                let group = &grouping.groups[g];
                let copies = matches!(group.kind, KernelKind::Fused | KernelKind::Optimizer);
                let name = format!("{}.k{}", src.name, out.bodies.len());
                let mut body = Region::new(&name);
                let mut bmap: HashMap<Value, Value> = HashMap::new();
                let mut ext: Vec<Value> = Vec::new();
                let mut copied = 0;
                for &m in &group.members {
                    let node = &src.nodes[m.index()];
                    let mut inputs = Vec::with_capacity(node.inputs.len());
                    for &v in &node.inputs {
                        if let Some(&b) = bmap.get(&v) {
                            inputs.push(b);
                            continue;
                        }
                        let copied_from = is_scalar_constant(src, v).filter(|c| copies && grouping.group_of[c.index()] != Some(g));
                        let b = match copied_from {
                            Some(c) => {
                                let cn = &src.nodes[c.index()];
                                copied += 1;
                                push_node(&mut body, cn.op.clone(), Vec::new(), &[src.value(v)])[0]
                            }
                            None => {
                                ext.push(v);
                                let d = src.value(v);
                                body.add_arg(d.ty.clone(), ArgKind::Block, d.name.as_deref())
                            }
                        };
                        bmap.insert(v, b);
                        inputs.push(b);
                    }
                    let datas: Vec<&ValueData> = node.results.iter().map(|&r| src.value(r)).collect();
                    let results = push_node(&mut body, node.op.clone(), inputs, &datas);
                    for (&old, new) in node.results.iter().zip(results) {
                        bmap.insert(old, new);
                    }
                }
                let mut produced: Vec<Value> = Vec::new();
                // An attention kernel writes both its results (the generated kernels' ABI), even
                // when only one is read: activation checkpointing may leave the forward's
                // logsumexp unread (it is recomputed in the backward).
                let whole = matches!(group.kind, KernelKind::Attention | KernelKind::AttentionBwd)
                    && group.members.iter().any(|m| users_outside_any(src, *m, &users_outside, &escapes));
                for &m in &group.members {
                    for &r in &src.nodes[m.index()].results {
                        if whole || users_outside.contains(&r) || escapes.contains(&r) {
                            produced.push(r);
                            body.outputs.push(Output { name: None, value: bmap[&r] });
                        }
                    }
                }
                if produced.is_empty() {
                    // Nothing reads the group (dead code the pipeline's dce would have removed).
                    continue;
                }
                out.ops_outlined += group.members.len();
                out.constants_copied += copied;
                body.canonicalize();
                let inputs = ext.iter().map(|&v| lookup(&map, v)).collect::<Result<Vec<_>, _>>()?;
                let datas: Vec<&ValueData> = produced.iter().map(|&r| src.value(r)).collect();
                let op = Op::Kernel { body: BlockId(first_block + out.bodies.len() as u32), kind: group.kind };
                let results = push_node(&mut out.region, op, inputs, &datas);
                for (&old, new) in produced.iter().zip(results) {
                    map.insert(old, new);
                }
                out.bodies.push(body);
            }
        }
    }
    for o in &src.outputs {
        out.region.outputs.push(Output { name: o.name.clone(), value: lookup(&map, o.value)? });
    }
    for u in &src.updates {
        out.region.updates.push(Update { state: lookup(&map, u.state)?, value: lookup(&map, u.value)? });
    }
    out.region.canonicalize();
    Ok(out)
}
