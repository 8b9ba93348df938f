//! The executor as a state machine: it turns one rank's steps into actions
//! (post a send or a receive, wait, reduce, copy, finish) as their data
//! dependencies allow, and takes completions back. It does no I/O and reads
//! no clock; a driver performs its actions (over a transport, in memory, or
//! in simulated time).
//!
//! Steps are posted in program order, but nothing waits unless a data
//! dependency demands it: a send waits only for earlier steps that write the
//! region it reads, a receive only for earlier steps that touch the region
//! it overwrites. Received chunks that must be reduced land in staging slots
//! and are reduced when a slot is needed or a later step depends on them.

use std::collections::VecDeque;
use std::ops::Range;

use crate::schedule::{overlaps, scratch_len, Buf, Loc, Step};
use crate::Error;

/// A byte range of one buffer, checked to lie within it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Region {
    /// Which buffer.
    pub buf: Buf,
    /// First byte.
    pub start: usize,
    /// Length in bytes.
    pub len: usize,
}

/// Where a receive lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dest {
    /// Straight into the buffers.
    Region(Region),
    /// Into the first `len` bytes of staging slot `slot`.
    Slot { slot: usize, len: usize },
}

/// A reduction of a received chunk, to do before the next action (its slot may be
/// reused by it): `into = with op slot` (`with: None`: `into = into op slot`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reduce {
    pub into: Region,
    pub with: Option<Region>,
    pub slot: usize,
}

/// What the driver does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// Post a send of `from` to `peer`, then hand its request to [`Machine::posted`].
    Send { id: u64, peer: usize, from: Region },
    /// Post a receive from `peer` into `into`, then hand its request to [`Machine::posted`].
    Recv { id: u64, peer: usize, into: Dest },
    /// Wait for request `id` ([`Machine::waiting`]), then report it to [`Machine::complete`].
    Wait { id: u64 },
    /// `into = from` (equal lengths; the two may overlap).
    Copy { from: Region, into: Region },
    /// Finish the fully reduced `at` (divide by the world size for `Avg`).
    Finish { at: Region },
    /// Every step has completed.
    Done,
}

/// The memory one call works on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layout {
    /// Bytes per element.
    pub elem: usize,
    /// Bytes of input.
    pub input_len: usize,
    /// Where the input lies in the output (`Some(0)`: in place), or `None`: apart from it.
    pub input_at: Option<usize>,
    /// Bytes of output.
    pub output_len: usize,
    /// Staging slots (receive-and-reduce chunks in flight at once; at least one).
    pub depth: usize,
    /// Bytes of scratch (see [`Needs::of`]).
    pub scratch_len: usize,
    /// Whether `Finish` steps do anything (`Avg` over more than one rank).
    pub finish: bool,
}

/// Bytes a call needs besides the caller's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Needs {
    /// Bytes of each staging slot.
    pub slot_bytes: usize,
    /// Bytes of scratch.
    pub scratch_bytes: usize,
}

impl Needs {
    /// What `steps` need, in elements of `elem` bytes.
    pub fn of(steps: &[Step], elem: usize) -> Needs {
        let max_chunk = steps
            .iter()
            .filter_map(|s| match s {
                Step::RecvReduce { into, .. } => Some(into.len()),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        Needs {
            slot_bytes: max_chunk * elem,
            scratch_bytes: scratch_len(steps) * elem,
        }
    }
}

/// A rank's steps as the machine reads them: the whole program, or a window of it
/// that the driver loads as the machine moves on.
pub(crate) trait Program {
    /// Step `pc`, or `None` past the last.
    fn step(&mut self, pc: usize) -> Option<&Step>;
}

impl Program for &[Step] {
    #[inline]
    fn step(&mut self, pc: usize) -> Option<&Step> {
        self.get(pc)
    }
}

/// A posted request and what it touches (addresses in one space for all buffers).
#[derive(Debug)]
struct Pending<R> {
    id: u64,
    req: R,
    mem: Range<usize>,
    kind: Kind,
}

#[derive(Debug, Clone)]
enum Kind {
    /// A send, reading `mem`.
    Send,
    /// A receive straight into `mem`.
    Recv,
    /// A receive into a staging slot; when settled, `mem = with op slot`.
    Staged { slot: usize, with: Range<usize> },
}

impl<R> Pending<R> {
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

/// One rank's executor for one call at a time; `R` is the driver's handle of a posted request.
///
/// A driver calls [`start`](Self::start), then [`next`](Self::next) until
/// [`Action::Done`] or an error, performing each action; after a failure it
/// calls [`reset`](Self::reset). The machine keeps its queues between calls.
#[derive(Debug)]
pub(crate) struct Machine<R> {
    /// Posted requests not settled yet, oldest first.
    pending: VecDeque<Pending<R>>,
    /// Free staging slots.
    free: Vec<usize>,
    /// The request posted by the last action, once the driver has its handle.
    unposted: Option<(u64, Range<usize>, Kind)>,
    /// The pending entry of the last `Wait`.
    wait_at: usize,
    /// Start of each buffer in the one address space (input, output, scratch).
    base: [usize; 3],
    /// Length of each buffer.
    len: [usize; 3],
    elem: usize,
    finish: bool,
    /// The next step.
    pc: usize,
    /// Whether step `pc` has not been looked at yet.
    fresh: bool,
    next_id: u64,
}

impl<R> Default for Machine<R> {
    fn default() -> Machine<R> {
        Machine {
            pending: VecDeque::new(),
            free: Vec::new(),
            unposted: None,
            wait_at: 0,
            base: [0; 3],
            len: [0; 3],
            elem: 1,
            finish: false,
            pc: 0,
            fresh: true,
            next_id: 0,
        }
    }
}

fn index(buf: Buf) -> usize {
    match buf {
        Buf::Input => 0,
        Buf::Output => 1,
        Buf::Scratch => 2,
    }
}

impl<R> Machine<R> {
    /// Starts a call on `layout`.
    pub fn start(&mut self, layout: &Layout) {
        self.reset();
        let out = layout.output_len;
        let input = layout.input_at.unwrap_or(out);
        self.base = [input, 0, out + layout.input_len];
        self.len = [layout.input_len, out, layout.scratch_len];
        self.elem = layout.elem;
        self.finish = layout.finish;
        self.free.extend(0..layout.depth.max(1));
    }

    /// The step the machine is at (the one after the last posted, or the one it waits to run).
    pub fn pc(&self) -> usize {
        self.pc
    }

    /// Forgets the call in progress (dropping its requests' handles).
    pub fn reset(&mut self) {
        self.pending.clear();
        self.free.clear();
        self.unposted = None;
        self.pc = 0;
        self.fresh = true;
    }

    /// The handle of the request the last [`Action::Wait`] names.
    pub fn waiting(&self) -> &R {
        &self.pending[self.wait_at].req
    }

    /// The driver posted the last `Send` or `Recv` action's request as `req`.
    pub fn posted(&mut self, req: R) {
        let (id, mem, kind) = self.unposted.take().expect("an action to post");
        self.pending.push_back(Pending { id, req, mem, kind });
    }

    /// Request `id`, named by the last [`Action::Wait`], has completed; returns the
    /// reduction to do now if it was a staged receive.
    #[inline]
    pub fn complete(&mut self, id: u64) -> Option<Reduce> {
        let at = if self.pending.get(self.wait_at).is_some_and(|p| p.id == id) {
            self.wait_at
        } else {
            self.pending
                .iter()
                .position(|p| p.id == id)
                .expect("a pending request")
        };
        let p = self.pending.remove(at).expect("a pending request");
        match p.kind {
            Kind::Staged { slot, with } => {
                self.free.push(slot);
                Some(Reduce {
                    into: self.region(&p.mem),
                    with: (with != p.mem).then(|| self.region(&with)),
                    slot,
                })
            }
            Kind::Send | Kind::Recv => None,
        }
    }

    /// The next action. Before a step is first looked at, `finished` is asked about the
    /// oldest sends and receives (not staged ones), which are dropped while it says yes.
    ///
    /// Fails when a step leaves its buffer, writes the input, or reduces mismatched regions.
    #[inline]
    pub fn next(
        &mut self,
        mut steps: impl Program,
        mut finished: impl FnMut(&R) -> bool,
    ) -> Result<Action, Error> {
        loop {
            let Some(step) = steps.step(self.pc) else {
                return Ok(if self.pending.is_empty() {
                    Action::Done
                } else {
                    self.settle(0)
                });
            };
            if self.fresh {
                self.fresh = false;
                self.retire_finished_front(&mut finished);
            }
            match step {
                Step::Send { peer, from } => {
                    let (from, mem) = self.resolve(from)?;
                    if let Some(i) = self.find(|p| p.writes(&mem)) {
                        return Ok(self.settle(i));
                    }
                    let id = self.post(mem, Kind::Send);
                    return Ok(Action::Send {
                        id,
                        peer: *peer,
                        from,
                    });
                }
                Step::Recv { peer, into } => {
                    let (into, mem) = self.resolve_target(into)?;
                    if let Some(i) = self.find(|p| p.writes(&mem) || p.reads(&mem)) {
                        return Ok(self.settle(i));
                    }
                    let id = self.post(mem, Kind::Recv);
                    return Ok(Action::Recv {
                        id,
                        peer: *peer,
                        into: Dest::Region(into),
                    });
                }
                Step::RecvReduce { peer, with, into } => {
                    let (with, with_mem) = self.resolve(with)?;
                    let (into, mem) = self.resolve_target(into)?;
                    if with.len != into.len || (with_mem != mem && overlaps(&with_mem, &mem)) {
                        return Err(Error::Internal(format!(
                            "schedule reduces {into:?} from a mismatched operand {with:?}"
                        )));
                    }
                    let Some(&slot) = self.free.last() else {
                        let oldest = self
                            .find(|p| matches!(p.kind, Kind::Staged { .. }))
                            .expect("every slot in use belongs to a pending receive");
                        return Ok(self.settle(oldest));
                    };
                    self.free.pop();
                    let len = mem.len();
                    let id = self.post(
                        mem,
                        Kind::Staged {
                            slot,
                            with: with_mem,
                        },
                    );
                    return Ok(Action::Recv {
                        id,
                        peer: *peer,
                        into: Dest::Slot { slot, len },
                    });
                }
                Step::Copy { from, into } => {
                    let (from, from_mem) = self.resolve(from)?;
                    let (into, mem) = self.resolve_target(into)?;
                    if from.len != into.len {
                        return Err(Error::Internal(format!(
                            "schedule copies {from:?} into {into:?} of another length"
                        )));
                    }
                    if from_mem != mem {
                        let conflict =
                            |p: &Pending<R>| p.writes(&from_mem) || p.writes(&mem) || p.reads(&mem);
                        if let Some(i) = self.find(conflict) {
                            return Ok(self.settle(i));
                        }
                        self.advance();
                        return Ok(Action::Copy { from, into });
                    }
                }
                Step::Finish { at } => {
                    if self.finish {
                        let (at, mem) = self.resolve_target(at)?;
                        if let Some(i) = self.find(|p| p.writes(&mem) || p.reads(&mem)) {
                            return Ok(self.settle(i));
                        }
                        self.advance();
                        return Ok(Action::Finish { at });
                    }
                }
                Step::Fence => {
                    if !self.pending.is_empty() {
                        return Ok(self.settle(0));
                    }
                }
            }
            self.advance();
        }
    }

    fn advance(&mut self) {
        self.pc += 1;
        self.fresh = true;
    }

    /// Readies the current step's request (posted once the driver has its handle) and
    /// moves past the step.
    fn post(&mut self, mem: Range<usize>, kind: Kind) -> u64 {
        self.next_id += 1;
        self.unposted = Some((self.next_id, mem, kind));
        self.advance();
        self.next_id
    }

    fn find(&self, conflict: impl Fn(&Pending<R>) -> bool) -> Option<usize> {
        self.pending.iter().position(conflict)
    }

    /// Drops completed sends and plain receives from the front of the queue.
    fn retire_finished_front(&mut self, finished: &mut impl FnMut(&R) -> bool) {
        while let Some(front) = self.pending.front() {
            if matches!(front.kind, Kind::Staged { .. }) || !finished(&front.req) {
                return;
            }
            self.pending.pop_front();
        }
    }

    /// The wait that settling pending entry `i` starts with: the entry itself, or first
    /// the earliest earlier one a reduction into it depends on (and so on down).
    #[inline]
    fn settle(&mut self, mut i: usize) -> Action {
        while let Some(j) = self.dependency(i) {
            i = j;
        }
        self.wait_at = i;
        Action::Wait {
            id: self.pending[i].id,
        }
    }

    /// The first earlier pending entry that staged entry `i`'s reduction must follow.
    #[inline]
    fn dependency(&self, i: usize) -> Option<usize> {
        let p = &self.pending[i];
        let Kind::Staged { with, .. } = &p.kind else {
            return None;
        };
        self.pending
            .iter()
            .take(i)
            .position(|q| q.writes(&p.mem) || q.reads(&p.mem) || q.writes(with))
    }

    /// The region at addresses `mem` (a resolved location; in place, the input's bytes are
    /// named as the output's).
    #[inline]
    fn region(&self, mem: &Range<usize>) -> Region {
        let (buf, base) = if mem.start >= self.base[2] {
            (Buf::Scratch, self.base[2])
        } else if mem.start < self.len[1] {
            (Buf::Output, 0)
        } else {
            (Buf::Input, self.base[0])
        };
        Region {
            buf,
            start: mem.start - base,
            len: mem.len(),
        }
    }

    /// The region `loc` names and its addresses; fails if it leaves its buffer.
    #[inline]
    pub fn resolve(&self, loc: &Loc) -> Result<(Region, Range<usize>), Error> {
        let b = index(loc.buf);
        let (start, end) = (loc.range.start * self.elem, loc.range.end * self.elem);
        if end > self.len[b] || start > end {
            return Err(Error::Internal(format!(
                "schedule step {loc:?} reaches past its buffer of {} bytes",
                self.len[b]
            )));
        }
        let region = Region {
            buf: loc.buf,
            start,
            len: end - start,
        };
        Ok((region, self.base[b] + start..self.base[b] + end))
    }

    /// Resolves a location a step writes; the input is never written.
    pub fn resolve_target(&self, loc: &Loc) -> Result<(Region, Range<usize>), Error> {
        if loc.buf == Buf::Input {
            return Err(Error::Internal(format!(
                "schedule writes its input at {loc:?}"
            )));
        }
        self.resolve(loc)
    }
}
