//! `barrier_perf`: barrier latency (one row of size 0), nccl-tests style.
//!
//! `barrier_perf -n 1000 -np 4` starts four local ranks;
//! under torchrun, chorusrun, SLURM or mpirun it runs as one rank.

fn main() -> std::process::ExitCode {
    chorus_tools::perf::main(&chorus_tools::perf::BARRIER)
}
