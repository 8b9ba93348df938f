#!/usr/bin/env python3
"""chorus_sim against shaped links: the output of sim_vs_shaped.sh runs as RESULTS.md shows
it, each cell the measured time and the prediction over it.

    python3 benches/baselines/shaped_table.py results/shaped/*.txt
"""

import re
import sys

WORLD = re.compile(r"# W=(\d+) \((\d+) per node\) rate (\S+) .*measured alpha (\S+) us, "
                   r"beta (\S+) Gbit/s")
CELL = re.compile(r"\s*(\d+) (\S+)\s+(\S+)\s+(\S+)\s+(\S+)$")
PICKS = re.compile(r"(\d+): tuner picks (\S+), simulation's best (\S+), measured best (\S+)")


def rate(text):
    """tc's rate ("100mbit") as a reader's ("100 Mbit/s")."""
    m = re.match(r"([\d.]+)(\D*)", text)
    unit = {"kbit": "kbit/s", "mbit": "Mbit/s", "gbit": "Gbit/s"}.get(m.group(2), "bit/s")
    return f"{m.group(1)} {unit}"


def size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def ms(us):
    """A time in ms, to two significant figures below 10 ms."""
    return f"{us / 1e3:.1f} ms" if us < 1e4 else f"{us / 1e3:.0f} ms"


def parse(path):
    """Rows: (link, W, alpha us, beta Mbit/s, size, {algo: (measured us, ratio)}, pick, best);
    W is written "W = N x P" where nodes run P ranks each."""
    rows, world, cells = [], None, {}
    for line in open(path):
        if m := WORLD.match(line):
            w, per = int(m.group(1)), int(m.group(2))
            ranks = str(w) if per == 1 else f"{w} = {w // per} x {per}"
            world = (rate(m.group(3)), ranks, float(m.group(4)), float(m.group(5)) * 1e3)
        elif (m := PICKS.match(line)) and world:
            n = int(m.group(1))
            rows.append((*world, n, cells.pop(n, {}), m.group(2), m.group(4)))
        elif (m := CELL.match(line)) and world:
            n, algo, _, measured, ratio = m.groups()
            cells.setdefault(int(n), {})[algo] = (float(measured), float(ratio))
    return rows


def main(paths):
    rows = [row for path in paths for row in parse(path)]
    # By link, then ranks, then size, whichever run measured them.
    rows.sort(key=lambda r: (r[0], int(r[1].split()[0]), r[4]))
    algos = list(dict.fromkeys(a for row in rows for a in row[5]))
    print("| link | W | measured alpha, beta | size | " + " | ".join(algos)
          + " | tuner's pick | fastest measured |")
    print("|---" * (len(algos) + 6) + "|")
    for link, w, alpha, beta, n, cells, pick, best in rows:
        shown = [f"{ms(cells[a][0])} / {cells[a][1]:.2f}" if a in cells else "–"
                 for a in algos]
        print(f"| {link} | {w} | {alpha:.1f} us, {beta:.0f} Mbit/s | {size(n)} | "
              + " | ".join(shown) + f" | {pick} | {best} |")
    ratios = [r for row in rows for _, r in row[5].values()]
    near = sum(picked_within(row, 1.05) for row in rows)
    print()
    print(f"Predicted over measured, every cell: {min(ratios):.2f} to {max(ratios):.2f}; the "
          f"tuner's pick is the fastest measured algorithm, or within 5% of it, at {near} of "
          f"{len(rows)} sizes.")


def picked_within(row, factor):
    """Whether the tuner's pick measured within `factor` of the fastest algorithm."""
    cells, pick = row[5], row[6]
    fastest = min(t for t, _ in cells.values())
    return pick in cells and cells[pick][0] <= factor * fastest


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
