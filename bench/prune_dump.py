#!/usr/bin/env python3
"""Keeps only some cases of a GPU reference dump (`TITAN_GPU_DUMP`, read by
kernels/tests/gpu_check.py), so a device call carries less:

    python3 bench/prune_dump.py DIR PREFIX...

A case, and every file of the dump, stays if its name starts with one of the prefixes; the
rest are removed from `cases.json` and `perf.json` and from DIR.
"""
import json
import os
import sys


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    d, prefixes = sys.argv[1], tuple(sys.argv[2:])
    index = ("cases.json", "perf.json")
    for j in index:
        path = os.path.join(d, j)
        with open(path) as f:
            cases = [c for c in json.load(f) if c["name"].startswith(prefixes)]
        with open(path, "w") as f:
            json.dump(cases, f)
    for name in os.listdir(d):
        if name not in index and not name.startswith(prefixes):
            os.remove(os.path.join(d, name))


if __name__ == "__main__":
    main()
