#!/usr/bin/env bash
# One round of the comparison tables: every row through Chorus, Open MPI and Gloo, with the
# ceilings that bound it, one library after the other.
#
# Shared memory first (Chorus's default transport on one host against Open MPI's vader), then
# TCP over loopback (CHORUS_TRANSPORT=tcp against Open MPI's tcp and Gloo): the 8-byte
# all-reduce, the 64 MiB all-reduce and broadcast, and the barrier at W = 2 and 4, private
# buffers. shm_ceiling and tcp_ceiling run in the same round, so each row's bound is of the
# same minutes. Last, the same rows through the torch backend (torch_backend_bench.py, in
# place as torch.distributed's calls are), under Debian's torch and, where TORCH2 names a
# Python with torch 2.x and chorus_torch, under that one too. Run it three times in a row and
# take the medians: this kind of machine drifts by a third within an hour.
#
# Usage (release tools built; Open MPI's mpirun and mpi4py, and PyTorch for Gloo, installed):
#   cargo build --release -p chorus-tools
#   for r in 1 2 3; do benches/baselines/every_row.sh > benches/results/every-row/round-$r.txt; done
#   python3 benches/baselines/regenerate.py   # benches/RESULTS.md's tables and plot from them
# Environment: BIN (target/release), PYTHON (/usr/bin/python3: Debian's, with torch, mpi4py
# and chorus_torch), TORCH2 (unset), PARTS (the parts to run, of "shm tcp torch sweep": all;
# "chorus" runs Chorus's shm and tcp rows alone, as before_after.sh does), PAGES (the page
# sizes of the shared-memory part's private buffers, of "small huge": both).
# Chorus's lines are the perf tools' columns: size, time and busbw out of place, time and busbw
# in place; the baselines' are collective_bench.py's: call, bytes, time (us), algbw, busbw.
# A command that fails or runs past 10 minutes is named in a "-- failed" line, and the round
# goes on.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release}
PYTHON=${PYTHON:-/usr/bin/python3}
BENCH=benches/baselines/collective_bench.py
CALLS=(--ops allreduce,broadcast,barrier --sizes 8,64M)
# A job's first few hundred milliseconds of small calls run slower where ranks outnumber cores
# (the kernel is still spreading the spinning ranks over the cores; ranks pinned to cores show
# no such start): every library's small calls are timed after about a second of warm-up.
WARM=(--warmup-seconds 1)
PARTS=${PARTS:-shm tcp torch sweep}
PAGES=${PAGES:-small huge}
BENCH_ARGS=()

# Runs a command with a time limit; says so if it fails.
run() { timeout 600 "$@" || echo "-- failed ($?): $*"; }

# The data line of a perf tool's table: size, then both times and both bus bandwidths.
row() { awk 'NF >= 12 && $1 ~ /^[0-9]+$/ { print $1, $6, $8, $10, $12 }'; }

# Chorus's four rows at W ranks over `transport` (shm: the default, tcp: CHORUS_TRANSPORT=tcp);
# with `huge` as the third argument, its 64 MiB rows alone on buffers advised onto huge pages
# (titles ending ", huge pages").
chorus() {
    local transport=$1 w=$2 pages=${3:-small} env=(env -u CHORUS_TRANSPORT) flag=() tail=""
    [[ $transport == tcp ]] && env=(env CHORUS_TRANSPORT=tcp)
    [[ $pages == huge ]] && flag=(--hugepages) tail=", huge pages"
    if [[ $pages == small ]]; then
        echo "-- chorus $transport W=$w all-reduce 8 B"
        run "${env[@]}" "$BIN/allreduce_perf" -b 8 -e 8 -n 20000 -w 300000 -c 0 -np "$w" | row
    fi
    echo "-- chorus $transport W=$w all-reduce 64 MiB$tail"
    run "${env[@]}" "$BIN/allreduce_perf" -b 64M -e 64M -n 10 -w 2 -c 0 -np "$w" "${flag[@]}" | row
    echo "-- chorus $transport W=$w broadcast 64 MiB$tail"
    run "${env[@]}" "$BIN/broadcast_perf" -b 64M -e 64M -n 10 -w 2 -c 0 -np "$w" "${flag[@]}" | row
    if [[ $pages == small ]]; then
        echo "-- chorus $transport W=$w barrier"
        run "${env[@]}" "$BIN/barrier_perf" -n 100000 -w 300000 -c 0 -np "$w" | row
    fi
}

# Open MPI with the byte transfer layers given, W ranks; CALLS and BENCH_ARGS name the calls.
mpi() {
    local w=$1 btl=$2
    shift 2
    run mpirun --allow-run-as-root --oversubscribe -np "$w" --mca btl "$btl" "$@" \
        "$PYTHON" "$BENCH" --backend mpi "${CALLS[@]}" "${WARM[@]}" --small-iters 20000 \
        "${BENCH_ARGS[@]}" | grep -v '^#'
}

# Shared memory on each page size of PAGES: on huge pages, the 64 MiB rows alone, both
# libraries' private buffers advised onto them, and shm_ceiling's copies on them too.
shm() {
    for pages in $PAGES; do
        local tail="" flag=()
        [[ $pages == huge ]] && tail=", huge pages" flag=(--hugepages)
        echo "-- shm_ceiling$tail"
        run "$BIN/shm_ceiling" -n 3 "${flag[@]}"
        for w in 2 4; do
            chorus shm "$w" "$pages"
            echo "-- open mpi vader W=$w$tail"
            vader "$w" "$pages"
        done
    done
}

# Open MPI's vader rows at W ranks; on huge pages the 64 MiB rows alone, numpy's arrays left
# on the huge pages it asks for.
vader() {
    local w=$1 pages=$2
    [[ $pages == huge ]] && local CALLS=(--ops allreduce,broadcast --sizes 64M) BENCH_ARGS=(--hugepages)
    mpi "$w" vader,self
}

tcp() {
    echo "-- tcp_ceiling"
    run "$BIN/tcp_ceiling" -np 4
    for w in 2 4; do
        chorus tcp "$w"
        echo "-- open mpi tcp W=$w"
        mpi "$w" tcp,self --mca btl_tcp_if_include lo
        echo "-- gloo W=$w"
        run "$PYTHON" "$BENCH" --backend gloo -np "$w" "${CALLS[@]}" "${WARM[@]}" | grep -v '^#'
    done
}

# Chorus's rows alone, both transports, for comparing two builds of it (before_after.sh).
chorus_only() {
    for transport in shm tcp; do
        for w in 2 4; do chorus "$transport" "$w"; done
    done
}

# The all-reduce at W=4 from 8 B to 64 MiB, for the plot of bus bandwidth against size:
# Chorus over shared memory, Open MPI's vader and Gloo (TCP over loopback, its only way).
SWEEP=8,64,512,4K,32K,256K,2M,16M,64M
sweep() {
    echo "-- chorus shm W=4 all-reduce sweep"
    run env -u CHORUS_TRANSPORT "$BIN/allreduce_perf" -b 8 -e 64M -f 8 -n 50 -w 10 -c 0 -np 4 | row
    echo "-- open mpi vader W=4 sweep"
    run mpirun --allow-run-as-root --oversubscribe -np 4 --mca btl vader,self \
        "$PYTHON" "$BENCH" --backend mpi --ops allreduce --sizes $SWEEP -n 50 -w 10 --small-iters 2000 |
        grep -v '^#'
    echo "-- gloo W=4 sweep"
    run "$PYTHON" "$BENCH" --backend gloo -np 4 --ops allreduce --sizes $SWEEP -n 50 -w 10 \
        --small-iters 2000 | grep -v '^#'
}

# The rows through torch.distributed's chorus backend (Gloo's are in the TCP part).
torch() {
    for python in "$PYTHON" ${TORCH2:+"$TORCH2"}; do
        echo "-- torch backend, torch $("$python" -c 'import torch; print(torch.__version__)')"
        run env -u CHORUS_TRANSPORT "$python" benches/baselines/torch_backend_bench.py \
            -np 2,4 --sizes 8,64M --steps 0 --backends chorus
    done
}

echo "== $(date +%T), load average $(cut -d' ' -f1 /proc/loadavg)"
# The machine's traits beside the figures: its processor and caches here, its memory's rate
# and a system call's cost in shm_ceiling's copy and syscall lines.
echo "-- machine: $(nproc) cores; $(lscpu | awk -F: '/^(Model name|L1d|L2|L3)/ {gsub(/^ +/, "", $2); printf "%s %s; ", $1, $2}')"
for part in $PARTS; do
    case $part in
        shm | tcp | torch | sweep) "$part" ;;
        chorus) chorus_only ;;
        *) echo "-- unknown part $part (PARTS takes shm, tcp, torch, sweep and chorus)" ;;
    esac
done
