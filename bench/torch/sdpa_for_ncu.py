#!/usr/bin/env python3
"""PyTorch's SDPA forward and backward at the attention table's seq 8192 shapes, for Nsight
Compute: what cuDNN's kernels are (launch shape, registers, shared memory) and what they move
(L2 reads and reductions), to compare with titan's under the same metrics (issue 15).

    ncu -k regex:'bprop|dot_do_o|convert_dq|reduce_head|fprop' --launch-count 16 \
        --section LaunchStats --section Occupancy --section SpeedOfLight \
        --metrics lts__t_sectors_op_red.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum \
        python3 bench/torch/sdpa_for_ncu.py

titan's side: `gpu_check.py DIR perf` on `TITAN_GPU_DUMP` kernels under the same `ncu` flags
(docs/performance.md, session 18). Causal, GQA through `enable_gqa=True` as the step calls it,
bf16, batch 1; two forward+backward rounds per shape (the first warms cuDNN's plan cache).
Run without another cuDNN on `LD_LIBRARY_PATH` (`require_cudnn`).
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import require_cudnn  # noqa: E402

SHAPES = [(64, 16, 64), (32, 8, 128)]  # (query heads, kv heads, head_dim): the table's seq 8192 rows


def main():
    print(f"cuDNN {require_cudnn()}", flush=True)
    for hq, hkv, d in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, h, 8192, d, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True) for h in (hq, hkv, hkv))
        for _ in range(2):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            o.backward(torch.ones_like(o))
        torch.cuda.synchronize()
        print(f"done: {hq}/{hkv} heads, head_dim {d}", flush=True)


if __name__ == "__main__":
    main()
