//! Data parallelism on flat gradient buffers: the gradient-bucket reducer
//! ([`Ddp`]) and the [`DistributedSampler`].
//!
//! Framework-agnostic: a trainer registers its parameters as
//! ([`ParamSpec`]: name, length, dtype), writes gradients into the views
//! [`Ddp`] hands out, and marks them ready as backward produces them.

mod bucket;
mod fingerprint;
mod hook;
mod reducer;
mod sampler;

pub use bucket::ParamSpec;
pub(crate) use bucket::{assign as assign_buckets, caps_in_bytes};
pub(crate) use fingerprint::check as check_same_params;
pub use hook::Compression;
pub use reducer::{Ddp, DdpOptions};
pub use sampler::DistributedSampler;
