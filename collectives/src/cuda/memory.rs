//! Memory the device paths own: device allocations made with `cuMemAlloc` (IPC can export
//! them, unlike stream-ordered pool memory) and page-locked host buffers.

use std::ffi::c_void;

use chorus_kernels::cuda::cudarc::driver::{result, sys};
use chorus_kernels::cuda::{CudaError, CudaStream};

/// Device memory from `cuMemAlloc`, freed on drop. The device's context must be current
/// on the thread that makes and drops it.
#[derive(Debug)]
pub(super) struct DeviceAlloc {
    pub ptr: u64,
}

impl DeviceAlloc {
    pub fn new(bytes: usize) -> Result<DeviceAlloc, CudaError> {
        // SAFETY: a plain allocation in the current context; the pointer is owned here.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }
            .map_err(CudaError::driver("allocating device memory"))?;
        Ok(DeviceAlloc { ptr })
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `cuMemAlloc` and is freed once; callers synchronize the
        // streams that used it before dropping.
        if let Err(err) = unsafe { result::free_sync(self.ptr) } {
            tracing::warn!(%err, "freeing device memory failed");
        }
    }
}

/// A page-locked host buffer (`cuMemHostAlloc`), which the copy engines read and write
/// asynchronously; freed on drop.
#[derive(Debug)]
pub(super) struct Pinned {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value; access goes through
// `&self`/`&mut self`.
unsafe impl Send for Pinned {}

impl Pinned {
    pub fn new(len: usize) -> Result<Pinned, CudaError> {
        // SAFETY: allocates `len` bytes (at least 1) of page-locked memory in the current context.
        let ptr = unsafe { result::malloc_host(len.max(1), 0) }
            .map_err(CudaError::driver("allocating page-locked host memory"))?;
        Ok(Pinned {
            ptr: ptr.cast(),
            len,
        })
    }

    /// The first `len` bytes. Callers make sure no copy into or out of them is in flight.
    pub fn bytes(&self, len: usize) -> &[u8] {
        assert!(
            len <= self.len,
            "pinned buffer of {} bytes, {len} asked",
            self.len
        );
        // SAFETY: `ptr` is valid for `self.len` bytes for the life of `self`; no copy
        // engine writes them while this borrow lives (the caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr, len) }
    }

    /// The first `len` bytes, writable.
    pub fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        assert!(
            len <= self.len,
            "pinned buffer of {} bytes, {len} asked",
            self.len
        );
        // SAFETY: as in `bytes`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len) }
    }

    /// The address at byte `offset`, for asynchronous copies.
    pub fn at(&self, offset: usize) -> *mut u8 {
        assert!(offset <= self.len);
        self.ptr.wrapping_add(offset)
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `cuMemHostAlloc`; the streams that copied through it were
        // synchronized before the owner dropped it.
        if let Err(err) = unsafe { result::free_host(self.ptr.cast::<c_void>()) } {
            tracing::warn!(%err, "freeing page-locked host memory failed");
        }
    }
}

/// Enqueues a copy of `bytes` bytes from device `src` to host `dst` on `stream`.
///
/// # Safety
/// `src` must be device memory of `stream`'s context and `dst` page-locked host memory,
/// each valid for `bytes` bytes until the copy has run, and nothing may touch `dst` meanwhile.
pub(super) unsafe fn copy_to_host(
    dst: *mut u8,
    src: u64,
    bytes: usize,
    stream: &CudaStream,
) -> Result<(), CudaError> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, stream.cu_stream()) }
        .result()
        .map_err(CudaError::driver("copying from the device to the host"))
}

/// Enqueues a copy of `bytes` bytes from host `src` to device `dst` on `stream`.
///
/// # Safety
/// As [`copy_to_host`], the directions swapped: nothing may write `src` until the copy has run.
pub(super) unsafe fn copy_to_device(
    dst: u64,
    src: *const u8,
    bytes: usize,
    stream: &CudaStream,
) -> Result<(), CudaError> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, stream.cu_stream()) }
        .result()
        .map_err(CudaError::driver("copying from the host to the device"))
}

/// Enqueues a copy of `bytes` bytes between device pointers on `stream`.
///
/// # Safety
/// Both pointers must be device memory usable in `stream`'s context (peers' memory mapped
/// through IPC included), valid for `bytes` bytes until the copy has run, not overlapping.
pub(super) unsafe fn copy_on_device(
    dst: u64,
    src: u64,
    bytes: usize,
    stream: &CudaStream,
) -> Result<(), CudaError> {
    if bytes == 0 || dst == src {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }
        .map_err(CudaError::driver("copying on the device"))
}
