//! The TCP progress engine: per-socket send and receive queues, served by the threads that
//! post and wait, and by a background thread.
//!
//! All state sits behind one mutex. A posting thread enqueues its stripes and immediately
//! tries the socket (so small messages leave without a thread hop). Everything else moves
//! when [`Poller`] finds a socket ready: it owns readiness, and says which sockets the
//! waiters watch (and read and write themselves) and which the background thread watches
//! (sends that did not fit). A socket is only read while a receive is posted on it:
//! unexpected data stays in the kernel, so there is no unbounded buffering and every payload
//! lands straight in the caller's buffer.

use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::conn::{check_header, io_error, send_frame, Conn, Inbound, RecvPiece, SendPiece, SMALL};
use super::frame::{self, FrameHeader, HEADER_LEN};
use super::poller::{Poller, Sleeper, Watch};
use crate::matching;
use crate::peers::Peers;
use crate::request::{Completion, CompletionPool, Direction, Idle, Progress, Request};
use crate::{Exchange, Payload, TransportError};

/// Longest a blocked waiter sleeps before it looks at its request again (a request can also be
/// completed by another thread, or failed by an abort that does not shut the sockets).
const NAP: Duration = Duration::from_millis(2);

/// Longest an exchange waits for its small reply to arrive while it holds the engine, reading
/// the socket itself, before it queues the receive like any other (as a waiter spins first).
const DIRECT: Duration = Duration::from_micros(50);

/// Everything the engine knows; guarded by the mutex in [`Shared`].
#[derive(Debug)]
pub(crate) struct Engine {
    /// Each peer's sockets (indices into `conns`).
    peers: Peers<Vec<usize>>,
    conns: Vec<Conn>,
    min_stripe: usize,
    /// Sockets that stopped on their budget and must be served again.
    again: Vec<usize>,
    /// Stripes finished or failed so far, and that count when sleepers were last told.
    settled: u64,
    told: u64,
    /// Waiters asleep in the poller, and whether their doorbell is rung.
    sleepers: usize,
    rung: bool,
    /// A post left bytes queued on a socket the background thread does not watch yet.
    kick: bool,
    completions: CompletionPool,
}

// SAFETY: the raw pointers in the queues are only dereferenced while the
// engine mutex is held; `Transport::isend`/`irecv` callers guarantee the
// memory stays valid until the request completes or `abort` returns, and
// both completion and abort happen under that same mutex.
unsafe impl Send for Engine {}

/// The engine and its poller, shared by the posting, waiting and background threads.
#[derive(Debug)]
pub(crate) struct Shared {
    engine: Mutex<Engine>,
    poller: Poller,
    stop: AtomicBool,
}

impl Shared {
    /// Builds the engine over `sockets[p]` (the sockets to peer `p`) for `rank`.
    pub(crate) fn new(
        rank: usize,
        sockets: Vec<Vec<TcpStream>>,
        min_stripe: usize,
    ) -> io::Result<Arc<Shared>> {
        let mut links = Vec::with_capacity(sockets.len());
        let mut conns = Vec::new();
        for (peer, streams) in sockets.into_iter().enumerate() {
            let mut link = Vec::new();
            for stream in streams {
                stream.set_nonblocking(true)?;
                link.push(conns.len());
                conns.push(Conn::new(peer, stream));
            }
            links.push((peer != rank).then_some(link));
        }
        let engine = Engine {
            peers: Peers::new(rank, links),
            conns,
            min_stripe,
            again: Vec::new(),
            settled: 0,
            told: 0,
            sleepers: 0,
            rung: false,
            kick: false,
            completions: CompletionPool::default(),
        };
        Ok(Arc::new(Shared {
            engine: Mutex::new(engine),
            poller: Poller::new()?,
            stop: AtomicBool::new(false),
        }))
    }

    /// Locks the engine (a panic elsewhere does not poison progress).
    pub(crate) fn lock(&self) -> MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Kicks the background thread if there is work it does not watch yet, and rings the
    /// waiters' doorbell if some request settled while waiters sleep.
    pub(crate) fn hand_over(&self, engine: &mut Engine) {
        if std::mem::take(&mut engine.kick) || !engine.again.is_empty() {
            self.poller.kick();
        }
        if engine.settled != engine.told && engine.sleepers > 0 {
            self.poller.ring();
            engine.rung = true;
        }
        engine.told = engine.settled;
    }
}

impl crate::endpoint::Engine for Shared {
    unsafe fn post(
        &self,
        peer: usize,
        tag: u64,
        payload: Payload<'_>,
    ) -> Result<Request, TransportError> {
        let (direction, buf, len) = payload.raw();
        let mut engine = self.lock();
        // SAFETY: the caller keeps `buf` valid (and unaliased for a receive) until completion or
        // abort (this trait's contract).
        let req = unsafe {
            match direction {
                Direction::Send => engine.post_send(peer, tag, buf, len),
                Direction::Recv => engine.post_recv(peer, tag, buf, len),
            }
        };
        self.hand_over(&mut engine);
        req
    }

    /// A small exchange whose reply is the next frame on a socket with nothing else to read
    /// is done under the engine's lock: the send written at once (without a request, where
    /// the socket takes it whole), the reply read straight from the socket into `buf`,
    /// without a request, for up to [`DIRECT`]; then the receive is queued like any other.
    /// Holding the lock keeps every other receive queued behind this one, so no other thread
    /// reads its frame.
    unsafe fn sendrecv(
        &self,
        to: usize,
        from: usize,
        tag: u64,
        data: &[u8],
        buf: &mut [u8],
    ) -> Result<Option<Exchange>, TransportError> {
        if data.len() > SMALL || buf.len() > SMALL {
            return Ok(None);
        }
        let mut engine = self.lock();
        let Some(idx) = engine.quiet_inbound(from, buf.len()) else {
            return Ok(None);
        };
        // SAFETY: the caller keeps `data` valid until the send completes or the engine is
        // aborted (this trait's contract).
        let send = unsafe { engine.send_now(to, tag, data) };
        let recv = match send {
            Ok(_) => engine.read_direct(idx, from, tag, buf),
            Err(_) => Ok(None),
        };
        self.hand_over(&mut engine);
        Ok(Some(Exchange {
            send: send?,
            recv: recv?,
        }))
    }

    fn probe(&self, peer: usize) -> Result<Option<(u64, usize)>, TransportError> {
        let mut engine = self.lock();
        let next = engine.probe(peer);
        // A peer found failed has had its requests failed: their waiters are told.
        self.hand_over(&mut engine);
        next
    }

    fn abort(&self, reason: &str) {
        let mut engine = self.lock();
        engine.abort(reason, true);
        self.hand_over(&mut engine);
    }

    fn unanswered(&self, peer: usize) -> Option<Duration> {
        let engine = self.lock();
        let link = &engine.peers.get(peer)?.link;
        link.iter()
            .filter_map(|&idx| engine.conns[idx].unanswered())
            .max()
    }

    /// Asks the background thread to exit.
    fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.poller.kick();
    }

    /// The background thread's loop: sleeps in the poller on sockets with sends queued, and
    /// serves them and those that stopped on their budget.
    fn run(&self) {
        // Looked at before each sleep: `stop` is set before its kick, which a serve below may
        // clear.
        while !self.stop.load(Ordering::Acquire) {
            let mut engine = self.lock();
            for idx in std::mem::take(&mut engine.again) {
                engine.serve(idx, true, true);
            }
            self.hand_over(&mut engine);
            let busy = !engine.again.is_empty();
            let watch = self.poller.watch(engine.queued(), Sleeper::Background);
            drop(engine);
            let mut watch = watch.expect("the background thread always watches its kick");
            self.poller.sleep(&mut watch, busy.then(Instant::now));
            let mut engine = self.lock();
            engine.serve_ready(&self.poller, &watch);
            if self.poller.rang(&watch) {
                self.poller.clear_kick();
            }
            self.hand_over(&mut engine);
        }
    }

    fn close(&self) {
        let mut engine = self.lock();
        engine.abort("transport dropped", false);
        self.hand_over(&mut engine);
    }
}

impl Progress for Shared {
    /// Serves `peer`'s sockets; if no message settled, yields the CPU: what the waiter needs
    /// next comes from another process (and the kernel's loopback work done in its context),
    /// which a spinning waiter would keep off a busy core. With 4 ranks on 2 cores this halves
    /// an 8-byte all-reduce; with a core to spare it costs nothing. A waiter whose message just
    /// arrived goes on at once: yielding then handed the core to a spinning rank for nothing.
    fn poll(&self, peer: usize) {
        // Never wait for the lock: the thread holding it is making progress anyway.
        if let Ok(mut engine) = self.engine.try_lock() {
            let before = engine.settled;
            let socks = engine.peers.get(peer).map_or(0, |p| p.link.len());
            for k in 0..socks {
                let idx = engine.peers.get(peer).expect("reached").link[k];
                engine.serve(idx, true, true);
            }
            let settled = engine.settled != before;
            self.hand_over(&mut engine);
            if settled {
                return;
            }
        }
        std::thread::yield_now();
    }

    /// Sleeps in the poller on every socket with a receive posted or a send queued, and on the
    /// doorbell, then serves the sockets that are ready: every socket, not only the awaited
    /// peer's, so bytes that some other rank needs first keep moving while this thread waits.
    fn idle(&self, _peer: usize, until: Instant, done: &dyn Fn() -> bool) -> Idle {
        let mut watch = {
            let mut engine = self.lock();
            // Requests settle under this lock: one that settles after this check rings.
            if done() {
                return Idle::Again;
            }
            let Some(watch) = self.poller.watch(engine.queued(), Sleeper::Waiter) else {
                return Idle::Park;
            };
            engine.sleepers += 1;
            watch
        };
        self.poller
            .sleep(&mut watch, Some(until.min(Instant::now() + NAP)));
        let mut engine = self.lock();
        engine.sleepers -= 1;
        if engine.sleepers == 0 && engine.rung {
            self.poller.clear_doorbell();
            engine.rung = false;
        }
        engine.serve_ready(&self.poller, &watch);
        self.hand_over(&mut engine);
        Idle::Again
    }
}

impl Engine {
    /// Every socket with a receive posted or a send queued: its index and descriptor, and
    /// whether it has receives and sends.
    pub(crate) fn queued(&self) -> impl Iterator<Item = (usize, libc::c_int, bool, bool)> + '_ {
        self.conns.iter().enumerate().filter_map(|(idx, conn)| {
            let (reads, writes) = (!conn.recvs.is_empty(), !conn.sends.is_empty());
            (reads || writes).then(|| (idx, conn.stream.as_raw_fd(), reads, writes))
        })
    }

    /// Numbers a new message to or from `peer`, lays out its stripes and
    /// creates its request; fails if the peer cannot be used.
    fn start(
        &mut self,
        peer: usize,
        direction: Direction,
        len: usize,
    ) -> Result<
        (
            u64,
            impl ExactSizeIterator<Item = frame::Stripe>,
            Request,
            Arc<Completion>,
        ),
        TransportError,
    > {
        let p = self.peers.usable(peer)?;
        let seq = p.next_seq(direction);
        let stripes = frame::stripes(seq, len, p.link.len(), self.min_stripe);
        let (req, done) =
            Request::pooled(&mut self.completions, peer, direction, len, stripes.len());
        Ok((seq, stripes, req, done))
    }

    /// Queues a send and writes as much as the sockets take now.
    ///
    /// # Safety
    ///
    /// `data..data+len` must stay valid until the request completes or the
    /// engine is aborted.
    pub(crate) unsafe fn post_send(
        &mut self,
        peer: usize,
        tag: u64,
        data: *const u8,
        len: usize,
    ) -> Result<Request, TransportError> {
        let (seq, stripes, req, done) = self.start(peer, Direction::Send, len)?;
        for stripe in stripes {
            let idx = self.socket(peer, stripe.socket);
            let watched = !self.conns[idx].sends.is_empty();
            let header = FrameHeader {
                tag,
                seq,
                msg_len: len as u64,
                stripe_len: stripe.range.len() as u64,
            };
            self.conns[idx].sends.push_back(SendPiece {
                header: header.encode(),
                // SAFETY: `stripe.range` lies within `0..len` (frame::stripes covers exactly the message).
                data: unsafe { data.add(stripe.range.start) },
                len: stripe.range.len(),
                written: 0,
                done: done.clone(),
            });
            self.serve(idx, false, true);
            // What did not fit is the background thread's, which must look at this socket.
            self.kick |= !watched && !self.conns[idx].sends.is_empty();
        }
        Ok(req)
    }

    /// Sends `data` (at most [`SMALL`] bytes, one stripe) straight from the caller, without a
    /// request, when nothing is queued on its socket and the socket takes its whole frame at
    /// once: `None`. Otherwise queues it as [`post_send`](Self::post_send) does, with what the
    /// socket took counted as written, and returns that request. A failure fails the peer.
    ///
    /// # Safety
    ///
    /// As for [`post_send`](Self::post_send): `data` must stay valid until a returned request
    /// completes or the engine is aborted.
    unsafe fn send_now(
        &mut self,
        to: usize,
        tag: u64,
        data: &[u8],
    ) -> Result<Option<Request>, TransportError> {
        let len = data.len();
        let p = self.peers.usable(to)?;
        let idle = small_socket(&p.link, p.send_seq(), len, self.min_stripe)
            .filter(|&idx| self.conns[idx].sends.is_empty());
        let Some(idx) = idle else {
            // SAFETY: the caller's guarantee, passed on.
            return unsafe { self.post_send(to, tag, data.as_ptr(), len) }.map(Some);
        };
        let header = FrameHeader {
            tag,
            seq: p.next_seq(Direction::Send),
            msg_len: len as u64,
            stripe_len: len as u64,
        }
        .encode();
        let conn = &mut self.conns[idx];
        let written = loop {
            match send_frame(&mut conn.stream, &header, data) {
                Ok(0) => break Err(TransportError::PeerClosed { peer: to }),
                Ok(n) => break Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break Ok(0),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => break Err(io_error(to, "send", e)),
            }
        };
        let written = match written {
            Ok(n) if n == HEADER_LEN + len => return Ok(None),
            Ok(n) => n,
            Err(err) => {
                self.fail_peer(to, err.clone());
                return Err(err);
            }
        };
        let (req, done) = Request::pooled(&mut self.completions, to, Direction::Send, len, 1);
        conn.sends.push_back(SendPiece {
            header,
            data: data.as_ptr(),
            len,
            written,
            done,
        });
        // The rest is the background thread's, which must look at this socket.
        self.kick = true;
        Ok(Some(req))
    }

    /// Queues a receive; its waiter reads it (a read now would mostly find nothing yet, and cost
    /// a syscall on every small message).
    ///
    /// # Safety
    ///
    /// `buf..buf+len` must stay valid and unaliased until the request
    /// completes or the engine is aborted.
    pub(crate) unsafe fn post_recv(
        &mut self,
        peer: usize,
        tag: u64,
        buf: *mut u8,
        len: usize,
    ) -> Result<Request, TransportError> {
        let (seq, stripes, req, done) = self.start(peer, Direction::Recv, len)?;
        for stripe in stripes {
            let idx = self.socket(peer, stripe.socket);
            self.conns[idx].recvs.push_back(RecvPiece {
                expect: FrameHeader {
                    tag,
                    seq,
                    msg_len: len as u64,
                    stripe_len: stripe.range.len() as u64,
                },
                // SAFETY: `stripe.range` lies within `0..len`.
                buf: unsafe { buf.add(stripe.range.start) },
                len: stripe.range.len(),
                got: 0,
                done: done.clone(),
            });
        }
        Ok(req)
    }

    /// The tag and length of the next message from `peer` that no posted receive claims, once
    /// the header of its first stripe has arrived; fails the peer if its socket has failed or
    /// closed.
    ///
    /// Message `recv_seq`'s first stripe travels on a socket known from its number alone. With
    /// no receive queued on that socket, every earlier frame on it has been read, so the bytes
    /// at its front are that stripe's header: peeked (`MSG_PEEK`), never read.
    pub(crate) fn probe(&mut self, peer: usize) -> Result<Option<(u64, usize)>, TransportError> {
        let p = self.peers.usable(peer)?;
        let seq = p.recv_seq();
        let idx = p.link[frame::first_socket(seq, p.link.len())];
        let conn = &mut self.conns[idx];
        if !conn.recvs.is_empty() {
            return Ok(None);
        }
        let next = conn.peek_header().and_then(|header| match header {
            Some(h) => {
                matching::check_seq(peer, h.seq, seq)?;
                Ok(Some((h.tag, h.msg_len as usize)))
            }
            None => Ok(None),
        });
        if let Err(e) = &next {
            self.fail_peer(peer, e.clone());
        }
        next
    }

    /// The socket that the next message from `from` (`len` bytes) arrives on whole, if it is
    /// at most [`SMALL`] bytes, one stripe, and nothing is posted or half read on that socket:
    /// then the frame at its front is that message's.
    fn quiet_inbound(&mut self, from: usize, len: usize) -> Option<usize> {
        let p = self.peers.usable(from).ok()?;
        let idx = small_socket(&p.link, p.recv_seq(), len, self.min_stripe)?;
        let conn = &self.conns[idx];
        let quiet = conn.recvs.is_empty() && conn.header_got == 0;
        (quiet && conn.inbound == Inbound::Open).then_some(idx)
    }

    /// Reads the next message from `from`, `buf.len()` bytes tagged `tag`, straight from its
    /// quiet socket `idx` into `buf`, yielding the core while nothing has arrived, for up to
    /// [`DIRECT`]; then, or once part of its frame has been read, queues its receive as
    /// [`post_recv`](Self::post_recv) does (with the bytes read so far) and returns that
    /// request. A failure fails the peer.
    ///
    /// The caller holds the engine throughout, so nothing else reads socket `idx` meanwhile.
    fn read_direct(
        &mut self,
        idx: usize,
        from: usize,
        tag: u64,
        buf: &mut [u8],
    ) -> Result<Option<Request>, TransportError> {
        let read = self.take_reply(idx, from, tag, buf);
        if let Err(err) = &read {
            self.fail_peer(from, err.clone());
        }
        read
    }

    /// [`read_direct`](Self::read_direct), but for failing the peer.
    fn take_reply(
        &mut self,
        idx: usize,
        from: usize,
        tag: u64,
        buf: &mut [u8],
    ) -> Result<Option<Request>, TransportError> {
        let len = buf.len();
        let total = HEADER_LEN + len;
        let mut frame = [0u8; HEADER_LEN + SMALL];
        let mut until = None;
        let got = loop {
            match self.conns[idx].stream.read(&mut frame[..total]) {
                Ok(0) => {
                    self.conns[idx].inbound = Inbound::Ended;
                    return Err(TransportError::PeerClosed { peer: from });
                }
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let now = Instant::now();
                    if now >= *until.get_or_insert(now + DIRECT) {
                        break 0;
                    }
                    std::thread::yield_now();
                }
                Err(e) => return Err(io_error(from, "recv", e)),
            }
        };
        let p = self.peers.usable(from)?;
        if got == total {
            let seq = p.next_seq(Direction::Recv);
            let expect = FrameHeader {
                tag,
                seq,
                msg_len: len as u64,
                stripe_len: len as u64,
            };
            let header = frame[..HEADER_LEN].try_into().expect("a header's bytes");
            check_header(from, header, &expect)?;
            buf.copy_from_slice(&frame[HEADER_LEN..total]);
            return Ok(None);
        }
        // The frame's first bytes go where `pump` would have put them.
        let head = got.min(HEADER_LEN);
        buf[..got - head].copy_from_slice(&frame[head..got]);
        // SAFETY: the caller keeps `buf` valid and unaliased until the request completes or
        // the engine is aborted (`Engine::sendrecv`'s contract).
        let req = unsafe { self.post_recv(from, tag, buf.as_mut_ptr(), len)? };
        if got > 0 {
            let conn = &mut self.conns[idx];
            conn.header[..head].copy_from_slice(&frame[..head]);
            conn.header_got = head;
            let piece = conn.recvs.front_mut().expect("the receive just queued");
            piece.got = got - head;
            if head == HEADER_LEN {
                check_header(from, &conn.header, &piece.expect)?;
            }
        }
        Ok(Some(req))
    }

    /// Serves the sockets the poller found ready in `watch`.
    fn serve_ready(&mut self, poller: &Poller, watch: &Watch) {
        for (idx, read, write) in poller.ready(watch) {
            self.serve(idx, read, write);
        }
    }

    /// Moves bytes on socket `idx`; a failure fails the whole peer.
    fn serve(&mut self, idx: usize, read: bool, write: bool) {
        let conn = &mut self.conns[idx];
        let (peer, before) = (conn.peer, conn.finished);
        let mut result = Ok(true);
        if write {
            result = conn.flush();
        }
        if read && matches!(result, Ok(true)) {
            result = conn.pump();
        }
        self.settled += conn.finished - before;
        match result {
            Ok(true) => {}
            Ok(false) => self.again.push(idx),
            Err(e) => self.fail_peer(peer, e),
        }
    }

    /// Fails every request to `peer`, now and later, and closes its sockets, except after a
    /// protocol error: then the sockets stay open until the caller aborts, so it can first
    /// tell the other ranks what went wrong (a peer that saw them close would blame this rank).
    pub(crate) fn fail_peer(&mut self, peer: usize, err: TransportError) {
        let close = !matches!(err, TransportError::Protocol { .. });
        self.fail_requests(peer, err, close);
    }

    /// Fails every request to `peer`, now and later; with `close`, also shuts
    /// its sockets down so the peer notices at once.
    fn fail_requests(&mut self, peer: usize, err: TransportError, close: bool) {
        let (conns, settled) = (&mut self.conns, &mut self.settled);
        self.peers.fail(peer, err, |socks, err| {
            *settled += fail_sockets(conns, socks, err, close);
        });
    }

    /// Fails everything with `Aborted(reason)`; later posts fail the same way.
    ///
    /// With `close`, shuts every socket down so peers notice at once;
    /// without, the sockets close gracefully when dropped, and bytes already
    /// handed to the kernel still reach their peers.
    pub(crate) fn abort(&mut self, reason: &str, close: bool) {
        let (conns, settled) = (&mut self.conns, &mut self.settled);
        self.peers.abort(reason, |socks, err| {
            *settled += fail_sockets(conns, socks, err, close);
        });
    }

    /// Socket `k` of `peer` (a reached peer: its link was checked).
    fn socket(&self, peer: usize, k: usize) -> usize {
        self.peers.get(peer).expect("a reached peer").link[k]
    }
}

/// Fails every stripe queued on sockets `socks` with `err` (and with `close` shuts them down);
/// returns how many there were.
fn fail_sockets(conns: &mut [Conn], socks: &[usize], err: &TransportError, close: bool) -> u64 {
    let mut failed = 0;
    for &idx in socks {
        let conn = &mut conns[idx];
        failed += (conn.sends.len() + conn.recvs.len()) as u64;
        for piece in conn.sends.drain(..) {
            piece.done.complete(Err(err.clone()));
        }
        for piece in conn.recvs.drain(..) {
            piece.done.complete(Err(err.clone()));
        }
        if close {
            let _ = conn.stream.shutdown(std::net::Shutdown::Both);
        }
    }
    failed
}

/// The socket of `link` that message `seq` of `len` bytes travels on whole, if it is at most
/// [`SMALL`] bytes and one stripe.
fn small_socket(link: &[usize], seq: u64, len: usize, min_stripe: usize) -> Option<usize> {
    let one = len <= SMALL && frame::stripes(seq, len, link.len(), min_stripe).len() == 1;
    one.then(|| link[frame::first_socket(seq, link.len())])
}

#[cfg(test)]
mod tests {
    use super::super::conn::conn_and_other_end;
    use super::*;
    use std::io::Write;
    use std::net::TcpStream as StdStream;

    /// Rank 0's engine over one socket to rank 1, and rank 1's end of it (blocking).
    fn engine_and_peer() -> (Arc<Shared>, StdStream) {
        let (conn, peer) = conn_and_other_end();
        let engine = Shared::new(0, vec![vec![], vec![conn.stream]], 4096).expect("engine");
        (engine, peer)
    }

    /// The frame of message `seq` of rank 1 to rank 0: `payload` tagged `tag`.
    fn frame_of(tag: u64, seq: u64, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u64;
        let header = FrameHeader {
            tag,
            seq,
            msg_len: len,
            stripe_len: len,
        };
        let mut wire = header.encode().to_vec();
        wire.extend_from_slice(payload);
        wire
    }

    /// Waits until `bytes` bytes wait on rank 0's socket.
    fn arrived(engine: &Shared, bytes: usize) {
        let waiting = || {
            engine.lock().conns[0]
                .stream
                .peek(&mut [0u8; 64])
                .unwrap_or(0)
        };
        while waiting() < bytes {
            std::thread::yield_now();
        }
    }

    /// Rank 0's `sendrecv` of `data` with rank 1, into `buf`.
    fn exchange(engine: &Shared, data: &[u8], buf: &mut [u8]) -> Result<Exchange, TransportError> {
        use crate::endpoint::Engine as _;
        // SAFETY: the callers keep both buffers until the requests returned are settled.
        let taken = unsafe { engine.sendrecv(1, 1, 7, data, buf) };
        Ok(taken?.expect("a small exchange on a quiet socket is the engine's"))
    }

    #[test]
    fn an_exchange_reads_a_frame_that_has_arrived_without_a_request() {
        let (engine, mut peer) = engine_and_peer();
        // The reply is on the socket before the exchange starts.
        let wire = frame_of(7, 0, &[5; 8]);
        peer.write_all(&wire).expect("write");
        arrived(&engine, wire.len());
        let mut buf = [0u8; 8];
        let pending = exchange(&engine, &[9; 8], &mut buf).expect("exchange");
        assert!(
            pending.send.is_none() && pending.recv.is_none(),
            "{pending:?}"
        );
        assert_eq!(buf, [5; 8]);
        let mut sent = vec![0u8; HEADER_LEN + 8];
        peer.read_exact(&mut sent).expect("read");
        assert_eq!(sent, frame_of(7, 0, &[9; 8]));
    }

    #[test]
    fn an_exchange_whose_send_the_socket_cannot_take_queues_it() {
        let (engine, mut peer) = engine_and_peer();
        // Bytes ahead of the exchange's frame fill the socket.
        let mut ahead = 0;
        loop {
            match engine.lock().conns[0].stream.write(&[3; 65536]) {
                Ok(n) => ahead += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("filling the socket: {e}"),
            }
        }
        let mut buf = [0u8; 8];
        let pending = exchange(&engine, &[9; 8], &mut buf).expect("exchange");
        let send = pending.send.expect("a full socket cannot take the frame");
        let reader = std::thread::spawn(move || {
            let mut wire = vec![0u8; ahead + HEADER_LEN + 8];
            peer.read_exact(&mut wire).expect("read");
            (peer, wire)
        });
        send.with_progress(engine.clone())
            .wait(Instant::now() + Duration::from_secs(10))
            .expect("the send, once the peer reads");
        let (_peer, wire) = reader.join().expect("reader");
        assert!(wire[..ahead].iter().all(|&b| b == 3));
        assert_eq!(wire[ahead..], frame_of(7, 0, &[9; 8]));
    }

    #[test]
    fn an_exchange_hands_a_late_or_partial_reply_to_a_queued_receive() {
        // Nothing yet, part of the header, the whole header, the header and part of the payload.
        for early in [0, 10, HEADER_LEN, HEADER_LEN + 3] {
            let (engine, mut peer) = engine_and_peer();
            let wire = frame_of(7, 0, &[1, 2, 3, 4, 5, 6]);
            peer.write_all(&wire[..early]).expect("write");
            arrived(&engine, early);
            let mut buf = [0u8; 6];
            let pending = exchange(&engine, &[9; 3], &mut buf).expect("exchange");
            let recv = pending.recv.expect("the reply cannot have arrived whole");
            assert!(recv.test().is_none(), "{early}: done too early");
            peer.write_all(&wire[early..]).expect("write");
            let recv = recv.with_progress(engine.clone());
            recv.wait(Instant::now() + Duration::from_secs(10))
                .expect("the reply");
            assert_eq!(buf, [1, 2, 3, 4, 5, 6], "{early}");
        }
    }

    #[test]
    fn an_exchange_whose_reply_is_another_message_fails_the_peer() {
        let (engine, mut peer) = engine_and_peer();
        peer.write_all(&frame_of(8, 0, &[1; 4])).expect("write");
        let mut buf = [0u8; 4];
        // Read at once, or (not arrived yet) queued and failed when it arrives.
        let err = match exchange(&engine, &[], &mut buf) {
            Err(e) => e,
            Ok(pending) => {
                let recv = pending.recv.expect("pending").with_progress(engine.clone());
                recv.wait(Instant::now() + Duration::from_secs(10))
                    .unwrap_err()
            }
        };
        assert!(
            matches!(err, TransportError::Protocol { peer: 1, .. }),
            "{err}"
        );
    }
}
