//! Compiling the kernel source with NVRTC, through the on-disk cache.

use std::ffi::{c_char, c_int, CStr, CString};
use std::fmt;
use std::path::Path;
use std::time::Instant;

use cudarc::nvrtc::{result, sys};

use super::error::CudaError;
use super::{cache, load, source};

/// What NVRTC is asked to produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    /// A CUBIN for exactly this architecture (`sm_XY`, XY = 10 * major + minor): loads
    /// without JIT, and runs on drivers older than the NVRTC that built it.
    Cubin(i32),
    /// PTX for this virtual architecture (`compute_XY`), JIT-compiled by the driver: used
    /// when the device is newer than anything this NVRTC knows.
    Ptx(i32),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Cubin(arch) => write!(f, "sm_{arch}"),
            Target::Ptx(arch) => write!(f, "compute_{arch}"),
        }
    }
}

/// Picks the target for a device of compute capability `(major, minor)` given the
/// architectures NVRTC supports (as reported by `nvrtcGetSupportedArchs`).
pub(crate) fn target_for(
    (major, minor): (i32, i32),
    supported: &[i32],
    nvrtc: (i32, i32),
) -> Result<Target, CudaError> {
    let arch = major * 10 + minor;
    if supported.contains(&arch) {
        return Ok(Target::Cubin(arch));
    }
    match supported.iter().copied().filter(|&a| a < arch).max() {
        // A device this NVRTC does not know (newer than it, or a variant it skips): PTX for
        // the closest older architecture, which the driver compiles for the device.
        Some(older) => Ok(Target::Ptx(older)),
        None => Err(CudaError::UnsupportedArch {
            major,
            minor,
            nvrtc: format!("{}.{}", nvrtc.0, nvrtc.1),
            supported: supported
                .iter()
                .map(i32::to_string)
                .collect::<Vec<_>>()
                .join(", sm_"),
        }),
    }
}

/// The NVRTC options for `target`.
pub(crate) fn options(target: Target) -> Vec<String> {
    vec![
        format!("--gpu-architecture={target}"),
        "--std=c++17".to_owned(),
        // Keep IEEE semantics, as the host kernels have: subnormals, exact division, and no
        // contraction of separate operations.
        "--ftz=false".to_owned(),
        "--prec-div=true".to_owned(),
        "--fmad=false".to_owned(),
    ]
}

/// NVRTC's version, (major, minor).
pub(crate) fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    load::nvrtc()?;
    load::guarded("loading NVRTC", || {
        let (mut major, mut minor): (c_int, c_int) = (0, 0);
        // SAFETY: both pointers are valid for writes of one `c_int`.
        let status = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
        status
            .result()
            .map_err(nvrtc_error("querying the NVRTC version"))?;
        Ok((major, minor))
    })
}

/// The real architectures NVRTC can produce CUBINs for (75, 80, 86, 89, 90, ...).
pub(crate) fn supported_archs() -> Result<Vec<i32>, CudaError> {
    load::nvrtc()?;
    load::guarded("loading NVRTC", || {
        let mut count: c_int = 0;
        // SAFETY: the pointer is valid for a write of one `c_int`.
        let status = unsafe { sys::nvrtcGetNumSupportedArchs(&mut count) };
        status
            .result()
            .map_err(nvrtc_error("listing architectures"))?;
        let mut archs = vec![0 as c_int; usize::try_from(count).unwrap_or(0)];
        // SAFETY: `archs` has room for the `count` values NVRTC writes.
        let status = unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) };
        status
            .result()
            .map_err(nvrtc_error("listing architectures"))?;
        Ok(archs)
    })
}

/// Where a kernel image came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Origin {
    /// Read from the on-disk cache.
    Disk,
    /// Compiled by NVRTC just now (and written to the cache if there is one).
    Compiled,
}

/// The image of the kernel source for `target`: from `cache_dir` when it holds a valid one
/// (unless `recompile`), else compiled by NVRTC and stored there.
///
/// The image is what `cuModuleLoadData` takes: a CUBIN, or NUL-terminated PTX text.
pub(crate) fn image(
    target: Target,
    cache_dir: Option<&Path>,
    recompile: bool,
) -> Result<(Vec<u8>, Origin), CudaError> {
    let src = source::source();
    let opts = options(target);
    let path = match cache_dir {
        Some(dir) => {
            let name = cache::file_name(src, &target.to_string(), nvrtc_version()?, &opts);
            Some(dir.join(name))
        }
        None => None,
    };
    if let Some(path) = path.as_deref().filter(|_| !recompile) {
        if let Some(image) = cache::read(path) {
            tracing::debug!(path = %path.display(), "CUDA kernels loaded from the cache");
            return Ok((image, Origin::Disk));
        }
    }
    let start = Instant::now();
    let image = compile(src, target, &opts)?;
    tracing::info!(
        %target,
        seconds = start.elapsed().as_secs_f64(),
        "compiled the CUDA reduction kernels with NVRTC"
    );
    if let Some(path) = path.as_deref() {
        if let Err(err) = cache::write(path, &image) {
            tracing::warn!(path = %path.display(), %err, "cannot write the CUDA kernel cache");
        }
    }
    Ok((image, Origin::Compiled))
}

/// Compiles `src` for `target` with `opts`.
pub(crate) fn compile(src: &str, target: Target, opts: &[String]) -> Result<Vec<u8>, CudaError> {
    load::nvrtc()?;
    load::guarded("running NVRTC", || {
        let src_c = CString::new(src).map_err(|_| CudaError::Compile {
            target: target.to_string(),
            message: "the source contains a NUL byte".to_owned(),
            log: String::new(),
        })?;
        let program = Program(
            result::create_program(&src_c, Some(c"chorus_kernels.cu"))
                .map_err(nvrtc_error("creating the NVRTC program"))?,
        );
        // SAFETY: `program` was created above and is destroyed only by its drop.
        if let Err(err) = unsafe { result::compile_program(program.0, opts) } {
            return Err(CudaError::Compile {
                target: target.to_string(),
                message: format!("{:?}", err.0),
                log: program.log(),
            });
        }
        let image = match target {
            Target::Cubin(_) => program.cubin(),
            Target::Ptx(_) => program.ptx(),
        };
        image.map_err(nvrtc_error("reading the compiled image"))
    })
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Program {
    /// The compilation log, lossily decoded.
    fn log(&self) -> String {
        // SAFETY: `self.0` is a live program.
        match unsafe { result::get_program_log(self.0) } {
            Ok(chars) => c_chars_to_string(&chars),
            Err(err) => format!("(no log: {err:?})"),
        }
    }

    /// The CUBIN of a program compiled for a real architecture.
    fn cubin(&self) -> Result<Vec<u8>, result::NvrtcError> {
        let mut size = 0usize;
        // SAFETY: `self.0` is a live, compiled program; the pointer is valid for one write.
        unsafe { sys::nvrtcGetCUBINSize(self.0, &mut size) }.result()?;
        let mut cubin = vec![0u8; size];
        // SAFETY: `cubin` has room for the `size` bytes NVRTC writes.
        unsafe { sys::nvrtcGetCUBIN(self.0, cubin.as_mut_ptr().cast::<c_char>()) }.result()?;
        Ok(cubin)
    }

    /// The PTX text, NUL-terminated as `cuModuleLoadData` wants it.
    fn ptx(&self) -> Result<Vec<u8>, result::NvrtcError> {
        // SAFETY: `self.0` is a live, compiled program.
        let chars = unsafe { result::get_ptx(self.0) }?;
        // `c_char` is `i8` or `u8` depending on the platform: reinterpret each byte.
        Ok(chars.into_iter().map(|c| c as u8).collect())
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: `self.0` is a live program and is not used after this.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// Decodes a NUL-terminated `c_char` buffer.
fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().map(|&c| c as u8).collect();
    match CStr::from_bytes_until_nul(&bytes) {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// Maps an NVRTC error code to [`CudaError::Nvrtc`] with what was being done.
fn nvrtc_error(during: &'static str) -> impl Fn(result::NvrtcError) -> CudaError {
    move |err| CudaError::Nvrtc {
        during,
        code: format!("{:?}", err.0),
    }
}
