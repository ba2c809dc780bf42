//! `titanc build`: compile a model graph into an artifact directory that `titan-run` executes.
//!
//! Phases: **pipeline** (verify the model, lower it to the training step and fuse it into the
//! kernel graph with [`compile_train_graph`]), **plan** (the static memory plan, rank 0's
//! schedule and the kernel table: [`memory`], [`schedule`], [`gemm`]), **codegen** (PTX for every
//! generated kernel body, once per distinct module, through
//! `titan_kernels::compile_kernel_cached`), **ptxas** (each PTX assembled into an sm_90a cubin
//! when `ptxas` is found, by worker threads beside code generation (`cubins.rs`); the phase is
//! the wait after code generation; without `ptxas` the artifact ships PTX only and the summary
//! says so) and **write** ([`emit`]:
//! `manifest.json`, `graph.ir`, `kernels/*.ptx`, `kernels/*.cubin` into a temporary directory
//! renamed into place). `docs/artifact.md` describes the result.
//!
//! Building is deterministic: the same model text, options and target give byte-identical
//! files, and `content_hash` (hex SHA-256 of the three) identifies them.

mod cubin_cache;
mod cubins;
pub mod device_memory;
pub mod emit;
pub mod eval;
pub mod gemm;
pub mod memory;
pub mod schedule;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use titan_ir::artifact::workspace::{LibraryWorkspaces, library_workspaces};
use titan_ir::artifact::{
    Arena, ArenaPlan, BufRef, CollectiveOp, CommVolume, FORMAT_VERSION, KERNEL_DIR, Kernel, Manifest, MemoryPlan, Mesh, MeshDim, MeshReport, RankMemory,
    RankSchedule, Step, Target, TrainingInfo,
};
use titan_ir::attr::fmt_float;
use titan_ir::{AttrValue, BlockId, Graph, KernelKind};
use titan_kernels::{KernelError, PtxasReport};
use titan_passes::activation_checkpoint::AcPolicy;
use titan_passes::fuse::FusionReport;
use titan_passes::pipeline::{BUILD_PIPELINE, EVAL_BUILD_PIPELINE, SPMD_BUILD_PIPELINE, SPMD_EVAL_BUILD_PIPELINE};
use titan_passes::{PassError, PipelineOptions, PipelineReport, TrainOptions, compile_train_graph, fusion_report, lower_to_train};

use self::memory::{Storage, bytes_of, shape_of};
use self::schedule::Schedule;
use crate::stats::model_stats;
use titan_ir::artifact::liveness::Lifetime;

/// Targets `titanc build --target` accepts.
pub const TARGETS: [&str; 1] = ["sm_90a"];

/// Everything that decides what `titanc build` produces (besides the model).
#[derive(Clone, Debug, PartialEq)]
pub struct BuildOptions {
    pub train: TrainOptions,
    /// Verification, dumps and timings of the pass pipeline (they do not change the output).
    pub pipeline: PipelineOptions,
    pub target: Target,
    /// Also compute the fusion report (one more lowering, without fusion, to compare with).
    pub report: bool,
    /// The device mesh (`--dp-replicate/--dp-shard/--tp`); one rank builds the single-device
    /// step, more build the SPMD step every rank runs.
    pub mesh: titan_ir::Mesh,
    /// With tp > 1, the vocab-parallel cross-entropy (`false`: `--disable-loss-parallel`).
    pub loss_parallel: bool,
    /// With dp_shard > 1, gather layer `l + 1`'s weights during layer `l` (`prefetch-next-layer`;
    /// `false`: `--disable-prefetch-next-layer`).
    pub prefetch_next_layer: bool,
    /// Activation checkpointing (`--ac`, `[activation_checkpoint]`; the `activation-checkpoint` pass).
    pub ac: AcPolicy,
    /// Async tensor parallelism (`--async-tp`; the `async-tp` pass): needs tp > 1.
    pub async_tp: Option<titan_passes::async_tp::AsyncTpMode>,
}

impl Default for BuildOptions {
    fn default() -> BuildOptions {
        BuildOptions {
            train: TrainOptions::default(),
            pipeline: PipelineOptions::default(),
            target: Target::sm90a(),
            report: false,
            mesh: titan_ir::Mesh::new(1, 1, 1),
            loss_parallel: true,
            prefetch_next_layer: true,
            ac: AcPolicy::None,
            async_tp: None,
        }
    }
}

impl BuildOptions {
    /// The options that decide the artifact's bytes, one `key = value` per line, floats printed
    /// so they read back exactly. Part of the content hash.
    pub fn canonical_text(&self) -> String {
        let spmd = self.mesh.world_size() > 1;
        let pipeline: &[&str] = if spmd { &SPMD_BUILD_PIPELINE } else { &BUILD_PIPELINE };
        let mut lines = vec![
            format!("titan_version = {}", env!("CARGO_PKG_VERSION")),
            format!("format_version = {FORMAT_VERSION}"),
            format!("pipeline = {}", pipeline.join(",")),
        ];
        let eval: &[&str] = if spmd { &SPMD_EVAL_BUILD_PIPELINE } else { &EVAL_BUILD_PIPELINE };
        lines.push(format!("eval_pipeline = {}", eval.join(",")));
        lines.extend(self.train.canonical_lines().into_iter().map(|(k, v)| format!("train.{k} = {v}")));
        if let Some(f8) = &self.train.float8 {
            lines.extend(f8.canonical_lines());
        }
        if self.ac != AcPolicy::None {
            lines.push(format!("activation_checkpoint = {}", self.ac));
        }
        lines.extend([format!("target.arch = {}", self.target.arch), format!("target.ptx_isa = {}", self.target.ptx_isa)]);
        if spmd {
            let [r, d, t] = self.mesh.sizes;
            lines.push(format!("mesh = dp_replicate {r}, dp_shard {d}, tp {t}"));
            if !self.loss_parallel {
                lines.push("loss_parallel = false".into());
            }
            if !self.prefetch_next_layer {
                lines.push("prefetch_next_layer = false".into());
            }
            if let Some(mode) = self.async_tp {
                lines.push(format!("async_tp = {}", mode.name()));
            }
        }
        lines.iter().map(|l| format!("{l}\n")).collect()
    }
}

/// Why a build failed.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Pass(#[from] PassError),
    /// A bad option or an input the build cannot handle; the message says what to change.
    #[error("{0}")]
    Invalid(String),
    /// The kernel code generator failed; the message names the kernel.
    #[error("code generation failed: {0}")]
    Codegen(String),
    #[error("cannot write the artifact `{path}`: {message}")]
    Io { path: String, message: String },
    #[error("`{path}` exists and is not a titan artifact (no manifest.json); choose another output directory or remove it")]
    NotArtifact { path: String },
    /// A compiler bug, not a user error.
    #[error("internal error in titanc build (please report it): {0}")]
    Internal(String),
}

/// Wall time of the build's phases.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Phases {
    pub pipeline: Duration,
    pub plan: Duration,
    pub codegen: Duration,
    /// The wait for `ptxas` after code generation, beside which it runs (zero without `ptxas`).
    pub ptxas: Duration,
    pub write: Duration,
    /// The extra unfused lowering of `--report` (zero without it).
    pub report: Duration,
    /// Lowering, planning and code generation of the eval step (zero without one).
    pub eval: Duration,
}

impl Phases {
    pub fn total(&self) -> Duration {
        self.pipeline + self.plan + self.codegen + self.ptxas + self.write + self.report + self.eval
    }
}

/// What a build produced, for `titanc build` to print and the benchmark to tabulate.
#[derive(Clone, Debug, PartialEq)]
pub struct BuildSummary {
    pub out_dir: PathBuf,
    /// The fused graph's name (`llama3_debug_train`).
    pub graph: String,
    pub content_hash: String,
    /// The model hash (`titan_passes::model_hash`): the model and training options, not the
    /// mesh or build choices.
    pub model_hash: String,
    /// Kernels of the kernel table, by kind name.
    pub kernels_by_kind: BTreeMap<&'static str, usize>,
    pub kernels: usize,
    pub ptx_files: usize,
    /// Cubins written next to the PTX (0 without `ptxas`).
    pub cubin_files: usize,
    /// What ptxas reported on each assembled kernel (training step, then eval step): registers,
    /// spills, shared memory.
    pub ptxas_reports: Vec<(String, PtxasReport)>,
    /// The most dynamic shared memory any launch asks for (every phase of every kernel, both
    /// steps): ptxas's figures count only the static part.
    pub dynamic_shared_max: u64,
    pub launches_per_step: u64,
    pub buffers: usize,
    pub arenas: Vec<ArenaPlan>,
    /// Predicted peak device memory of each rank.
    pub peak_bytes_per_rank: Vec<u64>,
    pub activation_bytes_unplanned: u64,
    pub phases: Phases,
    pub pipeline: PipelineReport,
    pub fusion: Option<FusionReport>,
    /// Kernels left without GPU code, a build without cubins, and why.
    pub notes: Vec<String>,
    /// The mesh of an SPMD build (empty on one device) and its world size.
    pub mesh: Mesh,
    /// Collective steps per training step (SPMD).
    pub collectives_per_step: u64,
    /// Per-rank memory and communication of an SPMD build.
    pub report: Option<MeshReport>,
    /// What a GPU rank needs besides the memory plan (`titan_ir::artifact::workspace`).
    pub workspaces: LibraryWorkspaces,
    /// Where each recomputed activation went in the kernel graph (activation checkpointing).
    pub recompute_placement: Vec<String>,
    /// The eval step: kernels, launches per step, activation bytes (`None`: no eval step).
    pub eval: Option<EvalSummary>,
}

/// What the build's eval step is, for the summary.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalSummary {
    pub kernels: usize,
    pub launches_per_step: u64,
    pub activation_bytes: u64,
    /// The `activations` arena grew from this many bytes to hold it.
    pub grew_activations_from: Option<u64>,
}

/// `1.50 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    titan_ir::artifact::human_bytes(bytes, 2)
}

fn secs(d: Duration) -> String {
    format!("{:.3} s", d.as_secs_f64())
}

impl fmt::Display for BuildSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "built {} from @{} (content hash {}, model hash {})",
            self.out_dir.display(),
            self.graph,
            &self.content_hash[..self.content_hash.len().min(16)],
            &self.model_hash[..self.model_hash.len().min(16)]
        )?;
        let kinds: Vec<String> = self.kernels_by_kind.iter().map(|(k, n)| format!("{n} {k}")).collect();
        writeln!(
            f,
            "kernels:      {} ({}); {} PTX files, {} cubins; {} launches per step",
            self.kernels,
            kinds.join(", "),
            self.ptx_files,
            self.cubin_files,
            self.launches_per_step
        )?;
        if let Some(regs) = self.ptxas_reports.iter().map(|(_, r)| r.registers).max() {
            let spilling: Vec<&str> = self.ptxas_reports.iter().filter(|(_, r)| r.spills()).map(|(k, _)| k.as_str()).collect();
            let smem = self.ptxas_reports.iter().map(|(_, r)| r.shared_bytes).max().unwrap_or(0);
            let spills = match spilling.as_slice() {
                [] => "no register spills".to_string(),
                ks => format!("warning: {} kernel(s) spill registers to local memory: {}", ks.len(), ks.join(", ")),
            };
            writeln!(
                f,
                "ptxas:        at most {regs} registers and {} of static shared memory per kernel (launches ask for up to {} dynamic); {spills}",
                human_bytes(smem),
                human_bytes(self.dynamic_shared_max)
            )?;
            let serialized: Vec<&str> = self.ptxas_reports.iter().filter(|(_, r)| r.wgmma_serialized).map(|(k, _)| k.as_str()).collect();
            if !serialized.is_empty() {
                writeln!(
                    f,
                    "ptxas:        warning: {} kernel(s) have their wgmma instructions serialized by ptxas: {}",
                    serialized.len(),
                    serialized.join(", ")
                )?;
            }
        }
        writeln!(f, "memory plan:  {} buffers", self.buffers)?;
        for a in &self.arenas {
            writeln!(f, "  {:<16} {:>12}", memory::arena_name(a.arena), human_bytes(a.bytes))?;
        }
        let planned = self.arenas.iter().find(|a| a.arena == titan_ir::artifact::Arena::Activations).map_or(0, |a| a.bytes);
        writeln!(
            f,
            "  activations and gradients are {} planned, {} if no buffer were reused",
            human_bytes(planned),
            human_bytes(self.activation_bytes_unplanned)
        )?;
        match &self.report {
            Some(r) => {
                write_mesh_report(f, &self.mesh, self.collectives_per_step, r, &self.workspaces)?;
            }
            None => {
                for (rank, peak) in self.peak_bytes_per_rank.iter().enumerate() {
                    writeln!(f, "predicted peak memory: rank {rank}: {} ({peak} bytes) in the memory plan", human_bytes(*peak))?;
                    write_workspaces(f, &format!("rank {rank}"), *peak, &self.workspaces)?;
                }
            }
        }
        if let Some(e) = &self.eval {
            let arena = match e.grew_activations_from {
                Some(from) => format!("the activations arena grew from {} to hold it", human_bytes(from)),
                None => "within the training step's activations arena".to_string(),
            };
            writeln!(
                f,
                "eval step:    {} kernels, {} launches; activations {} ({arena}); params and inputs shared with the training step",
                e.kernels,
                e.launches_per_step,
                human_bytes(e.activation_bytes)
            )?;
        }
        if let Some(ac) = self.pipeline.stats("activation-checkpoint").filter(|s| !s.notes.is_empty()) {
            writeln!(f, "activation checkpointing:")?;
            for line in &ac.notes {
                writeln!(f, "  {line}")?;
            }
            for line in &self.recompute_placement {
                writeln!(f, "  recomputed {line}")?;
            }
        }
        let p = &self.phases;
        let ptxas = if p.ptxas > Duration::ZERO { format!(", ptxas {}", secs(p.ptxas)) } else { String::new() };
        let mut phases = format!("pipeline {}, plan {}, codegen {}{ptxas}, write {}", secs(p.pipeline), secs(p.plan), secs(p.codegen), secs(p.write));
        if p.report > Duration::ZERO {
            phases.push_str(&format!(", report {}", secs(p.report)));
        }
        if p.eval > Duration::ZERO {
            phases.push_str(&format!(", eval step {}", secs(p.eval)));
        }
        writeln!(f, "build time:   {} ({phases})", secs(p.total()))?;
        for n in &self.notes {
            writeln!(f, "note: {n}")?;
        }
        // With `--timings` the pass table below shows the same lines.
        // (activation checkpointing has its own section above, with the recompute placement.)
        for r in self.pipeline.passes.iter().filter(|r| !r.stats.notes.is_empty() && !self.pipeline.timings && r.pass != "activation-checkpoint") {
            writeln!(f, "{}:", r.pass)?;
            for line in &r.stats.notes {
                writeln!(f, "  {line}")?;
            }
        }
        if self.pipeline.timings {
            writeln!(f)?;
            writeln!(f, "passes:")?;
            write!(f, "{}", self.pipeline)?;
        }
        if let Some(r) = &self.fusion {
            writeln!(f)?;
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

/// The library workspaces a GPU rank needs on top of the plan's `peak`, one line, and the total.
fn write_workspaces(f: &mut fmt::Formatter<'_>, who: &str, peak: u64, w: &LibraryWorkspaces) -> fmt::Result {
    writeln!(
        f,
        "  library workspaces {:>12}  cuBLASLt {}, kernel workspaces {}, collective staging {}, NCCL {} (estimate)",
        human_bytes(w.total()),
        human_bytes(w.cublaslt),
        human_bytes(w.kernels),
        human_bytes(w.collective_staging),
        human_bytes(w.nccl)
    )?;
    let total = peak.saturating_add(w.total());
    writeln!(f, "predicted peak device memory with library workspaces: {who}: {} ({total} bytes)", human_bytes(total))
}

/// The mesh part of the summary: per-rank memory by class and communication per mesh dim.
fn write_mesh_report(f: &mut fmt::Formatter<'_>, mesh: &Mesh, collectives: u64, r: &MeshReport, w: &LibraryWorkspaces) -> fmt::Result {
    let dims: Vec<String> = mesh.dims.iter().map(|d| format!("{} {}", d.name, d.size)).collect();
    writeln!(
        f,
        "mesh:         world {} = {} (SPMD: every rank runs this schedule on its shards; {collectives} collectives per step)",
        mesh.world_size,
        dims.join(" x ")
    )?;
    let m = &r.memory;
    writeln!(f, "per-rank memory (predicted, each of the {} ranks):", mesh.world_size)?;
    writeln!(f, "  params           {:>12}  fp32 master weights and their compute copies (this rank's shards)", human_bytes(m.params))?;
    writeln!(f, "  optimizer_state  {:>12}  AdamW moments", human_bytes(m.optimizer_state))?;
    writeln!(
        f,
        "  activations      {:>12}  planned with the gradients; includes {} of FSDP-gathered weights, {} of them saved for the backward",
        human_bytes(m.activations),
        human_bytes(m.gathered_weights),
        human_bytes(m.gathered_weights_saved)
    )?;
    writeln!(f, "  inputs           {:>12}", human_bytes(m.inputs))?;
    writeln!(f, "predicted peak memory: each rank: {} ({} bytes) in the memory plan", human_bytes(m.peak), m.peak)?;
    write_workspaces(f, "each rank", m.peak, w)?;
    writeln!(
        f,
        "communication per step, bytes each rank sends (and receives) with ring algorithms: all_gather and reduce_scatter (n-1)/n of the full buffer, all_reduce 2(n-1)/n:"
    )?;
    for c in &r.comm {
        writeln!(
            f,
            "  {:<12} ({:>2} ranks): {:>5} calls, all_gather {:>11}, reduce_scatter {:>11}, all_reduce {:>11}, {}total {:>11}",
            c.mesh_dim,
            c.group,
            c.calls,
            human_bytes(c.all_gather_bytes),
            human_bytes(c.reduce_scatter_bytes),
            human_bytes(c.all_reduce_bytes),
            if c.ring_shift_bytes > 0 { format!("ring_shift {:>11}, ", human_bytes(c.ring_shift_bytes)) } else { String::new() },
            human_bytes(c.total_bytes())
        )?;
    }
    Ok(())
}

/// The manifest's mesh of a [`titan_ir::Mesh`]: the dims of more than one rank, outermost first.
pub fn manifest_mesh(mesh: &titan_ir::Mesh) -> Mesh {
    let dims = titan_ir::MeshDim::ALL.into_iter().filter(|&d| mesh.size(d) > 1).map(|d| MeshDim { name: d.name().to_string(), size: mesh.size(d) }).collect();
    Mesh { world_size: mesh.world_size(), dims }
}

/// The per-rank memory by class and the communication per step of an SPMD plan.
pub fn mesh_report(plan: &Plan, mesh: &titan_ir::Mesh) -> MeshReport {
    let arena = |a: Arena| plan.memory.arenas.iter().find(|p| p.arena == a).map_or(0, |p| p.bytes);
    let buffers = &plan.storage.buffers;
    // Buffers written by FSDP's all-gathers, and those written a layer slice at a time (stacked
    // results that stay live until the backward reads them).
    let mut gathered: BTreeMap<u32, bool> = BTreeMap::new();
    let mut comm: BTreeMap<usize, CommVolume> = BTreeMap::new();
    fn walk(steps: &[Step], times: u64, carries: &[[u32; 2]], gathered: &mut BTreeMap<u32, bool>, comm: &mut BTreeMap<usize, CommVolume>) {
        for s in steps {
            match s {
                Step::Loop { count, carries, body, prefetch, .. } => {
                    // The prefetch steps run `count` times too: before the loop and in every
                    // iteration but the last.
                    walk(prefetch, times * u64::from(*count), carries, gathered, comm);
                    walk(body, times * u64::from(*count), carries, gathered, comm);
                }
                Step::Collective { collective, mesh_dim, group, output, send_bytes, .. } => {
                    if collective.is_rank_local() {
                        continue;
                    }
                    let Some(m) = titan_ir::MeshDim::from_name(mesh_dim) else { continue };
                    if *collective == CollectiveOp::AllGather && m == titan_ir::MeshDim::DpShard {
                        match *output {
                            BufRef::Buffer { buffer, .. } | BufRef::View { buffer, .. } => *gathered.entry(buffer).or_default() |= output.per_layer(),
                            BufRef::Carry { carry, .. } => {
                                for &b in carries.get(carry as usize).into_iter().flatten() {
                                    gathered.entry(b).or_default();
                                }
                            }
                        }
                    }
                    let c = comm.entry(m.index()).or_insert_with(|| CommVolume {
                        mesh_dim: mesh_dim.clone(),
                        group: *group,
                        calls: 0,
                        all_gather_bytes: 0,
                        reduce_scatter_bytes: 0,
                        all_reduce_bytes: 0,
                        ring_shift_bytes: 0,
                    });
                    c.calls += times;
                    let bytes = send_bytes * times;
                    match collective {
                        CollectiveOp::AllGather => c.all_gather_bytes += bytes,
                        CollectiveOp::ReduceScatter => c.reduce_scatter_bytes += bytes,
                        CollectiveOp::RingShift => c.ring_shift_bytes += bytes,
                        _ => c.all_reduce_bytes += bytes,
                    }
                }
                _ => {}
            }
        }
    }
    walk(&plan.schedule.steps, 1, &[], &mut gathered, &mut comm);
    let bytes_of_buffer = |id: u32| buffers.get(id as usize).map_or(0, |b| b.bytes);
    let gathered_weights = gathered.keys().map(|&b| bytes_of_buffer(b)).sum();
    let gathered_weights_saved = gathered.iter().filter(|(_, saved)| **saved).map(|(&b, _)| bytes_of_buffer(b)).sum();
    let comm = titan_ir::MeshDim::ALL
        .into_iter()
        .filter(|&d| mesh.size(d) > 1)
        .map(|d| {
            comm.remove(&d.index()).unwrap_or(CommVolume {
                mesh_dim: d.name().to_string(),
                group: mesh.size(d),
                calls: 0,
                all_gather_bytes: 0,
                reduce_scatter_bytes: 0,
                all_reduce_bytes: 0,
                ring_shift_bytes: 0,
            })
        })
        .collect();
    MeshReport {
        memory: RankMemory {
            params: arena(Arena::Params),
            optimizer_state: arena(Arena::OptimizerState),
            activations: arena(Arena::Activations),
            inputs: arena(Arena::Inputs),
            gathered_weights,
            gathered_weights_saved,
            peak: plan.memory.peak_bytes,
        },
        comm,
    }
}

/// The kernel graph with its memory plan and schedule (no code generated yet).
#[derive(Clone, Debug)]
pub struct Plan {
    pub storage: Storage,
    pub schedule: Schedule,
    pub lifetimes: Vec<Option<Lifetime>>,
    pub memory: MemoryPlan,
}

/// Memory plan and schedule of a kernel graph (the output of [`compile_train_graph`]).
pub fn plan_kernel_graph(fused: &Graph) -> Result<Plan, BuildError> {
    let mut storage = memory::assign_storage(fused)?;
    let schedule = schedule::build_schedule(fused, &storage)?;
    let lifetimes = memory::lifetimes(&storage, &schedule.steps);
    let memory = memory::place(&mut storage.buffers, &lifetimes);
    Ok(Plan { storage, schedule, lifetimes, memory })
}

/// An artifact in memory: the manifest, the fused graph's text, the PTX files and the cubins.
#[derive(Clone, Debug, PartialEq)]
pub struct Artifact {
    pub manifest: Manifest,
    pub graph_text: String,
    /// `(path relative to the artifact directory, text)`.
    pub ptx: Vec<(String, String)>,
    /// `(path relative to the artifact directory, cubin image)`.
    pub cubins: Vec<(String, Vec<u8>)>,
    /// The fused eval graph's text (`eval.ir`), when the artifact has an eval step.
    pub eval_graph_text: Option<String>,
}

/// Hex SHA-256 of the model text, the canonical options and the target, each length-prefixed,
/// and of the build-time switches set in this process ([`titan_kernels::switches`]).
pub fn content_hash(model_text: &str, opts: &BuildOptions) -> String {
    content_hash_with(model_text, opts, &titan_kernels::switches::active())
}

/// [`content_hash`] with the build-time switches given: none set (every ordinary build) hashes
/// as before switches were hashed; any set adds a `switches` section, so a build with one never
/// shares a hash with the default build.
pub fn content_hash_with(model_text: &str, opts: &BuildOptions, switches: &BTreeMap<String, String>) -> String {
    let mut h = Sha256::new();
    h.update(b"titan artifact\n");
    let target = format!("{} {}", opts.target.arch, opts.target.ptx_isa);
    let switches_text: String = switches.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    let options = opts.canonical_text();
    let mut sections = vec![("model", model_text), ("options", options.as_str()), ("target", target.as_str())];
    // No switch set: the three sections hashed before switches existed.
    if !switches.is_empty() {
        sections.push(("switches", switches_text.as_str()));
    }
    for (label, text) in sections {
        h.update(format!("{label} {}\n", text.len()).as_bytes());
        h.update(text.as_bytes());
        h.update(b"\n");
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn meta_json(v: &AttrValue) -> serde_json::Value {
    match v {
        AttrValue::Bool(b) => serde_json::Value::Bool(*b),
        AttrValue::Int(i) => serde_json::Value::from(*i),
        AttrValue::Float(x) => serde_json::Number::from_f64(*x).map_or_else(|| serde_json::Value::String(fmt_float(*x)), serde_json::Value::Number),
        AttrValue::Str(s) | AttrValue::Ident(s) | AttrValue::Symbol(s) => serde_json::Value::String(s.clone()),
        AttrValue::List(items) => serde_json::Value::Array(items.iter().map(meta_json).collect()),
        AttrValue::Call(..) => serde_json::Value::String(v.to_string()),
    }
}

fn check_target(t: &Target) -> Result<(), BuildError> {
    if *t != Target::sm90a() {
        return Err(BuildError::Invalid(format!(
            "target `{}` (PTX ISA {}) is not supported; titan generates code for {} (H100/H200): use `--target sm_90a`",
            t.arch,
            t.ptx_isa,
            TARGETS.join(", ")
        )));
    }
    Ok(())
}

/// Generated code of one kernel body.
struct Code {
    entry: String,
    ptx: String,
    launch: titan_ir::artifact::Launch,
    prologue: Option<titan_ir::artifact::Prologue>,
    epilogue: Option<titan_ir::artifact::Prologue>,
    workspace_bytes: u64,
    workspace_scratch: bool,
}

/// Run the code generator on every body, on `threads` threads (at most one per body; the build
/// asks for up to eight), each with its own MLIR context
/// (one generator thread was the rule while every kernel created a context: registering the
/// dialects and passes takes process-wide locks, and two threads ran slower than one; with a
/// context per thread two threads take the 8B preset's code generation from 0.70 to 0.39 s on a
/// 2-core machine). Threads take the bodies `ptxas` is slowest on first (the optimizer's, then
/// attention's), and `generated(i, code)` hands each to the `ptxas` pool ([`cubins::Pool`]) as
/// soon as body `i` has its code; the result is in body order whatever the threads' timing, and
/// each kernel's PTX depends on its body alone. A body whose pattern the code generator does not
/// handle (e.g. f32 attention) gets no GPU code and a note: the artifact then runs on the CPU
/// backend only, and the CUDA backend refuses it at load naming the kernel. Invalid bodies and
/// generator bugs fail the build (the first such body in body order is named). `lowered` holds
/// the PTX of the modules lowered before in this build (the eval step's forward kernels generate
/// the training step's modules).
fn codegen(
    threads: usize,
    fused: &Graph,
    bodies: &[(BlockId, KernelKind, String)],
    lowered: &titan_kernels::Lowered,
    notes: &mut Vec<String>,
    generated: &(dyn Fn(usize, &Code) + Sync),
) -> Result<Vec<Option<Code>>, BuildError> {
    let slow_first = |kind: &KernelKind| match kind {
        KernelKind::Optimizer => 0,
        KernelKind::AttentionBwd => 1,
        KernelKind::Attention => 2,
        _ => 3,
    };
    let mut order: Vec<usize> = (0..bodies.len()).collect();
    order.sort_by_key(|&i| (slow_first(&bodies[i].1), i));
    let threads = threads.clamp(1, order.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut results: Vec<(usize, Result<Option<Code>, KernelError>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    while let Some(&i) = order.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                        let (body, kind, name) = &bodies[i];
                        let r = titan_kernels::compile_kernel_cached(fused, *body, *kind, name, lowered).map(|c| {
                            c.map(|c| Code {
                                entry: c.entry,
                                ptx: c.ptx,
                                launch: c.launch,
                                prologue: c.prologue,
                                epilogue: c.epilogue,
                                workspace_bytes: c.workspace_bytes,
                                workspace_scratch: c.workspace_scratch,
                            })
                        });
                        if let Ok(Some(c)) = &r {
                            generated(i, c);
                        }
                        out.push((i, r));
                    }
                    out
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    });
    results.sort_by_key(|(i, _)| *i);
    let mut code: Vec<Option<Code>> = bodies.iter().map(|_| None).collect();
    let mut unsupported = Vec::new();
    for (i, r) in results {
        match r {
            Ok(c) => code[i] = c,
            Err(e @ KernelError::Unsupported { .. }) => unsupported.push(e.to_string()),
            Err(e @ KernelError::InvalidBody { .. }) => return Err(BuildError::Codegen(e.to_string())),
            Err(e) => return Err(BuildError::Codegen(format!("kernel `{}`: {e}", bodies[i].2))),
        }
    }
    // One note per kernel reads well for a few; a float8 build has dozens with two reasons.
    match unsupported.as_slice() {
        [] => {}
        few if few.len() <= 3 => notes.extend(few.iter().map(|e| format!("no GPU code: {e}; the artifact runs on the CPU backend only"))),
        many => notes.push(format!("no GPU code for {} kernels (the first: {}); the artifact runs on the CPU backend only", many.len(), many[0])),
    }
    Ok(code)
}

/// Compile `model` (whose source text is `model_text`) into an in-memory artifact; no files
/// are touched. Returns the artifact and a summary without the write time. Cubins are
/// assembled with the `ptxas` that `titan_kernels::find_ptxas` finds (`TITAN_PTXAS` pointing
/// at a missing file disables them).
pub fn compile_artifact(model: &Graph, model_text: &str, opts: &BuildOptions) -> Result<(Artifact, BuildSummary), BuildError> {
    let ptxas = titan_kernels::find_ptxas();
    compile(model, model_text, opts, true, ptxas.as_deref())
}

/// Refuse a graph that is already a training step (`meta` `step = "train"`: the output of
/// `titanc lower --to train`, or an artifact's `graph.ir`) where a model graph is expected;
/// `source` names it in the message (a file, or the graph).
pub fn check_model_graph(g: &Graph, source: &str) -> Result<(), BuildError> {
    match g.meta.get("step").and_then(AttrValue::as_str) {
        Some("train") => Err(BuildError::Invalid(format!(
            "{source} is already a training-step graph (its meta has step = \"train\"); titanc build and titanc lower --to train take the model graph (`titanc new ...`), and titan-run runs a training graph directly (`titan-run FILE.ir`, unfused)"
        ))),
        _ => Ok(()),
    }
}

/// [`compile_artifact`], optionally without code generation (tests of the plan and schedule),
/// with an explicit `ptxas` (`None`: no cubins).
pub(crate) fn compile(
    model: &Graph,
    model_text: &str,
    opts: &BuildOptions,
    generate_code: bool,
    ptxas: Option<&Path>,
) -> Result<(Artifact, BuildSummary), BuildError> {
    check_target(&opts.target)?;
    check_model_graph(model, &format!("the graph @{}", model.name))?;
    let mut phases = Phases::default();

    let t = Instant::now();
    verify_model(model)?;
    check_async_tp(opts)?;
    let spmd = opts.mesh.world_size() > 1;
    let meshed = (spmd || opts.ac != AcPolicy::None).then(|| with_layout_meta(model, opts));
    let model = meshed.as_ref().unwrap_or(model);
    let mut notes = Vec::new();
    let train = &opts.train;
    let (fused, pipeline) = compile_train_graph(model, train, &opts.pipeline)?;
    phases.pipeline = t.elapsed();

    let fusion = if opts.report {
        let t = Instant::now();
        let unfused = lower_to_train(model, train)?;
        let r = fusion_report(&unfused, &fused);
        phases.report = t.elapsed();
        Some(r)
    } else {
        None
    };

    let t = Instant::now();
    let mut plan = plan_kernel_graph(&fused)?;
    phases.plan = t.elapsed();

    // The eval step, bound to the training plan (it may grow the activations arena, so before
    // the mesh report).
    let t = Instant::now();
    let mut eval = Some(eval::plan_eval(model, opts, &plan.storage.buffers, &mut plan.memory)?);
    phases.eval = t.elapsed();

    let t = Instant::now();
    let report = spmd.then(|| mesh_report(&plan, &opts.mesh));
    let (bodies, mut kernels) = kernel_table(&fused, &plan)?;
    phases.plan += t.elapsed();

    // Code generation, with `ptxas` assembling each kernel beside it (the training step's kernels
    // are table 0, the eval step's table 1); the eval kernels use the same code generator, their
    // files next to the training ones.
    let lowered = titan_kernels::Lowered::default();
    let ptxas = ptxas.filter(|_| generate_code);
    let cache = ptxas.and_then(|p| cubin_cache::cache_dir().and_then(|d| cubin_cache::CubinCache::open(d, p)));
    let mut eval_notes = Vec::new();
    let (code, eval_code, done) = std::thread::scope(|s| -> Result<_, BuildError> {
        let pool = ptxas.map(|p| cubins::Pool::start(s, p, cache.as_ref()));
        let send = |table: usize| {
            let pool = pool.as_ref();
            move |i: usize, c: &Code| {
                if let Some(pool) = pool {
                    pool.send((table, i), &c.ptx, &c.entry);
                }
            }
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 8);
        let t = Instant::now();
        let code = if generate_code { codegen(threads, &fused, &bodies, &lowered, &mut notes, &send(0))? } else { bodies.iter().map(|_| None).collect() };
        phases.codegen = t.elapsed();
        let t = Instant::now();
        let eval_code = match eval.as_ref() {
            Some(e) if generate_code => Some(codegen(threads, &e.fused, &e.bodies, &lowered, &mut eval_notes, &send(1))?),
            Some(e) => Some(e.bodies.iter().map(|_| None).collect()),
            None => None,
        };
        phases.eval += t.elapsed();
        // What assembling adds after code generation: the queue's tail.
        let t = Instant::now();
        let done = pool.map(cubins::Pool::finish).unwrap_or_default();
        phases.ptxas = t.elapsed();
        Ok((code, eval_code, done))
    })?;
    let mut ptx = attach_code(&mut kernels, code);
    let mut eval_ptx = Vec::new();
    if let (Some(e), Some(c)) = (eval.as_mut(), eval_code) {
        eval_ptx = attach_code(&mut e.step.kernels, c);
    }
    for n in eval_notes {
        if !notes.contains(&n) {
            notes.push(format!("eval step: {n}"));
        }
    }
    let mut ptxas_reports = Vec::new();
    let cubins = {
        let mut sets: Vec<cubins::KernelSet> = vec![(&mut kernels, &ptx)];
        if let Some(e) = eval.as_mut() {
            sets.push((&mut e.step.kernels, &eval_ptx));
        }
        match ptxas {
            Some(_) => cubins::attach(&mut sets, done, &mut notes, &mut ptxas_reports),
            None => {
                if sets.iter().any(|(_, ptx)| !ptx.is_empty()) {
                    notes.push(
                        "ptxas not found: the artifact ships PTX only and the CUDA driver JIT-compiles it at start-up (seconds); install it \
                         with `pip install nvidia-cuda-nvcc` or point TITAN_PTXAS at a ptxas binary, then rebuild"
                            .to_string(),
                    );
                }
                Vec::new()
            }
        }
    };
    ptx.extend(eval_ptx);

    let dims = fused.dims.clone();
    let batch = dims.get("batch").copied().unwrap_or(0);
    let seq_len = dims.get("seq").copied().unwrap_or(0);
    let vocab_size = fused.meta_i64("vocab_size").and_then(|v| u64::try_from(v).ok()).unwrap_or(0);
    let flops_per_token = model_stats(model).ok().and_then(|s| s.flops_per_token).map_or(0, |f| f.round() as u64);
    let build_switches = titan_kernels::switches::active();
    for name in titan_kernels::switches::unknown() {
        notes.push(format!(
            "`{name}` is set but is not a build-time switch, so it changed nothing (the switches: {})",
            titan_kernels::switches::Switch::ALL.map(|s| s.name()).join(", ")
        ));
    }
    if !build_switches.is_empty() {
        let list: Vec<String> = build_switches.iter().map(|(k, v)| format!("{k}={v}")).collect();
        notes.push(format!(
            "built with build-time switches {} (kernels may differ from the default build; recorded in the manifest and the content hash)",
            list.join(" ")
        ));
    }
    let content_hash = content_hash_with(model_text, opts, &build_switches);
    // `model` carries the mesh meta here; the model hash leaves it out.
    let model_hash = titan_passes::model_hash(model, &opts.train);
    let mut kernels_by_kind = BTreeMap::new();
    for k in &kernels {
        *kernels_by_kind.entry(k.kind.name()).or_insert(0) += 1;
    }
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        titan_version: env!("CARGO_PKG_VERSION").to_string(),
        content_hash: content_hash.clone(),
        model_hash: Some(model_hash.clone()),
        target: opts.target.clone(),
        model: model.meta.entries.iter().map(|(k, v)| (k.clone(), meta_json(v))).collect(),
        dims: dims.into_iter().collect(),
        mesh: manifest_mesh(&opts.mesh),
        training: TrainingInfo { batch, seq_len, vocab_size, tokens_per_step: batch * seq_len, flops_per_token },
        buffers: plan.storage.buffers.clone(),
        memory: plan.memory.clone(),
        kernels,
        ranks: vec![RankSchedule { rank: 0, steps: plan.schedule.steps.clone() }],
        report: report.clone(),
        eval: eval.as_ref().map(|e| e.step.clone()),
        build_switches,
    };
    let dynamic_shared_max = manifest
        .kernels
        .iter()
        .chain(manifest.eval.iter().flat_map(|e| e.kernels.iter()))
        .flat_map(|k| k.launch.iter().chain(k.prologue.iter().map(|p| &p.launch)).chain(k.epilogue.iter().map(|p| &p.launch)))
        .map(|l| u64::from(l.shared_bytes))
        .max()
        .unwrap_or(0);
    let summary = BuildSummary {
        out_dir: PathBuf::new(),
        graph: fused.name.clone(),
        content_hash,
        model_hash,
        kernels_by_kind,
        kernels: manifest.kernels.len(),
        ptx_files: ptx.len(),
        cubin_files: cubins.len(),
        ptxas_reports,
        dynamic_shared_max,
        launches_per_step: plan.schedule.launches_per_step,
        buffers: manifest.buffers.len(),
        arenas: plan.memory.arenas.clone(),
        peak_bytes_per_rank: vec![plan.memory.peak_bytes],
        activation_bytes_unplanned: plan.memory.activation_bytes_unplanned,
        phases,
        pipeline,
        fusion,
        notes,
        mesh: manifest_mesh(&opts.mesh),
        collectives_per_step: plan.schedule.collectives_per_step,
        report,
        workspaces: library_workspaces(&manifest),
        recompute_placement: titan_passes::activation_checkpoint::recompute_placement(&fused),
        eval: eval.as_ref().map(|e| EvalSummary {
            kernels: e.step.kernels.len(),
            launches_per_step: e.launches_per_step,
            activation_bytes: e.step.activation_bytes,
            grew_activations_from: e.grew_activations_from,
        }),
    };
    let graph_text = titan_ir::print::print_graph(&fused);
    let eval_graph_text = eval.as_ref().map(|e| titan_ir::print::print_graph(&e.fused));
    Ok((Artifact { manifest, graph_text, ptx, cubins, eval_graph_text }, summary))
}

/// Refuse `--async-tp` where it cannot apply: it splits the sequence-parallel collectives of
/// tensor parallelism, so it needs tp > 1 (the `async-tp` pass checks the rest).
pub fn check_async_tp(opts: &BuildOptions) -> Result<(), BuildError> {
    let tp = opts.mesh.size(titan_ir::MeshDim::Tp);
    if opts.async_tp.is_some() && tp < 2 {
        return Err(BuildError::Invalid(format!(
            "async tensor parallelism (`--async-tp`) needs tp > 1 with sequence parallelism, and this build has tp = {tp}: add `--tp N` (N > 1) or drop `--async-tp`"
        )));
    }
    Ok(())
}

/// Refuse a model graph that does not verify, listing every error.
fn verify_model(model: &Graph) -> Result<(), BuildError> {
    let errors = titan_ir::verify::verify(model);
    if !errors.is_empty() {
        let errors = errors.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n");
        return Err(BuildError::Invalid(format!("the model graph does not verify; fix these errors first:\n{errors}")));
    }
    Ok(())
}

/// `model` with the layout `meta` of the build: on a mesh the mesh and the partitioning toggles
/// the options turn off; the activation-checkpointing policy.
fn with_layout_meta(model: &Graph, opts: &BuildOptions) -> Graph {
    let mut m = model.clone();
    if opts.mesh.world_size() > 1 {
        opts.mesh.write_meta(&mut m);
    }
    opts.ac.write_meta(&mut m);
    if !opts.loss_parallel {
        titan_passes::shard_tp::disable_loss_parallel(&mut m);
    }
    if !opts.prefetch_next_layer {
        titan_passes::prefetch_next_layer::disable_prefetch_next_layer(&mut m);
    }
    if let Some(mode) = opts.async_tp {
        titan_passes::async_tp::enable_async_tp(&mut m, mode);
    }
    m
}

/// The kernels of the schedule, in order: `(body, kind, name)` for the code generator, and the
/// manifest's entries without code (name, kind, body, GEMM description, bytes moved).
type KernelTable = (Vec<(BlockId, KernelKind, String)>, Vec<Kernel>);

fn kernel_table(fused: &Graph, plan: &Plan) -> Result<KernelTable, BuildError> {
    let mut bodies = Vec::with_capacity(plan.schedule.kernels.len());
    for &(body, kind) in &plan.schedule.kernels {
        let region = fused.blocks.get(body.index()).ok_or_else(|| BuildError::Internal(format!("kernel body #{} does not exist", body.0)))?;
        bodies.push((body, kind, schedule::kernel_name(region)));
    }
    let mut kernels = Vec::with_capacity(bodies.len());
    for (id, (body, kind, name)) in bodies.iter().enumerate() {
        let region = &fused.blocks[body.index()];
        let size = |vs: &mut dyn Iterator<Item = titan_ir::Value>| -> Result<u64, BuildError> {
            let mut total = 0u64;
            for v in vs {
                total += bytes_of(region.ty(v).dtype, &shape_of(fused, region, v)?);
            }
            Ok(total)
        };
        let bytes_read = size(&mut region.arg_values())?;
        let bytes_written = size(&mut region.outputs.iter().map(|o| o.value))?;
        let gemm = if *kind == KernelKind::Gemm { Some(gemm::gemm_desc(fused, region)?) } else { None };
        kernels.push(Kernel {
            id: id as u32,
            name: name.clone(),
            kind: *kind,
            body: region.name.clone(),
            ptx: None,
            cubin: None,
            entry: None,
            launch: None,
            prologue: None,
            epilogue: None,
            gemm,
            workspace_bytes: 0,
            workspace_scratch: false,
            bytes_read,
            bytes_written,
        });
    }
    Ok((bodies, kernels))
}

/// Record each kernel's generated code (entry, launch, prologue, epilogue, workspace) in its manifest
/// entry; returns the PTX files, `(path, text)`.
fn attach_code(kernels: &mut [Kernel], code: Vec<Option<Code>>) -> Vec<(String, String)> {
    let mut ptx = Vec::new();
    for (k, c) in kernels.iter_mut().zip(code) {
        let Some(c) = c else { continue };
        let path = format!("{KERNEL_DIR}/{}.ptx", k.name);
        k.ptx = Some(path.clone());
        k.entry = Some(c.entry);
        k.launch = Some(c.launch);
        k.prologue = c.prologue;
        k.epilogue = c.epilogue;
        k.workspace_bytes = c.workspace_bytes;
        k.workspace_scratch = c.workspace_scratch;
        ptx.push((path, c.ptx));
    }
    ptx
}

/// What `titanc build` says about `precompute_float8_dynamic_scale_for_fsdp` (see
/// `compile_artifact`).
/// Build the artifact of `model` into `out_dir` (see the module documentation). A failed build
/// leaves `out_dir` as it was.
pub fn build_artifact(model: &Graph, model_text: &str, opts: &BuildOptions, out_dir: &Path) -> Result<BuildSummary, BuildError> {
    let (artifact, mut summary) = compile_artifact(model, model_text, opts)?;
    let t = Instant::now();
    emit::write_artifact(out_dir, &artifact)?;
    summary.phases.write = t.elapsed();
    summary.out_dir = out_dir.to_path_buf();
    Ok(summary)
}
