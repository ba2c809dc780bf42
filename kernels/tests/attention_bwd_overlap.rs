//! The attention backward's dK/dV consumers with S^T and dP^T overlapped (`TITAN_ATT_BWD_OVERLAP=1`
//! at build time, opt-in: measured and not kept, docs/notes.md session 27): its own test binary,
//! so setting the switch cannot change the kernels other tests generate.

mod common;

use common::attention_body;
use titan_ir::{Graph, KernelKind};
use titan_kernels::{compile_kernel, ptxas_check};

/// The causal kernel `name` for `shape`: its PTX and whether `ptxas` found it clean (no spills).
fn ptx_of(g: &mut Graph, name: &str, shape: [u64; 5]) -> (String, bool) {
    let id = attention_body(g, shape, true, true);
    let k = compile_kernel(g, id, KernelKind::AttentionBwd, name).expect("generates").expect("a kernel");
    let r = ptxas_check(&k.ptx, &k.entry).unwrap_or_else(|e| panic!("{name}: {e}"));
    println!("{name}: {} registers, {} spill stores", r.registers, r.spill_stores);
    (k.ptx, r.problems().is_empty())
}

/// At head_dim 128 the warp-specialized dK/dV consumers (the five-product pass at seq 8192, the
/// seven-product pass at 4096) wait for S^T with dP^T still in flight (`wgmma.wait_group 1`);
/// switched off, or at head_dim 64, every chain is waited for whole. The five-product pass
/// assembles without spills either way (the seven-product one spilled 8 bytes in its copier
/// until session 26 gave it 32 registers; it is not asserted here).
#[test]
fn overlapped_products_at_head_dim_128_only() {
    let mut g = Graph::new("overlap");
    let overlapped = |ptx: &str| ptx.contains("wgmma.wait_group.sync.aligned 1;");
    // SAFETY (of the process environment): this binary's only test; nothing else reads it here.
    unsafe { std::env::set_var("TITAN_ATT_BWD_OVERLAP", "1") };
    let (five, clean) = ptx_of(&mut g, "bwd_ov_8b", [1, 8192, 32, 8, 128]);
    assert!(overlapped(&five) && clean, "five-product pass, head_dim 128: overlapped, no spills");
    let (seven, _) = ptx_of(&mut g, "bwd_ov_8b_4096", [2, 4096, 32, 8, 128]);
    assert!(overlapped(&seven), "seven-product pass, head_dim 128");
    let (d64, clean) = ptx_of(&mut g, "bwd_ov_1b", [1, 8192, 32, 8, 64]);
    assert!(!overlapped(&d64) && clean, "head_dim 64 keeps the products apart");
    // SAFETY: as above.
    unsafe { std::env::remove_var("TITAN_ATT_BWD_OVERLAP") };
    let (off, _) = ptx_of(&mut g, "bwd_8b", [1, 8192, 32, 8, 128]);
    assert!(!overlapped(&off), "off by default");
}
