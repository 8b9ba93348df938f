//! Ring reduce-scatter: partial sums travel once around the ring.
//!
//! In step k = 0..W-1 rank r sends its partial sum of block r-k-1 to its
//! right neighbour and receives the partial sum of block r-k-2 from its
//! left, adding its own input block. In the last step the arriving block is
//! block r itself: it is reduced straight into the output and finished
//! there. Partial sums alternate between two scratch areas of `count`
//! elements. W-1 steps; each rank sends and receives (W-1) * count elements
//! (bandwidth-optimal). Input and output must not overlap, except that the
//! output may be input block `rank` itself (it is read only in the last step).

use super::{chunks, interleave, Loc, Schedule, Step};

/// The ring reduce-scatter program of `rank`: `world_size * count` input elements, `count` output.
pub fn ring(rank: usize, world_size: usize, count: usize, chunk: usize) -> Schedule {
    let w = world_size;
    let right = (rank + 1) % w;
    let left = (rank + w - 1) % w;
    // Input block r-j (mod w), as chunks relative to the block start.
    let base = |j: usize| (rank + w - j % w) % w * count;
    let parts = chunks(0..count, chunk);
    let shift = |r: &std::ops::Range<usize>, by: usize| r.start + by..r.end + by;
    let mut steps = Vec::new();
    if w == 1 {
        steps.push(Step::Copy {
            from: Loc::input(0..count),
            into: Loc::output(0..count),
        });
    }
    for k in 0..w - 1 {
        // Sent: block r-k-1, from the input at first, then from the partial sums
        // that arrived in the previous step (scratch area (k-1) % 2).
        let sends = parts.iter().map(|r| Step::Send {
            peer: right,
            from: if k == 0 {
                Loc::input(shift(r, base(k + 1)))
            } else {
                Loc::scratch(shift(r, (k - 1) % 2 * count))
            },
        });
        // Received: block r-k-2, plus this rank's input; the last one is block r.
        let recvs = parts.iter().map(|r| Step::RecvReduce {
            peer: left,
            with: Loc::input(shift(r, base(k + 2))),
            into: if k + 2 == w {
                Loc::output(r.clone())
            } else {
                Loc::scratch(shift(r, k % 2 * count))
            },
        });
        interleave(&mut steps, sends, recvs);
    }
    steps.extend(
        parts
            .into_iter()
            .map(|r| Step::Finish { at: Loc::output(r) }),
    );
    steps
}
