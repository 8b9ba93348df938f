//! The staged path: device data through page-locked host buffers and the host transport.
//!
//! A call is cut into chunks, and two chunks are in flight, one per slot: while one chunk
//! is on the wire, the other's copies and kernels run. Copies between the device and the
//! pinned buffers run on a queue of their own, kernels on the caller's, and events order
//! the two.
//!
//! * Broadcast and all-gather, which only move bytes, run each chunk through the host
//!   collective: copied into a pinned buffer, run, copied back.
//! * The reductions run on the GPU, as a ring over the chunk's `world` segments. At each of
//!   `world - 1` steps, a rank copies a partial result into a pinned buffer and sends it to
//!   the next rank while it receives the previous rank's partial into another; it copies
//!   that to device memory and adds its own segment to it with the NVRTC kernels. After the
//!   last step each rank holds one segment of the result: reduce-scatter is done there,
//!   all-reduce all-gathers the segments and reduce gathers them to the root, through the
//!   host collective.
//!
//! The device is a [`Gpu`]: a CUDA device in use, and in the tests a device of host memory
//! whose queues run only when waited for, which checks the ordering too.

use std::sync::Arc;

use chorus_kernels::ReduceOp;

use super::gpu::{settle, Gpu, HostBuffer};
use super::{agree, slice, slice_width, DeviceCall, Job};
use crate::communicator::CallKind;
use crate::{Communicator, Result};

/// Bytes of each pinned buffer (two slots, an input and an output buffer each).
pub(super) const STAGE_BYTES: usize = 4 << 20;
/// The tag of the ring's messages (the communicator is this path's own).
const RING_TAG: u32 = 0;

pub(super) struct Staging<G: Gpu> {
    slots: [Slot<G>; 2],
    /// Bytes of each pinned buffer and of each slot's device buffer.
    room: usize,
    /// Runs the copies between the device and the pinned buffers.
    copies: Arc<G::Queue>,
    /// Recorded on the caller's queue as a call starts; the copy queue waits for it.
    start: G::Event,
}

struct Slot<G: Gpu> {
    /// What this rank sends, or gives the host collective.
    input: G::Pinned,
    /// What this rank receives, or gets from the host collective.
    output: G::Pinned,
    /// Device memory for a received partial result, reduced in place.
    partial: G::Scratch,
    /// Recorded on the copy queue once `input` holds what is to be sent.
    ready: G::Event,
    /// Recorded on the copy queue once `output` has been copied into `partial`.
    landed: G::Event,
    /// Recorded on the caller's queue after each kernel of the slot.
    reduced: G::Event,
}

/// One chunk: bytes `offset..offset + len` of every rank block the call touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Chunk {
    offset: usize,
    len: usize,
}

impl<G: Gpu> Staging<G> {
    /// Buffers for calls on `world` ranks; a CUDA device's context must be current.
    pub fn new(gpu: &G, world: usize) -> Result<Staging<G>> {
        Staging::sized(gpu, world, STAGE_BYTES)
    }

    /// As [`new`](Self::new), with pinned buffers of `bytes` (or the least that works).
    pub fn sized(gpu: &G, world: usize, bytes: usize) -> Result<Staging<G>> {
        // Room for `world` blocks of two 16-byte units at least: every chunk holds an
        // element, with room for the ring's segments to be rounded up to 16 bytes.
        let room = bytes.max(world.saturating_mul(32));
        let slot = || -> Result<Slot<G>> {
            Ok(Slot {
                input: gpu.pinned(room)?,
                output: gpu.pinned(room)?,
                partial: gpu.scratch(room)?,
                ready: gpu.event()?,
                landed: gpu.event()?,
                reduced: gpu.event()?,
            })
        };
        Ok(Staging {
            slots: [slot()?, slot()?],
            room,
            copies: gpu.queue()?,
            start: gpu.event()?,
        })
    }

    /// Runs `job` on `comm`'s ranks, ordered after the work enqueued on `stream` before it;
    /// returns once the call's copies and kernels have run.
    pub fn run(&mut self, comm: &Communicator, gpu: &G, job: Job, stream: &G::Queue) -> Result<()> {
        if comm.world_size() == 1 && !matches!(job.call, DeviceCall::Broadcast { .. }) {
            return alone(gpu, job, stream);
        }
        gpu.record(&self.start, stream)?;
        gpu.wait(&self.copies, &self.start)?;
        let ran = match job.call {
            DeviceCall::Broadcast { .. } | DeviceCall::AllGather | DeviceCall::AllToAll => {
                self.moves(comm, gpu, job)
            }
            DeviceCall::AllReduce(op)
            | DeviceCall::Reduce { op, .. }
            | DeviceCall::ReduceScatter(op) => self.reduction(comm, gpu, job, op, stream),
        };
        settle(gpu, ran, &[&*self.copies, stream])
    }

    /// Broadcast, all-gather and all-to-all: each chunk through the host collective.
    fn moves(&mut self, comm: &Communicator, gpu: &G, job: Job) -> Result<()> {
        let chunks = chunks(job, comm.world_size(), self.room);
        for (slot, chunk) in chunks.iter().take(2).enumerate() {
            self.stage_in(slot, comm, gpu, job, *chunk)?;
        }
        for (i, chunk) in chunks.iter().enumerate() {
            let slot = i % 2;
            gpu.wait_event(&self.slots[slot].ready)?;
            self.host_step(slot, comm, job, *chunk)?;
            self.stage_out(slot, comm, gpu, job, *chunk)?;
            if let Some(next) = chunks.get(i + 2) {
                self.stage_in(slot, comm, gpu, job, *next)?;
            }
        }
        Ok(())
    }

    /// Enqueues the copies of `chunk`'s input into slot `slot` and records its event.
    fn stage_in(
        &mut self,
        slot: usize,
        comm: &Communicator,
        gpu: &G,
        job: Job,
        chunk: Chunk,
    ) -> Result<()> {
        let slot = &mut self.slots[slot];
        let from = |block: usize| job.input + (block * job.block + chunk.offset) as u64;
        let sources: Vec<(usize, u64)> = match job.call {
            DeviceCall::Broadcast { root } if root != comm.rank() => Vec::new(),
            DeviceCall::AllToAll => (0..comm.world_size())
                .map(|q| (q * chunk.len, from(q)))
                .collect(),
            _ => vec![(0, from(0))],
        };
        for (at, src) in sources {
            // SAFETY: `src` lies in the caller's input (the call's lengths were checked);
            // the slot's buffer holds `room >= at + len` bytes (a chunk of an all-to-all is
            // `room / world`) and is not read until `ready` fires.
            unsafe { gpu.to_host(slot.input.at(at), src, chunk.len, &self.copies)? };
        }
        gpu.record(&slot.ready, &self.copies)
    }

    /// Runs the host collective on slot `slot`, whose input has arrived.
    fn host_step(
        &mut self,
        slot: usize,
        comm: &Communicator,
        job: Job,
        chunk: Chunk,
    ) -> Result<()> {
        let (kind, op, root) = job.call.host();
        let info = (kind, job.dtype, op, root, chunk.len / job.dtype.size());
        let Slot { input, output, .. } = &mut self.slots[slot];
        let all = comm.world_size() * chunk.len;
        match job.call {
            DeviceCall::AllGather => {
                comm.run_bytes(info, Some(input.bytes(chunk.len)), output.bytes_mut(all))
            }
            DeviceCall::AllToAll => {
                let counts = vec![chunk.len; comm.world_size()];
                let (input, output) = (input.bytes(all), output.bytes_mut(all));
                comm.all_to_all_v(input, &counts, output, &counts)
            }
            _ => comm.run_bytes(info, None, input.bytes_mut(chunk.len)),
        }
    }

    /// Enqueues the copies of slot `slot`'s result to the device.
    fn stage_out(
        &mut self,
        slot: usize,
        comm: &Communicator,
        gpu: &G,
        job: Job,
        chunk: Chunk,
    ) -> Result<()> {
        let slot = &self.slots[slot];
        let to = |block: usize| job.output + (block * job.block + chunk.offset) as u64;
        let copies: Vec<(u64, *const u8)> = match job.call {
            DeviceCall::AllGather | DeviceCall::AllToAll => (0..comm.world_size())
                .map(|q| (to(q), slot.output.at(q * chunk.len).cast_const()))
                .collect(),
            DeviceCall::Broadcast { root } if root == comm.rank() && job.input == job.output => {
                Vec::new()
            }
            _ => vec![(to(0), slot.input.at(0).cast_const())],
        };
        for (dst, src) in copies {
            // SAFETY: `dst` lies in the caller's output (lengths checked); `src` is a chunk
            // of the slot, which is not written again before `ready` fires after this copy
            // (the copy queue runs in order).
            unsafe { gpu.to_device(dst, src, chunk.len, &self.copies)? };
        }
        Ok(())
    }

    /// All-reduce, reduce and reduce-scatter: the ring on each chunk, two chunks at a time.
    fn reduction(
        &mut self,
        comm: &Communicator,
        gpu: &G,
        job: Job,
        op: ReduceOp,
        stream: &G::Queue,
    ) -> Result<()> {
        agree(comm, job)?;
        let (rank, world) = (comm.rank(), comm.world_size());
        let queues = (&*self.copies, stream);
        for pair in chunks(job, world, self.room).chunks(2) {
            let rings: Vec<Ring> = pair
                .iter()
                .map(|&chunk| Ring {
                    job,
                    chunk,
                    rank,
                    world,
                })
                .collect();
            for (slot, ring) in self.slots.iter_mut().zip(&rings) {
                let (src, len) = ring.own(ring.sent(0));
                slot.stage(gpu, src, len, queues.0)?;
            }
            for step in 0..world - 1 {
                for (slot, ring) in self.slots.iter_mut().zip(&rings) {
                    slot.step(comm, gpu, ring, step, op, queues)?;
                }
            }
            if matches!(job.call, DeviceCall::ReduceScatter(_)) {
                continue;
            }
            for (slot, ring) in self.slots.iter_mut().zip(&rings) {
                let len = ring.segment(rank).1;
                let result = ring.result(G::address(&slot.partial));
                slot.stage(gpu, result, len, queues.0)?;
            }
            for (slot, ring) in self.slots.iter_mut().zip(&rings) {
                gpu.wait_event(&slot.ready)?;
                slot.gather(comm, gpu, ring, queues.0)?;
            }
        }
        Ok(())
    }
}

impl<G: Gpu> Slot<G> {
    /// Enqueues the copy of `len` bytes at device address `src` into `input`, after the
    /// slot's kernels, and records `ready`.
    fn stage(&mut self, gpu: &G, src: u64, len: usize, copies: &G::Queue) -> Result<()> {
        gpu.wait(copies, &self.reduced)?;
        if len > 0 {
            // SAFETY: `src` holds `len <= room` bytes (a segment of the caller's buffers or
            // of `partial`); `input` is not read until `ready` fires after the copy.
            unsafe { gpu.to_host(self.input.at(0), src, len, copies)? };
        }
        gpu.record(&self.ready, copies)
    }

    /// Ring step `step`: sends the staged partial on, receives the previous rank's,
    /// and reduces this rank's own segment into it.
    fn step(
        &mut self,
        comm: &Communicator,
        gpu: &G,
        ring: &Ring,
        step: usize,
        op: ReduceOp,
        (copies, stream): (&G::Queue, &G::Queue),
    ) -> Result<()> {
        let (rank, world) = (ring.rank, ring.world);
        let sending = ring.segment(ring.sent(step)).1;
        let (own, len) = ring.own(ring.sent(step + 1));
        gpu.wait_event(&self.ready)?;
        let (input, output) = (&self.input, &mut self.output);
        comm.group(|g| {
            g.send(input.bytes(sending), (rank + 1) % world, RING_TAG);
            g.recv(output.bytes_mut(len), (rank + world - 1) % world, RING_TAG);
        })?;
        let last = step + 2 == world;
        let partial = G::address(&self.partial);
        if len > 0 {
            let dst = if last { ring.result(partial) } else { partial };
            gpu.wait(copies, &self.reduced)?;
            // SAFETY: `partial` holds `room >= len` bytes and no kernel reads it until
            // `landed` fires; `output` is not received into again before `ready` fires,
            // after this copy on the same queue.
            unsafe { gpu.to_device(partial, self.output.at(0), len, copies)? };
            gpu.record(&self.landed, copies)?;
            gpu.wait(stream, &self.landed)?;
            // SAFETY: `dst`, `partial` and `own` each address `len` bytes (the result's
            // segment, the slot's buffer, the caller's input segment); `dst` overlaps
            // `own` only by being equal to it (an all-reduce in place).
            unsafe {
                gpu.reduce(op, ring.job.dtype, [dst, partial, own], len, stream)?;
                if last && op == ReduceOp::Avg {
                    gpu.finish_avg(ring.job.dtype, dst, len, world, stream)?;
                }
            }
            gpu.record(&self.reduced, stream)?;
        }
        if last {
            Ok(())
        } else {
            self.stage(gpu, partial, len, copies)
        }
    }

    /// All-reduce and reduce, after the ring: gathers the staged segment of every rank
    /// through the host collective and copies the others' segments into the output.
    fn gather(
        &mut self,
        comm: &Communicator,
        gpu: &G,
        ring: &Ring,
        copies: &G::Queue,
    ) -> Result<()> {
        let job = ring.job;
        let width = slice_width(ring.chunk.len, job.dtype, ring.world);
        let count = width / job.dtype.size();
        let (kind, root, mine) = match job.call {
            DeviceCall::Reduce { root, .. } => (CallKind::Gather, root, None),
            _ => (CallKind::AllGather, 0, Some(ring.rank)),
        };
        comm.run_bytes(
            (kind, job.dtype, ReduceOp::Sum, root, count),
            Some(self.input.bytes(width)),
            self.output.bytes_mut(ring.world * width),
        )?;
        if kind == CallKind::Gather && ring.rank != root {
            return Ok(());
        }
        for q in (0..ring.world).filter(|&q| Some(q) != mine) {
            let (at, len) = ring.segment(q);
            if len > 0 {
                let (dst, src) = (job.output + at as u64, self.output.at(q * width));
                // SAFETY: segment `q` lies in the caller's output; the pinned bytes are not
                // written again before `ready` fires after this copy (same queue).
                unsafe { gpu.to_device(dst, src, len, copies)? };
            }
        }
        Ok(())
    }
}

/// One chunk of a reduction, cut into `world` segments for the ring.
struct Ring {
    job: Job,
    chunk: Chunk,
    rank: usize,
    world: usize,
}

impl Ring {
    /// The segment this rank sends at `step` (and, at `step + 1`, reduces into): segment
    /// `rank - step - 1`, so that after `world - 1` steps it holds segment `rank` reduced.
    fn sent(&self, step: usize) -> usize {
        (self.rank + (step + 1) * (self.world - 1)) % self.world
    }

    /// Segment `q`: its offset from the start of a rank block's buffer, and its length.
    fn segment(&self, q: usize) -> (usize, usize) {
        match self.job.call {
            DeviceCall::ReduceScatter(_) => {
                (q * self.job.block + self.chunk.offset, self.chunk.len)
            }
            _ => {
                let (start, end) = slice(self.chunk.len, self.job.dtype, self.world, q);
                (self.chunk.offset + start, end - start)
            }
        }
    }

    /// The device address and length of this rank's own input for segment `q`.
    fn own(&self, q: usize) -> (u64, usize) {
        let (at, len) = self.segment(q);
        (self.job.input + at as u64, len)
    }

    /// Where this rank's reduced segment goes: its place in the output, or, for a reduce
    /// (whose outputs other than the root's stay untouched), the slot's device buffer.
    fn result(&self, partial: u64) -> u64 {
        match self.job.call {
            DeviceCall::ReduceScatter(_) => self.job.output + self.chunk.offset as u64,
            DeviceCall::Reduce { .. } => partial,
            _ => self.job.output + self.segment(self.rank).0 as u64,
        }
    }
}

/// A reduction on one rank: the input is the result.
fn alone<G: Gpu>(gpu: &G, job: Job, stream: &G::Queue) -> Result<()> {
    if job.input != job.output && job.block > 0 {
        // SAFETY: both addresses hold `block` bytes of the caller's buffers.
        unsafe { gpu.on_device(job.output, job.input, job.block, stream)? };
    }
    gpu.finish(stream)
}

/// The chunks of `job`: every chunk fits a pinned buffer of `room` bytes with all the
/// blocks it stages (the ring's segments rounded up), and holds whole elements.
fn chunks(job: Job, world: usize, room: usize) -> Vec<Chunk> {
    let per_block = match job.call {
        DeviceCall::AllGather | DeviceCall::ReduceScatter(_) | DeviceCall::AllToAll => room / world,
        DeviceCall::AllReduce(_) | DeviceCall::Reduce { .. } => {
            room.saturating_sub(world.saturating_mul(16))
        }
        DeviceCall::Broadcast { .. } => room,
    };
    let size = job.dtype.size();
    let step = (per_block / size).max(1) * size;
    (0..job.block)
        .step_by(step)
        .map(|offset| Chunk {
            offset,
            len: step.min(job.block - offset),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::gpu::lazy::{Buffer, LazyGpu};
    use crate::cuda::testing::{self, Case};
    use crate::Error;
    use chorus_kernels::DType;

    fn job(call: DeviceCall, dtype: DType, block: usize) -> Job {
        Job {
            call,
            dtype,
            block,
            input: 0,
            output: 0,
        }
    }

    #[test]
    fn chunks_cover_the_block_in_whole_elements() {
        let broadcast = job(DeviceCall::Broadcast { root: 0 }, DType::F64, 100);
        let got = chunks(broadcast, 4, 24);
        assert_eq!(
            got,
            [(0, 24), (24, 24), (48, 24), (72, 24), (96, 4)]
                .map(|(offset, len)| Chunk { offset, len })
        );
        // All-gather stages one block per rank: a quarter of the room each.
        let gather = job(DeviceCall::AllGather, DType::F32, 20);
        assert_eq!(chunks(gather, 4, 32).len(), 3);
        assert!(chunks(gather, 4, 32).iter().all(|c| c.len % 4 == 0));
        assert!(chunks(job(DeviceCall::AllGather, DType::F32, 0), 4, 32).is_empty());
    }

    #[test]
    fn a_chunks_ring_segments_fit_the_room() {
        let world = 3;
        let all_reduce = job(DeviceCall::AllReduce(ReduceOp::Sum), DType::F32, 1000);
        for chunk in chunks(all_reduce, world, 128) {
            let width = slice_width(chunk.len, DType::F32, world);
            assert!(world * width <= 128, "{chunk:?}: {world} x {width}");
        }
    }

    #[test]
    fn the_ring_reduces_every_segment_once_and_ends_on_its_own() {
        for world in 2..=5 {
            let chunk = Chunk { offset: 0, len: 64 };
            for rank in 0..world {
                let ring = Ring {
                    job: job(DeviceCall::AllReduce(ReduceOp::Sum), DType::F32, 64),
                    chunk,
                    rank,
                    world,
                };
                // What rank sends at a step, the next rank reduces into at that step.
                let next = Ring {
                    rank: (rank + 1) % world,
                    ..ring
                };
                for step in 0..world - 1 {
                    assert_eq!(ring.sent(step), next.sent(step + 1));
                }
                let reduced: Vec<usize> = (1..world).map(|s| ring.sent(s)).collect();
                assert_eq!(reduced.last(), Some(&rank), "world {world}");
                let mut sorted = reduced.clone();
                sorted.sort_unstable();
                sorted.dedup();
                assert_eq!(sorted.len(), world - 1);
            }
        }
    }

    /// A room of 256 bytes cuts 1,000 elements into many chunks, so both slots take turns.
    const ROOM: usize = 256;

    /// Every world of two to four ranks (each its own host, as the path does not look).
    const WORLDS: [&[usize]; 3] = [&[0, 1], &[0, 1, 2], &[0, 1, 2, 3]];

    /// Checks `cases` through the staged path with pinned buffers of `room` bytes.
    fn check(cases: &[Case], room: usize) {
        testing::check(&WORLDS, cases, |comm, gpu, _| {
            Staging::sized(gpu, comm.world_size(), room).expect("staging")
        });
    }

    #[test]
    fn the_staged_reductions_give_every_rank_its_result() {
        let reduce = DeviceCall::Reduce {
            op: ReduceOp::Sum,
            root: 1,
        };
        check(
            &[
                (DeviceCall::AllReduce(ReduceOp::Sum), DType::I32, 1000),
                (DeviceCall::AllReduce(ReduceOp::Avg), DType::F64, 333),
                (reduce, DType::I32, 1000),
                (DeviceCall::ReduceScatter(ReduceOp::Sum), DType::I32, 500),
            ],
            ROOM,
        );
    }

    #[test]
    fn the_staged_moves_give_every_rank_its_result() {
        let broadcast = DeviceCall::Broadcast { root: 1 };
        check(
            &[
                (broadcast, DType::I32, 1000),
                (DeviceCall::AllGather, DType::I32, 500),
                (DeviceCall::AllToAll, DType::I32, 300),
                (DeviceCall::AllToAll, DType::F64, 1),
            ],
            ROOM,
        );
    }

    #[test]
    fn a_call_of_one_chunk_and_an_empty_call_work_too() {
        let all_reduce = DeviceCall::AllReduce(ReduceOp::Sum);
        check(&[(all_reduce, DType::I32, 7)], STAGE_BYTES);
        check(&[(DeviceCall::AllGather, DType::I32, 0)], ROOM);
    }

    #[test]
    fn a_call_that_fails_halfway_has_run_its_copies_when_it_returns() {
        // A broadcast of 16 chunks on one rank: both slots staged in, the first chunk out,
        // then the third chunk's copy in refused, with the second's still to run.
        testing::on_ranks(&[0], |comm, _| {
            let gpu = LazyGpu::refusing_after(3);
            let mut staging = Staging::sized(&gpu, 1, 64).expect("buffers");
            let (input, output) = (Buffer::new(1024), Buffer::new(1024));
            let job = Job {
                input: input.address(),
                output: output.address(),
                ..job(DeviceCall::Broadcast { root: 0 }, DType::I32, 1024)
            };
            let stream = gpu.queue().expect("a queue");
            let failed = staging.run(comm, &gpu, job, &stream);
            assert!(matches!(failed, Err(Error::Internal(_))), "{failed:?}");
            assert!(gpu.idle(), "work left on a queue after the call returned");
        });
    }

    #[test]
    fn the_lazy_device_runs_nothing_before_it_is_waited_for() {
        let gpu = LazyGpu::default();
        let (copies, device) = (gpu.queue().unwrap(), Buffer::new(16));
        let mut host = Buffer::new(16);
        let done = gpu.event().unwrap();
        // SAFETY: both buffers hold 16 bytes and live past the copy, which runs while no
        // other borrow of them is live (writing `host` before it runs is this test's point).
        unsafe {
            gpu.to_host(host.at(0), device.address(), 16, &copies)
                .unwrap()
        };
        gpu.record(&done, &copies).unwrap();
        host.bytes_mut(16).fill(7);
        gpu.wait_event(&done).unwrap();
        assert_eq!(
            host.bytes(16),
            [0; 16],
            "the copy ran when waited for, not before"
        );
        // A queue told to wait for another's event runs that one's work first.
        let (other, late) = (gpu.queue().unwrap(), Buffer::new(16));
        host.bytes_mut(16).fill(9);
        // SAFETY: as above.
        unsafe {
            gpu.to_device(late.address(), host.at(0), 16, &copies)
                .unwrap()
        };
        gpu.record(&done, &copies).unwrap();
        gpu.wait(&other, &done).unwrap();
        gpu.finish(&other).unwrap();
        assert_eq!(late.bytes(16), [9; 16]);
    }
}
