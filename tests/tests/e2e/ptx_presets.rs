//! Every PTX file `titanc build` emits for the debug and the 8B presets (real dims: dim 4096,
//! ffn 14336, vocab 128256, seq 8192) is assembled by ptxas for sm_90a. Prints registers,
//! spills and shared memory per kernel; fails on any ptxas error or any local-memory spill.
//! ptxas comes from PyPI (`pip install nvidia-cuda-nvcc`, done by scripts/setup.sh); a missing
//! ptxas fails the test rather than skipping it.

use titan_compiler::build::{BuildOptions, compile_artifact};
use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::print::print_graph;
use titan_kernels::{find_ptxas, ptxas_check};

fn assemble_preset(preset: Preset) {
    assert!(find_ptxas().is_some(), "ptxas not found: run scripts/setup.sh or `pip install nvidia-cuda-nvcc`, or set TITAN_PTXAS");
    let model = build_llama3(&LlamaConfig::preset(preset), &format!("llama3_{}", preset.name())).expect("model");
    let text = print_graph(&model);
    let (artifact, _) = compile_artifact(&model, &text, &BuildOptions::default()).expect("build");
    let mut checked = 0;
    let mut failures = Vec::new();
    println!("{:<44} {:>5} {:>7} {:>7} {:>7}", format!("{} kernel", preset.name()), "regs", "st-spl", "ld-spl", "smem");
    // The training step's kernels and the eval step's (validation), which ship PTX too.
    let eval = artifact.manifest.eval.iter().flat_map(|e| &e.kernels);
    for k in artifact.manifest.kernels.iter().chain(eval) {
        let (Some(path), Some(entry)) = (&k.ptx, &k.entry) else { continue };
        let ptx = &artifact.ptx.iter().find(|(p, _)| p == path).unwrap_or_else(|| panic!("{path} listed in the manifest but not emitted")).1;
        match ptxas_check(ptx, entry) {
            Ok(r) => {
                println!("{:<44} {:>5} {:>7} {:>7} {:>7}", k.name, r.registers, r.spill_stores, r.spill_loads, r.shared_bytes);
                if r.spill_stores > 0 || r.spill_loads > 0 {
                    failures.push(format!("{}: {} spill stores, {} spill loads", k.name, r.spill_stores, r.spill_loads));
                }
            }
            Err(e) => failures.push(format!("{}: {e}", k.name)),
        }
        checked += 1;
    }
    assert_eq!(checked, artifact.ptx.len(), "every emitted PTX file belongs to a kernel");
    assert!(checked >= 30, "expected the generated kernels of a whole training step, found {checked}");
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
