//! The attention backward's dK/dV passes with their query tiles walked another way
//! (`TITAN_ATT_BWD_WALK=down|down-heads-inner` at build time) or their grid in bands of kv heads
//! (`TITAN_ATT_BWD_BAND=g|wave`): its own test binary, so setting the switches cannot change the
//! kernels other tests generate. What the kernels compute is checked on the GPU
//! (`kernels/tests/gpu_check.py` on a `TITAN_GPU_DUMP` made with the switches); here, that each
//! switch reaches every dK/dV pass, that each setting gives a different kernel, that they still
//! assemble without spills, that a band that does not divide the kv heads is ignored, and that
//! `wave` picks the band nearest one wave of CTAs.

mod common;

use common::attention_body;
use titan_ir::{Graph, KernelKind};
use titan_kernels::{compile_kernel, ptxas_check};

/// The causal backward `name` for `shape`: its PTX and whether `ptxas` found it clean.
fn ptx_of(g: &mut Graph, name: &str, shape: [u64; 5]) -> (String, bool) {
    let id = attention_body(g, shape, true, true);
    let k = compile_kernel(g, id, KernelKind::AttentionBwd, name).expect("generates").expect("a kernel");
    let r = ptxas_check(&k.ptx, &k.entry).unwrap_or_else(|e| panic!("{name}: {e}"));
    (k.ptx, r.problems().is_empty())
}

/// Sets (or with `None` removes) the build-time switch `key`.
fn switch(key: &str, value: Option<&str>) {
    // SAFETY (of the process environment): this binary's only test; nothing else reads it here.
    unsafe {
        match value {
            Some(v) => std::env::set_var(key, v),
            None => std::env::remove_var(key),
        }
    }
}

/// The five-product pass (8B's and Llama-3.2 1B's heads at seq 8192), the warp-specialized
/// seven-product pass (head_dim 128, seq 4096) and the single-warpgroup one (head_dim 64, seq
/// 2048), under each setting: all different from each other, all clean. (`down` with a band
/// spills 4 bytes in the 8B shape's five-product pass, so the band is tried with
/// `down-heads-inner` here.)
#[test]
fn walks_and_bands_reach_every_dkdv_pass() {
    let mut g = Graph::new("walk");
    let shapes =
        [("bwd_8b", [1, 8192, 32, 8, 128]), ("bwd_1b", [1, 8192, 32, 8, 64]), ("bwd_4096", [2, 4096, 32, 8, 128]), ("bwd_2048_d64", [4, 2048, 64, 16, 64])];
    let settings = [(None, None), (Some("down"), None), (Some("down-heads-inner"), None), (None, Some("2")), (Some("down-heads-inner"), Some("4"))];
    let mut seen: Vec<Vec<String>> = Vec::new();
    for (walk, band) in settings {
        switch("TITAN_ATT_BWD_WALK", walk);
        switch("TITAN_ATT_BWD_BAND", band);
        let ptx: Vec<String> = shapes
            .iter()
            .map(|(name, shape)| {
                let (ptx, clean) = ptx_of(&mut g, name, *shape);
                assert!(clean, "{name}: spills with walk {walk:?}, band {band:?}");
                ptx
            })
            .collect();
        for (i, earlier) in seen.iter().enumerate() {
            for (k, (name, _)) in shapes.iter().enumerate() {
                assert_ne!(earlier[k], ptx[k], "{name}: walk {walk:?}, band {band:?} gives setting {i}'s kernel");
            }
        }
        seen.push(ptx);
    }
    // 8 kv heads of batch 1: a band of 3 does not divide them, so the grid stays as it is.
    switch("TITAN_ATT_BWD_WALK", None);
    switch("TITAN_ATT_BWD_BAND", Some("3"));
    assert_eq!(ptx_of(&mut g, "bwd_8b", shapes[0].1).0, seen[0][0], "a band of 3 ignored");
    // `wave`: the band nearest one wave of 132 CTAs: 2 kv heads at seq 8192 (64 tiles of 128
    // keys each), 4 at seq 4096 (32 tiles) and at seq 2048 with head_dim 64 (the
    // single-warpgroup pass: 32 tiles of 64 keys).
    switch("TITAN_ATT_BWD_WALK", Some("down-heads-inner"));
    let wave_as = [("2", &shapes[0]), ("2", &shapes[1]), ("4", &shapes[2]), ("4", &shapes[3])];
    for (band, (name, shape)) in wave_as {
        switch("TITAN_ATT_BWD_BAND", Some("wave"));
        let wave = ptx_of(&mut g, name, *shape);
        switch("TITAN_ATT_BWD_BAND", Some(band));
        assert!(wave == ptx_of(&mut g, name, *shape), "{name}: a wave is not a band of {band}");
    }
    switch("TITAN_ATT_BWD_WALK", None);
    switch("TITAN_ATT_BWD_BAND", None);
}
