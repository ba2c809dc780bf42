//! Start-up timing and measured memory of the CUDA backend. On a GPU (elsewhere
//! `runtime/build.rs` compiles the tests as ignored, "skipped: no CUDA device"; forced on, they
//! print that line and return) with `TITAN_CUDA_STEP_ARTIFACT` naming an artifact whose
//! every kernel has GPU code: the start-up phases are timed, the measured peak covers at least
//! the arenas, and every step reports it; the initial state equals the CPU backend's whatever
//! the number of init threads (the CPU side draws on 1 thread here, the GPU side on many).

use std::path::PathBuf;

use titan_runtime::backend::cuda::CudaArtifactTrainer;
use titan_runtime::backend::cuda::driver::Gpu;
use titan_runtime::init::init_values_with;
use titan_runtime::{Artifact, BUNDLED_CORPUS, Batcher, Trainer, byte_tokens};

fn have_gpu() -> bool {
    match Gpu::open() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            false
        }
    }
}

fn step_artifact() -> Option<Artifact> {
    let Some(dir) = std::env::var_os("TITAN_CUDA_STEP_ARTIFACT").map(PathBuf::from) else {
        eprintln!("skipped: set TITAN_CUDA_STEP_ARTIFACT to an artifact whose every kernel has GPU code");
        return None;
    };
    Some(Artifact::load(&dir).unwrap_or_else(|e| panic!("TITAN_CUDA_STEP_ARTIFACT={}: {e}", dir.display())))
}

#[test]
#[cfg_attr(titan_no_cuda, ignore = "skipped: no CUDA device")]
fn startup_is_timed_and_memory_is_measured() {
    if !have_gpu() {
        return;
    }
    let Some(a) = step_artifact() else { return };
    let started = std::time::Instant::now();
    let mut gpu = CudaArtifactTrainer::new(&a, 3).expect("cuda trainer");
    let total = started.elapsed().as_secs_f64();
    let t = gpu.startup();
    let phases = [t.load_s, t.plan_s, t.alloc_s, t.init_s, t.upload_s];
    assert!(phases.iter().all(|&s| s >= 0.0) && phases.iter().sum::<f64>() <= total + 1e-3, "{t:?} in {total} s");
    let arenas: u64 = a.manifest.memory.arenas.iter().map(|p| p.bytes).sum();
    assert!(gpu.measured_peak_bytes() >= arenas, "measured {} below the arenas' {arenas} bytes", gpu.measured_peak_bytes());
    let mut batcher = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), gpu.batch_size(), gpu.seq_len(), 3).expect("batcher");
    let mut last = 0;
    for _ in 0..4 {
        let m = gpu.step(&batcher.next_batch()).expect("step");
        let measured = m.measured_peak_bytes.expect("the cuda backend measures its peak");
        assert!(measured >= last, "the measured peak is a running maximum");
        last = measured;
    }
    assert!(gpu.capture_seconds().is_some_and(|s| s >= 0.0), "the capture after the warm-up is timed");
}

#[test]
#[cfg_attr(titan_no_cuda, ignore = "skipped: no CUDA device")]
fn gpu_initial_state_matches_single_threaded_init() {
    if !have_gpu() {
        return;
    }
    let Some(a) = step_artifact() else { return };
    let gpu = CudaArtifactTrainer::new(&a, 11).expect("cuda trainer");
    let graph = &a.graph;
    for (name, t) in gpu.states().expect("states") {
        let Some(arg) = graph.main.args.iter().find(|x| x.kind.param_info().is_some_and(|p| name == p.name)) else { continue };
        let Some(p) = arg.kind.param_info() else { continue };
        let shape = graph.main.ty(arg.value).resolve(&graph.dims).expect("shape");
        let (layers, per_layer) = if p.is_stacked() { (shape[0], shape[1..].iter().product()) } else { (1, shape.iter().product()) };
        let want = init_values_with(p.init, layers, per_layer, 11, &|l| p.layer_name(l), 1).expect("init");
        let dtype = graph.main.ty(arg.value).dtype;
        let got = t.floats().expect("float state");
        assert_eq!(got.len(), want.len(), "state `{name}`");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let w = titan_ir::interp::round_to_dtype(*w, dtype);
            assert_eq!(g.to_bits(), w.to_bits(), "state `{name}` element {i}: gpu {g}, 1-thread init {w}");
        }
    }
}
