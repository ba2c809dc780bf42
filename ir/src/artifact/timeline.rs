//! One step of a rank's schedule as a flat list of operations, and step timelines as Chrome
//! trace files.
//!
//! [`unroll`] flattens the schedule the way both backends run it (loops unrolled in
//! [`loop_runs`](super::loop_runs) order, layer slices and carry slots resolved) and gives every
//! operation the byte ranges it touches, in one address space where arena `a` starts at the sum
//! of the earlier arenas' sizes. [`join_points`] is the stream rule of the CUDA backend: a
//! collective runs on its mesh dim's collectives stream ([`comm_stream`]: `tp` on one, the
//! data-parallel dims on another) after the compute enqueued before it, and the compute stream
//! waits for it just before the first later compute operation that touches its bytes; a
//! collective that touches the bytes of an earlier one on the other stream, not yet joined,
//! waits for it. The compiler's step-time simulator and the runtime use the same functions, so
//! the predicted and the measured timeline have the same operations, in the same order, with
//! the same names.
//!
//! [`chrome_trace`] writes a timeline in the Chrome trace event format (`ph: "X"` complete
//! events, microseconds), which Perfetto and `chrome://tracing` open; `titanc build --trace`
//! writes the predicted step and `titan-run --trace` the measured one.

use serde::{Deserialize, Serialize};

use super::{BufRef, CollectiveOp, Manifest, Step, loop_runs};

/// What an unrolled operation does.
#[derive(Clone, Debug, PartialEq)]
pub enum OpKind {
    /// Kernel `kernel` of the manifest.
    Launch {
        kernel: usize,
    },
    Copy {
        bytes: u64,
    },
    Memset {
        bytes: u64,
    },
    /// A collective step; `communicates` is false for the rank-local `take_shard` /
    /// `place_shard` / `ring_slice` / `ring_concat`, which run on the compute stream.
    Collective {
        collective: CollectiveOp,
        mesh_dim: String,
        group: u32,
        send_bytes: u64,
        bytes: u64,
        communicates: bool,
    },
}

/// One operation of the unrolled step.
#[derive(Clone, Debug, PartialEq)]
pub struct UnrolledOp {
    pub kind: OpKind,
    /// Its name in timelines: the kernel's name, `copy`, `memset`, or the collective with its
    /// mesh dim (`all_gather(tp)`).
    pub name: String,
    /// Where it comes from: `schedule step 4.2, layer 1`.
    pub at: String,
    /// The byte ranges `(start, len)` it reads (the first `reads`) and writes (the rest).
    pub ranges: Vec<(u64, u64)>,
    pub reads: usize,
}

impl UnrolledOp {
    /// Runs on a collectives stream.
    pub fn on_comm_stream(&self) -> bool {
        self.comm_stream().is_some()
    }

    /// The collectives stream it runs on ([`comm_stream`]); `None` for compute.
    pub fn comm_stream(&self) -> Option<usize> {
        match &self.kind {
            OpKind::Collective { communicates: true, mesh_dim, .. } => Some(comm_stream(mesh_dim)),
            _ => None,
        }
    }
}

/// The collectives streams: the data-parallel dims' (`dp_replicate`, `dp_shard`) and `tp`'s.
pub const COMM_STREAMS: usize = 2;
/// [`comm_stream`] of the data-parallel dims.
pub const DATA_STREAM: usize = 0;
/// [`comm_stream`] of `tp`.
pub const TP_STREAM: usize = 1;

/// The collectives stream of a mesh dim's collectives. Each mesh dim has its own NCCL
/// communicator, so collectives of different dims need not queue behind each other: `tp`'s
/// (sequence-parallel gathers, async TP's ring shifts, over NVLink inside a node) run apart
/// from the data-parallel ones (FSDP gathers and reduce-scatters, gradient all-reduces). The
/// two data-parallel dims share a stream: both cross the same network link when they leave the
/// node, which one queue models and two would overcommit.
pub fn comm_stream(mesh_dim: &str) -> usize {
    if mesh_dim == "tp" { TP_STREAM } else { DATA_STREAM }
}

/// The trace name of collectives stream `s` ([`Span::stream`]).
pub fn comm_stream_name(s: usize) -> &'static str {
    if s == TP_STREAM { "comm_tp" } else { "comm" }
}

#[derive(Clone, Copy)]
struct Frame<'s> {
    layer: usize,
    t: usize,
    carries: &'s [[u32; 2]],
}

struct Unroller<'m> {
    m: &'m Manifest,
    base: Vec<u64>,
    tp_coord: u32,
}

impl Unroller<'_> {
    fn whole(&self, id: u32) -> Result<(u64, u64), String> {
        let b = self.m.buffers.get(id as usize).ok_or_else(|| format!("buffer {id} does not exist"))?;
        let arena = self
            .m
            .memory
            .arenas
            .iter()
            .position(|a| a.arena == b.arena)
            .ok_or_else(|| format!("buffer {id}: arena `{}` is not planned", super::arena_name(b.arena)))?;
        Ok((self.base[arena] + b.offset, b.bytes))
    }

    fn view(&self, r: &BufRef, frame: Option<Frame<'_>>) -> Result<(u64, u64), String> {
        match *r {
            BufRef::Buffer { buffer, .. } | BufRef::View { buffer, .. } => {
                let (p, len) = self.whole(buffer)?;
                let lead = self.m.buffers[buffer as usize].shape.first().copied().unwrap_or(0);
                let (o, n) = r.range_in(len, lead, frame.map(|f| f.layer), self.tp_coord)?;
                Ok((p + o, n))
            }
            BufRef::Carry { carry, out } => {
                let f = frame.ok_or_else(|| format!("carry {carry} outside any loop"))?;
                let pair = f.carries.get(carry as usize).ok_or_else(|| format!("carry {carry} does not exist"))?;
                self.whole(pair[(f.t + usize::from(out)) % 2])
            }
        }
    }

    fn unroll(&self, steps: &[Step], frame: Option<Frame<'_>>, path: &mut Vec<usize>, ops: &mut Vec<UnrolledOp>) -> Result<(), String> {
        for (i, s) in steps.iter().enumerate() {
            path.push(i);
            let p: Vec<String> = path.iter().map(ToString::to_string).collect();
            let at = match frame {
                Some(f) => format!("schedule step {}, layer {}", p.join("."), f.layer),
                None => format!("schedule step {}", p.join(".")),
            };
            let views = |refs: &[BufRef]| refs.iter().map(|r| self.view(r, frame)).collect::<Result<Vec<_>, _>>();
            match s {
                Step::Launch { kernel, inputs, outputs, .. } => {
                    let k = self.m.kernels.get(*kernel as usize).ok_or_else(|| format!("{at}: kernel {kernel} does not exist"))?;
                    let mut ranges = views(inputs)?;
                    let reads = ranges.len();
                    ranges.extend(views(outputs)?);
                    ops.push(UnrolledOp { kind: OpKind::Launch { kernel: *kernel as usize }, name: k.name.clone(), at, ranges, reads });
                }
                Step::Copy { src, dst, bytes, .. } => {
                    let ranges = vec![(self.view(src, frame)?.0, *bytes), (self.view(dst, frame)?.0, *bytes)];
                    ops.push(UnrolledOp { kind: OpKind::Copy { bytes: *bytes }, name: "copy".into(), at, ranges, reads: 1 });
                }
                Step::Memset { dst, bytes, .. } => {
                    let ranges = vec![(self.view(dst, frame)?.0, *bytes)];
                    ops.push(UnrolledOp { kind: OpKind::Memset { bytes: *bytes }, name: "memset".into(), at, ranges, reads: 0 });
                }
                Step::Collective { collective, mesh_dim, group, dtype, in_shape, out_shape, input, more_inputs, output, send_bytes, .. } => {
                    let e = dtype.size_bytes() as u64;
                    let (ni, no) = (in_shape.iter().product::<u64>() * e, out_shape.iter().product::<u64>() * e);
                    let mut ranges = vec![(self.view(input, frame)?.0, ni)];
                    for r in more_inputs {
                        ranges.push((self.view(r, frame)?.0, ni));
                    }
                    let reads = ranges.len();
                    ranges.push((self.view(output, frame)?.0, no));
                    let communicates = *group > 1
                        && matches!(collective, CollectiveOp::AllGather | CollectiveOp::ReduceScatter | CollectiveOp::AllReduce | CollectiveOp::RingShift);
                    let kind = OpKind::Collective {
                        collective: *collective,
                        mesh_dim: mesh_dim.clone(),
                        group: *group,
                        send_bytes: *send_bytes,
                        bytes: ni.max(no),
                        communicates,
                    };
                    ops.push(UnrolledOp { kind, name: format!("{}({mesh_dim})", collective.name()), at, ranges, reads });
                }
                Step::Loop { count, reverse, carries, body, prefetch } => {
                    for run in loop_runs(*count, *reverse, !prefetch.is_empty()) {
                        let steps = if run.prefetch { prefetch } else { body };
                        self.unroll(steps, Some(Frame { layer: run.layer, t: run.t, carries }), path, ops)?;
                    }
                }
            }
            path.pop();
        }
        Ok(())
    }
}

/// The schedule of `rank` flattened into the operations one step runs, in order.
pub fn unroll(m: &Manifest, rank: usize) -> Result<Vec<UnrolledOp>, String> {
    let sched = m.ranks.get(rank).ok_or_else(|| format!("the manifest has no schedule for rank {rank}"))?;
    let mut base = Vec::with_capacity(m.memory.arenas.len());
    let mut next = 0u64;
    for a in &m.memory.arenas {
        base.push(next);
        next = next.saturating_add(a.bytes);
    }
    let mut ops = Vec::new();
    Unroller { m, base, tp_coord: m.mesh.tp_coord(rank) }.unroll(&sched.steps, None, &mut Vec::new(), &mut ops)?;
    Ok(ops)
}

/// Where the streams wait for each collective: `before[j]` lists the collectives (by their
/// number among the communicating ones) the compute stream waits for before op `j`, `at_end`
/// those no later op touches (waited for at the end of the step), and `comm_waits[c]` the
/// collectives of other streams collective `c` waits for before it starts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Joins {
    pub before: Vec<Vec<usize>>,
    pub at_end: Vec<usize>,
    pub comm_waits: Vec<Vec<usize>>,
}

fn overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.1 > 0 && b.1 > 0 && a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

fn touches(a: &[(u64, u64)], b: &[(u64, u64)]) -> bool {
    a.iter().any(|x| b.iter().any(|y| overlap(*x, *y)))
}

/// Whether op `b`, after op `a`, must wait for it: it touches what `a` writes, or writes what
/// `a` reads (two reads of the same bytes need no order).
fn conflicts(ranges: &[Vec<(u64, u64)>], reads: &[usize], a: usize, b: usize) -> bool {
    let (ar, aw) = ranges[a].split_at(reads[a].min(ranges[a].len()));
    let bw = &ranges[b][reads[b].min(ranges[b].len())..];
    touches(aw, &ranges[b]) || touches(ar, bw)
}

/// For ops in schedule order, `stream[j]` the collectives stream op `j` runs on (`None`: the
/// compute stream), `ranges[j]` the byte ranges it touches and `reads[j]` how many of them
/// (the first) it only reads: each collective is joined before the first later compute op
/// that conflicts with it (reads or writes its result, or overwrites its operand's memory; a
/// compute op that only reads the collective's operand too needs no join, which lets async
/// TP's chunk GEMM run beside the ring shift of the same chunk). Later collectives of the same
/// stream need no join: a stream runs its collectives in order, and each starts after the
/// compute enqueued before it. A collective that conflicts with an earlier collective of
/// another stream waits for it (`comm_waits`) unless the compute stream joined that one before
/// the later collective was enqueued (then the order is already implied).
pub fn join_points(stream: &[Option<usize>], ranges: &[Vec<(u64, u64)>], reads: &[usize]) -> Joins {
    let mut j = Joins { before: vec![Vec::new(); stream.len()], at_end: Vec::new(), comm_waits: Vec::new() };
    // (op index, stream, joined before op) of each collective so far.
    let mut seen: Vec<(usize, usize, usize)> = Vec::new();
    for (i, s) in stream.iter().enumerate() {
        let Some(s) = *s else { continue };
        let first = (i + 1..stream.len()).find(|&k| stream[k].is_none() && conflicts(ranges, reads, i, k));
        match first {
            Some(k) => j.before[k].push(seen.len()),
            None => j.at_end.push(seen.len()),
        }
        let waits = seen.iter().enumerate().filter(|&(_, &(p, ps, joined))| ps != s && joined > i && conflicts(ranges, reads, p, i)).map(|(c, _)| c).collect();
        j.comm_waits.push(waits);
        seen.push((i, s, first.unwrap_or(usize::MAX)));
    }
    j
}

/// The kind of kernel an op runs, for grouping in reports (`gemm`, `attention`, `copy`, ...).
pub fn op_class(m: &Manifest, op: &UnrolledOp) -> &'static str {
    match &op.kind {
        OpKind::Launch { kernel } => m.kernels[*kernel].kind.name(),
        OpKind::Copy { .. } => "copy",
        OpKind::Memset { .. } => "memset",
        OpKind::Collective { communicates: true, .. } => "collective",
        OpKind::Collective { .. } => "shard",
    }
}

/// One interval of a timeline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Span {
    pub name: String,
    /// `gemm`, `fused`, `collective`, ... ([`op_class`]).
    pub class: String,
    /// `compute`, `comm` (the data-parallel collectives stream), `comm_tp` (tp's), or `wait`
    /// (the compute stream waiting for a collective).
    pub stream: String,
    pub start_s: f64,
    pub dur_s: f64,
    /// Where it comes from in the schedule.
    pub at: String,
}

/// A timeline in the Chrome trace event format: one process per rank, one thread per stream.
pub fn chrome_trace(rank: usize, what: &str, spans: &[Span]) -> String {
    let tid = |s: &str| match s {
        "compute" => 0,
        "comm" => 1,
        "comm_tp" => 3,
        _ => 2,
    };
    let mut events = Vec::with_capacity(spans.len() + 4);
    events.push(serde_json::json!({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": format!("rank {rank} ({what})")}}));
    for (name, t) in [("compute stream", 0), ("collectives stream (data parallel)", 1), ("compute waits for collectives", 2), ("collectives stream (tp)", 3)] {
        events.push(serde_json::json!({"name": "thread_name", "ph": "M", "pid": rank, "tid": t, "args": {"name": name}}));
    }
    for s in spans {
        events.push(serde_json::json!({
            "name": s.name, "cat": s.class, "ph": "X", "pid": rank, "tid": tid(&s.stream),
            "ts": s.start_s * 1e6, "dur": s.dur_s * 1e6, "args": {"at": s.at},
        }));
    }
    serde_json::to_string_pretty(&serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"})).unwrap_or_default()
}

/// Read the spans back from a trace [`chrome_trace`] wrote (complete events only).
pub fn read_chrome_trace(text: &str) -> Result<Vec<Span>, String> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let events = v.get("traceEvents").and_then(|e| e.as_array()).ok_or("no `traceEvents` array")?;
    let mut spans = Vec::new();
    for (i, e) in events.iter().enumerate() {
        if e.get("ph").and_then(|p| p.as_str()) != Some("X") {
            continue;
        }
        let f = |k: &str| e.get(k).and_then(serde_json::Value::as_f64).ok_or_else(|| format!("event {i}: no number `{k}`"));
        let s = |k: &str| e.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string();
        let stream = match e.get("tid").and_then(serde_json::Value::as_u64) {
            Some(0) => "compute",
            Some(1) => "comm",
            Some(3) => "comm_tp",
            _ => "wait",
        };
        let at = e.get("args").and_then(|a| a.get("at")).and_then(|a| a.as_str()).unwrap_or("").to_string();
        spans.push(Span { name: s("name"), class: s("cat"), stream: stream.into(), start_s: f("ts")? * 1e-6, dur_s: f("dur")? * 1e-6, at });
    }
    Ok(spans)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_collective_joins_before_the_first_compute_op_touching_its_bytes() {
        // op 0 computes into [0, 8); op 1 gathers [0, 8) -> [100, 8); op 2 touches neither;
        // op 3 reads [104, 2): the gather is joined before op 3.
        let comm = [None, Some(DATA_STREAM), None, None];
        let ranges = vec![vec![(0, 8)], vec![(0, 8), (100, 8)], vec![(50, 4)], vec![(104, 2)]];
        let j = join_points(&comm, &ranges, &[0, 1, 0, 1]);
        assert_eq!(j.before, vec![vec![], vec![], vec![], vec![0]]);
        assert!(j.at_end.is_empty());
        assert_eq!(j.comm_waits, vec![Vec::<usize>::new()]);
        // Nobody touches it: joined at the end.
        let j = join_points(&comm[..3], &ranges[..3], &[0, 1, 0]);
        assert_eq!(j.at_end, vec![0]);
    }

    #[test]
    fn tp_and_data_parallel_collectives_run_on_their_own_streams() {
        assert_eq!((comm_stream("tp"), comm_stream("dp_shard"), comm_stream("dp_replicate")), (TP_STREAM, DATA_STREAM, DATA_STREAM));
        assert_eq!((comm_stream_name(TP_STREAM), comm_stream_name(DATA_STREAM)), ("comm_tp", "comm"));
        // An FSDP gather [0, 8) -> [100, 8), then a tp ring shift [200, 8) -> [300, 8) of
        // unrelated bytes: no wait between the streams; compute reads each result.
        let s = [Some(DATA_STREAM), Some(TP_STREAM), None, None];
        let ranges = vec![vec![(0, 8), (100, 8)], vec![(200, 8), (300, 8)], vec![(300, 8)], vec![(100, 8)]];
        let j = join_points(&s, &ranges, &[1; 4]);
        assert_eq!(j.comm_waits, vec![Vec::<usize>::new(), vec![]]);
        assert_eq!(j.before, vec![vec![], vec![], vec![1], vec![0]]);
    }

    #[test]
    fn a_collective_waits_for_an_unjoined_one_of_the_other_stream_it_overlaps() {
        // A dp gather writes [100, 8); a tp collective then reads [100, 8) before any compute
        // joined the gather: it waits on its stream for collective 0.
        let s = [Some(DATA_STREAM), Some(TP_STREAM), None];
        let ranges = vec![vec![(0, 8), (100, 8)], vec![(100, 8), (300, 8)], vec![(300, 8)]];
        let j = join_points(&s, &ranges, &[1; 3]);
        assert_eq!(j.comm_waits, vec![vec![], vec![0]]);
        // The same stream needs no wait: it runs its collectives in order.
        let j = join_points(&[Some(TP_STREAM), Some(TP_STREAM), None], &ranges, &[1; 3]);
        assert_eq!(j.comm_waits, vec![Vec::<usize>::new(), vec![]]);
        // Joined by compute (op 1 reads it) before the tp collective is enqueued: implied.
        let s = [Some(DATA_STREAM), None, Some(TP_STREAM), None];
        let ranges = vec![vec![(0, 8), (100, 8)], vec![(100, 8)], vec![(100, 8), (300, 8)], vec![(300, 8)]];
        let j = join_points(&s, &ranges, &[1; 4]);
        assert_eq!(j.comm_waits, vec![Vec::<usize>::new(), vec![]]);
        assert_eq!(j.before[1], vec![0]);
        // Two collectives of different streams that only read the same bytes: no wait.
        let j = join_points(&[Some(DATA_STREAM), Some(TP_STREAM)], &[vec![(0, 8), (100, 8)], vec![(0, 8), (300, 8)]], &[1, 1]);
        assert_eq!(j.comm_waits, vec![Vec::<usize>::new(), vec![]]);
    }

    #[test]
    fn reading_a_collectives_operand_needs_no_join_overwriting_it_does() {
        // A ring shift reads chunk [0, 8) into [100, 8); the chunk's GEMM reads [0, 8) too
        // (into [200, 8)): no join, they run side by side. The next GEMM reads [100, 8): joined
        // there.
        let s = [Some(TP_STREAM), None, None];
        let ranges = vec![vec![(0, 8), (100, 8)], vec![(0, 8), (200, 8)], vec![(100, 8), (300, 8)]];
        assert_eq!(join_points(&s, &ranges, &[1; 3]).before, vec![vec![], vec![], vec![0]]);
        // An op that overwrites the chunk must wait for the shift to have read it.
        let ranges = vec![vec![(0, 8), (100, 8)], vec![(0, 8)], vec![(500, 8)]];
        assert_eq!(join_points(&s, &ranges, &[1, 0, 1]).before, vec![vec![], vec![0], vec![]]);
    }

    #[test]
    fn traces_round_trip() {
        let spans = vec![
            Span {
                name: "layer.k3_gemm".into(),
                class: "gemm".into(),
                stream: "compute".into(),
                start_s: 0.0,
                dur_s: 1.5e-3,
                at: "schedule step 4.1, layer 0".into(),
            },
            Span {
                name: "all_gather(tp)".into(),
                class: "collective".into(),
                stream: "comm".into(),
                start_s: 1e-4,
                dur_s: 2e-4,
                at: "schedule step 4.0, layer 0".into(),
            },
            Span { name: "wait".into(), class: "wait".into(), stream: "wait".into(), start_s: 1.5e-3, dur_s: 0.0, at: String::new() },
        ];
        let back = read_chrome_trace(&chrome_trace(0, "predicted", &spans)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back.len(), 3);
        for (a, b) in spans.iter().zip(&back) {
            assert_eq!((&a.name, &a.class, &a.stream, &a.at), (&b.name, &b.class, &b.stream, &b.at));
            assert!((a.start_s - b.start_s).abs() < 1e-12 && (a.dur_s - b.dur_s).abs() < 1e-12);
        }
        assert!(read_chrome_trace("{}").is_err());
    }
}
