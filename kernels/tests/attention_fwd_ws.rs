//! The warp-specialized attention forward, forced on (`TITAN_ATT_FWD_WS=1` at build time) at
//! every shape it can run, then off: its own test binary, so setting the switch cannot change
//! the kernels other tests generate.

mod common;

use common::attention_body;
use titan_ir::{Graph, KernelKind};
use titan_kernels::{compile_kernel, ptxas_check};

/// One CTA of three warpgroups per 128 queries: a ring of K/V stages behind `mbarrier`s (a full
/// and an empty one per stage), registers moved from the copying warpgroup to the two computing
/// ones, no CTA-wide barrier after the split, every product on `wgmma` (Q from registers at
/// head_dim 64, from shared memory at 128), assembled by `ptxas` without spills.
#[test]
fn warp_specialized_forward_structure() {
    // SAFETY (of the process environment): this binary's only test; nothing else reads it here.
    unsafe { std::env::set_var("TITAN_ATT_FWD_WS", "1") };
    let mut g = Graph::new("fwd_ws");
    for (name, shape, causal) in [
        ("fwd_ws_gqa_causal", [2, 256, 8, 2, 128], true),
        ("fwd_ws_8b", [1, 8192, 32, 8, 128], true),
        ("fwd_ws_full", [1, 512, 4, 4, 128], false),
        ("fwd_ws_d64_causal", [2, 256, 8, 2, 64], true),
        ("fwd_ws_1b", [1, 8192, 32, 8, 64], true),
        ("fwd_ws_d64_full", [1, 384, 4, 4, 64], false),
    ] {
        let id = attention_body(&mut g, shape, causal, false);
        let k = compile_kernel(&g, id, KernelKind::Attention, name).expect("generates").expect("a kernel");
        let [b, s, hq, _, d] = shape;
        assert_eq!(k.launch.block, [384, 1, 1], "{name}");
        assert_eq!(k.launch.grid, [(s / 128 * b * hq) as u32, 1, 1], "{name}");
        assert!(k.prologue.is_none() && k.epilogue.is_none() && k.workspace_bytes == 0, "{name}");
        // Stages of a 128-key K and V tile each (3 of 64 KB at head_dim 128, 6 of 32 KB at 64),
        // Q's 128 rows at head_dim 128 (32 KB), then two barriers a stage.
        let stages = if d == 128 { 3 } else { 6 };
        let q = if d == 128 { 2 * 128 * d } else { 0 };
        assert_eq!(k.launch.shared_bytes as u64, stages * (2 * 2 * 128 * d + 16) + q, "{name}");
        let r = ptxas_check(&k.ptx, &k.entry).unwrap_or_else(|e| panic!("{name}: {e}"));
        println!("{name}: {} registers, {} spill stores, {} spill loads", r.registers, r.spill_stores, r.spill_loads);
        assert!(r.problems().is_empty(), "{name}: {:?}", r.problems());
        let ptx = &k.ptx;
        assert_eq!(ptx.matches("mbarrier.init.shared::cta.b64").count(), 2 * stages as usize, "{name}");
        assert!(ptx.contains("setmaxnreg.inc.sync.aligned.u32 232;") && ptx.contains("setmaxnreg.dec.sync.aligned.u32 32;"), "{name}");
        // One CTA-wide barrier, after the barriers' initialization and before the roles split;
        // then the ping-pong's named barriers of 256 threads: a turn waited for before the first
        // tile, in the loop and before the last P V, passed on after each and once up front.
        assert_eq!(ptx.matches("bar.sync").count() + ptx.matches("barrier.sync").count(), 4, "{name}");
        assert_eq!(ptx.matches("bar.sync \t0;").count(), 1, "{name}");
        assert_eq!(ptx.matches("bar.sync %r").count(), 3, "{name}");
        assert_eq!(ptx.matches("bar.arrive %r").count(), 4, "{name}");
        // S = Q K^T with Q in registers over 128 keys (m64n128), O += P V over head_dim (V
        // MN-major).
        assert!(ptx.contains("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"), "{name}");
        assert!(ptx.contains(&format!("wgmma.mma_async.sync.aligned.m64n{d}k16.f32.bf16.bf16")), "{name}");
        // Q read by the consumers from global memory (register fragments) only at head_dim 64;
        // at 128 the copier brings it with the first tile.
        assert_eq!(ptx.contains("ld.global"), d == 64, "{name}");
        // O's rescale skipped where no row of a warp moved its max: one vote a tile.
        assert_eq!(ptx.matches("vote.sync.any.pred").count(), 1, "{name}");
        assert!(ptx.contains("cp.async.cg.shared.global") || ptx.contains("cp.async.ca.shared.global"), "{name}: the producer copies");
    }
    // Where it cannot run (a sequence not a multiple of 128), and switched off: the
    // single-warpgroup kernel.
    let id = attention_body(&mut g, [1, 192, 4, 4, 128], true, false);
    let k = compile_kernel(&g, id, KernelKind::Attention, "fwd_192").expect("generates").expect("a kernel");
    assert_eq!(k.launch.block, [128, 1, 1]);
    assert_eq!(k.ptx.matches("vote.sync.any.pred").count(), 1, "the single-warpgroup kernel skips the rescale too");
    // SAFETY: as above.
    unsafe { std::env::set_var("TITAN_ATT_FWD_WS", "0") };
    let id = attention_body(&mut g, [1, 8192, 32, 8, 128], true, false);
    let k = compile_kernel(&g, id, KernelKind::Attention, "fwd_8b").expect("generates").expect("a kernel");
    assert_eq!((k.launch.block, k.launch.grid), ([128, 1, 1], [8192 / 64 * 32, 1, 1]));
    // By default: head_dim 128 from sequence 2048 on (Llama-3 8B's shape), not at 1024 or at 64.
    // SAFETY: as above.
    unsafe { std::env::remove_var("TITAN_ATT_FWD_WS") };
    for (shape, block) in [([1, 8192, 32, 8, 128], 384), ([4, 2048, 32, 8, 128], 384), ([8, 1024, 32, 8, 128], 128), ([1, 8192, 32, 8, 64], 128)] {
        let id = attention_body(&mut g, shape, true, false);
        let k = compile_kernel(&g, id, KernelKind::Attention, "fwd_default").expect("generates").expect("a kernel");
        assert_eq!(k.launch.block, [block, 1, 1], "{shape:?}");
    }
}
