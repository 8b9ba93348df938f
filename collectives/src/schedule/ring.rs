//! Ring all-reduce: a reduce-scatter then an all-gather around the ring.
//!
//! The buffer is cut into `world_size` segments. In W-1 reduce-scatter
//! steps each rank passes a partial result to its right neighbour, so rank r
//! ends owning the full reduction of segment r+1; in W-1 all-gather steps
//! the finished segments travel around once more. Every segment is split
//! into chunks so that the executor pipelines wire and reduction. Each rank
//! sends and receives 2(W-1)/W of the buffer: bandwidth-optimal.

use super::{chunks, interleave, split, Buf, Schedule, Step};

/// The ring all-reduce program of `rank` for `count` elements.
pub fn all_reduce(rank: usize, world_size: usize, count: usize, chunk: usize) -> Schedule {
    let w = world_size;
    if w == 1 {
        return vec![
            Step::Copy { region: 0..count },
            Step::Finish { region: 0..count },
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
        let buf = if k == 0 { Buf::Input } else { Buf::Output };
        interleave(
            &mut steps,
            seg(k).into_iter().map(|region| Step::Send {
                peer: right,
                buf,
                region,
            }),
            seg(k + 1).into_iter().map(|region| Step::RecvReduce {
                peer: left,
                src: Buf::Input,
                region,
            }),
        );
    }
    // This rank now owns segment r+1 (that is, r-(w-1)).
    steps.extend(seg(w - 1).into_iter().map(|region| Step::Finish { region }));
    // All-gather: at step k send segment r+1-k, receive segment r-k.
    for k in 0..w - 1 {
        interleave(
            &mut steps,
            seg(w - 1 + k).into_iter().map(|region| Step::Send {
                peer: right,
                buf: Buf::Output,
                region,
            }),
            seg(w + k)
                .into_iter()
                .map(|region| Step::Recv { peer: left, region }),
        );
    }
    steps
}
