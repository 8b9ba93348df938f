//! A call in flight, as Python sees it: Chorus's [`Work`](chorus::Work) without its buffers'
//! type, waited on with the GIL released.

use std::sync::{Mutex, OnceLock};

use pyo3::prelude::*;

use crate::error::raised;

/// A call's handle ([`chorus::Work`] of any buffers, or a device call's): what [`Pending`]
/// needs of it.
pub(crate) trait Outcome: Send {
    /// Waits, running the call here if the worker has not started it.
    fn wait(self: Box<Self>) -> chorus::Result<()>;
    /// Waits for the worker to finish the call, never running it here.
    fn join(self: Box<Self>) -> chorus::Result<()>;
    /// Whether the call has finished.
    fn is_completed(&self) -> bool;
}

impl<B: Send + 'static> Outcome for chorus::Work<B> {
    fn wait(self: Box<Self>) -> chorus::Result<()> {
        (*self).wait().map(drop)
    }

    fn join(self: Box<Self>) -> chorus::Result<()> {
        (*self).join().map(drop)
    }

    fn is_completed(&self) -> bool {
        chorus::Work::is_completed(self)
    }
}

/// A Chorus call in flight on tensors' memory, which it holds until it is done (even if this
/// object goes first). Waiting on it raises the call's error, every time.
#[pyclass(frozen, module = "chorus_torch._chorus")]
pub(crate) struct Pending {
    /// The handle, until a waiter takes it (held locked while that waiter waits).
    work: Mutex<Option<Box<dyn Outcome>>>,
    /// The call's outcome, once a waiter has seen it.
    outcome: OnceLock<chorus::Result<()>>,
}

impl Pending {
    pub(crate) fn new<B: Send + 'static>(work: chorus::Work<B>) -> Pending {
        Pending::from(Box::new(work) as Box<dyn Outcome>)
    }

    /// The call `start` issues on `comm`, run to its end on this thread without the GIL and
    /// without waking Chorus's worker ([`chorus::Communicator::run_here`]): for a call the
    /// caller waits on at once.
    pub(crate) fn ended(
        py: Python<'_>,
        comm: &chorus::Communicator,
        start: impl FnOnce(&chorus::Communicator) -> PyResult<Pending> + Send,
    ) -> PyResult<Pending> {
        py.detach(|| {
            comm.run_here(|c| {
                let pending = start(c)?;
                pending.settled(|work| work.wait());
                Ok(pending)
            })
        })
    }

    /// Settles the outcome with `wait` unless another waiter has; the outcome, if any.
    fn settled(
        &self,
        wait: impl FnOnce(Box<dyn Outcome>) -> chorus::Result<()>,
    ) -> Option<chorus::Result<()>> {
        let mut work = self.work.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(work) = work.take() {
            let _ = self.outcome.set(wait(work));
        }
        self.outcome.get().cloned()
    }

    /// Settles the outcome with `wait` unless another waiter has; raises it if it failed.
    fn settle(
        &self,
        py: Python<'_>,
        wait: impl FnOnce(Box<dyn Outcome>) -> chorus::Result<()> + Send,
    ) -> PyResult<()> {
        match py.detach(|| self.settled(wait)) {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(raised(&e)),
            None => Err(raised(&chorus::Error::Internal(
                "a call's outcome was lost".to_string(),
            ))),
        }
    }
}

impl From<Box<dyn Outcome>> for Pending {
    fn from(work: Box<dyn Outcome>) -> Pending {
        Pending {
            work: Mutex::new(Some(work)),
            outcome: OnceLock::new(),
        }
    }
}

#[pymethods]
impl Pending {
    /// Waits for the call, running it on this thread if Chorus's worker has not started it;
    /// raises ChorusError (a RuntimeError) if it failed.
    pub(crate) fn wait(&self, py: Python<'_>) -> PyResult<()> {
        self.settle(py, |work| work.wait())
    }

    /// Waits for Chorus's worker to finish the call, never running it on this thread (a
    /// completion thread's wait); raises as `wait` does.
    pub(crate) fn join(&self, py: Python<'_>) -> PyResult<()> {
        self.settle(py, |work| work.join())
    }

    /// Whether the call has finished, successfully or not.
    pub(crate) fn is_completed(&self) -> bool {
        if self.outcome.get().is_some() {
            return true;
        }
        match self.work.try_lock() {
            Ok(work) => work.as_ref().is_none_or(|w| w.is_completed()),
            // A waiter holds it: finished only once that waiter has seen the outcome.
            Err(_) => false,
        }
    }
}
