//! Flat kernels: a grid-stride loop over vectors of every element domain of the body, for groups
//! without row ops.

use titan_ir::Op;

use super::analyze::{AccSrc, Analysis, RedOp};
use super::cross_block::{Geometry, Partials, finish_accs, workspace_bytes};
use super::reduce::{Params, Top, identities, kernel_top, lanes_dividing, red_smem, store_output, update};
use crate::emit::{Elem, Func, ICmp, Ty, Val};
use crate::values::{Body, Eval, Lay, narrow, storage};
use crate::{GenResult, Generated, invalid, math, unsupported};

/// Threads of a flat kernel.
const FLAT_BLOCK: u64 = 256;
/// Grid cap of flat kernels: 8 CTAs of 256 threads on each of 132 SMs.
const FLAT_GRID_CAP: u64 = 1056;

/// One element domain of a flat kernel: the values with `n` elements.
struct Domain {
    n: u64,
    lanes: u32,
    nvec: u64,
}

/// The element domains a flat kernel stores or reduces, each with the widest vector width that
/// divides it and keeps broadcast sources' rows whole.
fn flat_domains(b: &Body, a: &Analysis) -> Vec<Domain> {
    let mut ns: Vec<u64> = b.r.outputs.iter().filter(|o| a.lay[o.value.index()] == Lay::Elem).map(|o| b.numel(o.value)).collect();
    for acc in &a.accs {
        if let AccSrc::Elem(v) = acc.src {
            ns.push(b.numel(v));
        }
    }
    ns.sort_unstable();
    ns.dedup();
    ns.into_iter()
        .map(|n| {
            let mut sizes = vec![n];
            for node in b.nodes() {
                if matches!(node.op, Op::Broadcast { .. }) && a.lay[node.inputs[0].index()] == Lay::Gen && b.numel(node.results[0]) == n {
                    sizes.push(b.shape[node.results[0].index()].last().copied().unwrap_or(1));
                }
            }
            let lanes = lanes_dividing(&sizes);
            Domain { n, lanes, nvec: n / u64::from(lanes) }
        })
        .collect()
}

/// One work item of a flat kernel in domain `dom`: store its outputs, fold its reductions.
#[allow(clippy::too_many_arguments)]
fn flat_item(f: &mut Func, ev: &mut Eval, b: &Body, a: &Analysis, p: &Params, dom: &Domain, i: Val, valid: Option<Val>, st: &[Val]) -> GenResult<Vec<Val>> {
    let l = f.i64c(i64::from(dom.lanes));
    let lin = f.muli(i, l);
    let pos = ev.pos(dom.lanes, lin, None);
    for (oi, o) in b.r.outputs.iter().enumerate() {
        if a.lay[o.value.index()] == Lay::Elem && b.numel(o.value) == dom.n {
            store_output(f, ev, p, oi, o.value, &pos, valid)?;
        }
    }
    let mut next = st.to_vec();
    for (k, acc) in a.accs.iter().filter(|x| !x.col).enumerate() {
        let AccSrc::Elem(v) = acc.src else {
            return invalid("per-row accumulation in a flat kernel");
        };
        if b.numel(v) == dom.n {
            let x = ev.lanes(f, v, &pos)?;
            next[k] = update(f, acc.op, &[st[k]], x, valid)[0];
        }
    }
    Ok(next)
}

pub(super) fn gen_flat(b: &Body, a: &Analysis, entry: &str) -> GenResult<Generated> {
    if a.accs.iter().any(|x| x.col) {
        return invalid("column sums in a flat kernel");
    }
    let doms = flat_domains(b, a);
    if let Some(t) = tiled_transpose(b, &doms) {
        if packs(b, &doms[0], &t) {
            return gen_packed(b, a, entry, &t);
        }
        return gen_tiled(b, a, entry, &doms[0], &t);
    }
    // Work in chunks of one vector per thread; a table of chunk offsets maps a chunk to its domain.
    let single = doms.len() == 1;
    let max_nvec = doms.iter().map(|d| d.nvec).max().unwrap_or(1);
    let threads = if max_nvec <= 1 && doms.len() <= 1 { 32 } else { FLAT_BLOCK };
    let mut first_chunk = Vec::new();
    let mut chunks = 0u64;
    for d in &doms {
        first_chunk.push(chunks);
        chunks += d.nvec.div_ceil(threads);
    }
    if chunks > i32::MAX as u64 {
        return unsupported(format!("a pointwise kernel of {chunks} chunks exceeds the grid limit"));
    }
    let grid = chunks.clamp(1, FLAT_GRID_CAP);
    let Start { mut f, mut ev, p, tid, bid, init, ws_bytes } = start(b, a, grid)?;
    let tid64 = f.extui(tid, Elem::I64);
    let bid64 = f.extui(bid, Elem::I64);
    let tt = f.i64c(threads as i64);
    let parts = if doms.is_empty() {
        init.clone()
    } else if single {
        // One domain: a plain grid-stride loop over its vectors.
        let dom = &doms[0];
        let start = f.muli(bid64, tt);
        let start = f.addi(start, tid64);
        let end = f.i64c(dom.nvec as i64);
        let step = f.i64c((grid * threads) as i64);
        f.try_for_loop(start, end, step, &init, |f, i, st| {
            let next = flat_item(f, &mut ev, b, a, &p, dom, i, None, st);
            ev.forget_items();
            next
        })?
    } else {
        let end = f.i64c(chunks as i64);
        let step = f.i64c(grid as i64);
        f.try_for_loop(bid64, end, step, &init, |f, c, st| {
            let mut k = f.i32c(0);
            for &fc in &first_chunk[1..] {
                let s = f.i64c(fc as i64);
                let ge = f.cmpi(ICmp::Uge, c, s);
                let one = f.extui(ge, Elem::I32);
                k = f.addi(k, one);
            }
            f.try_switch_values(k, doms.len(), st, |f, di| {
                let dom = &doms[di];
                let fc = f.i64c(first_chunk[di] as i64);
                let local = f.subi(c, fc);
                let base = f.muli(local, tt);
                let i = f.addi(base, tid64);
                let nv = f.i64c(dom.nvec as i64);
                let valid = f.cmpi(ICmp::Slt, i, nv);
                let last = f.i64c(dom.nvec as i64 - 1);
                let ic = f.minsi(i, last);
                let next = flat_item(f, &mut ev, b, a, &p, dom, ic, Some(valid), st);
                ev.forget_items();
                next
            })
        })?
    };
    finish(Start { f, ev, p, tid, bid, init, ws_bytes }, a, parts, entry, threads, grid)
}

/// What every flat kernel starts with: its function, parameters and evaluator, the scalar
/// outputs computed once at the top, and the reductions' identity states.
struct Start<'b, 'g> {
    f: Func,
    ev: Eval<'b, 'g>,
    p: Params,
    tid: Val,
    bid: Val,
    init: Vec<Val>,
    ws_bytes: u64,
}

fn start<'b, 'g>(b: &'b Body<'g>, a: &Analysis, grid: u64) -> GenResult<Start<'b, 'g>> {
    let ws_bytes = workspace_bytes(a, grid, 1);
    let Top { mut f, ev, p, tid, bid, .. } = kernel_top(b, a, ws_bytes > 0)?;
    let ops: Vec<RedOp> = a.accs.iter().map(|x| x.op).collect();
    let init: Vec<Val> = identities(&mut f, &ops).into_iter().flatten().collect();
    Ok(Start { f, ev, p, tid, bid, init, ws_bytes })
}

/// Finish the cross-block reductions from each thread's partial states and emit the kernel.
fn finish(k: Start<'_, '_>, a: &Analysis, parts: Vec<Val>, entry: &str, threads: u64, grid: u64) -> GenResult<Generated> {
    let Start { mut f, mut ev, p, tid, bid, ws_bytes, .. } = k;
    if !a.accs.is_empty() {
        let smem = f.shared_array("titan_red", Elem::F32, red_smem(1));
        let geo = Geometry { threads: threads as u32, grid, d: 1, lanes: 1, col_of: vec![], smem, tid, bid };
        let parts = Partials { scalar: parts.into_iter().map(|x| vec![x]).collect(), col: vec![] };
        finish_accs(&mut f, &mut ev, a, &p, parts, &geo)?;
    }
    Ok(Generated::new(f.finish(entry, threads as u32, grid as u32), threads as u32, grid as u32, ws_bytes))
}

/// The first row and column of tile `tile` (row-major over tiles, `tiles_c` across) of
/// `rows x cols` tiles.
fn tile_origin(f: &mut Func, tile: Val, tiles_c: u64, rows: u64, cols: u64) -> (Val, Val) {
    let tc = f.i64c(tiles_c as i64);
    let tr = f.divui(tile, tc);
    let tcol = f.remui(tile, tc);
    let r = f.i64c(rows as i64);
    let c = f.i64c(cols as i64);
    (f.muli(tr, r), f.muli(tcol, c))
}

/// Side of the square tiles a transposing kernel moves through shared memory.
const TILE: u64 = 64;
/// Row pitch of a tile in shared memory, in elements: 4 more than the tile so that a column
/// read of one-byte elements falls in distinct banks.
const TILE_PITCH: u64 = TILE + 4;
/// Consecutive output elements each thread stores in the second phase of a tile.
const TILE_RUN: u64 = 4;

/// A flat kernel whose transposed outputs go through shared memory: the 2-D domain `[rows,
/// cols]` and, per output, `Some(x)` when it stores `transpose(x)`.
struct Tiled {
    rows: u64,
    cols: u64,
    transposed: Vec<Option<titan_ir::Value>>,
}

/// The tiling of a one-domain flat kernel that stores a 2-D `transpose` (float8's column-scaled
/// operands, stored K-major for the TN GEMMs), when both sides are multiples of [`TILE`];
/// `None` keeps the element-at-a-time scattered stores.
fn tiled_transpose(b: &Body, doms: &[Domain]) -> Option<Tiled> {
    let [dom] = doms else { return None };
    let mut shape = None;
    let mut transposed = Vec::with_capacity(b.r.outputs.len());
    for o in &b.r.outputs {
        match b.def(o.value) {
            Some((node, _)) if matches!(&node.op, Op::Transpose { perm } if perm.as_slice() == [1, 0]) => {
                let x = node.inputs[0];
                let s = b.shape[x.index()].clone();
                if s.len() != 2 || b.numel(x) != dom.n || shape.is_some_and(|t: (u64, u64)| t != (s[0], s[1])) {
                    return None;
                }
                shape = Some((s[0], s[1]));
                transposed.push(Some(x));
            }
            Some((node, _)) if matches!(node.op, Op::Transpose { .. }) => return None,
            _ => transposed.push(None),
        }
    }
    let (rows, cols) = shape?;
    (rows.is_multiple_of(TILE) && cols.is_multiple_of(TILE) && rows / TILE * (cols / TILE) <= i32::MAX as u64).then_some(Tiled { rows, cols, transposed })
}

/// A flat kernel over `TILE x TILE` tiles of a 2-D domain. Each tile is computed in the
/// domain's order (vector loads along the rows, the untransposed outputs stored as in
/// [`gen_flat`], reductions folded); the transposed outputs' values go to shared memory, and
/// after a barrier each thread stores [`TILE_RUN`] consecutive elements of a transposed row,
/// so the global stores are coalesced instead of one scattered element per store.
fn gen_tiled(b: &Body, a: &Analysis, entry: &str, dom: &Domain, t: &Tiled) -> GenResult<Generated> {
    let threads = FLAT_BLOCK;
    let lanes = dom.lanes.min(8);
    let (tiles_r, tiles_c) = (t.rows / TILE, t.cols / TILE);
    let tiles = tiles_r * tiles_c;
    let grid = tiles.clamp(1, FLAT_GRID_CAP);
    let Start { mut f, mut ev, p, tid, bid, init, ws_bytes } = start(b, a, grid)?;
    let mut smem = Vec::with_capacity(t.transposed.len());
    for (oi, x) in t.transposed.iter().enumerate() {
        smem.push(match x {
            Some(x) => Some((f.shared_array(&format!("titan_tile{oi}"), storage(b.dtype(*x))?, TILE * TILE_PITCH), storage(b.dtype(*x))?)),
            None => None,
        });
    }
    let tid64 = f.extui(tid, Elem::I64);
    let bid64 = f.extui(bid, Elem::I64);
    let end = f.i64c(tiles as i64);
    let step = f.i64c(grid as i64);
    let parts = f.try_for_loop(bid64, end, step, &init, |f, tile, st| {
        let (r0, c0) = tile_origin(f, tile, tiles_c, TILE, TILE);
        let tile_c = f.i64c(TILE as i64);
        let cols = f.i64c(t.cols as i64);
        let pitch = f.i64c(TILE_PITCH as i64);
        let mut st = st.to_vec();
        // Phase 1: the tile in the domain's order, `lanes` elements of a row per work item.
        let items = TILE * TILE / u64::from(lanes);
        for k in 0..items.div_ceil(threads) {
            let kk = f.i64c((k * threads) as i64);
            let item = f.addi(kk, tid64);
            let l = f.i64c(i64::from(lanes));
            let e = f.muli(item, l);
            let rl = f.divui(e, tile_c);
            let cl = f.remui(e, tile_c);
            let r = f.addi(r0, rl);
            let c = f.addi(c0, cl);
            let row = f.muli(r, cols);
            let lin = f.addi(row, c);
            let pos = ev.pos(lanes, lin, None);
            for (oi, o) in b.r.outputs.iter().enumerate() {
                match (&t.transposed[oi], &smem[oi]) {
                    (Some(x), Some((sm, el))) => {
                        let xv = ev.lanes(f, *x, &pos)?;
                        let y = narrow(f, xv, *el);
                        let at = f.muli(rl, pitch);
                        let at = f.addi(at, cl);
                        for ln in 0..lanes {
                            let off = f.i64c(i64::from(ln));
                            let idx = f.addi(at, off);
                            let v = f.extract(y, ln);
                            f.store_at(v, *sm, idx, el.bytes());
                        }
                    }
                    _ if a.lay[o.value.index()] == Lay::Elem && b.numel(o.value) == dom.n => store_output(f, &mut ev, &p, oi, o.value, &pos, None)?,
                    _ => {}
                }
            }
            for (k, acc) in a.accs.iter().filter(|x| !x.col).enumerate() {
                let AccSrc::Elem(v) = acc.src else {
                    return invalid("per-row accumulation in a flat kernel");
                };
                if b.numel(v) == dom.n {
                    let x = ev.lanes(f, v, &pos)?;
                    st[k] = update(f, acc.op, &[st[k]], x, None)[0];
                }
            }
            ev.forget_items();
        }
        f.barrier();
        // Phase 2: each thread stores `TILE_RUN` consecutive elements of one transposed row.
        let rows = f.i64c(t.rows as i64);
        let runs_per_col = f.i64c((TILE / TILE_RUN) as i64);
        let run = f.i64c(TILE_RUN as i64);
        for (oi, sm) in smem.iter().enumerate() {
            let Some((sm, el)) = sm else { continue };
            for k in 0..(TILE * TILE / TILE_RUN).div_ceil(threads) {
                let kk = f.i64c((k * threads) as i64);
                let q = f.addi(kk, tid64);
                let cl = f.divui(q, runs_per_col);
                let rq = f.remui(q, runs_per_col);
                let rl = f.muli(rq, run);
                let mut vals = Vec::with_capacity(TILE_RUN as usize);
                for i in 0..TILE_RUN {
                    let off = f.i64c(i as i64);
                    let r = f.addi(rl, off);
                    let at = f.muli(r, pitch);
                    let at = f.addi(at, cl);
                    vals.push(f.load_at(*sm, at, Ty::S(*el), el.bytes()));
                }
                let v = f.vector_of(&vals);
                let c = f.addi(c0, cl);
                let dst = f.muli(c, rows);
                let dst = f.addi(dst, r0);
                let dst = f.addi(dst, rl);
                f.store_at(v, p.outs[oi], dst, el.bytes() * TILE_RUN as u32);
            }
        }
        // The next tile overwrites shared memory only after every thread has read this one.
        f.barrier();
        Ok(st)
    })?;
    finish(Start { f, ev, p, tid, bid, init: Vec::new(), ws_bytes }, a, parts, entry, threads, grid)
}

/// Rows of a [`gen_packed`] tile: 32 groups of four, one 16-byte vector per transposed row and
/// group of 16 rows in shared memory.
const PACK_ROWS: u64 = 128;
/// Columns of a [`gen_packed`] tile: eight threads of eight lanes (one 16-byte bf16 load each).
const PACK_COLS: u64 = 64;

/// Whether a tiled transpose can take [`gen_packed`]: every transposed output is fp8 (one
/// byte), the domain's vectors hold at least 8 lanes and both sides are multiples of the tile.
fn packs(b: &Body, dom: &Domain, t: &Tiled) -> bool {
    dom.lanes >= 8
        && t.rows.is_multiple_of(PACK_ROWS)
        && t.cols.is_multiple_of(PACK_COLS)
        && t.transposed.iter().flatten().all(|&x| matches!(storage(b.dtype(x)), Ok(Elem::F8E4M3 | Elem::F8E5M2)))
}

/// A transposing flat kernel for fp8 outputs over `PACK_ROWS x PACK_COLS` tiles, one tile per
/// CTA (a grid-stride loop only when the body also reduces, whose partials are per CTA).
///
/// Thread `t` owns column group `t % 8` (8 columns) and rows `4 (t / 8) .. +4` of the tile: it
/// computes its four rows (four 16-byte loads in flight), packs each column's four fp8 bytes
/// into one 32-bit word (`prmt`) and stores eight words to shared memory, where a transposed row
/// (an input column) is 32 words. After a barrier each thread moves two 16-byte vectors of a
/// transposed row to global memory. The 16-byte chunks of a transposed row are XOR-swizzled by
/// the column group (`chunk ^ (col / 8)`), so both the word stores and the vector loads are free
/// of bank conflicts. Against [`gen_tiled`]: a quarter of the shared-memory instructions and
/// 16-byte instead of 4-byte global stores.
fn gen_packed(b: &Body, a: &Analysis, entry: &str, t: &Tiled) -> GenResult<Generated> {
    let threads = FLAT_BLOCK;
    let groups = PACK_COLS / 8;
    let words = PACK_ROWS / 4;
    let (tiles_r, tiles_c) = (t.rows / PACK_ROWS, t.cols / PACK_COLS);
    let tiles = tiles_r * tiles_c;
    if tiles > i32::MAX as u64 {
        return unsupported(format!("a transposing kernel of {tiles} tiles exceeds the grid limit"));
    }
    let grid = if a.accs.is_empty() { tiles.max(1) } else { tiles.clamp(1, FLAT_GRID_CAP) };
    let Start { mut f, mut ev, p, tid, bid, init, ws_bytes } = start(b, a, grid)?;
    let smem: Vec<Option<(Val, Elem)>> = t
        .transposed
        .iter()
        .enumerate()
        .map(|(oi, x)| match x {
            Some(x) => storage(b.dtype(*x)).map(|el| Some((f.shared_array(&format!("titan_pack{oi}"), Elem::I32, PACK_COLS * words), el))),
            None => Ok(None),
        })
        .collect::<GenResult<_>>()?;
    let tid64 = f.extui(tid, Elem::I64);
    let bid64 = f.extui(bid, Elem::I64);
    let c8 = f.i64c(8);
    let c4 = f.i64c(4);
    let c32 = f.i64c(32);
    let cg = f.remui(tid64, c8);
    let rq = f.divui(tid64, c8);
    // This thread's word slot in a transposed row: chunk `rq / 4` swizzled by the column group.
    let chunk = f.divui(rq, c4);
    let chunk = f.xori(chunk, cg);
    let slot = f.muli(chunk, c4);
    let within = f.remui(rq, c4);
    let slot = f.addi(slot, within);
    let end = f.i64c(tiles as i64);
    let step = f.i64c(grid as i64);
    let parts = f.try_for_loop(bid64, end, step, &init, |f, tile, st| {
        let (r0, c0) = tile_origin(f, tile, tiles_c, PACK_ROWS, PACK_COLS);
        let cols = f.i64c(t.cols as i64);
        let mut st = st.to_vec();
        // Phase 1: four rows of eight columns, each transposed value as fp8 pairs.
        let col = f.muli(cg, c8);
        let col = f.addi(c0, col);
        let row = f.muli(rq, c4);
        let row = f.addi(r0, row);
        let mut pairs: Vec<Vec<Vec<Val>>> = vec![Vec::new(); t.transposed.len()];
        for i in 0..4 {
            let off = f.i64c(i);
            let r = f.addi(row, off);
            let base = f.muli(r, cols);
            let lin = f.addi(base, col);
            let pos = ev.pos(8, lin, None);
            for (oi, o) in b.r.outputs.iter().enumerate() {
                match (&t.transposed[oi], &smem[oi]) {
                    (Some(x), Some((_, el))) => {
                        let xv = ev.lanes(f, *x, &pos)?;
                        pairs[oi].push(math::f8_pairs(f, xv, *el));
                    }
                    _ if a.lay[o.value.index()] == Lay::Elem => store_output(f, &mut ev, &p, oi, o.value, &pos, None)?,
                    _ => {}
                }
            }
            for (k, acc) in a.accs.iter().filter(|x| !x.col).enumerate() {
                let AccSrc::Elem(v) = acc.src else {
                    return invalid("per-row accumulation in a flat kernel");
                };
                let x = ev.lanes(f, v, &pos)?;
                st[k] = update(f, acc.op, &[st[k]], x, None)[0];
            }
            ev.forget_items();
        }
        // Each column's four rows as one word: rows 0-1 and 2-3 side by side, then the even and
        // the odd column's bytes selected from them.
        let sixteen = f.i32c(16);
        for (oi, sm) in smem.iter().enumerate() {
            let Some((sm, _)) = sm else { continue };
            let rows = &pairs[oi];
            for k in 0..4u64 {
                let join = |f: &mut Func, lo: Val, hi: Val| {
                    let lo = f.extui(lo, Elem::I32);
                    let hi = f.extui(hi, Elem::I32);
                    let hi = f.shli(hi, sixteen);
                    f.ori(lo, hi)
                };
                let k_us = k as usize;
                let r01 = join(f, rows[0][k_us], rows[1][k_us]);
                let r23 = join(f, rows[2][k_us], rows[3][k_us]);
                for (j, sel) in [(2 * k, "0x6420"), (2 * k + 1, "0x7531")] {
                    let w = f.inline_asm(&format!("prmt.b32 $0, $1, $2, {sel};"), "=r,r,r", &[r01, r23], Ty::S(Elem::I32));
                    let c = f.muli(cg, c8);
                    let jj = f.i64c(j as i64);
                    let c = f.addi(c, jj);
                    let at = f.muli(c, c32);
                    let at = f.addi(at, slot);
                    f.store_at(w, *sm, at, 4);
                }
            }
        }
        f.barrier();
        // Phase 2: 16-byte vectors of the transposed rows, eight per row.
        let nrows = f.i64c(t.rows as i64);
        let v4 = Ty::V(Elem::I32, 4);
        for (oi, sm) in smem.iter().enumerate() {
            let Some((sm, _)) = sm else { continue };
            for k in 0..(PACK_COLS * groups).div_ceil(threads) {
                let kk = f.i64c((k * threads) as i64);
                let q = f.addi(kk, tid64);
                let cl = f.divui(q, c8);
                let part = f.remui(q, c8);
                let cgrp = f.divui(cl, c8);
                let sw = f.xori(part, cgrp);
                let at = f.muli(cl, c32);
                let sw4 = f.muli(sw, c4);
                let at = f.addi(at, sw4);
                let v = f.load_at(*sm, at, v4, 16);
                // Byte offset (c0 + cl) * rows + r0 + 16 part, in words.
                let c = f.addi(c0, cl);
                let dst = f.muli(c, nrows);
                let dst = f.addi(dst, r0);
                let p16 = f.i64c(16);
                let pb = f.muli(part, p16);
                let dst = f.addi(dst, pb);
                let dst = f.divui(dst, c4);
                f.store_at(v, p.outs[oi], dst, 16);
            }
        }
        // A next tile (grid-stride) overwrites shared memory only after every thread has read.
        if grid < tiles {
            f.barrier();
        }
        Ok(st)
    })?;
    finish(Start { f, ev, p, tid, bid, init: Vec::new(), ws_bytes }, a, parts, entry, threads, grid)
}
