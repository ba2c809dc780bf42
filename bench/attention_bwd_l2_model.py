#!/usr/bin/env python3
"""A model of how much of the attention backward's dK/dV pass data (or, `--forward`, the
forward's K/V reads) misses L2, per walk order and grid banding (the build-time switches
`TITAN_ATT_BWD_WALK` and `TITAN_ATT_BWD_BAND`, kernels/src/attention_bwd.rs `Order`, `walk`
and `key_tile`). Not a measurement: Nsight Compute's L2 hit rate and DRAM throughput on the
kernels are (docs/notes.md, sessions 27-28; the model's 24 MB column ranked the four orders
measured in session 28 as ncu's DRAM bytes did).

The model: 132 SMs, one CTA each; CTAs dispatched greedily in grid order (a CTA per (batch, kv
head, 128-key tile), key tile first within a band of `band` kv heads); every CTA does one query
tile a step (64 queries at head_dim 128, 128 at 64) over its group's query heads, from its
diagonal when causal. Each step touches one unit: the tile's Q and dO (bf16) and its u32 dQ
accumulator rows. A unit misses when it is first touched or when more distinct units than fit
the L2 capacity were touched since its last use (LRU stack distance). Prints, per setting, the
miss fraction at each capacity and the makespan against perfect balance.

    python3 bench/attention_bwd_l2_model.py [--shape b,s,hq,hkv,d] [--capacity-mb 24,40,50] [--forward]

`--forward` models the forward's K/V tile reads the same way (`fwd_accesses`).
"""
import argparse
import heapq

SMS = 132


def accesses(b, s, hq, hkv, d, down, heads_inner, band):
    """(time, unit) of every step of every CTA, sorted; and the makespan against the ideal."""
    bm = 64 if d == 128 else 128
    nk, grp, nq = s // 128, hq // hkv, s // bm
    nbk = b * hkv
    g = band if band and nbk % band == 0 else nbk
    order = [(grp_i * g + k, j) for grp_i in range(nbk // g) for j in range(nk) for k in range(g)]
    free = [(0, i) for i in range(SMS)]
    heapq.heapify(free)
    acc, end, work = [], 0, 0
    for bk, j in order:
        t0, sm = heapq.heappop(free)
        t_start = j * 128 // bm
        ntile = nq - t_start
        n = ntile * grp
        for f in range(n):
            hh, tt = (f % grp, f // grp) if heads_inner else (f // ntile, f % ntile)
            tile = nq - 1 - tt if down else t_start + tt
            acc.append((t0 + f, sm, (bk, hh, tile)))
        heapq.heappush(free, (t0 + n, sm))
        end, work = max(end, t0 + n), work + n
    acc.sort()
    return [u for _, _, u in acc], end / (work / SMS), bm * d * 8 / 2**20


def fwd_accesses(b, s, hq, hkv, d, band):
    """The forward's (time, unit) order, as `accesses` for the backward: a CTA per (batch, query
    head, query tile) (128 queries at head_dim 128, one CTA an SM; 64 at 64, four an SM), the
    longest causal tiles first over all (batch, head)s (`attention.rs` `tile_of`), or with `band`
    over `band` kv heads' query heads at a time; each CTA reads one 128-key K/V tile a step, its
    unit (batch, kv head, key tile)."""
    bm, slots = (128, SMS) if d == 128 else (64, 4 * SMS)
    nm, grp, nbk = s // bm, hq // hkv, b * hkv
    g = band if band and nbk % band == 0 else nbk
    order = [(bg * g + k, h, m) for bg in range(nbk // g) for m in reversed(range(nm)) for k in range(g) for h in range(grp)]
    free = [(0, i) for i in range(slots)]
    heapq.heapify(free)
    acc, end, work = [], 0, 0
    for bk, _h, m in order:
        t0, sm = heapq.heappop(free)
        n = (m + 1) * bm // 128
        for k in range(n):
            acc.append((t0 + k, sm, (bk, k)))
        heapq.heappush(free, (t0 + n, sm))
        end, work = max(end, t0 + n), work + n
    acc.sort()
    return [u for _, _, u in acc], end / (work / slots), 128 * d * 2 * 2 / 2**20


def stack_distances(units):
    """Distinct units touched since each access's previous access to its unit (None: first)."""
    n = len(units)
    tree = [0] * (n + 1)

    def add(i, v):
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(i):
        i += 1
        r = 0
        while i > 0:
            r += tree[i]
            i -= i & -i
        return r

    last, out = {}, []
    for k, u in enumerate(units):
        if u in last:
            p = last[u]
            out.append(prefix(k - 1) - prefix(p))
            add(p, -1)
        else:
            out.append(None)
        last[u] = k
        add(k, 1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1,8192,32,8,128", help="b,s,hq,hkv,d (default: Llama-3 8B's heads, seq 8192)")
    ap.add_argument("--capacity-mb", default="24,40,50")
    ap.add_argument("--forward", action="store_true", help="model the forward's K/V reads instead (`fwd_accesses`)")
    a = ap.parse_args()
    shape = [int(x) for x in a.shape.split(",")]
    caps = [float(x) for x in a.capacity_mb.split(",")]
    if a.forward:
        print(f"forward, shape {shape}; K/V tile reads that miss at " + " / ".join(f"{c:g} MB" for c in caps) + "; makespan / ideal")
        for name, band in [("one band (default)", None), ("band 1", 1), ("band 2", 2), ("band 4", 4)]:
            units, makespan, unit_mb = fwd_accesses(*shape, band)
            dist = stack_distances(units)
            miss = [sum(1 for x in dist if x is None or x * unit_mb > c) / len(dist) for c in caps]
            print(f"{name:26s} " + " / ".join(f"{m:.3f}" for m in miss) + f"   {makespan:.3f}   ({len(dist)} tile reads of {unit_mb * 1024:.0f} KB)")
        return
    settings = [("up (below seq 4096)", False, False, None), ("down", True, False, None), ("down-heads-inner", True, True, None),
                ("band 2, down (8B's default)", True, False, 2), ("band 2, down-heads-inner", True, True, 2),
                ("band 4, down", True, False, 4), ("band 4, down-heads-inner", True, True, 4)]
    print(f"shape {shape}; miss fraction at " + " / ".join(f"{c:g} MB" for c in caps) + "; makespan / ideal")
    for name, down, inner, band in settings:
        units, makespan, unit_mb = accesses(*shape, down, inner, band)
        dist = stack_distances(units)
        miss = [sum(1 for x in dist if x is None or x * unit_mb > c) / len(dist) for c in caps]
        print(f"{name:28s} " + " / ".join(f"{m:.2f}" for m in miss) + f"   {makespan:.3f}")


if __name__ == "__main__":
    main()
