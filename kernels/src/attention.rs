//! `attention` kernels: a FlashAttention-2 style forward pass on tensor cores, emitted as MLIR
//! text with NVVM ops and inline PTX. At head_dim 64 and 128 both products run on Hopper's
//! warpgroup MMA (`wgmma.mma_async`, B from shared memory in 128-byte-swizzled tiles); at
//! head_dim 16 (rows of 32 bytes, below the swizzle's 128) on `mma.sync` m16n8k16 with
//! `ldmatrix` fragments.
//!
//! Design (forward):
//! - One CTA of 4 warps (128 threads) per 64-query tile of one (batch, query head); each warp owns
//!   16 query rows. The 1-D grid is ordered so the longest causal tiles (the last query tiles)
//!   start first; `block -> (query tile, batch, head)` is decoded in the kernel.
//! - `wgmma` path (head_dim 64, 128): a K or V tile of 64 keys is stored as `d / 64` blocks of 64
//!   keys x 64 dims, each key's 128-byte row with its 16-byte chunk `c` at `c ^ (key % 8)` (the
//!   128-byte swizzle `wgmma` reads; blocks 8 KB apart, 1024-byte aligned), copied by `cp.async`
//!   (16 bytes per thread per copy, each thread at a fixed conflict-free slot) into dynamic
//!   shared memory, and made visible to `wgmma` by `fence.proxy.async`. `S = Q K^T` is `d / 16`
//!   chained `m64n64k16` (K K-major), `O += P V` four `m64n{d}k16` (V MN-major, the transposed
//!   B); the accumulators come back in the `mma.sync` C layout, so the softmax is shared. Q is
//!   the first product's A operand: register fragments at head_dim 64 (loaded once in the
//!   `mma.sync` A layout, which is `wgmma`'s register A layout: warp `w` owns rows `16 w..16 w +
//!   16` of the m64 tile), a swizzled K-major shared tile at head_dim 128 ([`Variant`]).
//! - The key loop is software-pipelined inside the warpgroup (FA3's intra-warpgroup overlap):
//!   tiles run last to first, and iteration `j` issues `S_j = Q K_j^T` and `O += P_{j+1} V_{j+1}`
//!   as two `wgmma` groups, waits for the first only, and runs tile `j`'s softmax while the
//!   tensor cores finish the second; O is scaled by the new max after that wait, where some row
//!   of the warp moved its max (a warp vote; elsewhere the scale is exactly 1). V has two
//!   buffers (V_j loads while `P_{j+1} V_{j+1}` reads the other), K two at head_dim 64 and one at
//!   128 (K_{j-1} loads once every warp's `S_j` is done). See [`forward_wgmma`].
//! - `mma.sync` path (head_dim 16): Q fragments in registers, one K and one V tile `64 x (d + 8)`
//!   bf16 (the 16-byte row padding makes `ldmatrix` conflict-free); S = Q K^T with `ldmatrix` (K
//!   is the col-major B operand as stored), `O += P V` with `ldmatrix.trans` of V; the next K
//!   tile loads during the softmax and `P V`, the next V tile during the next `Q K^T`.
//! - The online softmax keeps
//!   the running row max in the `log2` domain (`exp2(s * scale * log2 e - m)`, `ex2.approx`),
//!   per-thread partial row sums reduced across the quad only at the end (FA2); P is converted
//!   in registers from the C-fragment layout to the A-fragment layout (`cvt.rn.bf16x2`).
//! - Causal: query tile `m` visits key tiles `0..=m`; only the diagonal tile `m` is masked (`key >
//!   query`): the `wgmma` path takes it first (its prologue), the `mma.sync` path last (a
//!   straight-line copy of the tile body after the loop); tiles beyond the diagonal are never
//!   loaded. GQA: query head `h` reads kv head `h / (hq / hkv)`.
//! - Epilogue: `O / l` rounded to bf16 (4-byte stores), `lse = (m + log2 l) ln 2` (f32).
//! - At head_dim 128 from sequence 2048 the warp-specialized forward (`fwd_ws.rs`: 128-query
//!   CTAs of two computing warpgroups and a copying one, 128-key tiles, ping-pong) replaces this
//!   design; the key loop and the softmax are shared ([`Pipelined`]).
//!
//! Supported: bf16 q/k/v/out, f32 lse, head_dim 16, 64 or 128, sequence length a multiple of 64,
//! `hq` a multiple of `hkv`, `scale > 0`. The backward kernel is in `attention_bwd.rs`.

use std::fmt::Write as _;

use titan_ir::{DType, Graph, Node, Op, Region};

use crate::values::Body;
use crate::{GenResult, Generated, invalid, unsupported};

mod fwd_ws;

/// Query rows per CTA.
const BM: u64 = 64;
/// Keys per K/V tile.
const BN: u64 = 64;
/// Threads per CTA (4 warps).
const THREADS: u64 = 128;
/// Resident CTAs per SM asked of ptxas (`.minnctapersm`) at head_dim 128: three CTAs of 128
/// threads leave 168 registers a thread (the pipelined loop with Q in shared memory takes
/// 141-143). At head_dim 64 (128 registers, 32 KB) four CTAs fit by arithmetic without asking.
const CTAS_PER_SM_D128: u32 = 3;
/// Bytes of one swizzled block: 64 keys' 128-byte rows.
const SW_BLOCK: i64 = 64 * 128;

/// Whether head_dim `d` takes the `wgmma` path (rows of whole 128-byte swizzle atoms).
pub(crate) fn uses_wgmma(d: u64) -> bool {
    d.is_multiple_of(64)
}

pub(crate) const F4: &str = "!llvm.struct<(f32, f32, f32, f32)>";
pub(crate) const I4: &str = "!llvm.struct<(i32, i32, i32, i32)>";

/// The sizes and options of one forward problem.
#[derive(Clone, Copy, Debug)]
struct Problem {
    b: u64,
    s: u64,
    hq: u64,
    hkv: u64,
    d: u64,
    causal: bool,
    scale: f64,
}

/// Minimal SSA text emitter: values are their printed names; types are tracked by the caller.
pub(crate) struct Em {
    pub(crate) body: String,
    next: u32,
    pub(crate) indent: usize,
}

impl Em {
    pub(crate) fn new() -> Em {
        Em { body: String::new(), next: 0, indent: 3 }
    }

    pub(crate) fn line(&mut self, s: &str) {
        for _ in 0..self.indent {
            self.body.push_str("  ");
        }
        self.body.push_str(s);
        self.body.push('\n');
    }

    pub(crate) fn fresh(&mut self) -> String {
        let n = format!("%a{}", self.next);
        self.next += 1;
        n
    }

    pub(crate) fn op(&mut self, rhs: &str) -> String {
        let r = self.fresh();
        self.line(&format!("{r} = {rhs}"));
        r
    }

    pub(crate) fn i32c(&mut self, x: i64) -> String {
        self.op(&format!("arith.constant {x} : i32"))
    }

    pub(crate) fn i64c(&mut self, x: i64) -> String {
        self.op(&format!("arith.constant {x} : i64"))
    }

    pub(crate) fn f32c(&mut self, x: f32) -> String {
        self.op(&format!("arith.constant 0x{:08X} : f32", x.to_bits()))
    }

    pub(crate) fn bin(&mut self, op: &str, a: &str, b: &str, ty: &str) -> String {
        self.op(&format!("arith.{op} {a}, {b} : {ty}"))
    }

    pub(crate) fn addi(&mut self, a: &str, b: &str) -> String {
        self.bin("addi", a, b, "i32")
    }

    pub(crate) fn muli(&mut self, a: &str, b: &str) -> String {
        self.bin("muli", a, b, "i32")
    }

    /// `a + k` (i32) with a constant `k`.
    pub(crate) fn addk(&mut self, a: &str, k: i64) -> String {
        if k == 0 {
            return a.to_string();
        }
        let c = self.i32c(k);
        self.addi(a, &c)
    }

    pub(crate) fn mulk(&mut self, a: &str, k: i64) -> String {
        let c = self.i32c(k);
        self.muli(a, &c)
    }

    pub(crate) fn divk(&mut self, a: &str, k: i64) -> String {
        let c = self.i32c(k);
        self.bin("divui", a, &c, "i32")
    }

    pub(crate) fn remk(&mut self, a: &str, k: i64) -> String {
        let c = self.i32c(k);
        self.bin("remui", a, &c, "i32")
    }

    pub(crate) fn ext64(&mut self, a: &str) -> String {
        self.op(&format!("arith.extui {a} : i32 to i64"))
    }

    /// `row * stride + col + base` (i64 elements): column `col` (i64) of row `row` (i32) of a
    /// row-major tensor whose rows are `stride` elements apart, from `base` (i64).
    pub(crate) fn row_offset(&mut self, row: &str, stride: i64, col: &str, base: &str) -> String {
        let r64 = self.ext64(row);
        let s = self.i64c(stride);
        let o = self.bin("muli", &r64, &s, "i64");
        let o = self.bin("addi", &o, col, "i64");
        self.bin("addi", &o, base, "i64")
    }

    pub(crate) fn fadd(&mut self, a: &str, b: &str) -> String {
        self.bin("addf", a, b, "f32")
    }

    pub(crate) fn fsub(&mut self, a: &str, b: &str) -> String {
        self.bin("subf", a, b, "f32")
    }

    pub(crate) fn fmul(&mut self, a: &str, b: &str) -> String {
        self.bin("mulf", a, b, "f32")
    }

    pub(crate) fn intr(&mut self, name: &str, args: &[&str], tys: &str, ret: &str) -> String {
        self.op(&format!("llvm.call_intrinsic \"{name}\"({}) : ({tys}) -> {ret}", args.join(", ")))
    }

    pub(crate) fn fmax(&mut self, a: &str, b: &str) -> String {
        self.intr("llvm.maxnum.f32", &[a, b], "f32, f32", "f32")
    }

    pub(crate) fn fma(&mut self, a: &str, b: &str, c: &str) -> String {
        self.intr("llvm.fma.f32", &[a, b, c], "f32, f32, f32", "f32")
    }

    /// `2^a` on the special-function unit: `ex2.approx.ftz.f32` where `ftz` (a result below
    /// 2^-126 is 0: ptxas emits the bare `MUFU.EX2`), else `ex2.approx.f32`, which ptxas wraps in
    /// a compare and two multiplies per call to keep subnormal results.
    pub(crate) fn ex2(&mut self, a: &str, ftz: bool) -> String {
        let name = if ftz { "llvm.nvvm.ex2.approx.ftz.f32" } else { "llvm.nvvm.ex2.approx.f32" };
        self.intr(name, &[a], "f32", "f32")
    }

    pub(crate) fn lg2(&mut self, a: &str) -> String {
        self.intr("llvm.nvvm.lg2.approx.f", &[a], "f32", "f32")
    }

    /// `shfl.sync.bfly` of an f32 over the full warp.
    pub(crate) fn shfl_xor(&mut self, v: &str, off: i64) -> String {
        let o = self.i32c(off);
        let w = self.i32c(32);
        let r = self.fresh();
        let ok = self.fresh();
        self.line(&format!("{r}, {ok} = gpu.shuffle xor {v}, {o}, {w} : f32"));
        r
    }

    /// `ptr + off` elements of `elem` (`off` i64 or i32).
    pub(crate) fn gep(&mut self, ptr: &str, space: u32, off: &str, oty: &str, elem: &str) -> String {
        self.op(&format!("llvm.getelementptr {ptr}[{off}] : (!llvm.ptr<{space}>, {oty}) -> !llvm.ptr<{space}>, {elem}"))
    }

    /// `ptr + k` bf16 elements (a constant offset).
    pub(crate) fn gepk(&mut self, ptr: &str, space: u32, k: i64) -> String {
        if k == 0 {
            return ptr.to_string();
        }
        let c = self.i32c(k);
        self.gep(ptr, space, &c, "i32", "bf16")
    }

    pub(crate) fn extract(&mut self, s: &str, i: usize, ty: &str) -> String {
        self.op(&format!("llvm.extractvalue {s}[{i}] : {ty}"))
    }

    /// Two f32 rounded to a packed bf16 pair (`cvt.rn.bf16x2.f32`), `lo` in the low half.
    pub(crate) fn pack_bf16(&mut self, lo: &str, hi: &str) -> String {
        let v = self.op(&format!("vector.from_elements {lo}, {hi} : vector<2xf32>"));
        let t = self.op(&format!("arith.truncf {v} : vector<2xf32> to vector<2xbf16>"));
        self.op(&format!("llvm.bitcast {t} : vector<2xbf16> to i32"))
    }

    /// `ldmatrix.x4` (optionally `.trans`) from shared memory: four b16x2 registers.
    pub(crate) fn ldmatrix4(&mut self, ptr: &str, trans: bool) -> [String; 4] {
        let layout = if trans { "col" } else { "row" };
        let s = self.op(&format!(
            "nvvm.ldmatrix {ptr} {{num = 4 : i32, layout = #nvvm.mma_layout<{layout}>, shape = #nvvm.ld_st_matrix_shape<m = 8, n = 8>, eltType = #nvvm.ld_st_matrix_elt_type<b16>}} : (!llvm.ptr<3>) -> {I4}"
        ));
        [0, 1, 2, 3].map(|i| self.extract(&s, i, I4))
    }

    /// `c += a b` with `mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32`.
    pub(crate) fn mma(&mut self, a: &[String; 4], b: [&str; 2], c: &[String; 4]) -> [String; 4] {
        let s = self.op(&format!(
            "nvvm.mma.sync A[{}, {}, {}, {}] B[{}, {}] C[{}, {}, {}, {}] {{layoutA = #nvvm.mma_layout<row>, layoutB = #nvvm.mma_layout<col>, multiplicandAPtxType = #nvvm.mma_type<bf16>, multiplicandBPtxType = #nvvm.mma_type<bf16>, shape = #nvvm.shape<m = 16, n = 8, k = 16>}} : (i32, i32, f32) -> {F4}",
            a[0], a[1], a[2], a[3], b[0], b[1], c[0], c[1], c[2], c[3]
        ));
        [0, 1, 2, 3].map(|i| self.extract(&s, i, F4))
    }

    pub(crate) fn barrier(&mut self) {
        self.line("gpu.barrier");
    }

    /// Named barrier `id` (i32, 1-15) of `threads` threads: `bar.sync` (arrive and wait) or
    /// `bar.arrive` (arrive only).
    pub(crate) fn named_barrier(&mut self, wait: bool, id: &str, threads: i64) {
        let op = if wait { "bar.sync" } else { "bar.arrive" };
        let n = self.i32c(threads);
        self.line(&format!("llvm.inline_asm has_side_effects \"{op} $0, $1;\", \"r,r,~{{memory}}\" {id}, {n} : (i32, i32) -> ()"));
    }

    /// `fence.proxy.async.shared::cta`: this thread's generic-proxy writes to shared memory (its
    /// `cp.async` copies, once waited for) become visible to async-proxy reads (`wgmma`).
    pub(crate) fn fence_proxy_async(&mut self) {
        self.line("llvm.inline_asm has_side_effects \"fence.proxy.async.shared::cta;\", \"\" : () -> ()");
    }

    /// The 32-bit shared-memory address of `ptr` (`!llvm.ptr<3>`), as PTX's `[reg]` operands of
    /// the `mbarrier` instructions take it.
    pub(crate) fn smem_addr32(&mut self, ptr: &str) -> String {
        self.op(&format!("llvm.ptrtoint {ptr} : !llvm.ptr<3> to i32"))
    }

    /// `mbarrier.init`: the barrier at shared address `bar` (i32) expects `count` arrivals a phase.
    pub(crate) fn mbar_init(&mut self, bar: &str, count: i64) {
        let c = self.i32c(count);
        self.line(&format!("llvm.inline_asm has_side_effects \"mbarrier.init.shared::cta.b64 [$0], $1;\", \"r,r,~{{memory}}\" {bar}, {c} : (i32, i32) -> ()"));
    }

    /// `mbarrier.arrive` (release): this thread's earlier shared-memory accesses happen before the
    /// phase completes for any thread that waits for it.
    pub(crate) fn mbar_arrive(&mut self, bar: &str) {
        self.line(&format!("llvm.inline_asm has_side_effects \"mbarrier.arrive.shared::cta.b64 _, [$0];\", \"r,~{{memory}}\" {bar} : (i32) -> ()"));
    }

    /// Wait (acquire) until the phase of parity `parity` (i32, 0 or 1) of barrier `bar` has
    /// completed. A barrier starts in phase 0, so waiting for parity 1 before any phase has
    /// completed returns at once (the first use of an empty slot).
    pub(crate) fn mbar_wait(&mut self, bar: &str, parity: &str) {
        self.line(&format!(
            "llvm.inline_asm has_side_effects \"{{ .reg .pred P; WAIT: mbarrier.try_wait.parity.shared::cta.b64 P, [$0], $1; @!P bra WAIT; }}\", \"r,r,~{{memory}}\" {bar}, {parity} : (i32, i32) -> ()"
        ));
    }

    /// `setmaxnreg`: every warp of the warpgroup moves its register allocation to `n` (a multiple
    /// of 8 in 24..=256; `inc` to grow, else shrink). The warpgroup must execute it together.
    pub(crate) fn setmaxnreg(&mut self, inc: bool, n: u32) {
        let dir = if inc { "inc" } else { "dec" };
        self.line(&format!("llvm.inline_asm has_side_effects \"setmaxnreg.{dir}.sync.aligned.u32 {n};\", \"~{{memory}}\" : () -> ()"));
    }

    pub(crate) fn cp_async16(&mut self, dst: &str, src: &str) {
        self.line(&format!("nvvm.cp.async.shared.global {dst}, {src}, 16, cache = cg : !llvm.ptr<3>, !llvm.ptr<1>"));
    }

    pub(crate) fn commit(&mut self) {
        self.line("nvvm.cp.async.commit.group");
    }

    pub(crate) fn wait_group(&mut self, n: u32) {
        self.line(&format!("nvvm.cp.async.wait.group {n}"));
    }
}

/// `scf.if cond { then }` (no results).
pub(crate) fn if_then(e: &mut Em, cond: &str, then: impl FnOnce(&mut Em)) {
    e.line(&format!("scf.if {cond} {{"));
    e.indent += 1;
    then(e);
    e.indent -= 1;
    e.line("}");
}

/// `scf.if cond -> (f32...) { then } else { vals }`: the f32 values `then` yields where `cond`
/// holds, else `vals` unchanged.
pub(crate) fn if_map_f32(e: &mut Em, cond: &str, vals: &[String], then: impl FnOnce(&mut Em) -> Vec<String>) -> Vec<String> {
    let res: Vec<String> = vals.iter().map(|_| e.fresh()).collect();
    let tys = vec!["f32"; vals.len()].join(", ");
    e.line(&format!("{} = scf.if {cond} -> ({tys}) {{", res.join(", ")));
    e.indent += 1;
    let out = then(e);
    e.line(&format!("scf.yield {} : {tys}", out.join(", ")));
    e.indent -= 1;
    e.line("} else {");
    e.indent += 1;
    e.line(&format!("scf.yield {} : {tys}", vals.join(", ")));
    e.indent -= 1;
    e.line("}");
    res
}

/// `scf.if cond { then } else { other }` (no results).
pub(crate) fn if_else(e: &mut Em, cond: &str, then: impl FnOnce(&mut Em), other: impl FnOnce(&mut Em)) {
    e.line(&format!("scf.if {cond} {{"));
    e.indent += 1;
    then(e);
    e.indent -= 1;
    e.line("} else {");
    e.indent += 1;
    other(e);
    e.indent -= 1;
    e.line("}");
}

/// `scf.for iv = lo to hi step 1` carrying nothing.
pub(crate) fn for_each(e: &mut Em, lo: &str, hi: &str, body: impl FnOnce(&mut Em, &str)) {
    let iv = e.fresh();
    let one = e.i32c(1);
    e.line(&format!("scf.for {iv} = {lo} to {hi} step {one} : i32 {{"));
    e.indent += 1;
    body(e, &iv);
    e.indent -= 1;
    e.line("}");
}

/// Where each of `node`'s results sits among the body's outputs: the body must output every
/// result exactly once (`what` names the kernel, `names` its results, for errors).
pub(crate) fn output_slots<const N: usize>(r: &Region, node: &Node, what: &str, names: &str) -> GenResult<[usize; N]> {
    let mut outs = [usize::MAX; N];
    for (i, o) in r.outputs.iter().enumerate() {
        match node.results.iter().position(|&v| v == o.value) {
            Some(p) if p < N && outs[p] == usize::MAX => outs[p] = i,
            _ => return invalid(format!("the outputs of an {what} body must be its node's {names}, once each")),
        }
    }
    if outs.contains(&usize::MAX) || r.outputs.len() != N {
        return unsupported(format!("the {what} kernel writes {names}; the body must output all of them"));
    }
    Ok(outs)
}

/// The sizes `[b, s, hq, hkv, d]` of an attention node's q, k and v (its first three inputs),
/// checked for the `what` kernel: `[batch, seq, heads, head_dim]`, v shaped like k, whole GQA
/// groups, head_dim 16, 64 or 128, a sequence length that is a multiple of 64, a positive scale.
pub(crate) fn checked_sizes(b: &Body, node: &Node, scale: f64, what: &str) -> GenResult<[u64; 5]> {
    let (qs, ks) = (&b.shape[node.inputs[0].index()], &b.shape[node.inputs[1].index()]);
    let (&[bb, s, hq, d], &[kb, kss, hkv, kd]) = (qs.as_slice(), ks.as_slice()) else {
        return invalid(format!("{what} q and k must be [batch, seq, heads, head_dim]"));
    };
    if (kb, kss, kd) != (bb, s, d) || b.shape[node.inputs[2].index()] != *ks || hkv == 0 || hq % hkv != 0 {
        return invalid(format!("{what} q, k, v shapes do not match"));
    }
    if !matches!(d, 16 | 64 | 128) {
        return unsupported(format!("{what} head_dim {d} (the kernel supports 16, 64 and 128)"));
    }
    if s == 0 || s % BM != 0 {
        return unsupported(format!("{what} sequence length {s} (the kernel needs a multiple of {BM})"));
    }
    if !(scale.is_finite() && scale > 0.0) {
        return unsupported(format!("{what} scale {scale} (the kernel needs a positive scale)"));
    }
    Ok([bb, s, hq, hkv, d])
}

/// Read the forward body: one `attention` node over body arguments, both results as outputs.
/// Returns the problem and the parameter order: (q, k, v) argument indices and (out, lse)
/// output indices.
fn read_forward(g: &Graph, r: &Region) -> GenResult<(Problem, [usize; 3], [usize; 2])> {
    let b = Body::new(g, r)?;
    let nodes: Vec<_> = b.nodes().collect();
    let [node] = nodes.as_slice() else {
        return unsupported(format!("an attention body must hold exactly one attention node, found {} nodes", nodes.len()));
    };
    let Op::Attention { causal, scale } = node.op else {
        return invalid(format!("an attention body holds `{}`; expected attention", node.op.name()));
    };
    let (Some(qi), Some(ki), Some(vi)) = (b.arg_index(node.inputs[0]), b.arg_index(node.inputs[1]), b.arg_index(node.inputs[2])) else {
        return invalid("the q, k and v of an attention kernel must be body arguments");
    };
    let outs = output_slots::<2>(r, node, "attention", "out and lse")?;
    for (v, what) in [(node.inputs[0], "q"), (node.inputs[1], "k"), (node.inputs[2], "v"), (node.results[0], "out")] {
        if b.dtype(v) != DType::BF16 {
            return unsupported(format!("attention {what} must be bf16, found {:?}", b.dtype(v)));
        }
    }
    if b.dtype(node.results[1]) != DType::F32 {
        return unsupported("attention lse must be f32");
    }
    let [bb, s, hq, hkv, d] = checked_sizes(&b, node, scale, "attention")?;
    let grid = (s / BM) * bb * hq;
    if grid == 0 || grid > u64::from(u32::MAX) || bb * s * hq * d >= 1 << 40 {
        return unsupported("attention problem size out of range");
    }
    Ok((Problem { b: bb, s, hq, hkv, d, causal, scale }, [qi, ki, vi], outs))
}

/// The attention forward kernel for `r`.
pub(crate) fn generate(g: &Graph, r: &Region, entry: &str) -> GenResult<Generated> {
    let (p, ins, outs) = read_forward(g, r)?;
    let n_args = r.args.len();
    let params: Vec<String> = (0..n_args + 2).map(|i| format!("%p{i}")).collect();
    let qp = params[ins[0]].clone();
    let kp = params[ins[1]].clone();
    let vp = params[ins[2]].clone();
    let op = params[n_args + outs[0]].clone();
    let lp = params[n_args + outs[1]].clone();
    let var = Variant::for_head_dim(p.d);
    let ws = fwd_ws::enabled(&p);
    let (grid, block, attrs, body, bytes) = if ws {
        let (grid, block, attrs) = fwd_ws::launch(&p);
        (grid, block, attrs, fwd_ws::body(&p, &qp, &kp, &vp, &op, &lp), fwd_ws::smem_bytes(p.d as i64) as u64)
    } else {
        let occupancy = if p.d == 128 { format!(", nvvm.minctasm = {CTAS_PER_SM_D128} : i32") } else { String::new() };
        let grid = ((p.s / BM) * p.b * p.hq) as u32;
        (grid, THREADS as u32, occupancy, forward_body(&p, var, &qp, &kp, &vp, &op, &lp), smem_layout(p.d, var).0)
    };
    let mut m = String::new();
    m.push_str("module attributes {gpu.container_module} {\n  gpu.module @titan {\n");
    // 1024-byte aligned: the swizzled `wgmma` tiles repeat their pattern every 1 KB.
    m.push_str("    llvm.mlir.global external @att_smem() {addr_space = 3 : i32, alignment = 1024 : i64} : !llvm.array<0 x i8>\n");
    let ps: Vec<String> = params.iter().map(|p| format!("{p}: !llvm.ptr<1>")).collect();
    let _ = writeln!(
        m,
        "    gpu.func @{entry}({}) kernel attributes {{known_block_size = array<i32: {block}, 1, 1>, known_grid_size = array<i32: {grid}, 1, 1>{attrs}}} {{",
        ps.join(", ")
    );
    m.push_str(&body);
    m.push_str("      gpu.return\n    }\n  }\n}\n");
    Ok(Generated { shared_bytes: bytes as u32, ..Generated::new(m, block, grid, 0) })
}

/// Dynamic shared memory of the forward kernel at head_dim `d`: (bytes, element offsets of the
/// V buffers and of Q's tile). `wgmma` path: `v.k_bufs` K buffers, two V buffers, then Q's
/// tile if it lives there, each of 64 rows in 128-byte-swizzled 64-dim blocks (a multiple of
/// 1 KB, so every buffer keeps the swizzle's alignment); `mma.sync` path: one K and one V tile
/// of `64 x (d + 8)` (padded rows for `ldmatrix`).
fn smem_layout(d: u64, v: Variant) -> (u64, i64, i64) {
    if uses_wgmma(d) {
        let tile = BN * d;
        let kv = (v.k_bufs + 2) * tile;
        let q = if v.q_smem { BM * d } else { 0 };
        ((kv + q) * 2, (v.k_bufs * tile) as i64, kv as i64)
    } else {
        let tile = BN * (d + 8);
        (2 * tile * 2, tile as i64, 0)
    }
}

/// How the `wgmma` path holds Q and K, by head_dim (measured on the H200, 2026-12-03, perf
/// cases on normal inputs: docs/performance.md, session 15). head_dim 128: Q in shared memory
/// (the first product's A operand from a descriptor) and one K buffer, which leaves 141-143
/// registers and 64 KB a CTA, so three CTAs fit an SM (Q in registers with two K buffers
/// needs more than the 168 registers of three CTAs: ptxas spills and serializes the `wgmma`s;
/// at two CTAs an SM it ran 530 against 554 TFLOP/s at seq 8192). head_dim 64: Q in registers
/// and two K buffers (128 registers and 32 KB: four CTAs an SM by arithmetic): 436 against 423 TFLOP/s with Q
/// in shared memory.
#[derive(Clone, Copy, Debug)]
struct Variant {
    q_smem: bool,
    k_bufs: u64,
}

impl Variant {
    fn for_head_dim(d: u64) -> Variant {
        let q_smem = d == 128;
        Variant { q_smem, k_bufs: if q_smem { 1 } else { 2 } }
    }
}

/// The loop-carried state of the forward pass: O fragments (`d / 8` n-tiles of 4), then the
/// running max and partial sum of the thread's two rows.
struct State {
    o: Vec<[String; 4]>,
    m: [String; 2],
    l: [String; 2],
}

impl State {
    fn flat(&self) -> Vec<String> {
        let mut v: Vec<String> = self.o.iter().flat_map(|t| t.iter().cloned()).collect();
        v.extend(self.m.iter().cloned());
        v.extend(self.l.iter().cloned());
        v
    }

    fn from_flat(v: &[String], nt: usize) -> State {
        let o = (0..nt).map(|i| [0, 1, 2, 3].map(|j| v[4 * i + j].clone())).collect();
        State { o, m: [v[4 * nt].clone(), v[4 * nt + 1].clone()], l: [v[4 * nt + 2].clone(), v[4 * nt + 3].clone()] }
    }
}

/// Q's shared tile (`Variant::q_smem`).
struct QTile {
    /// Its shared buffer.
    smem: String,
    /// The global pointer at this thread's first copy chunk of the CTA's Q tile.
    g: String,
    /// Elements between query rows in global memory (`hq * d`).
    row: i64,
    /// Its `wgmma` descriptor: Q is the first product's A operand, K-major like K.
    desc: String,
}

/// Per-thread values the tile body needs.
struct Ctx {
    d: u64,
    stride: i64,
    causal: bool,
    /// `scale * log2(e)`.
    c: String,
    qf: Vec<[String; 4]>,
    /// Q in shared memory (`Variant::q_smem`; `qf` is then empty).
    q_tile: Option<QTile>,
    /// How the `wgmma` path holds Q and K.
    var: Variant,
    ks: String,
    vs: String,
    /// The `wgmma` path (else `mma.sync`).
    wgmma: bool,
    /// Shared pointers at this lane's `ldmatrix` row for K and V (`mma.sync` path).
    k_lm: String,
    v_lm: String,
    /// `wgmma` descriptors (i64) of the K and V tiles ([`sw128_descriptor`]).
    k_desc: String,
    v_desc: String,
    /// Global K/V pointers at this thread's first copy chunk of key tile 0.
    k_g: String,
    v_g: String,
    /// Shared element offset of this thread's first copy chunk (either path's layout).
    s_off: String,
    /// Elements between key rows in global memory (`hkv * d`).
    kv_row: i64,
    /// Number of key tiles this CTA visits (i32).
    n_tiles: String,
    /// Query row within the tile of this thread's two rows (for the causal mask).
    qrow: [String; 2],
    /// Key column offset within an 8-key n-tile (`2 * (lane % 4)`).
    kcol: String,
}

/// Issue the cp.async copies of key tile `j` (i32) of K or V into the shared buffer at `sbase`.
fn load_tile(e: &mut Em, cx: &Ctx, j: &str, v: bool, sbase: &str) {
    let gbase = if v { &cx.v_g } else { &cx.k_g };
    let cpr = (cx.d / 8) as i64;
    let iters = (BN * cx.d / 8 / THREADS) as i64;
    let rows_per_iter = THREADS as i64 / cpr;
    let j64 = e.ext64(j);
    let tile = e.i64c(BN as i64 * cx.kv_row);
    let off = e.bin("muli", &j64, &tile, "i64");
    let g0 = e.gep(gbase, 1, &off, "i64", "bf16");
    let s0 = e.gep(sbase, 3, &cx.s_off, "i32", "bf16");
    for it in 0..iters {
        let (gk, sk) = if cx.wgmma { sw128_copy(it, BN as i64, cx.kv_row) } else { (it * rows_per_iter * cx.kv_row, it * rows_per_iter * cx.stride) };
        let gk = e.i64c(gk);
        let gp = e.gep(&g0, 1, &gk, "i64", "bf16");
        let sp = e.gepk(&s0, 3, sk);
        e.cp_async16(&sp, &gp);
    }
}

/// Issue the cp.async copies of this CTA's Q tile into its shared buffer, if Q lives there
/// (`Variant::q_smem`): the swizzled K-major layout of a K tile, 64 query rows `hq * d`
/// elements apart.
fn load_q_tile(e: &mut Em, cx: &Ctx) {
    let iters = (BM * cx.d / 8 / THREADS) as i64;
    let Some(q) = &cx.q_tile else { return };
    let s0 = e.gep(&q.smem, 3, &cx.s_off, "i32", "bf16");
    for it in 0..iters {
        let (gk, sk) = sw128_copy(it, BM as i64, q.row);
        let gk = e.i64c(gk);
        let gp = e.gep(&q.g, 1, &gk, "i64", "bf16");
        let sp = e.gepk(&s0, 3, sk);
        e.cp_async16(&sp, &gp);
    }
}

/// Element offset (i32) of 16-byte chunk `chunk` of row `row` in a 128-byte-swizzled block of
/// 128-byte rows: `row * 64 + ((chunk ^ (row % 8)) * 8)` bf16 elements.
pub(crate) fn sw128_slot(e: &mut Em, row: &str, chunk: &str) -> String {
    let r8 = e.remk(row, 8);
    let x = e.op(&format!("arith.xori {chunk}, {r8} : i32"));
    let ro = e.mulk(row, 64);
    let xo = e.mulk(&x, 8);
    e.addi(&ro, &xo)
}

/// (global, shared) element offsets of copy `it` of a tile of `rows` rows into 128-byte-swizzled
/// blocks of 64 dims: a copy is one warpgroup's 128 16-byte chunks in storage order (block `b`,
/// 16 rows from `r0`), global rows `grow` elements apart. Each thread adds its own row and
/// swizzled slot ([`sw128_slot`] of row `tid / 8`, chunk `tid % 8`).
pub(crate) fn sw128_copy(it: i64, rows: i64, grow: i64) -> (i64, i64) {
    let q = it * THREADS as i64;
    let (b, r0) = (q / (rows * 8), q % (rows * 8) / 8);
    (r0 * grow + b * 64, b * rows * 64 + r0 * 64)
}

/// The k-step advances (16-byte units) of a K-major `wgmma` operand of `rows` rows over `d`
/// dims: 16 dims are 32 bytes along the swizzled rows, the next 64-dim block every four steps.
pub(crate) fn sw128_kmajor_steps(d: i64, rows: i64) -> Vec<i64> {
    (0..d / 16).map(|k| (k / 4) * rows * 128 / 16 + (k % 4) * 2).collect()
}

/// The k-step advances (16-byte units) of an MN-major `wgmma` B operand whose K runs over
/// `k_rows` rows: 16 rows, two 1 KB groups of eight, per step.
pub(crate) fn sw128_mnmajor_steps(k_rows: i64) -> Vec<i64> {
    (0..k_rows / 16).map(|k| k * 2048 / 16).collect()
}

/// Descriptor `desc` (of the tile at shared element offset 0) moved to element offset `off`
/// (i32): `off / 8` 16-byte units added to its start address.
pub(crate) fn sw128_desc_at(e: &mut Em, desc: &str, off: &str) -> String {
    let u = e.divk(off, 8);
    let u = e.ext64(&u);
    e.bin("addi", desc, &u, "i64")
}

/// A `wgmma` shared-memory matrix descriptor (i64) for the tile at `base` in the 128-byte swizzle
/// (bits 62-63 = 1): start address >> 4 in bits 0-13, the leading byte offset >> 4 in 16-29, the
/// stride byte offset >> 4 in 32-45. K-major (K): `lbo` unused, `sbo` = 1024 between groups of
/// eight keys. MN-major (V, N = dims): `lbo` = the 8 KB between 64-dim blocks, `sbo` = 1024
/// between groups of eight keys along K (measured: with the two swapped the kernel faults).
pub(crate) fn sw128_descriptor(e: &mut Em, base: &str, lbo: i64, sbo: i64) -> String {
    let addr = e.op(&format!("llvm.ptrtoint {base} : !llvm.ptr<3> to i64"));
    let sh = e.i64c(4);
    let a4 = e.bin("shrui", &addr, &sh, "i64");
    let mask = e.i64c(0x3fff);
    let a4 = e.bin("andi", &a4, &mask, "i64");
    let fields = e.i64c((lbo >> 4) << 16 | (sbo >> 4) << 32 | 1 << 62);
    e.bin("ori", &a4, &fields, "i64")
}

/// The A operand of a [`wgmma_chain`]: one `mma.sync`-layout fragment per 16-wide k-step from
/// registers, or a shared-memory descriptor (i64) advanced by the given 16-byte units per
/// k-step, K-major (`Smem`) or MN-major (`SmemMn`: M contiguous, the transpose-A immediate).
#[derive(Clone, Copy)]
pub(crate) enum WgA<'a> {
    Regs(&'a [[String; 4]]),
    Smem(&'a str, &'a [i64]),
    SmemMn(&'a str, &'a [i64]),
}

impl WgA<'_> {
    /// The shared-memory descriptor and its k-step advances, if A is in shared memory.
    fn smem(&self) -> Option<(&str, &[i64])> {
        match self {
            WgA::Regs(_) => None,
            WgA::Smem(d, o) | WgA::SmemMn(d, o) => Some((d, o)),
        }
    }
}

/// A chain of `wgmma.mma_async.m64n{n}k16` (bf16 in, f32 accumulators) over the k-steps of `a`,
/// B through `desc` advanced by `offs[k]` 16-byte units at k-step `k` (`trans_b`: B is
/// MN-major), issued then waited for at once. `acc` (`n / 2` per thread, the `mma.sync` C layout
/// of `n / 8` n-tiles) is added to; the sums come back the same way. Inline PTX: the
/// accumulators are tied outputs.
pub(crate) fn wgmma_chain(e: &mut Em, n: usize, acc: &[String], a: WgA, desc: &str, offs: &[i64], trans_b: bool) -> Vec<String> {
    wgmma_asm(e, n, acc, a, desc, offs, trans_b, true, true)
}

/// [`wgmma_chain`] issued and committed as one `wgmma` group, not waited for: the results are
/// in flight until a [`wgmma_wait`] that passes them through. `accumulate: false` computes
/// `A B` alone (scale-d 0: `acc` is not read, `llvm.mlir.undef` will do).
#[allow(clippy::too_many_arguments)]
fn wgmma_issue(e: &mut Em, n: usize, acc: &[String], a: WgA, desc: &str, offs: &[i64], trans_b: bool, accumulate: bool) -> Vec<String> {
    wgmma_asm(e, n, acc, a, desc, offs, trans_b, accumulate, false)
}

#[allow(clippy::too_many_arguments)]
fn wgmma_asm(e: &mut Em, n: usize, acc: &[String], a: WgA, desc: &str, offs: &[i64], trans_b: bool, accumulate: bool, wait: bool) -> Vec<String> {
    let na = n / 2;
    let a0 = 2 * na;
    let (n_areg, ksteps) = match (&a, a.smem()) {
        (WgA::Regs(f), _) => (4 * f.len(), f.len()),
        (_, Some((_, o))) => (1, o.len()),
        _ => unreachable!("A is in registers or in shared memory"),
    };
    let dsc = a0 + n_areg;
    let accs: Vec<String> = (0..na).map(|i| format!("${i}")).collect();
    let regs = if a.smem().is_some() { "d, da" } else { "d" };
    // p: scale-d (from the i32 argument: 1 accumulates). A non-accumulating chain's first
    // k-step takes p (0: the accumulators are not read), its later k-steps q (1).
    let mut asm = if accumulate {
        format!("{{ .reg .pred p; .reg .b64 {regs}; setp.ne.b32 p, ${}, 0; wgmma.fence.sync.aligned; ", dsc + 1)
    } else {
        format!("{{ .reg .pred p, q; .reg .b64 {regs}; setp.ne.b32 p, ${0}, 0; setp.eq.b32 q, ${0}, 0; wgmma.fence.sync.aligned; ", dsc + 1)
    };
    for (k, off) in offs.iter().enumerate().take(ksteps) {
        let aop = match a.smem() {
            None => format!("{{{}}}", (0..4).map(|i| format!("${}", a0 + 4 * k + i)).collect::<Vec<_>>().join(", ")),
            Some((_, ao)) => {
                let _ = write!(asm, "add.s64 da, ${a0}, {}; ", ao[k]);
                "da".to_string()
            }
        };
        // The register-A form has no transpose-A immediate; the descriptor form's is 0 for
        // K-major, 1 for MN-major.
        let ta = match a {
            WgA::Regs(_) => "",
            WgA::Smem(..) => "0, ",
            WgA::SmemMn(..) => "1, ",
        };
        let pd = if k == 0 || accumulate { "p" } else { "q" };
        let _ = write!(
            asm,
            "add.s64 d, ${dsc}, {off}; wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{}}}, {aop}, d, {pd}, 1, 1, {ta}{}; ",
            accs.join(", "),
            u8::from(trans_b)
        );
    }
    asm += "wgmma.commit_group.sync.aligned; ";
    if wait {
        asm += "wgmma.wait_group.sync.aligned 0; ";
    }
    asm += "}";
    let mut cons: Vec<String> = (0..na).map(|_| "=f".to_string()).collect();
    cons.extend((0..na).map(|i| i.to_string()));
    let mut args: Vec<String> = acc.to_vec();
    let mut tys = vec!["f32"; na];
    match a {
        WgA::Regs(f) => {
            cons.extend((0..n_areg).map(|_| "r".to_string()));
            args.extend(f.iter().flat_map(|x| x.iter().cloned()));
            tys.extend(vec!["i32"; n_areg]);
        }
        WgA::Smem(ad, _) | WgA::SmemMn(ad, _) => {
            cons.push("l".to_string());
            args.push(ad.to_string());
            tys.push("i64");
        }
    }
    cons.extend(["l".to_string(), "r".to_string()]);
    let scale_d = e.i32c(i64::from(accumulate));
    args.extend([desc.to_string(), scale_d]);
    tys.extend(["i64", "i32"]);
    let sty = format!("!llvm.struct<({})>", vec!["f32"; na].join(", "));
    let r = e.op(&format!("llvm.inline_asm has_side_effects \"{asm}\", \"{}\" {} : ({}) -> {sty}", cons.join(","), args.join(", "), tys.join(", ")));
    (0..na).map(|i| e.extract(&r, i, &sty)).collect()
}

/// `wgmma.wait_group.sync.aligned pending`: every `wgmma` group but the newest `pending` is
/// done. `f` (f32) and `r` (i32) pass through tied, so each later use reads the value after the
/// wait (the accumulators of a finished chain) and the register A fragments of a chain still in
/// flight stay allocated, unchanged, until it is waited for (the PTX rule for async operands).
fn wgmma_wait(e: &mut Em, pending: u32, f: &[String], r: &[String]) -> (Vec<String>, Vec<String>) {
    let n = f.len() + r.len();
    let mut cons: Vec<String> = f.iter().map(|_| "=f".to_string()).chain(r.iter().map(|_| "=r".to_string())).collect();
    cons.extend((0..n).map(|i| i.to_string()));
    let args: Vec<String> = f.iter().chain(r).cloned().collect();
    let tys: Vec<&str> = f.iter().map(|_| "f32").chain(r.iter().map(|_| "i32")).collect();
    let sty = format!("!llvm.struct<({})>", tys.join(", "));
    let v = e.op(&format!(
        "llvm.inline_asm has_side_effects \"wgmma.wait_group.sync.aligned {pending};\", \"{}\" {} : ({}) -> {sty}",
        cons.join(","),
        args.join(", "),
        tys.join(", ")
    ));
    let out: Vec<String> = (0..n).map(|i| e.extract(&v, i, &sty)).collect();
    (out[..f.len()].to_vec(), out[f.len()..].to_vec())
}

/// Accumulators grouped as `mma.sync` n-tiles of 4.
fn n_tiles(v: &[String]) -> Vec<[String; 4]> {
    v.chunks(4).map(|c| [0, 1, 2, 3].map(|i| c[i].clone())).collect()
}

/// Diagonal tile: key (n-tile * 8 + `kcol` + i) > query row (`qrow`, the thread's two rows; keys
/// and rows counted from the tile's first key, which is its first query row) -> -inf.
fn mask_diagonal(e: &mut Em, kcol: &str, qrow: &[String; 2], s: &mut [[String; 4]]) {
    let ninf = e.f32c(f32::NEG_INFINITY);
    for (nt, t) in s.iter_mut().enumerate() {
        for (i, x) in t.iter_mut().enumerate() {
            let key = e.addk(kcol, nt as i64 * 8 + (i % 2) as i64);
            let gt = e.op(&format!("arith.cmpi ugt, {key}, {} : i32", qrow[i / 2]));
            *x = e.op(&format!("arith.select {gt}, {ninf}, {x} : f32"));
        }
    }
}

/// The online softmax of one S tile (n-tiles of 8 keys in the C layout: c0, c1 in row g, c2, c3
/// in row g + 8; `c` = `scale log2 e`) against the running max `m` and partial sums `l` of the thread's two rows. Returns
/// the new max, `alpha = exp2(m - m_new)` (what O must be scaled by), `l alpha` plus this tile's
/// row sums, and P as A fragments (key step kk covers n-tiles 2kk and 2kk + 1).
fn online_softmax(e: &mut Em, c: &str, s: &mut [[String; 4]], m: &[String; 2], l: &[String; 2]) -> ([String; 2], [String; 2], [String; 2], Vec<[String; 4]>) {
    let ftz = ex2_ftz(crate::switches::Switch::AttFwdEx2);
    let mut m_new = [String::new(), String::new()];
    let mut alpha = [String::new(), String::new()];
    for r in 0..2 {
        let mut mx = s[0][2 * r].clone();
        for (nt, t) in s.iter().enumerate() {
            for i in 0..2 {
                if nt == 0 && i == 0 {
                    continue;
                }
                mx = e.fmax(&mx, &t[2 * r + i]);
            }
        }
        for off in [1, 2] {
            let o = e.shfl_xor(&mx, off);
            mx = e.fmax(&mx, &o);
        }
        let mxs = e.fmul(&mx, c);
        m_new[r] = e.fmax(&m[r], &mxs);
        let dm = e.fsub(&m[r], &m_new[r]);
        alpha[r] = e.ex2(&dm, ftz);
    }
    let neg_m = [0, 1].map(|r| e.op(&format!("arith.negf {} : f32", m_new[r])));
    let mut l = [e.fmul(&l[0], &alpha[0]), e.fmul(&l[1], &alpha[1])];
    for t in s.iter_mut() {
        for (i, x) in t.iter_mut().enumerate() {
            let y = e.fma(x, c, &neg_m[i / 2]);
            *x = e.ex2(&y, ftz);
            l[i / 2] = e.fadd(&l[i / 2], x);
        }
    }
    let pf: Vec<[String; 4]> = (0..s.len() / 2)
        .map(|kk| {
            let (t0, t1) = (&s[2 * kk], &s[2 * kk + 1]);
            [e.pack_bf16(&t0[0], &t0[1]), e.pack_bf16(&t0[2], &t0[3]), e.pack_bf16(&t1[0], &t1[1]), e.pack_bf16(&t1[2], &t1[3])]
        })
        .collect();
    (m_new, alpha, l, pf)
}

/// One key tile `j` on `mma.sync` (head_dim 16): S = Q K^T, (mask), online softmax, O += P V,
/// each product waited for before the next step. Returns the new state.
fn tile_body(e: &mut Em, cx: &Ctx, j: &str, st: &State, masked: bool) -> State {
    let d = cx.d as i64;
    // K_j ready (V_j may still be in flight).
    e.wait_group(1);
    e.barrier();
    let zero = e.f32c(0.0);
    let mut s: Vec<[String; 4]> = (0..8).map(|_| [0; 4].map(|_| zero.clone())).collect();
    for kstep in 0..(d / 16) {
        for np in 0..4i64 {
            let ptr = e.gepk(&cx.k_lm, 3, 16 * np * cx.stride + 16 * kstep);
            let r = e.ldmatrix4(&ptr, false);
            let a = &cx.qf[kstep as usize];
            let n0 = (2 * np) as usize;
            s[n0] = e.mma(a, [&r[0], &r[1]], &s[n0]);
            s[n0 + 1] = e.mma(a, [&r[2], &r[3]], &s[n0 + 1]);
        }
    }
    e.barrier();
    // Prefetch K_{j+1} into the buffer every warp is done with.
    let j1 = e.addk(j, 1);
    let has_next = e.op(&format!("arith.cmpi slt, {j1}, {} : i32", cx.n_tiles));
    if_then(e, &has_next, |e| load_tile(e, cx, &j1, false, &cx.ks));
    e.commit();
    if masked {
        mask_diagonal(e, &cx.kcol, &cx.qrow, &mut s);
    }
    let (m_new, alpha, l, pf) = online_softmax(e, &cx.c, &mut s, &st.m, &st.l);
    let mut o: Vec<[String; 4]> = st.o.iter().map(|t| [0, 1, 2, 3].map(|i| e.fmul(&t[i], &alpha[i / 2]))).collect();
    // V_j ready (K_{j+1} may still be in flight).
    e.wait_group(1);
    e.barrier();
    for (kk, a) in pf.iter().enumerate() {
        for dp in 0..(d / 16) {
            let ptr = e.gepk(&cx.v_lm, 3, 16 * kk as i64 * cx.stride + 16 * dp);
            let r = e.ldmatrix4(&ptr, true);
            let n0 = (2 * dp) as usize;
            o[n0] = e.mma(a, [&r[0], &r[1]], &o[n0]);
            o[n0 + 1] = e.mma(a, [&r[2], &r[3]], &o[n0 + 1]);
        }
    }
    e.barrier();
    if_then(e, &has_next, |e| load_tile(e, cx, &j1, true, &cx.vs));
    e.commit();
    State { o, m: m_new, l }
}

/// The `mma.sync` path's key loop (head_dim 16): tiles in order, the diagonal last and masked.
fn forward_mma_sync(e: &mut Em, cx: &Ctx, mblk: &str) -> State {
    let d = cx.d as i64;
    // Prologue: K_0 and V_0 in two groups.
    let zero_i = e.i32c(0);
    load_tile(e, cx, &zero_i, false, &cx.ks);
    e.commit();
    load_tile(e, cx, &zero_i, true, &cx.vs);
    e.commit();
    let zf = e.f32c(0.0);
    let ninf = e.f32c(f32::NEG_INFINITY);
    let nt = (d / 8) as usize;
    let init = State { o: (0..nt).map(|_| [0; 4].map(|_| zf.clone())).collect(), m: [ninf.clone(), ninf.clone()], l: [zf.clone(), zf.clone()] };
    // Unmasked tiles: all of them, or those before the diagonal.
    let n_full = if cx.causal { mblk.to_string() } else { cx.n_tiles.clone() };
    let flat = init.flat();
    let tys = vec!["f32"; flat.len()];
    let res = scf_for(e, &zero_i, &n_full, &flat, &tys, |e, j, args| tile_body(e, cx, j, &State::from_flat(args, nt), false).flat());
    let mut st = State::from_flat(&res, nt);
    if cx.causal {
        st = tile_body(e, cx, mblk, &st, true);
    }
    st
}

/// `scf.for iv = lo to hi step 1` carrying `init` (of types `tys`); `body(e, iv, args)` returns
/// the values to yield. Returns the loop's results.
pub(crate) fn scf_for(
    e: &mut Em,
    lo: &str,
    hi: &str,
    init: &[String],
    tys: &[&str],
    body: impl FnOnce(&mut Em, &str, &[String]) -> Vec<String>,
) -> Vec<String> {
    let results: Vec<String> = init.iter().map(|_| e.fresh()).collect();
    let args: Vec<String> = init.iter().map(|_| e.fresh()).collect();
    let iv = e.fresh();
    let one = e.i32c(1);
    let pairs: Vec<String> = args.iter().zip(init).map(|(a, i)| format!("{a} = {i}")).collect();
    let tys = tys.join(", ");
    e.line(&format!("{} = scf.for {iv} = {lo} to {hi} step {one} iter_args({}) -> ({tys}) : i32 {{", results.join(", "), pairs.join(", ")));
    e.indent += 1;
    let next = body(e, &iv, &args);
    e.line(&format!("scf.yield {} : {tys}", next.join(", ")));
    e.indent -= 1;
    e.line("}");
    results
}

/// The A operand of `S = Q K^T`: Q's register fragments, or its shared tile (K-major, the
/// same k-steps as K's).
fn q_operand<'a>(cx: &'a Ctx, koffs: &'a [i64]) -> WgA<'a> {
    match &cx.q_tile {
        Some(q) => WgA::Smem(&q.desc, koffs),
        None => WgA::Regs(&cx.qf),
    }
}

/// The `wgmma` path's key loop (head_dim 64, 128), software-pipelined within the warpgroup
/// (FA3's intra-warpgroup overlap). Key tiles run last to first (causal: the diagonal first, so
/// only the prologue's tile is masked), K and V double-buffered. Iteration `t` (tile `j`):
/// wait for K_j and V_{j+1}; prefetch K_{j-1} and V_j into the buffers freed by iteration
/// `t - 1`; issue `S_j = Q K_j^T` and `O += P_{j+1} V_{j+1}` as two `wgmma` groups; wait for
/// the first and run tile `j`'s softmax while the tensor cores finish the second; then wait for
/// it and scale O by `alpha_j`. The last tile's `P V` follows the loop.
fn forward_wgmma(e: &mut Em, cx: &Ctx) -> State {
    let d = cx.d as i64;
    let nt = (d / 8) as usize;
    let tile = BN as i64 * d;
    let koffs = sw128_kmajor_steps(d, BN as i64);
    let voffs = sw128_mnmajor_steps(BN as i64);
    // Buffer `b` (i32, 0 or 1) of K or V: its shared pointer and `wgmma` descriptor.
    let buf = |e: &mut Em, v: bool, b: &str| -> (String, String) {
        let off = e.mulk(b, tile);
        let (base, desc) = if v { (&cx.vs, &cx.v_desc) } else { (&cx.ks, &cx.k_desc) };
        let ptr = e.gep(base, 3, &off, "i32", "bf16");
        (ptr, sw128_desc_at(e, desc, &off))
    };
    let one = e.i32c(1);
    let last = e.addk(&cx.n_tiles, -1);
    // Prologue: tile `last` (causal: the diagonal) into buffers 0 (and Q into its own); K_{last -
    // 1} into K buffer 1 at once with two K buffers, into buffer 0 once S_last is done with one.
    load_tile(e, cx, &last, false, &cx.ks);
    load_tile(e, cx, &last, true, &cx.vs);
    load_q_tile(e, cx);
    e.commit();
    e.wait_group(0);
    e.fence_proxy_async();
    e.barrier();
    let zero = e.i32c(0);
    let prev = e.addk(&last, -1);
    // K_{last - 1} (if any) into K buffer `kb` once buffer `kb` is free.
    let prefetch_k = |e: &mut Em, kb: &str| {
        let has = e.op(&format!("arith.cmpi sgt, {last}, {zero} : i32"));
        if_then(e, &has, |e| {
            let (kp, _) = buf(e, false, kb);
            load_tile(e, cx, &prev, false, &kp);
        });
        e.commit();
    };
    if cx.var.k_bufs == 2 {
        prefetch_k(e, &one);
    }
    let undef = e.op("llvm.mlir.undef : f32");
    let u = vec![undef; 32];
    let s = wgmma_issue(e, 64, &u, q_operand(cx, &koffs), &cx.k_desc, &koffs, false, false);
    let (s, _) = wgmma_wait(e, 0, &s, &[]);
    if cx.var.k_bufs == 1 {
        e.barrier();
        prefetch_k(e, &zero);
    }
    // Carried: O (zero: tile `last`'s P V is issued in the first iteration), m, l, P.
    let (init, tys) = first_carried(e, &cx.c, &s, cx.causal.then_some((cx.kcol.as_str(), &cx.qrow)), nt);
    let res = scf_for(e, &one, &cx.n_tiles, &init, &tys, |e, t, a| {
        let j = e.bin("subi", &last, t, "i32");
        let b = e.remk(t, 2);
        let bp = e.bin("subi", &one, &b, "i32");
        // K_j and V_{j + 1} landed (every copy this thread issued), visible to `wgmma`, and every
        // warp is past iteration t - 1's products (their buffers are free).
        e.wait_group(0);
        e.fence_proxy_async();
        e.barrier();
        let has_next = e.op(&format!("arith.cmpi sgt, {j}, {zero} : i32"));
        let jm1 = e.addk(&j, -1);
        let prefetch_k = |e: &mut Em, kb: &str| {
            if_then(e, &has_next, |e| {
                let (kn, _) = buf(e, false, kb);
                load_tile(e, cx, &jm1, false, &kn);
            });
        };
        if cx.var.k_bufs == 2 {
            prefetch_k(e, &bp);
        }
        let (vn, _) = buf(e, true, &b);
        load_tile(e, cx, &j, true, &vn);
        e.commit();
        let kb = if cx.var.k_bufs == 2 { b.clone() } else { zero.clone() };
        let (_, kd) = buf(e, false, &kb);
        let (_, vd) = buf(e, true, &bp);
        let tile = Pipelined { q: q_operand(cx, &koffs), koffs: &koffs, voffs: &voffs, c: &cx.c, d, nt, bn: BN as usize, turns: None };
        let after_s = |e: &mut Em| {
            if cx.var.k_bufs == 1 {
                // Every warp's S_j is done: K_{j-1} into the one K buffer.
                e.barrier();
                prefetch_k(e, &zero);
                e.commit();
            }
        };
        tile.step(e, a, &kd, &vd, after_s, |_| {})
    });
    // The last tile's P V, from V buffer (n_tiles - 1) % 2.
    e.wait_group(0);
    e.fence_proxy_async();
    e.barrier();
    let bl = e.remk(&last, 2);
    let (_, vd) = buf(e, true, &bl);
    last_pv(e, &res, &vd, &voffs, d, nt, None)
}

/// The pipelined key loop's carried values after its first tile (S in `s`, masked on the
/// diagonal by `mask` = (kcol, qrow) when given) and their types: O (zero: the tile's P V is
/// issued by the first iteration), the rows' max and partial sum, P's A fragments.
fn first_carried(e: &mut Em, c: &str, s: &[String], mask: Option<(&str, &[String; 2])>, nt: usize) -> (Vec<String>, Vec<&'static str>) {
    let mut s = n_tiles(s);
    if let Some((kcol, qrow)) = mask {
        mask_diagonal(e, kcol, qrow, &mut s);
    }
    let ninf = e.f32c(f32::NEG_INFINITY);
    let zf = e.f32c(0.0);
    let (m, _, l, pf) = online_softmax(e, c, &mut s, &[ninf.clone(), ninf], &[zf.clone(), zf.clone()]);
    let p_regs = 4 * pf.len();
    let mut init: Vec<String> = vec![zf; 4 * nt];
    init.extend(m);
    init.extend(l);
    init.extend(pf.iter().flat_map(|f| f.iter().cloned()));
    let mut tys = vec!["f32"; 4 * nt + 4];
    tys.extend(vec!["i32"; p_regs]);
    (init, tys)
}

/// Whether the attention kernels' softmax exponentials flush subnormal results to zero: yes
/// unless the build-time switch `var` (`TITAN_ATT_FWD_EX2` for the forward, `TITAN_ATT_BWD_EX2`
/// for the backward) is `full`, for comparisons. Only a probability below 2^-126 changes (to
/// 0), next to a row whose largest term is 1 (forward) or whose terms sum to 1 (backward). On
/// an H100 (docs/performance.md, session 29) the forward took 2.6% less energy held at the
/// power cap at the 8B shape and 7% less at head_dim 64, the backward 0.7-4.7% less at four of
/// the six perf shapes, level at the 8B one and mixed at seq 8192 head_dim 64 (-1.1% and +1.5%
/// in two calls); the 20-step losses of 8b-4l and Llama-3.2 1B were bit-identical.
pub(crate) fn ex2_ftz(var: crate::switches::Switch) -> bool {
    crate::switches::var(var).as_deref() != Some("full")
}

/// Whether the pipelined key loop skips O's rescale where no row of the warp changed its max
/// (the same bits either way): on an H100, 3.5% faster at the 8B shape (907 against 941 us)
/// and 4.6% at the 1B shape (1,221 against 1,280), 3.6-4% less energy a launch held at the
/// power cap (docs/performance.md, session 26). `TITAN_ATT_FWD_SKIP_RESCALE=0` at build time
/// always rescales, for comparisons.
fn skip_rescale() -> bool {
    crate::switches::var(crate::switches::Switch::AttFwdSkipRescale).as_deref() != Some("0")
}

/// One iteration of the pipelined key loop (both forwards): its operands' layout.
struct Pipelined<'a> {
    /// Q, the A operand of `S = Q K^T`.
    q: WgA<'a>,
    koffs: &'a [i64],
    voffs: &'a [i64],
    /// `scale log2 e`.
    c: &'a str,
    d: i64,
    nt: usize,
    /// Keys per tile: S's `wgmma` N, P V's K.
    bn: usize,
    /// Turn-taking between two warpgroups ([`Turns`]), or none.
    turns: Option<&'a Turns>,
}

/// FA3's ping-pong between the two computing warpgroups of a CTA: each issues its `wgmma`s only
/// on its turn (named barrier `1 + w` of 256 threads: its own 128 waiting, the other's 128
/// arriving) and passes the turn on once they are issued, so one warpgroup's softmax runs while
/// the other's products hold the tensor cores.
pub(crate) struct Turns {
    /// This warpgroup's barrier and the other's (i32).
    own: String,
    other: String,
}

impl Turns {
    /// For warpgroup `wgi` (i32, 0 or 1); warpgroup 1 passes warpgroup 0 the first turn.
    pub(crate) fn new(e: &mut Em, wgi: &str) -> Turns {
        let own = e.addk(wgi, 1);
        let one = e.i32c(1);
        let o = e.bin("subi", &one, wgi, "i32");
        let other = e.addk(&o, 1);
        let first = e.op(&format!("arith.cmpi eq, {wgi}, {one} : i32"));
        if_then(e, &first, |e| e.named_barrier(false, &other, 256));
        Turns { own, other }
    }

    pub(crate) fn wait(&self, e: &mut Em) {
        e.named_barrier(true, &self.own, 256);
    }

    pub(crate) fn pass(&self, e: &mut Em) {
        e.named_barrier(false, &self.other, 256);
    }
}

impl Pipelined<'_> {
    /// On the carried values `a` ([`first_carried`]'s layout): issue `S = Q K^T` (K at `kd`) and
    /// `O += P V` with the previous tile's P (V at `vd`) as two `wgmma` groups; wait for S, run
    /// `after_s` (the caller's buffer work), the softmax while `P V` runs, wait for it, run
    /// `after_pv`, scale O by the new max. Returns the next carried values.
    fn step(&self, e: &mut Em, a: &[String], kd: &str, vd: &str, after_s: impl FnOnce(&mut Em), after_pv: impl FnOnce(&mut Em)) -> Vec<String> {
        let nt = self.nt;
        let o: Vec<String> = a[..4 * nt].to_vec();
        let (m, l) = ([a[4 * nt].clone(), a[4 * nt + 1].clone()], [a[4 * nt + 2].clone(), a[4 * nt + 3].clone()]);
        let pf_flat: Vec<String> = a[4 * nt + 4..].to_vec();
        let undef = e.op("llvm.mlir.undef : f32");
        let u = vec![undef; self.bn / 2];
        if let Some(t) = self.turns {
            t.wait(e);
        }
        let s = wgmma_issue(e, self.bn, &u, self.q, kd, self.koffs, false, false);
        let pf_prev = n_tiles(&pf_flat);
        let o = wgmma_issue(e, self.d as usize, &o, WgA::Regs(&pf_prev), vd, self.voffs, true, true);
        if let Some(t) = self.turns {
            t.pass(e);
        }
        // S done; the previous P stays allocated while `P V` reads it.
        let (s, pf_live) = wgmma_wait(e, 1, &s, &pf_flat);
        after_s(e);
        let mut s = n_tiles(&s);
        let (m_new, alpha, l, pf) = online_softmax(e, self.c, &mut s, &m, &l);
        let (o, _) = wgmma_wait(e, 0, &o, &pf_live);
        after_pv(e);
        let scale = |e: &mut Em| -> Vec<String> { o.iter().enumerate().map(|(i, x)| e.fmul(x, &alpha[(i % 4) / 2])).collect() };
        let mut next = if skip_rescale() {
            // alpha is exactly 1 where a row's finite max did not move (ex2.approx(0) = 1), and
            // O x 1 is O: skipped where no row of the warp moved, the same bits. (Where a max is
            // not finite, alpha was NaN and stays in l, so the row's output is NaN either way.)
            let moved = [0, 1].map(|r| e.op(&format!("arith.cmpf one, {}, {} : f32", m[r], m_new[r])));
            let any = e.op(&format!("arith.ori {}, {} : i1", moved[0], moved[1]));
            let any = e.op(&format!("arith.extui {any} : i1 to i32"));
            let warp_any = e.op(&format!(
                "llvm.inline_asm has_side_effects \"{{ .reg .pred p, q; setp.ne.u32 p, $1, 0; vote.sync.any.pred q, p, 0xffffffff; selp.u32 $0, 1, 0, q; }}\", \"=r,r\" {any} : (i32) -> i32"
            ));
            let zero = e.i32c(0);
            let go = e.op(&format!("arith.cmpi ne, {warp_any}, {zero} : i32"));
            if_map_f32(e, &go, &o, scale)
        } else {
            scale(e)
        };
        next.extend(m_new);
        next.extend(l);
        next.extend(pf.iter().flat_map(|f| f.iter().cloned()));
        next
    }
}

/// The loop's results `res` ([`first_carried`]'s layout) after the last tile's `P V` (V at `vd`).
/// With `turns`, issued on this warpgroup's turn, which it passes on where `pass` (i1) holds.
fn last_pv(e: &mut Em, res: &[String], vd: &str, voffs: &[i64], d: i64, nt: usize, turns: Option<(&Turns, &str)>) -> State {
    let pf = n_tiles(&res[4 * nt + 4..]);
    let o = match turns {
        None => wgmma_chain(e, d as usize, &res[..4 * nt], WgA::Regs(&pf), vd, voffs, true),
        Some((t, pass)) => {
            t.wait(e);
            let o = wgmma_issue(e, d as usize, &res[..4 * nt], WgA::Regs(&pf), vd, voffs, true, true);
            if_then(e, pass, |e| t.pass(e));
            wgmma_wait(e, 0, &o, &res[4 * nt + 4..]).0
        }
    };
    State { o: n_tiles(&o), m: [res[4 * nt].clone(), res[4 * nt + 1].clone()], l: [res[4 * nt + 2].clone(), res[4 * nt + 3].clone()] }
}

fn forward_body(p: &Problem, var: Variant, qp: &str, kp: &str, vp: &str, op: &str, lp: &str) -> String {
    let mut e = Em::new();
    let d = p.d as i64;
    let stride = d + 8;
    let nm = (p.s / BM) as i64;
    let tid_ix = e.op("gpu.thread_id x");
    let tid = e.op(&format!("arith.index_cast {tid_ix} : index to i32"));
    let bid_ix = e.op("gpu.block_id x");
    let bid = e.op(&format!("arith.index_cast {bid_ix} : index to i32"));
    let warp = e.divk(&tid, 32);
    let lane = e.remk(&tid, 32);
    let g = e.divk(&lane, 4);
    let tq = e.remk(&lane, 4);
    let Tile { mblk, bhi, q_base, kv_base } = tile_of(&mut e, p, &bid, nm);
    let q_row = (p.hq * p.d) as i64;
    let kv_row = (p.hkv * p.d) as i64;
    // This thread's two query rows (absolute) and their offsets within the tile.
    let w16 = e.mulk(&warp, 16);
    let qr0 = e.addi(&w16, &g);
    let qr1 = e.addk(&qr0, 8);
    let m64 = e.mulk(&mblk, BM as i64);
    let row0 = e.addi(&m64, &qr0);
    let row1 = e.addi(&m64, &qr1);
    let kcol = e.mulk(&tq, 2);
    // Row pointers of q/out for the two rows, at column kcol.
    let row_ptr = |e: &mut Em, base: &str, row: &str| -> String {
        let r64 = e.ext64(row);
        let rs = e.i64c(q_row);
        let ro = e.bin("muli", &r64, &rs, "i64");
        let o = e.bin("addi", &q_base, &ro, "i64");
        let k64 = e.ext64(&kcol);
        let o = e.bin("addi", &o, &k64, "i64");
        e.gep(base, 1, &o, "i64", "bf16")
    };
    let qrow_p = [row_ptr(&mut e, qp, &row0), row_ptr(&mut e, qp, &row1)];
    let qf = if var.q_smem { Vec::new() } else { q_frags(&mut e, &qrow_p, d) };
    // Shared buffers and this lane's ldmatrix rows.
    // Dynamic shared memory: the K buffers, then the V buffers ([`smem_layout`]).
    let ks = e.op("llvm.mlir.addressof @att_smem : !llvm.ptr<3>");
    let (_, v_at, q_at) = smem_layout(d as u64, var);
    let vs = e.gepk(&ks, 3, v_at);
    let mi = e.divk(&lane, 8);
    let r8 = e.remk(&lane, 8);
    let mi_lo = e.remk(&mi, 2);
    let mi_hi = e.divk(&mi, 2);
    // K (B of Q K^T): key = (mi / 2) * 8 + r, dim = (mi % 2) * 8.
    let kr = e.mulk(&mi_hi, 8);
    let kr = e.addi(&kr, &r8);
    let kro = e.mulk(&kr, stride);
    let kc = e.mulk(&mi_lo, 8);
    let k_off = e.addi(&kro, &kc);
    let k_lm = e.gep(&ks, 3, &k_off, "i32", "bf16");
    // V (B of P V, transposed): key = (mi % 2) * 8 + r, dim = (mi / 2) * 8.
    let vr = e.mulk(&mi_lo, 8);
    let vr = e.addi(&vr, &r8);
    let vro = e.mulk(&vr, stride);
    let vc = e.mulk(&mi_hi, 8);
    let v_off = e.addi(&vro, &vc);
    let v_lm = e.gep(&vs, 3, &v_off, "i32", "bf16");
    let wgmma = uses_wgmma(p.d);
    let k_desc = sw128_descriptor(&mut e, &ks, 16, 1024);
    let v_desc = sw128_descriptor(&mut e, &vs, SW_BLOCK, 1024);
    // cp.async: `mma.sync` path, chunk (row = tid / cpr, col = tid % cpr) of 8 bf16 into padded
    // rows; `wgmma` path, row tid / 8, chunk tid % 8 of a 64-dim block, stored at chunk
    // (tid % 8) ^ (row % 8) (rows advance by multiples of 16 per copy, so the swizzle term is
    // the thread's own).
    let cpr = if wgmma { 8 } else { d / 8 };
    let crow = e.divk(&tid, cpr);
    let cch = e.remk(&tid, cpr);
    let cc8 = e.mulk(&cch, 8);
    let s_off = if wgmma {
        sw128_slot(&mut e, &crow, &cch)
    } else {
        let s_row = e.mulk(&crow, stride);
        e.addi(&s_row, &cc8)
    };
    let cc864 = e.ext64(&cc8);
    let g_off = e.row_offset(&crow, kv_row, &cc864, &kv_base);
    let k_g = e.gep(kp, 1, &g_off, "i64", "bf16");
    let v_g = e.gep(vp, 1, &g_off, "i64", "bf16");
    // Q's tile in shared memory: copies of row m64 + crow of this (batch, head), chunk cc8.
    let q_tile = var.q_smem.then(|| {
        let smem = e.gepk(&ks, 3, q_at);
        let qr = e.addi(&m64, &crow);
        let q_off = e.row_offset(&qr, q_row, &cc864, &q_base);
        let g = e.gep(qp, 1, &q_off, "i64", "bf16");
        let desc = sw128_descriptor(&mut e, &smem, 16, 1024);
        QTile { smem, g, row: q_row, desc }
    });
    let n_tiles = if p.causal { e.addk(&mblk, 1) } else { e.i32c(nm) };
    let c = e.f32c((p.scale * std::f64::consts::LOG2_E) as f32);
    let cx = Ctx {
        d: p.d,
        stride,
        causal: p.causal,
        c,
        qf,
        q_tile,
        var,
        ks,
        vs,
        wgmma,
        k_lm,
        v_lm,
        k_desc,
        v_desc,
        k_g,
        v_g,
        s_off,
        kv_row,
        n_tiles,
        qrow: [qr0, qr1],
        kcol: kcol.clone(),
    };
    let st = if wgmma { forward_wgmma(&mut e, &cx) } else { forward_mma_sync(&mut e, &cx, &mblk) };
    let orow_p = [row_ptr(&mut e, op, &row0), row_ptr(&mut e, op, &row1)];
    write_out(&mut e, &st, &orow_p, lp, &bhi, p.s as i64, [&row0, &row1], &tq);
    e.body
}

/// A forward CTA's work: its query tile (i32, of `nm` per head), its (batch x heads + head), and
/// the element bases (i64) of its Q head and its K/V head.
struct Tile {
    mblk: String,
    bhi: String,
    q_base: String,
    kv_base: String,
}

/// The forward's grid in bands of `g` (batch, kv head)s, each band's CTAs query tile first (the
/// longest causal tiles first), so the CTAs running together read the K and V of fewer kv heads:
/// the build-time switch `TITAN_ATT_FWD_BAND=g` (a divisor of `b hkv`; anything else is one band
/// over all of them, the default). Measured (docs/notes.md, session 30): at the 8B shape bands
/// of 1 or 2 cut the DRAM bytes read from 245 to 101 MB (cuDNN's), but time and energy held at
/// the power cap stayed level and the steps too, so it is not the default.
fn fwd_band(p: &Problem) -> i64 {
    let nbk = (p.b * p.hkv) as i64;
    match crate::switches::var(crate::switches::Switch::AttFwdBand).and_then(|v| v.parse::<i64>().ok()) {
        Some(g) if g > 0 && nbk % g == 0 => g,
        _ => nbk,
    }
}

/// Block `bid` -> [`Tile`], the longest causal tiles (the last query tiles) first, in bands of
/// [`fwd_band`] (batch, kv head)s.
fn tile_of(e: &mut Em, p: &Problem, bid: &str, nm: i64) -> Tile {
    let bh = (p.b * p.hq) as i64;
    let nm1 = e.i32c(nm - 1);
    let group = (p.hq / p.hkv) as i64;
    let g = fwd_band(p);
    let (mblk, bhi, bi, h, kh) = if g == (p.b * p.hkv) as i64 {
        let mb_rev = e.divk(bid, bh);
        let mblk = e.bin("subi", &nm1, &mb_rev, "i32");
        let bhi = e.remk(bid, bh);
        let bi = e.divk(&bhi, p.hq as i64);
        let h = e.remk(&bhi, p.hq as i64);
        let kh = e.divk(&h, group);
        (mblk, bhi, bi, h, kh)
    } else {
        // A band is `nm` rounds of its `g group` query heads, kv head by kv head.
        let heads = g * group;
        let per_band = heads * nm;
        let band = e.divk(bid, per_band);
        let r = e.remk(bid, per_band);
        let mb_rev = e.divk(&r, heads);
        let mblk = e.bin("subi", &nm1, &mb_rev, "i32");
        let w = e.remk(&r, heads);
        let b0 = e.mulk(&band, g);
        let wu = e.divk(&w, group);
        let unit = e.addi(&b0, &wu);
        let qi = e.remk(&w, group);
        let bi = e.divk(&unit, p.hkv as i64);
        let kh = e.remk(&unit, p.hkv as i64);
        let khg = e.mulk(&kh, group);
        let h = e.addi(&khg, &qi);
        let bq = e.mulk(&bi, p.hq as i64);
        let bhi = e.addi(&bq, &h);
        (mblk, bhi, bi, h, kh)
    };
    let bi64 = e.ext64(&bi);
    let h64 = e.ext64(&h);
    let kh64 = e.ext64(&kh);
    let sq = e.i64c((p.s * p.hq * p.d) as i64);
    let skv = e.i64c((p.s * p.hkv * p.d) as i64);
    let d64 = e.i64c(p.d as i64);
    let qb = e.bin("muli", &bi64, &sq, "i64");
    let hd = e.bin("muli", &h64, &d64, "i64");
    let q_base = e.bin("addi", &qb, &hd, "i64");
    let kvb = e.bin("muli", &bi64, &skv, "i64");
    let khd = e.bin("muli", &kh64, &d64, "i64");
    let kv_base = e.bin("addi", &kvb, &khd, "i64");
    Tile { mblk, bhi, q_base, kv_base }
}

/// The `d / 16` register A fragments (the `mma.sync` A layout, which is `wgmma`'s register A
/// layout) of a bf16 `[rows, d]` tensor, straight from global memory at the thread's two rows
/// and its column (`qrow_p`): Q in the forwards, Q and dO in the backward's dQ pass.
pub(crate) fn q_frags(e: &mut Em, qrow_p: &[String; 2], d: i64) -> Vec<[String; 4]> {
    (0..d / 16)
        .map(|ks| {
            let mut a: [String; 4] = Default::default();
            for (i, x) in a.iter_mut().enumerate() {
                let ptr = e.gepk(&qrow_p[i % 2], 1, 16 * ks + 8 * (i / 2) as i64);
                *x = e.op(&format!("llvm.load {ptr} {{alignment = 4 : i64}} : !llvm.ptr<1> -> i32"));
            }
            a
        })
        .collect()
}

/// The forward's epilogue for the thread's two rows `rows` (absolute query rows of head `bhi` =
/// batch x heads + head): full row sums across the quad, `O / l` rounded to bf16 at `orow_p`
/// (the rows' output pointers at the thread's column), `lse = (m + log2 l) ln 2` by the quad's
/// first thread (`tq` 0) into `lp` (`s` rows a head).
#[allow(clippy::too_many_arguments)]
fn write_out(e: &mut Em, st: &State, orow_p: &[String; 2], lp: &str, bhi: &str, s: i64, rows: [&str; 2], tq: &str) {
    let mut inv = [String::new(), String::new()];
    let mut lse = [String::new(), String::new()];
    let ln2 = e.f32c(std::f32::consts::LN_2);
    let onef = e.f32c(1.0);
    for r in 0..2 {
        let mut l = st.l[r].clone();
        for off in [1, 2] {
            let o = e.shfl_xor(&l, off);
            l = e.fadd(&l, &o);
        }
        inv[r] = e.bin("divf", &onef, &l, "f32");
        let lg = e.lg2(&l);
        let t = e.fadd(&st.m[r], &lg);
        lse[r] = e.fmul(&t, &ln2);
    }
    for (n, t) in st.o.iter().enumerate() {
        for r in 0..2 {
            let x0 = e.fmul(&t[2 * r], &inv[r]);
            let x1 = e.fmul(&t[2 * r + 1], &inv[r]);
            let pk = e.pack_bf16(&x0, &x1);
            let ptr = e.gepk(&orow_p[r], 1, 8 * n as i64);
            e.line(&format!("llvm.store {pk}, {ptr} {{alignment = 4 : i64}} : i32, !llvm.ptr<1>"));
        }
    }
    let zero_i = e.i32c(0);
    let is0 = e.op(&format!("arith.cmpi eq, {tq}, {zero_i} : i32"));
    e.line(&format!("scf.if {is0} {{"));
    e.indent += 1;
    let bh_s = e.mulk(bhi, s);
    for (r, row) in rows.iter().enumerate() {
        let idx = e.addi(&bh_s, row);
        let i64v = e.ext64(&idx);
        let ptr = e.op(&format!("llvm.getelementptr {lp}[{i64v}] : (!llvm.ptr<1>, i64) -> !llvm.ptr<1>, f32"));
        e.line(&format!("llvm.store {}, {ptr} {{alignment = 4 : i64}} : f32, !llvm.ptr<1>", lse[r]));
    }
    e.indent -= 1;
    e.line("}");
}
