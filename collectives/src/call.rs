//! What a call is, as ranks compare it and errors describe it.

use std::fmt;

use chorus_kernels::{DType, ReduceOp};

use crate::algorithm::Collective;
use crate::Error;

/// The kinds of call, as message tags carry them and errors name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CallKind {
    /// [`all_reduce`](crate::Communicator::all_reduce).
    AllReduce = 1,
    /// [`broadcast`](crate::Communicator::broadcast).
    Broadcast = 2,
    /// [`barrier`](crate::Communicator::barrier).
    Barrier = 3,
    /// [`reduce`](crate::Communicator::reduce).
    Reduce = 4,
    /// [`all_gather`](crate::Communicator::all_gather) and its in-place form.
    AllGather = 5,
    /// [`reduce_scatter`](crate::Communicator::reduce_scatter).
    ReduceScatter = 6,
    /// [`all_to_all`](crate::Communicator::all_to_all) and its uneven form.
    AllToAll = 7,
    /// [`gather`](crate::Communicator::gather).
    Gather = 8,
    /// [`scatter`](crate::Communicator::scatter).
    Scatter = 9,
    /// A group of sends and receives ([`group`](crate::Communicator::group) and the
    /// single `send`/`recv` calls).
    PointToPoint = 10,
}

impl CallKind {
    /// Every kind, in code order.
    pub(crate) const ALL: [CallKind; 10] = [
        CallKind::AllReduce,
        CallKind::Broadcast,
        CallKind::Barrier,
        CallKind::Reduce,
        CallKind::AllGather,
        CallKind::ReduceScatter,
        CallKind::AllToAll,
        CallKind::Gather,
        CallKind::Scatter,
        CallKind::PointToPoint,
    ];

    /// The call's name, as users write it.
    pub fn name(self) -> &'static str {
        match self {
            CallKind::AllReduce => "all_reduce",
            CallKind::Broadcast => "broadcast",
            CallKind::Barrier => "barrier",
            CallKind::Reduce => "reduce",
            CallKind::AllGather => "all_gather",
            CallKind::ReduceScatter => "reduce_scatter",
            CallKind::AllToAll => "all_to_all",
            CallKind::Gather => "gather",
            CallKind::Scatter => "scatter",
            CallKind::PointToPoint => "send/recv",
        }
    }

    /// The collective the schedules and the tuner know this call as; `None` for a barrier
    /// and for point-to-point groups.
    pub(crate) fn collective(self) -> Option<Collective> {
        match self {
            CallKind::AllReduce => Some(Collective::AllReduce),
            CallKind::Broadcast => Some(Collective::Broadcast),
            CallKind::Reduce => Some(Collective::Reduce),
            CallKind::AllGather => Some(Collective::AllGather),
            CallKind::ReduceScatter => Some(Collective::ReduceScatter),
            CallKind::AllToAll => Some(Collective::AllToAll),
            CallKind::Gather => Some(Collective::Gather),
            CallKind::Scatter => Some(Collective::Scatter),
            CallKind::Barrier | CallKind::PointToPoint => None,
        }
    }

    /// The kind whose code (`kind as u8`) is `code`.
    pub(crate) fn from_code(code: u8) -> Option<CallKind> {
        CallKind::ALL.into_iter().find(|&k| k as u8 == code)
    }
}

/// One collective call as every rank must make it: what ranks compare, and errors report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallInfo {
    /// Which collective.
    pub kind: CallKind,
    /// The elements' type.
    pub dtype: DType,
    /// The reduction (meaningless for calls that reduce nothing).
    pub op: ReduceOp,
    /// The root rank (0 for calls without one).
    pub root: usize,
    /// Elements per rank as every rank must agree on it (0 where counts may differ).
    pub count: usize,
}

impl CallInfo {
    /// The description of a call. Every collective makes one before anything else, so this is
    /// where an operator that is not defined on the data type (a bitwise one on a float
    /// type) fails, with [`Error::InvalidArgument`] naming both, before anything is sent.
    pub(crate) fn new(
        kind: CallKind,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        count: usize,
    ) -> Result<CallInfo, Error> {
        op.check(dtype)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        Ok(CallInfo {
            kind,
            dtype,
            op,
            root,
            count,
        })
    }

    /// 20 bits standing for the root and the count in the message tag.
    pub(crate) fn fingerprint(&self) -> u64 {
        // splitmix64's finaliser spreads both numbers over all the bits.
        let mut z = (self.root as u64) ^ (self.count as u64).rotate_left(24);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) & 0xF_FFFF
    }

    /// The data type's and the operator's codes: their indices in [`DType::ALL`] and
    /// [`ReduceOp::ALL`].
    pub(crate) fn codes(&self) -> (usize, usize) {
        let dtype = DType::ALL.iter().position(|&d| d == self.dtype);
        let op = ReduceOp::ALL.iter().position(|&o| o == self.op);
        (dtype.unwrap_or(0), op.unwrap_or(0))
    }

    /// The call as one line of text, for another rank to [`decode`](Self::decode).
    pub(crate) fn encode(&self) -> String {
        let (dtype, op) = self.codes();
        let (kind, root, count) = (self.kind as u8, self.root, self.count);
        format!("{kind},{dtype},{op},{root},{count}")
    }

    /// The call [`encode`](Self::encode) wrote, if `text` is one.
    pub(crate) fn decode(text: &str) -> Option<CallInfo> {
        let mut parts = text.split(',');
        let mut next = || parts.next()?.parse::<usize>().ok();
        Some(CallInfo {
            kind: CallKind::from_code(u8::try_from(next()?).ok()?)?,
            dtype: *DType::ALL.get(next()?)?,
            op: *ReduceOp::ALL.get(next()?)?,
            root: next()?,
            count: next()?,
        })
    }
}

impl fmt::Display for CallInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, dtype, op, n) = (self.kind.name(), self.dtype, self.op, self.count);
        match self.kind {
            CallKind::Barrier => write!(f, "{name}"),
            CallKind::AllToAll | CallKind::PointToPoint => write!(f, "{name}({dtype})"),
            CallKind::AllReduce | CallKind::ReduceScatter => {
                write!(f, "{name}({dtype} {op}, {n} elements)")
            }
            CallKind::Reduce => {
                write!(f, "{name}({dtype} {op}, {n} elements, root {})", self.root)
            }
            CallKind::AllGather => write!(f, "{name}({dtype}, {n} elements per rank)"),
            CallKind::Broadcast | CallKind::Gather | CallKind::Scatter => {
                write!(f, "{name}({dtype}, {n} elements, root {})", self.root)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(kind: CallKind, root: usize, count: usize) -> CallInfo {
        CallInfo::new(kind, DType::F32, ReduceOp::Sum, root, count).unwrap()
    }

    #[test]
    fn fingerprints_tell_roots_and_counts_apart() {
        let base = call(CallKind::AllReduce, 0, 1024).fingerprint();
        assert_eq!(base, call(CallKind::AllReduce, 0, 1024).fingerprint());
        assert!(base < 1 << 20);
        for count in [0, 1, 1023, 1025, 2048, 1 << 30] {
            assert_ne!(
                base,
                call(CallKind::AllReduce, 0, count).fingerprint(),
                "count {count}"
            );
        }
        for root in 1..64 {
            assert_ne!(
                base,
                call(CallKind::AllReduce, root, 1024).fingerprint(),
                "root {root}"
            );
        }
    }

    #[test]
    fn calls_read_as_users_write_them() {
        assert_eq!(
            call(CallKind::AllReduce, 0, 8).to_string(),
            "all_reduce(float sum, 8 elements)"
        );
        assert_eq!(
            call(CallKind::Broadcast, 2, 8).to_string(),
            "broadcast(float, 8 elements, root 2)"
        );
        assert_eq!(call(CallKind::Barrier, 0, 0).to_string(), "barrier");
    }

    #[test]
    fn calls_survive_their_encoding() {
        for kind in CallKind::ALL {
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    let info = CallInfo {
                        kind,
                        dtype,
                        op,
                        root: 3,
                        count: 1 << 40,
                    };
                    assert_eq!(CallInfo::decode(&info.encode()), Some(info));
                }
            }
        }
        for garbage in ["", "1,2", "99,0,0,0,0", "1,0,0,0,x", "1,99,0,0,0"] {
            assert_eq!(CallInfo::decode(garbage), None, "{garbage:?}");
        }
    }

    #[test]
    fn every_collective_has_the_tuners_name_but_barriers_and_send_recv() {
        for kind in CallKind::ALL {
            match kind {
                CallKind::Barrier | CallKind::PointToPoint => assert_eq!(kind.collective(), None),
                _ => {
                    let c = kind.collective().expect("a collective");
                    assert_eq!(c.name(), kind.name().replace('_', ""));
                }
            }
        }
    }
}
