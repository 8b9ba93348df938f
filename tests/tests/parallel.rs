//! Pipeline and sharded data parallelism across real processes: a pipeline's
//! gradients equal the layers run on one rank, 2-D groups average them over
//! replicas, ZeRO 1 and 2 end with DDP's parameters, and a rank killed
//! mid-pipeline fails every other rank promptly, naming it.

use std::path::Path;
use std::time::Duration;

use chorus_launch::{launch, Exit, LaunchSpec, Output};
use chorus_tests::{assert_success, run};

const WORKER: &str = env!("CARGO_BIN_EXE_chorus-parallel-worker");

/// Runs `world` workers with `args`, checks every rank printed `ok`, and
/// shows what they printed (measured bubbles, bytes held) under `--nocapture`.
fn all_ok(world: usize, args: &[&str], ok: &str) {
    let report = run(world, Path::new(WORKER), args, &[]);
    assert_success(&report);
    for r in &report.ranks {
        assert!(r.stdout.contains(ok), "rank {}: {}", r.rank, r.stdout);
        println!("W={world} {args:?} rank {}: {}", r.rank, r.stdout.trim());
    }
}

#[test]
fn a_two_stage_pipeline_matches_one_rank_with_both_schedules() {
    all_ok(2, &["pipeline", "gpipe", "4"], "pipeline ok");
    all_ok(2, &["pipeline", "1f1b", "5"], "pipeline ok");
}

#[test]
fn three_and_four_stage_pipelines_match_one_rank() {
    all_ok(3, &["pipeline", "1f1b", "7"], "pipeline ok");
    all_ok(4, &["pipeline", "gpipe", "6"], "pipeline ok");
    all_ok(4, &["pipeline", "1f1b", "2"], "pipeline ok");
}

#[test]
fn two_replicas_of_two_stages_average_like_one_rank() {
    all_ok(4, &["grid", "2", "2", "1f1b", "4"], "grid ok");
    all_ok(2, &["grid", "2", "1", "gpipe", "3"], "grid ok");
}

#[test]
fn zero_one_and_two_end_with_ddps_parameters() {
    for world in [2, 3, 4] {
        all_ok(world, &["zero", "1"], "zero ok");
        all_ok(world, &["zero", "2"], "zero ok");
    }
}

/// A stage killed with SIGKILL in its forward: every other stage fails at once
/// (not by timing out), naming it: the first stage to notice raises the
/// monitor's alarm before giving up, so the stages further away, which only see
/// a neighbour leave, read the cause from it.
#[test]
fn a_rank_killed_mid_pipeline_fails_every_other_rank_naming_it() {
    for victim in [1usize, 3] {
        let spec = LaunchSpec::new(WORKER, 4)
            .args(["kill", &victim.to_string()])
            .timeout(Duration::from_secs(120))
            .output(Output::Capture)
            .wait_all(true)
            .env("CHORUS_TIMEOUT", "60");
        let report = launch(&spec).expect("launch");
        assert!(!report.timed_out, "the job hung:\n{}", report.summary());
        assert_eq!(report.ranks[victim].status, Exit::Signal(9));
        for rank in (0..4).filter(|&r| r != victim) {
            let r = &report.ranks[rank];
            let error = r
                .stderr
                .lines()
                .find_map(|l| l.strip_prefix("failed: "))
                .unwrap_or_else(|| panic!("rank {rank} printed no error:\n{}", r.stderr));
            assert_eq!(r.status, Exit::Code(1), "rank {rank}: {error}");
            assert!(!error.contains("timed out"), "rank {rank}: {error}");
            assert!(
                error.contains(&format!("rank {victim} ")),
                "rank {rank} does not name rank {victim}: {error}"
            );
        }
    }
}
