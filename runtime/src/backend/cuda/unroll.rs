//! The schedule unrolled at load: device addresses of the arenas, buffer references resolved
//! (layer slices, carry ping-pong, a loop's prefetch steps) and every loop flattened into one
//! list of launches, copies, memsets and collective steps.

use titan_ir::DType;
use titan_ir::artifact::{BufRef, Buffer, Kernel, Step};

use super::{bad, collective, comm_profile, slot};
use crate::RuntimeError;
use crate::artifact::Artifact;

/// One entry of the unrolled schedule.
pub(super) enum Op {
    Launch {
        kernel: usize,
        ins: Vec<u64>,
        outs: Vec<u64>,
        at: String,
    },
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
        at: String,
    },
    Memset {
        dst: u64,
        bytes: usize,
        at: String,
    },
    /// A collective step (or a rank-local `take_shard`/`place_shard`/`ring_slice`/`ring_concat`):
    /// its planned actions on `input`/`output`, `ring_concat`'s `more` operands (and the shared
    /// staging buffer) over mesh dim `mesh_dim`.
    Collective {
        plan: collective::Plan,
        input: u64,
        output: u64,
        more: Vec<u64>,
        mesh_dim: usize,
        dtype: DType,
        at: String,
        /// For `--profile`: what it moves.
        info: comm_profile::CollectiveInfo,
    },
}

/// Where a step sits: `step 4.2 (layer 1)`.
fn loc(path: &[usize], layer: Option<usize>) -> String {
    let p: Vec<String> = path.iter().map(|i| i.to_string()).collect();
    match layer {
        Some(l) => format!("schedule step {}, layer {l}", p.join(".")),
        None => format!("schedule step {}", p.join(".")),
    }
}

/// The loop iteration a step runs in.
#[derive(Clone, Copy)]
pub(super) struct Frame<'s> {
    pub(super) layer: usize,
    pub(super) t: usize,
    pub(super) carries: &'s [[u32; 2]],
}

/// Which tables a schedule's buffer and kernel ids index: the training step's
/// (`manifest.buffers`, `manifest.kernels`) or the eval step's (`manifest.eval`), whose
/// buffers lie in the same arenas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Table {
    Train,
    Eval,
}

/// Device addresses of the arenas, resolving buffer references like the CPU backend.
pub(super) struct Arenas<'a> {
    pub(super) artifact: &'a Artifact,
    pub(super) base: [u64; 4],
    pub(super) bytes: [u64; 4],
    /// This rank's coordinates in the mesh (zeros on one GPU).
    pub(super) coords: [usize; 3],
    /// The schedule whose ids [`Arenas::view`] and [`Arenas::unroll`] resolve.
    pub(super) table: Table,
}

impl<'a> Arenas<'a> {
    /// The same arenas, resolving the ids of `table`'s schedule.
    pub(super) fn with_table(&self, table: Table) -> Arenas<'a> {
        Arenas { artifact: self.artifact, base: self.base, bytes: self.bytes, coords: self.coords, table }
    }

    /// The kernels of this table (empty for an eval table of an artifact without an eval step).
    pub(super) fn kernels(&self) -> &'a [Kernel] {
        match self.table {
            Table::Train => &self.artifact.manifest.kernels,
            Table::Eval => self.artifact.manifest.eval.as_ref().map_or(&[], |e| &e.kernels),
        }
    }

    /// The position in [`Arenas::kernels`] of kernel `id` (an eval kernel's id is its position).
    pub(super) fn kernel_pos(&self, id: u32) -> Option<usize> {
        match self.table {
            Table::Train => self.artifact.kernel_pos(id),
            Table::Eval => Some(id as usize).filter(|&i| i < self.kernels().len()),
        }
    }

    fn buffer(&self, id: u32) -> Option<&'a Buffer> {
        match self.table {
            Table::Train => self.artifact.buffer(id),
            Table::Eval => self.artifact.eval_buffer(id),
        }
    }

    /// `(address, bytes)` of the whole of buffer `b`.
    pub(super) fn whole(&self, b: &Buffer) -> Result<(u64, u64), RuntimeError> {
        let a = slot(b.arena);
        if b.offset.checked_add(b.bytes).is_none_or(|end| end > self.bytes[a]) {
            return Err(bad(format!("buffer {} (`{}`) lies outside its arena", b.id, b.name)));
        }
        Ok((self.base[a] + b.offset, b.bytes))
    }

    pub(super) fn view(&self, r: &BufRef, frame: Option<Frame<'_>>) -> Result<(u64, u64), RuntimeError> {
        let buffer = |id: u32| self.buffer(id).ok_or_else(|| bad(format!("buffer {id} does not exist")));
        match *r {
            BufRef::Buffer { buffer: id, .. } | BufRef::View { buffer: id, .. } => {
                let b = buffer(id)?;
                let (p, len) = self.whole(b)?;
                let lead = b.shape.first().copied().unwrap_or(0);
                let (o, n) = r.range_in(len, lead, frame.map(|f| f.layer), self.coords[2] as u32).map_err(bad)?;
                Ok((p + o, n))
            }
            BufRef::Carry { carry, out } => {
                let f = frame.ok_or_else(|| bad(format!("carry {carry} outside any loop")))?;
                let pair = f.carries.get(carry as usize).ok_or_else(|| bad(format!("carry {carry} does not exist")))?;
                self.whole(buffer(pair[(f.t + usize::from(out)) % 2])?)
            }
        }
    }

    /// Unroll `steps` into `ops`.
    /// `ext` gets, per op, the byte ranges it touches and how many of them (the first) it only
    /// reads (for ordering collectives, `join_points`).
    pub(super) fn unroll(
        &self,
        steps: &[Step],
        frame: Option<Frame<'_>>,
        path: &mut Vec<usize>,
        ops: &mut Vec<Op>,
        ext: &mut Vec<(Vec<(u64, u64)>, usize)>,
    ) -> Result<(), RuntimeError> {
        for (i, step) in steps.iter().enumerate() {
            path.push(i);
            let at = loc(path, frame.map(|f| f.layer));
            match step {
                Step::Launch { kernel, inputs, outputs, .. } => {
                    let pos = self.kernel_pos(*kernel).ok_or_else(|| bad(format!("{at}: kernel {kernel} does not exist")))?;
                    let ins = inputs.iter().map(|r| self.view(r, frame)).collect::<Result<Vec<_>, _>>()?;
                    let outs = outputs.iter().map(|r| self.view(r, frame)).collect::<Result<Vec<_>, _>>()?;
                    ext.push((ins.iter().chain(&outs).copied().collect(), ins.len()));
                    ops.push(Op::Launch { kernel: pos, ins: ins.iter().map(|v| v.0).collect(), outs: outs.iter().map(|v| v.0).collect(), at });
                }
                Step::Copy { src, dst, bytes, .. } => {
                    let (s, d) = (self.view(src, frame)?, self.view(dst, frame)?);
                    if *bytes > s.1 || *bytes > d.1 {
                        return Err(bad(format!("{at}: a copy of {bytes} bytes between buffers of {} and {} bytes", s.1, d.1)));
                    }
                    let bytes = usize::try_from(*bytes).map_err(|_| bad(format!("{at}: copy too large")))?;
                    if bytes > 0 {
                        ext.push((vec![(s.0, bytes as u64), (d.0, bytes as u64)], 1));
                        ops.push(Op::Copy { dst: d.0, src: s.0, bytes, at });
                    }
                }
                Step::Memset { dst, bytes, .. } => {
                    let d = self.view(dst, frame)?;
                    if *bytes > d.1 {
                        return Err(bad(format!("{at}: a memset of {bytes} bytes on a buffer of {} bytes", d.1)));
                    }
                    let bytes = usize::try_from(*bytes).map_err(|_| bad(format!("{at}: memset too large")))?;
                    if bytes > 0 {
                        ext.push((vec![(d.0, bytes as u64)], 0));
                        ops.push(Op::Memset { dst: d.0, bytes, at });
                    }
                }
                Step::Collective { collective, mesh_dim, group, dim, reduce, dtype, in_shape, out_shape, input, output, more_inputs, shift, .. } => {
                    let m = titan_ir::MeshDim::from_name(mesh_dim).ok_or_else(|| bad(format!("{at}: unknown mesh dim `{mesh_dim}`")))?.index();
                    let shape = collective::StepShape {
                        collective: *collective,
                        group: u64::from(*group),
                        dim: *dim,
                        reduce: *reduce,
                        shift: *shift,
                        more_inputs: more_inputs.len(),
                        dtype: *dtype,
                        in_shape,
                        out_shape,
                    };
                    let plan =
                        collective::plan(&shape, self.coords[m] as u64).map_err(|e| bad(format!("{at}: `{}` over {mesh_dim}: {e}", collective.name())))?;
                    let (i, o) = (self.view(input, frame)?, self.view(output, frame)?);
                    let e = dtype.size_bytes() as u64;
                    let (ni, no) = (in_shape.iter().product::<u64>() * e, out_shape.iter().product::<u64>() * e);
                    if ni > i.1 || no > o.1 {
                        return Err(bad(format!("{at}: `{}` reads {ni} and writes {no} bytes, its buffers hold {} and {}", collective.name(), i.1, o.1)));
                    }
                    let more = more_inputs.iter().map(|r| self.view(r, frame)).collect::<Result<Vec<_>, _>>()?;
                    if let Some(m) = more.iter().find(|m| ni > m.1) {
                        return Err(bad(format!("{at}: `{}` reads {ni} bytes from each operand, one holds {}", collective.name(), m.1)));
                    }
                    let mut ranges: Vec<(u64, u64)> = std::iter::once(i.0).chain(more.iter().map(|m| m.0)).map(|a| (a, ni)).collect();
                    ranges.push((o.0, no));
                    ext.push((ranges, 1 + more.len()));
                    let dim_name = titan_ir::MeshDim::from_name(mesh_dim).map_or("?", titan_ir::MeshDim::name);
                    let info = comm_profile::CollectiveInfo { op: collective.name(), dim: dim_name, bytes: ni.max(no), at: at.clone() };
                    ops.push(Op::Collective { plan, input: i.0, output: o.0, more: more.iter().map(|m| m.0).collect(), mesh_dim: m, dtype: *dtype, at, info });
                }
                Step::Loop { count, reverse, carries, body, prefetch } => {
                    // The next layer's gathers are unrolled at the top of each iteration, so
                    // the comm stream runs them while this layer computes.
                    for run in titan_ir::artifact::loop_runs(*count, *reverse, !prefetch.is_empty()) {
                        let steps = if run.prefetch { prefetch } else { body };
                        self.unroll(steps, Some(Frame { layer: run.layer, t: run.t, carries }), path, ops, ext)?;
                    }
                }
            }
            path.pop();
        }
        Ok(())
    }
}
