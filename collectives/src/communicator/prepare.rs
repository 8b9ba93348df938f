//! The one way every collective is built: each entry point describes its call
//! (a [`CallInfo`] and its buffers) and [`Inner::prepare`] makes the one
//! decision, the [`Route`] and its algorithm, from the tuner's table
//! ([`crate::tuner`], which holds the topology the transport found), then the
//! call runs in issue order (`Inner::execute`).
//!
//! The routes:
//! - [`Route::Messages`]: the schedule of the picked algorithm (ring, tree,
//!   recursive doubling or halving, direct, hierarchical across hosts, or a
//!   barrier's dissemination), run by the executor over the transport.
//! - [`Route::Mailbox`]: every rank on one host and a small call (or a
//!   barrier): one meeting in the shared-memory mailboxes (`mailbox.rs`).
//! - [`Route::Window`]: the buffers are this communicator's shared buffers;
//!   peers read and write them directly between meetings (`shared.rs`).
//!
//! A training loop repeats the same few calls (same collective, type, size,
//! root and kind of buffer), so the decision and the schedule of recent call
//! shapes are kept: a repeated call costs one lookup. Each decision is logged
//! when it is made: the tuner's table at `info` when the pick for that kind of
//! call changes, one line at `debug` otherwise.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use chorus_kernels::DType;

use super::shared::WindowCall;
use super::CallInfo;
use super::{lock, CallKind, Inner};
use crate::algorithm::{Algorithm, Collective, Path};
use crate::executor::Buffers;
use crate::schedule::{all_to_all, barrier, hierarchical, Schedule};
use crate::tuner::Plan;
use crate::{Error, Result};

/// Decisions kept at most (a handful of gradient buckets and sync calls).
const KEEP: usize = 16;

/// One call, ready to run: what it is, the memory it works on (borrowed for `'a`) and how.
pub(crate) struct Call<'a> {
    pub info: CallInfo,
    pub bufs: Buffers<'a>,
    pub route: Route,
}

/// How a call runs.
pub(crate) enum Route {
    /// This schedule, as messages through the transport.
    Messages(Arc<Schedule>),
    /// One meeting in the shared-memory mailboxes.
    Mailbox,
    /// Directly on these shared buffers.
    Window(WindowCall),
}

/// What a kept decision depends on, besides the communicator itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    kind: CallKind,
    dtype: DType,
    count: usize,
    root: usize,
    on_windows: bool,
}

/// A decision as kept: the route without this call's buffers.
#[derive(Debug, Clone)]
enum Decided {
    Messages(Arc<Schedule>),
    Mailbox,
    Window,
}

/// The most recent decisions, newest first.
#[derive(Debug, Default)]
pub(crate) struct Decisions {
    recent: Mutex<VecDeque<(Key, Decided)>>,
}

impl Decisions {
    /// The decision for `key`: the one made before, or `decide`'s, kept for next time.
    fn get_or_decide(&self, key: Key, decide: impl FnOnce() -> Result<Decided>) -> Result<Decided> {
        if let Some((_, hit)) = lock(&self.recent).iter().find(|(k, _)| *k == key) {
            return Ok(hit.clone());
        }
        let decided = decide()?;
        let mut recent = lock(&self.recent);
        recent.push_front((key, decided.clone()));
        recent.truncate(KEEP);
        Ok(decided)
    }
}

/// The tuner's name for the collective `kind` is (`None`: a barrier).
fn collective(kind: CallKind) -> Option<Collective> {
    match kind {
        CallKind::AllReduce => Some(Collective::AllReduce),
        CallKind::Broadcast => Some(Collective::Broadcast),
        CallKind::Reduce => Some(Collective::Reduce),
        CallKind::AllGather => Some(Collective::AllGather),
        CallKind::ReduceScatter => Some(Collective::ReduceScatter),
        CallKind::AllToAll => Some(Collective::AllToAll),
        CallKind::Gather => Some(Collective::Gather),
        CallKind::Scatter => Some(Collective::Scatter),
        CallKind::Barrier | CallKind::PointToPoint => None,
    }
}

impl Inner {
    /// Call `info` on `bufs`, ready to run: the route and algorithm the tuner picks.
    pub(super) fn prepare<'a>(&self, info: CallInfo, bufs: Buffers<'a>) -> Result<Call<'a>> {
        self.prepare_with(info, bufs, None)
    }

    /// As [`prepare`](Self::prepare), for an all-to-all with per-rank `counts` (to send,
    /// to receive): its schedule is built for each call, since counts may change.
    pub(super) fn prepare_with<'a>(
        &self,
        info: CallInfo,
        bufs: Buffers<'a>,
        counts: Option<(&[usize], &[usize])>,
    ) -> Result<Call<'a>> {
        let window = self.window_call(&info, &bufs);
        let key = Key {
            kind: info.kind,
            dtype: info.dtype,
            count: info.count,
            root: info.root,
            on_windows: window.is_some(),
        };
        let decide = || self.decide(&info, key.on_windows, counts);
        let decided = match counts {
            Some(_) => decide()?,
            None => self.decisions.get_or_decide(key, decide)?,
        };
        let route = match (decided, window) {
            (Decided::Messages(steps), _) => Route::Messages(steps),
            (Decided::Mailbox, _) => Route::Mailbox,
            (Decided::Window, Some(window)) => Route::Window(window),
            (Decided::Window, None) => {
                return Err(Error::Internal(format!(
                    "{} was routed to shared buffers it does not have",
                    info.kind.name()
                )))
            }
        };
        Ok(Call { info, bufs, route })
    }

    /// The tuner's pick for call `info` (on shared buffers when `on_windows`), logged,
    /// with the schedule it runs when it runs as messages.
    fn decide(
        &self,
        info: &CallInfo,
        on_windows: bool,
        counts: Option<(&[usize], &[usize])>,
    ) -> Result<Decided> {
        let (rank, w) = (self.config.rank, self.config.world_size);
        let c = collective(info.kind);
        // nccl-tests' size: the buffer of all-reduce, broadcast and reduce, the whole
        // of the other collectives' blocks.
        let elems = match (info.kind, counts) {
            (_, Some((send, _))) => send.iter().sum(),
            (
                CallKind::AllReduce | CallKind::Broadcast | CallKind::Reduce | CallKind::Barrier,
                _,
            ) => info.count,
            _ => info.count * w,
        };
        let bytes = elems * info.dtype.size();
        let plan = self.tuner.plan(c, bytes, w, on_windows);
        self.log_pick(info.kind, &plan, || {
            self.tuner.explain_call(c, bytes, w, on_windows)
        });
        let algorithm = match plan.path {
            Path::Mailbox => return Ok(Decided::Mailbox),
            Path::Window => return Ok(Decided::Window),
            Path::Messages(a) => a,
        };
        let shared = self.tuner.topology().shared_memory;
        let chunk = chunk_for(c, w, elems, shared, self.chunk_elems(info.dtype));
        let steps = match (c, algorithm, counts) {
            (None, _, _) => barrier::dissemination(rank, w),
            (_, _, Some((send, recv))) => all_to_all::pairwise(rank, w, send, recv),
            (_, Algorithm::Hierarchical, _) => {
                hierarchical::all_reduce_on(rank, &self.hosts, info.count, chunk)
            }
            (Some(c), a, None) => {
                // One machine without a transport.
                let machines = self.transport.as_ref().map_or(1, |t| t.machines());
                let ready_above = crate::cost::ready_above(machines, info.dtype.size());
                crate::cost::schedule_for(c, a, rank, w, elems, chunk, info.root, ready_above)
                    .ok_or_else(|| {
                        Error::Internal(format!(
                            "the tuner offered {a:?}, which has no {c:?} schedule"
                        ))
                    })?
            }
        };
        Ok(Decided::Messages(Arc::new(steps)))
    }

    /// Logs `plan` for a call of `kind`: `table` at `info` when the pick for `kind` changed.
    fn log_pick(&self, kind: CallKind, plan: &Plan, table: impl FnOnce() -> String) {
        let rank = self.config.rank;
        if lock(&self.picks).insert(kind, plan.path) != Some(plan.path) {
            tracing::info!(rank, "{}", table());
        } else {
            tracing::debug!(rank, call = kind.name(), path = %plan, "tuner");
        }
    }
}

/// The pipeline chunk of call `c` on `elems` elements over `world` ranks: `configured`,
/// but a broadcast between two ranks that share memory goes as one message. Two ranks relay
/// nothing, and over shared memory the receiver copies the whole message straight from the
/// root's buffer; over sockets chunks move faster (W=2, 64 MiB, in place: 3.8-6.0 GB/s
/// against 2.3-3.5 whole).
fn chunk_for(
    c: Option<Collective>,
    world: usize,
    elems: usize,
    shared_memory: bool,
    configured: usize,
) -> usize {
    match c {
        Some(Collective::Broadcast) if world == 2 && shared_memory => elems.max(1),
        _ => configured,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Step;

    fn key(count: usize) -> Key {
        Key {
            kind: CallKind::AllReduce,
            dtype: DType::F32,
            count,
            root: 0,
            on_windows: false,
        }
    }

    fn one_step(count: usize) -> Result<Decided> {
        Ok(Decided::Messages(Arc::new(vec![Step::Recv {
            peer: 1,
            into: crate::schedule::Loc::output(0..count),
        }])))
    }

    fn steps(d: Result<Decided>) -> Arc<Schedule> {
        match d {
            Ok(Decided::Messages(steps)) => steps,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_broadcast_between_two_ranks_is_one_message_on_shared_memory_only() {
        let bcast = Some(Collective::Broadcast);
        assert_eq!(chunk_for(bcast, 2, 1 << 24, true, 1 << 17), 1 << 24);
        assert_eq!(chunk_for(bcast, 2, 0, true, 1 << 17), 1);
        assert_eq!(chunk_for(bcast, 2, 1 << 24, false, 1 << 17), 1 << 17);
        assert_eq!(chunk_for(bcast, 3, 1 << 24, true, 1 << 17), 1 << 17);
        let all_reduce = Some(Collective::AllReduce);
        assert_eq!(chunk_for(all_reduce, 2, 1 << 24, true, 1 << 17), 1 << 17);
        assert_eq!(chunk_for(None, 2, 0, true, 1 << 17), 1 << 17);
    }

    #[test]
    fn decides_once_per_key_and_forgets_the_oldest() {
        let kept = Decisions::default();
        let first = steps(kept.get_or_decide(key(3), || one_step(3)));
        let again = steps(kept.get_or_decide(key(3), || panic!("decided twice")));
        assert!(Arc::ptr_eq(&first, &again));
        for count in 100..100 + KEEP {
            steps(kept.get_or_decide(key(count), || one_step(count)));
        }
        let mut again = false;
        steps(kept.get_or_decide(key(3), || {
            again = true;
            one_step(3)
        }));
        assert!(again, "the oldest decision should have been dropped");
    }

    #[test]
    fn a_failed_decision_is_returned_and_not_kept() {
        let kept = Decisions::default();
        let failed = kept.get_or_decide(key(3), || Err(Error::Internal("no schedule".into())));
        assert!(matches!(failed, Err(Error::Internal(_))), "{failed:?}");
        let mut decided = false;
        steps(kept.get_or_decide(key(3), || {
            decided = true;
            one_step(3)
        }));
        assert!(decided, "a failure must not be kept as the decision");
    }

    #[test]
    fn calls_on_shared_buffers_are_kept_apart() {
        let kept = Decisions::default();
        steps(kept.get_or_decide(key(3), || one_step(3)));
        let on_windows = Key {
            on_windows: true,
            ..key(3)
        };
        let d = kept.get_or_decide(on_windows, || Ok(Decided::Window));
        assert!(matches!(d, Ok(Decided::Window)), "{d:?}");
    }

    #[test]
    fn every_collective_has_the_tuners_name_but_barriers_and_send_recv() {
        for kind in CallKind::ALL {
            match kind {
                CallKind::Barrier | CallKind::PointToPoint => assert_eq!(collective(kind), None),
                _ => {
                    let c = collective(kind).expect("a collective");
                    assert_eq!(c.name(), kind.name().replace('_', ""));
                }
            }
        }
    }
}
