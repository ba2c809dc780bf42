"""PyTorch parity: the reference Llama-3 (tools/llama_ref.py) trained on titan-run's own batches
from the same safetensors weights, step by step against titan-run's `--metrics` losses.

  torch_parity.py init    --ir MODEL.ir --out init.safetensors [--seed 0] [--dtype bf16|f32]
  torch_parity.py compare --ir MODEL.ir --init init.safetensors --batches batches.bin \
                          --metrics metrics.jsonl --steps 20 [training flags] [--tolerance 2e-2]

`init` writes TorchTitan-style initial weights with Hugging Face names (docs/checkpoints.md), for
`titan-run --init-from` and for `compare`: Python writes the init (rather than titan-run writing a
step-0 checkpoint) so titan-run needs no new checkpoint semantics, the 6 GB file of the 8B-shaped
model is generated on the GPU in seconds, and titan-run's `--init-from` path (how real Hugging
Face weights come in) is what the check exercises.

`compare` reads the model's sizes from the graph's `meta`/`dims`, the batches titan-run wrote with
`--dump-batches` (int32 little-endian, `[steps, 2 (tokens, targets), batch, seq]`), trains with
`torch.optim.AdamW(foreach=False, fused=False)` (PyTorch's per-tensor math, which titan's AdamW
follows), titan's learning-rate schedule set per step, and clipping with
`clip_grad_norm_` (`coef = min(1, max_norm / (norm + 1e-6))`, titan's). The training flags are
`titanc build`'s (`--lr --warmup-steps --decay-steps --decay --min-lr-ratio --beta1 --beta2 --eps
--weight-decay --max-norm`): pass the same ones to both. It prints a table
`step | titan | torch | abs diff | rel diff` and exits 1 when any step's
`|loss_titan - loss_torch| > tolerance * max(1, loss_titan)`.
"""

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_ref import Llama, LlamaConfig, float8_convert, hf_name, init_like_titan, rope_tables  # noqa: E402


class ParityError(Exception):
    """A bad input: the message says what to change."""


def lr_at(a, s):
    """titan's schedule (ir/src/interp/model.rs `lr_at`) at 1-based step `s`."""
    w, m = a.warmup_steps, a.min_lr_ratio
    if w > 0 and s <= w:
        return a.lr * s / w
    progress = min((s - w) / max(a.decay_steps, 1), 1.0)
    if a.decay == "cosine":
        factor = m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress))
    elif a.decay == "linear":
        factor = 1.0 - (1.0 - m) * progress
    else:
        factor = 1.0
    return a.lr * factor


def read_config(path):
    try:
        text = open(path).read()
    except OSError as e:
        raise ParityError(f"cannot read the model graph `{path}`: {e}; pass the .ir `titanc new` wrote") from None
    try:
        return LlamaConfig.from_ir(text)
    except ValueError as e:
        raise ParityError(f"`{path}`: {e}") from None


def cmd_init(a):
    from safetensors.torch import save_file

    c = read_config(a.ir)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device(dev):
        model = Llama(c)
    init_like_titan(model, a.seed)
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[a.dtype]
    tensors = {hf_name(n): p.detach().to(dtype).cpu().contiguous() for n, p in model.named_parameters()}
    save_file(tensors, a.out, metadata={"format": "pt", "writer": "tools/torch_parity.py init"})
    n = sum(t.numel() for t in tensors.values())
    print(f"torch_parity: wrote {len(tensors)} tensors, {n:,} parameters ({a.dtype}) to {a.out}")


def load_init(model, path):
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except Exception as e:  # safetensors raises several types
        raise ParityError(f"cannot read `{path}`: {e}; pass the file `torch_parity.py init` wrote") from None
    names = {hf_name(n): (n, p) for n, p in model.named_parameters()}
    missing = sorted(set(names) - set(tensors))
    extra = sorted(set(tensors) - set(names))
    if missing or extra:
        raise ParityError(f"`{path}` does not match the model: missing {missing[:4]}, extra {extra[:4]}; write it with `torch_parity.py init --ir` of this graph")
    with torch.no_grad():
        for hf, (n, p) in names.items():
            t = tensors[hf]
            if tuple(t.shape) != tuple(p.shape):
                raise ParityError(f"`{hf}` in `{path}` is {tuple(t.shape)}, the model's `{n}` is {tuple(p.shape)}")
            p.copy_(t.to(p.device, torch.float32))


def read_batches(path, c, steps):
    """`[steps, 2, batch, seq]` int32 from titan-run's `--dump-batches` file."""
    per_step = 2 * c.batch_size * c.seq_len * 4
    try:
        raw = open(path, "rb").read()
    except OSError as e:
        raise ParityError(f"cannot read the batches `{path}`: {e}; run titan-run with --dump-batches {path}") from None
    if len(raw) % per_step:
        raise ParityError(f"`{path}` has {len(raw)} bytes, not a multiple of one step's {per_step} (2 x batch {c.batch_size} x seq {c.seq_len} x int32); was it written for this model?")
    if len(raw) // per_step < steps:
        raise ParityError(f"`{path}` holds {len(raw) // per_step} steps, fewer than --steps {steps}; run titan-run with --steps {steps} or more")
    b = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(-1, 2, c.batch_size, c.seq_len)
    if int(b.min()) < 0 or int(b.max()) >= c.vocab_size:
        raise ParityError(f"`{path}` has token ids outside [0, {c.vocab_size}); was it written for this model?")
    return b


def read_metrics(path, steps):
    rows = {}
    try:
        for line in open(path):
            if line.strip():
                r = json.loads(line)
                rows[int(r["step"])] = r
    except (OSError, ValueError, KeyError) as e:
        raise ParityError(f"cannot read titan-run's metrics `{path}`: {e}; run titan-run with --metrics {path}") from None
    lacking = [s for s in range(1, steps + 1) if s not in rows]
    if lacking:
        raise ParityError(f"`{path}` lacks steps {lacking[:5]}; run titan-run with --steps {steps} or more")
    return rows


def cmd_compare(a):
    c = read_config(a.ir)
    if not torch.cuda.is_available():
        raise ParityError("no CUDA device: the comparison runs the bf16 reference on the GPU titan-run used")
    dev = torch.device("cuda")
    # titan's GEMMs accumulate in f32 (cuBLASLt); forbid cuBLAS's reduced-precision bf16 split-K.
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    batches = read_batches(a.batches, c, a.steps)
    titan = read_metrics(a.metrics, a.steps)
    torch.manual_seed(0)
    with torch.device(dev):
        model = Llama(c)
    load_init(model, a.init)
    if a.float8:
        # torchao's float8 training with the recipe titan was built with (`--float8`): the
        # reference of a `titanc build --float8 RECIPE` run.
        model = float8_convert(model, a.float8, tuple(f for f in a.float8_filter.split(",") if f))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr_at(a, 1), betas=(a.beta1, a.beta2), eps=a.eps, weight_decay=a.weight_decay, foreach=False, fused=False)
    cos, sin = rope_tables(c.seq_len, c.head_dim, c.rope_theta, dev)
    rows = []
    t0 = time.perf_counter()
    for s in range(1, a.steps + 1):
        lr = lr_at(a, s)
        for g in opt.param_groups:
            g["lr"] = lr
        tok = batches[s - 1, 0].to(dev, torch.long)
        tgt = batches[s - 1, 1].to(dev, torch.long)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tok, tgt, cos, sin)
        loss.backward()
        if a.max_norm > 0:
            gn = torch.nn.utils.clip_grad_norm_(params, a.max_norm, foreach=False)
        else:
            gn = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        tr = titan[s]
        rows.append(dict(step=s, titan=float(tr["loss"]), torch=float(loss.detach()), titan_gn=tr.get("grad_norm"), torch_gn=float(gn), titan_lr=tr.get("lr"), lr=lr))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0

    worst, failed = 0.0, []
    lines = [
        "| step | titan | torch | abs diff | rel diff | allowed | titan grad_norm | torch grad_norm | lr |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        d = abs(r["titan"] - r["torch"])
        allowed = a.tolerance * max(1.0, abs(r["titan"]))
        rel = d / max(abs(r["titan"]), 1e-12)
        worst = max(worst, d / allowed)
        if not d <= allowed:  # NaN fails too
            failed.append(r["step"])
        tgn = "null" if r["titan_gn"] is None else f"{r['titan_gn']:.4f}"
        lines.append(f"| {r['step']} | {r['titan']:.5f} | {r['torch']:.5f} | {d:.2e} | {rel:.2e} | {allowed:.2e} | {tgn} | {r['torch_gn']:.4f} | {r['lr']:.3e} |")
    lr_gap = max((abs(r["titan_lr"] - r["lr"]) / r["lr"] for r in rows if r["titan_lr"] is not None and r["lr"] > 0), default=0.0)
    diffs = [abs(r["titan"] - r["torch"]) for r in rows]
    summary = (
        f"{a.label}: {a.steps} steps, batch {c.batch_size} x seq {c.seq_len}; max |Δloss| {max(diffs):.3e} (step {1 + diffs.index(max(diffs))}), "
        f"mean {sum(diffs) / len(diffs):.3e}; max |Δ|/allowed {worst:.2f} (tolerance {a.tolerance:g} x max(1, loss)); "
        f"max relative lr gap {lr_gap:.1e}; torch {elapsed:.1f} s; {torch.cuda.get_device_name()} torch {torch.__version__}"
    )
    table = "\n".join(lines)
    print(table)
    print(summary)
    if a.table_out:
        with open(a.table_out, "w") as f:
            f.write(table + "\n\n" + summary + "\n")
    if lr_gap > 1e-5:
        print(f"torch_parity: titan's lr differs from the schedule by {lr_gap:.1e} (relative); pass torch_parity.py the flags given to `titanc build`", file=sys.stderr)
        return 1
    if failed:
        print(f"torch_parity: {a.label}: steps {failed} exceed the tolerance", file=sys.stderr)
        return 1
    print(f"torch_parity: {a.label}: PASS")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init", help="write TorchTitan-style initial weights with Hugging Face names")
    i.add_argument("--ir", required=True, help="the model graph (`titanc new llama3 ... -o MODEL.ir`)")
    i.add_argument("--out", required=True)
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--dtype", choices=["bf16", "f32"], default="bf16", help="stored dtype (bf16 halves the file; both sides load it exactly)")
    c = sub.add_parser("compare", help="train the reference on titan-run's batches and compare losses")
    c.add_argument("--ir", required=True)
    c.add_argument("--init", required=True)
    c.add_argument("--batches", required=True, help="titan-run --dump-batches FILE")
    c.add_argument("--metrics", required=True, help="titan-run --metrics FILE.jsonl")
    c.add_argument("--steps", type=int, default=20)
    c.add_argument("--tolerance", type=float, default=2e-2, help="allowed |Δloss| per step, times max(1, loss)")
    c.add_argument("--float8", choices=["rowwise", "rowwise_with_gw_hp", "tensorwise"], help="train the reference with torchao's float8 recipe (titanc build --float8)")
    c.add_argument("--float8-filter", default="", help="comma-separated fqn substrings kept high precision (titanc build --float8-filter)")
    c.add_argument("--label", default="model")
    c.add_argument("--table-out", help="also write the table (markdown) to this file")
    # titanc build's training flags, with its defaults.
    c.add_argument("--lr", type=float, default=8e-4)
    c.add_argument("--warmup-steps", type=int, default=200)
    c.add_argument("--decay-steps", type=int, default=800)
    c.add_argument("--decay", choices=["cosine", "linear", "constant"], default="linear")
    c.add_argument("--min-lr-ratio", type=float, default=0.0)
    c.add_argument("--beta1", type=float, default=0.9)
    c.add_argument("--beta2", type=float, default=0.95)
    c.add_argument("--eps", type=float, default=1e-8)
    c.add_argument("--weight-decay", type=float, default=0.1)
    c.add_argument("--max-norm", type=float, default=1.0, help="0 disables clipping (as titanc build)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "init":
            cmd_init(a)
            return 0
        return cmd_compare(a)
    except ParityError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
