//! Chorus programs under a real SLURM (Debian's `slurm-wlm`, tested with 22.05.8, and `munge`):
//! each test writes a `slurm.conf` of its own into a scratch directory, starts `munged`,
//! `slurmctld` and one `slurmd` per node in the foreground as its children (stopped by a guard,
//! also when the test fails) and submits with `srun` and `sbatch` under a private
//! `SLURM_CONF`. No cgroups (`proctrack/linuxproc`, `task/none`); the controller and daemons
//! listen on free ports; the first job id is picked so that the Chorus store port derived from
//! it (`10000 + SLURM_JOB_ID % 20000`) is free.
//!
//! One node (`localhost`) runs `srun -n 2` and `-n 4`, and `srun -n 2` in an
//! `sbatch --ntasks-per-node=4` job (a step smaller than its job). Two nodes are two network namespaces of
//! `netns_support` (the controller and the submitting commands in the first), each with its own
//! `slurmd`; the nodes are named by their addresses, so that the node list SLURM hands the
//! ranks (`10.77.0.[10-11]`) names a host they reach. There `srun -N 2 --ntasks-per-node 2`
//! and the three batch scripts of `examples/slurm/` run across both nodes, adapted to this
//! cluster (see [`adapt`]).
//!
//! Without the SLURM programs, or not as root (slurmd runs jobs as their user; namespaces need
//! root and iproute2), a test prints `skipping: ...` and returns. Every wait is bounded.

mod chorusrun_support;
mod netns_support;

use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use chorusrun_support::{
    allreduce_perf, assert_every_rank_reduced_on, assert_perf_table, chorusrun, clean_env, start,
    Finished, Scratch, PERF_ARGS, PROBE,
};
use netns_support::{cluster, Cluster};

/// Bound on one job, and on the cluster coming up.
const LIMIT: Duration = Duration::from_secs(60);

/// Held by a running cluster: the tests run one cluster at a time, so that each job has the
/// machine's cores to itself.
static ONE_CLUSTER: Mutex<()> = Mutex::new(());

/// The programs the tests run, with the Debian package that has them.
const PROGRAMS: [(&str, &str); 8] = [
    ("munged", "munge"),
    ("slurmctld", "slurmctld"),
    ("slurmd", "slurmd"),
    ("srun", "slurm-client"),
    ("sbatch", "slurm-client"),
    ("sinfo", "slurm-client"),
    ("scontrol", "slurm-client"),
    ("scancel", "slurm-client"),
];

/// `name` on `PATH` or in the system directories (slurmctld, slurmd and munged are in
/// `/usr/sbin`).
fn program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|exe| exe.is_file())
}

/// Prints (past the test harness's capture) why a test does not run.
fn skip(why: &str) {
    let _ = writeln!(std::io::stderr(), "skipping: {why}");
}

/// Whether SLURM can run here; prints why not otherwise.
fn usable() -> bool {
    let missing: Vec<String> = PROGRAMS
        .iter()
        .filter(|(name, _)| program(name).is_none())
        .map(|(name, package)| format!("{name} ({package})"))
        .collect();
    if !missing.is_empty() {
        skip(&format!(
            "SLURM is not installed: {} missing (apt-get install slurm-wlm munge)",
            missing.join(", ")
        ));
        return false;
    }
    if !nix::unistd::geteuid().is_root() {
        skip("SLURM's slurmd needs root to run jobs");
        return false;
    }
    true
}

/// A free TCP port (in the namespace this test runs in; the nodes' own namespaces are empty).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("0.0.0.0:0").expect("bind a free port");
    listener.local_addr().unwrap().port()
}

/// A first job id whose store port (and the next few, one per job) is free here.
fn first_job_id() -> u64 {
    static TRIES: AtomicU64 = AtomicU64::new(0);
    for _ in 0..1000 {
        let seed = u64::from(std::process::id()) * 7919 + TRIES.fetch_add(1, Ordering::Relaxed);
        let id = 1 + seed % 19_000;
        // The ports of jobs id..id+4: 10000 + id % 20000, below 30000.
        let free = (id..id + 5).all(|j| {
            std::net::TcpListener::bind(("0.0.0.0", 10_000 + (j % 20_000) as u16)).is_ok()
        });
        if free {
            return id;
        }
    }
    panic!("no 5 free ports in a row between 10001 and 29005");
}

/// A daemon started by a test: its output goes to a log file; SIGTERM, then SIGKILL after 10 s,
/// when dropped.
struct Daemon {
    child: Child,
    name: String,
    log: PathBuf,
}

impl Daemon {
    /// Starts `cmd` as daemon `name`, logging to `dir/NAME.log`.
    fn start(name: &str, mut cmd: Command, dir: &Path) -> Daemon {
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log).expect("create a daemon log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        Daemon {
            child,
            name: name.to_string(),
            log,
        }
    }

    /// The name and the log's last lines.
    fn report(&self) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(15)..].join("\n");
        format!("--- {} ({}):\n{tail}\n", self.name, self.log.display())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        end(&mut self.child);
    }
}

/// Waits up to 10 s for `child` to exit, then kills it.
fn end(child: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A node of the test cluster: its SLURM name, address and network namespace (`None`: this
/// one).
struct Node {
    name: String,
    addr: String,
    ns: Option<String>,
}

/// `program args..` run in network namespace `ns` (only the network: `ip netns exec` would
/// also remount `/sys`, hiding the cgroup filesystem slurmd looks at).
fn in_ns(ns: Option<&str>, program: &Path) -> Command {
    match ns {
        Some(ns) => {
            let mut cmd = Command::new("nsenter");
            cmd.arg(format!("--net=/run/netns/{ns}")).arg(program);
            cmd
        }
        None => Command::new(program),
    }
}

/// A running SLURM cluster; its daemons stop (slurmd, slurmctld, then munged) when dropped.
/// One at a time: the tests hold [`ONE_CLUSTER`] while theirs runs.
struct Slurm {
    /// munged first.
    daemons: Vec<Daemon>,
    conf: PathBuf,
    /// Where the controller runs and jobs are submitted from: the first node's namespace.
    submit_ns: Option<String>,
    scratch: Scratch,
    /// The namespaces, removed after the daemons stopped.
    _cluster: Option<Cluster>,
    /// Released last.
    _one: MutexGuard<'static, ()>,
}

impl Slurm {
    /// Starts munged, slurmctld on the first node and a slurmd per node (in `cluster`'s
    /// namespaces, if any) for `test`, and waits (at most [`LIMIT`]) until every node is idle;
    /// panics with the daemons' logs if they do not come up.
    fn start(
        test: &str,
        one: MutexGuard<'static, ()>,
        nodes: Vec<Node>,
        cluster: Option<Cluster>,
    ) -> Slurm {
        // The tools are built before the daemons start.
        let _ = allreduce_perf();
        let scratch = Scratch::new(&format!("slurm-{test}"));
        let dir = scratch.path().to_path_buf();
        // munged wants its socket's directory searchable by all and its key readable by it
        // only.
        let munge = dir.join("munge");
        fs::create_dir(&munge).unwrap();
        fs::set_permissions(&munge, fs::Permissions::from_mode(0o755)).unwrap();
        let key = munge.join("munge.key");
        let mut bytes = vec![0u8; 1024];
        File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
            .expect("read /dev/urandom");
        fs::write(&key, &bytes).unwrap();
        fs::set_permissions(&key, fs::Permissions::from_mode(0o400)).unwrap();
        let socket = munge.join("munge.socket");
        let mut cmd = Command::new(program("munged").unwrap());
        cmd.arg("--foreground")
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--key-file={}", key.display()))
            .arg(format!("--log-file={}", munge.join("munged.log").display()))
            .arg(format!("--pid-file={}", munge.join("munged.pid").display()))
            .arg(format!(
                "--seed-file={}",
                munge.join("munged.seed").display()
            ));
        let mut slurm = Slurm {
            daemons: vec![Daemon::start("munged", cmd, &dir)],
            conf: dir.join("slurm.conf"),
            submit_ns: nodes[0].ns.clone(),
            scratch,
            _cluster: cluster,
            _one: one,
        };
        slurm.wait_until("munged's socket", |_| socket.exists());

        fs::create_dir(dir.join("state")).unwrap();
        for node in &nodes {
            fs::create_dir_all(dir.join("spool").join(&node.name)).unwrap();
        }
        // slurmctld runs only where the host name is its SlurmctldHost.
        let host = fs::read_to_string("/proc/sys/kernel/hostname").expect("the host name");
        let node_lines: String = nodes
            .iter()
            .map(|n| format!("NodeName={} NodeAddr={} CPUs=4\n", n.name, n.addr))
            .collect();
        let conf = format!(
            "ClusterName=chorus\n\
             SlurmctldHost={host}({ctl})\n\
             SlurmctldPort={ctl_port}\n\
             SlurmdPort={d_port}\n\
             AuthType=auth/munge\n\
             CredType=cred/munge\n\
             AuthInfo=socket={socket}\n\
             SlurmUser=root\n\
             SlurmdUser=root\n\
             StateSaveLocation={dir}/state\n\
             SlurmdSpoolDir={dir}/spool/%n\n\
             SlurmctldPidFile={dir}/slurmctld.pid\n\
             SlurmdPidFile={dir}/spool/%n/slurmd.pid\n\
             ProctrackType=proctrack/linuxproc\n\
             TaskPlugin=task/none\n\
             JobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\n\
             SelectType=select/cons_tres\n\
             SelectTypeParameters=CR_CPU\n\
             SlurmdParameters=config_overrides\n\
             MpiDefault=none\n\
             ReturnToService=2\n\
             FirstJobId={first_job}\n\
             {node_lines}\
             PartitionName=chorus Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n",
            host = host.trim(),
            ctl = nodes[0].addr,
            ctl_port = free_port(),
            d_port = free_port(),
            socket = socket.display(),
            dir = dir.display(),
            first_job = first_job_id(),
        );
        fs::write(&slurm.conf, conf).unwrap();

        let mut ctld = in_ns(nodes[0].ns.as_deref(), &program("slurmctld").unwrap());
        ctld.arg("-D").arg("-f").arg(&slurm.conf);
        slurm.daemons.push(Daemon::start("slurmctld", ctld, &dir));
        for node in &nodes {
            let mut slurmd = in_ns(node.ns.as_deref(), &program("slurmd").unwrap());
            slurmd.arg("-D").arg("-f").arg(&slurm.conf);
            slurmd.arg("-N").arg(&node.name);
            let name = format!("slurmd-{}", node.name);
            slurm.daemons.push(Daemon::start(&name, slurmd, &dir));
        }
        let want = nodes.len();
        slurm.wait_until("every node idle", |slurm| {
            let run = start(slurm.command("sinfo", &["-h", "-N", "-o", "%t"])).wait(LIMIT);
            run.stdout.lines().filter(|l| l.trim() == "idle").count() == want
        });
        slurm
    }

    /// One node, `localhost`, in this namespace.
    fn local(test: &str) -> Option<Slurm> {
        let one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
        usable().then(|| {
            let node = Node {
                name: "localhost".into(),
                addr: "127.0.0.1".into(),
                ns: None,
            };
            Slurm::start(test, one, vec![node], None)
        })
    }

    /// `n` nodes, one per network namespace, each named by its address.
    fn across(test: &str, n: usize) -> Option<Slurm> {
        let one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
        if !usable() {
            return None;
        }
        let cluster = cluster(n)?;
        let nodes = (0..n)
            .map(|i| Node {
                name: Cluster::addr(i),
                addr: Cluster::addr(i),
                ns: Some(cluster.nodes[i].clone()),
            })
            .collect();
        Some(Slurm::start(test, one, nodes, Some(cluster)))
    }

    /// Polls `ready` until it holds, at most [`LIMIT`]; panics with the daemons' logs past
    /// that, or when a daemon has exited.
    fn wait_until(&mut self, what: &str, mut ready: impl FnMut(&Slurm) -> bool) {
        let deadline = Instant::now() + LIMIT;
        loop {
            if ready(self) {
                return;
            }
            let exited = self
                .daemons
                .iter_mut()
                .any(|d| !matches!(d.child.try_wait(), Ok(None)));
            if exited || Instant::now() >= deadline {
                let logs: String = self.daemons.iter().map(Daemon::report).collect();
                let why = if exited {
                    "a daemon exited"
                } else {
                    "timed out"
                };
                panic!("waiting for {what}: {why}\n{logs}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// A SLURM client command (`srun`, `sbatch`, ...) for this cluster: its `SLURM_CONF`,
    /// run where the controller is, in the scratch directory, with no launcher or SLURM
    /// variables inherited.
    fn command(&self, name: &str, args: &[&str]) -> Command {
        let exe = program(name).unwrap_or_else(|| panic!("{name} is not installed"));
        let mut cmd = in_ns(self.submit_ns.as_deref(), &exe);
        clean_env(&mut cmd);
        for (var, _) in std::env::vars_os() {
            if var.to_string_lossy().starts_with("SLURM") {
                cmd.env_remove(var);
            }
        }
        cmd.env("SLURM_CONF", &self.conf)
            .current_dir(self.scratch.path())
            .args(args);
        cmd
    }

    /// The daemons' logs, for a failure message.
    fn logs(&self) -> String {
        self.daemons.iter().map(Daemon::report).collect()
    }

    /// Submits `script` with `sbatch --wait` (bounded by [`LIMIT`]) and returns sbatch's exit
    /// status with the job's output (its `-o` file) as stdout.
    fn batch(&self, script: &str) -> Finished {
        let path = self.scratch.path().join("job.sbatch");
        fs::write(&path, script).unwrap();
        let out = self.scratch.path().join("job.out");
        let args = [
            "--wait",
            "-o",
            out.to_str().unwrap(),
            path.to_str().unwrap(),
        ];
        let run = start(self.command("sbatch", &args)).wait(LIMIT);
        Finished {
            status: run.status,
            stdout: fs::read_to_string(&out).unwrap_or_default(),
            stderr: format!("{}{}\n{}", run.stdout, run.stderr, self.logs()),
        }
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        // A job a failed test left behind ends with the cluster (slurmd leaves its steps be).
        if self.daemons.len() > 1 {
            let mut scancel = self.command("scancel", &["--user=root"]);
            scancel.stdout(Stdio::null()).stderr(Stdio::null());
            if let Ok(mut child) = scancel.spawn() {
                end(&mut child);
            }
        }
        while let Some(daemon) = self.daemons.pop() {
            drop(daemon);
        }
    }
}

/// Runs `srun args.. allreduce_perf` and checks the table of `n` ranks.
fn srun_perf(slurm: &Slurm, args: &[&str], n: usize) {
    let perf = allreduce_perf().to_str().unwrap();
    let mut all = args.to_vec();
    all.push(perf);
    all.extend(PERF_ARGS);
    let mut run = start(slurm.command("srun", &all)).wait(LIMIT);
    run.stderr.push_str(&slurm.logs());
    assert_perf_table(&run, n);
}

#[test]
fn srun_on_one_node() {
    let Some(slurm) = Slurm::local("srun-local") else {
        return;
    };
    for n in [2, 4] {
        srun_perf(&slurm, &["-n", &n.to_string()], n);
    }
    // A step smaller than its job: the job's --ntasks-per-node=4 stays in the step's
    // SLURM_NTASKS_PER_NODE, the step's own layout is SLURM_STEP_TASKS_PER_NODE=2.
    let script = format!(
        "#!/bin/bash\n#SBATCH -N 1\n#SBATCH --ntasks-per-node=4\nsrun -n 2 {PROBE} allreduce 1000\n"
    );
    assert_every_rank_reduced_on(&slurm.batch(&script), 2, 2);
}

#[test]
fn srun_across_two_nodes() {
    let Some(slurm) = Slurm::across("srun-nodes", 2) else {
        return;
    };
    let layout = ["-N", "2", "--ntasks-per-node", "2"];
    srun_perf(&slurm, &layout, 4);
    // Ranks 2 and 3 reach rank 0's store on the first node's address.
    let mut args = layout.to_vec();
    args.extend([PROBE, "allreduce", "1000"]);
    let mut run = start(slurm.command("srun", &args)).wait(LIMIT);
    run.stderr.push_str(&slurm.logs());
    assert_every_rank_reduced_on(&run, 4, 2);
}

/// `examples/slurm/NAME` for this cluster and build: no `--gres` line (the nodes have no
/// GPUs), the binaries of this build in place of `./target/release/`, the perf tool's sizes
/// cut to [`PERF_ARGS`], and Open MPI's `mpirun` by the path `mpirun_path` gives (as root it
/// also needs `--allow-run-as-root`). The node and task counts stay: the cluster has 2 nodes.
fn adapt(name: &str, mpirun_path: Option<&Path>) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/slurm")
        .join(name);
    let script = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let bin_dir = format!("{}/", allreduce_perf().parent().unwrap().display());
    let script: String = script
        .lines()
        .filter(|l| !l.starts_with("#SBATCH --gres"))
        .map(|l| format!("{l}\n"))
        .collect();
    let mut script = script
        .replace("./target/release/", &bin_dir)
        .replace("-b 8 -e 128M -f 2", &PERF_ARGS.join(" "));
    if let Some(mpirun) = mpirun_path {
        let with = format!("{} --allow-run-as-root -np", mpirun.display());
        script = script.replace("mpirun -np", &with);
    }
    script
}

#[test]
fn sbatch_srun_2x2() {
    let Some(slurm) = Slurm::across("sbatch-srun", 2) else {
        return;
    };
    assert_perf_table(&slurm.batch(&adapt("srun_2x2.sbatch", None)), 4);
}

#[test]
fn sbatch_chorusrun_2x2() {
    // Built before the job needs it.
    let _ = chorusrun();
    let Some(slurm) = Slurm::across("sbatch-chorusrun", 2) else {
        return;
    };
    let mut run = slurm.batch(&adapt("chorusrun_2x2.sbatch", None));
    // The workers' lines, which chorusrun tags with `[rankN]: ` (the job's output also has
    // chorusrun's own notices).
    run.stdout = run
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("[rank")?.split_once("]: "))
        .map(|(_, line)| format!("{line}\n"))
        .collect();
    assert_perf_table(&run, 4);
}

#[test]
fn sbatch_mpirun_2x2() {
    let Some(mpirun) = program("mpirun.openmpi") else {
        skip("Open MPI's mpirun.openmpi is not installed (apt-get install openmpi-bin)");
        return;
    };
    let Some(slurm) = Slurm::across("sbatch-mpirun", 2) else {
        return;
    };
    assert_perf_table(&slurm.batch(&adapt("mpirun_2x2.sbatch", Some(&mpirun))), 4);
}
