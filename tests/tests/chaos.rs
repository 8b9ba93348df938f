//! Breaking jobs on purpose: a rank killed or stopped mid-job, mismatched
//! calls, aborts and drops. Every survivor must fail promptly with an error
//! naming the culprit; nothing may hang, and no process may be left behind.

use std::io::Write;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use chorus::Auth;
use chorus_launch::{launch, Exit, LaunchReport, LaunchSpec, Output, PortReservation};
use chorus_tests::dump;
use chorus_transport::store::{Store, StoreError, TcpStore};

const WORKER: &str = env!("CARGO_BIN_EXE_chorus-chaos-worker");

/// One job at a time: the reports these tests read (who answered within the grace period)
/// should not depend on how many other jobs share the two cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `world` chaos workers to the end, letting survivors run on after a rank fails.
fn chaos(world: usize, args: &[&str], timeout_s: &str) -> LaunchReport {
    let _one = serial();
    let spec = LaunchSpec::new(WORKER, world)
        .args(args.iter().copied())
        .timeout(Duration::from_secs(120))
        .output(Output::Capture)
        .wait_all(true)
        .env("CHORUS_TIMEOUT", timeout_s)
        // Warnings too: the watchdog's stall reports.
        .env("CHORUS_DEBUG", "warn");
    let report = launch(&spec).expect("launch");
    assert!(!report.timed_out, "the job hung:\n{}", dump(&report));
    report
}

/// The survivor's error line, with its own "rank N:" prefix removed.
fn error_of(report: &LaunchReport, rank: usize) -> String {
    let r = &report.ranks[rank];
    assert_eq!(
        r.status,
        Exit::Code(1),
        "rank {rank} should fail with an error:\n{}",
        dump(report)
    );
    let line = r
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("failed: "))
        .unwrap_or_else(|| panic!("rank {rank} printed no error:\n{}", dump(report)));
    line.strip_prefix(&format!("rank {rank}: "))
        .unwrap_or(line)
        .to_string()
}

/// The fault rank `rank` failed with, as the chaos worker prints it: its cause, its culprit
/// (`None` where it names none) and the rank that found it.
fn fault_of(report: &LaunchReport, rank: usize) -> (String, Option<usize>, usize) {
    let line = report.ranks[rank]
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("fault: "))
        .unwrap_or_else(|| panic!("rank {rank} printed no fault:\n{}", dump(report)));
    let fields: Vec<&str> = line.split(' ').collect();
    let [cause, culprit, found_by] = fields[..] else {
        panic!("rank {rank}: malformed fault line {line:?}");
    };
    (
        cause.to_string(),
        culprit.parse().ok(),
        found_by.parse().expect("the finder's rank"),
    )
}

/// A rank killed with SIGKILL at a random moment during 200 all-reduces: every
/// survivor fails at once (not by timing out) with an error naming it.
#[test]
fn a_killed_rank_is_named_by_every_survivor() {
    for seed in [1u64, 2, 3, 4, 5] {
        let victim = (seed % 4) as usize;
        let report = chaos(4, &["kill", &victim.to_string(), &seed.to_string()], "60");
        let ctx = || format!("seed {seed}, victim {victim}:\n{}", dump(&report));
        assert_eq!(report.ranks[victim].status, Exit::Signal(9), "{}", ctx());
        for rank in (0..4).filter(|&r| r != victim) {
            let error = error_of(&report, rank);
            assert!(
                error.contains(&format!("rank {victim} ")),
                "rank {rank}: {error}\n{}",
                ctx()
            );
            // Rank 0 takes the rendezvous store it hosts with it.
            let expected = if victim == 0 {
                "StoreHostGone"
            } else {
                "PeerClosed"
            };
            let (cause, culprit, _) = fault_of(&report, rank);
            assert_eq!(
                (cause.as_str(), culprit),
                (expected, Some(victim)),
                "rank {rank}: {error}\n{}",
                ctx()
            );
            assert!(
                !error.contains("timed out"),
                "rank {rank} waited for the timeout: {error}"
            );
        }
        // Rank 0, the store's host, waits at its end for every rank's goodbye (the grace
        // period: 5 s here), but not for a rank whose process is gone.
        if victim != 0 {
            let after = report.ranks[0]
                .elapsed
                .saturating_sub(report.ranks[victim].elapsed);
            assert!(
                after < Duration::from_secs(4),
                "rank 0 ended {after:?} after rank {victim} was killed\n{}",
                ctx()
            );
        }
    }
}

/// Rank 0, which hosts the rendezvous store, killed mid-job: every survivor fails naming
/// rank 0 first, without waiting on the store that went with it (a reconnection the store
/// refuses is final: its server has gone), so within seconds rather than at the timeout.
#[test]
fn rank_0_killed_is_named_first_by_every_survivor() {
    for seed in [6u64, 7] {
        let report = chaos(4, &["kill", "0", &seed.to_string()], "60");
        assert_eq!(report.ranks[0].status, Exit::Signal(9), "{}", dump(&report));
        let killed = report.ranks[0].elapsed;
        for rank in 1..4 {
            let after = report.ranks[rank].elapsed.saturating_sub(killed);
            assert!(
                after < Duration::from_secs(5),
                "rank {rank} ended {after:?} after rank 0 was killed (the timeout is 60 s)\n{}",
                dump(&report)
            );
            let error = error_of(&report, rank);
            assert!(
                error.starts_with("aborted: rank 0 is gone"),
                "rank {rank}: {error}\n{}",
                dump(&report)
            );
            let (cause, culprit, _) = fault_of(&report, rank);
            assert_eq!((cause.as_str(), culprit), ("StoreHostGone", Some(0)));
        }
    }
}

/// A rank stopped with SIGSTOP: the others warn of the stall, then time out naming it; once
/// continued it fails too instead of computing with what is left.
#[test]
fn a_stopped_rank_is_named_and_fails_when_continued() {
    let dir = std::env::temp_dir().join(format!("chorus-stop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let victim = 2;
    let report = chaos(4, &["stop", "2", dir.to_str().unwrap()], "4");
    for rank in [0, 1, 3] {
        let error = error_of(&report, rank);
        assert!(
            error.contains("rank 2 did not answer"),
            "rank {rank}: {error}\n{}",
            dump(&report)
        );
        let (cause, culprit, _) = fault_of(&report, rank);
        assert_eq!((cause.as_str(), culprit), ("Timeout", Some(victim)));
        // The watchdog warned before the timeout (half of it, by default).
        assert!(
            report.ranks[rank].stderr.contains("has waited"),
            "rank {rank} gave no stall warning:\n{}",
            dump(&report)
        );
    }
    // Continued, the victim fails with an error rather than a wrong result, saying that it
    // is the rank the others gave up on.
    let error = error_of(&report, victim);
    assert!(
        error.contains("rank 2 stopped answering while the other ranks waited for it"),
        "the victim: {error}\n{}",
        dump(&report)
    );
    let (cause, culprit, found_by) = fault_of(&report, victim);
    assert_eq!((cause.as_str(), culprit), ("Unresponsive", Some(victim)));
    assert_ne!(found_by, victim, "the victim found its own stall");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One rank calls broadcast where the others call all_reduce: every rank fails saying both.
#[test]
fn mismatched_calls_fail_everywhere_saying_what_each_called() {
    for world in [2, 4] {
        let report = chaos(world, &["mismatch", "kind"], "30");
        for rank in 0..world {
            let error = error_of(&report, rank);
            for needle in [
                "broadcast(float, 64 elements, root 0)",
                "all_reduce(float sum, 64 elements)",
            ] {
                assert!(error.contains(needle), "W={world} rank {rank}: {error}");
            }
            let (cause, culprit, _) = fault_of(&report, rank);
            assert_eq!(cause, "Mismatch", "W={world} rank {rank}: {error}");
            assert!(culprit.is_some(), "W={world} rank {rank} names no culprit");
        }
    }
    let report = chaos(2, &["mismatch", "count"], "30");
    for rank in 0..2 {
        let error = error_of(&report, rank);
        for needle in [
            "all_reduce(float sum, 64 elements)",
            "all_reduce(float sum, 65 elements)",
        ] {
            assert!(error.contains(needle), "rank {rank}: {error}");
        }
    }
}

/// `abort()` from another thread fails the call in flight and later calls with `Aborted`;
/// the peer that arrives later fails naming the aborted rank.
#[test]
fn abort_fails_in_flight_and_later_calls() {
    let report = chaos(2, &["abort"], "30");
    assert_rank_0_left_and_was_named(&report, "Abort");
}

/// Rank 0 (which gave up on the job) exited cleanly, and rank 1 failed naming it, with a
/// fault of `cause`.
fn assert_rank_0_left_and_was_named(report: &LaunchReport, cause: &str) {
    assert_eq!(report.ranks[0].status, Exit::Code(0), "{}", dump(report));
    assert!(error_of(report, 1).contains("rank 0 "), "{}", dump(report));
    let (found, culprit, _) = fault_of(report, 1);
    assert_eq!(
        (found.as_str(), culprit),
        (cause, Some(0)),
        "{}",
        dump(report)
    );
}

/// Dropping a communicator with queued work it cannot finish returns after a short grace.
#[test]
fn drop_with_queued_work_returns_promptly() {
    let report = chaos(2, &["drop"], "60");
    assert_rank_0_left_and_was_named(&report, "Dropped");
    let dropped = report.ranks[0]
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("dropped in "))
        .and_then(|l| l.trim_end_matches(" s").parse::<f64>().ok())
        .expect("rank 0 timed its drop");
    // The grace period is 2 s; the timeout (60 s) is what a hang would take.
    assert!(dropped < 30.0, "drop blocked for {dropped} s");
}

/// Strangers knock on the store and transport ports while a job runs: garbage, a forged
/// hello, a client with the wrong secret. They are refused; the job completes correctly.
#[test]
fn strangers_do_not_disturb_a_running_job() {
    // Held until the job is over: the port stays rank 0's.
    let reserved = PortReservation::new("127.0.0.1").unwrap();
    let port = reserved.port();
    let token = "chaos-secret";
    let spec = LaunchSpec::new(WORKER, 2)
        .args(["rounds", "1500"])
        .timeout(Duration::from_secs(120))
        .output(Output::Capture)
        .master_port(port)
        .env("CHORUS_TIMEOUT", "30")
        .env("CHORUS_TRANSPORT", "tcp")
        .env("CHORUS_AUTH_TOKEN", token);
    let _one = serial();
    let job = std::thread::spawn(move || launch(&spec).expect("launch"));
    // The launcher gives TORCHELASTIC_RUN_ID=none, which is the job id.
    let insider = Auth::new("none", token).unwrap();
    let store = TcpStore::connect_with_auth("127.0.0.1", port, Duration::from_secs(30), insider)
        .expect("the job's store");
    // Rank 1 joins late, so rank 0 is still accepting on its transport port.
    let addr = String::from_utf8(store.get("chorus/0/tcp/addr/0").unwrap()).unwrap();
    let knocks: [(&str, Vec<u8>); 3] = [
        ("transport", b"GET / HTTP/1.1\r\n\r\n".to_vec()),
        ("transport", [b"CHRH".as_slice(), &[0u8; 56]].concat()),
        ("store", (0..=255u8).cycle().take(4096).collect()),
    ];
    for (target, bytes) in knocks {
        let to = if target == "store" {
            format!("127.0.0.1:{port}")
        } else {
            addr.clone()
        };
        if let Ok(mut stranger) = std::net::TcpStream::connect(&to) {
            let _ = stranger.write_all(&bytes);
        }
    }
    let wrong = Auth::new("none", "guess").unwrap();
    match TcpStore::connect_with_auth("127.0.0.1", port, Duration::from_secs(30), wrong) {
        Err(StoreError::Refused(why)) => assert!(why.contains("CHORUS_AUTH_TOKEN"), "{why}"),
        other => panic!("a client with the wrong secret got {other:?}"),
    }
    let report = job.join().unwrap();
    drop(reserved);
    assert!(report.success(), "{}", dump(&report));
}

/// 20,000 small and 200 large all-reduces in one communicator: no growth in open files,
/// threads or resident memory beyond small bounds.
#[test]
fn a_long_run_does_not_leak() {
    let report = chaos(2, &["soak"], "60");
    assert!(report.success(), "{}", dump(&report));
}

/// 100 communicators created and dropped in a loop leak nothing.
#[test]
fn communicators_created_and_dropped_do_not_leak() {
    let report = chaos(2, &["churn"], "60");
    assert!(report.success(), "{}", dump(&report));
}
