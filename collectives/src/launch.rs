//! Local multi-process launcher: runs `world_size` copies of a worker program on this host.
//!
//! Every worker gets torchrun's environment contract ([`ENV_MASTER_ADDR`], [`ENV_MASTER_PORT`],
//! [`ENV_RANK`], [`ENV_WORLD_SIZE`], [`ENV_LOCAL_RANK`], [`ENV_LOCAL_WORLD_SIZE`],
//! [`ENV_GROUP_RANK`], [`ENV_GROUP_WORLD_SIZE`]) on top of the launcher's own environment and
//! the caller's extra variables. The launcher captures (and optionally forwards) every worker's
//! stdout/stderr, watches the workers, and as soon as one fails or the job's time limit passes it
//! kills all the others with SIGKILL. No worker is ever left running (or unreaped) when
//! [`launch`] returns, also when it returns an error or unwinds from a panic.
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
//! Limitations: only the worker processes themselves are killed, not processes they spawned;
//! output of such descendants that keep a worker's pipe open is collected for at most
//! [`READER_GRACE`] after the worker exits. Nothing is cleaned up if the launcher process itself
//! is killed by a signal (workers share the launcher's process group, so a terminal's Ctrl-C
//! reaches them too).

use std::ffi::OsString;
use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use tracing::debug;

/// Env var: address of the rank-0 rendezvous host.
pub const ENV_MASTER_ADDR: &str = "MASTER_ADDR";
/// Env var: TCP port of the rank-0 rendezvous listener.
pub const ENV_MASTER_PORT: &str = "MASTER_PORT";
/// Env var: global rank of the worker, `0..WORLD_SIZE`.
pub const ENV_RANK: &str = "RANK";
/// Env var: total number of workers in the job.
pub const ENV_WORLD_SIZE: &str = "WORLD_SIZE";
/// Env var: rank of the worker among the workers on its node.
pub const ENV_LOCAL_RANK: &str = "LOCAL_RANK";
/// Env var: number of workers on the worker's node.
pub const ENV_LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Env var: rank of the worker's node (always 0 for this single-node launcher).
pub const ENV_GROUP_RANK: &str = "GROUP_RANK";
/// Env var: number of nodes in the job (always 1 for this single-node launcher).
pub const ENV_GROUP_WORLD_SIZE: &str = "GROUP_WORLD_SIZE";

/// Master address used by [`LaunchSpec::new`].
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
/// Whole-job time limit used by [`LaunchSpec::new`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Most bytes of each worker stream kept in the report; older output is dropped beyond this.
pub const MAX_CAPTURED_BYTES: usize = 16 << 20;
/// How long the launcher waits, after the last worker is reaped, for output still in flight.
pub const READER_GRACE: Duration = Duration::from_secs(1);

/// Fallback interval between checks of the workers' state.
const POLL_INTERVAL: Duration = Duration::from_millis(5);
/// Longest line forwarded in one piece; longer lines are split.
const MAX_LINE_BYTES: u64 = 64 << 10;
/// Signal number of SIGKILL (the same on every Unix Chorus runs on).
#[cfg(unix)]
const SIGKILL: i32 = 9;

/// How the launcher treats each worker's stdout/stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Output {
    /// Capture both streams in memory (returned in the report); nothing printed. For tests.
    Capture,
    /// Stream both to the launcher's stdout/stderr line by line, each line prefixed
    /// `[rank{r}]: `, and also keep them in the report. The default.
    #[default]
    Prefixed,
    /// Stream rank 0's lines unprefixed to the launcher's stdout/stderr (like nccl-tests under
    /// mpirun: one table); keep every rank's output in the report.
    RankZero,
}

/// What to launch: `world_size` copies of `program args..` on this host.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Worker executable (a bare name is looked up in `PATH`).
    pub program: PathBuf,
    /// Arguments passed to every worker.
    pub args: Vec<OsString>,
    /// Number of workers to start (must be at least 1).
    pub world_size: usize,
    /// Value of `MASTER_ADDR` (default `127.0.0.1`).
    pub master_addr: String,
    /// Value of `MASTER_PORT`; `None` (or `Some(0)`) picks a free port.
    pub master_port: Option<u16>,
    /// Extra variables for every worker; the contract variables (`RANK`, ...) take precedence.
    pub env: Vec<(String, String)>,
    /// Whole-job limit, counted from the start of [`launch`]; `Duration::MAX` means none.
    pub timeout: Duration,
    /// What happens to the workers' output.
    pub output: Output,
}

impl LaunchSpec {
    /// A spec for `world_size` copies of `program` with no arguments and the defaults.
    pub fn new(program: impl Into<PathBuf>, world_size: usize) -> Self {
        LaunchSpec {
            program: program.into(),
            args: Vec::new(),
            world_size,
            master_addr: DEFAULT_MASTER_ADDR.to_string(),
            master_port: None,
            env: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
            output: Output::default(),
        }
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
}

/// How one rank ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The worker exited by itself with this code.
    Code(i32),
    /// The worker was terminated by this signal (not sent by the launcher).
    Signal(i32),
    /// Stopped by the launcher because of another rank's failure or the timeout.
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
            Exit::Signal(sig) => match signal_name(sig) {
                Some(name) => write!(f, "killed by signal {sig} ({name})"),
                None => write!(f, "killed by signal {sig}"),
            },
            Exit::KilledByLauncher => f.write_str("stopped by the launcher"),
        }
    }
}

/// How one rank ended, with its output.
#[derive(Debug, Clone)]
pub struct RankOutcome {
    /// The worker's rank.
    pub rank: usize,
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

/// The result of a whole launch.
#[derive(Debug, Clone)]
pub struct LaunchReport {
    /// One entry per rank, in rank order.
    pub ranks: Vec<RankOutcome>,
    /// The `MASTER_PORT` the workers were given.
    pub port: u16,
    /// Wall time of the whole launch.
    pub elapsed: Duration,
    /// Whether the job hit its time limit.
    pub timed_out: bool,
    /// The time limit the job ran under.
    pub timeout: Duration,
    /// The rank whose failure (non-zero exit or signal) the launcher saw first, if any.
    pub first_failed: Option<usize>,
}

impl LaunchReport {
    /// Whether every rank exited with code 0.
    pub fn success(&self) -> bool {
        !self.timed_out
            && !self.ranks.is_empty()
            && self.ranks.iter().all(|r| r.status.is_success())
    }

    /// The rank that failed first in time (not the lowest failed rank); ranks the launcher
    /// killed never count.
    pub fn first_failure(&self) -> Option<&RankOutcome> {
        let first = self.first_failed.and_then(|r| self.ranks.get(r));
        first
            .filter(|r| r.status.is_failure())
            .or_else(|| self.ranks.iter().find(|r| r.status.is_failure()))
    }

    /// One line describing how the job ended, for logs and error messages.
    pub fn summary(&self) -> String {
        let n = self.ranks.len();
        if self.success() {
            return format!("all {n} ranks succeeded in {:.2}s", secs(self.elapsed));
        }
        let killed: Vec<usize> = self
            .ranks
            .iter()
            .filter(|r| r.status == Exit::KilledByLauncher)
            .map(|r| r.rank)
            .collect();
        let mut parts = Vec::new();
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
        parts.join("; ")
    }
}

/// Why [`launch`] could not run the job at all.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// Starting the worker for `rank` failed (e.g. the program does not exist).
    #[error("failed to start rank {rank} ({program}): {source}", program = program.display())]
    Spawn {
        /// The rank that could not be started.
        rank: usize,
        /// The program that was being started.
        program: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The world size is not usable (it must be at least 1).
    #[error("invalid world size {0}: need at least one worker")]
    InvalidWorldSize(usize),
    /// No free master port could be found.
    #[error("could not find a free master port: {0}")]
    Port(#[source] io::Error),
}

/// A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0 and read it back).
///
/// Fails if binding a socket on 127.0.0.1 fails.
pub fn free_port() -> io::Result<u16> {
    free_port_on(DEFAULT_MASTER_ADDR)
}

/// A port that was free on `addr` a moment ago; loopback names use 127.0.0.1.
fn free_port_on(addr: &str) -> io::Result<u16> {
    let host = match addr {
        "" | "localhost" => DEFAULT_MASTER_ADDR,
        other => other,
    };
    let listener = TcpListener::bind((host, 0))?;
    Ok(listener.local_addr()?.port())
}

/// Starts the workers, waits for them, and returns how each ended.
///
/// As soon as one rank fails (non-zero exit or signal), or the timeout passes, every other
/// worker is killed. Fails only if the launch itself fails (program not found, world_size 0,
/// no free port): [`LaunchError`] names what; workers already started are then killed.
pub fn launch(spec: &LaunchSpec) -> Result<LaunchReport, LaunchError> {
    let world = spec.world_size;
    if world == 0 {
        return Err(LaunchError::InvalidWorldSize(world));
    }
    let port = match spec.master_port {
        Some(port) if port != 0 => port,
        _ => free_port_on(&spec.master_addr).map_err(LaunchError::Port)?,
    };
    let start = Instant::now();
    let deadline = start.checked_add(spec.timeout);
    debug!(
        program = %spec.program.display(),
        world,
        port,
        timeout = ?spec.timeout,
        "launching workers"
    );

    let (tx, rx) = mpsc::channel();
    let mut workers = Workers::default();
    let mut streams: Vec<[Pump; 2]> = Vec::with_capacity(world);
    for rank in 0..world {
        let spawn_err = |source| LaunchError::Spawn {
            rank,
            program: spec.program.clone(),
            source,
        };
        let mut child = worker_command(spec, rank, port)
            .spawn()
            .map_err(spawn_err)?;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        debug!(rank, pid = child.id(), "worker started");
        workers.procs.push(Proc {
            child,
            exit: None,
            ended: Duration::ZERO,
        });
        let out = Pump::start(rank, Stream::Stdout, stdout, spec.output, tx.clone());
        let err = Pump::start(rank, Stream::Stderr, stderr, spec.output, tx.clone());
        streams.push([out.map_err(spawn_err)?, err.map_err(spawn_err)?]);
    }
    drop(tx);

    let mut closed = 0usize;
    let mut first_failed = None;
    let mut timed_out = false;
    let mut hints: Vec<usize> = Vec::new();
    loop {
        while let Ok(Event::Closed(rank)) = rx.try_recv() {
            closed += 1;
            hints.push(rank);
        }
        // Ranks whose streams just closed are checked first, in the order they closed, so
        // that the first failure in time wins when several are seen in one sweep.
        let order: Vec<usize> = hints.drain(..).chain(0..world).collect();
        for rank in order {
            if let Some(exit) = workers.poll(rank, start) {
                if exit.is_failure() && first_failed.is_none() {
                    debug!(rank, %exit, "first failure");
                    first_failed = Some(rank);
                }
            }
        }
        if first_failed.is_some() || workers.all_ended() {
            break;
        }
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            debug!(timeout = ?spec.timeout, "job timed out");
            timed_out = true;
            break;
        }
        let wait = deadline.map_or(POLL_INTERVAL, |d| (d - now).min(POLL_INTERVAL));
        match rx.recv_timeout(wait) {
            Ok(Event::Closed(rank)) => {
                closed += 1;
                hints.push(rank);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => thread::sleep(wait),
        }
    }
    workers.kill_remaining(start);

    // Every worker is reaped; collect the output still in flight (bounded, since processes the
    // workers spawned may hold their pipes open).
    let grace_end = Instant::now() + READER_GRACE;
    while closed < 2 * world {
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
        .map(|(rank, (proc_, [out, err]))| RankOutcome {
            rank,
            status: proc_.exit.unwrap_or(Exit::KilledByLauncher),
            stdout: out.finish(),
            stderr: err.finish(),
            elapsed: proc_.ended,
        })
        .collect();
    let report = LaunchReport {
        ranks,
        port,
        elapsed: start.elapsed(),
        timed_out,
        timeout: spec.timeout,
        first_failed,
    };
    debug!(summary = %report.summary(), "launch finished");
    Ok(report)
}

/// The command for one worker: program, args, inherited env + extras + the contract.
fn worker_command(spec: &LaunchSpec, rank: usize, port: u16) -> Command {
    let world = spec.world_size.to_string();
    let rank = rank.to_string();
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (key, value) in &spec.env {
        cmd.env(key, value);
    }
    cmd.env(ENV_MASTER_ADDR, &spec.master_addr)
        .env(ENV_MASTER_PORT, port.to_string())
        .env(ENV_RANK, &rank)
        .env(ENV_WORLD_SIZE, &world)
        .env(ENV_LOCAL_RANK, &rank)
        .env(ENV_LOCAL_WORLD_SIZE, &world)
        .env(ENV_GROUP_RANK, "0")
        .env(ENV_GROUP_WORLD_SIZE, "1");
    cmd
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
#[derive(Default)]
struct Workers {
    procs: Vec<Proc>,
}

impl Workers {
    /// Checks (without blocking) whether `rank` has ended; returns its exit if it just did.
    fn poll(&mut self, rank: usize, start: Instant) -> Option<Exit> {
        let proc_ = &mut self.procs[rank];
        if proc_.exit.is_some() {
            return None;
        }
        let exit = match proc_.child.try_wait() {
            Ok(None) => return None,
            Ok(Some(status)) => classify(status, false),
            Err(e) => {
                // Cannot happen for our own children unless something reaped them behind our
                // back; count the worker as failed rather than waiting forever.
                debug!(rank, error = %e, "cannot wait for worker");
                Exit::Code(-1)
            }
        };
        proc_.exit = Some(exit);
        proc_.ended = start.elapsed();
        debug!(rank, %exit, "worker ended");
        Some(exit)
    }

    fn all_ended(&self) -> bool {
        self.procs.iter().all(|p| p.exit.is_some())
    }

    /// SIGKILLs every worker still running, then reaps them all.
    fn kill_remaining(&mut self, start: Instant) {
        let mut killed = Vec::new();
        for (rank, proc_) in self.procs.iter_mut().enumerate() {
            if proc_.exit.is_none() {
                debug!(rank, "killing worker");
                if let Err(e) = proc_.child.kill() {
                    debug!(rank, error = %e, "kill failed");
                }
                killed.push(rank);
            }
        }
        for rank in killed {
            let proc_ = &mut self.procs[rank];
            proc_.exit = Some(match proc_.child.wait() {
                Ok(status) => classify(status, true),
                Err(e) => {
                    debug!(rank, error = %e, "cannot reap worker");
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

/// Sent by a reader thread when its stream reaches end of file.
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
    /// Starts the thread (none when the stream is missing).
    fn start(
        rank: usize,
        stream: Stream,
        source: Option<impl Read + Send + 'static>,
        output: Output,
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
                    pump(source, stream, prefix.as_deref(), &shared);
                    let _ = tx.send(Event::Closed(rank));
                })?)
            }
            None => {
                let _ = tx.send(Event::Closed(rank));
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

/// Reads `source` line by line until EOF, forwarding each line (when `prefix` is set) and
/// appending it to `buf`.
fn pump(source: impl Read, stream: Stream, prefix: Option<&str>, buf: &Mutex<Captured>) {
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
}
