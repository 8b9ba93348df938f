//! Receiving from any source (`Communicator::recv_any`) between real processes, over TCP and
//! over shared memory: every sender's message taken once, a message with another tag left for
//! its own receive, and clear errors for a length mismatch and for a tag nobody sends.

use std::path::Path;

use chorus_tests::{assert_success, run};

const WORKER: &str = env!("CARGO_BIN_EXE_chorus-test-worker");

/// The transports each case runs over: TCP, shared memory, and shared memory with every
/// message moved in ring-sized chunks (no single copy).
const TRANSPORTS: [&[(&str, &str)]; 3] = [
    &[("CHORUS_TRANSPORT", "tcp")],
    &[("CHORUS_TRANSPORT", "shm")],
    &[("CHORUS_TRANSPORT", "shm"), ("CHORUS_SHM_SINGLE_COPY", "0")],
];

fn worker() -> &'static Path {
    Path::new(WORKER)
}

#[test]
fn every_sender_is_received_once_and_other_tags_wait_their_turn() {
    for env in TRANSPORTS {
        for world in [3, 4] {
            let report = run(world, worker(), &["any_source"], env);
            assert_success(&report);
            assert!(
                report
                    .ranks
                    .iter()
                    .all(|r| r.stdout.contains("any_source ok")),
                "W={world} {env:?}"
            );
        }
    }
}

#[test]
fn one_rank_has_no_one_to_receive_from() {
    let report = run(1, worker(), &["any_source"], &[]);
    assert_success(&report);
    assert!(report.ranks[0].stdout.contains("any_source ok"));
}

/// Rank 0's stdout from `scenario` at W=3 over each transport, once every rank has succeeded.
fn rank_0_says(scenario: &str, extra: &[(&str, &str)]) -> Vec<String> {
    TRANSPORTS
        .iter()
        .map(|env| {
            let env: Vec<_> = env.iter().chain(extra).copied().collect();
            let report = run(3, worker(), &[scenario], &env);
            assert_success(&report);
            report.ranks[0].stdout.clone()
        })
        .collect()
}

#[test]
fn a_tag_nobody_sends_times_out_naming_it() {
    for said in rank_0_says("any_source_timeout", &[("CHORUS_TIMEOUT", "5")]) {
        assert!(
            said.contains("expected error: rank 0: recv_any: no rank sent rank 0 a message with tag 6 within 5.0 s"),
            "{said}"
        );
        assert!(
            said.contains("rank 1's next message is a send with tag 5"),
            "{said}"
        );
    }
}

#[test]
fn a_message_of_another_length_fails_naming_the_sender_and_both_sizes() {
    for said in rank_0_says("any_source_length", &[]) {
        assert!(
            said.contains(
                "expected error: rank 0: protocol error with rank 1: its message with tag 3 is \
                 32 bytes, but recv_any receives 16 bytes"
            ),
            "{said}"
        );
    }
}

#[test]
fn ranks_that_left_are_passed_over_until_none_is_left() {
    for said in rank_0_says("any_source_left", &[]) {
        assert!(said.contains("any_source_left ok"), "{said}");
        assert!(
            said.contains("expected error: rank 0: rank ")
                && said.contains("closed its connection"),
            "{said}"
        );
    }
}
