//! What the CUDA driver says of a buffer and of the calling thread, where there is a driver:
//! opened the first time a call asks, so loading this library does nothing.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::OnceLock;

use libloading::{Library, Symbol};

use crate::comm::{Failure, Outcome};

/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`.
const MEMORY_TYPE: c_int = 2;
/// `CU_MEMORYTYPE_DEVICE`.
const DEVICE: c_uint = 2;

type Init = unsafe extern "C" fn(c_uint) -> c_int;
type PointerAttribute = unsafe extern "C" fn(*mut c_void, c_int, u64) -> c_int;
type CtxDevice = unsafe extern "C" fn(*mut c_int) -> c_int;
type IsCapturing = unsafe extern "C" fn(*mut c_void, *mut c_uint) -> c_int;

/// The driver, initialised, or `None` where there is none.
fn driver() -> Option<&'static Library> {
    static DRIVER: OnceLock<Option<Library>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            // SAFETY: libcuda's initialisers only set up the driver.
            let lib = unsafe { Library::new("libcuda.so.1") }.ok()?;
            // SAFETY: cuInit's signature; it may be called any number of times.
            let init: Symbol<Init> = unsafe { lib.get(b"cuInit\0") }.ok()?;
            // SAFETY: as above.
            (unsafe { init(0) } == 0).then_some(())?;
            Some(lib)
        })
        .as_ref()
}

/// Fails, naming `name`, if `ptr` is CUDA device memory, which this library does not move yet.
pub fn host(ptr: *const c_void, name: &str) -> Outcome {
    let Some(lib) = driver() else { return Ok(()) };
    // SAFETY: cuPointerGetAttribute's signature.
    let Ok(attribute) = (unsafe { lib.get::<PointerAttribute>(b"cuPointerGetAttribute\0") }) else {
        return Ok(());
    };
    let mut kind: c_uint = 0;
    // SAFETY: the attribute is a CUmemorytype (an unsigned int) written into `kind`; any
    // address may be asked about (pageable host memory answers with an error).
    let found = unsafe { attribute((&mut kind as *mut c_uint).cast(), MEMORY_TYPE, ptr as u64) };
    match found == 0 && kind == DEVICE {
        true => Err(Failure::usage(format!(
            "{name} {ptr:p} is CUDA device memory, which this library does not move yet: \
             host memory only (see docs/nccl.md)"
        ))),
        false => Ok(()),
    }
}

/// The device of the calling thread's current CUDA context, if there is one.
pub fn current_device() -> Option<c_int> {
    let lib = driver()?;
    // SAFETY: cuCtxGetDevice's signature.
    let get: Symbol<CtxDevice> = unsafe { lib.get(b"cuCtxGetDevice\0") }.ok()?;
    let mut device = -1;
    // SAFETY: writes one int.
    (unsafe { get(&mut device) } == 0).then_some(device)
}

/// Fails if `stream` is being captured into a CUDA graph: Chorus's calls are driven by the
/// host, so a graph could not replay them.
pub fn not_capturing(stream: *mut c_void) -> Outcome {
    let Some(lib) = driver() else { return Ok(()) };
    if stream.is_null() {
        return Ok(());
    }
    // SAFETY: cuStreamIsCapturing's signature.
    let Ok(query) = (unsafe { lib.get::<IsCapturing>(b"cuStreamIsCapturing\0") }) else {
        return Ok(());
    };
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
