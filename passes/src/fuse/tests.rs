//! Unit tests of the fusion rules on small hand-built graphs; each fused graph is verified
//! and run against the unfused one on the interpreter (results must be bit-identical).

use titan_ir::interp::{Interpreter, Precision, Tensor};
use titan_ir::{ArgKind, BinaryOp, Builder, DType, Graph, KernelKind, Op, Output, ReduceKind, Region, TensorType, UnaryOp, Value};

use super::{FuseStats, check_kernel_graph, fuse};

fn f32s(shape: &[u64]) -> TensorType {
    TensorType::fixed(DType::F32, shape)
}

/// A graph whose `main` takes `n` f32[8, 8] inputs, built by `body`.
fn graph(n: usize, body: impl FnOnce(&mut Builder, &[Value]) -> Result<Vec<Value>, String>) -> Graph {
    let mut g = Graph::new("t");
    let xs: Vec<Value> = (0..n).map(|i| g.main.add_arg(f32s(&[8, 8]), ArgKind::Input, Some(&format!("x{i}")))).collect();
    let outs = {
        let mut b = g.main_builder();
        body(&mut b, &xs).expect("the test graph builds")
    };
    for (i, v) in outs.into_iter().enumerate() {
        g.main.outputs.push(Output { name: Some(format!("out{i}")), value: v });
    }
    assert_eq!(verify(&g), Vec::<String>::new());
    g
}

fn verify(g: &Graph) -> Vec<String> {
    titan_ir::verify::verify(g).iter().map(ToString::to_string).collect()
}

/// Fuse a copy of `g`, check it verifies and computes bit-identical outputs on fixed inputs.
fn fused(g: &Graph) -> (Graph, FuseStats) {
    let mut f = g.clone();
    let stats = fuse(&mut f).expect("fusion");
    assert_eq!(verify(&f), Vec::<String>::new(), "{f}");
    assert_eq!(check_kernel_graph(&f), Vec::<String>::new(), "{f}");
    let args: Vec<Tensor<f32>> = g
        .main
        .args
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let shape = g.main.ty(a.value).resolve(&g.dims).expect("fixed dims");
            let n: usize = shape.iter().product();
            Tensor::from_vec(DType::F32, shape, (0..n).map(|k| ((k * 7 + i * 3) % 11) as f32 / 11.0 - 0.4).collect()).expect("tensor")
        })
        .collect();
    let want = Interpreter::new(g, Precision::Emulate).run(&args).expect("unfused runs");
    let got = Interpreter::new(&f, Precision::Emulate).run(&args).expect("fused runs");
    let bits = |t: &Tensor<f32>| t.floats().expect("floats").iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (k, (w, g)) in want.outputs.iter().zip(&got.outputs).enumerate() {
        let (wb, gb) = (bits(w), bits(g));
        assert_eq!(wb.len(), gb.len());
        if let Some(i) = wb.iter().zip(&gb).position(|(a, b)| a != b) {
            panic!("output {k} differs at element {i}: unfused {} vs fused {}", f32::from_bits(wb[i]), f32::from_bits(gb[i]));
        }
    }
    (f, stats)
}

/// `(kind, ops of the body)` of every kernel of `main`, in order.
fn kernels(g: &Graph) -> Vec<(KernelKind, Vec<&'static str>)> {
    kernels_of(g, &g.main)
}

fn kernels_of<'g>(g: &'g Graph, r: &'g Region) -> Vec<(KernelKind, Vec<&'static str>)> {
    r.order
        .iter()
        .filter_map(|&n| match r.node(n).op {
            Op::Kernel { body, kind } => Some((kind, g.block(body).order.iter().map(|&m| g.block(body).node(m).op.name()).collect())),
            Op::Reshape | Op::Repeat { .. } => None,
            ref other => panic!("`{}` left outside kernels", other.name()),
        })
        .collect()
}

fn unary(b: &mut Builder, u: UnaryOp, x: Value) -> Result<Value, String> {
    b.push1(Op::Unary(u), &[x])
}

fn binary(b: &mut Builder, o: BinaryOp, x: Value, y: Value) -> Result<Value, String> {
    b.push1(Op::Binary(o), &[x, y])
}

fn matmul(b: &mut Builder, x: Value, y: Value) -> Result<Value, String> {
    b.push1(Op::Matmul { transpose_a: false, transpose_b: true }, &[x, y])
}

use titan_ir::KernelKind::{Fused, Gemm};

#[test]
fn producer_consumer_chains_fuse() {
    let g = graph(2, |b, x| {
        let a = unary(b, UnaryOp::Exp, x[0])?;
        let c = binary(b, BinaryOp::Mul, a, x[1])?;
        Ok(vec![unary(b, UnaryOp::Neg, c)?])
    });
    let (f, stats) = fused(&g);
    assert_eq!(kernels(&f), vec![(Fused, vec!["exp", "mul", "neg"])]);
    assert_eq!((stats.regions, stats.kernels, stats.ops_outlined), (1, 1, 3));
}

/// `a = exp(x); add(a, matmul(a, x))`: joining the add to `a`'s kernel would make a cycle
/// through the GEMM, so it is not merged (without the GEMM it would be).
#[test]
fn a_diamond_through_a_gemm_is_not_merged() {
    let g = graph(2, |b, x| {
        let a = unary(b, UnaryOp::Exp, x[0])?;
        let m = matmul(b, a, x[1])?;
        Ok(vec![binary(b, BinaryOp::Add, a, m)?])
    });
    let (f, _) = fused(&g);
    assert_eq!(kernels(&f), vec![(Fused, vec!["exp"]), (Gemm, vec!["matmul"]), (Fused, vec!["add"])]);

    let g = graph(2, |b, x| {
        let a = unary(b, UnaryOp::Exp, x[0])?;
        let m = unary(b, UnaryOp::Neg, a)?;
        Ok(vec![binary(b, BinaryOp::Add, a, m)?])
    });
    assert_eq!(kernels(&fused(&g).0), vec![(Fused, vec!["exp", "neg", "add"])]);
}

/// A cycle that only shows between kernels: `a -> gemm -> b` and `c -> gemm -> d` with `b` and
/// `c` in one kernel (siblings reading `s`). Joining `d` to `a`'s kernel is node-level convex
/// but would make the kernels `{a, d}` and `{b, c}` depend on each other.
#[test]
fn a_cycle_through_another_kernel_is_not_merged() {
    let g = graph(4, |b, x| {
        let (s, y, w) = (x[1], x[2], x[3]);
        let a = unary(b, UnaryOp::Exp, x[0])?;
        let g1 = matmul(b, a, w)?;
        let bb = binary(b, BinaryOp::Mul, g1, s)?;
        let c = binary(b, BinaryOp::Mul, y, s)?;
        let g2 = matmul(b, c, w)?;
        // (`max`, not `add`: an add of a GEMM's product would be its epilogue, rule 11.)
        let d = binary(b, BinaryOp::Max, a, g2)?;
        Ok(vec![bb, d])
    });
    let (f, _) = fused(&g);
    let ks = kernels(&f);
    assert!(ks.contains(&(Fused, vec!["mul", "mul"])), "{ks:?}");
    assert!(ks.contains(&(Fused, vec!["exp"])) && ks.contains(&(Fused, vec!["max"])), "{ks:?}");
    assert_eq!(ks.len(), 5, "{ks:?}");
}

/// Rule 11: the residual add of a GEMM's product becomes the GEMM's epilogue (`D = A B + C`),
/// the add's other operand the body's argument 2; a chain of adds of products (the backward's
/// q/k/v input gradients) goes to the later GEMM each time.
#[test]
fn a_residual_add_becomes_the_gemm_epilogue() {
    let g = graph(3, |b, x| {
        let m = matmul(b, x[0], x[1])?;
        Ok(vec![binary(b, BinaryOp::Add, x[2], m)?])
    });
    let (f, _) = fused(&g);
    assert_eq!(kernels(&f), vec![(Gemm, vec!["matmul", "add"])]);
    let body = f.blocks.iter().find(|r| r.order.len() == 2).expect("the gemm body");
    assert_eq!(body.args.len(), 3, "A, B, C");
    assert!(check_kernel_graph(&f).is_empty(), "{:?}", check_kernel_graph(&f));

    let g = graph(5, |b, x| {
        let m1 = matmul(b, x[0], x[3])?;
        let m2 = matmul(b, x[1], x[3])?;
        let s = binary(b, BinaryOp::Add, m1, m2)?;
        let m3 = matmul(b, x[2], x[4])?;
        Ok(vec![binary(b, BinaryOp::Add, s, m3)?])
    });
    let (f, _) = fused(&g);
    assert_eq!(kernels(&f), vec![(Gemm, vec!["matmul"]), (Gemm, vec!["matmul", "add"]), (Gemm, vec!["matmul", "add"])]);
}

/// The add stays a pointwise kernel when the product is read elsewhere (it must be written
/// anyway), when the add reads the product twice or an operand of the GEMM (the body's
/// arguments would not be `A, B, C`), and when its other operand is made after the GEMM.
#[test]
fn a_gemm_epilogue_needs_a_private_product_and_a_separate_c() {
    let shared = graph(3, |b, x| {
        let m = matmul(b, x[0], x[1])?;
        let s = binary(b, BinaryOp::Add, x[2], m)?;
        Ok(vec![s, unary(b, UnaryOp::Exp, m)?])
    });
    let twice = graph(2, |b, x| {
        let m = matmul(b, x[0], x[1])?;
        Ok(vec![binary(b, BinaryOp::Add, m, m)?])
    });
    let own_operand = graph(2, |b, x| {
        let m = matmul(b, x[0], x[1])?;
        Ok(vec![binary(b, BinaryOp::Add, x[0], m)?])
    });
    // C made after the product: the GEMM would wait for it (the tied embedding's head gradient
    // and the embedding's scatter_add), stretching its operands' lifetimes.
    let late_c = graph(3, |b, x| {
        let m = matmul(b, x[0], x[1])?;
        let c = unary(b, UnaryOp::Exp, x[2])?;
        Ok(vec![binary(b, BinaryOp::Add, c, m)?])
    });
    for g in [shared, twice, own_operand, late_c] {
        let (f, _) = fused(&g);
        let ks = kernels(&f);
        assert!(ks.contains(&(Gemm, vec!["matmul"])), "{ks:?}");
        assert!(ks.iter().all(|(k, ops)| *k != Gemm || ops.len() == 1), "{ks:?}");
    }
}

#[test]
fn incompatible_iteration_spaces_stay_apart() {
    let g = graph(1, |b, x| {
        let a = unary(b, UnaryOp::Exp, x[0])?;
        // 128 elements without rows next to the 64 of `exp`: two kernels.
        let wide = b.push_typed(Op::Broadcast { dims: vec![1, 2] }, &[a], f32s(&[2, 8, 8]))?;
        Ok(vec![unary(b, UnaryOp::Sqrt, wide)?])
    });
    assert_eq!(kernels(&fused(&g).0), vec![(Fused, vec!["exp"]), (Fused, vec!["broadcast", "sqrt"])]);
}

/// A row reduction's per-row result (one element per row) stays in the row kernel, and so does
/// what is computed from it and broadcast back along the rows: a row amax, the float8 scale
/// of each row and the quantized rows are one kernel.
#[test]
fn per_row_values_join_their_row_group() {
    let g = graph(1, |b, x| {
        let a = unary(b, UnaryOp::Exp, x[0])?;
        let r = b.push1(Op::Reduce { kind: ReduceKind::Sum, axes: vec![1] }, &[a])?;
        let s = unary(b, UnaryOp::Sqrt, r)?;
        let back = b.push_typed(Op::Broadcast { dims: vec![0] }, &[s], f32s(&[8, 8]))?;
        Ok(vec![b.push1(Op::Binary(titan_ir::BinaryOp::Mul), &[a, back])?])
    });
    assert_eq!(kernels(&fused(&g).0), vec![(Fused, vec!["exp", "reduce_sum", "sqrt", "broadcast", "mul"])]);
}

/// A full reduction's result is complete only after its kernel, so `x * sum(x^2)` takes two
/// kernels even though the multiply has the same element count.
#[test]
fn a_full_reduction_is_not_read_in_its_own_kernel() {
    let g = graph(1, |b, x| {
        let sq = unary(b, UnaryOp::Square, x[0])?;
        let s = b.push1(Op::Reduce { kind: ReduceKind::Sum, axes: vec![0, 1] }, &[sq])?;
        let r = unary(b, UnaryOp::Rsqrt, s)?;
        Ok(vec![binary(b, BinaryOp::Mul, x[0], r)?])
    });
    assert_eq!(kernels(&fused(&g).0), vec![(Fused, vec!["square", "reduce_sum"]), (Fused, vec!["rsqrt", "mul"])]);
}

/// float8's per-column quantization: `abs`, the column `reduce_max` over the rows and the
/// per-column scale computed from the amax are one column kernel (the scale after its last
/// pass, rule 5's exception), and the op quantizing `x` (here a `neg` standing in for the
/// widening cast) reads `x` again after it: it needs the finished amax, so as a sibling of the
/// amax kernel it would only make that kernel write a copy of `x` for it. Tensorwise's amax
/// over every element likewise, its scalar scale a kernel of its own. A row reduction and a
/// column reduction of the same values stay in two kernels.
#[test]
fn an_amax_fuses_with_its_producers_not_its_siblings() {
    // Rowwise's column amax (over axis 0, scale broadcast along the rows) and tensorwise's
    // amax over every element.
    for (axes, dims, cols) in [(vec![0], vec![1], true), (vec![0, 1], vec![], false)] {
        let g = graph(1, |b, x| {
            let a = unary(b, UnaryOp::Abs, x[0])?;
            let m = b.push1(Op::Reduce { kind: ReduceKind::Max, axes }, &[a])?;
            let s = unary(b, UnaryOp::Recip, m)?;
            let c = unary(b, UnaryOp::Neg, x[0])?;
            let wide = b.push_typed(Op::Broadcast { dims }, &[s], f32s(&[8, 8]))?;
            Ok(vec![binary(b, BinaryOp::Mul, c, wide)?, m])
        });
        let want = if cols {
            vec![(Fused, vec!["abs", "reduce_max", "recip"]), (Fused, vec!["neg", "broadcast", "mul"])]
        } else {
            vec![(Fused, vec!["abs", "reduce_max"]), (Fused, vec!["recip"]), (Fused, vec!["neg", "broadcast", "mul"])]
        };
        assert_eq!(kernels(&fused(&g).0), want);
    }

    // A per-column op that also reads a value from elsewhere (here the input's first row)
    // is not a value of the column kernel: it stays out of it.
    let g = graph(1, |b, x| {
        let a = unary(b, UnaryOp::Abs, x[0])?;
        let m = b.push1(Op::Reduce { kind: ReduceKind::Max, axes: vec![0] }, &[a])?;
        let e = unary(b, UnaryOp::Exp, x[0])?;
        let first = b.push1(Op::Reduce { kind: ReduceKind::Sum, axes: vec![0] }, &[e])?;
        Ok(vec![binary(b, BinaryOp::Mul, m, first)?])
    });
    let ks = kernels(&fused(&g).0);
    assert!(ks.iter().all(|(_, ops)| !(ops.contains(&"reduce_max") && ops.contains(&"mul"))), "{ks:?}");

    let g = graph(1, |b, x| {
        let a = unary(b, UnaryOp::Exp, x[0])?;
        let r = b.push1(Op::Reduce { kind: ReduceKind::Sum, axes: vec![1] }, &[a])?;
        Ok(vec![r, b.push1(Op::Reduce { kind: ReduceKind::Max, axes: vec![0] }, &[a])?])
    });
    assert_eq!(kernels(&fused(&g).0), vec![(Fused, vec!["exp", "reduce_sum"]), (Fused, vec!["reduce_max"])]);
}

/// A rank-0 constant read by two kernels is copied into both; read by a region output it also
/// becomes a kernel of its own. A non-scalar constant is a fill kernel.
#[test]
fn scalar_constants_are_copied_into_each_kernel() {
    let g = graph(2, |b, x| {
        let k = b.push_typed(Op::Constant { value: 2.0 }, &[], TensorType::scalar(DType::F32))?;
        let a = binary(b, BinaryOp::Mul, x[0], k)?;
        let m = matmul(b, a, x[1])?;
        let c = binary(b, BinaryOp::Mul, m, k)?;
        let z = b.push_typed(Op::Constant { value: 0.5 }, &[], f32s(&[8, 8]))?;
        let d = binary(b, BinaryOp::Add, c, z)?;
        Ok(vec![d])
    });
    let (f, stats) = fused(&g);
    assert_eq!(kernels(&f), vec![(Fused, vec!["constant", "mul"]), (Gemm, vec!["matmul"]), (Fused, vec!["constant"]), (Fused, vec!["constant", "mul", "add"])]);
    assert_eq!(stats.constants_copied, 2);
    // The fill is the non-scalar constant, read by the last kernel.
    let fill =
        f.main.order.iter().map(|&n| f.main.node(n)).find(|n| matches!(n.op, Op::Kernel { body, .. } if f.block(body).name == "main.k2")).expect("fill kernel");
    assert_eq!(f.main.ty(fill.results[0]), &f32s(&[8, 8]));

    let g = graph(1, |b, x| {
        let k = b.push_typed(Op::Constant { value: 3.0 }, &[], TensorType::scalar(DType::F32))?;
        Ok(vec![binary(b, BinaryOp::Mul, x[0], k)?, k])
    });
    assert_eq!(kernels(&fused(&g).0), vec![(Fused, vec!["constant"]), (Fused, vec!["constant", "mul"])]);
}

#[test]
fn fusing_twice_changes_nothing() {
    let g = graph(2, |b, x| {
        let a = unary(b, UnaryOp::Exp, x[0])?;
        let m = matmul(b, a, x[1])?;
        let k = b.push_typed(Op::Constant { value: 2.0 }, &[], TensorType::scalar(DType::F32))?;
        let c = binary(b, BinaryOp::Mul, m, k)?;
        let v = b.push_typed(Op::Reshape, &[c], f32s(&[64]))?;
        Ok(vec![unary(b, UnaryOp::Neg, v)?])
    });
    let (once, stats) = fused(&g);
    assert_eq!(stats.kernels, 4);
    let mut twice = once.clone();
    let again = fuse(&mut twice).expect("fusing a kernel graph");
    assert_eq!(again, FuseStats::default());
    assert_eq!(twice, once);
}

/// Names of kernel bodies follow `@<region>.k<N>`, numbered per region in program order.
#[test]
fn kernel_bodies_are_named_after_their_region() {
    let g = graph(1, |b, x| Ok(vec![unary(b, UnaryOp::Exp, x[0])?]));
    let (f, _) = fused(&g);
    let names: Vec<&str> = f.blocks.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(names, vec!["main.k0"]);
    let mut clash = g.clone();
    clash.add_block(Region::new("main.k0"));
    let err = fuse(&mut clash).expect_err("a clashing block name");
    assert!(err.to_string().contains("`@main.k0` would reuse the name of an existing block"), "{err}");
}

#[test]
fn the_kernel_graph_check_reports_leftover_ops() {
    let g = graph(2, |b, x| {
        let m = matmul(b, x[0], x[1])?;
        Ok(vec![unary(b, UnaryOp::Exp, m)?])
    });
    assert_eq!(
        check_kernel_graph(&g),
        ["@main: `matmul` is outside any kernel; run the `fuse` pass", "@main: `exp` is outside any kernel; run the `fuse` pass"]
    );
    let (mut f, _) = fused(&g);
    // Turn the fused `exp` kernel into a `gemm` kernel: the check notices.
    let exp_kernel = f.main.order.iter().copied().find(|&n| matches!(f.main.node(n).op, Op::Kernel { kind: Fused, .. })).expect("exp kernel");
    let Op::Kernel { body, .. } = f.main.node(exp_kernel).op else { unreachable!("a kernel") };
    f.main.nodes[exp_kernel.index()].op = Op::Kernel { body, kind: Gemm };
    assert_eq!(check_kernel_graph(&f), ["@main.k1 is a `gemm` kernel but holds exp"]);
}

/// `c = cast(gemm) : f32`, read by the norm kernel `reduce_sum(square(c))` and by a kernel that
/// scales it by the norm (rule 5 keeps them apart). With `widen` the cast is bf16 -> f32, which
/// rule 10 computes again in the second kernel; a narrowing cast stays written out once.
fn norm_then_scale(widen: bool, also_gemm: bool) -> Graph {
    graph(2, |b, x| {
        let (narrow, wide) = if widen { (DType::BF16, DType::F32) } else { (DType::F32, DType::BF16) };
        let (h, w) = if widen {
            (b.push_typed(Op::Cast, &[x[0]], TensorType::fixed(narrow, &[8, 8]))?, b.push_typed(Op::Cast, &[x[1]], TensorType::fixed(narrow, &[8, 8]))?)
        } else {
            (x[0], x[1])
        };
        let m = matmul(b, h, w)?;
        let c = b.push_typed(Op::Cast, &[m], TensorType::fixed(wide, &[8, 8]))?;
        let sq = unary(b, UnaryOp::Square, c)?;
        let s = b.push1(Op::Reduce { kind: ReduceKind::Sum, axes: vec![0, 1] }, &[sq])?;
        let r = unary(b, UnaryOp::Rsqrt, s)?;
        let y = binary(b, BinaryOp::Mul, c, r)?;
        let mut outs = vec![s, y];
        if also_gemm {
            outs.push(matmul(b, c, c)?);
        }
        Ok(outs)
    })
}

/// The dtypes of the non-scalar operands of `main`'s kernel whose body ends in `mul`.
fn scaling_kernel_inputs(g: &Graph) -> Vec<DType> {
    let is_scaling = |body: titan_ir::BlockId| g.block(body).order.last().is_some_and(|&m| matches!(g.block(body).node(m).op, Op::Binary(BinaryOp::Mul)));
    let k = g.main.order.iter().map(|&k| g.main.node(k)).find(|k| matches!(k.op, Op::Kernel { body, .. } if is_scaling(body))).expect("the scaling kernel");
    k.inputs.iter().map(|&v| g.main.ty(v)).filter(|t| t.rank() > 0).map(|t| t.dtype).collect()
}

#[test]
fn a_widening_cast_read_by_two_kernels_is_recomputed_in_each() {
    let (f, stats) = fused(&norm_then_scale(true, false));
    assert_eq!(
        kernels(&f),
        vec![
            (Fused, vec!["cast"]),
            (Fused, vec!["cast"]),
            (Gemm, vec!["matmul"]),
            (Fused, vec!["cast", "square", "reduce_sum"]),
            (Fused, vec!["rsqrt", "cast", "mul"])
        ]
    );
    assert_eq!(stats.recomputed, 1);
    // The norm kernel writes only the scalar; the scaling kernel reads the bf16 GEMM result.
    let norm = f.main.order.iter().map(|&k| f.main.node(k)).filter(|k| matches!(k.op, Op::Kernel { .. })).nth(3).expect("norm kernel");
    assert_eq!(norm.results.iter().map(|&r| f.main.ty(r).rank()).collect::<Vec<_>>(), vec![0]);
    assert_eq!(scaling_kernel_inputs(&f), vec![DType::BF16]);
}

#[test]
fn a_narrowing_cast_or_one_a_gemm_reads_is_written_once() {
    // f32 -> bf16: reading the f32 operand twice would move more bytes than the bf16 copy.
    let (f, stats) = fused(&norm_then_scale(false, false));
    assert_eq!(stats.recomputed, 0);
    assert!(kernels(&f).contains(&(Fused, vec!["rsqrt", "mul"])));
    assert_eq!(scaling_kernel_inputs(&f), vec![DType::BF16]);
    // A GEMM reads the f32 copy anyway, so the kernels share it.
    let (f, stats) = fused(&norm_then_scale(true, true));
    assert_eq!(stats.recomputed, 0);
    assert!(kernels(&f).contains(&(Fused, vec!["rsqrt", "mul"])));
    assert_eq!(scaling_kernel_inputs(&f), vec![DType::F32]);
}

/// `c = cast(cast(x) : bf16) : f32` made inside the norm kernel (`reduce_sum(square(c))`) and
/// read by a second kernel that scales it by the norm: the float8 head's weight gradient after
/// its scale epilogue has this shape.
fn rounded_then_scaled() -> Graph {
    graph(1, |b, x| {
        let h = b.push_typed(Op::Cast, &[x[0]], TensorType::fixed(DType::BF16, &[8, 8]))?;
        let c = b.push_typed(Op::Cast, &[h], f32s(&[8, 8]))?;
        let sq = unary(b, UnaryOp::Square, c)?;
        let s = b.push1(Op::Reduce { kind: ReduceKind::Sum, axes: vec![0, 1] }, &[sq])?;
        let r = unary(b, UnaryOp::Rsqrt, s)?;
        let y = binary(b, BinaryOp::Mul, c, r)?;
        Ok(vec![s, y])
    })
}

#[test]
fn a_widening_cast_of_a_value_of_its_own_kernel_writes_the_narrow_value() {
    let (f, stats) = fused(&rounded_then_scaled());
    assert_eq!(kernels(&f), vec![(Fused, vec!["cast", "cast", "square", "reduce_sum"]), (Fused, vec!["rsqrt", "cast", "mul"])]);
    assert_eq!(stats.recomputed, 1);
    // The norm kernel writes its scalar and the bf16 value (not the f32 cast of it), which the
    // scaling kernel widens itself.
    let norm = f.main.order.iter().map(|&k| f.main.node(k)).find(|k| matches!(k.op, Op::Kernel { .. })).expect("norm kernel");
    let mut written: Vec<DType> = norm.results.iter().map(|&r| f.main.ty(r)).filter(|t| t.rank() > 0).map(|t| t.dtype).collect();
    written.sort_by_key(|d| d.size_bytes());
    assert_eq!(written, vec![DType::BF16]);
    assert_eq!(scaling_kernel_inputs(&f), vec![DType::BF16]);
}

#[test]
fn an_absolute_value_two_kernels_reduce_is_taken_in_each() {
    // float8 rowwise's weight: `abs(w)` reduced along its rows (the forward's scales, with the
    // quantization in the same kernel) and along its columns (grad_input's scales, a column
    // kernel). Without recomputation the row kernel wrote `abs(w)` for the column kernel.
    let g = graph(1, |b, x| {
        let a = unary(b, UnaryOp::Abs, x[0])?;
        let rows = b.push1(Op::Reduce { kind: ReduceKind::Max, axes: vec![1] }, &[a])?;
        let cols = b.push1(Op::Reduce { kind: ReduceKind::Max, axes: vec![0] }, &[a])?;
        let sb = b.push_typed(Op::Broadcast { dims: vec![0] }, &[rows], f32s(&[8, 8]))?;
        let q = binary(b, BinaryOp::Mul, x[0], sb)?;
        Ok(vec![q, cols])
    });
    let (f, stats) = fused(&g);
    assert_eq!(stats.recomputed, 1, "{f}");
    // No kernel writes an f32[8, 8] other than the scaled output.
    let written: usize = f
        .main
        .order
        .iter()
        .map(|&k| f.main.node(k))
        .filter(|k| matches!(k.op, Op::Kernel { .. }))
        .map(|k| k.results.iter().filter(|&&r| f.main.ty(r).rank() == 2).count())
        .sum();
    assert_eq!(written, 1, "{f}");
}

#[test]
fn a_node_that_joined_its_producer_also_joins_a_sibling_reading_the_same_tensor() {
    // SwiGLU's backward after `none` recomputes `silu(gate)`: `dy * up` is one kernel, then
    // `silu(gate)` and `dy * silu(gate)` another; the second multiply joins `silu`'s group (its
    // producer) and brings it into the kernel that already reads `dy`, so `dy` is read once.
    let g = graph(3, |b, x| {
        let a = binary(b, BinaryOp::Mul, x[0], x[1])?;
        let s = unary(b, UnaryOp::Silu, x[2])?;
        let m = binary(b, BinaryOp::Mul, x[0], s)?;
        Ok(vec![a, m])
    });
    let (f, _) = fused(&g);
    assert_eq!(kernels(&f), vec![(Fused, vec!["mul", "silu", "mul"])]);
}
