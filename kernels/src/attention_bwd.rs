//! `attention_bwd` kernel: the FlashAttention-2 backward pass on tensor cores (`mma.sync`
//! m16n8k16 bf16 -> f32, `ldmatrix` fragments), emitted as MLIR text with NVVM ops.
//!
//! Design:
//! - One CTA of 4 warps per 64-key tile of one (batch, kv head); warp `w` owns keys
//!   `16w..16w+16` of the tile. The CTA keeps dK and dV of its keys in registers (f32) while it
//!   loops over the query heads of its GQA group and, per head, over query tiles of 32 rows (16
//!   at head_dim 128, where dK and dV take 128 registers a thread), from the diagonal on when
//!   causal: earlier query tiles see none of its keys. Causal CTAs with the most work (the first
//!   key tiles) come first in the grid.
//! - Static shared memory: the K and V tiles (`64 x (d + 8)` bf16 each, staged once by
//!   `cp.async`), the Q and dO tiles (`cp.async` per query tile), dS^T (`64 x 40` bf16) and the
//!   tile's lse and D (f32): 48,772 bytes at head_dim 128 (under the 48 KiB static limit).
//! - Per query tile: S^T = K Q^T; P^T = exp2(S^T scale log2 e - lse log2 e) (masked to 0 above
//!   the diagonal); dV += P^T dO; dP^T = V dO^T; dS^T = P^T (dP^T - D); dK += dS^T Q.
//!   The dV update comes after dS so P, dP and P's bf16 copy are never live together.
//!   D = rowsum(dO o O) is recomputed per query tile from global memory (`128 / rows` threads per
//!   row), so no preceding phase is needed.
//! - dQ: dS^T goes through shared memory; the 4 warps compute the tile's `rows x d` partial
//!   `dS K scale` and add it with f32 atomics into a workspace accumulator. A per-query-tile
//!   arrival counter (after a device-scope fence) tells the last contributing CTA to convert the
//!   tile to bf16 `dq`, reading the accumulator with atomic exchanges of 0 and resetting the
//!   counter: the workspace is left zeroed.
//!
//! Supported: the forward kernel's shapes (bf16, head_dim 16/64/128, sequence length a multiple
//! of 64, `scale > 0`).

use std::fmt::Write as _;

use titan_ir::{DType, Graph, Op, Region};

use crate::attention::Em;
use crate::values::Body;
use crate::{GenResult, Generated, invalid, unsupported};

/// Keys per CTA.
const BN: i64 = 64;
/// Queries per inner tile: 32, or 16 at head_dim 128 (fewer live registers next to dK, dV).
fn bmq(d: i64) -> i64 {
    if d > 64 { 16 } else { 32 }
}
const THREADS: i64 = 128;
/// Row stride (elements) of the dS^T tile in shared memory.
const DS_STRIDE: i64 = 32 + 8;

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
    let mut outs = [usize::MAX; 3];
    for (i, o) in r.outputs.iter().enumerate() {
        match node.results.iter().position(|&v| v == o.value) {
            Some(p) if outs[p] == usize::MAX => outs[p] = i,
            _ => return invalid("the outputs of an attention_bwd body must be its node's dq, dk and dv, once each"),
        }
    }
    if outs.contains(&usize::MAX) || r.outputs.len() != 3 {
        return unsupported("the attention_bwd kernel writes dq, dk and dv; the body must output all three");
    }
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
    let (qs, ks) = (&b.shape[node.inputs[0].index()], &b.shape[node.inputs[1].index()]);
    let (&[bb, s, hq, d], &[kb, kss, hkv, kd]) = (qs.as_slice(), ks.as_slice()) else {
        return invalid("attention_bwd q and k must be [batch, seq, heads, head_dim]");
    };
    if (kb, kss, kd) != (bb, s, d) || hkv == 0 || hq % hkv != 0 {
        return invalid("attention_bwd q, k, v shapes do not match");
    }
    if !matches!(d, 16 | 64 | 128) {
        return unsupported(format!("attention_bwd head_dim {d} (the kernel supports 16, 64 and 128)"));
    }
    if s == 0 || s % BN as u64 != 0 {
        return unsupported(format!("attention_bwd sequence length {s} (the kernel needs a multiple of {BN})"));
    }
    if !(scale.is_finite() && scale > 0.0) {
        return unsupported(format!("attention_bwd scale {scale} (the kernel needs a positive scale)"));
    }
    if bb * s * hq * d >= 1 << 36 || (s / BN as u64) * bb * hkv > u64::from(u32::MAX) {
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
    let acc_elems = p.b * p.s * p.hq * p.d;
    let counters = p.b * p.hq * (p.s / bmq(p.d));
    let body = bwd_body(&p, &io, acc_elems);
    let st = p.d + 8;
    let mut m = String::new();
    m.push_str("module attributes {gpu.container_module} {\n  gpu.module @titan {\n");
    for (name, n, ty) in [
        ("attb_k", BN * st, "bf16"),
        ("attb_v", BN * st, "bf16"),
        ("attb_q", bmq(p.d) * st, "bf16"),
        ("attb_do", bmq(p.d) * st, "bf16"),
        ("attb_ds", BN * DS_STRIDE, "bf16"),
        ("attb_lse", bmq(p.d), "f32"),
        ("attb_d", bmq(p.d), "f32"),
        ("attb_flag", 1, "i32"),
    ] {
        let _ = writeln!(m, "    llvm.mlir.global internal @{name}() {{addr_space = 3 : i32, alignment = 16 : i64}} : !llvm.array<{n} x {ty}>");
    }
    let ps: Vec<String> = params.iter().map(|p| format!("{p}: !llvm.ptr<1>")).collect();
    let _ = writeln!(
        m,
        "    gpu.func @{entry}({}) kernel attributes {{known_block_size = array<i32: {THREADS}, 1, 1>, known_grid_size = array<i32: {grid}, 1, 1>}} {{",
        ps.join(", ")
    );
    m.push_str(&body);
    m.push_str("      gpu.return\n    }\n  }\n}\n");
    Ok(Generated { mlir: m, block: THREADS as u32, grid, workspace_bytes: (acc_elems as u64 + counters as u64) * 4 })
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
    let results: Vec<String> = inits.iter().map(|_| e.fresh()).collect();
    let args: Vec<String> = inits.iter().map(|_| e.fresh()).collect();
    let iv = e.fresh();
    let one = e.i32c(1);
    let pairs: Vec<String> = args.iter().zip(inits).map(|(a, i)| format!("{a} = {i}")).collect();
    let tys = vec!["f32"; inits.len()].join(", ");
    e.line(&format!("{} = scf.for {iv} = {lo} to {hi} step {one} iter_args({}) -> ({tys}) : i32 {{", results.join(", "), pairs.join(", ")));
    e.indent += 1;
    let next = body(e, &iv, &args);
    e.line(&format!("scf.yield {} : {tys}", next.join(", ")));
    e.indent -= 1;
    e.line("}");
    results
}

fn if_then(e: &mut Em, cond: &str, then: impl FnOnce(&mut Em)) {
    e.line(&format!("scf.if {cond} {{"));
    e.indent += 1;
    then(e);
    e.indent -= 1;
    e.line("}");
}

fn bwd_body(p: &Problem, io: &Io, acc_elems: i64) -> String {
    let mut e = Em::new();
    let d = p.d;
    let st = d + 8;
    let grp = p.hq / p.hkv;
    let bm = bmq(d);
    let nqt = p.s / bm;
    // Query n-tiles (8 wide) per tile, warps per query m-tile, threads per row for D.
    let qn = (bm / 8) as usize;
    let mtiles = bm / 16;
    let tpr = THREADS / bm;
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
    let zero_i = e.i32c(0);
    // Block -> (key tile j, batch, kv head); low j (the most causal work) first.
    let j = e.divk(&bid, p.b * p.hkv);
    let bk = e.remk(&bid, p.b * p.hkv);
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
    let kv_row = p.hkv * d;
    let q_row = p.hq * d;
    // Shared buffers.
    let ks = e.op("llvm.mlir.addressof @attb_k : !llvm.ptr<3>");
    let vs = e.op("llvm.mlir.addressof @attb_v : !llvm.ptr<3>");
    let qs = e.op("llvm.mlir.addressof @attb_q : !llvm.ptr<3>");
    let dos = e.op("llvm.mlir.addressof @attb_do : !llvm.ptr<3>");
    let dss = e.op("llvm.mlir.addressof @attb_ds : !llvm.ptr<3>");
    let lses = e.op("llvm.mlir.addressof @attb_lse : !llvm.ptr<3>");
    let dsm = e.op("llvm.mlir.addressof @attb_d : !llvm.ptr<3>");
    let flag = e.op("llvm.mlir.addressof @attb_flag : !llvm.ptr<3>");
    // K and V tiles -> shared (cp.async, once).
    let cpr = d / 8;
    {
        let crow = e.divk(&tid, cpr);
        let cch = e.remk(&tid, cpr);
        let cc8 = e.mulk(&cch, 8);
        let s_row = e.mulk(&crow, st);
        let s_off = e.addi(&s_row, &cc8);
        let grow = e.addi(&kv0, &crow);
        let grow64 = e.ext64(&grow);
        let kvr = e.i64c(kv_row);
        let go = e.bin("muli", &grow64, &kvr, "i64");
        let cc864 = e.ext64(&cc8);
        let go = e.bin("addi", &go, &cc864, "i64");
        let go = e.bin("addi", &go, &kv_base, "i64");
        for (src, dst) in [(&io.k, &ks), (&io.v, &vs)] {
            let g0 = e.gep(src, 1, &go, "i64", "bf16");
            let s0 = e.gep(dst, 3, &s_off, "i32", "bf16");
            let rows_per_iter = THREADS / cpr;
            for it in 0..(BN * d / 8 / THREADS) {
                let gk = e.i64c(it * rows_per_iter * kv_row);
                let gp = e.gep(&g0, 1, &gk, "i64", "bf16");
                let sp = e.gepk(&s0, 3, it * rows_per_iter * st);
                e.cp_async16(&sp, &gp);
            }
        }
        e.commit();
    }
    // The warp's key rows (g, g + 8) and the thread's column pair in C fragments.
    let w16 = e.mulk(&warp, 16);
    let key0 = e.addi(&w16, &g); // key within the tile, rows g / g + 8
    let key1 = e.addk(&key0, 8);
    let kcol = e.mulk(&tq, 2);
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
    // Per-lane ldmatrix offsets.
    // A (row-major, 16 rows): row = lane % 16, col = (lane / 16) * 8.
    let l16 = e.remk(&lane, 16);
    let l16r = e.mulk(&l16, st);
    let lhi = e.divk(&lane, 16);
    let lhc = e.mulk(&lhi, 8);
    let a_off = e.addi(&l16r, &lhc);
    let wrow = e.mulk(&warp, 16 * st);
    let a_off = e.addi(&a_off, &wrow);
    let k_a = e.gep(&ks, 3, &a_off, "i32", "bf16");
    let v_a = e.gep(&vs, 3, &a_off, "i32", "bf16");
    // B non-trans (rows = n): row = (mi / 2) * 8 + r, col = (mi % 2) * 8.
    let bn_r = e.mulk(&mi_hi, 8);
    let bn_r = e.addi(&bn_r, &r8);
    let bn_ro = e.mulk(&bn_r, st);
    let bn_c = e.mulk(&mi_lo, 8);
    let bn_off = e.addi(&bn_ro, &bn_c);
    let q_bn = e.gep(&qs, 3, &bn_off, "i32", "bf16");
    let do_bn = e.gep(&dos, 3, &bn_off, "i32", "bf16");
    // B trans (rows = k): row = (mi % 2) * 8 + r, col = (mi / 2) * 8.
    let bt_r = e.mulk(&mi_lo, 8);
    let bt_r = e.addi(&bt_r, &r8);
    let bt_ro = e.mulk(&bt_r, st);
    let bt_c = e.mulk(&mi_hi, 8);
    let bt_off = e.addi(&bt_ro, &bt_c);
    let q_bt = e.gep(&qs, 3, &bt_off, "i32", "bf16");
    let do_bt = e.gep(&dos, 3, &bt_off, "i32", "bf16");
    // dQ: A = dS (trans from dS^T [key][q]): key = (mi / 2) * 8 + r, q = 16 * (warp % 2) + (mi % 2) * 8.
    let mt = e.remk(&warp, mtiles);
    let nhalf = e.divk(&warp, mtiles);
    let dsa_r = e.mulk(&mi_hi, 8);
    let dsa_r = e.addi(&dsa_r, &r8);
    let dsa_ro = e.mulk(&dsa_r, DS_STRIDE);
    let mt16 = e.mulk(&mt, 16);
    let dsa_c = e.addi(&bn_c, &mt16);
    let dsa_off = e.addi(&dsa_ro, &dsa_c);
    let ds_a = e.gep(&dss, 3, &dsa_off, "i32", "bf16");
    // dQ: B = K (trans, two k-steps per x4): key = mi * 8 + r, dim = the n-tile's.
    let kb_r = e.mulk(&mi, 8);
    let kb_r = e.addi(&kb_r, &r8);
    let kb_ro = e.mulk(&kb_r, st);
    let nh_dims = e.mulk(&nhalf, d * mtiles / 4);
    let kb_off = e.addi(&kb_ro, &nh_dims);
    let k_bt = e.gep(&ks, 3, &kb_off, "i32", "bf16");
    let c = e.f32c((p.scale * std::f64::consts::LOG2_E) as f32);
    let scale = e.f32c(p.scale as f32);
    let log2e = e.f32c(std::f32::consts::LOG2_E);
    let zf = e.f32c(0.0);
    let nt_d = (d / 8) as usize;
    let init: Vec<String> = vec![zf.clone(); 8 * nt_d];
    let t_start = if p.causal { e.mulk(&j, BN / bm) } else { zero_i.clone() };
    let t_end = e.i32c(nqt);
    let grp_c = e.i32c(grp);
    let kh_g = e.mulk(&kh, grp);
    let res = for_f32(&mut e, &zero_i, &grp_c, &init, |e, hh, carried| {
        let h = e.addi(&kh_g, hh);
        let h64 = e.ext64(&h);
        let hd = e.bin("muli", &h64, &d64, "i64");
        let q_base = e.bin("addi", &q_bbase, &hd, "i64");
        let bh = e.mulk(&bi, p.hq);
        let bh = e.addi(&bh, &h);
        let lse_row0 = e.mulk(&bh, p.s);
        let cnt_row0 = e.mulk(&bh, nqt);
        for_f32(e, &t_start, &t_end, carried, |e, t, carried| {
            let (mut dk, mut dv) = (frags_of(&carried[..4 * nt_d]), frags_of(&carried[4 * nt_d..]));
            let q0 = e.mulk(t, bm);
            // Everyone is done with the previous tile's shared buffers.
            e.barrier();
            // Q and dO tiles -> shared.
            let crow = e.divk(&tid, cpr);
            let cch = e.remk(&tid, cpr);
            let cc8 = e.mulk(&cch, 8);
            let s_row = e.mulk(&crow, st);
            let s_off = e.addi(&s_row, &cc8);
            let grow = e.addi(&q0, &crow);
            let grow64 = e.ext64(&grow);
            let qr = e.i64c(q_row);
            let go = e.bin("muli", &grow64, &qr, "i64");
            let cc864 = e.ext64(&cc8);
            let go = e.bin("addi", &go, &cc864, "i64");
            let go = e.bin("addi", &go, &q_base, "i64");
            let chunks = bm * d / 8;
            let rows_per_iter = THREADS / cpr;
            let copy = |e: &mut Em, it: i64| {
                let gk = e.i64c(it * rows_per_iter * q_row);
                let go2 = e.bin("addi", &go, &gk, "i64");
                for (src, dst) in [(&io.q, &qs), (&io.dout, &dos)] {
                    let gp = e.gep(src, 1, &go2, "i64", "bf16");
                    let s0 = e.gep(dst, 3, &s_off, "i32", "bf16");
                    let sp = e.gepk(&s0, 3, it * rows_per_iter * st);
                    e.cp_async16(&sp, &gp);
                }
            };
            if chunks < THREADS {
                let lim = e.i32c(chunks);
                let ok = e.op(&format!("arith.cmpi ult, {tid}, {lim} : i32"));
                if_then(e, &ok, |e| copy(e, 0));
            } else {
                for it in 0..chunks / THREADS {
                    copy(e, it);
                }
            }
            e.commit();
            // D = rowsum(dO o O) and lse (log2 domain) of the tile's rows: 4 threads per row.
            let drow = e.divk(&tid, tpr);
            let dpart = e.remk(&tid, tpr);
            let qrow = e.addi(&q0, &drow);
            let qrow64 = e.ext64(&qrow);
            let qr = e.i64c(q_row);
            let ro = e.bin("muli", &qrow64, &qr, "i64");
            let ro = e.bin("addi", &ro, &q_base, "i64");
            let pc = e.mulk(&dpart, d / tpr);
            let pc64 = e.ext64(&pc);
            let ro = e.bin("addi", &ro, &pc64, "i64");
            let op = e.gep(&io.o, 1, &ro, "i64", "bf16");
            let dp = e.gep(&io.dout, 1, &ro, "i64", "bf16");
            let mut acc = zf.clone();
            for k in 0..d / tpr / 2 {
                let a = e.gepk(&op, 1, 2 * k);
                let b = e.gepk(&dp, 1, 2 * k);
                let av = e.op(&format!("llvm.load {a} {{alignment = 4 : i64}} : !llvm.ptr<1> -> vector<2xbf16>"));
                let bv = e.op(&format!("llvm.load {b} {{alignment = 4 : i64}} : !llvm.ptr<1> -> vector<2xbf16>"));
                let af = e.op(&format!("arith.extf {av} : vector<2xbf16> to vector<2xf32>"));
                let bf = e.op(&format!("arith.extf {bv} : vector<2xbf16> to vector<2xf32>"));
                for i in 0..2 {
                    let x = e.op(&format!("vector.extract {af}[{i}] : f32 from vector<2xf32>"));
                    let y = e.op(&format!("vector.extract {bf}[{i}] : f32 from vector<2xf32>"));
                    acc = e.fma(&x, &y, &acc);
                }
            }
            for off in (0..).map(|i| 1i64 << i).take_while(|&o| o < tpr) {
                let o = e.shfl_xor(&acc, off);
                acc = e.fadd(&acc, &o);
            }
            let first = e.op(&format!("arith.cmpi eq, {dpart}, {zero_i} : i32"));
            if_then(e, &first, |e| {
                let dptr = e.gep(&dsm, 3, &drow, "i32", "f32");
                e.line(&format!("llvm.store {acc}, {dptr} {{alignment = 4 : i64}} : f32, !llvm.ptr<3>"));
                let li = e.addi(&lse_row0, &qrow);
                let li64 = e.ext64(&li);
                let lp = e.gep(&io.lse, 1, &li64, "i64", "f32");
                let l = e.op(&format!("llvm.load {lp} {{alignment = 4 : i64}} : !llvm.ptr<1> -> f32"));
                let l2 = e.fmul(&l, &log2e);
                let lsp = e.gep(&lses, 3, &drow, "i32", "f32");
                e.line(&format!("llvm.store {l2}, {lsp} {{alignment = 4 : i64}} : f32, !llvm.ptr<3>"));
            });
            e.wait_group(0);
            e.barrier();
            // S^T = K Q^T: 16 keys x 32 queries per warp (4 n-tiles).
            let z = zf.clone();
            let mut s: Vec<[String; 4]> = (0..qn).map(|_| [0; 4].map(|_| z.clone())).collect();
            for kstep in 0..d / 16 {
                let pa = e.gepk(&k_a, 3, 16 * kstep);
                let a = e.ldmatrix4(&pa, false);
                for np in 0..bm / 16 {
                    let pb = e.gepk(&q_bn, 3, 16 * np * st + 16 * kstep);
                    let r = e.ldmatrix4(&pb, false);
                    let n0 = (2 * np) as usize;
                    s[n0] = e.mma(&a, [&r[0], &r[1]], &s[n0]);
                    s[n0 + 1] = e.mma(&a, [&r[2], &r[3]], &s[n0 + 1]);
                }
            }
            // P^T and the tile's D per column (query).
            let mut dcol = Vec::new();
            for nt in 0..qn as i64 {
                for i in 0..2i64 {
                    let col = e.addk(&kcol, nt * 8 + i);
                    let lp = e.gep(&lses, 3, &col, "i32", "f32");
                    let l = e.op(&format!("llvm.load {lp} {{alignment = 4 : i64}} : !llvm.ptr<3> -> f32"));
                    let nl = e.op(&format!("arith.negf {l} : f32"));
                    dcol.push((nl, col));
                }
            }
            let mut pt: Vec<[String; 4]> = Vec::new();
            for (nt, tile) in s.iter().enumerate() {
                let mut out: [String; 4] = Default::default();
                for (i, x) in tile.iter().enumerate() {
                    let (nl, col) = &dcol[nt * 2 + i % 2];
                    let y = e.fma(x, &c, nl);
                    let mut pv = e.ex2(&y);
                    if p.causal {
                        // key (kv0 + key row) > query (q0 + col) -> 0
                        let kr = if i / 2 == 0 { &key0 } else { &key1 };
                        let ka = e.addi(&kv0, kr);
                        let qa = e.addi(&q0, col);
                        let gt = e.op(&format!("arith.cmpi ugt, {ka}, {qa} : i32"));
                        pv = e.op(&format!("arith.select {gt}, {zf}, {pv} : f32"));
                    }
                    out[i] = pv;
                }
                pt.push(out);
            }
            let to_a = |e: &mut Em, f: &[[String; 4]], kk: usize| -> [String; 4] {
                let (t0, t1) = (&f[2 * kk], &f[2 * kk + 1]);
                [e.pack_bf16(&t0[0], &t0[1]), e.pack_bf16(&t0[2], &t0[3]), e.pack_bf16(&t1[0], &t1[1]), e.pack_bf16(&t1[2], &t1[3])]
            };
            // dP^T = V dO^T.
            let mut dpt: Vec<[String; 4]> = (0..qn).map(|_| [0; 4].map(|_| z.clone())).collect();
            for kstep in 0..d / 16 {
                let pa = e.gepk(&v_a, 3, 16 * kstep);
                let a = e.ldmatrix4(&pa, false);
                for np in 0..bm / 16 {
                    let pb = e.gepk(&do_bn, 3, 16 * np * st + 16 * kstep);
                    let r = e.ldmatrix4(&pb, false);
                    let n0 = (2 * np) as usize;
                    dpt[n0] = e.mma(&a, [&r[0], &r[1]], &dpt[n0]);
                    dpt[n0 + 1] = e.mma(&a, [&r[2], &r[3]], &dpt[n0 + 1]);
                }
            }
            // dS^T = P^T o (dP^T - D); D re-read from shared memory here (fewer live registers).
            let dcol: Vec<String> = dcol
                .iter()
                .map(|(_, col)| {
                    let dp = e.gep(&dsm, 3, col, "i32", "f32");
                    e.op(&format!("llvm.load {dp} {{alignment = 4 : i64}} : !llvm.ptr<3> -> f32"))
                })
                .collect();
            let mut dst: Vec<[String; 4]> = Vec::new();
            for nt in 0..qn {
                let mut out: [String; 4] = Default::default();
                for (i, o) in out.iter_mut().enumerate() {
                    let dd = &dcol[nt * 2 + i % 2];
                    let x = e.fsub(&dpt[nt][i], dd);
                    *o = e.fmul(&pt[nt][i], &x);
                }
                dst.push(out);
            }
            // dV += P^T dO.
            for kk in 0..mtiles as usize {
                let a = to_a(e, &pt, kk);
                for dp in 0..d / 16 {
                    let pb = e.gepk(&do_bt, 3, 16 * kk as i64 * st + 16 * dp);
                    let r = e.ldmatrix4(&pb, true);
                    let n0 = (2 * dp) as usize;
                    dv[n0] = e.mma(&a, [&r[0], &r[1]], &dv[n0]);
                    dv[n0 + 1] = e.mma(&a, [&r[2], &r[3]], &dv[n0 + 1]);
                }
            }
            // dK += dS^T Q (scaled at the end).
            for kk in 0..mtiles as usize {
                let a = to_a(e, &dst, kk);
                for dp in 0..d / 16 {
                    let pb = e.gepk(&q_bt, 3, 16 * kk as i64 * st + 16 * dp);
                    let r = e.ldmatrix4(&pb, true);
                    let n0 = (2 * dp) as usize;
                    dk[n0] = e.mma(&a, [&r[0], &r[1]], &dk[n0]);
                    dk[n0 + 1] = e.mma(&a, [&r[2], &r[3]], &dk[n0 + 1]);
                }
            }
            // dS^T -> shared ([key][query]).
            let r0 = e.mulk(&key0, DS_STRIDE);
            let r0 = e.addi(&r0, &kcol);
            let dsp = e.gep(&dss, 3, &r0, "i32", "bf16");
            for (nt, t) in dst.iter().enumerate() {
                for half in 0..2usize {
                    let pk = e.pack_bf16(&t[2 * half], &t[2 * half + 1]);
                    let ptr = e.gepk(&dsp, 3, nt as i64 * 8 + half as i64 * 8 * DS_STRIDE);
                    e.line(&format!("llvm.store {pk}, {ptr} {{alignment = 4 : i64}} : i32, !llvm.ptr<3>"));
                }
            }
            e.barrier();
            // dQ partial = dS K scale: warp -> query m-tile (warp % 2), d/16 n-tiles from (warp / 2) d/2.
            let af: Vec<[String; 4]> = (0..4i64)
                .map(|kstep| {
                    let pa = e.gepk(&ds_a, 3, 16 * kstep * DS_STRIDE);
                    e.ldmatrix4(&pa, true)
                })
                .collect();
            let dqrow = e.addi(&q0, &mt16);
            let dqrow = e.addi(&dqrow, &g);
            let dr64 = e.ext64(&dqrow);
            let qr = e.i64c(q_row);
            let dro = e.bin("muli", &dr64, &qr, "i64");
            let dro = e.bin("addi", &dro, &q_base, "i64");
            let nd64 = e.ext64(&nh_dims);
            let dro = e.bin("addi", &dro, &nd64, "i64");
            let kc64 = e.ext64(&kcol);
            let dro = e.bin("addi", &dro, &kc64, "i64");
            let wsrow = e.gep(&io.ws, 1, &dro, "i64", "f32");
            for ni in 0..d * mtiles / 32 {
                let mut acc4 = [0; 4].map(|_| z.clone());
                for kp in 0..2i64 {
                    let pb = e.gepk(&k_bt, 3, 32 * kp * st + 8 * ni);
                    let r = e.ldmatrix4(&pb, true);
                    acc4 = e.mma(&af[2 * kp as usize], [&r[0], &r[1]], &acc4);
                    acc4 = e.mma(&af[2 * kp as usize + 1], [&r[2], &r[3]], &acc4);
                }
                for (i, x) in acc4.iter().enumerate() {
                    let v = e.fmul(x, &scale);
                    let off = e.i64c(8 * ni + (i % 2) as i64 + if i >= 2 { 8 * q_row } else { 0 });
                    let ptr = e.gep(&wsrow, 1, &off, "i64", "f32");
                    e.op(&format!("llvm.atomicrmw fadd {ptr}, {v} monotonic : !llvm.ptr<1>, f32"));
                }
            }
            // Arrival on the tile's counter; the last contributor converts and clears the tile.
            e.line("llvm.fence syncscope(\"device\") acq_rel");
            e.barrier();
            let is_t0 = e.op(&format!("arith.cmpi eq, {tid}, {zero_i} : i32"));
            let expected = if p.causal {
                let h2 = e.divk(t, BN / bm);
                e.addk(&h2, 1)
            } else {
                e.i32c(p.s / BN)
            };
            let ci = e.addi(&cnt_row0, t);
            let ci64 = e.ext64(&ci);
            let cbase = e.i64c(acc_elems);
            let ci64 = e.bin("addi", &ci64, &cbase, "i64");
            let cptr = e.op(&format!("llvm.getelementptr {}[{ci64}] : (!llvm.ptr<1>, i64) -> !llvm.ptr<1>, i32", io.ws));
            if_then(e, &is_t0, |e| {
                let one = e.i32c(1);
                let old = e.op(&format!("llvm.atomicrmw add {cptr}, {one} monotonic : !llvm.ptr<1>, i32"));
                let old1 = e.addi(&old, &one);
                let last = e.op(&format!("arith.cmpi eq, {old1}, {expected} : i32"));
                let lv = e.op(&format!("arith.extui {last} : i1 to i32"));
                e.line(&format!("llvm.store {lv}, {flag} {{alignment = 4 : i64}} : i32, !llvm.ptr<3>"));
                e.line("llvm.fence syncscope(\"device\") acq_rel");
            });
            e.barrier();
            let fl = e.op(&format!("llvm.load {flag} {{alignment = 4 : i64}} : !llvm.ptr<3> -> i32"));
            let is_last = e.op(&format!("arith.cmpi ne, {fl}, {zero_i} : i32"));
            if_then(e, &is_last, |e| {
                e.line("llvm.fence syncscope(\"device\") acq_rel");
                let pairs = bm * d / 2;
                let zero_f = zf.clone();
                for it in 0..pairs / THREADS {
                    let pi = e.addk(&tid, it * THREADS);
                    let row = e.divk(&pi, d / 2);
                    let cp = e.remk(&pi, d / 2);
                    let col = e.mulk(&cp, 2);
                    let rr = e.addi(&q0, &row);
                    let rr64 = e.ext64(&rr);
                    let qr = e.i64c(q_row);
                    let o = e.bin("muli", &rr64, &qr, "i64");
                    let o = e.bin("addi", &o, &q_base, "i64");
                    let c64 = e.ext64(&col);
                    let o = e.bin("addi", &o, &c64, "i64");
                    let wp = e.gep(&io.ws, 1, &o, "i64", "f32");
                    let x0 = e.op(&format!("llvm.atomicrmw xchg {wp}, {zero_f} monotonic : !llvm.ptr<1>, f32"));
                    let one64 = e.i64c(1);
                    let wp1 = e.gep(&wp, 1, &one64, "i64", "f32");
                    let x1 = e.op(&format!("llvm.atomicrmw xchg {wp1}, {zero_f} monotonic : !llvm.ptr<1>, f32"));
                    let pk = e.pack_bf16(&x0, &x1);
                    let dqp = e.gep(&io.dq, 1, &o, "i64", "bf16");
                    e.line(&format!("llvm.store {pk}, {dqp} {{alignment = 4 : i64}} : i32, !llvm.ptr<1>"));
                }
                if_then(e, &is_t0, |e| {
                    e.op(&format!("llvm.atomicrmw xchg {cptr}, {zero_i} monotonic : !llvm.ptr<1>, i32"));
                });
            });
            let mut next = frag_names(&dk);
            next.extend(frag_names(&dv));
            next
        })
    });
    let (dk, dv) = (frags_of(&res[..4 * nt_d]), frags_of(&res[4 * nt_d..]));
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
