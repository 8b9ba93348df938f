//! Point-to-point messages: `send`/`recv` and groups of them posted at once.
//!
//! Messages between two ranks are received in the order they were sent; a
//! tag labels each one and is checked on arrival (a mismatch is an error,
//! never a silent swap). A [`Group`] posts all of its sends and receives
//! before waiting for any, like `ncclGroupStart`/`ncclGroupEnd`, so rings,
//! pipelines and halo exchanges cannot deadlock on ordering.

use std::time::Instant;

use chorus_kernels::Element;
use chorus_transport::{Request, Transport};

use super::{Communicator, Inner, Kind};
use crate::{Error, Result};

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
}

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
        let tag = |t: u32| (t as u64) << 32 | (Kind::PointToPoint as u64) << 28;
        let deadline = Instant::now() + self.config.timeout;
        let mut reqs: Vec<Request> = Vec::with_capacity(sends.len() + others.len());
        let posted = (|| -> Result<()> {
            for (peer, t, buf) in others {
                // SAFETY: `buf` is borrowed for the whole call; every request completes,
                // or the transport is aborted, before this function returns.
                reqs.push(unsafe { transport.irecv(*peer, tag(*t), buf)? });
            }
            for (peer, t, data) in &sends {
                // SAFETY: as above, for the borrowed send buffer.
                reqs.push(unsafe { transport.isend(*peer, tag(*t), data)? });
            }
            chorus_transport::wait_all(&reqs, deadline).map_err(Error::from)
        })();
        if posted.is_err() {
            transport.abort("a point-to-point exchange failed on this rank");
        }
        posted.map_err(|e| e.on_rank(rank))
    }
}
