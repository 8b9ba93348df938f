#!/usr/bin/env python3
"""The tables of benches/RESULTS.md from rounds of every_row.sh: medians over the rounds, Chorus against
the other library, and against the ceiling the probes measured in the same rounds.

    for r in 1 2 3; do benches/baselines/every_row.sh > round-$r.txt; done
    python3 benches/baselines/every_row_table.py round-*.txt

Prints the machine's traits in each round, the table of every row (shared memory on small
pages, then its 64 MiB rows on huge pages where the rounds have them, then TCP), those 64 MiB
rows again with the two page sizes side by side, and the torch backend's rows beside vader's. A figure a round lacks (a part not run, a
command that failed) is left out of its median; a row no round has is left out.
"""

import re
import statistics
import sys


def sections(path):
    """A round's output as {section title: [lines]}, and its "==" line."""
    found, title, stamp = {}, None, ""
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("== "):
                stamp = line[3:]
            elif line.startswith("-- "):
                title = line[3:]
                found.setdefault(title, [])
            elif title is not None:
                found[title].append(line)
    return found, stamp


def number(text):
    return float(text) if text is not None else None


def chorus(rnd, title, place):
    """A perf tool's figure: place 0 out of place, 1 in place (time for small calls and
    barriers, bus bandwidth otherwise)."""
    for line in rnd.get(title, []):
        w = line.split()
        if len(w) == 5 and w[0].isdigit():
            small = w[0] in ("0", "8")
            return float(w[1 + 2 * place] if small else w[2 + 2 * place])
    return None


def baseline(rnd, title, call, size):
    """collective_bench.py's time (small calls) or bus bandwidth (64 MiB)."""
    for line in rnd.get(title, []):
        w = line.split()
        if len(w) == 5 and w[0] == call and w[1] == str(size):
            return float(w[2] if size <= 8 else w[4])
    return None


def probe(rnd, title, pattern):
    """The groups of `pattern` in the first matching line of a ceiling probe."""
    for line in rnd.get(title, []):
        m = re.search(pattern, line)
        if m:
            return [number(g) for g in m.groups()]
    return None


def torch_figure(rnd, version, w, call, size):
    """torch_backend_bench.py's time (8 B, barrier) or bus bandwidth under `version`."""
    for title, lines in rnd.items():
        if not title.startswith("torch backend, torch " + version):
            continue
        current = None
        for line in lines:
            m = re.match(r"# W=(\d+): (\w+) ", line)
            if m:
                current = (int(m.group(1)), m.group(2))
                continue
            parts = line.split()
            if current == (w, call) and len(parts) == 3 and parts[0] == str(size):
                return float(parts[1] if size <= 8 else parts[2])
    return None


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v):
    if v is None:
        return "-"
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def pair(values):
    """Figures joined with " / ", or the one figure where they are all the same."""
    texts = [fmt(v) for v in values]
    return texts[0] if len(set(texts)) == 1 else " / ".join(texts)


def speedup(chorus_value, other, is_time):
    """How many times the other's speed Chorus's is (for a time, the other's over Chorus's)."""
    if chorus_value is None or other is None:
        return None
    return other / chorus_value if is_time else chorus_value / other


def by_round(chorus_values, others, is_time):
    """The median over the rounds of each round's speed-up."""
    return median([speedup(c, o, is_time) for c, o in zip(chorus_values, others)])


def traits(rounds):
    print("Machine in each round:")
    for i, (rnd, stamp) in enumerate(rounds, 1):
        copy = probe(rnd, "shm_ceiling", r"memcpy of 64 MiB: ([\d.]+) GB/s on one core; ([\d.]+)")
        meet = probe(rnd, "shm_ceiling", r"meet +W=2 .*: ([\d.]+) us")
        syscall = probe(rnd, "shm_ceiling", r"getppid (\d+) ns, sched_yield (\d+) ns")
        parts = [stamp]
        if copy:
            parts.append(f"memcpy 64 MiB {fmt(copy[0])} GB/s alone, {fmt(copy[1])} each on two")
        if meet:
            parts.append(f"bare W=2 meeting {fmt(meet[0])} us")
        if syscall:
            parts.append(f"getppid {syscall[0]:.0f} ns, sched_yield {syscall[1]:.0f} ns")
        print(f"- round {i}: " + "; ".join(parts))
    print()


class Rounds:
    """One figure read from every round, as a list over the rounds."""

    def __init__(self, rounds):
        self.rounds = rounds

    def each(self, read):
        return [read(rnd) for rnd, _ in self.rounds]

    def chorus(self, title, places=(0, 1)):
        return [self.each(lambda r, p=p: chorus(r, title, p)) for p in places]

    def baseline(self, title, call, size):
        return self.each(lambda r: baseline(r, title, call, size))

    def probe(self, title, pattern, count=1):
        """Each of a probe line's `count` numbers over the rounds."""
        return [self.each(lambda r, i=i: (probe(r, title, pattern) or [None] * count)[i])
                for i in range(count)]


def row(label, is_time, other, figures, ceilings=None, ceiling_text=None):
    """One line of the table: medians over the rounds, and the medians of each round's
    ratios. `other` is (its figure over the rounds, its name); `ceilings` has one figure
    over the rounds per Chorus figure (a floor for a time, a bound for a bandwidth)."""
    values, name = other
    if all(f is None for figure in figures for f in figure):
        return
    against, shares = ratios(is_time, values, figures, ceilings)
    if ceiling_text is None:
        ceiling_text = pair(median(c) for c in ceilings) if ceilings else ""
    other_text = fmt(median(values)) + (f" ({name})" if name else "")
    print(f"| {label} | {other_text} | {pair(median(f) for f in figures)} | {against} "
          f"| {ceiling_text} | {shares} |")


def ratios(is_time, values, figures, ceilings=None):
    """Chorus's `figures` against the other's `values`, and against `ceilings` (one per
    figure), as texts: the medians of each round's ratios."""
    against = " / ".join(ratio(by_round(f, values, is_time)) for f in figures)
    shares = " / ".join(percent(by_round(f, c, is_time))
                        for f, c in zip(figures, ceilings or []))
    return against, shares


def ratio(value):
    return "-" if value is None else f"x{value:.2f}"


def percent(value):
    return "-" if value is None else f"{100 * value:.0f}%"


HUGE = ", huge pages"


def shm_bounds(m, w, call, pages):
    """shm_ceiling's bound on the 64 MiB `call` at W=w, out of place and in place, over
    the rounds."""
    ceiling = "shm_ceiling" + pages
    if call == "all-reduce":
        # Rounds before the out-of-place reduction's own rate gave one bound for both.
        in_place, out_of_place = m.probe(
            ceiling, rf"W={w} all-reduce .*<= ([\d.]+) GB/s(?: in place, ([\d.]+))?", 2)
        return [[o if o is not None else i for o, i in zip(out_of_place, in_place)], in_place]
    in_place, out_of_place = m.probe(
        ceiling, rf"W={w} broadcast .*<= ([\d.]+) GB/s in place, ([\d.]+)", 2)
    return [out_of_place, in_place]


def pages_side_by_side(rounds):
    """The 64 MiB shared-memory rows on both page sizes, side by side: Chorus against vader
    out of place / in place, and its share of the row's bound; where the rounds ran both."""
    m = Rounds(rounds)
    if all(v is None for v in m.baseline(f"open mpi vader W=2{HUGE}", "allreduce", 64 << 20)):
        return
    print("| 64 MiB row: Chorus against vader (share of bound) | 4 KiB pages | huge pages |")
    print("|---|---|---|")
    for w in (2, 4):
        for call, name in (("all-reduce", "allreduce"), ("broadcast", "broadcast")):
            cells = []
            for pages in ("", HUGE):
                vader = m.baseline(f"open mpi vader W={w}{pages}", name, 64 << 20)
                figures = m.chorus(f"chorus shm W={w} {call} 64 MiB{pages}")
                against, shares = ratios(False, vader, figures, shm_bounds(m, w, call, pages))
                cells.append(f"{against} ({shares})")
            print(f"| {call} W={w} | {cells[0]} | {cells[1]} |")
    print()


def shm_rows(m, w, pages=""):
    """The shared-memory rows at W=w; with pages=HUGE, the 64 MiB rows on huge pages (both
    libraries' buffers, and the bounds', advised onto them)."""
    vader = f"open mpi vader W={w}{pages}"
    shm = f"chorus shm W={w}"
    ceiling = "shm_ceiling" + pages
    on = " on huge pages" if pages else ""
    row(f"shm all-reduce W={w}, 8 B (us)", True, (m.baseline(vader, "allreduce", 8), ""),
        m.chorus(shm + " all-reduce 8 B" + pages))
    if w == 4:
        floor = m.probe(ceiling, r"meet +W=4 .*: ([\d.]+) us")
        row("shm barrier W=4 (us)", True, (m.baseline(vader, "barrier", 0), ""),
            m.chorus(shm + " barrier" + pages, (0,)), floor)
    bound = shm_bounds(m, w, "all-reduce", pages)
    row(f"shm all-reduce W={w}, 64 MiB{on} (GB/s)", False,
        (m.baseline(vader, "allreduce", 64 << 20), ""),
        m.chorus(shm + " all-reduce 64 MiB" + pages), bound)
    row(f"shm broadcast W={w}, 64 MiB{on} (GB/s)", False,
        (m.baseline(vader, "broadcast", 64 << 20), ""),
        m.chorus(shm + " broadcast 64 MiB" + pages), shm_bounds(m, w, "broadcast", pages))


def tcp_rows(m, w):
    tcp = f"chorus tcp W={w}"

    def better(call, size, is_time):
        """The better of Open MPI's TCP transport and Gloo by their medians: (figure, name)."""
        known = [(v, name) for v, name in
                 ((m.baseline(f"open mpi tcp W={w}", call, size), "Open MPI"),
                  (m.baseline(f"gloo W={w}", call, size), "Gloo")) if median(v) is not None]
        if not known:
            return [], ""
        return (min if is_time else max)(known, key=lambda k: median(k[0]))

    floor = m.probe("tcp_ceiling", rf"exchange +W={w} .*: ([\d.]+) us")
    row(f"TCP all-reduce W={w}, 8 B (us)", True, better("allreduce", 8, True),
        m.chorus(tcp + " all-reduce 8 B"), floor * 2, fmt(median(floor[0])))
    row(f"TCP barrier W={w} (us)", True, better("barrier", 0, True),
        m.chorus(tcp + " barrier", (0,)), floor)
    cold, warm = m.probe(
        "tcp_ceiling", rf"all-reduce W={w} of .*<= ([\d.]+) GB/s cold, ([\d.]+) warm", 2)
    row(f"TCP all-reduce W={w}, 64 MiB (GB/s)", False, better("allreduce", 64 << 20, False),
        m.chorus(tcp + " all-reduce 64 MiB"), [cold, cold],
        f"{pair(map(median, (cold, warm)))} (cold share)")
    if w == 2:
        # The bare broadcast in 512 KiB pieces, out of place and in place.
        in_place, out_of_place = m.probe(
            "tcp_ceiling", r"in 512 KiB pieces: ([\d.]+) GB/s in place, ([\d.]+) out", 2)
        ceilings = [out_of_place, in_place]
        text = f"bare {pair(map(median, ceilings))}"
    else:
        cold, warm = m.probe(
            "tcp_ceiling", rf"bound +broadcast W={w} .*<= ([\d.]+) GB/s cold, ([\d.]+) warm", 2)
        ceilings, text = [cold, cold], f"{pair(map(median, (cold, warm)))} (cold share)"
        # The bare chain in 512 KiB pieces (in place), where the round measured it.
        chain, = m.probe("tcp_ceiling", rf"chain +broadcast W={w} .*: ([\d.]+) GB/s")
        if median(chain) is not None:
            ceilings, text = [chain, chain], f"bare chain {fmt(median(chain))}; {text}"
    row(f"TCP broadcast W={w}, 64 MiB (GB/s)", False, better("broadcast", 64 << 20, False),
        m.chorus(tcp + " broadcast 64 MiB"), ceilings, text)


def every_row(rounds):
    m = Rounds(rounds)
    print("| row | other | Chorus | Chorus against other | ceiling | Chorus against ceiling |")
    print("|---|---|---|---|---|---|")
    for w in (2, 4):
        shm_rows(m, w)
    for w in (2, 4):
        shm_rows(m, w, HUGE)
    for w in (2, 4):
        tcp_rows(m, w)
    print()


def torch_rows(rounds):
    versions = []
    for rnd, _ in rounds:
        for title in rnd:
            m = re.match(r"torch backend, torch (\S+)", title)
            if m and m.group(1) not in versions:
                versions.append(m.group(1))
    if not versions:
        return
    m = Rounds(rounds)
    print("| row | vader | " + " | ".join(f"torch {v}" for v in versions)
          + " | against vader |")
    print("|---|---|" + "---|" * len(versions) + "---|")
    for label, w, call, size in (("all-reduce W=2, 8 B (us)", 2, "allreduce", 8),
                                 ("all-reduce W=4, 8 B (us)", 4, "allreduce", 8),
                                 ("barrier W=4 (us)", 4, "barrier", 0),
                                 ("all-reduce W=2, 64 MiB (GB/s)", 2, "allreduce", 64 << 20),
                                 ("all-reduce W=4, 64 MiB (GB/s)", 4, "allreduce", 64 << 20),
                                 ("broadcast W=2, 64 MiB (GB/s)", 2, "broadcast", 64 << 20),
                                 ("broadcast W=4, 64 MiB (GB/s)", 4, "broadcast", 64 << 20)):
        vader = m.baseline(f"open mpi vader W={w}", call, size)
        figures = [m.each(lambda r, v=v: torch_figure(r, v, w, call, size)) for v in versions]
        against = " / ".join(ratio(by_round(f, vader, size <= 8)) for f in figures)
        print(f"| {label} | {fmt(median(vader))} | "
              + " | ".join(fmt(median(f)) for f in figures) + f" | {against} |")
    print()


def main(paths):
    if not paths:
        sys.exit("usage: every_row_table.py ROUND_FILE...")
    rounds = [sections(p) for p in paths]
    traits(rounds)
    every_row(rounds)
    pages_side_by_side(rounds)
    torch_rows(rounds)


if __name__ == "__main__":
    main(sys.argv[1:])
