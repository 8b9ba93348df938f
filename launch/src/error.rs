//! Why a launch could not run.

use std::io;
use std::path::PathBuf;

/// Why [`launch`](crate::launch) could not run the job at all.
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
