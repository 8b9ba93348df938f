//! Pipeline parallelism: a model split by layers across ranks, each stage
//! running micro-batches as a [`PipelineSchedule`] says.
//!
//! Schedules are pure data ([`ScheduleKind::GPipe`], [`ScheduleKind::OneFOneB`]),
//! proved by [`verify`]; a [`Stage`] runs one over point-to-point calls with the
//! caller's forward and backward, and [`Grid`] splits a world into data-parallel
//! and pipeline groups.

mod grid;
mod schedule;
mod stage;
mod verify;

pub use grid::Grid;
pub use schedule::{bubble, PipelineSchedule, ScheduleKind, Step, Transfer};
pub use stage::{Stage, StageTimes};
pub use verify::verify;
