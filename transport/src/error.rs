//! The transport's error type.

use std::io;
use std::sync::Arc;
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
    #[error("I/O error with rank {peer} during {op}: {}{source}", cannot(.step))]
    Io {
        /// The peer's rank.
        peer: usize,
        /// What was being done: `send`, `recv` or `connect`.
        op: &'static str,
        /// The step of `op` that failed, where narrower (`send the hello`).
        step: Option<String>,
        /// The OS error (shared: the error is `Clone`).
        source: Arc<io::Error>,
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
    /// Connection set-up could not have an operating-system resource: a socket, a
    /// listener, a thread.
    #[error("connection set-up failed: {what}: {source}")]
    Resource {
        /// What was being done (`cannot listen on 10.0.0.1:29500`).
        what: String,
        /// The OS error (shared: the error is `Clone`).
        source: Arc<io::Error>,
    },
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

/// `"cannot {step}: "` for an I/O error's narrower step, else nothing.
fn cannot(step: &Option<String>) -> String {
    step.as_ref()
        .map(|step| format!("cannot {step}: "))
        .unwrap_or_default()
}

impl TransportError {
    /// An I/O error with `peer` during `op` (`send`, `recv`, `connect`), in `step` of it
    /// where narrower.
    pub fn io(peer: usize, op: &'static str, step: Option<String>, e: io::Error) -> Self {
        TransportError::Io {
            peer,
            op,
            step,
            source: Arc::new(e),
        }
    }

    /// A set-up failure to have an operating-system resource, saying `what` was being done.
    pub fn resource(what: impl Into<String>, e: io::Error) -> Self {
        TransportError::Resource {
            what: what.into(),
            source: Arc::new(e),
        }
    }

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

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    /// The OS error at the end of `e`'s source chain, if any.
    fn os_error(e: &TransportError) -> Option<io::ErrorKind> {
        let source = e.source()?;
        Some(source.downcast_ref::<Arc<io::Error>>()?.kind())
    }

    #[test]
    fn an_io_error_keeps_the_os_error_and_says_which_step() {
        let timed_out = || io::Error::new(io::ErrorKind::TimedOut, "it took too long");
        let e = TransportError::io(4, "recv", None, timed_out());
        assert_eq!(e.peer(), Some(4));
        assert_eq!(
            e.to_string(),
            "I/O error with rank 4 during recv: it took too long"
        );
        assert_eq!(os_error(&e), Some(io::ErrorKind::TimedOut));

        let e = TransportError::io(4, "connect", Some("send the hello".into()), timed_out());
        assert_eq!(
            e.to_string(),
            "I/O error with rank 4 during connect: cannot send the hello: it took too long"
        );
        assert_eq!(os_error(&e.clone()), Some(io::ErrorKind::TimedOut));
    }

    #[test]
    fn a_resource_error_keeps_the_os_error() {
        let e = TransportError::resource(
            "cannot listen on 127.0.0.1:1",
            io::Error::new(io::ErrorKind::AddrInUse, "address in use"),
        );
        assert_eq!(e.peer(), None);
        assert_eq!(
            e.to_string(),
            "connection set-up failed: cannot listen on 127.0.0.1:1: address in use"
        );
        assert_eq!(os_error(&e), Some(io::ErrorKind::AddrInUse));
    }
}
