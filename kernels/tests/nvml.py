"""A kernel's time and energy *sustained* at the GPU's power cap, through NVML (`libnvidia-ml.so.1`,
the driver's; ctypes, no Python package needed).

The H100/H200 run titan's training step at their 700 W cap (docs/notes.md, Runtime: "the step is
most likely energy-bound"), so a kernel's time in the step follows its energy more than its
latency on a cool GPU, which is what a burst of 20 launches times. `sustained(launch, ms)` runs a
kernel back to back for `warm_s` seconds (the power limiter settles), waits for the queue to
drain (microseconds idle), then for `seconds` more, reading the board's energy counter
(`nvmlDeviceGetTotalEnergyConsumption`, millijoules) before and after, while a thread samples
the SM clock every 50 ms.
"""

import ctypes
import statistics
import threading
import time

NVML_CLOCK_SM = 1

_lib = None
_dev = None


def _nvml():
    global _lib, _dev
    if _lib is None:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        rc = lib.nvmlInit_v2()
        if rc != 0:
            raise RuntimeError(f"nvmlInit_v2 failed ({rc})")
        dev = ctypes.c_void_p()
        rc = lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev))
        if rc != 0:
            raise RuntimeError(f"nvmlDeviceGetHandleByIndex_v2 failed ({rc})")
        _lib, _dev = lib, dev
    return _lib, _dev


def energy_mj():
    """The board's energy counter since the driver loaded, in millijoules."""
    lib, dev = _nvml()
    e = ctypes.c_ulonglong()
    rc = lib.nvmlDeviceGetTotalEnergyConsumption(dev, ctypes.byref(e))
    if rc != 0:
        raise RuntimeError(f"nvmlDeviceGetTotalEnergyConsumption failed ({rc})")
    return e.value


def sm_mhz():
    lib, dev = _nvml()
    c = ctypes.c_uint()
    rc = lib.nvmlDeviceGetClockInfo(dev, NVML_CLOCK_SM, ctypes.byref(c))
    if rc != 0:
        raise RuntimeError(f"nvmlDeviceGetClockInfo failed ({rc})")
    return c.value


def sustained(launch, sync, burst_ms, seconds=2.0, warm_s=1.0):
    """`launch()` queues one launch (of however many kernels), `sync()` waits for the queue;
    `burst_ms` is a launch's time on a cool GPU (to size the windows). Returns a dict: `ms` per
    launch, `J` per launch, mean `W`, median SM `MHz` and the launch count `n`."""
    for _ in range(max(1, int(warm_s * 1e3 / burst_ms))):
        launch()
    sync()
    n = max(4, int(seconds * 1e3 / burst_ms))
    clocks, done = [], threading.Event()

    def sample():
        while not done.wait(0.05):
            clocks.append(sm_mhz())

    sampler = threading.Thread(target=sample, daemon=True)
    e0, t0 = energy_mj(), time.perf_counter()
    sampler.start()
    for _ in range(n):
        launch()
    sync()
    e1, t1 = energy_mj(), time.perf_counter()
    done.set()
    sampler.join()
    wall = t1 - t0
    joules = (e1 - e0) / 1e3
    return {"ms": wall * 1e3 / n, "J": joules / n, "W": joules / wall, "MHz": statistics.median(clocks) if clocks else sm_mhz(), "n": n}
