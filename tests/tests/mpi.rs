//! Chorus programs under the real MPI launchers, side by side as Debian installs them: Open
//! MPI's `mpirun` (`openmpi-bin`, as `mpirun.openmpi`) and MPICH's hydra `mpiexec` (`mpich`, as
//! `mpiexec.hydra`), at 2 and 4 ranks, with nothing exported but what docs/launching.md
//! says: `MASTER_ADDR` and `MASTER_PORT` for Open MPI (`-x`), nothing for hydra (rank 0's
//! address goes through hydra's PMI-1 server, over `PMI_FD` or, with `-pmi-port`, `PMI_PORT`).
//!
//! Across two network-namespace nodes (as root with iproute2, see `netns_support`) each
//! launcher starts its remote daemons through an agent script that enters the node's namespace
//! in place of ssh (Open MPI's `plm_rsh_agent`, hydra's `-launcher-exec`).
//!
//! A launcher that is not installed makes its tests print `skipping: ... not installed` and
//! return; the namespace tests also print `skipping: needs root and iproute2` without those.
//! Every run is bounded in time.

mod chorusrun_support;
mod netns_support;

use std::ffi::OsStr;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use chorus_launch::PortReservation;
use chorusrun_support::{
    allreduce_perf, assert_every_rank_reduced_on, assert_perf_table, clean_env, start, Finished,
    Scratch, PERF_ARGS, PROBE,
};
use netns_support::{cluster, Cluster};

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
    fn command<S: AsRef<OsStr>>(&self, args: &[S]) -> Command {
        let mut cmd = Command::new(&self.path);
        clean_env(&mut cmd);
        cmd.args(args);
        cmd
    }

    /// The same, run inside network namespace `ns` (a node of a [`Cluster`]).
    fn command_in<S: AsRef<OsStr>>(&self, ns: &str, args: &[S]) -> Command {
        let mut cmd = Command::new("ip");
        clean_env(&mut cmd);
        cmd.args(["netns", "exec", ns]).arg(&self.path).args(args);
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
    mpirun.command(&open_mpi_args(n, rest))
}

/// The arguments of [`mpirun_n`].
fn open_mpi_args(n: usize, rest: &[&str]) -> Vec<String> {
    let root = nix::unistd::geteuid().is_root();
    let flags = root.then_some("--allow-run-as-root").into_iter();
    let flags = flags.chain(["--oversubscribe", "-n"]).map(String::from);
    let flags = flags.chain([n.to_string()]);
    flags.chain(rest.iter().map(|a| a.to_string())).collect()
}

/// Checks that a launch of the probe's `allreduce` succeeded on every one of `n` ranks, each
/// reporting its own rank and agreeing on the world (the probe checked the sums itself).
fn assert_every_rank_reduced(run: &Finished, n: usize) {
    assert_every_rank_reduced_on(run, n, n);
}

/// Writes a program that stands in for ssh to the cluster's nodes: `AGENT [-opts] HOST CMD..`
/// runs `CMD..` with `sh -c` (as ssh's remote shell would) in the namespace whose address is
/// `HOST`. Open MPI's `plm_rsh_agent` and hydra's `-launcher-exec` start their daemons with it.
fn namespace_agent(cluster: &Cluster, dir: &Path) -> PathBuf {
    let cases: String = cluster
        .nodes
        .iter()
        .enumerate()
        .map(|(i, ns)| format!("{}) ns={ns} ;;\n", Cluster::addr(i)))
        .collect();
    let script = format!(
        "#!/bin/sh\n# Options (hydra's -x) come before the host.\n\
         while [ \"${{1#-}}\" != \"$1\" ]; do shift; done\n\
         case \"$1\" in\n{cases}*) echo \"no such node: $1\" >&2; exit 1 ;;\nesac\n\
         shift\nexec ip netns exec \"$ns\" sh -c \"$*\"\n"
    );
    let agent = dir.join("agent");
    std::fs::write(&agent, script).unwrap();
    let mut perms = std::fs::metadata(&agent).unwrap().permissions();
    perms.set_mode(0o755);
    std::fs::set_permissions(&agent, perms).unwrap();
    agent
}

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
    // taken. Bounded by LIMIT, well below the ranks' own timeout: rank 1 must not wait it out.
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
    // Rank 0 says why; rank 1 learns through PMI that rank 0 failed, and stops at once.
    for want in [
        format!("cannot listen on 0.0.0.0:{port} for the rendezvous store"),
        "rank 0 could not host the rendezvous store".to_string(),
    ] {
        assert!(
            run.stderr.contains(&want),
            "{want:?} missing in:\n{}",
            run.stderr
        );
    }
}

#[test]
fn under_hydra_a_rank_0_that_exits_before_its_rendezvous_stops_the_others_in_their_timeout() {
    let Some(mpiexec) = hydra() else { return };
    // Hydra does not stop a job whose process exits outside a PMI session, so rank 1 learns
    // nothing of rank 0's exit: its wait is bounded by CHORUS_TIMEOUT, and its error says so.
    let args = [
        "-genv",
        "CHORUS_TIMEOUT",
        "3",
        "-n",
        "1",
        "false",
        ":",
        "-n",
        "1",
        PROBE,
        "allreduce",
        "10",
    ];
    let run = start(mpiexec.command(&args)).wait(LIMIT);
    assert_ne!(run.status.code(), Some(0), "{run:?}");
    let want = "waiting for rank 0 to publish its address: no answer within 3s (a rank that \
                exits before its rendezvous, rank 0 included, does not stop a hydra job";
    assert!(
        run.stderr.contains(want),
        "{want:?} missing in:\n{}",
        run.stderr
    );
}

#[test]
fn open_mpi_across_two_namespace_nodes() {
    let Some(mpirun) = open_mpi() else { return };
    let Some(cluster) = cluster(2) else { return };
    let scratch = Scratch::new("mpi-agent-openmpi");
    let agent = namespace_agent(&cluster, scratch.path());
    let hosts = format!("{}:2,{}:2", Cluster::addr(0), Cluster::addr(1));
    let rest = [
        "--mca",
        "plm_rsh_agent",
        agent.to_str().unwrap(),
        "-H",
        &hosts,
        "-x",
        "MASTER_ADDR",
        "-x",
        "MASTER_PORT",
        PROBE,
        "allreduce",
        "1000",
    ];
    // mpirun on node 0, with the port inside node 0's own namespace.
    let mut cmd = mpirun.command_in(&cluster.nodes[0], &open_mpi_args(4, &rest));
    cmd.env("MASTER_ADDR", Cluster::addr(0))
        .env("MASTER_PORT", "29500");
    assert_every_rank_reduced_on(&start(cmd).wait(LIMIT), 4, 2);
}

#[test]
fn hydra_across_two_namespace_nodes_with_nothing_exported() {
    let Some(mpiexec) = hydra() else { return };
    let Some(cluster) = cluster(2) else { return };
    let scratch = Scratch::new("mpi-agent-hydra");
    let agent = namespace_agent(&cluster, scratch.path());
    let hosts = format!("{},{}", Cluster::addr(0), Cluster::addr(1));
    let args = [
        "-launcher",
        "ssh",
        "-launcher-exec",
        agent.to_str().unwrap(),
        "-hosts",
        &hosts,
        "-n",
        "4",
        "-ppn",
        "2",
        PROBE,
        "allreduce",
        "1000",
    ];
    let mut cmd = mpiexec.command_in(&cluster.nodes[0], &args);
    cmd.env("CHORUS_DEBUG", "chorus=info");
    let run = start(cmd).wait(LIMIT);
    assert_every_rank_reduced_on(&run, 4, 2);
    // Rank 0 published node 0's address as mpiexec named it (not the host name every
    // namespace shares).
    let published: Vec<&str> = run
        .stderr
        .lines()
        .filter(|l| l.contains("store address through PMI"))
        .collect();
    assert_eq!(published.len(), 4, "{}", run.stderr);
    for line in published {
        assert!(line.contains(&Cluster::addr(0)), "{line}");
    }
}
