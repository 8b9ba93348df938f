//! Choosing an algorithm for a collective from its size and the world size.
//!
//! A [`Tuner`] holds a link model (per-message latency `alpha`, bandwidth
//! `beta`, see [`crate::cost`]; a communicator takes them from its transport,
//! shared memory's 2 us and 2 GB/s on one host, TCP's [`DEFAULT_ALPHA`] = 10 us
//! and [`DEFAULT_BETA`] = 1.5 GB/s across hosts) and what
//! `CHORUS_ALGO` forces ([`Forced`]). For each call it estimates every
//! candidate algorithm ([`Algorithm`]) with the closed forms of
//! [`crate::cost::closed`] and picks the cheapest. The estimates depend only
//! on values every rank shares (the model, the size, the world size) and
//! near-ties go to the earlier candidate, so every rank picks the same
//! algorithm as long as every rank uses the same `alpha`, `beta` and chunk.

use std::fmt;
use std::str::FromStr;

use crate::cost::{closed, LinkModel};

pub use crate::cost::{DEFAULT_ALPHA, DEFAULT_BETA};

/// The collectives the tuner knows.
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

    fn index(self) -> usize {
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

/// The algorithm families a collective can run (every one the tuner knows;
/// [`Algorithm`] is the older pair the communicator still matches on).
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
}

impl Algorithm {
    /// Every algorithm, in the fixed tie-breaking order.
    pub const ALL: [Algorithm; 5] = [
        Algorithm::Ring,
        Algorithm::Tree,
        Algorithm::RecursiveDoubling,
        Algorithm::HalvingDoubling,
        Algorithm::Direct,
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
            _ => Err(format!(
                "unknown algorithm '{s}' (expected ring, chain, tree, rd, rhd or direct)"
            )),
        }
    }
}

/// Parsed `CHORUS_ALGO`: one algorithm for every collective (`tree`), or
/// per collective (`allreduce:ring,broadcast:tree`), or both (`ring,broadcast:tree`:
/// the bare name applies to collectives not named). Errors name the bad token.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Forced {
    all: Option<Algorithm>,
    each: [Option<Algorithm>; 8],
}

impl Forced {
    /// Nothing forced: the tuner decides everything.
    pub fn none() -> Forced {
        Forced::default()
    }

    /// `algorithm` forced for every collective.
    pub fn all(algorithm: Algorithm) -> Forced {
        Forced {
            all: Some(algorithm),
            ..Forced::default()
        }
    }

    /// This with `algorithm` forced for `c`.
    pub fn with(mut self, c: Collective, algorithm: Algorithm) -> Forced {
        self.each[c.index()] = Some(algorithm);
        self
    }

    /// The algorithm forced for `c`, if any (valid for `c` or not).
    pub fn get(&self, c: Collective) -> Option<Algorithm> {
        self.each[c.index()].or(self.all)
    }

    /// Whether nothing is forced.
    pub fn is_empty(&self) -> bool {
        self.all.is_none() && self.each.iter().all(Option::is_none)
    }
}

impl FromStr for Forced {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut forced = Forced::default();
        let s = s.trim();
        if s.is_empty() || s.eq_ignore_ascii_case("auto") {
            return Ok(forced);
        }
        for token in s.split(',').map(str::trim) {
            let bad = |why: String| format!("bad CHORUS_ALGO token '{token}': {why}");
            match token.split_once(':') {
                Some((c, a)) => {
                    let c: Collective = c.parse().map_err(bad)?;
                    let a: Algorithm = a.parse().map_err(bad)?;
                    forced.each[c.index()] = Some(a);
                }
                None if token.is_empty() => return Err(bad("empty".into())),
                None => forced.all = Some(token.parse().map_err(bad)?),
            }
        }
        Ok(forced)
    }
}

impl fmt::Display for Forced {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = self.all.iter().map(ToString::to_string).collect();
        for c in Collective::ALL {
            if let Some(a) = self.each[c.index()] {
                parts.push(format!("{c}:{a}"));
            }
        }
        if parts.is_empty() {
            f.write_str("auto")
        } else {
            f.write_str(&parts.join(","))
        }
    }
}

/// Why the tuner picked what it picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// `CHORUS_ALGO` forced it.
    Forced,
    /// It had the lowest estimate.
    Model,
    /// `CHORUS_ALGO` forced this algorithm, which the collective cannot run, so the model decided.
    ForcedInvalid(Algorithm),
}

/// A decision: the algorithm and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    /// The algorithm to run.
    pub algorithm: Algorithm,
    /// Why it was picked.
    pub reason: Reason,
}

impl fmt::Display for Choice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.reason {
            Reason::Forced => write!(f, "{} (forced)", self.algorithm),
            Reason::Model => write!(f, "{} (model)", self.algorithm),
            Reason::ForcedInvalid(a) => write!(
                f,
                "{} (model; forced {a} is not available for this collective)",
                self.algorithm
            ),
        }
    }
}

/// Estimates closer than this fraction count as a tie, which the earlier candidate wins.
pub const TIE_MARGIN: f64 = 0.01;

/// Picks an algorithm per call from a link model and what is forced.
#[derive(Debug, Clone, PartialEq)]
pub struct Tuner {
    model: LinkModel,
    chunk_bytes: usize,
    forced: Forced,
}

impl Default for Tuner {
    fn default() -> Tuner {
        Tuner::new(DEFAULT_ALPHA, DEFAULT_BETA, Forced::none())
    }
}

impl Tuner {
    /// A tuner for links of `alpha` seconds per message and `beta` bytes/s, with `forced` overrides.
    ///
    /// The pipeline chunk defaults to [`crate::DEFAULT_CHUNK_BYTES`] and
    /// reductions are free (see [`Tuner::with_chunk_bytes`], [`Tuner::with_gamma`]).
    pub fn new(alpha: f64, beta: f64, forced: Forced) -> Tuner {
        Tuner {
            model: LinkModel::new(alpha, beta),
            chunk_bytes: crate::DEFAULT_CHUNK_BYTES,
            forced,
        }
    }

    /// This tuner, estimating schedules cut into chunks of `chunk_bytes` (as `CHORUS_CHUNK_BYTES`).
    pub fn with_chunk_bytes(mut self, chunk_bytes: usize) -> Tuner {
        self.chunk_bytes = chunk_bytes.max(1);
        self
    }

    /// This tuner, charging reductions `bytes / gamma` seconds (gamma in bytes/s).
    pub fn with_gamma(mut self, gamma: f64) -> Tuner {
        self.model = self.model.with_gamma(gamma);
        self
    }

    /// The link model the estimates use.
    pub fn model(&self) -> &LinkModel {
        &self.model
    }

    /// The pipeline chunk the estimates assume, in bytes.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// What is forced.
    pub fn forced(&self) -> &Forced {
        &self.forced
    }

    /// Candidates valid for `c`, in tie-breaking order.
    pub fn candidates(c: Collective) -> &'static [Algorithm] {
        use Algorithm::*;
        match c {
            Collective::AllReduce => &[Ring, Tree, RecursiveDoubling, HalvingDoubling],
            Collective::Broadcast | Collective::Reduce => &[Ring, Tree],
            Collective::AllGather | Collective::ReduceScatter => &[Ring],
            Collective::AllToAll | Collective::Gather | Collective::Scatter => &[Direct],
        }
    }

    /// Estimated seconds for `c` by `a` on `bytes` over `world_size` ranks (infinite if `a` cannot run `c`).
    ///
    /// `bytes` is nccl-tests' size: the buffer for all-reduce, broadcast and
    /// reduce; the whole output for all-gather and gather; the whole input
    /// for reduce-scatter and scatter; each rank's buffer for all-to-all.
    pub fn estimate(&self, c: Collective, a: Algorithm, bytes: usize, world_size: usize) -> f64 {
        closed::estimate(&self.model, c, a, bytes, world_size, self.chunk_bytes)
            .unwrap_or(f64::INFINITY)
    }

    /// The algorithm for `c` on `bytes` over `world_size` ranks, and why.
    pub fn decide(&self, c: Collective, bytes: usize, world_size: usize) -> Choice {
        let candidates = Tuner::candidates(c);
        let forced = self.forced.get(c);
        if let Some(a) = forced {
            if candidates.contains(&a) {
                return Choice {
                    algorithm: a,
                    reason: Reason::Forced,
                };
            }
        }
        // A later candidate must be cheaper by more than TIE_MARGIN: near
        // ties (rounding of chunk counts) go to the earlier candidate, so the
        // pick does not flicker between equivalent algorithms.
        let mut best = candidates[0];
        let mut best_time = self.estimate(c, best, bytes, world_size);
        for &a in &candidates[1..] {
            let t = self.estimate(c, a, bytes, world_size);
            if t < best_time * (1.0 - TIE_MARGIN) {
                (best, best_time) = (a, t);
            }
        }
        Choice {
            algorithm: best,
            reason: forced.map_or(Reason::Model, Reason::ForcedInvalid),
        }
    }

    /// The algorithm for `c` on `bytes` over `world_size` ranks: the forced one
    /// if `c` can run it, else the cheapest estimate (within [`TIE_MARGIN`],
    /// the earliest candidate). Every rank picks the same.
    pub fn choose(&self, c: Collective, bytes: usize, world_size: usize) -> Algorithm {
        self.decide(c, bytes, world_size).algorithm
    }

    /// One line listing each candidate's estimate and the pick, for logs and tools.
    pub fn explain(&self, c: Collective, bytes: usize, world_size: usize) -> String {
        let estimates: Vec<String> = Tuner::candidates(c)
            .iter()
            .map(|&a| {
                let t = self.estimate(c, a, bytes, world_size);
                format!("{a}={}", format_seconds(t))
            })
            .collect();
        format!(
            "{c} {bytes} B on {world_size} ranks: {} -> {}",
            estimates.join(" "),
            self.decide(c, bytes, world_size)
        )
    }
}

/// `t` seconds as a short human string (`12.3us`, `4.56ms`, `1.23s`).
pub fn format_seconds(t: f64) -> String {
    if !t.is_finite() {
        "inf".into()
    } else if t < 1e-3 {
        format!("{:.1}us", t * 1e6)
    } else if t < 1.0 {
        format!("{:.3}ms", t * 1e3)
    } else {
        format!("{t:.3}s")
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

    #[test]
    fn forced_parses_one_or_per_collective() {
        let f: Forced = "tree".parse().unwrap();
        assert!(Collective::ALL
            .iter()
            .all(|&c| f.get(c) == Some(Algorithm::Tree)));
        let f: Forced = " allreduce:ring , broadcast:tree ".parse().unwrap();
        assert_eq!(f.get(Collective::AllReduce), Some(Algorithm::Ring));
        assert_eq!(f.get(Collective::Broadcast), Some(Algorithm::Tree));
        assert_eq!(f.get(Collective::Reduce), None);
        let f: Forced = "rd,broadcast:chain".parse().unwrap();
        assert_eq!(
            f.get(Collective::AllReduce),
            Some(Algorithm::RecursiveDoubling)
        );
        assert_eq!(f.get(Collective::Broadcast), Some(Algorithm::Ring));
        assert_eq!(f.to_string(), "rd,broadcast:ring");
        assert_eq!(f.to_string().parse::<Forced>(), Ok(f));
        assert!("".parse::<Forced>().unwrap().is_empty());
        assert!("auto".parse::<Forced>().unwrap().is_empty());
        assert_eq!(
            Forced::none().with(Collective::Gather, Algorithm::Direct),
            "gather:direct".parse().unwrap()
        );
    }

    #[test]
    fn forced_errors_name_the_bad_token() {
        for (input, token) in [
            ("spiral", "'spiral'"),
            ("allreduce:ring,broadcast:spiral", "'broadcast:spiral'"),
            ("allsum:ring", "'allsum:ring'"),
            ("ring,,tree", "''"),
        ] {
            let e = input.parse::<Forced>().unwrap_err();
            assert!(e.contains(token), "{input}: {e}");
        }
    }

    #[test]
    fn tiny_messages_at_scale_take_few_steps_large_ones_bandwidth() {
        let t = Tuner::default();
        for w in [64, 1024, 4096] {
            let small = t.choose(Collective::AllReduce, 8, w);
            assert!(
                matches!(small, Algorithm::Tree | Algorithm::RecursiveDoubling),
                "W={w}: {small}"
            );
            let large = t.choose(Collective::AllReduce, 1 << 30, w);
            assert!(
                matches!(large, Algorithm::Ring | Algorithm::HalvingDoubling),
                "W={w}: {large}"
            );
            assert_eq!(t.choose(Collective::Broadcast, 8, w), Algorithm::Tree);
        }
        // The chain's W-1 hops stop paying off only at thousands of ranks.
        assert_eq!(
            t.choose(Collective::Broadcast, 1 << 30, 1024),
            Algorithm::Ring
        );
        assert_eq!(
            t.choose(Collective::Broadcast, 1 << 30, 4096),
            Algorithm::Tree
        );
        assert_eq!(t.choose(Collective::AllGather, 8, 64), Algorithm::Ring);
        assert_eq!(t.choose(Collective::AllToAll, 8, 64), Algorithm::Direct);
    }

    #[test]
    fn forced_wins_when_valid_and_says_so_when_not() {
        let t = Tuner::new(DEFAULT_ALPHA, DEFAULT_BETA, "tree".parse().unwrap());
        assert_eq!(
            t.decide(Collective::AllReduce, 1 << 30, 64),
            Choice {
                algorithm: Algorithm::Tree,
                reason: Reason::Forced
            }
        );
        let d = t.decide(Collective::AllGather, 1 << 20, 64);
        assert_eq!(d.algorithm, Algorithm::Ring);
        assert_eq!(d.reason, Reason::ForcedInvalid(Algorithm::Tree));
        assert!(t
            .explain(Collective::AllGather, 1 << 20, 64)
            .contains("forced tree is not available"));
    }

    #[test]
    fn picks_the_cheapest_and_near_ties_go_to_the_earlier_candidate() {
        let t = Tuner::new(7e-6, 3e9, Forced::none());
        for c in Collective::ALL {
            let candidates = Tuner::candidates(c);
            for w in [2, 3, 5, 8, 100, 1000] {
                for shift in (0..31).step_by(3) {
                    let bytes = 1 << shift;
                    let cost = |a| t.estimate(c, a, bytes, w);
                    let pick = t.choose(c, bytes, w);
                    let at = candidates.iter().position(|&a| a == pick).unwrap();
                    // Every earlier candidate costs more; no later one is cheaper by the margin.
                    for &a in &candidates[..at] {
                        assert!(cost(a) > cost(pick), "{c} W={w} {bytes} B: {a} vs {pick}");
                    }
                    for &a in &candidates[at + 1..] {
                        assert!(
                            cost(a) >= cost(pick) * (1.0 - TIE_MARGIN),
                            "{c} W={w} {bytes} B: {a} vs {pick}"
                        );
                    }
                }
            }
        }
        // Where the tree's estimate is below the chain's but within the margin, the chain
        // (the earlier candidate) stays.
        let (c, w) = (Collective::Broadcast, 1024);
        let cost = |a, bytes| t.estimate(c, a, bytes, w);
        let near_tie = (1..=1 << 18)
            .map(|k| k << 12)
            .find(|&bytes| {
                let (ring, tree) = (cost(Algorithm::Ring, bytes), cost(Algorithm::Tree, bytes));
                tree < ring && tree >= ring * (1.0 - TIE_MARGIN)
            })
            .expect("a size where the two estimates are within the margin");
        assert_eq!(t.choose(c, near_tie, w), Algorithm::Ring, "{near_tie} B");
        // One rank: everything is free, the first candidate wins.
        assert_eq!(t.choose(Collective::AllReduce, 1 << 20, 1), Algorithm::Ring);
        assert_eq!(t.choose(Collective::AllReduce, 0, 64), Algorithm::Ring);
    }

    #[test]
    fn explain_lists_every_candidate() {
        let t = Tuner::default();
        let s = t.explain(Collective::AllReduce, 4096, 16);
        for a in Tuner::candidates(Collective::AllReduce) {
            assert!(s.contains(&format!("{a}=")), "{s}");
        }
        assert!(s.contains("-> "), "{s}");
        assert!(Tuner::candidates(Collective::AllReduce)
            .iter()
            .all(|&a| t.estimate(Collective::AllReduce, a, 4096, 16).is_finite()));
        assert!(t
            .estimate(Collective::AllGather, Algorithm::Tree, 4096, 16)
            .is_infinite());
    }
}
