//! Small graph-editing helpers shared by the passes.

use titan_ir::{Builder, DType, Dim, Op, Region, TensorType, Value, ValueData, ValueDef};

/// A rank-0 constant of `dtype`.
pub fn scalar(b: &mut Builder, value: f64, dtype: DType) -> Result<Value, String> {
    b.push_typed(Op::Constant { value }, &[], TensorType::scalar(dtype))
}

/// A tensor of `ty` filled with zeros.
pub fn zeros(b: &mut Builder, ty: &TensorType) -> Result<Value, String> {
    b.push_typed(Op::Constant { value: 0.0 }, &[], ty.clone())
}

/// `a + b`, or whichever side exists.
pub fn accumulate(b: &mut Builder, acc: Option<Value>, v: Value) -> Result<Value, String> {
    match acc {
        None => Ok(v),
        Some(a) => b.push1(Op::Binary(titan_ir::BinaryOp::Add), &[a, v]),
    }
}

/// Replace every use of `old` as a node input (and in outputs/updates) by `new`, except in
/// `keep` (the node that defines `new` from `old`).
pub fn replace_uses(region: &mut Region, old: Value, new: Value, keep: Option<titan_ir::NodeId>) {
    for (i, node) in region.nodes.iter_mut().enumerate() {
        if keep.map(|k| k.index()) == Some(i) {
            continue;
        }
        for input in &mut node.inputs {
            if *input == old {
                *input = new;
            }
        }
    }
    for o in &mut region.outputs {
        if o.value == old {
            o.value = new;
        }
    }
    for u in &mut region.updates {
        if u.value == old {
            u.value = new;
        }
    }
}

/// Append a result of type `ty` to `node` (used when a block gains outputs).
pub fn add_result(region: &mut Region, node: titan_ir::NodeId, ty: TensorType) -> Value {
    let v = Value(region.values.len() as u32);
    let index = region.nodes[node.index()].results.len() as u32;
    region.values.push(ValueData { ty, def: ValueDef::Result { node, index }, name: None, placement: vec![] });
    region.nodes[node.index()].results.push(v);
    v
}

/// Resolve every dimension of `ty`, as a type of fixed dims.
pub fn fixed_dims(ty: &TensorType, dims: &titan_ir::DimTable) -> Result<Vec<u64>, String> {
    ty.shape.iter().map(|d| titan_ir::shape::resolve_dim(d, dims).ok_or_else(|| format!("unbound dimension `{d}`"))).collect()
}

/// `ty` with its leading dims flattened: `[a, b, c, k] -> [a*b*c, k]`.
pub fn flatten_leading(ty: &TensorType, dims: &titan_ir::DimTable) -> Result<TensorType, String> {
    let d = fixed_dims(ty, dims)?;
    let (last, lead) = d.split_last().ok_or("cannot flatten a scalar")?;
    Ok(TensorType::new(ty.dtype, vec![Dim::Fixed(lead.iter().product()), Dim::Fixed(*last)]))
}
