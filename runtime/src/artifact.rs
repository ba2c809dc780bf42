//! Loading an artifact directory (`titanc build -o DIR`): `manifest.json` (format version checked
//! first), the target, `graph.ir`, and the consistency of the memory plan and the schedule, so
//! that a backend can execute the schedule without checking anything again. A corrupt or
//! inconsistent artifact is an [`ArtifactError`], never a panic.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use titan_ir::artifact::{Arena, ArtifactError, BufRef, Buffer, BufferClass, EVAL_GRAPH_FILE, GRAPH_FILE, Kernel, MANIFEST_FILE, Manifest, Step};
use titan_ir::{BlockId, DType, Graph, Region};

/// The GPU architectures this runtime executes artifacts for.
pub const KNOWN_TARGETS: &[&str] = &["sm_90a"];

/// What the runtime feeds to the input buffers each step.
pub const FEEDS: [&str; 3] = ["tokens", "targets", "step"];

pub use titan_ir::artifact::{arena_name, arena_of};

/// The manifest's spelling of a buffer class.
pub fn class_name(c: BufferClass) -> &'static str {
    match c {
        BufferClass::Input => "input",
        BufferClass::Param => "param",
        BufferClass::OptimizerState => "optimizer_state",
        BufferClass::ComputeCopy => "compute_copy",
        BufferClass::Grad => "grad",
        BufferClass::Activation => "activation",
    }
}

/// A loaded, checked artifact.
#[derive(Debug)]
pub struct Artifact {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// The fused training graph (`graph.ir`).
    pub graph: Graph,
    /// Buffer id -> index in `manifest.buffers`.
    buffer_index: BTreeMap<u32, usize>,
    /// Kernel id -> (index in `manifest.kernels`, its body block in `graph`).
    kernel_index: BTreeMap<u32, (usize, BlockId)>,
    /// Bytes of each arena.
    arena_bytes: BTreeMap<Arena, u64>,
    /// The eval step's fused graph (`eval.ir`) and kernel bodies, when the manifest has one.
    pub eval: Option<EvalProgram>,
}

/// The eval step of a loaded artifact: `eval.ir` and each eval kernel's body in it (buffer and
/// kernel ids of `manifest.eval` are positions, checked by the manifest verifier).
#[derive(Debug)]
pub struct EvalProgram {
    pub graph: Graph,
    bodies: Vec<BlockId>,
}

fn invalid(message: String) -> ArtifactError {
    ArtifactError::Invalid(message)
}

/// The bytes of a `dtype` tensor of `shape`, or `None` on overflow.
pub fn tensor_bytes(dtype: DType, shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(dtype.size_bytes() as u64, |acc, &d| acc.checked_mul(d))
}

/// Where a schedule step sits, for error messages: `rank 0, step 4.2`.
fn loc(rank: u32, path: &[usize]) -> String {
    let p: Vec<String> = path.iter().map(|i| i.to_string()).collect();
    format!("rank {rank}, step {}", p.join("."))
}

/// A persistent buffer (parameter or optimizer state) with the state argument of `graph.ir` it
/// holds: what every backend needs to initialize and checkpoint it.
/// What [`Artifact::step_feeds`] finds.
#[derive(Clone, Copy, Debug)]
pub struct StepFeeds<'a> {
    pub tokens: &'a Buffer,
    pub targets: &'a Buffer,
    pub step: &'a Buffer,
    pub batch: usize,
    pub seq: usize,
    /// Elements of `tokens`: `batch * seq`, or this rank's share with sequence parallelism.
    pub tokens_len: usize,
}

pub struct StateSlot<'a> {
    pub buffer: &'a Buffer,
    pub info: &'a titan_ir::ParamInfo,
    /// 1 for an unstacked state; the leading dim of a per-layer (`{i}`) state.
    pub layers: usize,
    pub per_layer: usize,
    /// The state argument's placement on the mesh (empty on one device).
    pub placement: &'a [titan_ir::Placement],
    /// Its shape (this rank's, on a mesh).
    pub shape: Vec<usize>,
}

/// The enclosing loop of a schedule step during checking.
struct LoopScope<'a> {
    count: u32,
    carries: &'a [[u32; 2]],
}

impl Artifact {
    /// Every param/optimizer-state buffer matched with its `graph.ir` state argument, whose type
    /// must be the buffer's.
    pub fn state_slots(&self) -> Result<Vec<StateSlot<'_>>, ArtifactError> {
        let graph = &self.graph;
        let bad = |m: String| ArtifactError::Invalid(m);
        let mut slots = Vec::new();
        for b in &self.manifest.buffers {
            if !matches!(b.class, BufferClass::Param | BufferClass::OptimizerState) {
                continue;
            }
            let Some(s) = &b.state else { return Err(bad(format!("buffer {} (`{}`) is persistent but has no `state`", b.id, b.name))) };
            let arg = graph.main.args.iter().find(|a| a.kind.param_info().is_some_and(|p| p.name == s.name)).ok_or_else(|| {
                bad(format!(
                    "state buffer {} (`{}`) has no state argument named \"{}\" in graph.ir; rebuild the artifact with `titanc build`",
                    b.id, b.name, s.name
                ))
            })?;
            let Some(info) = arg.kind.param_info() else { continue };
            let ty = graph.main.ty(arg.value);
            let shape = ty.resolve(&graph.dims).map_err(|e| bad(format!("state `{}` in graph.ir: {e}", s.name)))?;
            if ty.dtype != b.dtype || shape.iter().map(|&d| d as u64).collect::<Vec<_>>() != b.shape {
                return Err(bad(format!("state `{}` is {ty} in graph.ir but buffer {} is {}{:?}", s.name, b.id, b.dtype, b.shape)));
            }
            let (layers, per_layer) = if info.is_stacked() { (shape[0], shape[1..].iter().product()) } else { (1, shape.iter().product()) };
            let placement = &graph.main.value(arg.value).placement;
            slots.push(StateSlot { buffer: b, info, layers, per_layer, placement, shape });
        }
        Ok(slots)
    }

    /// Every compute copy buffer with its master's buffer (`compute-copies`): the runtime writes
    /// `cast(master)` into the copy whenever it sets the master (start-up, `--resume`); the
    /// optimizer kernel keeps them equal after each step. Checked at load (same shape, f32
    /// master, narrower copy).
    pub fn compute_copies(&self) -> Result<Vec<(&Buffer, &Buffer)>, ArtifactError> {
        let mut out = Vec::new();
        for b in &self.manifest.buffers {
            if b.class != BufferClass::ComputeCopy {
                continue;
            }
            let name = b.state.as_ref().and_then(|s| s.name.strip_suffix(titan_ir::COMPUTE_COPY_SUFFIX));
            let master =
                name.and_then(|n| self.manifest.buffers.iter().find(|t| t.class == BufferClass::Param && t.state.as_ref().is_some_and(|s| s.name == n)));
            let Some(master) = master else {
                return Err(ArtifactError::Invalid(format!(
                    "compute copy buffer {} (`{}`) names no master; rebuild the artifact with `titanc build`",
                    b.id, b.name
                )));
            };
            out.push((b, master));
        }
        Ok(out)
    }

    /// Every state's checkpoint name, placement and (per-rank) shape, in manifest order.
    pub fn state_layout(&self) -> Result<Vec<crate::backend::StateLayout>, ArtifactError> {
        Ok(self
            .state_slots()?
            .into_iter()
            .map(|s| crate::backend::StateLayout { name: s.info.name.clone(), placement: s.placement.to_vec(), shape: s.shape })
            .collect())
    }

    /// Read and check the artifact in `dir`.
    pub fn load(dir: impl AsRef<Path>) -> Result<Artifact, ArtifactError> {
        let dir = dir.as_ref();
        let shown = dir.display().to_string();
        if !dir.exists() {
            return Err(ArtifactError::Io {
                path: shown.clone(),
                message: format!("no such directory; build the artifact first with `titanc build model.ir -o {shown}`"),
            });
        }
        if !dir.is_dir() {
            return Err(ArtifactError::Io {
                path: shown,
                message: "not a directory; pass the directory `titanc build -o DIR` wrote (or a training graph `.ir` file)".into(),
            });
        }
        let manifest_path = dir.join(MANIFEST_FILE);
        let manifest_shown = manifest_path.display().to_string();
        let text = std::fs::read_to_string(&manifest_path).map_err(|e| ArtifactError::Io {
            path: manifest_shown.clone(),
            message: if e.kind() == std::io::ErrorKind::NotFound {
                format!("not found, so `{shown}` is not a titan artifact; build one with `titanc build model.ir -o {shown}`")
            } else {
                e.to_string()
            },
        })?;
        let manifest = Manifest::from_json(&manifest_shown, &text)?;
        if !KNOWN_TARGETS.contains(&manifest.target.arch.as_str()) {
            return Err(ArtifactError::Target { found: manifest.target.arch.clone(), expected: KNOWN_TARGETS[0].to_string() });
        }
        let graph_path = dir.join(GRAPH_FILE);
        if !graph_path.is_file() {
            return Err(ArtifactError::Io {
                path: graph_path.display().to_string(),
                message: "not found; the artifact is incomplete, rebuild it with `titanc build`".into(),
            });
        }
        for k in &manifest.kernels {
            let Some(cubin) = &k.cubin else { continue };
            if k.ptx.is_none() {
                return Err(invalid(format!("kernel `{}` lists the cubin `{cubin}` but no PTX; rebuild the artifact with `titanc build`", k.name)));
            }
            let path = dir.join(cubin);
            if !path.is_file() {
                return Err(ArtifactError::Io {
                    path: path.display().to_string(),
                    message: format!(
                        "the cubin of kernel `{}` is not found; the artifact is incomplete, rebuild it with `titanc build` (or remove the kernel's `cubin` entry from {MANIFEST_FILE} to use its PTX)",
                        k.name
                    ),
                });
            }
        }
        let graph = titan_ir::parse_file(&graph_path).map_err(|e| invalid(format!("`{}` does not parse: {e}", graph_path.display())))?;
        crate::manifest_check::verify_manifest(&manifest, &graph, dir)?;
        let eval = match &manifest.eval {
            None => None,
            Some(e) => {
                let path = dir.join(EVAL_GRAPH_FILE);
                if !path.is_file() {
                    return Err(ArtifactError::Io {
                        path: path.display().to_string(),
                        message: "not found, but the manifest has an eval step; the artifact is incomplete, rebuild it with `titanc build`".into(),
                    });
                }
                let g = titan_ir::parse_file(&path).map_err(|err| invalid(format!("`{}` does not parse: {err}", path.display())))?;
                crate::manifest_check::verify_eval(&manifest, &g, dir)?;
                let bodies = e
                    .kernels
                    .iter()
                    .map(|k| {
                        g.block_by_name(&k.body)
                            .ok_or_else(|| invalid(format!("eval kernel `{}`: its body `@{}` is not a block of {EVAL_GRAPH_FILE}", k.name, k.body)))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Some(EvalProgram { graph: g, bodies })
            }
        };
        let mut artifact = Artifact {
            dir: dir.to_path_buf(),
            manifest,
            graph,
            buffer_index: BTreeMap::new(),
            kernel_index: BTreeMap::new(),
            arena_bytes: BTreeMap::new(),
            eval,
        };
        artifact.check()?;
        Ok(artifact)
    }

    /// The buffer with id `id` (checked to exist for every id the schedule names).
    pub fn buffer(&self, id: u32) -> Option<&Buffer> {
        self.buffer_index.get(&id).map(|&i| &self.manifest.buffers[i])
    }

    /// Index of buffer `id` in `manifest.buffers`.
    pub fn buffer_pos(&self, id: u32) -> Option<usize> {
        self.buffer_index.get(&id).copied()
    }

    /// The kernel with id `id` and the block of `graph.ir` holding its body.
    pub fn kernel(&self, id: u32) -> Option<(&titan_ir::artifact::Kernel, &Region)> {
        self.kernel_index.get(&id).map(|&(i, b)| (&self.manifest.kernels[i], self.graph.block(b)))
    }

    /// Buffer `id` of the eval step (its position in `manifest.eval.buffers`).
    pub fn eval_buffer(&self, id: u32) -> Option<&Buffer> {
        self.manifest.eval.as_ref()?.buffers.get(id as usize)
    }

    /// Kernel `id` of the eval step and the block of `eval.ir` holding its body.
    pub fn eval_kernel(&self, id: u32) -> Option<(&Kernel, &Region)> {
        let (e, p) = (self.manifest.eval.as_ref()?, self.eval.as_ref()?);
        Some((e.kernels.get(id as usize)?, p.graph.block(*p.bodies.get(id as usize)?)))
    }

    /// Index of kernel `id` in `manifest.kernels`.
    pub fn kernel_pos(&self, id: u32) -> Option<usize> {
        self.kernel_index.get(&id).map(|&(i, _)| i)
    }

    /// Bytes of `arena` in the memory plan (0 when the plan has none).
    pub fn arena_bytes(&self, arena: Arena) -> u64 {
        self.arena_bytes.get(&arena).copied().unwrap_or(0)
    }

    /// The buffer the step's named output (`loss`, `grad_norm`, `lr`) is read from.
    pub fn output_buffer(&self, name: &str) -> Option<&Buffer> {
        self.manifest.buffers.iter().find(|b| b.output.as_deref() == Some(name))
    }

    /// The input buffer fed with `feed` (`tokens`, `targets`, `step`).
    pub fn feed_buffer(&self, feed: &str) -> Option<&Buffer> {
        self.manifest.buffers.iter().find(|b| b.feed.as_deref() == Some(feed))
    }

    /// Check that a rank of `mesh` can run this artifact: the same size on every mesh dim.
    pub fn check_rank_mesh(&self, mesh: &titan_ir::Mesh) -> Result<(), ArtifactError> {
        let m = &self.manifest.mesh;
        let size = |name: &str| m.dims.iter().find(|d| d.name == name).map_or(1, |d| d.size);
        let want = [size("dp_replicate"), size("dp_shard"), size("tp")];
        if mesh.sizes != want || mesh.world_size() != m.world_size {
            return Err(invalid(format!(
                "a rank of mesh {:?} (dp_replicate, dp_shard, tp) cannot run an artifact built for {want:?} (world size {})",
                mesh.sizes, m.world_size
            )));
        }
        Ok(())
    }

    /// The fed buffers of a step and its shape, checked against the manifest, for a rank whose
    /// mesh has `tp` tensor-parallel ranks (1 off a mesh): a sequence-parallel rank reads a slice
    /// of every row's tokens, so the step's `[batch, seq]` is the targets'.
    pub fn step_feeds(&self, tp: u32) -> Result<StepFeeds<'_>, ArtifactError> {
        let feed = |f: &str| self.feed_buffer(f).ok_or_else(|| invalid(format!("no input buffer is fed `{f}`")));
        let (tokens, targets, step) = (feed("tokens")?, feed("targets")?, feed("step")?);
        let seq_parallel = tp > 1 && tokens.shape.first() == targets.shape.first();
        let &[b, s] = targets.shape.as_slice() else {
            return Err(invalid(format!("the targets buffer is {:?}; it must be [batch, seq]", targets.shape)));
        };
        if tokens.shape != targets.shape && !seq_parallel {
            return Err(invalid(format!("the tokens buffer is {:?} and the targets buffer {:?}; they must match", tokens.shape, targets.shape)));
        }
        let t = &self.manifest.training;
        if (t.batch, t.seq_len) != (b, s) {
            return Err(invalid(format!("the manifest trains batch {} x seq {}, its targets buffer is {:?}", t.batch, t.seq_len, targets.shape)));
        }
        let size = |x: u64, what: &str| usize::try_from(x).map_err(|_| invalid(format!("{what} {x} does not fit this machine")));
        Ok(StepFeeds { tokens, targets, step, batch: size(b, "batch")?, seq: size(s, "seq")?, tokens_len: size(tokens.shape.iter().product(), "tokens")? })
    }

    /// Collective steps per training step (rank-local `take_shard`/`place_shard` included),
    /// loops expanded.
    pub fn collectives_per_step(&self) -> u64 {
        fn count(steps: &[Step]) -> u64 {
            steps
                .iter()
                .map(|s| match s {
                    Step::Collective { .. } => 1,
                    Step::Loop { count: n, body, prefetch, .. } => u64::from(*n).saturating_mul(count(body).saturating_add(count(prefetch))),
                    _ => 0,
                })
                .fold(0u64, u64::saturating_add)
        }
        self.manifest.ranks.first().map_or(0, |r| count(&r.steps))
    }

    /// Number of schedule steps of rank 0, loops expanded.
    pub fn launches_per_step(&self) -> u64 {
        fn count(steps: &[Step]) -> u64 {
            steps
                .iter()
                .map(|s| match s {
                    Step::Launch { .. } => 1,
                    Step::Loop { count: n, body, prefetch, .. } => u64::from(*n).saturating_mul(count(body).saturating_add(count(prefetch))),
                    _ => 0,
                })
                .fold(0u64, u64::saturating_add)
        }
        self.manifest.ranks.first().map_or(0, |r| count(&r.steps))
    }

    /// Check everything a backend relies on.
    fn check(&mut self) -> Result<(), ArtifactError> {
        let m = &self.manifest;
        for a in &m.memory.arenas {
            if self.arena_bytes.insert(a.arena, a.bytes).is_some() {
                return Err(invalid(format!("the memory plan lists the `{}` arena twice", arena_name(a.arena))));
            }
        }
        let mut feeds = BTreeSet::new();
        let mut outputs = BTreeSet::new();
        for (i, b) in m.buffers.iter().enumerate() {
            let what = format!("buffer {} (`{}`)", b.id, b.name);
            if self.buffer_index.insert(b.id, i).is_some() {
                return Err(invalid(format!("buffer id {} is used twice", b.id)));
            }
            let bytes = tensor_bytes(b.dtype, &b.shape).ok_or_else(|| invalid(format!("{what}: its shape {:?} overflows", b.shape)))?;
            if bytes != b.bytes {
                return Err(invalid(format!("{what}: {} bytes declared, its type {}{:?} needs {bytes}", b.bytes, b.dtype, b.shape)));
            }
            let want = arena_of(b.class);
            if b.arena != want {
                return Err(invalid(format!(
                    "{what}: a `{}` buffer must live in the `{}` arena, found `{}`",
                    class_name(b.class),
                    arena_name(want),
                    arena_name(b.arena)
                )));
            }
            let arena =
                self.arena_bytes.get(&b.arena).copied().ok_or_else(|| invalid(format!("{what}: the memory plan has no `{}` arena", arena_name(b.arena))))?;
            match b.offset.checked_add(b.bytes) {
                Some(end) if end <= arena => {}
                _ => {
                    return Err(invalid(format!(
                        "{what}: bytes {}..{} lie outside its arena of {arena} bytes; the memory plan is inconsistent, rebuild with `titanc build`",
                        b.offset,
                        b.offset.saturating_add(b.bytes)
                    )));
                }
            }
            match (&b.feed, b.class) {
                (Some(f), BufferClass::Input) => {
                    if !FEEDS.contains(&f.as_str()) {
                        return Err(invalid(format!("{what}: feed `{f}` is not one titan-run provides (tokens, targets, step)")));
                    }
                    if !feeds.insert(f.clone()) {
                        return Err(invalid(format!("two input buffers are fed `{f}`")));
                    }
                    let ok = if f == "step" { b.shape.is_empty() } else { b.shape.len() == 2 };
                    if !b.dtype.is_int() || !ok {
                        return Err(invalid(format!(
                            "{what}: the `{f}` input must be an integer {}, found {}{:?}",
                            if f == "step" { "scalar" } else { "[batch, seq] tensor" },
                            b.dtype,
                            b.shape
                        )));
                    }
                }
                (None, BufferClass::Input) => return Err(invalid(format!("{what}: an input buffer must name its feed (tokens, targets or step)"))),
                (Some(_), _) => return Err(invalid(format!("{what}: only input buffers are fed"))),
                (None, _) => {}
            }
            if matches!(b.class, BufferClass::Param | BufferClass::OptimizerState | BufferClass::ComputeCopy) {
                let s = b.state.as_ref().ok_or_else(|| invalid(format!("{what}: a persistent buffer needs its `state` (checkpoint name and init)")))?;
                if !b.dtype.is_float() {
                    return Err(invalid(format!("{what}: state `{}` has an integer type; titan-run initializes float state only", s.name)));
                }
                if s.name.contains("{i}") && b.shape.is_empty() {
                    return Err(invalid(format!("{what}: the stacked state `{}` needs a leading layer dim", s.name)));
                }
            }
            if let Some(o) = &b.output {
                if !outputs.insert(o.clone()) {
                    return Err(invalid(format!("two buffers hold the output `{o}`")));
                }
                if b.shape.iter().product::<u64>() == 0 {
                    return Err(invalid(format!("{what}: the output `{o}` buffer is empty")));
                }
            }
        }
        for f in FEEDS {
            if !feeds.contains(f) {
                return Err(invalid(format!("no input buffer is fed `{f}`; is this a training-step artifact?")));
            }
        }
        if !outputs.contains("loss") {
            return Err(invalid("no buffer holds the `loss` output; is this a training-step artifact?".into()));
        }
        for (i, k) in m.kernels.iter().enumerate() {
            let block = self.graph.block_by_name(&k.body).ok_or_else(|| {
                invalid(format!(
                    "kernel {} (`{}`): its body `@{}` is not a block of {GRAPH_FILE}; rebuild the artifact with `titanc build`",
                    k.id, k.name, k.body
                ))
            })?;
            if self.kernel_index.insert(k.id, (i, block)).is_some() {
                return Err(invalid(format!("kernel id {} is used twice", k.id)));
            }
        }
        if m.ranks.is_empty() {
            return Err(invalid("the artifact has no schedule (`ranks` is empty)".into()));
        }
        for r in &m.ranks {
            let mut path = Vec::new();
            self.check_steps(r.rank, &r.steps, &mut path, &mut Vec::new())?;
        }
        Ok(())
    }

    fn check_steps<'a>(&'a self, rank: u32, steps: &'a [Step], path: &mut Vec<usize>, scopes: &mut Vec<LoopScope<'a>>) -> Result<(), ArtifactError> {
        for (i, step) in steps.iter().enumerate() {
            path.push(i);
            match step {
                Step::Launch { kernel, inputs, outputs, .. } => {
                    let (k, body) = self.kernel(*kernel).ok_or_else(|| invalid(format!("{}: kernel {kernel} does not exist", loc(rank, path))))?;
                    let at = format!("{} (launch of `{}`)", loc(rank, path), k.name);
                    if inputs.len() != body.args.len() || outputs.len() != body.outputs.len() {
                        return Err(invalid(format!(
                            "{at}: binds {} inputs and {} outputs, its body `@{}` takes {} arguments and returns {} values",
                            inputs.len(),
                            outputs.len(),
                            body.name,
                            body.args.len(),
                            body.outputs.len()
                        )));
                    }
                    let dims = &self.graph.dims;
                    let arg_types = body.args.iter().map(|a| body.ty(a.value));
                    let out_types = body.outputs.iter().map(|o| body.ty(o.value));
                    for (j, (r, ty)) in inputs.iter().zip(arg_types).enumerate() {
                        self.check_binding(&format!("{at}, input {j}"), r, ty, dims, scopes)?;
                    }
                    for (j, (r, ty)) in outputs.iter().zip(out_types).enumerate() {
                        self.check_binding(&format!("{at}, output {j}"), r, ty, dims, scopes)?;
                    }
                }
                Step::Copy { src, dst, bytes, .. } => {
                    let at = loc(rank, path);
                    for (what, r) in [("source", src), ("destination", dst)] {
                        let v = self.check_ref(&format!("{at} (copy {what})"), r, scopes)?;
                        if *bytes > v.bytes {
                            return Err(invalid(format!("{at}: copies {bytes} bytes, its {what} holds {}", v.bytes)));
                        }
                    }
                }
                Step::Memset { dst, bytes, .. } => {
                    let at = loc(rank, path);
                    let v = self.check_ref(&format!("{at} (memset)"), dst, scopes)?;
                    if *bytes > v.bytes {
                        return Err(invalid(format!("{at}: zeroes {bytes} bytes, its destination holds {}", v.bytes)));
                    }
                }
                Step::Collective { collective, mesh_dim, group, dim, reduce, dtype, in_shape, out_shape, input, output, more_inputs, shift, .. } => {
                    let at = format!("{} ({} over {mesh_dim})", loc(rank, path), collective.name());
                    let m = &self.manifest.mesh;
                    let size = m.dims.iter().find(|d| d.name == *mesh_dim).map_or(1, |d| d.size);
                    if size != *group || m.world_size < 2 {
                        return Err(invalid(format!(
                            "{at}: a collective over {group} ranks of `{mesh_dim}`, but the artifact's mesh (world size {}) has {size} there; rebuild the artifact with `titanc build`",
                            m.world_size
                        )));
                    }
                    collective.to_op(mesh_dim, *group, *dim, *reduce, *shift).map_err(|e| invalid(format!("{at}: {e}")))?;
                    let parts = if *collective == titan_ir::artifact::CollectiveOp::RingConcat { *group as usize } else { 1 };
                    if more_inputs.len() + 1 != parts {
                        return Err(invalid(format!("{at}: {} operands, the step needs {parts}", more_inputs.len() + 1)));
                    }
                    let ins = std::iter::once(input).chain(more_inputs).map(|r| ("input", r, in_shape));
                    for (what, r, shape) in ins.chain([("output", output, out_shape)]) {
                        let v = self.check_ref(&format!("{at}, {what}"), r, scopes)?;
                        let want = tensor_bytes(*dtype, shape).ok_or_else(|| invalid(format!("{at}: the {what} shape {shape:?} overflows")))?;
                        if v.dtype != *dtype || v.bytes != want {
                            return Err(invalid(format!(
                                "{at}: the {what} is {dtype}{shape:?} ({want} bytes), the schedule binds {}{:?} ({} bytes)",
                                v.dtype, v.shape, v.bytes
                            )));
                        }
                    }
                }
                Step::Loop { count, carries, body, prefetch, .. } => {
                    let at = loc(rank, path);
                    for (c, pair) in carries.iter().enumerate() {
                        let [a, b] =
                            pair.map(|id| self.buffer(id).ok_or_else(|| invalid(format!("{at}: loop carry {c} names buffer {id}, which does not exist"))));
                        let (a, b) = (a?, b?);
                        if a.dtype != b.dtype || a.bytes != b.bytes {
                            return Err(invalid(format!(
                                "{at}: loop carry {c} ping-pongs between buffers of different types ({}{:?} and {}{:?})",
                                a.dtype, a.shape, b.dtype, b.shape
                            )));
                        }
                    }
                    scopes.push(LoopScope { count: *count, carries });
                    self.check_steps(rank, prefetch, path, scopes)?;
                    self.check_steps(rank, body, path, scopes)?;
                    scopes.pop();
                }
            }
            path.pop();
        }
        Ok(())
    }

    /// Check a kernel operand against the body's declared type: same dtype, same bytes.
    fn check_binding(&self, at: &str, r: &BufRef, ty: &titan_ir::TensorType, dims: &titan_ir::DimTable, scopes: &[LoopScope<'_>]) -> Result<(), ArtifactError> {
        let v = self.check_ref(at, r, scopes)?;
        let shape = ty.resolve(dims).map_err(|e| invalid(format!("{at}: {e} in {GRAPH_FILE}")))?;
        let shape: Vec<u64> = shape.into_iter().map(|d| d as u64).collect();
        let want = tensor_bytes(ty.dtype, &shape).ok_or_else(|| invalid(format!("{at}: the type {ty} overflows")))?;
        if v.dtype != ty.dtype || v.bytes != want {
            return Err(invalid(format!("{at}: the kernel expects {ty} ({want} bytes), the schedule binds {}{:?} ({} bytes)", v.dtype, v.shape, v.bytes)));
        }
        Ok(())
    }

    /// Check a buffer reference in its loop scope and return the region it addresses.
    fn check_ref(&self, at: &str, r: &BufRef, scopes: &[LoopScope<'_>]) -> Result<RefView, ArtifactError> {
        match *r {
            BufRef::Buffer { buffer, layer } => {
                let b = self.buffer(buffer).ok_or_else(|| invalid(format!("{at}: buffer {buffer} does not exist")))?;
                if !layer {
                    return Ok(RefView { dtype: b.dtype, shape: b.shape.clone(), bytes: b.bytes });
                }
                let scope = scopes.last().ok_or_else(|| invalid(format!("{at}: a layer slice of buffer {buffer} (`{}`) outside any loop", b.name)))?;
                if b.shape.first() != Some(&u64::from(scope.count)) {
                    return Err(invalid(format!(
                        "{at}: a layer slice of buffer {buffer} (`{}`, shape {:?}) in a loop of {} iterations; its dim 0 must be the loop count",
                        b.name, b.shape, scope.count
                    )));
                }
                let shape = b.shape[1..].to_vec();
                let bytes = tensor_bytes(b.dtype, &shape).unwrap_or(0);
                Ok(RefView { dtype: b.dtype, shape, bytes })
            }
            BufRef::View { buffer, offset, stride, ring, .. } => {
                let b = self.buffer(buffer).ok_or_else(|| invalid(format!("{at}: buffer {buffer} does not exist")))?;
                let lead = b.shape.first().copied().unwrap_or(0);
                // Check the first and the last iteration's range (the range grows with the layer).
                let last = match (stride, scopes.last()) {
                    (0, _) => None,
                    (_, Some(scope)) => Some(scope.count.saturating_sub(1) as usize),
                    (_, None) => return Err(invalid(format!("{at}: a per-layer view of buffer {buffer} (`{}`) outside any loop", b.name))),
                };
                // A ring offset: over the mesh's tp ranks, every tp coordinate's range.
                let tp = self.manifest.mesh.tp();
                let ring_step = match ring {
                    Some(ring) if ring.size != tp => {
                        return Err(invalid(format!("{at}: a ring view of buffer {buffer} (`{}`) over {} ranks on a mesh with tp = {tp}", b.name, ring.size)));
                    }
                    Some(ring) => ring.step,
                    None => 0,
                };
                let coords = if ring.is_some() { tp } else { 1 };
                let (_, bytes) = r.range_in(b.bytes, lead, last.map(|_| 0), 0).map_err(|e| invalid(format!("{at}: {e} (`{}`)", b.name)))?;
                for c in 0..coords {
                    r.range_in(b.bytes, lead, last, c).map_err(|e| invalid(format!("{at}: {e} (`{}`)", b.name)))?;
                }
                let elem = b.dtype.size_bytes() as u64;
                if bytes % elem != 0 || offset % elem != 0 || stride % elem != 0 || ring_step % elem != 0 {
                    return Err(invalid(format!(
                        "{at}: the view (offset {offset}, {bytes} bytes, stride {stride}) of buffer {buffer} (`{}`) does not fall on {} elements",
                        b.name, b.dtype
                    )));
                }
                Ok(RefView { dtype: b.dtype, shape: vec![bytes / elem], bytes })
            }
            BufRef::Carry { carry, .. } => {
                let scope = scopes.last().ok_or_else(|| invalid(format!("{at}: carry {carry} outside any loop")))?;
                let ids =
                    scope.carries.get(carry as usize).ok_or_else(|| invalid(format!("{at}: carry {carry}, the loop has {} carries", scope.carries.len())))?;
                let b = self.buffer(ids[0]).ok_or_else(|| invalid(format!("{at}: carry {carry} names buffer {}, which does not exist", ids[0])))?;
                Ok(RefView { dtype: b.dtype, shape: b.shape.clone(), bytes: b.bytes })
            }
        }
    }
}

/// Type and size of what a [`BufRef`] addresses.
struct RefView {
    dtype: DType,
    shape: Vec<u64>,
    bytes: u64,
}

/// Format a byte count for logs: `512 B`, `12.3 KiB`, `4.56 MiB`, `79.2 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut x = bytes as f64 / 1024.0;
    let mut unit = UNITS[0];
    for u in &UNITS[1..] {
        if x < 1024.0 {
            break;
        }
        x /= 1024.0;
        unit = u;
    }
    let digits = if x < 10.0 {
        2
    } else if x < 100.0 {
        1
    } else {
        0
    };
    format!("{x:.digits$} {unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_formatted_with_binary_units() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(12 * 1024 * 1024 + 300 * 1024), "12.3 MiB");
        assert_eq!(format_bytes(80 << 30), "80.0 GiB");
        assert_eq!(format_bytes(300 << 30), "300 GiB");
    }

    #[test]
    fn every_class_has_its_arena() {
        assert_eq!(arena_of(BufferClass::Grad), Arena::Activations);
        assert_eq!(arena_of(BufferClass::OptimizerState), Arena::OptimizerState);
    }
}
