//! The Chorus command-line tools; [`perf`] is the measuring harness shared
//! by `allreduce_perf` and its siblings.

pub mod perf;
