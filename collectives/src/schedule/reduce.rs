//! Reduce to a root: a pipelined binary tree, or a pipelined chain.
//!
//! Both move the buffer chunk by chunk so that every link works at once.
//! Tree: the in-order binary tree with ranks renumbered so the root is 0;
//! ceil(log2 W) hops, an interior rank receives up to 2x and sends 1x the
//! buffer, so it suits small and medium messages. Chain: root+W-1 -> ... ->
//! root+1 -> root (the broadcast chain reversed); W-1 hops, every rank
//! receives and sends the buffer once, so large messages move at link speed.
//! The root finishes each chunk once, as its last contribution arrives.
//! Non-root ranks use their output as the partial-sum buffer.

use super::tree::{reduce_up, rooted, Node};
use super::{chunks, Schedule};

/// The tree reduce program of `rank`: `count` elements reduced into `root`'s output.
pub fn tree(rank: usize, world_size: usize, root: usize, count: usize, chunk: usize) -> Schedule {
    let node = rooted(rank, world_size, root);
    let mut steps = Vec::new();
    for r in chunks(0..count, chunk) {
        reduce_up(&mut steps, &node, r);
    }
    steps
}

/// The chain reduce program of `rank`: `count` elements reduced into `root`'s output.
pub fn chain(rank: usize, world_size: usize, root: usize, count: usize, chunk: usize) -> Schedule {
    let w = world_size;
    let pos = (rank + w - root) % w;
    // Data flows from position w-1 down to position 0 (the root).
    let node = Node {
        parent: (pos > 0).then_some((rank + w - 1) % w),
        children: if pos + 1 < w {
            vec![(rank + 1) % w]
        } else {
            Vec::new()
        },
    };
    let mut steps = Vec::new();
    for r in chunks(0..count, chunk) {
        reduce_up(&mut steps, &node, r);
    }
    steps
}
