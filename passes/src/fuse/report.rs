//! The fusion report: the kernels of each region and the memory traffic of one training step
//! before and after fusion, counted the simple way: every node (before) or kernel (after)
//! reads each distinct operand once and writes each result once; block regions count once per
//! layer; views (`reshape`) and `repeat` itself cost nothing. Values with an unbound dimension
//! count 0 bytes.

use std::collections::HashSet;
use std::fmt;

use titan_ir::{Graph, KernelKind, Op, Region, Value};

use super::kernel_bodies;

/// One kernel of a fused region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelInfo {
    /// The body block, `layer.k3`.
    pub name: String,
    pub kind: KernelKind,
    /// The ops of the body in order.
    pub ops: Vec<&'static str>,
    /// Bytes read and written by one run.
    pub bytes: u64,
}

/// One region of the graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionReport {
    pub region: String,
    /// Runs per step: 1 for `main`, the layer count for a repeated block.
    pub runs: u64,
    /// The kernels of the fused region, in program order.
    pub kernels: Vec<KernelInfo>,
    /// Bytes per step (all runs) before fusion.
    pub bytes_before: u64,
    /// Bytes per step (all runs) after fusion.
    pub bytes_after: u64,
}

impl RegionReport {
    /// How many kernels of `kind` the region has.
    pub fn count(&self, kind: KernelKind) -> usize {
        self.kernels.iter().filter(|k| k.kind == kind).count()
    }
}

/// Kernels and memory traffic per region, before and after fusion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusionReport {
    pub graph: String,
    /// The blocks (in the unfused graph's order), then `main`.
    pub regions: Vec<RegionReport>,
    pub bytes_before: u64,
    pub bytes_after: u64,
}

impl FusionReport {
    pub fn region(&self, name: &str) -> Option<&RegionReport> {
        self.regions.iter().find(|r| r.region == name)
    }

    pub fn kernel_count(&self) -> usize {
        self.regions.iter().map(|r| r.kernels.len()).sum()
    }
}

fn value_bytes(g: &Graph, r: &Region, v: Value) -> u64 {
    r.values.get(v.index()).and_then(|d| d.ty.size_bytes(&g.dims)).unwrap_or(0)
}

/// Bytes one run of `r` reads and writes.
fn region_bytes(g: &Graph, r: &Region) -> u64 {
    let mut total = 0;
    for node in r.order.iter().filter_map(|n| r.nodes.get(n.index())) {
        // Views move no bytes (a `concat` does when its operands cannot be placed in it).
        if matches!(node.op, Op::Reshape | Op::Slice { .. } | Op::Repeat { .. }) {
            continue;
        }
        let mut seen: HashSet<Value> = HashSet::new();
        total += node.inputs.iter().filter(|v| seen.insert(**v)).map(|&v| value_bytes(g, r, v)).sum::<u64>();
        total += node.results.iter().map(|&v| value_bytes(g, r, v)).sum::<u64>();
    }
    total
}

/// How many times per step `main` runs the block named `name`.
fn runs(g: &Graph, name: &str) -> u64 {
    if name == g.main.name {
        return 1;
    }
    g.main
        .order
        .iter()
        .filter_map(|n| g.main.nodes.get(n.index()))
        .filter_map(|node| match node.op {
            Op::Repeat { block, count, .. } if g.blocks.get(block.index()).is_some_and(|b| b.name == name) => Some(u64::from(count)),
            _ => None,
        })
        .sum()
}

/// The regions that are not kernel bodies: blocks in order, then `main`.
fn regions(g: &Graph) -> Vec<&Region> {
    let bodies = kernel_bodies(g);
    g.blocks.iter().enumerate().filter(|(i, _)| !bodies.contains(&titan_ir::BlockId(*i as u32))).map(|(_, b)| b).chain([&g.main]).collect()
}

fn kernels(g: &Graph, r: &Region) -> Vec<KernelInfo> {
    let mut out = Vec::new();
    for node in r.order.iter().filter_map(|n| r.nodes.get(n.index())) {
        let Op::Kernel { body, kind } = node.op else { continue };
        let Some(b) = g.blocks.get(body.index()) else { continue };
        let mut seen: HashSet<Value> = HashSet::new();
        let bytes = node.inputs.iter().filter(|v| seen.insert(**v)).chain(&node.results).map(|&v| value_bytes(g, r, v)).sum();
        let ops = b.order.iter().filter_map(|n| b.nodes.get(n.index())).map(|n| n.op.name()).collect();
        out.push(KernelInfo { name: b.name.clone(), kind, ops, bytes });
    }
    out
}

/// Compare the graph before fusion with the graph after it.
pub fn fusion_report(unfused: &Graph, fused: &Graph) -> FusionReport {
    let mut report = FusionReport { graph: fused.name.clone(), regions: Vec::new(), bytes_before: 0, bytes_after: 0 };
    let before = regions(unfused);
    let after = regions(fused);
    let mut names: Vec<&str> = before.iter().map(|r| r.name.as_str()).collect();
    for r in &after {
        if !names.contains(&r.name.as_str()) {
            names.insert(names.len().saturating_sub(1), r.name.as_str());
        }
    }
    for name in names {
        let b = before.iter().find(|r| r.name == name);
        let a = after.iter().find(|r| r.name == name);
        let bytes_before = b.map_or(0, |r| region_bytes(unfused, r) * runs(unfused, name));
        let bytes_after = a.map_or(0, |r| region_bytes(fused, r) * runs(fused, name));
        let runs = if a.is_some() { runs(fused, name) } else { runs(unfused, name) };
        report.bytes_before += bytes_before;
        report.bytes_after += bytes_after;
        report.regions.push(RegionReport {
            region: name.to_string(),
            runs,
            kernels: a.map_or_else(Vec::new, |r| kernels(fused, r)),
            bytes_before,
            bytes_after,
        });
    }
    report
}

/// `12.3 MiB`.
fn human(bytes: u64) -> String {
    titan_ir::artifact::human_bytes(bytes, 1)
}

fn ratio(after: u64, before: u64) -> String {
    if before == 0 { "-".into() } else { format!("{:.2}", after as f64 / before as f64) }
}

impl fmt::Display for FusionReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "fusion report for @{} (bytes read + written per step; views are free)", self.graph)?;
        let by_kind = |r: &RegionReport| -> String {
            let parts: Vec<String> = KernelKind::ALL.iter().filter(|&&k| r.count(k) > 0).map(|&k| format!("{} {}", r.count(k), k.name())).collect();
            parts.join(", ")
        };
        let name_w = self.regions.iter().map(|r| r.region.len() + 1).chain([6]).max().unwrap_or(6);
        let kind_w = self.regions.iter().map(|r| by_kind(r).len()).chain([7]).max().unwrap_or(7);
        writeln!(f, "{:<name_w$}  {:>4}  {:>7}  {:<kind_w$}  {:>12}  {:>12}  {:>6}", "region", "runs", "kernels", "by kind", "before", "after", "ratio")?;
        for r in &self.regions {
            writeln!(
                f,
                "{:<name_w$}  {:>4}  {:>7}  {:<kind_w$}  {:>12}  {:>12}  {:>6}",
                format!("@{}", r.region),
                r.runs,
                r.kernels.len(),
                by_kind(r),
                human(r.bytes_before),
                human(r.bytes_after),
                ratio(r.bytes_after, r.bytes_before)
            )?;
        }
        writeln!(
            f,
            "{:<name_w$}  {:>4}  {:>7}  {:<kind_w$}  {:>12}  {:>12}  {:>6}",
            "total",
            "",
            self.kernel_count(),
            "",
            human(self.bytes_before),
            human(self.bytes_after),
            ratio(self.bytes_after, self.bytes_before)
        )?;
        writeln!(f, "bytes per step: {} before, {} after", self.bytes_before, self.bytes_after)?;
        for r in &self.regions {
            writeln!(f)?;
            writeln!(f, "@{} ({} run{} per step)", r.region, r.runs, if r.runs == 1 { "" } else { "s" })?;
            let kw = r.kernels.iter().map(|k| k.name.len() + 1).max().unwrap_or(0);
            for k in &r.kernels {
                writeln!(f, "  {:<kw$}  {:<13}  {:>10}  {}", format!("@{}", k.name), k.kind.name(), human(k.bytes), k.ops.join(" "))?;
            }
        }
        Ok(())
    }
}
