//! The artifact: what `titanc build` writes and `titan-run` reads, the one serialized boundary
//! between compiler and runtime. A directory holding `manifest.json` (this module's
//! [`Manifest`]), `graph.ir` (the fused training graph whose blocks are the kernels' op groups)
//! and `kernels/*.ptx`. `docs/artifact.md` documents every field.
//!
//! Everything here is deterministic: maps are `BTreeMap`, lists are in schedule order.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::op::{CollectiveReduce, KernelKind, Op};
use crate::placement::MeshDim as GraphMeshDim;

pub mod liveness;
pub mod memory_svg;
pub mod timeline;
pub mod workspace;

/// Bumped on every change a reader of an older version would misread. Version 3 added the
/// `collective` schedule step and the optional mesh `report` (SPMD artifacts): a version-2
/// reader would reject the unknown step and run a mesh artifact as one rank. Version 4 added
/// the loop's `prefetch` steps (`prefetch-next-layer`): a version-3 reader would ignore them
/// and read prefetched carry slots nothing wrote. Version 5 added `model_hash`: a version-4
/// reader would run the artifact but drop the model identity from its checkpoints, so they
/// could not be resumed on another mesh without `--allow-different-build`; readers of version 5
/// still read version 4 (no `model_hash`: checkpoints are matched on the content hash alone).
///
/// Version 6 added the optional `eval` step (validation loss): a version-5 reader would ignore
/// it and refuse `--val-data`. Version 7 dropped the `grads` arena: gradients are planned with
/// the activations in one arena (both are dead between steps), so an older manifest names an
/// arena this reader does not have, and an older reader would size the arenas wrongly.
///
/// Version 8 added the offset view [`BufRef::View`] (a leading-axis `slice` of a buffer, one
/// operand's place in a `concat`, every-N-th layer checkpointing): an older reader would fail on
/// it or, worse, bind the whole buffer.
///
/// Version 9 added the `compute_copy` buffers (`compute-copies`): the bf16 compute copies of the
/// masters are persistent, written by the optimizer kernel and cast from the masters by the
/// runtime at start-up and after `--resume`, no longer cast at the top of every step. An older
/// reader would leave them uninitialized (and an older artifact's copies are activations), so
/// neither side reads the other's.
/// Version 10 added the ring offset of a view ([`RingOffset`]: async TP's chunk GEMMs read and
/// write their rows of a tp-sharded value in place, at an offset that depends on the rank's tp
/// coordinate) and the lifetime rule that a buffer a loop's data-parallel collective reads
/// lives across the loop (`liveness::pinned_in_loops`): an older reader would ignore the ring
/// offset and address rank 0's rows on every rank, and would check plans against shorter
/// lifetimes.
///
/// Version 11 added the lifetime rule that a communicating collective's operand inside a loop
/// lives until the compute stream joins the collective (the first later step of the iteration
/// touching its result, `liveness::held_until_joined`): a format-10 plan may reuse those bytes
/// (async TP's chunk GEMMs overwrote the partial the previous `ring_shift` still sent), which
/// this reader's check refuses, and an older reader would accept plans made either way.
///
/// Version 12 added a kernel's `epilogue` (a phase launched after its entry): a reader of version
/// 11 would skip it and leave the kernel's output unwritten, so 12 is needed where one is present.
pub const FORMAT_VERSION: u32 = 12;
/// The oldest format version this reader reads.
pub const MIN_FORMAT_VERSION: u32 = 11;
pub const MANIFEST_FILE: &str = "manifest.json";
/// The fused training graph; each kernel's `body` names one of its blocks.
pub const GRAPH_FILE: &str = "graph.ir";
/// The fused eval step's graph; each eval kernel's `body` names one of its blocks.
pub const EVAL_GRAPH_FILE: &str = "eval.ir";
pub const KERNEL_DIR: &str = "kernels";

/// The GPU the PTX was generated for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Target {
    /// `sm_90a`.
    pub arch: String,
    /// PTX ISA version of the emitted files, e.g. `8.0`.
    pub ptx_isa: String,
}

impl Target {
    pub fn sm90a() -> Target {
        Target { arch: "sm_90a".into(), ptx_isa: "8.0".into() }
    }
}

/// One dimension of the device mesh (TorchTitan names: `dp_replicate`, `dp_shard`, `cp`, `tp`, `pp`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshDim {
    pub name: String,
    pub size: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mesh {
    pub world_size: u32,
    /// Outermost first; empty on one device.
    pub dims: Vec<MeshDim>,
}

/// What a buffer holds; decides its arena and how the runtime treats it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferClass {
    /// Fed by the runtime every step (`tokens`, `targets`, `step`).
    Input,
    /// fp32 master weights: persistent, initialized, checkpointed.
    Param,
    /// AdamW moments: persistent, checkpointed.
    OptimizerState,
    /// The compute-dtype copy of a master weight (`init = compute_copy`, `state.name` the
    /// master's name plus `.compute`): persistent, in the params arena, written by the optimizer
    /// kernel each step, cast from its master by the runtime whenever the master is set
    /// (start-up, `--resume`); never checkpointed.
    ComputeCopy,
    /// Gradients of parameters (from the backward to the optimizer).
    Grad,
    /// Everything else computed during the step (activations, compute copies, temporaries).
    Activation,
}

/// Separate regions of device memory; each buffer lives at `offset` in its arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arena {
    Inputs,
    Params,
    OptimizerState,
    /// Everything the step computes (activations, gradients and their fp32 copies): dead between
    /// steps, so one best-fit plan over all of them lets a gradient reuse the bytes of an
    /// activation the backward has finished with.
    Activations,
}

/// The arena a buffer of each class lives in.
pub fn arena_of(class: BufferClass) -> Arena {
    match class {
        BufferClass::Input => Arena::Inputs,
        BufferClass::Param | BufferClass::ComputeCopy => Arena::Params,
        BufferClass::OptimizerState => Arena::OptimizerState,
        BufferClass::Grad => Arena::Activations,
        BufferClass::Activation => Arena::Activations,
    }
}

/// The manifest's spelling of an arena.
pub fn arena_name(a: Arena) -> &'static str {
    match a {
        Arena::Inputs => "inputs",
        Arena::Params => "params",
        Arena::OptimizerState => "optimizer_state",
        Arena::Activations => "activations",
    }
}

/// `1.50 GiB` (binary units, `decimals` digits after the point; plain bytes below 1 KiB).
pub fn human_bytes(bytes: u64, decimals: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = bytes as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{bytes} B") } else { format!("{x:.decimals$} {}", UNITS[u]) }
}

/// A persistent buffer's checkpoint identity and initializer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StateInfo {
    /// Checkpoint name; a stacked buffer names layers with `{i}`.
    pub name: String,
    /// The initializer as written in the IR (`normal(1.0)`, `zeros`, ...).
    pub init: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Buffer {
    pub id: u32,
    /// The IR value it holds (`main.%x`, `layer.%12`), for reports and errors.
    pub name: String,
    pub dtype: DType,
    /// Fully resolved shape.
    pub shape: Vec<u64>,
    /// `numel * dtype size`.
    pub bytes: u64,
    pub class: BufferClass,
    pub arena: Arena,
    /// Byte offset in the arena (aligned to 256).
    pub offset: u64,
    /// For `param`/`optimizer_state` buffers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<StateInfo>,
    /// For `input` buffers: `tokens`, `targets` or `step`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feed: Option<String>,
    /// Set when the step's named output (`loss`, `grad_norm`, `lr`) is read from this buffer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArenaPlan {
    pub arena: Arena,
    /// Bytes to allocate (the arena's high-water mark).
    pub bytes: u64,
}

/// The static memory plan of one rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryPlan {
    pub arenas: Vec<ArenaPlan>,
    /// Sum over arenas: the predicted peak device memory of the step (excluding library workspaces).
    pub peak_bytes: u64,
    /// Activation bytes if nothing were reused (sum of all activation buffers), for the report.
    pub activation_bytes_unplanned: u64,
}

/// cuBLASLt description of a GEMM: `C[m, n] = op(A) @ op(B)`, row-major, `batch` times with
/// the given strides (elements). bf16/f16 in, fp32 accumulation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GemmDesc {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub batch: u64,
    pub transpose_a: bool,
    pub transpose_b: bool,
    pub lda: u64,
    pub ldb: u64,
    pub ldc: u64,
    pub stride_a: u64,
    pub stride_b: u64,
    pub stride_c: u64,
    pub a_dtype: DType,
    pub b_dtype: DType,
    pub c_dtype: DType,
    /// Always `f32` for now.
    pub compute: DType,
    /// `none`, or `add`: the residual-add epilogue `D = A B + C_in`, `C_in` the kernel's
    /// input 2 with the output's type and layout (cuBLASLt's `beta = 1`; `fuse` rule 11).
    pub epilogue: String,
    /// How A's rows are scaled (fp8 `scaled_matmul`: the body's argument 2); absent for
    /// unscaled GEMMs.
    #[serde(default, skip_serializing_if = "GemmScale::is_none")]
    pub scale_a: GemmScale,
    /// How C's columns are scaled (the body's argument 3).
    #[serde(default, skip_serializing_if = "GemmScale::is_none")]
    pub scale_b: GemmScale,
    /// Hopper's reduced-precision fp8 accumulation (the forward GEMM of float8 training).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fast_accum: bool,
}

impl GemmDesc {
    /// The `epilogue` value of the residual-add epilogue.
    pub const ADD: &'static str = "add";

    /// Whether the GEMM adds its launch's input 2 (`epilogue = "add"`: `D = A B + C_in`).
    pub fn adds_input(&self) -> bool {
        self.epilogue == Self::ADD
    }
}

/// The dequantization scale of one fp8 GEMM operand (f32, the reciprocal of the quantization
/// scale): none, one for the tensor, or one per row of A / per column of B (cuBLASLt's outer
/// vector scaling).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GemmScale {
    #[default]
    None,
    Tensor,
    Vector,
}

impl GemmScale {
    pub fn is_none(&self) -> bool {
        matches!(self, GemmScale::None)
    }
}

/// Grid and block dimensions and dynamic shared memory of a generated kernel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launch {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
}

/// Another grid-wide phase of a kernel: an entry of the same module, launched with the same
/// arguments just before the kernel's own entry (`prologue`: the attention backward's dQ pass,
/// which also writes the row statistics its dK/dV pass reads) or just after it (`epilogue`: the
/// five-product attention backward's f32 -> bf16 dQ conversion).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prologue {
    pub entry: String,
    pub launch: Launch,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Kernel {
    pub id: u32,
    /// Unique, e.g. `layer.k3_rmsnorm`.
    pub name: String,
    pub kind: KernelKind,
    /// The block of `graph.ir` holding the op group (without `@`).
    pub body: String,
    /// PTX file relative to the artifact directory; absent for GEMMs (cuBLASLt) and for kinds
    /// whose code generator is not built yet (the CPU backend still runs them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ptx: Option<String>,
    /// Cubin file relative to the artifact directory (`kernels/<name>.cubin`): the PTX assembled
    /// by `ptxas` for `target.arch`, so the driver need not JIT-compile it at load. Absent when
    /// the build found no `ptxas`; loaders use it only on a matching device and fall back to the
    /// PTX otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cubin: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launch: Option<Launch>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prologue: Option<Prologue>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epilogue: Option<Prologue>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm: Option<GemmDesc>,
    /// Scratch the kernel needs (cross-block reductions); passed as the last pointer argument.
    /// The runtime allocates it zeroed once; the kernel leaves it zeroed when it returns, unless
    /// `workspace_scratch` says it writes every workspace byte it reads (then no zeroing matters).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub workspace_bytes: u64,
    #[serde(default, skip_serializing_if = "is_false")]
    pub workspace_scratch: bool,
    /// Bytes the kernel reads and writes per launch (for the fusion report and rooflines).
    pub bytes_read: u64,
    pub bytes_written: u64,
}

/// A buffer operand of a schedule step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum BufRef {
    /// Slot `carry` of the enclosing loop: its input buffer this iteration (`out = false`) or
    /// the buffer the next iteration reads (`out = true`).
    Carry { carry: u32, out: bool },
    /// Bytes `offset + i * stride .. offset + i * stride + bytes` of `buffer`, `i` the enclosing
    /// loop's layer index (`stride = 0`: the same bytes in every iteration, and outside loops):
    /// a leading-axis `slice` of a buffer or of a layer slice, or the place one operand of a
    /// `concat` is written to. Listed before `Buffer` so the untagged form picks it when all
    /// four fields are present.
    ///
    /// With `ring`, the view also moves by a rank-dependent multiple of `ring.step`
    /// ([`RingOffset`]): one chunk of async TP's ring, read or written in place.
    View {
        buffer: u32,
        offset: u64,
        bytes: u64,
        stride: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ring: Option<RingOffset>,
    },
    /// Slice `i` along dim 0 of `buffer`, `i` the enclosing loop's layer index (`layer = true`),
    /// or the whole buffer.
    Buffer {
        buffer: u32,
        #[serde(default, skip_serializing_if = "is_false")]
        layer: bool,
    },
}

/// The rank-dependent part of a view's offset: `step * ((c + shift) mod size)` bytes, `c` the
/// rank's coordinate along `tp` (`size` is the tp degree). Async TP's ring micro-steps visit the
/// tp shards of a value in ring order, so the chunk a rank computes at micro-step `shift` is the
/// slice `(c + shift) mod size` of the assembled value (`ring_concat`), and the rows a
/// reduce-scatter's chunk GEMM reads are that slice of its operand (`ring_slice`). Only
/// leading-axis slices are contiguous, so a view has one ring offset at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingOffset {
    pub size: u32,
    pub shift: u32,
    pub step: u64,
}

impl RingOffset {
    /// The bytes it adds for the rank at tp coordinate `tp_coord`.
    pub fn bytes_at(&self, tp_coord: u32) -> Result<u64, String> {
        if self.size == 0 || tp_coord >= self.size {
            return Err(format!("a ring offset over {} ranks at tp coordinate {tp_coord}", self.size));
        }
        u64::from((tp_coord + self.shift % self.size) % self.size)
            .checked_mul(self.step)
            .ok_or_else(|| format!("a ring offset of {} x {} bytes overflows", self.size, self.step))
    }
}

impl BufRef {
    /// The buffer a `Buffer` or `View` reference addresses (`None` for a carry).
    pub fn buffer_id(&self) -> Option<u32> {
        match *self {
            BufRef::Buffer { buffer, .. } | BufRef::View { buffer, .. } => Some(buffer),
            BufRef::Carry { .. } => None,
        }
    }

    /// Whether what the reference addresses depends on the loop iteration.
    pub fn per_layer(&self) -> bool {
        match *self {
            BufRef::Buffer { layer, .. } => layer,
            BufRef::View { stride, .. } => stride != 0,
            BufRef::Carry { .. } => false,
        }
    }

    /// The bytes `(start, len)` a `Buffer` or `View` reference addresses, relative to the start
    /// of its buffer of `bytes` bytes whose dim 0 is `lead`, in loop iteration `layer` (`None`
    /// outside loops), for the rank at tp coordinate `tp_coord` (which only a ring offset
    /// reads). Every range is checked against the buffer; a carry is an error (the caller
    /// resolves carries through its loop's slots).
    pub fn range_in(&self, bytes: u64, lead: u64, layer: Option<usize>, tp_coord: u32) -> Result<(u64, u64), String> {
        match *self {
            BufRef::Buffer { layer: false, .. } => Ok((0, bytes)),
            BufRef::Buffer { buffer, layer: true } => {
                let i = layer.ok_or_else(|| format!("a layer slice of buffer {buffer} outside any loop"))? as u64;
                if i >= lead {
                    return Err(format!("layer {i} of buffer {buffer}, which has {lead}"));
                }
                let per = bytes / lead;
                Ok((i * per, per))
            }
            BufRef::View { buffer, offset, bytes: len, stride, ring } => {
                let i = match (stride, layer) {
                    (0, _) => 0,
                    (_, Some(i)) => i as u64,
                    (_, None) => return Err(format!("a per-layer view of buffer {buffer} outside any loop")),
                };
                let r = match ring {
                    Some(ring) => ring.bytes_at(tp_coord).map_err(|e| format!("the view of buffer {buffer}: {e}"))?,
                    None => 0,
                };
                let start = i.checked_mul(stride).and_then(|x| x.checked_add(offset)).and_then(|x| x.checked_add(r));
                match start.and_then(|s| s.checked_add(len)) {
                    Some(end) if end <= bytes => Ok((end - len, len)),
                    _ => Err(format!("the view of bytes {offset} + {i} * {stride} .. + {len} of buffer {buffer} ends past its {bytes} bytes")),
                }
            }
            BufRef::Carry { carry, .. } => Err(format!("carry {carry} is not a buffer range")),
        }
    }
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// One entry of a rank's schedule, executed in order on `stream`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Step {
    /// Launch kernel `kernel`: `inputs` bind its body's arguments, `outputs` its results.
    Launch { kernel: u32, inputs: Vec<BufRef>, outputs: Vec<BufRef>, stream: u32 },
    /// Copy `bytes` from `src` to `dst`.
    Copy { src: BufRef, dst: BufRef, bytes: u64, stream: u32 },
    /// Zero `bytes` of `dst`.
    Memset { dst: BufRef, bytes: u64, stream: u32 },
    /// Run `body` `count` times with layer index `i = 0..count` (or `count-1..=0` when
    /// `reverse`). Iteration `t` (0-based, in execution order) reads carry slot `c` from
    /// `carries[c][t % 2]` and writes it to `carries[c][(t + 1) % 2]`.
    ///
    /// `prefetch` (empty unless the graph's `repeat` has prefetched carries) computes the next
    /// iteration's prefetched carries from the next layer's slices: it runs once before the
    /// first iteration with the first layer's index (as iteration `-1`: its `out` carries are
    /// `carries[c][0]`), then at the top of every iteration `t` but the last, before `body`,
    /// with iteration `t + 1`'s layer index and iteration `t`'s carry slots.
    Loop {
        count: u32,
        reverse: bool,
        carries: Vec<[u32; 2]>,
        body: Vec<Step>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        prefetch: Vec<Step>,
    },
    /// One collective of an SPMD schedule (or a rank-local `take_shard`/`place_shard`), a step of
    /// its own: `output` gets `collective` of `input` over the `group` ranks that differ from
    /// this one only along `mesh_dim`. `input` is `in_shape` and `output` `out_shape`, both of
    /// `dtype`, row-major (the shapes are the IR value's, which may be a view of its buffer).
    Collective {
        collective: CollectiveOp,
        /// `dp_replicate`, `dp_shard` or `tp`.
        mesh_dim: String,
        /// Ranks along `mesh_dim` (the mesh's size of that dim).
        group: u32,
        /// The tensor dim gathered, scattered or sliced; absent for `all_reduce`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        dim: Option<u32>,
        /// `sum` or `max` for `all_reduce` and `reduce_scatter`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reduce: Option<ReduceOp>,
        dtype: DType,
        in_shape: Vec<u64>,
        out_shape: Vec<u64>,
        input: BufRef,
        output: BufRef,
        /// `ring_concat`: its operands after the first (`input`), in ring order.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        more_inputs: Vec<BufRef>,
        /// `ring_shift` and `ring_slice`: the rotation (rank `r` reads rank or slice
        /// `(r + shift) mod group`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shift: Option<u32>,
        /// Bytes this rank sends per call with ring algorithms (and receives as many):
        /// [`CollectiveOp::ring_send_bytes`].
        send_bytes: u64,
        stream: u32,
    },
}

/// What a [`Step::Collective`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveOp {
    /// Concatenate every rank's `input` along `dim`, in coordinate order.
    AllGather,
    /// Reduce every rank's `input` elementwise (in coordinate order); keep this rank's slice of `dim`.
    ReduceScatter,
    /// Reduce every rank's `input` elementwise (in coordinate order); every rank gets the result.
    AllReduce,
    /// Rank-local: this rank's slice of `dim` (no communication).
    TakeShard,
    /// Rank-local: `input` at this rank's slot of `dim`, zeros elsewhere (no communication).
    PlaceShard,
    /// Point to point: send `input` to the rank `shift` places back along the mesh dim,
    /// receive the `input` of the rank `shift` places ahead (`async-tp`'s micro-steps).
    RingShift,
    /// Rank-local: slice `(r + shift) mod group` of `dim` (no communication).
    RingSlice,
    /// Rank-local: `input`, then `more_inputs` (ring order) placed at slices `r, r + 1, ...`
    /// (mod `group`) of `dim` (no communication).
    RingConcat,
}

/// What a collective step does, without its operands: [`CollectiveOp::of_op`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollectiveSpec {
    pub op: CollectiveOp,
    /// `ring_shift` and `ring_slice`.
    pub shift: Option<u32>,
    pub mesh_dim: GraphMeshDim,
    /// Ranks along `mesh_dim`.
    pub group: u32,
    /// The tensor dim gathered, scattered or sliced (not for `all_reduce`).
    pub dim: Option<u32>,
    /// For `all_reduce` and `reduce_scatter`.
    pub reduce: Option<ReduceOp>,
}

/// The reduction of an `all_reduce` or `reduce_scatter`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReduceOp {
    Sum,
    Max,
}

impl CollectiveOp {
    pub fn name(self) -> &'static str {
        match self {
            CollectiveOp::AllGather => "all_gather",
            CollectiveOp::ReduceScatter => "reduce_scatter",
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::TakeShard => "take_shard",
            CollectiveOp::PlaceShard => "place_shard",
            CollectiveOp::RingShift => "ring_shift",
            CollectiveOp::RingSlice => "ring_slice",
            CollectiveOp::RingConcat => "ring_concat",
        }
    }

    /// Rank-local steps: no communication.
    pub fn is_rank_local(self) -> bool {
        matches!(self, CollectiveOp::TakeShard | CollectiveOp::PlaceShard | CollectiveOp::RingSlice | CollectiveOp::RingConcat)
    }

    /// Bytes each of `group` ranks sends per call (and receives as many) with the standard
    /// ring algorithms: `all_gather` `(n-1)/n` of its (full) output, `reduce_scatter` `(n-1)/n`
    /// of its (full) input, `all_reduce` `2(n-1)/n` of its input, `ring_shift` its input;
    /// rank-local ops send nothing.
    pub fn ring_send_bytes(self, group: u32, in_bytes: u64, out_bytes: u64) -> u64 {
        let n = u64::from(group.max(1));
        match self {
            CollectiveOp::AllGather => out_bytes / n * (n - 1),
            CollectiveOp::ReduceScatter => in_bytes / n * (n - 1),
            CollectiveOp::AllReduce => 2 * (in_bytes / n * (n - 1)),
            CollectiveOp::RingShift => in_bytes,
            CollectiveOp::TakeShard | CollectiveOp::PlaceShard | CollectiveOp::RingSlice | CollectiveOp::RingConcat => 0,
        }
    }

    /// The step of the IR op `op` (a collective, `take_shard` or `place_shard`) on `mesh`.
    pub fn of_op(op: &Op, mesh: &crate::placement::Mesh) -> Option<CollectiveSpec> {
        let red = |r: &CollectiveReduce| match r {
            CollectiveReduce::Sum => ReduceOp::Sum,
            CollectiveReduce::Max => ReduceOp::Max,
        };
        let spec = |op, mesh_dim, group, dim, reduce| CollectiveSpec { op, shift: None, mesh_dim, group, dim, reduce };
        Some(match op {
            Op::AllGather { mesh_dim, dim, size } => spec(CollectiveOp::AllGather, *mesh_dim, *size, Some(*dim), None),
            Op::ReduceScatter { mesh_dim, dim, size, reduce } => spec(CollectiveOp::ReduceScatter, *mesh_dim, *size, Some(*dim), Some(red(reduce))),
            Op::AllReduce { mesh_dim, reduce } => spec(CollectiveOp::AllReduce, *mesh_dim, mesh.size(*mesh_dim), None, Some(red(reduce))),
            Op::TakeShard { mesh_dim, dim, size } => spec(CollectiveOp::TakeShard, *mesh_dim, *size, Some(*dim), None),
            Op::PlaceShard { mesh_dim, dim, size } => spec(CollectiveOp::PlaceShard, *mesh_dim, *size, Some(*dim), None),
            Op::RingShift { mesh_dim, size, shift } => CollectiveSpec { shift: Some(*shift), ..spec(CollectiveOp::RingShift, *mesh_dim, *size, None, None) },
            Op::RingSlice { mesh_dim, dim, size, shift } => {
                CollectiveSpec { shift: Some(*shift), ..spec(CollectiveOp::RingSlice, *mesh_dim, *size, Some(*dim), None) }
            }
            Op::RingConcat { mesh_dim, dim, size } => spec(CollectiveOp::RingConcat, *mesh_dim, *size, Some(*dim), None),
            _ => return None,
        })
    }

    /// The IR op a collective step runs (its semantics are the interpreter's).
    pub fn to_op(self, mesh_dim: &str, group: u32, dim: Option<u32>, reduce: Option<ReduceOp>, shift: Option<u32>) -> Result<Op, String> {
        let m = GraphMeshDim::from_name(mesh_dim).ok_or_else(|| format!("unknown mesh dim `{mesh_dim}` (dp_replicate, dp_shard or tp)"))?;
        let dim = || dim.ok_or_else(|| format!("a `{}` step needs `dim`", self.name()));
        let reduce = || match reduce {
            Some(ReduceOp::Sum) => Ok(CollectiveReduce::Sum),
            Some(ReduceOp::Max) => Ok(CollectiveReduce::Max),
            None => Err(format!("a `{}` step needs `reduce`", self.name())),
        };
        Ok(match self {
            CollectiveOp::AllGather => Op::AllGather { mesh_dim: m, dim: dim()?, size: group },
            CollectiveOp::ReduceScatter => Op::ReduceScatter { mesh_dim: m, dim: dim()?, size: group, reduce: reduce()? },
            CollectiveOp::AllReduce => Op::AllReduce { mesh_dim: m, reduce: reduce()? },
            CollectiveOp::TakeShard => Op::TakeShard { mesh_dim: m, dim: dim()?, size: group },
            CollectiveOp::PlaceShard => Op::PlaceShard { mesh_dim: m, dim: dim()?, size: group },
            CollectiveOp::RingShift | CollectiveOp::RingSlice => {
                let shift = shift.filter(|&s| s < group).ok_or_else(|| format!("a `{}` step needs `shift` below its group of {group}", self.name()))?;
                if self == CollectiveOp::RingShift {
                    Op::RingShift { mesh_dim: m, size: group, shift }
                } else {
                    Op::RingSlice { mesh_dim: m, dim: dim()?, size: group, shift }
                }
            }
            CollectiveOp::RingConcat => Op::RingConcat { mesh_dim: m, dim: dim()?, size: group },
        })
    }
}

/// The schedule of one rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankSchedule {
    pub rank: u32,
    pub steps: Vec<Step>,
}

/// Training facts the runtime logs with (tokens per step, FLOPs per token for MFU).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainingInfo {
    pub batch: u64,
    pub seq_len: u64,
    pub vocab_size: u64,
    pub tokens_per_step: u64,
    /// `6 * N_non_embedding + 12 * n_layers * n_heads * head_dim * seq_len`.
    pub flops_per_token: u64,
}

/// Per-rank memory of an SPMD build, by what the bytes hold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankMemory {
    /// fp32 master weights and, in a bf16 build, their bf16 compute copies (this rank's shards).
    pub params: u64,
    /// AdamW moments.
    pub optimizer_state: u64,
    /// The planned activation arena (everything computed in the step, gradients included),
    /// which includes `gathered_weights`.
    pub activations: u64,
    /// `tokens`, `targets`, `step`.
    pub inputs: u64,
    /// Bytes of the buffers written by `all_gather`s over `dp_shard` (FSDP's gathered compute
    /// weights), part of `activations`.
    pub gathered_weights: u64,
    /// Of `gathered_weights`, the per-layer stacked buffers that stay live from the forward to
    /// the backward (the gathered weights saved as activations: no reshard after forward).
    pub gathered_weights_saved: u64,
    /// The sum of the arenas: the predicted peak of the step.
    pub peak: u64,
}

/// Communication of one mesh dimension per training step, per rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommVolume {
    pub mesh_dim: String,
    pub group: u32,
    /// Collective calls per step (loops counted `count` times).
    pub calls: u64,
    /// Bytes each rank sends per step (ring algorithms; it receives as many), by op.
    pub all_gather_bytes: u64,
    pub reduce_scatter_bytes: u64,
    pub all_reduce_bytes: u64,
    /// `async-tp`'s point-to-point `ring_shift` micro-steps (each sends its whole operand).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ring_shift_bytes: u64,
}

impl CommVolume {
    pub fn total_bytes(&self) -> u64 {
        self.all_gather_bytes + self.reduce_scatter_bytes + self.all_reduce_bytes + self.ring_shift_bytes
    }
}

/// The build report of an SPMD artifact: what one rank holds and sends per step (every rank
/// runs the same schedule on shards of equal size, so one rank stands for all).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshReport {
    pub memory: RankMemory,
    /// One entry per mesh dim of more than one rank, outermost first.
    pub comm: Vec<CommVolume>,
}

/// `manifest.json`. `format_version` is the first field so any reader can check it first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub titan_version: String,
    /// Hex SHA-256 of the input IR text, the effective build options and the target.
    pub content_hash: String,
    /// Hex SHA-256 of the model graph before partitioning and the training options, not the
    /// mesh or any build choice: a checkpoint of a build with the same model hash resumes on
    /// this one (`docs/checkpoints.md`). Absent in artifacts before format version 5.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_hash: Option<String>,
    pub target: Target,
    /// The model graph's `meta` (dim, n_layers, ...), as JSON values.
    pub model: BTreeMap<String, serde_json::Value>,
    /// Named dims and their sizes (`batch`, `seq`).
    pub dims: BTreeMap<String, u64>,
    pub mesh: Mesh,
    pub training: TrainingInfo,
    pub buffers: Vec<Buffer>,
    pub memory: MemoryPlan,
    pub kernels: Vec<Kernel>,
    /// One schedule per rank; an SPMD artifact has one schedule that every rank runs (`rank 0`).
    pub ranks: Vec<RankSchedule>,
    /// Per-rank memory and communication of an SPMD artifact; absent on one device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<MeshReport>,
    /// The eval step (forward and loss, no backward or optimizer) over the same memory plan;
    /// absent before format version 6 and in builds without one (float8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<EvalStep>,
    /// The build-time switches (`TITAN_ATT_*`, ...: environment variables that change generated
    /// kernels, for comparisons) set when it was built, also in `content_hash`; absent when none
    /// was, as in every ordinary build.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub build_switches: BTreeMap<String, String>,
}

/// The eval step: its own buffer table, kernels and schedule, run between training steps.
/// Its `param` buffers are the training plan's masters (same state name, dtype, shape, arena and
/// offset), its `input` buffers the training plan's `tokens` and `targets`; every other buffer
/// is an `activation` placed in the training plan's `activations` arena, which holds nothing
/// live between steps. Buffer and kernel ids are positions in this step's own lists; kernel
/// bodies are blocks of [`EVAL_GRAPH_FILE`], kernel files live in `kernels/` with the training
/// ones (names start with `eval_`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalStep {
    pub buffers: Vec<Buffer>,
    /// Bytes of the `activations` arena the eval step uses (at most the arena's size).
    pub activation_bytes: u64,
    pub kernels: Vec<Kernel>,
    /// The schedule every rank runs (SPMD, like `ranks[0]`).
    pub steps: Vec<Step>,
}

/// Why an artifact cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("cannot read `{path}`: {message}")]
    Io { path: String, message: String },
    #[error("`{path}` is not a titan manifest: {message}")]
    Malformed { path: String, message: String },
    #[error(
        "artifact format version {found} is not supported by this titan-run (reads versions {MIN_FORMAT_VERSION} to {expected}); rebuild it with this version's titanc"
    )]
    Version { found: u32, expected: u32 },
    #[error("artifact was built for {found}, this runtime targets {expected}; rebuild with `titanc build --target {expected}`")]
    Target { found: String, expected: String },
    #[error("invalid artifact: {0}")]
    Invalid(String),
}

impl Mesh {
    /// The tp degree (1 without a `tp` dim).
    pub fn tp(&self) -> u32 {
        self.dims.iter().find(|d| d.name == "tp").map_or(1, |d| d.size.max(1))
    }

    /// Rank `rank`'s coordinate along `tp`, the innermost mesh dim (what a view's
    /// [`RingOffset`] reads).
    pub fn tp_coord(&self, rank: usize) -> u32 {
        (rank % self.tp() as usize) as u32
    }
}

impl Manifest {
    /// Serialize deterministically (pretty JSON, trailing newline).
    pub fn to_json(&self) -> String {
        let mut s = serde_json::to_string_pretty(self).expect("invariant: a manifest always serializes");
        s.push('\n');
        s
    }

    /// Parse, checking `format_version` before anything else so an old or new artifact gets a
    /// version error rather than a field error.
    pub fn from_json(path: &str, text: &str) -> Result<Manifest, ArtifactError> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| ArtifactError::Malformed { path: path.into(), message: e.to_string() })?;
        let found = v
            .get("format_version")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| ArtifactError::Malformed { path: path.into(), message: "missing `format_version`".into() })?;
        if !(u64::from(MIN_FORMAT_VERSION)..=u64::from(FORMAT_VERSION)).contains(&found) {
            return Err(ArtifactError::Version { found: found as u32, expected: FORMAT_VERSION });
        }
        serde_json::from_value(v).map_err(|e| ArtifactError::Malformed { path: path.into(), message: e.to_string() })
    }
}

/// One run of a loop's steps, in execution order (see [`Step::Loop`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoopRun {
    /// Run the loop's `prefetch` steps (else its `body`).
    pub prefetch: bool,
    /// The layer index `i` that `layer` slices resolve to.
    pub layer: usize,
    /// The iteration whose carry slots `carry` references resolve to: `in` is
    /// `carries[c][t % 2]`, `out` `carries[c][(t + 1) % 2]`. The prologue runs as iteration
    /// `-1`, written here as 1 (the same parity: its `out` slot is `carries[c][0]`).
    pub t: usize,
}

/// The runs of a loop of `count` iterations, with `prefetch` steps or not: the prologue
/// prefetch (the first layer), then per iteration `t` the prefetch of iteration `t + 1`'s
/// layer (but in the last) followed by the body.
pub fn loop_runs(count: u32, reverse: bool, prefetch: bool) -> Vec<LoopRun> {
    let count = count as usize;
    let layer = |t: usize| if reverse { count - 1 - t } else { t };
    let mut runs = Vec::with_capacity(if prefetch { 2 * count } else { count });
    if prefetch && count > 0 {
        runs.push(LoopRun { prefetch: true, layer: layer(0), t: 1 });
    }
    for t in 0..count {
        if prefetch && t + 1 < count {
            runs.push(LoopRun { prefetch: true, layer: layer(t + 1), t });
        }
        runs.push(LoopRun { prefetch: false, layer: layer(t), t });
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Views resolve like the layer slices they generalize, serialize with all four fields (and
    /// plain references unchanged), and a range past the buffer is an error, not a panic.
    #[test]
    fn offset_views_resolve_and_round_trip() {
        let layer = BufRef::Buffer { buffer: 3, layer: true };
        let view = BufRef::View { buffer: 3, offset: 8, bytes: 4, stride: 16, ring: None };
        assert_eq!(layer.range_in(48, 3, Some(2), 0), Ok((32, 16)));
        assert_eq!(view.range_in(48, 3, Some(2), 0), Ok((40, 4)));
        assert!(view.range_in(48, 3, None, 0).is_err_and(|e| e.contains("outside any loop")));
        let fixed = BufRef::View { buffer: 3, offset: 40, bytes: 8, stride: 0, ring: None };
        assert_eq!(fixed.range_in(48, 3, None, 0), Ok((40, 8)));
        assert!(
            BufRef::View { buffer: 3, offset: 44, bytes: 8, stride: 0, ring: None }
                .range_in(48, 3, None, 0)
                .is_err_and(|e| e.contains("ends past its 48 bytes"))
        );
        assert!(BufRef::View { buffer: 3, offset: 0, bytes: 8, stride: u64::MAX, ring: None }.range_in(48, 3, Some(2), 0).is_err());
        // A ring view: chunk `(c + shift) mod size` of 4 chunks of 8 bytes, in layer 1's slice.
        let ring = BufRef::View { buffer: 3, offset: 0, bytes: 8, stride: 32, ring: Some(RingOffset { size: 4, shift: 3, step: 8 }) };
        let at = |c: u32| ring.range_in(64, 2, Some(1), c);
        assert_eq!((at(0), at(1), at(2), at(3)), (Ok((56, 8)), Ok((32, 8)), Ok((40, 8)), Ok((48, 8))));
        assert!(at(4).is_err_and(|e| e.contains("tp coordinate 4")));
        for r in [layer, view, ring, BufRef::Buffer { buffer: 1, layer: false }, BufRef::Carry { carry: 0, out: true }] {
            let json = serde_json::to_string(&r).expect("json");
            assert_eq!(serde_json::from_str::<BufRef>(&json).expect("back"), r, "{json}");
        }
        assert_eq!(serde_json::to_string(&view).expect("json"), r#"{"buffer":3,"offset":8,"bytes":4,"stride":16}"#);
        assert_eq!(view.buffer_id(), Some(3));
        assert!(view.per_layer() && !fixed.per_layer());
    }

    /// Forward and reverse, with and without prefetch: the prologue fetches the first layer into
    /// slot 0, iteration `t` fetches layer `t + 1`'s into slot `(t + 1) % 2` (none in the last),
    /// and each layer is fetched exactly once.
    #[test]
    fn loop_runs_prefetch_each_layer_once_ahead_of_its_iteration() {
        let run = |prefetch, layer, t| LoopRun { prefetch, layer, t };
        assert_eq!(loop_runs(3, false, false), [run(false, 0, 0), run(false, 1, 1), run(false, 2, 2)]);
        assert_eq!(loop_runs(3, true, true), [run(true, 2, 1), run(true, 1, 0), run(false, 2, 0), run(true, 0, 1), run(false, 1, 1), run(false, 0, 2)]);
        for (count, reverse) in [(1, false), (2, true), (5, false), (6, true)] {
            let runs = loop_runs(count, reverse, true);
            let mut fetched: Vec<usize> = runs.iter().filter(|r| r.prefetch).map(|r| r.layer).collect();
            fetched.sort_unstable();
            assert_eq!(fetched, (0..count as usize).collect::<Vec<_>>());
            // A prefetch writes the slot its layer's body then reads.
            for (i, r) in runs.iter().enumerate().filter(|(_, r)| r.prefetch) {
                let body = runs[i..].iter().find(|b| !b.prefetch && b.layer == r.layer).expect("the layer runs later");
                assert_eq!((r.t + 1) % 2, body.t % 2);
            }
        }
        assert!(loop_runs(0, false, true).is_empty());
    }
}
