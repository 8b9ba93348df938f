//! `ncclGroupStart` / `ncclGroupEnd`: calls made between them on this thread wait for the
//! outermost end, which runs them together: set-ups of several communicators at once, each
//! communicator's collectives in order on a thread of its own (one thread may drive several
//! ranks), then its sends and receives all posted at once, so pairs of them cannot deadlock
//! whatever order each rank made them in.

use std::cell::RefCell;

use chorus::Communicator;

use crate::comm::{Comm, Failure, Outcome};

/// A collective waiting for its group's end; it owns what it needs of the caller's buffers
/// as addresses, which the caller keeps valid until the group ends.
pub type Collective = Box<dyn FnOnce(&Communicator) -> chorus::Result<()> + Send>;

/// A call waiting for its group's end.
pub enum Op {
    /// A collective, run in order with the communicator's others.
    Collective(Collective),
    /// A send of `bytes` at `data` to `peer`.
    Send {
        /// Address of the bytes.
        data: usize,
        /// How many.
        bytes: usize,
        /// To which rank.
        peer: usize,
    },
    /// A receive of `bytes` into `buf` from `peer`.
    Recv {
        /// Address of the buffer.
        buf: usize,
        /// How many bytes.
        bytes: usize,
        /// From which rank.
        peer: usize,
    },
}

/// This thread's open groups.
#[derive(Default)]
struct Pending {
    depth: usize,
    /// Each op with its communicator's address, in the order made.
    ops: Vec<(usize, Op)>,
    /// Communicators set up inside the group.
    inits: Vec<usize>,
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
    let (ops, inits) = PENDING
        .with(|p| {
            let mut p = p.borrow_mut();
            match p.depth {
                0 => Err(Failure::usage("ncclGroupEnd without ncclGroupStart")),
                1 => {
                    p.depth = 0;
                    Ok(Some((
                        std::mem::take(&mut p.ops),
                        std::mem::take(&mut p.inits),
                    )))
                }
                _ => {
                    p.depth -= 1;
                    Ok(None)
                }
            }
        })?
        .unwrap_or_default();
    run(ops, inits)
}

/// Runs `op` on `comm` now, or at the group's end if one is open.
pub fn submit(comm: &Comm, op: Op) -> Outcome {
    let at = comm as *const Comm as usize;
    let queued = PENDING.with(|p| {
        let mut p = p.borrow_mut();
        if p.depth == 0 {
            return Some(op);
        }
        p.ops.push((at, op));
        None
    });
    match queued {
        Some(op) => run(vec![(at, op)], Vec::new()),
        None => Ok(()),
    }
}

/// Notes a communicator set up inside the open group: its end waits for it.
pub fn note_init(comm: &Comm) {
    PENDING.with(|p| p.borrow_mut().inits.push(comm as *const Comm as usize));
}

/// The handle at `at`.
///
/// # Safety
/// `at` is the address of a live handle: the caller keeps every communicator it used in a
/// group alive until the group ends, as NCCL requires.
unsafe fn handle<'a>(at: usize) -> &'a Comm {
    // SAFETY: as the function requires.
    unsafe { &*(at as *const Comm) }
}

fn run(ops: Vec<(usize, Op)>, inits: Vec<usize>) -> Outcome {
    let mut first: Outcome = Ok(());
    std::thread::scope(|s| {
        let setups: Vec<_> = inits
            .into_iter()
            // SAFETY: noted by `note_init` on a handle the caller keeps alive.
            .map(|at| s.spawn(move || unsafe { handle(at) }.communicator().map(drop)))
            .collect();
        for setup in setups {
            let done = setup.join().unwrap_or_else(|_| Err(panicked()));
            first = first.clone().and(done);
        }
    });
    let mut by_comm: Vec<(usize, Vec<Op>)> = Vec::new();
    for (at, op) in ops {
        match by_comm.iter_mut().find(|(c, _)| *c == at) {
            Some((_, list)) => list.push(op),
            None => by_comm.push((at, vec![op])),
        }
    }
    let single = by_comm.len() == 1;
    std::thread::scope(|s| {
        let mut runs = Vec::new();
        for (at, list) in by_comm {
            // SAFETY: queued by `submit` on a handle the caller keeps alive.
            let comm = unsafe { handle(at) };
            if single {
                let done = run_on(comm, list);
                first = first.clone().and(done);
            } else {
                runs.push(s.spawn(move || run_on(comm, list)));
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
    let communicator = comm.communicator()?;
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    for op in ops {
        match op {
            Op::Collective(call) => call(communicator)?,
            Op::Send { data, bytes, peer } => sends.push((data, bytes, peer)),
            Op::Recv { buf, bytes, peer } => recvs.push((buf, bytes, peer)),
        }
    }
    if sends.is_empty() && recvs.is_empty() {
        return Ok(());
    }
    for &(_, _, peer) in sends.iter().chain(&recvs) {
        if peer >= comm.nranks() {
            return Err(Failure::argument(format!(
                "peer {peer} is not a rank of this communicator of {}",
                comm.nranks()
            )));
        }
    }
    let posted: chorus::Result<()> = communicator.group(|g| {
        for &(data, bytes, peer) in &sends {
            // SAFETY: the caller keeps its buffers valid and unchanged until the group ends.
            g.send(
                unsafe { std::slice::from_raw_parts(data as *const u8, bytes) },
                peer,
                TAG,
            );
        }
        for &(buf, bytes, peer) in &recvs {
            // SAFETY: as above, and no other call of the group writes a receive's buffer.
            g.recv(
                unsafe { std::slice::from_raw_parts_mut(buf as *mut u8, bytes) },
                peer,
                TAG,
            );
        }
    });
    posted.map_err(Failure::from)
}
