//! Algorithms as schedules: pure data saying, for one rank, which region of
//! the buffer goes to which peer, what comes back, and what is reduced.
//!
//! A schedule knows nothing of sockets; [`crate::executor`] runs any schedule
//! over any transport, and the tests below run every schedule for hundreds of
//! ranks in memory to prove it correct.

pub mod barrier;
pub mod broadcast;
pub mod ring;
pub mod tree;

#[cfg(test)]
mod sim;

use std::ops::Range;

/// Which of the caller's buffers a step reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buf {
    /// The input buffer (the same memory as the output when in place).
    Input,
    /// The output buffer.
    Output,
}

/// One step of a rank's program. Regions are element ranges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Send `buf[region]` to `peer`.
    Send {
        /// Destination rank.
        peer: usize,
        /// Which buffer to read.
        buf: Buf,
        /// Elements to send.
        region: Range<usize>,
    },
    /// Receive from `peer` straight into `output[region]`.
    Recv {
        /// Source rank.
        peer: usize,
        /// Elements to receive.
        region: Range<usize>,
    },
    /// Receive from `peer` and set `output[region] = src[region] op incoming`.
    RecvReduce {
        /// Source rank.
        peer: usize,
        /// The buffer holding this rank's operand.
        src: Buf,
        /// Elements to reduce.
        region: Range<usize>,
    },
    /// `output[region] = input[region]` (nothing when in place).
    Copy {
        /// Elements to copy.
        region: Range<usize>,
    },
    /// Finish a fully reduced region (divides by the world size for `Avg`).
    Finish {
        /// Elements to finish.
        region: Range<usize>,
    },
    /// Wait until every earlier step has completed.
    Fence,
}

/// A rank's whole program for one collective.
pub type Schedule = Vec<Step>;

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
