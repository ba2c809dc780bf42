//! `float8`: float8 training (torchao's `convert_to_float8_training`). Every eligible `linear`
//! of the model — each block's once, serving every layer, and those of `main` such as the
//! output head — becomes a `linear_f8` with the chosen recipe; `autodiff` differentiates it
//! into the recipe's two backward GEMMs and expands its forward into quantization primitives
//! and a `scaled_matmul` ([`expand`]), which `fuse` then groups like any other ops.
//!
//! A linear stays in high precision (with the reason in the report) when:
//! - its input has rank < 2, or K, N or the token count M is not a multiple of 16 (the fp8
//!   GEMMs' alignment; M is the contraction of `grad_weight`),
//! - its weight's fully-qualified name contains an entry of the filter (TorchTitan's
//!   `filter_fqns`, substring match; names are the parameter names with `{i}` for the layer
//!   and without `.weight`, e.g. `layers.{i}.attention.wq`, `output`),
//! - with the `auto` filter, the first-order cost model ([`CostModel`]) predicts the fp8 GEMMs
//!   plus their quantization to be slower than the three high-precision GEMMs.
//!
//! On a mesh the pass runs after `shard-tp`/`shard-dp`: every amax is taken over the rank's
//! local shard (as torchao's rowwise scaling of DTensor shards), and the partial products a
//! row-parallel GEMM sums over tp are dequantized before the reduce-scatter adds them, so a
//! mesh run matches the single-rank run up to fp8 rounding of differently scaled shards.

use std::fmt::Write as _;

use titan_ir::float8::{OperandScaling, Scaling, scalings};
use titan_ir::{ArgKind, BlockId, Builder, DType, Float8Recipe, Graph, NodeId, Op, Region, Value, ValueDef};

use crate::PassDiag;
use crate::util::replace_uses;

/// What `--float8` and `--float8-filter` ask for.
#[derive(Clone, Debug, PartialEq)]
pub struct Float8Options {
    pub recipe: Float8Recipe,
    /// Substrings of fully-qualified names to keep in high precision (TorchTitan's `filter_fqns`).
    pub filter: Vec<String>,
    /// Also keep the linears the cost model finds faster in high precision (`--float8-filter auto`).
    pub auto: bool,
    /// All-gather FSDP weight shards in fp8 (`tensorwise` only; torchao's
    /// `enable_fsdp_float8_all_gather`): the `float8-fsdp-gather` pass.
    pub fsdp_all_gather: bool,
    /// With `fsdp_all_gather`: one amax all-reduce for all weights of a block (torchao's
    /// `precompute_float8_dynamic_scale_for_fsdp`).
    pub precompute_scale: bool,
}

impl Float8Options {
    pub fn new(recipe: Float8Recipe) -> Float8Options {
        Float8Options { recipe, filter: Vec::new(), auto: false, fsdp_all_gather: false, precompute_scale: false }
    }

    /// Parse a comma-separated `--float8-filter` list; `auto` switches the cost-model filter on.
    pub fn with_filter_list(mut self, list: &str) -> Float8Options {
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if item == "auto" {
                self.auto = true;
            } else {
                self.filter.push(item.to_string());
            }
        }
        self
    }

    /// Switch fp8 FSDP all-gathers on (`precompute`: with one batched amax all-reduce per block).
    /// torchao gathers fp8 weights only with tensorwise scaling (TorchTitan asserts the same for
    /// a `recipe_name`): the rowwise recipes quantize along axes a shard does not hold whole.
    pub fn with_fsdp_all_gather(mut self, precompute: bool) -> Result<Float8Options, String> {
        if self.recipe != Float8Recipe::Tensorwise {
            return Err(format!(
                "fp8 FSDP all-gathers need the tensorwise recipe, not `{}` (as torchao: the rowwise recipes gather the weight in bf16 and quantize it after the gather)",
                self.recipe.name()
            ));
        }
        self.fsdp_all_gather = true;
        self.precompute_scale = precompute;
        Ok(self)
    }

    /// The options as `key = value` lines (part of the build's content hash).
    pub fn canonical_lines(&self) -> Vec<String> {
        let mut lines = vec![
            format!("float8.recipe = {}", self.recipe.name()),
            format!("float8.filter = {}", self.filter.join(",")),
            format!("float8.auto = {}", self.auto),
        ];
        if self.fsdp_all_gather {
            lines.push(format!("float8.fsdp_all_gather = true, precompute = {}", self.precompute_scale));
        }
        lines
    }
}

/// First-order costs of one linear's three GEMMs and of the quantization around them, in
/// seconds: GEMMs at a sustained rate, quantization kernels by the bytes they move at HBM
/// bandwidth plus a fixed launch cost. Rates are this project's H200 measurements
/// (`docs/performance.md`): bf16 GEMMs 680-800 TFLOP/s on 8B shapes, fp8 (per-tensor scales)
/// 1,300-1,500, and the 3.8 TB/s the AdamW kernel sustains; the defaults (700 and 1,300) sit at
/// the low end of those ranges.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    pub bf16_flops: f64,
    pub fp8_flops: f64,
    pub hbm_bytes_per_s: f64,
    pub launch_s: f64,
}

impl Default for CostModel {
    fn default() -> CostModel {
        CostModel { bf16_flops: 700e12, fp8_flops: 1300e12, hbm_bytes_per_s: 3.8e12, launch_s: 4e-6 }
    }
}

impl CostModel {
    /// `(high precision, float8)` seconds for one linear of `m × k → n` with `hp_bytes` per
    /// element, under `recipe`. Quantizing an operand reads it once and writes one byte per
    /// element when the scale runs along its rows (the amax fuses into the row pass), and
    /// reads it twice when the amax runs down its columns or over the whole tensor.
    pub fn linear_seconds(&self, recipe: Float8Recipe, m: u64, n: u64, k: u64, hp_bytes: u64) -> (f64, f64) {
        let gemm = 2.0 * (m as f64) * (n as f64) * (k as f64);
        let hp = 3.0 * (gemm / self.bf16_flops + self.launch_s);
        let (fwd, gi, gw) = scalings(recipe, 2);
        let quant = |s: OperandScaling, elems: u64, row_axis: usize| -> f64 {
            let reads = if s.scaling == Scaling::Over(row_axis) { 1.0 } else { 2.0 };
            let bytes = reads * (elems * hp_bytes) as f64 + elems as f64;
            bytes / self.hbm_bytes_per_s + self.launch_s
        };
        let (mk, nk, mn) = (m * k, n * k, m * n);
        let mut f8 = 3.0 * self.launch_s + 2.0 * gemm / self.fp8_flops + quant(fwd.0, mk, 1) + quant(fwd.1, nk, 1) + quant(gi.0, mn, 1) + quant(gi.1, nk, 1);
        f8 += match gw {
            Some((dy, x)) => gemm / self.fp8_flops + quant(dy, mn, 1) + quant(x, mk, 1),
            None => gemm / self.bf16_flops,
        };
        (hp, f8)
    }
}

/// What the pass decided for one linear.
#[derive(Clone, Debug, PartialEq)]
pub struct LinearDecision {
    /// `@block` or `main`.
    pub region: String,
    /// The weight's fully-qualified name (`layers.{i}.attention.wq`).
    pub fqn: String,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// `None`: converted to fp8; `Some(reason)`: kept in high precision.
    pub kept: Option<String>,
    /// The cost model's `(high precision, float8)` microseconds, with the `auto` filter.
    pub cost_us: Option<(f64, f64)>,
}

fn scaling_text(s: OperandScaling, rows: &str, cols: &str) -> String {
    let how = match s.scaling {
        Scaling::Tensor => "tensor".to_string(),
        Scaling::Over(0) => format!("per {cols}"),
        Scaling::Over(_) => format!("per {rows}"),
    };
    format!("{} {how}", s.dtype)
}

/// One line per GEMM of `recipe`: the operands' dtypes and scaling axes.
pub fn recipe_lines(recipe: Float8Recipe) -> [String; 3] {
    let (fwd, gi, gw) = scalings(recipe, 2);
    [
        format!("output      x {} · w {} (fast accumulation)", scaling_text(fwd.0, "row", "column"), scaling_text(fwd.1, "output row", "column")),
        format!("grad_input  dy {} · w {}", scaling_text(gi.0, "row", "column"), scaling_text(gi.1, "row", "input column")),
        match gw {
            Some((dy, x)) => format!("grad_weight dyᵀ {} · x {}", scaling_text(dy, "row", "column"), scaling_text(x, "row", "column")),
            None => "grad_weight dyᵀ · x in high precision".to_string(),
        },
    ]
}

/// The report the build prints: the recipe's GEMMs, then every linear with its decision.
pub fn report_lines(recipe: Float8Recipe, decisions: &[LinearDecision]) -> Vec<String> {
    let mut out = vec![format!("recipe {}:", recipe.name())];
    out.extend(recipe_lines(recipe).into_iter().map(|l| format!("  {l}")));
    let width = decisions.iter().map(|d| d.fqn.len()).max().unwrap_or(0);
    for d in decisions {
        let mut line = format!("{:<width$}  [{}×{}]·[{}×{}]ᵀ  ", d.fqn, d.m, d.k, d.n, d.k);
        match &d.kept {
            None => line.push_str(recipe.name()),
            Some(why) => {
                let _ = write!(line, "bf16: {why}");
            }
        }
        if let Some((hp, f8)) = d.cost_us {
            let _ = write!(line, " (predicted {hp:.1} µs high precision, {f8:.1} µs fp8)");
        }
        out.push(line);
    }
    out
}

/// The name of the parameter `v` reads (through casts, gathers and views), if any.
fn param_name(g: &Graph, region: Option<BlockId>, v: Value) -> Option<String> {
    let r: &Region = match region {
        Some(b) => g.block(b),
        None => &g.main,
    };
    match r.value(v).def {
        ValueDef::Result { node, .. } => {
            let n = r.node(node);
            match n.op {
                Op::Cast | Op::AllGather { .. } | Op::TakeShard { .. } | Op::Reshape | Op::Broadcast { .. } | Op::Transpose { .. } => {
                    param_name(g, region, n.inputs[0])
                }
                _ => None,
            }
        }
        ValueDef::Arg(i) => match region {
            None => match &r.args.get(i as usize)?.kind {
                ArgKind::Param(info) | ArgKind::State(info) => Some(info.name.clone()),
                _ => None,
            },
            Some(b) => {
                // The value the (first) repeat of this block binds to argument `i`.
                let caller = g.main.order.iter().map(|&n| g.main.node(n)).find(|n| matches!(n.op, Op::Repeat { block, .. } if block == b))?;
                param_name(g, None, *caller.inputs.get(i as usize)?)
            }
        },
    }
}

fn fqn_of(g: &Graph, region: Option<BlockId>, w: Value) -> String {
    match param_name(g, region, w) {
        Some(name) => name.strip_suffix(".weight").unwrap_or(&name).to_string(),
        None => {
            let r = region.map_or(&g.main, |b| g.block(b));
            r.value(w).name.clone().unwrap_or_else(|| format!("%{}", w.0))
        }
    }
}

/// Decide one linear.
fn decide(g: &Graph, region: Option<BlockId>, node: NodeId, opts: &Float8Options, cost: &CostModel) -> Result<LinearDecision, PassDiag> {
    let r = region.map_or(&g.main, |b| g.block(b));
    let n = r.node(node);
    let (x, w) = (n.inputs[0], n.inputs[1]);
    let (xt, wt) = (r.ty(x), r.ty(w));
    let fixed = |t: &titan_ir::TensorType| crate::util::fixed_dims(t, &g.dims).map_err(PassDiag::from);
    let (xs, ws) = (fixed(xt)?, fixed(wt)?);
    let k = ws.get(1).copied().unwrap_or(0);
    let nn = ws.first().copied().unwrap_or(0);
    let m: u64 = xs[..xs.len().saturating_sub(1)].iter().product();
    let mut d = LinearDecision {
        region: region.map_or_else(|| "main".to_string(), |b| format!("@{}", g.block(b).name)),
        fqn: fqn_of(g, region, w),
        m,
        n: nn,
        k,
        kept: None,
        cost_us: None,
    };
    let keep = if xs.len() < 2 {
        Some(format!("its input {xt} has rank < 2"))
    } else if !matches!(xt.dtype, DType::BF16 | DType::F16 | DType::F32) {
        Some(format!("its input is {}", xt.dtype))
    } else if !k.is_multiple_of(16) || !nn.is_multiple_of(16) {
        Some(format!("K = {k} and N = {nn} must be multiples of 16 for the fp8 GEMMs"))
    } else if !m.is_multiple_of(16) {
        Some(format!("the token count M = {m} must be a multiple of 16 (grad_weight contracts over it)"))
    } else {
        opts.filter.iter().find(|f| d.fqn.contains(f.as_str())).map(|f| format!("filtered (`{f}`)"))
    };
    d.kept = keep;
    if d.kept.is_none() && opts.auto {
        let (hp, f8) = cost.linear_seconds(opts.recipe, m, nn, k, xt.dtype.size_bytes() as u64);
        d.cost_us = Some((hp * 1e6, f8 * 1e6));
        if f8 >= hp {
            d.kept = Some("the cost model predicts fp8 slower (`auto` filter)".to_string());
        }
    }
    Ok(d)
}

/// Every `linear` of the graph (blocks in order, then `main`) with its node.
fn linears(g: &Graph) -> Vec<(Option<BlockId>, NodeId)> {
    let mut out = Vec::new();
    let regions = (0..g.blocks.len()).map(|i| Some(BlockId(i as u32))).chain([None]);
    for region in regions {
        let r = region.map_or(&g.main, |b| g.block(b));
        for &n in &r.order {
            if matches!(r.node(n).op, Op::Linear) {
                out.push((region, n));
            }
        }
    }
    out
}

/// The decisions [`float8`] would take, without changing the graph.
pub fn plan(g: &Graph, opts: &Float8Options) -> Result<Vec<LinearDecision>, PassDiag> {
    let cost = CostModel::default();
    linears(g).into_iter().map(|(region, n)| decide(g, region, n, opts, &cost)).collect()
}

/// Convert every eligible `linear` to `linear_f8`; returns the decisions, in [`plan`]'s order.
pub fn float8(g: &mut Graph, opts: &Float8Options) -> Result<Vec<LinearDecision>, PassDiag> {
    if g.blocks.iter().chain([&g.main]).any(|r| r.order.iter().any(|&n| matches!(r.node(n).op, Op::LinearF8 { .. } | Op::ScaledMatmul { .. }))) {
        return Err(PassDiag::precondition("the graph already has float8 ops: `float8` has run on it"));
    }
    if crate::train::gradient_map(g)?.is_some() {
        return Err(PassDiag::precondition("`float8` runs before `autodiff` (its VJP emits the backward fp8 GEMMs); this graph is already differentiated"));
    }
    let cost = CostModel::default();
    let mut decisions = Vec::new();
    for (region, n) in linears(g) {
        let d = decide(g, region, n, opts, &cost)?;
        if d.kept.is_none() {
            let r = match region {
                Some(b) => &mut g.blocks[b.index()],
                None => &mut g.main,
            };
            r.nodes[n.index()].op = Op::LinearF8 { recipe: opts.recipe };
        }
        decisions.push(d);
    }
    Ok(decisions)
}

/// Replace every `linear_f8` of `region` by its forward as primitives, in place (the
/// expansion takes the node's position in the order). Returns how many were expanded.
fn expand_region(region: &mut Region, dims: &titan_ir::DimTable, blocks: &[Region]) -> Result<usize, PassDiag> {
    if !region.order.iter().any(|&n| matches!(region.node(n).op, Op::LinearF8 { .. })) {
        return Ok(0);
    }
    let old = std::mem::take(&mut region.order);
    let mut expanded = 0;
    for n in old {
        let Op::LinearF8 { recipe } = region.node(n).op else {
            region.order.push(n);
            continue;
        };
        let (x, w, y) = (region.node(n).inputs[0], region.node(n).inputs[1], region.node(n).results[0]);
        let name = region.value(y).name.clone();
        let new = {
            let mut b = Builder::new(region, dims, blocks);
            titan_ir::float8::forward(&mut b, x, w, recipe)?
        };
        replace_uses(region, y, new, None);
        region.values[new.index()].name = name;
        region.values[y.index()].name = None;
        expanded += 1;
    }
    Ok(expanded)
}

/// Expand every `linear_f8` of the graph (see [`expand_region`]); `autodiff` calls this once
/// it has differentiated them.
pub fn expand(g: &mut Graph) -> Result<usize, PassDiag> {
    let mut total = 0;
    for i in 0..g.blocks.len() {
        let mut r = std::mem::take(&mut g.blocks[i]);
        let res = expand_region(&mut r, &g.dims, &g.blocks);
        g.blocks[i] = r;
        total += res?;
    }
    let mut main = std::mem::take(&mut g.main);
    let res = expand_region(&mut main, &g.dims, &g.blocks);
    g.main = main;
    Ok(total + res?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_model_prefers_fp8_on_large_gemms_only() {
        let c = CostModel::default();
        let (hp, f8) = c.linear_seconds(Float8Recipe::Rowwise, 8192, 14336, 4096, 2);
        assert!(f8 < hp, "8B w1: {f8} vs {hp}");
        let (hp, f8) = c.linear_seconds(Float8Recipe::Rowwise, 1024, 64, 64, 2);
        assert!(f8 > hp, "a tiny GEMM: {f8} vs {hp}");
    }

    #[test]
    fn filter_list_parses_auto_and_names() {
        let o = Float8Options::new(Float8Recipe::Rowwise).with_filter_list("output, auto,,layers.{i}.attention.wo");
        assert!(o.auto);
        assert_eq!(o.filter, vec!["output".to_string(), "layers.{i}.attention.wo".to_string()]);
    }

    #[test]
    fn recipe_lines_name_every_gemm() {
        let l = recipe_lines(Float8Recipe::Rowwise);
        assert!(l[1].contains("w f8e4m3 per input column"), "{l:?}");
        let l = recipe_lines(Float8Recipe::Tensorwise);
        assert!(l[1].starts_with("grad_input  dy f8e5m2 tensor"), "{l:?}");
        assert!(recipe_lines(Float8Recipe::RowwiseWithGwHp)[2].contains("high precision"));
    }
}
