//! Broadcast: a pipelined chain, or a pipelined binary tree.

use super::tree::{btree, push_down};
use super::{chunks, Buf, Schedule, Step};

/// Chain broadcast: root -> root+1 -> ... -> root-1, chunk by chunk.
///
/// Every link carries the buffer once, so large messages move at link
/// speed; latency grows with W.
pub fn chain(rank: usize, world_size: usize, root: usize, count: usize, chunk: usize) -> Schedule {
    let w = world_size;
    let pos = (rank + w - root) % w;
    let next = (pos + 1 < w).then_some((rank + 1) % w);
    chunks(0..count, chunk)
        .into_iter()
        .flat_map(|region| {
            let mut steps = Vec::new();
            if pos == 0 {
                steps.push(Step::Copy {
                    region: region.clone(),
                });
            } else {
                steps.push(Step::Recv {
                    peer: (rank + w - 1) % w,
                    region: region.clone(),
                });
            }
            if let Some(next) = next {
                let buf = if pos == 0 { Buf::Input } else { Buf::Output };
                steps.push(Step::Send {
                    peer: next,
                    buf,
                    region,
                });
            }
            steps
        })
        .collect()
}

/// Tree broadcast: the binary tree with ranks renumbered so `root` is 0.
///
/// Latency grows with log2(W); interior ranks send twice per chunk.
pub fn tree(rank: usize, world_size: usize, root: usize, count: usize, chunk: usize) -> Schedule {
    let w = world_size;
    let virt = btree((rank + w - root) % w, w);
    let real = |v: usize| (v + root) % w;
    let node = super::tree::Node {
        parent: virt.parent.map(real),
        children: virt.children.into_iter().map(real).collect(),
    };
    let mut steps = Vec::new();
    for region in chunks(0..count, chunk) {
        if rank == root {
            steps.push(Step::Copy {
                region: region.clone(),
            });
        }
        push_down(&mut steps, &node, region);
    }
    steps
}
