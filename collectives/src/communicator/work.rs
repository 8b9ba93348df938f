//! Asynchronous operations: [`Work`] handles and the per-communicator worker thread that
//! runs them in issue order.
//!
//! Every call takes a ticket when it is issued. A blocking call runs on the calling thread
//! when its ticket's turn comes; an asynchronous one is queued for the worker and returns a
//! [`Work`] at once. Whoever gets to a queued operation first runs it: the worker, or a
//! thread that waits on its handle before the worker has started it (so a call waited on
//! at once costs no hand-over between threads; [`Communicator::run_here`] keeps such a call
//! from waking the worker at all). Either way it runs in its ticket's turn.
//!
//! An asynchronous call takes ownership of its buffers and gives them back through the
//! handle, so they cannot be touched or freed while the operation runs: the type system,
//! not a comment, rules out use-after-free. Dropping a handle does not cancel or wait for
//! its operation: it still runs in its turn, in the background, and its buffers are
//! dropped when it is done (a dropped communicator gives queued operations a short grace,
//! then fails them).

use std::sync::{Arc, Condvar, Mutex};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender};

use super::{lock, Call, Communicator, Inner, State};
use crate::{Error, Result};

/// An operation's body: runs it and hands its outcome and its buffers to the [`Finish`].
type Body<B> = Box<dyn FnOnce(Finish<'_, B>) + Send>;

/// Where an operation's body records its outcome.
struct Finish<'a, B>(&'a Slot<B>);

impl<B> Finish<'_, B> {
    /// Makes the operation finished, its outcome and buffers ready for the handle (which
    /// drops a failed operation's buffers: never the thread that ran it).
    fn finish(self, result: Result<()>, buf: B) {
        self.end(Stage::Finished(result, buf));
    }

    /// Makes the operation finished at `stage`, and says so to its waiters.
    fn end(self, stage: Stage<B>) {
        *lock(&self.0.stage) = stage;
        self.0.finished.notify_all();
    }
}

/// What the worker runs: an operation that may already have been taken by a waiter.
pub(super) trait Task: Send + Sync {
    /// Runs the operation unless someone already has.
    fn run(&self);
    /// Whether nobody has started the operation yet.
    fn queued(&self) -> bool;
}

/// Where an operation is.
enum Stage<B> {
    /// Not started: the worker or a waiter takes it from here.
    Queued(Body<B>),
    /// Running on some thread.
    Running,
    /// Finished; the outcome waits for the handle.
    Finished(Result<()>, B),
    /// Panicked, its buffers lost; the error waits for the handle.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Panicked(Error),
    /// The handle took the outcome.
    Collected,
}

impl<B> Stage<B> {
    /// Takes a finished operation's outcome and buffers, leaving `Collected`; `None` (and
    /// the stage as it was) while the operation is queued or running.
    fn collect(&mut self) -> Option<Result<B>> {
        match std::mem::replace(self, Stage::Collected) {
            Stage::Finished(result, buf) => Some(result.map(|()| buf)),
            Stage::Panicked(error) => Some(Err(error)),
            other => {
                *self = other;
                None
            }
        }
    }
}

/// An operation shared between the queue and its handle.
struct Slot<B> {
    stage: Mutex<Stage<B>>,
    /// Signalled when the operation finishes.
    finished: Condvar,
}

impl<B> Slot<B> {
    /// Takes the operation's body if nobody has started it.
    fn take(&self) -> Option<Body<B>> {
        let mut stage = lock(&self.stage);
        match std::mem::replace(&mut *stage, Stage::Running) {
            Stage::Queued(body) => Some(body),
            other => {
                *stage = other;
                None
            }
        }
    }

    /// Runs `body` here.
    fn run_body(&self, body: Body<B>) {
        body(Finish(self));
    }
}

impl<B: Send> Task for Slot<B> {
    fn run(&self) {
        if let Some(body) = self.take() {
            self.run_body(body);
        }
    }

    fn queued(&self) -> bool {
        matches!(*lock(&self.stage), Stage::Queued(_))
    }
}

/// The thread that runs a communicator's asynchronous operations in issue order.
pub(super) struct Worker {
    tasks: Option<Sender<Arc<dyn Task>>>,
    thread: Option<JoinHandle<()>>,
    /// Disconnects when the thread ends.
    ended: Receiver<()>,
}

impl Worker {
    fn start(rank: usize) -> Result<Worker> {
        let (tasks, queue) = channel::unbounded::<Arc<dyn Task>>();
        let (alive, ended) = channel::bounded::<()>(0);
        let thread = std::thread::Builder::new()
            .name(format!("chorus-work-{rank}"))
            .spawn(move || {
                let _alive = alive;
                queue.into_iter().for_each(|task| task.run());
            })
            .map_err(|source| Error::Resource {
                what: "cannot start the worker thread",
                source: source.into(),
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

/// `body`'s handle, and the task that runs it.
fn task<B: Send + 'static>(body: Body<B>) -> (Work<B>, Arc<dyn Task>) {
    let slot = Arc::new(Slot {
        stage: Mutex::new(Stage::Queued(body)),
        finished: Condvar::new(),
    });
    (Work { slot: slot.clone() }, slot)
}

/// Hands `task` to `worker` (started on first use); whether a worker took it. If none can
/// run it, its handle's [`Work::wait`] runs it instead.
fn send(worker: &mut Option<Worker>, rank: usize, task: Arc<dyn Task>) -> bool {
    if worker.is_none() {
        match Worker::start(rank) {
            Ok(started) => *worker = Some(started),
            Err(e) => tracing::warn!(
                rank,
                "{e}: operations run on the threads that issue or wait on them"
            ),
        }
    }
    // Only fails once the thread has ended; `wait` runs the operation then.
    let tasks = worker.as_ref().and_then(|w| w.tasks.as_ref());
    tasks.is_some_and(|tasks| tasks.send(task).is_ok())
}

/// The error of an operation that panicked (a defect in Chorus), with the panic's message.
#[cfg(feature = "cuda")]
fn panicked(panic: &(dyn std::any::Any + Send)) -> Error {
    let message = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("no message");
    Error::Internal(format!("the operation panicked: {message}"))
}

/// Where a communicator's calls are issued: tickets, the worker, and the call a thread in
/// [`Communicator::run_here`] keeps from the worker.
#[derive(Default)]
pub(super) struct Issue {
    /// The next call's ticket.
    next: u64,
    worker: Option<Worker>,
    /// The thread whose next call is kept from the worker.
    keep_for: Option<ThreadId>,
    /// That call, once issued, until it has run or goes to the worker.
    kept: Option<Arc<dyn Task>>,
}

impl Issue {
    /// Hands out the next ticket, and whether its call is the one a thread in
    /// [`Communicator::run_here`] keeps (its first). A call kept before goes to the worker
    /// first: this one will wait for its turn.
    pub(super) fn ticket(&mut self, rank: usize) -> (u64, bool) {
        self.hand_over(rank);
        let keep = self.keep_for.is_some() && self.keep_for == Some(std::thread::current().id());
        if keep {
            self.keep_for = None;
        }
        self.next += 1;
        (self.next - 1, keep)
    }

    /// Takes the worker (to finish it).
    pub(super) fn take_worker(&mut self) -> Option<Worker> {
        self.worker.take()
    }

    /// Hands the kept call to the worker if nobody has run it, in its place in issue order.
    fn hand_over(&mut self, rank: usize) {
        if let Some(kept) = self.kept.take().filter(|k| k.queued()) {
            send(&mut self.worker, rank, kept);
        }
    }
}

/// An ordered queue of operations run by a worker thread started on first use: what the
/// device collectives' asynchronous calls run on.
#[cfg(feature = "cuda")]
pub(crate) struct Queue {
    rank: usize,
    worker: Mutex<Option<Worker>>,
}

#[cfg(feature = "cuda")]
impl Queue {
    pub(crate) fn new(rank: usize) -> Queue {
        Queue {
            rank,
            worker: Mutex::new(None),
        }
    }

    /// Runs `op` after every operation queued before it; its outcome and the buffer it
    /// returns come back through the handle. Only the worker runs the queue's operations
    /// (they take no turns, so a waiter must not run one ahead of those before it); where
    /// no worker thread can start, `op` runs here and now. An `op` that panics fails its
    /// handle with [`Error::Internal`] and leaves the queue running.
    pub(crate) fn submit<B, F>(&self, op: F) -> Work<B>
    where
        B: Send + 'static,
        F: FnOnce() -> (Result<()>, B) + Send + 'static,
    {
        let body: Body<B> = Box::new(move |finish| {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(op)) {
                Ok((result, buf)) => finish.finish(result, buf),
                Err(panic) => finish.end(Stage::Panicked(panicked(panic.as_ref()))),
            }
        });
        let (work, task) = task(body);
        let mut worker = lock(&self.worker);
        if !send(&mut worker, self.rank, Arc::clone(&task)) {
            // Under the lock, so that operations queued by other threads wait for it.
            task.run();
        }
        work
    }

    /// Waits until every operation queued so far has run; at once if none ever was.
    pub(crate) fn drain(&self) {
        if lock(&self.worker).is_some() {
            let _ = self.submit(|| (Ok(()), ())).join();
        }
    }
}

/// A handle to an operation in flight; gives its buffers back when it completes.
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
///
/// Dropping a handle neither cancels nor waits for its operation: it still runs in its
/// turn, and its buffers are dropped when it is done.
#[must_use = "an operation's result is only seen through its handle"]
pub struct Work<B> {
    slot: Arc<Slot<B>>,
}

impl<B> std::fmt::Debug for Work<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("completed", &self.is_completed())
            .finish()
    }
}

impl<B> Work<B> {
    /// Whether the operation has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        matches!(
            *lock(&self.slot.stage),
            Stage::Finished(..) | Stage::Panicked(_)
        )
    }

    /// Blocks until another thread (the worker) has finished the operation, leaving its
    /// outcome for the handle; never runs it here, as [`join`](Self::join).
    #[cfg(feature = "cuda")]
    pub(crate) fn finished(&self) {
        let mut stage = lock(&self.slot.stage);
        while matches!(*stage, Stage::Queued(_) | Stage::Running) {
            stage = self
                .slot
                .finished
                .wait(stage)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Waits for the operation and returns its buffers; if the worker has not started it
    /// yet, runs it on this thread (in its turn).
    ///
    /// Fails with the operation's error (the buffers' contents are then unspecified and
    /// they are dropped).
    pub fn wait(self) -> Result<B> {
        if let Some(body) = self.slot.take() {
            self.slot.run_body(body);
        }
        self.join()
    }

    /// Waits for another thread (the worker) to finish the operation and returns its
    /// buffers; never runs the operation here (a completion thread's wait, which must not
    /// hold up the calls behind it). Fails as [`wait`](Self::wait) does.
    pub fn join(self) -> Result<B> {
        let mut stage = lock(&self.slot.stage);
        loop {
            if let Some(outcome) = stage.collect() {
                return outcome;
            }
            stage = self
                .slot
                .finished
                .wait(stage)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Waits at most `timeout` for another thread (the worker) to finish the operation:
    /// the outcome if it finished, else the handle back. Never runs the operation here.
    pub fn wait_timeout(self, timeout: Duration) -> std::result::Result<Result<B>, Work<B>> {
        let deadline = Instant::now() + timeout;
        let mut stage = lock(&self.slot.stage);
        loop {
            if let Some(outcome) = stage.collect() {
                return Ok(outcome);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                drop(stage);
                return Err(self);
            }
            stage = self
                .slot
                .finished
                .wait_timeout(stage, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Communicator {
    /// Queues `run(inner, state, buf)` to run in the turn of a ticket taken now; returns at
    /// once. The buffers come back through the handle with the outcome.
    pub(super) fn submit<B, F>(&self, buf: B, run: F) -> Work<B>
    where
        B: Send + 'static,
        F: FnOnce(&Inner, &mut State, &mut B) -> Result<()> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        let mut issue = lock(&self.inner.issue);
        let (ticket, keep) = issue.ticket(self.rank());
        // The outcome is recorded in the operation's turn, so operations show as completed
        // in issue order.
        let body: Body<B> = Box::new(move |finish| {
            inner.run_then(ticket, buf, run, |result, buf| finish.finish(result, buf));
        });
        let (work, task) = task(body);
        if keep {
            issue.kept = Some(task);
        } else {
            send(&mut issue.worker, self.rank(), task);
        }
        work
    }

    /// Runs `f`, keeping the first call it issues from the worker thread so that waiting on
    /// it runs it on this thread: for a call waited on at once, which gains nothing from
    /// the worker and, where ranks outnumber cores, pays for waking it. `f` should wait on
    /// that call with [`Work::wait`]; once `f` issues another call (or another thread issues
    /// one), or returns without waiting, the call goes to the worker as usual, in its turn.
    /// (Until then nothing else runs it: `join`, `wait_timeout` or polling it inside `f`
    /// would wait for ever.)
    ///
    /// ```no_run
    /// # use chorus::{Communicator, ReduceOp};
    /// let comm = Communicator::from_env()?;
    /// let grads = comm.run_here(|c| c.all_reduce_async(vec![1.0f32; 8], ReduceOp::Sum).wait())?;
    /// # Ok::<(), chorus::Error>(())
    /// ```
    pub fn run_here<R>(&self, f: impl FnOnce(&Communicator) -> R) -> R {
        /// Hands a call `f` kept but did not run to the worker, even if `f` panics.
        struct Release<'a>(&'a Communicator);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                let mut issue = lock(&self.0.inner.issue);
                if issue.keep_for == Some(std::thread::current().id()) {
                    issue.keep_for = None;
                }
                issue.hand_over(self.0.rank());
            }
        }
        lock(&self.inner.issue).keep_for = Some(std::thread::current().id());
        let _release = Release(self);
        f(self)
    }

    /// Queues the collective that `build` describes on `buf` (see [`submit`](Self::submit)).
    /// Arguments `build` refuses fail the handle and leave the communicator usable.
    pub(super) fn submit_call<B, F>(&self, buf: B, build: F) -> Work<B>
    where
        B: Send + 'static,
        F: for<'a> FnOnce(&Inner, &'a mut B) -> Result<Call<'a>> + Send + 'static,
    {
        self.submit(buf, move |inner, state, buf| {
            inner.execute(state, build(inner, buf)?)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Config, ReduceOp};

    const PATIENCE: Duration = Duration::from_secs(30);

    fn solo() -> Communicator {
        Communicator::new(Config::new(0, 1, "127.0.0.1", 0)).expect("one rank")
    }

    fn worker_started(comm: &Communicator) -> bool {
        lock(&comm.inner.issue).worker.is_some()
    }

    #[test]
    fn a_call_waited_on_in_run_here_never_wakes_the_worker() {
        let comm = solo();
        let sum = comm.run_here(|c| c.all_reduce_async(vec![2.0f32, 3.0], ReduceOp::Sum).wait());
        assert_eq!(sum.unwrap(), [2.0, 3.0]);
        assert!(!worker_started(&comm));
        // Outside it, an asynchronous call goes to the worker.
        let work = comm.all_reduce_async(vec![1u8], ReduceOp::Max);
        assert!(worker_started(&comm));
        assert_eq!(work.wait().unwrap(), [1]);
    }

    /// Runs `f` on a thread of its own and gives its result, failing the test rather than
    /// hanging if it does not end.
    fn within<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
        let (tx, rx) = channel::bounded(1);
        std::thread::spawn(move || tx.send(f()));
        rx.recv_timeout(PATIENCE).expect("the calls did not end")
    }

    #[test]
    fn a_call_run_here_leaves_unwaited_goes_to_the_worker_in_its_turn() {
        let comm = Arc::new(solo());
        let c = Arc::clone(&comm);
        let (left, later) = within(move || {
            // Kept, then handed over when `run_here` returns: `join` never runs it here.
            let left = c.run_here(|c| c.all_reduce_async(vec![1i32], ReduceOp::Sum));
            // Kept, then handed over when the second call is issued, which waits for its turn.
            let later = c.run_here(|c| {
                let first = c.all_reduce_async(vec![2i32], ReduceOp::Sum);
                let second = c.all_reduce_async(vec![3i32], ReduceOp::Sum).wait();
                (first.join(), second)
            });
            (left.join(), later)
        });
        assert_eq!(left.unwrap(), [1]);
        assert_eq!((later.0.unwrap(), later.1.unwrap()), (vec![2], vec![3]));
    }

    #[test]
    fn a_blocking_call_after_a_kept_one_hands_it_to_the_worker() {
        let comm = Arc::new(solo());
        let c = Arc::clone(&comm);
        let (barrier, kept) = within(move || {
            c.run_here(|c| {
                let work = c.all_reduce_async(vec![5i32], ReduceOp::Sum);
                // Waits for the kept call's turn, which the worker now gives it.
                (c.barrier(), work.wait())
            })
        });
        barrier.unwrap();
        assert_eq!(kept.unwrap(), [5]);
        assert!(worker_started(&comm));
        // A blocking call first is the one run here: the asynchronous one after goes to
        // the worker.
        let other = Arc::new(solo());
        let o = Arc::clone(&other);
        let (barrier, later) = within(move || {
            o.run_here(|c| {
                (
                    c.barrier(),
                    c.all_reduce_async(vec![6i64], ReduceOp::Sum).join(),
                )
            })
        });
        barrier.unwrap();
        assert_eq!(later.unwrap(), [6]);
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn a_queued_operation_never_runs_ahead_of_those_before_it() {
        let queue = Queue::new(0);
        let order = Arc::new(Mutex::new(Vec::new()));
        let (release, held) = channel::bounded::<()>(1);
        let (ran, second_ran) = channel::bounded::<()>(1);
        let o = Arc::clone(&order);
        let first = queue.submit(move || {
            // Held until the second has run (out of turn), or for a while if it does not.
            let _ = held.recv_timeout(PATIENCE);
            o.lock().unwrap().push(1);
            (Ok(()), ())
        });
        let o = Arc::clone(&order);
        let second = queue.submit(move || {
            o.lock().unwrap().push(2);
            let _ = ran.send(());
            (Ok(()), ())
        });
        std::thread::spawn(move || {
            let _ = second_ran.recv_timeout(Duration::from_millis(200));
            let _ = release.send(());
        });
        // What a device call's handle does where streams cannot wait on memory.
        within(move || {
            second.finished();
            second.join()
        })
        .unwrap();
        within(move || first.join()).unwrap();
        assert_eq!(*order.lock().unwrap(), [1, 2]);
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn a_queued_operation_that_panics_fails_its_handle_and_the_queue_goes_on() {
        let queue = Queue::new(0);
        let panics = queue.submit(|| -> (Result<()>, ()) { panic!("on purpose") });
        let after = queue.submit(|| (Ok(()), 7));
        match within(move || panics.join()) {
            Err(Error::Internal(why)) => assert!(why.contains("on purpose"), "{why}"),
            other => panic!("not the panic's error: {other:?}"),
        }
        assert_eq!(within(move || after.join()).unwrap(), 7);
    }

    #[test]
    fn a_call_kept_by_a_function_that_panics_still_runs() {
        let comm = Arc::new(solo());
        let (tx, rx) = channel::bounded(1);
        let c = Arc::clone(&comm);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            c.run_here(|c| {
                tx.send(c.all_reduce_async(vec![4u64], ReduceOp::Sum))
                    .unwrap();
                panic!("after issuing");
            })
        }));
        assert!(panicked.is_err());
        let work = rx.recv().unwrap();
        let outcome = within(move || work.join());
        assert_eq!(outcome.unwrap(), [4]);
    }
}
