//! The launcher on real processes: `/bin/sh` workers that report what they were given, fail,
//! hang or ignore signals. Every job is bounded in time.

use std::io;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use chorus_launch::{launch, Exit, Interrupt, LaunchError, LaunchSpec, Output};

/// A spec running `/bin/sh -c script` on every rank, capturing output, bounded in time.
fn sh(world: usize, script: &str) -> LaunchSpec {
    LaunchSpec::new("/bin/sh", world)
        .arg("-c")
        .arg(script)
        .output(Output::Capture)
        .timeout(Duration::from_secs(20))
}

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("chorus-launch-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Asserts that no process with the pid stored in `file` exists any more (Linux only).
fn assert_gone(file: &Path) {
    let pid = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let pid = pid.trim();
    assert!(!pid.is_empty());
    if cfg!(target_os = "linux") {
        assert!(
            !Path::new("/proc").join(pid).exists(),
            "worker {pid} still exists after launch returned"
        );
    }
}

#[test]
fn all_ranks_exit_zero() {
    let report = launch(&sh(4, "exit 0")).unwrap();
    assert!(report.success(), "{}", report.summary());
    assert_eq!(report.ranks.len(), 4);
    assert!(!report.timed_out);
    assert!(report.first_failure().is_none());
    for (i, r) in report.ranks.iter().enumerate() {
        assert_eq!(r.rank, i);
        assert_eq!(r.status, Exit::Code(0));
    }
    assert!(
        report.summary().starts_with("all 4 ranks succeeded in "),
        "{}",
        report.summary()
    );
}

#[test]
fn env_contract() {
    let script = "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK \
                  $GROUP_WORLD_SIZE $MASTER_ADDR $MASTER_PORT";
    let report = launch(&sh(3, script)).unwrap();
    assert!(report.success(), "{}", report.summary());
    assert_ne!(report.port, 0);
    for r in &report.ranks {
        let want = format!("{0} 3 {0} 3 0 1 127.0.0.1 {1}\n", r.rank, report.port);
        assert_eq!(r.stdout, want);
        assert_eq!(r.stderr, "");
    }
}

#[test]
fn fixed_master_port_and_addr() {
    let spec = sh(2, "echo $MASTER_ADDR:$MASTER_PORT")
        .master_port(29_517)
        .master_addr("localhost");
    let report = launch(&spec).unwrap();
    assert_eq!(report.port, 29_517);
    for r in &report.ranks {
        assert_eq!(r.stdout, "localhost:29517\n");
    }
}

#[test]
fn extra_env_and_inherited_env() {
    let spec = sh(
        2,
        "echo \"$CHORUS_TEST_A|$CHORUS_TEST_B\"; [ -n \"$PATH\" ]",
    )
    .env("CHORUS_TEST_A", "hello world")
    .env("CHORUS_TEST_B", "2");
    let report = launch(&spec).unwrap();
    assert!(report.success(), "{}", report.summary());
    for r in &report.ranks {
        assert_eq!(r.stdout, "hello world|2\n");
    }
}

#[test]
fn contract_overrides_extra_env() {
    let report = launch(&sh(2, "echo $RANK").env("RANK", "7")).unwrap();
    assert_eq!(report.ranks[1].stdout, "1\n");
}

#[test]
fn failure_kills_the_others() {
    let dir = scratch("failure");
    let script = format!(
        "echo $$ > {d}/tmp$RANK; mv {d}/tmp$RANK {d}/pid$RANK; \
         if [ $RANK = 2 ]; then echo 'starting'; \
           until [ -e {d}/pid0 ] && [ -e {d}/pid1 ] && [ -e {d}/pid3 ]; do sleep 0.01; done; \
           echo 'first line' >&2; echo 'boom: rank 2 gave up' >&2; exit 3; \
         fi; exec sleep 30",
        d = dir.display()
    );
    let report = launch(&sh(4, &script)).unwrap();
    assert!(!report.success());
    assert!(!report.timed_out);
    assert!(report.elapsed < Duration::from_secs(10), "{report:?}");
    let first = report.first_failure().unwrap();
    assert_eq!(first.rank, 2);
    assert_eq!(first.status, Exit::Code(3));
    assert_eq!(first.stdout, "starting\n");
    assert_eq!(first.stderr, "first line\nboom: rank 2 gave up\n");
    for r in [0, 1, 3] {
        assert_eq!(report.ranks[r].status, Exit::KilledByLauncher);
    }
    for r in 0..4 {
        assert_gone(&dir.join(format!("pid{r}")));
    }
    let summary = report.summary();
    assert!(
        summary.starts_with("rank 2 failed first: exit code 3"),
        "{summary}"
    );
    assert!(
        summary.contains("last stderr line: boom: rank 2 gave up"),
        "{summary}"
    );
    assert!(
        summary.ends_with("ranks 0, 1, 3 stopped by the launcher"),
        "{summary}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn first_failure_is_first_in_time_not_lowest_rank() {
    // Rank 3 fails; rank 0 fails too, but only after rank 3 has been reaped.
    let dir = scratch("order");
    let script = format!(
        "if [ $RANK = 3 ]; then echo $$ > {d}/tmp; mv {d}/tmp {d}/pid3; exit 1; fi; \
         if [ $RANK = 0 ]; then \
           until [ -s {d}/pid3 ]; do sleep 0.01; done; \
           while kill -0 $(cat {d}/pid3) 2>/dev/null; do sleep 0.01; done; exit 5; \
         fi; exec sleep 30",
        d = dir.display()
    );
    let report = launch(&sh(4, &script)).unwrap();
    assert_eq!(report.first_failed, Some(3));
    let first = report.first_failure().unwrap();
    assert_eq!((first.rank, first.status), (3, Exit::Code(1)));
    assert!(matches!(
        report.ranks[0].status,
        Exit::KilledByLauncher | Exit::Code(5)
    ));
    assert!(report.summary().starts_with("rank 3 failed first"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn timeout_kills_everyone() {
    let dir = scratch("timeout");
    let script = format!(
        "echo $$ > {d}/tmp$RANK; mv {d}/tmp$RANK {d}/pid$RANK; exec sleep 30",
        d = dir.display()
    );
    let spec = sh(3, &script).timeout(Duration::from_millis(500));
    let report = launch(&spec).unwrap();
    assert!(report.timed_out);
    assert!(!report.success());
    assert!(report.first_failure().is_none());
    assert!(report.elapsed >= Duration::from_millis(500));
    assert!(report.elapsed < Duration::from_secs(10), "{report:?}");
    for r in &report.ranks {
        assert_eq!(r.status, Exit::KilledByLauncher);
        // A rank that had not got as far as writing its pid when it was killed is gone too.
        let pid_file = dir.join(format!("pid{}", r.rank));
        if pid_file.exists() {
            assert_gone(&pid_file);
        }
    }
    let summary = report.summary();
    assert!(summary.starts_with("timed out after 500ms"), "{summary}");
    assert!(
        summary.ends_with("ranks still running: 0, 1, 2"),
        "{summary}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn timeout_reports_only_unfinished_ranks() {
    let spec = sh(3, "[ $RANK = 1 ] && exit 0; exec sleep 30").timeout(Duration::from_millis(300));
    let report = launch(&spec).unwrap();
    assert!(report.timed_out);
    assert_eq!(report.ranks[1].status, Exit::Code(0));
    assert!(report.summary().ends_with("ranks still running: 0, 2"));
}

#[cfg(unix)]
#[test]
fn signal_death() {
    let report = launch(&sh(3, "[ $RANK = 1 ] && kill -9 $$; exec sleep 30")).unwrap();
    let first = report.first_failure().unwrap();
    assert_eq!((first.rank, first.status), (1, Exit::Signal(9)));
    assert_eq!(report.ranks[0].status, Exit::KilledByLauncher);
    assert_eq!(report.ranks[2].status, Exit::KilledByLauncher);
    assert!(report.elapsed < Duration::from_secs(10));
    let summary = report.summary();
    assert!(
        summary.starts_with("rank 1 failed first: killed by signal 9 (SIGKILL)"),
        "{summary}"
    );
    assert!(summary.contains("no stderr output"), "{summary}");
}

#[test]
fn missing_program_is_a_spawn_error() {
    let spec = LaunchSpec::new("/nonexistent/chorus-worker", 2).output(Output::Capture);
    match launch(&spec) {
        Err(LaunchError::Spawn {
            rank,
            program,
            source,
        }) => {
            assert_eq!(rank, 0);
            assert_eq!(program, Path::new("/nonexistent/chorus-worker"));
            assert_eq!(source.kind(), io::ErrorKind::NotFound);
        }
        other => panic!("expected a spawn error, got {other:?}"),
    }
}

#[test]
fn zero_world_size_is_an_error() {
    let err = launch(&sh(0, "exit 0")).unwrap_err();
    assert!(matches!(err, LaunchError::InvalidWorldSize(0)), "{err}");
}

#[test]
fn prefixed_and_rank_zero_modes_keep_output() {
    for mode in [Output::Prefixed, Output::RankZero] {
        let spec = sh(2, "echo out$RANK; echo err$RANK >&2").output(mode);
        let report = launch(&spec).unwrap();
        assert!(report.success(), "{}", report.summary());
        for r in &report.ranks {
            assert_eq!(r.stdout, format!("out{}\n", r.rank));
            assert_eq!(r.stderr, format!("err{}\n", r.rank));
        }
    }
}

#[test]
fn large_output_and_partial_last_line() {
    // 2 MB per rank through the pipes (more than any pipe buffer) and no final newline.
    let script = "i=0; while [ $i -lt 2000 ]; do \
                  printf '%01000d\\n' $i; i=$((i+1)); done; printf tail";
    let report = launch(&sh(2, script)).unwrap();
    assert!(report.success(), "{}", report.summary());
    for r in &report.ranks {
        assert_eq!(r.stdout.len(), 2000 * 1001 + 4);
        assert!(r.stdout.ends_with("1999\ntail"));
    }
}

#[test]
fn invalid_utf8_is_lossy() {
    let report = launch(&sh(1, "printf 'a\\377b\\n'")).unwrap();
    assert_eq!(report.ranks[0].stdout, "a\u{FFFD}b\n");
}

#[test]
fn multi_node_contract_and_devices() {
    let script = "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK \
                  $GROUP_WORLD_SIZE $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS \
                  $TORCHELASTIC_RUN_ID ${CUDA_VISIBLE_DEVICES-unset} ${CHORUS_DEVICE_IDS-unset}";
    let spec = sh(3, script)
        .nodes(2, 1)
        .master_port(29_999)
        .max_restarts(4)
        .run_id("job9")
        .devices(["4", "5"]);
    assert_eq!(spec.world_size(), 6);
    let report = launch(&spec).unwrap();
    assert!(report.success(), "{}", report.summary());
    let got: Vec<&str> = report.ranks.iter().map(|r| r.stdout.as_str()).collect();
    assert_eq!(
        got,
        [
            "3 6 0 3 1 2 0 4 job9 4 4\n",
            "4 6 1 3 1 2 0 4 job9 4 4\n",
            "5 6 2 3 1 2 0 4 job9 5 5\n"
        ]
    );
    assert_eq!(
        report
            .ranks
            .iter()
            .map(|r| (r.rank, r.local_rank))
            .collect::<Vec<_>>(),
        [(3, 0), (4, 1), (5, 2)]
    );
    // Without devices nothing is set.
    let report = launch(&sh(1, script)).unwrap();
    assert_eq!(report.ranks[0].stdout, "0 1 0 1 0 1 0 0 none unset unset\n");
}

#[test]
fn bad_node_settings_are_errors() {
    let err = launch(&sh(2, "exit 0").nodes(2, 2).master_port(1)).unwrap_err();
    assert!(
        matches!(
            err,
            LaunchError::InvalidNodes {
                nnodes: 2,
                node_rank: 2
            }
        ),
        "{err}"
    );
    let err = launch(&sh(2, "exit 0").nodes(0, 0)).unwrap_err();
    assert!(matches!(err, LaunchError::InvalidNodes { .. }), "{err}");
    let err = launch(&sh(2, "exit 0").nodes(2, 0)).unwrap_err();
    assert!(matches!(err, LaunchError::MasterPortRequired(2)), "{err}");
}

#[test]
fn restarts_the_group_after_a_failure() {
    // Rank 1 fails on the first attempt only; everyone else waits to be stopped.
    let script = "if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then \
                    if [ $RANK = 1 ]; then echo 'first try fails' >&2; exit 7; fi; \
                    exec sleep 30; \
                  fi; echo attempt $TORCHELASTIC_RESTART_COUNT";
    let report = launch(&sh(3, script).max_restarts(1)).unwrap();
    assert!(report.success(), "{}", report.summary());
    assert_eq!(report.restarts, 1);
    for r in &report.ranks {
        assert_eq!(r.stdout, "attempt 1\n");
    }
    assert!(
        report.summary().ends_with("after 1 restart"),
        "{}",
        report.summary()
    );

    // Always failing: restarts run out and the last failure is reported.
    let report = launch(&sh(2, "[ $RANK = 0 ] && exit 9; exec sleep 30").max_restarts(2)).unwrap();
    assert!(!report.success());
    assert_eq!(report.restarts, 2);
    assert_eq!(report.exit_code(), 9);
    let summary = report.summary();
    assert!(
        summary.starts_with("rank 0 failed first: exit code 9"),
        "{summary}"
    );
    assert!(summary.ends_with("after 2 restarts"), "{summary}");

    // A timeout is not restarted.
    let spec = sh(1, "exec sleep 30")
        .max_restarts(3)
        .timeout(Duration::from_millis(200));
    let report = launch(&spec).unwrap();
    assert!(report.timed_out);
    assert_eq!(report.restarts, 0);
}

#[test]
fn log_files_per_rank_and_attempt() {
    let dir = scratch("logs");
    let script = "echo out $RANK $TORCHELASTIC_RESTART_COUNT; echo err $RANK >&2; \
                  [ $TORCHELASTIC_RESTART_COUNT = 0 ] && [ $LOCAL_RANK = 1 ] && exit 1; \
                  [ $TORCHELASTIC_RESTART_COUNT = 0 ] && exec sleep 30; exit 0";
    let spec = sh(2, script)
        .nodes(2, 1)
        .master_port(1)
        .max_restarts(1)
        .log_dir(&dir);
    let report = launch(&spec).unwrap();
    assert!(report.success(), "{}", report.summary());
    let read = |attempt: u32, rank: usize, stream: &str| {
        let path = dir.join(format!("attempt_{attempt}/rank{rank}.{stream}.log"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    for rank in [2, 3] {
        assert_eq!(read(1, rank, "stdout"), format!("out {rank} 1\n"));
        assert_eq!(read(1, rank, "stderr"), format!("err {rank}\n"));
    }
    assert_eq!(read(0, 3, "stdout"), "out 3 0\n");
    // A log directory that cannot be created is a launch error.
    let blocked = dir.join("file");
    std::fs::write(&blocked, "").unwrap();
    let err = launch(&sh(1, "exit 0").log_dir(&blocked)).unwrap_err();
    assert!(matches!(err, LaunchError::LogFile { .. }), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Waits (bounded) until every `pid{r}` file exists in `dir`.
fn wait_for_pids(dir: &Path, ranks: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while (0..ranks).any(|r| !dir.join(format!("pid{r}")).exists()) {
        assert!(Instant::now() < deadline, "workers did not start");
        thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(unix)]
#[test]
fn interrupt_forwards_the_signal() {
    let dir = scratch("interrupt");
    // Each worker (and its child, in the worker's own group) records the signal it got.
    let script = format!(
        "trap 'echo got TERM; echo $RANK > {d}/got$RANK; exit 42' TERM; \
         echo $$ > {d}/tmp$RANK; mv {d}/tmp$RANK {d}/pid$RANK; \
         sleep 30 & wait $!; exit 1",
        d = dir.display()
    );
    let interrupt = Interrupt::new();
    assert_eq!(interrupt.signal(), None);
    let spec = sh(3, &script)
        .interrupt(interrupt.clone())
        .own_process_group(true)
        .max_restarts(5);
    let raiser = {
        let dir = dir.clone();
        thread::spawn(move || {
            wait_for_pids(&dir, 3);
            interrupt.raise(15);
        })
    };
    let report = launch(&spec).unwrap();
    raiser.join().unwrap();
    assert_eq!(report.interrupted, Some(15));
    assert_eq!(report.restarts, 0, "an interrupt is never restarted");
    assert_eq!(report.exit_code(), 143);
    for r in &report.ranks {
        assert_eq!(r.status, Exit::Code(42), "{}", report.summary());
        assert_eq!(r.stdout, "got TERM\n");
        assert!(dir.join(format!("got{}", r.rank)).exists());
    }
    assert!(report.summary().starts_with(
        "interrupted by signal 15 (SIGTERM), forwarded to the workers; rank 0: exit code 42"
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(unix)]
#[test]
fn interrupt_kills_workers_that_ignore_it() {
    let dir = scratch("ignore");
    let script = format!(
        "trap '' INT TERM; echo $$ > {d}/tmp$RANK; mv {d}/tmp$RANK {d}/pid$RANK; \
         while :; do sleep 0.05; done",
        d = dir.display()
    );
    let interrupt = Interrupt::new();
    let spec = sh(2, &script)
        .interrupt(interrupt.clone())
        .stop_grace(Duration::from_millis(300));
    let raiser = {
        let dir = dir.clone();
        thread::spawn(move || {
            wait_for_pids(&dir, 2);
            interrupt.raise(2);
        })
    };
    let report = launch(&spec).unwrap();
    raiser.join().unwrap();
    assert_eq!(report.interrupted, Some(2));
    for r in &report.ranks {
        assert_eq!(r.status, Exit::KilledByLauncher);
        assert_gone(&dir.join(format!("pid{}", r.rank)));
    }
    assert!(report.elapsed < Duration::from_secs(20), "{report:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(unix)]
#[test]
fn a_second_interrupt_kills_at_once() {
    let dir = scratch("second");
    let script = format!(
        "trap '' INT TERM; echo $$ > {d}/tmp$RANK; mv {d}/tmp$RANK {d}/pid$RANK; \
         while :; do sleep 0.05; done",
        d = dir.display()
    );
    let interrupt = Interrupt::new();
    // No grace limit: only the second request can end the job before its timeout.
    let spec = sh(2, &script)
        .interrupt(interrupt.clone())
        .stop_grace(Duration::MAX);
    let raiser = {
        let dir = dir.clone();
        thread::spawn(move || {
            wait_for_pids(&dir, 2);
            interrupt.raise(15);
            interrupt.raise(15);
        })
    };
    let report = launch(&spec).unwrap();
    raiser.join().unwrap();
    assert!(!report.timed_out, "{}", report.summary());
    assert_eq!(report.interrupted, Some(15));
    for r in &report.ranks {
        assert_eq!(r.status, Exit::KilledByLauncher);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
