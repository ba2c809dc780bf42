//! Cross-block accumulation: each CTA writes its partials to the workspace and the last CTA to
//! arrive (two levels: groups of CTAs, then the groups) folds them in CTA order, stores the
//! results and zeroes the workspace again.

use super::analyze::{Acc, Analysis, RedOp};
use super::reduce::{Params, block_reduce, combine, store_output, store_uniform};
use crate::emit::{Elem, Func, ICmp, Ty, Val};
use crate::values::{Eval, Lay, storage};
use crate::{GenResult, invalid, math};

/// Cross-block accumulation: per-thread partial states of scalar accs and per-chunk column
/// partials (`col_parts[acc][chunk]`, vectors at column `col_of[chunk]`).
pub(super) struct Partials {
    pub(super) scalar: Vec<Vec<Val>>,
    pub(super) col: Vec<Vec<Val>>,
}

pub(super) struct Geometry {
    pub(super) threads: u32,
    pub(super) grid: u64,
    /// Row kernels: row length, lanes and the column of each chunk with its validity.
    pub(super) d: u64,
    pub(super) lanes: u32,
    pub(super) col_of: Vec<(Val, Option<Val>)>,
    /// The block-reduction scratch, thread and block index.
    pub(super) smem: Val,
    pub(super) tid: Val,
    pub(super) bid: Val,
}

/// CTAs per group of the two-level cross-block finish.
const GROUP: u64 = 32;

fn round4(x: u64) -> u64 {
    x.div_ceil(4) * 4
}

/// Where the cross-block state lives in the workspace (offsets in 4-byte words): arrival
/// counters (the total, then one per group), per-CTA scalar partials `[acc][cta]`, per-group
/// scalar partials `[acc][group]`, per-CTA column partials `[acc][cta][col]`, per-group column
/// partials `[acc][group][col]`. Every region starts 16-byte aligned.
struct WsLayout {
    groups: u64,
    ps: u64,
    gps: u64,
    pc: u64,
    gpc: u64,
    words: u64,
}

impl WsLayout {
    fn new(ns: u64, nc: u64, grid: u64, d: u64) -> WsLayout {
        let groups = grid.div_ceil(GROUP);
        let ps = round4(1 + groups);
        let gps = ps + round4(ns * grid);
        let pc = gps + round4(ns * groups);
        let gpc = pc + nc * grid * d;
        let words = gpc + nc * groups * d;
        WsLayout { groups, ps, gps, pc, gpc, words }
    }
}

/// Workspace bytes for the accumulations of `a` with `grid` CTAs and rows of `d`.
pub(super) fn workspace_bytes(a: &Analysis, grid: u64, d: u64) -> u64 {
    if a.accs.is_empty() {
        return 0;
    }
    let ns = a.accs.iter().filter(|x| !x.col).count() as u64;
    let nc = a.accs.iter().filter(|x| x.col).count() as u64;
    4 * WsLayout::new(ns, nc, grid, d).words
}

/// Thread 0 bumps counter `idx` and publishes in shared slot `slot` whether it was the
/// `expected`-th (last) arrival; returns that flag (i1) in every thread.
pub(super) fn arrive(f: &mut Func, ws: Val, idx: Val, expected: Val, slot: i64, is_t0: Val) -> Val {
    let flag = f.shared_array("titan_last", Elem::I32, 2);
    let s = f.i64c(slot);
    f.fence();
    f.barrier();
    f.if_then(is_t0, |f| {
        let cnt = f.gep(ws, idx, Elem::I32);
        let one = f.i32c(1);
        let ticket = f.atomic_add_i32(cnt, one);
        let one = f.i32c(1);
        let last = f.subi(expected, one);
        let is_last = f.cmpi(ICmp::Eq, ticket, last);
        let zero = f.i32c(0);
        let v = f.select(is_last, one, zero);
        f.store_at(v, flag, s, 4);
    });
    f.barrier();
    let v = f.load_at(flag, s, Ty::S(Elem::I32), 4);
    let one = f.i32c(1);
    f.cmpi(ICmp::Eq, v, one)
}

/// Fold `count` consecutive rows of column partials (`src + k * d`, k in order) into `dst`,
/// zeroing what was read; `lanes`-wide, one column vector per thread and step. Returns nothing;
/// `emit` is given each total vector and its column (for the last level).
#[allow(clippy::too_many_arguments)]
fn fold_columns(
    f: &mut Func,
    ws: Val,
    src: Val,
    count: Val,
    d: u64,
    lanes: u32,
    geo: &Geometry,
    op: RedOp,
    mut emit: impl FnMut(&mut Func, Val, Val) -> GenResult<()>,
) -> GenResult<()> {
    let tid64 = f.extui(geo.tid, Elem::I64);
    let l = f.i64c(i64::from(lanes));
    let start = f.muli(tid64, l);
    let end = f.i64c(d as i64);
    let step = f.i64c(i64::from(geo.threads) * i64::from(lanes));
    let vt = Ty::lanes_of(Elem::F32, lanes);
    let align = (lanes * 4).min(16);
    f.try_for_loop(start, end, step, &[], |f, c, _| -> GenResult<Vec<Val>> {
        let init = f.cf(op.identity()[0], vt);
        let lo = f.i64c(0);
        let one = f.i64c(1);
        let dd = f.i64c(d as i64);
        let tot = f.for_loop(lo, count, one, &[init], |f, k, st| {
            let off = f.muli(k, dd);
            let idx = f.addi(src, off);
            let idx = f.addi(idx, c);
            let x = f.load_at(ws, idx, vt, align);
            let zero = f.cf(0.0, vt);
            f.store_at(zero, ws, idx, align);
            vec![if op == RedOp::Max { f.maximumf(st[0], x) } else { f.addf(st[0], x) }]
        });
        emit(f, tot[0], c)?;
        Ok(vec![])
    })?;
    Ok(())
}

/// Finish the cross-block accumulations: each CTA writes its partials; the last CTA of each
/// group of 32 folds the group's partials (in CTA order) into a group partial; the last group
/// folds the group partials (in group order), computes the Post values and stores them. Every
/// partial and counter is zeroed by whoever read it last.
pub(super) fn finish_accs(f: &mut Func, ev: &mut Eval, a: &Analysis, p: &Params, parts: Partials, geo: &Geometry) -> GenResult<()> {
    let Some(ws) = p.ws else {
        return invalid("cross-block accumulation without a workspace");
    };
    let (smem, tid, bid) = (geo.smem, geo.tid, geo.bid);
    let sacc: Vec<&Acc> = a.accs.iter().filter(|x| !x.col).collect();
    let cacc: Vec<&Acc> = a.accs.iter().filter(|x| x.col).collect();
    let (g, d) = (geo.grid, geo.d);
    let lay = WsLayout::new(sacc.len() as u64, cacc.len() as u64, g, d);
    let bid64 = f.extui(bid, Elem::I64);
    let zero32 = f.i32c(0);
    let is_t0 = f.cmpi(ICmp::Eq, tid, zero32);
    // 1. This CTA's partials.
    if !sacc.is_empty() {
        let ops: Vec<RedOp> = sacc.iter().map(|x| x.op).collect();
        let red = block_reduce(f, &ops, parts.scalar, geo.threads, smem, tid);
        f.if_then(is_t0, |f| {
            for (i, st) in red.iter().enumerate() {
                let base = f.i64c((lay.ps + i as u64 * g) as i64);
                let idx = f.addi(base, bid64);
                f.store_at(st[0], ws, idx, 4);
            }
        });
    }
    for (i, chunks) in parts.col.iter().enumerate() {
        for (c, &v) in chunks.iter().enumerate() {
            let (col, valid) = geo.col_of[c];
            let base = f.i64c((lay.pc + i as u64 * g * d) as i64);
            let dd = f.i64c(d as i64);
            let rowoff = f.muli(bid64, dd);
            let idx = f.addi(base, rowoff);
            let idx = f.addi(idx, col);
            let align = (v.ty.lanes() * 4).min(16);
            match valid {
                Some(ok) => f.if_then(ok, |f| f.store_at(v, ws, idx, align)),
                None => f.store_at(v, ws, idx, align),
            }
        }
    }
    // 2. The last CTA of each group folds the group.
    let gsz = f.i64c(GROUP as i64);
    let grp = f.divui(bid64, gsz);
    let first = f.muli(grp, gsz);
    let gend = f.i64c(g as i64);
    let left = f.subi(gend, first);
    let members = f.minsi(left, gsz);
    let members32 = f.trunci(members, Elem::I32);
    let one64 = f.i64c(1);
    let cidx = f.addi(grp, one64);
    let group_last = arrive(f, ws, cidx, members32, 0, is_t0);
    f.try_if_then(group_last, |f| {
        f.fence();
        f.if_then(is_t0, |f| {
            for (i, acc) in sacc.iter().enumerate() {
                let init = f.f32c(acc.op.identity()[0] as f32);
                let base = f.i64c((lay.ps + i as u64 * g) as i64);
                let src = f.addi(base, first);
                let lo = f.i64c(0);
                let one = f.i64c(1);
                let op = acc.op;
                let tot = f.for_loop(lo, members, one, &[init], |f, k, st| {
                    let idx = f.addi(src, k);
                    let x = f.load_at(ws, idx, Ty::f32(), 4);
                    let zero = f.f32c(0.0);
                    f.store_at(zero, ws, idx, 4);
                    combine(f, op, &[st[0]], &[x])
                });
                let gb = f.i64c((lay.gps + i as u64 * lay.groups) as i64);
                let gidx = f.addi(gb, grp);
                f.store_at(tot[0], ws, gidx, 4);
            }
            let zero = f.i32c(0);
            f.store_at(zero, ws, cidx, 4);
        });
        for (i, acc) in cacc.iter().enumerate() {
            let base = f.i64c((lay.pc + i as u64 * g * d) as i64);
            let dd = f.i64c(d as i64);
            let off = f.muli(first, dd);
            let src = f.addi(base, off);
            let gb = f.i64c((lay.gpc + i as u64 * lay.groups * d) as i64);
            let goff = f.muli(grp, dd);
            let dst = f.addi(gb, goff);
            fold_columns(f, ws, src, members, d, geo.lanes, geo, acc.op, |f, tot, c| {
                let at = f.addi(dst, c);
                let align = (tot.ty.lanes() * 4).min(16);
                f.store_at(tot, ws, at, align);
                Ok(())
            })?;
        }
        // 3. The last group finishes.
        let z = f.i64c(0);
        let ng = f.i32c(lay.groups as i64);
        let last = arrive(f, ws, z, ng, 1, is_t0);
        f.try_if_then(last, |f| last_block(f, ev, p, ws, geo, &lay, &sacc, &cacc))
    })
}

/// The last group's CTA: fold the group partials in group order, zero them, compute and store
/// the Post values, reset the total counter.
#[allow(clippy::too_many_arguments)]
fn last_block(f: &mut Func, ev: &mut Eval, p: &Params, ws: Val, geo: &Geometry, lay: &WsLayout, sacc: &[&Acc], cacc: &[&Acc]) -> GenResult<()> {
    f.fence();
    let zero32 = f.i32c(0);
    let is_t0 = f.cmpi(ICmp::Eq, geo.tid, zero32);
    let ngroups = f.i64c(lay.groups as i64);
    // Every thread folds the (few) scalar group partials itself, so all hold the totals.
    for (i, acc) in sacc.iter().enumerate() {
        let init = f.f32c(acc.op.identity()[0] as f32);
        let base = f.i64c((lay.gps + i as u64 * lay.groups) as i64);
        let lo = f.i64c(0);
        let one = f.i64c(1);
        let op = acc.op;
        let tot = f.for_loop(lo, ngroups, one, &[init], |f, k, st| {
            let idx = f.addi(base, k);
            let x = f.load_at(ws, idx, Ty::f32(), 4);
            combine(f, op, &[st[0]], &[x])
        });
        let mut t = tot[0];
        if let Some(div) = acc.divide {
            let c = f.f32c(div as f32);
            t = f.divf(t, c);
        }
        let t = math::round_to(f, t, storage(ev.b.dtype(acc.result))?);
        ev.uni.insert(acc.result, t);
    }
    f.barrier();
    // Zero the scalar group partials once everyone has read them.
    if !sacc.is_empty() {
        f.if_then(is_t0, |f| {
            for i in 0..sacc.len() {
                let base = (lay.gps + i as u64 * lay.groups) as i64;
                for k in 0..lay.groups as i64 {
                    let idx = f.i64c(base + k);
                    let zero = f.f32c(0.0);
                    f.store_at(zero, ws, idx, 4);
                }
            }
        });
    }
    // Post scalar values and outputs.
    for node in ev.b.nodes() {
        for &r in &node.results {
            if ev.lay[r.index()] == Lay::PostScalar {
                ev.uniform(f, r)?;
            }
        }
    }
    for (oi, o) in ev.b.r.outputs.iter().enumerate() {
        if ev.lay[o.value.index()] == Lay::PostScalar {
            let z = f.i64c(0);
            store_uniform(f, ev, p, oi, o.value, z, is_t0)?;
        }
    }
    // Column totals, Post column values and outputs. With several column sums the first one
    // drives the loop and the others are folded at the same columns.
    if let Some((first, rest)) = cacc.split_first() {
        let d = geo.d;
        let lanes = geo.lanes;
        let base0 = f.i64c(lay.gpc as i64);
        fold_columns(f, ws, base0, ngroups, d, lanes, geo, first.op, |f, tot0, c| {
            let pos = ev.pos(lanes, c, Some(c));
            let mut totals = vec![(first, tot0)];
            for (j, acc) in rest.iter().enumerate() {
                let vt = Ty::lanes_of(Elem::F32, lanes);
                let init = f.cf(acc.op.identity()[0], vt);
                let lo = f.i64c(0);
                let one = f.i64c(1);
                let dd = f.i64c(d as i64);
                let base = f.i64c((lay.gpc + (j as u64 + 1) * lay.groups * d) as i64);
                let op = acc.op;
                let align = (lanes * 4).min(16);
                let tot = f.for_loop(lo, ngroups, one, &[init], |f, k, st| {
                    let off = f.muli(k, dd);
                    let idx = f.addi(base, off);
                    let idx = f.addi(idx, c);
                    let x = f.load_at(ws, idx, vt, align);
                    let zero = f.cf(0.0, vt);
                    f.store_at(zero, ws, idx, align);
                    vec![if op == RedOp::Max { f.maximumf(st[0], x) } else { f.addf(st[0], x) }]
                });
                totals.push((acc, tot[0]));
            }
            for (acc, mut t) in totals {
                if let Some(div) = acc.divide {
                    let dv = f.cf(div, t.ty);
                    t = f.divf(t, dv);
                }
                let t = math::round_to(f, t, storage(ev.b.dtype(acc.result))?);
                ev.memo.insert((pos.id, acc.result), t);
            }
            for (oi, o) in ev.b.r.outputs.iter().enumerate() {
                if ev.lay[o.value.index()] == Lay::PostCol {
                    store_output(f, ev, p, oi, o.value, &pos, None)?;
                }
            }
            ev.forget_items();
            Ok(())
        })?;
    }
    f.if_then(is_t0, |f| {
        let z = f.i64c(0);
        let zero = f.i32c(0);
        f.store_at(zero, ws, z, 4);
    });
    Ok(())
}
