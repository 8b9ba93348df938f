#!/usr/bin/env bash
# One round of the tuner's picks against every algorithm forced: the all-reduce of 16 and
# 64 MiB through allreduce_perf at each W of WORLDS (3 4 8: on a 2-core machine, ranks that
# outnumber the cores) on both page sizes of the private buffers, each algorithm forced with
# CHORUS_ALGO and then the tuner left to pick (its pick for each size recorded from its log).
# picks_table.py prints, per row, each algorithm's medians over the rounds and how far the
# pick lies from the fastest.
#
# Usage (release tools built):
#   for r in 1 2 3; do benches/baselines/picks.sh > benches/results/picks/round-$r.txt; done
#   python3 benches/baselines/regenerate.py
# Environment: BIN (target/release), WORLDS (3 4 8), ALGOS (ring tree rhd), ITERS (5), WARMUP (10:
# steady state; at W = 4, 16 MiB, the tree gained 5-13% on halving-doubling from 2 warm-up
# calls to 10).
# Sections start "== pages=P W=N algo=A" (A "auto": the tuner); the perf tools' lines follow
# (size, time and busbw out of place, time and busbw in place), then "pick BYTES ALGO" lines
# for the tuner's sections.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release}
for pages in small huge; do
    flag=()
    [[ $pages == huge ]] && flag=(--hugepages)
    for w in ${WORLDS:-3 4 8}; do
        for algo in ${ALGOS:-ring tree rhd} auto; do
            echo "== pages=$pages W=$w algo=$algo"
            forced=allreduce:$algo
            [[ $algo == auto ]] && forced=auto
            log=$(mktemp)
            CHORUS_ALGO=$forced CHORUS_DEBUG=info timeout 600 "$BIN/allreduce_perf" \
                -b 16M -e 64M -f 4 -n "${ITERS:-5}" -w "${WARMUP:-10}" -c 0 -np "$w" "${flag[@]}" 2>"$log" \
                | awk '/^ +[0-9]/ { print $1, $6, $8, $10, $12 }' \
                || echo "-- failed: allreduce_perf W=$w algo=$algo"
            [[ $algo == auto ]] && sed -n 's/\x1b\[[0-9;]*m//g; s/.*allreduce \([0-9]*\) B on [0-9]* ranks: .* -> \([a-z]*\) (model).*rank=0$/pick \1 \2/p' "$log" \
                | awk '$2 >= 16777216' | sort -u
            rm -f "$log"
        done
    done
done
