//! The library's error type.

use chorus_kernels::KernelError;
use chorus_transport::store::StoreError;
use chorus_transport::TransportError;

/// Everything that can go wrong in a Chorus call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value (usually an environment variable) is missing or invalid.
    #[error("invalid configuration: {var}={value:?}: {reason}")]
    Config {
        /// The variable's name.
        var: &'static str,
        /// The value found (empty if missing).
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Moving bytes between ranks failed; names the peer rank where known.
    #[error("rank {rank}: {source}")]
    Transport {
        /// This process's rank.
        rank: usize,
        /// The transport's error.
        source: TransportError,
    },
    /// The rendezvous store failed.
    #[error("rendezvous failed: {0}")]
    Store(#[from] StoreError),
    /// A reduction kernel rejected its input.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A call's arguments are invalid (lengths, root rank).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An earlier operation failed; the communicator cannot be used.
    #[error("communicator unusable after an earlier failure: {0}")]
    Broken(String),
    /// The operation was aborted: by [`abort`](crate::Communicator::abort), or because a rank
    /// found a fault (the text names it: a dead rank, a mismatched call, a stall).
    #[error("aborted: {0}")]
    Aborted(String),
    /// A collective did not finish within `CHORUS_TIMEOUT`; says which ranks held it up.
    #[error("rank {rank}: {detail}")]
    Timeout {
        /// This process's rank.
        rank: usize,
        /// The call, how long it waited, and what the other ranks were doing.
        detail: String,
    },
    /// Ranks called different collectives (or the same one with different arguments).
    #[error("rank {rank}: mismatched collectives: {detail}")]
    Mismatch {
        /// This process's rank.
        rank: usize,
        /// What each side called.
        detail: String,
    },
}

impl From<TransportError> for Error {
    fn from(source: TransportError) -> Self {
        // The rank is filled in by the communicator; see `Error::on_rank`.
        Error::Transport {
            rank: usize::MAX,
            source,
        }
    }
}

impl Error {
    /// Stamps this rank onto a transport error.
    pub(crate) fn on_rank(self, rank: usize) -> Error {
        match self {
            Error::Transport { source, .. } => Error::Transport { rank, source },
            other => other,
        }
    }
}

/// Short for `Result<T, chorus::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
