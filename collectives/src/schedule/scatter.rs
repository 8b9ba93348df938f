//! Direct scatter: the root sends every rank its block.
//!
//! The root copies its own block and sends block q of its input to rank q;
//! all sends are posted at once. One step: the root sends (W-1) * count
//! elements (its link is the bottleneck), every other rank receives
//! `count`. In place, the root's output is input block `root`. Non-root
//! inputs are never read; `count == 0` sends nothing.

use super::{Loc, Schedule, Step};

/// The direct scatter program of `rank`: `world_size * count` input elements at the root, `count` output.
pub fn direct(rank: usize, world_size: usize, root: usize, count: usize) -> Schedule {
    if rank != root {
        return if count > 0 {
            vec![Step::Recv {
                peer: root,
                into: Loc::output(0..count),
            }]
        } else {
            Vec::new()
        };
    }
    let block = |q: usize| q * count..(q + 1) * count;
    let mut steps = Vec::new();
    if count > 0 {
        steps.extend(
            (1..world_size)
                .map(|k| (root + k) % world_size)
                .map(|q| Step::Send {
                    peer: q,
                    from: Loc::input(block(q)),
                }),
        );
    }
    steps.push(Step::Copy {
        from: Loc::input(block(root)),
        into: Loc::output(0..count),
    });
    steps
}
