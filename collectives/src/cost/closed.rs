//! Closed forms: `latency * steps + bytes / bandwidth` per collective and
//! algorithm, for schedules cut into chunks of at most `chunk` bytes.
//!
//! Notation: `W` ranks, `S` bytes (nccl-tests' size, see
//! [`crate::tuner::Tuner::estimate`]), `n` chunks of a message, `u = alpha +
//! S'/(n beta)` the link time of one chunk of an `S'`-byte message. Every
//! message pays `alpha`, so cutting into chunks costs `alpha` per chunk and
//! buys pipelining. With free reductions the ring, all-gather,
//! reduce-scatter, pairwise, direct and chain forms are exact for the
//! schedules (up to rounding of uneven splits); the tree forms are within a
//! few percent (the evaluator's tests state the tolerances).

use super::LinkModel;
use crate::algorithm::{Algorithm, Collective};

/// Estimated seconds for `c` by `a`, or `None` if `a` does not implement `c`.
pub fn estimate(
    m: &LinkModel,
    c: Collective,
    a: Algorithm,
    bytes: usize,
    world: usize,
    chunk: usize,
) -> Option<f64> {
    use Algorithm::*;
    use Collective::*;
    let (w, s, k) = (world, bytes as f64, chunk.max(1) as f64);
    Some(match (c, a) {
        (AllReduce, Ring) => ring_all_reduce(m, w, s, k),
        (AllReduce, Tree) => tree_all_reduce(m, w, s, k),
        (AllReduce, RecursiveDoubling) => recursive_doubling_all_reduce(m, w, s, k),
        (AllReduce, HalvingDoubling) => halving_doubling_all_reduce(m, w, s, k),
        (Broadcast, Ring) => chain_broadcast(m, w, s, k),
        (Broadcast, Tree) => tree_broadcast(m, w, s, k),
        (Reduce, Ring) => chain_reduce(m, w, s, k),
        (Reduce, Tree) => tree_reduce(m, w, s, k),
        (AllGather, Ring) => ring_all_gather(m, w, s, k),
        (ReduceScatter, Ring) => ring_reduce_scatter(m, w, s, k),
        (AllToAll, Direct) => pairwise_all_to_all(m, w, s),
        (Gather, Direct) => direct_gather(m, w, s),
        (Scatter, Direct) => direct_scatter(m, w, s),
        _ => return None,
    })
}

/// Bytes every rank sends, summed over the ranks, for `c` by `a` on `bytes` over `world`
/// ranks (`None` if `a` does not implement `c`, or for the hierarchical all-reduce): the
/// work a host's cores share where its ranks outnumber them.
pub fn sent(c: Collective, a: Algorithm, bytes: usize, world: usize) -> Option<f64> {
    use Algorithm::*;
    use Collective::*;
    let (w, s) = (world.max(1) as f64, bytes as f64);
    let (l, _) = log2_floor(world);
    let p = f64::from(1u32 << l);
    Some(match (c, a) {
        // The folded ranks' whole buffer in and out, besides the power of two's exchanges.
        (AllReduce, RecursiveDoubling) => (p * f64::from(l) + 2.0 * (w - p)) * s,
        (AllReduce, Ring | Tree | HalvingDoubling) => 2.0 * (w - 1.0) * s,
        (Broadcast | Reduce, Ring | Tree) | (AllGather | ReduceScatter, Ring) => (w - 1.0) * s,
        (AllToAll, Direct) => (w - 1.0) * s,
        (Gather | Scatter, Direct) => (w - 1.0) / w * s,
        _ => return None,
    })
}

/// Chunks a message of `bytes` is cut into (none for an empty one).
pub fn chunks(bytes: f64, chunk: f64) -> f64 {
    if bytes <= 0.0 {
        0.0
    } else {
        (bytes / chunk).ceil().max(1.0)
    }
}

/// log2 of the largest power of two not above `w`, and whether `w` is one.
fn log2_floor(w: usize) -> (u32, bool) {
    let w = w.max(1);
    (usize::BITS - 1 - w.leading_zeros(), w.is_power_of_two())
}

/// Depth of the binary trees over `w` ranks: ceil(log2 w).
pub fn tree_depth(w: usize) -> f64 {
    let (l, exact) = log2_floor(w);
    f64::from(l + u32::from(!exact))
}

/// Link time of `n` chunks carrying `bytes` in all: `n alpha + bytes / beta`.
fn wire(m: &LinkModel, bytes: f64, n: f64) -> f64 {
    n * m.alpha + bytes / m.beta
}

/// One receive-and-reduce step of `bytes` in `n` chunks: the wire and the
/// reductions overlap chunk by chunk, so the slower of the two, but at least
/// one chunk's wire plus its reduction.
fn reduce_step(m: &LinkModel, bytes: f64, n: f64) -> f64 {
    if n == 0.0 {
        return 0.0;
    }
    let (u, r) = (m.message(bytes / n), m.reduce(bytes / n));
    (n * u).max(n * r).max(u + r)
}

/// Ring all-reduce: 2(W-1) steps of S/W, `2(W-1)(alpha + S/(W beta))` unchunked.
pub fn ring_all_reduce(m: &LinkModel, w: usize, s: f64, chunk: f64) -> f64 {
    if w < 2 {
        return 0.0;
    }
    let (wf, seg) = ((w - 1) as f64, s / w as f64);
    let n = chunks(seg, chunk);
    wf * reduce_step(m, seg, n) + wf * wire(m, seg, n)
}

/// Double binary tree all-reduce, as the executor runs it: each tree
/// reduces half the buffer up and broadcasts it down, chunk by chunk, every
/// rank in lockstep slots (a chunk climbs a level, or descends one, per
/// slot). One chunk a tree takes `4D - 2` steps for depth `D = ceil(log2 W)`
/// (`4D - 4` where the deepest rank is alone at its depth, `4D - 3` between);
/// each further chunk adds 4 steps (a rank sends and receives four chunks a
/// slot) until the pipeline settles at `P` steps a chunk, less `k` steps:
/// the links' sharing and the slots' lockstep leave some of them idle.
/// Fitted to the evaluator (within 20%; W = 2 apart): `P = 5.75`, `k = 10`,
/// but for the bandwidth at W = 4, 6 and 8 (`P = 4.3`) and at W = 3 (`P =
/// 3.5`, and 4 for the latency).
pub fn tree_all_reduce(m: &LinkModel, w: usize, s: f64, chunk: f64) -> f64 {
    if w < 2 || s <= 0.0 {
        return 0.0;
    }
    let half = s / 2.0;
    let n = chunks(half, chunk);
    let d = tree_depth(w);
    let first = if w.is_power_of_two() {
        4.0 * d - 2.0
    } else if lone_deepest(w) {
        4.0 * d - 4.0
    } else {
        4.0 * d - 3.0
    };
    // Steps for a pipeline settling at `settled` steps a chunk, less `less`.
    let steps = |(settled, less): (f64, f64)| {
        (first + (n - 1.0) * f64::min(settled, 4.0)).max(settled * n - less)
    };
    let (latency, bandwidth) = match w {
        // Each rank is the other's only child in one tree: one step up, one down.
        2 => (2.0 * n, 2.0 * n),
        3 => (steps((4.0, 0.0)), steps((3.5, 0.0))),
        4 | 6 | 8 => (steps((5.75, 10.0)), steps((4.3, 0.0))),
        _ => (steps((5.75, 10.0)), steps((5.75, 10.0))),
    };
    latency * m.alpha + bandwidth * half / n / m.beta + (n + fan(w) * d) * m.reduce(half / n)
}

/// Whether a binary tree of `w` ranks has one rank alone at its deepest level
/// (`w = 2^(D-1) + 1`).
fn lone_deepest(w: usize) -> bool {
    w > 2 && (w - 1).is_power_of_two()
}

/// Recursive doubling all-reduce: log2(P) rounds exchanging the whole
/// buffer (P the largest power of two up to W), plus a fold in and a copy
/// out (2 steps, and one for queueing) when W is not a power of two.
pub fn recursive_doubling_all_reduce(m: &LinkModel, w: usize, s: f64, chunk: f64) -> f64 {
    if w < 2 {
        return 0.0;
    }
    let (l, exact) = log2_floor(w);
    let n = chunks(s, chunk);
    let round = reduce_step(m, s, n);
    let fold = if exact { 0.0 } else { fold(m, s, n) };
    f64::from(l) * round + fold
}

/// Halving-doubling (Rabenseifner) all-reduce: reduce-scatter by recursive
/// halving then all-gather by recursive doubling, `2 log2(P) alpha + 2 (P-1)/P S/beta`
/// unchunked, plus the fold in and out (2 steps of S, and one for queueing)
/// when W is not a power of two.
pub fn halving_doubling_all_reduce(m: &LinkModel, w: usize, s: f64, chunk: f64) -> f64 {
    if w < 2 {
        return 0.0;
    }
    let (l, exact) = log2_floor(w);
    let mut t = 0.0;
    let mut part = s;
    for _ in 0..l {
        part /= 2.0;
        let n = chunks(part, chunk);
        t += reduce_step(m, part, n) + wire(m, part, n);
    }
    if !exact {
        t += fold(m, s, chunks(s, chunk));
    }
    t
}

/// Folding W-P extra ranks in and out: S each way in `n` chunks, plus one
/// chunk for the first round's messages queueing behind the fold at the
/// partner's incoming link.
fn fold(m: &LinkModel, s: f64, n: f64) -> f64 {
    reduce_step(m, s, n) + wire(m, s, n) + m.message(s / n)
}

/// Chain broadcast, pipelined: `(W-1 + n-1)(alpha + S/(n beta))` for `n` chunks.
pub fn chain_broadcast(m: &LinkModel, w: usize, s: f64, chunk: f64) -> f64 {
    if w < 2 || s <= 0.0 {
        return 0.0;
    }
    let n = chunks(s, chunk);
    ((w - 1) as f64 + n - 1.0) * m.message(s / n)
}

/// Binary tree broadcast, pipelined: interior ranks send each chunk to two
/// children at once, `(2(n-1) + 2D - 1)(alpha + S/(n beta))` for `n` chunks
/// and depth `D = ceil(log2 W)`, one step less where the deepest rank is
/// alone at its depth; exact for W < 4 (a chain).
pub fn tree_broadcast(m: &LinkModel, w: usize, s: f64, chunk: f64) -> f64 {
    if w < 2 || s <= 0.0 {
        return 0.0;
    }
    let n = chunks(s, chunk);
    let last = 2.0 * tree_depth(w) - if lone_deepest(w) { 2.0 } else { 1.0 };
    (fan(w) * (n - 1.0) + last) * m.message(s / n)
}

/// Chunks an interior rank of a binary tree of `w` ranks passes on per chunk.
fn fan(w: usize) -> f64 {
    if w <= 3 {
        1.0
    } else {
        2.0
    }
}

/// Chain reduce, pipelined: as the chain broadcast, each hop also reducing a chunk.
pub fn chain_reduce(m: &LinkModel, w: usize, s: f64, chunk: f64) -> f64 {
    if w < 2 || s <= 0.0 {
        return 0.0;
    }
    let n = chunks(s, chunk);
    let (u, r) = (m.message(s / n), m.reduce(s / n));
    ((w - 1) as f64 + n - 1.0) * u.max(r) + (w - 1) as f64 * u.min(r)
}

/// Binary tree reduce, pipelined: interior ranks receive each chunk from
/// two children at once and reduce both, `(2(n-1) + 2D - 1) max(u, r) +
/// 2D min(u, r)` (W > 3; a chain below) for `n` chunks of link time `u` and
/// reduction time `r`, depth `D = ceil(log2 W)`, one step less where W is
/// not a power of two.
pub fn tree_reduce(m: &LinkModel, w: usize, s: f64, chunk: f64) -> f64 {
    if w < 2 || s <= 0.0 {
        return 0.0;
    }
    let n = chunks(s, chunk);
    let (u, r) = (m.message(s / n), m.reduce(s / n));
    let d = tree_depth(w);
    let last = 2.0 * d - if w.is_power_of_two() { 1.0 } else { 2.0 };
    (fan(w) * (n - 1.0) + last) * u.max(r) + fan(w) * d * u.min(r)
}

/// Ring all-gather of `S` bytes of output: `(W-1)(alpha + S/(W beta))` unchunked.
pub fn ring_all_gather(m: &LinkModel, w: usize, s: f64, chunk: f64) -> f64 {
    if w < 2 {
        return 0.0;
    }
    let blk = s / w as f64;
    (w - 1) as f64 * wire(m, blk, chunks(blk, chunk))
}

/// Ring reduce-scatter of `S` bytes of input: `(W-1)(alpha + S/(W beta))` unchunked, plus reductions.
pub fn ring_reduce_scatter(m: &LinkModel, w: usize, s: f64, chunk: f64) -> f64 {
    if w < 2 {
        return 0.0;
    }
    let blk = s / w as f64;
    (w - 1) as f64 * reduce_step(m, blk, chunks(blk, chunk))
}

/// Pairwise all-to-all of `S` bytes per rank: W-1 messages of S/W, not
/// chunked, `(W-1)(alpha + S/(W beta))`.
pub fn pairwise_all_to_all(m: &LinkModel, w: usize, s: f64) -> f64 {
    if w < 2 {
        return 0.0;
    }
    (w - 1) as f64 * m.message(s / w as f64)
}

/// Direct gather of `S` bytes at the root: its incoming link takes W-1
/// blocks of S/W, `(W-1)(alpha + S/(W beta))`.
pub fn direct_gather(m: &LinkModel, w: usize, s: f64) -> f64 {
    if s <= 0.0 {
        return 0.0;
    }
    pairwise_all_to_all(m, w, s)
}

/// Direct scatter of `S` bytes from the root: its outgoing link sends W-1
/// blocks of S/W, `(W-1)(alpha + S/(W beta))`.
pub fn direct_scatter(m: &LinkModel, w: usize, s: f64) -> f64 {
    direct_gather(m, w, s)
}
