//! Issue order for a communicator driven from Python: calls run on the caller's thread or,
//! when queued, on one worker thread, never overtaking each other.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use chorus::Communicator;
use crossbeam::channel::{self, Sender};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// One call, run against the communicator.
pub(crate) type Job = Box<dyn FnOnce(&Communicator) -> chorus::Result<()> + Send>;

/// A queued call, what it must keep alive, and where its outcome goes.
struct Queued {
    job: Job,
    keep: Py<PyAny>,
    outcome: Arc<Outcome>,
}

/// A communicator and the worker thread that runs its queued calls in order.
pub(crate) struct Lane {
    comm: Arc<Communicator>,
    /// Calls queued and not yet finished.
    pending: Mutex<usize>,
    /// Signalled when `pending` drops to zero.
    idle: Condvar,
    worker: Sender<Queued>,
}

impl Lane {
    /// Starts the worker thread for `comm`.
    pub fn start(comm: Communicator) -> std::io::Result<Arc<Lane>> {
        let (worker, queue) = channel::unbounded::<Queued>();
        let lane = Arc::new(Lane {
            comm: Arc::new(comm),
            pending: Mutex::new(0),
            idle: Condvar::new(),
            worker,
        });
        let weak = Arc::downgrade(&lane);
        let comm = Arc::clone(&lane.comm);
        std::thread::Builder::new()
            .name(format!("chorus-torch-{}", comm.rank()))
            .spawn(move || {
                for Queued { job, keep, outcome } in queue {
                    outcome.settle(job(&comm), Some(keep));
                    if let Some(lane) = weak.upgrade() {
                        let mut pending = lane.pending();
                        *pending -= 1;
                        if *pending == 0 {
                            lane.idle.notify_all();
                        }
                    }
                }
            })?;
        Ok(lane)
    }

    /// The communicator.
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    fn pending(&self) -> MutexGuard<'_, usize> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `job` (`queue`) or runs it here once every queued call has finished; the
    /// returned handle settles when it is done. Call without the GIL; a call run here gives
    /// `keep` back, for the caller to drop once it holds the GIL again.
    pub fn issue(&self, queue: bool, keep: Py<PyAny>, job: Job) -> (Handle, Option<Py<PyAny>>) {
        let outcome = Arc::new(Outcome::default());
        let mut pending = self.pending();
        if queue || *pending > 0 {
            if queue {
                *pending += 1;
                let queued = Queued {
                    job,
                    keep,
                    outcome: Arc::clone(&outcome),
                };
                if let Err(e) = self.worker.send(queued) {
                    *pending -= 1;
                    let Queued { keep, .. } = e.into_inner();
                    outcome.settle(
                        Err(chorus::Error::Broken(
                            "the worker thread has stopped".into(),
                        )),
                        Some(keep),
                    );
                }
                return (Handle { outcome }, None);
            }
            while *pending > 0 {
                pending = self.idle.wait(pending).unwrap_or_else(|e| e.into_inner());
            }
        }
        // Holding `pending` keeps other threads' calls from overtaking this one.
        let result = job(&self.comm);
        drop(pending);
        outcome.settle(result, None);
        (Handle { outcome }, Some(keep))
    }
}

/// How a call ended, once it has.
#[derive(Default)]
struct Outcome {
    state: Mutex<State>,
    settled: Condvar,
}

#[derive(Default)]
struct State {
    /// `None` while running; then the error's text, if it failed.
    result: Option<Result<(), String>>,
    /// Called (without arguments) once it settles.
    callbacks: Vec<Py<PyAny>>,
}

impl Outcome {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `result`, wakes waiters, then runs the callbacks and lets `keep` go with the GIL.
    fn settle(&self, result: chorus::Result<()>, keep: Option<Py<PyAny>>) {
        let callbacks = {
            let mut state = self.state();
            state.result = Some(result.map_err(|e| e.to_string()));
            std::mem::take(&mut state.callbacks)
        };
        self.settled.notify_all();
        if callbacks.is_empty() && keep.is_none() {
            return;
        }
        Python::attach(|py| {
            for callback in callbacks {
                if let Err(e) = callback.call0(py) {
                    e.write_unraisable(py, None);
                }
            }
            drop(keep);
        });
    }
}

/// A call issued through a [`Lane`]; settles when the call finishes.
#[pyclass(frozen, module = "chorus_torch._chorus")]
pub(crate) struct Handle {
    outcome: Arc<Outcome>,
}

#[pymethods]
impl Handle {
    /// Waits until the call finishes, or `timeout` seconds pass (returns False then);
    /// raises RuntimeError with Chorus's message if it failed.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let deadline = timeout
            .filter(|t| t.is_finite() && *t >= 0.0)
            .map(|t| Instant::now() + Duration::from_secs_f64(t));
        let outcome = &self.outcome;
        let result = py.detach(|| {
            let mut state = outcome.state();
            loop {
                if let Some(result) = &state.result {
                    return Some(result.clone());
                }
                state = match deadline {
                    None => outcome
                        .settled
                        .wait(state)
                        .unwrap_or_else(|e| e.into_inner()),
                    Some(deadline) => {
                        let left = deadline.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return None;
                        }
                        outcome
                            .settled
                            .wait_timeout(state, left)
                            .unwrap_or_else(|e| e.into_inner())
                            .0
                    }
                };
            }
        });
        match result {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(e)) => Err(PyRuntimeError::new_err(e)),
        }
    }

    /// Whether the call has finished, successfully or not.
    fn is_completed(&self) -> bool {
        self.outcome.state().result.is_some()
    }

    /// The failure's message, once the call has failed; else None.
    fn error(&self) -> Option<String> {
        self.outcome.state().result.clone()?.err()
    }

    /// Calls `callback()` once the call has finished (now, if it has).
    fn on_done(&self, py: Python<'_>, callback: Py<PyAny>) -> PyResult<()> {
        {
            let mut state = self.outcome.state();
            if state.result.is_none() {
                state.callbacks.push(callback);
                return Ok(());
            }
        }
        callback.call0(py).map(drop)
    }
}
