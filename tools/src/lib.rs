//! The Chorus command-line tools; [`perf`] is the measuring harness shared
//! by `allreduce_perf` and its siblings (`broadcast_perf`, `reduce_perf`,
//! `all_gather_perf`, `reduce_scatter_perf`, `alltoall_perf`,
//! `sendrecv_perf`, `barrier_perf`).

pub mod perf;
pub mod train;
