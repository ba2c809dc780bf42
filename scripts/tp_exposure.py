#!/usr/bin/env python3
"""Attribute the exposed tp communication of a predicted step trace (`titanc build --trace`)
to the schedule steps it comes from: the compute stream's `wait` spans, intersected with what
the `comm_tp` stream runs in them, as the simulator counts exposure (so the total is the
`exposed` it prints, up to the collectives of the wait's own dim it does not name). Prints, per schedule step of the tp collectives (loop steps
summed over the layers), the communication time, the exposed time and the compute kernels that
follow it in the schedule, largest exposure first.

    scripts/tp_exposure.py step.json [--top N]
"""
import json
import re
import sys
from collections import defaultdict


def main():
    path = sys.argv[1]
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 40
    ev = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    tp = sorted((e["ts"], e["ts"] + e["dur"], e) for e in ev if e["tid"] == 3)
    compute = [e for e in ev if e["tid"] == 0]

    def step_key(at):
        m = re.match(r"schedule step ([\d.]+)(, layer \d+)?", at)
        return m.group(1) if m else at

    # The compute op names at each step key (to name what a collective feeds).
    names = {}
    for e in compute:
        names.setdefault(step_key(e["args"]["at"]), e["name"])
    comm = defaultdict(float)
    exposed = defaultdict(float)
    count = defaultdict(int)
    label = {}
    for b, e, x in tp:
        k = step_key(x["args"]["at"])
        comm[k] += e - b
        count[k] += 1
        label[k] = x["name"]
    # The simulator's accounting (`compiler/src/cost.rs`, `lay_out`): a wait for a dim's
    # collective exposes what that dim's stream runs in it; where that stream is idle in the
    # wait, what the other stream runs.
    data = sorted((e["ts"], e["ts"] + e["dur"], e) for e in ev if e["tid"] == 1)
    waits = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e["tid"] == 2)

    def overlap(spans, a, b):
        for s0, s1, x in spans:
            o = min(b, s1) - max(a, s0)
            if o > 0:
                yield s0, s1, x, o

    for w0, w1, name in waits:
        own, other = (tp, data) if name == "wait for tp" else (data, tp)
        gaps, at = [], w0
        for s0, s1, x, o in overlap(own, w0, w1):
            if own is tp:
                exposed[step_key(x["args"]["at"])] += o
            if s0 > at:
                gaps.append((at, s0))
            at = max(at, s1)
        if w1 > at:
            gaps.append((at, w1))
        if other is tp:
            for g0, g1 in gaps:
                for _, _, x, o in overlap(tp, g0, g1):
                    exposed[step_key(x["args"]["at"])] += o
    total_c = sum(comm.values())
    total_e = sum(exposed.values())
    print(f"tp communication {total_c / 1e3:.2f} ms, exposed {total_e / 1e3:.2f} ms, hidden {100 * (1 - total_e / total_c):.1f}%")

    def next_compute(k):
        # The first compute op after step k in schedule order (same loop).
        parts = [int(p) for p in k.split(".")]
        best = None
        for ck in names:
            try:
                cp = [int(p) for p in ck.split(".")]
            except ValueError:
                continue
            if len(cp) == len(parts) and cp[:-1] == parts[:-1] and cp[-1] > parts[-1]:
                if best is None or cp[-1] < best[0]:
                    best = (cp[-1], names[ck])
        return best[1] if best else "-"

    print(f"{'step':<10} {'collective':<22} {'calls':>6} {'comm ms':>9} {'exposed ms':>11}  next compute")
    for k in sorted(comm, key=lambda k: -exposed[k])[:top]:
        print(f"{k:<10} {label[k]:<22} {count[k]:>6} {comm[k] / 1e3:>9.2f} {exposed[k] / 1e3:>11.2f}  {next_compute(k)}")


if __name__ == "__main__":
    main()
