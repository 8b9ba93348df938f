#!/usr/bin/env python3
"""The plot of benches/RESULTS.md: bus bandwidth of the W=4 all-reduce against its size,
Chorus over shared memory, Open MPI's vader and Gloo, medians over rounds of every_row.sh's
sweep part, as an SVG on standard output.

    python3 benches/baselines/sweep_plot.py benches/results/every-row/round-*.txt > plot.svg
"""

import math
import statistics
import sys

from every_row_table import sections

# Each line: its section in a round, the column of its bus bandwidth, its colour.
LINES = (
    ("Chorus (out of place)", "chorus shm W=4 all-reduce sweep", 2, "#1f77b4"),
    ("Open MPI (vader)", "open mpi vader W=4 sweep", 4, "#d62728"),
    ("Gloo", "gloo W=4 sweep", 4, "#2ca02c"),
)
WIDTH, HEIGHT = 700, 400
LEFT, RIGHT, TOP, BOTTOM = 64, 190, 40, 56


def figures(rounds, title, column):
    """{bytes: median bus bandwidth in GB/s} of one line over the rounds."""
    by_size = {}
    for rnd, _ in rounds:
        for line in rnd.get(title, []):
            words = line.split()
            if len(words) != 5:
                continue
            size = words[1] if column == 4 else words[0]
            if size.isdigit():
                by_size.setdefault(int(size), []).append(float(words[column]))
    return {size: statistics.median(v) for size, v in sorted(by_size.items())}


def size_label(n):
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{n >> shift}{unit}"
    return str(n)


def main(paths):
    if not paths:
        sys.exit(__doc__)
    rounds = [sections(p) for p in paths]
    lines = [(name, figures(rounds, title, column), colour)
             for name, title, column, colour in LINES]
    sizes = sorted({s for _, f, _ in lines for s in f})
    if not sizes:
        sys.exit("sweep_plot.py: no round has the sweep part")
    top = max(v for _, f, _ in lines for v in f.values()) or 1.0
    step = 10 ** math.floor(math.log10(top / 4)) if top > 0 else 1
    step *= next(m for m in (1, 2, 5, 10) if top / (step * m) <= 5)
    ymax = step * math.ceil(top / step)
    lo, hi = math.log2(sizes[0]), math.log2(sizes[-1])
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(size):
        return LEFT + plot_w * (math.log2(size) - lo) / max(hi - lo, 1)

    def y(value):
        return TOP + plot_h * (1 - value / ymax)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="12" y="22" font-size="14">All-reduce, 4 ranks on one host: bus bandwidth '
           f'(GB/s) by size, medians of {len(rounds)} round(s)</text>']
    tick = 0.0
    while tick <= ymax + 1e-9:
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" '
                   f'stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:g}</text>')
        tick += step
    for size in sizes:
        out.append(f'<text x="{x(size):.1f}" y="{TOP + plot_h + 18}" text-anchor="middle">'
                   f'{size_label(size)}</text>')
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 12}" text-anchor="middle">'
               f'bytes per rank</text>')
    out.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + plot_h}" stroke="black"/>')
    out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{TOP + plot_h}" y2="{TOP + plot_h}" '
               f'stroke="black"/>')
    for i, (name, f, colour) in enumerate(lines):
        points = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in f.items())
        out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>')
        out.extend(f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="3" fill="{colour}"/>'
                   for s, v in f.items())
        ly = TOP + 10 + 20 * i
        out.append(f'<line x1="{LEFT + plot_w + 16}" x2="{LEFT + plot_w + 40}" y1="{ly}" y2="{ly}" '
                   f'stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{LEFT + plot_w + 46}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1:])
