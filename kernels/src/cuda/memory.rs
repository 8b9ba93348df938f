//! Device memory the collectives own and move data through: allocations made with
//! `cuMemAlloc` (which CUDA IPC can export, unlike stream-ordered pool memory), their IPC
//! handles and their mappings in other processes of the host, page-locked host buffers,
//! and asynchronous copies between them.
//!
//! Everything here works in the CUDA context current on the calling thread: bind the
//! device's context ([`CudaContext::bind_to_thread`](cudarc::driver::CudaContext::bind_to_thread))
//! before making, using or dropping these values.

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUipcMemHandle, CUipcMem_flags};
use cudarc::driver::{result, CudaStream};

use super::error::CudaError;

/// Device memory from `cuMemAlloc`, freed on drop.
#[derive(Debug)]
pub struct DeviceAlloc {
    ptr: u64,
}

impl DeviceAlloc {
    /// Allocates `bytes` bytes (at least one) in the current context.
    pub fn new(bytes: usize) -> Result<DeviceAlloc, CudaError> {
        // SAFETY: a plain allocation in the current context; the pointer is owned here.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }
            .map_err(CudaError::driver("allocating device memory"))?;
        Ok(DeviceAlloc { ptr })
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The handle through which other processes of the host map this allocation.
    pub fn export(&self) -> Result<IpcHandle, CudaError> {
        let mut handle = CUipcMemHandle {
            reserved: [0; IpcHandle::LEN],
        };
        // SAFETY: `ptr` is the start of a live `cuMemAlloc` allocation of the current context.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, self.ptr) }
            .result()
            .map_err(CudaError::driver(
                "exporting device memory (cuIpcGetMemHandle)",
            ))?;
        Ok(IpcHandle(handle.reserved.map(|b| b as u8)))
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `cuMemAlloc` and is freed once; its users synchronize the
        // streams that touched it before dropping it.
        if let Err(err) = unsafe { result::free_sync(self.ptr) } {
            tracing::warn!(%err, "freeing device memory failed");
        }
    }
}

/// A [`DeviceAlloc`]'s IPC handle: bytes to send to another process of the same host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; IpcHandle::LEN]);

impl IpcHandle {
    /// Bytes of a handle.
    pub const LEN: usize = 64;

    /// Maps the allocation into this process (peer access enabled as needed).
    ///
    /// Fails for a handle of this process's own memory, of a freed allocation, or of
    /// another host.
    pub fn open(&self) -> Result<IpcMapping, CudaError> {
        let handle = CUipcMemHandle {
            reserved: self.0.map(|b| b as _),
        };
        let mut ptr = 0;
        // SAFETY: the driver validates the handle; the mapping is closed once, on drop.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                handle,
                CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(CudaError::driver(
            "mapping a peer's device memory (cuIpcOpenMemHandle)",
        ))?;
        Ok(IpcMapping { ptr })
    }
}

/// Another process's allocation mapped into this one; unmapped on drop.
#[derive(Debug)]
pub struct IpcMapping {
    ptr: u64,
}

impl IpcMapping {
    /// The mapping's device address in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `cuIpcOpenMemHandle` and is closed once.
        if let Err(err) = unsafe { sys::cuIpcCloseMemHandle(self.ptr) }.result() {
            tracing::warn!(%err, "unmapping a peer's device memory failed");
        }
    }
}

/// A page-locked host buffer (`cuMemHostAlloc`), which the copy engines read and write
/// asynchronously; freed on drop.
#[derive(Debug)]
pub struct Pinned {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value; access goes through
// `&self`/`&mut self`.
unsafe impl Send for Pinned {}

impl Pinned {
    /// Allocates `len` bytes (at least one), zeroed.
    pub fn new(len: usize) -> Result<Pinned, CudaError> {
        // SAFETY: allocates `len` bytes (at least 1) of page-locked memory.
        let ptr: *mut u8 = unsafe { result::malloc_host(len.max(1), 0) }
            .map_err(CudaError::driver("allocating page-locked host memory"))?
            .cast();
        // SAFETY: `ptr` is a fresh allocation of at least `len` bytes, written once here so
        // that every later read sees initialized bytes.
        unsafe { ptr.write_bytes(0, len) };
        Ok(Pinned { ptr, len })
    }

    /// The first `len` bytes. The caller makes sure no copy into them is in flight.
    ///
    /// Panics if `len` exceeds the buffer.
    pub fn bytes(&self, len: usize) -> &[u8] {
        assert!(
            len <= self.len,
            "pinned buffer of {} bytes, {len} asked",
            self.len
        );
        // SAFETY: `ptr` is valid for `self.len` bytes for the life of `self`, and
        // initialized (zeroed at allocation; only copies and `bytes_mut` write it after).
        unsafe { std::slice::from_raw_parts(self.ptr, len) }
    }

    /// The first `len` bytes, writable. The caller makes sure no copy touches them meanwhile.
    ///
    /// Panics if `len` exceeds the buffer.
    pub fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        assert!(
            len <= self.len,
            "pinned buffer of {} bytes, {len} asked",
            self.len
        );
        // SAFETY: as in `bytes`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len) }
    }

    /// The address of byte `offset`, for asynchronous copies.
    ///
    /// Panics if `offset` is past the end.
    pub fn at(&self, offset: usize) -> *mut u8 {
        assert!(
            offset <= self.len,
            "offset {offset} past {} bytes",
            self.len
        );
        self.ptr.wrapping_add(offset)
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `cuMemHostAlloc`; the streams that copied through it were
        // synchronized before its owner dropped it.
        if let Err(err) = unsafe { result::free_host(self.ptr.cast::<c_void>()) } {
            tracing::warn!(%err, "freeing page-locked host memory failed");
        }
    }
}

/// Enqueues a copy of `bytes` bytes from device `src` to host `dst` on `stream`.
///
/// # Safety
/// `src` must be device memory usable in `stream`'s context and `dst` page-locked host
/// memory, each valid for `bytes` bytes until the copy has run; nothing may touch `dst`
/// meanwhile.
pub unsafe fn copy_to_host(
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
pub unsafe fn copy_to_device(
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

/// Enqueues a copy of `bytes` bytes between device addresses of `stream`'s context
/// (mappings of peers' memory included) on `stream`. Nothing happens when `dst == src`.
///
/// # Safety
/// Both ranges must be device memory usable in `stream`'s context, valid for `bytes`
/// bytes until the copy has run, and not overlapping unless equal.
pub unsafe fn copy_on_device(
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

/// Enqueues the zeroing of `bytes` bytes at device address `dst` on `stream`.
///
/// # Safety
/// `dst` must be device memory usable in `stream`'s context, valid for `bytes` bytes until
/// the kernel has run, and touched by nothing else meanwhile.
pub unsafe fn zero_on_device(dst: u64, bytes: usize, stream: &CudaStream) -> Result<(), CudaError> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { result::memset_d8_async(dst, 0, bytes, stream.cu_stream()) }
        .map_err(CudaError::driver("zeroing device memory"))
}

/// Enqueues a copy of `bytes` bytes from `src` in the context of `src_on` to `dst` in the
/// context of `dst_on` (two devices, or one), on `stream`.
///
/// # Safety
/// Each range must be device memory of its stream's context, valid for `bytes` bytes until
/// the copy has run, and not overlapping the other.
pub unsafe fn copy_between(
    (dst, dst_on): (u64, &CudaStream),
    (src, src_on): (u64, &CudaStream),
    bytes: usize,
    stream: &CudaStream,
) -> Result<(), CudaError> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
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
    .map_err(CudaError::driver("copying between devices"))
}
