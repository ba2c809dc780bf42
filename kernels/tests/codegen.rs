//! Kernel codegen end to end on hand-built bodies: MLIR snapshots of an RMSNorm and a SwiGLU
//! kernel, and every generated kernel assembled by `ptxas` for sm_90a with no spills.

use std::time::Instant;

use titan_ir::{
    AdamWConfig, ArgKind, BinaryOp, BlockId, Builder, DType, DecayKind, Graph, KernelKind, LrSchedule, Op, Output, ReduceKind, Region, RopeConfig, RopeLayout,
    RopeScaling, TensorType, UnaryOp, Value,
};
use titan_kernels::{CompiledKernel, Lowered, compile_kernel, compile_kernel_cached, find_ptxas, ptxas_check};

fn bf16(shape: &[u64]) -> TensorType {
    TensorType::fixed(DType::BF16, shape)
}

fn f32t(shape: &[u64]) -> TensorType {
    TensorType::fixed(DType::F32, shape)
}

fn i32t(shape: &[u64]) -> TensorType {
    TensorType::fixed(DType::I32, shape)
}

/// Build a body block: `args` are its argument types, `build` appends nodes and returns the
/// outputs.
fn body(g: &mut Graph, name: &str, args: &[TensorType], build: impl FnOnce(&mut Builder, &[Value]) -> Vec<Value>) -> BlockId {
    let mut r = Region::new(name);
    let vals: Vec<Value> = args.iter().map(|t| r.add_arg(t.clone(), ArgKind::Block, None)).collect();
    let outs = {
        let mut b = Builder::new(&mut r, &g.dims, &g.blocks);
        build(&mut b, &vals)
    };
    r.outputs = outs.into_iter().map(|value| Output { name: None, value }).collect();
    g.add_block(r)
}

fn graph() -> Graph {
    let mut g = Graph::new("kernels");
    g.dims.insert("batch".into(), 8);
    g.dims.insert("seq".into(), 64);
    g
}

fn push(b: &mut Builder, op: Op, inputs: &[Value]) -> Value {
    b.push1(op, inputs).expect("the test body type-checks")
}

fn rmsnorm_body(g: &mut Graph) -> BlockId {
    body(g, "rmsnorm", &[bf16(&[8, 64, 64]), bf16(&[64])], |b, a| vec![push(b, Op::RmsNorm { eps: 1e-5 }, &[a[0], a[1]])])
}

fn swiglu_body(g: &mut Graph) -> BlockId {
    body(g, "swiglu", &[bf16(&[8, 64, 192]), bf16(&[8, 64, 192])], |b, a| {
        let s = push(b, Op::Unary(UnaryOp::Silu), &[a[0]]);
        vec![push(b, Op::Binary(BinaryOp::Mul), &[s, a[1]])]
    })
}

fn compile(g: &Graph, id: BlockId, kind: KernelKind, name: &str) -> CompiledKernel {
    match compile_kernel(g, id, kind, name) {
        Ok(Some(k)) => k,
        Ok(None) => panic!("{name}: no kernel generated"),
        Err(e) => panic!("{name}: {e}"),
    }
}

#[test]
fn rmsnorm_mlir_snapshot() {
    let mut g = graph();
    let id = rmsnorm_body(&mut g);
    let k = compile(&g, id, KernelKind::Fused, "layer.k0_rmsnorm");
    assert_eq!(k.entry, "layer_k0_rmsnorm");
    assert_eq!(k.launch.grid, [512, 1, 1]);
    assert_eq!(k.launch.block, [32, 1, 1]);
    assert_eq!(k.workspace_bytes, 0);
    insta::assert_snapshot!("rmsnorm_fwd", k.mlir);
}

#[test]
fn swiglu_mlir_snapshot() {
    let mut g = graph();
    let id = swiglu_body(&mut g);
    let k = compile(&g, id, KernelKind::Fused, "layer.k1_swiglu");
    insta::assert_snapshot!("swiglu_fwd", k.mlir);
}

#[test]
fn a_module_lowered_before_is_reused_under_the_new_name() {
    let mut g = graph();
    let a = rmsnorm_body(&mut g);
    let b = rmsnorm_body(&mut g);
    let c = swiglu_body(&mut g);
    let lowered = Lowered::default();
    let cached = |g: &Graph, id, name| compile_kernel_cached(g, id, KernelKind::Fused, name, &lowered).expect("generates").expect("a kernel");
    let first = cached(&g, a, "layer.k0_rmsnorm");
    let again = cached(&g, b, "eval_layer.k0_rmsnorm");
    assert_eq!(lowered.len(), 1, "the second rmsnorm generates the same module");
    cached(&g, c, "layer.k1_swiglu");
    assert_eq!(lowered.len(), 2);
    // Each is what lowering it alone gives: its own entry name everywhere, no trace of the
    // other's or of the placeholder.
    assert_eq!(first, compile(&g, a, KernelKind::Fused, "layer.k0_rmsnorm"));
    assert_eq!(again, compile(&g, b, KernelKind::Fused, "eval_layer.k0_rmsnorm"));
    assert_eq!(again.entry, "eval_layer_k0_rmsnorm");
    assert!(again.ptx.contains(".entry eval_layer_k0_rmsnorm("), "{}", again.ptx);
    for k in [&first, &again] {
        assert!(!k.ptx.contains("titan__entry") && !k.mlir.contains("titan__entry"));
    }
    assert!(!again.ptx.contains(" layer_k0_rmsnorm"));
}

#[test]
fn kinds_without_generated_code_return_none() {
    let mut g = graph();
    let id = body(&mut g, "mm", &[bf16(&[8, 64, 64]), bf16(&[32, 64])], |b, a| vec![push(b, Op::Linear, &[a[0], a[1]])]);
    assert!(compile_kernel(&g, id, KernelKind::Gemm, "k").expect("no error").is_none());
}

#[test]
fn missing_and_malformed_bodies_are_errors() {
    let mut g = graph();
    let err = compile_kernel(&g, BlockId(7), KernelKind::Fused, "k").expect_err("no such block");
    assert!(err.to_string().contains("body block #7 does not exist"), "{err}");
    let id = body(&mut g, "bad", &[bf16(&[8, 64])], |b, a| vec![push(b, Op::Unary(UnaryOp::Exp), &[a[0]])]);
    // Corrupt the result type behind the builder's back: the body no longer type-checks.
    let v = g.blocks[id.index()].outputs[0].value;
    g.blocks[id.index()].values[v.index()].ty = f32t(&[8, 64]);
    let err = compile_kernel(&g, id, KernelKind::Fused, "bad").expect_err("ill-typed body");
    assert!(err.to_string().contains("has an invalid body"), "{err}");
}

#[test]
fn unsupported_bodies_are_reported() {
    let mut g = graph();
    // A transpose is stored, never read, inside a kernel.
    let id = body(&mut g, "tr", &[bf16(&[8, 64])], |b, a| {
        let t = push(b, Op::Transpose { perm: vec![1, 0] }, &[a[0]]);
        vec![push(b, Op::Unary(UnaryOp::Neg), &[t])]
    });
    let err = compile_kernel(&g, id, KernelKind::Fused, "tr").expect_err("a transposed value read in its kernel");
    assert!(err.to_string().contains("is read inside its kernel"), "{err}");
    let id = body(&mut g, "att", &[bf16(&[8, 64, 4, 16]), bf16(&[8, 64, 4, 16]), bf16(&[8, 64, 4, 16])], |b, a| {
        b.push(Op::Attention { causal: true, scale: 0.25 }, &[a[0], a[1], a[2]]).expect("attention")
    });
    let err = compile_kernel(&g, id, KernelKind::Fused, "att").expect_err("attention is not fusable");
    assert!(err.to_string().contains("`attention` cannot be part of a fused kernel"), "{err}");
}

/// A column reduction of any width is a column kernel: the output head's `[8192, 128256]`
/// column amax (refused before: rows longer than 32768 elements) gets a grid of 501 column
/// tiles x 17 row chunks and a workspace of one counter per tile and the chunks' partials,
/// instead of one partial row per CTA.
#[test]
fn column_amax_of_any_width_is_a_column_kernel() {
    let mut g = graph();
    let id = colmax_body(&mut g, "head_colmax", &[8192, 128256], false);
    let k = compile(&g, id, KernelKind::Fused, "main.k23_reduce_max");
    assert_eq!((k.launch.grid, k.launch.block), ([501 * 17, 1, 1], [256, 1, 1]));
    assert_eq!(k.workspace_bytes, 4 * (504 + 17 * 128256));
    let id = colmax_body(&mut g, "wo_colmax", &[8192, 4096], false);
    let k = compile(&g, id, KernelKind::Fused, "layer_bwd.k9_reduce_max");
    assert_eq!(k.launch.grid, [16 * 32, 1, 1]);
    assert_eq!(k.workspace_bytes, 4 * (16 + 32 * 4096));
}

/// A row kernel with column sums (rmsnorm's backward with `dw`) over more rows than one wave
/// runs 264 CTAs, two per SM, each bulk-prefetching its next row of every row-shaped argument
/// into L2 (`x` and `dy`, not the weight); over fewer rows it runs one CTA per row and
/// prefetches nothing.
#[test]
fn row_kernels_with_cross_block_sums_run_one_wave_and_prefetch_the_next_row() {
    let mut g = graph();
    let norm_bwd = |g: &mut Graph, name: &str, rows: u64| {
        body(g, name, &[bf16(&[rows, 2048]), bf16(&[2048]), bf16(&[rows, 2048])], |b, a| {
            b.push(Op::RmsNormBwd { eps: 1e-5 }, &[a[0], a[1], a[2]]).expect("rmsnorm_bwd")
        })
    };
    let id = norm_bwd(&mut g, "norm_bwd_8192", 8192);
    let k = compile(&g, id, KernelKind::Fused, "layer_bwd.k7_rmsnorm_bwd");
    assert_eq!(k.launch.grid, [264, 1, 1]);
    assert_eq!(k.ptx.matches("cp.async.bulk.prefetch.L2.global").count(), 2, "{}", k.ptx);
    let id = norm_bwd(&mut g, "norm_bwd_200", 200);
    let k = compile(&g, id, KernelKind::Fused, "layer_bwd.k7_rmsnorm_bwd");
    assert_eq!(k.launch.grid, [200, 1, 1]);
    assert!(!k.ptx.contains("cp.async.bulk.prefetch"));
}

/// The cross entropy of an output head over the vocabulary, its gradient and, with `quant`, the
/// gradient's float8 row quantization (float8 rowwise's head).
fn ce_head_body(g: &mut Graph, name: &str, rows: u64, quant: bool) -> BlockId {
    body(g, name, &[bf16(&[rows, 128256]), i32t(&[rows])], |b, a| {
        let one = b.push_typed(Op::Constant { value: 1.0 }, &[], f32t(&[])).expect("constant");
        let loss = push(b, Op::CrossEntropy, &[a[0], a[1]]);
        let dx = push(b, Op::CrossEntropyBwd, &[a[0], a[1], one]);
        if !quant {
            return vec![loss, dx];
        }
        let per_row = titan_ir::float8::OperandScaling { dtype: DType::F8E4M3, scaling: titan_ir::float8::Scaling::Over(1) };
        let q = titan_ir::float8::quantize(b, dx, per_row, true).expect("quantize");
        vec![loss, dx, q.q, q.inv_scale]
    })
}

/// A transposing fp8 cast whose sides are multiples of 128 x 64 takes one packed tile per CTA
/// (four rows' bytes per word through swizzled shared memory, 16-byte stores); with 64 rows it
/// keeps the 64x64 tiles, and a non-fp8 transpose too.
#[test]
fn transposing_fp8_casts_pack_four_rows_per_word() {
    let mut g = graph();
    let packed = quantize_body_of(&mut g, "qp", DType::BF16, &[256, 192], false, DType::F8E4M3, true);
    let k = compile(&g, packed, KernelKind::Fused, "qp");
    assert_eq!(k.launch.grid[0], 2 * 3, "one CTA per 128 x 64 tile");
    assert!(k.ptx.contains("titan_pack0"), "the packed tile");
    assert_eq!((k.ptx.matches(", 0x6420;").count(), k.ptx.matches(", 0x7531;").count()), (4, 4), "two byte selects per pair of columns, four pairs");
    assert!(k.ptx.contains("ld.shared.v4.b32") && k.ptx.contains("st.global.v4.b32"), "16-byte moves out of the tile");
    let tiled = quantize_body_of(&mut g, "qt", DType::BF16, &[64, 192], false, DType::F8E4M3, true);
    let k = compile(&g, tiled, KernelKind::Fused, "qt");
    assert!(!k.ptx.contains("titan_pack") && k.ptx.contains("titan_tile"), "64 rows: the 64x64 tiles");
    let wide = body(&mut g, "tb", &[bf16(&[256, 192])], |b, a| vec![push(b, Op::Transpose { perm: vec![1, 0] }, &[a[0]])]);
    let k = compile(&g, wide, KernelKind::Fused, "tb");
    assert!(!k.ptx.contains("titan_pack") && k.ptx.contains("titan_tile"), "bf16 outputs: the 64x64 tiles");
}

#[test]
fn a_looped_pass_reads_back_what_an_earlier_pass_stored() {
    // The quantizing pass of float8 rowwise's head needs the gradient an earlier pass stored:
    // it loads it instead of recomputing it, so the kernel evaluates `exp` (log2(e) is its
    // first constant) exactly as often as the plain loss-and-gradient kernel (78 against 110
    // with the recomputation).
    let mut g = graph();
    let plain = ce_head_body(&mut g, "ce_plain", 64, false);
    let quant = ce_head_body(&mut g, "ce_quant", 64, true);
    let plain = compile(&g, plain, KernelKind::Fused, "main.k1_ce");
    let quant = compile(&g, quant, KernelKind::Fused, "main.k2_ce_quant");
    let exps = |ptx: &str| ptx.matches("0f3FB8AA3B").count();
    assert!(exps(&plain.ptx) > 0);
    assert_eq!(exps(&quant.ptx), exps(&plain.ptx));
}

/// All the hand-built bodies, one per pattern the generators support.
/// `quantize`'s scaling and cast of float8 training (`titan_ir::float8::quantize`) as fusion
/// outlines it: `x [rows, cols] * broadcast(scale)` clamped to ±max, cast to `dtype`, stored
/// transposed when `transposed` (the K-major operand of a TN GEMM). `per_row`: the scale is per
/// row (else per column).
fn quantize_body(g: &mut Graph, name: &str, shape: &[u64], per_row: bool, dtype: DType, transposed: bool) -> BlockId {
    quantize_body_of(g, name, DType::F32, shape, per_row, dtype, transposed)
}

/// [`quantize_body`] of an `input`-typed operand (bf16 in the training step).
fn quantize_body_of(g: &mut Graph, name: &str, input: DType, shape: &[u64], per_row: bool, dtype: DType, transposed: bool) -> BlockId {
    let rank = shape.len();
    let scale_shape: Vec<u64> = if per_row { shape[..rank - 1].to_vec() } else { vec![shape[rank - 1]] };
    let dims: Vec<usize> = if per_row { (0..rank - 1).collect() } else { vec![rank - 1] };
    let max = f64::from(titan_ir::fp8::fp8_max(dtype).expect("an fp8 dtype"));
    body(g, name, &[f32t(&scale_shape), TensorType::fixed(input, shape)], |b, a| {
        let wide = b.push_typed(Op::Broadcast { dims }, &[a[0]], f32t(shape)).expect("broadcast");
        let x = if input == DType::F32 { a[1] } else { b.push_typed(Op::Cast, &[a[1]], f32t(shape)).expect("cast") };
        let x = push(b, Op::Binary(BinaryOp::Mul), &[x, wide]);
        let lo = b.push_typed(Op::Constant { value: -max }, &[], TensorType::scalar(DType::F32)).expect("constant");
        let hi = b.push_typed(Op::Constant { value: max }, &[], TensorType::scalar(DType::F32)).expect("constant");
        let x = push(b, Op::Binary(BinaryOp::Max), &[x, lo]);
        let x = push(b, Op::Binary(BinaryOp::Min), &[x, hi]);
        let q = b.push_typed(Op::Cast, &[x], TensorType::fixed(dtype, shape)).expect("cast");
        if transposed { vec![push(b, Op::Transpose { perm: vec![1, 0] }, &[q])] } else { vec![q] }
    })
}

/// The float8 kernels: scales (`fp8_scale` and its reciprocal), quantization (rowwise, per
/// column and stored transposed, e5m2), and the amax reductions (per column, whole tensor),
/// with the float input range each is tested on.
fn fp8_cases(g: &mut Graph) -> Vec<(&'static str, BlockId, (f64, f64))> {
    let scale = |g: &mut Graph, name: &str, t: TensorType, dtype: DType, pow2: bool| {
        body(g, name, &[t], |b, a| {
            let s = push(b, Op::Fp8Scale { dtype, pow2 }, &[a[0]]);
            vec![s, push(b, Op::Unary(UnaryOp::Recip), &[s])]
        })
    };
    let amax = |g: &mut Graph, name: &str, shape: &[u64], axes: Vec<usize>| {
        body(g, name, &[bf16(shape)], |b, a| {
            let x = push(b, Op::Unary(UnaryOp::Abs), &[a[0]]);
            vec![push(b, Op::Reduce { kind: ReduceKind::Max, axes }, &[x])]
        })
    };
    vec![
        ("fp8_scale_pow2", scale(g, "fp8_scale_pow2", bf16(&[8, 64]), DType::F8E4M3, true), (0.0, 8.0)),
        // amax below the 1e-12 clamp (and the clamp's f64 constant) and no power-of-2 rounding.
        ("fp8_scale_tiny_e5m2", scale(g, "fp8_scale_tiny", f32t(&[300]), DType::F8E5M2, false), (0.0, 2e-12)),
        ("fp8_quantize_rows", quantize_body(g, "fp8_q_rows", &[8, 64, 64], true, DType::F8E4M3, false), (-30.0, 30.0)),
        ("fp8_quantize_cols_transposed", quantize_body(g, "fp8_q_cols_t", &[64, 192], false, DType::F8E4M3, true), (-30.0, 30.0)),
        ("fp8_quantize_rows_e5m2_transposed", quantize_body(g, "fp8_q_e5m2_t", &[96, 40], true, DType::F8E5M2, true), (-3000.0, 3000.0)),
        // Both sides multiples of 64: the transposed values go through shared-memory tiles.
        ("fp8_quantize_rows_e5m2_transposed_tiled", quantize_body(g, "fp8_q_e5m2_tt", &[128, 192], true, DType::F8E5M2, true), (-3000.0, 3000.0)),
        // The step's grad_weight operands: bf16, per column, rows a multiple of 128 (four rows'
        // bytes packed per word), two tiles down and three across.
        ("fp8_quantize_cols_transposed_packed", quantize_body_of(g, "fp8_q_cols_tp", DType::BF16, &[256, 192], false, DType::F8E4M3, true), (-30.0, 30.0)),
        ("fp8_amax_cols", amax(g, "fp8_amax_cols", &[512, 64], vec![0]), (-4.0, 4.0)),
        ("fp8_amax_tensor", amax(g, "fp8_amax_tensor", &[8, 64, 64], vec![0, 1, 2]), (-4.0, 4.0)),
    ]
}

/// float8's per-column amax over the tokens (the grad_weight operands' column scales) as a
/// column kernel: `abs -> reduce_max over the rows -> fp8_scale, recip` of a bf16 `[rows..., d]`,
/// the amax and both per-column results as outputs. With `elem`, the kernel also stores a
/// per-element value (`cast` of the input to f32) as it reads the rows.
fn colmax_body(g: &mut Graph, name: &str, shape: &[u64], elem: bool) -> BlockId {
    let axes: Vec<usize> = (0..shape.len() - 1).collect();
    body(g, name, &[bf16(shape)], |b, a| {
        let x = push(b, Op::Unary(UnaryOp::Abs), &[a[0]]);
        let m = push(b, Op::Reduce { kind: ReduceKind::Max, axes }, &[x]);
        let s = b.push_typed(Op::Fp8Scale { dtype: DType::F8E4M3, pow2: true }, &[m], f32t(&[shape[shape.len() - 1]])).expect("fp8_scale");
        let r = push(b, Op::Unary(UnaryOp::Recip), &[s]);
        let mut outs = vec![m, s, r];
        if elem {
            outs.insert(0, b.push_typed(Op::Cast, &[a[0]], f32t(shape)).expect("cast"));
        }
        outs
    })
}

/// float8's rowwise quantization of a row kernel's value, built by the float8 pass's own
/// `titan_ir::float8::quantize` (e4m3 per row, power-of-2 scales): of `h = gate * up` with
/// `product` (SwiGLU's shape with its `silu` left out, so that every result stays exact; `h`
/// is an output too) or of the argument itself; with `colmax`, also the per-column amax over
/// the rows (a column accumulation next to the row reduction: the row kernel's cross-block path
/// that rmsnorm_bwd's weight gradient takes).
fn row_quant_body(g: &mut Graph, name: &str, rows: u64, d: u64, product: bool, colmax: bool) -> BlockId {
    let shape = [rows, d];
    let args: Vec<TensorType> = if product { vec![bf16(&shape), bf16(&shape)] } else { vec![bf16(&shape)] };
    body(g, name, &args, |b, a| {
        let h = if product { push(b, Op::Binary(BinaryOp::Mul), &[a[0], a[1]]) } else { a[0] };
        let per_row = titan_ir::float8::OperandScaling { dtype: DType::F8E4M3, scaling: titan_ir::float8::Scaling::Over(1) };
        let q = titan_ir::float8::quantize(b, h, per_row, true).expect("quantize");
        let mut outs = vec![q.q, q.inv_scale];
        if product {
            outs.insert(0, h);
        }
        if colmax {
            let x = push(b, Op::Unary(UnaryOp::Abs), &[h]);
            outs.push(push(b, Op::Reduce { kind: ReduceKind::Max, axes: vec![0] }, &[x]));
        }
        outs
    })
}

/// SwiGLU with float8 rowwise's row quantization of what the next GEMM reads, at `[rows, d]`:
/// forward `h = silu(gate) * up` (h stored and quantized), or backward from `dh` the gate's
/// and up's gradients (both stored and quantized), as fusion groups them in a rowwise build.
fn swiglu_quant_body(g: &mut Graph, name: &str, rows: u64, d: u64, bwd: bool) -> BlockId {
    let shape = [rows, d];
    let n = if bwd { 3 } else { 2 };
    body(g, name, &vec![bf16(&shape); n], |b, a| {
        let per_row = titan_ir::float8::OperandScaling { dtype: DType::F8E4M3, scaling: titan_ir::float8::Scaling::Over(1) };
        let outs: Vec<Value> = if bwd {
            // (dh, gate, up) -> (d_gate, d_up)
            let s = push(b, Op::Unary(UnaryOp::Silu), &[a[1]]);
            let d_up = push(b, Op::Binary(BinaryOp::Mul), &[a[0], s]);
            let d_s = push(b, Op::Binary(BinaryOp::Mul), &[a[0], a[2]]);
            vec![push(b, Op::Binary(BinaryOp::SiluGrad), &[a[1], d_s]), d_up]
        } else {
            let s = push(b, Op::Unary(UnaryOp::Silu), &[a[0]]);
            vec![push(b, Op::Binary(BinaryOp::Mul), &[s, a[1]])]
        };
        let mut all = Vec::new();
        for x in outs {
            let q = titan_ir::float8::quantize(b, x, per_row, true).expect("quantize");
            all.extend([x, q.q, q.inv_scale]);
        }
        all
    })
}

/// Column-amax kernels at small odd shapes (a partial column tile, one column per lane, a
/// partial last chunk), leading dims folded into the rows, a stored per-element value, and a
/// head-like row of 128256 columns; the float input range of each.
fn colmax_cases(g: &mut Graph) -> Vec<(&'static str, BlockId, (f64, f64))> {
    vec![
        ("colmax_96x40", colmax_body(g, "colmax_96x40", &[96, 40], false), (-4.0, 4.0)),
        ("colmax_1000x77", colmax_body(g, "colmax_1000x77", &[1000, 77], false), (-300.0, 300.0)),
        ("colmax_3d_2x300x136", colmax_body(g, "colmax_3d", &[2, 300, 136], false), (-1e-3, 1e-3)),
        ("colmax_elem_200x264", colmax_body(g, "colmax_elem", &[200, 264], true), (-8.0, 8.0)),
        ("colmax_head_48x128256", colmax_body(g, "colmax_head", &[48, 128256], false), (-2.0, 2.0)),
        // A row kernel holding a column amax next to its row quantization: more rows than the
        // grid (1100 > 264 CTAs), so CTAs visit several rows (prefetching the next), and 9 groups
        // of CTA partials, the last one partial.
        ("row_quant_colmax_1100x4096", row_quant_body(g, "rq_colmax", 1100, 4096, false, true), (-6.0, 6.0)),
        // SwiGLU's 14336-wide rows with their row quantization: looped by 448-thread CTAs, two
        // per SM, the quantizing pass reading back the stored product.
        ("mul_quant_rows_24x14336", row_quant_body(g, "mul_q", 24, 14336, true, false), (-4.0, 4.0)),
        (
            "colmax_plain_4100x24",
            body(g, "colmax_plain", &[bf16(&[4100, 24])], |b, a| vec![push(b, Op::Reduce { kind: ReduceKind::Max, axes: vec![0] }, &[a[0]])]),
            (-5.0, 5.0),
        ),
    ]
}

fn cases(g: &mut Graph) -> Vec<(&'static str, BlockId, KernelKind)> {
    let mut v = Vec::new();
    for (name, id, _) in fp8_cases(g) {
        v.push((name, id, KernelKind::Fused));
    }
    for (name, id, _) in colmax_cases(g) {
        v.push((name, id, KernelKind::Fused));
    }
    v.push(("rmsnorm_fwd", rmsnorm_body(g), KernelKind::Fused));
    v.push(("swiglu_fwd", swiglu_body(g), KernelKind::Fused));
    // float8 rowwise's SwiGLU kernels at 8B's width (wide rows looped by 448-thread CTAs, two
    // per SM: they must fit in 73 registers without spilling).
    v.push(("swiglu_quant_rows_8b", swiglu_quant_body(g, "swiglu_q_8b", 16, 14336, false), KernelKind::Fused));
    v.push(("swiglu_bwd_quant_rows_8b", swiglu_quant_body(g, "swiglu_bwd_q_8b", 16, 14336, true), KernelKind::Fused));
    v.push((
        "residual_rmsnorm",
        body(g, "res_norm", &[bf16(&[8, 64, 64]), bf16(&[8, 64, 64]), bf16(&[64])], |b, a| {
            let h = push(b, Op::Binary(BinaryOp::Add), &[a[0], a[1]]);
            vec![h, push(b, Op::RmsNorm { eps: 1e-5 }, &[h, a[2]])]
        }),
        KernelKind::Fused,
    ));
    v.push((
        "rmsnorm_fwd_8b",
        body(g, "norm_8b", &[bf16(&[2, 1024, 4096]), bf16(&[2, 1024, 4096]), bf16(&[4096])], |b, a| {
            let h = push(b, Op::Binary(BinaryOp::Add), &[a[0], a[1]]);
            vec![h, push(b, Op::RmsNorm { eps: 1e-5 }, &[h, a[2]])]
        }),
        KernelKind::Fused,
    ));
    v.push((
        "rmsnorm_fwd_70b",
        body(g, "norm_70b", &[bf16(&[2, 1024, 8192]), bf16(&[8192])], |b, a| vec![push(b, Op::RmsNorm { eps: 1e-5 }, &[a[0], a[1]])]),
        KernelKind::Fused,
    ));
    v.push((
        "swiglu_bwd",
        body(g, "swiglu_bwd", &[bf16(&[8, 64, 192]), bf16(&[8, 64, 192]), bf16(&[8, 64, 192]), bf16(&[8, 64, 192])], |b, a| {
            // (dh, up, gate, pre-activation) -> (d_pre, d_up)
            let d_gate = push(b, Op::Binary(BinaryOp::Mul), &[a[0], a[1]]);
            let d_up = push(b, Op::Binary(BinaryOp::Mul), &[a[0], a[2]]);
            vec![push(b, Op::Binary(BinaryOp::SiluGrad), &[a[3], d_gate]), d_up]
        }),
        KernelKind::Fused,
    ));
    let half = RopeConfig { theta: 500000.0, layout: RopeLayout::Half, scaling: None, inverse: false };
    v.push(("rope_half", body(g, "rope_q", &[bf16(&[8, 64, 4, 16])], |b, a| vec![push(b, Op::Rope(half), &[a[0]])]), KernelKind::Fused));
    let scaled = RopeConfig {
        theta: 500000.0,
        layout: RopeLayout::Interleaved,
        scaling: Some(RopeScaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 }),
        inverse: true,
    };
    v.push(("rope_interleaved_inverse", body(g, "rope_bwd", &[bf16(&[8, 64, 2, 16])], |b, a| vec![push(b, Op::Rope(scaled), &[a[0]])]), KernelKind::Fused));
    let half_8b = RopeConfig { inverse: true, ..half };
    v.push(("rope_half_8b", body(g, "rope_8b", &[bf16(&[2, 1024, 32, 128])], |b, a| vec![push(b, Op::Rope(half_8b), &[a[0]])]), KernelKind::Fused));
    v.push((
        "rmsnorm_bwd_add",
        body(g, "norm_bwd", &[bf16(&[8, 64, 64]), bf16(&[64]), bf16(&[8, 64, 64]), bf16(&[8, 64, 64]), bf16(&[8, 64, 64])], |b, a| {
            let dy = push(b, Op::Binary(BinaryOp::Add), &[a[2], a[3]]);
            let r = b.push(Op::RmsNormBwd { eps: 1e-5 }, &[a[0], a[1], dy]).expect("rmsnorm_bwd");
            vec![push(b, Op::Binary(BinaryOp::Add), &[a[4], r[0]]), r[1]]
        }),
        KernelKind::Fused,
    ));
    v.push((
        "rmsnorm_bwd_8b",
        body(g, "norm_bwd_8b", &[bf16(&[2, 1024, 4096]), bf16(&[4096]), bf16(&[2, 1024, 4096])], |b, a| {
            b.push(Op::RmsNormBwd { eps: 1e-5 }, &[a[0], a[1], a[2]]).expect("rmsnorm_bwd")
        }),
        KernelKind::Fused,
    ));
    v.push(("cross_entropy", body(g, "ce", &[bf16(&[8, 64, 256]), i32t(&[8, 64])], |b, a| vec![push(b, Op::CrossEntropy, &[a[0], a[1]])]), KernelKind::Fused));
    v.push((
        "cross_entropy_bwd",
        body(g, "ce_bwd", &[bf16(&[8, 64, 256]), i32t(&[8, 64])], |b, a| {
            let one = b.push_typed(Op::Constant { value: 1.0 }, &[], f32t(&[])).expect("constant");
            vec![push(b, Op::CrossEntropyBwd, &[a[0], a[1], one])]
        }),
        KernelKind::Fused,
    ));
    v.push((
        "cross_entropy_fwd_bwd_vocab",
        body(g, "ce_vocab", &[bf16(&[4, 512, 128256]), i32t(&[4, 512]), f32t(&[])], |b, a| {
            let loss = push(b, Op::CrossEntropy, &[a[0], a[1]]);
            vec![loss, push(b, Op::CrossEntropyBwd, &[a[0], a[1], a[2]])]
        }),
        KernelKind::Fused,
    ));
    // The vocab-parallel loss (forward and backward are separate kernels in a build): 70B's
    // vocabulary shard at tp 8 (rows held in registers) and 8B's at tp 2 (rows looped), and the
    // combine of 8 shards' statistics.
    let stats_cases: [(&'static str, &'static str, &'static str, &'static str, u64, u64); 2] = [
        ("ce_stats_tp8", "ce_stats8", "ce_stats_bwd_tp8", "ce_stats_bwd8", 16032, 8),
        ("ce_stats_tp2", "ce_stats2", "ce_stats_bwd_tp2", "ce_stats_bwd2", 64128, 2),
    ];
    for (name, key, bwd_name, bwd_key, v_shard, n) in stats_cases {
        v.push((
            name,
            body(g, key, &[bf16(&[2, 512, v_shard]), i32t(&[2, 512]), f32t(&[n])], |b, a| {
                b.push(Op::CrossEntropyStats, &[a[0], a[1], a[2]]).expect("cross_entropy_stats")
            }),
            KernelKind::Fused,
        ));
        v.push((
            bwd_name,
            body(g, bwd_key, &[bf16(&[2, 512, v_shard]), i32t(&[2, 512]), f32t(&[n]), f32t(&[2, 512, 1]), f32t(&[2, 512, 1]), f32t(&[2, 512, 1])], |b, a| {
                vec![push(b, Op::CrossEntropyStatsBwd, &[a[0], a[1], a[2], a[3], a[4], a[5]])]
            }),
            KernelKind::Fused,
        ));
    }
    v.push((
        "ce_combine_tp8",
        body(g, "ce_combine", &[f32t(&[2, 512, 8]), f32t(&[2, 512, 8]), f32t(&[2, 512, 8])], |b, a| {
            vec![push(b, Op::CrossEntropyCombine, &[a[0], a[1], a[2]])]
        }),
        KernelKind::Fused,
    ));
    v.push((
        "cast_bf16_to_f32",
        body(g, "cast_up", &[bf16(&[2, 192, 64])], |b, a| vec![b.push_typed(Op::Cast, &[a[0]], f32t(&[2, 192, 64])).expect("cast")]),
        KernelKind::Fused,
    ));
    v.push((
        "cast_f32_to_bf16",
        body(g, "cast_down", &[f32t(&[256, 64])], |b, a| vec![b.push_typed(Op::Cast, &[a[0]], bf16(&[256, 64])).expect("cast")]),
        KernelKind::Fused,
    ));
    v.push((
        "grad_norm_sq",
        body(g, "gnorm", &[bf16(&[2, 192, 64])], |b, a| {
            let c = b.push_typed(Op::Cast, &[a[0]], f32t(&[2, 192, 64])).expect("cast");
            let s = push(b, Op::Unary(UnaryOp::Square), &[c]);
            vec![push(b, Op::Reduce { kind: ReduceKind::Sum, axes: vec![0, 1, 2] }, &[s])]
        }),
        KernelKind::Fused,
    ));
    v.push((
        "scalar_chain",
        body(g, "clip", &[f32t(&[]), f32t(&[])], |b, a| {
            let n = push(b, Op::Unary(UnaryOp::Sqrt), &[a[0]]);
            let eps = b.push_typed(Op::Constant { value: 1e-6 }, &[], f32t(&[])).expect("constant");
            let one = b.push_typed(Op::Constant { value: 1.0 }, &[], f32t(&[])).expect("constant");
            let s = push(b, Op::Binary(BinaryOp::Add), &[n, eps]);
            let s = push(b, Op::Binary(BinaryOp::Add), &[s, a[1]]);
            let q = push(b, Op::Binary(BinaryOp::Div), &[one, s]);
            vec![n, push(b, Op::Binary(BinaryOp::Min), &[q, one])]
        }),
        KernelKind::Fused,
    ));
    v.push((
        "softmax_rows",
        body(g, "softmax", &[f32t(&[512, 256]), f32t(&[256])], |b, a| {
            let m = push(b, Op::Reduce { kind: ReduceKind::Max, axes: vec![1] }, &[a[0]]);
            let mb = b.push_typed(Op::Broadcast { dims: vec![0] }, &[m], f32t(&[512, 256])).expect("broadcast");
            let x = push(b, Op::Binary(BinaryOp::Sub), &[a[0], mb]);
            let e = push(b, Op::Unary(UnaryOp::Exp), &[x]);
            let s = push(b, Op::Reduce { kind: ReduceKind::Sum, axes: vec![1] }, &[e]);
            let sb = b.push_typed(Op::Broadcast { dims: vec![0] }, &[s], f32t(&[512, 256])).expect("broadcast");
            let p = push(b, Op::Binary(BinaryOp::Div), &[e, sb]);
            let wb = b.push_typed(Op::Broadcast { dims: vec![1] }, &[a[1]], f32t(&[512, 256])).expect("broadcast");
            vec![push(b, Op::Binary(BinaryOp::Mul), &[p, wb]), s]
        }),
        KernelKind::Fused,
    ));
    v.push((
        "column_sum",
        body(g, "colsum", &[bf16(&[8, 64, 64])], |b, a| vec![push(b, Op::Reduce { kind: ReduceKind::Sum, axes: vec![0, 1] }, &[a[0]])]),
        KernelKind::Fused,
    ));
    v.push((
        "pointwise_math",
        body(g, "math", &[f32t(&[8, 1000]), f32t(&[1000]), f32t(&[8, 1000])], |b, a| {
            let x = push(b, Op::Unary(UnaryOp::Log), &[a[0]]);
            let y = push(b, Op::Unary(UnaryOp::Tanh), &[x]);
            let e = b.push_typed(Op::Broadcast { dims: vec![1] }, &[a[1]], f32t(&[8, 1000])).expect("broadcast");
            let z = push(b, Op::Binary(BinaryOp::Pow), &[y, e]);
            let r = push(b, Op::Unary(UnaryOp::Rsqrt), &[z]);
            let s = push(b, Op::Unary(UnaryOp::Sigmoid), &[r]);
            vec![push(b, Op::Binary(BinaryOp::Max), &[s, a[2]])]
        }),
        KernelKind::Fused,
    ));
    v.push(("embedding", body(g, "embed", &[i32t(&[8, 64]), bf16(&[256, 64])], |b, a| vec![push(b, Op::Embedding, &[a[0], a[1]])]), KernelKind::Gather));
    v.push((
        "embedding_8b",
        body(g, "embed_8b", &[i32t(&[8, 8192]), bf16(&[128256, 4096])], |b, a| vec![push(b, Op::Embedding, &[a[0], a[1]])]),
        KernelKind::Gather,
    ));
    v.push((
        "scatter_add",
        body(g, "scatter", &[i32t(&[8, 64]), bf16(&[8, 64, 64])], |b, a| {
            vec![b.push_typed(Op::ScatterAdd, &[a[0], a[1]], bf16(&[256, 64])).expect("scatter_add")]
        }),
        KernelKind::ScatterAdd,
    ));
    v.push((
        "scatter_add_8b",
        body(g, "scatter_8b", &[i32t(&[8, 8192]), bf16(&[8, 8192, 4096])], |b, a| {
            vec![b.push_typed(Op::ScatterAdd, &[a[0], a[1]], bf16(&[128256, 4096])).expect("scatter_add")]
        }),
        KernelKind::ScatterAdd,
    ));
    // Llama-3.2 1B's tied embedding gradient: the head's weight gradient plus the scatter (rule 12).
    v.push((
        "scatter_add_into_1b",
        body(g, "scatter_into_1b", &[i32t(&[1, 8192]), bf16(&[1, 8192, 2048]), bf16(&[128256, 2048])], |b, a| {
            let t = b.push_typed(Op::ScatterAdd, &[a[0], a[1]], bf16(&[128256, 2048])).expect("scatter_add");
            vec![push(b, Op::Binary(BinaryOp::Add), &[a[2], t])]
        }),
        KernelKind::ScatterAdd,
    ));
    // The vocab-parallel embedding at 70B (tp 8: a 16032-row shard of 128256 words, seq 8192).
    v.push((
        "gather_shard_70b",
        body(g, "gather_shard_70b", &[bf16(&[16032, 8192]), i32t(&[1, 8192]), f32t(&[8])], |b, a| vec![push(b, Op::GatherShard, &[a[0], a[1], a[2]])]),
        KernelKind::Gather,
    ));
    // Its gradient at 8B (tp 2: a 64128-row shard, rows of 4096). FIXME: at 70B's rows of 8192
    // `scatter_add` and `scatter_add_shard` alike use 64 registers and spill 4 bytes (the
    // register cap of 4 CTAs per SM with 4 column chunks of accumulators per thread).
    v.push((
        "scatter_add_shard_8b",
        body(g, "scatter_shard_8b", &[i32t(&[8, 8192]), bf16(&[8, 8192, 4096]), f32t(&[2])], |b, a| {
            vec![b.push_typed(Op::ScatterAddShard, &[a[0], a[1], a[2]], bf16(&[64128, 4096])).expect("scatter_add_shard")]
        }),
        KernelKind::ScatterAdd,
    ));
    v.push(("grad_norm_clip", grad_norm_body(g, [&[2, 192, 64], &[64], &[256, 64]]), KernelKind::Fused));
    v.push(("optimizer", optimizer_body(g), KernelKind::Optimizer));
    v.push(("optimizer_mixed_grads", optimizer_mixed_body(g), KernelKind::Optimizer));
    v.push(("optimizer_compute_copies", optimizer_copies_body(g), KernelKind::Optimizer));
    v.push(("attention_d128_gqa_causal", attention_body(g, [1, 512, 8, 2, 128], true), KernelKind::Attention));
    v.push(("attention_d128", attention_body(g, [1, 512, 8, 2, 128], false), KernelKind::Attention));
    v.push(("attention_d64_causal", attention_body(g, [2, 256, 4, 4, 64], true), KernelKind::Attention));
    v.push(("attention_d16_debug", attention_body(g, [8, 64, 4, 4, 16], true), KernelKind::Attention));
    v
}

/// One `attention` node: `[b, s, hq, hkv, d]`, scale `1 / sqrt(d)`; outputs (out, lse).
fn attention_body(g: &mut Graph, [b, s, hq, hkv, d]: [u64; 5], causal: bool) -> BlockId {
    let scale = 1.0 / (d as f64).sqrt();
    body(g, "attn", &[bf16(&[b, s, hq, d]), bf16(&[b, s, hkv, d]), bf16(&[b, s, hkv, d])], |bd, a| {
        bd.push(Op::Attention { causal, scale }, &[a[0], a[1], a[2]]).expect("attention")
    })
}

/// One `attention_bwd` node: `(q, k, v, out, lse, dout) -> (dq, dk, dv)`, `[b, s, hq, hkv, d]`.
fn attention_bwd_body(g: &mut Graph, [b, s, hq, hkv, d]: [u64; 5], causal: bool) -> BlockId {
    let scale = 1.0 / (d as f64).sqrt();
    let (q, kv) = (bf16(&[b, s, hq, d]), bf16(&[b, s, hkv, d]));
    body(g, "attn_bwd", &[q.clone(), kv.clone(), kv, q.clone(), f32t(&[b, hq, s]), q], |bd, a| {
        bd.push(Op::AttentionBwd { causal, scale }, a).expect("attention_bwd")
    })
}

#[test]
fn attention_bwd_assembles_without_spills() {
    let mut g = graph();
    let mut failures = Vec::new();
    for (name, shape, causal) in [
        ("attention_bwd_d128_gqa_causal", [1, 512, 8, 2, 128], true),
        ("attention_bwd_d128_gqa", [1, 512, 8, 2, 128], false),
        // Llama-3 8B's heads at seq 4096 (its dK/dV copier spilled at 24 registers; seq 512
        // did not).
        ("attention_bwd_d128_4096", [2, 4096, 32, 8, 128], true),
        ("attention_bwd_d64", [2, 256, 4, 4, 64], false),
        ("attention_bwd_d64_gqa_causal", [2, 256, 8, 2, 64], true),
        ("attention_bwd_d16_debug", [8, 64, 4, 4, 16], true),
    ] {
        let id = attention_bwd_body(&mut g, shape, causal);
        let k = compile(&g, id, KernelKind::AttentionBwd, name);
        let [b, s, hq, _, d] = shape;
        // Two phases: the dQ pass (which writes D and lse for the second) first; scratch workspace.
        assert_eq!(k.workspace_bytes, 2 * b * s * hq * 4);
        assert!(k.workspace_scratch);
        let pro = k.prologue.as_ref().expect("attention_bwd has a dQ phase");
        assert_eq!(pro.entry, format!("{}_dq", k.entry));
        // Warp-specialized (head_dim 128: two consumer warpgroups of 64 rows), else 64 rows a CTA.
        let rows = if d == 128 { 128 } else { 64 };
        assert_eq!(pro.launch.grid[0] as u64, s / rows * b * hq);
        for (entry, launch) in [(&pro.entry, &pro.launch), (&k.entry, &k.launch)] {
            match ptxas_check(&k.ptx, entry) {
                Ok(r) => {
                    println!(
                        "{name} {entry}: {} registers, {} spill stores, {} spill loads, {} bytes static smem, {} bytes dynamic (grid {})",
                        r.registers, r.spill_stores, r.spill_loads, r.shared_bytes, launch.shared_bytes, launch.grid[0]
                    );
                    failures.extend(r.problems().into_iter().map(|p| format!("{name} {entry}: {p}")));
                }
                Err(e) => failures.push(format!("{name}: {e}")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn attention_kernel_shape_and_launch() {
    let mut g = graph();
    let id = attention_body(&mut g, [2, 256, 8, 2, 64], true);
    let k = compile(&g, id, KernelKind::Attention, "layer.attn");
    // One CTA of 4 warps per 64-row query tile of each (batch, head).
    assert_eq!(k.launch.grid, [4 * 2 * 8, 1, 1]);
    assert_eq!(k.launch.block, [128, 1, 1]);
    assert_eq!(k.workspace_bytes, 0);
    // head_dim 64: both products on wgmma (K K-major, V MN-major: the transposed B), operands
    // behind a proxy fence, no mma.sync left.
    assert!(k.ptx.contains("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"));
    assert_eq!(k.ptx.matches("wgmma.mma_async").count(), 4 * 4, "Q K^T in the prologue and the loop, P V in the loop and after it: 4 k-steps each");
    // S = Q K^T starts from nothing (scale-d p = 0 on its first k-step, q = 1 after); P V adds.
    assert!(k.ptx.contains("d, p, 1, 1, 0;") && k.ptx.contains("d, q, 1, 1, 0;") && k.ptx.contains("d, p, 1, 1, 1;"));
    assert!(k.ptx.contains("fence.proxy.async.shared::cta"));
    assert!(!k.ptx.contains("mma.sync") && !k.ptx.contains("ldmatrix"));
    assert!(k.ptx.contains("cp.async.cg.shared.global"));
    // Pipelined: the loop waits for S_j with P_{j+1} V_{j+1} still in flight (wait_group 1),
    // then for that; Q from registers at head_dim 64; two K and two V buffers of 8 KB.
    assert!(k.ptx.contains("wgmma.wait_group.sync.aligned 1;") && k.ptx.contains("wgmma.wait_group.sync.aligned 0;"));
    assert!(!k.ptx.contains("add.s64 da"), "head_dim 64 keeps Q in registers");
    assert_eq!(k.launch.shared_bytes, 4 * 64 * 64 * 2);
    // head_dim 128: Q in shared memory (the first product's A operand from a descriptor, eight
    // k-steps), one K and two V buffers of 16 KB plus Q's 16 KB: three CTAs fit an SM.
    let id = attention_body(&mut g, [1, 512, 8, 2, 128], true);
    let k = compile(&g, id, KernelKind::Attention, "layer.attn128");
    assert_eq!(k.ptx.matches("add.s64 da").count(), 2 * 8, "Q K^T from shared A in the prologue and the loop");
    assert_eq!(k.launch.shared_bytes, 4 * 64 * 128 * 2);
    assert!(k.ptx.contains(".minnctapersm 3"));
    // The backward's dQ pass (the module's `_dq` entry) runs its three products on wgmma too.
    let id = attention_bwd_body(&mut g, [2, 256, 8, 2, 64], true);
    let k = compile(&g, id, KernelKind::AttentionBwd, "layer_bwd.attn");
    let dq = &k.ptx[k.ptx.find(".entry layer_bwd_attn_dq(").expect("dq entry")..];
    let dq = &dq[..dq[1..].find(".entry").map_or(dq.len(), |i| i + 1)];
    assert_eq!(dq.matches("wgmma.fence.sync.aligned").count(), 2 * 3, "S, dP and dQ chains in the unmasked and the diagonal loop");
    assert_eq!(dq.matches("wgmma.mma_async.sync.aligned.m64n64k16").count(), 2 * 3 * 4, "four k-steps a chain at head_dim 64");
    assert!(dq.contains("fence.proxy.async.shared::cta"));
    // And the dK/dV pass (the main entry): S^T and dP^T with both operands from shared memory,
    // dV and dK with P^T and dS^T as register fragments, four chains of four k-steps.
    let dkdv = &k.ptx[k.ptx.find(".entry layer_bwd_attn(").expect("dK/dV entry")..];
    let dkdv = &dkdv[..dkdv[1..].find(".entry").map_or(dkdv.len(), |i| i + 1)];
    assert_eq!(dkdv.matches("wgmma.fence.sync.aligned").count(), 4, "S^T, dP^T, dV and dK chains");
    assert_eq!(dkdv.matches("wgmma.mma_async.sync.aligned.m64n64k16").count(), 4 * 4, "four k-steps a chain at head_dim 64");
    assert!(dkdv.contains("fence.proxy.async.shared::cta"));
    assert!(!dkdv.contains("mma.sync") && !dkdv.contains("ldmatrix"));
    // head_dim 16 (rows below the 128-byte swizzle) keeps mma.sync with ldmatrix fragments.
    let id = attention_body(&mut g, [1, 128, 4, 2, 16], true);
    let k = compile(&g, id, KernelKind::Attention, "layer.attn16");
    assert!(k.ptx.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"));
    assert!(k.ptx.contains("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"));
    assert!(!k.ptx.contains("wgmma"));
}

/// The backward's warp-specialized passes (head_dim 128 by default, sequence a multiple of
/// 128): three warpgroups a CTA (two computing, one copying), registers moved between them by
/// `setmaxnreg`, stages handed over by `mbarrier`s, no CTA-wide barrier after the split. A
/// sequence that is a multiple of 64 only, and head_dim 64, keep the single-warpgroup passes.
#[test]
fn attention_bwd_warp_specialized_structure() {
    let mut g = graph();
    let id = attention_bwd_body(&mut g, [2, 256, 8, 2, 128], true);
    let k = compile(&g, id, KernelKind::AttentionBwd, "layer_bwd.ws");
    assert_eq!(k.launch.block, [384, 1, 1]);
    assert_eq!(k.launch.grid, [256 / 128 * 2 * 2, 1, 1], "one CTA per 128 keys of each (batch, kv head)");
    let pro = k.prologue.as_ref().expect("dQ phase");
    assert_eq!(pro.launch.block, [384, 1, 1]);
    assert_eq!(pro.launch.grid, [256 / 128 * 2 * 8, 1, 1], "one CTA per 128 queries of each (batch, head)");
    // Three stages at head_dim 128: K and V of 128 keys and 33 KB (Q, dO, lse, D) stages; (K,
    // V) stages of 64 keys for dQ; 16 bytes of barriers a stage.
    assert_eq!(k.launch.shared_bytes, 2 * (2 * 128 * 128 + 3 * 16896) + 16 * 3);
    assert_eq!(pro.launch.shared_bytes, 3 * 2 * 64 * 128 * 2 + 16 * 3);
    // The dK/dV pass's copier keeps 32 registers (24 spilled at Llama-3 8B's heads), the dQ
    // pass's 24.
    for (entry, consumer, copier) in [("layer_bwd_ws(", 232, 32), ("layer_bwd_ws_dq(", 240, 24)] {
        let body = &k.ptx[k.ptx.find(&format!(".entry {entry}")).expect("entry")..];
        let body = &body[..body[1..].find(".entry").map_or(body.len(), |i| i + 1)];
        assert!(body.contains(".maxnreg 168"), "{entry}: 384 threads x 168 registers fill the SM");
        assert_eq!(body.matches(&format!("setmaxnreg.inc.sync.aligned.u32 {consumer};")).count(), 1, "{entry}");
        assert_eq!(body.matches(&format!("setmaxnreg.dec.sync.aligned.u32 {copier};")).count(), 1, "{entry}");
        assert_eq!(body.matches("mbarrier.init.shared::cta.b64").count(), 6, "{entry}: a full and an empty barrier per stage");
        assert_eq!(body.matches("bar.sync").count() + body.matches("barrier.sync").count(), 1, "{entry}: one CTA-wide barrier, after the init");
        assert!(body.contains("mbarrier.try_wait.parity.shared::cta.b64") && body.contains("mbarrier.arrive.shared::cta.b64"));
        assert!(body.contains("fence.proxy.async.shared::cta"), "{entry}: the producer fences its copies for wgmma");
    }
    // 192 tokens (whole 64-row tiles, not 128) and head_dim 64 below sequence 4096: the
    // single-warpgroup passes.
    for (shape, name) in [([1, 192, 4, 4, 128], "layer_bwd.s192"), ([1, 256, 4, 4, 64], "layer_bwd.d64"), ([1, 2048, 4, 4, 64], "layer_bwd.d64_2k")] {
        let id = attention_bwd_body(&mut g, shape, false);
        let k = compile(&g, id, KernelKind::AttentionBwd, name);
        assert_eq!(k.launch.block, [128, 1, 1], "{name}");
        assert!(!k.ptx.contains("setmaxnreg") && !k.ptx.contains("mbarrier"), "{name}");
    }
    // head_dim 64 from sequence 4096 on (Llama-3.2 1B's 8192) and 128 from 8192 on (Llama-3 8B's):
    // the five-product backward (tests/attention_five.rs checks its structure; there the
    // seven-product passes it replaces). Head_dim 128 at 4096 keeps the seven-product passes.
    let id = attention_bwd_body(&mut g, [1, 4096, 32, 8, 128], true);
    let k = compile(&g, id, KernelKind::AttentionBwd, "layer_bwd.d128_4k");
    assert!(k.epilogue.is_none() && !k.ptx.contains("cp.reduce.async.bulk"), "head_dim 128 at 4096: seven products");
    for (shape, name) in [([1, 4096, 4, 4, 64], "layer_bwd.d64_4k"), ([1, 8192, 32, 8, 64], "layer_bwd.d64_8k"), ([1, 8192, 32, 8, 128], "layer_bwd.d128_8k")] {
        let id = attention_bwd_body(&mut g, shape, true);
        let k = compile(&g, id, KernelKind::AttentionBwd, name);
        let (pro, epi) = (k.prologue.as_ref().expect("prep phase"), k.epilogue.as_ref().expect("convert phase"));
        assert!(pro.entry.ends_with("_prep") && epi.entry.ends_with("_dqcvt"), "{name}: {} {}", pro.entry, epi.entry);
        assert_eq!(k.launch.block, [384, 1, 1], "{name}");
        assert!(k.ptx.contains("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u32"), "{name}");
    }
}

#[test]
fn unsupported_attention_shapes_are_reported() {
    let mut g = graph();
    let id = attention_body(&mut g, [1, 128, 4, 4, 96], false);
    let err = compile_kernel(&g, id, KernelKind::Attention, "a96").expect_err("head_dim 96");
    assert!(err.to_string().contains("head_dim 96"), "{err}");
    let id = attention_body(&mut g, [1, 100, 4, 4, 64], false);
    let err = compile_kernel(&g, id, KernelKind::Attention, "a100").expect_err("seq 100");
    assert!(err.to_string().contains("sequence length 100"), "{err}");
    let id = attention_body(&mut g, [1, 128, 4, 4, 64], true);
    let t = bf16(&[1, 128, 4, 64]);
    let bwd = body(&mut g, "attn_bwd", &[t.clone(), t.clone(), t], |b, a| {
        let r = b.push(Op::Attention { causal: true, scale: 0.125 }, &[a[0], a[1], a[2]]).expect("attention");
        b.push(Op::AttentionBwd { causal: true, scale: 0.125 }, &[a[0], a[1], a[2], r[0], r[1], a[0]]).expect("attention_bwd")
    });
    assert!(compile_kernel(&g, bwd, KernelKind::AttentionBwd, "bwd").is_err(), "a body of two nodes is not an attention_bwd kernel");
    let err = compile_kernel(&g, bwd, KernelKind::Attention, "bwd").expect_err("two nodes");
    assert!(err.to_string().contains("exactly one attention node"), "{err}");
    assert!(compile_kernel(&g, id, KernelKind::Attention, "ok").is_ok());
}

/// The global gradient norm over three gradients of different shapes, the clip coefficient, and
/// one gradient cast to f32: one flat kernel over three element domains.
fn grad_norm_body(g: &mut Graph, shapes: [&[u64]; 3]) -> BlockId {
    let args = [bf16(shapes[0]), bf16(shapes[1]), f32t(shapes[2])];
    body(g, "gnorm_all", &args, |b, a| {
        let mut total = None;
        let mut casted = None;
        for (i, &x) in a.iter().enumerate() {
            let c = if i < 2 { b.push_typed(Op::Cast, &[x], f32t(shapes[i])).expect("cast") } else { x };
            if i == 0 {
                casted = Some(c);
            }
            let s = push(b, Op::Unary(UnaryOp::Square), &[c]);
            let axes: Vec<usize> = (0..shapes[i].len()).collect();
            let r = push(b, Op::Reduce { kind: ReduceKind::Sum, axes }, &[s]);
            total = Some(match total {
                None => r,
                Some(t) => push(b, Op::Binary(BinaryOp::Add), &[t, r]),
            });
        }
        let total = total.expect("three gradients");
        let norm = push(b, Op::Unary(UnaryOp::Sqrt), &[total]);
        let eps = b.push_typed(Op::Constant { value: 1e-6 }, &[], f32t(&[])).expect("constant");
        let one = b.push_typed(Op::Constant { value: 1.0 }, &[], f32t(&[])).expect("constant");
        let s = push(b, Op::Binary(BinaryOp::Add), &[norm, eps]);
        let q = push(b, Op::Binary(BinaryOp::Div), &[one, s]);
        let clip = push(b, Op::Binary(BinaryOp::Min), &[q, one]);
        vec![norm, clip, casted.expect("first gradient")]
    })
}

fn optimizer_body(g: &mut Graph) -> BlockId {
    optimizer_body_of(g, "opt", &[(&[256, 64], DType::BF16), (&[2, 64], DType::BF16), (&[2, 192, 64], DType::BF16)], false)
}

/// The optimizer as `fuse` builds it since rule 10 (gradients read as the backward made them):
/// bf16 gradients cast and clipped inside the kernel next to an f32 one (a parameter computed
/// in f32), over several chunks and every vector width (4, 2 and 1 lanes).
fn optimizer_mixed_body(g: &mut Graph) -> BlockId {
    optimizer_body_of(g, "opt_mixed", &[(&[3, 4097], DType::BF16), (&[2, 5000], DType::F32), (&[7, 6], DType::BF16), (&[4096], DType::BF16)], false)
}

/// The optimizer as `fuse` builds it after `compute-copies`: every tensor with a bf16 gradient
/// (a bf16 parameter) also writes the bf16 compute copy of its new master, `cast(p_new)`; the
/// f32 one does not. Multi-chunk, every vector width.
fn optimizer_copies_body(g: &mut Graph) -> BlockId {
    optimizer_body_of(g, "opt_copies", &[(&[3, 4097], DType::BF16), (&[2, 5000], DType::F32), (&[7, 6], DType::BF16), (&[4096], DType::BF16)], true)
}

/// `lr_schedule` and one AdamW per `(shape, gradient dtype)`; arguments `step, clip_coef`, then
/// `p, g, m, v` per tensor. A bf16 gradient is cast to f32 before the clip multiply; with
/// `copies` its tensor's new master is also cast to bf16 (one more result).
fn optimizer_body_of(g: &mut Graph, name: &str, tensors: &[(&[u64], DType)], copies: bool) -> BlockId {
    let mut args = vec![i32t(&[]), f32t(&[])];
    for &(s, dt) in tensors {
        args.extend([f32t(s), TensorType::fixed(dt, s), f32t(s), f32t(s)]);
    }
    body(g, name, &args, |b, a| {
        let sched = LrSchedule { lr: 8e-4, warmup_steps: 200, decay_steps: 800, decay: DecayKind::Cosine, min_lr_ratio: 0.1 };
        let lr = push(b, Op::LrSchedule(sched), &[a[0]]);
        let cfg = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
        let mut outs = vec![lr];
        for (i, &(s, dt)) in tensors.iter().enumerate() {
            let (p, gr, m, v) = (a[2 + 4 * i], a[3 + 4 * i], a[4 + 4 * i], a[5 + 4 * i]);
            let g32 = if dt == DType::F32 { gr } else { b.push_typed(Op::Cast, &[gr], f32t(s)).expect("cast") };
            let gc = push(b, Op::Binary(BinaryOp::Mul), &[g32, a[1]]);
            let r = b.push(Op::AdamW(cfg), &[p, gc, m, v, lr, a[0]]).expect("adamw");
            if copies && dt != DType::F32 {
                outs.push(b.push_typed(Op::Cast, &[r[0]], bf16(s)).expect("cast"));
            }
            outs.extend(r);
        }
        outs
    })
}

#[test]
fn every_kernel_assembles_without_spills() {
    if find_ptxas().is_none() {
        panic!("ptxas not found: install it with `pip install nvidia-cuda-nvcc` (or set TITAN_PTXAS); CI installs it, so this test does not skip");
    }
    let mut g = graph();
    let cases = cases(&mut g);
    let mut failures = Vec::new();
    for (name, id, kind) in cases {
        let t = Instant::now();
        let k = match compile_kernel(&g, id, kind, name) {
            Ok(Some(k)) => k,
            Ok(None) => {
                failures.push(format!("{name}: no kernel"));
                continue;
            }
            Err(e) => {
                failures.push(format!("{name}: {e}"));
                continue;
            }
        };
        let codegen = t.elapsed();
        // `TITAN_DUMP_DIR=/tmp/k cargo test -p titan-kernels` keeps each kernel's MLIR and PTX.
        if let Some(dir) = std::env::var_os("TITAN_DUMP_DIR") {
            let dir = std::path::PathBuf::from(dir);
            let written = std::fs::create_dir_all(&dir)
                .and_then(|()| std::fs::write(dir.join(format!("{name}.mlir")), &k.mlir))
                .and_then(|()| std::fs::write(dir.join(format!("{name}.ptx")), &k.ptx));
            if let Err(e) = written {
                failures.push(format!("{name}: cannot dump to {}: {e}", dir.display()));
            }
        }
        match ptxas_check(&k.ptx, &k.entry) {
            Ok(r) => {
                println!(
                    "{name}: {} registers, {} spill stores, {} spill loads, {} bytes smem (grid {}, block {}, workspace {} B, codegen {:.1} ms)",
                    r.registers,
                    r.spill_stores,
                    r.spill_loads,
                    r.shared_bytes,
                    k.launch.grid[0],
                    k.launch.block[0],
                    k.workspace_bytes,
                    codegen.as_secs_f64() * 1e3
                );
                failures.extend(r.problems().into_iter().map(|p| format!("{name}: {p}")));
            }
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    assert!(failures.is_empty(), "kernels failed:\n{}", failures.join("\n"));
}

/// Deterministic pseudo-random numbers (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next() >> 11) as f64 / (1u64 << 53) as f64)
    }
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::I32 => "i32",
        DType::I64 => "i64",
        DType::F8E4M3 => "f8e4m3",
        DType::F8E5M2 => "f8e5m2",
    }
}

fn tensor_bytes(t: &titan_ir::interp::Tensor<f32>) -> Vec<u8> {
    let mut out = Vec::new();
    match &t.data {
        titan_ir::interp::Data::Float(v) => {
            for &x in v {
                match t.dtype {
                    DType::BF16 => out.extend_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes()),
                    DType::F16 => out.extend_from_slice(&half_bits(x).to_le_bytes()),
                    DType::F8E4M3 | DType::F8E5M2 => out.push(titan_ir::fp8::encode(t.dtype, x).expect("an fp8 dtype")),
                    _ => out.extend_from_slice(&x.to_le_bytes()),
                }
            }
        }
        titan_ir::interp::Data::Int(v) => {
            for &x in v {
                match t.dtype {
                    DType::I64 => out.extend_from_slice(&x.to_le_bytes()),
                    _ => out.extend_from_slice(&(x as i32).to_le_bytes()),
                }
            }
        }
    }
    out
}

/// f16 bits of a value already rounded to f16 (only used for dumping test data).
fn half_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    let man = ((b >> 13) & 0x3ff) as u16;
    if x == 0.0 { sign } else { sign | ((exp.clamp(0, 31) as u16) << 10) | man }
}

/// Random arguments for a body: floats in `range` rounded to their dtype, integers in
/// `[0, int_hi)`; `special` overrides arguments by index.
fn random_args(g: &Graph, id: BlockId, rng: &mut Rng, range: (f64, f64), int_hi: i64) -> Vec<titan_ir::interp::Tensor<f32>> {
    let r = g.block(id);
    r.args
        .iter()
        .map(|a| {
            let ty = r.ty(a.value);
            let shape = ty.resolve(&g.dims).expect("bound dims");
            let n: usize = shape.iter().product();
            if ty.dtype.is_int() {
                let v = (0..n).map(|_| (rng.next() % int_hi.max(1) as u64) as i64).collect();
                titan_ir::interp::Tensor::from_ints(ty.dtype, shape, v).expect("ints")
            } else {
                let v = (0..n).map(|_| titan_ir::interp::round_to_dtype(rng.uniform(range.0, range.1) as f32, ty.dtype)).collect();
                titan_ir::interp::Tensor::from_vec(ty.dtype, shape, v).expect("floats")
            }
        })
        .collect()
}

/// A GPU validation case: name, body, kind, float input range, integer input bound, minimal
/// fraction of elements within one ulp of the interpreter, largest relative error.
type GpuCase = (&'static str, BlockId, KernelKind, (f64, f64), i64, f64, f64);

/// GPU validation data: with `TITAN_GPU_DUMP=<dir>`, compile moderate-size kernels, run the
/// reference interpreter on random inputs, and write PTX, inputs and expected outputs for
/// `python3 kernels/tests/gpu_check.py <dir>` on a GPU machine. Without the variable it only
/// checks that every case compiles (CI has no GPU).
#[test]
fn gpu_reference_dump() {
    use titan_ir::interp::{Interpreter, Precision, Tensor};
    let dir = std::env::var_os("TITAN_GPU_DUMP").map(std::path::PathBuf::from);
    let mut g = graph();
    // (name, body, kind, float range, int bound, min fraction within 1 ulp, max rel error)
    let mut cases: Vec<GpuCase> = Vec::new();
    let half = RopeConfig { theta: 500000.0, layout: RopeLayout::Half, scaling: None, inverse: false };
    let scaled = RopeConfig {
        theta: 500000.0,
        layout: RopeLayout::Interleaved,
        scaling: Some(RopeScaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 64 }),
        inverse: true,
    };
    cases.push(("rmsnorm_fwd", rmsnorm_body(&mut g), KernelKind::Fused, (-2.0, 2.0), 1, 0.99, 0.02));
    cases.push(("swiglu_fwd", swiglu_body(&mut g), KernelKind::Fused, (-4.0, 4.0), 1, 0.999, 0.02));
    cases.push((
        "residual_rmsnorm_4100",
        body(&mut g, "g_res_norm", &[bf16(&[3, 5, 4100]), bf16(&[3, 5, 4100]), bf16(&[4100])], |b, a| {
            let h = push(b, Op::Binary(BinaryOp::Add), &[a[0], a[1]]);
            vec![h, push(b, Op::RmsNorm { eps: 1e-5 }, &[h, a[2]])]
        }),
        KernelKind::Fused,
        (-2.0, 2.0),
        1,
        0.99,
        0.02,
    ));
    cases.push((
        "rmsnorm_4096",
        body(&mut g, "g_norm_4096", &[bf16(&[64, 4096]), bf16(&[4096])], |b, a| vec![push(b, Op::RmsNorm { eps: 1e-5 }, &[a[0], a[1]])]),
        KernelKind::Fused,
        (-2.0, 2.0),
        1,
        0.99,
        0.02,
    ));
    cases.push((
        "swiglu_bwd",
        body(&mut g, "g_swiglu_bwd", &[bf16(&[8, 64, 192]), bf16(&[8, 64, 192]), bf16(&[8, 64, 192]), bf16(&[8, 64, 192])], |b, a| {
            let d_gate = push(b, Op::Binary(BinaryOp::Mul), &[a[0], a[1]]);
            let d_up = push(b, Op::Binary(BinaryOp::Mul), &[a[0], a[2]]);
            vec![push(b, Op::Binary(BinaryOp::SiluGrad), &[a[3], d_gate]), d_up]
        }),
        KernelKind::Fused,
        (-4.0, 4.0),
        1,
        0.999,
        0.02,
    ));
    cases.push((
        "rope_half",
        body(&mut g, "g_rope", &[bf16(&[2, 64, 4, 16])], |b, a| vec![push(b, Op::Rope(half), &[a[0]])]),
        KernelKind::Fused,
        (-2.0, 2.0),
        1,
        0.999,
        0.02,
    ));
    cases.push((
        "rope_interleaved_scaled_inverse",
        body(&mut g, "g_rope_i", &[bf16(&[2, 300, 2, 128])], |b, a| vec![push(b, Op::Rope(scaled), &[a[0]])]),
        KernelKind::Fused,
        (-2.0, 2.0),
        1,
        0.999,
        0.02,
    ));
    cases.push((
        "rope_half_128",
        body(&mut g, "g_rope_128", &[f32t(&[1, 257, 8, 128])], |b, a| vec![push(b, Op::Rope(RopeConfig { inverse: true, ..half }), &[a[0]])]),
        KernelKind::Fused,
        (-2.0, 2.0),
        1,
        0.99,
        1e-4,
    ));
    cases.push((
        "rmsnorm_bwd_add",
        body(&mut g, "g_norm_bwd", &[bf16(&[8, 64, 64]), bf16(&[64]), bf16(&[8, 64, 64]), bf16(&[8, 64, 64]), bf16(&[8, 64, 64])], |b, a| {
            let dy = push(b, Op::Binary(BinaryOp::Add), &[a[2], a[3]]);
            let r = b.push(Op::RmsNormBwd { eps: 1e-5 }, &[a[0], a[1], dy]).expect("rmsnorm_bwd");
            vec![push(b, Op::Binary(BinaryOp::Add), &[a[4], r[0]]), r[1]]
        }),
        KernelKind::Fused,
        (-2.0, 2.0),
        1,
        0.97,
        0.01,
    ));
    cases.push((
        "rmsnorm_bwd_4096",
        body(&mut g, "g_norm_bwd_4096", &[bf16(&[600, 4096]), f32t(&[4096]), bf16(&[600, 4096])], |b, a| {
            let w = b.push_typed(Op::Cast, &[a[1]], bf16(&[4096])).expect("cast");
            let r = b.push(Op::RmsNormBwd { eps: 1e-5 }, &[a[0], w, a[2]]).expect("rmsnorm_bwd");
            let dw = b.push_typed(Op::Cast, &[r[1]], f32t(&[4096])).expect("cast");
            vec![r[0], dw]
        }),
        KernelKind::Fused,
        (-2.0, 2.0),
        1,
        0.9,
        0.01,
    ));
    cases.push((
        "cross_entropy",
        body(&mut g, "g_ce", &[bf16(&[8, 64, 256]), i32t(&[8, 64])], |b, a| vec![push(b, Op::CrossEntropy, &[a[0], a[1]])]),
        KernelKind::Fused,
        (-8.0, 8.0),
        256,
        0.0,
        1e-5,
    ));
    cases.push((
        "cross_entropy_bwd",
        body(&mut g, "g_ce_bwd", &[bf16(&[8, 64, 256]), i32t(&[8, 64])], |b, a| {
            let one = b.push_typed(Op::Constant { value: 1.0 }, &[], f32t(&[])).expect("constant");
            vec![push(b, Op::CrossEntropyBwd, &[a[0], a[1], one])]
        }),
        KernelKind::Fused,
        (-8.0, 8.0),
        256,
        0.99,
        0.02,
    ));
    cases.push((
        "cross_entropy_vocab",
        body(&mut g, "g_ce_vocab", &[bf16(&[3, 128256]), i32t(&[3]), f32t(&[])], |b, a| {
            let loss = push(b, Op::CrossEntropy, &[a[0], a[1]]);
            vec![loss, push(b, Op::CrossEntropyBwd, &[a[0], a[1], a[2]])]
        }),
        KernelKind::Fused,
        (-8.0, 8.0),
        128256,
        0.98,
        0.02,
    ));
    // float8 rowwise's output head: the loss, its gradient and the gradient's row quantization
    // in one looped-row kernel (four passes; the last reads the stored gradient back instead
    // of recomputing it). The gradient carries the cross entropy's tolerance; a value one bf16
    // ulp off may round to the neighbouring e4m3 value.
    cases.push(("cross_entropy_quant_rows_vocab", ce_head_body(&mut g, "g_ce_quant_vocab", 3, true), KernelKind::Fused, (-8.0, 8.0), 128256, 0.98, 0.15));
    cases.push((
        "grad_norm_sq",
        body(&mut g, "g_gnorm", &[bf16(&[3, 1000, 1000])], |b, a| {
            let c = b.push_typed(Op::Cast, &[a[0]], f32t(&[3, 1000, 1000])).expect("cast");
            let s = push(b, Op::Unary(UnaryOp::Square), &[c]);
            let r = push(b, Op::Reduce { kind: ReduceKind::Sum, axes: vec![0, 1, 2] }, &[s]);
            vec![r, push(b, Op::Unary(UnaryOp::Sqrt), &[r])]
        }),
        KernelKind::Fused,
        (-1.0, 1.0),
        1,
        0.0,
        1e-5,
    ));
    cases.push((
        "scalar_chain",
        body(&mut g, "g_clip", &[f32t(&[]), f32t(&[])], |b, a| {
            let n = push(b, Op::Unary(UnaryOp::Sqrt), &[a[0]]);
            let eps = b.push_typed(Op::Constant { value: 1e-6 }, &[], f32t(&[])).expect("constant");
            let one = b.push_typed(Op::Constant { value: 1.0 }, &[], f32t(&[])).expect("constant");
            let s = push(b, Op::Binary(BinaryOp::Add), &[n, eps]);
            let s = push(b, Op::Binary(BinaryOp::Add), &[s, a[1]]);
            let q = push(b, Op::Binary(BinaryOp::Div), &[one, s]);
            vec![n, push(b, Op::Binary(BinaryOp::Min), &[q, one])]
        }),
        KernelKind::Fused,
        (0.0, 3.0),
        1,
        1.0,
        0.0,
    ));
    cases.push((
        "softmax_rows",
        body(&mut g, "g_softmax", &[f32t(&[512, 256]), f32t(&[256])], |b, a| {
            let m = push(b, Op::Reduce { kind: ReduceKind::Max, axes: vec![1] }, &[a[0]]);
            let mb = b.push_typed(Op::Broadcast { dims: vec![0] }, &[m], f32t(&[512, 256])).expect("broadcast");
            let x = push(b, Op::Binary(BinaryOp::Sub), &[a[0], mb]);
            let e = push(b, Op::Unary(UnaryOp::Exp), &[x]);
            let s = push(b, Op::Reduce { kind: ReduceKind::Sum, axes: vec![1] }, &[e]);
            let sb = b.push_typed(Op::Broadcast { dims: vec![0] }, &[s], f32t(&[512, 256])).expect("broadcast");
            let p = push(b, Op::Binary(BinaryOp::Div), &[e, sb]);
            let wb = b.push_typed(Op::Broadcast { dims: vec![1] }, &[a[1]], f32t(&[512, 256])).expect("broadcast");
            vec![push(b, Op::Binary(BinaryOp::Mul), &[p, wb]), s]
        }),
        KernelKind::Fused,
        (-5.0, 5.0),
        1,
        0.3,
        1e-5,
    ));
    cases.push((
        "column_mean",
        body(&mut g, "g_colmean", &[bf16(&[8, 64, 64])], |b, a| vec![push(b, Op::Reduce { kind: ReduceKind::Mean, axes: vec![0, 1] }, &[a[0]])]),
        KernelKind::Fused,
        (-2.0, 2.0),
        1,
        0.97,
        0.05,
    ));
    cases.push((
        "pointwise_math",
        body(&mut g, "g_math", &[f32t(&[8, 1000]), f32t(&[1000]), f32t(&[8, 1000])], |b, a| {
            let x = push(b, Op::Unary(UnaryOp::Log), &[a[0]]);
            let y = push(b, Op::Unary(UnaryOp::Tanh), &[x]);
            let e = b.push_typed(Op::Broadcast { dims: vec![1] }, &[a[1]], f32t(&[8, 1000])).expect("broadcast");
            let y = push(b, Op::Unary(UnaryOp::Abs), &[y]);
            let z = push(b, Op::Binary(BinaryOp::Pow), &[y, e]);
            let r = push(b, Op::Unary(UnaryOp::Rsqrt), &[z]);
            let s = push(b, Op::Unary(UnaryOp::Sigmoid), &[r]);
            let t = push(b, Op::Unary(UnaryOp::Exp), &[a[2]]);
            vec![push(b, Op::Binary(BinaryOp::Max), &[s, a[2]]), x, y, z, t]
        }),
        KernelKind::Fused,
        (0.01, 20.0),
        1,
        0.4,
        1e-5,
    ));
    cases.push((
        "embedding",
        body(&mut g, "g_embed", &[i32t(&[8, 64]), bf16(&[256, 64])], |b, a| vec![push(b, Op::Embedding, &[a[0], a[1]])]),
        KernelKind::Gather,
        (-2.0, 2.0),
        256,
        1.0,
        0.0,
    ));
    cases.push((
        "scatter_add",
        body(&mut g, "g_scatter", &[i32t(&[8, 64]), bf16(&[8, 64, 64])], |b, a| {
            vec![b.push_typed(Op::ScatterAdd, &[a[0], a[1]], bf16(&[256, 64])).expect("scatter_add")]
        }),
        KernelKind::ScatterAdd,
        (-2.0, 2.0),
        256,
        1.0,
        0.0,
    ));
    cases.push((
        "scatter_add_skewed",
        body(&mut g, "g_scatter_skew", &[i32t(&[9000]), f32t(&[9000, 96])], |b, a| {
            vec![b.push_typed(Op::ScatterAdd, &[a[0], a[1]], f32t(&[700, 96])).expect("scatter_add")]
        }),
        KernelKind::ScatterAdd,
        (-2.0, 2.0),
        700,
        1.0,
        0.0,
    ));
    // The vocab-parallel embedding: shard 2 of 4 of a 256-row table (indices over the whole
    // table, so about a quarter are this shard's rows), and a skewed scatter into shard 1 of 3.
    cases.push((
        "gather_shard",
        body(&mut g, "g_gather_shard", &[bf16(&[64, 64]), i32t(&[8, 64]), f32t(&[4])], |b, a| vec![push(b, Op::GatherShard, &[a[0], a[1], a[2]])]),
        KernelKind::Gather,
        (-2.0, 2.0),
        256,
        1.0,
        0.0,
    ));
    cases.push((
        "scatter_add_shard",
        body(&mut g, "g_scatter_shard", &[i32t(&[8, 64]), bf16(&[8, 64, 64]), f32t(&[4])], |b, a| {
            vec![b.push_typed(Op::ScatterAddShard, &[a[0], a[1], a[2]], bf16(&[64, 64])).expect("scatter_add_shard")]
        }),
        KernelKind::ScatterAdd,
        (-2.0, 2.0),
        256,
        1.0,
        0.0,
    ));
    cases.push((
        "scatter_add_shard_skewed",
        body(&mut g, "g_scatter_shard_skew", &[i32t(&[9000]), f32t(&[9000, 96]), f32t(&[3])], |b, a| {
            vec![b.push_typed(Op::ScatterAddShard, &[a[0], a[1], a[2]], f32t(&[700, 96])).expect("scatter_add_shard")]
        }),
        KernelKind::ScatterAdd,
        (-2.0, 2.0),
        2100,
        1.0,
        0.0,
    ));
    // Rule 12's scatter into the tensor it is added to (the tied embedding's gradient): into a
    // buffer of its own, into the tensor's own buffer (`alias`: rows no index hits are not
    // written; skewed ids, the table added second), and into a row shard.
    for (name, shard) in [("scatter_add_into", false), ("scatter_add_into_skewed_inplace", false), ("scatter_add_shard_into", true)] {
        let skewed = name.contains("skewed");
        let dt = if skewed { f32t } else { bf16 };
        let (ids, src, rows): (&[u64], &[u64], u64) = if skewed { (&[9000], &[9000, 96], 700) } else { (&[8, 64], &[8, 64, 64], if shard { 64 } else { 256 }) };
        let width = *src.last().expect("rows");
        let mut ins = vec![i32t(ids), dt(src)];
        if shard {
            ins.push(f32t(&[4]));
        }
        ins.push(dt(&[rows, width]));
        let id = body(&mut g, name, &ins, |b, a| {
            let op = if shard { Op::ScatterAddShard } else { Op::ScatterAdd };
            let table = b.push_typed(op, &a[..a.len() - 1], dt(&[rows, width])).expect("scatter_add");
            let x = a[a.len() - 1];
            let pair = if skewed { [x, table] } else { [table, x] };
            vec![push(b, Op::Binary(BinaryOp::Add), &pair)]
        });
        cases.push((name, id, KernelKind::ScatterAdd, (-2.0, 2.0), if shard { 256 } else { rows as i64 }, 1.0, 0.0));
    }
    cases.push((
        "rmsnorm_long_rows",
        body(&mut g, "g_norm_long", &[bf16(&[3, 40000]), bf16(&[40000])], |b, a| {
            let y = push(b, Op::RmsNorm { eps: 1e-5 }, &[a[0], a[1]]);
            let m = push(b, Op::Reduce { kind: ReduceKind::Max, axes: vec![1] }, &[a[0]]);
            vec![y, m]
        }),
        KernelKind::Fused,
        (-2.0, 2.0),
        1,
        0.99,
        0.02,
    ));
    cases.push(("grad_norm_clip", grad_norm_body(&mut g, [&[3, 700, 1000], &[4096], &[1000, 100]]), KernelKind::Fused, (-0.01, 0.01), 1, 1.0, 0.0));
    cases.push(("optimizer", optimizer_body(&mut g), KernelKind::Optimizer, (-1.0, 1.0), 1, 1.0, 0.0));
    cases.push(("optimizer_mixed_grads", optimizer_mixed_body(&mut g), KernelKind::Optimizer, (-1.0, 1.0), 1, 1.0, 0.0));
    cases.push(("optimizer_compute_copies", optimizer_copies_body(&mut g), KernelKind::Optimizer, (-1.0, 1.0), 1, 1.0, 0.0));
    // Attention: judged by absolute error (out within 2e-2, lse within 1e-3; see `max_abs`).
    cases.push(("attention_gqa_causal", attention_body(&mut g, [1, 512, 8, 2, 128], true), KernelKind::Attention, (-2.0, 2.0), 1, 0.0, 1.0));
    cases.push(("attention_gqa", attention_body(&mut g, [1, 512, 8, 2, 128], false), KernelKind::Attention, (-2.0, 2.0), 1, 0.0, 1.0));
    cases.push(("attention_d64", attention_body(&mut g, [2, 256, 4, 4, 64], false), KernelKind::Attention, (-2.0, 2.0), 1, 0.0, 1.0));
    cases.push(("attention_d64_causal", attention_body(&mut g, [2, 256, 4, 4, 64], true), KernelKind::Attention, (-2.0, 2.0), 1, 0.0, 1.0));
    cases.push(("attention_debug_causal", attention_body(&mut g, [8, 64, 4, 4, 16], true), KernelKind::Attention, (-2.0, 2.0), 1, 0.0, 1.0));
    // Attention backward (not routed by `compile_kernel` yet): out and lse come from the forward.
    cases.push(("attention_bwd_gqa_causal", attention_bwd_body(&mut g, [1, 512, 8, 2, 128], true), KernelKind::AttentionBwd, (-2.0, 2.0), 1, 0.0, 0.05));
    cases.push(("attention_bwd_gqa", attention_bwd_body(&mut g, [1, 512, 8, 2, 128], false), KernelKind::AttentionBwd, (-2.0, 2.0), 1, 0.0, 0.05));
    cases.push(("attention_bwd_d64", attention_bwd_body(&mut g, [2, 256, 4, 4, 64], false), KernelKind::AttentionBwd, (-2.0, 2.0), 1, 0.0, 0.05));
    // Llama-3.2 1B's attention: head_dim 64, GQA 4:1, causal.
    cases.push(("attention_bwd_d64_gqa_causal", attention_bwd_body(&mut g, [2, 256, 8, 2, 64], true), KernelKind::AttentionBwd, (-2.0, 2.0), 1, 0.0, 0.05));
    cases.push(("attention_bwd_debug_causal", attention_bwd_body(&mut g, [8, 64, 4, 4, 16], true), KernelKind::AttentionBwd, (-2.0, 2.0), 1, 0.0, 0.05));
    // The vocab-parallel loss on shard 1 of 2 (8B's vocabulary: rows looped) and of 8 (70B's:
    // rows in registers); targets over the whole vocabulary, so about 1 in n is in the shard.
    for (name, v_shard, n) in [("ce_stats_looped", 64128u64, 2u64), ("ce_stats_unrolled", 16032, 8)] {
        let id =
            body(&mut g, name, &[bf16(&[2, 4, v_shard]), i32t(&[2, 4]), f32t(&[n])], |b, a| b.push(Op::CrossEntropyStats, &[a[0], a[1], a[2]]).expect("stats"));
        // The interpreter sums exp in sequence in f32, the GPU in a tree: sumexp differs in the
        // last bits (4.5e-5 relative measured on 64128 elements); max and target are exact.
        cases.push((name, id, KernelKind::Fused, (-8.0, 8.0), (v_shard * n) as i64, 0.0, 2e-4));
    }
    for (name, v_shard, n) in [("ce_stats_bwd_looped", 64128u64, 2u64), ("ce_stats_bwd_unrolled", 16032, 8)] {
        let id = body(&mut g, name, &[bf16(&[2, 4, v_shard]), i32t(&[2, 4]), f32t(&[n]), f32t(&[2, 4, 1]), f32t(&[2, 4, 1]), f32t(&[2, 4, 1])], |b, a| {
            vec![push(b, Op::CrossEntropyStatsBwd, &[a[0], a[1], a[2], a[3], a[4], a[5]])]
        });
        cases.push((name, id, KernelKind::Fused, (-8.0, 8.0), (v_shard * n) as i64, 0.99, 0.02));
    }
    let combine =
        body(&mut g, "ce_combine", &[f32t(&[64, 8]), f32t(&[64, 8]), f32t(&[64, 8])], |b, a| vec![push(b, Op::CrossEntropyCombine, &[a[0], a[1], a[2]])]);
    cases.push(("ce_combine", combine, KernelKind::Fused, (-4.0, 4.0), 1, 0.99, 1e-5));
    // float8: scales, quantized values and amaxes are exact.
    for (name, id, range) in fp8_cases(&mut g) {
        cases.push((name, id, KernelKind::Fused, range, 1, 1.0, 0.0));
    }
    // Column amaxes (and their scales) are exact too, whatever the split into chunks.
    for (name, id, range) in colmax_cases(&mut g) {
        cases.push((name, id, KernelKind::Fused, range, 1, 1.0, 0.0));
    }
    let mut rng = Rng(0x5EED);
    let mut manifest = Vec::new();
    for (name, id, kind, range, int_hi, min_within1, max_rel) in cases {
        let k = compile(&g, id, kind, name);
        let Some(dir) = &dir else { continue };
        let mut args = random_args(&g, id, &mut rng, range, int_hi);
        // Inputs with structure: a skewed index distribution, a positive step, AdamW's v >= 0.
        // The row shard's one-hot (gather: shard 2 of 4; scatter: shard 1 of 4 or 3), and for
        // the skewed case most indices on one row of the shard (707) and many on a row of
        // another shard (300).
        let shard = match name {
            "gather_shard" => Some(2),
            "scatter_add_shard" | "scatter_add_shard_skewed" | "scatter_add_shard_into" => Some(1),
            _ => None,
        };
        if let Some(k) = shard {
            let shards = args[2].numel();
            args[2] = Tensor::from_vec(DType::F32, vec![shards], (0..shards).map(|j| if j == k { 1.0 } else { 0.0 }).collect()).expect("one-hot");
        }
        if let ("scatter_add_shard_skewed", titan_ir::interp::Data::Int(v)) = (name, &mut args[0].data) {
            for (i, x) in v.iter_mut().enumerate() {
                *x = match i % 9 {
                    0..5 => 707,
                    5 => 300,
                    _ => *x,
                };
            }
        }
        if let ("scatter_add_skewed" | "scatter_add_into_skewed_inplace", titan_ir::interp::Data::Int(v)) = (name, &mut args[0].data) {
            for (i, x) in v.iter_mut().enumerate() {
                *x = if i % 9 < 5 {
                    7
                } else if i % 9 == 5 {
                    300
                } else {
                    *x
                };
            }
        }
        if name.starts_with("optimizer") {
            args[0] = Tensor::from_ints(DType::I32, Vec::<usize>::new(), vec![250]).expect("step");
            for i in 0..(args.len() - 2) / 4 {
                if let Some(v) = args[5 + 4 * i].floats_mut() {
                    v.iter_mut().for_each(|x| *x = x.abs() * 1e-3);
                }
            }
        }
        if kind == KernelKind::AttentionBwd {
            // Consistent out and lse: the forward of the same q, k, v.
            let shape = args[0].shape.clone();
            let kv = args[1].shape.clone();
            let causal = matches!(g.block(id).nodes.first().map(|n| &n.op), Some(Op::AttentionBwd { causal: true, .. }));
            let fwd = attention_body(&mut g, [shape[0] as u64, shape[1] as u64, shape[2] as u64, kv[2] as u64, shape[3] as u64], causal);
            let r = Interpreter::new(&g, Precision::Emulate).run_region(g.block(fwd), &args[..3]).unwrap_or_else(|e| panic!("{name}: forward: {e}"));
            args[3] = r[0].clone();
            args[4] = r[1].clone();
        }
        if name.starts_with("ce_stats") {
            // Shard 1 of the one-hot; the last row's target in the shard at its first max (so
            // the argmax and target terms of the backward meet).
            let shards = args[2].numel();
            args[2] = Tensor::from_vec(DType::F32, vec![shards], (0..shards).map(|j| if j == 1 { 1.0 } else { 0.0 }).collect()).expect("one-hot");
            let v = args[0].shape[2];
            let last = args[0].numel() / v - 1;
            if let Some(xs) = args[0].floats_mut() {
                xs[last * v + 5] = 9.0;
            }
            if let titan_ir::interp::Data::Int(t) = &mut args[1].data {
                t[last] = (v + 5) as i64;
            }
        }
        if name == "ce_combine"
            && let Some(s) = args[1].floats_mut()
        {
            s.iter_mut().for_each(|x| *x = x.abs() + 0.05);
        }
        if name == "scalar_chain" {
            args[1] = Tensor::from_vec(DType::F32, Vec::<usize>::new(), vec![0.25]).expect("scalar");
        }
        let outs = Interpreter::new(&g, Precision::Emulate).run_region(g.block(id), &args).unwrap_or_else(|e| panic!("{name}: interpreter: {e}"));
        std::fs::create_dir_all(dir).expect("dump dir");
        std::fs::write(dir.join(format!("{name}.ptx")), &k.ptx).expect("write");
        let mut arg_json = Vec::new();
        for (i, t) in args.iter().enumerate() {
            let file = format!("{name}.a{i}.bin");
            std::fs::write(dir.join(&file), tensor_bytes(t)).expect("write");
            arg_json.push(format!("{{\"file\": \"{file}\", \"dtype\": \"{}\"}}", dtype_name(t.dtype)));
        }
        let mut out_json = Vec::new();
        for (i, t) in outs.iter().enumerate() {
            let file = format!("{name}.o{i}.bin");
            std::fs::write(dir.join(&file), tensor_bytes(t)).expect("write");
            out_json.push(format!("{{\"expected\": \"{file}\", \"dtype\": \"{}\", \"numel\": {}}}", dtype_name(t.dtype), t.numel()));
        }
        let max_abs = match kind {
            KernelKind::Attention => ", \"max_abs\": [2e-2, 1e-3]",
            _ if name.ends_with("_inplace") => ", \"alias\": {\"0\": 2}",
            _ => "",
        };
        manifest.push(format!(
            "{{\"name\": \"{name}\", \"ptx\": \"{name}.ptx\", \"entry\": \"{}\", \"grid\": {}, \"block\": {}, \"ws\": {}{}, \"min_within1\": {min_within1}, \"max_rel\": {max_rel}, \"max_rel_scalar\": {}{max_abs}, \"args\": [{}], \"outs\": [{}]}}",
            k.entry,
            k.launch.grid[0],
            k.launch.block[0],
            k.workspace_bytes,
            launch_extras(&k),
            // The interpreter sums millions of squares sequentially in f32 and drifts by ~1e-3
            // (the GPU's tree order matches an f64 sum to ~1e-8).
            if name.starts_with("grad_norm") { 3e-3 } else { 1e-3 },
            arg_json.join(", "),
            out_json.join(", ")
        ));
    }
    if let Some(dir) = &dir {
        std::fs::write(dir.join("cases.json"), format!("[\n{}\n]\n", manifest.join(",\n"))).expect("write manifest");
        std::fs::write(dir.join("perf.json"), perf_manifest(dir)).expect("write perf manifest");
    }
}

/// Launch fields beyond grid, block and workspace for `gpu_check.py`: dynamic shared memory, a
/// scratch workspace, the prologue and epilogue phases (entry, grid, block, shared memory), and
/// whether two runs must agree bitwise.
fn launch_extras(k: &titan_kernels::CompiledKernel) -> String {
    let mut s = format!(", \"shared\": {}, \"scratch\": {}, \"deterministic\": {}", k.launch.shared_bytes, k.workspace_scratch, k.deterministic);
    for (tag, phase) in [("pre", &k.prologue), ("post", &k.epilogue)] {
        if let Some(p) = phase {
            s += &format!(
                ", \"{tag}_entry\": \"{}\", \"{tag}_grid\": {}, \"{tag}_block\": {}, \"{tag}_shared\": {}",
                p.entry, p.launch.grid[0], p.launch.block[0], p.launch.shared_bytes
            );
        }
    }
    s
}

/// `[b, s, hq, hkv, d]` of the step's attention on 8b-4l.
const ATTENTION_8B: [u64; 5] = [1, 8192, 32, 8, 128];

/// The attention table's shapes: sequence 2048, 4096 and 8192 at 8192 tokens, head_dim 128 and 64.
const ATTENTION_TABLE: [[u64; 5]; 6] =
    [[4, 2048, 32, 8, 128], [2, 4096, 32, 8, 128], ATTENTION_8B, [4, 2048, 64, 16, 64], [2, 4096, 64, 16, 64], [1, 8192, 64, 16, 64]];

/// Matmul flops of a causal attention forward: `4 b s^2 hq d`, halved by the mask.
fn attention_flops([b, s, hq, _, d]: [u64; 5]) -> u64 {
    4 * b * s * s * hq * d / 2
}

/// Llama-3-8B-sized kernels for `gpu_check.py <dir> perf` (PTX and buffer sizes only).
fn perf_manifest(dir: &std::path::Path) -> String {
    let mut g = graph();
    let (t, d, ffn, v) = (16384u64, 4096u64, 14336u64, 128256u64);
    let half = RopeConfig { theta: 500000.0, layout: RopeLayout::Half, scaling: None, inverse: false };
    let mut cases: Vec<(&str, BlockId, KernelKind, i64)> = vec![
        (
            "perf_residual_rmsnorm",
            body(&mut g, "p_norm", &[bf16(&[t, d]), bf16(&[t, d]), bf16(&[d])], |b, a| {
                let h = push(b, Op::Binary(BinaryOp::Add), &[a[0], a[1]]);
                vec![h, push(b, Op::RmsNorm { eps: 1e-5 }, &[h, a[2]])]
            }),
            KernelKind::Fused,
            1,
        ),
        (
            "perf_rmsnorm_bwd_add",
            body(&mut g, "p_norm_bwd", &[bf16(&[t, d]), bf16(&[d]), bf16(&[t, d]), bf16(&[t, d])], |b, a| {
                let r = b.push(Op::RmsNormBwd { eps: 1e-5 }, &[a[0], a[1], a[2]]).expect("rmsnorm_bwd");
                vec![push(b, Op::Binary(BinaryOp::Add), &[a[3], r[0]]), r[1]]
            }),
            KernelKind::Fused,
            1,
        ),
        (
            "perf_rmsnorm_bwd_add_1b",
            body(&mut g, "p_norm_bwd_1b", &[bf16(&[8192, 2048]), bf16(&[2048]), bf16(&[8192, 2048]), bf16(&[8192, 2048])], |b, a| {
                let r = b.push(Op::RmsNormBwd { eps: 1e-5 }, &[a[0], a[1], a[2]]).expect("rmsnorm_bwd");
                vec![push(b, Op::Binary(BinaryOp::Add), &[a[3], r[0]]), r[1]]
            }),
            KernelKind::Fused,
            1,
        ),
        (
            "perf_rmsnorm_bwd_dx_only",
            body(&mut g, "p_norm_bwd_dx", &[bf16(&[t, d]), bf16(&[d]), bf16(&[t, d]), bf16(&[t, d])], |b, a| {
                let r = b.push(Op::RmsNormBwd { eps: 1e-5 }, &[a[0], a[1], a[2]]).expect("rmsnorm_bwd");
                vec![push(b, Op::Binary(BinaryOp::Add), &[a[3], r[0]])]
            }),
            KernelKind::Fused,
            1,
        ),
        (
            "perf_swiglu_fwd",
            body(&mut g, "p_swiglu", &[bf16(&[t, ffn]), bf16(&[t, ffn])], |b, a| {
                let s = push(b, Op::Unary(UnaryOp::Silu), &[a[0]]);
                vec![push(b, Op::Binary(BinaryOp::Mul), &[s, a[1]])]
            }),
            KernelKind::Fused,
            1,
        ),
        ("perf_rope_q", body(&mut g, "p_rope", &[bf16(&[8, 2048, 32, 128])], |b, a| vec![push(b, Op::Rope(half), &[a[0]])]), KernelKind::Fused, 1),
        (
            "perf_cross_entropy_fwd_bwd",
            body(&mut g, "p_ce", &[bf16(&[4096, v]), i32t(&[4096]), f32t(&[])], |b, a| {
                let loss = push(b, Op::CrossEntropy, &[a[0], a[1]]);
                vec![loss, push(b, Op::CrossEntropyBwd, &[a[0], a[1], a[2]])]
            }),
            KernelKind::Fused,
            v as i64,
        ),
        // float8 rowwise's output head: loss, gradient and the gradient's row quantization.
        (
            "perf_cross_entropy_quant_rows",
            body(&mut g, "p_ce_q", &[bf16(&[4096, v]), i32t(&[4096]), f32t(&[])], |b, a| {
                let loss = push(b, Op::CrossEntropy, &[a[0], a[1]]);
                let dx = push(b, Op::CrossEntropyBwd, &[a[0], a[1], a[2]]);
                let per_row = titan_ir::float8::OperandScaling { dtype: DType::F8E4M3, scaling: titan_ir::float8::Scaling::Over(1) };
                let q = titan_ir::float8::quantize(b, dx, per_row, true).expect("quantize");
                vec![loss, dx, q.q, q.inv_scale]
            }),
            KernelKind::Fused,
            v as i64,
        ),
        (
            "perf_embedding",
            body(&mut g, "p_embed", &[i32t(&[t]), bf16(&[v, d])], |b, a| vec![push(b, Op::Embedding, &[a[0], a[1]])]),
            KernelKind::Gather,
            v as i64,
        ),
        (
            "perf_scatter_add",
            body(&mut g, "p_scatter", &[i32t(&[t]), bf16(&[t, d])], |b, a| {
                vec![b.push_typed(Op::ScatterAdd, &[a[0], a[1]], bf16(&[v, d])).expect("scatter_add")]
            }),
            KernelKind::ScatterAdd,
            v as i64,
        ),
        // The same with byte-level token ids (the bundled corpus): every index in the first 256
        // rows, so one CTA owns all the work (the skew of real text's frequent tokens, extreme).
        (
            "perf_scatter_add_bytes",
            body(&mut g, "p_scatter_bytes", &[i32t(&[t]), bf16(&[t, d])], |b, a| {
                vec![b.push_typed(Op::ScatterAdd, &[a[0], a[1]], bf16(&[v, d])).expect("scatter_add")]
            }),
            KernelKind::ScatterAdd,
            256,
        ),
        // Rule 12's scatter into the tensor it is added to, written over it (`alias`): only the
        // rows an index hits are read and written.
        (
            "perf_scatter_add_into",
            body(&mut g, "p_scatter_into", &[i32t(&[t]), bf16(&[t, d]), bf16(&[v, d])], |b, a| {
                let table = b.push_typed(Op::ScatterAdd, &[a[0], a[1]], bf16(&[v, d])).expect("scatter_add");
                vec![push(b, Op::Binary(BinaryOp::Add), &[a[2], table])]
            }),
            KernelKind::ScatterAdd,
            v as i64,
        ),
        ("perf_grad_norm_clip", grad_norm_body(&mut g, [&[ffn, d], &[d], &[d, d]]), KernelKind::Fused, 1),
        // float8's K-major operand of grad_weight (x per column, stored transposed): tiled through
        // shared memory, and at a width that is not a multiple of 64 (one scattered byte per store).
        ("perf_fp8_quantize_cols_transposed", quantize_body(&mut g, "p_q_cols_t", &[8192, d], false, DType::F8E4M3, true), KernelKind::Fused, 1),
        ("perf_fp8_quantize_cols_transposed_untiled", quantize_body(&mut g, "p_q_cols_tu", &[8192, d + 4], false, DType::F8E4M3, true), KernelKind::Fused, 1),
        // float8's per-column amax over the tokens with its scales (grad_weight's operands, the
        // output head's dy), and a plain column max at the FFN width.
        ("perf_colmax_8192x4096", colmax_body(&mut g, "p_colmax_d", &[8192, d], false), KernelKind::Fused, 1),
        ("perf_colmax_8192x128256", colmax_body(&mut g, "p_colmax_v", &[8192, v], false), KernelKind::Fused, 1),
        ("perf_colmax_8192x14336", colmax_body(&mut g, "p_colmax_f", &[8192, ffn], false), KernelKind::Fused, 1),
        ("perf_colmax_8192x1024", colmax_body(&mut g, "p_colmax_kv", &[8192, 1024], false), KernelKind::Fused, 1),
        ("perf_colmax_14336x4096", colmax_body(&mut g, "p_colmax_w", &[ffn, d], false), KernelKind::Fused, 1),
        ("perf_fp8_quantize_cols_transposed_ffn", quantize_body(&mut g, "p_q_cols_tf", &[8192, ffn], false, DType::F8E4M3, true), KernelKind::Fused, 1),
        // The same from bf16, as in the step: the FFN's operands, the model width, the head's dy.
        ("perf_fp8_qt_bf16_8192x14336", quantize_body_of(&mut g, "p_qt_f", DType::BF16, &[8192, ffn], false, DType::F8E4M3, true), KernelKind::Fused, 1),
        ("perf_fp8_qt_bf16_8192x4096", quantize_body_of(&mut g, "p_qt_d", DType::BF16, &[8192, d], false, DType::F8E4M3, true), KernelKind::Fused, 1),
        ("perf_fp8_qt_bf16_8192x128256", quantize_body_of(&mut g, "p_qt_v", DType::BF16, &[8192, v], false, DType::F8E4M3, true), KernelKind::Fused, 1),
        ("perf_fp8_qt_bf16_128256x4096", quantize_body_of(&mut g, "p_qt_w", DType::BF16, &[v, d], false, DType::F8E4M3, true), KernelKind::Fused, 1),
        (
            "perf_colmax_plain_8192x14336",
            body(&mut g, "p_colmax_ffn", &[bf16(&[8192, ffn])], |b, a| vec![push(b, Op::Reduce { kind: ReduceKind::Max, axes: vec![0] }, &[a[0]])]),
            KernelKind::Fused,
            1,
        ),
        ("perf_attention_fwd_causal", attention_body(&mut g, ATTENTION_8B, true), KernelKind::Attention, 1),
        // AdamW over one 8B layer's worth of stacked weights and a norm (bf16 gradients, bf16
        // compute copies), as the step's multi-tensor kernel: 28 bytes per parameter.
        (
            "perf_optimizer",
            optimizer_body_of(&mut g, "p_opt", &[(&[4, ffn, d], DType::BF16), (&[4, d, d], DType::BF16), (&[4, d], DType::BF16)], true),
            KernelKind::Optimizer,
            1,
        ),
        ("perf_attention_bwd_causal", attention_bwd_body(&mut g, ATTENTION_8B, true), KernelKind::AttentionBwd, 1),
    ];
    // Issue 15's attention table (`bench/attention_table.py`): causal, 8192 tokens per launch,
    // head_dim 128 (32 query heads, 8 kv heads: Llama-3 8B) and 64 (64 and 16: the same width).
    let table: Vec<(String, String, [u64; 5])> = ATTENTION_TABLE
        .iter()
        .filter(|&&shape| shape != ATTENTION_8B) // the two cases above
        .map(|&[b, s, hq, hkv, d]| {
            (format!("perf_attention_fwd_causal_s{s}_d{d}_b{b}"), format!("perf_attention_bwd_causal_s{s}_d{d}_b{b}"), [b, s, hq, hkv, d])
        })
        .collect();
    let mut flops_of: Vec<(&str, u64)> =
        vec![("perf_attention_fwd_causal", attention_flops(ATTENTION_8B)), ("perf_attention_bwd_causal", attention_flops(ATTENTION_8B) * 5 / 2)];
    for (fwd, bwd, shape) in &table {
        cases.push((fwd, attention_body(&mut g, *shape, true), KernelKind::Attention, 1));
        cases.push((bwd, attention_bwd_body(&mut g, *shape, true), KernelKind::AttentionBwd, 1));
        flops_of.push((fwd, attention_flops(*shape)));
        flops_of.push((bwd, attention_flops(*shape) * 5 / 2));
    }
    let mut out = Vec::new();
    for (name, id, kind, int_hi) in cases {
        let k = compile(&g, id, kind, name);
        std::fs::write(dir.join(format!("{name}.ptx")), &k.ptx).expect("write");
        let r = g.block(id);
        let mut bytes = 0u64;
        let buf = |ty: &TensorType, bytes: &mut u64| {
            let n = ty.numel(&g.dims).expect("bound");
            *bytes += ty.size_bytes(&g.dims).expect("bound");
            let hi = if ty.dtype.is_int() { format!(", \"int_hi\": {int_hi}") } else { String::new() };
            format!("{{\"dtype\": \"{}\", \"numel\": {n}{hi}}}", dtype_name(ty.dtype))
        };
        let args: Vec<String> = r.args.iter().map(|a| buf(r.ty(a.value), &mut bytes)).collect();
        let outs: Vec<String> = r.outputs.iter().map(|o| buf(r.ty(o.value), &mut bytes)).collect();
        // Backward: 2.5x the forward's matmul flops (5 GEMMs of the forward's 2).
        let mut flops = flops_of.iter().find(|(n, _)| *n == name).map(|(_, f)| format!(", \"flops\": {f}")).unwrap_or_default();
        if name == "perf_scatter_add_into" {
            flops.push_str(", \"alias\": {\"0\": 2}");
        }
        out.push(format!(
            "{{\"name\": \"{name}\", \"ptx\": \"{name}.ptx\", \"entry\": \"{}\", \"grid\": {}, \"block\": {}, \"ws\": {}{}, \"bytes\": {bytes}{flops}, \"args\": [{}], \"outs\": [{}]}}",
            k.entry,
            k.launch.grid[0],
            k.launch.block[0],
            k.workspace_bytes,
            launch_extras(&k),
            args.join(", "),
            outs.join(", ")
        ));
    }
    format!("[\n{}\n]\n", out.join(",\n"))
}
