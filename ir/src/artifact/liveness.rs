//! Buffer lifetimes recomputed from a manifest's schedule alone, as `docs/artifact.md`
//! ("Lifetimes") defines them: what a loader needs to check that no two buffers live at the same
//! time share a byte, without the compiler's storage tables.
//!
//! The schedule is linearized with each top-level loop's prefetch and body steps once, after a
//! position of the loop itself. A buffer lives from the first position that touches it to the
//! last. A *loop temporary* (a buffer referenced only whole or through fixed views, only inside one loop's steps, and
//! not one of its carry slots) lives within the positions of the steps that touch it, so every
//! iteration reuses its bytes; any other buffer a loop touches (layer-sliced operands and results,
//! invariant operands, carry slots) lives across the whole loop. A buffer holding a step output
//! (`loss`, `grad_norm`, `lr`) lives to the end of the step. This is the planner's rule
//! (`compiler/src/build/memory.rs`), recovered without its per-buffer scope: the compiler's tests
//! check that both give the same lifetimes.
//!
//! One exception keeps the data-parallel collectives stream from serializing the others: a
//! buffer a loop's data-parallel collective reads ([`pinned_in_loops`]) is not a
//! loop temporary but lives across the whole loop. That collective runs on a stream of its own
//! and may finish well after the compute stream (and the tp stream) moved on; had a later
//! temporary of the same iteration (a tp reduce-scatter's result, say) reused its bytes, that
//! later operation would have to wait for it (`timeline::join_points`). Outside loops the rule
//! does not apply (pinning there means to the end of the step: the 70B prediction gained 0.02
//! ms for 0.37 GiB of peak).
//!
//! A second rule does the same for every communicating collective inside a loop, for as long
//! as its stream may still read the operand ([`held_until_joined`], format 11): the operand
//! lives until the first later step of the iteration that touches the collective's result (where
//! the compute stream joins it), or to the iteration's end. Async TP's reduce-scatter ring sends
//! each partial with a `ring_shift` while the next chunk GEMM computes; without the rule that
//! GEMM's result took the bytes of the partial being sent and waited for the shift, which
//! serialized the ring (70B, batch 4: 62 ms of the 104 ms of exposed tp communication).

use super::timeline::{DATA_STREAM, comm_stream};
use super::{BufRef, Manifest, Step};

/// The inclusive range of schedule positions during which a buffer's bytes are in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    pub start: u32,
    pub end: u32,
}

impl Lifetime {
    pub fn overlaps(&self, o: &Lifetime) -> bool {
        self.start <= o.end && o.start <= self.end
    }
}

/// Where a buffer is referenced: `None` not yet, `Some(Some(l))` only whole inside top-level loop
/// `l` (not as one of its carries), `Some(None)` anywhere else too.
type Scope = Option<Option<usize>>;

/// The buffer references of one step (a loop's own steps are not included).
pub fn step_refs(s: &Step) -> Vec<BufRef> {
    match s {
        Step::Launch { inputs, outputs, .. } => inputs.iter().chain(outputs).copied().collect(),
        Step::Copy { src, dst, .. } => vec![*src, *dst],
        Step::Memset { dst, .. } => vec![*dst],
        Step::Collective { input, more_inputs, output, .. } => std::iter::once(input).chain(more_inputs).chain([output]).copied().collect(),
        Step::Loop { .. } => Vec::new(),
    }
}

/// The buffer ids a reference touches (a carry: both of its slots in `carries`).
pub fn ref_buffers(r: &BufRef, carries: &[[u32; 2]]) -> Vec<u32> {
    match *r {
        BufRef::Buffer { buffer, .. } | BufRef::View { buffer, .. } => vec![buffer],
        BufRef::Carry { carry, .. } => carries.get(carry as usize).map(|c| c.to_vec()).unwrap_or_default(),
    }
}

/// Whether `s` is a collective that communicates on the data-parallel collectives stream
/// ([`comm_stream`]).
fn on_data_stream(s: &Step) -> bool {
    communicates(s) && matches!(s, Step::Collective { mesh_dim, .. } if comm_stream(mesh_dim) == DATA_STREAM)
}

/// The buffers (by id) a data-parallel collective inside a top-level loop reads (carries and
/// layer slices included, which live across the loop anyway): never loop temporaries, so no
/// later buffer of the loop takes their bytes while that stream may still read them. (What it
/// writes needs no pin: its readers on the compute stream wait for it first, and it starts
/// after the compute enqueued before it.)
pub fn pinned_in_loops(steps: &[Step]) -> Vec<u32> {
    let mut ids = Vec::new();
    for s in steps {
        if let Step::Loop { body, prefetch, .. } = s {
            for bs in prefetch.iter().chain(body) {
                if let Step::Collective { input, more_inputs, .. } = bs
                    && on_data_stream(bs)
                {
                    ids.extend(std::iter::once(input).chain(more_inputs).flat_map(|r| ref_buffers(r, &[])));
                }
            }
        }
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Which buffers are temporaries of which top-level loop (by buffer position).
fn scopes(n: usize, steps: &[Step]) -> Vec<Scope> {
    let mut scope: Vec<Scope> = vec![None; n];
    let mut mark = |id: u32, s: Option<usize>| {
        if let Some(slot) = scope.get_mut(id as usize) {
            *slot = match *slot {
                None => Some(s),
                Some(old) if old == s => Some(s),
                Some(_) => Some(None),
            };
        }
    };
    let mut loop_index = 0usize;
    for s in steps {
        match s {
            Step::Loop { carries, body, prefetch, .. } => {
                for id in carries.iter().flatten() {
                    mark(*id, None);
                }
                for bs in prefetch.iter().chain(body) {
                    for r in step_refs(bs) {
                        match r {
                            BufRef::Carry { .. } => {}
                            // A view fixed across iterations is referenced like the whole buffer.
                            BufRef::Buffer { buffer, .. } | BufRef::View { buffer, .. } if !r.per_layer() => mark(buffer, Some(loop_index)),
                            BufRef::Buffer { buffer, .. } | BufRef::View { buffer, .. } => mark(buffer, None),
                        }
                    }
                    // A loop nested in a loop body is not something the planner writes: its
                    // buffers count as touched across the whole outer loop.
                    if let Step::Loop { carries, body, prefetch, .. } = bs {
                        for id in carries.iter().flatten() {
                            mark(*id, None);
                        }
                        for inner in prefetch.iter().chain(body) {
                            for r in step_refs(inner) {
                                for id in ref_buffers(&r, &[]) {
                                    mark(id, None);
                                }
                            }
                        }
                    }
                }
                loop_index += 1;
            }
            other => {
                for r in step_refs(other) {
                    for id in ref_buffers(&r, &[]) {
                        mark(id, None);
                    }
                }
            }
        }
    }
    for id in pinned_in_loops(steps) {
        mark(id, None);
    }
    scope
}

/// Whether `s` is a collective that communicates (on a collectives stream, [`comm_stream`]).
fn communicates(s: &Step) -> bool {
    matches!(s, Step::Collective { collective, group, .. } if *group > 1 && !collective.is_rank_local())
}

/// For each of `steps` (one loop iteration: its prefetch steps, then its body), the buffers a
/// communicating collective there reads, each with the index of the step that joins the
/// collective: the first later step of the iteration that references its result's buffer (the
/// compute stream's join, [`super::timeline::join_points`], which compares bytes: a step
/// touching another part of that buffer ends the hold early, never late), or the iteration's
/// last step when none does. Until then
/// the collective's stream may still be reading them, so no buffer born before that step may
/// take their bytes: a chunk GEMM of async TP's reduce-scatter ring would otherwise write the
/// partial the previous micro-step's `ring_shift` is still sending, and wait for it.
fn held_until_joined(steps: &[&Step], carries: &[[u32; 2]]) -> Vec<Vec<(u32, usize)>> {
    let mut held = vec![Vec::new(); steps.len()];
    for (k, s) in steps.iter().enumerate() {
        let Step::Collective { input, more_inputs, output, .. } = s else { continue };
        if !communicates(s) {
            continue;
        }
        let result = ref_buffers(output, carries);
        let touches = |t: &Step| {
            let mut refs = step_refs(t);
            if let Step::Loop { body, prefetch, .. } = t {
                refs.extend(prefetch.iter().chain(body).flat_map(step_refs));
            }
            refs.iter().flat_map(|r| ref_buffers(r, carries)).any(|id| result.contains(&id))
        };
        let until = (k + 1..steps.len()).find(|&q| touches(steps[q])).unwrap_or(steps.len() - 1);
        for id in std::iter::once(input).chain(more_inputs).flat_map(|r| ref_buffers(r, carries)) {
            held[k].push((id, until));
        }
    }
    held
}

/// The lifetime of every buffer of rank `rank`'s schedule, by position in `m.buffers`
/// (`None`: never touched). References to buffers that do not exist are ignored (the loader
/// refuses them separately).
pub fn buffer_lifetimes(m: &Manifest, rank: usize) -> Vec<Option<Lifetime>> {
    let Some(schedule) = m.ranks.get(rank) else { return vec![None; m.buffers.len()] };
    let scope = scopes(m.buffers.len(), &schedule.steps);
    let temporary_of = |id: u32| scope.get(id as usize).copied().flatten().flatten();
    lifetimes(m.buffers.len(), &schedule.steps, temporary_of, |i| m.buffers[i].output.is_some())
}

/// The lifetime of every buffer of the eval step (`m.eval`), by position in its `buffers`; empty
/// without one.
pub fn eval_buffer_lifetimes(m: &Manifest) -> Vec<Option<Lifetime>> {
    let Some(e) = &m.eval else { return Vec::new() };
    let scope = scopes(e.buffers.len(), &e.steps);
    let temporary_of = |id: u32| scope.get(id as usize).copied().flatten().flatten();
    lifetimes(e.buffers.len(), &e.steps, temporary_of, |i| e.buffers[i].output.is_some())
}

/// The lifetime of each of `n` buffers over the linearized `steps`, given which top-level loop
/// (by index) each buffer is a temporary of (`temporary_of`) and which buffers hold step
/// outputs (`is_output`). The planner calls this with its own scopes; the loader with the ones
/// [`buffer_lifetimes`] recovers from the schedule.
pub fn lifetimes(n: usize, steps: &[Step], temporary_of: impl Fn(u32) -> Option<usize>, is_output: impl Fn(usize) -> bool) -> Vec<Option<Lifetime>> {
    let mut lt: Vec<Option<Lifetime>> = vec![None; n];
    let mut touch = |id: u32, at: u32| {
        if let Some(slot) = lt.get_mut(id as usize) {
            *slot = Some(match *slot {
                None => Lifetime { start: at, end: at },
                Some(l) => Lifetime { start: l.start.min(at), end: l.end.max(at) },
            });
        }
    };
    let mut pos = 0u32;
    let mut loop_index = 0usize;
    for s in steps {
        match s {
            Step::Loop { carries, body, prefetch, .. } => {
                let start = pos;
                pos += 1;
                let mut whole: Vec<u32> = carries.iter().flatten().copied().collect();
                let iteration: Vec<&Step> = prefetch.iter().chain(body).collect();
                let held = held_until_joined(&iteration, carries);
                // An iteration runs the prefetch steps (all but the last), then the body.
                for (k, bs) in iteration.iter().enumerate() {
                    for &(id, until) in &held[k] {
                        if temporary_of(id) == Some(loop_index) {
                            touch(id, pos + (until - k) as u32);
                        }
                    }
                    let mut refs = step_refs(bs);
                    if let Step::Loop { body, prefetch, .. } = bs {
                        refs.extend(prefetch.iter().chain(body).flat_map(step_refs));
                    }
                    for r in refs {
                        for id in ref_buffers(&r, carries) {
                            if temporary_of(id) == Some(loop_index) {
                                touch(id, pos);
                            } else {
                                whole.push(id);
                            }
                        }
                    }
                    if let Step::Loop { carries, .. } = bs {
                        whole.extend(carries.iter().flatten());
                    }
                    pos += 1;
                }
                let end = pos.saturating_sub(1).max(start);
                for id in whole {
                    touch(id, start);
                    touch(id, end);
                }
                loop_index += 1;
            }
            other => {
                for r in step_refs(other) {
                    for id in ref_buffers(&r, &[]) {
                        touch(id, pos);
                    }
                }
                pos += 1;
            }
        }
    }
    let last = pos.saturating_sub(1);
    for (i, slot) in lt.iter_mut().enumerate() {
        if is_output(i) {
            let l = slot.get_or_insert(Lifetime { start: last, end: last });
            l.end = last;
        }
    }
    lt
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::artifact::CollectiveOp;

    fn buf(buffer: u32) -> BufRef {
        BufRef::Buffer { buffer, layer: false }
    }

    fn gemm(input: u32, output: u32) -> Step {
        Step::Launch { kernel: 0, inputs: vec![buf(input)], outputs: vec![buf(output)], stream: 0 }
    }

    fn shift(input: u32, output: u32, group: u32) -> Step {
        Step::Collective {
            collective: CollectiveOp::RingShift,
            mesh_dim: "tp".into(),
            group,
            dim: None,
            reduce: None,
            dtype: DType::BF16,
            in_shape: vec![4],
            out_shape: vec![4],
            input: buf(input),
            output: buf(output),
            more_inputs: Vec::new(),
            shift: Some(1),
            send_bytes: 8,
            stream: 0,
        }
    }

    /// Async TP's reduce-scatter ring in a loop body: partial `p0` (buffer 1) is computed and
    /// sent (into 2), the next partial `p1` (buffer 3) computed and sent (into 4), and the sum
    /// reads both received partials (into 5). Every buffer is a loop temporary.
    fn ring(group: u32) -> Vec<Step> {
        let body = vec![
            gemm(0, 1),
            shift(1, 2, group),
            gemm(0, 3),
            shift(3, 4, group),
            Step::Launch { kernel: 1, inputs: vec![buf(2), buf(4)], outputs: vec![buf(5)], stream: 0 },
        ];
        vec![Step::Loop { count: 2, reverse: false, carries: Vec::new(), body, prefetch: Vec::new() }]
    }

    #[test]
    fn a_ring_shifts_operand_lives_until_the_compute_stream_joins_the_shift() {
        let steps = ring(8);
        let temporary = |id: u32| (id != 0).then_some(0);
        let lt = lifetimes(6, &steps, temporary, |_| false);
        // Positions: the loop at 0, its body at 1..=5. Partial 1 is sent at 2 and the shift is
        // joined at 5 (the sum reads its result): it lives to 5, so partial 3 (born at 3) can
        // not take its bytes while the tp stream may still be reading them.
        assert_eq!(lt[1], Some(Lifetime { start: 1, end: 5 }));
        assert_eq!(lt[3], Some(Lifetime { start: 3, end: 5 }));
        assert!(lt[1].is_some_and(|a| lt[3].is_some_and(|b| a.overlaps(&b))));
        // A group of one does not communicate (no stream): the operand dies at its last use.
        let lt = lifetimes(6, &ring(1), temporary, |_| false);
        assert_eq!(lt[1], Some(Lifetime { start: 1, end: 2 }));
        assert!(!lt[1].is_some_and(|a| lt[3].is_some_and(|b| a.overlaps(&b))));
    }

    #[test]
    fn an_unjoined_collectives_operand_lives_to_the_end_of_the_iteration() {
        // Nothing in the body reads the shift's result: joined at the end of the iteration.
        let body = vec![gemm(0, 1), shift(1, 2, 8), gemm(0, 3)];
        let steps = vec![Step::Loop { count: 2, reverse: false, carries: Vec::new(), body, prefetch: Vec::new() }];
        let lt = lifetimes(4, &steps, |id| (id != 0).then_some(0), |_| false);
        assert_eq!(lt[1], Some(Lifetime { start: 1, end: 3 }));
    }
}
