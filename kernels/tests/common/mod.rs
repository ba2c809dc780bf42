//! What the attention test binaries that set build-time switches share (each switch gets a
//! binary of its own, so setting it cannot change the kernels other tests generate).
// Each binary uses what it needs of this module.
#![allow(dead_code)]

use titan_ir::{ArgKind, BlockId, Builder, DType, Graph, KernelKind, Op, Output, Region, TensorType};
use titan_kernels::{compile_kernel, ptxas_check};

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

/// The attention kernel `name` for `shape` (causal or not; the backward's passes with `bwd`):
/// its PTX and the most bytes `ptxas` spilled (stored or loaded) in any of its entries, the
/// prologue's and epilogue's too. Panics where an entry does not assemble or serializes a `wgmma`.
pub fn assembled(g: &mut Graph, name: &str, shape: [u64; 5], causal: bool, bwd: bool) -> (String, u64) {
    let id = attention_body(g, shape, causal, bwd);
    let kind = if bwd { KernelKind::AttentionBwd } else { KernelKind::Attention };
    let k = compile_kernel(g, id, kind, name).expect("generates").expect("a kernel");
    let mut spill = 0;
    for entry in std::iter::once(&k.entry).chain(k.prologue.as_ref().map(|p| &p.entry)).chain(k.epilogue.as_ref().map(|p| &p.entry)) {
        let r = ptxas_check(&k.ptx, entry).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!r.wgmma_serialized, "{name} {entry}: wgmma serialized");
        spill = spill.max(r.spill_stores).max(r.spill_loads);
    }
    (k.ptx, spill)
}

/// Sets (or with `None` removes) the build-time switch `key`.
pub fn switch(key: &str, value: Option<&str>) {
    // SAFETY (of the process environment): each binary using this has one test; nothing else
    // reads the environment there.
    unsafe {
        match value {
            Some(v) => std::env::set_var(key, v),
            None => std::env::remove_var(key),
        }
    }
}
