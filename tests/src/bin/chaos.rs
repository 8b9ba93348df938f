//! The chaos worker: one rank of a job that is broken on purpose.
//!
//! Scenarios (first argument):
//! - `kill VICTIM SEED`: 200 all-reduces of mixed sizes; rank VICTIM sends
//!   itself SIGKILL at a moment drawn from SEED.
//! - `stop VICTIM DIR`: all-reduces until rank VICTIM sends itself SIGSTOP
//!   (after writing its pid to DIR/pid); the lowest surviving rank sends it
//!   SIGCONT once it has failed.
//! - `mismatch kind|count`: rank 1 calls broadcast (or all_reduce with one more
//!   element) where the others call all_reduce.
//! - `abort`: rank 0 aborts from a second thread while waiting for rank 1,
//!   which joins late.
//! - `drop`: rank 0 drops its communicator with work queued that cannot finish;
//!   rank 1 joins late.
//!
//! - `rounds DELAY_MS`: rank 1 joins DELAY_MS late, then the 200 all-reduces
//!   run to the end (strangers knock meanwhile; see the test).
//! - `soak`: 20,000 small and 200 large all-reduces; open files and resident
//!   memory must stay within small bounds (read from /proc).
//! - `churn`: 100 communicators duplicated from one and dropped; no files or threads leak.
//! - `vanish DIR`: small all-reduces until one fails; after the first, each rank writes
//!   DIR/ready-RANK, so that the test can cut a node off while every rank is in the loop.
//!
//! Survivors print `failed: ERROR` on stderr and exit with status 1; a
//! result that is wrong is reported as `WRONG` and exits with status 2.

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::{env, Cause, Communicator, Error, ReduceOp};
use chorus_tests::draw;
use nix::sys::signal::{kill, raise, Signal};
use nix::unistd::Pid;

/// All-reduces each job runs unless something breaks.
const ROUNDS: usize = 200;
/// Element counts the rounds draw from.
const COUNTS: [usize; 5] = [2, 100, 4096, 65_536, 262_144];

fn main() -> ExitCode {
    chorus_tests::init_logging();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).map(String::as_str).unwrap_or("");
    if arg(0) == "rounds" && std::env::var(env::RANK).as_deref() == Ok("1") {
        std::thread::sleep(Duration::from_millis(parse(arg(1)) as u64));
    }
    let comm = match Communicator::from_env() {
        Ok(comm) => comm,
        Err(e) => return failed(&e),
    };
    let outcome = match arg(0) {
        "kill" => killed(&comm, parse(arg(1)), parse(arg(2)) as u64),
        "stop" => stopped(&comm, parse(arg(1)), arg(2)),
        "mismatch" => mismatched(&comm, arg(1)),
        "abort" => aborted(comm),
        "drop" => dropped(comm),
        "rounds" => rounds(&comm, 7, &AtomicUsize::new(0)),
        "soak" => soak(&comm),
        "churn" => churn(&comm),
        "vanish" => until_it_fails(&comm, arg(1)),
        other => Outcome::Wrong(format!("unknown scenario {other:?}")),
    };
    report(outcome)
}

fn report(outcome: Outcome) -> ExitCode {
    match outcome {
        Outcome::Done => ExitCode::SUCCESS,
        Outcome::Failed(e) => failed(&e),
        Outcome::Wrong(what) => {
            eprintln!("WRONG: {what}");
            ExitCode::from(2)
        }
    }
}

/// What this process holds: open files, threads, resident KiB.
fn holdings() -> (usize, usize, u64) {
    let count = |dir: &str| std::fs::read_dir(dir).map_or(0, |d| d.count());
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    (count("/proc/self/fd"), count("/proc/self/task"), rss)
}

/// Checks that files and threads grew by at most `slack` and memory by at most `rss_kib`.
fn bounded(what: &str, before: (usize, usize, u64), slack: usize, rss_kib: u64) -> Outcome {
    let after = holdings();
    eprintln!(
        "{what}: files {} -> {}, threads {} -> {}, resident {} -> {} KiB",
        before.0, after.0, before.1, after.1, before.2, after.2
    );
    if after.0 > before.0 + slack || after.1 > before.1 + slack || after.2 > before.2 + rss_kib {
        return Outcome::Wrong(format!("{what} leaked: {before:?} -> {after:?}"));
    }
    Outcome::Done
}

fn soak(comm: &Communicator) -> Outcome {
    // Every 101st call is large (1 MiB), the others small.
    let run = |calls: usize| -> Outcome {
        for i in 0..calls {
            let count = if i % 101 == 0 { 262_144 } else { 4 };
            match round(comm, count) {
                Outcome::Done => {}
                other => return other,
            }
        }
        Outcome::Done
    };
    // Warm up: buffers, staging slots and the tuner's choices reach their steady state.
    if let other @ (Outcome::Failed(_) | Outcome::Wrong(_)) = run(1010) {
        return other;
    }
    let before = holdings();
    // 20,000 small and 200 large.
    match run(20_200) {
        Outcome::Done => bounded("soak", before, 4, 16 << 10),
        other => other,
    }
}

fn churn(parent: &Communicator) -> Outcome {
    let mut before = None;
    for i in 0..101 {
        let comm = match parent.dup() {
            Ok(comm) => comm,
            Err(e) => return Outcome::Failed(e),
        };
        if let other @ (Outcome::Failed(_) | Outcome::Wrong(_)) = round(&comm, 100) {
            return other;
        }
        drop(comm);
        if i == 0 {
            before = Some(holdings());
        }
    }
    // Monitor threads of the last communicators may still be closing: allow a few.
    bounded("churn", before.expect("measured"), 12, 16 << 10)
}

enum Outcome {
    Done,
    Failed(Error),
    Wrong(String),
}

/// Prints the error and, where a fault caused it, the fault's fields for the tests to read.
fn failed(e: &Error) -> ExitCode {
    eprintln!("failed: {e}");
    if let Some(fault) = e.fault() {
        let culprit = fault.culprit.map_or("none".to_string(), |r| r.to_string());
        eprintln!("fault: {:?} {culprit} {}", fault.cause, fault.found_by);
    }
    ExitCode::FAILURE
}

fn parse(s: &str) -> usize {
    s.parse()
        .unwrap_or_else(|_| panic!("expected a number, got {s:?}"))
}

/// The element count of round `i` under `seed`, the same on every rank.
fn drawn_count(seed: u64, i: usize) -> usize {
    COUNTS[(draw(seed, i as u64) % COUNTS.len() as u64) as usize]
}

/// Runs round `i`: an all-reduce whose every element has an exactly known sum.
fn round(comm: &Communicator, count: usize) -> Outcome {
    let (rank, world) = (comm.rank() as f32, comm.world_size() as f32);
    let mut buf: Vec<f32> = (0..count)
        .map(|j| (rank + 1.0) * (j % 7 + 1) as f32)
        .collect();
    if let Err(e) = comm.all_reduce(&mut buf, ReduceOp::Sum) {
        return Outcome::Failed(e);
    }
    let ranks = world * (world + 1.0) / 2.0;
    match buf
        .iter()
        .enumerate()
        .find(|(j, &v)| v != ranks * (j % 7 + 1) as f32)
    {
        Some((j, v)) => Outcome::Wrong(format!("element {j} of {count} is {v}")),
        None => Outcome::Done,
    }
}

fn rounds(comm: &Communicator, seed: u64, progress: &AtomicUsize) -> Outcome {
    for i in 0..ROUNDS {
        progress.store(i, Ordering::Release);
        let count = drawn_count(seed, i);
        match round(comm, count) {
            Outcome::Done => {}
            other => return other,
        }
    }
    Outcome::Done
}

fn killed(comm: &Communicator, victim: usize, seed: u64) -> Outcome {
    let progress = Arc::new(AtomicUsize::new(0));
    if comm.rank() == victim {
        let at = (draw(seed, 1000) % 150) as usize;
        let delay = Duration::from_micros(draw(seed, 1001) % 2000);
        let seen = progress.clone();
        std::thread::spawn(move || {
            while seen.load(Ordering::Acquire) < at {
                std::thread::sleep(Duration::from_micros(100));
            }
            std::thread::sleep(delay);
            raise(Signal::SIGKILL).expect("SIGKILL");
        });
        // Never get far past the drawn round: the others must not finish.
        for i in 0..at + 3 {
            progress.store(i, Ordering::Release);
            let count = drawn_count(seed, i);
            if let other @ (Outcome::Failed(_) | Outcome::Wrong(_)) = round(comm, count) {
                return other;
            }
        }
        std::thread::sleep(Duration::from_secs(600));
        return Outcome::Wrong("the victim outlived its kill".into());
    }
    rounds(comm, seed, &progress)
}

fn stopped(comm: &Communicator, victim: usize, dir: &str) -> Outcome {
    let stop_at = 5;
    for i in 0..ROUNDS {
        if comm.rank() == victim && i == stop_at {
            std::fs::write(format!("{dir}/pid"), std::process::id().to_string()).expect("pid file");
            raise(Signal::SIGSTOP).expect("SIGSTOP");
        }
        match round(comm, COUNTS[i % COUNTS.len()]) {
            Outcome::Done => {}
            Outcome::Failed(e) => {
                let first_survivor = if victim == 0 { 1 } else { 0 };
                if comm.rank() == first_survivor {
                    let pid: i32 = std::fs::read_to_string(format!("{dir}/pid"))
                        .expect("the victim wrote its pid")
                        .trim()
                        .parse()
                        .expect("a pid");
                    kill(Pid::from_raw(pid), Signal::SIGCONT).expect("SIGCONT");
                }
                return Outcome::Failed(e);
            }
            wrong => return wrong,
        }
    }
    Outcome::Done
}

fn until_it_fails(comm: &Communicator, dir: &str) -> Outcome {
    for i in 0.. {
        match round(comm, 100) {
            Outcome::Done if i == 0 => {
                let ready = format!("{dir}/ready-{}", comm.rank());
                std::fs::write(ready, b"").expect("ready file");
            }
            Outcome::Done => {}
            other => return other,
        }
    }
    Outcome::Done
}

fn mismatched(comm: &Communicator, how: &str) -> Outcome {
    let mut buf = vec![1.0f32; 64];
    let result = match (comm.rank(), how) {
        (1, "kind") => comm.broadcast(&mut buf, 0),
        (1, _) => comm.all_reduce(&mut vec![1.0f32; 65], ReduceOp::Sum),
        _ => comm.all_reduce(&mut buf, ReduceOp::Sum),
    };
    match result {
        Ok(()) => Outcome::Wrong("a mismatched call succeeded".into()),
        Err(e) => Outcome::Failed(e),
    }
}

/// Rank 1 joins late, after rank 0 has given up on the call (the drop grace is 2 s): it
/// must fail naming rank 0.
fn late(comm: &Communicator) -> Outcome {
    std::thread::sleep(Duration::from_secs(4));
    match comm.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum) {
        Ok(()) => Outcome::Wrong("all_reduce with a departed rank succeeded".into()),
        Err(e) => Outcome::Failed(e),
    }
}

fn aborted(comm: Communicator) -> Outcome {
    if comm.rank() != 0 {
        return late(&comm);
    }
    let comm = Arc::new(comm);
    let aborter = comm.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        aborter.abort();
    });
    let in_flight = comm.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum);
    let later = comm.barrier();
    for (what, result) in [("in flight", in_flight), ("later", later)] {
        match result {
            Err(Error::Aborted(fault))
                if (fault.cause, fault.culprit) == (Cause::Abort, Some(0)) =>
            {
                eprintln!("{what}: aborted: {fault}")
            }
            other => return Outcome::Wrong(format!("{what}: {other:?} instead of Aborted")),
        }
    }
    Outcome::Done
}

/// Rank 0 drops its communicator with work queued that cannot finish.
fn dropped(comm: Communicator) -> Outcome {
    if comm.rank() != 0 {
        return late(&comm);
    }
    let work = comm.all_reduce_async(vec![1.0f32; 4], ReduceOp::Sum);
    let start = Instant::now();
    drop(comm);
    eprintln!("dropped in {:.1} s", start.elapsed().as_secs_f64());
    match work.wait() {
        Err(Error::Aborted(fault)) if (fault.cause, fault.culprit) == (Cause::Dropped, Some(0)) => {
            eprintln!("queued work: aborted: {fault}");
            Outcome::Done
        }
        other => Outcome::Wrong(format!("queued work after drop: {other:?}")),
    }
}
