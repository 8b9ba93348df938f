//! Chorus programs under the real MPI launchers, side by side as Debian installs them: Open
//! MPI's `mpirun` (`openmpi-bin`, as `mpirun.openmpi`) and MPICH's hydra `mpiexec` (`mpich`, as
//! `mpiexec.hydra`), at 2 and 4 ranks, with nothing exported but what the README's launch
//! section says: `MASTER_ADDR` and `MASTER_PORT` for Open MPI (`-x`), nothing for hydra (rank 0's
//! address goes through hydra's PMI-1 server, over `PMI_FD` or, with `-pmi-port`, `PMI_PORT`).
//!
//! A launcher that is not installed makes its tests print `skipping: ... not installed` and
//! return. Every run is bounded in time.

mod chorusrun_support;

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use chorus_launch::PortReservation;
use chorusrun_support::{allreduce_perf, clean_env, start, Finished, PROBE};

/// Bound on one launch (the ranks' own timeout is Chorus's default; this stops them first).
const LIMIT: Duration = Duration::from_secs(120);

/// An MPI launcher found on `PATH`.
struct Launcher {
    path: PathBuf,
}

impl Launcher {
    /// The first of `names` on `PATH` whose `--version` mentions one of `marks`; `None`, after
    /// printing a skip line naming `what` and `package`, when none is.
    fn find(what: &str, names: &[&str], marks: &[&str], package: &str) -> Option<Launcher> {
        let path = std::env::var_os("PATH").unwrap_or_default();
        let found = names.iter().find_map(|name| {
            std::env::split_paths(&path)
                .map(|dir| dir.join(name))
                .filter(|exe| exe.is_file())
                .find(|exe| {
                    let mut cmd = Command::new(exe);
                    cmd.arg("--version");
                    let run = start(cmd).wait(LIMIT);
                    let text = format!("{}{}", run.stdout, run.stderr);
                    marks.iter().any(|mark| text.contains(mark))
                })
        });
        if found.is_none() {
            // Written to stderr itself, past the test harness's capture.
            let _ = writeln!(
                std::io::stderr(),
                "skipping: {what} is not installed (none of {names:?} on PATH is it; apt-get \
                 install {package})"
            );
        }
        found.map(|path| Launcher { path })
    }

    /// A command for this launcher with `args`, the launcher variables removed from its
    /// environment.
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.path);
        clean_env(&mut cmd);
        cmd.args(args);
        cmd
    }
}

/// Open MPI's `mpirun`.
fn open_mpi() -> Option<Launcher> {
    Launcher::find(
        "Open MPI's mpirun",
        &["mpirun.openmpi", "mpirun"],
        &["Open MPI", "OpenRTE"],
        "openmpi-bin",
    )
}

/// MPICH's hydra `mpiexec`.
fn hydra() -> Option<Launcher> {
    Launcher::find(
        "MPICH's hydra mpiexec",
        &["mpiexec.hydra", "mpiexec.mpich", "mpiexec"],
        &["HYDRA"],
        "mpich",
    )
}

/// `mpirun -n N rest..` for this machine: `--allow-run-as-root` as root (CI), and
/// `--oversubscribe` since it may have fewer cores than ranks.
fn mpirun_n(mpirun: &Launcher, n: usize, rest: &[&str]) -> Command {
    let count = n.to_string();
    let mut args = vec!["--oversubscribe", "-n", &count];
    if nix::unistd::geteuid().is_root() {
        args.insert(0, "--allow-run-as-root");
    }
    args.extend(rest);
    mpirun.command(&args)
}

/// Checks that a launch of the probe's `allreduce` succeeded on every one of `n` ranks, each
/// reporting its own rank and agreeing on the world (the probe checked the sums itself).
fn assert_every_rank_reduced(run: &Finished, n: usize) {
    run.assert_code(0);
    let mut lines: Vec<&str> = run
        .stdout
        .lines()
        .filter_map(|l| l.find("allreduce ok").map(|i| &l[i..]))
        .collect();
    lines.sort();
    let want: Vec<String> = (0..n)
        .map(|r| format!("allreduce ok rank={r} world={n} local_rank={r} local_world={n}"))
        .collect();
    assert_eq!(
        lines, want,
        "stdout:\n{}\nstderr:\n{}",
        run.stdout, run.stderr
    );
}

/// Checks an `allreduce_perf` table from `n` ranks: every rank listed, every size checked with
/// no wrong value.
fn assert_perf_table(run: &Finished, n: usize) {
    run.assert_code(0);
    let out = &run.stdout;
    let mut ranks: Vec<usize> = out
        .lines()
        .filter_map(|l| l.strip_prefix("#  Rank"))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .collect();
    ranks.sort_unstable();
    assert_eq!(ranks, (0..n).collect::<Vec<_>>(), "{out}");
    let rows: Vec<Vec<&str>> = out
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 3, "sizes 8, 128 and 2048:\n{out}");
    for row in &rows {
        assert_eq!(row.len(), 13, "{row:?}");
        assert_eq!((row[8], row[12]), ("0", "0"), "wrong values: {row:?}");
    }
    assert!(out.contains("# Out of bounds values : 0 OK"), "{out}");
}

/// The perf tool's arguments: 8 B to 2 KiB, a few iterations.
const PERF_ARGS: [&str; 10] = ["-b", "8", "-e", "2K", "-f", "16", "-n", "3", "-w", "1"];

#[test]
fn open_mpi_mpirun_with_master_addr_and_port_exported() {
    let Some(mpirun) = open_mpi() else { return };
    for n in [2, 4] {
        let reserved = PortReservation::new("127.0.0.1").unwrap();
        let rest = [
            "-x",
            "MASTER_ADDR",
            "-x",
            "MASTER_PORT",
            PROBE,
            "allreduce",
            "1000",
        ];
        let mut cmd = mpirun_n(&mpirun, n, &rest);
        cmd.env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", reserved.port().to_string());
        assert_every_rank_reduced(&start(cmd).wait(LIMIT), n);
    }
    // The NAME=value form, running the perf tool.
    let reserved = PortReservation::new("127.0.0.1").unwrap();
    let port = format!("MASTER_PORT={}", reserved.port());
    let perf = allreduce_perf().to_str().unwrap();
    let mut rest = vec!["-x", "MASTER_ADDR=127.0.0.1", "-x", &port, perf];
    rest.extend(PERF_ARGS);
    assert_perf_table(&start(mpirun_n(&mpirun, 2, &rest)).wait(LIMIT), 2);
}

#[test]
fn open_mpi_without_the_exports_says_how_to_export_them() {
    let Some(mpirun) = open_mpi() else { return };
    let run = start(mpirun_n(&mpirun, 2, &[PROBE, "allreduce", "10"])).wait(LIMIT);
    assert_ne!(run.status.code(), Some(0), "{run:?}");
    let text = format!("{}{}", run.stdout, run.stderr);
    for needle in [
        "MASTER_ADDR=\"\": not set: Open MPI (found OMPI_COMM_WORLD_RANK=",
        "mpirun -x MASTER_ADDR=HOST -x MASTER_PORT=PORT",
    ] {
        assert!(text.contains(needle), "{needle:?} missing in:\n{text}");
    }
}

#[test]
fn hydra_mpiexec_with_nothing_exported() {
    let Some(mpiexec) = hydra() else { return };
    // PMI_FD (hydra's default) at 2 and 4 ranks, and PMI_PORT (-pmi-port, where the rank and
    // size come through PMI only) at 4.
    for (flags, n) in [(&[][..], 2), (&[][..], 4), (&["-pmi-port"][..], 4)] {
        let count = n.to_string();
        let mut args = flags.to_vec();
        args.extend(["-n", &count, PROBE, "allreduce", "1000"]);
        let mut cmd = mpiexec.command(&args);
        cmd.env("CHORUS_DEBUG", "chorus=info");
        let run = start(cmd).wait(LIMIT);
        assert_every_rank_reduced(&run, n);
        // Every rank found rank 0 through PMI.
        let through_pmi = run
            .stderr
            .lines()
            .filter(|l| l.contains("store address through PMI"))
            .count();
        assert_eq!(through_pmi, n, "{flags:?}:\n{}", run.stderr);
    }
    let mut args = vec!["-n", "4", allreduce_perf().to_str().unwrap()];
    args.extend(PERF_ARGS);
    assert_perf_table(&start(mpiexec.command(&args)).wait(LIMIT), 4);
}

#[test]
fn hydra_mpiexec_with_master_addr_and_port_given() {
    let Some(mpiexec) = hydra() else { return };
    let reserved = PortReservation::new("127.0.0.1").unwrap();
    let port = reserved.port().to_string();
    let args = [
        "-n",
        "2",
        "-genv",
        "MASTER_ADDR",
        "127.0.0.1",
        "-genv",
        "MASTER_PORT",
        &port,
        PROBE,
        "allreduce",
        "1000",
    ];
    let mut cmd = mpiexec.command(&args);
    cmd.env("CHORUS_DEBUG", "chorus=info");
    let run = start(cmd).wait(LIMIT);
    assert_every_rank_reduced(&run, 2);
    assert!(!run.stderr.contains("through PMI"), "{}", run.stderr);
    assert!(
        run.stderr.contains(&format!("127.0.0.1:{port}")),
        "{}",
        run.stderr
    );
}

#[test]
fn hydra_stops_the_job_when_rank_0_cannot_bind_its_store() {
    let Some(mpiexec) = hydra() else { return };
    // MASTER_PORT alone picks rank 0's port and still leaves the address to PMI; here it is
    // taken.
    let busy = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let args = [
        "-n",
        "2",
        "-genv",
        "MASTER_PORT",
        &port,
        PROBE,
        "allreduce",
        "10",
    ];
    let run = start(mpiexec.command(&args)).wait(LIMIT);
    assert_ne!(run.status.code(), Some(0), "{run:?}");
    let want = format!("cannot listen on 0.0.0.0:{port} for the rendezvous store");
    assert!(
        run.stderr.contains(&want),
        "{want:?} missing in:\n{}",
        run.stderr
    );
}
