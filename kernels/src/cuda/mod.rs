//! GPU reduction kernels (cargo feature `cuda`).
//!
//! [`Device::reduce`], [`Device::reduce_into`] and [`Device::finish_avg`] are the GPU forms
//! of [`reduce`](crate::reduce), [`reduce_into`](crate::reduce_into) and
//! [`finish_avg`](crate::finish_avg), for every [`DType`](crate::DType) and
//! [`ReduceOp`](crate::ReduceOp) that applies to it, with the same semantics (see the [crate
//! documentation](crate)): integers wrap, float `Min`/`Max` propagate NaN and order
//! `-0.0 < +0.0`, `f16`/`bf16` are computed in `f32` and rounded once, `Avg` reduces as
//! `Sum`, `finish_avg` divides (integers truncating toward zero), and the bitwise operators
//! exist for integer types only (on floats they fail as on the host). Results are bit for
//! bit those of the host kernels, NaN payloads aside. Buffers are raw bytes at any offset:
//! aligned ones are processed 16 bytes at a time, others element by element.
//!
//! # What is needed at run time
//!
//! Nothing CUDA is needed to build: cudarc opens the libraries when a device is opened.
//! Running needs an NVIDIA driver (`libcuda.so.1`; the CUDA 13.0 driver API, so driver 580
//! or newer) and NVRTC (`libnvrtc.so.13`, or `.so.12`) on the loader path or in the lib
//! folder of `$CUDA_HOME`, `$CUDA_PATH` or `/usr/local/cuda`. A missing piece is reported
//! as [`CudaError::NoCuda`], never a panic.
//!
//! # Compilation and caching
//!
//! The CUDA C source is generated for every dtype and operator and compiled by NVRTC for
//! the device's compute capability (`--gpu-architecture=sm_XY`, a CUBIN; PTX for the
//! nearest older architecture if NVRTC does not know the device) the first time a kernel
//! runs on a device in a process. The loaded kernels are kept per device for the life of
//! the process, and the compiled image is stored on disk, keyed by a hash of the source,
//! the architecture, the NVRTC version and the options, under `$CHORUS_CUDA_CACHE`, else
//! `$XDG_CACHE_HOME/chorus`, else `~/.cache/chorus`: later processes load it without
//! compiling.
//!
//! # Example
//!
//! ```no_run
//! use chorus_kernels::cuda::Device;
//! use chorus_kernels::{DType, ReduceOp};
//!
//! let device = Device::open(0)?;
//! let stream = device.new_stream()?;
//! let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
//! let mut acc = device.upload(&stream, &bytes(&[1.0, 5.0, -2.0]))?;
//! let other = device.upload(&stream, &bytes(&[3.0, 4.0, -1.0]))?;
//! device.reduce(ReduceOp::Max, DType::F32, &mut acc, &other, &stream)?;
//! assert_eq!(device.download(&stream, &acc)?, bytes(&[3.0, 5.0, -1.0]));
//! # Ok::<(), chorus_kernels::cuda::CudaError>(())
//! ```

mod cache;
mod compile;
mod device;
mod error;
mod load;
pub mod memory;
pub mod order;
mod source;
#[cfg(test)]
mod tests;

pub use cudarc;
pub use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice,
};
pub use device::Device;
pub use error::CudaError;
