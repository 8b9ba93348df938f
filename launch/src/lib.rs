//! The launcher of Chorus jobs: runs `nproc_per_node` copies of a worker program on this host,
//! as node `node_rank` of a job of `nnodes` nodes.
//!
//! Every worker gets torchrun's environment contract ([`MASTER_ADDR`](chorus_env::MASTER_ADDR),
//! [`MASTER_PORT`](chorus_env::MASTER_PORT), [`RANK`](chorus_env::RANK), [`WORLD_SIZE`](chorus_env::WORLD_SIZE),
//! [`LOCAL_RANK`](chorus_env::LOCAL_RANK), [`LOCAL_WORLD_SIZE`](chorus_env::LOCAL_WORLD_SIZE),
//! [`GROUP_RANK`](chorus_env::GROUP_RANK), [`GROUP_WORLD_SIZE`](chorus_env::GROUP_WORLD_SIZE),
//! [`TORCHELASTIC_RESTART_COUNT`](chorus_env::TORCHELASTIC_RESTART_COUNT),
//! [`TORCHELASTIC_MAX_RESTARTS`](chorus_env::TORCHELASTIC_MAX_RESTARTS),
//! [`TORCHELASTIC_RUN_ID`](chorus_env::TORCHELASTIC_RUN_ID)) and, when the node's GPUs are given, its
//! share of them ([`CUDA_VISIBLE_DEVICES`](chorus_env::CUDA_VISIBLE_DEVICES),
//! [`CHORUS_DEVICE_IDS`](chorus_env::CHORUS_DEVICE_IDS), see [`gpus_for_local_rank`]), on top of the
//! launcher's own environment and the caller's extra variables. `RANK` is
//! `node_rank * nproc_per_node + LOCAL_RANK`. A single-node launch that is given no port
//! reserves one for rank 0's store before it starts anyone ([`PortReservation`]).
//!
//! The launcher captures (and optionally forwards, and writes to per-rank log files) every
//! worker's stdout/stderr, watches the workers, and as soon as one fails or the job's time
//! limit passes it kills all the others with SIGKILL. While restarts remain
//! ([`LaunchSpec::max_restarts`]) a failure restarts the whole local group with
//! `TORCHELASTIC_RESTART_COUNT` one higher. An [`Interrupt`] (chorusrun raises it on SIGINT and
//! SIGTERM) forwards its signal to every worker and stops the job. No worker is ever left
//! running (or unreaped) when [`launch`] returns, also when it returns an error or unwinds from
//! a panic.
//!
//! Used by `chorusrun`, the perf tools' and `train`'s `-np W` ([`run_copies`]), the test
//! harness and the benchmarks.
//!
//! ```no_run
//! use chorus_launch::{launch, LaunchSpec, Output};
//! use std::time::Duration;
//!
//! let spec = LaunchSpec::new("/path/to/worker", 4)
//!     .arg("--size=1M")
//!     .timeout(Duration::from_secs(60))
//!     .output(Output::RankZero);
//! let report = launch(&spec).expect("could not start the workers");
//! if !report.success() {
//!     eprintln!("{}", report.summary());
//! }
//! ```
//!
//! Limitations: without [`LaunchSpec::own_process_group`] only the worker processes themselves
//! are killed, not processes they spawned; with it, a worker's whole process group is signalled
//! and killed while the worker runs, but descendants that outlive a worker that exited by
//! itself are left alone. Output of descendants that keep a worker's pipe open is collected for
//! at most [`READER_GRACE`] after the worker exits. Nothing is cleaned up if the launcher
//! process itself is killed by SIGKILL. Restarts are per node: there is no elastic rendezvous
//! between the launchers of different nodes, so with several nodes each restarts its own group
//! when its workers fail (the peers of a dead worker fail in turn and restart too) and the
//! store port stays the same.

mod copies;
mod error;
mod output;
mod port;
mod report;
mod run;
mod spec;

use std::time::Duration;

pub use copies::run_copies;
pub use error::LaunchError;
pub use port::PortReservation;
pub use report::{Exit, LaunchReport, RankOutcome};
pub use run::launch;
pub use spec::{gpus_for_local_rank, Interrupt, LaunchSpec, Output};

/// Whole-job time limit used by [`LaunchSpec::new`] (the job's, not a worker's
/// per-wait `CHORUS_TIMEOUT`).
pub const DEFAULT_JOB_TIMEOUT: Duration = Duration::from_secs(300);
/// Run id used by [`LaunchSpec::new`] (torchrun's default).
pub const DEFAULT_RUN_ID: &str = "none";
/// How long workers may take to exit after an interrupt's signal before they are killed.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(10);
/// Most bytes of each worker stream kept in the report; older output is dropped beyond this.
pub const MAX_CAPTURED_BYTES: usize = 16 << 20;
/// How long the launcher waits, after the last worker is reaped, for output still in flight.
pub const READER_GRACE: Duration = Duration::from_secs(1);
