#!/usr/bin/env python3
"""Chorus's rows from two builds side by side: the rounds before_after.sh wrote to OUT
(before-N.txt and after-N.txt), each row's medians over the rounds and the median over the
rounds of its ratio after / before (above 1: the build after is faster; for times, before
over after).

    python3 benches/baselines/before_after_table.py OUT

Rows whose median ratio is below 0.95 (slower by more than 5%) are marked.
"""

import glob
import os
import sys

from every_row_table import chorus, fmt, median, sections

ROWS = [
    (f"chorus {transport} W={w} {call}", call in ("all-reduce 8 B", "barrier"))
    for transport in ("shm", "tcp")
    for w in (2, 4)
    for call in ("all-reduce 8 B", "all-reduce 64 MiB", "broadcast 64 MiB", "barrier")
]


def rounds(folder, side):
    paths = sorted(glob.glob(os.path.join(folder, f"{side}-*.txt")))
    return [sections(p)[0] for p in paths]


def main(argv):
    if len(argv) != 1:
        sys.exit(__doc__)
    before, after = rounds(argv[0], "before"), rounds(argv[0], "after")
    if not before or len(before) != len(after):
        sys.exit(f"before_after_table.py: {argv[0]} needs as many after-N.txt as before-N.txt")
    print("| row | before (oop / ip) | after (oop / ip) | after / before (oop / ip) |")
    print("|---|---|---|---|")
    slower = 0
    for title, is_time in ROWS:
        places = (0,) if title.endswith("barrier") else (0, 1)
        cells, ratios = [[], []], []
        for place in places:
            b = [chorus(r, title, place) for r in before]
            a = [chorus(r, title, place) for r in after]
            cells[0].append(fmt(median(b)))
            cells[1].append(fmt(median(a)))
            each = [(x / y if is_time else y / x) for x, y in zip(b, a) if x and y]
            ratios.append(median(each))
        if all(r is None for r in ratios):
            continue
        marks = []
        for r in ratios:
            marks.append("-" if r is None else f"x{r:.2f}" + (" (slower)" if r < 0.95 else ""))
            slower += r is not None and r < 0.95
        unit = "us" if is_time else "GB/s"
        print(f"| {title} ({unit}) | {' / '.join(cells[0])} | {' / '.join(cells[1])} | "
              f"{' / '.join(marks)} |")
    print()
    print(f"{slower} figure(s) slower by more than 5% in the median")


if __name__ == "__main__":
    main(sys.argv[1:])
