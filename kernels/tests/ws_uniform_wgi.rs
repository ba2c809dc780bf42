//! The warp-specialized passes' warpgroup index broadcast from lane 0 (`TITAN_WS_WGI=shfl` at
//! build time, `warp_spec::ws_split_regs`): `tid / 128` is the same in every lane of a warp, but
//! ptxas cannot prove it, so the `wgmma` descriptors built from it live in vector registers and
//! are moved to uniform ones (`R2UR`) before every product; the `shfl.sync.idx` tells it. Its
//! own test binary, so setting the switch cannot change the kernels other tests generate. What
//! the kernels compute is checked on the GPU (`kernels/tests/gpu_check.py` on a
//! `TITAN_GPU_DUMP` made with the switch); here, that it reaches the warp-specialized passes
//! (the forward at head_dim 128, the five-product and warp-specialized backward) and no other,
//! and that they assemble with no `wgmma` serialized and at most 16 bytes spilled.

mod common;

use common::assembled;
use titan_ir::Graph;

/// The causal attention kernel `name` for `shape` (the backward's passes with `bwd`): its PTX,
/// every entry assembled with at most 16 bytes spilled.
fn ptx_of(g: &mut Graph, name: &str, shape: [u64; 5], bwd: bool) -> String {
    let (ptx, spill) = assembled(g, name, shape, true, bwd);
    assert!(spill <= 16, "{name}: {spill} bytes spilled");
    ptx
}

/// Sets (or with `None` removes) `TITAN_WS_WGI`.
fn switch(value: Option<&str>) {
    common::switch("TITAN_WS_WGI", value);
}

/// 8B's forward and backward at seq 8192 (warp-specialized forward, five-product backward),
/// Llama-3.2 1B's backward at seq 8192 (warp-specialized, head_dim 64), and two passes without
/// warp specialization: 1B's forward and the head_dim 64 backward at seq 2048.
#[test]
fn the_switch_reaches_the_warp_specialized_passes_only() {
    let mut g = Graph::new("wgi");
    let cases = [
        ("fwd_8b", [1, 8192, 32, 8, 128], false, true),
        ("bwd_8b", [1, 8192, 32, 8, 128], true, true),
        ("bwd_1b", [1, 8192, 32, 8, 64], true, true),
        ("fwd_1b", [1, 8192, 32, 8, 64], false, false),
        ("bwd_2048_d64", [4, 2048, 64, 16, 64], true, false),
    ];
    let build = |g: &mut Graph| -> Vec<String> { cases.iter().map(|(n, s, bwd, _)| ptx_of(g, n, *s, *bwd)).collect() };
    let broadcasts = |ptx: &str| ptx.matches("shfl.sync.idx.b32").count();
    switch(None);
    let default = build(&mut g);
    for (value, on) in [("shfl", true), ("tid", false)] {
        switch(Some(value));
        let ptx = build(&mut g);
        for (k, (name, _, _, ws)) in cases.iter().enumerate() {
            let reaches = on && *ws;
            assert_eq!(ptx[k] != default[k], reaches, "{name}: TITAN_WS_WGI={value}");
            assert_eq!(broadcasts(&ptx[k]), broadcasts(&default[k]) + usize::from(reaches), "{name}: TITAN_WS_WGI={value}");
        }
    }
    switch(None);
}
