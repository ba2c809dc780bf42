//! The attention forward, warp-specialized (FA3's producer/consumer structure; `wgmma` head dims
//! 64 and 128, sequence a multiple of 128): one CTA of three warpgroups per 128-query tile of
//! one (batch, query head), the longest causal tiles first. Warpgroup 2 copies each key tile's
//! K and V (128 keys; first Q's 128 rows at head_dim 128, [`q_smem`]) into a [`Ring`] of
//! stages, once for both consumers; warpgroups 0 and 1 own the query rows `64 w ..` of the tile
//! and run the single-warpgroup kernel's pipelined key loop ([`super::forward_wgmma`]: `S_j = Q
//! K_j^T` and `O += P_{j+1} V_{j+1}` as two `wgmma` groups, tile `j`'s softmax while the second
//! runs) on the ring's stages, S at `wgmma` N = 128 (twice the single-warpgroup kernel's 64 keys
//! a tile: half the waits, barrier round trips and row-max shuffles per key). The two take
//! turns issuing their products ([`Turns`], FA3's ping-pong, [`pingpong`]), so one's softmax
//! runs while the other's products hold the tensor cores; `mbarrier`s and those two named
//! barriers are the only synchronization after the split.
//!
//! What it changes against the single-warpgroup kernel (three 64-query CTAs an SM at head_dim
//! 128, each loading every K/V tile itself): each K/V tile crosses L2 -> SM once per 128 query
//! rows instead of per 64, and the loads leave the computing warps. Session 14's two-warpgroup
//! forward without a producer shared tiles behind CTA-wide barriers and ran slower
//! (docs/notes.md, Kernels). The default at head_dim 128 from sequence 2048 on ([`enabled`]).
//!
//! Tile order: key tiles last to first, as the single-warpgroup kernel runs them. Causal, the
//! CTA's sequence starts at its diagonal tile (key tile `m` for query tile `m`, both of 128), the
//! one tile each consumer masks; the lower warpgroup's half of it past its own rows is all
//! masked (its products there are spent for nothing: one tile of the CTA's `m + 1`).

use super::*;
use crate::warp_spec::{Ring, WS_LAUNCH_REGS, WS_THREADS, WgIndex, ws_split_regs};

/// Query rows per CTA: two consumer warpgroups of 64.
const QUERIES: i64 = 128;
/// Keys per tile (a stage's K and V rows, S's `wgmma` N).
const KEYS: i64 = 128;

/// Stages in the ring, each a K and a V tile of 128 keys: 32 KB at head_dim 64, 64 KB at 128
/// (192 KB either way).
fn stages(d: i64) -> i64 {
    if d == 64 { 6 } else { 3 }
}

/// Whether the two computing warpgroups take turns issuing their products ([`Turns`], FA3's
/// ping-pong): on an H100 at seq 8192, head_dim 128, 939 against 996 us in a burst and 0.731
/// against 0.809 J a launch held at the power cap (docs/performance.md, session 26).
/// `TITAN_ATT_FWD_PINGPONG=0` at build time turns it off, for comparisons.
fn pingpong() -> bool {
    crate::switches::var(crate::switches::Switch::AttFwdPingpong).as_deref() != Some("0")
}

/// Whether Q sits in shared memory (the A operand of `S = Q K^T` from a descriptor, 32 KB after
/// the stages) instead of registers: at head_dim 128, where Q's 32 registers a thread beside S
/// (64), O (64) and two tiles of P (32 each) spill ptxas's 240.
fn q_smem(d: i64) -> bool {
    d == 128
}

/// Whether the warp-specialized forward is built for `p` (`wgmma` head dims, whole 128-query
/// tiles): by default at head_dim 128 from sequence 2048 on, where on an H100 it ran 4-6.5%
/// faster in bursts than the single-warpgroup kernel (seq 8192: 939 against 1,004 us, 585
/// TFLOP/s) and, held at the power cap, took 0.731 J a launch at seq 8192 (cuDNN's SDPA 0.703;
/// the single-warpgroup kernel 0.826 in session 25), docs/performance.md, session 26. Shorter
/// sequences were not measured. At head_dim 64 it is 3-16% slower in bursts than the four
/// single-warpgroup CTAs an SM and takes about their energy, so it is off there.
/// `TITAN_ATT_FWD_WS` at build time overrides, for comparisons: `1` wherever it can run, `0`
/// never.
pub(super) fn enabled(p: &Problem) -> bool {
    if !uses_wgmma(p.d) || !p.s.is_multiple_of(QUERIES as u64) {
        return false;
    }
    match crate::switches::var(crate::switches::Switch::AttFwdWs).as_deref() {
        Some("1") => true,
        Some("0") => false,
        _ => p.d == 128 && p.s >= 2048,
    }
}

/// Dynamic shared memory: the stages, Q's tile ([`q_smem`]), then a full and an empty
/// `mbarrier` (8 bytes) per stage.
pub(super) fn smem_bytes(d: i64) -> i64 {
    2 * q_at(d) + if q_smem(d) { 2 * QUERIES * d } else { 0 } + 16 * stages(d)
}

/// Element offset of Q's tile: after the stages.
fn q_at(d: i64) -> i64 {
    stages(d) * 2 * KEYS * d
}

/// (grid, block, extra kernel attributes): one CTA per 128-query tile of a (batch, head), 384
/// threads launched at the registers `setmaxnreg` redistributes.
pub(super) fn launch(p: &Problem) -> (u32, u32, String) {
    (((p.s / QUERIES as u64) * p.b * p.hq) as u32, WS_THREADS as u32, format!(", nvvm.maxnreg = {WS_LAUNCH_REGS} : i32"))
}

/// The kernel body (parameters q, k, v, out, lse).
pub(super) fn body(p: &Problem, qp: &str, kp: &str, vp: &str, op: &str, lp: &str) -> String {
    let mut e = Em::new();
    let d = p.d as i64;
    let bn = KEYS;
    let nst = stages(d);
    // Elements of a stage: K's tile, then V's.
    let se = 2 * bn * d;
    let nm = p.s as i64 / QUERIES;
    let tid_ix = e.op("gpu.thread_id x");
    let tid = e.op(&format!("arith.index_cast {tid_ix} : index to i32"));
    let bid_ix = e.op("gpu.block_id x");
    let bid = e.op(&format!("arith.index_cast {bid_ix} : index to i32"));
    let Tile { mblk, bhi, q_base, kv_base } = tile_of(&mut e, p, &bid, nm);
    let kv_row = (p.hkv * p.d) as i64;
    let smem = e.op("llvm.mlir.addressof @att_smem : !llvm.ptr<3>");
    let ring = Ring::new(&mut e, &smem, smem_bytes(d) - 16 * nst, nst, &tid);
    // The CTA's key tiles: up to its diagonal when causal.
    let n_tiles = if p.causal { e.addk(&mblk, 1) } else { e.i32c(p.s as i64 / bn) };
    let last = e.addk(&n_tiles, -1);
    // The copier (128-key tiles, and Q's 128 rows at head_dim 128) spilled 20 bytes at 24
    // registers at the 8B shape (not at the small test shapes): 32 for it, so 232 for the
    // consumers (no spills either side).
    ws_split_regs(
        &mut e,
        &tid,
        (232, 32),
        WgIndex::Divided,
        |e, cp| {
            let g_off = e.row_offset(&cp.crow, kv_row, &cp.cc864, &kv_base);
            let k_g = e.gep(kp, 1, &g_off, "i64", "bf16");
            let v_g = e.gep(vp, 1, &g_off, "i64", "bf16");
            if q_smem(d) {
                // Q's 128 rows, in tile 0's copy group (published with it).
                let q_row = (p.hq * p.d) as i64;
                let q_off = e.row_offset(&cp.crow, q_row, &cp.cc864, &q_base);
                let q_g = e.gep(qp, 1, &q_off, "i64", "bf16");
                let m64 = e.ext64(&mblk);
                let tq = e.i64c(QUERIES * q_row);
                let off = e.bin("muli", &m64, &tq, "i64");
                let qb = e.i32c(q_at(d));
                cp.copy(e, &smem, &q_g, &off, q_row, QUERIES, d, &qb);
            }
            // Sequence entry f is key tile `last - f`.
            let load = |e: &mut Em, f: &str| {
                let (s, _) = ring.slot(e, f);
                let kb = e.mulk(&s, se);
                let vb = e.addk(&kb, bn * d);
                let j = e.bin("subi", &last, f, "i32");
                let j64 = e.ext64(&j);
                let tk = e.i64c(bn * kv_row);
                let off = e.bin("muli", &j64, &tk, "i64");
                for (src, base) in [(&k_g, &kb), (&v_g, &vb)] {
                    cp.copy(e, &smem, src, &off, kv_row, bn, d, base);
                }
            };
            ring.produce(e, &n_tiles, &load);
        },
        |e, wgi| consumer(e, p, &ring, Consumer { wgi, tid: &tid, mblk: &mblk, bhi: &bhi, q_base: &q_base, n_tiles: &n_tiles, smem: &smem }, [qp, op, lp]),
    );
    e.body
}

/// What a consumer warpgroup's code needs from the CTA's.
struct Consumer<'a> {
    /// The warpgroup (i32, 0 or 1).
    wgi: &'a str,
    tid: &'a str,
    /// The CTA's 128-query tile, its (batch x heads + head), and Q's element base of that head.
    mblk: &'a str,
    bhi: &'a str,
    q_base: &'a str,
    n_tiles: &'a str,
    smem: &'a str,
}

/// A consumer warpgroup: its 64 query rows against every stage of the ring, then its rows of
/// `out` and `lse`.
fn consumer(e: &mut Em, p: &Problem, ring: &Ring, c: Consumer, [qp, op, lp]: [&str; 3]) {
    let d = p.d as i64;
    let bn = KEYS;
    let se = 2 * bn * d;
    let nt = (d / 8) as usize;
    let lane = e.remk(c.tid, 32);
    let warp = e.divk(c.tid, 32);
    let wl = e.remk(&warp, 4);
    let g = e.divk(&lane, 4);
    let tq = e.remk(&lane, 4);
    let m128 = e.mulk(c.mblk, QUERIES);
    let w64 = e.mulk(c.wgi, 64);
    // The thread's two rows within the CTA's 128 (the diagonal mask's), then absolute.
    let w16 = e.mulk(&wl, 16);
    let qr = e.addi(&w16, &g);
    let qr0 = e.addi(&w64, &qr);
    let qr1 = e.addk(&qr0, 8);
    let row0 = e.addi(&m128, &qr0);
    let row1 = e.addi(&m128, &qr1);
    let kcol = e.mulk(&tq, 2);
    let q_row = (p.hq * p.d) as i64;
    let row_ptr = |e: &mut Em, base: &str, row: &str| -> String {
        let r64 = e.ext64(row);
        let rs = e.i64c(q_row);
        let ro = e.bin("muli", &r64, &rs, "i64");
        let o = e.bin("addi", c.q_base, &ro, "i64");
        let k64 = e.ext64(&kcol);
        let o = e.bin("addi", &o, &k64, "i64");
        e.gep(base, 1, &o, "i64", "bf16")
    };
    let cs = e.f32c((p.scale * std::f64::consts::LOG2_E) as f32);
    let koffs = sw128_kmajor_steps(d, bn);
    // Q: register fragments, or the warpgroup's 64 rows of the shared tile (K-major, 128 rows a
    // 64-dim block).
    let (qf, q_desc) = if q_smem(d) {
        let desc = sw128_descriptor(e, c.smem, 16, 1024);
        let rows = e.mulk(&w64, 64);
        let at = e.addk(&rows, q_at(d));
        (Vec::new(), sw128_desc_at(e, &desc, &at))
    } else {
        let qrow_p = [row_ptr(e, qp, &row0), row_ptr(e, qp, &row1)];
        (q_frags(e, &qrow_p, d), String::new())
    };
    let q_offs = sw128_kmajor_steps(d, QUERIES);
    let q = if q_smem(d) { WgA::Smem(&q_desc, &q_offs) } else { WgA::Regs(&qf) };
    let voffs = sw128_mnmajor_steps(bn);
    let k_desc = sw128_descriptor(e, c.smem, 16, 1024);
    // V's 64-dim blocks are `bn` rows of 128 bytes apart.
    let v_desc = sw128_descriptor(e, c.smem, bn * 128, 1024);
    // The K and V descriptors of sequence entry f's stage.
    let descs = |e: &mut Em, f: &str| -> (String, String, String) {
        let (s, _) = ring.slot(e, f);
        let kb = e.mulk(&s, se);
        let vb = e.addk(&kb, bn * d);
        (sw128_desc_at(e, &k_desc, &kb), sw128_desc_at(e, &v_desc, &vb), s)
    };
    let turns = pingpong().then(|| Turns::new(e, c.wgi));
    // Prologue: S of the first tile (causal: the diagonal, masked), its softmax.
    let f0 = e.i32c(0);
    ring.acquire(e, &f0);
    let (kd, _, _) = descs(e, &f0);
    let undef = e.op("llvm.mlir.undef : f32");
    let u = vec![undef; bn as usize / 2];
    if let Some(t) = &turns {
        t.wait(e);
    }
    let s = wgmma_issue(e, bn as usize, &u, q, &kd, &koffs, false, false);
    if let Some(t) = &turns {
        t.pass(e);
    }
    let (s, _) = wgmma_wait(e, 0, &s, &[]);
    let (init, tys) = first_carried(e, &cs, &s, p.causal.then_some((kcol.as_str(), &[qr0.clone(), qr1.clone()])), nt);
    let lo = e.i32c(1);
    let tile = Pipelined { q, koffs: &koffs, voffs: &voffs, c: &cs, d, nt, bn: bn as usize, turns: turns.as_ref() };
    let res = scf_for(e, &lo, c.n_tiles, &init, &tys, |e, f, a| {
        ring.acquire(e, f);
        let (kd, _, _) = descs(e, f);
        let fp = e.addk(f, -1);
        let (_, vd, sp) = descs(e, &fp);
        // Entry f - 1 is read once `P V` is done (its K by the previous S, its V by this P V).
        tile.step(e, a, &kd, &vd, |_| {}, |e| ring.release(e, &sp))
    });
    // The last entry's P V.
    let fl = e.addk(c.n_tiles, -1);
    let (_, vd, sl) = descs(e, &fl);
    // Warpgroup 1 passed the first turn unasked, so it keeps its last: every barrier phase
    // then has its 256 arrivals and none is left open.
    let zero = e.i32c(0);
    let is0 = e.op(&format!("arith.cmpi eq, {}, {zero} : i32", c.wgi));
    let st = last_pv(e, &res, &vd, &voffs, d, nt, turns.as_ref().map(|t| (t, is0.as_str())));
    ring.release(e, &sl);
    let orow_p = [row_ptr(e, op, &row0), row_ptr(e, op, &row1)];
    write_out(e, &st, &orow_p, lp, c.bhi, p.s as i64, [&row0, &row1], &tq);
}
