//! The tuner: which path and algorithm each call takes, from one table of estimates;
//! [`crate::schedule::plan`] turns its pick into the call's plan.
//!
//! A [`Tuner`] holds a link model (per-message latency `alpha`, bandwidth
//! `beta`, see [`crate::cost`]; a communicator takes them from its transport,
//! shared memory's 2 us and 3 GB/s on one host, TCP's [`DEFAULT_ALPHA`] = 10 us
//! and [`DEFAULT_BETA`] = 1.5 GB/s across hosts), the [`Topology`] the
//! transport found (how many hosts, whether every rank shares memory, and the
//! cores of a job on one host, where a crowded host's cores bound every
//! algorithm and stall the ring: see [`Tuner::estimate`]) and what
//! `CHORUS_ALGO` forces ([`Forced`]). For each call, [`Tuner::pick`] estimates
//! every row of its table ([`Tuner::table`]) and picks the cheapest [`Path`]:
//!
//! - [`Path::Window`]: the call's buffers are shared buffers; peers read and
//!   write them directly (a few meetings, then memory copies and reductions).
//! - [`Path::Mailbox`]: every rank on one host and at most
//!   [`MAILBOX_BYTES`] bytes (or a barrier); one meeting in the mailboxes.
//! - [`Path::Messages`] by each [`Algorithm`] that can run the collective,
//!   with the closed forms of [`crate::cost::closed`], and the hierarchical
//!   all-reduce when the ranks span several hosts with several ranks on one.
//!
//! A valid forced algorithm leaves only itself and the shared buffers' row in
//! the table (shared buffers are the caller's choice of memory), so forcing
//! one turns the mailbox off. The estimates depend only on values every rank
//! shares (the model, the topology, the size, the world size) and near-ties go
//! to the earlier row, so every rank picks the same path, as long as every
//! rank passes shared buffers to the same calls. The communicator asks once
//! per call shape and keeps the answer (see its schedule cache).

use std::fmt;
use std::str::FromStr;

pub use crate::algorithm::{Algorithm, Collective};
use chorus_transport::shm::{ShmTransport, MAILBOX_BYTES};

pub use crate::algorithm::Path;
use crate::cost::{closed, LinkModel};

pub use crate::cost::{CROWDED_RING, DEFAULT_ALPHA, DEFAULT_BETA};

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

/// A decision for one call: the path (and algorithm) and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    /// How the call runs.
    pub path: Path,
    /// Why it was picked.
    pub reason: Reason,
}

impl fmt::Display for Pick {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_reason(f, self.path, self.reason)
    }
}

impl fmt::Display for Choice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_reason(f, Path::Messages(self.algorithm), self.reason)
    }
}

/// `path` and why it was picked, as logs show it.
fn write_reason(f: &mut fmt::Formatter<'_>, path: Path, reason: Reason) -> fmt::Result {
    match reason {
        Reason::Forced => write!(f, "{path} (forced)"),
        Reason::Model => write!(f, "{path} (model)"),
        Reason::ForcedInvalid(a) => write!(
            f,
            "{path} (model; forced {a} is not available for this collective)"
        ),
    }
}

/// Where a communicator's ranks are, as its transport found them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    /// Number of hosts the ranks are on.
    pub hosts: usize,
    /// The most ranks on one host.
    pub most_local: usize,
    /// Whether every rank maps shared memory with every other (mailboxes and shared
    /// buffers work).
    pub shared_memory: bool,
    /// The cores the ranks share where they are all on one host (as its transport
    /// counted them, the same on every rank); `usize::MAX` elsewhere or unknown.
    pub cores: usize,
}

impl Topology {
    /// Whether every rank is on one host and they outnumber its cores.
    pub fn crowded(&self, world_size: usize) -> bool {
        self.hosts == 1 && world_size > self.cores
    }
}

impl Default for Topology {
    /// Every rank on a host of its own, no shared memory: messages only.
    fn default() -> Topology {
        Topology {
            hosts: usize::MAX,
            most_local: 1,
            shared_memory: false,
            cores: usize::MAX,
        }
    }
}

/// Estimates closer than this fraction count as a tie, which the earlier candidate wins.
pub const TIE_MARGIN: f64 = 0.01;

/// Picks a path and algorithm per call from a link model, the topology and what is forced.
#[derive(Debug, Clone, PartialEq)]
pub struct Tuner {
    model: LinkModel,
    chunk_bytes: usize,
    forced: Forced,
    topology: Topology,
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
            topology: Topology::default(),
        }
    }

    /// This tuner, for ranks placed as `topology` says (by default each on a host of its
    /// own: messages only).
    pub fn with_topology(mut self, topology: Topology) -> Tuner {
        self.topology = topology;
        self
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

    /// Where the ranks are, as the transport found them.
    pub fn topology(&self) -> &Topology {
        &self.topology
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

    /// Estimated seconds for `c` by `a` on `bytes` over `world_size` ranks (infinite if `a` cannot run `c`,
    /// or, for the hierarchical all-reduce, this tuner's topology has not several hosts with
    /// several ranks on one).
    ///
    /// `bytes` is nccl-tests' size: the buffer for all-reduce, broadcast and
    /// reduce; the whole output for all-gather and gather; the whole input
    /// for reduce-scatter and scatter; each rank's buffer for all-to-all.
    ///
    /// Where the ranks, all on one host, outnumber its cores, the links' estimate
    /// becomes at least the cores' time for every byte sent, and a ring's is
    /// [`CROWDED_RING`] times that (see `crowded`).
    pub fn estimate(&self, c: Collective, a: Algorithm, bytes: usize, world_size: usize) -> f64 {
        let t = &self.topology;
        match a {
            Algorithm::Hierarchical => {
                let hosts = t.hosts > 1 && t.hosts < world_size && t.most_local > 1;
                if c == Collective::AllReduce && hosts {
                    self.hierarchical(bytes, t.hosts, t.most_local)
                } else {
                    f64::INFINITY
                }
            }
            _ => closed::estimate(&self.model, c, a, bytes, world_size, self.chunk_bytes)
                .map_or(f64::INFINITY, |t| self.crowded(t, c, a, bytes, world_size)),
        }
    }

    /// `t`, the links' estimate, where the ranks outnumber their one host's cores: at least
    /// the time the cores take to move every byte the ranks send between them (as the
    /// links' `beta`); and [`CROWDED_RING`] times that for a ring, whose steps form a cycle
    /// through every rank, so the ranks that run cannot go on without those waiting for a
    /// core, past the few chunks the links hold (the trees and the pairwise exchanges let two
    /// running ranks finish a step between them).
    fn crowded(&self, t: f64, c: Collective, a: Algorithm, bytes: usize, world_size: usize) -> f64 {
        let topology = &self.topology;
        if !topology.crowded(world_size) {
            return t;
        }
        let cores = closed::sent(c, a, bytes, world_size)
            .map_or(0.0, |sent| sent / (topology.cores as f64 * self.model.beta));
        let cycle = a == Algorithm::Ring
            && matches!(
                c,
                Collective::AllReduce | Collective::AllGather | Collective::ReduceScatter
            );
        t.max(cores) * if cycle { CROWDED_RING } else { 1.0 }
    }

    /// The message algorithm for `c` on `bytes` over `world_size` ranks, and why (flat
    /// algorithms only, whatever the topology: what the tools compare).
    pub fn decide(&self, c: Collective, bytes: usize, world_size: usize) -> Choice {
        let rows: Vec<(Path, f64)> = Tuner::candidates(c)
            .iter()
            .map(|&a| (Path::Messages(a), self.estimate(c, a, bytes, world_size)))
            .collect();
        let pick = best(&rows, self.forced.get(c));
        match pick.path {
            Path::Messages(algorithm) => Choice {
                algorithm,
                reason: pick.reason,
            },
            _ => unreachable!("only message rows were offered"),
        }
    }

    /// Every way the communicator can run one call of `c` (`None`: a barrier) on `bytes`
    /// over `world_size` ranks, with its estimated seconds, in tie-breaking order: shared
    /// buffers (when `on_windows`), the mailbox, then the message algorithms.
    pub fn table(
        &self,
        c: Option<Collective>,
        bytes: usize,
        world_size: usize,
        on_windows: bool,
    ) -> Vec<(Path, f64)> {
        let t = &self.topology;
        let meeting = ShmTransport::MEETING_COST;
        let (latency, copied) = (meeting.latency, |b: usize| b as f64 / meeting.bandwidth);
        let (b, w) = (bytes, world_size);
        let mut rows = Vec::new();
        match c {
            Some(Collective::AllReduce) if on_windows => {
                rows.push((Path::Window, 3.0 * latency + copied(2 * b)));
            }
            Some(Collective::Broadcast) if on_windows => {
                rows.push((Path::Window, 2.0 * latency + copied(b)));
            }
            _ => {}
        }
        if t.shared_memory && b <= MAILBOX_BYTES {
            match c {
                None => rows.push((Path::Mailbox, latency)),
                Some(Collective::AllReduce) => rows.push((Path::Mailbox, latency + copied(w * b))),
                Some(Collective::Broadcast) => rows.push((Path::Mailbox, latency + copied(b))),
                _ => {}
            }
        }
        let Some(c) = c else {
            // Dissemination: ceil(log2(W)) rounds of empty messages.
            let rounds = w.max(1).next_power_of_two().trailing_zeros();
            let messages = Path::Messages(Algorithm::RecursiveDoubling);
            rows.push((messages, f64::from(rounds) * self.model.message(0.0)));
            return rows;
        };
        for &a in Tuner::candidates(c) {
            rows.push((Path::Messages(a), self.estimate(c, a, b, w)));
        }
        let hierarchical = self.estimate(c, Algorithm::Hierarchical, b, w);
        if hierarchical.is_finite() {
            rows.push((Path::Messages(Algorithm::Hierarchical), hierarchical));
        }
        rows
    }

    /// Estimated seconds of the hierarchical all-reduce of `bytes` over `hosts` hosts
    /// of at most `local` ranks: a tree reduce and a tree broadcast over shared memory,
    /// a ring between hosts over this tuner's links, one after the other.
    fn hierarchical(&self, bytes: usize, hosts: usize, local: usize) -> f64 {
        let inside = LinkModel::shared_memory().with_gamma(self.model.gamma);
        let chunk = self.chunk_bytes;
        let tree = |c| closed::estimate(&inside, c, Algorithm::Tree, bytes, local, chunk);
        let ring = closed::estimate(
            &self.model,
            Collective::AllReduce,
            Algorithm::Ring,
            bytes,
            hosts,
            chunk,
        );
        match (tree(Collective::Reduce), ring, tree(Collective::Broadcast)) {
            (Some(up), Some(across), Some(down)) => up + across + down,
            _ => f64::INFINITY,
        }
    }

    /// How one call of `c` (`None`: a barrier) on `bytes` over `world_size` ranks runs, and
    /// why: the forced algorithm if [`Tuner::table`] has it (the shared buffers' row
    /// stays), else the cheapest row (within [`TIE_MARGIN`], the earliest).
    pub fn pick(
        &self,
        c: Option<Collective>,
        bytes: usize,
        world_size: usize,
        on_windows: bool,
    ) -> Pick {
        let rows = self.table(c, bytes, world_size, on_windows);
        best(&rows, c.and_then(|c| self.forced.get(c)))
    }

    /// One line listing every row of the call's table and the pick, for logs.
    pub fn explain_call(
        &self,
        c: Option<Collective>,
        bytes: usize,
        world_size: usize,
        on_windows: bool,
    ) -> String {
        let rows = self.table(c, bytes, world_size, on_windows);
        let name = c.map_or("barrier", Collective::name);
        describe(
            name,
            bytes,
            world_size,
            &rows,
            best(&rows, c.and_then(|c| self.forced.get(c))),
        )
    }

    /// The algorithm for `c` on `bytes` over `world_size` ranks: the forced one
    /// if `c` can run it, else the cheapest estimate (within [`TIE_MARGIN`],
    /// the earliest candidate). Every rank picks the same.
    pub fn choose(&self, c: Collective, bytes: usize, world_size: usize) -> Algorithm {
        self.decide(c, bytes, world_size).algorithm
    }

    /// One line listing each candidate's estimate and the pick, for logs and tools.
    pub fn explain(&self, c: Collective, bytes: usize, world_size: usize) -> String {
        let rows: Vec<(Path, f64)> = Tuner::candidates(c)
            .iter()
            .map(|&a| (Path::Messages(a), self.estimate(c, a, bytes, world_size)))
            .collect();
        let choice = self.decide(c, bytes, world_size);
        let pick = Pick {
            path: Path::Messages(choice.algorithm),
            reason: choice.reason,
        };
        describe(c.name(), bytes, world_size, &rows, pick)
    }
}

/// The row to run: `forced`'s, if the table has it as a message row (the window's row
/// stays beside it), else the cheapest; a later row must be cheaper by more than
/// [`TIE_MARGIN`], so the pick does not flicker between near ties (rounding of chunk counts).
fn best(rows: &[(Path, f64)], forced: Option<Algorithm>) -> Pick {
    let valid = forced.filter(|&a| rows.iter().any(|(p, _)| *p == Path::Messages(a)));
    let mut best: Option<(Path, f64)> = None;
    for &(path, t) in rows {
        if valid.is_some_and(|a| path != Path::Messages(a) && path != Path::Window) {
            continue;
        }
        if best.is_none_or(|(_, best_time)| t < best_time * (1.0 - TIE_MARGIN)) {
            best = Some((path, t));
        }
    }
    let (path, _) = best.expect("every table has a message row");
    let reason = match (forced, valid) {
        (_, Some(a)) if path == Path::Messages(a) => Reason::Forced,
        (Some(a), None) => Reason::ForcedInvalid(a),
        _ => Reason::Model,
    };
    Pick { path, reason }
}

/// `name bytes B on W ranks: row=estimate ... -> pick`.
fn describe(
    name: &str,
    bytes: usize,
    world_size: usize,
    rows: &[(Path, f64)],
    pick: Pick,
) -> String {
    let estimates: Vec<String> = rows
        .iter()
        .map(|(path, t)| format!("{path}={}", format_seconds(*t)))
        .collect();
    format!(
        "{name} {bytes} B on {world_size} ranks: {} -> {pick}",
        estimates.join(" ")
    )
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

    fn one_host() -> Tuner {
        let shm = chorus_transport::shm::LINK_COST;
        Tuner::new(shm.latency, shm.bandwidth, Forced::none()).with_topology(Topology {
            hosts: 1,
            most_local: 4,
            shared_memory: true,
            cores: 4,
        })
    }

    #[test]
    fn where_ranks_outnumber_cores_the_cores_bound_and_the_ring_stalls() {
        let on = |cores| Tuner {
            topology: Topology {
                cores,
                ..one_host().topology
            },
            ..one_host()
        };
        let all_reduce = Collective::AllReduce;
        let estimate = |cores, a, bytes| on(cores).estimate(all_reduce, a, bytes, 4);
        for bytes in [16 << 20, 64 << 20] {
            // Four ranks on four cores: the ring, as on any links.
            let roomy = on(4).pick(Some(all_reduce), bytes, 4, false);
            assert_eq!(roomy.path, Path::Messages(Algorithm::Ring), "{bytes} B");
            // On two, what moves the same bytes without a cycle through every rank: the
            // tree and halving-doubling tie on the cores, and the earlier row wins.
            let crowded = on(2).pick(Some(all_reduce), bytes, 4, false);
            assert_eq!(crowded.path, Path::Messages(Algorithm::Tree), "{bytes} B");
            let cores = 2.0 * 3.0 * bytes as f64 / (2.0 * on(2).model().beta);
            let (tree, rhd) = (Algorithm::Tree, Algorithm::HalvingDoubling);
            assert!((estimate(2, tree, bytes) - cores).abs() < 1e-9);
            assert!((estimate(2, rhd, bytes) - cores).abs() < 1e-9);
            let ring = estimate(2, Algorithm::Ring, bytes);
            assert!((ring - CROWDED_RING * cores).abs() < 1e-9, "{ring}");
            // Recursive doubling sends the whole buffer each round: dearer on the cores.
            assert!(estimate(2, Algorithm::RecursiveDoubling, bytes) > estimate(2, tree, bytes));
        }
        // Small calls keep their latency: the cores' bound is below the links' estimate.
        assert_eq!(
            estimate(2, Algorithm::Tree, 64 << 10),
            estimate(4, Algorithm::Tree, 64 << 10)
        );
        // Ranks across hosts count no shared cores.
        let apart = Topology {
            hosts: 2,
            cores: 1,
            ..Topology::default()
        };
        assert!(!apart.crowded(4));
        // The all-gather has only its ring: dearer, still picked.
        let gather = on(2).pick(Some(Collective::AllGather), 64 << 20, 4, false);
        assert_eq!(gather.path, Path::Messages(Algorithm::Ring));
        assert!(
            on(2).estimate(Collective::AllGather, Algorithm::Ring, 64 << 20, 4)
                > on(4).estimate(Collective::AllGather, Algorithm::Ring, 64 << 20, 4)
        );
    }

    #[test]
    fn one_host_meets_for_small_calls_and_on_shared_buffers() {
        let t = one_host();
        let all_reduce = Some(Collective::AllReduce);
        assert_eq!(t.pick(all_reduce, 8, 4, false).path, Path::Mailbox);
        assert_eq!(t.pick(None, 0, 4, false).path, Path::Mailbox);
        assert_eq!(
            t.pick(Some(Collective::Broadcast), MAILBOX_BYTES, 4, false)
                .path,
            Path::Mailbox
        );
        // Too big for a mailbox: messages, unless the buffers are shared.
        let big = t.pick(all_reduce, MAILBOX_BYTES + 1, 4, false).path;
        assert!(matches!(big, Path::Messages(_)), "{big}");
        for bytes in [MAILBOX_BYTES + 1, 1 << 20, 1 << 28] {
            assert_eq!(t.pick(all_reduce, bytes, 4, true).path, Path::Window);
        }
        // One meeting beats the shared buffers' three.
        assert_eq!(t.pick(all_reduce, 8, 4, true).path, Path::Mailbox);
        // Reduce has no meeting route.
        let reduce = t.pick(Some(Collective::Reduce), 8, 4, true).path;
        assert!(matches!(reduce, Path::Messages(_)), "{reduce}");
        // Without shared memory, messages only; a barrier's are dissemination rounds.
        let apart = Tuner::default();
        assert_eq!(
            apart.pick(None, 0, 4, false).path,
            Path::Messages(Algorithm::RecursiveDoubling)
        );
        assert!(apart
            .table(all_reduce, 8, 4, false)
            .iter()
            .all(|(p, _)| matches!(p, Path::Messages(_))));
    }

    #[test]
    fn forcing_an_algorithm_turns_the_mailbox_off_but_not_shared_buffers() {
        let t = one_host();
        let forced = Tuner {
            forced: "allreduce:ring".parse().unwrap(),
            ..t.clone()
        };
        let all_reduce = Some(Collective::AllReduce);
        let pick = forced.pick(all_reduce, 8, 4, false);
        assert_eq!(
            pick,
            Pick {
                path: Path::Messages(Algorithm::Ring),
                reason: Reason::Forced
            }
        );
        assert_eq!(forced.pick(all_reduce, 8, 4, true).path, Path::Window);
        // Broadcast is not forced: its mailbox stays.
        assert_eq!(
            forced.pick(Some(Collective::Broadcast), 8, 4, false).path,
            Path::Mailbox
        );
        // A hierarchical all-reduce needs several hosts: forced, the model decides.
        let hier = Tuner {
            forced: "hier".parse().unwrap(),
            ..t
        };
        let pick = hier.pick(all_reduce, 1 << 20, 4, false);
        assert_eq!(pick.reason, Reason::ForcedInvalid(Algorithm::Hierarchical));
        assert!(hier
            .explain_call(all_reduce, 1 << 20, 4, false)
            .contains("forced hier is not available"));
    }

    #[test]
    fn the_hierarchical_row_needs_several_hosts_with_several_ranks_on_one() {
        let row = |hosts, most_local| {
            Tuner::default()
                .with_topology(Topology {
                    hosts,
                    most_local,
                    shared_memory: false,
                    ..Topology::default()
                })
                .table(Some(Collective::AllReduce), 1 << 20, 8, false)
                .into_iter()
                .find(|(p, _)| *p == Path::Messages(Algorithm::Hierarchical))
        };
        assert!(row(1, 8).is_none());
        assert!(row(8, 1).is_none());
        let (_, t) = row(2, 4).expect("two hosts of four ranks");
        assert!(t.is_finite() && t > 0.0);
        // Forced, it runs wherever it is in the table.
        let forced = Tuner::new(DEFAULT_ALPHA, DEFAULT_BETA, "hier".parse().unwrap())
            .with_topology(Topology {
                hosts: 2,
                most_local: 4,
                shared_memory: false,
                ..Topology::default()
            });
        assert_eq!(
            forced.pick(Some(Collective::AllReduce), 8, 8, false).path,
            Path::Messages(Algorithm::Hierarchical)
        );
    }

    #[test]
    fn decide_agrees_with_the_table_without_topology() {
        let t = Tuner::default();
        for c in Collective::ALL {
            for bytes in [8, 1 << 16, 1 << 26] {
                assert_eq!(
                    t.pick(Some(c), bytes, 16, false).path,
                    Path::Messages(t.choose(c, bytes, 16)),
                    "{c} {bytes} B"
                );
            }
        }
    }
}
