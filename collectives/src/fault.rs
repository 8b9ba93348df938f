//! Faults: what stopped a call, as the rank that found it describes it to every rank.

use std::fmt;

use crate::call::CallInfo;

/// What went wrong, as a [`Fault`] classifies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Cause {
    /// The culprit closed its connections: its process exited or crashed.
    PeerClosed = 1,
    /// The connection to the culprit failed otherwise (an I/O error, a malformed message).
    Transport = 2,
    /// Rank 0, the culprit, is gone, and the rendezvous store it hosted with it.
    StoreHostGone = 3,
    /// A connection failed and the rendezvous store, hosted apart from rank 0, is
    /// unreachable too.
    StoreLost = 4,
    /// The call did not finish within the communicator's timeout. The culprit is a rank that
    /// did not answer, or had not joined the call, where one was found.
    Timeout = 5,
    /// Ranks called different collectives, or the same one with different arguments. The
    /// culprit is a rank whose call differed, where it answered.
    Mismatch = 6,
    /// The culprit stopped answering (stopped by a signal or a debugger, or hung outside
    /// Chorus) and the other ranks gave up on it: what the culprit reports when it resumes.
    Unresponsive = 7,
    /// The culprit called [`abort`](crate::Communicator::abort).
    Abort = 8,
    /// The culprit dropped its communicator with calls in flight.
    Dropped = 9,
    /// The culprit's process left during set-up (its connection to the store closed).
    LeftDuringSetUp = 10,
    /// The culprit failed during set-up.
    SetUpFailed = 11,
}

impl Cause {
    const ALL: [Cause; 11] = [
        Cause::PeerClosed,
        Cause::Transport,
        Cause::StoreHostGone,
        Cause::StoreLost,
        Cause::Timeout,
        Cause::Mismatch,
        Cause::Unresponsive,
        Cause::Abort,
        Cause::Dropped,
        Cause::LeftDuringSetUp,
        Cause::SetUpFailed,
    ];
}

/// A fault that stopped a call: what it was, who is to blame, and where it was found.
///
/// Made by the rank that found it and, through the rendezvous store, handed to every
/// rank, so that all of them report the same culprit. Ranks are the job's (`RANK`), also on
/// communicators [`split`](crate::Communicator::split) from the job's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// What went wrong.
    pub cause: Cause,
    /// The rank held responsible, where one is known.
    pub culprit: Option<usize>,
    /// The rank that found the fault.
    pub found_by: usize,
    /// The collective the finder was in (none in set-up and point-to-point calls).
    pub call: Option<CallInfo>,
    /// That call's sequence number on the finder's communicator (its first collective is
    /// 1; 0 without a call, and for a device call found mismatched before it began).
    pub seq: u64,
    /// The finding in words, where the fields do not say it all: the transport's report,
    /// what the other ranks were doing.
    pub detail: String,
}

impl Fault {
    /// A fault `found_by` a rank outside any call, for `cause` and `culprit`.
    pub(crate) fn new(cause: Cause, culprit: Option<usize>, found_by: usize) -> Fault {
        Fault {
            cause,
            culprit,
            found_by,
            call: None,
            seq: 0,
            detail: String::new(),
        }
    }

    /// This fault found in `call`, number `seq`.
    pub(crate) fn in_call(self, call: CallInfo, seq: u64) -> Fault {
        Fault {
            call: Some(call),
            seq,
            ..self
        }
    }

    /// This fault with `detail`.
    pub(crate) fn saying(self, detail: impl Into<String>) -> Fault {
        Fault {
            detail: detail.into(),
            ..self
        }
    }

    /// The fault as one line of text, for another rank to [`decode`](Self::decode).
    pub(crate) fn encode(&self) -> String {
        let culprit = self.culprit.map_or("-".to_string(), |r| r.to_string());
        let call = self.call.map_or("-".to_string(), |c| c.encode());
        let (cause, by, seq, detail) = (self.cause as u8, self.found_by, self.seq, &self.detail);
        format!("{cause} {by} {culprit} {seq} {call} {detail}")
    }

    /// The fault [`encode`](Self::encode) wrote, if `text` is one.
    pub(crate) fn decode(text: &str) -> Option<Fault> {
        let mut parts = text.splitn(6, ' ');
        let cause: u8 = parts.next()?.parse().ok()?;
        let found_by = parts.next()?.parse().ok()?;
        let culprit = match parts.next()? {
            "-" => None,
            r => Some(r.parse().ok()?),
        };
        let seq = parts.next()?.parse().ok()?;
        let call = match parts.next()? {
            "-" => None,
            c => Some(CallInfo::decode(c)?),
        };
        Some(Fault {
            cause: Cause::ALL.into_iter().find(|&c| c as u8 == cause)?,
            culprit,
            found_by,
            call,
            seq,
            detail: parts.next()?.to_string(),
        })
    }

    /// The rank the fault's own words name: the culprit, else the finder.
    fn named(&self) -> usize {
        self.culprit.unwrap_or(self.found_by)
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (by, detail) = (self.found_by, &self.detail);
        let noticed = |f: &mut fmt::Formatter<'_>| match self.call {
            Some(call) => write!(f, "; rank {by} noticed in {call} #{}", self.seq),
            None => write!(f, "; rank {by} noticed in send/recv"),
        };
        match self.cause {
            Cause::PeerClosed | Cause::Transport | Cause::StoreLost => {
                f.write_str(detail)?;
                noticed(f)
            }
            Cause::StoreHostGone => {
                write!(
                    f,
                    "rank 0 is gone, and the rendezvous store it hosted with it: {detail}"
                )?;
                noticed(f)
            }
            Cause::Timeout => match self.call {
                Some(call) => write!(f, "{call} #{} on rank {by} {detail}", self.seq),
                None => f.write_str(detail),
            },
            Cause::Mismatch => match self.call {
                Some(call) if self.seq == 0 => write!(f, "rank {by} called {call}, but {detail}"),
                Some(call) => write!(f, "rank {by} called {call} as #{}, but {detail}", self.seq),
                None => f.write_str(detail),
            },
            Cause::Unresponsive => write!(
                f,
                "rank {} stopped answering while the other ranks waited for it (stopped by a \
                 signal or a debugger, or hung outside Chorus), and they gave up on it: {detail}",
                self.named()
            ),
            Cause::Abort => write!(f, "rank {} aborted its communicator", self.named()),
            Cause::Dropped => write!(
                f,
                "rank {} dropped its communicator with operations in flight",
                self.named()
            ),
            Cause::LeftDuringSetUp => write!(
                f,
                "rank {} left during set-up: its connection to the rendezvous store closed \
                 (the process died or exited)",
                self.named()
            ),
            Cause::SetUpFailed => {
                write!(f, "rank {} failed during set-up: {detail}", self.named())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CallKind, DType, ReduceOp};

    fn all_reduce() -> CallInfo {
        CallInfo {
            kind: CallKind::AllReduce,
            dtype: DType::F32,
            op: ReduceOp::Sum,
            root: 0,
            count: 8,
        }
    }

    #[test]
    fn faults_survive_their_encoding() {
        for cause in Cause::ALL {
            let bare = Fault::new(cause, None, 2);
            let full = Fault::new(cause, Some(1), 2)
                .in_call(all_reduce(), 7)
                .saying("rank 1 closed its connection; with spaces, and - dashes");
            for fault in [bare, full] {
                assert_eq!(Fault::decode(&fault.encode()), Some(fault.clone()));
            }
        }
        for garbage in ["", "1 2", "99 0 - 0 - x", "1 x - 0 - x", "1 0 - 0 9,9 x"] {
            assert_eq!(Fault::decode(garbage), None, "{garbage:?}");
        }
    }

    #[test]
    fn faults_read_as_a_sentence_naming_the_call_and_the_finder() {
        let closed = Fault::new(Cause::PeerClosed, Some(1), 2)
            .in_call(all_reduce(), 5)
            .saying("rank 1 closed its connection");
        assert_eq!(
            closed.to_string(),
            "rank 1 closed its connection; rank 2 noticed in all_reduce(float sum, 8 elements) #5"
        );
        let point_to_point = Fault {
            call: None,
            ..closed
        };
        assert!(point_to_point
            .to_string()
            .ends_with("rank 2 noticed in send/recv"));
        let timeout = Fault::new(Cause::Timeout, Some(3), 0)
            .in_call(all_reduce(), 9)
            .saying("timed out after 5.0 s: rank 3 has not joined it");
        assert_eq!(
            timeout.to_string(),
            "all_reduce(float sum, 8 elements) #9 on rank 0 timed out after 5.0 s: rank 3 has \
             not joined it"
        );
        assert_eq!(
            Fault::new(Cause::Abort, Some(4), 4).to_string(),
            "rank 4 aborted its communicator"
        );
    }
}
