#!/usr/bin/env python3
"""Run kernels dumped by `TITAN_GPU_DUMP=<dir> cargo test -p titan-kernels --test codegen
gpu_reference_dump` on a GPU and compare them with the reference interpreter's outputs.

Usage: python3 kernels/tests/gpu_check.py <dir> [perf]   (needs only the CUDA driver, libcuda.so.1)
`perf` times the kernels of <dir>/perf.json on device-filled inputs instead (TFLOP/s for cases
with `flops`; float inputs all 1.0, or standard normal with `TITAN_GPU_RANDOM=1`).
`TITAN_GPU_ONLY=<substring>` restricts both modes to the matching case names.

Each kernel runs twice on the same inputs with one zeroed workspace: the second run checks
that the kernel left the workspace zeroed (unless it is `scratch`, then it is poisoned before each
run) and that results are bitwise reproducible (a case with `"deterministic": false` may differ
between runs: the difference is printed, and both runs are held to the tolerances). A case with
`pre_entry` launches that entry of the same module first (a kernel's prologue phase: its own
grid, block and shared memory), one with `post_entry` that entry last, with the same arguments.
"""
import ctypes
import json
import math
import os
import struct
import sys

cu = ctypes.CDLL("libcuda.so.1")
# `TITAN_GPU_ONLY=attention` runs only the cases whose name contains the string.
ONLY = os.environ.get("TITAN_GPU_ONLY", "")


def check(rc, what):
    if rc != 0:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {rc} {name.value}")


SIZES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i64": 8, "f8e4m3": 1, "f8e5m2": 1}


def f8(b, dtype):
    """One fp8 byte as a float (e4m3: bias 7, no infinities, S.1111.111 is NaN; e5m2: IEEE-like)."""
    e_bits, bias = (4, 7) if dtype == "f8e4m3" else (5, 15)
    m_bits = 7 - e_bits
    sign = -1.0 if b & 0x80 else 1.0
    e = (b >> m_bits) & ((1 << e_bits) - 1)
    m = b & ((1 << m_bits) - 1)
    if dtype == "f8e4m3" and e == 15 and m == 7:
        return math.nan
    if dtype == "f8e5m2" and e == 31:
        return math.nan if m else sign * math.inf
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - m_bits)
    return sign * (1 + m / 2.0**m_bits) * 2.0 ** (e - bias)


def decode(raw, dtype):
    if dtype == "f32":
        return list(struct.unpack(f"<{len(raw)//4}f", raw))
    if dtype == "bf16":
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in struct.unpack(f"<{len(raw)//2}H", raw)]
    if dtype == "f16":
        return list(struct.unpack(f"<{len(raw)//2}e", raw))
    if dtype == "i32":
        return list(struct.unpack(f"<{len(raw)//4}i", raw))
    if dtype == "i64":
        return list(struct.unpack(f"<{len(raw)//8}q", raw))
    if dtype in ("f8e4m3", "f8e5m2"):
        return [f8(b, dtype) for b in raw]
    raise ValueError(dtype)


def ulp(dtype):
    return {"f32": 2.0**-23, "bf16": 2.0**-7, "f16": 2.0**-10}.get(dtype, 0.0)


def compare(got, exp, dtype):
    n = len(exp)
    exact = within1 = nan_bad = 0
    worst = 0.0
    compare.max_abs = 0.0
    worst_i = -1
    u = ulp(dtype)
    finite = [e for e in exp if not isinstance(e, int) and math.isfinite(e)]
    # Errors are relative to max(|e|, rms of the output): sums that cancel to ~0 (column sums,
    # gradients) are judged at the scale of the tensor, not of the near-zero element.
    rms = math.sqrt(sum(e * e for e in finite) / len(finite)) if finite else 0.0
    for i, (g, e) in enumerate(zip(got, exp)):
        if isinstance(e, int):
            exact += g == e
            continue
        if math.isnan(e) or math.isnan(g):
            if math.isnan(e) and math.isnan(g):
                exact += 1
            else:
                nan_bad += 1
            continue
        if g == e:
            exact += 1
            within1 += 1
            continue
        compare.max_abs = max(compare.max_abs, abs(g - e))
        scale = max(abs(e), 1e-30)
        rel = abs(g - e) / max(scale, rms)
        # one unit in the last place of the dtype at e's magnitude
        if abs(g - e) <= u * 2.0 ** math.floor(math.log2(scale)) * 1.0001:
            within1 += 1
        if rel > worst:
            worst, worst_i = rel, i
    return n, exact, within1, nan_bad, worst, worst_i


def main(d):
    cases = [c for c in json.load(open(os.path.join(d, "cases.json"))) if ONLY in c["name"]]
    check(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "ctx")
    check(cu.cuCtxSetCurrent(ctx), "set ctx")
    ok_all = True
    for c in cases:
        ptx = open(os.path.join(d, c["ptx"]), "rb").read() + b"\0"
        mod = ctypes.c_void_p()
        rc = cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(ptx))
        if rc != 0:
            print(f"{c['name']}: module load failed ({rc})")
            ok_all = False
            continue
        fns = loader(c, mod)
        ptrs = []
        raws = []
        for a in c["args"]:
            raw = open(os.path.join(d, a["file"]), "rb").read()
            p = ctypes.c_uint64()
            check(cu.cuMemAlloc_v2(ctypes.byref(p), max(len(raw), 16)), "alloc")
            check(cu.cuMemcpyHtoD_v2(p, raw, len(raw)), "h2d")
            ptrs.append(p)
            raws.append(raw)
        # `alias`: {"<output index>": <argument index>}: that output is written over the
        # argument (a scatter into the tensor it adds to); the argument is uploaded again
        # before each run.
        alias = {int(o): i for o, i in c.get("alias", {}).items()}
        outs = []
        for oi, o in enumerate(c["outs"]):
            nbytes = o["numel"] * SIZES[o["dtype"]]
            if oi in alias:
                p = ptrs[alias[oi]]
                assert len(raws[alias[oi]]) == nbytes, f"{c['name']}: output {oi} aliases an argument of another size"
            else:
                p = ctypes.c_uint64()
                check(cu.cuMemAlloc_v2(ctypes.byref(p), max(nbytes, 16)), "alloc")
                check(cu.cuMemsetD8_v2(p, 0xFF, nbytes), "memset")
            ptrs.append(p)
            outs.append((p, nbytes, o))
        ws = None
        if c["ws"] > 0:
            ws = ctypes.c_uint64()
            check(cu.cuMemAlloc_v2(ctypes.byref(ws), c["ws"]), "alloc ws")
            check(cu.cuMemsetD8_v2(ws, 0, c["ws"]), "memset ws")
            ptrs.append(ws)
        params = (ctypes.c_void_p * len(ptrs))(*[ctypes.cast(ctypes.pointer(p), ctypes.c_void_p) for p in ptrs])
        results = []
        for run in range(2):
            for i in alias.values():
                check(cu.cuMemcpyHtoD_v2(ptrs[i], raws[i], len(raws[i])), "h2d again")
            if ws is not None and c.get("scratch"):
                check(cu.cuMemsetD8_v2(ws, 0xFF, c["ws"]), "poison ws")
            launch(c, fns, params)
            rc = cu.cuCtxSynchronize()
            if rc != 0:
                print(f"{c['name']}: kernel failed ({rc})")
                return False
            got = []
            for p, nbytes, o in outs:
                buf = ctypes.create_string_buffer(nbytes)
                check(cu.cuMemcpyDtoH_v2(buf, p, nbytes), "d2h")
                got.append(buf.raw)
            results.append(got)
            if ws is not None and not c.get("scratch"):
                buf = ctypes.create_string_buffer(c["ws"])
                check(cu.cuMemcpyDtoH_v2(buf, ws, c["ws"]), "d2h ws")
                if any(buf.raw):
                    print(f"{c['name']}: run {run}: workspace not zero after the kernel")
                    ok_all = False
        same = results[0] == results[1]
        line = [f"{c['name']}:"]
        if not same and c.get("deterministic", True):
            line.append("NOT REPRODUCIBLE")
            ok_all = False
        elif not same:
            diff = [i for i, (a, b) in enumerate(zip(results[0], results[1])) if a != b]
            line.append(f"(not deterministic: outputs {diff} differ between runs)")
        for oi, ((p, nbytes, o), raw) in enumerate([(x, r) for run in results for x, r in zip(outs, run)] if not same else zip(outs, results[0])):
            oi %= len(outs)
            got = decode(raw, o["dtype"])
            exp = decode(open(os.path.join(d, o["expected"]), "rb").read(), o["dtype"])
            n, exact, within1, nan_bad, worst, wi = compare(got, exp, o["dtype"])
            frac1 = within1 / n if n else 1.0
            line.append(f"[{o['dtype']}x{n}: exact {exact/n:.4f}, <=1ulp {frac1:.4f}, nan-mismatch {nan_bad}, max rel {worst:.2e}, max abs {compare.max_abs:.2e}" + (f" at {wi} got {got[wi]} want {exp[wi]}" if wi >= 0 else "") + "]")
            # Scalars are sums over many elements in another order: judged by relative error.
            tol = 0.0 if n == 1 else c.get("min_within1", 0.99)
            max_rel = c.get("max_rel_scalar", 1e-3) if n == 1 else c.get("max_rel", 0.05)
            # Cases with `max_abs` (attention: one bound per output) are judged by absolute error.
            if "max_abs" in c and compare.max_abs > c["max_abs"][oi]:
                ok_all = False
                line.append("FAIL(abs)")
            if nan_bad or frac1 < tol or worst > max_rel:
                ok_all = False
                line.append("FAIL")
        print(" ".join(line), flush=True)
        # An aliased output is its argument's buffer: freed once.
        for k, p in enumerate(ptrs):
            if k - len(c["args"]) not in alias:
                cu.cuMemFree_v2(p)
        cu.cuModuleUnload(mod)
    print("ALL OK" if ok_all else "SOME FAILED")
    return ok_all



def loader(c, mod):
    """The case's launches in order: [(function, grid, block, shared bytes)], prologue first,
    epilogue last."""
    out = []
    for entry, grid, block, shared in [
        (c.get("pre_entry"), c.get("pre_grid"), c.get("pre_block", c["block"]), c.get("pre_shared", 0)),
        (c["entry"], c["grid"], c["block"], c.get("shared", 0)),
        (c.get("post_entry"), c.get("post_grid"), c.get("post_block", c["block"]), c.get("post_shared", 0)),
    ]:
        if entry is None:
            continue
        fn = ctypes.c_void_p()
        check(cu.cuModuleGetFunction(ctypes.byref(fn), mod, entry.encode()), "get function " + entry)
        if shared > 48 * 1024:
            # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
            check(cu.cuFuncSetAttribute(fn, 8, shared), "allow shared memory")
        out.append((fn, grid, block, shared))
    return out


def launch(c, fns, params):
    for fn, grid, block, shared in fns:
        check(cu.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, shared, None, params, None), "launch")


def perf(d):
    """Time kernels listed in perf.json on device-filled inputs; print achieved bandwidth. With
    `TITAN_GPU_SUSTAIN=<seconds>`, each case is also held at the power cap (`nvml.sustained`)
    and a second line gives its time, energy, power and SM clock a launch there."""
    sustain = float(os.environ.get("TITAN_GPU_SUSTAIN") or 0) or None
    for c, t in timed(d, lambda name: ONLY in name, random_floats=os.environ.get("TITAN_GPU_RANDOM") == "1", sustain=sustain):
        rate = f"{c['flops'] / (t * 1e-3) / 1e12:.0f} TFLOP/s" if "flops" in c else f"{c['bytes'] / (t * 1e-3) / 1e9:.0f} GB/s"
        print(f"{c['name']}: {t*1e3:.1f} us, {rate} (grid {c['grid']}, block {c['block']})", flush=True)
        if sustain:
            h = c["sustained"]
            print(f"held {c['name']}: {h['ms']*1e3:.1f} us, {h['J']:.3f} J, {h['W']:.0f} W, {h['MHz']:.0f} MHz a launch ({h['n']} launches)", flush=True)


def timed(d, keep, iters=20, random_floats=False, inputs=None, sustain=None):
    """Yield (case, ms per launch) for each case of `d`/perf.json whose name `keep` accepts: three
    warm-up launches, then the mean of `iters` timed by CUDA events. Float inputs are all 1.0, or
    with `random_floats` standard normal (numpy): compute-bound kernels run slower on random bits
    (more power, a lower clock), so timings to compare with PyTorch's on `randn` need them.
    `inputs(case)`, if given, may return the bytes of every argument instead (a list in
    argument order, or None for the fills above). With `sustain` (seconds), each case then also
    runs back to back at the power cap (`nvml.sustained`: 1 s to settle, `sustain` measured) and
    the case dict gets `sustained`: {ms, J, W, MHz, n} per launch."""
    import random

    cases = [c for c in json.load(open(os.path.join(d, "perf.json"))) if keep(c["name"])]
    check(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "ctx")
    check(cu.cuCtxSetCurrent(ctx), "set ctx")
    rng = random.Random(1)
    for c in cases:
        ptx = open(os.path.join(d, c["ptx"]), "rb").read() + b"\0"
        mod = ctypes.c_void_p()
        check(cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(ptx)), "load " + c["name"])
        fns = loader(c, mod)
        given = inputs(c) if inputs else None
        ptrs = []
        # `alias`: {"<output index>": <argument index>}: that output is written in place over
        # the argument (as the step's optimizer updates its states), not to a buffer of its own.
        alias = {len(c["args"]) + int(o): i for o, i in c.get("alias", {}).items()}
        for ai, a in enumerate(c["args"] + c["outs"]):
            if ai in alias:
                ptrs.append(ptrs[alias[ai]])
                continue
            nbytes = a["numel"] * SIZES[a["dtype"]]
            p = ctypes.c_uint64()
            check(cu.cuMemAlloc_v2(ctypes.byref(p), max(nbytes, 16)), "alloc")
            if given is not None and ai < len(given):
                assert len(given[ai]) == nbytes, f"{c['name']}: argument {ai} is {len(given[ai])} bytes, not {nbytes}"
                check(cu.cuMemcpyHtoD_v2(p, given[ai], nbytes), "h2d")
            elif "int_hi" in a:
                vals = [rng.randrange(a["int_hi"]) for _ in range(a["numel"])]
                raw = struct.pack(f"<{len(vals)}i", *vals)
                check(cu.cuMemcpyHtoD_v2(p, raw, len(raw)), "h2d")
            elif random_floats and a["dtype"] in ("bf16", "f16", "f32"):
                import numpy as np

                x = np.random.default_rng(len(ptrs)).standard_normal(a["numel"], dtype=np.float32)
                if a["dtype"] == "bf16":
                    x = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16
                elif a["dtype"] == "f16":
                    x = x.astype(np.float16)
                check(cu.cuMemcpyHtoD_v2(p, x.tobytes(), nbytes), "h2d")
            elif a["dtype"] in ("bf16", "f16"):
                check(cu.cuMemsetD16_v2(p, 0x3C00, a["numel"]), "fill")
            else:
                check(cu.cuMemsetD32_v2(p, 0x3C000000, a["numel"] * SIZES[a["dtype"]] // 4), "fill")
            ptrs.append(p)
        if c["ws"] > 0:
            ws = ctypes.c_uint64()
            check(cu.cuMemAlloc_v2(ctypes.byref(ws), c["ws"]), "alloc ws")
            check(cu.cuMemsetD8_v2(ws, 0, c["ws"]), "memset ws")
            ptrs.append(ws)
        params = (ctypes.c_void_p * len(ptrs))(*[ctypes.cast(ctypes.pointer(p), ctypes.c_void_p) for p in ptrs])
        start, stop = ctypes.c_void_p(), ctypes.c_void_p()
        check(cu.cuEventCreate(ctypes.byref(start), 0), "event")
        check(cu.cuEventCreate(ctypes.byref(stop), 0), "event")
        for _ in range(3):
            launch(c, fns, params)
        check(cu.cuEventRecord(start, None), "record")
        for _ in range(iters):
            launch(c, fns, params)
        check(cu.cuEventRecord(stop, None), "record")
        check(cu.cuEventSynchronize(stop), "sync")
        ms = ctypes.c_float()
        check(cu.cuEventElapsedTime(ctypes.byref(ms), start, stop), "elapsed")
        if sustain:
            import nvml

            c["sustained"] = nvml.sustained(lambda: launch(c, fns, params), lambda: check(cu.cuCtxSynchronize(), "sync"), ms.value / iters, seconds=sustain)
        for pi, p in enumerate(ptrs):
            if pi not in alias:
                cu.cuMemFree_v2(p)
        cu.cuModuleUnload(mod)
        yield c, ms.value / iters


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[2] == "perf":
    perf(sys.argv[1])
    sys.exit(0)

if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1]) else 1)
