//! Semantics of the collective ops (`all_gather`, `reduce_scatter`, `all_reduce`) on top of a
//! [`Communicator`]: the one primitive a mesh backend provides is an ordered exchange among the
//! ranks of one mesh dimension; every reduction is then computed identically on every rank, in
//! rank order, so results are deterministic and bit-identical across ranks. The rank-local
//! `take_shard` and `place_shard` only read the rank's coordinate.

use crate::interp::Real;
use crate::interp::round::round_to_dtype;
use crate::interp::tensor::{Data, Tensor};
use crate::interp::{Precision, is_narrow_float};
use crate::op::{CollectiveReduce, Op};
use crate::placement::MeshDim;

/// A rank's view of the device mesh. Implementations connect the ranks of one mesh dimension;
/// every rank of a group must call [`Communicator::exchange`] the same number of times, in the
/// same order (the collective safety check proves this for SPMD graphs).
pub trait Communicator: Send + Sync {
    /// The size of each mesh dimension, indexed by [`MeshDim::index`].
    fn sizes(&self) -> [usize; 3];
    /// This rank's coordinate along each mesh dimension.
    fn coords(&self) -> [usize; 3];
    /// Contribute `data` to the group of ranks that differ from this one only along `mesh_dim`,
    /// and return every member's contribution ordered by its coordinate along `mesh_dim`.
    fn exchange(&self, mesh_dim: MeshDim, data: Vec<f64>) -> Result<Vec<Vec<f64>>, String>;

    /// The point-to-point transfer of `ring_shift`: send `data` to the rank `shift` places
    /// back along `mesh_dim` and return what the rank `shift` places ahead sent. Every rank of
    /// the group calls it with the same `shift`. The default runs it as one [`exchange`]
    /// (every rank keeps only its source's part): the CPU meshes' transport has no cheaper
    /// pairwise path (the TCP process group routes every exchange through rank 0's hub).
    ///
    /// [`exchange`]: Communicator::exchange
    fn shift(&self, mesh_dim: MeshDim, data: Vec<f64>, shift: usize) -> Result<Vec<f64>, String> {
        let n = self.sizes()[mesh_dim.index()];
        let from = (self.coords()[mesh_dim.index()] + shift) % n.max(1);
        let mut parts = self.exchange(mesh_dim, data)?;
        if parts.len() != n {
            return Err(format!("ring_shift over {mesh_dim}: {} of {n} ranks answered", parts.len()));
        }
        Ok(std::mem::take(&mut parts[from]))
    }
}

/// Split `shape` around `dim`: (product of the dims before, dim size, product after).
fn split(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    (shape[..dim].iter().product(), shape[dim], shape[dim + 1..].iter().product())
}

fn floats<T: Real>(t: &Tensor<T>) -> Result<&[T], String> {
    t.floats().ok_or_else(|| "collectives take float tensors".to_string())
}

/// Evaluate one collective op on this rank's operand.
pub fn eval_collective<T: Real>(op: &Op, x: &Tensor<T>, comm: &dyn Communicator, precision: Precision) -> Result<Tensor<T>, String> {
    let mesh_dim = op.mesh_dim().ok_or_else(|| format!("`{}` is not a collective", op.name()))?;
    let group = comm.sizes()[mesh_dim.index()];
    let check_size = |size: u32| -> Result<(), String> {
        if size as usize == group { Ok(()) } else { Err(format!("`{}` has size = {size} but mesh dim {mesh_dim} has {group} ranks", op.name())) }
    };
    // Rank-local ops: no exchange (they are not in the collective schedule).
    match op {
        Op::TakeShard { dim, size, .. } => {
            check_size(*size)?;
            return shard_of(x, *dim as usize, group, comm.coords()[mesh_dim.index()]).map_err(|e| format!("take_shard: {e}"));
        }
        Op::PlaceShard { dim, size, .. } => {
            check_size(*size)?;
            return place_shard(x, *dim as usize, group, comm.coords()[mesh_dim.index()]);
        }
        Op::RingSlice { dim, size, shift, .. } => {
            check_size(*size)?;
            let coord = (comm.coords()[mesh_dim.index()] + *shift as usize) % group;
            return shard_of(x, *dim as usize, group, coord).map_err(|e| format!("ring_slice: {e}"));
        }
        Op::RingShift { size, shift, .. } => {
            check_size(*size)?;
            let xs = floats(x)?;
            let got = comm.shift(mesh_dim, xs.iter().map(|&v| Real::to_f64(v)).collect(), *shift as usize)?;
            if got.len() != xs.len() {
                return Err(format!("ring_shift over {mesh_dim}: the ranks sent tensors of different sizes"));
            }
            return Tensor::from_vec(x.dtype, x.shape.clone(), got.into_iter().map(T::from_f64).collect());
        }
        Op::RingConcat { .. } => return Err("ring_concat takes one operand per rank; evaluate it with eval_mesh_op".into()),
        _ => {}
    }
    let xs = floats(x)?;
    let parts = comm.exchange(mesh_dim, xs.iter().map(|&v| Real::to_f64(v)).collect())?;
    if parts.len() != group || parts.iter().any(|p| p.len() != xs.len()) {
        return Err(format!("`{}` over {mesh_dim}: the ranks contributed tensors of different sizes", op.name()));
    }
    let reduce = |kind: CollectiveReduce| -> Vec<T> {
        let mut acc: Vec<T> = parts[0].iter().map(|&v| T::from_f64(v)).collect();
        for p in &parts[1..] {
            for (a, &v) in acc.iter_mut().zip(p) {
                let v = T::from_f64(v);
                *a = match kind {
                    CollectiveReduce::Sum => *a + v,
                    CollectiveReduce::Max => a.max(v),
                };
            }
        }
        if precision == Precision::Emulate && is_narrow_float(x.dtype) {
            for a in acc.iter_mut() {
                *a = T::from_f64(f64::from(round_to_dtype(Real::to_f64(*a) as f32, x.dtype)));
            }
        }
        acc
    };
    match op {
        Op::AllReduce { reduce: kind, .. } => Tensor::from_vec(x.dtype, x.shape.clone(), reduce(*kind)),
        Op::AllGather { dim, size, .. } => {
            check_size(*size)?;
            let d = *dim as usize;
            if d >= x.rank() {
                return Err(format!("all_gather: dim {d} is out of range for {}", x.type_string()));
            }
            let (outer, n, inner) = split(&x.shape, d);
            let mut out = Vec::with_capacity(xs.len() * group);
            for o in 0..outer {
                for p in &parts {
                    out.extend(p[o * n * inner..(o + 1) * n * inner].iter().map(|&v| T::from_f64(v)));
                }
            }
            let mut shape = x.shape.clone();
            shape[d] = n * group;
            Tensor::from_vec(x.dtype, shape, out)
        }
        Op::ReduceScatter { dim, size, reduce: kind, .. } => {
            check_size(*size)?;
            let d = *dim as usize;
            if d >= x.rank() || !x.shape[d].is_multiple_of(group) {
                return Err(format!("reduce_scatter: dim {d} of {} is not divisible by {group}", x.type_string()));
            }
            let full = reduce(*kind);
            let (outer, n, inner) = split(&x.shape, d);
            let local = n / group;
            let r = comm.coords()[mesh_dim.index()];
            let mut out = Vec::with_capacity(xs.len() / group);
            for o in 0..outer {
                let start = (o * n + r * local) * inner;
                out.extend_from_slice(&full[start..start + local * inner]);
            }
            let mut shape = x.shape.clone();
            shape[d] = local;
            Tensor::from_vec(x.dtype, shape, out)
        }
        _ => Err(format!("`{}` is not a collective", op.name())),
    }
}

/// Evaluate a collective or rank-local op on this rank's operands: [`eval_collective`], and
/// `ring_concat`, whose `size` operands are the chunks in ring order (this rank's first).
pub fn eval_mesh_op<T: Real>(op: &Op, inputs: &[&Tensor<T>], comm: &dyn Communicator, precision: Precision) -> Result<Tensor<T>, String> {
    let Op::RingConcat { mesh_dim, dim, size } = op else {
        let x = inputs.first().ok_or_else(|| format!("`{}` has no operand", op.name()))?;
        return eval_collective(op, x, comm, precision);
    };
    let group = comm.sizes()[mesh_dim.index()];
    if *size as usize != group || inputs.len() != group {
        return Err(format!("`ring_concat` has size = {size} and {} operands but mesh dim {mesh_dim} has {group} ranks", inputs.len()));
    }
    let me = comm.coords()[mesh_dim.index()];
    // Rank order: slice `k` is the chunk computed at ring step `(k - me) mod group`.
    let ordered: Vec<Tensor<T>> = (0..group).map(|k| inputs[(k + group - me) % group].clone()).collect();
    concat(&ordered, *dim as usize).map_err(|e| format!("ring_concat: {e}"))
}

/// The slice of `full` that rank `coord` of `size` holds when dim `dim` is sharded.
pub fn shard_of<T: Real>(full: &Tensor<T>, dim: usize, size: usize, coord: usize) -> Result<Tensor<T>, String> {
    if dim >= full.rank() || size == 0 || !full.shape[dim].is_multiple_of(size) || coord >= size {
        return Err(format!("cannot take shard {coord} of {size} along dim {dim} of {}", full.type_string()));
    }
    let (outer, n, inner) = split(&full.shape, dim);
    let local = n / size;
    let mut shape = full.shape.clone();
    shape[dim] = local;
    match &full.data {
        Data::Float(xs) => {
            let mut out = Vec::with_capacity(outer * local * inner);
            for o in 0..outer {
                let start = (o * n + coord * local) * inner;
                out.extend_from_slice(&xs[start..start + local * inner]);
            }
            Tensor::from_vec(full.dtype, shape, out)
        }
        Data::Int(xs) => {
            let mut out = Vec::with_capacity(outer * local * inner);
            for o in 0..outer {
                let start = (o * n + coord * local) * inner;
                out.extend_from_slice(&xs[start..start + local * inner]);
            }
            Tensor::from_ints(full.dtype, shape, out)
        }
    }
}

/// `x` as slice `coord` of `size` along `dim` of an otherwise zero tensor: what `place_shard`
/// computes on rank `coord` (the adjoint of [`shard_of`]).
fn place_shard<T: Real>(x: &Tensor<T>, dim: usize, size: usize, coord: usize) -> Result<Tensor<T>, String> {
    if dim >= x.rank() || coord >= size {
        return Err(format!("place_shard: cannot place {} as shard {coord} of {size} along dim {dim}", x.type_string()));
    }
    let xs = floats(x)?;
    let (outer, n, inner) = split(&x.shape, dim);
    let mut out = vec![T::zero(); xs.len() * size];
    for o in 0..outer {
        let start = (o * size + coord) * n * inner;
        out[start..start + n * inner].copy_from_slice(&xs[o * n * inner..(o + 1) * n * inner]);
    }
    let mut shape = x.shape.clone();
    shape[dim] = n * size;
    Tensor::from_vec(x.dtype, shape, out)
}

/// Concatenate shards (in rank order) along `dim`: the inverse of [`shard_of`].
pub fn concat<T: Real>(parts: &[Tensor<T>], dim: usize) -> Result<Tensor<T>, String> {
    let first = parts.first().ok_or("nothing to concatenate")?;
    if dim >= first.rank() || parts.iter().any(|p| p.shape != first.shape || p.dtype != first.dtype) {
        return Err(format!("cannot concatenate shards of {} along dim {dim}", first.type_string()));
    }
    let (outer, n, inner) = split(&first.shape, dim);
    let mut out = Vec::with_capacity(first.numel() * parts.len());
    for o in 0..outer {
        for p in parts {
            let xs = floats(p)?;
            out.extend_from_slice(&xs[o * n * inner..(o + 1) * n * inner]);
        }
    }
    let mut shape = first.shape.clone();
    shape[dim] = n * parts.len();
    Tensor::from_vec(first.dtype, shape, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    /// A 2-rank `dp_shard` group seen from rank `me`; the other rank contributes `10 * data`.
    struct TwoRanks {
        me: usize,
    }

    impl Communicator for TwoRanks {
        fn sizes(&self) -> [usize; 3] {
            [1, 2, 1]
        }
        fn coords(&self) -> [usize; 3] {
            [0, self.me, 0]
        }
        fn exchange(&self, _: MeshDim, data: Vec<f64>) -> Result<Vec<Vec<f64>>, String> {
            let other: Vec<f64> = data.iter().map(|x| 10.0 * x).collect();
            Ok(if self.me == 0 { vec![data, other] } else { vec![other, data] })
        }
    }

    fn t(shape: &[usize], xs: &[f64]) -> Tensor<f64> {
        Tensor::from_vec(DType::F32, shape.to_vec(), xs.to_vec()).expect("tensor")
    }

    #[test]
    fn collectives_combine_the_ranks_in_rank_order() {
        let x = t(&[2, 2], &[1.0, 2.0, 3.0, 4.0]);
        let me0 = TwoRanks { me: 0 };
        let me1 = TwoRanks { me: 1 };
        let ag = |dim| Op::AllGather { mesh_dim: MeshDim::DpShard, dim, size: 2 };
        let rows = eval_collective(&ag(0), &x, &me0, Precision::Exact).expect("all_gather");
        assert_eq!((rows.shape.clone(), rows.to_f64_vec()), (vec![4, 2], vec![1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 30.0, 40.0]));
        let cols = eval_collective(&ag(1), &x, &me1, Precision::Exact).expect("all_gather");
        assert_eq!((cols.shape.clone(), cols.to_f64_vec()), (vec![2, 4], vec![10.0, 20.0, 1.0, 2.0, 30.0, 40.0, 3.0, 4.0]));
        let rs = Op::ReduceScatter { mesh_dim: MeshDim::DpShard, dim: 1, size: 2, reduce: CollectiveReduce::Sum };
        let r1 = eval_collective(&rs, &x, &me1, Precision::Exact).expect("reduce_scatter");
        assert_eq!((r1.shape.clone(), r1.to_f64_vec()), (vec![2, 1], vec![22.0, 44.0]));
        let max = Op::AllReduce { mesh_dim: MeshDim::DpShard, reduce: CollectiveReduce::Max };
        assert_eq!(eval_collective(&max, &t(&[2], &[-1.0, 2.0]), &me0, Precision::Exact).expect("max").to_f64_vec(), vec![-1.0, 20.0]);
        // Rank-local: rank 1 keeps / is placed at slice 1, nothing is exchanged.
        let take = Op::TakeShard { mesh_dim: MeshDim::DpShard, dim: 1, size: 2 };
        let mine = eval_collective(&take, &x, &me1, Precision::Exact).expect("take_shard");
        assert_eq!((mine.shape.clone(), mine.to_f64_vec()), (vec![2, 1], vec![2.0, 4.0]));
        let place = Op::PlaceShard { mesh_dim: MeshDim::DpShard, dim: 1, size: 2 };
        let placed = eval_collective(&place, &mine, &me1, Precision::Exact).expect("place_shard");
        assert_eq!((placed.shape.clone(), placed.to_f64_vec()), (vec![2, 2], vec![0.0, 2.0, 0.0, 4.0]));
        let placed0 = eval_collective(&place, &x, &me0, Precision::Exact).expect("place_shard");
        assert_eq!((placed0.shape.clone(), placed0.to_f64_vec()), (vec![2, 4], vec![1.0, 2.0, 0.0, 0.0, 3.0, 4.0, 0.0, 0.0]));
        let bad = Op::AllGather { mesh_dim: MeshDim::DpShard, dim: 0, size: 4 };
        let err = eval_collective(&bad, &x, &me0, Precision::Exact).expect_err("size 4 on 2 ranks");
        assert!(err.contains("has size = 4 but mesh dim dp_shard has 2 ranks"), "{err}");
    }

    /// The ring micro-steps of `async-tp` on rank 1 of 2: a shift receives the other rank's
    /// operand, a rotated slice is the other rank's rows, and the chunks computed in ring
    /// order (own first) concatenate back in rank order.
    #[test]
    fn ring_ops_rotate_by_the_rank() {
        let x = t(&[2, 2], &[1.0, 2.0, 3.0, 4.0]);
        let me1 = TwoRanks { me: 1 };
        let shift = Op::RingShift { mesh_dim: MeshDim::DpShard, size: 2, shift: 1 };
        assert_eq!(eval_collective(&shift, &x, &me1, Precision::Exact).expect("ring_shift").to_f64_vec(), vec![10.0, 20.0, 30.0, 40.0]);
        let slice = |shift| Op::RingSlice { mesh_dim: MeshDim::DpShard, dim: 1, size: 2, shift };
        assert_eq!(eval_collective(&slice(0), &x, &me1, Precision::Exact).expect("ring_slice").to_f64_vec(), vec![2.0, 4.0]);
        assert_eq!(eval_collective(&slice(1), &x, &me1, Precision::Exact).expect("ring_slice").to_f64_vec(), vec![1.0, 3.0]);
        let (own, next) = (t(&[2, 1], &[2.0, 4.0]), t(&[2, 1], &[1.0, 3.0]));
        let concat = Op::RingConcat { mesh_dim: MeshDim::DpShard, dim: 1, size: 2 };
        let full = eval_mesh_op(&concat, &[&own, &next], &me1, Precision::Exact).expect("ring_concat");
        assert_eq!(full, x);
        let err = eval_mesh_op(&concat, &[&own], &me1, Precision::Exact).expect_err("one chunk");
        assert!(err.contains("has size = 2 and 1 operands"), "{err}");
        // The printed attributes parse back to the same op; a shift outside the group is refused.
        for op in [shift, slice(1), concat] {
            assert_eq!(Op::from_parts(op.name(), op.attrs(&|_| String::new()), &|_| None), Ok(op.clone()));
        }
        let bad = Op::RingShift { mesh_dim: MeshDim::Tp, size: 2, shift: 2 };
        let err = Op::from_parts(bad.name(), bad.attrs(&|_| String::new()), &|_| None).expect_err("shift 2 of 2");
        assert!(err.contains("needs 0 <= shift < size"), "{err}");
    }

    #[test]
    fn shards_concatenate_back_to_the_full_tensor() {
        let full = t(&[2, 4], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
        let parts: Vec<Tensor<f64>> = (0..2).map(|c| shard_of(&full, 1, 2, c).expect("shard")).collect();
        assert_eq!(parts[1].to_f64_vec(), vec![2.0, 3.0, 6.0, 7.0]);
        assert_eq!(concat(&parts, 1).expect("concat"), full);
        assert!(shard_of(&full, 1, 3, 0).is_err());
    }

    #[test]
    fn without_a_mesh_collectives_say_what_they_need() {
        let x = t(&[2], &[1.0, 2.0]);
        let op = Op::AllReduce { mesh_dim: MeshDim::Tp, reduce: CollectiveReduce::Sum };
        let ty = crate::shape::TensorType::fixed(DType::F32, &[2]);
        let err = crate::interp::eval_op(&op, &[&x], &[ty], &Default::default(), Precision::Exact).expect_err("no mesh");
        assert!(err.contains("`all_reduce` needs a device mesh"), "{err}");
        let take = Op::TakeShard { mesh_dim: MeshDim::Tp, dim: 0, size: 2 };
        let half = crate::shape::TensorType::fixed(DType::F32, &[1]);
        let err = crate::interp::eval_op(&take, &[&x], &[half], &Default::default(), Precision::Exact).expect_err("no mesh");
        assert!(err.contains("`take_shard` needs a device mesh"), "{err}");
    }
}
