//! All-reduce, broadcast and barrier across real processes on loopback.

use std::path::Path;

use chorus_tests::{assert_identical_digests, assert_success, reduction_pairs, run};

const WORKER: &str = env!("CARGO_BIN_EXE_chorus-test-worker");

fn worker() -> &'static Path {
    Path::new(WORKER)
}

/// Uneven counts, the largest spanning several pipeline chunks (512 KiB); a smaller largest at
/// eight ranks, whose calls take turns on a small machine's cores.
fn counts(world: usize) -> String {
    let large = if world >= 8 { 300_007 } else { 1_048_579 };
    let mut counts = vec![0, 1, 7, world.saturating_sub(1), 1023, large];
    counts.sort_unstable();
    counts.dedup();
    counts
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

fn all_reduce(world: usize, algo: &str) {
    all_reduce_with(world, algo, "1");
}

/// Runs the matrix with `nsocks` sockets per peer; more than one stripes large messages over
/// TCP (which then carries every peer: ranks on one host otherwise talk shared memory).
fn all_reduce_with(world: usize, algo: &str, nsocks: &str) {
    let counts = counts(world);
    let transport = if nsocks == "1" { "auto" } else { "tcp" };
    let env = [
        ("CHORUS_ALGO", algo),
        ("CHORUS_NSOCKS", nsocks),
        ("CHORUS_TRANSPORT", transport),
    ];
    let report = run(world, worker(), &["all_reduce", &counts], &env);
    assert_success(&report);
    // Every (dtype, op) pair x 2 placements per distinct count.
    let distinct = counts.split(',').count();
    assert_eq!(
        assert_identical_digests(&report),
        reduction_pairs().count() * 2 * distinct
    );
}

#[test]
fn all_reduce_ring_w1() {
    all_reduce(1, "ring");
}

#[test]
fn all_reduce_tree_w1() {
    all_reduce(1, "tree");
}

#[test]
fn all_reduce_ring_w2() {
    all_reduce(2, "ring");
}

#[test]
fn all_reduce_tree_w2() {
    all_reduce(2, "tree");
}

#[test]
fn all_reduce_ring_w3_striped() {
    all_reduce_with(3, "ring", "3");
}

#[test]
fn all_reduce_tree_w3() {
    all_reduce(3, "tree");
}

#[test]
fn all_reduce_ring_w4() {
    all_reduce(4, "ring");
}

#[test]
fn all_reduce_tree_w4() {
    all_reduce(4, "tree");
}

#[test]
fn all_reduce_ring_w5() {
    all_reduce(5, "ring");
}

#[test]
fn all_reduce_tree_w5_striped() {
    all_reduce_with(5, "tree", "2");
}

#[test]
fn all_reduce_ring_w8() {
    all_reduce(8, "ring");
}

#[test]
fn all_reduce_tree_w8() {
    all_reduce(8, "tree");
}

fn broadcast(world: usize, algo: &str) {
    broadcast_over(world, algo, "auto");
}

/// Broadcasts from every root over `transport` (`auto`: shared memory between local ranks);
/// 300007 elements are several pipeline chunks.
fn broadcast_over(world: usize, algo: &str, transport: &str) {
    let report = run(
        world,
        worker(),
        &["broadcast", "0,1,7,1023,300007"],
        &[("CHORUS_ALGO", algo), ("CHORUS_TRANSPORT", transport)],
    );
    assert_success(&report);
    // 4 dtypes x 5 counts x 2 placements per root.
    assert_eq!(assert_identical_digests(&report), 40 * world);
}

#[test]
fn broadcast_from_every_root() {
    for world in [1, 2, 3, 4, 5, 8] {
        broadcast(world, "ring");
        broadcast(world, "tree");
    }
}

#[test]
fn broadcast_over_tcp_from_every_root() {
    // Between two ranks: chunks over sockets, where shared memory sends one message.
    for world in [2, 3] {
        broadcast_over(world, "ring", "tcp");
    }
}

#[test]
fn barrier_lets_no_rank_leave_early() {
    // Meetings in shared memory, then messages over TCP (the exchanges of a dissemination).
    let runs = [1, 2, 3, 4, 5, 8].map(|w| (w, "auto")).into_iter();
    for (world, transport) in runs.chain([2, 3, 4, 5].map(|w| (w, "tcp"))) {
        let dir = std::env::temp_dir().join(format!(
            "chorus-barrier-{}-{world}-{transport}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let env = [("CHORUS_TRANSPORT", transport)];
        let report = run(world, worker(), &["barrier", dir.to_str().unwrap()], &env);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_success(&report);
        assert!(report.ranks.iter().all(|r| r.stdout.contains("barrier ok")));
    }
}

fn scenario(name: &str, worlds: &[usize]) {
    for &world in worlds {
        let report = run(world, worker(), &[name], &[]);
        assert_success(&report);
        let marker = format!("{name} ok");
        assert!(
            report.ranks.iter().all(|r| r.stdout.contains(&marker)),
            "{name} at W={world}"
        );
    }
}

#[test]
fn async_work_completes_in_issue_order() {
    scenario("async", &[1, 2, 3, 4]);
}

#[test]
fn every_async_call_matches_its_blocking_form() {
    scenario("async_every", &[1, 2, 3, 4]);
}

#[test]
fn calls_in_flight_fail_naming_a_rank_that_left() {
    scenario("async_vanish", &[2, 3, 4]);
}

#[test]
fn split_and_dup_run_beside_the_parent() {
    scenario("split", &[1, 2, 3, 5]);
}

#[test]
fn point_to_point_and_groups() {
    scenario("p2p", &[1, 2, 3, 4]);
}

#[test]
fn rooted_and_data_movement_collectives() {
    for world in [1, 2, 3, 4, 5, 8] {
        let report = run(world, worker(), &["more", "0,1,7,1000,65543"], &[]);
        assert_success(&report);
        assert!(
            report.ranks.iter().all(|r| r.stdout.contains("more ok")),
            "W={world}"
        );
    }
}

/// Small all-reduces by recursive doubling over TCP, which run as exchanges of a message
/// each way (up to 216 bytes without requests; 256 bytes posted as usual), at world sizes
/// with and without ranks folded in first.
#[test]
fn all_reduce_small_exchanges_over_tcp() {
    for world in [2, 3, 4] {
        let env = [("CHORUS_ALGO", "rd"), ("CHORUS_TRANSPORT", "tcp")];
        let report = run(world, worker(), &["all_reduce", "0,1,7,27,54,64"], &env);
        assert_success(&report);
        assert_eq!(
            assert_identical_digests(&report),
            reduction_pairs().count() * 6 * 2,
            "W={world}"
        );
    }
}

#[test]
fn all_reduce_recursive_doubling_w3() {
    all_reduce_with(3, "rd", "1");
}

#[test]
fn all_reduce_halving_doubling_w4() {
    all_reduce_with(4, "rhd", "1");
}

#[test]
fn all_reduce_halving_doubling_w5() {
    all_reduce_with(5, "allreduce:rhd,broadcast:tree", "1");
}

/// The recursive algorithms at the remaining world sizes, on smaller counts.
#[test]
fn all_reduce_recursive_at_every_world_size() {
    for world in [1, 2, 8] {
        for algo in ["rd", "rhd"] {
            let env = [("CHORUS_ALGO", algo)];
            let report = run(world, worker(), &["all_reduce", "0,1,7,1023,65543"], &env);
            assert_success(&report);
            assert_eq!(
                assert_identical_digests(&report),
                reduction_pairs().count() * 5 * 2,
                "{algo} at W={world}"
            );
        }
    }
}
