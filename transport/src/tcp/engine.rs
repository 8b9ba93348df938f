//! The TCP progress engine: per-socket send and receive queues, driven by the
//! threads that post and wait, and by a background progress thread.
//!
//! All state sits behind one mutex. A posting thread enqueues its stripes and
//! immediately tries the socket (so small messages leave without a thread
//! hop); what does not fit is written by the progress thread on the socket's
//! next edge-triggered writable event, and by waiters. Incoming bytes are read
//! by the threads waiting on this transport: a waiter spins briefly, then
//! sleeps in `poll(2)` on every socket with work queued (and on a doorbell
//! rung when a request settles) and serves them itself when it wakes, so a
//! message costs no hop through another thread. The progress thread reads only
//! to finish what a waiter left at its per-socket budget. A socket is only read
//! while a receive is posted on it: unexpected data stays in the kernel, so
//! there is no unbounded buffering and every payload lands straight in the
//! caller's buffer.

use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token, Waker};

use super::frame::{self, FrameHeader, HEADER_LEN};
use crate::matching::{self, MessageId};
use crate::request::{Completion, CompletionPool, Direction, Progress, Request};
use crate::TransportError;

/// Most bytes moved on one socket before the engine turns to the next one.
const BUDGET: usize = 4 << 20;

/// Largest payload sent and received as one contiguous frame, copied through the stack:
/// send(2) and recv(2) of one buffer cost the kernel less than writev(2) and readv(2).
const SMALL: usize = 216;

/// Longest a blocked waiter sleeps before it looks at its request again (a request can also be
/// completed by another thread, or failed by an abort that does not shut the sockets).
const NAP: Duration = Duration::from_millis(2);

/// Token of the waker that stops the progress thread.
const WAKER: Token = Token(usize::MAX);

/// A stripe waiting to be written: header first, then payload.
#[derive(Debug)]
struct SendPiece {
    header: [u8; HEADER_LEN],
    data: *const u8,
    len: usize,
    written: usize,
    done: Arc<Completion>,
}

/// A stripe waiting to be read: header (checked), then payload.
#[derive(Debug)]
struct RecvPiece {
    expect: FrameHeader,
    buf: *mut u8,
    len: usize,
    got: usize,
    done: Arc<Completion>,
}

/// One socket to a peer.
#[derive(Debug)]
struct Conn {
    peer: usize,
    stream: TcpStream,
    sends: VecDeque<SendPiece>,
    recvs: VecDeque<RecvPiece>,
    header: [u8; HEADER_LEN],
    header_got: usize,
    /// The peer closed this socket after everything it sent was read.
    eof: bool,
    /// Stripes finished on this socket, both ways.
    finished: u64,
}

/// Per-peer state: its sockets and message counters.
#[derive(Debug, Default)]
struct Peer {
    conns: Vec<usize>,
    send_seq: u64,
    recv_seq: u64,
    failed: Option<TransportError>,
}

/// Everything the engine knows; guarded by the mutex in [`Shared`].
#[derive(Debug)]
pub(crate) struct Engine {
    rank: usize,
    peers: Vec<Peer>,
    conns: Vec<Conn>,
    min_stripe: usize,
    aborted: Option<String>,
    /// Sockets that stopped on their budget and must be served again.
    again: Vec<usize>,
    /// Stripes finished or failed so far, and that count when sleepers were last told.
    settled: u64,
    told: u64,
    /// Waiters asleep in [`Progress::block`], and whether the doorbell is rung.
    sleepers: usize,
    rung: bool,
    completions: CompletionPool,
}

// SAFETY: the raw pointers in the queues are only dereferenced while the
// engine mutex is held; `Transport::isend`/`irecv` callers guarantee the
// memory stays valid until the request completes or `abort` returns, and
// both completion and abort happen under that same mutex.
unsafe impl Send for Engine {}

/// The engine and what the progress thread needs beside it.
#[derive(Debug)]
pub(crate) struct Shared {
    engine: Mutex<Engine>,
    waker: Waker,
    /// An eventfd that wakes waiters asleep in `poll(2)` when some request settles: one that
    /// another thread finished (the progress thread, or a waiter serving every socket) would
    /// otherwise leave its waiter asleep until the next nap ends.
    doorbell: OwnedFd,
    stop: AtomicBool,
}

impl Shared {
    /// Registers `sockets[p]` (the sockets to peer `p`) and builds the engine.
    pub(crate) fn new(
        rank: usize,
        sockets: Vec<Vec<std::net::TcpStream>>,
        min_stripe: usize,
    ) -> io::Result<(Arc<Shared>, Poll)> {
        let poll = Poll::new()?;
        let waker = Waker::new(poll.registry(), WAKER)?;
        let mut peers: Vec<Peer> = (0..sockets.len()).map(|_| Peer::default()).collect();
        let mut conns = Vec::new();
        for (peer, streams) in sockets.into_iter().enumerate() {
            for stream in streams {
                stream.set_nonblocking(true)?;
                let mut stream = TcpStream::from_std(stream);
                let token = Token(conns.len());
                poll.registry()
                    .register(&mut stream, token, Interest::WRITABLE)?;
                peers[peer].conns.push(token.0);
                conns.push(Conn::new(peer, stream));
            }
        }
        let engine = Engine {
            rank,
            peers,
            conns,
            min_stripe,
            aborted: None,
            again: Vec::new(),
            settled: 0,
            told: 0,
            sleepers: 0,
            rung: false,
            completions: CompletionPool::default(),
        };
        // SAFETY: eventfd takes no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a non-negative result is a new descriptor that nothing else owns.
        let doorbell = unsafe { OwnedFd::from_raw_fd(fd) };
        let shared = Shared {
            engine: Mutex::new(engine),
            waker,
            doorbell,
            stop: AtomicBool::new(false),
        };
        Ok((Arc::new(shared), poll))
    }

    /// Locks the engine (a panic elsewhere does not poison progress).
    pub(crate) fn lock(&self) -> MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes the progress thread if inline work stopped on its budget, and sleeping waiters if
    /// some request settled.
    pub(crate) fn hand_over(&self, engine: &mut Engine) {
        if !engine.again.is_empty() {
            // A failed wake means the thread is gone; the transport is being dropped.
            let _ = self.waker.wake();
        }
        self.tell_sleepers(engine);
    }

    /// Rings the doorbell if requests settled since sleepers were last told and some sleep.
    pub(crate) fn tell_sleepers(&self, engine: &mut Engine) {
        if engine.settled != engine.told && engine.sleepers > 0 {
            let one = 1u64;
            // SAFETY: writes 8 bytes from a live u64 to our eventfd. It can only fail with the
            // counter full, and then it is readable anyway.
            unsafe { libc::write(self.doorbell.as_raw_fd(), (&one as *const u64).cast(), 8) };
            engine.rung = true;
        }
        engine.told = engine.settled;
    }

    /// Asks the progress thread to exit.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        // A failed wake only matters if the thread is already gone.
        let _ = self.waker.wake();
    }

    /// The progress thread's loop: waits for readiness and serves sockets.
    pub(crate) fn run(&self, mut poll: Poll) {
        let mut events = Events::with_capacity(256);
        loop {
            let busy = !self.lock().again.is_empty();
            let timeout = busy.then_some(std::time::Duration::ZERO);
            if let Err(e) = poll.poll(&mut events, timeout) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                let mut engine = self.lock();
                engine.abort(&format!("progress thread cannot poll: {e}"), true);
                self.tell_sleepers(&mut engine);
                return;
            }
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let mut engine = self.lock();
            for idx in std::mem::take(&mut engine.again) {
                engine.serve(idx, true, true);
            }
            for event in events.iter() {
                if event.token() == WAKER {
                    continue;
                }
                let idx = event.token().0;
                if event.is_error() {
                    engine.serve(idx, true, true);
                    let peer = engine.conns[idx].peer;
                    if let Ok(Some(e)) = engine.conns[idx].stream.take_error() {
                        engine.fail_peer(peer, io_error(peer, "poll", e));
                    }
                    continue;
                }
                let readable = event.is_readable() || event.is_read_closed();
                engine.serve(
                    idx,
                    readable,
                    event.is_writable() || event.is_write_closed(),
                );
            }
            self.tell_sleepers(&mut engine);
        }
    }
}

impl Progress for Shared {
    /// Serves `peer`'s sockets; if no message settled, yields the CPU: what the waiter needs
    /// next comes from another process (and the kernel's loopback work done in its context),
    /// which a spinning waiter would keep off a busy core. With 4 ranks on 2 cores this halves
    /// an 8-byte all-reduce; with a core to spare it costs nothing. A waiter whose message just
    /// arrived goes on at once: yielding then handed the core to a spinning rank for nothing.
    fn poll(&self, peer: usize) {
        // Never wait for the lock: the progress thread holding it is making progress anyway.
        if let Ok(mut engine) = self.engine.try_lock() {
            if peer < engine.peers.len() {
                let before = engine.settled;
                for k in 0..engine.peers[peer].conns.len() {
                    let idx = engine.peers[peer].conns[k];
                    engine.serve(idx, true, true);
                }
                let settled = engine.settled != before;
                self.hand_over(&mut engine);
                if settled {
                    return;
                }
            }
        }
        std::thread::yield_now();
    }

    /// Sleeps in `poll(2)` on every socket with a receive posted or a send queued, and on the
    /// doorbell, then serves the sockets that are ready: every socket, not only the awaited
    /// peer's, so bytes that some other rank needs first keep moving while this thread waits.
    fn block(&self, until: Instant, done: &dyn Fn() -> bool) -> bool {
        let doorbell = libc::pollfd {
            fd: self.doorbell.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let (mut fds, mut conns) = (vec![doorbell], Vec::new());
        {
            let mut engine = self.lock();
            // Requests settle under this lock: one that settles after this check rings.
            if done() {
                return true;
            }
            for (idx, conn) in engine.conns.iter().enumerate() {
                let mut events = 0;
                if !conn.recvs.is_empty() {
                    events |= libc::POLLIN;
                }
                if !conn.sends.is_empty() {
                    events |= libc::POLLOUT;
                }
                if events != 0 {
                    let fd = conn.stream.as_raw_fd();
                    fds.push(libc::pollfd {
                        fd,
                        events,
                        revents: 0,
                    });
                    conns.push(idx);
                }
            }
            if conns.is_empty() {
                // Nothing queued, so nothing pending: the waiter need not sleep.
                return false;
            }
            engine.sleepers += 1;
        }
        let left = until.saturating_duration_since(Instant::now()).min(NAP);
        // Whole milliseconds, rounded up so that a wait does not spin through its last one.
        let timeout = left.as_micros().div_ceil(1000) as libc::c_int;
        // SAFETY: `fds` is an array of `fds.len()` initialised pollfd records. The sockets stay
        // open while `self` lives (they are only shut down, never closed, before the drop).
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        let failed = (ready < 0).then(io::Error::last_os_error);
        let mut engine = self.lock();
        engine.sleepers -= 1;
        if engine.sleepers == 0 && engine.rung {
            // The last sleeper up clears the doorbell, so none misses a ring.
            let mut count = 0u64;
            // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd.
            unsafe { libc::read(fds[0].fd, (&mut count as *mut u64).cast(), 8) };
            engine.rung = false;
        }
        if failed.is_some_and(|e| e.kind() != io::ErrorKind::Interrupted) {
            // Cannot watch the sockets (out of memory): serve them all after a nap instead.
            drop(engine);
            std::thread::sleep(NAP);
            engine = self.lock();
            for p in &mut fds[1..] {
                p.revents = p.events;
            }
        }
        for (p, &idx) in fds[1..].iter().zip(&conns) {
            let hangup = p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0;
            let read = hangup || p.revents & libc::POLLIN != 0;
            let write = hangup || p.revents & libc::POLLOUT != 0;
            if read || write {
                engine.serve(idx, read, write);
            }
        }
        self.hand_over(&mut engine);
        true
    }
}

impl Engine {
    fn check_peer(&self, peer: usize) -> Result<(), TransportError> {
        if let Some(reason) = &self.aborted {
            return Err(TransportError::Aborted(reason.clone()));
        }
        if peer >= self.peers.len() || peer == self.rank {
            return Err(TransportError::InvalidPeer {
                peer,
                rank: self.rank,
                world_size: self.peers.len(),
            });
        }
        match &self.peers[peer].failed {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
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
        self.check_peer(peer)?;
        let p = &mut self.peers[peer];
        let counter = match direction {
            Direction::Send => &mut p.send_seq,
            Direction::Recv => &mut p.recv_seq,
        };
        let seq = *counter;
        *counter += 1;
        let stripes = frame::stripes(seq, len, p.conns.len(), self.min_stripe);
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
            let idx = self.peers[peer].conns[stripe.socket];
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
        }
        Ok(req)
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
            let idx = self.peers[peer].conns[stripe.socket];
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
        self.check_peer(peer)?;
        let p = &self.peers[peer];
        let seq = p.recv_seq;
        let idx = p.conns[frame::first_socket(seq, p.conns.len())];
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
        if self.peers[peer].failed.is_some() {
            return;
        }
        tracing::debug!(rank = self.rank, peer, error = %err, "peer failed");
        for &idx in &self.peers[peer].conns {
            let conn = &mut self.conns[idx];
            self.settled += (conn.sends.len() + conn.recvs.len()) as u64;
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
        self.peers[peer].failed = Some(err);
    }

    /// Fails everything with `Aborted(reason)`; later posts fail the same way.
    ///
    /// With `close`, shuts every socket down so peers notice at once;
    /// without, the sockets close gracefully when dropped, and bytes already
    /// handed to the kernel still reach their peers.
    pub(crate) fn abort(&mut self, reason: &str, close: bool) {
        if self.aborted.is_some() {
            return;
        }
        for peer in 0..self.peers.len() {
            self.fail_requests(peer, TransportError::Aborted(reason.to_string()), close);
        }
        self.aborted = Some(reason.to_string());
    }
}

impl Conn {
    fn new(peer: usize, stream: TcpStream) -> Conn {
        Conn {
            peer,
            stream,
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
            header: [0; HEADER_LEN],
            header_got: 0,
            eof: false,
            finished: 0,
        }
    }

    /// Writes queued stripes until the socket is full; `Ok(false)` if the budget ran out.
    fn flush(&mut self) -> Result<bool, TransportError> {
        let mut moved = 0;
        while let Some(piece) = self.sends.front_mut() {
            if moved >= BUDGET {
                return Ok(false);
            }
            let total = HEADER_LEN + piece.len;
            // SAFETY: `data..data+len` is valid for reads per `post_send`'s contract.
            let body = unsafe { std::slice::from_raw_parts(piece.data, piece.len) };
            let sent = if piece.written == 0 && piece.len <= SMALL {
                let mut frame = [0u8; HEADER_LEN + SMALL];
                frame[..HEADER_LEN].copy_from_slice(&piece.header);
                frame[HEADER_LEN..total].copy_from_slice(body);
                self.stream.write(&frame[..total])
            } else {
                let (head, body_from) = if piece.written < HEADER_LEN {
                    (&piece.header[piece.written..], 0)
                } else {
                    (&[][..], piece.written - HEADER_LEN)
                };
                let bufs = [IoSlice::new(head), IoSlice::new(&body[body_from..])];
                self.stream.write_vectored(&bufs)
            };
            let n = match sent {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_error(self.peer, "send", e)),
            };
            if n == 0 && total > piece.written {
                return Err(TransportError::PeerClosed { peer: self.peer });
            }
            piece.written += n;
            moved += n;
            if piece.written == total {
                let piece = self.sends.pop_front().expect("front exists");
                self.finished += 1;
                piece.done.part_done();
            }
        }
        Ok(true)
    }

    /// Reads into posted stripes until the socket is empty; `Ok(false)` if the budget ran out.
    ///
    /// With nothing posted, only checks whether the peer has closed the socket.
    fn pump(&mut self) -> Result<bool, TransportError> {
        if self.eof && !self.recvs.is_empty() {
            return Err(TransportError::PeerClosed { peer: self.peer });
        }
        if self.recvs.is_empty() {
            return self.probe_eof();
        }
        let mut moved = 0;
        while let Some(piece) = self.recvs.front_mut() {
            if moved >= BUDGET {
                return Ok(false);
            }
            // SAFETY: `buf..buf+len` is valid and exclusively ours per `post_recv`'s contract.
            let buf = unsafe { std::slice::from_raw_parts_mut(piece.buf, piece.len) };
            // The header and the payload in one read: a small message costs one syscall. Payload
            // bytes read before a header fails its check only land in a buffer whose receive fails.
            let got = if self.header_got == 0 && piece.got == 0 && piece.len <= SMALL {
                let mut frame = [0u8; HEADER_LEN + SMALL];
                let got = self.stream.read(&mut frame[..HEADER_LEN + piece.len]);
                if let Ok(n) = got {
                    let head = n.min(HEADER_LEN);
                    self.header[..head].copy_from_slice(&frame[..head]);
                    buf[..n - head].copy_from_slice(&frame[head..n]);
                }
                got
            } else {
                let mut bufs = [
                    IoSliceMut::new(&mut self.header[self.header_got..]),
                    IoSliceMut::new(&mut buf[piece.got..]),
                ];
                self.stream.read_vectored(&mut bufs)
            };
            let n = match got {
                Ok(0) => return Err(TransportError::PeerClosed { peer: self.peer }),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_error(self.peer, "recv", e)),
            };
            let to_header = n.min(HEADER_LEN - self.header_got);
            let header_done = to_header > 0 && self.header_got + to_header == HEADER_LEN;
            self.header_got += to_header;
            piece.got += n - to_header;
            moved += n;
            if header_done {
                check_header(self.peer, &self.header, &piece.expect)?;
            }
            if self.header_got == HEADER_LEN && piece.got == piece.len {
                self.header_got = 0;
                let piece = self.recvs.pop_front().expect("front exists");
                self.finished += 1;
                piece.done.part_done();
            }
        }
        Ok(true)
    }

    /// The header of the frame at the front of the socket, left there; `None` until all of it
    /// has arrived. Only meaningful with nothing posted (no frame read in part).
    fn peek_header(&mut self) -> Result<Option<FrameHeader>, TransportError> {
        let mut bytes = [0u8; HEADER_LEN];
        match self.stream.peek(&mut bytes) {
            Ok(0) => {
                self.eof = true;
                Err(TransportError::PeerClosed { peer: self.peer })
            }
            Ok(n) if n < HEADER_LEN => Ok(None),
            Ok(_) => {
                FrameHeader::decode(&bytes)
                    .map(Some)
                    .map_err(|detail| TransportError::Protocol {
                        peer: self.peer,
                        detail,
                    })
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(io_error(self.peer, "recv", e)),
        }
    }

    /// With nothing posted, notes whether the peer closed this socket. That is only an error
    /// once a receive needs it (other sockets of the same peer may still carry the rest of a
    /// message).
    fn probe_eof(&mut self) -> Result<bool, TransportError> {
        let mut probe = [0u8; 1];
        match self.stream.peek(&mut probe) {
            Ok(0) => {
                self.eof = true;
                Ok(true)
            }
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(true),
            Err(e) => Err(io_error(self.peer, "recv", e)),
        }
    }
}

/// Checks an arrived header against what the posted receive expects.
fn check_header(
    peer: usize,
    bytes: &[u8; HEADER_LEN],
    expect: &FrameHeader,
) -> Result<(), TransportError> {
    let got =
        FrameHeader::decode(bytes).map_err(|detail| TransportError::Protocol { peer, detail })?;
    let id = |h: &FrameHeader| MessageId {
        seq: h.seq,
        tag: h.tag,
        len: h.msg_len,
        piece: h.stripe_len,
    };
    matching::check(peer, id(&got), id(expect))
}

fn io_error(peer: usize, op: &'static str, e: io::Error) -> TransportError {
    match e.kind() {
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::UnexpectedEof => TransportError::PeerClosed { peer },
        _ => TransportError::Io {
            peer,
            op,
            message: e.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream as StdStream};

    /// A connection on one end of a socket, and the other end (blocking).
    fn conn_and_other_end() -> (Conn, StdStream) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let other = StdStream::connect(listener.local_addr().expect("address")).expect("connect");
        other.set_nodelay(true).expect("nodelay");
        let (mine, _) = listener.accept().expect("accept");
        mine.set_nonblocking(true).expect("non-blocking");
        mine.set_nodelay(true).expect("nodelay");
        (Conn::new(1, TcpStream::from_std(mine)), other)
    }

    /// Bytes of the frame in flight that `conn` has taken in so far.
    fn taken(conn: &Conn, frame: usize) -> usize {
        match conn.recvs.front() {
            Some(piece) => conn.header_got + piece.got,
            None => frame,
        }
    }

    #[test]
    fn a_frame_arriving_in_pieces_is_reassembled() {
        // Small and large payloads. 7-byte pieces split the header, and the first read of a
        // small frame (one recv of header and payload) as well as the later ones (readv); 45
        // bytes end that first read inside the payload; 48 bring a whole 8-byte frame at once.
        for (len, piece) in [
            (8, 7),
            (SMALL, 7),
            (SMALL + 1, 7),
            (1000, 7),
            (100, 45),
            (8, 48),
        ] {
            let (mut conn, mut writer) = conn_and_other_end();
            let header = FrameHeader {
                tag: 7,
                seq: 0,
                msg_len: len as u64,
                stripe_len: len as u64,
            };
            let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let mut buf = vec![0u8; len];
            let (req, done) = Request::new(1, Direction::Recv, len);
            conn.recvs.push_back(RecvPiece {
                expect: header,
                buf: buf.as_mut_ptr(),
                len,
                got: 0,
                done,
            });
            let mut wire = header.encode().to_vec();
            wire.extend(&payload);
            let mut sent = 0;
            for bytes in wire.chunks(piece) {
                assert!(req.test().is_none(), "{len} B done after {sent} bytes");
                writer.write_all(bytes).expect("write");
                sent += bytes.len();
                let deadline = Instant::now() + Duration::from_secs(10);
                while taken(&conn, wire.len()) < sent {
                    assert!(
                        Instant::now() < deadline,
                        "{len} B: {sent} bytes never read"
                    );
                    assert!(conn.pump().expect("pump"));
                }
                assert_eq!(
                    taken(&conn, wire.len()),
                    sent,
                    "{len} B read past what was sent"
                );
            }
            assert!(matches!(req.test(), Some(Ok(()))), "{len} B not done");
            assert_eq!(buf, payload, "{len} B payload");
        }
    }

    #[test]
    fn frames_queued_behind_a_large_one_leave_intact() {
        // The large frames fill the socket, so the small ones after them may go out in pieces
        // (a short send, then the vectored path) while the other end reads in odd sizes.
        let (mut conn, mut reader) = conn_and_other_end();
        let sizes = [3 << 20, 8, SMALL, 100, 0, 1 << 20, 40, SMALL - 1, 8];
        let payloads: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(k, &len)| (0..len).map(|i| (i * 7 + k) as u8).collect())
            .collect();
        let mut wire = Vec::new();
        let mut reqs = Vec::new();
        for (seq, payload) in payloads.iter().enumerate() {
            let len = payload.len();
            let header = FrameHeader {
                tag: 9,
                seq: seq as u64,
                msg_len: len as u64,
                stripe_len: len as u64,
            }
            .encode();
            wire.extend_from_slice(&header);
            wire.extend_from_slice(payload);
            let (req, done) = Request::new(1, Direction::Send, len);
            conn.sends.push_back(SendPiece {
                header,
                data: payload.as_ptr(),
                len,
                written: 0,
                done,
            });
            reqs.push(req);
        }
        let total = wire.len();
        let drain = std::thread::spawn(move || {
            let mut got = Vec::with_capacity(total);
            let mut buf = [0u8; 4093];
            while got.len() < total {
                let n = reader.read(&mut buf).expect("read");
                assert!(n > 0, "the sender closed after {} bytes", got.len());
                got.extend_from_slice(&buf[..n]);
            }
            got
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        while !conn.sends.is_empty() {
            assert!(
                Instant::now() < deadline,
                "{} frames never left",
                conn.sends.len()
            );
            assert!(conn.flush().expect("flush") || !conn.sends.is_empty());
            std::thread::yield_now();
        }
        assert!(
            drain.join().expect("reader") == wire,
            "the bytes on the wire differ"
        );
        for (k, req) in reqs.iter().enumerate() {
            assert!(matches!(req.test(), Some(Ok(()))), "send {k} not done");
        }
    }

    #[test]
    fn a_small_frame_cut_short_is_finished_by_the_vectored_path() {
        // What a short send(2) of a small frame leaves: `written` bytes gone, header or payload
        // partly; the rest must follow exactly.
        for written in [1, 20, HEADER_LEN, HEADER_LEN + 3] {
            let (mut conn, mut reader) = conn_and_other_end();
            let payload: Vec<u8> = (0..8).map(|i| 100 + i).collect();
            let header = FrameHeader {
                tag: 3,
                seq: 0,
                msg_len: 8,
                stripe_len: 8,
            }
            .encode();
            let (req, done) = Request::new(1, Direction::Send, 8);
            conn.sends.push_back(SendPiece {
                header,
                data: payload.as_ptr(),
                len: 8,
                written,
                done,
            });
            assert!(conn.flush().expect("flush"));
            assert!(
                matches!(req.test(), Some(Ok(()))),
                "cut at {written}: not done"
            );
            let mut wire = header.to_vec();
            wire.extend_from_slice(&payload);
            let mut rest = vec![0u8; wire.len() - written];
            reader.read_exact(&mut rest).expect("read");
            assert_eq!(rest, wire[written..], "cut at {written}");
        }
    }
}
