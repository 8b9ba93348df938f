#!/usr/bin/env bash
# Rounds of the trainer's parallel modes on the 784-1024-1024-1024-1024-10 MLP:
#
#     benches/baselines/modes_rounds.sh OUT ROUNDS TRAIN
#
# TRAIN is a release `train` binary. Each round runs every mode of modes_table.py at batch
# 256 (`--bench 60`) and 64 (`--bench 200`), W=1 first and last, into OUT/round-R.txt, which
# starts with the machine's load. modes_table.py prints the table of their medians
# (RESULTS.md's "Parallel modes" is generated from benches/results/modes/).
set -euo pipefail
[ $# -eq 3 ] || { sed -n '2,9p' "$0"; exit 2; }
out=$1 rounds=$2 train=$3
hidden="--hidden 1024,1024,1024,1024"
modes=(
    "-np 1"
    "-np 2 --pp 2 --micro-batches 4"
    "-np 2 --pp 2 --micro-batches 8"
    "-np 2 --dp 2"
    "-np 2 --dp 2 --zero 1"
    "-np 2 --dp 2 --zero 2"
    "-np 4 --pp 2 --dp 2 --micro-batches 8"
    "-np 1"
)
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
    file="$out/round-$round.txt"
    {
        echo "# load average $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) cores"
        for batch in "256 60" "64 200"; do
            set -- $batch
            for mode in "${modes[@]}"; do
                # shellcheck disable=SC2086
                "$train" $mode $hidden --batch-size "$1" --bench "$2" 2>&1 | grep -E '^(bench|rank)'
            done
        done
    } > "$file"
    echo "$file"
done
