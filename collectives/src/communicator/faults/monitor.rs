//! Watching collectives from the side: who is stuck, who died, who called what.
//!
//! Every communicator with peers runs a listener thread on the rendezvous
//! store. Ranks post numbered events under the communicator's key prefix:
//!
//! - an *alarm*: a rank found a [`Fault`] (a dead peer, a mismatched call, a
//!   stall). Every listener fails its communicator with it, so all ranks
//!   fail promptly and name the same culprit. The first alarm wins and stays
//!   readable, so a rank that only saw the fallout (a neighbour closing its
//!   sockets as it gave up) reports the cause instead.
//! - a *question*: every listener answers with what its rank is doing, so a
//!   waiting rank can say which ranks have not joined its call.
//!
//! Nothing touches the store on the hot path: a collective only records its
//! [`Activity`] under an uncontended mutex.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use chorus_transport::store::{PrefixStore, Store, StoreError};
use chorus_transport::{Transport, TransportError};

use crate::communicator::{connect_store, lock, CallInfo, Inner};
use crate::executor::Watch;
use crate::{Cause, Config, Error, Fault, StoreKind};

/// How long one wait for the next event lasts before the listener looks around.
const LISTEN_TICK: Duration = Duration::from_secs(5);
/// How long a rank that saw rank 0's connection close waits for its listener to tell why.
const RANK_0_WAIT: Duration = Duration::from_millis(200);

/// What a rank learns after rank 0's connection closed.
enum Rank0 {
    /// Rank 0 raised this alarm before it left.
    Alarm(Fault),
    /// The store rank 0 hosted is gone too: rank 0 died.
    Gone,
}

/// What this rank is doing: its latest collective and whether it is still in it.
#[derive(Debug, Default)]
pub(crate) struct Activity(Mutex<Doing>);

#[derive(Debug, Default)]
struct Doing {
    seq: u64,
    call: Option<CallInfo>,
    running: bool,
    since: Option<Instant>,
}

impl Activity {
    pub fn begin(&self, seq: u64, call: CallInfo, now: Instant) {
        *lock(&self.0) = Doing {
            seq,
            call: Some(call),
            running: true,
            since: Some(now),
        };
    }

    pub fn end(&self) {
        let mut doing = lock(&self.0);
        doing.running = false;
        doing.since = Some(Instant::now());
    }

    /// The status line peers read: `seq running elapsed_ms call`.
    fn encode(&self) -> String {
        let doing = lock(&self.0);
        let elapsed = doing.since.map_or(0, |t| t.elapsed().as_millis());
        let call = doing
            .call
            .map_or_else(|| "nothing".to_string(), |c| c.to_string());
        format!("{} {} {elapsed} {call}", doing.seq, u8::from(doing.running))
    }
}

/// One rank's answer to a question.
#[derive(Debug, Clone, PartialEq)]
struct Status {
    seq: u64,
    running: bool,
    elapsed: Duration,
    call: String,
}

impl Status {
    fn decode(text: &str) -> Option<Status> {
        let mut parts = text.splitn(4, ' ');
        Some(Status {
            seq: parts.next()?.parse().ok()?,
            running: parts.next()? == "1",
            elapsed: Duration::from_millis(parts.next()?.parse().ok()?),
            call: parts.next()?.to_string(),
        })
    }
}

/// Where a communicator made from another ([`split`](crate::Communicator::split),
/// [`shrink`](crate::Communicator::shrink)) sits in its job.
pub(crate) struct Lineage {
    /// The monitor of the communicator it was split from (none for a shrunk one: faults do
    /// not travel between a communicator and the one its survivors made).
    pub parent: Option<Arc<Monitor>>,
    /// The job's rank of each of its ranks.
    pub job_ranks: Vec<usize>,
}

/// This rank's side of the monitoring: its store client, its activity and its listener.
///
/// The monitors of a job's communicators form a family: an alarm raised on a communicator
/// split from another is raised on that one too, up to the job's first communicator, and an
/// alarm heard on a communicator fails those split from it, so that every rank of the job
/// fails at once and names the same culprit, whichever communicator it was waiting in.
pub(crate) struct Monitor {
    rank: usize,
    world_size: usize,
    /// The job's rank of each rank here (the identity on a job's first communicator).
    job_ranks: Vec<usize>,
    /// The monitor of the communicator this one was split from.
    parent: Option<Arc<Monitor>>,
    /// A client of its own whose short timeout bounds every question and alarm.
    store: PrefixStore<Arc<dyn Store>>,
    /// How long to wait for answers.
    grace: Duration,
    /// When, into a call, the watchdog asks around (`None`: never).
    warn_after: Option<Duration>,
    pub activity: Activity,
    /// The alarm the listener received, kept for when the store is gone.
    heard: Mutex<Option<Fault>>,
    /// Whether rank 0 hosts the store (so the store's loss means rank 0's).
    store_on_rank_0: bool,
    /// Set when the listener lost the store while the communicator was in use.
    store_lost: AtomicBool,
    stop: AtomicBool,
}

impl Monitor {
    /// Connects a client for the communicator under `prefix` and starts listening.
    ///
    /// The listener holds `inner` weakly, so it never keeps a dropped communicator alive.
    pub fn start(
        config: &Config,
        prefix: &str,
        inner: Weak<Inner>,
        lineage: Option<Lineage>,
    ) -> Result<Arc<Monitor>, Error> {
        let grace = (config.timeout / 10).clamp(Duration::from_secs(1), Duration::from_secs(5));
        let client = connect_store(config, grace)?;
        let warn_after = (config.watchdog > 0.0).then(|| config.timeout.mul_f64(config.watchdog));
        let (parent, job_ranks) = match lineage {
            Some(l) => (l.parent, l.job_ranks),
            None => (None, (0..config.world_size).collect()),
        };
        let monitor = Arc::new(Monitor {
            rank: config.rank,
            world_size: config.world_size,
            job_ranks,
            parent,
            store: PrefixStore::new(format!("{prefix}/monitor"), client),
            grace,
            warn_after,
            activity: Activity::default(),
            heard: Mutex::new(None),
            store_on_rank_0: config.store == StoreKind::Chorus,
            store_lost: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        let listener = monitor.clone();
        std::thread::Builder::new()
            .name(format!("chorus-monitor-{}", config.rank))
            .spawn(move || listener.listen(&inner))
            .map_err(|source| Error::Resource {
                what: "cannot start the monitor thread",
                source: source.into(),
            })?;
        Ok(monitor)
    }

    /// Lets the listener go (it exits at its next event or tick) and says goodbye.
    ///
    /// The store's host (`hosts_store`) first waits, up to the grace period, for the goodbye
    /// of every rank but `gone` (the job's rank of one whose process is known to be gone), so
    /// ranks that are failing can still read the alarm that explains why.
    pub fn stop(&self, hosts_store: bool, gone: Option<usize>) {
        self.stop.store(true, Ordering::Release);
        if self.store.set(&format!("bye/{}", self.rank), b"").is_ok() && hosts_store {
            let keys: Vec<String> = (0..self.world_size)
                .filter(|&r| Some(self.job_rank(r)) != gone)
                .map(|r| format!("bye/{r}"))
                .collect();
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            if let Err(e) = self.store.wait(&keys, self.grace) {
                tracing::debug!(rank = self.rank, error = %e, "closing the store before every rank said goodbye");
            }
        }
        // Wakes the listener from its wait, so its thread and connections go now.
        self.store.inner().shutdown();
    }

    /// Serves events until stopped or the store goes away.
    fn listen(&self, inner: &Weak<Inner>) {
        let mut next: i64 = 1;
        while !self.stop.load(Ordering::Acquire) {
            let key = format!("event/{next}");
            match self.store.wait(&[&key], LISTEN_TICK) {
                Ok(()) => {
                    match self.store.get(&key) {
                        Ok(event) => self.handle(next, &event, inner),
                        Err(e) => return self.lost(&e),
                    }
                    next += 1;
                }
                Err(StoreError::Timeout { .. }) => {
                    // An event whose poster died between numbering and posting it
                    // would block the ones after it: skip it once later ones exist.
                    match self.store.add("events", 0) {
                        Ok(posted) if posted > next => next += 1,
                        Ok(_) => {}
                        Err(e) => return self.lost(&e),
                    }
                }
                Err(e) => return self.lost(&e),
            }
        }
    }

    fn lost(&self, e: &StoreError) {
        if !self.stop.load(Ordering::Acquire) {
            self.store_lost.store(true, Ordering::Release);
            tracing::debug!(rank = self.rank, error = %e, "monitor: the store is gone; no more fault reports");
        }
    }

    fn handle(&self, number: i64, event: &[u8], inner: &Weak<Inner>) {
        let event = String::from_utf8_lossy(event);
        tracing::debug!(rank = self.rank, number, %event, "monitor event");
        if event == "ask" {
            let answer = self.activity.encode();
            if let Err(e) = self
                .store
                .set(&format!("status/{number}/{}", self.rank), answer.as_bytes())
            {
                tracing::debug!(rank = self.rank, error = %e, "monitor: cannot answer");
            }
        } else if let Some(alarm) = event.strip_prefix("alarm ") {
            let fault = self.own_part(self.read_fault(alarm));
            lock(&self.heard).get_or_insert_with(|| fault.clone());
            if let Some(inner) = inner.upgrade() {
                tracing::error!(rank = self.rank, "{fault}");
                inner.fail_family(&fault);
            }
        }
    }

    /// Posts an event; returns its number.
    fn post(&self, event: &str) -> Result<i64, StoreError> {
        let number = self.store.add("events", 1)?;
        self.store
            .set(&format!("event/{number}"), event.as_bytes())?;
        Ok(number)
    }

    /// Tells every rank to fail with `fault`, unless another alarm came first; returns the
    /// alarm that stands (this one or the earlier one).
    pub fn raise(&self, fault: &Fault) -> Result<Fault, StoreError> {
        if self.store.add("alarms", 1)? > 1 {
            return Ok(self.alarm()?.unwrap_or_else(|| fault.clone()));
        }
        // The alarm is readable before anyone is woken by it.
        let alarm = fault.encode();
        self.store.set("alarm", alarm.as_bytes())?;
        self.post(&format!("alarm {alarm}"))?;
        Ok(fault.clone())
    }

    /// Raises `fault` here and, where it is the alarm that stands here, on the
    /// communicators this one was split from; returns the alarm that stands.
    fn raise_up(&self, fault: &Fault) -> Result<Fault, StoreError> {
        let standing = self.raise(fault)?;
        match &self.parent {
            // A parent already dropped (its store client shut) has no one left to tell.
            Some(parent) if standing == *fault => Ok(parent.raise_up(fault).unwrap_or(standing)),
            _ => Ok(standing),
        }
    }

    /// The alarm raised so far on this communicator or, failing that, on one it was split from.
    fn family_alarm(&self) -> Result<Option<Fault>, StoreError> {
        match (self.alarm()?, &self.parent) {
            (None, Some(parent)) => Ok(parent.family_alarm().unwrap_or(None)),
            (own, _) => Ok(own),
        }
    }

    /// The job's rank of each rank of this communicator.
    pub fn job_ranks(&self) -> &[usize] {
        &self.job_ranks
    }

    /// The job's rank of this communicator's `rank`.
    pub(crate) fn job_rank(&self, rank: usize) -> usize {
        self.job_ranks.get(rank).copied().unwrap_or(rank)
    }

    /// A fault this rank found through the transport's error `source`, outside any call: its
    /// cause, the peer it names as the culprit, and the transport's words.
    fn finding(&self, source: &TransportError) -> Fault {
        let reset = |e: &io::Error| {
            matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
            )
        };
        let cause = match source {
            TransportError::PeerClosed { .. } => Cause::PeerClosed,
            TransportError::Io { source, .. } if reset(source) => Cause::PeerClosed,
            TransportError::Timeout { .. } => Cause::Timeout,
            TransportError::Protocol { .. } => Cause::Mismatch,
            _ => Cause::Transport,
        };
        let culprit = source.peer().map(|peer| self.job_rank(peer));
        Fault::new(cause, culprit, self.job_rank(self.rank)).saying(source.to_string())
    }

    /// `fault`, whose words name ranks of this communicator, saying which of the job's ranks
    /// they are, where the two differ.
    fn in_job_terms(&self, fault: Fault) -> Fault {
        if self.job_ranks.iter().enumerate().all(|(i, &r)| i == r) {
            return fault;
        }
        let here: Vec<usize> = (0..self.job_ranks.len()).collect();
        let detail = format!(
            "{} (on a communicator made from the job's, whose {} are {} of the job)",
            fault.detail,
            ranks(&here),
            ranks(&self.job_ranks)
        );
        fault.saying(detail)
    }

    /// The fault in an alarm's text. Ranks of one job run one version of Chorus, so the text
    /// is always one; anything else is kept as the detail of a fault of unknown origin.
    fn read_fault(&self, text: &str) -> Fault {
        Fault::decode(text).unwrap_or_else(|| {
            Fault::new(Cause::Transport, None, self.job_rank(self.rank)).saying(text)
        })
    }

    /// The alarm raised so far, if any (waiting briefly for it if it is being written).
    fn alarm(&self) -> Result<Option<Fault>, StoreError> {
        if let Some(heard) = self.heard() {
            return Ok(Some(heard));
        }
        if self.store.add("alarms", 0)? == 0 {
            return Ok(None);
        }
        self.store.wait(&["alarm"], self.grace)?;
        let text = self.store.get("alarm")?;
        Ok(Some(self.read_fault(&String::from_utf8_lossy(&text))))
    }

    /// After rank 0's connection closed, on a rank of a job whose store rank 0 hosts: waits
    /// a moment for the listener to hear either the alarm rank 0 raised before leaving (it
    /// failed on something else) or the store's loss (rank 0 died, and asking the store
    /// would only wait out its timeout). `None` when neither came, or the store is elsewhere.
    fn after_rank_0_closed(&self) -> Option<Rank0> {
        if !self.store_on_rank_0 || self.job_ranks[self.rank] == 0 {
            return None;
        }
        let until = Instant::now() + RANK_0_WAIT;
        loop {
            if let Some(cause) = self.heard() {
                return Some(Rank0::Alarm(cause));
            }
            if self.store_lost.load(Ordering::Acquire) {
                return Some(Rank0::Gone);
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The alarm the listener has received, if any.
    fn heard(&self) -> Option<Fault> {
        lock(&self.heard).clone()
    }

    /// Asks every rank what it is doing; `None` for ranks that did not answer in time.
    fn ask(&self) -> Result<Vec<Option<Status>>, StoreError> {
        let number = self.post("ask")?;
        let keys: Vec<String> = (0..self.world_size)
            .map(|r| format!("status/{number}/{r}"))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        // A timeout here just means some ranks stayed silent; read what came.
        let _ = self.store.wait(&refs, self.grace);
        Ok(keys
            .iter()
            .map(|k| {
                let text = self.store.get(k).ok()?;
                Status::decode(&String::from_utf8_lossy(&text))
            })
            .collect())
    }

    /// Explains what the other ranks are doing while this one waits in call `seq`.
    fn survey(&self, seq: u64, call: &CallInfo) -> Survey {
        let statuses = match self.ask() {
            Ok(s) => s,
            Err(e) => {
                return Survey {
                    text: format!("cannot ask the other ranks ({e})"),
                    ..Survey::default()
                }
            }
        };
        let mut survey = Survey::default();
        let mut waiting = Vec::new();
        let mut notes = Vec::new();
        let mine = call.to_string();
        for (rank, status) in statuses.into_iter().enumerate() {
            if rank == self.rank {
                continue;
            }
            let Some(s) = status else {
                survey.silent.push(rank);
                continue;
            };
            let secs = s.elapsed.as_secs_f64();
            if s.seq == seq && s.running && s.call == mine {
                waiting.push(rank);
            } else if s.seq == seq && s.call != mine {
                survey.differs.get_or_insert(rank);
                notes.push(format!("rank {rank} called {} as #{seq}", s.call));
            } else if s.seq < seq && !s.running {
                survey.behind.get_or_insert(rank);
                notes.push(format!(
                    "rank {rank} has not joined it (last finished #{} {}, {secs:.1} s ago)",
                    s.seq, s.call
                ));
            } else if s.seq < seq {
                survey.behind.get_or_insert(rank);
                notes.push(format!(
                    "rank {rank} is still in #{} {} ({secs:.1} s)",
                    s.seq, s.call
                ));
            } else if s.seq > seq {
                notes.push(format!("rank {rank} is already at #{} {}", s.seq, s.call));
            } else {
                notes.push(format!(
                    "rank {rank} finished #{seq} {} {secs:.1} s ago",
                    s.call
                ));
            }
        }
        if !survey.silent.is_empty() {
            notes.push(format!(
                "{} did not answer within {:.1} s (stopped, or hung outside Chorus?)",
                ranks(&survey.silent),
                self.grace.as_secs_f64()
            ));
        }
        if !waiting.is_empty() {
            notes.push(format!("{} waiting in the same call", ranks(&waiting)));
        }
        survey.text = notes.join("; ");
        survey
    }

    /// Marks `silent` as ranks a timed-out call gave up on, for them to read if they resume.
    fn mark_silent(&self, silent: &[usize]) {
        for rank in silent {
            if let Err(e) = self.store.add(&format!("silent/{rank}"), 1) {
                tracing::debug!(rank = self.rank, error = %e, "monitor: cannot mark rank {rank} silent");
            }
        }
    }

    /// `fault`, the alarm this rank fails with, told from this rank's side where it is the
    /// rank the others gave up on (it was stopped, and resumed too late).
    fn own_part(&self, fault: Fault) -> Fault {
        let me = self.job_rank(self.rank);
        if fault.cause == Cause::Unresponsive && fault.culprit == Some(me) {
            return fault;
        }
        match self.store.add(&format!("silent/{}", self.rank), 0) {
            Ok(marks) if marks > 0 => Fault {
                cause: Cause::Unresponsive,
                culprit: Some(me),
                detail: fault.to_string(),
                ..fault
            },
            _ => fault,
        }
    }
}

/// What the other ranks were doing while this one waited in a call.
#[derive(Default)]
struct Survey {
    /// Their answers, in words.
    text: String,
    /// The ranks that did not answer.
    silent: Vec<usize>,
    /// The first rank that called something else in this call's place.
    differs: Option<usize>,
    /// The first rank that had not reached this call.
    behind: Option<usize>,
}

impl Survey {
    /// The rank that held the call up: the first silent one, else the first one behind.
    fn holder(&self) -> Option<usize> {
        self.silent.first().copied().or(self.behind)
    }
}

/// "rank 3" or "ranks 1, 2".
pub(crate) fn ranks(list: &[usize]) -> String {
    let names: Vec<String> = list.iter().map(usize::to_string).collect();
    match list {
        [one] => format!("rank {one}"),
        _ => format!("ranks {}", names.join(", ")),
    }
}

/// The watchdog for one call: warns when it stalls and explains how it failed.
pub(crate) struct Watcher<'a> {
    pub monitor: &'a Monitor,
    /// Asked about ranks that do not answer the watchdog's question.
    pub transport: Option<&'a dyn Transport>,
    pub seq: u64,
    pub call: CallInfo,
    pub started: Instant,
}

impl Watch for Watcher<'_> {
    fn warn_at(&self) -> Option<Instant> {
        self.monitor.warn_after.map(|d| self.started + d)
    }

    fn stalled(&self) -> Option<TransportError> {
        let (rank, seq, call) = (self.monitor.rank, self.seq, self.call);
        let waited = self.started.elapsed().as_secs_f64();
        let survey = self.monitor.survey(seq, &call);
        tracing::warn!(
            "rank {rank}: {call} #{seq} has waited {waited:.1} s: {}",
            survey.text
        );
        // A rank that did not answer, and whose host has acknowledged nothing for as long as
        // the question waited, is gone (a pulled link, a machine down), not stopped or slow.
        let transport = self.transport?;
        survey.silent.iter().find_map(|&peer| {
            let quiet = transport
                .unanswered(peer)
                .filter(|&q| q >= self.monitor.grace)?;
            let why = format!(
                "its host has acknowledged nothing for {:.1} s (its link or machine is down?)",
                quiet.as_secs_f64()
            );
            let timed_out = io::Error::from(io::ErrorKind::TimedOut);
            Some(TransportError::io(peer, "wait", Some(why), timed_out))
        })
    }

    fn failed(&self, error: Error) -> Error {
        match self.explain(error) {
            Error::Aborted(fault) => Error::Aborted(Box::new(self.monitor.own_part(*fault))),
            other => other,
        }
    }
}

impl Watcher<'_> {
    /// The error a failed call reports: the alarm that explains it, or this rank's own
    /// finding, raised as the alarm for the others.
    fn explain(&self, error: Error) -> Error {
        let (monitor, seq, call) = (self.monitor, self.seq, self.call);
        let Error::Transport { source, .. } = &error else {
            return error;
        };
        let found = monitor.finding(source).in_call(call, seq);
        if let Some(explained) = monitor.cause(source, &found) {
            return explained;
        }
        let fault = match found.cause {
            Cause::Timeout => {
                let waited = self.started.elapsed().as_secs_f64();
                let survey = monitor.survey(seq, &call);
                monitor.mark_silent(&survey.silent);
                Fault {
                    culprit: survey.holder().map(|r| monitor.job_rank(r)),
                    ..found
                }
                .saying(format!("timed out after {waited:.1} s: {}", survey.text))
            }
            Cause::Mismatch => {
                let survey = monitor.survey(seq, &call);
                let culprit = survey.differs.map(|r| monitor.job_rank(r));
                let detail = format!("{} ({source})", survey.text);
                Fault {
                    culprit: culprit.or(found.culprit),
                    ..found
                }
                .saying(detail)
            }
            _ => found,
        };
        monitor.alert(fault)
    }
}

impl Monitor {
    /// Explains a point-to-point exchange's failure as a collective's is: by the
    /// alarm another rank raised first, or by raising one, so every rank names the
    /// same culprit (a pipeline's far stages included). A timeout raises none: a
    /// message that has not come yet fails this rank only, as peers may still be
    /// about to send theirs.
    pub fn point_to_point_failed(&self, error: Error) -> Error {
        let Error::Transport { source, .. } = &error else {
            return error;
        };
        let found = self.finding(source);
        if let Some(explained) = self.cause(source, &found) {
            return explained;
        }
        if found.cause == Cause::Timeout {
            return found.into();
        }
        self.alert(found)
    }

    /// What explains the transport failure `source` that this rank `found`, if not this
    /// rank's own finding: an abort (the error as it is, for the communicator to report
    /// the abort's cause), rank 0's alarm or death, another rank's alarm, or the store's loss.
    fn cause(&self, source: &TransportError, found: &Fault) -> Option<Error> {
        if let TransportError::Aborted(_) = source {
            return Some(Error::transport(self.rank, source.clone()));
        }
        let store_host_gone = |detail: String| {
            let fault = Fault {
                cause: Cause::StoreHostGone,
                culprit: Some(0),
                ..found.clone()
            };
            Error::Aborted(Box::new(fault.saying(detail)))
        };
        let peer_is_rank_0 = matches!(source, TransportError::PeerClosed { peer } if self.job_ranks.get(*peer) == Some(&0));
        if peer_is_rank_0 {
            match self.after_rank_0_closed() {
                Some(Rank0::Alarm(fault)) => return Some(Error::Aborted(Box::new(fault))),
                Some(Rank0::Gone) => return Some(store_host_gone(source.to_string())),
                None => {}
            }
        }
        // A rank that found the fault first has explained it; this one may only see its fallout.
        match self.family_alarm() {
            Ok(Some(fault)) => Some(Error::Aborted(Box::new(fault))),
            Ok(None) => None,
            Err(e) => {
                // The listener may have read the alarm while the store was still up.
                if let Some(fault) = self.heard() {
                    return Some(Error::Aborted(Box::new(fault)));
                }
                Some(if self.store_on_rank_0 {
                    store_host_gone(format!("{source} (and the store: {e})"))
                } else {
                    let detail = format!("{source}; the rendezvous store is unreachable too ({e})");
                    let fault = Fault {
                        cause: Cause::StoreLost,
                        ..found.clone()
                    };
                    Error::Aborted(Box::new(fault.saying(detail)))
                })
            }
        }
    }

    /// Raises `fault`, told in the job's ranks, as the alarm here and on the communicators
    /// this one was split from, and returns its error, unless an alarm came first: then
    /// returns that one.
    fn alert(&self, fault: Fault) -> Error {
        // An alarm heard while surveying came first (its rank may be gone by now,
        // and the store with it).
        if let Some(heard) = self.heard() {
            return Error::Aborted(Box::new(heard));
        }
        let fault = self.in_job_terms(fault);
        match self.raise_up(&fault) {
            Ok(standing) if standing != fault => Error::Aborted(Box::new(standing)),
            Ok(_) => fault.into(),
            Err(e) => {
                if let Some(heard) = self.heard() {
                    return Error::Aborted(Box::new(heard));
                }
                tracing::warn!(rank = self.rank, "cannot tell the other ranks: {e}");
                fault.into()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CallKind, DType, ReduceOp};

    #[test]
    fn status_lines_round_trip() {
        let activity = Activity::default();
        let reduce = CallInfo::new(CallKind::Reduce, DType::F32, ReduceOp::Sum, 1, 5).unwrap();
        activity.begin(17, reduce, Instant::now());
        let status = Status::decode(&activity.encode()).expect("decodes");
        assert_eq!((status.seq, status.running), (17, true));
        assert_eq!(status.call, "reduce(float sum, 5 elements, root 1)");
        activity.end();
        assert!(!Status::decode(&activity.encode()).unwrap().running);
        assert_eq!(Status::decode("garbage"), None);
    }

    #[test]
    fn rank_lists_read_naturally() {
        assert_eq!(ranks(&[3]), "rank 3");
        assert_eq!(ranks(&[1, 2]), "ranks 1, 2");
    }
}
