//! Requests: handles to posted sends and receives, and how callers wait on them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crate::TransportError;

const PENDING: u8 = 0;
const DONE: u8 = 1;
const FAILED: u8 = 2;

/// How long a waiter spins on the completion flag before it sleeps.
const SPIN: Duration = Duration::from_micros(50);

/// The shared completion state of one request, set once by the transport.
#[derive(Debug, Default)]
pub struct Completion {
    state: AtomicU8,
    /// Parts of the request still unfinished (see [`Request::in_parts`]).
    parts: AtomicUsize,
    error: OnceLock<TransportError>,
    /// Set once a waiter has left its thread in `waiter` to be unparked.
    parked: AtomicBool,
    waiter: Mutex<Option<Thread>>,
}

impl Completion {
    fn new(parts: usize) -> Completion {
        assert!(parts > 0, "a request has at least one part");
        Completion {
            parts: AtomicUsize::new(parts),
            ..Completion::default()
        }
    }

    /// Marks one part of the request done; the last completes it.
    pub fn part_done(&self) {
        let before = self.parts.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(before > 0, "more parts done than the request has");
        if before == 1 {
            self.complete(Ok(()));
        }
    }

    /// Marks the request done, or failed with `error`, and wakes its waiter.
    ///
    /// Only the first call has an effect.
    pub fn complete(&self, result: Result<(), TransportError>) {
        if self.state.load(Ordering::Acquire) != PENDING {
            return;
        }
        let state = match result {
            Ok(()) => DONE,
            Err(e) => {
                // Set before the state says FAILED. Two racing failures may report either error.
                let _ = self.error.set(e);
                FAILED
            }
        };
        let won = self
            .state
            .compare_exchange(PENDING, state, Ordering::SeqCst, Ordering::Acquire)
            .is_ok();
        // Sequentially consistent with the waiter's `parked` store and state load: either it
        // sees the new state before it parks, or this sees `parked` and unparks it.
        if won && self.parked.load(Ordering::SeqCst) {
            if let Some(thread) = lock(&self.waiter).take() {
                thread.unpark();
            }
        }
    }

    fn poll(&self) -> Option<Result<(), TransportError>> {
        match self.state.load(Ordering::Acquire) {
            PENDING => None,
            DONE => Some(Ok(())),
            _ => Some(Err(self.error.get().cloned().unwrap_or_else(|| {
                TransportError::Aborted("request failed".into())
            }))),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What a waiter that stopped spinning does next (see [`Progress::idle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Idle {
    /// The transport slept the waiter until bytes could move and moved them: look again.
    Again,
    /// The transport has handed the work to its background thread: park until completion.
    Park,
}

/// Lets a waiting thread move bytes itself, while it spins and while it sleeps,
/// instead of waiting for a progress thread to be scheduled.
pub trait Progress: Send + Sync + std::fmt::Debug {
    /// Serves the connections to `peer` once, without blocking.
    fn poll(&self, peer: usize);

    /// Called when a waiter on `peer` stops spinning; `done()` tells whether its request has
    /// settled. Either sleeps the waiter until this transport's connections can move bytes or
    /// some request settles (or `until`, or a few milliseconds, pass) and moves them
    /// ([`Idle::Again`]), or makes whatever moves bytes in the background take over now
    /// ([`Idle::Park`]: the waiter parks its thread until the request completes).
    fn idle(&self, peer: usize, until: Instant, done: &dyn Fn() -> bool) -> Idle;
}

/// Completions kept for reuse, so that a small message costs no allocation: the oldest kept
/// is handed out again once nothing but the pool refers to it (its request and the
/// transport's queues have let go of it).
#[derive(Default)]
pub struct CompletionPool {
    kept: VecDeque<Arc<Completion>>,
}

impl std::fmt::Debug for CompletionPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CompletionPool({} kept)", self.kept.len())
    }
}

impl CompletionPool {
    /// Completions kept at most: more than a call has requests in flight, usually.
    const KEEP: usize = 64;

    /// A pending completion of `parts` parts.
    fn take(&mut self, parts: usize) -> Arc<Completion> {
        let completion = match self.kept.front_mut().and_then(Arc::get_mut) {
            Some(free) => {
                *free = Completion::new(parts);
                self.kept.pop_front().expect("the front exists")
            }
            None => Arc::new(Completion::new(parts)),
        };
        self.kept.push_back(completion.clone());
        if self.kept.len() > Self::KEEP {
            self.kept.pop_front();
        }
        completion
    }
}

/// Which direction a request moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// A posted send.
    Send,
    /// A posted receive.
    Recv,
}

impl Direction {
    /// `"send"` or `"recv"`, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Direction::Send => "send",
            Direction::Recv => "recv",
        }
    }
}

/// A handle to a posted send or receive.
#[derive(Debug, Clone)]
pub struct Request {
    completion: Arc<Completion>,
    peer: usize,
    direction: Direction,
    len: usize,
    progress: Option<Arc<dyn Progress>>,
}

impl Request {
    /// A new pending request and the completion the transport will set.
    pub fn new(peer: usize, direction: Direction, len: usize) -> (Request, Arc<Completion>) {
        Request::in_parts(peer, direction, len, 1)
    }

    /// A new pending request that completes when [`Completion::part_done`] has been called
    /// `parts` times (a message striped over several sockets), or on the first failure.
    pub fn in_parts(
        peer: usize,
        direction: Direction,
        len: usize,
        parts: usize,
    ) -> (Request, Arc<Completion>) {
        Request::around(Arc::new(Completion::new(parts)), peer, direction, len)
    }

    /// Like [`in_parts`](Self::in_parts), with a completion from `pool`.
    #[inline]
    pub fn pooled(
        pool: &mut CompletionPool,
        peer: usize,
        direction: Direction,
        len: usize,
        parts: usize,
    ) -> (Request, Arc<Completion>) {
        Request::around(pool.take(parts), peer, direction, len)
    }

    fn around(
        completion: Arc<Completion>,
        peer: usize,
        direction: Direction,
        len: usize,
    ) -> (Request, Arc<Completion>) {
        let req = Request {
            completion: completion.clone(),
            peer,
            direction,
            len,
            progress: None,
        };
        (req, completion)
    }

    /// Lets waiters drive `progress` while they wait.
    pub fn with_progress(mut self, progress: Arc<dyn Progress>) -> Request {
        self.progress = Some(progress);
        self
    }

    /// The peer rank this request talks to.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// Whether this is a send or a receive.
    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// The request's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the request moves no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The outcome if the request has finished, without blocking.
    pub fn test(&self) -> Option<Result<(), TransportError>> {
        self.completion.poll()
    }

    /// Blocks until the request finishes or `deadline` passes.
    ///
    /// Spins briefly, moving bytes itself through the request's progress hook
    /// (small messages finish within microseconds), then sleeps until the
    /// transport's connections can move bytes and moves them itself, or, where
    /// the transport cannot do that, parks the thread. Fails with the request's
    /// own error, or `Timeout` naming the peer; after a timeout the caller must
    /// abort the transport before it reuses the request's buffer.
    pub fn wait(&self, deadline: Instant) -> Result<(), TransportError> {
        if let Some(result) = self.completion.poll() {
            return result;
        }
        // A small message has often arrived by now: look before reading the clock.
        if let Some(progress) = &self.progress {
            progress.poll(self.peer);
            if let Some(result) = self.completion.poll() {
                return result;
            }
        }
        let start = Instant::now();
        let spin_until = start + SPIN;
        loop {
            if let Some(result) = self.completion.poll() {
                return result;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TransportError::Timeout {
                    peer: self.peer,
                    op: self.direction.name(),
                    len: self.len,
                    waited: now - start,
                });
            }
            if now < spin_until {
                match &self.progress {
                    Some(progress) => progress.poll(self.peer),
                    None => std::hint::spin_loop(),
                }
                continue;
            }
            if let Some(progress) = &self.progress {
                let done = || self.completion.poll().is_some();
                if progress.idle(self.peer, deadline, &done) == Idle::Again {
                    continue;
                }
            }
            *lock(&self.completion.waiter) = Some(std::thread::current());
            self.completion.parked.store(true, Ordering::SeqCst);
            if self.completion.state.load(Ordering::SeqCst) == PENDING {
                std::thread::park_timeout(deadline - now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completes_from_another_thread() {
        let (req, completion) = Request::new(3, Direction::Recv, 8);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            completion.complete(Ok(()));
        });
        req.wait(Instant::now() + Duration::from_secs(10)).unwrap();
        // The wait ended because the request completed, not before.
        assert!(matches!(req.test(), Some(Ok(()))));
        t.join().unwrap();
    }

    #[test]
    fn a_completion_racing_the_waiters_park_is_never_lost() {
        let (tx, rx) = std::sync::mpsc::channel::<(Arc<Completion>, Duration)>();
        let completer = std::thread::spawn(move || {
            for (completion, delay) in rx {
                let at = Instant::now() + delay;
                while Instant::now() < at {
                    std::hint::spin_loop();
                }
                completion.complete(Ok(()));
            }
        });
        for i in 0..2000u64 {
            let (req, completion) = Request::new(1, Direction::Recv, 8);
            // Around the end of the spin phase, where the waiter parks.
            let delay = SPIN + Duration::from_micros(i % 40) - Duration::from_micros(20);
            tx.send((completion, delay)).expect("completer alive");
            let start = Instant::now();
            req.wait(start + Duration::from_secs(5)).expect("completed");
            // A lost wake-up parks the waiter until its deadline.
            assert!(
                start.elapsed() < Duration::from_secs(4),
                "wake-up lost at {i}"
            );
        }
        drop(tx);
        completer.join().expect("completer");
    }

    #[test]
    fn times_out_naming_the_peer() {
        let (req, _completion) = Request::new(5, Direction::Send, 64);
        let err = req
            .wait(Instant::now() + Duration::from_millis(20))
            .unwrap_err();
        assert!(matches!(
            err,
            TransportError::Timeout {
                peer: 5,
                op: "send",
                len: 64,
                ..
            }
        ));
        assert!(err.to_string().contains("rank 5"), "{err}");
    }

    #[test]
    fn a_pooled_completion_is_reused_only_once_free() {
        let mut pool = CompletionPool::default();
        let (busy, busy_done) = Request::pooled(&mut pool, 1, Direction::Send, 8, 1);
        // The oldest is still held by its request and the transport: a new one is made.
        let (other, other_done) = Request::pooled(&mut pool, 1, Direction::Recv, 8, 2);
        assert!(!Arc::ptr_eq(&busy_done, &other_done));
        busy_done.complete(Err(TransportError::PeerClosed { peer: 1 }));
        assert!(busy.test().is_some_and(|r| r.is_err()));
        let first = Arc::as_ptr(&busy_done);
        drop((busy, busy_done));
        // Now free: handed out again, pending and without the old error.
        let (again, again_done) = Request::pooled(&mut pool, 2, Direction::Send, 4, 1);
        assert_eq!(Arc::as_ptr(&again_done), first);
        assert!(again.test().is_none());
        again_done.complete(Ok(()));
        assert!(matches!(again.test(), Some(Ok(()))));
        // The request still in flight was left alone: it needs both of its parts.
        other_done.part_done();
        assert!(other.test().is_none());
        other_done.part_done();
        assert!(matches!(other.test(), Some(Ok(()))));
    }

    #[test]
    fn first_outcome_wins() {
        let (req, completion) = Request::new(1, Direction::Recv, 0);
        completion.complete(Err(TransportError::PeerClosed { peer: 1 }));
        completion.complete(Ok(()));
        assert!(matches!(
            req.test(),
            Some(Err(TransportError::PeerClosed { peer: 1 }))
        ));
    }
}
