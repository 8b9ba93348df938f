//! The Chorus command-line tools; [`perf`] is the measuring harness shared
//! by `allreduce_perf` and its siblings (`broadcast_perf`, `reduce_perf`,
//! `all_gather_perf`, `reduce_scatter_perf`, `alltoall_perf`,
//! `sendrecv_perf`, `barrier_perf`; `all_reduce_perf` is nccl-tests' name for
//! `allreduce_perf`).

pub mod perf;
pub mod train;

/// CPU seconds used so far, as `clock` counts them (`libc::CLOCK_PROCESS_CPUTIME_ID`: the
/// whole process; `libc::CLOCK_THREAD_CPUTIME_ID`: the calling thread).
pub fn cpu_seconds(clock: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec into a live local; both clocks exist on every Linux.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// GB/s of incoming bytes one core sums into a 64 MiB float buffer with Chorus's kernel,
/// 512 KiB at a time (the default pipeline chunk), median of `reps` passes after one that
/// warms the buffers up (the ceiling probes' reduction rate): in place (`out += incoming`),
/// or `out_of_place`, into an output apart from a 64 MiB input (`out = input + incoming`)
/// with streaming stores, as Chorus writes an output that large.
pub fn reduce_rate(reps: usize, out_of_place: bool) -> f64 {
    use chorus_kernels::{reduce, reduce_into_streaming, DType, ReduceOp};
    const PIECE: usize = 512 << 10;
    let input = match out_of_place {
        true => vec![3u8; 64 << 20],
        false => Vec::new(),
    };
    let mut out = vec![1u8; 64 << 20];
    let incoming = vec![2u8; PIECE];
    let (sum, dtype) = (ReduceOp::Sum, DType::F32);
    let mut pass = || {
        let start = std::time::Instant::now();
        for (k, piece) in out.chunks_mut(PIECE).enumerate() {
            match input.get(k * PIECE..(k + 1) * PIECE) {
                Some(with) => reduce_into_streaming(sum, dtype, piece, with, &incoming),
                None => reduce(sum, dtype, piece, &incoming),
            }
            .expect("equal lengths");
        }
        out.len() as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    pass();
    median((0..reps.max(1)).map(|_| pass()).collect())
}

/// The middle value of `values` (the upper one of an even count); NaN if there is none.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

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
