#!/usr/bin/env python3
"""Issue 15's attention table: titan's generated attention kernels against PyTorch's
`scaled_dot_product_attention`, forward and backward, in one process on one GPU.

Shapes: causal, 8192 tokens per launch (batch 4 x seq 2048, 2 x 4096, 1 x 8192), head_dim 128
(32 query heads, 8 kv heads: Llama-3 8B) and 64 (64 and 16 heads: the same width), bf16. titan's
kernels come from a perf dump (`TITAN_GPU_DUMP=DIR cargo test --release -p titan-kernels --test
codegen gpu_reference_dump`: the `perf_attention_*` cases), timed as `kernels/tests/gpu_check.py
DIR perf` times them (3 warm-up launches, mean of 20, CUDA events; the backward includes its dQ
prologue launch; on standard normal inputs, see `titan_times`). PyTorch runs SDPA
on `[b, h, s, d]` views of `[b, s, h, d]` tensors with
`enable_gqa=True`, as `tools/llama_ref.py` calls it in the step; its backward is timed alone
(`torch.autograd.grad` of a saved forward). TFLOP/s count the causal matmul flops: forward
`2 b s^2 hq d`, backward 2.5x that (the five GEMM-sized products of FlashAttention-2; titan's
deterministic backward does seven).

    python3 bench/attention_table.py --dump DIR [--markdown FILE] [--sdpa-backend cudnn|flash] [--sustain SECONDS] [--forward-only] [--only SEQ:HEAD_DIM,...]

`--sustain` adds a second table: each kernel run back to back at the power cap, where the
training step runs (docs/notes.md, Runtime), with its time, energy (NVML's counter) and SM clock
there; TFLOP/J counts the same flops as the first table. In a power-capped step a kernel's energy
per launch, more than its burst time, is what it costs (`kernels/tests/nvml.py`).

PyTorch must load its own cuDNN (`require_cudnn`): with another cuDNN on `LD_LIBRARY_PATH`,
torch 2.11 refuses it and SDPA falls back from cuDNN's fused flash kernels to FlashAttention-2
(docs/performance.md, session 16). `--sdpa-backend` pins the backend
(`torch.nn.attention.sdpa_kernel`; not yet run pinned), and the table's first line names the
kernels that ran.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch"))

# [b, s, hq, hkv, d]; the names of the perf cases that codegen.rs writes for them.
SHAPES = [(4, 2048, 32, 8, 128), (2, 4096, 32, 8, 128), (1, 8192, 32, 8, 128), (4, 2048, 64, 16, 64), (2, 4096, 64, 16, 64), (1, 8192, 64, 16, 64)]


def case_names(shape):
    b, s, _, _, d = shape
    if (s, d) == (8192, 128):
        return "perf_attention_fwd_causal", "perf_attention_bwd_causal"
    return f"perf_attention_fwd_causal_s{s}_d{d}_b{b}", f"perf_attention_bwd_causal_s{s}_d{d}_b{b}"


def flops(shape):
    b, s, hq, _, d = shape
    return 4 * b * s * s * hq * d // 2


def titan_times(dump, sustain=None, backward=True, shapes=SHAPES):
    """({case name: ms per launch}, {case name: `nvml.sustained` dict, or None without
    `sustain`}) of titan's attention perf cases on inputs like SDPA's: standard
    normal q, k, v (and dout), the backward's `out` and `lse` computed from them by PyTorch in
    f32 (`bwd_inputs`). A kernel's speed depends on its inputs' bits through power and clock: the
    H200 ran the seq 8192, head_dim 128 forward at 544 TFLOP/s on gpu_check's all-ones fill and
    at 528-529 on normal inputs (2026-12-03)."""
    import gpu_check

    fwd = {case_names(sh)[0] for sh in shapes}
    bwd = {case_names(sh)[1]: sh for sh in shapes}
    if not backward:
        bwd = {}
    wanted = fwd | set(bwd)
    got, held = {}, {}
    for c, ms in gpu_check.timed(dump, lambda name: name in fwd, random_floats=True, sustain=sustain):
        got[c["name"]], held[c["name"]] = ms, c.get("sustained")
    for name, sh in bwd.items():
        args = bwd_inputs(sh)
        for c, ms in gpu_check.timed(dump, lambda n, name=name: n == name, inputs=lambda c, args=args: args, sustain=sustain):
            got[c["name"]], held[c["name"]] = ms, c.get("sustained")
    missing = sorted(wanted - set(got))
    if missing:
        sys.exit(f"attention_table: {dump}/perf.json lacks {missing}; regenerate the dump with this checkout's codegen tests")
    return got, held


def bwd_inputs(shape, seed=0):
    """The bytes of titan's attention backward arguments `(q, k, v, out, lse, dout)` for `shape`:
    standard normal bf16 q, k, v, dout (`[b, s, h, d]`), and the causal forward's `out` (bf16) and
    natural-log `lse` (f32, `[b, hq, s]`) from them, computed per head in f32 by PyTorch."""
    import torch

    b, s, hq, hkv, d = shape
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, do = (torch.randn(b, s, h, d, device=dev, generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv, hq))
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, s, device=dev, dtype=torch.float32)
    causal = torch.ones(s, s, device=dev, dtype=torch.bool).tril()
    for bi in range(b):
        for h in range(hq):
            kv = h // (hq // hkv)
            sc = (q[bi, :, h].float() @ k[bi, :, kv].float().T) / d**0.5
            sc = sc.masked_fill(~causal, float("-inf"))
            lse[bi, h] = torch.logsumexp(sc, dim=-1)
            out[bi, :, h] = (torch.exp(sc - lse[bi, h, :, None]) @ v[bi, :, kv].float()).to(torch.bfloat16)
    raw = lambda t: t.contiguous().view(torch.uint8).cpu().numpy().tobytes()  # noqa: E731
    return [raw(t) for t in (q, k, v, out, lse, do)]


def sdpa_times(shape, iters=20, sustain=None, backward=True):
    """(forward ms, backward ms, backend kernel names, sustained) of PyTorch's SDPA on `shape`;
    `sustained` is None, or with `sustain` (seconds) the forward's and backward's
    `nvml.sustained` dicts (without `backward`, the backward's entries are None)."""
    import torch
    import torch.nn.functional as F
    from cuda_timing import cuda_ms

    b, s, hq, hkv, d = shape
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, s, hq, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(b, s, hkv, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(b, s, hkv, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    do = torch.randn(b, hq, s, d, device=dev, dtype=torch.bfloat16, generator=g)

    def fwd():
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)

    with torch.no_grad():
        t_fwd = cuda_ms(fwd, iters=iters)
    out = fwd()
    t_bwd = cuda_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), iters=iters) if backward else None
    held = None
    if sustain:
        import nvml

        with torch.no_grad():
            held_fwd = nvml.sustained(fwd, torch.cuda.synchronize, t_fwd, seconds=sustain)
        held_bwd = None
        if backward:
            held_bwd = nvml.sustained(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), torch.cuda.synchronize, t_bwd, seconds=sustain)
        held = (held_fwd, held_bwd)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(fwd(), (q, k, v), do)
        torch.cuda.synchronize()
    names = {e.key.removeprefix("void ").split("<")[0].split("(")[0] for e in prof.key_averages()}
    kernels = sorted(n for n in names if any(w in n.lower() for w in ("flash", "fmha", "cudnn", "attention", "sdpa")))
    return t_fwd, t_bwd, kernels, held


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", required=True, help="the perf dump directory (see the module doc)")
    ap.add_argument("--markdown", help="also write the table to this file")
    ap.add_argument("--sdpa-backend", choices=["default", "cudnn", "flash"], default="default", help="pin SDPA's backend")
    ap.add_argument(
        "--sustain",
        type=float,
        metavar="SECONDS",
        help="also run every kernel back to back at the power cap (1 s to settle, then SECONDS measured) and print its time, energy and clock there",
    )
    ap.add_argument("--forward-only", action="store_true", help="time the forward kernels only (titan's and SDPA's)")
    ap.add_argument("--only", metavar="SEQ:HEAD_DIM,...", help="only these shapes, e.g. 8192:128 (the 8B one)")
    a = ap.parse_args()
    backward = not a.forward_only
    shapes = SHAPES
    if a.only:
        want = {tuple(int(x) for x in w.split(":")) for w in a.only.split(",")}
        shapes = [sh for sh in SHAPES if (sh[1], sh[4]) in want]
        if not shapes:
            sys.exit(f"attention_table: no shape matches --only {a.only}; the shapes are " + ", ".join(f"{sh[1]}:{sh[4]}" for sh in SHAPES))
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cuda_timing import require_cudnn

    cudnn = require_cudnn()
    pin = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}.get(a.sdpa_backend)

    titan, titan_held = titan_times(a.dump, a.sustain, backward, shapes)
    rows, held_rows = [], []
    backends = set()
    for sh in shapes:
        f_name, b_name = case_names(sh)
        tf, tb = titan[f_name], titan.get(b_name)
        with sdpa_kernel(pin) if pin is not None else contextlib.nullcontext():
            pf, pb, ks, sdpa_held = sdpa_times(sh, sustain=a.sustain, backward=backward)
        backends.update(ks)
        fl = flops(sh)
        rate = lambda ms, mult=1.0: fl * mult / (ms * 1e-3) / 1e12  # noqa: E731
        b, s, hq, hkv, d = sh
        if backward:
            bwd_cells = f"{tb:.3f} | {rate(tb, 2.5):.0f} | {pb:.3f} | {rate(pb, 2.5):.0f} | {(pf + pb) / (tf + tb):.2f}"
        else:
            bwd_cells = f"- | - | - | - | {pf / tf:.2f} (fwd)"
        rows.append(f"| {s} | {d} | {b} x {hq}/{hkv} | {tf:.3f} | {rate(tf):.0f} | {pf:.3f} | {rate(pf):.0f} | {bwd_cells} |")
        if a.sustain:
            passes = (("fwd", f_name, 1.0, sdpa_held[0]), ("bwd", b_name, 2.5, sdpa_held[1]))
            for way, name, mult, theirs in passes[: 2 if backward else 1]:
                ours = titan_held[name]
                cells = " | ".join(f"{h['ms']:.3f} | {fl * mult / h['J'] / 1e12:.2f} | {h['J']:.3f} | {h['W']:.0f} | {h['MHz']:.0f}" for h in (ours, theirs))
                held_rows.append(f"| {s} | {d} | {way} | {cells} | {ours['J'] / theirs['J']:.3f} |")
    head = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {cudnn}; SDPA kernels: {', '.join(sorted(backends)) or 'unknown'}",
        "",
        "| seq | head_dim | batch x heads (q/kv) | titan fwd ms | TFLOP/s | SDPA fwd ms | TFLOP/s | titan bwd ms | TFLOP/s | SDPA bwd ms | TFLOP/s | SDPA / titan (fwd+bwd time) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    text = "\n".join(head + rows)
    if held_rows:
        text += "\n".join(
            [
                "",
                "",
                f"Sustained at the power cap (1 s to settle, {a.sustain:g} s measured; NVML energy counter, SM clock median of 50 ms samples):",
                "",
                "| seq | head_dim | pass | titan ms | TFLOP/J | J | W | MHz | SDPA ms | TFLOP/J | J | W | MHz | titan J / SDPA J |",
                "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            + held_rows
        )
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
