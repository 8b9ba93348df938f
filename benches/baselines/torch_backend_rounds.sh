#!/usr/bin/env bash
# Rounds of the torch backend against Gloo on the CPU, under each torch given:
#
#     benches/baselines/torch_backend_rounds.sh OUT ROUNDS PYTHON...
#
# Each round runs torch_backend_bench.py (all-reduce of 8 B, 64 KiB, 1 MiB and 64 MiB, DDP
# of the ToyModel and the MLP, at 2 and 4 ranks) once under each PYTHON in turn, into
# OUT/round-R-torchX.Y.txt, which starts with the torch version and the machine's load.
# torch_backend_table.py prints the table of their medians (RESULTS.md's "Through the
# torch backend" is generated from benches/results/torch-backend/).
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,10p' "$0"; exit 2; }
out=$1 rounds=$2
shift 2
here=$(dirname "$0")
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
    for python in "$@"; do
        version=$("$python" -c 'import torch; print(".".join(torch.__version__.split(".")[:2]))')
        file="$out/round-$round-torch$version.txt"
        {
            echo "# torch $version; load average $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) cores"
            "$python" "$here/torch_backend_bench.py" -np 2,4 --backends chorus,gloo --ops allreduce \
                --sizes 8,64K,1M,64M
        } > "$file"
        echo "$file"
    done
done
