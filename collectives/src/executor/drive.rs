//! The real driver: performs the machine's actions on the caller's buffers
//! with the transport and the kernels, waiting with the deadline and the watchdog;
//! programs planned as exchanges ([`Drive::Exchanges`]) go to the transport pair by pair.

use chorus_kernels::{
    copy_streaming, reduce, reduce_into, reduce_into_streaming, DType, KernelError, ReduceOp,
};
use chorus_transport::{Payload, Request, Transport, TransportError};

use super::machine::{Action, Dest, Layout, Machine, Needs, Reduce, Region};
use super::{Buffers, Job, Watch, Workspace};
use crate::schedule::plan::{Drive, Messages, EXCHANGE_BYTES};
use crate::schedule::{overlaps, Buf, Step};
use crate::Error;

/// Runs `messages` to completion, as they are planned to be driven (by the machine when
/// there is no transport, which reports a schedule that communicates).
///
/// On any error the transport is aborted before returning, so no request
/// still refers to the caller's buffers.
pub(crate) fn execute(
    job: &Job<'_>,
    bufs: &Buffers<'_>,
    messages: &Messages,
    work: &mut Workspace,
) -> Result<(), Error> {
    let (steps, elem) = (&messages.steps[..], job.dtype.size());
    let exchanged = job.transport.is_some() && messages.drive == Drive::Exchanges;
    let needs = Needs::of(steps, elem);
    let layout = Layout {
        elem,
        input_len: bufs.input_len,
        input_at: bufs.input_at,
        output_len: bufs.output_len,
        depth: job.depth,
        scratch_len: needs.scratch_bytes,
        finish: job.op == ReduceOp::Avg && job.world_size > 1,
    };
    work.machine.start(&layout);
    // An exchange's reply lands in the first slot, reduced or not.
    let slot_bytes = match exchanged {
        true => EXCHANGE_BYTES,
        false => needs.slot_bytes,
    };
    work.reserve(job.depth, slot_bytes, needs.scratch_bytes);
    let mut run = Run {
        job,
        bufs,
        scratch: work.scratch.as_mut_ptr(),
        slots: &mut work.slots,
        machine: &mut work.machine,
        warned: false,
    };
    match exchanged {
        true => run.exchange(steps),
        false => run.run(steps),
    }
    .map_err(|error| failed(error, job.watch, job.transport))
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
    scratch: *mut u8,
    slots: &'a mut [Vec<u8>],
    machine: &'a mut Machine<Request>,
    /// Whether the watchdog has reported this call as stalled.
    warned: bool,
}

impl Drop for Run<'_, '_> {
    /// Empties the machine's queue, also when a panic unwinds. After a failure the transport
    /// has been aborted already; a panic aborts it here, so no request still uses the
    /// caller's buffers once the unwinding frees them.
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Some(transport) = self.job.transport {
                transport.abort("a collective panicked on this rank");
            }
        }
        self.machine.reset();
    }
}

impl Run<'_, '_> {
    fn transport(&self) -> Result<&dyn Transport, Error> {
        self.job
            .transport
            .ok_or_else(|| Error::Internal("a schedule for one rank tried to communicate".into()))
    }

    /// The address of `region`'s first byte.
    fn ptr(&self, region: Region) -> *mut u8 {
        let base = match region.buf {
            Buf::Input => self.bufs.input.cast_mut(),
            Buf::Output => self.bufs.output,
            Buf::Scratch => self.scratch,
        };
        // SAFETY: the machine checked that the region lies within its buffer, whose length
        // it was given (the scratch holds at least what it asked for).
        unsafe { base.add(region.start) }
    }

    fn run(&mut self, steps: &[Step]) -> Result<(), Error> {
        loop {
            let action = self
                .machine
                .next(steps, |req| matches!(req.test(), Some(Ok(()))))?;
            match action {
                Action::Send { peer, from, .. } => {
                    let ptr = self.ptr(from);
                    // SAFETY: `from` lies within the caller's buffers or the scratch; the
                    // machine posts no write to it until this request is settled, which
                    // happens (or the transport is aborted) before `execute` returns.
                    let req = unsafe {
                        let data = std::slice::from_raw_parts(ptr.cast_const(), from.len);
                        let payload = match self.bufs.lends(from.buf) {
                            true => Payload::Lend(data),
                            false => Payload::Send(data),
                        };
                        self.transport()?
                            .post(peer, self.job.tag, payload)
                            .map_err(|e| Error::transport(self.job.rank, e))?
                    };
                    self.machine.posted(req);
                }
                Action::Recv { peer, into, .. } => {
                    let (ptr, len, streaming) = match into {
                        Dest::Region(region) => {
                            (self.ptr(region), region.len, self.streams(region))
                        }
                        Dest::Slot { slot, len } => (self.slots[slot].as_mut_ptr(), len, false),
                    };
                    // SAFETY: as for sends; nothing else touches the region until the
                    // request is settled, because the machine settles it before any later
                    // step that touches it. A slot holds at least the largest
                    // receive-and-reduce of the schedule (`Workspace::reserve`) and belongs
                    // to this request until its reduction.
                    let req = unsafe {
                        let buf = std::slice::from_raw_parts_mut(ptr, len);
                        let payload = match streaming {
                            true => Payload::RecvStreaming(buf),
                            false => Payload::Recv(buf),
                        };
                        self.transport()?
                            .post(peer, self.job.tag, payload)
                            .map_err(|e| Error::transport(self.job.rank, e))?
                    };
                    self.machine.posted(req);
                }
                Action::Wait { id } => {
                    wait(self.job, &mut self.warned, self.machine.waiting())?;
                    if let Some(reduction) = self.machine.complete(id) {
                        self.reduce(reduction)?;
                    }
                }
                Action::Copy { from, into } => {
                    // SAFETY: both regions are in bounds and no pending request touches them
                    // (settled by the machine); `copy` allows overlap.
                    unsafe {
                        std::ptr::copy(self.ptr(from).cast_const(), self.ptr(into), into.len)
                    };
                }
                Action::Finish { at } => {
                    // SAFETY: in bounds, and no pending request touches it (settled first).
                    let out = unsafe { std::slice::from_raw_parts_mut(self.ptr(at), at.len) };
                    chorus_kernels::finish_avg(self.job.dtype, out, self.job.world_size)?;
                }
                Action::Done => return Ok(()),
            }
        }
    }
}

impl Run<'_, '_> {
    /// Runs a program of exchanges (see [`Messages::of`]) pair by pair: both messages of a
    /// pair through one [`Transport::sendrecv`], the reply landing in the first staging
    /// slot, then reduced or copied into place. Regions are checked as the machine checks
    /// them.
    fn exchange(&mut self, steps: &[Step]) -> Result<(), Error> {
        let mut rest = steps;
        while let Some((step, tail)) = rest.split_first() {
            rest = tail;
            let (to, from) = match step {
                Step::Send { peer, from } => (*peer, self.machine.resolve(from)?.0),
                Step::Finish { at } => {
                    let at = self.machine.resolve_target(at)?.0;
                    if self.job.op == ReduceOp::Avg && self.job.world_size > 1 {
                        // SAFETY: in bounds (`resolve_target`), and nothing is in flight.
                        let out = unsafe { std::slice::from_raw_parts_mut(self.ptr(at), at.len) };
                        chorus_kernels::finish_avg(self.job.dtype, out, self.job.world_size)?;
                    }
                    continue;
                }
                _ => continue,
            };
            let (recv, tail) = tail.split_first().expect("a send's pair (`Messages::of`)");
            rest = tail;
            let (source, into, with) = match recv {
                Step::Recv { peer, into } => (*peer, into, None),
                Step::RecvReduce { peer, with, into } => (*peer, into, Some(with)),
                _ => unreachable!("a send's pair receives (`Messages::of`)"),
            };
            let (into, into_mem) = self.machine.resolve_target(into)?;
            // The operand, unless it is `into` itself (`None`): of its length, and apart.
            let operand = match with.map(|w| self.machine.resolve(w)).transpose()? {
                Some((with, mem))
                    if with.len != into.len || (mem != into_mem && overlaps(&mem, &into_mem)) =>
                {
                    return Err(Error::Internal(format!(
                        "schedule reduces {into:?} from a mismatched operand {with:?}"
                    )))
                }
                Some((with, mem)) => (mem != into_mem).then_some(with),
                None => None,
            };
            let slot = self.slots[0].as_mut_ptr();
            // SAFETY: `from` lies in the caller's buffers and the slot holds EXCHANGE_BYTES
            // (`Workspace::reserve`), no more than a message here; both stay put until the
            // requests returned are settled below, or the transport is aborted on failure.
            let pending = unsafe {
                let data = std::slice::from_raw_parts(self.ptr(from).cast_const(), from.len);
                let reply = std::slice::from_raw_parts_mut(slot, into.len);
                self.transport()?
                    .sendrecv(to, source, self.job.tag, data, reply)
                    .map_err(|e| Error::transport(self.job.rank, e))?
            };
            for req in [pending.recv, pending.send].iter().flatten() {
                wait(self.job, &mut self.warned, req)?;
            }
            // SAFETY: the reply has arrived in the slot, which nothing else touches; `into`
            // and the operand are in bounds and apart (checked above), and nothing is in
            // flight.
            unsafe {
                let reply = std::slice::from_raw_parts(slot.cast_const(), into.len);
                let out = std::slice::from_raw_parts_mut(self.ptr(into), into.len);
                match (with, operand) {
                    (None, _) if self.streams(into) => copy_streaming(out, reply)?,
                    (None, _) => out.copy_from_slice(reply),
                    (Some(_), None) => reduce(self.job.op, self.job.dtype, out, reply)?,
                    (Some(_), Some(operand)) => {
                        let operand =
                            std::slice::from_raw_parts(self.ptr(operand).cast_const(), into.len);
                        self.reduce_into(into)(self.job.op, self.job.dtype, out, operand, reply)?
                    }
                }
            }
        }
        Ok(())
    }

    /// The out-of-place reduction kernel for results landing in `into`: one that streams
    /// past the caches into an output the call streams ([`Buffers::stream`]).
    fn reduce_into(&self, into: Region) -> ReduceInto {
        match self.streams(into) {
            true => reduce_into_streaming,
            false => reduce_into,
        }
    }

    /// Whether writes into `region` stream past the caches ([`Buffers::stream`]).
    fn streams(&self, region: Region) -> bool {
        region.buf == Buf::Output && self.bufs.streamed
    }

    /// Reduces a received chunk from its staging slot.
    fn reduce(&self, Reduce { into, with, slot }: Reduce) -> Result<(), Error> {
        let len = into.len;
        // SAFETY: the slot holds this request's completed message; `into` and `with` are in
        // bounds, of equal length, identical or disjoint (checked by the machine), and no
        // pending request touches them (settled first).
        unsafe {
            let incoming = std::slice::from_raw_parts(self.slots[slot].as_ptr(), len);
            let out = std::slice::from_raw_parts_mut(self.ptr(into), len);
            match with {
                None => reduce(self.job.op, self.job.dtype, out, incoming)?,
                Some(with) => {
                    let operand = std::slice::from_raw_parts(self.ptr(with).cast_const(), len);
                    self.reduce_into(into)(self.job.op, self.job.dtype, out, operand, incoming)?
                }
            }
        }
        Ok(())
    }
}

/// An out-of-place reduction kernel: `out = a op b`.
type ReduceInto = fn(ReduceOp, DType, &mut [u8], &[u8], &[u8]) -> Result<(), KernelError>;

/// Waits for `req` until the job's deadline, reporting a stall to the watchdog once on the way.
fn wait(job: &Job<'_>, warned: &mut bool, req: &Request) -> Result<(), Error> {
    let deadline = job.deadline;
    if let Some(watch) = job.watch.filter(|_| !*warned) {
        if let Some(warn_at) = watch.warn_at().filter(|&t| t < deadline) {
            match req.wait(warn_at) {
                Err(TransportError::Timeout { .. }) => {
                    *warned = true;
                    if let Some(gone) = watch.stalled() {
                        return Err(Error::transport(job.rank, gone));
                    }
                }
                done => return done.map_err(|e| Error::transport(job.rank, e)),
            }
        }
    }
    req.wait(deadline)
        .map_err(|e| Error::transport(job.rank, e))
}
