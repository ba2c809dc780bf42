//! The CUDA backend against the CPU backend.
//!
//! * Everywhere: an artifact with a kernel that has no GPU code is refused at load, before the
//!   GPU is touched.
//! * On a GPU (elsewhere `runtime/build.rs` compiles these tests as ignored, "skipped: no CUDA
//!   device"; forced on, each prints that line and returns), with artifacts built by
//!   `titanc` (the runtime cannot depend on the compiler) and named by environment variables:
//!   - `TITAN_CUDA_ARTIFACT` (e.g. `titanc build examples/llama3-debug.ir -o DIR`): every
//!     generated kernel and every GEMM, one at a time, on fresh random inputs with NaN-poisoned
//!     outputs, against the interpreter's result for that kernel body (what the CPU backend
//!     computes); kernels without GPU code (a body whose pattern has no generator) are listed
//!     and skipped.
//!   - `TITAN_CUDA_STEP_ARTIFACT` (an artifact whose every kernel has GPU code): initial state
//!     bit-for-bit equal to the CPU backend's, losses of several steps close to the CPU
//!     backend's, the CUDA-graph replay equal to eager execution; its eval step's losses close
//!     to the CPU backend's, and training with validation bitwise training without it.
//!   - `TITAN_CUDA_TIME_ARTIFACT`: prints the median time of each kernel (a record, no check).
//!
//! Tolerances (per output dtype; attention kernels: every element within 5% of the reference rms
//! plus 2 ulp, out and lse of attention_bwd computed from its q, k, v): bf16/f16 every element within max(2 ulp, 2e-2) of the
//! reference and at least 99% within 1 ulp; f32 every element within 1e-3 |ref| + 1e-4 rms(ref);
//! integers exact. A NaN where the reference is finite (an unwritten element) always fails.

mod common;

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use titan_ir::artifact::Step;
use titan_ir::interp::{Interpreter, Precision, Tensor, eval_op};
use titan_ir::{DType, KernelKind, Op};
use titan_runtime::backend::codec::{decode, encode};
use titan_runtime::backend::cuda::driver::Gpu;
use titan_runtime::backend::cuda::{CudaArtifactTrainer, KernelRunner, Operand};
use titan_runtime::{Artifact, BUNDLED_CORPUS, Batcher, CpuArtifactTrainer, Trainer, byte_tokens};

/// Whether a CUDA device can be opened here.
fn have_gpu() -> bool {
    match Gpu::open() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            false
        }
    }
}

/// The artifact named by `var`, or `None` (with a note) when unset.
fn artifact_from(var: &str, how: &str) -> Option<Artifact> {
    let Some(dir) = std::env::var_os(var).map(PathBuf::from) else {
        eprintln!("skipped: set {var} to {how}");
        return None;
    };
    Some(Artifact::load(&dir).unwrap_or_else(|e| panic!("{var}={}: {e}", dir.display())))
}

/// splitmix64: a fresh, printed seed per run, no dependency on an RNG crate's API.
struct Rng(u64);

impl Rng {
    fn fresh() -> Rng {
        let seed = std::env::var("TITAN_CUDA_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1) ^ u64::from(std::process::id()));
        eprintln!("random inputs from seed {seed} (TITAN_CUDA_SEED={seed} repeats them)");
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform().max(1e-300), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

/// Random valid values of one operand: integers in `[1, vocab)` (token ids, targets, the step),
/// floats N(0, 1), made positive for the optimizer and for scalars (moments, sums of squares).
fn random_operand(rng: &mut Rng, o: &Operand, n: usize, vocab: u64, positive: bool) -> Tensor<f32> {
    let positive = positive || o.shape.iter().product::<usize>() <= 1;
    if o.dtype.is_int() {
        let span = vocab.saturating_sub(1).max(1);
        let data = (0..n).map(|_| 1 + (rng.next() % span) as i64).collect();
        return Tensor { dtype: o.dtype, shape: vec![n], data: titan_ir::interp::Data::Int(data) };
    }
    let data = (0..n)
        .map(|_| {
            let x = rng.normal() as f32;
            if positive { x.abs() + 0.05 } else { x }
        })
        .collect();
    Tensor { dtype: o.dtype, shape: vec![n], data: titan_ir::interp::Data::Float(data) }
}

fn bytes_of(t: &Tensor<f32>) -> Vec<u8> {
    let mut out = vec![0u8; t.data.len() * t.dtype.size_bytes()];
    encode(t, &mut out).expect("encode");
    out
}

/// One element of a bf16/f16 ulp at `x`.
fn ulp(x: f32, dtype: DType) -> f32 {
    let mantissa = if dtype == DType::F16 { 10 } else { 7 };
    let e = if x == 0.0 { -126 } else { x.abs().log2().floor() as i32 };
    2f32.powi(e.max(-126) - mantissa)
}

/// How one output compares with its reference.
#[derive(Debug, Default)]
struct Diff {
    elements: usize,
    max_abs: f64,
    /// bf16/f16: largest difference in ulps; f32: largest relative difference.
    max_ulp_or_rel: f64,
    over_one_ulp: usize,
    failures: usize,
    unwritten: usize,
}

/// Attention kernels (tensor-core MMA, online softmax in the log2 domain, tiled sums over keys)
/// sum in another order than the interpreter: every element within 5% of the reference's rms
/// plus 2 ulp, no per-ulp majority rule (validated bounds of the attention engineer's harness).
fn compare_attention(gpu: &Tensor<f32>, cpu: &Tensor<f32>) -> Diff {
    let mut d = compare(gpu, cpu);
    let (g, c) = (gpu.floats().unwrap_or(&[]), cpu.floats().unwrap_or(&[]));
    let rms = (c.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>() / c.len().max(1) as f64).sqrt();
    d.failures = d.unwritten
        + g.iter().zip(c).filter(|&(&a, &b)| a.is_finite() && (f64::from(a) - f64::from(b)).abs() > 0.05 * rms + 2.0 * f64::from(ulp(b, cpu.dtype))).count();
    d
}

/// A GEMM with the residual-add epilogue (`D = A B + C`): cuBLASLt adds C to the f32
/// accumulator and rounds once, the interpreter rounds the product `p` to bf16 first and then
/// the sum, so where the sum cancels the two differ by up to the product's rounding, which is
/// large against the sum's ulp. Every element within that (one ulp of the product) plus the
/// plain GEMM's 2 ulp of the result; the per-ulp majority rule counts beyond one ulp of each.
fn compare_epilogue(gpu: &Tensor<f32>, cpu: &Tensor<f32>, product: &Tensor<f32>) -> Diff {
    let mut d = compare(gpu, cpu);
    let (g, c, p) = (gpu.floats().unwrap_or(&[]), cpu.floats().unwrap_or(&[]), product.floats().unwrap_or(&[]));
    let (mut failures, mut over) = (d.unwritten, 0);
    for ((&a, &b), &q) in g.iter().zip(c).zip(p) {
        if !a.is_finite() {
            continue;
        }
        let (ub, uq) = (f64::from(ulp(b, cpu.dtype)), f64::from(ulp(q, cpu.dtype)));
        let diff = (f64::from(a) - f64::from(b)).abs();
        failures += usize::from(diff > (2.0 * ub + uq).max(2e-2));
        over += usize::from(diff > ub + uq + 1e-12);
    }
    d.failures = failures + usize::from(over * 100 > d.elements);
    d.over_one_ulp = over;
    d
}

fn compare(gpu: &Tensor<f32>, cpu: &Tensor<f32>) -> Diff {
    let mut d = Diff { elements: cpu.data.len(), ..Diff::default() };
    if cpu.dtype.is_int() {
        let (g, c) = (gpu.ints().unwrap_or(&[]), cpu.ints().unwrap_or(&[]));
        d.failures = g.iter().zip(c).filter(|(a, b)| a != b).count() + c.len().abs_diff(g.len());
        d.max_abs = g.iter().zip(c).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
        return d;
    }
    let (g, c) = (gpu.floats().unwrap_or(&[]), cpu.floats().unwrap_or(&[]));
    let rms = (c.iter().filter(|x| x.is_finite()).map(|&x| f64::from(x) * f64::from(x)).sum::<f64>() / c.len().max(1) as f64).sqrt();
    for (&a, &b) in g.iter().zip(c) {
        if b.is_nan() && a.is_nan() {
            continue;
        }
        if !a.is_finite() && b.is_finite() {
            d.unwritten += 1;
            d.failures += 1;
            continue;
        }
        let diff = (f64::from(a) - f64::from(b)).abs();
        d.max_abs = d.max_abs.max(diff);
        match cpu.dtype {
            DType::BF16 | DType::F16 => {
                let u = f64::from(ulp(b, cpu.dtype));
                let ulps = diff / u;
                d.max_ulp_or_rel = d.max_ulp_or_rel.max(ulps);
                if ulps > 1.0 + 1e-6 {
                    d.over_one_ulp += 1;
                }
                if diff > (2.0 * u).max(2e-2) {
                    d.failures += 1;
                }
            }
            _ => {
                d.max_ulp_or_rel = d.max_ulp_or_rel.max(diff / f64::from(b.abs()).max(1e-30));
                if diff > 1e-3 * f64::from(b.abs()) + 1e-4 * rms {
                    d.failures += 1;
                }
            }
        }
    }
    if matches!(cpu.dtype, DType::BF16 | DType::F16) && d.over_one_ulp * 100 > d.elements {
        d.failures = d.failures.max(1);
    }
    d
}

#[test]
fn kernels_without_gpu_code_are_refused_at_load() {
    // The hand-built bigram artifact has no PTX at all: its first kernel is refused before the
    // GPU is touched, so this runs everywhere.
    let dir = common::temp_dir("cuda-refuse");
    common::bigram().write(&dir, common::BIGRAM_IR);
    let a = Artifact::load(&dir).expect("load");
    let e = CudaArtifactTrainer::new(&a, 0).err().expect("refused").to_string();
    let first = &a.manifest.kernels[0];
    assert!(e.contains(&format!("kernel `{}` ({}) has no GPU code yet; use --backend cpu", first.name, first.kind.name())), "{e}");
}

#[test]
#[cfg_attr(titan_no_cuda, ignore = "skipped: no CUDA device")]
fn every_generated_kernel_and_gemm_matches_the_cpu_backend() {
    if !have_gpu() {
        return;
    }
    let Some(a) = artifact_from("TITAN_CUDA_ARTIFACT", "an artifact directory (`titanc build examples/llama3-debug.ir -o DIR`)") else { return };
    let runner = KernelRunner::new(&a).expect("load the kernels");
    let (major, minor) = runner.capability().expect("capability");
    eprintln!("device: {} (sm_{major}{minor})", runner.device_name());
    let mut rng = Rng::fresh();
    let interp = Interpreter::new(&a.graph, Precision::Emulate);
    let vocab = a.manifest.training.vocab_size;
    let mut failed = Vec::new();
    let mut skipped = Vec::new();
    let mut tested = 0;
    eprintln!("{:<44} {:<12} {:>3} {:>6} {:>9} {:>10} {:>8} {:>5}", "kernel", "kind", "out", "dtype", "max |d|", "ulp/rel", ">1ulp %", "ok");
    for (pos, k) in a.manifest.kernels.iter().enumerate() {
        if !runner.has_gpu_code(pos) {
            skipped.push(format!("{} ({})", k.name, k.kind.name()));
            continue;
        }
        tested += 1;
        let (ins, outs) = runner.operands(pos).expect("operands");
        let positive = k.kind == KernelKind::Optimizer;
        let args: Vec<Tensor<f32>> = ins
            .iter()
            .map(|o| {
                let n = o.shape.iter().product();
                let t = random_operand(&mut rng, o, n, vocab, positive);
                // Round to the dtype and give it its shape, exactly as the GPU sees it.
                decode(&bytes_of(&t), o.dtype, o.shape.clone()).expect("decode")
            })
            .collect();
        let (_, body) = a.kernel(k.id).expect("body");
        let mut args = args;
        // attention_bwd reads (q, k, v, out, lse, dout): out and lse must be the forward of q, k, v,
        // or exp(s - lse) is meaningless.
        if let Some(&Op::AttentionBwd { causal, scale }) = body.order.first().map(|&n| &body.node(n).op) {
            let types = [body.ty(body.args[3].value).clone(), body.ty(body.args[4].value).clone()];
            let fwd = eval_op(&Op::Attention { causal, scale }, &[&args[0], &args[1], &args[2]], &types, &a.graph.dims, Precision::Emulate)
                .unwrap_or_else(|e| panic!("the forward for `{}`: {e}", k.name));
            let mut fwd = fwd.into_iter();
            args[3] = fwd.next().expect("out");
            args[4] = fwd.next().expect("lse");
        }
        // The vocab-parallel loss and embedding: `shard` is a one-hot of a random shard, and the
        // shards' `sumexp` are positive (sums of exponentials).
        for &n in &body.order {
            let node = body.node(n);
            let arg = |v: titan_ir::Value| body.args.iter().position(|a| a.value == v);
            match node.op {
                Op::CrossEntropyStats | Op::CrossEntropyStatsBwd | Op::GatherShard | Op::ScatterAddShard => {
                    if let Some(i) = arg(node.inputs[2]) {
                        let shards = args[i].data.len();
                        let k = (rng.next() % shards as u64) as usize;
                        args[i].data = titan_ir::interp::Data::Float((0..shards).map(|j| if j == k { 1.0 } else { 0.0 }).collect());
                    }
                }
                Op::CrossEntropyCombine => {
                    if let Some(i) = arg(node.inputs[1])
                        && let titan_ir::interp::Data::Float(xs) = &mut args[i].data
                    {
                        xs.iter_mut().for_each(|x| *x = x.abs() + 0.05);
                    }
                }
                _ => {}
            }
        }
        let input_bytes: Vec<Vec<u8>> = args.iter().map(bytes_of).collect();
        let want = interp.run_region(body, &args).unwrap_or_else(|e| panic!("the interpreter on `{}`: {e}", k.name));
        // The residual-add epilogue: the product alone (the body's first op on A and B), for
        // the tolerance of the rounding the GPU leaves out.
        let product = k.gemm.as_ref().filter(|g| g.adds_input()).map(|_| {
            let n = body.node(body.order[0]);
            let types = [body.ty(n.results[0]).clone()];
            eval_op(&n.op, &[&args[0], &args[1]], &types, &a.graph.dims, Precision::Emulate)
                .unwrap_or_else(|e| panic!("the product of `{}`: {e}", k.name))
                .remove(0)
        });
        // scatter_add sums into a table the schedule zeroes first; everything else is poisoned.
        let poison = if k.kind == KernelKind::ScatterAdd { 0 } else { 0xff };
        let got = runner.run(pos, &input_bytes, poison).unwrap_or_else(|e| panic!("{e}"));
        if !got.workspace_zeroed {
            failed.push(format!("{}: the workspace is not zero after the launch", k.name));
        }
        for (j, (w, o)) in want.iter().zip(&outs).enumerate() {
            // Encode then decode the reference: the exact bytes the CPU backend would store.
            let w = decode(&bytes_of(w), o.dtype, o.shape.clone()).expect("decode reference");
            let g = decode(&got.outputs[j], o.dtype, o.shape.clone()).expect("decode result");
            let attention = matches!(k.kind, KernelKind::Attention | KernelKind::AttentionBwd);
            let d = match &product {
                _ if attention => compare_attention(&g, &w),
                Some(p) => compare_epilogue(&g, &w, p),
                None => compare(&g, &w),
            };
            let ok = d.failures == 0;
            eprintln!(
                "{:<44} {:<12} {:>3} {:>6} {:>9.3e} {:>10.3e} {:>8.3} {:>5}",
                k.name,
                k.kind.name(),
                j,
                o.dtype.to_string(),
                d.max_abs,
                d.max_ulp_or_rel,
                100.0 * d.over_one_ulp as f64 / d.elements.max(1) as f64,
                if ok { "ok" } else { "FAIL" }
            );
            if !ok {
                failed.push(format!("{} output {j}: {d:?}", k.name));
            }
        }
    }
    eprintln!("tested {tested} kernels on the GPU; no GPU code yet (skipped): {}", if skipped.is_empty() { "none".into() } else { skipped.join(", ") });
    assert!(tested > 0, "no kernel of the artifact has GPU code");
    assert!(failed.is_empty(), "kernels differ from the CPU backend:\n{}", failed.join("\n"));
}

/// Losses of `steps` steps on the bundled corpus.
fn losses(t: &mut dyn Trainer, steps: usize, seed: u64) -> Vec<f64> {
    let mut batcher = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), t.batch_size(), t.seq_len(), seed).expect("batcher");
    (0..steps).map(|_| t.step(&batcher.next_batch()).expect("step").loss).collect()
}

fn state_bits(t: &dyn Trainer) -> Vec<(String, Vec<u32>)> {
    t.states().expect("states").into_iter().map(|(n, s)| (n, s.floats().expect("float state").iter().map(|x| x.to_bits()).collect())).collect()
}

#[test]
#[cfg_attr(titan_no_cuda, ignore = "skipped: no CUDA device")]
fn training_steps_match_the_cpu_backend_and_graph_replay_matches_eager() {
    if !have_gpu() {
        return;
    }
    let Some(a) = artifact_from("TITAN_CUDA_STEP_ARTIFACT", "an artifact whose every kernel has GPU code") else { return };
    let steps = 8;
    let mut gpu = CudaArtifactTrainer::new(&a, 5).expect("cuda trainer");
    let mut cpu = CpuArtifactTrainer::new(&a, 5).expect("cpu trainer");
    assert!(state_bits(&gpu) == state_bits(&cpu), "the GPU starts from different parameters than the CPU backend");
    let g = losses(&mut gpu, steps, 5);
    assert!(gpu.replaying(), "steps after the warm-up replay the captured graph");
    let c = losses(&mut cpu, steps, 5);
    let mut eager = CudaArtifactTrainer::new(&a, 5).expect("cuda trainer");
    eager.set_graphs(false);
    let e = losses(&mut eager, steps, 5);
    eprintln!("losses cpu  {c:?}\nlosses cuda {g:?}\nlosses eager {e:?}");
    for (i, ((g, c), e)) in g.iter().zip(&c).zip(&e).enumerate() {
        assert!(g.is_finite(), "step {}: loss {g}", i + 1);
        assert!((g - c).abs() <= 2e-2 * c.abs(), "step {}: cuda loss {g}, cpu loss {c}", i + 1);
        assert!((g - e).abs() <= 1e-5 * e.abs(), "step {}: graph replay loss {g}, eager loss {e}", i + 1);
    }
    assert!(g[steps - 1] < g[0], "the loss goes down: {g:?}");
}

/// Validation on the GPU: the eval step (loaded at the first validation, run eagerly between
/// training steps, the later ones replayed from the captured graph) gives the CPU backend's
/// validation losses within the training tolerance, and training with it is bit for bit
/// training without it.
#[test]
#[cfg_attr(titan_no_cuda, ignore = "skipped: no CUDA device")]
fn the_eval_step_matches_the_cpu_backend_and_leaves_training_unchanged() {
    if !have_gpu() {
        return;
    }
    let Some(a) = artifact_from("TITAN_CUDA_STEP_ARTIFACT", "an artifact whose every kernel has GPU code") else { return };
    if a.manifest.eval.is_none() {
        eprintln!("skipped: the artifact has no eval step; rebuild it with this titanc");
        return;
    }
    let steps = 6;
    // Training losses, and after steps 1, 2, 4 and 6 the mean eval loss over two fixed batches.
    let run = |t: &mut dyn Trainer, validate: bool| -> (Vec<f64>, Vec<f64>) {
        let mut batcher = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), t.batch_size(), t.seq_len(), 5).expect("batcher");
        let mut held = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), t.batch_size(), t.seq_len(), 9).expect("batcher");
        let val = [held.next_batch(), held.next_batch()];
        let (mut train, mut evals) = (Vec::new(), Vec::new());
        for s in 1..=steps {
            train.push(t.step(&batcher.next_batch()).expect("step").loss);
            if validate && (s == 1 || s % 2 == 0) {
                evals.push(val.iter().map(|b| t.eval_loss(b).expect("eval")).sum::<f64>() / 2.0);
            }
        }
        (train, evals)
    };
    let mut gpu = CudaArtifactTrainer::new(&a, 5).expect("cuda trainer");
    let (g_train, g_eval) = run(&mut gpu, true);
    assert!(gpu.replaying(), "the training steps after the warm-up replay the captured graph");
    let (n_train, _) = run(&mut CudaArtifactTrainer::new(&a, 5).expect("cuda trainer"), false);
    let (_, c_eval) = run(&mut CpuArtifactTrainer::new(&a, 5).expect("cpu trainer"), true);
    eprintln!("validation losses cpu {c_eval:?}\nvalidation losses cuda {g_eval:?}");
    assert!(g_train.iter().map(|l| l.to_bits()).eq(n_train.iter().map(|l| l.to_bits())), "validation changed training: {g_train:?} vs {n_train:?}");
    for (i, (g, c)) in g_eval.iter().zip(&c_eval).enumerate() {
        assert!(g.is_finite() && (g - c).abs() <= 2e-2 * c.abs(), "validation {i}: cuda {g}, cpu {c}");
    }
}

/// The rank path of the CUDA backend (NCCL communicators from a rendezvous, states initialized
/// as this rank's shard) on a one-rank mesh is the single-GPU trainer, bit for bit.
#[test]
#[cfg_attr(titan_no_cuda, ignore = "skipped: no CUDA device")]
fn a_one_rank_mesh_trainer_matches_the_single_gpu_trainer() {
    if !have_gpu() {
        return;
    }
    let Some(a) = artifact_from("TITAN_CUDA_STEP_ARTIFACT", "an artifact whose every kernel has GPU code") else { return };
    if let Err(e) = titan_runtime::dist::nccl::check_nccl() {
        eprintln!("skipped: {e}");
        return;
    }
    let payload = titan_runtime::dist::nccl::unique_id_payload().expect("unique id");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    let group = titan_runtime::dist::ProcessGroup::rendezvous(0, 1, ("127.0.0.1", port), "rank-test", payload, Default::default()).expect("rendezvous");
    let setup = titan_runtime::backend::cuda::CudaRankSetup {
        group: &group,
        mesh: titan_ir::Mesh::new(1, 1, 1),
        device: 0,
        step_timeout: std::time::Duration::from_secs(120),
    };
    let mut ranked = CudaArtifactTrainer::with_rank(&a, 5, Some(setup)).expect("rank trainer");
    let mut single = CudaArtifactTrainer::new(&a, 5).expect("cuda trainer");
    assert!(state_bits(&ranked) == state_bits(&single), "the rank's shard init differs from the single-GPU init");
    let (r, s) = (losses(&mut ranked, 4, 5), losses(&mut single, 4, 5));
    assert_eq!(r, s, "a one-rank mesh trains exactly like one GPU");
}

/// Launches of each kernel per step (loops expanded).
fn launches(steps: &[Step], times: u64, out: &mut std::collections::BTreeMap<u32, u64>) {
    for s in steps {
        match s {
            Step::Launch { kernel, .. } => *out.entry(*kernel).or_default() += times,
            Step::Loop { count, body, prefetch, .. } => {
                launches(prefetch, times * u64::from(*count), out);
                launches(body, times * u64::from(*count), out);
            }
            _ => {}
        }
    }
}

#[test]
#[cfg_attr(titan_no_cuda, ignore = "skipped: no CUDA device")]
fn kernel_times_for_the_record() {
    if !have_gpu() {
        return;
    }
    let Some(a) = artifact_from("TITAN_CUDA_TIME_ARTIFACT", "an artifact directory to time kernel by kernel") else { return };
    let runner = KernelRunner::new(&a).expect("load the kernels");
    let mut rng = Rng::fresh();
    let vocab = a.manifest.training.vocab_size;
    let mut per = std::collections::BTreeMap::new();
    launches(&a.manifest.ranks[0].steps, 1, &mut per);
    let mut rows = Vec::new();
    for (pos, k) in a.manifest.kernels.iter().enumerate() {
        if !runner.has_gpu_code(pos) {
            eprintln!("{:<44} {:<12} no GPU code yet", k.name, k.kind.name());
            continue;
        }
        let positive = k.kind == KernelKind::Optimizer;
        let ms = runner
            .time(pos, 20, &mut |o| {
                let n = (1usize << 16) / o.dtype.size_bytes();
                bytes_of(&random_operand(&mut rng, o, n, vocab, positive))
            })
            .unwrap_or_else(|e| panic!("{e}"));
        let n = per.get(&k.id).copied().unwrap_or(0);
        let bytes = (k.bytes_read + k.bytes_written) as f64;
        let flops = k.gemm.as_ref().map_or(0.0, |g| 2.0 * (g.m * g.n * g.k * g.batch.max(1)) as f64);
        rows.push((k.name.clone(), k.kind.name().to_string(), n, ms, bytes / (ms * 1e-3) / 1e9, flops / (ms * 1e-3) / 1e12));
    }
    rows.sort_by(|a, b| (b.3 * b.2 as f64).total_cmp(&(a.3 * a.2 as f64)));
    eprintln!("{:<44} {:<12} {:>5} {:>10} {:>9} {:>9} {:>10}", "kernel", "kind", "n", "ms/launch", "GB/s", "TFLOP/s", "ms/step");
    let mut total = 0.0;
    for (name, kind, n, ms, gbs, tf) in &rows {
        total += ms * *n as f64;
        eprintln!("{name:<44} {kind:<12} {n:>5} {ms:>10.4} {gbs:>9.1} {tf:>9.1} {:>10.3}", ms * *n as f64);
    }
    eprintln!("sum over launches with GPU code: {total:.3} ms per step");
}

/// The collective steps' building blocks on the real driver and NCCL, on the one GPU there is:
/// the strided copies of every gather/scatter plan along every dim (for 1-4 ranks, each rank's
/// buffers on the GPU, the NCCL exchange between them done on the host), and a one-rank NCCL
/// communicator (rendezvous payload, `ncclCommInitRank`, the three collectives and a ring
/// shift's send/receive pair on the collectives' stream). NCCL refuses two ranks on one GPU, so the multi-rank NCCL path itself
/// waits for a multi-GPU machine.
#[test]
#[cfg_attr(titan_no_cuda, ignore = "skipped: no CUDA device")]
fn collective_plans_and_a_one_rank_nccl_communicator_run_on_the_gpu() {
    use titan_ir::DType;
    use titan_ir::artifact::{CollectiveOp, ReduceOp};
    use titan_runtime::backend::cuda::collective::{Action, Loc, NcclKind, StepShape, plan};
    use titan_runtime::backend::cuda::driver::Gpu;
    if !have_gpu() {
        return;
    }
    let gpu = Gpu::open().expect("gpu");
    let f32s = |b: &[u8]| b.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<f32>>();
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let down = |p: u64, n: usize| {
        let mut h = vec![0u8; n];
        gpu.download(&mut h, p, || "reading back".into()).expect("download");
        h
    };
    for (shard, d, n) in [(vec![3u64, 4], 1usize, 2u64), (vec![2, 3, 4], 1, 4), (vec![2, 3, 4], 2, 3), (vec![5, 2], 0, 2)] {
        let mut full = shard.clone();
        full[d] *= n;
        let (len, full_len) = (shard.iter().product::<u64>() as usize, full.iter().product::<u64>() as usize);
        // all_gather: rank r's input is r * 1000 + i; the result must be their concatenation.
        let plans: Vec<_> = (0..n)
            .map(|c| {
                let s = StepShape {
                    collective: CollectiveOp::AllGather,
                    group: n,
                    dim: Some(d as u32),
                    reduce: None,
                    shift: None,
                    more_inputs: 0,
                    dtype: DType::F32,
                    in_shape: &shard,
                    out_shape: &full,
                };
                plan(&s, c).expect("plan")
            })
            .collect();
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| (0..len).map(|i| (r * 1000) as f32 + i as f32).collect()).collect();
        let bufs: Vec<[titan_runtime::backend::cuda::driver::DeviceBuffer; 3]> = (0..n as usize)
            .map(|r| {
                let i = gpu.alloc(4 * len as u64, 0, "input").expect("alloc");
                gpu.upload_sync(i.ptr, &bytes(&inputs[r]), || "input".into()).expect("upload");
                [i, gpu.alloc(4 * full_len as u64, 0xAB, "output").expect("alloc"), gpu.alloc(plans[0].staging_bytes.max(4), 0xCD, "staging").expect("alloc")]
            })
            .collect();
        let addr = |r: usize, l: Loc| match l {
            Loc::Input(o) => bufs[r][0].ptr + o,
            Loc::Output(o) => bufs[r][1].ptr + o,
            Loc::Staging(o) => bufs[r][2].ptr + o,
            Loc::More(..) => panic!("an all-gather has one operand"),
        };
        for i in 0..plans[0].actions.len() {
            for (r, p) in plans.iter().enumerate() {
                match p.actions[i] {
                    Action::Nccl { kind: NcclKind::AllGather, send, recv, count, .. } => {
                        // What NCCL does: every rank's `count` elements, rank-major, on every rank.
                        let all: Vec<u8> = (0..n as usize).flat_map(|q| down(addr(q, send), 4 * count as usize)).collect();
                        gpu.upload_sync(addr(r, recv), &all, || "gathered".into()).expect("upload");
                    }
                    Action::Copy2d { dst, dst_pitch, src, src_pitch, width, height } => {
                        gpu.copy_2d(None, addr(r, dst), dst_pitch, addr(r, src), src_pitch, width, height, || "copy".into()).expect("copy_2d");
                        gpu.sync(|| "copy".into()).expect("sync");
                    }
                    other => panic!("unexpected action {other:?}"),
                }
            }
        }
        let outer: usize = shard[..d].iter().product::<u64>() as usize;
        let inner = len / outer;
        let want: Vec<f32> = (0..outer).flat_map(|o| inputs.iter().flat_map(move |x| x[o * inner..(o + 1) * inner].to_vec())).collect();
        for (r, b) in bufs.iter().enumerate() {
            assert_eq!(f32s(&down(b[1].ptr, 4 * full_len)), want, "all_gather {shard:?} dim {d} over {n}, rank {r}");
        }
    }
    // A one-rank NCCL communicator: the rendezvous carries the unique id, and each collective
    // (bf16 and f32, sum and max) gives its operand back.
    let Err(e) = titan_runtime::dist::nccl::check_nccl() else {
        let payload = titan_runtime::dist::nccl::unique_id_payload().expect("unique id");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
        let port = listener.local_addr().expect("addr").port();
        drop(listener);
        let group = titan_runtime::dist::ProcessGroup::rendezvous(0, 1, ("127.0.0.1", port), "nccl-test", payload, Default::default()).expect("rendezvous");
        gpu.bind().expect("bind");
        let mesh = titan_runtime::dist::nccl::NcclMesh::new(&group, titan_ir::Mesh::new(1, 1, 1)).expect("communicators");
        assert_eq!((mesh.world.rank(), mesh.world.size()), (0, 1));
        let x: Vec<f32> = (0..4096).map(|i| (i % 97) as f32 - 48.0).collect();
        let src = gpu.alloc(4 * 4096, 0, "send").expect("alloc");
        gpu.upload_sync(src.ptr, &bytes(&x), || "send".into()).expect("upload");
        for (kind, dtype, reduce) in [
            (NcclKind::AllReduce, DType::F32, ReduceOp::Sum),
            (NcclKind::AllReduce, DType::BF16, ReduceOp::Max),
            (NcclKind::AllGather, DType::F32, ReduceOp::Sum),
            (NcclKind::ReduceScatter, DType::F32, ReduceOp::Sum),
            // Async TP's ring shift over one rank: a grouped send and receive to itself.
            (NcclKind::SendRecv { to: 0, from: 0 }, DType::BF16, ReduceOp::Sum),
            (NcclKind::SendRecv { to: 0, from: 0 }, DType::F8E4M3, ReduceOp::Sum),
        ] {
            let count = 4 * 4096 / dtype.size_bytes();
            let dst = gpu.alloc(4 * 4096, 0xAB, "recv").expect("alloc");
            // SAFETY: both buffers hold `count` elements of `dtype` and outlive the sync below.
            unsafe { mesh.world.run(kind, src.ptr, dst.ptr, count, dtype, reduce, gpu.comm[0]) }.expect("nccl");
            gpu.sync_all(|| "waiting for NCCL".into()).expect("sync");
            assert_eq!(down(dst.ptr, 4 * 4096), bytes(&x), "{kind:?} {dtype:?} {reduce:?} over one rank is the identity");
        }
        eprintln!("NCCL {}: one-rank communicator and collectives ok", titan_runtime::dist::nccl::check_nccl().expect("version"));
        return;
    };
    eprintln!("skipped the NCCL part: {e}");
}
