#!/bin/bash
# Chorus under mpirun without a scheduler: 4 ranks over two hosts (2 each).
# MPI names each rank; where rank 0's store listens:
#   Open MPI: MASTER_ADDR/MASTER_PORT, exported to every rank with -x;
#   MPICH (hydra's mpiexec): nothing to export, rank 0 publishes its address through hydra's PMI.
# Debian installs the two side by side as mpirun.openmpi and mpiexec.hydra (plain mpirun and
# mpiexec are whichever update-alternatives picked); set MPIRUN to choose another.
#
# Usage: examples/mpirun.sh host0 host1 [openmpi|mpich]
set -euo pipefail
HOST0=${1:?usage: $0 host0 host1 [openmpi|mpich]}
HOST1=${2:?usage: $0 host0 host1 [openmpi|mpich]}
PERF=(./target/release/allreduce_perf -b 8 -e 128M -f 2)

case "${3:-openmpi}" in
openmpi)
    # As root, also --allow-run-as-root.
    "${MPIRUN:-mpirun.openmpi}" -np 4 -H "$HOST0:2,$HOST1:2" \
        -x MASTER_ADDR="$HOST0" -x MASTER_PORT=29500 "${PERF[@]}"
    ;;
mpich)
    # Rank 0 publishes its host name, which every host must resolve (else give MASTER_ADDR
    # and MASTER_PORT with -genv NAME value).
    "${MPIRUN:-mpiexec.hydra}" -n 4 -ppn 2 -hosts "$HOST0,$HOST1" "${PERF[@]}"
    ;;
*)
    echo "usage: $0 host0 host1 [openmpi|mpich]" >&2
    exit 2
    ;;
esac
