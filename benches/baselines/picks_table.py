#!/usr/bin/env python3
"""The tuner's all-reduce picks beside every algorithm forced, from rounds of picks.sh.

    python3 benches/baselines/picks_table.py ROUND...

Per page size, W and size: each forced algorithm's median time over the rounds, out of
place / in place (ms), the fastest marked; what the tuner picked and its own run's medians;
and the picked algorithm's time forced over the fastest's, the worse of the two modes (at
most 1.05: the pick is the fastest or within 5%; set against the other forced runs, not
against the tuner's own run, which is a run apart).
"""

import re
import statistics
import sys

HEADER = re.compile(r"== pages=(\w+) W=(\d+) algo=(\w+)")


def read(paths):
    """{(pages, w, algo, bytes): ([oop us], [ip us])} and {(pages, w, bytes): {pick}}."""
    times, picks = {}, {}
    for path in paths:
        section = None
        for line in open(path):
            m = HEADER.match(line)
            words = line.split()
            if m:
                section = (m.group(1), int(m.group(2)), m.group(3))
            elif section and words and words[0] == "pick":
                picks.setdefault((section[0], section[1], int(words[1])), set()).add(words[2])
            elif section and len(words) == 5 and words[0].isdigit():
                oop, ip = times.setdefault((*section, int(words[0])), ([], []))
                oop.append(float(words[1]))
                ip.append(float(words[3]))
    return times, picks


def main(paths):
    times, picks = read(paths)
    algos = sorted({k[2] for k in times if k[2] != "auto"})
    rows = sorted({(k[0] != "small", k[0], k[1], k[3]) for k in times})
    head = ["pages", "W", "size"] + algos + ["pick", "its own run", "pick / fastest"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for _, pages, w, size in rows:
        med = {a: tuple(statistics.median(t) / 1e3 for t in times[(pages, w, a, size)])
               for a in algos + ["auto"] if (pages, w, a, size) in times}
        forced = [a for a in algos if a in med]
        fastest = [min(med[a][i] for a in forced) for i in (0, 1)]
        cells = []
        for a in algos:
            if a not in med:
                cells.append("")
                continue
            parts = [f"**{t:.1f}**" if t == fastest[i] else f"{t:.1f}"
                     for i, t in enumerate(med[a])]
            cells.append(" / ".join(parts))
        picked = picks.get((pages, w, size), set())
        pick = "/".join(sorted(picked)) or "?"
        own = " / ".join(f"{t:.1f}" for t in med.get("auto", ()))
        ratio = ""
        if len(picked) == 1 and pick in med:
            ratio = f"x{max(med[pick][i] / fastest[i] for i in (0, 1)):.2f}"
        tail = [pick, own, ratio]
        print(f"| {pages} | {w} | {size >> 20} MiB | " + " | ".join(cells + tail) + " |")
    n = len(paths)
    print(f"\nMedians of {n} round{'s' if n != 1 else ''}, ms out of place / in place; "
          "bold: the fastest forced.")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
