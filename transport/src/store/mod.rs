//! The bootstrap key-value store through which ranks exchange addresses (c10d's TCPStore,
//! Gloo's rendezvous store).
//!
//! Rank 0 (or the launcher) hosts a [`StoreServer`] at `MASTER_ADDR:MASTER_PORT`; every rank,
//! rank 0 included, talks to it through a [`TcpStore`] client. Under torchrun, whose agent
//! already serves torch's TCPStore there, every rank is a [`TorchStore`] client of that one
//! instead. [`PrefixStore`] gives each communicator its own key space. The wire formats are
//! described in the `protocol` and `torch` modules' sources.
//!
//! ```
//! use std::time::Duration;
//! use chorus_transport::store::{PrefixStore, Store, StoreServer, TcpStore};
//!
//! let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
//! let port = server.local_addr().port();
//! let store = TcpStore::connect("127.0.0.1", port, Duration::from_secs(10)).unwrap();
//! let store = PrefixStore::new("comm0", store);
//! store.set("rank0/addr", b"10.0.0.1:4000").unwrap();
//! assert_eq!(store.get("rank0/addr").unwrap(), b"10.0.0.1:4000");
//! assert_eq!(store.add("joined", 1).unwrap(), 1);
//! ```

mod client;
mod conn;
pub mod handshake;
pub mod pmi;
pub mod protocol;
mod server;
mod torch;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use client::{Presence, TcpStore};
pub use protocol::{MAX_KEY_LEN, MAX_VALUE_LEN};
pub use server::{StoreLimits, StoreServer};
pub use torch::TorchStore;

/// A rendezvous key-value store (set/get/wait/add), as in c10d and Gloo.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any previous value.
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;
    /// Returns the value of `key`, waiting until it is set or the store's timeout passes.
    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError>;
    /// Waits until every key in `keys` is set, or `timeout` passes (error names the missing keys).
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError>;
    /// Atomically adds `delta` to the integer stored at `key` (0 if unset) and returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError>;
    /// Opens a connection of its own on which the server sets `key` to `value` once that
    /// connection closes (this process exited or died), unless `key` is set by then, so that
    /// clients waiting for `key` wake. `None` where the store cannot (torch's TCPStore).
    fn presence(&self, key: &str, value: &[u8]) -> Result<Option<Presence>, StoreError> {
        let _ = (key, value);
        Ok(None)
    }
    /// Closes this client's connections: requests in flight (a thread parked in `wait`) and
    /// later ones fail with [`StoreError::Closed`]. Does nothing by default.
    fn shutdown(&self) {}
}

/// Errors of the rendezvous store.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The server could not listen on its address.
    #[error(
        "cannot listen on {addr} for the rendezvous store: {source} \
         (is another job using MASTER_PORT?)"
    )]
    Bind {
        /// The address that could not be bound.
        addr: SocketAddr,
        /// Why.
        source: Arc<std::io::Error>,
    },
    /// The client could not reach the server before its timeout.
    #[error(
        "cannot reach the rendezvous store at {addr} (MASTER_ADDR:MASTER_PORT) \
         after {waited:?}: {source}"
    )]
    Connect {
        /// The `host:port` tried.
        addr: String,
        /// How long the client kept trying.
        waited: Duration,
        /// The last failure.
        source: Arc<std::io::Error>,
    },
    /// Keys were still unset when the timeout passed.
    #[error("timed out after {waited:?} waiting for store keys {keys:?}")]
    Timeout {
        /// The keys still missing.
        keys: Vec<String>,
        /// The timeout that passed.
        waited: Duration,
    },
    /// An I/O error on the store connection.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: Arc<std::io::Error>,
    },
    /// A malformed or oversized frame, an unknown opcode, or a refused request.
    #[error("rendezvous store protocol error: {0}")]
    Protocol(String),
    /// The server closed the connection.
    #[error("the rendezvous store server closed the connection (did rank 0 exit?)")]
    Closed,
    /// The server refused this client's handshake (another job, or a different secret).
    #[error("the rendezvous store refused this connection: {0}")]
    Refused(String),
}

impl StoreError {
    /// Wraps an I/O error with what was being done.
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        StoreError::Io {
            context: context.into(),
            source: source.into(),
        }
    }
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        (**self).set(key, value)
    }
    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        (**self).get(key)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        (**self).wait(keys, timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        (**self).add(key, delta)
    }
    fn presence(&self, key: &str, value: &[u8]) -> Result<Option<Presence>, StoreError> {
        (**self).presence(key, value)
    }
    fn shutdown(&self) {
        (**self).shutdown();
    }
}

/// A view of another store under a key prefix (Gloo's PrefixStore): every key becomes
/// `"{prefix}/{key}"`.
#[derive(Debug, Clone)]
pub struct PrefixStore<S: Store> {
    prefix: String,
    inner: S,
}

impl<S: Store> PrefixStore<S> {
    /// Wraps `inner` so that every key is stored as `"{prefix}/{key}"`.
    pub fn new(prefix: impl Into<String>, inner: S) -> Self {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    /// The prefix, without the trailing `/`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn full_key(&self, key: &str) -> String {
        format!("{}/{key}", self.prefix)
    }
}

impl<S: Store> Store for PrefixStore<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.inner.set(&self.full_key(key), value)
    }
    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.inner.get(&self.full_key(key))
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let full: Vec<String> = keys.iter().map(|key| self.full_key(key)).collect();
        let full: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait(&full, timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.inner.add(&self.full_key(key), delta)
    }
    fn presence(&self, key: &str, value: &[u8]) -> Result<Option<Presence>, StoreError> {
        self.inner.presence(&self.full_key(key), value)
    }
    fn shutdown(&self) {
        self.inner.shutdown();
    }
}
