"""What the GPU benchmarks share: timing a PyTorch callable with CUDA events, and reading
`titan-run --profile`'s per-kernel table."""

import os
import re
import subprocess
import tempfile

import torch


def require_cudnn():
    """PyTorch's own cuDNN must load, or the baseline is not PyTorch as users run it: on the
    H200 machines, an `LD_LIBRARY_PATH` holding the system's cuDNN 9.14 made torch 2.11 (built
    against 9.19) refuse cuDNN, and SDPA fell back from cuDNN's fused flash kernels to
    FlashAttention-2, which took 6.58 ms fwd+bwd at seq 8192, head_dim 128 where cuDNN's took 3.56
    (docs/performance.md, session 16).
    Returns cuDNN's version; exits with what to change otherwise."""
    try:
        if not torch.backends.cudnn.is_available():
            raise RuntimeError("torch.backends.cudnn.is_available() is False")
        version = torch.backends.cudnn.version()
    except RuntimeError as e:
        ld = os.environ.get("LD_LIBRARY_PATH", "")
        raise SystemExit(
            f"error: PyTorch cannot use its cuDNN ({e}); its attention would not be what a PyTorch user gets. "
            f"Run the PyTorch side without the directories of another cuDNN on LD_LIBRARY_PATH (now {ld!r}), "
            f"e.g. `env -u LD_LIBRARY_PATH ...`"
        ) from e
    return version


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


class ClockSampler:
    """`nvidia-smi` sampling the SM clock, board power and throttle reasons every `ms` while the
    `with` block runs (or between `start()` and `stop()`). The H200 runs a training step at its power cap (docs/notes.md, Runtime),
    so tok/s moves with the clock; each benchmark row reports what the GPU ran at.
    `summary()`: median SM MHz, median watts and the fraction of samples with the software power
    cap active (reason bit 0x4), over the samples taken while busy (above `busy_watts`, which
    leaves out start-up and compilation); None without nvidia-smi or samples."""

    POWER_CAP = 0x4

    def __init__(self, ms=100, busy_watts=150.0):
        self.ms, self.busy_watts, self.proc, self.out, self.samples = ms, busy_watts, None, None, []

    @property
    def started(self):
        return self.out is not None

    def start(self):
        """Start sampling (also `with`); without nvidia-smi there will be no samples."""
        dev = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        cmd = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active", "--format=csv,noheader,nounits",
               "-lms", str(self.ms), "-i", dev if dev.isdigit() else "0"]
        # Samples go to a file, not a pipe: a pipe nobody reads fills and stalls nvidia-smi.
        self.out = tempfile.TemporaryFile(mode="w+")
        try:
            self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None

    def stop(self):
        """Stop sampling and read the samples; nothing to do if never started."""
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.out.seek(0)
            self.samples = parse_clock_samples(self.out.read())
            self.proc = None
        if self.out is not None:
            self.out.close()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def summary(self):
        busy = [s for s in self.samples if s[1] > self.busy_watts]
        if not busy:
            return None
        mid = len(busy) // 2
        return dict(sm_mhz=sorted(s[0] for s in busy)[mid], watts=sorted(s[1] for s in busy)[mid],
                    capped=sum(1 for s in busy if s[2] & ClockSampler.POWER_CAP) / len(busy))


def parse_clock_samples(text):
    """[(SM MHz, watts, throttle reasons)] from `nvidia-smi --format=csv,noheader,nounits` lines
    of `clocks.sm, power.draw, clocks_throttle_reasons.active`; lines that do not parse (e.g.
    `[N/A]`) are skipped."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            samples.append((float(parts[0]), float(parts[1]), int(parts[2], 16)))
        except ValueError:
            continue
    return samples


def clock_note(summary):
    """`SM MHz, W, capped %` columns of a benchmark row ('-' without samples)."""
    if not summary:
        return f"{'-':>7} {'-':>5} {'-':>6}"
    return f"{summary['sm_mhz']:>7.0f} {summary['watts']:>5.0f} {100 * summary['capped']:>5.0f}%"
