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
    Em, WgA, checked_sizes, ex2_ftz, for_each, if_map_f32, if_then, output_slots, q_frags, scf_for, sw128_copy, sw128_desc_at, sw128_descriptor,
    sw128_kmajor_steps, sw128_mnmajor_steps, sw128_slot, uses_wgmma, wgmma_chain,
};
use crate::values::Body;
use crate::warp_spec::{Copier, Ring, WS_LAUNCH_REGS, WS_THREADS, WgIndex, ws_split, ws_split_regs};
use crate::{GenResult, Generated, invalid, unsupported};

mod five;

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
    stage_elems_rows(d, BMQ)
}

/// [`stage_elems`] of a stage of `bm` query rows.
fn stage_elems_rows(d: i64, bm: i64) -> i64 {
    let n = 2 * bm * row_elems(d) + 4 * bm;
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
    if five::enabled(&p) {
        return Ok(generate_five(&p, &io, &params, entry));
    }
    let (ws, dq_ws) = uses_ws(&p);
    let (keys, threads) = if ws { (WS_KEYS, WS_THREADS) } else { (BN, THREADS) };
    let grid = ((p.s / keys) * p.b * p.hkv) as u32;
    let (queries, dq_threads) = if dq_ws { (WS_QUERIES, WS_THREADS) } else { (BM, THREADS) };
    let dq_grid = ((p.s / queries) * p.b * p.hq) as u32;
    let ws_regs = format!(", nvvm.maxnreg = {WS_LAUNCH_REGS} : i32");
    let (dkdv, regs) = if ws { (dkdv_ws_body(&p, &io), ws_regs.clone()) } else { (dkdv_body(&p, &io), String::new()) };
    let (dq, dq_regs) = if dq_ws { (dq_ws_body(&p, &io), ws_regs) } else { (dq_body(&p, &io), String::new()) };
    let funcs = [(format!("{entry}_dq"), dq_grid, dq_threads, dq_regs, dq), (entry.to_string(), grid, threads, regs, dkdv)];
    Ok(Generated {
        mlir: module_text(&params, &funcs),
        block: threads as u32,
        grid,
        shared_bytes: if ws { dkdv_ws_smem_bytes(p.d) } else { dkdv_smem_bytes(p.d) } as u32,
        prologue: Some(("_dq", dq_grid, dq_threads as u32, if dq_ws { dq_ws_smem_bytes(p.d) } else { dq_smem_bytes(p.d) } as u32)),
        epilogue: None,
        workspace_bytes: 2 * (p.b * p.hq * p.s) as u64 * 4,
        workspace_scratch: true,
        deterministic: true,
    })
}

/// The five-product backward's module: prep (prologue), the dK/dV/dQ pass, convert (epilogue).
fn generate_five(p: &Problem, io: &Io, params: &[String], entry: &str) -> Generated {
    let tiles = ((p.s / BM) * p.b * p.hq) as u32;
    let grid = ((p.s / WS_KEYS) * p.b * p.hkv) as u32;
    let ws_regs = format!(", nvvm.maxnreg = {WS_LAUNCH_REGS} : i32");
    let funcs = [
        (format!("{entry}_prep"), tiles, THREADS, String::new(), five::prep_body(p, io)),
        (entry.to_string(), grid, WS_THREADS, ws_regs, five::body(p, io)),
        (format!("{entry}_dqcvt"), tiles, THREADS, String::new(), five::convert_body(p, io)),
    ];
    Generated {
        mlir: module_text(params, &funcs),
        block: WS_THREADS as u32,
        grid,
        shared_bytes: five::smem_bytes(p.d) as u32,
        // The prologue's warps meet in 32 bytes of shared memory (the K and V maxima).
        prologue: Some(("_prep", tiles, THREADS as u32, 32)),
        epilogue: Some(("_dqcvt", tiles, THREADS as u32, 0)),
        // The statistics, the bounds, then the u32 dQ accumulator (zeroed by the prologue).
        workspace_bytes: five::workspace_bytes(p),
        workspace_scratch: true,
        deterministic: true,
    }
}

/// The module holding `funcs`: (name, grid, block, extra attributes, body).
fn module_text(params: &[String], funcs: &[(String, u32, i64, String, String)]) -> String {
    let mut m = String::new();
    m.push_str("module attributes {gpu.container_module} {\n  gpu.module @titan {\n");
    // 1024-byte aligned: the swizzled `wgmma` tiles repeat their pattern every 1 KB.
    m.push_str("    llvm.mlir.global external @attb_smem() {addr_space = 3 : i32, alignment = 1024 : i64} : !llvm.array<0 x i8>\n");
    let ps: Vec<String> = params.iter().map(|p| format!("{p}: !llvm.ptr<1>")).collect();
    for (name, grid, block, attrs, body) in funcs {
        let _ = writeln!(
            m,
            "    gpu.func @{name}({}) kernel attributes {{known_block_size = array<i32: {block}, 1, 1>, known_grid_size = array<i32: {grid}, 1, 1>{attrs}}} {{",
            ps.join(", ")
        );
        m.push_str(body);
        m.push_str("      gpu.return\n    }\n");
    }
    m.push_str("  }\n}\n");
    m
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

/// What a warp of the dQ pass holds before its key loop: its two query rows (absolute) and
/// column pair, the (batch, head) bases, Q and dO as register A fragments, `D = rowsum(dO o O)`
/// and `-lse log2 e` of the rows (both also written to the workspace for the dK/dV pass).
struct DqRows {
    rows: [String; 2],
    kcol: String,
    q_base: String,
    kv_base: String,
    qf: Vec<[String; 4]>,
    dof: Vec<[String; 4]>,
    dsum: [String; 2],
    neg_lse: [String; 2],
}

/// [`DqRows`] of the warp `warp` (0..4) of a warpgroup whose 64 query rows start at `row_base`,
/// for `(batch, query head)` index `bhi`; `g`, `tq` are the lane's fragment row and column pair.
#[allow(clippy::too_many_arguments)]
fn dq_rows(e: &mut Em, p: &Problem, io: &Io, warp: &str, g: &str, tq: &str, row_base: &str, bhi: &str) -> DqRows {
    let d = p.d;
    let (q_base, kv_base) = head_bases(e, p, bhi);
    let w16 = e.mulk(warp, 16);
    let qr0 = e.addi(&w16, g);
    let row0 = e.addi(row_base, &qr0);
    let row1 = e.addk(&row0, 8);
    let rows = [row0, row1];
    let kcol = e.mulk(tq, 2);
    let mut r = DqRows { rows, kcol, q_base, kv_base, qf: Vec::new(), dof: Vec::new(), dsum: Default::default(), neg_lse: Default::default() };
    // A fragments of a [rows, d] bf16 tensor straight from global memory.
    let frags = |e: &mut Em, r: &DqRows, base: &str| -> Vec<[String; 4]> {
        let rp = [dq_row_ptr(e, p, r, base, &r.rows[0]), dq_row_ptr(e, p, r, base, &r.rows[1])];
        q_frags(e, &rp, d)
    };
    r.qf = frags(e, &r, &io.q);
    r.dof = frags(e, &r, &io.dout);
    // D = rowsum(dO o O) for the two rows: fragments of O in the same layout, then the quad.
    let zf = e.f32c(0.0);
    let mut dsum = [zf.clone(), zf.clone()];
    {
        let of = frags(e, &r, &io.o);
        for (a, b) in r.dof.iter().zip(&of) {
            for i in 0..4 {
                let x = unpack_bf16(e, &a[i]);
                let y = unpack_bf16(e, &b[i]);
                for k in 0..2 {
                    dsum[i % 2] = e.fma(&x[k], &y[k], &dsum[i % 2]);
                }
            }
        }
        for s in dsum.iter_mut() {
            for off in [1, 2] {
                let o = e.shfl_xor(s, off);
                *s = e.fadd(s, &o);
            }
        }
    }
    // lse (log2 domain) of the rows; both statistics go to the workspace for the dK/dV pass.
    let log2e = e.f32c(std::f32::consts::LOG2_E);
    let bh64 = e.ext64(bhi);
    let s64 = e.i64c(p.s);
    let bhs = e.bin("muli", &bh64, &s64, "i64");
    let stat_base = e.i64c(p.b * p.hq * p.s);
    let mut neg_lse: [String; 2] = Default::default();
    for (k, row) in r.rows.iter().enumerate() {
        let r64 = e.ext64(row);
        let i = e.bin("addi", &bhs, &r64, "i64");
        let lp = e.gep(&io.lse, 1, &i, "i64", "f32");
        let l = e.op(&format!("llvm.load {lp} {{alignment = 4 : i64}} : !llvm.ptr<1> -> f32"));
        let l2 = e.fmul(&l, &log2e);
        neg_lse[k] = e.op(&format!("arith.negf {l2} : f32"));
        let zero_i = e.i32c(0);
        let first = e.op(&format!("arith.cmpi eq, {tq}, {zero_i} : i32"));
        let dsr = dsum[k].clone();
        if_then(e, &first, |e| {
            let dp = e.gep(&io.ws, 1, &i, "i64", "f32");
            e.line(&format!("llvm.store {dsr}, {dp} {{alignment = 4 : i64}} : f32, !llvm.ptr<1>"));
            let li = e.bin("addi", &i, &stat_base, "i64");
            let lp = e.gep(&io.ws, 1, &li, "i64", "f32");
            e.line(&format!("llvm.store {l2}, {lp} {{alignment = 4 : i64}} : f32, !llvm.ptr<1>"));
        });
    }
    r.dsum = dsum;
    r.neg_lse = neg_lse;
    r
}

/// Element bases of `(batch, query head)` index `bhi`'s Q rows and of its kv head's K/V rows.
fn head_bases(e: &mut Em, p: &Problem, bhi: &str) -> (String, String) {
    let d = p.d;
    let bi = e.divk(bhi, p.hq);
    let h = e.remk(bhi, p.hq);
    let kh = e.divk(&h, p.hq / p.hkv);
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
    (q_base, e.bin("addi", &kvb, &khd, "i64"))
}

/// Pointer to the thread's column pair of query row `row` of the `[b, s, hq, d]` tensor `base`.
fn dq_row_ptr(e: &mut Em, p: &Problem, r: &DqRows, base: &str, row: &str) -> String {
    let r64 = e.ext64(row);
    let rs = e.i64c(p.hq * p.d);
    let ro = e.bin("muli", &r64, &rs, "i64");
    let o = e.bin("addi", &r.q_base, &ro, "i64");
    let k64 = e.ext64(&r.kcol);
    let o = e.bin("addi", &o, &k64, "i64");
    e.gep(base, 1, &o, "i64", "bf16")
}

/// dQ (scaled) as bf16 into the thread's rows.
fn dq_store(e: &mut Em, p: &Problem, io: &Io, r: &DqRows, dq: &[[String; 4]]) {
    let scale = e.f32c(p.scale as f32);
    let dqp = [dq_row_ptr(e, p, r, &io.dq, &r.rows[0]), dq_row_ptr(e, p, r, &io.dq, &r.rows[1])];
    store_rows(e, &dqp, dq, Some(&scale));
}

/// Accumulator fragments (`mma.sync` C layout: n-tile `n` at columns `8 n ..` of the thread's
/// two rows) as bf16 pairs at the two row pointers, times `scale` if given.
fn store_rows(e: &mut Em, rowp: &[String; 2], t: &[[String; 4]], scale: Option<&str>) {
    for (n, f) in t.iter().enumerate() {
        for (k, row) in rowp.iter().enumerate() {
            let (x0, x1) = match scale {
                Some(sc) => (e.fmul(&f[2 * k], sc), e.fmul(&f[2 * k + 1], sc)),
                None => (f[2 * k].clone(), f[2 * k + 1].clone()),
            };
            let pk = e.pack_bf16(&x0, &x1);
            let ptr = e.gepk(row, 1, 8 * n as i64);
            e.line(&format!("llvm.store {pk}, {ptr} {{alignment = 4 : i64}} : i32, !llvm.ptr<1>"));
        }
    }
}

/// The shared-memory side of a dQ tile: the `ldmatrix` lane offsets (`mma.sync`) and the
/// `wgmma` descriptors at element offset 0 (K-major for `S = Q K^T` and `dP = dO V^T`, MN-major
/// for `dQ += dS K`: `bn * 128` bytes between 64-dim blocks).
struct DqSmem {
    /// Keys of a tile.
    bn: i64,
    smem: String,
    k_off: String,
    kt_off: String,
    kmaj: String,
    mnmaj: String,
}

/// One key tile `j` of the dQ pass, its K and V at shared element offsets `kb` and `vb`: `S =
/// Q K^T`, `P = exp2(S scale log2 e - lse log2 e)` (0 above the diagonal when `masked`), `dP = dO
/// V^T`, `dS = P o (dP - D)`, `dQ += dS K`. At head_dim 64 and 128 the three products run on
/// `wgmma`, at 16 on `ldmatrix` fragments and `mma.sync`.
#[allow(clippy::too_many_arguments)]
fn dq_tile(e: &mut Em, p: &Problem, r: &DqRows, sm: &DqSmem, kb: &str, vb: &str, j: &str, mut dq: Vec<[String; 4]>, masked: bool) -> Vec<[String; 4]> {
    let d = p.d;
    let st = d + 8;
    let bn = sm.bn;
    let wg = uses_wgmma(d as u64);
    let nk = (bn / 8) as usize;
    let c = e.f32c((p.scale * std::f64::consts::LOG2_E) as f32);
    let zf = e.f32c(0.0);
    let ko = e.addi(kb, &sm.k_off);
    let k_lm = sptr(e, &sm.smem, &ko, "bf16");
    let vo = e.addi(vb, &sm.k_off);
    let v_lm = sptr(e, &sm.smem, &vo, "bf16");
    let kto = e.addi(kb, &sm.kt_off);
    let kt_lm = sptr(e, &sm.smem, &kto, "bf16");
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
        let kd = sw128_desc_at(e, &sm.kmaj, kb);
        wprod(e, &r.qf, &kd)
    } else {
        prod(e, &r.qf, &k_lm)
    };
    let key_base = e.mulk(j, bn);
    let kb0 = e.addi(&key_base, &r.kcol);
    let mut pm: Vec<[String; 4]> = Vec::new();
    for (nt, t) in s.iter().enumerate() {
        let mut out: [String; 4] = Default::default();
        for (i, x) in t.iter().enumerate() {
            let y = e.fma(x, &c, &r.neg_lse[i / 2]);
            let mut pv = e.ex2(&y, ex2_ftz(crate::switches::Switch::AttBwdEx2));
            if masked {
                let key = e.addk(&kb0, nt as i64 * 8 + (i % 2) as i64);
                let gt = e.op(&format!("arith.cmpi ugt, {key}, {} : i32", r.rows[i / 2]));
                pv = e.op(&format!("arith.select {gt}, {zf}, {pv} : f32"));
            }
            out[i] = pv;
        }
        pm.push(out);
    }
    let dp = if wg {
        let vd = sw128_desc_at(e, &sm.kmaj, vb);
        wprod(e, &r.dof, &vd)
    } else {
        prod(e, &r.dof, &v_lm)
    };
    let ds: Vec<[String; 4]> = pm
        .iter()
        .zip(&dp)
        .map(|(pt, dt)| {
            [0, 1, 2, 3].map(|i| {
                let x = e.fsub(&dt[i], &r.dsum[i / 2]);
                e.fmul(&pt[i], &x)
            })
        })
        .collect();
    // dQ += dS K (wgmma: K MN-major, 16 keys = two 1 KB groups of rows per k-step).
    if wg {
        let a: Vec<[String; 4]> = (0..(bn / 16) as usize).map(|kk| to_a(e, &ds, kk)).collect();
        let kd = sw128_desc_at(e, &sm.mnmaj, kb);
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
    dq
}

/// The dQ pass: one CTA per 64-query tile of one (batch, query head).
fn dq_body(p: &Problem, io: &Io) -> String {
    let mut e = Em::new();
    let d = p.d;
    let st = d + 8;
    let bn = BNK;
    let nm = p.s / BM;
    let bh = p.b * p.hq;
    let kv_row = p.hkv * d;
    let id = ids(&mut e);
    // Longest causal tiles first: block -> (query tile, batch * head).
    let mb_rev = e.divk(&id.bid, bh);
    let nm1 = e.i32c(nm - 1);
    let mblk = e.bin("subi", &nm1, &mb_rev, "i32");
    let bhi = e.remk(&id.bid, bh);
    let m64 = e.mulk(&mblk, BM);
    let r = dq_rows(&mut e, p, io, &id.warp, &id.g, &id.tq, &m64, &bhi);
    // Shared memory: K stages at 0 and one tile, V stages at two and three tiles. A tile is `bn`
    // padded rows (`mma.sync`), or with `wgmma` (head_dim 64, 128) `d / 64` blocks of `bn` keys'
    // 128-byte rows of 64 dims, chunk `c` of row `r` at `c ^ (r % 8)` (the forward's layout).
    let wg = uses_wgmma(d as u64);
    let smem = e.op("llvm.mlir.addressof @attb_smem : !llvm.ptr<3>");
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
    let sm = DqSmem {
        bn,
        k_off: lm_off(&mut e, &id.mi_hi, &id.mi_lo, &id.r8, st),
        kt_off: lm_off(&mut e, &id.mi_lo, &id.mi_hi, &id.r8, st),
        kmaj: sw128_descriptor(&mut e, &smem, 16, 1024),
        mnmaj: sw128_descriptor(&mut e, &smem, bn * 128, 1024),
        smem: smem.clone(),
    };
    let cc864 = e.ext64(&cc8);
    let g_off = e.row_offset(&crow, kv_row, &cc864, &r.kv_base);
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
    let zero_i = e.i32c(0);
    load(&mut e, &zero_i);
    e.commit();
    let nt_d = (d / 8) as usize;
    let tile_body = |e: &mut Em, j: &str, carried: &[String], masked: bool| -> Vec<String> {
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
        frag_names(&dq_tile(e, p, &r, &sm, &kb, &vb, j, frags_of(carried), masked))
    };
    let init = frag_names(&zeros(&mut e, nt_d));
    let mut res = for_f32(&mut e, &zero_i, &n_full, &init, |e, j, carried| tile_body(e, j, carried, false));
    if p.causal {
        res = for_f32(&mut e, &n_full, &n_tiles, &res, |e, j, carried| tile_body(e, j, carried, true));
    }
    dq_store(&mut e, p, io, &r, &frags_of(&res));
    e.body
}

/// `cp.async` of a (Q, dO) stage's statistics: per-row f32 arrays of the workspace (element
/// offsets `bases`, each `b hq s` long; [`stats_bases`]: `lse log2 e` then `D`, as the dQ pass
/// wrote them) for the stage's `bm` query rows, into the stage at element `sb + at`, one after the
/// other, `bm / 4` 16-byte chunks each, by the copying threads `t < bases.len() bm / 4`.
#[allow(clippy::too_many_arguments)]
fn copy_stats(e: &mut Em, p: &Problem, io: &Io, smem: &str, t: &str, bh0: &str, h: &str, q0: &str, sb: &str, at: i64, bm: i64, bases: &[i64]) {
    let chunks = bm / 4;
    let lim = e.i32c(bases.len() as i64 * chunks);
    let copies = e.op(&format!("arith.cmpi ult, {t}, {lim} : i32"));
    if_then(e, &copies, |e| {
        let which = e.divk(t, chunks);
        let ch = e.remk(t, chunks);
        let bh = e.addi(bh0, h);
        let bh64 = e.ext64(&bh);
        let s64 = e.i64c(p.s);
        let row0 = e.bin("muli", &bh64, &s64, "i64");
        let q064 = e.ext64(q0);
        let row0 = e.bin("addi", &row0, &q064, "i64");
        let c4 = e.mulk(&ch, 4);
        let c464 = e.ext64(&c4);
        let row0 = e.bin("addi", &row0, &c464, "i64");
        // The array `which` copies: a select chain over the (few) bases.
        let mut base = e.i64c(bases[0]);
        for (i, b) in bases.iter().enumerate().skip(1) {
            let ic = e.i32c(i as i64);
            let is = e.op(&format!("arith.cmpi eq, {which}, {ic} : i32"));
            let bc = e.i64c(*b);
            base = e.op(&format!("arith.select {is}, {bc}, {base} : i64"));
        }
        let go = e.bin("addi", &row0, &base, "i64");
        let gp = e.gep(&io.ws, 1, &go, "i64", "f32");
        let sb2 = e.addk(sb, at);
        let sb_f = sptr(e, smem, &sb2, "bf16");
        let wb = e.mulk(&which, bm);
        let fo = e.addi(&wb, &c4);
        let sp = sptr(e, &sb_f, &fo, "f32");
        e.cp_async16(&sp, &gp);
    });
}

/// The workspace arrays [`copy_stats`] stages for the dK/dV passes: `lse log2 e` (at `b hq s`)
/// then `D` (at 0).
fn stats_bases(p: &Problem) -> [i64; 2] {
    [p.b * p.hq * p.s, 0]
}

/// What a dK/dV tile's elementwise steps need: the thread's query columns of the stage (`cols`,
/// both of each n-tile), the stage's statistics (`stats`: lse then D, `bm` f32 each), the
/// tile's first query row `q0`, the thread's two keys (absolute) and `scale log2 e`.
struct DkdvCols<'a> {
    cols: &'a [String],
    stats: &'a str,
    q0: &'a str,
    keys: &'a [String; 2],
    /// The warp's last key (absolute): a tile whose first query row is at or past it has no key
    /// past any of its queries, so it is not masked.
    last_key: &'a str,
    c: &'a str,
    bm: i64,
}

/// Whether the causal dK/dV passes mask only the tiles that cross the diagonal (a warp-uniform
/// branch) instead of every tile (`TITAN_ATT_BWD_MASK=all` at build time, for comparisons).
fn mask_diagonal_only() -> bool {
    crate::switches::var(crate::switches::Switch::AttBwdMask).as_deref() == Some("diag")
}

impl DkdvCols<'_> {
    fn stat(&self, e: &mut Em, col: &str, which: i64) -> String {
        let o = e.addk(col, which * self.bm);
        let ptr = sptr(e, self.stats, &o, "f32");
        e.op(&format!("llvm.load {ptr} {{alignment = 4 : i64}} : !llvm.ptr<3> -> f32"))
    }

    /// `P^T = exp2(S^T scale log2 e - lse log2 e)`, 0 where the key is past the query (causal).
    fn p_t(&self, e: &mut Em, causal: bool, s_t: &[[String; 4]]) -> Vec<[String; 4]> {
        let neg_lse: Vec<String> = self
            .cols
            .iter()
            .map(|col| {
                let l = self.stat(e, col, 0);
                e.op(&format!("arith.negf {l} : f32"))
            })
            .collect();
        let ftz = ex2_ftz(crate::switches::Switch::AttBwdEx2);
        // Every tile masked right after its exponentials, or (diagonal only) after all of them,
        // in a branch taken by the tiles that cross the diagonal.
        let each = causal && !mask_diagonal_only();
        let zf = e.f32c(0.0);
        // 0 where the key is past the query: element i of n-tile nt.
        let mask = |e: &mut Em, nt: usize, i: usize, pv: &str| -> String {
            let qa = e.addi(self.q0, &self.cols[nt * 2 + i % 2]);
            let gt = e.op(&format!("arith.cmpi ugt, {}, {qa} : i32", self.keys[i / 2]));
            e.op(&format!("arith.select {gt}, {zf}, {pv} : f32"))
        };
        let mut pt: Vec<String> = Vec::new();
        for (nt, tile) in s_t.iter().enumerate() {
            for (i, x) in tile.iter().enumerate() {
                let y = e.fma(x, self.c, &neg_lse[nt * 2 + i % 2]);
                let pv = e.ex2(&y, ftz);
                pt.push(if each { mask(e, nt, i, &pv) } else { pv });
            }
        }
        if causal && !each {
            let crosses = e.op(&format!("arith.cmpi ugt, {}, {} : i32", self.last_key, self.q0));
            pt = if_map_f32(e, &crosses, &pt, |e| pt.iter().enumerate().map(|(n, pv)| mask(e, n / 4, n % 4, pv)).collect());
        }
        frags_of(&pt)
    }

    /// `dS^T = P^T o (dP^T - D)`.
    fn ds_t(&self, e: &mut Em, pt: &[[String; 4]], dpt: &[[String; 4]]) -> Vec<[String; 4]> {
        let dcol: Vec<String> = self.cols.iter().map(|col| self.stat(e, col, 1)).collect();
        pt.iter()
            .zip(dpt)
            .enumerate()
            .map(|(nt, (p4, d4))| {
                [0, 1, 2, 3].map(|i| {
                    let x = e.fsub(&d4[i], &dcol[nt * 2 + i % 2]);
                    e.fmul(&p4[i], &x)
                })
            })
            .collect()
    }
}

/// `dV += P^T dO`, `dK += dS^T Q` on `wgmma`: P^T and dS^T as register A fragments, dO and Q
/// of the stage (element offsets `do_tile`, `q_tile`) MN-major through `mnmaj` (16 queries =
/// two 1 KB row groups a k-step).
#[allow(clippy::too_many_arguments)]
fn dkdv_update_wgmma(
    e: &mut Em,
    d: i64,
    bm: i64,
    mnmaj: &str,
    pt: &[[String; 4]],
    dst: &[[String; 4]],
    do_tile: &str,
    q_tile: &str,
    dk: &mut Vec<[String; 4]>,
    dv: &mut Vec<[String; 4]>,
) {
    let offs = sw128_mnmajor_steps(bm);
    for (src, tile, acc) in [(pt, do_tile, dv), (dst, q_tile, dk)] {
        let a: Vec<[String; 4]> = (0..(bm / 16) as usize).map(|kk| to_a(e, src, kk)).collect();
        let bd = sw128_desc_at(e, mnmaj, tile);
        *acc = frags_of(&wgmma_chain(e, d as usize, &frag_names(acc), WgA::Regs(&a), &bd, &offs, true));
    }
}

/// dK (scaled) and dV as bf16 into the thread's two key rows `base_key + key0`, `base_key +
/// key1` of the `[b, s, hkv, d]` gradients, column pair `kcol`.
#[allow(clippy::too_many_arguments)]
fn store_dkdv(e: &mut Em, p: &Problem, io: &Io, kv_base: &str, base_key: &str, keys: [&str; 2], kcol: &str, dk: &[[String; 4]], dv: &[[String; 4]]) {
    let scale = e.f32c(p.scale as f32);
    let kv_row = p.hkv * p.d;
    let kv_row_ptr = |e: &mut Em, base: &str, key: &str| -> String {
        let k = e.addi(base_key, key);
        let k64 = e.ext64(&k);
        let rs = e.i64c(kv_row);
        let o = e.bin("muli", &k64, &rs, "i64");
        let o = e.bin("addi", &o, kv_base, "i64");
        let c64 = e.ext64(kcol);
        let o = e.bin("addi", &o, &c64, "i64");
        e.gep(base, 1, &o, "i64", "bf16")
    };
    let dkrow = [kv_row_ptr(e, &io.dk, keys[0]), kv_row_ptr(e, &io.dk, keys[1])];
    let dvrow = [kv_row_ptr(e, &io.dv, keys[0]), kv_row_ptr(e, &io.dv, keys[1])];
    store_rows(e, &dkrow, dk, Some(&scale));
    store_rows(e, &dvrow, dv, None);
}

/// A dK/dV CTA's key tile: block -> (key tile `j` of `keys` keys, batch `bi`, kv head `kh`),
/// low j (the most causal work) first; its first key `kv0` and the element bases of its K/V
/// head and of its batch's Q.
struct KeyTile {
    /// The pass's work order: [`Order::of`].
    order: Order,
    j: String,
    bi: String,
    kh: String,
    kv0: String,
    kv_base: String,
    q_bbase: String,
}

fn key_tile(e: &mut Em, p: &Problem, bid: &str, keys: i64) -> KeyTile {
    let d = p.d;
    // Bands of `g` (batch, kv head)s, each band's CTAs key tile first (the longest causal walks
    // first): [`Order::of`].
    let nbk = p.b * p.hkv;
    let order = Order::of(p, keys);
    let g = order.band;
    let (j, bk) = if g == nbk {
        (e.divk(bid, nbk), e.remk(bid, nbk))
    } else {
        // `per_band` is a multiple of `g`: the kv head within the band is `bid % g`.
        let per_band = g * (p.s / keys);
        let r = e.remk(bid, per_band);
        let j = e.divk(&r, g);
        let band = e.divk(bid, per_band);
        let b0 = e.mulk(&band, g);
        let k = e.remk(bid, g);
        (j, e.addi(&b0, &k))
    };
    let bi = e.divk(&bk, p.hkv);
    let kh = e.remk(&bk, p.hkv);
    let kv0 = e.mulk(&j, keys);
    let bi64 = e.ext64(&bi);
    let kh64 = e.ext64(&kh);
    let d64 = e.i64c(d);
    let skv = e.i64c(p.s * p.hkv * d);
    let kvb = e.bin("muli", &bi64, &skv, "i64");
    let khd = e.bin("muli", &kh64, &d64, "i64");
    let kv_base = e.bin("addi", &kvb, &khd, "i64");
    let sq = e.i64c(p.s * p.hq * d);
    let q_bbase = e.bin("muli", &bi64, &sq, "i64");
    KeyTile { order, j, bi, kh, kv0, kv_base, q_bbase }
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
    let KeyTile { order, j, bi, kh, kv0, kv_base, q_bbase } = key_tile(&mut e, p, &id.bid, BN);
    let d64 = e.i64c(d);
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
    let stage0 = 2 * BN * st;
    let se = stage_elems(d);
    // (query head, first query row) of sequence position f.
    let locate = |e: &mut Em, f: &str| -> (String, String) {
        let (h, t) = walk(e, &order, f, &ntile, &t_start, nqt, grp, &|e, hh| e.addi(&kh_g, hh));
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
        copy_stats(e, p, io, &smem, &tid, &bh0, &h, &q0, &sb, 2 * bm * st, bm, &stats_bases(p));
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
        let ka = [e.addi(&kv0, &key0), e.addi(&kv0, &key1)];
        let w_last = e.addi(&kv0, &w16);
        let w_last = e.addk(&w_last, 15);
        let cx = DkdvCols { cols: &cols, stats: &stats, q0: &q0, keys: &ka, last_key: &w_last, c: &c, bm };
        let pt = cx.p_t(e, p.causal, &s);
        let dpt = if wg { wprod(e, BN * st, &do_tile) } else { prod(e, &v_a, &do_bn) };
        let dst = cx.ds_t(e, &pt, &dpt);
        if wg {
            dkdv_update_wgmma(e, d, bm, &mnmaj, &pt, &dst, &do_tile, &q_tile, &mut dk, &mut dv);
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
    store_dkdv(&mut e, p, io, &kv_base, &kv0, [&key0, &key1], &kcol, &dk, &dv);
    e.body
}

/// Keys per CTA of the warp-specialized dK/dV pass: two consumer warpgroups of 64 keys each
/// share every (Q, dO, lse, D) stage, so a stage is read from L2 once per 128 keys.
const WS_KEYS: i64 = 128;

/// Stages in flight: 4 at head_dim 64, 3 at 128 (dK/dV: 33 KB each at both; dQ: 32 KB).
fn ws_stages(d: i64) -> i64 {
    if d == 64 { 4 } else { 3 }
}

/// Rows of a stage of the warp-specialized passes (query rows of a dK/dV stage, keys of a dQ
/// stage): 128 at head_dim 64, so each consumer's `wgmma` chains run at N = 128 with the
/// registers 240 leave, 64 at head_dim 128.
fn ws_rows(d: i64) -> i64 {
    if d == 64 { 128 } else { 64 }
}

/// Which passes are warp-specialized, (dK/dV, dQ): only `wgmma` head dims with whole 128-row
/// tiles can be. By default both at head_dim 128, and at head_dim 64 (128-row stages) from
/// sequence 8192 on, where they ran 7.7% faster alone and the 1B step 1.5-2% faster; at 2048
/// and 4096 they ran 8.5% and 3.5% slower (docs/performance.md, sessions 19 and 20).
/// `TITAN_ATT_BWD_WS` at build time overrides, for comparisons: `0` neither, `dkdv` the dK/dV
/// pass alone, `all` both.
fn uses_ws(p: &Problem) -> (bool, bool) {
    if !uses_wgmma(p.d as u64) || p.s % WS_KEYS != 0 {
        return (false, false);
    }
    match crate::switches::var(crate::switches::Switch::AttBwdWs).as_deref() {
        Some("0") => (false, false),
        Some("dkdv") => (true, false),
        Some("all") => (true, true),
        _ => {
            let ws = p.d == 128 || p.s >= 8192;
            (ws, ws)
        }
    }
}

/// Dynamic shared memory of the warp-specialized pass: K and V (128 keys), the stages, then a
/// full and an empty `mbarrier` (8 bytes) per stage.
fn dkdv_ws_smem_bytes(d: i64) -> i64 {
    2 * (2 * WS_KEYS * d + ws_stages(d) * stage_elems_rows(d, ws_rows(d))) + 16 * ws_stages(d)
}

/// The dK/dV pass, warp-specialized (FA3's producer/consumer structure): one CTA per 128-key
/// tile of one (batch, kv head). Warpgroups 0 and 1 compute the keys `64 w ..` of the tile as the
/// single-warpgroup pass does, warpgroup 2 copies: K and V once, then each (Q, dO, lse, D) stage
/// of the flattened (query head, query tile) sequence into a ring of `ws_stages` slots. Per slot
/// two `mbarrier`s: `full` (128 producer arrivals: the producer waits for its `cp.async` group,
/// fences the async proxy, arrives) and `empty` (256 consumer arrivals after the slot's last
/// `wgmma`). Tile `f` uses slot `f % n` in round `r = f / n`: consumers wait for `full`'s phase
/// of parity `r & 1`, the producer for `empty`'s of parity `(r & 1) ^ 1` (round 0 passes at
/// once). No CTA-wide barrier after the split, so the two consumers drift apart and one's
/// softmax overlaps the other's `wgmma`. `setmaxnreg` gives the consumers 240 registers, the
/// producer 24. Deterministic as the single-warpgroup pass: each warpgroup owns its dK and dV.
fn dkdv_ws_body(p: &Problem, io: &Io) -> String {
    let mut e = Em::new();
    let d = p.d;
    let bm = ws_rows(d);
    let nst = ws_stages(d);
    let bar0 = 2 * (2 * WS_KEYS * d + nst * stage_elems_rows(d, bm));
    let id = ids(&mut e);
    let tid = id.tid.clone();
    let seq = QuerySeq::new(&mut e, p, &id.bid, bm);
    let ring = Ring::new(&mut e, &seq.smem, bar0, nst, &tid);
    // The copier at 24 registers spilled 8 bytes at head_dim 128 with Llama-3 8B's heads (seq
    // 2048-4096; not at the seq 512 test shapes); at 32 neither side spills (five.rs's split).
    // Not timed on a GPU: the same instructions, the spill gone (session 26).
    ws_split_regs(
        &mut e,
        &tid,
        (232, 32),
        WgIndex::Broadcast,
        |e, cp| {
            seq.copy_kv(e, p, io, cp);
            // Tile 0 (with K and V) as the first group; then tile f's copies are issued before
            // tile f - 1's are waited for and published.
            ring.produce(e, &seq.total, &|e, f| seq.load(e, p, io, cp, &ring, f));
        },
        |e, wgi| {
            let cx = WsCx { wgi, kv0: &seq.kt.kv0, kv_base: &seq.kt.kv_base, smem: &seq.smem, total: &seq.total, ring: &ring, bm };
            dkdv_ws_consumer(e, p, io, &cx, &|e, f| seq.locate(e, f), &|_, _, _, _| {});
        },
    );
    e.body
}

/// A warp-specialized dK/dV CTA's work: its 128-key tile and the flattened (head of the group,
/// query tile of `bm` rows) sequence it loops over, from the lower warpgroup's diagonal when
/// causal; K and V at shared element 0 and `128 d`, the (Q, dO, lse, D) stages after them.
struct QuerySeq {
    kt: KeyTile,
    smem: String,
    bm: i64,
    t_start: String,
    ntile: String,
    /// Query tiles of `bm` rows in the sequence.
    nqt: i64,
    /// Query heads of the GQA group.
    grp: i64,
    total: String,
    kh_g: String,
    bh0: String,
    /// The per-row workspace arrays staged with each tile ([`copy_stats`]): [`stats_bases`], to
    /// which the five-product pass may add its rows' norms.
    stats: Vec<i64>,
}

impl QuerySeq {
    fn new(e: &mut Em, p: &Problem, bid: &str, bm: i64) -> QuerySeq {
        let kt = key_tile(e, p, bid, WS_KEYS);
        let smem = e.op("llvm.mlir.addressof @attb_smem : !llvm.ptr<3>");
        let t_start = if p.causal { e.mulk(&kt.j, WS_KEYS / bm) } else { e.i32c(0) };
        let nqt_c = e.i32c(p.s / bm);
        let ntile = e.bin("subi", &nqt_c, &t_start, "i32");
        let total = e.mulk(&ntile, p.hq / p.hkv);
        let kh_g = e.mulk(&kt.kh, p.hq / p.hkv);
        let bh0 = e.mulk(&kt.bi, p.hq);
        QuerySeq { kt, smem, bm, t_start, ntile, nqt: p.s / bm, grp: p.hq / p.hkv, total, kh_g, bh0, stats: stats_bases(p).to_vec() }
    }

    /// (query head, first query row) of tile `f`.
    fn locate(&self, e: &mut Em, f: &str) -> (String, String) {
        let (h, t) = walk(e, &self.kt.order, f, &self.ntile, &self.t_start, self.nqt, self.grp, &|e, hh| e.addi(&self.kh_g, hh));
        let q0 = e.mulk(&t, self.bm);
        (h, q0)
    }

    /// The copier's `cp.async` of the CTA's K and V.
    fn copy_kv(&self, e: &mut Em, p: &Problem, io: &Io, cp: &Copier) {
        let (d, kv_row) = (p.d, p.hkv * p.d);
        let grow = e.addi(&self.kt.kv0, &cp.crow);
        let go = e.row_offset(&grow, kv_row, &cp.cc864, &self.kt.kv_base);
        let k_at = e.i32c(0);
        cp.copy(e, &self.smem, &io.k, &go, kv_row, WS_KEYS, d, &k_at);
        let v_at = e.i32c(WS_KEYS * d);
        cp.copy(e, &self.smem, &io.v, &go, kv_row, WS_KEYS, d, &v_at);
    }

    /// The copier's `cp.async` of tile `f`'s (Q, dO, lse, D) into its slot of `ring`.
    /// The copier's `cp.async` of tile `f`'s Q and dO rows and the per-row workspace arrays of
    /// [`QuerySeq::stats`] (after Q and dO, `bm` f32 each: [`copy_stats`]).
    fn load(&self, e: &mut Em, p: &Problem, io: &Io, cp: &Copier, ring: &Ring, f: &str) {
        let (d, bm, q_row) = (p.d, self.bm, p.hq * p.d);
        let (h, q0) = self.locate(e, f);
        let (s, _) = ring.slot(e, f);
        let sb = e.mulk(&s, stage_elems_rows(d, bm));
        let sb = e.addk(&sb, 2 * WS_KEYS * d);
        let h64 = e.ext64(&h);
        let d64 = e.i64c(d);
        let hd = e.bin("muli", &h64, &d64, "i64");
        let q_base = e.bin("addi", &self.kt.q_bbase, &hd, "i64");
        let grow = e.addi(&q0, &cp.crow);
        let go = e.row_offset(&grow, q_row, &cp.cc864, &q_base);
        cp.copy(e, &self.smem, &io.q, &go, q_row, bm, d, &sb);
        let dob = e.addk(&sb, bm * d);
        cp.copy(e, &self.smem, &io.dout, &go, q_row, bm, d, &dob);
        copy_stats(e, p, io, &self.smem, &cp.ptid, &self.bh0, &h, &q0, &sb, 2 * bm * d, bm, &self.stats);
    }
}

/// How a dK/dV CTA walks its (query head of the group, query tile) sequence: `ntile` tiles
/// `t_start .. nqt` of each of the group's `grp` heads. Position `f` is (`head_at(head)`, tile)
/// in the [`Order`] `w`. The order changes which data the CTAs running at once share in L2 and
/// the order in which dK and dV add the same per-tile products in f32 (so their rounding, not
/// their determinism: the order is fixed at build time); each tile is masked by its
/// coordinates, and the five-product pass's dQ sums are order-independent u32 adds.
///
/// The head comes first, then `kh_g + head` through `head_at`, then the tile (the ops in the
/// order the kernels had before the walk could change, so walking up gives the same PTX).
#[allow(clippy::too_many_arguments)] // the walk's state, as the two passes hold it
fn walk(e: &mut Em, w: &Order, f: &str, ntile: &str, t_start: &str, nqt: i64, grp: i64, head_at: &dyn Fn(&mut Em, &str) -> String) -> (String, String) {
    let (hh, tt) = if w.heads_inner { (e.remk(f, grp), e.divk(f, grp)) } else { (e.bin("divui", f, ntile, "i32"), e.bin("remui", f, ntile, "i32")) };
    let h = head_at(e, &hh);
    let t = if w.down {
        let last = e.i32c(nqt - 1);
        e.bin("subi", &last, &tt, "i32")
    } else {
        e.addi(t_start, &tt)
    };
    (h, t)
}

/// The order of a dK/dV pass's work: which CTAs run together (`band`) and how each walks its
/// query tiles (`down`, `heads_inner`). The CTAs of a kv head read the same query heads' Q and
/// dO and (five products) add to their u32 dQ accumulator; 8 MB a query head at head_dim 128,
/// seq 8192, against a 50 MB L2. Measured on an H100 against one band walked up (performance.md,
/// session 28), held at the power cap: at seq 8192 with Llama-3 8B's heads 28% less DRAM
/// traffic (Nsight Compute), 4-6% less time and 6-8% less energy a launch; at head_dim 64 2-3%
/// and 1-8%; at seq 4096 level at head_dim 128 and 3.5% less time at 64; at seq 2048 level at
/// head_dim 128 and 5% more time at 64 (the single-warpgroup pass), so seq 2048 keeps one band
/// walked up. Bands of 2 kv heads where they fill half a wave or less were 4-7% slower.
struct Order {
    /// Each head's tiles from the last one down (else up from the CTA's diagonal): the CTAs of
    /// a kv head started together stay on the same tile until the shortest ends its head.
    down: bool,
    /// At each tile the group's heads in turn (else each head's tiles in turn), so the CTAs stay
    /// together for their whole walk (with `down`).
    heads_inner: bool,
    /// (batch, kv head)s a band of the grid, each band key tile first (the longest causal walks
    /// first); it divides `b hkv`, which is one band.
    band: i64,
}

impl Order {
    /// The order of a pass over `p` whose CTAs take `keys` keys each: at seq 4096 and longer,
    /// `down` and bands of [`wave_band`] kv heads; else one band walked up. Build-time
    /// switches for comparison: `TITAN_ATT_BWD_WALK=up|down|down-heads-inner` and
    /// `TITAN_ATT_BWD_BAND=all|wave|g` (`g` dividing `b hkv`; another value is ignored).
    fn of(p: &Problem, keys: i64) -> Order {
        let nbk = p.b * p.hkv;
        let long = p.s >= 4096;
        let (down, heads_inner) = match crate::switches::var(crate::switches::Switch::AttBwdWalk).as_deref() {
            Some("up") => (false, false),
            Some("down") => (true, false),
            Some("down-heads-inner") => (true, true),
            _ => (long, false),
        };
        let wave = wave_band(nbk, p.s / keys);
        let band = match crate::switches::var(crate::switches::Switch::AttBwdBand).as_deref() {
            Some("all") => nbk,
            Some("wave") => wave,
            Some(v) => match v.parse::<i64>() {
                Ok(g) if g > 0 && nbk % g == 0 => g,
                _ => nbk,
            },
            None if long => wave,
            None => nbk,
        };
        Order { down, heads_inner, band }
    }
}

/// The divisor `g` of `nbk` for which `g tiles` is nearest [`crate::SMS`] (the smaller at a tie).
fn wave_band(nbk: i64, tiles: i64) -> i64 {
    let sms = crate::SMS as i64;
    (1..=nbk).filter(|g| nbk % g == 0).min_by_key(|g| (g * tiles - sms).abs()).unwrap_or(nbk)
}

/// What the consumer warpgroups of [`dkdv_ws_body`] take from its prologue.
struct WsCx<'a> {
    /// The warpgroup (0 or 1): its keys are `kv0 + 64 wgi ..`.
    wgi: &'a str,
    kv0: &'a str,
    kv_base: &'a str,
    smem: &'a str,
    total: &'a str,
    ring: &'a Ring,
    /// Query rows of a stage.
    bm: i64,
}

/// What a consumer of [`dkdv_ws_consumer`] does after a tile's dK and dV updates, before it
/// releases the stage: `(tile f, the stage's statistics (bf16 shared pointer), dS^T)` (the
/// five-product pass's dQ partial).
type AfterTile<'a> = dyn Fn(&mut Em, &str, &str, &[[String; 4]]) + 'a;

/// A consumer warpgroup of [`dkdv_ws_body`]: the single-warpgroup pass's `wgmma` tile loop on
/// 64 of the CTA's 128 keys, each stage waited for on its `full` barrier and released on its
/// `empty` one, after `after` (nothing for the seven-product pass). `locate(f)` gives tile f's
/// (query head, first query row).
fn dkdv_ws_consumer(e: &mut Em, p: &Problem, io: &Io, cx: &WsCx, locate: &dyn Fn(&mut Em, &str) -> (String, String), after: &AfterTile) {
    let d = p.d;
    let bm = cx.bm;
    let qn = (bm / 8) as usize;
    let se = stage_elems_rows(d, bm);
    let stage0 = 2 * WS_KEYS * d;
    let id = ids(e);
    let wl = e.remk(&id.warp, 4);
    let w16 = e.mulk(&wl, 16);
    let key0 = e.addi(&w16, &id.g);
    let key1 = e.addk(&key0, 8);
    // This warpgroup's first key within the CTA's tile.
    let wk = e.mulk(cx.wgi, 64);
    let kcol = e.mulk(&id.tq, 2);
    let c = e.f32c((p.scale * std::f64::consts::LOG2_E) as f32);
    let nt_d = (d / 8) as usize;
    let kmaj = sw128_descriptor(e, cx.smem, 16, 1024);
    let mnmaj = sw128_descriptor(e, cx.smem, bm * 128, 1024);
    let a_offs = sw128_kmajor_steps(d, WS_KEYS);
    let b_offs = sw128_kmajor_steps(d, bm);
    // K and V rows of this warpgroup: 64 rows of 128 bytes into each 64-dim block.
    let k_at = e.mulk(&wk, 64);
    let v_at = e.addk(&k_at, WS_KEYS * d);
    let ka_abs = e.addi(cx.kv0, &wk);
    let ka = [e.addi(&ka_abs, &key0), e.addi(&ka_abs, &key1)];
    let w_last = e.addi(&ka_abs, &w16);
    let w_last = e.addk(&w_last, 15);
    let zero_i = e.i32c(0);
    let init = frag_names(&zeros(e, 2 * nt_d));
    let res = for_f32(e, &zero_i, cx.total, &init, |e, f, carried| {
        let (mut dk, mut dv) = (frags_of(&carried[..4 * nt_d]), frags_of(&carried[4 * nt_d..]));
        let s = cx.ring.acquire(e, f);
        let (_, q0) = locate(e, f);
        let sb = e.mulk(&s, se);
        let sb = e.addk(&sb, stage0);
        let stats_at = e.addk(&sb, 2 * bm * d);
        let stats = sptr(e, cx.smem, &stats_at, "bf16");
        let wprod = |e: &mut Em, a_at: &str, b_at: &str| -> Vec<[String; 4]> {
            let z = frag_names(&zeros(e, qn));
            let ad = sw128_desc_at(e, &kmaj, a_at);
            let bd = sw128_desc_at(e, &kmaj, b_at);
            frags_of(&wgmma_chain(e, bm as usize, &z, WgA::Smem(&ad, &a_offs), &bd, &b_offs, false))
        };
        let q_tile = sb.clone();
        let do_tile = e.addk(&sb, bm * d);
        let s_t = wprod(e, &k_at, &q_tile);
        let cols: Vec<String> = (0..qn as i64).flat_map(|nt| [0, 1].map(|i| nt * 8 + i)).map(|k| e.addk(&kcol, k)).collect();
        let tile = DkdvCols { cols: &cols, stats: &stats, q0: &q0, keys: &ka, last_key: &w_last, c: &c, bm };
        let pt = tile.p_t(e, p.causal, &s_t);
        let dpt = wprod(e, &v_at, &do_tile);
        let dst = tile.ds_t(e, &pt, &dpt);
        dkdv_update_wgmma(e, d, bm, &mnmaj, &pt, &dst, &do_tile, &q_tile, &mut dk, &mut dv);
        after(e, f, &stats, &dst);
        // Both chains were waited for: the slot's tiles are no longer read.
        cx.ring.release(e, &s);
        let mut next = frag_names(&dk);
        next.extend(frag_names(&dv));
        next
    });
    let (dk, dv) = (frags_of(&res[..4 * nt_d]), frags_of(&res[4 * nt_d..]));
    store_dkdv(e, p, io, cx.kv_base, &ka_abs, [&key0, &key1], &kcol, &dk, &dv);
}

/// Query rows per CTA of the warp-specialized dQ pass: two consumer warpgroups of 64 rows
/// share every (K, V) stage.
const WS_QUERIES: i64 = 128;

/// Dynamic shared memory of the warp-specialized dQ pass: the (K, V) stages, then the barriers.
fn dq_ws_smem_bytes(d: i64) -> i64 {
    2 * ws_stages(d) * 2 * ws_rows(d) * d + 16 * ws_stages(d)
}

/// The dQ pass, warp-specialized as [`dkdv_ws_body`]: one CTA per 128-query tile of one
/// (batch, query head), longest causal tiles first. Warpgroups 0 and 1 own the rows `64 w ..`
/// (Q and dO in registers, D and lse written for the dK/dV pass as in [`dq_body`]); warpgroup
/// 2 copies the key tiles (K, V) both need into the [`Ring`]. Causal: the producer loads the
/// tiles up to the upper warpgroup's diagonal; the lower one releases that last tile unread.
fn dq_ws_body(p: &Problem, io: &Io) -> String {
    let mut e = Em::new();
    let d = p.d;
    let bn = ws_rows(d);
    let nst = ws_stages(d);
    let nm = p.s / WS_QUERIES;
    let bh = p.b * p.hq;
    let kv_row = p.hkv * d;
    let se = 2 * bn * d;
    let id = ids(&mut e);
    let tid = id.tid.clone();
    let mb_rev = e.divk(&id.bid, bh);
    let nm1 = e.i32c(nm - 1);
    let mblk = e.bin("subi", &nm1, &mb_rev, "i32");
    let bhi = e.remk(&id.bid, bh);
    let smem = e.op("llvm.mlir.addressof @attb_smem : !llvm.ptr<3>");
    let ring = Ring::new(&mut e, &smem, 2 * nst * se, nst, &tid);
    // Key tiles the CTA's rows need: up to the one holding its last row's diagonal when causal.
    let n_tiles = if p.causal {
        let m128 = e.mulk(&mblk, WS_QUERIES);
        let last = e.addk(&m128, WS_QUERIES - 1);
        let t = e.divk(&last, bn);
        e.addk(&t, 1)
    } else {
        e.i32c(p.s / bn)
    };
    ws_split(
        &mut e,
        &tid,
        WgIndex::Broadcast,
        |e, cp| {
            let (_, kv_base) = head_bases(e, p, &bhi);
            let g_off = e.row_offset(&cp.crow, kv_row, &cp.cc864, &kv_base);
            let k_g = e.gep(&io.k, 1, &g_off, "i64", "bf16");
            let v_g = e.gep(&io.v, 1, &g_off, "i64", "bf16");
            let load = |e: &mut Em, j: &str| {
                let (s, _) = ring.slot(e, j);
                let kb = e.mulk(&s, se);
                let vb = e.addk(&kb, bn * d);
                let j64 = e.ext64(j);
                let tk = e.i64c(bn * kv_row);
                let off = e.bin("muli", &j64, &tk, "i64");
                for (src, base) in [(&k_g, &kb), (&v_g, &vb)] {
                    cp.copy(e, &smem, src, &off, kv_row, bn, d, base);
                }
            };
            ring.produce(e, &n_tiles, &load);
        },
        |e, wgi| {
            let wl = e.remk(&id.warp, 4);
            let m128 = e.mulk(&mblk, WS_QUERIES);
            let w64 = e.mulk(wgi, 64);
            let row_base = e.addi(&m128, &w64);
            let r = dq_rows(e, p, io, &wl, &id.g, &id.tq, &row_base, &bhi);
            let sm = DqSmem {
                bn,
                k_off: lm_off(e, &id.mi_hi, &id.mi_lo, &id.r8, d + 8),
                kt_off: lm_off(e, &id.mi_lo, &id.mi_hi, &id.r8, d + 8),
                kmaj: sw128_descriptor(e, &smem, 16, 1024),
                mnmaj: sw128_descriptor(e, &smem, bn * 128, 1024),
                smem: smem.clone(),
            };
            // This warpgroup's tiles when causal: those below its first row unmasked, then up to
            // the one holding its last row's diagonal.
            let (n_w, n_full) = if p.causal {
                let last = e.addk(&row_base, 63);
                let t = e.divk(&last, bn);
                (e.addk(&t, 1), e.divk(&row_base, bn))
            } else {
                (n_tiles.clone(), n_tiles.clone())
            };
            let tile_body = |e: &mut Em, j: &str, carried: &[String], masked: bool| -> Vec<String> {
                let s = ring.acquire(e, j);
                let kb = e.mulk(&s, se);
                let vb = e.addk(&kb, bn * d);
                let dq = dq_tile(e, p, &r, &sm, &kb, &vb, j, frags_of(carried), masked);
                ring.release(e, &s);
                frag_names(&dq)
            };
            let zero_i = e.i32c(0);
            let init = frag_names(&zeros(e, (d / 8) as usize));
            let mut res = for_f32(e, &zero_i, &n_full, &init, |e, j, carried| tile_body(e, j, carried, false));
            if p.causal {
                res = for_f32(e, &n_full, &n_w, &res, |e, j, carried| tile_body(e, j, carried, true));
                // Tiles the other warpgroup needs and this one's rows do not: released unread.
                for_each(e, &n_w, &n_tiles, |e, j| {
                    let s = ring.acquire(e, j);
                    ring.release(e, &s);
                });
            }
            dq_store(e, p, io, &r, &frags_of(&res));
        },
    );
    e.body
}
