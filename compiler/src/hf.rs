//! Hugging Face `config.json` of a Llama model (`LlamaForCausalLM`) to a [`LlamaConfig`].
//!
//! Optional keys take the defaults of `transformers.LlamaConfig`; anything the Llama-3 graph
//! cannot express (biases, other activations, other RoPE scalings, a separate `head_dim`) is
//! rejected with a message naming the key rather than silently ignored.

use std::path::Path;

use serde_json::{Map, Value as Json};
use titan_ir::{DType, RopeScaling};

use crate::FrontendError;
use crate::llama::LlamaConfig;

/// The longest default `seq_len` taken from `max_position_embeddings`.
pub const DEFAULT_MAX_SEQ_LEN: u64 = 8192;

/// Read and convert a Hugging Face `config.json`. The result is not validated yet: apply
/// overrides first, then [`LlamaConfig::validate`] (which [`crate::build_llama3`] also runs).
pub fn load_hf_config(path: &Path) -> Result<LlamaConfig, FrontendError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| FrontendError::Io { file: file.clone(), message: e.to_string() })?;
    parse_hf_config(&file, &text)
}

/// Convert the text of a Hugging Face `config.json`; `file` names it in error messages.
/// `batch_size` is 1 and `seq_len` is `min(max_position_embeddings, 8192)`.
pub fn parse_hf_config(file: &str, text: &str) -> Result<LlamaConfig, FrontendError> {
    let err = |message: String| FrontendError::HfConfig { file: file.to_string(), message };
    // Editors on Windows save UTF-8 with a byte-order mark, which JSON parsers reject.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let json: Json = serde_json::from_str(text).map_err(|e| err(format!("invalid JSON: {e}")))?;
    let obj = match &json {
        Json::Object(o) => o,
        other => return Err(err(format!("expected a JSON object at the top level, found {}", kind(other)))),
    };
    let c = Keys { obj, prefix: "" };
    convert(&c).map_err(err)
}

fn convert(c: &Keys) -> Result<LlamaConfig, String> {
    match c.opt_str("model_type")? {
        Some("llama") => {}
        Some(other) => return Err(format!("model_type `{other}` is not supported; titan builds `llama` models only")),
        None => return Err("missing key `model_type`; a Hugging Face Llama config has `\"model_type\": \"llama\"`".into()),
    }
    let hidden_act = c.opt_str("hidden_act")?.unwrap_or("silu");
    if hidden_act != "silu" {
        return Err(format!("hidden_act `{hidden_act}` is not supported; Llama's feed-forward uses `silu`"));
    }
    for key in ["attention_bias", "mlp_bias"] {
        if c.opt_bool(key)? == Some(true) {
            return Err(format!("{key}=true is not supported yet; Llama 3 has no biases, set {key} to false"));
        }
    }
    if let Some(p) = c.opt_f64("attention_dropout")?
        && p != 0.0
    {
        return Err(format!("attention_dropout={p} is not supported yet; set it to 0.0"));
    }
    let dim = c.req_u64("hidden_size")?;
    let n_layers = c.req_u64("num_hidden_layers")?;
    let n_heads = c.req_u64("num_attention_heads")?;
    let n_kv_heads = c.opt_u64("num_key_value_heads")?.unwrap_or(n_heads);
    let ffn_dim = c.req_u64("intermediate_size")?;
    let vocab_size = c.req_u64("vocab_size")?;
    for (key, v) in [
        ("hidden_size", dim),
        ("num_hidden_layers", n_layers),
        ("num_attention_heads", n_heads),
        ("num_key_value_heads", n_kv_heads),
        ("intermediate_size", ffn_dim),
        ("vocab_size", vocab_size),
    ] {
        if v == 0 {
            return Err(format!("{key}=0 must be at least 1; a Llama model needs a positive {key}"));
        }
    }
    if let Some(hd) = c.opt_u64("head_dim")?
        && n_heads.checked_mul(hd) != Some(dim)
    {
        return Err(format!(
            "head_dim={hd} differs from hidden_size / num_attention_heads = {dim} / {n_heads}; a separate head_dim is not supported yet, remove the key or make it {}",
            dim.checked_div(n_heads).unwrap_or(0)
        ));
    }
    let rope_theta = c.opt_f64("rope_theta")?.unwrap_or(10000.0);
    let norm_eps = c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6);
    let max_pos = c.opt_u64("max_position_embeddings")?.unwrap_or(2048);
    let tie_embeddings = c.opt_bool("tie_word_embeddings")?.unwrap_or(false);
    // Newer transformers write `dtype`, older ones `torch_dtype`.
    let dtype_key = if c.obj.contains_key("torch_dtype") { "torch_dtype" } else { "dtype" };
    let dtype = match c.opt_str(dtype_key)? {
        None | Some("bfloat16") => DType::BF16,
        Some("float16") => DType::F16,
        Some("float32") => DType::F32,
        Some(other) => return Err(format!("{dtype_key} `{other}` is not supported; use bfloat16, float16 or float32")),
    };
    let rope_scaling = match c.obj.get("rope_scaling") {
        None | Some(Json::Null) => None,
        Some(Json::Object(s)) => rope_scaling(&Keys { obj: s, prefix: "rope_scaling." })?,
        Some(other) => return Err(format!("key `rope_scaling` must be an object or null, found {}", kind(other))),
    };
    Ok(LlamaConfig {
        dim,
        n_layers,
        n_heads,
        n_kv_heads,
        ffn_dim,
        vocab_size,
        seq_len: max_pos.min(DEFAULT_MAX_SEQ_LEN),
        batch_size: 1,
        rope_theta,
        norm_eps,
        rope_scaling,
        tie_embeddings,
        dtype,
    })
}

fn rope_scaling(c: &Keys) -> Result<Option<RopeScaling>, String> {
    let ty = match c.opt_str("rope_type")? {
        Some(t) => t,
        None => c.opt_str("type")?.ok_or("rope_scaling has no `rope_type`; expected `\"rope_type\": \"llama3\"`")?,
    };
    match ty {
        "llama3" => {}
        "default" => return Ok(None),
        other => return Err(format!("rope_scaling type `{other}` is not supported yet; only `llama3` (or null) is")),
    }
    Ok(Some(RopeScaling {
        factor: c.req_f64("factor")?,
        low_freq_factor: c.req_f64("low_freq_factor")?,
        high_freq_factor: c.req_f64("high_freq_factor")?,
        original_max_position: c.req_u64("original_max_position_embeddings")?,
    }))
}

/// [`LlamaConfig::validate`] of a configuration read from the Hugging Face `config.json` at
/// `path` (with the command-line overrides applied when `overridden`): its errors name the file.
pub fn validate_hf_config(cfg: &LlamaConfig, path: &Path, overridden: bool) -> Result<(), FrontendError> {
    cfg.validate().map_err(|e| FrontendError::HfConfig {
        file: path.display().to_string(),
        message: if overridden { format!("{e} (with the command-line overrides applied)") } else { e.to_string() },
    })
}

/// Typed access to the keys of one JSON object; `prefix` qualifies keys in messages.
struct Keys<'a> {
    obj: &'a Map<String, Json>,
    prefix: &'a str,
}

impl Keys<'_> {
    /// The value of `key`, `None` when absent or null.
    fn get(&self, key: &str) -> Option<&Json> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn wrong(&self, key: &str, want: &str, found: &Json) -> String {
        format!("key `{}{key}` must be {want}, found {} `{}`", self.prefix, kind(found), short(found))
    }

    fn missing(&self, key: &str) -> String {
        format!("missing key `{}{key}`; a Hugging Face Llama config.json has it", self.prefix)
    }

    fn opt_u64(&self, key: &str) -> Result<Option<u64>, String> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| self.wrong(key, "a non-negative integer", v)),
        }
    }

    fn req_u64(&self, key: &str) -> Result<u64, String> {
        self.opt_u64(key)?.ok_or_else(|| self.missing(key))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>, String> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.wrong(key, "a number", v)),
        }
    }

    fn req_f64(&self, key: &str) -> Result<f64, String> {
        self.opt_f64(key)?.ok_or_else(|| self.missing(key))
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, String> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.wrong(key, "true or false", v)),
        }
    }

    fn opt_str(&self, key: &str) -> Result<Option<&str>, String> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.wrong(key, "a string", v)),
        }
    }
}

fn kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a bool",
        Json::Number(n) if n.is_f64() => "a float",
        Json::Number(n) if n.as_i64().is_some_and(|i| i < 0) => "a negative integer",
        Json::Number(_) => "an integer",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

/// The value as JSON, cut to a readable length.
fn short(v: &Json) -> String {
    let s = v.to_string();
    if s.chars().count() > 40 { format!("{}...", s.chars().take(40).collect::<String>()) } else { s }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_transformers() {
        let cfg = parse_hf_config(
            "c.json",
            r#"{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "intermediate_size": 128, "vocab_size": 100}"#,
        )
        .unwrap();
        assert_eq!(cfg.n_kv_heads, 4);
        assert_eq!(cfg.rope_theta, 10000.0);
        assert_eq!(cfg.norm_eps, 1e-6);
        assert_eq!(cfg.seq_len, 2048);
        assert_eq!(cfg.batch_size, 1);
        assert!(!cfg.tie_embeddings);
        assert_eq!(cfg.dtype, DType::BF16);
        assert_eq!(cfg.rope_scaling, None);
    }
}
