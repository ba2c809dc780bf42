//! Model statistics read off a graph: parameter counts and training FLOPs per token.
//!
//! FLOPs follow TorchTitan's `get_nparams_and_flops`: `6 * N + 12 * L * H * Dh * T`, where `N`
//! counts parameters without the token embedding table and `T` is the sequence length.

use std::fmt;

use titan_ir::shape::resolve_dim;
use titan_ir::{ArgKind, Graph};

use crate::FrontendError;

/// The checkpoint name of the token embedding table (excluded from `N` in the FLOPs formula).
pub const EMBEDDING_PARAM: &str = "tok_embeddings.weight";

#[derive(Clone, Debug, PartialEq)]
pub struct ModelStats {
    pub graph: String,
    /// Parameter tensors of `main` (a tied table counts once).
    pub param_tensors: usize,
    /// Elements of every parameter.
    pub params: u128,
    /// Elements of `tok_embeddings.weight`.
    pub embedding_params: u128,
    /// `params - embedding_params`.
    pub non_embedding_params: u128,
    /// `(n_layers, n_heads, head_dim, seq)` from the graph's meta and dims, when present.
    pub attention_shape: Option<(u64, u64, u64, u64)>,
    /// Training (forward + backward) FLOPs per token, when `attention_shape` is known.
    pub flops_per_token: Option<f64>,
}

/// Count the parameters of `g`'s `main` and, for Llama graphs, the FLOPs per token. A graph
/// without `param` arguments (such as a lowered training step) is an error.
pub fn model_stats(g: &Graph) -> Result<ModelStats, FrontendError> {
    let mut params = 0u128;
    let mut embedding_params = 0u128;
    let mut param_tensors = 0usize;
    for a in &g.main.args {
        let ArgKind::Param(info) = &a.kind else { continue };
        let ty = g.main.ty(a.value);
        let mut n = 1u128;
        for d in &ty.shape {
            let size = resolve_dim(d, &g.dims)
                .ok_or_else(|| FrontendError::invalid(format!("parameter `{}` has the unbound dimension `{d}`; bind it in the graph's dims", info.name)))?;
            n = n.saturating_mul(u128::from(size));
        }
        params = params.saturating_add(n);
        param_tensors += 1;
        if info.name == EMBEDDING_PARAM {
            embedding_params = embedding_params.saturating_add(n);
        }
    }
    if param_tensors == 0 {
        return Err(FrontendError::invalid(format!(
            "@{} has no `param` arguments (a training graph keeps weights as `state`); run stats on the model graph, the input of `titanc lower`",
            g.name
        )));
    }
    let non_embedding_params = params - embedding_params;
    let meta = |k: &str| g.meta_i64(k).and_then(|x| u64::try_from(x).ok());
    let seq = g.dims.get("seq").copied().or_else(|| meta("seq_len"));
    let attention_shape = match (meta("n_layers"), meta("n_heads"), meta("head_dim"), seq) {
        (Some(l), Some(h), Some(hd), Some(t)) => Some((l, h, hd, t)),
        _ => None,
    };
    let flops_per_token = attention_shape.map(|(l, h, hd, t)| 6.0 * non_embedding_params as f64 + 12.0 * l as f64 * h as f64 * hd as f64 * t as f64);
    Ok(ModelStats { graph: g.name.clone(), param_tensors, params, embedding_params, non_embedding_params, attention_shape, flops_per_token })
}

/// `8030261248` as `8,030,261,248`.
pub fn with_commas(n: u128) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `8.03B`, `124.44M`, `3.20K`.
pub fn human(n: f64) -> String {
    let units = [(1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")];
    units.iter().find(|(u, _)| n >= *u).map_or_else(|| format!("{n}"), |(u, s)| format!("{:.2}{s}", n / u))
}

impl fmt::Display for ModelStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "graph:                 @{}", self.graph)?;
        writeln!(f, "parameter tensors:     {}", self.param_tensors)?;
        writeln!(f, "parameters:            {} ({})", with_commas(self.params), human(self.params as f64))?;
        writeln!(f, "embedding parameters:  {} ({})", with_commas(self.embedding_params), human(self.embedding_params as f64))?;
        writeln!(f, "non-embedding params:  {} ({})", with_commas(self.non_embedding_params), human(self.non_embedding_params as f64))?;
        match (self.flops_per_token, self.attention_shape) {
            (Some(fl), Some((l, h, hd, t))) => {
                writeln!(f, "training flops/token:  {fl:.4e} (6*N_non_embedding + 12*L*H*Dh*T with L={l}, H={h}, Dh={hd}, T={t})")
            }
            _ => writeln!(f, "training flops/token:  unknown (the graph's meta lacks n_layers, n_heads or head_dim)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_counts() {
        assert_eq!(with_commas(0), "0");
        assert_eq!(with_commas(999), "999");
        assert_eq!(with_commas(1000), "1,000");
        assert_eq!(with_commas(8030261248), "8,030,261,248");
        assert_eq!(human(8.03e9), "8.03B");
        assert_eq!(human(12.0), "12");
    }
}
