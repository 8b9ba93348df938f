//! `libnccl.so.2` on Chorus: NCCL's C API with the ABI of NCCL 2.30.7, so that a program
//! written for NCCL (through its header, or PyTorch's `nccl` backend) runs its collectives
//! on Chorus without a change, loaded in NCCL's place (`LD_PRELOAD`, or first on the
//! loader's path).
//!
//! - [`abi`]: NCCL's types and constants as its header lays them out, and the reading of a
//!   caller's `ncclConfig_t` whatever its header's version.
//! - [`id`]: the unique id, which names the rendezvous store its maker serves and the job's
//!   secret.
//! - [`comm`]: the communicator behind `ncclComm_t`, set up at once or in the background.
//! - `handles`: the `ncclComm_t` handles handed out, looked up rather than dereferenced, so
//!   a communicator outlives the calls on it whoever destroys or aborts it.
//! - `group`: `ncclGroupStart` / `ncclGroupEnd`, per thread (crate-private: what it
//!   queues holds the caller's addresses, which only the `unsafe` entry points vouch for).
//! - [`premul`]: the operators `ncclRedOpCreatePreMulSum` makes.
//! - `ordered` (cargo feature `cuda`): calls ordered on the caller's CUDA streams, on device
//!   memory and host memory alike (crate-private, as `group` is).
//! - [`api`]: the entry points.
//!
//! Loading the library starts nothing (no thread, no socket, not even the CUDA driver)
//! until a call asks; no panic crosses the C boundary. Where every rank had a current CUDA
//! device when its communicator was made (and the library was built with `cuda`), each call
//! is issued on its stream and returns at once, as NCCL's do; elsewhere calls run on host
//! memory and return when done. See `docs/nccl.md` for what is supported and how what is
//! not fails.

pub mod abi;
pub mod api;
pub mod comm;
mod group;
mod handles;
pub mod id;
mod memory;
#[cfg(feature = "cuda")]
mod ordered;
pub mod premul;

/// Locks `m`, taking over a lock a panicking thread left (the state behind every lock here
/// stays whole between statements, so a panic elsewhere does not make it wrong).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
