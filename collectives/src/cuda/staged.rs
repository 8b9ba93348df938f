//! The staged path: device data through page-locked host buffers and the host transport.
//!
//! A call is cut into chunks, and two chunks are in flight, one per slot: while one chunk
//! is on the wire, the other's copies and kernels run. Copies between the device and the
//! pinned buffers run on a stream of their own, kernels on the caller's stream, and events
//! order the two.
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

use std::sync::Arc;

use chorus_kernels::cuda::cudarc::driver::CudaEvent;
use chorus_kernels::cuda::memory::{
    copy_on_device, copy_to_device, copy_to_host, DeviceAlloc, Pinned,
};
use chorus_kernels::cuda::{CudaError, CudaStream, Device};
use chorus_kernels::ReduceOp;

use super::{agree, slice, slice_width, DeviceCall, Job};
use crate::communicator::CallKind;
use crate::{Communicator, Result};

/// Bytes of each pinned buffer (two slots, an input and an output buffer each).
const STAGE_BYTES: usize = 4 << 20;
/// The tag of the ring's messages (the communicator is this path's own).
const RING_TAG: u32 = 0;

pub(super) struct Staging {
    slots: [Slot; 2],
    /// Bytes of each pinned buffer and of each slot's device buffer.
    room: usize,
    /// Runs the copies between the device and the pinned buffers.
    copies: Arc<CudaStream>,
    /// Recorded on the caller's stream as a call starts; the copy stream waits for it.
    start: CudaEvent,
}

struct Slot {
    /// What this rank sends, or gives the host collective.
    input: Pinned,
    /// What this rank receives, or gets from the host collective.
    output: Pinned,
    /// Device memory for a received partial result, reduced in place.
    partial: DeviceAlloc,
    /// Recorded on the copy stream once `input` holds what is to be sent.
    ready: CudaEvent,
    /// Recorded on the copy stream once `output` has been copied into `partial`.
    landed: CudaEvent,
    /// Recorded on the caller's stream after each kernel of the slot.
    reduced: CudaEvent,
}

/// One chunk: bytes `offset..offset + len` of every rank block the call touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Chunk {
    offset: usize,
    len: usize,
}

impl Staging {
    /// Buffers for calls on `world` ranks; the device's context must be current.
    pub fn new(device: &Device, world: usize) -> Result<Staging> {
        // Room for `world` blocks of two 16-byte units at least: every chunk holds an
        // element, with room for the ring's segments to be rounded up to 16 bytes.
        let room = STAGE_BYTES.max(world.saturating_mul(32));
        let event = || {
            device
                .context()
                .new_event(None)
                .map_err(CudaError::driver("creating an event"))
        };
        let slot = || -> Result<Slot, CudaError> {
            Ok(Slot {
                input: Pinned::new(room)?,
                output: Pinned::new(room)?,
                partial: DeviceAlloc::new(room)?,
                ready: event()?,
                landed: event()?,
                reduced: event()?,
            })
        };
        Ok(Staging {
            slots: [slot()?, slot()?],
            room,
            copies: device.new_stream()?,
            start: event()?,
        })
    }

    pub fn run(
        &mut self,
        comm: &Communicator,
        device: &Device,
        job: Job,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        if comm.world_size() == 1 && !matches!(job.call, DeviceCall::Broadcast { .. }) {
            return alone(job, stream);
        }
        self.start
            .record(stream)
            .map_err(CudaError::driver("recording an event"))?;
        self.copies
            .wait(&self.start)
            .map_err(CudaError::driver("ordering the copy stream"))?;
        match job.call {
            DeviceCall::Broadcast { .. } | DeviceCall::AllGather => self.moves(comm, job),
            DeviceCall::AllReduce(op)
            | DeviceCall::Reduce { op, .. }
            | DeviceCall::ReduceScatter(op) => self.reduction(comm, device, job, op, stream),
        }?;
        self.copies
            .synchronize()
            .map_err(CudaError::driver("waiting for the copies"))?;
        stream
            .synchronize()
            .map_err(CudaError::driver("waiting for the stream"))?;
        Ok(())
    }

    /// Broadcast and all-gather: each chunk through the host collective.
    fn moves(&mut self, comm: &Communicator, job: Job) -> Result<()> {
        let chunks = chunks(job, comm.world_size(), self.room);
        for (slot, chunk) in chunks.iter().take(2).enumerate() {
            self.stage_in(slot, comm, job, *chunk)?;
        }
        for (i, chunk) in chunks.iter().enumerate() {
            let slot = i % 2;
            self.slots[slot].wait_ready()?;
            self.host_step(slot, comm, job, *chunk)?;
            self.stage_out(slot, comm, job, *chunk)?;
            if let Some(next) = chunks.get(i + 2) {
                self.stage_in(slot, comm, job, *next)?;
            }
        }
        Ok(())
    }

    /// Enqueues the copies of `chunk`'s input into slot `slot` and records its event.
    fn stage_in(&mut self, slot: usize, comm: &Communicator, job: Job, chunk: Chunk) -> Result<()> {
        let slot = &mut self.slots[slot];
        let source = match job.call {
            DeviceCall::Broadcast { root } if root != comm.rank() => None,
            _ => Some(job.input + chunk.offset as u64),
        };
        if let Some(src) = source {
            // SAFETY: `src` lies in the caller's input (the call's lengths were checked);
            // the slot's buffer holds `room >= len` bytes and is not read until `ready` fires.
            unsafe { copy_to_host(slot.input.at(0), src, chunk.len, &self.copies)? };
        }
        slot.ready
            .record(&self.copies)
            .map_err(CudaError::driver("recording an event"))?;
        Ok(())
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
        match job.call {
            DeviceCall::AllGather => comm.run_bytes(
                info,
                Some(input.bytes(chunk.len)),
                output.bytes_mut(comm.world_size() * chunk.len),
            ),
            _ => comm.run_bytes(info, None, input.bytes_mut(chunk.len)),
        }
    }

    /// Enqueues the copies of slot `slot`'s result to the device.
    fn stage_out(
        &mut self,
        slot: usize,
        comm: &Communicator,
        job: Job,
        chunk: Chunk,
    ) -> Result<()> {
        let slot = &self.slots[slot];
        let to = |block: usize| job.output + (block * job.block + chunk.offset) as u64;
        let copies: Vec<(u64, *const u8)> = match job.call {
            DeviceCall::AllGather => (0..comm.world_size())
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
            // (the copy stream runs in order).
            unsafe { copy_to_device(dst, src, chunk.len, &self.copies)? };
        }
        Ok(())
    }

    /// All-reduce, reduce and reduce-scatter: the ring on each chunk, two chunks at a time.
    fn reduction(
        &mut self,
        comm: &Communicator,
        device: &Device,
        job: Job,
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<()> {
        agree(comm, job)?;
        let (rank, world) = (comm.rank(), comm.world_size());
        let copies = &*self.copies;
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
                slot.stage(src, len, copies)?;
            }
            for step in 0..world - 1 {
                for (slot, ring) in self.slots.iter_mut().zip(&rings) {
                    slot.step(comm, device, ring, step, op, (copies, stream))?;
                }
            }
            if matches!(job.call, DeviceCall::ReduceScatter(_)) {
                continue;
            }
            for (slot, ring) in self.slots.iter_mut().zip(&rings) {
                let len = ring.segment(rank).1;
                slot.stage(ring.result(&slot.partial), len, copies)?;
            }
            for (slot, ring) in self.slots.iter_mut().zip(&rings) {
                slot.wait_ready()?;
                slot.gather(comm, ring, copies)?;
            }
        }
        Ok(())
    }
}

impl Slot {
    fn wait_ready(&self) -> Result<()> {
        self.ready
            .synchronize()
            .map_err(CudaError::driver("waiting for a copy to the host"))?;
        Ok(())
    }

    /// Enqueues the copy of `len` bytes at device address `src` into `input`, after the
    /// slot's kernels, and records `ready`.
    fn stage(&mut self, src: u64, len: usize, copies: &CudaStream) -> Result<()> {
        copies
            .wait(&self.reduced)
            .map_err(CudaError::driver("ordering the copy stream"))?;
        if len > 0 {
            // SAFETY: `src` holds `len <= room` bytes (a segment of the caller's buffers or
            // of `partial`); `input` is not read until `ready` fires after the copy.
            unsafe { copy_to_host(self.input.at(0), src, len, copies)? };
        }
        self.ready
            .record(copies)
            .map_err(CudaError::driver("recording an event"))?;
        Ok(())
    }

    /// Ring step `step`: sends the staged partial on, receives the previous rank's,
    /// and reduces this rank's own segment into it.
    fn step(
        &mut self,
        comm: &Communicator,
        device: &Device,
        ring: &Ring,
        step: usize,
        op: ReduceOp,
        (copies, stream): (&CudaStream, &CudaStream),
    ) -> Result<()> {
        let (rank, world) = (ring.rank, ring.world);
        let sending = ring.segment(ring.sent(step)).1;
        let (own, len) = ring.own(ring.sent(step + 1));
        self.wait_ready()?;
        let (input, output) = (&self.input, &mut self.output);
        comm.group(|g| {
            g.send(input.bytes(sending), (rank + 1) % world, RING_TAG);
            g.recv(output.bytes_mut(len), (rank + world - 1) % world, RING_TAG);
        })?;
        let last = step + 2 == world;
        let partial = self.partial.ptr();
        if len > 0 {
            let dst = if last {
                ring.result(&self.partial)
            } else {
                partial
            };
            copies
                .wait(&self.reduced)
                .map_err(CudaError::driver("ordering the copy stream"))?;
            // SAFETY: `partial` holds `room >= len` bytes and no kernel reads it until
            // `landed` fires; `output` is not received into again before `ready` fires,
            // after this copy on the same stream.
            unsafe { copy_to_device(partial, self.output.at(0), len, copies)? };
            self.landed
                .record(copies)
                .map_err(CudaError::driver("recording an event"))?;
            stream
                .wait(&self.landed)
                .map_err(CudaError::driver("ordering the stream"))?;
            // SAFETY: `dst`, `partial` and `own` each address `len` bytes (the result's
            // segment, the slot's buffer, the caller's input segment); `dst` overlaps
            // `own` only by being equal to it (an all-reduce in place).
            unsafe {
                device.reduce_into_raw(op, ring.job.dtype, [dst, partial, own], len, stream)?;
                if last && op == ReduceOp::Avg {
                    device.finish_avg_raw(ring.job.dtype, dst, len, world, stream)?;
                }
            }
            self.reduced
                .record(stream)
                .map_err(CudaError::driver("recording an event"))?;
        }
        if last {
            Ok(())
        } else {
            self.stage(partial, len, copies)
        }
    }

    /// All-reduce and reduce, after the ring: gathers the staged segment of every rank
    /// through the host collective and copies the others' segments into the output.
    fn gather(&mut self, comm: &Communicator, ring: &Ring, copies: &CudaStream) -> Result<()> {
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
                // SAFETY: segment `q` lies in the caller's output; the pinned bytes are not
                // written again before `ready` fires after this copy (same stream).
                unsafe {
                    copy_to_device(
                        job.output + at as u64,
                        self.output.at(q * width),
                        len,
                        copies,
                    )?
                };
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
    fn result(&self, partial: &DeviceAlloc) -> u64 {
        match self.job.call {
            DeviceCall::ReduceScatter(_) => self.job.output + self.chunk.offset as u64,
            DeviceCall::Reduce { .. } => partial.ptr(),
            _ => self.job.output + self.segment(self.rank).0 as u64,
        }
    }
}

/// A reduction on one rank: the input is the result.
fn alone(job: Job, stream: &CudaStream) -> Result<()> {
    if job.input != job.output && job.block > 0 {
        // SAFETY: both addresses hold `block` bytes of the caller's buffers.
        unsafe { copy_on_device(job.output, job.input, job.block, stream)? };
    }
    stream
        .synchronize()
        .map_err(CudaError::driver("waiting for the stream"))?;
    Ok(())
}

/// The chunks of `job`: every chunk fits a pinned buffer of `room` bytes with all the
/// blocks it stages (the ring's segments rounded up), and holds whole elements.
fn chunks(job: Job, world: usize, room: usize) -> Vec<Chunk> {
    let per_block = match job.call {
        DeviceCall::AllGather | DeviceCall::ReduceScatter(_) => room / world,
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
}
