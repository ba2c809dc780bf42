//! `fused` kernels: pointwise chains, broadcasts, RoPE and row reductions (rmsnorm, rmsnorm_bwd,
//! reduce over trailing axes, cross_entropy, cross_entropy_bwd, and the vocab-parallel loss's
//! cross_entropy_stats, cross_entropy_stats_bwd, cross_entropy_combine), with cross-block results
//! (full reductions, column sums such as rmsnorm_bwd's `dw`, the mean loss) finished by the last
//! block to arrive.
//!
//! Three shapes of kernel:
//! * flat: a grid-stride loop over vectors of the whole domain (16-byte accesses when the sizes
//!   allow), for groups without row ops; one that stores a 2-D `transpose` (float8's K-major
//!   GEMM operands) works on tiles instead, the transposed values passing through shared memory
//!   so that both the loads and the stores are coalesced: 128x64 tiles, one per CTA, with four
//!   rows' fp8 bytes packed per word for fp8 outputs, 64x64 tiles otherwise;
//! * columns: reductions over the rows with nothing per row (float8's per-column amax over
//!   the tokens, column sums), any row length: a grid of column tiles x row chunks whose
//!   partials the last CTA of each tile folds in chunk order (`col.rs`);
//! * rows: one CTA per row (a grid-stride loop over rows when cross-block sums need a bounded
//!   grid). The row is read in passes, one per level of dependent reductions; rows of up to
//!   4096 vectors are held in registers across passes (the work items are unrolled), longer rows
//!   (the vocabulary) are looped and recomputed, with an online max/sum-exp for log-sum-exp.
//!   Per-row reductions go lane -> warp (`shfl.bfly`) -> block (shared memory), in a fixed order.
//!
//! Cross-block results go through the workspace: each CTA writes its partial, bumps a counter, and
//! the last CTA sums the partials in CTA order (deterministic), zeroes them and the counter.
//!
//! The analysis of a body (`analyze.rs`) decides the shape; `flat.rs`, `col.rs` and `row.rs`
//! generate the three shapes from the codegen they share (`reduce.rs`) and the cross-block
//! arrival and finish (`cross_block.rs`).

mod analyze;
mod col;
mod cross_block;
mod flat;
mod reduce;
mod row;

use titan_ir::{Graph, Region};

use self::analyze::analyze;
use self::col::{gen_cols, is_column};
use self::flat::gen_flat;
use self::row::gen_rows;
use crate::values::Body;
use crate::{GenResult, Generated, invalid};

pub(crate) fn generate(g: &Graph, r: &Region, entry: &str) -> GenResult<Generated> {
    let b = Body::new(g, r)?;
    if r.outputs.is_empty() {
        return invalid("a fused body needs at least one output");
    }
    let a = analyze(&b)?;
    if a.flat {
        gen_flat(&b, &a, entry)
    } else if is_column(&b, &a) {
        gen_cols(&b, &a, entry)
    } else {
        gen_rows(&b, &a, entry)
    }
}

#[cfg(test)]
mod tests {
    use super::reduce::lanes_dividing;

    #[test]
    fn lanes_divide_every_size() {
        assert_eq!(lanes_dividing(&[64]), 8);
        assert_eq!(lanes_dividing(&[64, 12]), 4);
        assert_eq!(lanes_dividing(&[7]), 1);
    }
}
