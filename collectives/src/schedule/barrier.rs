//! Dissemination barrier: ceil(log2 W) rounds of empty messages.
//!
//! In round k every rank signals rank r+2^k and waits for rank r-2^k (or, when
//! W is a power of two, exchanges with rank r XOR 2^k). After the last round
//! each rank has heard, directly or through others, from every rank, so none
//! leaves before all have arrived.

use super::{Loc, Schedule, Step};

/// The dissemination barrier program of `rank`.
///
/// When W is a power of two, round k pairs rank r with r XOR 2^k instead (a butterfly): the
/// same messages and rounds, but each goes back over the connection it came in on, so a TCP
/// acknowledgement rides on the reply rather than costing a packet of its own.
pub fn dissemination(rank: usize, world_size: usize) -> Schedule {
    let w = world_size;
    let butterfly = w.is_power_of_two();
    let mut steps = Vec::new();
    let mut dist = 1;
    while dist < w {
        let (to, from) = match butterfly {
            true => (rank ^ dist, rank ^ dist),
            false => ((rank + dist) % w, (rank + w - dist) % w),
        };
        steps.push(Step::Send {
            peer: to,
            from: Loc::input(0..0),
        });
        steps.push(Step::Recv {
            peer: from,
            into: Loc::output(0..0),
        });
        steps.push(Step::Fence);
        dist *= 2;
    }
    steps
}
