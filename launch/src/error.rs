//! Why a launch could not run.

use std::io;
use std::path::PathBuf;

use crate::LaunchReport;

/// Why [`launch`](crate::launch) could not run the job at all, or why the job of
/// [`run_copies`](crate::run_copies) did not succeed.
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
    /// No master port could be reserved (see [`PortReservation`](crate::PortReservation)).
    #[error("could not reserve a master port: {0}")]
    Port(#[source] io::Error),
    /// The running program cannot find its own file (to start copies of it).
    #[error("cannot find the running program: {0}")]
    CurrentExe(#[source] io::Error),
    /// The job ran and did not succeed (only from [`run_copies`](crate::run_copies)): its
    /// report, shown as the summary and the stderr of the rank that failed first.
    #[error("{}", failure(.0))]
    Failed(Box<LaunchReport>),
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

/// The summary of a failed job, then the stderr of the rank that failed first.
fn failure(report: &LaunchReport) -> String {
    let mut text = report.summary();
    if let Some(failed) = report.first_failure() {
        text.push_str(&format!(
            "\n--- rank {} stderr:\n{}",
            failed.rank,
            failed.stderr.trim_end()
        ));
    }
    text
}
