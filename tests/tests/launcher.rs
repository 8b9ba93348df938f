//! `chorusrun` on real processes: the environment each worker gets, prefixed output, stopping
//! everyone on a failure, restarts, signal forwarding, per-rank log files, a real all-reduce
//! across two chorusrun "nodes" on loopback, and rendezvous through a file, SLURM's and Open
//! MPI's variables. Every process is bounded in time.

mod chorusrun_support;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use chorus_launch::PortReservation;
use chorusrun_support::{
    chorusrun_cmd, clean_env, start, wait_for_files, Finished, Scratch, PROBE,
};

/// Bound on one chorusrun run.
const LIMIT: Duration = Duration::from_secs(90);

/// Runs `chorusrun args..` to the end (bounded).
fn chorusrun(args: &[&str]) -> Finished {
    start(chorusrun_cmd(args)).wait(LIMIT)
}

/// The `probe ...` lines of stdout, by the `[rankN]: ` prefix's rank: VAR -> value.
fn parse_probes(stdout: &str) -> BTreeMap<usize, BTreeMap<String, String>> {
    let mut by_rank = BTreeMap::new();
    for line in stdout.lines() {
        let Some(rest) = line.strip_prefix("[rank") else {
            continue;
        };
        let (rank, text) = rest.split_once("]: ").expect("a [rankN]: prefix");
        let Some(vars) = text.strip_prefix("probe ") else {
            continue;
        };
        let vars = vars
            .split(' ')
            .map(|kv| {
                let (k, v) = kv.split_once('=').expect("VAR=value");
                (k.to_string(), v.to_string())
            })
            .collect();
        let rank: usize = rank.parse().expect("a rank number");
        assert!(by_rank.insert(rank, vars).is_none(), "rank {rank} twice");
    }
    by_rank
}

fn get<'a>(vars: &'a BTreeMap<String, String>, key: &str) -> &'a str {
    vars.get(key)
        .unwrap_or_else(|| panic!("{key} missing in {vars:?}"))
}

#[test]
fn standalone_workers_get_the_contract_and_prefixed_output() {
    let run = chorusrun(&[
        "--standalone",
        "--nproc-per-node",
        "3",
        "--gpus-per-node",
        "2",
        PROBE,
        "env",
    ]);
    run.assert_code(0);
    let probes = parse_probes(&run.stdout);
    assert_eq!(probes.len(), 3, "{}", run.stdout);
    let port = get(&probes[&0], "MASTER_PORT").to_string();
    assert_ne!(port, "-");
    assert_ne!(port, "0");
    // 3 ranks on 2 GPUs: ranks 0 and 1 share GPU 0.
    let gpus = ["0", "0", "1"];
    for (rank, vars) in &probes {
        let want = [
            ("RANK", rank.to_string()),
            ("LOCAL_RANK", rank.to_string()),
            ("GROUP_RANK", "0".into()),
            ("WORLD_SIZE", "3".into()),
            ("LOCAL_WORLD_SIZE", "3".into()),
            ("GROUP_WORLD_SIZE", "1".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.clone()),
            ("TORCHELASTIC_RESTART_COUNT", "0".into()),
            ("TORCHELASTIC_MAX_RESTARTS", "0".into()),
            ("TORCHELASTIC_RUN_ID", "none".into()),
            ("OMP_NUM_THREADS", "1".into()),
            ("CUDA_VISIBLE_DEVICES", gpus[*rank].into()),
            ("CHORUS_DEVICE_IDS", gpus[*rank].into()),
        ];
        for (key, value) in want {
            assert_eq!(get(vars, key), value, "rank {rank}: {key}");
        }
        let line = format!("[rank{rank}]: probe stderr {rank}\n");
        assert!(run.stderr.contains(&line), "{line:?} in:\n{}", run.stderr);
    }
    // torchrun's notice, once.
    assert_eq!(run.stderr.matches("Setting OMP_NUM_THREADS").count(), 1);

    // A set OMP_NUM_THREADS is kept, without the notice; no GPUs given, none set.
    let mut cmd = chorusrun_cmd(["--standalone", "--gpus-per-node", "0", PROBE, "env"]);
    cmd.env("OMP_NUM_THREADS", "4");
    let run = start(cmd).wait(LIMIT);
    run.assert_code(0);
    let probes = parse_probes(&run.stdout);
    assert_eq!(get(&probes[&0], "OMP_NUM_THREADS"), "4");
    assert_eq!(get(&probes[&0], "CUDA_VISIBLE_DEVICES"), "-");
    assert_eq!(get(&probes[&0], "CHORUS_DEVICE_IDS"), "-");
    assert!(
        !run.stderr.contains("Setting OMP_NUM_THREADS"),
        "{}",
        run.stderr
    );
}

#[test]
fn second_node_ranks_and_torchrun_spellings() {
    // Node 1 of 2: ranks 2 and 3. Nothing connects, so node 0 need not exist.
    let run = chorusrun(&[
        "--nnodes=2",
        "--node_rank=1",
        "--nproc_per_node=2",
        "--master_addr=10.1.2.3",
        "--master_port=29511",
        "--max_restarts=2",
        "--run_id=job42",
        "--gpus-per-node=4",
        PROBE,
        "env",
    ]);
    run.assert_code(0);
    let probes = parse_probes(&run.stdout);
    assert_eq!(probes.keys().copied().collect::<Vec<_>>(), [2, 3]);
    for (rank, gpus) in [(2, "0,1"), (3, "2,3")] {
        let vars = &probes[&rank];
        assert_eq!(get(vars, "LOCAL_RANK"), (rank - 2).to_string());
        assert_eq!(get(vars, "GROUP_RANK"), "1");
        assert_eq!(get(vars, "WORLD_SIZE"), "4");
        assert_eq!(get(vars, "LOCAL_WORLD_SIZE"), "2");
        assert_eq!(get(vars, "GROUP_WORLD_SIZE"), "2");
        assert_eq!(get(vars, "MASTER_ADDR"), "10.1.2.3");
        assert_eq!(get(vars, "MASTER_PORT"), "29511");
        assert_eq!(get(vars, "TORCHELASTIC_MAX_RESTARTS"), "2");
        assert_eq!(get(vars, "TORCHELASTIC_RUN_ID"), "job42");
        assert_eq!(get(vars, "CUDA_VISIBLE_DEVICES"), gpus);
        assert_eq!(get(vars, "CHORUS_DEVICE_IDS"), gpus);
    }
}

#[test]
fn bad_flags_are_clear_errors() {
    chorusrun(&["--nnodes", "2", "--node-rank", "2", PROBE, "env"])
        .assert_code(1)
        .assert_stderr_has("--node-rank 2 is not below --nnodes 2");
    chorusrun(&["--standalone", "--nnodes", "2", PROBE, "env"])
        .assert_code(1)
        .assert_stderr_has("--standalone runs a single node");
    chorusrun(&["--standalone", "/nonexistent/chorus-program"])
        .assert_code(1)
        .assert_stderr_has("failed to start rank 0 (/nonexistent/chorus-program)");
    chorusrun(&["--nnodes", "1:2", PROBE]).assert_code(2);
}

/// Whether process `pid` still runs: it exists and is not a zombie (Linux; elsewhere assumes
/// it is gone).
fn exists(pid: &str) -> bool {
    let stat = std::fs::read_to_string(Path::new("/proc").join(pid.trim()).join("stat"));
    // The state follows the command's closing parenthesis.
    stat.is_ok_and(|s| {
        s.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

#[test]
fn a_failing_worker_stops_the_others() {
    let dir = Scratch::new("launcher-fail");
    let d = dir.path().to_str().unwrap();
    let run = chorusrun(&[
        "--standalone",
        "--nproc-per-node",
        "3",
        PROBE,
        "fail",
        "1",
        "5",
        d,
    ]);
    run.assert_code(5)
        .assert_stderr_has("[rank1]: env_probe: rank 1 fails on purpose with code 5")
        .assert_stderr_has("chorusrun: rank 1 failed first: exit code 5")
        .assert_stderr_has("ranks 0, 2 stopped by the launcher");
    for rank in [0, 2] {
        let pid = std::fs::read_to_string(dir.path().join(format!("pid{rank}"))).unwrap();
        assert!(!exists(&pid), "rank {rank} (pid {pid}) still runs");
    }
}

#[test]
fn workers_die_with_a_killed_launcher() {
    let dir = Scratch::new("launcher-killed");
    let d = dir.path().to_str().unwrap();
    // There is no rank 9: both workers write their pid and wait (60 s) to be stopped.
    let running = start(chorusrun_cmd([
        "--standalone",
        "--nproc-per-node",
        "2",
        PROBE,
        "fail",
        "9",
        "5",
        d,
    ]));
    let files: Vec<_> = (0..2).map(|r| dir.path().join(format!("pid{r}"))).collect();
    wait_for_files(&files);
    let pid = nix::unistd::Pid::from_raw(running.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
    running.wait(LIMIT);
    for (rank, file) in files.iter().enumerate() {
        let pid = std::fs::read_to_string(file).unwrap();
        // The kernel kills them as the launcher dies; the bound only keeps a failure finite.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while exists(&pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            !exists(&pid),
            "rank {rank} (pid {pid}) outlived its killed launcher"
        );
    }
}

#[test]
fn restarts_after_a_failure() {
    // Rank 1 fails while TORCHELASTIC_RESTART_COUNT=0; the restarted group succeeds.
    let run = chorusrun(&[
        "--standalone",
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "1",
        PROBE,
        "fail-once",
        "1",
    ]);
    run.assert_code(0)
        .assert_stderr_has("rank 1 failed first: exit code 7")
        .assert_stderr_has("restarting the workers (restart 1 of 1)");
    for rank in 0..3 {
        let line = format!("[rank{rank}]: attempt 1 ok\n");
        assert!(run.stdout.contains(&line), "{line:?} in:\n{}", run.stdout);
    }
    // Without restarts the failure is final.
    chorusrun(&[
        "--standalone",
        "--nproc-per-node",
        "2",
        PROBE,
        "fail-once",
        "1",
    ])
    .assert_code(7)
    .assert_stderr_has("chorusrun: rank 1 failed first: exit code 7");
}

#[test]
fn sigterm_is_forwarded_to_the_workers() {
    let dir = Scratch::new("launcher-signal");
    let d = dir.path().to_str().unwrap();
    let running = start(chorusrun_cmd([
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        PROBE,
        "signal",
        d,
    ]));
    wait_for_files(&[dir.path().join("ready0"), dir.path().join("ready1")]);
    let pid = nix::unistd::Pid::from_raw(running.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    // Bounded: chorusrun must end by itself well within this.
    let run = running.wait(Duration::from_secs(30));
    run.assert_code(128 + 15)
        .assert_stderr_has(
            "chorusrun: interrupted by signal 15 (SIGTERM), forwarded to the workers",
        )
        .assert_stderr_has("rank 0: exit code 42, rank 1: exit code 42");
    for rank in 0..2 {
        let got = std::fs::read_to_string(dir.path().join(format!("got{rank}"))).unwrap();
        assert_eq!(got, "SIGTERM", "rank {rank}");
        let line = format!("[rank{rank}]: rank {rank} got SIGTERM\n");
        assert!(run.stdout.contains(&line), "{line:?} in:\n{}", run.stdout);
    }
    assert!(
        !run.stderr.contains("restarting"),
        "an interrupt is not restarted:\n{}",
        run.stderr
    );
}

#[test]
fn log_dir_holds_each_ranks_output() {
    let dir = Scratch::new("launcher-logs");
    let logs = dir.path().join("logs");
    let run = chorusrun(&[
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        logs.to_str().unwrap(),
        PROBE,
        "env",
    ]);
    run.assert_code(0);
    for rank in 0..2 {
        let read = |stream: &str| {
            let path = logs.join(format!("attempt_0/rank{rank}.{stream}.log"));
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        };
        let out = read("stdout");
        assert!(out.starts_with(&format!("probe RANK={rank} ")), "{out}");
        assert_eq!(out.lines().count(), 1);
        assert_eq!(read("stderr"), format!("probe stderr {rank}\n"));
    }
    // Output still goes to the terminal, prefixed.
    assert!(
        run.stdout.contains("[rank1]: probe RANK=1 "),
        "{}",
        run.stdout
    );
}

/// The `allreduce ok` lines of some outputs, sorted.
fn all_reduce_lines(outputs: &[&str]) -> Vec<String> {
    let mut lines: Vec<String> = outputs
        .iter()
        .flat_map(|o| o.lines())
        .filter_map(|l| l.find("allreduce ok").map(|i| l[i..].to_string()))
        .collect();
    lines.sort();
    lines
}

#[test]
fn all_reduce_across_two_chorusrun_nodes_on_loopback() {
    // Held until both nodes are done: the port stays for rank 0's store.
    let reserved = PortReservation::new("127.0.0.1").unwrap();
    let port = reserved.port().to_string();
    let node = |rank: &str| {
        let mut cmd = chorusrun_cmd([
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "--timeout",
            "60",
            PROBE,
            "allreduce",
            "10000",
        ]);
        cmd.env("CHORUS_TIMEOUT", "30");
        start(cmd)
    };
    let (node0, node1) = (node("0"), node("1"));
    let (run0, run1) = (node0.wait(LIMIT), node1.wait(LIMIT));
    run0.assert_code(0);
    run1.assert_code(0);
    assert_eq!(
        all_reduce_lines(&[&run0.stdout, &run1.stdout]),
        (0..4)
            .map(|r| format!(
                "allreduce ok rank={r} world=4 local_rank={} local_world=2",
                r % 2
            ))
            .collect::<Vec<_>>()
    );
    assert!(
        run1.stdout.contains("[rank3]: allreduce ok rank=3"),
        "{}",
        run1.stdout
    );
}

#[test]
fn a_world_size_typo_fails_at_once_naming_the_limit() {
    // Address space capped at 4 GiB: before WORLD_SIZE was bounded this grew past 11 GB.
    let reserved = PortReservation::new("127.0.0.1").unwrap();
    let mut cmd = Command::new("sh");
    clean_env(&mut cmd);
    cmd.args(["-c", "ulimit -v 4194304 && exec \"$0\" allreduce 8", PROBE])
        .env("RANK", "0")
        .env("WORLD_SIZE", "1000000000")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", reserved.port().to_string())
        .env("CHORUS_TIMEOUT", "5");
    start(cmd).wait(LIMIT).assert_code(1).assert_stderr_has(
        "invalid configuration: WORLD_SIZE=\"1000000000\": must be at most 1048576",
    );
}

#[test]
fn rendezvous_through_a_shared_file() {
    let dir = Scratch::new("launcher-file");
    let file = dir.path().join("rendezvous");
    let mut cmd = chorusrun_cmd([
        "--standalone",
        "--nproc-per-node",
        "3",
        PROBE,
        "allreduce",
        "100",
    ]);
    cmd.env("CHORUS_INIT_METHOD", format!("file://{}", file.display()))
        .env("CHORUS_TIMEOUT", "30");
    let run = start(cmd).wait(LIMIT);
    run.assert_code(0);
    assert_eq!(all_reduce_lines(&[&run.stdout]).len(), 3, "{}", run.stdout);
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.starts_with("chorus-rendezvous-v1 run=none/0 addr=127.0.0.1 port="),
        "{text}"
    );
}

/// A port in `lo..hi` that nothing held a moment ago, reserved for the job's store.
fn reserve_port_between(lo: u16, hi: u16) -> PortReservation {
    let span = u32::from(hi - lo);
    let start = std::process::id() % span;
    (0..span)
        .map(|i| lo + ((start + i) % span) as u16)
        .find_map(|port| {
            // Fails while anything listens on the port or holds it without SO_REUSEADDR.
            drop(TcpListener::bind(("0.0.0.0", port)).ok()?);
            PortReservation::at("127.0.0.1", port).ok()
        })
        .expect("a free port")
}

/// Starts one probe per environment directly (no chorusrun) and checks every all-reduce.
fn run_group(world: usize, env_of: impl Fn(usize) -> Vec<(&'static str, String)>) {
    let procs: Vec<_> = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(PROBE);
            clean_env(&mut cmd);
            cmd.args(["allreduce", "1000"]).env("CHORUS_TIMEOUT", "30");
            cmd.envs(env_of(rank));
            start(cmd)
        })
        .collect();
    let runs: Vec<Finished> = procs.into_iter().map(|p| p.wait(LIMIT)).collect();
    for run in &runs {
        run.assert_code(0);
    }
    let outputs: Vec<&str> = runs.iter().map(|r| r.stdout.as_str()).collect();
    assert_eq!(all_reduce_lines(&outputs).len(), world, "{outputs:?}");
}

#[test]
fn rendezvous_from_slurm_variables() {
    // As `srun -N1 -n3` sets them; the port comes from the job id.
    let reserved = reserve_port_between(10_000, 30_000);
    let job_id = (u32::from(reserved.port()) - 10_000 + 20_000 * 7).to_string();
    run_group(3, |rank| {
        vec![
            ("SLURM_PROCID", rank.to_string()),
            ("SLURM_NTASKS", "3".into()),
            ("SLURM_LOCALID", rank.to_string()),
            ("SLURM_NODEID", "0".into()),
            ("SLURM_TASKS_PER_NODE", "3".into()),
            ("SLURM_JOB_NODELIST", "127.0.0.1".into()),
            ("SLURM_JOB_ID", job_id.clone()),
        ]
    });
}

#[test]
fn rendezvous_from_open_mpi_variables() {
    let reserved = PortReservation::new("127.0.0.1").unwrap();
    let port = reserved.port().to_string();
    run_group(2, |rank| {
        vec![
            ("OMPI_COMM_WORLD_RANK", rank.to_string()),
            ("OMPI_COMM_WORLD_SIZE", "2".into()),
            ("OMPI_COMM_WORLD_LOCAL_RANK", rank.to_string()),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.clone()),
        ]
    });
    // Without MASTER_*: an error that says what was found and what to set.
    let mut cmd = Command::new(PROBE);
    clean_env(&mut cmd);
    cmd.args(["allreduce", "1"]).envs([
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ]);
    start(cmd)
        .wait(LIMIT)
        .assert_code(1)
        .assert_stderr_has("MASTER_ADDR")
        .assert_stderr_has("Open MPI (found OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2");
}

#[test]
fn example_scripts_are_valid_shell() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let scripts = [
        "mpirun.sh",
        "slurm/srun_2x2.sbatch",
        "slurm/chorusrun_2x2.sbatch",
        "slurm/mpirun_2x2.sbatch",
    ];
    for script in scripts {
        let path = examples.join(script);
        assert!(path.exists(), "{} is missing", path.display());
        let mut cmd = Command::new("bash");
        cmd.arg("-n").arg(&path);
        start(cmd).wait(LIMIT).assert_code(0);
    }
}

/// With `--survive` a worker's death does not stop the others: they shrink their
/// communicator, finish, and the job succeeds. Without it the death stops the job, whose
/// code is the dead worker's (128 + SIGKILL).
#[test]
fn with_survive_the_others_go_on_after_a_worker_dies() {
    let worker = env!("CARGO_BIN_EXE_chorus-test-worker");
    let args = ["--standalone", "--nproc-per-node", "3"];
    let job = [worker, "shrink", "1"];
    let run = chorusrun(&[&args[..], &["--survive"], &job].concat());
    run.assert_code(0)
        .assert_stderr_has("the job went on without ranks [1]");
    for rank in [0, 2] {
        let done = format!("[rank{rank}]: survived 1");
        assert!(
            run.stdout.contains(&done),
            "{done:?} missing:\n{}",
            run.stdout
        );
    }
    chorusrun(&[&args[..], &job].concat()).assert_code(128 + 9);
}
