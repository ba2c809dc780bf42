//! The CPU reference interpreter: runs a graph's regions node by node on host tensors, the
//! executable spec every backend is compared against. Owns region execution (`repeat`
//! included), argument checking and freeing intermediates after their last use; the op
//! semantics live in [`ops`] and the modules it dispatches to.

mod attention;
mod collective;
mod float8;
mod linalg;
mod model;
mod ops;
mod round;
mod tensor;

use std::fmt;

use crate::graph::{Graph, NodeId, Region, Value};
use crate::op::Op;
use crate::shape::TensorType;

pub use collective::{Communicator, concat, eval_collective, eval_mesh_op, shard_of};
pub use model::{lr_at, rope_inv_freq};
pub use ops::eval_op;
pub use round::{is_narrow_float, round_to_dtype};
pub use tensor::{Data, MatMut, MatRef, Real, Tensor, gemm};

/// How low-precision dtypes are treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// Round every result whose dtype is bf16/f16/f8 to that dtype (f32-typed results stay
    /// in `T`), plus the documented intermediate roundings inside ops: what a mixed-precision
    /// backend computes.
    Emulate,
    /// No rounding at all: exact math in `T`, for gradient checks in f64.
    Exact,
}

/// An error while running a graph: where (region, node, op) and what.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub struct InterpError {
    pub region: String,
    pub node: Option<NodeId>,
    pub op: Option<&'static str>,
    pub message: String,
}

impl fmt::Display for InterpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "in @{}", self.region)?;
        if let Some(n) = self.node {
            write!(f, ", node {n}")?;
        }
        if let Some(op) = self.op {
            write!(f, " (`{op}`)")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl InterpError {
    fn region(region: &Region, message: String) -> InterpError {
        InterpError { region: region.name.clone(), node: None, op: None, message }
    }

    fn node(region: &Region, node: NodeId, op: &Op, message: String) -> InterpError {
        InterpError { region: region.name.clone(), node: Some(node), op: Some(op.name()), message }
    }
}

/// What `main` returns.
#[derive(Clone, Debug, PartialEq)]
pub struct MainResult<T> {
    /// In `main.outputs` order.
    pub outputs: Vec<Tensor<T>>,
    /// The new state values, in `main.updates` order.
    pub updates: Vec<Tensor<T>>,
}

/// When each value of a region dies: computed once per region.
#[derive(Clone, Debug, Default)]
struct Plan {
    /// Arguments nothing reads (dropped before the first node).
    unused_args: Vec<Value>,
    /// Per position in `order`: the values whose last use is that node.
    free_after: Vec<Vec<Value>>,
}

impl Plan {
    fn new(region: &Region) -> Plan {
        let n = region.values.len();
        let mut last: Vec<Option<usize>> = vec![None; n];
        let mut keep = vec![false; n];
        for v in region.outputs.iter().map(|o| o.value).chain(region.updates.iter().map(|u| u.value)) {
            if let Some(k) = keep.get_mut(v.index()) {
                *k = true;
            }
        }
        for (pos, nid) in region.order.iter().enumerate() {
            let Some(node) = region.nodes.get(nid.index()) else { continue };
            for v in node.inputs.iter().chain(&node.results) {
                if let Some(l) = last.get_mut(v.index()) {
                    *l = Some(l.map_or(pos, |p| p.max(pos)));
                }
            }
        }
        let mut free_after = vec![Vec::new(); region.order.len()];
        for (i, l) in last.iter().enumerate() {
            if let (Some(pos), false) = (l, keep[i]) {
                free_after[*pos].push(Value(i as u32));
            }
        }
        let unused_args = region.args.iter().map(|a| a.value).filter(|v| last.get(v.index()).is_some_and(Option::is_none) && !keep[v.index()]).collect();
        Plan { unused_args, free_after }
    }
}

/// A value of the environment: absent, borrowed from the caller, or computed here.
enum Slot<'a, T> {
    Empty,
    Borrowed(&'a Tensor<T>),
    Owned(Tensor<T>),
}

impl<T> Slot<'_, T> {
    fn get(&self) -> Option<&Tensor<T>> {
        match self {
            Slot::Empty => None,
            Slot::Borrowed(t) => Some(t),
            Slot::Owned(t) => Some(t),
        }
    }
}

fn value_name(region: &Region, v: Value) -> String {
    match region.values.get(v.index()).and_then(|d| d.name.as_deref()) {
        Some(name) => format!("%{name}"),
        None => format!("{v}"),
    }
}

/// Runs a graph on host tensors.
pub struct Interpreter<'g> {
    graph: &'g Graph,
    precision: Precision,
    main_plan: Plan,
    block_plans: Vec<Plan>,
    /// The device mesh collectives run on; `None` for a single-rank run.
    comm: Option<std::sync::Arc<dyn Communicator>>,
}

impl<'g> Interpreter<'g> {
    pub fn new(graph: &'g Graph, precision: Precision) -> Self {
        Interpreter { graph, precision, main_plan: Plan::new(&graph.main), block_plans: graph.blocks.iter().map(Plan::new).collect(), comm: None }
    }

    /// Run collectives through `comm` (this interpreter is one rank of a mesh).
    pub fn with_communicator(mut self, comm: std::sync::Arc<dyn Communicator>) -> Self {
        self.comm = Some(comm);
        self
    }

    pub fn graph(&self) -> &'g Graph {
        self.graph
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Run `main` once. `args` follow `main.args`; each is checked against its declared type.
    pub fn run<T: Real>(&self, args: &[Tensor<T>]) -> Result<MainResult<T>, InterpError> {
        let main = &self.graph.main;
        let wanted: Vec<Value> = main.outputs.iter().map(|o| o.value).chain(main.updates.iter().map(|u| u.value)).collect();
        let slots = args.iter().map(Slot::Borrowed).collect();
        let mut all = self.exec(main, &self.main_plan, slots, &wanted)?;
        let updates = all.split_off(main.outputs.len());
        Ok(MainResult { outputs: all, updates })
    }

    /// Run one region (`main` or a block) on `args` and return its outputs.
    pub fn run_region<T: Real>(&self, region: &Region, args: &[Tensor<T>]) -> Result<Vec<Tensor<T>>, InterpError> {
        let wanted: Vec<Value> = region.outputs.iter().map(|o| o.value).collect();
        let slots = args.iter().map(Slot::Borrowed).collect();
        let fresh;
        let plan = if std::ptr::eq(region, &self.graph.main) {
            &self.main_plan
        } else if let Some(i) = self.graph.blocks.iter().position(|b| std::ptr::eq(b, region)) {
            &self.block_plans[i]
        } else {
            fresh = Plan::new(region);
            &fresh
        };
        self.exec(region, plan, slots, &wanted)
    }

    /// Check an argument tensor against the region's declaration.
    fn check_arg<T: Real>(&self, region: &Region, i: usize, t: &Tensor<T>) -> Result<(), InterpError> {
        let arg = &region.args[i];
        let name = value_name(region, arg.value);
        let decl = region
            .values
            .get(arg.value.index())
            .map(|d| &d.ty)
            .ok_or_else(|| InterpError::region(region, format!("argument {i} names a value that does not exist")))?;
        let shape = decl.resolve(&self.graph.dims).map_err(|e| InterpError::region(region, format!("argument {i} ({name}): {e}")))?;
        if t.dtype != decl.dtype || t.shape != shape {
            let want = format!("{}{}", decl.dtype, tensor::shape_str(&shape));
            return Err(InterpError::region(region, format!("argument {i} ({name}) is {}, expected {want}", t.type_string())));
        }
        t.validate().map_err(|e| InterpError::region(region, format!("argument {i} ({name}): {e}")))
    }

    /// Execute `region` in `order`, dropping each intermediate after its last use, and
    /// return the values of `wanted`.
    fn exec<'a, T: Real>(&self, region: &Region, plan: &Plan, args: Vec<Slot<'a, T>>, wanted: &[Value]) -> Result<Vec<Tensor<T>>, InterpError> {
        if args.len() != region.args.len() {
            return Err(InterpError::region(region, format!("@{} takes {} arguments, {} given", region.name, region.args.len(), args.len())));
        }
        let mut env: Vec<Slot<'a, T>> = (0..region.values.len()).map(|_| Slot::Empty).collect();
        for (i, slot) in args.into_iter().enumerate() {
            if let Some(t) = slot.get() {
                self.check_arg(region, i, t)?;
            }
            let v = region.args[i].value;
            let dst = env.get_mut(v.index()).ok_or_else(|| InterpError::region(region, format!("argument {i} names a value that does not exist")))?;
            *dst = slot;
        }
        for v in &plan.unused_args {
            env[v.index()] = Slot::Empty;
        }
        for (pos, &nid) in region.order.iter().enumerate() {
            let node = region.nodes.get(nid.index()).ok_or_else(|| InterpError::region(region, format!("node {nid} in the order does not exist")))?;
            let err = |m: String| InterpError::node(region, nid, &node.op, m);
            let mut result_types: Vec<TensorType> = Vec::with_capacity(node.results.len());
            for r in &node.results {
                let d = region.values.get(r.index()).ok_or_else(|| err(format!("result {r} does not exist")))?;
                result_types.push(d.ty.clone());
            }
            let outs = {
                let mut inputs: Vec<&Tensor<T>> = Vec::with_capacity(node.inputs.len());
                for &v in &node.inputs {
                    let t =
                        env.get(v.index()).and_then(Slot::get).ok_or_else(|| err(format!("operand {} is used before it is defined", value_name(region, v))))?;
                    inputs.push(t);
                }
                match &node.op {
                    &Op::Repeat { block, count, carry, stacked, reverse, prefetch } => {
                        let rep = Repeat {
                            block: block.index(),
                            count: count as usize,
                            carry: carry as usize,
                            stacked: stacked as usize,
                            reverse,
                            prefetch: prefetch as usize,
                        };
                        self.repeat(region, nid, &rep, &inputs, &result_types)?
                    }
                    &Op::Kernel { body, .. } => {
                        let block = self.graph.blocks.get(body.index()).ok_or_else(|| err(format!("kernel body #{} does not exist", body.0)))?;
                        let wanted: Vec<Value> = block.outputs.iter().map(|o| o.value).collect();
                        let args = inputs.iter().map(|t| Slot::Borrowed(*t)).collect();
                        self.exec(block, &self.block_plans[body.index()], args, &wanted).map_err(|mut e| {
                            e.message = format!("{} (in `kernel` node {nid} of @{})", e.message, region.name);
                            e
                        })?
                    }
                    op if op.mesh_dim().is_some() && self.comm.is_some() => {
                        let comm = self.comm.as_deref().ok_or_else(|| err("no communicator".into()))?;
                        vec![eval_mesh_op(op, &inputs, comm, self.precision).map_err(err)?]
                    }
                    op => eval_op(op, &inputs, &result_types, &self.graph.dims, self.precision).map_err(err)?,
                }
            };
            if outs.len() != node.results.len() {
                return Err(err(format!("produced {} results for {} declared", outs.len(), node.results.len())));
            }
            for (r, t) in node.results.iter().zip(outs) {
                env[r.index()] = Slot::Owned(t);
            }
            for v in &plan.free_after[pos] {
                env[v.index()] = Slot::Empty;
            }
        }
        let mut out = Vec::with_capacity(wanted.len());
        for (i, &v) in wanted.iter().enumerate() {
            let reused = wanted[i + 1..].contains(&v);
            let slot = env.get_mut(v.index()).ok_or_else(|| InterpError::region(region, format!("output {v} does not exist")))?;
            let t = match std::mem::replace(slot, Slot::Empty) {
                Slot::Owned(t) if !reused => t,
                Slot::Owned(t) => {
                    let copy = t.clone();
                    *slot = Slot::Owned(t);
                    copy
                }
                Slot::Borrowed(t) => {
                    *slot = Slot::Borrowed(t);
                    t.clone()
                }
                Slot::Empty => return Err(InterpError::region(region, format!("output {} is never defined", value_name(region, v)))),
            };
            out.push(t);
        }
        Ok(out)
    }

    /// Run a block once per layer (see [`Op::Repeat`]).
    fn repeat<'a, T: Real>(
        &self,
        region: &Region,
        nid: NodeId,
        rep: &Repeat,
        inputs: &[&'a Tensor<T>],
        result_types: &[TensorType],
    ) -> Result<Vec<Tensor<T>>, InterpError> {
        let op_name = "repeat";
        let err = |m: String| InterpError { region: region.name.clone(), node: Some(nid), op: Some(op_name), message: m };
        let block = self.graph.blocks.get(rep.block).ok_or_else(|| err(format!("block #{} does not exist", rep.block)))?;
        let plan = &self.block_plans[rep.block];
        let (nc, ns, np, count) = (rep.carry, rep.stacked, rep.prefetch, rep.count);
        if inputs.len() + np != block.args.len() || nc + ns > inputs.len() {
            return Err(err(format!("@{} takes {} operands, {} given (carry {nc}, stacked {ns}, prefetch {np})", block.name, block.args.len(), inputs.len())));
        }
        if block.outputs.len() < nc + np || result_types.len() + np != block.outputs.len() {
            return Err(err(format!(
                "@{} returns {} values for carry {nc}, prefetch {np} and {} results",
                block.name,
                block.outputs.len(),
                result_types.len()
            )));
        }
        for (j, t) in inputs[nc..nc + ns].iter().enumerate() {
            if t.shape.first() != Some(&count) {
                return Err(err(format!("stacked operand {} is {}, its leading dim must be the layer count {count}", nc + j, t.type_string())));
            }
        }
        let mut stacked_out = Vec::with_capacity(result_types.len() - nc);
        for ty in &result_types[nc..] {
            let shape = ty.resolve(&self.graph.dims).map_err(err)?;
            if shape.first() != Some(&count) {
                return Err(err(format!("stacked result {ty} must lead with the layer count {count}")));
            }
            stacked_out.push(Tensor::<T>::zeros(ty.dtype, shape));
        }
        let layer_of = |t: usize| if rep.reverse { count - 1 - t } else { t };
        // With prefetched carries: the prefetch nodes run alone before the first layer (on its
        // slices), and the last layer runs without them (there is no next layer).
        let split = crate::prefetch::prefetch_split(block, nc, ns, np).map_err(err)?;
        let (prologue, last) = if np > 0 {
            let pro = Part::new(block, |n| split.contains(n), |j| j >= nc && j < nc + np);
            let last = Part::new(block, |n| !split.contains(n), |j| j < nc || j >= nc + np);
            (Some(pro), Some(last))
        } else {
            (None, None)
        };
        let next_args: Vec<bool> = (0..ns).map(|j| split.next_args.contains(&(nc + np + j))).collect();
        // Block arguments for layer `i` reading the next-layer arguments at `next`.
        let layer_args = |i: usize, next: Option<usize>, carried: Vec<Slot<'a, T>>| -> Result<Vec<Slot<'a, T>>, InterpError> {
            let mut args: Vec<Slot<'a, T>> = Vec::with_capacity(block.args.len());
            args.extend(carried);
            for (j, t) in inputs[nc..nc + ns].iter().enumerate() {
                let slice = if next_args[j] { next } else { Some(i) };
                args.push(match slice {
                    Some(l) => Slot::Owned(t.try_layer(l).map_err(err)?),
                    None => Slot::Empty,
                });
            }
            args.extend(inputs[nc + ns..].iter().map(|t| Slot::Borrowed(*t)));
            Ok(args)
        };
        let wanted: Vec<Value> = block.outputs.iter().map(|o| o.value).collect();
        let mut carries: Vec<Slot<'a, T>> = inputs[..nc].iter().map(|t| Slot::Borrowed(*t)).collect();
        if let Some(pro) = &prologue
            && count > 0
        {
            let empty = (0..nc + np).map(|_| Slot::Empty).collect();
            let args = layer_args(layer_of(0), Some(layer_of(0)), empty)?;
            let outs = self.exec(&pro.region, &pro.plan, args, &pro.wanted).map_err(|mut e| {
                e.message = format!("{} (prefetch of layer {} before `repeat` node {nid} in @{})", e.message, layer_of(0), region.name);
                e
            })?;
            carries.extend(outs.into_iter().map(Slot::Owned));
        }
        for step in 0..count {
            let i = layer_of(step);
            let is_last = step + 1 == count;
            let next = (!is_last).then(|| layer_of(step + 1));
            let args = layer_args(i, next, std::mem::take(&mut carries))?;
            let (exec_region, exec_plan, exec_wanted) = match &last {
                Some(l) if is_last => (&l.region, &l.plan, &l.wanted),
                _ => (block, plan, &wanted),
            };
            let outs = self.exec(exec_region, exec_plan, args, exec_wanted).map_err(|mut e| {
                e.message = format!("{} (layer {i} of `repeat` node {nid} in @{})", e.message, region.name);
                e
            })?;
            let mut outs = outs.into_iter();
            let n_carried = if is_last { nc } else { nc + np };
            carries = outs.by_ref().take(n_carried).map(Slot::Owned).collect();
            for (j, (t, dst)) in outs.zip(&mut stacked_out).enumerate() {
                let n = t.numel();
                let ok = t.dtype == dst.dtype && t.data.len() * count == dst.data.len() && dst.shape[1..] == t.shape[..];
                let placed = ok
                    && match (&mut dst.data, &t.data) {
                        (Data::Float(d), Data::Float(s)) => {
                            d[i * n..(i + 1) * n].copy_from_slice(s);
                            true
                        }
                        (Data::Int(d), Data::Int(s)) => {
                            d[i * n..(i + 1) * n].copy_from_slice(s);
                            true
                        }
                        _ => false,
                    };
                if !placed {
                    return Err(err(format!("block output {} is {}, the stacked result is {}", nc + np + j, t.type_string(), dst.type_string())));
                }
            }
        }
        carries.truncate(nc);
        let mut results = Vec::with_capacity(result_types.len());
        for c in carries {
            results.push(match c {
                Slot::Owned(t) => t,
                Slot::Borrowed(t) => t.clone(),
                Slot::Empty => return Err(err("a carried value is missing".into())),
            });
        }
        results.extend(stacked_out);
        Ok(results)
    }
}

/// The attributes of one `repeat` node.
struct Repeat {
    block: usize,
    count: usize,
    carry: usize,
    stacked: usize,
    reverse: bool,
    prefetch: usize,
}

/// A block cut down to some of its nodes and outputs (the prologue or the last layer of a
/// prefetching `repeat`), with its plan.
struct Part {
    region: Region,
    plan: Plan,
    wanted: Vec<Value>,
}

impl Part {
    fn new(block: &Region, keep_node: impl Fn(NodeId) -> bool, keep_output: impl Fn(usize) -> bool) -> Part {
        let mut region = block.clone();
        region.order.retain(|&n| keep_node(n));
        region.outputs = block.outputs.iter().enumerate().filter(|(j, _)| keep_output(*j)).map(|(_, o)| o.clone()).collect();
        let wanted = region.outputs.iter().map(|o| o.value).collect();
        let plan = Plan::new(&region);
        Part { region, plan, wanted }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{ArgKind, Output};
    use crate::op::{BinaryOp, UnaryOp};

    /// `a -> exp -> neg -> add(neg, a)`: each intermediate dies right after its last reader.
    #[test]
    fn intermediates_are_freed_after_their_last_use() {
        let mut g = Graph::new("chain");
        let a = g.main.add_arg(TensorType::fixed(crate::dtype::DType::F32, &[3]), ArgKind::Input, Some("a"));
        let (e, n, s, dead) = {
            let mut b = g.main_builder();
            let e = b.push1(Op::Unary(UnaryOp::Exp), &[a]).expect("exp");
            let n = b.push1(Op::Unary(UnaryOp::Neg), &[e]).expect("neg");
            let dead = b.push1(Op::Unary(UnaryOp::Abs), &[n]).expect("abs");
            let s = b.push1(Op::Binary(BinaryOp::Add), &[n, a]).expect("add");
            (e, n, s, dead)
        };
        g.main.outputs.push(Output { name: Some("s".into()), value: s });
        let plan = Plan::new(&g.main);
        assert!(plan.unused_args.is_empty());
        assert_eq!(plan.free_after, vec![vec![], vec![e], vec![dead], vec![a, n]]);
        let out = Interpreter::new(&g, Precision::Exact)
            .run(&[Tensor::<f64>::from_vec(crate::dtype::DType::F32, vec![3], vec![0.0, 1.0, -1.0]).expect("tensor")])
            .expect("runs");
        let want: Vec<f64> = [0.0f64, 1.0, -1.0].iter().map(|x| x - x.exp()).collect();
        assert_eq!(out.outputs[0].to_f64_vec(), want);
    }
}
