//! `optimizer` kernels: every `adamw` node of the step (with `lr_schedule` and the pointwise
//! producers of the gradients: casts, the clip multiply) in one multi-tensor launch. A `cast`
//! of a new master (its compute copy, `compute-copies`) is one more output of its tensor's
//! update, stored from the same f32 value.
//!
//! A compile-time table splits each tensor into chunks of 4096 elements, numbered across the
//! launch; CTA `b` updates the chunks `c = b (mod grid)`, in one grid-stride loop per tensor
//! over that tensor's chunks (so only its pointers are live in the loop). Scalars
//! (the learning rate, bias corrections in f64) are computed once per thread. The arithmetic
//! follows the interpreter's AdamW operation by operation, so results match it bit for bit
//! apart from the f64 `pow` of the bias corrections.

use titan_ir::{AdamWConfig, Graph, Node, Op, Region};

use crate::emit::{Elem, Func, ICmp, Ty, Val};
use crate::values::{Body, Eval, Lay, narrow, storage, vec_align};
use crate::{GenResult, Generated, invalid, math, unsupported};

const BLOCK: u64 = 256;
/// Resident CTAs per SM asked of ptxas (`.minnctapersm`, at most 85 registers a thread).
const CTAS_PER_SM: u32 = 3;
/// One wave of resident CTAs: a larger grid-stride grid leaves its last CTAs to run after the
/// first finish, on part of each SM (1056 CTAs, 2.7 waves: `perf_optimizer` 2,161 us against
/// 2,126 us with 396 on the H200).
const GRID_CAP: u64 = CTAS_PER_SM as u64 * crate::SMS;
/// Elements per chunk: 256 threads x 4 lanes x 4 items.
const CHUNK: u64 = 4096;

struct Tensor<'g> {
    node: &'g Node,
    cfg: AdamWConfig,
    n: u64,
    lanes: u32,
    first_chunk: u64,
}

/// Per-node scalars: `(lr, 1 - b1^t, 1 - b2^t, 1 - lr wd)` as f32.
struct Scalars {
    lr: Val,
    bc1: Val,
    bc2: Val,
    decay: Val,
}

pub(crate) fn generate(g: &Graph, r: &Region, entry: &str) -> GenResult<Generated> {
    let b = Body::new(g, r)?;
    let mut lay: Vec<Lay> = b.r.values.iter().map(|v| if v.ty.rank() == 0 { Lay::Scalar } else { Lay::Elem }).collect();
    let mut tensors = Vec::new();
    let mut chunks = 0u64;
    for node in b.nodes() {
        match &node.op {
            Op::AdamW(cfg) => {
                let p = node.inputs[0];
                let n = b.numel(p);
                if n == 0 {
                    continue;
                }
                for &v in node.inputs[..4].iter().chain(&node.results) {
                    lay[v.index()] = Lay::Elem;
                }
                let lanes = [4u32, 2, 1].into_iter().find(|&l| n.is_multiple_of(u64::from(l))).unwrap_or(1);
                tensors.push(Tensor { node, cfg: *cfg, n, lanes, first_chunk: chunks });
                chunks += n.div_ceil(CHUNK);
            }
            Op::LrSchedule(_) | Op::Unary(_) | Op::Binary(_) | Op::Cast | Op::Constant { .. } | Op::Reshape => {}
            Op::Broadcast { .. } if b.numel(node.inputs[0]) == 1 => {}
            other => {
                return unsupported(format!(
                    "`{}` in an optimizer kernel; only adamw, lr_schedule and pointwise gradient producers belong there",
                    other.name()
                ));
            }
        }
    }
    if tensors.is_empty() {
        return invalid("an optimizer body needs at least one adamw node");
    }
    for o in &b.r.outputs {
        let v = o.value;
        let from_adamw = b.def(v).is_some_and(|(n, _)| matches!(n.op, Op::AdamW(_))) || copy_of(&b, v).is_some();
        if lay[v.index()] == Lay::Elem && !from_adamw {
            return unsupported(format!("optimizer output {v} is not an adamw result; compute it in a fused kernel"));
        }
    }
    if chunks > i32::MAX as u64 {
        return unsupported("more than 2^31 optimizer chunks");
    }
    let grid = chunks.clamp(1, GRID_CAP);
    let na = b.r.args.len();
    let no = b.r.outputs.len();
    let mut f = Func::new(na + no);
    f.min_ctas_per_sm(CTAS_PER_SM);
    let args: Vec<Val> = (0..na).map(|i| f.param(i)).collect();
    let outs: Vec<Val> = (0..no).map(|i| f.param(na + i)).collect();
    let mut ev = Eval::new(&b, lay.clone(), args);
    let tid = f.thread_id();
    let bid = f.block_id();
    let zero32 = f.i32c(0);
    let t0 = f.cmpi(ICmp::Eq, tid, zero32);
    let b0 = f.cmpi(ICmp::Eq, bid, zero32);
    let first = f.andi(t0, b0);
    // Uniform values first (nested regions use them), Scalar outputs from thread 0.
    for node in b.nodes() {
        for &res in node.inputs.iter().chain(&node.results) {
            if lay[res.index()] == Lay::Scalar {
                ev.uniform(&mut f, res)?;
            }
        }
    }
    for (oi, o) in b.r.outputs.iter().enumerate() {
        if lay[o.value.index()] == Lay::Scalar {
            let x = ev.uniform(&mut f, o.value)?;
            let st = storage(b.dtype(o.value))?;
            let ptr = outs[oi];
            f.if_then(first, |f| {
                let y = narrow(f, x, st);
                let z = f.i64c(0);
                f.store_at(y, ptr, z, st.bytes());
            });
        }
    }
    let tid64 = f.extui(tid, Elem::I64);
    let bid64 = f.extui(bid, Elem::I64);
    let gstep = f.i64c(grid as i64);
    // CTA `b` updates the chunks `c = b (mod grid)` of the launch, in order. One grid-stride
    // loop per tensor over its chunks [first, end) (the same chunks in the same order as one
    // loop over all of them with a switch per chunk): each loop keeps only its own tensor's
    // pointers live, so the kernel's registers do not grow with the number of tensors (with
    // one loop, the compiler hoisted every pointer parameter out of it: 8B with the compute
    // copies spilled).
    let mut scalars = Vec::new();
    for t in &tensors {
        scalars.push(node_scalars(&mut f, &mut ev, t.node, &t.cfg)?);
    }
    for (t, sc) in tensors.iter().zip(&scalars) {
        let first = t.first_chunk;
        let end = f.i64c((first + t.n.div_ceil(CHUNK)) as i64);
        // The first chunk >= `first` congruent to `b` modulo `grid`.
        let skew = f.i64c(((grid - first % grid) % grid) as i64);
        let r = f.addi(bid64, skew);
        let r = f.remui(r, gstep);
        let base = f.i64c(first as i64);
        let start = f.addi(base, r);
        f.try_for_loop(start, end, gstep, &[], |f, c, _| -> GenResult<Vec<Val>> {
            tensor_chunk(f, &mut ev, &b, &outs, t, sc, c, tid64)?;
            Ok(vec![])
        })?;
    }
    Ok(Generated::new(f.finish(entry, BLOCK as u32, grid as u32), BLOCK as u32, grid as u32, 0))
}

/// For an output that is the `cast` of an adamw result (a compute copy of the new master,
/// `compute-copies`), that result.
fn copy_of(b: &Body, v: titan_ir::Value) -> Option<titan_ir::Value> {
    let (n, _) = b.def(v)?;
    let src = *n.inputs.first()?;
    let from_adamw = b.def(src).is_some_and(|(p, _)| matches!(p.op, Op::AdamW(_)));
    (matches!(n.op, Op::Cast) && n.inputs.len() == 1 && from_adamw).then_some(src)
}

/// The scalars of one adamw node, in f64 where the interpreter uses f64.
fn node_scalars(f: &mut Func, ev: &mut Eval, node: &Node, cfg: &AdamWConfig) -> GenResult<Scalars> {
    let lr = ev.uniform(f, node.inputs[4])?;
    let step = ev.uniform(f, node.inputs[5])?;
    let step = f.as_i64(step);
    let one_i = f.i64c(1);
    let step = f.maxsi(step, one_i);
    let one = f.f64c(1.0);
    let p1 = math::powi_f64(f, cfg.beta1, step);
    let p2 = math::powi_f64(f, cfg.beta2, step);
    let bc1 = f.subf(one, p1);
    let bc1 = f.truncf(bc1, Elem::F32);
    let bc2 = f.subf(one, p2);
    let bc2 = f.truncf(bc2, Elem::F32);
    let wd = f.f32c(cfg.weight_decay as f32);
    let one32 = f.f32c(1.0);
    let lw = f.mulf(lr, wd);
    let decay = f.subf(one32, lw);
    Ok(Scalars { lr, bc1, bc2, decay })
}

/// One chunk of tensor `t`: each thread updates `CHUNK / (BLOCK * lanes)` vectors.
#[allow(clippy::too_many_arguments)]
fn tensor_chunk(f: &mut Func, ev: &mut Eval, b: &Body, outs: &[Val], t: &Tensor, s: &Scalars, c: Val, tid64: Val) -> GenResult<()> {
    let lanes = t.lanes;
    let per_thread = CHUNK / (BLOCK * u64::from(lanes));
    let first = f.i64c(t.first_chunk as i64);
    let local = f.subi(c, first);
    let ch = f.i64c(CHUNK as i64);
    let base = f.muli(local, ch);
    let lo = f.i64c(0);
    let hi = f.i64c(per_thread as i64);
    let one = f.i64c(1);
    f.try_for_loop(lo, hi, one, &[], |f, it, _| -> GenResult<Vec<Val>> {
        let bt = f.i64c(BLOCK as i64);
        let w = f.muli(it, bt);
        let w = f.addi(w, tid64);
        let l = f.i64c(i64::from(lanes));
        let e = f.muli(w, l);
        let e = f.addi(base, e);
        let n = f.i64c(t.n as i64);
        let inside = f.cmpi(ICmp::Slt, e, n);
        f.try_if_then(inside, |f| {
            let r = update(f, ev, b, outs, t, s, e);
            ev.forget_items();
            r
        })?;
        Ok(vec![])
    })?;
    Ok(())
}

/// AdamW on the `lanes` elements at `e`, as `interp::model::adamw` computes it.
fn update(f: &mut Func, ev: &mut Eval, b: &Body, outs: &[Val], t: &Tensor, s: &Scalars, e: Val) -> GenResult<()> {
    let lanes = t.lanes;
    let pos = ev.pos(lanes, e, None);
    let node = t.node;
    let p = ev.lanes(f, node.inputs[0], &pos)?;
    let g = ev.lanes(f, node.inputs[1], &pos)?;
    let m = ev.lanes(f, node.inputs[2], &pos)?;
    let v = ev.lanes(f, node.inputs[3], &pos)?;
    let ty = Ty::lanes_of(Elem::F32, lanes);
    let c = |f: &mut Func, x: f32| f.cf(f64::from(x), ty);
    let b1 = t.cfg.beta1 as f32;
    let b2 = t.cfg.beta2 as f32;
    let b1v = c(f, b1);
    let omb1 = c(f, 1.0 - b1);
    let b2v = c(f, b2);
    let omb2 = c(f, 1.0 - b2);
    let eps = c(f, t.cfg.eps as f32);
    let x1 = f.mulf(b1v, m);
    let x2 = f.mulf(omb1, g);
    let mi = f.addf(x1, x2);
    let y1 = f.mulf(b2v, v);
    let y2 = f.mulf(omb2, g);
    let y2 = f.mulf(y2, g);
    let vi = f.addf(y1, y2);
    let bc1 = f.splat(s.bc1, lanes);
    let bc2 = f.splat(s.bc2, lanes);
    let mhat = f.divf(mi, bc1);
    let vhat = f.divf(vi, bc2);
    let decay = f.splat(s.decay, lanes);
    let lr = f.splat(s.lr, lanes);
    let pd = f.mulf(p, decay);
    let num = f.mulf(lr, mhat);
    let sq = f.sqrt(vhat);
    let den = f.addf(sq, eps);
    let q = f.divf(num, den);
    let pn = f.subf(pd, q);
    let results = [pn, mi, vi];
    for (ri, &res) in node.results.iter().enumerate() {
        for (oi, o) in b.r.outputs.iter().enumerate() {
            // The result itself, or its cast (a compute copy): the same f32 value rounded to
            // the output's dtype, as a `cast` kernel would store it.
            if o.value != res && copy_of(b, o.value) != Some(res) {
                continue;
            }
            let st = storage(b.dtype(o.value))?;
            let x = math::round_to(f, results[ri], st);
            let x = narrow(f, x, st);
            let align = vec_align(st, lanes, t.n);
            f.store_at(x, outs[oi], e, align);
        }
    }
    Ok(())
}
