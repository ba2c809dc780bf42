"""Would merging the GEMMs that share an operand pay at the power cap? (issue 15, item 3)

A Llama block has two groups of projections that read the same input: q/k/v (from the
attention's rmsnorm) and w1/w3 (from the MLP's). titan runs each as its own cuBLASLt GEMM, and
in the backward adds their input gradients through the `beta = 1` epilogue (the later GEMM reads
the earlier's product as C). Merged, each group is one GEMM with the weights stacked along N
(forward: `x @ [W1; W3]^T`, output `[s, 2f]`), one with the gradients side by side along K
(input gradient: `[dg | du] @ [W1; W3]`, no C to read) and one with M doubled (weight gradient:
`[dg | du]^T @ x = [dW1; dW3]`). Same FLOPs; fewer launches, no C read, larger tiles' worth of
work per GEMM. A third form needs no layout change at all: the members of one shape (w1 and
w3; k and v) as one strided-batched GEMM over their separate buffers, the shared operand
broadcast (batch stride 0); the input gradient (a sum over members) has no batched form and
stays separate there. Before building any of it (stacked parameter placement, strided views, a fusion rule),
this measures what it is worth: each form of each group on the shapes of Llama-3.2 1B and of
Llama-3 8B (seq 8192, batch 1), timed in bursts and held at the power cap (`kernels/tests/nvml.py`:
1 s to settle, SECONDS measured, joules from the board's counter), with PyTorch's cuBLAS
(`torch.matmul`, `Tensor.addmm_` for the `beta = 1` add, as titan's epilogue). Operands are
normal-like bf16 (a GEMM's power depends on its operands' bits).

    python3 bench/torch/gemm_merge.py [--sustain SECONDS] [--rounds N] [--models 1b,8b]

Each row: the form's kernels launched per call (`k`, from torch.profiler: a batched form that
copied its broadcast operand would show one more), its burst time and rate, then each held
round's time, joules, watts and median SM clock.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "kernels", "tests"))

from cuda_timing import cuda_ms  # noqa: E402

# (hidden, ffn, q width, kv width): q = heads x head_dim, kv = kv heads x head_dim.
MODELS = {"1b": (2048, 8192, 2048, 512), "8b": (4096, 14336, 4096, 1024)}
SEQ = 8192


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def groups(h, f, q, kv):
    """{group: {form: (launch, FLOPs)}} for one block's shapes."""
    s = SEQ
    x = rand(s, h)
    out = {}
    for name, widths in (("w1w3", (f, f)), ("qkv", (q, kv, kv))):
        n = sum(widths)
        wcat = rand(n, h, scale=h**-0.5)  # the stacked weights [W1; W3] (rows: out features)
        parts = [p.contiguous() for p in wcat.split(widths, 0)]  # each W_i alone (the separate form)
        gcat = rand(s, n)  # the output gradients side by side, [s, sum widths]
        gparts = [g.contiguous() for g in gcat.split(widths, 1)]
        ycat = torch.empty(s, n, device="cuda", dtype=torch.bfloat16)
        ys = [torch.empty(s, w, device="cuda", dtype=torch.bfloat16) for w in widths]
        dx = torch.empty(s, h, device="cuda", dtype=torch.bfloat16)
        dwcat = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
        dws = [torch.empty(w, h, device="cuda", dtype=torch.bfloat16) for w in widths]

        def fwd_sep(parts=parts, ys=ys):
            for w, y in zip(parts, ys):
                torch.matmul(x, w.t(), out=y)

        def fwd_cat(wcat=wcat, ycat=ycat):
            torch.matmul(x, wcat.t(), out=ycat)

        def dx_sep(parts=parts, gparts=gparts):
            torch.matmul(gparts[0], parts[0], out=dx)
            for g, w in zip(gparts[1:], parts[1:]):
                dx.addmm_(g, w)

        def dx_cat(gcat=gcat, wcat=wcat):
            torch.matmul(gcat, wcat, out=dx)

        def dw_sep(gparts=gparts, dws=dws):
            for g, dw in zip(gparts, dws):
                torch.matmul(g.t(), x, out=dw)

        def dw_cat(gcat=gcat, dwcat=dwcat):
            torch.matmul(gcat.t(), x, out=dwcat)

        # Batched: the same-shaped members (w1 and w3; k and v) as one strided-batched GEMM
        # over their separate buffers, the shared operand broadcast (batch stride 0): what the
        # runtime could launch without moving any parameter or activation.
        same = [i for i, w in enumerate(widths) if w == widths[-1]]
        rest = [i for i in range(len(widths)) if i not in same]
        wst = torch.stack([parts[i] for i in same])  # [b, w, h]: the members' weights, one stride apart
        yst = torch.empty(len(same), s, widths[-1], device="cuda", dtype=torch.bfloat16)
        gst = torch.stack([gparts[i] for i in same])  # [b, s, w]
        dwst = torch.empty(len(same), widths[-1], h, device="cuda", dtype=torch.bfloat16)
        xb = x.unsqueeze(0).expand(len(same), s, h)

        def fwd_bat(wst=wst, yst=yst, rest=rest, parts=parts, ys=ys):
            for i in rest:
                torch.matmul(x, parts[i].t(), out=ys[i])
            torch.bmm(xb, wst.transpose(1, 2), out=yst)

        def dw_bat(gst=gst, dwst=dwst, rest=rest, gparts=gparts, dws=dws):
            for i in rest:
                torch.matmul(gparts[i].t(), x, out=dws[i])
            torch.bmm(gst.transpose(1, 2), xb, out=dwst)

        flops = 2.0 * s * h * n
        out[name] = {
            "fwd": {"separate": (fwd_sep, flops), "merged": (fwd_cat, flops), "batched": (fwd_bat, flops)},
            "dx": {"separate": (dx_sep, flops), "merged": (dx_cat, flops)},
            "dw": {"separate": (dw_sep, flops), "merged": (dw_cat, flops), "batched": (dw_bat, flops)},
        }
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sustain", type=float, default=1.0, metavar="SECONDS", help="seconds held at the cap per form (0: bursts only)")
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--rounds", type=int, default=2, help="times each held pair is measured, alternating the forms")
    a = ap.parse_args()
    import nvml
    from torch.profiler import ProfilerActivity, profile

    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; seq {SEQ}, bf16, cuBLAS through torch.matmul / addmm_")
    print(f"{'model':<5} {'group':<5} {'GEMM':<4} {'form':<9} {'k':>3} {'burst us':>9} {'TFLOP/s':>8} " + " ".join(f"{'held us':>8} {'J':>7} {'W':>4} {'MHz':>5}" for _ in range(a.rounds)))
    for model in a.models.split(","):
        h, f, q, kv = MODELS[model]
        per_block = {"separate": [0.0, 0.0], "merged": [0.0, 0.0], "batched": [0.0, 0.0]}
        for gname, gemms in groups(h, f, q, kv).items():
            for kind, forms in gemms.items():
                bursts = {form: cuda_ms(fn, warmup=5, iters=30) for form, (fn, _) in forms.items()}
                held = {form: [] for form in forms}
                if a.sustain > 0:
                    for _ in range(a.rounds):
                        for form, (fn, _) in forms.items():
                            held[form].append(nvml.sustained(fn, torch.cuda.synchronize, bursts[form], seconds=a.sustain))
                launched = {}
                for form, (fn, _) in forms.items():
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        fn()
                        torch.cuda.synchronize()
                    launched[form] = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
                for form, (fn, flops) in forms.items():
                    us = bursts[form] * 1e3
                    cells = " ".join(f"{r['ms'] * 1e3:>8.1f} {r['J']:>7.4f} {r['W']:>4.0f} {r['MHz']:>5.0f}" for r in held[form])
                    print(f"{model:<5} {gname:<5} {kind:<4} {form:<9} {launched[form]:>3} {us:>9.1f} {flops / (us * 1e-6) / 1e12:>8.0f} {cells}")
                    if held[form]:
                        # The input gradient has no batched form (a sum over the members): the
                        # batched block counts the separate GEMMs there.
                        into = [form] + (["batched"] if kind == "dx" and form == "separate" else [])
                        for key in ("ms", "J"):
                            mean = sum(r[key] for r in held[form]) / len(held[form])
                            for t in into:
                                per_block[t][key == "J"] += mean
        if a.sustain > 0:
            (ms_s, j_s) = per_block["separate"]
            for form in ("merged", "batched"):
                ms_m, j_m = per_block[form]
                print(f"{model}: one block's six GEMM groups held: separate {ms_s:.3f} ms {j_s:.3f} J, {form} {ms_m:.3f} ms {j_m:.3f} J ({form}/separate: time {ms_m / ms_s:.4f}, energy {j_m / j_s:.4f})")


if __name__ == "__main__":
    main()
