//! Chorus against torch itself: `TorchStore` and a Python `torch.distributed.TCPStore` reading
//! each other's keys (libuv and classic servers), the perf tool under `torchrun --standalone`,
//! and a `torchrun --max-restarts 1` job whose rank fails in the first attempt (the restart
//! must not read the failed attempt's keys; torchrun's summary must show the error file),
//! torchrun's c10d rendezvous across two network-namespace nodes, and the DDP tutorial's
//! ToyModel on the torch backend `chorus` under `torchrun --standalone`.
//!
//! Needs a Python with torch 2.x: `CHORUS_TORCH_PYTHON` names it, else `python3` is tried.
//! Without one each test prints "skipping: needs torch >= 2 ..." and passes (the c10d test
//! also needs root and iproute2 for its nodes, and says so without them). Every process is
//! bounded in time.

mod chorusrun_support;
mod netns_support;

use std::io::Write;
use std::process::Command;
use std::time::Duration;

use chorus_launch::PortReservation;
use chorus_transport::store::{Store, StoreError, TorchStore};
use chorusrun_support::{
    allreduce_perf, clean_env, start, wait_for_files, Finished, Running, Scratch, PROBE,
};
use netns_support::{cluster, Cluster};

/// Bound on one Python or torchrun run.
const LIMIT: Duration = Duration::from_secs(120);
/// What libstdc++ prints when torch's gloo backend aborts while it tears down.
const GLOO_TEARDOWN_ABORT: &str = "terminate called without an active exception";
/// Bound on every TorchStore request and on the workers' collectives.
const STORE_TIMEOUT: Duration = Duration::from_secs(60);

/// The Python that has torch 2.x, or `None` after printing (past the harness's capture) why
/// the test skips.
fn torch_python() -> Option<String> {
    let python =
        std::env::var(chorus::env::CHORUS_TORCH_PYTHON).unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python)
        .args(["-c", "import torch; print(torch.__version__)"])
        .output();
    let why = match probe {
        Ok(out) if out.status.success() => {
            let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
            let major = version
                .split('.')
                .next()
                .and_then(|m| m.parse::<u32>().ok());
            if major.is_some_and(|m| m >= 2) {
                return Some(python);
            }
            format!("{python} has torch {version}")
        }
        Ok(_) => format!("{python} cannot import torch"),
        Err(e) => format!("cannot run {python}: {e}"),
    };
    let _ = writeln!(
        std::io::stderr(),
        "skipping: needs torch >= 2 ({why}; set CHORUS_TORCH_PYTHON to a python that has it)"
    );
    None
}

/// The Python side of the store test: a TCPStore server (argument: `libuv` or `classic`) that
/// publishes its port in a file (second argument), then trades keys with the Rust client.
const STORE_SCRIPT: &str = r#"
import datetime, os, sys
from torch.distributed import TCPStore
kind, port_file = sys.argv[1], sys.argv[2]
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                 use_libuv=(kind == "libuv"), timeout=datetime.timedelta(seconds=60))
with open(port_file + ".tmp", "w") as f:
    f.write(str(store.port))
os.rename(port_file + ".tmp", port_file)
store.set("py/key", b"from python")
store.set("py/bin", bytes(range(256)) * 1024)
store.wait(["rust/key"])
assert store.get("rust/key") == b"from rust", store.get("rust/key")
assert store.get("rust/big") == bytes(range(256)) * 4096
assert store.add("counter", 5) == 7
store.set("py/added", b"")
store.wait(["rust/done"])
print("python ok", kind, flush=True)
"#;

#[test]
fn torchstore_and_torchs_tcpstore_read_each_others_keys() {
    let Some(python) = torch_python() else {
        return;
    };
    for kind in ["libuv", "classic"] {
        let scratch = Scratch::new(&format!("torch-store-{kind}"));
        let port_file = scratch.path().join("port");
        let mut cmd = Command::new(&python);
        cmd.args(["-c", STORE_SCRIPT, kind])
            .arg(&port_file)
            .env("PYTHONUNBUFFERED", "1");
        let server = start(cmd);
        wait_for_files(std::slice::from_ref(&port_file));
        let port: u16 = std::fs::read_to_string(&port_file)
            .unwrap()
            .parse()
            .unwrap();

        let store = TorchStore::connect("127.0.0.1", port, STORE_TIMEOUT).unwrap();
        assert_eq!(store.get("py/key").unwrap(), b"from python", "{kind}");
        let pattern: Vec<u8> = (0..=255u8).collect();
        assert_eq!(store.get("py/bin").unwrap(), pattern.repeat(1024), "{kind}");
        assert_eq!(store.add("counter", 2).unwrap(), 2, "{kind}");
        store.set("rust/big", &pattern.repeat(4096)).unwrap();
        store.set("rust/key", b"from rust").unwrap();
        store.wait(&["py/added"], STORE_TIMEOUT).unwrap();
        // ADD keeps its value as decimal text, as torch does.
        assert_eq!(store.get("counter").unwrap(), b"7", "{kind}");
        assert_eq!(store.add("counter", 0).unwrap(), 7, "{kind}");
        // A wait that runs out is cancelled, names what is missing, and the store goes on.
        let err = store
            .wait(&["py/key", "never"], Duration::from_millis(300))
            .unwrap_err();
        assert!(
            matches!(&err, StoreError::Timeout { keys, .. } if keys == &["never"]),
            "{kind}: {err}"
        );
        store.set("rust/done", b"").unwrap();

        let run = server.wait(LIMIT);
        run.assert_code(0);
        assert!(run.stdout.contains(&format!("python ok {kind}")), "{run:?}");
    }
}

/// `python -m torch.distributed.run args..` (torchrun) with the launcher variables removed
/// and every Chorus wait bounded, run to the end.
fn torchrun(python: &str, args: &[&str]) -> Finished {
    let mut cmd = Command::new(python);
    clean_env(&mut cmd);
    cmd.args(["-m", "torch.distributed.run"])
        .args(args)
        .env("CHORUS_TIMEOUT", STORE_TIMEOUT.as_secs().to_string())
        .env("PYTHONUNBUFFERED", "1");
    start(cmd).wait(LIMIT)
}

#[test]
fn the_perf_tool_runs_under_torchrun_standalone() {
    let Some(python) = torch_python() else {
        return;
    };
    let perf = allreduce_perf().to_str().expect("a UTF-8 path");
    let common = ["--standalone", "--nproc-per-node", "2", "--no-python", perf];
    let mut args = common.to_vec();
    args.extend(["-b", "8", "-e", "256K", "-f", "8", "-n", "2", "-w", "1"]);
    let run = torchrun(&python, &args);
    run.assert_code(0);
    assert!(
        run.stdout.contains("# Out of bounds values : 0 OK"),
        "{run:?}"
    );

    // A failure reaches torchrun's summary through the error file.
    let mut args = common.to_vec();
    args.extend(["-n", "0"]);
    let run = torchrun(&python, &args);
    assert_ne!(run.status.code(), Some(0), "{run:?}");
    run.assert_stderr_has("error_file")
        .assert_stderr_has("traceback : allreduce_perf: -n and -m must be at least 1");
}

/// torchrun's dynamic rendezvous (`--rdzv-backend c10d`) over two network-namespace nodes of
/// two ranks each, running the perf tool with every result checked. The namespaces share this
/// machine's name, which resolves to 127.0.0.1: the endpoint's node is told it hosts the
/// rendezvous (`is_host`), and without `--local-addr` the agents name `localhost` for the
/// store, which the second node's ranks cannot reach; they fail saying to set it.
#[test]
fn torchrun_c10d_rendezvous_spans_two_namespace_nodes() {
    let Some(python) = torch_python() else {
        return;
    };
    let Some(cluster) = cluster(2) else { return };
    let perf = allreduce_perf().to_str().expect("a UTF-8 path");
    let endpoint = format!("{}:29400", Cluster::addr(0));
    let job = |local_addr: bool, timeout: &str| -> Vec<Finished> {
        let running: Vec<Running> = (0..2)
            .map(|i| {
                let mut cmd = Command::new("ip");
                clean_env(&mut cmd);
                cmd.args(["netns", "exec", &cluster.nodes[i], &python])
                    .args(["-m", "torch.distributed.run", "--nnodes", "2"])
                    .args(["--nproc-per-node", "2", "--rdzv-backend", "c10d"])
                    .args(["--rdzv-endpoint", &endpoint, "--rdzv-id", "c10d-test"])
                    .args([
                        "--rdzv-conf",
                        if i == 0 { "is_host=1" } else { "is_host=0" },
                    ]);
                if local_addr {
                    cmd.args(["--local-addr", &Cluster::addr(i)]);
                }
                cmd.args(["--no-python", perf, "-b", "8", "-e", "256K", "-f", "32"])
                    .args(["-n", "2", "-w", "1", "-c", "1"])
                    .env("CHORUS_TIMEOUT", timeout)
                    .env("PYTHONUNBUFFERED", "1");
                start(cmd)
            })
            .collect();
        running.into_iter().map(|r| r.wait(LIMIT)).collect()
    };

    let runs = job(true, &STORE_TIMEOUT.as_secs().to_string());
    for run in &runs {
        run.assert_code(0);
    }
    assert!(
        runs[0].stdout.contains("# Out of bounds values : 0 OK")
            && runs[0].stdout.contains("#  Rank  3 "),
        "{:?}",
        runs[0]
    );

    let runs = job(false, "10");
    assert_ne!(runs[1].status.code(), Some(0), "{:?}", runs[1]);
    runs[1]
        .assert_stderr_has("MASTER_ADDR=\"localhost\"")
        .assert_stderr_has("start torchrun with --local-addr");
}

#[test]
fn a_restarted_torchrun_attempt_starts_afresh_and_failures_are_summarised() {
    let Some(python) = torch_python() else {
        return;
    };
    // Held while torchrun runs: its agent's store binds it (with SO_REUSEADDR, as torch does).
    let reserved = PortReservation::new("127.0.0.1").unwrap();
    let port = reserved.port().to_string();
    let job = |restarts: &str| {
        let args = [
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "--max-restarts",
            restarts,
            "--no-python",
            PROBE,
            "elastic",
            "1",
        ];
        torchrun(&python, &args)
    };

    // The agent's store outlives attempt 0; attempt 1 must not read its keys.
    let run = job("1");
    run.assert_code(0);
    for rank in 0..2 {
        for line in [
            format!("attempt 0 joined rank={rank}"),
            format!("attempt 1 joined rank={rank}"),
            format!("attempt 1 ok rank={rank}"),
        ] {
            assert!(run.stdout.contains(&line), "{line:?} missing: {run:?}");
        }
    }

    let run = job("0");
    assert_ne!(run.status.code(), Some(0), "{run:?}");
    run.assert_stderr_has("traceback : env_probe: rank 1 fails on purpose in attempt 0");
}

/// The parameter norm each rank of `python/examples/ddp_toy.py` reports, by rank (read from
/// anywhere in the output: the two ranks' lines may interleave).
fn ddp_norms(run: &Finished) -> Vec<(usize, f64)> {
    let mut norms: Vec<(usize, f64)> = run
        .stdout
        .split("rank = ")
        .filter_map(|part| {
            let (rank, rest) = part.split_once(": trained")?;
            let norm = rest.split("parameter norm ").nth(1)?;
            let norm: String = norm
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            Some((rank.trim().parse().ok()?, norm.parse().ok()?))
        })
        .collect();
    norms.sort_by_key(|&(rank, _)| rank);
    norms
}

#[test]
fn ddp_trains_on_the_chorus_backend_under_torchrun_as_on_gloo() {
    let Some(python) = torch_python() else {
        return;
    };
    let scratch = Scratch::new("torchrun-ddp");
    chorus_tests::torch_package(scratch.path());
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../python/examples/ddp_toy.py");
    let train = |backend: &str| {
        let mut cmd = Command::new(&python);
        clean_env(&mut cmd);
        cmd.args([
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
        ])
        .args([example, "--backend", backend, "--steps", "20"])
        .env("PYTHONPATH", scratch.path())
        .env("CHORUS_TIMEOUT", STORE_TIMEOUT.as_secs().to_string())
        .env("PYTHONUNBUFFERED", "1");
        start(cmd).wait(LIMIT)
    };
    let norms = |backend: &str, run: &Finished| {
        run.assert_code(0);
        let norms = ddp_norms(run);
        assert_eq!(
            norms.iter().map(|&(rank, _)| rank).collect::<Vec<_>>(),
            [0, 1],
            "{backend}: {run:?}"
        );
        norms
    };
    let chorus = norms("chorus", &train("chorus"));
    // Torch's gloo backend now and then aborts in its own teardown, after training
    // ("terminate called without an active exception"); only that reference run is retried.
    let mut reference = train("gloo");
    for _ in 0..2 {
        if reference.status.success() || !reference.stderr.contains(GLOO_TEARDOWN_ABORT) {
            break;
        }
        let _ = writeln!(
            std::io::stderr(),
            "note: the gloo reference run aborted in torch's teardown; running it again"
        );
        reference = train("gloo");
    }
    let gloo = norms("gloo", &reference);
    for ((rank, ours), (_, theirs)) in chorus.iter().zip(&gloo) {
        assert!(
            (ours - theirs).abs() <= 1e-4 * theirs.abs().max(1.0),
            "rank {rank}: chorus ends at norm {ours}, gloo at {theirs}"
        );
    }
    // DDP keeps the replicas equal.
    assert_eq!(chorus[0].1, chorus[1].1, "{chorus:?}");
}
