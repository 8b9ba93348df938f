//! The launcher tests' worker: one process of a job started by `chorusrun` (or by hand with
//! SLURM / MPI variables). Each scenario reports what the launcher gave it, or fails, or waits
//! for a signal, in a way the tests in `tests/launcher.rs` and `tests/multinode.rs` check.
//!
//! Scenarios (first argument):
//! - `env`: prints `probe VAR=value ...` (every launcher variable, `-` when unset) on stdout
//!   and `probe stderr RANK` on stderr.
//! - `fail RANK CODE DIR`: every rank writes `DIR/pid<RANK>`; rank RANK waits until this
//!   node's ranks have all written theirs, then exits with CODE; the others wait to be stopped.
//! - `fail-once RANK`: while `TORCHELASTIC_RESTART_COUNT` is 0, rank RANK exits with 7 and the
//!   others wait to be stopped; on a restart every rank prints `attempt N ok`.
//! - `signal DIR`: writes `DIR/ready<RANK>`, waits for SIGTERM or SIGINT, writes the signal's
//!   name to `DIR/got<RANK>` and exits with 42.
//! - `allreduce COUNT`: joins the job with `Communicator::from_env()`, all-reduces COUNT i64s
//!   and checks the exact sums; prints `allreduce ok rank=R world=W`.
//! - `elastic RANK`: joins the job, all-reduces, prints `attempt N joined rank=R` and meets the
//!   others in a barrier. While `TORCHELASTIC_RESTART_COUNT` is 0, rank RANK then fails with 7,
//!   recording `env_probe: rank RANK fails on purpose in attempt 0` in torchrun's error file,
//!   and the others wait to be stopped; on a restart every rank all-reduces again and prints
//!   `attempt N ok rank=R`.
//!
//! Every wait is bounded ([`WAIT_LIMIT`]): a worker that is never stopped ends by itself (with
//! a status the tests treat as wrong) instead of hanging.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::{env, Communicator, ReduceOp};

/// The longest any scenario waits for something.
const WAIT_LIMIT: Duration = Duration::from_secs(60);
/// Exit status of a worker that saw the signal it waited for.
const GOT_SIGNAL: u8 = 42;
/// Exit status of a worker that waited [`WAIT_LIMIT`] without being stopped.
const NEVER_STOPPED: u8 = 99;

/// The variables `env` prints, in order.
const VARS: [&str; 16] = [
    env::RANK,
    env::LOCAL_RANK,
    env::GROUP_RANK,
    env::WORLD_SIZE,
    env::LOCAL_WORLD_SIZE,
    env::GROUP_WORLD_SIZE,
    env::MASTER_ADDR,
    env::MASTER_PORT,
    env::TORCHELASTIC_RESTART_COUNT,
    env::TORCHELASTIC_MAX_RESTARTS,
    env::TORCHELASTIC_RUN_ID,
    env::OMP_NUM_THREADS,
    env::CUDA_VISIBLE_DEVICES,
    env::CHORUS_DEVICE_IDS,
    env::CHORUS_TIMEOUT,
    env::CHORUS_INIT_METHOD,
];

fn main() -> ExitCode {
    chorus_tests::init_logging();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("env_probe error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<u8, String> {
    let arg = |i: usize| -> Result<&str, String> {
        args.get(i)
            .map(String::as_str)
            .ok_or_else(|| format!("missing argument {i}"))
    };
    let number = |i: usize| -> Result<usize, String> {
        arg(i)?.parse().map_err(|e| format!("argument {i}: {e}"))
    };
    match arg(0)? {
        "env" => {
            let line: Vec<String> = VARS
                .iter()
                .map(|var| format!("{var}={}", var_or_dash(var)))
                .collect();
            println!("probe {}", line.join(" "));
            eprintln!("probe stderr {}", var_or_dash(env::RANK));
            Ok(0)
        }
        "fail" => fail(number(1)?, number(2)?, Path::new(arg(3)?)),
        "fail-once" => fail_once(number(1)?),
        "signal" => wait_for_signal(Path::new(arg(1)?)),
        "allreduce" => all_reduce(number(1)?),
        "elastic" => elastic(number(1)?),
        other => Err(format!("unknown scenario {other:?}")),
    }
}

fn var_or_dash(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| "-".to_string())
}

fn env_number(var: &str) -> Result<usize, String> {
    std::env::var(var)
        .map_err(|_| format!("{var} is not set"))?
        .parse()
        .map_err(|e| format!("{var}: {e}"))
}

/// Writes `dir/name` atomically (a temporary file, then a rename).
fn write_atomic(dir: &Path, name: &str, text: &str) -> Result<(), String> {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(name)).map_err(|e| format!("rename to {name}: {e}"))
}

/// Sleeps until `done()` or [`WAIT_LIMIT`]; returns whether `done()` came true.
fn wait_until(mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + WAIT_LIMIT;
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    done()
}

fn fail(failing: usize, code: usize, dir: &Path) -> Result<u8, String> {
    let rank = env_number(env::RANK)?;
    let local_world = env_number(env::LOCAL_WORLD_SIZE)?;
    let first = rank - env_number(env::LOCAL_RANK)?;
    write_atomic(dir, &format!("pid{rank}"), &std::process::id().to_string())?;
    if rank != failing {
        wait_until(|| false);
        return Ok(NEVER_STOPPED);
    }
    let pids: Vec<PathBuf> = (first..first + local_world)
        .map(|r| dir.join(format!("pid{r}")))
        .collect();
    if !wait_until(|| pids.iter().all(|p| p.exists())) {
        return Err("the other ranks never started".into());
    }
    eprintln!("env_probe: rank {rank} fails on purpose with code {code}");
    u8::try_from(code).map_err(|e| format!("exit code {code}: {e}"))
}

fn fail_once(failing: usize) -> Result<u8, String> {
    let rank = env_number(env::RANK)?;
    let restart = env_number(env::TORCHELASTIC_RESTART_COUNT)?;
    if restart > 0 {
        println!("attempt {restart} ok");
        return Ok(0);
    }
    if rank == failing {
        eprintln!("env_probe: rank {rank} fails on the first attempt");
        return Ok(7);
    }
    wait_until(|| false);
    Ok(NEVER_STOPPED)
}

fn wait_for_signal(dir: &Path) -> Result<u8, String> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let rank = env_number(env::RANK)?;
    let term = Arc::new(AtomicBool::new(false));
    let int = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(SIGTERM, Arc::clone(&term)).map_err(|e| e.to_string())?;
    signal_hook::flag::register(SIGINT, Arc::clone(&int)).map_err(|e| e.to_string())?;
    write_atomic(dir, &format!("ready{rank}"), "")?;
    if !wait_until(|| term.load(Ordering::SeqCst) || int.load(Ordering::SeqCst)) {
        return Ok(NEVER_STOPPED);
    }
    let name = if term.load(Ordering::SeqCst) {
        "SIGTERM"
    } else {
        "SIGINT"
    };
    write_atomic(dir, &format!("got{rank}"), name)?;
    println!("rank {rank} got {name}");
    Ok(GOT_SIGNAL)
}

fn all_reduce(count: usize) -> Result<u8, String> {
    let comm = Communicator::from_env().map_err(|e| e.to_string())?;
    check_all_reduce(&comm, count)?;
    println!(
        "allreduce ok rank={} world={} local_rank={} local_world={}",
        comm.rank(),
        comm.world_size(),
        comm.local_rank(),
        comm.local_world_size()
    );
    Ok(0)
}

/// All-reduces `count` i64s and checks the exact sums.
fn check_all_reduce(comm: &Communicator, count: usize) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut data: Vec<i64> = (0..count)
        .map(|i| (rank as i64 + 1) * (i as i64 + 1))
        .collect();
    comm.all_reduce(&mut data, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    let ranks_sum = (world * (world + 1) / 2) as i64;
    match (0..count).find(|&i| data[i] != ranks_sum * (i as i64 + 1)) {
        Some(i) => Err(format!(
            "element {i} is {}, expected {}",
            data[i],
            ranks_sum * (i as i64 + 1)
        )),
        None => Ok(()),
    }
}

fn elastic(failing: usize) -> Result<u8, String> {
    let restart = env_number(env::TORCHELASTIC_RESTART_COUNT)?;
    let comm = Communicator::from_env().map_err(|e| e.to_string())?;
    let rank = comm.rank();
    check_all_reduce(&comm, 1000)?;
    println!("attempt {restart} joined rank={rank}");
    comm.barrier().map_err(|e| e.to_string())?;
    if restart == 0 {
        if rank != failing {
            wait_until(|| false);
            return Ok(NEVER_STOPPED);
        }
        let message = format!("env_probe: rank {rank} fails on purpose in attempt 0");
        eprintln!("{message}");
        chorus::torchrun::write_error_file(&message).map_err(|e| e.to_string())?;
        return Ok(7);
    }
    check_all_reduce(&comm, 1000)?;
    println!("attempt {restart} ok rank={rank}");
    Ok(0)
}
