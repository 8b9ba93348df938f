//! The error type of the CUDA kernels.

use cudarc::driver::DriverError;

use crate::KernelError;

/// Why a CUDA device could not be used or a GPU kernel call was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The CUDA driver or NVRTC library is missing or unusable (no NVIDIA driver, no GPU,
    /// no `libnvrtc`); the message says which and how it was looked for.
    #[error("CUDA is not available: {0}")]
    NoCuda(String),
    /// The requested device ordinal does not exist.
    #[error("there is no CUDA device {ordinal} ({count} found)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call failed while {during}: {source}")]
    Driver {
        /// What was being done.
        during: &'static str,
        /// The driver's error code.
        source: DriverError,
    },
    /// An NVRTC call other than the compilation itself failed.
    #[error("NVRTC call failed while {during}: {code}")]
    Nvrtc {
        /// What was being done.
        during: &'static str,
        /// NVRTC's error code.
        code: String,
    },
    /// NVRTC failed to compile the kernels (a bug in the generated source, or an NVRTC
    /// that does not know the target).
    #[error("NVRTC failed to compile the kernels for {target}: {message}\n{log}")]
    Compile {
        /// The `--gpu-architecture` value.
        target: String,
        /// NVRTC's error code.
        message: String,
        /// The compiler log.
        log: String,
    },
    /// The device's compute capability is older than anything this NVRTC can target.
    #[error(
        "NVRTC {nvrtc} cannot compile for compute capability {major}.{minor} \
         (it supports sm_{supported})"
    )]
    UnsupportedArch {
        /// Compute capability major version of the device.
        major: i32,
        /// Compute capability minor version of the device.
        minor: i32,
        /// NVRTC version, "major.minor".
        nvrtc: String,
        /// The architectures NVRTC supports, comma separated.
        supported: String,
    },
    /// A buffer or stream passed to a [`Device`](super::Device) method belongs to another
    /// device or CUDA context.
    #[error("{what} belongs to another CUDA device or context than device {ordinal}")]
    WrongDevice {
        /// Which argument.
        what: &'static str,
        /// The ordinal of the device the call was made on.
        ordinal: usize,
    },
    /// The arguments were rejected by the same checks as the host kernels' (length mismatch,
    /// length not a whole number of elements, zero count for `finish_avg`).
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

impl CudaError {
    /// Wraps a driver error with what was being done.
    pub fn driver(during: &'static str) -> impl FnOnce(DriverError) -> CudaError {
        move |source| CudaError::Driver { during, source }
    }
}
