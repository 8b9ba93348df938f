//! The executor: runs any schedule over any transport.
//!
//! [`machine`] decides what to do (post, wait, reduce, copy) from the steps'
//! data dependencies; [`drive`] does it over a transport, with the caller's
//! buffers, the deadline and the watchdog; the tests' `in_memory` driver runs
//! every rank's machine in one process; the cost evaluator
//! ([`crate::cost::simulate`]) runs every rank's machine in simulated time.

mod buffers;
mod drive;
#[cfg(test)]
mod in_memory;
mod machine;

use std::time::Instant;

use chorus_kernels::{DType, ReduceOp};
use chorus_transport::{Request, Transport};

use crate::Error;

pub use buffers::Buffers;
pub(crate) use drive::{execute, failed};
#[cfg(test)]
pub(crate) use machine::Reduce;
pub(crate) use machine::{Action, Dest, Layout, Machine, Program};

/// What a driver did with its machine's actions, as the tests compare drivers: every action
/// but a wait (how many waits there are depends on when requests complete), and every
/// staged chunk reduced.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Did {
    Act(Action),
    Reduced(Reduce),
}

#[cfg(test)]
impl Did {
    /// `action`, unless it is a wait.
    pub(crate) fn act(action: Action) -> Option<Did> {
        (!matches!(action, Action::Wait { .. })).then_some(Did::Act(action))
    }
}

/// Staging slots a call uses (receive-and-reduce chunks in flight at once): the pipeline
/// depth of the communicator, and the cost evaluator's default.
pub(crate) const PIPELINE_DEPTH: usize = 4;

/// Memory the executor keeps between calls: staging slots for chunks that
/// are reduced on arrival, the scratch buffer schedules may use, and the
/// machine with its queues (empty between calls).
#[derive(Debug, Default)]
pub struct Workspace {
    slots: Vec<Vec<u8>>,
    scratch: Vec<u8>,
    machine: Machine<Request>,
}

impl Workspace {
    /// Makes sure there are at least `depth` slots of `slot_bytes` and `scratch_bytes` of
    /// scratch (what an earlier call made stays, for the next call that needs it).
    fn reserve(&mut self, depth: usize, slot_bytes: usize, scratch_bytes: usize) {
        if self.slots.len() < depth.max(1) {
            self.slots.resize_with(depth.max(1), Vec::new);
        }
        for slot in &mut self.slots[..depth.max(1)] {
            if slot.len() < slot_bytes {
                slot.resize(slot_bytes, 0);
            }
        }
        if self.scratch.len() < scratch_bytes {
            self.scratch.resize(scratch_bytes, 0);
        }
    }
}

/// What one collective call operates on.
pub struct Job<'a> {
    /// The transport to the other ranks (`None` for a world of one).
    pub transport: Option<&'a dyn Transport>,
    /// This process's rank (named by the call's errors).
    pub rank: usize,
    /// The tag on every message of this call.
    pub tag: u64,
    /// Element type.
    pub dtype: DType,
    /// Reduction operator (for `RecvReduce` and `Finish`).
    pub op: ReduceOp,
    /// Number of ranks (the divisor of `Avg`).
    pub world_size: usize,
    /// When every wait gives up.
    pub deadline: Instant,
    /// Most receive-and-reduce chunks in flight at once.
    pub depth: usize,
    /// Watches the call: told when it stalls, and asked to explain a failure.
    pub watch: Option<&'a dyn Watch>,
}

/// A watchdog over one call.
pub trait Watch {
    /// When a wait still pending should be reported as stalled (`None`: never).
    fn warn_at(&self) -> Option<Instant>;
    /// Called once, when a wait outlasts [`warn_at`](Self::warn_at): the call goes on waiting,
    /// unless this names a peer found gone (its host answers nothing), which fails the wait.
    fn stalled(&self) -> Option<chorus_transport::TransportError>;
    /// Turns a failure into the error to report, before the transport is aborted.
    fn failed(&self, error: Error) -> Error;
}

#[cfg(test)]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use chorus_transport::{Payload, TransportError};

    use super::*;
    use crate::schedule::plan::Messages;
    use crate::schedule::{Buf, Loc, Step};

    /// A transport whose requests never complete (`stuck`) or complete at once; records
    /// whether each send was lent and whether it was aborted.
    #[derive(Default)]
    struct Fake {
        stuck: bool,
        lent: std::sync::Mutex<Vec<bool>>,
        aborted: AtomicBool,
    }

    impl Fake {
        fn stuck() -> Fake {
            Fake {
                stuck: true,
                ..Fake::default()
            }
        }
    }

    impl Transport for Fake {
        fn rank(&self) -> usize {
            0
        }

        fn world_size(&self) -> usize {
            2
        }

        unsafe fn post(
            &self,
            peer: usize,
            _: u64,
            payload: Payload<'_>,
        ) -> Result<Request, TransportError> {
            self.lent.lock().unwrap().push(payload.lent());
            let (request, completion) = Request::new(peer, payload.direction(), payload.len());
            if !self.stuck {
                completion.complete(Ok(()));
            }
            Ok(request)
        }

        fn probe(&self, _: usize) -> Result<Option<(u64, usize)>, TransportError> {
            Ok(None)
        }

        fn abort(&self, _: &str) {
            self.aborted.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn sends_from_the_callers_buffers_are_lent_as_marked() {
        let input = [1u8; 8];
        let mut out = [0u8; 8];
        let steps: Vec<Step> = [Buf::Input, Buf::Output, Buf::Scratch]
            .into_iter()
            .map(|buf| Step::Send {
                peer: 1,
                from: Loc { buf, range: 0..8 },
            })
            .chain([Step::Fence])
            .collect();
        for lent in [[true, false], [false, true], [false, false]] {
            let transport = Fake::default();
            let mut bufs = Buffers::new(Some(&input), &mut out);
            bufs.lend(lent);
            let deadline = Instant::now() + Duration::from_secs(60);
            execute(
                &job(Some(&transport), deadline, None),
                &bufs,
                &Messages::of(steps.clone(), 1),
                &mut Workspace::default(),
            )
            .unwrap();
            let posted = transport.lent.into_inner().unwrap();
            assert_eq!(posted, [lent[0], lent[1], false]);
        }
    }

    /// A watchdog that panics when told of a stall, which it reports at once.
    struct PanicsWhenStalled;

    impl Watch for PanicsWhenStalled {
        fn warn_at(&self) -> Option<Instant> {
            Some(Instant::now())
        }

        fn stalled(&self) -> Option<TransportError> {
            panic!("stalled");
        }

        fn failed(&self, error: Error) -> Error {
            error
        }
    }

    /// A call of rank 0 in a world of two on `transport`, of bytes summed.
    fn job<'a>(
        transport: Option<&'a dyn Transport>,
        deadline: Instant,
        watch: Option<&'a dyn Watch>,
    ) -> Job<'a> {
        Job {
            transport,
            rank: 0,
            tag: 1,
            dtype: DType::U8,
            op: ReduceOp::Sum,
            world_size: 2,
            deadline,
            depth: 1,
            watch,
        }
    }

    /// Runs a receive into the whole of `out` on `transport`, then waits for it.
    fn receive(
        transport: &Fake,
        deadline: Instant,
        watch: Option<&dyn Watch>,
        out: &mut [u8],
    ) -> Result<(), Error> {
        let into = Loc {
            buf: Buf::Output,
            range: 0..out.len(),
        };
        let steps = vec![Step::Recv { peer: 1, into }, Step::Fence];
        execute(
            &job(Some(transport), deadline, watch),
            &Buffers::new(None, out),
            &Messages::of(steps, 1),
            &mut Workspace::default(),
        )
    }

    #[test]
    fn a_schedule_that_communicates_without_a_transport_is_an_internal_error() {
        let mut out = [0u8; 4];
        let from = Loc {
            buf: Buf::Input,
            range: 0..4,
        };
        let steps = vec![Step::Send { peer: 1, from }, Step::Fence];
        let err = execute(
            &job(None, Instant::now(), None),
            &Buffers::new(None, &mut out),
            &Messages::of(steps, 1),
            &mut Workspace::default(),
        )
        .unwrap_err();
        assert!(
            matches!(&err, Error::Internal(why) if why.contains("tried to communicate")),
            "{err}"
        );
    }

    #[test]
    fn a_failed_call_aborts_the_transport() {
        let transport = Fake::stuck();
        let err = receive(&transport, Instant::now(), None, &mut [0; 8]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Transport {
                    rank: 0,
                    source: TransportError::Timeout { .. },
                }
            ),
            "{err}"
        );
        assert!(transport.aborted.load(Ordering::SeqCst));
    }

    #[test]
    fn a_panic_with_a_request_in_flight_aborts_the_transport() {
        let transport = Fake::stuck();
        let deadline = Instant::now() + Duration::from_secs(60);
        let panicked = catch_unwind(AssertUnwindSafe(|| {
            receive(&transport, deadline, Some(&PanicsWhenStalled), &mut [0; 8])
        }));
        assert!(panicked.is_err());
        assert!(transport.aborted.load(Ordering::SeqCst));
    }
}
