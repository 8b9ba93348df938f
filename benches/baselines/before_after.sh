#!/usr/bin/env bash
# Chorus's every-row figures from two builds, interleaved: ROUNDS rounds (3), each running
# the rows of every_row.sh's "chorus" part with the build before, then the build after, so
# both see the same minutes of this drifting machine. The rounds go to OUT (a folder), and
# before_after_table.py prints each row's median ratio, after over before.
#
# Usage:
#   git worktree add /tmp/before REV && (cd /tmp/before && CARGO_TARGET_DIR=/tmp/before-target \
#       cargo build --release -p chorus-tools)
#   cargo build --release -p chorus-tools
#   benches/baselines/before_after.sh /tmp/before-target/release target/release OUT
#   python3 benches/baselines/before_after_table.py OUT
set -euo pipefail
[[ $# -eq 3 ]] || { sed -n '2,12p' "$0"; exit 2; }
before=$1 after=$2 out=$3
cd "$(dirname "$0")/../.."
mkdir -p "$out"
for round in $(seq 1 "${ROUNDS:-3}"); do
    for side in before after; do
        bin=$before
        [[ $side == after ]] && bin=$after
        BIN=$bin PARTS=chorus benches/baselines/every_row.sh > "$out/$side-$round.txt"
    done
done
