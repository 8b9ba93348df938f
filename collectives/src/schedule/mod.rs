//! Algorithms as schedules: pure data saying, for one rank, which region of
//! the buffer goes to which peer, what comes back, and what is reduced.
//!
//! A schedule knows nothing of sockets; the executor runs any schedule
//! over any transport, and the tests below run every schedule for hundreds of
//! ranks in memory to prove it correct.

pub mod all_gather;
pub mod all_to_all;
pub mod barrier;
pub mod broadcast;
pub mod gather;
pub mod hierarchical;
pub mod plan;
pub mod recursive;
pub mod reduce;
pub mod reduce_scatter;
pub mod ring;
pub mod scatter;
pub mod tree;

#[cfg(test)]
mod verify;

use std::ops::Range;

/// The buffers a step can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buf {
    /// The caller's input (it may share memory with the output: in place).
    Input,
    /// The caller's output.
    Output,
    /// A temporary buffer owned by the executor, as long as the schedule needs.
    Scratch,
}

/// A range of elements in one of the buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loc {
    /// Which buffer.
    pub buf: Buf,
    /// Element range within it.
    pub range: Range<usize>,
}

impl Loc {
    /// Elements `range` of the input.
    pub fn input(range: Range<usize>) -> Loc {
        Loc {
            buf: Buf::Input,
            range,
        }
    }

    /// Elements `range` of the output.
    pub fn output(range: Range<usize>) -> Loc {
        Loc {
            buf: Buf::Output,
            range,
        }
    }

    /// Elements `range` of the scratch buffer.
    pub fn scratch(range: Range<usize>) -> Loc {
        Loc {
            buf: Buf::Scratch,
            range,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Whether this range and `other` share an element of one buffer.
    pub fn overlaps(&self, other: &Loc) -> bool {
        self.buf == other.buf && overlaps(&self.range, &other.range)
    }
}

/// Whether ranges `a` and `b` share an element.
pub(crate) fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// One step of a rank's program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Send the elements at `from` to `peer`.
    Send {
        /// Destination rank.
        peer: usize,
        /// What to send.
        from: Loc,
    },
    /// Receive from `peer` straight into `into`.
    Recv {
        /// Source rank.
        peer: usize,
        /// Where the message lands.
        into: Loc,
    },
    /// Receive from `peer` and set `into = with op incoming` (same lengths).
    RecvReduce {
        /// Source rank.
        peer: usize,
        /// This rank's operand.
        with: Loc,
        /// Where the result goes (may be `with` itself).
        into: Loc,
    },
    /// `into = from` (nothing when both name the same memory).
    Copy {
        /// Source elements.
        from: Loc,
        /// Destination elements.
        into: Loc,
    },
    /// Finish fully reduced elements (divides by the world size for `Avg`).
    Finish {
        /// The elements to finish.
        at: Loc,
    },
    /// Wait until every earlier step has completed.
    Fence,
}

/// A rank's whole program for one collective.
pub type Schedule = Vec<Step>;

impl Step {
    /// The locations this step names (none, one or two).
    pub fn locs(&self) -> impl Iterator<Item = &Loc> {
        let (a, b) = match self {
            Step::Send { from: a, .. } | Step::Recv { into: a, .. } | Step::Finish { at: a } => {
                (Some(a), None)
            }
            Step::RecvReduce { with, into, .. } => (Some(with), Some(into)),
            Step::Copy { from, into } => (Some(from), Some(into)),
            Step::Fence => (None, None),
        };
        a.into_iter().chain(b)
    }
}

/// Elements of `buf` that `steps` reach (the end of the furthest range in it).
pub fn extent(steps: &[Step], buf: Buf) -> usize {
    steps
        .iter()
        .flat_map(Step::locs)
        .filter(|l| l.buf == buf)
        .map(|l| l.range.end)
        .max()
        .unwrap_or(0)
}

/// Elements of scratch space `steps` use.
pub fn scratch_len(steps: &[Step]) -> usize {
    extent(steps, Buf::Scratch)
}

/// Splits `0..count` into `parts` near-equal consecutive ranges.
pub fn split(count: usize, parts: usize) -> Vec<Range<usize>> {
    (0..parts)
        .map(|i| count * i / parts..count * (i + 1) / parts)
        .collect()
}

/// Splits `range` into chunks of at most `chunk` elements (none if empty).
pub fn chunks(range: Range<usize>, chunk: usize) -> Vec<Range<usize>> {
    let chunk = chunk.max(1);
    (range.start..range.end)
        .step_by(chunk)
        .map(|s| s..(s + chunk).min(range.end))
        .collect()
}

/// Appends `a` and `b` alternately (a0, b0, a1, b1, ...), then the rest of the longer.
pub fn interleave(
    steps: &mut Schedule,
    a: impl IntoIterator<Item = Step>,
    b: impl IntoIterator<Item = Step>,
) {
    let (mut a, mut b) = (a.into_iter(), b.into_iter());
    loop {
        match (a.next(), b.next()) {
            (None, None) => return,
            (x, y) => steps.extend(x.into_iter().chain(y)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_in_order() {
        for count in [0, 1, 5, 7, 100] {
            for parts in 1..9 {
                let s = split(count, parts);
                assert_eq!(s.len(), parts);
                assert_eq!(s[0].start, 0);
                assert_eq!(s[parts - 1].end, count);
                assert!(s.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
    }

    #[test]
    fn chunks_cover_in_order() {
        assert_eq!(chunks(3..10, 3), vec![3..6, 6..9, 9..10]);
        assert!(chunks(4..4, 3).is_empty());
    }
}
