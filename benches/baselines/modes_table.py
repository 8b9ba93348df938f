#!/usr/bin/env python3
"""The trainer's parallel modes: the medians of rounds of modes_rounds.sh, as RESULTS.md
shows them.

    python3 benches/baselines/modes_table.py results/modes/round-*.txt
"""

import re
import statistics
import sys

BENCH = re.compile(r"bench\s+world (\d+)\s+dp (\d+)\s+pp (\d+)\s+micro (\d+)\s+.*zero (\d+)\s+"
                   r"batch/replica (\d+)\s+.*samples/s (\d+)")
RANK = re.compile(r"rank (\d+)\s+replica (\d+) stage (\d+) .*bubble (\S+) \(theory (\S+)\)\s+"
                  r"MB params (\S+) grads (\S+) optimizer (\S+)")


def mode(world, dp, pp, micro, zero):
    """The mode's name, as the command line gives it."""
    if pp == 1 and dp == 1:
        return "W=1"
    words = [f"--pp {pp}"] if pp > 1 else []
    words += [f"--dp {dp}"] if dp > 1 else []
    words += [f"--zero {zero}"] if zero else []
    words += [f"--micro-batches {micro}"] if pp > 1 else []
    name = "`" + " ".join(words) + "`"
    return name + (f" ({world} ranks)" if dp > 1 and pp > 1 else "")


def parse(path):
    """(load, [(mode, batch, samples/s, {stage: (bubble, theory)}, {stage: memory})])."""
    load, runs, current = None, [], None
    for line in open(path):
        if m := re.match(r"# load average (\S+)", line):
            load = float(m.group(1))
        elif m := BENCH.match(line):
            world, dp, pp, micro, zero, batch, rate = map(int, m.groups())
            current = (mode(world, dp, pp, micro, zero), batch, rate, {}, {})
            runs.append(current)
        elif (m := RANK.match(line)) and current:
            stage = int(m.group(3))
            current[3].setdefault(stage, (float(m.group(4)), float(m.group(5))))
            current[4].setdefault(stage, tuple(m.group(6, 7, 8)))
    return load, runs


def samples(n):
    return f"{round(n):,}"


def memory(stages):
    """MB per rank: one stage's figures, or each stage's where they differ."""
    if len(stages) == 1:
        return ", ".join(stages[0])
    return "; ".join(f"stage {s}: {', '.join(m)}" for s, m in sorted(stages.items()))


def main(paths):
    rounds = [parse(p) for p in paths]
    loads = [r[0] for r in rounds]
    print(f"Medians of {len(rounds)} rounds (load averages {min(loads):.1f} to "
          f"{max(loads):.1f} as each began); W=1 ran first and last in each.")
    print()
    print("| mode | samples/s, batch 256 | samples/s, batch 64 | bubble, batch 256: each stage "
          "(theory) | MB per rank: params, grads, optimizer |")
    print("|---|---|---|---|---|")
    names = list(dict.fromkeys(run[0] for _, runs in rounds for run in runs))
    for name in names:
        runs = [run for _, rs in rounds for run in rs if run[0] == name]
        rate = {b: statistics.median(r[2] for r in runs if r[1] == b) for b in (256, 64)}
        big = [r for r in runs if r[1] == 256]
        stages = sorted(big[0][3]) if big else []
        bubble = "–"
        if len(stages) > 1:
            each = [statistics.median(r[3][s][0] for r in big) for s in stages]
            bubble = ", ".join(f"{b:.2f}" for b in each) + f" ({big[0][3][stages[0]][1]:.2f})"
        print(f"| {name} | {samples(rate[256])} | {samples(rate[64])} | {bubble} "
              f"| {memory(big[0][4]) if big else '–'} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
