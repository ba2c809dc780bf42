//! `activation-checkpoint`: choose which activations a repeated block's forward saves for its
//! backward, and recompute the rest inside the backward block.
//!
//! Runs after `autodiff`, which makes every forward block return, besides its own outputs, the
//! values its backward reads (the **saved** outputs, stacked per layer by the `repeat`, read by
//! the reversed backward `repeat` as stacked inputs). The policy (meta `activation_checkpoint`,
//! written by `titanc --ac` and the job config's `[activation_checkpoint]`) marks which forward
//! values may be saved; the pass then
//!
//! 1. resolves every saved value: kept when the policy allows it or when it is the block's
//!    carried input (the layer input, which nothing else can give back), otherwise recomputed
//!    from its operands, resolved the same way (parameters are block arguments the backward
//!    already reads: never saved, never recomputed);
//! 2. rewrites the forward block to return the kept set only (the `repeat` loses the stacked
//!    results of the recomputed values and gains those of newly kept ones), and the backward
//!    `repeat` and block to read the kept set, plus any parameter slice the recompute needs;
//! 3. clones the recomputed nodes into the backward block, each placed right before its first
//!    reader there (as late as possible), so `fuse` groups the recompute into the kernels that
//!    consume it (an RMSNorm recomputed inside the kernel that needs its output) and the
//!    recomputed values live only for their layer's backward.
//!
//! The recomputed ops are the forward's own ops on the same operands, so every value the
//! backward reads is bit-identical to the one `none` would have saved, and so are losses and
//! gradients (tested on the CPU backend, single rank and simulated mesh).
//!
//! Policies (TorchTitan's names):
//! - `none`: every value is saved except what torch.compile's partitioner would recompute for
//!   free: a pointwise value whose backward readers are all pointwise (so the recompute lands in
//!   the kernel that reads it) and whose recompute saves no new bytes beyond its own
//!   ([`free_recompute`]): SwiGLU's `silu(gate)` from the saved gate projection, and float8
//!   rowwise's scaled GEMM outputs from the raw ones. Nothing else changes.
//! - `full`: every block saves its input only; the backward recomputes the whole forward.
//! - `selective(op)`: TorchTitan's op policy: the outputs of the block's GEMMs are saveable except
//!   every second one (counted 1-based in forward order: odd saved, even recomputed), and so are
//!   the attention output and its logsumexp and, on a mesh, reduce-scatter outputs (float8
//!   amax/scales will join them: [`op_policy_saves`]); everything else is recomputed.
//! - `budget(...)`: the kept set of least recompute time whose saved bytes over all layers fit the
//!   budget, found exactly by enumerating the block's candidate values ([`solve_budget`]); the
//!   cost of a recomputed node comes from [`node_cost`] (a roofline: FLOPs at the GEMM rate or
//!   bytes at HBM bandwidth, whichever is slower).
//! - `selective(N)`: TorchTitan's layer policy: every N-th layer (1-based) fully recomputed,
//!   the others save everything. The pair is first split into a `repeat` over groups of N
//!   inlined layers and a `repeat` over the `L % N` remaining ones ([`split_every`]); the group
//!   pair is then checkpointed keeping every value of the group's first N-1 layers.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::str::FromStr;

use titan_ir::{ArgKind, AttrValue, Dim, Graph, NodeId, Op, Output, Placement, Region, TensorType, Value, ValueDef};

use crate::PassDiag;

/// The suffix of the names of recomputed values in the backward block (`%gate.recompute`), so
/// dumps show them and [`recompute_placement`] finds them after fusion.
pub const RECOMPUTE_SUFFIX: &str = ".recompute";

/// Where each recomputed value of a kernel graph went: one line per region, `@layer_bwd: %gate
/// in @layer_bwd.k4 (fused), ...`, from the value names [`activation_checkpoint`] gave them.
pub fn recompute_placement(fused: &Graph) -> Vec<String> {
    let mut lines = Vec::new();
    let bodies: HashSet<titan_ir::BlockId> = fused
        .blocks
        .iter()
        .flat_map(|b| b.order.iter().map(move |&n| &b.node(n).op))
        .filter_map(|op| if let Op::Kernel { body, .. } = op { Some(*body) } else { None })
        .collect();
    for (i, region) in fused.blocks.iter().enumerate() {
        if bodies.contains(&titan_ir::BlockId(i as u32)) {
            continue;
        }
        let mut parts = Vec::new();
        for &n in &region.order {
            let node = region.node(n);
            let (values, place): (Vec<&titan_ir::ValueData>, String) = match &node.op {
                Op::Kernel { body, kind } => {
                    let b = fused.block(*body);
                    (b.order.iter().flat_map(|&m| b.node(m).results.iter().map(|&v| b.value(v))).collect(), format!("@{} ({})", b.name, kind.name()))
                }
                op => (node.results.iter().map(|&v| region.value(v)).collect(), format!("a `{}` of @{}", op.name(), region.name)),
            };
            for d in values {
                if let Some(name) = d.name.as_deref().and_then(|n| n.strip_suffix(RECOMPUTE_SUFFIX)) {
                    parts.push(format!("%{name} in {place}"));
                }
            }
        }
        if !parts.is_empty() {
            lines.push(format!("@{}: {}", region.name, parts.join(", ")));
        }
    }
    lines
}

/// The `meta` key holding the policy (`activation_checkpoint = "selective(op)"`).
pub const AC_META: &str = "activation_checkpoint";

/// A memory budget for `budget` mode.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Budget {
    /// Per-rank bytes of saved activations over all layers, in GiB (`--ac budget=<GiB>`).
    Gib(f64),
    /// A fraction of what `none` saves (TorchTitan's `memory_budget`: 0 recomputes everything
    /// it can, 1 keeps everything).
    Fraction(f64),
}

/// An activation-checkpointing policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AcPolicy {
    None,
    Full,
    /// TorchTitan's op policy (`selective_ac_option = "op"`).
    SelectiveOp,
    /// Full recompute of every N-th layer (`selective_ac_option = "<N>"`), graph mode only for now.
    SelectiveEvery(u32),
    Budget(Budget),
}

impl fmt::Display for AcPolicy {
    /// The meta spelling: `none`, `full`, `selective(op)`, `selective(2)`, `budget(40 GiB)`,
    /// `budget(0.5)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fl = titan_ir::attr::fmt_float;
        match self {
            AcPolicy::None => f.write_str("none"),
            AcPolicy::Full => f.write_str("full"),
            AcPolicy::SelectiveOp => f.write_str("selective(op)"),
            AcPolicy::SelectiveEvery(n) => write!(f, "selective({n})"),
            AcPolicy::Budget(Budget::Gib(g)) => write!(f, "budget({} GiB)", fl(*g)),
            AcPolicy::Budget(Budget::Fraction(x)) => write!(f, "budget({})", fl(*x)),
        }
    }
}

impl FromStr for AcPolicy {
    type Err = String;

    /// Reads the meta spelling ([`fmt::Display`]).
    fn from_str(s: &str) -> Result<AcPolicy, String> {
        let bad = || {
            format!(
                "unknown activation checkpointing policy `{s}`; expected none, full, selective(op), selective(<N>), budget(<GiB> GiB) or budget(<fraction>)"
            )
        };
        let s = s.trim();
        match s {
            "none" => return Ok(AcPolicy::None),
            "full" => return Ok(AcPolicy::Full),
            _ => {}
        }
        let inner = |prefix: &str| s.strip_prefix(prefix).and_then(|r| r.strip_suffix(')')).map(str::trim);
        if let Some(opt) = inner("selective(") {
            return AcPolicy::selective(opt);
        }
        if let Some(b) = inner("budget(") {
            return match b.strip_suffix("GiB") {
                Some(g) => AcPolicy::budget_gib(g.trim()),
                None => AcPolicy::budget_fraction(b.parse::<f64>().map_err(|_| bad())?),
            };
        }
        Err(bad())
    }
}

impl AcPolicy {
    /// `selective` with TorchTitan's `selective_ac_option`: `op` or a positive layer frequency.
    pub fn selective(option: &str) -> Result<AcPolicy, String> {
        if option == "op" {
            return Ok(AcPolicy::SelectiveOp);
        }
        match option.parse::<u32>() {
            Ok(n) if n > 0 => Ok(AcPolicy::SelectiveEvery(n)),
            _ => Err(format!("selective activation checkpointing option `{option}` is neither `op` nor a positive number of layers")),
        }
    }

    /// `budget=<GiB>`: the per-rank bytes the saved activations of all layers may take.
    pub fn budget_gib(gib: &str) -> Result<AcPolicy, String> {
        match gib.parse::<f64>() {
            Ok(g) if g.is_finite() && g >= 0.0 => Ok(AcPolicy::Budget(Budget::Gib(g))),
            _ => Err(format!("activation memory budget `{gib}` is not a number of GiB >= 0 (e.g. `budget=40`)")),
        }
    }

    /// TorchTitan's `memory_budget`: a fraction in [0, 1] of what `none` saves.
    pub fn budget_fraction(x: f64) -> Result<AcPolicy, String> {
        if (0.0..=1.0).contains(&x) {
            Ok(AcPolicy::Budget(Budget::Fraction(x)))
        } else {
            Err(format!("`memory_budget = {x}` must be a fraction in [0, 1] of the activation memory without checkpointing"))
        }
    }

    /// The policy recorded in `g`'s meta; `none` when there is none.
    pub fn from_graph(g: &Graph) -> Result<AcPolicy, PassDiag> {
        match g.meta.get(AC_META) {
            None => Ok(AcPolicy::None),
            Some(AttrValue::Str(s)) => s.parse().map_err(|e: String| PassDiag::invalid(format!("meta `{AC_META}`: {e}"))),
            Some(other) => Err(PassDiag::invalid(format!("meta `{AC_META}` must be a string such as \"selective(op)\", found {other}"))),
        }
    }

    /// Record this policy in `g`'s meta (`none` removes the key).
    pub fn write_meta(self, g: &mut Graph) {
        g.meta.entries.retain(|(k, _)| k != AC_META);
        if self != AcPolicy::None {
            g.meta.entries.push((AC_META.into(), AttrValue::Str(self.to_string())));
        }
    }
}

/// What [`activation_checkpoint`] did (per layer, summed over the checkpointed blocks).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AcStats {
    pub blocks: usize,
    /// Saved values per layer before and after.
    pub saved_before: usize,
    pub saved_after: usize,
    /// Values the backward now recomputes, and the nodes cloned to do it.
    pub recomputed: usize,
    pub recompute_nodes: usize,
    /// Bytes saved per layer before and after (one rank).
    pub saved_bytes_before: u64,
    pub saved_bytes_after: u64,
    /// Saved bytes over all layers (one rank), before and after.
    pub total_saved_bytes_before: u64,
    pub total_saved_bytes_after: u64,
    /// FLOPs of the recompute per step (all layers, one rank) and its modeled time.
    pub recompute_flops: u64,
    pub recompute_seconds: f64,
    /// `budget` mode: the Pareto frontier of the first block, (saved bytes over all layers,
    /// recompute seconds per step), by increasing memory.
    pub pareto: Vec<(u64, f64)>,
    /// Which forward values are saved and which are recomputed, by name (`%xn`), per block.
    pub decisions: Vec<String>,
    /// Blocks no `repeat` runs any more (`selective(N)` with `L % N = 0` replaces the original
    /// layer blocks by the group blocks), removed from the graph.
    pub blocks_removed: usize,
}

impl AcStats {
    /// The report of the pass: the policy's decisions per block, the saved memory and recompute
    /// cost, and in `budget` mode the Pareto frontier as a table.
    pub fn report_lines(&self) -> Vec<String> {
        let mut lines = self.decisions.clone();
        lines.push(format!(
            "saved activations per rank: {} -> {}; recompute {} FLOP ({:.3} ms modeled) per step",
            human(self.total_saved_bytes_before),
            human(self.total_saved_bytes_after),
            self.recompute_flops,
            self.recompute_seconds * 1e3
        ));
        if !self.pareto.is_empty() {
            lines.push("Pareto frontier (saved activations per rank vs modeled recompute time per step):".into());
            lines.push(format!("{:>14}  {:>14}", "saved", "recompute ms"));
            for &(m, s) in &self.pareto {
                lines.push(format!("{:>14}  {:>14.6}", human(m), s * 1e3));
            }
        }
        lines
    }
}

fn human(bytes: u64) -> String {
    titan_ir::artifact::human_bytes(bytes, 2)
}

/// The roofline the budget solver and the statistics use: H200 dense bf16 GEMM rate and HBM
/// bandwidth. titan has no per-kernel cost model yet (`fusion_report` counts bytes only).
pub const GEMM_FLOPS_PER_S: f64 = 989e12;
pub const HBM_BYTES_PER_S: f64 = 4.8e12;

/// `(FLOPs, seconds)` of running `node` once: GEMMs and attention at [`GEMM_FLOPS_PER_S`], every
/// op at least the time its operands and results take to move at [`HBM_BYTES_PER_S`] (an upper
/// bound for a recompute that `fuse` later places inside a consumer's kernel).
pub fn node_cost(region: &Region, n: NodeId, dims: &titan_ir::DimTable) -> (u64, f64) {
    let node = region.node(n);
    let numel = |v: Value| region.ty(v).numel(dims).unwrap_or(0);
    let bytes: u64 = node.inputs.iter().chain(&node.results).map(|&v| region.ty(v).size_bytes(dims).unwrap_or(0)).sum();
    let flops = match &node.op {
        Op::Linear => {
            let w = region.ty(node.inputs[1]).numel(dims).unwrap_or(0);
            let out_features = region.ty(node.inputs[1]).shape.first().and_then(|d| titan_ir::shape::resolve_dim(d, dims)).unwrap_or(1).max(1);
            2 * numel(node.results[0]) / out_features * w
        }
        Op::Matmul { transpose_a, .. } | Op::ScaledMatmul { transpose_a, .. } => {
            let a = region.ty(node.inputs[0]);
            let k = if *transpose_a { a.shape.first() } else { a.shape.last() };
            2 * numel(node.results[0]) * k.and_then(|d| titan_ir::shape::resolve_dim(d, dims)).unwrap_or(0)
        }
        Op::Attention { causal, .. } => {
            // q [b, s, h, d], k [b, t, kv, d]: QK^T and PV, 2 * 2 * b * h * s * t * d; half when causal.
            let q = region.ty(node.inputs[0]).resolve(dims).unwrap_or_default();
            let k = region.ty(node.inputs[1]).resolve(dims).unwrap_or_default();
            match (q.as_slice(), k.as_slice()) {
                ([b, s, h, d], [_, t, _, _]) => {
                    let f = 4 * (b * s * h * d * t) as u64;
                    if *causal { f / 2 } else { f }
                }
                _ => 0,
            }
        }
        _ => 0,
    };
    let seconds = (flops as f64 / GEMM_FLOPS_PER_S).max(bytes as f64 / HBM_BYTES_PER_S);
    let seconds = if matches!(node.op, Op::Reshape) { 0.0 } else { seconds };
    (flops, seconds)
}

/// Whether TorchTitan's op policy saves result `index` of `node`, given the 1-based position
/// `gemm` of the node among the block's GEMMs in forward order (when it is one).
///
/// Float8: the fp8 GEMMs (`scaled_matmul`) count as GEMMs, and every float8 scale is saved
/// (TorchTitan saves the amax for float8, so a recomputed quantization reuses it; the scale is
/// a function of the amax and a few bytes per row).
pub fn op_policy_saves(op: &Op, gemm: Option<usize>) -> bool {
    match op {
        Op::Linear | Op::Matmul { .. } | Op::ScaledMatmul { .. } => gemm.is_some_and(|k| k % 2 == 1),
        Op::Attention { .. } | Op::ReduceScatter { .. } | Op::Fp8Scale { .. } => true,
        _ => false,
    }
}

/// The forward/backward `repeat` pair of one block in `main`.
struct Pair {
    fwd: NodeId,
    bwd: NodeId,
    /// Result indices of `fwd` that are saved activations (read only by `bwd`).
    saved_results: Vec<usize>,
}

fn repeat_parts(op: &Op) -> Option<(titan_ir::BlockId, usize, usize)> {
    match op {
        Op::Repeat { block, carry, stacked, .. } => Some((*block, *carry as usize, *stacked as usize)),
        _ => None,
    }
}

/// Every forward `repeat` whose non-carried results feed only one other `repeat` (its backward).
fn find_pairs(main: &Region) -> Result<Vec<Pair>, PassDiag> {
    let mut users: HashMap<Value, Vec<NodeId>> = HashMap::new();
    for &n in &main.order {
        for &v in &main.node(n).inputs {
            users.entry(v).or_default().push(n);
        }
    }
    let in_outputs: HashSet<Value> = main.outputs.iter().map(|o| o.value).chain(main.updates.iter().map(|u| u.value)).collect();
    let mut pairs = Vec::new();
    for &n in &main.order {
        let node = main.node(n);
        let Some((_, carry, _)) = repeat_parts(&node.op) else { continue };
        let mut bwd = None;
        let mut saved = Vec::new();
        for (i, &r) in node.results.iter().enumerate().skip(carry) {
            let us = users.get(&r).map(Vec::as_slice).unwrap_or_default();
            let only = match us {
                [u] if !in_outputs.contains(&r) && repeat_parts(&main.node(*u).op).is_some() && *u != n => *u,
                _ => continue,
            };
            if bwd.is_some_and(|b| b != only) {
                return Err(PassDiag::unsupported(format!("node {n}: the saved activations of one `repeat` feed two backward `repeat`s (not supported yet)")));
            }
            bwd = Some(only);
            saved.push(i);
        }
        if let Some(b) = bwd {
            pairs.push(Pair { fwd: n, bwd: b, saved_results: saved });
        }
    }
    Ok(pairs)
}

/// How each forward value needed by the backward is obtained.
struct Plan {
    /// Forward values kept (saved per layer), in output order.
    keep: Vec<Value>,
    /// Forward nodes cloned into the backward, in forward order.
    recompute: Vec<NodeId>,
    /// Forward arguments the recompute reads.
    args: Vec<Value>,
}

/// Resolve the values `needed` by the backward given which forward values may be kept.
fn plan(fwd: &Region, n_carry: usize, needed: &[Value], may_keep: &dyn Fn(Value) -> bool) -> Plan {
    let mut keep = Vec::new();
    let mut recompute = HashSet::new();
    let mut args = Vec::new();
    let mut seen = HashSet::new();
    let mut stack: Vec<Value> = needed.iter().rev().copied().collect();
    while let Some(v) = stack.pop() {
        if !seen.insert(v) {
            continue;
        }
        match fwd.value(v).def {
            ValueDef::Arg(i) if (i as usize) < n_carry => keep.push(v),
            ValueDef::Arg(_) => args.push(v),
            ValueDef::Result { node, .. } => {
                if may_keep(v) {
                    keep.push(v);
                } else if recompute.insert(node) {
                    stack.extend(fwd.node(node).inputs.iter().rev().copied());
                }
            }
        }
    }
    let recompute = fwd.order.iter().copied().filter(|n| recompute.contains(n)).collect();
    Plan { keep, recompute, args }
}

fn bytes(region: &Region, v: Value, dims: &titan_ir::DimTable) -> u64 {
    region.ty(v).size_bytes(dims).unwrap_or(0)
}

fn recompute_cost(fwd: &Region, p: &Plan, dims: &titan_ir::DimTable) -> (u64, f64) {
    p.recompute.iter().map(|&n| node_cost(fwd, n, dims)).fold((0, 0.0), |(f, s), (f2, s2)| (f + f2, s + s2))
}

/// The exact budget solver: every subset of the block's candidate values (results of non-view
/// nodes that the saved set depends on) is a kept set; its memory is its bytes times the layer
/// count, its cost the modeled time of the recompute it implies. Returns the plan of least
/// recompute time within `budget_bytes` (ties: least memory), and the Pareto frontier.
fn solve_budget(
    fwd: &Region,
    n_carry: usize,
    needed: &[Value],
    count: u64,
    budget: u64,
    dims: &titan_ir::DimTable,
) -> Result<(Plan, Vec<(u64, f64)>), PassDiag> {
    // Candidates: every non-view result reachable from the needed values.
    let everything = plan(fwd, n_carry, needed, &|_| false);
    // Values computed from parameters alone (FSDP gathers, kv-head slices) are never worth a
    // layer's memory: the backward re-issues them anyway (autodiff's reshard-after-forward).
    let mut param_derived: HashSet<NodeId> = HashSet::new();
    let mut cands: Vec<Value> = Vec::new();
    for &n in &everything.recompute {
        let node = fwd.node(n);
        let from_params = node.inputs.iter().all(|&x| match fwd.value(x).def {
            ValueDef::Arg(i) => i as usize >= n_carry,
            ValueDef::Result { node, .. } => param_derived.contains(&node),
        });
        if from_params {
            param_derived.insert(n);
            continue;
        }
        if matches!(node.op, Op::Reshape) {
            continue;
        }
        cands.extend(node.results.iter().copied());
    }
    const MAX_CANDIDATES: usize = 22;
    if cands.len() > MAX_CANDIDATES {
        return Err(PassDiag::unsupported(format!(
            "@{}: the memory-budget solver enumerates kept sets exactly and handles at most {MAX_CANDIDATES} candidate values per block, this one has {} (not supported yet)",
            fwd.name,
            cands.len()
        )));
    }
    let mut points: Vec<(u64, f64, u32)> = Vec::with_capacity(1 << cands.len());
    for mask in 0u32..(1u32 << cands.len()) {
        let chosen: HashSet<Value> = cands.iter().enumerate().filter(|(i, _)| mask >> i & 1 == 1).map(|(_, &v)| v).collect();
        let p = plan(fwd, n_carry, needed, &|v| chosen.contains(&v));
        // A chosen value that the plan does not keep is wasted: skip such masks (a subset says the same).
        if p.keep.iter().filter(|v| chosen.contains(v)).count() != chosen.len() {
            continue;
        }
        let mem: u64 = p.keep.iter().map(|&v| bytes(fwd, v, dims)).sum::<u64>() * count;
        let (_, secs) = recompute_cost(fwd, &p, dims);
        points.push((mem, secs * count as f64, mask));
    }
    points.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let mut frontier: Vec<(u64, f64, u32)> = Vec::new();
    for p in points {
        if frontier.last().is_none_or(|l| p.1 < l.1) {
            frontier.push(p);
        }
    }
    let best = frontier.iter().rev().find(|p| p.0 <= budget).ok_or_else(|| {
        let least = frontier.first().map_or(0, |p| p.0);
        PassDiag::precondition(format!(
            "the activation memory budget {} GiB per rank is infeasible: saving only each layer's input takes {} GiB; raise the budget to at least that",
            gib(budget),
            gib(least)
        ))
    })?;
    let chosen: HashSet<Value> = cands.iter().enumerate().filter(|(i, _)| best.2 >> i & 1 == 1).map(|(_, &v)| v).collect();
    let p = plan(fwd, n_carry, needed, &|v| chosen.contains(&v));
    Ok((p, frontier.iter().map(|&(m, s, _)| (m, s)).collect()))
}

/// `bytes` in GiB as `--ac budget=` takes it, rounded up to 1e-9 GiB (about a byte), so a printed
/// smallest feasible budget is feasible.
pub fn gib(bytes: u64) -> String {
    let g = (bytes as f64 / (1u64 << 30) as f64 * 1e9).ceil() / 1e9;
    let s = format!("{g:.9}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// A readable name of a forward value (`%xn`, `%28`).
fn value_name(r: &Region, v: Value) -> String {
    match &r.value(v).name {
        Some(n) => format!("%{n}"),
        None => format!("%{}", v.0),
    }
}

/// Apply the graph's activation-checkpointing policy (meta [`AC_META`]) to every
/// forward/backward `repeat` pair of `main`.
pub fn activation_checkpoint(g: &mut Graph) -> Result<AcStats, PassDiag> {
    let policy = AcPolicy::from_graph(g)?;
    let mut stats = AcStats::default();
    let pairs = match find_pairs(&g.main) {
        Ok(p) => p,
        // `none` changes nothing it cannot: a graph the other policies refuse builds as it is.
        Err(_) if policy == AcPolicy::None => return Ok(stats),
        Err(e) => return Err(e),
    };
    let mut done = HashSet::new();
    for pair in pairs {
        let (fblock, n_carry, n_stacked) = repeat_parts(&g.main.node(pair.fwd).op).expect("invariant: a pair starts at a repeat");
        if !done.insert(fblock) || g.main.order.iter().filter(|&&n| repeat_parts(&g.main.node(n).op).is_some_and(|(b, ..)| b == fblock)).count() > 1 {
            if policy == AcPolicy::None {
                continue;
            }
            return Err(PassDiag::unsupported(format!(
                "@{}: a block run by more than one `repeat` cannot be checkpointed (not supported yet)",
                g.block(fblock).name
            )));
        }
        if let AcPolicy::SelectiveEvery(n) = policy {
            let Some((group_fwd, last, rest_bytes)) = split_every(g, &pair, n)? else { continue };
            // The remaining layers save everything, under every policy.
            stats.total_saved_bytes_before += rest_bytes;
            stats.total_saved_bytes_after += rest_bytes;
            let group = find_pairs(&g.main)?
                .into_iter()
                .find(|p| p.fwd == group_fwd)
                .ok_or_else(|| PassDiag::invalid(format!("@{}: the group `repeat` of {n} layers has no backward", g.block(fblock).name)))?;
            let (_, c, s) = repeat_parts(&g.main.node(group_fwd).op).expect("invariant: split_every returns a repeat");
            checkpoint_pair(g, &group, c, s, policy, Some(&last), &mut stats)?;
        } else if !checkpoint_pair(g, &pair, n_carry, n_stacked, policy, None, &mut stats)? {
            continue;
        }
        stats.blocks += 1;
    }
    if stats.blocks > 0 {
        g.canonicalize();
        stats.blocks_removed = g.drop_unused_blocks();
    }
    Ok(stats)
}

/// Checkpoint one pair under `policy`; for `selective(N)` the pair is a group pair of
/// [`split_every`] and `last` the nodes of each group's last layer (recomputed, the others kept).
/// Returns whether the pair changed (`none` leaves a pair with nothing to recompute for free).
fn checkpoint_pair(
    g: &mut Graph,
    pair: &Pair,
    n_carry: usize,
    n_stacked: usize,
    policy: AcPolicy,
    last: Option<&HashSet<NodeId>>,
    stats: &mut AcStats,
) -> Result<bool, PassDiag> {
    let fnode = g.main.node(pair.fwd).clone();
    let bnode = g.main.node(pair.bwd).clone();
    let Op::Repeat { block: fblock, count, .. } = fnode.op else { unreachable!("invariant: checked by find_pairs") };
    let Op::Repeat { block: bblock, carry: b_carry, stacked: b_stacked, .. } = bnode.op else { unreachable!("invariant: checked by find_pairs") };
    let (b_carry, b_stacked) = (b_carry as usize, b_stacked as usize);
    let fwd = g.block(fblock).clone();
    let count = u64::from(count);
    let dims = g.dims.clone();

    // Saved outputs of the forward block and the backward arguments that receive them.
    let saved: Vec<Value> = pair.saved_results.iter().map(|&i| fwd.outputs[i].value).collect();
    let bwd_arg_of_result = |r: Value| -> Vec<usize> { bnode.inputs.iter().enumerate().filter(|&(_, &x)| x == r).map(|(i, _)| i).collect() };
    // Backward arguments that already hold forward arguments (parameter slices, invariants).
    let mut arg_in_bwd: HashMap<Value, usize> = HashMap::new();
    for (i, &x) in bnode.inputs.iter().enumerate() {
        if let Some(j) = fnode.inputs.iter().position(|&y| y == x) {
            let is_stacked = (b_carry..b_carry + b_stacked).contains(&i);
            let fwd_stacked = (n_carry..n_carry + n_stacked).contains(&j);
            if (is_stacked && fwd_stacked) || (!is_stacked && i >= b_carry + b_stacked && j >= n_carry + n_stacked) {
                arg_in_bwd.insert(fwd.args[j].value, i);
            }
        }
    }

    // GEMM numbering for the op policy.
    let mut gemm_index: HashMap<NodeId, usize> = HashMap::new();
    for &n in &fwd.order {
        if matches!(fwd.node(n).op, Op::Linear | Op::Matmul { .. } | Op::ScaledMatmul { .. }) {
            let k = gemm_index.len() + 1;
            gemm_index.insert(n, k);
        }
    }
    let keep_op = |v: Value| match fwd.value(v).def {
        ValueDef::Result { node, .. } => op_policy_saves(&fwd.node(node).op, gemm_index.get(&node).copied()),
        ValueDef::Arg(_) => true,
    };
    let total_none: u64 = saved.iter().map(|&v| bytes(&fwd, v, &dims)).sum::<u64>() * count;
    let p = match policy {
        AcPolicy::Full => plan(&fwd, n_carry, &saved, &|_| false),
        AcPolicy::SelectiveOp => plan(&fwd, n_carry, &saved, &keep_op),
        AcPolicy::Budget(b) => {
            let budget = match b {
                Budget::Gib(x) => (x * (1u64 << 30) as f64) as u64,
                Budget::Fraction(x) => (x * total_none as f64) as u64,
            };
            let (p, frontier) = solve_budget(&fwd, n_carry, &saved, count, budget, &dims)?;
            if stats.pareto.is_empty() {
                stats.pareto = frontier;
            }
            p
        }
        AcPolicy::SelectiveEvery(_) => {
            let last = last.expect("invariant: selective(N) checkpoints a group pair");
            plan(&fwd, n_carry, &saved, &|v| match fwd.value(v).def {
                ValueDef::Result { node, .. } => !last.contains(&node),
                ValueDef::Arg(_) => true,
            })
        }
        AcPolicy::None => {
            let bwd = g.block(bblock);
            let readers: Vec<(Value, Vec<Value>)> = saved
                .iter()
                .zip(&pair.saved_results)
                .map(|(&s, &ri)| (s, bwd_arg_of_result(fnode.results[ri]).into_iter().map(|i| bwd.args[i].value).collect()))
                .collect();
            let not_kept = free_recompute(&fwd, bwd, &readers, &dims);
            if not_kept.is_empty() {
                return Ok(false);
            }
            plan(&fwd, n_carry, &saved, &|v| !not_kept.contains(&v))
        }
    };

    // Statistics.
    let kept: HashSet<Value> = p.keep.iter().copied().collect();
    let recomputed: Vec<Value> = saved.iter().copied().filter(|v| !kept.contains(v)).collect();
    let (flops, secs) = recompute_cost(&fwd, &p, &dims);
    stats.saved_before += saved.len();
    stats.saved_after += p.keep.len();
    stats.recomputed += recomputed.len();
    stats.recompute_nodes += p.recompute.len();
    let before: u64 = saved.iter().map(|&v| bytes(&fwd, v, &dims)).sum();
    let after: u64 = p.keep.iter().map(|&v| bytes(&fwd, v, &dims)).sum();
    stats.saved_bytes_before += before;
    stats.saved_bytes_after += after;
    stats.total_saved_bytes_before += before * count;
    stats.total_saved_bytes_after += after * count;
    stats.recompute_flops += flops * count;
    stats.recompute_seconds += secs * count as f64;
    let names = |vs: &[Value]| vs.iter().map(|&v| value_name(&fwd, v)).collect::<Vec<_>>().join(" ");
    stats.decisions.push(format!("@{}: saves {}; recomputes {}", fwd.name, names(&p.keep), names(&recomputed)));

    // 1. The forward block returns its own outputs, then the kept values.
    let saved_set: HashSet<usize> = pair.saved_results.iter().copied().collect();
    let own: Vec<usize> = (0..fwd.outputs.len()).filter(|i| !saved_set.contains(i)).collect();
    {
        let fb = &mut g.blocks[fblock.index()];
        let mut outs: Vec<titan_ir::Output> = own.iter().map(|&i| fwd.outputs[i].clone()).collect();
        outs.extend(p.keep.iter().map(|&v| titan_ir::Output { name: None, value: v }));
        fb.outputs = outs;
    }
    // The forward repeat's results: own ones keep their values, kept ones are new stacked results.
    let mut kept_result: HashMap<Value, Value> = HashMap::new();
    {
        let main = &mut g.main;
        let mut results: Vec<Value> = own.iter().map(|&i| fnode.results[i]).collect();
        for (k, &r) in results.iter().enumerate() {
            main.values[r.index()].def = ValueDef::Result { node: pair.fwd, index: k as u32 };
        }
        main.nodes[pair.fwd.index()].results = results.clone();
        for &v in &p.keep {
            let t = fwd.ty(v).clone();
            let mut shape = vec![titan_ir::Dim::Fixed(count)];
            shape.extend(t.shape.iter().cloned());
            let r = crate::util::add_result(main, pair.fwd, titan_ir::TensorType::new(t.dtype, shape));
            kept_result.insert(v, r);
            results.push(r);
        }
    }

    // 2. The backward block: kept values stay (or become) stacked arguments, recomputed ones are
    // cloned from them.
    let mut bwd = g.block(bblock).clone();
    let old_args: Vec<Value> = bwd.args.iter().map(|a| a.value).collect();
    let mut map: HashMap<Value, Value> = HashMap::new(); // forward value -> backward value
    let mut new_stacked: Vec<(Value, Value)> = Vec::new(); // (backward arg, main input)
    let mut new_invariant: Vec<(Value, Value)> = Vec::new();
    let mut dropped: HashSet<Value> = HashSet::new();
    for (&s, &ri) in saved.iter().zip(&pair.saved_results) {
        for i in bwd_arg_of_result(fnode.results[ri]) {
            if kept.contains(&s) {
                map.insert(s, old_args[i]);
            } else {
                dropped.insert(old_args[i]);
                bwd.values[old_args[i].index()].name = None;
            }
        }
    }
    for &v in &p.keep {
        if let std::collections::hash_map::Entry::Vacant(e) = map.entry(v) {
            let a = bwd.add_arg(fwd.ty(v).clone(), ArgKind::Block, fwd.value(v).name.as_deref());
            e.insert(a);
            new_stacked.push((a, kept_result[&v]));
        }
    }
    for &a in &p.args {
        if let Some(&i) = arg_in_bwd.get(&a) {
            map.insert(a, old_args[i]);
            continue;
        }
        let ValueDef::Arg(j) = fwd.value(a).def else { unreachable!("invariant: plan args are arguments") };
        let j = j as usize;
        let b = bwd.add_arg(fwd.ty(a).clone(), ArgKind::Block, fwd.value(a).name.as_deref());
        map.insert(a, b);
        if j < n_carry + n_stacked {
            new_stacked.push((b, fnode.inputs[j]));
        } else {
            new_invariant.push((b, fnode.inputs[j]));
        }
    }
    // Clone the recompute in forward order.
    let taken: HashSet<String> = bwd.values.iter().filter_map(|d| d.name.clone()).collect();
    let mut clones = HashSet::new();
    for &n in &p.recompute {
        let node = fwd.node(n);
        let ins: Vec<Value> = node.inputs.iter().map(|x| map[x]).collect();
        let tys = node.results.iter().map(|&r| fwd.ty(r).clone()).collect();
        let id = bwd.add_node(node.op.clone(), ins, tys);
        clones.insert(id);
        for (&r, &c) in node.results.iter().zip(&bwd.node(id).results.clone()) {
            map.insert(r, c);
            let label = format!("{}{RECOMPUTE_SUFFIX}", fwd.value(r).name.clone().unwrap_or_else(|| r.0.to_string()));
            if !taken.contains(&label) {
                bwd.values[c.index()].name = Some(label);
            }
            bwd.values[c.index()].placement = fwd.value(r).placement.clone();
        }
    }
    for (&s, &ri) in saved.iter().zip(&pair.saved_results) {
        if kept.contains(&s) {
            continue;
        }
        for i in bwd_arg_of_result(fnode.results[ri]) {
            crate::util::replace_uses(&mut bwd, old_args[i], map[&s], None);
        }
    }
    place_late(&mut bwd, &clones);

    // Arguments: carried, stacked (old minus dropped, then new), invariant (old, then new).
    let mut order: Vec<Value> = Vec::new();
    let mut inputs: Vec<Value> = Vec::new();
    // Kept saved values move to the forward repeat's new results.
    let moved: HashMap<Value, Value> =
        saved.iter().zip(&pair.saved_results).filter_map(|(s, &ri)| kept_result.get(s).map(|&r| (fnode.results[ri], r))).collect();
    for (i, &a) in old_args.iter().enumerate().take(b_carry + b_stacked) {
        if !dropped.contains(&a) {
            order.push(a);
            let x = bnode.inputs[i];
            inputs.push(moved.get(&x).copied().unwrap_or(x));
        }
    }
    for &(a, x) in &new_stacked {
        order.push(a);
        inputs.push(x);
    }
    let stacked_now = order.len() - b_carry;
    for (i, &a) in old_args.iter().enumerate().skip(b_carry + b_stacked) {
        order.push(a);
        inputs.push(bnode.inputs[i]);
    }
    for &(a, x) in &new_invariant {
        order.push(a);
        inputs.push(x);
    }
    set_args(&mut bwd, &order);
    g.blocks[bblock.index()] = bwd;
    let bn = &mut g.main.nodes[pair.bwd.index()];
    bn.inputs = inputs;
    if let Op::Repeat { stacked, .. } = &mut bn.op {
        *stacked = stacked_now as u32;
    }
    Ok(true)
}

/// Pointwise ops: what a fused kernel computes per element.
fn pointwise(op: &Op) -> bool {
    matches!(op, Op::Unary(_) | Op::Binary(_) | Op::Cast | Op::Broadcast { .. } | Op::Constant { .. })
}

/// `none`'s free recompute. A saved value qualifies when it is a pointwise op's result of at
/// least 1/16 the size of the block's largest saved value (an activation, not a vector), every
/// reader of it in the backward block is pointwise (`readers`: each saved value and the backward
/// arguments holding it), and recomputing it through pointwise ops down to values that are kept
/// anyway (other saved values, the carried input, parameters) or new leaves needs no more
/// new saved bytes than the value itself (vectors of at most 1/64 of it not counted): the forward then stops writing it (a swap for the
/// GEMM output it came from, which is written anyway) and its backward kernel computes it from
/// what it reads. Qualifying is decided to a fixed point (a value that stays saved is a leaf
/// for the others). Returns the values that may not be kept: the qualifying ones and the
/// pointwise values their recompute goes through (empty: nothing qualifies).
fn free_recompute(fwd: &Region, bwd: &Region, readers: &[(Value, Vec<Value>)], dims: &titan_ir::DimTable) -> HashSet<Value> {
    let mut users: HashMap<Value, Vec<&Op>> = HashMap::new();
    for &n in &bwd.order {
        for &v in &bwd.node(n).inputs {
            users.entry(v).or_default().push(&bwd.node(n).op);
        }
    }
    let bwd_outputs: HashSet<Value> = bwd.outputs.iter().map(|o| o.value).collect();
    let saved: HashSet<Value> = readers.iter().map(|(v, _)| *v).collect();
    let pointwise_readers = |args: &[Value]| {
        !args.is_empty()
            && args
                .iter()
                .all(|a| !bwd_outputs.contains(a) && users.get(a).is_some_and(|us| us.iter().all(|op| matches!(op, Op::Unary(_) | Op::Binary(_) | Op::Cast))))
    };
    // Only activations count: a per-row or per-column vector (float8's scales and their
    // reciprocals) costs nothing to save and would become a kernel of its own to recompute.
    let largest = readers.iter().map(|(v, _)| bytes(fwd, *v, dims)).max().unwrap_or(0);
    let mut chosen: HashSet<Value> = readers
        .iter()
        .filter(|(v, args)| {
            matches!(fwd.value(*v).def, ValueDef::Result { node, .. } if pointwise(&fwd.node(node).op))
                && bytes(fwd, *v, dims) * 16 >= largest
                && pointwise_readers(args)
        })
        .map(|(v, _)| *v)
        .collect();
    // The pointwise values `v`'s recompute goes through, and its new leaves' bytes (per-row or
    // per-column vectors, at most 1/64 of `v`, are not counted: float8's row and column scales
    // of a GEMM output, which the recompute reads with it).
    let walk = |v: Value, chosen: &HashSet<Value>| -> (Vec<Value>, u64) {
        let small = bytes(fwd, v, dims) / 64;
        let (mut chain, mut new_bytes, mut seen) = (Vec::new(), 0u64, HashSet::new());
        let mut stack = vec![v];
        while let Some(x) = stack.pop() {
            if !seen.insert(x) {
                continue;
            }
            match fwd.value(x).def {
                // The carried layer input is always kept; parameters are re-read.
                ValueDef::Arg(_) => {}
                ValueDef::Result { node, .. } => {
                    let kept_anyway = saved.contains(&x) && !chosen.contains(&x);
                    // A vector on the way (a scale's reciprocal) is kept, not recomputed in a
                    // kernel of its own; constants are copied.
                    let op = &fwd.node(node).op;
                    if !kept_anyway && pointwise(op) && (bytes(fwd, x, dims) > small || matches!(op, Op::Constant { .. })) {
                        chain.push(x);
                        stack.extend(fwd.node(node).inputs.iter().copied());
                    } else if !saved.contains(&x) && bytes(fwd, x, dims) > small {
                        new_bytes += bytes(fwd, x, dims);
                    }
                }
            }
        }
        (chain, new_bytes)
    };
    loop {
        let before = chosen.len();
        let keep: Vec<Value> = chosen.iter().copied().filter(|&v| walk(v, &chosen).1 <= bytes(fwd, v, dims)).collect();
        chosen = keep.into_iter().collect();
        if chosen.len() == before {
            break;
        }
    }
    chosen.iter().flat_map(|&v| walk(v, &chosen).0).collect()
}

/// Put `region`'s arguments in `order` (the kept ones; the others become dead values).
fn set_args(region: &mut Region, order: &[Value]) {
    let old = std::mem::take(&mut region.args);
    for (i, &v) in order.iter().enumerate() {
        let arg = old.iter().find(|a| a.value == v).expect("invariant: order lists arguments").clone();
        region.values[v.index()].def = ValueDef::Arg(i as u32);
        region.args.push(arg);
    }
}

/// Move each node of `late` to just before the first node that reads it (dependencies first),
/// keeping the order of every other node.
fn place_late(region: &mut Region, late: &HashSet<NodeId>) {
    let def_node = |r: &Region, v: Value| match r.value(v).def {
        ValueDef::Result { node, .. } => Some(node),
        ValueDef::Arg(_) => None,
    };
    fn emit(
        r: &Region,
        n: NodeId,
        late: &HashSet<NodeId>,
        done: &mut HashSet<NodeId>,
        out: &mut Vec<NodeId>,
        def_node: &dyn Fn(&Region, Value) -> Option<NodeId>,
    ) {
        for &x in &r.node(n).inputs {
            if let Some(d) = def_node(r, x)
                && late.contains(&d)
                && !done.contains(&d)
            {
                emit(r, d, late, done, out, def_node);
            }
        }
        if done.insert(n) {
            out.push(n);
        }
    }
    let mut out = Vec::with_capacity(region.order.len());
    let mut done = HashSet::new();
    for &n in region.order.iter().filter(|n| !late.contains(n)) {
        emit(region, n, late, &mut done, &mut out, &def_node);
    }
    for &n in region.order.iter().filter(|n| late.contains(n)) {
        emit(region, n, late, &mut done, &mut out, &def_node);
    }
    region.order = out;
}

/// The Pareto frontier of `budget` mode as an SVG line chart (`titanc build --ac-pareto
/// FILE.svg`): saved activations per rank (GiB, x) against modeled recompute time per step (ms,
/// y), one dot per frontier point, the chosen point ringed. `points` are `(bytes, seconds)` by
/// increasing memory.
pub fn pareto_svg(points: &[(f64, f64)], chosen: Option<(f64, f64)>) -> String {
    let (w, h, m) = (640.0, 400.0, 60.0);
    let gibs: Vec<(f64, f64)> = points.iter().map(|&(b, s)| (b / (1u64 << 30) as f64, s * 1e3)).collect();
    let x_max = gibs.iter().map(|p| p.0).fold(0.0, f64::max).max(1e-12);
    let y_max = gibs.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-12);
    let px = |x: f64| m + x / x_max * (w - 2.0 * m);
    let py = |y: f64| h - m - y / y_max * (h - 2.0 * m);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <line x1=\"{m}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <line x1=\"{m}\" y1=\"{m}\" x2=\"{m}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <text x=\"{cx}\" y=\"{xl}\" text-anchor=\"middle\">saved activations per rank (GiB; max {x_max:.3})</text>\n\
         <text x=\"15\" y=\"{cy}\" text-anchor=\"middle\" transform=\"rotate(-90 15 {cy})\">modeled recompute per step (ms; max {y_max:.3})</text>\n",
        b = h - m,
        r = w - m,
        cx = w / 2.0,
        xl = h - 20.0,
        cy = h / 2.0,
    );
    let path: Vec<String> = gibs.iter().map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y))).collect();
    svg.push_str(&format!("<polyline fill=\"none\" stroke=\"steelblue\" stroke-width=\"2\" points=\"{}\"/>\n", path.join(" ")));
    for &(x, y) in &gibs {
        svg.push_str(&format!("<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"steelblue\"><title>{x:.3} GiB, {y:.3} ms</title></circle>\n", px(x), py(y)));
    }
    if let Some((b, s)) = chosen {
        let (x, y) = (b / (1u64 << 30) as f64, s * 1e3);
        svg.push_str(&format!("<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"7\" fill=\"none\" stroke=\"crimson\" stroke-width=\"2\"><title>chosen: {x:.3} GiB, {y:.3} ms</title></circle>\n", px(x), py(y)));
    }
    svg.push_str("</svg>\n");
    svg
}

/// `selective(N)`: the forward/backward `repeat` pair split into groups of `n` layers (the
/// design is in `docs/notes.md`). TorchTitan wraps the blocks whose 1-based position is a
/// multiple of `n` (`ptd_checkpoint_wrapper._count % ac_freq == 0`), so in each group of `n`
/// consecutive layers the last one is fully recomputed and the others save everything; the
/// `L % n` layers after the last whole group are never wrapped and keep the plain blocks.
///
/// In `main`, each stacked operand `[L, ...]` becomes the view `[L/n, n, ...]` of its first
/// `n (L/n)` layers (a leading-axis `slice`, then a `reshape`) plus a `slice` of the rest. A
/// forward group block runs the `n` layers inlined, reading layer `j`'s slice of each stacked
/// argument; it returns every layer's saved values as separate stacked outputs, so the saved
/// activations are never concatenated. Its backward runs the `n` backward blocks in reverse and
/// returns each weight gradient as the `concat` of its `n` layer gradients; `main` reshapes
/// that back to `[n (L/n), ...]` and concatenates the remainder's. Returns the group pair's
/// forward `repeat`, the nodes of each group's last layer (the fully recomputed one) and the
/// bytes the remaining layers save, or `None` when `L < n` (no layer is checkpointed).
fn split_every(g: &mut Graph, pair: &Pair, n: u32) -> Result<Option<(NodeId, HashSet<NodeId>, u64)>, PassDiag> {
    let fnode = g.main.node(pair.fwd).clone();
    let bnode = g.main.node(pair.bwd).clone();
    let Op::Repeat { block: fblock, count, carry: f_carry, stacked: f_stacked, .. } = fnode.op else { unreachable!("invariant: a pair starts at a repeat") };
    let Op::Repeat { block: bblock, carry: b_carry, stacked: b_stacked, reverse: b_reverse, .. } = bnode.op else {
        unreachable!("invariant: a pair ends at a repeat")
    };
    let (f_carry, f_stacked, b_carry, b_stacked) = (f_carry as usize, f_stacked as usize, b_carry as usize, b_stacked as usize);
    let (groups, rest) = (count / n, count % n);
    if groups == 0 {
        return Ok(None);
    }
    let fwd = g.block(fblock).clone();
    let bwd = g.block(bblock).clone();
    let saved_set: HashSet<usize> = pair.saved_results.iter().copied().collect();
    if (f_carry..fnode.results.len()).any(|i| !saved_set.contains(&i)) {
        return Err(PassDiag::unsupported(format!(
            "@{}: a forward `repeat` with stacked results other than saved activations cannot be split into groups of {n} layers (not supported yet)",
            fwd.name
        )));
    }
    let grouped = u64::from(groups * n);
    let (n64, g64, r64) = (u64::from(n), u64::from(groups), u64::from(rest));

    // `main`: the group view and the remainder slice of every stacked operand.
    let mut fwd_seq: Vec<NodeId> = Vec::new();
    let mut bwd_seq: Vec<NodeId> = Vec::new();
    let mut views: HashMap<Value, (Value, Option<Value>)> = HashMap::new();
    let fpos = g.main.order.iter().position(|&x| x == pair.fwd).expect("invariant: the pair is live");
    let before_fwd: HashSet<NodeId> = g.main.order[..fpos].iter().copied().collect();
    /// The group view and remainder slice of stacked operand `x`, made once, placed before the
    /// forward pair when `x` exists by then.
    fn view(
        main: &mut Region,
        x: Value,
        views: &mut HashMap<Value, (Value, Option<Value>)>,
        seq: &mut Vec<NodeId>,
        (grouped, g64, n64, r64): (u64, u64, u64, u64),
    ) -> (Value, Option<Value>) {
        if let Some(&v) = views.get(&x) {
            return v;
        }
        let t = main.ty(x).clone();
        let p = main.value(x).placement.clone();
        let inner = TensorType::new(t.dtype, t.shape[1..].to_vec());
        let mut push = |main: &mut Region, op: Op, ins: Vec<Value>, lead: &[u64], place: Vec<Placement>| -> Value {
            let id = main.add_node(op, ins, vec![with_lead(lead, &inner)]);
            seq.push(id);
            let r = main.node(id).results[0];
            main.values[r.index()].placement = place;
            r
        };
        let head = if r64 == 0 { x } else { push(main, Op::Slice { axis: 0, start: 0, len: grouped }, vec![x], &[grouped], p.clone()) };
        let groups_view = push(main, Op::Reshape, vec![head], &[g64, n64], shifted(&p, 1));
        let tail = (r64 > 0).then(|| push(main, Op::Slice { axis: 0, start: grouped, len: r64 }, vec![x], &[r64], p.clone()));
        views.insert(x, (groups_view, tail));
        (groups_view, tail)
    }
    let sizes = (grouped, g64, n64, r64);
    let early = |main: &Region, x: Value| match main.value(x).def {
        ValueDef::Arg(_) => true,
        ValueDef::Result { node, .. } => before_fwd.contains(&node),
    };

    // The forward group block: `n` layers inlined.
    let mut gf = Region::new(&format!("{}_x{n}", fwd.name));
    let mut fmap: HashMap<Value, Value> = HashMap::new();
    let mut carry: Vec<Value> = Vec::new();
    let mut f_stacked_args = Vec::new();
    for (k, a) in fwd.args.iter().enumerate() {
        let t = fwd.ty(a.value);
        let name = fwd.value(a.value).name.as_deref();
        let is_stacked = (f_carry..f_carry + f_stacked).contains(&k);
        let v = gf.add_arg(if is_stacked { with_lead(&[n64], t) } else { t.clone() }, a.kind.clone(), name);
        gf.values[v.index()].placement = if is_stacked { shifted(&fwd.value(a.value).placement, 1) } else { fwd.value(a.value).placement.clone() };
        if k < f_carry {
            carry.push(v);
        } else if is_stacked {
            f_stacked_args.push(v);
        } else {
            fmap.insert(a.value, v);
        }
    }
    let mut last = HashSet::new();
    let mut per_layer_out: Vec<Vec<Value>> = Vec::new(); // [layer][output index past the carry]
    let layer_slice = |r: &mut Region, whole: Value, j: u64, t: &TensorType, place: &[Placement], name: Option<String>, made: &mut Vec<NodeId>| -> Value {
        let s = r.add_node(Op::Slice { axis: 0, start: j, len: 1 }, vec![whole], vec![with_lead(&[1], t)]);
        let sv = r.node(s).results[0];
        r.values[sv.index()].placement = shifted(place, 1);
        let v = r.add_node(Op::Reshape, vec![sv], vec![t.clone()]);
        let vv = r.node(v).results[0];
        r.values[vv.index()].placement = place.to_vec();
        r.values[vv.index()].name = name;
        made.extend([s, v]);
        vv
    };
    let suffixed = |name: &Option<String>, j: u32| name.as_ref().map(|s| format!("{s}.{j}"));
    for j in 0..n {
        let mut made = Vec::new();
        for (k, a) in fwd.args.iter().map(|a| a.value).enumerate().take(f_carry) {
            fmap.insert(a, carry[k]);
        }
        for (s, a) in fwd.args.iter().map(|a| a.value).skip(f_carry).take(f_stacked).enumerate() {
            let v = layer_slice(&mut gf, f_stacked_args[s], u64::from(j), fwd.ty(a), &fwd.value(a).placement, suffixed(&fwd.value(a).name, j), &mut made);
            fmap.insert(a, v);
        }
        for &m in &fwd.order {
            let node = fwd.node(m);
            let ins = node.inputs.iter().map(|x| fmap[x]).collect();
            let id = gf.add_node(node.op.clone(), ins, node.results.iter().map(|&r| fwd.ty(r).clone()).collect());
            made.push(id);
            for (&r, &c) in node.results.iter().zip(&gf.node(id).results.clone()) {
                gf.values[c.index()].name = suffixed(&fwd.value(r).name, j);
                gf.values[c.index()].placement = fwd.value(r).placement.clone();
                fmap.insert(r, c);
            }
        }
        carry = fwd.outputs[..f_carry].iter().map(|o| fmap[&o.value]).collect();
        per_layer_out.push(fwd.outputs[f_carry..].iter().map(|o| fmap[&o.value]).collect());
        if j + 1 == n {
            last.extend(made);
        }
    }
    let n_out = fwd.outputs.len() - f_carry;
    gf.outputs = carry.iter().map(|&v| Output { name: None, value: v }).collect();
    for o in 0..n_out {
        for layer in &per_layer_out {
            gf.outputs.push(Output { name: None, value: layer[o] });
        }
    }
    let gf_id = g.add_block(gf);

    // The forward `repeat`s: groups, then the remainder.
    let f_ops: Vec<Value> = fnode.inputs.clone();
    let mut g_ins: Vec<Value> = f_ops[..f_carry].to_vec();
    let mut r_ins: Vec<Value> = f_ops[..f_carry].to_vec();
    for &x in &f_ops[f_carry..f_carry + f_stacked] {
        let (gv, tail) = view(&mut g.main, x, &mut views, &mut fwd_seq, sizes);
        g_ins.push(gv);
        if let Some(t) = tail {
            r_ins.push(t);
        }
    }
    g_ins.extend_from_slice(&f_ops[f_carry + f_stacked..]);
    r_ins.extend_from_slice(&f_ops[f_carry + f_stacked..]);
    let carry_tys: Vec<TensorType> = fnode.results[..f_carry].iter().map(|&r| g.main.ty(r).clone()).collect();
    let out_tys: Vec<TensorType> = fwd.outputs[f_carry..].iter().map(|o| fwd.ty(o.value).clone()).collect();
    let mut tys = carry_tys.clone();
    for t in &out_tys {
        tys.extend(std::iter::repeat_n(with_lead(&[g64], t), n as usize));
    }
    let grp_f =
        g.main.add_node(Op::Repeat { block: gf_id, count: groups, carry: f_carry as u32, stacked: f_stacked as u32, reverse: false, prefetch: 0 }, g_ins, tys);
    fwd_seq.push(grp_f);
    let grp_f_res = g.main.node(grp_f).results.clone();
    let mut final_carry: Vec<Value> = grp_f_res[..f_carry].to_vec();
    let mut rem_f_res: Vec<Value> = Vec::new();
    if rest > 0 {
        r_ins[..f_carry].copy_from_slice(&final_carry);
        let op = Op::Repeat { block: fblock, count: rest, carry: f_carry as u32, stacked: f_stacked as u32, reverse: false, prefetch: 0 };
        rem_f_res = add_repeat(&mut g.main, &mut fwd_seq, op, r_ins, &carry_tys, &out_tys, &[r64]);
        final_carry = rem_f_res[..f_carry].to_vec();
    }
    // Group result of forward output `o` (past the carry), layer `j` of the group.
    let grp_out = |o: usize, j: usize| grp_f_res[f_carry + o * n as usize + j];

    // The backward group block: the `n` backward blocks in reverse.
    let mut gb = Region::new(&format!("{}_x{n}", bwd.name));
    let mut carry: Vec<Value> = Vec::new();
    // Per stacked operand of the backward: saved (one argument per layer) or a view.
    enum StackedArg {
        Saved(Vec<Value>),
        Whole(Value),
    }
    let mut stacked_args: Vec<StackedArg> = Vec::new();
    let mut bmap: HashMap<Value, Value> = HashMap::new();
    let mut gb_ins: Vec<Value> = Vec::new();
    let mut rb_ins: Vec<Value> = Vec::new();
    let fwd_result_index = |x: Value| fnode.results.iter().position(|&r| r == x);
    for (k, a) in bwd.args.iter().enumerate() {
        let (t, d) = (bwd.ty(a.value).clone(), bwd.value(a.value));
        let x = bnode.inputs[k];
        if (b_carry..b_carry + b_stacked).contains(&k) {
            match fwd_result_index(x).filter(|&i| i >= f_carry) {
                Some(i) => {
                    let o = i - f_carry;
                    let mut args = Vec::new();
                    for j in 0..n {
                        let v = gb.add_arg(t.clone(), a.kind.clone(), suffixed(&d.name, j).as_deref());
                        gb.values[v.index()].placement = d.placement.clone();
                        args.push(v);
                        gb_ins.push(grp_out(o, j as usize));
                    }
                    stacked_args.push(StackedArg::Saved(args));
                    rb_ins.push(if rest > 0 { rem_f_res[i] } else { x });
                }
                None => {
                    let v = gb.add_arg(with_lead(&[n64], &t), a.kind.clone(), d.name.as_deref());
                    gb.values[v.index()].placement = shifted(&d.placement, 1);
                    stacked_args.push(StackedArg::Whole(v));
                    let seq = if early(&g.main, x) { &mut fwd_seq } else { &mut bwd_seq };
                    let (gv, tail) = view(&mut g.main, x, &mut views, seq, sizes);
                    gb_ins.push(gv);
                    if let Some(t) = tail {
                        rb_ins.push(t);
                    }
                }
            }
        } else {
            let v = gb.add_arg(t, a.kind.clone(), d.name.as_deref());
            gb.values[v.index()].placement = d.placement.clone();
            if k < b_carry {
                carry.push(v);
            } else {
                bmap.insert(a.value, v);
            }
            gb_ins.push(x);
            rb_ins.push(x);
        }
    }
    let mut per_layer_grad: Vec<Vec<Value>> = vec![Vec::new(); n as usize];
    for j in (0..n).rev() {
        let mut made = Vec::new();
        for (k, a) in bwd.args.iter().map(|a| a.value).enumerate().take(b_carry) {
            bmap.insert(a, carry[k]);
        }
        for (s, a) in bwd.args.iter().map(|a| a.value).skip(b_carry).take(b_stacked).enumerate() {
            let v = match &stacked_args[s] {
                StackedArg::Saved(args) => args[j as usize],
                StackedArg::Whole(w) => layer_slice(&mut gb, *w, u64::from(j), bwd.ty(a), &bwd.value(a).placement, suffixed(&bwd.value(a).name, j), &mut made),
            };
            bmap.insert(a, v);
        }
        for &m in &bwd.order {
            let node = bwd.node(m);
            let ins = node.inputs.iter().map(|x| bmap[x]).collect();
            let id = gb.add_node(node.op.clone(), ins, node.results.iter().map(|&r| bwd.ty(r).clone()).collect());
            for (&r, &c) in node.results.iter().zip(&gb.node(id).results.clone()) {
                gb.values[c.index()].name = suffixed(&bwd.value(r).name, j);
                gb.values[c.index()].placement = bwd.value(r).placement.clone();
                bmap.insert(r, c);
            }
        }
        carry = bwd.outputs[..b_carry].iter().map(|o| bmap[&o.value]).collect();
        per_layer_grad[j as usize] = bwd.outputs[b_carry..].iter().map(|o| bmap[&o.value]).collect();
    }
    gb.outputs = carry.iter().map(|&v| Output { name: None, value: v }).collect();
    let grad_tys: Vec<TensorType> = bwd.outputs[b_carry..].iter().map(|o| bwd.ty(o.value).clone()).collect();
    for (o, t) in grad_tys.iter().enumerate() {
        let place = bwd.value(bwd.outputs[b_carry + o].value).placement.clone();
        let parts: Vec<Value> = per_layer_grad
            .iter()
            .map(|layer| {
                let id = gb.add_node(Op::Reshape, vec![layer[o]], vec![with_lead(&[1], t)]);
                let r = gb.node(id).results[0];
                gb.values[r.index()].placement = shifted(&place, 1);
                r
            })
            .collect();
        let id = gb.add_node(Op::Concat { axis: 0 }, parts, vec![with_lead(&[n64], t)]);
        let r = gb.node(id).results[0];
        gb.values[r.index()].placement = shifted(&place, 1);
        gb.outputs.push(Output { name: None, value: r });
    }
    let n_bstacked = gb_ins.len() - b_carry - (bnode.inputs.len() - b_carry - b_stacked);
    let gb_id = g.add_block(gb);

    // The backward `repeat`s: the remainder (the last layers) first, then the groups.
    let b_carry_tys: Vec<TensorType> = bnode.results[..b_carry].iter().map(|&r| g.main.ty(r).clone()).collect();
    let mut rem_b_res: Vec<Value> = Vec::new();
    if rest > 0 {
        let op = Op::Repeat { block: bblock, count: rest, carry: b_carry as u32, stacked: b_stacked as u32, reverse: b_reverse, prefetch: 0 };
        rem_b_res = add_repeat(&mut g.main, &mut bwd_seq, op, rb_ins, &b_carry_tys, &grad_tys, &[r64]);
        gb_ins[..b_carry].copy_from_slice(&rem_b_res[..b_carry]);
    }
    let op = Op::Repeat { block: gb_id, count: groups, carry: b_carry as u32, stacked: n_bstacked as u32, reverse: b_reverse, prefetch: 0 };
    let grp_b_res = add_repeat(&mut g.main, &mut bwd_seq, op, gb_ins, &b_carry_tys, &grad_tys, &[g64, n64]);
    for (&old, &new) in bnode.results[..b_carry].iter().zip(&grp_b_res[..b_carry]) {
        crate::util::replace_uses(&mut g.main, old, new, None);
    }
    for (o, t) in grad_tys.iter().enumerate() {
        let old = bnode.results[b_carry + o];
        let place = g.main.value(old).placement.clone();
        let mut add = |main: &mut Region, op: Op, ins: Vec<Value>, ty: TensorType| -> Value {
            let id = main.add_node(op, ins, vec![ty]);
            bwd_seq.push(id);
            let r = main.node(id).results[0];
            main.values[r.index()].placement = place.clone();
            r
        };
        let flat = add(&mut g.main, Op::Reshape, vec![grp_b_res[b_carry + o]], with_lead(&[grouped], t));
        let old_ty = g.main.ty(old).clone();
        let whole = if rest > 0 { add(&mut g.main, Op::Concat { axis: 0 }, vec![flat, rem_b_res[b_carry + o]], old_ty) } else { flat };
        crate::util::replace_uses(&mut g.main, old, whole, None);
    }
    for (&old, &new) in fnode.results[..f_carry].iter().zip(&final_carry) {
        crate::util::replace_uses(&mut g.main, old, new, None);
    }
    let fwd_seq_set: HashSet<NodeId> = fwd_seq.iter().chain(&bwd_seq).copied().collect();
    let mut order = Vec::with_capacity(g.main.order.len() + fwd_seq_set.len());
    for &m in &g.main.order {
        if m == pair.fwd {
            order.extend(fwd_seq.iter().copied());
        } else if m == pair.bwd {
            order.extend(bwd_seq.iter().copied());
        } else if !fwd_seq_set.contains(&m) {
            order.push(m);
        }
    }
    g.main.order = order;
    let per_layer: u64 = pair.saved_results.iter().map(|&i| bytes(&fwd, fwd.outputs[i].value, &g.dims)).sum();
    Ok(Some((grp_f, last, per_layer * r64)))
}

/// Append `op` (a `repeat`) to `main` and to `seq`: its results are the carried types, then each
/// stacked output type with the leading dimensions `lead`.
fn add_repeat(main: &mut Region, seq: &mut Vec<NodeId>, op: Op, ins: Vec<Value>, carry: &[TensorType], outs: &[TensorType], lead: &[u64]) -> Vec<Value> {
    let mut tys = carry.to_vec();
    tys.extend(outs.iter().map(|t| with_lead(lead, t)));
    let id = main.add_node(op, ins, tys);
    seq.push(id);
    main.node(id).results.clone()
}

/// `t` with leading dimensions `lead`.
fn with_lead(lead: &[u64], t: &TensorType) -> TensorType {
    let mut shape: Vec<Dim> = lead.iter().map(|&d| Dim::Fixed(d)).collect();
    shape.extend(t.shape.iter().cloned());
    TensorType::new(t.dtype, shape)
}

/// Placements of a value whose dimensions moved by `by` (a leading dimension added or removed).
fn shifted(p: &[Placement], by: i64) -> Vec<Placement> {
    p.iter().map(|&x| if let Placement::Shard(d) = x { Placement::Shard((i64::from(d) + by).max(0) as u32) } else { x }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_print_as_the_meta_reads_them() {
        for p in [
            AcPolicy::None,
            AcPolicy::Full,
            AcPolicy::SelectiveOp,
            AcPolicy::SelectiveEvery(2),
            AcPolicy::Budget(Budget::Gib(40.5)),
            AcPolicy::Budget(Budget::Fraction(0.25)),
        ] {
            assert_eq!(p.to_string().parse::<AcPolicy>(), Ok(p), "{p}");
        }
        assert_eq!(AcPolicy::selective("op"), Ok(AcPolicy::SelectiveOp));
        assert!(AcPolicy::selective("0").is_err());
        assert!(AcPolicy::budget_gib("-1").is_err());
        assert!(AcPolicy::budget_fraction(1.5).is_err());
        assert!("partial".parse::<AcPolicy>().is_err());
        let mut g = Graph::new("g");
        AcPolicy::Full.write_meta(&mut g);
        assert_eq!(AcPolicy::from_graph(&g), Ok(AcPolicy::Full));
        AcPolicy::None.write_meta(&mut g);
        assert!(g.meta.get(AC_META).is_none());
    }

    #[test]
    fn op_policy_saves_odd_gemms_attention_and_reduce_scatters() {
        assert!(op_policy_saves(&Op::Linear, Some(1)));
        assert!(!op_policy_saves(&Op::Linear, Some(2)));
        assert!(op_policy_saves(&Op::Matmul { transpose_a: false, transpose_b: false }, Some(3)));
        assert!(op_policy_saves(&Op::Attention { causal: true, scale: 1.0 }, None));
        assert!(!op_policy_saves(&Op::RmsNorm { eps: 1e-5 }, None));
    }

    #[test]
    fn the_pareto_chart_has_a_dot_per_point_and_rings_the_choice() {
        let svg = pareto_svg(&[(1e9, 0.1), (2e9, 0.05), (4e9, 0.0)], Some((2e9, 0.05)));
        assert!(svg.starts_with("<svg ") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<circle").count(), 4);
        assert!(svg.contains("chosen: 1.863 GiB, 50.000 ms"), "{svg}");
    }

    #[test]
    fn gib_rounds_up() {
        assert_eq!(gib(1 << 30), "1");
        assert_eq!(gib(256), "0.000000239");
        assert_eq!(gib(0), "0");
    }
}
