//! The attention kernels' exponentials and the dK/dV passes' causal mask: by default every
//! exponential is `ex2.approx.ftz.f32`; the build-time switches `TITAN_ATT_FWD_EX2=full` (the
//! forward's softmax) and `TITAN_ATT_BWD_EX2=full` (the backward's recomputed P) go back to
//! `ex2.approx.f32`, and `TITAN_ATT_BWD_MASK=diag` makes the dK/dV consumers mask only the
//! tiles that cross the diagonal, in a warp-uniform branch (`all`, every tile, the default). Its
//! own test binary, so setting the switches cannot change the kernels other tests generate.
//! What the kernels compute is checked on the GPU (`kernels/tests/gpu_check.py` on a
//! `TITAN_GPU_DUMP` made with the switches); here, that each switch reaches the kernels it names
//! and no other, and that they still assemble with no `wgmma` serialized.

mod common;

use common::{assembled, switch};
use titan_ir::Graph;

/// The attention kernel `name` for `shape` (the backward's passes with `bwd`): its PTX.
fn ptx_of(g: &mut Graph, name: &str, shape: [u64; 5], causal: bool, bwd: bool) -> String {
    assembled(g, name, shape, causal, bwd).0
}

/// How many exponentials of each form the PTX has: (`ex2.approx.f32`, `ex2.approx.ftz.f32`).
fn ex2_forms(ptx: &str) -> (usize, usize) {
    (ptx.matches("ex2.approx.f32 ").count(), ptx.matches("ex2.approx.ftz.f32 ").count())
}

/// The forward (8B's heads, warp-specialized; Llama-3.2 1B's, single warpgroup) and the
/// backward (8B's five-product pass; head_dim 64 at seq 2048, single warpgroup), causal, and
/// the backward without the mask.
#[test]
fn ex2_and_mask_switches_reach_their_kernels() {
    let mut g = Graph::new("ex2");
    let fwd = [("fwd_8b", [1, 8192, 32, 8, 128]), ("fwd_1b", [1, 8192, 32, 8, 64])];
    let bwd = [("bwd_8b", [1, 8192, 32, 8, 128], true), ("bwd_2048_d64", [4, 2048, 64, 16, 64], true), ("bwd_full", [1, 512, 4, 4, 128], false)];
    let build = |g: &mut Graph| -> (Vec<String>, Vec<String>) {
        let f = fwd.iter().map(|(n, s)| ptx_of(g, n, *s, true, false)).collect();
        let b = bwd.iter().map(|(n, s, c)| ptx_of(g, n, *s, *c, true)).collect();
        (f, b)
    };
    for key in ["TITAN_ATT_FWD_EX2", "TITAN_ATT_BWD_EX2", "TITAN_ATT_BWD_MASK"] {
        switch(key, None);
    }
    let (f0, b0) = build(&mut g);
    for ptx in f0.iter().chain(&b0) {
        let (full, ftz) = ex2_forms(ptx);
        assert!(full == 0 && ftz > 0, "default: ex2.approx.ftz.f32 only ({full}, {ftz})");
    }

    switch("TITAN_ATT_FWD_EX2", Some("full"));
    let (f1, b1) = build(&mut g);
    for (n, ptx) in f1.iter().enumerate() {
        let (full, ftz) = ex2_forms(ptx);
        assert!(ftz == 0 && full == ex2_forms(&f0[n]).1, "{}: no exponential flushes ({full}, {ftz})", fwd[n].0);
    }
    assert_eq!(b1, b0, "the forward's switch leaves the backward alone");
    switch("TITAN_ATT_FWD_EX2", None);

    switch("TITAN_ATT_BWD_EX2", Some("full"));
    let (f2, b2) = build(&mut g);
    assert_eq!(f2, f0, "the backward's switch leaves the forward alone");
    for (n, ptx) in b2.iter().enumerate() {
        let (full, ftz) = ex2_forms(ptx);
        assert!(ftz == 0 && full == ex2_forms(&b0[n]).1, "{}: no exponential flushes ({full}, {ftz})", bwd[n].0);
    }
    switch("TITAN_ATT_BWD_EX2", None);

    switch("TITAN_ATT_BWD_MASK", Some("diag"));
    let (f3, b3) = build(&mut g);
    assert_eq!(f3, f0, "the mask switch leaves the forward alone");
    for (n, (name, _, causal)) in bwd.iter().enumerate() {
        if *causal {
            assert_ne!(b3[n], b0[n], "{name}: the causal dK/dV pass masks in a branch");
            assert_eq!(ex2_forms(&b3[n]), ex2_forms(&b0[n]), "{name}");
        } else {
            assert_eq!(b3[n], b0[n], "{name}: nothing to mask without causality");
        }
    }
    switch("TITAN_ATT_BWD_MASK", Some("all"));
    let (_, b4) = build(&mut g);
    assert_eq!(b4, b0, "`all` is the default");
    switch("TITAN_ATT_BWD_MASK", None);
}
