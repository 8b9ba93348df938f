#!/usr/bin/env python3
"""One row from two builds in pairs (before_after_pairs.sh's lines "PAIR SIDE OOP IP", times in
us): each side's median time, the median of the pairs' ratios after / before (above 1: after
is slower), and, given SLOW, how many runs of each side took more than SLOW us (a slow mode).
Several files (sittings of one row) pool their pairs. LABELS name the lines' two figures (out
of place, in place); SIDES the two sides (before, after).

    python3 benches/baselines/before_after_pairs.py PAIRS.txt... [SLOW] [--labels FIRST,SECOND]
        [--sides BEFORE,AFTER]
"""

import os
import statistics
import sys


def us(t):
    """A time in us, to as many places as it needs."""
    return f"{t:.2f}" if t < 100 else f"{t:,.0f}"


def main(argv):
    names = {"--labels": ("out of place", "in place"), "--sides": ("before", "after")}
    for flag in names:
        if flag in argv[:-1]:
            at = argv.index(flag)
            names[flag] = tuple(argv[at + 1].split(","))
            argv = argv[:at] + argv[at + 2:]
    labels, sides = names["--labels"], names["--sides"]
    slow = None
    if len(argv) > 1 and not os.path.exists(argv[-1]):
        slow = float(argv.pop())
    if not argv or len(labels) != 2 or len(sides) != 2:
        sys.exit(__doc__)
    runs = {}
    for path in argv:
        with open(path) as f:
            for line in f:
                pair, side, oop, ip = line.split()
                runs.setdefault((path, pair), {})[side] = (float(oop), float(ip))
    pairs = [p for p in runs.values() if len(p) == 2]
    head = f"| {len(pairs)} pairs | {sides[0]} (us) | {sides[1]} (us) | {sides[1]} / {sides[0]}, paired |"
    rule = "|---|---|---|---|"
    if slow is not None:
        head += f" runs over {slow:g} us, {sides[0]} / {sides[1]} |"
        rule += "---|"
    print(head)
    print(rule)
    for k, name in enumerate(labels):
        before = [p["before"][k] for p in pairs]
        after = [p["after"][k] for p in pairs]
        ratio = statistics.median(p["after"][k] / p["before"][k] for p in pairs)
        line = f"| {name} | {us(statistics.median(before))} | {us(statistics.median(after))} | x{ratio:.3f} |"
        if slow is not None:
            line += f" {sum(t > slow for t in before)} / {sum(t > slow for t in after)} |"
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
