//! [`Stage`]: one rank's part of a pipeline, running a schedule over point-to-point calls.

use std::sync::{Condvar, Mutex, MutexGuard};
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

/// What the computing thread and the exchanging thread of [`Stage::run`] share.
#[derive(Debug)]
struct Progress {
    held: Vec<Held>,
    /// Computations finished, and exchanges finished, each counted in schedule order.
    computed: usize,
    exchanged: usize,
    /// Set when either side stops early (an exchange failed, or the computing side
    /// returned or panicked): the other side then stops waiting.
    stopped: bool,
}

/// Shared progress and its signal, rung whenever a side finishes a step or stops.
struct Board {
    progress: Mutex<Progress>,
    changed: Condvar,
}

impl Board {
    fn lock(&self) -> MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until `ready` holds or a side stopped; `None` in the second case.
    fn wait_for(&self, ready: impl Fn(&Progress) -> bool) -> Option<MutexGuard<'_, Progress>> {
        let mut progress = self.lock();
        while !ready(&progress) {
            if progress.stopped {
                return None;
            }
            progress = self
                .changed
                .wait(progress)
                .unwrap_or_else(|p| p.into_inner());
        }
        Some(progress)
    }

    fn stop(&self) {
        self.lock().stopped = true;
        self.changed.notify_all();
    }
}

/// Stops the other side's waits when one side leaves, returning or unwinding.
struct StopOnDrop<'a>(&'a Board);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.stop();
    }
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
    /// neighbour's send and this stage's receive proceed at once. They run on a
    /// thread of their own, in the schedule's order, each once the computations
    /// before it are done, while the calling thread goes on with the next
    /// computations whose inputs have arrived: a send waiting for a busy
    /// neighbour overlaps this stage's next forward or backward. So `forward`
    /// and `backward` must not call `comm` themselves (other communicators,
    /// such as a data-parallel group's, are free).
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
        let steps = &schedule.steps[s];
        // What each step waits for: an exchange, the computations before it (which made what
        // it sends); a computation, the exchanges up to the one bringing its input (counted
        // from 1; 0: none, it has no input to wait for).
        let (mut computes, mut exchanges) = (0, 0);
        let (mut activation_in, mut gradient_in) = (vec![0; micro], vec![0; micro]);
        let needs: Vec<usize> = steps
            .iter()
            .map(|step| match step {
                Step::Exchange(transfers) => {
                    exchanges += 1;
                    for &t in transfers {
                        match t {
                            Transfer::RecvActivation(m) => activation_in[m] = exchanges,
                            Transfer::RecvGradient(m) => gradient_in[m] = exchanges,
                            _ => {}
                        }
                    }
                    computes
                }
                Step::Forward(m) => {
                    computes += 1;
                    activation_in[*m]
                }
                Step::Backward(m) => {
                    computes += 1;
                    gradient_in[*m]
                }
            })
            .collect();
        let board = Board {
            progress: Mutex::new(Progress {
                held: (0..micro).map(|_| Held::default()).collect(),
                computed: 0,
                exchanged: 0,
                stopped: false,
            }),
            changed: Condvar::new(),
        };
        std::thread::scope(|scope| {
            let exchanging = scope.spawn(|| self.exchange_all(s, steps, &needs, &board));
            let computed = {
                let _stop = StopOnDrop(&board);
                self.compute_all(steps, &needs, &board, &mut forward, &mut backward)
            };
            // The last exchanges (sends, on the last stages) finish while this side waits.
            let joining = Instant::now();
            let exchanged = exchanging
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            // The exchange's error explains why the computations stopped.
            exchanged?;
            let mut times = computed.ok_or_else(|| {
                Error::Internal(format!("stage {s}: the exchanges stopped early"))
            })?;
            times.wait += joining.elapsed();
            Ok(times)
        })
    }

    /// The computations of `steps`, in order, each once the exchanges it `needs` are done;
    /// `None` if the exchanges stopped first.
    fn compute_all(
        &self,
        steps: &[Step],
        needs: &[usize],
        board: &Board,
        forward: &mut impl FnMut(usize, &[f32], &mut [f32]),
        backward: &mut impl FnMut(usize, &[f32], &[f32], &mut [f32]),
    ) -> Option<StageTimes> {
        let mut times = StageTimes::default();
        for (step, &need) in steps.iter().zip(needs) {
            let m = match *step {
                Step::Forward(m) | Step::Backward(m) => m,
                Step::Exchange(_) => continue,
            };
            let waiting = Instant::now();
            let mut progress = board.wait_for(|p| p.exchanged >= need)?;
            let h = &mut progress.held[m];
            let input = h.input.take().unwrap_or_default();
            let grad_out = h.grad_out.take().unwrap_or_default();
            drop(progress);
            let start = Instant::now();
            times.wait += start - waiting;
            let mut progress = match *step {
                Step::Forward(_) => {
                    let mut output = vec![0.0; self.out_len];
                    forward(m, &input, &mut output);
                    let mut progress = board.lock();
                    progress.held[m].input = Some(input);
                    progress.held[m].output = Some(output);
                    progress
                }
                _ => {
                    let mut grad_in = vec![0.0; self.in_len];
                    backward(m, &input, &grad_out, &mut grad_in);
                    let mut progress = board.lock();
                    progress.held[m].grad_in = Some(grad_in);
                    progress
                }
            };
            times.compute += start.elapsed();
            progress.computed += 1;
            drop(progress);
            board.changed.notify_all();
        }
        Some(times)
    }

    /// The exchanges of `steps`, in order, each once the computations it `needs` are done.
    fn exchange_all(&self, s: usize, steps: &[Step], needs: &[usize], board: &Board) -> Result<()> {
        // However this side ends, the computing side stops waiting for it.
        let _stop = StopOnDrop(board);
        for (step, &need) in steps.iter().zip(needs) {
            let Step::Exchange(transfers) = step else {
                continue;
            };
            let Some(mut progress) = board.wait_for(|p| p.computed >= need) else {
                return Ok(());
            };
            let (sends, mut arrived) = self.take_sends(s, transfers, &mut progress.held)?;
            drop(progress);
            let stages = self.comm.world_size();
            self.comm.group(|g| {
                for (buf, peer, tag) in &sends {
                    g.send(&buf[..], *peer, *tag);
                }
                for (t, buf) in arrived.iter_mut() {
                    let peer = t.peer(s, stages).unwrap_or(s);
                    g.recv(&mut buf[..], peer, t.tag());
                }
            })?;
            let mut progress = board.lock();
            for (t, buf) in arrived {
                let h = &mut progress.held[t.micro_batch()];
                match t {
                    Transfer::RecvActivation(_) => h.input = Some(buf),
                    _ => h.grad_out = Some(buf),
                }
            }
            progress.exchanged += 1;
            drop(progress);
            board.changed.notify_all();
        }
        Ok(())
    }

    /// The buffers `transfers` send, taken from `held` (sent, they are freed), with their
    /// peers and tags; and the buffers they receive into. Fails if the schedule sends
    /// something not computed yet.
    #[allow(clippy::type_complexity)]
    fn take_sends(
        &self,
        s: usize,
        transfers: &[Transfer],
        held: &mut [Held],
    ) -> Result<(Vec<(Vec<f32>, usize, u32)>, Vec<(Transfer, Vec<f32>)>)> {
        let stages = self.comm.world_size();
        let missing = |t: Transfer| {
            Error::InvalidArgument(format!(
                "stage {s}: the schedule sends {t:?} before computing it"
            ))
        };
        let mut sends = Vec::new();
        let mut arrived = Vec::new();
        for &t in transfers {
            let h = &mut held[t.micro_batch()];
            match t {
                Transfer::RecvActivation(_) => arrived.push((t, vec![0.0; self.in_len])),
                Transfer::RecvGradient(_) => arrived.push((t, vec![0.0; self.out_len])),
                Transfer::SendActivation(_) | Transfer::SendGradient(_) => {
                    let buf = match t {
                        Transfer::SendActivation(_) => h.output.take(),
                        _ => h.grad_in.take(),
                    };
                    let peer = t.peer(s, stages).ok_or_else(|| missing(t))?;
                    sends.push((buf.ok_or_else(|| missing(t))?, peer, t.tag()));
                }
            }
        }
        Ok((sends, arrived))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::pipeline::ScheduleKind;
    use crate::Config;

    /// A hand-made schedule whose first exchange fails (it sends what was never computed)
    /// while a computation waits for a later exchange: the call fails, naming the fault,
    /// instead of leaving that computation waiting.
    #[test]
    fn a_failed_exchange_fails_the_call_while_a_computation_waits() {
        let schedule = PipelineSchedule {
            kind: ScheduleKind::GPipe,
            stages: 1,
            micro_batches: 1,
            steps: vec![vec![
                Step::Exchange(vec![Transfer::SendActivation(0)]),
                Step::Exchange(vec![Transfer::RecvGradient(0)]),
                Step::Backward(0),
            ]],
        };
        let (done, result) = mpsc::channel();
        std::thread::spawn(move || {
            let comm = Communicator::new(Config::new(0, 1, "127.0.0.1", 0)).expect("one rank");
            let run = Stage::new(&comm, 4, 4).run(&schedule, |_, _, _| {}, |_, _, _, _| {});
            done.send(run.map(|_| ())).ok();
        });
        match result.recv_timeout(Duration::from_secs(20)) {
            Ok(Err(Error::InvalidArgument(why))) => {
                assert!(why.contains("before computing it"), "{why}")
            }
            Ok(other) => panic!("expected the schedule's fault, got {other:?}"),
            Err(_) => panic!("Stage::run still waits 20 s after its exchange failed"),
        }
    }
}
