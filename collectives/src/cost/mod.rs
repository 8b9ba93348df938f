//! The cost model: what a schedule costs on a network of alpha-beta links.
//!
//! Every message costs `alpha + bytes / beta` seconds of link time: `alpha`
//! is a per-message latency (wire, stack, syscalls), `beta` the link
//! bandwidth in bytes/s. Each rank has one outgoing and one incoming link (a
//! NIC) that its sends and its receives share; a received chunk that is
//! reduced costs `bytes / gamma` more on the receiving rank (`gamma` is
//! infinite, reductions free, unless set).
//!
//! - [`closed`]: closed forms per collective and algorithm (what the
//!   [`crate::tuner`] uses at run time; no schedule is built).
//! - [`simulate`]: the evaluator, which runs the real schedules of every
//!   rank on the executor's own state machine, in simulated time.

pub mod closed;
mod fabric;
pub mod simulate;

pub use simulate::{evaluate, EvalConfig, EvalError, Evaluation, DEFAULT_DEPTH};

use crate::algorithm::{Algorithm, Collective};
use crate::schedule::{
    all_gather, all_to_all, broadcast, gather, recursive, reduce, reduce_scatter, ring, scatter,
    tree, Schedule,
};

/// Per-message latency assumed when nothing is measured: 10 us (TCP over loopback or a LAN).
pub const DEFAULT_ALPHA: f64 = chorus_transport::tcp::LINK_COST.latency;

/// Link bandwidth assumed when nothing is measured: 1.5 GB/s (loopback TCP, one stream).
pub const DEFAULT_BETA: f64 = chorus_transport::tcp::LINK_COST.bandwidth;

/// The alpha-beta(-gamma) link model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkModel {
    /// Seconds of link time every message costs, whatever its size.
    pub alpha: f64,
    /// Link bandwidth in bytes per second.
    pub beta: f64,
    /// Reduction bandwidth in bytes per second (infinite: reductions are free).
    pub gamma: f64,
}

impl Default for LinkModel {
    fn default() -> LinkModel {
        LinkModel::new(DEFAULT_ALPHA, DEFAULT_BETA)
    }
}

impl LinkModel {
    /// Links of `alpha` seconds per message and `beta` bytes/s; free reductions.
    pub fn new(alpha: f64, beta: f64) -> LinkModel {
        LinkModel {
            alpha,
            beta,
            gamma: f64::INFINITY,
        }
    }

    /// Shared memory between two ranks of one host, as the tuner assumes it.
    pub fn shared_memory() -> LinkModel {
        let shm = chorus_transport::shm::LINK_COST;
        LinkModel::new(shm.latency, shm.bandwidth)
    }

    /// This model with reductions at `gamma` bytes/s.
    pub fn with_gamma(mut self, gamma: f64) -> LinkModel {
        self.gamma = gamma;
        self
    }

    /// Link time of one message of `bytes`: `alpha + bytes / beta`.
    pub fn message(&self, bytes: f64) -> f64 {
        self.alpha + bytes / self.beta
    }

    /// Time to reduce `bytes` of received data: `bytes / gamma`.
    pub fn reduce(&self, bytes: f64) -> f64 {
        if self.gamma.is_finite() {
            bytes / self.gamma
        } else {
            0.0
        }
    }
}

/// The links of a simulated cluster: hosts of `per_host` consecutive ranks. Each host has
/// one outgoing and one incoming link to the others (`between`, shared by its ranks); ranks
/// on one host reach each other over links of their own (`within`, e.g. shared memory).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Network {
    /// Links between hosts (reductions cost its `gamma`).
    pub between: LinkModel,
    /// Links between two ranks of one host.
    pub within: LinkModel,
    /// Ranks per host (the last host may hold fewer).
    pub per_host: usize,
}

impl Network {
    /// Every rank on a host of its own, with `model`'s links.
    pub fn flat(model: LinkModel) -> Network {
        Network {
            between: model,
            within: model,
            per_host: 1,
        }
    }

    /// The host of `rank`.
    pub fn host(&self, rank: usize) -> usize {
        rank / self.per_host.max(1)
    }
}

/// The `ready_above` of [`schedule_for`] for elements of `elem` bytes on ranks spread over
/// `machines` machines: between machines, a round's message larger than what the sockets
/// hold before its receive is posted waits for a handshake; on one machine (over shared
/// memory or loopback TCP) no link is shared, so none does.
pub fn ready_above(machines: usize, elem: usize) -> usize {
    match machines {
        0 | 1 => usize::MAX,
        _ => fabric::EAGER as usize / elem.max(1),
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
    use crate::schedule::Step;

    #[test]
    fn only_rounds_between_hosts_larger_than_the_sockets_hold_shake_hands() {
        assert_eq!(ready_above(1, 4), usize::MAX);
        assert_eq!(ready_above(2, 4), 16 << 10);
        assert_eq!(ready_above(3, 8), 8 << 10);
        let fence = |s: &Step| matches!(s, Step::Fence);
        let rd = |hosts| {
            schedule_for(
                Collective::AllReduce,
                Algorithm::RecursiveDoubling,
                0,
                4,
                1 << 20,
                1 << 17,
                0,
                ready_above(hosts, 4),
            )
            .expect("recursive doubling implements all-reduce")
        };
        assert!(!rd(1).iter().any(fence));
        assert_eq!(rd(4).iter().filter(|s| fence(s)).count(), 4);
    }
}
