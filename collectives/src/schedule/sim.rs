//! An in-memory simulator that runs every rank's schedule against the others
//! with symbolic data, proving a schedule correct for many world sizes
//! without a socket: messages match in order and in length, nothing
//! deadlocks, every contribution is reduced exactly once, and `Finish` is
//! applied exactly once to fully reduced data.

use std::collections::{HashMap, VecDeque};

use super::{barrier, broadcast, ring, tree, Buf, Schedule, Step};

/// A symbolic element: the wrapping sum of its contributions' labels,
/// how many contributions it holds, and whether it was finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Val {
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

struct Rank {
    input: Vec<Val>,
    output: Vec<Val>,
    pc: usize,
}

/// Runs the programs; returns each rank's output.
fn run(programs: &[Schedule], count: usize, in_place: bool, world: usize) -> Vec<Vec<Val>> {
    let mut ranks: Vec<Rank> = (0..world)
        .map(|r| {
            let input: Vec<Val> = (0..count)
                .map(|i| Val {
                    sum: label(r, i),
                    count: 1,
                    finished: false,
                })
                .collect();
            let output = if in_place {
                input.clone()
            } else {
                vec![GARBAGE; count]
            };
            Rank {
                input,
                output,
                pc: 0,
            }
        })
        .collect();
    let mut wires: HashMap<(usize, usize), VecDeque<Vec<Val>>> = HashMap::new();
    loop {
        let mut progressed = false;
        for (r, rank) in ranks.iter_mut().enumerate() {
            while let Some(step) = programs[r].get(rank.pc) {
                let read = |rank: &Rank, buf: Buf, region: &std::ops::Range<usize>| -> Vec<Val> {
                    match (buf, in_place) {
                        (Buf::Input, false) => rank.input[region.clone()].to_vec(),
                        _ => rank.output[region.clone()].to_vec(),
                    }
                };
                match step {
                    Step::Send { peer, buf, region } => {
                        assert_ne!(*peer, r, "rank {r} sends to itself");
                        let data = read(rank, *buf, region);
                        wires.entry((r, *peer)).or_default().push_back(data);
                    }
                    Step::Recv { peer, region } | Step::RecvReduce { peer, region, .. } => {
                        let Some(data) = wires.get_mut(&(*peer, r)).and_then(VecDeque::pop_front)
                        else {
                            break;
                        };
                        assert_eq!(
                            data.len(),
                            region.len(),
                            "rank {r} step {}: length mismatch from {peer}",
                            rank.pc
                        );
                        let own = match step {
                            Step::RecvReduce { src, .. } => Some(read(rank, *src, region)),
                            _ => None,
                        };
                        for (k, i) in region.clone().enumerate() {
                            rank.output[i] = match &own {
                                None => data[k],
                                Some(own) => {
                                    let (a, b) = (own[k], data[k]);
                                    assert!(
                                        !a.finished && !b.finished,
                                        "rank {r} reduces finished data"
                                    );
                                    Val {
                                        sum: a.sum.wrapping_add(b.sum),
                                        count: a.count + b.count,
                                        finished: false,
                                    }
                                }
                            };
                        }
                    }
                    Step::Copy { region } => {
                        let data = read(rank, Buf::Input, region);
                        rank.output[region.clone()].copy_from_slice(&data);
                    }
                    Step::Finish { region } => {
                        for v in &mut rank.output[region.clone()] {
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
            return ranks.into_iter().map(|rank| rank.output).collect();
        }
        assert!(
            progressed,
            "deadlock: {:?}",
            ranks.iter().map(|r| r.pc).collect::<Vec<_>>()
        );
    }
}

fn check_all_reduce(
    make: fn(usize, usize, usize, usize) -> Schedule,
    world: usize,
    count: usize,
    chunk: usize,
) {
    let programs: Vec<Schedule> = (0..world).map(|r| make(r, world, count, chunk)).collect();
    for in_place in [false, true] {
        let outputs = run(&programs, count, in_place, world);
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
                        for (r, out) in run(&programs, count, in_place, world).iter().enumerate() {
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
        run(&programs, 0, true, world);
    }
}
