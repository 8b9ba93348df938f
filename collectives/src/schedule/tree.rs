//! Binary trees, passing chunks up (reducing) and down them, and the
//! double-binary-tree all-reduce.
//!
//! The tree is the in-order binary tree on rank numbers: a rank's level is
//! its lowest set bit, so odd ranks are leaves and rank 0 is a root with a
//! single child. The second tree mirrors the first (even world sizes) or
//! shifts it by one (odd), so that nearly every rank is a leaf in one tree
//! and interior in the other; each tree carries half of the data, which
//! balances the links. Latency grows with log2(W) instead of W.

use std::ops::Range;

use super::{chunks, split, Loc, Schedule, Step};

/// A rank's place in a tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// The parent's rank, or `None` at the root.
    pub parent: Option<usize>,
    /// The children's ranks (at most two).
    pub children: Vec<usize>,
}

/// `rank`'s place in the in-order binary tree over `0..n` rooted at 0.
pub fn btree(rank: usize, n: usize) -> Node {
    // The lowest set bit of `rank` (for rank 0: the first power of two >= n).
    let mut bit = 1;
    while bit < n && bit & rank == 0 {
        bit <<= 1;
    }
    if rank == 0 {
        let children = if n > 1 { vec![bit >> 1] } else { Vec::new() };
        return Node {
            parent: None,
            children,
        };
    }
    let mut parent = (rank ^ bit) | (bit << 1);
    if parent >= n {
        parent = rank ^ bit;
    }
    let mut children = Vec::new();
    let mut low = bit >> 1;
    if low > 0 {
        children.push(rank - low);
        while low > 0 && rank + low >= n {
            low >>= 1;
        }
        if low > 0 {
            children.push(rank + low);
        }
    }
    Node {
        parent: Some(parent),
        children,
    }
}

/// `rank`'s place in the binary tree over `0..n` renumbered so that `root` is its root.
pub fn rooted(rank: usize, n: usize, root: usize) -> Node {
    let virt = btree((rank + n - root) % n, n);
    let real = |v: usize| (v + root) % n;
    Node {
        parent: virt.parent.map(real),
        children: virt.children.into_iter().map(real).collect(),
    }
}

/// `rank`'s place in tree `t` (0 or 1) of the double binary tree over `0..n`.
pub fn dtree(rank: usize, n: usize, t: usize) -> Node {
    if t == 0 {
        return btree(rank, n);
    }
    // Tree 1 relabels ranks (mirror for even n, shift by one for odd n),
    // builds the same shape, and maps back.
    let even = n % 2 == 0;
    let to = |r: usize| if even { n - 1 - r } else { (r + n - 1) % n };
    let from = |r: usize| if even { n - 1 - r } else { (r + 1) % n };
    let node = btree(to(rank), n);
    Node {
        parent: node.parent.map(&from),
        children: node.children.into_iter().map(&from).collect(),
    }
}

/// Hops from `rank` up to the root of tree `t` of the double binary tree over `0..n`.
fn depth(rank: usize, n: usize, t: usize) -> usize {
    let (mut at, mut hops) = (rank, 0);
    while let Some(parent) = dtree(at, n, t).parent {
        at = parent;
        hops += 1;
    }
    hops
}

/// The double-binary-tree all-reduce program of `rank` for `count` elements.
///
/// Each tree reduces its half up to its root chunk by chunk, the root
/// finishes each chunk, and it goes back down the same tree. The program
/// runs in time slots, as a systolic pipeline does: with `D` the deepest
/// rank's depth, a rank at depth `d` reduces chunk `c` of a tree in slot
/// `c + D - d` (a slot after its children sent it) and passes it down in
/// slot `c + D + d`. A rank posts its steps in program order, so laying the
/// program out by slot keeps one tree's chunk from waiting behind another
/// chunk that arrives later. Within a slot a leaf's send (which needs
/// nothing) comes first, then the receives, then the sends that wait for
/// them.
pub fn all_reduce(rank: usize, world_size: usize, count: usize, chunk: usize) -> Schedule {
    let halves = split(count, 2);
    let trees = [0, 1].map(|t| {
        let node = dtree(rank, world_size, t);
        // Which children are leaves: they send a chunk the slot they take it up.
        let leaves: Vec<bool> = node
            .children
            .iter()
            .map(|&c| dtree(c, world_size, t).children.is_empty())
            .collect();
        (node, leaves, depth(rank, world_size, t))
    });
    // ceil(log2 W): rank 1's path up passes 2, 4, ... to the root in both trees' shape.
    let deepest = world_size.max(1).next_power_of_two().trailing_zeros() as usize;
    let parts: Vec<Vec<_>> = halves.iter().map(|h| chunks(h.clone(), chunk)).collect();
    let rounds = parts.iter().map(Vec::len).max().unwrap_or(0);
    // The chunk each tree `t` takes up (`down`: down) in a slot.
    let at = |slot: usize, down: bool| -> Vec<(usize, &Node, &[bool], Range<usize>)> {
        trees
            .iter()
            .zip(&parts)
            .enumerate()
            .filter_map(|(t, ((node, leaves, d), part))| {
                let lag = if down { deepest + d } else { deepest - d };
                let c = slot.checked_sub(lag)?;
                Some((t, node, leaves.as_slice(), part.get(c)?.clone()))
            })
            .collect()
    };
    let mut steps = Vec::new();
    for slot in 0..rounds + 2 * deepest + 1 {
        let (up, down) = (at(slot, false), at(slot, true));
        let (leaves, inner): (Vec<_>, Vec<_>) = up
            .iter()
            .partition(|(_, node, ..)| node.children.is_empty());
        for (_, node, _, r) in leaves {
            pass_up(&mut steps, node, r.clone());
        }
        // A leaf sends first (its send needs nothing), so a rank receives from its leaf
        // children first, and then in tree order: two messages from one child in one
        // slot are received as they were sent.
        let mut gathers: Vec<(bool, usize, usize, &Range<usize>)> = up
            .iter()
            .flat_map(|(t, node, leaves, r)| {
                node.children
                    .iter()
                    .zip(*leaves)
                    .map(move |(&child, &leaf)| (!leaf, *t, child, r))
            })
            .collect();
        gathers.sort_by_key(|&(inner, t, ..)| (inner, t));
        let mut first = [true; 2];
        for (_, t, child, r) in gathers {
            receive_child(&mut steps, child, std::mem::take(&mut first[t]), r.clone());
        }
        for (_, node, _, r) in &down {
            receive_down(&mut steps, node, Loc::output(r.clone()));
        }
        for (_, node, _, r) in inner {
            pass_up(&mut steps, node, r.clone());
        }
        for (_, node, _, r) in down {
            send_down(&mut steps, node, Loc::output(r));
        }
    }
    steps
}

/// Reduces elements `r` from the children into the output and passes the
/// result to the parent; the root (no parent) finishes it in its output.
pub(super) fn reduce_up(steps: &mut Schedule, node: &Node, r: Range<usize>) {
    gather_up(steps, node, r.clone());
    pass_up(steps, node, r);
}

/// Receives elements `r` from each child, reducing them into the output.
fn gather_up(steps: &mut Schedule, node: &Node, r: Range<usize>) {
    for (i, &child) in node.children.iter().enumerate() {
        receive_child(steps, child, i == 0, r.clone());
    }
}

/// Receives elements `r` from `child` and reduces them into the output: the
/// `first` child's with the input, later ones' with the partial result.
fn receive_child(steps: &mut Schedule, child: usize, first: bool, r: Range<usize>) {
    let with = if first {
        Loc::input(r.clone())
    } else {
        Loc::output(r.clone())
    };
    steps.push(Step::RecvReduce {
        peer: child,
        with,
        into: Loc::output(r),
    });
}

/// Sends the reduced elements `r` (a leaf's input) to the parent; the root
/// finishes them in its output.
fn pass_up(steps: &mut Schedule, node: &Node, r: Range<usize>) {
    let result = if node.children.is_empty() {
        Loc::input(r.clone())
    } else {
        Loc::output(r.clone())
    };
    match node.parent {
        Some(parent) => steps.push(Step::Send {
            peer: parent,
            from: result,
        }),
        None => {
            steps.push(Step::Copy {
                from: result,
                into: Loc::output(r.clone()),
            });
            steps.push(Step::Finish { at: Loc::output(r) });
        }
    }
}

/// Receive `at` from the parent (if any), then pass it to the children.
pub(super) fn push_down(steps: &mut Schedule, node: &Node, at: Loc) {
    receive_down(steps, node, at.clone());
    send_down(steps, node, at);
}

/// Receives `at` from the parent, if there is one.
fn receive_down(steps: &mut Schedule, node: &Node, at: Loc) {
    if let Some(parent) = node.parent {
        steps.push(Step::Recv {
            peer: parent,
            into: at,
        });
    }
}

/// Sends `at` to each child.
fn send_down(steps: &mut Schedule, node: &Node, at: Loc) {
    for &child in &node.children {
        steps.push(Step::Send {
            peer: child,
            from: at.clone(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank but the root has exactly one parent that lists it as a child.
    fn check_tree(n: usize, t: usize) {
        let nodes: Vec<Node> = (0..n).map(|r| dtree(r, n, t)).collect();
        let roots: Vec<usize> = (0..n).filter(|&r| nodes[r].parent.is_none()).collect();
        assert_eq!(roots.len(), 1, "n={n} t={t}");
        for (r, node) in nodes.iter().enumerate() {
            assert!(node.children.len() <= 2);
            if let Some(p) = node.parent {
                assert!(
                    p < n && nodes[p].children.contains(&r),
                    "n={n} t={t} rank {r} parent {p}"
                );
            }
            for &c in &node.children {
                assert_eq!(nodes[c].parent, Some(r));
            }
        }
        // Connected: walking up from every rank reaches the root within n steps.
        for r in 0..n {
            let (mut at, mut hops) = (r, 0);
            while let Some(p) = nodes[at].parent {
                at = p;
                hops += 1;
                assert!(hops <= n);
            }
            assert_eq!(at, roots[0]);
        }
    }

    #[test]
    fn both_trees_are_trees_for_every_size() {
        for n in 1..=130 {
            check_tree(n, 0);
            check_tree(n, 1);
        }
        check_tree(1000, 0);
        check_tree(1000, 1);
    }

    #[test]
    fn the_tree_matches_its_picture() {
        // 0 -> 8; 8 -> 4, 12; 4 -> 2, 6; 2 -> 1, 3 (n = 16)
        assert_eq!(
            btree(0, 16),
            Node {
                parent: None,
                children: vec![8]
            }
        );
        assert_eq!(
            btree(8, 16),
            Node {
                parent: Some(0),
                children: vec![4, 12]
            }
        );
        assert_eq!(
            btree(4, 16),
            Node {
                parent: Some(8),
                children: vec![2, 6]
            }
        );
        assert_eq!(
            btree(3, 16),
            Node {
                parent: Some(2),
                children: vec![]
            }
        );
        assert_eq!(
            btree(4, 5),
            Node {
                parent: Some(0),
                children: vec![2]
            }
        );
    }

    #[test]
    fn no_rank_lies_deeper_than_ceil_log2() {
        for n in 1..=130 {
            let deepest = (0..n).map(|r| depth(r, n, 0).max(depth(r, n, 1))).max();
            let bound = (n as f64).log2().ceil() as usize;
            assert_eq!(deepest, Some(bound), "n={n}");
        }
    }

    #[test]
    fn most_ranks_are_leaves_in_one_tree() {
        let n = 16;
        let interior_in_both = (0..n)
            .filter(|&r| !dtree(r, n, 0).children.is_empty() && !dtree(r, n, 1).children.is_empty())
            .count();
        assert!(interior_in_both <= 2, "{interior_in_both}");
    }
}
