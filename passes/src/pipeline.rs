//! The pass manager: one table of named passes, and [`run_pipeline`], which runs a list of
//! them in order, optionally verifying the graph after each one, timing each, and capturing the
//! IR text after the passes `--dump-after` asks for.
//!
//! The training lowering (`titanc lower --to train`) is [`TRAIN_PIPELINE`]; `titanc build`
//! runs [`BUILD_PIPELINE`] (the same passes, then `fuse`) through [`compile_train_graph`].

use std::fmt;
use std::time::{Duration, Instant};

use titan_ir::{Graph, Output};

use titan_ir::verify::{Loc, RegionRef};

use crate::train::{TrainOptions, grad_output_name};
use crate::{PassDiag, PassError, PassErrorKind};

/// Counters a pass reports, in the order it reports them (`params 12, casts 12`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PassStats {
    pub counters: Vec<(&'static str, u64)>,
    /// Lines of a report beyond the counters (what was decided and why), printed after them.
    pub notes: Vec<String>,
    /// Data series for plots, by name (`activation-checkpoint`: `pareto`, the frontier as
    /// `(saved bytes, recompute seconds)`, and `chosen`, the point it picked).
    pub series: Vec<(&'static str, Vec<(f64, f64)>)>,
}

impl PassStats {
    pub fn new() -> PassStats {
        PassStats::default()
    }

    /// Append a counter.
    pub fn with(mut self, name: &'static str, value: u64) -> PassStats {
        self.counters.push((name, value));
        self
    }

    /// The data series `name`.
    pub fn series(&self, name: &str) -> Option<&[(f64, f64)]> {
        self.series.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_slice())
    }

    /// Append report lines.
    pub fn with_notes(mut self, notes: impl IntoIterator<Item = String>) -> PassStats {
        self.notes.extend(notes);
        self
    }

    /// Append a report line.
    pub fn with_note(mut self, note: impl Into<String>) -> PassStats {
        self.notes.push(note.into());
        self
    }

    /// The value of counter `name`.
    pub fn get(&self, name: &str) -> Option<u64> {
        self.counters.iter().find(|(k, _)| *k == name).map(|&(_, v)| v)
    }
}

impl fmt::Display for PassStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.counters.is_empty() {
            return f.write_str("-");
        }
        let parts: Vec<String> = self.counters.iter().map(|(k, v)| format!("{k} {v}")).collect();
        f.write_str(&parts.join(", "))
    }
}

/// What every pass gets besides the graph.
#[derive(Clone, Debug, PartialEq)]
pub struct PassContext {
    pub train: TrainOptions,
    /// The pipeline verifies after every pass; a pass may run extra internal checks.
    pub verify_each: bool,
}

/// The signature of every pass in the table.
pub type PassFn = fn(&mut Graph, &PassContext) -> Result<PassStats, PassDiag>;

/// One entry of the pass table.
#[derive(Clone, Copy, Debug)]
pub struct PassInfo {
    /// Kebab-case name used on the command line (`--dump-after cse`).
    pub name: &'static str,
    /// One line for `--help` and listings.
    pub summary: &'static str,
    pub run: PassFn,
    /// The pass renumbers nodes (or rebuilds regions): after it, node ids no longer name the
    /// parts of the pipeline's input, so errors of later passes cannot point at its source.
    pub renumbers: bool,
}

impl PassInfo {
    pub const fn new(name: &'static str, summary: &'static str, run: PassFn) -> PassInfo {
        PassInfo { name, summary, run, renumbers: false }
    }

    const fn renumbering(mut self) -> PassInfo {
        self.renumbers = true;
        self
    }
}

static PASSES: [PassInfo; 19] = [
    PassInfo::new("shard-tp", "tensor parallelism: column/row-parallel block weights, vocab-parallel embedding and output", run_shard_tp),
    PassInfo::new("shard-dp", "split the batch over data-parallel ranks; FSDP-shard parameters on dp_shard", run_shard_dp),
    PassInfo::new("master-weights", "make every parameter an fp32 master `state` read through a compute-dtype cast", run_master_weights),
    PassInfo::new(
        "float8",
        "float8 training (`--float8`): eligible linears become `linear_f8` of the recipe; the report says why others stay bf16",
        run_float8,
    ),
    PassInfo::new(
        "float8-forward",
        "expand each `linear_f8` into its forward quantization and scaled GEMM (the eval step, which has no `autodiff` to do it)",
        run_float8_forward,
    ),
    PassInfo::new("autodiff", "differentiate `loss` (each block once); record each gradient output in the gradient map", run_autodiff),
    PassInfo::new(
        "activation-checkpoint",
        "keep the saved activations the policy (meta `activation_checkpoint`) allows; recompute the rest in the backward",
        run_activation_checkpoint,
    )
    .renumbering(),
    PassInfo::new("sync-grads", "all-reduce gradients of replicated parameters and the loss across the mesh", run_sync_grads),
    PassInfo::new("reduce-loss", "all-reduce the `loss` output over the mesh (the eval step's global mean)", run_reduce_loss),
    PassInfo::new("adamw", "consume the gradient map's outputs: global-norm clipping, lr schedule and AdamW updates", run_adamw),
    PassInfo::new(
        "compute-copies",
        "carry each master's compute-dtype copy across steps as state, written by the optimizer (no casts at the top of the step)",
        run_compute_copies,
    ),
    PassInfo::new("cse", "merge identical nodes", run_cse),
    PassInfo::new(
        "float8-fsdp-gather",
        "fp8 FSDP all-gathers (`--enable-fsdp-float8-all-gather`, tensorwise): quantize each weight shard with the dp_shard-wide amax, gather one byte per element",
        run_float8_fsdp_gather,
    ),
    PassInfo::new("dce", "drop nodes that reach no output or update, and renumber", run_dce).renumbering(),
    PassInfo::new(
        "async-tp",
        "async TP (`--async-tp`): split tp all-gather->GEMM and GEMM->reduce-scatter pairs into ring micro-steps; the report says why a pair stays synchronous",
        run_async_tp,
    ),
    PassInfo::new("prefetch-gathers", "issue each block's parameter all-gathers at its top (FSDP prefetch)", run_prefetch_gathers),
    PassInfo::new("prefetch-next-layer", "gather the next layer's parameter shards during each layer (FSDP cross-layer prefetch)", run_prefetch_next_layer),
    PassInfo::new("check-collectives", "prove every rank issues the same collectives in order on each communicator", run_check_collectives),
    PassInfo::new("fuse", "group every region's ops into kernels (gemm, attention, fused pointwise/row ops, optimizer)", run_fuse).renumbering(),
];

/// The passes of `titanc lower --to train`.
pub const TRAIN_PIPELINE: [&str; 8] = ["master-weights", "float8", "autodiff", "activation-checkpoint", "adamw", "compute-copies", "cse", "dce"];

/// The training lowering of a model whose `meta` names a device mesh (`world_size > 1`): the
/// SPMD partitioning passes around the single-rank lowering, then the collective safety check.
pub const SPMD_TRAIN_PIPELINE: [&str; 16] = [
    "shard-tp",
    "shard-dp",
    "master-weights",
    "float8",
    "autodiff",
    "activation-checkpoint",
    "sync-grads",
    "adamw",
    "compute-copies",
    "cse",
    "float8-fsdp-gather",
    "dce",
    "async-tp",
    "prefetch-gathers",
    "prefetch-next-layer",
    "check-collectives",
];

/// The passes of the eval step (forward and loss only, `titanc lower --to eval`): the same
/// fp32 masters read through compute-dtype casts as the training step, the same float8
/// linears (with `--float8`; their forward expanded as `autodiff` expands it for training), no
/// autodiff, no optimizer; `loss` is the only output.
pub const EVAL_PIPELINE: [&str; 5] = ["master-weights", "float8", "float8-forward", "cse", "dce"];

/// The eval lowering of a model whose `meta` names a mesh: partitioned like the training step,
/// the loss all-reduced over the mesh.
pub const SPMD_EVAL_PIPELINE: [&str; 11] = [
    "shard-tp",
    "shard-dp",
    "master-weights",
    "float8",
    "float8-forward",
    "reduce-loss",
    "cse",
    "dce",
    "prefetch-gathers",
    "prefetch-next-layer",
    "check-collectives",
];

/// `train` followed by `fuse` (checked at compile time to be one longer).
const fn then_fuse<const N: usize, const M: usize>(train: [&'static str; N]) -> [&'static str; M] {
    assert!(M == N + 1, "a build pipeline is its training pipeline plus `fuse`");
    let mut out = [""; M];
    let mut i = 0;
    while i < N {
        out[i] = train[i];
        i += 1;
    }
    out[N] = "fuse";
    out
}

/// The passes of `titanc build`: the training lowering, then fusion.
pub const BUILD_PIPELINE: [&str; 9] = then_fuse(TRAIN_PIPELINE);

/// The passes of `titanc build` for a model whose `meta` names a mesh: the SPMD training
/// lowering, then fusion (collectives stay steps of their own).
pub const SPMD_BUILD_PIPELINE: [&str; 17] = then_fuse(SPMD_TRAIN_PIPELINE);

/// The build pipeline for `model`: [`SPMD_BUILD_PIPELINE`] when its `meta` names a mesh of more
/// than one rank, else [`BUILD_PIPELINE`].
pub fn build_pipeline(model: &Graph) -> Result<&'static [&'static str], PassError> {
    let mesh = titan_ir::Mesh::from_graph(model).map_err(|message| PassError::new("build", PassErrorKind::Invalid, message))?;
    Ok(if mesh.is_some_and(|m| m.world_size() > 1) { &SPMD_BUILD_PIPELINE } else { &BUILD_PIPELINE })
}

/// The eval-step passes of `titanc build` (fusion included).
pub const EVAL_BUILD_PIPELINE: [&str; 6] = then_fuse(EVAL_PIPELINE);

/// The eval-step passes of `titanc build` on a mesh (fusion included).
pub const SPMD_EVAL_BUILD_PIPELINE: [&str; 12] = then_fuse(SPMD_EVAL_PIPELINE);

/// The eval lowering of `model` (without fusion): [`SPMD_EVAL_PIPELINE`] on a mesh, else
/// [`EVAL_PIPELINE`].
pub fn eval_pipeline(model: &Graph) -> Result<&'static [&'static str], PassError> {
    let mesh = titan_ir::Mesh::from_graph(model).map_err(|message| PassError::new("lower-to-eval", PassErrorKind::Invalid, message))?;
    Ok(if mesh.is_some_and(|m| m.world_size() > 1) { &SPMD_EVAL_PIPELINE } else { &EVAL_PIPELINE })
}

/// Every pass: those of [`BUILD_PIPELINE`] with the SPMD ones of [`SPMD_TRAIN_PIPELINE`] in place.
pub fn pass_table() -> &'static [PassInfo] {
    &PASSES
}

fn valid_names() -> String {
    PASSES.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
}

/// The table entries of `names`, in order; an unknown name is an error listing the valid ones.
pub fn lookup_passes(names: &[&str]) -> Result<Vec<PassInfo>, PassError> {
    names
        .iter()
        .map(|&n| PASSES.iter().find(|p| p.name == n).copied().ok_or_else(|| PassError::UnknownPass { name: n.to_string(), valid: valid_names() }))
        .collect()
}

/// After which passes to capture the IR text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DumpAfter {
    #[default]
    None,
    /// After the pass of this name (it must be in the pipeline).
    Pass(String),
    All,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PipelineOptions {
    /// Verify the input and the graph after every pass (tests turn this on).
    pub verify_each: bool,
    pub dump_after: DumpAfter,
    /// Show per-pass wall time when the report is printed (it is always measured).
    pub timings: bool,
}

/// What one pass did.
#[derive(Clone, Debug, PartialEq)]
pub struct PassRecord {
    pub pass: &'static str,
    pub stats: PassStats,
    /// Wall time of the pass itself (not of verification or dumping).
    pub wall: Duration,
}

/// What a pipeline run did: per-pass statistics and times, and the requested IR dumps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PipelineReport {
    pub passes: Vec<PassRecord>,
    /// `(pass, IR text after it)`, in pipeline order.
    pub dumps: Vec<(&'static str, String)>,
    /// Whether [`fmt::Display`] shows the time column.
    pub timings: bool,
}

impl PipelineReport {
    /// The statistics of the first run of `pass`.
    pub fn stats(&self, pass: &str) -> Option<&PassStats> {
        self.passes.iter().find(|r| r.pass == pass).map(|r| &r.stats)
    }

    /// The IR text captured after `pass`.
    pub fn dump(&self, pass: &str) -> Option<&str> {
        self.dumps.iter().find(|(p, _)| *p == pass).map(|(_, s)| s.as_str())
    }

    pub fn total_wall(&self) -> Duration {
        self.passes.iter().map(|r| r.wall).sum()
    }
}

impl fmt::Display for PipelineReport {
    /// One line per pass: name, time (with `timings`), statistics.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self.passes.iter().map(|r| r.pass.len()).chain([5]).max().unwrap_or(5);
        let ms = |d: Duration| format!("{:>9.2} ms", d.as_secs_f64() * 1e3);
        for r in &self.passes {
            if self.timings {
                writeln!(f, "{:<width$}  {}  {}", r.pass, ms(r.wall), r.stats)?;
            } else {
                writeln!(f, "{:<width$}  {}", r.pass, r.stats)?;
            }
            for note in &r.stats.notes {
                writeln!(f, "{:<width$}  note: {note}", r.pass)?;
            }
        }
        if self.timings {
            writeln!(f, "{:<width$}  {}", "total", ms(self.total_wall()))?;
        }
        Ok(())
    }
}

fn verify_messages(g: &Graph) -> Vec<String> {
    titan_ir::verify::verify(g).iter().map(ToString::to_string).collect()
}

/// Run `passes` on `g` in order. With `verify_each` the input and the result of every pass are
/// verified, and a failure names the pass that produced the invalid graph. `dump_after` must
/// name a pass of `passes`.
pub fn run_pipeline(g: &mut Graph, passes: &[PassInfo], train: &TrainOptions, popts: &PipelineOptions) -> Result<PipelineReport, PassError> {
    if let DumpAfter::Pass(name) = &popts.dump_after {
        lookup_passes(&[name.as_str()])?;
        if !passes.iter().any(|p| p.name == name) {
            let ran: Vec<&str> = passes.iter().map(|p| p.name).collect();
            return Err(PassError::new(
                "pipeline",
                PassErrorKind::Precondition,
                format!("`--dump-after {name}`: this pipeline does not run `{name}`; it runs {}", ran.join(", ")),
            ));
        }
    }
    let ctx = PassContext { train: train.clone(), verify_each: popts.verify_each };
    if popts.verify_each {
        let errors = verify_messages(g);
        if !errors.is_empty() {
            return Err(PassError::InvalidInput { errors });
        }
    }
    let mut report = PipelineReport { timings: popts.timings, ..PipelineReport::default() };
    let mut input_ids = true;
    for p in passes {
        let start = Instant::now();
        let stats = (p.run)(g, &ctx).map_err(|diag| PassError::from_diag(p.name, diag, g, input_ids))?;
        input_ids &= !p.renumbers;
        let wall = start.elapsed();
        report.passes.push(PassRecord { pass: p.name, stats, wall });
        if popts.verify_each {
            let errors = verify_messages(g);
            if !errors.is_empty() {
                return Err(PassError::Verify { after: p.name, errors });
            }
        }
        let dump = match &popts.dump_after {
            DumpAfter::None => false,
            DumpAfter::All => true,
            DumpAfter::Pass(name) => name == p.name,
        };
        if dump {
            report.dumps.push((p.name, titan_ir::print::print_graph(g)));
        }
    }
    Ok(report)
}

/// The whole compile of `titanc build`: copy `model` as `<name>_train`, lower it to the training
/// step and fuse it into kernels ([`build_pipeline`]: the SPMD passes first when `model`'s meta
/// names a mesh). Returns the kernel graph and the report.
pub fn compile_train_graph(model: &Graph, opts: &TrainOptions, popts: &PipelineOptions) -> Result<(Graph, PipelineReport), PassError> {
    let passes = lookup_passes(build_pipeline(model)?)?;
    crate::train::run_on_copy(model, opts, &passes, popts)
}

/// The eval step of `titanc build`: copy `model` as `<name>_eval`, lower it with
/// [`eval_pipeline`] and fuse it. Returns the kernel graph and the report.
pub fn compile_eval_graph(model: &Graph, opts: &TrainOptions, popts: &PipelineOptions) -> Result<(Graph, PipelineReport), PassError> {
    let mut names = eval_pipeline(model)?.to_vec();
    names.push("fuse");
    crate::train::run_eval_on_copy(model, opts, &lookup_passes(&names)?, popts)
}

/// The unfused eval step of `model` (`titanc lower --to eval`): the reference the compiled eval
/// step is checked against.
pub fn lower_to_eval(model: &Graph, opts: &TrainOptions) -> Result<Graph, PassError> {
    let passes = lookup_passes(eval_pipeline(model)?)?;
    crate::train::run_eval_on_copy(model, opts, &passes, &PipelineOptions::default()).map(|(g, _)| g)
}

fn run_reduce_loss(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
    Ok(PassStats::new().with("all_reduces", crate::sync_grads::reduce_loss_pass(g)? as u64))
}

fn run_master_weights(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
    let s = crate::master_weights::master_weights(g)?;
    Ok(PassStats::new().with("params", s.params as u64).with("casts", s.casts as u64))
}

fn run_compute_copies(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
    let s = crate::compute_copies::compute_copies(g)?;
    Ok(PassStats::new().with("copies", s.copies as u64).with("lookups_cast", s.lookups_cast as u64))
}

fn run_autodiff(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
    if crate::train::gradient_map(g)?.is_some() {
        return Err(PassDiag::precondition("the graph already has a gradient map (meta `gradients`): `autodiff` has run on it"));
    }
    let (grads, s) = crate::autodiff::differentiate_main(g, "loss")?;
    // The forward of every `linear_f8` has been differentiated as one op; now it becomes the
    // quantization primitives and `scaled_matmul` that fusion and the kernels see.
    let expanded = crate::float8::expand(g)?;
    let mut outputs = Vec::new();
    let mut map = Vec::new();
    for (i, grad) in grads.iter().enumerate() {
        let Some(value) = *grad else { continue };
        let name = grad_output_name(&g.main, i);
        let taken = g.main.outputs.iter().chain(&outputs).any(|o: &Output| o.name.as_deref() == Some(name.as_str()));
        if taken {
            return Err(PassDiag::invalid(format!(
                "the gradient of argument {i} would be output `{name}`, which already exists; rename the argument or that output"
            ))
            .at(Loc::Arg(RegionRef::Main, i)));
        }
        map.push((i, name.clone()));
        outputs.push(Output { name: Some(name), value });
    }
    let n = outputs.len() as u64;
    g.main.outputs.extend(outputs);
    crate::train::record_gradients(g, &map);
    let stats = PassStats::new()
        .with("blocks_differentiated", s.blocks_differentiated as u64)
        .with("saved_per_layer", s.saved_per_layer as u64)
        .with("backward_nodes", s.backward_nodes as u64)
        .with("gradients", n);
    Ok(if expanded > 0 { stats.with("float8_expanded", expanded as u64) } else { stats })
}

fn run_float8_fsdp_gather(g: &mut Graph, ctx: &PassContext) -> Result<PassStats, PassDiag> {
    let Some(opts) = ctx.train.float8.as_ref().filter(|o| o.fsdp_all_gather) else { return Ok(PassStats::new()) };
    let s = crate::float8_fsdp::float8_fsdp_gather(g, opts.precompute_scale)?;
    let mut notes = s.notes;
    if s.gathers == 0 {
        notes.push("no weight is all-gathered over dp_shard and quantized tensorwise: nothing to gather in fp8".to_string());
    }
    Ok(PassStats::new().with("fp8_gathers", s.gathers as u64).with("amax_all_reduces", s.all_reduces as u64).with_notes(notes))
}

fn run_float8_forward(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
    if crate::train::gradient_map(g)?.is_some() {
        return Err(PassDiag::precondition(
            "the graph has a gradient map: `autodiff` has run and expanded its float8 linears; `float8-forward` is for a graph nothing differentiates (the eval step)",
        ));
    }
    Ok(PassStats::new().with("expanded", crate::float8::expand(g)? as u64))
}

fn run_float8(g: &mut Graph, ctx: &PassContext) -> Result<PassStats, PassDiag> {
    let Some(opts) = &ctx.train.float8 else { return Ok(PassStats::new()) };
    let decisions = crate::float8::float8(g, opts)?;
    let converted = decisions.iter().filter(|d| d.kept.is_none()).count() as u64;
    Ok(PassStats::new()
        .with("float8", converted)
        .with("kept", decisions.len() as u64 - converted)
        .with_notes(crate::float8::report_lines(opts.recipe, &decisions)))
}

fn run_activation_checkpoint(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
    let s = crate::activation_checkpoint::activation_checkpoint(g)?;
    if s.blocks == 0 {
        return Ok(PassStats::new());
    }
    let mut stats = PassStats::new()
        .with("blocks", s.blocks as u64)
        .with("saved_before", s.saved_before as u64)
        .with("saved_after", s.saved_after as u64)
        .with("recomputed", s.recomputed as u64)
        .with("recompute_nodes", s.recompute_nodes as u64)
        .with("saved_bytes_per_layer_before", s.saved_bytes_before)
        .with("saved_bytes_per_layer_after", s.saved_bytes_after)
        .with("saved_bytes_total_before", s.total_saved_bytes_before)
        .with("saved_bytes_total_after", s.total_saved_bytes_after)
        .with("blocks_removed", s.blocks_removed as u64)
        .with("recompute_flops", s.recompute_flops)
        .with_notes(s.report_lines());
    if !s.pareto.is_empty() {
        stats.series.push(("pareto", s.pareto.iter().map(|&(b, t)| (b as f64, t)).collect()));
        stats.series.push(("chosen", vec![(s.total_saved_bytes_after as f64, s.recompute_seconds)]));
    }
    Ok(stats)
}

fn run_adamw(g: &mut Graph, ctx: &PassContext) -> Result<PassStats, PassDiag> {
    let map = crate::train::gradient_map(g)?
        .ok_or_else(|| PassDiag::precondition("the graph has no gradient map (meta `gradients`); run `autodiff` before `adamw`"))?;
    let mut grads = vec![None; g.main.args.len()];
    for &(arg, output) in &map {
        grads[arg] = Some(g.main.outputs[output].value);
    }
    let taken: Vec<usize> = map.iter().map(|&(_, o)| o).collect();
    let mut k = 0;
    g.main.outputs.retain(|_| {
        k += 1;
        !taken.contains(&(k - 1))
    });
    crate::train::take_gradient_map(g);
    let s = crate::adamw::append_adamw(g, &grads, &ctx.train)?;
    Ok(PassStats::new().with("params", s.params as u64).with("state_buffers", s.state_buffers as u64))
}

fn run_shard_tp(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
    let s = crate::shard_tp::shard_tp(g)?;
    Ok(PassStats::new()
        .with("column_parallel", s.column_parallel as u64)
        .with("row_parallel", s.row_parallel as u64)
        .with("kv_replicated", s.kv_replicated as u64)
        .with("vocab_parallel", s.vocab_parallel as u64)
        .with("collectives", s.collectives as u64))
}

fn run_shard_dp(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
    let s = crate::shard_dp::shard_dp(g)?;
    Ok(PassStats::new().with("params_sharded", s.params_sharded as u64).with("gathers", s.gathers as u64))
}

fn run_sync_grads(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
    let s = crate::sync_grads::sync_grads(g)?;
    Ok(PassStats::new().with("grad_all_reduces", s.grad_all_reduces as u64))
}

fn run_async_tp(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
    let s = crate::async_tp::async_tp(g)?;
    Ok(PassStats::new()
        .with("gathers_split", s.gathers_split as u64)
        .with("scatters_split", s.scatters_split as u64)
        .with("kept", s.kept as u64)
        .with("ring_shifts", s.ring_shifts as u64)
        .with("chunk_gemms", s.chunk_gemms as u64)
        .with_notes(s.decisions))
}

fn run_prefetch_gathers(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
    let s = crate::prefetch_gathers::prefetch_gathers(g);
    let stats = PassStats::new().with("hoisted", s.hoisted as u64);
    Ok(if s.after_ring_shifts > 0 { stats.with("tp_gathers_after_ring_shifts", s.after_ring_shifts as u64) } else { stats })
}

fn run_prefetch_next_layer(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
    let s = crate::prefetch_next_layer::prefetch_next_layer(g)?;
    Ok(PassStats::new().with("loops", s.loops as u64).with("gathers", s.gathers as u64))
}

fn run_check_collectives(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
    let s = crate::check_collectives::check_collectives(g)?;
    Ok(PassStats::new().with("collectives", s.collectives as u64).with("communicators", s.communicators as u64))
}

fn run_cse(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
    Ok(PassStats::new().with("merged", crate::cse::cse(g) as u64))
}

fn run_dce(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
    let removed = crate::dce::dce(g);
    g.canonicalize();
    Ok(PassStats::new().with("removed", removed as u64))
}

fn run_fuse(g: &mut Graph, ctx: &PassContext) -> Result<PassStats, PassDiag> {
    let s = crate::fuse::fuse(g)?;
    if ctx.verify_each {
        let errors = crate::fuse::check_kernel_graph(g);
        if !errors.is_empty() {
            return Err(PassDiag::invalid(format!("the result is not a kernel graph: {}", errors.join("; "))));
        }
    }
    Ok(PassStats::new()
        .with("regions", s.regions as u64)
        .with("kernels", s.kernels as u64)
        .with("fused_kernels", s.fused_kernels as u64)
        .with("ops_outlined", s.ops_outlined as u64)
        .with("constants_copied", s.constants_copied as u64)
        .with("recomputed", s.recomputed as u64))
}

#[cfg(test)]
mod tests {
    use titan_ir::{ArgKind, BinaryOp, DType, Init, Op, ParamInfo, ReduceKind, TensorType, Value};

    use super::*;

    /// `loss = sum(x * w)` with one parameter `w`.
    fn model() -> Graph {
        let mut g = Graph::new("tiny");
        let x = g.main.add_arg(TensorType::fixed(DType::F32, &[4]), ArgKind::Input, Some("x"));
        let w = g.main.add_arg(TensorType::fixed(DType::BF16, &[4]), ArgKind::Param(ParamInfo { name: "w".into(), init: Init::Ones }), Some("w"));
        let mut b = g.main_builder();
        let wf = b.push_typed(Op::Cast, &[w], TensorType::fixed(DType::F32, &[4])).expect("cast");
        let y = b.push1(Op::Binary(BinaryOp::Mul), &[x, wf]).expect("mul");
        let loss = b.push1(Op::Reduce { kind: ReduceKind::Sum, axes: vec![0] }, &[y]).expect("sum");
        g.main.outputs.push(Output { name: Some("loss".into()), value: loss });
        g
    }

    fn opts(verify_each: bool, dump_after: DumpAfter) -> PipelineOptions {
        PipelineOptions { verify_each, dump_after, timings: true }
    }

    #[test]
    fn the_table_runs_the_training_lowering() {
        let passes = lookup_passes(&TRAIN_PIPELINE).expect("names");
        let mut g = model();
        let report = run_pipeline(&mut g, &passes, &TrainOptions::default(), &opts(true, DumpAfter::All)).expect("pipeline");
        let ran: Vec<&str> = report.passes.iter().map(|r| r.pass).collect();
        assert_eq!(ran, TRAIN_PIPELINE);
        assert_eq!(report.dumps.len(), TRAIN_PIPELINE.len());
        // Between autodiff and adamw the gradient is an output; adamw consumes it.
        assert!(report.dump("autodiff").expect("dump").contains("output d_w = "));
        assert!(!report.dump("adamw").expect("dump").contains("d_w"));
        assert_eq!(report.stats("master-weights").map(ToString::to_string).as_deref(), Some("params 1, casts 1"));
        assert_eq!(report.stats("adamw").and_then(|s| s.get("state_buffers")), Some(3));
        let outputs: Vec<&str> = g.main.outputs.iter().filter_map(|o| o.name.as_deref()).collect();
        assert_eq!(outputs, ["loss", "grad_norm", "lr"]);
        let text = report.to_string();
        assert!(text.contains(" ms  ") && text.starts_with("master-weights") && text.contains("\ntotal "), "{text}");
        // `lower_to_train` is the same pipeline (plus the train name and meta).
        let lowered = crate::lower_to_train(&model(), &TrainOptions::default()).expect("lowering");
        g.name = lowered.name.clone();
        g.meta = lowered.meta.clone();
        assert_eq!(titan_ir::print::print_graph(&g), titan_ir::print::print_graph(&lowered));
    }

    #[test]
    fn compile_fuses_after_lowering() {
        let (g, report) = compile_train_graph(&model(), &TrainOptions::default(), &opts(true, DumpAfter::Pass("fuse".into()))).expect("compile");
        assert_eq!(g.name, "tiny_train");
        assert_eq!(report.dumps.len(), 1);
        assert!(report.dump("fuse").expect("dump").contains("kind = optimizer"));
        assert!(report.stats("fuse").and_then(|s| s.get("kernels")).is_some_and(|k| k > 0));
    }

    #[test]
    fn dump_after_names_are_checked() {
        let passes = lookup_passes(&TRAIN_PIPELINE).expect("names");
        let err = run_pipeline(&mut model(), &passes, &TrainOptions::default(), &opts(false, DumpAfter::Pass("fusion".into()))).expect_err("unknown");
        assert_eq!(
            err.to_string(),
            "unknown pass `fusion`; valid passes: shard-tp, shard-dp, master-weights, float8, float8-forward, autodiff, activation-checkpoint, sync-grads, reduce-loss, adamw, compute-copies, cse, float8-fsdp-gather, dce, async-tp, prefetch-gathers, prefetch-next-layer, check-collectives, fuse"
        );
        let err = run_pipeline(&mut model(), &passes, &TrainOptions::default(), &opts(false, DumpAfter::Pass("fuse".into()))).expect_err("not run");
        assert!(
            err.to_string().contains(
                "this pipeline does not run `fuse`; it runs master-weights, float8, autodiff, activation-checkpoint, adamw, compute-copies, cse, dce"
            ),
            "{err}"
        );
        assert!(matches!(lookup_passes(&["cse", "nope"]), Err(PassError::UnknownPass { name, .. }) if name == "nope"));
    }

    fn breaks_the_graph(g: &mut Graph, _: &PassContext) -> Result<PassStats, PassDiag> {
        g.main.outputs[0].value = Value(9999);
        Ok(PassStats::new())
    }

    #[test]
    fn verify_each_names_the_pass_that_broke_the_graph() {
        let mut passes = lookup_passes(&["master-weights"]).expect("names");
        passes.push(PassInfo::new("break-it", "test", breaks_the_graph));
        let err = run_pipeline(&mut model(), &passes, &TrainOptions::default(), &opts(true, DumpAfter::None)).expect_err("broken");
        match &err {
            PassError::Verify { after, errors } => {
                assert_eq!(*after, "break-it");
                assert!(errors.iter().any(|e| e.contains("value #9999")), "{errors:?}");
            }
            other => panic!("expected a verify error, got {other}"),
        }
        // Without verification the broken graph goes through.
        assert!(run_pipeline(&mut model(), &passes, &TrainOptions::default(), &opts(false, DumpAfter::None)).is_ok());
        // An invalid input is reported as such, before any pass runs.
        let mut bad = model();
        bad.main.outputs[0].value = Value(777);
        let err = run_pipeline(&mut bad, &passes, &TrainOptions::default(), &opts(true, DumpAfter::None)).expect_err("invalid input");
        assert!(matches!(err, PassError::InvalidInput { .. }), "{err}");
    }

    #[test]
    fn adamw_without_autodiff_says_what_to_run_first() {
        let passes = lookup_passes(&["master-weights", "adamw"]).expect("names");
        let err = run_pipeline(&mut model(), &passes, &TrainOptions::default(), &PipelineOptions::default()).expect_err("no gradients");
        assert!(err.to_string().contains("run `autodiff` before `adamw`"), "{err}");
    }

    #[test]
    fn every_pass_has_a_kebab_case_name_and_a_summary() {
        for p in pass_table() {
            assert!(p.name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'), "{}", p.name);
            assert!(!p.summary.is_empty() && !p.summary.ends_with('.'), "{}", p.name);
        }
        let names: Vec<&str> = pass_table().iter().map(|p| p.name).collect();
        let single: Vec<&str> = names.iter().copied().filter(|n| BUILD_PIPELINE.contains(n)).collect();
        assert_eq!(single, BUILD_PIPELINE);
        let spmd: Vec<&str> = names.iter().copied().filter(|n| SPMD_TRAIN_PIPELINE.contains(n)).collect();
        assert_eq!(spmd, SPMD_TRAIN_PIPELINE);
        assert!(names.iter().all(|n| BUILD_PIPELINE.contains(n) || SPMD_TRAIN_PIPELINE.contains(n) || SPMD_EVAL_PIPELINE.contains(n)));
    }
}
