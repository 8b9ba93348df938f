//! Asynchronous operations: a per-communicator worker thread and the
//! [`Work`] handles it completes.
//!
//! An asynchronous call takes ownership of its buffer and gives it back
//! through the handle, so the buffer cannot be touched or freed while the
//! operation runs: the type system, not a comment, rules out use-after-free.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender};

use super::{lock, Call, Communicator, Inner, State};
use crate::{Element, Error, ReduceOp, Result};

type Task = Box<dyn FnOnce() + Send>;

/// The thread that runs a communicator's asynchronous operations in issue order.
pub(super) struct Worker {
    tasks: Option<Sender<Task>>,
    thread: Option<JoinHandle<()>>,
    /// Disconnects when the thread ends.
    ended: Receiver<()>,
}

impl Worker {
    fn start(rank: usize) -> Result<Worker> {
        let (tasks, queue) = channel::unbounded::<Task>();
        let (alive, ended) = channel::bounded::<()>(0);
        let thread = std::thread::Builder::new()
            .name(format!("chorus-work-{rank}"))
            .spawn(move || {
                let _alive = alive;
                queue.into_iter().for_each(|task| task());
            })
            .map_err(|source| Error::Resource {
                what: "cannot start the worker thread",
                source,
            })?;
        Ok(Worker {
            tasks: Some(tasks),
            thread: Some(thread),
            ended,
        })
    }

    /// Lets queued operations run for up to `grace`, then calls `overdue` (which must make
    /// them fail promptly) and waits for the thread.
    pub(super) fn finish(mut self, grace: Duration, overdue: impl FnOnce()) {
        drop(self.tasks.take());
        if let Err(RecvTimeoutError::Timeout) = self.ended.recv_timeout(grace) {
            overdue();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        drop(self.tasks.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// An ordered queue of operations run by a worker thread started on first use: what the
/// device collectives' asynchronous calls run on.
#[cfg(feature = "cuda")]
pub(crate) struct Queue {
    rank: usize,
    worker: std::sync::Mutex<Option<Worker>>,
}

#[cfg(feature = "cuda")]
impl Queue {
    pub(crate) fn new(rank: usize) -> Queue {
        Queue {
            rank,
            worker: std::sync::Mutex::new(None),
        }
    }

    /// Runs `op` after every operation queued before it; its outcome and the buffer it
    /// returns come back through the handle.
    pub(crate) fn submit<B, F>(&self, op: F) -> Work<B>
    where
        B: Send + 'static,
        F: FnOnce() -> (Result<()>, B) + Send + 'static,
    {
        let (work, done) = Work::pending();
        let task: Task = Box::new(move || {
            let (result, buf) = op();
            done.mark();
            done.deliver(result, buf);
        });
        if let Err(e) = send(&mut lock(&self.worker), self.rank, task) {
            // The handle reports the worker as stopped.
            tracing::error!("cannot queue an asynchronous operation: {e}");
        }
        work
    }

    /// Waits until every operation queued so far has run; at once if none ever was.
    pub(crate) fn drain(&self) {
        if lock(&self.worker).is_some() {
            let _ = self.submit(|| (Ok(()), ())).wait();
        }
    }
}

/// The queued side of a [`Work`]: marks the operation finished and hands its outcome back.
struct Done<B> {
    outcome: Sender<(Result<()>, B)>,
    flag: Arc<AtomicBool>,
}

impl<B> Done<B> {
    /// Makes the operation show as finished ([`Work::is_completed`]).
    fn mark(&self) {
        self.flag.store(true, Ordering::Release);
    }

    /// Hands the outcome and the buffer to the handle (dropped if the handle is gone).
    fn deliver(self, result: Result<()>, buf: B) {
        let _ = self.outcome.send((result, buf));
    }
}

/// A handle to an operation in flight; gives its buffer back when it completes.
///
/// The operation owns its buffer meanwhile:
///
/// ```no_run
/// # use chorus::{Communicator, ReduceOp};
/// let comm = Communicator::from_env()?;
/// let grads = vec![1.0f32; 1024];
/// let work = comm.all_reduce_async(grads, ReduceOp::Sum);
/// let grads = work.wait()?;
/// # Ok::<(), chorus::Error>(())
/// ```
///
/// A borrowed buffer does not compile, so the transport never writes memory that was
/// freed while the operation ran:
///
/// ```compile_fail,E0597
/// # use chorus::{Communicator, ReduceOp};
/// let comm = Communicator::from_env()?;
/// let mut grads = vec![1.0f32; 1024];
/// let work = comm.all_reduce_async(&mut grads[..], ReduceOp::Sum);
/// drop(grads);
/// work.wait()?;
/// # Ok::<(), chorus::Error>(())
/// ```
#[derive(Debug)]
#[must_use = "an operation's result is only seen through its handle"]
pub struct Work<B> {
    done: Receiver<(Result<()>, B)>,
    finished: Arc<AtomicBool>,
}

impl<B> Work<B> {
    /// A handle for an operation about to be queued, and the other end, which completes it.
    fn pending() -> (Work<B>, Done<B>) {
        let (outcome, done) = channel::bounded(1);
        let finished = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&finished);
        (Work { done, finished }, Done { outcome, flag })
    }

    /// Whether the operation has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.finished.load(Ordering::Acquire) || !self.done.is_empty()
    }

    /// Waits for the operation and returns the buffer.
    ///
    /// Fails with the operation's error (the buffer's contents are then unspecified and it is dropped).
    pub fn wait(self) -> Result<B> {
        match self.done.recv() {
            Ok((result, buf)) => result.map(|()| buf),
            Err(_) => Err(Error::Broken(
                "the worker stopped before the operation finished".into(),
            )),
        }
    }

    /// Waits at most `timeout`: the outcome if the operation finished, else the handle back.
    pub fn wait_timeout(self, timeout: Duration) -> std::result::Result<Result<B>, Work<B>> {
        match self.done.recv_timeout(timeout) {
            Ok((result, buf)) => Ok(result.map(|()| buf)),
            Err(RecvTimeoutError::Timeout) => Err(self),
            Err(RecvTimeoutError::Disconnected) => Ok(Err(Error::Broken(
                "the worker stopped before the operation finished".into(),
            ))),
        }
    }
}

impl Communicator {
    /// Queues `build(buf)` to run after every operation issued before it; returns at once.
    ///
    /// `build` turns the owned buffer's bytes into a call; errors it returns
    /// (bad arguments) surface through the handle.
    pub(super) fn submit<B, F>(&self, mut buf: B, build: F) -> Work<B>
    where
        B: Send + 'static,
        F: for<'a> FnOnce(&Inner, &'a mut B) -> Result<Call<'a>> + Send + 'static,
    {
        let (work, done) = Work::pending();
        let inner = Arc::clone(&self.inner);
        let mut issue = lock(&self.inner.issue);
        let ticket = issue.next;
        issue.next += 1;
        let task: Task = Box::new(move || {
            // Completion is visible before the next operation's turn begins.
            let run =
                |inner: &Inner, state: &mut State| inner.execute(state, build(inner, &mut buf)?);
            let result = inner.run_then(ticket, run, || done.mark());
            done.deliver(result, buf);
        });
        if let Err(e) = send(&mut issue.worker, self.rank(), task) {
            // The handle reports the worker as stopped.
            tracing::error!("cannot queue an asynchronous operation: {e}");
        }
        work
    }

    /// Starts an in-place all-reduce of `buf` and returns at once.
    ///
    /// The buffer comes back from [`Work::wait`]; errors surface there.
    pub fn all_reduce_async<T, B>(&self, buf: B, op: ReduceOp) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        self.submit(buf, move |inner, buf| {
            inner.all_reduce_call(None, bytemuck::cast_slice_mut(buf.as_mut()), T::DTYPE, op)
        })
    }

    /// Starts a reduce-scatter of `input` (world size blocks of `output`'s length)
    /// into `output` and returns at once.
    ///
    /// Both buffers come back from [`Work::wait`], `input` first; errors (lengths
    /// that do not fit included) surface there.
    pub fn reduce_scatter_async<T, B>(&self, input: B, output: B, op: ReduceOp) -> Work<(B, B)>
    where
        T: Element,
        B: AsRef<[T]> + AsMut<[T]> + Send + 'static,
    {
        self.submit((input, output), move |inner, (input, output)| {
            inner.reduce_scatter_call(
                bytemuck::cast_slice(AsRef::<[T]>::as_ref(&*input)),
                bytemuck::cast_slice_mut(AsMut::<[T]>::as_mut(&mut *output)),
                T::DTYPE,
                op,
            )
        })
    }

    /// Starts an in-place broadcast of `root`'s `buf` and returns at once.
    ///
    /// The buffer comes back from [`Work::wait`]; errors surface there.
    pub fn broadcast_async<T, B>(&self, buf: B, root: usize) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        self.submit(buf, move |inner, buf| {
            inner.broadcast_call(None, bytemuck::cast_slice_mut(buf.as_mut()), T::DTYPE, root)
        })
    }
}

/// Queues `task` on `worker`, starting the thread on first use.
fn send(worker: &mut Option<Worker>, rank: usize, task: Task) -> Result<()> {
    if worker.is_none() {
        *worker = Some(Worker::start(rank)?);
    }
    let tasks = worker
        .as_ref()
        .and_then(|w| w.tasks.as_ref())
        .expect("worker running");
    tasks
        .send(task)
        .map_err(|_| Error::Broken("the worker thread has stopped".into()))
}
