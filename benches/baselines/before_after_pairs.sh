#!/usr/bin/env bash
# One row from two builds in pairs, the order alternating (after first in odd pairs), for a row
# whose runs swing between modes more than the builds differ: PAIRS (28) pairs of one perf
# tool's row, each line "PAIR SIDE OOP_US IP_US" (the row's times out of place and in place).
# The row is the tool and its arguments given after the builds; without them, the 8-byte
# all-reduce at W=NP (2). TRANSPORT (tcp) is the transport: tcp, or shm (Chorus's default).
# BEFORE_ENV and AFTER_ENV (VAR=VALUE words) set the sides' environments apart, so one build
# can be set against itself under two settings (e.g. two algorithms forced).
# before_after_pairs.py prints the medians and the median of the pairs' ratios.
#
# Usage: benches/baselines/before_after_pairs.sh BEFORE_BIN AFTER_BIN [TOOL ARG...] > OUT.txt
#   e.g. TRANSPORT=shm PAIRS=16 before_after_pairs.sh B A broadcast_perf -b 64M -e 64M -n 10 -w 2 -c 0 -np 4
#   BEFORE_ENV=CHORUS_ALGO=allreduce:tree AFTER_ENV=CHORUS_ALGO=allreduce:rhd TRANSPORT=shm \
#       before_after_pairs.sh target/release target/release allreduce_perf -b 16M -e 16M ... -np 4
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n '2,14p' "$0"; exit 2; }
before=$1 after=$2
shift 2
row=("$@")
[[ ${#row[@]} -gt 0 ]] || row=(allreduce_perf -b 8 -e 8 -n 20000 -w 300000 -c 0 -np "${NP:-2}")
env=(env CHORUS_TRANSPORT=tcp)
case ${TRANSPORT:-tcp} in
    tcp) ;;
    shm) env=(env -u CHORUS_TRANSPORT) ;;
    *) echo "TRANSPORT must be tcp or shm, not ${TRANSPORT}" >&2; exit 2 ;;
esac
for pair in $(seq 1 "${PAIRS:-28}"); do
    sides="before after"
    (( pair % 2 )) && sides="after before"
    for side in $sides; do
        bin=$before sets=${BEFORE_ENV:-}
        [[ $side == after ]] && bin=$after sets=${AFTER_ENV:-}
        printf '%s %s ' "$pair" "$side"
        # shellcheck disable=SC2086 # the settings are words
        "${env[@]}" $sets "$bin/${row[0]}" "${row[@]:1}" |
            awk 'NF >= 12 && $1 ~ /^[0-9]+$/ { print $6, $10 }'
    done
done
