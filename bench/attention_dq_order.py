"""What ordering dQ's partial sums costs a five-product attention backward (issue 15; no GPU).

A backward with one CTA per key tile that also produces dQ's partials (FA2's five products
instead of titan's seven) must add each query tile's partials in a fixed order to stay
deterministic: key tile j waits for key tile j+1's partial of the same query tile (the order
in which, under causal masking, every CTA reaches a tile before its lower neighbour, so
nothing waits once all of a group's CTAs run). That puts two constraints on the launch order,
which this models as list scheduling of whole CTAs onto `slots` resident CTAs, in block order:

- **safe**: a CTA's dependencies launch before it (key tile j+1 before j within a
  (batch, kv head) group). Blocks dispatch in order, so this can never deadlock; but the
  longest CTAs (low j: the most query tiles under causality) launch last in their group.
- **group-major, longest first**: progress only while a whole group fits in the resident
  slots (its CTAs wait on later ones in the same group), so it can deadlock on longer
  sequences or a busier GPU; it is the best the ordered sum allows here.
- **titan's order today** (longest first over every group, no cross-CTA waits): the
  seven-product design, for reference.

Each CTA's cost is its query tiles times the heads of its GQA group (`heads_per_kv`), in
units of one (key tile, query tile) step; waiting inside a run is not modelled (under the
order above a CTA's neighbour is ahead of it), so these are lower bounds for the ordered
variants. Prints the makespan of each order against the ideal (total work / slots).

    python3 bench/attention_dq_order.py [--slots 264] [--heads-per-kv 4]
"""

import argparse
import heapq


def makespan(durations, slots):
    """End time of list scheduling `durations` in order onto `slots` identical workers."""
    free = [0] * slots
    end = 0
    for dur in durations:
        t = heapq.heappop(free)
        heapq.heappush(free, t + dur)
        end = max(end, t + dur)
    return end


def orders(seq, groups, heads_per_kv, key_tile=64, query_tile=32):
    """{order name: CTA durations in block order} for causal attention."""
    nk, nq = seq // key_tile, seq // query_tile
    per_key = key_tile // query_tile  # query tiles before key tile 1's diagonal

    def dur(j):
        return heads_per_kv * (nq - per_key * j)

    return {
        "titan today (longest first, no waits)": [dur(j) for j in range(nk) for _ in range(groups)],
        "ordered dQ, group-major longest first (may deadlock)": [dur(j) for _ in range(groups) for j in range(nk)],
        "ordered dQ, safe (dependencies first)": [dur(j) for _ in range(groups) for j in reversed(range(nk))],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=264, help="resident CTAs (H200: 132 SMs x 2)")
    ap.add_argument("--heads-per-kv", type=int, default=4, help="query heads per kv head (Llama-3 8B: 4)")
    args = ap.parse_args()
    print(f"resident CTAs {args.slots}, {args.heads_per_kv} query heads per kv head; makespan / ideal")
    for seq, groups in [(8192, 8), (4096, 16), (2048, 32), (8192, 16)]:
        cases = orders(seq, groups, args.heads_per_kv)
        ideal = sum(next(iter(cases.values()))) / args.slots
        row = ", ".join(f"{name} {makespan(d, args.slots) / ideal:.3f}" for name, d in cases.items())
        print(f"seq {seq}, {groups} (batch, kv head) groups: {row}")


if __name__ == "__main__":
    main()
