//! The executor: runs any schedule over any transport.
//!
//! Steps are posted in program order, but nothing waits unless a data
//! dependency demands it: a send waits only for earlier steps that write the
//! region it reads, a receive only for earlier steps that touch the region
//! it overwrites. Received chunks that must be reduced land in staging slots
//! and are reduced when a slot is needed or a later step depends on them, so
//! the wire fills the next chunk while this thread reduces the last one.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::Instant;

use chorus_kernels::{reduce, reduce_into, DType, ReduceOp};
use chorus_transport::{Request, Transport};

use crate::schedule::{Buf, Step};
use crate::Error;

/// Receive buffers for chunks that are reduced on arrival; kept between calls.
#[derive(Debug, Default)]
pub struct Staging {
    slots: Vec<Vec<u8>>,
}

impl Staging {
    /// Makes sure there are `depth` slots of at least `bytes` each.
    fn reserve(&mut self, depth: usize, bytes: usize) {
        self.slots.resize_with(depth.max(1), Vec::new);
        for slot in &mut self.slots {
            if slot.len() < bytes {
                slot.resize(bytes, 0);
            }
        }
    }
}

/// What one collective call operates on.
pub struct Job<'a> {
    /// The transport to the other ranks.
    pub transport: &'a dyn Transport,
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
}

/// The caller's memory: raw because the transport reads and writes it in
/// the background while this thread works on other regions.
pub struct Buffers {
    input: *const u8,
    output: *mut u8,
    len: usize,
    in_place: bool,
}

impl Buffers {
    /// Separate input and output buffers (or the same one, when in place).
    ///
    /// Fails if the lengths differ.
    pub fn new(input: Option<&[u8]>, output: &mut [u8]) -> Result<Buffers, Error> {
        if let Some(input) = input {
            if input.len() != output.len() {
                return Err(Error::InvalidArgument(format!(
                    "input has {} bytes but output has {}",
                    input.len(),
                    output.len()
                )));
            }
        }
        let in_place = input.is_none_or(|i| std::ptr::eq(i.as_ptr(), output.as_ptr()));
        Ok(Buffers {
            input: input.map_or(output.as_ptr(), <[u8]>::as_ptr),
            output: output.as_mut_ptr(),
            len: output.len(),
            in_place,
        })
    }
}

/// A posted request and what it touches.
struct Pending {
    id: u64,
    req: Request,
    region: Range<usize>,
    kind: Kind,
}

enum Kind {
    /// A send; `output` when it reads the output buffer.
    Send { output: bool },
    /// A receive straight into the output.
    Recv,
    /// A receive into a staging slot, reduced with `src` when settled.
    Staged { slot: usize, src: Buf },
}

impl Pending {
    fn writes(&self, region: &Range<usize>) -> bool {
        !matches!(self.kind, Kind::Send { .. }) && overlaps(&self.region, region)
    }

    fn reads(&self, region: &Range<usize>) -> bool {
        matches!(self.kind, Kind::Send { output: true }) && overlaps(&self.region, region)
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
    bufs: &Buffers,
    steps: &[Step],
    staging: &mut Staging,
) -> Result<(), Error> {
    let elem = job.dtype.size();
    let max_chunk = steps
        .iter()
        .filter_map(|s| match s {
            Step::RecvReduce { region, .. } => Some(region.len()),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    staging.reserve(job.depth, max_chunk * elem);
    let mut run = Run {
        job,
        bufs,
        elem,
        staging,
        free: (0..job.depth.max(1)).collect(),
        pending: VecDeque::new(),
        next_id: 0,
    };
    let result = steps
        .iter()
        .try_for_each(|step| run.step(step))
        .and_then(|()| run.settle_all());
    if result.is_err() {
        job.transport.abort("a collective failed on this rank");
    }
    result
}

/// Runs a single rank's schedule, which only copies (a world of one).
///
/// Fails if the schedule would talk to a peer.
pub fn execute_local(dtype: DType, bufs: &Buffers, steps: &[Step]) -> Result<(), Error> {
    // With one rank every operator, Avg included, leaves the input as it is.
    for step in steps {
        match step {
            Step::Copy { region } if !bufs.in_place => {
                let bytes = region.start * dtype.size()..region.end * dtype.size();
                assert!(bytes.end <= bufs.len, "schedule region outside the buffer");
                // SAFETY: distinct input and output buffers of `len` bytes; the range is in bounds.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bufs.input.add(bytes.start),
                        bufs.output.add(bytes.start),
                        bytes.len(),
                    );
                }
            }
            Step::Copy { .. } | Step::Finish { .. } | Step::Fence => {}
            other => {
                return Err(Error::InvalidArgument(format!(
                    "a single rank cannot run {other:?}"
                )))
            }
        }
    }
    Ok(())
}

struct Run<'a, 'j> {
    job: &'a Job<'j>,
    bufs: &'a Buffers,
    elem: usize,
    staging: &'a mut Staging,
    free: Vec<usize>,
    pending: VecDeque<Pending>,
    next_id: u64,
}

impl Run<'_, '_> {
    fn step(&mut self, step: &Step) -> Result<(), Error> {
        self.retire_finished_front();
        match step {
            Step::Send { peer, buf, region } => {
                let output = *buf == Buf::Output || self.bufs.in_place;
                if output {
                    self.settle_conflicts(region, false)?;
                }
                let bytes = self.bytes(region);
                let base = if output {
                    self.bufs.output.cast_const()
                } else {
                    self.bufs.input
                };
                // SAFETY: `bytes` lies within the caller's buffer (schedules stay in
                // 0..count); no pending step writes it (settled above), and the request
                // completes, or the transport is aborted, before `execute` returns.
                let req = unsafe {
                    let data = std::slice::from_raw_parts(base.add(bytes.start), bytes.len());
                    self.job.transport.isend(*peer, self.job.tag, data)?
                };
                self.push(req, region, Kind::Send { output });
            }
            Step::Recv { peer, region } => {
                self.settle_conflicts(region, true)?;
                let bytes = self.bytes(region);
                // SAFETY: as for sends; nothing else touches this region until the
                // request is settled (later steps that touch it settle it first).
                let req = unsafe {
                    let buf = std::slice::from_raw_parts_mut(
                        self.bufs.output.add(bytes.start),
                        bytes.len(),
                    );
                    self.job.transport.irecv(*peer, self.job.tag, buf)?
                };
                self.push(req, region, Kind::Recv);
            }
            Step::RecvReduce { peer, src, region } => {
                let slot = self.take_slot()?;
                let len = self.bytes(region).len();
                let buf = &mut self.staging.slots[slot][..len];
                // SAFETY: the slot is owned by this request until it is settled; the
                // staging buffers outlive `execute`, which settles or aborts everything.
                let req = unsafe { self.job.transport.irecv(*peer, self.job.tag, buf)? };
                self.push(req, region, Kind::Staged { slot, src: *src });
            }
            Step::Copy { region } => {
                if !self.bufs.in_place {
                    self.settle_conflicts(region, true)?;
                    let bytes = self.bytes(region);
                    // SAFETY: input and output are distinct buffers of `len` bytes;
                    // no pending request touches this output region (settled above).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.bufs.input.add(bytes.start),
                            self.bufs.output.add(bytes.start),
                            bytes.len(),
                        );
                    }
                }
            }
            Step::Finish { region } => {
                if self.job.op == ReduceOp::Avg && self.job.world_size > 1 {
                    self.settle_conflicts(region, true)?;
                    let out = self.output(region);
                    chorus_kernels::finish_avg(self.job.dtype, out, self.job.world_size)?;
                }
            }
            Step::Fence => self.settle_all()?,
        }
        Ok(())
    }

    fn bytes(&self, region: &Range<usize>) -> Range<usize> {
        region.start * self.elem..region.end * self.elem
    }

    /// The output bytes of `region`, for this thread to write.
    #[allow(clippy::mut_from_ref)]
    fn output(&self, region: &Range<usize>) -> &mut [u8] {
        let bytes = self.bytes(region);
        debug_assert!(bytes.end <= self.bufs.len);
        // SAFETY: within the caller's output buffer; callers settle every pending
        // request touching `region` first, and the slice dies before the next step.
        unsafe { std::slice::from_raw_parts_mut(self.bufs.output.add(bytes.start), bytes.len()) }
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

    /// Settles every pending step that writes `region` (and, if `write`, reads it).
    fn settle_conflicts(&mut self, region: &Range<usize>, write: bool) -> Result<(), Error> {
        while let Some(i) = self
            .pending
            .iter()
            .position(|p| p.writes(region) || (write && p.reads(region)))
        {
            self.settle(i)?;
        }
        Ok(())
    }

    fn position(&self, id: u64) -> usize {
        self.pending
            .iter()
            .position(|p| p.id == id)
            .expect("pending step exists")
    }

    fn push(&mut self, req: Request, region: &Range<usize>, kind: Kind) {
        self.next_id += 1;
        self.pending.push_back(Pending {
            id: self.next_id,
            req,
            region: region.clone(),
            kind,
        });
    }

    fn settle_all(&mut self) -> Result<(), Error> {
        while !self.pending.is_empty() {
            self.settle(0)?;
        }
        Ok(())
    }

    /// Waits for pending step `i` (and what it depends on) and applies it.
    fn settle(&mut self, i: usize) -> Result<(), Error> {
        let id = self.pending[i].id;
        if let Kind::Staged { .. } = self.pending[i].kind {
            // Earlier steps touching the region come first (program order).
            let region = self.pending[i].region.clone();
            loop {
                let i = self.position(id);
                match self
                    .pending
                    .iter()
                    .take(i)
                    .position(|p| p.writes(&region) || p.reads(&region))
                {
                    Some(j) => self.settle(j)?,
                    None => break,
                }
            }
        }
        let i = self.position(id);
        let p = self.pending.remove(i).expect("index in range");
        p.req.wait(self.job.deadline)?;
        if let Kind::Staged { slot, src } = p.kind {
            let len = self.bytes(&p.region).len();
            let incoming = &self.staging.slots[slot][..len];
            let out = self.output(&p.region);
            if src == Buf::Output || self.bufs.in_place {
                reduce(self.job.op, self.job.dtype, out, incoming)?;
            } else {
                let bytes = self.bytes(&p.region);
                // SAFETY: the input buffer is distinct from the output and never written.
                let input = unsafe {
                    std::slice::from_raw_parts(self.bufs.input.add(bytes.start), bytes.len())
                };
                reduce_into(self.job.op, self.job.dtype, out, input, incoming)?;
            }
            self.free.push(slot);
        }
        Ok(())
    }
}
