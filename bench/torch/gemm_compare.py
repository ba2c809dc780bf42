"""Where titan's GEMM time goes against PyTorch's (issue 15, item 3): every GEMM of an
artifact's step, timed as PyTorch runs the same product, beside titan-run's profile of it.

For each `gemm` kernel of the artifact's manifest (`C[m, n] = op(A) @ op(B)`, row-major, with
its transposes, leading dimensions, batch strides and dtypes: `titan_ir::artifact::GemmDesc`),
PyTorch runs the product on views of the same layout: `torch.matmul` for bf16, `torch._scaled_mm`
with the same per-row / per-column or tensor scales and fast accumulation for fp8 (titan emits
every fp8 GEMM as TN, the layout `_scaled_mm` takes). A second PyTorch timing computes the
transposed product `C^T = op(B)^T @ op(A)^T` (bf16 only): the same math with the operands
swapped, which is the other choice a compiler has; the faster of the two bounds what a layout
change could gain. titan's time is `titan-run --profile`'s (mean of the profiled steps, an
event around every launch), divided by the kernel's launches per step. PyTorch: CUDA events,
3 warm-up launches, mean of 20, inputs drawn once.

    python3 bench/torch/gemm_compare.py ARTIFACT --titan-run BIN [--sustain SECONDS]
    python3 bench/torch/gemm_compare.py ARTIFACT --dry-run      # shapes only, any machine

`--sustain` also compares each GEMM *sustained* at the power cap, where the step runs: titan's
from `titan-run --kernel-energy SECONDS` (its cuBLASLt algorithm on the step's last buffers),
PyTorch's same-layout product back to back (`kernels/tests/nvml.py`, the same protocol: 1 s to
settle, SECONDS measured), each with its time and joules per launch. (`--kernel-energy` measures
the kernels of 99% of the step's time, so a small GEMM may lack titan's columns.)
"""

import argparse
import json
import os
import subprocess
import sys

import re

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "kernels", "tests"))

from cuda_timing import cuda_ms, parse_titan_profile  # noqa: E402

# A row of `titan-run --kernel-energy`'s table: J/step, launches, burst ms, held ms, J/launch, W,
# MHz, name (kind).
ENERGY_ROW = re.compile(r"^\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+(\S+) \((\w+)\)$")

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f8e4m3": torch.float8_e4m3fn, "f8e5m2": torch.float8_e5m2}


def gemms(manifest):
    """(name, GemmDesc) of every GEMM kernel, in schedule order."""
    return [(k["name"], k["gemm"]) for k in manifest["kernels"] if k.get("kind") == "gemm" and k.get("gemm")]


def operand(buf, rows, cols, ld, transposed, batch, stride):
    """op(X) as a [batch, rows, cols] view of `buf`: X stored row-major with leading dimension
    `ld`, as [rows, cols] or (transposed) as [cols, rows]."""
    if transposed:
        return buf.as_strided((batch, cols, rows), (stride, ld, 1)).transpose(1, 2)
    return buf.as_strided((batch, rows, cols), (stride, ld, 1))


def storage_elems(rows, cols, ld, transposed, batch, stride):
    """Elements the stored operand spans."""
    inner = (cols - 1) * ld + rows if transposed else (rows - 1) * ld + cols
    return (batch - 1) * stride + inner


def fill(n, dtype, device):
    x = torch.randn(n, device=device, dtype=torch.float32 if dtype.is_floating_point and dtype.itemsize == 1 else dtype)
    return (x * 0.5).to(dtype) if dtype.itemsize == 1 else x


def product(g, device):
    """Closures running the GEMM as PyTorch would: (same layout, transposed product or None)."""
    m, n, k, batch = g["m"], g["n"], g["k"], g["batch"]
    at, bt = DTYPES[g["a_dtype"]], DTYPES[g["b_dtype"]]
    ct = DTYPES[g["c_dtype"]]
    a_buf = fill(storage_elems(m, k, g["lda"], g["transpose_a"], batch, g["stride_a"]), at, device)
    b_buf = fill(storage_elems(k, n, g["ldb"], g["transpose_b"], batch, g["stride_b"]), bt, device)
    a = operand(a_buf, m, k, g["lda"], g["transpose_a"], batch, g["stride_a"])
    b = operand(b_buf, k, n, g["ldb"], g["transpose_b"], batch, g["stride_b"])
    if at.itemsize == 1:
        if batch != 1:
            raise ValueError("batched fp8 GEMMs are not timed")
        a2, b2 = a[0], b[0]
        vector = g.get("scale_a") == "vector"
        sa = torch.rand((m, 1) if vector else (), device=device) + 0.5
        sb = torch.rand((1, n) if g.get("scale_b") == "vector" else (), device=device) + 0.5
        fast = bool(g.get("fast_accum"))
        return (lambda: torch._scaled_mm(a2, b2, scale_a=sa, scale_b=sb, out_dtype=ct, use_fast_accum=fast)), None
    if batch == 1:
        a2, b2 = a[0], b[0]
        return (lambda: torch.matmul(a2, b2)), (lambda: torch.matmul(b2.t(), a2.t()))
    return (lambda: torch.matmul(a, b)), (lambda: torch.matmul(b.transpose(1, 2), a.transpose(1, 2)))


def titan_profile(titan_run, artifact, sustain=None):
    """({kernel name: (ms per step, launches per step)} of the GEMMs in `titan-run --profile`,
    {kernel name: (held ms per launch, J per launch)} of `--kernel-energy SECONDS`, empty without
    `sustain`)."""
    cmd = [titan_run, artifact, "--backend", "cuda", "--steps", "4", "--profile"] + (["--kernel-energy", str(sustain)] if sustain else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-3000:])
        raise SystemExit(f"titan-run failed: {' '.join(cmd)}")
    held = {}
    if sustain:
        lines = p.stderr.splitlines()
        start = next((i for i, l in enumerate(lines) if "--kernel-energy:" in l), len(lines))
        print("\n".join(lines[start:]) + "\n")
    for line in p.stderr.splitlines():
        m = ENERGY_ROW.match(line)
        if m and m.group(9) == "gemm":
            held[m.group(8)] = (float(m.group(4)), float(m.group(5)))
    return {name: (ms, launches) for _, name, kind, ms, launches in parse_titan_profile(p.stderr) if kind == "gemm"}, held


def describe(g):
    ops = ("T" if g["transpose_a"] else "N") + ("T" if g["transpose_b"] else "N")
    dt = g["a_dtype"] if g["a_dtype"] == g["b_dtype"] else f"{g['a_dtype']}x{g['b_dtype']}"
    extra = " fast" if g.get("fast_accum") else ""
    return f"{g['m']}x{g['n']}x{g['k']}" + (f" b{g['batch']}" if g["batch"] != 1 else "") + f" {ops} {dt}{extra}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--titan-run")
    ap.add_argument("--dry-run", action="store_true", help="build the views on the meta device and print the shapes")
    ap.add_argument("--sustain", type=float, metavar="SECONDS", help="also compare each GEMM sustained at the power cap: time and joules per launch")
    a = ap.parse_args()
    manifest = json.load(open(os.path.join(a.artifact, "manifest.json")))
    items = gemms(manifest)
    if a.dry_run:
        for name, g in items:
            same, swapped = product(g, "meta")
            c = same()
            print(f"{name:<28} {describe(g):<34} C {tuple(c.shape)}" + (f", C^T {tuple(swapped().shape)}" if swapped else ""))
        return
    if not a.titan_run:
        raise SystemExit("--titan-run BIN is needed (or --dry-run)")
    prof, titan_held = titan_profile(a.titan_run, a.artifact, a.sustain)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; {a.artifact}")
    print(f"{'kernel':<28} {'shape':<34} {'launches':>8} {'titan us':>9} {'TFLOP/s':>8} {'torch us':>9} {'TFLOP/s':>8} {'C^T us':>9} {'titan - best, ms/step':>22}")
    tot_titan = tot_torch = tot_best = 0.0
    held = []
    for name, g in items:
        flops = 2.0 * g["m"] * g["n"] * g["k"] * g["batch"]
        same, swapped = product(g, "cuda")
        t_same = cuda_ms(same) * 1e3
        t_swap = cuda_ms(swapped) * 1e3 if swapped else float("nan")
        ms, launches = prof.get(name, (float("nan"), 1))
        t_titan = ms * 1e3 / launches
        best = min(t_same, t_swap) if swapped else t_same
        tot_titan += ms
        tot_torch += t_same * launches / 1e3
        tot_best += best * launches / 1e3
        tf = lambda us: flops / (us * 1e-6) / 1e12  # noqa: E731
        print(f"{name:<28} {describe(g):<34} {launches:>8} {t_titan:>9.1f} {tf(t_titan):>8.0f} {t_same:>9.1f} {tf(t_same):>8.0f} {t_swap:>9.1f} {(t_titan - best) * launches / 1e3:>22.3f}")
        if a.sustain:
            import nvml

            h = nvml.sustained(same, torch.cuda.synchronize, t_same / 1e3, seconds=a.sustain)
            held.append((name, g, launches, titan_held.get(name), h))
        del same, swapped
    print(f"\nper step: titan {tot_titan:.2f} ms, PyTorch same layout {tot_torch:.2f} ms, PyTorch best of the two layouts {tot_best:.2f} ms")
    if held:
        print(f"\nSustained at the power cap (1 s to settle, {a.sustain:g} s measured): titan's cuBLASLt choice (`--kernel-energy`) and PyTorch's same-layout product")
        print(f"{'kernel':<28} {'shape':<34} {'launches':>8} {'titan us':>9} {'titan J':>8} {'torch us':>9} {'torch J':>8} {'torch W':>7} {'MHz':>5} {'J titan/torch':>13}")
        jt = jp = 0.0
        for name, g, launches, t, h in held:
            cells = f"{t[0] * 1e3:>9.1f} {t[1]:>8.4f}" if t else f"{'-':>9} {'-':>8}"
            ratio = f"{t[1] / h['J']:>13.3f}" if t else f"{'-':>13}"
            print(f"{name:<28} {describe(g):<34} {launches:>8} {cells} {h['ms'] * 1e3:>9.1f} {h['J']:>8.4f} {h['W']:>7.0f} {h['MHz']:>5.0f} {ratio}")
            if t:
                jt += t[1] * launches
                jp += h["J"] * launches
        print(f"\nper step, the GEMMs both sides measured: titan {jt:.2f} J, PyTorch {jp:.2f} J ({jt / max(jp, 1e-12):.3f}x)")


if __name__ == "__main__":
    main()
