//! Reverse-mode autodiff over the graph IR.
//!
//! A block is differentiated once, whatever the number of layers: its forward gains the
//! activations its backward reads as extra per-layer outputs, and a new backward block runs
//! under a reversed `repeat`. The `main` region is differentiated in place.

pub mod rules;

use crate::PassDiag;
use std::collections::HashMap;
use titan_ir::verify::{Loc, RegionRef};

use titan_ir::{ArgKind, BlockId, Builder, Graph, NodeId, Op, Region, TensorType, Value, ValueDef};

use crate::util::{accumulate, add_result, zeros};
use rules::{VjpArgs, differentiable, vjp, vjp_needs};

/// Where a stacked argument of a backward block gets its per-layer values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StackedSource {
    /// The forward repeat's stacked input number `i`.
    Input(usize),
    /// The forward block's saved activation number `k` (an extra forward output).
    Saved(usize),
}

/// The backward of one block and how the forward repeat must feed it.
#[derive(Clone, Debug)]
pub struct BlockGrad {
    pub bwd: Region,
    /// Values of the forward block appended to its outputs, one per-layer result each.
    pub saved: Vec<Value>,
    /// Sources of the backward's stacked args that follow the output cotangents.
    pub stacked_sources: Vec<StackedSource>,
    /// Invariant inputs (index among invariants) the backward reads.
    pub invariant_sources: Vec<usize>,
    /// Invariant inputs (index among invariants) that get an accumulated gradient.
    pub invariant_grads: Vec<usize>,
    /// Stacked inputs (index among stacked) that get a per-layer gradient, in output order.
    pub stacked_grads: Vec<usize>,
}

/// Statistics of the autodiff pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AutodiffStats {
    pub blocks_differentiated: usize,
    pub saved_per_layer: usize,
    pub backward_nodes: usize,
}

/// Accumulates cotangents keyed by primal value.
#[derive(Default)]
struct Cotangents {
    map: HashMap<Value, Value>,
}

impl Cotangents {
    fn add(&mut self, b: &mut Builder, primal: Value, g: Value) -> Result<(), String> {
        let acc = accumulate(b, self.map.get(&primal).copied(), g)?;
        self.map.insert(primal, acc);
        Ok(())
    }
}

/// How a primal value becomes available in the region the backward is emitted into.
trait PrimalMap {
    fn get(&mut self, b: &mut Builder, primal: &Region, v: Value) -> Result<Value, String>;
}

/// `main` is differentiated in place: primal values are used directly.
struct Identity;

impl PrimalMap for Identity {
    fn get(&mut self, _b: &mut Builder, _primal: &Region, v: Value) -> Result<Value, String> {
        Ok(v)
    }
}

/// In a block's backward, primal values become arguments: stacked/invariant inputs are
/// passed again, parameter gathers are re-issued (see [`BlockPrimals::regathered`]), every
/// other `all_gather` is re-issued on its saved operand (sequence parallelism saves the
/// sequence shard, not the gathered sequence, as Megatron-SP does), everything else is saved by
/// the forward.
struct BlockPrimals {
    n_carry: usize,
    n_stacked: usize,
    mapped: HashMap<Value, Value>,
    stacked_args: Vec<(Value, StackedSource)>,
    invariant_args: Vec<(Value, usize)>,
    saved: Vec<Value>,
}

impl BlockPrimals {
    /// Whether `v` is a parameter gather: computed from the block's stacked/invariant arguments
    /// (the layer's parameter shards) by `all_gather`, `take_shard`, `reshape` and `broadcast`
    /// only, with at least one `all_gather`/`take_shard`. Such values are re-issued in the
    /// backward instead of saved: FSDP's reshard-after-forward (the gathered weights of every
    /// layer would otherwise stay alive from the forward to the backward) and the kv-head slice
    /// of replicated kv weights. The backward then issues its own all-gathers, in its order,
    /// the same on every rank.
    fn regathered(&self, primal: &Region, v: Value) -> bool {
        fn walk(primal: &Region, v: Value, first_param: usize, collective: &mut bool) -> bool {
            match primal.value(v).def {
                ValueDef::Arg(i) => i as usize >= first_param,
                ValueDef::Result { node: n, .. } => {
                    let node = primal.node(n);
                    match node.op {
                        Op::AllGather { .. } | Op::TakeShard { .. } => *collective = true,
                        Op::Reshape | Op::Broadcast { .. } => {}
                        _ => return false,
                    }
                    node.inputs.iter().all(|&x| walk(primal, x, first_param, collective))
                }
            }
        }
        let mut collective = false;
        walk(primal, v, self.n_carry, &mut collective) && collective
    }
}

impl PrimalMap for BlockPrimals {
    fn get(&mut self, b: &mut Builder, primal: &Region, v: Value) -> Result<Value, String> {
        if let Some(&m) = self.mapped.get(&v) {
            return Ok(m);
        }
        if let ValueDef::Result { node: n, index: 0 } = primal.value(v).def
            && (self.regathered(primal, v) || matches!(primal.node(n).op, Op::AllGather { .. }))
        {
            let node = primal.node(n);
            let ins = node.inputs.iter().map(|&x| self.get(b, primal, x)).collect::<Result<Vec<_>, _>>()?;
            let r = b.push_typed(node.op.clone(), &ins, primal.ty(v).clone())?;
            if let Some(name) = primal.value(v).name.clone() {
                b.name(r, &name);
            }
            self.mapped.insert(v, r);
            return Ok(r);
        }
        let ty = primal.ty(v).clone();
        let name = primal.value(v).name.clone();
        let arg = b.region.add_arg(ty, ArgKind::Block, name.as_deref());
        match primal.value(v).def {
            ValueDef::Arg(i) if (i as usize) >= self.n_carry && (i as usize) < self.n_carry + self.n_stacked => {
                self.stacked_args.push((arg, StackedSource::Input(i as usize - self.n_carry)));
            }
            ValueDef::Arg(i) if (i as usize) >= self.n_carry + self.n_stacked => {
                self.invariant_args.push((arg, i as usize - self.n_carry - self.n_stacked));
            }
            _ => {
                self.stacked_args.push((arg, StackedSource::Saved(self.saved.len())));
                self.saved.push(v);
            }
        }
        self.mapped.insert(v, arg);
        Ok(arg)
    }
}

/// Emits the VJP of one `repeat` node: `(builder, node, result cotangents) -> input cotangents`.
type RepeatVjp<'a> = dyn FnMut(&mut Builder, NodeId, &[Option<Value>]) -> Result<Vec<Option<Value>>, PassDiag> + 'a;

/// Walk `primal`'s nodes in reverse, emitting VJPs through `b`. `repeat_vjp` handles repeat nodes.
fn backprop(
    primal: &Region,
    at: RegionRef,
    b: &mut Builder,
    cot: &mut Cotangents,
    pm: &mut dyn PrimalMap,
    repeat_vjp: &mut RepeatVjp<'_>,
) -> Result<(), PassDiag> {
    for &n in primal.order.iter().rev() {
        let node = primal.node(n);
        let dy: Vec<Option<Value>> = node.results.iter().map(|r| cot.map.get(r).copied()).collect();
        if dy.iter().all(Option::is_none) {
            continue;
        }
        let dx = if matches!(node.op, Op::Repeat { .. }) {
            repeat_vjp(b, n, &dy).map_err(|e| e.at(Loc::Node(at, n)))?
        } else {
            let need = vjp_needs(&node.op, node.inputs.len(), node.results.len());
            let x: Vec<Option<Value>> =
                node.inputs.iter().zip(&need.inputs).map(|(&v, &w)| w.then(|| pm.get(b, primal, v)).transpose()).collect::<Result<_, _>>()?;
            let y: Vec<Option<Value>> =
                node.results.iter().zip(&need.results).map(|(&v, &w)| w.then(|| pm.get(b, primal, v)).transpose()).collect::<Result<_, _>>()?;
            let x_ty: Vec<TensorType> = node.inputs.iter().map(|&v| primal.ty(v).clone()).collect();
            let y_ty: Vec<TensorType> = node.results.iter().map(|&v| primal.ty(v).clone()).collect();
            let args = VjpArgs { x: &x, y: &y, x_ty: &x_ty, y_ty: &y_ty, dy: &dy };
            vjp(&node.op, &args, b).map_err(|e| e.context(format_args!("backward of node {n} (`{}`)", node.op.name())).at(Loc::Node(at, n)))?
        };
        for (&input, g) in node.inputs.iter().zip(dx) {
            if let Some(g) = g
                && differentiable(primal.ty(input).dtype)
            {
                cot.add(b, input, g)?;
            }
        }
    }
    Ok(())
}

/// Derive the backward of `block` as repeated with `n_carry` carried and `n_stacked` stacked args.
pub fn differentiate_block(g: &Graph, block: BlockId, n_carry: usize, n_stacked: usize) -> Result<BlockGrad, PassDiag> {
    let fwd = g.block(block);
    let n_args = fwd.args.len();
    for i in 0..n_carry {
        if !differentiable(fwd.ty(fwd.args[i].value).dtype) {
            return Err(PassDiag::unsupported(format!("@{}: a carried integer value cannot be differentiated (not supported yet)", fwd.name))
                .at(Loc::Arg(RegionRef::Block(block), i)));
        }
    }
    let mut bwd = Region::new(&format!("{}_bwd", fwd.name));
    let mut pm = BlockPrimals { n_carry, n_stacked, mapped: HashMap::new(), stacked_args: vec![], invariant_args: vec![], saved: vec![] };
    let mut cot = Cotangents::default();
    // Seeds: cotangents of every output, carried ones first.
    let mut carry_seed_args = Vec::new();
    let mut stacked_seed_args = Vec::new();
    for (i, o) in fwd.outputs.iter().enumerate() {
        let ty = fwd.ty(o.value).clone();
        let a = bwd.add_arg(ty.clone(), ArgKind::Block, None);
        if i < n_carry {
            carry_seed_args.push(a);
        } else {
            stacked_seed_args.push(a);
        }
        if differentiable(ty.dtype) {
            let mut b = Builder::new(&mut bwd, &g.dims, &g.blocks);
            cot.add(&mut b, o.value, a)?;
        }
    }
    // Invariant inputs that need gradients get a carried accumulator.
    let invariant_grads: Vec<usize> =
        (n_carry + n_stacked..n_args).filter(|&i| differentiable(fwd.ty(fwd.args[i].value).dtype)).map(|i| i - n_carry - n_stacked).collect();
    let acc_args: Vec<Value> = invariant_grads
        .iter()
        .map(|&j| {
            let ty = fwd.ty(fwd.args[n_carry + n_stacked + j].value).clone();
            bwd.add_arg(ty, ArgKind::Block, None)
        })
        .collect();
    {
        let mut b = Builder::new(&mut bwd, &g.dims, &g.blocks);
        let mut no_repeat = |_: &mut Builder, n: NodeId, _: &[Option<Value>]| -> Result<Vec<Option<Value>>, PassDiag> {
            Err(PassDiag::unsupported(format!("node {n}: repeat inside a block is not supported yet")))
        };
        backprop(fwd, RegionRef::Block(block), &mut b, &mut cot, &mut pm, &mut no_repeat).map_err(|e| e.context(format_args!("@{}", fwd.name)))?;
    }
    // Outputs: carried grads, accumulators, then per-layer grads of stacked inputs.
    let mut b = Builder::new(&mut bwd, &g.dims, &g.blocks);
    let mut outputs = Vec::new();
    for i in 0..n_carry {
        let a = fwd.args[i].value;
        let gv = match cot.map.get(&a) {
            Some(&v) => v,
            None => zeros(&mut b, fwd.ty(a))?,
        };
        outputs.push(gv);
    }
    for (k, &j) in invariant_grads.iter().enumerate() {
        let a = fwd.args[n_carry + n_stacked + j].value;
        let gv = match cot.map.get(&a) {
            Some(&v) => b.push1(Op::Binary(titan_ir::BinaryOp::Add), &[acc_args[k], v])?,
            None => acc_args[k],
        };
        outputs.push(gv);
    }
    let mut stacked_grads = Vec::new();
    for i in n_carry..n_carry + n_stacked {
        let a = fwd.args[i].value;
        if !differentiable(fwd.ty(a).dtype) {
            continue;
        }
        let gv = match cot.map.get(&a) {
            Some(&v) => v,
            None => zeros(&mut b, fwd.ty(a))?,
        };
        stacked_grads.push(i - n_carry);
        outputs.push(gv);
    }
    bwd.outputs = outputs.into_iter().map(|value| titan_ir::Output { name: None, value }).collect();
    // Order the arguments as repeat expects: carry, stacked, invariant.
    let mut order: Vec<Value> = carry_seed_args.clone();
    order.extend(&acc_args);
    order.extend(&stacked_seed_args);
    order.extend(pm.stacked_args.iter().map(|(v, _)| *v));
    order.extend(pm.invariant_args.iter().map(|(v, _)| *v));
    reorder_args(&mut bwd, &order);
    Ok(BlockGrad {
        bwd,
        saved: pm.saved,
        stacked_sources: pm.stacked_args.iter().map(|(_, s)| *s).collect(),
        invariant_sources: pm.invariant_args.iter().map(|(_, j)| *j).collect(),
        invariant_grads,
        stacked_grads,
    })
}

/// Put the region's arguments in `order` (a permutation of its argument values).
fn reorder_args(region: &mut Region, order: &[Value]) {
    let old = std::mem::take(&mut region.args);
    for (i, &v) in order.iter().enumerate() {
        let arg = old.iter().find(|a| a.value == v).expect("invariant: order is a permutation of the args").clone();
        region.values[v.index()].def = ValueDef::Arg(i as u32);
        region.args.push(arg);
    }
}

/// What the main-region VJP of one repeat node needs to know.
struct RepeatGrad {
    bwd_block: BlockId,
    grad: BlockGrad,
    /// Results of the forward repeat before saved activations were appended.
    n_results: usize,
}

/// Differentiate `g.main` with respect to every `state` argument, seeding the output `loss`
/// with 1. Returns the gradient of each state argument (in argument order; `None` for
/// non-float or unused ones) and statistics.
pub fn differentiate_main(g: &mut Graph, loss_output: &str) -> Result<(Vec<Option<Value>>, AutodiffStats), PassDiag> {
    let mut stats = AutodiffStats::default();
    // 1. Differentiate each repeated block once and make its forward save what the backward reads.
    let mut repeats: HashMap<NodeId, RepeatGrad> = HashMap::new();
    let mut done: HashMap<BlockId, (BlockId, BlockGrad)> = HashMap::new();
    let order = g.main.order.clone();
    for n in order {
        let Op::Repeat { block, count, carry, stacked, prefetch, .. } = g.main.node(n).op.clone() else { continue };
        if prefetch > 0 {
            return Err(PassDiag::precondition(format!(
                "node {n}: `repeat` with prefetched carries cannot be differentiated; run prefetch-next-layer after autodiff"
            ))
            .at(Loc::Node(RegionRef::Main, n)));
        }
        if let std::collections::hash_map::Entry::Vacant(slot) = done.entry(block) {
            let grad = differentiate_block(g, block, carry as usize, stacked as usize)?;
            stats.blocks_differentiated += 1;
            stats.saved_per_layer += grad.saved.len();
            let fwd = &mut g.blocks[block.index()];
            for &s in &grad.saved {
                fwd.outputs.push(titan_ir::Output { name: None, value: s });
            }
            let bwd_id = g.add_block(grad.bwd.clone());
            slot.insert((bwd_id, grad));
        }
        let (bwd_block, grad) = done[&block].clone();
        let n_results = g.main.node(n).results.len();
        for &s in &grad.saved {
            let t = g.block(block).ty(s).clone();
            let mut shape = vec![titan_ir::Dim::Fixed(u64::from(count))];
            shape.extend(t.shape.iter().cloned());
            add_result(&mut g.main, n, TensorType::new(t.dtype, shape));
        }
        repeats.insert(n, RepeatGrad { bwd_block, grad, n_results });
    }
    // 2. Differentiate main in place.
    let primal = g.main.clone();
    let loss = primal
        .outputs
        .iter()
        .find(|o| o.name.as_deref() == Some(loss_output))
        .map(|o| o.value)
        .ok_or_else(|| PassDiag::precondition(format!("the model has no `{loss_output}` output to differentiate")))?;
    if primal.ty(loss).rank() != 0 || !primal.ty(loss).dtype.is_float() {
        return Err(PassDiag::precondition(format!("output `{loss_output}` must be a float scalar, found {}", primal.ty(loss))));
    }
    let nodes_before = g.main.order.len();
    let mut cot = Cotangents::default();
    let (main, dims, blocks) = (&mut g.main, &g.dims, &g.blocks);
    let mut b = Builder::new(main, dims, blocks);
    let one = crate::util::scalar(&mut b, 1.0, primal.ty(loss).dtype)?;
    cot.add(&mut b, loss, one)?;
    let mut repeat_vjp = |b: &mut Builder, n: NodeId, dy: &[Option<Value>]| -> Result<Vec<Option<Value>>, PassDiag> {
        let rg = repeats.get(&n).ok_or_else(|| format!("node {n}: repeat was not prepared for differentiation"))?;
        let node = primal.node(n);
        let Op::Repeat { count, carry, stacked, reverse, .. } = node.op else {
            return Err(PassDiag::invalid(format!("node {n} is not a repeat")));
        };
        let (nc, ns) = (carry as usize, stacked as usize);
        let mut carry_in = Vec::new();
        for (&r, &d) in node.results.iter().zip(dy).take(nc) {
            carry_in.push(match d {
                Some(v) => v,
                None => zeros(b, primal.ty(r))?,
            });
        }
        for &j in &rg.grad.invariant_grads {
            let inp = node.inputs[nc + ns + j];
            carry_in.push(zeros(b, primal.ty(inp))?);
        }
        let mut stacked_in = Vec::new();
        for (&r, &d) in node.results.iter().zip(dy).take(rg.n_results).skip(nc) {
            stacked_in.push(match d {
                Some(v) => v,
                None => zeros(b, primal.ty(r))?,
            });
        }
        for s in &rg.grad.stacked_sources {
            stacked_in.push(match *s {
                StackedSource::Input(i) => node.inputs[nc + i],
                StackedSource::Saved(k) => node.results[rg.n_results + k],
            });
        }
        let invariants: Vec<Value> = rg.grad.invariant_sources.iter().map(|&j| node.inputs[nc + ns + j]).collect();
        let mut inputs = carry_in.clone();
        inputs.extend(&stacked_in);
        inputs.extend(&invariants);
        let op = Op::Repeat { block: rg.bwd_block, count, carry: carry_in.len() as u32, stacked: stacked_in.len() as u32, reverse: !reverse, prefetch: 0 };
        let r = b.push(op, &inputs)?;
        let mut dx = vec![None; node.inputs.len()];
        for (i, d) in dx.iter_mut().enumerate().take(nc) {
            *d = Some(r[i]);
        }
        for (k, &j) in rg.grad.invariant_grads.iter().enumerate() {
            dx[nc + ns + j] = Some(r[nc + k]);
        }
        let base = nc + rg.grad.invariant_grads.len();
        for (k, &i) in rg.grad.stacked_grads.iter().enumerate() {
            dx[nc + i] = Some(r[base + k]);
        }
        Ok(dx)
    };
    backprop(&primal, RegionRef::Main, &mut b, &mut cot, &mut Identity, &mut repeat_vjp)?;
    stats.backward_nodes = g.main.order.len() - nodes_before;
    let grads = primal
        .args
        .iter()
        .map(|a| match a.kind {
            ArgKind::State(_) if differentiable(primal.ty(a.value).dtype) => cot.map.get(&a.value).copied(),
            _ => None,
        })
        .collect();
    Ok((grads, stats))
}
