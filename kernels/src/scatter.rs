//! `scatter_add` kernels: `out[idx[i]] += src[i]` into a table that starts at zero, computed
//! owner-side so it is deterministic and needs neither atomics on the data nor a workspace.
//!
//! Each CTA owns 256 consecutive output rows and writes all of them (zero rows included):
//! 1. it counts the indices falling in its rows (one pass over `idx`, shared-memory atomics on
//!    counters only, whose totals do not depend on order);
//! 2. thread 0 cuts its rows into groups of at most 4096 matches (a row with more is a group of
//!    its own);
//! 3. per group, a block-wide ordered compaction lists the matching `i` in increasing order, a
//!    stable counting sort (one thread per row) orders them by row, and each row's sources are
//!    summed in f32 in increasing `i` and stored once, rounded to the output dtype;
//! 4. a row with more than 4096 matches is summed chunk by chunk of `idx` instead.
//!
//! Sums run in the reference interpreter's order (increasing `i`), so results are bitwise those
//! of the interpreter and identical run to run. Indices outside `[0, rows)` are ignored (the
//! interpreter reports them as errors).
//!
//! `scatter_add_shard(idx, src, shard)` writes row shard `k` of the table (`k` from the one-hot
//! `shard`, [`crate::gather::shard_index`]): every index is shifted by `k rows` when read, so
//! the indices of other shards fall outside `[0, rows)` and are ignored, which is the op's
//! meaning.

use titan_ir::{Graph, Op, Region};

use crate::emit::{Elem, Func, ICmp, Ty, Val};
use crate::values::{Body, narrow, storage, vec_align, widen};
use crate::{GenResult, Generated, invalid, unsupported};

const THREADS: u64 = 256;
/// Output rows per CTA (one per thread in the sort).
const RB: u64 = 256;
/// Matches a group lists in shared memory.
const CAP: u64 = 4096;
/// Column chunks a thread accumulates in registers.
const MAX_COL_CHUNKS: u64 = 8;

struct Shared {
    cnt: Val,
    gstart: Val,
    gsum: Val,
    list: Val,
    sorted: Val,
    start2: Val,
    warps: Val,
    misc: Val,
}

fn ld(f: &mut Func, p: Val, i: Val) -> Val {
    let i = f.as_i64(i);
    f.load_at(p, i, Ty::S(Elem::I32), 4)
}

fn st(f: &mut Func, v: Val, p: Val, i: Val) {
    let i = f.as_i64(i);
    f.store_at(v, p, i, 4);
}

/// Block-wide exclusive prefix sum of one i32 per thread: `(exclusive, total)`.
fn block_scan(f: &mut Func, x: Val, tid: Val, warps_buf: Val) -> (Val, Val) {
    let c32 = f.i32c(32);
    let lane = f.remui(tid, c32);
    let w = f.divui(tid, c32);
    let zero = f.i32c(0);
    let mut v = x;
    for o in [1u32, 2, 4, 8, 16] {
        let y = f.shuffle_up(v, o);
        let oc = f.i32c(i64::from(o));
        let ok = f.cmpi(ICmp::Sge, lane, oc);
        let y = f.select(ok, y, zero);
        v = f.addi(v, y);
    }
    let excl = f.subi(v, x);
    let c31 = f.i32c(31);
    let last = f.cmpi(ICmp::Eq, lane, c31);
    f.if_then(last, |f| st(f, v, warps_buf, w));
    f.barrier();
    let mut off = zero;
    let mut total = zero;
    for ww in 0..(THREADS / 32) {
        let wi = f.i32c(ww as i64);
        let t = ld(f, warps_buf, wi);
        let before = f.cmpi(ICmp::Slt, wi, w);
        let add = f.select(before, t, zero);
        off = f.addi(off, add);
        total = f.addi(total, t);
    }
    f.barrier();
    (f.addi(excl, off), total)
}

pub(crate) fn generate(g: &Graph, r: &Region, entry: &str) -> GenResult<Generated> {
    let b = Body::new(g, r)?;
    let nodes: Vec<_> = b.nodes().collect();
    let [node] = nodes.as_slice() else {
        return unsupported(format!("a scatter_add body must hold exactly one scatter_add node, found {}", nodes.len()));
    };
    if !matches!(node.op, Op::ScatterAdd | Op::ScatterAddShard) {
        return invalid(format!("a scatter_add body holds `{}`", node.op.name()));
    }
    let shard = matches!(node.op, Op::ScatterAddShard).then(|| node.inputs[2]);
    let (idx, src) = (node.inputs[0], node.inputs[1]);
    let out = node.results[0];
    let [o] = r.outputs.as_slice() else {
        return invalid("a scatter_add body must have exactly one output");
    };
    if o.value != out {
        return invalid("the scatter_add body's output must be the table");
    }
    let (Some(ii), Some(si)) = (b.arg_index(idx), b.arg_index(src)) else {
        return invalid("the indices and sources of a scatter_add must be body arguments");
    };
    let os = &b.shape[out.index()];
    let Some(&rows) = os.first() else {
        return invalid("the scatter_add table must have rank >= 1");
    };
    let d: u64 = os[1..].iter().product();
    let n = b.numel(idx);
    if b.numel(src) != n * d {
        return invalid("scatter_add sources must be one table row per index");
    }
    if rows == 0 || d == 0 {
        return unsupported("scatter_add into an empty table");
    }
    if n >= (1u64 << 31) / RB {
        return unsupported(format!("scatter_add with {n} indices; at most {} are supported", (1u64 << 31) / RB - 1));
    }
    let ste = storage(b.dtype(src))?;
    let it = storage(b.dtype(idx))?;
    if !matches!(it, Elem::I32 | Elem::I64) {
        return invalid("scatter_add indices must be i32 or i64");
    }
    let lanes = [8u32, 4, 2, 1].into_iter().find(|&v| d.is_multiple_of(u64::from(v)) && v * ste.bytes() <= 16).unwrap_or(1);
    let nvec = d / u64::from(lanes);
    let cpt = nvec.div_ceil(THREADS);
    if cpt > MAX_COL_CHUNKS {
        return unsupported(format!("scatter_add rows of {d} elements; at most {} are supported", MAX_COL_CHUNKS * THREADS * u64::from(lanes)));
    }
    let grid = rows.div_ceil(RB);
    if grid > i32::MAX as u64 {
        return unsupported("scatter_add table too large");
    }
    let na = r.args.len();
    let mut f = Func::new(na + 1);
    f.min_ctas_per_sm(4);
    let (ip, sp, op) = (f.param(ii), f.param(si), f.param(na));
    let sh = Shared {
        cnt: f.shared_array("titan_cnt", Elem::I32, RB),
        gstart: f.shared_array("titan_gstart", Elem::I32, RB + 2),
        gsum: f.shared_array("titan_gsum", Elem::I32, RB + 1),
        list: f.shared_array("titan_list", Elem::I32, CAP),
        sorted: f.shared_array("titan_sorted", Elem::I32, CAP),
        start2: f.shared_array("titan_start", Elem::I32, RB + 1),
        warps: f.shared_array("titan_warps", Elem::I32, THREADS / 32),
        misc: f.shared_array("titan_misc", Elem::I32, 4),
    };
    // The first row of the table's shard in the index space (0 for a whole table).
    let shard_base = match shard {
        Some(sv) => {
            let k = crate::gather::shard_index(&mut f, &b, sv)?;
            let nr = f.i64c(rows as i64);
            Some(f.muli(k, nr))
        }
        None => None,
    };
    let tid = f.thread_id();
    let bid = f.block_id();
    let tid64 = f.extui(tid, Elem::I64);
    let bid64 = f.extui(bid, Elem::I64);
    let rb = f.i64c(RB as i64);
    let r0 = f.muli(bid64, rb);
    let vrows = f.i64c(rows as i64);
    let left = f.subi(vrows, r0);
    let rb_eff = f.minsi(left, rb);
    let z64 = f.i64c(0);
    let one64 = f.i64c(1);
    let tstep = f.i64c(THREADS as i64);
    let nn = f.i64c(n as i64);
    let zero = f.i32c(0);
    let one = f.i32c(1);
    let is_t0 = f.cmpi(ICmp::Eq, tid, zero);

    // 1. Count matches per owned row.
    f.for_loop(tid64, rb, tstep, &[], |f, rr, _| {
        st(f, zero, sh.cnt, rr);
        vec![]
    });
    f.barrier();
    f.for_loop(tid64, nn, tstep, &[], |f, i, _| {
        let id = f.load_at(ip, i, Ty::S(it), it.bytes());
        let id = f.as_i64(id);
        let id = match shard_base {
            Some(sb) => f.subi(id, sb),
            None => id,
        };
        let local = f.subi(id, r0);
        let ge = f.cmpi(ICmp::Sge, local, z64);
        let lt = f.cmpi(ICmp::Slt, local, rb_eff);
        let mine = f.andi(ge, lt);
        f.if_then(mine, |f| {
            let p = f.gep(sh.cnt, local, Elem::I32);
            f.atomic_add_i32(p, one);
        });
        vec![]
    });
    f.barrier();

    // 2. Groups of rows with at most CAP matches (thread 0, in row order).
    let cap = f.i32c(CAP as i64);
    f.if_then(is_t0, |f| {
        let out = f.for_loop(z64, rb_eff, one64, &[zero, zero, zero], |f, rr, s| {
            let (ng, start, sum) = (s[0], s[1], s[2]);
            let c = ld(f, sh.cnt, rr);
            let with = f.addi(sum, c);
            let over = f.cmpi(ICmp::Sgt, with, cap);
            let r32 = f.trunci(rr, Elem::I32);
            let nonempty = f.cmpi(ICmp::Sgt, r32, start);
            let close = f.andi(over, nonempty);
            f.if_else(
                close,
                &[Ty::S(Elem::I32), Ty::S(Elem::I32), Ty::S(Elem::I32)],
                |f| {
                    st(f, start, sh.gstart, ng);
                    st(f, sum, sh.gsum, ng);
                    let ng1 = f.addi(ng, one);
                    vec![ng1, r32, c]
                },
                |_| vec![ng, start, with],
            )
        });
        let (ng, start, sum) = (out[0], out[1], out[2]);
        st(f, start, sh.gstart, ng);
        st(f, sum, sh.gsum, ng);
        let ng1 = f.addi(ng, one);
        let e32 = f.trunci(rb_eff, Elem::I32);
        st(f, e32, sh.gstart, ng1);
        st(f, ng1, sh.misc, zero);
    });
    f.barrier();

    // 3. Each group: list, sort, sum.
    let ng = ld(&mut f, sh.misc, zero);
    let ng = f.extsi(ng, Elem::I64);
    let dd = f.i64c(d as i64);
    let lanes64 = f.i64c(i64::from(lanes));
    let vt = Ty::lanes_of(ste, lanes);
    let acc_t = Ty::lanes_of(Elem::F32, lanes);
    let align_src = vec_align(ste, lanes, b.numel(src));
    let align_out = vec_align(ste, lanes, b.numel(out));
    // This thread's column chunks: (clamped column, valid).
    let mut cols: Vec<(Val, Option<Val>)> = Vec::new();
    for k in 0..cpt {
        let base = f.i64c((k * THREADS) as i64);
        let w = f.addi(base, tid64);
        let valid = if (k + 1) * THREADS > nvec {
            let nv = f.i64c(nvec as i64);
            Some(f.cmpi(ICmp::Slt, w, nv))
        } else {
            None
        };
        let last = f.i64c(nvec as i64 - 1);
        let w = f.minsi(w, last);
        cols.push((f.muli(w, lanes64), valid));
    }
    let zero_acc = f.cf(0.0, acc_t);
    let inits: Vec<Val> = vec![zero_acc; cols.len()];
    // Add source row `i` (i64) into the accumulators.
    let add_row = |f: &mut Func, i: Val, acc: &[Val]| -> Vec<Val> {
        let base = f.muli(i, dd);
        cols.iter()
            .zip(acc)
            .map(|(&(c, _), &a)| {
                let at = f.addi(base, c);
                let x = f.load_at(sp, at, vt, align_src);
                let x = widen(f, x);
                f.addf(a, x)
            })
            .collect()
    };
    // Store the accumulators as output row `row` (local, i64).
    let store_row = |f: &mut Func, row: Val, acc: &[Val]| {
        let gr = f.addi(r0, row);
        let base = f.muli(gr, dd);
        for (&(c, valid), &a) in cols.iter().zip(acc) {
            let at = f.addi(base, c);
            let y = narrow(f, a, ste);
            match valid {
                Some(ok) => f.if_then(ok, |f| f.store_at(y, op, at, align_out)),
                None => f.store_at(y, op, at, align_out),
            }
        }
    };
    let chunks = f.i64c(n.div_ceil(THREADS) as i64);
    f.for_loop(z64, ng, one64, &[], |f, k, _| {
        let ga = ld(f, sh.gstart, k);
        let k1 = f.addi(k, one64);
        let gb = ld(f, sh.gstart, k1);
        let total = ld(f, sh.gsum, k);
        let big = f.cmpi(ICmp::Sgt, total, cap);
        let ga64 = f.extsi(ga, Elem::I64);
        let gb64 = f.extsi(gb, Elem::I64);
        f.if_else(
            big,
            &[],
            |f| {
                // One row with more than CAP matches: compact and sum chunk by chunk.
                let target = f.addi(r0, ga64);
                let acc = f.for_loop(z64, chunks, one64, &inits, |f, c, acc| {
                    let base = f.muli(c, tstep);
                    let i = f.addi(base, tid64);
                    let inside = f.cmpi(ICmp::Slt, i, nn);
                    let last = f.i64c(n as i64 - 1);
                    let ic = f.minsi(i, last);
                    let id = f.load_at(ip, ic, Ty::S(it), it.bytes());
                    let id = f.as_i64(id);
                    let id = match shard_base {
                        Some(sb) => f.subi(id, sb),
                        None => id,
                    };
                    let eq = f.cmpi(ICmp::Eq, id, target);
                    let flag = f.andi(inside, eq);
                    let fl = f.extui(flag, Elem::I32);
                    let (excl, tot) = block_scan(f, fl, tid, sh.warps);
                    let i32v = f.trunci(i, Elem::I32);
                    f.if_then(flag, |f| st(f, i32v, sh.list, excl));
                    f.barrier();
                    let tot64 = f.extsi(tot, Elem::I64);
                    let acc2 = f.for_loop(z64, tot64, one64, acc, |f, e, acc| {
                        let j = ld(f, sh.list, e);
                        let j = f.extsi(j, Elem::I64);
                        add_row(f, j, acc)
                    });
                    f.barrier();
                    acc2
                });
                store_row(f, ga64, &acc);
                vec![]
            },
            |f| {
                // List the group's matches in increasing i, sort them by row, sum each row.
                let has = f.cmpi(ICmp::Sgt, total, zero);
                f.if_then(has, |f| {
                    f.for_loop(z64, chunks, one64, &[zero], |f, c, run| {
                        let base = f.muli(c, tstep);
                        let i = f.addi(base, tid64);
                        let inside = f.cmpi(ICmp::Slt, i, nn);
                        let last = f.i64c(n as i64 - 1);
                        let ic = f.minsi(i, last);
                        let id = f.load_at(ip, ic, Ty::S(it), it.bytes());
                        let id = f.as_i64(id);
                        let id = match shard_base {
                            Some(sb) => f.subi(id, sb),
                            None => id,
                        };
                        let local = f.subi(id, r0);
                        let ge = f.cmpi(ICmp::Sge, local, ga64);
                        let lt = f.cmpi(ICmp::Slt, local, gb64);
                        let m = f.andi(ge, lt);
                        let flag = f.andi(inside, m);
                        let fl = f.extui(flag, Elem::I32);
                        let (excl, tot) = block_scan(f, fl, tid, sh.warps);
                        let at = f.addi(run[0], excl);
                        let rbc = f.i64c(RB as i64);
                        let packed = f.muli(i, rbc);
                        let packed = f.addi(packed, local);
                        let packed = f.trunci(packed, Elem::I32);
                        f.if_then(flag, |f| st(f, packed, sh.list, at));
                        vec![f.addi(run[0], tot)]
                    });
                    f.barrier();
                    // Stable counting sort by row: thread t owns row ga + t.
                    let t32 = tid;
                    let nrows = f.subi(gb, ga);
                    let mine = f.cmpi(ICmp::Slt, t32, nrows);
                    let my_row = f.addi(ga, t32);
                    let tot64 = f.extsi(total, Elem::I64);
                    let rmask = f.i32c(RB as i64 - 1);
                    let count = f.for_loop(z64, tot64, one64, &[zero], |f, e, cnt| {
                        let pk = ld(f, sh.list, e);
                        let lr = f.andi(pk, rmask);
                        let hit = f.cmpi(ICmp::Eq, lr, my_row);
                        let hit = f.andi(hit, mine);
                        let inc = f.extui(hit, Elem::I32);
                        vec![f.addi(cnt[0], inc)]
                    });
                    let (excl, _) = block_scan(f, count[0], tid, sh.warps);
                    f.if_then(mine, |f| st(f, excl, sh.start2, t32));
                    f.if_then(is_t0, |f| st(f, total, sh.start2, nrows));
                    let sh_rb = f.i32c(RB.trailing_zeros() as i64);
                    f.for_loop(z64, tot64, one64, &[excl], |f, e, at| {
                        let pk = ld(f, sh.list, e);
                        let lr = f.andi(pk, rmask);
                        let hit = f.cmpi(ICmp::Eq, lr, my_row);
                        let hit = f.andi(hit, mine);
                        let i = f.shrui(pk, sh_rb);
                        f.if_then(hit, |f| st(f, i, sh.sorted, at[0]));
                        let inc = f.extui(hit, Elem::I32);
                        vec![f.addi(at[0], inc)]
                    });
                    f.barrier();
                });
                let has64 = has;
                f.for_loop(ga64, gb64, one64, &[], |f, row, _| {
                    let lr = f.subi(row, ga64);
                    let lr1 = f.addi(lr, one64);
                    let es = ld(f, sh.start2, lr);
                    let ee = ld(f, sh.start2, lr1);
                    let es = f.select(has64, es, zero);
                    let ee = f.select(has64, ee, zero);
                    let es = f.extsi(es, Elem::I64);
                    let ee = f.extsi(ee, Elem::I64);
                    let acc = f.for_loop(es, ee, one64, &inits, |f, e, acc| {
                        let j = ld(f, sh.sorted, e);
                        let j = f.extsi(j, Elem::I64);
                        add_row(f, j, acc)
                    });
                    store_row(f, row, &acc);
                    vec![]
                });
                f.barrier();
                vec![]
            },
        );
        vec![]
    });
    Ok(Generated::new(f.finish(entry, THREADS as u32, grid as u32), THREADS as u32, grid as u32, 0))
}
