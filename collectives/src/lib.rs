//! Chorus: collective communication for distributed training.
//!
//! A [`Communicator`] joins a job of `world_size` processes (read from
//! torchrun's environment contract with [`Communicator::from_env`], or from
//! a [`Config`]) and runs collectives among them, over shared memory within a
//! host and TCP between hosts: [`all_reduce`], [`broadcast`], [`barrier`] and
//! every other collective and point-to-point call, on any [`Element`] type,
//! blocking or returning a [`Work`] at once.
//!
//! ```no_run
//! use chorus::{Communicator, ReduceOp};
//!
//! let comm = Communicator::from_env()?;
//! let mut grads = vec![1.0f32; 1024];
//! comm.all_reduce(&mut grads, ReduceOp::Avg)?;
//! # Ok::<(), chorus::Error>(())
//! ```
//!
//! Algorithms are [`schedule`]s (pure data), run by one executor; every call
//! is built the same way, and [`tuner`]'s one table picks its route (messages,
//! a shared-memory meeting, shared buffers) and algorithm; `CHORUS_ALGO` forces it.
//!
//! [`all_reduce`]: Communicator::all_reduce
//! [`broadcast`]: Communicator::broadcast
//! [`barrier`]: Communicator::barrier

mod algorithm;
mod call;
pub mod check;
mod communicator;
mod config;
pub mod cost;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod ddp;
pub mod env;
mod error;
mod executor;
mod fault;
pub mod pipeline;
mod rendezvous;
pub mod schedule;
mod streaming;
pub mod torchrun;
pub mod tuner;
pub mod zero;

/// The guides in `docs/`, whose Rust examples compile as doctests.
#[cfg(doctest)]
mod guides {
    #[doc = include_str!("../../docs/async.md")]
    struct Async;
    #[doc = include_str!("../../docs/errors.md")]
    struct Errors;
    #[doc = include_str!("../../docs/failures.md")]
    struct Failures;
    #[doc = include_str!("../../docs/library.md")]
    struct Library;
    #[doc = include_str!("../../docs/shared-memory.md")]
    struct SharedMemory;
    #[doc = include_str!("../../docs/training.md")]
    struct Training;
    #[doc = include_str!("../../docs/gpus.md")]
    struct Gpus;
}

pub use call::{CallInfo, CallKind};
pub use chorus_kernels::{bf16, f16, DType, Element, ReduceOp};
pub use chorus_transport::auth::Auth;
pub use chorus_transport::pages;
/// Chorus's rendezvous store server, for [`Communicator::with_store_server`].
pub use chorus_transport::store::StoreServer;
pub use chorus_transport::TransportKind;
pub use communicator::{Communicator, Group, Messages, SharedBuffer, Work};
pub use config::{
    hostname, Config, Rendezvous, StoreKind, DEFAULT_CHUNK_BYTES, DEFAULT_MASTER_ADDR,
    DEFAULT_NSOCKS, DEFAULT_TIMEOUT,
};
pub use error::{Error, Result};
pub use fault::{Cause, Fault};
pub use streaming::Streaming;
