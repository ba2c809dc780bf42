//! The attention forward, warp-specialized (FA3's producer/consumer structure; `wgmma` head dims
//! 64 and 128, sequence a multiple of 128): one CTA of three warpgroups per 128-query tile of
//! one (batch, query head), the longest causal tiles first. Warpgroup 2 copies each key tile's
//! K and V (64 keys) into a [`Ring`] of stages, once for both consumers; warpgroups 0 and 1 own
//! the query rows `64 w ..` of the tile and run the single-warpgroup kernel's pipelined key loop
//! ([`super::forward_wgmma`]: `S_j = Q K_j^T` and `O += P_{j+1} V_{j+1}` as two `wgmma` groups,
//! tile `j`'s softmax while the second runs) on the ring's stages, Q in registers. Only
//! `mbarrier`s synchronize after the split, so the two consumers drift apart and one's softmax
//! overlaps the other's products.
//!
//! What it changes against the single-warpgroup kernel (three 64-query CTAs an SM at head_dim
//! 128, each loading every K/V tile itself): each K/V tile crosses L2 -> SM once per 128 query
//! rows instead of per 64, and the loads leave the computing warps. Session 14's two-warpgroup
//! forward without a producer shared tiles behind CTA-wide barriers and ran slower
//! (docs/notes.md, Kernels). The default at head_dim 128 from sequence 8192 on ([`enabled`]).
//!
//! Tile order: key tiles last to first, as the single-warpgroup kernel runs them. Causal, the
//! CTA's sequence starts at the upper warpgroup's diagonal tile (`2 m + 1` for query tile `m` of
//! 128 rows), which the lower warpgroup releases unread; the lower warpgroup's first tile is its
//! own diagonal (`2 m`). Each consumer masks only its first tile.

use super::*;
use crate::warp_spec::{Ring, WS_LAUNCH_REGS, WS_THREADS, ws_split};

/// Query rows per CTA: two consumer warpgroups of 64.
const QUERIES: i64 = 128;

/// Stages in the ring, each a K and a V tile of 64 keys: 16 KB at head_dim 64, 32 KB at 128.
fn stages(d: i64) -> i64 {
    if d == 64 { 6 } else { 4 }
}

/// Whether the warp-specialized forward is built for `p` (`wgmma` head dims, whole 128-query
/// tiles): by default at head_dim 128 from sequence 8192 on, where on an H100 it took 1.9% less
/// energy a launch held at the power cap than the single-warpgroup kernel (0.810 against 0.826
/// J; 0.5% faster in a burst) and the 8b-4l step ran 0.5-0.7% faster (docs/performance.md,
/// session 25). At 4096 -2% energy but 4% slower in a burst, at 2048 +2.5% energy; at head_dim
/// 64 (one CTA of 8 computing warps an SM against four 4-warp CTAs) 27-38% slower in bursts and the 1B
/// step 0.8% slower. `TITAN_ATT_FWD_WS` at build time overrides, for comparisons: `1` wherever
/// it can run, `0` never.
pub(super) fn enabled(p: &Problem) -> bool {
    if !uses_wgmma(p.d) || !p.s.is_multiple_of(QUERIES as u64) {
        return false;
    }
    match std::env::var("TITAN_ATT_FWD_WS").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => p.d == 128 && p.s >= 8192,
    }
}

/// Dynamic shared memory: the stages, then a full and an empty `mbarrier` (8 bytes) per stage.
pub(super) fn smem_bytes(d: i64) -> i64 {
    stages(d) * 2 * 2 * BN as i64 * d + 16 * stages(d)
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
    let bn = BN as i64;
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
    let ring = Ring::new(&mut e, &smem, 2 * nst * se, nst, &tid);
    // The CTA's key tiles: up to the upper warpgroup's diagonal when causal.
    let n_tiles = if p.causal {
        let m2 = e.mulk(&mblk, 2);
        e.addk(&m2, 2)
    } else {
        e.i32c(p.s as i64 / bn)
    };
    let last = e.addk(&n_tiles, -1);
    ws_split(
        &mut e,
        &tid,
        |e, cp| {
            let g_off = e.row_offset(&cp.crow, kv_row, &cp.cc864, &kv_base);
            let k_g = e.gep(kp, 1, &g_off, "i64", "bf16");
            let v_g = e.gep(vp, 1, &g_off, "i64", "bf16");
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

/// A consumer warpgroup: its 64 query rows against every stage of the ring (the causal lower
/// warpgroup releases the first unread), then its rows of `out` and `lse`.
fn consumer(e: &mut Em, p: &Problem, ring: &Ring, c: Consumer, [qp, op, lp]: [&str; 3]) {
    let d = p.d as i64;
    let bn = BN as i64;
    let se = 2 * bn * d;
    let nt = (d / 8) as usize;
    let lane = e.remk(c.tid, 32);
    let warp = e.divk(c.tid, 32);
    let wl = e.remk(&warp, 4);
    let g = e.divk(&lane, 4);
    let tq = e.remk(&lane, 4);
    let m128 = e.mulk(c.mblk, QUERIES);
    let w64 = e.mulk(c.wgi, 64);
    let row_base = e.addi(&m128, &w64);
    // The thread's two rows within the warpgroup's 64 (the diagonal mask's), then absolute.
    let w16 = e.mulk(&wl, 16);
    let qr0 = e.addi(&w16, &g);
    let qr1 = e.addk(&qr0, 8);
    let row0 = e.addi(&row_base, &qr0);
    let row1 = e.addi(&row_base, &qr1);
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
    let qrow_p = [row_ptr(e, qp, &row0), row_ptr(e, qp, &row1)];
    let qf = q_frags(e, &qrow_p, d);
    let cs = e.f32c((p.scale * std::f64::consts::LOG2_E) as f32);
    let koffs = sw128_kmajor_steps(d, bn);
    let voffs = sw128_mnmajor_steps(bn);
    let k_desc = sw128_descriptor(e, c.smem, 16, 1024);
    let v_desc = sw128_descriptor(e, c.smem, SW_BLOCK, 1024);
    // The K and V descriptors of sequence entry f's stage.
    let descs = |e: &mut Em, f: &str| -> (String, String, String) {
        let (s, _) = ring.slot(e, f);
        let kb = e.mulk(&s, se);
        let vb = e.addk(&kb, bn * d);
        (sw128_desc_at(e, &k_desc, &kb), sw128_desc_at(e, &v_desc, &vb), s)
    };
    // The first entry this warpgroup reads: causal, the lower one skips the upper's diagonal.
    let f0 = if p.causal {
        let one = e.i32c(1);
        let f0 = e.bin("subi", &one, c.wgi, "i32");
        let zero = e.i32c(0);
        let skip = e.op(&format!("arith.cmpi ne, {f0}, {zero} : i32"));
        if_then(e, &skip, |e| {
            let s = ring.acquire(e, &zero);
            ring.release(e, &s);
        });
        f0
    } else {
        e.i32c(0)
    };
    // Prologue: S of the first tile (causal: the diagonal, masked), its softmax.
    ring.acquire(e, &f0);
    let (kd, _, _) = descs(e, &f0);
    let undef = e.op("llvm.mlir.undef : f32");
    let u = vec![undef; 32];
    let s = wgmma_issue(e, 64, &u, WgA::Regs(&qf), &kd, &koffs, false, false);
    let (s, _) = wgmma_wait(e, 0, &s, &[]);
    let (init, tys) = first_carried(e, &cs, &s, p.causal.then_some((kcol.as_str(), &[qr0.clone(), qr1.clone()])), nt);
    let lo = e.addk(&f0, 1);
    let tile = Pipelined { q: WgA::Regs(&qf), koffs: &koffs, voffs: &voffs, c: &cs, d, nt };
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
    let st = last_pv(e, &res, &vd, &voffs, d, nt);
    ring.release(e, &sl);
    let orow_p = [row_ptr(e, op, &row0), row_ptr(e, op, &row1)];
    write_out(e, &st, &orow_p, lp, c.bhi, p.s as i64, [&row0, &row1], &tq);
}
