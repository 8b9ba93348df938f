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
    /// An earlier operation failed or the communicator was aborted; it cannot be used.
    #[error("communicator unusable after an earlier failure: {0}")]
    Broken(String),
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
