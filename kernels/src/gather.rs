//! `gather` kernels: one `embedding(ids, table)`, `gather(table, ids)` or
//! `gather_shard(table, ids, shard)` node. A grid-stride loop over output vectors (16 bytes when
//! the row length allows); an index outside the table produces a zero row instead of reading
//! out of bounds (the reference interpreter reports an error there). `gather_shard`'s table is
//! row shard `k` of a larger table: indices are shifted by `k` rows-per-shard first (`k` read
//! from the one-hot `shard` argument by [`shard_index`]), so the other shards' rows, like
//! indices outside the whole table, give zero rows, which is the op's meaning.

use titan_ir::{DType, Graph, Op, Region, Value};

use crate::emit::{Elem, Func, ICmp, Ty, Val};
use crate::values::{Body, storage, vec_align};
use crate::{GenResult, Generated, invalid, unsupported};

const BLOCK: u64 = 256;
const GRID_CAP: u64 = 1056;

pub(crate) fn generate(g: &Graph, r: &Region, entry: &str) -> GenResult<Generated> {
    let b = Body::new(g, r)?;
    let nodes: Vec<_> = b.nodes().collect();
    let [node] = nodes.as_slice() else {
        return unsupported(format!("a gather body must hold exactly one embedding, gather or gather_shard node, found {}", nodes.len()));
    };
    let (table, ids, shard) = match node.op {
        Op::Embedding => (node.inputs[1], node.inputs[0], None),
        Op::Gather => (node.inputs[0], node.inputs[1], None),
        Op::GatherShard => (node.inputs[0], node.inputs[1], Some(node.inputs[2])),
        _ => return invalid(format!("a gather body holds `{}`; expected embedding, gather or gather_shard", node.op.name())),
    };
    let out = node.results[0];
    let [o] = r.outputs.as_slice() else {
        return invalid("a gather body must have exactly one output");
    };
    if o.value != out {
        return invalid("the gather body's output must be the gathered rows");
    }
    let (Some(ti), Some(ii)) = (b.arg_index(table), b.arg_index(ids)) else {
        return invalid("the table and the indices of a gather must be body arguments");
    };
    let ts = &b.shape[table.index()];
    let Some(&vocab) = ts.first() else {
        return invalid("the gather table must have rank >= 1");
    };
    let row: u64 = ts[1..].iter().product();
    let n_ids = b.numel(ids);
    if row == 0 || n_ids == 0 {
        return unsupported("gather of empty rows or no indices");
    }
    let st = storage(b.dtype(table))?;
    let it = storage(b.dtype(ids))?;
    if !matches!(it, Elem::I32 | Elem::I64) {
        return invalid("gather indices must be i32 or i64");
    }
    let lanes = [8u32, 4, 2, 1].into_iter().find(|&v| row.is_multiple_of(u64::from(v)) && v * st.bytes() <= 16).unwrap_or(1);
    let per_row = row / u64::from(lanes);
    let total = n_ids * per_row;
    let grid = total.div_ceil(BLOCK).clamp(1, GRID_CAP);
    let na = r.args.len();
    let mut f = Func::new(na + 1);
    let (tp, ip, op) = (f.param(ti), f.param(ii), f.param(na));
    // The first row of the table's shard in the index space (0 for a whole table).
    let base = match shard {
        Some(sv) => {
            let k = shard_index(&mut f, &b, sv)?;
            let nv = f.i64c(vocab as i64);
            Some(f.muli(k, nv))
        }
        None => None,
    };
    let tid = f.thread_id();
    let bid = f.block_id();
    let tid64 = f.extui(tid, Elem::I64);
    let bid64 = f.extui(bid, Elem::I64);
    let bt = f.i64c(BLOCK as i64);
    let start = f.muli(bid64, bt);
    let start = f.addi(start, tid64);
    let end = f.i64c(total as i64);
    let step = f.i64c((grid * BLOCK) as i64);
    let align = vec_align(st, lanes, b.numel(table)).min(vec_align(st, lanes, b.numel(out)));
    let vt = Ty::lanes_of(st, lanes);
    f.for_loop(start, end, step, &[], |f, v, _| {
        let pr = f.i64c(per_row as i64);
        let j = f.divui(v, pr);
        let c = f.remui(v, pr);
        let l = f.i64c(i64::from(lanes));
        let c = f.muli(c, l);
        let id = f.load_at(ip, j, Ty::S(it), it.bytes());
        let id = f.as_i64(id);
        let id = match base {
            Some(base) => f.subi(id, base),
            None => id,
        };
        let zero = f.i64c(0);
        let nv = f.i64c(vocab as i64);
        let ge = f.cmpi(ICmp::Sge, id, zero);
        let lt = f.cmpi(ICmp::Slt, id, nv);
        let ok = f.andi(ge, lt);
        let safe = f.select(ok, id, zero);
        let rl = f.i64c(row as i64);
        let src = f.muli(safe, rl);
        let src = f.addi(src, c);
        let x = f.load_at(tp, src, vt, align);
        let z = if st.is_float() { f.cf(0.0, vt) } else { f.ci(0, vt) };
        let x = f.select(ok, x, z);
        let dst = f.muli(j, rl);
        let dst = f.addi(dst, c);
        f.store_at(x, op, dst, align);
        vec![]
    });
    Ok(Generated::new(f.finish(entry, BLOCK as u32, grid as u32), BLOCK as u32, grid as u32, 0))
}

/// The index `k` (i64) of the row shard named by the one-hot `f32[n]` kernel argument `shard`
/// (`gather_shard`, `scatter_add_shard`): `sum_j j shard[j]`, read once per thread.
pub(crate) fn shard_index(f: &mut Func, b: &Body, shard: Value) -> GenResult<Val> {
    let Some(i) = b.arg_index(shard) else {
        return invalid("the row shard of a gather_shard or scatter_add_shard must be a kernel argument");
    };
    let n = b.numel(shard);
    if b.dtype(shard) != DType::F32 || n == 0 || n > 1024 {
        return unsupported(format!("the row shard {shard} must be a one-hot f32[shards] of 1 to 1024 shards"));
    }
    let ptr = f.param(i);
    let zero = f.f32c(0.0);
    let (lo, hi, one) = (f.i64c(0), f.i64c(n as i64), f.i64c(1));
    let k = f.for_loop(lo, hi, one, &[zero], |f, j, acc| {
        let x = f.load_at(ptr, j, Ty::S(Elem::F32), 4);
        let jf = f.sitofp(j, Elem::F32);
        let w = f.mulf(x, jf);
        vec![f.addf(acc[0], w)]
    });
    Ok(f.fptosi(k[0], Elem::I64))
}
