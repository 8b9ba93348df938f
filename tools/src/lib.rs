//! The Chorus command-line tools; [`perf`] is the measuring harness shared
//! by `allreduce_perf` and its siblings (`broadcast_perf`, `reduce_perf`,
//! `all_gather_perf`, `reduce_scatter_perf`, `alltoall_perf`,
//! `sendrecv_perf`, `barrier_perf`).

pub mod perf;
pub mod train;

/// How a tool ends on `result`: success, or `program: error` on stderr and exit code 1. Under
/// torchrun the error also goes to torchrun's error file, so its failure summary names it.
pub fn finish(program: &str, result: Result<(), String>) -> std::process::ExitCode {
    let Err(e) = result else {
        return std::process::ExitCode::SUCCESS;
    };
    let message = format!("{program}: {e}");
    eprintln!("{message}");
    if let Err(e) = chorus::torchrun::write_error_file(&message) {
        eprintln!("{program}: cannot write torchrun's error file: {e}");
    }
    std::process::ExitCode::FAILURE
}
