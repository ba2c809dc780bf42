"""What the GPU benchmarks share: timing a PyTorch callable with CUDA events, and reading
`titan-run --profile`'s per-kernel table."""

import re

import torch


def cuda_ms(fn, warmup=3, iters=20):
    """Mean milliseconds of `fn()` on the current stream: `warmup` untimed calls, then `iters`
    between two CUDA events."""
    for _ in range(warmup):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / iters


# `   ms/step  share  launches  GB/s  TFLOP/s  name (kind)`, TFLOP/s empty for non-GEMM kinds.
PROFILE_ROW = re.compile(r"^\s+([0-9.]+)\s+[0-9.]+%\s+([0-9]+)\s+[0-9.]+\s+[0-9.]*\s+(\S+) \((\w+)\)$")


def parse_titan_profile(stderr):
    """`titan-run --profile`'s table as [(line, name, kind, ms per step, launches per step)];
    its header lines come as (line, None, None, 0.0, 0)."""
    rows = []
    for line in stderr.splitlines():
        m = PROFILE_ROW.match(line)
        if m:
            rows.append((line, m.group(3), m.group(4), float(m.group(1)), int(m.group(2))))
        elif "time per kernel" in line or "ms/step" in line or "copies and memsets" in line:
            rows.append((line, None, None, 0.0, 0))
    return rows
