//! The store client: blocking TCP connections, one request/response at a time on each.
//!
//! Idle connections wait in a small pool; a request takes one (or opens one when all are in
//! use, so a thread parked in `get` never holds up another thread's `set`) and gives it back
//! once its response has been read. Every request runs under a deadline enforced with socket
//! read/write timeouts. When a request times out or its connection fails, the connection's
//! state is unknown (a late response may still arrive), so it is closed instead of being given
//! back; the next request opens a new one, retrying until its deadline like
//! [`TcpStore::connect`]. A WAIT that times out asks the server, on another connection, which
//! of its keys are still missing, to name them in the error.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tracing::{debug, trace};

use super::handshake;
use super::protocol::{self, RESPONSE_HEADER_LEN, STATUS_OK};
use super::{Store, StoreError};
use crate::auth::Auth;

const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(500);
/// The longest a single TCP connect attempt may take before the next address or retry.
const MAX_ATTEMPT: Duration = Duration::from_secs(5);
/// The most time spent, after a WAIT timed out, asking which of its keys are missing.
const MISSING_KEYS_BUDGET: Duration = Duration::from_secs(2);

/// A client connection to a store server.
///
/// Usable from several threads: concurrent requests use separate pooled connections. After a
/// timeout or a connection failure that connection is closed and later requests reconnect.
#[derive(Debug)]
pub struct TcpStore {
    auth: Auth,
    host: String,
    port: u16,
    timeout: Duration,
    idle: Mutex<Vec<TcpStream>>,
    /// Handles on the connections requests are using, so [`shutdown`](Self::shutdown) can
    /// interrupt them; keyed by a request counter.
    busy: Mutex<HashMap<u64, TcpStream>>,
    requests: AtomicU64,
    closed: AtomicBool,
}

impl TcpStore {
    /// Connects to `host:port`, retrying (connection refused / host not yet up) until `timeout`
    /// passes; `timeout` also bounds every later get/wait.
    ///
    /// Fails with [`StoreError::Connect`] naming the address and how long it tried.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<TcpStore, StoreError> {
        TcpStore::connect_with_auth(host, port, timeout, Auth::default())
    }

    /// Like [`connect`](Self::connect), proving membership of `auth`'s job on every connection.
    ///
    /// Fails at once with [`StoreError::Refused`] if the server belongs to another job or
    /// expects another secret.
    pub fn connect_with_auth(
        host: &str,
        port: u16,
        timeout: Duration,
        auth: Auth,
    ) -> Result<TcpStore, StoreError> {
        let stream = connect_with_retry(host, port, &auth, Instant::now() + timeout)?;
        Ok(TcpStore {
            auth,
            host: host.to_owned(),
            port,
            timeout,
            idle: Mutex::new(vec![stream]),
            busy: Mutex::new(HashMap::new()),
            requests: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        })
    }

    /// Closes every connection, interrupting requests in flight (they fail with
    /// [`StoreError::Closed`]); later requests fail the same way.
    pub fn shutdown(&self) {
        self.closed.store(true, Ordering::Release);
        for stream in self.with_idle(std::mem::take) {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for stream in lock(&self.busy).values() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// The timeout bounding connects, gets and every request's I/O.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sends one request and returns the OK payload, reconnecting first if needed.
    fn call(&self, request: &[u8], deadline: Instant) -> Result<Vec<u8>, Failure> {
        if self.closed.load(Ordering::Acquire) {
            return Err(StoreError::Closed.into());
        }
        let pooled = self.with_idle(Vec::pop);
        let stream = match pooled {
            Some(stream) => stream,
            None => connect_with_retry(&self.host, self.port, &self.auth, deadline)?,
        };
        let id = self.requests.fetch_add(1, Ordering::Relaxed);
        if let Ok(handle) = stream.try_clone() {
            lock(&self.busy).insert(id, handle);
        }
        if self.closed.load(Ordering::Acquire) {
            let _ = stream.shutdown(Shutdown::Both);
        }
        let exchanged = exchange(&stream, request, deadline);
        lock(&self.busy).remove(&id);
        let (status, payload) = exchanged?;
        // Only a completed exchange leaves the connection in a known state.
        if !self.closed.load(Ordering::Acquire) {
            self.with_idle(|idle| idle.push(stream));
        }
        if status != STATUS_OK {
            let message = String::from_utf8_lossy(&payload);
            return Err(
                StoreError::Protocol(format!("server refused the request: {message}")).into(),
            );
        }
        Ok(payload)
    }

    fn with_idle<T>(&self, f: impl FnOnce(&mut Vec<TcpStream>) -> T) -> T {
        // Only pushes and pops run under the lock, so a poisoned pool is still consistent.
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&mut idle)
    }

    /// Asks, in a new request, which of `keys` are still unset (all of them if that fails).
    fn missing_keys(&self, keys: &[&str]) -> Vec<String> {
        let budget = self.timeout.min(MISSING_KEYS_BUDGET);
        let all = || keys.iter().map(|key| key.to_string()).collect();
        let Ok(set) = self.call(&protocol::encode_check(keys), Instant::now() + budget) else {
            return all();
        };
        if set.len() != keys.len() {
            return all();
        }
        let missing = keys.iter().zip(set).filter(|(_, set)| *set == 0);
        missing.map(|(key, _)| key.to_string()).collect()
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        protocol::check_key(key)?;
        protocol::check_value(value)?;
        let deadline = Instant::now() + self.timeout;
        let request = protocol::encode_set(key, value);
        let what = || format!("set of store key {key:?}");
        self.call(&request, deadline)
            .map_err(|f| f.into_io_error(what))?;
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        protocol::check_key(key)?;
        let deadline = Instant::now() + self.timeout;
        self.call(&protocol::encode_get(key), deadline)
            .map_err(|failure| match failure {
                Failure::TimedOut => StoreError::Timeout {
                    keys: vec![key.to_owned()],
                    waited: self.timeout,
                },
                Failure::Store(e) => e,
            })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        protocol::check_keys(keys)?;
        if keys.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        match self.call(&protocol::encode_wait(keys), deadline) {
            Ok(_) => Ok(()),
            Err(Failure::Store(e)) => Err(e),
            Err(Failure::TimedOut) => {
                let keys = self.missing_keys(keys);
                if keys.is_empty() {
                    return Ok(()); // Everything arrived just as the timeout passed.
                }
                Err(StoreError::Timeout {
                    keys,
                    waited: timeout,
                })
            }
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        protocol::check_key(key)?;
        let deadline = Instant::now() + self.timeout;
        let what = || format!("add to store key {key:?}");
        let payload = self
            .call(&protocol::encode_add(key, delta), deadline)
            .map_err(|f| f.into_io_error(what))?;
        let bytes: [u8; 8] = payload.as_slice().try_into().map_err(|_| {
            StoreError::Protocol(format!("add answered {} bytes, not 8", payload.len()))
        })?;
        Ok(i64::from_le_bytes(bytes))
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How a request failed: its deadline passed, or anything else.
#[derive(Debug)]
enum Failure {
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
    fn into_io_error(self, what: impl FnOnce() -> String) -> StoreError {
        match self {
            Failure::TimedOut => StoreError::io(
                format!("{} timed out", what()),
                io::ErrorKind::TimedOut.into(),
            ),
            Failure::Store(e) => e,
        }
    }
}

/// Writes `request` and reads the response header and payload, all before `deadline`.
fn exchange(
    stream: &TcpStream,
    request: &[u8],
    deadline: Instant,
) -> Result<(u8, Vec<u8>), Failure> {
    write_all_by(stream, request, deadline)?;
    let mut header = [0u8; RESPONSE_HEADER_LEN];
    read_exact_by(stream, &mut header, deadline)?;
    let (status, len) = protocol::decode_response_header(&header)?;
    let mut payload = vec![0u8; len]; // len was checked against MAX_VALUE_LEN.
    read_exact_by(stream, &mut payload, deadline)?;
    Ok((status, payload))
}

fn write_all_by(mut stream: &TcpStream, mut buf: &[u8], deadline: Instant) -> Result<(), Failure> {
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

fn read_exact_by(
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

/// Connects to `host:port` and passes the handshake, retrying unreachable servers with a
/// doubling backoff until `deadline`.
fn connect_with_retry(
    host: &str,
    port: u16,
    auth: &Auth,
    deadline: Instant,
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
                handshake::client(&mut stream, auth)?;
                debug!(host, port, "connected to the rendezvous store");
                return Ok(stream);
            }
            Err(error) => error,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(StoreError::Connect {
                addr: format!("{host}:{port}"),
                waited: start.elapsed(),
                source: error,
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
    use crate::auth::{MAC_LEN, NONCE_LEN};

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
        let err = connect_with_retry("127.0.0.1", 9, &Auth::default(), Instant::now()).unwrap_err();
        assert!(matches!(err, StoreError::Connect { .. }), "{err}");
    }

    #[test]
    fn a_timed_out_request_leaves_its_connection_out_of_the_pool() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        // A "server" that admits the client, then never answers.
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            conn.write_all(&handshake::challenge(&[0; NONCE_LEN]))
                .unwrap();
            let mut answer = [0u8; 5 + MAC_LEN];
            conn.read_exact(&mut answer).unwrap();
            conn.write_all(&[0]).unwrap();
            conn
        });
        let store = TcpStore::connect("127.0.0.1", port, Duration::from_millis(200)).unwrap();
        let _silent = server.join().unwrap();
        assert_eq!(store.with_idle(|idle| idle.len()), 1);
        let err = store.set("k", b"v").unwrap_err();
        assert!(matches!(err, StoreError::Io { .. }), "{err}");
        assert!(err.to_string().contains("timed out"), "{err}");
        assert_eq!(store.with_idle(|idle| idle.len()), 0);
    }
}
