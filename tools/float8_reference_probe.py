"""Probe of a float8 reference's forward (issue 12's loss-curve comparison with torchao).

After one AdamW step of torchao's rowwise model on titan's first batch, evaluates the second
batch three ways: torchao's forward, a fresh torchao model loaded with the same weights, and the
bf16 forward of the same weights; then trains torchao compiled per block for three steps. On the
8b-4l run of 2026-12-02 torchao's forward gave 7.18 where the bf16 forward of the same weights
gave 11.98 (docs/performance.md). Runs on the GPU machine, from the repository root:

    python3 tools/torch_parity.py init --ir 8b4.ir --out /tmp/init.st --seed 0
    titan-run ARTIFACT --backend cuda --steps 3 --init-from /tmp/init.st --dump-batches /tmp/b.bat
    python3 tools/float8_reference_probe.py --ir 8b4.ir --init /tmp/init.st --batches /tmp/b.bat
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_parity as tp  # noqa: E402
from llama_ref import Llama, float8_convert, rope_tables  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ir", required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--batches", required=True)
    ap.add_argument("--recipe", default="rowwise")
    ap.add_argument("--lr", type=float, default=4e-6, help="the first step's learning rate (titanc's default schedule: 4e-6)")
    a = ap.parse_args()
    c = tp.read_config(a.ir)
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    b = tp.read_batches(a.batches, c, 3)
    cos, sin = rope_tables(c.seq_len, c.head_dim, c.rope_theta, dev)

    def batch(s):
        return b[s - 1, 0].to(dev, torch.long), b[s - 1, 1].to(dev, torch.long)

    def model(recipe, compiled=False):
        torch.manual_seed(0)
        with torch.device(dev):
            m = Llama(c)
        tp.load_init(m, a.init)
        if recipe:
            m = float8_convert(m, recipe, ())
        if compiled:
            for i, blk in enumerate(m.layers):
                m.layers[i] = torch.compile(blk)
        return m

    def train(m, lrs, label):
        params = list(m.parameters())
        opt = torch.optim.AdamW(params, lr=lrs[0], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False, fused=False)
        for s, lr in enumerate(lrs, 1):
            for g in opt.param_groups:
                g["lr"] = lr
            tok, tgt = batch(s)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(tok, tgt, cos, sin)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
            opt.step()
            opt.zero_grad(set_to_none=True)
            print(f"{label} step {s}: loss {loss.item():.5f} grad_norm {gn.item():.4f}", flush=True)

    def evaluate(m, s):
        tok, tgt = batch(s)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return m(tok, tgt, cos, sin).item()

    m8 = model(a.recipe)
    train(m8, [a.lr], f"{a.recipe} eager")
    print(f"batch 2 after step 1, {a.recipe} forward: {evaluate(m8, 2):.5f}")
    src = dict(m8.named_parameters())
    for label, recipe in (("bf16 forward of the same weights", None), (f"a fresh {a.recipe} model with the same weights", a.recipe)):
        m = model(recipe)
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(src[n])
        print(f"batch 2 after step 1, {label}: {evaluate(m, 2):.5f}")
        del m
    init = dict(model(None).named_parameters())
    moved = sorted(((src[n] - init[n]).abs().max().item(), n) for n in src)[-3:]
    print("largest |w - w_init| per tensor:", [(n, f"{x:.2e}") for x, n in moved])
    del m8, src, init
    torch.cuda.empty_cache()
    train(model(a.recipe, compiled=True), [a.lr, 2 * a.lr, 3 * a.lr], f"{a.recipe} compiled per block")


if __name__ == "__main__":
    main()
