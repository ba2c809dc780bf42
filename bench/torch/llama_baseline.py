"""Side-by-side benchmark: titan-run vs PyTorch (eager and per-block torch.compile) on one GPU.

Runs, in ONE process on the GPU machine, a PyTorch Llama-3 written to match titan's model
(tools/llama_ref.py: HF rotate-half RoPE, HF-order RMSNorm, SwiGLU, GQA, an untied or tied head, AdamW) on
uniform random tokens (a fresh batch each step), then, on uniform random tokens too (a u32 token
file), `titan-run ARTIFACT --backend cuda --metrics`, and prints tok/s (of the median timed step
on both sides), MFU and peak memory side by side,
then where the time goes: titan-run's per-kernel profile (`--profile`, top 10 with their share,
GB/s and TFLOP/s) and torch.compile's (torch.profiler over one step, top 10 CUDA kernels), with
both grouped into attention / GEMM / optimizer / other.

MFU = (6 * N_non_embedding + 12 * L * H * Dh * T) FLOPs per token / 989 TFLOP/s (TorchTitan's).
Precision policies: "fp32-master" = fp32 parameters and AdamW state under bf16 autocast (titan's
policy); "bf16" = bf16 parameters and state (the peer's default in PERFORMANCE.md).

usage: python3 llama_baseline.py --dim 4096 --n-layers 4 --n-heads 32 --n-kv-heads 8 \
           --ffn 14336 --vocab 128256 --seq 8192 --batch 1 [--tie-embeddings] [--titan-run BIN --artifact DIR]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from llama_ref import Llama, LlamaConfig, float8_convert, init_like_titan, rope_tables  # noqa: E402  (the model lives in tools/llama_ref.py)
from cuda_timing import ClockSampler, clock_note, parse_titan_profile, require_cudnn  # noqa: E402

PEAK_FLOPS = 989e12


def ref_config(a):
    """The reference model's sizes from this script's arguments."""
    return LlamaConfig(dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, ffn_dim=a.ffn, vocab_size=a.vocab,
                       seq_len=a.seq, batch_size=a.batch, rope_theta=a.rope_theta, norm_eps=a.norm_eps, tie_embeddings=a.tie_embeddings)


def flops_per_token(a):
    hd = a.dim // a.n_heads
    per_layer = a.dim * (a.n_heads * hd) * 2 + a.dim * (a.n_kv_heads * hd) * 2 + 3 * a.dim * a.ffn + 2 * a.dim
    # norms + head; tok_embeddings excluded, and so is a head tied to them (titanc's --summary)
    n = a.n_layers * per_layer + a.dim + (0 if a.tie_embeddings else a.vocab * a.dim)
    return 6 * n + 12 * a.n_layers * a.n_heads * hd * a.seq


def kernel_group(name):
    """attention | gemm | optimizer | other, from a CUDA kernel's (or titan kernel kind's) name."""
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "cudnn")):
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "matmul", "linear")):
        return "gemm"
    if any(k in n for k in ("adam", "optimizer", "multi_tensor")):
        return "optimizer"
    return "other"


def print_groups(title, rows):
    """rows: [(name, ms per step)]; prints the per-group totals."""
    groups = {}
    for name, ms in rows:
        g = kernel_group(name)
        groups[g] = groups.get(g, 0.0) + ms
    total = sum(groups.values())
    parts = ", ".join(f"{g} {ms:.1f} ms ({100 * ms / total:.0f}%)" for g, ms in sorted(groups.items(), key=lambda x: -x[1]))
    print(f"{title}: {total:.1f} ms of GPU time per step: {parts}")


_AC_COUNTS = {}


def _ac_policy(ctx, func, *args, **kwargs):
    """TorchTitan's selective op policy: save every odd `mm` of a block (per forward and per
    recompute) and the attention outputs; recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    if func == torch.ops.aten.mm.default:
        key = "recompute" if ctx.is_recompute else "forward"
        _AC_COUNTS[key] = _AC_COUNTS.get(key, 0) + 1
        keep = _AC_COUNTS[key] % 2 == 1
    else:
        keep = any(func == getattr(torch.ops.aten, n).default for n in (
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
            if hasattr(torch.ops.aten, n))
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _ac_context_fn():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    _AC_COUNTS.clear()
    return create_selective_checkpoint_contexts(_ac_policy)


def checkpointed(block, mode):
    """A block under activation checkpointing as TorchTitan applies it (before torch.compile):
    `full` recomputes the whole block; `selective` uses the op policy above."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    return checkpoint_wrapper(block, context_fn=_ac_context_fn, preserve_rng_state=False)


def run_torch(a, compile_blocks, bf16_params, profile=False, ac="none", float8=None, filter_fqns=()):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = Llama(ref_config(a)).to(dev)
    # titan's (TorchTitan's) initial weights: what a GEMM multiplies sets its power draw, and
    # under the H200's 700 W cap its clock (PyTorch's default init made the tied 1B's logits
    # ~45x too large, a loss of ~165).
    init_like_titan(model, 0)
    if bf16_params:
        model = model.to(torch.bfloat16)
    if float8:
        model = float8_convert(model, float8, filter_fqns)
    if ac != "none":
        for i, blk in enumerate(model.layers):
            model.layers[i] = checkpointed(blk, ac)
    if compile_blocks:
        for i, blk in enumerate(model.layers):
            model.layers[i] = torch.compile(blk)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    cos, sin = rope_tables(a.seq, a.dim // a.n_heads, a.rope_theta, dev)
    # A fresh batch every step, as titan-run reads its token file: repeating one batch lets the
    # model memorize it (loss 6.4-7.9 by step 13, session 12), and a memorizing model's activations and
    # gradients are not the workload titan runs (under the power cap, values move the clock).
    batches = a.warmup + a.steps + 1
    tokens = torch.randint(0, a.vocab, (batches, a.batch, a.seq), device=dev)
    targets = torch.randint(0, a.vocab, (batches, a.batch, a.seq), device=dev)
    torch.cuda.reset_peak_memory_stats()

    def step(i):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not bf16_params):
            loss = model(tokens[i], targets[i], cos, sin)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for i in range(a.warmup):
        step(i)
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    # An event between steps (no host sync, so the queue stays ahead as in training); tok/s from
    # the median step, as titan's side, so one step's host stall does not move the row.
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(a.steps + 1)]
    with ClockSampler() as clocks:
        marks[0].record()
        for k in range(a.steps):
            loss = step(a.warmup + k)
            marks[k + 1].record()
        torch.cuda.synchronize()
    dt = statistics.median(marks[k].elapsed_time(marks[k + 1]) for k in range(a.steps)) / 1e3
    tps = a.batch * a.seq / dt
    peak = torch.cuda.max_memory_allocated()
    kernels = gemms = None
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            step(batches - 1)
            torch.cuda.synchronize()

        def device_ms(e):
            us = getattr(e, "device_time_total", None)
            return (us if us is not None else getattr(e, "cuda_time_total", 0.0)) / 1e3

        kernels, gemms = [], []
        for e in prof.key_averages():
            # The kernels themselves (an op's device time is its kernels': counted once, here).
            # (Ranges such as "## Call CompiledFxGraph ##" carry device time too: not kernels.)
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False) and device_ms(e) > 0:
                kernels.append((e.key, device_ms(e), e.count))
        for e in prof.key_averages(group_by_input_shape=True):
            if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm") and device_ms(e) > 0:
                gemms.append((e.key, str(e.input_shapes), device_ms(e), e.count))
        kernels.sort(key=lambda r: -r[1])
        gemms.sort(key=lambda r: -r[2])
    del model, opt
    torch.cuda.empty_cache()
    return dict(tps=tps, mfu=tps * flops_per_token(a) / PEAK_FLOPS, peak=peak, warmup_s=warm, loss=float(loss.detach()), kernels=kernels,
                gemms=gemms, clocks=clocks.summary())


def titan_profile(a):
    """titan-run's per-kernel profile: [(line, name, kind, ms per step)] from `--profile`."""
    cmd = titan_cmd(a, "--steps", "4", "--profile")
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-3000:])
        return None
    return [r[:4] for r in parse_titan_profile(p.stderr)]


def random_tokens(a):
    """A token file of uniform random ids in [0, vocab) (u32, 1M tokens, fixed seed): titan-run
    trains on the same distribution of tokens as the PyTorch side (which draws them with
    torch.randint), so data-dependent kernels (the embedding backward) see the same work."""
    path = f"/tmp/titan_random_tokens_{a.vocab}.bin"
    if not os.path.exists(path):
        g = torch.Generator().manual_seed(0)
        torch.randint(0, a.vocab, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32).numpy().tofile(path)
    return path


def titan_cmd(a, *extra):
    return [a.titan_run, a.artifact, "--backend", "cuda", "--data", random_tokens(a), "--data-format", "u32", *extra]


def metrics_lines(path):
    """Complete lines in titan-run's metrics file so far (0 before it exists)."""
    try:
        with open(path) as f:
            return f.read().count("\n")
    except OSError:
        return 0


def run_titan(a):
    metrics = "/tmp/titan_metrics.jsonl"
    if os.path.exists(metrics):
        os.remove(metrics)
    steps = a.warmup + a.steps
    cmd = titan_cmd(a, "--steps", str(steps), "--metrics", metrics, "--log-every", "1")
    t0 = time.perf_counter()
    out, err = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")
    p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
    # The clock samples cover the timed steps only, as on the PyTorch side: the sampler starts
    # once the last warm-up step's metrics line is written (start-up, GEMM timing and warm-up
    # left out) and stops when titan-run exits.
    clocks = ClockSampler()
    while p.poll() is None:
        if not clocks.started and metrics_lines(metrics) >= a.warmup:
            clocks.start()
        time.sleep(0.01)
    clocks.stop()
    wall = time.perf_counter() - t0
    for f, dst in ((out, sys.stdout), (err, sys.stderr)):
        f.seek(0)
        dst.write(f.read()[-3000:])
        f.close()
    if p.returncode != 0:
        return None
    rows = [json.loads(l) for l in open(metrics)]
    timed = rows[a.warmup:]
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    peak = max((r.get("measured_peak_bytes") or 0) for r in rows) or rows[-1].get("predicted_peak_bytes", 0)
    predicted = max((r.get("predicted_peak_bytes") or 0) for r in rows)
    return dict(tps=tps, mfu=tps * flops_per_token(a) / PEAK_FLOPS, peak=peak, predicted=predicted, warmup_s=wall, loss=rows[-1]["loss"],
                clocks=clocks.summary())


def main():
    ap = argparse.ArgumentParser()
    for k, v in dict(dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, ffn=14336, vocab=128256, seq=8192, batch=1, warmup=3, steps=10).items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--norm-eps", type=float, default=1e-5)
    ap.add_argument("--tie-embeddings", action="store_true", help="one table for the embedding and the output head (Llama 3.2 1B/3B)")
    ap.add_argument("--titan-run")
    ap.add_argument("--artifact")
    ap.add_argument("--only", default="all", help="all | torch | titan | compile (torch.compile at the same policy alone, profiled)")
    ap.add_argument("--float8-artifacts", help="float8 side by side: LABEL=DIR,... where LABEL is bf16 or RECIPE[:FILTER] "
                    "(e.g. rowwise, rowwise:output); each titan artifact against torch.compile per block + torchao "
                    "convert_to_float8_training with that recipe and filter_fqns (fp32 params + bf16 autocast)")
    ap.add_argument("--ac-artifacts", help="activation checkpointing side by side: MODE=DIR,... (none, selective, full) "
                    "titan artifacts, each against torch.compile per block with TorchTitan's policy of that mode")
    a = ap.parse_args()
    cudnn = require_cudnn()
    if a.ac_artifacts:
        return ac_side_by_side(a)
    if a.float8_artifacts:
        return float8_side_by_side(a)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} cuDNN {cudnn}; flops/token {flops_per_token(a):.4g}")
    results = {}
    if a.only in ("all", "titan") and a.titan_run and a.artifact:
        results["titan-run (fp32 master, bf16 compute)"] = run_titan(a)
    if a.only == "compile":
        results["torch.compile per block, fp32 params + bf16 autocast"] = run_torch(a, True, False, profile=True)
    if a.only in ("all", "torch"):
        results["pytorch eager, fp32 params + bf16 autocast"] = run_torch(a, False, False)
        results["torch.compile per block, fp32 params + bf16 autocast"] = run_torch(a, True, False, profile=True)
        results["pytorch eager, bf16 params"] = run_torch(a, False, True)
        results["torch.compile per block, bf16 params"] = run_torch(a, True, True)
    print(f"{'variant':<56} {'tok/s':>10} {'MFU':>7} {'peak GiB':>9} {'warm-up s':>9} {'loss':>8} {'SM MHz':>7} {'W':>5} {'capped':>6}")
    for k, r in results.items():
        if r is None:
            print(f"{k:<56} failed")
            continue
        print(f"{k:<56} {r['tps']:>10.0f} {100 * r['mfu']:>6.1f}% {r['peak'] / 2**30:>9.1f} {r['warmup_s']:>9.1f} {r['loss']:>8.4f} "
              + clock_note(r.get("clocks")))
    print("(tok/s of the median timed step; SM MHz and W: medians of nvidia-smi samples every 100 ms while busy; capped: share of them at the software power cap)")
    if a.only in ("all", "titan") and a.titan_run and a.artifact:
        prof = titan_profile(a)
        if prof:
            print("\n# titan-run --profile (eager steps with an event around every launch; top 10 kernels)")
            kernels = [r for r in prof if r[1] is not None]
            for line, name, _, _ in [r for r in prof if r[1] is None][:2] + kernels[:10]:
                print(line)
            print_groups("titan-run", [(f"{name} {kind}", ms) for _, name, kind, ms in kernels])
    compiled = results.get("torch.compile per block, fp32 params + bf16 autocast")
    if compiled and compiled.get("kernels"):
        ks = compiled["kernels"]
        total = sum(ms for _, ms, _ in ks)
        print(f"\n# torch.compile per block, fp32 params + bf16 autocast: torch.profiler over one step ({total:.1f} ms of kernels; top 10)")
        for name, ms, count in ks[:10]:
            print(f"  {ms:>10.3f} {100 * ms / total:>5.1f}% {count:>8}  {name[:110]}")
        print_groups("torch.compile", [(name, ms) for name, ms, _ in ks])
        sdpa = sorted({"cuDNN" if "cudnn" in n.lower() else "FlashAttention-2" if "pytorch_flash" in n else "other"
                       for n, _, _ in ks if kernel_group(n) == "attention"})
        print(f"torch.compile's attention kernels: {', '.join(sdpa) or 'none seen'}")
        if compiled.get("gemms"):
            gs = compiled["gemms"]
            print(f"\n# torch.compile's GEMM ops in that step, by input shapes ({sum(ms for _, _, ms, _ in gs):.1f} ms; device time of each op's kernels)")
            print(f"  {'ms':>8} {'calls':>5} {'us/call':>8}  op, input shapes")
            for key, shapes, ms, count in gs:
                print(f"  {ms:>8.3f} {count:>5} {1e3 * ms / count:>8.1f}  {key} {shapes}")


def float8_side_by_side(a):
    """titan-run with each float8 artifact and torch.compile per block + torchao with the same
    recipe and filter (TorchTitan's single-GPU policy: fp32 params + bf16 autocast): tok/s, MFU,
    peak memory; then titan-run's profile of the float8 kernels of each artifact."""
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; float8 side by side")
    rows = []
    for item in a.float8_artifacts.split(","):
        label, path = item.split("=", 1)
        recipe, _, filt = label.partition(":")
        filters = tuple(f for f in filt.split("+") if f)
        a.artifact = path
        what = "bf16" if recipe == "bf16" else f"float8 {recipe}, filter [{', '.join(filters)}]"
        rows.append((f"titan-run {what}", run_titan(a)))
        f8 = None if recipe == "bf16" else recipe
        try:
            r = run_torch(a, True, False, float8=f8, filter_fqns=filters)
        except Exception as e:  # a recipe torchao cannot run here is reported, not fatal
            print(f"torch.compile + torchao {what}: {type(e).__name__}: {str(e)[:300]}")
            r = None
        rows.append((f"torch.compile{'' if f8 is None else ' + torchao'} {what}", r))
        for k, r in rows[-2:]:  # as they come, so a run cut short still reports what it measured
            print(f"# {k}: " + ("failed" if r is None else f"{r['tps']:.0f} tok/s, peak {r['peak'] / 2**30:.2f} GiB, loss {r['loss']:.4f}"), flush=True)
    base = {k: r for k, r in rows if r is not None}
    tb = base.get("titan-run bf16")
    print(f"{'variant':<62} {'tok/s':>10} {'vs titan bf16':>13} {'MFU':>7} {'peak GiB':>9} {'loss':>8} {'SM MHz':>7} {'W':>5} {'capped':>6}")
    for k, r in rows:
        if r is None:
            print(f"{k:<62} failed")
            continue
        rel = f"{r['tps'] / tb['tps']:>13.3f}" if tb else f"{'-':>13}"
        print(f"{k:<62} {r['tps']:>10.0f} {rel} {100 * r['mfu']:>6.1f}% {r['peak'] / 2**30:>9.2f} {r['loss']:>8.4f} " + clock_note(r.get("clocks")))
    for item in a.float8_artifacts.split(","):
        label, path = item.split("=", 1)
        if label == "bf16":
            continue
        a.artifact = path
        prof = titan_profile(a)
        if prof:
            kernels = [r for r in prof if r[1] is not None]
            print(f"\n# titan-run --profile, {label}: top 12 kernels")
            for line, _, _, _ in [r for r in prof if r[1] is None][:2] + kernels[:12]:
                print(line)
            print_groups(f"titan-run {label}", [(f"{name} {kind}", ms) for _, name, kind, ms in kernels])


def ac_side_by_side(a):
    """titan-run with each activation-checkpointing artifact and torch.compile per block with the
    same mode (fp32 params + bf16 autocast, TorchTitan's single-GPU policy): tok/s, peak memory."""
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; activation checkpointing side by side")
    rows = []
    for item in a.ac_artifacts.split(","):
        mode, path = item.split("=", 1)
        a.artifact = path
        rows.append((f"titan-run --ac {mode}", run_titan(a)))
        rows.append((f"torch.compile per block, AC {mode}", run_torch(a, True, False, ac=mode)))
    print(f"{'variant':<44} {'tok/s':>10} {'MFU':>7} {'peak GiB':>9} {'predicted':>9} {'loss':>8}")
    for k, r in rows:
        if r is None:
            print(f"{k:<44} failed")
            continue
        pred = f"{r['predicted'] / 2**30:>9.2f}" if r.get("predicted") else f"{'-':>9}"
        print(f"{k:<44} {r['tps']:>10.0f} {100 * r['mfu']:>6.1f}% {r['peak'] / 2**30:>9.2f} {pred} {r['loss']:>8.4f}")


if __name__ == "__main__":
    main()
