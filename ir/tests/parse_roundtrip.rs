//! Round trips of the text format: random valid graphs built with the `Builder` and a
//! hand-written graph using every op must print, parse back to the same graph and print again
//! identically. The generator here is also used by `parse_fuzz.rs` for its seed inputs.

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use titan_ir::print::print_graph;
use titan_ir::*;

/// A graph exercising every op of the `Op` enum at least once, in printed (canonical) form.
/// `@layer` runs a kernel whose body `@fused` is defined after it.
pub const EVERY_OP: &str = r#"graph @every_op {
  meta {arch = "llama3", dim = 8, eps = 1e-5, big = 1e300, tiny = 0.1, neg = -0.0, flag = true, label = "a \"quoted\"\n\\ string\t\u{1}", list = [1, -2, 3.5, [inf, -inf]], init = normal(0.02), kind = cosine, ref = @layer}
  dims {batch = 2, seq = 4}

  block @layer(%h: bf16[batch, seq, 8], %wq: bf16[8, 8], %norm: f32[8]) {
    %3 = rmsnorm(%h, %norm) {eps = 1e-5} : bf16[batch, seq, 8]
    %4 = linear(%3, %wq) : bf16[batch, seq, 8]
    %5 = reshape(%4) : bf16[batch, seq, 2, 4]
    %6 = rope(%5) {theta = 500000.0, layout = half} : bf16[batch, seq, 2, 4]
    %7 = rope(%5) {theta = 10000.0, layout = interleaved, scaling_factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_position = 8192} : bf16[batch, seq, 2, 4]
    %8, %9 = attention(%6, %7, %5) {causal = true, scale = 0.5} : bf16[batch, seq, 2, 4], f32[batch, 2, seq]
    %10 = reshape(%8) : bf16[batch, seq, 8]
    %11 = add(%h, %10) : bf16[batch, seq, 8] #[Shard(0), Replicate]
    %12 = kernel(%11) {body = @fused, kind = fused} : bf16[batch, seq, 8]
    return %12, %9
  }

  block @fused(%a: bf16[batch, seq, 8]) {
    %1 = exp(%a) : bf16[batch, seq, 8]
    return %1
  }

  func @main {
    input %tokens : i32[batch, seq]
    input %targets : i32[batch, seq]
    input %step : i32[]
    param %tok_embeddings : bf16[16, 8] {name = "tok_embeddings.weight", init = normal(1.0)}
    param %wq : bf16[2, 8, 8] {name = "layers.{i}.attention.wq.weight", init = trunc_normal_depth(0.02, -0.06, 0.06)}
    param %norm : f32[2, 8] {name = "layers.{i}.attention_norm.weight", init = ones}
    param %final_norm : f32[8] {name = "norm.weight", init = ones}
    param %output : bf16[16, 8] #[Replicate, Shard(0)] {name = "output.weight", init = trunc_normal(0.02, -0.04, 0.04)}
    state %master : f32[16, 8] {name = "output.weight.master", init = zeros}
    state %m : f32[16, 8] #[Shard(1), Partial] {name = "output.weight.exp_avg", init = zeros}
    state %v : f32[16, 8] {name = "output.weight.exp_avg_sq", init = zeros}
    %11 = embedding(%tokens, %tok_embeddings) : bf16[batch, seq, 8]
    %h, %lse = repeat(%11, %wq, %norm) {block = @layer, count = 2, carry = 1, stacked = 2, reverse = false} : bf16[batch, seq, 8], f32[2, batch, 2, seq]
    %14, %15 = repeat(%h, %wq, %norm) {block = @layer, count = 2, carry = 1, stacked = 2, reverse = true} : bf16[batch, seq, 8], f32[2, batch, 2, seq]
    %16 = linear(%14, %output) : bf16[batch, seq, 16]
    %logits = cast(%16) : f32[batch, seq, 16] #[Shard(0)]
    %loss = cross_entropy(%logits, %targets) : f32[]
    %19 = constant() {value = 1.0} : f32[]
    %20 = cross_entropy_bwd(%logits, %targets, %19) : f32[batch, seq, 16]
    %21 = neg(%20) : f32[batch, seq, 16]
    %22 = exp(%21) : f32[batch, seq, 16]
    %23 = log(%22) : f32[batch, seq, 16]
    %24 = sqrt(%23) : f32[batch, seq, 16]
    %25 = rsqrt(%24) : f32[batch, seq, 16]
    %26 = recip(%25) : f32[batch, seq, 16]
    %27 = sigmoid(%26) : f32[batch, seq, 16]
    %28 = silu(%27) : f32[batch, seq, 16]
    %29 = tanh(%28) : f32[batch, seq, 16]
    %30 = abs(%29) : f32[batch, seq, 16]
    %31 = square(%30) : f32[batch, seq, 16]
    %32 = add(%31, %20) : f32[batch, seq, 16]
    %33 = sub(%32, %20) : f32[batch, seq, 16]
    %34 = mul(%33, %20) : f32[batch, seq, 16]
    %35 = div(%34, %20) : f32[batch, seq, 16]
    %36 = max(%35, %20) : f32[batch, seq, 16]
    %37 = min(%36, %20) : f32[batch, seq, 16]
    %38 = pow(%37, %19) : f32[batch, seq, 16]
    %39 = silu_grad(%19, %38) : f32[batch, seq, 16]
    %40 = reduce_sum(%39) {axes = [2]} : f32[batch, seq]
    %41 = reduce_max(%40) {axes = [0, 1]} : f32[]
    %42 = reduce_mean(%39) {axes = [1, 2]} : f32[batch]
    %43 = transpose(%39) {perm = [2, 0, 1]} : f32[16, batch, seq]
    %44 = broadcast(%40) {dims = [0, 1]} : f32[batch, seq, 16]
    %45 = matmul(%44, %master) {transpose_a = false, transpose_b = false} : f32[batch, seq, 8]
    %46 = matmul(%45, %master) {transpose_a = false, transpose_b = true} : f32[batch, seq, 16]
    %47 = matmul(%master, %master) {transpose_a = true, transpose_b = false} : f32[8, 8]
    %48 = gather(%master, %tokens) : f32[batch, seq, 8]
    %49 = rmsnorm(%48, %final_norm) {eps = 1e-6} : f32[batch, seq, 8]
    %50, %51 = rmsnorm_bwd(%48, %final_norm, %49) {eps = 1e-6} : f32[batch, seq, 8], f32[8]
    %52 = reshape(%50) : f32[batch, seq, 2, 4]
    %53 = rope(%52) {theta = 10000.0, layout = half, inverse = true} : f32[batch, seq, 2, 4]
    %54, %55 = attention(%53, %52, %52) {causal = false, scale = 0.5} : f32[batch, seq, 2, 4], f32[batch, 2, seq]
    %56, %57, %58 = attention_bwd(%53, %52, %52, %54, %55, %54) {causal = false, scale = 0.5} : f32[batch, seq, 2, 4], f32[batch, seq, 2, 4], f32[batch, seq, 2, 4]
    %59 = reshape(%56) : f32[batch, seq, 8]
    %60 = scatter_add(%tokens, %59) : f32[16, 8]
    %lr = lr_schedule(%step) {lr = 0.0003, warmup_steps = 10, decay_steps = 100, decay = cosine, min_lr_ratio = 0.1} : f32[]
    %62 = lr_schedule(%step) {lr = 0.001, warmup_steps = 0, decay_steps = 5, decay = linear, min_lr_ratio = 0.0} : f32[]
    %63 = lr_schedule(%step) {lr = 0.001, warmup_steps = 2, decay_steps = 0, decay = constant, min_lr_ratio = 1.0} : f32[]
    %64, %65, %66 = adamw(%master, %60, %m, %v, %lr, %step) {beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1} : f32[16, 8], f32[16, 8], f32[16, 8]
    %67 = kernel(%14) {body = @fused, kind = fused} : bf16[batch, seq, 8]
    %68 = all_gather(%master) {mesh_dim = dp_shard, dim = 1, size = 2} : f32[16, 16] #[Replicate, Replicate, Replicate]
    %69 = reduce_scatter(%68) {mesh_dim = tp, dim = 0, size = 4, reduce = sum} : f32[4, 16] #[Replicate, Replicate, Shard(0)]
    %70 = all_reduce(%69) {mesh_dim = dp_replicate, reduce = max} : f32[4, 16]
    %71 = take_shard(%master) {mesh_dim = tp, dim = 0, size = 4} : f32[4, 8] #[Replicate, Replicate, Shard(0)]
    %72 = place_shard(%71) {mesh_dim = tp, dim = 1, size = 2} : f32[4, 16]
    %73 = constant() {value = 0.5} : f32[2]
    %74, %75, %76 = cross_entropy_stats(%logits, %targets, %73) : f32[batch, seq, 1], f32[batch, seq, 1], f32[batch, seq, 1]
    %77 = cross_entropy_stats_bwd(%logits, %targets, %73, %74, %75, %76) : f32[batch, seq, 16]
    %78 = all_gather(%75) {mesh_dim = tp, dim = 2, size = 2} : f32[batch, seq, 2]
    %79 = cross_entropy_combine(%78, %78, %78) : f32[]
    %sliced = slice(%43) {axis = 0, start = 2, len = 4} : f32[4, batch, seq]
    %joined = concat(%sliced, %43) {axis = 0} : f32[20, batch, seq]
    output loss = %loss
    output lse = %lse
    output stats = %42
    output max = %41
    output t = %43
    output mm = %46
    output sq = %47
    output dw = %51
    output dk = %57
    output dv = %58
    output lr2 = %62
    output lr3 = %63
    output k = %67
    output ce_dx = %77
    output ce = %79
    update %master <- %64
    update %m <- %65
    update %v <- %66
  }
}
"#;

/// Random graph recipes: shrinkable descriptions that [`build`] turns into valid graphs.
pub mod generator {
    use std::collections::BTreeSet;

    use proptest::collection::vec;
    use proptest::prelude::*;
    use titan_ir::*;

    #[derive(Clone, Debug)]
    pub struct Step {
        pub kind: u8,
        pub a: u16,
        pub b: u16,
        pub c: u16,
        /// Bit 0: name the result; bit 1: give it a placement.
        pub flags: u8,
    }

    #[derive(Clone, Debug)]
    pub struct BlockRecipe {
        pub name: String,
        pub layers: u32,
        pub reverse: bool,
        /// Whether the norm weight is stacked per layer (`stacked = 2`) or shared (`stacked = 1`).
        pub stack_norm: bool,
        /// Whether the block also returns a non-carried value (stacked per layer by `repeat`).
        pub extra_output: bool,
    }

    #[derive(Clone, Debug)]
    pub struct Recipe {
        pub name: String,
        pub batch: u64,
        pub seq: u64,
        pub hidden: u64,
        pub named_hidden: bool,
        pub dtype: u8,
        pub meta: Vec<AttrValue>,
        pub block: Option<BlockRecipe>,
        pub steps: Vec<Step>,
        pub name_bases: Vec<String>,
        pub placements: Vec<Vec<Placement>>,
        pub inits: Vec<Init>,
        pub ckpt_names: Vec<String>,
        pub states: u8,
    }

    fn keyword(s: &str) -> bool {
        matches!(s, "true" | "false" | "inf" | "nan")
    }

    fn word() -> impl Strategy<Value = String> {
        "[a-z_][a-z0-9_]{0,7}".prop_filter("keywords read back as other values", |s| !keyword(s))
    }

    fn float() -> impl Strategy<Value = f64> {
        prop_oneof![
            prop_oneof![Just(1e-5), Just(0.1), Just(1e300), Just(-0.0), Just(0.0), Just(f64::INFINITY), Just(f64::NEG_INFINITY)],
            Just(f64::MIN_POSITIVE),
            Just(5e-324),
            Just(f64::MAX),
            prop::num::f64::POSITIVE | prop::num::f64::NEGATIVE | prop::num::f64::NORMAL | prop::num::f64::SUBNORMAL | prop::num::f64::ZERO,
        ]
    }

    /// Strings with quotes, backslashes, control characters and any Unicode.
    fn string() -> impl Strategy<Value = String> {
        prop_oneof![
            vec(any::<char>(), 0..10).prop_map(String::from_iter),
            vec(prop_oneof![Just('"'), Just('\\'), Just('\n'), Just('\t'), Just('\u{0}'), Just('{'), Just('é'), Just('a')], 0..10).prop_map(String::from_iter),
        ]
    }

    pub fn attr_value() -> impl Strategy<Value = AttrValue> {
        let leaf = prop_oneof![
            any::<bool>().prop_map(AttrValue::Bool),
            any::<i64>().prop_map(AttrValue::Int),
            float().prop_map(AttrValue::Float),
            string().prop_map(AttrValue::Str),
            word().prop_map(AttrValue::Ident),
            "[A-Za-z0-9_.]{1,8}".prop_map(AttrValue::Symbol),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![vec(inner.clone(), 0..4).prop_map(AttrValue::List), (word(), vec(inner, 0..4)).prop_map(|(n, a)| AttrValue::Call(n, a)),]
        })
    }

    fn init() -> impl Strategy<Value = Init> {
        prop_oneof![
            Just(Init::Zeros),
            Just(Init::Ones),
            float().prop_map(|std| Init::Normal { std }),
            (float(), float(), float(), any::<bool>()).prop_map(|(std, lo, hi, depth_scaled)| Init::TruncNormal { std, lo, hi, depth_scaled }),
        ]
    }

    fn placement() -> impl Strategy<Value = Placement> {
        prop_oneof![Just(Placement::Replicate), Just(Placement::Partial), (0u32..4).prop_map(Placement::Shard)]
    }

    pub fn recipe() -> impl Strategy<Value = Recipe> {
        let block = ("[a-z][a-z0-9_.]{0,6}", 1u32..4, any::<bool>(), any::<bool>(), any::<bool>())
            .prop_map(|(name, layers, reverse, stack_norm, extra_output)| BlockRecipe { name, layers, reverse, stack_norm, extra_output });
        let step = (0u8..16, any::<u16>(), any::<u16>(), any::<u16>(), any::<u8>()).prop_map(|(kind, a, b, c, flags)| Step { kind, a, b, c, flags });
        let shape = ("[A-Za-z_][A-Za-z0-9_.]{0,8}", 1u64..5, 1u64..6, 1u64..5, any::<bool>(), 0u8..3);
        let body = (
            vec(attr_value(), 0..6),
            prop::option::weighted(0.7, block),
            vec(step, 0..24),
            vec("[a-z][a-z.]{0,5}", 1..4),
            vec(vec(placement(), 1..3), 1..3),
            vec(init(), 1..4),
            vec(string(), 1..3),
            0u8..3,
        );
        (shape, body).prop_map(|((name, batch, seq, hidden, named_hidden, dtype), (meta, block, steps, name_bases, placements, inits, ckpt_names, states))| {
            Recipe { name, batch, seq, hidden, named_hidden, dtype, meta, block, steps, name_bases, placements, inits, ckpt_names, states }
        })
    }

    const FLOATS: [DType; 5] = [DType::F32, DType::BF16, DType::F16, DType::F8E4M3, DType::F8E5M2];

    /// Builds the main region: every new value may get a name or a placement.
    struct MainBuilder<'r> {
        r: &'r Recipe,
        counter: usize,
        used_names: BTreeSet<String>,
    }

    impl MainBuilder<'_> {
        fn decorate(&mut self, b: &mut Builder, v: Value, flags: u8) {
            self.counter += 1;
            let k = self.counter;
            if flags & 1 != 0 {
                let name = format!("{}_{k}", self.r.name_bases[k % self.r.name_bases.len()]);
                assert!(self.used_names.insert(name.clone()), "generator made a duplicate name");
                b.name(v, &name);
            }
            if flags & 2 != 0 {
                b.region.values[v.index()].placement = self.r.placements[k % self.r.placements.len()].clone();
            }
        }

        fn param(&mut self, b: &mut Builder, ty: TensorType, flags: u8) -> Value {
            self.counter += 1;
            let k = self.counter;
            let info = ParamInfo { name: format!("{}{k}", self.r.ckpt_names[k % self.r.ckpt_names.len()]), init: self.r.inits[k % self.r.inits.len()] };
            let v = b.region.add_arg(ty, ArgKind::Param(info), None);
            self.decorate(b, v, flags >> 2);
            v
        }

        fn step(&mut self, b: &mut Builder, pool: &mut Vec<Value>, s: &Step) {
            let x = pool[s.a as usize % pool.len()];
            let tx = b.ty(x).clone();
            let rank = tx.rank();
            let fixed = |n: u16, m: u64| Dim::Fixed(1 + u64::from(n) % m);
            let unary = |b: &mut Builder| b.push1(Op::Unary(UnaryOp::ALL[s.b as usize % UnaryOp::ALL.len()]), &[x]);
            let results: Result<Vec<Value>, String> = match s.kind {
                0 | 11 => unary(b).map(|v| vec![v]),
                1 | 12 => {
                    let op = Op::Binary(BinaryOp::ALL[s.b as usize % BinaryOp::ALL.len()]);
                    let y = pool[s.c as usize % pool.len()];
                    if s.c.is_multiple_of(4) {
                        let c = b.push_typed(Op::Constant { value: f64::from(s.b) / 8.0 }, &[], TensorType::scalar(tx.dtype));
                        c.and_then(|c| if s.c.is_multiple_of(8) { b.push(op, &[x, c]) } else { b.push(op, &[c, x]) })
                    } else if b.ty(y).same_as(&tx, b.ctx.dims) {
                        b.push(op, &[x, y])
                    } else {
                        b.push(op, &[x, x])
                    }
                }
                2 if rank > 0 => {
                    let mut axes: Vec<usize> = (0..rank).filter(|i| s.b & (1 << (i % 16)) != 0).collect();
                    if axes.is_empty() {
                        axes.push(s.c as usize % rank);
                    }
                    let kind = [ReduceKind::Sum, ReduceKind::Max, ReduceKind::Mean][s.c as usize % 3];
                    b.push(Op::Reduce { kind, axes }, &[x])
                }
                3 => {
                    let mut perm: Vec<usize> = (0..rank).collect();
                    let mut seed = u32::from(s.b) | (u32::from(s.c) << 16);
                    for i in (1..rank).rev() {
                        perm.swap(i, seed as usize % (i + 1));
                        seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                    }
                    b.push(Op::Transpose { perm }, &[x])
                }
                4 => {
                    let numel = tx.numel(b.ctx.dims).expect("generator binds every dim");
                    let shape =
                        if s.b.is_multiple_of(2) { vec![Dim::Fixed(numel)] } else { std::iter::once(Dim::Fixed(1)).chain(tx.shape.iter().cloned()).collect() };
                    b.push_typed(Op::Reshape, &[x], TensorType::new(tx.dtype, shape)).map(|v| vec![v])
                }
                5 if rank >= 2 => {
                    let (ta, tb) = (s.b & 1 != 0, s.b & 2 != 0);
                    let k = if ta { tx.shape[rank - 2].clone() } else { tx.shape[rank - 1].clone() };
                    let n = fixed(s.c, 4);
                    let wshape = if tb { vec![n, k] } else { vec![k, n] };
                    let w = self.param(b, TensorType::new(tx.dtype, wshape), s.flags);
                    b.push(Op::Matmul { transpose_a: ta, transpose_b: tb }, &[x, w])
                }
                6 => b.push_typed(Op::Cast, &[x], tx.with_dtype(FLOATS[s.b as usize % FLOATS.len()])).map(|v| vec![v]),
                7 => {
                    let value = f64::from(s.c) / 7.0 - 3.0;
                    b.push_typed(Op::Constant { value }, &[], tx.clone()).map(|v| vec![v])
                }
                8 => {
                    let p = s.b as usize % (rank + 1);
                    let new = if s.c.is_multiple_of(2) { Dim::named("batch") } else { fixed(s.c, 3) };
                    let mut shape = tx.shape.clone();
                    shape.insert(p, new);
                    let dims = (0..rank).map(|i| if i < p { i } else { i + 1 }).collect();
                    b.push_typed(Op::Broadcast { dims }, &[x], TensorType::new(tx.dtype, shape)).map(|v| vec![v])
                }
                9 if rank >= 1 => {
                    let w = self.param(b, TensorType::new(tx.dtype, vec![fixed(s.c, 4), tx.shape[rank - 1].clone()]), s.flags);
                    b.push(Op::Linear, &[x, w])
                }
                10 if rank >= 1 => {
                    let w = self.param(b, TensorType::new(DType::F32, vec![tx.shape[rank - 1].clone()]), s.flags);
                    b.push(Op::RmsNorm { eps: 1e-6 }, &[x, w])
                }
                _ => unary(b).map(|v| vec![v]),
            };
            let results = results.unwrap_or_else(|e| panic!("generator built an invalid op for {s:?} on {tx}: {e}"));
            for &v in &results {
                self.decorate(b, v, s.flags);
            }
            pool.extend(results);
        }
    }

    /// A valid graph from a recipe.
    pub fn build(r: &Recipe) -> Graph {
        let mut g = Graph::new(&r.name);
        g.meta = Attrs::new(r.meta.iter().enumerate().map(|(i, v)| (format!("k{i}"), v.clone())).collect());
        g.dims.insert("batch".into(), r.batch);
        g.dims.insert("seq".into(), r.seq);
        let hid = if r.named_hidden {
            g.dims.insert("hidden".into(), r.hidden);
            Dim::named("hidden")
        } else {
            Dim::Fixed(r.hidden)
        };
        let dt = [DType::F32, DType::BF16, DType::F16][r.dtype as usize % 3];
        let act = TensorType::new(dt, vec![Dim::named("batch"), Dim::named("seq"), hid.clone()]);
        let wty = TensorType::new(dt, vec![hid.clone(), hid.clone()]);
        let nty = TensorType::new(DType::F32, vec![hid.clone()]);
        if let Some(br) = &r.block {
            let mut blk = Region::new(&br.name);
            let h = blk.add_arg(act.clone(), ArgKind::Block, Some("h"));
            let w = blk.add_arg(wty.clone(), ArgKind::Block, Some("w"));
            let n = blk.add_arg(nty.clone(), ArgKind::Block, None);
            let mut b = Builder::new(&mut blk, &g.dims, &g.blocks);
            let built = (|| -> Result<Vec<Value>, String> {
                let x = b.push1(Op::RmsNorm { eps: 1e-5 }, &[h, n])?;
                let l = b.push1(Op::Linear, &[x, w])?;
                let s = b.push1(Op::Unary(UnaryOp::Silu), &[l])?;
                let o = b.push1(Op::Binary(BinaryOp::Add), &[h, s])?;
                Ok(if br.extra_output { vec![o, l] } else { vec![o] })
            })();
            let outs = built.unwrap_or_else(|e| panic!("generator built an invalid block: {e}"));
            blk.outputs = outs.into_iter().map(|value| Output { name: None, value }).collect();
            g.add_block(blk);
        }
        let mut mb = MainBuilder { r, counter: 0, used_names: BTreeSet::new() };
        let mut b = g.main_builder();
        let tokens = b.region.add_arg(TensorType::new(DType::I32, vec![Dim::named("batch"), Dim::named("seq")]), ArgKind::Input, Some("tokens"));
        let _step = b.region.add_arg(TensorType::scalar(DType::I32), ArgKind::Input, None);
        let emb = mb.param(&mut b, TensorType::new(dt, vec![Dim::Fixed(7), hid.clone()]), 1);
        let x0 = b.push1(Op::Embedding, &[tokens, emb]).unwrap_or_else(|e| panic!("generator: {e}"));
        let mut pool = vec![x0];
        if let Some(br) = &r.block {
            let layers = Dim::Fixed(u64::from(br.layers));
            let stack = |t: &TensorType| TensorType::new(t.dtype, std::iter::once(layers.clone()).chain(t.shape.iter().cloned()).collect());
            let info = |name: &str, init| ArgKind::Param(ParamInfo { name: name.to_string(), init });
            let ws = b.region.add_arg(stack(&wty), info("layers.{i}.w", r.inits[0]), Some("w_stack"));
            let ns = if br.stack_norm {
                b.region.add_arg(stack(&nty), info("layers.{i}.norm", Init::Ones), None)
            } else {
                b.region.add_arg(nty.clone(), info("shared.norm", Init::Ones), Some("shared.norm"))
            };
            let op = Op::Repeat { block: BlockId(0), count: br.layers, carry: 1, stacked: if br.stack_norm { 2 } else { 1 }, reverse: br.reverse, prefetch: 0 };
            let res = b.push(op, &[x0, ws, ns]).unwrap_or_else(|e| panic!("generator built an invalid repeat: {e}"));
            pool.extend(res);
        }
        for s in &r.steps {
            mb.step(&mut b, &mut pool, s);
        }
        for k in 0..r.states as usize {
            let v = pool[(k * 7) % pool.len()];
            let ty = b.ty(v).clone();
            let info = ParamInfo { name: format!("state.{k}"), init: r.inits[k % r.inits.len()] };
            let name = format!("st{k}");
            let s = b.region.add_arg(ty, ArgKind::State(info), (k % 2 == 0).then_some(name.as_str()));
            let value = b.push1(Op::Binary(BinaryOp::Add), &[s, v]).unwrap_or_else(|e| panic!("generator: {e}"));
            b.region.updates.push(Update { state: s, value });
        }
        let last = pool[pool.len() - 1];
        b.region.outputs.push(Output { name: Some("out".into()), value: last });
        b.region.outputs.push(Output { name: Some("first".into()), value: x0 });
        g
    }
}

/// Tests of this file do nothing when it is compiled into `parse_fuzz` for its generator.
fn included_elsewhere() -> bool {
    env!("CARGO_CRATE_NAME") != "parse_roundtrip"
}

/// Print, parse, compare with the canonical graph, print again.
fn check_round_trip(g: &Graph) -> Result<(), TestCaseError> {
    let errors = verify(g);
    prop_assert!(errors.is_empty(), "generated graph does not verify: {:?}\n{}", errors.iter().map(ToString::to_string).collect::<Vec<_>>(), print_graph(g));
    let text = print_graph(g);
    let parsed = match parse(&text) {
        Ok((p, _)) => p,
        Err(d) => return Err(TestCaseError::fail(format!("{}\n{text}", titan_ir::diag::render_all(&d, "<printed>", &text)))),
    };
    let mut canon = g.clone();
    canon.canonicalize();
    prop_assert_eq!(&parsed, &canon, "parsed graph differs from the original\n{}", text);
    prop_assert_eq!(print_graph(&parsed), text.clone());
    let verified = parse_and_verify("<printed>", &text).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(&verified, &canon);
    Ok(())
}

#[test]
fn random_graphs_round_trip() {
    if included_elsewhere() {
        return;
    }
    let mut runner = TestRunner::new(Config { cases: 256, failure_persistence: None, ..Config::default() });
    let result = runner.run(&generator::recipe(), |r| check_round_trip(&generator::build(&r)));
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn meta_attributes_round_trip() {
    if included_elsewhere() {
        return;
    }
    let mut runner = TestRunner::new(Config { cases: 256, failure_persistence: None, ..Config::default() });
    let strategy = proptest::collection::vec(generator::attr_value(), 0..8);
    let result = runner.run(&strategy, |values| {
        let mut g = Graph::new("m");
        g.meta = Attrs::new(values.into_iter().enumerate().map(|(i, v)| (format!("key_{i}"), v)).collect());
        check_round_trip(&g)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn every_op_round_trips() {
    if included_elsewhere() {
        return;
    }
    let g = match parse_and_verify("every_op.ir", EVERY_OP) {
        Ok(g) => g,
        Err(e) => panic!("{e}"),
    };
    let printed = print_graph(&g);
    if printed != EVERY_OP {
        let first = printed.lines().zip(EVERY_OP.lines()).position(|(a, b)| a != b);
        panic!("printing changed the text (first differing line {first:?}):\n{printed}");
    }
    let mut names: Vec<&str> = g.blocks.iter().chain([&g.main]).flat_map(|r| r.nodes.iter().map(|n| n.op.name())).collect();
    names.sort_unstable();
    names.dedup();
    let mut all: Vec<&str> = [
        "embedding",
        "linear",
        "rmsnorm",
        "rope",
        "attention",
        "cross_entropy",
        "rmsnorm_bwd",
        "attention_bwd",
        "cross_entropy_bwd",
        "cast",
        "reshape",
        "transpose",
        "slice",
        "concat",
        "broadcast",
        "matmul",
        "gather",
        "scatter_add",
        "constant",
        "lr_schedule",
        "adamw",
        "repeat",
        "reduce_sum",
        "reduce_max",
        "reduce_mean",
        "kernel",
        "all_gather",
        "reduce_scatter",
        "all_reduce",
        "take_shard",
        "place_shard",
        "cross_entropy_stats",
        "cross_entropy_stats_bwd",
        "cross_entropy_combine",
    ]
    .into_iter()
    .chain(UnaryOp::ALL.iter().map(|u| u.name()))
    .chain(BinaryOp::ALL.iter().map(|b| b.name()))
    .collect();
    all.sort_unstable();
    assert_eq!(names, all, "the every-op graph must use each op");
    // Rope with scaling and inverse, and every lr decay, are present.
    let ops: Vec<&Op> = g.blocks.iter().chain([&g.main]).flat_map(|r| r.nodes.iter().map(|n| &n.op)).collect();
    assert!(ops.iter().any(|o| matches!(o, Op::Rope(c) if c.scaling.is_some())));
    assert!(ops.iter().any(|o| matches!(o, Op::Rope(c) if c.inverse)));
    for d in [DecayKind::Constant, DecayKind::Linear, DecayKind::Cosine] {
        assert!(ops.iter().any(|o| matches!(o, Op::LrSchedule(s) if s.decay == d)));
    }
    // Parsing alone (no canonicalization) gives the same graph.
    let parsed = parse(EVERY_OP).map(|(g, _)| g).map_err(|d| format!("{d:?}"));
    assert_eq!(parsed.as_ref(), Ok(&g));
}

#[test]
fn special_spellings_parse() {
    if included_elsewhere() {
        return;
    }
    let src = "// a comment\ngraph @x.y_1 { // trailing comment\n  meta {a = nan, b = 1E3, c = -5, d = [], e = f(), s = \"\\u{1F600}\"}\n  func @main {\n    input %in.put : f32[] #[]\n    %r = neg(%in.put) : f32[]\n    output o = %r\n  }\n}\n";
    let g = match parse_and_verify("special.ir", src) {
        Ok(g) => g,
        Err(e) => panic!("{e}"),
    };
    assert!(g.meta_f64("a").is_some_and(f64::is_nan));
    assert_eq!(g.meta_f64("b"), Some(1000.0));
    assert_eq!(g.meta_i64("c"), Some(-5));
    assert_eq!(g.meta.get("d"), Some(&AttrValue::List(vec![])));
    assert_eq!(g.meta.get("e"), Some(&AttrValue::Call("f".into(), vec![])));
    assert_eq!(g.meta.get("s"), Some(&AttrValue::Str("\u{1F600}".into())));
    assert_eq!(g.name, "x.y_1");
    assert_eq!(g.main.find("in.put"), Some(Value(0)));
    let reparsed: Graph = match print_graph(&g).parse() {
        Ok(g) => g,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(print_graph(&reparsed), print_graph(&g));
}

#[test]
fn forward_references_are_sorted_stably() {
    if included_elsewhere() {
        return;
    }
    let src = "graph @g {\n  func @main {\n    %c = add(%a, %b) : f32[2]\n    %b = exp(%x) : f32[2]\n    input %x : f32[2]\n    %a = neg(%x) : f32[2]\n    output c = %c\n  }\n}\n";
    let g = match parse_and_verify("fwd.ir", src) {
        Ok(g) => g,
        Err(e) => panic!("{e}"),
    };
    let order: Vec<String> = g.main.order.iter().map(|&n| g.main.node(n).op.name().to_string()).collect();
    assert_eq!(order, ["exp", "neg", "add"]);
    assert_eq!(
        print_graph(&g),
        "graph @g {\n\n  func @main {\n    input %x : f32[2]\n    %b = exp(%x) : f32[2]\n    %a = neg(%x) : f32[2]\n    %c = add(%a, %b) : f32[2]\n    output c = %c\n  }\n}\n"
    );
}

#[test]
fn docs_example_round_trips() {
    if included_elsewhere() {
        return;
    }
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/ir.md");
    let doc = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    // The first fenced block of the document is a complete graph.
    let block = doc.split("```").nth(1).unwrap_or_default();
    let src: String = block.lines().skip(1).filter(|l| !l.trim_start().starts_with("//")).map(|l| format!("{l}\n")).collect();
    let g = match parse_and_verify("docs/ir.md", &src) {
        Ok(g) => g,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(print_graph(&g), src, "the docs example is not in canonical form");
}
