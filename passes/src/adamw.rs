//! `adamw`: the optimizer step appended to the training graph: global gradient-norm clipping and
//! AdamW over fp32 master weights with fp32 moments.

use crate::PassDiag;
use titan_ir::{
    AdamWConfig, ArgKind, BinaryOp, CollectiveReduce, DType, Graph, Init, LrSchedule, Mesh, MeshDim, Op, Output, ParamInfo, Placement, ReduceKind, TensorType,
    UnaryOp, Update, Value,
};

use crate::TrainOptions;
use crate::util::{scalar, zeros};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdamWStats {
    pub params: usize,
    pub state_buffers: usize,
}

/// Append clipping and AdamW for every `state` argument with a gradient in `grads`
/// (indexed like `g.main.args`). Adds the `step` input and the `grad_norm` and `lr` outputs.
pub fn append_adamw(g: &mut Graph, grads: &[Option<Value>], opts: &TrainOptions) -> Result<AdamWStats, PassDiag> {
    let mut stats = AdamWStats::default();
    let step = g.main.add_arg(TensorType::scalar(DType::I32), ArgKind::Input, Some("step"));
    let params: Vec<(Value, ParamInfo)> = g
        .main
        .args
        .iter()
        .filter_map(|a| match &a.kind {
            ArgKind::State(p) => Some((a.value, p.clone())),
            _ => None,
        })
        .collect();
    let mut moments = Vec::new();
    for (v, p) in &params {
        let ty = g.main.ty(*v).clone();
        let base = g.main.value(*v).name.clone().unwrap_or_else(|| p.name.replace("{i}", "i"));
        let m =
            g.main.add_arg(ty.clone(), ArgKind::State(ParamInfo { name: format!("{}.exp_avg", p.name), init: Init::Zeros }), Some(&format!("{base}.exp_avg")));
        let s =
            g.main.add_arg(ty, ArgKind::State(ParamInfo { name: format!("{}.exp_avg_sq", p.name), init: Init::Zeros }), Some(&format!("{base}.exp_avg_sq")));
        moments.push((m, s));
    }
    let mesh = Mesh::from_graph(g)?;
    for (v, (m, s)) in params.iter().map(|(v, _)| *v).zip(&moments) {
        let p = g.main.value(v).placement.clone();
        g.main.values[m.index()].placement = p.clone();
        g.main.values[s.index()].placement = p;
    }
    let placements: Vec<Vec<Placement>> = g.main.values.iter().map(|d| d.placement.clone()).collect();
    let mut b = g.main_builder();
    // Gradients (zeros for parameters the loss does not reach).
    let mut gs = Vec::new();
    for (i, (v, _)) in params.iter().enumerate() {
        let arg_index = match b.region.value(*v).def {
            titan_ir::ValueDef::Arg(k) => k as usize,
            titan_ir::ValueDef::Result { .. } => return Err("invariant: a state is an argument".into()),
        };
        let gv = match grads.get(arg_index).copied().flatten() {
            Some(gv) => gv,
            None => {
                let ty = b.ty(*v).clone();
                zeros(&mut b, &ty)?
            }
        };
        let _ = i;
        gs.push(gv);
    }
    // Global norm over all gradients, in f32.
    // Squared sums grouped by the mesh dims their gradient is sharded on: each group's
    // partial sum is all-reduced over those dims, so the norm is the global one.
    let sharded_on = |v: Value| -> Vec<MeshDim> {
        let p = &placements[v.index()];
        MeshDim::ALL.into_iter().filter(|m| mesh.is_some_and(|mesh| mesh.size(*m) > 1) && matches!(p.get(m.index()), Some(Placement::Shard(_)))).collect()
    };
    let mut groups: Vec<(Vec<MeshDim>, Value)> = Vec::new();
    for (&gv, (pv, _)) in gs.iter().zip(&params) {
        let rank = b.ty(gv).rank();
        let sq = b.push1(Op::Unary(UnaryOp::Square), &[gv])?;
        let s = if rank == 0 { sq } else { b.push1(Op::Reduce { kind: ReduceKind::Sum, axes: (0..rank).collect() }, &[sq])? };
        let key = sharded_on(*pv);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, t)) => *t = b.push1(Op::Binary(BinaryOp::Add), &[*t, s])?,
            None => groups.push((key, s)),
        }
    }
    let mut total: Option<Value> = None;
    for (key, mut s) in groups {
        for m in key {
            s = b.push1(Op::AllReduce { mesh_dim: m, reduce: CollectiveReduce::Sum }, &[s])?;
        }
        total = Some(match total {
            None => s,
            Some(t) => b.push1(Op::Binary(BinaryOp::Add), &[t, s])?,
        });
    }
    let total = match total {
        Some(t) => t,
        None => return Err(PassDiag::precondition("the model has no parameters to train (no `state` arguments: run `master-weights` first)")),
    };
    let norm = b.push1(Op::Unary(UnaryOp::Sqrt), &[total])?;
    b.name(norm, "grad_norm");
    if let Some(max_norm) = opts.max_norm {
        let mx = scalar(&mut b, max_norm, DType::F32)?;
        let eps = scalar(&mut b, 1e-6, DType::F32)?;
        let den = b.push1(Op::Binary(BinaryOp::Add), &[norm, eps])?;
        let ratio = b.push1(Op::Binary(BinaryOp::Div), &[mx, den])?;
        let one = scalar(&mut b, 1.0, DType::F32)?;
        let coef = b.push1(Op::Binary(BinaryOp::Min), &[ratio, one])?;
        b.name(coef, "clip_coef");
        for gv in &mut gs {
            *gv = b.push1(Op::Binary(BinaryOp::Mul), &[*gv, coef])?;
        }
    }
    let sched = LrSchedule { lr: opts.lr, warmup_steps: opts.warmup_steps, decay_steps: opts.decay_steps, decay: opts.decay, min_lr_ratio: opts.min_lr_ratio };
    let lr = b.push1(Op::LrSchedule(sched), &[step])?;
    b.name(lr, "lr");
    let cfg = AdamWConfig { beta1: opts.beta1, beta2: opts.beta2, eps: opts.eps, weight_decay: opts.weight_decay };
    let mut updates = Vec::new();
    for (((v, _), &(m, s)), &gv) in params.iter().zip(&moments).zip(&gs) {
        let r = b.push(Op::AdamW(cfg), &[*v, gv, m, s, lr, step])?;
        updates.push(Update { state: *v, value: r[0] });
        updates.push(Update { state: m, value: r[1] });
        updates.push(Update { state: s, value: r[2] });
        stats.params += 1;
        stats.state_buffers += 3;
    }
    g.main.updates.extend(updates);
    g.main.outputs.push(Output { name: Some("grad_norm".into()), value: norm });
    g.main.outputs.push(Output { name: Some("lr".into()), value: lr });
    Ok(stats)
}
