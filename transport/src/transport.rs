//! The `Transport` trait: the contract every way of moving bytes between ranks meets.

use std::time::{Duration, Instant};

use crate::{Direction, Request, TransportError};

/// What one message over a link costs, in the alpha-beta model a tuner uses:
/// `latency + bytes / bandwidth` seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkCost {
    /// Seconds every message costs whatever its size (alpha).
    pub latency: f64,
    /// Bytes per second (beta).
    pub bandwidth: f64,
}

/// Moves byte ranges between the ranks of one communicator.
///
/// # Contract
///
/// * **Ranks.** A transport connects rank `rank()` to every other rank in
///   `0..world_size()`; all connection set-up happens before the value exists.
/// * **Posting.** [`isend`](Transport::isend) and [`irecv`](Transport::irecv)
///   return at once with a [`Request`]; bytes move in the background (a
///   progress thread, and the kernel's socket buffers), so the caller can
///   compute while the wire works. Over TCP, received bytes leave the
///   kernel's buffers only while some thread waits on this transport, so a
///   large receive finishes (and its sender's large send with it) only once
///   the receiver waits.
/// * **Matching.** Between one pair of ranks, messages are matched strictly in
///   posting order: the k-th receive posted for `peer` takes the k-th message
///   `peer` sent to this rank. The receiver checks that the message's tag and
///   length equal those it posted; a difference fails the receive with
///   [`TransportError::Protocol`] naming the peer and both values, never with
///   silent corruption. Messages to different peers are independent.
/// * **Buffers.** A send reads, and a receive writes, the caller's memory
///   directly (no copy in the transport). The memory must stay valid, and the
///   caller must not touch a receive buffer (nor write a send buffer), until
///   the request has completed or [`abort`](Transport::abort) has returned. A
///   receive that fails leaves its buffer's contents unspecified.
/// * **Errors.** Every error names the peer rank where one is involved. A
///   failure on a connection fails every pending and later request to that
///   peer; it does not stall other peers.
/// * **Progress.** Requests complete without further calls into the
///   transport; waiting is done on the [`Request`] with a deadline. A
///   transport may leave incoming bytes to the threads waiting on its
///   requests, so a caller that only [`test`](Request::test)s must
///   eventually wait.
pub trait Transport: Send + Sync {
    /// This process's rank.
    fn rank(&self) -> usize;

    /// The number of ranks connected by this transport.
    fn world_size(&self) -> usize;

    /// Posts `payload` (a send's bytes or a receive's buffer) with `peer`, labelled `tag`: the
    /// one way into a transport, behind [`isend`](Transport::isend) and
    /// [`irecv`](Transport::irecv).
    ///
    /// Fails at once if `peer` is out of range or its connection has failed.
    ///
    /// # Safety
    ///
    /// The payload's memory must stay valid until the returned request has completed or
    /// `abort` has returned; a send's bytes must not be written meanwhile, and a receive's
    /// buffer must not be read or written by anyone else.
    unsafe fn post(
        &self,
        peer: usize,
        tag: u64,
        payload: Payload<'_>,
    ) -> Result<Request, TransportError>;

    /// Posts a send of `data` to `peer`, labelled with `tag`.
    ///
    /// Fails at once if `peer` is out of range or its connection has failed.
    ///
    /// # Safety
    ///
    /// `data` must stay valid and unmodified until the returned request has
    /// completed or `abort` has returned.
    unsafe fn isend(&self, peer: usize, tag: u64, data: &[u8]) -> Result<Request, TransportError> {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.post(peer, tag, Payload::Send(data)) }
    }

    /// Posts a receive of exactly `buf.len()` bytes from `peer`, labelled `tag`.
    ///
    /// Fails at once if `peer` is out of range or its connection has failed.
    ///
    /// # Safety
    ///
    /// `buf` must stay valid, and must not be read or written by anyone else,
    /// until the returned request has completed or `abort` has returned.
    unsafe fn irecv(
        &self,
        peer: usize,
        tag: u64,
        buf: &mut [u8],
    ) -> Result<Request, TransportError> {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.post(peer, tag, Payload::Recv(buf)) }
    }

    /// Looks at the next message from `peer` that no posted receive has claimed, without taking
    /// it: `Some((tag, len))` (`len` in bytes) once its header has arrived, `None` until then.
    ///
    /// The message stays where it is: the next receive posted for `peer` takes it (and checks
    /// its tag and length as always). While receives posted for `peer` are pending, the answer
    /// may be `None` even though the message has arrived. Fails if `peer` is out of range or its
    /// connection has failed, and with [`TransportError::PeerClosed`] once `peer` has closed its
    /// connection with no unclaimed message left; a peer found failed or closed is failed for
    /// every later request too.
    fn probe(&self, peer: usize) -> Result<Option<(u64, usize)>, TransportError>;

    /// Fails every pending and later request with `Aborted(reason)` and closes
    /// the connections, so peers see this rank leave.
    ///
    /// When it returns, the transport no longer touches any posted buffer.
    fn abort(&self, reason: &str);

    /// How long `peer`'s host has acknowledged nothing of what this rank sent it, while the
    /// bytes are being retransmitted: `Some` only when its machine or link has stopped
    /// answering (a process that is stopped or busy keeps its kernel acknowledging). `None`
    /// where the peer answers, or the transport cannot tell (shared memory).
    fn unanswered(&self, peer: usize) -> Option<Duration> {
        let _ = peer;
        None
    }

    /// Posts a send of `data` to `to` and a receive of exactly `buf.len()` bytes from `from`,
    /// both labelled `tag` and numbered as an [`isend`](Self::isend) then an
    /// [`irecv`](Self::irecv) would be, and returns the requests still pending. A transport
    /// may finish a small exchange here, moving its bytes straight between the sockets and
    /// the buffers, without requests.
    ///
    /// # Safety
    ///
    /// As for `isend` and `irecv`: `data` and `buf` must stay valid (and `buf` untouched by
    /// anyone else) until the returned requests have completed or `abort` has returned.
    unsafe fn sendrecv(
        &self,
        to: usize,
        from: usize,
        tag: u64,
        data: &[u8],
        buf: &mut [u8],
    ) -> Result<Exchange, TransportError> {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { Exchange::posted(self, to, from, tag, data, buf) }
    }
}

/// What one posted message moves: the bytes a send reads, or the buffer a receive fills.
#[derive(Debug)]
pub enum Payload<'a> {
    /// A send of these bytes.
    Send(&'a [u8]),
    /// A send of bytes a peer on this host may read where they lie, the caller having
    /// judged one copy the cheaper (they sit on huge pages, say): over shared memory the
    /// receiver copies them straight out of the sender's memory (see
    /// [`SingleCopy`](crate::shm::SingleCopy)); elsewhere, a `Send`.
    Lend(&'a [u8]),
    /// A receive of exactly this many bytes, into this buffer.
    Recv(&'a mut [u8]),
    /// A receive into a buffer nothing reads again while it could still be in the caches:
    /// over shared memory the bytes are written with streaming stores (see
    /// [`copy_streaming`](chorus_kernels::copy_streaming)); elsewhere, a `Recv`.
    RecvStreaming(&'a mut [u8]),
}

impl Payload<'_> {
    /// Which way the bytes move.
    pub fn direction(&self) -> Direction {
        match self {
            Payload::Send(_) | Payload::Lend(_) => Direction::Send,
            Payload::Recv(_) | Payload::RecvStreaming(_) => Direction::Recv,
        }
    }

    /// How many bytes move.
    pub fn len(&self) -> usize {
        match self {
            Payload::Send(data) | Payload::Lend(data) => data.len(),
            Payload::Recv(buf) | Payload::RecvStreaming(buf) => buf.len(),
        }
    }

    /// Whether no bytes move.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether this is a [`RecvStreaming`](Payload::RecvStreaming).
    pub fn streaming(&self) -> bool {
        matches!(self, Payload::RecvStreaming(_))
    }

    /// Whether this is a [`Lend`](Payload::Lend).
    pub fn lent(&self) -> bool {
        matches!(self, Payload::Lend(_))
    }

    /// The memory as an engine keeps it until the message completes: its direction, start
    /// and length (a send's start is only ever read through).
    pub(crate) fn raw(self) -> (Direction, *mut u8, usize) {
        match self {
            Payload::Send(data) | Payload::Lend(data) => {
                (Direction::Send, data.as_ptr().cast_mut(), data.len())
            }
            Payload::Recv(buf) | Payload::RecvStreaming(buf) => {
                (Direction::Recv, buf.as_mut_ptr(), buf.len())
            }
        }
    }
}

/// The requests of a [`Transport::sendrecv`] still pending when it returned.
#[derive(Debug, Default)]
pub struct Exchange {
    /// The send, unless it had completed.
    pub send: Option<Request>,
    /// The receive, unless it had completed.
    pub recv: Option<Request>,
}

impl Exchange {
    /// Posts the exchange's send and receive through `transport`'s `isend` and `irecv`.
    ///
    /// # Safety
    ///
    /// As for [`Transport::sendrecv`].
    pub unsafe fn posted(
        transport: &(impl Transport + ?Sized),
        to: usize,
        from: usize,
        tag: u64,
        data: &[u8],
        buf: &mut [u8],
    ) -> Result<Exchange, TransportError> {
        // SAFETY: the caller's guarantee, passed on.
        unsafe {
            let send = transport.isend(to, tag, data)?;
            let recv = transport.irecv(from, tag, buf)?;
            Ok(Exchange {
                send: send.test().is_none().then_some(send),
                recv: Some(recv),
            })
        }
    }
}

/// Waits for every request in `reqs`, in order, until `deadline`.
///
/// Returns the first failure; the caller aborts the transport before reusing
/// the buffers of the requests that did not complete.
pub fn wait_all(reqs: &[Request], deadline: Instant) -> Result<(), TransportError> {
    reqs.iter().try_for_each(|r| r.wait(deadline))
}
