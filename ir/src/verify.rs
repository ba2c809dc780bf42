//! The verifier: every structural and typing rule a graph must satisfy, checked all at once so
//! a user sees every problem in one report. Safe on any `Graph`, including hand-built ones with
//! dangling ids.

use std::collections::{HashMap, HashSet};
use std::fmt;

use petgraph::algo::kosaraju_scc;
use petgraph::graph::{DiGraph, NodeIndex};

use crate::attr::AttrValue;
use crate::diag::{Diagnostic, Span};
use crate::graph::{ArgKind, BlockId, Graph, NodeId, Region, Value, ValueDef};
use crate::infer::{InferCtx, infer_types};
use crate::op::Op;
use crate::parse::{RegionSpans, SourceMap, is_name, is_word};
use crate::shape::{Dim, TensorType};

/// Which region of the graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RegionRef {
    Main,
    Block(BlockId),
}

/// What a verifier error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Loc {
    Graph,
    Region(RegionRef),
    /// Argument number `usize` of the region.
    Arg(RegionRef, usize),
    Node(RegionRef, NodeId),
    /// Output (or block result) number `usize`.
    Output(RegionRef, usize),
    /// `update` number `usize` of `main`.
    Update(usize),
}

/// One broken rule.
#[derive(Clone, Debug, PartialEq)]
pub struct VerifyError {
    pub loc: Loc,
    pub message: String,
    /// The location in words (`in @layer, node n3 (`linear`)`), for reports without source text.
    pub place: String,
}

impl VerifyError {
    /// An error at `loc` of `g`, with the location described in words.
    pub fn new(g: &Graph, loc: Loc, message: impl Into<String>) -> VerifyError {
        let names = match loc {
            Loc::Arg(r, _) => Names::new(region_of(g, r)),
            _ => Names { names: Vec::new() },
        };
        VerifyError { loc, message: message.into(), place: describe_loc(g, loc, &names) }
    }
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.place, self.message)
    }
}

fn region_of(g: &Graph, r: RegionRef) -> Option<&Region> {
    match r {
        RegionRef::Main => Some(&g.main),
        RegionRef::Block(b) => g.blocks.get(b.index()),
    }
}

fn region_label(g: &Graph, r: RegionRef) -> String {
    match region_of(g, r) {
        Some(region) => format!("@{}", region.name),
        None => match r {
            RegionRef::Main => "func".to_string(),
            RegionRef::Block(b) => format!("block #{}", b.0),
        },
    }
}

/// `in @layer, node n3 (`linear`)` and friends.
/// `names` spells the values of the loc's region (only arguments need it).
fn describe_loc(g: &Graph, loc: Loc, names: &Names) -> String {
    match loc {
        Loc::Graph => format!("in graph @{}", g.name),
        Loc::Region(r) => format!("in {}", region_label(g, r)),
        Loc::Arg(r, i) => {
            let spelled = region_of(g, r).and_then(|reg| reg.args.get(i)).map(|a| names.spell(a.value));
            match spelled {
                Some(s) => format!("in {}, argument {i} (`{s}`)", region_label(g, r)),
                None => format!("in {}, argument {i}", region_label(g, r)),
            }
        }
        Loc::Node(r, n) => match region_of(g, r).and_then(|reg| reg.nodes.get(n.index())) {
            Some(node) => format!("in {}, node {n} (`{}`)", region_label(g, r), node.op.name()),
            None => format!("in {}, node {n}", region_label(g, r)),
        },
        Loc::Output(r, i) => match (r, region_of(g, r).and_then(|reg| reg.outputs.get(i))) {
            (RegionRef::Main, Some(o)) if o.name.is_some() => {
                format!("in {}, output `{}`", region_label(g, r), o.name.as_deref().unwrap_or_default())
            }
            (RegionRef::Main, _) => format!("in {}, output {i}", region_label(g, r)),
            (RegionRef::Block(_), _) => format!("in {}, result {i}", region_label(g, r)),
        },
        Loc::Update(i) => format!("in {}, update {i}", region_label(g, RegionRef::Main)),
    }
}

/// Spellings of a region's values as the printer writes them, computed without trusting ids.
struct Names {
    names: Vec<Option<String>>,
}

impl Names {
    fn new(region: Option<&Region>) -> Names {
        let Some(r) = region else { return Names { names: Vec::new() } };
        let mut names: Vec<Option<String>> = vec![None; r.values.len()];
        let mut next = 0usize;
        let mut assign = |v: Value| {
            if let Some(slot @ None) = names.get_mut(v.index()) {
                *slot = Some(match &r.values[v.index()].name {
                    Some(n) => format!("%{n}"),
                    None => format!("%{next}"),
                });
            }
            next += 1;
        };
        for a in &r.args {
            assign(a.value);
        }
        for &n in &r.order {
            if let Some(node) = r.nodes.get(n.index()) {
                for &v in &node.results {
                    assign(v);
                }
            }
        }
        Names { names }
    }

    fn spell(&self, v: Value) -> String {
        self.names.get(v.index()).cloned().flatten().unwrap_or_else(|| format!("%?{}", v.0))
    }
}

/// Where a live value comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Src {
    Arg(usize),
    Node(NodeId),
}

struct Checker<'g> {
    g: &'g Graph,
    errors: Vec<VerifyError>,
    /// Named dims already reported as unbound (once per graph).
    unbound_reported: HashSet<String>,
    /// Value spellings per region, for describing locations.
    names: HashMap<RegionRef, Names>,
}

impl<'g> Checker<'g> {
    fn err(&mut self, loc: Loc, message: impl Into<String>) {
        let g = self.g;
        let place = match loc_region(loc) {
            Some(r) => describe_loc(g, loc, self.names.entry(r).or_insert_with(|| Names::new(region_of(g, r)))),
            None => describe_loc(g, loc, &Names { names: Vec::new() }),
        };
        self.errors.push(VerifyError { loc, message: message.into(), place });
    }

    /// Whether every argument and result of block `b` points into its value table (so the
    /// typing of a `repeat` can look at them).
    fn block_sound(&self, b: BlockId) -> bool {
        match self.g.blocks.get(b.index()) {
            Some(r) => r.args.iter().map(|a| a.value).chain(r.outputs.iter().map(|o| o.value)).all(|v| v.index() < r.values.len()),
            None => true,
        }
    }

    fn check_graph(&mut self) {
        let g = self.g;
        if !is_name(&g.name) {
            self.err(Loc::Graph, format!("graph name `{}` cannot be written as `@name`; use letters, digits, `_` and `.`", g.name));
        }
        for (k, v) in &g.meta.entries {
            if !is_word(k) {
                self.err(Loc::Graph, format!("meta key `{k}` is not a word; use letters, digits and `_`, starting with a letter"));
            }
            if let Some(why) = unprintable_attr(v, 0) {
                self.err(Loc::Graph, format!("meta attribute `{k}` cannot be written in the text format: {why}"));
            }
        }
        if let Some(k) = g.meta.entries.iter().enumerate().find_map(|(i, (k, _))| g.meta.entries[..i].iter().any(|(k2, _)| k2 == k).then_some(k)) {
            self.err(Loc::Graph, format!("duplicate meta key `{k}`"));
        }
        for k in g.dims.keys() {
            if !is_word(k) {
                self.err(Loc::Graph, format!("dimension name `{k}` is not a word; use letters, digits and `_`, starting with a letter"));
            }
        }
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (i, b) in g.blocks.iter().enumerate() {
            let rr = RegionRef::Block(BlockId(i as u32));
            if !is_name(&b.name) {
                self.err(Loc::Region(rr), format!("block name `{}` cannot be written as `@name`; use letters, digits, `_` and `.`", b.name));
            }
            if let Some(first) = seen.insert(&b.name, i) {
                seen.insert(&b.name, first);
                self.err(Loc::Region(rr), format!("duplicate block name `@{}` (also block #{first})", b.name));
            }
        }
        if !is_name(&g.main.name) {
            self.err(Loc::Region(RegionRef::Main), format!("func name `{}` cannot be written as `@name`; use letters, digits, `_` and `.`", g.main.name));
        }
        for (i, b) in g.blocks.iter().enumerate() {
            self.check_region(RegionRef::Block(BlockId(i as u32)), b);
        }
        self.check_region(RegionRef::Main, &g.main);
    }

    fn check_region(&mut self, rr: RegionRef, r: &'g Region) {
        let nv = r.values.len();
        let valid = |v: Value| v.index() < nv;
        let names = Names::new(Some(r));
        let label = region_label(self.g, rr);
        let mut defined: Vec<Option<Src>> = vec![None; nv];

        // Arguments.
        for (i, a) in r.args.iter().enumerate() {
            let loc = Loc::Arg(rr, i);
            if !valid(a.value) {
                self.err(loc, format!("argument {i} refers to value #{}, but {label} has only {nv} values", a.value.0));
                continue;
            }
            if r.values[a.value.index()].def != ValueDef::Arg(i as u32) {
                self.err(loc, format!("the value table does not record `{}` as argument {i}", names.spell(a.value)));
            }
            match defined[a.value.index()] {
                Some(_) => self.err(loc, format!("`{}` is defined twice", names.spell(a.value))),
                None => defined[a.value.index()] = Some(Src::Arg(i)),
            }
        }

        // Nodes in program order.
        let mut pos_of: Vec<Option<usize>> = vec![None; r.nodes.len()];
        let mut live: Vec<(NodeId, bool)> = Vec::new();
        for &n in &r.order {
            let Some(node) = r.nodes.get(n.index()) else {
                self.err(Loc::Region(rr), format!("the program order lists node {n}, but {label} has only {} nodes", r.nodes.len()));
                continue;
            };
            if pos_of[n.index()].is_some() {
                self.err(Loc::Node(rr, n), format!("node {n} appears twice in the program order"));
                continue;
            }
            pos_of[n.index()] = Some(live.len());
            let mut sound = true;
            for (i, &res) in node.results.iter().enumerate() {
                if !valid(res) {
                    self.err(Loc::Node(rr, n), format!("result {i} refers to value #{}, but {label} has only {nv} values", res.0));
                    sound = false;
                    continue;
                }
                if r.values[res.index()].def != (ValueDef::Result { node: n, index: i as u32 }) {
                    self.err(Loc::Node(rr, n), format!("the value table does not record `{}` as result {i} of node {n}", names.spell(res)));
                }
                match defined[res.index()] {
                    Some(_) => self.err(Loc::Node(rr, n), format!("`{}` is defined twice", names.spell(res))),
                    None => defined[res.index()] = Some(Src::Node(n)),
                }
            }
            for (i, &inp) in node.inputs.iter().enumerate() {
                if !valid(inp) {
                    self.err(Loc::Node(rr, n), format!("operand {i} refers to value #{}, but {label} has only {nv} values", inp.0));
                    sound = false;
                }
            }
            live.push((n, sound));
        }

        // Uses of values defined nowhere live.
        let nowhere = "which is defined nowhere: it is neither an argument nor a result of a node in the program order";
        for &(n, _) in &live {
            for (i, &inp) in r.nodes[n.index()].inputs.iter().enumerate() {
                if valid(inp) && defined[inp.index()].is_none() {
                    self.err(Loc::Node(rr, n), format!("operand {i} is value #{}, {nowhere}", inp.0));
                }
            }
        }
        for (i, o) in r.outputs.iter().enumerate() {
            if !valid(o.value) {
                self.err(Loc::Output(rr, i), format!("output refers to value #{}, but {label} has only {nv} values", o.value.0));
            } else if defined[o.value.index()].is_none() {
                self.err(Loc::Output(rr, i), format!("output is value #{}, {nowhere}", o.value.0));
            }
        }
        if rr == RegionRef::Main {
            for (i, u) in r.updates.iter().enumerate() {
                for (what, v) in [("target", u.state), ("value", u.value)] {
                    if !valid(v) {
                        self.err(Loc::Update(i), format!("update {what} refers to value #{}, but {label} has only {nv} values", v.0));
                    } else if defined[v.index()].is_none() {
                        self.err(Loc::Update(i), format!("update {what} is value #{}, {nowhere}", v.0));
                    }
                }
            }
        }

        self.check_order(rr, r, &live, &pos_of, &defined, &names);
        let big = self.check_value_types(rr, r, &live, &defined);
        self.check_value_names(rr, r, &live, &names);

        // Typing of each node.
        let ctx = InferCtx { dims: &self.g.dims, blocks: &self.g.blocks };
        for &(n, sound) in &live {
            let node = &r.nodes[n.index()];
            if matches!(node.op, Op::Repeat { .. }) && matches!(rr, RegionRef::Block(_)) {
                self.err(Loc::Node(rr, n), "repeat inside a block is not supported yet; repeat blocks from func only");
                continue;
            }
            if let Some(b) = referenced_block(&node.op) {
                if rr == RegionRef::Block(b) {
                    self.err(Loc::Node(rr, n), format!("`{}` runs its own block {}; a block cannot run itself", node.op.name(), region_label(self.g, rr)));
                    continue;
                }
                // Typing looks into the block's tables; a malformed block is reported on its own.
                if !self.block_sound(b) {
                    continue;
                }
            }
            if !sound || node.inputs.iter().chain(&node.results).any(|v| big.contains(v)) {
                continue;
            }
            let inputs: Vec<&TensorType> = node.inputs.iter().map(|&v| &r.values[v.index()].ty).collect();
            let declared: Vec<TensorType> = node.results.iter().map(|&v| r.values[v.index()].ty.clone()).collect();
            if let Err(msg) = infer_types(&node.op, &inputs, Some(&declared), &ctx) {
                self.err(Loc::Node(rr, n), msg);
            } else if let Op::Repeat { block, carry, stacked, prefetch, .. } = node.op
                && prefetch > 0
                && let Err(msg) = crate::prefetch::prefetch_split(&self.g.blocks[block.index()], carry as usize, stacked as usize, prefetch as usize)
            {
                self.err(Loc::Node(rr, n), format!("repeat: {msg}"));
            }
        }

        match rr {
            RegionRef::Main => self.check_main(r, &defined, &names),
            RegionRef::Block(_) => self.check_block(rr, r, &names),
        }
        for (i, a) in r.args.iter().enumerate() {
            if let Some(p) = a.kind.param_info()
                && p.is_stacked()
                && valid(a.value)
                && r.values[a.value.index()].ty.rank() == 0
            {
                self.err(
                    Loc::Arg(rr, i),
                    format!(
                        "`{}` is stacked per layer (its name `{}` contains `{{i}}`) so it needs rank >= 1, found {}",
                        names.spell(a.value),
                        p.name,
                        r.values[a.value.index()].ty
                    ),
                );
            }
        }
    }

    /// Cycles (one report per strongly connected component) and uses before definitions.
    fn check_order(&mut self, rr: RegionRef, r: &Region, live: &[(NodeId, bool)], pos_of: &[Option<usize>], defined: &[Option<Src>], names: &Names) {
        let mut dg: DiGraph<NodeId, ()> = DiGraph::with_capacity(live.len(), 0);
        let ix: Vec<NodeIndex> = live.iter().map(|&(n, _)| dg.add_node(n)).collect();
        let producer = |v: Value| match defined.get(v.index()).copied().flatten() {
            Some(Src::Node(p)) => pos_of[p.index()],
            _ => None,
        };
        for (c, &(n, _)) in live.iter().enumerate() {
            for &inp in &r.nodes[n.index()].inputs {
                if let Some(p) = producer(inp) {
                    dg.add_edge(ix[p], ix[c], ());
                }
            }
        }
        let mut scc_of = vec![usize::MAX; live.len()];
        for (k, scc) in kosaraju_scc(&dg).into_iter().enumerate() {
            let cyclic = scc.len() > 1 || dg.contains_edge(scc[0], scc[0]);
            if !cyclic {
                continue;
            }
            let mut members: Vec<usize> = scc.iter().map(|i| i.index()).collect();
            members.sort_unstable();
            for &m in &members {
                scc_of[m] = k;
            }
            let spelled: Vec<String> = members
                .iter()
                .map(|&m| {
                    let n = live[m].0;
                    r.nodes[n.index()].results.first().map_or_else(|| format!("node {n}"), |&v| names.spell(v))
                })
                .collect();
            self.err(Loc::Node(rr, live[members[0]].0), format!("cycle through {}; a value cannot depend on itself", spelled.join(", ")));
        }
        for (c, &(n, _)) in live.iter().enumerate() {
            for &inp in &r.nodes[n.index()].inputs {
                if let Some(p) = producer(inp) {
                    let same_cycle = scc_of[c] != usize::MAX && scc_of[c] == scc_of[p];
                    if p > c && !same_cycle {
                        self.err(Loc::Node(rr, n), format!("`{}` is used before its definition; move its definition above this node", names.spell(inp)));
                    }
                }
            }
        }
    }

    /// Unbound named dims (once per name) and types too large to count; returns the values
    /// whose types are too large to type-check safely.
    fn check_value_types(&mut self, rr: RegionRef, r: &Region, live: &[(NodeId, bool)], defined: &[Option<Src>]) -> HashSet<Value> {
        let mut big = HashSet::new();
        let mut values: Vec<(Value, Loc)> = Vec::new();
        for (i, a) in r.args.iter().enumerate() {
            if defined.get(a.value.index()).copied().flatten() == Some(Src::Arg(i)) {
                values.push((a.value, Loc::Arg(rr, i)));
            }
        }
        for &(n, _) in live {
            for &v in &r.nodes[n.index()].results {
                if defined.get(v.index()).copied().flatten() == Some(Src::Node(n)) {
                    values.push((v, Loc::Node(rr, n)));
                }
            }
        }
        for (v, loc) in values {
            let ty = &r.values[v.index()].ty;
            let mut bytes = Some(ty.dtype.size_bytes() as u64);
            for d in &ty.shape {
                match d {
                    Dim::Named(name) => match self.g.dims.get(name) {
                        Some(&n) => bytes = bytes.and_then(|b| b.checked_mul(n)),
                        None => {
                            if self.unbound_reported.insert(name.clone()) {
                                self.err(loc, format!("dimension `{name}` is not bound; add `{name} = <size>` to the graph's `dims`"));
                            }
                        }
                    },
                    Dim::Fixed(n) => bytes = bytes.and_then(|b| b.checked_mul(*n)),
                }
            }
            if bytes.is_none() {
                self.err(loc, format!("type {ty} is too large: its size in bytes does not fit in 64 bits"));
                big.insert(v);
            }
        }
        big
    }

    /// Value names must be printable and unique within the region.
    fn check_value_names(&mut self, rr: RegionRef, r: &Region, live: &[(NodeId, bool)], names: &Names) {
        let mut values: Vec<(Value, Loc)> = r.args.iter().enumerate().map(|(i, a)| (a.value, Loc::Arg(rr, i))).collect();
        for &(n, _) in live {
            values.extend(r.nodes[n.index()].results.iter().map(|&v| (v, Loc::Node(rr, n))));
        }
        let mut seen: HashSet<&str> = HashSet::new();
        for (v, loc) in values {
            let Some(name) = r.values.get(v.index()).and_then(|d| d.name.as_deref()) else { continue };
            if !is_name(name) || name.chars().all(|c| c.is_ascii_digit()) {
                self.err(loc, format!("value name `{name}` cannot be written as `%name`; use letters, digits, `_` and `.`, and not only digits"));
            } else if !seen.insert(name) {
                self.err(loc, format!("duplicate value name `{}` in {}; rename one of them", names.spell(v), region_label(self.g, rr)));
            }
        }
    }

    fn check_main(&mut self, r: &Region, defined: &[Option<Src>], names: &Names) {
        let rr = RegionRef::Main;
        for (i, a) in r.args.iter().enumerate() {
            if a.kind == ArgKind::Block {
                self.err(Loc::Arg(rr, i), format!("`{}` is a block argument, but func arguments are `input`, `param` or `state`", names.spell(a.value)));
            }
        }
        let mut seen: HashSet<&str> = HashSet::new();
        for (i, o) in r.outputs.iter().enumerate() {
            match o.name.as_deref() {
                None => self.err(Loc::Output(rr, i), "func outputs must be named: `output NAME = %x`"),
                Some(n) if !is_word(n) => {
                    self.err(Loc::Output(rr, i), format!("output name `{n}` is not a word; use letters, digits and `_`, starting with a letter"))
                }
                Some(n) => {
                    if !seen.insert(n) {
                        self.err(Loc::Output(rr, i), format!("duplicate output name `{n}`; rename one of the outputs"));
                    }
                }
            }
        }
        let nv = r.values.len();
        let mut updated: HashSet<Value> = HashSet::new();
        for (i, u) in r.updates.iter().enumerate() {
            if u.state.index() >= nv || defined[u.state.index()].is_none() {
                continue;
            }
            let target = names.spell(u.state);
            match defined[u.state.index()].and_then(|s| match s {
                Src::Arg(k) => r.args.get(k),
                Src::Node(_) => None,
            }) {
                Some(a) if matches!(a.kind, ArgKind::State(_)) => {}
                Some(a) => {
                    let kind = match a.kind {
                        ArgKind::Input => "an input",
                        ArgKind::Param(_) => "a param",
                        _ => "a block argument",
                    };
                    self.err(Loc::Update(i), format!("update target `{target}` is {kind}; only `state` arguments can be updated"));
                }
                None => self.err(Loc::Update(i), format!("update target `{target}` is a node result; only `state` arguments can be updated")),
            }
            if !updated.insert(u.state) {
                self.err(Loc::Update(i), format!("`{target}` is updated twice; keep one update per state"));
            }
            if u.value.index() < nv {
                let (ts, tv) = (&r.values[u.state.index()].ty, &r.values[u.value.index()].ty);
                if !ts.same_as(tv, &self.g.dims) {
                    self.err(Loc::Update(i), format!("update of `{target}` ({ts}) with `{}` of a different type ({tv})", names.spell(u.value)));
                }
            }
        }
    }

    fn check_block(&mut self, rr: RegionRef, r: &Region, names: &Names) {
        let label = region_label(self.g, rr);
        for (i, a) in r.args.iter().enumerate() {
            let kind = match a.kind {
                ArgKind::Block => continue,
                ArgKind::Input => "an input",
                ArgKind::Param(_) => "a param",
                ArgKind::State(_) => "a state",
            };
            self.err(
                Loc::Arg(rr, i),
                format!("`{}` is {kind}, but block arguments are bound by `repeat`; declare inputs, params and state in func", names.spell(a.value)),
            );
        }
        if r.outputs.is_empty() {
            self.err(Loc::Region(rr), format!("{label} returns nothing; a block must return at least one value"));
        }
        for (i, o) in r.outputs.iter().enumerate() {
            if let Some(n) = &o.name {
                self.err(Loc::Output(rr, i), format!("block results are unnamed, found name `{n}`"));
            }
        }
        if !r.updates.is_empty() {
            self.err(Loc::Region(rr), format!("{label} has {} update(s); only func updates state", r.updates.len()));
        }
    }
}

/// The block an op runs, if any.
fn referenced_block(op: &Op) -> Option<BlockId> {
    match op {
        Op::Repeat { block, .. } => Some(*block),
        Op::Kernel { body, .. } => Some(*body),
        _ => None,
    }
}

/// Why `v` would not read back identically from the text format, if it would not.
fn unprintable_attr(v: &AttrValue, depth: usize) -> Option<String> {
    if depth > 32 {
        return Some("it is nested more than 32 levels deep".into());
    }
    match v {
        AttrValue::Ident(w) if !is_word(w) || matches!(w.as_str(), "true" | "false" | "inf" | "nan") => Some(format!("`{w}` is not a plain word")),
        AttrValue::Symbol(s) if !is_name(s) => Some(format!("`@{s}` is not a valid reference")),
        AttrValue::Call(w, _) if !is_word(w) || matches!(w.as_str(), "true" | "false" | "inf" | "nan") => Some(format!("`{w}` is not a plain word")),
        AttrValue::List(items) | AttrValue::Call(_, items) => items.iter().find_map(|x| unprintable_attr(x, depth + 1)),
        _ => None,
    }
}

/// Check every rule on `g` and return every problem found (empty when the graph is valid).
pub fn verify(g: &Graph) -> Vec<VerifyError> {
    let mut c = Checker { g, errors: Vec::new(), unbound_reported: HashSet::new(), names: HashMap::new() };
    c.check_graph();
    c.errors
}

fn spans_of(map: &SourceMap, r: RegionRef) -> Option<&RegionSpans> {
    match r {
        RegionRef::Main => Some(&map.main),
        RegionRef::Block(b) => map.blocks.get(b.index()),
    }
}

fn span_of(map: &SourceMap, loc: Loc) -> Option<Span> {
    let pick = |r: RegionRef, f: &dyn Fn(&RegionSpans) -> Option<Span>| spans_of(map, r).map(|s| f(s).unwrap_or(s.region));
    match loc {
        Loc::Graph => Some(map.graph),
        Loc::Region(r) => pick(r, &|_| None),
        Loc::Arg(r, i) => pick(r, &|s| s.args.get(i).copied()),
        Loc::Node(r, n) => pick(r, &|s| s.nodes.get(n.index()).copied()),
        Loc::Output(r, i) => pick(r, &|s| s.outputs.get(i).copied()),
        Loc::Update(i) => pick(RegionRef::Main, &|s| s.updates.get(i).copied()),
    }
}

fn loc_region(loc: Loc) -> Option<RegionRef> {
    match loc {
        Loc::Graph => None,
        Loc::Region(r) | Loc::Arg(r, _) | Loc::Node(r, _) | Loc::Output(r, _) => Some(r),
        Loc::Update(_) => Some(RegionRef::Main),
    }
}

/// Replace canonical spellings `%N` of unnamed values by the spelling the source used.
fn respell(message: &str, names: &[String]) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(p) = rest.find('%') {
        out.push_str(&rest[..p]);
        let after = &rest[p + 1..];
        let digits = after.chars().take_while(char::is_ascii_digit).count();
        let whole = digits > 0 && !after[digits..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.');
        match after[..digits].parse::<usize>().ok().filter(|_| whole).and_then(|i| names.get(i)) {
            Some(name) => {
                out.push('%');
                out.push_str(name);
            }
            None => {
                out.push('%');
                out.push_str(&after[..digits]);
            }
        }
        rest = &after[digits..];
    }
    out.push_str(rest);
    out
}

/// Turn verifier errors into diagnostics, in the same order. With the source map of the parsed
/// text each points at its line and values are spelled as in the source; without one, the
/// message starts with the location in words.
pub fn to_diagnostics(errors: &[VerifyError], map: Option<&SourceMap>) -> Vec<Diagnostic> {
    errors
        .iter()
        .map(|e| match map.and_then(|m| span_of(m, e.loc).map(|s| (m, s))) {
            Some((m, span)) => {
                let names = loc_region(e.loc).and_then(|r| spans_of(m, r)).map_or(&[][..], |s| &s.value_names[..]);
                Diagnostic::new(respell(&e.message, names), Some(span))
            }
            None => Diagnostic::new(e.to_string(), None),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attr::Attrs;
    use crate::dtype::DType;
    use crate::graph::{Builder, Init, Output, ParamInfo, Update};
    use crate::op::{BinaryOp, UnaryOp};

    fn f32s(shape: &[u64]) -> TensorType {
        TensorType::fixed(DType::F32, shape)
    }

    fn messages(g: &Graph) -> Vec<String> {
        verify(g).iter().map(ToString::to_string).collect()
    }

    fn has(msgs: &[String], needle: &str) -> bool {
        msgs.iter().any(|m| m.contains(needle))
    }

    /// A valid graph: one block repeated twice over a stacked weight.
    fn valid() -> Graph {
        let mut g = Graph::new("ok");
        g.dims.insert("n".into(), 4);
        let mut blk = Region::new("layer");
        let h = blk.add_arg(TensorType::new(DType::F32, vec![Dim::named("n")]), ArgKind::Block, Some("h"));
        let w = blk.add_arg(f32s(&[4, 4]), ArgKind::Block, Some("w"));
        let mut b = Builder::new(&mut blk, &g.dims, &g.blocks);
        let x = b.push1(Op::Matmul { transpose_a: false, transpose_b: false }, &[w, w]).map_err(|e| e.to_string());
        let y = b.push1(Op::Unary(UnaryOp::Neg), &[h]);
        let (Ok(_), Ok(y)) = (x, y) else { panic!("valid block does not build") };
        blk.outputs.push(Output { name: None, value: y });
        g.add_block(blk);
        let mut b = g.main_builder();
        let x = b.region.add_arg(TensorType::new(DType::F32, vec![Dim::named("n")]), ArgKind::Input, Some("x"));
        let info = ParamInfo { name: "layers.{i}.w".into(), init: Init::Zeros };
        let ws = b.region.add_arg(f32s(&[2, 4, 4]), ArgKind::Param(info), Some("ws"));
        let state = ParamInfo { name: "s".into(), init: Init::Ones };
        let s = b.region.add_arg(TensorType::new(DType::F32, vec![Dim::named("n")]), ArgKind::State(state), Some("s"));
        let op = Op::Repeat { block: BlockId(0), count: 2, carry: 1, stacked: 1, reverse: false, prefetch: 0 };
        let Ok(r) = b.push1(op, &[x, ws]) else { panic!("valid repeat does not build") };
        let Ok(u) = b.push1(Op::Binary(BinaryOp::Add), &[s, r]) else { panic!("valid add does not build") };
        b.region.outputs.push(Output { name: Some("y".into()), value: r });
        b.region.updates.push(Update { state: s, value: u });
        g
    }

    #[test]
    fn valid_graph_has_no_errors() {
        assert_eq!(messages(&valid()), Vec::<String>::new());
    }

    #[test]
    fn dangling_ids_are_reported_not_indexed() {
        let mut g = valid();
        let big = Value(1000);
        g.main.nodes[0].inputs.push(big);
        g.main.order.push(NodeId(77));
        g.main.outputs.push(Output { name: Some("z".into()), value: big });
        g.main.updates.push(Update { state: big, value: big });
        g.main.args[0].value = Value(999);
        g.blocks[0].args[1].value = Value(555);
        g.blocks[0].nodes[0].results.push(Value(444));
        let m = messages(&g);
        for needle in [
            "argument 0 refers to value #999",
            "operand 2 refers to value #1000",
            "the program order lists node n77",
            "output refers to value #1000",
            "update target refers to value #1000",
            "result 1 refers to value #444",
        ] {
            assert!(has(&m, needle), "missing {needle:?} in {m:#?}");
        }
        // A repeat of a malformed block is not type-checked (that would index its tables).
        let mut g = valid();
        g.blocks[0].outputs[0].value = Value(12345);
        let m = messages(&g);
        assert!(has(&m, "output refers to value #12345"), "{m:#?}");
        let mut g = valid();
        g.main.nodes[0].op = Op::Repeat { block: BlockId(9), count: 2, carry: 1, stacked: 1, reverse: false, prefetch: 0 };
        assert!(has(&messages(&g), "repeat names block #9 which does not exist"));
    }

    #[test]
    fn liveness_order_and_cycles() {
        let mut g = valid();
        // The add of the update uses the repeat's result; drop the repeat from the order.
        g.main.order.remove(0);
        let m = messages(&g);
        assert!(has(&m, "operand 1 is value #3, which is defined nowhere"), "{m:#?}");
        assert!(has(&m, "output is value #3, which is defined nowhere"), "{m:#?}");

        let mut g = valid();
        g.main.order.reverse();
        let m = messages(&g);
        // Printed in this order the repeat result is numbered after the add result.
        assert!(has(&m, "`%4` is used before its definition"), "{m:#?}");

        let mut g = valid();
        let r = g.main.nodes[0].results[0];
        g.main.nodes[0].inputs[0] = r;
        let m = messages(&g);
        assert!(has(&m, "cycle through %3"), "{m:#?}");
        assert!(!has(&m, "used before"), "{m:#?}");
    }

    #[test]
    fn region_rules() {
        let mut g = valid();
        g.blocks[0].args[0].kind = ArgKind::Input;
        g.blocks[0].outputs[0].name = Some("o".into());
        let (s, v) = (g.blocks[0].args[0].value, g.blocks[0].args[0].value);
        g.blocks[0].updates.push(Update { state: s, value: v });
        g.main.args[0].kind = ArgKind::Block;
        g.main.outputs[0].name = None;
        g.main.args[1].kind = ArgKind::Param(ParamInfo { name: "w.{i}".into(), init: Init::Zeros });
        g.main.values[1].ty = TensorType::scalar(DType::F32);
        g.main.values[0].name = Some("12".into());
        g.main.values[2].name = Some("s".into());
        g.main.values[3].name = Some("s".into());
        g.main.values[3].ty = TensorType::new(DType::F32, vec![Dim::named("unbound")]);
        g.main.updates[0].state = g.main.args[1].value;
        g.meta = Attrs::new(vec![("bad key".into(), AttrValue::Ident("true".into()))]);
        g.blocks.push(Region::new("layer"));
        let m = messages(&g);
        for needle in [
            "`%h` is an input, but block arguments are bound by `repeat`",
            "block results are unnamed, found name `o`",
            "@layer has 1 update(s); only func updates state",
            "is a block argument, but func arguments are",
            "func outputs must be named",
            "needs rank >= 1, found f32[]",
            "value name `12` cannot be written",
            "duplicate value name `%s`",
            "dimension `unbound` is not bound",
            "update target `%ws` is a param",
            "meta key `bad key` is not a word",
            "`true` is not a plain word",
            "duplicate block name `@layer`",
            "returns nothing; a block must return at least one value",
        ] {
            assert!(has(&m, needle), "missing {needle:?} in {m:#?}");
        }
    }

    #[test]
    fn huge_types_are_reported_not_overflowed() {
        let mut g = valid();
        g.dims.insert("n".into(), u64::MAX);
        let m = messages(&g);
        assert!(has(&m, "is too large: its size in bytes does not fit in 64 bits"), "{m:#?}");
    }

    #[test]
    fn diagnostics_without_source_map_name_the_place() {
        let mut g = valid();
        g.blocks[0].nodes[1].op = Op::Linear;
        g.main.updates[0].value = g.main.args[0].value;
        g.main.values[0].ty = f32s(&[3]);
        let errors = verify(&g);
        let diags = to_diagnostics(&errors, None);
        let msgs: Vec<&str> = diags.iter().map(|d| d.message.as_str()).collect();
        assert!(diags.iter().all(|d| d.span.is_none()));
        assert!(msgs.iter().any(|m| m.starts_with("in @layer, node n1 (`linear`): `linear` takes 2 operands")), "{msgs:#?}");
        assert!(msgs.iter().any(|m| m.starts_with("in @main, update 0: update of `%s`")), "{msgs:#?}");
        assert!(msgs.iter().any(|m| m.starts_with("in @main, node n0 (`repeat`): repeat: operand 0 is f32[3]")), "{msgs:#?}");
        assert_eq!(errors[0].to_string(), format!("{}: {}", errors[0].place, errors[0].message));
    }

    #[test]
    fn respelling_uses_source_names() {
        let names: Vec<String> = ["x", "0", "7", "a.b"].iter().map(|s| s.to_string()).collect();
        assert_eq!(respell("cycle through %1, %2, %3 and %9, %1x, %?2", &names), "cycle through %0, %7, %a.b and %9, %1x, %?2");
    }
}
