//! Hierarchical all-reduce for ranks spread over several hosts with several
//! ranks on some: [`all_reduce_on`] takes each host's ranks (the communicator
//! passes what its transport found), [`all_reduce`] consecutive ranks per host.
//!
//! Each host reduces to its first rank (the leader) over a binary tree, the
//! leaders run a ring all-reduce across hosts, and each leader broadcasts
//! the result back over its host's tree. Only leaders touch the network
//! between hosts: H hosts move 2(H-1)/H of the buffer per leader instead of
//! every rank crossing the slow links.
//!
//! [`sharded_all_reduce_on`] is the device path's hierarchical plan as messages (what the
//! simulator prices it by): the buffer is cut into as many shards as the busiest host has
//! ranks, each with one owner per host; every rank sends each shard to its host's owner,
//! which reduces them, the owners of each shard run a ring all-reduce across hosts, and
//! each owner sends its shard back to its host's ranks. Every rank of a host moves its
//! share of the traffic between hosts, in parallel.

use super::{broadcast, chunks, reduce, ring, split, Buf, Loc, Schedule, Step};

/// The hierarchical all-reduce program of `rank`; hosts hold `local_world_size` consecutive ranks.
///
/// Panics unless `local_world_size` divides `world_size` (callers check).
pub fn all_reduce(
    rank: usize,
    world_size: usize,
    local_world_size: usize,
    count: usize,
    chunk: usize,
) -> Schedule {
    let local = local_world_size;
    assert!(
        local > 0 && world_size % local == 0,
        "{local} ranks per host do not divide {world_size}"
    );
    let hosts: Vec<Vec<usize>> = (0..world_size / local)
        .map(|h| (h * local..(h + 1) * local).collect())
        .collect();
    all_reduce_on(rank, &hosts, count, chunk)
}

/// The hierarchical all-reduce program of `rank`, `hosts` listing each host's ranks (the
/// first of each is its leader); hosts may differ in size.
///
/// Panics unless `rank` is on exactly one of `hosts` (callers build them from the transport).
pub fn all_reduce_on(rank: usize, hosts: &[Vec<usize>], count: usize, chunk: usize) -> Schedule {
    let (host, local_rank) = place_of(rank, hosts);
    let mine = &hosts[host];
    let on_host = |v: usize| mine[v];
    // 1. Reduce onto the host's leader (its output holds the host's partial result).
    let mut steps = relocate(
        reduce::tree(local_rank, mine.len(), 0, count, chunk),
        on_host,
        (false, 0),
    );
    steps.retain(|s| !matches!(s, Step::Finish { .. }));
    // 2. Leaders all-reduce their partial results across hosts, in their outputs.
    if local_rank == 0 {
        steps.extend(relocate(
            ring::all_reduce(host, hosts.len(), count, chunk),
            |h| hosts[h][0],
            (true, 0),
        ));
    }
    // 3. Each leader broadcasts the result over its host.
    steps.extend(relocate(
        broadcast::tree(local_rank, mine.len(), 0, count, chunk),
        on_host,
        (true, 0),
    ));
    steps
}

/// The sharded hierarchical all-reduce program of `rank` (see the [module
/// documentation](self)), `hosts` listing each host's ranks; hosts may differ in size (on a
/// host of fewer ranks than shards, local rank `l` owns every shard `s` with
/// `s % ranks == l`).
///
/// Panics unless `rank` is on exactly one of `hosts`.
pub fn sharded_all_reduce_on(
    rank: usize,
    hosts: &[Vec<usize>],
    count: usize,
    chunk: usize,
) -> Schedule {
    let (host, _) = place_of(rank, hosts);
    let mine = &hosts[host];
    let shards = split(count, hosts.iter().map(Vec::len).max().unwrap_or(1));
    let owner = |h: usize, s: usize| hosts[h][s % hosts[h].len()];
    let mut steps = Vec::new();
    // 1. Each shard to its owner on this host, which reduces them in local rank order.
    for (s, shard) in shards.iter().enumerate() {
        let o = owner(host, s);
        for piece in chunks(shard.clone(), chunk) {
            if o != rank {
                let from = Loc::input(piece);
                steps.push(Step::Send { peer: o, from });
                continue;
            }
            let (from, into) = (Loc::input(piece.clone()), Loc::output(piece.clone()));
            steps.push(Step::Copy { from, into });
            for &q in mine.iter().filter(|&&q| q != rank) {
                let (with, into) = (Loc::output(piece.clone()), Loc::output(piece.clone()));
                steps.push(Step::RecvReduce {
                    peer: q,
                    with,
                    into,
                });
            }
        }
    }
    // 2. The owners of each shard, one per host, all-reduce it across hosts.
    for (s, shard) in shards
        .iter()
        .enumerate()
        .filter(|(s, _)| owner(host, *s) == rank)
    {
        steps.extend(relocate(
            ring::all_reduce(host, hosts.len(), shard.len(), chunk),
            |h| owner(h, s),
            (true, shard.start),
        ));
    }
    // 3. Each owner sends its shard back to this host's other ranks.
    for (s, shard) in shards.iter().enumerate() {
        let o = owner(host, s);
        for piece in chunks(shard.clone(), chunk) {
            if o != rank {
                steps.push(Step::Recv {
                    peer: o,
                    into: Loc::output(piece),
                });
                continue;
            }
            for &q in mine.iter().filter(|&&q| q != rank) {
                let from = Loc::output(piece.clone());
                steps.push(Step::Send { peer: q, from });
            }
        }
    }
    steps
}

/// The host of `rank` among `hosts` and its place there; panics if it is on none.
fn place_of(rank: usize, hosts: &[Vec<usize>]) -> (usize, usize) {
    hosts
        .iter()
        .enumerate()
        .find_map(|(h, ranks)| ranks.iter().position(|&r| r == rank).map(|l| (h, l)))
        .unwrap_or_else(|| panic!("rank {rank} is on none of the hosts {hosts:?}"))
}

/// Maps a sub-group schedule's peers to real ranks and its ranges `offset` elements on;
/// with `from_output`, its input is this rank's output.
fn relocate(
    steps: Schedule,
    peer: impl Fn(usize) -> usize,
    (from_output, offset): (bool, usize),
) -> Schedule {
    let place = |loc: Loc| {
        let range = loc.range.start + offset..loc.range.end + offset;
        match loc.buf {
            Buf::Input if from_output => Loc::output(range),
            buf => Loc { buf, range },
        }
    };
    steps
        .into_iter()
        .map(|step| match step {
            Step::Send { peer: p, from } => Step::Send {
                peer: peer(p),
                from: place(from),
            },
            Step::Recv { peer: p, into } => Step::Recv {
                peer: peer(p),
                into: place(into),
            },
            Step::RecvReduce {
                peer: p,
                with,
                into,
            } => Step::RecvReduce {
                peer: peer(p),
                with: place(with),
                into: place(into),
            },
            Step::Copy { from, into } => Step::Copy {
                from: place(from),
                into: place(into),
            },
            Step::Finish { at } => Step::Finish { at: place(at) },
            Step::Fence => Step::Fence,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `steps` with every peer renamed by `rename`.
    fn renamed(steps: Schedule, rename: impl Fn(usize) -> usize) -> Schedule {
        relocate(steps, rename, (false, 0))
    }

    #[test]
    fn hosts_in_any_order_run_the_consecutive_schedule_renamed() {
        // Hosts {0, 2} and {1, 3}: consecutive ranks 0,1 | 2,3 renamed 0->0, 1->2, 2->1, 3->3.
        let hosts = [vec![0, 2], vec![1, 3]];
        let real = [0, 2, 1, 3];
        for (consecutive, &rank) in real.iter().enumerate() {
            for (count, chunk) in [(1, 1), (7, 2), (100, 16)] {
                assert_eq!(
                    all_reduce_on(rank, &hosts, count, chunk),
                    renamed(all_reduce(consecutive, 4, 2, count, chunk), |p| real[p]),
                    "rank {rank}, {count} elements"
                );
            }
        }
    }

    #[test]
    fn a_host_of_one_rank_only_rings_and_others_reduce_first() {
        let hosts = [vec![0, 1, 2], vec![3]];
        let alone = all_reduce_on(3, &hosts, 8, 8);
        // Rank 3 leads its host: it talks to rank 0 only, the other leader.
        assert!(!alone.is_empty());
        assert!(alone.iter().all(|s| match s {
            Step::Send { peer, .. } | Step::Recv { peer, .. } | Step::RecvReduce { peer, .. } =>
                *peer == 0,
            _ => true,
        }));
        // Rank 2 only talks to ranks on its own host.
        assert!(all_reduce_on(2, &hosts, 8, 8).iter().all(|s| match s {
            Step::Send { peer, .. } | Step::Recv { peer, .. } | Step::RecvReduce { peer, .. } =>
                *peer < 3,
            _ => true,
        }));
    }
}
