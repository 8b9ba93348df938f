//! Scenarios of the asynchronous forms: each against its blocking form, and calls in flight
//! when a rank goes.

use chorus::{Cause, Communicator, Error, ReduceOp};

use super::check;

/// Elements in each rank's block.
const BLOCK: usize = 1000;

/// Every asynchronous collective and a group of messages, issued back to back before any is
/// waited on, give the blocking forms' results and complete in issue order; arguments that
/// do not fit fail the handle with [`Error::InvalidArgument`] and leave the communicator usable.
pub fn every_call(comm: &Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let err = |e: Error| e.to_string();
    let whole: Vec<f32> = (0..world * BLOCK)
        .map(|i| ((rank * 7 + i) % 13) as f32)
        .collect();
    let block = whole[..BLOCK].to_vec();
    let (first, last) = (0, world - 1);
    let sends: Vec<usize> = (0..world).map(|q| q + 1).collect();
    let recvs = vec![rank + 1; world];
    let sent: usize = sends.iter().sum();
    let part = |len: usize| {
        whole
            .iter()
            .copied()
            .cycle()
            .take(len)
            .collect::<Vec<f32>>()
    };
    let root_len = |root: usize, len: usize| if rank == root { len } else { 0 };

    // The blocking forms' results.
    let mut all_reduce = whole.clone();
    comm.all_reduce(&mut all_reduce, ReduceOp::Sum)
        .map_err(err)?;
    let mut broadcast = whole.clone();
    comm.broadcast(&mut broadcast, last).map_err(err)?;
    let mut reduce = whole.clone();
    comm.reduce(&mut reduce, ReduceOp::Max, first)
        .map_err(err)?;
    let mut all_gather = vec![0.0; world * BLOCK];
    comm.all_gather(&block, &mut all_gather).map_err(err)?;
    let mut reduce_scatter = vec![0.0; BLOCK];
    comm.reduce_scatter(&whole, &mut reduce_scatter, ReduceOp::Min)
        .map_err(err)?;
    let mut all_to_all = vec![0.0; world * BLOCK];
    comm.all_to_all(&whole, &mut all_to_all).map_err(err)?;
    let mut all_to_all_v = vec![0.0; world * (rank + 1)];
    comm.all_to_all_v(&part(sent), &sends, &mut all_to_all_v, &recvs)
        .map_err(err)?;
    let mut gather = vec![0.0; root_len(first, world * BLOCK)];
    comm.gather(&block, &mut gather, first).map_err(err)?;
    let mut scatter = vec![0.0; BLOCK];
    comm.scatter(&whole[..root_len(last, world * BLOCK)], &mut scatter, last)
        .map_err(err)?;

    // The same calls, all in flight at once.
    let in_place = {
        let mut buf = vec![0.0; world * BLOCK];
        buf[rank * BLOCK..(rank + 1) * BLOCK].copy_from_slice(&block);
        buf
    };
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let works = (
        comm.all_reduce_async(whole.clone(), ReduceOp::Sum),
        comm.broadcast_async(whole.clone(), last),
        comm.reduce_async(whole.clone(), ReduceOp::Max, first),
        comm.all_gather_async(block.clone(), vec![0.0f32; world * BLOCK]),
        comm.all_gather_in_place_async(in_place),
        comm.reduce_scatter_async(whole.clone(), vec![0.0f32; BLOCK], ReduceOp::Min),
        comm.all_to_all_async(whole.clone(), vec![0.0f32; world * BLOCK]),
        comm.all_to_all_v_async(part(sent), sends, vec![0.0f32; world * (rank + 1)], recvs),
        comm.gather_async(
            block.clone(),
            vec![0.0f32; root_len(first, world * BLOCK)],
            first,
        ),
        comm.scatter_async(
            whole[..root_len(last, world * BLOCK)].to_vec(),
            vec![0.0f32; BLOCK],
            last,
        ),
        comm.group_async(
            vec![(vec![rank as u8; 64], next, 5)],
            vec![(vec![0u8; 64], prev, 5)],
        ),
    );
    let barrier = comm.barrier_async();
    barrier.wait().map_err(err)?;
    // Done in issue order: everything issued before the barrier shows as completed.
    let completed = [
        works.0.is_completed(),
        works.1.is_completed(),
        works.2.is_completed(),
        works.3.is_completed(),
        works.4.is_completed(),
        works.5.is_completed(),
        works.6.is_completed(),
        works.7.is_completed(),
        works.8.is_completed(),
        works.9.is_completed(),
        works.10.is_completed(),
    ];
    if let Some(i) = completed.iter().position(|done| !done) {
        return Err(format!(
            "call {i} shows as running after a later barrier completed"
        ));
    }
    check("all_reduce_async", works.0.wait().map_err(err)?, all_reduce)?;
    check("broadcast_async", works.1.wait().map_err(err)?, broadcast)?;
    let reduced = works.2.wait().map_err(err)?;
    if rank == first {
        check("reduce_async", reduced, reduce)?;
    }
    check(
        "all_gather_async",
        works.3.wait().map_err(err)?.1,
        all_gather.clone(),
    )?;
    check(
        "all_gather_in_place_async",
        works.4.wait().map_err(err)?,
        all_gather,
    )?;
    check(
        "reduce_scatter_async",
        works.5.wait().map_err(err)?.1,
        reduce_scatter,
    )?;
    check(
        "all_to_all_async",
        works.6.wait().map_err(err)?.1,
        all_to_all,
    )?;
    check(
        "all_to_all_v_async",
        works.7.wait().map_err(err)?.1,
        all_to_all_v,
    )?;
    check("gather_async", works.8.wait().map_err(err)?.1, gather)?;
    check("scatter_async", works.9.wait().map_err(err)?.1, scatter)?;
    let (_, received) = works.10.wait().map_err(err)?;
    check("group_async", received[0].0.clone(), vec![prev as u8; 64])?;

    // Arguments that do not fit: the handle fails, nothing moves, and the next call works.
    match comm
        .all_gather_async(vec![0.0f32; 3], vec![0.0f32; 3 * world + 1])
        .wait()
    {
        Err(Error::InvalidArgument(_)) => {}
        other => return Err(format!("a misfit all_gather_async gave {other:?}")),
    }
    let mut one = vec![1u32; 4];
    comm.all_reduce(&mut one, ReduceOp::Sum).map_err(err)?;
    check(
        "all_reduce after a refused call",
        one,
        vec![world as u32; 4],
    )?;
    println!("async_every ok");
    Ok(())
}

/// The last rank leaves once every rank is in; the others' calls in flight (several, issued
/// before any is waited on) each fail, naming it, within the communicator's timeout.
pub fn rank_leaves(comm: &Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    comm.barrier().map_err(|e| e.to_string())?;
    let gone = world - 1;
    if rank == gone {
        println!("async_vanish ok");
        // Leaves without a word, as a crashed process does (its sockets close).
        std::process::exit(0);
    }
    let works: Vec<_> = (0..4)
        .map(|_| comm.all_reduce_async(vec![1.0f32; 1 << 20], ReduceOp::Sum))
        .collect();
    // The first call fails with the fault; the later ones fail as aborted by it, or as
    // broken by the first one's error.
    for (i, work) in works.into_iter().enumerate() {
        let fault = match work.wait() {
            Ok(_) => return Err(format!("call {i} succeeded without rank {gone}")),
            Err(Error::Aborted(fault)) => *fault,
            Err(Error::Broken(first)) if i > 0 => match first.fault() {
                Some(fault) => fault.clone(),
                None => return Err(format!("call {i} broken by {first:?}")),
            },
            Err(other) => return Err(format!("call {i} failed as {other:?}")),
        };
        if fault.cause != Cause::PeerClosed || fault.culprit != Some(gone) {
            return Err(format!(
                "call {i} failed without naming rank {gone}: {fault:?}"
            ));
        }
    }
    println!("async_vanish ok");
    Ok(())
}
