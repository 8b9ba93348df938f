//! Going on after a rank's death: the survivors shrink their communicator, agree on who is
//! left without rank 0's store, and run every collective on the new one, again after a
//! second death; a rank that comes too late, or that another's list excludes, is told so.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use chorus_launch::{launch, Exit, LaunchReport, LaunchSpec, Output};
use chorus_tests::dump;

const WORKER: &str = env!("CARGO_BIN_EXE_chorus-test-worker");

/// One job at a time: each has up to eight ranks on two cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `world` workers on `args` to the end, the survivors going on after a rank dies.
fn job(world: usize, args: &[&str], env: &[(&str, &str)]) -> LaunchReport {
    let _one = serial();
    let mut spec = LaunchSpec::new(WORKER, world)
        .args(args.iter().copied())
        .timeout(Duration::from_secs(300))
        .output(Output::Capture)
        .wait_all(true)
        .env("CHORUS_TIMEOUT", "30");
    for &(k, v) in env {
        spec = spec.env(k, v);
    }
    let report = launch(&spec).expect("launch");
    assert!(!report.timed_out, "the job hung:\n{}", dump(&report));
    report
}

/// Checks that each of `ranks` exited with code 0.
fn assert_finished(report: &LaunchReport, ranks: impl IntoIterator<Item = usize>) {
    for r in ranks {
        let status = report.ranks[r].status;
        assert_eq!(status, Exit::Code(0), "rank {r}:\n{}", dump(report));
    }
}

/// The lines rank `rank` printed that start with `prefix`, the prefix removed.
fn lines<'a>(report: &'a LaunchReport, rank: usize, prefix: &'a str) -> Vec<&'a str> {
    report.ranks[rank]
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .collect()
}

/// Checks that `victims` died by their own SIGKILL and every other rank finished, having
/// shrunk once per death to the expected shape.
fn check_survivors(report: &LaunchReport, world: usize, victims: &[usize]) {
    for &v in victims {
        assert_eq!(report.ranks[v].status, Exit::Signal(9), "{}", dump(report));
    }
    let mut alive: Vec<usize> = (0..world).collect();
    let mut expected: Vec<Vec<String>> = vec![Vec::new(); world];
    for (round, v) in victims.iter().enumerate() {
        alive.retain(|r| r != v);
        for (new_rank, &r) in alive.iter().enumerate() {
            expected[r].push(format!("{round}: rank {new_rank} of {}", alive.len()));
        }
    }
    assert_finished(report, alive.iter().copied());
    for &r in &alive {
        assert_eq!(
            lines(report, r, "shrunk "),
            expected[r],
            "rank {r}:\n{}",
            dump(report)
        );
        assert_eq!(
            lines(report, r, "survived "),
            [victims.len().to_string()],
            "{}",
            dump(report)
        );
    }
}

/// Four ranks on one host (shared memory): rank 2 dies, then rank 0, which after the first
/// shrink is the new communicator's rank 0 and hosts its store.
#[test]
fn four_ranks_survive_two_deaths_and_run_every_collective() {
    let report = job(4, &["shrink", "2,0"], &[]);
    check_survivors(&report, 4, &[2, 0]);
}

/// Eight ranks on two stand-in hosts (shared memory within, TCP between): rank 0, which
/// hosts the job's rendezvous store, dies first, then rank 5.
#[test]
fn eight_ranks_on_two_hosts_survive_rank_0_and_another() {
    let env = [(chorus_tests::CHORUS_TEST_RANKS_PER_HOST, "4")];
    let report = job(8, &["shrink", "0,5"], &env);
    check_survivors(&report, 8, &[0, 5]);
}

/// Rank 3 of 4 dies and rank 2 comes to the shrink after the timeout: ranks 0 and 1 go on
/// as two, and rank 2 learns it was left out (by rank 0, for coming late) instead of hanging.
#[test]
fn a_rank_that_comes_after_the_timeout_is_told_it_was_left_out() {
    let report = job(4, &["shrink_late"], &[("CHORUS_TIMEOUT", "3")]);
    assert_eq!(report.ranks[3].status, Exit::Signal(9), "{}", dump(&report));
    assert_finished(&report, 0..3);
    for r in [0, 1] {
        assert_eq!(lines(&report, r, "shrunk "), [format!("0: rank {r} of 2")]);
    }
    assert_eq!(
        lines(&report, 2, "excluded: "),
        ["coordinator 0 named_by None"],
        "{}",
        dump(&report)
    );
}

/// No rank dies: rank 1 leaves without shrinking, ranks 0 and 2 exclude ranks 1 and 3, and
/// rank 3, which excludes only rank 1, learns that rank 0's list named it.
#[test]
fn ranks_an_exclusion_list_names_are_left_out_and_told_by_whom() {
    let report = job(4, &["shrink_exclude"], &[]);
    assert_finished(&report, 0..4);
    assert_eq!(lines(&report, 0, "shrunk "), ["0: rank 0 of 2"]);
    assert_eq!(lines(&report, 2, "shrunk "), ["0: rank 1 of 2"]);
    assert_eq!(
        lines(&report, 3, "excluded: "),
        ["coordinator 0 named_by Some(0)"],
        "{}",
        dump(&report)
    );
}
