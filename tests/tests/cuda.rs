//! Collectives on CUDA device buffers across real processes, every rank on the machine's
//! first GPU(s): every path (CUDA IPC and pinned-host staging at 1, 2 and 4 ranks, the
//! hierarchical path at 2 ranks on one host and 4 as two hosts of two). Each
//! rank checks its outputs against the host's result. Without a GPU the workers print a
//! skip line, shown here; `CHORUS_REQUIRE_CUDA=1` makes that a failure.
#![cfg(feature = "cuda")]

use std::path::PathBuf;

use chorus_tests::{assert_success, run, CHORUS_TEST_BIN_DIR};

/// The worker: the one cargo built, or the one in `CHORUS_TEST_BIN_DIR` (binaries carried
/// to a GPU machine by `tools/gpu-check.sh`).
fn worker() -> PathBuf {
    match std::env::var_os(CHORUS_TEST_BIN_DIR) {
        Some(dir) => PathBuf::from(dir).join("chorus-cuda-worker"),
        None => PathBuf::from(env!("CARGO_BIN_EXE_chorus-cuda-worker")),
    }
}

/// Runs `args` on `world` ranks with the path forced; false when the workers skipped.
fn on_gpu(world: usize, path: &str, args: &[&str], ok: &str) -> bool {
    let report = run(world, &worker(), args, &[("CHORUS_CUDA_PATH", path)]);
    assert_success(&report);
    if let Some(skip) = report.ranks.iter().find(|r| r.stdout.contains("skipping")) {
        println!("skipping device collectives: {}", skip.stdout.trim());
        return false;
    }
    for r in &report.ranks {
        assert!(r.stdout.contains(ok), "rank {}: {}", r.rank, r.stdout);
        println!("W={world} {path} rank {}: {}", r.rank, r.stdout.trim());
    }
    true
}

#[test]
fn device_collectives_match_the_host_through_ipc() {
    for world in [1, 2, 4] {
        if !on_gpu(world, "ipc", &["check", "ipc"], "device collectives ok") {
            return;
        }
    }
}

#[test]
fn device_collectives_match_the_host_through_staging() {
    for world in [1, 2, 4] {
        if !on_gpu(
            world,
            "staged",
            &["check", "staged"],
            "device collectives ok",
        ) {
            return;
        }
    }
}

/// Ranks `2h` and `2h + 1` count as host `h` (the worker sets their `CHORUS_HOST_ID`).
#[test]
fn device_collectives_match_the_host_through_the_hierarchical_path() {
    for world in [2, 4] {
        let args = ["check", "hierarchical"];
        if !on_gpu(world, "hierarchical", &args, "device collectives ok") {
            return;
        }
    }
}

/// The last of three ranks leaves mid-job; the other two shrink the device communicator and
/// run the device collectives on it, through each path.
#[test]
fn survivors_shrink_the_device_communicator_and_go_on() {
    for path in ["ipc", "staged"] {
        if !on_gpu(3, path, &["shrink", path], "shrunk ok") {
            return;
        }
    }
}
