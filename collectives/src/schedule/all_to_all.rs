//! Pairwise all-to-all (variable block sizes).
//!
//! Rank r copies its own block, then in round k = 1..W sends its block for
//! rank r+k and receives the block from rank r-k, straight between the
//! caller's buffers. Every round is posted at once (rounds only fix the
//! order, so that no rank has all others sending to it first); empty blocks
//! travel as bare headers. W-1 rounds; each rank sends the sum of its send
//! counts and receives the sum of its receive counts, less its own block.
//!
//! The counts must agree: rank r's `recv_counts[q]` equals rank q's
//! `send_counts[r]`. Every pair exchanges a message, even an empty one, so
//! any disagreement fails the receive as a length mismatch on the wire.
//! [`validate`] checks what one rank can check alone.

use super::{Loc, Schedule, Step};

/// Offsets of the consecutive blocks with lengths `counts` (one more than blocks: the total).
fn offsets(counts: &[usize]) -> Vec<usize> {
    let mut at = vec![0];
    for c in counts {
        at.push(at[at.len() - 1] + c);
    }
    at
}

/// Checks the counts one rank can check alone: one per rank, and its own block of one length.
pub fn validate(
    rank: usize,
    world_size: usize,
    send_counts: &[usize],
    recv_counts: &[usize],
) -> Result<(), String> {
    if send_counts.len() != world_size || recv_counts.len() != world_size {
        return Err(format!(
            "{} send counts and {} receive counts for {world_size} ranks",
            send_counts.len(),
            recv_counts.len()
        ));
    }
    if rank >= world_size {
        return Err(format!("rank {rank} outside a world of {world_size}"));
    }
    if send_counts[rank] != recv_counts[rank] {
        return Err(format!(
            "rank {rank} sends itself {} elements but receives {}",
            send_counts[rank], recv_counts[rank]
        ));
    }
    Ok(())
}

/// The pairwise all-to-all program of `rank` (panics where [`validate`] fails).
pub fn pairwise(
    rank: usize,
    world_size: usize,
    send_counts: &[usize],
    recv_counts: &[usize],
) -> Schedule {
    if let Err(e) = validate(rank, world_size, send_counts, recv_counts) {
        panic!("all-to-all counts: {e}");
    }
    let w = world_size;
    let (send, recv) = (offsets(send_counts), offsets(recv_counts));
    let mut steps = vec![Step::Copy {
        from: Loc::input(send[rank]..send[rank + 1]),
        into: Loc::output(recv[rank]..recv[rank + 1]),
    }];
    for k in 1..w {
        let (to, from) = ((rank + k) % w, (rank + w - k) % w);
        // Empty blocks still travel (as bare headers), so any count that
        // disagrees with the peer's fails as a length mismatch.
        steps.push(Step::Send {
            peer: to,
            from: Loc::input(send[to]..send[to + 1]),
        });
        steps.push(Step::Recv {
            peer: from,
            into: Loc::output(recv[from]..recv[from + 1]),
        });
    }
    steps
}
