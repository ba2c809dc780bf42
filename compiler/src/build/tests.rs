//! Tests of the build: the memory plan (no overlapping live buffers, and a shadow execution of
//! the schedule that checks every read sees the bytes its producer wrote), the plan summary
//! snapshot, determinism and the atomic write.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use titan_ir::artifact::{Arena, BufRef, BufferClass, Manifest, Step};
use titan_ir::{Graph, KernelKind};
use titan_passes::{PipelineOptions, TrainOptions, compile_train_graph};

use super::memory::overlapping_buffers;
use super::*;
use crate::{LlamaConfig, Preset, build_llama3};

fn model(p: Preset, n_layers: Option<u64>) -> Graph {
    let mut cfg = LlamaConfig::preset(p);
    if let Some(n) = n_layers {
        cfg.n_layers = n;
    }
    build_llama3(&cfg, p.name()).unwrap_or_else(|e| panic!("{e}"))
}

fn kernel_graph(m: &Graph) -> Graph {
    let popts = PipelineOptions { verify_each: true, ..PipelineOptions::default() };
    compile_train_graph(m, &TrainOptions::default(), &popts).unwrap_or_else(|e| panic!("{e}")).0
}

fn debug_text() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/llama3-debug.ir")).unwrap_or_default()
}

/// A fresh scratch directory for one test.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("titan-build-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    dir
}

/// Runs the schedule symbolically, unrolling loops, and reports every read that would not see
/// the bytes its producer wrote: a read of a buffer (or layer slice) nothing wrote yet, or whose
/// bytes another buffer overwrote since. This checks the memory plan and the Loop/carry/slice
/// semantics of `docs/artifact.md` independently of how the planner computes lifetimes.
fn shadow_execute(m: &Manifest) -> Vec<String> {
    shadow_execute_rank(m, 0)
}

/// [`shadow_execute`] for the rank at tp coordinate `tp_coord` (where async TP's ring views
/// lie depends on it).
fn shadow_execute_rank(m: &Manifest, tp_coord: usize) -> Vec<String> {
    struct Sim<'m> {
        m: &'m Manifest,
        tp_coord: u32,
        /// `(arena, start, end, buffer)` of every write, in order.
        log: Vec<(Arena, u64, u64, u32)>,
        errors: Vec<String>,
    }
    /// A buffer and a byte range of it (relative to the buffer): a whole buffer, a layer slice
    /// or an offset view.
    type Key = (u32, u64, u64);
    impl Sim<'_> {
        fn resolve(&self, r: BufRef, layer: u64, t: u64, carries: &[[u32; 2]]) -> Key {
            let buffer = match r {
                BufRef::Carry { carry, out } => carries[carry as usize][((t + u64::from(out)) % 2) as usize],
                other => other.buffer_id().expect("invariant: not a carry"),
            };
            let buf = &self.m.buffers[buffer as usize];
            let (s, n) = match r {
                BufRef::Carry { .. } => (0, buf.bytes),
                other => {
                    other.range_in(buf.bytes, buf.shape.first().copied().unwrap_or(0), Some(layer as usize), self.tp_coord).unwrap_or_else(|e| panic!("{e}"))
                }
            };
            (buffer, s, s + n)
        }
        fn range(&self, (b, s, e): Key) -> (Arena, u64, u64) {
            let buf = &self.m.buffers[b as usize];
            (buf.arena, buf.offset + s, buf.offset + e)
        }
        fn write(&mut self, key: Key) {
            let (a, s, e) = self.range(key);
            self.log.push((a, s, e, key.0));
        }
        fn read(&mut self, key: Key, what: &str) {
            let buf = &self.m.buffers[key.0 as usize];
            let preset = matches!(buf.class, BufferClass::Input | BufferClass::Param | BufferClass::OptimizerState | BufferClass::ComputeCopy);
            let (a, s, e) = self.range(key);
            // The writes this read depends on: the latest writes of this buffer that together
            // cover the bytes read (scanning back until they do).
            let mut covered: Vec<(u64, u64)> = Vec::new();
            let mut since = None;
            for (i, &(_, ws, we, wb)) in self.log.iter().enumerate().rev() {
                if wb != key.0 || we <= s || e <= ws {
                    continue;
                }
                covered.push((ws.max(s), we.min(e)));
                covered.sort_unstable();
                let mut end = s;
                for &(cs, ce) in &covered {
                    if cs > end {
                        break;
                    }
                    end = end.max(ce);
                }
                if end >= e {
                    since = Some(i);
                    break;
                }
            }
            let since = match (since, preset) {
                (Some(i), _) => i,
                (None, true) => 0,
                (None, false) => {
                    self.errors.push(format!("{what} reads {} bytes {}..{} before anything wrote them", buf.name, key.1, key.2));
                    return;
                }
            };
            for &(wa, ws, we, wb) in &self.log[since..] {
                if wa == a && wb != key.0 && ws < e && s < we {
                    self.errors.push(format!("{what} reads {} bytes {}..{}, overwritten by {}", buf.name, key.1, key.2, self.m.buffers[wb as usize].name));
                    return;
                }
            }
        }
        fn run(&mut self, steps: &[Step], layer: u64, t: u64, carries: &[[u32; 2]]) {
            for s in steps {
                match s {
                    Step::Launch { kernel, inputs, outputs, .. } => {
                        let name = &self.m.kernels[*kernel as usize].name;
                        for &r in inputs {
                            let k = self.resolve(r, layer, t, carries);
                            self.read(k, &format!("{name} (layer {layer})"));
                        }
                        for &r in outputs {
                            let k = self.resolve(r, layer, t, carries);
                            self.write(k);
                        }
                    }
                    Step::Copy { src, dst, .. } => {
                        let k = self.resolve(*src, layer, t, carries);
                        self.read(k, "copy");
                        let k = self.resolve(*dst, layer, t, carries);
                        self.write(k);
                    }
                    Step::Memset { dst, .. } => {
                        let k = self.resolve(*dst, layer, t, carries);
                        self.write(k);
                    }
                    Step::Collective { collective, input, more_inputs, output, .. } => {
                        for r in std::iter::once(input).chain(more_inputs) {
                            let k = self.resolve(*r, layer, t, carries);
                            self.read(k, &format!("{} (layer {layer})", collective.name()));
                        }
                        let k = self.resolve(*output, layer, t, carries);
                        self.write(k);
                    }
                    Step::Loop { count, reverse, carries, body, prefetch } => {
                        for run in titan_ir::artifact::loop_runs(*count, *reverse, !prefetch.is_empty()) {
                            let steps = if run.prefetch { prefetch } else { body };
                            self.run(steps, run.layer as u64, run.t as u64, carries);
                        }
                    }
                }
            }
        }
    }
    let mut sim = Sim { m, tp_coord: tp_coord as u32, log: Vec::new(), errors: Vec::new() };
    sim.run(&m.ranks[0].steps, 0, 0, &[]);
    // The step's outputs must still be intact at the end.
    for b in m.buffers.iter().filter(|b| b.output.is_some()) {
        sim.read((b.id, 0, b.bytes), "the step output");
    }
    sim.errors
}

/// The manifest without code generation (the plan and schedule do not depend on it).
fn manifest_of(m: &Graph, text: &str) -> Manifest {
    compile(m, text, &BuildOptions::default(), false, None).unwrap_or_else(|e| panic!("{e}")).0.manifest
}

#[test]
fn live_buffers_never_share_bytes_debug_and_8b() {
    for (p, layers) in [(Preset::Debug, None), (Preset::B8, Some(3))] {
        let m = model(p, layers);
        let plan = plan_kernel_graph(&kernel_graph(&m)).unwrap_or_else(|e| panic!("{e}"));
        let bad = overlapping_buffers(&plan.storage.buffers, &plan.lifetimes);
        assert!(bad.is_empty(), "{p}: live buffers share bytes: {bad:?}");
        for b in &plan.storage.buffers {
            assert_eq!(b.offset % memory::ALIGN, 0, "{p}: {} is not aligned", b.name);
            let arena = plan.memory.arenas.iter().find(|a| a.arena == b.arena).map_or(0, |a| a.bytes);
            assert!(b.offset + b.bytes <= arena, "{p}: {} ends past its arena", b.name);
        }
        assert_eq!(plan.memory.peak_bytes, plan.memory.arenas.iter().map(|a| a.bytes).sum::<u64>());
        assert!(plan.memory.arenas.iter().find(|a| a.arena == Arena::Activations).map_or(0, |a| a.bytes) <= plan.memory.activation_bytes_unplanned);
    }
}

/// `fuse`'s rule 10 on the training step: the grad-norm kernels write only their partial sums
/// (no fp32 copy of a gradient) and the optimizer kernel reads every gradient as the backward
/// produced it, in bf16, casting and clipping it itself.
#[test]
fn the_optimizer_reads_the_bf16_gradients_and_norm_kernels_write_no_copies() {
    for (p, layers) in [(Preset::Debug, None), (Preset::B8, Some(2))] {
        let g = kernel_graph(&model(p, layers));
        let main = &g.main;
        let kernels: Vec<(KernelKind, &titan_ir::Node)> = main
            .order
            .iter()
            .map(|&n| main.node(n))
            .filter_map(|node| match node.op {
                titan_ir::Op::Kernel { kind, .. } => Some((kind, node)),
                _ => None,
            })
            .collect();
        let opt = kernels.iter().find(|(k, _)| *k == KernelKind::Optimizer).map(|(_, n)| *n).expect("an optimizer kernel");
        let grads: Vec<&titan_ir::TensorType> = opt
            .inputs
            .iter()
            .filter(|&&v| matches!(main.value(v).def, titan_ir::ValueDef::Result { .. }))
            .map(|&v| main.ty(v))
            .filter(|t| t.rank() > 0)
            .collect();
        let masters_and_moments = main.args.iter().filter(|a| matches!(&a.kind, titan_ir::ArgKind::State(i) if i.init != titan_ir::Init::ComputeCopy)).count();
        assert_eq!(grads.len(), masters_and_moments / 3, "{p}: one gradient per parameter");
        assert!(grads.iter().all(|t| t.dtype == titan_ir::DType::BF16), "{p}: {grads:?}");
        // `compute-copies`: the optimizer also writes the bf16 copy of every new master.
        let copies = opt.results.iter().filter(|&&r| main.ty(r).dtype == titan_ir::DType::BF16).count();
        // The 8B table (128256 rows, 2 x 8192 tokens) has no copy: its lookup casts the rows.
        let table_copies = usize::from(p == Preset::Debug);
        assert_eq!(copies + 1 - table_copies, grads.len(), "{p}: one compute copy per parameter (but a large table) written by the optimizer");
        let is_norm = |n: &titan_ir::Node| {
            let titan_ir::Op::Kernel { body, .. } = n.op else { return false };
            g.block(body).order.iter().any(|&m| matches!(g.block(body).node(m).op, titan_ir::Op::Unary(titan_ir::UnaryOp::Square)))
        };
        let norms: Vec<&titan_ir::Node> = kernels.iter().filter(|(k, n)| *k == KernelKind::Fused && is_norm(n)).map(|(_, n)| *n).collect();
        assert_eq!(norms.len(), grads.len(), "{p}");
        for n in norms {
            assert!(n.results.iter().all(|&r| main.ty(r).rank() == 0), "{p}: a grad-norm kernel writes a tensor");
        }
    }
}

#[test]
fn shadow_execution_reads_what_was_written() {
    for (p, layers) in [(Preset::Debug, None), (Preset::B8, Some(3))] {
        let m = model(p, layers);
        let manifest = manifest_of(&m, &titan_ir::print::print_graph(&m));
        let errors = shadow_execute(&manifest);
        assert!(errors.is_empty(), "{p}: {} bad reads, first: {:#?}", errors.len(), &errors[..errors.len().min(10)]);
    }
}

/// Tied embeddings (fusion rule 12): the embedding's `scatter_add` kernel adds its rows to the
/// head's weight gradient and writes the sum over that gradient's buffer, which nothing reads
/// after it; every read still sees its producer's bytes.
#[test]
fn the_tied_gradient_is_scattered_in_place() {
    let cfg = LlamaConfig { tie_embeddings: true, ..LlamaConfig::preset(Preset::Debug) };
    let m = build_llama3(&cfg, "llama3_debug_tied").unwrap_or_else(|e| panic!("{e}"));
    let manifest = manifest_of(&m, &titan_ir::print::print_graph(&m));
    let scatters: Vec<&Step> = all_steps(&manifest.ranks[0].steps)
        .into_iter()
        .filter(|s| matches!(s, Step::Launch { kernel, .. } if manifest.kernels[*kernel as usize].kind == KernelKind::ScatterAdd))
        .collect();
    let [Step::Launch { inputs, outputs, .. }] = scatters.as_slice() else { panic!("one scatter_add launch expected: {scatters:?}") };
    assert_eq!(inputs.len(), 3, "indices, sources and the head gradient");
    assert_eq!(outputs.as_slice(), &inputs[2..], "the sum is written over the head gradient");
    assert!(!all_steps(&manifest.ranks[0].steps).iter().any(|s| matches!(s, Step::Memset { .. })), "nothing zeroes the table");
    let errors = shadow_execute(&manifest);
    assert!(errors.is_empty(), "{} bad reads, first: {:#?}", errors.len(), &errors[..errors.len().min(10)]);
}

/// SPMD builds (FSDP x TP, HSDP x TP, kv-head replication at tp 4, FSDP over 3 layers: an odd
/// count ends the prefetched carries in the other slot): collective results get buffers of
/// their own, live buffers never share bytes, every read sees its producer's bytes (the
/// prefetched gathers included: the shadow execution runs each loop's prologue and prefetches).
#[test]
fn spmd_plans_are_sound() {
    for (mesh, layers) in [
        (titan_ir::Mesh::new(1, 2, 2), None),
        (titan_ir::Mesh::new(2, 2, 2), None),
        (titan_ir::Mesh::new(1, 1, 4), None),
        (titan_ir::Mesh::new(1, 2, 1), Some(3)),
    ] {
        let m = model(Preset::Debug, layers);
        let opts = BuildOptions { mesh, ..BuildOptions::default() };
        let (artifact, summary) = compile(&m, "", &opts, false, None).unwrap_or_else(|e| panic!("{mesh:?}: {e}"));
        let manifest = artifact.manifest;
        assert!(summary.collectives_per_step > 0);
        let errors = shadow_execute(&manifest);
        assert!(errors.is_empty(), "{mesh:?}: {} bad reads, first: {:#?}", errors.len(), &errors[..errors.len().min(10)]);
        let mut meshed = m.clone();
        mesh.write_meta(&mut meshed);
        let plan = plan_kernel_graph(&kernel_graph(&meshed)).unwrap_or_else(|e| panic!("{e}"));
        assert!(overlapping_buffers(&plan.storage.buffers, &plan.lifetimes).is_empty(), "{mesh:?}");
        assert_eq!(manifest.mesh.world_size, mesh.world_size());
        let report = manifest.report.expect("report");
        assert_eq!(report.memory.peak, manifest.memory.peak_bytes);
    }
}

/// `prefetch-next-layer` on an FSDP build: each loop's 9 parameter gathers are its `prefetch`
/// steps (layer slices of the shards into the prefetched carries' next slots), the bodies
/// gather nothing over dp_shard, both slots of every prefetched carry are live together for
/// the whole loop (two layers' gathered weights), so the predicted peak is about one layer's
/// gathered weights above the build without prefetch, and the communication is the same.
/// A loop's carries, body and prefetch steps.
type LoopParts<'a> = (&'a [[u32; 2]], &'a [Step], &'a [Step]);

#[test]
fn prefetched_gathers_hold_two_layers_of_gathered_weights() {
    use titan_ir::artifact::CollectiveOp;
    let m = model(Preset::Debug, Some(3));
    let build = |prefetch_next_layer: bool| {
        let opts = BuildOptions { mesh: titan_ir::Mesh::new(1, 2, 1), prefetch_next_layer, ..BuildOptions::default() };
        compile(&m, "", &opts, false, None).unwrap_or_else(|e| panic!("{e}")).0.manifest
    };
    let (on, off) = (build(true), build(false));
    let loops: Vec<LoopParts<'_>> = on.ranks[0]
        .steps
        .iter()
        .filter_map(|s| match s {
            Step::Loop { carries, body, prefetch, .. } => Some((carries.as_slice(), body.as_slice(), prefetch.as_slice())),
            _ => None,
        })
        .collect();
    assert_eq!(loops.len(), 2, "forward and backward");
    let dp_gather = |s: &Step| matches!(s, Step::Collective { collective: CollectiveOp::AllGather, mesh_dim, .. } if mesh_dim == "dp_shard");
    for (l, (carries, body, prefetch)) in loops.iter().enumerate() {
        // The forward's hidden state lives in its stack of layer inputs, not in two slots.
        let hidden = usize::from(l == 1);
        assert_eq!((carries.len(), prefetch.len()), (hidden + 9, 9), "the hidden state (backward) and 9 prefetched weights");
        for s in prefetch.iter() {
            assert!(dp_gather(s), "{s:?}");
            let Step::Collective { input, output, .. } = s else { unreachable!() };
            assert!(matches!(input, BufRef::Buffer { layer: true, .. }), "reads a layer slice of the shards: {s:?}");
            assert!(
                matches!(output, BufRef::Carry { carry, out: true } if (hidden..hidden + 9).contains(&(*carry as usize))),
                "writes the next layer's slot: {s:?}"
            );
        }
        assert!(!body.iter().any(dp_gather), "the body gathers no weight");
    }
    assert!(off.ranks[0].steps.iter().all(|s| !matches!(s, Step::Loop { prefetch, .. } if !prefetch.is_empty())));
    // Both slots of each prefetched carry live across their whole loop, together.
    let mut meshed = m.clone();
    titan_ir::Mesh::new(1, 2, 1).write_meta(&mut meshed);
    let plan = plan_kernel_graph(&kernel_graph(&meshed)).unwrap_or_else(|e| panic!("{e}"));
    for (carries, _, _) in &loops {
        let slots: Vec<u32> = carries[carries.len() - 9..].iter().flatten().copied().collect();
        for &a in &slots {
            for &b in &slots {
                let (la, lb) = (plan.lifetimes[a as usize].expect("live"), plan.lifetimes[b as usize].expect("live"));
                assert!(la.overlaps(&lb), "{} and {}", on.buffers[a as usize].name, on.buffers[b as usize].name);
            }
        }
    }
    let layer: u64 = loops[0].0.iter().map(|c| on.buffers[c[0] as usize].bytes.div_ceil(memory::ALIGN) * memory::ALIGN).sum();
    let delta = on.memory.peak_bytes - off.memory.peak_bytes;
    println!("one layer's gathered weights {layer} B; peak {} -> {} B (+{delta})", off.memory.peak_bytes, on.memory.peak_bytes);
    assert!(delta + 1024 >= layer && delta <= layer + layer / 4, "peak +{delta} B, one layer's gathered weights {layer} B");
    let (r_on, r_off) = (on.report.expect("report"), off.report.expect("report"));
    assert_eq!(r_on.comm, r_off.comm, "the same gathers, none wasted");
}

#[test]
fn shadow_execution_catches_a_clobbering_plan() {
    let m = model(Preset::Debug, None);
    let mut manifest = manifest_of(&m, "");
    // Put every activation at offset 0: saved activations now overwrite each other.
    for b in manifest.buffers.iter_mut().filter(|b| b.arena == Arena::Activations) {
        b.offset = 0;
    }
    assert!(!shadow_execute(&manifest).is_empty());
}

/// Arena sizes, buffer count and the ten biggest buffers.
fn plan_summary(manifest: &Manifest) -> String {
    let mut s = String::new();
    for a in &manifest.memory.arenas {
        let _ = writeln!(s, "{:<16} {:>9}", memory::arena_name(a.arena), a.bytes);
    }
    let _ = writeln!(s, "peak_bytes       {:>9}", manifest.memory.peak_bytes);
    let _ = writeln!(s, "unplanned acts   {:>9}", manifest.memory.activation_bytes_unplanned);
    let _ = writeln!(s, "buffers          {:>9}", manifest.buffers.len());
    let mut by_size: Vec<_> = manifest.buffers.iter().collect();
    by_size.sort_by_key(|b| (std::cmp::Reverse(b.bytes), b.id));
    for b in by_size.iter().take(10) {
        let _ = writeln!(s, "{:>9}  {:<15} {:?} {:?}", b.bytes, format!("{:?}", b.class), b.shape, b.name);
    }
    s
}

#[test]
fn debug_memory_plan_snapshot() {
    let text = debug_text();
    let m = titan_ir::parse::parse_and_verify("llama3-debug.ir", &text).unwrap_or_else(|e| panic!("{e}"));
    insta::assert_snapshot!("debug_memory_plan", plan_summary(&manifest_of(&m, &text)));
}

#[test]
fn manifest_describes_the_debug_step() {
    let text = debug_text();
    let m = titan_ir::parse::parse_and_verify("llama3-debug.ir", &text).unwrap_or_else(|e| panic!("{e}"));
    let man = manifest_of(&m, &text);
    let feeds: Vec<&str> = man.buffers.iter().filter_map(|b| b.feed.as_deref()).collect();
    assert_eq!(feeds, ["tokens", "targets", "step"]);
    let mut outputs: Vec<&str> = man.buffers.iter().filter_map(|b| b.output.as_deref()).collect();
    outputs.sort_unstable();
    assert_eq!(outputs, ["grad_norm", "loss", "lr"]);
    let states = man.buffers.iter().filter(|b| b.state.is_some()).count();
    assert_eq!(states, 48, "12 masters, 24 moments and 12 compute copies");
    let copies = man.buffers.iter().filter(|b| b.class == BufferClass::ComputeCopy).count();
    assert_eq!(copies, 12, "every bf16 master has its carried copy (the debug table is small: no row cast)");
    assert!(man.buffers.iter().any(|b| b.class == BufferClass::Grad));
    assert_eq!((man.training.batch, man.training.seq_len, man.training.tokens_per_step, man.training.vocab_size), (8, 64, 512, 256));
    assert_eq!(man.mesh.world_size, 1);
    let loops: Vec<(u32, bool)> = man.ranks[0]
        .steps
        .iter()
        .filter_map(|s| match s {
            Step::Loop { count, reverse, .. } => Some((*count, *reverse)),
            _ => None,
        })
        .collect();
    assert_eq!(loops, [(2, false), (2, true)]);
    // The scatter_add kernel writes every row of its table: nothing zeroes it first.
    assert!(!all_steps(&man.ranks[0].steps).iter().any(|s| matches!(s, Step::Memset { .. })), "a memset in the schedule");
    for k in &man.kernels {
        assert_eq!(k.gemm.is_some(), k.kind == KernelKind::Gemm, "{}", k.name);
        assert!(k.name.starts_with(&k.body), "{} names its body {}", k.name, k.body);
    }
    // Every kernel body is launched, and every launch binds the body's arguments and results.
    let (artifact, _) = compile_artifact(&m, &text, &BuildOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    for k in &artifact.manifest.kernels {
        // GEMMs run on cuBLASLt; every other kind is generated.
        let generated = k.kind != KernelKind::Gemm;
        assert_eq!(k.ptx.is_some(), generated, "{}", k.name);
        assert_eq!(k.entry.is_some() && k.launch.is_some(), generated, "{}", k.name);
        if let Some(p) = &k.ptx {
            assert_eq!(p, &format!("kernels/{}.ptx", k.name));
            assert!(artifact.ptx.iter().any(|(f, text)| f == p && text.contains(".entry")), "{p} holds no entry");
        }
        let planned = man.kernels.iter().find(|x| x.id == k.id).unwrap_or_else(|| panic!("kernel {} missing", k.id));
        assert_eq!(
            (&planned.name, planned.kind, &planned.gemm, planned.bytes_read),
            (&k.name, k.kind, &k.gemm, k.bytes_read),
            "codegen changes only code fields"
        );
    }
    assert_eq!(artifact.manifest.ranks, man.ranks);
    assert_eq!(artifact.manifest.buffers, man.buffers);
    let g = titan_ir::parse::parse_and_verify("graph.ir", &artifact.graph_text).unwrap_or_else(|e| panic!("graph.ir does not parse back: {e}"));
    fn check(steps: &[Step], man: &Manifest, g: &Graph, seen: &mut HashSet<u32>) {
        for s in steps {
            match s {
                Step::Launch { kernel, inputs, outputs, .. } => {
                    let k = &man.kernels[*kernel as usize];
                    let body = g.block_by_name(&k.body).map(|b| g.block(b)).unwrap_or_else(|| panic!("no block @{}", k.body));
                    assert_eq!((inputs.len(), outputs.len()), (body.args.len(), body.outputs.len()), "{}", k.name);
                    seen.insert(*kernel);
                }
                Step::Loop { body, prefetch, .. } => {
                    check(prefetch, man, g, seen);
                    check(body, man, g, seen);
                }
                _ => {}
            }
        }
    }
    let mut seen = HashSet::new();
    check(&man.ranks[0].steps, &man, &g, &mut seen);
    assert_eq!(seen.len(), man.kernels.len());
}

/// The code generator's threads change nothing but the time: one thread and four give the same
/// code for every body of the debug model, every body is handed to `generated` exactly once, and
/// the kernels `ptxas` is slowest on go first on one thread.
#[test]
fn codegen_on_several_threads_gives_what_one_thread_gives() {
    let text = debug_text();
    let m = titan_ir::parse::parse_and_verify("llama3-debug.ir", &text).unwrap_or_else(|e| panic!("{e}"));
    let fused = kernel_graph(&m);
    let plan = plan_kernel_graph(&fused).unwrap_or_else(|e| panic!("{e}"));
    let (bodies, _) = kernel_table(&fused, &plan).unwrap_or_else(|e| panic!("{e}"));
    let run = |threads: usize| {
        let handed = std::sync::Mutex::new(Vec::new());
        let mut notes = Vec::new();
        let code = codegen(threads, &fused, &bodies, &titan_kernels::Lowered::default(), &mut notes, &|i, _| handed.lock().expect("lock").push(i))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(notes.is_empty(), "{notes:?}");
        let order = handed.into_inner().expect("lock");
        (code.into_iter().map(|c| c.map(|c| (c.entry, c.ptx, c.launch, c.workspace_bytes))).collect::<Vec<_>>(), order)
    };
    let (one, order) = run(1);
    let (four, mut handed) = run(4);
    assert_eq!(one, four);
    let with_code: Vec<usize> = (0..bodies.len()).filter(|&i| one[i].is_some()).collect();
    handed.sort_unstable();
    assert_eq!(handed, with_code, "every body with code is handed over once");
    let kinds: Vec<KernelKind> = order.iter().map(|&i| bodies[i].1).collect();
    assert_eq!(kinds.first(), Some(&KernelKind::Optimizer), "{kinds:?}");
    assert_eq!(&kinds[1..3], &[KernelKind::AttentionBwd, KernelKind::Attention], "{kinds:?}");
}

#[test]
fn builds_are_byte_identical_and_hashed() {
    let text = debug_text();
    let m = titan_ir::parse::parse_and_verify("llama3-debug.ir", &text).unwrap_or_else(|e| panic!("{e}"));
    let dir = scratch("determinism");
    let (a, b) = (dir.join("a"), dir.join("b"));
    let opts = BuildOptions::default();
    let sa = build_artifact(&m, &text, &opts, &a).unwrap_or_else(|e| panic!("{e}"));
    let sb = build_artifact(&m, &text, &opts, &b).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(sa.content_hash, sb.content_hash);
    assert_eq!(sa.content_hash.len(), 64);
    let files = |root: &Path| -> Vec<(PathBuf, Vec<u8>)> {
        let mut out = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{e}")).flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    out.push((p.strip_prefix(root).unwrap_or(&p).to_path_buf(), std::fs::read(&p).unwrap_or_default()));
                }
            }
        }
        out.sort();
        out
    };
    let (fa, fb) = (files(&a), files(&b));
    assert!(fa.len() >= 2 + sa.ptx_files + sa.cubin_files, "manifest, graph, the PTX files and the cubins: {:?}", fa.iter().map(|f| &f.0).collect::<Vec<_>>());
    assert_eq!(fa.len(), fb.len());
    for ((pa, ca), (pb, cb)) in fa.iter().zip(&fb) {
        assert_eq!(pa, pb);
        assert!(ca == cb, "{} differs between two builds", pa.display());
    }
    // Any effective option changes the hash; the model text does too.
    let mut other = opts.clone();
    other.train.lr = 1e-3;
    assert_ne!(content_hash(&text, &other), sa.content_hash);
    assert_ne!(content_hash(&format!("{text}\n"), &opts), sa.content_hash);
    // No build-time switch set hashes as without switches; one set changes the hash.
    assert_eq!(content_hash_with(&text, &opts, &BTreeMap::new()), sa.content_hash);
    let split = BTreeMap::from([("TITAN_SCATTER_SPLIT".to_string(), "1".to_string())]);
    assert_ne!(content_hash_with(&text, &opts, &split), sa.content_hash);
    let split2 = BTreeMap::from([("TITAN_SCATTER_SPLIT".to_string(), "2".to_string())]);
    assert_ne!(content_hash_with(&text, &opts, &split2), content_hash_with(&text, &opts, &split));
    // The manifest reads back.
    let json = std::fs::read_to_string(a.join(titan_ir::artifact::MANIFEST_FILE)).unwrap_or_default();
    let back = Manifest::from_json("manifest.json", &json).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back.content_hash, sa.content_hash);
    assert!(json.starts_with(&format!("{{\n  \"format_version\": {},", titan_ir::artifact::FORMAT_VERSION)), "format_version comes first");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The model hash covers the model and the training options, not the mesh, the partitioning
/// toggles (`--disable-loss-parallel`, `--disable-prefetch-next-layer`), fusion, the pipeline
/// options or the input's formatting; the content hash covers the build choices.
#[test]
fn the_model_hash_ignores_the_mesh_and_build_choices() {
    let text = debug_text();
    let m = titan_ir::parse::parse_and_verify("llama3-debug.ir", &text).unwrap_or_else(|e| panic!("{e}"));
    let base = BuildOptions { train: TrainOptions { lr: 3e-3, ..TrainOptions::default() }, ..BuildOptions::default() };
    let built = |m: &Graph, text: &str, opts: &BuildOptions| compile(m, text, opts, false, None).unwrap_or_else(|e| panic!("{e}")).0;
    let one = built(&m, &text, &base);
    let hash = one.manifest.model_hash.clone().unwrap_or_else(|| panic!("a model hash in the manifest"));
    assert_eq!(hash.len(), 64);
    assert_eq!(hash, titan_passes::model_hash(&m, &base.train));
    // The kernel graph (fused) records it, as the unfused training graph does.
    let fused = titan_ir::parse::parse_and_verify("graph.ir", &one.graph_text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(titan_ir::identity::graph_model_hash(&fused).as_deref(), Some(hash.as_str()));
    let unfused = titan_passes::lower_to_train(&m, &base.train).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(titan_ir::identity::graph_model_hash(&unfused).as_deref(), Some(hash.as_str()));

    let mesh = |r, d, t| titan_ir::Mesh::new(r, d, t);
    let layouts = [
        ("tp 2", BuildOptions { mesh: mesh(1, 1, 2), ..base.clone() }),
        ("tp 2 without loss parallelism", BuildOptions { mesh: mesh(1, 1, 2), loss_parallel: false, ..base.clone() }),
        ("dp_shard 2", BuildOptions { mesh: mesh(1, 2, 1), ..base.clone() }),
        ("dp_shard 2 without prefetch", BuildOptions { mesh: mesh(1, 2, 1), prefetch_next_layer: false, ..base.clone() }),
        (
            "dp_replicate 2 x dp_shard 2 x tp 2, both off",
            BuildOptions { mesh: mesh(2, 2, 2), loss_parallel: false, prefetch_next_layer: false, ..base.clone() },
        ),
    ];
    for (what, opts) in &layouts {
        let a = built(&m, &text, opts);
        assert_eq!(a.manifest.model_hash.as_deref(), Some(hash.as_str()), "{what}");
        assert_ne!(a.manifest.content_hash, one.manifest.content_hash, "{what}");
    }
    // Options that change neither the artifact nor the model.
    let quiet = BuildOptions { report: true, pipeline: PipelineOptions { verify_each: true, timings: true, ..PipelineOptions::default() }, ..base.clone() };
    assert_eq!(built(&m, &text, &quiet).manifest.model_hash.as_deref(), Some(hash.as_str()));
    // The input's formatting: another content hash, the same model.
    let spaced = format!("{text}\n");
    let a = built(&m, &spaced, &base);
    assert_ne!(a.manifest.content_hash, one.manifest.content_hash);
    assert_eq!(a.manifest.model_hash.as_deref(), Some(hash.as_str()));

    // Another learning rate, schedule or clipping, another model: another model hash.
    for (what, train) in [
        ("lr", TrainOptions { lr: 1e-3, ..base.train.clone() }),
        ("warmup", TrainOptions { warmup_steps: 3, ..base.train.clone() }),
        ("max_norm", TrainOptions { max_norm: None, ..base.train.clone() }),
    ] {
        let a = built(&m, &text, &BuildOptions { train, ..base.clone() });
        assert_ne!(a.manifest.model_hash.as_deref(), Some(hash.as_str()), "{what}");
    }
    let deeper = model(Preset::Debug, Some(3));
    let a = built(&deeper, &titan_ir::print::print_graph(&deeper), &base);
    assert_ne!(a.manifest.model_hash.as_deref(), Some(hash.as_str()), "n_layers");
}

/// A manifest of an older format (version 6 had a separate `grads` arena; version 10 shorter
/// lifetimes for a collective's operand) is refused naming
/// the versions this reader reads, before anything else is parsed; version 11 (no kernel
/// epilogues yet) is still read.
#[test]
fn older_manifests_are_refused_with_the_versions_read() {
    let m = model(Preset::Debug, None);
    let man = manifest_of(&m, &titan_ir::print::print_graph(&m));
    let mut v: serde_json::Value = serde_json::from_str(&man.to_json()).unwrap_or_else(|e| panic!("{e}"));
    let back = Manifest::from_json("manifest.json", &v.to_string()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back.format_version, titan_ir::artifact::FORMAT_VERSION);
    for old in [4, 5, 6, 7, 8, 9, 10] {
        v["format_version"] = old.into();
        let e = Manifest::from_json("manifest.json", &v.to_string()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains(&format!("format version {old} is not supported")) && e.contains("reads versions 11 to 12"), "{e}");
        assert!(e.contains("rebuild it with this version's titanc"), "{e}");
    }
    v["format_version"] = 11.into();
    let back = Manifest::from_json("manifest.json", &v.to_string()).unwrap_or_else(|e| panic!("version 11: {e}"));
    assert_eq!(back.format_version, 11);
}

#[test]
fn writes_are_atomic_and_never_clobber_other_directories() {
    let text = debug_text();
    let m = titan_ir::parse::parse_and_verify("llama3-debug.ir", &text).unwrap_or_else(|e| panic!("{e}"));
    let dir = scratch("atomic");
    let leftovers = |d: &Path| -> Vec<String> {
        std::fs::read_dir(d)
            .map(|r| r.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with('.')).collect())
            .unwrap_or_default()
    };
    // A directory that is not an artifact is refused and left alone.
    let user = dir.join("user");
    std::fs::create_dir_all(&user).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(user.join("notes.txt"), "mine").unwrap_or_else(|e| panic!("{e}"));
    let e = build_artifact(&m, &text, &BuildOptions::default(), &user).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("exists and is not a titan artifact"), "{e}");
    assert_eq!(std::fs::read_to_string(user.join("notes.txt")).unwrap_or_default(), "mine");
    // A failing build (unsupported target) leaves nothing behind.
    let out = dir.join("out");
    let bad = BuildOptions { target: titan_ir::artifact::Target { arch: "sm_80".into(), ptx_isa: "7.0".into() }, ..BuildOptions::default() };
    let e = build_artifact(&m, &text, &bad, &out).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("use `--target sm_90a`"), "{e}");
    assert!(!out.exists());
    // A previous artifact is replaced in one rename.
    build_artifact(&m, &text, &BuildOptions::default(), &out).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(out.join("stale.txt"), "old").unwrap_or_else(|e| panic!("{e}"));
    build_artifact(&m, &text, &BuildOptions::default(), &out).unwrap_or_else(|e| panic!("{e}"));
    assert!(!out.join("stale.txt").exists(), "the old artifact is replaced as a whole");
    assert!(out.join("manifest.json").is_file());
    assert!(leftovers(&dir).is_empty(), "temporary directories left: {:?}", leftovers(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}

/// An f32 model builds: the kernels the GPU generator has no pattern for (attention is bf16-only)
/// get no PTX and a note, so the artifact still runs on the CPU backend.
#[test]
fn unsupported_gpu_patterns_leave_kernels_without_ptx_and_say_so() {
    let mut cfg = LlamaConfig::preset(Preset::Debug);
    cfg.dtype = titan_ir::DType::F32;
    let m = build_llama3(&cfg, "debug_f32").expect("model");
    let text = titan_ir::print::print_graph(&m);
    let (artifact, summary) = compile_artifact(&m, &text, &BuildOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let without: Vec<&str> = artifact.manifest.kernels.iter().filter(|k| k.ptx.is_none() && k.kind != KernelKind::Gemm).map(|k| k.name.as_str()).collect();
    assert_eq!(without.len(), 2, "the two attention kernels: {without:?}");
    assert!(without.iter().all(|n| n.contains("attention")), "{without:?}");
    assert_eq!(summary.notes.iter().filter(|n| n.starts_with("no GPU code")).count(), 2, "{:?}", summary.notes);
    let shown = summary.to_string();
    assert!(shown.contains("note: no GPU code: kernel `layer.k6_attention` (attention)"), "{shown}");
    assert!(shown.contains("the artifact runs on the CPU backend only"), "{shown}");
}

/// A `--float8 rowwise` debug build has GPU code for every kernel (quantization, scales and
/// amaxes are generated kernels, the transposed fp8 operands stored by the quantizing kernels),
/// and every scaled GEMM is TN with scalar (unit) scales, the only kind Hopper's cuBLASLt takes:
/// the power-of-2 row and column scales multiply the product in the consuming kernel.
#[test]
fn float8_rowwise_debug_build_has_gpu_code_and_tn_gemms() {
    let m = build_llama3(&LlamaConfig::preset(Preset::Debug), "debug_f8").expect("model");
    let text = titan_ir::print::print_graph(&m);
    let train = TrainOptions { float8: Some(titan_passes::float8::Float8Options::new(titan_ir::Float8Recipe::Rowwise)), ..TrainOptions::default() };
    let opts = BuildOptions { train, ..BuildOptions::default() };
    let (artifact, summary) = compile_artifact(&m, &text, &opts).unwrap_or_else(|e| panic!("{e}"));
    let without: Vec<&str> = artifact.manifest.kernels.iter().filter(|k| k.ptx.is_none() && k.kind != KernelKind::Gemm).map(|k| k.name.as_str()).collect();
    assert!(without.is_empty(), "kernels without GPU code: {without:?}\n{summary}");
    let scaled: Vec<_> = artifact.manifest.kernels.iter().filter_map(|k| k.gemm.as_ref()).filter(|g| !g.scale_a.is_none()).collect();
    assert_eq!(scaled.len(), 24, "3 GEMMs for each of the 8 linears");
    for g in scaled {
        assert!(!g.transpose_a && g.transpose_b, "not TN: {g:?}");
        assert_eq!((g.scale_a, g.scale_b), (titan_ir::artifact::GemmScale::Tensor, titan_ir::artifact::GemmScale::Tensor), "{g:?}");
        assert_eq!((g.a_dtype, g.b_dtype), (titan_ir::DType::F8E4M3, titan_ir::DType::F8E4M3), "{g:?}");
    }
}

/// With Llama 3's vocabulary the output head's grad_weight needs the column amax of `dy` over
/// rows of 128256 logits; it is a column kernel with GPU code, so `--float8 rowwise` with the
/// head in fp8 (TorchTitan's default, no filter) runs on the GPU.
#[test]
fn float8_rowwise_head_with_the_llama3_vocabulary_has_gpu_code() {
    let cfg = LlamaConfig { vocab_size: 128256, n_layers: 1, ..LlamaConfig::preset(Preset::Debug) };
    let m = build_llama3(&cfg, "debug_f8_vocab").expect("model");
    let text = titan_ir::print::print_graph(&m);
    let train = TrainOptions { float8: Some(titan_passes::float8::Float8Options::new(titan_ir::Float8Recipe::Rowwise)), ..TrainOptions::default() };
    let opts = BuildOptions { train, ..BuildOptions::default() };
    // PTX only (no ptxas): the kernels' assembly is `titan-kernels`' test.
    let (artifact, summary) = compile(&m, &text, &opts, true, None).unwrap_or_else(|e| panic!("{e}"));
    let without: Vec<&str> = artifact.manifest.kernels.iter().filter(|k| k.ptx.is_none() && k.kind != KernelKind::Gemm).map(|k| k.name.as_str()).collect();
    assert!(without.is_empty(), "kernels without GPU code: {without:?}\n{summary}");
    let head_amax = artifact.manifest.kernels.iter().filter(|k| k.name.starts_with("main.") && k.name.ends_with("_abs_reduce_max")).count();
    assert!(head_amax >= 1, "the head's column amax is a kernel of `main`\n{summary}");
}

/// With `ptxas`, every PTX kernel of the debug model also ships an sm_90a cubin (an ELF image),
/// listed in the manifest, written next to the PTX, and read back from the manifest.
#[test]
fn debug_build_ships_a_cubin_per_ptx_kernel() {
    let Some(ptxas) = titan_kernels::find_ptxas() else {
        eprintln!("ptxas not found; skipping the cubin build test");
        return;
    };
    let text = debug_text();
    let m = titan_ir::parse::parse_and_verify("llama3-debug.ir", &text).unwrap_or_else(|e| panic!("{e}"));
    let (artifact, summary) = compile(&m, &text, &BuildOptions::default(), true, Some(&ptxas)).unwrap_or_else(|e| panic!("{e}"));
    assert!(summary.notes.is_empty(), "{:?}", summary.notes);
    assert!(summary.ptx_files > 0);
    assert_eq!(summary.cubin_files, summary.ptx_files);
    assert!(summary.to_string().contains(&format!("{} PTX files, {} cubins", summary.ptx_files, summary.cubin_files)));
    for k in &artifact.manifest.kernels {
        assert_eq!(k.cubin.is_some(), k.ptx.is_some(), "{}", k.name);
        if let Some(c) = &k.cubin {
            assert_eq!(c, &format!("kernels/{}.cubin", k.name));
            let (_, image) = artifact.cubins.iter().find(|(p, _)| p == c).unwrap_or_else(|| panic!("{c} not in the artifact"));
            assert!(image.starts_with(b"\x7fELF"), "{c} is not an ELF image");
        }
    }
    let back = Manifest::from_json("manifest.json", &artifact.manifest.to_json()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back, artifact.manifest);
    let dir = scratch("cubins");
    let out = dir.join("a");
    emit::write_artifact(&out, &artifact).unwrap_or_else(|e| panic!("{e}"));
    for (p, image) in &artifact.cubins {
        assert_eq!(&std::fs::read(out.join(p)).unwrap_or_default(), image, "{p}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without `ptxas` the build still succeeds: PTX only, no `cubin` entries, and a note saying
/// how to get cubins. `TITAN_PTXAS` naming a missing file is how users get here.
#[test]
fn without_ptxas_the_build_ships_ptx_only_and_says_so() {
    let text = debug_text();
    let m = titan_ir::parse::parse_and_verify("llama3-debug.ir", &text).unwrap_or_else(|e| panic!("{e}"));
    let (artifact, summary) = compile(&m, &text, &BuildOptions::default(), true, None).unwrap_or_else(|e| panic!("{e}"));
    assert!(artifact.cubins.is_empty());
    assert!(artifact.manifest.kernels.iter().all(|k| k.cubin.is_none()));
    assert!(artifact.manifest.kernels.iter().any(|k| k.ptx.is_some()));
    assert_eq!(summary.cubin_files, 0);
    assert!(!artifact.manifest.to_json().contains("cubin"), "no `cubin` keys in the manifest");
    let shown = summary.to_string();
    assert!(shown.contains("note: ptxas not found") && shown.contains("TITAN_PTXAS"), "{shown}");
    // A ptxas that cannot run gives notes, never a failed build.
    let (artifact, summary) = compile(&m, &text, &BuildOptions::default(), true, Some(Path::new("/nonexistent/ptxas"))).unwrap_or_else(|e| panic!("{e}"));
    assert!(artifact.cubins.is_empty());
    assert_eq!(summary.notes.len(), 1, "one note, not one per kernel: {:?}", summary.notes);
    assert!(summary.notes[0].starts_with("no cubins") && summary.notes[0].contains("/nonexistent/ptxas"), "{:?}", summary.notes);
}

/// A kernel `ptxas` rejects keeps its PTX with a note naming it; every other kernel, of the
/// training and the eval step, still gets its cubin, and the results land on their own kernels
/// whatever order the workers finish in. The `ptxas` here is a wrapper that refuses the
/// attention forward (the training step's and the eval step's) and runs the real one on the rest;
/// its `--version` banner differs, so the cubin cache never answers for it with the real one's.
#[test]
fn a_kernel_ptxas_rejects_keeps_its_ptx_and_the_others_get_cubins() {
    let Some(real) = titan_kernels::find_ptxas() else {
        eprintln!("ptxas not found; skipping the partial ptxas failure test");
        return;
    };
    let dir = scratch("ptxas_rejects");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let wrapper = dir.join("ptxas");
    let script = format!(
        "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'wrapper refusing attention'; exec '{real}' --version; fi\n\
         for a in \"$@\"; do case \"$a\" in *.ptx) if grep -q '^.visible .entry [a-z_]*layer_k6_attention(' \"$a\"; then echo 'refused' >&2; exit 1; fi;; esac; done\n\
         exec '{real}' \"$@\"\n",
        real = real.display()
    );
    std::fs::write(&wrapper, script).unwrap_or_else(|e| panic!("{e}"));
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap_or_else(|e| panic!("{e}"));
    let text = debug_text();
    let m = titan_ir::parse::parse_and_verify("llama3-debug.ir", &text).unwrap_or_else(|e| panic!("{e}"));
    let (artifact, summary) = compile(&m, &text, &BuildOptions::default(), true, Some(&wrapper)).unwrap_or_else(|e| panic!("{e}"));
    let eval = artifact.manifest.eval.as_ref().expect("an eval step");
    let refused = ["layer.k6_attention", "eval_layer.k6_attention"];
    for k in artifact.manifest.kernels.iter().chain(&eval.kernels).filter(|k| k.ptx.is_some()) {
        assert_eq!(k.cubin.is_none(), refused.contains(&k.name.as_str()), "{}: {:?}", k.name, k.cubin);
    }
    assert_eq!(summary.cubin_files + 2, summary.ptx_files);
    assert_eq!(summary.notes.len(), 2, "{:?}", summary.notes);
    for (note, name) in summary.notes.iter().zip(refused) {
        assert!(note.starts_with(&format!("no cubin for `kernels/{name}.ptx`")) && note.contains("refused"), "{note}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The lifetimes a loader recomputes from the manifest alone
/// (`titan_ir::artifact::liveness`, which `titan-run` checks placements with) are the planner's,
/// on one device, an 8B-shaped model and SPMD builds (FSDP x TP, and FSDP over an odd layer count
/// with prefetched carries).
#[test]
fn manifest_lifetimes_are_the_planners() {
    let one = titan_ir::Mesh::new(1, 1, 1);
    for (p, layers, mesh) in [
        (Preset::Debug, None, one),
        (Preset::B8, Some(3), one),
        (Preset::Debug, None, titan_ir::Mesh::new(1, 2, 2)),
        (Preset::Debug, Some(3), titan_ir::Mesh::new(1, 2, 1)),
        (Preset::Debug, None, titan_ir::Mesh::new(1, 2, 4)),
    ] {
        let m = model(p, layers);
        // tp 4: with async TP (ring views, and the data-parallel stream's pinned buffers).
        let async_tp = (mesh.size(titan_ir::MeshDim::Tp) == 4).then_some(titan_passes::async_tp::AsyncTpMode::All);
        let opts = BuildOptions { mesh, async_tp, ..BuildOptions::default() };
        let manifest = compile(&m, "", &opts, false, None).unwrap_or_else(|e| panic!("{p} {mesh:?}: {e}")).0.manifest;
        let mut meshed = m.clone();
        if mesh.world_size() > 1 {
            mesh.write_meta(&mut meshed);
        }
        if let Some(mode) = async_tp {
            titan_passes::async_tp::enable_async_tp(&mut meshed, mode);
        }
        let plan = plan_kernel_graph(&kernel_graph(&meshed)).unwrap_or_else(|e| panic!("{e}"));
        let planner: Vec<Option<(u32, u32)>> = plan.lifetimes.iter().map(|l| l.map(|l| (l.start, l.end))).collect();
        let derived: Vec<Option<(u32, u32)>> =
            titan_ir::artifact::liveness::buffer_lifetimes(&manifest, 0).iter().map(|l| l.map(|l| (l.start, l.end))).collect();
        assert_eq!(derived.len(), planner.len(), "{p} {mesh:?}");
        for (i, (d, q)) in derived.iter().zip(&planner).enumerate() {
            assert_eq!(d, q, "{p} {mesh:?}: buffer {i} (`{}`)", manifest.buffers[i].name);
        }
    }
}

/// Async TP on dp_shard 2 x tp 2 and tp 4: the memory plan turns the ring slices and concats
/// into ring views (no copy step but the one of the gathered value assembled from the
/// backward's carried cotangent), every rank's shadow execution reads what was written, and no
/// two buffers live at once share a byte. Then, with and without async TP: a buffer a
/// data-parallel collective in a loop reads lives across the loop, so no tp collective of a
/// layer waits for a dp_shard one (`join_points`' cross-stream waits), whatever the plan
/// reused. (Outside the loops such a wait remains on this model: a top-level reduce-scatter
/// over tp waits for the dp_shard reduce-scatter issued just before it.) And in the loops the
/// compute stream joins a collective only where it touches its result.
#[test]
fn async_tp_plans_use_ring_views_and_the_streams_do_not_wait_on_each_other() {
    use titan_ir::artifact::CollectiveOp;
    use titan_ir::artifact::timeline::{self, UnrolledOp};
    let m = model(Preset::Debug, None);
    for (mesh, async_tp) in [
        (titan_ir::Mesh::new(1, 2, 2), None),
        (titan_ir::Mesh::new(1, 2, 2), Some(titan_passes::async_tp::AsyncTpMode::All)),
        (titan_ir::Mesh::new(1, 1, 4), Some(titan_passes::async_tp::AsyncTpMode::All)),
    ] {
        let opts = BuildOptions { mesh, async_tp, ..BuildOptions::default() };
        let manifest = compile(&m, "", &opts, false, None).unwrap_or_else(|e| panic!("{mesh:?}: {e}")).0.manifest;
        let steps = all_steps(&manifest.ranks[0].steps);
        let count = |op: CollectiveOp| steps.iter().filter(|s| matches!(s, Step::Collective { collective, .. } if *collective == op)).count();
        let rings = steps.iter().flat_map(|s| titan_ir::artifact::liveness::step_refs(s)).filter(|r| matches!(r, BufRef::View { ring: Some(_), .. })).count();
        if async_tp.is_some() {
            assert!(count(CollectiveOp::RingShift) > 0, "{mesh:?}");
            assert_eq!((count(CollectiveOp::RingSlice), count(CollectiveOp::RingConcat)), (0, 1), "{mesh:?}: ring views, not copy steps");
            assert!(rings > 0, "{mesh:?}");
        }
        // Every tp coordinate's ranks read what was written (the ring offsets differ per rank).
        for coord in 0..mesh.size(titan_ir::MeshDim::Tp) as usize {
            let errors = shadow_execute_rank(&manifest, coord);
            assert!(errors.is_empty(), "{mesh:?} tp coordinate {coord}: {} bad reads, first: {:#?}", errors.len(), &errors[..errors.len().min(10)]);
        }
        let ops = timeline::unroll(&manifest, 0).unwrap_or_else(|e| panic!("{e}"));
        let stream: Vec<Option<usize>> = ops.iter().map(UnrolledOp::comm_stream).collect();
        let ranges: Vec<Vec<(u64, u64)>> = ops.iter().map(|o| o.ranges.clone()).collect();
        let reads: Vec<usize> = ops.iter().map(|o| o.reads).collect();
        let joins = timeline::join_points(&stream, &ranges, &reads);
        let comm: Vec<usize> = stream.iter().enumerate().filter(|(_, s)| s.is_some()).map(|(i, _)| i).collect();
        // Inside the layer loops (outside them the rule does not apply: `liveness`).
        for (c, waits) in joins.comm_waits.iter().enumerate() {
            for &w in waits.iter().filter(|_| ops[comm[c]].at.contains(", layer ")) {
                assert!(
                    !(stream[comm[c]] == Some(timeline::TP_STREAM) && stream[comm[w]] == Some(timeline::DATA_STREAM)),
                    "{mesh:?} async {async_tp:?}: {} ({}) waits for {} ({})",
                    ops[comm[c]].name,
                    ops[comm[c]].at,
                    ops[comm[w]].name,
                    ops[comm[w]].at
                );
            }
        }
        // Inside a layer the compute stream joins each collective where it touches the result,
        // never earlier because a later op of the layer overwrites bytes the collective still
        // reads (`liveness::held_until_joined`: before it, each chunk GEMM of the reduce-scatter
        // ring wrote over the partial the previous `ring_shift` was sending, and waited for it).
        // (Across layers such a wait remains: the next layer's weight-gradient GEMM writes the
        // buffer the previous layer's dp_shard reduce-scatter reads, one buffer per loop.)
        let overlaps = |a: &[(u64, u64)], b: &[(u64, u64)]| a.iter().any(|&(s, n)| b.iter().any(|&(t, m)| s < t + m && t < s + n));
        // `schedule step L.S, layer N`: the loop L's iteration for layer N.
        let layer = |at: &str| at.split_once(", layer ").map(|(step, l)| (step.split('.').next().unwrap_or_default().to_string(), l.to_string()));
        for (k, joined) in joins.before.iter().enumerate() {
            for &c in joined.iter().filter(|&&c| layer(&ops[comm[c]].at).is_some() && layer(&ops[comm[c]].at) == layer(&ops[k].at)) {
                let col = &ops[comm[c]];
                let result = &col.ranges[col.reads..];
                assert!(
                    overlaps(&ops[k].ranges, result),
                    "{mesh:?} async {async_tp:?}: {} ({}) waits for {} ({}) without touching its result: a write over its operand",
                    ops[k].name,
                    ops[k].at,
                    col.name,
                    col.at
                );
            }
        }
    }
}

/// `titanc build` warns when a rank's predicted peak (plan + library workspaces) exceeds the
/// device memory: the 70B preset at tp 8 without dp_shard (178 GiB per rank) against
/// the default 80 GiB and `--device-memory 141`, naming both numbers and a dp_shard that fits;
/// the debug model does not warn, and a large enough budget silences it.
#[test]
fn a_rank_that_does_not_fit_the_device_warns() {
    let m = model(Preset::B70, None);
    let opts = BuildOptions { mesh: titan_ir::Mesh::new(1, 1, 8), ..BuildOptions::default() };
    let (_, summary) = compile(&m, "", &opts, false, None).unwrap_or_else(|e| panic!("{e}"));
    let peak = summary.peak_bytes_per_rank[0];
    assert!(peak > 141 << 30, "{}", human_bytes(peak));
    for (budget, named) in [(None, "the 80 GiB of an H100 (the sm_90a default"), (Some(141.0), "the 141.00 GiB of `--device-memory 141`")] {
        let w = device_memory::memory_warning(&summary, "sm_90a", budget).expect("warns");
        assert!(w.starts_with("each rank needs "), "{w}");
        assert!(w.contains(&format!("memory plan {} + library workspaces", human_bytes(peak))), "{w}");
        assert!(w.contains(named), "{w}");
        assert!(w.contains("`--dp-shard "), "{w}");
    }
    assert_eq!(device_memory::memory_warning(&summary, "sm_90a", Some(4096.0)), None);
    let (_, debug) = compile(&model(Preset::Debug, None), "", &BuildOptions::default(), false, None).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(device_memory::memory_warning(&debug, "sm_90a", None), None);
    assert!(debug.to_string().contains("  library workspaces    32.00 MiB  cuBLASLt 32.00 MiB"), "{debug}");
    assert_eq!(device_memory::parse_gib("141"), Ok(141.0));
    assert!(device_memory::parse_gib("-1").is_err() && device_memory::parse_gib("nan").is_err() && device_memory::parse_gib("0").is_err());
}

/// Every step of `steps`, loop bodies and prefetches included.
fn all_steps(steps: &[Step]) -> Vec<&Step> {
    let mut out = Vec::new();
    for s in steps {
        out.push(s);
        if let Step::Loop { body, prefetch, .. } = s {
            out.extend(all_steps(prefetch));
            out.extend(all_steps(body));
        }
    }
    out
}

/// Every-N-th layer checkpointing on 3 layers (a group of 2 and a remainder layer), on one rank
/// and at tp 2 x dp_shard 2: the group reads its weights through offset views and its gradients'
/// concats are computed in place (no copy into a view), every read sees its producer's
/// bytes, and the loader's lifetimes are the planner's.
#[test]
fn every_n_th_layer_plans_use_offset_views_soundly() {
    use titan_passes::activation_checkpoint::AcPolicy;
    let m = model(Preset::Debug, Some(3));
    for mesh in [titan_ir::Mesh::new(1, 1, 1), titan_ir::Mesh::new(1, 2, 2)] {
        let opts = BuildOptions { mesh, ac: AcPolicy::SelectiveEvery(2), ..BuildOptions::default() };
        let manifest = compile(&m, "", &opts, false, None).unwrap_or_else(|e| panic!("{mesh:?}: {e}")).0.manifest;
        let steps = all_steps(&manifest.ranks[0].steps);
        let views = steps.iter().flat_map(|s| titan_ir::artifact::liveness::step_refs(s)).filter(|r| matches!(r, BufRef::View { .. })).count();
        assert!(views > 0, "{mesh:?}: the group reads offset views");
        // A concat operand that is not computed in place is copied into a view of the result
        // (the copies into the first slice of a carry's stack are not concat copies).
        let is_stack = |r: &BufRef| matches!(r, BufRef::View { buffer, .. } if manifest.buffers[*buffer as usize].name.ends_with(".stack"));
        let concat_copies = steps.iter().filter(|s| matches!(s, Step::Copy { dst: dst @ BufRef::View { .. }, .. } if !is_stack(dst))).count();
        assert_eq!(concat_copies, 0, "{mesh:?}: the concats are computed in place");
        let loops: Vec<u32> = steps.iter().filter_map(|s| if let Step::Loop { count, .. } = s { Some(*count) } else { None }).collect();
        assert_eq!(loops, [1, 1, 1, 1], "{mesh:?}: group and remainder loops, forward and backward");
        let errors = shadow_execute(&manifest);
        assert!(errors.is_empty(), "{mesh:?}: {} bad reads, first: {:#?}", errors.len(), &errors[..errors.len().min(10)]);
        let plan = plan_kernel_graph(&kernel_graph(&with_layout_meta(&m, &opts))).unwrap_or_else(|e| panic!("{e}"));
        let planner: Vec<Option<(u32, u32)>> = plan.lifetimes.iter().map(|l| l.map(|l| (l.start, l.end))).collect();
        let derived: Vec<Option<(u32, u32)>> =
            titan_ir::artifact::liveness::buffer_lifetimes(&manifest, 0).iter().map(|l| l.map(|l| (l.start, l.end))).collect();
        assert_eq!(derived, planner, "{mesh:?}: lifetimes");
        assert!(overlapping_buffers(&plan.storage.buffers, &plan.lifetimes).is_empty(), "{mesh:?}");
    }
}
