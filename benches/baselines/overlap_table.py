#!/usr/bin/env python3
"""The overlap tables of benches/RESULTS.md from the output of torch_overlap_bench.py.

    python3 benches/baselines/torch_overlap_bench.py -np 2 --rounds 3 -n 20 > overlap.txt
    python3 benches/baselines/overlap_table.py overlap.txt

Prints, per backend: (a) the async all-reduce's time and the fraction of it hidden behind
sleep, per round and their median; (b) the DDP step, the no_sync step, the bare all-reduces
and the step's ratio to no_sync plus the bare all-reduces, per round.
"""

import statistics
import sys


def rows(path):
    """{part: {backend: [[figures of a round], ...]}} from the bench's output, part "a" or "b"."""
    found, part = {"a": {}, "b": {}}, None
    with open(path) as f:
        for line in f:
            words = line.split()
            if line.startswith("(a)") or line.startswith("(b)"):
                part = line[1]
            elif part and len(words) >= 4 and words[0] != "backend":
                found[part].setdefault(words[0], []).append([float(w) for w in words[1:]])
    return found


def spread(values, digits=1):
    """"low-high" of `values`, or the one value."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def main(paths):
    if len(paths) != 1:
        sys.exit(__doc__)
    found = rows(paths[0])
    print("| backend | all-reduce (ms) | hidden, per round | median |")
    print("|---|---|---|---|")
    for backend, rounds in found["a"].items():
        hidden = [r[2] for r in rounds]
        print(f"| {backend} | {spread([r[0] for r in rounds])} | "
              f"{', '.join(f'{h:.2f}' for h in hidden)} | {statistics.median(hidden):.2f} |")
    print()
    print("| backend | step (ms) | no_sync step (ms) | bare all-reduces (ms) | ratio, per round |")
    print("|---|---|---|---|---|")
    for backend, rounds in found["b"].items():
        figures = [spread([r[i] for r in rounds]) for i in range(3)]
        ratios = ", ".join(f"{r[3]:.2f}" for r in rounds)
        print(f"| {backend} | {' | '.join(figures)} | {ratios} |")


if __name__ == "__main__":
    main(sys.argv[1:])
