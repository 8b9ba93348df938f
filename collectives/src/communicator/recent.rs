//! Schedules of recent calls: a training loop repeats the same few calls
//! (same collective, type, size and root), which then skip the tuner and
//! the schedule build.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use chorus_kernels::DType;

use super::monitor::CallInfo;
use super::Kind;
use crate::schedule::Schedule;

/// Schedules kept at most (a handful of gradient buckets and sync calls).
const KEEP: usize = 16;

/// What a cached schedule depends on, besides the communicator itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Key {
    pub kind: Kind,
    pub dtype: DType,
    pub count: usize,
    pub root: usize,
}

impl Key {
    /// The key of a call (its operator does not change the schedule).
    pub fn of(info: &CallInfo) -> Key {
        Key {
            kind: info.kind,
            dtype: info.dtype,
            count: info.count,
            root: info.root,
        }
    }
}

/// The most recently built schedules, newest first.
#[derive(Debug, Default)]
pub(crate) struct Recent {
    schedules: Mutex<VecDeque<(Key, Arc<Schedule>)>>,
}

impl Recent {
    /// The schedule for `key`: the one built before, or `build`'s, kept for next time.
    pub fn get_or_build(&self, key: Key, build: impl FnOnce() -> Schedule) -> Arc<Schedule> {
        if let Some((_, hit)) = super::lock(&self.schedules).iter().find(|(k, _)| *k == key) {
            return hit.clone();
        }
        let built = Arc::new(build());
        let mut schedules = super::lock(&self.schedules);
        schedules.push_front((key, built.clone()));
        schedules.truncate(KEEP);
        built
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Step;

    fn key(count: usize) -> Key {
        Key {
            kind: Kind::AllReduce,
            dtype: DType::F32,
            count,
            root: 0,
        }
    }

    fn one_step(count: usize) -> Schedule {
        vec![Step::Recv {
            peer: 1,
            into: crate::schedule::Loc::output(0..count),
        }]
    }

    #[test]
    fn builds_once_per_key_and_forgets_the_oldest() {
        let recent = Recent::default();
        let first = recent.get_or_build(key(3), || one_step(3));
        let again = recent.get_or_build(key(3), || panic!("built twice"));
        assert!(Arc::ptr_eq(&first, &again));
        for count in 100..100 + KEEP {
            recent.get_or_build(key(count), || one_step(count));
        }
        let mut rebuilt = false;
        recent.get_or_build(key(3), || {
            rebuilt = true;
            one_step(3)
        });
        assert!(rebuilt, "the oldest schedule should have been dropped");
    }
}
