//! Finding the CUDA libraries at run time without panicking.
//!
//! cudarc opens `libcuda` and `libnvrtc` lazily and panics when one is missing, so every
//! entry point first checks that the library can be opened, and runs its first calls into
//! cudarc under [`guarded`], which turns a panic (say, a missing symbol in an old driver)
//! into a [`CudaError::NoCuda`].

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::error::CudaError;
use crate::env;

/// Checks that the CUDA driver library (`libcuda.so.1`, installed with the NVIDIA driver)
/// can be opened.
pub(crate) fn driver() -> Result<(), CudaError> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries to open the driver library under its usual
    // names and closes it again; the driver's initialisers have no preconditions.
    if *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() }) {
        Ok(())
    } else {
        Err(CudaError::NoCuda(format!(
            "no CUDA driver library found ({}): is an NVIDIA driver installed?",
            names("cuda")
        )))
    }
}

/// Checks that NVRTC can be opened. Besides the loader's search path (`LD_LIBRARY_PATH`,
/// `ld.so.conf`), looks in the lib folders of `$CUDA_HOME`, `$CUDA_PATH`, `$CUDA_ROOT`
/// and `/usr/local/cuda`; a library found there is kept loaded so that cudarc finds it by
/// name.
pub(crate) fn nvrtc() -> Result<(), CudaError> {
    static FOUND: OnceLock<Result<(), String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            // SAFETY: as in `driver`, for NVRTC.
            if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return Ok(());
            }
            let dirs = toolkit_lib_dirs();
            for dir in &dirs {
                for name in ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"] {
                    let path = dir.join(name);
                    if path.is_file() && preload(dir, &path) {
                        // SAFETY: as above.
                        if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                            return Ok(());
                        }
                    }
                }
            }
            Err(format!(
                "no NVRTC library found ({} on the loader path, or in {}): install the CUDA \
                 toolkit's NVRTC (e.g. the cuda-nvrtc package) or add its lib folder to \
                 LD_LIBRARY_PATH",
                names("nvrtc"),
                dirs.iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
        .clone()
        .map_err(CudaError::NoCuda)
}

/// Loads NVRTC from `path` in `dir` for the rest of the process, after the
/// `libnvrtc-builtins` beside it (which NVRTC opens by name when it compiles), so that
/// opening either by name finds these copies. Whether NVRTC loaded.
fn preload(dir: &Path, path: &Path) -> bool {
    let builtins = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            name.starts_with("libnvrtc-builtins.so") && !name.contains(".alt.")
        });
    for entry in builtins {
        // SAFETY: loading NVIDIA's NVRTC libraries runs only their own initialisers, which
        // have no preconditions.
        if let Ok(lib) = unsafe { libloading::Library::new(entry.path()) } {
            std::mem::forget(lib);
        }
    }
    // SAFETY: as above.
    match unsafe { libloading::Library::new(path) } {
        Ok(lib) => {
            std::mem::forget(lib);
            true
        }
        Err(_) => false,
    }
}

/// The file names cudarc tries for `lib`, for error messages (without the Windows-style
/// `lib64_*` names it also tries elsewhere).
fn names(lib: &str) -> String {
    let mut names = cudarc::get_lib_name_candidates(lib);
    names.retain(|name| cfg!(windows) || !name.contains(&format!("{lib}64")));
    names.dedup();
    names.join(", ")
}

/// Lib folders of the CUDA toolkits named by the environment, then the default install.
fn toolkit_lib_dirs() -> Vec<PathBuf> {
    let roots = [env::CUDA_HOME, env::CUDA_PATH, env::CUDA_ROOT]
        .iter()
        .filter_map(std::env::var_os)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .chain([PathBuf::from("/usr/local/cuda")]);
    let arch = if cfg!(target_arch = "aarch64") {
        "sbsa-linux"
    } else {
        "x86_64-linux"
    };
    roots
        .flat_map(|root| {
            [
                root.join("lib64"),
                root.join("lib"),
                root.join("targets").join(arch).join("lib"),
            ]
        })
        .collect()
}

/// Runs `f`, turning a panic inside cudarc (a library or symbol it could not load) into
/// [`CudaError::NoCuda`].
pub(crate) fn guarded<T>(
    what: &str,
    f: impl FnOnce() -> Result<T, CudaError>,
) -> Result<T, CudaError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("unknown panic");
        Err(CudaError::NoCuda(format!("{what}: {msg}")))
    })
}
