//! Codegen shared by both kernel shapes: reduction states and their identities, folding lanes
//! into them and combining them across the block, the kernel parameters, stores of outputs, and
//! the scalars evaluated at the top of a kernel.

use titan_ir::{Op, Value};

use super::analyze::{Analysis, RedOp};
use crate::emit::{Elem, FCmp, Func, ICmp, Ty, Val};
use crate::values::{Body, Eval, Lay, Pos, narrow, storage, vec_align};
use crate::{GenResult, invalid, math};

/// Lanes per work item: the widest of 8, 4, 2, 1 dividing every size in `sizes`.
pub(super) fn lanes_dividing(sizes: &[u64]) -> u32 {
    [8u32, 4, 2, 1].into_iter().find(|&v| sizes.iter().all(|&s| s.is_multiple_of(u64::from(v)))).unwrap_or(1)
}

/// The state of one reduction of `op` after folding in the lanes of `x`; `valid` (i1) masks
/// the whole work item.
pub(super) fn update(f: &mut Func, op: RedOp, st: &[Val], x: Val, valid: Option<Val>) -> Vec<Val> {
    let lanes = x.ty.lanes();
    match op {
        RedOp::Sum | RedOp::Max => {
            let id = if op == RedOp::Sum { 0.0 } else { f64::NEG_INFINITY };
            let x = match valid {
                Some(ok) => {
                    let z = f.cf(id, x.ty);
                    f.select(ok, x, z)
                }
                None => x,
            };
            let mut acc = st[0];
            for l in 0..lanes {
                let e = f.extract(x, l);
                acc = if op == RedOp::Sum { f.addf(acc, e) } else { f.maximumf(acc, e) };
            }
            vec![acc]
        }
        RedOp::Lse => {
            let xm = match valid {
                Some(ok) => {
                    let z = f.cf(f64::NEG_INFINITY, x.ty);
                    f.select(ok, x, z)
                }
                None => x,
            };
            let mut m_item = f.extract(xm, 0);
            for l in 1..lanes {
                let e = f.extract(xm, l);
                m_item = f.maximumf(m_item, e);
            }
            let m_new = f.maximumf(st[0], m_item);
            let sc = lse_scale(f, st[0], m_new);
            let mut s = f.mulf(st[1], sc);
            let mv = f.splat(m_new, lanes);
            let dx = f.subf(xm, mv);
            let e = math::exp_approx(f, dx);
            let e = match valid {
                Some(ok) => {
                    let z = f.cf(0.0, e.ty);
                    f.select(ok, e, z)
                }
                None => e,
            };
            for l in 0..lanes {
                let el = f.extract(e, l);
                s = f.addf(s, el);
            }
            vec![m_new, s]
        }
    }
}

/// `exp(m_old - m_new)`, and 1 when both are equal (so two empty states stay empty).
fn lse_scale(f: &mut Func, m_old: Val, m_new: Val) -> Val {
    let eq = f.cmpf(FCmp::Oeq, m_old, m_new);
    let d = f.subf(m_old, m_new);
    let e = math::exp_approx(f, d);
    let one = f.f32c(1.0);
    f.select(eq, one, e)
}

pub(super) fn combine(f: &mut Func, op: RedOp, a: &[Val], b: &[Val]) -> Vec<Val> {
    match op {
        RedOp::Sum => vec![f.addf(a[0], b[0])],
        RedOp::Max => vec![f.maximumf(a[0], b[0])],
        RedOp::Lse => {
            // Scale the smaller-max side by exp(lo - hi): one exp per combine.
            let m = f.maximumf(a[0], b[0]);
            let ge = f.cmpf(FCmp::Oge, a[0], b[0]);
            let (hs, ls) = (f.select(ge, a[1], b[1]), f.select(ge, b[1], a[1]));
            let (hm, lm) = (f.select(ge, a[0], b[0]), f.select(ge, b[0], a[0]));
            let sc = lse_scale(f, lm, hm);
            let t = f.mulf(ls, sc);
            vec![m, f.addf(hs, t)]
        }
    }
}

/// Reduce per-thread states across the block; every thread gets the totals, computed in the
/// same order everywhere. Warp butterflies first; then lane 0 of each warp publishes its
/// warp's state in shared memory and every warp reduces those states with one more butterfly
/// (lane `l` takes warp `l`'s state).
pub(super) fn block_reduce(f: &mut Func, ops: &[RedOp], states: Vec<Vec<Val>>, threads: u32, smem: Val, tid: Val) -> Vec<Vec<Val>> {
    let butterfly = |f: &mut Func, states: &mut Vec<Vec<Val>>, width: u32| {
        let mut off = width / 2;
        while off >= 1 {
            for (op, st) in ops.iter().zip(states.iter_mut()) {
                let other: Vec<Val> = st.iter().map(|&x| f.shuffle_xor(x, off)).collect();
                *st = combine(f, *op, st, &other);
            }
            off /= 2;
        }
    };
    let mut states = states;
    butterfly(f, &mut states, threads.min(32));
    let warps = threads.div_ceil(32);
    if warps <= 1 {
        return states;
    }
    let ncomp: usize = states.iter().map(Vec::len).sum();
    let c32 = f.i32c(32);
    let lane = f.remui(tid, c32);
    let warp = f.divui(tid, c32);
    let zero = f.i32c(0);
    let is0 = f.cmpi(ICmp::Eq, lane, zero);
    let flat: Vec<Val> = states.iter().flatten().copied().collect();
    f.if_then(is0, |f| {
        let w = f.extui(warp, Elem::I64);
        let nc = f.i64c(ncomp as i64);
        let base = f.muli(w, nc);
        for (c, &x) in flat.iter().enumerate() {
            let o = f.i64c(c as i64);
            let idx = f.addi(base, o);
            f.store_at(x, smem, idx, 4);
        }
    });
    f.barrier();
    // Within each group of `width` lanes, lane l reads warp l's state (identity past the last
    // warp), so every group, hence every lane, folds the same values in the same order.
    let width = warps.next_power_of_two().min(32);
    let wm = f.i32c(i64::from(width) - 1);
    let slot = f.andi(lane, wm);
    let nw = f.i32c(i64::from(warps));
    let has = f.cmpi(ICmp::Slt, slot, nw);
    let last = f.i32c(i64::from(warps) - 1);
    let src = f.minsi(slot, last);
    let src = f.extui(src, Elem::I64);
    let nc = f.i64c(ncomp as i64);
    let base = f.muli(src, nc);
    let mut c = 0usize;
    let mut cross: Vec<Vec<Val>> = Vec::new();
    for (op, st) in ops.iter().zip(&states) {
        let mut comp = Vec::new();
        for id in op.identity().into_iter().take(st.len()) {
            let o = f.i64c(c as i64);
            let idx = f.addi(base, o);
            let x = f.load_at(smem, idx, Ty::f32(), 4);
            let id = f.f32c(id as f32);
            comp.push(f.select(has, x, id));
            c += 1;
        }
        cross.push(comp);
    }
    butterfly(f, &mut cross, width);
    f.barrier();
    cross
}

/// Identity states of reductions.
pub(super) fn identities(f: &mut Func, ops: &[RedOp]) -> Vec<Vec<Val>> {
    ops.iter().map(|op| op.identity().into_iter().map(|x| f.f32c(x as f32)).collect()).collect()
}

/// What every fused kernel starts with: the function and its parameters (args, outputs, the
/// workspace when there is one), the evaluator, the thread and block index, whether this is
/// thread 0 (i1), and the scalars evaluated at the top (Scalar outputs stored by thread 0 of
/// block 0).
pub(super) struct Top<'b, 'g> {
    pub(super) f: Func,
    pub(super) ev: Eval<'b, 'g>,
    pub(super) p: Params,
    pub(super) tid: Val,
    pub(super) bid: Val,
    pub(super) is_t0: Val,
}

pub(super) fn kernel_top<'b, 'g>(b: &'b Body<'g>, a: &Analysis, ws: bool) -> GenResult<Top<'b, 'g>> {
    let nparams = b.r.args.len() + b.r.outputs.len() + usize::from(ws);
    let mut f = Func::new(nparams);
    let (args, p) = params(&f, b, ws);
    let mut ev = Eval::new(b, a.lay.clone(), args);
    if !a.flat {
        ev.row_len = a.d;
        ev.rows = a.rows;
    }
    let tid = f.thread_id();
    let bid = f.block_id();
    let zero32 = f.i32c(0);
    let is_t0 = f.cmpi(ICmp::Eq, tid, zero32);
    let b0 = f.cmpi(ICmp::Eq, bid, zero32);
    let first = f.andi(is_t0, b0);
    scalars_at_top(&mut f, &mut ev, b, &p, first)?;
    Ok(Top { f, ev, p, tid, bid, is_t0 })
}

/// Kernel parameters: args, outputs, then the workspace.
pub(super) struct Params {
    pub(super) outs: Vec<Val>,
    pub(super) ws: Option<Val>,
}

pub(super) fn params(f: &Func, b: &Body, ws: bool) -> (Vec<Val>, Params) {
    let na = b.r.args.len();
    let no = b.r.outputs.len();
    let args = (0..na).map(|i| f.param(i)).collect();
    let outs = (0..no).map(|i| f.param(na + i)).collect();
    (args, Params { outs, ws: ws.then(|| f.param(na + no)) })
}

/// Store output `oi` (value `v`) at `pos` (its linear index), guarded by `valid`.
pub(super) fn store_output(f: &mut Func, ev: &mut Eval, p: &Params, oi: usize, v: Value, pos: &Pos, valid: Option<Val>) -> GenResult<()> {
    if let Some((node, _)) = ev.b.def(v)
        && let Op::Transpose { perm } = &node.op
    {
        return store_transposed(f, ev, p, oi, node.inputs[0], perm, pos, valid);
    }
    let at = pos.lin;
    let x = ev.lanes(f, v, pos)?;
    let st = storage(ev.b.dtype(v))?;
    let align = vec_align(st, pos.lanes, ev.b.numel(v));
    let ptr = p.outs[oi];
    match valid {
        Some(ok) => f.if_then(ok, |f| {
            let y = narrow(f, x, st);
            f.store_at(y, ptr, at, align);
        }),
        None => {
            let y = narrow(f, x, st);
            f.store_at(y, ptr, at, align);
        }
    }
    Ok(())
}

/// Store output `oi`, `transpose(x)` with `perm`, at one work item of `x`'s domain: each lane
/// goes to its transposed position, one element at a time (scattered stores).
#[allow(clippy::too_many_arguments)]
fn store_transposed(f: &mut Func, ev: &mut Eval, p: &Params, oi: usize, x: Value, perm: &[usize], pos: &Pos, valid: Option<Val>) -> GenResult<()> {
    let shape = ev.b.shape[x.index()].clone();
    if perm.len() != shape.len() {
        return invalid(format!("transpose perm {perm:?} does not match the rank of {x}"));
    }
    let xv = ev.lanes(f, x, pos)?;
    let st = storage(ev.b.dtype(x))?;
    let y = narrow(f, xv, st);
    // Output strides, and for each input axis the output stride it moves along.
    let out_shape: Vec<u64> = perm.iter().map(|&a| shape[a]).collect();
    let mut out_strides = vec![1u64; out_shape.len()];
    for i in (0..out_shape.len().saturating_sub(1)).rev() {
        out_strides[i] = out_strides[i + 1] * out_shape[i + 1];
    }
    let mut stride_of_in = vec![0u64; shape.len()];
    for (j, &a) in perm.iter().enumerate() {
        stride_of_in[a] = out_strides[j];
    }
    let ptr = p.outs[oi];
    let store = |f: &mut Func| {
        for l in 0..pos.lanes {
            let o = f.i64c(i64::from(l));
            let mut rest = f.addi(pos.lin, o);
            let mut dst = f.i64c(0);
            for a in (0..shape.len()).rev() {
                let sz = f.i64c(shape[a] as i64);
                let coord = if a == 0 { rest } else { f.remui(rest, sz) };
                let s = f.i64c(stride_of_in[a] as i64);
                let t = f.muli(coord, s);
                dst = f.addi(dst, t);
                if a > 0 {
                    rest = f.divui(rest, sz);
                }
            }
            let e = f.extract(y, l);
            f.store_at(e, ptr, dst, st.bytes());
        }
    };
    match valid {
        Some(ok) => f.if_then(ok, store),
        None => store(f),
    }
    Ok(())
}

/// Store a uniform output value from one thread (`who` is i1).
pub(super) fn store_uniform(f: &mut Func, ev: &mut Eval, p: &Params, oi: usize, v: Value, at: Val, who: Val) -> GenResult<()> {
    let x = ev.uniform(f, v)?;
    let st = storage(ev.b.dtype(v))?;
    let ptr = p.outs[oi];
    f.if_then(who, |f| {
        let y = narrow(f, x, st);
        f.store_at(y, ptr, at, st.bytes());
    });
    Ok(())
}

/// Evaluate every Scalar value at the top of the kernel (so nested regions may use them) and
/// store Scalar outputs from global thread 0.
pub(super) fn scalars_at_top(f: &mut Func, ev: &mut Eval, b: &Body, p: &Params, first: Val) -> GenResult<()> {
    for node in b.nodes() {
        for &r in node.inputs.iter().chain(&node.results) {
            if ev.lay[r.index()] == Lay::Scalar {
                ev.uniform(f, r)?;
            }
        }
    }
    for (oi, o) in b.r.outputs.iter().enumerate() {
        if ev.lay[o.value.index()] == Lay::Scalar {
            let z = f.i64c(0);
            store_uniform(f, ev, p, oi, o.value, z, first)?;
        }
    }
    Ok(())
}

/// Shared-memory floats block reductions need: one slot per warp and state component.
pub(super) fn red_smem(ops_comps: usize) -> u64 {
    32 * ops_comps.max(2) as u64
}
