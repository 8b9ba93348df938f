//! A client of torch's TCPStore (`torch.distributed.TCPStore`, c10d's), the store torchrun's
//! elastic agent serves at `MASTER_ADDR:MASTER_PORT` for its workers.
//!
//! The wire format, as torch's own client (`TCPStore.cpp`) writes it and both of torch's
//! servers read it: the libuv one (`TCPStoreLibUvBackend.cpp`, the default since torch 2.4)
//! and the classic one (`TCPStoreBackend.cpp`, `use_libuv=False`). Integers are written in the
//! host's byte order by torch, little-endian on every platform torch ships for; this client
//! writes them little-endian.
//!
//! ```text
//! request     = opcode u8, then its fields
//! string      = length u64, then the bytes (keys and values alike)
//!
//! VALIDATE    = 0   magic u32 0x3C85F7CE        no answer; a connection's first request
//! SET         = 1   key, value                  no answer
//! GET         = 3   key                         value (an unset key: the libuv server answers
//!                                               an empty value, the classic one drops the
//!                                               connection, so a GET follows a WAIT)
//! ADD         = 4   key, delta i64              the new value, i64 (stored as decimal text)
//! CHECK       = 5   count u64, count keys       u8: 0 every key is set, 1 not
//! WAIT        = 6   count u64, count keys       u8 0 once every key is set
//! CANCEL_WAIT = 12                              u8 1, perhaps after the 0 of a WAIT it crossed
//! ```
//!
//! Keys go out with torch's client prefix `/` in front, so that `TCPStore.get("k")` in Python
//! reads what `set("k", ..)` here wrote, and the other way round. On connecting, the client
//! sends VALIDATE and a CHECK, and expects the CHECK's answer: torch 2.5 and later also know a
//! PING, but a CHECK is answered by every server since 2.2. The libuv server refuses keys over
//! 8 KiB (prefix included), values over 8 MiB and waits on more than 128 Ki keys; this client
//! refuses them before sending.
//!
//! Verified against the servers of torch 2.15.0 and 2.4.0, both kinds, by
//! `tests/tests/torchrun.rs`; the opcodes, the magic number and the `/` prefix above are the
//! same in the headers of torch 2.2, 2.3, 2.4 and 2.5. Servers of torch 2.1 and older speak other variants of the protocol, which
//! this client does not.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::conn::{self, read_exact_by, write_all_by, Failure, Greeting, Pool};
use super::{Store, StoreError};

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const WAIT: u8 = 6;
const CANCEL_WAIT: u8 = 12;
/// VALIDATE's magic number (`validationMagicNumber`).
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// CHECK's answers.
const READY: u8 = 0;
const NOT_READY: u8 = 1;
/// WAIT's and CANCEL_WAIT's answers.
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;
/// What torch's client puts in front of every key.
const KEY_PREFIX: &str = "/";
/// The libuv server's limits: a key with its prefix, a value, the keys of one WAIT or CHECK.
const MAX_WIRE_KEY_LEN: usize = 8 << 10;
const MAX_VALUE_LEN: usize = 8 << 20;
const MAX_KEYS: usize = 128 << 10;
/// The longest the server may take to answer the handshake.
const GREETING_LIMIT: Duration = Duration::from_secs(30);
/// The longest the server may take to confirm a cancelled WAIT.
const CANCEL_LIMIT: Duration = Duration::from_secs(2);

/// A client of torch's TCPStore at a given address (see the module's source for the protocol).
///
/// Usable from several threads: concurrent requests use separate pooled connections. Every
/// request is bounded by the timeout given at connection; a WAIT that runs out is cancelled as
/// torch's client cancels it, and the error names the keys still missing.
#[derive(Debug)]
pub struct TorchStore {
    pool: Pool<TorchGreeting>,
    timeout: Duration,
}

/// VALIDATE and a CHECK, on every new connection.
#[derive(Debug)]
struct TorchGreeting;

impl Greeting for TorchGreeting {
    fn greet(&self, stream: &mut TcpStream) -> Result<(), StoreError> {
        let mut hello = vec![VALIDATE];
        hello.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
        hello.extend_from_slice(&encode_keys(CHECK, &[KEY_PREFIX]));
        let bound = stream
            .read_timeout()
            .ok()
            .flatten()
            .map_or(GREETING_LIMIT, |t| t.min(GREETING_LIMIT));
        let deadline = Instant::now() + bound;
        let answer =
            write_all_by(stream, &hello, deadline).and_then(|()| read_u8(stream, deadline));
        let why = match answer {
            Ok(READY | NOT_READY) => return Ok(()),
            Ok(other) => format!("it answered byte {other:#04x}"),
            Err(Failure::TimedOut) => format!("no answer within {bound:?}"),
            Err(Failure::Store(e)) => e.to_string(),
        };
        let peer = stream
            .peer_addr()
            .map_or_else(|_| "the server".to_string(), |a| a.to_string());
        Err(StoreError::Refused(format!(
            "{peer} did not pass the handshake of torch's TCPStore ({why}): is it the store of \
             torchrun's agent, from torch 2.2 or later?"
        )))
    }
}

impl TorchStore {
    /// Connects to torch's TCPStore at `host:port`, retrying (connection refused / host not
    /// yet up) until `timeout` passes; `timeout` also bounds every later request.
    ///
    /// Fails with [`StoreError::Connect`] naming the address and how long it tried, or with
    /// [`StoreError::Refused`] when what answers there is not torch's TCPStore.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<TorchStore, StoreError> {
        let pool = Pool::connect(host, port, TorchGreeting, Instant::now() + timeout)?;
        Ok(TorchStore { pool, timeout })
    }

    /// What a failure of `what` on `key` says, naming this store.
    fn context(&self, what: &str, key: &str) -> String {
        format!(
            "{what} of key {key:?} in torch's TCPStore at {}",
            self.pool.addr()
        )
    }
}

impl Store for TorchStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let wire = wire_key(key)?;
        if value.len() > MAX_VALUE_LEN {
            return Err(StoreError::Protocol(format!(
                "value of {} bytes for key {key:?} exceeds torch's TCPStore limit of \
                 {MAX_VALUE_LEN} bytes",
                value.len()
            )));
        }
        // SET has no answer: a CHECK behind it confirms it arrived.
        let mut request = vec![SET];
        put_bytes(&mut request, wire.as_bytes());
        put_bytes(&mut request, value);
        request.extend_from_slice(&encode_keys(CHECK, &[&wire]));
        let deadline = Instant::now() + self.timeout;
        self.pool
            .run(deadline, |stream| {
                write_all_by(stream, &request, deadline)?;
                match read_u8(stream, deadline)? {
                    READY => Ok(()),
                    other => Err(unexpected("CHECK after SET", other)),
                }
            })
            .map_err(|f| f.into_io_error(|| self.context("set", key)))
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let wire = wire_key(key)?;
        let deadline = Instant::now() + self.timeout;
        let got = self.pool.run(deadline, |stream| {
            if !wait_on(stream, &[&wire], deadline)? {
                return Ok(None);
            }
            let mut request = vec![GET];
            put_bytes(&mut request, wire.as_bytes());
            write_all_by(stream, &request, deadline)?;
            read_value(stream, deadline).map(Some)
        });
        match got {
            Ok(Some(value)) => Ok(value),
            Ok(None) | Err(Failure::TimedOut) => Err(StoreError::Timeout {
                keys: vec![key.to_owned()],
                waited: self.timeout,
            }),
            Err(Failure::Store(e)) => Err(e),
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        if keys.len() > MAX_KEYS {
            return Err(StoreError::Protocol(format!(
                "a wait on {} keys exceeds torch's TCPStore limit of {MAX_KEYS}",
                keys.len()
            )));
        }
        let wire = keys
            .iter()
            .map(|key| wire_key(key))
            .collect::<Result<Vec<_>, _>>()?;
        let wire: Vec<&str> = wire.iter().map(String::as_str).collect();
        if keys.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        let result = self
            .pool
            .run(deadline, |stream| wait_on(stream, &wire, deadline));
        conn::finish_wait(result, keys, timeout, self.timeout, |deadline| {
            self.pool
                .run(deadline, |stream| check_each(stream, &wire, deadline))
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let wire = wire_key(key)?;
        let mut request = vec![ADD];
        put_bytes(&mut request, wire.as_bytes());
        request.extend_from_slice(&delta.to_le_bytes());
        let deadline = Instant::now() + self.timeout;
        self.pool
            .run(deadline, |stream| {
                write_all_by(stream, &request, deadline)?;
                let mut value = [0u8; 8];
                read_exact_by(stream, &mut value, deadline)?;
                Ok(i64::from_le_bytes(value))
            })
            .map_err(|f| f.into_io_error(|| self.context("add", key)))
    }

    fn shutdown(&self) {
        self.pool.shutdown();
    }
}

/// `key` as it goes out (with torch's prefix), or why it cannot.
fn wire_key(key: &str) -> Result<String, StoreError> {
    let wire = format!("{KEY_PREFIX}{key}");
    if wire.len() > MAX_WIRE_KEY_LEN {
        return Err(StoreError::Protocol(format!(
            "key of {} bytes exceeds torch's TCPStore limit of {} bytes",
            key.len(),
            MAX_WIRE_KEY_LEN - KEY_PREFIX.len()
        )));
    }
    Ok(wire)
}

/// Appends a length-prefixed string.
fn put_bytes(frame: &mut Vec<u8>, bytes: &[u8]) {
    frame.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    frame.extend_from_slice(bytes);
}

/// A WAIT or CHECK request for `keys` (already in their wire form).
fn encode_keys(op: u8, keys: &[&str]) -> Vec<u8> {
    let mut frame = vec![op];
    frame.extend_from_slice(&(keys.len() as u64).to_le_bytes());
    for key in keys {
        put_bytes(&mut frame, key.as_bytes());
    }
    frame
}

fn read_u8(stream: &TcpStream, deadline: Instant) -> Result<u8, Failure> {
    let mut byte = [0u8];
    read_exact_by(stream, &mut byte, deadline)?;
    Ok(byte[0])
}

/// Reads a length-prefixed value, refusing one over the size limit before allocating it.
fn read_value(stream: &TcpStream, deadline: Instant) -> Result<Vec<u8>, Failure> {
    let mut len = [0u8; 8];
    read_exact_by(stream, &mut len, deadline)?;
    let len = u64::from_le_bytes(len);
    let len = usize::try_from(len)
        .ok()
        .filter(|&len| len <= MAX_VALUE_LEN)
        .ok_or_else(|| {
            StoreError::Protocol(format!(
                "torch's TCPStore announced a value of {len} bytes (limit {MAX_VALUE_LEN})"
            ))
        })?;
    let mut value = vec![0u8; len];
    read_exact_by(stream, &mut value, deadline)?;
    Ok(value)
}

fn unexpected(what: &str, byte: u8) -> Failure {
    StoreError::Protocol(format!(
        "torch's TCPStore answered {what} with byte {byte:#04x}"
    ))
    .into()
}

/// Sends a WAIT for `keys` and reads its answer before `deadline`: `Ok(true)` once every key
/// is set, `Ok(false)` when the deadline passed and the WAIT was cancelled (the connection is
/// then still in step and goes back to the pool, as torch's client keeps it).
fn wait_on(stream: &TcpStream, keys: &[&str], deadline: Instant) -> Result<bool, Failure> {
    write_all_by(stream, &encode_keys(WAIT, keys), deadline)?;
    match read_u8(stream, deadline) {
        Ok(STOP_WAITING) => return Ok(true),
        Ok(other) => return Err(unexpected("WAIT", other)),
        Err(Failure::TimedOut) => {}
        Err(e) => return Err(e),
    }
    let grace = Instant::now() + CANCEL_LIMIT;
    write_all_by(stream, &[CANCEL_WAIT], grace)?;
    match read_u8(stream, grace)? {
        WAIT_CANCELED => Ok(false),
        // The keys arrived as the cancel went out: the WAIT's answer comes first.
        STOP_WAITING => match read_u8(stream, grace)? {
            WAIT_CANCELED => Ok(true),
            other => Err(unexpected("CANCEL_WAIT", other)),
        },
        other => Err(unexpected("CANCEL_WAIT", other)),
    }
}

/// Which of `keys` are set, by one CHECK each (sent together).
fn check_each(stream: &TcpStream, keys: &[&str], deadline: Instant) -> Result<Vec<bool>, Failure> {
    let requests: Vec<u8> = keys
        .iter()
        .flat_map(|key| encode_keys(CHECK, &[key]))
        .collect();
    write_all_by(stream, &requests, deadline)?;
    let mut answers = vec![0u8; keys.len()];
    read_exact_by(stream, &mut answers, deadline)?;
    answers
        .into_iter()
        .map(|answer| match answer {
            READY => Ok(true),
            NOT_READY => Ok(false),
            other => Err(unexpected("CHECK", other)),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    //! Against a small fake of torch's server, written from the format above; the real check
    //! is `tests/tests/torchrun.rs`, against torch itself.

    use std::collections::HashMap;
    use std::io::{self, Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::{Arc, Mutex};

    use super::*;

    type Keys = Arc<Mutex<HashMap<String, Vec<u8>>>>;

    /// Serves every connection on its own thread until the client hangs up.
    fn fake_server() -> (u16, Keys) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let keys: Keys = Arc::default();
        let shared = keys.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let keys = shared.clone();
                std::thread::spawn(move || serve(conn?, &keys));
            }
            io::Result::Ok(())
        });
        (port, keys)
    }

    fn read_n<const N: usize>(conn: &mut TcpStream) -> io::Result<[u8; N]> {
        let mut buf = [0u8; N];
        conn.read_exact(&mut buf)?;
        Ok(buf)
    }

    fn read_string(conn: &mut TcpStream) -> io::Result<Vec<u8>> {
        let len = u64::from_le_bytes(read_n(conn)?);
        let mut buf = vec![0; len as usize];
        conn.read_exact(&mut buf)?;
        Ok(buf)
    }

    fn read_keys(conn: &mut TcpStream) -> io::Result<Vec<String>> {
        let count = u64::from_le_bytes(read_n(conn)?);
        (0..count)
            .map(|_| Ok(String::from_utf8(read_string(conn)?).unwrap()))
            .collect()
    }

    fn serve(mut conn: TcpStream, keys: &Keys) -> io::Result<()> {
        let [op] = read_n(&mut conn)?;
        assert_eq!(op, VALIDATE, "a connection starts with VALIDATE");
        assert_eq!(u32::from_le_bytes(read_n(&mut conn)?), VALIDATION_MAGIC);
        let all_set = |names: &[String]| {
            let map = keys.lock().unwrap();
            names.iter().all(|k| map.contains_key(k))
        };
        loop {
            let [op] = read_n(&mut conn)?;
            match op {
                SET => {
                    let key = String::from_utf8(read_string(&mut conn)?).unwrap();
                    let value = read_string(&mut conn)?;
                    keys.lock().unwrap().insert(key, value);
                }
                GET => {
                    let key = String::from_utf8(read_string(&mut conn)?).unwrap();
                    let value = keys.lock().unwrap()[&key].clone();
                    let mut answer = Vec::new();
                    put_bytes(&mut answer, &value);
                    conn.write_all(&answer)?;
                }
                ADD => {
                    let key = String::from_utf8(read_string(&mut conn)?).unwrap();
                    let delta = i64::from_le_bytes(read_n(&mut conn)?);
                    let mut map = keys.lock().unwrap();
                    let old = map
                        .get(&key)
                        .map_or(0, |v| String::from_utf8_lossy(v).parse::<i64>().unwrap());
                    map.insert(key, (old + delta).to_string().into_bytes());
                    conn.write_all(&(old + delta).to_le_bytes())?;
                }
                CHECK => {
                    let names = read_keys(&mut conn)?;
                    conn.write_all(&[if all_set(&names) { READY } else { NOT_READY }])?;
                }
                WAIT => {
                    let names = read_keys(&mut conn)?;
                    // Poll for the keys, or for a CANCEL_WAIT.
                    conn.set_read_timeout(Some(Duration::from_millis(5)))?;
                    let answer = loop {
                        if all_set(&names) {
                            break STOP_WAITING;
                        }
                        let mut byte = [0u8];
                        match conn.read(&mut byte) {
                            Ok(1) if byte[0] == CANCEL_WAIT => break WAIT_CANCELED,
                            Ok(_) => return Ok(()),
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                            Err(e) => return Err(e),
                        }
                    };
                    conn.set_read_timeout(None)?;
                    conn.write_all(&[answer])?;
                }
                other => panic!("unexpected opcode {other}"),
            }
        }
    }

    #[test]
    fn set_get_add_and_wait_speak_torchs_format() {
        let (port, keys) = fake_server();
        let store = TorchStore::connect("127.0.0.1", port, Duration::from_secs(10)).unwrap();
        store.set("a", b"alpha").unwrap();
        assert_eq!(keys.lock().unwrap()["/a"], b"alpha");
        assert_eq!(store.get("a").unwrap(), b"alpha");
        assert_eq!(store.add("n", 5).unwrap(), 5);
        assert_eq!(store.add("n", -2).unwrap(), 3);
        assert_eq!(store.get("n").unwrap(), b"3");
        store.wait(&["a", "n"], Duration::from_secs(1)).unwrap();
        // A get waits for its key.
        let late = std::thread::spawn({
            let keys = keys.clone();
            move || {
                std::thread::sleep(Duration::from_millis(50));
                keys.lock().unwrap().insert("/late".into(), b"x".to_vec());
            }
        });
        assert_eq!(store.get("late").unwrap(), b"x");
        late.join().unwrap();
    }

    #[test]
    fn a_wait_that_runs_out_is_cancelled_and_names_the_missing_keys() {
        let (port, _keys) = fake_server();
        let store = TorchStore::connect("127.0.0.1", port, Duration::from_secs(10)).unwrap();
        store.set("here", b"1").unwrap();
        let err = store
            .wait(&["here", "absent"], Duration::from_millis(100))
            .unwrap_err();
        match err {
            StoreError::Timeout { keys, .. } => assert_eq!(keys, ["absent"]),
            other => panic!("{other}"),
        }
        // The cancelled wait left its connection in step: it went back to the pool.
        assert_eq!(store.pool.idle_len(), 1);
        assert_eq!(store.get("here").unwrap(), b"1");
    }

    #[test]
    fn a_server_of_another_protocol_is_refused_with_its_address() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            conn.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
            std::thread::sleep(Duration::from_millis(200));
        });
        let err = TorchStore::connect("127.0.0.1", port, Duration::from_secs(5)).unwrap_err();
        assert!(matches!(err, StoreError::Refused(_)), "{err}");
        let text = err.to_string();
        assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
        assert!(text.contains("torch's TCPStore"), "{text}");
    }

    #[test]
    fn oversized_keys_and_values_fail_before_sending() {
        let (port, _keys) = fake_server();
        let store = TorchStore::connect("127.0.0.1", port, Duration::from_secs(10)).unwrap();
        let long = "k".repeat(MAX_WIRE_KEY_LEN);
        assert!(matches!(store.get(&long), Err(StoreError::Protocol(_))));
        let big = vec![0u8; MAX_VALUE_LEN + 1];
        let err = store.set("k", &big).unwrap_err();
        assert!(err.to_string().contains("\"k\""), "{err}");
    }
}
