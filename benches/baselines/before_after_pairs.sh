#!/usr/bin/env bash
# One row from two builds in pairs, the order alternating (after first in odd pairs), for a row
# whose runs swing between modes more than the builds differ: PAIRS (28) pairs of the 8-byte
# all-reduce over TCP at W=NP (2), each line "PAIR SIDE OOP_US IP_US". before_after_pairs.py
# prints the medians and the median of the pairs' ratios.
#
# Usage: benches/baselines/before_after_pairs.sh BEFORE_BIN AFTER_BIN > OUT.txt
set -euo pipefail
[[ $# -eq 2 ]] || { sed -n '2,7p' "$0"; exit 2; }
before=$1 after=$2
for pair in $(seq 1 "${PAIRS:-28}"); do
    sides="before after"
    (( pair % 2 )) && sides="after before"
    for side in $sides; do
        bin=$before
        [[ $side == after ]] && bin=$after
        printf '%s %s ' "$pair" "$side"
        CHORUS_TRANSPORT=tcp "$bin/allreduce_perf" -b 8 -e 8 -n 20000 -w 300000 -c 0 -np "${NP:-2}" |
            awk 'NF >= 12 && $1 ~ /^[0-9]+$/ { print $6, $10 }'
    done
done
