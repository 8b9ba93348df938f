//! Choosing an algorithm for a collective from its size and the world size.

use std::fmt;
use std::str::FromStr;

/// The algorithm families a collective can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// Ring all-reduce; chain (pipelined ring) broadcast. Bandwidth-optimal.
    Ring,
    /// Double binary tree all-reduce; binary tree broadcast. Latency grows with log2(W).
    Tree,
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
        })
    }
}

impl FromStr for Algorithm {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "ring" => Ok(Algorithm::Ring),
            "tree" => Ok(Algorithm::Tree),
            _ => Err(format!("unknown algorithm '{s}' (expected ring or tree)")),
        }
    }
}

/// Messages up to this size favour the tree when there are more than two ranks.
pub const TREE_MAX_BYTES: usize = 64 << 10;

/// Picks the algorithm for a collective of `bytes` over `world_size` ranks.
///
/// `forced` (from `CHORUS_ALGO`) wins. Otherwise: the tree for small messages
/// on more than two ranks, where its log2(W) steps beat the ring's 2(W-1);
/// the ring for everything else, where bandwidth dominates. The rule depends
/// only on values every rank shares, so every rank picks the same.
pub fn choose(forced: Option<Algorithm>, bytes: usize, world_size: usize) -> Algorithm {
    match forced {
        Some(algo) => algo,
        None if world_size > 2 && bytes <= TREE_MAX_BYTES => Algorithm::Tree,
        None => Algorithm::Ring,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_messages_take_the_tree_large_the_ring() {
        assert_eq!(choose(None, 8, 8), Algorithm::Tree);
        assert_eq!(choose(None, 8, 2), Algorithm::Ring);
        assert_eq!(choose(None, 64 << 20, 8), Algorithm::Ring);
        assert_eq!(choose(Some(Algorithm::Tree), 64 << 20, 8), Algorithm::Tree);
    }

    #[test]
    fn names_round_trip() {
        for a in [Algorithm::Ring, Algorithm::Tree] {
            assert_eq!(a.to_string().parse::<Algorithm>(), Ok(a));
        }
        assert!("spiral".parse::<Algorithm>().is_err());
    }
}
