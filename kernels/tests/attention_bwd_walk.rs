//! The order of the attention backward's dK/dV passes (`attention_bwd.rs`, `Order`): by default
//! one band walked up below seq 4096, bands of about one wave walked down from it; the
//! build-time switches `TITAN_ATT_BWD_WALK=up|down|down-heads-inner` and
//! `TITAN_ATT_BWD_BAND=all|wave|g` for comparison. Its own test binary, so setting the switches
//! cannot change the kernels other tests generate. What the kernels compute is checked on the
//! GPU (`kernels/tests/gpu_check.py` on a `TITAN_GPU_DUMP` made with the switches); here, that
//! each switch reaches every dK/dV pass, that each setting gives a different kernel, that they
//! still assemble (without spills but a few registers of the head_dim 64 five-product pass),
//! that a band that does not divide the kv heads is ignored, that `wave` picks the band
//! nearest one wave of CTAs, and which settings the default is at each shape.

mod common;

use common::{assembled, switch};
use titan_ir::Graph;

/// The causal backward `name` for `shape`: its PTX and the most bytes spilled in an entry.
fn ptx_of(g: &mut Graph, name: &str, shape: [u64; 5]) -> (String, u64) {
    assembled(g, name, shape, true, true)
}

/// The five-product pass (8B's and Llama-3.2 1B's heads at seq 8192), the warp-specialized
/// seven-product pass (head_dim 128, seq 4096) and the single-warpgroup one (head_dim 64, seq
/// 2048), under each setting.
#[test]
fn walks_and_bands_reach_every_dkdv_pass() {
    let mut g = Graph::new("walk");
    let shapes =
        [("bwd_8b", [1, 8192, 32, 8, 128]), ("bwd_1b", [1, 8192, 32, 8, 64]), ("bwd_4096", [2, 4096, 32, 8, 128]), ("bwd_2048_d64", [4, 2048, 64, 16, 64])];
    let settings = [("up", "all"), ("down", "all"), ("down-heads-inner", "all"), ("up", "2"), ("down-heads-inner", "4"), ("down", "wave")];
    let mut seen: Vec<Vec<String>> = Vec::new();
    for (walk, band) in settings {
        switch("TITAN_ATT_BWD_WALK", Some(walk));
        switch("TITAN_ATT_BWD_BAND", Some(band));
        let ptx: Vec<String> = shapes
            .iter()
            .map(|(name, shape)| {
                let (ptx, spill) = ptx_of(&mut g, name, *shape);
                // The head_dim 64 five-product pass (1B) with the warpgroup index broadcast
                // (`warp_spec::WgIndex`, session 31): 16 bytes walked down (the default, measured
                // 8% faster than the unspilled pass with the index divided), more walked up.
                // The 8B pass no longer spills (12-16 bytes walked down before the broadcast).
                let allowed = match (*name, walk, band) {
                    ("bwd_1b", "down", _) => 16,
                    ("bwd_1b", "up", "all") => 32,
                    ("bwd_1b", "up", _) => 48,
                    _ => 0,
                };
                assert!(spill <= allowed, "{name}: {spill} bytes spilled with walk {walk}, band {band}");
                ptx
            })
            .collect();
        for (i, earlier) in seen.iter().enumerate() {
            for (k, (name, _)) in shapes.iter().enumerate() {
                assert!(earlier[k] != ptx[k], "{name}: walk {walk}, band {band} gives setting {i}'s kernel");
            }
        }
        seen.push(ptx);
    }
    // The default: bands of about a wave walked down from seq 4096, one band walked up below.
    switch("TITAN_ATT_BWD_WALK", None);
    switch("TITAN_ATT_BWD_BAND", None);
    for (k, (name, shape)) in shapes.iter().enumerate() {
        let expect = if shape[1] >= 4096 { 5 } else { 0 };
        assert!(ptx_of(&mut g, name, *shape).0 == seen[expect][k], "{name}: the default is setting {expect}");
    }
    // 8 kv heads of batch 1: a band of 3 does not divide them, so the grid stays one band.
    switch("TITAN_ATT_BWD_WALK", Some("up"));
    switch("TITAN_ATT_BWD_BAND", Some("3"));
    assert!(ptx_of(&mut g, "bwd_8b", shapes[0].1).0 == seen[0][0], "a band of 3 ignored");
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
