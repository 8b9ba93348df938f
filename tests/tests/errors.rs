//! Bad input gives a clear error naming what was wrong, within the timeout:
//! never a hang or a panic.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread;
use std::time::Duration;

use chorus_launch::PortReservation;
use chorus_tests::{assert_success, run, run_one};
use chorus_transport::auth::Auth;
use chorus_transport::store::{Store, TcpStore};

const WORKER: &str = env!("CARGO_BIN_EXE_chorus-test-worker");
const LIMIT: Duration = Duration::from_secs(60);

fn worker() -> &'static Path {
    Path::new(WORKER)
}

/// Runs the worker's `connect` scenario as one rank of a loopback job.
fn connect_as(rank: &str, world: &str, port: &str, timeout: &str) -> chorus_tests::Finished {
    run_as(&["connect"], rank, world, port, timeout)
}

/// Runs the worker with `args` as one rank of a loopback job.
fn run_as(
    args: &[&str],
    rank: &str,
    world: &str,
    port: &str,
    timeout: &str,
) -> chorus_tests::Finished {
    let env = [
        ("RANK", rank),
        ("WORLD_SIZE", world),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", port),
        ("CHORUS_TIMEOUT", timeout),
    ];
    run_one(worker(), args, &env, LIMIT)
}

fn assert_clean_failure(stderr: &str, needles: &[&str]) {
    assert!(
        !stderr.contains("panicked"),
        "a panic instead of an error:\n{stderr}"
    );
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "error should mention {needle:?}:\n{stderr}"
        );
    }
}

/// Environment variables given to a process.
type Env<'a> = &'a [(&'a str, &'a str)];

#[test]
fn invalid_rank_variables_are_named() {
    let cases: [(Env, &[&str]); 4] = [
        (
            &[
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "1"),
            ],
            &["RANK", "not set"],
        ),
        (&[("RANK", "one"), ("WORLD_SIZE", "2")], &["RANK=\"one\""]),
        (
            &[("RANK", "2"), ("WORLD_SIZE", "2")],
            &["RANK", "below WORLD_SIZE=2"],
        ),
        (&[("RANK", "0"), ("WORLD_SIZE", "-3")], &["WORLD_SIZE"]),
    ];
    for (env, needles) in cases {
        let done = run_one(worker(), &["connect"], env, LIMIT);
        assert!(!done.success, "{env:?} should fail");
        assert_clean_failure(&done.stderr, needles);
    }
}

#[test]
fn an_unreachable_store_times_out_with_its_address() {
    // Reserved: nothing listens there, and nothing can start to.
    let reserved = PortReservation::new("127.0.0.1").unwrap();
    let port = reserved.port().to_string();
    let done = connect_as("1", "2", &port, "2");
    assert!(!done.success);
    assert_clean_failure(&done.stderr, &[&format!("127.0.0.1:{port}")]);
    assert!(
        done.elapsed < Duration::from_secs(20),
        "took {:?}",
        done.elapsed
    );
}

#[test]
fn a_busy_master_port_is_reported() {
    let blocker = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = blocker.local_addr().unwrap().port().to_string();
    let done = connect_as("0", "2", &port, "2");
    assert!(!done.success);
    assert_clean_failure(&done.stderr, &[&port, "MASTER_PORT"]);
    drop(blocker);
}

#[test]
fn a_rank_that_never_shows_up_is_named() {
    let reserved = PortReservation::new("127.0.0.1").unwrap();
    let port = reserved.port().to_string();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let port = port.clone();
            thread::spawn(move || connect_as(&rank.to_string(), "3", &port, "3"))
        })
        .collect();
    for done in ranks.into_iter().map(|t| t.join().unwrap()) {
        assert!(!done.success);
        assert_clean_failure(&done.stderr, &["[2]"]);
        assert!(
            done.elapsed < Duration::from_secs(30),
            "took {:?}",
            done.elapsed
        );
    }
}

/// A rank whose world size differs from rank 0's fails naming both values, and rank 0
/// fails at once with the same words, not after its timeout (60 s here).
#[test]
fn a_world_size_that_differs_from_rank_0s_is_named() {
    let reserved = PortReservation::new("127.0.0.1").unwrap();
    let port = reserved.port().to_string();
    let (zero, one) = thread::scope(|s| {
        let zero = s.spawn(|| connect_as("0", "2", &port, "60"));
        let one = connect_as("1", "3", &port, "60");
        (zero.join().unwrap(), one)
    });
    assert!(!one.success && !zero.success);
    let said = "rank 1 says WORLD_SIZE=3, rank 0 says WORLD_SIZE=2";
    assert_clean_failure(&one.stderr, &[said]);
    assert_clean_failure(&zero.stderr, &["rank 1 failed during set-up", said]);
    assert!(
        zero.elapsed < Duration::from_secs(30),
        "rank 0 took {:?}",
        zero.elapsed
    );
}

/// A rank killed after it joined, while the others still wait in set-up (here for a rank
/// that never comes): they fail at once naming it, not after their timeout (60 s here).
#[test]
fn a_rank_killed_during_set_up_is_named_at_once() {
    let reserved = PortReservation::new("127.0.0.1").unwrap();
    let port = reserved.port().to_string();
    let env = |rank| {
        [
            ("RANK", rank),
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port.as_str()),
            ("CHORUS_TIMEOUT", "60"),
            ("CHORUS_JOB_ID", "killed-in-set-up"),
        ]
    };
    let zero_env = env("0");
    let zero = thread::scope(|s| {
        let zero = s.spawn(|| run_one(worker(), &["connect"], &zero_env, LIMIT));
        let mut victim = Command::new(WORKER)
            .arg("connect")
            .envs(env("2"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start rank 2");
        // Rank 2 posts its settings once it watches the set-up: from then on it is a member.
        let auth = Auth::new("killed-in-set-up", "").unwrap();
        let store = TcpStore::connect_with_auth("127.0.0.1", reserved.port(), LIMIT, auth)
            .expect("the job's store");
        let joined = store.wait(&["chorus/0/settings/2"], LIMIT);
        victim.kill().expect("kill rank 2");
        victim.wait().expect("reap rank 2");
        joined.expect("rank 2 joined");
        zero.join().unwrap()
    });
    assert!(!zero.success);
    assert_clean_failure(&zero.stderr, &["rank 2 left during set-up"]);
    assert!(
        zero.elapsed < Duration::from_secs(30),
        "rank 0 took {:?}",
        zero.elapsed
    );
}

/// Two processes given the same RANK: the second to claim it fails at once saying so,
/// and the job of the other two completes.
#[test]
fn a_rank_number_given_twice_is_refused() {
    let reserved = PortReservation::new("127.0.0.1").unwrap();
    let port = reserved.port().to_string();
    // The job holds on until the refused claimer has exited, however late it started.
    let release = std::env::temp_dir().join(format!("chorus-errors-release-{port}"));
    let _ = std::fs::remove_file(&release);
    let release = release.to_str().unwrap();
    let done: Vec<_> = thread::scope(|s| {
        let runs: Vec<_> = ["0", "1", "1"]
            .map(|rank| s.spawn(|| run_as(&["connect_until", release], rank, "2", &port, "20")))
            .into_iter()
            .collect();
        while !runs.iter().any(|t| t.is_finished()) {
            thread::sleep(Duration::from_millis(10));
        }
        std::fs::write(release, b"").unwrap();
        runs.into_iter().map(|t| t.join().unwrap()).collect()
    });
    std::fs::remove_file(release).unwrap();
    let refused: Vec<_> = done.iter().filter(|d| !d.success).collect();
    assert_eq!(
        refused.len(),
        1,
        "one of the two rank 1s must fail: {done:?}"
    );
    assert_clean_failure(&refused[0].stderr, &["already has rank 1"]);
}

#[test]
fn mismatched_lengths_fail_on_every_rank() {
    for world in [2, 3] {
        let report = run(world, worker(), &["mismatched_length"], &[]);
        assert_success(&report);
        let errors: Vec<&str> = report.ranks.iter().map(|r| r.stdout.as_str()).collect();
        assert!(
            errors.iter().all(|e| e.contains("expected error")),
            "{errors:?}"
        );
        assert!(
            errors
                .iter()
                .all(|e| e.contains("1000 elements") && e.contains("1001 elements")),
            "every rank should name both sizes: {errors:?}"
        );
    }
}

#[test]
fn bitwise_operators_on_floats_fail_on_every_rank_and_the_communicator_goes_on() {
    for world in [2, 3] {
        let report = run(world, worker(), &["bitwise_floats"], &[]);
        assert_success(&report);
        for r in &report.ranks {
            assert!(
                r.stdout.contains("bitwise on floats ok")
                    && r.stdout.contains(
                        "refused: reduce_scatter: reduction operator bxor is not defined for \
                         double"
                    ),
                "rank {}: {}",
                r.rank,
                r.stdout
            );
        }
    }
}

/// A rank with another job's id or another secret is refused by the store, saying why; the
/// rank it never joins is named by the others.
#[test]
fn ranks_of_another_job_or_secret_are_refused() {
    let intruders: [(&[(&str, &str)], &str); 2] = [
        (&[("CHORUS_AUTH_TOKEN", "guess")], "CHORUS_AUTH_TOKEN"),
        (
            &[("CHORUS_AUTH_TOKEN", "s3cret"), ("CHORUS_JOB_ID", "job-b")],
            "job-b",
        ),
    ];
    for (intruder, needle) in intruders {
        let reserved = PortReservation::new("127.0.0.1").unwrap();
        let port = reserved.port().to_string();
        let base = [
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port.as_str()),
            ("CHORUS_TIMEOUT", "3"),
            ("CHORUS_JOB_ID", "job-a"),
        ];
        let owner: Vec<_> = base
            .iter()
            .copied()
            .chain([("RANK", "0"), ("CHORUS_AUTH_TOKEN", "s3cret")])
            .collect();
        // Later entries win: the intruder's job id and secret replace the owner's.
        let stranger: Vec<_> = base
            .iter()
            .copied()
            .chain([("RANK", "1")])
            .chain(intruder.iter().copied())
            .collect();
        let (waited, refused) = thread::scope(|s| {
            let first = s.spawn(|| run_one(worker(), &["connect"], &owner, LIMIT));
            let refused = run_one(worker(), &["connect"], &stranger, LIMIT);
            (first.join().unwrap(), refused)
        });
        assert!(!refused.success && !waited.success);
        assert_clean_failure(&refused.stderr, &["refused", needle]);
        assert_clean_failure(&waited.stderr, &["[1]"]);
    }
}
