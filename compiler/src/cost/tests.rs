//! The cost model's files, the simulator's stream rule and calibration, on debug artifacts.

use titan_ir::artifact::Manifest;
use titan_ir::artifact::timeline::Span;

use super::*;
use crate::build::{BuildOptions, compile};
use crate::{LlamaConfig, Preset, build_llama3};

fn manifest(mesh: titan_ir::Mesh) -> Manifest {
    let m = build_llama3(&LlamaConfig::preset(Preset::Debug), "debug").unwrap_or_else(|e| panic!("{e}"));
    let opts = BuildOptions { mesh, ..BuildOptions::default() };
    compile(&m, "", &opts, false, None).unwrap_or_else(|e| panic!("{e}")).0.manifest
}

fn h200() -> CostModel {
    CostModel::load("h200").unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn built_in_models_load_and_bad_files_are_refused() {
    for name in ["h100", "h200"] {
        let c = CostModel::load(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((c.format, c.name.as_str()), (COST_MODEL_FORMAT, name));
        // Larger GEMMs run at least as fast.
        let bf16: Vec<f64> = c.gemm.iter().filter(|g| g.dtype == "bf16").map(|g| g.tflops).collect();
        assert!(bf16.windows(2).all(|w| w[0] <= w[1]), "{name}: {bf16:?}");
    }
    let mut v: serde_json::Value = serde_json::from_str(H200).unwrap_or_default();
    v["format"] = 2.into();
    let e = CostModel::parse("c.json", &v.to_string()).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("cost model format 2 is not supported"), "{e}");
    v["format"] = 1.into();
    v["memory_gbps"] = (-1.0).into();
    let e = CostModel::parse("c.json", &v.to_string()).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("`memory_gbps` must be a positive number"), "{e}");
    let e = CostModel::load("/nonexistent/cost.json").err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("cannot read `/nonexistent/cost.json`"), "{e}");
}

/// One rank: everything on the compute stream, back to back; the step is the sum of the
/// operations' costs, and the GEMM share follows the rates.
#[test]
fn a_single_rank_step_is_its_operations_back_to_back() {
    let m = manifest(titan_ir::Mesh::new(1, 1, 1));
    let c = h200();
    let sim = simulate(&m, 0, &c).unwrap_or_else(|e| panic!("{e}"));
    assert!(sim.comm_s.is_empty());
    let mut t = 0.0;
    for s in &sim.spans {
        assert_eq!(s.stream, "compute");
        assert!((s.start_s - t).abs() < 1e-12, "{} starts at {} not {t}", s.name, s.start_s);
        t += s.dur_s;
    }
    assert!((sim.step_s - t).abs() < 1e-12 && (sim.compute_s - t).abs() < 1e-12);
    // Twice the launch overhead adds exactly one overhead per operation.
    let slow = CostModel { launch_us: 2.0 * c.launch_us, ..c.clone() };
    let sim2 = simulate(&m, 0, &slow).unwrap_or_else(|e| panic!("{e}"));
    let n = sim.spans.len() as f64;
    assert!((sim2.step_s - sim.step_s - n * c.launch_us * 1e-6).abs() < 1e-9);
    assert!(sim.mfu() > 0.0 && sim.mfu() < 1.0, "{}", sim.mfu());
}

/// On a mesh, collectives run on their own stream in order, never before the compute enqueued
/// before them, and what the compute stream waits for them is the exposed time; slowing the
/// links down can only expose more.
#[test]
fn collectives_overlap_compute_and_expose_only_what_is_waited_for() {
    let m = manifest(titan_ir::Mesh::new(1, 2, 2));
    let c = h200();
    let sim = simulate(&m, 0, &c).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(sim.comm_s.keys().cloned().collect::<Vec<_>>(), vec!["dp_shard".to_string(), "tp".to_string()]);
    let comm: Vec<&Span> = sim.spans.iter().filter(|s| s.stream == "comm").collect();
    assert!(comm.windows(2).all(|w| w[1].start_s >= w[0].start_s + w[0].dur_s - 1e-15), "the collectives' stream runs them in order");
    let compute: Vec<&Span> = sim.spans.iter().filter(|s| s.stream != "comm").collect();
    assert!(compute.windows(2).all(|w| w[1].start_s >= w[0].start_s + w[0].dur_s - 1e-15), "the compute stream runs one thing at a time");
    let waited: f64 = sim.spans.iter().filter(|s| s.stream == "wait").map(|s| s.dur_s).sum();
    let exposed: f64 = sim.exposed_s.values().sum();
    assert!((waited - exposed).abs() < 1e-12);
    for dim in ["dp_shard", "tp"] {
        assert!((0.0..=1.0).contains(&sim.hidden(dim)), "{dim}: {}", sim.hidden(dim));
    }
    let slow = CostModel { nvlink: Link { gbps: c.nvlink.gbps / 100.0, latency_us: c.nvlink.latency_us }, ..c.clone() };
    let sim2 = simulate(&m, 0, &slow).unwrap_or_else(|e| panic!("{e}"));
    assert!(sim2.exposed_s.values().sum::<f64>() > exposed);
    assert!(sim2.step_s > sim.step_s);
    // The same mesh laid over nodes of one GPU: every collective crosses the network.
    let tiny_nodes = CostModel { gpus_per_node: 1, ..c.clone() };
    let sim3 = simulate(&m, 0, &tiny_nodes).unwrap_or_else(|e| panic!("{e}"));
    assert!(sim3.comm_s["tp"] > sim.comm_s["tp"]);
}

/// A trace produced by one model calibrates another into it: every rate the step exercises is
/// recovered, and the comparison of the calibrated prediction with the trace is exact.
#[test]
fn calibration_recovers_the_rates_of_a_trace() {
    let m = manifest(titan_ir::Mesh::new(1, 1, 2));
    // No launch overhead or link latency: on the debug model they would dwarf the rates being
    // fitted.
    let base = h200();
    let truth = CostModel { launch_us: 0.0, nvlink: Link { gbps: base.nvlink.gbps, latency_us: 0.0 }, ..base };
    let measured = simulate(&m, 0, &truth).unwrap_or_else(|e| panic!("{e}")).spans;
    // Round-trip through the trace format, as `titan-run --trace` files arrive.
    let measured =
        titan_ir::artifact::timeline::read_chrome_trace(&titan_ir::artifact::timeline::chrome_trace(0, "test", &measured)).unwrap_or_else(|e| panic!("{e}"));
    let mut wrong = truth.clone();
    wrong.memory_gbps *= 3.0;
    wrong.attention_fwd_tflops *= 0.5;
    wrong.attention_bwd_tflops *= 2.0;
    wrong.nvlink.gbps *= 0.25;
    for g in &mut wrong.gemm {
        g.tflops *= 1.7;
    }
    let before = compare(&m, 0, &wrong, &measured).unwrap_or_else(|e| panic!("{e}"));
    assert!((before.predicted_s / before.measured_s - 1.0).abs() > 0.05, "{before}");
    let fitted = calibrate(&m, 0, &wrong, &measured).unwrap_or_else(|e| panic!("{e}"));
    let close = |a: f64, b: f64| (a / b - 1.0).abs() < 1e-6;
    assert!(close(fitted.memory_gbps, truth.memory_gbps), "{} vs {}", fitted.memory_gbps, truth.memory_gbps);
    assert!(close(fitted.attention_fwd_tflops, truth.attention_fwd_tflops));
    assert!(close(fitted.attention_bwd_tflops, truth.attention_bwd_tflops));
    assert!(close(fitted.nvlink.gbps, truth.nvlink.gbps), "{} vs {}", fitted.nvlink.gbps, truth.nvlink.gbps);
    let after = compare(&m, 0, &fitted, &measured).unwrap_or_else(|e| panic!("{e}"));
    assert!((after.predicted_s / after.measured_s - 1.0).abs() < 1e-6, "{after}");
    for (name, _, _, p, me) in &after.rows {
        assert!((p / me - 1.0).abs() < 1e-6, "{name}: {p} vs {me}");
    }
    // A trace of another artifact is refused, naming the first operation that differs.
    let other = manifest(titan_ir::Mesh::new(1, 2, 1));
    let e = compare(&other, 0, &truth, &measured).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("a trace of another artifact?") || e.contains("ends before"), "{e}");
}
