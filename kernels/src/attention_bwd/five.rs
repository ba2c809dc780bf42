//! The five-product attention backward (FA2's arithmetic in the structure cuDNN's and FA3's
//! backward kernels share): one pass over (key tile, query tile) pairs computes dK, dV *and* dQ's
//! partial sums, so `S` and `dP` are computed once instead of twice (five GEMM-sized products
//! instead of the seven-product default's). Head_dim 64 or 128, sequence a multiple of 128, opt-in
//! at build time with `TITAN_ATT_BWD_5P=1` while it is measured (docs/notes.md, Kernels).
//!
//! Three launches of one module, with the same arguments:
//! - **prep** (`<entry>_prep`, the prologue): one CTA of 4 warps per 64-query tile of one (batch,
//!   query head) writes the rows' `D = rowsum(dO o O)` and `lse log2 e` to the workspace (as the
//!   seven-product dQ pass does) and zeroes the tile's f32 dQ accumulator.
//! - **dK/dV/dQ** (`<entry>`): the warp-specialized dK/dV pass ([`super::dkdv_ws_body`]'s
//!   structure, 2 stages of [`super::ws_rows`] query rows: 64 at head_dim 128, 128 at 64):
//!   warpgroups 0 and 1 own 64 keys each; per (Q, dO) stage each writes its `dS^T` (bf16, 64 keys
//!   x the stage's queries) into a shared tile, the two meet at a named barrier, and each
//!   computes a 64 x 64 block of the partial `dQ = dS K` over all 128 keys (`wgmma`, dS MN-major
//!   as A, K MN-major as B): at head_dim 128 the stage's 64 queries and dims `64 w ..`, at 64 the
//!   queries `64 w ..` and all 64 dims. Each writes its block (f32) into a 32 KB staging tile
//!   (the stage's queries x d); the copying warpgroup's thread 0 sends each staged tile to the
//!   accumulator with one `cp.reduce.async.bulk .add.f32` (the L2 adds it), so no computing warp
//!   issues or waits for a reduction. Double-buffered dS and staging tiles; a staging tile is
//!   written again only after its send has read it (`sfree` mbarriers).
//! - **convert** (`<entry>_dqcvt`, the epilogue): the accumulator, scaled, to bf16 dQ.
//!
//! Not deterministic: the L2 adds each query tile's 32-64 partials in arrival order, so dQ can
//! differ in its last bits between runs (dK and dV are computed as in the seven-product pass).
//! The accumulator is `b hq s d` f32 in the workspace after the statistics, row-major per (batch,
//! query head) in the staging tile's layout: row `r` (query), 16-byte chunk `c` (4 dims) at
//! chunk `c ^ (2 r % 8)` of the row (conflict-free float2 writes from the `wgmma` fragments).

use super::*;

/// (Q, dO) stages in flight, of `ws_rows(d)` query rows each: 64 at head_dim 128, 128 at 64, so
/// a dQ partial is always 32 KB and each consumer's `dQ` block 64 x 64.
const STAGES: i64 = 2;

/// Whether the five-product pass is built for `p`.
pub(super) fn enabled(p: &Problem) -> bool {
    matches!(p.d, 64 | 128) && p.s % WS_KEYS == 0 && std::env::var("TITAN_ATT_BWD_5P").as_deref() == Ok("1")
}

/// Shared-memory layout, in bytes: K and V (128 keys), the stages, two dS^T tiles (128 keys x
/// the stage's queries, bf16, in 64-query blocks), two staging tiles (the stage's queries x d,
/// f32), then the barriers (full, empty, sfree: two each). 231,472 bytes at both head dims.
struct Layout {
    ds0: i64,
    stg0: i64,
    bar0: i64,
    bytes: i64,
}

fn layout(d: i64) -> Layout {
    let stage0 = 2 * WS_KEYS * d;
    let se = stage_elems_rows(d, ws_rows(d));
    let ds0 = 2 * (stage0 + STAGES * se);
    let stg0 = ds0 + 2 * ds_bytes(d);
    let bar0 = stg0 + 2 * stg_bytes(d);
    Layout { ds0, stg0, bar0, bytes: bar0 + 3 * 8 * STAGES }
}

fn ds_bytes(d: i64) -> i64 {
    WS_KEYS * ws_rows(d) * 2
}

fn stg_bytes(d: i64) -> i64 {
    ws_rows(d) * d * 4
}

pub(super) fn smem_bytes(d: i64) -> i64 {
    layout(d).bytes
}

/// f32 element offset (i64) of query row `q0` (a multiple of 4) of `(batch, query head)` index
/// `bh` in the workspace's accumulator (after `2 b hq s` f32 of statistics).
fn acc_at(e: &mut Em, p: &Problem, bh: &str, q0: &str) -> String {
    let x = e.mulk(bh, p.s);
    let x = e.addi(&x, q0);
    let x64 = e.ext64(&x);
    let row = e.i64c(p.d);
    let o = e.bin("muli", &x64, &row, "i64");
    let base = e.i64c(2 * p.b * p.hq * p.s);
    e.bin("addi", &o, &base, "i64")
}

/// f32 element offset (i32) within a staging or accumulator tile of the 16-byte chunk holding
/// column `col` (a multiple of 4 plus `sub`, i32) of row `row`.
fn stg_off(e: &mut Em, d: i64, row: &str, chunk: &str, sub: &str) -> String {
    let r4 = e.remk(row, 4);
    let x = e.mulk(&r4, 2);
    let sw = e.op(&format!("arith.xori {chunk}, {x} : i32"));
    let ro = e.mulk(row, d);
    let co = e.mulk(&sw, 4);
    let o = e.addi(&ro, &co);
    e.addi(&o, sub)
}

/// The prologue: statistics of 64 query rows and their accumulator rows zeroed.
pub(super) fn prep_body(p: &Problem, io: &Io) -> String {
    let mut e = Em::new();
    let bh = p.b * p.hq;
    let id = ids(&mut e);
    let t = e.divk(&id.bid, bh);
    let bhi = e.remk(&id.bid, bh);
    let row_base = e.mulk(&t, BM);
    // The statistics (Q and dO fragments, unused here, are dropped by LLVM).
    let _ = dq_rows(&mut e, p, io, &id.warp, &id.g, &id.tq, &row_base, &bhi);
    let base = acc_at(&mut e, p, &bhi, &row_base);
    let t4 = e.mulk(&id.tid, 4);
    let t464 = e.ext64(&t4);
    let at = e.bin("addi", &base, &t464, "i64");
    let ptr = e.gep(&io.ws, 1, &at, "i64", "f32");
    let z = e.op("arith.constant dense<0.0> : vector<4xf32>");
    for it in 0..BM * p.d / 4 / THREADS {
        let c = e.i64c(it * 4 * THREADS);
        let pi = e.gep(&ptr, 1, &c, "i64", "f32");
        e.line(&format!("llvm.store {z}, {pi} {{alignment = 16 : i64}} : vector<4xf32>, !llvm.ptr<1>"));
    }
    e.body
}

/// The epilogue: one CTA per 64-query tile; warp `w` converts rows `16 w ..`, `32 / (d / 4)` rows
/// at a time, lane `l` the dims `4 (l % (d / 4)) ..` of its row (whole rows read and written
/// contiguously).
pub(super) fn convert_body(p: &Problem, io: &Io) -> String {
    let mut e = Em::new();
    let d = p.d;
    let bh = p.b * p.hq;
    let id = ids(&mut e);
    let t = e.divk(&id.bid, bh);
    let bhi = e.remk(&id.bid, bh);
    let (q_base, _) = head_bases(&mut e, p, &bhi);
    let t64 = e.mulk(&t, BM);
    let base = acc_at(&mut e, p, &bhi, &t64);
    let scale = e.f32c(p.scale as f32);
    let zero = e.i32c(0);
    // 16-byte chunks of a row, rows a warp converts at a time.
    let cpr = d / 4;
    let per = 32 / cpr;
    let chunk = e.remk(&id.lane, cpr);
    let lrow = e.divk(&id.lane, cpr);
    let col = e.mulk(&chunk, 4);
    let col64 = e.ext64(&col);
    for i in 0..16 / per {
        let w16 = e.mulk(&id.warp, 16);
        let row = e.addk(&w16, i * per);
        let row = e.addi(&row, &lrow);
        let o = stg_off(&mut e, d, &row, &chunk, &zero);
        let o64 = e.ext64(&o);
        let at = e.bin("addi", &base, &o64, "i64");
        let src = e.gep(&io.ws, 1, &at, "i64", "f32");
        let v = e.op(&format!("llvm.load {src} {{alignment = 16 : i64}} : !llvm.ptr<1> -> vector<4xf32>"));
        let x: Vec<String> = (0..4)
            .map(|k| {
                let xk = e.op(&format!("vector.extract {v}[{k}] : f32 from vector<4xf32>"));
                e.fmul(&xk, &scale)
            })
            .collect();
        let lo = e.pack_bf16(&x[0], &x[1]);
        let hi = e.pack_bf16(&x[2], &x[3]);
        let pk = e.op(&format!("vector.from_elements {lo}, {hi} : vector<2xi32>"));
        let grow = e.addi(&t64, &row);
        let go = e.row_offset(&grow, p.hq * d, &col64, &q_base);
        let dst = e.gep(&io.dq, 1, &go, "i64", "bf16");
        e.line(&format!("llvm.store {pk}, {dst} {{alignment = 8 : i64}} : vector<2xi32>, !llvm.ptr<1>"));
    }
    e.body
}

/// The dK/dV/dQ pass.
pub(super) fn body(p: &Problem, io: &Io) -> String {
    let mut e = Em::new();
    let d = p.d;
    let bm = ws_rows(d);
    let l = layout(d);
    let id = ids(&mut e);
    let tid = id.tid.clone();
    let seq = QuerySeq::new(&mut e, p, &id.bid, bm);
    let smem = seq.smem.clone();
    let smem32 = e.smem_addr32(&smem);
    // sfree[b]: one arrival (the sender) once staging tile b's send has read it.
    let sfree0 = e.addk(&smem32, l.bar0 + 16 * STAGES);
    let zero_i = e.i32c(0);
    let first = e.op(&format!("arith.cmpi eq, {tid}, {zero_i} : i32"));
    if_then(&mut e, &first, |e| {
        for b in 0..2 {
            let bar = e.addk(&sfree0, 8 * b);
            e.mbar_init(&bar, 1);
        }
    });
    let ring = Ring::new(&mut e, &smem, l.bar0, STAGES, &tid);
    let total = seq.total.clone();
    // Buffer (0 or 1) of tile f's dS^T and staging tiles, and the parity of tile f's wait for
    // tile f - 2's send (round 0 passes at once).
    let buf = |e: &mut Em, f: &str| -> (String, String) {
        let b = e.remk(f, 2);
        let r = e.divk(f, 2);
        let par = e.remk(&r, 2);
        let one = e.i32c(1);
        (b, e.op(&format!("arith.xori {par}, {one} : i32")))
    };
    // The copier also sends: 32 registers (24 spilled), so 232 for the consumers.
    ws_split_regs(
        &mut e,
        &tid,
        (232, 32),
        |e, cp| {
            seq.copy_kv(e, p, io, cp);
            let load = |e: &mut Em, f: &str| seq.load(e, p, io, cp, &ring, f);
            let sender = e.op(&format!("arith.cmpi eq, {}, {zero_i} : i32", cp.ptid));
            // Tile g's staging tile (both warpgroups wrote it before releasing g's stage) to the
            // accumulator; then the send before it has read its tile: its buffer is free.
            let send = |e: &mut Em, g: &str| {
                let (h, q0) = seq.locate(e, g);
                let bh = e.addi(&seq.bh0, &h);
                let at = acc_at(e, p, &bh, &q0);
                let gp = e.gep(&io.ws, 1, &at, "i64", "f32");
                let ga = e.op(&format!("llvm.ptrtoint {gp} : !llvm.ptr<1> to i64"));
                let (b, _) = buf(e, g);
                let so = e.mulk(&b, stg_bytes(d));
                let so = e.addk(&so, l.stg0);
                let sa = e.addi(&smem32, &so);
                e.line(&format!(
                    "llvm.inline_asm has_side_effects \"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], {}; cp.async.bulk.commit_group; cp.async.bulk.wait_group.read 1;\", \"l,r,~{{memory}}\" {ga}, {sa} : (i64, i32) -> ()",
                    stg_bytes(d)
                ));
                let has_prev = e.op(&format!("arith.cmpi ugt, {g}, {zero_i} : i32"));
                if_then(e, &has_prev, |e| {
                    let pb = e.addk(&b, 1);
                    let pb = e.remk(&pb, 2);
                    let po = e.mulk(&pb, 8);
                    let bar = e.addi(&sfree0, &po);
                    e.mbar_arrive(&bar);
                });
            };
            let publish = |e: &mut Em, f: &str| {
                e.fence_proxy_async();
                let (s, _) = ring.slot(e, f);
                let bar = ring.bar(e, &s, false);
                e.mbar_arrive(&bar);
            };
            // Two stages: tile f - 1 is published as soon as it lands, then tile f's slot (tile
            // f - 2's) is waited for; its release also says tile f - 2's dQ partial is staged.
            load(e, &zero_i);
            e.commit();
            let one = e.i32c(1);
            let two = e.i32c(2);
            for_each(e, &one, &total, |e, f| {
                e.wait_group(0);
                let prev = e.addk(f, -1);
                publish(e, &prev);
                let (s, par) = ring.slot(e, f);
                let free = e.op(&format!("arith.xori {par}, {one} : i32"));
                let bar = ring.bar(e, &s, true);
                e.mbar_wait(&bar, &free);
                let old = e.op(&format!("arith.cmpi uge, {f}, {two} : i32"));
                let go = e.op(&format!("arith.andi {sender}, {old} : i1"));
                if_then(e, &go, |e| {
                    let g = e.addk(f, -2);
                    send(e, &g);
                });
                load(e, f);
                e.commit();
            });
            e.wait_group(0);
            let last = e.addk(&total, -1);
            publish(e, &last);
            // The last two tiles' partials, once their stages are released.
            if_then(e, &sender, |e| {
                let lo = e.addk(&total, -2);
                for_each(e, &lo, &total, |e, g| {
                    let (s, par) = ring.slot(e, g);
                    let bar = ring.bar(e, &s, true);
                    e.mbar_wait(&bar, &par);
                    send(e, g);
                });
                e.line("llvm.inline_asm has_side_effects \"cp.async.bulk.wait_group 0;\", \"~{memory}\" : () -> ()");
            });
        },
        |e, wgi| {
            let wl = e.remk(&id.warp, 4);
            let wk = e.mulk(wgi, 64);
            let w16 = e.mulk(&wl, 16);
            let key0 = e.addi(&w16, &id.g);
            let kcol = e.mulk(&id.tq, 2);
            let tq2 = e.divk(&id.tq, 2);
            let tqsub = e.remk(&id.tq, 2);
            let tqsub = e.mulk(&tqsub, 2);
            // dS as A (MN-major: 64 queries along each 128-byte row, one row per key, 64-query
            // blocks of 128 rows) and a 64-dim block of K as B (MN-major), 16 keys a k-step.
            // This warpgroup's 64 x 64 block of dQ: query block `qb`, dim block `db`.
            let (qb, db) = if bm == 64 { (e.i32c(0), wgi.to_string()) } else { (wgi.to_string(), e.i32c(0)) };
            let mnmaj = sw128_descriptor(e, &smem, WS_KEYS * 128, 1024);
            let offs = sw128_mnmajor_steps(WS_KEYS);
            let k_blk = e.mulk(&db, WS_KEYS * 64);
            let kd = sw128_desc_at(e, &mnmaj, &k_blk);
            let row0 = e.mulk(&qb, 64);
            let row0 = e.addi(&row0, &key0);
            let chunk0 = e.mulk(&db, 16);
            let after = |e: &mut Em, f: &str, dst: &[[String; 4]]| {
                let (b, free) = buf(e, f);
                // dS^T -> dS tile b: key row `wk + key` of query block `nt / 8`, query chunk
                // `nt % 8` of its 128-byte row, swizzled (chunk ^ key % 8; key % 8 = g).
                let ds_el = e.mulk(&b, ds_bytes(d) / 2);
                let ds_el = e.addk(&ds_el, l.ds0 / 2);
                for (nt, t) in dst.iter().enumerate() {
                    for k in 0..2 {
                        let row = e.addi(&wk, &key0);
                        let row = e.addk(&row, 8 * k as i64 + WS_KEYS * (nt as i64 / 8));
                        let ntc = e.i32c(nt as i64 % 8);
                        let ch = e.op(&format!("arith.xori {ntc}, {} : i32", id.g));
                        let ro = e.mulk(&row, 64);
                        let co = e.mulk(&ch, 8);
                        let o = e.addi(&ro, &co);
                        let o = e.addi(&o, &kcol);
                        let o = e.addi(&o, &ds_el);
                        let ptr = sptr(e, &smem, &o, "bf16");
                        let pk = e.pack_bf16(&t[2 * k], &t[2 * k + 1]);
                        e.line(&format!("llvm.store {pk}, {ptr} {{alignment = 4 : i64}} : i32, !llvm.ptr<3>"));
                    }
                }
                e.fence_proxy_async();
                e.line("llvm.inline_asm has_side_effects \"bar.sync 1, 256;\", \"~{memory}\" : () -> ()");
                // dQ[64 qb .., 64 db ..] = dS K over the CTA's 128 keys.
                let a_el = e.mulk(&qb, WS_KEYS * 64);
                let a_el = e.addi(&a_el, &ds_el);
                let ad = sw128_desc_at(e, &mnmaj, &a_el);
                let z = frag_names(&zeros(e, 8));
                let dq = frags_of(&wgmma_chain(e, 64, &z, WgA::SmemMn(&ad, &offs), &kd, &offs, true));
                // The staging tile is free once tile f - 2's send has read it.
                let bar = e.mulk(&b, 8);
                let bar = e.addi(&sfree0, &bar);
                e.mbar_wait(&bar, &free);
                let st_el = e.mulk(&b, stg_bytes(d) / 4);
                let st_el = e.addk(&st_el, l.stg0 / 4);
                let stg = sptr(e, &smem, &st_el, "f32");
                for (nt, t) in dq.iter().enumerate() {
                    for k in 0..2 {
                        let row = e.addk(&row0, 8 * k as i64);
                        // Chunk of column 64 db + 8 nt + 2 tq.
                        let c = e.addk(&chunk0, 2 * nt as i64);
                        let c = e.addi(&c, &tq2);
                        let o = stg_off(e, d, &row, &c, &tqsub);
                        let ptr = sptr(e, &stg, &o, "f32");
                        let v = e.op(&format!("vector.from_elements {}, {} : vector<2xf32>", t[2 * k], t[2 * k + 1]));
                        e.line(&format!("llvm.store {v}, {ptr} {{alignment = 8 : i64}} : vector<2xf32>, !llvm.ptr<3>"));
                    }
                }
                e.fence_proxy_async();
            };
            let cx = WsCx { wgi, kv0: &seq.kt.kv0, kv_base: &seq.kt.kv_base, smem: &smem, total: &total, ring: &ring, bm };
            dkdv_ws_consumer(e, p, io, &cx, &|e, f| seq.locate(e, f), &after);
        },
    );
    e.body
}
