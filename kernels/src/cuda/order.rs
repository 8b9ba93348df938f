//! The few raw CUDA operations that order streams after work driven from the host: a
//! counter in page-locked host memory that the device can read, a stream wait on it, and
//! the graph-capture check. Every `unsafe` call of stream ordering lives here.

use std::ffi::c_void;
use std::sync::atomic::AtomicU64;

use cudarc::driver::sys::{
    self, CUdevice_attribute, CUstreamCaptureStatus, CUstreamWaitValue_flags,
};
use cudarc::driver::{CudaContext, CudaStream, DriverError};

use super::CudaError;

/// A 64-bit counter in page-locked host memory mapped into the device's address space: the
/// host advances it, and streams wait on it with `cuStreamWaitValue64`.
#[derive(Debug)]
pub struct MappedCounter {
    host: *mut AtomicU64,
    device: u64,
}

// SAFETY: the counter is an atomic in memory owned by this value until drop.
unsafe impl Send for MappedCounter {}
// SAFETY: as above; every access is atomic.
unsafe impl Sync for MappedCounter {}

impl MappedCounter {
    /// Allocates a counter at zero, mapped into every context (the current one binds it).
    pub fn new(ctx: &CudaContext) -> Result<MappedCounter, CudaError> {
        ctx.bind_to_thread()
            .map_err(CudaError::driver("binding the device's context"))?;
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: allocates 8 bytes of page-locked host memory into `host`.
        unsafe { sys::cuMemHostAlloc(&mut host, size_of::<AtomicU64>(), flags) }
            .result()
            .map_err(CudaError::driver("allocating the completion counter"))?;
        let host = host.cast::<AtomicU64>();
        // SAFETY: `host` is a fresh allocation of 8 bytes, aligned (page-locked allocations
        // are page aligned), written once before any other access.
        unsafe { host.write(AtomicU64::new(0)) };
        // Owns the allocation from here: a failure below frees it.
        let mut counter = MappedCounter { host, device: 0 };
        // SAFETY: `host` came from `cuMemHostAlloc` with `CU_MEMHOSTALLOC_DEVICEMAP`.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut counter.device, host.cast(), 0) }
            .result()
            .map_err(CudaError::driver("mapping the completion counter"))?;
        Ok(counter)
    }

    /// The counter, as the host reads and advances it.
    pub fn value(&self) -> &AtomicU64 {
        // SAFETY: `host` is valid and initialized for the life of `self`.
        unsafe { &*self.host }
    }

    /// Makes `stream` wait until the counter is at least `value`, without blocking the host.
    /// The device compares cyclically (`(int64_t)(counter - value) >= 0`): a counter more
    /// than 2^63 past `value` does not release the wait.
    ///
    /// Fails where the driver refuses stream memory operations (see
    /// [`stream_waits_supported`]).
    ///
    /// # Safety
    /// The device reads the counter until the wait passes: before `self` is dropped, the
    /// counter must release the wait and `stream` must have passed it (synchronized).
    pub unsafe fn wait_at_least(&self, stream: &CudaStream, value: u64) -> Result<(), CudaError> {
        stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("binding the device's context"))?;
        let geq = CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        // SAFETY: `device` maps this counter, which lives as long as `self`, and the caller
        // keeps `self` until the stream has passed the wait (the function's contract).
        unsafe { sys::cuStreamWaitValue64_v2(stream.cu_stream(), self.device, value, geq) }
            .result()
            .map_err(CudaError::driver(
                "making a stream wait on the completion counter",
            ))
    }
}

impl Drop for MappedCounter {
    fn drop(&mut self) {
        // SAFETY: `host` came from `cuMemHostAlloc`, and no stream waits on it any more
        // (`wait_at_least`'s contract).
        if let Err(err) = unsafe { sys::cuMemFreeHost(self.host.cast()) }.result() {
            tracing::warn!(%err, "freeing the completion counter failed");
        }
    }
}

/// Whether the device lets streams wait on 64-bit values in memory
/// (`CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`).
pub fn stream_waits_supported(ctx: &CudaContext) -> bool {
    let attribute = CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS;
    matches!(ctx.attribute(attribute), Ok(1))
}

/// Whether `stream` is being captured into a CUDA graph.
pub fn is_capturing(stream: &CudaStream) -> Result<bool, CudaError> {
    let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: `stream` is a live stream; the call writes `status`.
    let result: Result<(), DriverError> =
        unsafe { sys::cuStreamIsCapturing(stream.cu_stream(), &mut status) }.result();
    result.map_err(CudaError::driver(
        "asking whether a stream is being captured",
    ))?;
    Ok(status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}
