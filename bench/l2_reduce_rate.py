#!/usr/bin/env python3
"""How fast can every SM add f32 tiles into global memory? (issue 15, the five-product backward)

The five-product attention backward sums each (key tile, query tile) pair's f32 dQ partial into
an accumulator in global memory: 16 KB per 64 x 64 tile pair at head_dim 64. Session 17's probe
took as long as its reductions would at ~1.9 TB/s, so this measures the rate itself, without
the attention around it: each of `grid` CTAs (128 threads) adds `iters` 16 KB tiles of 1.0 into
a region of `tiles` x 16 KB (tile `(i * grid + cta) mod tiles` at step i, so with tiles >= grid
no two CTAs hit the same tile in a step), by one of:

  bulk_red   one `cp.reduce.async.bulk...add.f32` of 16 KB from shared memory (thread 0), up to
             `depth` in flight (`cp.async.bulk.wait_group.read depth`): the probe's way
  bulk_st    the same as a plain bulk store (`cp.async.bulk.global.shared::cta`): the write rate
  red_v4     every thread `red.global.add.v4.f32` from registers (8 a tile per thread)
  red_f32    every thread `red.global.add.f32` (32 a tile per thread)
  st_v4      plain `st.global.v4.f32` (the write rate from registers)

Prints GB/s of f32 added (bytes of tiles / time) per variant and region. Needs only the CUDA
driver (libcuda.so.1): `python3 bench/l2_reduce_rate.py [--check]`; `--emit DIR` writes the
PTX instead (to validate it with ptxas on a machine without a GPU).
"""
import argparse
import ctypes
import os
import sys

TILE = 16384
THREADS = 128

HEAD = """.version 8.1
.target sm_90a
.address_size 64
.extern .shared .align 1024 .b8 smem[];
.visible .entry k(.param .u64 p_dst, .param .u32 p_iters, .param .u32 p_mask)
{
 .reg .pred %p<4>;
 .reg .b32 %r<32>;
 .reg .b64 %rd<16>;
 .reg .f32 %f<4>;
 ld.param.u64 %rd1, [p_dst];
 cvta.to.global.u64 %rd1, %rd1;
 ld.param.u32 %r1, [p_iters];
 ld.param.u32 %r2, [p_mask];
 mov.u32 %r3, %tid.x;
 mov.u32 %r4, %ctaid.x;
 mov.u32 %r5, %nctaid.x;
 mov.u32 %r6, smem;
 mov.f32 %f1, 0f3F800000;
 mov.u32 %r7, 0;
FILL:
 mad.lo.u32 %r8, %r7, 128, %r3;
 shl.b32 %r8, %r8, 2;
 add.u32 %r8, %r8, %r6;
 st.shared.f32 [%r8], %f1;
 add.u32 %r7, %r7, 1;
 setp.lt.u32 %p1, %r7, 32;
 @%p1 bra FILL;
 fence.proxy.async.shared::cta;
 bar.sync 0;
"""

LOOP = """ mov.u32 %r9, 0;
LOOP:
 mad.lo.u32 %r10, %r9, %r5, %r4;
 and.b32 %r10, %r10, %r2;
 mul.wide.u32 %rd2, %r10, 16384;
 add.s64 %rd3, %rd1, %rd2;
{body}
 add.u32 %r9, %r9, 1;
 setp.lt.u32 %p2, %r9, %r1;
 @%p2 bra LOOP;
{tail}
DONE:
 ret;
}}
"""


def ptx(variant, depth=4):
    """The PTX of one variant: a kernel `k(dst, iters, mask)` over 128 threads, 16 KB of shared memory."""
    if variant in ("bulk_red", "bulk_st"):
        op = (
            f"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%rd3], [%r6], {TILE};"
            if variant == "bulk_red"
            else f"cp.async.bulk.global.shared::cta.bulk_group [%rd3], [%r6], {TILE};"
        )
        pre = " setp.ne.u32 %p3, %r3, 0;\n @%p3 bra DONE;\n"
        body = f" {op}\n cp.async.bulk.commit_group;\n cp.async.bulk.wait_group.read {depth};"
        return HEAD + pre + LOOP.format(body=body, tail=" cp.async.bulk.wait_group 0;")
    per = {"red_v4": 16, "st_v4": 16, "red_f32": 4}[variant]
    pre = f" mul.wide.u32 %rd4, %r3, {per};\n"
    lines = [" add.s64 %rd5, %rd3, %rd4;"]
    for j in range(TILE // (THREADS * per)):
        off = j * THREADS * per
        if variant == "red_v4":
            lines.append(f" red.global.add.v4.f32 [%rd5+{off}], {{%f1, %f1, %f1, %f1}};")
        elif variant == "st_v4":
            lines.append(f" st.global.v4.f32 [%rd5+{off}], {{%f1, %f1, %f1, %f1}};")
        else:
            lines.append(f" red.global.add.f32 [%rd5+{off}], %f1;")
    return HEAD + pre + LOOP.format(body="\n".join(lines), tail="")


def check(cu, rc, what):
    if rc != 0:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {rc} {name.value}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--emit", help="write each variant's PTX into this directory and stop")
    ap.add_argument("--grid", type=int, nargs="+", default=[264])
    ap.add_argument("--iters", type=int, default=256, help="tiles per CTA per launch")
    ap.add_argument("--launches", type=int, default=10)
    ap.add_argument("--check", action="store_true", help="read the reduced regions up to 16 MB back (numpy): every element must equal its tile's add count")
    args = ap.parse_args()
    variants = [("bulk_red", 1), ("bulk_red", 4), ("bulk_st", 4), ("red_v4", 0), ("red_f32", 0), ("st_v4", 0)]
    if args.emit:
        os.makedirs(args.emit, exist_ok=True)
        for v, dep in variants:
            open(os.path.join(args.emit, f"{v}_d{dep}.ptx"), "w").write(ptx(v, dep))
        return
    cu = ctypes.CDLL("libcuda.so.1")
    check(cu, cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cu, cu.cuDeviceGet(ctypes.byref(dev), 0), "device")
    ctx = ctypes.c_void_p()
    check(cu, cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "ctx")
    check(cu, cu.cuCtxSetCurrent(ctx), "set ctx")
    regions = [("4 MB", 256), ("16 MB", 1024), ("512 MB", 32768), ("1 MB (shared tiles)", 64)]
    big = max(t for _, t in regions) * TILE
    buf = ctypes.c_uint64()
    check(cu, cu.cuMemAlloc_v2(ctypes.byref(buf), big), "alloc")
    start, stop = ctypes.c_void_p(), ctypes.c_void_p()
    check(cu, cu.cuEventCreate(ctypes.byref(start), 0), "event")
    check(cu, cu.cuEventCreate(ctypes.byref(stop), 0), "event")
    print(f"{'variant':<12} {'grid':>5} {'region':<20} {'ms/launch':>10} {'GB/s':>8}  check")
    for grid in args.grid:
        for v, dep in variants:
            mod = ctypes.c_void_p()
            src = ptx(v, dep).encode() + b"\0"
            check(cu, cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(src)), f"load {v}")
            fn = ctypes.c_void_p()
            check(cu, cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"k"), "function")
            for rname, tiles in regions:
                dst = ctypes.c_uint64(buf.value)
                iters = ctypes.c_uint32(args.iters)
                mask = ctypes.c_uint32(tiles - 1)
                params = (ctypes.c_void_p * 3)(*[ctypes.cast(ctypes.pointer(x), ctypes.c_void_p) for x in (dst, iters, mask)])
                check(cu, cu.cuMemsetD32_v2(buf, 0, tiles * TILE // 4), "zero")

                def launch():
                    check(cu, cu.cuLaunchKernel(fn, grid, 1, 1, THREADS, 1, 1, TILE, None, params, None), "launch")

                for _ in range(3):
                    launch()
                check(cu, cu.cuEventRecord(start, None), "record")
                for _ in range(args.launches):
                    launch()
                check(cu, cu.cuEventRecord(stop, None), "record")
                check(cu, cu.cuEventSynchronize(stop), "sync")
                ms = ctypes.c_float()
                check(cu, cu.cuEventElapsedTime(ctypes.byref(ms), start, stop), "elapsed")
                per = ms.value / args.launches
                nbytes = grid * args.iters * TILE
                verdict = ""
                if args.check and v not in ("bulk_st", "st_v4") and tiles <= 1024:
                    import numpy as np

                    n = tiles * TILE // 4
                    raw = (ctypes.c_char * (n * 4))()
                    check(cu, cu.cuMemcpyDtoH_v2(raw, buf, n * 4), "d2h")
                    got = np.frombuffer(bytes(raw), dtype=np.float32).reshape(tiles, TILE // 4)
                    adds = np.bincount((np.arange(args.iters)[:, None] * grid + np.arange(grid)[None, :]).ravel() % tiles, minlength=tiles)
                    want = (adds * (3 + args.launches)).astype(np.float32)[:, None]
                    bad = int((got != want).sum())
                    verdict = "ok" if bad == 0 else f"{bad} wrong"
                print(f"{v + ('' if dep == 0 else f' d{dep}'):<12} {grid:>5} {rname:<20} {per:>10.3f} {nbytes / per / 1e6:>8.0f}  {verdict}", flush=True)
            cu.cuModuleUnload(mod)
    return 0


if __name__ == "__main__":
    sys.exit(main())
