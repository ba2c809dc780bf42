//! Shard geometry: where one rank's shard of a state lies in the full tensor ([`ShardBox`]),
//! its parts in the per-layer checkpoint tensors, and the contiguous runs of a box that reads
//! and writes go through.

use titan_ir::{Mesh, Placement};

use super::CheckpointError;
use super::hf_names::hf_name;

/// Where one rank's shard of a state lies in the full (single-device) tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardBox {
    /// The full tensor's shape.
    pub full: Vec<usize>,
    /// The shard's first element's index along every dim.
    pub offset: Vec<usize>,
    /// The shard's shape (the rank's state shape).
    pub shape: Vec<usize>,
    /// Whether this rank writes the shard to a checkpoint: the first replica of it, at
    /// coordinate 0 along every mesh dim the state is replicated on.
    pub writer: bool,
}

/// The shard of state `name` (shape `local` on each rank, `placement` on `mesh`) that the rank at
/// `coords` holds. Along every mesh dim of more than one rank where the state is `Shard(d)`,
/// dim `d` is split in equal parts, outer mesh dims first (the rule of the initialization,
/// `cpu_graph::init_state_shard`, and of `sim_mesh`'s gather).
pub fn shard_box(name: &str, local: &[usize], placement: &[Placement], mesh: Mesh, coords: [usize; 3]) -> Result<ShardBox, CheckpointError> {
    let mut full = local.to_vec();
    let mut cuts = Vec::new();
    let mut writer = true;
    for (m, &size) in mesh.sizes.iter().enumerate() {
        let n = size as usize;
        if n <= 1 {
            continue;
        }
        match placement.get(m).unwrap_or(&Placement::Replicate) {
            Placement::Shard(d) => {
                let d = *d as usize;
                let dim = full
                    .get_mut(d)
                    .ok_or_else(|| CheckpointError::Mismatch(format!("state `{name}` is sharded along dim {d}, which its shape {local:?} does not have")))?;
                *dim *= n;
                cuts.push((d, n, coords[m]));
            }
            Placement::Replicate => writer &= coords[m] == 0,
            Placement::Partial => {
                return Err(CheckpointError::Mismatch(format!(
                    "state `{name}` is a partial sum on the mesh; a checkpoint needs every state sharded or replicated"
                )));
            }
        }
    }
    let mut offset = vec![0; full.len()];
    let mut len = full.clone();
    for (d, n, c) in cuts {
        len[d] /= n;
        offset[d] += c * len[d];
    }
    Ok(ShardBox { full, offset, shape: local.to_vec(), writer })
}

/// The shard `b` of the full tensor `full` (row-major values of shape `b.full`).
pub fn shard_values(b: &ShardBox, full: &[f32]) -> Result<Vec<f32>, CheckpointError> {
    let numel: usize = b.full.iter().product();
    if full.len() != numel {
        return Err(CheckpointError::Mismatch(format!("a tensor of shape {:?} has {numel} elements, {} were given", b.full, full.len())));
    }
    let mut out = vec![0.0f32; b.shape.iter().product()];
    for_each_run(&b.full, &b.offset, &b.shape, &mut |src, dst, len| {
        out[dst..dst + len].copy_from_slice(&full[src..src + len]);
        Ok(())
    })?;
    Ok(out)
}

/// The parts of a shard in the checkpoint tensors of its state (one per layer it holds of a
/// stacked state): the HF name, that tensor's shape, the shard's box in it (offset, shape) and
/// where the part starts among the shard's elements.
pub(super) type BoxPart = (String, Vec<usize>, Vec<usize>, Vec<usize>, usize);

pub(super) fn box_parts(name: &str, b: &ShardBox) -> Result<Vec<BoxPart>, CheckpointError> {
    if !name.contains("{i}") {
        return Ok(vec![(hf_name(name), b.full.clone(), b.offset.clone(), b.shape.clone(), 0)]);
    }
    if b.full.is_empty() {
        return Err(CheckpointError::Mismatch(format!("stacked state `{name}` is a scalar; it needs a leading layer dim")));
    }
    let per: usize = b.shape[1..].iter().product();
    let (first, count) = (b.offset[0], b.shape[0]);
    Ok((first..first + count)
        .map(|l| (hf_name(&name.replace("{i}", &l.to_string())), b.full[1..].to_vec(), b.offset[1..].to_vec(), b.shape[1..].to_vec(), (l - first) * per))
        .collect())
}

/// Call `f(element index in the tensor, element index in the box, length)` for every contiguous
/// run of the box (`offset`, `shape`) of a row-major tensor of shape `full`, in the box's
/// row-major order. Inner dims the box covers whole merge into one run.
pub(super) fn for_each_run(
    full: &[usize],
    offset: &[usize],
    shape: &[usize],
    f: &mut dyn FnMut(usize, usize, usize) -> Result<(), CheckpointError>,
) -> Result<(), CheckpointError> {
    if shape.contains(&0) {
        return Ok(());
    }
    let n = full.len();
    // Dims `whole..` are covered whole by the box.
    let mut whole = n;
    while whole > 0 && shape[whole - 1] == full[whole - 1] {
        whole -= 1;
    }
    let inner: usize = full[whole..].iter().product();
    // A run spans dim `whole - 1` partly (when there is one) and the dims after it whole.
    let (outer, run) = if whole == 0 { (0, inner) } else { (whole - 1, shape[whole - 1] * inner) };
    let mut strides = vec![1; n];
    for d in (0..n.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * full[d + 1];
    }
    let partial = if whole == 0 { 0 } else { offset[whole - 1] * strides[whole - 1] };
    let count: usize = shape[..outer].iter().product();
    let mut idx = vec![0; outer];
    for i in 0..count {
        let src = partial + (0..outer).map(|d| (offset[d] + idx[d]) * strides[d]).sum::<usize>();
        f(src, i * run, run)?;
        for d in (0..outer).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(())
}
