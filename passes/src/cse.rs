//! Common-subexpression elimination: a node identical to an earlier one (same op, attributes,
//! inputs and result types) is dropped and its results are replaced by the earlier node's.
//! Every op of the IR is pure, so this is always sound.

use std::collections::HashMap;

use titan_ir::{Graph, NodeId, Region, Value};

/// Deduplicate one region; returns how many nodes were removed.
pub fn cse_region(region: &mut Region) -> usize {
    let mut seen: HashMap<(&'static str, Vec<Value>), Vec<NodeId>> = HashMap::new();
    let mut replace: HashMap<Value, Value> = HashMap::new();
    let mut keep = Vec::with_capacity(region.order.len());
    let order = region.order.clone();
    for n in order {
        for i in 0..region.nodes[n.index()].inputs.len() {
            let v = region.nodes[n.index()].inputs[i];
            if let Some(&r) = replace.get(&v) {
                region.nodes[n.index()].inputs[i] = r;
            }
        }
        let node = &region.nodes[n.index()];
        let key = (node.op.name(), node.inputs.clone());
        let same = seen.get(&key).and_then(|cands| {
            cands.iter().copied().find(|&c| {
                let other = &region.nodes[c.index()];
                other.op == node.op
                    && other.results.len() == node.results.len()
                    && other.results.iter().zip(&node.results).all(|(a, b)| region.values[a.index()].ty == region.values[b.index()].ty)
            })
        });
        match same {
            Some(c) => {
                for (&dup, &orig) in node.results.iter().zip(&region.nodes[c.index()].results) {
                    replace.insert(dup, orig);
                }
            }
            None => {
                seen.entry(key).or_default().push(n);
                keep.push(n);
            }
        }
    }
    let removed = region.order.len() - keep.len();
    region.order = keep;
    for o in &mut region.outputs {
        if let Some(&r) = replace.get(&o.value) {
            o.value = r;
        }
    }
    for u in &mut region.updates {
        if let Some(&r) = replace.get(&u.value) {
            u.value = r;
        }
    }
    removed
}

/// Deduplicate every region of the graph.
pub fn cse(g: &mut Graph) -> usize {
    let mut n = cse_region(&mut g.main);
    for b in &mut g.blocks {
        n += cse_region(b);
    }
    n
}
