//! The launcher: runs `nproc_per_node` copies of a worker program on this host, as node
//! `node_rank` of a job of `nnodes` nodes.
//!
//! Every worker gets torchrun's environment contract ([`MASTER_ADDR`](env::MASTER_ADDR), [`MASTER_PORT`](env::MASTER_PORT),
//! [`RANK`](env::RANK), [`WORLD_SIZE`](env::WORLD_SIZE), [`LOCAL_RANK`](env::LOCAL_RANK), [`LOCAL_WORLD_SIZE`](env::LOCAL_WORLD_SIZE),
//! [`GROUP_RANK`](env::GROUP_RANK), [`GROUP_WORLD_SIZE`](env::GROUP_WORLD_SIZE), [`TORCHELASTIC_RESTART_COUNT`](env::TORCHELASTIC_RESTART_COUNT), [`TORCHELASTIC_MAX_RESTARTS`](env::TORCHELASTIC_MAX_RESTARTS),
//! [`TORCHELASTIC_RUN_ID`](env::TORCHELASTIC_RUN_ID)) and, when the node's GPUs are given, its share of them
//! ([`CUDA_VISIBLE_DEVICES`](env::CUDA_VISIBLE_DEVICES), [`CHORUS_DEVICE_IDS`](env::CHORUS_DEVICE_IDS), see [`gpus_for_local_rank`]), on top of
//! the launcher's own environment and the caller's extra variables. `RANK` is
//! `node_rank * nproc_per_node + LOCAL_RANK`.
//!
//! The launcher captures (and optionally forwards, and writes to per-rank log files) every
//! worker's stdout/stderr, watches the workers, and as soon as one fails or the job's time
//! limit passes it kills all the others with SIGKILL. While restarts remain
//! ([`LaunchSpec::max_restarts`]) a failure restarts the whole local group with
//! `TORCHELASTIC_RESTART_COUNT` one higher. An [`Interrupt`] (chorusrun raises it on SIGINT and
//! SIGTERM) forwards its signal to every worker and stops the job. No worker is ever left
//! running (or unreaped) when [`launch`] returns, also when it returns an error or unwinds from
//! a panic.
//!
//! Used by the test harness, `allreduce_perf -np W` and `chorusrun`.
//!
//! ```no_run
//! use chorus::launch::{launch, LaunchSpec, Output};
//! use std::time::Duration;
//!
//! let spec = LaunchSpec::new("/path/to/worker", 4)
//!     .arg("--size=1M")
//!     .timeout(Duration::from_secs(60))
//!     .output(Output::RankZero);
//! let report = launch(&spec).expect("could not start the workers");
//! if !report.success() {
//!     eprintln!("{}", report.summary());
//! }
//! ```
//!
//! Limitations: without [`LaunchSpec::own_process_group`] only the worker processes themselves
//! are killed, not processes they spawned; with it, a worker's whole process group is signalled
//! and killed while the worker runs, but descendants that outlive a worker that exited by
//! itself are left alone. Output of descendants that keep a worker's pipe open is collected for
//! at most [`READER_GRACE`] after the worker exits. Nothing is cleaned up if the launcher
//! process itself is killed by SIGKILL. Restarts are per node: there is no elastic rendezvous
//! between the launchers of different nodes, so with several nodes each restarts its own group
//! when its workers fail (the peers of a dead worker fail in turn and restart too) and the
//! store port stays the same.

use std::ffi::OsString;
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::{env, DEFAULT_MASTER_ADDR};

/// Whole-job time limit used by [`LaunchSpec::new`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Run id used by [`LaunchSpec::new`] (torchrun's default).
pub const DEFAULT_RUN_ID: &str = "none";
/// How long workers may take to exit after an interrupt's signal before they are killed.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(10);
/// Most bytes of each worker stream kept in the report; older output is dropped beyond this.
pub const MAX_CAPTURED_BYTES: usize = 16 << 20;
/// How long the launcher waits, after the last worker is reaped, for output still in flight.
pub const READER_GRACE: Duration = Duration::from_secs(1);

/// Fallback interval between checks of the workers' state.
const POLL_INTERVAL: Duration = Duration::from_millis(5);
/// Longest line forwarded in one piece; longer lines are split.
const MAX_LINE_BYTES: u64 = 64 << 10;
/// Signal number of SIGKILL (the same on every Unix Chorus runs on).
const SIGKILL: i32 = 9;
/// Signal number of SIGTERM (the same on every Unix Chorus runs on).
const SIGTERM: i32 = 15;

/// How the launcher treats each worker's stdout/stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Output {
    /// Capture both streams in memory (returned in the report); nothing printed. For tests.
    Capture,
    /// Stream both to the launcher's stdout/stderr line by line, each line prefixed
    /// `[rank{r}]: ` (the global rank), and also keep them in the report. The default.
    #[default]
    Prefixed,
    /// Stream rank 0's lines unprefixed to the launcher's stdout/stderr (like nccl-tests under
    /// mpirun: one table); keep every rank's output in the report.
    RankZero,
}

/// The GPUs local rank `local_rank` of `nproc_per_node` gets on a node of `gpus` GPUs: indices
/// into the node's GPU list.
///
/// With `nproc_per_node <= gpus` the GPUs are split into contiguous blocks,
/// `[r*G/L, (r+1)*G/L)`: every GPU goes to exactly one rank, and the blocks differ in size by at
/// most one when `L` does not divide `G`. With more ranks than GPUs, ranks share GPUs: rank `r`
/// gets the single GPU `r*G/L`, so neighbouring local ranks share one (4 ranks on 2 GPUs:
/// ranks 0 and 1 on GPU 0, ranks 2 and 3 on GPU 1). With no GPUs the range is empty.
///
/// Panics if `local_rank >= nproc_per_node`.
pub fn gpus_for_local_rank(local_rank: usize, nproc_per_node: usize, gpus: usize) -> Range<usize> {
    assert!(
        local_rank < nproc_per_node,
        "local rank {local_rank} is not below nproc_per_node {nproc_per_node}"
    );
    let first = local_rank * gpus / nproc_per_node;
    if gpus == 0 {
        0..0
    } else if nproc_per_node <= gpus {
        first..(local_rank + 1) * gpus / nproc_per_node
    } else {
        first..first + 1
    }
}

/// A request from outside the launch (a signal handler's thread) to stop the job with a
/// signal: [`launch`] forwards the signal to every worker, waits up to
/// [`LaunchSpec::stop_grace`] for them to exit, then kills the rest; a second request kills
/// them at once. No restart follows. Cloning shares the request.
#[derive(Debug, Clone, Default)]
pub struct Interrupt {
    inner: Arc<InterruptState>,
}

#[derive(Debug, Default)]
struct InterruptState {
    signal: AtomicI32,
    count: AtomicU32,
}

impl Interrupt {
    /// A request not raised yet.
    pub fn new() -> Interrupt {
        Interrupt::default()
    }

    /// Asks the launch to forward `signal` (e.g. 15 for SIGTERM) to the workers and stop.
    pub fn raise(&self, signal: i32) {
        self.inner.signal.store(signal, Ordering::SeqCst);
        self.inner.count.fetch_add(1, Ordering::SeqCst);
    }

    /// The last signal raised, if any.
    pub fn signal(&self) -> Option<i32> {
        (self.count() > 0).then(|| self.inner.signal.load(Ordering::SeqCst))
    }

    fn count(&self) -> u32 {
        self.inner.count.load(Ordering::SeqCst)
    }
}

/// What to launch: `nproc_per_node` copies of `program args..` on this host.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Worker executable (a bare name is looked up in `PATH`).
    pub program: PathBuf,
    /// Arguments passed to every worker.
    pub args: Vec<OsString>,
    /// Number of workers to start on this node (must be at least 1): `LOCAL_WORLD_SIZE`.
    pub nproc_per_node: usize,
    /// Number of nodes in the job (default 1): `GROUP_WORLD_SIZE`.
    pub nnodes: usize,
    /// This node's rank, `0..nnodes` (default 0): `GROUP_RANK`.
    pub node_rank: usize,
    /// Value of `MASTER_ADDR` (default `127.0.0.1`).
    pub master_addr: String,
    /// Value of `MASTER_PORT`; `None` (or `Some(0)`) picks a free port (single node only).
    pub master_port: Option<u16>,
    /// Extra variables for every worker; the contract variables (`RANK`, ...) take precedence.
    pub env: Vec<(String, String)>,
    /// Whole-job limit, counted from the start of [`launch`] over all restarts;
    /// `Duration::MAX` means none.
    pub timeout: Duration,
    /// What happens to the workers' output.
    pub output: Output,
    /// How many times a failed local group is restarted (default 0).
    pub max_restarts: u32,
    /// `TORCHELASTIC_RUN_ID` (default `none`).
    pub run_id: String,
    /// When set, every rank's stdout and stderr are also written, unprefixed, to
    /// `<log_dir>/attempt_<restart>/rank<RANK>.{stdout,stderr}.log`.
    pub log_dir: Option<PathBuf>,
    /// The node's GPU ids (as CUDA numbers them without `CUDA_VISIBLE_DEVICES`); when not
    /// empty each worker gets its share ([`gpus_for_local_rank`]) in `CUDA_VISIBLE_DEVICES`
    /// and `CHORUS_DEVICE_IDS`.
    pub devices: Vec<String>,
    /// A stop request to watch (see [`Interrupt`]).
    pub interrupt: Option<Interrupt>,
    /// Start each worker in a process group of its own (Unix), so that a terminal's Ctrl-C
    /// reaches only the launcher (which forwards it through an [`Interrupt`]) and signals and
    /// kills reach the worker's children too. Default false: workers share the launcher's
    /// group, so a launcher without a signal handler still has its workers stopped by Ctrl-C.
    pub own_process_group: bool,
    /// After an interrupt's signal, how long workers may take to exit before they are killed.
    pub stop_grace: Duration,
    /// After a worker fails, let the others run until they end by themselves (or the
    /// timeout) instead of stopping them: for watching how the survivors fail.
    pub wait_all: bool,
}

impl LaunchSpec {
    /// A spec for `nproc_per_node` copies of `program` on a single node, with no arguments and
    /// the defaults.
    pub fn new(program: impl Into<PathBuf>, nproc_per_node: usize) -> Self {
        LaunchSpec {
            program: program.into(),
            args: Vec::new(),
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: DEFAULT_MASTER_ADDR.to_string(),
            master_port: None,
            env: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
            output: Output::default(),
            max_restarts: 0,
            run_id: DEFAULT_RUN_ID.to_string(),
            log_dir: None,
            devices: Vec::new(),
            interrupt: None,
            own_process_group: false,
            stop_grace: DEFAULT_STOP_GRACE,
            wait_all: false,
        }
    }

    /// The job's `WORLD_SIZE`: `nnodes * nproc_per_node`.
    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    /// Appends one argument.
    #[must_use]
    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Appends several arguments.
    #[must_use]
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Adds an environment variable for every worker.
    #[must_use]
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Sets the whole-job time limit.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets how the workers' output is handled.
    #[must_use]
    pub fn output(mut self, output: Output) -> Self {
        self.output = output;
        self
    }

    /// Uses a fixed `MASTER_PORT` instead of picking a free one.
    #[must_use]
    pub fn master_port(mut self, port: u16) -> Self {
        self.master_port = Some(port);
        self
    }

    /// Sets `MASTER_ADDR`.
    #[must_use]
    pub fn master_addr(mut self, addr: impl Into<String>) -> Self {
        self.master_addr = addr.into();
        self
    }

    /// Makes this launch node `node_rank` of a job of `nnodes` nodes.
    #[must_use]
    pub fn nodes(mut self, nnodes: usize, node_rank: usize) -> Self {
        self.nnodes = nnodes;
        self.node_rank = node_rank;
        self
    }

    /// Allows `max_restarts` restarts of the local group after failures.
    #[must_use]
    pub fn max_restarts(mut self, max_restarts: u32) -> Self {
        self.max_restarts = max_restarts;
        self
    }

    /// Sets `TORCHELASTIC_RUN_ID`.
    #[must_use]
    pub fn run_id(mut self, run_id: impl Into<String>) -> Self {
        self.run_id = run_id.into();
        self
    }

    /// Also writes every rank's output to files under `dir`.
    #[must_use]
    pub fn log_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.log_dir = Some(dir.into());
        self
    }

    /// Sets the node's GPU ids, shared out among the local ranks.
    #[must_use]
    pub fn devices<I, S>(mut self, ids: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.devices = ids.into_iter().map(Into::into).collect();
        self
    }

    /// Watches `interrupt` for stop requests.
    #[must_use]
    pub fn interrupt(mut self, interrupt: Interrupt) -> Self {
        self.interrupt = Some(interrupt);
        self
    }

    /// Starts each worker in a process group of its own (see the field).
    #[must_use]
    pub fn own_process_group(mut self, own: bool) -> Self {
        self.own_process_group = own;
        self
    }

    /// Sets how long workers may take to exit after an interrupt's signal.
    #[must_use]
    pub fn stop_grace(mut self, grace: Duration) -> Self {
        self.stop_grace = grace;
        self
    }

    /// Lets the other workers run on after one fails (see the field).
    #[must_use]
    pub fn wait_all(mut self, wait_all: bool) -> Self {
        self.wait_all = wait_all;
        self
    }
}

/// How one rank ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The worker exited by itself with this code.
    Code(i32),
    /// The worker was terminated by this signal (not SIGKILL sent by the launcher).
    Signal(i32),
    /// Stopped by the launcher because of another rank's failure, the timeout or an interrupt.
    KilledByLauncher,
}

impl Exit {
    /// Whether the worker exited with code 0.
    pub fn is_success(self) -> bool {
        self == Exit::Code(0)
    }

    /// Whether the worker failed by itself (non-zero code or a signal not sent by the launcher).
    pub fn is_failure(self) -> bool {
        match self {
            Exit::Code(code) => code != 0,
            Exit::Signal(_) => true,
            Exit::KilledByLauncher => false,
        }
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Exit::Code(code) => write!(f, "exit code {code}"),
            Exit::Signal(sig) => write!(f, "killed by {}", describe_signal(sig)),
            Exit::KilledByLauncher => f.write_str("stopped by the launcher"),
        }
    }
}

/// How one rank ended, with its output.
#[derive(Debug, Clone)]
pub struct RankOutcome {
    /// The worker's global rank (`RANK`).
    pub rank: usize,
    /// The worker's rank on this node (`LOCAL_RANK`); also its index in [`LaunchReport::ranks`].
    pub local_rank: usize,
    /// How it ended.
    pub status: Exit,
    /// Everything it wrote to stdout (lossy UTF-8; see [`MAX_CAPTURED_BYTES`]).
    pub stdout: String,
    /// Everything it wrote to stderr (lossy UTF-8; see [`MAX_CAPTURED_BYTES`]).
    pub stderr: String,
    /// Time from the start of the launch until the launcher saw the worker end.
    pub elapsed: Duration,
}

impl RankOutcome {
    /// The last non-empty line of stderr, trimmed, if any.
    pub fn last_stderr_line(&self) -> Option<&str> {
        self.stderr
            .lines()
            .rev()
            .map(str::trim)
            .find(|line| !line.is_empty())
    }
}

/// The result of a whole launch (of its last attempt, when the group was restarted).
#[derive(Debug, Clone)]
pub struct LaunchReport {
    /// One entry per local rank, in order.
    pub ranks: Vec<RankOutcome>,
    /// The `MASTER_PORT` the workers were given.
    pub port: u16,
    /// Wall time of the whole launch.
    pub elapsed: Duration,
    /// Whether the job hit its time limit.
    pub timed_out: bool,
    /// The time limit the job ran under.
    pub timeout: Duration,
    /// The local rank (index into `ranks`) whose failure (non-zero exit or signal) the launcher
    /// saw first, if any.
    pub first_failed: Option<usize>,
    /// How many times the group was restarted before this last attempt.
    pub restarts: u32,
    /// The signal an [`Interrupt`] forwarded to the workers, if the job was interrupted.
    pub interrupted: Option<i32>,
}

impl LaunchReport {
    /// Whether every rank exited with code 0 (and the job was neither timed out nor interrupted).
    pub fn success(&self) -> bool {
        !self.timed_out
            && self.interrupted.is_none()
            && !self.ranks.is_empty()
            && self.ranks.iter().all(|r| r.status.is_success())
    }

    /// The rank that failed first in time (not the lowest failed rank); ranks the launcher
    /// killed, and ranks that died of an interrupt's forwarded signal, never count.
    pub fn first_failure(&self) -> Option<&RankOutcome> {
        let first = self.first_failed.and_then(|r| self.ranks.get(r));
        first.filter(|r| r.status.is_failure()).or_else(|| {
            self.interrupted
                .is_none()
                .then(|| self.ranks.iter().find(|r| r.status.is_failure()))
                .flatten()
        })
    }

    /// The exit code a launcher process should end with: 0 on success; `128 + signal` when
    /// interrupted; the first failed rank's exit code (or `128 + signal` if a signal killed
    /// it); 124 on timeout; 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        if self.success() {
            return 0;
        }
        if let Some(sig) = self.interrupted {
            return 128 + sig;
        }
        match self.first_failure().map(|r| r.status) {
            Some(Exit::Code(code)) if (1..=255).contains(&code) => code,
            Some(Exit::Signal(sig)) => 128 + sig,
            _ if self.timed_out => 124,
            _ => 1,
        }
    }

    /// One line describing how the job ended, for logs and error messages.
    pub fn summary(&self) -> String {
        let n = self.ranks.len();
        let restarts = match self.restarts {
            0 => String::new(),
            1 => " after 1 restart".to_string(),
            r => format!(" after {r} restarts"),
        };
        if self.success() {
            return format!(
                "all {n} ranks succeeded in {:.2}s{restarts}",
                secs(self.elapsed)
            );
        }
        let mut parts = Vec::new();
        if let Some(sig) = self.interrupted {
            parts.push(format!(
                "interrupted by {}, forwarded to the workers",
                describe_signal(sig)
            ));
            let each: Vec<String> = self
                .ranks
                .iter()
                .map(|r| format!("rank {}: {}", r.rank, r.status))
                .collect();
            parts.push(each.join(", "));
            let mut line = parts.join("; ");
            line.push_str(&restarts);
            return line;
        }
        let killed: Vec<usize> = self
            .ranks
            .iter()
            .filter(|r| r.status == Exit::KilledByLauncher)
            .map(|r| r.rank)
            .collect();
        let first = self.first_failure();
        if let Some(first) = first {
            parts.push(format!(
                "rank {} failed first: {} after {:.2}s",
                first.rank,
                first.status,
                secs(first.elapsed)
            ));
            match first.last_stderr_line() {
                Some(line) => parts.push(format!("last stderr line: {}", clip(line, 300))),
                None => parts.push("no stderr output".to_string()),
            }
        } else if self.timed_out {
            parts.push(format!(
                "timed out after {:?} ({:.2}s elapsed)",
                self.timeout,
                secs(self.elapsed)
            ));
        } else {
            parts.push(format!("{n} ranks did not all succeed"));
        }
        let also: Vec<String> = self
            .ranks
            .iter()
            .filter(|r| r.status.is_failure() && Some(r.rank) != first.map(|f| f.rank))
            .map(|r| format!("rank {} ({})", r.rank, r.status))
            .collect();
        if !also.is_empty() {
            parts.push(format!("also failed: {}", also.join(", ")));
        }
        if !killed.is_empty() {
            let list = join_ranks(&killed);
            if self.timed_out && first.is_none() {
                parts.push(format!("ranks still running: {list}"));
            } else {
                parts.push(format!("ranks {list} stopped by the launcher"));
            }
        }
        let mut line = parts.join("; ");
        line.push_str(&restarts);
        line
    }
}

/// Why [`launch`] could not run the job at all.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// Starting the worker for `rank` failed (e.g. the program does not exist).
    #[error("failed to start rank {rank} ({program}): {source}", program = program.display())]
    Spawn {
        /// The (global) rank that could not be started.
        rank: usize,
        /// The program that was being started.
        program: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The number of workers per node is not usable (it must be at least 1).
    #[error("invalid world size {0}: need at least one worker")]
    InvalidWorldSize(usize),
    /// The node count or node rank is not usable.
    #[error("invalid nodes: node rank {node_rank} of {nnodes} nodes (need node_rank < nnodes)")]
    InvalidNodes {
        /// Number of nodes.
        nnodes: usize,
        /// This node's rank.
        node_rank: usize,
    },
    /// A job of several nodes needs the same fixed master port on every node.
    #[error("a job of {0} nodes needs a fixed master port (the same on every node)")]
    MasterPortRequired(usize),
    /// No free master port could be found.
    #[error("could not find a free master port: {0}")]
    Port(#[source] io::Error),
    /// A log directory or file could not be created.
    #[error("cannot create log file {path}: {source}", path = path.display())]
    LogFile {
        /// The directory or file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0 and read it back).
///
/// Fails if binding a socket on 127.0.0.1 fails.
pub fn free_port() -> io::Result<u16> {
    free_port_on(DEFAULT_MASTER_ADDR)
}

/// A port that was free on `addr` a moment ago; loopback names use 127.0.0.1.
pub(crate) fn free_port_on(addr: &str) -> io::Result<u16> {
    let host = match addr {
        "" | "localhost" => DEFAULT_MASTER_ADDR,
        other => other,
    };
    let listener = TcpListener::bind((host, 0))?;
    Ok(listener.local_addr()?.port())
}

/// Records a worker's failure for torchrun: when `TORCHELASTIC_ERROR_FILE` names a file (torchrun
/// sets it), writes `message` there as torch's `@record` does, so torchrun's failure summary
/// shows it instead of "To enable traceback see ...". Returns the file written, or `None`
/// when the variable is unset.
///
/// The file is `{"message": {"message": M, "extraInfo": {"py_callstack": M, "timestamp": S}}}`
/// with S the seconds since 1970 as text; the summary prints `py_callstack` (here the message
/// again, as there is no Python stack) and picks the failure with the smallest timestamp as the
/// root cause. Fails if the file cannot be written.
pub fn write_error_file(message: &str) -> io::Result<Option<PathBuf>> {
    let Some(path) = std::env::var_os(env::TORCHELASTIC_ERROR_FILE).filter(|p| !p.is_empty())
    else {
        return Ok(None);
    };
    let path = PathBuf::from(path);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let json = error_file_json(message, now.map_or(0, |d| d.as_secs()));
    std::fs::write(&path, json)?;
    Ok(Some(path))
}

/// The error file's JSON for `message` at `timestamp` (seconds since 1970).
fn error_file_json(message: &str, timestamp: u64) -> String {
    let mut text = String::with_capacity(message.len() + 2);
    text.push('"');
    for c in message.chars() {
        match c {
            '"' => text.push_str("\\\""),
            '\\' => text.push_str("\\\\"),
            '\n' => text.push_str("\\n"),
            '\r' => text.push_str("\\r"),
            '\t' => text.push_str("\\t"),
            c if u32::from(c) < 0x20 => text.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => text.push(c),
        }
    }
    text.push('"');
    format!(
        r#"{{"message": {{"message": {text}, "extraInfo": {{"py_callstack": {text}, "timestamp": "{timestamp}"}}}}}}"#
    )
}

/// `spec`, plus a fresh `CHORUS_AUTH_TOKEN` for a single-node job that has none, so that only
/// its own workers can join its store and sockets. (The nodes of a multi-node job could not
/// agree on generated secrets: there the user sets one on every node.)
fn with_job_secret(spec: &LaunchSpec) -> LaunchSpec {
    let mut spec = spec.clone();
    let given = spec.env.iter().any(|(k, _)| k == env::CHORUS_AUTH_TOKEN)
        || std::env::var_os(env::CHORUS_AUTH_TOKEN).is_some();
    if given || spec.nnodes > 1 {
        return spec;
    }
    match chorus_transport::auth::random_token() {
        Ok(token) => spec.env.push((env::CHORUS_AUTH_TOKEN.to_string(), token)),
        Err(e) => warn!("the workers get no secret of their own: {e}"),
    }
    spec
}

/// Starts the workers, waits for them, and returns how each ended.
///
/// As soon as one rank fails (non-zero exit or signal), or the timeout passes, every other
/// worker is killed (unless [`LaunchSpec::wait_all`]); after a failure, while restarts remain, the group starts again. Fails only
/// if the launch itself fails (program not found, no workers, bad node rank, no free port, a
/// log file that cannot be created): [`LaunchError`] names what; workers already started are
/// then killed.
pub fn launch(spec: &LaunchSpec) -> Result<LaunchReport, LaunchError> {
    if spec.nproc_per_node == 0 {
        return Err(LaunchError::InvalidWorldSize(0));
    }
    if spec.nnodes == 0 || spec.node_rank >= spec.nnodes {
        return Err(LaunchError::InvalidNodes {
            nnodes: spec.nnodes,
            node_rank: spec.node_rank,
        });
    }
    let port = match spec.master_port {
        Some(port) if port != 0 => port,
        _ if spec.nnodes > 1 => return Err(LaunchError::MasterPortRequired(spec.nnodes)),
        _ => free_port_on(&spec.master_addr).map_err(LaunchError::Port)?,
    };
    let spec = &with_job_secret(spec);
    let start = Instant::now();
    let deadline = start.checked_add(spec.timeout);
    debug!(
        program = %spec.program.display(),
        nproc_per_node = spec.nproc_per_node,
        nnodes = spec.nnodes,
        node_rank = spec.node_rank,
        port,
        timeout = ?spec.timeout,
        "launching workers"
    );
    let mut restarts = 0;
    loop {
        let attempt = run_attempt(spec, port, restarts, start, deadline)?;
        let report = LaunchReport {
            ranks: attempt.ranks,
            port,
            elapsed: start.elapsed(),
            timed_out: attempt.timed_out,
            timeout: spec.timeout,
            first_failed: attempt.first_failed,
            restarts,
            interrupted: attempt.interrupted,
        };
        let interrupted = spec.interrupt.as_ref().and_then(Interrupt::signal);
        let retry = report.first_failed.is_some()
            && !report.timed_out
            && interrupted.is_none()
            && restarts < spec.max_restarts;
        if !retry {
            debug!(summary = %report.summary(), "launch finished");
            return Ok(report);
        }
        restarts += 1;
        warn!(
            "{}; restarting the workers (restart {restarts} of {})",
            report.summary(),
            spec.max_restarts
        );
    }
}

/// How one attempt (one start of the local group) ended.
struct Attempt {
    ranks: Vec<RankOutcome>,
    first_failed: Option<usize>,
    timed_out: bool,
    interrupted: Option<i32>,
}

/// Starts the local group once and waits until it succeeds, fails, times out or is
/// interrupted; every worker is reaped on return.
fn run_attempt(
    spec: &LaunchSpec,
    port: u16,
    restart: u32,
    start: Instant,
    deadline: Option<Instant>,
) -> Result<Attempt, LaunchError> {
    let nproc = spec.nproc_per_node;
    let logs = match &spec.log_dir {
        Some(dir) => {
            let dir = dir.join(format!("attempt_{restart}"));
            std::fs::create_dir_all(&dir).map_err(|source| LaunchError::LogFile {
                path: dir.clone(),
                source,
            })?;
            Some(dir)
        }
        None => None,
    };
    let (tx, rx) = mpsc::channel();
    let mut workers = Workers {
        procs: Vec::with_capacity(nproc),
        own_group: spec.own_process_group,
    };
    let mut streams: Vec<[Pump; 2]> = Vec::with_capacity(nproc);
    for local in 0..nproc {
        let rank = spec.node_rank * nproc + local;
        let spawn_err = |source| LaunchError::Spawn {
            rank,
            program: spec.program.clone(),
            source,
        };
        let log = |stream: Stream| -> Result<Option<File>, LaunchError> {
            let Some(dir) = &logs else { return Ok(None) };
            log_file(&dir.join(format!("rank{rank}.{}.log", stream.name()))).map(Some)
        };
        let (out_log, err_log) = (log(Stream::Stdout)?, log(Stream::Stderr)?);
        let mut child = worker_command(spec, local, port, restart)
            .spawn()
            .map_err(spawn_err)?;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        debug!(rank, local, pid = child.id(), restart, "worker started");
        workers.procs.push(Proc {
            child,
            exit: None,
            ended: Duration::ZERO,
        });
        let ids = (rank, local);
        let out = Pump::start(
            ids,
            Stream::Stdout,
            stdout,
            spec.output,
            out_log,
            tx.clone(),
        );
        let err = Pump::start(
            ids,
            Stream::Stderr,
            stderr,
            spec.output,
            err_log,
            tx.clone(),
        );
        streams.push([out.map_err(spawn_err)?, err.map_err(spawn_err)?]);
    }
    drop(tx);

    let mut closed = 0usize;
    let mut first_failed = None;
    let mut timed_out = false;
    let mut interrupted = None;
    let mut stop_by: Option<Instant> = None;
    let mut hints: Vec<usize> = Vec::new();
    loop {
        while let Ok(Event::Closed(local)) = rx.try_recv() {
            closed += 1;
            hints.push(local);
        }
        // Ranks whose streams just closed are checked first, in the order they closed, so
        // that the first failure in time wins when several are seen in one sweep.
        let order: Vec<usize> = hints.drain(..).chain(0..nproc).collect();
        for local in order {
            if let Some(exit) = workers.poll(local, start) {
                if exit.is_failure() && first_failed.is_none() && interrupted.is_none() {
                    debug!(local, %exit, "first failure");
                    first_failed = Some(local);
                }
            }
        }
        if (first_failed.is_some() && !spec.wait_all) || workers.all_ended() {
            break;
        }
        if let Some(interrupt) = &spec.interrupt {
            let requests = interrupt.count();
            if requests > 0 && interrupted.is_none() {
                let sig = interrupt.signal().unwrap_or(SIGTERM);
                warn!("got {}: forwarding it to the workers", describe_signal(sig));
                workers.signal_all(sig);
                interrupted = Some(sig);
                stop_by = Instant::now().checked_add(spec.stop_grace);
            }
            if requests > 1 {
                debug!("second interrupt: killing the workers");
                break;
            }
        }
        let now = Instant::now();
        if stop_by.is_some_and(|d| now >= d) {
            debug!(grace = ?spec.stop_grace, "workers still running after the grace period");
            break;
        }
        if deadline.is_some_and(|d| now >= d) {
            debug!(timeout = ?spec.timeout, "job timed out");
            timed_out = true;
            break;
        }
        let wait = deadline.map_or(POLL_INTERVAL, |d| (d - now).min(POLL_INTERVAL));
        match rx.recv_timeout(wait) {
            Ok(Event::Closed(local)) => {
                closed += 1;
                hints.push(local);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => thread::sleep(wait),
        }
    }
    workers.kill_remaining(start);

    // Every worker is reaped; collect the output still in flight (bounded, since processes the
    // workers spawned may hold their pipes open).
    let grace_end = Instant::now() + READER_GRACE;
    while closed < 2 * nproc {
        let now = Instant::now();
        if now >= grace_end {
            break;
        }
        match rx.recv_timeout(grace_end - now) {
            Ok(Event::Closed(_)) => closed += 1,
            Err(_) => break,
        }
    }

    let ranks = workers
        .procs
        .iter()
        .zip(streams)
        .enumerate()
        .map(|(local, (proc_, [out, err]))| RankOutcome {
            rank: spec.node_rank * nproc + local,
            local_rank: local,
            status: proc_.exit.unwrap_or(Exit::KilledByLauncher),
            stdout: out.finish(),
            stderr: err.finish(),
            elapsed: proc_.ended,
        })
        .collect();
    Ok(Attempt {
        ranks,
        first_failed,
        timed_out,
        interrupted,
    })
}

/// Creates (truncates) one log file.
fn log_file(path: &Path) -> Result<File, LaunchError> {
    File::create(path).map_err(|source| LaunchError::LogFile {
        path: path.to_path_buf(),
        source,
    })
}

/// The command for one worker: program, args, inherited env + extras + devices + the contract.
fn worker_command(spec: &LaunchSpec, local: usize, port: u16, restart: u32) -> Command {
    let nproc = spec.nproc_per_node;
    let rank = (spec.node_rank * nproc + local).to_string();
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    #[cfg(unix)]
    if spec.own_process_group {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
    }
    for (key, value) in &spec.env {
        cmd.env(key, value);
    }
    if !spec.devices.is_empty() {
        let mine = &spec.devices[gpus_for_local_rank(local, nproc, spec.devices.len())];
        let list = mine.join(",");
        cmd.env(env::CUDA_VISIBLE_DEVICES, &list)
            .env(env::CHORUS_DEVICE_IDS, &list);
    }
    cmd.env(env::MASTER_ADDR, &spec.master_addr)
        .env(env::MASTER_PORT, port.to_string())
        .env(env::RANK, &rank)
        .env(env::WORLD_SIZE, spec.world_size().to_string())
        .env(env::LOCAL_RANK, local.to_string())
        .env(env::LOCAL_WORLD_SIZE, nproc.to_string())
        .env(env::GROUP_RANK, spec.node_rank.to_string())
        .env(env::GROUP_WORLD_SIZE, spec.nnodes.to_string())
        .env(env::TORCHELASTIC_RESTART_COUNT, restart.to_string())
        .env(
            env::TORCHELASTIC_MAX_RESTARTS,
            spec.max_restarts.to_string(),
        )
        .env(env::TORCHELASTIC_RUN_ID, &spec.run_id);
    cmd
}

/// Sends `sig` to process `pid`, or to its whole process group.
#[cfg(unix)]
fn send_signal(pid: u32, sig: i32, group: bool) -> io::Result<()> {
    use nix::sys::signal::{kill, killpg, Signal};
    use nix::unistd::Pid;
    let sig = Signal::try_from(sig)?;
    let pid = Pid::from_raw(i32::try_from(pid).map_err(io::Error::other)?);
    if group {
        killpg(pid, sig)?;
    } else {
        kill(pid, sig)?;
    }
    Ok(())
}

#[cfg(not(unix))]
fn send_signal(_pid: u32, _sig: i32, _group: bool) -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "signals are Unix only",
    ))
}

/// One started worker.
struct Proc {
    child: Child,
    /// How it ended, once reaped.
    exit: Option<Exit>,
    /// When it was seen to end, from the start of the launch.
    ended: Duration,
}

/// The started workers; kills and reaps any still running when dropped.
struct Workers {
    procs: Vec<Proc>,
    /// Whether each worker leads a process group of its own.
    own_group: bool,
}

impl Workers {
    /// Checks (without blocking) whether local rank `local` has ended; returns its exit if it
    /// just did.
    fn poll(&mut self, local: usize, start: Instant) -> Option<Exit> {
        let proc_ = &mut self.procs[local];
        if proc_.exit.is_some() {
            return None;
        }
        let exit = match proc_.child.try_wait() {
            Ok(None) => return None,
            Ok(Some(status)) => classify(status, false),
            Err(e) => {
                // Cannot happen for our own children unless something reaped them behind our
                // back; count the worker as failed rather than waiting forever.
                debug!(local, error = %e, "cannot wait for worker");
                Exit::Code(-1)
            }
        };
        proc_.exit = Some(exit);
        proc_.ended = start.elapsed();
        debug!(local, %exit, "worker ended");
        Some(exit)
    }

    fn all_ended(&self) -> bool {
        self.procs.iter().all(|p| p.exit.is_some())
    }

    /// Sends `sig` to every worker not yet reaped (and its group, with `own_group`).
    fn signal_all(&self, sig: i32) {
        for (local, proc_) in self.procs.iter().enumerate() {
            if proc_.exit.is_none() {
                // A worker that exited but is not reaped yet still holds its pid: no reuse.
                if let Err(e) = send_signal(proc_.child.id(), sig, self.own_group) {
                    debug!(local, sig, error = %e, "cannot signal worker");
                }
            }
        }
    }

    /// SIGKILLs every worker still running (its whole group with `own_group`), then reaps them.
    fn kill_remaining(&mut self, start: Instant) {
        let mut killed = Vec::new();
        for (local, proc_) in self.procs.iter_mut().enumerate() {
            if proc_.exit.is_none() {
                debug!(local, "killing worker");
                let group = self.own_group && send_signal(proc_.child.id(), SIGKILL, true).is_ok();
                if !group {
                    if let Err(e) = proc_.child.kill() {
                        debug!(local, error = %e, "kill failed");
                    }
                }
                killed.push(local);
            }
        }
        for local in killed {
            let proc_ = &mut self.procs[local];
            proc_.exit = Some(match proc_.child.wait() {
                Ok(status) => classify(status, true),
                Err(e) => {
                    debug!(local, error = %e, "cannot reap worker");
                    Exit::KilledByLauncher
                }
            });
            proc_.ended = start.elapsed();
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        if !self.all_ended() {
            // An early return or a panic: never leave a worker behind.
            self.kill_remaining(Instant::now());
        }
    }
}

/// Turns an OS exit status into an [`Exit`]; `killed` says whether the launcher sent SIGKILL.
fn classify(status: ExitStatus, killed: bool) -> Exit {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return if killed && sig == SIGKILL {
                Exit::KilledByLauncher
            } else {
                Exit::Signal(sig)
            };
        }
    }
    match status.code() {
        #[cfg(not(unix))]
        Some(_) if killed => Exit::KilledByLauncher,
        Some(code) => Exit::Code(code),
        None => Exit::Code(-1),
    }
}

/// Which stream of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    fn name(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// Sent by a reader thread when its stream reaches end of file (with the local rank).
enum Event {
    Closed(usize),
}

/// A worker stream's captured text, bounded by a byte limit.
#[derive(Default)]
struct Captured {
    text: String,
    dropped: usize,
}

impl Captured {
    /// Appends `s`, dropping the oldest output (at a line start if possible) beyond `limit`.
    fn push(&mut self, s: &str, limit: usize) {
        self.text.push_str(s);
        if self.text.len() <= limit {
            return;
        }
        let keep = limit / 2;
        let mut cut = self.text.len() - keep;
        while !self.text.is_char_boundary(cut) {
            cut += 1;
        }
        if let Some(nl) = self.text[cut..].find('\n') {
            if nl < keep / 2 {
                cut += nl + 1;
            }
        }
        self.text.drain(..cut);
        self.dropped += cut;
    }

    /// The text, with a marker in front if output was dropped.
    fn into_text(self) -> String {
        if self.dropped == 0 {
            self.text
        } else {
            format!(
                "[chorus launch: {} earlier bytes dropped]\n{}",
                self.dropped, self.text
            )
        }
    }
}

fn lock(buf: &Mutex<Captured>) -> MutexGuard<'_, Captured> {
    buf.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A reader thread draining one worker stream.
struct Pump {
    buf: Arc<Mutex<Captured>>,
    handle: Option<JoinHandle<()>>,
    rank: usize,
    stream: Stream,
}

impl Pump {
    /// Starts the thread (none when the stream is missing) for the worker of global rank
    /// `rank` and local rank `local`; `tee` also gets every line, unprefixed.
    fn start(
        (rank, local): (usize, usize),
        stream: Stream,
        source: Option<impl Read + Send + 'static>,
        output: Output,
        tee: Option<File>,
        tx: Sender<Event>,
    ) -> io::Result<Pump> {
        let buf = Arc::new(Mutex::new(Captured::default()));
        let handle = match source {
            Some(source) => {
                let prefix = match output {
                    Output::Capture => None,
                    Output::Prefixed => Some(format!("[rank{rank}]: ")),
                    Output::RankZero if rank == 0 => Some(String::new()),
                    Output::RankZero => None,
                };
                let shared = Arc::clone(&buf);
                let name = format!("chorus-launch-r{rank}-{stream:?}").to_lowercase();
                Some(thread::Builder::new().name(name).spawn(move || {
                    pump(source, stream, prefix.as_deref(), tee, &shared);
                    let _ = tx.send(Event::Closed(local));
                })?)
            }
            None => {
                let _ = tx.send(Event::Closed(local));
                None
            }
        };
        Ok(Pump {
            buf,
            handle,
            rank,
            stream,
        })
    }

    /// The captured text; joins the thread if it is done, otherwise leaves it behind.
    fn finish(self) -> String {
        if let Some(handle) = self.handle {
            if handle.is_finished() {
                let _ = handle.join();
            } else {
                debug!(
                    rank = self.rank,
                    stream = ?self.stream,
                    "worker stream still open after the worker ended; output may be incomplete"
                );
            }
        }
        match Arc::try_unwrap(self.buf) {
            Ok(buf) => buf
                .into_inner()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .into_text(),
            Err(shared) => {
                let buf = lock(&shared);
                Captured {
                    text: buf.text.clone(),
                    dropped: buf.dropped,
                }
                .into_text()
            }
        }
    }
}

/// Reads `source` line by line until EOF, forwarding each line (when `prefix` is set), writing
/// it to `tee` (if any) and appending it to `buf`.
fn pump(
    source: impl Read,
    stream: Stream,
    prefix: Option<&str>,
    mut tee: Option<File>,
    buf: &Mutex<Captured>,
) {
    let mut reader = BufReader::new(source);
    let mut line = Vec::new();
    loop {
        line.clear();
        match (&mut reader)
            .take(MAX_LINE_BYTES)
            .read_until(b'\n', &mut line)
        {
            Ok(0) => break,
            Ok(_) => {
                if let Some(file) = &mut tee {
                    if let Err(e) = file.write_all(&line) {
                        debug!(error = %e, "cannot write the log file; no more lines go to it");
                        tee = None;
                    }
                }
                let text = String::from_utf8_lossy(&line);
                if let Some(prefix) = prefix {
                    forward(stream, prefix, &text);
                }
                lock(buf).push(&text, MAX_CAPTURED_BYTES);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
}

/// Writes one line to the launcher's stdout or stderr in a single write; errors are ignored
/// (the worker's output must keep draining even if the launcher's stdout is closed).
fn forward(stream: Stream, prefix: &str, text: &str) {
    let body = text.strip_suffix('\n').unwrap_or(text);
    let body = body.strip_suffix('\r').unwrap_or(body);
    let mut out = String::with_capacity(prefix.len() + body.len() + 1);
    out.push_str(prefix);
    out.push_str(body);
    out.push('\n');
    let _ = match stream {
        Stream::Stdout => io::stdout().lock().write_all(out.as_bytes()),
        Stream::Stderr => io::stderr().lock().write_all(out.as_bytes()),
    };
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn join_ranks(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn clip(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// `signal 15 (SIGTERM)`, or `signal 99` for signals without a portable name.
fn describe_signal(sig: i32) -> String {
    match signal_name(sig) {
        Some(name) => format!("signal {sig} ({name})"),
        None => format!("signal {sig}"),
    }
}

/// Names of the signals whose numbers are the same on Linux and macOS.
fn signal_name(sig: i32) -> Option<&'static str> {
    Some(match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        6 => "SIGABRT",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn error_files_hold_the_message_as_json() {
        let json = error_file_json("rank 1: \"x\" \\ \n\u{1} é", 1_700_000_000);
        let text = r#""rank 1: \"x\" \\ \n\u0001 é""#;
        let want = format!(
            r#"{{"message": {{"message": {text}, "extraInfo": {{"py_callstack": {text}, "timestamp": "1700000000"}}}}}}"#
        );
        assert_eq!(json, want);
    }

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
        let pid =
            std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
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
        let spec =
            sh(3, "[ $RANK = 1 ] && exit 0; exec sleep 30").timeout(Duration::from_millis(300));
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
    fn captured_output_is_bounded() {
        let mut buf = Captured::default();
        for i in 0..100 {
            buf.push(&format!("line {i:04}\n"), 100);
        }
        assert!(buf.text.len() <= 100);
        assert!(buf.text.ends_with("line 0099\n"));
        assert!(buf.text.starts_with("line "));
        let text = buf.into_text();
        assert!(text.starts_with("[chorus launch: "), "{text}");
        assert!(text.ends_with("line 0099\n"));
    }

    #[test]
    fn free_port_is_bindable() {
        // The port can be taken by someone else between the two binds (that is inherent in
        // free_port), so allow a few fresh tries.
        let bound = (0..5).any(|_| {
            let port = free_port().unwrap();
            assert_ne!(port, 0);
            TcpListener::bind(("127.0.0.1", port)).is_ok()
        });
        assert!(bound);
        assert_ne!(free_port_on("localhost").unwrap(), 0);
    }

    #[test]
    fn summary_of_a_constructed_report() {
        let outcome = |rank, status, stderr: &str| RankOutcome {
            rank,
            local_rank: rank,
            status,
            stdout: String::new(),
            stderr: stderr.to_string(),
            elapsed: Duration::from_millis(100),
        };
        let report = LaunchReport {
            ranks: vec![
                outcome(0, Exit::Code(1), "peer closed\n"),
                outcome(1, Exit::KilledByLauncher, ""),
                outcome(2, Exit::Signal(11), "partial\n\n"),
            ],
            port: 1234,
            elapsed: Duration::from_millis(200),
            timed_out: false,
            timeout: Duration::from_secs(30),
            first_failed: Some(2),
            restarts: 0,
            interrupted: None,
        };
        assert!(!report.success());
        assert_eq!(report.first_failure().unwrap().rank, 2);
        assert_eq!(
            report.summary(),
            "rank 2 failed first: killed by signal 11 (SIGSEGV) after 0.10s; \
             last stderr line: partial; also failed: rank 0 (exit code 1); \
             ranks 1 stopped by the launcher"
        );
    }

    #[test]
    fn exit_codes_and_restart_and_interrupt_summaries() {
        let outcome = |rank, status| RankOutcome {
            rank,
            local_rank: rank,
            status,
            stdout: String::new(),
            stderr: String::new(),
            elapsed: Duration::from_millis(100),
        };
        let report = |statuses: &[Exit], first_failed, timed_out, interrupted| LaunchReport {
            ranks: statuses
                .iter()
                .enumerate()
                .map(|(r, &s)| outcome(r, s))
                .collect(),
            port: 1,
            elapsed: Duration::from_millis(200),
            timed_out,
            timeout: Duration::from_secs(1),
            first_failed,
            restarts: 2,
            interrupted,
        };
        let ok = report(&[Exit::Code(0), Exit::Code(0)], None, false, None);
        assert_eq!(ok.exit_code(), 0);
        assert!(
            ok.summary().ends_with("s after 2 restarts"),
            "{}",
            ok.summary()
        );
        let failed = report(
            &[Exit::KilledByLauncher, Exit::Code(3)],
            Some(1),
            false,
            None,
        );
        assert_eq!(failed.exit_code(), 3);
        assert!(failed
            .summary()
            .ends_with("; ranks 0 stopped by the launcher after 2 restarts"));
        let signalled = report(
            &[Exit::Signal(11), Exit::KilledByLauncher],
            Some(0),
            false,
            None,
        );
        assert_eq!(signalled.exit_code(), 128 + 11);
        let timed_out = report(&[Exit::KilledByLauncher], None, true, None);
        assert_eq!(timed_out.exit_code(), 124);
        let interrupted = report(&[Exit::Signal(15), Exit::Code(42)], None, false, Some(15));
        assert!(!interrupted.success());
        assert_eq!(interrupted.exit_code(), 128 + 15);
        assert!(interrupted.first_failure().is_none());
        assert_eq!(
            interrupted.summary(),
            "interrupted by signal 15 (SIGTERM), forwarded to the workers; \
             rank 0: killed by signal 15 (SIGTERM), rank 1: exit code 42 after 2 restarts"
        );
        // Workers that exit 0 on the forwarded signal still make an interrupted job.
        let clean = report(&[Exit::Code(0)], None, false, Some(2));
        assert!(!clean.success());
        assert_eq!(clean.exit_code(), 130);
    }

    #[test]
    fn gpu_mapping() {
        let all = |l: usize, g: usize| -> Vec<Range<usize>> {
            (0..l).map(|r| gpus_for_local_rank(r, l, g)).collect()
        };
        // Fewer ranks than GPUs: contiguous blocks (the seeds' 2 ranks on 8 GPUs).
        assert_eq!(all(2, 8), [0..4, 4..8]);
        assert_eq!(all(1, 4)[0], 0..4);
        // Uneven: every GPU used once, block sizes differ by at most one.
        assert_eq!(all(2, 3), [0..1, 1..3]);
        assert_eq!(all(3, 8), [0..2, 2..5, 5..8]);
        // One rank per GPU.
        assert_eq!(all(4, 4), [0..1, 1..2, 2..3, 3..4]);
        // More ranks than GPUs: neighbours share one GPU.
        assert_eq!(all(4, 2), [0..1, 0..1, 1..2, 1..2]);
        assert_eq!(all(3, 2), [0..1, 0..1, 1..2]);
        assert_eq!(all(5, 1), vec![0..1; 5]);
        // No GPUs: nothing.
        assert_eq!(all(3, 0), vec![0..0; 3]);
        // Every GPU is used by some rank, and ranges stay in bounds.
        for l in 1..=9 {
            for g in 1..=9 {
                let ranges = all(l, g);
                let mut used = vec![false; g];
                for r in &ranges {
                    assert!(!r.is_empty() && r.end <= g, "L={l} G={g}: {ranges:?}");
                    used[r.clone()].iter_mut().for_each(|u| *u = true);
                }
                assert!(used.iter().all(|&u| u), "L={l} G={g}: {ranges:?}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "local rank 2 is not below nproc_per_node 2")]
    fn gpu_mapping_rejects_a_bad_rank() {
        let _ = gpus_for_local_rank(2, 2, 4);
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
        let report =
            launch(&sh(2, "[ $RANK = 0 ] && exit 9; exec sleep 30").max_restarts(2)).unwrap();
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
}
