//! Grouping: decides which nodes of one region run in which kernel, following the rules of
//! the [module documentation](super). Builds nothing; [`super::outline`] turns the groups into
//! kernel bodies.

use crate::PassDiag;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};

use titan_ir::{DimTable, KernelKind, NodeId, Op, Region, TensorType, Value, ValueDef};

/// The iteration space of a fusible op, or of a group of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Space {
    /// Rank-0 computation: fits any group.
    Scalar,
    /// `elems` elements; `row` is the row length when a row op (rmsnorm, rope, cross
    /// entropy, last-axis reduction) is part of the group.
    Elems { elems: u64, row: Option<u64> },
    /// A reduction over the leading axes of an `elems`-element operand with rows of `d` (one
    /// result per column: float8's per-column amax over the tokens) and the pointwise ops
    /// producing its operand: a column kernel, which reads the rows at bandwidth for any `d`.
    /// Row ops never join it (their cross-block column sums are the slow row-kernel path).
    Cols { elems: u64, d: u64 },
    /// Never shares a kernel (non-scalar constants, reductions over inner axes).
    Alone,
}

impl Space {
    /// The space of a group holding both, or `None` when they are incompatible.
    pub fn join(self, other: Space) -> Option<Space> {
        match (self, other) {
            (Space::Alone, _) | (_, Space::Alone) => None,
            (Space::Scalar, s) | (s, Space::Scalar) => Some(s),
            (Space::Cols { elems: a, d: x }, Space::Cols { elems: b, d: y }) => (a == b && x == y).then_some(self),
            (c @ Space::Cols { elems: a, .. }, Space::Elems { elems: b, row: None })
            | (Space::Elems { elems: b, row: None }, c @ Space::Cols { elems: a, .. }) => (a == b).then_some(c),
            (Space::Cols { .. }, Space::Elems { .. }) | (Space::Elems { .. }, Space::Cols { .. }) => None,
            (Space::Elems { elems: a, row: ra }, Space::Elems { elems: b, row: rb }) => {
                let rows_agree = match (ra, rb) {
                    (Some(x), Some(y)) => x == y,
                    _ => true,
                };
                if a == b && rows_agree {
                    return Some(Space::Elems { elems: a, row: ra.or(rb) });
                }
                // Per-row values (one element per row, e.g. a row amax and the float8 scale
                // computed from it) join the row group they belong to: the row kernel holds
                // them in registers between its passes over the row.
                match (ra, rb) {
                    (Some(r), None) if b.checked_mul(r) == Some(a) => Some(Space::Elems { elems: a, row: ra }),
                    (None, Some(r)) if a.checked_mul(r) == Some(b) => Some(Space::Elems { elems: b, row: rb }),
                    _ => None,
                }
            }
        }
    }
}

/// What the fusion pass does with one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Stays a region-level node: `reshape` (a view), a leading-axis `slice` (an offset view) or
    /// `concat` (operands placed into one buffer), `repeat`, an existing `kernel`, a
    /// collective (`all_gather`, `reduce_scatter`, `all_reduce`) or a rank-local
    /// `take_shard`/`place_shard`.
    Keep,
    /// A rank-0 `constant`: copied into every fused/optimizer kernel that reads it.
    ScalarConstant,
    /// The only op of a kernel of this kind.
    Single(KernelKind),
    /// Part of the region's one optimizer kernel (`adamw`, `lr_schedule`).
    Optimizer,
    /// Fusible into a `fused` kernel with this iteration space.
    Fusible(Space),
}

fn numel(t: &TensorType, dims: &DimTable) -> Result<u64, String> {
    t.numel(dims).ok_or_else(|| format!("a dimension of {t} is not bound; bind it in the graph's `dims`"))
}

fn last_dim(t: &TensorType, dims: &DimTable) -> Result<u64, String> {
    match t.shape.last() {
        Some(d) => titan_ir::shape::resolve_dim(d, dims).ok_or_else(|| format!("dimension `{d}` is not bound; bind it in the graph's `dims`")),
        None => Ok(1),
    }
}

/// How the pass treats `op` with these operand and result types.
pub fn classify(op: &Op, ins: &[&TensorType], outs: &[&TensorType], dims: &DimTable) -> Result<Class, String> {
    let out0 = outs.first().copied();
    let out_elems = |i: usize| -> Result<u64, String> {
        match outs.get(i) {
            Some(t) => numel(t, dims),
            None => Err(format!("`{}` has no result", op.name())),
        }
    };
    let in0 = || ins.first().copied().ok_or_else(|| format!("`{}` has no operand", op.name()));
    let rows_of = |t: &TensorType| -> Result<Class, String> { Ok(Class::Fusible(Space::Elems { elems: numel(t, dims)?, row: Some(last_dim(t, dims)?) })) };
    Ok(match op {
        Op::Reshape | Op::Repeat { .. } | Op::Kernel { .. } => Class::Keep,
        // Collectives (and the rank-local shard ops) are schedule steps of their own: they
        // never join a kernel, and the convexity check sees paths through them.
        Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::AllReduce { .. }
        | Op::TakeShard { .. }
        | Op::PlaceShard { .. }
        | Op::RingShift { .. }
        | Op::RingSlice { .. }
        | Op::RingConcat { .. } => Class::Keep,
        // A slice over the leading axis is an offset view and a concat its operands written into
        // offsets of one buffer (the memory plan's `View`); cutting an inner axis would need a
        // strided copy kernel.
        Op::Slice { axis, .. } | Op::Concat { axis } => {
            let t = match op {
                Op::Slice { .. } => in0()?,
                _ => out0.ok_or_else(|| format!("`{}` has no result", op.name()))?,
            };
            let outer = t.shape.iter().take(*axis as usize).map(|d| titan_ir::shape::resolve_dim(d, dims)).collect::<Option<Vec<u64>>>();
            match outer {
                Some(o) if o.iter().all(|&d| d == 1) => Class::Keep,
                Some(_) => {
                    return Err(format!(
                        "`{}` along axis {axis} of {t}, an inner axis, is not supported yet in a kernel graph (only along the leading axis or behind dims of size 1)",
                        op.name()
                    ));
                }
                None => return Err(format!("a dimension of {t} is not bound; bind it in the graph's `dims`")),
            }
        }
        Op::Linear | Op::Matmul { .. } | Op::ScaledMatmul { .. } => Class::Single(KernelKind::Gemm),
        Op::LinearF8 { .. } => return Err("`linear_f8` reaches fusion unexpanded; `autodiff` expands it (or run the `float8` pass before `autodiff`)".into()),
        Op::Attention { .. } => Class::Single(KernelKind::Attention),
        Op::AttentionBwd { .. } => Class::Single(KernelKind::AttentionBwd),
        Op::Embedding | Op::Gather | Op::GatherShard => Class::Single(KernelKind::Gather),
        Op::ScatterAdd | Op::ScatterAddShard => Class::Single(KernelKind::ScatterAdd),
        Op::AdamW(_) | Op::LrSchedule(_) => Class::Optimizer,
        Op::Constant { .. } => {
            if out0.is_some_and(|t| t.rank() == 0) {
                Class::ScalarConstant
            } else {
                Class::Fusible(Space::Alone)
            }
        }
        Op::Unary(_) | Op::Binary(_) | Op::Cast | Op::Fp8Scale { .. } | Op::Broadcast { .. } | Op::Transpose { .. } => {
            if out0.is_some_and(|t| t.rank() == 0) {
                Class::Fusible(Space::Scalar)
            } else {
                Class::Fusible(Space::Elems { elems: out_elems(0)?, row: None })
            }
        }
        Op::Reduce { axes, .. } => {
            let x = in0()?;
            if out0.is_some_and(|t| t.rank() == 0) {
                // A full reduction: its result is complete only when the kernel ends.
                Class::Fusible(Space::Elems { elems: numel(x, dims)?, row: None })
            } else if axes.as_slice() == [x.rank().saturating_sub(1)] {
                rows_of(x)?
            } else if is_leading(axes, x.rank()) {
                let elems = numel(x, dims)?;
                let mut rows = 1u64;
                for dim in &x.shape[..axes.len()] {
                    rows *= titan_ir::shape::resolve_dim(dim, dims).ok_or_else(|| format!("dimension `{dim}` is not bound; bind it in the graph's `dims`"))?;
                }
                Class::Fusible(elems.checked_div(rows).map_or(Space::Alone, |d| Space::Cols { elems, d }))
            } else {
                Class::Fusible(Space::Alone)
            }
        }
        Op::RmsNorm { .. } | Op::RmsNormBwd { .. } | Op::Rope(_) | Op::CrossEntropy | Op::CrossEntropyBwd => rows_of(in0()?)?,
        // The vocabulary-parallel cross-entropy's row ops (rows of the logits shard, of the
        // shards' statistics for `cross_entropy_combine`).
        Op::CrossEntropyStats | Op::CrossEntropyStatsBwd | Op::CrossEntropyCombine => rows_of(in0()?)?,
    })
}

/// Whether `axes` are the leading axes of a rank-`rank` operand, not all of them: a
/// reduction over the rows, one result per column.
fn is_leading(axes: &[usize], rank: usize) -> bool {
    !axes.is_empty() && axes.len() < rank && axes.iter().enumerate().all(|(i, &a)| a == i)
}

/// The results of `op` that reduce across rows (or to a scalar): complete only when the
/// whole kernel has run, so no op of the same kernel may read them.
pub fn grid_reduced_results(op: &Op, ins: &[&TensorType], outs: &[&TensorType]) -> Vec<usize> {
    match op {
        Op::CrossEntropy | Op::CrossEntropyCombine => vec![0],
        Op::RmsNormBwd { .. } => vec![1],
        Op::Reduce { .. } if outs.first().is_some_and(|t| t.rank() == 0) && ins.first().is_some_and(|t| t.rank() > 0) => vec![0],
        Op::Reduce { axes, .. } if ins.first().is_some_and(|t| is_leading(axes, t.rank())) => vec![0],
        _ => vec![],
    }
}

/// One kernel-to-be: its kind and members in program order.
#[derive(Clone, Debug, PartialEq)]
pub struct Group {
    pub kind: KernelKind,
    pub members: Vec<NodeId>,
    pub space: Space,
    /// Whether other fusible ops may still join (only `fused` groups of a non-`Alone` space).
    pub mergeable: bool,
}

/// A unit of the fused region's program: a kernel-to-be or a node left in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Group(usize),
    Keep(NodeId),
}

/// The result of grouping one region.
#[derive(Clone, Debug)]
pub struct Grouping {
    pub groups: Vec<Group>,
    /// The group of each node (`None`: kept in place, or a copied scalar constant).
    pub group_of: Vec<Option<usize>>,
    /// The region-level program after fusion, in a topological order.
    pub units: Vec<Unit>,
}

/// Analysis tables of one region.
struct Grouper<'r> {
    region: &'r Region,
    /// Position of each live node in the program order.
    pos: Vec<Option<usize>>,
    /// The live nodes reading each value, in program order (a node reading a value twice is listed once).
    users: Vec<Vec<NodeId>>,
    /// The node defining each value.
    producer: Vec<Option<NodeId>>,
    /// Whether a value is a region output or update.
    escapes: Vec<bool>,
    /// Whether a value reduces across rows ([`grid_reduced_results`]).
    grid_reduced: Vec<bool>,
    class: Vec<Option<Class>>,
    /// Whether a node joins the consumer that reads it rather than its producer: a `broadcast`
    /// to more elements than it reads (rule 9), or a recomputed clone (rule 10).
    pulled: Vec<bool>,
    groups: Vec<Option<Group>>,
    group_of: Vec<Option<usize>>,
}

impl<'r> Grouper<'r> {
    fn new(region: &'r Region, dims: &DimTable, recomputed: &HashSet<NodeId>) -> Result<Grouper<'r>, String> {
        let nv = region.values.len();
        let nn = region.nodes.len();
        let mut g = Grouper {
            region,
            pos: vec![None; nn],
            users: vec![Vec::new(); nv],
            producer: vec![None; nv],
            escapes: vec![false; nv],
            grid_reduced: vec![false; nv],
            class: vec![None; nn],
            pulled: vec![false; nn],
            groups: Vec::new(),
            group_of: vec![None; nn],
        };
        let bad_value = |v: Value| format!("@{} refers to value #{} which does not exist", region.name, v.0);
        for (p, &n) in region.order.iter().enumerate() {
            let node = region.nodes.get(n.index()).ok_or_else(|| format!("@{} lists node {n} which does not exist", region.name))?;
            g.pos[n.index()] = Some(p);
            for &v in &node.inputs {
                let us = g.users.get_mut(v.index()).ok_or_else(|| bad_value(v))?;
                if us.last() != Some(&n) {
                    us.push(n);
                }
            }
            for &r in &node.results {
                *g.producer.get_mut(r.index()).ok_or_else(|| bad_value(r))? = Some(n);
            }
            let ins: Vec<&TensorType> = node.inputs.iter().map(|&v| region.ty(v)).collect();
            let outs: Vec<&TensorType> = node.results.iter().map(|&v| region.ty(v)).collect();
            for i in grid_reduced_results(&node.op, &ins, &outs) {
                if let Some(&r) = node.results.get(i) {
                    g.grid_reduced[r.index()] = true;
                }
            }
            g.class[n.index()] = Some(classify(&node.op, &ins, &outs, dims).map_err(|e| format!("@{}, node {n} (`{}`): {e}", region.name, node.op.name()))?);
            if let (Op::Broadcast { .. }, [i], [o]) = (&node.op, ins.as_slice(), outs.as_slice()) {
                g.pulled[n.index()] = numel(o, dims)? > numel(i, dims)?;
            }
            if recomputed.contains(&n) {
                g.pulled[n.index()] = true;
            }
        }
        for v in region.outputs.iter().map(|o| o.value).chain(region.updates.iter().map(|u| u.value)) {
            *g.escapes.get_mut(v.index()).ok_or_else(|| bad_value(v))? = true;
        }
        Ok(g)
    }

    fn node_class(&self, n: NodeId) -> Option<Class> {
        self.class.get(n.index()).copied().flatten()
    }

    fn is_scalar_constant(&self, v: Value) -> bool {
        self.producer[v.index()].is_some_and(|p| self.node_class(p) == Some(Class::ScalarConstant))
    }

    fn new_group(&mut self, kind: KernelKind, members: Vec<NodeId>, space: Space) -> usize {
        let id = self.groups.len();
        for &m in &members {
            self.group_of[m.index()] = Some(id);
        }
        let mergeable = kind == KernelKind::Fused && space != Space::Alone;
        self.groups.push(Some(Group { kind, members, space, mergeable }));
        id
    }

    fn group(&self, id: usize) -> &Group {
        self.groups[id].as_ref().expect("invariant: only live groups are referenced")
    }

    /// Whether the set `members` is convex in the kernel graph: no path leaves it and comes
    /// back through nodes outside it. A path entering another group continues from every member
    /// of that group, since a kernel's outputs wait for all of its inputs.
    fn convex(&self, inside: &dyn Fn(NodeId) -> bool, members: &[NodeId]) -> bool {
        let mut seen: HashSet<NodeId> = HashSet::new();
        let mut stack: Vec<NodeId> = Vec::new();
        let push_users = |n: NodeId, stack: &mut Vec<NodeId>, seen: &mut HashSet<NodeId>| {
            for &r in &self.region.nodes[n.index()].results {
                for &u in &self.users[r.index()] {
                    if seen.insert(u) {
                        stack.push(u);
                    }
                }
            }
        };
        for &m in members {
            for &r in &self.region.nodes[m.index()].results {
                for &u in &self.users[r.index()] {
                    if !inside(u) && seen.insert(u) {
                        stack.push(u);
                    }
                }
            }
        }
        let mut expanded: HashSet<usize> = HashSet::new();
        while let Some(x) = stack.pop() {
            if inside(x) {
                return false;
            }
            match self.group_of[x.index()] {
                Some(g) => {
                    if expanded.insert(g) {
                        for &y in &self.group(g).members {
                            seen.insert(y);
                            push_users(y, &mut stack, &mut seen);
                        }
                    }
                }
                None => push_users(x, &mut stack, &mut seen),
            }
        }
        true
    }

    /// The values of group `g` complete only when its kernel ends: its row-crossing reductions
    /// and what its members compute from them (a column kernel's per-column values, such as the
    /// float8 scale of a column amax).
    fn post_values(&self, g: usize) -> HashSet<Value> {
        let mut post = HashSet::new();
        for &m in &self.group(g).members {
            let node = &self.region.nodes[m.index()];
            let derived = node.inputs.iter().any(|v| post.contains(v));
            for &r in &node.results {
                if derived || self.grid_reduced[r.index()] {
                    post.insert(r);
                }
            }
        }
        post
    }

    /// Whether an op of one of the groups reads a value of the other that is complete only when
    /// the other's kernel ends ([`Grouper::post_values`]).
    fn reads_grid_reduced(&self, a: usize, b: usize) -> bool {
        let crosses = |from: usize, to: usize| {
            let post = self.post_values(from);
            !post.is_empty() && self.group(to).members.iter().any(|&m| self.region.nodes[m.index()].inputs.iter().any(|v| post.contains(v)))
        };
        crosses(a, b) || crosses(b, a)
    }

    /// Whether `per_col` (a group of `d` elements) only computes per-column values from what the
    /// column group `cols` reduces: every non-scalar value its members read from outside it is
    /// one of `cols`'s [`Grouper::post_values`]. The column kernel then computes them after
    /// its last pass (float8's `fp8_scale` and `recip` of a column amax), instead of a kernel of
    /// a few thousand elements launched after it.
    fn is_post_column(&self, cols: usize, per_col: usize) -> bool {
        let post = self.post_values(cols);
        let members = &self.group(per_col).members;
        let mut reads_post = false;
        for &m in members {
            for &v in &self.region.nodes[m.index()].inputs {
                let made_here = self.producer[v.index()].is_some_and(|p| self.group_of[p.index()] == Some(per_col));
                if made_here || self.region.ty(v).rank() == 0 {
                    continue;
                }
                if !post.contains(&v) {
                    return false;
                }
                reads_post = true;
            }
        }
        reads_post
    }

    /// Whether group `g` holds a `reduce` whose result crosses rows (to a scalar or over the
    /// leading axes).
    fn reduces_across_rows(&self, g: usize) -> bool {
        self.group(g).members.iter().any(|&m| {
            let node = &self.region.nodes[m.index()];
            matches!(node.op, Op::Reduce { .. }) && node.results.iter().any(|r| self.grid_reduced[r.index()])
        })
    }

    /// The space of `a` and `b` merged, if they may merge.
    fn can_merge(&self, a: usize, b: usize) -> Option<Space> {
        let (ga, gb) = (self.group(a), self.group(b));
        if a == b || !ga.mergeable || !gb.mergeable {
            return None;
        }
        // A column kernel takes the per-column values computed from its reduction (rule 5's
        // exception); otherwise no kernel reads what another part of it reduces across rows.
        let per_col =
            |x: &Group, y: &Group| matches!((x.space, y.space), (Space::Cols { elems, d }, Space::Elems { elems: n, row: None }) if n == d && n != elems);
        let space = if per_col(ga, gb) && self.is_post_column(a, b) {
            ga.space
        } else if per_col(gb, ga) && self.is_post_column(b, a) {
            gb.space
        } else {
            let space = ga.space.join(gb.space)?;
            if self.reads_grid_reduced(a, b) {
                return None;
            }
            space
        };
        let members: Vec<NodeId> = ga.members.iter().chain(&gb.members).copied().collect();
        let inside = |n: NodeId| matches!(self.group_of[n.index()], Some(g) if g == a || g == b);
        self.convex(&inside, &members).then_some(space)
    }

    /// Move `b`'s members into `a`.
    fn merge(&mut self, a: usize, b: usize, space: Space) {
        let gb = self.groups[b].take().expect("invariant: merging a live group");
        for &m in &gb.members {
            self.group_of[m.index()] = Some(a);
        }
        let pos = &self.pos;
        let ga = self.groups[a].as_mut().expect("invariant: merging into a live group");
        ga.members.extend(gb.members);
        ga.members.sort_by_key(|m| pos[m.index()]);
        ga.space = space;
    }

    /// The optimizer group: every `adamw` and `lr_schedule`, plus the pointwise producers of
    /// each gradient operand whose results only the group reads.
    fn optimizer_group(&mut self) -> Result<(), PassDiag> {
        let region = self.region;
        let core: Vec<NodeId> = region.order.iter().copied().filter(|&n| self.node_class(n) == Some(Class::Optimizer)).collect();
        if core.is_empty() {
            return Ok(());
        }
        let mut inside: HashSet<NodeId> = core.iter().copied().collect();
        let mut work: Vec<Value> = core
            .iter()
            .filter(|&&n| matches!(region.nodes[n.index()].op, Op::AdamW(_)))
            .filter_map(|&n| region.nodes[n.index()].inputs.get(1).copied())
            .collect();
        while let Some(v) = work.pop() {
            let Some(p) = self.producer[v.index()] else { continue };
            let node = &region.nodes[p.index()];
            let only_ours = node.results.iter().all(|r| !self.escapes[r.index()] && self.users[r.index()].iter().all(|u| inside.contains(u)));
            let rank0 = region.ty(v).rank() == 0;
            if inside.contains(&p) || rank0 || !node.op.is_pointwise() || !only_ours {
                continue;
            }
            inside.insert(p);
            work.extend(node.inputs.iter().copied().filter(|&i| region.ty(i).rank() > 0));
        }
        // The casts of the new masters (`compute-copies`): the kernel writes each compute copy
        // from the f32 value it has just computed, instead of a kernel reading the master back.
        let mut copies: Vec<NodeId> = Vec::new();
        for &n in &core {
            let node = &region.nodes[n.index()];
            if !matches!(node.op, Op::AdamW(_)) {
                continue;
            }
            for u in node.results.first().map(|r| self.users[r.index()].clone()).unwrap_or_default() {
                let un = &region.nodes[u.index()];
                if matches!(un.op, Op::Cast) && un.inputs.len() == 1 && !inside.contains(&u) {
                    copies.push(u);
                }
            }
        }
        inside.extend(copies.iter().copied());
        let mut members: Vec<NodeId> = inside.iter().copied().collect();
        members.sort_by_key(|m| self.pos[m.index()]);
        let contains = |n: NodeId| inside.contains(&n);
        if !self.convex(&contains, &members) {
            // Retry without the absorbed producers before giving up.
            let core_set: HashSet<NodeId> = core.iter().copied().collect();
            if !self.convex(&|n| core_set.contains(&n), &core) {
                return Err(PassDiag::unsupported(format!(
                    "@{}: the optimizer updates depend on each other through other ops (not supported yet)",
                    region.name
                )));
            }
            members = core;
            members.extend(copies);
            members.sort_by_key(|m| self.pos[m.index()]);
        }
        self.new_group(KernelKind::Optimizer, members, Space::Alone);
        Ok(())
    }

    /// The operands of node `n` if it is an `add` that may become an epilogue (rules 11, 12):
    /// not yet in a group, two distinct tensors (not scalars) of the result's type.
    fn epilogue_add(&self, n: NodeId) -> Option<(Value, Value)> {
        let region = self.region;
        let node = &region.nodes[n.index()];
        if !matches!(node.op, Op::Binary(titan_ir::BinaryOp::Add)) || self.group_of[n.index()].is_some() {
            return None;
        }
        let ([x, y], [r]) = (node.inputs.as_slice(), node.results.as_slice()) else { return None };
        let ty = region.ty(*r);
        (x != y && region.ty(*x) == ty && region.ty(*y) == ty && ty.rank() > 0).then_some((*x, *y))
    }

    /// Rule 11: a GEMM's residual add becomes its epilogue. An `add` of two same-typed
    /// tensors, one of them the result of a `linear`/`matmul` that nothing else reads, joins
    /// that GEMM's kernel (cuBLASLt's `D = A B + C`, `beta = 1`), so the product is never
    /// written out and read back. Where both operands are such products, the later one takes
    /// the add (the earlier is then its `C`, already computed). The add's other operand must not
    /// be an operand of the GEMM itself, so the body's arguments stay `A, B, C`, and must be
    /// made before the GEMM in program order: waiting for a later `C` would move the GEMM, and
    /// with it its operands' lifetimes (the tied embedding's head gradient plus the embedding's
    /// `scatter_add`, made after the whole backward, kept the logits' gradient alive across it:
    /// 1B's peak +384 MiB).
    fn gemm_epilogues(&mut self) {
        let region = self.region;
        let is_gemm = |op: &Op| matches!(op, Op::Linear | Op::Matmul { .. });
        for &n in &region.order {
            let Some((x, y)) = self.epilogue_add(n) else { continue };
            let candidate = |v: Value, other: Value| -> Option<(usize, NodeId)> {
                let p = self.producer[v.index()]?;
                let pn = &region.nodes[p.index()];
                let ok = is_gemm(&pn.op)
                    && self.group_of[p.index()].is_none()
                    && pn.results.as_slice() == [v]
                    && !self.escapes[v.index()]
                    && self.users[v.index()].as_slice() == [n]
                    && pn.inputs.len() == 2
                    && pn.inputs[0] != pn.inputs[1]
                    && !pn.inputs.contains(&other)
                    && self.producer[other.index()].is_none_or(|q| self.pos[q.index()] < self.pos[p.index()]);
                ok.then(|| (self.pos[p.index()].unwrap_or(0), p))
            };
            let Some((_, gemm)) = [candidate(x, y), candidate(y, x)].into_iter().flatten().max() else { continue };
            self.new_group(KernelKind::Gemm, vec![gemm, n], Space::Alone);
        }
    }

    /// Rule 12: an `add` of a `scatter_add`'s table and a tensor of the same type made before
    /// it joins the scatter's kernel, which then scatters into that tensor instead of into
    /// zeros (the tied embedding's gradient: the head's weight gradient plus the embedding's
    /// `scatter_add`). The table is never written whole and read back; where the memory plan
    /// gives the sum the tensor's own buffer, only the rows an index hits are touched. The
    /// table must be read by nothing else, and the tensor must not be an operand of the
    /// scatter and be made before it (waiting for it would move the scatter).
    fn scatter_epilogues(&mut self) {
        let region = self.region;
        for &n in &region.order {
            let Some((x, y)) = self.epilogue_add(n) else { continue };
            let candidate = |v: Value, other: Value| -> Option<NodeId> {
                let p = self.producer[v.index()]?;
                let pn = &region.nodes[p.index()];
                let ok = matches!(pn.op, Op::ScatterAdd | Op::ScatterAddShard)
                    && self.group_of[p.index()].is_none()
                    && pn.results.as_slice() == [v]
                    && !self.escapes[v.index()]
                    && self.users[v.index()].as_slice() == [n]
                    && !pn.inputs.contains(&other)
                    && self.producer[other.index()].is_none_or(|q| self.pos[q.index()] < self.pos[p.index()]);
                ok.then_some(p)
            };
            let Some(scatter) = candidate(x, y).or_else(|| candidate(y, x)) else { continue };
            self.new_group(KernelKind::ScatterAdd, vec![scatter, n], Space::Alone);
        }
    }

    /// Greedy merging in program order (module documentation, rules 1-5).
    fn fuse_pointwise(&mut self) {
        let region = self.region;
        let mut deferred: Vec<NodeId> = Vec::new();
        for &n in &region.order {
            let Some(Class::Fusible(space)) = self.node_class(n) else { continue };
            if self.group_of[n.index()].is_some() {
                continue;
            }
            let mut cur = self.new_group(KernelKind::Fused, vec![n], space);
            if space == Space::Alone {
                continue;
            }
            let node = &region.nodes[n.index()];
            // Rule 9: an expanding `broadcast` waits for its consumers, so a small tensor (a row
            // scale) is expanded inside the kernel that reads it rather than written out wide;
            // rule 10: so does a recomputed clone.
            if self.pulled[n.index()] {
                deferred.push(n);
                continue;
            }
            // Broadcasts and clones waiting for this consumer (rules 9, 10) come first, so that
            // joining their producers' groups below stays convex.
            for &v in &node.inputs {
                let Some(p) = self.producer[v.index()].filter(|p| self.pulled[p.index()]) else { continue };
                let Some(g) = self.group_of[p.index()].filter(|&g| g != cur && self.group(g).members.len() == 1) else { continue };
                if let Some(s) = self.can_merge(cur, g) {
                    self.merge(cur, g, s);
                }
            }
            // Producer -> consumer: join the groups that made the operands.
            let mut joined = false;
            let mut tried: Vec<usize> = Vec::new();
            for &v in &node.inputs {
                let Some(g) = self.producer[v.index()].and_then(|p| self.group_of[p.index()]) else { continue };
                if g == cur || tried.contains(&g) {
                    continue;
                }
                tried.push(g);
                if let Some(s) = self.can_merge(g, cur) {
                    self.merge(g, cur, s);
                    cur = g;
                    joined = true;
                }
            }
            // Siblings: join a group that already reads one of the same (non-scalar) tensors.
            // A node that joined its producers' group brings that group along: the SwiGLU
            // backward's `dy * silu(gate)`, whose `silu` the backward recomputes (activation
            // checkpointing), joins the kernel that already reads `dy` for `dy * up`.
            let mut siblings: Vec<usize> = Vec::new();
            let outside = |v: &titan_ir::Value| !joined || self.producer[v.index()].and_then(|p| self.group_of[p.index()]) != Some(cur);
            for &v in node.inputs.iter().filter(|&&v| region.ty(v).rank() > 0 && outside(&v)) {
                for &u in &self.users[v.index()] {
                    if let Some(g) = self.group_of[u.index()]
                        && g != cur
                        && !tried.contains(&g)
                        && !siblings.contains(&g)
                        && self.pos[u.index()] < self.pos[n.index()]
                    {
                        siblings.push(g);
                    }
                }
            }
            // A group reducing across rows (a column or full `reduce`: float8's amax) takes no
            // siblings: the other readers of its operand (float8's quantizing cast) need the
            // reduced value, so they run after it and read the operand again instead of having
            // the amax kernel write out a copy for them.
            siblings.retain(|&g| !self.reduces_across_rows(g));
            for g in siblings {
                if let Some(s) = self.can_merge(g, cur) {
                    self.merge(g, cur, s);
                    break;
                }
            }
        }
        // A broadcast no consumer took joins its producer as rule 1 would have had it.
        for n in deferred {
            let Some(cur) = self.group_of[n.index()] else { continue };
            if self.group(cur).members.len() != 1 {
                continue;
            }
            let Some(g) = region.nodes[n.index()].inputs.first().and_then(|v| self.producer[v.index()]).and_then(|p| self.group_of[p.index()]) else {
                continue;
            };
            if let Some(s) = self.can_merge(g, cur) {
                self.merge(g, cur, s);
            }
        }
    }

    /// Whether group `g` gets its own copy of the scalar constants it reads.
    fn copies_constants(&self, g: usize) -> bool {
        matches!(self.group(g).kind, KernelKind::Fused | KernelKind::Optimizer)
    }

    /// A scalar constant read outside fused/optimizer kernels (or a region result) becomes a
    /// one-op fused kernel.
    fn materialize_constants(&mut self) {
        let region = self.region;
        for &n in &region.order {
            if self.node_class(n) != Some(Class::ScalarConstant) {
                continue;
            }
            let needed = region.nodes[n.index()]
                .results
                .iter()
                .any(|r| self.escapes[r.index()] || self.users[r.index()].iter().any(|u| !self.group_of[u.index()].is_some_and(|g| self.copies_constants(g))));
            if needed {
                self.new_group(KernelKind::Fused, vec![n], Space::Alone);
            }
        }
    }

    /// Every gemm, attention, gather and scatter node gets a kernel of its own.
    fn single_kernels(&mut self) {
        for &n in &self.region.order {
            if let Some(Class::Single(kind)) = self.node_class(n)
                && self.group_of[n.index()].is_none()
            {
                self.new_group(kind, vec![n], Space::Alone);
            }
        }
    }

    /// Order the groups and kept nodes topologically, earliest first member first.
    fn schedule(&self, live: &[usize]) -> Result<Vec<Unit>, String> {
        let region = self.region;
        let mut units: Vec<Unit> = live.iter().map(|&g| Unit::Group(g)).collect();
        let mut unit_of: Vec<Option<usize>> = vec![None; region.nodes.len()];
        for (u, &g) in live.iter().enumerate() {
            for &m in &self.group(g).members {
                unit_of[m.index()] = Some(u);
            }
        }
        for &n in &region.order {
            if self.node_class(n) == Some(Class::Keep) {
                unit_of[n.index()] = Some(units.len());
                units.push(Unit::Keep(n));
            }
        }
        let members = |u: Unit| -> Vec<NodeId> {
            match u {
                Unit::Group(g) => self.group(g).members.clone(),
                Unit::Keep(n) => vec![n],
            }
        };
        let mut first = vec![usize::MAX; units.len()];
        let mut indeg = vec![0usize; units.len()];
        let mut succ: Vec<Vec<usize>> = vec![Vec::new(); units.len()];
        for (u, &unit) in units.iter().enumerate() {
            let copies = matches!(unit, Unit::Group(g) if self.copies_constants(g));
            let mut preds: Vec<usize> = Vec::new();
            for m in members(unit) {
                first[u] = first[u].min(self.pos[m.index()].unwrap_or(usize::MAX));
                for &v in &region.nodes[m.index()].inputs {
                    if copies && self.is_scalar_constant(v) {
                        continue;
                    }
                    let Some(p) = self.producer[v.index()] else { continue };
                    match unit_of[p.index()] {
                        Some(pu) if pu != u && !preds.contains(&pu) => preds.push(pu),
                        Some(_) => {}
                        None => return Err(format!("@{}: node {m} reads a value of node {p}, which is in no kernel", region.name)),
                    }
                }
            }
            indeg[u] = preds.len();
            for p in preds {
                succ[p].push(u);
            }
        }
        let mut ready: BinaryHeap<Reverse<(usize, usize)>> = (0..units.len()).filter(|&u| indeg[u] == 0).map(|u| Reverse((first[u], u))).collect();
        let mut out = Vec::with_capacity(units.len());
        while let Some(Reverse((_, u))) = ready.pop() {
            out.push(units[u]);
            for &s in &succ[u] {
                indeg[s] -= 1;
                if indeg[s] == 0 {
                    ready.push(Reverse((first[s], s)));
                }
            }
        }
        if out.len() != units.len() {
            return Err(format!("@{}: the kernels would form a cycle (a bug in the convexity check)", region.name));
        }
        Ok(out)
    }
}

/// Group the nodes of `region` into kernels.
pub fn group_region(region: &Region, dims: &DimTable) -> Result<Grouping, PassDiag> {
    group_region_with(region, dims, &HashSet::new())
}

/// Group the nodes of `region` into kernels, `recomputed` being the clones of rule 10 (each
/// joins the kernel of the consumer that reads it).
pub fn group_region_with(region: &Region, dims: &DimTable, recomputed: &HashSet<NodeId>) -> Result<Grouping, PassDiag> {
    let mut g = Grouper::new(region, dims, recomputed)?;
    g.optimizer_group()?;
    g.gemm_epilogues();
    g.scatter_epilogues();
    g.fuse_pointwise();
    g.single_kernels();
    g.materialize_constants();
    // Compact: keep live groups that produce something, in order of their first member.
    let mut live: Vec<usize> = (0..g.groups.len()).filter(|&i| g.groups[i].is_some()).collect();
    live.sort_by_key(|&i| g.group(i).members.first().and_then(|m| g.pos[m.index()]));
    let units = g.schedule(&live)?;
    let mut renumber = vec![None; g.groups.len()];
    let mut groups = Vec::with_capacity(live.len());
    let mut out_units = Vec::with_capacity(units.len());
    for u in units {
        match u {
            Unit::Group(old) => {
                renumber[old] = Some(groups.len());
                out_units.push(Unit::Group(groups.len()));
                groups.push(g.group(old).clone());
            }
            Unit::Keep(n) => out_units.push(Unit::Keep(n)),
        }
    }
    let group_of = g.group_of.iter().map(|x| x.and_then(|old| renumber[old])).collect();
    Ok(Grouping { groups, group_of, units: out_units })
}

/// Whether `v` is made by a rank-0 `constant` node of `region`.
pub fn is_scalar_constant(region: &Region, v: Value) -> Option<NodeId> {
    match region.values.get(v.index())?.def {
        ValueDef::Result { node, .. } => {
            let n = region.nodes.get(node.index())?;
            (matches!(n.op, Op::Constant { .. }) && region.ty(v).rank() == 0).then_some(node)
        }
        ValueDef::Arg(_) => None,
    }
}
