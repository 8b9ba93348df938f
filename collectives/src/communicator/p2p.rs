//! Point-to-point messages: `send`/`recv` and groups of them posted at once.
//!
//! Messages between two ranks are received in the order they were sent; a
//! tag labels each one and is checked on arrival (a mismatch is an error,
//! never a silent swap). A [`Group`] posts all of its sends and receives
//! before waiting for any, like `ncclGroupStart`/`ncclGroupEnd`, so rings,
//! pipelines and halo exchanges cannot deadlock on ordering.
//! [`Communicator::recv_any`] takes the first message with its tag from whichever rank
//! sends one.

use std::time::{Duration, Instant};

use chorus_kernels::Element;
use chorus_transport::{Request, Transport, TransportError};

use super::faults::ranks;
use super::{CallKind, Communicator, Inner, Work};
use crate::{Cause, Error, Fault, Result};

/// Rounds over the peers `recv_any` makes back to back, yielding the core between them,
/// before it starts to sleep.
const ANY_SPINS: u32 = 64;
/// The first sleep between `recv_any`'s rounds; each later one doubles, up to [`ANY_NAP_MAX`].
const ANY_NAP_MIN: Duration = Duration::from_micros(50);
/// The longest sleep between `recv_any`'s rounds, and so the most it adds to a message's latency.
const ANY_NAP_MAX: Duration = Duration::from_millis(1);

/// Sends and receives to be posted together; see [`Communicator::group`].
#[derive(Debug, Default)]
pub struct Group<'a> {
    sends: Vec<(usize, u32, &'a [u8])>,
    recvs: Vec<(usize, u32, &'a mut [u8])>,
}

impl<'a> Group<'a> {
    /// Adds a send of `data` to `peer`, labelled `tag`.
    pub fn send<T: Element>(&mut self, data: &'a [T], peer: usize, tag: u32) {
        self.sends.push((peer, tag, bytemuck::cast_slice(data)));
    }

    /// Adds a receive of exactly `buf.len()` elements from `peer`, labelled `tag`.
    pub fn recv<T: Element>(&mut self, buf: &'a mut [T], peer: usize, tag: u32) {
        self.recvs.push((peer, tag, bytemuck::cast_slice_mut(buf)));
    }
}

impl Communicator {
    /// Sends `data` to `peer` and returns when it is on its way (the peer must post a matching `recv`).
    ///
    /// Fails if `peer` is not a rank, on a transport error or timeout.
    pub fn send<T: Element>(&self, data: &[T], peer: usize, tag: u32) -> Result<()> {
        self.group(|g| g.send(data, peer, tag))
    }

    /// Receives exactly `buf.len()` elements from `peer`.
    ///
    /// Fails if `peer` is not a rank, on a transport error or timeout, or if
    /// the message's tag or length differs from this call's.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize, tag: u32) -> Result<()> {
        self.group(|g| g.recv(buf, peer, tag))
    }

    /// Receives exactly `buf.len()` elements from whichever rank sends this rank a message
    /// labelled `tag`, and returns that rank (MPI's `MPI_ANY_SOURCE`, torch's `recv` without
    /// `src`).
    ///
    /// Looks at every other rank's next message in turn, without taking it, starting one rank
    /// past the previous call's sender so that no sender is starved. A rank whose next message
    /// is something else (another tag, a collective's) is passed over: that message stays for
    /// the call it belongs to. The message found is received as [`recv`](Self::recv) from its
    /// sender. Between rounds the call yields its core, then sleeps up to a millisecond. A rank
    /// that has closed its connection, with nothing left to read, is passed over too (it may
    /// have finished its part), while some other rank can still send.
    ///
    /// Fails with [`Error::InvalidArgument`] if the world has one rank; with a protocol error
    /// naming the sender and both sizes, as `recv`, if the message is not `buf.len()` elements;
    /// [`Error::Timeout`] if no rank sends such a message within the communicator's timeout
    /// (naming the ranks that have left, and what the others sent instead); and on abort, on
    /// a failed peer, or once every other rank has left.
    pub fn recv_any<T: Element>(&self, buf: &mut [T], tag: u32) -> Result<usize> {
        let buf: &mut [u8] = bytemuck::cast_slice_mut(buf);
        let ticket = self.inner.ticket();
        let mut source = 0;
        self.inner.run_with(ticket, |inner, state| {
            source = inner.recv_any(buf, tag, &mut state.any_from)?;
            Ok(())
        })?;
        Ok(source)
    }

    /// Posts every send and receive `build` adds, then waits for all of them.
    ///
    /// Messages to oneself are delivered in order to one's own receives.
    /// Fails as `send`/`recv` do; after a failure the communicator is broken.
    pub fn group<'a>(&self, build: impl FnOnce(&mut Group<'a>)) -> Result<()> {
        let mut group = Group::default();
        build(&mut group);
        let ticket = self.inner.ticket();
        self.inner
            .run_with(ticket, |inner, _| inner.exchange(group))
    }

    /// Starts the point-to-point messages of a group on owned buffers and returns at once:
    /// each send's bytes go to its rank with its tag, each receive takes exactly its
    /// buffer's length from its rank, all posted together as in [`group`](Self::group).
    ///
    /// The buffers come back from [`Work::wait`], sends first; errors surface there.
    pub fn group_async<S, R>(
        &self,
        sends: Vec<(S, usize, u32)>,
        recvs: Vec<(R, usize, u32)>,
    ) -> Work<Messages<S, R>>
    where
        S: AsRef<[u8]> + Send + 'static,
        R: AsMut<[u8]> + Send + 'static,
    {
        self.submit((sends, recvs), |inner, _, (sends, recvs)| {
            let mut group = Group::default();
            for (data, peer, tag) in sends.iter() {
                group.send(data.as_ref(), *peer, *tag);
            }
            for (buf, peer, tag) in recvs.iter_mut() {
                group.recv(buf.as_mut(), *peer, *tag);
            }
            inner.exchange(group)
        })
    }
}

/// A group's sends and receives on owned buffers, each with its peer and tag.
pub type Messages<S, R> = (Vec<(S, usize, u32)>, Vec<(R, usize, u32)>);

impl Inner {
    fn exchange(&self, group: Group<'_>) -> Result<()> {
        let Group { sends, mut recvs } = group;
        let rank = self.config.rank;
        let (to_self, sends): (Vec<_>, Vec<_>) = sends.into_iter().partition(|s| s.0 == rank);
        let mut from_self = recvs.iter_mut().filter(|r| r.0 == rank);
        for (_, tag, data) in to_self {
            let Some((_, want, buf)) = from_self.next() else {
                return Err(Error::InvalidArgument(format!(
                    "rank {rank} sends to itself without a matching receive"
                )));
            };
            if *want != tag || buf.len() != data.len() {
                return Err(Error::InvalidArgument(format!(
                    "rank {rank} sends itself {} bytes with tag {tag} but receives {} bytes with tag {want}",
                    data.len(),
                    buf.len()
                )));
            }
            buf.copy_from_slice(data);
        }
        if from_self.next().is_some() {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} receives from itself more than it sends"
            )));
        }
        let others: Vec<_> = recvs.iter_mut().filter(|r| r.0 != rank).collect();
        if sends.is_empty() && others.is_empty() {
            return Ok(());
        }
        let transport: &dyn Transport = self.transport.as_ref().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "no peer to talk to: the world has one rank, not rank {}",
                sends.first().map_or_else(|| others[0].0, |s| s.0)
            ))
        })?;
        let deadline = Instant::now() + self.config.timeout;
        let mut reqs: Vec<Request> = Vec::with_capacity(sends.len() + others.len());
        let posted = (|| -> Result<(), TransportError> {
            for (peer, t, buf) in others {
                // SAFETY: `buf` is borrowed for the whole call; every request completes,
                // or the transport is aborted, before this function returns.
                reqs.push(unsafe { transport.irecv(*peer, p2p_tag(*t), buf)? });
            }
            for (peer, t, data) in &sends {
                // SAFETY: as above, for the borrowed send buffer.
                reqs.push(unsafe { transport.isend(*peer, p2p_tag(*t), data)? });
            }
            chorus_transport::wait_all(&reqs, deadline)
        })();
        // As a collective does: explain the failure (raising the alarm) before aborting, so a
        // rank that sees this one close finds the alarm; the requests still borrow their
        // buffers until the abort.
        posted.map_err(|e| {
            let error = Error::transport(rank, e);
            let error = match &self.monitor {
                Some(monitor) => monitor.point_to_point_failed(error),
                None => error,
            };
            transport.abort(&format!(
                "a point-to-point exchange failed on this rank: {error}"
            ));
            error
        })
    }
}

impl Inner {
    /// `recv_any`'s body: finds a rank whose next message carries `tag`, starting at the
    /// offset `from` past this rank (and leaving it one past the sender), and receives it.
    fn recv_any(&self, buf: &mut [u8], tag: u32, from: &mut usize) -> Result<usize> {
        let (rank, world) = (self.config.rank, self.config.world_size);
        let Some(transport) = self.transport.as_ref() else {
            return Err(Error::InvalidArgument(format!(
                "recv_any on rank {rank}: the world has one rank, so no rank can send to it"
            )));
        };
        let want = p2p_tag(tag);
        let others = world - 1;
        let deadline = Instant::now() + self.config.timeout;
        // Ranks that closed their connections, and the other messages found at the front.
        let mut left: Vec<usize> = Vec::new();
        let mut instead: Vec<(usize, u64)> = Vec::new();
        let fail = |e: TransportError, why: &str| {
            transport.abort(why);
            Error::transport(rank, e)
        };
        let mut round = 0u32;
        loop {
            instead.clear();
            for k in 0..others {
                let offset = (*from + k) % others;
                let peer = (rank + 1 + offset) % world;
                if left.contains(&peer) {
                    continue;
                }
                match transport.probe(peer) {
                    Ok(Some((t, len))) if t == want => {
                        *from = (offset + 1) % others;
                        if len != buf.len() {
                            let detail = format!(
                                "its message with tag {tag} is {len} bytes, but recv_any \
                                 receives {} bytes",
                                buf.len()
                            );
                            let e = TransportError::Protocol { peer, detail };
                            let why = "recv_any found a message of another length";
                            return Err(fail(e, why));
                        }
                        let recv = Group {
                            sends: Vec::new(),
                            recvs: vec![(peer, tag, buf)],
                        };
                        self.exchange(recv)?;
                        return Ok(peer);
                    }
                    Ok(Some((t, _))) => instead.push((peer, t)),
                    Ok(None) => {}
                    Err(TransportError::PeerClosed { .. }) => left.push(peer),
                    Err(e) => return Err(fail(e, "recv_any failed on this rank")),
                }
            }
            if left.len() == others {
                // Nobody is left to send: the last one's leaving is the error.
                let e = TransportError::PeerClosed {
                    peer: left[left.len() - 1],
                };
                return Err(fail(e, "recv_any found every other rank gone"));
            }
            let now = Instant::now();
            if now >= deadline {
                let detail = no_sender(rank, tag, self.config.timeout, &left, &instead);
                transport.abort("recv_any timed out");
                let fault = Fault::new(Cause::Timeout, None, self.job_rank());
                return Err(fault.saying(detail).into());
            }
            if round < ANY_SPINS {
                std::thread::yield_now();
            } else {
                let nap = ANY_NAP_MIN.saturating_mul(1 << (round - ANY_SPINS).min(5));
                std::thread::sleep(nap.min(ANY_NAP_MAX).min(deadline - now));
            }
            round = round.saturating_add(1);
        }
    }
}

/// The transport tag of point-to-point messages labelled `t`.
fn p2p_tag(t: u32) -> u64 {
    (t as u64) << 32 | (CallKind::PointToPoint as u64) << 28
}

/// The text of `recv_any`'s timeout: rank `rank` waited `timeout` for a message with `tag`;
/// the ranks in `left` had closed their connections, and those in `instead` had other
/// messages (their transport tags) at the front.
fn no_sender(
    rank: usize,
    tag: u32,
    timeout: Duration,
    left: &[usize],
    instead: &[(usize, u64)],
) -> String {
    let mut text = format!(
        "recv_any: no rank sent rank {rank} a message with tag {tag} within {:.1} s",
        timeout.as_secs_f64()
    );
    for &(peer, t) in instead {
        let what = if t & 0xFFFF_FFFF == p2p_tag(0) {
            format!("a send with tag {}", t >> 32)
        } else {
            "a collective's message".to_string()
        };
        text.push_str(&format!("; rank {peer}'s next message is {what}"));
    }
    if !left.is_empty() {
        text.push_str(&format!("; connection closed by {}", ranks(left)));
    }
    text
}
