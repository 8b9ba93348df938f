//! Shared by `launcher.rs`, `mpi.rs`, `multinode.rs`, `slurm.rs` and `torchrun.rs`: where `chorusrun`, the perf
//! tools and the probe are, and running them with a bound on time.

#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use chorus::env;

/// The worker the launcher tests start.
pub const PROBE: &str = env!("CARGO_BIN_EXE_chorus-env-probe");

/// Variables a launcher sets; removed from what the tests inherit, so that only what the test
/// means to give reaches the workers.
pub const LAUNCHER_VARS: [&str; 19] = [
    env::RANK,
    env::WORLD_SIZE,
    env::LOCAL_RANK,
    env::LOCAL_WORLD_SIZE,
    env::GROUP_RANK,
    env::GROUP_WORLD_SIZE,
    env::MASTER_ADDR,
    env::MASTER_PORT,
    env::TORCHELASTIC_RESTART_COUNT,
    env::TORCHELASTIC_MAX_RESTARTS,
    env::TORCHELASTIC_RUN_ID,
    env::TORCHELASTIC_USE_AGENT_STORE,
    env::TORCHELASTIC_ERROR_FILE,
    env::OMP_NUM_THREADS,
    env::CUDA_VISIBLE_DEVICES,
    env::CHORUS_DEVICE_IDS,
    env::CHORUS_INIT_METHOD,
    env::SLURM_PROCID,
    env::OMPI_COMM_WORLD_RANK,
];

/// The `chorusrun` binary of this build, built on first use (see [`tool`]).
pub fn chorusrun() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| tool("chorusrun"))
}

/// The `allreduce_perf` binary of this build, built on first use (see [`tool`]).
pub fn allreduce_perf() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| tool("allreduce_perf"))
}

/// The binary `name` of chorus-tools in this build.
///
/// Cargo builds another package's binaries only for that package's own tests, so under
/// `cargo test` (which sets `CARGO`) this runs `cargo build --workspace --tests --bin NAME`
/// into the same target directory and profile as this test. Building the workspace's tests
/// with it resolves features as `cargo test --workspace` does, so after that command the
/// binary is fresh and nothing is built again (`-p chorus-tools` alone leaves out features
/// other members' dev-dependencies turn on, and so rebuilds the core). Run directly, it takes
/// the binary that is there.
fn tool(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    // <target>/<profile>/deps/<test>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test runs from <target>/<profile>/deps");
    let bin = profile_dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if let Some(cargo) = std::env::var_os("CARGO") {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("tests/ sits in the workspace");
        let mut cmd = Command::new(cargo);
        cmd.current_dir(workspace)
            .args(["build", "--quiet", "--workspace", "--tests", "--bin", name])
            .stdin(Stdio::null());
        match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => {}
            Some("release") => {
                cmd.arg("--release");
            }
            Some(profile) => {
                cmd.args(["--profile", profile]);
            }
        }
        if let Some(target) = profile_dir.parent() {
            cmd.env("CARGO_TARGET_DIR", target);
        }
        let out = cmd.output().expect("cannot run cargo to build a tool");
        assert!(
            out.status.success(),
            "building {name} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(
        bin.exists(),
        "{} not found: build it with `cargo build -p chorus-tools --bin {name}`",
        bin.display()
    );
    bin
}

/// A command for `chorusrun args..` with the launcher variables removed from its environment.
pub fn chorusrun_cmd<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut cmd = Command::new(chorusrun());
    clean_env(&mut cmd);
    cmd.args(args);
    cmd
}

/// Removes the launcher variables from `cmd`'s environment.
pub fn clean_env(cmd: &mut Command) {
    for var in LAUNCHER_VARS {
        cmd.env_remove(var);
    }
}

/// How a process ended, with its output.
#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    /// Panics, showing the output, unless the process exited with `code`.
    pub fn assert_code(&self, code: i32) -> &Self {
        assert_eq!(
            self.status.code(),
            Some(code),
            "expected exit code {code}, got {}\n--- stdout:\n{}\n--- stderr:\n{}",
            self.status,
            self.stdout,
            self.stderr
        );
        self
    }

    /// Panics, showing the output, unless `needle` is in stderr.
    pub fn assert_stderr_has(&self, needle: &str) -> &Self {
        assert!(
            self.stderr.contains(needle),
            "stderr should contain {needle:?}:\n{}",
            self.stderr
        );
        self
    }
}

/// The perf tool's arguments: 8 B to 2 KiB, a few iterations.
pub const PERF_ARGS: [&str; 10] = ["-b", "8", "-e", "2K", "-f", "16", "-n", "3", "-w", "1"];

/// Checks an `allreduce_perf` table from `n` ranks: every rank listed, every size checked with
/// no wrong value.
pub fn assert_perf_table(run: &Finished, n: usize) {
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

/// Checks that a launch of the probe's `allreduce` succeeded on every one of `n` ranks, placed
/// `per_node` to a node in rank order, each reporting its own rank and agreeing on the world
/// (the probe checked the sums itself).
pub fn assert_every_rank_reduced_on(run: &Finished, n: usize, per_node: usize) {
    run.assert_code(0);
    let mut lines: Vec<&str> = run
        .stdout
        .lines()
        .filter_map(|l| l.find("allreduce ok").map(|i| &l[i..]))
        .collect();
    lines.sort();
    let want: Vec<String> = (0..n)
        .map(|r| {
            let local = r % per_node;
            format!("allreduce ok rank={r} world={n} local_rank={local} local_world={per_node}")
        })
        .collect();
    assert_eq!(
        lines, want,
        "stdout:\n{}\nstderr:\n{}",
        run.stdout, run.stderr
    );
}

/// A started process whose output is being collected; stopped if dropped while running.
pub struct Running {
    child: Child,
    out: Option<JoinHandle<String>>,
    err: Option<JoinHandle<String>>,
    what: String,
}

/// Starts `cmd` with piped output and no input.
pub fn start(mut cmd: Command) -> Running {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            String::from_utf8_lossy(&bytes).into_owned()
        })
    };
    let out = child.stdout.take().map(|p| drain(Box::new(p)));
    let err = child.stderr.take().map(|p| drain(Box::new(p)));
    Running {
        child,
        out,
        err,
        what,
    }
}

impl Running {
    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process has ended (it is reaped if so).
    pub fn has_ended(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits for the process, at most `limit`; past that, stops it and panics with its output.
    pub fn wait(mut self, limit: Duration) -> Finished {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait on child") {
                break status;
            }
            if Instant::now() >= deadline {
                self.stop();
                let (stdout, stderr) = self.output();
                panic!(
                    "{} did not finish within {limit:?}\n--- stdout:\n{stdout}\n--- stderr:\n{stderr}",
                    self.what
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let (stdout, stderr) = self.output();
        Finished {
            status,
            stdout,
            stderr,
        }
    }

    /// Output collected so far (waits for the pipes to close, so only after the process ended).
    fn output(&mut self) -> (String, String) {
        let join = |h: Option<JoinHandle<String>>| h.map(|h| h.join().unwrap_or_default());
        (
            join(self.out.take()).unwrap_or_default(),
            join(self.err.take()).unwrap_or_default(),
        )
    }

    /// SIGTERM (chorusrun then stops its workers), and SIGKILL if it is still there after 15 s.
    fn stop(&mut self) {
        if self.has_ended() {
            return;
        }
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(15);
        while !self.has_ended() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A fresh scratch directory for one test (removed again when dropped).
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("chorus-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a scratch directory");
        Scratch(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits (at most 30 s) until every one of `files` exists; panics naming the missing ones.
pub fn wait_for_files(files: &[PathBuf]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let missing: Vec<&PathBuf> = files.iter().filter(|f| !f.exists()).collect();
        if missing.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "never appeared: {missing:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}
