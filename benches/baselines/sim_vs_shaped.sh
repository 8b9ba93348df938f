#!/usr/bin/env bash
# chorus_sim against measurements on shaped links.
#
# Builds W / PER_NODE network namespaces ("nodes", PER_NODE ranks each, 1 by default) on a bridge, shapes every
# node's link with tc tbf to RATE, measures the link's alpha (an 8-byte sendrecv)
# and beta (a large sendrecv) between two nodes, runs allreduce_perf with each
# all-reduce algorithm forced (CHORUS_ALGO) over a size sweep, runs chorus_sim with
# the measured alpha and beta, and prints predicted vs measured per size and
# algorithm, with the fastest measured algorithm (ties within 2% go to the earlier
# one) next to the tuner's pick.
#
# Both ends of each veth pair are shaped: the node's end limits what the node
# sends, the bridge's end what it receives. That is the model's NIC (one outgoing
# and one incoming link per rank, each at beta), so several senders to one node
# share its incoming rate as they would on a real switch port.
#
# TCP runs CUBIC on the nodes' routes whatever the host's default: under BBR
# the exchanges of recursive doubling and halving-doubling (both directions of
# one connection busy at once) got up to a fifth less than the shaped rate while the
# ring (one direction per connection) got all of it, so the measurement was of
# the congestion control and not of the schedule.
#
# Every veth end steers its packets to a CPU by flow (RPS). Without it a packet
# goes to the backlog of whichever CPU dequeued it from tbf, and the two CPUs
# deliver one connection's packets out of order: TCP took that for loss (no tbf
# dropped a packet, yet fast retransmits and SACK recoveries shrank the windows),
# and recursive doubling at W = 4 and 4 MiB ran at 0.70-1.00 of the model's speed,
# varying from run to run, where with RPS it ran at 1.00-1.01. A real NIC keeps a
# flow in order.
#
# With PER_NODE ranks on a node they share its shaped link and reach each other
# over shared memory (chorus_sim --ranks-per-host), and the hierarchical
# all-reduce joins the algorithms.
#
# Usage (root, iproute2 and tc; release binaries built):
#   cargo build --release -p chorus-tools
#   sudo benches/baselines/sim_vs_shaped.sh 100mbit "4 6 8" 1M 64M
#   sudo benches/baselines/sim_vs_shaped.sh 1gbit "4 8" 4M 256M
#   sudo PER_NODE=2 benches/baselines/sim_vs_shaped.sh 100mbit "4 6" 1M 16M
# Arguments: rate (tc syntax, in bit, kbit, mbit or gbit), worlds (ranks in all), smallest and
# largest size (step factor 4).
# Environment: PER_NODE (1), ALGOS (default "ring tree rd rhd", and "hier" with PER_NODE > 1), ITERS (5),
# BIN (target/release), TBF (tbf's options, "burst <2 ms at RATE> latency 100ms"),
# CC (TCP congestion control, cubic).
set -euo pipefail

RATE=${1:-100mbit}
WORLDS=${2:-4}
MINB=${3:-1M}
MAXB=${4:-64M}
PER_NODE=${PER_NODE:-1}
if ((PER_NODE > 1)); then ALGOS=${ALGOS:-ring tree rd rhd hier}; else ALGOS=${ALGOS:-ring tree rd rhd}; fi
ITERS=${ITERS:-5}
BIN=${BIN:-target/release}
# A bucket of 2 ms at RATE: a larger one lets a rank that idled send that much
# at the veth's own speed (the tree ran 1.4-1.6x faster than predicted at 1 MiB,
# sizes below 64 KiB up to 9x, with 256 KB at 100 Mbit/s).
BURST=$(awk -v r="$RATE" 'BEGIN {
    n = r + 0; u = tolower(substr(r, length(n "") + 1))
    m = u == "kbit" ? 1e3 : u == "mbit" ? 1e6 : u == "gbit" ? 1e9 : u == "bit" || u == "" ? 1 : 0
    if (m == 0) { print "sim_vs_shaped: rate " r ": use bit, kbit, mbit or gbit" > "/dev/stderr"; exit 1 }
    printf "%d", n * m / 8 * 0.002 }')
TBF=${TBF:-burst $BURST latency 100ms}
CC=${CC:-cubic}
# RPS mask: every CPU, in 32-bit groups as sysfs writes them.
RPS=$(awk -v n="$(nproc)" 'BEGIN {
    for (g = 0; n > 0; g++) { k = n > 32 ? 32 : n; n -= k; m = sprintf("%x", 2 ^ k - 1); s = g ? m "," s : m }
    print s }')
ID=$$
BR=csb$ID
NODES=()

# Ends every process left in the nodes (an interrupted run leaves its ranks), then the nodes.
cleanup() {
    for ns in "${NODES[@]}"; do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
    ip link del "$BR" 2>/dev/null || true
}
trap cleanup EXIT

addr() { echo "10.78.0.$((10 + $1))"; }

# tbf on one device: RATE, the bucket above, and a queue of 100 ms so that
# TCP's window fills it without drops.
shape() {
    local ns=$1 dev=$2
    # shellcheck disable=SC2086
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$RATE" $TBF
}

# Creates nodes 0..n-1; the bridge lives in a namespace of its own so that the
# host's firewall and its other bridges never see the traffic.
make_cluster() {
    local n=$1
    ip netns add "csbr$ID"
    NODES+=("csbr$ID")
    ip -n "csbr$ID" link add "$BR" type bridge
    ip -n "csbr$ID" link set "$BR" up
    for ((i = 0; i < n; i++)); do
        local ns=cs$ID-n$i
        ip netns add "$ns"
        NODES+=("$ns")
        ip -n "$ns" link add eth0 type veth peer name "p$i" netns "csbr$ID"
        ip -n "csbr$ID" link set "p$i" master "$BR" up
        ip -n "$ns" addr add "$(addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        ip -n "$ns" route replace 10.78.0.0/24 dev eth0 congctl "$CC"
        shape "$ns" eth0
        shape "csbr$ID" "p$i"
        ip netns exec "$ns" sh -c "echo $RPS >/sys/class/net/eth0/queues/rx-0/rps_cpus"
        ip netns exec "csbr$ID" sh -c "echo $RPS >/sys/class/net/p$i/queues/rx-0/rps_cpus"
    done
}

drop_cluster() {
    cleanup
    NODES=()
}

# Runs a perf tool on `n` nodes of `per` ranks each; prints rank 0's table.
perf() {
    local n=$1 per=$2 tool=$3
    shift 3
    local pids=() out
    out=$(mktemp)
    for ((i = 0; i < n; i++)); do
        ip netns exec "cs$ID-n$i" "$BIN/chorusrun" --nnodes "$n" --node-rank "$i" \
            --nproc-per-node "$per" --master-addr "$(addr 0)" --master-port 29500 --timeout 600 \
            "$BIN/$tool" -n "$ITERS" -w 2 -c 0 "$@" >"$out.$i" 2>&1 &
        pids+=($!)
    done
    local rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    if ((rc)); then
        echo "sim_vs_shaped: $tool failed:" >&2
        cat "$out".* >&2
        exit 1
    fi
    cat "$out.0"
    rm -f "$out" "$out".*
}

# Out-of-place time in us per size from an nccl-tests table: "size time" lines.
# Lines carry chorusrun's "[rank0]: " prefix.
times() { sed 's/^\[rank[0-9]*\]: *//' | awk '!/^#/ && NF >= 8 && $1 ~ /^[0-9]+$/ { print $1, $6 }'; }

for W in $WORLDS; do
    if ((W % PER_NODE)); then
        echo "sim_vs_shaped: PER_NODE=$PER_NODE does not divide W=$W" >&2
        exit 1
    fi
    make_cluster $((W / PER_NODE))
    # A sendrecv step sends one message each way at once (alpha + S/beta): alpha is
    # an 8-byte step, beta the slope between a 4 MiB and a 16 MiB step (which leaves
    # out TCP's ramp-up at the start of each message).
    alpha_us=$(perf 2 1 sendrecv_perf -b 8 -e 8 | times | awk '{ print $2 }')
    gbps=$(perf 2 1 sendrecv_perf -b 4M -e 16M -f 4 | times |
        awk 'NR == 1 { s = $1; t = $2 } NR == 2 { printf "%.4f", ($1 - s) * 8 / (($2 - t) * 1e3) }')
    echo "# W=$W ($PER_NODE per node) rate $RATE tbf $TBF TCP $CC: measured alpha $alpha_us us, beta $gbps Gbit/s ($(uptime | sed 's/.*load/load/'))"

    declare -A measured=()
    for a in $ALGOS; do
        while read -r size t; do measured[$a,$size]=$t; done < <(
            CHORUS_ALGO="allreduce:$a" perf $((W / PER_NODE)) "$PER_NODE" allreduce_perf -b "$MINB" -e "$MAXB" -f 4 | times
        )
    done
    sim=$(mktemp)
    "$BIN/chorus_sim" -w "$W" -b "$MINB" -e "$MAXB" -f 4 --alpha-us "$alpha_us" --gbps "$gbps" \
        --ranks-per-host "$PER_NODE" \
        --algos "${ALGOS// /,}" >"$sim"
    # chorus_sim's rows: size, then (time busbw) per algorithm in its own order (the
    # header names them), then pick and best.
    read -ra order < <(awk '/size \(B\)/ { for (i = 4; i < NF - 1; i += 3) printf "%s ", $i; print "" }' "$sim")
    printf '%10s %-17s %12s %12s %6s\n' size algorithm predicted_us measured_us ratio
    grep -v '^#' "$sim" | while read -r size rest; do
        read -ra f <<<"$rest"
        j=0 best= bt=
        for a in "${order[@]}"; do
            p=${f[$((2 * j))]%\*}
            m=${measured[$a,$size]:-nan}
            printf '%10s %-17s %12.0f %12.0f %6.2f\n' "$size" "$a" "$p" "$m" \
                "$(awk -v p="$p" -v m="$m" 'BEGIN { print p / m }')"
            if [[ -z $bt ]] || awk -v m="$m" -v b="$bt" 'BEGIN { exit !(m < 0.98 * b) }'; then
                best=$a bt=$m
            fi
            j=$((j + 1))
        done
        echo "${size}: tuner picks ${f[$((2 * j))]}, simulation's best ${f[$((2 * j + 1))]}, measured best $best"
    done
    rm -f "$sim"
    unset measured
    drop_cluster
done
