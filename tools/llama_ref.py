"""A reference Llama-3 in PyTorch whose every op mirrors titan's model and dtypes.

titan's model (`titanc new llama3`): HF rotate-half RoPE, HF-order RMSNorm, SwiGLU, GQA and an
output head of its own or tied to the embedding (`tie_embeddings`); parameters are fp32 masters
and every step computes with bf16 copies of them.
This module mirrors that op by op:

- parameters are fp32 (`nn.Parameter`), cast to bf16 where titan casts its masters (the matmuls
  run under bf16 autocast; the embedding table and the norm weights are cast explicitly, since
  autocast leaves `embedding` and elementwise `mul` in fp32);
- activations are bf16 between ops (embedding output, norms, RoPE, attention, SwiGLU, residuals);
- RMSNorm in Hugging Face's order: `n = x * rsqrt(mean(x^2) + eps)` in fp32, rounded to bf16,
  then `n * w` in bf16;
- RoPE in fp32 on the bf16 input, rounded to bf16 (angles from float64 tables);
- attention is `F.scaled_dot_product_attention` (causal, GQA) on bf16 q, k, v;
- the logits are bf16 and the loss is the mean cross entropy computed in fp32 on them.

`bench/torch/llama_baseline.py` (tok/s and MFU) and `tools/torch_parity.py` (loss parity with
titan-run) both use this model. Module names follow TorchTitan's (`layers.{i}.wq`, without its
`attention.`/`feed_forward.` levels); `hf_name` maps them to the Hugging Face names titan-run's
safetensors checkpoints use (docs/checkpoints.md).
"""

from dataclasses import dataclass
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

BF16 = torch.bfloat16


@dataclass
class LlamaConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 192
    vocab_size: int = 256
    seq_len: int = 64
    batch_size: int = 8
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    @property
    def head_dim(self):
        return self.dim // self.n_heads

    @staticmethod
    def from_ir(text):
        """The sizes of a titan graph (`titanc new llama3 ... -o model.ir`): its `meta` and `dims`.

        Raises ValueError naming what is missing, or when the graph uses RoPE scaling (Llama 3.1
        scaling is not mirrored here).
        """
        meta = re.search(r"meta\s*\{([^}]*)\}", text)
        dims = re.search(r"dims\s*\{([^}]*)\}", text)
        if not meta or not dims:
            raise ValueError("the graph has no `meta {...}` or `dims {...}`; pass a model graph written by `titanc new llama3`")
        kv = dict(re.findall(r"(\w+)\s*=\s*(\"[^\"]*\"|[^,\s]+)", meta.group(1) + ", " + dims.group(1)))
        if "scaling" in text or "low_freq_factor" in text:
            raise ValueError("the graph uses RoPE scaling, which llama_ref.py does not mirror; build the model without rope scaling")
        try:
            return LlamaConfig(
                dim=int(kv["dim"]),
                n_layers=int(kv["n_layers"]),
                n_heads=int(kv["n_heads"]),
                n_kv_heads=int(kv["n_kv_heads"]),
                ffn_dim=int(kv["ffn_dim"]),
                vocab_size=int(kv["vocab_size"]),
                seq_len=int(kv["seq"]),
                batch_size=int(kv["batch"]),
                rope_theta=float(kv["rope_theta"]),
                norm_eps=float(kv["norm_eps"]),
                tie_embeddings=kv.get("tie_embeddings", "false") == "true",
            )
        except KeyError as e:
            raise ValueError(f"the graph's meta/dims lack {e}; pass a model graph written by `titanc new llama3`") from None


class RMSNorm(nn.Module):
    """HF `LlamaRMSNorm` with titan's dtypes: `bf16(bf16(x * r) * bf16(w))`, `r` in fp32."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        n = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return n * self.weight.to(x.dtype)


def rope_tables(seq, head_dim, theta, device):
    """cos and sin `[seq, head_dim]` in fp32 (angles in float64), HF "half" layout."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float64), inv)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().float(), emb.sin().float()


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x, cos, sin):
    """RoPE on `x [b, s, h, d]`: computed in fp32, rounded to x's dtype."""
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    xf = x.float()
    return (xf * c + rotate_half(xf) * s).to(x.dtype)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        hd = c.head_dim
        self.n_heads, self.n_kv, self.hd = c.n_heads, c.n_kv_heads, hd
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.wq = nn.Linear(c.dim, c.n_heads * hd, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(c.n_heads * hd, c.dim, bias=False)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.w1 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn_dim, bias=False)

    def forward(self, h, cos, sin):
        b, s, _ = h.shape
        x = self.attention_norm(h)
        q = apply_rope(self.wq(x).view(b, s, self.n_heads, self.hd), cos, sin)
        k = apply_rope(self.wk(x).view(b, s, self.n_kv, self.hd), cos, sin)
        v = self.wv(x).view(b, s, self.n_kv, self.hd)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
        h = h + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        x = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(x)) * self.w3(x))


class Llama(nn.Module):
    """Llama-3 with fp32 parameters; `forward` returns the mean cross entropy (fp32).

    Call it under `torch.autocast("cuda", dtype=torch.bfloat16)` so the linears run in bf16;
    without autocast (fp32 params) the matmuls run in fp32 and only the explicit casts apply.
    """

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList([Block(c) for _ in range(c.n_layers)])
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_embeddings:
            # One parameter serves the embedding and the head (Llama 3.2 1B/3B): `parameters()`
            # and the optimizer see it once, its gradient is the sum of both uses.
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens, targets, cos, sin):
        w = self.tok_embeddings.weight
        h = F.embedding(tokens, w.to(BF16) if torch.is_autocast_enabled("cuda") else w)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten().long())


def float8_convert(model, recipe, filter_fqns):
    """torchao's float8 training on the model's linears, as TorchTitan's `[float8]` converter
    applies it (before compile): `recipe` is torchao's recipe name, `filter_fqns` the
    fully-qualified-name substrings that stay high precision (TorchTitan's `filter_fqns`)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)

    def keep(mod, fqn):
        return isinstance(mod, torch.nn.Linear) and mod.in_features % 16 == 0 and mod.out_features % 16 == 0 and not any(f in fqn for f in filter_fqns)

    return convert_to_float8_training(model, module_filter_fn=keep, config=config)


def hf_name(name):
    """This model's parameter name (`layers.0.wq.weight`) -> the Hugging Face name titan-run's
    checkpoints use (`model.layers.0.self_attn.q_proj.weight`)."""
    fixed = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    m = re.fullmatch(r"layers\.(\d+)\.(\w+)\.weight", name)
    if not m:
        raise ValueError(f"no Hugging Face name for parameter `{name}`")
    i, leaf = m.groups()
    sub = {
        "wq": "self_attn.q_proj",
        "wk": "self_attn.k_proj",
        "wv": "self_attn.v_proj",
        "wo": "self_attn.o_proj",
        "w1": "mlp.gate_proj",
        "w2": "mlp.down_proj",
        "w3": "mlp.up_proj",
        "attention_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }[leaf]
    return f"model.layers.{i}.{sub}.weight"


def init_like_titan(model, seed):
    """TorchTitan's Llama-3 init (as titan's graph declares it): embedding N(0, 1); wq/wk/wv/w1
    trunc-normal(0.02); wo/w2/w3 trunc-normal(0.02 / sqrt(2 (layer + 1))); output trunc-normal
    (dim^-0.5, +-3 std); norms ones. Draws on the model's device from `torch.Generator(seed)`."""
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    std_out = model.c.dim**-0.5
    with torch.no_grad():
        if model.c.tie_embeddings:
            # titan's tied table (`llama.rs`, `embedding_init`): trunc-normal(min(dim^-0.5, 0.02), +-3 std).
            std_emb = min(std_out, 0.02)
            nn.init.trunc_normal_(model.tok_embeddings.weight, 0.0, std_emb, -3 * std_emb, 3 * std_emb, generator=g)
        else:
            model.tok_embeddings.weight.normal_(0.0, 1.0, generator=g)
        for i, blk in enumerate(model.layers):
            depth = 0.02 / (2 * (i + 1)) ** 0.5
            for lin, std in [(blk.wq, 0.02), (blk.wk, 0.02), (blk.wv, 0.02), (blk.w1, 0.02), (blk.wo, depth), (blk.w2, depth), (blk.w3, depth)]:
                nn.init.trunc_normal_(lin.weight, 0.0, std, -2.0, 2.0, generator=g)
            blk.attention_norm.weight.fill_(1.0)
            blk.ffn_norm.weight.fill_(1.0)
        model.norm.weight.fill_(1.0)
        if not model.c.tie_embeddings:
            nn.init.trunc_normal_(model.output.weight, 0.0, std_out, -3 * std_out, 3 * std_out, generator=g)
