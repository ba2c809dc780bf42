//! `--profile` on a GPU rank of a mesh: how long each collective keeps the collectives' stream
//! busy, and how long the compute stream waits for collectives (the communication that is not
//! hidden behind compute). The CUDA backend records the events; this module sums them and
//! formats the report.
//!
//! Attribution: a collective starts on the collectives' stream after the compute enqueued before
//! it and the compute stream waits for it just before the first later op that touches its
//! buffers (`collective::join_points`). The profile records an event before those waits and one
//! after, so the wait is its own interval and not part of the preceding kernel's time.

use std::collections::BTreeMap;
use std::fmt::Write;

/// One communicating collective step of the schedule (in the order the step enqueues them).
#[derive(Clone, Debug, PartialEq)]
pub struct CollectiveInfo {
    /// `all_gather`, `reduce_scatter`, `all_reduce`.
    pub op: &'static str,
    /// The mesh dim it runs over.
    pub dim: &'static str,
    /// The size of the whole buffer it moves (NCCL-tests' "size": the gathered output, the
    /// scattered input, the reduced buffer), for the algorithm bandwidth.
    pub bytes: u64,
    /// Where it comes from in the schedule.
    pub at: String,
}

/// A place where the compute stream waits for collectives.
#[derive(Clone, Debug, PartialEq)]
pub struct WaitPoint {
    /// The op the wait precedes (`end of step` for the waits after the last op).
    pub before: String,
    /// The collectives waited for (indices into the step's [`CollectiveInfo`]s).
    pub collectives: Vec<usize>,
}

/// Sums over the profiled steps.
#[derive(Clone, Debug, Default)]
pub struct CommProfile {
    /// Seconds each collective kept the collectives' stream busy.
    pub busy: Vec<f64>,
    /// Seconds the compute stream waited at each wait point.
    pub waited: Vec<f64>,
}

impl CommProfile {
    pub fn new(collectives: usize, waits: usize) -> CommProfile {
        CommProfile { busy: vec![0.0; collectives], waited: vec![0.0; waits] }
    }
}

fn ms(seconds: f64, steps: u64) -> f64 {
    1e3 * seconds / steps.max(1) as f64
}

/// One line for the other ranks of a run: compute, communication, exposed waits per step.
pub fn summary(profile: &CommProfile, compute_s: f64, steps: u64) -> String {
    let busy: f64 = profile.busy.iter().sum();
    let waited: f64 = profile.waited.iter().sum();
    format!(
        "{:.3} ms per step in kernels and copies, {:.3} ms on the collectives' stream, {:.3} ms waiting for collectives (exposed)",
        ms(compute_s, steps),
        ms(busy, steps),
        ms(waited, steps)
    )
}

/// The report: collectives grouped by op and mesh dim (time on their stream, calls, algorithm
/// bandwidth), then the `top` longest waits of the compute stream and what they waited for.
pub fn report(infos: &[CollectiveInfo], waits: &[WaitPoint], profile: &CommProfile, compute_s: f64, steps: u64, top: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "collectives, mean of {steps} profiled step(s): {}", summary(profile, compute_s, steps));
    let mut groups: BTreeMap<(&str, &str), (f64, u64, u64)> = BTreeMap::new();
    for (c, info) in infos.iter().enumerate() {
        let g = groups.entry((info.dim, info.op)).or_default();
        g.0 += profile.busy.get(c).copied().unwrap_or(0.0);
        g.1 += 1;
        g.2 += info.bytes;
    }
    let _ = writeln!(out, "  {:>10} {:>6} {:>10} {:>9}  collective", "ms/step", "calls", "MiB/step", "algo GB/s");
    for ((dim, op), (secs, calls, bytes)) in &groups {
        let per_step = secs / steps.max(1) as f64;
        let rate = if per_step > 0.0 { *bytes as f64 / per_step / 1e9 } else { 0.0 };
        let _ = writeln!(out, "  {:>10.3} {:>6} {:>10.1} {:>9.1}  {op} over {dim}", 1e3 * per_step, calls, *bytes as f64 / (1u64 << 20) as f64, rate);
    }
    let mut order: Vec<usize> = (0..waits.len()).filter(|&w| profile.waited.get(w).is_some_and(|&s| s > 0.0)).collect();
    order.sort_by(|&a, &b| profile.waited[b].total_cmp(&profile.waited[a]).then(a.cmp(&b)));
    if !order.is_empty() {
        let _ = writeln!(out, "  the {} longest waits of the compute stream for collectives:", top.min(order.len()));
        for &w in order.iter().take(top) {
            let what: Vec<String> = waits[w].collectives.iter().filter_map(|&c| infos.get(c)).map(|i| format!("{} over {} ({})", i.op, i.dim, i.at)).collect();
            let _ = writeln!(out, "  {:>10.3} ms/step before {}: {}", ms(profile.waited[w], steps), waits[w].before, what.join(", "));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(op: &'static str, dim: &'static str, bytes: u64, at: &str) -> CollectiveInfo {
        CollectiveInfo { op, dim, bytes, at: at.into() }
    }

    #[test]
    fn the_report_groups_collectives_and_ranks_the_waits() {
        let infos = [
            info("all_gather", "dp_shard", 1 << 30, "layer.%wq"),
            info("all_gather", "dp_shard", 1 << 30, "layer.%w1"),
            info("reduce_scatter", "tp", 1 << 20, "layer.%7"),
        ];
        let waits = [
            WaitPoint { before: "kernel `layer.k3`".into(), collectives: vec![0] },
            WaitPoint { before: "kernel `layer.k9`".into(), collectives: vec![1, 2] },
            WaitPoint { before: "end of step".into(), collectives: vec![] },
        ];
        // Two steps: each all_gather 5 ms per step, the reduce_scatter 1 ms; waits 0.5 and 3 ms.
        let p = CommProfile { busy: vec![0.010, 0.010, 0.002], waited: vec![0.001, 0.006, 0.0] };
        let r = report(&infos, &waits, &p, 0.100, 2, 5);
        assert!(
            r.starts_with(
                "collectives, mean of 2 profiled step(s): 50.000 ms per step in kernels and copies, 11.000 ms on the collectives' stream, 3.500 ms waiting"
            ),
            "{r}"
        );
        // 2 GiB per step in 10 ms: 214.7 GB/s.
        assert!(r.contains("      10.000      2     2048.0     214.7  all_gather over dp_shard"), "{r}");
        assert!(r.contains("       1.000      1        1.0       1.0  reduce_scatter over tp"), "{r}");
        let longest = r.find("3.000 ms/step before kernel `layer.k9`: all_gather over dp_shard (layer.%w1), reduce_scatter over tp (layer.%7)").expect(&r);
        let next = r.find("0.500 ms/step before kernel `layer.k3`: all_gather over dp_shard (layer.%wq)").expect(&r);
        assert!(longest < next, "longest first: {r}");
        assert!(!r.contains("end of step"), "waits that never stalled are left out: {r}");
        assert!(r.contains("the 2 longest waits"), "{r}");
    }
}
