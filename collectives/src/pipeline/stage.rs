//! [`Stage`]: one rank's part of a pipeline, running a schedule over point-to-point calls.

use std::time::{Duration, Instant};

use super::schedule::{PipelineSchedule, Step, Transfer};
use crate::{Communicator, Error, Result};

/// Where a stage's time went in [`Stage::run`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageTimes {
    /// Time in the caller's forward and backward.
    pub compute: Duration,
    /// Time waiting for exchanges with the neighbouring stages.
    pub wait: Duration,
}

impl StageTimes {
    /// The measured bubble: the fraction of the run spent waiting (0 when nothing ran).
    pub fn bubble(&self) -> f64 {
        let total = (self.compute + self.wait).as_secs_f64();
        if total == 0.0 {
            0.0
        } else {
            self.wait.as_secs_f64() / total
        }
    }
}

impl std::ops::AddAssign for StageTimes {
    fn add_assign(&mut self, other: StageTimes) {
        self.compute += other.compute;
        self.wait += other.wait;
    }
}

/// One pipeline stage: rank `s` of the pipeline communicator is stage `s`.
///
/// Activations are `f32` buffers of fixed length per micro-batch: `in_len`
/// arrive from the previous stage, `out_len` go to the next one (the first
/// stage has no input and the last no output: their lengths are ignored).
/// The stage keeps each micro-batch's input until its backward has run.
#[derive(Debug)]
pub struct Stage<'c> {
    comm: &'c Communicator,
    in_len: usize,
    out_len: usize,
}

/// One micro-batch's buffers, each held only as long as the schedule needs it.
#[derive(Debug, Default)]
struct Held {
    input: Option<Vec<f32>>,
    output: Option<Vec<f32>>,
    grad_out: Option<Vec<f32>>,
    grad_in: Option<Vec<f32>>,
}

impl<'c> Stage<'c> {
    /// Stage `comm.rank()` of a pipeline of `comm.world_size()` stages.
    pub fn new(comm: &'c Communicator, in_len: usize, out_len: usize) -> Stage<'c> {
        let (s, stages) = (comm.rank(), comm.world_size());
        Stage {
            comm,
            in_len: if s == 0 { 0 } else { in_len },
            out_len: if s + 1 == stages { 0 } else { out_len },
        }
    }

    /// This stage's index.
    pub fn index(&self) -> usize {
        self.comm.rank()
    }

    /// Runs this stage's part of `schedule` once.
    ///
    /// `forward(m, input, output)` computes micro-batch `m` (the first stage's
    /// `input` and the last stage's `output` are empty: they load their data
    /// and compute the loss themselves). `backward(m, input, grad_out, grad_in)`
    /// gets the forward's input back, the gradient of its output (empty on the
    /// last stage) and writes the gradient of its input (empty on the first).
    /// The transfers between two computations are posted together, so a
    /// neighbour's send and this stage's receive proceed at once.
    ///
    /// Fails if the schedule is not for this pipeline's size or names a
    /// micro-batch past its count, or as the point-to-point calls do: a dead or
    /// failed stage is named in the error (by its rank in `comm`), on its
    /// neighbours and, through the monitor's alarm, on the stages beyond them.
    pub fn run(
        &self,
        schedule: &PipelineSchedule,
        mut forward: impl FnMut(usize, &[f32], &mut [f32]),
        mut backward: impl FnMut(usize, &[f32], &[f32], &mut [f32]),
    ) -> Result<StageTimes> {
        let (s, stages) = (self.index(), self.comm.world_size());
        if schedule.stages != stages {
            return Err(Error::InvalidArgument(format!(
                "a schedule for {} stages cannot run on a pipeline of {stages}",
                schedule.stages
            )));
        }
        let micro = schedule.micro_batches;
        let past = |m: usize| m >= micro;
        if let Some(step) = schedule.steps[s].iter().find(|step| match step {
            Step::Forward(m) | Step::Backward(m) => past(*m),
            Step::Exchange(ts) => ts.iter().any(|t| past(t.micro_batch())),
        }) {
            return Err(Error::InvalidArgument(format!(
                "stage {s}: step {step:?} names a micro-batch past the schedule's {micro}"
            )));
        }
        let mut held: Vec<Held> = (0..schedule.micro_batches)
            .map(|_| Held::default())
            .collect();
        let mut times = StageTimes::default();
        for step in &schedule.steps[s] {
            let start = Instant::now();
            match *step {
                Step::Forward(m) => {
                    let h = &mut held[m];
                    let input = h.input.get_or_insert_with(Vec::new);
                    let mut output = vec![0.0; self.out_len];
                    forward(m, input, &mut output);
                    h.output = Some(output);
                    times.compute += start.elapsed();
                }
                Step::Backward(m) => {
                    let h = &mut held[m];
                    let input = h.input.take().unwrap_or_default();
                    let grad_out = h.grad_out.take().unwrap_or_default();
                    let mut grad_in = vec![0.0; self.in_len];
                    backward(m, &input, &grad_out, &mut grad_in);
                    h.grad_in = Some(grad_in);
                    times.compute += start.elapsed();
                }
                Step::Exchange(ref transfers) => {
                    self.exchange(s, transfers, &mut held)?;
                    times.wait += start.elapsed();
                }
            }
        }
        Ok(times)
    }

    /// Posts `transfers` as one group, then files what arrived and frees what left.
    fn exchange(&self, s: usize, transfers: &[Transfer], held: &mut [Held]) -> Result<()> {
        let stages = self.comm.world_size();
        let mut arrived: Vec<(Transfer, Vec<f32>)> = transfers
            .iter()
            .filter(|t| !t.is_send())
            .map(|&t| {
                let len = match t {
                    Transfer::RecvActivation(_) => self.in_len,
                    _ => self.out_len,
                };
                (t, vec![0.0; len])
            })
            .collect();
        let sends: Vec<Transfer> = transfers.iter().copied().filter(|t| t.is_send()).collect();
        let missing = |t: Transfer| {
            Error::InvalidArgument(format!(
                "stage {s}: the schedule sends {t:?} before computing it"
            ))
        };
        let mut data: Vec<(&[f32], usize, u32)> = Vec::with_capacity(sends.len());
        for &t in &sends {
            let h = &held[t.micro_batch()];
            let buf = match t {
                Transfer::SendActivation(_) => h.output.as_deref(),
                _ => h.grad_in.as_deref(),
            };
            let peer = t.peer(s, stages).ok_or_else(|| missing(t))?;
            data.push((buf.ok_or_else(|| missing(t))?, peer, t.tag()));
        }
        self.comm.group(|g| {
            for &(buf, peer, tag) in &data {
                g.send(buf, peer, tag);
            }
            for (t, buf) in arrived.iter_mut() {
                let peer = t.peer(s, stages).unwrap_or(s);
                g.recv(&mut buf[..], peer, t.tag());
            }
        })?;
        for t in sends {
            let h = &mut held[t.micro_batch()];
            match t {
                Transfer::SendActivation(_) => h.output = None,
                _ => h.grad_in = None,
            }
        }
        for (t, buf) in arrived {
            let h = &mut held[t.micro_batch()];
            match t {
                Transfer::RecvActivation(_) => h.input = Some(buf),
                _ => h.grad_out = Some(buf),
            }
        }
        Ok(())
    }
}
