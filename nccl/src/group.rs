//! `ncclGroupStart` / `ncclGroupEnd`: calls made between them on this thread wait for the
//! outermost end, which runs them together: set-ups, splits and shrinks of several
//! communicators at once (each on a thread of its own, so one thread may drive every rank), each
//! communicator's collectives in order on a thread of its own (one thread may drive several
//! ranks), then its sends and receives all posted at once, so pairs of them cannot deadlock
//! whatever order each rank made them in.

use std::cell::RefCell;
use std::sync::Arc;

use chorus::Communicator;

use crate::comm::{Comm, Failure, Outcome};

/// A collective waiting for its group's end: it issues the call on the communicator (run
/// at once, or on its stream); it holds the caller's buffers as addresses, which the caller
/// keeps valid until the group ends (and, on a stream, until the call has ended there).
pub type Collective = Box<dyn FnOnce(&Comm) -> Outcome + Send>;

/// A split or a shrink waiting for its group's end: makes the communicator and hands it to
/// the caller.
pub type Make = Box<dyn FnOnce() -> Outcome + Send>;

/// A call waiting for its group's end.
pub enum Op {
    /// A collective, issued in order with the communicator's others.
    Collective(Collective),
    /// A send of the message's bytes.
    Send(Message),
    /// A receive into the message's buffer.
    Recv(Message),
}

/// A send's bytes or a receive's buffer.
#[derive(Debug, Clone, Copy)]
pub struct Message {
    /// Address of the bytes.
    pub at: usize,
    /// How many.
    pub bytes: usize,
    /// To or from which rank.
    pub peer: usize,
    /// Whether they are CUDA device memory.
    pub device: bool,
    /// The CUDA stream the call is ordered on (its raw handle; read where calls are).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub stream: usize,
}

/// This thread's open groups.
#[derive(Default)]
struct Pending {
    depth: usize,
    /// Each op with its communicator, in the order made.
    ops: Vec<(Arc<Comm>, Op)>,
    /// Communicators set up inside the group.
    inits: Vec<Arc<Comm>>,
    /// Splits and shrinks made inside the group, each with the communicator it is made from.
    makes: Vec<(Arc<Comm>, Make)>,
}

thread_local! {
    static PENDING: RefCell<Pending> = RefCell::new(Pending::default());
}

/// Tag of every point-to-point message: NCCL matches them in order per pair of ranks.
const TAG: u32 = 0;

/// Opens a group (they nest).
pub fn start() {
    PENDING.with(|p| p.borrow_mut().depth += 1);
}

/// Whether a group is open on this thread.
pub fn open() -> bool {
    PENDING.with(|p| p.borrow().depth > 0)
}

/// Closes a group; the outermost runs everything made inside it.
pub fn end() -> Outcome {
    let ended = PENDING.with(|p| {
        let mut p = p.borrow_mut();
        match p.depth {
            0 => Err(Failure::usage("ncclGroupEnd without ncclGroupStart")),
            1 => Ok(Some(std::mem::take(&mut *p))),
            _ => {
                p.depth -= 1;
                Ok(None)
            }
        }
    })?;
    match ended {
        Some(group) => run(group.ops, group.inits, group.makes),
        None => Ok(()),
    }
}

/// `push`es `item` into this thread's open group; gives it back where none is open.
fn queue<T>(item: T, push: impl FnOnce(&mut Pending, T)) -> Option<T> {
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        match p.depth {
            0 => Some(item),
            _ => {
                push(&mut p, item);
                None
            }
        }
    })
}

/// Runs `op` on `comm` now, or at the group's end if one is open.
pub fn submit(comm: &Arc<Comm>, op: Op) -> Outcome {
    comm.usable()?;
    match queue(op, |p, op| p.ops.push((comm.clone(), op))) {
        Some(op) => run(vec![(comm.clone(), op)], Vec::new(), Vec::new()),
        None => Ok(()),
    }
}

/// Runs `make` (a split or shrink of `from`) now, or at the group's end if one is open: with
/// those of other communicators at once, after those of `from` made before it.
pub fn make(from: &Arc<Comm>, make: Make) -> Outcome {
    queue(make, |p, make| p.makes.push((from.clone(), make))).map_or(Ok(()), |make| make())
}

/// Drops what this thread's open group queued on `comm` (it is being aborted): nothing of
/// the group keeps it alive or runs on it.
pub fn forget(comm: &Arc<Comm>) {
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        p.ops.retain(|(c, _)| !Arc::ptr_eq(c, comm));
        p.inits.retain(|c| !Arc::ptr_eq(c, comm));
        p.makes.retain(|(c, _)| !Arc::ptr_eq(c, comm));
    });
}

/// `items` gathered by communicator, each communicator's in the order given.
fn by_comm<T>(items: Vec<(Arc<Comm>, T)>) -> Vec<(Arc<Comm>, Vec<T>)> {
    let mut gathered: Vec<(Arc<Comm>, Vec<T>)> = Vec::new();
    for (comm, item) in items {
        match gathered.iter_mut().find(|(c, _)| Arc::ptr_eq(c, &comm)) {
            Some((_, list)) => list.push(item),
            None => gathered.push((comm, vec![item])),
        }
    }
    gathered
}

/// Notes a communicator set up inside the open group: its end waits for it.
pub fn note_init(comm: &Arc<Comm>) {
    PENDING.with(|p| p.borrow_mut().inits.push(comm.clone()));
}

fn run(ops: Vec<(Arc<Comm>, Op)>, inits: Vec<Arc<Comm>>, makes: Vec<(Arc<Comm>, Make)>) -> Outcome {
    let mut first: Outcome = Ok(());
    std::thread::scope(|s| {
        // Two splits of one communicator are collectives on it: they run in order.
        let in_order = |makes: Vec<Make>| makes.into_iter().try_for_each(|make| make());
        let setups: Vec<_> = inits
            .into_iter()
            .map(|comm| s.spawn(move || comm.communicator().map(drop)))
            .chain(
                by_comm(makes)
                    .into_iter()
                    .map(|(_, list)| s.spawn(move || in_order(list))),
            )
            .collect();
        for setup in setups {
            let done = setup.join().unwrap_or_else(|_| Err(panicked()));
            first = first.clone().and(done);
        }
    });
    let ops = by_comm(ops);
    let single = ops.len() == 1;
    std::thread::scope(|s| {
        let mut runs = Vec::new();
        for (comm, list) in ops {
            // Calls on streams are only issued: here, in the group's order, so that every
            // rank queues them on a shared stream in one order. Calls that run at once may
            // wait for another rank's call on a later communicator: each runs on a thread.
            if single || comm.on_streams() {
                let done = run_on(&comm, list);
                first = first.clone().and(done);
            } else {
                runs.push(s.spawn(move || run_on(&comm, list)));
            }
        }
        for r in runs {
            let done = r.join().unwrap_or_else(|_| Err(panicked()));
            first = first.clone().and(done);
        }
    });
    first
}

fn panicked() -> Failure {
    Failure::new(
        crate::abi::NcclResult::InternalError,
        "a call of the group panicked",
    )
}

/// One communicator's share of a group: its collectives in order, then its messages at once.
fn run_on(comm: &Comm, ops: Vec<Op>) -> Outcome {
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    for op in ops {
        match op {
            Op::Collective(call) => call(comm)?,
            Op::Send(m) => sends.push(m),
            Op::Recv(m) => recvs.push(m),
        }
    }
    if sends.is_empty() && recvs.is_empty() {
        return Ok(());
    }
    let joined = comm.joined()?;
    #[cfg(feature = "cuda")]
    if let Some(ordered) = &joined.ordered {
        return exchange_ordered(ordered, sends, recvs);
    }
    match sends.iter().chain(&recvs).any(|m| m.device) {
        true => Err(Failure::usage(crate::memory::NO_DEVICE_CALLS)),
        // SAFETY: the caller keeps its buffers valid and unchanged until the group ends.
        false => unsafe { post(&joined.communicator, &sends, &recvs) }.map_err(Failure::from),
    }
}

/// Posts `sends` and `recvs`, in host memory, at once.
///
/// # Safety
/// Every message addresses host memory of its length, valid until this returns, which
/// nothing else writes meanwhile (nor reads, for a receive's).
unsafe fn post(c: &Communicator, sends: &[Message], recvs: &[Message]) -> chorus::Result<()> {
    c.group(|g| {
        for m in sends {
            // SAFETY: as the function requires.
            g.send(
                unsafe { std::slice::from_raw_parts(m.at as *const u8, m.bytes) },
                m.peer,
                TAG,
            );
        }
        for m in recvs {
            // SAFETY: as the function requires.
            g.recv(
                unsafe { std::slice::from_raw_parts_mut(m.at as *mut u8, m.bytes) },
                m.peer,
                TAG,
            );
        }
    })
}

/// Issues a group's messages on their streams (see [`Ordered::across`]).
///
/// [`Ordered::across`]: crate::ordered::Ordered::across
#[cfg(feature = "cuda")]
fn exchange_ordered(
    ordered: &crate::ordered::Ordered,
    sends: Vec<Message>,
    recvs: Vec<Message>,
) -> Outcome {
    let mut streams: Vec<usize> = Vec::new();
    for m in sends.iter().chain(&recvs) {
        if !streams.contains(&m.stream) {
            streams.push(m.stream);
        }
    }
    // One call, on the first stream, ordered on every stream of the group.
    ordered.across(&streams, |stream| {
        exchange_on(ordered, sends, recvs, stream)
    })
}

/// Issues a group's messages on `stream`: those on device memory together (through CUDA
/// IPC or page-locked copies), then those on host memory together. Every rank issues the
/// two in this order, so the two ranks of a pair meet in the same call whatever else their
/// groups hold (a send and its receive must both be on device memory or both on host
/// memory).
/// Messages of no bytes move nothing and are left out, on both sides.
#[cfg(feature = "cuda")]
fn exchange_on(
    ordered: &crate::ordered::Ordered,
    sends: Vec<Message>,
    recvs: Vec<Message>,
    stream: usize,
) -> Outcome {
    use chorus::cuda::DeviceMessage;
    let apart = |messages: Vec<Message>| -> (Vec<Message>, Vec<Message>) {
        let moving = messages.into_iter().filter(|m| m.bytes > 0);
        moving.partition(|m| m.device)
    };
    let ((device_sends, host_sends), (device_recvs, host_recvs)) = (apart(sends), apart(recvs));
    if !device_sends.is_empty() || !device_recvs.is_empty() {
        let message = |sends: bool| {
            move |m: &Message| DeviceMessage::new(sends, m.peer, TAG, (m.at as u64, m.bytes))
        };
        let messages = (device_sends.iter().map(message(true)))
            .chain(device_recvs.iter().map(message(false)))
            .collect();
        // SAFETY: the caller's device buffers stay valid, and written by nothing else, until
        // the call has ended on its stream (NCCL's rule).
        unsafe { ordered.exchange(messages, stream) }?;
    }
    if !host_sends.is_empty() || !host_recvs.is_empty() {
        let call = move |c: &Communicator| {
            // SAFETY: the caller keeps its buffers valid and unchanged until the call has
            // ended on its stream (NCCL's rule).
            unsafe { post(c, &host_sends, &host_recvs) }
        };
        ordered.host(stream, Box::new(call))?;
    }
    Ok(())
}
