#!/usr/bin/env python3
"""`train --bench` against PyTorch's DDP: the medians of rounds of train_rounds.sh, as
RESULTS.md shows them.

    python3 benches/baselines/train_table.py results/train/round-*.txt
"""

import re
import statistics
import sys


def parse(path):
    """(load, {W: chorus samples/s}, {W: torch samples/s}, torch version) of one round."""
    load, chorus, torch, version = None, {}, {}, None
    for line in open(path):
        if m := re.match(r"# load average (\S+)", line):
            load = float(m.group(1))
        elif m := re.match(r"bench\s+world (\d+) .*samples/s (\d+)", line):
            chorus[int(m.group(1))] = float(m.group(2))
        elif m := re.match(r"torch (\S+) gloo\s+world (\d+) .*samples/s (\d+)", line):
            version = m.group(1)
            torch[int(m.group(2))] = float(m.group(3))
    return load, chorus, torch, version


def samples(n):
    return f"{round(n):,}"


def main(paths):
    rounds = [parse(p) for p in paths]
    loads = [r[0] for r in rounds]
    version = next((r[3] for r in rounds if r[3]), "?")
    print(f"Medians of {len(rounds)} rounds (load averages {min(loads):.1f} to {max(loads):.1f} "
          f"as each began); PyTorch {version}, gloo, one thread per rank.")
    print()
    print("| ranks | Chorus samples/s | PyTorch DDP samples/s | Chorus / PyTorch |")
    print("|---|---|---|---|")
    for world in sorted({w for r in rounds for w in r[1]}):
        c = statistics.median(r[1][world] for r in rounds if world in r[1])
        t = statistics.median(r[2][world] for r in rounds if world in r[2])
        print(f"| W={world} | {samples(c)} | {samples(t)} | x{c / t:.2f} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
