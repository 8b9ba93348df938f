//! What a call runs, decided in one place. [`plan`] takes a call's [`Shape`], where its
//! ranks are ([`Placement`]) and the tuner, and returns the [`Plan`]: one meeting in the
//! shared-memory mailboxes, a call on the communicator's shared windows, or [`Messages`]:
//! the schedule of the algorithm picked, with the pipeline chunk and handshakes its
//! placement calls for, and the way the executor drives it ([`Drive`]). The communicator
//! runs the plans made here; the simulator prices the same schedules ([`messages`], for
//! every algorithm it compares).

use std::sync::Arc;

use super::{
    all_gather, all_to_all, barrier, broadcast, gather, hierarchical, recursive, reduce,
    reduce_scatter, ring, scatter, tree, Buf, Loc, Schedule, Step,
};
use crate::algorithm::{Algorithm, Collective, Path};
use crate::cost::EAGER;
use crate::tuner::{Pick, Tuner};
use crate::{Error, Result};

/// A call, as far as its plan depends on it.
#[derive(Debug, Clone, Copy)]
pub struct Shape<'a> {
    /// The collective; `None` for a barrier.
    pub collective: Option<Collective>,
    /// nccl-tests' size in elements (see [`schedule_for`]); of an all-to-all with `counts`,
    /// what this rank sends.
    pub count: usize,
    /// Bytes per element.
    pub elem: usize,
    /// The root of broadcast, reduce, gather and scatter.
    pub root: usize,
    /// The configured pipeline chunk, in elements.
    pub chunk: usize,
    /// An all-to-all's elements to each rank and from each rank, where they vary.
    pub counts: Option<(&'a [usize], &'a [usize])>,
    /// Whether the buffers are the communicator's shared windows.
    pub on_windows: bool,
}

/// Where a call's ranks are.
#[derive(Debug, Clone, Copy)]
pub struct Placement<'a> {
    /// The rank planned for.
    pub rank: usize,
    /// How many ranks take part.
    pub world: usize,
    /// The ranks of each host, which share memory, in the order of each host's lowest rank.
    pub hosts: &'a [Vec<usize>],
    /// Distinct machines the ranks run on (several hosts may be one machine's ranks that
    /// take TCP only): rounds between machines can wait for a handshake.
    pub machines: usize,
    /// Whether every rank reaches every other through shared memory.
    pub shared_memory: bool,
}

/// What a call runs.
#[derive(Debug, Clone)]
pub enum Plan {
    /// These messages, through the transport.
    Messages(Arc<Messages>),
    /// One meeting in the shared-memory mailboxes.
    Mailbox,
    /// Directly on the communicator's shared windows.
    Window,
}

/// A rank's messages for one call: its schedule and how the executor drives it.
#[derive(Debug, Clone, PartialEq)]
pub struct Messages {
    /// The steps, in order.
    pub steps: Schedule,
    /// How the executor runs them.
    pub drive: Drive,
}

/// How the executor runs a schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drive {
    /// Its machine posts, waits and reduces as the steps' dependencies allow.
    Machine,
    /// Pair by pair through the transport's `sendrecv`, which may move small messages
    /// without requests: a program of small exchanges only (see [`Messages::of`]).
    Exchanges,
}

/// Largest message of a program driven as exchanges.
pub const EXCHANGE_BYTES: usize = 256;

impl Messages {
    /// `steps` on elements of `elem` bytes, driven as exchanges when they are only
    /// exchanges: pairs of a send and a receive (or receive-and-reduce) into the output, of
    /// at most [`EXCHANGE_BYTES`] each, where every pair but the first follows a fence or
    /// sends what the pair before received (so the machine too would run the pairs one
    /// after the other), with perhaps a finish and fences at the end. Small all-reduces by
    /// recursive doubling and barriers are.
    pub fn of(steps: Schedule, elem: usize) -> Messages {
        let drive = match exchanges(&steps, elem) {
            true => Drive::Exchanges,
            false => Drive::Machine,
        };
        Messages { steps, drive }
    }
}

fn exchanges(steps: &[Step], elem: usize) -> bool {
    let small = |loc: &Loc| loc.range.len() * elem <= EXCHANGE_BYTES && loc.buf != Buf::Scratch;
    let mut after: Option<&Loc> = None;
    let mut rest = steps;
    while let Some((step, tail)) = rest.split_first() {
        rest = tail;
        let from = match step {
            Step::Fence => {
                after = None;
                continue;
            }
            Step::Finish { .. } => return tail.iter().all(|s| matches!(s, Step::Fence)),
            Step::Send { from, .. } => from,
            _ => return false,
        };
        let into = match tail.first() {
            Some(Step::Recv { into, .. }) => into,
            Some(Step::RecvReduce { with, into, .. }) if small(with) => into,
            _ => return false,
        };
        let follows = after.is_none_or(|last| last.overlaps(from));
        if !(follows && small(from) && small(into) && into.buf == Buf::Output) {
            return false;
        }
        after = Some(into);
        rest = &tail[1..];
    }
    true
}

/// The plan of call `shape` on rank `at.rank`, from `tuner`'s pick (returned beside it).
pub fn plan(tuner: &Tuner, shape: &Shape<'_>, at: &Placement<'_>) -> Result<(Plan, Pick)> {
    let c = shape.collective;
    let pick = tuner.pick(c, shape.count * shape.elem, at.world, shape.on_windows);
    let plan = match pick.path {
        Path::Mailbox => Plan::Mailbox,
        Path::Window => Plan::Window,
        Path::Messages(a) => Plan::Messages(Arc::new(messages(shape, a, at).ok_or_else(|| {
            Error::Internal(format!(
                "the tuner offered {a:?}, which has no {c:?} schedule"
            ))
        })?)),
    };
    Ok((plan, pick))
}

/// The messages of call `shape` on rank `at.rank` by algorithm `a`, or `None` if `a` does
/// not implement the call. A barrier is a dissemination whatever `a`; an all-to-all with
/// counts, pairwise.
pub fn messages(shape: &Shape<'_>, a: Algorithm, at: &Placement<'_>) -> Option<Messages> {
    let (rank, w) = (at.rank, at.world);
    let chunk = chunk_for(shape, at);
    let steps = match (shape.collective, a, shape.counts) {
        (None, _, _) => barrier::dissemination(rank, w),
        (Some(Collective::AllToAll), _, Some((send, recv))) => {
            all_to_all::pairwise(rank, w, send, recv)
        }
        (Some(Collective::AllReduce), Algorithm::Hierarchical, None) => {
            hierarchical::all_reduce_on(rank, at.hosts, shape.count, chunk)
        }
        (Some(c), a, None) => {
            let ready_above = ready_above(at.machines, shape.elem);
            schedule_for(c, a, rank, w, shape.count, chunk, shape.root, ready_above)?
        }
        (Some(_), _, Some(_)) => return None,
    };
    Some(Messages::of(steps, shape.elem))
}

/// The pipeline chunk of `shape` at `at`: the configured one, but a broadcast between two
/// ranks that share memory goes as one message. Two ranks relay nothing, and over shared
/// memory the receiver copies the whole message straight from the root's buffer; over
/// sockets chunks move faster (W=2, 64 MiB, in place: 3.8-6.0 GB/s against 2.3-3.5 whole).
fn chunk_for(shape: &Shape<'_>, at: &Placement<'_>) -> usize {
    match shape.collective {
        Some(Collective::Broadcast) if at.world == 2 && at.shared_memory => shape.count.max(1),
        _ => shape.chunk,
    }
}

/// The `ready_above` of [`schedule_for`] for elements of `elem` bytes on ranks spread over
/// `machines` machines: between machines, a round's message larger than what the sockets
/// hold before its receive is posted waits for a handshake; on one machine (over shared
/// memory or loopback TCP) no link is shared, so none does.
pub fn ready_above(machines: usize, elem: usize) -> usize {
    match machines {
        0 | 1 => usize::MAX,
        _ => EAGER as usize / elem.max(1),
    }
}

/// The schedule `rank` runs for `c` by `a`, or `None` if `a` does not implement `c`.
///
/// `count` is nccl-tests' size in elements (see [`crate::tuner::Tuner::estimate`]):
/// the buffer of all-reduce, broadcast and reduce; the whole output of
/// all-gather and gather, the whole input of reduce-scatter and scatter,
/// each rank's buffer of all-to-all, of which every rank's block is
/// `count / world_size` elements. `chunk` is the pipeline chunk in elements;
/// `root` the root of broadcast, reduce, gather and scatter; rounds of recursive doubling
/// and halving-doubling that send more than `ready_above` elements start with a handshake
/// (see [`ready_above`]; `usize::MAX`: none).
#[allow(clippy::too_many_arguments)]
pub fn schedule_for(
    c: Collective,
    a: Algorithm,
    rank: usize,
    world_size: usize,
    count: usize,
    chunk: usize,
    root: usize,
    ready_above: usize,
) -> Option<Schedule> {
    use Algorithm::*;
    use Collective::*;
    let (w, block) = (world_size, count / world_size.max(1));
    Some(match (c, a) {
        (AllReduce, Ring) => ring::all_reduce(rank, w, count, chunk),
        (AllReduce, Tree) => tree::all_reduce(rank, w, count, chunk),
        (AllReduce, RecursiveDoubling) => recursive::doubling(rank, w, count, chunk, ready_above),
        (AllReduce, HalvingDoubling) => {
            recursive::halving_doubling(rank, w, count, chunk, ready_above)
        }
        (Broadcast, Ring) => broadcast::chain(rank, w, root, count, chunk),
        (Broadcast, Tree) => broadcast::tree(rank, w, root, count, chunk),
        (Reduce, Ring) => reduce::chain(rank, w, root, count, chunk),
        (Reduce, Tree) => reduce::tree(rank, w, root, count, chunk),
        (AllGather, Ring) => all_gather::ring(rank, w, block, chunk),
        (ReduceScatter, Ring) => reduce_scatter::ring(rank, w, block, chunk),
        (AllToAll, Direct) => {
            let counts = vec![block; w];
            all_to_all::pairwise(rank, w, &counts, &counts)
        }
        (Gather, Direct) => gather::direct(rank, w, root, block),
        (Scatter, Direct) => scatter::direct(rank, w, root, block),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(collective: Option<Collective>, count: usize) -> Shape<'static> {
        Shape {
            collective,
            count,
            elem: 4,
            root: 0,
            chunk: 1 << 17,
            counts: None,
            on_windows: false,
        }
    }

    fn on_one_host(rank: usize, hosts: &[Vec<usize>], shared_memory: bool) -> Placement<'_> {
        Placement {
            rank,
            world: hosts.iter().map(Vec::len).sum(),
            hosts,
            machines: 1,
            shared_memory,
        }
    }

    #[test]
    fn a_broadcast_between_two_ranks_is_one_message_on_shared_memory_only() {
        let two = [vec![0, 1]];
        let three = [vec![0, 1, 2]];
        let bcast = |count| shape(Some(Collective::Broadcast), count);
        assert_eq!(
            chunk_for(&bcast(1 << 24), &on_one_host(0, &two, true)),
            1 << 24
        );
        assert_eq!(chunk_for(&bcast(0), &on_one_host(0, &two, true)), 1);
        assert_eq!(
            chunk_for(&bcast(1 << 24), &on_one_host(0, &two, false)),
            1 << 17
        );
        assert_eq!(
            chunk_for(&bcast(1 << 24), &on_one_host(0, &three, true)),
            1 << 17
        );
        let all_reduce = shape(Some(Collective::AllReduce), 1 << 24);
        assert_eq!(chunk_for(&all_reduce, &on_one_host(0, &two, true)), 1 << 17);
        assert_eq!(
            chunk_for(&shape(None, 0), &on_one_host(0, &two, true)),
            1 << 17
        );
    }

    #[test]
    fn only_rounds_between_machines_larger_than_the_sockets_hold_shake_hands() {
        assert_eq!(ready_above(1, 4), usize::MAX);
        assert_eq!(ready_above(2, 4), 16 << 10);
        assert_eq!(ready_above(3, 8), 8 << 10);
        let hosts: Vec<Vec<usize>> = (0..4).map(|r| vec![r]).collect();
        let fences = |machines| {
            let at = Placement {
                machines,
                ..on_one_host(0, &hosts, false)
            };
            let all_reduce = shape(Some(Collective::AllReduce), 1 << 20);
            let rd = messages(&all_reduce, Algorithm::RecursiveDoubling, &at).unwrap();
            rd.steps.iter().filter(|s| matches!(s, Step::Fence)).count()
        };
        assert_eq!(fences(1), 0);
        assert_eq!(fences(4), 4);
    }

    #[test]
    fn barriers_all_to_all_v_and_hierarchical_all_reduce_have_their_own_schedules() {
        let hosts = [vec![0, 1], vec![2, 3]];
        let at = Placement {
            machines: 2,
            ..on_one_host(2, &hosts, false)
        };
        let barrier = messages(&shape(None, 0), Algorithm::Ring, &at).unwrap();
        assert_eq!(barrier.steps, barrier::dissemination(2, 4));
        let (send, recv) = ([1, 2, 3, 4], [4, 3, 3, 1]);
        let v = Shape {
            counts: Some((&send, &recv)),
            ..shape(Some(Collective::AllToAll), 10)
        };
        let steps = messages(&v, Algorithm::Direct, &at).unwrap().steps;
        assert_eq!(steps, all_to_all::pairwise(2, 4, &send, &recv));
        let all_reduce = shape(Some(Collective::AllReduce), 1 << 10);
        let h = messages(&all_reduce, Algorithm::Hierarchical, &at).unwrap();
        assert_eq!(
            h.steps,
            hierarchical::all_reduce_on(2, &hosts, 1 << 10, 1 << 17)
        );
        let bcast = shape(Some(Collective::Broadcast), 1 << 10);
        assert_eq!(messages(&bcast, Algorithm::Hierarchical, &at), None);
        assert_eq!(
            messages(&v, Algorithm::Ring, &at).map(|m| m.steps),
            Some(steps)
        );
        let counted_reduce = Shape {
            counts: Some((&send, &recv)),
            ..shape(Some(Collective::Reduce), 10)
        };
        assert_eq!(messages(&counted_reduce, Algorithm::Ring, &at), None);
    }

    #[test]
    fn small_doublings_and_barriers_run_as_exchanges_and_nothing_else_does() {
        // Floats: 64 of them are EXCHANGE_BYTES.
        let chunk = 1 << 20;
        for (world, rank) in [(2, 0), (2, 1), (4, 3), (8, 5)] {
            assert!(exchanges(
                &recursive::doubling(rank, world, 64, chunk, usize::MAX),
                4
            ));
            assert!(exchanges(&barrier::dissemination(rank, world), 4));
            // A message too big, and chunks of one round that the machine would overlap.
            assert!(!exchanges(
                &recursive::doubling(rank, world, 65, chunk, usize::MAX),
                4
            ));
            assert!(!exchanges(
                &recursive::doubling(rank, world, 64, 16, usize::MAX),
                4
            ));
            assert!(!exchanges(&ring::all_reduce(rank, world, 64, chunk), 4));
        }
        // Three ranks: rank 2 is folded into rank 0, which receives from it before any send.
        assert!(exchanges(
            &recursive::doubling(2, 3, 8, chunk, usize::MAX),
            4
        ));
        assert!(!exchanges(
            &recursive::doubling(0, 3, 8, chunk, usize::MAX),
            4
        ));
        assert!(exchanges(&barrier::dissemination(1, 3), 4));
        let drive = |steps| Messages::of(steps, 4).drive;
        assert_eq!(drive(barrier::dissemination(1, 3)), Drive::Exchanges);
        assert_eq!(drive(ring::all_reduce(1, 3, 64, chunk)), Drive::Machine);
    }
}
