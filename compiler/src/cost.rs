//! The step-time cost model and simulator: one rank's step predicted from the artifact alone.
//!
//! Every operation of the unrolled schedule ([`titan_ir::artifact::timeline::unroll`]) gets a
//! duration from a [`CostModel`]: GEMMs by FLOPs at a rate per dtype and size class,
//! attention by its causal FLOPs at the attention kernels' rates, everything memory-bound
//! (fused kernels, gathers, the optimizer, copies) by its bytes at an effective bandwidth,
//! collectives by the bytes a ring sends over the link their mesh dim runs on plus a latency
//! per ring hop (a `ring_shift` is one hop); each launch adds a fixed overhead. [`simulate`]
//! then lays the operations on the compute stream and the collectives streams with the CUDA
//! backend's rule ([`join_points`]): collectives run in order on their mesh dim's stream (`tp`
//! apart from the data-parallel dims, [`timeline::comm_stream`]), each after the compute
//! enqueued before it, and the compute stream waits for one just before the first later
//! operation that touches its bytes. What the compute stream waits is the exposed
//! communication; the rest is hidden behind compute. The two collectives streams do not share
//! a link in the model: `tp` runs inside a node, the data-parallel dims beyond it.
//!
//! Parameters are a versioned JSON file (`compiler/cost/*.json`; `h100` and `h200` built in,
//! `h200`'s measured on our H200 in 2026-12-01/02's step and `h100`'s fitted to a Llama-3.2
//! 1B step on an H100 in session 32, each file says how), and [`calibrate`] fits them to a
//! measured trace (`titan-run --trace`) of the same artifact. Not modeled: NCCL kernels taking
//! SMs from compute, clock changes under load, and the CPU launch path (CUDA graphs make it
//! small).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};
use titan_ir::KernelKind;
use titan_ir::artifact::Manifest;
use titan_ir::artifact::timeline::{self, OpKind, Span, UnrolledOp, join_points};

/// The format version of cost model files this titanc reads.
pub const COST_MODEL_FORMAT: u32 = 1;

/// GEMM throughput for one dtype class above a size: the largest `min_gflop` at or below a
/// GEMM's FLOPs applies.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmRate {
    /// `bf16` or `fp8`.
    pub dtype: String,
    /// GFLOP (of one GEMM call, all batches) from which this rate applies.
    pub min_gflop: f64,
    pub tflops: f64,
}

/// A link collectives run over.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Bytes per second one rank sends (NCCL's bus bandwidth).
    pub gbps: f64,
    /// Per ring hop.
    pub latency_us: f64,
}

/// The parameters of the model (see the module documentation).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    pub format: u32,
    pub name: String,
    /// Where the numbers come from.
    pub source: String,
    /// Dense bf16 peak, for MFU.
    pub peak_bf16_tflops: f64,
    pub gemm: Vec<GemmRate>,
    pub attention_fwd_tflops: f64,
    pub attention_bwd_tflops: f64,
    /// Effective bandwidth of memory-bound kernels, GB/s.
    pub memory_gbps: f64,
    /// Fixed cost of every operation on a stream, microseconds.
    pub launch_us: f64,
    /// GPUs per node: a mesh dim whose ranks span more than one node runs over `network`.
    pub gpus_per_node: u32,
    pub nvlink: Link,
    pub network: Link,
}

const H100: &str = include_str!("../cost/h100.json");
const H200: &str = include_str!("../cost/h200.json");

/// Why a cost model or a simulation cannot be had.
#[derive(Debug, thiserror::Error)]
pub enum CostError {
    #[error("cannot read `{path}`: {message}")]
    Io { path: String, message: String },
    #[error("`{path}` is not a cost model: {message}")]
    Malformed { path: String, message: String },
    #[error("`{path}`: cost model format {found} is not supported (this titanc reads format {COST_MODEL_FORMAT})")]
    Version { path: String, found: u32 },
    #[error("{0}")]
    Schedule(String),
}

impl CostModel {
    fn parse(path: &str, text: &str) -> Result<CostModel, CostError> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| CostError::Malformed { path: path.into(), message: e.to_string() })?;
        let found = v.get("format").and_then(serde_json::Value::as_u64).unwrap_or(0);
        if found != u64::from(COST_MODEL_FORMAT) {
            return Err(CostError::Version { path: path.into(), found: u32::try_from(found).unwrap_or(u32::MAX) });
        }
        let m: CostModel = serde_json::from_value(v).map_err(|e| CostError::Malformed { path: path.into(), message: e.to_string() })?;
        m.check().map_err(|message| CostError::Malformed { path: path.into(), message })?;
        Ok(m)
    }

    fn check(&self) -> Result<(), String> {
        let rates = [
            ("peak_bf16_tflops", self.peak_bf16_tflops),
            ("attention_fwd_tflops", self.attention_fwd_tflops),
            ("attention_bwd_tflops", self.attention_bwd_tflops),
            ("memory_gbps", self.memory_gbps),
            ("nvlink.gbps", self.nvlink.gbps),
            ("network.gbps", self.network.gbps),
        ];
        for (k, v) in rates.into_iter().chain(self.gemm.iter().map(|g| ("gemm.tflops", g.tflops))) {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("`{k}` must be a positive number, found {v}"));
            }
        }
        for (k, v) in [("launch_us", self.launch_us), ("nvlink.latency_us", self.nvlink.latency_us), ("network.latency_us", self.network.latency_us)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("`{k}` must be a number >= 0, found {v}"));
            }
        }
        if self.gpus_per_node == 0 {
            return Err("`gpus_per_node` must be at least 1".into());
        }
        if !self.gemm.iter().any(|g| g.dtype == "bf16") {
            return Err("`gemm` needs at least one `bf16` rate".into());
        }
        Ok(())
    }

    /// `h100`, `h200` (built in), or a file.
    pub fn load(spec: &str) -> Result<CostModel, CostError> {
        match spec {
            "h100" => CostModel::parse("built-in h100", H100),
            "h200" => CostModel::parse("built-in h200", H200),
            path => {
                let text = std::fs::read_to_string(path).map_err(|e| CostError::Io { path: path.into(), message: e.to_string() })?;
                CostModel::parse(path, &text)
            }
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    fn gemm_tflops(&self, dtype: &str, gflop: f64) -> f64 {
        let pick = |d: &str| self.gemm.iter().filter(|g| g.dtype == d && g.min_gflop <= gflop).max_by(|a, b| a.min_gflop.total_cmp(&b.min_gflop));
        pick(dtype)
            .or_else(|| pick("bf16"))
            .or_else(|| self.gemm.iter().filter(|g| g.dtype == "bf16").min_by(|a, b| a.min_gflop.total_cmp(&b.min_gflop)))
            .map_or(1.0, |g| g.tflops)
    }
}

/// What an operation costs: FLOPs (at a rate of `class`) or bytes (at a bandwidth).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Work {
    Gemm { flops: f64, fp8: bool },
    AttentionFwd { flops: f64 },
    AttentionBwd { flops: f64 },
    Memory { bytes: f64 },
    Comm { bytes: f64, hops: f64, network: bool },
}

fn dim_of(m: &Manifest, key: &str) -> f64 {
    m.model.get(key).and_then(serde_json::Value::as_f64).unwrap_or(0.0)
}

/// Causal attention FLOPs of one layer's forward on this rank: `2 b h s^2 d` (QK^T and PV,
/// half the score matrix); the backward is 2.5 times that.
fn attention_flops(m: &Manifest) -> f64 {
    let tp = m.mesh.dims.iter().find(|d| d.name == "tp").map_or(1, |d| d.size).max(1);
    let dp: u32 = m.mesh.dims.iter().filter(|d| d.name != "tp").map(|d| d.size).product();
    let b = m.training.batch as f64 / f64::from(dp.max(1));
    let s = m.training.seq_len as f64;
    2.0 * b * (dim_of(m, "n_heads") / f64::from(tp)) * s * s * dim_of(m, "head_dim")
}

/// Whether the ranks of `mesh_dim` span more than one node (mesh dims are laid out innermost
/// last: `tp` is contiguous, `dp_shard` strides over tp, ...).
fn crosses_nodes(m: &Manifest, mesh_dim: &str, gpus_per_node: u32) -> bool {
    let Some(i) = m.mesh.dims.iter().position(|d| d.name == mesh_dim) else { return false };
    let inner: u32 = m.mesh.dims[i + 1..].iter().map(|d| d.size).product();
    inner.saturating_mul(m.mesh.dims[i].size) > gpus_per_node
}

fn work(m: &Manifest, op: &UnrolledOp, gpus_per_node: u32) -> Work {
    match &op.kind {
        OpKind::Launch { kernel } => {
            let k = &m.kernels[*kernel];
            match (k.kind, &k.gemm) {
                (KernelKind::Gemm, Some(g)) => {
                    let fp8 = g.a_dtype.size_bytes() == 1;
                    Work::Gemm { flops: 2.0 * (g.m * g.n * g.k * g.batch.max(1)) as f64, fp8 }
                }
                (KernelKind::Attention, _) => Work::AttentionFwd { flops: attention_flops(m) },
                (KernelKind::AttentionBwd, _) => Work::AttentionBwd { flops: 2.5 * attention_flops(m) },
                // A gather reads the rows it writes, not the table.
                (KernelKind::Gather, _) => Work::Memory { bytes: 2.0 * k.bytes_written as f64 },
                // A scatter written over the tensor it adds to (fusion rule 12) reads its
                // indices and sources and reads and writes at most one table row per source.
                (KernelKind::ScatterAdd, _) if op.reads >= 3 && op.ranges.len() == op.reads + 1 && op.ranges[op.reads] == op.ranges[op.reads - 1] => {
                    let small: u64 = op.ranges[..op.reads - 1].iter().map(|r| r.1).sum();
                    Work::Memory { bytes: (small + 2 * op.ranges[1].1.min(op.ranges[op.reads].1)) as f64 }
                }
                _ => Work::Memory { bytes: (k.bytes_read + k.bytes_written) as f64 },
            }
        }
        OpKind::Copy { bytes } => Work::Memory { bytes: 2.0 * *bytes as f64 },
        OpKind::Memset { bytes } => Work::Memory { bytes: *bytes as f64 },
        OpKind::Collective { communicates: false, bytes, .. } => Work::Memory { bytes: 2.0 * *bytes as f64 },
        OpKind::Collective { collective, mesh_dim, group, send_bytes, .. } => {
            use titan_ir::artifact::CollectiveOp;
            let hops = match collective {
                CollectiveOp::RingShift => 1.0,
                CollectiveOp::AllReduce => 2.0 * f64::from(group.saturating_sub(1)),
                _ => f64::from(group.saturating_sub(1)),
            };
            Work::Comm { bytes: *send_bytes as f64, hops, network: crosses_nodes(m, mesh_dim, gpus_per_node) }
        }
    }
}

fn seconds(c: &CostModel, w: Work) -> f64 {
    let launch = c.launch_us * 1e-6;
    launch
        + match w {
            Work::Gemm { flops, fp8 } => flops / (c.gemm_tflops(if fp8 { "fp8" } else { "bf16" }, flops * 1e-9) * 1e12),
            Work::AttentionFwd { flops } => flops / (c.attention_fwd_tflops * 1e12),
            Work::AttentionBwd { flops } => flops / (c.attention_bwd_tflops * 1e12),
            Work::Memory { bytes } => bytes / (c.memory_gbps * 1e9),
            Work::Comm { bytes, hops, network } => {
                let l = if network { &c.network } else { &c.nvlink };
                hops * l.latency_us * 1e-6 + bytes / (l.gbps * 1e9)
            }
        }
}

/// A predicted (or measured) step.
#[derive(Clone, Debug)]
pub struct Simulation {
    pub spans: Vec<Span>,
    pub step_s: f64,
    /// Busy time of the compute stream (without waits).
    pub compute_s: f64,
    /// Seconds each mesh dim's collectives keep their collectives stream busy.
    pub comm_s: BTreeMap<String, f64>,
    /// Of those, the seconds the compute stream waits for them.
    pub exposed_s: BTreeMap<String, f64>,
    /// Model FLOPs of the step on this rank, for MFU.
    pub model_flops: f64,
    pub peak_tflops: f64,
}

impl Simulation {
    pub fn mfu(&self) -> f64 {
        self.model_flops / (self.step_s * self.peak_tflops * 1e12)
    }

    /// The share of `dim`'s communication hidden behind compute (1 when it has none).
    pub fn hidden(&self, dim: &str) -> f64 {
        match self.comm_s.get(dim) {
            Some(&c) if c > 0.0 => 1.0 - self.exposed_s.get(dim).copied().unwrap_or(0.0) / c,
            _ => 1.0,
        }
    }

    /// `predicted step 164.2 ms, MFU 50.1% (...)` and one line per mesh dim.
    pub fn summary(&self, model: &str) -> String {
        let mut s = format!(
            "predicted step: {:.2} ms on one rank, MFU {:.1}% ({} cost model; compute stream busy {:.2} ms)\n",
            self.step_s * 1e3,
            100.0 * self.mfu(),
            model,
            self.compute_s * 1e3
        );
        for (dim, c) in &self.comm_s {
            let e = self.exposed_s.get(dim).copied().unwrap_or(0.0);
            let _ = writeln!(s, "  {dim:<12} communication {:.2} ms, exposed {:.2} ms, hidden {:.1}%", c * 1e3, e * 1e3, 100.0 * self.hidden(dim));
        }
        s
    }
}

/// Lay rank `rank`'s step on its streams with the durations of `c`.
pub fn simulate(m: &Manifest, rank: usize, c: &CostModel) -> Result<Simulation, CostError> {
    let ops = timeline::unroll(m, rank).map_err(CostError::Schedule)?;
    let durations: Vec<f64> = ops.iter().map(|op| seconds(c, work(m, op, c.gpus_per_node))).collect();
    Ok(lay_out(m, &ops, &durations, c.peak_bf16_tflops))
}

/// Place `ops` with the given durations on the compute stream and the collectives streams
/// (see the module documentation).
fn lay_out(m: &Manifest, ops: &[UnrolledOp], durations: &[f64], peak_tflops: f64) -> Simulation {
    let stream: Vec<Option<usize>> = ops.iter().map(UnrolledOp::comm_stream).collect();
    let ranges: Vec<Vec<(u64, u64)>> = ops.iter().map(|o| o.ranges.clone()).collect();
    let reads: Vec<usize> = ops.iter().map(|o| o.reads).collect();
    let joins = join_points(&stream, &ranges, &reads);
    let (mut compute_t, mut busy) = (0.0f64, 0.0f64);
    let mut comm_t = [0.0f64; timeline::COMM_STREAMS];
    // Per collective: (end, mesh dim, stream).
    let mut ends: Vec<(f64, String, usize)> = Vec::new();
    let mut spans = Vec::with_capacity(ops.len());
    let mut comm_s = BTreeMap::new();
    let mut exposed_s: BTreeMap<String, f64> = BTreeMap::new();
    // Each collectives stream as (start, end, mesh dim), in order.
    let mut busy_comm: [Vec<(f64, f64, String)>; timeline::COMM_STREAMS] = Default::default();
    // Wait for the latest of `which`. The waited interval is exposed communication of whatever
    // that collective's stream runs in it (a collective queued behind others of its stream
    // exposes their time, not its own); where that stream is idle in it (the collective waits
    // for one of the other stream), of what the other stream runs; the rest of the collective
    // waited for.
    let mut wait =
        |compute_t: &mut f64, which: &[usize], ends: &[(f64, String, usize)], busy_comm: &[Vec<(f64, f64, String)>], spans: &mut Vec<Span>, at: &str| {
            if let Some((end, dim, s)) = which.iter().map(|&c| &ends[c]).max_by(|a, b| a.0.total_cmp(&b.0))
                && *end > *compute_t
            {
                let (t0, t1) = (*compute_t, *end);
                spans.push(Span { name: format!("wait for {dim}"), class: "wait".into(), stream: "wait".into(), start_s: t0, dur_s: t1 - t0, at: at.into() });
                // The idle gaps of stream `s` in [t0, t1].
                let mut gaps = Vec::new();
                let mut from = t0;
                for (b, e, d) in &busy_comm[*s] {
                    let o = e.min(t1) - b.max(t0);
                    if o > 0.0 {
                        *exposed_s.entry(d.clone()).or_default() += o;
                        if *b > from {
                            gaps.push((from, *b));
                        }
                        from = from.max(*e);
                    }
                }
                if t1 > from {
                    gaps.push((from, t1));
                }
                let mut rest = 0.0;
                for (g0, g1) in gaps {
                    let mut covered = 0.0;
                    for (b, e, d) in busy_comm.iter().enumerate().filter(|(k, _)| k != s).flat_map(|(_, v)| v) {
                        let o = e.min(g1) - b.max(g0);
                        if o > 0.0 {
                            *exposed_s.entry(d.clone()).or_default() += o;
                            covered += o;
                        }
                    }
                    rest += (g1 - g0 - covered).max(0.0);
                }
                if rest > 0.0 {
                    *exposed_s.entry(dim.clone()).or_default() += rest;
                }
                *compute_t = t1;
            }
        };
    for (j, op) in ops.iter().enumerate() {
        let class = timeline::op_class(m, op).to_string();
        let d = durations[j];
        if let Some(s) = stream[j] {
            let after_others = joins.comm_waits[ends.len()].iter().map(|&c| ends[c].0).fold(0.0, f64::max);
            let start = comm_t[s].max(compute_t).max(after_others);
            comm_t[s] = start + d;
            let dim = match &op.kind {
                OpKind::Collective { mesh_dim, .. } => mesh_dim.clone(),
                _ => String::new(),
            };
            *comm_s.entry(dim.clone()).or_default() += d;
            busy_comm[s].push((start, comm_t[s], dim.clone()));
            ends.push((comm_t[s], dim, s));
            spans.push(Span { name: op.name.clone(), class, stream: timeline::comm_stream_name(s).into(), start_s: start, dur_s: d, at: op.at.clone() });
        } else {
            wait(&mut compute_t, &joins.before[j], &ends, &busy_comm, &mut spans, &op.at);
            spans.push(Span { name: op.name.clone(), class, stream: "compute".into(), start_s: compute_t, dur_s: d, at: op.at.clone() });
            compute_t += d;
            busy += d;
        }
    }
    wait(&mut compute_t, &joins.at_end, &ends, &busy_comm, &mut spans, "end of step");
    let world = f64::from(m.mesh.world_size.max(1));
    Simulation {
        spans,
        step_s: comm_t.iter().fold(compute_t, |a, &b| a.max(b)),
        compute_s: busy,
        comm_s,
        exposed_s,
        model_flops: m.training.flops_per_token as f64 * m.training.tokens_per_step as f64 / world,
        peak_tflops,
    }
}

/// Predicted against measured, per kernel name (summed over the step), largest first.
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    pub rows: Vec<(String, String, usize, f64, f64)>,
    pub predicted_s: f64,
    pub measured_s: f64,
}

impl std::fmt::Display for Comparison {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{:<44} {:<13} {:>5} {:>12} {:>12} {:>8}", "kernel", "class", "calls", "predicted ms", "measured ms", "ratio")?;
        for (name, class, n, p, me) in &self.rows {
            writeln!(f, "{name:<44} {class:<13} {n:>5} {:>12.3} {:>12.3} {:>8.2}", p * 1e3, me * 1e3, p / me.max(1e-12))?;
        }
        writeln!(
            f,
            "step: predicted {:.2} ms, measured {:.2} ms ({:+.1}%)",
            self.predicted_s * 1e3,
            self.measured_s * 1e3,
            100.0 * (self.predicted_s / self.measured_s - 1.0)
        )
    }
}

/// The measured trace's compute and collective spans, checked to be the artifact's operations
/// in order (a trace of another artifact is refused).
fn measured_ops<'a>(ops: &[UnrolledOp], measured: &'a [Span]) -> Result<Vec<&'a Span>, CostError> {
    // Compute spans, then each collectives stream's.
    let lane = |stream: &str| match stream {
        "compute" => Some(0),
        "comm" => Some(1 + timeline::DATA_STREAM),
        "comm_tp" => Some(1 + timeline::TP_STREAM),
        _ => None,
    };
    let mut by_stream: Vec<Vec<&Span>> = vec![Vec::new(); 1 + timeline::COMM_STREAMS];
    for s in measured {
        if let Some(k) = lane(&s.stream) {
            by_stream[k].push(s);
        }
    }
    let mut next = vec![0usize; by_stream.len()];
    let mut out = Vec::with_capacity(ops.len());
    for (j, op) in ops.iter().enumerate() {
        let k = op.comm_stream().map_or(0, |s| 1 + s);
        let s =
            by_stream[k].get(next[k]).ok_or_else(|| CostError::Schedule(format!("the measured trace ends before operation {j} ({} at {})", op.name, op.at)))?;
        if s.name != op.name {
            return Err(CostError::Schedule(format!(
                "operation {j} is `{}` ({}) in the artifact but `{}` in the measured trace: a trace of another artifact?",
                op.name, op.at, s.name
            )));
        }
        next[k] += 1;
        out.push(*s);
    }
    Ok(out)
}

/// Compare the prediction of `c` with a measured trace of the same artifact.
pub fn compare(m: &Manifest, rank: usize, c: &CostModel, measured: &[Span]) -> Result<Comparison, CostError> {
    let ops = timeline::unroll(m, rank).map_err(CostError::Schedule)?;
    let meas = measured_ops(&ops, measured)?;
    let sim = simulate(m, rank, c)?;
    let predicted: Vec<&Span> = sim.spans.iter().filter(|s| s.stream != "wait").collect();
    let mut rows: BTreeMap<String, (String, usize, f64, f64)> = BTreeMap::new();
    // Predicted spans are in op order too (compute and comm interleaved as the ops are).
    for ((op, p), me) in ops.iter().zip(predicted).zip(meas) {
        let e = rows.entry(op.name.clone()).or_insert_with(|| (p.class.clone(), 0, 0.0, 0.0));
        e.1 += 1;
        e.2 += p.dur_s;
        e.3 += me.dur_s;
    }
    let mut rows: Vec<(String, String, usize, f64, f64)> = rows.into_iter().map(|(n, (c, k, p, me))| (n, c, k, p, me)).collect();
    rows.sort_by(|a, b| b.4.total_cmp(&a.4));
    let measured_s = measured.iter().map(|s| s.start_s + s.dur_s).fold(0.0, f64::max) - measured.iter().map(|s| s.start_s).fold(f64::INFINITY, f64::min);
    Ok(Comparison { rows, predicted_s: sim.step_s, measured_s })
}

/// `base` with its rates fitted to a measured trace of `m`: per work class, the work of its
/// operations over their measured time less the launch overhead (GEMMs per dtype and size
/// class, attention forward and backward, memory-bound bandwidth, each link's bandwidth).
/// Classes the trace does not exercise keep `base`'s value.
pub fn calibrate(m: &Manifest, rank: usize, base: &CostModel, measured: &[Span]) -> Result<CostModel, CostError> {
    let ops = timeline::unroll(m, rank).map_err(CostError::Schedule)?;
    let meas = measured_ops(&ops, measured)?;
    let launch = base.launch_us * 1e-6;
    // (work, seconds) per key.
    let mut sums: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for (op, s) in ops.iter().zip(meas) {
        let t = (s.dur_s - launch).max(0.0);
        let (key, amount) = match work(m, op, base.gpus_per_node) {
            Work::Gemm { flops, fp8 } => {
                let d = if fp8 { "fp8" } else { "bf16" };
                let class = base.gemm.iter().filter(|g| g.dtype == d && g.min_gflop <= flops * 1e-9).map(|g| g.min_gflop).fold(0.0, f64::max);
                (format!("gemm {d} {class}"), flops)
            }
            Work::AttentionFwd { flops } => ("attention_fwd".into(), flops),
            Work::AttentionBwd { flops } => ("attention_bwd".into(), flops),
            Work::Memory { bytes } => ("memory".into(), bytes),
            Work::Comm { bytes, network, .. } => ((if network { "network" } else { "nvlink" }).into(), bytes),
        };
        let e = sums.entry(key).or_default();
        e.0 += amount;
        e.1 += t;
    }
    let rate = |k: &str| sums.get(k).filter(|(w, t)| *w > 0.0 && *t > 0.0).map(|(w, t)| w / t);
    let mut c = base.clone();
    for g in &mut c.gemm {
        if let Some(r) = rate(&format!("gemm {} {}", g.dtype, g.min_gflop)) {
            g.tflops = r * 1e-12;
        }
    }
    if let Some(r) = rate("attention_fwd") {
        c.attention_fwd_tflops = r * 1e-12;
    }
    if let Some(r) = rate("attention_bwd") {
        c.attention_bwd_tflops = r * 1e-12;
    }
    if let Some(r) = rate("memory") {
        c.memory_gbps = r * 1e-9;
    }
    if let Some(r) = rate("nvlink") {
        c.nvlink.gbps = r * 1e-9;
    }
    if let Some(r) = rate("network") {
        c.network.gbps = r * 1e-9;
    }
    c.name = format!("{} calibrated", base.name);
    c.source =
        format!("{}; rates fitted to a measured trace of `{}` ({} operations)", base.source, m.content_hash.get(..16).unwrap_or(&m.content_hash), ops.len());
    Ok(c)
}

/// Write `sim` as a Chrome trace.
pub fn write_trace(path: &Path, rank: usize, sim: &Simulation, model: &str) -> Result<(), CostError> {
    let text = timeline::chrome_trace(rank, &format!("predicted, {model}"), &sim.spans);
    std::fs::write(path, text).map_err(|e| CostError::Io { path: path.display().to_string(), message: e.to_string() })
}

#[cfg(test)]
mod tests;
