//! The library's error type.

use std::io;
use std::sync::Arc;

use chorus_kernels::KernelError;
use chorus_transport::store::StoreError;
use chorus_transport::TransportError;

use crate::{Cause, Fault};

/// Everything that can go wrong in a Chorus call.
#[derive(Debug, Clone, thiserror::Error)]
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
    ///
    /// Made by [`Error::transport`], which takes this process's rank.
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
    /// A CUDA call failed, or the device path could not be set up (feature `cuda`).
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] chorus_kernels::cuda::CudaError),
    /// A call's arguments are invalid (lengths, root rank).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The operating system refused a resource Chorus needs (a thread).
    #[error("{what}: {source}")]
    Resource {
        /// What was being done (`cannot start the worker thread`).
        what: &'static str,
        /// The OS error.
        source: Arc<io::Error>,
    },
    /// A broken invariant inside Chorus (a malformed schedule, an executor bug): a bug
    /// to report, not a misuse.
    #[error("internal error: {0}")]
    Internal(String),
    /// An earlier call failed with the error held here; the communicator cannot be used.
    #[error("communicator unusable after an earlier failure: {0}")]
    Broken(Arc<Error>),
    /// The call was stopped by a fault: a peer that died or whose connection failed (found
    /// here or by another rank), a fault another rank found (its timeout or mismatch), or
    /// [`abort`](crate::Communicator::abort). The fault names its culprit.
    #[error("aborted: {0}")]
    Aborted(Box<Fault>),
    /// This rank's call did not finish within `CHORUS_TIMEOUT`; the fault says which ranks
    /// held it up.
    #[error("rank {}: {}", .0.found_by, .0)]
    Timeout(Box<Fault>),
    /// The ranks of a communicator [shrank](crate::Communicator::shrink) without this one:
    /// another rank's exclusion list named it, or it came to the agreement after the
    /// coordinator's timeout. Ranks are the job's.
    #[error(
        "rank {rank} was left out when its communicator shrank (rank {coordinator} \
         coordinated{})",
        match named_by {
            Some(by) => format!("; rank {by}'s exclusion list named it"),
            None => "; it came after the timeout".to_string(),
        }
    )]
    Excluded {
        /// This rank.
        rank: usize,
        /// The rank that coordinated the agreement.
        coordinator: usize,
        /// The rank whose exclusion list named this one; `None` when it came too late.
        named_by: Option<usize>,
    },
    /// This rank found that ranks called different collectives (or the same one with
    /// different arguments); the fault says what each side called.
    #[error("rank {}: mismatched collectives: {}", .0.found_by, .0)]
    Mismatch(Box<Fault>),
}

impl Error {
    /// The transport's error `source`, seen by `rank` (this process's rank).
    pub fn transport(rank: usize, source: TransportError) -> Error {
        Error::Transport { rank, source }
    }

    /// The fault that stopped the call, where a fault did (also behind [`Error::Broken`]).
    pub fn fault(&self) -> Option<&Fault> {
        match self {
            Error::Aborted(fault) | Error::Timeout(fault) | Error::Mismatch(fault) => Some(fault),
            Error::Broken(earlier) => earlier.fault(),
            _ => None,
        }
    }
}

impl From<Fault> for Error {
    /// The error of the call in which `fault` was found: [`Error::Timeout`] and
    /// [`Error::Mismatch`] for those causes, [`Error::Aborted`] for the others.
    fn from(fault: Fault) -> Error {
        match fault.cause {
            Cause::Timeout => Error::Timeout(Box::new(fault)),
            Cause::Mismatch => Error::Mismatch(Box::new(fault)),
            _ => Error::Aborted(Box::new(fault)),
        }
    }
}

/// Short for `Result<T, chorus::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn a_transport_error_names_the_rank_it_was_made_with() {
        let err = Error::transport(3, TransportError::PeerClosed { peer: 1 });
        assert!(matches!(err, Error::Transport { rank: 3, .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            "rank 3: rank 1 closed its connection (did the process exit or crash?)"
        );
        let source = err.source().expect("the transport's error");
        assert!(matches!(
            source.downcast_ref::<TransportError>(),
            Some(TransportError::PeerClosed { peer: 1 })
        ));
    }

    #[test]
    fn the_source_chain_reaches_the_os_error() {
        let refused = || io::Error::from(io::ErrorKind::ConnectionRefused);
        let err = Error::transport(0, TransportError::io(2, "connect", None, refused()));
        let transport = err.source().expect("the transport's error");
        let os = transport.source().expect("the OS error");
        let os = os.downcast_ref::<Arc<io::Error>>().expect("an io::Error");
        assert_eq!(os.kind(), io::ErrorKind::ConnectionRefused);

        let err = Error::Resource {
            what: "cannot start the worker thread",
            source: io::Error::from(io::ErrorKind::OutOfMemory).into(),
        };
        assert!(err
            .to_string()
            .starts_with("cannot start the worker thread: "));
        let os = err.source().expect("the OS error");
        let os = os.downcast_ref::<Arc<io::Error>>().expect("an io::Error");
        assert_eq!(os.kind(), io::ErrorKind::OutOfMemory);
    }
}
