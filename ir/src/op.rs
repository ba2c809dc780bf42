//! The closed set of operations: model-level ops, their backward ops, primitives, the optimizer
//! ops and the `repeat` op that runs a block once per layer. Each op's name and attributes are
//! defined here once; the printer, parser and verifier all go through [`Op::name`],
//! [`Op::attrs`] and [`Op::from_parts`].

use crate::attr::{AttrValue, Attrs};
use crate::dtype::DType;
use crate::graph::BlockId;
use crate::placement::MeshDim;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Recip,
    Sigmoid,
    Silu,
    Tanh,
    Abs,
    Square,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Max,
    Min,
    Pow,
    /// `silu_grad(x, dy) = dy * silu'(x)`: the backward of silu as one pointwise op.
    SiluGrad,
}

/// How a collective combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CollectiveReduce {
    Sum,
    Max,
}

impl CollectiveReduce {
    pub fn name(self) -> &'static str {
        match self {
            CollectiveReduce::Sum => "sum",
            CollectiveReduce::Max => "max",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceKind {
    Sum,
    Max,
    Mean,
}

/// Which pairs of the head dimension RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeLayout {
    /// Hugging Face layout: element `j` pairs with `j + head_dim/2` (`rotate_half`).
    Half,
    /// Meta layout: element `2j` pairs with `2j + 1`.
    Interleaved,
}

/// A float8 training recipe (torchao's `Float8LinearRecipeName`): how the three GEMMs of a
/// `linear_f8` quantize their operands. See `docs/ir.md` for the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Float8Recipe {
    /// Every operand e4m3 with one scale per row or column (the GEMM's outer vectors), scales
    /// rounded down to a power of two; the weight is re-quantized along the other axis for
    /// `grad_input`.
    Rowwise,
    /// `rowwise`'s output GEMM; `grad_input` with a tensorwise e4m3 weight; `grad_weight` in
    /// high precision.
    RowwiseWithGwHp,
    /// One scale per tensor: e4m3 forward operands, e5m2 gradients.
    Tensorwise,
}

impl Float8Recipe {
    pub const ALL: [Float8Recipe; 3] = [Float8Recipe::Rowwise, Float8Recipe::RowwiseWithGwHp, Float8Recipe::Tensorwise];

    pub fn name(self) -> &'static str {
        match self {
            Float8Recipe::Rowwise => "rowwise",
            Float8Recipe::RowwiseWithGwHp => "rowwise_with_gw_hp",
            Float8Recipe::Tensorwise => "tensorwise",
        }
    }

    /// The recipe named `s`, or an error listing the three.
    pub fn from_name(s: &str) -> Result<Float8Recipe, String> {
        Float8Recipe::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| format!("unknown float8 recipe `{s}`; expected `rowwise`, `rowwise_with_gw_hp` or `tensorwise`"))
    }
}

/// Llama 3.1 frequency scaling of RoPE (`rope_scaling.rope_type = "llama3"` in HF configs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position: u64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub layout: RopeLayout,
    pub scaling: Option<RopeScaling>,
    /// Rotate by the negative angle: the backward of rope is rope with `inverse = true`.
    pub inverse: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecayKind {
    Constant,
    Linear,
    Cosine,
}

/// Learning-rate schedule: linear warmup, then a decay to `min_lr_ratio * lr`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    pub lr: f64,
    pub warmup_steps: u64,
    pub decay_steps: u64,
    pub decay: DecayKind,
    pub min_lr_ratio: f64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// What executes a `kernel` node's body on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelKind {
    /// A generated kernel: pointwise ops, broadcasts and row reductions fused together.
    Fused,
    /// One `matmul` or `linear`, run as a cuBLASLt GEMM.
    Gemm,
    /// One `attention` (forward), a generated FlashAttention-style kernel.
    Attention,
    /// One `attention_bwd`.
    AttentionBwd,
    /// One `embedding`, `gather` or `gather_shard`: rows of a table.
    Gather,
    /// One `scatter_add` or `scatter_add_shard`: rows summed into a zeroed table.
    ScatterAdd,
    /// Several `adamw` updates in one multi-tensor launch.
    Optimizer,
}

impl KernelKind {
    pub const ALL: [KernelKind; 7] = [
        KernelKind::Fused,
        KernelKind::Gemm,
        KernelKind::Attention,
        KernelKind::AttentionBwd,
        KernelKind::Gather,
        KernelKind::ScatterAdd,
        KernelKind::Optimizer,
    ];

    pub fn name(self) -> &'static str {
        match self {
            KernelKind::Fused => "fused",
            KernelKind::Gemm => "gemm",
            KernelKind::Attention => "attention",
            KernelKind::AttentionBwd => "attention_bwd",
            KernelKind::Gather => "gather",
            KernelKind::ScatterAdd => "scatter_add",
            KernelKind::Optimizer => "optimizer",
        }
    }
}

/// Every operation of the IR. Shapes and dtypes of results are described in `infer.rs`.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    // ---- model-level ops ----
    /// `(tokens int[...], table [V, D]) -> [..., D]`
    Embedding,
    /// `(x [..., in], w [out, in]) -> [..., out]`, i.e. `x @ w^T`
    Linear,
    /// `(x [..., in], w [out, in]) -> [..., out]`: `linear` with its GEMMs in float8 as `recipe`
    /// says (operands quantized from `x` and `w`, a `scaled_matmul`); its VJP quantizes the
    /// backward GEMMs' operands from the same high-precision `x` and `w` (straight-through).
    /// `autodiff` expands the forward into the primitives below once it has differentiated it.
    LinearF8 {
        recipe: Float8Recipe,
    },
    /// `(x [..., D], w [D]) -> [..., D]`, computed in f32
    RmsNorm {
        eps: f64,
    },
    /// `(x [b, s, h, d]) -> [b, s, h, d]`, positions `0..s`
    Rope(RopeConfig),
    /// `(q [b, s, hq, d], k [b, s, hkv, d], v [b, s, hkv, d]) -> (out [b, s, hq, d], lse f32[b, hq, s])`
    Attention {
        causal: bool,
        scale: f64,
    },
    /// `(logits [..., V], targets int[...]) -> f32[]`, mean over tokens
    CrossEntropy,

    // ---- backward of model-level ops ----
    /// `(x, w, dy) -> (dx, dw)`
    RmsNormBwd {
        eps: f64,
    },
    /// `(q, k, v, out, lse, dout) -> (dq, dk, dv)`
    AttentionBwd {
        causal: bool,
        scale: f64,
    },
    /// `(logits, targets, dloss f32[]) -> dlogits`
    CrossEntropyBwd,

    // ---- vocabulary-parallel cross-entropy (loss parallelism) ----
    /// `(logits [..., V/n], targets int[...], shard f32[n]) -> (max, sumexp, target) f32[..., 1]`:
    /// the cross-entropy statistics of one vocabulary shard; `shard` is the one-hot of the
    /// shard's index (its logits are classes `k V/n ..`).
    CrossEntropyStats,
    /// `(logits, targets, shard, dmax, dsumexp, dtarget) -> dlogits`, the VJP of `cross_entropy_stats`
    CrossEntropyStatsBwd,
    /// `(max, sumexp, target f32[..., n]) -> f32[]`: the mean over rows of
    /// `logsumexp - target` from the statistics of `n` vocabulary shards
    CrossEntropyCombine,

    // ---- primitives ----
    Unary(UnaryOp),
    /// Same shapes, or one side a rank-0 scalar.
    Binary(BinaryOp),
    /// Result dtype from the declared type.
    Cast,
    /// Removes `axes` (sorted, unique).
    Reduce {
        kind: ReduceKind,
        axes: Vec<usize>,
    },
    /// Result shape from the declared type.
    Reshape,
    Transpose {
        perm: Vec<usize>,
    },
    /// `(x) -> x` with dim `axis` cut to `[start, start + len)`.
    Slice {
        axis: u32,
        start: u64,
        len: u64,
    },
    /// `(x_0, ..., x_{n-1}) -> ` their concatenation along `axis` (n >= 1, one dtype, the other
    /// dims equal).
    Concat {
        axis: u32,
    },
    /// Input dim `i` becomes output dim `dims[i]` (size equal or 1); output shape declared.
    Broadcast {
        dims: Vec<usize>,
    },
    /// `(a [..., m, k], b [k, n] or [..., k, n]) -> [..., m, n]`, f32 accumulation
    Matmul {
        transpose_a: bool,
        transpose_b: bool,
    },
    /// `(amax float[...]) -> f32[...]`: the float8 scale `fp8_max(dtype) / max(amax, 1e-12)`,
    /// computed in f64 and rounded to f32, then (with `pow2`) rounded down to a power of two.
    Fp8Scale {
        dtype: DType,
        pow2: bool,
    },
    /// `(a f8[..., m, k], b f8[k, n], sa f32[..., m] or f32[], sb f32[n] or f32[]) -> T[..., m, n]`
    /// (`a` 2-D and stored `[k, m]` with `transpose_a`; `b` stored `[n, k]` with `transpose_b`):
    /// the product accumulated in f32, times `sa` per row and `sb` per column (the reciprocal
    /// quantization scales), rounded to the declared float type `T`. `fast_accum` lets the GPU
    /// use Hopper's reduced-precision fp8 accumulation; the reference always accumulates in f32.
    ScaledMatmul {
        transpose_a: bool,
        transpose_b: bool,
        fast_accum: bool,
    },
    /// `(table [V, r...], idx int[i...]) -> [i..., r...]`: rows of `table`
    Gather,
    /// `(idx int[i...], src [i..., r...]) -> [V, r...]`: rows summed into a zero table, V declared
    ScatterAdd,
    /// `(table [V/n, r...], idx int[i...], shard f32[n]) -> [i..., r...]`: the `gather` of one
    /// row shard of a `[V, r...]` table (vocabulary-parallel embedding). `shard` is the one-hot
    /// of the shard's index `k` (its rows are `k V/n ..`); an index in `[k V/n, (k+1) V/n)`
    /// gives its row, any other index of `[0, V)` a zero row.
    GatherShard,
    /// `(idx int[i...], src [i..., r...], shard f32[n]) -> [V/n, r...]`, V/n declared: the VJP of
    /// `gather_shard`, the `scatter_add` of the sources whose index lies in shard `k`'s rows
    /// (at `idx - k V/n`); the others are dropped.
    ScatterAddShard,
    /// `() -> T`: every element `value`
    Constant {
        value: f64,
    },

    // ---- optimizer ----
    /// `(step int[]) -> f32[]`: learning rate at 1-based `step`
    LrSchedule(LrSchedule),
    /// `(param, grad, m, v, lr f32[], step int[]) -> (param, m, v)`
    AdamW(AdamWConfig),

    // ---- collectives (SPMD graphs: every rank runs the same graph on its local values) ----
    /// `(x) -> x` with dim `dim` multiplied by `size`: the slices of the `size` ranks along
    /// `mesh_dim` concatenated in rank order.
    AllGather {
        mesh_dim: MeshDim,
        dim: u32,
        size: u32,
    },
    /// `(x) -> x` with dim `dim` divided by `size`: the elementwise sum over the ranks along
    /// `mesh_dim` (in rank order), of which rank `r` keeps slice `r` of dim `dim`.
    ReduceScatter {
        mesh_dim: MeshDim,
        dim: u32,
        size: u32,
        reduce: CollectiveReduce,
    },
    /// `(x) -> x`: the elementwise sum (or max) over the ranks along `mesh_dim`, in rank order.
    AllReduce {
        mesh_dim: MeshDim,
        reduce: CollectiveReduce,
    },
    /// `(x) -> x` with dim `dim` divided by `size`: rank `r` of the `size` ranks along
    /// `mesh_dim` keeps slice `r` of its (replicated) operand. Rank-local, no communication:
    /// DTensor's `Replicate -> Shard` redistribution.
    TakeShard {
        mesh_dim: MeshDim,
        dim: u32,
        size: u32,
    },
    /// `(x) -> x` with dim `dim` multiplied by `size`: zeros except slice `r` (rank `r` along
    /// `mesh_dim`), which is `x`. Rank-local, no communication: the VJP of `take_shard` (and
    /// the other way around).
    PlaceShard {
        mesh_dim: MeshDim,
        dim: u32,
        size: u32,
    },
    /// `(x) -> x`: a point-to-point ring shift among the `size` ranks along `mesh_dim`: rank
    /// `r` receives the operand of rank `(r + shift) mod size` and sends its own to rank
    /// `(r - shift) mod size`. One micro-step of `async-tp`'s decomposed all-gather and
    /// reduce-scatter (PyTorch's micro-pipelined TP).
    RingShift {
        mesh_dim: MeshDim,
        size: u32,
        shift: u32,
    },
    /// `(x) -> x` with dim `dim` divided by `size`: rank `r` along `mesh_dim` keeps slice
    /// `(r + shift) mod size` of its operand. Rank-local: `take_shard` rotated by `shift`
    /// (`shift = 0` is `take_shard`).
    RingSlice {
        mesh_dim: MeshDim,
        dim: u32,
        size: u32,
        shift: u32,
    },
    /// `(x_0, ..., x_{size-1}) -> x` with dim `dim` multiplied by `size`: on rank `r` along
    /// `mesh_dim`, slice `(r + s) mod size` of the result is `x_s`. Rank-local: assembles the
    /// chunks a rank computed in ring order (its own first) in rank order.
    RingConcat {
        mesh_dim: MeshDim,
        dim: u32,
        size: u32,
    },

    // ---- structure ----
    /// Run `block` `count` times. Inputs: `carry` carried values, then `stacked` per-layer
    /// values (leading dim `count`, sliced per layer), then values every layer sees whole.
    /// Results: the final carried values, then the block's other outputs stacked per layer.
    /// `reverse` walks layers from `count - 1` down to 0. `prefetch` (0 unless the
    /// `prefetch-next-layer` pass wrote it) is the number of **prefetched carries**: block
    /// arguments and outputs right after the `carry` carried ones that have no operand and no
    /// result; the block's prefetch nodes (see [`crate::prefetch::PrefetchSplit`]) compute
    /// them from the *next* layer's slices, once before the first layer and then during every
    /// layer but the last.
    Repeat {
        block: BlockId,
        count: u32,
        carry: u32,
        stacked: u32,
        reverse: bool,
        prefetch: u32,
    },
    /// One kernel launch: run `body` (a block outlined by the fusion pass) on the inputs.
    /// Inputs bind the body's arguments in order; results are the body's outputs.
    Kernel {
        body: BlockId,
        kind: KernelKind,
    },
}

impl UnaryOp {
    pub const ALL: [UnaryOp; 11] = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Recip,
        UnaryOp::Sigmoid,
        UnaryOp::Silu,
        UnaryOp::Tanh,
        UnaryOp::Abs,
        UnaryOp::Square,
    ];

    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Recip => "recip",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Silu => "silu",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Abs => "abs",
            UnaryOp::Square => "square",
        }
    }
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 8] =
        [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Max, BinaryOp::Min, BinaryOp::Pow, BinaryOp::SiluGrad];

    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Max => "max",
            BinaryOp::Min => "min",
            BinaryOp::Pow => "pow",
            BinaryOp::SiluGrad => "silu_grad",
        }
    }
}

impl ReduceKind {
    pub fn op_name(self) -> &'static str {
        match self {
            ReduceKind::Sum => "reduce_sum",
            ReduceKind::Max => "reduce_max",
            ReduceKind::Mean => "reduce_mean",
        }
    }
}

fn layout_name(l: RopeLayout) -> &'static str {
    match l {
        RopeLayout::Half => "half",
        RopeLayout::Interleaved => "interleaved",
    }
}

fn decay_name(d: DecayKind) -> &'static str {
    match d {
        DecayKind::Constant => "constant",
        DecayKind::Linear => "linear",
        DecayKind::Cosine => "cosine",
    }
}

fn f(x: f64) -> AttrValue {
    AttrValue::Float(x)
}

fn b(x: bool) -> AttrValue {
    AttrValue::Bool(x)
}

fn i(x: u64) -> AttrValue {
    AttrValue::Int(x as i64)
}

fn list(xs: &[usize]) -> AttrValue {
    AttrValue::List(xs.iter().map(|&x| AttrValue::Int(x as i64)).collect())
}

fn word(s: &str) -> AttrValue {
    AttrValue::Ident(s.to_string())
}

impl Op {
    /// The name the text format uses.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Embedding => "embedding",
            Op::Linear => "linear",
            Op::LinearF8 { .. } => "linear_f8",
            Op::RmsNorm { .. } => "rmsnorm",
            Op::Rope(_) => "rope",
            Op::Attention { .. } => "attention",
            Op::CrossEntropy => "cross_entropy",
            Op::RmsNormBwd { .. } => "rmsnorm_bwd",
            Op::AttentionBwd { .. } => "attention_bwd",
            Op::CrossEntropyBwd => "cross_entropy_bwd",
            Op::CrossEntropyStats => "cross_entropy_stats",
            Op::CrossEntropyStatsBwd => "cross_entropy_stats_bwd",
            Op::CrossEntropyCombine => "cross_entropy_combine",
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Cast => "cast",
            Op::Reduce { kind, .. } => kind.op_name(),
            Op::Reshape => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Slice { .. } => "slice",
            Op::Concat { .. } => "concat",
            Op::Broadcast { .. } => "broadcast",
            Op::Matmul { .. } => "matmul",
            Op::Fp8Scale { .. } => "fp8_scale",
            Op::ScaledMatmul { .. } => "scaled_matmul",
            Op::Gather => "gather",
            Op::ScatterAdd => "scatter_add",
            Op::GatherShard => "gather_shard",
            Op::ScatterAddShard => "scatter_add_shard",
            Op::Constant { .. } => "constant",
            Op::LrSchedule(_) => "lr_schedule",
            Op::AdamW(_) => "adamw",
            Op::Repeat { .. } => "repeat",
            Op::Kernel { .. } => "kernel",
            Op::AllGather { .. } => "all_gather",
            Op::ReduceScatter { .. } => "reduce_scatter",
            Op::AllReduce { .. } => "all_reduce",
            Op::TakeShard { .. } => "take_shard",
            Op::PlaceShard { .. } => "place_shard",
            Op::RingShift { .. } => "ring_shift",
            Op::RingSlice { .. } => "ring_slice",
            Op::RingConcat { .. } => "ring_concat",
        }
    }

    /// Number of inputs the op takes, `None` when it varies (`repeat`).
    pub fn arity(&self) -> Option<usize> {
        Some(match self {
            Op::Embedding | Op::Linear | Op::LinearF8 { .. } | Op::RmsNorm { .. } | Op::CrossEntropy => 2,
            Op::Fp8Scale { .. } => 1,
            Op::ScaledMatmul { .. } => 4,
            Op::Rope(_) => 1,
            Op::Attention { .. } | Op::CrossEntropyStats | Op::CrossEntropyCombine => 3,
            Op::GatherShard | Op::ScatterAddShard => 3,
            Op::CrossEntropyStatsBwd => 6,
            Op::RmsNormBwd { .. } | Op::CrossEntropyBwd => 3,
            Op::AttentionBwd { .. } => 6,
            Op::Unary(_) | Op::Cast | Op::Reduce { .. } | Op::Reshape | Op::Transpose { .. } | Op::Slice { .. } => 1,
            Op::AllGather { .. } | Op::ReduceScatter { .. } | Op::AllReduce { .. } => 1,
            Op::TakeShard { .. } | Op::PlaceShard { .. } | Op::RingShift { .. } | Op::RingSlice { .. } => 1,
            Op::RingConcat { size, .. } => *size as usize,
            Op::Broadcast { .. } | Op::LrSchedule(_) => 1,
            Op::Binary(_) | Op::Matmul { .. } | Op::Gather | Op::ScatterAdd => 2,
            Op::Constant { .. } => 0,
            Op::AdamW(_) => 6,
            Op::Repeat { .. } | Op::Kernel { .. } | Op::Concat { .. } => return None,
        })
    }

    /// Number of results the op produces, `None` when it depends on the block (`repeat`).
    pub fn num_results(&self) -> Option<usize> {
        Some(match self {
            Op::Attention { .. } | Op::RmsNormBwd { .. } => 2,
            Op::AttentionBwd { .. } | Op::AdamW(_) | Op::CrossEntropyStats => 3,
            Op::Repeat { .. } | Op::Kernel { .. } => return None,
            _ => 1,
        })
    }

    /// Ops whose result type cannot be inferred from the inputs and is taken from the declaration.
    pub fn result_type_declared(&self) -> bool {
        matches!(self, Op::Cast | Op::Reshape | Op::Broadcast { .. } | Op::ScatterAdd | Op::ScatterAddShard | Op::Constant { .. } | Op::ScaledMatmul { .. })
    }

    /// Collectives: communication between the ranks of one mesh dimension.
    pub fn is_collective(&self) -> bool {
        matches!(self, Op::AllGather { .. } | Op::ReduceScatter { .. } | Op::AllReduce { .. } | Op::RingShift { .. })
    }

    /// Rank-local ops whose result depends on the rank's coordinate along a mesh dim but
    /// which communicate nothing: `take_shard`, `place_shard`, `ring_slice`, `ring_concat`.
    pub fn is_rank_local(&self) -> bool {
        matches!(self, Op::TakeShard { .. } | Op::PlaceShard { .. } | Op::RingSlice { .. } | Op::RingConcat { .. })
    }

    /// The group size a collective or rank-local op names (`all_reduce` names none).
    pub fn group_size(&self) -> Option<u32> {
        match self {
            Op::AllGather { size, .. }
            | Op::ReduceScatter { size, .. }
            | Op::TakeShard { size, .. }
            | Op::PlaceShard { size, .. }
            | Op::RingShift { size, .. }
            | Op::RingSlice { size, .. }
            | Op::RingConcat { size, .. } => Some(*size),
            _ => None,
        }
    }

    /// The mesh dimension a collective communicates over.
    pub fn collective_mesh_dim(&self) -> Option<MeshDim> {
        match self {
            Op::AllGather { mesh_dim, .. } | Op::ReduceScatter { mesh_dim, .. } | Op::AllReduce { mesh_dim, .. } | Op::RingShift { mesh_dim, .. } => {
                Some(*mesh_dim)
            }
            _ => None,
        }
    }

    /// The mesh dimension an op's result depends on: collectives and the rank-local
    /// `take_shard`/`place_shard`, whose result depends on the rank's coordinate.
    pub fn mesh_dim(&self) -> Option<MeshDim> {
        match self {
            Op::TakeShard { mesh_dim, .. } | Op::PlaceShard { mesh_dim, .. } | Op::RingSlice { mesh_dim, .. } | Op::RingConcat { mesh_dim, .. } => {
                Some(*mesh_dim)
            }
            _ => self.collective_mesh_dim(),
        }
    }

    /// Pointwise ops (elementwise over same-shaped operands, scalars broadcast).
    pub fn is_pointwise(&self) -> bool {
        matches!(self, Op::Unary(_) | Op::Binary(_) | Op::Cast | Op::Fp8Scale { .. })
    }

    /// The attribute dictionary as printed. `block_name` maps a block id to its name.
    pub fn attrs(&self, block_name: &dyn Fn(BlockId) -> String) -> Attrs {
        let e: Vec<(&str, AttrValue)> = match self {
            Op::Embedding
            | Op::Linear
            | Op::CrossEntropy
            | Op::CrossEntropyBwd
            | Op::CrossEntropyStats
            | Op::CrossEntropyStatsBwd
            | Op::CrossEntropyCombine
            | Op::Unary(_)
            | Op::Binary(_)
            | Op::Cast
            | Op::Reshape
            | Op::Gather
            | Op::ScatterAdd
            | Op::GatherShard
            | Op::ScatterAddShard => vec![],
            Op::RmsNorm { eps } | Op::RmsNormBwd { eps } => vec![("eps", f(*eps))],
            Op::Rope(r) => {
                let mut v = vec![("theta", f(r.theta)), ("layout", word(layout_name(r.layout)))];
                if let Some(s) = r.scaling {
                    v.push(("scaling_factor", f(s.factor)));
                    v.push(("low_freq_factor", f(s.low_freq_factor)));
                    v.push(("high_freq_factor", f(s.high_freq_factor)));
                    v.push(("original_max_position", i(s.original_max_position)));
                }
                if r.inverse {
                    v.push(("inverse", b(true)));
                }
                v
            }
            Op::Attention { causal, scale } | Op::AttentionBwd { causal, scale } => {
                vec![("causal", b(*causal)), ("scale", f(*scale))]
            }
            Op::Reduce { axes, .. } => vec![("axes", list(axes))],
            Op::Transpose { perm } => vec![("perm", list(perm))],
            Op::Slice { axis, start, len } => vec![("axis", i(u64::from(*axis))), ("start", i(*start)), ("len", i(*len))],
            Op::Concat { axis } => vec![("axis", i(u64::from(*axis)))],
            Op::Broadcast { dims } => vec![("dims", list(dims))],
            Op::Matmul { transpose_a, transpose_b } => {
                vec![("transpose_a", b(*transpose_a)), ("transpose_b", b(*transpose_b))]
            }
            Op::LinearF8 { recipe } => vec![("recipe", word(recipe.name()))],
            Op::Fp8Scale { dtype, pow2 } => vec![("dtype", word(dtype.name())), ("pow2", b(*pow2))],
            Op::ScaledMatmul { transpose_a, transpose_b, fast_accum } => {
                vec![("transpose_a", b(*transpose_a)), ("transpose_b", b(*transpose_b)), ("fast_accum", b(*fast_accum))]
            }
            Op::Constant { value } => vec![("value", f(*value))],
            Op::LrSchedule(s) => vec![
                ("lr", f(s.lr)),
                ("warmup_steps", i(s.warmup_steps)),
                ("decay_steps", i(s.decay_steps)),
                ("decay", word(decay_name(s.decay))),
                ("min_lr_ratio", f(s.min_lr_ratio)),
            ],
            Op::AdamW(c) => vec![("beta1", f(c.beta1)), ("beta2", f(c.beta2)), ("eps", f(c.eps)), ("weight_decay", f(c.weight_decay))],
            Op::Repeat { block, count, carry, stacked, reverse, prefetch } => {
                let mut v = vec![
                    ("block", AttrValue::Symbol(block_name(*block))),
                    ("count", i(u64::from(*count))),
                    ("carry", i(u64::from(*carry))),
                    ("stacked", i(u64::from(*stacked))),
                    ("reverse", b(*reverse)),
                ];
                if *prefetch > 0 {
                    v.push(("prefetch", i(u64::from(*prefetch))));
                }
                v
            }
            Op::Kernel { body, kind } => vec![("body", AttrValue::Symbol(block_name(*body))), ("kind", word(kind.name()))],
            Op::AllGather { mesh_dim, dim, size } | Op::TakeShard { mesh_dim, dim, size } | Op::PlaceShard { mesh_dim, dim, size } => {
                vec![("mesh_dim", word(mesh_dim.name())), ("dim", i(u64::from(*dim))), ("size", i(u64::from(*size)))]
            }
            Op::ReduceScatter { mesh_dim, dim, size, reduce } => {
                vec![("mesh_dim", word(mesh_dim.name())), ("dim", i(u64::from(*dim))), ("size", i(u64::from(*size))), ("reduce", word(reduce.name()))]
            }
            Op::AllReduce { mesh_dim, reduce } => vec![("mesh_dim", word(mesh_dim.name())), ("reduce", word(reduce.name()))],
            Op::RingShift { mesh_dim, size, shift } => {
                vec![("mesh_dim", word(mesh_dim.name())), ("size", i(u64::from(*size))), ("shift", i(u64::from(*shift)))]
            }
            Op::RingSlice { mesh_dim, dim, size, shift } => {
                vec![("mesh_dim", word(mesh_dim.name())), ("dim", i(u64::from(*dim))), ("size", i(u64::from(*size))), ("shift", i(u64::from(*shift)))]
            }
            Op::RingConcat { mesh_dim, dim, size } => {
                vec![("mesh_dim", word(mesh_dim.name())), ("dim", i(u64::from(*dim))), ("size", i(u64::from(*size)))]
            }
        };
        Attrs::new(e.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
    }

    /// Build an op from its name and attributes; every attribute must be used.
    /// `block_id` resolves `@name` references to blocks.
    pub fn from_parts(name: &str, attrs: Attrs, block_id: &dyn Fn(&str) -> Option<BlockId>) -> Result<Op, String> {
        let mut a = attrs;
        let op = match name {
            "embedding" => Op::Embedding,
            "linear" => Op::Linear,
            "cross_entropy" => Op::CrossEntropy,
            "cross_entropy_bwd" => Op::CrossEntropyBwd,
            "cross_entropy_stats" => Op::CrossEntropyStats,
            "cross_entropy_stats_bwd" => Op::CrossEntropyStatsBwd,
            "cross_entropy_combine" => Op::CrossEntropyCombine,
            "cast" => Op::Cast,
            "reshape" => Op::Reshape,
            "gather" => Op::Gather,
            "scatter_add" => Op::ScatterAdd,
            "gather_shard" => Op::GatherShard,
            "scatter_add_shard" => Op::ScatterAddShard,
            "rmsnorm" => Op::RmsNorm { eps: a.take_f64("eps")? },
            "rmsnorm_bwd" => Op::RmsNormBwd { eps: a.take_f64("eps")? },
            "rope" => {
                let theta = a.take_f64("theta")?;
                let layout = match a.take_ident("layout")?.as_str() {
                    "half" => RopeLayout::Half,
                    "interleaved" => RopeLayout::Interleaved,
                    other => return Err(format!("unknown rope layout `{other}`; expected `half` or `interleaved`")),
                };
                let scaling = match a.get("scaling_factor") {
                    None => None,
                    Some(_) => Some(RopeScaling {
                        factor: a.take_f64("scaling_factor")?,
                        low_freq_factor: a.take_f64("low_freq_factor")?,
                        high_freq_factor: a.take_f64("high_freq_factor")?,
                        original_max_position: a.take_u64("original_max_position")?,
                    }),
                };
                let inverse = match a.get("inverse") {
                    None => false,
                    Some(_) => a.take_bool("inverse")?,
                };
                Op::Rope(RopeConfig { theta, layout, scaling, inverse })
            }
            "attention" | "attention_bwd" => {
                let causal = a.take_bool("causal")?;
                let scale = a.take_f64("scale")?;
                if name == "attention" { Op::Attention { causal, scale } } else { Op::AttentionBwd { causal, scale } }
            }
            "reduce_sum" | "reduce_max" | "reduce_mean" => {
                let kind = match name {
                    "reduce_sum" => ReduceKind::Sum,
                    "reduce_max" => ReduceKind::Max,
                    _ => ReduceKind::Mean,
                };
                Op::Reduce { kind, axes: a.take_usize_list("axes")? }
            }
            "transpose" => Op::Transpose { perm: a.take_usize_list("perm")? },
            "slice" | "concat" => {
                let axis = a.take_u64("axis")?;
                let axis = u32::try_from(axis).map_err(|_| "attribute `axis` is too large".to_string())?;
                if name == "concat" { Op::Concat { axis } } else { Op::Slice { axis, start: a.take_u64("start")?, len: a.take_u64("len")? } }
            }
            "broadcast" => Op::Broadcast { dims: a.take_usize_list("dims")? },
            "matmul" => Op::Matmul { transpose_a: a.take_bool("transpose_a")?, transpose_b: a.take_bool("transpose_b")? },
            "linear_f8" => Op::LinearF8 { recipe: Float8Recipe::from_name(&a.take_ident("recipe")?)? },
            "fp8_scale" => {
                let name = a.take_ident("dtype")?;
                let dtype: DType = name.parse()?;
                if crate::fp8::fp8_max(dtype).is_none() {
                    return Err(format!("`fp8_scale` needs an fp8 dtype (`f8e4m3` or `f8e5m2`), found `{dtype}`"));
                }
                Op::Fp8Scale { dtype, pow2: a.take_bool("pow2")? }
            }
            "scaled_matmul" => {
                Op::ScaledMatmul { transpose_a: a.take_bool("transpose_a")?, transpose_b: a.take_bool("transpose_b")?, fast_accum: a.take_bool("fast_accum")? }
            }
            "constant" => Op::Constant { value: a.take_f64("value")? },
            "lr_schedule" => {
                let lr = a.take_f64("lr")?;
                let warmup_steps = a.take_u64("warmup_steps")?;
                let decay_steps = a.take_u64("decay_steps")?;
                let decay = match a.take_ident("decay")?.as_str() {
                    "constant" => DecayKind::Constant,
                    "linear" => DecayKind::Linear,
                    "cosine" => DecayKind::Cosine,
                    other => {
                        return Err(format!("unknown decay `{other}`; expected `constant`, `linear` or `cosine`"));
                    }
                };
                let min_lr_ratio = a.take_f64("min_lr_ratio")?;
                Op::LrSchedule(LrSchedule { lr, warmup_steps, decay_steps, decay, min_lr_ratio })
            }
            "adamw" => Op::AdamW(AdamWConfig {
                beta1: a.take_f64("beta1")?,
                beta2: a.take_f64("beta2")?,
                eps: a.take_f64("eps")?,
                weight_decay: a.take_f64("weight_decay")?,
            }),
            "repeat" => {
                let block = match a.take_required("block")? {
                    AttrValue::Symbol(s) => block_id(&s).ok_or_else(|| format!("no block named `@{s}`"))?,
                    other => return Err(format!("attribute `block` must be a block reference `@name`, found {}", other.kind())),
                };
                let small = |a: &mut Attrs, k: &str| -> Result<u32, String> {
                    let v = a.take_u64(k)?;
                    u32::try_from(v).map_err(|_| format!("attribute `{k}` is too large"))
                };
                let count = small(&mut a, "count")?;
                let carry = small(&mut a, "carry")?;
                let stacked = small(&mut a, "stacked")?;
                let reverse = a.take_bool("reverse")?;
                let prefetch = match a.get("prefetch") {
                    None => 0,
                    Some(_) => small(&mut a, "prefetch")?,
                };
                Op::Repeat { block, count, carry, stacked, reverse, prefetch }
            }
            "kernel" => {
                let body = match a.take_required("body")? {
                    AttrValue::Symbol(s) => block_id(&s).ok_or_else(|| format!("no block named `@{s}`"))?,
                    other => return Err(format!("attribute `body` must be a block reference `@name`, found {}", other.kind())),
                };
                let kind_name = a.take_ident("kind")?;
                let kind = KernelKind::ALL.into_iter().find(|k| k.name() == kind_name).ok_or_else(|| {
                    let all: Vec<&str> = KernelKind::ALL.iter().map(|k| k.name()).collect();
                    format!("unknown kernel kind `{kind_name}`; expected one of {}", all.join(", "))
                })?;
                Op::Kernel { body, kind }
            }
            "all_gather" | "reduce_scatter" | "all_reduce" | "take_shard" | "place_shard" | "ring_shift" | "ring_slice" | "ring_concat" => {
                let mesh_name = a.take_ident("mesh_dim")?;
                let mesh_dim =
                    MeshDim::from_name(&mesh_name).ok_or_else(|| format!("unknown mesh dim `{mesh_name}`; expected `dp_replicate`, `dp_shard` or `tp`"))?;
                let small = |a: &mut Attrs, k: &str| -> Result<u32, String> {
                    let v = a.take_u64(k)?;
                    u32::try_from(v).map_err(|_| format!("attribute `{k}` is too large"))
                };
                let reduce = |a: &mut Attrs| -> Result<CollectiveReduce, String> {
                    match a.take_ident("reduce")?.as_str() {
                        "sum" => Ok(CollectiveReduce::Sum),
                        "max" => Ok(CollectiveReduce::Max),
                        other => Err(format!("unknown reduction `{other}`; expected `sum` or `max`")),
                    }
                };
                match name {
                    "all_gather" => Op::AllGather { mesh_dim, dim: small(&mut a, "dim")?, size: small(&mut a, "size")? },
                    "take_shard" => Op::TakeShard { mesh_dim, dim: small(&mut a, "dim")?, size: small(&mut a, "size")? },
                    "place_shard" => Op::PlaceShard { mesh_dim, dim: small(&mut a, "dim")?, size: small(&mut a, "size")? },
                    "ring_concat" => Op::RingConcat { mesh_dim, dim: small(&mut a, "dim")?, size: small(&mut a, "size")? },
                    "ring_shift" | "ring_slice" => {
                        let dim = if name == "ring_slice" { Some(small(&mut a, "dim")?) } else { None };
                        let size = small(&mut a, "size")?;
                        let shift = small(&mut a, "shift")?;
                        if size == 0 || shift >= size {
                            return Err(format!("`{name}` needs 0 <= shift < size, found shift = {shift}, size = {size}"));
                        }
                        match dim {
                            Some(dim) => Op::RingSlice { mesh_dim, dim, size, shift },
                            None => Op::RingShift { mesh_dim, size, shift },
                        }
                    }
                    "reduce_scatter" => {
                        let dim = small(&mut a, "dim")?;
                        let size = small(&mut a, "size")?;
                        let reduce = reduce(&mut a)?;
                        if reduce != CollectiveReduce::Sum {
                            return Err("`reduce_scatter` with `reduce = max` is not supported yet; use `reduce = sum`".into());
                        }
                        Op::ReduceScatter { mesh_dim, dim, size, reduce }
                    }
                    _ => Op::AllReduce { mesh_dim, reduce: reduce(&mut a)? },
                }
            }
            other => {
                if let Some(u) = UnaryOp::ALL.into_iter().find(|u| u.name() == other) {
                    Op::Unary(u)
                } else if let Some(bo) = BinaryOp::ALL.into_iter().find(|bo| bo.name() == other) {
                    Op::Binary(bo)
                } else {
                    return Err(format!("unknown op `{other}`"));
                }
            }
        };
        a.finish(&format!("`{name}`"))?;
        Ok(op)
    }
}
