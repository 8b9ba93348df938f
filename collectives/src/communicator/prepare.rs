//! The one way every collective is built: each entry point describes its call
//! (a [`CallInfo`] and its buffers) and [`Inner::prepare`] asks
//! [`crate::schedule::plan`], where every call's plan is decided, for its [`Plan`] (from the
//! tuner's table, which holds the topology the transport found), then the call runs in
//! issue order (`Inner::execute`) by its [`Route`]: messages through the transport, one
//! meeting in the shared-memory mailboxes (`mailbox.rs`), or directly on this
//! communicator's shared buffers (`shared.rs`).
//!
//! A training loop repeats the same few calls (same collective, type, size,
//! root and kind of buffer), so the plans of recent call shapes are kept: a repeated call
//! costs one lookup. Each decision is logged when it is made: the tuner's table at `info`
//! when the pick for that kind of call changes, one line at `debug` otherwise.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use chorus_kernels::DType;

use super::shared::WindowCall;
use super::CallInfo;
use super::{lock, CallKind, Inner};
use crate::executor::Buffers;
use crate::schedule::plan::{self, Messages, Placement, Plan, Shape};
use crate::tuner::Pick;
use crate::{Error, Result};

/// Decisions kept at most (a handful of gradient buckets and sync calls).
const KEEP: usize = 16;

/// The smallest call whose sends are lent when its buffers lie on huge pages: below it, a
/// call is over before a single copy's set-up pays (a W=2 broadcast of 256 KiB on huge
/// pages took 30-150 us lent against 20-60 through the slots; of 1 MiB, 45-190 against
/// 140-180).
const LEND_FROM: usize = 1 << 20;

/// One call, ready to run: what it is, the memory it works on (borrowed for `'a`) and how.
pub(crate) struct Call<'a> {
    pub info: CallInfo,
    pub bufs: Buffers<'a>,
    pub route: Route,
}

/// How a call runs.
pub(crate) enum Route {
    /// These messages, through the transport.
    Messages(Arc<Messages>),
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

/// The most recent plans, newest first.
#[derive(Debug, Default)]
pub(crate) struct Decisions {
    recent: Mutex<VecDeque<(Key, Plan)>>,
}

/// What a rank logs (debug) when a call writes its output with streaming stores.
const STREAMED: &str = "the output is written with streaming stores";

impl Decisions {
    /// The plan for `key`: the one made before, or `decide`'s, kept for next time.
    fn get_or_decide(&self, key: Key, decide: impl FnOnce() -> Result<Plan>) -> Result<Plan> {
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
        mut bufs: Buffers<'a>,
        counts: Option<(&[usize], &[usize])>,
    ) -> Result<Call<'a>> {
        bufs.lend(self.lending(&info, &bufs));
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
            (Plan::Messages(messages), _) => Route::Messages(messages),
            (Plan::Mailbox, _) => Route::Mailbox,
            (Plan::Window, Some(window)) => Route::Window(window),
            (Plan::Window, None) => {
                return Err(Error::Internal(format!(
                    "{} was routed to shared buffers it does not have",
                    info.kind.name()
                )))
            }
        };
        bufs.stream(matches!(route, Route::Messages(_)) && self.streams(&bufs));
        Ok(Call { info, bufs, route })
    }

    /// Which of call `info`'s buffers lend their sends to peers on this host (input,
    /// output): those on huge pages, where one copy beats two through the slots, and the
    /// input of an out-of-place broadcast's root with one receiver, whose core has its own
    /// copy to make while the receiver only reads. (With more ranks a receiver passes the
    /// message on, so the root's core is no longer the busiest, and reading 4 KiB pages
    /// straight from it slows the first receiver.) Only with
    /// `CHORUS_SHM_SINGLE_COPY` at its default, for calls of [`LEND_FROM`] bytes or more;
    /// asking the kernel about the pages costs a few microseconds.
    fn lending(&self, info: &CallInfo, bufs: &Buffers<'_>) -> [bool; 2] {
        let (input, output) = bufs.addresses();
        // Open only where this communicator lends (see `join`).
        let Some(pagemap) = &self.pagemap else {
            return [false; 2];
        };
        if input.len().max(output.len()) < LEND_FROM {
            return [false; 2];
        }
        let [in_huge, out_huge] = bufs.on_huge_pages(pagemap);
        let rank = self.config.rank;
        if in_huge || out_huge {
            tracing::debug!(
                rank,
                input = in_huge,
                output = out_huge,
                "sends from buffers on huge pages are lent"
            );
        }
        let copying_root = info.kind == CallKind::Broadcast
            && info.root == rank
            && input != output
            && self.config.world_size == 2;
        [in_huge || copying_root, out_huge]
    }

    /// Whether a call on `bufs` that sends messages writes its output with streaming stores:
    /// where this rank's input and output (the output alone where the input lies in it)
    /// reach [`stream_from`](Inner::stream_from) bytes.
    fn streams(&self, bufs: &Buffers<'_>) -> bool {
        let (input, output) = bufs.addresses();
        let inside = output.start <= input.start && input.end <= output.end;
        let bytes = match inside {
            true => output.len(),
            false => input.len() + output.len(),
        };
        let streams = self.stream_from.is_some_and(|from| bytes >= from);
        if streams {
            tracing::debug!(rank = self.config.rank, bytes, STREAMED);
        }
        streams
    }

    /// The plan of call `info` (on shared buffers when `on_windows`), its pick logged.
    fn decide(
        &self,
        info: &CallInfo,
        on_windows: bool,
        counts: Option<(&[usize], &[usize])>,
    ) -> Result<Plan> {
        let w = self.config.world_size;
        let collective = info.kind.collective();
        // nccl-tests' size: the buffer of all-reduce, broadcast and reduce, the whole
        // of the other collectives' blocks.
        let count = match (info.kind, counts) {
            (_, Some((send, _))) => send.iter().sum(),
            (
                CallKind::AllReduce | CallKind::Broadcast | CallKind::Reduce | CallKind::Barrier,
                _,
            ) => info.count,
            _ => info.count * w,
        };
        let shape = Shape {
            collective,
            count,
            elem: info.dtype.size(),
            root: info.root,
            chunk: self.chunk_elems(info.dtype),
            counts,
            on_windows,
        };
        let at = Placement {
            rank: self.config.rank,
            world: w,
            hosts: &self.hosts,
            // One machine without a transport.
            machines: self.transport.as_ref().map_or(1, |t| t.machines()),
            shared_memory: self.tuner.topology().shared_memory,
        };
        let (plan, pick) = plan::plan(&self.tuner, &shape, &at)?;
        self.log_pick(info.kind, &pick, || {
            let bytes = count * shape.elem;
            self.tuner.explain_call(collective, bytes, w, on_windows)
        });
        Ok(plan)
    }

    /// Logs `pick` for a call of `kind`: `table` at `info` when the pick for `kind` changed.
    fn log_pick(&self, kind: CallKind, pick: &Pick, table: impl FnOnce() -> String) {
        let rank = self.config.rank;
        if lock(&self.picks).insert(kind, pick.path) != Some(pick.path) {
            tracing::info!(rank, "{}", table());
        } else {
            tracing::debug!(rank, call = kind.name(), path = %pick, "tuner");
        }
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

    fn one_step(count: usize) -> Result<Plan> {
        let step = Step::Recv {
            peer: 1,
            into: crate::schedule::Loc::output(0..count),
        };
        Ok(Plan::Messages(Arc::new(Messages::of(vec![step], 4))))
    }

    fn steps(d: Result<Plan>) -> Arc<Messages> {
        match d {
            Ok(Plan::Messages(messages)) => messages,
            other => panic!("{other:?}"),
        }
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
        let d = kept.get_or_decide(on_windows, || Ok(Plan::Window));
        assert!(matches!(d, Ok(Plan::Window)), "{d:?}");
    }
}
