"""How much of a memory-bound AdamW update hides behind compute-bound kernels on another stream.

The question behind issue 15's "optimizer off the critical path": on one GPU, does running the
optimizer's update on a second stream beside the next step's forward shorten the step? This
times, on the same GPU in one run, (a) 12 bf16 GEMMs [8192 x 4096] x [4096 x 14336] and (b)
three causal SDPA forwards (8B attention, seq 8192), each alone, AdamW alone (PyTorch's fused
multi-tensor kernel over 250 M fp32 parameters, four calls: 28 bytes per parameter, the traffic
of titan's optimizer), and both together on two streams, with and without the compute stream at
high priority. "hidden" is the sum of the times alone minus the time together (min of 3 runs).

    python3 bench/torch/stream_overlap.py
"""

import torch
import torch.nn.functional as F


def on_two_streams(first, first_stream, second, second_stream):
    """Run `first()` on `first_stream` and `second()` on `second_stream`, both after the work
    queued on the current stream so far, and make the current stream wait for both."""
    cur = torch.cuda.current_stream()
    ev = torch.cuda.Event()
    ev.record(cur)
    first_stream.wait_event(ev)
    second_stream.wait_event(ev)
    with torch.cuda.stream(first_stream):
        first()
    with torch.cuda.stream(second_stream):
        second()
    cur.wait_stream(first_stream)
    cur.wait_stream(second_stream)


def main():
    dev = "cuda"
    torch.manual_seed(0)
    m, k, n = 8192, 4096, 14336
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    params = 250_000_000
    p = torch.randn(params, device=dev)
    g = torch.randn(params, device=dev) * 1e-3
    m1 = torch.zeros(params, device=dev)
    m2 = torch.zeros(params, device=dev)
    step = torch.tensor(1.0, device=dev)
    q = torch.randn(1, 32, 8192, 128, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(1, 32, 8192, 128, device=dev, dtype=torch.bfloat16)

    def gemms():
        for _ in range(12):
            torch.mm(a, b)

    def attention():
        for _ in range(3):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True)

    def adamw():
        for _ in range(4):
            torch._fused_adamw_([p], [g], [m1], [m2], [], [step], lr=1e-4, beta1=0.9, beta2=0.95,
                                weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)

    def timed(fn):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1)

    high, low = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)
    plain = torch.cuda.Stream()

    def together(work, priority):
        s0 = high if priority else plain
        return lambda: on_two_streams(work, s0, adamw, low)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, work in [("12 GEMMs [8192x4096]x[4096x14336]", gemms), ("3 causal SDPA forwards", attention)]:
        for _ in range(2):
            timed(work)
            timed(adamw)
        tw = min(timed(work) for _ in range(3))
        to = min(timed(adamw) for _ in range(3))
        tt = min(timed(together(work, False)) for _ in range(3))
        tp = min(timed(together(work, True)) for _ in range(3))
        gbs = 4 * params * 28 / (to * 1e-3) / 1e9
        print(f"{name}: alone {tw:.2f} ms; AdamW alone {to:.2f} ms ({gbs:.0f} GB/s); sum {tw + to:.2f}; "
              f"together {tt:.2f} (hidden {tw + to - tt:.2f}); compute at high priority {tp:.2f} (hidden {tw + to - tp:.2f})")


if __name__ == "__main__":
    main()
