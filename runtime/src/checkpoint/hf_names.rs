//! Checkpoint tensor names: a titan (TorchTitan) state name to its Hugging Face Llama name, and
//! a state buffer to its checkpoint tensors (one per layer for a stacked buffer).

use super::CheckpointError;

/// Whether a state's checkpoint name is an AdamW moment (stored in `optimizer.safetensors`).
pub fn is_optimizer_state(name: &str) -> bool {
    name.ends_with(".exp_avg") || name.ends_with(".exp_avg_sq")
}

/// The Hugging Face name of a titan (TorchTitan) checkpoint name of one tensor (a per-layer
/// name has its layer index, not `{i}`). Moments keep their suffix after the parameter's HF
/// name. Names outside the Llama scheme are kept as they are.
pub fn hf_name(name: &str) -> String {
    for suffix in [".exp_avg_sq", ".exp_avg"] {
        if let Some(base) = name.strip_suffix(suffix) {
            return format!("{}{suffix}", hf_name(base));
        }
    }
    match name {
        "tok_embeddings.weight" => return "model.embed_tokens.weight".into(),
        "norm.weight" => return "model.norm.weight".into(),
        "output.weight" => return "lm_head.weight".into(),
        _ => {}
    }
    if let Some(rest) = name.strip_prefix("layers.")
        && let Some((layer, tail)) = rest.split_once('.')
        && layer.parse::<u64>().is_ok()
    {
        let mapped = match tail {
            "attention.wq.weight" => "self_attn.q_proj.weight",
            "attention.wk.weight" => "self_attn.k_proj.weight",
            "attention.wv.weight" => "self_attn.v_proj.weight",
            "attention.wo.weight" => "self_attn.o_proj.weight",
            "feed_forward.w1.weight" => "mlp.gate_proj.weight",
            "feed_forward.w2.weight" => "mlp.down_proj.weight",
            "feed_forward.w3.weight" => "mlp.up_proj.weight",
            "attention_norm.weight" => "input_layernorm.weight",
            "ffn_norm.weight" => "post_attention_layernorm.weight",
            _ => return name.to_string(),
        };
        return format!("model.layers.{layer}.{mapped}");
    }
    name.to_string()
}

/// One checkpoint tensor of a state buffer: its HF name, shape and range of the buffer's elements.
pub(super) type Piece = (String, Vec<usize>, std::ops::Range<usize>);

/// The checkpoint tensors of one state buffer, one per layer for a stacked buffer (a name with
/// `{i}`).
pub(super) fn pieces(name: &str, shape: &[usize]) -> Result<Vec<Piece>, CheckpointError> {
    let numel: usize = shape.iter().product();
    if !name.contains("{i}") {
        return Ok(vec![(hf_name(name), shape.to_vec(), 0..numel)]);
    }
    let Some((&layers, rest)) = shape.split_first() else {
        return Err(CheckpointError::Mismatch(format!("stacked state `{name}` is a scalar; it needs a leading layer dim")));
    };
    let per: usize = rest.iter().product();
    Ok((0..layers).map(|l| (hf_name(&name.replace("{i}", &l.to_string())), rest.to_vec(), l * per..(l + 1) * per)).collect())
}
