//! The transport's error type.

use std::time::Duration;

use crate::store::StoreError;

/// What went wrong while moving bytes between ranks.
///
/// Every variant that concerns a peer names its rank, so a failure in a large
/// job points at the process to look at.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// An operating-system error on the connection to `peer`.
    #[error("I/O error with rank {peer} during {op}: {message}")]
    Io {
        /// The peer's rank.
        peer: usize,
        /// What was being done.
        op: &'static str,
        /// The OS error, as text.
        message: String,
    },
    /// The peer closed its connection (its process exited or crashed).
    #[error("rank {peer} closed its connection (did the process exit or crash?)")]
    PeerClosed {
        /// The peer's rank.
        peer: usize,
    },
    /// A request did not complete in time.
    #[error("timed out after {waited:?} in {op} of {len} bytes with rank {peer}")]
    Timeout {
        /// The peer's rank.
        peer: usize,
        /// `send` or `recv`.
        op: &'static str,
        /// The request's length in bytes.
        len: usize,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The peer sent something that does not match what this rank expected.
    #[error("protocol error with rank {peer}: {detail}")]
    Protocol {
        /// The peer's rank.
        peer: usize,
        /// What differed.
        detail: String,
    },
    /// Connection set-up failed.
    #[error("connection set-up failed: {0}")]
    Setup(String),
    /// The rendezvous store failed while exchanging addresses.
    #[error(transparent)]
    Store(#[from] std::sync::Arc<StoreError>),
    /// A peer rank outside `0..world_size`, or the rank itself.
    #[error("invalid peer rank {peer} (world size {world_size}, own rank {rank})")]
    InvalidPeer {
        /// The rank asked for.
        peer: usize,
        /// This rank.
        rank: usize,
        /// Number of ranks.
        world_size: usize,
    },
    /// The transport was aborted; carries the reason.
    #[error("aborted: {0}")]
    Aborted(String),
}

impl From<StoreError> for TransportError {
    fn from(e: StoreError) -> Self {
        TransportError::Store(std::sync::Arc::new(e))
    }
}

impl TransportError {
    /// The peer rank this error concerns, if any.
    pub fn peer(&self) -> Option<usize> {
        match self {
            TransportError::Io { peer, .. }
            | TransportError::PeerClosed { peer }
            | TransportError::Timeout { peer, .. }
            | TransportError::Protocol { peer, .. }
            | TransportError::InvalidPeer { peer, .. } => Some(*peer),
            _ => None,
        }
    }
}
