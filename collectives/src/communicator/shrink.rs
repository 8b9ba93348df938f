//! Shrinking to the survivors: after a rank's death, or to leave ranks out, the others make a
//! communicator of themselves without restarting, as `ncclCommShrink` and ULFM's
//! `MPI_Comm_shrink` do.
//!
//! The survivors agree over their own lifelines (see [`lifeline`](super::lifeline)), never
//! through the rendezvous store, which may have died with rank 0:
//!
//! 1. Each survivor takes for coordinator the lowest rank it does not exclude whose lifeline
//!    answers (itself, when no rank below it answers) and posts its exclusion list there.
//! 2. The coordinator waits for a proposal from every rank above it that no list excludes,
//!    until that rank's lifeline stops answering (it died) or the timeout passes (it is left
//!    out, and told so when it comes). Then it posts the members: itself and every rank that
//!    proposed and no list excludes.
//! 3. The members join a new communicator through the coordinator's lifeline, which is its
//!    store; the coordinator is its rank 0, and the others keep their order.
//!
//! A coordinator that dies before it posts the members is found by its lifeline closing, and
//! the survivors turn to the next rank. One that dies after is the new communicator's rank 0
//! dying during set-up: the members fail naming it, and may shrink again.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use chorus_transport::store::{PrefixStore, Store};

use super::faults::{self, Lineage};
use super::lifeline::Lifeline;
use super::{Communicator, Inner};
use crate::{Cause, Error, Fault, Result, StoreKind};

/// How often the coordinator looks for new proposals.
const POLL: Duration = Duration::from_millis(10);
/// How often the coordinator probes the ranks it still waits for.
const PROBE_EVERY: Duration = Duration::from_millis(500);

impl Communicator {
    /// A new communicator of this one's ranks less the dead and those in `exclude` (ranks
    /// here), for going on after a rank's death without restarting, like `ncclCommShrink`.
    ///
    /// Every surviving rank calls it, with the same `exclude` (ranks that are excluded do
    /// not call it). Usable on a broken communicator: the survivors agree on who is left over
    /// their own connections, not through the rendezvous store, so rank 0 may be among the
    /// dead. The new communicator's ranks keep their order (the lowest survivor is its
    /// rank 0); faults on it name the job's ranks, as on this one. This communicator stays
    /// as it was; dropping it frees what it holds of the dead ranks.
    ///
    /// A rank that reaches the agreement after the others' timeout, or that another rank's
    /// `exclude` names, fails with [`Error::Excluded`]. Fails with
    /// [`Error::InvalidArgument`] when `exclude` names this rank or a rank out of range,
    /// and as [`split`](Self::split) does when the new communicator cannot be set up (a
    /// member died meanwhile: shrink again).
    pub fn shrink(&self, exclude: &[usize]) -> Result<Communicator> {
        let (rank, world_size) = (self.rank(), self.world_size());
        if let Some(&bad) = exclude.iter().find(|&&r| r >= world_size || r == rank) {
            return Err(Error::InvalidArgument(format!(
                "shrink: rank {rank} cannot exclude rank {bad} (ranks here are 0..{world_size}, \
                 and a rank that calls shrink stays)"
            )));
        }
        let ticket = self.inner.ticket();
        self.inner.in_turn(ticket, |inner, state| {
            let n = state.shrinks;
            state.shrinks += 1;
            inner.shrink(n, exclude)
        })
    }
}

impl Inner {
    fn shrink(&self, n: u64, exclude: &[usize]) -> Result<Communicator> {
        let config = &self.config;
        let (Some(lifeline), Some((_, prefix))) = (&self.lifeline, &self.store) else {
            // One rank: nothing to agree on.
            return Ok(Communicator::assemble(config.clone(), None, None));
        };
        let space = format!("{prefix}/shrink{n}");
        let agreement = Agreement {
            lifeline,
            rank: config.rank,
            timeout: config.timeout,
            auth: &config.auth,
            space: &space,
        };
        let decision = agreement.reach(exclude)?;
        let job_rank = |r: usize| self.monitor.as_ref().map_or(r, |m| m.job_rank(r));
        let members = match decision {
            Decision::Members(members) => members,
            Decision::Left { coordinator, by } => {
                return Err(Error::Excluded {
                    rank: self.job_rank(),
                    coordinator: job_rank(coordinator),
                    named_by: by.map(job_rank),
                })
            }
        };
        let coordinator = members[0];
        let position = |ranks: &[usize]| ranks.iter().position(|&r| r == config.rank);
        let host = self.hosts.iter().find(|h| h.contains(&config.rank));
        let local: Vec<usize> = members
            .iter()
            .copied()
            .filter(|r| host.is_some_and(|h| h.contains(r)))
            .collect();
        let mut sub = config.clone();
        sub.rank = position(&members).expect("a member");
        sub.world_size = members.len();
        sub.local_rank = position(&local).unwrap_or(0);
        sub.local_world_size = local.len().max(1);
        let at = lifeline.addrs[coordinator];
        sub.master_addr = at.ip().to_string();
        sub.master_port = at.port();
        sub.store = StoreKind::Chorus;
        sub.rendezvous = Default::default();
        tracing::info!(
            rank = config.rank,
            new_rank = sub.rank,
            world_size = sub.world_size,
            coordinator,
            "shrunk"
        );
        if sub.world_size == 1 {
            return Ok(Communicator::assemble(sub, None, None));
        }
        let client: Arc<dyn Store> =
            Arc::new(lifeline.client(coordinator, config.timeout, &config.auth)?);
        let lineage = Lineage {
            parent: None,
            job_ranks: members.iter().map(|&r| job_rank(r)).collect(),
        };
        let prefix = format!("{space}/comm");
        let _watch = match coordinator == config.rank {
            true => Some(SetUpWatch::start(
                lifeline.subset(&members),
                PrefixStore::new(prefix.clone(), Arc::clone(&client)),
            )?),
            false => None,
        };
        let hosted = (coordinator == config.rank).then(|| Arc::clone(&lifeline.server));
        Communicator::join(
            sub,
            client,
            prefix,
            hosted,
            Some(lineage),
            Some(lifeline.subset(&members)),
        )
    }
}

/// The coordinator's watch over the members while they set up the new communicator: a member
/// whose lifeline stops answering (it died after the decision, before it joined) fails every
/// member's set-up at once, naming it, instead of at the timeout.
struct SetUpWatch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl SetUpWatch {
    fn start(members: Lifeline, store: PrefixStore<Arc<dyn Store>>) -> Result<SetUpWatch> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("chorus-shrink-watch".into())
            .spawn(move || {
                let mut last = Instant::now();
                while !stopped.load(Ordering::Acquire) {
                    std::thread::sleep(POLL);
                    if last.elapsed() < PROBE_EVERY {
                        continue;
                    }
                    last = Instant::now();
                    let Some(gone) = (1..members.addrs.len()).find(|&r| !members.answers(r)) else {
                        continue;
                    };
                    let fault = Fault::new(Cause::LeftDuringSetUp, Some(gone), 0)
                        .saying("its process is gone: its lifeline no longer answers");
                    if let Err(e) = faults::post(&store, &fault) {
                        tracing::debug!(error = %e, "shrink: cannot fail the set-up");
                    }
                    return;
                }
            })
            .map_err(|source| Error::Resource {
                what: "cannot start the shrink's set-up watch",
                source: source.into(),
            })?;
        Ok(SetUpWatch {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for SetUpWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What the coordinator decided, as one rank learns it.
#[derive(Debug, PartialEq)]
enum Decision {
    /// The new communicator's ranks (ranks here, ascending; the first coordinated).
    Members(Vec<usize>),
    /// This rank is not among them: `coordinator` left it out, because rank `by`'s
    /// exclusion list named it, or (`None`) because it came after the timeout.
    Left {
        coordinator: usize,
        by: Option<usize>,
    },
}

/// One rank's part in agreeing who is left. See the [module documentation](self).
struct Agreement<'a> {
    lifeline: &'a Lifeline,
    rank: usize,
    timeout: Duration,
    auth: &'a chorus_transport::auth::Auth,
    /// The keys' prefix on the coordinator's lifeline: this shrink of this communicator.
    space: &'a str,
}

impl Agreement<'_> {
    /// Finds the coordinator and learns its decision, turning to the next rank while the
    /// coordinator turns out to be gone.
    fn reach(&self, exclude: &[usize]) -> Result<Decision> {
        let excluded: BTreeSet<usize> = exclude.iter().copied().collect();
        let mut candidates = (0..self.lifeline.addrs.len()).filter(|r| !excluded.contains(r));
        loop {
            let Some(coordinator) = candidates
                .by_ref()
                .find(|&r| r == self.rank || self.lifeline.answers(r))
            else {
                return Err(Error::Internal(
                    "shrink: no coordinator, not even this rank".into(),
                ));
            };
            if coordinator == self.rank {
                return self.decide(&excluded);
            }
            match self.propose(coordinator, exclude) {
                Err(Error::Store(e)) if !self.lifeline.answers(coordinator) => {
                    tracing::info!(rank = self.rank, coordinator, error = %e, "shrink: the coordinator is gone; turning to the next rank");
                }
                other => return other,
            }
        }
    }

    /// Posts this rank's exclusion list to `coordinator` and waits for its decision.
    fn propose(&self, coordinator: usize, exclude: &[usize]) -> Result<Decision> {
        // The coordinator waits up to the timeout for the slowest rank, from when it came.
        let store = self
            .lifeline
            .client(coordinator, self.timeout * 2, self.auth)?;
        store.set(
            &self.key(&format!("proposal/{}", self.rank)),
            list(exclude).as_bytes(),
        )?;
        let decision = store.get(&self.key("decision"))?;
        decode(&String::from_utf8_lossy(&decision), self.rank, coordinator)
    }

    /// As the coordinator: gathers the others' proposals, decides, and posts the decision.
    fn decide(&self, excluded: &BTreeSet<usize>) -> Result<Decision> {
        let store = self.lifeline.client(self.rank, self.timeout, self.auth)?;
        let world_size = self.lifeline.addrs.len();
        let mut pending: BTreeSet<usize> = (self.rank + 1..world_size)
            .filter(|r| !excluded.contains(r))
            .collect();
        let mut proposed = vec![self.rank];
        // Who excluded whom: the first list to name a rank.
        let mut named: BTreeMap<usize, usize> = excluded.iter().map(|&r| (r, self.rank)).collect();
        let started = Instant::now();
        let mut probed = started;
        while !pending.is_empty() {
            let ranks: Vec<usize> = pending.iter().copied().collect();
            let keys: Vec<String> = ranks
                .iter()
                .map(|r| self.key(&format!("proposal/{r}")))
                .collect();
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let set = store.check(&keys)?;
            for ((&r, key), _) in ranks.iter().zip(keys).zip(set).filter(|(_, set)| *set) {
                let list = store.get(key)?;
                for x in parse_list(&String::from_utf8_lossy(&list), r)? {
                    named.entry(x).or_insert(r);
                }
                proposed.push(r);
                pending.remove(&r);
            }
            pending.retain(|r| !named.contains_key(r));
            if probed.elapsed() >= PROBE_EVERY {
                pending.retain(|&r| self.lifeline.answers(r));
                probed = Instant::now();
            }
            if started.elapsed() >= self.timeout {
                break;
            }
            if !pending.is_empty() {
                std::thread::sleep(POLL);
            }
        }
        let text = match named.get(&self.rank) {
            Some(&by) => format!(
                "refused rank {by}'s exclusion list names rank {}, which coordinates this \
                 shrink: every rank must pass the same list",
                self.rank
            ),
            None => {
                let mut members: Vec<usize> = proposed
                    .into_iter()
                    .filter(|r| !named.contains_key(r))
                    .collect();
                members.sort_unstable();
                let named: Vec<String> = named.iter().map(|(r, by)| format!("{r}:{by}")).collect();
                format!("members {}\nnamed {}", list(&members), named.join(","))
            }
        };
        if !pending.is_empty() {
            tracing::warn!(rank = self.rank, late = ?pending, "shrink: left out ranks that did not come within the timeout");
        }
        store.set(&self.key("decision"), text.as_bytes())?;
        decode(&text, self.rank, self.rank)
    }

    fn key(&self, what: &str) -> String {
        format!("{}/{what}", self.space)
    }
}

/// Reads the decision `text` of `coordinator` for rank `rank`.
fn decode(text: &str, rank: usize, coordinator: usize) -> Result<Decision> {
    if let Some(why) = text.strip_prefix("refused ") {
        return Err(Error::InvalidArgument(format!("shrink: {why}")));
    }
    let malformed = || Error::Internal(format!("shrink: a malformed decision {text:?}"));
    let mut lines = text.lines();
    let members = lines
        .next()
        .and_then(|l| l.strip_prefix("members "))
        .ok_or_else(malformed)?;
    let named = lines
        .next()
        .and_then(|l| l.strip_prefix("named "))
        .ok_or_else(malformed)?;
    let members = parse_list(members, coordinator)?;
    if members.contains(&rank) {
        return Ok(Decision::Members(members));
    }
    let by = named
        .split(',')
        .filter_map(|pair| pair.split_once(':'))
        .find(|(r, _)| r.parse() == Ok(rank))
        .and_then(|(_, by)| by.parse().ok());
    Ok(Decision::Left { coordinator, by })
}

/// `ranks` as a comma-separated list, as [`parse_list`] reads it.
fn list(ranks: &[usize]) -> String {
    let ranks: Vec<String> = ranks.iter().map(usize::to_string).collect();
    ranks.join(",")
}

/// Parses a comma-separated list of ranks that rank `from` posted.
fn parse_list(text: &str, from: usize) -> Result<Vec<usize>> {
    text.split(',')
        .filter(|r| !r.is_empty())
        .map(|r| {
            r.parse().map_err(|_| {
                Error::Internal(format!(
                    "shrink: rank {from} posted a malformed list {text:?}"
                ))
            })
        })
        .collect()
}
