//! Ring all-reduce: a reduce-scatter then an all-gather around the ring.
//!
//! The buffer is cut into `world_size` segments. In W-1 reduce-scatter
//! steps each rank passes a partial result to its right neighbour, so rank r
//! ends owning the full reduction of segment r+1; in W-1 all-gather steps
//! the finished segments travel around once more. Every segment is split
//! into chunks so that the executor pipelines wire and reduction. Each rank
//! sends and receives 2(W-1)/W of the buffer: bandwidth-optimal.

use super::{chunks, interleave, split, Loc, Schedule, Step};

/// The ring all-reduce program of `rank` for `count` elements.
pub fn all_reduce(rank: usize, world_size: usize, count: usize, chunk: usize) -> Schedule {
    let w = world_size;
    if w == 1 {
        let all = 0..count;
        return vec![
            Step::Copy {
                from: Loc::input(all.clone()),
                into: Loc::output(all.clone()),
            },
            Step::Finish {
                at: Loc::output(all),
            },
        ];
    }
    let segs = split(count, w);
    let right = (rank + 1) % w;
    let left = (rank + w - 1) % w;
    // Segment r-k (mod w), in chunks.
    let seg = |k: usize| chunks(segs[(rank + w - k % w) % w].clone(), chunk);
    let mut steps = Vec::new();
    // Reduce-scatter: at step k send segment r-k, reduce segment r-k-1 into it.
    for k in 0..w - 1 {
        let from = if k == 0 { Loc::input } else { Loc::output };
        interleave(
            &mut steps,
            seg(k).into_iter().map(|r| Step::Send {
                peer: right,
                from: from(r),
            }),
            seg(k + 1).into_iter().map(|r| Step::RecvReduce {
                peer: left,
                with: Loc::input(r.clone()),
                into: Loc::output(r),
            }),
        );
    }
    // This rank now owns segment r+1 (that is, r-(w-1)).
    steps.extend(
        seg(w - 1)
            .into_iter()
            .map(|r| Step::Finish { at: Loc::output(r) }),
    );
    // All-gather: at step k send segment r+1-k, receive segment r-k.
    for k in 0..w - 1 {
        interleave(
            &mut steps,
            seg(w - 1 + k).into_iter().map(|r| Step::Send {
                peer: right,
                from: Loc::output(r),
            }),
            seg(w + k).into_iter().map(|r| Step::Recv {
                peer: left,
                into: Loc::output(r),
            }),
        );
    }
    steps
}
