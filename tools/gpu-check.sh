#!/usr/bin/env bash
# Every GPU check of Chorus, in one table.
#
#   tools/gpu-check.sh build [DIR]   build the release binaries into DIR (default
#                                    target/gpu-check), on any x86-64 Linux machine with cargo
#   tools/gpu-check.sh run [DIR]     on a machine with an NVIDIA GPU (no Rust needed): run the
#                                    checks from DIR's binaries, print one table
#
# The checks, with CHORUS_REQUIRE_CUDA=1 (a missing GPU fails, never skips):
#   kernels cold / warm   the CUDA kernel tests, on an empty kernel cache, then on the filled one
#   sum f32 / bf16        the sum kernels' bandwidth as a share of a device-to-device copy, 256 MiB
#   collectives ...       the device collectives' tests at 1, 2 and 4 ranks on the GPU(s),
#                         through CUDA IPC and through pinned-host staging, and a rank of three
#                         leaving, the other two shrinking the device communicator and going on
#   stream order          asynchronous device calls: the time to return with 200 GiB of
#                         copies queued ahead, work queued after the call seeing its result, a
#                         failed call releasing its stream, a call under graph capture refused
#   all-reduce 64 MiB     W = 2 and 4 ranks: device all-reduce time, bus bandwidth, the IPC
#                         path against the floor its bytes allow at the copy bandwidth, the
#                         staged path against the host-buffer all-reduce (also over TCP)
#   allreduce_perf        allreduce_perf --device cuda, -np 2 and -np 4, and -np 2 -g 2
#   train                 the trainer's GPU tests (--device cuda against the host trainer), and
#                         train --bench 200 samples/s on the CPU and the GPU, -np 1 and 2 (on
#                         Fashion-MNIST, copied from the build machine's dataset-fashion-mnist)
#   torch backend         where the machine's python3 has torch on CUDA and pytest: the torch
#                         backend's CUDA tests (python/tests/test_cuda.py), the DDP example on
#                         the GPU (python/examples/ddp_toy.py --device cuda), and under MPS its
#                         64 MiB all-reduce on CUDA tensors against Gloo's
#                         (torch_backend_bench.py --device cuda), and the overlap of background
#                         calls on CPU tensors against Gloo's, and the time a 64 MiB
#                         all_reduce(async_op=True) on CUDA tensors takes to return
#                         (torch_overlap_bench.py)
set -uo pipefail

mode=${1:-}
dir=${2:-target/gpu-check}

build() {
    set -e
    mkdir -p "$dir"
    local json
    json=$(mktemp)
    cargo build --release -p chorus-tools --features cuda --bin chorusrun --bin allreduce_perf --bin train
    cargo build --release -p chorus-kernels --features cuda --example cuda_bench
    cargo build --release -p chorus-tests --features cuda --bin chorus-cuda-worker
    cargo test --release -p chorus-kernels --features cuda --no-run --message-format=json >"$json"
    cargo test --release -p chorus-tests --features cuda --test cuda --no-run --message-format=json >>"$json"
    cargo test --release -p chorus-tools --features cuda --test train --no-run --message-format=json >>"$json"
    local kernels tests train
    kernels=$(grep -o '"executable":"[^"]*chorus_kernels-[^"]*"' "$json" | tail -1 | cut -d'"' -f4)
    tests=$(grep -o '"executable":"[^"]*/cuda-[^"]*"' "$json" | tail -1 | cut -d'"' -f4)
    train=$(grep -o '"executable":"[^"]*/train-[^"]*"' "$json" | tail -1 | cut -d'"' -f4)
    rm -f "$json"
    cp target/release/chorusrun target/release/allreduce_perf target/release/chorus-cuda-worker \
        target/release/train target/release/examples/cuda_bench "$dir"/
    cp "$kernels" "$dir"/kernel-tests
    cp "$tests" "$dir"/cuda-tests
    cp "$train" "$dir"/train-tests
    [ ! -d /usr/share/datasets/fashion-mnist ] || cp -r /usr/share/datasets/fashion-mnist "$dir"/
    # The torch backend with CUDA support, laid out as an importable package.
    cargo build --release -p chorus-torch --lib --features cuda
    mkdir -p "$dir"/torch/chorus_torch
    cp python/chorus_torch/*.py "$dir"/torch/chorus_torch/
    cp target/release/lib_chorus.so "$dir"/torch/chorus_torch/_chorus.abi3.so
    strip --strip-debug "$dir"/* "$dir"/torch/chorus_torch/_chorus.abi3.so 2>/dev/null || true
    du -sh "$dir"
}

rows=()
row() { rows+=("$(printf '%-24s %-6s %s' "$1" "$2" "$3")"); }

# check NAME LIMIT_S COMMAND...: runs it, logs it under $log, adds a row with its status.
check() {
    local name=$1 limit=$2
    shift 2
    local out="$log/${name// /_}.log" start=$SECONDS
    timeout "$limit" "$@" >"$out" 2>&1
    local rc=$?
    local took=$((SECONDS - start))
    if [ $rc -eq 0 ]; then status=ok; else status="FAIL($rc)"; fi
    last_out=$out
    last_detail="${took}s"
    echo "== $name: $status in ${took}s" >&2
    [ $rc -eq 0 ] || tail -20 "$out" >&2
}

run() {
    export CHORUS_REQUIRE_CUDA=1 CHORUS_TEST_BIN_DIR
    CHORUS_TEST_BIN_DIR=$(realpath "$dir")
    log=${OUT:-$(mktemp -d)}
    local cache
    cache=$(mktemp -d)
    nvidia-smi -L >&2 || true
    # The torch backend's package, where python3 has torch on CUDA and pytest to run it.
    torch=
    if python3 -c 'import torch, pytest; assert torch.cuda.is_available()' 2>/dev/null; then
        torch=$(realpath "$dir"/torch)
    fi

    check "kernels cold" 120 env CHORUS_CUDA_CACHE="$cache" "$dir"/kernel-tests cuda
    row "kernels cold cache" "$status" "$(grep -o 'test result.*passed;[^;]*failed' "$last_out" | tail -1) ($last_detail)"
    check "kernels warm" 120 env CHORUS_CUDA_CACHE="$cache" "$dir"/kernel-tests cuda
    row "kernels warm cache" "$status" "$(grep -o 'test result.*passed;[^;]*failed' "$last_out" | tail -1) ($last_detail)"

    check "cuda_bench" 120 "$dir"/cuda_bench 256
    for dtype in float bfloat16; do
        row "sum $dtype 256 MiB" "$status" "$(grep "^$dtype *reduce sum" "$last_out" | awk '{print $(NF-1) " GB/s, " $NF " of copy"}')"
    done

    check "collectives" 300 "$dir"/cuda-tests --test-threads 1 --nocapture
    row "collectives W=1,2,4" "$status" "$(grep -c 'device collectives ok' "$last_out") rank runs ok; ipc and staged ($last_detail)"
    row "shrink W=3 -> 2" "$status" "$(grep -c 'shrunk ok: rank [0-9] of 2' "$last_out") survivor runs ok of 4; ipc and staged"
    row "stream order (async)" "$status" "$(grep -o 'all_reduce_async returned in [0-9]* us, the work ahead [a-z ]*' "$last_out" | head -1); $(grep -c 'stream order: a failed call released' "$last_out") failed-call releases; $(grep -c 'stream order: a call under graph capture refused' "$last_out") capture refusals; $(grep -c 'streams cannot wait on memory' "$last_out") runs without stream waits"

    for path in ipc staged; do
        for world in 2 4; do
            check "bench $path $world" 120 env CHORUS_CUDA_PATH=$path "$dir"/chorusrun --standalone \
                --nproc-per-node $world "$dir"/chorus-cuda-worker bench $path 64
            row "all-reduce $path W=$world" "$status" \
                "$(grep -o 'device_us.*' "$last_out" | head -1)"
        done
    done

    # The staged path as it runs across hosts: every rank over TCP (loopback here).
    check "bench staged tcp 2" 120 env CHORUS_CUDA_PATH=staged CHORUS_TRANSPORT=tcp "$dir"/chorusrun \
        --standalone --nproc-per-node 2 "$dir"/chorus-cuda-worker bench staged 64
    row "all-reduce staged TCP W=2" "$status" "$(grep -o 'device_us.*' "$last_out" | head -1)"

    # Ranks sharing a GPU from separate processes take turns on it (time-slicing, a context
    # switch at every turn) unless CUDA MPS runs them in one context: the IPC rows again under
    # MPS where the machine has it. The daemon lives in a private folder and quits at the end.
    if command -v nvidia-cuda-mps-control >/dev/null; then
        export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
        if nvidia-cuda-mps-control -d; then
            for world in 2 4; do
                check "bench ipc mps $world" 120 env CHORUS_CUDA_PATH=ipc "$dir"/chorusrun \
                    --standalone --nproc-per-node $world "$dir"/chorus-cuda-worker bench ipc 64
                row "all-reduce ipc MPS W=$world" "$status" "$(grep -o 'device_us.*' "$last_out" | head -1)"
            done
            check "allreduce_perf mps 2" 120 "$dir"/allreduce_perf --device cuda -np 2 -b 16 -e 64M -f 4
            row "allreduce_perf MPS -np 2" "$status" "$(grep -E '^ +67108864' "$last_out" | head -1 | tr -s ' ')"
            if [ -n "$torch" ]; then
                check "torch bench mps" 240 env PYTHONPATH="$torch" python3 benches/baselines/torch_backend_bench.py \
                    -np 2,4 --device cuda --backends chorus,gloo --sizes 8,64M --steps 0
                row "torch MPS 64 MiB W=2,4" "$status" \
                    "$(awk '/allreduce/ { on = 1 } /broadcast/ { on = 0 } on && $1 == 67108864 { printf "%s us (gloo %s us, x%s)  ", $2, $4, substr($6, 2) }' "$last_out")"
            fi
            echo quit | nvidia-cuda-mps-control
        else
            row "MPS" "n/a" "nvidia-cuda-mps-control -d failed"
        fi
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    else
        row "MPS" "n/a" "no nvidia-cuda-mps-control on this machine"
    fi

    for world in 2 4; do
        check "allreduce_perf $world" 120 "$dir"/allreduce_perf --device cuda -np $world -b 16 -e 64M -f 4
        row "allreduce_perf -np $world" "$status" "$(grep -E '^ +67108864' "$last_out" | head -1 | tr -s ' ')"
    done
    # Two GPUs per rank (both on the one GPU where there is one): 4 participants.
    check "allreduce_perf g2" 120 "$dir"/allreduce_perf --device cuda -np 2 -g 2 -b 16 -e 64M -f 4
    row "allreduce_perf -np 2 -g 2" "$status" "$(grep -E '^ +67108864' "$last_out" | head -1 | tr -s ' ')"

    check "train tests" 150 "$dir"/train-tests cuda --test-threads 1 --nocapture
    row "train --device cuda" "$status" "$(grep -c '^test .* ok$' "$last_out") tests ok; $(grep -o 'W=2: GPU vs host.*' "$last_out" | head -1) ($last_detail)"

    for world in 1 2; do
        for device in cpu cuda; do
            check "train $device $world" 60 "$dir"/train --device $device --bench 200 -np $world \
                --data-dir "$dir"/fashion-mnist --no-progress
            row "train $device -np $world" "$status" "$(grep -o 'step_ms.*' "$last_out" | head -1)"
        done
    done

    if [ -n "$torch" ]; then
        check "torch cuda tests" 300 env PYTHONPATH="$torch" python3 -m pytest -q -rs -p no:cacheprovider \
            python/tests/test_cuda.py
        row "torch backend, CUDA" "$status" "$(grep -E '[0-9]+ passed' "$last_out" | tail -1) ($last_detail)"
        check "torch ddp example" 120 env PYTHONPATH="$torch" "$dir"/chorusrun --standalone --nproc-per-node 2 python3 \
            python/examples/ddp_toy.py --device cuda --steps 20
        row "ddp_toy.py --device cuda" "$status" "$(grep -o 'rank = 0: trained.*' "$last_out" | head -1)"
        # Calls on CUDA tensors return once enqueued (torch 2.7 and later): 64 MiB, target <= 50 us.
        check "torch cuda return" 180 env PYTHONPATH="$torch" python3 benches/baselines/torch_overlap_bench.py -np 2 \
            --device cuda
        row "torch async return 64M" "$status" "$(awk '$1 == "chorus" || $1 == "gloo" { printf "%s %s us  ", $1, $2 }' "$last_out")"
        # Background calls on CPU tensors (torch 2.7 and later), on a machine with a core per rank.
        check "torch overlap" 300 env PYTHONPATH="$torch" python3 benches/baselines/torch_overlap_bench.py -np 2
        row "torch overlap (CPU)" "$status" "$(awk '$1 == "chorus" || $1 == "gloo" { printf "%s %s  ", $1, $NF }' "$last_out")"
    else
        row "torch backend, CUDA" "n/a" "no python3 with torch on CUDA and pytest here"
    fi

    echo
    printf '%-24s %-6s %s\n' check status result
    printf '%s\n' "${rows[@]}"
}

case $mode in
build) build ;;
run) run ;;
*)
    echo "usage: $0 build|run [DIR]" >&2
    exit 2
    ;;
esac
