#!/usr/bin/env bash
# Rounds of `train --bench` against PyTorch's DDP (gloo, CPU) on the same MLP, data, batch,
# optimizer and sampler:
#
#     benches/baselines/train_rounds.sh OUT ROUNDS TRAIN PYTHON
#
# TRAIN is a release `train` binary, PYTHON one with torch. Each round runs, at 1, 2 and 4
# ranks, `TRAIN -np W --bench 500` and tools/bench/torch_ddp_baseline.py W 500 right after
# it, into OUT/round-R.txt, which starts with the machine's load. train_table.py prints the
# table of their medians (RESULTS.md's "Training" is generated from benches/results/train/).
set -euo pipefail
[ $# -eq 4 ] || { sed -n '2,11p' "$0"; exit 2; }
out=$1 rounds=$2 train=$3 python=$4
baseline=$(dirname "$0")/../../tools/bench/torch_ddp_baseline.py
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
    file="$out/round-$round.txt"
    {
        echo "# load average $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) cores"
        for world in 1 2 4; do
            "$train" -np "$world" --bench 500 2>&1 | grep '^bench'
            "$python" "$baseline" "$world" 500 2>&1 | grep '^torch'
        done
    } > "$file"
    echo "$file"
done
