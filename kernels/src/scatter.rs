//! `scatter_add` kernels: `out[idx[i]] += src[i]` into a table that starts at zero, computed
//! owner-side so it is deterministic and needs neither atomics on the data nor a workspace.
//!
//! The table is cut into blocks of 256 consecutive rows, each with [`split`] CTAs, and every
//! row is written by exactly one CTA (zero rows included):
//! 1. each CTA counts the indices falling in its block's rows (one pass over `idx`,
//!    shared-memory atomics on counters only, whose totals do not depend on order);
//! 2. if the block has at most [`SPLIT_MIN`] matches its first CTA owns all its rows and the
//!    others stop; with more (the rows of frequent tokens: real text's low ids, every byte of a
//!    byte-level corpus) CTA `s` owns the rows `s`, `s + split`, ... of the block, so its work
//!    is spread over `split` SMs and consecutive hot ids over different CTAs. Every CTA of a
//!    block counts the same total, so they agree without talking;
//! 3. thread 0 cuts the owned rows into groups of at most 4096 matches (a row with more is a
//!    group of its own);
//! 4. per group, a block-wide ordered compaction lists the matching `i` in increasing order, a
//!    stable counting sort (one thread per row) orders them by row, and each row's sources are
//!    summed in f32 in increasing `i` (the loads of several rows issued before their adds) and
//!    stored once, rounded to the output dtype;
//! 5. a row with more than 4096 matches is summed chunk by chunk of `idx` instead.
//!
//! Sums run in the reference interpreter's order (increasing `i`) whichever CTA owns the row,
//! so results are bitwise those of the interpreter and identical run to run. Indices outside
//! `[0, rows)` are ignored (the interpreter reports them as errors).
//!
//! A body `[scatter_add, add(x, table)]` (fusion rule 12: the tied embedding's gradient) scatters
//! into `x` instead of into zeros: a hit row is summed and rounded as the table's row would
//! be, then added to `x`'s row and rounded again, the body's values bit for bit; a row no
//! index hits is `x + 0`. When the output is `x`'s own buffer (the memory plan writes the sum
//! in place, checked at run time by comparing the pointers), rows no index hits are not
//! touched at all: they keep `x`'s bits (the same value; a -0 stays -0).
//!
//! `scatter_add_shard(idx, src, shard)` writes row shard `k` of the table (`k` from the one-hot
//! `shard`, [`crate::gather::shard_index`]): every index is shifted by `k rows` when read, so
//! the indices of other shards fall outside `[0, rows)` and are ignored, which is the op's
//! meaning.

use titan_ir::{BinaryOp, Graph, Op, Region, Value};

use crate::emit::{Elem, Func, ICmp, Ty, Val};
use crate::values::{Body, narrow, storage, vec_align, widen};
use crate::{GenResult, Generated, invalid, unsupported};

const THREADS: u64 = 256;
/// Output rows per block (one per thread in the sort and in [`own_rows`]'s total).
const RB: u64 = THREADS;
/// CTAs per block of rows by default.
const SPLIT: u64 = 8;
/// Matches in a block above which its rows are spread over its [`split`] CTAs. Below, one CTA
/// sums them faster than the others would list them again (each CTA's listing reads all of
/// `idx`); above, one CTA streaming every source row alone (one SM's loads in flight, ~25 GB/s)
/// is the kernel's tail: all 8,192 sources of a byte-level batch took 1.7 ms at 1B's rows.
const SPLIT_MIN: i64 = 256;
/// Indices each thread loads before counting them.
const COUNT_AHEAD: u64 = 4;

/// CTAs per block of rows: [`SPLIT`], or the build-time switch `TITAN_SCATTER_SPLIT` (a power
/// of two from 1 to 64; anything else is refused by being ignored: the default), for
/// comparisons: `1` is the kernel before the split, one CTA per block.
fn split() -> u64 {
    crate::switches::var(crate::switches::Switch::ScatterSplit).and_then(|v| v.parse::<u64>().ok()).filter(|v| v.is_power_of_two() && *v <= 64).unwrap_or(SPLIT)
}
/// Matches a group lists in shared memory.
const CAP: u64 = 4096;
/// Column chunks a thread accumulates in registers.
const MAX_COL_CHUNKS: u64 = 8;
/// 16-byte source loads a thread keeps in flight while summing rows (rows ahead = this over
/// its column chunks).
const LOADS_AHEAD: usize = 8;

#[derive(Clone, Copy)]
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
    let s = check_body(&b, r)?;
    let na = r.args.len();
    let mut f = Func::new(na + 1);
    f.min_ctas_per_sm(4);
    let c = prologue(&mut f, &b, &s, na)?;
    count_matches(&mut f, &s, &c);
    let own = own_rows(&mut f, &s, &c);
    f.if_then(own.active, |f| {
        let cap = f.i32c(CAP as i64);
        cut_groups(f, &c, &own, cap);
        sum_groups(f, &b, &s, &c, &own, cap);
    });
    Ok(Generated::new(f.finish(entry, THREADS as u32, s.grid as u32), THREADS as u32, s.grid as u32, 0))
}

/// What a scatter_add body scatters: its operands, the table's geometry and the vector width.
struct Scatter {
    /// The one-hot shard argument of a `scatter_add_shard`.
    shard: Option<Value>,
    /// Argument positions of the indices and the sources.
    ii: usize,
    si: usize,
    src: Value,
    out: Value,
    /// Table rows, elements per row, indices.
    rows: u64,
    d: u64,
    n: u64,
    /// The tensor the table is added to (argument index), for a body with the add.
    x: Option<usize>,
    /// Storage of the sources (and table) and of the indices.
    ste: Elem,
    it: Elem,
    /// Lanes per vector, vectors per row, column chunks per thread, CTAs per block of rows,
    /// CTAs.
    lanes: u32,
    nvec: u64,
    cpt: u64,
    split: u64,
    grid: u64,
}

/// Check that `r` is one scatter_add the generator handles, and size the kernel.
fn check_body(b: &Body, r: &Region) -> GenResult<Scatter> {
    let nodes: Vec<_> = b.nodes().collect();
    let (node, add) = match nodes.as_slice() {
        [node] => (*node, None),
        [node, add] if matches!(add.op, Op::Binary(BinaryOp::Add)) => (*node, Some(*add)),
        _ => return unsupported(format!("a scatter_add body must hold one scatter_add node, or one and its add, found {} nodes", nodes.len())),
    };
    if !matches!(node.op, Op::ScatterAdd | Op::ScatterAddShard) {
        return invalid(format!("a scatter_add body holds `{}`", node.op.name()));
    }
    let shard = matches!(node.op, Op::ScatterAddShard).then(|| node.inputs[2]);
    let (idx, src) = (node.inputs[0], node.inputs[1]);
    let table = node.results[0];
    let (out, x) = match add {
        None => (table, None),
        Some(a) => {
            let x = match a.inputs.as_slice() {
                [p, q] if *p == table && *q != table => *q,
                [p, q] if *q == table && *p != table => *p,
                _ => return invalid("a scatter_add body's add must add the table to another tensor"),
            };
            let Some(xi) = b.arg_index(x) else {
                return invalid("the tensor a scatter_add body adds its table to must be a body argument");
            };
            if b.dtype(x) != b.dtype(table) || b.shape[x.index()] != b.shape[table.index()] || b.dtype(a.results[0]) != b.dtype(table) {
                return invalid("a scatter_add body's add must take and give the table's type");
            }
            (a.results[0], Some(xi))
        }
    };
    let [o] = r.outputs.as_slice() else {
        return invalid("a scatter_add body must have exactly one output");
    };
    if o.value != out {
        return invalid("the scatter_add body's output must be the table (or its sum with the added tensor)");
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
    let split = split();
    let grid = rows.div_ceil(RB) * split;
    if grid > i32::MAX as u64 {
        return unsupported("scatter_add table too large");
    }
    Ok(Scatter { shard, ii, si, src, out, rows, d, n, x, ste, it, lanes, nvec, cpt, split, grid })
}

/// The values every phase of the kernel uses, emitted once at its top.
struct Ctx {
    /// Pointers: indices, sources, table.
    ip: Val,
    sp: Val,
    op: Val,
    /// The tensor added to (a body with the add), and whether the table is a buffer apart from
    /// it (the pointers differ; where they are equal, rows no index hits are left as they are).
    xp: Option<(Val, Val)>,
    sh: Shared,
    /// The first row of the table's shard in the index space (`None`: a whole table).
    shard_base: Option<Val>,
    tid: Val,
    tid64: Val,
    /// This CTA's place among its block's `split`, and `split` (i64).
    part: Val,
    split: Val,
    /// Rows per block, the block's first row and its number of rows (i64).
    rb: Val,
    r0: Val,
    rb_eff: Val,
    z64: Val,
    one64: Val,
    tstep: Val,
    nn: Val,
    zero: Val,
    one: Val,
    is_t0: Val,
}

/// Emit the parameters, the shared arrays and the values every phase uses.
fn prologue(f: &mut Func, b: &Body, s: &Scatter, na: usize) -> GenResult<Ctx> {
    let (ip, sp, op) = (f.param(s.ii), f.param(s.si), f.param(na));
    let xp = s.x.map(|xi| {
        let xp = f.param(xi);
        let a = f.ptr_to_i64(xp);
        let o = f.ptr_to_i64(op);
        (xp, f.cmpi(ICmp::Ne, a, o))
    });
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
    let shard_base = match s.shard {
        Some(sv) => {
            let k = crate::gather::shard_index(f, b, sv)?;
            let nr = f.i64c(s.rows as i64);
            Some(f.muli(k, nr))
        }
        None => None,
    };
    let tid = f.thread_id();
    let bid = f.block_id();
    let tid64 = f.extui(tid, Elem::I64);
    let bid64 = f.extui(bid, Elem::I64);
    // The first CTAs of all blocks come first, so every block's writer is resident in the
    // first wave; then, block by block, the others, which stop after counting unless their
    // block is hot (with the parts interleaved, seven in eight CTAs of each wave only counted,
    // and the writers of the last blocks started late: uniform ids took 9% longer).
    let split = f.i64c(s.split as i64);
    let nb = f.i64c((s.grid / s.split) as i64);
    let lead = f.cmpi(ICmp::Slt, bid64, nb);
    let k = f.subi(bid64, nb);
    let others = f.i64c(s.split.saturating_sub(1).max(1) as i64);
    let kb = f.divui(k, others);
    let block = f.select(lead, bid64, kb);
    let kp = f.remui(k, others);
    let p1 = f.i64c(1);
    let kp = f.addi(kp, p1);
    let p0 = f.i64c(0);
    let part = f.select(lead, p0, kp);
    let rb = f.i64c(RB as i64);
    let r0 = f.muli(block, rb);
    let vrows = f.i64c(s.rows as i64);
    let left = f.subi(vrows, r0);
    let rb_eff = f.minsi(left, rb);
    let z64 = f.i64c(0);
    let one64 = f.i64c(1);
    let tstep = f.i64c(THREADS as i64);
    let nn = f.i64c(s.n as i64);
    let zero = f.i32c(0);
    let one = f.i32c(1);
    let is_t0 = f.cmpi(ICmp::Eq, tid, zero);
    Ok(Ctx { ip, sp, op, xp, sh, shard_base, tid, tid64, part, split, rb, r0, rb_eff, z64, one64, tstep, nn, zero, one, is_t0 })
}

/// Which rows of its block a CTA owns: local rows `start + j step`, `j` in `[0, nj)` (i64,
/// `step = 1 << sh`), if `active`. In the phases after [`own_rows`] a CTA's rows are numbered
/// by `j`.
struct Own {
    active: Val,
    step: Val,
    start: Val,
    sh: Val,
    nj: Val,
}

impl Own {
    /// The table row (local to the table or its shard) of owned row `j` (i64).
    fn row(&self, f: &mut Func, c: &Ctx, j: Val) -> Val {
        let at = f.shli(j, self.sh);
        let at = f.addi(at, self.start);
        f.addi(c.r0, at)
    }
}

/// Step 2: the CTA adds the block's counts and decides whether its rows are spread over the
/// block's CTAs (the same decision in each, from the same counts); each CTA then moves the
/// counts of its own rows to the front of `cnt`, numbered by `j`.
fn own_rows(f: &mut Func, s: &Scatter, c: &Ctx) -> Own {
    // The block's total, one row's count a thread (`RB == THREADS`), every thread getting it.
    let sh = c.sh;
    let n = ld(f, sh.cnt, c.tid64);
    let in_block = f.cmpi(ICmp::Slt, c.tid64, c.rb_eff);
    let n = f.select(in_block, n, c.zero);
    let (_, total) = block_scan(f, n, c.tid, sh.warps);
    let min = f.i32c(SPLIT_MIN);
    let spread = f.cmpi(ICmp::Sgt, total, min);
    let first = f.cmpi(ICmp::Eq, c.part, c.z64);
    let active = f.ori(spread, first);
    let step = f.select(spread, c.split, c.one64);
    let start = f.select(spread, c.part, c.z64);
    let log = f.i64c(s.split.trailing_zeros() as i64);
    let shift = f.select(spread, log, c.z64);
    // nj = ceil((rows - start) / step), 0 where the block's last rows end before `start`.
    let left = f.subi(c.rb_eff, start);
    let left = f.maxsi(left, c.z64);
    let up = f.subi(step, c.one64);
    let left = f.addi(left, up);
    let nj = f.shrui(left, shift);
    let mine = f.cmpi(ICmp::Slt, c.tid64, nj);
    let from = f.shli(c.tid64, shift);
    let from = f.addi(from, start);
    let last = f.i64c(RB as i64 - 1);
    let from = f.minsi(from, last);
    let n = ld(f, sh.cnt, from);
    f.barrier();
    f.if_then(mine, |f| st(f, n, sh.cnt, c.tid64));
    f.barrier();
    Own { active, step, start, sh: shift, nj }
}

/// Step 1: count the indices falling in each owned row (shared-memory atomics on counters).
fn count_matches(f: &mut Func, s: &Scatter, c: &Ctx) {
    let (sh, zero, one, it) = (c.sh, c.zero, c.one, s.it);
    f.for_loop(c.tid64, c.rb, c.tstep, &[], |f, rr, _| {
        st(f, zero, sh.cnt, rr);
        vec![]
    });
    f.barrier();
    let count = |f: &mut Func, id: Val| {
        let id = f.as_i64(id);
        let id = match c.shard_base {
            Some(sb) => f.subi(id, sb),
            None => id,
        };
        let local = f.subi(id, c.r0);
        let ge = f.cmpi(ICmp::Sge, local, c.z64);
        let lt = f.cmpi(ICmp::Slt, local, c.rb_eff);
        let mine = f.andi(ge, lt);
        f.if_then(mine, |f| {
            let p = f.gep(sh.cnt, local, Elem::I32);
            f.atomic_add_i32(p, one);
        });
    };
    // Every CTA reads all of `idx`: `COUNT_AHEAD` loads a thread in flight, then the rest one
    // at a time.
    let wide = COUNT_AHEAD * THREADS;
    let whole = f.i64c((s.n / wide * wide) as i64);
    let wstep = f.i64c(wide as i64);
    f.for_loop(c.tid64, whole, wstep, &[], |f, i, _| {
        let ids: Vec<Val> = (0..COUNT_AHEAD)
            .map(|k| {
                let off = f.i64c((k * THREADS) as i64);
                let at = f.addi(i, off);
                f.load_at(c.ip, at, Ty::S(it), it.bytes())
            })
            .collect();
        for id in ids {
            count(f, id);
        }
        vec![]
    });
    let rest = f.addi(whole, c.tid64);
    f.for_loop(rest, c.nn, c.tstep, &[], |f, i, _| {
        let id = f.load_at(c.ip, i, Ty::S(it), it.bytes());
        count(f, id);
        vec![]
    });
    f.barrier();
}

/// Step 3: thread 0 cuts the owned rows, in order, into groups of at most `cap` matches (a row
/// with more is a group of its own): group starts (owned rows `j`) in `gstart`, match counts in
/// `gsum`, the number of groups in `misc[0]`.
fn cut_groups(f: &mut Func, c: &Ctx, own: &Own, cap: Val) {
    let (sh, zero, one) = (c.sh, c.zero, c.one);
    f.if_then(c.is_t0, |f| {
        let out = f.for_loop(c.z64, own.nj, c.one64, &[zero, zero, zero], |f, rr, s| {
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
        let e32 = f.trunci(own.nj, Elem::I32);
        st(f, e32, sh.gstart, ng1);
        st(f, ng1, sh.misc, zero);
    });
    f.barrier();
}

/// This thread's column chunks of a table row and how rows are read and stored through them.
struct Columns {
    /// Per chunk: the (clamped) first column and whether the chunk is inside the row.
    cols: Vec<(Val, Option<Val>)>,
    /// Elements per row (i64).
    dd: Val,
    vt: Ty,
    align_src: u32,
    align_out: u32,
    ste: Elem,
}

impl Columns {
    /// Add source row `i` (i64) into the accumulators.
    fn add_row(&self, f: &mut Func, c: &Ctx, i: Val, acc: &[Val]) -> Vec<Val> {
        let row = self.load_row(f, c, i);
        Self::add_loaded(f, acc, row)
    }

    /// `acc + row`, chunk by chunk, the loaded chunks widened to f32.
    fn add_loaded(f: &mut Func, acc: &[Val], row: Vec<Val>) -> Vec<Val> {
        acc.iter()
            .zip(row)
            .map(|(&a, x)| {
                let x = widen(f, x);
                f.addf(a, x)
            })
            .collect()
    }

    /// Sum source rows `list[e]`, `e` in `[es, ee)` (i64), into the accumulators in increasing
    /// `e`. The loads of `ahead` rows are issued before their adds, so that many row loads are in
    /// flight instead of one (a CTA summing thousands of source rows, as the one owning the most
    /// frequent tokens does, was bound by one load's latency per row); the adds are the same in
    /// the same order, so the sum is bitwise the one-row-at-a-time sum.
    fn add_listed(&self, f: &mut Func, c: &Ctx, list: Val, es: Val, ee: Val, acc: &[Val]) -> Vec<Val> {
        let ahead = (LOADS_AHEAD / self.cols.len()).max(1) as i64;
        let n = f.subi(ee, es);
        let step = f.i64c(ahead);
        let whole = f.divui(n, step);
        let whole = f.muli(whole, step);
        let mid = f.addi(es, whole);
        let acc = f.for_loop(es, mid, step, acc, |f, e, acc| {
            let rows: Vec<Vec<Val>> = (0..ahead)
                .map(|k| {
                    let ek = f.i64c(k);
                    let ek = f.addi(e, ek);
                    let j = ld(f, list, ek);
                    let j = f.extsi(j, Elem::I64);
                    self.load_row(f, c, j)
                })
                .collect();
            rows.into_iter().fold(acc.to_vec(), |acc, row| Self::add_loaded(f, &acc, row))
        });
        f.for_loop(mid, ee, c.one64, &acc, |f, e, acc| {
            let j = ld(f, list, e);
            let j = f.extsi(j, Elem::I64);
            self.add_row(f, c, j, acc)
        })
    }

    /// This thread's chunks of source row `i` (i64), as stored.
    fn load_row(&self, f: &mut Func, c: &Ctx, i: Val) -> Vec<Val> {
        let base = f.muli(i, self.dd);
        self.cols
            .iter()
            .map(|&(col, _)| {
                let at = f.addi(base, col);
                f.load_at(c.sp, at, self.vt, self.align_src)
            })
            .collect()
    }

    /// Store the accumulators as table row `gr` (i64), rounded to the table's dtype and, with the
    /// add, added to the row of the tensor added to and rounded again.
    fn store_row(&self, f: &mut Func, c: &Ctx, gr: Val, acc: &[Val]) {
        let base = f.muli(gr, self.dd);
        for (&(col, valid), &a) in self.cols.iter().zip(acc) {
            let at = f.addi(base, col);
            let mut y = narrow(f, a, self.ste);
            if let Some((xp, _)) = c.xp {
                let x = f.load_at(xp, at, self.vt, self.align_out);
                let x = widen(f, x);
                let t = widen(f, y);
                let sum = f.addf(x, t);
                y = narrow(f, sum, self.ste);
            }
            match valid {
                Some(ok) => f.if_then(ok, |f| f.store_at(y, c.op, at, self.align_out)),
                None => f.store_at(y, c.op, at, self.align_out),
            }
        }
    }
}

/// Step 4: each group's rows summed in f32 in increasing `i` and stored once: a row with more
/// than `cap` matches chunk by chunk of `idx` ([`sum_big_row`]), the others listed, sorted by
/// row and summed ([`sum_group`]).
fn sum_groups(f: &mut Func, b: &Body, s: &Scatter, c: &Ctx, own: &Own, cap: Val) {
    let (sh, z64, one64, zero) = (c.sh, c.z64, c.one64, c.zero);
    let ng = ld(f, sh.misc, zero);
    let ng = f.extsi(ng, Elem::I64);
    let dd = f.i64c(s.d as i64);
    let lanes64 = f.i64c(i64::from(s.lanes));
    let vt = Ty::lanes_of(s.ste, s.lanes);
    let acc_t = Ty::lanes_of(Elem::F32, s.lanes);
    let align_src = vec_align(s.ste, s.lanes, b.numel(s.src));
    let align_out = vec_align(s.ste, s.lanes, b.numel(s.out));
    // This thread's column chunks: (clamped column, valid).
    let mut cols: Vec<(Val, Option<Val>)> = Vec::new();
    for k in 0..s.cpt {
        let base = f.i64c((k * THREADS) as i64);
        let w = f.addi(base, c.tid64);
        let valid = if (k + 1) * THREADS > s.nvec {
            let nv = f.i64c(s.nvec as i64);
            Some(f.cmpi(ICmp::Slt, w, nv))
        } else {
            None
        };
        let last = f.i64c(s.nvec as i64 - 1);
        let w = f.minsi(w, last);
        cols.push((f.muli(w, lanes64), valid));
    }
    let zero_acc = f.cf(0.0, acc_t);
    let inits: Vec<Val> = vec![zero_acc; cols.len()];
    let cl = Columns { cols, dd, vt, align_src, align_out, ste: s.ste };
    let chunks = f.i64c(s.n.div_ceil(THREADS) as i64);
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
                sum_big_row(f, s, c, own, &cl, &inits, chunks, ga64);
                vec![]
            },
            |f| {
                sum_group(f, s, c, own, &cl, &inits, chunks, [ga, gb, total], [ga64, gb64]);
                vec![]
            },
        );
        vec![]
    });
}

/// One row (owned row `ga64`) with more than CAP matches: compact and sum chunk by chunk of `idx`.
#[allow(clippy::too_many_arguments)]
fn sum_big_row(f: &mut Func, s: &Scatter, c: &Ctx, own: &Own, cl: &Columns, inits: &[Val], chunks: Val, ga64: Val) {
    let (sh, z64, one64, it) = (c.sh, c.z64, c.one64, s.it);
    let target = own.row(f, c, ga64);
    let acc = f.for_loop(z64, chunks, one64, inits, |f, ch, acc| {
        let base = f.muli(ch, c.tstep);
        let i = f.addi(base, c.tid64);
        let inside = f.cmpi(ICmp::Slt, i, c.nn);
        let last = f.i64c(s.n as i64 - 1);
        let ic = f.minsi(i, last);
        let id = f.load_at(c.ip, ic, Ty::S(it), it.bytes());
        let id = f.as_i64(id);
        let id = match c.shard_base {
            Some(sb) => f.subi(id, sb),
            None => id,
        };
        let eq = f.cmpi(ICmp::Eq, id, target);
        let flag = f.andi(inside, eq);
        let fl = f.extui(flag, Elem::I32);
        let (excl, tot) = block_scan(f, fl, c.tid, sh.warps);
        let i32v = f.trunci(i, Elem::I32);
        f.if_then(flag, |f| st(f, i32v, sh.list, excl));
        f.barrier();
        let tot64 = f.extsi(tot, Elem::I64);
        let acc2 = cl.add_listed(f, c, sh.list, z64, tot64, acc);
        f.barrier();
        acc2
    });
    cl.store_row(f, c, target, &acc);
}

/// A group of owned rows `[ga, gb)` with `total` matches: list them in increasing `i`, sort them
/// by row (stable counting sort, thread `t` owning row `ga + t`) and sum each row.
#[allow(clippy::too_many_arguments)]
fn sum_group(f: &mut Func, s: &Scatter, c: &Ctx, own: &Own, cl: &Columns, inits: &[Val], chunks: Val, [ga, gb, total]: [Val; 3], [ga64, gb64]: [Val; 2]) {
    let (sh, z64, one64, zero, tid, it) = (c.sh, c.z64, c.one64, c.zero, c.tid, s.it);
    let has = f.cmpi(ICmp::Sgt, total, zero);
    f.if_then(has, |f| {
        f.for_loop(z64, chunks, one64, &[zero], |f, ch, run| {
            let base = f.muli(ch, c.tstep);
            let i = f.addi(base, c.tid64);
            let inside = f.cmpi(ICmp::Slt, i, c.nn);
            let last = f.i64c(s.n as i64 - 1);
            let ic = f.minsi(i, last);
            let id = f.load_at(c.ip, ic, Ty::S(it), it.bytes());
            let id = f.as_i64(id);
            let id = match c.shard_base {
                Some(sb) => f.subi(id, sb),
                None => id,
            };
            // The owned row `j` the index falls on, if any: `rel = j step` with `rel >= 0`.
            let local = f.subi(id, c.r0);
            let rel = f.subi(local, own.start);
            let nonneg = f.cmpi(ICmp::Sge, rel, z64);
            let low = f.subi(own.step, one64);
            let off = f.andi(rel, low);
            let aligned = f.cmpi(ICmp::Eq, off, z64);
            let local = f.shrui(rel, own.sh);
            let ge = f.cmpi(ICmp::Sge, local, ga64);
            let lt = f.cmpi(ICmp::Slt, local, gb64);
            let m = f.andi(ge, lt);
            let m = f.andi(m, nonneg);
            let m = f.andi(m, aligned);
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
        f.if_then(c.is_t0, |f| st(f, total, sh.start2, nrows));
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
        let acc = cl.add_listed(f, c, sh.sorted, es, ee, inits);
        let gr = own.row(f, c, row);
        match c.xp {
            // Written over the tensor added to: a row no index hits stays as it is.
            Some((_, apart)) => {
                let hit = f.cmpi(ICmp::Ne, es, ee);
                let store = f.ori(hit, apart);
                f.if_then(store, |f| cl.store_row(f, c, gr, &acc));
            }
            None => cl.store_row(f, c, gr, &acc),
        }
        vec![]
    });
    f.barrier();
}
