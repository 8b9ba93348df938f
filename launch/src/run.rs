//! Running a launch: the contract's variables, starting and watching the workers, stopping
//! them on a failure, a timeout or an interrupt, and restarts.

use std::fs::File;
use std::io;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use chorus_env as env;
use tracing::{debug, warn};

use crate::output::{Event, Pump, Stream};
use crate::report::describe_signal;
use crate::{
    gpus_for_local_rank, Exit, Interrupt, LaunchError, LaunchReport, LaunchSpec, PortReservation,
    RankOutcome, READER_GRACE,
};

/// Fallback interval between checks of the workers' state.
const POLL_INTERVAL: Duration = Duration::from_millis(5);
/// Signal number of SIGKILL (the same on every Unix Chorus runs on).
const SIGKILL: i32 = 9;
/// Signal number of SIGTERM (the same on every Unix Chorus runs on).
const SIGTERM: i32 = 15;

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
/// worker is killed (unless [`LaunchSpec::wait_all`]); after a failure, while restarts remain,
/// the group starts again. Fails only if the launch itself fails (program not found, no
/// workers, bad node rank, no port to reserve, a log file that cannot be created):
/// [`LaunchError`] names what; workers already started are then killed.
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
    // Held until every worker is gone, so that the port stays rank 0's across restarts.
    let reservation = match spec.master_port {
        Some(port) if port != 0 => None,
        _ if spec.nnodes > 1 => return Err(LaunchError::MasterPortRequired(spec.nnodes)),
        _ => Some(PortReservation::new(&spec.master_addr).map_err(LaunchError::Port)?),
    };
    let port = match &reservation {
        Some(reserved) => reserved.port(),
        None => spec.master_port.unwrap_or_default(),
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
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let launcher = nix::unistd::getpid();
        // SAFETY: the hook runs in the forked child before exec and makes only
        // async-signal-safe system calls (prctl, getppid); it neither allocates nor locks.
        unsafe {
            cmd.pre_exec(move || die_with_launcher(launcher));
        }
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

/// In a forked worker before exec: asks the kernel for SIGKILL when the launcher dies, so that
/// `kill -9` of the launcher leaves no worker behind.
///
/// The kernel sends it when the *thread* that forked exits; that thread is the one in
/// `run_attempt`, which reaps every worker it starts before it returns, so it outlives them
/// unless the launcher dies. Fails (and the worker is not started) if the launcher died before
/// the request was in place, when the worker's parent is no longer `launcher`.
#[cfg(target_os = "linux")]
fn die_with_launcher(launcher: nix::unistd::Pid) -> io::Result<()> {
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
    if nix::unistd::getppid() != launcher {
        return Err(nix::errno::Errno::ESRCH.into());
    }
    Ok(())
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
