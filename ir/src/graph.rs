//! The graph: a `main` region (the step function) and `block` regions it repeats per layer.
//! Values and nodes are small typed ids into tables owned by their region.

use std::fmt;

use crate::attr::{AttrValue, Attrs};
use crate::infer::{InferCtx, infer_types};
use crate::op::Op;
use crate::placement::Placement;
use crate::shape::{DimTable, TensorType};

/// A value of one region; prints as `%3` (or `%name` when it has a name).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Value(pub u32);

/// A node of one region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

/// A block region of the graph; prints as `@name`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl Value {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl BlockId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}", self.0)
    }
}

/// Where a value comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueDef {
    /// The region's argument number `i`.
    Arg(u32),
    /// Result `index` of `node`.
    Result { node: NodeId, index: u32 },
}

#[derive(Clone, Debug, PartialEq)]
pub struct ValueData {
    pub ty: TensorType,
    pub def: ValueDef,
    /// Optional readable name (`%tokens`); unnamed values print by number.
    pub name: Option<String>,
    /// Placement per mesh dimension; empty until the sharding passes run.
    pub placement: Vec<Placement>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<Value>,
    pub results: Vec<Value>,
}

/// How a parameter or state buffer is initialized before the first step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Zeros,
    Ones,
    Normal {
        std: f64,
    },
    /// Normal with `std`, resampled outside `[lo, hi]`. With `depth_scaled`, layer `l` uses
    /// `std / sqrt(2 (l + 1))` (TorchTitan's depth init).
    TruncNormal {
        std: f64,
        lo: f64,
        hi: f64,
        depth_scaled: bool,
    },
    /// The compute copy of a master weight (`compute-copies`): the cast of the master named by
    /// this state's name without [`COMPUTE_COPY_SUFFIX`] to this state's dtype. Recomputed from
    /// the master whenever the master is set (start-up, `--resume`), never checkpointed.
    ComputeCopy,
}

/// The checkpoint-name suffix of a compute copy: `layers.{i}.attention.wq.weight.compute`.
pub const COMPUTE_COPY_SUFFIX: &str = ".compute";

impl Init {
    pub fn to_attr(self) -> AttrValue {
        match self {
            Init::Zeros => AttrValue::Ident("zeros".into()),
            Init::Ones => AttrValue::Ident("ones".into()),
            Init::ComputeCopy => AttrValue::Ident("compute_copy".into()),
            Init::Normal { std } => AttrValue::Call("normal".into(), vec![AttrValue::Float(std)]),
            Init::TruncNormal { std, lo, hi, depth_scaled } => AttrValue::Call(
                if depth_scaled { "trunc_normal_depth" } else { "trunc_normal" }.into(),
                vec![AttrValue::Float(std), AttrValue::Float(lo), AttrValue::Float(hi)],
            ),
        }
    }

    pub fn from_attr(v: &AttrValue) -> Result<Init, String> {
        let nums = |args: &[AttrValue], n: usize, what: &str| -> Result<Vec<f64>, String> {
            let xs: Option<Vec<f64>> = args.iter().map(AttrValue::as_f64).collect();
            match xs {
                Some(xs) if xs.len() == n => Ok(xs),
                _ => Err(format!("`{what}` takes {n} numbers")),
            }
        };
        match v {
            AttrValue::Ident(s) if s == "zeros" => Ok(Init::Zeros),
            AttrValue::Ident(s) if s == "ones" => Ok(Init::Ones),
            AttrValue::Ident(s) if s == "compute_copy" => Ok(Init::ComputeCopy),
            AttrValue::Call(name, args) if name == "normal" => Ok(Init::Normal { std: nums(args, 1, name)?[0] }),
            AttrValue::Call(name, args) if name == "trunc_normal" || name == "trunc_normal_depth" => {
                let x = nums(args, 3, name)?;
                Ok(Init::TruncNormal { std: x[0], lo: x[1], hi: x[2], depth_scaled: name == "trunc_normal_depth" })
            }
            other => Err(format!(
                "unknown initializer `{other}`; expected zeros, ones, normal(std), trunc_normal(std, lo, hi), trunc_normal_depth(std, lo, hi) or compute_copy"
            )),
        }
    }
}

/// A named, persistent tensor: a model parameter, or optimizer state in the training graph.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamInfo {
    /// Checkpoint name, Hugging Face style. A per-layer parameter stacked along dim 0 names
    /// its layers with `{i}`: `layers.{i}.attention.wq.weight`.
    pub name: String,
    pub init: Init,
}

impl ParamInfo {
    /// Whether dim 0 stacks one slice per layer.
    pub fn is_stacked(&self) -> bool {
        self.name.contains("{i}")
    }

    /// The checkpoint name of layer `i`'s slice.
    pub fn layer_name(&self, i: usize) -> String {
        self.name.replace("{i}", &i.to_string())
    }

    /// For a compute copy (`init = compute_copy`), the checkpoint name of its master.
    pub fn compute_copy_of(&self) -> Option<&str> {
        if self.init != Init::ComputeCopy {
            return None;
        }
        self.name.strip_suffix(COMPUTE_COPY_SUFFIX)
    }
}

/// What an argument of a region is.
#[derive(Clone, Debug, PartialEq)]
pub enum ArgKind {
    /// An argument of a block region (bound by `repeat`).
    Block,
    /// Fed by the runtime each step (tokens, targets, step number).
    Input,
    /// A model parameter.
    Param(ParamInfo),
    /// A persistent buffer the step reads and updates (master weights, AdamW moments).
    State(ParamInfo),
}

impl ArgKind {
    pub fn param_info(&self) -> Option<&ParamInfo> {
        match self {
            ArgKind::Param(p) | ArgKind::State(p) => Some(p),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Arg {
    pub value: Value,
    pub kind: ArgKind,
}

/// A result of a region: blocks return unnamed values, `main` names its outputs (`loss`).
#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    pub name: Option<String>,
    pub value: Value,
}

/// `update %state <- %value`: the runtime stores `value` into the state buffer after the step.
#[derive(Clone, Debug, PartialEq)]
pub struct Update {
    pub state: Value,
    pub value: Value,
}

/// A list of nodes in program order over one table of values.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Region {
    pub name: String,
    pub values: Vec<ValueData>,
    pub nodes: Vec<Node>,
    /// Program order; nodes not listed here are dead (removed by a pass).
    pub order: Vec<NodeId>,
    pub args: Vec<Arg>,
    pub outputs: Vec<Output>,
    pub updates: Vec<Update>,
}

impl Region {
    pub fn new(name: &str) -> Region {
        Region { name: name.to_string(), ..Region::default() }
    }

    pub fn value(&self, v: Value) -> &ValueData {
        &self.values[v.index()]
    }

    pub fn ty(&self, v: Value) -> &TensorType {
        &self.values[v.index()].ty
    }

    pub fn node(&self, n: NodeId) -> &Node {
        &self.nodes[n.index()]
    }

    /// Add an argument; arguments are numbered in the order they are added.
    pub fn add_arg(&mut self, ty: TensorType, kind: ArgKind, name: Option<&str>) -> Value {
        let v = Value(self.values.len() as u32);
        let idx = self.args.len() as u32;
        self.values.push(ValueData { ty, def: ValueDef::Arg(idx), name: name.map(str::to_string), placement: vec![] });
        self.args.push(Arg { value: v, kind });
        v
    }

    /// Append a node with the given result types (no checking; see [`Builder::push`]).
    pub fn add_node(&mut self, op: Op, inputs: Vec<Value>, result_types: Vec<TensorType>) -> NodeId {
        let id = NodeId(self.nodes.len() as u32);
        let results = result_types
            .into_iter()
            .enumerate()
            .map(|(i, ty)| {
                let v = Value(self.values.len() as u32);
                self.values.push(ValueData { ty, def: ValueDef::Result { node: id, index: i as u32 }, name: None, placement: vec![] });
                v
            })
            .collect();
        self.nodes.push(Node { op, inputs, results });
        self.order.push(id);
        id
    }

    pub fn arg_values(&self) -> impl Iterator<Item = Value> + '_ {
        self.args.iter().map(|a| a.value)
    }

    /// The argument description of `v`, if `v` is an argument.
    pub fn arg_of(&self, v: Value) -> Option<&Arg> {
        match self.values[v.index()].def {
            ValueDef::Arg(i) => self.args.get(i as usize),
            ValueDef::Result { .. } => None,
        }
    }

    /// Find a value by its name.
    pub fn find(&self, name: &str) -> Option<Value> {
        self.values.iter().position(|d| d.name.as_deref() == Some(name)).map(|i| Value(i as u32))
    }

    /// Rebuild the tables so values and nodes are numbered in definition order and dead nodes
    /// are gone. Printing is unaffected; structural equality after parsing relies on it.
    pub fn canonicalize(&mut self) {
        let mut map = vec![None; self.values.len()];
        let mut values = Vec::with_capacity(self.values.len());
        for a in &self.args {
            map[a.value.index()] = Some(Value(values.len() as u32));
            values.push(self.values[a.value.index()].clone());
        }
        let mut nodes = Vec::with_capacity(self.order.len());
        for (new_id, &n) in self.order.iter().enumerate() {
            let node = &self.nodes[n.index()];
            let mut results = Vec::with_capacity(node.results.len());
            for (i, &r) in node.results.iter().enumerate() {
                let nv = Value(values.len() as u32);
                map[r.index()] = Some(nv);
                let mut d = self.values[r.index()].clone();
                d.def = ValueDef::Result { node: NodeId(new_id as u32), index: i as u32 };
                values.push(d);
                results.push(nv);
            }
            nodes.push(Node { op: node.op.clone(), inputs: node.inputs.clone(), results });
        }
        let remap = |v: Value| map[v.index()].expect("invariant: canonicalize sees only live values");
        for node in &mut nodes {
            for i in &mut node.inputs {
                *i = remap(*i);
            }
        }
        for a in &mut self.args {
            a.value = remap(a.value);
        }
        for o in &mut self.outputs {
            o.value = remap(o.value);
        }
        for u in &mut self.updates {
            u.state = remap(u.state);
            u.value = remap(u.value);
        }
        self.order = (0..nodes.len() as u32).map(NodeId).collect();
        self.values = values;
        self.nodes = nodes;
    }
}

/// A whole program: metadata, named dimensions, blocks and the `main` step function.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Graph {
    pub name: String,
    /// Free-form model description (`dim = 4096`, `n_layers = 32`, ...), kept in order.
    pub meta: Attrs,
    /// Named dimensions and their sizes.
    pub dims: DimTable,
    pub blocks: Vec<Region>,
    pub main: Region,
}

impl Graph {
    pub fn new(name: &str) -> Graph {
        Graph { name: name.to_string(), main: Region::new("main"), ..Graph::default() }
    }

    pub fn block(&self, b: BlockId) -> &Region {
        &self.blocks[b.index()]
    }

    pub fn block_by_name(&self, name: &str) -> Option<BlockId> {
        self.blocks.iter().position(|r| r.name == name).map(|i| BlockId(i as u32))
    }

    /// Remove the blocks that no live node of `main` reaches (through `repeat` and `kernel`, also
    /// from inside blocks) and renumber the block ids of the rest; returns how many were removed.
    pub fn drop_unused_blocks(&mut self) -> usize {
        fn block_of(op: &Op) -> Option<BlockId> {
            match *op {
                Op::Repeat { block, .. } => Some(block),
                Op::Kernel { body, .. } => Some(body),
                _ => None,
            }
        }
        let live_blocks = |r: &Region| -> Vec<BlockId> { r.order.iter().filter_map(|n| r.nodes.get(n.index())).filter_map(|n| block_of(&n.op)).collect() };
        let mut used = vec![false; self.blocks.len()];
        let mut work = live_blocks(&self.main);
        while let Some(b) = work.pop() {
            match used.get_mut(b.index()) {
                Some(u) if !*u => {
                    *u = true;
                    work.extend(live_blocks(&self.blocks[b.index()]));
                }
                _ => {}
            }
        }
        let removed = used.iter().filter(|u| !**u).count();
        if removed == 0 {
            return 0;
        }
        let mut new_id = vec![None; self.blocks.len()];
        let mut next = 0u32;
        for (i, &u) in used.iter().enumerate() {
            if u {
                new_id[i] = Some(BlockId(next));
                next += 1;
            }
        }
        let blocks = std::mem::take(&mut self.blocks);
        self.blocks = blocks.into_iter().zip(&used).filter(|(_, u)| **u).map(|(b, _)| b).collect();
        for r in std::iter::once(&mut self.main).chain(self.blocks.iter_mut()) {
            for n in &mut r.nodes {
                match &mut n.op {
                    // A dead node may name a removed block: it keeps an id nothing resolves.
                    Op::Repeat { block: b, .. } | Op::Kernel { body: b, .. } => *b = new_id.get(b.index()).copied().flatten().unwrap_or(BlockId(u32::MAX)),
                    _ => {}
                }
            }
        }
        removed
    }

    pub fn add_block(&mut self, region: Region) -> BlockId {
        self.blocks.push(region);
        BlockId(self.blocks.len() as u32 - 1)
    }

    pub fn meta_i64(&self, key: &str) -> Option<i64> {
        self.meta.get(key).and_then(AttrValue::as_i64)
    }

    pub fn meta_f64(&self, key: &str) -> Option<f64> {
        self.meta.get(key).and_then(AttrValue::as_f64)
    }

    /// A builder appending to `main`.
    pub fn main_builder(&mut self) -> Builder<'_> {
        Builder { region: &mut self.main, ctx: InferCtx { dims: &self.dims, blocks: &self.blocks } }
    }

    pub fn canonicalize(&mut self) {
        for b in &mut self.blocks {
            b.canonicalize();
        }
        self.main.canonicalize();
    }
}

/// Appends type-checked nodes to a region.
pub struct Builder<'a> {
    pub region: &'a mut Region,
    pub ctx: InferCtx<'a>,
}

impl<'a> Builder<'a> {
    pub fn new(region: &'a mut Region, dims: &'a DimTable, blocks: &'a [Region]) -> Builder<'a> {
        Builder { region, ctx: InferCtx { dims, blocks } }
    }

    pub fn ty(&self, v: Value) -> &TensorType {
        self.region.ty(v)
    }

    /// Append `op` with inferred result types.
    pub fn push(&mut self, op: Op, inputs: &[Value]) -> Result<Vec<Value>, String> {
        self.push_declared(op, inputs, None)
    }

    /// Append `op` whose result type is declared (cast, reshape, broadcast, scatter_add, constant).
    pub fn push_typed(&mut self, op: Op, inputs: &[Value], ty: TensorType) -> Result<Value, String> {
        Ok(self.push_declared(op, inputs, Some(&[ty]))?[0])
    }

    /// Append an op with exactly one result.
    pub fn push1(&mut self, op: Op, inputs: &[Value]) -> Result<Value, String> {
        let r = self.push(op, inputs)?;
        match r.as_slice() {
            [v] => Ok(*v),
            _ => Err(format!("expected one result, the op has {}", r.len())),
        }
    }

    fn push_declared(&mut self, op: Op, inputs: &[Value], declared: Option<&[TensorType]>) -> Result<Vec<Value>, String> {
        let in_types: Vec<&TensorType> = inputs.iter().map(|&v| self.region.ty(v)).collect();
        let types = infer_types(&op, &in_types, declared, &self.ctx)?;
        let n = self.region.add_node(op, inputs.to_vec(), types);
        Ok(self.region.node(n).results.clone())
    }

    pub fn name(&mut self, v: Value, name: &str) -> Value {
        self.region.values[v.index()].name = Some(name.to_string());
        v
    }
}
