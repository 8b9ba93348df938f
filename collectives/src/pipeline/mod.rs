//! Pipeline parallelism: a model split by layers across ranks, each stage
//! running micro-batches as a [`PipelineSchedule`] says.
//!
//! Schedules are pure data ([`ScheduleKind::GPipe`], [`ScheduleKind::OneFOneB`]),
//! proved by [`verify`]; a [`Stage`] runs one over point-to-point calls with the
//! caller's forward and backward, and [`Grid`] splits a world into data-parallel
//! and pipeline groups.
//!
//! ```no_run
//! use chorus::pipeline::{Grid, PipelineSchedule, ScheduleKind, Stage};
//! use chorus::{Communicator, ReduceOp};
//!
//! let world = Communicator::from_env()?;
//! let grid = Grid::new(&world, 2, 2)?; // 2 replicas x 2 stages
//! let schedule = PipelineSchedule::new(ScheduleKind::OneFOneB, grid.pp, 8)?;
//! let stage = Stage::new(&grid.pipeline, 128, 128);
//! let mut grads = vec![0.0f32; 1000];
//! let times = stage.run(
//!     &schedule,
//!     |_m, _input, _output| { /* this stage's layers forward */ },
//!     |_m, _input, _grad_out, _grad_in| { /* backward, accumulating into grads */ },
//! )?;
//! grid.data.all_reduce(&mut grads, ReduceOp::Avg)?;
//! println!("bubble {:.2} (theory {:.2})", times.bubble(), schedule.bubble());
//! # Ok::<(), chorus::Error>(())
//! ```

mod grid;
mod schedule;
mod stage;
mod verify;

pub use grid::Grid;
pub use schedule::{bubble, PipelineSchedule, ScheduleKind, Step, Transfer};
pub use stage::{Stage, StageTimes};
pub use verify::verify;
