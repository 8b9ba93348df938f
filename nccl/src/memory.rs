//! What the CUDA driver says of a buffer and of the calling thread, and the memory
//! `ncclMemAlloc` hands out: the driver is opened the first time a call asks (so loading
//! this library does nothing), and its entry points are looked up once.

use std::alloc::Layout;
use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Mutex, OnceLock};

use libloading::Library;

use crate::abi::NcclResult;
use crate::comm::{Failure, Outcome};
use crate::lock;

/// `CU_POINTER_ATTRIBUTE_CONTEXT`.
const CONTEXT: c_int = 1;
/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`.
const MEMORY_TYPE: c_int = 2;
/// `CU_MEMORYTYPE_DEVICE`.
const DEVICE: c_uint = 2;
/// The alignment of host memory `ncclMemAlloc` hands out where there is no device: a page,
/// as the driver's allocations are at least.
const HOST_ALIGN: usize = 4096;

/// Why a call on device memory fails where calls cannot be ordered on streams.
#[cfg(feature = "cuda")]
pub const NO_DEVICE_CALLS: &str = "a buffer is CUDA device memory, but this communicator \
    orders no calls on streams: some rank had no current CUDA device when it was made";
/// Why a call on device memory fails in a library built without the device path.
#[cfg(not(feature = "cuda"))]
pub const NO_DEVICE_CALLS: &str = "a buffer is CUDA device memory, which this build of the \
    library does not move: build it with `--features cuda` (see docs/nccl.md)";

type Init = unsafe extern "C" fn(c_uint) -> c_int;
type PointerAttribute = unsafe extern "C" fn(*mut c_void, c_int, u64) -> c_int;
type CtxDevice = unsafe extern "C" fn(*mut c_int) -> c_int;
type IsCapturing = unsafe extern "C" fn(*mut c_void, *mut c_uint) -> c_int;
type MemAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
type MemFree = unsafe extern "C" fn(u64) -> c_int;
type CtxPush = unsafe extern "C" fn(*mut c_void) -> c_int;
type CtxPop = unsafe extern "C" fn(*mut *mut c_void) -> c_int;
type CopyToHost = unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int;
type CtxGet = unsafe extern "C" fn(*mut *mut c_void) -> c_int;
type CtxSet = unsafe extern "C" fn(*mut c_void) -> c_int;

/// The driver's entry points this library asks, resolved once.
struct Driver {
    pointer_attribute: PointerAttribute,
    ctx_device: CtxDevice,
    is_capturing: Option<IsCapturing>,
    mem_alloc: MemAlloc,
    mem_free: MemFree,
    ctx_push: CtxPush,
    ctx_pop: CtxPop,
    copy_to_host: CopyToHost,
    ctx_get: CtxGet,
    ctx_set: CtxSet,
    /// Keeps the entry points loaded.
    _lib: Library,
}

/// The driver, opened once, and initialised, or `None` where there is none.
static DRIVER: OnceLock<Option<Driver>> = OnceLock::new();

/// The driver, initialised, or `None` where there is none.
fn driver() -> Option<&'static Driver> {
    DRIVER.get_or_init(open).as_ref()
}

fn open() -> Option<Driver> {
    // SAFETY: libcuda's initialisers only set up the driver.
    let lib = unsafe { Library::new("libcuda.so.1") }.ok()?;
    // SAFETY: each symbol is looked up with the driver API's signature for that name; the
    // pointers are kept beside the library, which stays loaded.
    unsafe {
        let init = *lib.get::<Init>(b"cuInit\0").ok()?;
        (init(0) == 0).then_some(())?;
        Some(Driver {
            pointer_attribute: *lib.get(b"cuPointerGetAttribute\0").ok()?,
            ctx_device: *lib.get(b"cuCtxGetDevice\0").ok()?,
            is_capturing: lib.get(b"cuStreamIsCapturing\0").ok().map(|s| *s),
            mem_alloc: *lib.get(b"cuMemAlloc_v2\0").ok()?,
            mem_free: *lib.get(b"cuMemFree_v2\0").ok()?,
            ctx_push: *lib.get(b"cuCtxPushCurrent_v2\0").ok()?,
            ctx_pop: *lib.get(b"cuCtxPopCurrent_v2\0").ok()?,
            copy_to_host: *lib.get(b"cuMemcpyDtoH_v2\0").ok()?,
            ctx_get: *lib.get(b"cuCtxGetCurrent\0").ok()?,
            ctx_set: *lib.get(b"cuCtxSetCurrent\0").ok()?,
            _lib: lib,
        })
    }
}

/// The CUDA context current on the calling thread when it was made, current again when it
/// is dropped: a call that binds its communicator's device to the caller's thread leaves
/// the caller's current device as it found it, as NCCL does.
pub struct KeepContext(Option<(&'static Driver, *mut c_void)>);

impl KeepContext {
    /// Notes the calling thread's current context, where this library has opened the
    /// driver already (a call that opens it binds no context on the calling thread, and one
    /// that never needs it, such as `ncclGetVersion`, leaves CUDA untouched).
    pub fn new() -> KeepContext {
        KeepContext(DRIVER.get().and_then(Option::as_ref).and_then(|driver| {
            let mut current = std::ptr::null_mut();
            // SAFETY: cuCtxGetCurrent writes a CUcontext (a pointer, perhaps null).
            let asked = unsafe { (driver.ctx_get)(&mut current) };
            (asked == 0).then_some((driver, current))
        }))
    }
}

impl Drop for KeepContext {
    fn drop(&mut self) {
        let Some((driver, kept)) = self.0 else { return };
        let mut current = std::ptr::null_mut();
        // SAFETY: as in `new`; setting back a context that was current on this thread (or
        // none) changes only this thread's binding.
        unsafe {
            if (driver.ctx_get)(&mut current) == 0 && current != kept {
                (driver.ctx_set)(kept);
            }
        }
    }
}

/// Whether there is a CUDA driver, initialised.
#[cfg(feature = "cuda")]
pub fn has_driver() -> bool {
    driver().is_some()
}

/// Whether `ptr` is CUDA device memory (never, where there is no driver).
pub fn is_device(ptr: *const c_void) -> bool {
    let Some(driver) = driver() else { return false };
    let mut kind: c_uint = 0;
    // SAFETY: the attribute is a CUmemorytype (an unsigned int) written into `kind`; any
    // address may be asked about (pageable host memory answers with an error).
    let found = unsafe {
        (driver.pointer_attribute)((&mut kind as *mut c_uint).cast(), MEMORY_TYPE, ptr as u64)
    };
    found == 0 && kind == DEVICE
}

/// Copies `to.len()` bytes of device memory at `from` into `to`, waiting for the copy, in
/// the memory's own context (whatever context the calling thread has).
pub fn read_device(from: usize, to: &mut [u8]) -> Result<(), String> {
    let driver = driver().ok_or("no CUDA driver")?;
    let mut context: *mut c_void = std::ptr::null_mut();
    // SAFETY: the attribute is a CUcontext (a pointer) written into `context`.
    let asked = unsafe {
        (driver.pointer_attribute)(
            (&mut context as *mut *mut c_void).cast(),
            CONTEXT,
            from as u64,
        )
    };
    if asked != 0 || context.is_null() {
        return Err(format!(
            "{from:#x} is not device memory (CUDA error {asked})"
        ));
    }
    // SAFETY: the context that owns the memory, current on this thread for the copy only; the
    // copy writes `to.len()` bytes into `to`.
    unsafe {
        match (driver.ctx_push)(context) {
            0 => {}
            code => return Err(format!("cuCtxPushCurrent failed with CUDA error {code}")),
        }
        let copied = (driver.copy_to_host)(to.as_mut_ptr().cast(), from as u64, to.len());
        let mut popped = std::ptr::null_mut();
        (driver.ctx_pop)(&mut popped);
        match copied {
            0 => Ok(()),
            code => Err(format!(
                "cuMemcpyDtoH of {} bytes failed with CUDA error {code}",
                to.len()
            )),
        }
    }
}

/// The device of the calling thread's current CUDA context, if there is one.
pub fn current_device() -> Option<c_int> {
    let driver = driver()?;
    let mut device = -1;
    // SAFETY: writes one int.
    (unsafe { (driver.ctx_device)(&mut device) } == 0).then_some(device)
}

/// Fails if `stream` is being captured into a CUDA graph: Chorus's calls are driven by the
/// host, so a graph could not replay them.
pub fn not_capturing(stream: *mut c_void) -> Outcome {
    let Some(query) = driver().and_then(|d| d.is_capturing) else {
        return Ok(());
    };
    if stream.is_null() {
        return Ok(());
    }
    let mut status: c_uint = 0;
    // SAFETY: `stream` is the caller's CUDA stream; the status is one unsigned int.
    let asked = unsafe { query(stream, &mut status) };
    match asked == 0 && status != 0 {
        true => Err(Failure::usage(
            "called while its stream is captured into a CUDA graph: Chorus's calls are driven \
             by the host, and a graph cannot replay them",
        )),
        false => Ok(()),
    }
}

/// Host allocations `ncclMemAlloc` made (where there was no device), by address.
fn host_blocks() -> &'static Mutex<HashMap<usize, Layout>> {
    static BLOCKS: OnceLock<Mutex<HashMap<usize, Layout>>> = OnceLock::new();
    BLOCKS.get_or_init(Mutex::default)
}

/// `bytes` of memory for buffers of collectives (`ncclMemAlloc`): device memory on the
/// calling thread's current device, or, where there is no driver or no current device,
/// page-aligned host memory (which this library's calls take as host buffers). Null for
/// zero bytes.
pub fn alloc(bytes: usize) -> Outcome<*mut c_void> {
    if bytes == 0 {
        return Ok(std::ptr::null_mut());
    }
    if let Some(driver) = driver().filter(|_| current_device().is_some()) {
        let mut at = 0u64;
        // SAFETY: writes one device address.
        let made = unsafe { (driver.mem_alloc)(&mut at, bytes) };
        return match made {
            0 => Ok(at as *mut c_void),
            code => Err(Failure::new(
                NcclResult::UnhandledCudaError,
                format!("cuMemAlloc of {bytes} bytes failed with CUDA error {code}"),
            )),
        };
    }
    let layout = Layout::from_size_align(bytes, HOST_ALIGN)
        .map_err(|_| Failure::argument(format!("size {bytes} is too large")))?;
    // SAFETY: the layout's size is not zero.
    let at = unsafe { std::alloc::alloc_zeroed(layout) };
    if at.is_null() {
        return Err(Failure::new(
            NcclResult::SystemError,
            format!("no host memory for {bytes} bytes"),
        ));
    }
    lock(host_blocks()).insert(at as usize, layout);
    Ok(at.cast())
}

/// Frees what [`alloc`] returned (`ncclMemFree`); nothing for null.
pub fn free(ptr: *mut c_void) -> Outcome {
    if ptr.is_null() {
        return Ok(());
    }
    if let Some(layout) = lock(host_blocks()).remove(&(ptr as usize)) {
        // SAFETY: allocated by `alloc` with this layout, and freed once (removed above).
        unsafe { std::alloc::dealloc(ptr.cast(), layout) };
        return Ok(());
    }
    let Some(driver) = driver().filter(|_| is_device(ptr)) else {
        return Err(Failure::argument(format!(
            "{ptr:p} is not memory ncclMemAlloc returned"
        )));
    };
    // SAFETY: device memory, as the driver says; freeing memory not from cuMemAlloc fails
    // with an error code rather than harm.
    match unsafe { (driver.mem_free)(ptr as u64) } {
        0 => Ok(()),
        code => Err(Failure::new(
            NcclResult::UnhandledCudaError,
            format!("cuMemFree of {ptr:p} failed with CUDA error {code}"),
        )),
    }
}
