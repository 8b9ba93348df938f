//! What the store clients share: a pool of blocking connections to one server, each opened
//! with a retry until a deadline and greeted by the client's own handshake, and reads and
//! writes bounded by a deadline.
//!
//! Idle connections wait in the pool; a request takes one (or opens one when all are in use, so
//! a thread parked in a wait never holds up another thread's set) and gives it back once its
//! exchange has completed. When a request times out or its connection fails, the connection's
//! state is unknown (a late response may still arrive), so it is closed instead of being given
//! back; the next request opens a new one.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tracing::{debug, trace};

use super::StoreError;

const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(500);
/// The longest a single TCP connect attempt may take before the next address or retry.
const MAX_ATTEMPT: Duration = Duration::from_secs(5);
/// The most time spent, after a wait timed out, asking which of its keys are missing.
const MISSING_KEYS_BUDGET: Duration = Duration::from_secs(2);

/// A client's handshake, run on every new connection before its first request.
pub(super) trait Greeting: fmt::Debug + Send + Sync {
    /// Greets the server on `stream` (whose read and write timeouts bound it).
    fn greet(&self, stream: &mut TcpStream) -> Result<(), StoreError>;
}

/// Connections to one store server, usable from several threads.
#[derive(Debug)]
pub(super) struct Pool<G> {
    greeting: G,
    host: String,
    port: u16,
    idle: Mutex<Vec<TcpStream>>,
    /// Handles on the connections requests are using, so [`shutdown`](Self::shutdown) can
    /// interrupt them; keyed by a request counter.
    busy: Mutex<HashMap<u64, TcpStream>>,
    requests: AtomicU64,
    closed: AtomicBool,
}

impl<G: Greeting> Pool<G> {
    /// Opens the first connection to `host:port`, retrying until `deadline`.
    pub fn connect(
        host: &str,
        port: u16,
        greeting: G,
        deadline: Instant,
    ) -> Result<Pool<G>, StoreError> {
        let stream = connect_with_retry(host, port, &greeting, deadline, Refused::Retry)?;
        Ok(Pool {
            greeting,
            host: host.to_owned(),
            port,
            idle: Mutex::new(vec![stream]),
            busy: Mutex::new(HashMap::new()),
            requests: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        })
    }

    /// Opens a connection of its own, outside the pool, before `deadline`.
    pub fn open(&self, deadline: Instant) -> Result<TcpStream, StoreError> {
        self.reconnect(deadline)
    }

    /// A new connection to the server this pool reached before: a refusal now means the
    /// server has gone (its process exited), so it fails at once instead of retrying.
    fn reconnect(&self, deadline: Instant) -> Result<TcpStream, StoreError> {
        let (host, port) = (&self.host, self.port);
        connect_with_retry(host, port, &self.greeting, deadline, Refused::Final)
    }

    /// The server's `host:port`, for messages.
    pub fn addr(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// Runs one exchange on a connection (pooled, or opened before `deadline`); the connection
    /// goes back to the pool only if `exchange` succeeds.
    pub fn run<T>(
        &self,
        deadline: Instant,
        exchange: impl FnOnce(&TcpStream) -> Result<T, Failure>,
    ) -> Result<T, Failure> {
        if self.closed.load(Ordering::Acquire) {
            return Err(StoreError::Closed.into());
        }
        let pooled = self.with_idle(Vec::pop);
        let stream = match pooled {
            Some(stream) => stream,
            None => self.reconnect(deadline)?,
        };
        let id = self.requests.fetch_add(1, Ordering::Relaxed);
        if let Ok(handle) = stream.try_clone() {
            lock(&self.busy).insert(id, handle);
        }
        if self.closed.load(Ordering::Acquire) {
            let _ = stream.shutdown(Shutdown::Both);
        }
        let result = exchange(&stream);
        lock(&self.busy).remove(&id);
        // Only a completed exchange leaves the connection in a known state.
        if result.is_ok() && !self.closed.load(Ordering::Acquire) {
            self.with_idle(|idle| idle.push(stream));
        }
        result
    }

    /// Closes every connection, interrupting exchanges in flight (they fail with
    /// [`StoreError::Closed`]); later ones fail the same way.
    pub fn shutdown(&self) {
        self.closed.store(true, Ordering::Release);
        for stream in self.with_idle(std::mem::take) {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for stream in lock(&self.busy).values() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    fn with_idle<T>(&self, f: impl FnOnce(&mut Vec<TcpStream>) -> T) -> T {
        // Only pushes and pops run under the lock, so a poisoned pool is still consistent.
        f(&mut lock(&self.idle))
    }

    /// Connections waiting in the pool.
    #[cfg(test)]
    pub fn idle_len(&self) -> usize {
        self.with_idle(|idle| idle.len())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How a request failed: its deadline passed, or anything else.
#[derive(Debug)]
pub(super) enum Failure {
    TimedOut,
    Store(StoreError),
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        Failure::Store(e)
    }
}

impl Failure {
    /// For requests that never block in the server, a timeout is an I/O failure.
    pub fn into_io_error(self, what: impl FnOnce() -> String) -> StoreError {
        match self {
            Failure::TimedOut => StoreError::io(
                format!("{} timed out", what()),
                io::ErrorKind::TimedOut.into(),
            ),
            Failure::Store(e) => e,
        }
    }
}

/// Ends a wait for `keys` whose exchange gave `result`: `Ok(true)` when they were all set,
/// `Ok(false)` or [`Failure::TimedOut`] when `timeout` passed first. After a timeout, `which`
/// says which keys are set (by a deadline within `store_timeout` and [`MISSING_KEYS_BUDGET`]), so
/// the error names those still missing (all of them if `which` fails).
pub(super) fn finish_wait(
    result: Result<bool, Failure>,
    keys: &[&str],
    timeout: Duration,
    store_timeout: Duration,
    which: impl FnOnce(Instant) -> Result<Vec<bool>, Failure>,
) -> Result<(), StoreError> {
    match result {
        Ok(true) => return Ok(()),
        Ok(false) | Err(Failure::TimedOut) => {}
        Err(Failure::Store(e)) => return Err(e),
    }
    let budget = store_timeout.min(MISSING_KEYS_BUDGET);
    let set = which(Instant::now() + budget).ok();
    let missing: Vec<String> = match set {
        Some(set) if set.len() == keys.len() => keys
            .iter()
            .zip(set)
            .filter(|(_, set)| !set)
            .map(|(key, _)| key.to_string())
            .collect(),
        _ => keys.iter().map(|key| key.to_string()).collect(),
    };
    if missing.is_empty() {
        return Ok(()); // Everything arrived just as the timeout passed.
    }
    Err(StoreError::Timeout {
        keys: missing,
        waited: timeout,
    })
}

/// Writes all of `buf` before `deadline`.
pub(super) fn write_all_by(
    mut stream: &TcpStream,
    mut buf: &[u8],
    deadline: Instant,
) -> Result<(), Failure> {
    while !buf.is_empty() {
        stream
            .set_write_timeout(Some(remaining(deadline)?))
            .map_err(|e| io_failure("setting the store write timeout", e))?;
        match stream.write(buf) {
            Ok(0) => return Err(StoreError::Closed.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) => check_retryable(e, deadline, "sending a store request")?,
        }
    }
    Ok(())
}

/// Fills `buf` before `deadline`.
pub(super) fn read_exact_by(
    mut stream: &TcpStream,
    mut buf: &mut [u8],
    deadline: Instant,
) -> Result<(), Failure> {
    while !buf.is_empty() {
        stream
            .set_read_timeout(Some(remaining(deadline)?))
            .map_err(|e| io_failure("setting the store read timeout", e))?;
        match stream.read(buf) {
            Ok(0) => return Err(StoreError::Closed.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) => check_retryable(e, deadline, "reading a store response")?,
        }
    }
    Ok(())
}

/// Time left before `deadline`, or [`Failure::TimedOut`] when none is (a zero socket timeout
/// would mean "block forever").
fn remaining(deadline: Instant) -> Result<Duration, Failure> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(Failure::TimedOut);
    }
    Ok(left)
}

/// Classifies a socket error: Ok to try again (interrupted, or a socket timeout before the
/// deadline), else the failure to report.
fn check_retryable(e: io::Error, deadline: Instant, context: &str) -> Result<(), Failure> {
    match e.kind() {
        io::ErrorKind::Interrupted => Ok(()),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => remaining(deadline).map(|_| ()),
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::UnexpectedEof => Err(StoreError::Closed.into()),
        _ => Err(io_failure(context, e)),
    }
}

fn io_failure(context: &str, e: io::Error) -> Failure {
    StoreError::io(context, e).into()
}

/// What a refused connection means to [`connect_with_retry`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    /// The server may not be up yet: retry.
    Retry,
    /// The server was up and has gone: fail.
    Final,
}

/// Connects to `host:port` and passes the handshake, retrying unreachable servers with a
/// doubling backoff until `deadline` (refused connections too, unless `refused` is final).
fn connect_with_retry(
    host: &str,
    port: u16,
    greeting: &dyn Greeting,
    deadline: Instant,
    refused: Refused,
) -> Result<TcpStream, StoreError> {
    let start = Instant::now();
    let mut backoff = FIRST_BACKOFF;
    loop {
        let error = match try_connect(host, port, deadline) {
            Ok(mut stream) => {
                let left = deadline.saturating_duration_since(Instant::now());
                let bound = Some(left.max(Duration::from_millis(1)));
                stream
                    .set_read_timeout(bound)
                    .and_then(|()| stream.set_write_timeout(bound))
                    .map_err(|e| StoreError::io("store handshake", e))?;
                greeting.greet(&mut stream)?;
                debug!(host, port, "connected to the rendezvous store");
                return Ok(stream);
            }
            Err(error) => error,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let gone = refused == Refused::Final && error.kind() == io::ErrorKind::ConnectionRefused;
        if left.is_zero() || gone {
            return Err(StoreError::Connect {
                addr: format!("{host}:{port}"),
                waited: start.elapsed(),
                source: error.into(),
            });
        }
        trace!(host, port, error = %error, "rendezvous store not reachable yet; retrying");
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One round: resolve `host` and try each of its addresses once.
fn try_connect(host: &str, port: u16, deadline: Instant) -> io::Result<TcpStream> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| io::Error::new(e.kind(), format!("cannot resolve host {host:?}: {e}")))?
        .collect();
    if addrs.is_empty() {
        let message = format!("host {host:?} has no address");
        return Err(io::Error::new(io::ErrorKind::NotFound, message));
    }
    let mut last = io::Error::new(io::ErrorKind::TimedOut, "no time left to connect");
    for addr in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match TcpStream::connect_timeout(&addr, left.min(MAX_ATTEMPT)) {
            Ok(stream) if is_self_connected(&stream) => {
                last = io::Error::new(io::ErrorKind::ConnectionRefused, "nothing listening");
            }
            Ok(stream) => {
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Whether TCP simultaneous open connected the socket to itself: retrying a local port in the
/// ephemeral range where nothing listens can pick that very port as the source.
fn is_self_connected(stream: &TcpStream) -> bool {
    matches!((stream.local_addr(), stream.peer_addr()), (Ok(local), Ok(peer)) if local == peer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Silent;

    impl Greeting for Silent {
        fn greet(&self, _: &mut TcpStream) -> Result<(), StoreError> {
            Ok(())
        }
    }

    #[test]
    fn remaining_is_a_timeout_once_the_deadline_passed() {
        assert!(matches!(remaining(Instant::now()), Err(Failure::TimedOut)));
        let left = remaining(Instant::now() + Duration::from_secs(60)).unwrap();
        assert!(left > Duration::ZERO);
    }

    #[test]
    fn socket_errors_are_classified() {
        let later = Instant::now() + Duration::from_secs(60);
        let kind = |kind: io::ErrorKind, deadline| check_retryable(kind.into(), deadline, "test");
        assert!(kind(io::ErrorKind::Interrupted, later).is_ok());
        assert!(kind(io::ErrorKind::WouldBlock, later).is_ok());
        let now = Instant::now();
        assert!(matches!(
            kind(io::ErrorKind::WouldBlock, now),
            Err(Failure::TimedOut)
        ));
        assert!(matches!(
            kind(io::ErrorKind::ConnectionReset, later),
            Err(Failure::Store(StoreError::Closed))
        ));
        assert!(matches!(
            kind(io::ErrorKind::PermissionDenied, later),
            Err(Failure::Store(StoreError::Io { .. }))
        ));
    }

    #[test]
    fn a_zero_timeout_connect_fails_without_blocking() {
        let err = connect_with_retry("127.0.0.1", 9, &Silent, Instant::now(), Refused::Retry)
            .unwrap_err();
        assert!(matches!(err, StoreError::Connect { .. }), "{err}");
    }

    #[test]
    fn a_failed_exchange_leaves_its_connection_out_of_the_pool() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let deadline = Instant::now() + Duration::from_secs(10);
        let pool = Pool::connect("127.0.0.1", port, Silent, deadline).unwrap();
        let _conn = listener.accept().unwrap();
        assert_eq!(pool.idle_len(), 1);
        assert!(pool.run(deadline, |_| Ok(())).is_ok());
        assert_eq!(pool.idle_len(), 1);
        let failed: Result<(), Failure> = pool.run(deadline, |_| Err(Failure::TimedOut));
        assert!(failed.is_err());
        assert_eq!(pool.idle_len(), 0);
        pool.shutdown();
        let closed = pool.run(deadline, |_| Ok(()));
        assert!(matches!(closed, Err(Failure::Store(StoreError::Closed))));
    }

    #[test]
    fn a_timed_out_wait_names_the_keys_still_missing() {
        let keys = ["a", "b", "c"];
        let timeout = Duration::from_millis(5);
        let store = Duration::from_secs(1);
        let err = finish_wait(Ok(false), &keys, timeout, store, |_| {
            Ok(vec![true, false, true])
        });
        match err.unwrap_err() {
            StoreError::Timeout { keys, waited } => {
                assert_eq!((keys, waited), (vec!["b".to_string()], timeout));
            }
            other => panic!("{other}"),
        }
        let err = finish_wait(Err(Failure::TimedOut), &keys, timeout, store, |_| {
            Err(Failure::TimedOut)
        });
        assert!(matches!(err, Err(StoreError::Timeout { keys, .. }) if keys.len() == 3));
        let late = finish_wait(Ok(false), &keys, timeout, store, |_| Ok(vec![true; 3]));
        assert!(late.is_ok());
        assert!(finish_wait(Ok(true), &keys, timeout, store, |_| unreachable!()).is_ok());
    }
}
