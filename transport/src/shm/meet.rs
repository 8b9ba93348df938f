//! Meetings: the local ranks wait for one another through words in the
//! shared region, with no message, so calls on shared buffers (see
//! [`Window`](super::Window)) can hand over whole buffers at once.
//!
//! Each rank writes the call it is in (a [`CallPlace`]) and bumps its epoch,
//! in one of two turns (cache lines) that alternate between meetings; a
//! meeting is over for a rank once every local rank's turn for it has reached
//! its epoch. Waiters spin briefly, then sleep on the missing peer's epoch (a
//! futex), waking at least every millisecond to notice an abort, a peer that
//! closed its transport or a peer process that exited.

use std::sync::atomic::fence;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::time::{Duration, Instant};

use super::region::{Meeting, Turn, MAILBOX_BYTES};
use super::wake;
use super::ShmTransport;
use crate::{LinkCost, TransportError};

/// Polls of a missing peer before a waiter starts to sleep.
const SPINS: u32 = 2000;
/// Longest sleep between checks for an abort or a dead peer.
const NAP: Duration = Duration::from_millis(1);
/// Local ranks whose posted bytes [`ShmTransport::meet_posted`] gathers without allocating.
const ON_STACK: usize = 8;
/// Words of a turn that carry a small call's posted bytes in place of window words.
const INLINE_WORDS: usize = 4;
/// Posted bytes that travel in the turn itself, on the line a peer polls for the rank's
/// arrival, rather than in a mailbox, a second line fetched after it.
const INLINE_BYTES: usize = 8 * INLINE_WORDS;

/// Bytes a rank posted for its next meeting ([`ShmTransport::post`]): how many, for which
/// meeting (its epoch), and where.
#[must_use = "posted bytes are read by meet_posted"]
#[derive(Debug)]
pub struct Posted {
    len: usize,
    meeting: u32,
    at: PostedAt,
}

/// Where a rank's posted bytes wait for its next meeting.
#[derive(Debug)]
enum PostedAt {
    /// In its mailbox of the meeting's parity.
    Mailbox,
    /// In its turn's window words, written when it arrives.
    Turn([u64; INLINE_WORDS]),
}

/// When a meeting counts as stalled, and whom to tell (each meeting that
/// outlasts `at` calls `tell` once; the meeting goes on waiting).
#[derive(Clone, Copy)]
pub struct Stall<'a> {
    /// From when waiting is a stall.
    pub at: Instant,
    /// Told of the stall.
    pub tell: &'a dyn Fn(),
}

/// The call a rank is in and where its buffers lie, as its local peers see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CallPlace {
    /// The call's tag (its sequence number and fingerprint).
    pub tag: u64,
    /// Whether the rank meets its peers in this call (false: it moves the call's bytes as messages).
    pub meets: bool,
    /// The call's length in bytes.
    pub len: usize,
    /// The call's root rank (0 where it has none).
    pub root: usize,
    /// The input's window id and byte offset in the rank's segment (`None`: not in a window).
    pub input: Option<(u64, usize)>,
    /// The output's window id and byte offset (`None`: not in a window).
    pub output: Option<(u64, usize)>,
}

impl CallPlace {
    /// The top bit of the root's word: whether the rank meets.
    const MEETS: u64 = 1 << 63;
    /// The next bit: the window words carry posted bytes instead (no window).
    const INLINE: u64 = 1 << 62;

    fn words(&self) -> [u64; 7] {
        let (iw, io) = self.input.map_or((0, 0), |(w, o)| (w + 1, o as u64));
        let (ow, oo) = self.output.map_or((0, 0), |(w, o)| (w + 1, o as u64));
        let meets = if self.meets { Self::MEETS } else { 0 };
        let (len, root) = (self.len as u64, self.root as u64 | meets);
        [self.tag, len, root, iw, io, ow, oo]
    }

    /// The words in `turn`; `None` while the rank is rewriting them.
    ///
    /// The tag is cleared first and written last, and read before and after
    /// the rest (a sequence lock), so a torn mix of two calls is never seen.
    fn read(turn: &Turn<'_>) -> Option<CallPlace> {
        let words = turn.call;
        let tag = words[0].load(Acquire);
        let w: [u64; 7] = std::array::from_fn(|i| words[i].load(Relaxed));
        fence(Acquire);
        if tag == 0 || words[0].load(Relaxed) != tag {
            return None;
        }
        let inline = w[2] & Self::INLINE != 0;
        let place = |id: u64, off: u64| (id > 0 && !inline).then(|| (id - 1, off as usize));
        Some(CallPlace {
            tag,
            meets: w[2] & Self::MEETS != 0,
            len: w[1] as usize,
            root: (w[2] & !(Self::MEETS | Self::INLINE)) as usize,
            input: place(w[3], w[4]),
            output: place(w[5], w[6]),
        })
    }

    /// Writes the words in `turn` (see [`read`](Self::read)), with `inline` posted bytes in
    /// the window words (the call then has no windows).
    fn write(&self, turn: &Turn<'_>, inline: Option<&[u64; INLINE_WORDS]>) {
        let words = turn.call;
        let mut values = self.words();
        if let Some(inline) = inline {
            values[2] |= Self::INLINE;
            values[3..].copy_from_slice(inline);
        }
        words[0].store(0, Relaxed);
        fence(Release);
        for (word, &value) in words.iter().zip(&values).skip(1) {
            word.store(value, Relaxed);
        }
        words[0].store(values[0], Release);
    }

    fn describe(&self) -> String {
        format!(
            "#{} (tag {:#x}, {} bytes, root {})",
            self.tag >> 32,
            self.tag,
            self.len,
            self.root
        )
    }

    /// Whether `other` is this very call (same tag, length and root).
    pub fn same_call(&self, other: &CallPlace) -> bool {
        (self.tag, self.len, self.root) == (other.tag, other.len, other.root)
    }
}

impl ShmTransport {
    /// What a call through meetings costs, for the tuner: `latency` per meeting of every
    /// local rank (no message: words in the mapping), `bandwidth` of the copies and
    /// reductions each rank then runs through the mapping.
    pub const MEETING_COST: LinkCost = LinkCost {
        latency: 0.5e-6,
        bandwidth: 5e9,
    };

    /// Global ranks of this host, by local rank.
    pub fn local_ranks(&self) -> &[usize] {
        &self.local
    }

    /// Tells the local peers which call this rank is in, without meeting them
    /// (a call that moves its bytes as messages), so a peer waiting to meet
    /// in the same call learns that this rank is not coming.
    pub fn announce(&self, place: &CallPlace) {
        let own = self.shared.region().meeting(self.own_local);
        // In the turn of the meeting it would be at next, where waiting peers look.
        place.write(own.turn(own.epoch().wrapping_add(1)), None);
    }

    /// Arrives at the next meeting in the call `place`, then waits until every
    /// local rank has arrived.
    ///
    /// Fails naming the peer if a peer announced the same call without
    /// meeting, closed its transport, or exited; with `Aborted` if this
    /// transport was aborted; with `Timeout` naming a missing peer at `deadline`.
    /// A wait past `stall.at` is reported to `stall.tell`, once.
    pub fn meet(
        &self,
        place: &CallPlace,
        deadline: Instant,
        stall: Option<Stall<'_>>,
    ) -> Result<(), TransportError> {
        self.meet_carrying(place, None, deadline, stall)
    }

    /// [`meet`](Self::meet), with `inline` posted bytes in the turn this rank arrives in.
    fn meet_carrying(
        &self,
        place: &CallPlace,
        inline: Option<&[u64; INLINE_WORDS]>,
        deadline: Instant,
        stall: Option<Stall<'_>>,
    ) -> Result<(), TransportError> {
        let (target, before) = self.arrive(place, inline);
        let met = self.await_peers(place, target, deadline, stall);
        if met.is_err() {
            self.withdraw(target, before);
        }
        met
    }

    /// Writes this rank's arrival at its next meeting, in the call `place`, with `inline`
    /// posted bytes; returns the meeting (its epoch) and the epoch its turn held before.
    fn arrive(&self, place: &CallPlace, inline: Option<&[u64; INLINE_WORDS]>) -> (u32, u32) {
        let own = self.shared.region().meeting(self.own_local);
        let target = own.epoch().wrapping_add(1);
        let turn = own.turn(target);
        let before = turn.epoch.load(Relaxed);
        place.write(turn, inline);
        self.set_epoch(turn, target);
        (target, before)
    }

    /// Takes back this rank's arrival at meeting `target`, whose turn held `before`: it failed
    /// there (aborted, timed out, or a peer will not come), so a peer that comes later waits
    /// and learns why rather than completing the call with a rank that gave up on it. A peer
    /// that saw the arrival first has met.
    fn withdraw(&self, target: u32, before: u32) {
        let own = self.shared.region().meeting(self.own_local);
        self.set_epoch(own.turn(target), before);
    }

    /// Stores `epoch` in this rank's `turn` and wakes the peers sleeping on it.
    fn set_epoch(&self, turn: &Turn<'_>, epoch: u32) {
        turn.epoch.store(epoch, SeqCst);
        if self
            .shared
            .region()
            .meeting(self.own_local)
            .sleepers
            .load(SeqCst)
            > 0
        {
            wake::futex_wake(turn.epoch);
        }
    }

    /// Waits until every local rank has arrived at meeting `target` of the call `place`, as
    /// [`meet`](Self::meet) describes.
    fn await_peers(
        &self,
        place: &CallPlace,
        target: u32,
        deadline: Instant,
        stall: Option<Stall<'_>>,
    ) -> Result<(), TransportError> {
        let region = self.shared.region();
        let mut polls = 0u32;
        let mut started = None; // from the first slow look: a fast meeting reads no clock
        let mut stall = stall;
        for (local, &peer) in self.local.iter().enumerate() {
            let theirs = region.meeting(local);
            let arrived = theirs.turn(target).epoch;
            while !reached(arrived.load(Acquire), target) {
                polls += 1;
                if polls < SPINS {
                    std::hint::spin_loop();
                    if self.shared.crowded() {
                        std::thread::yield_now();
                    }
                    continue;
                }
                self.check_peer(local, peer, place, target)?;
                let now = Instant::now();
                let started = *started.get_or_insert(now);
                if let Some(s) = stall.filter(|s| now >= s.at) {
                    (s.tell)();
                    stall = None;
                }
                if now >= deadline {
                    return Err(TransportError::Timeout {
                        peer,
                        op: "meeting",
                        len: 0,
                        waited: now - started,
                    });
                }
                // Counted as a sleeper before looking (pairs with the arriving rank's
                // store then load): either it sees this sleeper or this sees its epoch.
                theirs.sleepers.fetch_add(1, SeqCst);
                let seen = arrived.load(SeqCst);
                if !reached(seen, target) {
                    wake::futex_wait(arrived, seen, NAP.min(deadline - now));
                }
                theirs.sleepers.fetch_sub(1, SeqCst);
            }
        }
        Ok(())
    }

    /// Where every local rank's buffers lie (by local rank), as they said for
    /// the meeting this rank last passed. They stay until this rank meets again.
    ///
    /// Fails naming the first rank whose words are not this call's.
    pub fn places(&self, mine: &CallPlace) -> Result<Vec<CallPlace>, TransportError> {
        let mut places = Vec::with_capacity(self.local.len());
        self.visit_places(mine, |place| places.push(place))?;
        Ok(places)
    }

    /// Checks that every local rank met in `mine`'s call, as [`places`](Self::places)
    /// does, without collecting where their buffers lie.
    pub fn check_places(&self, mine: &CallPlace) -> Result<(), TransportError> {
        self.visit_places(mine, |_| ())
    }

    /// Hands `each` every local rank's words for the meeting this rank last passed, by
    /// local rank; fails naming the first rank whose words are not `mine`'s call.
    fn visit_places(
        &self,
        mine: &CallPlace,
        mut each: impl FnMut(CallPlace),
    ) -> Result<(), TransportError> {
        let region = self.shared.region();
        let epoch = region.meeting(self.own_local).epoch();
        for (local, &peer) in self.local.iter().enumerate() {
            match CallPlace::read(region.meeting(local).turn(epoch)) {
                Some(place) if place.same_call(mine) => each(place),
                other => {
                    return Err(TransportError::Protocol {
                        peer,
                        detail: format!(
                            "rank {peer} met in call {}, this rank in {}",
                            other.map_or("(unreadable)".into(), |p| p.describe()),
                            mine.describe()
                        ),
                    })
                }
            }
        }
        Ok(())
    }

    /// Posts `data` (at most [`MAILBOX_BYTES`] bytes) in this rank's mailbox for its next
    /// meeting, which [`meet_posted`](Self::meet_posted) holds. `data` is copied before this
    /// returns, so it may be the memory the call then writes its result to.
    ///
    /// Panics if `data` does not fit a mailbox.
    pub fn post(&self, data: &[u8]) -> Posted {
        assert!(
            data.len() <= MAILBOX_BYTES,
            "{} bytes do not fit a mailbox",
            data.len()
        );
        let len = data.len();
        let region = self.shared.region();
        let meeting = region.meeting(self.own_local).epoch().wrapping_add(1);
        // Every rank of the call decides alike: the same length, the same local ranks.
        if len <= INLINE_BYTES && self.local.len() <= ON_STACK {
            let mut bytes = [0u8; INLINE_BYTES];
            bytes[..len].copy_from_slice(data);
            let words = std::array::from_fn(|i| {
                u64::from_ne_bytes(bytes[8 * i..8 * i + 8].try_into().expect("8 bytes"))
            });
            return Posted {
                len,
                meeting,
                at: PostedAt::Turn(words),
            };
        }
        // SAFETY: the mailbox holds MAILBOX_BYTES >= data.len(); no peer reads it until the
        // next meeting, which orders this write before their reads (release/acquire).
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                region.mailbox(self.own_local, mailbox_of(meeting)),
                data.len(),
            );
        }
        Posted {
            len,
            meeting,
            at: PostedAt::Mailbox,
        }
    }

    /// Meets as [`meet`](Self::meet) does, with the bytes this rank `posted` for this meeting,
    /// and hands `read` every local rank's posted bytes (by local rank, each as long as this
    /// rank's).
    ///
    /// Panics if `posted` is not for this rank's next meeting (a meeting came between).
    pub fn meet_posted<R>(
        &self,
        posted: Posted,
        place: &CallPlace,
        deadline: Instant,
        stall: Option<Stall<'_>>,
        read: impl FnOnce(&[&[u8]]) -> R,
    ) -> Result<R, TransportError> {
        let Posted { len, meeting, at } = posted;
        let next = self
            .shared
            .region()
            .meeting(self.own_local)
            .epoch()
            .wrapping_add(1);
        // Peers write the mailboxes of this meeting's parity again only two meetings on,
        // which needs this rank: reading them after any other meeting could race.
        assert_eq!(
            meeting, next,
            "bytes posted for meeting {meeting} are read by that meeting, the rank's next"
        );
        let inline = match &at {
            PostedAt::Turn(words) => Some(words),
            PostedAt::Mailbox => None,
        };
        self.meet_carrying(place, inline, deadline, stall)?;
        self.check_places(place)?;
        Ok(match at {
            PostedAt::Turn(_) => self.read_turns(len, read),
            PostedAt::Mailbox => self.read_mailboxes(mailbox_of(meeting), len, read),
        })
    }

    /// Hands `read` the `len` bytes every local rank posted in its mailbox `which` for the
    /// meeting this rank last passed.
    fn read_mailboxes<R>(&self, which: usize, len: usize, read: impl FnOnce(&[&[u8]]) -> R) -> R {
        let region = self.shared.region();
        // SAFETY: in bounds (`len <= MAILBOX_BYTES`); every rank posted as many bytes before
        // the meeting (they run the same call: tags checked) and rewrites this mailbox only
        // after meeting again, which needs this rank, still inside `read`.
        let mailbox = |l: usize| unsafe {
            std::slice::from_raw_parts(region.mailbox(l, which).cast_const(), len)
        };
        // A small call's whole cost is a few hundred nanoseconds: no allocation for the
        // usual few local ranks.
        let n = self.local.len();
        if n <= ON_STACK {
            let all: [&[u8]; ON_STACK] =
                std::array::from_fn(|l| if l < n { mailbox(l) } else { &[] });
            read(&all[..n])
        } else {
            read(&(0..n).map(mailbox).collect::<Vec<_>>())
        }
    }

    /// Hands `read` the `len` bytes every local rank posted in its turn of the meeting this
    /// rank last passed (at most [`ON_STACK`] ranks).
    fn read_turns<R>(&self, len: usize, read: impl FnOnce(&[&[u8]]) -> R) -> R {
        let region = self.shared.region();
        let epoch = region.meeting(self.own_local).epoch();
        let n = self.local.len();
        // Each rank wrote its words before the epoch this rank saw (release/acquire), and
        // rewrites this turn only two meetings on, which needs this rank.
        let bytes: [[u8; INLINE_BYTES]; ON_STACK] = std::array::from_fn(|l| {
            let mut bytes = [0u8; INLINE_BYTES];
            if l < n {
                let words = &region.meeting(l).turn(epoch).call[3..];
                for (chunk, word) in bytes.chunks_exact_mut(8).zip(words) {
                    chunk.copy_from_slice(&word.load(Relaxed).to_ne_bytes());
                }
            }
            bytes
        });
        let all: [&[u8]; ON_STACK] = std::array::from_fn(|l| &bytes[l][..len]);
        read(&all[..n])
    }

    /// Fails if this rank aborted, or if `peer` (local rank `local`) will not
    /// come to meeting `target`, of the call `place`.
    fn check_peer(
        &self,
        local: usize,
        peer: usize,
        place: &CallPlace,
        target: u32,
    ) -> Result<(), TransportError> {
        let engine = self.shared.lock();
        if let Some(reason) = engine.aborted() {
            return Err(TransportError::Aborted(reason.to_string()));
        }
        let region = self.shared.region();
        let theirs = region.meeting(local);
        let turn = theirs.turn(target);
        if region.control(local).closed.load(Acquire) != 0 || engine.peer_exited(peer) {
            // Its epoch read after its leaving: a peer that arrived, then finished the call
            // and left before this rank looked again, has met.
            return match reached(turn.epoch.load(Acquire), target) {
                true => Ok(()),
                false => Err(TransportError::PeerClosed { peer }),
            };
        }
        let Some(said) = CallPlace::read(turn) else {
            return Ok(()); // being rewritten: look again later
        };
        let behind = !reached(turn.epoch.load(Acquire), target);
        let seq = |tag: u64| (tag >> 32) as u32;
        // Behind in meetings yet on a later call: it ran this one without meeting.
        if behind && (seq(said.tag).wrapping_sub(seq(place.tag)) as i32) > 0 {
            return Err(TransportError::Protocol {
                peer,
                detail: format!(
                    "rank {peer} is already at call {} without meeting in {}",
                    said.describe(),
                    place.describe()
                ),
            });
        }
        let same_seq = seq(said.tag) == seq(place.tag);
        if behind && same_seq && !said.same_call(place) {
            return Err(TransportError::Protocol {
                peer,
                detail: format!(
                    "rank {peer} is in call {}, this rank in {}",
                    said.describe(),
                    place.describe()
                ),
            });
        }
        if behind && said.same_call(place) && !said.meets {
            return Err(TransportError::Protocol {
                peer,
                detail: format!(
                    "rank {peer} runs this call (tag {:#x}) on buffers outside shared memory, \
                     this rank on shared buffers (allocate them on every rank, or on none)",
                    place.tag
                ),
            });
        }
        Ok(())
    }
}

/// The mailbox (0 or 1) that holds bytes posted for meeting `meeting`: they alternate, so a
/// peer reads one until it meets again, and this rank cannot reach the meeting after that
/// one without it.
fn mailbox_of(meeting: u32) -> usize {
    meeting as usize % 2
}

/// Whether a rank whose epoch is `epoch` has arrived at meeting `target`: its epoch is not
/// behind it (a wrapping comparison).
fn reached(epoch: u32, target: u32) -> bool {
    (epoch.wrapping_sub(target) as i32) >= 0
}

impl<'a> Meeting<'a> {
    /// The last meeting the rank reached: the later of its two turns' (read by the rank itself).
    fn epoch(&self) -> u32 {
        let [even, odd] = self.turns.map(|t| t.epoch.load(Relaxed));
        if reached(even, odd) {
            even
        } else {
            odd
        }
    }

    /// The turn that holds meeting `epoch`.
    fn turn(&self, epoch: u32) -> &Turn<'a> {
        &self.turns[epoch as usize % 2]
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::super::tests::{deadline, pair};
    use super::CallPlace;
    use crate::{Transport, TransportError};

    #[test]
    fn a_peer_that_arrived_and_then_left_has_met() {
        let t = pair(2);
        let place = CallPlace {
            tag: 3 << 32,
            meets: true,
            ..CallPlace::default()
        };
        let epoch = |local: usize| t[0].shared.region().meeting(local).epoch();
        let target = epoch(0).wrapping_add(1);
        // Rank 1 arrives, then leaves: as a rank does that met (rank 0 arrived just after
        // rank 0's last look) and finished the call.
        assert_eq!(t[1].arrive(&place, None).0, target);
        t[1].abort("finished and left");
        // Rank 0 looks at rank 1 only now, as when its last poll came just before the arrival.
        t[0].check_peer(1, 1, &place, target).unwrap();
        // A peer that left without arriving has not.
        let err = t[0]
            .check_peer(1, 1, &place, target.wrapping_add(1))
            .unwrap_err();
        assert!(
            matches!(err, TransportError::PeerClosed { peer: 1 }),
            "{err}"
        );
    }

    #[test]
    fn a_rank_whose_meeting_failed_has_not_met() {
        let t = pair(2);
        let place = CallPlace {
            tag: 5 << 32,
            meets: true,
            ..CallPlace::default()
        };
        let soon = || Instant::now() + Duration::from_millis(50);
        // Rank 1 arrives, waits for rank 0 in vain and gives up.
        let err = t[1].meet(&place, soon(), None).unwrap_err();
        assert!(
            matches!(err, TransportError::Timeout { peer: 0, .. }),
            "{err}"
        );
        // Rank 0 comes later and does not find it there.
        let err = t[0].meet(&place, soon(), None).unwrap_err();
        assert!(
            matches!(err, TransportError::Timeout { peer: 1, .. }),
            "{err}"
        );
        // Once rank 1 has left, rank 0 names it.
        t[1].abort("gave up");
        let err = t[0].meet(&place, deadline(), None).unwrap_err();
        assert!(
            matches!(err, TransportError::PeerClosed { peer: 1 }),
            "{err}"
        );
    }
}
