//! How a launch ended: each rank's [`Exit`] and output, and the [`LaunchReport`] with its
//! summary line and exit code.

use std::fmt;
use std::time::Duration;

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
    /// Everything it wrote to stdout (lossy UTF-8; see [`MAX_CAPTURED_BYTES`](crate::MAX_CAPTURED_BYTES)).
    pub stdout: String,
    /// Everything it wrote to stderr (lossy UTF-8; see [`MAX_CAPTURED_BYTES`](crate::MAX_CAPTURED_BYTES)).
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
    /// The signal an [`Interrupt`](crate::Interrupt) forwarded to the workers, if the job was interrupted.
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

    /// Whether the job went on without the ranks a signal killed (see
    /// [`LaunchSpec::wait_all`](crate::LaunchSpec::wait_all)) and ended well: every other rank
    /// exited with code 0, at least one did, and the job was neither timed out nor
    /// interrupted. A rank that exited with another code failed; it was not lost.
    pub fn survived(&self) -> bool {
        !self.timed_out
            && self.interrupted.is_none()
            && self.ranks.iter().any(|r| r.status.is_success())
            && self
                .ranks
                .iter()
                .all(|r| matches!(r.status, Exit::Code(0) | Exit::Signal(_)))
    }

    /// The ranks a signal killed.
    pub fn lost(&self) -> Vec<usize> {
        let lost = self
            .ranks
            .iter()
            .filter(|r| matches!(r.status, Exit::Signal(_)));
        lost.map(|r| r.rank).collect()
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
pub(crate) fn describe_signal(sig: i32) -> String {
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
}
