"""Probe of a float8 reference's first step (issue 12's loss-curve comparison with torchao).

torchao quantizes the fp32 master weights directly; titan quantizes the bf16 copy it computes
with. When the masters start on the bf16 grid (an init or checkpoint stored in bf16), one weight
in sixteen sits exactly halfway between two e4m3 codes after its power-of-2 row scale (e4m3's
mantissa has 3 bits, bf16's 7, so a bf16 value is a rounding tie when its 4 lower mantissa bits
are 1000). Round-to-nearest-even sends a tie to the even code; the first AdamW step moves every
weight by about the learning rate in the direction of -sign(grad), so every tie then rounds one
whole e4m3 step the same way as the update: the fp8 forward sees an update hundreds of times the
step. The bf16 copy absorbs the same step (it is far below bf16's half step), so titan and a
bf16 forward of the same weights do not.

The probe counts the ties in the init, takes one AdamW step of torchao's model on titan's first
batch, counts the weights whose fp8 code changed, and evaluates the second batch with torchao's
forward and with the bf16 forward of the same weights. Runs on the GPU machine, from the
repository root (with an init stored in bf16, then in f32):

    python3 tools/torch_parity.py init --ir 8b4.ir --out /tmp/init.st --seed 0 [--dtype f32]
    titan-run ARTIFACT --backend cuda --steps 2 --init-from /tmp/init.st --dump-batches /tmp/b.bat
    python3 tools/float8_reference_probe.py --ir 8b4.ir --init /tmp/init.st --batches /tmp/b.bat
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_parity as tp  # noqa: E402
from llama_ref import Llama, float8_convert, rope_tables  # noqa: E402

E4M3_MAX = 448.0


def fp8_rows(w):
    """`w` [n, k] scaled per row as torchao's rowwise recipe (power-of-2 scale of the row amax),
    as f32, and its e4m3 codes."""
    w = w.detach().float()
    amax = w.abs().amax(-1, keepdim=True).double().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax))).float()
    scaled = (w * scale).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled, scaled.to(torch.float8_e4m3fn).view(torch.uint8)


def ties(scaled):
    """Elements exactly halfway between two e4m3 codes (the neighbours either side round apart)."""
    up = torch.nextafter(scaled, torch.full_like(scaled, float("inf"))).to(torch.float8_e4m3fn).view(torch.uint8)
    down = torch.nextafter(scaled, torch.full_like(scaled, float("-inf"))).to(torch.float8_e4m3fn).view(torch.uint8)
    return up != down


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
    b = tp.read_batches(a.batches, c, 2)
    cos, sin = rope_tables(c.seq_len, c.head_dim, c.rope_theta, dev)

    def batch(s):
        return b[s - 1, 0].to(dev, torch.long), b[s - 1, 1].to(dev, torch.long)

    def model(recipe):
        torch.manual_seed(0)
        with torch.device(dev):
            m = Llama(c)
        tp.load_init(m, a.init)
        return float8_convert(m, recipe, ()) if recipe else m

    def evaluate(m, s):
        tok, tgt = batch(s)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return m(tok, tgt, cos, sin).item()

    m8 = model(a.recipe)
    linears = {n: p for n, p in m8.named_parameters() if p.dim() == 2 and "tok_embeddings" not in n}
    before = {}
    n_all = n_tie = 0
    for n, p in linears.items():
        scaled, codes = fp8_rows(p)
        before[n] = (codes, ties(scaled))
        n_all += p.numel()
        n_tie += int(before[n][1].sum())
    print(f"init {a.init}: {n_tie:,} of {n_all:,} linear weights ({100 * n_tie / n_all:.2f}%) sit on an e4m3 rounding tie under rowwise scaling")
    print(f"batch 2 at init, {a.recipe} forward: {evaluate(m8, 2):.5f}")

    params = list(m8.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False, fused=False)
    tok, tgt = batch(1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = m8(tok, tgt, cos, sin)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step 1 ({a.recipe}, lr {a.lr:g}): loss {loss.item():.5f}")

    moved = moved_ties = 0
    for n, p in linears.items():
        codes, was_tie = before[n]
        changed = fp8_rows(p)[1] != codes
        moved += int(changed.sum())
        moved_ties += int((changed & was_tie).sum())
    print(f"after step 1: {moved:,} fp8 weight codes changed ({100 * moved / n_all:.2f}%), {moved_ties:,} of them ties")
    print(f"batch 2 after step 1, {a.recipe} forward: {evaluate(m8, 2):.5f}")
    src = dict(m8.named_parameters())
    mb = model(None)
    with torch.no_grad():
        for n, p in mb.named_parameters():
            p.copy_(src[n])
    print(f"batch 2 after step 1, bf16 forward of the same weights: {evaluate(mb, 2):.5f}")


if __name__ == "__main__":
    main()
