#!/bin/bash
# Chorus under mpirun without a scheduler: 4 ranks over two hosts (2 each).
# MPI names each rank; MASTER_ADDR/MASTER_PORT say where rank 0's store listens.
#
# Usage: examples/mpirun.sh host0 host1
set -euo pipefail
HOST0=${1:?usage: $0 host0 host1}
HOST1=${2:?usage: $0 host0 host1}

# Open MPI
mpirun -np 4 -H "$HOST0:2,$HOST1:2" -x MASTER_ADDR="$HOST0" -x MASTER_PORT=29500 \
    ./target/release/allreduce_perf -b 8 -e 128M -f 2

# MPICH / Intel MPI (Hydra):
#   mpiexec -n 4 -ppn 2 -hosts "$HOST0,$HOST1" -genv MASTER_ADDR "$HOST0" -genv MASTER_PORT 29500 \
#       ./target/release/allreduce_perf -b 8 -e 128M -f 2
