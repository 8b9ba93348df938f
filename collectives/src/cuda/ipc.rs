//! The IPC path: ranks of one host read and reduce each other's device memory directly.
//!
//! Every rank allocates a scratch buffer (on CUDA, with `cuMemAlloc`), exports it
//! (`cuIpcGetMemHandle`), and maps every peer's (`cuIpcOpenMemHandle`); the device is a
//! [`Gpu`], so the tests run the path on a device of host memory. A call runs in
//! rounds of at most half a scratch buffer, the rounds alternating between the halves.
//! In a round each rank copies its input into its half, and after a fence the ranks read
//! each other's halves: an all-reduce on two ranks has each rank reduce the whole round
//! (one pass over both inputs); on more ranks each reduces its own slice into its half,
//! and after a second fence copies the others' reduced slices (two-shot).
//!
//! A fence is a synchronization of the caller's stream, then an exchange among the ranks,
//! so a rank reads a peer's half only once the peer's writes to it are complete. A rank
//! writes a half again only two rounds later, past a fence that every peer reaches only
//! after its reads of the previous use: no fence is needed at the end of a round.
//!
//! The hierarchical path (`tiered`) runs its rounds through the same halves.

use chorus_kernels::{DType, ReduceOp};

use super::gpu::{settle, Gpu, HANDLE};
use super::pipes::{self, DeviceMessage, SLOT_BYTES};
use super::{agree, slice, DeviceCall, Job};
use crate::{Communicator, Result};

/// Bytes of each half of a rank's scratch buffer: the most one round moves per rank.
const HALF_BYTES: usize = 64 << 20;
/// Bytes of the memory [`reach`] exports to probe which peers map it.
const PROBE_BYTES: usize = 2 << 20;

/// This rank's scratch buffer and every rank's, mapped into this process.
pub(super) struct Peers<G: Gpu> {
    scratch: G::Scratch,
    /// The peers' scratch buffers mapped into this process (unmapped on drop).
    mapped: Vec<G::Mapping>,
    /// Every rank's scratch buffer in this process's address space (this rank's own too).
    ptrs: Vec<u64>,
    /// Bytes of each half of every scratch buffer.
    half_bytes: usize,
    /// Bytes of each slot for sends, one per rank, past the halves.
    slot_bytes: usize,
    /// The half the next round uses (every rank runs the same rounds, so all agree).
    half: usize,
}

impl<G: Gpu> Peers<G> {
    /// Sets up the IPC path among `comm`'s ranks, which must share a host. `Ok(Err(why))`
    /// where some rank cannot take part (every rank gets it, each with its own words).
    /// A CUDA device's context must be current.
    pub fn connect(comm: &Communicator, gpu: &G) -> Result<std::result::Result<Peers<G>, String>> {
        Peers::sized(comm, gpu, (HALF_BYTES, SLOT_BYTES))
    }

    /// As [`connect`](Self::connect), with halves of `half_bytes` and slots for sends of
    /// `slot_bytes`.
    pub fn sized(
        comm: &Communicator,
        gpu: &G,
        (half_bytes, slot_bytes): (usize, usize),
    ) -> Result<std::result::Result<Peers<G>, String>> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let (exported, records) = export(comm, gpu, 2 * half_bytes + world * slot_bytes)?;
        if let Some(q) = records.iter().position(|theirs| theirs[0] != 1) {
            return Ok(Err(format!(
                "rank {q} cannot export device memory through CUDA IPC"
            )));
        }
        // This rank's own record passed the check above, so the export succeeded.
        let scratch = exported?;
        let mut ptrs = Vec::with_capacity(world);
        let mut mapped = Vec::with_capacity(world);
        let mut failure = None;
        for (q, theirs) in records.iter().enumerate() {
            if q == rank {
                ptrs.push(G::address(&scratch));
                continue;
            }
            let handle = theirs[1..].try_into().expect("a whole handle");
            match gpu.open(handle) {
                Ok(mapping) => {
                    ptrs.push(G::mapped(&mapping));
                    mapped.push(mapping);
                }
                Err(err) => {
                    failure.get_or_insert(format!(
                        "rank {rank} cannot map rank {q}'s device memory: {err}"
                    ));
                    ptrs.push(0);
                }
            }
        }
        let mut agreed = [u8::from(failure.is_none())];
        comm.all_reduce(&mut agreed, ReduceOp::Min)?;
        if agreed[0] == 0 {
            // Every rank unmaps its peers' memory before any frees its own.
            drop(mapped);
            comm.barrier()?;
            return Ok(Err(failure.unwrap_or_else(|| {
                "another rank cannot map its peers' device memory".into()
            })));
        }
        Ok(Ok(Peers {
            scratch,
            mapped,
            ptrs,
            half_bytes,
            slot_bytes,
            half: 0,
        }))
    }

    /// Unmaps the peers' buffers and waits until every rank has (so the scratch buffer
    /// freed next is no longer mapped anywhere).
    pub fn close(&mut self, comm: &Communicator) {
        self.mapped.clear();
        self.ptrs.clear();
        if let Err(err) = comm.barrier() {
            tracing::warn!(%err, "closing the device communicator: barrier failed");
        }
    }

    /// Runs the sends and receives `messages` among `comm`'s ranks (those this path was set
    /// up on) through the slots (see the `pipes` module), after the work enqueued on
    /// `stream`; returns once they have landed.
    pub fn exchange(
        &self,
        comm: &Communicator,
        gpu: &G,
        messages: &[DeviceMessage],
        stream: &G::Queue,
    ) -> Result<()> {
        let base = 2 * self.half_bytes;
        let slots = |from: usize, to: usize| self.ptrs[from] + (base + to * self.slot_bytes) as u64;
        pipes::exchange(comm, gpu, (&slots, self.slot_bytes), messages, stream)
    }

    /// Bytes of each half: the most a round moves per rank.
    pub fn half_bytes(&self) -> usize {
        self.half_bytes
    }

    /// The next round's half: its address in every rank's scratch buffer, and in this
    /// rank's own. Halves alternate from round to round.
    pub fn next_half(&mut self) -> (Vec<u64>, u64) {
        let at = (self.half * self.half_bytes) as u64;
        self.half ^= 1;
        let ptrs = self.ptrs.iter().map(|p| p + at).collect();
        (ptrs, G::address(&self.scratch) + at)
    }

    pub fn run(&mut self, comm: &Communicator, gpu: &G, job: Job, stream: &G::Queue) -> Result<()> {
        let size = job.dtype.size();
        let room = match job.call {
            DeviceCall::ReduceScatter(_) | DeviceCall::AllToAll => {
                self.half_bytes / comm.world_size()
            }
            _ => self.half_bytes,
        };
        let step = (room / size).max(1) * size;
        let ran = (0..job.block)
            .step_by(step)
            .enumerate()
            .try_for_each(|(i, offset)| {
                let (ptrs, scratch) = self.next_half();
                let round = Round {
                    comm,
                    gpu,
                    stream,
                    ptrs,
                    scratch,
                    job,
                    first: i == 0,
                };
                let len = step.min(job.block - offset);
                match job.call {
                    DeviceCall::AllReduce(op) => round.all_reduce(op, offset, len),
                    DeviceCall::Broadcast { root } => round.broadcast(root, offset, len),
                    DeviceCall::Reduce { op, root } => round.reduce(op, root, offset, len),
                    DeviceCall::AllGather => round.all_gather(offset, len),
                    DeviceCall::ReduceScatter(op) => round.reduce_scatter(op, offset, len),
                    DeviceCall::AllToAll => round.all_to_all(offset, len),
                }
            });
        settle(gpu, ran, &[stream])
    }
}

struct Round<'a, G: Gpu> {
    comm: &'a Communicator,
    gpu: &'a G,
    stream: &'a G::Queue,
    /// Every rank's half for this round.
    ptrs: Vec<u64>,
    /// This rank's half.
    scratch: u64,
    job: Job,
    /// The call's first round: its first fence checks that every rank makes this call.
    first: bool,
}

impl<G: Gpu> Round<'_, G> {
    fn all_reduce(&self, op: ReduceOp, offset: usize, len: usize) -> Result<()> {
        let (input, output) = self.at(offset);
        self.copy(self.scratch, input, len)?;
        self.fence(self.first)?;
        let (world, me) = (self.comm.world_size(), self.comm.rank());
        if world <= 2 {
            return self.reduce_from(op, output, 0, len);
        }
        let (start, end) = slice(len, self.job.dtype, world, me);
        let mine = output + start as u64;
        self.reduce_from(op, mine, start as u64, end - start)?;
        self.copy(self.scratch + start as u64, mine, end - start)?;
        self.fence(false)?;
        for (q, &theirs) in self.ptrs.iter().enumerate().filter(|(q, _)| *q != me) {
            let (start, end) = slice(len, self.job.dtype, world, q);
            self.copy(output + start as u64, theirs + start as u64, end - start)?;
        }
        Ok(())
    }

    fn broadcast(&self, root: usize, offset: usize, len: usize) -> Result<()> {
        let (input, output) = self.at(offset);
        if self.comm.rank() == root {
            self.copy(self.scratch, input, len)?;
            self.copy(output, input, len)?;
        }
        self.fence(self.first)?;
        if self.comm.rank() != root {
            self.copy(output, self.ptrs[root], len)?;
        }
        Ok(())
    }

    fn reduce(&self, op: ReduceOp, root: usize, offset: usize, len: usize) -> Result<()> {
        let (input, output) = self.at(offset);
        self.copy(self.scratch, input, len)?;
        self.fence(self.first)?;
        if self.comm.rank() == root {
            self.reduce_from(op, output, 0, len)?;
        }
        Ok(())
    }

    fn all_gather(&self, offset: usize, len: usize) -> Result<()> {
        let (input, _) = self.at(offset);
        self.copy(self.scratch, input, len)?;
        self.fence(self.first)?;
        for (q, &theirs) in self.ptrs.iter().enumerate() {
            let dst = self.job.output + (q * self.job.block + offset) as u64;
            let src = if q == self.comm.rank() { input } else { theirs };
            self.copy(dst, src, len)?;
        }
        Ok(())
    }

    fn reduce_scatter(&self, op: ReduceOp, offset: usize, len: usize) -> Result<()> {
        self.stage_blocks(offset, len)?;
        self.fence(self.first)?;
        let output = self.job.output + offset as u64;
        self.reduce_from(op, output, (self.comm.rank() * len) as u64, len)
    }

    /// Each rank copies its own block for rank `q` from rank `q`'s half.
    fn all_to_all(&self, offset: usize, len: usize) -> Result<()> {
        self.stage_blocks(offset, len)?;
        self.fence(self.first)?;
        let me = self.comm.rank();
        for (q, &theirs) in self.ptrs.iter().enumerate() {
            let dst = self.job.output + (q * self.job.block + offset) as u64;
            self.copy(dst, theirs + (me * len) as u64, len)?;
        }
        Ok(())
    }

    /// Copies bytes `offset..offset + len` of every block of the input into this rank's
    /// half, block `q` at `q * len`.
    fn stage_blocks(&self, offset: usize, len: usize) -> Result<()> {
        for q in 0..self.comm.world_size() {
            let src = self.job.input + (q * self.job.block + offset) as u64;
            self.copy(self.scratch + (q * len) as u64, src, len)?;
        }
        Ok(())
    }

    /// The input and output addresses at byte `offset` of this rank's block.
    fn at(&self, offset: usize) -> (u64, u64) {
        (
            self.job.input + offset as u64,
            self.job.output + offset as u64,
        )
    }

    /// `out = op` over every rank's scratch bytes `at..at + len`, in rank order (so every
    /// rank that computes a slice computes it alike); `Avg` divides at the end.
    fn reduce_from(&self, op: ReduceOp, out: u64, at: u64, len: usize) -> Result<()> {
        let sources: Vec<u64> = self.ptrs.iter().map(|p| p + at).collect();
        // SAFETY: every scratch buffer holds `at + len` bytes and is mapped here; `out` lies
        // in the caller's output; no peer writes its scratch before the next fence, and the
        // stream is synchronized before that fence.
        unsafe {
            reduce_into(
                self.gpu,
                self.stream,
                (op, self.job.dtype),
                out,
                &sources,
                len,
            )
        }
    }

    fn copy(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: the callers pass ranges inside the caller's buffers (lengths checked by
        // the communicator) or inside the halves of scratch buffers; the fences keep peers
        // from writing what is being read.
        unsafe { self.gpu.on_device(dst, src, len, self.stream) }
    }

    /// Waits for this rank's queued work, then for every rank to get there; with `check`,
    /// the meeting is `agree`'s exchange, which also checks the ranks make the same call.
    fn fence(&self, check: bool) -> Result<()> {
        self.gpu.finish(self.stream)?;
        if check {
            agree(self.comm, self.job)
        } else {
            self.comm.barrier()
        }
    }
}

/// A rank's record of its exported scratch memory: 1 and the handle, or 0 where it has none.
type Record = [u8; 1 + HANDLE];

/// Allocates `bytes` of scratch memory and exports it; with every rank's record. Collective.
fn export<G: Gpu>(
    comm: &Communicator,
    gpu: &G,
    bytes: usize,
) -> Result<(Result<G::Scratch>, Vec<Record>)> {
    let exported = gpu.scratch(bytes).and_then(|scratch| {
        let handle = gpu.export(&scratch)?;
        Ok((scratch, handle))
    });
    let mut record: Record = [0; 1 + HANDLE];
    if let Ok((_, handle)) = &exported {
        record[0] = 1;
        record[1..].copy_from_slice(handle);
    }
    let mut all = vec![0u8; record.len() * comm.world_size()];
    comm.all_gather(&record, &mut all)?;
    let records = all
        .chunks(record.len())
        .map(|r| r.try_into().expect("whole records"))
        .collect();
    Ok((exported.map(|(scratch, _)| scratch), records))
}

/// Which of `comm`'s ranks (ranks of one host) can map each other's device memory: for
/// every rank a mask whose bit `q` says it maps rank `q`'s (its own bit: it can export).
/// Collective; ranks past the 64th are reached by none.
pub(super) fn reach<G: Gpu>(comm: &Communicator, gpu: &G) -> Result<Vec<u64>> {
    let (exported, records) = export(comm, gpu, PROBE_BYTES)?;
    let mut mine = 0u64;
    if exported.is_ok() {
        for (q, theirs) in records.iter().enumerate().take(64) {
            let handle = theirs[1..].try_into().expect("a whole handle");
            // The mapping is dropped at once: the probe only asks whether it can be made.
            if q == comm.rank() || (theirs[0] == 1 && gpu.open(handle).is_ok()) {
                mine |= 1 << q;
            }
        }
    }
    let mut masks = vec![0u64; comm.world_size()];
    // After this exchange no rank maps another's probe, which is freed on return.
    comm.all_gather(&[mine], &mut masks)?;
    Ok(masks)
}

/// Enqueues `out = op` over `sources` (each `len` bytes of device memory of `dtype`),
/// reducing them in the order given; `Avg` divides by their number at the end.
///
/// # Safety
/// Every source and `out` must hold `len` bytes of device memory until the work has run,
/// nothing may write the sources meanwhile, and `out` may be the first source but no other.
pub(super) unsafe fn reduce_into<G: Gpu>(
    gpu: &G,
    queue: &G::Queue,
    (op, dtype): (ReduceOp, DType),
    out: u64,
    sources: &[u64],
    len: usize,
) -> Result<()> {
    match *sources {
        // SAFETY: the caller's contract.
        [only] => unsafe { gpu.on_device(out, only, len, queue)? },
        [a, b, ref rest @ ..] => {
            // SAFETY: the caller's contract: `out` is `a` or overlaps neither.
            unsafe { gpu.reduce(op, dtype, [out, a, b], len, queue)? };
            for &src in rest {
                // SAFETY: as above; `src` is not `out`.
                unsafe { gpu.reduce(op, dtype, [out, out, src], len, queue)? };
            }
        }
        [] => {}
    }
    if op == ReduceOp::Avg {
        // SAFETY: the caller's contract.
        unsafe { gpu.finish_avg(dtype, out, len, sources.len(), queue)? };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use chorus_kernels::DType;

    use super::*;
    use crate::cuda::gpu::lazy::{Buffer, LazyGpu};
    use crate::cuda::testing::{check, on_ranks, Case};
    use crate::Error;

    /// Bytes of each half in the tests: 1,000 four-byte elements take several rounds.
    const HALF: usize = 512;

    /// Every call the path makes, in sizes that take several rounds and one.
    fn cases() -> Vec<Case> {
        let (i32, f64) = (DType::I32, DType::F64);
        vec![
            (DeviceCall::AllReduce(ReduceOp::Sum), i32, 1000),
            (DeviceCall::AllReduce(ReduceOp::Avg), f64, 333),
            (DeviceCall::AllReduce(ReduceOp::Max), i32, 3),
            (
                DeviceCall::Reduce {
                    op: ReduceOp::Sum,
                    root: 1,
                },
                i32,
                1000,
            ),
            (DeviceCall::Broadcast { root: 1 }, i32, 1000),
            (DeviceCall::AllGather, i32, 300),
            (DeviceCall::ReduceScatter(ReduceOp::Sum), i32, 300),
            (DeviceCall::AllToAll, i32, 300),
            (DeviceCall::AllToAll, f64, 1),
            (DeviceCall::AllGather, i32, 0),
        ]
    }

    #[test]
    fn a_call_that_fails_halfway_has_run_its_copies_when_it_returns() {
        // The root's copy into its scratch memory enqueued, its copy to the output refused.
        on_ranks(&[0], |comm, _| {
            let gpu = LazyGpu::refusing_after(1);
            let mut peers = Peers::sized(comm, &gpu, (HALF, HALF))
                .expect("the exchange")
                .expect("the rank maps its own memory");
            let (input, output) = (Buffer::new(64), Buffer::new(64));
            let job = Job {
                call: DeviceCall::Broadcast { root: 0 },
                dtype: DType::I32,
                block: 64,
                input: input.address(),
                output: output.address(),
            };
            let stream = gpu.queue().expect("a queue");
            let failed = peers.run(comm, &gpu, job, &stream);
            peers.close(comm);
            assert!(matches!(failed, Err(Error::Internal(_))), "{failed:?}");
            assert!(gpu.idle(), "work left on a queue after the call returned");
        });
    }

    #[test]
    fn the_ipc_path_gives_every_rank_its_result() {
        let layouts: [&[usize]; 3] = [&[0, 0], &[0, 0, 0], &[0, 0, 0, 0]];
        check(&layouts, &cases(), |comm, gpu, _| {
            Peers::sized(comm, gpu, (HALF, HALF))
                .expect("the exchange")
                .expect("every rank maps its peers' memory")
        });
    }
}
