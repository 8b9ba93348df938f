//! `all_gather_perf`: all-gather, nccl-tests style.
//!
//! `all_gather_perf -b 8 -e 256M -f 2 -np 4` starts four local ranks;
//! under torchrun, chorusrun, SLURM or mpirun it runs as one rank.

fn main() -> std::process::ExitCode {
    chorus_tools::perf::main(&chorus_tools::perf::ALL_GATHER)
}
