//! How a schedule's `collective` step runs on the GPU: NCCL moves contiguous, rank-major
//! chunks, while the IR gathers and scatters along any tensor dim. A step becomes a short list of
//! [`Action`]s: NCCL calls on whole buffers, and strided 2-D copies (`cuMemcpy2DAsync`) that
//! move the rank chunks between the tensor's layout and a staging buffer when the dim is not the
//! outermost one (`prod(shape[..dim]) > 1`). `take_shard`/`place_shard` are copies only.
//!
//! Async TP's ring: `ring_shift` is one grouped NCCL send and receive (to the rank `shift` places
//! back, from the one `shift` places ahead); `ring_slice` and a copying `ring_concat` (the one the
//! compiler could not turn into views) are rank-local strided copies.
//!
//! Row-major tensor of shape `s`, dim `d`, group `n`, element size `e`: `outer = prod(s[..d])`,
//! and a rank's chunk is `outer` rows of `inner = prod(shard[d..])` elements. The rank-`r` chunk
//! sits at column `r * inner` of rows that are `n * inner` long in the full tensor, and at
//! `r * outer * inner` in the rank-major staging buffer NCCL reads or writes.

use titan_ir::DType;
use titan_ir::artifact::{CollectiveOp, ReduceOp};

/// The stream rule lives with the schedule so the compiler's simulator uses it too.
pub use titan_ir::artifact::timeline::{Joins, join_points};

/// A byte offset into one of the buffers a step touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loc {
    Input(u64),
    Output(u64),
    Staging(u64),
    /// Byte `.1` of the step's `more_inputs[.0]` (`ring_concat`'s operands after the first).
    More(u32, u64),
}

/// The NCCL collective of an [`Action::Nccl`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NcclKind {
    /// `count` elements from every rank, rank-major into `recv`.
    AllGather,
    /// `send` holds `n * count` elements; rank `r` gets the reduction of chunk `r`.
    ReduceScatter,
    /// `count` elements, reduced, on every rank.
    AllReduce,
    /// `ring_shift`: send `count` elements to the group's rank `to` and receive as many from
    /// rank `from`, as one NCCL group (raw bytes: nothing is reduced, fp8 chunks included).
    SendRecv { to: u32, from: u32 },
}

/// One thing a collective step does, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// An NCCL call over the step's mesh dim; `count` in elements (per rank for all-gather, of
    /// the result for reduce-scatter).
    Nccl { kind: NcclKind, send: Loc, recv: Loc, count: u64, reduce: ReduceOp },
    /// `height` rows of `width` bytes from `src` (rows `src_pitch` bytes apart) to `dst` (rows
    /// `dst_pitch` apart).
    Copy2d { dst: Loc, dst_pitch: u64, src: Loc, src_pitch: u64, width: u64, height: u64 },
    /// Zero `bytes` at `dst`.
    Zero { dst: Loc, bytes: u64 },
}

/// The actions of one step and the staging bytes they need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub actions: Vec<Action>,
    pub staging_bytes: u64,
    /// Whether the step communicates (else it is rank-local copies).
    pub communicates: bool,
}

/// The step's fields a plan needs.
pub struct StepShape<'a> {
    pub collective: CollectiveOp,
    pub group: u64,
    pub dim: Option<u32>,
    pub reduce: Option<ReduceOp>,
    /// `ring_shift` and `ring_slice`: the rotation.
    pub shift: Option<u32>,
    /// `ring_concat`: how many operands follow the first (`Loc::More`).
    pub more_inputs: usize,
    pub dtype: DType,
    pub in_shape: &'a [u64],
    pub out_shape: &'a [u64],
}

/// `(outer, inner)`: the product of the dims before `d`, and of `d` and after.
fn split(shape: &[u64], d: usize) -> Result<(u64, u64), String> {
    if d >= shape.len() {
        return Err(format!("dim {d} of a rank-{} tensor", shape.len()));
    }
    Ok((shape[..d].iter().product(), shape[d..].iter().product()))
}

/// A ring step's rotation, below its group.
fn ring_shift_of(s: &StepShape<'_>) -> Result<u64, String> {
    match s.shift {
        Some(k) if u64::from(k) < s.group => Ok(u64::from(k)),
        Some(k) => Err(format!("`{}` with shift {k} in a group of {}", s.collective.name(), s.group)),
        None => Err(format!("`{}` needs a shift", s.collective.name())),
    }
}

/// `take_shard` and `ring_slice`: the copy of slice `at` (of `group`) of dim `d` of the input.
fn slice_copy(s: &StepShape<'_>, d: usize, at: u64) -> Result<Action, String> {
    let (n, e) = (s.group, s.dtype.size_bytes() as u64);
    let (outer, inner) = split(s.out_shape, d)?;
    if s.in_shape.iter().product::<u64>() != n * outer * inner {
        return Err(format!("{} of {:?} over {n} ranks cannot give {:?}", s.collective.name(), s.in_shape, s.out_shape));
    }
    Ok(Action::Copy2d { dst: Loc::Output(0), dst_pitch: inner * e, src: Loc::Input(at * inner * e), src_pitch: n * inner * e, width: inner * e, height: outer })
}

/// Plan a step for the rank at coordinate `coord` (0-based) along the step's mesh dim.
pub fn plan(s: &StepShape<'_>, coord: u64) -> Result<Plan, String> {
    let n = s.group;
    let e = s.dtype.size_bytes() as u64;
    let numel = |shape: &[u64]| shape.iter().product::<u64>();
    if n == 0 || coord >= n {
        return Err(format!("rank coordinate {coord} in a group of {n}"));
    }
    let reduce = s.reduce.unwrap_or(ReduceOp::Sum);
    let dim = || s.dim.map(|d| d as usize).ok_or_else(|| format!("`{}` needs a tensor dim", s.collective.name()));
    let (actions, staging_bytes, communicates) = match s.collective {
        CollectiveOp::RingShift => {
            let shift = ring_shift_of(s)?;
            if numel(s.in_shape) != numel(s.out_shape) {
                return Err("ring_shift changes the element count".into());
            }
            let (to, from) = ((coord + n - shift) % n, (coord + shift) % n);
            let kind = NcclKind::SendRecv { to: to as u32, from: from as u32 };
            (vec![Action::Nccl { kind, send: Loc::Input(0), recv: Loc::Output(0), count: numel(s.in_shape), reduce }], 0, true)
        }
        CollectiveOp::RingSlice => (vec![slice_copy(s, dim()?, (coord + ring_shift_of(s)?) % n)?], 0, false),
        CollectiveOp::RingConcat => {
            let d = dim()?;
            let (outer, inner) = split(s.in_shape, d)?;
            if numel(s.out_shape) != n * outer * inner {
                return Err(format!("ring_concat of {:?} over {n} ranks cannot give {:?}", s.in_shape, s.out_shape));
            }
            if s.more_inputs as u64 + 1 != n {
                return Err(format!("ring_concat over {n} ranks has {} operands", s.more_inputs + 1));
            }
            // Operand `j` (ring order) is slice `(coord + j) mod n` of the result.
            let a = (0..n)
                .map(|j| Action::Copy2d {
                    dst: Loc::Output((coord + j) % n * inner * e),
                    dst_pitch: n * inner * e,
                    src: if j == 0 { Loc::Input(0) } else { Loc::More(j as u32 - 1, 0) },
                    src_pitch: inner * e,
                    width: inner * e,
                    height: outer,
                })
                .collect();
            (a, 0, false)
        }
        CollectiveOp::AllReduce => {
            if numel(s.in_shape) != numel(s.out_shape) {
                return Err("all_reduce changes the element count".into());
            }
            (vec![Action::Nccl { kind: NcclKind::AllReduce, send: Loc::Input(0), recv: Loc::Output(0), count: numel(s.in_shape), reduce }], 0, true)
        }
        CollectiveOp::AllGather => {
            let d = dim()?;
            let (outer, inner) = split(s.in_shape, d)?;
            if numel(s.out_shape) != n * outer * inner {
                return Err(format!("all_gather of {:?} over {n} ranks cannot give {:?}", s.in_shape, s.out_shape));
            }
            let count = outer * inner;
            if outer == 1 {
                (vec![Action::Nccl { kind: NcclKind::AllGather, send: Loc::Input(0), recv: Loc::Output(0), count, reduce }], 0, true)
            } else {
                let mut a = vec![Action::Nccl { kind: NcclKind::AllGather, send: Loc::Input(0), recv: Loc::Staging(0), count, reduce }];
                for r in 0..n {
                    a.push(Action::Copy2d {
                        dst: Loc::Output(r * inner * e),
                        dst_pitch: n * inner * e,
                        src: Loc::Staging(r * count * e),
                        src_pitch: inner * e,
                        width: inner * e,
                        height: outer,
                    });
                }
                (a, n * count * e, true)
            }
        }
        CollectiveOp::ReduceScatter => {
            let d = dim()?;
            let (outer, inner) = split(s.out_shape, d)?;
            if numel(s.in_shape) != n * outer * inner {
                return Err(format!("reduce_scatter of {:?} over {n} ranks cannot give {:?}", s.in_shape, s.out_shape));
            }
            let count = outer * inner;
            if outer == 1 {
                (vec![Action::Nccl { kind: NcclKind::ReduceScatter, send: Loc::Input(0), recv: Loc::Output(0), count, reduce }], 0, true)
            } else {
                let mut a = Vec::new();
                for r in 0..n {
                    a.push(Action::Copy2d {
                        dst: Loc::Staging(r * count * e),
                        dst_pitch: inner * e,
                        src: Loc::Input(r * inner * e),
                        src_pitch: n * inner * e,
                        width: inner * e,
                        height: outer,
                    });
                }
                a.push(Action::Nccl { kind: NcclKind::ReduceScatter, send: Loc::Staging(0), recv: Loc::Output(0), count, reduce });
                (a, n * count * e, true)
            }
        }
        CollectiveOp::TakeShard => (vec![slice_copy(s, dim()?, coord)?], 0, false),
        CollectiveOp::PlaceShard => {
            let d = dim()?;
            let (outer, inner) = split(s.in_shape, d)?;
            if numel(s.out_shape) != n * outer * inner {
                return Err(format!("place_shard of {:?} over {n} ranks cannot give {:?}", s.in_shape, s.out_shape));
            }
            let a = vec![
                Action::Zero { dst: Loc::Output(0), bytes: n * outer * inner * e },
                Action::Copy2d {
                    dst: Loc::Output(coord * inner * e),
                    dst_pitch: n * inner * e,
                    src: Loc::Input(0),
                    src_pitch: inner * e,
                    width: inner * e,
                    height: outer,
                },
            ];
            (a, 0, false)
        }
    };
    Ok(Plan { actions, staging_bytes, communicates })
}

#[cfg(test)]
mod tests {
    //! The plans run on host memory for every rank of a group, with NCCL's semantics written
    //! out, and must give what the interpreter's collectives give (concatenation, elementwise
    //! reduction and slicing along the dim, in coordinate order).
    use super::*;

    /// Host buffers of one rank.
    struct Rank {
        input: Vec<u8>,
        output: Vec<u8>,
        staging: Vec<u8>,
        more: Vec<Vec<u8>>,
    }

    fn buf(r: &mut Rank, l: Loc) -> (&mut Vec<u8>, usize) {
        match l {
            Loc::Input(o) => (&mut r.input, o as usize),
            Loc::Output(o) => (&mut r.output, o as usize),
            Loc::Staging(o) => (&mut r.staging, o as usize),
            Loc::More(j, o) => (&mut r.more[j as usize], o as usize),
        }
    }

    fn read(r: &mut Rank, l: Loc, bytes: usize) -> Vec<u8> {
        let (b, o) = buf(r, l);
        b[o..o + bytes].to_vec()
    }

    fn write(r: &mut Rank, l: Loc, data: &[u8]) {
        let (b, o) = buf(r, l);
        b[o..o + data.len()].copy_from_slice(data);
    }

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// Run every rank's plan (the same action list shape on every rank; NCCL calls meet).
    fn run(plans: &[Plan], ranks: &mut [Rank]) {
        let n = ranks.len();
        for i in 0..plans[0].actions.len() {
            match plans[0].actions[i] {
                Action::Nccl { kind: NcclKind::SendRecv { .. }, send, recv, count, .. } => {
                    // Every rank's own peers: rank `ri` gets what its `from` sent, and that
                    // rank's `to` must be `ri` (the pairs match up).
                    let sent: Vec<Vec<u8>> = ranks.iter_mut().map(|r| read(r, send, 4 * count as usize)).collect();
                    for (ri, r) in ranks.iter_mut().enumerate() {
                        let Action::Nccl { kind: NcclKind::SendRecv { from, .. }, .. } = plans[ri].actions[i] else {
                            panic!("the ranks' plans differ in shape")
                        };
                        let Action::Nccl { kind: NcclKind::SendRecv { to, .. }, .. } = plans[from as usize].actions[i] else {
                            panic!("the ranks' plans differ in shape")
                        };
                        assert_eq!(to as usize, ri, "rank {from} sends to {to}, but rank {ri} receives from it");
                        write(r, recv, &sent[from as usize]);
                    }
                }
                Action::Nccl { kind, send, recv, count, reduce } => {
                    let c = count as usize;
                    let sends: Vec<Vec<f32>> = ranks
                        .iter_mut()
                        .map(|r| {
                            let len = if kind == NcclKind::ReduceScatter { n * c } else { c };
                            f32s(&read(r, send, 4 * len))
                        })
                        .collect();
                    let fold = |a: f32, b: f32| if reduce == ReduceOp::Max { a.max(b) } else { a + b };
                    for (ri, r) in ranks.iter_mut().enumerate() {
                        let out: Vec<f32> = match kind {
                            NcclKind::AllGather => sends.concat(),
                            NcclKind::AllReduce => (0..c).map(|j| sends.iter().skip(1).fold(sends[0][j], |a, s| fold(a, s[j]))).collect(),
                            NcclKind::ReduceScatter => (0..c).map(|j| sends.iter().skip(1).fold(sends[0][ri * c + j], |a, s| fold(a, s[ri * c + j]))).collect(),
                            NcclKind::SendRecv { .. } => unreachable!("matched above"),
                        };
                        write(r, recv, &bytes(&out));
                    }
                }
                _ => {
                    for (ri, r) in ranks.iter_mut().enumerate() {
                        match plans[ri].actions[i] {
                            Action::Copy2d { dst, dst_pitch, src, src_pitch, width, height } => {
                                for row in 0..height {
                                    let shift = |l: Loc, by: u64| match l {
                                        Loc::Input(o) => Loc::Input(o + by),
                                        Loc::Output(o) => Loc::Output(o + by),
                                        Loc::Staging(o) => Loc::Staging(o + by),
                                        Loc::More(j, o) => Loc::More(j, o + by),
                                    };
                                    let data = read(r, shift(src, row * src_pitch), width as usize);
                                    write(r, shift(dst, row * dst_pitch), &data);
                                }
                            }
                            Action::Zero { dst, bytes: b } => write(r, dst, &vec![0u8; b as usize]),
                            Action::Nccl { .. } => unreachable!("the ranks' plans differ in shape"),
                        }
                    }
                }
            }
        }
    }

    /// The reference: element `idx` (row-major in `shape`) of the concatenation along `d` of the
    /// ranks' tensors of shape `part`.
    fn concat_ref(parts: &[Vec<f32>], part: &[u64], d: usize) -> Vec<f32> {
        let n = parts.len() as u64;
        let (outer, inner) = (part[..d].iter().product::<u64>(), part[d..].iter().product::<u64>());
        let mut out = Vec::new();
        for o in 0..outer {
            for p in parts {
                out.extend_from_slice(&p[(o * inner) as usize..((o + 1) * inner) as usize]);
            }
        }
        assert_eq!(out.len() as u64, n * outer * inner);
        out
    }

    /// Slice `c` of `n` along `d` of a tensor of shape `full`.
    fn slice_ref(x: &[f32], full: &[u64], d: usize, n: u64, c: u64) -> Vec<f32> {
        let outer: u64 = full[..d].iter().product();
        let row: u64 = full[d..].iter().product();
        let inner = row / n;
        (0..outer).flat_map(|o| x[(o * row + c * inner) as usize..(o * row + (c + 1) * inner) as usize].to_vec()).collect()
    }

    fn values(len: u64, seed: u64) -> Vec<f32> {
        (0..len).map(|i| ((i * 7 + seed * 13) % 23) as f32 - 11.0 + seed as f32 * 0.5).collect()
    }

    fn ranks_for(n: u64, inputs: &[Vec<f32>], out_len: u64, staging: u64) -> Vec<Rank> {
        (0..n as usize)
            .map(|r| Rank { input: bytes(&inputs[r]), output: vec![0xAB; 4 * out_len as usize], staging: vec![0xCD; staging as usize], more: Vec::new() })
            .collect()
    }

    #[test]
    fn gathers_and_scatters_along_every_dim_match_the_interpreter_semantics() {
        let shapes: [&[u64]; 3] = [&[6], &[3, 4], &[2, 3, 4]];
        for shard in shapes {
            for d in 0..shard.len() {
                for n in [1u64, 2, 4] {
                    let mut full = shard.to_vec();
                    full[d] *= n;
                    let (len, full_len) = (shard.iter().product::<u64>(), full.iter().product::<u64>());
                    let shape = |c, i: &'static [u64], o: &'static [u64]| StepShape {
                        collective: c,
                        group: n,
                        dim: Some(d as u32),
                        reduce: None,
                        shift: None,
                        more_inputs: 0,
                        dtype: DType::F32,
                        in_shape: i,
                        out_shape: o,
                    };
                    let (shard_s, full_s): (&'static [u64], &'static [u64]) = (Vec::leak(shard.to_vec()), Vec::leak(full.clone()));
                    // all_gather: shard -> full.
                    let inputs: Vec<Vec<f32>> = (0..n).map(|r| values(len, r)).collect();
                    let plans: Vec<Plan> = (0..n).map(|c| plan(&shape(CollectiveOp::AllGather, shard_s, full_s), c).expect("plan")).collect();
                    let mut ranks = ranks_for(n, &inputs, full_len, plans[0].staging_bytes);
                    run(&plans, &mut ranks);
                    let want = concat_ref(&inputs, shard, d);
                    for r in &ranks {
                        assert_eq!(f32s(&r.output), want, "all_gather {shard:?} dim {d} n {n}");
                    }
                    // reduce_scatter: full -> shard, the sum of the ranks' slice c.
                    let inputs: Vec<Vec<f32>> = (0..n).map(|r| values(full_len, r + 5)).collect();
                    let plans: Vec<Plan> = (0..n).map(|c| plan(&shape(CollectiveOp::ReduceScatter, full_s, shard_s), c).expect("plan")).collect();
                    let mut ranks = ranks_for(n, &inputs, len, plans[0].staging_bytes);
                    run(&plans, &mut ranks);
                    for (c, r) in ranks.iter().enumerate() {
                        let mut want = vec![0.0f32; len as usize];
                        for x in &inputs {
                            for (w, v) in want.iter_mut().zip(slice_ref(x, &full, d, n, c as u64)) {
                                *w += v;
                            }
                        }
                        assert_eq!(f32s(&r.output), want, "reduce_scatter {full:?} dim {d} n {n} rank {c}");
                    }
                    // take_shard and place_shard: rank-local.
                    let x = values(full_len, 9);
                    for c in 0..n {
                        let p = plan(&shape(CollectiveOp::TakeShard, full_s, shard_s), c).expect("plan");
                        assert!(!p.communicates);
                        let mut r = ranks_for(1, std::slice::from_ref(&x), len, 0);
                        run(std::slice::from_ref(&p), &mut r);
                        assert_eq!(f32s(&r[0].output), slice_ref(&x, &full, d, n, c), "take_shard");
                        let s = values(len, 3);
                        let p = plan(&shape(CollectiveOp::PlaceShard, shard_s, full_s), c).expect("plan");
                        let mut r = ranks_for(1, std::slice::from_ref(&s), full_len, 0);
                        run(std::slice::from_ref(&p), &mut r);
                        let got = f32s(&r[0].output);
                        assert_eq!(slice_ref(&got, &full, d, n, c), s, "place_shard slot");
                        assert_eq!(got.iter().filter(|&&v| v != 0.0).count(), s.iter().filter(|&&v| v != 0.0).count(), "place_shard zeros elsewhere");
                    }
                }
            }
        }
    }

    /// Ops that read their first range and write the rest (a single range: written).
    fn reads(ranges: &[Vec<(u64, u64)>]) -> Vec<usize> {
        ranges.iter().map(|r| usize::from(r.len() > 1)).collect()
    }

    /// One collectives stream for the `true`s.
    fn streams(comm: &[bool]) -> Vec<Option<usize>> {
        comm.iter().map(|&c| c.then_some(0)).collect()
    }

    #[test]
    fn collectives_are_joined_before_the_first_op_touching_their_buffers() {
        // op 0: compute; 1: gather A -> [100, 110); 2: gather B -> [200, 210); 3: compute on
        // unrelated memory; 4: reads [205, 206) (B's result); 5: writes [95, 101) (reuses A's
        // result); 6: gather C, never touched again.
        let comm = [false, true, true, false, false, false, true];
        let ranges = vec![
            vec![(0, 50)],
            vec![(60, 5), (100, 10)],
            vec![(70, 5), (200, 10)],
            vec![(300, 10)],
            vec![(205, 1), (400, 4)],
            vec![(95, 6)],
            vec![(500, 8), (600, 8)],
        ];
        let j = join_points(&streams(&comm), &ranges, &reads(&ranges));
        assert_eq!(j.before, vec![vec![], vec![], vec![], vec![], vec![1], vec![0], vec![]]);
        assert_eq!(j.at_end, vec![2]);
        // Adjacent ranges do not overlap; empty ones never do.
        assert_eq!(join_points(&streams(&[true, false]), &[vec![(0, 10)], vec![(10, 5)]], &[1, 0]).at_end, vec![0]);
        assert_eq!(join_points(&streams(&[true, false]), &[vec![(0, 11)], vec![(10, 5)]], &[1, 0]).before[1], vec![0]);
        assert_eq!(join_points(&streams(&[true, false]), &[vec![(0, 0)], vec![(0, 5)]], &[1, 0]).at_end, vec![0]);
        // A collective's operand being overwritten later also forces the join.
        let j = join_points(&streams(&[true, false]), &[vec![(0, 8), (100, 8)], vec![(4, 1)]], &[1, 0]);
        assert_eq!(j.before, vec![vec![], vec![0]]);
    }

    /// A 3-layer loop with `prefetch-next-layer`'s gathers, unrolled as the backend unrolls it
    /// (`loop_runs`): the gather of layer `l + 1` is issued before layer `l`'s compute and
    /// joined only before layer `l + 1`'s, so it runs while layer `l` computes; each gather
    /// writes the slot the previous layer has finished reading (it starts after the compute
    /// enqueued before it).
    #[test]
    fn the_next_layers_gather_is_joined_only_where_that_layer_reads_it() {
        let slot = |s: usize| (100 + 100 * s as u64, 10);
        let (mut comm, mut ranges, mut what) = (Vec::new(), Vec::new(), Vec::new());
        for run in titan_ir::artifact::loop_runs(3, false, true) {
            if run.prefetch {
                // all_gather(shard[layer]) -> carry out
                comm.push(true);
                ranges.push(vec![(1000 + 10 * run.layer as u64, 5), slot((run.t + 1) % 2)]);
                what.push(format!("gather layer {}", run.layer));
            } else {
                // the layer's GEMM reads carry in
                comm.push(false);
                ranges.push(vec![slot(run.t % 2), (5000, 10)]);
                what.push(format!("compute layer {}", run.layer));
            }
        }
        assert_eq!(what, ["gather layer 0", "gather layer 1", "compute layer 0", "gather layer 2", "compute layer 1", "compute layer 2"]);
        let j = join_points(&streams(&comm), &ranges, &reads(&ranges));
        assert_eq!(j.before, vec![vec![], vec![], vec![0], vec![], vec![1], vec![2]]);
        assert!(j.at_end.is_empty());
    }

    #[test]
    fn all_reduce_is_one_call_and_bad_steps_are_refused() {
        let s = StepShape {
            collective: CollectiveOp::AllReduce,
            group: 4,
            dim: None,
            reduce: Some(ReduceOp::Max),
            shift: None,
            more_inputs: 0,
            dtype: DType::BF16,
            in_shape: &[8, 2],
            out_shape: &[8, 2],
        };
        let p = plan(&s, 3).expect("plan");
        assert_eq!(p.actions, vec![Action::Nccl { kind: NcclKind::AllReduce, send: Loc::Input(0), recv: Loc::Output(0), count: 16, reduce: ReduceOp::Max }]);
        assert!(plan(&s, 4).expect_err("coord 4 of 4").contains("coordinate 4"));
        let bad = StepShape {
            collective: CollectiveOp::AllGather,
            group: 2,
            dim: Some(1),
            reduce: None,
            shift: None,
            more_inputs: 0,
            dtype: DType::F32,
            in_shape: &[2, 3],
            out_shape: &[2, 5],
        };
        assert!(plan(&bad, 0).expect_err("5 is not 2 x 3").contains("cannot give"));
        let no_dim = StepShape { dim: None, ..bad };
        assert!(plan(&no_dim, 0).expect_err("no dim").contains("needs a tensor dim"));
    }

    /// Async TP's ring steps, run for every rank of groups of 1, 2, 4 and 8 at every shift,
    /// against the interpreter's semantics (`titan_ir::interp::collective`): `ring_shift` gets
    /// rank `(r + shift) mod n`'s operand, `ring_slice` its slice `(r + shift) mod n` of `dim`,
    /// and `ring_concat` places operand `j` at slice `(r + j) mod n`.
    #[test]
    fn ring_steps_match_the_interpreter_semantics() {
        let shard: &'static [u64] = &[2, 3, 4];
        for d in 0..shard.len() {
            for n in [1u64, 2, 4, 8] {
                let mut full = shard.to_vec();
                full[d] *= n;
                let full: &'static [u64] = Vec::leak(full);
                let (len, full_len) = (shard.iter().product::<u64>(), full.iter().product::<u64>());
                let shape = |c, shift, more, i: &'static [u64], o: &'static [u64]| StepShape {
                    collective: c,
                    group: n,
                    dim: (c != CollectiveOp::RingShift).then_some(d as u32),
                    reduce: None,
                    shift,
                    more_inputs: more,
                    dtype: DType::F32,
                    in_shape: i,
                    out_shape: o,
                };
                for k in 0..n {
                    // ring_shift: the shard of the rank k places ahead.
                    let inputs: Vec<Vec<f32>> = (0..n).map(|r| values(len, r)).collect();
                    let plans: Vec<Plan> = (0..n).map(|c| plan(&shape(CollectiveOp::RingShift, Some(k as u32), 0, shard, shard), c).expect("plan")).collect();
                    assert!(plans.iter().all(|p| p.communicates));
                    let mut ranks = ranks_for(n, &inputs, len, 0);
                    run(&plans, &mut ranks);
                    for (r, rank) in ranks.iter().enumerate() {
                        assert_eq!(f32s(&rank.output), inputs[(r + k as usize) % n as usize], "ring_shift n {n} shift {k} rank {r}");
                    }
                    // ring_slice: slice (r + k) mod n of the full tensor, no communication.
                    let inputs: Vec<Vec<f32>> = (0..n).map(|r| values(full_len, 100 + r)).collect();
                    let plans: Vec<Plan> = (0..n).map(|c| plan(&shape(CollectiveOp::RingSlice, Some(k as u32), 0, full, shard), c).expect("plan")).collect();
                    assert!(plans.iter().all(|p| !p.communicates));
                    let mut ranks = ranks_for(n, &inputs, len, 0);
                    run(&plans, &mut ranks);
                    for (r, rank) in ranks.iter().enumerate() {
                        let want = slice_ref(&inputs[r], full, d, n, (r as u64 + k) % n);
                        assert_eq!(f32s(&rank.output), want, "ring_slice dim {d} n {n} shift {k} rank {r}");
                    }
                }
                // ring_concat: operand j of rank r at slice (r + j) mod n.
                let plans: Vec<Plan> = (0..n).map(|c| plan(&shape(CollectiveOp::RingConcat, None, n as usize - 1, shard, full), c).expect("plan")).collect();
                assert!(plans.iter().all(|p| !p.communicates && p.staging_bytes == 0));
                let operands: Vec<Vec<Vec<f32>>> = (0..n).map(|r| (0..n).map(|j| values(len, 1000 + 10 * r + j)).collect()).collect();
                let mut ranks = ranks_for(n, &operands.iter().map(|o| o[0].clone()).collect::<Vec<_>>(), full_len, 0);
                for (r, rank) in ranks.iter_mut().enumerate() {
                    rank.more = operands[r][1..].iter().map(|o| bytes(o)).collect();
                }
                run(&plans, &mut ranks);
                for (r, rank) in ranks.iter().enumerate() {
                    // The reference: the slices in coordinate order, slice s being operand (s - r) mod n.
                    let parts: Vec<Vec<f32>> = (0..n as usize).map(|s| operands[r][(s + n as usize - r) % n as usize].clone()).collect();
                    assert_eq!(f32s(&rank.output), concat_ref(&parts, shard, d), "ring_concat dim {d} n {n} rank {r}");
                }
            }
        }
        let s = shape_of_bad_ring();
        assert!(plan(&s, 0).expect_err("shift 2 of 2").contains("shift 2"));
        assert!(plan(&StepShape { shift: None, ..s }, 0).expect_err("no shift").contains("needs a shift"));
        let concat = StepShape { collective: CollectiveOp::RingConcat, dim: Some(0), shift: None, more_inputs: 0, out_shape: &[8], ..shape_of_bad_ring() };
        assert!(plan(&concat, 0).expect_err("one operand for two ranks").contains("has 1 operands"));
    }

    fn shape_of_bad_ring() -> StepShape<'static> {
        StepShape {
            collective: CollectiveOp::RingShift,
            group: 2,
            dim: None,
            reduce: None,
            shift: Some(2),
            more_inputs: 0,
            dtype: DType::BF16,
            in_shape: &[4],
            out_shape: &[4],
        }
    }
}
