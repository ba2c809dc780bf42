//! Graph mode: runs an unfused training-step graph (`titanc lower --to train`) whole on the
//! reference interpreter, keeping the state buffers (master weights, AdamW moments) between
//! steps. The reference the artifact backend is compared against.

use std::time::Instant;

use titan_ir::interp::{Interpreter, Precision, Tensor};
use titan_ir::{ArgKind, DType, Graph, ParamInfo};

use crate::RuntimeError;
use crate::backend::{StepMetrics, Trainer, check_rank_batch};
use crate::data::Batch;
use crate::init::init_values;

/// What the runtime feeds to each argument of `main`.
#[derive(Clone, Debug, PartialEq)]
enum Feed {
    Tokens,
    Targets,
    Step,
    State(ParamInfo),
    /// A compute copy (`init = compute_copy`): the cast of the state with this checkpoint name,
    /// set whenever that master is; not a checkpointed state.
    Copy(String),
}

/// What one rank of a mesh run needs: the mesh, its coordinates and its communicator.
#[derive(Clone)]
pub struct RankContext {
    pub mesh: titan_ir::Mesh,
    pub coords: [usize; 3],
    pub comm: std::sync::Arc<dyn titan_ir::interp::Communicator>,
}

/// The initial value of state `p` on the rank `rank` (or the single rank): the single-rank
/// initialization with `seed` of the full tensor, of which a rank keeps its shard along every
/// mesh dim of more than one rank where `placement` says `Shard(d)`. `local_shape` is the
/// state's (per-rank) shape. Shared by the graph and artifact backends, so every backend and
/// mesh starts from exactly the parameters of the single-rank run.
pub(crate) fn init_state_shard(
    p: &ParamInfo,
    local_shape: &[usize],
    placement: &[titan_ir::Placement],
    rank: Option<([usize; 3], titan_ir::Mesh)>,
    seed: u64,
) -> Result<Tensor<f32>, RuntimeError> {
    // The full (single-rank) shape, and the shards this rank holds of it.
    let mut shape = local_shape.to_vec();
    let mut shards = Vec::new();
    if let Some(r) = rank {
        let (coords, mesh) = r;
        for (m, pl) in placement.iter().enumerate() {
            let n = mesh.sizes.get(m).copied().unwrap_or(1) as usize;
            if let (titan_ir::Placement::Shard(d), true) = (pl, n > 1) {
                let d = *d as usize;
                let dim = shape.get_mut(d).ok_or_else(|| RuntimeError::Graph(format!("state `{}` is sharded along dim {d} it does not have", p.name)))?;
                *dim *= n;
                shards.push((d, n, coords[m]));
            }
        }
    }
    let (layers, per_layer) = if p.is_stacked() {
        let l = shape.first().copied().ok_or_else(|| RuntimeError::Graph(format!("stacked parameter `{}` must have a leading layer dim", p.name)))?;
        (l, shape[1..].iter().product())
    } else {
        (1, shape.iter().product())
    };
    let values =
        init_values(p.init, layers, per_layer, seed, &|l| p.layer_name(l)).map_err(|e| RuntimeError::Graph(format!("initializing `{}`: {e}", p.name)))?;
    let mut t = Tensor::from_vec(DType::F32, shape, values).map_err(RuntimeError::Graph)?;
    for (d, n, c) in shards {
        t = titan_ir::interp::shard_of(&t, d, n, c).map_err(RuntimeError::Graph)?;
    }
    Ok(t)
}

/// Runs steps of a training graph on the CPU reference interpreter.
pub struct CpuTrainer<'g> {
    graph: &'g Graph,
    interp: Interpreter<'g>,
    feeds: Vec<Feed>,
    /// Current value of every argument (inputs are overwritten each step).
    args: Vec<Tensor<f32>>,
    /// For each `update`, the argument it writes.
    update_args: Vec<usize>,
    /// Positions of `loss`, `grad_norm`, `lr` among the outputs.
    out_loss: usize,
    out_grad_norm: Option<usize>,
    out_lr: Option<usize>,
    batch: usize,
    seq: usize,
    /// Elements of `tokens`: `batch * seq`, or this rank's share with sequence parallelism.
    tokens_len: usize,
    vocab: usize,
    step: u64,
}

fn resolve(graph: &Graph, v: titan_ir::Value) -> Result<Vec<usize>, RuntimeError> {
    graph.main.ty(v).resolve(&graph.dims).map_err(RuntimeError::Graph)
}

impl<'g> CpuTrainer<'g> {
    /// Prepare a training graph: check its interface and initialize every state buffer from
    /// its `init` attribute with `seed`.
    pub fn new(graph: &'g Graph, seed: u64) -> Result<CpuTrainer<'g>, RuntimeError> {
        CpuTrainer::with_rank(graph, seed, None)
    }

    /// One rank of an SPMD graph: collectives go through `rank.comm`, and each state buffer
    /// starts as this rank's shard (by its placement) of the single-rank initialization, so a
    /// mesh run starts from exactly the parameters of the single-rank run.
    pub fn with_rank(graph: &'g Graph, seed: u64, rank: Option<RankContext>) -> Result<CpuTrainer<'g>, RuntimeError> {
        let main = &graph.main;
        let mut feeds = Vec::new();
        let mut args = Vec::new();
        let (mut batch, mut seq, mut tokens_len) = (0, 0, 0);
        for a in &main.args {
            let ty = main.ty(a.value);
            let shape = resolve(graph, a.value)?;
            let name = main.value(a.value).name.clone().unwrap_or_default();
            match &a.kind {
                ArgKind::Input => {
                    let feed = match name.as_str() {
                        "tokens" => Feed::Tokens,
                        "targets" => Feed::Targets,
                        "step" => Feed::Step,
                        other => {
                            return Err(RuntimeError::Graph(format!(
                                "input `%{other}` is not one titan-run feeds (tokens, targets, step); is this a training graph from `titanc lower --to train`?"
                            )));
                        }
                    };
                    if matches!(feed, Feed::Tokens | Feed::Targets) {
                        if shape.len() != 2 || !ty.dtype.is_int() {
                            return Err(RuntimeError::Graph(format!("input `%{name}` must be an integer [batch, seq] tensor, found {ty}")));
                        }
                        // A sequence-parallel rank reads a slice of the tokens; the step's
                        // shape is the targets'.
                        if feed == Feed::Targets {
                            (batch, seq) = (shape[0], shape[1]);
                        } else {
                            tokens_len = shape[0] * shape[1];
                        }
                    }
                    if feed == Feed::Step && (!shape.is_empty() || !ty.dtype.is_int()) {
                        return Err(RuntimeError::Graph(format!("input `%step` must be an integer scalar, found {ty}")));
                    }
                    args.push(Tensor::zeros(ty.dtype, shape));
                    feeds.push(feed);
                }
                ArgKind::State(p) | ArgKind::Param(p) if p.compute_copy_of().is_some() => {
                    // Filled from its master below, once every master is.
                    args.push(Tensor::zeros(ty.dtype, shape));
                    feeds.push(Feed::Copy(p.compute_copy_of().unwrap_or_default().to_string()));
                }
                ArgKind::State(p) | ArgKind::Param(p) => {
                    if ty.dtype.is_int() {
                        return Err(RuntimeError::Graph(format!("state `{}` has an integer type {ty}; titan-run initializes float state only", p.name)));
                    }
                    let mut t = init_state_shard(p, &shape, &main.value(a.value).placement, rank.as_ref().map(|r| (r.coords, r.mesh)), seed)?;
                    if ty.dtype != DType::F32 {
                        // Parameters stored in a low-precision dtype start from rounded values.
                        if let Some(xs) = t.floats_mut() {
                            for x in xs.iter_mut() {
                                *x = titan_ir::interp::round_to_dtype(*x, ty.dtype);
                            }
                        }
                        t.dtype = ty.dtype;
                    }
                    args.push(t);
                    feeds.push(Feed::State(p.clone()));
                }
                ArgKind::Block => return Err(RuntimeError::Graph("main has a block argument".into())),
            }
        }
        for f in [Feed::Tokens, Feed::Targets, Feed::Step] {
            if !feeds.contains(&f) {
                return Err(RuntimeError::Graph(
                    format!("the graph has no `{f:?}` input; is this a training graph from `titanc lower --to train`?").to_lowercase(),
                ));
            }
        }
        let mut update_args = Vec::new();
        for u in &main.updates {
            let i = main
                .args
                .iter()
                .position(|a| a.value == u.state)
                .ok_or_else(|| RuntimeError::Graph("an update targets a value that is not an argument".into()))?;
            update_args.push(i);
        }
        let out = |name: &str| main.outputs.iter().position(|o| o.name.as_deref() == Some(name));
        let out_loss = out("loss").ok_or_else(|| RuntimeError::Graph("the graph has no `loss` output".into()))?;
        let vocab = graph.meta_i64("vocab_size").map(|v| v as usize).unwrap_or(256);
        let mut t = CpuTrainer {
            graph,
            interp: match rank {
                Some(r) => Interpreter::new(graph, Precision::Emulate).with_communicator(r.comm),
                None => Interpreter::new(graph, Precision::Emulate),
            },
            feeds,
            args,
            update_args,
            out_loss,
            out_grad_norm: out("grad_norm"),
            out_lr: out("lr"),
            batch,
            seq,
            tokens_len,
            vocab,
            step: 0,
        };
        t.refresh_copies(None)?;
        Ok(t)
    }

    /// Set every compute copy of master `master` (of every master: `None`) to the master's cast.
    fn refresh_copies(&mut self, master: Option<&str>) -> Result<(), RuntimeError> {
        for i in 0..self.feeds.len() {
            let Feed::Copy(m) = &self.feeds[i] else { continue };
            if master.is_some_and(|x| x != m) {
                continue;
            }
            let j = self
                .feeds
                .iter()
                .position(|f| matches!(f, Feed::State(p) if p.name == *m))
                .ok_or_else(|| RuntimeError::Graph(format!("compute copy of `{m}`, which is no state of the graph")))?;
            let dtype = self.args[i].dtype;
            let mut t = self.args[j].clone();
            if t.shape != self.args[i].shape {
                return Err(RuntimeError::Graph(format!("the compute copy of `{m}` is {:?}, its master {:?}", self.args[i].shape, t.shape)));
            }
            if let Some(xs) = t.floats_mut() {
                for x in xs.iter_mut() {
                    *x = titan_ir::interp::round_to_dtype(*x, dtype);
                }
            }
            t.dtype = dtype;
            self.args[i] = t;
        }
        Ok(())
    }

    pub fn batch_size(&self) -> usize {
        self.batch
    }

    pub fn seq_len(&self) -> usize {
        self.seq
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    pub fn graph(&self) -> &Graph {
        self.graph
    }

    /// Steps taken so far.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// The state buffers by checkpoint name (stacked ones carry `{i}`).
    pub fn states(&self) -> impl Iterator<Item = (&ParamInfo, &Tensor<f32>)> {
        self.feeds.iter().zip(&self.args).filter_map(|(f, t)| match f {
            Feed::State(p) => Some((p, t)),
            _ => None,
        })
    }

    /// Overwrite the state with checkpoint name `name` with `values` (row-major), rounded to
    /// its dtype.
    pub fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), RuntimeError> {
        let i = self
            .feeds
            .iter()
            .position(|f| matches!(f, Feed::State(p) if p.name == name))
            .ok_or_else(|| RuntimeError::Backend(format!("the graph has no state named `{name}`")))?;
        let t = &mut self.args[i];
        let dtype = t.dtype;
        let xs = t.floats_mut().ok_or_else(|| RuntimeError::Backend(format!("state `{name}` is not a float tensor")))?;
        crate::backend::check_state_len(name, xs.len(), values.len())?;
        for (x, &v) in xs.iter_mut().zip(values) {
            *x = if dtype == DType::F32 { v } else { titan_ir::interp::round_to_dtype(v, dtype) };
        }
        self.refresh_copies(Some(name))
    }

    /// Set the number of steps taken; the next step feeds `steps + 1`.
    pub fn set_steps_done(&mut self, steps: u64) {
        self.step = steps;
    }

    /// TorchTitan's `6 N + 12 L H Dh T` from the graph's `meta` (`n_layers`, `n_heads`,
    /// `head_dim`), `N` counting the master weights other than `tok_embeddings.weight`; `None`
    /// when the meta lacks them.
    pub fn flops_per_token(&self) -> Option<u64> {
        let meta = |k: &str| self.graph.meta_i64(k).and_then(|x| u64::try_from(x).ok());
        let (l, h, hd) = (meta("n_layers")?, meta("n_heads")?, meta("head_dim")?);
        let mut n: u64 = 0;
        for (p, t) in self.states() {
            if p.name != "tok_embeddings.weight" && !p.name.ends_with(".exp_avg") && !p.name.ends_with(".exp_avg_sq") {
                n = n.checked_add(t.shape.iter().product::<usize>() as u64)?;
            }
        }
        6u64.checked_mul(n)?.checked_add(12u64.checked_mul(l)?.checked_mul(h)?.checked_mul(hd)?.checked_mul(self.seq as u64)?)
    }

    /// Run one training step on `batch`.
    pub fn step(&mut self, batch: &Batch) -> Result<StepMetrics, RuntimeError> {
        check_rank_batch(batch, self.batch, self.seq, self.tokens_len, self.vocab)?;
        let n = self.batch * self.seq;
        self.step += 1;
        for (f, t) in self.feeds.iter().zip(self.args.iter_mut()) {
            let (dtype, shape) = (t.dtype, t.shape.clone());
            match f {
                Feed::Tokens => *t = Tensor::from_ints(dtype, shape, batch.tokens.clone()).map_err(RuntimeError::Data)?,
                Feed::Targets => *t = Tensor::from_ints(dtype, shape, batch.targets.clone()).map_err(RuntimeError::Data)?,
                Feed::Step => *t = Tensor::from_ints(dtype, shape, vec![self.step as i64]).map_err(RuntimeError::Data)?,
                Feed::State(_) | Feed::Copy(_) => {}
            }
        }
        let start = Instant::now();
        let result = self.interp.run(&self.args)?;
        let secs = start.elapsed().as_secs_f64();
        for (&i, t) in self.update_args.iter().zip(result.updates) {
            self.args[i] = t;
        }
        let scalar = |i: usize| -> f64 { result.outputs.get(i).map(|t| t.to_f64_vec().first().copied().unwrap_or(f64::NAN)).unwrap_or(f64::NAN) };
        Ok(StepMetrics {
            step: self.step,
            loss: scalar(self.out_loss),
            grad_norm: self.out_grad_norm.map_or(f64::NAN, scalar),
            lr: self.out_lr.map_or(f64::NAN, scalar),
            tokens_per_s: n as f64 / secs.max(1e-9),
            peak_bytes: None,
            measured_peak_bytes: None,
        })
    }
}

impl Trainer for CpuTrainer<'_> {
    fn step(&mut self, batch: &Batch) -> Result<StepMetrics, RuntimeError> {
        CpuTrainer::step(self, batch)
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
        Ok(CpuTrainer::states(self).map(|(p, t)| (p.name.clone(), t.clone())).collect())
    }

    fn state(&self, name: &str) -> Result<Tensor<f32>, RuntimeError> {
        CpuTrainer::states(self)
            .find(|(p, _)| p.name == name)
            .map(|(_, t)| t.clone())
            .ok_or_else(|| RuntimeError::Backend(format!("the graph has no state named `{name}`")))
    }

    fn set_state(&mut self, name: &str, values: &[f32]) -> Result<(), RuntimeError> {
        CpuTrainer::set_state(self, name, values)
    }

    fn set_steps_done(&mut self, steps: u64) -> Result<(), RuntimeError> {
        CpuTrainer::set_steps_done(self, steps);
        Ok(())
    }

    fn flops_per_token(&self) -> Option<u64> {
        CpuTrainer::flops_per_token(self)
    }

    fn reports_grad_norm(&self) -> bool {
        self.out_grad_norm.is_some()
    }
}
