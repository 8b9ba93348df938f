//! Recursive all-reduce for any world size: recursive doubling, and
//! Rabenseifner's halving-doubling.
//!
//! Let P be the largest power of two not above W. The W-P extra ranks fold
//! first: extra rank P+i sends its input to rank i, which reduces it into
//! its own, and receives the finished result from rank i at the end. The P
//! remaining ranks then run the power-of-two algorithm. Folding costs two
//! more steps and `count` elements each way for the ranks involved.
//!
//! * Doubling: in round k = 0..log2(P) rank r exchanges its whole partial
//!   result with rank r xor 2^k and both combine the two. log2(P) steps,
//!   log2(P) * count elements sent and received per rank: few steps, many
//!   bytes, so it suits tiny messages.
//! * Halving-doubling: a reduce-scatter by recursive halving (round k sends
//!   away half of what is left, to rank r xor P/2^(k+1)), so rank r ends with
//!   the full reduction of segment r, finishes it there, then an all-gather
//!   by recursive doubling. 2 log2(P) steps, 2(P-1)/P * count elements sent
//!   and received per rank: bandwidth-optimal with logarithmic latency.
//!
//! Every message is cut into chunks of `chunk` elements to pipeline it.
//!
//! Between hosts, a round whose message to the partner is larger than `ready_above`
//! elements starts with a handshake: the rank finishes every earlier step, swaps an empty
//! message with the partner and only then sends. Without it a pair that finished a round
//! early sends its next partner data while that partner is still receiving the round
//! before, on the same incoming link: the late pair falls further behind, and on 100 Mbit/s
//! links recursive doubling of 1 MiB over 8 ranks took 300-450 ms a call where lockstep
//! rounds take 270 (plain sockets did the same; with the handshake, 268-272).
//!
//! Identical results on every rank: halving-doubling produces each element
//! at a single rank, which finishes it before the all-gather copies it.
//! Doubling produces every element on all P ranks, so there each of them
//! finishes its own final result once. It is still bit-identical: in every
//! round both partners combine the same two operands, and by induction all
//! 2^k ranks of a group hold the same bits after round k, because every
//! reduction operator is commutative bit for bit (IEEE sum and product,
//! order-independent min and max, wrapping integers); `Finish` is a
//! deterministic function of those identical bits; the folded extra ranks
//! receive the finished bytes.

use std::ops::Range;

use super::{chunks, interleave, Buf, Loc, Schedule, Step};

/// Elements `range` of buffer `buf`.
fn at(buf: Buf, range: Range<usize>) -> Loc {
    Loc { buf, range }
}

/// Runs `core` on the largest power of two of ranks, folding the others in.
///
/// `core(p, buf, steps)` gets the number of ranks taking part and the buffer
/// holding this rank's operand (the input, or the output after folding); it
/// must leave the finished result in the output.
fn fold(
    rank: usize,
    world_size: usize,
    count: usize,
    chunk: usize,
    core: impl FnOnce(usize, Buf, &mut Schedule),
) -> Schedule {
    let w = world_size;
    let p = if w == 0 { 1 } else { 1 << w.ilog2() };
    let parts = chunks(0..count, chunk);
    let mut steps = Vec::new();
    if rank >= p {
        // An extra rank: hand the input over, take the result back.
        let peer = rank - p;
        steps.extend(parts.iter().map(|r| Step::Send {
            peer,
            from: Loc::input(r.clone()),
        }));
        steps.extend(parts.iter().map(|r| Step::Recv {
            peer,
            into: Loc::output(r.clone()),
        }));
        return steps;
    }
    let extra = (rank + p < w).then_some(rank + p);
    let buf = match extra {
        Some(peer) => {
            steps.extend(parts.iter().map(|r| Step::RecvReduce {
                peer,
                with: Loc::input(r.clone()),
                into: Loc::output(r.clone()),
            }));
            Buf::Output
        }
        None => Buf::Input,
    };
    core(p, buf, &mut steps);
    if let Some(peer) = extra {
        steps.extend(parts.iter().map(|r| Step::Send {
            peer,
            from: Loc::output(r.clone()),
        }));
    }
    steps
}

/// Starts a round in which `peer` and this rank send each other about `elems` elements (the
/// same figure on both sides) with a handshake if that is more than `ready_above`: a fence
/// (this rank is done with the rounds before), an empty message each way, and a fence (so
/// is the peer).
fn handshake(steps: &mut Schedule, peer: usize, elems: usize, ready_above: usize) {
    if elems > ready_above {
        steps.extend([
            Step::Fence,
            Step::Send {
                peer,
                from: Loc::input(0..0),
            },
            Step::Recv {
                peer,
                into: Loc::output(0..0),
            },
            Step::Fence,
        ]);
    }
}

/// Copies the operand to the output if it is still in the input, then finishes `range` by chunks.
fn finish(steps: &mut Schedule, buf: Buf, range: Range<usize>, chunk: usize) {
    if buf == Buf::Input {
        steps.push(Step::Copy {
            from: Loc::input(range.clone()),
            into: Loc::output(range.clone()),
        });
    }
    steps.extend(
        chunks(range, chunk)
            .into_iter()
            .map(|r| Step::Finish { at: Loc::output(r) }),
    );
}

/// The recursive-doubling all-reduce program of `rank` for `count` elements; rounds that
/// send more than `ready_above` elements start with a handshake (`usize::MAX`: none).
pub fn doubling(
    rank: usize,
    world_size: usize,
    count: usize,
    chunk: usize,
    ready_above: usize,
) -> Schedule {
    fold(rank, world_size, count, chunk, |p, mut buf, steps| {
        let parts = chunks(0..count, chunk);
        let mut dist = 1;
        while dist < p {
            let peer = rank ^ dist;
            handshake(steps, peer, count, ready_above);
            for r in &parts {
                steps.push(Step::Send {
                    peer,
                    from: at(buf, r.clone()),
                });
                steps.push(Step::RecvReduce {
                    peer,
                    with: at(buf, r.clone()),
                    into: Loc::output(r.clone()),
                });
            }
            buf = Buf::Output;
            dist *= 2;
        }
        finish(steps, buf, 0..count, chunk);
    })
}

/// The halving-doubling (Rabenseifner) all-reduce program of `rank` for `count` elements;
/// rounds that send more than `ready_above` elements start with a handshake.
pub fn halving_doubling(
    rank: usize,
    world_size: usize,
    count: usize,
    chunk: usize,
    ready_above: usize,
) -> Schedule {
    fold(rank, world_size, count, chunk, |p, mut buf, steps| {
        // Elements of segments lo..hi (segment s is the part rank s finishes).
        let segs = |lo: usize, hi: usize| count * lo / p..count * hi / p;
        let (mut lo, mut hi) = (0, p);
        // Reduce-scatter: keep the half of lo..hi that holds segment `rank`.
        let mut dist = p / 2;
        while dist > 0 {
            let peer = rank ^ dist;
            let mid = (lo + hi) / 2;
            let (keep, give) = if rank & dist == 0 {
                ((lo, mid), (mid, hi))
            } else {
                ((mid, hi), (lo, mid))
            };
            // Half of what both partners hold (their sends differ by an element at most):
            // the same on both sides, so both shake hands or neither does.
            handshake(steps, peer, segs(lo, hi).len() / 2, ready_above);
            interleave(
                steps,
                chunks(segs(give.0, give.1), chunk)
                    .into_iter()
                    .map(|r| Step::Send {
                        peer,
                        from: at(buf, r),
                    }),
                chunks(segs(keep.0, keep.1), chunk)
                    .into_iter()
                    .map(|r| Step::RecvReduce {
                        peer,
                        with: at(buf, r.clone()),
                        into: Loc::output(r),
                    }),
            );
            (lo, hi) = keep;
            buf = Buf::Output;
            dist /= 2;
        }
        // Now lo == rank: this rank alone holds segment `rank` fully reduced.
        finish(steps, buf, segs(lo, hi), chunk);
        // All-gather: swap what each half holds, doubling it every round.
        let mut dist = 1;
        while dist < p {
            let peer = rank ^ dist;
            let theirs = if rank & dist == 0 {
                (hi, hi + dist)
            } else {
                (lo - dist, lo)
            };
            let both = (lo.min(theirs.0), hi.max(theirs.1));
            handshake(steps, peer, segs(both.0, both.1).len() / 2, ready_above);
            interleave(
                steps,
                chunks(segs(lo, hi), chunk).into_iter().map(|r| Step::Send {
                    peer,
                    from: Loc::output(r),
                }),
                chunks(segs(theirs.0, theirs.1), chunk)
                    .into_iter()
                    .map(|r| Step::Recv {
                        peer,
                        into: Loc::output(r),
                    }),
            );
            (lo, hi) = both;
            dist *= 2;
        }
    })
}
