//! The `--profile` kernel table, shared by the CPU and CUDA backends and the ranks of a mesh.

use std::fmt::Write;

use crate::artifact::Artifact;
use crate::backend::KernelTime;

/// Matmul FLOPs of one launch of `k` (GEMMs and attention; the attention backward counted as
/// 2.5x its forward, FlashAttention's convention), for the profile's TFLOP/s column.
pub fn kernel_flops(artifact: &Artifact, k: &titan_ir::artifact::Kernel) -> Option<f64> {
    if let Some(gm) = &k.gemm {
        return Some(2.0 * (gm.m * gm.n * gm.k * gm.batch.max(1)) as f64);
    }
    let g = &artifact.graph;
    let r = g.block(g.block_by_name(&k.body)?);
    let node = r.node(*r.order.first()?);
    let (causal, mult) = match node.op {
        titan_ir::Op::Attention { causal, .. } => (causal, 1.0),
        titan_ir::Op::AttentionBwd { causal, .. } => (causal, 2.5),
        _ => return None,
    };
    let q = r.ty(*node.inputs.first()?).resolve(&g.dims).ok()?;
    let [b, s, h, d] = q[..] else { return None };
    Some(mult * 4.0 * (b * s * s * h * d) as f64 * if causal { 0.5 } else { 1.0 })
}

/// The `--profile` table: time per kernel per step, its share, and its achieved rate (GB/s of
/// the bytes its body reads and writes; TFLOP/s for GEMMs and attention), every kernel that ran,
/// the most expensive first.
/// `other` is the time in copies and memsets, `steps` the number of profiled steps.
pub fn kernel_table(artifact: &Artifact, times: &[KernelTime], other: Option<KernelTime>, steps: u64, backend: &str) -> String {
    let mut out = String::new();
    let steps = steps.max(1) as f64;
    let total: f64 = times.iter().map(|t| t.seconds).sum::<f64>() + other.map_or(0.0, |o| o.seconds);
    let mut rows: Vec<_> = artifact.manifest.kernels.iter().zip(times).filter(|(_, t)| t.launches > 0).collect();
    rows.sort_by(|a, b| b.1.seconds.total_cmp(&a.1.seconds));
    let _ = writeln!(out, "titan-run: time per kernel on the {backend} backend, mean of {steps} profiled step(s): {:.3} ms per step", 1e3 * total / steps);
    let _ = writeln!(out, "  {:>10} {:>6} {:>8} {:>9} {:>9}  kernel (kind)", "ms/step", "share", "launches", "GB/s", "TFLOP/s");
    for (k, t) in &rows {
        let per_launch = t.seconds / t.launches as f64;
        let gbs = (k.bytes_read + k.bytes_written) as f64 / per_launch / 1e9;
        let tflops = kernel_flops(artifact, k).map_or(String::new(), |f| format!("{:.1}", f / per_launch / 1e12));
        let _ = writeln!(
            out,
            "  {:>10.3} {:>5.1}% {:>8} {:>9.1} {:>9}  {} ({})",
            1e3 * t.seconds / steps,
            100.0 * t.seconds / total.max(1e-12),
            (t.launches as f64 / steps).round(),
            gbs,
            tflops,
            k.name,
            k.kind.name()
        );
    }
    if let Some(o) = other.filter(|o| o.launches > 0) {
        let _ = writeln!(
            out,
            "  {:>10.3} {:>5.1}% {:>8}  copies and memsets of the schedule",
            1e3 * o.seconds / steps,
            100.0 * o.seconds / total.max(1e-12),
            (o.launches as f64 / steps).round()
        );
    }
    out
}

/// The measured timeline of one profiled step for `--trace`: `times[i]` is `(start, seconds)` of
/// operation `i` of the unrolled schedule (`titan_ir::artifact::timeline::unroll`, the order both
/// backends run it in), relative to the step's start; the names, classes and streams are the
/// ones `titanc simulate` predicts, so the two traces compare operation by operation. `None`
/// when the count does not match the schedule (no complete profiled step yet).
pub fn measured_spans(artifact: &Artifact, rank: usize, times: &[(f64, f64)]) -> Option<Vec<titan_ir::artifact::timeline::Span>> {
    use titan_ir::artifact::timeline::{Span, op_class, unroll};
    let m = &artifact.manifest;
    let ops = unroll(m, rank.min(m.ranks.len().saturating_sub(1))).ok()?;
    if ops.len() != times.len() {
        return None;
    }
    let spans = ops
        .iter()
        .zip(times)
        .map(|(op, &(start_s, dur_s))| Span {
            name: op.name.clone(),
            class: op_class(m, op).into(),
            stream: op.comm_stream().map_or("compute", titan_ir::artifact::timeline::comm_stream_name).into(),
            start_s,
            dur_s,
            at: op.at.clone(),
        })
        .collect();
    Some(spans)
}
