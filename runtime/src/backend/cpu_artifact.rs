//! The CPU backend over an artifact: the reference executor of the schedule. One byte vector
//! per arena, sized by the memory plan; every buffer lives at its offset in its real dtype
//! encoding, so the plan is exercised for real (two live buffers that overlap corrupt each
//! other and the results show it). Steps run in order: a `launch` decodes its input buffers,
//! runs the kernel's body block of `graph.ir` on the interpreter (bf16 emulated) and encodes the
//! results into its output buffers; `copy`, `memset` and `loop` (layer index, carry
//! ping-pong and the `prefetch` steps one iteration ahead, in `titan_ir::artifact::loop_runs`
//! order) move bytes as documented in `titan_ir::artifact`.
//!
//! A body runs op by op with the interpreter's own `eval_op`, in the body's order: the same
//! computation as [`Interpreter::run_region`] (which [`CpuArtifactTrainer::set_streaming`]
//! switches back to), but each input is decoded at its first use and each output encoded as
//! soon as it is computed, so the multi-tensor optimizer kernel of a large model holds one
//! parameter's operands at a time rather than a second copy of the whole training state.
//!
//! The activation and gradient arenas are filled with NaN bytes before every step, as device
//! memory holds garbage: a kernel reading a buffer nothing wrote this step poisons the loss.
//!
//! An SPMD artifact (a mesh in its manifest) runs one trainer per rank
//! ([`CpuArtifactTrainer::with_rank`], driven by `sim_mesh::ArtifactMeshTrainer`): every rank
//! runs the same schedule, its `collective` steps go through the rank's [`Communicator`]
//! (the interpreter's `eval_mesh_op`, so the same bits as graph mode), and each state buffer
//! starts as the rank's shard of the single-rank initialization.
//!
//! [`Communicator`]: titan_ir::interp::Communicator

use std::sync::Arc;
use std::time::Instant;

use titan_ir::artifact::{Arena, BufRef, Buffer, BufferClass, Step};
use titan_ir::interp::{Interpreter, Precision, Tensor, eval_mesh_op, eval_op};
use titan_ir::{DType, Op, Region, TensorType, ValueDef};

use crate::RuntimeError;
use crate::artifact::{Artifact, StepFeeds, arena_name};
use crate::backend::KernelTime;
use crate::backend::codec::{decode, encode, encode_floats, encode_ints};
use crate::backend::cpu_graph::{RankContext, init_state_shard};
use crate::backend::{StepMetrics, Trainer, check_rank_batch};
use crate::data::Batch;

/// The byte every element of a poisoned arena starts with: `0xff..` is NaN in every float
/// format and -1 as an integer.
const POISON: u8 = 0xff;

const ARENAS: [Arena; 4] = [Arena::Inputs, Arena::Params, Arena::OptimizerState, Arena::Activations];

fn slot(a: Arena) -> usize {
    match a {
        Arena::Inputs => 0,
        Arena::Params => 1,
        Arena::OptimizerState => 2,
        Arena::Activations => 3,
    }
}

fn bad(message: String) -> RuntimeError {
    RuntimeError::Artifact(titan_ir::artifact::ArtifactError::Invalid(message))
}

/// Where a [`BufRef`] points this iteration: a byte range of one arena.
#[derive(Clone, Copy, Debug)]
struct View {
    arena: usize,
    start: usize,
    len: usize,
    dtype: DType,
}

/// The loop iteration a step runs in.
#[derive(Clone, Copy)]
struct Frame<'s> {
    /// The layer index `i`.
    layer: usize,
    /// The iteration number in execution order, which picks the carry buffers.
    t: usize,
    carries: &'s [[u32; 2]],
}

/// How to run a kernel body op by op (see [`CpuArtifactTrainer::run_streaming`]), computed
/// once per kernel.
struct BodyPlan {
    /// Value index -> the argument it is.
    arg_of: Vec<Option<usize>>,
    /// Value index -> how many node operands read it.
    uses: Vec<u32>,
    /// Value index -> the body outputs it is.
    outputs_of: Vec<Vec<usize>>,
    /// Arguments returned as outputs, decoded before anything is written.
    eager_args: Vec<usize>,
    /// Per node in program order: its declared result types.
    result_types: Vec<Vec<TensorType>>,
}

impl BodyPlan {
    /// `None` for a body the interpreter must run whole (nested `repeat`/`kernel` nodes) or
    /// that refers to values or nodes that do not exist (the interpreter reports those).
    fn new(body: &Region) -> Option<BodyPlan> {
        let n = body.values.len();
        let mut arg_of = vec![None; n];
        for (i, a) in body.args.iter().enumerate() {
            *arg_of.get_mut(a.value.index())? = Some(i);
        }
        let mut uses = vec![0u32; n];
        let mut result_types = Vec::with_capacity(body.order.len());
        for id in &body.order {
            let node = body.nodes.get(id.index())?;
            if matches!(node.op, Op::Repeat { .. } | Op::Kernel { .. }) {
                return None;
            }
            for v in &node.inputs {
                *uses.get_mut(v.index())? += 1;
            }
            let mut types = Vec::with_capacity(node.results.len());
            for r in &node.results {
                types.push(body.values.get(r.index())?.ty.clone());
            }
            result_types.push(types);
        }
        let mut outputs_of = vec![Vec::new(); n];
        let mut eager_args = Vec::new();
        for (o, out) in body.outputs.iter().enumerate() {
            outputs_of.get_mut(out.value.index())?.push(o);
            if let ValueDef::Arg(i) = body.values[out.value.index()].def {
                eager_args.push(i as usize);
            }
        }
        eager_args.sort_unstable();
        eager_args.dedup();
        if eager_args.iter().any(|&i| i >= body.args.len()) {
            return None;
        }
        Some(BodyPlan { arg_of, uses, outputs_of, eager_args, result_types })
    }
}

/// Runs an artifact's schedule on the CPU (one device, or one rank of an SPMD artifact).
pub struct CpuArtifactTrainer<'a> {
    artifact: &'a Artifact,
    interp: Interpreter<'a>,
    /// One byte vector per arena, indexed by [`slot`].
    arenas: Vec<Vec<u8>>,
    tokens: &'a Buffer,
    targets: &'a Buffer,
    step_buf: &'a Buffer,
    loss: &'a Buffer,
    grad_norm: Option<&'a Buffer>,
    lr: Option<&'a Buffer>,
    batch: usize,
    seq: usize,
    /// Elements of `tokens`: `batch * seq`, or this rank's share with sequence parallelism.
    tokens_len: usize,
    vocab: usize,
    step: u64,
    poison: bool,
    /// The rank of an SPMD artifact: mesh, coordinates and communicator.
    rank: Option<RankContext>,
    /// Per kernel (in `manifest.kernels` order) when profiling.
    profile: Option<Vec<KernelTime>>,
    /// Steps run since profiling was enabled.
    profiled_steps: u64,
    /// When profiling: the start of the current step, and `(start, seconds)` of every operation
    /// it ran so far, in execution order.
    step_start: Option<Instant>,
    op_times: Vec<(f64, f64)>,
    /// Per kernel (in `manifest.kernels` order): how to stream its body, if it can be.
    plans: Arc<Vec<Option<BodyPlan>>>,
    streaming: bool,
    /// The eval step's interpreter and body plans (per `manifest.eval.kernels`), when the
    /// artifact has one.
    eval: Option<(Interpreter<'a>, Arc<Vec<Option<BodyPlan>>>)>,
    /// The schedule being run is the eval step's: buffer and kernel ids are its own.
    in_eval: bool,
}

fn usize_of(x: u64, what: &str) -> Result<usize, RuntimeError> {
    usize::try_from(x).map_err(|_| bad(format!("{what} ({x} bytes) does not fit this machine's address space")))
}

impl<'a> CpuArtifactTrainer<'a> {
    /// The bytes this trainer allocated for its arenas (the memory plan's peak, as allocated).
    pub fn allocated_bytes(&self) -> u64 {
        self.arenas.iter().map(|a| a.len() as u64).sum()
    }

    /// Allocate the arenas of `artifact`'s memory plan and initialize every parameter and
    /// optimizer-state buffer from `graph.ir`'s state arguments with `seed` (the same values
    /// graph mode starts from). A single-device artifact only; see [`Self::with_rank`].
    pub fn new(artifact: &'a Artifact, seed: u64) -> Result<CpuArtifactTrainer<'a>, RuntimeError> {
        CpuArtifactTrainer::with_rank(artifact, seed, None)
    }

    /// [`Self::new`], as rank `rank` of an SPMD artifact: collective steps go through
    /// `rank.comm`, and each state buffer starts as this rank's shard (by the placement of its
    /// `graph.ir` state argument) of the single-rank initialization.
    pub fn with_rank(artifact: &'a Artifact, seed: u64, rank: Option<RankContext>) -> Result<CpuArtifactTrainer<'a>, RuntimeError> {
        let m = &artifact.manifest;
        if m.ranks.len() != 1 {
            return Err(RuntimeError::Backend(format!(
                "the artifact has {} schedules; titan artifacts carry one (SPMD: every rank runs it), rebuild it with `titanc build`",
                m.ranks.len()
            )));
        }
        match &rank {
            None if m.mesh.world_size > 1 => {
                return Err(RuntimeError::Backend(format!(
                    "the artifact is built for a mesh of {} ranks; run it on the simulated mesh (`titan-run DIR` on the cpu backend), or rebuild it without a mesh",
                    m.mesh.world_size
                )));
            }
            Some(r) => artifact.check_rank_mesh(&r.mesh)?,
            None => {}
        }
        let mut arenas = Vec::with_capacity(ARENAS.len());
        for a in ARENAS {
            let bytes = usize_of(artifact.arena_bytes(a), &format!("the `{}` arena", arena_name(a)))?;
            let mut v = Vec::new();
            v.try_reserve_exact(bytes).map_err(|_| {
                RuntimeError::Backend(format!("cannot allocate the `{}` arena of {bytes} bytes; this machine has too little memory", arena_name(a)))
            })?;
            v.resize(bytes, 0);
            arenas.push(v);
        }
        let StepFeeds { tokens, targets, step: step_buf, batch, seq, tokens_len } = artifact.step_feeds(rank.as_ref().map_or(1, |r| r.mesh.sizes[2]))?;
        let t = &m.training;
        let loss = artifact.output_buffer("loss").ok_or_else(|| bad("no buffer holds the `loss` output".into()))?;
        let interp = match &rank {
            Some(r) => Interpreter::new(&artifact.graph, Precision::Emulate).with_communicator(Arc::clone(&r.comm)),
            None => Interpreter::new(&artifact.graph, Precision::Emulate),
        };
        let eval = match (&m.eval, &artifact.eval) {
            (Some(e), Some(p)) => {
                let interp = match &rank {
                    Some(r) => Interpreter::new(&p.graph, Precision::Emulate).with_communicator(Arc::clone(&r.comm)),
                    None => Interpreter::new(&p.graph, Precision::Emulate),
                };
                let plans = (0..e.kernels.len() as u32).map(|id| artifact.eval_kernel(id).and_then(|(_, body)| BodyPlan::new(body))).collect();
                Some((interp, Arc::new(plans)))
            }
            _ => None,
        };
        let mut trainer = CpuArtifactTrainer {
            artifact,
            interp,
            arenas,
            tokens,
            targets,
            step_buf,
            loss,
            grad_norm: artifact.output_buffer("grad_norm"),
            lr: artifact.output_buffer("lr"),
            batch,
            seq,
            tokens_len,
            vocab: usize_of(t.vocab_size, "vocab_size")?,
            step: 0,
            poison: true,
            rank,
            streaming: true,
            profile: None,
            profiled_steps: 0,
            step_start: None,
            op_times: Vec::new(),
            plans: Arc::new(m.kernels.iter().map(|k| artifact.graph.block_by_name(&k.body).and_then(|b| BodyPlan::new(artifact.graph.block(b)))).collect()),
            eval,
            in_eval: false,
        };
        trainer.init_state(seed)?;
        Ok(trainer)
    }

    /// Fill every persistent buffer from the state argument of `graph.ir`'s `main` with the
    /// same checkpoint name (this rank's shard of it on a mesh).
    fn init_state(&mut self, seed: u64) -> Result<(), RuntimeError> {
        for slot in self.artifact.state_slots()? {
            let (b, p) = (slot.buffer, slot.info);
            let t = init_state_shard(p, &slot.shape, slot.placement, self.rank.as_ref().map(|r| (r.coords, r.mesh)), seed)?;
            let values = t.floats().ok_or_else(|| bad(format!("state `{}` is not a float tensor", p.name)))?;
            let v = self.whole(b)?;
            encode_floats(values, b.dtype, &mut self.arenas[v.arena][v.start..v.start + v.len]).map_err(|e| bad(format!("state `{}`: {e}", p.name)))?;
        }
        self.refresh_copies(None)
    }

    /// Write the cast of master `master` (of every master: `None`) into its compute copy, as
    /// the optimizer kernel writes it after each update (`compute-copies`).
    fn refresh_copies(&mut self, master: Option<&str>) -> Result<(), RuntimeError> {
        let artifact = self.artifact;
        for (copy, m) in artifact.compute_copies()? {
            if master.is_some_and(|x| m.state.as_ref().is_none_or(|s| s.name != x)) {
                continue;
            }
            let t = self.read(m)?;
            let values = t.floats().ok_or_else(|| bad(format!("master `{}` is not a float tensor", m.name)))?;
            let v = self.whole(copy)?;
            encode_floats(values, copy.dtype, &mut self.arenas[v.arena][v.start..v.start + v.len])
                .map_err(|e| bad(format!("compute copy `{}`: {e}", copy.name)))?;
        }
        Ok(())
    }

    /// Turn the NaN poisoning of the activation and gradient arenas on or off (on by default).
    pub fn set_poison(&mut self, on: bool) {
        self.poison = on;
    }

    /// Run kernel bodies op by op with inputs decoded at first use and outputs encoded at once
    /// (the default), or whole with [`Interpreter::run_region`]. Both give the same bits; the
    /// streaming mode needs far less memory for multi-tensor optimizer kernels.
    pub fn set_streaming(&mut self, on: bool) {
        self.streaming = on;
    }

    /// Record the time spent in each kernel from now on.
    pub fn enable_profile(&mut self) {
        self.profile = Some(vec![KernelTime::default(); self.artifact.manifest.kernels.len()]);
    }

    /// Time per kernel (in `manifest.kernels` order) summed over the profiled steps, and their
    /// number, when profiling.
    pub fn profile(&self) -> Option<(&[KernelTime], u64)> {
        self.profile.as_deref().map(|p| (p, self.profiled_steps))
    }

    pub fn artifact(&self) -> &Artifact {
        self.artifact
    }

    /// The whole of buffer `b`.
    fn whole(&self, b: &Buffer) -> Result<View, RuntimeError> {
        let what = || format!("buffer {} (`{}`)", b.id, b.name);
        let start = usize_of(b.offset, &what())?;
        let len = usize_of(b.bytes, &what())?;
        let arena = slot(b.arena);
        if start.checked_add(len).is_none_or(|end| end > self.arenas[arena].len()) {
            return Err(bad(format!("{} lies outside its arena", what())));
        }
        Ok(View { arena, start, len, dtype: b.dtype })
    }

    /// Resolve `r` in the loop iteration `frame`.
    fn view(&self, r: &BufRef, frame: Option<Frame<'_>>) -> Result<View, RuntimeError> {
        let buffer = |id: u32| {
            let b = if self.in_eval { self.artifact.eval_buffer(id) } else { self.artifact.buffer(id) };
            b.ok_or_else(|| bad(format!("buffer {id} does not exist")))
        };
        match *r {
            BufRef::Buffer { buffer: id, .. } | BufRef::View { buffer: id, .. } => {
                let b = buffer(id)?;
                let v = self.whole(b)?;
                let lead = b.shape.first().copied().unwrap_or(0);
                let tp_coord = self.rank.as_ref().map_or(0, |r| r.coords[2] as u32);
                let (o, n) = r.range_in(v.len as u64, lead, frame.map(|f| f.layer), tp_coord).map_err(bad)?;
                Ok(View { start: v.start + o as usize, len: n as usize, ..v })
            }
            BufRef::Carry { carry, out } => {
                let f = frame.ok_or_else(|| bad(format!("carry {carry} outside any loop")))?;
                let pair = f.carries.get(carry as usize).ok_or_else(|| bad(format!("carry {carry} does not exist")))?;
                self.whole(buffer(pair[(f.t + usize::from(out)) % 2])?)
            }
        }
    }

    fn bytes(&self, v: View) -> &[u8] {
        &self.arenas[v.arena][v.start..v.start + v.len]
    }

    /// Decode a whole buffer.
    fn read(&self, b: &Buffer) -> Result<Tensor<f32>, RuntimeError> {
        let v = self.whole(b)?;
        decode(self.bytes(v), b.dtype, b.shape.iter().map(|&d| d as usize).collect()).map_err(|e| bad(format!("buffer {} (`{}`): {e}", b.id, b.name)))
    }

    /// The first element of an output buffer.
    fn scalar(&self, b: Option<&Buffer>) -> Result<f64, RuntimeError> {
        match b {
            Some(b) => Ok(self.read(b)?.to_f64_vec().first().copied().unwrap_or(f64::NAN)),
            None => Ok(f64::NAN),
        }
    }

    fn feed(&mut self, b: &Buffer, values: &[i64]) -> Result<(), RuntimeError> {
        let v = self.whole(b)?;
        encode_ints(values, b.dtype, &mut self.arenas[v.arena][v.start..v.start + v.len]).map_err(|e| RuntimeError::Data(format!("feeding `{}`: {e}", b.name)))
    }

    /// Execute `steps` in order.
    fn exec(&mut self, steps: &[Step], frame: Option<Frame<'_>>) -> Result<(), RuntimeError> {
        for step in steps {
            let t0 = (self.step_start.is_some() && !matches!(step, Step::Loop { .. })).then(Instant::now);
            match step {
                Step::Launch { kernel, inputs, outputs, .. } => self.launch(*kernel, inputs, outputs, frame)?,
                Step::Copy { src, dst, bytes, .. } => {
                    let (s, d) = (self.view(src, frame)?, self.view(dst, frame)?);
                    let n = usize_of(*bytes, "a copy")?;
                    if n > s.len || n > d.len {
                        return Err(bad(format!("a copy of {n} bytes between buffers of {} and {} bytes", s.len, d.len)));
                    }
                    if s.arena == d.arena {
                        self.arenas[s.arena].copy_within(s.start..s.start + n, d.start);
                    } else {
                        let (lo, hi) = self.arenas.split_at_mut(s.arena.max(d.arena));
                        let (src, dst) = if s.arena < d.arena { (&lo[s.arena], &mut hi[0]) } else { (&hi[0], &mut lo[d.arena]) };
                        dst[d.start..d.start + n].copy_from_slice(&src[s.start..s.start + n]);
                    }
                }
                Step::Memset { dst, bytes, .. } => {
                    let d = self.view(dst, frame)?;
                    let n = usize_of(*bytes, "a memset")?;
                    if n > d.len {
                        return Err(bad(format!("a memset of {n} bytes on a buffer of {} bytes", d.len)));
                    }
                    self.arenas[d.arena][d.start..d.start + n].fill(0);
                }
                Step::Loop { count, reverse, carries, body, prefetch } => {
                    for run in titan_ir::artifact::loop_runs(*count, *reverse, !prefetch.is_empty()) {
                        let steps = if run.prefetch { prefetch } else { body };
                        self.exec(steps, Some(Frame { layer: run.layer, t: run.t, carries }))?;
                    }
                }
                Step::Collective { collective, mesh_dim, group, dim, reduce, dtype, in_shape, out_shape, input, output, more_inputs, shift, .. } => {
                    let what = || format!("`{}` over {mesh_dim}", collective.name());
                    let comm = self.rank.as_ref().map(|r| Arc::clone(&r.comm)).ok_or_else(|| {
                        RuntimeError::Backend(format!("{}: a collective step outside a mesh run; run the artifact on the simulated mesh", what()))
                    })?;
                    let op = collective.to_op(mesh_dim, *group, *dim, *reduce, *shift).map_err(|e| bad(format!("{}: {e}", what())))?;
                    let o = self.view(output, frame)?;
                    let shape = |s: &[u64]| s.iter().map(|&d| usize_of(d, "a collective operand")).collect::<Result<Vec<_>, _>>();
                    let mut xs = Vec::with_capacity(1 + more_inputs.len());
                    for r in std::iter::once(input).chain(more_inputs) {
                        let i = self.view(r, frame)?;
                        if i.dtype != *dtype || o.dtype != *dtype {
                            return Err(bad(format!("{}: the step is {dtype}, the schedule binds {} and {} buffers", what(), i.dtype, o.dtype)));
                        }
                        xs.push(decode(self.bytes(i), *dtype, shape(in_shape)?).map_err(|e| bad(format!("{}: input: {e}", what())))?);
                    }
                    let refs: Vec<&Tensor<f32>> = xs.iter().collect();
                    let y = eval_mesh_op(&op, &refs, comm.as_ref(), Precision::Emulate).map_err(|e| RuntimeError::Backend(format!("{}: {e}", what())))?;
                    if y.shape != shape(out_shape)? {
                        return Err(bad(format!("{}: the result is {:?}, the step declares {out_shape:?}", what(), y.shape)));
                    }
                    encode(&y, &mut self.arenas[o.arena][o.start..o.start + o.len]).map_err(|e| bad(format!("{}: output: {e}", what())))?;
                }
            }
            if let (Some(t0), Some(base)) = (t0, self.step_start) {
                self.op_times.push((t0.duration_since(base).as_secs_f64(), t0.elapsed().as_secs_f64()));
            }
        }
        Ok(())
    }

    fn launch(&mut self, kernel: u32, inputs: &[BufRef], outputs: &[BufRef], frame: Option<Frame<'_>>) -> Result<(), RuntimeError> {
        let artifact = self.artifact;
        let missing = || bad(format!("kernel {kernel} does not exist"));
        let (pos, (k, body)) = if self.in_eval {
            (kernel as usize, artifact.eval_kernel(kernel).ok_or_else(missing)?)
        } else {
            (artifact.kernel_pos(kernel).ok_or_else(missing)?, artifact.kernel(kernel).ok_or_else(missing)?)
        };
        if inputs.len() != body.args.len() || outputs.len() != body.outputs.len() {
            return Err(bad(format!("kernel `{}` is launched with {} inputs and {} outputs", k.name, inputs.len(), outputs.len())));
        }
        let ins = inputs.iter().map(|r| self.view(r, frame)).collect::<Result<Vec<_>, _>>()?;
        let outs = outputs.iter().map(|r| self.view(r, frame)).collect::<Result<Vec<_>, _>>()?;
        // The profile counts training kernels (the eval step is not part of a training step).
        let start = (self.profile.is_some() && !self.in_eval).then(Instant::now);
        let plans = match (&self.eval, self.in_eval) {
            (Some((_, p)), true) => Arc::clone(p),
            _ => Arc::clone(&self.plans),
        };
        let plan = plans.get(pos).ok_or_else(|| bad(format!("kernel `{}` has no execution plan", k.name)))?;
        let result = match plan {
            Some(plan) if self.streaming => self.run_streaming(body, plan, &ins, &outs),
            _ => self.run_whole(body, &ins, &outs),
        };
        result.map_err(|e| match e {
            RuntimeError::Interp(mut e) => {
                e.message = format!("{} (kernel `{}`)", e.message, k.name);
                RuntimeError::Interp(e)
            }
            RuntimeError::Artifact(titan_ir::artifact::ArtifactError::Invalid(m)) => bad(format!("kernel `{}`: {m}", k.name)),
            other => other,
        })?;
        if let (Some(start), Some(p)) = (start, self.profile.as_mut())
            && let Some(kt) = p.get_mut(pos)
        {
            kt.launches += 1;
            kt.seconds += start.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// Decode argument `i` of `body` from `view`.
    fn decode_arg(&self, body: &Region, i: usize, view: View) -> Result<Tensor<f32>, RuntimeError> {
        let ty = body.ty(body.args[i].value);
        if view.dtype != ty.dtype {
            return Err(bad(format!("argument {i} is {ty}, the schedule binds a {} buffer", view.dtype)));
        }
        let shape = ty.resolve(&self.artifact.graph.dims).map_err(bad)?;
        decode(self.bytes(view), ty.dtype, shape).map_err(|e| bad(format!("argument {i}: {e}")))
    }

    fn encode_out(&mut self, i: usize, t: &Tensor<f32>, view: View) -> Result<(), RuntimeError> {
        if view.dtype != t.dtype {
            return Err(bad(format!("result {i} is {}, the schedule binds a {} buffer", t.type_string(), view.dtype)));
        }
        encode(t, &mut self.arenas[view.arena][view.start..view.start + view.len]).map_err(|e| bad(format!("result {i}: {e}")))
    }

    /// Decode every input, run the body on the interpreter, encode every output.
    fn run_whole(&mut self, body: &Region, ins: &[View], outs: &[View]) -> Result<(), RuntimeError> {
        let args = ins.iter().enumerate().map(|(i, &v)| self.decode_arg(body, i, v)).collect::<Result<Vec<_>, _>>()?;
        let interp = match &self.eval {
            Some((i, _)) if self.in_eval => i,
            _ => &self.interp,
        };
        let results = interp.run_region(body, &args)?;
        drop(args);
        for (i, (t, &v)) in results.iter().zip(outs).enumerate() {
            self.encode_out(i, t, v)?;
        }
        Ok(())
    }

    /// Run the body op by op like the interpreter (the same `eval_op` calls in the same order,
    /// so the same bits), decoding each input at its first use, encoding each output as soon
    /// as it is computed and dropping every value after its last use: a multi-tensor optimizer
    /// kernel then holds one tensor's operands at a time instead of a copy of the whole model.
    /// An output waits while it overlaps an input not yet decoded, which keeps in-place
    /// updates exact.
    fn run_streaming(&mut self, body: &Region, plan: &BodyPlan, ins: &[View], outs: &[View]) -> Result<(), RuntimeError> {
        let dims = &self.artifact.graph.dims;
        let mut env: Vec<Option<Tensor<f32>>> = (0..body.values.len()).map(|_| None).collect();
        let mut uses = plan.uses.clone();
        let mut done = vec![false; outs.len()];
        let mut pending: Vec<usize> = Vec::new();
        for &i in &plan.eager_args {
            env[body.args[i].value.index()] = Some(self.decode_arg(body, i, ins[i])?);
        }
        let overlaps = |a: View, b: View| a.arena == b.arena && a.start < b.start + b.len && b.start < a.start + a.len;
        for (n, node) in body.order.iter().map(|&id| &body.nodes[id.index()]).enumerate() {
            for &v in &node.inputs {
                if env[v.index()].is_none()
                    && let Some(i) = plan.arg_of[v.index()]
                {
                    env[v.index()] = Some(self.decode_arg(body, i, ins[i])?);
                }
            }
            let results = {
                let mut operands = Vec::with_capacity(node.inputs.len());
                for &v in &node.inputs {
                    operands.push(env[v.index()].as_ref().ok_or_else(|| bad(format!("value {v} of @{} is used before it is defined", body.name)))?);
                }
                eval_op(&node.op, &operands, &plan.result_types[n], dims, Precision::Emulate).map_err(|m| titan_ir::interp::InterpError {
                    region: body.name.clone(),
                    node: Some(body.order[n]),
                    op: Some(node.op.name()),
                    message: m,
                })?
            };
            for (r, t) in node.results.iter().zip(results) {
                env[r.index()] = Some(t);
                pending.extend(plan.outputs_of[r.index()].iter().copied());
            }
            for &v in &node.inputs {
                uses[v.index()] = uses[v.index()].saturating_sub(1);
            }
            // Encode what no longer overlaps an input still to be decoded.
            let waiting = |v: View| {
                ins.iter().enumerate().any(|(i, &iv)| {
                    let a = body.args[i].value.index();
                    env[a].is_none() && uses[a] > 0 && overlaps(v, iv)
                })
            };
            let mut still = Vec::new();
            for &o in &pending {
                if waiting(outs[o]) {
                    still.push(o);
                    continue;
                }
                if let Some(t) = env[body.outputs[o].value.index()].as_ref() {
                    self.encode_out(o, t, outs[o])?;
                    done[o] = true;
                }
            }
            pending = still;
            for &v in node.inputs.iter().chain(&node.results) {
                let i = v.index();
                if uses[i] == 0 && plan.outputs_of[i].iter().all(|&o| done[o]) {
                    env[i] = None;
                }
            }
        }
        for o in 0..outs.len() {
            if done[o] {
                continue;
            }
            let v = body.outputs[o].value;
            let t = match (env[v.index()].take(), plan.arg_of[v.index()]) {
                (Some(t), _) => t,
                (None, Some(i)) => self.decode_arg(body, i, ins[i])?,
                (None, None) => return Err(bad(format!("output {o} of @{} is never defined", body.name))),
            };
            self.encode_out(o, &t, outs[o])?;
            env[v.index()] = Some(t);
        }
        Ok(())
    }

    /// Run one training step on `batch`.
    pub fn step(&mut self, batch: &Batch) -> Result<StepMetrics, RuntimeError> {
        check_rank_batch(batch, self.batch, self.seq, self.tokens_len, self.vocab)?;
        self.step += 1;
        if self.profile.is_some() {
            self.profiled_steps += 1;
        }
        let start = Instant::now();
        if self.profile.is_some() {
            self.step_start = Some(start);
            self.op_times.clear();
        }
        if self.poison {
            self.arenas[slot(Arena::Activations)].fill(POISON);
        }
        self.feed(self.tokens, &batch.tokens)?;
        self.feed(self.targets, &batch.targets)?;
        let step = i64::try_from(self.step).map_err(|_| RuntimeError::Data("the step counter overflowed".into()))?;
        self.feed(self.step_buf, &[step])?;
        let steps = &self.artifact.manifest.ranks[0].steps;
        self.exec(steps, None)?;
        let secs = start.elapsed().as_secs_f64();
        Ok(StepMetrics {
            step: self.step,
            loss: self.scalar(Some(self.loss))?,
            grad_norm: self.scalar(self.grad_norm)?,
            lr: self.scalar(self.lr)?,
            tokens_per_s: (self.batch * self.seq) as f64 / secs.max(1e-9),
            peak_bytes: Some(self.artifact.manifest.memory.peak_bytes),
            measured_peak_bytes: None,
        })
    }

    /// Run the artifact's eval step (forward and loss, no update) on `batch` and return its loss.
    /// It reads the masters in place and writes only the activations arena (poisoned first), so
    /// the training steps that follow are the same with or without it.
    pub fn eval_loss(&mut self, batch: &Batch) -> Result<f64, RuntimeError> {
        let e = self.artifact.manifest.eval.as_ref().ok_or_else(no_eval_step)?;
        check_rank_batch(batch, self.batch, self.seq, self.tokens_len, self.vocab)?;
        if self.poison {
            self.arenas[slot(Arena::Activations)].fill(POISON);
        }
        self.feed(self.tokens, &batch.tokens)?;
        self.feed(self.targets, &batch.targets)?;
        let loss = e.buffers.iter().find(|b| b.output.as_deref() == Some("loss")).ok_or_else(|| bad("the eval step has no `loss` buffer".into()))?;
        self.in_eval = true;
        let run = self.exec(&e.steps, None);
        self.in_eval = false;
        run?;
        self.scalar(Some(loss))
    }

    /// Every state buffer by checkpoint name, in manifest order.
    pub fn states(&self) -> Result<Vec<(String, Tensor<f32>)>, RuntimeError> {
        let mut out = Vec::new();
        for b in &self.artifact.manifest.buffers {
            if let (BufferClass::Param | BufferClass::OptimizerState, Some(s)) = (b.class, &b.state) {
                out.push((s.name.clone(), self.read(b)?));
            }
        }
        Ok(out)
    }

    /// The state buffer with checkpoint name `name`.
    pub fn state(&self, name: &str) -> Result<Tensor<f32>, RuntimeError> {
        self.read(state_buffer(self.artifact, name)?)
    }

    /// Overwrite the state buffer with checkpoint name `name` with `values` (row-major), encoded
    /// in the buffer's dtype.
    pub fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), RuntimeError> {
        let b = state_buffer(self.artifact, name)?;
        let numel = b.shape.iter().product::<u64>();
        crate::backend::check_state_len(name, usize_of(numel, name)?, values.len())?;
        let v = self.whole(b)?;
        encode_floats(values, b.dtype, &mut self.arenas[v.arena][v.start..v.start + v.len]).map_err(|e| bad(format!("state `{name}`: {e}")))?;
        self.refresh_copies(Some(name))
    }

    /// Set the number of steps taken; the next step feeds `steps + 1`.
    pub fn set_steps_done(&mut self, steps: u64) {
        self.step = steps;
    }

    /// Decode any buffer (for tests and debugging).
    pub fn read_buffer(&self, id: u32) -> Result<Tensor<f32>, RuntimeError> {
        let b = self.artifact.buffer(id).ok_or_else(|| bad(format!("buffer {id} does not exist")))?;
        self.read(b)
    }
}

/// Why `--val-data` cannot run on an artifact without an eval step.
pub(crate) fn no_eval_step() -> RuntimeError {
    RuntimeError::Backend(
        "the artifact has no eval step (built before format version 6, or a float8 build of a titanc before its eval step); rebuild it with this titanc, or drop --val-data".into(),
    )
}

/// The param or optimizer-state buffer with checkpoint name `name`.
pub(crate) fn state_buffer<'a>(artifact: &'a Artifact, name: &str) -> Result<&'a Buffer, RuntimeError> {
    artifact
        .manifest
        .buffers
        .iter()
        .find(|b| matches!(b.class, BufferClass::Param | BufferClass::OptimizerState) && b.state.as_ref().is_some_and(|s| s.name == name))
        .ok_or_else(|| RuntimeError::Backend(format!("the artifact has no state buffer named `{name}`")))
}

impl Trainer for CpuArtifactTrainer<'_> {
    fn enable_profile(&mut self) -> Result<(), RuntimeError> {
        CpuArtifactTrainer::enable_profile(self);
        Ok(())
    }

    fn step_trace(&self) -> Option<Vec<titan_ir::artifact::timeline::Span>> {
        // Every rank runs `ranks[0]`'s schedule (one plan serves all ranks).
        crate::backend::profile::measured_spans(self.artifact, 0, &self.op_times)
    }

    fn profile_report(&self, full: bool) -> Option<String> {
        let (times, steps) = self.profile().filter(|(_, n)| *n > 0)?;
        Some(if full {
            crate::backend::profile::kernel_table(self.artifact, times, None, steps, "cpu")
        } else {
            let secs: f64 = times.iter().map(|t| t.seconds).sum();
            format!("titan-run: --profile: {:.3} ms per step in kernels\n", 1e3 * secs / steps as f64)
        })
    }

    fn step(&mut self, batch: &Batch) -> Result<StepMetrics, RuntimeError> {
        CpuArtifactTrainer::step(self, batch)
    }

    fn eval_loss(&mut self, batch: &Batch) -> Result<f64, RuntimeError> {
        CpuArtifactTrainer::eval_loss(self, batch)
    }

    fn batch_size(&self) -> usize {
        self.batch
    }

    fn seq_len(&self) -> usize {
        self.seq
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn steps_done(&self) -> u64 {
        self.step
    }

    fn states(&self) -> Result<Vec<(String, Tensor<f32>)>, RuntimeError> {
        CpuArtifactTrainer::states(self)
    }

    fn state(&self, name: &str) -> Result<Tensor<f32>, RuntimeError> {
        CpuArtifactTrainer::state(self, name)
    }

    fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), RuntimeError> {
        CpuArtifactTrainer::set_state(self, name, values)
    }

    fn set_steps_done(&mut self, steps: u64) -> Result<(), RuntimeError> {
        CpuArtifactTrainer::set_steps_done(self, steps);
        Ok(())
    }

    fn flops_per_token(&self) -> Option<u64> {
        Some(self.artifact.manifest.training.flops_per_token).filter(|&f| f > 0)
    }

    fn reports_grad_norm(&self) -> bool {
        self.grad_norm.is_some()
    }
}
