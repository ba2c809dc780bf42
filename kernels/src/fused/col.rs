//! Column kernels: reductions over the rows of a `[rows, d]` domain with no reduction along the
//! rows (float8's per-column amax over the tokens, column sums), for any row length and row
//! count. A two-pass scheme in one launch, deterministic, no atomics on values:
//!
//! 1. The grid is (column tiles) x (row chunks). A CTA of `tx x ty` threads covers `tx` column
//!    vectors (`lanes` consecutive columns each, so a warp reads one contiguous run of a row)
//!    and `ty` rows at a time of its chunk, [`UNROLL`] independent loads in flight per thread.
//!    Per-element outputs are stored as they are computed. The `ty` partial states of a column
//!    are folded in order through shared memory and written as the chunk's partial to the
//!    workspace.
//! 2. The last CTA of a column tile to arrive (a counter per tile) folds the tile's chunk
//!    partials in chunk order, zeroing them, and computes and stores the per-column results
//!    (`PostCol` values such as the float8 scale of the amax) for its columns.
//!
//! A maximum is exact, so the result equals the interpreter's whatever the split; sums are
//! reproducible (fixed order) but not the interpreter's sequential order.

use super::analyze::{AccSrc, Analysis, RedOp};
use super::cross_block::arrive;
use super::reduce::{Top, kernel_top, lanes_dividing, store_output};
use crate::emit::{Elem, Func, ICmp, Ty, Val};
use crate::values::{Body, Lay, storage};
use crate::{GenResult, Generated, math, unsupported};

/// Threads of a column kernel.
const THREADS: u64 = 256;
/// CTAs a column kernel aims for: about eight waves of 8 CTAs on each of 132 SMs, so that the
/// last wave's imbalance costs little.
const TARGET_CTAS: u64 = 8 * 1056;
/// Fewest rows a chunk covers. It bounds the partials (one f32 row per chunk) and sets how
/// much a CTA reads: with 64-row chunks the 8B shapes' CTAs read 32 KiB each and finished at
/// 1.8-2.8 TB/s; with 256 rows (128 KiB per CTA, 4x fewer partials to fold) the same kernels
/// ran 1.26-1.53x faster on the H200 (`gpu_check.py perf`, `docs/performance.md`).
const MIN_CHUNK_ROWS: u64 = 256;
/// Fewest rows a chunk covers when [`MIN_CHUNK_ROWS`] would give fewer than [`MIN_CTAS`] CTAs.
const SHORT_CHUNK_ROWS: u64 = 64;
/// CTAs a column kernel aims for at least: two per SM of the H200.
const MIN_CTAS: u64 = 2 * 132;
/// Rows each thread loads per loop iteration (independent loads in flight).
const UNROLL: u64 = 4;

/// Whether a row-shaped body is a column kernel: column accumulations of per-element values
/// and nothing that needs a whole row (no row reductions, per-row values, rope or per-column
/// outputs, which [`super::row`] handles).
pub(super) fn is_column(b: &Body, a: &Analysis) -> bool {
    !a.flat
        && a.reds.is_empty()
        && a.row_ops.is_empty()
        && a.rope.is_none()
        && !a.accs.is_empty()
        && a.accs.iter().all(|x| x.col && matches!(x.src, AccSrc::Elem(_)))
        && !a.lay.iter().any(|l| matches!(l, Lay::Row | Lay::PostScalar | Lay::Gen))
        && !b.r.outputs.iter().any(|o| a.lay[o.value.index()] == Lay::Col)
}

/// How a column kernel covers `[rows, d]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ColGeo {
    pub(super) lanes: u32,
    /// Column vectors of a row (`d / lanes`).
    pub(super) nvec: u64,
    /// Threads along the columns (column vectors per tile) and along the rows.
    pub(super) tx: u64,
    pub(super) ty: u64,
    pub(super) tiles: u64,
    pub(super) chunk_rows: u64,
    pub(super) chunks: u64,
}

pub(super) fn col_geometry(rows: u64, d: u64) -> ColGeo {
    let lanes = lanes_dividing(&[d]);
    let nvec = d / u64::from(lanes);
    let tx = nvec.next_power_of_two().min(32);
    let ty = THREADS / tx;
    let tiles = nvec.div_ceil(tx);
    let most = rows.div_ceil(MIN_CHUNK_ROWS).max(1);
    let mut want = TARGET_CTAS.div_ceil(tiles).clamp(1, most);
    // Narrow operands (few column tiles) would leave SMs idle with long chunks: shorter chunks,
    // down to `SHORT_CHUNK_ROWS`, until every SM has two CTAs.
    if tiles * want < MIN_CTAS {
        want = MIN_CTAS.div_ceil(tiles).clamp(want, rows.div_ceil(SHORT_CHUNK_ROWS).max(1));
    }
    let chunk_rows = rows.div_ceil(want).max(1);
    let chunks = rows.div_ceil(chunk_rows).max(1);
    ColGeo { lanes, nvec, tx, ty, tiles, chunk_rows, chunks }
}

fn round4(x: u64) -> u64 {
    x.div_ceil(4) * 4
}

/// Workspace words: one arrival counter per tile, then `[acc][chunk][d]` f32 partials.
fn ws_words(geo: &ColGeo, naccs: u64, d: u64) -> (u64, u64) {
    let parts = round4(geo.tiles);
    (parts, parts + naccs * geo.chunks * d)
}

fn fold(f: &mut Func, op: RedOp, a: Val, b: Val) -> Val {
    if op == RedOp::Max { f.maximumf(a, b) } else { f.addf(a, b) }
}

/// Fold each thread's states over the `ty` threads of its column (in `ty` order) through
/// shared memory; the totals are valid in the threads of row 0 (`ty == 0`).
#[allow(clippy::too_many_arguments)]
fn fold_rows(f: &mut Func, smem: &[Val], ops: &[RedOp], states: &[Val], geo: &ColGeo, tx: Val, ty: Val, is_row0: Val) -> Vec<Val> {
    let lanes = geo.lanes;
    let vt = Ty::lanes_of(Elem::F32, lanes);
    let align = (lanes * 4).min(16);
    let l = f.i64c(i64::from(lanes));
    let txn = f.i64c(geo.tx as i64);
    let tx64 = f.extui(tx, Elem::I64);
    let ty64 = f.extui(ty, Elem::I64);
    let slot = f.muli(ty64, txn);
    let slot = f.addi(slot, tx64);
    let at = f.muli(slot, l);
    for (sm, &st) in smem.iter().zip(states) {
        f.store_at(st, *sm, at, align);
    }
    f.barrier();
    let ids: Vec<Val> = ops.iter().map(|op| f.cf(op.identity()[0], vt)).collect();
    let tys: Vec<Ty> = vec![vt; ops.len()];
    let out = f.if_else(
        is_row0,
        &tys,
        |f| {
            let lo = f.i64c(0);
            let hi = f.i64c(geo.ty as i64);
            let one = f.i64c(1);
            f.for_loop(lo, hi, one, &ids, |f, k, st| {
                let s = f.muli(k, txn);
                let s = f.addi(s, tx64);
                let idx = f.muli(s, l);
                ops.iter()
                    .zip(smem)
                    .zip(st)
                    .map(|((&op, sm), &cur)| {
                        let x = f.load_at(*sm, idx, vt, align);
                        fold(f, op, cur, x)
                    })
                    .collect()
            })
        },
        |_| ids.clone(),
    );
    // The shared slots are written again (by the second pass) only after everyone has read.
    f.barrier();
    out
}

pub(super) fn gen_cols(b: &Body, a: &Analysis, entry: &str) -> GenResult<Generated> {
    let geo = col_geometry(a.rows, a.d);
    let grid = geo.tiles * geo.chunks;
    if grid > i32::MAX as u64 {
        return unsupported(format!("a column reduction over [{}, {}] needs {grid} CTAs, beyond the grid limit", a.rows, a.d));
    }
    let accs: Vec<_> = a.accs.iter().collect();
    let ops: Vec<RedOp> = accs.iter().map(|x| x.op).collect();
    let (parts_at, words) = ws_words(&geo, accs.len() as u64, a.d);
    let ws_bytes = 4 * words;
    let Top { mut f, mut ev, p, tid, bid, is_t0 } = kernel_top(b, a, true)?;
    let Some(ws) = p.ws else {
        return unsupported("column kernel without a workspace");
    };
    let zero32 = f.i32c(0);
    let lanes = geo.lanes;
    let vt = Ty::lanes_of(Elem::F32, lanes);
    let align = (lanes * 4).min(16);
    let smem: Vec<Val> = (0..accs.len()).map(|i| f.shared_array(&format!("titan_colred{i}"), Elem::F32, THREADS * u64::from(lanes))).collect();
    let txc = f.i32c(geo.tx as i64);
    let tx = f.remui(tid, txc);
    let ty = f.divui(tid, txc);
    let is_row0 = f.cmpi(ICmp::Eq, ty, zero32);
    let bid64 = f.extui(bid, Elem::I64);
    let tiles = f.i64c(geo.tiles as i64);
    let tile = f.remui(bid64, tiles);
    let chunk = f.divui(bid64, tiles);
    // This thread's column vector (clamped into the row; `cvalid` says whether it is real).
    let txn = f.i64c(geo.tx as i64);
    let tx64 = f.extui(tx, Elem::I64);
    let cv = f.muli(tile, txn);
    let cv = f.addi(cv, tx64);
    let cvalid = if geo.tiles * geo.tx > geo.nvec {
        let n = f.i64c(geo.nvec as i64);
        let ok = f.cmpi(ICmp::Slt, cv, n);
        Some(ok)
    } else {
        None
    };
    let last_cv = f.i64c(geo.nvec as i64 - 1);
    let cv = f.minsi(cv, last_cv);
    let l = f.i64c(i64::from(lanes));
    let col = f.muli(cv, l);
    // Pass 1: this CTA's rows of its chunk.
    let cr = f.i64c(geo.chunk_rows as i64);
    let r0 = f.muli(chunk, cr);
    let rows = f.i64c(a.rows as i64);
    let rend = f.addi(r0, cr);
    let rend = f.minsi(rend, rows);
    let ty64 = f.extui(ty, Elem::I64);
    let start = f.addi(r0, ty64);
    let step = f.i64c((geo.ty * UNROLL) as i64);
    let init: Vec<Val> = ops.iter().map(|op| f.cf(op.identity()[0], vt)).collect();
    let d = f.i64c(a.d as i64);
    let last_row = f.i64c(a.rows as i64 - 1);
    let states = f.try_for_loop(start, rend, step, &init, |f, r, st| -> GenResult<Vec<Val>> {
        let mut st = st.to_vec();
        for u in 0..UNROLL {
            let off = f.i64c((u * geo.ty) as i64);
            let row = f.addi(r, off);
            let rvalid = f.cmpi(ICmp::Slt, row, rend);
            let valid = match cvalid {
                Some(c) => f.andi(rvalid, c),
                None => rvalid,
            };
            let row = f.minsi(row, last_row);
            let base = f.muli(row, d);
            let lin = f.addi(base, col);
            let pos = ev.pos(lanes, lin, Some(col));
            for (oi, o) in b.r.outputs.iter().enumerate() {
                if a.lay[o.value.index()] == Lay::Elem {
                    store_output(f, &mut ev, &p, oi, o.value, &pos, Some(valid))?;
                }
            }
            for (i, acc) in accs.iter().enumerate() {
                let AccSrc::Elem(v) = acc.src else {
                    return unsupported("a column kernel accumulates per-element values only");
                };
                let x = ev.lanes(f, v, &pos)?;
                let id = f.cf(acc.op.identity()[0], vt);
                let x = f.select(valid, x, id);
                st[i] = fold(f, acc.op, st[i], x);
            }
        }
        ev.forget_items();
        Ok(st)
    })?;
    let totals = fold_rows(&mut f, &smem, &ops, &states, &geo, tx, ty, is_row0);
    // The chunk's partials: `[acc][chunk][col]`.
    let chunk_d = f.muli(chunk, d);
    let write = match cvalid {
        Some(c) => f.andi(is_row0, c),
        None => is_row0,
    };
    f.if_then(write, |f| {
        for (i, &t) in totals.iter().enumerate() {
            let base = f.i64c((parts_at + i as u64 * geo.chunks * a.d) as i64);
            let idx = f.addi(base, chunk_d);
            let idx = f.addi(idx, col);
            f.store_at(t, ws, idx, align);
        }
    });
    // Pass 2: the tile's last CTA folds its chunks in order.
    let expected = f.i32c(geo.chunks as i64);
    let last = arrive(&mut f, ws, tile, expected, 0, is_t0);
    f.try_if_then(last, |f| -> GenResult<()> {
        f.fence();
        // Chunks `ty, ty + ty_n, ...` of this thread's column, `UNROLL` loads in flight.
        let nch = f.i64c(geo.chunks as i64);
        let last_chunk = f.i64c(geo.chunks as i64 - 1);
        let step = f.i64c((geo.ty * UNROLL) as i64);
        let mine = f.for_loop(ty64, nch, step, &init, |f, k0, st| {
            // Every load first, then the zeroing stores (which could alias later loads).
            let mut got = Vec::new();
            for u in 0..UNROLL {
                let off = f.i64c((u * geo.ty) as i64);
                let k = f.addi(k0, off);
                let here = f.cmpi(ICmp::Slt, k, nch);
                let k = f.minsi(k, last_chunk);
                let kd = f.muli(k, d);
                for i in 0..ops.len() {
                    let base = f.i64c((parts_at + i as u64 * geo.chunks * a.d) as i64);
                    let idx = f.addi(base, kd);
                    let idx = f.addi(idx, col);
                    let x = f.load_at(ws, idx, vt, align);
                    got.push((i, here, idx, x));
                }
            }
            let mut st = st.to_vec();
            for &(i, here, idx, x) in &got {
                let zap = match cvalid {
                    Some(c) => f.andi(here, c),
                    None => here,
                };
                let zero = f.cf(0.0, vt);
                f.if_then(zap, |f| f.store_at(zero, ws, idx, align));
                let id = f.cf(ops[i].identity()[0], vt);
                let x = f.select(here, x, id);
                st[i] = fold(f, ops[i], st[i], x);
            }
            st
        });
        let totals = fold_rows(f, &smem, &ops, &mine, &geo, tx, ty, is_row0);
        f.try_if_then(write, |f| -> GenResult<()> {
            let pos = ev.pos(lanes, col, Some(col));
            for (acc, &t) in accs.iter().zip(&totals) {
                let mut t = t;
                if let Some(div) = acc.divide {
                    let dv = f.cf(div, vt);
                    t = f.divf(t, dv);
                }
                let t = math::round_to(f, t, storage(b.dtype(acc.result))?);
                ev.memo.insert((pos.id, acc.result), t);
            }
            for (oi, o) in b.r.outputs.iter().enumerate() {
                if a.lay[o.value.index()] == Lay::PostCol {
                    store_output(f, &mut ev, &p, oi, o.value, &pos, None)?;
                }
            }
            ev.forget_items();
            Ok(())
        })?;
        f.if_then(is_t0, |f| {
            let zero = f.i32c(0);
            f.store_at(zero, ws, tile, 4);
        });
        Ok(())
    })?;
    Ok(Generated::new(f.finish(entry, THREADS as u32, grid as u32), THREADS as u32, grid as u32, ws_bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_covers_every_shape() {
        // 8b's grad_weight operands: 16 tiles of 256 columns, 256-row chunks.
        let g = col_geometry(8192, 4096);
        assert_eq!((g.lanes, g.tx, g.ty, g.tiles, g.chunk_rows, g.chunks), (8, 32, 8, 16, 256, 32));
        // The output head's dy: 501 tiles, 17 chunks of 482 rows.
        let g = col_geometry(8192, 128256);
        assert_eq!((g.tiles, g.chunk_rows, g.chunks), (501, 482, 17));
        // 8b's k and v projections: 4 tiles, so 66 chunks of 125 rows, two CTAs per SM.
        let g = col_geometry(8192, 1024);
        assert_eq!((g.tiles, g.chunk_rows, g.chunks), (4, 125, 66));
        // Odd widths: one column per lane, a partial last tile.
        let g = col_geometry(1000, 77);
        assert_eq!((g.lanes, g.tx, g.ty, g.tiles, g.chunks), (1, 32, 8, 3, 16));
        // Narrow rows: fewer threads across, more down.
        let g = col_geometry(96, 40);
        assert_eq!((g.lanes, g.nvec, g.tx, g.ty, g.tiles, g.chunks), (8, 5, 8, 32, 1, 2));
        for (rows, d) in [(1, 1), (7, 3), (8192, 14336), (100_000, 8)] {
            let g = col_geometry(rows, d);
            assert!(g.chunks * g.chunk_rows >= rows && (g.chunks - 1) * g.chunk_rows < rows, "{rows}x{d}: {g:?}");
            assert!(g.tiles * g.tx >= g.nvec && g.tx * g.ty == THREADS, "{rows}x{d}: {g:?}");
        }
    }
}
