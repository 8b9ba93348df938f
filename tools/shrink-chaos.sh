#!/usr/bin/env bash
# Kills ranks at random points of the shrink path, run after run, and counts the outcomes.
#
#   tools/shrink-chaos.sh [RUNS] [WORLD]    (default 100 runs of 4 ranks)
#
# Each run starts WORLD ranks of the test worker's `shrink_chaos SEED` scenario under
# `chorusrun --survive`: one or two ranks drawn from SEED die (SIGKILL) at drawn moments
# (before a step, as a shrink starts, as one ends), and the others shrink after every failure
# until they have run 20 checked steps. A run is `ok` when every rank no signal killed exited
# 0, `wrong` when a rank saw a wrong result, `hung` when chorusrun's --timeout stopped it, and
# `failed` otherwise (a survivor gave up). Logs of the runs that were not `ok` stay in
# target/shrink-chaos/.
set -euo pipefail
runs=${1:-100}
world=${2:-4}
cd "$(dirname "$0")/.."
cargo build -q -p chorus-tools --bin chorusrun
cargo build -q -p chorus-tests --bin chorus-test-worker
logs=target/shrink-chaos
rm -rf "$logs" && mkdir -p "$logs"
declare -A count=([ok]=0 [wrong]=0 [hung]=0 [failed]=0)
start=$(date +%s)
for seed in $(seq 1 "$runs"); do
    log="$logs/seed$seed.log"
    code=0
    began=$(date +%s%3N)
    CHORUS_TIMEOUT=20 target/debug/chorusrun --standalone --nproc-per-node "$world" --survive \
        --timeout 180 target/debug/chorus-test-worker shrink_chaos "$seed" >"$log" 2>&1 || code=$?
    if grep -q "WRONG" "$log"; then
        outcome=wrong
    elif [ "$code" = 124 ]; then
        outcome=hung
    elif [ "$code" = 0 ]; then
        outcome=ok
    else
        outcome=failed
    fi
    count[$outcome]=$((count[$outcome] + 1))
    [ "$outcome" = ok ] && rm -f "$log"
    ms=$(( $(date +%s%3N) - began ))
    echo "seed $seed: $outcome in $((ms / 1000)).$(( ms % 1000 / 100 )) s"
done
echo "runs $runs, world $world, $(( $(date +%s) - start )) s: ok ${count[ok]}, failed ${count[failed]}, wrong ${count[wrong]}, hung ${count[hung]}"
