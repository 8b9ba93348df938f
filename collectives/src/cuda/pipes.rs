//! Sends and receives on device memory between ranks of one host, through CUDA IPC.
//!
//! Every rank's scratch buffer holds, past the collectives' halves, one slot per peer of
//! its host. A group's messages to one peer form one stream (ordered by tag, then as
//! given, on both sides, so messages of different tags match as the host's do), cut into
//! chunks of a slot. In each round the sender copies its next chunk into its slot for the
//! receiver and says so over the host communicator; the receiver copies the chunk from the
//! sender's slot (mapped into its process) into its buffers and says so back, which frees
//! the slot for the next round. Before the first round each pair checks that both sides
//! describe the same messages (bytes per tag); a pair that does not is left out, and both
//! of its ranks fail naming the other once the rest have run.

use std::collections::BTreeMap;

use super::gpu::{settle, Gpu};
use crate::{Communicator, Error, Result};

/// Host tags of the control messages (on the device communicator's own connections): a
/// stream's description from its sender and from its receiver, a chunk in the slot, the
/// slot free again.
const SENDER: u32 = 1;
const RECEIVER: u32 = 2;
const READY: u32 = 3;
const DONE: u32 = 4;

/// A send or a receive on device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceMessage {
    /// `bytes` bytes at device address `at` to rank `peer`, matched by its receive of `tag`.
    Send {
        /// The receiving rank.
        peer: usize,
        /// The sender's and receiver's tag.
        tag: u32,
        /// Device address of the bytes.
        at: u64,
        /// How many bytes.
        bytes: usize,
    },
    /// `bytes` bytes from rank `peer`'s send of `tag` into device address `at`.
    Recv {
        /// The sending rank.
        peer: usize,
        /// The sender's and receiver's tag.
        tag: u32,
        /// Device address the bytes land at.
        at: u64,
        /// How many bytes.
        bytes: usize,
    },
}

impl DeviceMessage {
    /// A send (`sends`) or a receive of `bytes` at `at`, to or from `peer`, of `tag`.
    pub fn new(sends: bool, peer: usize, tag: u32, (at, bytes): (u64, usize)) -> DeviceMessage {
        match sends {
            true => DeviceMessage::Send {
                peer,
                tag,
                at,
                bytes,
            },
            false => DeviceMessage::Recv {
                peer,
                tag,
                at,
                bytes,
            },
        }
    }

    /// The other rank.
    pub fn peer(&self) -> usize {
        match *self {
            DeviceMessage::Send { peer, .. } | DeviceMessage::Recv { peer, .. } => peer,
        }
    }

    /// This message with its peer renamed.
    pub(super) fn to(self, peer: usize) -> DeviceMessage {
        match self {
            DeviceMessage::Send { tag, at, bytes, .. } => {
                DeviceMessage::new(true, peer, tag, (at, bytes))
            }
            DeviceMessage::Recv { tag, at, bytes, .. } => {
                DeviceMessage::new(false, peer, tag, (at, bytes))
            }
        }
    }
}

/// One direction between this rank and a peer: its pieces (device address, bytes), in
/// stream order, and what describes them.
#[derive(Debug, Default)]
struct Stream {
    pieces: Vec<(u64, usize)>,
    total: usize,
    /// FNV-1a over every (tag, bytes) in stream order.
    digest: u64,
}

impl Stream {
    /// The stream of `messages` (one peer, one direction), sorted by tag.
    fn of(mut messages: Vec<(u32, u64, usize)>) -> Stream {
        messages.sort_by_key(|&(tag, ..)| tag);
        let mut described = Vec::new();
        for &(tag, _, bytes) in &messages {
            described.extend_from_slice(&tag.to_le_bytes());
            described.extend_from_slice(&(bytes as u64).to_le_bytes());
        }
        Stream {
            pieces: messages.iter().map(|&(_, at, bytes)| (at, bytes)).collect(),
            total: messages.iter().map(|&(.., bytes)| bytes).sum(),
            digest: crate::check::digest(&described),
        }
    }

    /// Enqueues the copies of chunk `k` (of `slot` bytes) between the stream's pieces and
    /// the slot at device address `at`: into it with `into`, else out of it.
    ///
    /// # Safety
    /// The pieces and the slot must be device memory of their lengths until the copies have
    /// run, and nothing else may touch the destination meanwhile.
    unsafe fn chunk<G: Gpu>(
        &self,
        gpu: &G,
        stream: &G::Queue,
        (k, slot): (usize, usize),
        (mut at, into): (u64, bool),
    ) -> Result<()> {
        let (from, len) = (k * slot, slot.min(self.total - k * slot));
        for (piece, bytes) in self.runs(from, len) {
            let (dst, src) = if into { (at, piece) } else { (piece, at) };
            // SAFETY: the caller's contract.
            unsafe { gpu.on_device(dst, src, bytes, stream)? };
            at += bytes as u64;
        }
        Ok(())
    }

    fn rounds(&self, slot: usize) -> usize {
        self.total.div_ceil(slot)
    }

    /// The (address, bytes) runs of bytes `from..from + len` of the stream.
    fn runs(&self, from: usize, len: usize) -> Vec<(u64, usize)> {
        let mut runs = Vec::new();
        let (mut start, end) = (0, from + len);
        for &(at, bytes) in &self.pieces {
            let (lo, hi) = (from.max(start), end.min(start + bytes));
            if lo < hi {
                runs.push((at + (lo - start) as u64, hi - lo));
            }
            start += bytes;
        }
        runs
    }
}

/// Runs `messages` (peers: ranks of `comm`, all on this host) through the slots. `slots`
/// gives, for a sender and a receiver, the sender's slot for the receiver in this process.
/// Returns once every message has landed, or fails naming the first peer whose messages
/// did not match this rank's.
pub(super) fn exchange<G: Gpu>(
    comm: &Communicator,
    gpu: &G,
    (slots, slot): (&dyn Fn(usize, usize) -> u64, usize),
    messages: &[DeviceMessage],
    stream: &G::Queue,
) -> Result<()> {
    let me = comm.rank();
    let mut outgoing: BTreeMap<usize, Vec<(u32, u64, usize)>> = BTreeMap::new();
    let mut incoming: BTreeMap<usize, Vec<(u32, u64, usize)>> = BTreeMap::new();
    for &m in messages {
        match m {
            DeviceMessage::Send {
                peer,
                tag,
                at,
                bytes,
            } => outgoing.entry(peer).or_default().push((tag, at, bytes)),
            DeviceMessage::Recv {
                peer,
                tag,
                at,
                bytes,
            } => incoming.entry(peer).or_default().push((tag, at, bytes)),
        }
    }
    let mut outgoing: BTreeMap<usize, Stream> = outgoing
        .into_iter()
        .map(|(p, m)| (p, Stream::of(m)))
        .collect();
    let mut incoming: BTreeMap<usize, Stream> = incoming
        .into_iter()
        .map(|(p, m)| (p, Stream::of(m)))
        .collect();
    let failure = agree(comm, &mut outgoing, &mut incoming)?;
    let rounds = outgoing
        .values()
        .chain(incoming.values())
        .map(|s| s.rounds(slot))
        .max()
        .unwrap_or(0);
    let mut heard = vec![0u8; incoming.len().max(outgoing.len())];
    // Each half of a round enqueues its copies and waits for them before it signals; one
    // that fails while enqueuing waits for those it enqueued before it returns.
    let copy = |chunks: &[Live<'_>], k: usize, sends: bool| {
        let ran = chunks.iter().try_for_each(|&(peer, s)| {
            let (from, to) = if sends { (me, peer) } else { (peer, me) };
            // SAFETY: the chunk lies in the caller's buffers (its promise). Sent, it goes
            // into this rank's slot for `peer`, which holds `slot` bytes and which `peer`
            // reads only after READY; received, it comes from `peer`'s slot for this rank,
            // which holds it (READY came) until DONE goes back.
            unsafe { s.chunk(gpu, stream, (k, slot), (slots(from, to), sends)) }
        });
        settle(gpu, ran, &[stream])
    };
    for k in 0..rounds {
        let (sending, receiving) = (live(&outgoing, k, slot), live(&incoming, k, slot));
        copy(&sending, k, true)?;
        signal(comm, (&sending, &receiving), READY, &mut heard)?;
        copy(&receiving, k, false)?;
        signal(comm, (&receiving, &sending), DONE, &mut heard)?;
    }
    failure.map_or(Ok(()), Err)
}

/// Sends a byte of `tag` to every peer of `to` and receives one from every peer of `from`
/// (this rank itself left out), together.
fn signal(
    comm: &Communicator,
    (to, from): (&[Live<'_>], &[Live<'_>]),
    tag: u32,
    heard: &mut [u8],
) -> Result<()> {
    let me = comm.rank();
    let others = |peers: &[Live<'_>]| -> Vec<usize> {
        peers.iter().map(|&(p, _)| p).filter(|&p| p != me).collect()
    };
    let (to, from) = (others(to), others(from));
    comm.group(|g| {
        for &peer in &to {
            g.send(&[1u8], peer, tag);
        }
        for (&peer, seen) in from.iter().zip(heard.iter_mut()) {
            g.recv(std::slice::from_mut(seen), peer, tag);
        }
    })
}

/// A stream with a chunk in the round, and its peer.
type Live<'a> = (usize, &'a Stream);

/// The streams with a chunk in round `k`.
fn live(streams: &BTreeMap<usize, Stream>, k: usize, slot: usize) -> Vec<Live<'_>> {
    let live = streams.iter().filter(|(_, s)| s.rounds(slot) > k);
    live.map(|(&p, s)| (p, s)).collect()
}

/// Exchanges each stream's description with its peer; leaves out the pairs whose sides
/// differ, and returns the error for the first. Between two ranks the descriptions go in
/// one order on both sides (the stream from the lower rank first), as the host's messages
/// between a pair match in order; a rank's streams to itself are compared here.
fn agree(
    comm: &Communicator,
    outgoing: &mut BTreeMap<usize, Stream>,
    incoming: &mut BTreeMap<usize, Stream>,
) -> Result<Option<Error>> {
    let me = comm.rank();
    let describe = |s: &Stream| [s.total as u64, s.digest];
    // (peer, whether this rank sends the stream, its description here, the peer's).
    let mut pairs: Vec<(usize, bool, [u64; 2], [u64; 2])> = Vec::new();
    for peer in outgoing
        .keys()
        .chain(incoming.keys())
        .copied()
        .collect::<std::collections::BTreeSet<_>>()
    {
        let ours = [(true, outgoing.get(&peer)), (false, incoming.get(&peer))];
        let ours = if me < peer { ours } else { [ours[1], ours[0]] };
        for (sends, stream) in ours {
            if let Some(stream) = stream {
                pairs.push((peer, sends, describe(stream), [0; 2]));
            }
        }
    }
    comm.group(|g| {
        for (peer, sends, mine, theirs) in pairs.iter_mut().filter(|p| p.0 != me) {
            let (say, hear) = if *sends {
                (SENDER, RECEIVER)
            } else {
                (RECEIVER, SENDER)
            };
            g.send(&mine[..], *peer, say);
            g.recv(&mut theirs[..], *peer, hear);
        }
    })?;
    if let (Some(out), Some(into)) = (outgoing.get(&me), incoming.get(&me)) {
        let (sent, received) = (describe(out), describe(into));
        for pair in pairs.iter_mut().filter(|p| p.0 == me) {
            pair.3 = if pair.1 { received } else { sent };
        }
    }
    let mut failure = None;
    for (peer, sends, mine, theirs) in pairs {
        if mine == theirs {
            continue;
        }
        let (streams, what, other) = match sends {
            true => (&mut *outgoing, "sends", "receives"),
            false => (&mut *incoming, "receives", "sends"),
        };
        streams.remove(&peer);
        failure.get_or_insert(Error::InvalidArgument(format!(
            "rank {me} {what} {} bytes to or from rank {peer}, which {other} {} (or the \
             tags or sizes of their messages differ)",
            mine[0], theirs[0]
        )));
    }
    Ok(failure)
}

/// Bytes of one slot of a pipe: the most a round moves between a pair.
pub(super) const SLOT_BYTES: usize = 2 << 20;

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::cuda::gpu::lazy::{Buffer, LazyGpu, Queue};
    use crate::cuda::gpu::HostBuffer;
    use crate::cuda::ipc::Peers;
    use crate::cuda::testing::on_ranks;
    use crate::cuda::tiered::Tiered;

    /// Slots of 64 bytes: a message of a few hundred takes several rounds.
    const SLOT: usize = 64;

    /// The byte rank `from` sends rank `to` at `i` of its message of `tag`.
    fn byte(from: usize, to: usize, tag: u32, i: usize) -> u8 {
        (from * 31 + to * 7 + tag as usize * 3 + i) as u8
    }

    /// The bytes of a message of `tag` between two ranks: 0 (empty) to several slots.
    fn len(from: usize, to: usize, tag: u32) -> usize {
        (from * 50 + to * 70 + tag as usize * 40) % 300
    }

    /// Every rank sends every rank (itself too) a message of tag 5 and one of tag 2, the
    /// receives posted in the other order of tags, and returns what arrived per (peer, tag).
    fn all_pairs(
        comm: &Communicator,
        eager: bool,
        run: impl FnOnce(&[DeviceMessage], &Queue) -> Result<()>,
    ) -> Vec<(usize, u32, Vec<u8>)> {
        let (me, world) = (comm.rank(), comm.world_size());
        let gpu = LazyGpu::default();
        let stream = match eager {
            true => Arc::new(Queue::eager()),
            false => gpu.queue().expect("a queue"),
        };
        let mut keep = Vec::new();
        let mut messages = Vec::new();
        let mut landed = Vec::new();
        for peer in 0..world {
            for tag in [5, 2] {
                let bytes = len(me, peer, tag);
                let mut buf = Buffer::new(bytes);
                let data: Vec<u8> = (0..bytes).map(|i| byte(me, peer, tag, i)).collect();
                // Written by work queued before the call: the call must read it after.
                buf.bytes_mut(bytes).fill(0x5A);
                let mut source = Buffer::new(bytes);
                source.bytes_mut(bytes).copy_from_slice(&data);
                // SAFETY: both hold `bytes` bytes and live until the call has ended.
                unsafe { gpu.to_device(buf.address(), source.at(0), bytes, &stream) }
                    .expect("a copy");
                messages.push(DeviceMessage::new(true, peer, tag, (buf.address(), bytes)));
                keep.push((buf, source));
            }
            for tag in [2, 5] {
                let bytes = len(peer, me, tag);
                let out = Buffer::new(bytes);
                messages.push(DeviceMessage::new(false, peer, tag, (out.address(), bytes)));
                landed.push((peer, tag, bytes, out));
            }
        }
        run(&messages, &stream).expect("the exchange");
        landed
            .into_iter()
            .map(|(peer, tag, bytes, out)| (peer, tag, out.bytes(bytes).to_vec()))
            .collect()
    }

    fn check(world: usize, got: Vec<Vec<(usize, u32, Vec<u8>)>>) {
        for (me, landed) in got.into_iter().enumerate() {
            for (peer, tag, bytes) in landed {
                let want: Vec<u8> = (0..len(peer, me, tag))
                    .map(|i| byte(peer, me, tag, i))
                    .collect();
                assert_eq!(
                    bytes, want,
                    "W={world}: rank {me} from rank {peer}, tag {tag}"
                );
            }
        }
    }

    #[test]
    fn messages_between_ranks_of_a_host_land_whole_through_the_slots() {
        for (world, eager) in [(2, false), (3, true), (4, false)] {
            let got = on_ranks(&vec![0; world], |comm, _| {
                let gpu = LazyGpu::default();
                let mut peers = Peers::sized(comm, &gpu, (256, SLOT))
                    .expect("the exchange")
                    .expect("every rank maps its peers' memory");
                let landed = all_pairs(comm, eager, |messages, stream| {
                    peers.exchange(comm, &gpu, messages, stream)
                });
                peers.close(comm);
                landed
            });
            check(world, got);
        }
    }

    #[test]
    fn the_hierarchical_path_runs_its_hosts_messages_and_hands_back_the_others() {
        let hosts = [0, 0, 1, 1, 1];
        let got = on_ranks(&hosts, |comm, layout| {
            let gpu = LazyGpu::default();
            let mut tiered = Tiered::sized(comm, &gpu, layout.clone(), Some((256, SLOT)))
                .expect("the exchange")
                .expect("every host's ranks map each other's memory");
            let me = comm.rank();
            let mut remote = Vec::new();
            let landed = all_pairs(comm, false, |messages, stream| {
                // The other hosts' messages come back: every message of this rank's host
                // has landed, so only those are checked.
                remote = tiered.exchange_local(comm, &gpu, messages.to_vec(), stream)?;
                Ok(())
            });
            assert!(remote.iter().all(|m| hosts[m.peer()] != hosts[me]));
            assert_eq!(
                remote.len(),
                4 * hosts.iter().filter(|&&h| h != hosts[me]).count()
            );
            tiered.close();
            let local = landed
                .into_iter()
                .filter(|(peer, ..)| hosts[*peer] == hosts[me]);
            local.collect::<Vec<_>>()
        });
        check(hosts.len(), got);
    }

    #[test]
    fn a_pair_whose_messages_differ_fails_by_name_and_the_others_go_on() {
        // Rank 0 sends rank 1 100 bytes, which expects 50; ranks 0 and 2 exchange 300 each
        // way.
        let results = on_ranks(&[0, 0, 0], |comm, _| {
            let gpu = LazyGpu::default();
            let mut peers = Peers::sized(comm, &gpu, (256, SLOT))
                .expect("the exchange")
                .expect("every rank maps its peers' memory");
            let (mut a, b) = (Buffer::new(300), Buffer::new(300));
            a.bytes_mut(300).fill(comm.rank() as u8 + 1);
            let message = |send: bool, peer: usize, bytes: usize, buf: &Buffer| {
                DeviceMessage::new(send, peer, 0, (buf.address(), bytes))
            };
            let messages = match comm.rank() {
                0 => vec![
                    message(true, 1, 100, &a),
                    message(true, 2, 300, &a),
                    message(false, 2, 300, &b),
                ],
                1 => vec![message(false, 0, 50, &b)],
                _ => vec![message(true, 0, 300, &a), message(false, 0, 300, &b)],
            };
            let stream = gpu.queue().expect("a queue");
            let result = peers.exchange(comm, &gpu, &messages, &stream);
            peers.close(comm);
            let refusal = result.err().map(|e| match e {
                Error::InvalidArgument(why) => why,
                other => panic!("not a refusal: {other}"),
            });
            (refusal, b.bytes(300).to_vec())
        });
        // Ranks 0 and 2 exchanged in full; rank 1 received nothing.
        assert_eq!(results[0].1, [3; 300]);
        assert_eq!(results[2].1, [1; 300]);
        assert_eq!(results[1].1, [0; 300]);
        assert!(results[2].0.is_none(), "{:?}", results[2].0);
        for (rank, other) in [(0, 1), (1, 0)] {
            let why = results[rank].0.as_ref().expect("a refusal");
            assert!(why.contains(&format!("rank {other}")), "rank {rank}: {why}");
        }
    }
}
