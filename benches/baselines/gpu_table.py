#!/usr/bin/env python3
"""The GPU checks as RESULTS.md shows them: one table of the rows of runs of
`tools/gpu-check.sh run` (each run's $OUT/rows.tsv, kept as benches/results/gpu/*.tsv),
a column per run.

    python3 benches/baselines/gpu_table.py results/gpu/*.tsv
"""

import sys


def parse(path):
    """(the machine and date of the run, [(check, status, result)])."""
    machine, rows = "?", []
    for line in open(path):
        line = line.rstrip("\n")
        if line.startswith("# "):
            machine = line[2:]
        elif line:
            check, status, result = (line.split("\t") + ["", ""])[:3]
            rows.append((check, status, result))
    return machine, rows


def cell(status, result):
    """A row's cell: its result, with its status where it did not pass."""
    text = result.replace("|", "/") or status
    return text if status == "ok" else f"**{status}** {text}".strip()


def main(paths):
    runs = [parse(p) for p in paths]
    checks = list(dict.fromkeys(check for _, rows in runs for check, _, _ in rows))
    print("| check | " + " | ".join(machine for machine, _ in runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for check in checks:
        cells = []
        for _, rows in runs:
            found = [cell(s, r) for c, s, r in rows if c == check]
            cells.append(found[0] if found else "–")
        print(f"| {check} | " + " | ".join(cells) + " |")
    failed = sum(s not in ("ok", "n/a") for _, rows in runs for _, s, _ in rows)
    print()
    print(f"{len(runs)} run(s); {failed} check(s) did not pass.")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
