//! `attention_bwd` kernel: the FlashAttention-2 backward pass on tensor cores (Hopper's `wgmma`
//! at head_dim 64 and 128, `mma.sync` m16n8k16 with `ldmatrix` fragments at head_dim 16; bf16 ->
//! f32), emitted as MLIR text with NVVM ops, as two grid-wide phases of one module (the dQ phase
//! is the kernel's prologue launch).
//!
//! Design: dQ and (dK, dV) are computed by separate passes, each owning its output, so neither
//! needs atomics and the result is deterministic (bitwise reproducible). The dQ pass recomputes
//! `S` and `dP`: 7 GEMM-sized products instead of FA2's 5, traded for no f32 atomics, no
//! cross-CTA counters and fewer live registers in both passes.
//! - **dQ pass** (`<entry>_dq`, launched first): one CTA of 4 warps per 64-query tile of one
//!   (batch, query head), 16 rows a warp, the longest causal tiles first. Q and dO fragments stay
//!   in registers; `D = rowsum(dO o O)` and `lse log2 e` of the rows are computed once and written
//!   to the workspace for the second pass. Key tiles of 64 keys of K and V
//!   are double-buffered in shared memory by `cp.async` (tile `j + 1` lands while tile `j` is used).
//!   Per tile: `S = Q K^T`, `P = exp2(S scale log2 e - lse log2 e)` (0 above the diagonal),
//!   `dP = dO V^T`, `dS = P o (dP - D)`, `dQ += dS K`. dQ is scaled at the end. At head_dim 64
//!   and 128 the three products run on `wgmma` as in the forward (`attention.rs`): the K and V
//!   stages are 128-byte-swizzled blocks of `bn` keys x 64 dims, S and dP read them K-major,
//!   `dQ += dS K` reads K MN-major (its 64-dim blocks `bn * 128` bytes apart); at head_dim 16,
//!   `ldmatrix` fragments and `mma.sync` (`ldmatrix.trans` of K for dQ).
//! - **dK/dV pass** (`<entry>`): one CTA of 4 warps per 64-key tile of one (batch, kv head),
//!   16 keys a warp, lowest key tiles (the most causal work) first. K and V are staged once; the
//!   CTA loops over the query heads of its GQA group and their query tiles (64 rows; from the
//!   diagonal on when causal) as one flattened sequence, double-buffering
//!   Q, dO and the tile's `lse log2 e` and `D` (read back from the workspace). Per tile:
//!   `S^T = K Q^T`, `P^T`, `dP^T = V dO^T`, `dS^T = P^T o (dP^T - D)`, `dV += P^T dO`,
//!   `dK += dS^T Q` (scaled at the end), dK and dV in f32 registers throughout. At head_dim 64
//!   and 128 the four products run on `wgmma`: K, V, Q and dO are 128-byte-swizzled blocks of 64
//!   dims (each stage rounded up to 1 KB so its tiles stay 1024-byte aligned); `S^T` and `dP^T`
//!   take both operands from shared memory (K or V as A, Q or dO as B, K-major), `dV` and `dK`
//!   take `P^T` and `dS^T` as register A fragments and read dO and Q MN-major.
//! - Shared memory is dynamic (`@attb_smem`): 100,352 bytes for the dK/dV pass and 69,632 for the
//!   dQ pass at head_dim 128. The workspace (`2 b hq s` f32) is scratch: written by the first
//!   pass before the second reads it.
//!
//! Supported: the forward kernel's shapes (bf16, head_dim 16/64/128, sequence length a multiple
//! of 64, `scale > 0`).

use std::fmt::Write as _;

use titan_ir::{DType, Graph, Op, Region};

use crate::attention::{
    Em, WgA, checked_sizes, if_then, output_slots, scf_for, sw128_copy, sw128_desc_at, sw128_descriptor, sw128_kmajor_steps, sw128_mnmajor_steps, sw128_slot,
    uses_wgmma, wgmma_chain,
};
use crate::values::Body;
use crate::{GenResult, Generated, invalid, unsupported};

/// Keys per dK/dV CTA (4 warps x 16 keys) and query rows per dQ CTA (4 warps x 16 rows).
const BN: i64 = 64;
const BM: i64 = 64;
const THREADS: i64 = 128;

/// Query rows per tile of the dK/dV pass and keys per tile of the dQ pass. At head_dim 128 the
/// dK/dV pass then holds 246 registers and 100,352 bytes of shared memory, the dQ pass 221 and
/// 69,632 (two CTAs per SM each, no spills); at 32 (half the registers of `S^T`, `dP^T` and
/// their stages) the 8B-shaped backward took 3,563 us on the H200 against 3,079 (docs/notes.md,
/// Kernels).
const BMQ: i64 = 64;
const BNK: i64 = 64;

/// Dynamic shared memory of the dK/dV pass: K and V, then two stages of (Q, dO, lse, D).
fn dkdv_smem_bytes(d: i64) -> i64 {
    2 * (2 * BN * row_elems(d) + 2 * stage_elems(d))
}

/// bf16 elements of a tile row: padded for `ldmatrix` (`mma.sync`), whole swizzled 128-byte rows
/// for `wgmma` (head_dim 64, 128).
fn row_elems(d: i64) -> i64 {
    if uses_wgmma(d as u64) { d } else { d + 8 }
}

/// bf16 elements of one dK/dV stage: Q and dO tiles, then lse and D (f32, 2 elements each);
/// with `wgmma` rounded up to 1 KB so every stage's tiles stay 1024-byte aligned.
fn stage_elems(d: i64) -> i64 {
    let n = 2 * BMQ * row_elems(d) + 4 * BMQ;
    if uses_wgmma(d as u64) { (n as u64).next_multiple_of(512) as i64 } else { n }
}

/// Dynamic shared memory of the dQ pass: two stages of K, then two of V.
fn dq_smem_bytes(d: i64) -> i64 {
    2 * 4 * BNK * (d + 8)
}

#[derive(Clone, Copy, Debug)]
struct Problem {
    b: i64,
    s: i64,
    hq: i64,
    hkv: i64,
    d: i64,
    causal: bool,
    scale: f64,
}

/// Parameter positions: (q, k, v, out, lse, dout) argument indices, (dq, dk, dv) output indices.
type Params = ([usize; 6], [usize; 3]);

fn read(g: &Graph, r: &Region) -> GenResult<(Problem, Params)> {
    let b = Body::new(g, r)?;
    let nodes: Vec<_> = b.nodes().collect();
    let [node] = nodes.as_slice() else {
        return unsupported(format!("an attention_bwd body must hold exactly one attention_bwd node, found {} nodes", nodes.len()));
    };
    let Op::AttentionBwd { causal, scale } = node.op else {
        return invalid(format!("an attention_bwd body holds `{}`; expected attention_bwd", node.op.name()));
    };
    let mut ins = [0usize; 6];
    for (i, v) in node.inputs.iter().enumerate().take(6) {
        let Some(a) = b.arg_index(*v) else {
            return invalid("the inputs of an attention_bwd kernel must be body arguments");
        };
        ins[i] = a;
    }
    if node.inputs.len() != 6 || node.results.len() != 3 {
        return invalid("attention_bwd takes 6 inputs and has 3 results");
    }
    let outs = output_slots::<3>(r, node, "attention_bwd", "dq, dk and dv")?;
    for (k, v) in node.inputs.iter().enumerate() {
        let want = if k == 4 { DType::F32 } else { DType::BF16 };
        if b.dtype(*v) != want {
            return unsupported(format!("attention_bwd input {k} must be {want:?}, found {:?}", b.dtype(*v)));
        }
    }
    for v in &node.results {
        if b.dtype(*v) != DType::BF16 {
            return unsupported("attention_bwd gradients must be bf16");
        }
    }
    let [bb, s, hq, hkv, d] = checked_sizes(&b, node, scale, "attention_bwd")?;
    if bb * s * hq * d >= 1 << 36 || (s / BM as u64) * bb * hq > u64::from(u32::MAX) {
        return unsupported("attention_bwd problem size out of range");
    }
    let p = Problem { b: bb as i64, s: s as i64, hq: hq as i64, hkv: hkv as i64, d: d as i64, causal, scale };
    Ok((p, (ins, outs)))
}

/// The attention backward kernel for `r`.
pub(crate) fn generate(g: &Graph, r: &Region, entry: &str) -> GenResult<Generated> {
    let (p, (ins, outs)) = read(g, r)?;
    let na = r.args.len();
    let params: Vec<String> = (0..na + 4).map(|i| format!("%p{i}")).collect();
    let ptr = |i: usize| params[i].clone();
    let io = Io {
        q: ptr(ins[0]),
        k: ptr(ins[1]),
        v: ptr(ins[2]),
        o: ptr(ins[3]),
        lse: ptr(ins[4]),
        dout: ptr(ins[5]),
        dq: ptr(na + outs[0]),
        dk: ptr(na + outs[1]),
        dv: ptr(na + outs[2]),
        ws: ptr(na + 3),
    };
    let grid = ((p.s / BN) * p.b * p.hkv) as u32;
    let dq_grid = ((p.s / BM) * p.b * p.hq) as u32;
    let mut m = String::new();
    m.push_str("module attributes {gpu.container_module} {\n  gpu.module @titan {\n");
    // 1024-byte aligned: the dQ pass's swizzled `wgmma` tiles repeat their pattern every 1 KB.
    m.push_str("    llvm.mlir.global external @attb_smem() {addr_space = 3 : i32, alignment = 1024 : i64} : !llvm.array<0 x i8>\n");
    let ps: Vec<String> = params.iter().map(|p| format!("{p}: !llvm.ptr<1>")).collect();
    for (name, grid, body) in [(format!("{entry}_dq"), dq_grid, dq_body(&p, &io)), (entry.to_string(), grid, dkdv_body(&p, &io))] {
        let _ = writeln!(
            m,
            "    gpu.func @{name}({}) kernel attributes {{known_block_size = array<i32: {THREADS}, 1, 1>, known_grid_size = array<i32: {grid}, 1, 1>}} {{",
            ps.join(", ")
        );
        m.push_str(&body);
        m.push_str("      gpu.return\n    }\n");
    }
    m.push_str("  }\n}\n");
    Ok(Generated {
        mlir: m,
        block: THREADS as u32,
        grid,
        shared_bytes: dkdv_smem_bytes(p.d) as u32,
        prologue: Some(("_dq", dq_grid, THREADS as u32, dq_smem_bytes(p.d) as u32)),
        workspace_bytes: 2 * (p.b * p.hq * p.s) as u64 * 4,
        workspace_scratch: true,
    })
}

struct Io {
    q: String,
    k: String,
    v: String,
    o: String,
    lse: String,
    dout: String,
    dq: String,
    dk: String,
    dv: String,
    ws: String,
}

fn frag_names(v: &[[String; 4]]) -> Vec<String> {
    v.iter().flat_map(|t| t.iter().cloned()).collect()
}

fn frags_of(v: &[String]) -> Vec<[String; 4]> {
    v.chunks(4).map(|c| [c[0].clone(), c[1].clone(), c[2].clone(), c[3].clone()]).collect()
}

/// Emit `scf.for iv = lo to hi step 1` carrying f32 `inits`; returns the results.
fn for_f32(e: &mut Em, lo: &str, hi: &str, inits: &[String], body: impl FnOnce(&mut Em, &str, &[String]) -> Vec<String>) -> Vec<String> {
    scf_for(e, lo, hi, inits, &vec!["f32"; inits.len()], body)
}

/// Thread and lane indices both passes use.
struct Ids {
    tid: String,
    bid: String,
    warp: String,
    lane: String,
    /// `lane / 4` (the C-fragment row) and `lane % 4` (its column pair).
    g: String,
    tq: String,
    /// `ldmatrix.x4` matrix index of the lane, split: `(lane / 8) % 2`, `lane / 16`, `lane % 8`.
    mi_lo: String,
    mi_hi: String,
    r8: String,
}

fn ids(e: &mut Em) -> Ids {
    let tid_ix = e.op("gpu.thread_id x");
    let tid = e.op(&format!("arith.index_cast {tid_ix} : index to i32"));
    let bid_ix = e.op("gpu.block_id x");
    let bid = e.op(&format!("arith.index_cast {bid_ix} : index to i32"));
    let warp = e.divk(&tid, 32);
    let lane = e.remk(&tid, 32);
    let g = e.divk(&lane, 4);
    let tq = e.remk(&lane, 4);
    let mi = e.divk(&lane, 8);
    let r8 = e.remk(&lane, 8);
    let mi_lo = e.remk(&mi, 2);
    let mi_hi = e.divk(&mi, 2);
    Ids { tid, bid, warp, lane, g, tq, mi_lo, mi_hi, r8 }
}

/// `(row * 8 + r8) * st + col * 8`: a lane's `ldmatrix` element offset from the 8x8 block indices.
fn lm_off(e: &mut Em, row: &str, col: &str, r8: &str, st: i64) -> String {
    let r = e.mulk(row, 8);
    let r = e.addi(&r, r8);
    let ro = e.mulk(&r, st);
    let c = e.mulk(col, 8);
    e.addi(&ro, &c)
}

/// `base + off` elements of `elem` in shared memory, `off` an i32 value.
fn sptr(e: &mut Em, base: &str, off: &str, elem: &str) -> String {
    e.gep(base, 3, off, "i32", elem)
}

/// Unpack an i32 holding two bf16 into two f32.
fn unpack_bf16(e: &mut Em, x: &str) -> [String; 2] {
    let v = e.op(&format!("llvm.bitcast {x} : i32 to vector<2xbf16>"));
    let f = e.op(&format!("arith.extf {v} : vector<2xbf16> to vector<2xf32>"));
    [0, 1].map(|i| e.op(&format!("vector.extract {f}[{i}] : f32 from vector<2xf32>")))
}

/// C fragments (two 8-column n-tiles) packed as one bf16 A fragment (16 columns of k).
fn to_a(e: &mut Em, f: &[[String; 4]], kk: usize) -> [String; 4] {
    let (t0, t1) = (&f[2 * kk], &f[2 * kk + 1]);
    [e.pack_bf16(&t0[0], &t0[1]), e.pack_bf16(&t0[2], &t0[3]), e.pack_bf16(&t1[0], &t1[1]), e.pack_bf16(&t1[2], &t1[3])]
}

fn zeros(e: &mut Em, n: usize) -> Vec<[String; 4]> {
    let z = e.f32c(0.0);
    (0..n).map(|_| [0; 4].map(|_| z.clone())).collect()
}

/// The dQ pass: one CTA per 64-query tile of one (batch, query head).
fn dq_body(p: &Problem, io: &Io) -> String {
    let mut e = Em::new();
    let d = p.d;
    let st = d + 8;
    let bn = BNK;
    let nm = p.s / BM;
    let bh = p.b * p.hq;
    let grp = p.hq / p.hkv;
    let q_row = p.hq * d;
    let kv_row = p.hkv * d;
    let id = ids(&mut e);
    // Longest causal tiles first: block -> (query tile, batch * head).
    let mb_rev = e.divk(&id.bid, bh);
    let nm1 = e.i32c(nm - 1);
    let mblk = e.bin("subi", &nm1, &mb_rev, "i32");
    let bhi = e.remk(&id.bid, bh);
    let bi = e.divk(&bhi, p.hq);
    let h = e.remk(&bhi, p.hq);
    let kh = e.divk(&h, grp);
    let bi64 = e.ext64(&bi);
    let h64 = e.ext64(&h);
    let kh64 = e.ext64(&kh);
    let d64 = e.i64c(d);
    let sq = e.i64c(p.s * p.hq * d);
    let skv = e.i64c(p.s * p.hkv * d);
    let qb = e.bin("muli", &bi64, &sq, "i64");
    let hd = e.bin("muli", &h64, &d64, "i64");
    let q_base = e.bin("addi", &qb, &hd, "i64");
    let kvb = e.bin("muli", &bi64, &skv, "i64");
    let khd = e.bin("muli", &kh64, &d64, "i64");
    let kv_base = e.bin("addi", &kvb, &khd, "i64");
    // The thread's two query rows (absolute) and column pair.
    let w16 = e.mulk(&id.warp, 16);
    let qr0 = e.addi(&w16, &id.g);
    let m64 = e.mulk(&mblk, BM);
    let row0 = e.addi(&m64, &qr0);
    let row1 = e.addk(&row0, 8);
    let rows = [row0, row1];
    let kcol = e.mulk(&id.tq, 2);
    let row_ptr = |e: &mut Em, base: &str, row: &str| -> String {
        let r64 = e.ext64(row);
        let rs = e.i64c(q_row);
        let ro = e.bin("muli", &r64, &rs, "i64");
        let o = e.bin("addi", &q_base, &ro, "i64");
        let k64 = e.ext64(&kcol);
        let o = e.bin("addi", &o, &k64, "i64");
        e.gep(base, 1, &o, "i64", "bf16")
    };
    // A fragments of a [rows, d] bf16 tensor straight from global memory.
    let frags = |e: &mut Em, base: &str| -> Vec<[String; 4]> {
        let rp = [row_ptr(e, base, &rows[0]), row_ptr(e, base, &rows[1])];
        (0..d / 16)
            .map(|ks| {
                let mut a: [String; 4] = Default::default();
                for (i, x) in a.iter_mut().enumerate() {
                    let ptr = e.gepk(&rp[i % 2], 1, 16 * ks + 8 * (i / 2) as i64);
                    *x = e.op(&format!("llvm.load {ptr} {{alignment = 4 : i64}} : !llvm.ptr<1> -> i32"));
                }
                a
            })
            .collect()
    };
    let qf = frags(&mut e, &io.q);
    let dof = frags(&mut e, &io.dout);
    // D = rowsum(dO o O) for the two rows: fragments of O in the same layout, then the quad.
    let zf = e.f32c(0.0);
    let mut dsum = [zf.clone(), zf.clone()];
    {
        let of = frags(&mut e, &io.o);
        for (a, b) in dof.iter().zip(&of) {
            for i in 0..4 {
                let x = unpack_bf16(&mut e, &a[i]);
                let y = unpack_bf16(&mut e, &b[i]);
                for k in 0..2 {
                    dsum[i % 2] = e.fma(&x[k], &y[k], &dsum[i % 2]);
                }
            }
        }
        for r in dsum.iter_mut() {
            for off in [1, 2] {
                let o = e.shfl_xor(r, off);
                *r = e.fadd(r, &o);
            }
        }
    }
    // lse (log2 domain) of the rows; both statistics go to the workspace for the dK/dV pass.
    let log2e = e.f32c(std::f32::consts::LOG2_E);
    let bh64 = e.ext64(&bhi);
    let s64 = e.i64c(p.s);
    let bhs = e.bin("muli", &bh64, &s64, "i64");
    let stat_base = e.i64c(p.b * p.hq * p.s);
    let mut neg_lse = [String::new(), String::new()];
    let mut idx = [String::new(), String::new()];
    for r in 0..2 {
        let r64 = e.ext64(&rows[r]);
        idx[r] = e.bin("addi", &bhs, &r64, "i64");
        let lp = e.gep(&io.lse, 1, &idx[r], "i64", "f32");
        let l = e.op(&format!("llvm.load {lp} {{alignment = 4 : i64}} : !llvm.ptr<1> -> f32"));
        let l2 = e.fmul(&l, &log2e);
        neg_lse[r] = e.op(&format!("arith.negf {l2} : f32"));
        let zero_i = e.i32c(0);
        let first = e.op(&format!("arith.cmpi eq, {}, {zero_i} : i32", id.tq));
        let (dsr, i) = (dsum[r].clone(), idx[r].clone());
        if_then(&mut e, &first, |e| {
            let dp = e.gep(&io.ws, 1, &i, "i64", "f32");
            e.line(&format!("llvm.store {dsr}, {dp} {{alignment = 4 : i64}} : f32, !llvm.ptr<1>"));
            let li = e.bin("addi", &i, &stat_base, "i64");
            let lp = e.gep(&io.ws, 1, &li, "i64", "f32");
            e.line(&format!("llvm.store {l2}, {lp} {{alignment = 4 : i64}} : f32, !llvm.ptr<1>"));
        });
    }
    // Shared memory: K stages at 0 and one tile, V stages at two and three tiles. A tile is `bn`
    // padded rows (`mma.sync`), or with `wgmma` (head_dim 64, 128) `d / 64` blocks of `bn` keys'
    // 128-byte rows of 64 dims, chunk `c` of row `r` at `c ^ (r % 8)` (the forward's layout).
    let wg = uses_wgmma(d as u64);
    let smem = e.op("llvm.mlir.addressof @attb_smem : !llvm.ptr<3>");
    let k_off = lm_off(&mut e, &id.mi_hi, &id.mi_lo, &id.r8, st);
    let kt_off = lm_off(&mut e, &id.mi_lo, &id.mi_hi, &id.r8, st);
    let cpr = if wg { 8 } else { d / 8 };
    let crow = e.divk(&id.tid, cpr);
    let cch = e.remk(&id.tid, cpr);
    let cc8 = e.mulk(&cch, 8);
    let s_off = if wg {
        sw128_slot(&mut e, &crow, &cch)
    } else {
        let s_row = e.mulk(&crow, st);
        e.addi(&s_row, &cc8)
    };
    // Descriptors of the stage at element offset 0; a stage adds its offset / 8 (16-byte units).
    // K-major (S = Q K^T, dP = dO V^T: N = keys, K = dims) and MN-major (dQ += dS K: N = dims,
    // K = keys; `bn * 128` bytes between 64-dim blocks).
    let kmaj = sw128_descriptor(&mut e, &smem, 16, 1024);
    let mnmaj = sw128_descriptor(&mut e, &smem, bn * 128, 1024);
    let cc864 = e.ext64(&cc8);
    let g_off = e.row_offset(&crow, kv_row, &cc864, &kv_base);
    let k_g = e.gep(&io.k, 1, &g_off, "i64", "bf16");
    let v_g = e.gep(&io.v, 1, &g_off, "i64", "bf16");
    let tile = if wg { bn * d } else { bn * st };
    let load = |e: &mut Em, j: &str| {
        let stage = e.remk(j, 2);
        let kb = e.mulk(&stage, tile);
        let vb = e.addk(&kb, 2 * tile);
        let j64 = e.ext64(j);
        let tk = e.i64c(bn * kv_row);
        let off = e.bin("muli", &j64, &tk, "i64");
        let rows_per_iter = THREADS / cpr;
        for (src, base) in [(&k_g, &kb), (&v_g, &vb)] {
            let g0 = e.gep(src, 1, &off, "i64", "bf16");
            let so = e.addi(base, &s_off);
            let s0 = sptr(e, &smem, &so, "bf16");
            for it in 0..bn * d / 8 / THREADS {
                let (gk, sk) = if wg { sw128_copy(it, bn, kv_row) } else { (it * rows_per_iter * kv_row, it * rows_per_iter * st) };
                let gk = e.i64c(gk);
                let gp = e.gep(&g0, 1, &gk, "i64", "bf16");
                let sp = e.gepk(&s0, 3, sk);
                e.cp_async16(&sp, &gp);
            }
        }
    };
    let n_tiles = if p.causal {
        let m1 = e.addk(&mblk, 1);
        e.mulk(&m1, BM / bn)
    } else {
        e.i32c(p.s / bn)
    };
    let n_full = if p.causal { e.mulk(&mblk, BM / bn) } else { n_tiles.clone() };
    let c = e.f32c((p.scale * std::f64::consts::LOG2_E) as f32);
    let zero_i = e.i32c(0);
    load(&mut e, &zero_i);
    e.commit();
    let nt_d = (d / 8) as usize;
    let nk = (bn / 8) as usize;
    let tile_body = |e: &mut Em, j: &str, carried: &[String], masked: bool| -> Vec<String> {
        let mut dq = frags_of(carried);
        // Everyone is done with the stage tile j + 1 goes to; then tile j must have landed.
        e.barrier();
        let j1 = e.addk(j, 1);
        let has_next = e.op(&format!("arith.cmpi slt, {j1}, {n_tiles} : i32"));
        if_then(e, &has_next, |e| load(e, &j1));
        e.commit();
        e.wait_group(1);
        if wg {
            e.fence_proxy_async();
        }
        e.barrier();
        let stage = e.remk(j, 2);
        let kb = e.mulk(&stage, tile);
        let vb = e.addk(&kb, 2 * tile);
        let ko = e.addi(&kb, &k_off);
        let k_lm = sptr(e, &smem, &ko, "bf16");
        let vo = e.addi(&vb, &k_off);
        let v_lm = sptr(e, &smem, &vo, "bf16");
        let kto = e.addi(&kb, &kt_off);
        let kt_lm = sptr(e, &smem, &kto, "bf16");
        // S = Q K^T and dP = dO V^T: 16 rows x bn keys.
        let prod = |e: &mut Em, a: &[[String; 4]], lm: &str| -> Vec<[String; 4]> {
            let mut s = zeros(e, nk);
            for kstep in 0..d / 16 {
                for np in 0..bn / 16 {
                    let ptr = e.gepk(lm, 3, 16 * np * st + 16 * kstep);
                    let r = e.ldmatrix4(&ptr, false);
                    let n0 = (2 * np) as usize;
                    s[n0] = e.mma(&a[kstep as usize], [&r[0], &r[1]], &s[n0]);
                    s[n0 + 1] = e.mma(&a[kstep as usize], [&r[2], &r[3]], &s[n0 + 1]);
                }
            }
            s
        };
        let koffs = sw128_kmajor_steps(d, bn);
        let wprod = |e: &mut Em, a: &[[String; 4]], base: &str| -> Vec<[String; 4]> {
            let z = frag_names(&zeros(e, nk));
            frags_of(&wgmma_chain(e, bn as usize, &z, WgA::Regs(a), base, &koffs, false))
        };
        let s = if wg {
            let kd = sw128_desc_at(e, &kmaj, &kb);
            wprod(e, &qf, &kd)
        } else {
            prod(e, &qf, &k_lm)
        };
        let key_base = e.mulk(j, bn);
        let kb0 = e.addi(&key_base, &kcol);
        let mut pm: Vec<[String; 4]> = Vec::new();
        for (nt, t) in s.iter().enumerate() {
            let mut out: [String; 4] = Default::default();
            for (i, x) in t.iter().enumerate() {
                let y = e.fma(x, &c, &neg_lse[i / 2]);
                let mut pv = e.ex2(&y);
                if masked {
                    let key = e.addk(&kb0, nt as i64 * 8 + (i % 2) as i64);
                    let gt = e.op(&format!("arith.cmpi ugt, {key}, {} : i32", rows[i / 2]));
                    pv = e.op(&format!("arith.select {gt}, {zf}, {pv} : f32"));
                }
                out[i] = pv;
            }
            pm.push(out);
        }
        let dp = if wg {
            let vd = sw128_desc_at(e, &kmaj, &vb);
            wprod(e, &dof, &vd)
        } else {
            prod(e, &dof, &v_lm)
        };
        let ds: Vec<[String; 4]> = pm
            .iter()
            .zip(&dp)
            .map(|(pt, dt)| {
                [0, 1, 2, 3].map(|i| {
                    let x = e.fsub(&dt[i], &dsum[i / 2]);
                    e.fmul(&pt[i], &x)
                })
            })
            .collect();
        // dQ += dS K (wgmma: K MN-major, 16 keys = two 1 KB groups of rows per k-step).
        if wg {
            let a: Vec<[String; 4]> = (0..(bn / 16) as usize).map(|kk| to_a(e, &ds, kk)).collect();
            let kd = sw128_desc_at(e, &mnmaj, &kb);
            let offs = sw128_mnmajor_steps(bn);
            dq = frags_of(&wgmma_chain(e, d as usize, &frag_names(&dq), WgA::Regs(&a), &kd, &offs, true));
        }
        for kk in (0..(bn / 16) as usize).filter(|_| !wg) {
            let a = to_a(e, &ds, kk);
            for dd in 0..d / 16 {
                let ptr = e.gepk(&kt_lm, 3, 16 * kk as i64 * st + 16 * dd);
                let r = e.ldmatrix4(&ptr, true);
                let n0 = (2 * dd) as usize;
                dq[n0] = e.mma(&a, [&r[0], &r[1]], &dq[n0]);
                dq[n0 + 1] = e.mma(&a, [&r[2], &r[3]], &dq[n0 + 1]);
            }
        }
        frag_names(&dq)
    };
    let init = frag_names(&zeros(&mut e, nt_d));
    let mut res = for_f32(&mut e, &zero_i, &n_full, &init, |e, j, carried| tile_body(e, j, carried, false));
    if p.causal {
        res = for_f32(&mut e, &n_full, &n_tiles, &res, |e, j, carried| tile_body(e, j, carried, true));
    }
    let dq = frags_of(&res);
    let scale = e.f32c(p.scale as f32);
    let dqp = [row_ptr(&mut e, &io.dq, &rows[0]), row_ptr(&mut e, &io.dq, &rows[1])];
    for (n, t) in dq.iter().enumerate() {
        for r in 0..2 {
            let x0 = e.fmul(&t[2 * r], &scale);
            let x1 = e.fmul(&t[2 * r + 1], &scale);
            let pk = e.pack_bf16(&x0, &x1);
            let ptr = e.gepk(&dqp[r], 1, 8 * n as i64);
            e.line(&format!("llvm.store {pk}, {ptr} {{alignment = 4 : i64}} : i32, !llvm.ptr<1>"));
        }
    }
    e.body
}

/// The dK/dV pass: one CTA per 64-key tile of one (batch, kv head).
fn dkdv_body(p: &Problem, io: &Io) -> String {
    let mut e = Em::new();
    let d = p.d;
    let wg = uses_wgmma(d as u64);
    let st = row_elems(d);
    let grp = p.hq / p.hkv;
    let bm = BMQ;
    let nqt = p.s / bm;
    let qn = (bm / 8) as usize;
    let q_row = p.hq * d;
    let kv_row = p.hkv * d;
    let id = ids(&mut e);
    let tid = id.tid.clone();
    // Block -> (key tile j, batch, kv head); low j (the most causal work) first.
    let j = e.divk(&id.bid, p.b * p.hkv);
    let bk = e.remk(&id.bid, p.b * p.hkv);
    let bi = e.divk(&bk, p.hkv);
    let kh = e.remk(&bk, p.hkv);
    let kv0 = e.mulk(&j, BN);
    let bi64 = e.ext64(&bi);
    let kh64 = e.ext64(&kh);
    let d64 = e.i64c(d);
    let skv = e.i64c(p.s * p.hkv * d);
    let kvb = e.bin("muli", &bi64, &skv, "i64");
    let khd = e.bin("muli", &kh64, &d64, "i64");
    let kv_base = e.bin("addi", &kvb, &khd, "i64");
    let sq = e.i64c(p.s * p.hq * d);
    let q_bbase = e.bin("muli", &bi64, &sq, "i64");
    let smem = e.op("llvm.mlir.addressof @attb_smem : !llvm.ptr<3>");
    // Copies: `mma.sync`, chunk (tid / cpr, tid % cpr) of padded rows; `wgmma`, row tid / 8,
    // chunk tid % 8 of a 64-dim block of 128-byte swizzled rows (the forward's layout; K and V
    // blocks of 64 keys, Q and dO blocks of `bm` queries).
    let cpr = if wg { 8 } else { d / 8 };
    let rows_per_iter = THREADS / cpr;
    let crow = e.divk(&tid, cpr);
    let cch = e.remk(&tid, cpr);
    let cc8 = e.mulk(&cch, 8);
    let s_off = if wg {
        sw128_slot(&mut e, &crow, &cch)
    } else {
        let s_row = e.mulk(&crow, st);
        e.addi(&s_row, &cc8)
    };
    // (global, shared) element offsets of copy `it` of a tile of `rows` rows.
    let copy_at =
        |it: i64, rows: i64, grow: i64| -> (i64, i64) { if wg { sw128_copy(it, rows, grow) } else { (it * rows_per_iter * grow, it * rows_per_iter * st) } };
    let cc864 = e.ext64(&cc8);
    // K and V -> shared (cp.async, once; in the first stage's group).
    {
        let grow = e.addi(&kv0, &crow);
        let go = e.row_offset(&grow, kv_row, &cc864, &kv_base);
        for (src, base) in [(&io.k, 0), (&io.v, BN * st)] {
            let g0 = e.gep(src, 1, &go, "i64", "bf16");
            let so = e.addk(&s_off, base);
            let s0 = sptr(&mut e, &smem, &so, "bf16");
            for it in 0..BN * d / 8 / THREADS {
                let (gk, sk) = copy_at(it, BN, kv_row);
                let gk = e.i64c(gk);
                let gp = e.gep(&g0, 1, &gk, "i64", "bf16");
                let sp = e.gepk(&s0, 3, sk);
                e.cp_async16(&sp, &gp);
            }
        }
    }
    // The flattened (head of the group, query tile) sequence.
    let t_start = if p.causal { e.mulk(&j, BN / bm) } else { e.i32c(0) };
    let nqt_c = e.i32c(nqt);
    let ntile = e.bin("subi", &nqt_c, &t_start, "i32");
    let total = e.mulk(&ntile, grp);
    let kh_g = e.mulk(&kh, grp);
    let bh0 = e.mulk(&bi, p.hq);
    let stat_base = e.i64c(p.b * p.hq * p.s);
    let stage0 = 2 * BN * st;
    let se = stage_elems(d);
    // (query head, first query row) of sequence position f.
    let locate = |e: &mut Em, f: &str| -> (String, String) {
        let hh = e.bin("divui", f, &ntile, "i32");
        let tt = e.bin("remui", f, &ntile, "i32");
        let h = e.addi(&kh_g, &hh);
        let t = e.addi(&t_start, &tt);
        let q0 = e.mulk(&t, bm);
        (h, q0)
    };
    let load = |e: &mut Em, f: &str| {
        let (h, q0) = locate(e, f);
        let stage = e.remk(f, 2);
        let sb = e.mulk(&stage, se);
        let sb = e.addk(&sb, stage0);
        let h64 = e.ext64(&h);
        let hd = e.bin("muli", &h64, &d64, "i64");
        let q_base = e.bin("addi", &q_bbase, &hd, "i64");
        let grow = e.addi(&q0, &crow);
        let go = e.row_offset(&grow, q_row, &cc864, &q_base);
        for (src, off) in [(&io.q, 0), (&io.dout, bm * st)] {
            let g0 = e.gep(src, 1, &go, "i64", "bf16");
            let so = e.addk(&sb, off);
            let so = e.addi(&so, &s_off);
            let s0 = sptr(e, &smem, &so, "bf16");
            for it in 0..bm * d / 8 / THREADS {
                let (gk, sk) = copy_at(it, bm, q_row);
                let gk = e.i64c(gk);
                let gp = e.gep(&g0, 1, &gk, "i64", "bf16");
                let sp = e.gepk(&s0, 3, sk);
                e.cp_async16(&sp, &gp);
            }
        }
        // lse (log2 domain) and D of the tile's rows: bm / 4 16-byte chunks each.
        let chunks = bm / 4;
        let lim = e.i32c(2 * chunks);
        let copies = e.op(&format!("arith.cmpi ult, {tid}, {lim} : i32"));
        if_then(e, &copies, |e| {
            let which = e.divk(&tid, chunks);
            let ch = e.remk(&tid, chunks);
            let bh = e.addi(&bh0, &h);
            let bh64 = e.ext64(&bh);
            let s64 = e.i64c(p.s);
            let row0 = e.bin("muli", &bh64, &s64, "i64");
            let q064 = e.ext64(&q0);
            let row0 = e.bin("addi", &row0, &q064, "i64");
            let c4 = e.mulk(&ch, 4);
            let c464 = e.ext64(&c4);
            let row0 = e.bin("addi", &row0, &c464, "i64");
            // lse at stat_base + row (which = 0), D at row (which = 1).
            let w64 = e.ext64(&which);
            let is_d = e.bin("muli", &w64, &stat_base, "i64");
            let lse_off = e.bin("subi", &stat_base, &is_d, "i64");
            let go = e.bin("addi", &row0, &lse_off, "i64");
            let gp = e.gep(&io.ws, 1, &go, "i64", "f32");
            let sb2 = e.addk(&sb, 2 * bm * st);
            let sb_f = sptr(e, &smem, &sb2, "bf16");
            let wb = e.mulk(&which, bm);
            let fo = e.addi(&wb, &c4);
            let sp = sptr(e, &sb_f, &fo, "f32");
            e.cp_async16(&sp, &gp);
        });
    };
    let zero_i = e.i32c(0);
    load(&mut e, &zero_i);
    e.commit();
    // Per-lane ldmatrix offsets. A (K, V rows; row-major 16 rows): row = lane % 16 + 16 warp,
    // col = (lane / 16) * 8.
    let l16 = e.remk(&id.lane, 16);
    let lhi = e.divk(&id.lane, 16);
    let w16 = e.mulk(&id.warp, 16);
    let arow = e.addi(&l16, &w16);
    let a_r = e.mulk(&arow, st);
    let a_c = e.mulk(&lhi, 8);
    let a_off = e.addi(&a_r, &a_c);
    let k_a = sptr(&mut e, &smem, &a_off, "bf16");
    let vo = e.addk(&a_off, BN * st);
    let v_a = sptr(&mut e, &smem, &vo, "bf16");
    // B non-trans (Q, dO rows = queries) and B trans (rows = the k dim).
    let bn_off = lm_off(&mut e, &id.mi_hi, &id.mi_lo, &id.r8, st);
    let bt_off = lm_off(&mut e, &id.mi_lo, &id.mi_hi, &id.r8, st);
    let key0 = e.addi(&w16, &id.g);
    let key1 = e.addk(&key0, 8);
    let kcol = e.mulk(&id.tq, 2);
    let c = e.f32c((p.scale * std::f64::consts::LOG2_E) as f32);
    let zf = e.f32c(0.0);
    let nt_d = (d / 8) as usize;
    // wgmma descriptors at element offset 0 (an offset adds offset / 8 16-byte units): K-major
    // for K and V as A and Q, dO as B of S^T = K Q^T and dP^T = V dO^T; MN-major for Q and dO as
    // B of dV += P^T dO and dK += dS^T Q (64-dim blocks `bm * 128` bytes apart).
    let kmaj = sw128_descriptor(&mut e, &smem, 16, 1024);
    let mnmaj = sw128_descriptor(&mut e, &smem, bm * 128, 1024);
    let a_offs = sw128_kmajor_steps(d, BN);
    let b_offs = sw128_kmajor_steps(d, bm);
    let init = frag_names(&zeros(&mut e, 2 * nt_d));
    let res = for_f32(&mut e, &zero_i, &total, &init, |e, f, carried| {
        let (mut dk, mut dv) = (frags_of(&carried[..4 * nt_d]), frags_of(&carried[4 * nt_d..]));
        e.barrier();
        let f1 = e.addk(f, 1);
        let has_next = e.op(&format!("arith.cmpi slt, {f1}, {total} : i32"));
        if_then(e, &has_next, |e| load(e, &f1));
        e.commit();
        e.wait_group(1);
        if wg {
            e.fence_proxy_async();
        }
        e.barrier();
        let (_, q0) = locate(e, f);
        let stage = e.remk(f, 2);
        let sb = e.mulk(&stage, se);
        let sb = e.addk(&sb, stage0);
        let o = e.addi(&sb, &bn_off);
        let q_bn = sptr(e, &smem, &o, "bf16");
        let o = e.addk(&o, bm * st);
        let do_bn = sptr(e, &smem, &o, "bf16");
        let o = e.addi(&sb, &bt_off);
        let q_bt = sptr(e, &smem, &o, "bf16");
        let o = e.addk(&o, bm * st);
        let do_bt = sptr(e, &smem, &o, "bf16");
        let o = e.addk(&sb, 2 * bm * st);
        let stats = sptr(e, &smem, &o, "bf16");
        // S^T = K Q^T and dP^T = V dO^T: 16 keys x bm queries per warp.
        let prod = |e: &mut Em, a_lm: &str, b_lm: &str| -> Vec<[String; 4]> {
            let mut s = zeros(e, qn);
            for kstep in 0..d / 16 {
                let pa = e.gepk(a_lm, 3, 16 * kstep);
                let a = e.ldmatrix4(&pa, false);
                for np in 0..bm / 16 {
                    let pb = e.gepk(b_lm, 3, 16 * np * st + 16 * kstep);
                    let r = e.ldmatrix4(&pb, false);
                    let n0 = (2 * np) as usize;
                    s[n0] = e.mma(&a, [&r[0], &r[1]], &s[n0]);
                    s[n0 + 1] = e.mma(&a, [&r[2], &r[3]], &s[n0 + 1]);
                }
            }
            s
        };
        // wgmma: A (K or V rows) from shared memory, B the stage's Q or dO tile, both K-major.
        let wprod = |e: &mut Em, a_off: i64, b_off: &str| -> Vec<[String; 4]> {
            let z = frag_names(&zeros(e, qn));
            let ac = e.i32c(a_off);
            let ad = sw128_desc_at(e, &kmaj, &ac);
            let bd = sw128_desc_at(e, &kmaj, b_off);
            frags_of(&wgmma_chain(e, bm as usize, &z, WgA::Smem(&ad, &a_offs), &bd, &b_offs, false))
        };
        let q_tile = sb.clone();
        let do_tile = e.addk(&sb, bm * st);
        let s = if wg { wprod(e, 0, &q_tile) } else { prod(e, &k_a, &q_bn) };
        // The columns (queries) of the thread's fragments and their statistics.
        let cols: Vec<String> = (0..qn as i64).flat_map(|nt| [0, 1].map(|i| nt * 8 + i)).map(|k| e.addk(&kcol, k)).collect();
        let stat = |e: &mut Em, col: &str, which: i64| -> String {
            let o = e.addk(col, which * bm);
            let ptr = sptr(e, &stats, &o, "f32");
            e.op(&format!("llvm.load {ptr} {{alignment = 4 : i64}} : !llvm.ptr<3> -> f32"))
        };
        let neg_lse: Vec<String> = cols
            .iter()
            .map(|col| {
                let l = stat(e, col, 0);
                e.op(&format!("arith.negf {l} : f32"))
            })
            .collect();
        let ka = [e.addi(&kv0, &key0), e.addi(&kv0, &key1)];
        let mut pt: Vec<[String; 4]> = Vec::new();
        for (nt, tile) in s.iter().enumerate() {
            let mut out: [String; 4] = Default::default();
            for (i, x) in tile.iter().enumerate() {
                let k = nt * 2 + i % 2;
                let y = e.fma(x, &c, &neg_lse[k]);
                let mut pv = e.ex2(&y);
                if p.causal {
                    let qa = e.addi(&q0, &cols[k]);
                    let gt = e.op(&format!("arith.cmpi ugt, {}, {qa} : i32", ka[i / 2]));
                    pv = e.op(&format!("arith.select {gt}, {zf}, {pv} : f32"));
                }
                out[i] = pv;
            }
            pt.push(out);
        }
        let dpt = if wg { wprod(e, BN * st, &do_tile) } else { prod(e, &v_a, &do_bn) };
        let dcol: Vec<String> = cols.iter().map(|col| stat(e, col, 1)).collect();
        let dst: Vec<[String; 4]> = pt
            .iter()
            .zip(&dpt)
            .enumerate()
            .map(|(nt, (p4, d4))| {
                [0, 1, 2, 3].map(|i| {
                    let x = e.fsub(&d4[i], &dcol[nt * 2 + i % 2]);
                    e.fmul(&p4[i], &x)
                })
            })
            .collect();
        // dV += P^T dO, dK += dS^T Q (wgmma: B MN-major, 16 queries = two 1 KB row groups).
        if wg {
            let offs = sw128_mnmajor_steps(bm);
            for (src, tile, acc) in [(&pt, &do_tile, &mut dv), (&dst, &q_tile, &mut dk)] {
                let a: Vec<[String; 4]> = (0..(bm / 16) as usize).map(|kk| to_a(e, src, kk)).collect();
                let bd = sw128_desc_at(e, &mnmaj, tile);
                *acc = frags_of(&wgmma_chain(e, d as usize, &frag_names(acc), WgA::Regs(&a), &bd, &offs, true));
            }
        }
        for (src, b_lm, acc) in [(&pt, &do_bt, &mut dv), (&dst, &q_bt, &mut dk)].into_iter().filter(|_| !wg) {
            for kk in 0..(bm / 16) as usize {
                let a = to_a(e, src, kk);
                for dp in 0..d / 16 {
                    let pb = e.gepk(b_lm, 3, 16 * kk as i64 * st + 16 * dp);
                    let r = e.ldmatrix4(&pb, true);
                    let n0 = (2 * dp) as usize;
                    acc[n0] = e.mma(&a, [&r[0], &r[1]], &acc[n0]);
                    acc[n0 + 1] = e.mma(&a, [&r[2], &r[3]], &acc[n0 + 1]);
                }
            }
        }
        let mut next = frag_names(&dk);
        next.extend(frag_names(&dv));
        next
    });
    let (dk, dv) = (frags_of(&res[..4 * nt_d]), frags_of(&res[4 * nt_d..]));
    let scale = e.f32c(p.scale as f32);
    let kv_row_ptr = |e: &mut Em, base: &str, key: &str| -> String {
        let k = e.addi(&kv0, key);
        let k64 = e.ext64(&k);
        let rs = e.i64c(kv_row);
        let o = e.bin("muli", &k64, &rs, "i64");
        let o = e.bin("addi", &o, &kv_base, "i64");
        let c64 = e.ext64(&kcol);
        let o = e.bin("addi", &o, &c64, "i64");
        e.gep(base, 1, &o, "i64", "bf16")
    };
    let dkrow = [kv_row_ptr(&mut e, &io.dk, &key0), kv_row_ptr(&mut e, &io.dk, &key1)];
    let dvrow = [kv_row_ptr(&mut e, &io.dv, &key0), kv_row_ptr(&mut e, &io.dv, &key1)];
    for n in 0..nt_d {
        for r in 0..2usize {
            let x0 = e.fmul(&dk[n][2 * r], &scale);
            let x1 = e.fmul(&dk[n][2 * r + 1], &scale);
            let pk = e.pack_bf16(&x0, &x1);
            let ptr = e.gepk(&dkrow[r], 1, 8 * n as i64);
            e.line(&format!("llvm.store {pk}, {ptr} {{alignment = 4 : i64}} : i32, !llvm.ptr<1>"));
            let pv = e.pack_bf16(&dv[n][2 * r], &dv[n][2 * r + 1]);
            let ptr = e.gepk(&dvrow[r], 1, 8 * n as i64);
            e.line(&format!("llvm.store {pv}, {ptr} {{alignment = 4 : i64}} : i32, !llvm.ptr<1>"));
        }
    }
    e.body
}
