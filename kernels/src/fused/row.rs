//! Row kernels: one CTA per row (a grid-stride loop over rows when cross-block sums bound the
//! grid), read in one pass per level of dependent reductions, with the row held in registers
//! when it fits and looped when it does not (a looped pass recomputes its values from the
//! arguments, except those an earlier pass stored, which it reads back).

use std::collections::{HashMap, HashSet};

use titan_ir::{Op, ReduceKind, RopeLayout, Value};

use super::analyze::{AccSrc, Analysis, Contrib, RedOp};
use super::cross_block::{Geometry, Partials, finish_accs, workspace_bytes};
use super::reduce::{Params, Top, block_reduce, identities, kernel_top, lanes_dividing, red_smem, store_output, store_uniform, update};
use crate::emit::{Elem, FCmp, Func, ICmp, Ty, Val};
use crate::values::{Body, Eval, Lay, Pos, RopeRow, RowKey, rope_freqs, storage};
use crate::{GenResult, Generated, invalid, math, unsupported};

/// Grid cap of kernels with cross-block sums: one wave of two CTAs on each of the H200's 132 SMs
/// (also bounds the workspace: one partial per CTA). Each CTA loops over its rows, prefetching
/// the next one into L2 ([`prefetch_rows`]). The rmsnorm backward with `dw` (bf16, 16384 x 4096,
/// 256 threads; 8192 x 2048, 128 threads) took 262-266 / 93-98 us at the old 1056 (8 per SM:
/// partial waves, more partials to fold), 211-220 / 89-91 at 264 without the prefetch and
/// 177-185 / 64-66 with it; with the prefetch, 132 CTAs took 204-205 / 90, 396 took 210 / 65
/// and prefetching two rows ahead 198-204 / 65 (`gpu_check.py perf`, H200, 2026-12-03).
const ACC_GRID_CAP: u64 = 264;
/// Work items a thread holds in registers across passes.
const UNROLL_MAX: u64 = 4;
const MAX_BLOCK: u64 = 1024;
/// Chunks per iteration of a looped (too long to unroll) row's passes.
const LOOP_UNROLL: u64 = 4;
/// Most threads of a CTA looping a wide row (more than `MAX_BLOCK` work items, at most
/// `MAX_BLOCK * UNROLL_MAX`): two such CTAs fit on an SM at up to 73 registers per thread.
const WIDE_BLOCK: u64 = 448;

/// What one pass of a looped row loads per element ([`RowGen::pass_needs`]).
struct PassNeeds {
    args: Vec<Value>,
    /// Values an earlier pass stored as output `oi`, read back from it.
    reloads: Vec<(Value, usize)>,
}

/// A work item of a row kernel: its positions (two for half-layout RoPE) and validity.
#[derive(Clone)]
struct Item {
    pos: Vec<Pos>,
    valid: Option<Val>,
    chunk: usize,
}

struct RowGeo {
    lanes: u32,
    threads: u64,
    /// Work items per row.
    items: u64,
    chunks: u64,
    unrolled: bool,
    /// Chunks per iteration of a looped row's passes.
    unroll: u64,
}

fn row_geometry(a: &Analysis) -> GenResult<RowGeo> {
    let (lanes, items) = match a.rope {
        Some(r) if r.cfg.layout == RopeLayout::Half => {
            let half = r.head_dim / 2;
            let lanes = lanes_dividing(&[half]);
            (lanes, (a.d / r.head_dim) * (half / u64::from(lanes)))
        }
        Some(r) => {
            let lanes = lanes_dividing(&[r.head_dim]).max(2);
            (lanes, a.d / u64::from(lanes))
        }
        None => {
            let lanes = lanes_dividing(&[a.d]);
            (lanes, a.d / u64::from(lanes))
        }
    };
    let has_cacc = a.accs.iter().any(|x| x.col);
    if items <= MAX_BLOCK || (has_cacc && items <= MAX_BLOCK * UNROLL_MAX) {
        let threads = (items.div_ceil(2).div_ceil(32) * 32).clamp(32, MAX_BLOCK);
        Ok(RowGeo { lanes, threads, items, chunks: items.div_ceil(threads), unrolled: true, unroll: 1 })
    } else if items <= MAX_BLOCK * UNROLL_MAX {
        // Wide rows (SwiGLU's 14336 bf16): looped by CTAs small enough that two fit on an SM,
        // so that one CTA's loads overlap the other's reductions and stores, one chunk per
        // iteration (two spilled in the SwiGLU backward). On the H200, 8b-4l float8 rowwise:
        // SwiGLU forward + quantization 1.73 -> 1.41 ms per step, backward 2.55 -> 2.17 ms,
        // against 896-thread CTAs holding the row in registers, one per SM.
        let threads = items.div_ceil(items.div_ceil(WIDE_BLOCK)).div_ceil(32) * 32;
        Ok(RowGeo { lanes, threads, items, chunks: items.div_ceil(threads), unrolled: false, unroll: 1 })
    } else {
        Ok(RowGeo { lanes, threads: MAX_BLOCK, items, chunks: items.div_ceil(MAX_BLOCK), unrolled: false, unroll: LOOP_UNROLL })
    }
}

struct RowGen<'a, 'b, 'g> {
    b: &'a Body<'g>,
    a: &'a Analysis<'g>,
    ev: Eval<'b, 'g>,
    p: Params,
    geo: RowGeo,
    tid: Val,
    tid64: Val,
    is_t0: Val,
    smem: Val,
}

impl<'g> RowGen<'_, '_, 'g> {
    /// The work item `w` (i64, possibly past the end) of row `row`.
    fn item(&mut self, f: &mut Func, row: Val, w: Val, chunk: usize, may_overhang: bool) -> Item {
        let lanes = self.geo.lanes;
        let (w, valid) = if may_overhang {
            let n = f.i64c(self.geo.items as i64);
            let ok = f.cmpi(ICmp::Slt, w, n);
            let last = f.i64c(self.geo.items as i64 - 1);
            (f.minsi(w, last), Some(ok))
        } else {
            (w, None)
        };
        let d = f.i64c(self.a.d as i64);
        let base = f.muli(row, d);
        let mk = |f: &mut Func, ev: &mut Eval, col: Val| {
            let lin = f.addi(base, col);
            ev.pos(lanes, lin, Some(col))
        };
        match self.a.rope {
            Some(r) if r.cfg.layout == RopeLayout::Half => {
                let half = r.head_dim / 2;
                let per_head = half / u64::from(lanes);
                let ph = f.i64c(per_head as i64);
                let head = f.divui(w, ph);
                let jv = f.remui(w, ph);
                let hd = f.i64c(r.head_dim as i64);
                let l = f.i64c(i64::from(lanes));
                let c0 = f.muli(head, hd);
                let j = f.muli(jv, l);
                let ca = f.addi(c0, j);
                let hh = f.i64c(half as i64);
                let cb = f.addi(ca, hh);
                let pa = mk(f, &mut self.ev, ca);
                let pb = mk(f, &mut self.ev, cb);
                self.ev.partner.insert(pa.id, (pb, true));
                self.ev.partner.insert(pb.id, (pa, false));
                Item { pos: vec![pa, pb], valid, chunk }
            }
            _ => {
                let l = f.i64c(i64::from(lanes));
                let col = f.muli(w, l);
                let p = mk(f, &mut self.ev, col);
                Item { pos: vec![p], valid, chunk }
            }
        }
    }

    /// Pass `k` over one work item: reduction updates, element outputs, accumulations.
    fn visit(&mut self, f: &mut Func, k: u32, it: &Item, red_st: &mut [Vec<Val>], sacc: &mut [Vec<Val>], cacc: &mut [Vec<Val>]) -> GenResult<()> {
        let a = self.a;
        for (ri, red) in a.reds.iter().enumerate() {
            if red.level != k {
                continue;
            }
            for pos in &it.pos {
                let x = match red.contrib {
                    Contrib::Square(v) => {
                        let x = self.ev.lanes(f, v, pos)?;
                        f.mulf(x, x)
                    }
                    Contrib::DyWX { x, w, dy } => {
                        let xv = self.ev.lanes(f, x, pos)?;
                        let wv = self.ev.lanes(f, w, pos)?;
                        let dyv = self.ev.lanes(f, dy, pos)?;
                        let dn = f.mulf(dyv, wv);
                        f.mulf(dn, xv)
                    }
                    Contrib::Plain(v) => self.ev.lanes(f, v, pos)?,
                    Contrib::NegFirstMax { x, key } => {
                        let xv = self.ev.lanes(f, x, pos)?;
                        let m = self.ev.row_result(key, RowKey::Max)?;
                        let Some(col) = pos.col else {
                            return invalid("cross_entropy_stats_bwd outside a row kernel");
                        };
                        let none = f.f32c(f32::NEG_INFINITY);
                        // Columns below 2^24 are exact in f32.
                        let cf = f.sitofp(col, Elem::F32);
                        let base = f.negf(cf);
                        let at: Vec<Val> = (0..pos.lanes)
                            .map(|l| {
                                let o = f.f32c(l as f32);
                                let neg = f.subf(base, o);
                                let xl = f.extract(xv, l);
                                let hit = f.cmpf(FCmp::Oeq, xl, m);
                                f.select(hit, neg, none)
                            })
                            .collect();
                        f.vector_of(&at)
                    }
                    Contrib::ShiftedExp { s, m, key } => {
                        let sv = self.ev.lanes(f, s, pos)?;
                        let mv = self.ev.lanes(f, m, pos)?;
                        let big = self.ev.row_result(key, RowKey::Max)?;
                        let big = f.splat(big, pos.lanes);
                        let d = f.subf(mv, big);
                        let e = math::exp_approx(f, d);
                        f.mulf(sv, e)
                    }
                };
                red_st[ri] = update(f, red.op, &red_st[ri], x, it.valid);
            }
        }
        for (oi, o) in self.b.r.outputs.iter().enumerate() {
            if a.lay[o.value.index()] == Lay::Elem && a.level[o.value.index()] == k {
                for pos in &it.pos {
                    store_output(f, &mut self.ev, &self.p, oi, o.value, pos, it.valid)?;
                }
            }
        }
        let (mut si, mut ci) = (0usize, 0usize);
        for acc in &a.accs {
            let here = acc.level == k;
            if acc.col {
                if here {
                    for pos in &it.pos {
                        let x = match acc.src {
                            AccSrc::Elem(v) => self.ev.lanes(f, v, pos)?,
                            AccSrc::RmsDw { key, x, dy } => {
                                let xv = self.ev.lanes(f, x, pos)?;
                                let dyv = self.ev.lanes(f, dy, pos)?;
                                let inv = self.ev.row_result(key, RowKey::Inv)?;
                                let inv = f.splat(inv, pos.lanes);
                                let n = f.mulf(xv, inv);
                                let n = math::round_to(f, n, storage(self.b.dtype(x))?);
                                f.mulf(dyv, n)
                            }
                            _ => return invalid("column accumulation of a per-row value"),
                        };
                        let x = match it.valid {
                            Some(ok) => {
                                let z = f.cf(acc.op.identity()[0], x.ty);
                                f.select(ok, x, z)
                            }
                            None => x,
                        };
                        let cur = cacc[ci][it.chunk];
                        cacc[ci][it.chunk] = if acc.op == RedOp::Max { f.maximumf(cur, x) } else { f.addf(cur, x) };
                    }
                }
                ci += 1;
            } else {
                if let (true, AccSrc::Elem(v)) = (here, acc.src) {
                    for pos in &it.pos {
                        let x = self.ev.lanes(f, v, pos)?;
                        sacc[si] = update(f, acc.op, &sacc[si], x, it.valid);
                    }
                }
                si += 1;
            }
        }
        Ok(())
    }

    /// Values of the current row known after level `k` (row results, per-row accumulations,
    /// per-row outputs).
    fn row_level(&mut self, f: &mut Func, k: u32, row: Val, sacc: &mut [Vec<Val>]) -> GenResult<()> {
        let a = self.a;
        for node in self.b.nodes() {
            for &r in node.inputs.iter().chain(&node.results) {
                if a.lay[r.index()] == Lay::Row && a.level[r.index()] == k {
                    self.ev.uniform(f, r)?;
                }
            }
        }
        for (oi, o) in self.b.r.outputs.iter().enumerate() {
            if a.lay[o.value.index()] == Lay::Row && a.level[o.value.index()] == k {
                store_uniform(f, &mut self.ev, &self.p, oi, o.value, row, self.is_t0)?;
            }
        }
        let mut si = 0usize;
        for acc in &a.accs {
            if acc.col {
                continue;
            }
            if acc.level == k {
                let x = match acc.src {
                    AccSrc::Row(v) => Some(self.ev.uniform(f, v)?),
                    AccSrc::CeLoss { key, logits } => Some(self.ce_loss(f, key, logits, row)?),
                    AccSrc::CeCombine { key } => {
                        let big = self.ev.row_result(key, RowKey::Max)?;
                        let sum = self.ev.row_result(key, RowKey::SumExp)?;
                        let target = self.ev.row_result(key, RowKey::TargetSum)?;
                        let l = math::log(f, sum);
                        let lse = f.addf(big, l);
                        Some(f.subf(lse, target))
                    }
                    _ => None,
                };
                if let Some(x) = x {
                    // Once per row: only thread 0 contributes.
                    let id = f.f32c(acc.op.identity()[0] as f32);
                    let x = f.select(self.is_t0, x, id);
                    sacc[si] = update(f, acc.op, &sacc[si], x, None);
                }
            }
            si += 1;
        }
        Ok(())
    }

    /// `lse - logits[row, target]` (NaN for a target outside the row).
    fn ce_loss(&mut self, f: &mut Func, key: usize, logits: Value, row: Val) -> GenResult<Val> {
        let lse = self.ev.row_result(key, RowKey::Lse)?;
        let t = self.ev.row_result(key, RowKey::Target)?;
        let zero = f.i64c(0);
        let dmax = f.i64c(self.a.d as i64 - 1);
        let tc = f.maxsi(t, zero);
        let tc = f.minsi(tc, dmax);
        let d = f.i64c(self.a.d as i64);
        let base = f.muli(row, d);
        let lin = f.addi(base, tc);
        let pos = self.ev.pos(1, lin, Some(tc));
        let xt = self.ev.elem(f, logits, &pos)?;
        let loss = f.subf(lse, xt);
        let ok = f.cmpi(ICmp::Eq, tc, t);
        let nan = f.f32c(f32::NAN);
        Ok(f.select(ok, loss, nan))
    }

    /// Finish the reductions of level `k`: block-reduce and compute each row op's row results.
    fn reduce_level(&mut self, f: &mut Func, k: u32, red_st: Vec<Vec<Val>>) -> GenResult<()> {
        let a = self.a;
        let idx: Vec<usize> = (0..a.reds.len()).filter(|&i| a.reds[i].level == k).collect();
        if idx.is_empty() {
            return Ok(());
        }
        let ops: Vec<RedOp> = idx.iter().map(|&i| a.reds[i].op).collect();
        let states: Vec<Vec<Val>> = idx.iter().map(|&i| red_st[i].clone()).collect();
        let totals = block_reduce(f, &ops, states, self.geo.threads as u32, self.smem, self.tid);
        let total = |i: usize| -> &Vec<Val> { &totals[idx.iter().position(|&j| j == i).unwrap_or(0)] };
        let d = self.a.d;
        for rop in &a.row_ops {
            if rop.level != k {
                continue;
            }
            match &rop.node.op {
                Op::RmsNorm { eps } | Op::RmsNormBwd { eps } => {
                    let ss = total(rop.reds[0])[0];
                    let dn = f.f32c(d as f32);
                    let m = f.divf(ss, dn);
                    let e = f.f32c(*eps as f32);
                    let t = f.addf(m, e);
                    let s = f.sqrt(t);
                    let one = f.f32c(1.0);
                    let inv = f.divf(one, s);
                    self.ev.rowres.insert((rop.key, RowKey::Inv), inv);
                    if let Some(&j) = rop.reds.get(1) {
                        let q = total(j)[0];
                        let dot = f.mulf(q, inv);
                        let inv_d = f.f32c((1.0 / d as f64) as f32);
                        let mean = f.mulf(dot, inv_d);
                        self.ev.rowres.insert((rop.key, RowKey::Mean), mean);
                    }
                }
                Op::Reduce { kind, .. } => {
                    let mut x = total(rop.reds[0])[0];
                    if *kind == ReduceKind::Mean {
                        let c = f.f32c(d as f32);
                        x = f.divf(x, c);
                    }
                    let r = rop.node.results[0];
                    let x = math::round_to(f, x, storage(self.b.dtype(r))?);
                    self.ev.rowres.insert((rop.key, RowKey::Reduced), x);
                }
                Op::CrossEntropy | Op::CrossEntropyBwd => {
                    let st = total(rop.reds[0]);
                    let l = math::log(f, st[1]);
                    let lse = f.addf(st[0], l);
                    self.ev.rowres.insert((rop.key, RowKey::Lse), lse);
                }
                // The first reduction of the loss shard: the online (max, sum of exp(x - max)).
                Op::CrossEntropyStats | Op::CrossEntropyStatsBwd if a.reds[rop.reds[0]].op == RedOp::Lse => {
                    let st = total(rop.reds[0]);
                    self.ev.rowres.insert((rop.key, RowKey::Max), st[0]);
                    self.ev.rowres.insert((rop.key, RowKey::SumExp), st[1]);
                }
                Op::CrossEntropyStatsBwd => {
                    self.ev.rowres.insert((rop.key, RowKey::NegArgMax), total(rop.reds[0])[0]);
                }
                Op::CrossEntropyCombine if a.reds[rop.reds[0]].op == RedOp::Max => {
                    self.ev.rowres.insert((rop.key, RowKey::Max), total(rop.reds[0])[0]);
                    self.ev.rowres.insert((rop.key, RowKey::TargetSum), total(rop.reds[1])[0]);
                }
                Op::CrossEntropyCombine => {
                    self.ev.rowres.insert((rop.key, RowKey::SumExp), total(rop.reds[0])[0]);
                }
                other => return invalid(format!("`{}` has no row reductions", other.name())),
            }
        }
        Ok(())
    }

    /// Targets of the cross-entropy nodes for the current row, and the vocabulary shard of the
    /// loss-shard nodes (the index of the one in their one-hot `shard`).
    fn targets(&mut self, f: &mut Func) -> GenResult<()> {
        for rop in &self.a.row_ops {
            // (cross_entropy_stats_bwd has two row ops: one for each of its reductions.)
            if self.ev.rowres.contains_key(&(rop.key, RowKey::Target)) {
                continue;
            }
            if matches!(rop.node.op, Op::CrossEntropy | Op::CrossEntropyBwd | Op::CrossEntropyStats | Op::CrossEntropyStatsBwd) {
                let t = self.ev.uniform(f, rop.node.inputs[1])?;
                let t = f.as_i64(t);
                self.ev.rowres.insert((rop.key, RowKey::Target), t);
            }
            if matches!(rop.node.op, Op::CrossEntropyStats | Op::CrossEntropyStatsBwd) {
                let shard = rop.node.inputs[2];
                let Some(i) = self.b.arg_index(shard) else {
                    return invalid("the vocabulary shard is not a kernel argument");
                };
                let n = self.b.numel(shard);
                if self.b.dtype(shard) != titan_ir::DType::F32 || n == 0 || n > 1024 {
                    return unsupported(format!("the vocabulary shard {shard} must be a one-hot f32[shards] of 1 to 1024 shards"));
                }
                let ptr = self.ev.args[i];
                let mut k = f.f32c(0.0);
                for j in 0..n {
                    let o = f.i64c(j as i64);
                    let x = f.load_at(ptr, o, Ty::S(Elem::F32), 4);
                    let jf = f.f32c(j as f32);
                    let w = f.mulf(x, jf);
                    k = f.addf(k, w);
                }
                let k = f.fptosi(k, Elem::I64);
                self.ev.rowres.insert((rop.key, RowKey::Shard), k);
            }
        }
        Ok(())
    }

    /// Fill the RoPE table for position `row % seq`.
    fn rope_table(&mut self, f: &mut Func, row: Val) -> GenResult<()> {
        let Some(r) = self.a.rope else { return Ok(()) };
        let half = r.head_dim / 2;
        let freqs = rope_freqs(&r.cfg, r.head_dim)?;
        let table = f.shared_array("titan_rope", Elem::F32, 2 * half);
        self.ev.rope = Some(RopeRow { table, head_dim: r.head_dim });
        let freq = f.const_table_f64("titan_rope_freq", &freqs);
        let seq = f.i64c(r.seq as i64);
        let p = f.remui(row, seq);
        let pf = f.sitofp(p, Elem::F64);
        let end = f.i64c(half as i64);
        let step = f.i64c(self.geo.threads as i64);
        let inverse = r.cfg.inverse;
        f.for_loop(self.tid64, end, step, &[], |f, j, _| {
            let fr = f.load_at(freq, j, Ty::S(Elem::F64), 8);
            let a = f.mulf(pf, fr);
            let a = if inverse { f.negf(a) } else { a };
            let (c, s) = math::sincos_f64(f, a);
            let c = f.truncf(c, Elem::F32);
            let s = f.truncf(s, Elem::F32);
            f.store_at(c, table, j, 4);
            let hh = f.i64c(half as i64);
            let js = f.addi(j, hh);
            f.store_at(s, table, js, 4);
            vec![]
        });
        f.barrier();
        Ok(())
    }

    /// One row: targets, RoPE table, then the passes, each followed by its reductions.
    fn row(&mut self, f: &mut Func, row: Val, max_level: u32, grid: u64, sacc: &mut [Vec<Val>], cacc: &mut [Vec<Val>]) -> GenResult<()> {
        let a = self.a;
        let b = self.b;
        let threads = self.geo.threads;
        self.ev.forget_row();
        self.ev.row = Some(row);
        self.targets(f)?;
        self.rope_table(f, row)?;
        self.row_level(f, 0, row, sacc)?;
        // Unrolled rows: the same work items (and their registers) serve every pass.
        let items: Vec<Item> = if self.geo.unrolled {
            (0..self.geo.chunks as usize)
                .map(|c| {
                    let base = f.i64c((c as u64 * threads) as i64);
                    let w = f.addi(base, self.tid64);
                    let overhang = (c as u64 + 1) * threads > self.geo.items;
                    self.item(f, row, w, c, overhang)
                })
                .collect()
        } else {
            Vec::new()
        };
        for k in 0..=max_level {
            let mut red_st: Vec<Vec<Val>> = a.reds.iter().map(|r| r.op.identity().into_iter().map(|x| f.f32c(x as f32)).collect()).collect();
            let needed = a.reds.iter().any(|r| r.level == k)
                || b.r.outputs.iter().any(|o| a.lay[o.value.index()] == Lay::Elem && a.level[o.value.index()] == k)
                || a.accs.iter().any(|x| x.level == k && matches!(x.src, AccSrc::Elem(_) | AccSrc::RmsDw { .. }));
            if needed {
                if self.geo.unrolled {
                    for it in &items {
                        self.visit(f, k, it, &mut red_st, sacc, cacc)?;
                    }
                } else {
                    self.looped_pass(f, k, row, &mut red_st, sacc)?;
                }
            }
            self.reduce_level(f, k, red_st)?;
            self.row_level(f, k + 1, row, sacc)?;
        }
        if a.rope.is_some() && grid < a.rows {
            f.barrier();
        }
        Ok(())
    }

    /// What pass `k` of a looped row reads per element: the per-element arguments its
    /// reductions, outputs and accumulations depend on, and the outputs of earlier passes it
    /// reads back instead of recomputing them.
    ///
    /// A looped row's pass visits each of its elements from the same thread as every earlier
    /// pass, so a value an earlier pass stored can be loaded again from its output: the stored
    /// value is the computed one rounded to its dtype, which is what the value is (each value is
    /// rounded to its dtype where it is computed), so the results are bit-identical. It saves
    /// the recomputation, which over vocabulary-long rows is the cost: float8 rowwise's cross
    /// entropy recomputed `cross_entropy_bwd` (an `exp` per element) in its quantizing pass.
    fn pass_needs(&self, k: u32) -> PassNeeds {
        let (a, b) = (self.a, self.b);
        let mut reloadable = HashMap::new();
        for (oi, o) in b.r.outputs.iter().enumerate() {
            let v = o.value;
            let plain = !b.def(v).is_some_and(|(n, _)| matches!(n.op, Op::Transpose { .. }));
            if a.lay[v.index()] == Lay::Elem && a.level[v.index()] < k && plain {
                reloadable.entry(v).or_insert(oi);
            }
        }
        let mut roots = Vec::new();
        for red in a.reds.iter().filter(|r| r.level == k) {
            match red.contrib {
                Contrib::Square(v) | Contrib::Plain(v) | Contrib::NegFirstMax { x: v, .. } => roots.push(v),
                Contrib::DyWX { x, w, dy } => roots.extend([x, w, dy]),
                Contrib::ShiftedExp { s, m, .. } => roots.extend([s, m]),
            }
        }
        for o in &b.r.outputs {
            if a.lay[o.value.index()] == Lay::Elem && a.level[o.value.index()] == k {
                roots.push(o.value);
            }
        }
        for acc in a.accs.iter().filter(|x| x.level == k) {
            match acc.src {
                AccSrc::Elem(v) => roots.push(v),
                AccSrc::RmsDw { x, dy, .. } => roots.extend([x, dy]),
                _ => {}
            }
        }
        let mut seen = HashSet::new();
        let mut needs = PassNeeds { args: Vec::new(), reloads: Vec::new() };
        while let Some(v) = roots.pop() {
            if a.lay[v.index()].is_uniform() || !seen.insert(v) {
                continue;
            }
            if let Some(&oi) = reloadable.get(&v) {
                needs.reloads.push((v, oi));
                continue;
            }
            match b.def(v) {
                Some((node, _)) => roots.extend(node.inputs.iter().copied()),
                None if a.lay[v.index()] == Lay::Elem => needs.args.push(v),
                None => {}
            }
        }
        // Loads in argument order, as before (the order only affects when each is issued).
        needs.args.sort_by_key(|&v| b.arg_index(v));
        needs.reloads.sort_by_key(|&(_, oi)| oi);
        needs
    }

    /// Pass `k` of a row too long to unroll: a loop over its chunks carrying the reduction and
    /// scalar-accumulation states (values are recomputed in every pass, or read back from an
    /// earlier pass's output: [`Self::pass_needs`]).
    fn looped_pass(&mut self, f: &mut Func, k: u32, row: Val, red_st: &mut [Vec<Val>], sacc: &mut [Vec<Val>]) -> GenResult<()> {
        let here: Vec<usize> = (0..self.a.reds.len()).filter(|&i| self.a.reds[i].level == k).collect();
        let mut carry: Vec<Val> = here.iter().flat_map(|&i| red_st[i].clone()).collect();
        carry.extend(sacc.iter().flatten().copied());
        let lo = f.i64c(0);
        let hi = f.i64c(self.geo.chunks.div_ceil(self.geo.unroll) as i64);
        let one = f.i64c(1);
        let threads = self.geo.threads;
        let template: Vec<Vec<Val>> = red_st.to_vec();
        let needs = self.pass_needs(k);
        let sacc_len: Vec<usize> = sacc.iter().map(Vec::len).collect();
        let out = f.try_for_loop(lo, hi, one, &carry, |f, c, cs| -> GenResult<Vec<Val>> {
            let mut rs = template.clone();
            let mut at = 0;
            for &i in &here {
                let nc = rs[i].len();
                rs[i] = cs[at..at + nc].to_vec();
                at += nc;
            }
            let mut sa: Vec<Vec<Val>> = Vec::new();
            for &nc in &sacc_len {
                sa.push(cs[at..at + nc].to_vec());
                at += nc;
            }
            // LOOP_UNROLL chunks per iteration, their argument loads issued before any of them is
            // used (and before any store of this pass, which the loads could not move above):
            // with one load per thread in flight the H200 took 1,318 us for the cross entropy
            // and its backward over 4096 x 128256 bf16 logits, 1,276 with 2 chunks per
            // iteration, 1,225 with 4 and 1,216 with 8 (`gpu_check.py perf`). Each thread still
            // visits its chunks in order, so the reductions see the same values in the same order.
            let t = f.i64c((threads * self.geo.unroll) as i64);
            let outer = f.muli(c, t);
            let mut items = Vec::new();
            for u in 0..self.geo.unroll {
                let off = f.i64c((u * threads) as i64);
                let base = f.addi(outer, off);
                let w = f.addi(base, self.tid64);
                items.push(self.item(f, row, w, 0, true));
            }
            for it in &items {
                for pos in &it.pos {
                    for &v in &needs.args {
                        self.ev.lanes(f, v, pos)?;
                    }
                    for &(v, oi) in &needs.reloads {
                        let x = self.ev.load_lanes(f, v, self.p.outs[oi], pos.lin, pos.lanes)?;
                        self.ev.memo.insert((pos.id, v), x);
                    }
                }
            }
            let mut none: Vec<Vec<Val>> = Vec::new();
            for it in &items {
                self.visit(f, k, it, &mut rs, &mut sa, &mut none)?;
            }
            self.ev.forget_items();
            let mut next: Vec<Val> = here.iter().flat_map(|&i| rs[i].clone()).collect();
            next.extend(sa.iter().flatten().copied());
            Ok(next)
        })?;
        let mut at = 0;
        for &i in &here {
            let nc = red_st[i].len();
            red_st[i] = out[at..at + nc].to_vec();
            at += nc;
        }
        for s in sacc.iter_mut() {
            let nc = s.len();
            *s = out[at..at + nc].to_vec();
            at += nc;
        }
        Ok(())
    }
}

/// The arguments a row kernel reads one full row of per row (`[rows, d]`, per element), as
/// (pointer, storage, bytes per row), where a row is a whole number of 16-byte units: the
/// kernel ABI then aligns the tensor to 16 bytes, as `cp.async.bulk.prefetch` needs.
fn prefetch_rows(b: &Body, a: &Analysis, ev: &Eval) -> Vec<(Val, Elem, u64)> {
    b.r.args
        .iter()
        .enumerate()
        .filter(|(_, arg)| a.lay[arg.value.index()] == Lay::Elem && b.numel(arg.value) == a.rows * a.d)
        .filter_map(|(i, arg)| storage(b.dtype(arg.value)).ok().map(|st| (ev.args[i], st, a.d * u64::from(st.bytes()))))
        .filter(|&(_, _, bytes)| bytes % 16 == 0 && bytes < 1 << 31)
        .collect()
}

pub(super) fn gen_rows(b: &Body, a: &Analysis, entry: &str) -> GenResult<Generated> {
    let geo = row_geometry(a)?;
    let has_cacc = a.accs.iter().any(|x| x.col);
    if has_cacc && !geo.unrolled {
        return unsupported(format!(
            "column sums over rows of {} elements next to row reductions; such rows longer than 32768 elements support only per-row and scalar results (a column reduction alone is a column kernel of any width)",
            a.d
        ));
    }
    if a.rows > i32::MAX as u64 {
        return unsupported(format!("{} rows exceed the grid limit", a.rows));
    }
    let grid = if a.accs.is_empty() { a.rows } else { a.rows.min(ACC_GRID_CAP) };
    let ws_bytes = workspace_bytes(a, grid, a.d);
    let Top { mut f, ev, p, tid, bid, is_t0 } = kernel_top(b, a, ws_bytes > 0)?;
    if !geo.unrolled && geo.threads <= WIDE_BLOCK {
        f.min_ctas_per_sm(2);
    }
    let max_comps = a.reds.iter().map(|r| r.op.identity().len()).sum::<usize>().max(a.accs.len());
    let smem = f.shared_array("titan_red", Elem::F32, red_smem(max_comps));
    let tid64 = f.extui(tid, Elem::I64);
    let bid64 = f.extui(bid, Elem::I64);
    let mut rg = RowGen { b, a, ev, p, geo, tid, tid64, is_t0, smem };
    let threads = rg.geo.threads;
    let chunks = rg.geo.chunks as usize;
    let lanes = rg.geo.lanes;
    let sacc_ops: Vec<RedOp> = a.accs.iter().filter(|x| !x.col).map(|x| x.op).collect();
    let cacc_ops: Vec<RedOp> = a.accs.iter().filter(|x| x.col).map(|x| x.op).collect();
    let max_level =
        a.level.iter().zip(&a.lay).filter(|(_, l)| !l.is_post()).map(|(l, _)| *l).max().unwrap_or(0).max(a.reds.iter().map(|r| r.level).max().unwrap_or(0));
    // Loop-carried: scalar partials, then column partials per chunk.
    let mut init: Vec<Val> = identities(&mut f, &sacc_ops).into_iter().flatten().collect();
    let n_s = init.len();
    for op in &cacc_ops {
        let id = f.cf(op.identity()[0], Ty::lanes_of(Elem::F32, lanes));
        init.extend(std::iter::repeat_n(id, chunks));
    }
    let rows = f.i64c(a.rows as i64);
    let gstep = f.i64c(grid as i64);
    // Unrolled rows: the next row's arguments stream into L2 while this one is reduced (looped,
    // vocabulary-long rows already keep LOOP_UNROLL chunks of loads in flight).
    let next_rows = if rg.geo.unrolled && grid < a.rows { prefetch_rows(b, a, &rg.ev) } else { Vec::new() };
    let t0 = rg.is_t0;
    let carried = f.try_for_loop(bid64, rows, gstep, &init, |f, row, st| {
        if !next_rows.is_empty() {
            let next = f.addi(row, gstep);
            let inside = f.cmpi(ICmp::Slt, next, rows);
            let go = f.andi(inside, t0);
            let dd = f.i64c(a.d as i64);
            let at = f.muli(next, dd);
            f.if_then(go, |f| {
                for &(base, st, bytes) in &next_rows {
                    let ptr = f.gep(base, at, st);
                    let n = f.i32c(bytes as i64);
                    f.prefetch_l2(ptr, n);
                }
            });
        }
        let mut sacc: Vec<Vec<Val>> = st[..n_s].iter().map(|&x| vec![x]).collect();
        let mut cacc: Vec<Vec<Val>> = (0..cacc_ops.len()).map(|i| st[n_s + i * chunks..n_s + (i + 1) * chunks].to_vec()).collect();
        rg.row(f, row, max_level, grid, &mut sacc, &mut cacc)?;
        let mut next: Vec<Val> = sacc.into_iter().flatten().collect();
        next.extend(cacc.into_iter().flatten());
        Ok(next)
    })?;
    rg.ev.forget_row();
    rg.ev.row = None;
    // Per-column outputs that need no cross-block sum: block 0 writes them.
    if b.r.outputs.iter().any(|o| a.lay[o.value.index()] == Lay::Col) {
        let dend = f.i64c(a.d as i64);
        let tstep = f.i64c(threads as i64);
        let zero = f.i32c(0);
        let isb0 = f.cmpi(ICmp::Eq, bid, zero);
        let ev = &mut rg.ev;
        let pp = &rg.p;
        f.try_if_then(isb0, |f| {
            f.try_for_loop(tid64, dend, tstep, &[], |f, c, _| -> GenResult<Vec<Val>> {
                let pos = ev.pos(1, c, Some(c));
                for (oi, o) in b.r.outputs.iter().enumerate() {
                    if a.lay[o.value.index()] == Lay::Col {
                        store_output(f, ev, pp, oi, o.value, &pos, None)?;
                    }
                }
                ev.forget_items();
                Ok(vec![])
            })
            .map(|_| ())
        })?;
    }
    if !a.accs.is_empty() {
        let scalar: Vec<Vec<Val>> = carried[..n_s].iter().map(|&x| vec![x]).collect();
        let col: Vec<Vec<Val>> = (0..cacc_ops.len()).map(|i| carried[n_s + i * chunks..n_s + (i + 1) * chunks].to_vec()).collect();
        // The column of each chunk of this thread, and whether it lies inside the row.
        let mut col_of = Vec::new();
        for c in 0..chunks {
            let base = f.i64c((c as u64 * threads) as i64);
            let w = f.addi(base, tid64);
            let l = f.i64c(i64::from(lanes));
            let col = f.muli(w, l);
            let valid = if (c as u64 + 1) * threads > rg.geo.items {
                let n = f.i64c(rg.geo.items as i64);
                Some(f.cmpi(ICmp::Slt, w, n))
            } else {
                None
            };
            col_of.push((col, valid));
        }
        let geom = Geometry { threads: threads as u32, grid, d: a.d, lanes, col_of, smem, tid, bid };
        finish_accs(&mut f, &mut rg.ev, a, &rg.p, Partials { scalar, col }, &geom)?;
    }
    Ok(Generated::new(f.finish(entry, threads as u32, grid as u32), threads as u32, grid as u32, ws_bytes))
}
