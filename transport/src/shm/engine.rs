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
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::cma::{self, Way};
use super::region::{Region, Ring, SlotHeader};
use super::wake::{self, Liveness};
use super::SingleCopy;
use crate::matching::{self, MessageId};
use crate::peers::Peers;
use crate::request::{Completion, Direction, Idle, Progress, Request};
use crate::{Payload, TransportError};

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
    /// A send the peer reads from this process's memory in one copy.
    single: bool,
    /// A receive written with streaming stores.
    streaming: bool,
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
    /// This rank's ends of the ring to the peer (it writes) and from it (it reads).
    tx: End,
    rx: End,
    sends: VecDeque<Op>,
    recvs: VecDeque<Op>,
    inflight: VecDeque<Inflight>,
    /// The single-copy message at `rx_head` is being copied (its number of
    /// pieces): this rank published its address, and the sender may be
    /// writing into it.
    reading: Option<u64>,
    /// Whether this process may write the peer's memory (to help its single copies).
    helps: bool,
    /// Which sends the peer reads from this process's memory (`Never` where it may not).
    single_copy: SingleCopy,
    pid: u32,
    live: Liveness,
}

/// The engine's state; guarded by the mutex in [`Shared`].
#[derive(Debug)]
pub(crate) struct Engine {
    rank: usize,
    region: Arc<Region>,
    own_local: usize,
    /// Links by global peer rank; `None` for ranks on other hosts and self.
    peers: Peers<Link>,
    /// Failed receives to settle once the lock is released (see [`Locked`]).
    unsettled: Vec<Unsettled>,
}

/// A receive that was being copied by a single copy when its link failed: the sender may
/// still be writing pieces into its buffer, so it fails only once they have landed.
#[derive(Debug)]
pub(crate) struct Unsettled {
    peer: usize,
    region: Arc<Region>,
    peer_local: usize,
    rx: Ring,
    /// The message's slot in `rx`, and its number of pieces.
    index: u64,
    pieces: u64,
    pid: u32,
    completion: Arc<Completion>,
    err: TransportError,
}

// SAFETY: `rx` points into the mapping that `region` keeps alive; it is only used to reach
// the slot's atomics.
unsafe impl Send for Unsettled {}

impl Unsettled {
    /// Stops the sender from taking more pieces and waits for those it is writing into the
    /// receive's buffer, until it finishes them, closes or dies; then fails the receive. The
    /// buffer goes back to the caller after that, so there is no time limit; a warning names
    /// the peer if the wait grows long (a stopped process).
    fn settle(self) {
        let split = self.rx.split(self.index);
        let taken = split.close(self.pieces);
        let closed = self.region.control(self.peer_local).closed;
        let live = Liveness::watch(self.pid);
        let mut warn_at = Some(Instant::now() + SETTLE);
        while split.progress().0 < taken {
            if closed.load(Ordering::Acquire) != 0 || live.dead() {
                break;
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
        self.completion.complete(Err(self.err));
    }
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
    /// Held while failed receives settle (see [`Locked`]).
    settling: Mutex<()>,
    /// Set by a waiter that parks: the progress thread must move bytes until
    /// nothing is pending.
    handoff: AtomicBool,
    /// More local ranks than cores: a spinning waiter yields its core to them.
    crowded: bool,
}

impl Shared {
    /// Builds the engine over `region` for local rank `own_local`, linked to `peers`, on a
    /// host whose local ranks share `cores`.
    pub fn new(
        rank: usize,
        world_size: usize,
        region: Arc<Region>,
        own_local: usize,
        peers: &[PeerInfo],
        single_copy: SingleCopy,
        cores: usize,
    ) -> Shared {
        let mut links: Vec<Option<Link>> = (0..world_size).map(|_| None).collect();
        for p in peers {
            links[p.rank] = Some(Link {
                peer: p.rank,
                peer_local: p.local,
                tx: End::new(region.ring(own_local, p.local), Side::Writer),
                rx: End::new(region.ring(p.local, own_local), Side::Reader),
                sends: VecDeque::new(),
                recvs: VecDeque::new(),
                inflight: VecDeque::new(),
                reading: None,
                helps: p.writable,
                single_copy: match p.single_copy {
                    true => single_copy,
                    false => SingleCopy::Never,
                },
                pid: p.pid,
                live: Liveness::watch(p.pid),
            });
        }
        let engine = Engine {
            rank,
            region: region.clone(),
            own_local,
            peers: Peers::new(rank, links),
            unsettled: Vec::new(),
        };
        Shared {
            engine: Mutex::new(engine),
            region,
            own_local,
            stop: AtomicBool::new(false),
            settling: Mutex::new(()),
            handoff: AtomicBool::new(false),
            crowded: peers.len() + 1 > cores,
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
    pub fn lock(&self) -> Locked<'_> {
        let engine = self.engine.lock().unwrap_or_else(|p| p.into_inner());
        Locked {
            shared: self,
            engine: Some(engine),
        }
    }

    /// Locks the engine unless another thread holds it.
    fn try_lock(&self) -> Option<Locked<'_>> {
        let engine = self.engine.try_lock().ok()?;
        Some(Locked {
            shared: self,
            engine: Some(engine),
        })
    }

    /// Waits until receives failed by other threads have settled.
    fn settled(&self) {
        drop(self.settling.lock().unwrap_or_else(|p| p.into_inner()));
    }
}

/// The locked engine. Receives it failed while copying are settled once the lock is
/// released (a stopped sender could make that wait long, and every other peer's traffic
/// would wait with it); [`Shared::settled`] waits for them.
pub(crate) struct Locked<'a> {
    shared: &'a Shared,
    engine: Option<MutexGuard<'a, Engine>>,
}

impl std::ops::Deref for Locked<'_> {
    type Target = Engine;

    fn deref(&self) -> &Engine {
        self.engine.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Engine {
        self.engine.as_mut().expect("held until dropped")
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let Some(mut engine) = self.engine.take() else {
            return;
        };
        if engine.unsettled.is_empty() {
            return;
        }
        let unsettled = std::mem::take(&mut engine.unsettled);
        // Taken before the engine is released, so that an abort waiting for it cannot return
        // in between.
        let _settling = self
            .shared
            .settling
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        drop(engine);
        for receive in unsettled {
            receive.settle();
        }
    }
}

impl crate::endpoint::Engine for Shared {
    unsafe fn post(
        &self,
        peer: usize,
        tag: u64,
        payload: Payload<'_>,
    ) -> Result<Request, TransportError> {
        let (lent, streaming) = (payload.lent(), payload.streaming());
        let (direction, buf, len) = payload.raw();
        // SAFETY: the caller keeps `buf` valid (and unaliased for a receive) until completion or
        // abort (this trait's contract).
        unsafe {
            self.lock()
                .post(peer, direction, tag, (buf, len), lent, streaming)
        }
    }

    fn probe(&self, peer: usize) -> Result<Option<(u64, usize)>, TransportError> {
        self.lock().probe(peer)
    }

    fn abort(&self, reason: &str) {
        self.lock().abort(reason);
        // Until every receive it failed has settled, a buffer may still be written.
        self.settled();
    }

    /// Asks the progress thread to exit and wakes it.
    fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        wake::ring(self.region.control(self.own_local));
    }

    /// The progress thread: dormant while waiters move bytes themselves;
    /// once one parks, moves bytes until nothing is pending, sleeping on its
    /// doorbell (rung by peers) whenever nothing can move. Checks peers'
    /// liveness while anything is pending.
    fn run(&self) {
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

    fn close(&self) {
        self.lock().abort("transport dropped");
        self.settled();
    }
}

impl Progress for Shared {
    fn poll(&self, _peer: usize) {
        // Never wait for the lock: whoever holds it is moving bytes anyway.
        // Every peer is served, since a receive may wait on a send to another.
        let moved = self.try_lock().is_some_and(|mut engine| engine.progress());
        if !moved && self.crowded {
            // Let the peer this waiter waits for run: it may share the core.
            std::thread::yield_now();
        }
    }

    /// Wakes the progress thread, which moves bytes until nothing is pending: shared memory
    /// has nothing a waiter could sleep on until bytes can move.
    fn idle(&self, _peer: usize, _until: Instant, _done: &dyn Fn() -> bool) -> Idle {
        self.handoff.store(true, Ordering::Release);
        wake::ring(self.region.control(self.own_local));
        Idle::Park
    }
}

impl Engine {
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
        (buf, len): (*mut u8, usize),
        lent: bool,
        streaming: bool,
    ) -> Result<Request, TransportError> {
        let p = self.peers.usable(peer)?;
        let seq = p.next_seq(direction);
        let link = &mut p.link;
        let (req, completion) = Request::new(peer, direction, len);
        let queue = match direction {
            Direction::Send => &mut link.sends,
            Direction::Recv => &mut link.recvs,
        };
        queue.push_back(Op {
            buf,
            len,
            tag,
            seq,
            done: 0,
            chunks_left: chunks(len, link.tx.ring.slot_bytes()),
            single: direction == Direction::Send && link.single_copy.takes(len, lent),
            streaming,
            completion,
        });
        self.serve(peer);
        Ok(req)
    }

    /// The tag and length of the next message from `peer` that no posted receive claims, once
    /// its first chunk is published; fails the peer if it has left with nothing more published.
    pub fn probe(&mut self, peer: usize) -> Result<Option<(u64, usize)>, TransportError> {
        let region = self.region.clone();
        let p = self.peers.usable(peer)?;
        let closed = region.control(p.link.peer_local).closed;
        let next = p.link.peek(p.leaving(), p.recv_seq(), closed);
        if let Err(e) = &next {
            self.fail_peer(peer, e.clone());
        }
        next.map(|header| header.map(|h| (h.tag, h.msg_len as usize)))
    }

    /// Moves whatever can move on every link; true if anything moved.
    pub fn progress(&mut self) -> bool {
        let mut moved = false;
        for peer in 0..self.peers.len() {
            moved |= self.serve(peer);
        }
        moved
    }

    /// Whether any request is still queued.
    pub fn pending(&self) -> bool {
        self.peers.iter().any(|(_, p)| p.link.busy())
    }

    /// Whether a peer may soon start reading a single-copy send this rank can help with.
    fn may_help(&self) -> bool {
        self.peers
            .iter()
            .any(|(_, p)| p.link.helps && !p.link.inflight.is_empty())
    }

    /// Why this engine was aborted, if it was.
    pub fn aborted(&self) -> Option<&str> {
        self.peers.aborted()
    }

    /// Whether the process of local peer `peer` (a global rank) has exited.
    pub fn peer_exited(&self, peer: usize) -> bool {
        self.peers
            .get(peer)
            .is_some_and(|p| p.leaving() || p.link.live.dead())
    }

    /// Marks peers with pending work whose process has exited, and fails their requests.
    pub fn check_liveness(&mut self) {
        for peer in 0..self.peers.len() {
            let Some(p) = self.peers.get_mut(peer) else {
                continue;
            };
            if p.link.busy() && !p.leaving() && !p.failed() && p.link.live.dead() {
                tracing::debug!(rank = self.rank, peer, "peer process exited");
                p.leave();
                self.serve(peer);
            }
        }
    }

    /// Moves bytes to and from `peer`; true if anything moved.
    fn serve(&mut self, peer: usize) -> bool {
        let Some(p) = self.peers.get_mut(peer) else {
            return false;
        };
        if p.failed() {
            return false;
        }
        let region = &self.region;
        let peer_control = region.control(p.link.peer_local);
        if peer_control.closed.load(Ordering::Acquire) != 0 {
            p.leave();
        }
        let leaving = p.leaving();
        let link = &mut p.link;
        let result = link.push(leaving, || wake::ring_if_sleeping(peer_control));
        let result = result.and_then(|sent| {
            let closed = || peer_control.closed.load(Ordering::Acquire) != 0;
            link.pull(|| wake::ring_if_sleeping(peer_control), closed)
                .map(|got| sent | got)
        });
        match result {
            Ok(moved) => {
                if leaving && link.busy() {
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
        let (region, unsettled) = (&self.region, &mut self.unsettled);
        self.peers.fail(peer, err, |link, err| {
            link.fail_requests(region, err, unsettled)
        });
    }

    /// Fails everything with `Aborted(reason)`, marks this rank closed in the
    /// region, and wakes every local peer so they notice at once.
    pub fn abort(&mut self, reason: &str) {
        if self.peers.aborted().is_some() {
            return;
        }
        // Closed first: a peer reading a single-copy send checks this flag
        // after its read, before the send's buffer is handed back below.
        self.region
            .control(self.own_local)
            .closed
            .store(1, Ordering::SeqCst);
        let (region, unsettled) = (&self.region, &mut self.unsettled);
        self.peers.abort(reason, |link, err| {
            link.fail_requests(region, err, unsettled)
        });
        for (_, p) in self.peers.iter() {
            wake::ring(self.region.control(p.link.peer_local));
        }
    }
}

impl Link {
    /// Fails every request queued on the link with `err`, except a receive being copied by a
    /// single copy: that one is left in `unsettled`, to fail once the sender has stopped
    /// writing into it.
    fn fail_requests(
        &mut self,
        region: &Arc<Region>,
        err: &TransportError,
        unsettled: &mut Vec<Unsettled>,
    ) {
        if let Some(pieces) = self.reading.take() {
            let op = self.recvs.pop_front().expect("a receive is being copied");
            unsettled.push(Unsettled {
                peer: self.peer,
                region: region.clone(),
                peer_local: self.peer_local,
                rx: self.rx.ring,
                index: self.rx.next,
                pieces,
                pid: self.pid,
                completion: op.completion,
                err: err.clone(),
            });
        }
        for op in self.sends.drain(..) {
            op.completion.complete(Err(err.clone()));
        }
        for op in self.recvs.drain(..) {
            op.completion.complete(Err(err.clone()));
        }
        for sent in self.inflight.drain(..) {
            sent.completion.complete(Err(err.clone()));
        }
    }

    /// Whether any request to or from the peer is unfinished.
    fn busy(&self) -> bool {
        !self.sends.is_empty() || !self.recvs.is_empty() || !self.inflight.is_empty()
    }

    /// The header of the first chunk of the next message no posted receive claims (message
    /// `recv_seq`), if it is published (`None` while receives are queued); fails once the peer
    /// has left (`leaving`, or `closed`: its flag, set when it aborts or drops its transport)
    /// with nothing more published.
    fn peek(
        &mut self,
        leaving: bool,
        recv_seq: u64,
        closed: &AtomicU32,
    ) -> Result<Option<SlotHeader>, TransportError> {
        if !self.recvs.is_empty() {
            return Ok(None);
        }
        if !self.rx.ready() {
            if !(leaving || closed.load(Ordering::Acquire) != 0 || self.live.dead()) {
                return Ok(None);
            }
            // Everything the peer published before it left is visible now.
            if !self.rx.ready() {
                return Err(TransportError::PeerClosed { peer: self.peer });
            }
        }
        let header = self.rx.ring.read_header(self.rx.next);
        matching::check_seq(self.peer, header.seq, recv_seq)?;
        Ok(Some(header))
    }

    /// Completes single-copy sends the peer has finished reading; true if any.
    fn reap(&mut self) -> bool {
        if self.inflight.is_empty() {
            return false;
        }
        let head = self.tx.look();
        let mut moved = false;
        while let Some(sent) = self.inflight.front() {
            if sent.index >= head {
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
            let split = self.tx.ring.split(sent.index);
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

    /// Copies queued sends into free slots (or, for a single copy, their
    /// address); true if any slot was published.
    /// Once the peer is `leaving`, only reaps what it finished reading.
    fn push(&mut self, leaving: bool, notify: impl Fn()) -> Result<bool, TransportError> {
        // Reaped first: a peer that read a single copy and then left did finish it.
        let mut moved = self.reap();
        if leaving {
            return Ok(moved);
        }
        moved |= self.help(&notify)?;
        let slot_bytes = self.tx.ring.slot_bytes();
        while let Some(op) = self.sends.front_mut() {
            if !self.tx.ready() {
                break;
            }
            if op.single {
                let header = SlotHeader {
                    seq: op.seq,
                    tag: op.tag,
                    msg_len: op.len as u64,
                    chunk_len: op.len as u64,
                    addr: op.buf as u64,
                };
                let op = self.sends.pop_front().expect("front exists");
                self.inflight.push_back(Inflight {
                    index: self.tx.next,
                    buf: op.buf,
                    len: op.len,
                    completion: op.completion,
                });
                self.tx.ring.write_header(self.tx.next, header);
                self.tx.pass(&notify);
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
                    self.tx.ring.payload(self.tx.next),
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
            self.tx.ring.write_header(self.tx.next, header);
            self.tx.pass(&notify);
            moved = true;
            if op.moved(chunk) {
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
        let slot_bytes = self.rx.ring.slot_bytes();
        let mut moved = false;
        while let Some(op) = self.recvs.front_mut() {
            if !self.rx.ready() {
                break;
            }
            let got = self.rx.ring.read_header(self.rx.next);
            let chunk = match got.addr {
                0 => (op.len - op.done).min(slot_bytes),
                _ => op.len - op.done,
            };
            check_header(self.peer, &got, op, chunk)?;
            if got.addr != 0 {
                // SAFETY: `done + chunk <= len` fits the caller's buffer.
                let dst = unsafe { op.buf.add(op.done) };
                let split = self.rx.ring.split(self.rx.next);
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
                // chunk <= len` fits the caller's buffer (post_recv's contract);
                // nothing else touches either meanwhile (the writer waits for the
                // head, the caller for the request), so both may be viewed as
                // slices, the buffer's part uniquely.
                unsafe {
                    let from = self.rx.ring.payload(self.rx.next);
                    let to = op.buf.add(op.done);
                    match op.streaming {
                        true => chorus_kernels::copy_streaming(
                            std::slice::from_raw_parts_mut(to, chunk),
                            std::slice::from_raw_parts(from, chunk),
                        )
                        .expect("equal lengths"),
                        false => std::ptr::copy_nonoverlapping(from, to, chunk),
                    }
                }
            }
            self.rx.pass(&notify);
            moved = true;
            if op.moved(chunk) {
                let op = self.recvs.pop_front().expect("front exists");
                op.completion.complete(Ok(()));
            }
        }
        Ok(moved)
    }
}

/// Which end of a ring this rank holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// Fills slots and advances the tail.
    Writer,
    /// Empties slots and advances the head.
    Reader,
}

/// This rank's end of one ring: the slot it moves next, and the other end's counter as last
/// seen. Sends and receives go through the same steps: wait for a slot ([`ready`](End::ready)),
/// copy, hand the slot over ([`pass`](End::pass)).
#[derive(Debug)]
struct End {
    ring: Ring,
    side: Side,
    next: u64,
    seen: u64,
}

impl End {
    fn new(ring: Ring, side: Side) -> End {
        End {
            ring,
            side,
            next: 0,
            seen: 0,
        }
    }

    /// The counter this end advances, and the other end's.
    fn counters(&self) -> (&AtomicU64, &AtomicU64) {
        match self.side {
            Side::Writer => (self.ring.tail(), self.ring.head()),
            Side::Reader => (self.ring.head(), self.ring.tail()),
        }
    }

    /// Whether the slot at `next` is this end's to move (free to fill, or published to
    /// empty); reloads the other end's counter only when the one last seen says no.
    fn ready(&mut self) -> bool {
        if !self.has_slot() {
            self.look();
        }
        self.has_slot()
    }

    fn has_slot(&self) -> bool {
        match self.side {
            Side::Writer => self.next - self.seen < self.ring.slots() as u64,
            Side::Reader => self.next != self.seen,
        }
    }

    /// Reloads the other end's counter (acquiring what it published), and returns it.
    fn look(&mut self) -> u64 {
        self.seen = self.counters().1.load(Ordering::Acquire);
        self.seen
    }

    /// Hands the slot at `next` to the other end and wakes it if it sleeps.
    fn pass(&mut self, notify: &impl Fn()) {
        self.next += 1;
        self.counters().0.store(self.next, Ordering::Release);
        notify();
    }
}

impl Op {
    /// Counts one more chunk of `chunk` bytes moved; true once the whole message has.
    fn moved(&mut self, chunk: usize) -> bool {
        self.done += chunk;
        self.chunks_left -= 1;
        self.chunks_left == 0
    }
}

/// The error for a failed cross-memory copy with `peer`.
fn cma_error(peer: usize, op: &'static str, what: &str, e: std::io::Error) -> TransportError {
    match e.raw_os_error() {
        Some(libc::ESRCH) => TransportError::PeerClosed { peer },
        _ => TransportError::io(peer, op, Some(what.to_string()), e),
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
