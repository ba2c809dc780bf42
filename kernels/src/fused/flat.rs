//! Flat kernels: a grid-stride loop over vectors of every element domain of the body, for groups
//! without row ops.

use titan_ir::Op;

use super::analyze::{AccSrc, Analysis, RedOp};
use super::cross_block::{Geometry, Partials, finish_accs, workspace_bytes};
use super::reduce::{Params, identities, lanes_dividing, params, red_smem, scalars_at_top, store_output, update};
use crate::emit::{Elem, Func, ICmp, Val};
use crate::values::{Body, Eval, Lay};
use crate::{GenResult, Generated, invalid, unsupported};

/// Threads of a flat kernel.
const FLAT_BLOCK: u64 = 256;
/// Grid cap of flat kernels: 8 CTAs of 256 threads on each of 132 SMs.
const FLAT_GRID_CAP: u64 = 1056;

/// One element domain of a flat kernel: the values with `n` elements.
struct Domain {
    n: u64,
    lanes: u32,
    nvec: u64,
}

/// The element domains a flat kernel stores or reduces, each with the widest vector width that
/// divides it and keeps broadcast sources' rows whole.
fn flat_domains(b: &Body, a: &Analysis) -> Vec<Domain> {
    let mut ns: Vec<u64> = b.r.outputs.iter().filter(|o| a.lay[o.value.index()] == Lay::Elem).map(|o| b.numel(o.value)).collect();
    for acc in &a.accs {
        if let AccSrc::Elem(v) = acc.src {
            ns.push(b.numel(v));
        }
    }
    ns.sort_unstable();
    ns.dedup();
    ns.into_iter()
        .map(|n| {
            let mut sizes = vec![n];
            for node in b.nodes() {
                if matches!(node.op, Op::Broadcast { .. }) && a.lay[node.inputs[0].index()] == Lay::Gen && b.numel(node.results[0]) == n {
                    sizes.push(b.shape[node.results[0].index()].last().copied().unwrap_or(1));
                }
            }
            let lanes = lanes_dividing(&sizes);
            Domain { n, lanes, nvec: n / u64::from(lanes) }
        })
        .collect()
}

/// One work item of a flat kernel in domain `dom`: store its outputs, fold its reductions.
#[allow(clippy::too_many_arguments)]
fn flat_item(f: &mut Func, ev: &mut Eval, b: &Body, a: &Analysis, p: &Params, dom: &Domain, i: Val, valid: Option<Val>, st: &[Val]) -> GenResult<Vec<Val>> {
    let l = f.i64c(i64::from(dom.lanes));
    let lin = f.muli(i, l);
    let pos = ev.pos(dom.lanes, lin, None);
    for (oi, o) in b.r.outputs.iter().enumerate() {
        if a.lay[o.value.index()] == Lay::Elem && b.numel(o.value) == dom.n {
            store_output(f, ev, p, oi, o.value, &pos, valid)?;
        }
    }
    let mut next = st.to_vec();
    for (k, acc) in a.accs.iter().filter(|x| !x.col).enumerate() {
        let AccSrc::Elem(v) = acc.src else {
            return invalid("per-row accumulation in a flat kernel");
        };
        if b.numel(v) == dom.n {
            let x = ev.lanes(f, v, &pos)?;
            next[k] = update(f, acc.op, &[st[k]], x, valid)[0];
        }
    }
    Ok(next)
}

pub(super) fn gen_flat(b: &Body, a: &Analysis, entry: &str) -> GenResult<Generated> {
    if a.accs.iter().any(|x| x.col) {
        return invalid("column sums in a flat kernel");
    }
    let doms = flat_domains(b, a);
    // Work in chunks of one vector per thread; a table of chunk offsets maps a chunk to its domain.
    let single = doms.len() == 1;
    let max_nvec = doms.iter().map(|d| d.nvec).max().unwrap_or(1);
    let threads = if max_nvec <= 1 && doms.len() <= 1 { 32 } else { FLAT_BLOCK };
    let mut first_chunk = Vec::new();
    let mut chunks = 0u64;
    for d in &doms {
        first_chunk.push(chunks);
        chunks += d.nvec.div_ceil(threads);
    }
    if chunks > i32::MAX as u64 {
        return unsupported(format!("a pointwise kernel of {chunks} chunks exceeds the grid limit"));
    }
    let grid = chunks.clamp(1, FLAT_GRID_CAP);
    let ws_bytes = workspace_bytes(a, grid, 1);
    let nparams = b.r.args.len() + b.r.outputs.len() + usize::from(ws_bytes > 0);
    let mut f = Func::new(nparams);
    let (args, p) = params(&f, b, ws_bytes > 0);
    let mut ev = Eval::new(b, a.lay.clone(), args);
    let tid = f.thread_id();
    let bid = f.block_id();
    let zero32 = f.i32c(0);
    let t0 = f.cmpi(ICmp::Eq, tid, zero32);
    let b0 = f.cmpi(ICmp::Eq, bid, zero32);
    let first = f.andi(t0, b0);
    scalars_at_top(&mut f, &mut ev, b, &p, first)?;
    let ops: Vec<RedOp> = a.accs.iter().map(|x| x.op).collect();
    let init: Vec<Val> = identities(&mut f, &ops).into_iter().flatten().collect();
    let tid64 = f.extui(tid, Elem::I64);
    let bid64 = f.extui(bid, Elem::I64);
    let tt = f.i64c(threads as i64);
    let parts = if doms.is_empty() {
        init.clone()
    } else if single {
        // One domain: a plain grid-stride loop over its vectors.
        let dom = &doms[0];
        let start = f.muli(bid64, tt);
        let start = f.addi(start, tid64);
        let end = f.i64c(dom.nvec as i64);
        let step = f.i64c((grid * threads) as i64);
        f.try_for_loop(start, end, step, &init, |f, i, st| {
            let next = flat_item(f, &mut ev, b, a, &p, dom, i, None, st);
            ev.forget_items();
            next
        })?
    } else {
        let end = f.i64c(chunks as i64);
        let step = f.i64c(grid as i64);
        f.try_for_loop(bid64, end, step, &init, |f, c, st| {
            let mut k = f.i32c(0);
            for &fc in &first_chunk[1..] {
                let s = f.i64c(fc as i64);
                let ge = f.cmpi(ICmp::Uge, c, s);
                let one = f.extui(ge, Elem::I32);
                k = f.addi(k, one);
            }
            f.try_switch_values(k, doms.len(), st, |f, di| {
                let dom = &doms[di];
                let fc = f.i64c(first_chunk[di] as i64);
                let local = f.subi(c, fc);
                let base = f.muli(local, tt);
                let i = f.addi(base, tid64);
                let nv = f.i64c(dom.nvec as i64);
                let valid = f.cmpi(ICmp::Slt, i, nv);
                let last = f.i64c(dom.nvec as i64 - 1);
                let ic = f.minsi(i, last);
                let next = flat_item(f, &mut ev, b, a, &p, dom, ic, Some(valid), st);
                ev.forget_items();
                next
            })
        })?
    };
    if !a.accs.is_empty() {
        let smem = f.shared_array("titan_red", Elem::F32, red_smem(1));
        let geo = Geometry { threads: threads as u32, grid, d: 1, lanes: 1, col_of: vec![], smem, tid, bid };
        let parts = Partials { scalar: parts.into_iter().map(|x| vec![x]).collect(), col: vec![] };
        finish_accs(&mut f, &mut ev, a, &p, parts, &geo)?;
    }
    Ok(Generated::new(f.finish(entry, threads as u32, grid as u32), threads as u32, grid as u32, ws_bytes))
}
