//! Gradient checks: the VJP of every differentiable op (and of `repeat`) against central
//! finite differences, both evaluated by the reference interpreter in f64 without rounding.
//!
//! Tolerance: |analytic - numeric| <= 1e-6 * max(1, |numeric|) with step h = 1e-6 (f64).

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use titan_ir::interp::{Interpreter, Precision, Tensor};
use titan_ir::{
    ArgKind, BinaryOp, DType, Dim, Graph, Init, Op, Output, ParamInfo, ReduceKind, Region, RopeConfig, RopeLayout, RopeScaling, TensorType, UnaryOp, Value,
};
use titan_passes::autodiff::differentiate_main;

/// How to draw an input's values.
#[derive(Clone, Copy)]
enum Dist {
    /// Uniform in [-1, 1].
    Signed,
    /// Uniform in [0.5, 2] (log, sqrt, pow bases, divisors).
    Positive,
    /// Integers in [0, n).
    Index(i64),
    /// The one-hot vector with a 1 at `k` (a vocabulary shard); never differentiated.
    OneHot(usize),
}

struct Input {
    ty: TensorType,
    dist: Dist,
}

fn f32t(shape: &[u64]) -> TensorType {
    TensorType::fixed(DType::F32, shape)
}

fn input(shape: &[u64], dist: Dist) -> Input {
    let dtype = if matches!(dist, Dist::Index(_)) { DType::I32 } else { DType::F32 };
    Input { ty: TensorType::fixed(dtype, shape), dist }
}

/// Build `loss = sum_i sum(result_i * cot_i)` over the differentiable results of the node(s)
/// made by `make`, with every float input a `state` argument so autodiff returns its gradient.
fn build(inputs: &[Input], n_diff_results: usize, make: &dyn Fn(&mut Graph, &[Value]) -> Vec<Value>) -> (Graph, Vec<usize>) {
    let mut g = Graph::new("gradcheck");
    let mut vals = Vec::new();
    let mut float_args = Vec::new();
    for (i, inp) in inputs.iter().enumerate() {
        let kind = if inp.ty.dtype.is_float() {
            float_args.push(i);
            ArgKind::State(ParamInfo { name: format!("x{i}"), init: Init::Zeros })
        } else {
            ArgKind::Input
        };
        vals.push(g.main.add_arg(inp.ty.clone(), kind, Some(&format!("x{i}"))));
    }
    let results = make(&mut g, &vals);
    let mut cots = Vec::new();
    for (k, &r) in results.iter().take(n_diff_results).enumerate() {
        let ty = g.main.ty(r).clone();
        cots.push(g.main.add_arg(ty, ArgKind::Input, Some(&format!("cot{k}"))));
    }
    let mut b = g.main_builder();
    let mut loss: Option<Value> = None;
    for (&r, &c) in results.iter().zip(&cots) {
        let p = b.push1(Op::Binary(BinaryOp::Mul), &[r, c]).expect("mul");
        let rank = b.ty(p).rank();
        let s = if rank == 0 { p } else { b.push1(Op::Reduce { kind: ReduceKind::Sum, axes: (0..rank).collect() }, &[p]).expect("sum") };
        loss = Some(match loss {
            None => s,
            Some(l) => b.push1(Op::Binary(BinaryOp::Add), &[l, s]).expect("add"),
        });
    }
    let loss = loss.expect("at least one result");
    g.main.outputs.push(Output { name: Some("loss".into()), value: loss });
    (g, float_args)
}

fn random_tensor(rng: &mut ChaCha8Rng, ty: &TensorType, dist: Dist) -> Tensor<f64> {
    let shape: Vec<usize> = ty.shape.iter().map(|d| if let Dim::Fixed(n) = d { *n as usize } else { panic!("fixed dims only") }).collect();
    let n: usize = shape.iter().product();
    match dist {
        Dist::Signed => Tensor::from_vec(ty.dtype, shape, (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()).expect("tensor"),
        Dist::Positive => Tensor::from_vec(ty.dtype, shape, (0..n).map(|_| rng.random_range(0.5..2.0)).collect()).expect("tensor"),
        Dist::Index(m) => Tensor::from_ints(ty.dtype, shape, (0..n).map(|_| rng.random_range(0..m)).collect()).expect("tensor"),
        Dist::OneHot(k) => Tensor::from_vec(ty.dtype, shape, (0..n).map(|i| if i == k { 1.0 } else { 0.0 }).collect()).expect("tensor"),
    }
}

/// Differentiate, then compare every gradient element (at most 24 sampled per input) with
/// central differences.
fn check(name: &str, inputs: Vec<Input>, n_diff_results: usize, make: &dyn Fn(&mut Graph, &[Value]) -> Vec<Value>) {
    let (mut g, float_args) = build(&inputs, n_diff_results, make);
    let (grads, _) = differentiate_main(&mut g, "loss").unwrap_or_else(|e| panic!("{name}: autodiff failed: {e}"));
    let arg_grads: Vec<(usize, Value)> = float_args.iter().filter_map(|&i| grads[i].map(|v| (i, v))).collect();
    assert!(!arg_grads.is_empty(), "{name}: no gradient reached any input");
    for &(i, v) in &arg_grads {
        g.main.outputs.push(Output { name: Some(format!("grad{i}")), value: v });
    }
    let errs = titan_ir::verify::verify(&g);
    assert!(errs.is_empty(), "{name}: differentiated graph does not verify: {:?}\n{g}", errs.iter().map(|e| e.to_string()).collect::<Vec<_>>());

    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed ^ name.len() as u64);
    let mut args: Vec<Tensor<f64>> = inputs.iter().map(|inp| random_tensor(&mut rng, &inp.ty, inp.dist)).collect();
    for a in &g.main.args[inputs.len()..] {
        args.push(random_tensor(&mut rng, g.main.ty(a.value), Dist::Signed));
    }
    let interp = Interpreter::new(&g, Precision::Exact);
    let base = interp.run(&args).unwrap_or_else(|e| panic!("{name}: run failed: {e}"));
    let loss_at = |args: &[Tensor<f64>]| -> f64 { interp.run(args).expect("run").outputs[0].to_f64_vec()[0] };
    let h = 1e-6;
    let mut checked = 0;
    for (k, &(i, _)) in arg_grads.iter().enumerate() {
        let analytic = base.outputs[1 + k].to_f64_vec();
        let n = analytic.len();
        let mut largest = 0f64;
        let picks: Vec<usize> = if n <= 24 { (0..n).collect() } else { (0..24).map(|_| rng.random_range(0..n)).collect() };
        for j in picks {
            let orig = args[i].floats().expect("float input")[j];
            args[i].floats_mut().expect("float")[j] = orig + h;
            let lp = loss_at(&args);
            args[i].floats_mut().expect("float")[j] = orig - h;
            let lm = loss_at(&args);
            args[i].floats_mut().expect("float")[j] = orig;
            let numeric = (lp - lm) / (2.0 * h);
            let a = analytic[j];
            assert!((a - numeric).abs() <= 1e-6 * numeric.abs().max(1.0), "{name}: d loss / d x{i}[{j}]: analytic {a} vs numeric {numeric}");
            checked += 1;
            largest = largest.max(numeric.abs());
        }
        assert!(largest > 1e-6, "{name}: every sampled gradient of x{i} is zero; the check would prove nothing");
    }
    assert!(checked > 0, "{name}: nothing checked");
}

fn one(op: Op) -> impl Fn(&mut Graph, &[Value]) -> Vec<Value> {
    move |g: &mut Graph, x: &[Value]| g.main_builder().push(op.clone(), x).expect("push")
}

fn typed(op: Op, ty: TensorType) -> impl Fn(&mut Graph, &[Value]) -> Vec<Value> {
    move |g: &mut Graph, x: &[Value]| vec![g.main_builder().push_typed(op.clone(), x, ty.clone()).expect("push")]
}

#[test]
fn unary_ops() {
    for u in UnaryOp::ALL {
        let dist = match u {
            UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Recip => Dist::Positive,
            _ => Dist::Signed,
        };
        check(u.name(), vec![input(&[3, 5], dist)], 1, &one(Op::Unary(u)));
    }
}

#[test]
fn binary_ops() {
    for bo in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Pow] {
        let rhs = if matches!(bo, BinaryOp::Div | BinaryOp::Pow) { Dist::Positive } else { Dist::Signed };
        let lhs = if bo == BinaryOp::Pow { Dist::Positive } else { Dist::Signed };
        check(bo.name(), vec![input(&[4, 3], lhs), input(&[4, 3], rhs)], 1, &one(Op::Binary(bo)));
        // A rank-0 operand broadcasts; its gradient sums over the tensor.
        check(&format!("{}-scalar-rhs", bo.name()), vec![input(&[4, 3], lhs), input(&[], rhs)], 1, &one(Op::Binary(bo)));
        check(&format!("{}-scalar-lhs", bo.name()), vec![input(&[], lhs), input(&[2, 3], rhs)], 1, &one(Op::Binary(bo)));
    }
}

#[test]
fn linear_and_matmul() {
    check("linear", vec![input(&[2, 3, 4], Dist::Signed), input(&[5, 4], Dist::Signed)], 1, &one(Op::Linear));
    check("linear-2d", vec![input(&[3, 4], Dist::Signed), input(&[5, 4], Dist::Signed)], 1, &one(Op::Linear));
    for ta in [false, true] {
        for tb in [false, true] {
            let a = if ta { [4, 3] } else { [3, 4] };
            let b = if tb { [5, 4] } else { [4, 5] };
            check(
                &format!("matmul-2d-{ta}-{tb}"),
                vec![input(&a, Dist::Signed), input(&b, Dist::Signed)],
                1,
                &one(Op::Matmul { transpose_a: ta, transpose_b: tb }),
            );
            let a3 = if ta { [2, 4, 3] } else { [2, 3, 4] };
            let b3 = if tb { [2, 5, 4] } else { [2, 4, 5] };
            check(
                &format!("matmul-batched-{ta}-{tb}"),
                vec![input(&a3, Dist::Signed), input(&b3, Dist::Signed)],
                1,
                &one(Op::Matmul { transpose_a: ta, transpose_b: tb }),
            );
        }
        let b = if ta { [5, 4] } else { [4, 5] };
        let _ = b;
    }
    for tb in [false, true] {
        let b = if tb { [5, 4] } else { [4, 5] };
        check(
            &format!("matmul-shared-rhs-{tb}"),
            vec![input(&[2, 3, 4], Dist::Signed), input(&b, Dist::Signed)],
            1,
            &one(Op::Matmul { transpose_a: false, transpose_b: tb }),
        );
    }
}

#[test]
fn rmsnorm() {
    check("rmsnorm", vec![input(&[2, 3, 8], Dist::Signed), input(&[8], Dist::Signed)], 1, &one(Op::RmsNorm { eps: 1e-5 }));
}

#[test]
fn rope() {
    let scaling = RopeScaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 4 };
    for layout in [RopeLayout::Half, RopeLayout::Interleaved] {
        for sc in [None, Some(scaling)] {
            for inverse in [false, true] {
                let cfg = RopeConfig { theta: 10000.0, layout, scaling: sc, inverse };
                check(&format!("rope-{layout:?}-{}-{inverse}", sc.is_some()), vec![input(&[2, 5, 3, 8], Dist::Signed)], 1, &one(Op::Rope(cfg)));
            }
        }
    }
}

#[test]
fn attention() {
    for causal in [true, false] {
        for (hq, hkv) in [(2, 2), (4, 2), (4, 1)] {
            let q = input(&[2, 5, hq, 4], Dist::Signed);
            let k = input(&[2, 5, hkv, 4], Dist::Signed);
            let v = input(&[2, 5, hkv, 4], Dist::Signed);
            // Only `out` is differentiable; lse is a by-product for the backward.
            check(&format!("attention-{causal}-{hq}-{hkv}"), vec![q, k, v], 1, &one(Op::Attention { causal, scale: 0.5 }));
        }
    }
}

#[test]
fn cross_entropy_and_embedding() {
    check("cross_entropy", vec![input(&[2, 3, 7], Dist::Signed), input(&[2, 3], Dist::Index(7))], 1, &one(Op::CrossEntropy));
    check("embedding", vec![input(&[2, 3], Dist::Index(5)), input(&[5, 4], Dist::Signed)], 1, &one(Op::Embedding));
    check("gather", vec![input(&[6, 2, 3], Dist::Signed), input(&[4], Dist::Index(6))], 1, &one(Op::Gather));
    check("scatter_add", vec![input(&[2, 3], Dist::Index(4)), input(&[2, 3, 5], Dist::Signed)], 1, &typed(Op::ScatterAdd, f32t(&[4, 5])));
}

/// The vocab-parallel embedding's row-shard ops (shard 1 of 3 of a 6-row table for the
/// gather, shard 2 of 3 of a 12-row table for the scatter): indices of other shards give zero
/// rows or are dropped, so their VJPs are each other. The mesh composition (reduce-scatter of
/// the partial embeddings) is checked end to end against single-rank training
/// (`tests/tests/e2e/distributed.rs`, every tp mesh).
#[test]
fn vocab_parallel_embedding() {
    check("gather_shard", vec![input(&[2, 3], Dist::Signed), input(&[2, 4], Dist::Index(6)), input(&[3], Dist::OneHot(1))], 1, &one(Op::GatherShard));
    check(
        "scatter_add_shard",
        vec![input(&[2, 3], Dist::Index(12)), input(&[2, 3, 5], Dist::Signed), input(&[3], Dist::OneHot(2))],
        1,
        &typed(Op::ScatterAddShard, f32t(&[4, 5])),
    );
}

/// The vocabulary-parallel cross-entropy's ops (loss parallelism), each on its own and
/// composed for one shard of one (no communicator: with one shard the gathers over tp are the
/// identity, so `cross_entropy_combine(cross_entropy_stats(..))` is the cross-entropy). The
/// mesh composition with its all-gathers and reduce-scatters is checked end to end against
/// single-rank training (`tests/tests/e2e/distributed.rs`, every tp mesh).
#[test]
fn vocab_parallel_cross_entropy() {
    // Shard 1 of 3 of a 15-word vocabulary: targets in other shards give a zero target logit.
    let stats = || vec![input(&[2, 3, 5], Dist::Signed), input(&[2, 3], Dist::Index(15)), input(&[3], Dist::OneHot(1))];
    check("cross_entropy_stats", stats(), 3, &one(Op::CrossEntropyStats));
    check(
        "cross_entropy_combine",
        vec![input(&[2, 3, 4], Dist::Signed), input(&[2, 3, 4], Dist::Positive), input(&[2, 3, 4], Dist::Signed)],
        1,
        &one(Op::CrossEntropyCombine),
    );
    let composed = |g: &mut Graph, x: &[Value]| {
        let mut b = g.main_builder();
        let s = b.push(Op::CrossEntropyStats, x).expect("stats");
        vec![b.push1(Op::CrossEntropyCombine, &s).expect("combine")]
    };
    check("cross_entropy_stats+combine", vec![input(&[2, 3, 7], Dist::Signed), input(&[2, 3], Dist::Index(7)), input(&[1], Dist::OneHot(0))], 1, &composed);
}

#[test]
fn shape_ops() {
    check("cast", vec![input(&[3, 4], Dist::Signed)], 1, &typed(Op::Cast, f32t(&[3, 4])));
    check("reshape", vec![input(&[3, 4], Dist::Signed)], 1, &typed(Op::Reshape, f32t(&[2, 6])));
    check("transpose", vec![input(&[2, 3, 4], Dist::Signed)], 1, &one(Op::Transpose { perm: vec![2, 0, 1] }));
    // slice's VJP places dy between zeros (a concat), concat's slices dy.
    check("slice-middle", vec![input(&[2, 5, 3], Dist::Signed)], 1, &one(Op::Slice { axis: 1, start: 1, len: 2 }));
    check("slice-leading", vec![input(&[4, 3], Dist::Signed)], 1, &one(Op::Slice { axis: 0, start: 0, len: 3 }));
    check("concat", vec![input(&[2, 3], Dist::Signed), input(&[1, 3], Dist::Signed), input(&[2, 3], Dist::Signed)], 1, &one(Op::Concat { axis: 0 }));
    check("concat-inner", vec![input(&[2, 3], Dist::Signed), input(&[2, 1], Dist::Signed)], 1, &one(Op::Concat { axis: 1 }));
    check("broadcast-new-dims", vec![input(&[3], Dist::Signed)], 1, &typed(Op::Broadcast { dims: vec![1] }, f32t(&[2, 3, 4])));
    check("broadcast-stretch", vec![input(&[1, 4], Dist::Signed)], 1, &typed(Op::Broadcast { dims: vec![0, 1] }, f32t(&[3, 4])));
    for kind in [ReduceKind::Sum, ReduceKind::Mean] {
        check(&format!("{kind:?}-0"), vec![input(&[3, 4, 2], Dist::Signed)], 1, &one(Op::Reduce { kind, axes: vec![0] }));
        check(&format!("{kind:?}-1-2"), vec![input(&[3, 4, 2], Dist::Signed)], 1, &one(Op::Reduce { kind, axes: vec![1, 2] }));
    }
}

/// A block with a carried value, a stacked weight and an invariant weight, repeated 3 times:
/// checks the per-layer backward, the saved activations and the invariant accumulator.
#[test]
fn repeat_forward_and_reverse() {
    for reverse in [false, true] {
        let make = move |g: &mut Graph, x: &[Value]| -> Vec<Value> {
            let mut blk = Region::new("layer");
            let h = blk.add_arg(f32t(&[2, 4]), ArgKind::Block, Some("h"));
            let w = blk.add_arg(f32t(&[4, 4]), ArgKind::Block, Some("w"));
            let u = blk.add_arg(f32t(&[4]), ArgKind::Block, Some("u"));
            {
                let mut b = titan_ir::Builder::new(&mut blk, &g.dims, &g.blocks);
                let y = b.push1(Op::Linear, &[h, w]).expect("linear");
                let y = b.push1(Op::Unary(UnaryOp::Tanh), &[y]).expect("tanh");
                let ub = b.push_typed(Op::Broadcast { dims: vec![1] }, &[u], f32t(&[2, 4])).expect("bcast");
                let z = b.push1(Op::Binary(BinaryOp::Mul), &[y, ub]).expect("mul");
                let out = b.push1(Op::Binary(BinaryOp::Add), &[z, h]).expect("add");
                let side = b.push1(Op::Unary(UnaryOp::Square), &[y]).expect("square");
                b.region.outputs = vec![Output { name: None, value: out }, Output { name: None, value: side }];
            }
            let id = g.add_block(blk);
            g.main_builder().push(Op::Repeat { block: id, count: 3, carry: 1, stacked: 1, reverse, prefetch: 0 }, x).expect("repeat")
        };
        check(&format!("repeat-reverse-{reverse}"), vec![input(&[2, 4], Dist::Signed), input(&[3, 4, 4], Dist::Signed), input(&[4], Dist::Signed)], 2, &make);
    }
}

/// Ops without a VJP say so instead of producing wrong gradients.
#[test]
fn non_differentiable_ops_are_reported() {
    for (op, n) in [(Op::Binary(BinaryOp::Max), 2), (Op::Binary(BinaryOp::Min), 2), (Op::Reduce { kind: ReduceKind::Max, axes: vec![0] }, 1)] {
        let inputs: Vec<Input> = (0..n).map(|_| input(&[3], Dist::Signed)).collect();
        let (mut g, _) = build(&inputs, 1, &one(op.clone()));
        let err = differentiate_main(&mut g, "loss").expect_err("must not differentiate");
        assert_eq!(err.kind, titan_passes::PassErrorKind::Unsupported, "{}: {err}", op.name());
        assert!(err.message.contains("not supported yet") && err.at.is_some(), "{}: {err}", op.name());
    }
}
