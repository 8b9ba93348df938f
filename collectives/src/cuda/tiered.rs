//! The hierarchical path: CUDA IPC within each host, the staged path between hosts.
//!
//! A job of several hosts, some with several ranks, moves each byte across the network
//! once per host rather than once per rank, and never through host memory within a host.
//! Every call runs in rounds through the IPC path's scratch halves. A round's data (the
//! round's bytes of the buffer; for all-gather and reduce-scatter, of every rank block)
//! is cut into as many shards as the busiest host has ranks, and each shard has one owner
//! on every host (local rank `shard % ranks on the host`, so a host of fewer ranks gives
//! some of them several). A round has three stages:
//!
//! 1. Within the host: each rank copies its input into its scratch half; after a fence,
//!    each owner reduces its shard from every local rank's half into its own (or, for a
//!    broadcast, copies it from the root's; for an all-gather, copies the local ranks'
//!    blocks and zeroes the others').
//! 2. Across hosts: the owners of one shard, one per host, run the staged path on it, in
//!    place in their halves (a communicator of their own per shard): all-reduce for
//!    all-reduce and reduce-scatter, reduce or broadcast from the root's host, and for an
//!    all-gather an all-reduce with bitwise or, which leaves every block as its own host
//!    wrote it since every other host wrote zeroes there.
//! 3. Within the host again, after a fence: each rank copies the shards it needs from the
//!    owners' halves into its output.
//!
//! An average sums in both stages and each owner divides its shard by the world size.
//!
//! Rounds pipeline: stage 2 runs on a thread and a queue of its own, so while one round
//! crosses hosts, the next is staged in and reduced within the host and the one before is
//! copied out. Each round uses the other half of the scratch buffers than the round before;
//! a third fence, after a round's stage 3, keeps the round after next from writing a half
//! that a peer still reads. A call is cut into several rounds (of at least
//! [`LEAST_ROUND_BYTES`] each) so that a large one overlaps its stages.
//!
//! An all-to-all has no owners: after the first fence each rank copies the blocks its
//! host's ranks staged for it from their halves, and exchanges the blocks for and from
//! other hosts through page-locked buffers and the host all-to-all (nothing for its own
//! host's ranks), in rounds the size of those buffers.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus_kernels::{DType, ReduceOp};

use super::gpu::{settle, Gpu, HostBuffer};
use super::ipc::{self, reduce_into, Peers};
use super::pipes::DeviceMessage;
use super::staged::{Staging, STAGE_BYTES};
use super::{agree, slice, DeviceCall, Job};
use crate::{Communicator, Error, Result};

/// The least data a round of a call moves when the call is cut into several so that its
/// stages overlap.
const LEAST_ROUND_BYTES: usize = 4 << 20;
/// Rounds a call is cut into where its size allows (at least `LEAST_ROUND_BYTES` each).
const PIPELINE_ROUNDS: usize = 4;

/// Which host each rank of a communicator runs on, as its device path sees hosts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Hosts {
    /// Each rank's host, numbered in the order of each host's lowest rank.
    of: Vec<usize>,
}

impl Hosts {
    /// Exchanges every rank's host identity (`CHORUS_HOST_ID`, through the communicator's
    /// configuration, else the kernel's boot id or the host name).
    pub fn gather(comm: &Communicator) -> Result<Hosts> {
        let id = comm.config().host_id.clone().unwrap_or_else(machine);
        let mine = [crate::check::digest(id.as_bytes())];
        let mut all = vec![0u64; comm.world_size()];
        comm.all_gather(&mine, &mut all)?;
        Ok(Hosts::numbered(&all))
    }

    /// Hosts from each rank's identity, numbered in order of first appearance.
    pub fn numbered<T: PartialEq>(ids: &[T]) -> Hosts {
        let mut seen: Vec<&T> = Vec::new();
        let of = ids
            .iter()
            .map(|id| match seen.iter().position(|s| *s == id) {
                Some(host) => host,
                None => {
                    seen.push(id);
                    seen.len() - 1
                }
            })
            .collect();
        Hosts { of }
    }

    /// How many hosts.
    pub fn count(&self) -> usize {
        self.of.iter().max().map_or(0, |h| h + 1)
    }

    /// Rank `rank`'s host.
    pub fn of(&self, rank: usize) -> usize {
        self.of[rank]
    }

    /// The ranks on host `host`, in rank order.
    pub fn ranks(&self, host: usize) -> Vec<usize> {
        (0..self.of.len()).filter(|&r| self.of[r] == host).collect()
    }

    /// The ranks of this rank's host, as a communicator of their own, in rank order.
    /// Collective over `comm`.
    pub fn local(&self, comm: &Communicator) -> Result<Communicator> {
        let rank = comm.rank();
        comm.split(Some(self.of(rank) as u32), rank as i64)?
            .ok_or_else(|| crate::Error::Internal("a split with a color gave nothing".into()))
    }

    /// Rank `rank`'s place among its host's ranks (its rank in the host's communicator).
    pub fn local_index(&self, rank: usize) -> usize {
        (0..rank).filter(|&r| self.of[r] == self.of[rank]).count()
    }

    /// The most ranks on one host.
    pub fn most_local(&self) -> usize {
        (0..self.count())
            .map(|h| self.ranks(h).len())
            .max()
            .unwrap_or(0)
    }

    /// The first rank on another host than rank `than`'s, if any.
    pub fn apart_from(&self, than: usize) -> Option<usize> {
        (0..self.of.len()).find(|&r| self.of[r] != self.of[than])
    }
}

/// Islands of ranks that can all map each other's memory, from every rank's reach (bit `q`
/// of `reach[r]`: rank `r` maps rank `q`'s): in rank order, each rank joins the first island
/// whose every member it maps and is mapped by, else starts one. Each rank's island.
fn islands(reach: &[u64]) -> Vec<usize> {
    // Ranks past the 64th have no bit: nobody reaches them, and they reach nobody.
    let maps = |a: usize, b: usize| reach[a].checked_shr(b as u32).is_some_and(|m| m & 1 == 1);
    let mutual = |a: usize, b: usize| maps(a, b) && maps(b, a);
    let mut members: Vec<Vec<usize>> = Vec::new();
    let mut of = Vec::with_capacity(reach.len());
    for r in 0..reach.len() {
        match members.iter().position(|m| m.iter().all(|&q| mutual(r, q))) {
            Some(island) => {
                members[island].push(r);
                of.push(island);
            }
            None => {
                members.push(vec![r]);
                of.push(members.len() - 1);
            }
        }
    }
    of
}

/// What identifies this machine when `CHORUS_HOST_ID` does not: the kernel's boot id (one
/// per machine and boot), else the host name.
fn machine() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| crate::hostname())
}

/// The hierarchical path's state on one rank.
pub(super) struct Tiered<G: Gpu> {
    /// This host's ranks, in rank order.
    local: Communicator,
    /// IPC among them.
    peers: Peers<G>,
    hosts: Hosts,
    /// Shards a round is cut into: the most ranks on one host.
    shards: usize,
    /// The shards this rank owns, each with the communicator of its owners on every host.
    owned: Vec<Owned<G>>,
    /// What an all-to-all's blocks to and from other hosts pass through.
    exchange: Exchange<G>,
    /// The queue stage 2 runs on, beside the caller's.
    crossing: Arc<G::Queue>,
}

/// Page-locked buffers of `room` bytes: what this rank sends to other hosts, and receives.
struct Exchange<G: Gpu> {
    send: G::Pinned,
    recv: G::Pinned,
    room: usize,
}

/// A shard this rank owns: its owners on every host, in host order, and their staging.
struct Owned<G: Gpu> {
    shard: usize,
    across: Communicator,
    staging: Staging<G>,
}

impl<G: Gpu> Tiered<G> {
    /// Sets up the path on `comm`, whose ranks run on `hosts`; `Ok(Err(why))` where some
    /// host's ranks cannot map each other's memory (every rank gets it). Collective.
    pub fn connect(
        comm: &Communicator,
        gpu: &G,
        hosts: Hosts,
    ) -> Result<std::result::Result<Tiered<G>, String>> {
        Tiered::sized(comm, gpu, hosts, None)
    }

    /// As [`connect`](Self::connect) where the ranks of some host cannot all map each
    /// other's memory: each island of ranks that can (see [`islands`]) counts as a host, so
    /// IPC runs within islands and staging between them. `Ok(Err(why))` where no island
    /// holds two ranks (every rank gets it). Collective.
    pub fn on_islands(
        comm: &Communicator,
        gpu: &G,
        hosts: &Hosts,
    ) -> Result<std::result::Result<Tiered<G>, String>> {
        Tiered::sized_on_islands(comm, gpu, hosts, None)
    }

    /// As [`on_islands`](Self::on_islands); `sizes` as [`sized`](Self::sized)'s.
    fn sized_on_islands(
        comm: &Communicator,
        gpu: &G,
        hosts: &Hosts,
        sizes: Option<(usize, usize)>,
    ) -> Result<std::result::Result<Tiered<G>, String>> {
        let (rank, host) = (comm.rank(), hosts.of(comm.rank()));
        let local = hosts.local(comm)?;
        let island = islands(&ipc::reach(&local, gpu)?)[local.rank()];
        let mine = [((host as u64) << 32) | island as u64];
        let mut all = vec![0u64; comm.world_size()];
        comm.all_gather(&mine, &mut all)?;
        let islands = Hosts::numbered(&all);
        if islands.most_local() < 2 {
            return Ok(Err(
                "no two ranks of a host can map each other's device memory".into(),
            ));
        }
        tracing::info!(
            rank,
            islands = islands.count(),
            "ranks of a host that cannot all map each other's memory: IPC within islands"
        );
        Tiered::sized(comm, gpu, islands, sizes)
    }

    /// As [`connect`](Self::connect); `sizes` (IPC halves, staging buffers) in tests.
    pub fn sized(
        comm: &Communicator,
        gpu: &G,
        hosts: Hosts,
        sizes: Option<(usize, usize)>,
    ) -> Result<std::result::Result<Tiered<G>, String>> {
        let host = hosts.of(comm.rank());
        let local = hosts.local(comm)?;
        let peers = match sizes {
            None => Peers::connect(&local, gpu)?,
            Some((half, room)) => Peers::sized(&local, gpu, (half, room))?,
        };
        let mut ok = [u8::from(peers.is_ok())];
        comm.all_reduce(&mut ok, ReduceOp::Min)?;
        let mut peers = match (ok[0], peers) {
            (1, Ok(peers)) => peers,
            (_, Err(why)) => return Ok(Err(why)),
            (_, Ok(mut peers)) => {
                peers.close(&local);
                return Ok(Err(
                    "the ranks of another host cannot map each other's device memory".into(),
                ));
            }
        };
        let shards = hosts.most_local();
        let mut owned = Vec::new();
        for shard in 0..shards {
            let mine = local.rank() == shard % local.world_size();
            let color = mine.then_some(shard as u32);
            let across = match comm.split(color, host as i64) {
                Ok(Some(across)) => across,
                Ok(None) => continue,
                Err(e) => {
                    peers.close(&local);
                    return Err(e);
                }
            };
            let made = match sizes {
                None => Staging::new(gpu, across.world_size()),
                Some((_, room)) => Staging::sized(gpu, across.world_size(), room),
            };
            let staging = match made {
                Ok(staging) => staging,
                Err(e) => {
                    peers.close(&local);
                    return Err(e);
                }
            };
            owned.push(Owned {
                shard,
                across,
                staging,
            });
        }
        // Room for a round of one element of up to 16 bytes from every rank.
        let room = sizes
            .map_or(STAGE_BYTES, |(_, room)| room)
            .max(comm.world_size() * 16);
        let made = gpu.pinned(room).and_then(|send| {
            let recv = gpu.pinned(room)?;
            Ok((Exchange { send, recv, room }, gpu.queue()?))
        });
        let (exchange, crossing) = match made {
            Ok(made) => made,
            Err(e) => {
                peers.close(&local);
                return Err(e);
            }
        };
        Ok(Ok(Tiered {
            local,
            peers,
            hosts,
            shards,
            owned,
            exchange,
            crossing,
        }))
    }

    /// Runs those of `messages` (peers: ranks of `comm`) whose peer runs on this host
    /// through IPC (see [`Peers::exchange`]), and returns the others.
    pub fn exchange_local(
        &self,
        comm: &Communicator,
        gpu: &G,
        messages: Vec<DeviceMessage>,
        stream: &G::Queue,
    ) -> Result<Vec<DeviceMessage>> {
        let me = self.hosts.of(comm.rank());
        let (local, remote): (Vec<_>, Vec<_>) = messages
            .into_iter()
            .partition(|m| self.hosts.of(m.peer()) == me);
        let index = |m: DeviceMessage| m.to(self.hosts.local_index(m.peer()));
        let local: Vec<_> = local.into_iter().map(index).collect();
        self.peers.exchange(&self.local, gpu, &local, stream)?;
        Ok(remote)
    }

    /// Unmaps the peers' memory (see [`Peers::close`]).
    pub fn close(&mut self) {
        self.peers.close(&self.local);
    }

    /// Runs `job` on `comm`'s ranks (those this path was set up on), ordered after the
    /// work enqueued on `stream` before it; returns once its copies and kernels have run.
    pub fn run(&mut self, comm: &Communicator, gpu: &G, job: Job, stream: &G::Queue) -> Result<()> {
        let ran = self.rounds(comm, gpu, job, stream);
        settle(gpu, ran, &[stream, &*self.crossing])
    }

    /// What [`run`](Self::run) runs, in rounds whose stages overlap, leaving work enqueued.
    fn rounds(&mut self, comm: &Communicator, gpu: &G, job: Job, stream: &G::Queue) -> Result<()> {
        let world = comm.world_size();
        let blocks = match job.call {
            DeviceCall::AllGather | DeviceCall::ReduceScatter(_) | DeviceCall::AllToAll => world,
            _ => 1,
        };
        let mut room = self.peers.half_bytes() / blocks;
        if job.call == DeviceCall::AllToAll {
            room = room.min(self.exchange.room / world);
        } else {
            // Several rounds, so that their stages overlap, where each still moves enough.
            let share = job.block.div_ceil(PIPELINE_ROUNDS);
            room = room.min(share.max(LEAST_ROUND_BYTES / blocks));
        }
        let size = job.dtype.size();
        let step = (room / size).max(1) * size;
        let rounds: Vec<usize> = (0..job.block).step_by(step).collect();
        let Tiered {
            local,
            peers,
            hosts,
            shards,
            owned,
            exchange,
            crossing,
        } = self;
        let mut round = |i: usize| {
            let (ptrs, mine) = peers.next_half();
            let offset = rounds[i];
            Round {
                local,
                hosts,
                shards: *shards,
                comm,
                gpu,
                stream,
                job,
                ptrs,
                mine,
                offset,
                len: step.min(job.block - offset),
            }
        };
        if job.call == DeviceCall::AllToAll {
            for i in 0..rounds.len() {
                let round = round(i);
                round.stage_in()?;
                round.fence(i == 0)?;
                round.all_to_all(exchange)?;
            }
            return Ok(());
        }
        let mine: Vec<usize> = owned.iter().map(|o| o.shard).collect();
        if rounds.len() == 1 {
            // Nothing to overlap: stage 2 on the caller's stream, after stage 1's kernels.
            let only = round(0);
            only.stage_in()?;
            only.fence(true)?;
            only.reduce_owned(&mine)?.run(owned, gpu, stream)?;
            only.fence(false)?;
            return only.stage_out();
        }
        std::thread::scope(|s| {
            let (cross, to_cross) = mpsc::channel::<Crossing>();
            let (crossed, has_crossed) = mpsc::channel::<(Result<()>, Duration)>();
            let queue: &G::Queue = crossing;
            let worker = s.spawn(move || {
                for crossing in to_cross {
                    let started = Instant::now();
                    let ended = gpu.bind().and_then(|()| crossing.run(owned, gpu, queue));
                    if crossed.send((ended, started.elapsed())).is_err() {
                        return;
                    }
                }
            });
            // Where the call's time went, for `CHORUS_DEBUG`: stage 1, waiting for stage 2,
            // stage 3 (this thread), and stage 2 (its own).
            let mut spent = [Duration::ZERO; 4];
            let mut pipeline = || -> Result<()> {
                let mut before: Option<Round<'_, G>> = None;
                for i in 0..=rounds.len() {
                    // Stage 1 of round i, while round i - 1 crosses hosts.
                    let start = Instant::now();
                    let now = match rounds.get(i) {
                        Some(_) => {
                            let now = round(i);
                            now.stage_in()?;
                            now.fence(i == 0)?;
                            let crossing = now.reduce_owned(&mine)?;
                            gpu.finish(stream)?;
                            Some((now, crossing))
                        }
                        None => None,
                    };
                    spent[0] += start.elapsed();
                    // Every owner of round i - 1 has crossed.
                    let start = Instant::now();
                    if let Some(before) = &before {
                        let (ended, took) = has_crossed.recv().map_err(|_| stopped())?;
                        spent[3] += took;
                        ended?;
                        before.fence(false)?;
                    }
                    spent[1] += start.elapsed();
                    let now = match now {
                        Some((now, crossing)) => {
                            cross.send(crossing).map_err(|_| stopped())?;
                            Some(now)
                        }
                        None => None,
                    };
                    // Stage 3 of round i - 1, while round i crosses; then no rank writes
                    // its half again (round i + 1) before every rank has read it.
                    let start = Instant::now();
                    if let Some(before) = before.take() {
                        before.stage_out()?;
                        before.fence(false)?;
                    }
                    spent[2] += start.elapsed();
                    before = now;
                }
                let us = |d: Duration| d.as_micros() as u64;
                tracing::debug!(
                    rounds = rounds.len(),
                    stage_1_us = us(spent[0]),
                    waiting_us = us(spent[1]),
                    stage_3_us = us(spent[2]),
                    stage_2_us = us(spent[3]),
                    "hierarchical call (stage 2 overlaps the others)"
                );
                Ok(())
            };
            let ran = pipeline();
            drop(cross);
            let joined = worker
                .join()
                .map_err(|_| Error::Internal("stage 2's thread panicked".into()));
            ran.and(joined)
        })
    }
}

/// The error of a round whose stage 2 never reported: its thread ended.
fn stopped() -> Error {
    Error::Internal("stage 2's thread ended".into())
}

/// Stage 2 of one round: the jobs of the shards this rank owns, in the order of its
/// [`Owned`], each on its owners across hosts, in place in this rank's half.
struct Crossing {
    jobs: Vec<Job>,
    /// The world size an average divides each shard by, after it crossed.
    average: Option<usize>,
}

impl Crossing {
    /// Runs the round's stage 2 on `queue`; returns once its work has run.
    fn run<G: Gpu>(self, owned: &mut [Owned<G>], gpu: &G, queue: &G::Queue) -> Result<()> {
        for (owned, job) in owned.iter_mut().zip(self.jobs) {
            owned.staging.run(&owned.across, gpu, job, queue)?;
            if let Some(world) = self.average {
                // SAFETY: the shard lies in this rank's half, which no peer reads before
                // the fence that follows this stage.
                unsafe { gpu.finish_avg(job.dtype, job.output, job.block, world, queue)? };
            }
        }
        gpu.finish(queue)
    }
}

/// One round of a call: bytes `offset..offset + len` of each rank block.
struct Round<'a, G: Gpu> {
    /// This host's ranks.
    local: &'a Communicator,
    hosts: &'a Hosts,
    shards: usize,
    comm: &'a Communicator,
    gpu: &'a G,
    stream: &'a G::Queue,
    job: Job,
    /// Every local rank's half for this round, in local rank order.
    ptrs: Vec<u64>,
    /// This rank's half.
    mine: u64,
    offset: usize,
    len: usize,
}

impl<G: Gpu> Round<'_, G> {
    /// Stage 1's copies of this rank's input into its half: at the start (a broadcast's root
    /// only), or, for all-gather and reduce-scatter, at each block's place among the
    /// round's `world` blocks.
    fn stage_in(&self) -> Result<()> {
        let (job, len) = (self.job, self.len);
        let input = job.input + self.offset as u64;
        match job.call {
            DeviceCall::AllReduce(_) | DeviceCall::Reduce { .. } => {
                self.copy(self.mine, input, len)
            }
            DeviceCall::Broadcast { root } if root == self.comm.rank() => {
                self.copy(self.mine, input, len)
            }
            DeviceCall::Broadcast { .. } => Ok(()),
            DeviceCall::AllGather => {
                let at = self.mine + (self.comm.rank() * len) as u64;
                self.copy(at, input, len)
            }
            DeviceCall::ReduceScatter(_) | DeviceCall::AllToAll => (0..self.comm.world_size())
                .try_for_each(|q| {
                    let from = input + (q * job.block) as u64;
                    self.copy(self.mine + (q * len) as u64, from, len)
                }),
        }
    }

    /// Stage 1's work of the owners, for each of the shards `mine`, and the stage 2 that
    /// follows it.
    fn reduce_owned(&self, mine: &[usize]) -> Result<Crossing> {
        let job = self.job;
        let local_op = |op: ReduceOp| match op {
            ReduceOp::Avg => ReduceOp::Sum,
            op => op,
        };
        let mut jobs = Vec::with_capacity(mine.len());
        for &shard in mine {
            let (start, end) = self.shard(shard);
            let (at, len) = (start as u64, end - start);
            let host = |r: usize| self.hosts.of(r);
            let (across, dtype) = match job.call {
                DeviceCall::AllReduce(op) | DeviceCall::ReduceScatter(op) => {
                    self.reduce_local(local_op(op), at, len)?;
                    (DeviceCall::AllReduce(local_op(op)), job.dtype)
                }
                DeviceCall::Reduce { op, root } => {
                    self.reduce_local(local_op(op), at, len)?;
                    let root = host(root);
                    (
                        DeviceCall::Reduce {
                            op: local_op(op),
                            root,
                        },
                        job.dtype,
                    )
                }
                DeviceCall::Broadcast { root } => {
                    if host(root) == host(self.comm.rank()) {
                        let theirs = self.ptrs[self.hosts.local_index(root)];
                        self.copy(self.mine + at, theirs + at, len)?;
                    }
                    (DeviceCall::Broadcast { root: host(root) }, job.dtype)
                }
                DeviceCall::AllGather => {
                    self.gather_local(start / self.len..end / self.len)?;
                    (DeviceCall::AllReduce(ReduceOp::BOr), DType::U8)
                }
                DeviceCall::AllToAll => unreachable!("an all-to-all has no owners"),
            };
            jobs.push(Job {
                call: across,
                dtype,
                block: len,
                input: self.mine + at,
                output: self.mine + at,
            });
        }
        let average = matches!(
            job.call,
            DeviceCall::AllReduce(ReduceOp::Avg)
                | DeviceCall::ReduceScatter(ReduceOp::Avg)
                | DeviceCall::Reduce {
                    op: ReduceOp::Avg,
                    ..
                }
        );
        Ok(Crossing {
            jobs,
            average: average.then_some(self.comm.world_size()),
        })
    }

    /// Stage 3: the shards this rank's output takes, from their owners' halves.
    fn stage_out(&self) -> Result<()> {
        let (job, len, me) = (self.job, self.len, self.comm.rank());
        let output = job.output + self.offset as u64;
        match job.call {
            DeviceCall::Reduce { root, .. } if root != me => Ok(()),
            DeviceCall::AllReduce(_) | DeviceCall::Reduce { .. } | DeviceCall::Broadcast { .. } => {
                (0..self.shards).try_for_each(|shard| {
                    let (start, end) = self.shard(shard);
                    let from = self.owner(shard) + start as u64;
                    self.copy(output + start as u64, from, end - start)
                })
            }
            DeviceCall::AllGather => (0..self.comm.world_size()).try_for_each(|q| {
                let from = self.owner(self.shard_of(q)) + (q * len) as u64;
                self.copy(output + (q * job.block) as u64, from, len)
            }),
            DeviceCall::ReduceScatter(_) => {
                let from = self.owner(self.shard_of(me)) + (me * len) as u64;
                self.copy(output, from, len)
            }
            DeviceCall::AllToAll => unreachable!("an all-to-all ends in its exchange"),
        }
    }

    /// An all-to-all after its first fence: the blocks of this host's ranks from their
    /// halves, the others' through the exchange's buffers and the host all-to-all.
    fn all_to_all(&self, exchange: &mut Exchange<G>) -> Result<()> {
        let Exchange { send, recv, .. } = exchange;
        let (job, len, me) = (self.job, self.len, self.comm.rank());
        let output = |q: usize| job.output + (q * job.block + self.offset) as u64;
        let hosts = self.hosts;
        let (local, remote): (Vec<usize>, Vec<usize>) =
            (0..self.comm.world_size()).partition(|&q| hosts.of(q) == hosts.of(me));
        for (k, &q) in remote.iter().enumerate() {
            // SAFETY: block `q` lies in this rank's half, which no peer writes before the
            // next fence; `send` holds `room >= world * len` bytes and is read by the host
            // only after the stream has been synchronized below.
            unsafe {
                self.gpu.to_host(
                    send.at(k * len),
                    self.mine + (q * len) as u64,
                    len,
                    self.stream,
                )?
            };
        }
        for q in local {
            let theirs = self.ptrs[self.hosts.local_index(q)];
            self.copy(output(q), theirs + (me * len) as u64, len)?;
        }
        // The copies out of `recv` of the round before are on this stream too.
        self.gpu.finish(self.stream)?;
        let counts: Vec<usize> = (0..self.comm.world_size())
            .map(|q| if hosts.of(q) == hosts.of(me) { 0 } else { len })
            .collect();
        let bytes = remote.len() * len;
        self.comm
            .all_to_all_v(send.bytes(bytes), &counts, recv.bytes_mut(bytes), &counts)?;
        for (k, &q) in remote.iter().enumerate() {
            // SAFETY: block `q` of the output lies in the caller's buffer (lengths checked);
            // `recv` is not written again before the stream is synchronized (next round).
            unsafe {
                self.gpu
                    .to_device(output(q), recv.at(k * len), len, self.stream)?
            };
        }
        Ok(())
    }

    /// `len` bytes at `at` of this rank's half: the reduction of every local rank's, this
    /// rank's own first (the reduction writes over it).
    fn reduce_local(&self, op: ReduceOp, at: u64, len: usize) -> Result<()> {
        let me = self.local.rank();
        let sources: Vec<u64> = std::iter::once(me)
            .chain((0..self.ptrs.len()).filter(|&q| q != me))
            .map(|q| self.ptrs[q] + at)
            .collect();
        // SAFETY: every half holds the round's bytes and is mapped here; no peer writes its
        // half before the next fence, which comes after the stream has been synchronized.
        unsafe {
            reduce_into(
                self.gpu,
                self.stream,
                (op, self.job.dtype),
                sources[0],
                &sources,
                len,
            )
        }
    }

    /// An all-gather owner's blocks `blocks` of the round: the local ranks' copied from
    /// their halves, the other hosts' zeroed.
    fn gather_local(&self, blocks: std::ops::Range<usize>) -> Result<()> {
        let (len, me) = (self.len, self.comm.rank());
        let hosts = &self.hosts;
        for q in blocks.filter(|&q| q != me) {
            let at = (q * len) as u64;
            if hosts.of(q) == hosts.of(me) {
                self.copy(
                    self.mine + at,
                    self.ptrs[self.hosts.local_index(q)] + at,
                    len,
                )?;
            } else {
                // SAFETY: the block lies in this rank's half, which no peer reads before
                // the next fence.
                unsafe { self.gpu.zero(self.mine + at, len, self.stream)? };
            }
        }
        Ok(())
    }

    /// Shard `shard`'s bytes of the round's data in each half: a slice of the round's
    /// bytes, or, for all-gather and reduce-scatter, a run of whole blocks.
    fn shard(&self, shard: usize) -> (usize, usize) {
        let (shards, world, len) = (self.shards, self.comm.world_size(), self.len);
        match self.job.call {
            DeviceCall::AllGather | DeviceCall::ReduceScatter(_) => (
                shard * world / shards * len,
                (shard + 1) * world / shards * len,
            ),
            _ => slice(len, self.job.dtype, shards, shard),
        }
    }

    /// The shard that holds block `q` (all-gather and reduce-scatter).
    fn shard_of(&self, q: usize) -> usize {
        let (shards, world) = (self.shards, self.comm.world_size());
        (0..shards)
            .find(|&s| (s + 1) * world / shards > q)
            .expect("every block is in a shard")
    }

    /// This host's owner of `shard`: its half.
    fn owner(&self, shard: usize) -> u64 {
        self.ptrs[shard % self.ptrs.len()]
    }

    /// Rank `rank`'s place among its host's ranks (it must be on this host).
    fn copy(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: the callers pass ranges inside the caller's buffers (lengths checked by
        // the communicator) or inside the halves of scratch buffers; the fences keep peers
        // from writing what is being read.
        unsafe { self.gpu.on_device(dst, src, len, self.stream) }
    }

    /// Waits for this rank's queued work, then for every rank of the host to get there;
    /// with `check`, for every rank of the job, through `agree`'s exchange, which also
    /// checks that every rank makes this call.
    fn fence(&self, check: bool) -> Result<()> {
        self.gpu.finish(self.stream)?;
        match check {
            true => agree(self.comm, self.job),
            false => self.local.barrier(),
        }
    }
}

#[cfg(test)]
mod tests {
    use chorus_kernels::DType;

    use super::*;
    use crate::cuda::gpu::lazy::LazyGpu;
    use crate::cuda::testing::{check, check_on, on_ranks, Case};

    /// IPC halves and staging buffers small enough that calls take several rounds, and a
    /// shard several chunks.
    const SIZES: (usize, usize) = (1024, 256);

    /// Every call the path makes, with roots on either host, in sizes of several rounds
    /// and of one.
    fn cases() -> Vec<Case> {
        let (i32, f64) = (DType::I32, DType::F64);
        let sum = ReduceOp::Sum;
        vec![
            (DeviceCall::AllReduce(sum), i32, 1000),
            (DeviceCall::AllReduce(ReduceOp::Avg), f64, 333),
            (DeviceCall::AllReduce(ReduceOp::Max), i32, 5),
            (DeviceCall::Reduce { op: sum, root: 1 }, i32, 700),
            (DeviceCall::Reduce { op: sum, root: 2 }, i32, 3),
            (DeviceCall::Broadcast { root: 1 }, i32, 1000),
            (DeviceCall::Broadcast { root: 2 }, f64, 7),
            (DeviceCall::AllGather, i32, 300),
            (DeviceCall::ReduceScatter(sum), i32, 300),
            (DeviceCall::ReduceScatter(ReduceOp::Max), i32, 1),
            (DeviceCall::AllToAll, i32, 300),
            (DeviceCall::AllToAll, f64, 1),
            (DeviceCall::AllGather, i32, 0),
        ]
    }

    fn setup(comm: &Communicator, gpu: &LazyGpu, hosts: &Hosts) -> Tiered<LazyGpu> {
        Tiered::sized(comm, gpu, hosts.clone(), Some(SIZES))
            .expect("the exchange")
            .expect("every host's ranks map each other's memory")
    }

    #[test]
    fn hosts_of_even_ranks_give_every_rank_its_result() {
        let layouts: [&[usize]; 4] = [
            &[0, 0, 1, 1],
            &[0, 1, 0, 1],
            &[0, 0, 0, 1, 1, 1],
            &[0, 0, 0, 0, 1, 1, 1, 1],
        ];
        check(&layouts, &cases(), setup);
    }

    #[test]
    fn hosts_of_uneven_ranks_give_every_rank_its_result() {
        let layouts: [&[usize]; 4] = [
            &[0, 1, 1],
            &[0, 0, 0, 1, 2, 2],
            &[0, 1, 1, 1, 1, 2, 2, 3],
            &[0, 0, 0, 0],
        ];
        check(&layouts, &cases(), setup);
    }

    #[test]
    fn ranks_that_cannot_all_map_each_other_run_as_islands() {
        // Rank r's device is of island ISLANDS[r]: devices of different islands cannot map
        // each other's memory, so IPC alone fails, and the islands are the path's hosts.
        const ISLANDS: [u8; 5] = [0, 1, 0, 2, 2];
        let layouts: [&[usize]; 2] = [&[0, 0, 0, 0, 0], &[0, 0, 0, 1, 1]];
        let on_island = |r: usize| LazyGpu::on_island(ISLANDS[r]);
        for hosts in layouts {
            let refused = on_ranks(hosts, |comm, layout| {
                let gpu = on_island(comm.rank());
                Tiered::sized(comm, &gpu, layout.clone(), Some(SIZES)).map(|t| t.err())
            });
            assert!(
                refused.iter().all(|r| matches!(r, Ok(Some(_)))),
                "{refused:?}"
            );
        }
        check_on(&layouts, &cases(), on_island, |comm, gpu, hosts| {
            let tiered = Tiered::sized_on_islands(comm, gpu, hosts, Some(SIZES))
                .expect("the exchange")
                .expect("islands of two ranks");
            assert_eq!(tiered.hosts.of, [0, 1, 0, 2, 2]);
            tiered
        });
        // Where no two ranks of a host map each other's memory, there are no islands to use.
        let alone = on_ranks(&[0, 0, 1], |comm, layout| {
            let gpu = LazyGpu::on_island(comm.rank() as u8);
            Tiered::on_islands(comm, &gpu, layout).map(|t| t.err())
        });
        assert!(alone.iter().all(|r| matches!(r, Ok(Some(_)))), "{alone:?}");
    }

    #[test]
    fn islands_hold_ranks_that_all_map_each_other() {
        // Ranks 0 and 2 map each other; 1 maps 0 but 0 not 1; 3 and 4 map each other and 2,
        // which maps neither.
        let reach = [0b00101, 0b00011, 0b00101, 0b11100, 0b11100];
        assert_eq!(islands(&reach), [0, 1, 0, 2, 2]);
        assert_eq!(islands(&[0b11, 0b11, 0b111]), [0, 0, 1]);
        assert_eq!(islands(&[0, 0]), [0, 1]);
        // A 65th rank has no bit in anyone's mask: it stands alone, and nothing overflows.
        let mut many = vec![u64::MAX; 65];
        many[64] = 0;
        assert_eq!(islands(&many)[64], 1);
        assert!(islands(&many)[..64].iter().all(|&i| i == 0));
    }

    #[test]
    fn hosts_are_numbered_in_order_of_their_first_rank() {
        let hosts = Hosts::numbered(&["b", "a", "b", "c", "a"]);
        assert_eq!(hosts.of, [0, 1, 0, 2, 1]);
        assert_eq!((hosts.count(), hosts.most_local()), (3, 2));
        assert_eq!(hosts.ranks(1), [1, 4]);
        assert_eq!(hosts.apart_from(0), Some(1));
        assert_eq!(Hosts::numbered(&[7, 7]).apart_from(1), None);
    }
}
