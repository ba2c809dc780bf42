//! The attention forward's grid in bands of (batch, kv head)s, `TITAN_ATT_FWD_BAND=g` at build
//! time (`attention.rs`, `fwd_band`): by default one band over all of them. Its own test binary,
//! so setting the switch cannot change the kernels other tests generate. What the kernels compute
//! is checked on the GPU (`kernels/tests/gpu_check.py` on a `TITAN_GPU_DUMP` made with the
//! switch); here, that it reaches both forwards (warp-specialized at head_dim 128, single
//! warpgroup at 64), that each band gives another kernel, that a band that does not divide
//! `b hkv` (or is not a number) is the default, and that they assemble without spills.

mod common;

use common::attention_body;
use titan_ir::{Graph, KernelKind};
use titan_kernels::{compile_kernel, ptxas_check};

/// The causal forward `name` for `shape`: its PTX, each entry assembled by `ptxas` without
/// spills or a serialized `wgmma`.
fn ptx_of(g: &mut Graph, name: &str, shape: [u64; 5]) -> String {
    let id = attention_body(g, shape, true, false);
    let k = compile_kernel(g, id, KernelKind::Attention, name).expect("generates").expect("a kernel");
    let r = ptxas_check(&k.ptx, &k.entry).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert!(!r.wgmma_serialized && r.spill_stores == 0 && r.spill_loads == 0, "{name}: {:?}", r.problems());
    k.ptx
}

/// Sets (or with `None` removes) the build-time switch.
fn band(value: Option<&str>) {
    // SAFETY (of the process environment): this binary's only test; nothing else reads it here.
    unsafe {
        match value {
            Some(v) => std::env::set_var("TITAN_ATT_FWD_BAND", v),
            None => std::env::remove_var("TITAN_ATT_FWD_BAND"),
        }
    }
}

/// 8B's heads (8 kv heads) at seq 8192 and Llama-3.2 1B's at seq 4096 batch 2 (16 (batch, kv
/// head)s), under bands of 1, 2 and 4, then settings that are the default.
#[test]
fn bands_reach_both_forwards() {
    let mut g = Graph::new("fwd_band");
    let shapes = [("fwd_8b", [1, 8192, 32, 8, 128]), ("fwd_1b_b2", [2, 4096, 32, 8, 64])];
    let build = |g: &mut Graph| -> Vec<String> { shapes.iter().map(|(n, s)| ptx_of(g, n, *s)).collect() };
    band(None);
    let default = build(&mut g);
    let mut seen = vec![default.clone()];
    for gs in ["1", "2", "4"] {
        band(Some(gs));
        let ptx = build(&mut g);
        for (i, earlier) in seen.iter().enumerate() {
            for (k, (name, _)) in shapes.iter().enumerate() {
                assert_ne!(earlier[k], ptx[k], "{name}: band {gs} gives setting {i}'s kernel");
            }
        }
        seen.push(ptx);
    }
    // 8 and 16 are every (batch, kv head) of one shape; 3 divides neither; `x` is no number.
    for (gs, same) in [("3", [true, true]), ("x", [true, true]), ("8", [true, false]), ("16", [true, true])] {
        band(Some(gs));
        let ptx = build(&mut g);
        for (k, (name, _)) in shapes.iter().enumerate() {
            assert_eq!(ptx[k] == default[k], same[k], "{name}: band {gs}");
        }
    }
    band(None);
}
