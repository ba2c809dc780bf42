//! `compute-copies`: the bf16 compute copies of the masters are state carried across steps and
//! written by the optimizer kernel, instead of cast from the masters at the top of every step.
//! A schedule change only, so every run here must equal, bit for bit, the training step that
//! still casts the copies each step (`lower_to_train_casting_copies`, the lowering titanc did
//! before): losses, gradient norms and every master and moment, on one rank and on the simulated
//! mesh (dp_shard, tp, both), in bf16 and with float8; states set from a checkpoint (resume)
//! refresh the copies; the step no longer reads a master outside the optimizer (but the lookup of
//! a large embedding table, which gathers fp32 rows and casts them: the table has no copy).

use std::time::Instant;

use crate::common::{Run, Scratch, scratch, train_options};
use titan_compiler::build::{BuildOptions, BuildSummary, build_artifact};
use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::artifact::{BufRef, BufferClass, Manifest, Step};
use titan_ir::{Float8Recipe, Graph, KernelKind, Mesh};
use titan_passes::float8::Float8Options;
use titan_passes::{TrainOptions, lower_to_train, lower_to_train_casting_copies};
use titan_runtime::{Artifact, ArtifactMeshTrainer, CpuArtifactTrainer, CpuTrainer, MeshTrainer, Trainer};

const STEPS: usize = 4;

/// `steps` steps from batch `from`, with every state sorted by name (graph mode and artifacts
/// list them in different orders).
fn train(t: &mut dyn Trainer, from: u64, steps: usize) -> Run {
    let (batch, seq) = (t.batch_size(), t.seq_len());
    Run::train_from(t, batch, seq, from, steps, |t| {
        let mut s = t.states().expect("states");
        s.sort_by(|a, b| a.0.cmp(&b.0));
        s
    })
}

fn bf16_debug() -> Graph {
    build_llama3(&LlamaConfig::preset(Preset::Debug), "llama3_debug").expect("debug model")
}

/// The debug model with a 4096-token vocabulary: 8 table rows per looked-up token (512), so the
/// table gets no copy and its lookup casts the fp32 rows it gathers.
fn big_vocab() -> Graph {
    build_llama3(&LlamaConfig { vocab_size: 4096, ..LlamaConfig::preset(Preset::Debug) }, "llama3_debug").expect("debug model, vocabulary 4096")
}

fn build(model: &Graph, opts: BuildOptions, name: &str) -> (Scratch, BuildSummary) {
    let dir = scratch("compute-copies", name);
    let summary = build_artifact(model, &titan_ir::print::print_graph(model), &opts, dir.as_ref()).unwrap_or_else(|e| panic!("building {name}: {e}"));
    (dir, summary)
}

/// One rank: graph mode with the casts (the reference), graph mode with carried copies, and
/// the artifact, all equal.
fn check_single(model: &Graph, opts: TrainOptions, name: &str) {
    let start = Instant::now();
    let old = lower_to_train_casting_copies(model, &opts).expect("lowering with casts");
    let new = lower_to_train(model, &opts).expect("lowering");
    let copies = |g: &Graph| g.main.args.iter().filter(|a| a.kind.param_info().is_some_and(|p| p.compute_copy_of().is_some())).count();
    assert_eq!(copies(&old), 0);
    assert!(copies(&new) > 0, "{name}: the lowering carries compute copies");
    let want = train(&mut CpuTrainer::new(&old, 3).expect("graph trainer"), 0, STEPS);
    let graph = train(&mut CpuTrainer::new(&new, 3).expect("graph trainer"), 0, STEPS);
    want.assert_bitwise(&graph, &format!("{name} graph mode"));
    let (dir, _) = build(model, BuildOptions { train: opts, ..BuildOptions::default() }, name);
    let a = Artifact::load(&dir).expect("load");
    let got = train(&mut CpuArtifactTrainer::new(&a, 3).expect("artifact trainer"), 0, STEPS);
    want.assert_bitwise(&got, &format!("{name} artifact"));
    println!("{name}: {:.1} s", start.elapsed().as_secs_f64());
}

#[test]
fn bf16_carried_copies_equal_casting_them_every_step() {
    check_single(&bf16_debug(), train_options(), "bf16");
    check_single(&big_vocab(), train_options(), "bf16-big-vocab");
}

#[test]
fn float8_carried_copies_equal_casting_them_every_step() {
    check_single(&bf16_debug(), TrainOptions { float8: Some(Float8Options::new(Float8Recipe::Rowwise)), ..train_options() }, "float8-rowwise");
}

/// The simulated mesh: graph mode with the casts against the artifact with carried copies.
fn check_mesh(mesh: Mesh, name: &str) {
    let mut model = bf16_debug();
    mesh.write_meta(&mut model);
    let old = lower_to_train_casting_copies(&model, &train_options()).expect("lowering with casts");
    let want = train(&mut MeshTrainer::new(&old, 5).expect("mesh trainer"), 0, STEPS);
    let (dir, _) = build(&bf16_debug(), BuildOptions { train: train_options(), mesh, ..BuildOptions::default() }, name);
    let a = Artifact::load(&dir).expect("load");
    let got = train(&mut ArtifactMeshTrainer::new(&a, 5).expect("artifact mesh trainer"), 0, STEPS);
    want.assert_bitwise(&got, &format!("{name} artifact mesh"));
}

#[test]
fn dp_shard_2_carried_copies_equal_casting_them_every_step() {
    check_mesh(Mesh::new(1, 2, 1), "fsdp2");
}

#[test]
fn tp_2_carried_copies_equal_casting_them_every_step() {
    check_mesh(Mesh::new(1, 1, 2), "tp2");
}

#[test]
fn dp_shard_2_tp_2_carried_copies_equal_casting_them_every_step() {
    check_mesh(Mesh::new(1, 2, 2), "fsdp2-tp2");
}

/// Setting the states (what `--resume` does) recasts the copies: a trainer started from other
/// weights and given the states of a run after 3 steps continues it bit for bit. Without the
/// recast it would read its own initial copies and diverge.
#[test]
fn setting_the_masters_recasts_the_copies() {
    let (dir, _) = build(&bf16_debug(), BuildOptions { train: train_options(), ..BuildOptions::default() }, "resume");
    let a = Artifact::load(&dir).expect("load");
    let mut full = CpuArtifactTrainer::new(&a, 1).expect("trainer");
    let want = train(&mut full, 0, 5);
    let mut first = CpuArtifactTrainer::new(&a, 1).expect("trainer");
    train(&mut first, 0, 3);
    let mut resumed = CpuArtifactTrainer::new(&a, 99).expect("trainer");
    for (name, t) in Trainer::states(&first).expect("states") {
        Trainer::set_state(&mut resumed, &name, t.floats().expect("float")).expect("set state");
    }
    Trainer::set_steps_done(&mut resumed, 3).expect("steps");
    let got = train(&mut resumed, 3, 2);
    let tail = Run { losses: want.losses[3..].to_vec(), grad_norms: want.grad_norms[3..].to_vec(), states: want.states };
    tail.assert_bitwise(&got, "the last 2 steps after the resume");
}

/// Every buffer a launch reads, anywhere in the schedule.
fn launch_inputs(steps: &[Step], kernels: &[titan_ir::artifact::Kernel], out: &mut Vec<(KernelKind, u32)>) {
    for s in steps {
        match s {
            Step::Loop { body, prefetch, .. } => {
                launch_inputs(body, kernels, out);
                launch_inputs(prefetch, kernels, out);
            }
            Step::Launch { kernel, inputs, .. } => {
                for r in inputs {
                    if let BufRef::Buffer { buffer, .. } | BufRef::View { buffer, .. } = r {
                        out.push((kernels[*kernel as usize].kind, *buffer));
                    }
                }
            }
            _ => {}
        }
    }
}

/// The built step: one compute copy per bf16 master, written in place by the optimizer kernel,
/// and no kernel but the optimizer reads a master (the casts at the top of the step are gone);
/// with a table of more than 5 rows per token (vocabulary 4096, 512 tokens) the embedding has no
/// copy and its lookup gathers the fp32 rows and casts them, bit-identically.
#[test]
fn only_the_optimizer_reads_the_masters_and_it_writes_the_copies() {
    let (dir, summary) = build(&big_vocab(), BuildOptions { train: train_options(), ..BuildOptions::default() }, "schedule");
    let m = Manifest::from_json("manifest.json", &std::fs::read_to_string(dir.join("manifest.json")).expect("read")).expect("manifest");
    let masters: Vec<u32> = m.buffers.iter().filter(|b| b.class == BufferClass::Param).map(|b| b.id).collect();
    let copies: Vec<u32> = m.buffers.iter().filter(|b| b.class == BufferClass::ComputeCopy).map(|b| b.id).collect();
    assert_eq!(masters.len(), copies.len() + 1, "every master of the bf16 model but the embedding table has a copy");
    let mut reads = Vec::new();
    let steps = &m.ranks[0].steps;
    launch_inputs(steps, &m.kernels, &mut reads);
    let readers: Vec<KernelKind> = reads.iter().filter(|(_, b)| masters.contains(b)).map(|(k, _)| *k).collect();
    assert!(!readers.is_empty());
    assert!(readers.iter().all(|k| matches!(k, KernelKind::Optimizer | KernelKind::Gather)), "masters read by {readers:?}");
    assert_eq!(readers.iter().filter(|k| **k == KernelKind::Gather).count(), 1, "one lookup reads the fp32 table: {readers:?}");
    let written: Vec<u32> = steps
        .iter()
        .filter_map(|s| match s {
            Step::Launch { kernel, outputs, .. } if m.kernels[*kernel as usize].kind == KernelKind::Optimizer => Some(outputs),
            _ => None,
        })
        .flatten()
        .filter_map(BufRef::buffer_id)
        .collect();
    assert!(copies.iter().all(|c| written.contains(c)), "the optimizer writes every copy");
    println!("launches per step: {}", summary.launches_per_step);
}
