//! The gradient-bucket reducer across real processes: averaged gradients,
//! launch order, no_sync, unused parameters, compression, and the check
//! that every rank registered the same parameters.

use std::path::Path;

use chorus_tests::{assert_success, run};

const WORKER: &str = env!("CARGO_BIN_EXE_chorus-ddp-worker");

fn reduce(world: usize, overlap: &str) {
    let report = run(
        world,
        Path::new(WORKER),
        &["reduce"],
        &[("CHORUS_DDP_OVERLAP", overlap)],
    );
    assert_success(&report);
    assert!(report
        .ranks
        .iter()
        .all(|r| r.stdout.contains("ddp reduce ok")));
}

#[test]
fn buckets_average_gradients_w1() {
    reduce(1, "1");
}

#[test]
fn buckets_average_gradients_w2() {
    reduce(2, "1");
}

#[test]
fn buckets_average_gradients_w3_without_overlap() {
    reduce(3, "0");
}

#[test]
fn buckets_average_gradients_w4() {
    reduce(4, "1");
}

#[test]
fn a_different_parameter_list_is_named_on_every_rank() {
    let report = run(3, Path::new(WORKER), &["mismatch"], &[]);
    assert_success(&report);
    assert!(report
        .ranks
        .iter()
        .all(|r| r.stdout.contains("mismatch reported")));
}
