//! The store server: one mio-driven thread serving every client with non-blocking sockets.
//!
//! Each connection has a read buffer and a write buffer and is served one request at a time:
//! the next request is decoded only once the previous response has been fully written and no
//! GET/WAIT is parked, which keeps every connection's memory bounded (about one frame each
//! way) and responses in order. A GET or WAIT that cannot be answered yet is parked, watching
//! one missing key; setting that key wakes it. A connection that breaks the protocol is logged
//! and dropped; nobody else notices. A connection may hold a key to be set when it closes
//! (HOLD), so that a client's death wakes the clients waiting for that key.
//!
//! What a stranger can make it hold is bounded ([`StoreLimits`]): a connection that has not
//! answered the handshake's challenge within its deadline is dropped (it is never waited on:
//! every connection is served as its bytes arrive), connections past the limit are refused at
//! the handshake, and a SET that would make the data pass its limit is refused.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};
use socket2::{Domain, Socket, Type};
use tracing::{debug, error, warn};

use super::handshake;
use super::protocol::{self, Request, MAX_REQUEST_LEN, STATUS_ERROR, STATUS_OK};
use super::StoreError;
use crate::auth::{nonce, Auth, NONCE_LEN};

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
const FIRST_CONNECTION: usize = 2;
const LISTEN_BACKLOG: i32 = 4096;
const READ_CHUNK: usize = 64 * 1024;
/// A connection may buffer one maximal request plus one read chunk while it waits for its
/// turn; more than that is a client flooding requests without reading responses.
const MAX_BUFFERED: usize = MAX_REQUEST_LEN + READ_CHUNK;
/// Connections past [`StoreLimits::max_connections`] that are still told why they are refused;
/// past these, new ones are closed at once.
const REFUSING: usize = 64;

/// What one store server holds at most; past a limit it refuses, telling the client why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreLimits {
    /// Bytes of keys and values held, all together: a SET past it fails with
    /// [`StoreError::Protocol`] saying the store is full.
    pub max_bytes: usize,
    /// Client connections open at once: a client past it is refused
    /// ([`StoreError::Refused`]).
    pub max_connections: usize,
    /// Time a new connection has to answer the handshake's challenge before it is dropped.
    pub handshake_deadline: Duration,
}

impl Default for StoreLimits {
    /// 256 MiB of data, 65,536 connections, 30 s to answer the challenge.
    fn default() -> Self {
        StoreLimits {
            max_bytes: 256 << 20,
            max_connections: 65_536,
            handshake_deadline: Duration::from_secs(30),
        }
    }
}

/// The store server: hosted by one process (rank 0 or the launcher), serving any number of
/// clients.
///
/// Dropping it stops the serving thread promptly, joins it and closes every socket; clients
/// waiting on it then fail with [`StoreError::Closed`].
#[derive(Debug)]
pub struct StoreServer {
    local_addr: SocketAddr,
    waker: Waker,
    thread: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` (e.g. "0.0.0.0:29500"; port 0 picks a free port) and serves on a
    /// background thread.
    ///
    /// Fails with [`StoreError::Bind`] naming the address if it is busy or not local.
    pub fn bind(addr: SocketAddr) -> Result<StoreServer, StoreError> {
        StoreServer::bind_with_auth(addr, Auth::default())
    }

    /// Like [`bind`](Self::bind), admitting only clients of `auth`'s job that know its secret.
    pub fn bind_with_auth(addr: SocketAddr, auth: Auth) -> Result<StoreServer, StoreError> {
        StoreServer::bind_with_limits(addr, auth, StoreLimits::default())
    }

    /// Like [`bind_with_auth`](Self::bind_with_auth), holding at most what `limits` allow.
    pub fn bind_with_limits(
        addr: SocketAddr,
        auth: Auth,
        limits: StoreLimits,
    ) -> Result<StoreServer, StoreError> {
        let listener = listen(addr).map_err(|source| StoreError::Bind {
            addr,
            source: source.into(),
        })?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| StoreError::io("reading the store server's address", e))?;
        let poll = Poll::new().map_err(|e| StoreError::io("creating the store poller", e))?;
        let waker = Waker::new(poll.registry(), WAKER)
            .map_err(|e| StoreError::io("creating the store waker", e))?;
        let mut server = Server::new(poll, listener, auth, limits);
        server
            .poll
            .registry()
            .register(&mut server.listener, LISTENER, Interest::READABLE)
            .map_err(|e| StoreError::io("registering the store listener", e))?;
        let thread = std::thread::Builder::new()
            .name("chorus-store".into())
            .spawn(move || server.run())
            .map_err(|e| StoreError::io("spawning the store server thread", e))?;
        debug!(%local_addr, "rendezvous store server listening");
        Ok(StoreServer {
            local_addr,
            waker,
            thread: Some(thread),
        })
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        if let Err(e) = self.waker.wake() {
            error!(error = %e, "cannot wake the store server thread to stop it");
            return; // Joining would hang; the thread is left running.
        }
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                error!("the store server thread panicked");
            }
        }
        debug!(local_addr = %self.local_addr, "rendezvous store server stopped");
    }
}

/// Opens a non-blocking listening socket with SO_REUSEADDR and a large backlog.
fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    socket.set_nonblocking(true)?;
    Ok(TcpListener::from_std(socket.into()))
}

/// A GET or WAIT that could not be answered yet.
#[derive(Debug)]
enum Parked {
    Get(String),
    Wait(Vec<String>),
}

/// One client connection and its buffers.
#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    read_buf: Vec<u8>,
    write_buf: Vec<u8>,
    written: usize,
    parked: Option<Parked>,
    /// The key whose SET wakes this connection, while it is parked.
    watching: Option<String>,
    /// The peer closed its side; serve what was received, then drop.
    eof: bool,
    /// The challenge sent, until the client has answered it.
    challenge: Option<[u8; NONCE_LEN]>,
    /// Why the handshake will be refused whatever the answer (the store is full).
    refusal: Option<String>,
    /// The key and value to set when this connection closes (a HOLD request).
    hold: Option<(String, Vec<u8>)>,
}

impl Conn {
    fn new(stream: TcpStream, peer: SocketAddr) -> Self {
        Conn {
            stream,
            peer,
            read_buf: Vec::new(),
            write_buf: Vec::new(),
            written: 0,
            parked: None,
            watching: None,
            eof: false,
            challenge: None,
            refusal: None,
            hold: None,
        }
    }

    /// Ready to decode its next request: nothing parked and nothing left to write.
    fn is_idle(&self) -> bool {
        self.parked.is_none() && self.write_buf.is_empty()
    }

    fn respond(&mut self, status: u8, payload: &[u8]) {
        self.write_buf
            .extend_from_slice(&protocol::encode_response(status, payload));
    }

    /// Writes as much of the write buffer as the socket takes.
    fn flush(&mut self) -> io::Result<()> {
        while self.written < self.write_buf.len() {
            match self.stream.write(&self.write_buf[self.written..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.write_buf.clear();
        self.written = 0;
        shrink_if_large(&mut self.write_buf);
        Ok(())
    }

    /// Reads one chunk; returns false once the socket has nothing more for now.
    fn read_chunk(&mut self, scratch: &mut [u8]) -> Result<bool, Disconnect> {
        match self.stream.read(scratch) {
            Ok(0) => {
                self.eof = true;
                Ok(false)
            }
            Ok(n) => {
                self.read_buf.extend_from_slice(&scratch[..n]);
                if self.read_buf.len() > MAX_BUFFERED {
                    return Err(Disconnect::Protocol(StoreError::Protocol(format!(
                        "{} bytes of requests buffered without reading responses",
                        self.read_buf.len()
                    ))));
                }
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(Disconnect::Io(e)),
        }
    }
}

/// Why a connection is being dropped.
#[derive(Debug)]
enum Disconnect {
    /// It broke the protocol.
    Protocol(StoreError),
    /// Its socket failed.
    Io(io::Error),
    /// It closed its side and has nothing more to be served.
    Closed,
    /// Its handshake failed: another job, or the wrong secret.
    Refused(String),
}

/// The key-value data, its size, and the parked connections waiting on keys.
#[derive(Debug)]
struct State {
    data: HashMap<String, Vec<u8>>,
    waiters: HashMap<String, Vec<Token>>,
    /// Bytes of keys and values in `data`.
    held: usize,
    /// Most bytes `data` may hold.
    max_bytes: usize,
}

impl Default for State {
    fn default() -> Self {
        State::new(StoreLimits::default().max_bytes)
    }
}

impl State {
    fn new(max_bytes: usize) -> Self {
        State {
            data: HashMap::new(),
            waiters: HashMap::new(),
            held: 0,
            max_bytes,
        }
    }

    /// Stores `value` and moves the connections watching `key` onto `woken`; fails, storing
    /// nothing, if the data would pass its limit.
    fn set(&mut self, key: String, value: Vec<u8>, woken: &mut Vec<Token>) -> Result<(), String> {
        let old = self.data.get(&key).map_or(0, |v| key.len() + v.len());
        let held = self.held - old + key.len() + value.len();
        if held > self.max_bytes {
            return Err(format!(
                "the store is full: setting {} bytes at key {key:?} would make it hold {held} \
                 bytes, over its limit of {}",
                value.len(),
                self.max_bytes
            ));
        }
        if let Some(tokens) = self.waiters.remove(&key) {
            woken.extend(tokens);
        }
        self.held = held;
        self.data.insert(key, value);
        Ok(())
    }

    /// Adds `delta` to the decimal integer at `key` (0 if unset); returns the new value.
    fn add(&mut self, key: String, delta: i64, woken: &mut Vec<Token>) -> Result<i64, String> {
        let current = match self.data.get(&key) {
            None => 0,
            Some(bytes) => std::str::from_utf8(bytes)
                .ok()
                .and_then(|text| text.parse::<i64>().ok())
                .ok_or_else(|| format!("add on key {key:?}, whose value is not an integer"))?,
        };
        let new = current
            .checked_add(delta)
            .ok_or_else(|| format!("add of {delta} to {current} at key {key:?} overflows"))?;
        self.set(key, new.to_string().into_bytes(), woken)?;
        Ok(new)
    }

    /// Keeps `bytes` in reserve for a connection's hold, counted against the limit like data.
    fn reserve(&mut self, bytes: usize) -> Result<(), String> {
        let held = self.held + bytes;
        if held > self.max_bytes {
            return Err(format!(
                "the store is full: holding {bytes} bytes for when this connection closes would \
                 make it hold {held} bytes, over its limit of {}",
                self.max_bytes
            ));
        }
        self.held = held;
        Ok(())
    }

    /// Takes a connection's hold out of reserve and sets its key, unless the key is set.
    fn release(&mut self, (key, value): (String, Vec<u8>), fire: bool, woken: &mut Vec<Token>) {
        self.held -= key.len() + value.len();
        if fire && !self.data.contains_key(&key) {
            if let Err(message) = self.set(key, value, woken) {
                warn!("store server cannot set a closed connection's key: {message}");
            }
        }
    }

    /// The first key in `keys` that is not set.
    fn first_missing<'k>(&self, keys: &'k [String]) -> Option<&'k String> {
        keys.iter().find(|key| !self.data.contains_key(*key))
    }

    fn watch(&mut self, key: &str, token: Token) {
        self.waiters.entry(key.to_owned()).or_default().push(token);
    }

    fn unwatch(&mut self, key: &str, token: Token) {
        if let Some(tokens) = self.waiters.get_mut(key) {
            tokens.retain(|t| *t != token);
            if tokens.is_empty() {
                self.waiters.remove(key);
            }
        }
    }
}

/// The serving thread's world.
struct Server {
    auth: Auth,
    limits: StoreLimits,
    /// Connections yet to answer the challenge, by deadline (the earliest first).
    handshakes: VecDeque<(Instant, Token)>,
    poll: Poll,
    listener: TcpListener,
    conns: HashMap<Token, Conn>,
    next_token: usize,
    state: State,
    scratch: Vec<u8>,
}

impl Server {
    fn new(poll: Poll, listener: TcpListener, auth: Auth, limits: StoreLimits) -> Self {
        Server {
            auth,
            limits,
            handshakes: VecDeque::new(),
            poll,
            listener,
            conns: HashMap::new(),
            next_token: FIRST_CONNECTION,
            state: State::new(limits.max_bytes),
            scratch: vec![0; READ_CHUNK],
        }
    }

    /// Serves until woken by [`StoreServer`]'s drop; then every socket closes with `self`.
    fn run(mut self) {
        let mut events = Events::with_capacity(1024);
        loop {
            let next = self.handshakes.front();
            let timeout =
                next.map(|(deadline, _)| deadline.saturating_duration_since(Instant::now()));
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                error!(error = %e, "rendezvous store server cannot poll; stopping");
                return;
            }
            for event in events.iter() {
                match event.token() {
                    WAKER => return,
                    LISTENER => self.accept_all(),
                    token => self.drive_from(token),
                }
            }
            self.expire_handshakes();
        }
    }

    /// Drops the connections whose handshake deadline has passed without an answer.
    fn expire_handshakes(&mut self) {
        let now = Instant::now();
        while let Some(&(deadline, token)) = self.handshakes.front() {
            if deadline > now {
                return;
            }
            self.handshakes.pop_front();
            match self.conns.remove(&token) {
                Some(conn) if conn.challenge.is_some() => {
                    let reason = format!(
                        "no answer to the challenge within {:?}",
                        self.limits.handshake_deadline
                    );
                    // Unproven, it holds nothing whose release could wake anyone.
                    self.drop_conn(token, conn, Disconnect::Refused(reason), &mut Vec::new());
                }
                Some(conn) => {
                    self.conns.insert(token, conn);
                }
                None => {}
            }
        }
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => self.add_conn(stream, peer),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if is_transient_accept_error(&e) => {
                    debug!(error = %e, "store server: transient accept failure");
                }
                Err(e) => {
                    // EMFILE and the like: the pending connection stays queued and is retried
                    // on the next listener event.
                    warn!(error = %e, "store server cannot accept a connection");
                    return;
                }
            }
        }
    }

    fn add_conn(&mut self, mut stream: TcpStream, peer: SocketAddr) {
        let max = self.limits.max_connections;
        if self.conns.len() >= max + REFUSING {
            return warn!(%peer, "store server closes a connection: {max} are open, its limit");
        }
        if let Err(e) = stream.set_nodelay(true) {
            debug!(%peer, error = %e, "store server cannot set TCP_NODELAY");
        }
        let token = Token(self.next_token);
        self.next_token += 1;
        let interest = Interest::READABLE | Interest::WRITABLE;
        if let Err(e) = self.poll.registry().register(&mut stream, token, interest) {
            warn!(%peer, error = %e, "store server cannot register a connection");
            return;
        }
        let nonce = match nonce() {
            Ok(nonce) => nonce,
            Err(e) => return warn!(%peer, "store server cannot challenge a client: {e}"),
        };
        debug!(%peer, "store client connected");
        let mut conn = Conn::new(stream, peer);
        conn.write_buf
            .extend_from_slice(&handshake::challenge(&nonce));
        conn.challenge = Some(nonce);
        if self.conns.len() >= max {
            conn.refusal = Some(format!(
                "the store already serves {max} connections, its limit"
            ));
        }
        self.conns.insert(token, conn);
        let deadline = Instant::now() + self.limits.handshake_deadline;
        self.handshakes.push_back((deadline, token));
    }

    /// Drives `first`, then every connection its requests woke, and so on.
    fn drive_from(&mut self, first: Token) {
        let mut pending = vec![first];
        while let Some(token) = pending.pop() {
            self.drive(token, &mut pending);
        }
    }

    /// Reads, serves and writes one connection as far as it can go without blocking.
    fn drive(&mut self, token: Token, woken: &mut Vec<Token>) {
        let Some(mut conn) = self.conns.remove(&token) else {
            return; // Already dropped.
        };
        match self.pump(token, &mut conn, woken) {
            Ok(()) => {
                self.conns.insert(token, conn);
            }
            Err(reason) => self.drop_conn(token, conn, reason, woken),
        }
    }

    fn pump(
        &mut self,
        token: Token,
        conn: &mut Conn,
        woken: &mut Vec<Token>,
    ) -> Result<(), Disconnect> {
        loop {
            self.serve(token, conn, woken)?;
            if conn.eof {
                return Err(Disconnect::Closed);
            }
            // On EOF, loop once more to serve the requests already received.
            if !conn.read_chunk(&mut self.scratch)? && !conn.eof {
                return Ok(());
            }
        }
    }

    /// Answers a woken parked request, then decodes and handles buffered requests while the
    /// connection is idle, flushing each response.
    fn serve(
        &mut self,
        token: Token,
        conn: &mut Conn,
        woken: &mut Vec<Token>,
    ) -> Result<(), Disconnect> {
        self.try_unpark(token, conn);
        conn.flush().map_err(Disconnect::Io)?;
        if let Some(nonce) = conn.challenge {
            let Some((answer, used)) =
                handshake::decode_answer(&conn.read_buf).map_err(Disconnect::Protocol)?
            else {
                return Ok(());
            };
            conn.read_buf.drain(..used);
            let outcome = match conn.refusal.take() {
                Some(reason) => Err(reason),
                None => handshake::check(&self.auth, &nonce, &answer),
            };
            conn.write_buf
                .extend_from_slice(&handshake::verdict(&outcome));
            conn.flush().map_err(Disconnect::Io)?;
            outcome.map_err(Disconnect::Refused)?;
            conn.challenge = None;
        }
        while conn.is_idle() {
            let Some((request, used)) =
                protocol::decode_request(&conn.read_buf).map_err(Disconnect::Protocol)?
            else {
                break;
            };
            conn.read_buf.drain(..used);
            shrink_if_large(&mut conn.read_buf);
            self.handle(token, conn, request, woken);
            conn.flush().map_err(Disconnect::Io)?;
        }
        Ok(())
    }

    fn handle(&mut self, token: Token, conn: &mut Conn, request: Request, woken: &mut Vec<Token>) {
        match request {
            Request::Set { key, value } => match self.state.set(key, value, woken) {
                Ok(()) => conn.respond(STATUS_OK, &[]),
                Err(message) => conn.respond(STATUS_ERROR, message.as_bytes()),
            },
            Request::Add { key, delta } => match self.state.add(key, delta, woken) {
                Ok(new) => conn.respond(STATUS_OK, &new.to_le_bytes()),
                Err(message) => conn.respond(STATUS_ERROR, message.as_bytes()),
            },
            Request::Check { keys } => {
                let set: Vec<u8> = keys
                    .iter()
                    .map(|k| u8::from(self.state.data.contains_key(k)))
                    .collect();
                conn.respond(STATUS_OK, &set);
            }
            Request::Get { key } => {
                conn.parked = Some(Parked::Get(key));
                self.try_unpark(token, conn);
            }
            Request::Wait { keys } => {
                conn.parked = Some(Parked::Wait(keys));
                self.try_unpark(token, conn);
            }
            Request::Hold { hold } => {
                if let Some(old) = conn.hold.take() {
                    self.state.release(old, false, woken);
                }
                let reserved = match &hold {
                    Some((key, value)) => self.state.reserve(key.len() + value.len()),
                    None => Ok(()),
                };
                match reserved {
                    Ok(()) => {
                        conn.hold = hold;
                        conn.respond(STATUS_OK, &[]);
                    }
                    Err(message) => conn.respond(STATUS_ERROR, message.as_bytes()),
                }
            }
        }
    }

    /// Answers the parked request if its keys are now set; otherwise watches a missing key.
    fn try_unpark(&mut self, token: Token, conn: &mut Conn) {
        if let Some(key) = &conn.watching {
            if !self.state.data.contains_key(key) {
                return; // Still blocked, and still in that key's waiter list.
            }
            // Setting the key removed its waiter list, this token included.
            conn.watching = None;
        }
        let missing = match &conn.parked {
            None => return,
            Some(Parked::Get(key)) => match self.state.data.get(key) {
                Some(value) => {
                    let frame = protocol::encode_response(STATUS_OK, value);
                    conn.write_buf.extend_from_slice(&frame);
                    None
                }
                None => Some(key.clone()),
            },
            Some(Parked::Wait(keys)) => self.state.first_missing(keys).cloned(),
        };
        match missing {
            Some(key) => {
                self.state.watch(&key, token);
                conn.watching = Some(key);
            }
            None => {
                if matches!(conn.parked, Some(Parked::Wait(_))) {
                    conn.respond(STATUS_OK, &[]);
                }
                conn.parked = None;
            }
        }
    }

    /// Drops a connection; its hold, if any, sets its key (waking `woken`'s connections).
    fn drop_conn(
        &mut self,
        token: Token,
        mut conn: Conn,
        reason: Disconnect,
        woken: &mut Vec<Token>,
    ) {
        if let Some(key) = conn.watching.take() {
            self.state.unwatch(&key, token);
        }
        if let Some(hold) = conn.hold.take() {
            self.state.release(hold, true, woken);
        }
        let peer = conn.peer;
        match reason {
            Disconnect::Protocol(e) => {
                warn!(%peer, error = %e, "dropping store client that broke the protocol")
            }
            Disconnect::Refused(reason) => warn!(%peer, "refusing a store client: {reason}"),
            Disconnect::Io(e) => debug!(%peer, error = %e, "store client connection failed"),
            Disconnect::Closed if !conn.read_buf.is_empty() && conn.is_idle() => {
                warn!(%peer, bytes = conn.read_buf.len(), "store client closed mid-frame");
            }
            Disconnect::Closed => debug!(%peer, "store client disconnected"),
        }
        if let Err(e) = self.poll.registry().deregister(&mut conn.stream) {
            debug!(%peer, error = %e, "store server cannot deregister a connection");
        }
    }
}

/// Releases the memory of a buffer that once held a large frame and is now empty.
fn shrink_if_large(buf: &mut Vec<u8>) {
    if buf.is_empty() && buf.capacity() > 4 * READ_CHUNK {
        *buf = Vec::new();
    }
}

fn is_transient_accept_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_counts_from_zero_in_decimal() {
        let mut state = State::default();
        let mut woken = Vec::new();
        assert_eq!(state.add("n".into(), 5, &mut woken), Ok(5));
        assert_eq!(state.add("n".into(), -7, &mut woken), Ok(-2));
        assert_eq!(state.data["n"], b"-2");
    }

    #[test]
    fn add_refuses_text_and_overflow() {
        let mut state = State::default();
        let mut woken = Vec::new();
        state
            .set("text".into(), b"abc".to_vec(), &mut woken)
            .unwrap();
        assert!(state.add("text".into(), 1, &mut woken).is_err());
        state
            .set("max".into(), i64::MAX.to_string().into_bytes(), &mut woken)
            .unwrap();
        assert!(state.add("max".into(), 1, &mut woken).is_err());
        assert_eq!(state.data["max"], i64::MAX.to_string().as_bytes());
    }

    #[test]
    fn setting_a_key_wakes_exactly_its_watchers() {
        let mut state = State::default();
        state.watch("a", Token(10));
        state.watch("a", Token(11));
        state.watch("b", Token(12));
        state.unwatch("a", Token(11));
        let mut woken = Vec::new();
        state.set("a".into(), b"1".to_vec(), &mut woken).unwrap();
        assert_eq!(woken, [Token(10)]);
        assert!(!state.waiters.contains_key("a"));
        state.unwatch("b", Token(12));
        assert!(state.waiters.is_empty());
    }

    #[test]
    fn the_data_held_is_bounded_counting_keys_and_replaced_values() {
        let mut state = State::new(10);
        let mut woken = Vec::new();
        state.set("ab".into(), vec![0; 8], &mut woken).unwrap();
        let err = state.set("c".into(), vec![], &mut woken).unwrap_err();
        assert!(err.contains("over its limit of 10"), "{err}");
        // Replacing a value counts only the difference.
        state.set("ab".into(), vec![0; 3], &mut woken).unwrap();
        assert_eq!(state.held, 5);
        state.set("c".into(), vec![0; 4], &mut woken).unwrap();
        assert!(state.add("d".into(), 1, &mut woken).is_err());
        assert_eq!((state.held, state.data.len()), (10, 2));
    }

    #[test]
    fn a_hold_is_reserved_then_sets_its_key_unless_already_set() {
        let mut state = State::new(30);
        let mut woken = Vec::new();
        state.reserve(10).unwrap();
        assert!(state.reserve(21).is_err());
        state.watch("gone", Token(7));
        state.release(("gone".into(), b"rank 1".to_vec()), true, &mut woken);
        assert_eq!(state.data["gone"], b"rank 1");
        assert_eq!((state.held, &woken[..]), (10, &[Token(7)][..]));
        // A key already set keeps its value; a released hold that does not fire sets nothing.
        state.reserve(11).unwrap();
        state.release(("gone".into(), b"rank 2!".to_vec()), true, &mut woken);
        state.reserve(6).unwrap();
        state.release(("other".into(), b"x".to_vec()), false, &mut woken);
        assert_eq!(state.data["gone"], b"rank 1");
        assert!(!state.data.contains_key("other"));
        assert_eq!(state.held, 10);
    }

    #[test]
    fn first_missing_skips_set_keys() {
        let mut state = State::default();
        state.set("a".into(), vec![], &mut Vec::new()).unwrap();
        let keys = ["a".to_string(), "b".to_string(), "c".to_string()];
        assert_eq!(state.first_missing(&keys), Some(&keys[1]));
        assert_eq!(state.first_missing(&keys[..1]), None);
    }

    #[test]
    fn buffers_that_held_a_large_frame_are_released() {
        let mut buf = Vec::with_capacity(16 * READ_CHUNK);
        shrink_if_large(&mut buf);
        assert_eq!(buf.capacity(), 0);
        let mut small = Vec::with_capacity(64);
        shrink_if_large(&mut small);
        assert_eq!(small.capacity(), 64);
    }
}
