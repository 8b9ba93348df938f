//! Broadcast: a pipelined chain, or a pipelined binary tree.

use super::tree::{push_down, rooted};
use super::{chunks, Loc, Schedule, Step};

/// Chain broadcast: root -> root+1 -> ... -> root-1, chunk by chunk.
///
/// Every link carries the buffer once, so large messages move at link
/// speed; latency grows with W.
pub fn chain(rank: usize, world_size: usize, root: usize, count: usize, chunk: usize) -> Schedule {
    let w = world_size;
    let pos = (rank + w - root) % w;
    let next = (pos + 1 < w).then_some((rank + 1) % w);
    let mut steps = Vec::new();
    for r in chunks(0..count, chunk) {
        if pos != 0 {
            steps.push(Step::Recv {
                peer: (rank + w - 1) % w,
                into: Loc::output(r.clone()),
            });
        }
        if let Some(next) = next {
            let from = if pos == 0 {
                Loc::input(r.clone())
            } else {
                Loc::output(r.clone())
            };
            steps.push(Step::Send { peer: next, from });
        }
        // The root's own copy comes after its send is posted, so the two overlap.
        if pos == 0 {
            steps.push(Step::Copy {
                from: Loc::input(r.clone()),
                into: Loc::output(r),
            });
        }
    }
    steps
}

/// Tree broadcast: the binary tree with ranks renumbered so `root` is 0.
///
/// Latency grows with log2(W); interior ranks send twice per chunk.
pub fn tree(rank: usize, world_size: usize, root: usize, count: usize, chunk: usize) -> Schedule {
    let node = rooted(rank, world_size, root);
    let mut steps = Vec::new();
    for r in chunks(0..count, chunk) {
        if rank == root {
            // Sends first, from the input, so the root's own copy overlaps them.
            push_down(&mut steps, &node, Loc::input(r.clone()));
            steps.push(Step::Copy {
                from: Loc::input(r.clone()),
                into: Loc::output(r),
            });
        } else {
            push_down(&mut steps, &node, Loc::output(r));
        }
    }
    steps
}
