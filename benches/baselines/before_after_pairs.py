#!/usr/bin/env python3
"""One row from two builds in pairs (before_after_pairs.sh's lines "PAIR SIDE OOP IP"): each
side's median time, the median of the pairs' ratios after / before (above 1: after is
slower), and how many runs of each side took more than SLOW us (the slow mode).

    python3 benches/baselines/before_after_pairs.py PAIRS.txt [SLOW]
"""

import statistics
import sys


def main(argv):
    if len(argv) not in (1, 2):
        sys.exit(__doc__)
    slow = float(argv[1]) if len(argv) == 2 else 5.5
    runs = {}
    with open(argv[0]) as f:
        for line in f:
            pair, side, oop, ip = line.split()
            runs.setdefault(pair, {})[side] = (float(oop), float(ip))
    pairs = [p for p in runs.values() if len(p) == 2]
    print(f"| {len(pairs)} pairs | before (us) | after (us) | after / before, paired | runs over {slow:g} us, before / after |")
    print("|---|---|---|---|---|")
    for k, name in ((0, "out of place"), (1, "in place")):
        before = [p["before"][k] for p in pairs]
        after = [p["after"][k] for p in pairs]
        ratio = statistics.median(p["after"][k] / p["before"][k] for p in pairs)
        over = (sum(t > slow for t in before), sum(t > slow for t in after))
        print(f"| {name} | {statistics.median(before):.2f} | {statistics.median(after):.2f} "
              f"| x{ratio:.3f} | {over[0]} / {over[1]} |")


if __name__ == "__main__":
    main(sys.argv[1:])
