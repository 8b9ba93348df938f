//! Hierarchical all-reduce for ranks spread over several hosts with several
//! ranks each (ranks of one host numbered consecutively, as launchers do).
//!
//! Each host reduces to its first rank (the leader) over a binary tree, the
//! leaders run a ring all-reduce across hosts, and each leader broadcasts
//! the result back over its host's tree. Only leaders touch the network
//! between hosts: H hosts move 2(H-1)/H of the buffer per leader instead of
//! every rank crossing the slow links.

use super::{broadcast, reduce, ring, Buf, Loc, Schedule, Step};

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
    let (host, local_rank, hosts) = (rank / local, rank % local, world_size / local);
    let on_host = |v: usize| host * local + v;
    // 1. Reduce onto the host's leader (its output holds the host's partial result).
    let mut steps = relocate(
        reduce::tree(local_rank, local, 0, count, chunk),
        on_host,
        false,
    );
    steps.retain(|s| !matches!(s, Step::Finish { .. }));
    // 2. Leaders all-reduce their partial results across hosts, in their outputs.
    if local_rank == 0 {
        steps.extend(relocate(
            ring::all_reduce(host, hosts, count, chunk),
            |h| h * local,
            true,
        ));
    }
    // 3. Each leader broadcasts the result over its host.
    steps.extend(relocate(
        broadcast::tree(local_rank, local, 0, count, chunk),
        on_host,
        true,
    ));
    steps
}

/// Maps a sub-group schedule's peers to real ranks; with `from_output`, its input is this rank's output.
fn relocate(steps: Schedule, peer: impl Fn(usize) -> usize, from_output: bool) -> Schedule {
    let place = |loc: Loc| match loc.buf {
        Buf::Input if from_output => Loc::output(loc.range),
        _ => loc,
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
