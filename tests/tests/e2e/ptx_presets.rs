//! Every PTX file `titanc build` emits for the debug and the 8B presets (real dims: dim 4096,
//! ffn 14336, vocab 128256, seq 8192) is assembled by ptxas for sm_90a. Prints registers,
//! spills and shared memory per kernel; fails on any ptxas error, any local-memory spill or any
//! kernel whose `wgmma`s ptxas serialized. (The 8B attention backward's 16 bytes allowed in
//! sessions 28-30 went with the warpgroup index broadcast, `warp_spec::WgIndex`.)
//! ptxas comes from PyPI (`pip install nvidia-cuda-nvcc`, done by scripts/setup.sh); a missing
//! ptxas fails the test rather than skipping it.

use titan_compiler::build::{BuildOptions, compile_artifact};
use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::print::print_graph;
use titan_kernels::find_ptxas;

/// The build assembles every kernel with `ptxas -v` once (or takes the cubin and its report from
/// the cubin cache, keyed by ptxas's version and the PTX): its reports are what is checked.
fn assemble_preset(preset: Preset) {
    assert!(find_ptxas().is_some(), "ptxas not found: run scripts/setup.sh or `pip install nvidia-cuda-nvcc`, or set TITAN_PTXAS");
    let model = build_llama3(&LlamaConfig::preset(preset), &format!("llama3_{}", preset.name())).expect("model");
    let text = print_graph(&model);
    let (artifact, summary) = compile_artifact(&model, &text, &BuildOptions::default()).expect("build");
    assert!(summary.notes.iter().all(|n| !n.contains("cubin")), "ptxas rejected kernels: {:?}", summary.notes);
    let mut failures = Vec::new();
    println!("{:<44} {:>5} {:>7} {:>7} {:>7}", format!("{} kernel", preset.name()), "regs", "st-spl", "ld-spl", "smem");
    for (k, r) in &summary.ptxas_reports {
        println!("{:<44} {:>5} {:>7} {:>7} {:>7}", k, r.registers, r.spill_stores, r.spill_loads, r.shared_bytes);
        failures.extend(r.problems().into_iter().map(|p| format!("{k}: {p}")));
    }
    // The training step's kernels and the eval step's (validation), which ship PTX too.
    let eval = artifact.manifest.eval.iter().flat_map(|e| &e.kernels);
    let with_ptx = artifact.manifest.kernels.iter().chain(eval).filter(|k| k.ptx.is_some()).count();
    assert_eq!(summary.ptxas_reports.len(), with_ptx, "every kernel with PTX was assembled");
    assert_eq!(with_ptx, artifact.ptx.len(), "every emitted PTX file belongs to a kernel");
    assert!(with_ptx >= 30, "expected the generated kernels of a whole training step, found {with_ptx}");
    assert!(failures.is_empty(), "ptxas problems:\n{}", failures.join("\n"));
}

#[test]
fn debug_preset_ptx_assembles_without_spills() {
    assemble_preset(Preset::Debug);
}

#[test]
fn b8_preset_ptx_assembles_without_spills() {
    assemble_preset(Preset::B8);
}
