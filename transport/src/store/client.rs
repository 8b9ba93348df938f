//! The client of Chorus's own store: one request/response at a time on each pooled connection
//! (see the `conn` module), every one under a deadline. A WAIT that times out asks the server,
//! on another connection, which of its keys are still missing, to name them in the error.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::conn::{self, read_exact_by, write_all_by, Failure, Greeting, Pool};
use super::handshake;
use super::protocol::{self, MAX_KEY_LEN, RESPONSE_HEADER_LEN, STATUS_OK};
use super::{Store, StoreError};
use crate::auth::Auth;

/// A client connection to a store server.
///
/// Usable from several threads: concurrent requests use separate pooled connections. After a
/// timeout or a connection failure that connection is closed and later requests reconnect,
/// retrying until their deadline like [`TcpStore::connect`].
#[derive(Debug)]
pub struct TcpStore {
    pool: Pool<Auth>,
    timeout: Duration,
}

impl Greeting for Auth {
    fn greet(&self, stream: &mut TcpStream) -> Result<(), StoreError> {
        handshake::client(stream, self)
    }
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
        let pool = Pool::connect(host, port, auth, Instant::now() + timeout)?;
        Ok(TcpStore { pool, timeout })
    }

    /// The timeout bounding connects, gets and every request's I/O.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Which of `keys` are set now, in order, without waiting for any.
    pub fn check(&self, keys: &[&str]) -> Result<Vec<bool>, StoreError> {
        protocol::check_keys(keys)?;
        let deadline = Instant::now() + self.timeout;
        let set = self
            .call(&protocol::encode_check(keys), deadline)
            .map_err(|f| f.into_io_error(|| format!("check of store keys {keys:?}")))?;
        Ok(set.into_iter().map(|set| set != 0).collect())
    }

    /// Sends one request and returns the OK payload, reconnecting first if needed.
    fn call(&self, request: &[u8], deadline: Instant) -> Result<Vec<u8>, Failure> {
        let (status, payload) = self
            .pool
            .run(deadline, |stream| exchange(stream, request, deadline))?;
        if status != STATUS_OK {
            let message = String::from_utf8_lossy(&payload);
            return Err(
                StoreError::Protocol(format!("server refused the request: {message}")).into(),
            );
        }
        Ok(payload)
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
        let result = self.call(&protocol::encode_wait(keys), deadline);
        conn::finish_wait(
            result.map(|_| true),
            keys,
            timeout,
            self.timeout,
            |deadline| {
                let set = self.call(&protocol::encode_check(keys), deadline)?;
                Ok(set.into_iter().map(|set| set != 0).collect())
            },
        )
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

    fn presence(&self, key: &str, value: &[u8]) -> Result<Option<Presence>, StoreError> {
        if key.is_empty() || key.len() > MAX_KEY_LEN || value.len() > MAX_KEY_LEN {
            return Err(StoreError::Protocol(format!(
                "a held key must have 1 to {MAX_KEY_LEN} bytes and its value at most as many; \
                 got {} and {}",
                key.len(),
                value.len()
            )));
        }
        let deadline = Instant::now() + self.timeout;
        let stream = self.pool.open(deadline)?;
        hold(&stream, key, value, deadline)?;
        Ok(Some(Presence {
            stream,
            timeout: self.timeout,
        }))
    }

    fn shutdown(&self) {
        self.pool.shutdown();
    }
}

/// A connection of its own to a store server, on which the server sets a key when the
/// connection closes (see [`Store::presence`]). Dropping it closes the connection and so sets
/// the key; [`release`](Presence::release) withdraws the key first.
#[derive(Debug)]
pub struct Presence {
    stream: TcpStream,
    timeout: Duration,
}

impl Presence {
    /// Withdraws the key, then closes the connection.
    pub fn release(self) -> Result<(), StoreError> {
        hold(&self.stream, "", b"", Instant::now() + self.timeout)
    }
}

/// Sends a HOLD request on `stream` (an empty `key` withdraws the connection's hold).
fn hold(stream: &TcpStream, key: &str, value: &[u8], deadline: Instant) -> Result<(), StoreError> {
    let what = || format!("hold of store key {key:?}");
    let (status, payload) = exchange(stream, &protocol::encode_hold(key, value), deadline)
        .map_err(|f| f.into_io_error(what))?;
    if status != STATUS_OK {
        let message = String::from_utf8_lossy(&payload);
        return Err(StoreError::Protocol(format!(
            "server refused the request: {message}"
        )));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;
    use crate::auth::{MAC_LEN, NONCE_LEN};

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
        assert_eq!(store.pool.idle_len(), 1);
        let err = store.set("k", b"v").unwrap_err();
        assert!(matches!(err, StoreError::Io { .. }), "{err}");
        assert!(err.to_string().contains("timed out"), "{err}");
        assert_eq!(store.pool.idle_len(), 0);
    }
}
