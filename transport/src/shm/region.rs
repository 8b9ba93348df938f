//! The shared mapping and its layout: a header, one control block per local
//! rank, and one ring of chunk slots per ordered pair of local ranks.
//!
//! ```text
//! 0            header: magic, local ranks, slots per ring, slot bytes
//! 4096         control block of local rank i (512 bytes each):
//!                doorbell (futex word), sleeping flag, closed flag,
//!                two meeting turns, a cache line each (the last meeting
//!                of its parity the rank reached, a futex word, and the
//!                call it met in), meeting sleepers
//! mailboxes    two mailboxes of local rank i (MAILBOX_BYTES each): bytes
//!                it posts with a meeting, read by its peers until the next
//! rings        ring (from, to) at rings + (from * locals + to) * ring_bytes:
//!                tail (written by the sender, own 128-byte line)
//!                head (written by the receiver, own 128-byte line)
//!                slots: 64-byte header + slot_bytes of payload each
//!                (seq, tag, message length, chunk length, sender address,
//!                and for a single copy the receiver's address and two
//!                piece counters shared by the two sides)
//! ```
//!
//! Counters and slot headers are atomics, so what a peer writes is never a
//! data race on this side; payload bytes are plain memory handed over by the
//! tail (release) and head (release) counters.

use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicU32, AtomicU64};

use memmap2::MmapRaw;

/// Identifies a Chorus mapping and its layout version.
const MAGIC: u64 = u64::from_le_bytes(*b"CHRSHM06");
/// Bytes before the first control block.
const HEADER_BYTES: usize = 4096;
/// Bytes per control block.
const CONTROL_BYTES: usize = 512;
/// Distance between the counters of a ring, so that producer and consumer
/// never share a cache line (nor its prefetch pair).
const LINE: usize = 128;
/// Bytes a rank can post with a meeting (see `Region::mailbox`).
pub const MAILBOX_BYTES: usize = 4096;
/// Bytes of a slot's header.
pub(crate) const SLOT_HEADER: usize = 64;

/// The shape of a mapping; every local rank must agree on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Ranks sharing the mapping.
    pub locals: usize,
    /// Slots per ring.
    pub slots: usize,
    /// Payload bytes per slot (a multiple of 64).
    pub slot_bytes: usize,
}

impl Layout {
    fn ring_bytes(&self) -> usize {
        2 * LINE + self.slots * (SLOT_HEADER + self.slot_bytes)
    }

    fn mailboxes_at(&self) -> usize {
        HEADER_BYTES + self.locals * CONTROL_BYTES
    }

    fn rings_at(&self) -> usize {
        self.mailboxes_at() + self.locals * 2 * MAILBOX_BYTES
    }

    /// Total size of the mapping in bytes.
    pub fn total_bytes(&self) -> usize {
        self.rings_at() + self.locals * self.locals * self.ring_bytes()
    }
}

/// A mapped region of shared memory with the layout above.
#[derive(Debug)]
pub(crate) struct Region {
    map: MmapRaw,
    layout: Layout,
}

impl Region {
    /// Wraps a fresh, zero-filled mapping and writes the header.
    pub fn init(map: MmapRaw, layout: Layout) -> Region {
        let region = Region { map, layout };
        let words = [layout.locals, layout.slots, layout.slot_bytes];
        for (i, w) in words.into_iter().enumerate() {
            region.word(8 * (i + 1)).store(w as u64, Release);
        }
        region.word(0).store(MAGIC, Release);
        region
    }

    /// Wraps a mapping another rank initialised; fails if its header differs from `layout`.
    pub fn open(map: MmapRaw, layout: Layout) -> Result<Region, String> {
        if map.len() < layout.total_bytes() {
            return Err(format!(
                "the mapping has {} bytes, expected {}",
                map.len(),
                layout.total_bytes()
            ));
        }
        let region = Region { map, layout };
        if region.word(0).load(Acquire) != MAGIC {
            return Err("not a Chorus shared-memory file (bad magic)".into());
        }
        let found = Layout {
            locals: region.word(8).load(Acquire) as usize,
            slots: region.word(16).load(Acquire) as usize,
            slot_bytes: region.word(24).load(Acquire) as usize,
        };
        if found != layout {
            return Err(format!(
                "layout {found:?} differs from this rank's {layout:?}"
            ));
        }
        Ok(region)
    }

    fn word(&self, at: usize) -> &AtomicU64 {
        &self.words::<1>(at)[0]
    }

    /// `N` consecutive words from byte `at`, checked once.
    fn words<const N: usize>(&self, at: usize) -> &[AtomicU64; N] {
        assert!(
            at % 8 == 0 && at + 8 * N <= self.map.len(),
            "words outside the map"
        );
        // SAFETY: in bounds and 8-aligned (the map is page-aligned), an array of atomics
        // laid out as `N` words in a row; the memory lives as long as `self`, and is only
        // accessed atomically here.
        unsafe { &*self.map.as_mut_ptr().add(at).cast::<[AtomicU64; N]>() }
    }

    fn word32(&self, at: usize) -> &AtomicU32 {
        assert!(
            at % 4 == 0 && at + 4 <= self.map.len(),
            "word outside the map"
        );
        // SAFETY: as in `words`, for a 4-byte word.
        unsafe { AtomicU32::from_ptr(self.map.as_mut_ptr().add(at).cast()) }
    }

    /// The control block of local rank `local`.
    pub fn control(&self, local: usize) -> Control<'_> {
        assert!(local < self.layout.locals, "local rank outside the map");
        let at = HEADER_BYTES + local * CONTROL_BYTES;
        Control {
            doorbell: self.word32(at),
            sleeping: self.word32(at + 64),
            closed: self.word32(at + 128),
        }
    }

    /// The meeting words of local rank `local` (see [`Meeting`]).
    pub fn meeting(&self, local: usize) -> Meeting<'_> {
        assert!(local < self.layout.locals, "local rank outside the map");
        let at = HEADER_BYTES + local * CONTROL_BYTES + 256;
        Meeting {
            turns: std::array::from_fn(|parity| {
                let line = at + 64 * parity;
                Turn {
                    epoch: self.word32(line),
                    call: self.words(line + 8),
                }
            }),
            sleepers: self.word32(at + 128),
        }
    }

    /// Mailbox `which` (0 or 1) of local rank `local`: [`MAILBOX_BYTES`] bytes.
    ///
    /// Written by its rank before a meeting, read by its peers after it;
    /// the two alternate between meetings.
    pub fn mailbox(&self, local: usize, which: usize) -> *mut u8 {
        assert!(
            local < self.layout.locals && which < 2,
            "mailbox outside the map"
        );
        let at = self.layout.mailboxes_at() + (2 * local + which) * MAILBOX_BYTES;
        // SAFETY: `at + MAILBOX_BYTES <= rings_at <= total_bytes <= map.len()`.
        unsafe { self.map.as_mut_ptr().add(at) }
    }

    /// The ring that carries messages from local rank `from` to local rank `to`.
    pub fn ring(&self, from: usize, to: usize) -> Ring {
        let l = self.layout;
        assert!(from < l.locals && to < l.locals, "ring outside the map");
        let at = l.rings_at() + (from * l.locals + to) * l.ring_bytes();
        Ring {
            // SAFETY: `at + ring_bytes <= total_bytes <= map.len()`.
            base: unsafe { self.map.as_mut_ptr().add(at) },
            slots: l.slots,
            slot_bytes: l.slot_bytes,
        }
    }
}

/// One local rank's wake-up words.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Control<'a> {
    /// Bumped (then futex-woken) to wake the rank's progress thread.
    pub doorbell: &'a AtomicU32,
    /// Non-zero while the progress thread sleeps and wants a doorbell.
    pub sleeping: &'a AtomicU32,
    /// Non-zero once the rank aborted or dropped its transport.
    pub closed: &'a AtomicU32,
}

/// One local rank's words for meeting its peers without messages (calls on
/// shared buffers): the meetings it has reached, and the calls it met in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Meeting<'a> {
    /// The turns for meetings of even epoch and of odd, so that peers still
    /// reading one meeting's call are not overwritten by the next.
    pub turns: [Turn<'a>; 2],
    /// Peers sleeping on a turn's epoch: a rank that bumps one wakes them.
    pub sleepers: &'a AtomicU32,
}

/// One cache line of a [`Meeting`]: a peer polling for the rank's arrival
/// holds the call it arrived in, with no second line to fetch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Turn<'a> {
    /// The last meeting of this parity the rank reached (a futex word, wrapping).
    pub epoch: &'a AtomicU32,
    /// The call it meets in, as the words of a [`CallPlace`](super::CallPlace).
    pub call: &'a [AtomicU64; 7],
}

/// A single-producer single-consumer ring of slots inside a [`Region`].
///
/// Holds a raw pointer: valid only while the region it came from is mapped.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ring {
    base: *mut u8,
    slots: usize,
    slot_bytes: usize,
}

/// The header in front of a slot's payload, as atomics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotHeader {
    /// The message's sequence number on this ring.
    pub seq: u64,
    /// The message's tag.
    pub tag: u64,
    /// The message's length in bytes.
    pub msg_len: u64,
    /// This chunk's payload bytes in the slot.
    pub chunk_len: u64,
    /// Non-zero: the payload is not in the slot but at this address in the
    /// sender's memory, for the receiver to read itself (single copy).
    pub addr: u64,
}

/// The shared state of a single-copy message that the receiver reads and
/// the sender, when it is free, writes at the same time: both take pieces
/// from one counter, so each piece is copied once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Split<'a> {
    /// The receiver's buffer; 0 until the receiver starts.
    pub dst: &'a AtomicU64,
    /// Pieces taken by either side so far (never past the number of pieces,
    /// except `u64::MAX` once the receiver closed the message).
    pub taken: &'a AtomicU64,
    /// Pieces settled (copied, or given up by a failed copy) in the low
    /// bits, and [`Split::SENDER_FAILED`].
    pub settled: &'a AtomicU64,
}

impl Split<'_> {
    /// Set in `settled` once the sender failed to write a piece it took.
    pub const SENDER_FAILED: u64 = 1 << 63;

    /// Takes the next of `total` pieces, if any is left.
    pub fn take(&self, total: u64) -> Option<u64> {
        self.taken
            .fetch_update(AcqRel, Acquire, |t| (t < total).then(|| t + 1))
            .ok()
    }

    /// Counts a piece as settled; `sender_failed` if it was the sender's and
    /// its write failed.
    pub fn settle(&self, sender_failed: bool) {
        if sender_failed {
            self.settled.fetch_or(Self::SENDER_FAILED, Release);
        }
        self.settled.fetch_add(1, Release);
    }

    /// Pieces settled so far, and whether the sender failed to write one.
    pub fn progress(&self) -> (u64, bool) {
        let s = self.settled.load(Acquire);
        (s & !Self::SENDER_FAILED, s & Self::SENDER_FAILED != 0)
    }

    /// Stops either side from taking more pieces; returns how many of
    /// `total` were taken.
    pub fn close(&self, total: u64) -> u64 {
        self.taken.swap(u64::MAX, AcqRel).min(total)
    }
}

impl Ring {
    fn counter(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `base` is 128-aligned inside the mapping (layout), `at` is
        // 0 or 128; the region outlives the ring (type invariant).
        unsafe { AtomicU64::from_ptr(self.base.add(at).cast()) }
    }

    /// Messages chunks published by the sender so far.
    pub fn tail(&self) -> &AtomicU64 {
        self.counter(0)
    }

    /// Chunks consumed by the receiver so far.
    pub fn head(&self) -> &AtomicU64 {
        self.counter(LINE)
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Payload bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slot(&self, index: u64) -> *mut u8 {
        let i = (index % self.slots as u64) as usize;
        // SAFETY: `i < slots`, so the slot lies inside the ring.
        unsafe {
            self.base
                .add(2 * LINE + i * (SLOT_HEADER + self.slot_bytes))
        }
    }

    fn header_words(&self, index: u64) -> [&AtomicU64; 5] {
        let slot = self.slot(index);
        // SAFETY: the header's first 40 bytes lie in the slot, 64-aligned.
        [0, 8, 16, 24, 32].map(|at| unsafe { AtomicU64::from_ptr(slot.add(at).cast()) })
    }

    /// Writes the header of slot `index` (the producer, before publishing
    /// it), clearing its split words.
    pub fn write_header(&self, index: u64, h: SlotHeader) {
        let words = self.header_words(index);
        for (w, v) in words
            .iter()
            .zip([h.seq, h.tag, h.msg_len, h.chunk_len, h.addr])
        {
            w.store(v, Relaxed);
        }
        let split = self.split(index);
        for w in [split.dst, split.taken, split.settled] {
            w.store(0, Relaxed);
        }
    }

    /// The words through which both sides copy the single-copy message in
    /// slot `index` together.
    pub fn split(&self, index: u64) -> Split<'_> {
        let slot = self.slot(index);
        // SAFETY: bytes 40..64 of the slot's header, 8-aligned; the ring
        // (and so the region) outlives the borrow.
        let [dst, taken, settled] =
            [40, 48, 56].map(|at| unsafe { AtomicU64::from_ptr(slot.add(at).cast()) });
        Split {
            dst,
            taken,
            settled,
        }
    }

    /// Reads the header of slot `index` (the consumer, after seeing it published).
    pub fn read_header(&self, index: u64) -> SlotHeader {
        let [seq, tag, msg_len, chunk_len, addr] =
            self.header_words(index).map(|w| w.load(Relaxed));
        SlotHeader {
            seq,
            tag,
            msg_len,
            chunk_len,
            addr,
        }
    }

    /// The payload of slot `index`: `slot_bytes` bytes.
    pub fn payload(&self, index: u64) -> *mut u8 {
        // SAFETY: the payload follows the header inside the slot.
        unsafe { self.slot(index).add(SLOT_HEADER) }
    }
}
