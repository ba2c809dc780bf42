//! The prefetch split of a repeated block: which of its nodes compute the next layer's
//! prefetched carries (a `repeat` with `prefetch = P`, see [`crate::Op::Repeat`]).
//!
//! A block run by `repeat {carry = C, stacked = S, prefetch = P}` has the arguments `C`
//! carried, `P` prefetched, `S` stacked, then the whole ones, and the outputs `C` carried, `P`
//! prefetched, then the stacked ones. Its **prefetch nodes** are the nodes the prefetched
//! outputs depend on. They read only stacked arguments (which they read at the *next* layer:
//! layer `l + 1`, or `l - 1` when `reverse`), whole arguments and each other, and nothing
//! else reads what they compute or the stacked arguments they read. So they can run before
//! the first layer (on the first layer's slices: the prefetched carries' initial values) and
//! during each layer but the last (for the next one), and a layer's other nodes read the
//! prefetched arguments: the values the previous layer (or the prologue) computed for it.
//! FSDP uses it to gather layer `l + 1`'s weights while layer `l` computes.

use crate::graph::{Region, Value, ValueDef};

/// The prefetch nodes of a block and the stacked arguments they read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefetchSplit {
    /// Per node id of the block: whether it is a prefetch node.
    pub is_prefetch: Vec<bool>,
    /// Indices (into the block's arguments) of the stacked arguments read at the next layer.
    pub next_args: Vec<usize>,
}

impl PrefetchSplit {
    /// Whether node `n` is a prefetch node.
    pub fn contains(&self, n: crate::NodeId) -> bool {
        self.is_prefetch.get(n.index()).copied().unwrap_or(false)
    }
}

/// The prefetch split of `block` under a `repeat` with `carry`, `stacked` and `prefetch`
/// (block layout as in the module docs); an error says which rule the block breaks.
pub fn prefetch_split(block: &Region, carry: usize, stacked: usize, prefetch: usize) -> Result<PrefetchSplit, String> {
    let mut split = PrefetchSplit { is_prefetch: vec![false; block.nodes.len()], next_args: Vec::new() };
    if prefetch == 0 {
        return Ok(split);
    }
    let name = &block.name;
    if block.outputs.len() < carry + prefetch || block.args.len() < carry + prefetch + stacked {
        return Err(format!("@{name} has too few arguments or outputs for carry {carry}, prefetch {prefetch}, stacked {stacked}"));
    }
    let arg_index = |v: Value| match block.values.get(v.index()).map(|d| d.def) {
        Some(ValueDef::Arg(i)) => Some(i as usize),
        _ => None,
    };
    let producer = |v: Value| match block.values.get(v.index()).map(|d| d.def) {
        Some(ValueDef::Result { node, .. }) => Some(node),
        _ => None,
    };
    // The nodes the prefetched outputs depend on.
    let mut stack: Vec<Value> = Vec::new();
    for (k, o) in block.outputs[carry..carry + prefetch].iter().enumerate() {
        if producer(o.value).is_none() {
            return Err(format!("prefetched output {k} of @{name} is not computed by a node of the block"));
        }
        stack.push(o.value);
    }
    let is_stacked = |i: usize| i >= carry + prefetch && i < carry + prefetch + stacked;
    while let Some(v) = stack.pop() {
        if let Some(i) = arg_index(v) {
            if is_stacked(i) {
                if !split.next_args.contains(&i) {
                    split.next_args.push(i);
                }
            } else if i < carry + prefetch {
                return Err(format!("a prefetch node of @{name} reads carried argument {i}; prefetch nodes may read only stacked and whole arguments"));
            }
            continue;
        }
        let Some(n) = producer(v) else { continue };
        if split.is_prefetch[n.index()] {
            continue;
        }
        split.is_prefetch[n.index()] = true;
        stack.extend(block.node(n).inputs.iter().copied());
    }
    split.next_args.sort_unstable();
    // Nothing else reads what the prefetch nodes compute or the arguments they read.
    let prefetch_value = |v: Value| producer(v).is_some_and(|n| split.is_prefetch[n.index()]) || arg_index(v).is_some_and(|i| split.next_args.contains(&i));
    for &n in &block.order {
        if split.is_prefetch[n.index()] {
            continue;
        }
        if let Some(&v) = block.node(n).inputs.iter().find(|&&v| prefetch_value(v)) {
            return Err(format!(
                "node {n} of @{name} reads {v}, which a prefetch node computes or reads at the next layer; only prefetch nodes and prefetched outputs may"
            ));
        }
    }
    for (j, o) in block.outputs.iter().enumerate() {
        if (j < carry || j >= carry + prefetch) && prefetch_value(o.value) {
            return Err(format!(
                "output {j} of @{name} is {}, which a prefetch node computes or reads at the next layer; only prefetched outputs may",
                o.value
            ));
        }
    }
    Ok(split)
}
