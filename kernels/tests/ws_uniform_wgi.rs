//! The warp-specialized passes' warpgroup index (`warp_spec::WgIndex`): `tid / 128` is the same
//! in every lane of a warp, but ptxas cannot prove it, so the `wgmma` descriptors built from it
//! live in vector registers and are moved to uniform ones (`R2UR`) before every product; a
//! `shfl.sync.idx` from lane 0 tells it. The backward's passes broadcast, the forward divides
//! (measured, session 31); `TITAN_WS_WGI=shfl` / `tid` at build time forces either everywhere.
//! Its own test binary, so setting the switch cannot change the kernels other tests generate.
//! What the kernels compute is checked on the GPU (`kernels/tests/gpu_check.py` on a
//! `TITAN_GPU_DUMP`); here, which passes broadcast by default, that the switch reaches the
//! warp-specialized passes (the forward at head_dim 128, the five-product and warp-specialized
//! backward) and no other, and that every variant assembles with no `wgmma` serialized and at
//! most 16 bytes spilled.

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
/// warp specialization: 1B's forward and the head_dim 64 backward at seq 2048. Each case: its
/// name, shape, backward or not, and whether it is warp-specialized.
const CASES: [(&str, [u64; 5], bool, bool); 5] = [
    ("fwd_8b", [1, 8192, 32, 8, 128], false, true),
    ("bwd_8b", [1, 8192, 32, 8, 128], true, true),
    ("bwd_1b", [1, 8192, 32, 8, 64], true, true),
    ("fwd_1b", [1, 8192, 32, 8, 64], false, false),
    ("bwd_2048_d64", [4, 2048, 64, 16, 64], true, false),
];

/// Every case's PTX with `TITAN_WS_WGI` set to `value`.
fn build(g: &mut Graph, value: Option<&str>) -> Vec<String> {
    switch(value);
    let ptx = CASES.iter().map(|(n, s, bwd, _)| ptx_of(g, n, *s, *bwd)).collect();
    switch(None);
    ptx
}

fn broadcasts(ptx: &str) -> usize {
    ptx.matches("shfl.sync.idx.b32").count()
}

/// The default is the forced broadcast in the warp-specialized backward passes and the forced
/// division everywhere else; forcing changes exactly the warp-specialized passes, by one
/// broadcast.
#[test]
fn the_backward_broadcasts_and_the_switch_reaches_the_warp_specialized_passes_only() {
    let mut g = Graph::new("wgi");
    let default = build(&mut g, None);
    let shfl = build(&mut g, Some("shfl"));
    let tid = build(&mut g, Some("tid"));
    for (k, (name, _, bwd, ws)) in CASES.iter().enumerate() {
        let broadcast_default = *bwd && *ws;
        assert_eq!(default[k] == shfl[k], broadcast_default || !ws, "{name}: default against shfl");
        assert_eq!(default[k] == tid[k], !broadcast_default, "{name}: default against tid");
        assert_eq!(broadcasts(&shfl[k]), broadcasts(&tid[k]) + usize::from(*ws), "{name}: shfl against tid");
    }
}
