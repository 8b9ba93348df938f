//! Calls over one buffer per local device: a process that drives several GPUs (seed
//! 003's DataParallel, NCCL's `ncclCommInitAll`), or several buffers of one GPU.
//!
//! The buffers are reduced into the first one on its device (peer copies from the
//! others, then the reduction kernel), that buffer goes through the communicator's call
//! across ranks, and the result is copied back to the other buffers.

use std::sync::Arc;

use chorus_kernels::cuda::cudarc::driver::result;
use chorus_kernels::cuda::{CudaError, CudaStream, DevicePtr, DevicePtrMut};
use chorus_kernels::{Element, ReduceOp};

use super::{CudaCommunicator, DeviceCall, Shared};
use crate::{Error, Result};

impl CudaCommunicator {
    /// All-reduce over `bufs`, one buffer per local device, across every buffer of every
    /// rank: each ends with the reduction of all `world_size * bufs.len()` of them
    /// (`Avg` divides by that count). `bufs[i]` is ordered on `streams[i]` (on its
    /// device); `bufs[0]` is on this communicator's device. Blocking, like
    /// [`all_reduce`](Self::all_reduce).
    ///
    /// Fails unless there are as many streams as buffers, at least one, all of one length.
    pub fn all_reduce_local<T: Element, B: DevicePtrMut<T>>(
        &self,
        bufs: &mut [B],
        op: ReduceOp,
        streams: &[Arc<CudaStream>],
    ) -> Result<()> {
        let world = self.world_size();
        self.now(|s| {
            let ptrs = s.locals(bufs, streams)?;
            let _guards: Vec<_> = ptrs.guards;
            let (first, bytes) = (ptrs.addrs[0], ptrs.bytes);
            if ptrs.addrs.len() > 1 {
                let stream = &streams[0];
                // SAFETY: a fresh allocation of `bytes` bytes, freed after the stream's work.
                let tmp = unsafe { stream.alloc::<u8>(bytes.max(1)) }
                    .map_err(CudaError::driver("allocating device memory"))?;
                let (at, _tmp) = tmp.device_ptr(stream);
                for (&other, other_stream) in ptrs.addrs[1..].iter().zip(&streams[1..]) {
                    s.copy_between((at, stream), (other, other_stream), bytes, stream)?;
                    // SAFETY: `first` and `at` hold `bytes` bytes on this device, kept
                    // alive (borrowed buffer, live allocation) until the stream is synchronized.
                    unsafe {
                        s.device
                            .reduce_into_raw(op, T::DTYPE, [first, first, at], bytes, stream)?
                    };
                }
            }
            let across = if op == ReduceOp::Avg {
                ReduceOp::Sum
            } else {
                op
            };
            let job = s.job(
                DeviceCall::AllReduce(across),
                T::DTYPE,
                bytes / T::DTYPE.size(),
                (first, first),
            )?;
            s.run(job, &streams[0])?;
            if op == ReduceOp::Avg {
                let n = world * ptrs.addrs.len();
                // SAFETY: as above; `first` is the caller's first buffer.
                unsafe {
                    s.device
                        .finish_avg_raw(T::DTYPE, first, bytes, n, &streams[0])?
                };
            }
            s.fan_out(&ptrs.addrs, bytes, streams)
        })
    }

    /// Broadcast of rank `root`'s `bufs[0]` into every buffer of every rank (`bufs` and
    /// `streams` as for [`all_reduce_local`](Self::all_reduce_local)).
    pub fn broadcast_local<T: Element, B: DevicePtrMut<T>>(
        &self,
        bufs: &mut [B],
        root: usize,
        streams: &[Arc<CudaStream>],
    ) -> Result<()> {
        self.now(|s| {
            let ptrs = s.locals(bufs, streams)?;
            let _guards: Vec<_> = ptrs.guards;
            let first = ptrs.addrs[0];
            let job = s.job(
                DeviceCall::Broadcast { root },
                T::DTYPE,
                ptrs.bytes / T::DTYPE.size(),
                (first, first),
            )?;
            s.run(job, &streams[0])?;
            s.fan_out(&ptrs.addrs, ptrs.bytes, streams)
        })
    }
}

/// The local buffers' addresses, held borrowed (their guards order the streams' accesses).
struct Locals<'a> {
    addrs: Vec<u64>,
    guards: Vec<chorus_kernels::cuda::cudarc::driver::SyncOnDrop<'a>>,
    bytes: usize,
}

impl Shared {
    /// Checks local buffers and their streams, and waits for the work queued on the streams.
    fn locals<'a, T: Element, B: DevicePtrMut<T>>(
        &self,
        bufs: &'a mut [B],
        streams: &'a [Arc<CudaStream>],
    ) -> Result<Locals<'a>> {
        let len = bufs.first().map(|b| b.len());
        if bufs.len() != streams.len() || len.is_none() {
            return Err(Error::InvalidArgument(format!(
                "a call over local devices needs one stream per buffer and at least one buffer; got {} buffers and {} streams",
                bufs.len(),
                streams.len()
            )));
        }
        self.check_stream(&streams[0])?;
        for (i, (buf, stream)) in bufs.iter().zip(streams).enumerate() {
            if buf.len() != len.unwrap_or(0) {
                return Err(Error::InvalidArgument(format!(
                    "local buffer {i} has {} elements, buffer 0 has {}",
                    buf.len(),
                    len.unwrap_or(0)
                )));
            }
            if **buf.stream().context() != **stream.context() {
                return Err(Error::InvalidArgument(format!(
                    "local buffer {i} is on another device than stream {i}"
                )));
            }
            stream
                .synchronize()
                .map_err(CudaError::driver("waiting for a stream"))?;
        }
        let (addrs, guards) = bufs
            .iter_mut()
            .zip(streams)
            .map(|(buf, stream)| buf.device_ptr_mut(stream))
            .unzip();
        Ok(Locals {
            addrs,
            guards,
            bytes: len.unwrap_or(0) * T::DTYPE.size(),
        })
    }

    /// Copies `bytes` bytes from `src` (on its stream's device) to `dst`, on `stream`.
    fn copy_between(
        &self,
        (dst, dst_on): (u64, &CudaStream),
        (src, src_on): (u64, &CudaStream),
        bytes: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        // SAFETY: both ranges lie in live buffers of `bytes` bytes on their streams'
        // devices, held until the streams are synchronized.
        unsafe {
            result::memcpy_peer_async(
                dst_on.context().cu_ctx(),
                dst,
                src_on.context().cu_ctx(),
                src,
                bytes,
                stream.cu_stream(),
            )
        }
        .map_err(CudaError::driver("copying between devices"))?;
        Ok(())
    }

    /// Copies the first buffer into the others, each on its own stream, and waits for all.
    fn fan_out(&self, addrs: &[u64], bytes: usize, streams: &[Arc<CudaStream>]) -> Result<()> {
        let wait = |stream: &CudaStream| {
            stream
                .synchronize()
                .map_err(CudaError::driver("waiting for a stream"))
        };
        wait(&streams[0])?;
        for (&dst, stream) in addrs[1..].iter().zip(&streams[1..]) {
            self.copy_between((dst, stream), (addrs[0], &streams[0]), bytes, stream)?;
        }
        streams[1..].iter().try_for_each(|s| wait(s))?;
        Ok(())
    }
}
