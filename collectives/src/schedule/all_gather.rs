//! Ring all-gather: every rank's block travels once around the ring.
//!
//! Rank r first puts its input into output block r (nothing to do in
//! place). In step k = 0..W-1 it sends block r-k to its right neighbour and
//! receives block r-k-1 from its left, chunk by chunk so the wire stays busy.
//! W-1 steps; each rank sends and receives (W-1) * count elements, which is
//! bandwidth-optimal.

use super::{chunks, interleave, Loc, Schedule, Step};

/// The ring all-gather program of `rank`: `count` input elements, `world_size * count` output.
pub fn ring(rank: usize, world_size: usize, count: usize, chunk: usize) -> Schedule {
    let w = world_size;
    let right = (rank + 1) % w;
    let left = (rank + w - 1) % w;
    // Output block r-k (mod w), in chunks.
    let block = |k: usize| {
        let q = (rank + w - k % w) % w;
        chunks(q * count..(q + 1) * count, chunk)
    };
    let mut steps = vec![Step::Copy {
        from: Loc::input(0..count),
        into: Loc::output(rank * count..(rank + 1) * count),
    }];
    for k in 0..w - 1 {
        // The own block goes out straight from the input; later blocks from the output.
        let from = |r: std::ops::Range<usize>| {
            if k == 0 {
                Loc::input(r.start - rank * count..r.end - rank * count)
            } else {
                Loc::output(r)
            }
        };
        interleave(
            &mut steps,
            block(k).into_iter().map(|r| Step::Send {
                peer: right,
                from: from(r),
            }),
            block(k + 1).into_iter().map(|r| Step::Recv {
                peer: left,
                into: Loc::output(r),
            }),
        );
    }
    steps
}
