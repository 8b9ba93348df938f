//! Connection set-up: every rank listens, publishes its address in the store,
//! connects to every lower rank and accepts every higher one.
//!
//! Each socket opens with a hello naming the job session, the world size,
//! the sender's rank and the socket's index, sealed with an HMAC of the job's
//! secret ([`crate::auth`]); the acceptor checks it (a stranger's or another
//! job's connection is logged and dropped) and answers with one ack byte. Connecting never waits on an accept (the listen backlog holds the
//! connection), and acks are read only after this rank has accepted all of
//! its own peers, so set-up cannot deadlock.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use socket2::{Domain, SockRef, Socket, TcpKeepalive, Type};

use super::TcpConfig;
use crate::auth::{Auth, MAC_LEN};
use crate::store::Store;
use crate::TransportError;

const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"CHRH");
const FIELDS_LEN: usize = 28;
const HELLO_LEN: usize = FIELDS_LEN + MAC_LEN;
/// The domain separating transport MACs from store MACs.
const DOMAIN: &str = "chorus-tcp";
const ACK: u8 = 0xA5;

/// Opens `nsocks` sockets to every peer; result indexed by peer rank.
pub(super) fn connect_all(
    rank: usize,
    world_size: usize,
    store: &dyn Store,
    config: &TcpConfig,
) -> Result<Vec<Vec<TcpStream>>, TransportError> {
    let deadline = Instant::now() + config.timeout;
    let nsocks = config.nsocks.max(1);
    let mut sockets: Vec<Vec<Option<TcpStream>>> = (0..world_size)
        .map(|_| (0..nsocks).map(|_| None).collect())
        .collect();
    if world_size == 1 {
        return Ok(vec![Vec::new()]);
    }
    let listener = listen(SocketAddr::new(config.addr, 0))?;
    let session = session_id(rank, store)?;
    let local = listener
        .local_addr()
        .map_err(setup("read the listen address"))?;
    store.set(&format!("tcp/addr/{rank}"), local.to_string().as_bytes())?;

    let hello = |sock: usize| Hello {
        session,
        world_size,
        rank,
        sock,
        nsocks,
    };
    for (peer, streams) in sockets.iter_mut().enumerate().take(rank) {
        let addr = peer_addr(store, peer)?;
        for (sock, slot) in streams.iter_mut().enumerate() {
            let mut stream = connect(peer, addr, deadline)?;
            stream
                .write_all(&hello(sock).encode(&config.auth))
                .map_err(|e| io_setup(peer, "send the hello", e))?;
            *slot = Some(stream);
        }
    }
    accept_higher(&listener, &hello(0), &config.auth, deadline, &mut sockets)?;
    for (peer, streams) in sockets.iter_mut().enumerate().take(rank) {
        for stream in streams.iter_mut().flatten() {
            read_ack(stream, peer, deadline)?;
        }
    }
    sockets
        .into_iter()
        .enumerate()
        .map(|(peer, streams)| {
            streams
                .into_iter()
                .flatten()
                .map(|s| {
                    s.set_nodelay(true)
                        .map_err(|e| io_setup(peer, "set TCP_NODELAY", e))?;
                    s.set_read_timeout(None)
                        .map_err(|e| io_setup(peer, "clear the timeout", e))?;
                    if let Some(dead_after) = config.dead_after {
                        probe(&s, dead_after)
                            .map_err(|e| io_setup(peer, "set TCP keepalive", e))?;
                    }
                    Ok(s)
                })
                .collect()
        })
        .collect()
}

/// Has the kernel probe the peer of `stream` when the connection idles (TCP keepalive: the
/// first probe after a quarter of `dead_after`, then three more a tenth apart), so that a
/// host that stopped answering fails the connection within about half of it. The kernel
/// answers probes for a process that is stopped or busy, so only a gone host fails. (Bytes
/// in flight are not probed: [`Transport::unanswered`](crate::Transport::unanswered) tells
/// the watchdog about those.)
fn probe(stream: &TcpStream, dead_after: Duration) -> io::Result<()> {
    let at_least_a_second = |d: Duration| d.max(Duration::from_secs(1));
    let keepalive = TcpKeepalive::new()
        .with_time(at_least_a_second(dead_after / 4))
        .with_interval(at_least_a_second(dead_after / 10))
        .with_retries(3);
    SockRef::from(stream).set_tcp_keepalive(&keepalive)
}

fn setup(what: &'static str) -> impl Fn(io::Error) -> TransportError {
    move |e| TransportError::resource(format!("cannot {what}"), e)
}

fn io_setup(peer: usize, what: &str, e: io::Error) -> TransportError {
    TransportError::io(peer, "connect", Some(what.to_string()), e)
}

fn listen(addr: SocketAddr) -> Result<TcpListener, TransportError> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)
        .map_err(setup("create a listening socket"))?;
    socket
        .bind(&addr.into())
        .map_err(|e| TransportError::resource(format!("cannot listen on {addr}"), e))?;
    socket.listen(1024).map_err(setup("listen"))?;
    let listener: TcpListener = socket.into();
    listener
        .set_nonblocking(true)
        .map_err(setup("make the listener non-blocking"))?;
    Ok(listener)
}

/// Rank 0 draws a random session id; the others read it from the store.
fn session_id(rank: usize, store: &dyn Store) -> Result<u64, TransportError> {
    use std::hash::{BuildHasher, Hasher};
    const KEY: &str = "tcp/session";
    if rank == 0 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
        );
        h.write_u32(std::process::id());
        let id = h.finish();
        store.set(KEY, &id.to_le_bytes())?;
        return Ok(id);
    }
    let bytes = store.get(KEY)?;
    let bytes: [u8; 8] = bytes
        .try_into()
        .map_err(|_| TransportError::Setup("malformed session id in the store".into()))?;
    Ok(u64::from_le_bytes(bytes))
}

fn peer_addr(store: &dyn Store, peer: usize) -> Result<SocketAddr, TransportError> {
    let raw = store.get(&format!("tcp/addr/{peer}"))?;
    String::from_utf8_lossy(&raw)
        .parse()
        .map_err(|e| TransportError::Setup(format!("rank {peer} published a bad address: {e}")))
}

/// Connects to `peer`, retrying refused connections until `deadline`.
fn connect(peer: usize, addr: SocketAddr, deadline: Instant) -> Result<TcpStream, TransportError> {
    let mut backoff = Duration::from_millis(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let result = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1)));
        match result {
            Ok(stream) => return Ok(stream),
            Err(e) if Instant::now() + backoff >= deadline => {
                return Err(io_setup(peer, &format!("connect to {addr}"), e));
            }
            Err(_) => {
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
    }
}

/// How long an accepted connection may take to send its hello before it is dropped.
const HELLO_WAIT: Duration = Duration::from_secs(5);
/// The most connections waiting for their hello at once; past it the oldest is dropped.
const MAX_PENDING: usize = 256;

/// Accepts `nsocks` sockets from every rank above `rank`.
///
/// Hellos are read from every accepted connection at once, each with its own
/// [`HELLO_WAIT`]: a connection that has not proven itself is never waited on, so a
/// stranger holding connections open, or sending a byte at a time, cannot delay the ranks.
fn accept_higher(
    listener: &TcpListener,
    own: &Hello,
    auth: &Auth,
    deadline: Instant,
    sockets: &mut [Vec<Option<TcpStream>>],
) -> Result<(), TransportError> {
    let rank = own.rank;
    let missing = |sockets: &[Vec<Option<TcpStream>>]| -> Vec<usize> {
        (rank + 1..sockets.len())
            .filter(|&p| sockets[p].iter().any(Option::is_none))
            .collect()
    };
    let mut pending: Vec<Pending> = Vec::new();
    let mut pause = Duration::from_micros(100);
    while !missing(sockets).is_empty() {
        let now = Instant::now();
        if now >= deadline {
            return Err(TransportError::Setup(format!(
                "rank {rank} timed out waiting for ranks {:?} to connect (are they running, with the same MASTER_ADDR and MASTER_PORT?)",
                missing(sockets)
            )));
        }
        let mut progressed = false;
        loop {
            let (stream, from) = match listener.accept() {
                Ok(pair) => pair,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(TransportError::resource("accept failed", e)),
            };
            progressed = true;
            if let Err(e) = stream.set_nonblocking(true) {
                tracing::warn!(%from, "dropped a connection: {e}");
                continue;
            }
            if pending.len() >= MAX_PENDING {
                let oldest = pending.remove(0);
                tracing::warn!(from = %oldest.from, "dropped a connection: too many without a hello");
            }
            pending.push(Pending {
                stream,
                from,
                hello: [0; HELLO_LEN],
                got: 0,
                until: (now + HELLO_WAIT).min(deadline),
            });
        }
        let mut i = 0;
        while i < pending.len() {
            let outcome = match pending[i].read(auth) {
                Ok(None) if now < pending[i].until => {
                    i += 1;
                    continue;
                }
                Ok(None) => Err(format!("no hello within {HELLO_WAIT:?}")),
                Ok(Some(hello)) => own.admit(&hello, sockets),
                Err(why) => Err(why),
            };
            progressed = true;
            let Pending {
                mut stream, from, ..
            } = pending.swap_remove(i);
            match outcome {
                Ok((peer, sock)) => {
                    stream
                        .set_nonblocking(false)
                        .and_then(|()| stream.write_all(&[ACK]))
                        .map_err(|e| io_setup(peer, "send the ack", e))?;
                    sockets[peer][sock] = Some(stream);
                }
                Err(why) => tracing::warn!(%from, "dropped a connection: {why}"),
            }
        }
        if progressed {
            pause = Duration::from_micros(100);
        } else {
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }
    Ok(())
}

/// An accepted connection whose hello has not fully arrived.
struct Pending {
    stream: TcpStream,
    from: SocketAddr,
    hello: [u8; HELLO_LEN],
    got: usize,
    /// When it is dropped if the hello is still incomplete.
    until: Instant,
}

impl Pending {
    /// Reads what has arrived: the decoded hello once complete, `None` while incomplete.
    fn read(&mut self, auth: &Auth) -> Result<Option<Hello>, String> {
        loop {
            match self.stream.read(&mut self.hello[self.got..]) {
                Ok(0) => return Err("closed before its hello".into()),
                Ok(n) => {
                    self.got += n;
                    if self.got == HELLO_LEN {
                        return Hello::decode(&self.hello, auth).map(Some);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("no hello: {e}")),
            }
        }
    }
}

fn read_ack(stream: &mut TcpStream, peer: usize, deadline: Instant) -> Result<(), TransportError> {
    let wait = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream
        .set_read_timeout(Some(wait))
        .map_err(|e| io_setup(peer, "set a timeout", e))?;
    let mut ack = [0u8; 1];
    stream.read_exact(&mut ack).map_err(|e| {
        io_setup(
            peer,
            "read the connection ack (did the peer reject this rank's hello?)",
            e,
        )
    })?;
    if ack[0] != ACK {
        return Err(TransportError::Protocol {
            peer,
            detail: format!("bad connection ack {:#x}", ack[0]),
        });
    }
    Ok(())
}

/// The first bytes on every socket.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Hello {
    session: u64,
    world_size: usize,
    rank: usize,
    sock: usize,
    nsocks: usize,
}

impl Hello {
    /// The hello's bytes, sealed with `auth`'s MAC.
    fn encode(&self, auth: &Auth) -> [u8; HELLO_LEN] {
        let mut out = [0u8; HELLO_LEN];
        out[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        out[4..12].copy_from_slice(&self.session.to_le_bytes());
        for (i, v) in [self.world_size, self.rank, self.sock, self.nsocks]
            .into_iter()
            .enumerate()
        {
            let at = 12 + 4 * i;
            out[at..at + 4].copy_from_slice(&(v as u32).to_le_bytes());
        }
        let mac = auth.mac(DOMAIN, &[&out[..FIELDS_LEN]]);
        out[FIELDS_LEN..].copy_from_slice(&mac);
        out
    }

    /// Decodes a hello, checking its magic number and that `auth`'s job sealed it.
    fn decode(buf: &[u8; HELLO_LEN], auth: &Auth) -> Result<Hello, String> {
        let word = |at: usize| u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"));
        if word(0) != HELLO_MAGIC {
            return Err("bad hello magic: not a Chorus peer".into());
        }
        if !auth.verify(DOMAIN, &[&buf[..FIELDS_LEN]], &buf[FIELDS_LEN..]) {
            return Err(
                "hello not sealed with this job's secret (another job, or a different CHORUS_AUTH_TOKEN)".into(),
            );
        }
        Ok(Hello {
            session: u64::from_le_bytes(buf[4..12].try_into().expect("8 bytes")),
            world_size: word(12) as usize,
            rank: word(16) as usize,
            sock: word(20) as usize,
            nsocks: word(24) as usize,
        })
    }

    /// Checks a peer's hello against this rank's view; returns (peer, socket).
    fn admit(
        &self,
        theirs: &Hello,
        sockets: &[Vec<Option<TcpStream>>],
    ) -> Result<(usize, usize), String> {
        if theirs.session != self.session {
            return Err("hello from another job (session id differs)".into());
        }
        if theirs.world_size != self.world_size || theirs.nsocks != self.nsocks {
            return Err(format!(
                "rank {} has world size {} and {} sockets per peer, this rank {} and {}",
                theirs.rank, theirs.world_size, theirs.nsocks, self.world_size, self.nsocks
            ));
        }
        if theirs.rank <= self.rank || theirs.rank >= self.world_size || theirs.sock >= self.nsocks
        {
            return Err(format!(
                "unexpected hello from rank {} socket {}",
                theirs.rank, theirs.sock
            ));
        }
        if sockets[theirs.rank][theirs.sock].is_some() {
            return Err(format!(
                "duplicate hello from rank {} socket {}",
                theirs.rank, theirs.sock
            ));
        }
        Ok((theirs.rank, theirs.sock))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Strangers that connect and send nothing, or a byte, before the peer: the peer is
    /// admitted as soon as its hello arrives. (Reading hellos one at a time, five seconds
    /// each, the strangers would outlast the deadline.)
    #[test]
    fn strangers_without_a_hello_do_not_hold_up_the_peers() {
        let listener = listen(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        let addr = listener.local_addr().unwrap();
        let strangers: Vec<TcpStream> = (0..4)
            .map(|i| {
                let mut s = TcpStream::connect(addr).unwrap();
                if i % 2 == 1 {
                    s.write_all(b"C").unwrap();
                }
                s
            })
            .collect();
        let auth = Auth::new("job", "secret").unwrap();
        let hello = |rank| Hello {
            session: 9,
            world_size: 2,
            rank,
            sock: 0,
            nsocks: 1,
        };
        let mut peer = TcpStream::connect(addr).unwrap();
        peer.write_all(&hello(1).encode(&auth)).unwrap();
        let mut sockets: Vec<Vec<Option<TcpStream>>> = vec![vec![None], vec![None]];
        let deadline = Instant::now() + Duration::from_secs(15);
        accept_higher(&listener, &hello(0), &auth, deadline, &mut sockets).unwrap();
        assert!(sockets[1][0].is_some());
        read_ack(&mut peer, 0, deadline).unwrap();
        drop(strangers);
    }

    #[test]
    fn hello_round_trips_and_rejects_strangers() {
        let h = Hello {
            session: 42,
            world_size: 8,
            rank: 3,
            sock: 1,
            nsocks: 2,
        };
        let auth = Auth::new("job", "secret").unwrap();
        assert_eq!(Hello::decode(&h.encode(&auth), &auth), Ok(h.clone()));
        let mut bad = h.encode(&auth);
        bad[0] = b'X';
        assert!(Hello::decode(&bad, &auth).is_err());
        let mut forged = h.encode(&auth);
        forged[16] ^= 1; // Claims another rank under the same seal.
        assert!(Hello::decode(&forged, &auth)
            .unwrap_err()
            .contains("secret"));
        for other in [
            Auth::new("job", "guess").unwrap(),
            Auth::new("job2", "secret").unwrap(),
        ] {
            assert!(
                Hello::decode(&h.encode(&other), &auth).is_err(),
                "{other:?}"
            );
        }

        let own = Hello {
            rank: 1,
            ..h.clone()
        };
        let sockets: Vec<Vec<Option<TcpStream>>> = (0..8).map(|_| vec![None, None]).collect();
        assert_eq!(own.admit(&h, &sockets), Ok((3, 1)));
        let other_job = Hello {
            session: 7,
            ..h.clone()
        };
        assert!(own
            .admit(&other_job, &sockets)
            .unwrap_err()
            .contains("another job"));
        let lower = Hello {
            rank: 0,
            ..h.clone()
        };
        assert!(own.admit(&lower, &sockets).is_err());
        let wrong_world = Hello { world_size: 4, ..h };
        assert!(own
            .admit(&wrong_world, &sockets)
            .unwrap_err()
            .contains("world size 4"));
    }
}
