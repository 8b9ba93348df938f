//! The communicator: a group of ranks and the collectives they run together.
//!
//! Every call takes a ticket when it is issued and runs when its turn comes,
//! so operations on one communicator complete in issue order whether they
//! are blocking or asynchronous, and whichever thread issues them.

mod collectives;
mod faults;
mod join;
mod lifeline;
mod mailbox;
mod meeting;
mod p2p;
mod prepare;
mod servers;
mod shared;
mod shrink;
mod split;
mod started;
mod work;

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use chorus_kernels::{DType, ReduceOp};
use chorus_transport::pages::Pagemap;
use chorus_transport::shm::ShmTransport;
use chorus_transport::store::{Store, StoreServer};
use chorus_transport::RoutedTransport;
use chorus_transport::{Transport, TransportError};

use crate::algorithm::Path;
use crate::executor::{self, Job, Watch, Workspace, PIPELINE_DEPTH};
use crate::tuner::Tuner;
use crate::{Cause, Config, Error, Fault, Result};

pub(crate) use crate::call::{CallInfo, CallKind};
use faults::{Monitor, Watcher};
use join::connect_store;
use lifeline::Lifeline;
pub use p2p::{Group, Messages};
use prepare::{Call, Route};
pub use shared::SharedBuffer;
use shared::Windows;
use work::Issue;
#[cfg(feature = "cuda")]
pub(crate) use work::Queue;
pub use work::Work;

/// How long dropping a communicator waits for its queued operations before failing them.
const DROP_GRACE: Duration = Duration::from_secs(2);

/// A group of ranks that run collectives together, like an NCCL communicator
/// or a torch.distributed process group.
///
/// Blocking calls return when this rank's part is done; `*_async` calls
/// return a [`Work`] handle at once. All ranks must issue the same
/// collectives in the same order with matching arguments. Calls from
/// several threads are serialised in the order they were issued. After a
/// failure (a timeout, a dead peer, [`abort`](Self::abort)) the
/// communicator is broken and every later call fails.
pub struct Communicator {
    inner: Arc<Inner>,
}

/// What blocking calls and the asynchronous worker share.
pub(crate) struct Inner {
    config: Config,
    transport: Option<RoutedTransport>,
    state: Mutex<State>,
    /// Signalled whenever `State::serving` advances.
    turn: Condvar,
    /// Ticket dispenser and the asynchronous worker, under one lock so that
    /// tickets reach the worker in the order they were handed out.
    issue: Mutex<Issue>,
    /// The rendezvous store client and this communicator's key prefix (absent for one rank).
    store: Option<(Arc<dyn Store>, String)>,
    /// The store server, when this process hosts it; shared with sub-communicators and the
    /// other ranks of this process that joined through it (the last of them to go waits for
    /// every rank's goodbye).
    server: Option<Arc<StoreServer>>,
    /// Every rank's lifeline, for agreeing who survived a death (absent for one rank).
    lifeline: Option<Lifeline>,
    /// Picks each call's route and algorithm from the cost model, the topology and
    /// `CHORUS_ALGO`.
    tuner: Tuner,
    /// Each host's ranks, as the transport found them (one host without a transport).
    hosts: Vec<Vec<usize>>,
    /// This process's page tables, open while the communicator may lend the sends of
    /// buffers on huge pages (see `prepare.rs`).
    pagemap: Option<Pagemap>,
    /// The bytes of this rank's buffers from which a call writes its output with streaming
    /// stores (`None`: never; see `streaming.rs`).
    stream_from: Option<usize>,
    /// The last pick per kind of call, to log changes.
    picks: Mutex<HashMap<CallKind, Path>>,
    /// Decisions and schedules of recent calls, reused by calls like them.
    decisions: prepare::Decisions,
    /// Why the communicator can no longer be used, once it cannot: the first call's error,
    /// or the fault that aborted it.
    fault: Mutex<Option<Arc<Error>>>,
    /// The watchdog and fault reports (absent for one rank).
    monitor: Option<Arc<Monitor>>,
    /// Shared buffers allocated on this communicator.
    windows: Mutex<Windows>,
    /// Whether any shared buffer was allocated (calls skip looking for theirs until then).
    has_windows: AtomicBool,
    /// The communicators split from this one, which an alarm heard here fails too.
    children: Mutex<Vec<Weak<Inner>>>,
}

pub(crate) struct State {
    /// Collectives run so far; part of every collective's message tag.
    seq: u64,
    /// The ticket whose turn it is.
    serving: u64,
    /// Threads waiting for their ticket's turn (none: passing the turn on
    /// needs no wake-up call).
    waiting: usize,
    work: Workspace,
    /// Sub-communicators created so far (names their store keys).
    splits: u64,
    /// Shrinks so far (names their keys on the lifelines).
    shrinks: u64,
    /// Where the next `recv_any` starts looking: an offset past this rank, one past the last
    /// sender found, so that every sender gets its turn.
    any_from: usize,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .finish_non_exhaustive()
    }
}

impl Communicator {
    /// A fault of `cause` this rank found outside a call of its own (a device call's
    /// agreement), blaming rank `culprit` of this communicator; ranks are named by their job
    /// rank.
    #[cfg(feature = "cuda")]
    pub(crate) fn found(&self, cause: Cause, culprit: Option<usize>) -> Fault {
        let inner = &self.inner;
        let job_rank = |r| inner.monitor.as_ref().map_or(r, |m| m.job_rank(r));
        Fault::new(cause, culprit.map(job_rank), inner.job_rank())
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.config.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.config.world_size
    }

    /// This process's rank among those on its host.
    pub fn local_rank(&self) -> usize {
        self.inner.config.local_rank
    }

    /// Number of ranks on this host.
    pub fn local_world_size(&self) -> usize {
        self.inner.config.local_world_size
    }

    /// The configuration this communicator was built from.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The error that broke this communicator, once one has (where a fault did,
    /// [`Error::fault`] names its culprit); `None` while it works. What a survivor reads to
    /// choose the ranks a [`shrink`](Self::shrink) leaves out, wherever the failure
    /// surfaced.
    pub fn failure(&self) -> Option<Error> {
        lock(&self.inner.fault).as_deref().cloned()
    }

    /// Fails every operation in flight and every later one with an error, promptly.
    ///
    /// Callable from any thread; peers see this rank's connections close.
    pub fn abort(&self) {
        let fault = self.inner.own_fault(Cause::Abort);
        self.inner.fail(&fault);
        if let Some(monitor) = self.inner.monitor.clone() {
            // Tell the other ranks why this one's connections closed, without waiting for the store.
            std::thread::spawn(move || monitor.raise(&fault).ok());
        }
    }

    /// Runs `call` now, in issue order with every other call.
    pub(crate) fn run_now(&self, call: Call<'_>) -> Result<()> {
        let ticket = self.inner.ticket();
        self.inner.run(ticket, call)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Queued asynchronous work gets a short grace period to finish, then fails.
        let worker = lock(&self.inner.issue).take_worker();
        if let Some(worker) = worker {
            worker.finish(DROP_GRACE, || {
                let fault = self.inner.own_fault(Cause::Dropped);
                self.inner.fail(&fault);
                // Peers waiting for those operations learn why (over TCP, bytes this rank
                // already sent could otherwise complete a peer's call after it left).
                if let Some(monitor) = &self.inner.monitor {
                    if let Err(e) = monitor.raise(&fault) {
                        tracing::debug!(rank = self.rank(), "cannot tell the other ranks: {e}");
                    }
                }
            });
        }
        // Here rather than when `Inner` goes: another thread (the listener, a straggling
        // task) may hold it last, and a process returning from `main` would not wait for
        // that thread to keep the store up for the ranks still reading why they failed.
        if let Some(monitor) = &self.inner.monitor {
            // Where no other communicator of this process uses it (the lifeline of this one
            // may be the same server: a shrunk communicator's coordinator hosts its store there).
            let hosts_store = self.inner.server.as_ref().is_some_and(|s| {
                let lifeline = self.inner.lifeline.as_ref();
                let own = 1 + usize::from(lifeline.is_some_and(|l| Arc::ptr_eq(&l.server, s)));
                Arc::strong_count(s) == own
            });
            // A rank whose process is gone says no goodbye: the store's host waits not for it.
            let gone = self
                .failure()
                .as_ref()
                .and_then(Error::fault)
                .filter(|f| matches!(f.cause, Cause::PeerClosed | Cause::LeftDuringSetUp))
                .and_then(|f| f.culprit);
            monitor.stop(hosts_store, gone);
        }
    }
}

impl Inner {
    /// The shared-memory transport, when every rank is on this host.
    fn all_shm(&self) -> Option<&ShmTransport> {
        self.transport
            .as_ref()
            .filter(|t| t.all_shm())
            .and_then(|t| t.shm())
    }

    /// Pipeline chunk in elements of `dtype`.
    fn chunk_elems(&self, dtype: DType) -> usize {
        (self.config.chunk_bytes / dtype.size()).max(1)
    }

    /// Hands out the next ticket.
    fn ticket(&self) -> u64 {
        lock(&self.issue).ticket(self.config.rank).0
    }

    /// Waits for `ticket`'s turn, runs `call`, and passes the turn on.
    ///
    /// A failure breaks the communicator: later calls fail at once.
    pub(crate) fn run(&self, ticket: u64, call: Call<'_>) -> Result<()> {
        self.run_with(ticket, |inner, state| inner.execute(state, call))
    }

    /// Waits for `ticket`'s turn, runs `f` unless the communicator is broken, and passes the turn on.
    pub(crate) fn run_with(
        &self,
        ticket: u64,
        f: impl FnOnce(&Inner, &mut State) -> Result<()>,
    ) -> Result<()> {
        self.run_then(ticket, (), |inner, state, ()| f(inner, state), |r, ()| r)
    }

    /// Like `run_with` on `payload`, handing the outcome and the payload to `done` before the
    /// next ticket's turn.
    pub(crate) fn run_then<P, R>(
        &self,
        ticket: u64,
        mut payload: P,
        f: impl FnOnce(&Inner, &mut State, &mut P) -> Result<()>,
        done: impl FnOnce(Result<()>, P) -> R,
    ) -> R {
        self.in_turn(ticket, |inner, state| {
            let earlier = lock(&inner.fault).clone();
            let result = match earlier {
                // An aborted communicator's calls say why it was aborted.
                Some(earlier) => Err(match &*earlier {
                    Error::Aborted(fault) => Error::Aborted(fault.clone()),
                    _ => Error::Broken(earlier),
                }),
                None => f(inner, state, &mut payload),
            };
            let result = match result {
                // Arguments refused before anything moved (an asynchronous call's, checked in
                // its turn) leave the communicator as it was.
                Ok(()) | Err(Error::InvalidArgument(_)) => result,
                Err(error) => Err(inner.record(error)),
            };
            done(result, payload)
        })
    }

    /// Waits for `ticket`'s turn, runs `f` whether or not the communicator is broken, and
    /// passes the turn on.
    fn in_turn<R>(&self, ticket: u64, f: impl FnOnce(&Inner, &mut State) -> R) -> R {
        let mut state = lock(&self.state);
        while state.serving != ticket {
            state.waiting += 1;
            state = self.turn.wait(state).unwrap_or_else(|p| p.into_inner());
            state.waiting -= 1;
        }
        let out = f(self, &mut state);
        state.serving += 1;
        if state.waiting > 0 {
            self.turn.notify_all();
        }
        out
    }

    /// Records `error`, a call's, as what broke the communicator, unless something broke
    /// it first; returns the error the call reports. A call that failed because
    /// [`fail`](Self::fail) aborted the transport reports the fault that did.
    fn record(&self, error: Error) -> Error {
        let mut recorded = lock(&self.fault);
        match &*recorded {
            Some(earlier) if is_abort(&error) => (**earlier).clone(),
            Some(_) => error,
            None => {
                *recorded = Some(Arc::new(error.clone()));
                error
            }
        }
    }

    /// Fails every operation in flight, and every later one, with `fault` (unless the
    /// communicator was broken already: the first error stays).
    fn fail(&self, fault: &Fault) {
        lock(&self.fault).get_or_insert_with(|| Arc::new(Error::Aborted(Box::new(fault.clone()))));
        if let Some(t) = &self.transport {
            t.abort(&fault.to_string());
        }
    }

    /// Fails this communicator and those split from it, as an alarm does.
    fn fail_family(&self, fault: &Fault) {
        self.fail(fault);
        let children: Vec<Arc<Inner>> = lock(&self.children)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for child in children {
            child.fail_family(fault);
        }
    }

    /// This rank's rank in the job (`RANK`), as faults name it.
    pub(crate) fn job_rank(&self) -> usize {
        let rank = self.config.rank;
        self.monitor.as_ref().map_or(rank, |m| m.job_ranks()[rank])
    }

    /// A fault this rank causes itself (aborting, dropping its communicator).
    fn own_fault(&self, cause: Cause) -> Fault {
        Fault::new(cause, Some(self.job_rank()), self.job_rank())
    }

    pub(crate) fn execute(&self, state: &mut State, call: Call<'_>) -> Result<()> {
        state.seq += 1;
        let info = call.info;
        let now = Instant::now();
        let watcher = self.monitor.as_deref().map(|monitor| {
            monitor.activity.begin(state.seq, info, now);
            Watcher {
                monitor,
                transport: self.transport.as_ref().map(|t| t as &dyn Transport),
                seq: state.seq,
                call: info,
                started: now,
            }
        });
        let tag = tag(state.seq, &info);
        let watch = watcher.as_ref().map(|w| w as &dyn Watch);
        let transport = self.transport.as_ref().map(|t| t as &dyn Transport);
        let deadline = now + self.config.timeout;
        let meet = |window| {
            self.run_meeting(window, &call.bufs, tag, &info, (deadline, watch))
                .map_err(|e| executor::failed(e, watch, transport))
        };
        let result = match &call.route {
            Route::Messages(messages) => {
                self.announce_messages(tag, call.bufs.addresses().1.len(), info.root);
                let job = Job {
                    transport,
                    rank: self.config.rank,
                    tag,
                    dtype: info.dtype,
                    op: info.op,
                    world_size: self.config.world_size,
                    deadline,
                    depth: PIPELINE_DEPTH,
                    watch,
                };
                executor::execute(&job, &call.bufs, messages, &mut state.work)
            }
            Route::Mailbox => meet(None),
            Route::Window(window) => meet(Some(window)),
        };
        if let Some(monitor) = &self.monitor {
            monitor.activity.end();
        }
        result
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn elements(bytes: usize, dtype: DType) -> Result<usize> {
    if bytes % dtype.size() != 0 {
        return Err(Error::InvalidArgument(format!(
            "{bytes} bytes is not a whole number of {dtype} elements ({} bytes each)",
            dtype.size()
        )));
    }
    Ok(bytes / dtype.size())
}

/// The message tag: sequence number and a fingerprint of the call (kind, dtype, op, and
/// 20 bits standing for root and count), so ranks that disagree on what they are running
/// fail instead of mixing data.
fn tag(seq: u64, call: &CallInfo) -> u64 {
    // Both lists hold every value, so each gets its own code, and each fits its 4 bits.
    const _: () = assert!(DType::ALL.len() <= 16 && ReduceOp::ALL.len() <= 16);
    let (dtype, op) = call.codes();
    let (dtype, op) = (dtype as u64, op as u64);
    (seq << 32) | (call.kind as u64) << 28 | dtype << 24 | op << 20 | call.fingerprint()
}

/// Whether `error` is the transport's report that this communicator was aborted.
fn is_abort(error: &Error) -> bool {
    matches!(
        error,
        Error::Transport {
            source: TransportError::Aborted(_),
            ..
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(dtype: DType, op: ReduceOp) -> CallInfo {
        CallInfo::new(CallKind::AllReduce, dtype, op, 0, 1000).unwrap()
    }

    #[test]
    fn every_operator_has_its_own_tag() {
        let sum = tag(9, &call(DType::I64, ReduceOp::Sum));
        let tags: Vec<u64> = ReduceOp::ALL
            .iter()
            .map(|&op| tag(9, &call(DType::I64, op)))
            .collect();
        for (i, t) in tags.iter().enumerate() {
            // Only the operator's 4 bits differ, and they hold the operator's index.
            assert_eq!(t & !(0xF << 20), sum & !(0xF << 20), "{}", ReduceOp::ALL[i]);
            assert_eq!((t >> 20) & 0xF, i as u64, "{}", ReduceOp::ALL[i]);
        }
        let dtypes: std::collections::HashSet<u64> = DType::ALL
            .iter()
            .map(|&d| tag(9, &call(d, ReduceOp::Max)))
            .collect();
        assert_eq!(dtypes.len(), DType::ALL.len());
    }

    #[test]
    fn bitwise_operators_on_floats_are_invalid_arguments() {
        for dtype in DType::ALL {
            for op in ReduceOp::BITWISE {
                let info = CallInfo::new(CallKind::ReduceScatter, dtype, op, 0, 8);
                if !dtype.is_float() {
                    assert_eq!(info.unwrap().op, op);
                    continue;
                }
                match info {
                    Err(Error::InvalidArgument(why)) => assert_eq!(
                        why,
                        format!(
                            "reduction operator {op} is not defined for {dtype} (bitwise \
                             operators need an integer type)"
                        )
                    ),
                    other => panic!("{op} {dtype}: {other:?}"),
                }
            }
        }
    }

    /// A one-rank communicator (no store, no peers).
    fn solo() -> Communicator {
        Communicator::new(Config::new(0, 1, "127.0.0.1", 0)).expect("one rank")
    }

    fn assert_invalid<T: std::fmt::Debug>(result: Result<T>, op: ReduceOp, dtype: DType) {
        match result {
            Err(Error::InvalidArgument(why)) => assert!(
                why.contains(&format!("operator {op} ")) && why.contains(&format!(" {dtype} ")),
                "{why}"
            ),
            other => panic!("{op} on {dtype}: {other:?}"),
        }
    }

    #[test]
    fn collectives_refuse_bitwise_operators_on_floats_and_go_on() {
        let comm = solo();
        let mut f = [1.5f32, -2.0];
        assert_invalid(
            comm.all_reduce(&mut f, ReduceOp::BAnd),
            ReduceOp::BAnd,
            DType::F32,
        );
        let mut out = [0.0f32; 2];
        let r = comm.all_reduce_into(&f, &mut out, ReduceOp::BOr);
        assert_invalid(r, ReduceOp::BOr, DType::F32);
        let mut bytes = [0u8; 16];
        let r = comm.all_reduce_bytes(None, &mut bytes, DType::F64, ReduceOp::BXor);
        assert_invalid(r, ReduceOp::BXor, DType::F64);
        let mut h = [crate::f16::ONE; 4];
        assert_invalid(
            comm.reduce(&mut h, ReduceOp::BOr, 0),
            ReduceOp::BOr,
            DType::F16,
        );
        let b = [crate::bf16::ONE; 4];
        let mut b_out = [crate::bf16::ZERO; 4];
        let r = comm.reduce_into(&b, &mut b_out, ReduceOp::BAnd, 0);
        assert_invalid(r, ReduceOp::BAnd, DType::BF16);
        let r = comm.reduce_scatter(&[1.0f64; 3], &mut [0.0; 3], ReduceOp::BXor);
        assert_invalid(r, ReduceOp::BXor, DType::F64);
        // Nothing was written, and the communicator still works (no call was started).
        assert_eq!(
            (f, out, bytes, b_out),
            ([1.5, -2.0], [0.0; 2], [0; 16], [crate::bf16::ZERO; 4])
        );
        assert_eq!(h, [crate::f16::ONE; 4]);
        let mut ints = [-1i32, 0x0F0F, 7];
        for op in ReduceOp::BITWISE {
            comm.all_reduce(&mut ints, op).unwrap();
            comm.reduce(&mut ints, op, 0).unwrap();
        }
        assert_eq!(ints, [-1, 0x0F0F, 7]);
        comm.all_reduce(&mut f, ReduceOp::Sum).unwrap();
        assert_eq!(f, [1.5, -2.0]);
        // Asynchronously the error comes back through the handle.
        let work = comm.all_reduce_async(vec![1.0f32], ReduceOp::BXor);
        assert_invalid(work.wait(), ReduceOp::BXor, DType::F32);
    }

    #[test]
    fn reduce_scatter_async_gives_both_buffers_back_and_names_bad_lengths() {
        let comm = solo();
        // On one rank the shard is the whole input.
        let work = comm.reduce_scatter_async(vec![2.5f32, 1.0], vec![0.0; 2], ReduceOp::Sum);
        assert_eq!(work.wait().unwrap(), (vec![2.5, 1.0], vec![2.5, 1.0]));
        let work = comm.reduce_scatter_async(vec![1.0f32; 3], vec![0.0; 2], ReduceOp::Sum);
        let e = work.wait().unwrap_err().to_string();
        assert!(
            e.contains("reduce_scatter: the input has 3 elements"),
            "{e}"
        );
    }
}
