//! The shared-memory progress engine: per-peer queues of posted sends and
//! receives, moved chunk by chunk through the rings of the shared region.
//!
//! A send is split into slot-sized chunks copied into the ring to the peer;
//! each chunk is published on its own (release store of the tail), so the
//! receiver copies one chunk out while the sender copies the next one in. A
//! receive checks every chunk's header (sequence, tag, length) before copying
//! it into the caller's buffer, then frees the slot (release store of the
//! head). A sleeping peer is woken through its doorbell after each chunk.
//!
//! A large message moves with a single copy: the slot carries the sender's
//! address and the receiver reads the message from there in pieces, while
//! the sender, as soon as it sees the receiver's address, takes pieces from
//! the same counter and writes them into it. A sender with nothing
//! else to do (a broadcast's root) thus doubles the copy rate; a busy one
//! leaves the pieces to the receiver.
//!
//! All local state sits behind one mutex. Posting threads and waiting
//! threads move bytes inline; the progress thread takes over when nobody is
//! waiting, and watches peers' liveness.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::cma::{self, Way};
use super::region::{Region, Ring, SlotHeader};
use super::wake::{self, Liveness};
use crate::matching::{self, MessageId};
use crate::request::{Completion, Direction, Progress, Request};
use crate::TransportError;

/// How long a failing receive waits for pieces the sender is still writing
/// into its buffer (each takes microseconds) before it warns that it waits.
const SETTLE: Duration = Duration::from_secs(2);
/// How often the progress thread checks that peers with pending work are alive.
const LIVENESS_EVERY: Duration = Duration::from_millis(20);
/// Longest sleep of the progress thread (it re-checks liveness after each).
const SLEEP: Duration = Duration::from_millis(20);
/// How long the progress thread keeps looking, rather than sleeping, for a
/// peer to start reading a single-copy send it could help with (about one
/// 512 KiB message; a wake-up would cost a good part of it).
const HELP_SPIN: Duration = Duration::from_micros(100);

/// A posted send or receive: the caller's memory (only read for a send)
/// and how much of it has moved.
#[derive(Debug)]
struct Op {
    buf: *mut u8,
    len: usize,
    tag: u64,
    seq: u64,
    done: usize,
    chunks_left: u64,
    completion: Arc<Completion>,
}

/// A single-copy send published to the peer, done once the peer's head passes
/// its slot; until then the sender may write pieces of it into the peer.
#[derive(Debug)]
struct Inflight {
    index: u64,
    buf: *mut u8,
    len: usize,
    completion: Arc<Completion>,
}

/// Everything about one local peer.
#[derive(Debug)]
struct Link {
    peer: usize,
    peer_local: usize,
    tx: Ring,
    rx: Ring,
    /// Chunks this rank published to the peer, and the peer's head as last seen.
    tx_tail: u64,
    tx_head: u64,
    /// Chunks this rank consumed from the peer, and the peer's tail as last seen.
    rx_head: u64,
    rx_tail: u64,
    sends: VecDeque<Op>,
    recvs: VecDeque<Op>,
    inflight: VecDeque<Inflight>,
    /// The single-copy message at `rx_head` is being copied (its number of
    /// pieces): this rank published its address, and the sender may be
    /// writing into it.
    reading: Option<u64>,
    /// Whether this process may write the peer's memory (to help its single copies).
    helps: bool,
    /// Sends of this many bytes or more are read by the peer from this
    /// process's memory (`usize::MAX`: never).
    single_copy_min: usize,
    pid: u32,
    send_seq: u64,
    recv_seq: u64,
    failed: Option<TransportError>,
    /// The peer process exited or closed its transport.
    gone: bool,
    live: Liveness,
}

/// The engine's state; guarded by the mutex in [`Shared`].
#[derive(Debug)]
pub(crate) struct Engine {
    rank: usize,
    world_size: usize,
    region: Arc<Region>,
    own_local: usize,
    /// Links by global peer rank; `None` for ranks on other hosts and self.
    links: Vec<Option<Link>>,
    aborted: Option<String>,
}

// SAFETY: the raw pointers (caller buffers, ring slots) are only dereferenced
// under the engine mutex; callers keep their buffers valid until completion
// or abort (both under that mutex), and the rings stay mapped as long as the
// engine holds `region`.
unsafe impl Send for Engine {}

/// A peer to link to: its global and local rank, and its process id.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PeerInfo {
    pub rank: usize,
    pub local: usize,
    pub pid: u32,
    /// Whether the peer can read this process's memory.
    pub single_copy: bool,
    /// Whether this process can write the peer's memory.
    pub writable: bool,
}

/// The engine and what the progress thread needs beside it.
#[derive(Debug)]
pub(crate) struct Shared {
    engine: Mutex<Engine>,
    region: Arc<Region>,
    own_local: usize,
    stop: AtomicBool,
    /// Set by a waiter that parks: the progress thread must move bytes until
    /// nothing is pending.
    handoff: AtomicBool,
    /// More local ranks than cores: a spinning waiter yields its core to them.
    crowded: bool,
}

impl Shared {
    /// Builds the engine over `region` for local rank `own_local`, linked to `peers`.
    pub fn new(
        rank: usize,
        world_size: usize,
        region: Arc<Region>,
        own_local: usize,
        peers: &[PeerInfo],
        single_copy_min: usize,
    ) -> Shared {
        let mut links: Vec<Option<Link>> = (0..world_size).map(|_| None).collect();
        for p in peers {
            links[p.rank] = Some(Link {
                peer: p.rank,
                peer_local: p.local,
                tx: region.ring(own_local, p.local),
                rx: region.ring(p.local, own_local),
                tx_tail: 0,
                tx_head: 0,
                rx_head: 0,
                rx_tail: 0,
                sends: VecDeque::new(),
                recvs: VecDeque::new(),
                inflight: VecDeque::new(),
                reading: None,
                helps: p.writable,
                single_copy_min: if p.single_copy {
                    single_copy_min.max(1)
                } else {
                    usize::MAX
                },
                pid: p.pid,
                send_seq: 0,
                recv_seq: 0,
                failed: None,
                gone: false,
                live: Liveness::watch(p.pid),
            });
        }
        let engine = Engine {
            rank,
            world_size,
            region: region.clone(),
            own_local,
            links,
            aborted: None,
        };
        Shared {
            engine: Mutex::new(engine),
            region,
            own_local,
            stop: AtomicBool::new(false),
            handoff: AtomicBool::new(false),
            crowded: peers.len() + 1 > std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }

    /// The shared region.
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Whether local ranks outnumber cores (waiters should yield).
    pub fn crowded(&self) -> bool {
        self.crowded
    }

    /// Locks the engine (a panic elsewhere does not poison progress).
    pub fn lock(&self) -> MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks the progress thread to exit and wakes it.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        wake::ring(self.region.control(self.own_local));
    }

    /// The progress thread: dormant while waiters move bytes themselves;
    /// once one parks, moves bytes until nothing is pending, sleeping on its
    /// doorbell (rung by peers) whenever nothing can move. Checks peers'
    /// liveness while anything is pending.
    pub fn run(&self) {
        let own = self.region.control(self.own_local);
        let mut last_check = Instant::now();
        let mut last_move = Instant::now();
        let mut active = false;
        while !self.stop.load(Ordering::Acquire) {
            let seen = own.doorbell.load(Ordering::Acquire);
            active |= self.handoff.swap(false, Ordering::AcqRel);
            let (moved, pending, may_help) = {
                let mut engine = self.lock();
                let moved = engine.progress();
                if last_check.elapsed() >= LIVENESS_EVERY {
                    engine.check_liveness();
                    last_check = Instant::now();
                }
                (moved, engine.pending(), engine.may_help())
            };
            if moved {
                last_move = Instant::now();
                continue;
            }
            active &= pending;
            if active && may_help && last_move.elapsed() < HELP_SPIN {
                std::thread::yield_now();
                continue;
            }
            if active {
                // Ask peers for a doorbell, then look once more before
                // sleeping (pairs with `ring_if_sleeping`).
                own.sleeping.store(1, Ordering::SeqCst);
                std::sync::atomic::fence(Ordering::SeqCst);
                if !self.lock().progress() {
                    wake::futex_wait(own.doorbell, seen, SLEEP);
                }
                own.sleeping.store(0, Ordering::Relaxed);
            } else {
                // Dormant: a parking waiter, abort or stop rings the doorbell.
                wake::futex_wait(own.doorbell, seen, SLEEP);
            }
        }
    }
}

impl Progress for Shared {
    fn poll(&self, _peer: usize) {
        // Never wait for the lock: whoever holds it is moving bytes anyway.
        // Every peer is served, since a receive may wait on a send to another.
        let moved = match self.engine.try_lock() {
            Ok(mut engine) => engine.progress(),
            Err(_) => false,
        };
        if !moved && self.crowded {
            // Let the peer this waiter waits for run: it may share the core.
            std::thread::yield_now();
        }
    }

    fn parking(&self, _peer: usize) {
        self.handoff.store(true, Ordering::Release);
        wake::ring(self.region.control(self.own_local));
    }
}

impl Engine {
    fn link(&mut self, peer: usize) -> Result<&mut Link, TransportError> {
        if let Some(reason) = &self.aborted {
            return Err(TransportError::Aborted(reason.clone()));
        }
        let (rank, world_size) = (self.rank, self.world_size);
        let invalid = TransportError::InvalidPeer {
            peer,
            rank,
            world_size,
        };
        let link = self
            .links
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or(invalid)?;
        match &link.failed {
            Some(e) => Err(e.clone()),
            None => Ok(link),
        }
    }

    /// Queues a send (reading `buf`) or a receive (writing it) with `peer`,
    /// and moves what can move now.
    ///
    /// # Safety
    ///
    /// `buf..buf+len` must stay valid (and, for a receive, unaliased) until
    /// the request completes or the engine is aborted.
    pub unsafe fn post(
        &mut self,
        peer: usize,
        direction: Direction,
        tag: u64,
        buf: *mut u8,
        len: usize,
    ) -> Result<Request, TransportError> {
        let link = self.link(peer)?;
        let (req, completion) = Request::new(peer, direction, len);
        let (counter, queue) = match direction {
            Direction::Send => (&mut link.send_seq, &mut link.sends),
            Direction::Recv => (&mut link.recv_seq, &mut link.recvs),
        };
        queue.push_back(Op {
            buf,
            len,
            tag,
            seq: *counter,
            done: 0,
            chunks_left: chunks(len, link.tx.slot_bytes()),
            completion,
        });
        *counter += 1;
        self.serve(peer);
        Ok(req)
    }

    /// The tag and length of the next message from `peer` that no posted receive claims, once
    /// its first chunk is published; fails the peer if it has left with nothing more published.
    pub fn probe(&mut self, peer: usize) -> Result<Option<(u64, usize)>, TransportError> {
        let region = self.region.clone();
        let link = self.link(peer)?;
        let next = link.peek(region.control(link.peer_local).closed);
        if let Err(e) = &next {
            self.fail_peer(peer, e.clone());
        }
        next.map(|header| header.map(|h| (h.tag, h.msg_len as usize)))
    }

    /// Moves whatever can move on every link; true if anything moved.
    pub fn progress(&mut self) -> bool {
        let mut moved = false;
        for peer in 0..self.links.len() {
            moved |= self.serve(peer);
        }
        moved
    }

    /// Whether any request is still queued.
    pub fn pending(&self) -> bool {
        self.links.iter().flatten().any(Link::busy)
    }

    /// Whether a peer may soon start reading a single-copy send this rank can help with.
    fn may_help(&self) -> bool {
        self.links
            .iter()
            .flatten()
            .any(|link| link.helps && !link.inflight.is_empty())
    }

    /// Why this engine was aborted, if it was.
    pub fn aborted(&self) -> Option<&str> {
        self.aborted.as_deref()
    }

    /// Whether the process of local peer `peer` (a global rank) has exited.
    pub fn peer_exited(&self, peer: usize) -> bool {
        self.links
            .get(peer)
            .and_then(Option::as_ref)
            .is_some_and(|link| link.gone || link.live.dead())
    }

    /// Marks peers with pending work whose process has exited, and fails their requests.
    pub fn check_liveness(&mut self) {
        for peer in 0..self.links.len() {
            let Some(link) = self.links[peer].as_mut() else {
                continue;
            };
            if link.busy() && !link.gone && link.live.dead() {
                tracing::debug!(rank = self.rank, peer, "peer process exited");
                link.gone = true;
                self.serve(peer);
            }
        }
    }

    /// Moves bytes to and from `peer`; true if anything moved.
    fn serve(&mut self, peer: usize) -> bool {
        let Some(link) = self.links[peer].as_mut() else {
            return false;
        };
        if link.failed.is_some() {
            return false;
        }
        let region = &self.region;
        let peer_control = region.control(link.peer_local);
        if !link.gone && peer_control.closed.load(Ordering::Acquire) != 0 {
            link.gone = true;
        }
        let result = link.push(|| wake::ring_if_sleeping(peer_control));
        let result = result.and_then(|sent| {
            let closed = || peer_control.closed.load(Ordering::Acquire) != 0;
            link.pull(|| wake::ring_if_sleeping(peer_control), closed)
                .map(|got| sent | got)
        });
        match result {
            Ok(moved) => {
                if link.gone && link.busy() {
                    // Whatever the peer published before leaving has been taken.
                    self.fail_peer(peer, TransportError::PeerClosed { peer });
                }
                moved
            }
            Err(e) => {
                self.fail_peer(peer, e);
                true
            }
        }
    }

    /// Fails every request to `peer`, now and later.
    fn fail_peer(&mut self, peer: usize, err: TransportError) {
        let Some(link) = self.links[peer].as_mut() else {
            return;
        };
        if link.failed.is_some() {
            return;
        }
        tracing::debug!(rank = self.rank, peer, error = %err, "peer failed");
        link.settle(self.region.control(link.peer_local).closed);
        for op in link.sends.drain(..) {
            op.completion.complete(Err(err.clone()));
        }
        for op in link.recvs.drain(..) {
            op.completion.complete(Err(err.clone()));
        }
        for sent in link.inflight.drain(..) {
            sent.completion.complete(Err(err.clone()));
        }
        link.failed = Some(err);
    }

    /// Fails everything with `Aborted(reason)`, marks this rank closed in the
    /// region, and wakes every local peer so they notice at once.
    pub fn abort(&mut self, reason: &str) {
        if self.aborted.is_some() {
            return;
        }
        // Closed first: a peer reading a single-copy send checks this flag
        // after its read, before the send's buffer is handed back below.
        self.region
            .control(self.own_local)
            .closed
            .store(1, Ordering::SeqCst);
        for peer in 0..self.links.len() {
            self.fail_peer(peer, TransportError::Aborted(reason.to_string()));
        }
        self.aborted = Some(reason.to_string());
        for link in self.links.iter().flatten() {
            wake::ring(self.region.control(link.peer_local));
        }
    }
}

impl Link {
    /// Whether any request to or from the peer is unfinished.
    fn busy(&self) -> bool {
        !self.sends.is_empty() || !self.recvs.is_empty() || !self.inflight.is_empty()
    }

    /// The header of the first chunk of the next message no posted receive claims, if it is
    /// published (`None` while receives are queued); fails once the peer has left (`closed`:
    /// its flag, set when it aborts or drops its transport) with nothing more published.
    fn peek(&mut self, closed: &AtomicU32) -> Result<Option<SlotHeader>, TransportError> {
        if !self.recvs.is_empty() {
            return Ok(None);
        }
        if self.rx_head == self.rx_tail {
            self.rx_tail = self.rx.tail().load(Ordering::Acquire);
        }
        if self.rx_head == self.rx_tail {
            if !(self.gone || closed.load(Ordering::Acquire) != 0 || self.live.dead()) {
                return Ok(None);
            }
            // Everything the peer published before it left is visible now.
            self.rx_tail = self.rx.tail().load(Ordering::Acquire);
            if self.rx_head == self.rx_tail {
                self.gone = true;
                return Err(TransportError::PeerClosed { peer: self.peer });
            }
        }
        let header = self.rx.read_header(self.rx_head);
        matching::check_seq(self.peer, header.seq, self.recv_seq)?;
        Ok(Some(header))
    }

    /// Completes single-copy sends the peer has finished reading; true if any.
    fn reap(&mut self) -> bool {
        if self.inflight.is_empty() {
            return false;
        }
        self.tx_head = self.tx.head().load(Ordering::Acquire);
        let mut moved = false;
        while let Some(sent) = self.inflight.front() {
            if sent.index >= self.tx_head {
                break;
            }
            let sent = self.inflight.pop_front().expect("front exists");
            sent.completion.complete(Ok(()));
            moved = true;
        }
        moved
    }

    /// Writes pieces of single-copy sends the peer has started reading into
    /// its memory; true if any moved.
    fn help(&mut self, notify: &impl Fn()) -> Result<bool, TransportError> {
        if !self.helps {
            return Ok(false);
        }
        let mut moved = false;
        for sent in &self.inflight {
            let split = self.tx.split(sent.index);
            let dst = split.dst.load(Ordering::Acquire);
            if dst == 0 {
                // The peer reads in order: it has not reached this one.
                break;
            }
            // SAFETY: `buf..buf+len` is the send's buffer, valid until it
            // completes (post's contract); pieces are taken through `split`.
            let wrote =
                unsafe { cma::take_pieces(split, self.pid, Way::Write, dst, sent.buf, sent.len) };
            match wrote {
                Ok(0) => {}
                Ok(_) => {
                    notify();
                    moved = true;
                }
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                    notify();
                    return Err(TransportError::PeerClosed { peer: self.peer });
                }
                Err(e) => {
                    // Helping is optional: the receiver reads the message
                    // itself (it sees the failure flagged in `split`).
                    tracing::debug!(peer = self.peer, "cannot write the receiver's memory: {e}");
                    self.helps = false;
                    notify();
                    return Ok(true);
                }
            }
        }
        Ok(moved)
    }

    /// Before a receive being copied is failed: stops the sender from
    /// taking more pieces and waits for those it is writing into the
    /// receive's buffer, until it finishes them, closes or dies. The buffer
    /// goes back to the caller after that, so there is no time limit; a
    /// warning names the peer if the wait grows long (a stopped process).
    fn settle(&mut self, closed: &AtomicU32) {
        let Some(pieces) = self.reading.take() else {
            return;
        };
        let split = self.rx.split(self.rx_head);
        let taken = split.close(pieces);
        let mut warn_at = Some(Instant::now() + SETTLE);
        while split.progress().0 < taken {
            if closed.load(Ordering::Acquire) != 0 || self.live.dead() {
                return;
            }
            if warn_at.is_some_and(|at| Instant::now() >= at) {
                warn_at = None;
                tracing::warn!(
                    peer = self.peer,
                    "waiting for rank {} to finish writing into this rank's memory",
                    self.peer
                );
            }
            std::thread::yield_now();
        }
    }

    /// Copies queued sends into free slots (or, for a single copy, their
    /// address); true if any slot was published.
    fn push(&mut self, notify: impl Fn()) -> Result<bool, TransportError> {
        // Reaped first: a peer that read a single copy and then left did finish it.
        let mut moved = self.reap();
        if self.gone {
            return Ok(moved);
        }
        moved |= self.help(&notify)?;
        let slots = self.tx.slots() as u64;
        let slot_bytes = self.tx.slot_bytes();
        while let Some(op) = self.sends.front_mut() {
            if self.tx_tail - self.tx_head >= slots {
                self.tx_head = self.tx.head().load(Ordering::Acquire);
                if self.tx_tail - self.tx_head >= slots {
                    break;
                }
            }
            if op.len >= self.single_copy_min {
                let header = SlotHeader {
                    seq: op.seq,
                    tag: op.tag,
                    msg_len: op.len as u64,
                    chunk_len: op.len as u64,
                    addr: op.buf as u64,
                };
                let op = self.sends.pop_front().expect("front exists");
                self.inflight.push_back(Inflight {
                    index: self.tx_tail,
                    buf: op.buf,
                    len: op.len,
                    completion: op.completion,
                });
                publish(&self.tx, &mut self.tx_tail, header, &notify);
                moved = true;
                continue;
            }
            let chunk = (op.len - op.done).min(slot_bytes);
            // SAFETY: the caller's buffer holds `len` bytes (post_send's
            // contract) and `done + chunk <= len`; the slot holds
            // `slot_bytes >= chunk` and is ours until the tail passes it.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    op.buf.add(op.done),
                    self.tx.payload(self.tx_tail),
                    chunk,
                );
            }
            let header = SlotHeader {
                seq: op.seq,
                tag: op.tag,
                msg_len: op.len as u64,
                chunk_len: chunk as u64,
                addr: 0,
            };
            publish(&self.tx, &mut self.tx_tail, header, &notify);
            moved = true;
            op.done += chunk;
            op.chunks_left -= 1;
            if op.chunks_left == 0 {
                let op = self.sends.pop_front().expect("front exists");
                op.completion.complete(Ok(()));
            }
        }
        Ok(moved)
    }

    /// Copies published chunks into posted receives, reading single-copy
    /// messages from the sender's memory; true if any slot was freed.
    ///
    /// `closed` tells whether the sender has aborted: a single copy made
    /// while it did may have read a buffer already handed back, so it fails.
    fn pull(
        &mut self,
        notify: impl Fn(),
        closed: impl Fn() -> bool,
    ) -> Result<bool, TransportError> {
        let slot_bytes = self.rx.slot_bytes();
        let mut moved = false;
        while let Some(op) = self.recvs.front_mut() {
            if self.rx_head == self.rx_tail {
                self.rx_tail = self.rx.tail().load(Ordering::Acquire);
                if self.rx_head == self.rx_tail {
                    break;
                }
            }
            let got = self.rx.read_header(self.rx_head);
            let chunk = match got.addr {
                0 => (op.len - op.done).min(slot_bytes),
                _ => op.len - op.done,
            };
            check_header(self.peer, &got, op, chunk)?;
            if got.addr != 0 {
                // SAFETY: `done + chunk <= len` fits the caller's buffer.
                let dst = unsafe { op.buf.add(op.done) };
                let split = self.rx.split(self.rx_head);
                let pieces = cma::pieces(chunk);
                if self.reading.is_none() {
                    // Invite the sender to write pieces from the other end.
                    split.dst.store(dst as u64, Ordering::Release);
                    self.reading = Some(pieces);
                    notify();
                }
                // SAFETY: as above; pieces are taken through `split`.
                let read =
                    unsafe { cma::take_pieces(split, self.pid, Way::Read, got.addr, dst, chunk) };
                let read =
                    read.map_err(|e| cma_error(self.peer, "recv", "read the sender's memory", e))?;
                moved |= read > 0;
                match split.progress() {
                    (settled, _) if settled < pieces => {
                        // The sender is still writing pieces it took.
                        if closed() {
                            return Err(TransportError::PeerClosed { peer: self.peer });
                        }
                        break;
                    }
                    (_, true) => {
                        // A piece the sender took did not arrive: read it all
                        // again (the sender no longer writes; its buffer stays
                        // valid until this slot is freed).
                        // SAFETY: as above.
                        let again = unsafe { cma::copy(self.pid, Way::Read, got.addr, dst, chunk) };
                        again.map_err(|e| {
                            cma_error(self.peer, "recv", "read the sender's memory", e)
                        })?;
                    }
                    (_, false) => {}
                }
                self.reading = None;
                if closed() {
                    return Err(TransportError::PeerClosed { peer: self.peer });
                }
                // The whole message came in this one slot.
                op.chunks_left = 1;
            } else {
                // SAFETY: the header matched, so `chunk` bytes of payload are
                // in the slot (published by the tail we acquired) and `done +
                // chunk <= len` fits the caller's buffer (post_recv's contract).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.rx.payload(self.rx_head),
                        op.buf.add(op.done),
                        chunk,
                    );
                }
            }
            self.rx_head += 1;
            self.rx.head().store(self.rx_head, Ordering::Release);
            notify();
            moved = true;
            op.done += chunk;
            op.chunks_left -= 1;
            if op.chunks_left == 0 {
                let op = self.recvs.pop_front().expect("front exists");
                op.completion.complete(Ok(()));
            }
        }
        Ok(moved)
    }
}

/// Writes `header` into the slot at `tail` (its payload already in place), then
/// hands the slot to the reader by advancing the tail and wakes it if it sleeps.
fn publish(tx: &Ring, tail: &mut u64, header: SlotHeader, notify: &impl Fn()) {
    tx.write_header(*tail, header);
    *tail += 1;
    tx.tail().store(*tail, Ordering::Release);
    notify();
}

/// The error for a failed cross-memory copy with `peer`.
fn cma_error(peer: usize, op: &'static str, what: &str, e: std::io::Error) -> TransportError {
    match e.raw_os_error() {
        Some(libc::ESRCH) => TransportError::PeerClosed { peer },
        _ => TransportError::Io {
            peer,
            op,
            message: format!("cannot {what}: {e}"),
        },
    }
}

/// Slot-sized chunks of a `len`-byte message (one, carrying only the header, if empty).
fn chunks(len: usize, slot_bytes: usize) -> u64 {
    len.div_ceil(slot_bytes).max(1) as u64
}

/// Checks an arrived chunk's header against the receive it is for.
fn check_header(
    peer: usize,
    got: &SlotHeader,
    op: &Op,
    chunk: usize,
) -> Result<(), TransportError> {
    let got = MessageId {
        seq: got.seq,
        tag: got.tag,
        len: got.msg_len,
        piece: got.chunk_len,
    };
    let want = MessageId {
        seq: op.seq,
        tag: op.tag,
        len: op.len as u64,
        piece: chunk as u64,
    };
    matching::check(peer, got, want)
}
