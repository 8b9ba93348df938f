//! Stream order for asynchronous device calls.
//!
//! Each asynchronous call gets the next value of a completion counter when it is issued, and
//! its completion event is recorded then, on Chorus's completion stream, behind a stream
//! wait for the counter to reach that value. Chorus's thread runs the call later and, when
//! the call ends (done, failed, or dropped unrun), marks its value complete; the counter
//! advances over every value whose call and all earlier ones have ended. So a stream told
//! to wait on a call's event runs on once the call and every call before it are over, and
//! never waits forever on a call that failed.
//!
//! The device compares the counter with a waited value cyclically (CUDA's
//! `CU_STREAM_WAIT_VALUE_GEQ`: `(int64_t)(counter - value) >= 0`), so every value waited
//! for is released by a counter at or a little past it, never by one far past it: a
//! counter of `u64::MAX` releases no wait for a small value.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use chorus_kernels::cuda::order::MappedCounter;

use crate::communicator::lock;

/// The counter's memory: device-readable in a communicator, plain memory in tests.
pub(crate) trait CounterMemory: Send + Sync {
    /// The counter.
    fn value(&self) -> &AtomicU64;
}

impl CounterMemory for MappedCounter {
    fn value(&self) -> &AtomicU64 {
        MappedCounter::value(self)
    }
}

/// The host side of a completion counter: one value per call, in issue order.
pub(crate) struct Completions<M> {
    memory: M,
    state: Mutex<Counting>,
}

#[derive(Default)]
struct Counting {
    /// The last value handed out.
    issued: u64,
    /// Values whose calls ended while an earlier call had not.
    ended_early: BTreeSet<u64>,
    /// Whether [`Completions::release_all`] has set the counter to the last value.
    released: bool,
}

impl<M: CounterMemory> Completions<M> {
    pub(crate) fn new(memory: M) -> Arc<Completions<M>> {
        Arc::new(Completions {
            memory,
            state: Mutex::new(Counting::default()),
        })
    }

    /// The next call's place: its value, marked complete when the place is dropped.
    pub(crate) fn issue(self: &Arc<Self>) -> Completion<M> {
        let mut state = lock(&self.state);
        state.issued += 1;
        Completion {
            completions: Arc::clone(self),
            value: state.issued,
        }
    }

    /// The counter: every call up to this value has ended.
    #[cfg(test)]
    fn completed(&self) -> u64 {
        self.memory.value().load(Ordering::Acquire)
    }

    /// The counter's memory.
    pub(crate) fn memory(&self) -> &M {
        &self.memory
    }

    /// Sets the counter to the last value handed out, releasing every wait whether its call
    /// ended or not, for when no call will run again.
    pub(crate) fn release_all(&self) {
        let mut state = lock(&self.state);
        state.released = true;
        self.memory.value().store(state.issued, Ordering::Release);
    }

    /// Marks `value`'s call ended, and advances the counter over every ended call that
    /// follows the calls already counted.
    fn end(&self, value: u64) {
        let mut state = lock(&self.state);
        if state.released {
            return;
        }
        let counter = self.memory.value();
        let mut reached = counter.load(Ordering::Acquire);
        if value != reached + 1 {
            state.ended_early.insert(value);
            return;
        }
        reached = value;
        while state.ended_early.remove(&(reached + 1)) {
            reached += 1;
        }
        counter.store(reached, Ordering::Release);
    }
}

/// One call's place in the completion order; marks the call ended when dropped, whether it
/// ran, failed or never ran.
pub(crate) struct Completion<M: CounterMemory> {
    completions: Arc<Completions<M>>,
    value: u64,
}

impl<M: CounterMemory> Completion<M> {
    /// The counter value that says this call, and every earlier one, has ended.
    pub(crate) fn value(&self) -> u64 {
        self.value
    }
}

impl<M: CounterMemory> Drop for Completion<M> {
    fn drop(&mut self) {
        self.completions.end(self.value);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    impl CounterMemory for AtomicU64 {
        fn value(&self) -> &AtomicU64 {
            self
        }
    }

    /// Stands in for a stream waiting on the counter: a thread that polls it and compares
    /// as the GPU does (cyclically), and reports whether it reached `value` within a few
    /// seconds.
    fn stream_wait(
        completions: &Arc<Completions<AtomicU64>>,
        value: u64,
    ) -> std::thread::JoinHandle<bool> {
        let completions = Arc::clone(completions);
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(20);
            while (completions.completed().wrapping_sub(value) as i64) < 0 {
                if Instant::now() > deadline {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            true
        })
    }

    #[test]
    fn values_follow_issue_order_and_the_counter_follows_completion() {
        let completions = Completions::new(AtomicU64::new(0));
        let calls: Vec<_> = (0..4).map(|_| completions.issue()).collect();
        let values: Vec<u64> = calls.iter().map(Completion::value).collect();
        assert_eq!(values, [1, 2, 3, 4]);
        assert_eq!(completions.completed(), 0);
        let mut calls = calls.into_iter();
        drop(calls.next());
        assert_eq!(completions.completed(), 1);
        drop(calls.next());
        assert_eq!(completions.completed(), 2);
    }

    #[test]
    fn a_call_ended_early_counts_only_once_the_calls_before_it_have() {
        let completions = Completions::new(AtomicU64::new(0));
        let (first, second, third) = (
            completions.issue(),
            completions.issue(),
            completions.issue(),
        );
        drop(third);
        drop(second);
        assert_eq!(
            completions.completed(),
            0,
            "the first call is still running"
        );
        drop(first);
        assert_eq!(completions.completed(), 3);
    }

    #[test]
    fn a_stream_waiting_on_a_failed_or_unrun_call_is_released() {
        let completions = Completions::new(AtomicU64::new(0));
        let failed = completions.issue();
        let unrun = completions.issue();
        let waiting = stream_wait(&completions, unrun.value());
        // The first call fails: its body returns an error and drops its place. The second
        // is dropped without running (its communicator went away).
        let body = move || -> Result<(), &'static str> {
            let _place = failed;
            Err("a peer failed")
        };
        assert!(body().is_err());
        drop(unrun);
        assert!(waiting.join().unwrap(), "the stream was never released");
    }

    #[test]
    fn releasing_all_lets_every_waiting_stream_on_however_the_device_compares() {
        let completions = Completions::new(AtomicU64::new(0));
        let calls: Vec<_> = (0..3).map(|_| completions.issue()).collect();
        let waiting: Vec<_> = calls
            .iter()
            .map(|call| stream_wait(&completions, call.value()))
            .collect();
        // The communicator goes away with none of the calls run.
        completions.release_all();
        for (i, waiting) in waiting.into_iter().enumerate() {
            assert!(
                waiting.join().unwrap(),
                "the wait of call {i} was never released"
            );
        }
        // Calls dropped after the release leave the counter where the release set it.
        drop(calls);
        assert_eq!(completions.completed(), 3);
    }
}
