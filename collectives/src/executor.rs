//! The executor: runs any schedule over any transport.
//!
//! Steps are posted in program order, but nothing waits unless a data
//! dependency demands it: a send waits only for earlier steps that write the
//! region it reads, a receive only for earlier steps that touch the region
//! it overwrites. Received chunks that must be reduced land in staging slots
//! and are reduced when a slot is needed or a later step depends on them, so
//! the wire fills the next chunk while this thread reduces the last one.

use std::collections::VecDeque;
use std::marker::PhantomData;
use std::ops::Range;
use std::time::Instant;

use chorus_kernels::{reduce, reduce_into, DType, ReduceOp};
use chorus_transport::{Request, Transport, TransportError};

use crate::schedule::{scratch_len, Buf, Loc, Step};
use crate::Error;

/// Memory the executor keeps between calls: staging slots for chunks that
/// are reduced on arrival, and the scratch buffer schedules may use.
#[derive(Debug, Default)]
pub struct Workspace {
    slots: Vec<Vec<u8>>,
    scratch: Vec<u8>,
    /// The free slots' indices during a call (kept to spare an allocation per call).
    free: Vec<usize>,
    /// The call's posted requests (kept for its capacity; empty between calls).
    pending: Posted,
}

/// The queue of posted requests a call has not yet settled, oldest first.
#[derive(Default)]
struct Posted(VecDeque<Pending>);

// SAFETY: a `Pending`'s raw pointers are only used by the call that posted it, on its own
// thread, and the queue is emptied when that call's `Run` is dropped, on return or unwind:
// no pointer crosses threads or outlives its call.
unsafe impl Send for Posted {}
// SAFETY: as for `Send`; a shared `Posted` is never read while it holds entries.
unsafe impl Sync for Posted {}

impl std::fmt::Debug for Posted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Posted({} requests)", self.0.len())
    }
}

impl Workspace {
    /// Makes sure there are `depth` slots of `slot_bytes` and `scratch_bytes` of scratch.
    fn reserve(&mut self, depth: usize, slot_bytes: usize, scratch_bytes: usize) {
        self.slots.resize_with(depth.max(1), Vec::new);
        for slot in &mut self.slots {
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
    /// Called once, when a wait outlasts [`warn_at`](Self::warn_at); the call goes on waiting.
    fn stalled(&self);
    /// Turns a failure into the error to report, before the transport is aborted.
    fn failed(&self, error: Error) -> Error;
}

/// The caller's memory, borrowed for `'a`: raw because the transport reads and writes it
/// in the background while this thread works on other regions.
pub struct Buffers<'a> {
    input: *const u8,
    input_len: usize,
    output: *mut u8,
    output_len: usize,
    /// Holds the caller's borrows for as long as the pointers are in use.
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> Buffers<'a> {
    /// The caller's input (`None`: the output serves as input, in place) and output.
    pub fn new(input: Option<&'a [u8]>, output: &'a mut [u8]) -> Buffers<'a> {
        let (input, input_len) =
            input.map_or((output.as_ptr(), output.len()), |i| (i.as_ptr(), i.len()));
        Buffers {
            input,
            input_len,
            output: output.as_mut_ptr(),
            output_len: output.len(),
            _borrow: PhantomData,
        }
    }

    /// In place with the input inside the output: `len` bytes from byte `offset`.
    ///
    /// Panics if the input would reach past the output (callers check the sizes).
    pub fn inside(output: &'a mut [u8], offset: usize, len: usize) -> Buffers<'a> {
        assert!(
            offset + len <= output.len(),
            "input block outside the output"
        );
        // SAFETY: `offset + len <= output.len()`, checked above.
        let input = unsafe { output.as_ptr().add(offset) };
        Buffers {
            input,
            input_len: len,
            output: output.as_mut_ptr(),
            output_len: output.len(),
            _borrow: PhantomData,
        }
    }

    /// The addresses of the input's and the output's bytes (equal when in place).
    pub(crate) fn addresses(&self) -> (Range<usize>, Range<usize>) {
        let (input, output) = (self.input as usize, self.output as usize);
        (
            input..input + self.input_len,
            output..output + self.output_len,
        )
    }

    /// The input as a slice.
    ///
    /// # Safety
    ///
    /// No mutable slice of the input (nor, in place, of the output) may be
    /// alive while it is, and no request may be writing it.
    pub(crate) unsafe fn input(&self) -> &[u8] {
        // SAFETY: the pointer and length come from a slice borrowed for `'a`, which
        // outlives `self`; the absence of writers is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.input, self.input_len) }
    }

    /// The start and length of the output.
    pub(crate) fn output_raw(&self) -> (*mut u8, usize) {
        (self.output, self.output_len)
    }

    /// Input and output of equal length (reductions, broadcast); fails naming both lengths.
    pub fn same_len(input: Option<&'a [u8]>, output: &'a mut [u8]) -> Result<Buffers<'a>, Error> {
        match input {
            Some(i) if i.len() != output.len() => Err(Error::InvalidArgument(format!(
                "input has {} bytes but output has {}",
                i.len(),
                output.len()
            ))),
            _ => Ok(Buffers::new(input, output)),
        }
    }
}

/// A posted request and the memory it touches (absolute byte addresses).
struct Pending {
    id: u64,
    req: Request,
    ptr: *mut u8,
    mem: Range<usize>,
    kind: Kind,
}

enum Kind {
    /// A send, reading `mem`.
    Send,
    /// A receive straight into `mem`.
    Recv,
    /// A receive into a staging slot; when settled, `mem = with op slot`.
    Staged {
        slot: usize,
        with: Range<usize>,
        with_ptr: *const u8,
    },
}

impl Pending {
    /// Whether settling this step writes memory overlapping `mem`.
    fn writes(&self, mem: &Range<usize>) -> bool {
        !matches!(self.kind, Kind::Send) && overlaps(&self.mem, mem)
    }

    /// Whether this step reads memory overlapping `mem` before it is settled.
    fn reads(&self, mem: &Range<usize>) -> bool {
        match &self.kind {
            Kind::Send => overlaps(&self.mem, mem),
            Kind::Staged { with, .. } => overlaps(with, mem),
            Kind::Recv => false,
        }
    }
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// Runs `steps` to completion.
///
/// On any error the transport is aborted before returning, so no request
/// still refers to the caller's buffers.
pub fn execute(
    job: &Job<'_>,
    bufs: &Buffers<'_>,
    steps: &[Step],
    work: &mut Workspace,
) -> Result<(), Error> {
    let elem = job.dtype.size();
    let max_chunk = steps
        .iter()
        .filter_map(|s| match s {
            Step::RecvReduce { into, .. } => Some(into.len()),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    work.reserve(job.depth, max_chunk * elem, scratch_len(steps) * elem);
    work.free.clear();
    work.free.extend(0..work.slots.len());
    let mut run = Run {
        job,
        bufs,
        elem,
        scratch: work.scratch.as_mut_ptr(),
        scratch_len: work.scratch.len(),
        slots: &mut work.slots,
        free: &mut work.free,
        pending: &mut work.pending.0,
        next_id: 0,
        warned: false,
    };
    let result = steps
        .iter()
        .try_for_each(|step| run.step(step))
        .and_then(|()| run.settle_all());
    result.map_err(|error| failed(error, job.watch, job.transport))
}

/// Explains a call's failure through `watch`, then aborts `transport` so no
/// peer request still refers to the caller's buffers; returns the error to report.
pub(crate) fn failed(
    error: Error,
    watch: Option<&dyn Watch>,
    transport: Option<&dyn Transport>,
) -> Error {
    let error = match watch {
        Some(watch) => watch.failed(error),
        None => error,
    };
    if let Some(transport) = transport {
        transport.abort(&format!("a collective failed on this rank: {error}"));
    }
    error
}

struct Run<'a, 'j> {
    job: &'a Job<'j>,
    bufs: &'a Buffers<'a>,
    elem: usize,
    scratch: *mut u8,
    scratch_len: usize,
    slots: &'a mut [Vec<u8>],
    free: &'a mut Vec<usize>,
    pending: &'a mut VecDeque<Pending>,
    next_id: u64,
    /// Whether the watchdog has reported this call as stalled.
    warned: bool,
}

impl Drop for Run<'_, '_> {
    /// Empties the kept queue, also when a panic unwinds. After a failure the transport has
    /// been aborted already; a panic aborts it here, so no request still uses the caller's
    /// buffers once the unwinding frees them.
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Some(transport) = self.job.transport {
                transport.abort("a collective panicked on this rank");
            }
        }
        self.pending.clear();
    }
}

impl Run<'_, '_> {
    fn transport(&self) -> Result<&dyn Transport, Error> {
        self.job.transport.ok_or_else(|| {
            Error::InvalidArgument("a schedule for one rank tried to communicate".into())
        })
    }

    /// The pointer to and absolute address range of `loc`; fails if it leaves its buffer.
    fn resolve(&self, loc: &Loc) -> Result<(*mut u8, Range<usize>), Error> {
        let (base, len) = match loc.buf {
            Buf::Input => (self.bufs.input.cast_mut(), self.bufs.input_len),
            Buf::Output => (self.bufs.output, self.bufs.output_len),
            Buf::Scratch => (self.scratch, self.scratch_len),
        };
        let bytes = loc.range.start * self.elem..loc.range.end * self.elem;
        if bytes.end > len {
            return Err(Error::InvalidArgument(format!(
                "schedule step {loc:?} reaches past its buffer of {len} bytes"
            )));
        }
        // SAFETY: `bytes.start <= len`, so the pointer stays within (or one past) the buffer.
        let ptr = unsafe { base.add(bytes.start) };
        let addr = ptr as usize;
        Ok((ptr, addr..addr + bytes.len()))
    }

    /// Resolves a location this step writes; the input is never written.
    fn resolve_target(&self, loc: &Loc) -> Result<(*mut u8, Range<usize>), Error> {
        if loc.buf == Buf::Input {
            return Err(Error::InvalidArgument(format!(
                "schedule writes its input at {loc:?}"
            )));
        }
        self.resolve(loc)
    }

    fn step(&mut self, step: &Step) -> Result<(), Error> {
        self.retire_finished_front();
        match step {
            Step::Send { peer, from } => {
                let (ptr, mem) = self.resolve(from)?;
                self.settle_conflicts(|p| p.writes(&mem))?;
                // SAFETY: `mem` lies within the caller's buffers or the scratch (checked by
                // `resolve`); no pending step writes it (settled above); the request
                // completes, or the transport is aborted, before `execute` returns.
                let req = unsafe {
                    let data = std::slice::from_raw_parts(ptr.cast_const(), mem.len());
                    self.transport()?.isend(*peer, self.job.tag, data)?
                };
                self.push(req, ptr, mem, Kind::Send);
            }
            Step::Recv { peer, into } => {
                let (ptr, mem) = self.resolve_target(into)?;
                self.settle_conflicts(|p| p.writes(&mem) || p.reads(&mem))?;
                // SAFETY: as for sends; nothing else touches `mem` until the request is
                // settled, because every later step that touches it settles it first.
                let req = unsafe {
                    let buf = std::slice::from_raw_parts_mut(ptr, mem.len());
                    self.transport()?.irecv(*peer, self.job.tag, buf)?
                };
                self.push(req, ptr, mem, Kind::Recv);
            }
            Step::RecvReduce { peer, with, into } => {
                let (with_ptr, with) = self.resolve(with)?;
                let (ptr, mem) = self.resolve_target(into)?;
                if with != mem && overlaps(&with, &mem) {
                    return Err(Error::InvalidArgument(format!(
                        "schedule reduces {into:?} from a partly overlapping operand"
                    )));
                }
                let slot = self.take_slot()?;
                // SAFETY: the slot holds at least the largest receive-and-reduce of this
                // schedule (`Workspace::reserve`) and belongs to this request until settled.
                let req = unsafe {
                    let buf =
                        std::slice::from_raw_parts_mut(self.slots[slot].as_mut_ptr(), mem.len());
                    self.transport()?.irecv(*peer, self.job.tag, buf)?
                };
                let with_ptr = with_ptr.cast_const();
                self.push(
                    req,
                    ptr,
                    mem,
                    Kind::Staged {
                        slot,
                        with,
                        with_ptr,
                    },
                );
            }
            Step::Copy { from, into } => {
                let (src, from_mem) = self.resolve(from)?;
                let (dst, mem) = self.resolve_target(into)?;
                if from_mem != mem {
                    self.settle_conflicts(|p| {
                        p.writes(&from_mem) || p.writes(&mem) || p.reads(&mem)
                    })?;
                    // SAFETY: both ranges are in bounds (checked by `resolve`) and no pending
                    // request touches them (settled above); `copy` allows overlap.
                    unsafe { std::ptr::copy(src.cast_const(), dst, mem.len().min(from_mem.len())) };
                }
            }
            Step::Finish { at } => {
                if self.job.op == ReduceOp::Avg && self.job.world_size > 1 {
                    let (ptr, mem) = self.resolve_target(at)?;
                    self.settle_conflicts(|p| p.writes(&mem) || p.reads(&mem))?;
                    // SAFETY: in bounds, and no pending request touches it (settled above).
                    let out = unsafe { std::slice::from_raw_parts_mut(ptr, mem.len()) };
                    chorus_kernels::finish_avg(self.job.dtype, out, self.job.world_size)?;
                }
            }
            Step::Fence => self.settle_all()?,
        }
        Ok(())
    }

    fn push(&mut self, req: Request, ptr: *mut u8, mem: Range<usize>, kind: Kind) {
        self.next_id += 1;
        self.pending.push_back(Pending {
            id: self.next_id,
            req,
            ptr,
            mem,
            kind,
        });
    }

    /// Drops completed sends and plain receives from the front of the queue.
    fn retire_finished_front(&mut self) {
        while let Some(front) = self.pending.front() {
            if matches!(front.kind, Kind::Staged { .. })
                || !matches!(front.req.test(), Some(Ok(())))
            {
                return;
            }
            self.pending.pop_front();
        }
    }

    fn take_slot(&mut self) -> Result<usize, Error> {
        while self.free.is_empty() {
            let oldest = self
                .pending
                .iter()
                .position(|p| matches!(p.kind, Kind::Staged { .. }))
                .expect("every slot in use belongs to a pending receive");
            self.settle(oldest)?;
        }
        Ok(self.free.pop().expect("a free slot"))
    }

    /// Settles, in order, every pending step for which `conflict` holds.
    fn settle_conflicts(&mut self, conflict: impl Fn(&Pending) -> bool) -> Result<(), Error> {
        while let Some(i) = self.pending.iter().position(&conflict) {
            self.settle(i)?;
        }
        Ok(())
    }

    fn settle_all(&mut self) -> Result<(), Error> {
        while !self.pending.is_empty() {
            self.settle(0)?;
        }
        Ok(())
    }

    fn position(&self, id: u64) -> usize {
        self.pending
            .iter()
            .position(|p| p.id == id)
            .expect("pending step exists")
    }

    /// Waits for `req` until the deadline, reporting a stall to the watchdog once on the way.
    fn wait(&mut self, req: &Request) -> Result<(), Error> {
        let deadline = self.job.deadline;
        if let Some(watch) = self.job.watch.filter(|_| !self.warned) {
            if let Some(warn_at) = watch.warn_at().filter(|&t| t < deadline) {
                match req.wait(warn_at) {
                    Err(TransportError::Timeout { .. }) => {
                        self.warned = true;
                        watch.stalled();
                    }
                    done => return Ok(done?),
                }
            }
        }
        Ok(req.wait(deadline)?)
    }

    /// Waits for pending step `i` (and the earlier steps it depends on) and applies it.
    fn settle(&mut self, i: usize) -> Result<(), Error> {
        let id = self.pending[i].id;
        if let Kind::Staged { with, .. } = &self.pending[i].kind {
            let (with, mem) = (with.clone(), self.pending[i].mem.clone());
            let depends = |p: &Pending| p.writes(&mem) || p.reads(&mem) || p.writes(&with);
            while let Some(j) = self
                .pending
                .iter()
                .take(self.position(id))
                .position(depends)
            {
                self.settle(j)?;
            }
        }
        let p = self
            .pending
            .remove(self.position(id))
            .expect("pending step exists");
        self.wait(&p.req)?;
        if let Kind::Staged {
            slot,
            with,
            with_ptr,
        } = p.kind
        {
            let len = p.mem.len();
            // SAFETY: the slot holds this request's completed message; `p.mem` and
            // `with` are in bounds (resolved when posted), identical or disjoint (checked
            // when posted), and no pending request touches them (settled above).
            unsafe {
                let incoming = std::slice::from_raw_parts(self.slots[slot].as_ptr(), len);
                let out = std::slice::from_raw_parts_mut(p.ptr, len);
                if with == p.mem {
                    reduce(self.job.op, self.job.dtype, out, incoming)?;
                } else {
                    let operand = std::slice::from_raw_parts(with_ptr, len);
                    reduce_into(self.job.op, self.job.dtype, out, operand, incoming)?;
                }
            }
            self.free.push(slot);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use chorus_transport::Direction;

    use super::*;

    /// A transport whose requests never complete; records whether it was aborted.
    #[derive(Default)]
    struct Stuck {
        aborted: AtomicBool,
    }

    impl Transport for Stuck {
        fn rank(&self) -> usize {
            0
        }

        fn world_size(&self) -> usize {
            2
        }

        unsafe fn isend(
            &self,
            peer: usize,
            _: u64,
            data: &[u8],
        ) -> Result<Request, TransportError> {
            Ok(Request::new(peer, Direction::Send, data.len()).0)
        }

        unsafe fn irecv(
            &self,
            peer: usize,
            _: u64,
            buf: &mut [u8],
        ) -> Result<Request, TransportError> {
            Ok(Request::new(peer, Direction::Recv, buf.len()).0)
        }

        fn probe(&self, _: usize) -> Result<Option<(u64, usize)>, TransportError> {
            Ok(None)
        }

        fn abort(&self, _: &str) {
            self.aborted.store(true, Ordering::SeqCst);
        }
    }

    /// A watchdog that panics when told of a stall, which it reports at once.
    struct PanicsWhenStalled;

    impl Watch for PanicsWhenStalled {
        fn warn_at(&self) -> Option<Instant> {
            Some(Instant::now())
        }

        fn stalled(&self) {
            panic!("stalled");
        }

        fn failed(&self, error: Error) -> Error {
            error
        }
    }

    /// Runs a receive into the whole of `out` on `transport`, then waits for it.
    fn receive(
        transport: &Stuck,
        deadline: Instant,
        watch: Option<&dyn Watch>,
        out: &mut [u8],
    ) -> Result<(), Error> {
        let job = Job {
            transport: Some(transport),
            tag: 1,
            dtype: DType::U8,
            op: ReduceOp::Sum,
            world_size: 2,
            deadline,
            depth: 1,
            watch,
        };
        let into = Loc {
            buf: Buf::Output,
            range: 0..out.len(),
        };
        let steps = [Step::Recv { peer: 1, into }, Step::Fence];
        execute(
            &job,
            &Buffers::new(None, out),
            &steps,
            &mut Workspace::default(),
        )
    }

    #[test]
    fn a_failed_call_aborts_the_transport() {
        let transport = Stuck::default();
        let err = receive(&transport, Instant::now(), None, &mut [0; 8]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Transport {
                    source: TransportError::Timeout { .. },
                    ..
                }
            ),
            "{err}"
        );
        assert!(transport.aborted.load(Ordering::SeqCst));
    }

    #[test]
    fn a_panic_with_a_request_in_flight_aborts_the_transport() {
        let transport = Stuck::default();
        let deadline = Instant::now() + Duration::from_secs(60);
        let panicked = catch_unwind(AssertUnwindSafe(|| {
            receive(&transport, deadline, Some(&PanicsWhenStalled), &mut [0; 8])
        }));
        assert!(panicked.is_err());
        assert!(transport.aborted.load(Ordering::SeqCst));
    }
}
