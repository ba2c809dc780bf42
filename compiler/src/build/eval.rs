//! The eval step of an artifact: the model's forward and loss (no backward, no optimizer),
//! lowered by [`compile_eval_graph`] (the training step's partitioning and fp32 masters read
//! through compute-dtype casts, the loss all-reduced on a mesh), fused by the same `fuse`, and
//! planned by the same planner. Its memory plan is then bound to the training plan's: every
//! `param` buffer is the training master of the same state name, the `input` buffers are the
//! training `tokens`/`targets`, and its activations are placed in the training plan's
//! `activations` arena, which holds nothing live between training steps (the arena grows only if
//! the eval step needs more than the training step, and the build says so).

use titan_ir::artifact::{Arena, Buffer, BufferClass, EvalStep, MemoryPlan};
use titan_ir::{BlockId, Graph, KernelKind};
use titan_passes::{PipelineOptions, PipelineReport, compile_eval_graph};

use super::memory::internal;
use super::{BuildError, BuildOptions, kernel_table, plan_kernel_graph};

/// The prefix of every eval kernel's name (eval and training kernels share `kernels/`).
pub const EVAL_KERNEL_PREFIX: &str = "eval_";

/// An eval step before code generation.
#[derive(Clone, Debug)]
pub struct EvalPlan {
    /// The fused eval graph (`eval.ir`).
    pub fused: Graph,
    pub report: PipelineReport,
    /// The manifest's `eval`, kernels without code yet.
    pub step: EvalStep,
    /// `(body, kind, name)` of every eval kernel, for the code generator.
    pub bodies: Vec<(BlockId, KernelKind, String)>,
    pub launches_per_step: u64,
    /// The `activations` arena grew from this many bytes to hold the eval step (`None`: it fit).
    pub grew_activations_from: Option<u64>,
}

/// Compile and plan the eval step of `model` (the model graph the training step was built from,
/// with its layout meta) against the training plan's `buffers` and `memory`, growing the
/// `activations` arena in `memory` if the eval step needs more.
pub fn plan_eval(model: &Graph, opts: &BuildOptions, train_buffers: &[Buffer], memory: &mut MemoryPlan) -> Result<EvalPlan, BuildError> {
    let popts = PipelineOptions { verify_each: opts.pipeline.verify_each, ..PipelineOptions::default() };
    let (fused, report) = compile_eval_graph(model, &opts.train, &popts)?;
    let plan = plan_kernel_graph(&fused)?;
    let mut buffers = plan.storage.buffers.clone();
    for b in &mut buffers {
        let shared = match b.class {
            BufferClass::Param => {
                let name = b.state.as_ref().map(|s| s.name.as_str()).ok_or_else(|| internal(format!("eval buffer `{}` is a param without a state", b.name)))?;
                train_buffers.iter().find(|t| t.class == BufferClass::Param && t.state.as_ref().is_some_and(|s| s.name == name))
            }
            BufferClass::Input => {
                let feed = b.feed.as_deref().ok_or_else(|| internal(format!("eval input buffer `{}` has no feed", b.name)))?;
                train_buffers.iter().find(|t| t.class == BufferClass::Input && t.feed.as_deref() == Some(feed))
            }
            BufferClass::Activation => continue,
            BufferClass::Grad | BufferClass::OptimizerState | BufferClass::ComputeCopy => {
                return Err(internal(format!("the eval step has a gradient, optimizer or compute copy buffer `{}`", b.name)));
            }
        };
        let t = shared.ok_or_else(|| internal(format!("eval buffer `{}` has no training buffer to share", b.name)))?;
        if (t.dtype, &t.shape, t.arena) != (b.dtype, &b.shape, b.arena) {
            return Err(internal(format!(
                "eval buffer `{}` is {}{:?}, the training buffer `{}` it shares is {}{:?}",
                b.name, b.dtype, b.shape, t.name, t.dtype, t.shape
            )));
        }
        b.offset = t.offset;
    }
    let activation_bytes = plan.memory.arenas.iter().find(|a| a.arena == Arena::Activations).map_or(0, |a| a.bytes);
    let arena = memory.arenas.iter_mut().find(|a| a.arena == Arena::Activations).ok_or_else(|| internal("the training plan has no activations arena"))?;
    let grew_activations_from = (activation_bytes > arena.bytes).then_some(arena.bytes);
    if grew_activations_from.is_some() {
        memory.peak_bytes += activation_bytes - arena.bytes;
        arena.bytes = activation_bytes;
    }
    let (mut bodies, mut kernels) = kernel_table(&fused, &plan)?;
    for (_, _, name) in &mut bodies {
        *name = format!("{EVAL_KERNEL_PREFIX}{name}");
    }
    for k in &mut kernels {
        k.name = format!("{EVAL_KERNEL_PREFIX}{}", k.name);
    }
    let step = EvalStep { buffers, activation_bytes, kernels, steps: plan.schedule.steps.clone() };
    Ok(EvalPlan { fused, report, step, bodies, launches_per_step: plan.schedule.launches_per_step, grew_activations_from })
}
