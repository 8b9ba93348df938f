//! `sendrecv_perf`: send to rank+1 while receiving from rank-1, nccl-tests style.
//!
//! `sendrecv_perf -b 8 -e 256M -f 2 -np 4` starts four local ranks;
//! under torchrun, chorusrun, SLURM or mpirun it runs as one rank.

fn main() -> std::process::ExitCode {
    chorus_tools::perf::main(&chorus_tools::perf::SEND_RECV)
}
