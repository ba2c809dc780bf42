//! What the attention test binaries that set build-time switches share (each switch gets a
//! binary of its own, so setting it cannot change the kernels other tests generate).

use titan_ir::{ArgKind, BlockId, Builder, DType, Graph, Op, Output, Region, TensorType};

/// A block of one causal-or-not attention op over bf16 `[b, s, h, d]` tensors (`hq` query
/// heads, `hkv` kv heads, scale `1 / sqrt(d)`): the forward (q, k, v) or, with `bwd`, the
/// backward (q, k, v, out, lse, d_out).
pub fn attention_body(g: &mut Graph, [b, s, hq, hkv, d]: [u64; 5], causal: bool, bwd: bool) -> BlockId {
    let scale = 1.0 / (d as f64).sqrt();
    let q = TensorType::fixed(DType::BF16, &[b, s, hq, d]);
    let kv = TensorType::fixed(DType::BF16, &[b, s, hkv, d]);
    let mut args = vec![q.clone(), kv.clone(), kv];
    if bwd {
        args.extend([q.clone(), TensorType::fixed(DType::F32, &[b, hq, s]), q]);
    }
    let mut r = Region::new(if bwd { "attn_bwd" } else { "attn_fwd" });
    let a: Vec<_> = args.into_iter().map(|t| r.add_arg(t, ArgKind::Block, None)).collect();
    let outs = {
        let mut bd = Builder::new(&mut r, &g.dims, &g.blocks);
        let op = if bwd { Op::AttentionBwd { causal, scale } } else { Op::Attention { causal, scale } };
        bd.push(op, &a).expect("attention")
    };
    r.outputs = outs.into_iter().map(|value| Output { name: None, value }).collect();
    g.add_block(r)
}
