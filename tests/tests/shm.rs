//! The shared-memory transport across real processes: hosts told apart by their identity
//! (shared memory inside a host, TCP across), TCP still carrying every collective when asked
//! for, single copies where asked for, shared buffers (`alloc_shared`) read and written
//! directly by every rank, and a rank killed with SIGKILL: its peer fails naming it, and
//! nothing is left in /dev/shm.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chorus::tuner::{Collective, Forced, Topology, Tuner};
use chorus_launch::{LaunchReport, PortReservation};
use chorus_tests::{
    assert_identical_digests, assert_success, reduction_pairs, run, CHORUS_TEST_PAGES,
    CHORUS_TEST_RANKS_PER_HOST, CHORUS_TEST_SHARED,
};

const WORKER: &str = env!("CARGO_BIN_EXE_chorus-test-worker");

fn worker() -> &'static Path {
    Path::new(WORKER)
}

/// The line where a rank logged its transport routes, without colour codes.
fn routes(stderr: &str) -> Option<String> {
    logged(stderr, "transport routes")
}

/// The latency and bandwidth the rank's tuner assumes, as it logged them.
fn link_model(stderr: &str) -> Option<String> {
    let line = logged(stderr, "tuner link model: ")?;
    let model = line.split("tuner link model: ").nth(1)?;
    Some(model.split(" rank=").next()?.trim().to_string())
}

/// The first line of `stderr` containing `marker`, without colour codes.
fn logged(stderr: &str, marker: &str) -> Option<String> {
    let line = stderr.lines().find(|l| l.contains(marker))?;
    let mut plain = String::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|&c| c == 'm');
        } else {
            plain.push(c);
        }
    }
    Some(plain)
}

#[test]
fn two_hosts_of_two_ranks_use_shm_inside_and_tcp_across() {
    let env = [(CHORUS_TEST_RANKS_PER_HOST, "2"), ("CHORUS_DEBUG", "info")];
    let report = run(4, worker(), &["all_reduce", "1,1023,300007"], &env);
    assert_success(&report);
    // Every (dtype, op) pair x 3 counts x 2 placements.
    assert_eq!(
        assert_identical_digests(&report),
        reduction_pairs().count() * 3 * 2
    );
    for r in &report.ranks {
        let partner = r.rank ^ 1;
        let routes = routes(&r.stderr)
            .unwrap_or_else(|| panic!("rank {} logged no routes:\n{}", r.rank, r.stderr));
        assert!(
            routes.contains(&format!("shm_peers=[{partner}]")) && routes.contains("tcp_peers=2"),
            "rank {}: {routes}",
            r.rank
        );
        // Rings cross hosts: every rank's tuner assumes TCP's links.
        assert_eq!(
            link_model(&r.stderr).as_deref(),
            Some("10 us per message, 1.5 GB/s")
        );
    }
    let report = run(4, worker(), &["broadcast", "0,7,300007"], &env);
    assert_success(&report);
    assert_eq!(assert_identical_digests(&report), 24 * 4);
}

#[test]
fn tcp_alone_still_carries_every_collective() {
    let tcp = [("CHORUS_TRANSPORT", "tcp"), ("CHORUS_DEBUG", "info")];
    let report = run(3, worker(), &["all_reduce", "0,7,1048579"], &tcp);
    assert_success(&report);
    // Every (dtype, op) pair x 3 counts x 2 placements.
    assert_eq!(
        assert_identical_digests(&report),
        reduction_pairs().count() * 3 * 2
    );
    for r in &report.ranks {
        let routes = routes(&r.stderr).unwrap_or_default();
        assert!(routes.contains("shm_peers=[] tcp_peers=2"), "{routes}");
        assert_eq!(
            link_model(&r.stderr).as_deref(),
            Some("10 us per message, 1.5 GB/s")
        );
    }
    for scenario in [&["more", "0,5,70001"][..], &["p2p"], &["split"]] {
        let report = run(3, worker(), scenario, &tcp);
        assert_success(&report);
        assert_identical_digests(&report);
    }
}

#[test]
fn one_host_tunes_for_shared_memory_and_its_cores_unless_configured() {
    let tuned = |world: usize, env: &[(&str, &str)], expected: &str| {
        let mut env = env.to_vec();
        env.push(("CHORUS_DEBUG", "info"));
        let report = run(world, worker(), &["all_reduce", "0,7,70001"], &env);
        assert_success(&report);
        for r in &report.ranks {
            assert_eq!(link_model(&r.stderr).as_deref(), Some(expected));
        }
        report
    };
    let report = tuned(3, &[], "2 us per message, 3 GB/s");
    // Every rank counted the cores this process may run on (the workers inherit its
    // affinity and quota), and picked what a tuner of such a host picks.
    let here = std::thread::available_parallelism().map_or(1, |n| n.get());
    let tuner = Tuner::new(2e-6, 3e9, Forced::none()).with_topology(Topology {
        hosts: 1,
        most_local: 3,
        shared_memory: true,
        cores: here,
    });
    for r in &report.ranks {
        let line = logged(&r.stderr, "tuner link model: ").unwrap();
        assert!(line.ends_with(&format!(" cores={here}")), "{line}");
        let picks: Vec<(usize, String)> = r
            .stderr
            .lines()
            .filter_map(|l| {
                let l = l.split("allreduce ").nth(1)?;
                let (bytes, rest) = l.split_once(" B on 3 ranks: ")?;
                let pick = rest.split(" -> ").nth(1)?.split(' ').next()?;
                Some((bytes.parse().ok()?, pick.to_string()))
            })
            .collect();
        assert!(!picks.is_empty(), "rank {} logged no picks", r.rank);
        for (bytes, pick) in picks {
            let path = tuner
                .pick(Some(Collective::AllReduce), bytes, 3, false)
                .path;
            assert_eq!(path.to_string(), pick, "{bytes} B");
        }
    }
    let configured = [("CHORUS_ALPHA_US", "7"), ("CHORUS_BANDWIDTH_GBS", "0.5")];
    tuned(2, &configured, "7 us per message, 0.5 GB/s");
}

#[test]
fn forcing_shm_across_hosts_is_a_clear_error() {
    let env = [
        ("CHORUS_TRANSPORT", "shm"),
        (CHORUS_TEST_RANKS_PER_HOST, "1"),
    ];
    let report = run(2, worker(), &["connect"], &env);
    assert!(!report.success(), "{}", report.summary());
    let failed = report
        .ranks
        .iter()
        .find(|r| r.stderr.contains("CHORUS_TRANSPORT=shm"))
        .unwrap_or_else(|| panic!("no rank explained the failure: {:?}", report.ranks));
    assert!(
        failed.stderr.contains("on other hosts"),
        "{}",
        failed.stderr
    );
}

/// Kills its processes when dropped, so a failing test leaves none behind.
struct Ranks(Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Files in /dev/shm that a Chorus process among `pids` created.
fn leftovers(pids: &[u32]) -> Vec<String> {
    let names = std::fs::read_dir("/dev/shm").map_or_else(
        |_| Vec::new(),
        |dir| {
            dir.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        },
    );
    names
        .into_iter()
        .filter(|n| pids.iter().any(|p| n.starts_with(&format!("chorus-{p}-"))))
        .collect()
}

/// Ranks that may read each other's memory find out at set-up unless single copies are
/// off; asked for every message from 64 KiB on, those are read straight from the sender's
/// memory, and every collective agrees as it does through the slots.
#[test]
fn single_copies_when_asked_carry_every_collective() {
    let single_copies = |report: &LaunchReport, on: bool| {
        let marker = format!("single_copies={on}");
        for r in &report.ranks {
            let line = logged(&r.stderr, "shm transport connected");
            assert!(
                line.as_ref().is_some_and(|l| l.contains(&marker)),
                "expected {marker} in the log: {line:?}"
            );
        }
    };
    let log = ("CHORUS_DEBUG", "chorus_transport::shm=debug");
    // By default, an out-of-place broadcast's root lends its input, whatever its pages.
    let report = run(2, worker(), &["broadcast", "7,300007"], &[log]);
    assert_success(&report);
    single_copies(&report, true);
    assert_eq!(assert_identical_digests(&report), 2 * 4 * 2 * 2);
    let env = [log, ("CHORUS_SHM_SINGLE_COPY", "0")];
    let report = run(2, worker(), &["all_reduce", "7"], &env);
    assert_success(&report);
    single_copies(&report, false);
    let env = [log, ("CHORUS_SHM_SINGLE_COPY", "65536")];
    for world in [2, 4] {
        let report = run(world, worker(), &["all_reduce", "7,70001,1048579"], &env);
        assert_success(&report);
        single_copies(&report, true);
        assert_eq!(
            assert_identical_digests(&report),
            reduction_pairs().count() * 3 * 2,
            "W={world}"
        );
    }
    let report = run(3, worker(), &["broadcast", "0,7,300007"], &env);
    assert_success(&report);
    assert_eq!(assert_identical_digests(&report), 3 * 4 * 3 * 2);
    let report = run(4, worker(), &["more", "0,1,7,1000,65543"], &env);
    assert_success(&report);
    assert!(report.ranks.iter().all(|r| r.stdout.contains("more ok")));
}

/// Asked for on every call, streaming stores carry every collective through the slots, in
/// single copies and over TCP to the same bytes as the caches do; turned off, no call
/// streams.
#[test]
fn streaming_stores_when_asked_carry_every_collective() {
    let streamed = |report: &LaunchReport| {
        let says = |r: &chorus_launch::RankOutcome| r.stderr.contains(STREAMED);
        (report.ranks.iter().all(says), report.ranks.iter().any(says))
    };
    let log = ("CHORUS_DEBUG", "chorus::communicator::prepare=debug");
    let every = ("CHORUS_STREAMING_STORES", "1");
    for (world, single_copy) in [(2, "0"), (4, "65536")] {
        let env = [log, every, ("CHORUS_SHM_SINGLE_COPY", single_copy)];
        let report = run(world, worker(), &["all_reduce", "7,70001"], &env);
        assert_success(&report);
        assert_eq!(streamed(&report), (true, true), "W={world}");
        assert_eq!(
            assert_identical_digests(&report),
            reduction_pairs().count() * 2 * 2,
            "W={world}"
        );
    }
    let report = run(3, worker(), &["broadcast", "0,7,300007"], &[log, every]);
    assert_success(&report);
    assert_eq!(assert_identical_digests(&report), 3 * 4 * 3 * 2);
    let report = run(4, worker(), &["more", "0,1,7,1000,65543"], &[log, every]);
    assert_success(&report);
    assert!(report.ranks.iter().all(|r| r.stdout.contains("more ok")));
    let tcp = [log, every, ("CHORUS_TRANSPORT", "tcp")];
    let report = run(3, worker(), &["all_reduce", "70001"], &tcp);
    assert_success(&report);
    assert_eq!(streamed(&report), (true, true));
    assert_eq!(
        assert_identical_digests(&report),
        reduction_pairs().count() * 2
    );
    let off = [log, ("CHORUS_STREAMING_STORES", "0")];
    let report = run(2, worker(), &["all_reduce", "70001"], &off);
    assert_success(&report);
    assert_eq!(streamed(&report), (false, false));
}

/// What a rank logs when a call writes its output with streaming stores.
const STREAMED: &str = "the output is written with streaming stores";

/// Every shared-memory route on private buffers the kernel puts on huge pages, as numpy's
/// are: the all-reduce and broadcast matrices at W = 2 and 4, through the slots and, as by
/// default, lent in single copies, the small calls through the mailboxes. Where transparent
/// huge pages are on, the large buffers must have got some, and been lent; where they are
/// off, the test says so.
#[test]
fn every_route_carries_buffers_on_huge_pages() {
    let mut huge = Some(0);
    for single_copy in ["0", "huge"] {
        let env = [
            (CHORUS_TEST_PAGES, "huge"),
            ("CHORUS_SHM_SINGLE_COPY", single_copy),
            ("CHORUS_DEBUG", "chorus::communicator::prepare=debug"),
        ];
        for world in [2, 4] {
            let report = run(world, worker(), &["all_reduce", "7,524309"], &env);
            assert_success(&report);
            let digests = assert_identical_digests(&report);
            assert_eq!(digests, reduction_pairs().count() * 2 * 2, "W={world}");
            let reduced = huge_page_bytes(&report);
            let lent = report.ranks.iter().any(|r| r.stderr.contains(LENT));
            let expected = single_copy == "huge" && reduced > Some(0);
            assert_eq!(
                lent, expected,
                "W={world}, {single_copy}, {reduced:?} bytes on huge pages"
            );
            let report = run(world, worker(), &["broadcast", "7,524309"], &env);
            assert_success(&report);
            assert_eq!(assert_identical_digests(&report), world * 4 * 2 * 2);
            huge = [huge, reduced, huge_page_bytes(&report)].into_iter().sum();
        }
    }
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
    match (thp.as_deref().unwrap_or(""), huge) {
        (_, None) => eprintln!("NOTE: this kernel cannot tell a buffer's page sizes (6.7 can)"),
        (on, Some(huge)) if on.contains("[always]") || on.contains("[madvise]") => {
            assert!(
                huge > 0,
                "no buffer advised onto huge pages got any (THP: {on})"
            )
        }
        (off, _) => eprintln!(
            "NOTE: transparent huge pages are off here ({}): the routes ran on small pages",
            off.trim()
        ),
    }
}

/// What a rank logs when it finds a call's buffers on huge pages.
const LENT: &str = "sends from buffers on huge pages are lent";

/// The bytes on huge pages that the ranks' `pages` lines report; `None` where a rank's
/// kernel could not tell.
fn huge_page_bytes(report: &LaunchReport) -> Option<u64> {
    let lines = report.ranks.iter().flat_map(|r| r.stdout.lines());
    let pages = lines.filter_map(|l| l.strip_prefix("pages "));
    pages
        .map(|l| l.split(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[test]
fn shared_buffers_carry_every_all_reduce_and_broadcast() {
    let shared = [(CHORUS_TEST_SHARED, "1")];
    for world in [2, 3, 4] {
        // Blocks of uneven size (3 ranks), fewer elements than ranks, none at all.
        let report = run(world, worker(), &["all_reduce", "0,1,5,70001"], &shared);
        assert_success(&report);
        assert_eq!(
            assert_identical_digests(&report),
            reduction_pairs().count() * 4 * 2,
            "W={world}"
        );
    }
    let report = run(3, worker(), &["broadcast", "0,7,300007"], &shared);
    assert_success(&report);
    assert_eq!(assert_identical_digests(&report), 3 * 4 * 3 * 2);
    let report = run(3, worker(), &["shared_async"], &[]);
    assert_success(&report);
    assert_eq!(assert_identical_digests(&report), 1);
    // Ranks on different shared buffers, each dropping the other meanwhile:
    // a clean error or a correct sum (the worker checks it), never a crash.
    for _ in 0..3 {
        let report = run(2, worker(), &["shared_dropped"], &[]);
        assert_success(&report);
        assert!(report.ranks.iter().all(|r| r.stdout.contains("outcome: ")));
    }
}

#[test]
fn a_shared_buffer_of_another_size_fails_on_every_rank_and_the_communicator_goes_on() {
    let report = run(
        3,
        worker(),
        &["shared_alloc_mismatch"],
        &[("CHORUS_TIMEOUT", "120")],
    );
    assert_success(&report);
    for r in &report.ranks {
        // Rank 1 names both sizes, the others the rank that failed.
        let why = if r.rank == 1 {
            "rank 0 for 4000"
        } else {
            "ranks [1] could not map"
        };
        assert!(
            r.stdout.contains("allocation failed as expected") && r.stdout.contains(why),
            "rank {}: {}",
            r.rank,
            r.stdout
        );
    }
}

#[test]
fn shared_buffers_across_hosts_or_over_tcp_are_plain_memory() {
    for env in [
        [(CHORUS_TEST_SHARED, "1"), ("CHORUS_TRANSPORT", "tcp")],
        [(CHORUS_TEST_SHARED, "1"), (CHORUS_TEST_RANKS_PER_HOST, "2")],
    ] {
        // The worker fails if a buffer is shared where it should not be.
        let report = run(4, worker(), &["all_reduce", "7,70001"], &env);
        assert_success(&report);
        assert_eq!(
            assert_identical_digests(&report),
            reduction_pairs().count() * 2 * 2,
            "{env:?}"
        );
    }
}

#[test]
fn a_rank_without_shared_buffers_fails_the_call_on_every_rank() {
    // Far longer than the test takes: the ranks must find the mismatch, not time out.
    let report = run(
        3,
        worker(),
        &["shared_mismatch"],
        &[("CHORUS_TIMEOUT", "120")],
    );
    assert_success(&report);
    for r in &report.ranks {
        assert!(
            r.stdout.contains("failed as expected"),
            "rank {}: {}",
            r.rank,
            r.stdout
        );
        assert!(
            !r.stdout.contains("timed out"),
            "rank {}: {}",
            r.rank,
            r.stdout
        );
    }
    let explained = report
        .ranks
        .iter()
        .filter(|r| {
            r.stdout.contains("rank 1 runs this call") && r.stdout.contains("outside shared memory")
        })
        .count();
    assert!(explained >= 1, "{:?}", report.ranks);
}

#[test]
fn a_killed_rank_fails_its_peer_promptly_and_leaves_nothing_in_dev_shm() {
    killed_rank_fails_its_peer(false);
}

#[test]
fn a_rank_killed_in_a_call_on_shared_buffers_fails_its_peer_promptly() {
    killed_rank_fails_its_peer(true);
}

/// Two ranks all-reduce (on shared buffers, or not) until rank 1 is killed:
/// rank 0 must fail naming it, and /dev/shm must hold nothing of theirs.
fn killed_rank_fails_its_peer(shared: bool) {
    let reserved = PortReservation::new("127.0.0.1").unwrap();
    let port = reserved.port().to_string();
    let mut ranks = Ranks(Vec::new());
    for rank in 0..2 {
        let child = Command::new(worker())
            .arg("hold")
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            // Far longer than the test waits: only noticing the death can end the survivor's wait.
            .env("CHORUS_TIMEOUT", "120")
            .env(CHORUS_TEST_SHARED, if shared { "1" } else { "0" })
            .env_remove("CHORUS_TRANSPORT")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start a worker");
        ranks.0.push(child);
    }
    let pids: Vec<u32> = ranks.0.iter().map(Child::id).collect();
    for child in &mut ranks.0 {
        let mut line = String::new();
        let stdout = child.stdout.as_mut().expect("piped stdout");
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read a worker's first line");
        assert!(line.starts_with("ready"), "worker said {line:?}");
    }
    assert_eq!(leftovers(&pids), Vec::<String>::new(), "while running");

    ranks.0[1].kill().expect("SIGKILL rank 1");
    ranks.0[1].wait().expect("reap rank 1");
    let survivor = &mut ranks.0[0];
    let start = Instant::now();
    let status = loop {
        if let Some(status) = survivor.try_wait().expect("wait for rank 0") {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "rank 0 did not notice that rank 1 died"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(survivor.stderr.as_mut().expect("piped stderr"), &mut stderr)
        .expect("read rank 0's stderr");
    assert!(!status.success(), "rank 0 went on without rank 1");
    let error = stderr
        .lines()
        .find(|l| l.starts_with("worker error"))
        .unwrap_or_else(|| panic!("no error line:\n{stderr}"));
    assert!(
        error.contains("rank 1") && !error.contains("timed out"),
        "{error}"
    );
    assert_eq!(leftovers(&pids), Vec::<String>::new(), "after SIGKILL");
}
