//! `all_reduce_perf`: nccl-tests' name for `allreduce_perf`, so that its recipes run as written.

fn main() -> std::process::ExitCode {
    chorus_tools::perf::main(&chorus_tools::perf::ALL_REDUCE)
}
