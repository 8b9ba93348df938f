//! The regions one rank's steps in flight still read or write: for each
//! buffer, disjoint element segments with the latest known completion of
//! their readers and writers and the records of those not known yet.
//!
//! No step writes the input (the evaluator rejects schedules that would, as
//! the executor does), so the input is not tracked at all.
//!
//! Segments are kept sorted in a vector: a lookup is a binary search plus
//! the k segments touched, so schedules that queue thousands of chunks
//! (recursive doubling at large sizes, gathers with W-1 receives posted at
//! once) stay cheap; schedules touch addresses mostly in order, so inserts
//! land near the end. Segments that can no longer delay anything are swept
//! out as the vectors grow.

/// No record.
pub(super) const NONE: u32 = u32::MAX;

/// A small set of record ids (usually none or one), two inline.
#[derive(Debug, Clone)]
struct Ids {
    a: u32,
    b: u32,
    /// Any beyond two (rare: a segment awaited by three or more records).
    more: Option<Box<[u32]>>,
}

impl Default for Ids {
    fn default() -> Ids {
        Ids {
            a: NONE,
            b: NONE,
            more: None,
        }
    }
}

impl Ids {
    fn first(&self) -> Option<u32> {
        (self.a != NONE).then_some(self.a)
    }

    fn is_empty(&self) -> bool {
        self.a == NONE
    }

    fn insert(&mut self, id: u32) {
        if self.a == NONE {
            self.a = id;
        } else if self.a == id || self.b == id {
        } else if self.b == NONE {
            self.b = id;
        } else {
            let mut more = self.more.take().map_or_else(Vec::new, Vec::from);
            if !more.contains(&id) {
                more.push(id);
            }
            self.more = Some(more.into_boxed_slice());
        }
    }

    fn remove(&mut self, id: u32) {
        let mut more = self.more.take().map_or_else(Vec::new, Vec::from);
        if self.a == id {
            self.a = NONE;
        } else if self.b == id {
            self.b = NONE;
        } else {
            more.retain(|&x| x != id);
        }
        if self.b == NONE {
            self.b = more.pop().unwrap_or(NONE);
        }
        if self.a == NONE {
            (self.a, self.b) = (self.b, more.pop().unwrap_or(NONE));
        }
        self.more = (!more.is_empty()).then(|| more.into_boxed_slice());
    }

    fn each(&self, mut f: impl FnMut(u32)) {
        for id in [self.a, self.b] {
            if id != NONE {
                f(id);
            }
        }
        if let Some(more) = &self.more {
            more.iter().for_each(|&id| f(id));
        }
    }
}

/// One segment `start..end` of buffer `buf`.
#[derive(Debug, Clone)]
struct Seg {
    buf: u8,
    start: u32,
    end: u32,
    /// Latest known completion of a step writing it.
    write: f64,
    /// Latest known completion of a step reading it.
    read: f64,
    /// Writers whose completion is not known yet.
    pending_writes: Ids,
    /// Readers whose completion is not known yet.
    pending_reads: Ids,
}

impl Seg {
    fn empty(buf: u8, start: u32, end: u32) -> Seg {
        Seg {
            buf,
            start,
            end,
            write: f64::NEG_INFINITY,
            read: f64::NEG_INFINITY,
            pending_writes: Ids::default(),
            pending_reads: Ids::default(),
        }
    }

    /// Whether this segment lies wholly before `buf[x..]`.
    fn before(&self, buf: u8, x: u32) -> bool {
        self.buf < buf || (self.buf == buf && self.end <= x)
    }

    fn dead(&self, now: f64) -> bool {
        self.pending_writes.is_empty()
            && self.pending_reads.is_empty()
            && self.write <= now
            && self.read <= now
    }
}

/// What earlier steps in flight mean for a new one.
pub(super) enum Conflict {
    /// All are known; the latest completes then (at least `now`).
    Ready(f64),
    /// This record is not known yet.
    Blocked(u32),
}

/// The buffer nothing writes (the caller's input): never tracked.
const INPUT: u8 = 0;

/// The in-flight regions of one rank: segments sorted by buffer, then start.
#[derive(Debug, Default)]
pub(super) struct Regions {
    segs: Vec<Seg>,
    swept: usize,
}

impl Regions {
    /// Earlier writers of `buf[s..e]` (and readers, if `reads`): the latest
    /// known completion (at least `now`), or a record not known yet.
    pub fn check(&mut self, buf: u8, s: u32, e: u32, reads: bool, now: f64) -> Conflict {
        let mut latest = now;
        let mut blocked = NONE;
        self.visit(buf, s, e, |seg| {
            if blocked != NONE {
                return;
            }
            if let Some(id) = seg.pending_writes.first() {
                blocked = id;
            } else if let (true, Some(id)) = (reads, seg.pending_reads.first()) {
                blocked = id;
            } else {
                latest = latest.max(seg.write);
                if reads {
                    latest = latest.max(seg.read);
                }
            }
        });
        if blocked == NONE {
            Conflict::Ready(latest)
        } else {
            Conflict::Blocked(blocked)
        }
    }

    /// Like `check`, but never blocks: the latest known completion, with the
    /// records not known yet added to `pending`.
    pub fn collect(
        &mut self,
        buf: u8,
        s: u32,
        e: u32,
        reads: bool,
        now: f64,
        pending: &mut Vec<u32>,
    ) -> f64 {
        let mut latest = now;
        self.visit(buf, s, e, |seg| {
            let mut add = |id| {
                if !pending.contains(&id) {
                    pending.push(id);
                }
            };
            seg.pending_writes.each(&mut add);
            latest = latest.max(seg.write);
            if reads {
                seg.pending_reads.each(&mut add);
                latest = latest.max(seg.read);
            }
        });
        latest
    }

    /// A step reads `buf[s..e]`, completing at `t`.
    pub fn read(&mut self, buf: u8, s: u32, e: u32, t: f64) {
        self.apply(buf, s, e, |seg| seg.read = seg.read.max(t));
    }

    /// A step writes `buf[s..e]`, completing at `t`.
    pub fn write(&mut self, buf: u8, s: u32, e: u32, t: f64) {
        self.apply(buf, s, e, |seg| seg.write = seg.write.max(t));
    }

    /// Record `id` will read `buf[s..e]`.
    pub fn read_pending(&mut self, buf: u8, s: u32, e: u32, id: u32) {
        self.apply(buf, s, e, |seg| seg.pending_reads.insert(id));
    }

    /// Record `id` will write `buf[s..e]`.
    pub fn write_pending(&mut self, buf: u8, s: u32, e: u32, id: u32) {
        self.apply(buf, s, e, |seg| seg.pending_writes.insert(id));
    }

    /// Record `id`, reading (`write == false`) or writing `buf[s..e]`, completes at `t`.
    pub fn resolve(&mut self, buf: u8, s: u32, e: u32, write: bool, id: u32, t: f64) {
        self.visit(buf, s, e, |seg| {
            if write {
                seg.pending_writes.remove(id);
                seg.write = seg.write.max(t);
            } else {
                seg.pending_reads.remove(id);
                seg.read = seg.read.max(t);
            }
        });
    }

    /// Forgets everything (after a fence, when all is complete by `now`).
    pub fn clear(&mut self) {
        self.segs.clear();
        self.swept = 0;
    }

    /// Drops segments that can no longer delay a step issued at `now` or later,
    /// when the maps have doubled since the last sweep.
    pub fn sweep(&mut self, now: f64) {
        if self.segs.len() <= 2 * self.swept + 16 {
            return;
        }
        self.segs.retain(|seg| !seg.dead(now));
        self.swept = self.segs.len();
    }

    /// Calls `f` on every existing segment overlapping `buf[s..e]`.
    fn visit(&mut self, buf: u8, s: u32, e: u32, mut f: impl FnMut(&mut Seg)) {
        if s >= e || buf == INPUT {
            return;
        }
        let first = self.segs.partition_point(|seg| seg.before(buf, s));
        for seg in self.segs[first..]
            .iter_mut()
            .take_while(|seg| seg.buf == buf && seg.start < e)
        {
            f(seg);
        }
    }

    /// Calls `f` on segments covering exactly `buf[s..e]`, splitting and creating them.
    fn apply(&mut self, buf: u8, s: u32, e: u32, mut f: impl FnMut(&mut Seg)) {
        if s >= e || buf == INPUT {
            return;
        }
        let segs = &mut self.segs;
        split(segs, buf, s);
        split(segs, buf, e);
        let mut i = segs.partition_point(|seg| seg.before(buf, s));
        let mut pos = s;
        while pos < e {
            match segs.get(i) {
                Some(seg) if seg.buf == buf && seg.start == pos => {
                    pos = seg.end;
                    f(&mut segs[i]);
                }
                next => {
                    let end = match next {
                        Some(seg) if seg.buf == buf => seg.start.min(e),
                        _ => e,
                    };
                    let mut gap = Seg::empty(buf, pos, end);
                    f(&mut gap);
                    segs.insert(i, gap);
                    pos = end;
                }
            }
            i += 1;
        }
    }
}

/// Makes `buf[x]` a segment boundary.
fn split(segs: &mut Vec<Seg>, buf: u8, x: u32) {
    let i = segs.partition_point(|seg| seg.before(buf, x));
    if let Some(seg) = segs.get_mut(i) {
        if seg.buf == buf && seg.start < x {
            let mut right = seg.clone();
            seg.end = x;
            right.start = x;
            segs.insert(i + 1, right);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(c: Conflict) -> f64 {
        match c {
            Conflict::Ready(t) => t,
            Conflict::Blocked(id) => panic!("blocked on {id}"),
        }
    }

    #[test]
    fn overlapping_regions_split_and_combine() {
        let mut r = Regions::default();
        r.read(INPUT, 0, 100, 9.0);
        r.read(1, 0, 100, 5.0);
        r.write(1, 50, 150, 7.0);
        assert_eq!(ready(r.check(1, 0, 10, false, 0.0)), 0.0);
        assert_eq!(ready(r.check(1, 0, 10, true, 0.0)), 5.0);
        assert_eq!(ready(r.check(1, 60, 61, false, 0.0)), 7.0);
        assert_eq!(ready(r.check(1, 140, 200, true, 6.0)), 7.0);
        assert_eq!(ready(r.check(0, 0, 200, true, 1.0)), 1.0);
        r.write_pending(1, 120, 130, 9);
        assert!(matches!(
            r.check(1, 0, 125, false, 0.0),
            Conflict::Blocked(9)
        ));
        assert_eq!(ready(r.check(1, 130, 140, false, 0.0)), 7.0);
        let mut pending = Vec::new();
        assert_eq!(r.collect(1, 0, 200, true, 0.0, &mut pending), 7.0);
        assert_eq!(pending, vec![9]);
        r.resolve(1, 120, 130, true, 9, 11.0);
        assert_eq!(ready(r.check(1, 0, 200, false, 0.0)), 11.0);
        r.sweep(100.0);
        r.clear();
        assert_eq!(ready(r.check(1, 0, 200, true, 3.0)), 3.0);
    }

    #[test]
    fn id_sets_keep_every_member() {
        let mut ids = Ids::default();
        for id in [5, 6, 5, 7, 8, 6] {
            ids.insert(id);
        }
        let mut all = Vec::new();
        ids.each(|id| all.push(id));
        assert_eq!(all, vec![5, 6, 7, 8]);
        for (gone, left) in [
            (6, vec![5, 8, 7]),
            (5, vec![8, 7]),
            (7, vec![8]),
            (8, vec![]),
        ] {
            ids.remove(gone);
            let mut all = Vec::new();
            ids.each(|id| all.push(id));
            assert_eq!(all, left, "after removing {gone}");
        }
        assert!(ids.is_empty());
    }

    #[test]
    fn dead_segments_are_swept() {
        let mut r = Regions::default();
        for i in 0..1000 {
            r.read(1, i * 10, i * 10 + 10, f64::from(i));
            r.sweep(f64::from(i));
        }
        let live = r.segs.len();
        assert!(live < 200, "{live}");
    }
}
