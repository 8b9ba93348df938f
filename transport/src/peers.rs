//! What every engine does alike for its peers: the state of each link, the numbering of its
//! messages both ways, failing a peer once, and aborting everything once.
//!
//! An engine keeps its own per-peer data (sockets, rings) as `L` in a [`Peer<L>`]; the
//! rules for when a post is refused, and with which error, live here only.

use crate::{Direction, TransportError};

/// Where the link to one peer stands.
#[derive(Debug, Clone, Default)]
pub(crate) enum LinkState {
    /// Requests are posted and bytes move.
    #[default]
    Open,
    /// The peer has left: what it sent before leaving may still be taken, then the link fails.
    Leaving,
    /// Every pending and later request to the peer fails with this error.
    Failed(TransportError),
}

/// One peer of an engine: its link's state, the next message number each way, and the
/// engine's own data for it.
#[derive(Debug)]
pub(crate) struct Peer<L> {
    pub state: LinkState,
    send_seq: u64,
    recv_seq: u64,
    pub link: L,
}

impl<L> Peer<L> {
    /// Numbers the next message in `direction`.
    pub fn next_seq(&mut self, direction: Direction) -> u64 {
        let counter = match direction {
            Direction::Send => &mut self.send_seq,
            Direction::Recv => &mut self.recv_seq,
        };
        *counter += 1;
        *counter - 1
    }

    /// The number the next send posted to this peer will get.
    pub fn send_seq(&self) -> u64 {
        self.send_seq
    }

    /// The number the next receive posted for this peer will get.
    pub fn recv_seq(&self) -> u64 {
        self.recv_seq
    }

    /// Whether the peer has left (its link may still hold what it sent).
    pub fn leaving(&self) -> bool {
        matches!(self.state, LinkState::Leaving)
    }

    /// Notes that the peer has left, unless the link already failed.
    pub fn leave(&mut self) {
        if matches!(self.state, LinkState::Open) {
            self.state = LinkState::Leaving;
        }
    }

    /// Whether the link has failed.
    pub fn failed(&self) -> bool {
        matches!(self.state, LinkState::Failed(_))
    }
}

/// An engine's peers by global rank (`None`: this rank, or one the engine does not reach),
/// and the reason it was aborted, once it is.
#[derive(Debug)]
pub(crate) struct Peers<L> {
    rank: usize,
    peers: Vec<Option<Peer<L>>>,
    aborted: Option<String>,
}

impl<L> Peers<L> {
    /// The peers of `rank`, with `links[p]` the engine's data for peer `p`.
    pub fn new(rank: usize, links: Vec<Option<L>>) -> Peers<L> {
        let peers = links
            .into_iter()
            .map(|link| {
                link.map(|link| Peer {
                    state: LinkState::Open,
                    send_seq: 0,
                    recv_seq: 0,
                    link,
                })
            })
            .collect();
        Peers {
            rank,
            peers,
            aborted: None,
        }
    }

    /// The number of ranks (reached or not).
    pub fn len(&self) -> usize {
        self.peers.len()
    }

    /// Peer `peer`, if the engine reaches it.
    pub fn get(&self, peer: usize) -> Option<&Peer<L>> {
        self.peers.get(peer).and_then(Option::as_ref)
    }

    /// Peer `peer`, if the engine reaches it.
    pub fn get_mut(&mut self, peer: usize) -> Option<&mut Peer<L>> {
        self.peers.get_mut(peer).and_then(Option::as_mut)
    }

    /// Every peer the engine reaches, with its rank.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &Peer<L>)> {
        self.peers
            .iter()
            .enumerate()
            .filter_map(|(rank, p)| Some((rank, p.as_ref()?)))
    }

    /// Peer `peer` to post to or probe.
    ///
    /// Fails with `Aborted` once the engine is, `InvalidPeer` for a rank it does not reach,
    /// and the link's error once the link has failed.
    #[inline]
    pub fn usable(&mut self, peer: usize) -> Result<&mut Peer<L>, TransportError> {
        if let Some(reason) = &self.aborted {
            return Err(TransportError::Aborted(reason.clone()));
        }
        let (rank, world_size) = (self.rank, self.peers.len());
        let p = self.peers.get_mut(peer).and_then(Option::as_mut).ok_or(
            TransportError::InvalidPeer {
                peer,
                rank,
                world_size,
            },
        )?;
        match &p.state {
            LinkState::Failed(e) => Err(e.clone()),
            _ => Ok(p),
        }
    }

    /// Fails `peer`'s link with `err`, now and for every later request, unless it has already
    /// failed: `fail_requests` then fails what is queued on the link.
    pub fn fail(
        &mut self,
        peer: usize,
        err: TransportError,
        fail_requests: impl FnOnce(&mut L, &TransportError),
    ) {
        let rank = self.rank;
        let Some(p) = self.get_mut(peer) else {
            return;
        };
        if p.failed() {
            return;
        }
        tracing::debug!(rank, peer, error = %err, "peer failed");
        fail_requests(&mut p.link, &err);
        p.state = LinkState::Failed(err);
    }

    /// Fails every link with `Aborted(reason)` (through `fail_requests`, as [`fail`](Self::fail))
    /// and refuses every later post the same way; `false`, doing nothing, if already aborted.
    pub fn abort(
        &mut self,
        reason: &str,
        mut fail_requests: impl FnMut(&mut L, &TransportError),
    ) -> bool {
        if self.aborted.is_some() {
            return false;
        }
        for peer in 0..self.peers.len() {
            let err = TransportError::Aborted(reason.to_string());
            self.fail(peer, err, &mut fail_requests);
        }
        self.aborted = Some(reason.to_string());
        true
    }

    /// Why the engine was aborted, if it was.
    pub fn aborted(&self) -> Option<&str> {
        self.aborted.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three() -> Peers<Vec<&'static str>> {
        Peers::new(1, vec![Some(Vec::new()), None, Some(Vec::new())])
    }

    #[test]
    fn messages_are_numbered_each_way_apart() {
        let mut peers = three();
        let p = peers.usable(0).unwrap();
        assert_eq!(p.next_seq(Direction::Send), 0);
        assert_eq!(p.next_seq(Direction::Send), 1);
        assert_eq!(p.recv_seq(), 0);
        assert_eq!(p.next_seq(Direction::Recv), 0);
        assert_eq!(p.recv_seq(), 1);
        assert_eq!(peers.usable(2).unwrap().next_seq(Direction::Send), 0);
    }

    #[test]
    fn self_and_unknown_ranks_are_invalid() {
        let mut peers = three();
        for peer in [1, 3] {
            let err = peers.usable(peer).unwrap_err();
            assert!(
                matches!(
                    err,
                    TransportError::InvalidPeer {
                        rank: 1,
                        world_size: 3,
                        ..
                    }
                ),
                "{err}"
            );
        }
    }

    #[test]
    fn a_peer_fails_once_and_stays_failed() {
        let mut peers = three();
        peers.fail(0, TransportError::PeerClosed { peer: 0 }, |q, _| {
            q.push("failed")
        });
        // A second failure neither replaces the first nor fails the requests again.
        peers.fail(0, TransportError::Aborted("later".into()), |q, _| {
            q.push("again")
        });
        assert_eq!(peers.get(0).unwrap().link, vec!["failed"]);
        assert!(matches!(
            peers.usable(0),
            Err(TransportError::PeerClosed { peer: 0 })
        ));
        assert!(peers.usable(2).is_ok());
    }

    #[test]
    fn leaving_keeps_the_link_usable_until_it_fails() {
        let mut peers = three();
        let p = peers.usable(2).unwrap();
        p.leave();
        assert!(p.leaving());
        assert!(peers.usable(2).is_ok());
        peers.fail(2, TransportError::PeerClosed { peer: 2 }, |_, _| {});
        let p = peers.get_mut(2).unwrap();
        p.leave();
        assert!(p.failed(), "a failed link does not go back to leaving");
    }

    #[test]
    fn abort_fails_every_link_once_and_refuses_later_posts() {
        let mut peers = three();
        peers.fail(2, TransportError::PeerClosed { peer: 2 }, |_, _| {});
        assert!(peers.abort("stop", |q, e| q.push(
            if matches!(e, TransportError::Aborted(_)) {
                "aborted"
            } else {
                "other"
            }
        )));
        assert!(!peers.abort("again", |q, _| q.push("twice")));
        assert_eq!(peers.get(0).unwrap().link, vec!["aborted"]);
        assert!(peers.get(2).unwrap().link.is_empty(), "already failed");
        assert_eq!(peers.aborted(), Some("stop"));
        for peer in [0, 1, 2] {
            assert!(matches!(
                peers.usable(peer),
                Err(TransportError::Aborted(ref why)) if why == "stop"
            ));
        }
    }
}
