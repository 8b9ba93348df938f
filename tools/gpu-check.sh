#!/usr/bin/env bash
# Every GPU check of Chorus, in one table.
#
#   tools/gpu-check.sh build [DIR]   build the release binaries into DIR (default
#                                    target/gpu-check), on any x86-64 Linux machine with cargo
#                                    (NCCL_TESTS_SRC=PATH also copies nccl-tests' source)
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
#   NCCL API on Chorus    libnccl.so.2 (chorus-nccl, --features cuda): nccl/tests/c/device.c,
#                         compiled there with nvcc, runs every call on device memory at W = 2
#                         and 4 (and the time a 64 MiB all-reduce takes to return); its 8 B and
#                         64 MiB all-reduce timed on Chorus's library and on NVIDIA's (the
#                         nvidia-nccl wheel's, NCCL_MULTI_RANK_GPU_ENABLE=1), with and without
#                         MPS; torch's "nccl" backend on Chorus's library (LD_PRELOAD):
#                         nccl/tests/torch_collectives.py's collectives, and DDP of the ToyModel
#                         and an MLP ending with the parameters the chorus backend gives; and
#                         nccl-tests' all_reduce_perf (-t 2 -g 1) built there from the source
#                         that `build` copied (NCCL_TESTS_SRC: a git checkout or bare mirror)
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
    # NCCL's C API on Chorus, the programs that call it, and nccl-tests' source to build there.
    cargo build --release -p chorus-nccl --features cuda
    mkdir -p "$dir"/nccl
    cp target/release/libnccl.so "$dir"/nccl/libnccl.so.2
    cp nccl/tests/c/device.c nccl/tests/c/ranks.h nccl/tests/torch_collectives.py "$dir"/nccl/
    if [ -n "${NCCL_TESTS_SRC:-}" ]; then
        rm -rf "$dir"/nccl-tests && mkdir -p "$dir"/nccl-tests
        git --git-dir "$(git -C "$NCCL_TESTS_SRC" rev-parse --absolute-git-dir)" archive HEAD |
            tar -x -C "$dir"/nccl-tests
    fi
    strip --strip-debug "$dir"/* "$dir"/torch/chorus_torch/_chorus.abi3.so "$dir"/nccl/libnccl.so.2 \
        2>/dev/null || true
    du -sh "$dir"
}

# row CHECK STATUS RESULT: a row of the table, appended to $keep/rows.tsv at once (kept
# tab-separated for benches' gpu_table.py), so a run stopped at its time limit keeps the rows
# it got to; the table printed at the end is read back from it.
row() {
    printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$keep/rows.tsv"
}

# check NAME LIMIT_S COMMAND...: runs it, logs it under $log (the end of each log also goes to
# $keep/checks.log, so that a run leaves two files: that and rows.tsv), sets its status.
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
    { echo "=== $name: $status in ${took}s"; tail -n 300 "$out"; } >>"$keep/checks.log"
}

# The rows of NCCL's C API on Chorus (see the header).
nccl_rows() {
    local nvidia here=$(realpath "$dir"/nccl) exe
    nvidia=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)
    if [ -z "$nvidia" ] || [ ! -f "$nvidia/include/nccl.h" ] || ! command -v nvcc >/dev/null; then
        row "NCCL API on Chorus" "n/a" "no nvcc, or no nvidia-nccl wheel (nccl.h) for python3 here"
        return
    fi
    exe=$here/device
    check "nccl device build" 120 nvcc -O2 -I"$nvidia/include" "$here/device.c" -o "$exe" \
        -L"$here" -l:libnccl.so.2
    [ "$status" = ok ] || { row "NCCL API on Chorus" "$status" "nvcc device.c failed"; return; }
    for world in 2 4; do
        check "nccl device check $world" 180 env LD_LIBRARY_PATH="$here" "$exe" check $world
        row "NCCL API device W=$world" "$status" "$(grep -c ' ok: ' "$last_out") ranks ok; $(grep -o 'returned in [0-9]* us and finished in [0-9]* us' "$last_out" | head -1)"
    done
    # Side by side: the same program on NVIDIA's library (several ranks on one GPU need its
    # NCCL_MULTI_RANK_GPU_ENABLE) and on Chorus's.
    local mps=
    for round in plain mps; do
        if [ $round = mps ]; then
            command -v nvidia-cuda-mps-control >/dev/null || break
            export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
            CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
            nvidia-cuda-mps-control -d || break
            mps=" MPS"
        fi
        for bytes in 8 67108864; do
            local iters=200 line="" both=ok
            [ $bytes = 8 ] || iters=20
            for lib in chorus nvidia; do
                local path=$here
                [ $lib = chorus ] || path=$nvidia/lib
                check "nccl bench $lib $bytes$round" 120 env LD_LIBRARY_PATH="$path" NCCL_MULTI_RANK_GPU_ENABLE=1 \
                    "$exe" bench 2 $bytes $iters
                [ "$status" = ok ] || both=$status
                line+="$lib $(grep -o 'time_us=[0-9.]* busbw_GBps=[0-9.]*' "$last_out" || echo "$status")  "
            done
            row "NCCL all-reduce $bytes W=2$mps" "$both" "$line"
        done
        if [ $round = mps ]; then
            echo quit | nvidia-cuda-mps-control
            unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        fi
    done
    # torch's "nccl" backend on this library, against the chorus backend's parameters.
    if [ -n "$torch" ]; then
        check "torch nccl on chorus" 300 env LD_PRELOAD="$here/libnccl.so.2" NCCL_DEBUG=INFO \
            python3 -m torch.distributed.run --standalone --nproc-per-node 2 "$here"/torch_collectives.py \
            --backend nccl --device cuda
        local on_nccl=$last_out nccl_status=$status
        check "torch chorus backend" 300 env PYTHONPATH="$torch" python3 -m torch.distributed.run \
            --standalone --nproc-per-node 2 "$here"/torch_collectives.py --backend chorus --device cuda
        local same=no
        [ "$(grep -o 'toy [0-9.]* mlp [0-9.]*' "$on_nccl" | sort -u)" = "$(grep -o 'toy [0-9.]* mlp [0-9.]*' "$last_out" | sort -u)" ] && same=yes
        row "torch nccl on Chorus" "$nccl_status" "$(grep -c 'every collective ok' "$on_nccl") ranks' collectives ok; DDP toy+MLP as chorus backend: $same; Chorus's log lines: $(grep -c ' on 2 ranks: ' "$on_nccl")"
    fi
    # nccl-tests' all_reduce_perf, two ranks as threads of one process on the one GPU.
    if [ -d "$dir"/nccl-tests/src ]; then
        local home
        home=$(mktemp -d)
        mkdir -p "$home"/lib && ln -s "$nvidia/include" "$home"/include
        ln -s "$here/libnccl.so.2" "$home"/lib/libnccl.so
        check "nccl-tests build" 300 make -C "$dir"/nccl-tests/src -j 16 MPI=0 NCCL_HOME="$home" \
            CUDA_HOME="$(dirname "$(dirname "$(command -v nvcc)")")" \
            NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" BUILDDIR="$home"/build "$home"/build/all_reduce_perf
        if [ "$status" = ok ]; then
            check "nccl-tests all_reduce" 180 env LD_LIBRARY_PATH="$here" NCCL_TESTS_DEVICE=0 \
                "$home"/build/all_reduce_perf -b 8 -e 64M -f 8 -t 2 -g 1 -c 1
        fi
        row "nccl-tests all_reduce" "$status" "$(grep -o 'Out of bounds values : [0-9]* [A-Z]*' "$last_out"); $(grep -o 'Avg bus bandwidth *: [0-9.]*' "$last_out")"
    else
        row "nccl-tests all_reduce" "n/a" "no source copied (NCCL_TESTS_SRC at build)"
    fi
}

run() {
    export CHORUS_REQUIRE_CUDA=1 CHORUS_TEST_BIN_DIR
    CHORUS_TEST_BIN_DIR=$(realpath "$dir")
    log=$(mktemp -d)
    keep=${OUT:-$log}
    : >"$keep/checks.log"
    local cache
    cache=$(mktemp -d)
    nvidia-smi -L >&2 || true
    # The rows as data, under the machine they ran on: keep $keep/rows.tsv as a round in
    # benches/results/gpu/ (see docs/gpus.md).
    echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(date -u '+%F %H:%M') UTC" \
        >"$keep/rows.tsv"
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
    row "collectives W=1,2,4" "$status" "$(grep -c 'device collectives ok' "$last_out") rank runs ok of 20; ipc, staged (1, 2, 4 ranks), hierarchical (2 ranks, 2x2) ($last_detail)"
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
            # Four ranks as two hosts of two (the worker sets CHORUS_HOST_ID): the hierarchical
            # path against staging over TCP, as a job across hosts would take them.
            # Each call logs where its time went (stage 2 overlaps stages 1 and 3).
            check "bench hierarchical mps 4" 120 env CHORUS_CUDA_PATH=hierarchical \
                CHORUS_DEBUG=chorus::cuda::tiered=debug "$dir"/chorusrun \
                --standalone --nproc-per-node 4 "$dir"/chorus-cuda-worker bench hierarchical 64
            row "all-reduce hierarchical 2x2 MPS W=4" "$status" "$(grep -o 'device_us.*' "$last_out" | head -1); last call: $(grep 'hierarchical call' "$last_out" | tail -1 | grep -oE '(rounds|stage_[123]_us|waiting_us)=[0-9]+' | tr '\n' ' ')"
            # The same with no path forced: the worker fails unless the pick is hierarchical.
            check "bench auto mps 4" 120 env -u CHORUS_CUDA_PATH "$dir"/chorusrun \
                --standalone --nproc-per-node 4 "$dir"/chorus-cuda-worker bench hierarchical 64
            row "all-reduce auto pick 2x2 MPS W=4" "$status" "$(grep -o 'device_us.*' "$last_out" | head -1)"
            check "bench staged tcp mps 4" 120 env CHORUS_CUDA_PATH=staged CHORUS_TRANSPORT=tcp "$dir"/chorusrun \
                --standalone --nproc-per-node 4 "$dir"/chorus-cuda-worker bench staged 64
            row "all-reduce staged TCP MPS W=4" "$status" "$(grep -o 'device_us.*' "$last_out" | head -1)"
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

    nccl_rows

    echo
    printf '%-24s %-6s %s\n' check status result
    awk -F'\t' '!/^#/ { printf "%-24s %-6s %s\n", $1, $2, $3 }' "$keep/rows.tsv"
}

case $mode in
build) build ;;
run) run ;;
*)
    echo "usage: $0 build|run [DIR]" >&2
    exit 2
    ;;
esac
