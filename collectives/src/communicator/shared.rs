//! Shared buffers: memory every rank of a one-host job maps, so all-reduce
//! and broadcast on it read and write the peers' buffers directly instead
//! of sending messages (like NCCL's `ncclMemAlloc` with registration, or
//! `MPI_Win_allocate_shared`).
//!
//! An all-reduce on shared buffers meets three times (see
//! [`ShmTransport::meet`]): once all inputs are ready, each rank reduces its
//! block of every rank's input into its own output; once all blocks are
//! reduced, each rank copies the other blocks from their owners' outputs;
//! the last meeting keeps every buffer untouched until all ranks are done
//! reading it. A broadcast meets twice, the ranks splitting the root's
//! bytes among them and writing them into every output. `prepare.rs` picks
//! this route from the tuner's table when a call's buffers lie here
//! (`Inner::window_call`); `meeting.rs` runs it.

use std::ops::{Deref, DerefMut, Range};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Instant;

use chorus_kernels::{finish_avg, reduce, reduce_into, DType, Element, ReduceOp};
use chorus_transport::shm::{CallPlace, ShmTransport, Stall, Window};
use chorus_transport::store::PrefixStore;
use chorus_transport::TransportError;

use super::{lock, CallInfo, CallKind, Communicator, Inner};
use crate::executor::Buffers;
use crate::{Error, Result};

/// Elements reduced at a time, so the output block being summed stays in cache.
const REDUCE_PIECE_BYTES: usize = 64 << 10;
/// All-reduces of at most this many bytes meet twice, every rank reducing the
/// whole buffer, rather than three times to split the work.
const WHOLE_BYTES: usize = 16 << 10;

/// Memory from [`Communicator::alloc_shared`]: a `[T]` that, when the whole
/// job runs on one host, the other ranks can read and write during a
/// collective.
///
/// Collectives on these buffers (all-reduce, broadcast) move data without
/// messages; on buffers elsewhere they run as usual. Every rank must then
/// pass shared buffers, or none, to the same call.
pub struct SharedBuffer<T: Element> {
    memory: Memory<T>,
    len: usize,
}

enum Memory<T> {
    /// A segment of a window mapped by every local rank.
    Window(Arc<Window>),
    /// Plain memory: the job spans hosts, or runs over TCP only.
    Private(Vec<T>),
}

impl<T: Element> SharedBuffer<T> {
    /// Whether the other ranks map this buffer (the whole job is on one host).
    pub fn is_shared(&self) -> bool {
        matches!(self.memory, Memory::Window(_))
    }
}

impl<T: Element> Deref for SharedBuffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.memory {
            // SAFETY: the segment (page-aligned, at least `len` elements) lives as long as
            // `self`; peers touch it only inside a collective, which borrows the buffer
            // mutably (after a failed call a peer may still be finishing its copies: the
            // contents are then undefined, as after any failed collective, but the
            // memory stays mapped).
            Memory::Window(w) => unsafe { std::slice::from_raw_parts(w.own().cast(), self.len) },
            Memory::Private(v) => v,
        }
    }
}

impl<T: Element> DerefMut for SharedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.memory {
            // SAFETY: as in `deref`, and `&mut self` makes this the only borrow here.
            Memory::Window(w) => unsafe {
                std::slice::from_raw_parts_mut(w.own().cast(), self.len)
            },
            Memory::Private(v) => v,
        }
    }
}

impl<T: Element> AsRef<[T]> for SharedBuffer<T> {
    fn as_ref(&self) -> &[T] {
        self
    }
}

impl<T: Element> AsMut<[T]> for SharedBuffer<T> {
    fn as_mut(&mut self) -> &mut [T] {
        self
    }
}

impl<T: Element> std::fmt::Debug for SharedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuffer")
            .field("len", &self.len)
            .field("shared", &self.is_shared())
            .finish()
    }
}

/// The windows of a communicator, by id (dropped ones are skipped).
#[derive(Default)]
pub(crate) struct Windows {
    made: u64,
    live: Vec<Weak<Window>>,
}

impl Windows {
    /// The window holding the bytes at addresses `at`, and their offset in it.
    fn find(&self, at: &Range<usize>) -> Option<(Arc<Window>, usize)> {
        self.live.iter().filter_map(Weak::upgrade).find_map(|w| {
            let base = w.own() as usize;
            (at.start >= base && at.end <= base + w.len()).then(|| (w.clone(), at.start - base))
        })
    }

    fn by_id(&self, id: u64) -> Option<Arc<Window>> {
        self.live
            .iter()
            .filter_map(Weak::upgrade)
            .find(|w| w.id() == id)
    }
}

impl Communicator {
    /// Allocates `len` zeroed elements that every rank of a one-host job
    /// maps; every rank must call it, in the same order as its collectives,
    /// with the same `len`.
    ///
    /// All-reduce and broadcast on such buffers (in place, or with input
    /// and output both shared) move the data through memory directly. When
    /// the job spans hosts or runs over TCP only, this is plain memory and
    /// collectives on it run as usual.
    ///
    /// Fails on every rank alike if the shared file cannot be created (a full
    /// `/dev/shm`) or mapped, or if ranks ask for different sizes; the
    /// communicator stays usable. Fails after the timeout if a rank does not
    /// take part.
    pub fn alloc_shared<T: Element>(&self, len: usize) -> Result<SharedBuffer<T>> {
        let inner = &self.inner;
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
            Error::InvalidArgument(format!("{len} elements of {} overflow", T::DTYPE))
        })?;
        let shm = inner
            .transport
            .as_ref()
            .filter(|t| t.all_shm())
            .and_then(|t| t.shm());
        let (Some(shm), Some((client, prefix))) = (shm, &inner.store) else {
            return Ok(SharedBuffer {
                memory: Memory::Private(vec![T::zeroed(); len]),
                len,
            });
        };
        // A failed allocation fails on every rank alike (the creator's verdict), so it
        // leaves the communicator usable: the caller may fall back to private memory.
        let mut made = None;
        inner.run_with(inner.ticket(), |inner, _| {
            let mut windows = lock(&inner.windows);
            let id = windows.made;
            windows.made += 1;
            let store = PrefixStore::new(prefix.clone(), client.clone());
            made = Some(shm.allocate_window(id, bytes, &store).map(|window| {
                inner.has_windows.store(true, Ordering::Relaxed);
                let window = Arc::new(window);
                windows.live.retain(|w| w.strong_count() > 0);
                windows.live.push(Arc::downgrade(&window));
                window
            }));
            Ok(())
        })?;
        let window = made
            .expect("run when the communicator is usable")
            .map_err(|e| Error::transport(self.rank(), e))?;
        tracing::debug!(rank = self.rank(), id = window.id(), bytes, "shared buffer");
        Ok(SharedBuffer {
            memory: Memory::Window(window),
            len,
        })
    }
}

/// A collective on shared buffers: where its input and output lie.
pub(crate) struct WindowCall {
    input: (Arc<Window>, usize),
    output: (Arc<Window>, usize),
}

impl WindowCall {
    /// `place` naming this call's buffers, as the peers read it.
    pub(super) fn place(&self, place: CallPlace) -> CallPlace {
        CallPlace {
            input: Some((self.input.0.id(), self.input.1)),
            output: Some((self.output.0.id(), self.output.1)),
            ..place
        }
    }
}

impl Inner {
    /// How to run `call` on `bufs` directly, if it is an all-reduce or broadcast, every
    /// rank shares memory, and they lie in this communicator's shared buffers.
    pub(super) fn window_call(&self, call: &CallInfo, bufs: &Buffers<'_>) -> Option<WindowCall> {
        if !matches!(call.kind, CallKind::AllReduce | CallKind::Broadcast)
            || !self.has_windows.load(Ordering::Relaxed)
        {
            return None;
        }
        self.all_shm()?;
        let windows = lock(&self.windows);
        if windows.live.is_empty() {
            return None;
        }
        let (input, output) = bufs.addresses();
        let len = output.len();
        let output = windows.find(&output)?;
        // Only the root's input is read by a broadcast.
        let input = match windows.find(&input) {
            Some(input) => input,
            None if call.kind == CallKind::Broadcast && call.root != self.config.rank => {
                output.clone()
            }
            None => return None,
        };
        let same_window = Arc::ptr_eq(&input.0, &output.0);
        if same_window && input.1 != output.1 && input.1.abs_diff(output.1) < len {
            // Partly overlapping input and output: the message path rejects or handles it.
            return None;
        }
        Some(WindowCall { input, output })
    }

    /// Runs call `info` on the shared buffers `place` names.
    pub(super) fn run_windows(
        &self,
        shm: &ShmTransport,
        place: &CallPlace,
        (deadline, stall): (Instant, Option<Stall<'_>>),
        info: &CallInfo,
    ) -> Result<()> {
        let (count, dtype, op, len) = (info.count, info.dtype, info.op, place.len);
        let failed = |e: TransportError| Error::transport(self.config.rank, e);
        shm.meet(place, deadline, stall).map_err(failed)?;
        let places = shm.places(place).map_err(failed)?;
        let peers = self.resolve(shm, &places, len)?;
        match info.kind {
            CallKind::Broadcast => {
                broadcast(&peers, self.config.rank, info.root, len);
                shm.meet(place, deadline, stall).map_err(failed)?;
            }
            _ if len <= WHOLE_BYTES => {
                let me = self.config.rank;
                let mut sum = vec![0u8; len];
                // SAFETY: between the first and second meetings nobody writes an input.
                let inputs: Vec<&[u8]> = peers
                    .iter()
                    .map(|p| unsafe { p.input.bytes(0..len) })
                    .collect();
                reduce_all(&inputs, &mut sum, dtype, op)?;
                shm.meet(place, deadline, stall).map_err(failed)?;
                // SAFETY: after the second meeting no peer reads this rank's output.
                unsafe { peers[me].output.bytes_mut(0..len) }.copy_from_slice(&sum);
            }
            _ => {
                let me = self.config.rank;
                let blocks = |r: usize| block(count, peers.len(), r);
                reduce_block(&peers, me, blocks(me), dtype, op)?;
                shm.meet(place, deadline, stall).map_err(failed)?;
                gather_blocks(&peers, me, blocks, dtype.size());
                shm.meet(place, deadline, stall).map_err(failed)?;
            }
        }
        Ok(())
    }

    /// Every rank's input and output (by rank), `len` bytes each, checked
    /// against the shared buffers this rank knows.
    fn resolve(&self, shm: &ShmTransport, places: &[CallPlace], len: usize) -> Result<Vec<Ends>> {
        let windows = lock(&self.windows);
        let rank = self.config.rank;
        let mut peers = Vec::with_capacity(places.len());
        for (local, place) in places.iter().enumerate() {
            let peer = shm.local_ranks()[local];
            let bad =
                |detail: String| Error::transport(rank, TransportError::Protocol { peer, detail });
            let end = |at: Option<(u64, usize)>| -> Result<End> {
                let (id, offset) =
                    at.ok_or_else(|| bad(format!("rank {peer} met without a buffer")))?;
                let window = windows.by_id(id).ok_or_else(|| {
                    bad(format!(
                        "rank {peer} passed shared buffer {id}, which rank {rank} has freed"
                    ))
                })?;
                if offset.checked_add(len).is_none_or(|end| end > window.len()) {
                    return Err(bad(format!(
                        "rank {peer} passed {len} bytes at offset {offset} of shared buffer {id}, which has {}",
                        window.len()
                    )));
                }
                Ok(End {
                    window,
                    local,
                    offset,
                })
            };
            peers.push(Ends {
                input: end(place.input)?,
                output: end(place.output)?,
            });
        }
        Ok(peers)
    }
}

/// One rank's buffer in a call: from `offset` in local rank `local`'s segment of `window`
/// (held, so it stays mapped while the call runs, even if this rank drops it meanwhile).
struct End {
    window: Arc<Window>,
    local: usize,
    offset: usize,
}

impl End {
    /// Whether `other` is the same memory.
    fn same(&self, other: &End) -> bool {
        Arc::ptr_eq(&self.window, &other.window)
            && (self.local, self.offset) == (other.local, other.offset)
    }

    /// Bytes `range` of this buffer, to read.
    ///
    /// # Safety
    /// As [`Window::bytes`]: nobody writes them while the slice lives.
    unsafe fn bytes(&self, range: Range<usize>) -> &[u8] {
        // SAFETY: passed on to the caller.
        unsafe {
            (self.window).bytes(
                self.local,
                self.offset + range.start..self.offset + range.end,
            )
        }
    }

    /// Bytes `range` of this buffer, to write.
    ///
    /// # Safety
    /// As [`Window::bytes_mut`]: nobody else touches them while the slice lives.
    #[allow(clippy::mut_from_ref)] // shared memory: exclusivity is the caller's contract
    unsafe fn bytes_mut(&self, range: Range<usize>) -> &mut [u8] {
        let at = self.offset + range.start..self.offset + range.end;
        // SAFETY: passed on to the caller.
        unsafe { self.window.bytes_mut(self.local, at) }
    }
}

/// One rank's input and output.
struct Ends {
    input: End,
    output: End,
}

/// Rank `r`'s block of `count` elements split among `n` ranks.
fn block(count: usize, n: usize, r: usize) -> std::ops::Range<usize> {
    count * r / n..count * (r + 1) / n
}

/// Reduces every rank's input over `elems` into rank `me`'s output, in
/// pieces that stay in cache: this rank's input first, then the others' in rank order.
fn reduce_block(
    peers: &[Ends],
    me: usize,
    elems: std::ops::Range<usize>,
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let size = dtype.size();
    let piece = (REDUCE_PIECE_BYTES / size).max(1);
    let others: Vec<usize> = (0..peers.len()).filter(|&r| r != me).collect();
    let in_place = peers[me].input.same(&peers[me].output);
    let mut at = elems.start;
    while at < elems.end {
        let n = piece.min(elems.end - at);
        let bytes = at * size..(at + n) * size;
        // SAFETY: between the first and second meetings only this rank writes its output's
        // block, and nobody writes inputs; input and output are the same memory (then this
        // rank's input is not read here) or disjoint.
        unsafe {
            let out = peers[me].output.bytes_mut(bytes.clone());
            let first = peers[others[0]].input.bytes(bytes.clone());
            if in_place {
                reduce(op, dtype, out, first)?;
            } else {
                reduce_into(op, dtype, out, peers[me].input.bytes(bytes.clone()), first)?;
            }
            for &r in &others[1..] {
                reduce(op, dtype, out, peers[r].input.bytes(bytes.clone()))?;
            }
            if op == ReduceOp::Avg {
                finish_avg(dtype, out, peers.len())?;
            }
        }
        at += n;
    }
    Ok(())
}

/// Reduces `inputs` (one per rank), in rank order so every rank gets the
/// same bytes, into `sum`.
pub(super) fn reduce_all(
    inputs: &[&[u8]],
    sum: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    reduce_into(op, dtype, sum, inputs[0], inputs[1])?;
    for input in &inputs[2..] {
        reduce(op, dtype, sum, input)?;
    }
    if op == ReduceOp::Avg {
        finish_avg(dtype, sum, inputs.len())?;
    }
    Ok(())
}

/// Copies every other rank's reduced block from its output into rank `me`'s output.
fn gather_blocks(peers: &[Ends], me: usize, blocks: impl Fn(usize) -> Range<usize>, size: usize) {
    for r in (0..peers.len()).filter(|&r| r != me) {
        let b = blocks(r);
        let bytes = b.start * size..b.end * size;
        // SAFETY: after the second meeting nobody writes rank `r`'s block of its output,
        // and only this rank writes its own output.
        unsafe {
            peers[me]
                .output
                .bytes_mut(bytes.clone())
                .copy_from_slice(peers[r].output.bytes(bytes));
        }
    }
}

/// Copies rank `me`'s share of `root`'s `len` bytes into every output.
fn broadcast(peers: &[Ends], me: usize, root: usize, len: usize) {
    let share = block(len, peers.len(), me);
    let src = &peers[root].input;
    for (r, ends) in peers.iter().enumerate() {
        if r == root && ends.output.same(src) {
            continue;
        }
        // SAFETY: between the two meetings the root's input is only read and each
        // output's share is written by this rank alone; the root's input is an output
        // only for the root in place, skipped above.
        unsafe {
            ends.output
                .bytes_mut(share.clone())
                .copy_from_slice(src.bytes(share.clone()));
        }
    }
}
