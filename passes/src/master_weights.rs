//! `master-weights`: mixed precision. Every parameter becomes an fp32 master weight (a `state` argument) and the
//! model reads a compute copy cast to the parameter's declared dtype at the start of the step.

use crate::PassDiag;
use titan_ir::{ArgKind, DType, Graph, NodeId, Op, TensorType};

use crate::util::replace_uses;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MasterWeightsStats {
    pub params: usize,
    pub casts: usize,
}

/// Turn `param` arguments of `main` into fp32 `state` masters plus compute-dtype casts.
pub fn master_weights(g: &mut Graph) -> Result<MasterWeightsStats, PassDiag> {
    let mut stats = MasterWeightsStats::default();
    let mut casts: Vec<NodeId> = Vec::new();
    for i in 0..g.main.args.len() {
        let ArgKind::Param(info) = g.main.args[i].kind.clone() else { continue };
        let v = g.main.args[i].value;
        let compute = g.main.ty(v).clone();
        if !compute.dtype.is_float() {
            return Err(
                PassDiag::invalid(format!("parameter `{}` has non-float type {compute}", info.name)).at(titan_ir::Loc::Arg(titan_ir::RegionRef::Main, i))
            );
        }
        stats.params += 1;
        g.main.args[i].kind = ArgKind::State(info);
        if compute.dtype == DType::F32 {
            continue;
        }
        g.main.values[v.index()].ty = TensorType::new(DType::F32, compute.shape.clone());
        let n = g.main.add_node(Op::Cast, vec![v], vec![compute]);
        g.main.order.pop();
        let copy = g.main.node(n).results[0];
        if let Some(name) = g.main.value(v).name.clone() {
            g.main.values[copy.index()].name = Some(format!("{name}.{}", g.main.ty(copy).dtype));
        }
        replace_uses(&mut g.main, v, copy, Some(n));
        casts.push(n);
        stats.casts += 1;
    }
    // The compute copies are made before anything else runs.
    let rest = std::mem::take(&mut g.main.order);
    g.main.order = casts;
    g.main.order.extend(rest);
    Ok(stats)
}
