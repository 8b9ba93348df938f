//! The names of the environment variables this crate reads (the GPU kernels' cache and the
//! CUDA toolkit's location). The library re-exports them in `chorus::env`, the one list of
//! every variable Chorus reads or sets; they are defined here because this crate sits below
//! the library.

/// Folder for compiled GPU kernel images (feature `cuda`).
pub const CHORUS_CUDA_CACHE: &str = "CHORUS_CUDA_CACHE";
/// The cache's parent folder when [`CHORUS_CUDA_CACHE`] is unset (`$XDG_CACHE_HOME/chorus`).
pub const XDG_CACHE_HOME: &str = "XDG_CACHE_HOME";
/// The home folder: the cache is `~/.cache/chorus` when neither variable above is set.
pub const HOME: &str = "HOME";
/// The first CUDA toolkit root searched for NVRTC when the loader does not find it (then
/// [`CUDA_PATH`], [`CUDA_ROOT`] and `/usr/local/cuda`).
pub const CUDA_HOME: &str = "CUDA_HOME";
/// CUDA toolkit root searched after [`CUDA_HOME`].
pub const CUDA_PATH: &str = "CUDA_PATH";
/// CUDA toolkit root searched after [`CUDA_PATH`].
pub const CUDA_ROOT: &str = "CUDA_ROOT";
/// Tests only: `1` makes the GPU tests fail instead of skipping without a GPU or NVRTC.
pub const CHORUS_REQUIRE_CUDA: &str = "CHORUS_REQUIRE_CUDA";
