//! An in-memory simulator that runs every rank's schedule against the others
//! with symbolic data, proving a schedule correct for many world sizes
//! without a socket: messages match in order and in length, nothing
//! deadlocks, every contribution is reduced exactly once, and `Finish` is
//! applied exactly once to fully reduced data.

use std::collections::{HashMap, VecDeque};

use super::{barrier, broadcast, ring, tree, Buf, Loc, Schedule, Step};

/// A symbolic element: the wrapping sum of its contributions' labels,
/// how many contributions it holds, and whether it was finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Val {
    sum: u64,
    count: u32,
    finished: bool,
}

const GARBAGE: Val = Val {
    sum: 0xbad,
    count: u32::MAX,
    finished: false,
};

fn label(rank: usize, i: usize) -> u64 {
    let mut x = (rank as u64) << 32 ^ i as u64 ^ 0x9e37_79b9_7f4a_7c15;
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
                mem[base + i] = Val {
                    sum: label(r, i),
                    count: 1,
                    finished: false,
                };
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
                        let data = rank.mem[rank.at(from, r)].to_vec();
                        wires.entry((r, *peer)).or_default().push_back(data);
                    }
                    Step::Recv { peer, into: to } | Step::RecvReduce { peer, into: to, .. } => {
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
                        let data = rank.mem[rank.at(from, r)].to_vec();
                        let at = rank.at(into, r);
                        rank.mem[at].copy_from_slice(&data);
                    }
                    Step::Finish { at } => {
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
    Val {
        sum: a.sum.wrapping_add(b.sum),
        count: a.count + b.count,
        finished: false,
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
    make: fn(usize, usize, usize, usize) -> Schedule,
    world: usize,
    count: usize,
    chunk: usize,
) {
    let programs: Vec<Schedule> = (0..world).map(|r| make(r, world, count, chunk)).collect();
    for in_place in [false, true] {
        let outputs = run(&programs, &all_reduce_layouts(world, count, in_place));
        for (r, out) in outputs.iter().enumerate() {
            for (i, v) in out.iter().enumerate() {
                let sum = (0..world).fold(0u64, |s, q| s.wrapping_add(label(q, i)));
                let want = Val {
                    sum,
                    count: world as u32,
                    finished: true,
                };
                assert_eq!(
                    *v, want,
                    "W={world} count={count} chunk={chunk} rank {r} element {i}"
                );
            }
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
