//! Direct gather: every rank sends its input straight to the root.
//!
//! The root copies its own block and receives block q from rank q into
//! output block q; all receives are posted at once. One step: a non-root
//! rank sends `count` elements, the root receives (W-1) * count (its link is
//! the bottleneck). In place, the root's input is output block `root`.
//! Non-root outputs are never touched; `count == 0` sends nothing.

use super::{Loc, Schedule, Step};

/// The direct gather program of `rank`: `count` input elements, `world_size * count` at the root.
pub fn direct(rank: usize, world_size: usize, root: usize, count: usize) -> Schedule {
    if rank != root {
        return if count > 0 {
            vec![Step::Send {
                peer: root,
                from: Loc::input(0..count),
            }]
        } else {
            Vec::new()
        };
    }
    let block = |q: usize| q * count..(q + 1) * count;
    let mut steps = vec![Step::Copy {
        from: Loc::input(0..count),
        into: Loc::output(block(root)),
    }];
    if count > 0 {
        steps.extend(
            (1..world_size)
                .map(|k| (root + k) % world_size)
                .map(|q| Step::Recv {
                    peer: q,
                    into: Loc::output(block(q)),
                }),
        );
    }
    steps
}
