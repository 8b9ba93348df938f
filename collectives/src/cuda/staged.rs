//! The staged path: device data through page-locked host buffers and the host collectives.
//!
//! A call is cut into chunks. Each chunk is copied from the device into a pinned buffer,
//! run through the host collective (any transport, reductions by the host kernels), and
//! copied back. Two slots alternate, so the copies of one chunk run on the stream while
//! the host collective works on the other.

use std::sync::Arc;

use chorus_kernels::cuda::cudarc::driver::CudaEvent;
use chorus_kernels::cuda::{CudaError, CudaStream, Device};

use super::{DeviceCall, Job};
use crate::{Communicator, Result};
use chorus_kernels::cuda::memory::{copy_to_device, copy_to_host, Pinned};

/// Bytes of each pinned buffer (two slots, an input and an output buffer each).
const STAGE_BYTES: usize = 4 << 20;

pub(super) struct Staging {
    slots: [Slot; 2],
    /// Bytes of each pinned buffer.
    room: usize,
}

struct Slot {
    input: Pinned,
    output: Pinned,
    /// Recorded on the stream once the slot's input has arrived.
    ready: CudaEvent,
}

/// One chunk: bytes `offset..offset + len` of every rank block the call touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Chunk {
    offset: usize,
    len: usize,
}

impl Staging {
    /// Pinned buffers for calls on `world` ranks; the device's context must be current.
    pub fn new(device: &Device, world: usize) -> Result<Staging> {
        // Room for `world` blocks of one 16-byte unit at least, so that every chunk holds an element.
        let room = STAGE_BYTES.max(world.saturating_mul(16));
        let slot = || -> Result<Slot, CudaError> {
            Ok(Slot {
                input: Pinned::new(room)?,
                output: Pinned::new(room)?,
                ready: device
                    .context()
                    .new_event(None)
                    .map_err(CudaError::driver("creating an event"))?,
            })
        };
        Ok(Staging {
            slots: [slot()?, slot()?],
            room,
        })
    }

    pub fn run(&mut self, comm: &Communicator, job: Job, stream: &Arc<CudaStream>) -> Result<()> {
        let world = comm.world_size();
        let chunks = chunks(job, world, self.room);
        for (i, chunk) in chunks.iter().take(2).enumerate() {
            self.stage_in(i, comm, job, *chunk, stream)?;
        }
        for (i, chunk) in chunks.iter().enumerate() {
            let slot = i % 2;
            self.slots[slot]
                .ready
                .synchronize()
                .map_err(CudaError::driver("waiting for a copy to the host"))?;
            self.host_step(slot, comm, job, *chunk)?;
            self.stage_out(slot, comm, job, *chunk, stream)?;
            if let Some(next) = chunks.get(i + 2) {
                self.stage_in(slot, comm, job, *next, stream)?;
            }
        }
        stream
            .synchronize()
            .map_err(CudaError::driver("waiting for the copies to the device"))?;
        Ok(())
    }

    /// Enqueues the copies of `chunk`'s input into slot `slot` and records its event.
    fn stage_in(
        &mut self,
        slot: usize,
        comm: &Communicator,
        job: Job,
        chunk: Chunk,
        stream: &CudaStream,
    ) -> Result<()> {
        let slot = &mut self.slots[slot];
        let from = |block: usize| job.input + (block * job.block + chunk.offset) as u64;
        let sources: Vec<u64> = match job.call {
            DeviceCall::Broadcast { root } if root != comm.rank() => Vec::new(),
            DeviceCall::ReduceScatter(_) => (0..comm.world_size()).map(from).collect(),
            _ => vec![from(0)],
        };
        for (i, src) in sources.into_iter().enumerate() {
            // SAFETY: `src` lies in the caller's input (the call's lengths were checked);
            // the slot's buffer holds `room >= sources * len` bytes and is not read until
            // `ready` fires.
            unsafe { copy_to_host(slot.input.at(i * chunk.len), src, chunk.len, stream)? };
        }
        slot.ready
            .record(stream)
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
        let world = comm.world_size();
        let (kind, op, root) = job.call.host();
        let info = (kind, job.dtype, op, root, chunk.len / job.dtype.size());
        let Slot { input, output, .. } = &mut self.slots[slot];
        match job.call {
            DeviceCall::AllGather => comm.run_bytes(
                info,
                Some(input.bytes(chunk.len)),
                output.bytes_mut(world * chunk.len),
            ),
            DeviceCall::ReduceScatter(_) => comm.run_bytes(
                info,
                Some(input.bytes(world * chunk.len)),
                output.bytes_mut(chunk.len),
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
        stream: &CudaStream,
    ) -> Result<()> {
        let rank = comm.rank();
        let slot = &self.slots[slot];
        let to = |block: usize| job.output + (block * job.block + chunk.offset) as u64;
        let copies: Vec<(u64, *const u8)> = match job.call {
            DeviceCall::AllGather => (0..comm.world_size())
                .map(|q| (to(q), slot.output.at(q * chunk.len).cast_const()))
                .collect(),
            DeviceCall::ReduceScatter(_) => vec![(to(0), slot.output.at(0).cast_const())],
            DeviceCall::Reduce { root, .. } if root != rank => Vec::new(),
            DeviceCall::Broadcast { root } if root == rank && job.input == job.output => Vec::new(),
            _ => vec![(to(0), slot.input.at(0).cast_const())],
        };
        for (dst, src) in copies {
            // SAFETY: `dst` lies in the caller's output (lengths checked); `src` is a
            // chunk of the slot, which is not written again before `ready` fires after
            // this copy (the stream runs the copies in order).
            unsafe { copy_to_device(dst, src, chunk.len, stream)? };
        }
        Ok(())
    }
}

/// The chunks of `job`: every chunk fits a pinned buffer of `room` bytes with all the
/// blocks it stages, and holds whole elements.
fn chunks(job: Job, world: usize, room: usize) -> Vec<Chunk> {
    let per_block = match job.call {
        DeviceCall::AllGather | DeviceCall::ReduceScatter(_) => room / world,
        _ => room,
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
    use chorus_kernels::{DType, ReduceOp};

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
        let all_reduce = job(DeviceCall::AllReduce(ReduceOp::Sum), DType::F64, 100);
        let got = chunks(all_reduce, 4, 24);
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
}
