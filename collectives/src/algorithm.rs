//! The collectives and the algorithms that can run them: the names the tuner,
//! the cost model, `CHORUS_ALGO` and the tools share.

use std::fmt;
use std::str::FromStr;

/// The collectives the tuner and the cost model know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Collective {
    /// Every rank ends with the reduction of every rank's buffer.
    AllReduce,
    /// The root's buffer is copied to every rank.
    Broadcast,
    /// The root ends with the reduction of every rank's buffer.
    Reduce,
    /// Every rank ends with every rank's block, in rank order.
    AllGather,
    /// Rank r ends with block r of the reduction of every rank's buffer.
    ReduceScatter,
    /// Rank r sends its block q to rank q and receives block r from every rank.
    AllToAll,
    /// The root ends with every rank's block, in rank order.
    Gather,
    /// Rank r receives block r of the root's buffer.
    Scatter,
}

impl Collective {
    /// Every collective, in a fixed order.
    pub const ALL: [Collective; 8] = [
        Collective::AllReduce,
        Collective::Broadcast,
        Collective::Reduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllToAll,
        Collective::Gather,
        Collective::Scatter,
    ];

    /// The name used by `CHORUS_ALGO` and the tools (`allreduce`, `broadcast`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "allreduce",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::AllGather => "allgather",
            Collective::ReduceScatter => "reducescatter",
            Collective::AllToAll => "alltoall",
            Collective::Gather => "gather",
            Collective::Scatter => "scatter",
        }
    }

    /// nccl-tests' bus-bandwidth factor: busbw = algbw * factor (all-reduce 2(W-1)/W).
    pub fn bus_factor(self, world_size: usize) -> f64 {
        let w = world_size.max(1) as f64;
        match self {
            Collective::AllReduce => 2.0 * (w - 1.0) / w,
            Collective::Broadcast | Collective::Reduce => 1.0,
            Collective::AllGather
            | Collective::ReduceScatter
            | Collective::AllToAll
            | Collective::Gather
            | Collective::Scatter => (w - 1.0) / w,
        }
    }

    /// Its position in [`Collective::ALL`].
    pub(crate) fn index(self) -> usize {
        Collective::ALL
            .iter()
            .position(|&c| c == self)
            .expect("every collective is in ALL")
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for Collective {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let key: String = s
            .trim()
            .chars()
            .filter(|c| *c != '_' && *c != '-')
            .collect::<String>()
            .to_ascii_lowercase();
        Collective::ALL
            .into_iter()
            .find(|c| c.name() == key)
            .ok_or_else(|| {
                format!(
                    "unknown collective '{s}' (expected allreduce, broadcast, reduce, \
                     allgather, reducescatter, alltoall, gather or scatter)"
                )
            })
    }
}

/// The algorithms a collective can run as messages between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Ring all-reduce, all-gather and reduce-scatter; chain (pipelined ring)
    /// broadcast and reduce. Bandwidth-optimal, latency grows with W.
    Ring,
    /// Double binary tree all-reduce; binary tree broadcast and reduce.
    /// Latency grows with log2(W).
    Tree,
    /// Recursive doubling: log2(W) rounds exchanging the whole buffer. Fewest steps.
    RecursiveDoubling,
    /// Recursive halving then doubling (Rabenseifner): 2 log2(W) steps, ring-like bandwidth.
    HalvingDoubling,
    /// Every block goes straight to (or from) the rank it belongs to.
    Direct,
    /// All-reduce over several hosts: a tree reduce inside each host, a ring between the
    /// hosts' first ranks, a tree broadcast inside each host.
    Hierarchical,
}

impl Algorithm {
    /// Every algorithm, in the fixed tie-breaking order.
    pub const ALL: [Algorithm; 6] = [
        Algorithm::Ring,
        Algorithm::Tree,
        Algorithm::RecursiveDoubling,
        Algorithm::HalvingDoubling,
        Algorithm::Direct,
        Algorithm::Hierarchical,
    ];
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
            Algorithm::RecursiveDoubling => "rd",
            Algorithm::HalvingDoubling => "rhd",
            Algorithm::Direct => "direct",
            Algorithm::Hierarchical => "hier",
        })
    }
}

impl FromStr for Algorithm {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
            "ring" | "chain" => Ok(Algorithm::Ring),
            "tree" => Ok(Algorithm::Tree),
            "rd" | "recursive_doubling" => Ok(Algorithm::RecursiveDoubling),
            "rhd" | "halving_doubling" => Ok(Algorithm::HalvingDoubling),
            "direct" => Ok(Algorithm::Direct),
            "hier" | "hierarchical" => Ok(Algorithm::Hierarchical),
            _ => Err(format!(
                "unknown algorithm '{s}' (expected ring, chain, tree, rd, rhd, direct or hier)"
            )),
        }
    }
}

/// How a call moves its data: the rows of the tuner's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// Messages through the transport, by this algorithm (a barrier's messages are
    /// dissemination rounds, shown as recursive doubling).
    Messages(Algorithm),
    /// One meeting in the shared-memory mailboxes: every rank on one host, small calls only.
    Mailbox,
    /// The peers read and write each other's shared buffers directly (`alloc_shared`).
    Window,
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Path::Messages(a) => a.fmt(f),
            Path::Mailbox => f.pad("mailbox"),
            Path::Window => f.pad("window"),
        }
    }
}

/// How a device communicator moves device data between ranks (feature `cuda`; priced by
/// [`crate::cost::device`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DevicePath {
    /// CUDA IPC: ranks read each other's device memory directly (one host).
    Ipc,
    /// Pinned host buffers and the host collectives (any transport).
    Staged,
    /// IPC within each host, pinned staging between hosts.
    Hierarchical,
}

impl DevicePath {
    /// Every path.
    pub const ALL: [DevicePath; 3] = [
        DevicePath::Ipc,
        DevicePath::Staged,
        DevicePath::Hierarchical,
    ];

    /// The name `CHORUS_CUDA_PATH` takes.
    pub fn name(self) -> &'static str {
        match self {
            DevicePath::Ipc => "ipc",
            DevicePath::Staged => "staged",
            DevicePath::Hierarchical => "hierarchical",
        }
    }
}

impl fmt::Display for DevicePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for a in Algorithm::ALL {
            assert_eq!(a.to_string().parse::<Algorithm>(), Ok(a));
        }
        for c in Collective::ALL {
            assert_eq!(c.to_string().parse::<Collective>(), Ok(c));
        }
        assert_eq!("chain".parse::<Algorithm>(), Ok(Algorithm::Ring));
        assert_eq!(
            "hierarchical".parse::<Algorithm>(),
            Ok(Algorithm::Hierarchical)
        );
        assert_eq!(Path::Messages(Algorithm::Tree).to_string(), "tree");
        assert_eq!(Path::Mailbox.to_string(), "mailbox");
        assert_eq!(
            "Recursive_Doubling".parse::<Algorithm>(),
            Ok(Algorithm::RecursiveDoubling)
        );
        assert_eq!(
            "halving-doubling".parse::<Algorithm>(),
            Ok(Algorithm::HalvingDoubling)
        );
        assert_eq!(
            "all_reduce".parse::<Collective>(),
            Ok(Collective::AllReduce)
        );
        assert!("spiral".parse::<Algorithm>().is_err());
        assert!("allsum".parse::<Collective>().is_err());
    }
}
