//! Dissemination barrier: ceil(log2 W) rounds of empty messages.
//!
//! In round k every rank signals rank r+2^k and waits for rank r-2^k. After
//! the last round each rank has heard, directly or through others, from
//! every rank, so none leaves before all have arrived.

use super::{Loc, Schedule, Step};

/// The dissemination barrier program of `rank`.
pub fn dissemination(rank: usize, world_size: usize) -> Schedule {
    let w = world_size;
    let mut steps = Vec::new();
    let mut dist = 1;
    while dist < w {
        steps.push(Step::Send {
            peer: (rank + dist) % w,
            from: Loc::input(0..0),
        });
        steps.push(Step::Recv {
            peer: (rank + w - dist) % w,
            into: Loc::output(0..0),
        });
        steps.push(Step::Fence);
        dist *= 2;
    }
    steps
}
