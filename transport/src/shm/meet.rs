//! Meetings: the local ranks wait for one another through words in the
//! shared region, with no message, so calls on shared buffers (see
//! [`Window`](super::Window)) can hand over whole buffers at once.
//!
//! Each rank writes the call it is in (a [`CallPlace`]) and bumps its epoch;
//! a meeting is over for a rank once every local rank's epoch has reached
//! its own. Waiters spin briefly, then sleep on the missing peer's epoch (a
//! futex), waking at least every millisecond to notice an abort, a peer that
//! closed its transport or a peer process that exited.

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::time::{Duration, Instant};

use super::region::Meeting;
use super::wake;
use super::ShmTransport;
use crate::TransportError;

/// Polls of a missing peer before a waiter starts to sleep.
const SPINS: u32 = 2000;
/// Longest sleep between checks for an abort or a dead peer.
const NAP: Duration = Duration::from_millis(1);

/// The call a rank is in and where its buffers lie, as its local peers see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CallPlace {
    /// The call's tag (its sequence number and fingerprint).
    pub tag: u64,
    /// The input's window id and byte offset in the rank's segment (`None`: not in a window).
    pub input: Option<(u64, usize)>,
    /// The output's window id and byte offset (`None`: not in a window).
    pub output: Option<(u64, usize)>,
}

impl CallPlace {
    fn words(&self) -> [u64; 5] {
        let (iw, io) = self.input.map_or((0, 0), |(w, o)| (w + 1, o as u64));
        let (ow, oo) = self.output.map_or((0, 0), |(w, o)| (w + 1, o as u64));
        [self.tag, iw, io, ow, oo]
    }

    fn read(meeting: &Meeting<'_>) -> CallPlace {
        let w: [u64; 5] = std::array::from_fn(|i| meeting.call[i].load(Acquire));
        let place = |id: u64, off: u64| (id > 0).then(|| (id - 1, off as usize));
        CallPlace {
            tag: w[0],
            input: place(w[1], w[2]),
            output: place(w[3], w[4]),
        }
    }

    fn write(&self, meeting: &Meeting<'_>) {
        for (word, value) in meeting.call.iter().zip(self.words()) {
            word.store(value, Release);
        }
    }
}

impl ShmTransport {
    /// Global ranks of this host, by local rank.
    pub fn local_ranks(&self) -> &[usize] {
        &self.local
    }

    /// Tells the local peers which call this rank is in, without meeting them
    /// (a call that moves its bytes as messages), so a peer waiting to meet
    /// in the same call learns that this rank is not coming.
    pub fn announce(&self, place: &CallPlace) {
        place.write(&self.shared.region().meeting(self.own_local));
    }

    /// Arrives at the next meeting in the call `place`, then waits until every
    /// local rank has arrived.
    ///
    /// Fails naming the peer if a peer announced the same call without
    /// meeting, closed its transport, or exited; with `Aborted` if this
    /// transport was aborted; with `Timeout` naming a missing peer at `deadline`.
    pub fn meet(&self, place: &CallPlace, deadline: Instant) -> Result<(), TransportError> {
        let region = self.shared.region();
        let own = region.meeting(self.own_local);
        place.write(&own);
        let target = own.epoch.load(Relaxed).wrapping_add(1);
        own.epoch.store(target, SeqCst);
        if own.sleepers.load(SeqCst) > 0 {
            wake::futex_wake(own.epoch);
        }
        let started = Instant::now();
        let mut polls = 0u32;
        for (local, &peer) in self.local.iter().enumerate() {
            let theirs = region.meeting(local);
            // Wrapping comparison: arrived once its epoch is not behind ours.
            let arrived = || (theirs.epoch.load(Acquire).wrapping_sub(target) as i32) >= 0;
            while !arrived() {
                polls += 1;
                if polls < SPINS {
                    std::hint::spin_loop();
                    if self.shared.crowded() {
                        std::thread::yield_now();
                    }
                    continue;
                }
                self.check_peer(local, peer, place)?;
                let now = Instant::now();
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
                let seen = theirs.epoch.load(SeqCst);
                if (seen.wrapping_sub(target) as i32) < 0 {
                    wake::futex_wait(theirs.epoch, seen, NAP.min(deadline - now));
                }
                theirs.sleepers.fetch_sub(1, SeqCst);
            }
        }
        Ok(())
    }

    /// Where every local rank's buffers lie (by local rank), as they last said.
    ///
    /// Read right after the first meeting of a call: no rank can have moved
    /// on to the next call before this one meets them again.
    pub fn places(&self) -> Vec<CallPlace> {
        let region = self.shared.region();
        (0..self.local.len())
            .map(|local| CallPlace::read(&region.meeting(local)))
            .collect()
    }

    /// Fails if this rank aborted, or if `peer` (local rank `local`) will not
    /// come to the meeting of the call `place`.
    fn check_peer(
        &self,
        local: usize,
        peer: usize,
        place: &CallPlace,
    ) -> Result<(), TransportError> {
        let engine = self.shared.lock();
        if let Some(reason) = engine.aborted() {
            return Err(TransportError::Aborted(reason.to_string()));
        }
        let region = self.shared.region();
        if region.control(local).closed.load(Acquire) != 0 || engine.peer_exited(peer) {
            return Err(TransportError::PeerClosed { peer });
        }
        let theirs = CallPlace::read(&region.meeting(local));
        if theirs.tag == place.tag && theirs.output.is_none() {
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
