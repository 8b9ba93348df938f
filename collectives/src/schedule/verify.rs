//! A schedule verifier: runs every rank's schedule against the others
//! with symbolic data, proving a schedule correct for many world sizes
//! without a socket: messages match in order and in length, nothing
//! deadlocks, every contribution is reduced exactly once, and `Finish` is
//! applied exactly once to fully reduced data. Each value also records the
//! shape of its reduction tree (up to swapping operands), so tests can prove
//! that all ranks end with bit-identical results under any commutative,
//! non-associative operator such as floating-point addition.

use std::collections::{HashMap, VecDeque};

use super::{
    all_gather, all_to_all, barrier, broadcast, gather, hierarchical, recursive, reduce,
    reduce_scatter, ring, scatter, tree, Buf, Loc, Schedule, Step,
};

/// A symbolic element: the wrapping sum of its contributions' labels,
/// how many contributions it holds, and whether it was finished.
///
/// `shape` hashes the order of reduction up to commutativity; `==` ignores
/// it (different algorithms may reduce in different orders), tests that
/// need bit-identical results compare it explicitly.
#[derive(Debug, Clone, Copy)]
pub(super) struct Val {
    sum: u64,
    count: u32,
    finished: bool,
    shape: u64,
}

impl PartialEq for Val {
    fn eq(&self, other: &Val) -> bool {
        (self.sum, self.count, self.finished) == (other.sum, other.count, other.finished)
    }
}

impl Val {
    /// Element `i` of `rank`'s input, as it starts.
    fn input(rank: usize, i: usize) -> Val {
        let sum = label(rank, i);
        Val {
            sum,
            count: 1,
            finished: false,
            shape: sum,
        }
    }

    /// The finished reduction of element `i` over all `world` inputs.
    fn reduced(world: usize, i: usize) -> Val {
        Val {
            sum: (0..world).fold(0u64, |s, q| s.wrapping_add(label(q, i))),
            count: world as u32,
            finished: true,
            shape: 0,
        }
    }
}

const GARBAGE: Val = Val {
    sum: 0xbad,
    count: u32::MAX,
    finished: false,
    shape: 0xbad,
};

fn label(rank: usize, i: usize) -> u64 {
    mix((rank as u64) << 32 ^ i as u64)
}

/// A 64-bit mixing function (splitmix64's finaliser).
fn mix(x: u64) -> u64 {
    let mut x = x ^ 0x9e37_79b9_7f4a_7c15;
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Where a rank's buffers sit in its flat simulated memory (element offsets).
#[derive(Debug, Clone, Copy)]
pub(super) struct Layout {
    /// Offset and length of the input.
    pub input: (usize, usize),
    /// Offset and length of the output.
    pub output: (usize, usize),
}

impl Layout {
    /// Separate input and output buffers of the given lengths.
    pub fn apart(input: usize, output: usize) -> Layout {
        Layout {
            input: (0, input),
            output: (input, output),
        }
    }

    /// The input lies inside the output, starting at `offset` (in place).
    pub fn inside(input: usize, output: usize, offset: usize) -> Layout {
        Layout {
            input: (offset, input),
            output: (0, output),
        }
    }

    /// The output lies inside the input, starting at `offset` (in place).
    pub fn around(input: usize, output: usize, offset: usize) -> Layout {
        Layout {
            input: (0, input),
            output: (offset, output),
        }
    }

    fn end(&self) -> usize {
        (self.input.0 + self.input.1).max(self.output.0 + self.output.1)
    }
}

struct Rank {
    mem: Vec<Val>,
    layout: Layout,
    pc: usize,
}

impl Rank {
    /// The flat memory range of `loc`; panics if it leaves its buffer.
    fn at(&self, loc: &Loc, r: usize) -> std::ops::Range<usize> {
        let (base, len) = match loc.buf {
            Buf::Input => self.layout.input,
            Buf::Output => self.layout.output,
            Buf::Scratch => (self.layout.end(), usize::MAX),
        };
        assert!(
            loc.range.end <= len,
            "rank {r}: {loc:?} outside its buffer of {len}"
        );
        base + loc.range.start..base + loc.range.end
    }
}

/// Runs the programs over the given layouts; returns each rank's output.
pub(super) fn run(programs: &[Schedule], layouts: &[Layout]) -> Vec<Vec<Val>> {
    let mut ranks: Vec<Rank> = layouts
        .iter()
        .enumerate()
        .map(|(r, &layout)| {
            let scratch = super::scratch_len(&programs[r]);
            let mut mem = vec![GARBAGE; layout.end() + scratch];
            let (base, len) = layout.input;
            for i in 0..len {
                mem[base + i] = Val::input(r, i);
            }
            Rank { mem, layout, pc: 0 }
        })
        .collect();
    let mut wires: HashMap<(usize, usize), VecDeque<Vec<Val>>> = HashMap::new();
    loop {
        let mut progressed = false;
        for (r, rank) in ranks.iter_mut().enumerate() {
            while let Some(step) = programs[r].get(rank.pc) {
                match step {
                    Step::Send { peer, from } => {
                        assert_ne!(*peer, r, "rank {r} sends to itself");
                        assert!(*peer < programs.len(), "rank {r} sends to {peer}");
                        let data = rank.mem[rank.at(from, r)].to_vec();
                        wires.entry((r, *peer)).or_default().push_back(data);
                    }
                    Step::Recv { peer, into: to } | Step::RecvReduce { peer, into: to, .. } => {
                        assert_ne!(*peer, r, "rank {r} receives from itself");
                        assert!(*peer < programs.len(), "rank {r} receives from {peer}");
                        let Some(data) = wires.get_mut(&(*peer, r)).and_then(VecDeque::pop_front)
                        else {
                            break;
                        };
                        assert_eq!(
                            data.len(),
                            to.len(),
                            "rank {r} step {}: length mismatch from {peer}",
                            rank.pc
                        );
                        assert_ne!(to.buf, Buf::Input, "rank {r} writes its input");
                        let result = match step {
                            Step::RecvReduce { with, .. } => {
                                let own = rank.mem[rank.at(with, r)].to_vec();
                                own.iter()
                                    .zip(&data)
                                    .map(|(a, b)| combine(*a, *b, r))
                                    .collect()
                            }
                            _ => data,
                        };
                        let at = rank.at(to, r);
                        rank.mem[at].copy_from_slice(&result);
                    }
                    Step::Copy { from, into } => {
                        assert_eq!(from.len(), into.len());
                        assert_ne!(into.buf, Buf::Input, "rank {r} writes its input");
                        let data = rank.mem[rank.at(from, r)].to_vec();
                        let at = rank.at(into, r);
                        rank.mem[at].copy_from_slice(&data);
                    }
                    Step::Finish { at } => {
                        assert_ne!(at.buf, Buf::Input, "rank {r} writes its input");
                        let at = rank.at(at, r);
                        for v in &mut rank.mem[at] {
                            assert!(!v.finished, "rank {r} finishes twice");
                            v.finished = true;
                        }
                    }
                    Step::Fence => {}
                }
                rank.pc += 1;
                progressed = true;
            }
        }
        if ranks
            .iter()
            .enumerate()
            .all(|(r, rank)| rank.pc == programs[r].len())
        {
            assert!(
                wires.values().all(VecDeque::is_empty),
                "messages left unreceived"
            );
            return ranks
                .into_iter()
                .map(|rank| {
                    let (base, len) = rank.layout.output;
                    rank.mem[base..base + len].to_vec()
                })
                .collect();
        }
        assert!(
            progressed,
            "deadlock: {:?}",
            ranks.iter().map(|r| r.pc).collect::<Vec<_>>()
        );
    }
}

fn combine(a: Val, b: Val, r: usize) -> Val {
    assert!(!a.finished && !b.finished, "rank {r} reduces finished data");
    assert!(
        a.count != GARBAGE.count && b.count != GARBAGE.count,
        "rank {r} reduces unwritten data"
    );
    let (lo, hi) = (a.shape.min(b.shape), a.shape.max(b.shape));
    Val {
        sum: a.sum.wrapping_add(b.sum),
        count: a.count + b.count,
        finished: false,
        shape: mix(mix(lo) ^ hi.rotate_left(29)),
    }
}

/// The all-reduce layouts: apart, or in place.
fn all_reduce_layouts(world: usize, count: usize, in_place: bool) -> Vec<Layout> {
    let layout = if in_place {
        Layout::inside(count, count, 0)
    } else {
        Layout::apart(count, count)
    };
    vec![layout; world]
}

fn check_all_reduce(
    make: impl Fn(usize, usize, usize, usize) -> Schedule,
    world: usize,
    count: usize,
    chunk: usize,
) {
    let programs: Vec<Schedule> = (0..world).map(|r| make(r, world, count, chunk)).collect();
    let want: Vec<Val> = (0..count).map(|i| Val::reduced(world, i)).collect();
    for in_place in [false, true] {
        let outputs = run(&programs, &all_reduce_layouts(world, count, in_place));
        for (r, out) in outputs.iter().enumerate() {
            for (i, v) in out.iter().enumerate() {
                assert_eq!(
                    *v, want[i],
                    "W={world} count={count} chunk={chunk} rank {r} element {i}"
                );
            }
        }
        assert_identical(&outputs, &format!("W={world} count={count} chunk={chunk}"));
    }
}

/// Every rank holds the same bits: equal values reduced in the same order.
fn assert_identical(outputs: &[Vec<Val>], what: &str) {
    for (r, out) in outputs.iter().enumerate() {
        for (i, (v, first)) in out.iter().zip(&outputs[0]).enumerate() {
            assert!(
                v == first && v.shape == first.shape,
                "{what}: rank {r} element {i} differs from rank 0"
            );
        }
    }
}

const SIZES: [usize; 5] = [0, 1, 7, 64, 1000];

#[test]
fn ring_all_reduce_is_correct() {
    for world in 1..=17 {
        for count in SIZES.into_iter().chain([world - 1, world + 1, 3 * world]) {
            for chunk in [1, 3, 1 << 20] {
                check_all_reduce(ring::all_reduce, world, count, chunk);
            }
        }
    }
}

#[test]
fn tree_all_reduce_is_correct() {
    for world in 1..=40 {
        for count in SIZES.into_iter().chain([world - 1, world + 1]) {
            for chunk in [1, 5, 1 << 20] {
                check_all_reduce(tree::all_reduce, world, count, chunk);
            }
        }
    }
}

#[test]
fn large_worlds_are_correct() {
    for world in [127, 256, 1024] {
        check_all_reduce(ring::all_reduce, world, world + 3, 1 << 20);
        check_all_reduce(tree::all_reduce, world, 4, 1);
        check_all_reduce(|r, w, c, k| recursive::doubling(r, w, c, k, 1), world, 3, 1);
        let halving = |r, w, c, k| recursive::halving_doubling(r, w, c, k, usize::MAX);
        check_all_reduce(halving, world, world + 3, 1 << 20);
    }
}

#[test]
fn broadcasts_deliver_the_root_buffer() {
    type Make = fn(usize, usize, usize, usize, usize) -> Schedule;
    for make in [broadcast::chain as Make, broadcast::tree as Make] {
        for world in 1..=20 {
            for root in 0..world {
                for (count, chunk) in [(0, 4), (1, 4), (10, 3), (100, 1 << 20)] {
                    let programs: Vec<Schedule> = (0..world)
                        .map(|r| make(r, world, root, count, chunk))
                        .collect();
                    for in_place in [false, true] {
                        for (r, out) in run(&programs, &all_reduce_layouts(world, count, in_place))
                            .iter()
                            .enumerate()
                        {
                            for (i, v) in out.iter().enumerate() {
                                assert_eq!(v.sum, label(root, i), "W={world} root={root} rank {r}");
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn barrier_hears_from_everyone() {
    for world in 1..=70 {
        let programs: Vec<Schedule> = (0..world)
            .map(|r| barrier::dissemination(r, world))
            .collect();
        // Track, per rank, which ranks it has heard from (directly or not) in program order.
        let mut heard: Vec<Vec<bool>> = (0..world)
            .map(|r| (0..world).map(|q| q == r).collect())
            .collect();
        let rounds = programs[0].len() / 3;
        for round in 0..rounds {
            let snapshot = heard.clone();
            for (r, program) in programs.iter().enumerate() {
                let Step::Recv { peer, .. } = &program[3 * round + 1] else {
                    panic!("round shape")
                };
                let Step::Send { peer: to, .. } = &programs[*peer][3 * round] else {
                    panic!("round shape")
                };
                assert_eq!(*to, r);
                for q in 0..world {
                    heard[r][q] |= snapshot[*peer][q];
                }
            }
        }
        assert!(heard.iter().all(|h| h.iter().all(|&x| x)), "W={world}");
        run(&programs, &all_reduce_layouts(world, 0, true));
    }
}

/// Runs the programs and checks output element `i` of rank `r` against
/// `want(r, i)` (`None`: unspecified); returns the outputs.
fn check(
    what: &str,
    programs: &[Schedule],
    layouts: &[Layout],
    want: impl Fn(usize, usize) -> Option<Val>,
) -> Vec<Vec<Val>> {
    let outputs = run(programs, layouts);
    for (r, out) in outputs.iter().enumerate() {
        for (i, v) in out.iter().enumerate() {
            if let Some(want) = want(r, i) {
                assert_eq!(*v, want, "{what}: rank {r} element {i}");
            }
        }
    }
    outputs
}

const CHUNKS: [usize; 3] = [1, 3, 1 << 20];

/// Small worlds, every one, then a few larger ones.
fn worlds() -> impl Iterator<Item = usize> {
    (1..=17).chain([31, 64])
}

/// Every root for small worlds, a few for large ones.
fn roots(world: usize) -> Vec<usize> {
    if world <= 17 {
        (0..world).collect()
    } else {
        vec![0, 1, world / 2, world - 1]
    }
}

#[test]
fn reduces_land_at_the_root() {
    type Make = fn(usize, usize, usize, usize, usize) -> Schedule;
    for (name, make) in [("tree", reduce::tree as Make), ("chain", reduce::chain)] {
        for world in worlds() {
            for root in roots(world) {
                for count in [0, 1, world + 1, 37] {
                    for chunk in CHUNKS {
                        let programs: Vec<Schedule> = (0..world)
                            .map(|r| make(r, world, root, count, chunk))
                            .collect();
                        for in_place in [false, true] {
                            let what = format!("reduce {name} W={world} root={root} count={count} chunk={chunk} in_place={in_place}");
                            let layouts = all_reduce_layouts(world, count, in_place);
                            check(&what, &programs, &layouts, |r, i| {
                                (r == root).then(|| Val::reduced(world, i))
                            });
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn ring_all_gather_is_correct() {
    for world in worlds() {
        for count in [0, 1, 2, 7, world + 1] {
            for chunk in CHUNKS {
                let programs: Vec<Schedule> = (0..world)
                    .map(|r| all_gather::ring(r, world, count, chunk))
                    .collect();
                for in_place in [false, true] {
                    let layouts: Vec<Layout> = (0..world)
                        .map(|r| {
                            if in_place {
                                Layout::inside(count, world * count, r * count)
                            } else {
                                Layout::apart(count, world * count)
                            }
                        })
                        .collect();
                    let what = format!(
                        "all-gather W={world} count={count} chunk={chunk} in_place={in_place}"
                    );
                    check(&what, &programs, &layouts, |_, i| {
                        Some(Val::input(i / count, i % count))
                    });
                }
            }
        }
    }
}

#[test]
fn ring_reduce_scatter_is_correct() {
    for world in worlds() {
        for count in [0, 1, 2, 7, world + 1] {
            for chunk in CHUNKS {
                let programs: Vec<Schedule> = (0..world)
                    .map(|r| reduce_scatter::ring(r, world, count, chunk))
                    .collect();
                // Apart, and with the output as the rank's own input block.
                for in_place in [false, true] {
                    let layouts: Vec<Layout> = (0..world)
                        .map(|r| {
                            if in_place {
                                Layout::around(world * count, count, r * count)
                            } else {
                                Layout::apart(world * count, count)
                            }
                        })
                        .collect();
                    let what = format!(
                        "reduce-scatter W={world} count={count} chunk={chunk} in_place={in_place}"
                    );
                    check(&what, &programs, &layouts, |r, i| {
                        Some(Val::reduced(world, r * count + i))
                    });
                }
            }
        }
    }
}

/// Runs the pairwise all-to-all in which rank r sends `m[r][q]` elements to rank q.
fn check_all_to_all(m: &[Vec<usize>]) {
    let w = m.len();
    let recv = |r: usize| (0..w).map(|q| m[q][r]).collect::<Vec<usize>>();
    let programs: Vec<Schedule> = (0..w)
        .map(|r| all_to_all::pairwise(r, w, &m[r], &recv(r)))
        .collect();
    let layouts: Vec<Layout> = (0..w)
        .map(|r| Layout::apart(m[r].iter().sum(), recv(r).iter().sum()))
        .collect();
    // Rank r's output: the blocks from q = 0..w, each the part of q's input meant for r.
    let want: Vec<Vec<Val>> = (0..w)
        .map(|r| {
            (0..w)
                .flat_map(|q| {
                    let start: usize = m[q][..r].iter().sum();
                    (start..start + m[q][r]).map(move |i| Val::input(q, i))
                })
                .collect()
        })
        .collect();
    check(&format!("all-to-all {m:?}"), &programs, &layouts, |r, i| {
        Some(want[r][i])
    });
}

#[test]
fn pairwise_all_to_all_is_correct() {
    for w in worlds() {
        for c in [0, 1, 3] {
            check_all_to_all(&vec![vec![c; w]; w]);
        }
        // Variable counts, many of them zero.
        check_all_to_all(
            &(0..w)
                .map(|r| (0..w).map(|q| (r * 7 + q * 3 + w) % 5).collect())
                .collect::<Vec<_>>(),
        );
        // Only rank 0 sends (a scatter), and only to odd ranks plus itself.
        check_all_to_all(
            &(0..w)
                .map(|r| {
                    (0..w)
                        .map(|q| {
                            if r == 0 && (q % 2 == 1 || q == 0) {
                                q + 2
                            } else {
                                0
                            }
                        })
                        .collect()
                })
                .collect::<Vec<_>>(),
        );
        // Everyone sends to rank w-1 only (a gather), nothing to itself.
        check_all_to_all(
            &(0..w)
                .map(|r| {
                    (0..w)
                        .map(|q| usize::from(q == w - 1 && r != q) * (r + 1))
                        .collect()
                })
                .collect::<Vec<_>>(),
        );
    }
}

/// Pairwise all-to-all programs for three ranks where rank 1 expects `from0` elements from rank 0.
fn mismatched_all_to_all(from0: usize) -> (Vec<Schedule>, Vec<Layout>) {
    let m = [[1, 2, 3], [4, 5, 6], [7, 8, 9]];
    let mut recv: Vec<Vec<usize>> = (0..3).map(|r| (0..3).map(|q| m[q][r]).collect()).collect();
    recv[1][0] = from0;
    let programs = (0..3)
        .map(|r| all_to_all::pairwise(r, 3, &m[r], &recv[r]))
        .collect();
    let layouts = (0..3)
        .map(|r| Layout::apart(m[r].iter().sum(), recv[r].iter().sum()))
        .collect();
    (programs, layouts)
}

#[test]
#[should_panic(expected = "length mismatch")]
fn all_to_all_count_mismatch_fails_on_the_wire() {
    let (programs, layouts) = mismatched_all_to_all(3);
    run(&programs, &layouts);
}

#[test]
#[should_panic(expected = "length mismatch")]
fn all_to_all_unexpected_block_is_not_silent() {
    let (programs, layouts) = mismatched_all_to_all(0);
    run(&programs, &layouts);
}

#[test]
#[should_panic(expected = "length mismatch")]
fn all_to_all_missing_block_is_not_silent() {
    let mut m = vec![vec![1usize; 3]; 3];
    let recv: Vec<Vec<usize>> = (0..3).map(|r| (0..3).map(|q| m[q][r]).collect()).collect();
    m[0][1] = 0;
    let programs: Vec<Schedule> = (0..3)
        .map(|r| all_to_all::pairwise(r, 3, &m[r], &recv[r]))
        .collect();
    let layouts: Vec<Layout> = (0..3)
        .map(|r| Layout::apart(m[r].iter().sum(), recv[r].iter().sum()))
        .collect();
    run(&programs, &layouts);
}

#[test]
fn all_to_all_validate_catches_local_errors() {
    assert!(all_to_all::validate(1, 3, &[1, 2, 3], &[4, 2, 6]).is_ok());
    assert!(all_to_all::validate(1, 3, &[1, 2, 3], &[4, 5, 6]).is_err());
    assert!(all_to_all::validate(1, 3, &[1, 2], &[4, 2, 6]).is_err());
    assert!(all_to_all::validate(3, 3, &[1, 2, 3], &[1, 2, 3]).is_err());
}

#[test]
fn gather_collects_every_block_at_the_root() {
    for world in worlds() {
        for root in roots(world) {
            for count in [0, 1, 5] {
                let programs: Vec<Schedule> = (0..world)
                    .map(|r| gather::direct(r, world, root, count))
                    .collect();
                // Root in place or not; other outputs empty, or full and left untouched.
                for (in_place, others) in [(false, 0), (true, 0), (false, world * count)] {
                    let layouts: Vec<Layout> = (0..world)
                        .map(|r| match (r == root, in_place) {
                            (true, true) => Layout::inside(count, world * count, root * count),
                            (true, false) => Layout::apart(count, world * count),
                            (false, _) => Layout::apart(count, others),
                        })
                        .collect();
                    let what =
                        format!("gather W={world} root={root} count={count} in_place={in_place}");
                    check(&what, &programs, &layouts, |r, i| {
                        Some(if r == root {
                            Val::input(i / count, i % count)
                        } else {
                            GARBAGE
                        })
                    });
                }
            }
        }
    }
}

#[test]
fn scatter_hands_every_rank_its_block() {
    for world in worlds() {
        for root in roots(world) {
            for count in [0, 1, 5] {
                let programs: Vec<Schedule> = (0..world)
                    .map(|r| scatter::direct(r, world, root, count))
                    .collect();
                // Root in place or not; other inputs empty (so never read) or full.
                for (in_place, others) in [(false, 0), (true, 0), (false, world * count)] {
                    let layouts: Vec<Layout> = (0..world)
                        .map(|r| match (r == root, in_place) {
                            (true, true) => Layout::around(world * count, count, root * count),
                            (true, false) => Layout::apart(world * count, count),
                            (false, _) => Layout::apart(others, count),
                        })
                        .collect();
                    let what =
                        format!("scatter W={world} root={root} count={count} in_place={in_place}");
                    check(&what, &programs, &layouts, |r, i| {
                        Some(Val::input(root, r * count + i))
                    });
                }
            }
        }
    }
}

/// Recursive doubling and halving-doubling, without handshakes, with one before every
/// round, and with them only before rounds sending more than 3 elements (where the halves
/// of halving-doubling differ in length, both partners must still agree on each round).
type Recursive = fn(usize, usize, usize, usize, usize) -> Schedule;
const RECURSIVE: [Recursive; 2] = [recursive::doubling, recursive::halving_doubling];
const READY_ABOVE: [usize; 3] = [usize::MAX, 0, 3];

#[test]
fn recursive_all_reduces_are_correct() {
    for (make, ready) in RECURSIVE
        .into_iter()
        .flat_map(|m| READY_ABOVE.map(|r| (m, r)))
    {
        let make = |r, w, c, k| make(r, w, c, k, ready);
        for world in 1..=17 {
            for count in SIZES.into_iter().chain([world - 1, world + 1, 3 * world]) {
                for chunk in CHUNKS {
                    check_all_reduce(make, world, count, chunk);
                }
            }
        }
        for world in [31, 64, 100] {
            check_all_reduce(make, world, world + 3, 5);
            check_all_reduce(make, world, 2, 1);
        }
    }
}

#[test]
fn handshakes_start_only_the_rounds_above_the_threshold() {
    let fences = |s: &Schedule| s.iter().filter(|s| matches!(s, Step::Fence)).count();
    // 8 ranks, 3 rounds of 1000 elements: a fence on each side of each handshake.
    assert_eq!(fences(&recursive::doubling(5, 8, 1000, 100, 999)), 6);
    assert_eq!(fences(&recursive::doubling(5, 8, 1000, 100, 1000)), 0);
    // Halving-doubling's rounds move 500, 250, 125 elements, then 125, 250, 500.
    assert_eq!(
        fences(&recursive::halving_doubling(5, 8, 1000, 100, 200)),
        8
    );
    assert_eq!(
        fences(&recursive::halving_doubling(5, 8, 1000, 100, usize::MAX)),
        0
    );
}

#[test]
fn recursive_all_reduces_are_bit_identical_on_every_rank() {
    for (make, ready) in RECURSIVE
        .into_iter()
        .flat_map(|m| READY_ABOVE.map(|r| (m, r)))
    {
        for world in [2, 3, 4, 6, 8, 13, 16] {
            let programs: Vec<Schedule> =
                (0..world).map(|r| make(r, world, 20, 3, ready)).collect();
            let outputs = run(&programs, &all_reduce_layouts(world, 20, false));
            assert!(outputs.iter().all(|out| out
                .iter()
                .zip(&outputs[0])
                .all(|(a, b)| a == b && a.shape == b.shape)));
        }
    }
    // The control: every rank adding the others' inputs to its own, in rank
    // order, gets the right sum but not the same bits (the order differs).
    let world = 4;
    let programs: Vec<Schedule> = (0..world)
        .map(|r| {
            let mut steps: Schedule = (0..world)
                .filter(|&q| q != r)
                .map(|q| Step::Send {
                    peer: q,
                    from: Loc::input(0..1),
                })
                .collect();
            steps.push(Step::Copy {
                from: Loc::input(0..1),
                into: Loc::output(0..1),
            });
            steps.extend((0..world).filter(|&q| q != r).map(|q| Step::RecvReduce {
                peer: q,
                with: Loc::output(0..1),
                into: Loc::output(0..1),
            }));
            steps.push(Step::Finish {
                at: Loc::output(0..1),
            });
            steps
        })
        .collect();
    let outputs = run(&programs, &all_reduce_layouts(world, 1, false));
    assert!(outputs.iter().all(|out| out[0] == Val::reduced(world, 0)));
    assert_ne!(outputs[0][0].shape, outputs[2][0].shape);
}

#[test]
fn hierarchical_all_reduce_is_correct() {
    for (world, local) in [
        (1, 1),
        (2, 1),
        (2, 2),
        (4, 2),
        (6, 3),
        (6, 2),
        (8, 4),
        (9, 3),
        (12, 4),
        (16, 8),
    ] {
        for count in [0, 1, 7, world + 1, 100] {
            for chunk in [1, 4, 1 << 20] {
                let make = |r, w, c, k| hierarchical::all_reduce(r, w, local, c, k);
                check_all_reduce(make, world, count, chunk);
            }
        }
    }
}

/// The device path's hierarchical plan as messages: every world up to 64 as hosts of 1-8
/// ranks, the last host short where they do not divide, and hosts of uneven sizes in any
/// order.
#[test]
fn sharded_hierarchical_all_reduce_is_correct() {
    let consecutive = |world: usize, per: usize| -> Vec<Vec<usize>> {
        (0..world.div_ceil(per))
            .map(|h| (h * per..world.min((h + 1) * per)).collect())
            .collect()
    };
    let mut layouts: Vec<Vec<Vec<usize>>> = (1..=64)
        .flat_map(|world| (1..=8).map(move |per| (world, per)))
        .map(|(world, per)| consecutive(world, per))
        .collect();
    layouts.push(vec![vec![0], vec![1, 2, 3, 4], vec![5, 6], vec![7]]);
    layouts.push(vec![vec![3, 0, 5], vec![1], vec![4, 2]]);
    for hosts in layouts {
        let world = hosts.iter().map(Vec::len).sum();
        let counts = [0, 1, 7, world + 1, 100];
        for (count, chunk) in counts.into_iter().flat_map(|c| [(c, 1), (c, 1 << 20)]) {
            if world > 16 && chunk == 1 && count > 7 {
                continue;
            }
            let make = |r, _, c, k| hierarchical::sharded_all_reduce_on(r, &hosts, c, k);
            check_all_reduce(make, world, count, chunk);
        }
    }
}
