//! Dead-code elimination: drop nodes none of whose results reach an output or update.

use std::collections::HashSet;

use titan_ir::{Graph, Region};

/// Remove dead nodes from one region; returns how many were removed.
pub fn dce_region(region: &mut Region) -> usize {
    let mut live: HashSet<titan_ir::Value> = region.outputs.iter().map(|o| o.value).collect();
    live.extend(region.updates.iter().map(|u| u.value));
    let mut keep = Vec::with_capacity(region.order.len());
    for &n in region.order.iter().rev() {
        let node = region.node(n);
        if node.results.iter().any(|r| live.contains(r)) {
            live.extend(node.inputs.iter().copied());
            keep.push(n);
        }
    }
    let removed = region.order.len() - keep.len();
    keep.reverse();
    region.order = keep;
    removed
}

/// Remove dead nodes from every region of the graph.
pub fn dce(g: &mut Graph) -> usize {
    let mut n = dce_region(&mut g.main);
    for b in &mut g.blocks {
        n += dce_region(b);
    }
    n
}
