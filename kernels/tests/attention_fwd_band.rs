//! The attention forward's grid in bands of (batch, kv head)s, `TITAN_ATT_FWD_BAND=g` at build
//! time (`attention.rs`, `fwd_band`): by default one band over all of them. Its own test binary,
//! so setting the switch cannot change the kernels other tests generate. What the kernels compute
//! is checked on the GPU (`kernels/tests/gpu_check.py` on a `TITAN_GPU_DUMP` made with the
//! switch); here, that it reaches both forwards (warp-specialized at head_dim 128, single
//! warpgroup at 64), that each band gives another kernel, that a band that does not divide
//! `b hkv` (or is not a number) is the default, and that they assemble without spills.

mod common;

use common::{assembled, switch};
use titan_ir::Graph;

/// The causal forward `name` for `shape`: its PTX, assembled by `ptxas` without spills.
fn ptx_of(g: &mut Graph, name: &str, shape: [u64; 5]) -> String {
    let (ptx, spill) = assembled(g, name, shape, true, false);
    assert_eq!(spill, 0, "{name}: spills");
    ptx
}

/// Sets (or with `None` removes) `TITAN_ATT_FWD_BAND`.
fn band(value: Option<&str>) {
    switch("TITAN_ATT_FWD_BAND", value);
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
