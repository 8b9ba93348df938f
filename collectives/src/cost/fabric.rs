//! The evaluator's links: how the messages in flight share them.
//!
//! A message crosses two links at once, its sender's outgoing link and its
//! receiver's incoming one (see [`Network`] for whose links they are). Each
//! ordered pair of ranks is one connection, which carries its messages one
//! after another, as a TCP stream does; a link is shared equally between the
//! connections with a message on it, and a message moves at the smaller of
//! its two shares. A message needs `alpha + bytes / beta` seconds of a whole
//! link, so alone on its links it takes exactly that, and a link never
//! carries more than one second of work a second.
//!
//! As the transport reads a socket only while a receive is posted on it, a
//! message whose receive is not posted yet crosses only its first [`EAGER`]
//! bytes (what the sockets' buffers hold), then stops until it is.
//!
//! Shares are local: a connection held back at its other end leaves part of
//! its share of this link unused (max-min fairness would hand it on). On the
//! collectives' patterns, where a rank's partners are as busy as it is, the
//! two agree.

use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use super::{LinkModel, Network};

/// Bytes of a message that cross before its receive is posted: about what a TCP
/// connection's buffers hold for a socket nobody reads (a 64 KiB window).
pub const EAGER: f64 = 65536.0;

/// `what` happens at `t`; `seq` orders equal times (first pushed, first popped).
#[derive(Debug, Clone, Copy)]
pub(super) struct At<T> {
    pub t: f64,
    pub seq: u64,
    pub what: T,
}

impl<T> PartialEq for At<T> {
    fn eq(&self, other: &At<T>) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}

impl<T> Eq for At<T> {}

impl<T> PartialOrd for At<T> {
    fn partial_cmp(&self, other: &At<T>) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl<T> Ord for At<T> {
    /// Reversed, so that a max-heap pops the earliest (then the first pushed).
    fn cmp(&self, other: &At<T>) -> std::cmp::Ordering {
        other
            .t
            .total_cmp(&self.t)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

/// A multiplicative hash for the (sender, receiver) keys of [`pair`].
#[derive(Default)]
pub(super) struct PairHasher(u64);

impl Hasher for PairHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by ordered pairs of ranks.
pub(super) type Pairs<V> = HashMap<u64, V, BuildHasherDefault<PairHasher>>;

/// The key of the ordered pair `src` to `dst`.
pub(super) fn pair(src: usize, dst: usize) -> u64 {
    (src as u64) << 32 | dst as u64
}

/// A message that has crossed its links at `t`: its sender's request `req` is done and it
/// has reached `dst`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Delivered {
    pub t: f64,
    pub src: usize,
    pub dst: usize,
    pub bytes: u64,
    pub req: u32,
}

/// Where a connection's first message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// There is none.
    Idle,
    /// On its links.
    Moving,
    /// Off its links until its receive is posted.
    Stalled,
}

/// A connection with messages to carry or receives posted.
struct Flow {
    src: u32,
    dst: u32,
    /// Its outgoing and incoming link, and its place in each one's list while it moves.
    links: [usize; 2],
    slots: [usize; 2],
    model: LinkModel,
    /// The messages' sizes and their senders' requests.
    queue: VecDeque<(u64, u32)>,
    /// Messages delivered and receives posted so far.
    delivered: u64,
    recvs: u64,
    phase: Phase,
    /// Seconds of a whole link the first message still needed at `since`.
    left: f64,
    /// What is left when it stops for its receive (0: it runs to the end).
    stall: f64,
    /// Its share of a link since `since` (0 before it has one).
    rate: f64,
    since: f64,
    /// The `seq` of its current timer (0: none).
    timer: u64,
}

/// The links of a network and the connections crossing them.
pub(super) struct Fabric {
    net: Network,
    hosts: usize,
    /// The flows on each link: the hosts' outgoing and incoming links, then each rank's own.
    links: Vec<Vec<u32>>,
    flows: Vec<Flow>,
    /// Entries of `flows` free for reuse.
    idle: Vec<u32>,
    by_pair: Pairs<u32>,
    /// When each flow's first message would be done (stale ones are skipped).
    timers: BinaryHeap<At<u32>>,
    seq: u64,
    /// Links whose flows changed at `changed_at` (marked in `is_changed`), to reshare
    /// once time moves on.
    changed: Vec<usize>,
    is_changed: Vec<bool>,
    changed_at: f64,
}

impl Fabric {
    /// The links of `world` ranks on `net`.
    pub fn new(net: &Network, world: usize) -> Fabric {
        let hosts = net.host(world.saturating_sub(1)) + 1;
        Fabric {
            net: *net,
            hosts,
            links: vec![Vec::new(); 2 * (hosts + world)],
            flows: Vec::new(),
            idle: Vec::new(),
            by_pair: Pairs::default(),
            timers: BinaryHeap::new(),
            seq: 0,
            changed: Vec::new(),
            is_changed: vec![false; 2 * (hosts + world)],
            changed_at: 0.0,
        }
    }

    /// When the links' flows last changed, if they have not been reshared since: events at
    /// that instant go first, so that a link is reshared once for all of them.
    pub fn changed_at(&self) -> Option<f64> {
        (!self.changed.is_empty()).then_some(self.changed_at)
    }

    /// Rank `src`'s message of `bytes` to `dst` (its request `req`) starts at `t`, behind
    /// the connection's earlier ones. `t` is never before an earlier call's or a step's.
    pub fn send(&mut self, t: f64, src: usize, dst: usize, bytes: u64, req: u32) {
        let f = self.flow(src, dst);
        let flow = &mut self.flows[f as usize];
        flow.queue.push_back((bytes, req));
        if flow.queue.len() == 1 {
            self.head(f, t);
        }
    }

    /// Rank `dst` posts a receive from `src` at `t` (the next one on their connection).
    pub fn recv(&mut self, t: f64, src: usize, dst: usize) {
        let f = self.flow(src, dst);
        let flow = &mut self.flows[f as usize];
        flow.recvs += 1;
        if flow.queue.is_empty() || flow.recvs != flow.delivered + 1 || flow.stall == 0.0 {
            return;
        }
        // The first message may now cross to its end.
        flow.stall = 0.0;
        match flow.phase {
            Phase::Moving => {
                flow.left -= (t - flow.since) * flow.rate;
                flow.since = t;
                self.seq += 1;
                arm(flow, self.seq, &mut self.timers, f);
            }
            Phase::Stalled => self.start(f, t),
            Phase::Idle => {}
        }
    }

    /// When the next message will have crossed its links or stop for its receive, if one
    /// is in flight.
    pub fn next(&mut self) -> Option<f64> {
        loop {
            let top = self.timers.peek().copied();
            if let Some(top) = top {
                if self.flows[top.what as usize].timer != top.seq {
                    self.timers.pop();
                    continue;
                }
            }
            // A timer at the instant of a change stands: shares change from then on.
            let later = top.is_none_or(|top| top.t > self.changed_at);
            if !self.changed.is_empty() && later {
                self.reshare();
                continue;
            }
            return top.map(|top| top.t);
        }
    }

    /// Moves on to the time [`Fabric::next`] named: a message has crossed (its connection's
    /// next one starts), or (`None`) one stops for its receive.
    pub fn step(&mut self) -> Option<Delivered> {
        self.next()?;
        let At { t, what: f, .. } = self.timers.pop()?;
        let flow = &mut self.flows[f as usize];
        match flow.phase {
            Phase::Moving if flow.stall > 0.0 => {
                flow.left = flow.stall;
                self.stop(f, t, Phase::Stalled);
                return None;
            }
            Phase::Moving => {}
            Phase::Stalled | Phase::Idle => return None,
        }
        let (bytes, req) = flow.queue.pop_front()?;
        flow.delivered += 1;
        let done = Delivered {
            t,
            src: flow.src as usize,
            dst: flow.dst as usize,
            bytes,
            req,
        };
        if !flow.queue.is_empty() {
            self.head(f, t);
            return Some(done);
        }
        self.stop(f, t, Phase::Idle);
        let flow = &self.flows[f as usize];
        if flow.recvs == flow.delivered {
            self.by_pair.remove(&pair(done.src, done.dst));
            self.idle.push(f);
        }
        Some(done)
    }

    /// Flow `f` of the pair `src` to `dst`, opened if it has none.
    fn flow(&mut self, src: usize, dst: usize) -> u32 {
        match self.by_pair.get(&pair(src, dst)) {
            Some(&f) => f,
            None => self.open(src, dst),
        }
    }

    /// The first message of flow `f` starts at `t`. Unless its receive is posted, it will
    /// cross only as much as the buffers hold.
    fn head(&mut self, f: u32, t: f64) {
        let flow = &mut self.flows[f as usize];
        flow.left = flow.model.message(flow.queue[0].0 as f64);
        flow.stall = if flow.recvs > flow.delivered {
            0.0
        } else {
            (flow.left - flow.model.message(EAGER)).max(0.0)
        };
        if flow.phase == Phase::Moving {
            flow.since = t;
            self.seq += 1;
            arm(flow, self.seq, &mut self.timers, f);
        } else {
            self.start(f, t);
        }
    }

    /// Puts flow `f` on its links at `t`.
    fn start(&mut self, f: u32, t: f64) {
        let flow = &mut self.flows[f as usize];
        flow.phase = Phase::Moving;
        flow.rate = 0.0;
        flow.since = t;
        for (link, slot) in flow.links.into_iter().zip(&mut flow.slots) {
            *slot = self.links[link].len();
            self.links[link].push(f);
        }
        self.change(f, t);
    }

    /// Takes flow `f` off its links at `t`, into `phase`.
    fn stop(&mut self, f: u32, t: f64, phase: Phase) {
        let flow = &mut self.flows[f as usize];
        flow.phase = phase;
        flow.timer = 0;
        let (links, slots) = (flow.links, flow.slots);
        for (link, slot) in links.into_iter().zip(slots) {
            let on = &mut self.links[link];
            on.swap_remove(slot);
            if let Some(&moved) = on.get(slot) {
                let moved = &mut self.flows[moved as usize];
                let k = usize::from(moved.links[0] != link);
                moved.slots[k] = slot;
            }
        }
        self.change(f, t);
    }

    /// Flow `f`'s links changed at `t`.
    fn change(&mut self, f: u32, t: f64) {
        debug_assert!(self.changed.is_empty() || self.changed_at == t);
        self.changed_at = t;
        for link in self.flows[f as usize].links {
            if !std::mem::replace(&mut self.is_changed[link], true) {
                self.changed.push(link);
            }
        }
    }

    /// A connection from `src` to `dst`, with nothing on it yet.
    fn open(&mut self, src: usize, dst: usize) -> u32 {
        let host = |r| self.net.host(r);
        let (model, links) = if host(src) == host(dst) {
            let own = 2 * self.hosts;
            (self.net.within, [own + 2 * src, own + 2 * dst + 1])
        } else {
            (self.net.between, [2 * host(src), 2 * host(dst) + 1])
        };
        let flow = Flow {
            src: src as u32,
            dst: dst as u32,
            links,
            slots: [0; 2],
            model,
            queue: VecDeque::new(),
            delivered: 0,
            recvs: 0,
            phase: Phase::Idle,
            left: 0.0,
            stall: 0.0,
            rate: 0.0,
            since: 0.0,
            timer: 0,
        };
        let f = match self.idle.pop() {
            Some(f) => {
                self.flows[f as usize] = flow;
                f
            }
            None => {
                self.flows.push(flow);
                (self.flows.len() - 1) as u32
            }
        };
        self.by_pair.insert(pair(src, dst), f);
        f
    }

    /// The changed links' flows go on from `changed_at`, each whose share changed at its
    /// new one.
    fn reshare(&mut self) {
        let Fabric {
            links,
            flows,
            idle,
            timers,
            seq,
            changed,
            is_changed,
            changed_at,
            ..
        } = self;
        let t = *changed_at;
        for link in changed.drain(..) {
            is_changed[link] = false;
            for &f in &links[link] {
                let flow = &mut flows[f as usize];
                let busiest = links[flow.links[0]].len().max(links[flow.links[1]].len());
                let rate = 1.0 / busiest as f64;
                if rate == flow.rate {
                    continue;
                }
                flow.left -= (t - flow.since) * flow.rate;
                flow.since = t;
                flow.rate = rate;
                *seq += 1;
                arm(flow, *seq, timers, f);
            }
        }
        // Stale timers are dropped as they surface; drop them all when they dominate.
        if timers.len() > 4 * (flows.len() - idle.len()) + 1024 {
            timers.retain(|a| flows[a.what as usize].timer == a.seq);
        }
    }
}

/// Sets flow `f`'s timer (`seq`) for when its message, at its rate from `since`, has
/// crossed or reaches its stall.
fn arm(flow: &mut Flow, seq: u64, timers: &mut BinaryHeap<At<u32>>, f: u32) {
    flow.left = flow.left.max(flow.stall);
    flow.timer = seq;
    timers.push(At {
        t: flow.since + (flow.left - flow.stall) / flow.rate,
        seq,
        what: f,
    });
}
