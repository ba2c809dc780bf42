"""Does AdamW's memory traffic hide behind compute-bound GEMMs on one GPU under its power cap?

Issue 15 asks for the optimizer off the critical path. Session 7's probe
(`stream_overlap.py`) timed short bursts on a cool GPU: a second stream hid under 1 ms of
AdamW beside GEMMs, which fill every SM. The step runs at the 700 W cap (docs/notes.md,
Runtime), where what decides a step's time is its energy, so this times the same pair
*sustained*: every mode runs `--warmup` iterations, then `--iters` timed ones back to back
(one CUDA event pair per iteration, median reported), long enough for the power limiter to
settle. Modes:

- `gemm`: 12 bf16 GEMMs [8192 x 4096] x [4096 x 14336] (8B's w1/w3 shape).
- `adamw`: PyTorch's fused AdamW over 1 B fp32 parameters in 4 tensors (28 bytes each, the
  traffic of titan's optimizer per parameter).
- `seq`: both on one stream, one after the other (today's step).
- `overlap`: the GEMMs on a high-priority stream, AdamW on another, joined per iteration.
- `overlap-cN`: the same with `N` SMs carved out of every cuBLAS GEMM
  (`torch._C._set_sm_carveout_experimental`, cuBLASLt's SM count target), so AdamW has SMs of
  its own; `gemm-cN` is the GEMMs alone with that carveout.

"hidden" is `seq - overlap`: the milliseconds a deferred optimizer could take off a step. With
`--smi FILE` (an `nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm --format=csv,noheader,
nounits -lms 20` log, started and stopped by this script) each mode also gets its median power and
SM clock over the second half of its window.

    python3 bench/torch/optimizer_overlap_capped.py [--smi /tmp/smi.csv]
"""

import argparse
import datetime
import statistics
import subprocess
import time

import torch

from stream_overlap import on_two_streams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--params", type=int, default=250_000_000, help="parameters per tensor (4 tensors)")
    ap.add_argument("--carveouts", default="8,16,32")
    ap.add_argument("--smi", help="sample power and clocks with nvidia-smi into this file")
    args = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    a = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 14336, device=dev, dtype=torch.bfloat16)
    c = torch.empty(8192, 14336, device=dev, dtype=torch.bfloat16)
    n = args.params
    ps = [torch.randn(n, device=dev) for _ in range(4)]
    gs = [torch.randn(n, device=dev) * 1e-3 for _ in range(4)]
    m1 = [torch.zeros(n, device=dev) for _ in range(4)]
    m2 = [torch.zeros(n, device=dev) for _ in range(4)]
    steps = [torch.tensor(1.0, device=dev) for _ in range(4)]
    hi, lo = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)

    def gemms():
        for _ in range(12):
            torch.mm(a, b, out=c)

    def adamw():
        torch._fused_adamw_(ps, gs, m1, m2, [], steps, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1,
                            eps=1e-8, amsgrad=False, maximize=False)

    def seq():
        gemms()
        adamw()

    def overlap():
        on_two_streams(gemms, hi, adamw, lo)

    def sustained(fn):
        for _ in range(args.warmup):
            fn()
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters + 1)]
        evs[0].record()
        for i in range(args.iters):
            fn()
            evs[i + 1].record()
        torch.cuda.synchronize()
        return [evs[i].elapsed_time(evs[i + 1]) for i in range(args.iters)]

    has_carveout = hasattr(torch._C, "_set_sm_carveout_experimental")
    modes = [("gemm", gemms, None), ("adamw", adamw, None), ("seq", seq, None), ("overlap", overlap, None)]
    if has_carveout:
        for k in [int(x) for x in args.carveouts.split(",") if x]:
            modes += [(f"gemm-c{k}", gemms, k), (f"overlap-c{k}", overlap, k)]
    modes += [("seq", seq, None), ("overlap", overlap, None)]  # again, for drift
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs, "
          f"carveout API {'yes' if has_carveout else 'no'}; {args.warmup} warm-up + {args.iters} timed iterations per mode", flush=True)
    smi = None
    if args.smi:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,power.draw,clocks.sm", "--format=csv,noheader,nounits",
                                "-lms", "20", "-f", args.smi])
    results = []
    for name, fn, k in modes:
        if has_carveout:
            torch._C._set_sm_carveout_experimental(k)
        t0 = time.time()
        ms = sustained(fn)
        t1 = time.time()
        results.append((name, statistics.median(ms), min(ms), t0, t1))
        print(f"  {name:<12} median {statistics.median(ms):7.2f} ms  min {min(ms):7.2f}", flush=True)
    if has_carveout:
        torch._C._set_sm_carveout_experimental(None)
    if smi:
        smi.terminate()
        smi.wait()
    adamw_ms = next(r[1] for r in results if r[0] == "adamw")
    gb = 4 * n * 28 / 1e9
    print(f"AdamW: {gb:.1f} GB per call, {gb / adamw_ms:.2f} TB/s sustained")
    power = read_smi(args.smi) if args.smi else []
    print("| mode | median ms | hidden vs seq (ms) | median W | median SM MHz |")
    print("|---|---:|---:|---:|---:|")
    seq_ms = [r[1] for r in results if r[0] == "seq"]
    seq_ref = statistics.mean(seq_ms)
    for name, med, _, t0, t1 in results:
        # The second half of each mode's window: the sustained part.
        mid = t0 + (t1 - t0) / 2
        sel = [(w, mhz) for t, w, mhz in power if mid <= t <= t1]
        w = f"{statistics.median(x[0] for x in sel):.0f}" if sel else "-"
        mhz = f"{statistics.median(x[1] for x in sel):.0f}" if sel else "-"
        hidden = f"{seq_ref - med:.2f}" if name.startswith("overlap") else ""
        print(f"| {name} | {med:.2f} | {hidden} | {w} | {mhz} |")


def read_smi(path):
    out = []
    for line in open(path):
        f = [x.strip() for x in line.split(",")]
        if len(f) != 3:
            continue
        try:
            t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((t, float(f[1]), float(f[2])))
        except ValueError:
            continue
    return out


if __name__ == "__main__":
    main()
