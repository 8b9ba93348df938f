//! Calls over one buffer per local device: a process that drives several GPUs (seed
//! 003's DataParallel, NCCL's `ncclCommInitAll`), or several buffers of one GPU.
//!
//! The buffers are reduced into the first one on its device (peer copies from the
//! others, then the reduction kernel), that buffer goes through the communicator's call
//! across ranks, and the result is copied back to the other buffers.

use std::sync::Arc;

use chorus_kernels::cuda::memory::copy_between;
use chorus_kernels::cuda::{CudaError, CudaStream, DevicePtr, DevicePtrMut};
use chorus_kernels::{DType, Element, ReduceOp};

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
        self.now(|s| {
            let locals = s.locals(bufs, streams)?;
            s.local(
                DeviceCall::AllReduce(op),
                T::DTYPE,
                &locals.addrs,
                locals.bytes,
                streams,
            )
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
            let locals = s.locals(bufs, streams)?;
            let call = DeviceCall::Broadcast { root };
            s.local(call, T::DTYPE, &locals.addrs, locals.bytes, streams)
        })
    }

    /// [`all_reduce_local`](Self::all_reduce_local) (`call` an all-reduce) or
    /// [`broadcast_local`](Self::broadcast_local) (a broadcast) on raw device pointers, in
    /// place: `bufs[i]` holds `count` elements of `dtype` on `streams[i]`'s device.
    ///
    /// # Safety
    /// Each pointer must address `count` elements of device memory on its stream's device,
    /// allocated until the call returns, not overlapping the others; nothing else may use
    /// them during the call.
    pub unsafe fn call_local_raw(
        &self,
        call: DeviceCall,
        dtype: DType,
        bufs: &[u64],
        count: usize,
        streams: &[Arc<CudaStream>],
    ) -> Result<()> {
        if bufs.len() != streams.len() || bufs.is_empty() {
            return Err(mismatch(bufs.len(), streams.len()));
        }
        let bytes = count.checked_mul(dtype.size()).ok_or_else(|| {
            Error::InvalidArgument(format!("{}: {count} elements is too many", call.name()))
        })?;
        self.now(|s| {
            s.check_stream(&streams[0])?;
            streams.iter().try_for_each(|stream| wait(stream))?;
            s.local(call, dtype, bufs, bytes, streams)
        })
    }
}

fn wait(stream: &CudaStream) -> Result<()> {
    stream
        .synchronize()
        .map_err(CudaError::driver("waiting for a stream"))?;
    Ok(())
}

fn mismatch(bufs: usize, streams: usize) -> Error {
    Error::InvalidArgument(format!(
        "a call over local devices needs one stream per buffer and at least one buffer; got {bufs} buffers and {streams} streams"
    ))
}

/// The local buffers' addresses, held borrowed (their guards order the streams' accesses).
struct Locals<'a> {
    addrs: Vec<u64>,
    /// Held for their drop, which records the buffers' use on their streams.
    _guards: Vec<chorus_kernels::cuda::cudarc::driver::SyncOnDrop<'a>>,
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
            return Err(mismatch(bufs.len(), streams.len()));
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
            wait(stream)?;
        }
        let (addrs, guards) = bufs
            .iter_mut()
            .zip(streams)
            .map(|(buf, stream)| buf.device_ptr_mut(stream))
            .unzip();
        Ok(Locals {
            addrs,
            _guards: guards,
            bytes: len.unwrap_or(0) * T::DTYPE.size(),
        })
    }

    /// Runs `call` (an all-reduce or a broadcast) over the local buffers at `addrs`, whose
    /// streams have been waited for: reduced into the first (all-reduce), across ranks on
    /// the first, then copied into the others.
    fn local(
        &self,
        call: DeviceCall,
        dtype: DType,
        addrs: &[u64],
        bytes: usize,
        streams: &[Arc<CudaStream>],
    ) -> Result<()> {
        let (first, stream) = (addrs[0], &streams[0]);
        let count = bytes / dtype.size();
        let across = match call {
            DeviceCall::AllReduce(op) => {
                self.reduce_locals(op, dtype, addrs, bytes, streams)?;
                DeviceCall::AllReduce(if op == ReduceOp::Avg { ReduceOp::Sum } else { op })
            }
            DeviceCall::Broadcast { .. } => call,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "{} takes one buffer per rank; calls over local devices are all_reduce and broadcast",
                    call.name()
                )))
            }
        };
        self.run(self.job(across, dtype, count, (first, first))?, stream)?;
        if call == DeviceCall::AllReduce(ReduceOp::Avg) {
            let n = self.comm.world_size() * addrs.len();
            // SAFETY: `first` holds `bytes` bytes on this device, live for the call.
            unsafe { self.device.finish_avg_raw(dtype, first, bytes, n, stream)? };
        }
        self.fan_out(addrs, bytes, streams)
    }

    /// Reduces every local buffer into the first with `op`, on the first's stream.
    fn reduce_locals(
        &self,
        op: ReduceOp,
        dtype: DType,
        addrs: &[u64],
        bytes: usize,
        streams: &[Arc<CudaStream>],
    ) -> Result<()> {
        let (first, stream) = (addrs[0], &streams[0]);
        if addrs.len() < 2 {
            return Ok(());
        }
        // SAFETY: a fresh allocation of `bytes` bytes, freed in stream order after the kernels.
        let tmp = unsafe { stream.alloc::<u8>(bytes.max(1)) }
            .map_err(CudaError::driver("allocating device memory"))?;
        let (at, _tmp) = tmp.device_ptr(stream);
        for (&other, other_stream) in addrs[1..].iter().zip(&streams[1..]) {
            // SAFETY: `other` holds `bytes` bytes on its stream's device, `first` and `at`
            // on this one, all live until the streams are synchronized.
            unsafe {
                copy_between((at, stream), (other, other_stream), bytes, stream)?;
                self.device
                    .reduce_into_raw(op, dtype, [first, first, at], bytes, stream)?
            };
        }
        Ok(())
    }

    /// Copies the first buffer into the others, each on its own stream, and waits for all.
    fn fan_out(&self, addrs: &[u64], bytes: usize, streams: &[Arc<CudaStream>]) -> Result<()> {
        wait(&streams[0])?;
        for (&dst, stream) in addrs[1..].iter().zip(&streams[1..]) {
            // SAFETY: every buffer holds `bytes` bytes on its stream's device, live until
            // the streams are synchronized below.
            unsafe { copy_between((dst, stream), (addrs[0], &streams[0]), bytes, stream)? };
        }
        streams[1..].iter().try_for_each(|s| wait(s))?;
        Ok(())
    }
}
