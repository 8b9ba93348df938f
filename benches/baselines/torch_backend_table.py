#!/usr/bin/env python3
"""The torch backend against Gloo: the medians of rounds of torch_backend_rounds.sh, one
column group per torch version (the newest first), as RESULTS.md shows them.

    python3 benches/baselines/torch_backend_table.py results/torch-backend/round-*.txt
"""

import re
import statistics
import sys

SIZES = {8: "8 B", 64 << 10: "64 KiB", 1 << 20: "1 MiB", 64 << 20: "64 MiB"}
MODELS = {"toy": "DDP ToyModel", "mlp": "DDP MLP"}


def parse(path):
    """(torch version, load, {(W, figure): (chorus, gloo)}) of one round: times in us with
    busbw for all-reduces, samples per second for DDP."""
    cells, world, version, load = {}, None, None, None
    for line in open(path):
        if m := re.match(r"# torch (\S+); load average (\S+)", line):
            version, load = m.group(1), float(m.group(2))
        elif m := re.match(r"# W=(\d+): ", line):
            world = int(m.group(1))
        elif m := re.match(r"\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s", line):
            size = int(m.group(1))
            if size in SIZES:
                chorus, gloo = (float(m.group(2)), float(m.group(3))), (float(m.group(4)), float(m.group(5)))
                cells[(world, SIZES[size])] = (chorus, gloo)
        elif m := re.match(r"\s*(toy|mlp) chorus:\s*([\d.]+) gloo:\s*([\d.]+)", line):
            cells[(world, MODELS[m.group(1)])] = (float(m.group(2)), float(m.group(3)))
    if version is None:
        sys.exit(f"torch_backend_table.py: {path} names no torch version")
    return version, load, cells


def median(values):
    """The median of each number of like-shaped values (numbers, or tuples of them)."""
    if isinstance(values[0], tuple):
        return tuple(median([v[i] for v in values]) for i in range(len(values[0])))
    return statistics.median(values)


def time(us):
    return f"{us:.3g} us" if us < 1000 else f"{us / 1000:.3g} ms"


def samples(n):
    return f"{round(n):,}".replace(",", " ")


def row(figure, pair):
    """The chorus, gloo and ratio cells of one figure."""
    chorus, gloo = pair
    if figure.startswith("DDP"):
        return [samples(chorus), samples(gloo), f"x{chorus / gloo:.2g}"]
    (ct, cb), (gt, gb) = chorus, gloo
    bw = lambda b: f" ({b:.3g})" if figure in ("1 MiB", "64 MiB") else ""
    return [time(ct) + bw(cb), time(gt) + bw(gb), f"x{gt / ct:.3g}"]


def main(paths):
    rounds = {}
    for path in paths:
        version, load, cells = parse(path)
        rounds.setdefault(version, []).append((load, cells))
    versions = sorted(rounds, key=lambda v: [int(x) for x in v.split(".")], reverse=True)
    loads = [load for v in versions for load, _ in rounds[v]]
    print(f"Medians of {min(len(rounds[v]) for v in versions)} rounds under each torch, "
          f"one after the other (load averages {min(loads):.1f} to {max(loads):.1f} as each began).")
    print()
    head = " | ".join(f"torch {v}: chorus | gloo | chorus vs gloo" for v in versions)
    print(f"| W | figure | {head} |")
    print("|---|---|" + "---|---|---|" * len(versions))
    keys = sorted({k for v in versions for _, cells in rounds[v] for k in cells},
                  key=lambda k: (k[0], list(SIZES.values()).index(k[1]) if k[1] in SIZES.values() else 10 + list(MODELS.values()).index(k[1])))
    for world, figure in keys:
        cells = []
        for v in versions:
            values = [c[(world, figure)] for _, c in rounds[v] if (world, figure) in c]
            cells += row(figure, median(values)) if values else ["", "", ""]
        print(f"| {world} | {figure} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
