//! The test driver: every rank's machine of a schedule in one process, with
//! real bytes, messages matched FIFO per ordered pair of ranks, and a
//! deterministic scheduler that picks which rank moves and which message or
//! send completes next. A message's bytes are read from the sender's buffer
//! when it is delivered, not when it is posted, so a machine that let a step
//! overwrite a region still being sent would deliver wrong data.

use std::collections::VecDeque;

use chorus_kernels::{finish_avg, reduce, reduce_into, DType, ReduceOp};

use super::machine::{Action, Dest, Layout, Machine, Needs, Reduce, Region};
use super::Did;
use crate::schedule::{Buf, Schedule};
use crate::{Cause, Error, Fault};

/// Which enabled move the scheduler takes.
#[derive(Debug, Clone, Copy)]
pub(super) enum Order {
    /// The first in the list of moves (ranks in order, then deliveries, then sends).
    First,
    /// The last.
    Last,
    /// One drawn by a pseudo-random generator from this seed.
    Random(u64),
}

/// A call for every rank.
pub(super) struct Call {
    pub dtype: DType,
    pub op: ReduceOp,
    pub depth: usize,
    /// Whether the input is the output (in place).
    pub in_place: bool,
    /// Each rank's program.
    pub steps: Vec<Schedule>,
    /// Each rank's input (and, in place, initial output).
    pub inputs: Vec<Vec<u8>>,
    /// Bytes of each rank's output.
    pub output_len: usize,
}

/// What one run produced.
pub(super) struct Outcome {
    /// Each rank's output, or its error.
    pub results: Vec<Result<Vec<u8>, Error>>,
    /// Distinct staging slots each rank used, and how many staged receives it posted.
    pub slots: Vec<(usize, usize)>,
    /// Actions each rank took.
    pub actions: Vec<usize>,
    /// What each rank did (see [`Did`]).
    pub did: Vec<Vec<Did>>,
}

#[derive(Debug, PartialEq)]
enum State {
    Runnable,
    Blocked(u64),
    Done,
    Failed,
}

struct Rank {
    machine: Machine<u64>,
    in_place: bool,
    state: State,
    error: Option<Error>,
    input: Vec<u8>,
    output: Vec<u8>,
    scratch: Vec<u8>,
    slots: Vec<Vec<u8>>,
    /// Completed requests, by id.
    completed: Vec<bool>,
    slots_used: Vec<bool>,
    staged: usize,
    actions: usize,
    did: Vec<Did>,
}

/// A posted send or receive waiting on one ordered pair of ranks.
struct Posted {
    id: u64,
    region: Region,
    slot: Option<usize>,
}

struct World<'a> {
    call: &'a Call,
    ranks: Vec<Rank>,
    /// Per ordered pair `src * W + dst`: sends posted and not yet delivered.
    sends: Vec<VecDeque<Posted>>,
    /// Per ordered pair: receives posted and not yet matched.
    recvs: Vec<VecDeque<Posted>>,
    /// Sends delivered but not yet reported complete: (rank, id).
    delivered: Vec<(usize, u64)>,
    aborted: bool,
    /// The rank and action index at which a failure is injected.
    fail_at: Option<(usize, usize)>,
}

/// Moves the scheduler may take.
#[derive(Debug, Clone, Copy)]
enum Move {
    Step(usize),
    Deliver(usize),
    CompleteSend(usize),
}

/// Runs `call` on every rank under `order`, failing rank `fail_at.0` at its action
/// `fail_at.1`; gives up (panics) after `max_moves` moves or on a deadlock.
pub(super) fn run(
    call: &Call,
    order: Order,
    fail_at: Option<(usize, usize)>,
    max_moves: usize,
) -> Outcome {
    let w = call.steps.len();
    let mut world = World {
        call,
        ranks: (0..w).map(|r| World::rank(call, r)).collect(),
        sends: (0..w * w).map(|_| VecDeque::new()).collect(),
        recvs: (0..w * w).map(|_| VecDeque::new()).collect(),
        delivered: Vec::new(),
        aborted: false,
        fail_at,
    };
    let mut rng = match order {
        Order::Random(seed) => seed | 1,
        _ => 0,
    };
    let mut moves = Vec::new();
    for _ in 0..max_moves {
        world.moves(&mut moves);
        if moves.is_empty() {
            let stuck: Vec<usize> = (0..w)
                .filter(|&r| matches!(world.ranks[r].state, State::Runnable | State::Blocked(_)))
                .collect();
            assert!(stuck.is_empty(), "deadlock: ranks {stuck:?} cannot go on");
            return world.outcome();
        }
        let pick = match order {
            Order::First => 0,
            Order::Last => moves.len() - 1,
            Order::Random(_) => {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                (rng % moves.len() as u64) as usize
            }
        };
        world.take(moves[pick]);
    }
    panic!("no end after {max_moves} moves");
}

impl World<'_> {
    fn rank(call: &Call, r: usize) -> Rank {
        let mut machine = Machine::default();
        let input = call.inputs[r].clone();
        let elem = call.dtype.size();
        let needs = Needs::of(&call.steps[r], elem);
        machine.start(&Layout {
            elem,
            input_len: input.len(),
            input_at: call.in_place.then_some(0),
            output_len: call.output_len,
            depth: call.depth,
            scratch_len: needs.scratch_bytes,
            finish: call.op == ReduceOp::Avg && call.steps.len() > 1,
        });
        let output = if call.in_place {
            input.clone()
        } else {
            vec![0xAB; call.output_len]
        };
        Rank {
            machine,
            in_place: call.in_place,
            state: State::Runnable,
            error: None,
            input,
            output,
            scratch: vec![0xCD; needs.scratch_bytes],
            slots: vec![vec![0xEF; needs.slot_bytes]; call.depth.max(1)],
            completed: vec![false],
            slots_used: vec![false; call.depth.max(1)],
            staged: 0,
            actions: 0,
            did: Vec::new(),
        }
    }

    fn world_size(&self) -> usize {
        self.ranks.len()
    }

    fn moves(&self, moves: &mut Vec<Move>) {
        moves.clear();
        for (r, rank) in self.ranks.iter().enumerate() {
            let ready = match rank.state {
                State::Runnable => true,
                State::Blocked(id) => rank.completed[id as usize] || self.aborted,
                State::Done | State::Failed => false,
            };
            if ready {
                moves.push(Move::Step(r));
            }
        }
        if !self.aborted {
            for (pair, sends) in self.sends.iter().enumerate() {
                if !sends.is_empty() && !self.recvs[pair].is_empty() {
                    moves.push(Move::Deliver(pair));
                }
            }
            moves.extend((0..self.delivered.len()).map(Move::CompleteSend));
        }
    }

    fn take(&mut self, m: Move) {
        match m {
            Move::Step(r) => {
                if let Err(error) = self.step(r) {
                    let rank = &mut self.ranks[r];
                    rank.machine.reset();
                    rank.state = State::Failed;
                    rank.error = Some(error);
                    self.aborted = true;
                }
            }
            Move::Deliver(pair) => self.deliver(pair),
            Move::CompleteSend(i) => {
                let (r, id) = self.delivered.swap_remove(i);
                self.ranks[r].completed[id as usize] = true;
            }
        }
    }

    /// Moves a message of `pair` into its receive: the sender's bytes as they are now.
    fn deliver(&mut self, pair: usize) {
        let w = self.world_size();
        let (src, dst) = (pair / w, pair % w);
        let send = self.sends[pair].pop_front().expect("a send");
        let recv = self.recvs[pair].pop_front().expect("a receive");
        assert_eq!(
            send.region.len, recv.region.len,
            "rank {src} sent {} bytes to rank {dst}, which expects {}",
            send.region.len, recv.region.len
        );
        let data = self.ranks[src].bytes(send.region).to_vec();
        let rank = &mut self.ranks[dst];
        match recv.slot {
            Some(slot) => rank.slots[slot][..data.len()].copy_from_slice(&data),
            None => rank.bytes_mut(recv.region).copy_from_slice(&data),
        }
        rank.completed[recv.id as usize] = true;
        self.delivered.push((src, send.id));
    }

    /// What rank `r` reports when it finds that the rank that failed has gone.
    fn peer_failed(&self, r: usize) -> Error {
        let culprit = self.fail_at.map(|(failed, _)| failed);
        Fault::new(Cause::PeerClosed, culprit, r).into()
    }

    /// Rank `r`'s next action, or the end of its wait.
    fn step(&mut self, r: usize) -> Result<(), Error> {
        let call = self.call;
        if let State::Blocked(id) = self.ranks[r].state {
            if self.aborted {
                return Err(self.peer_failed(r));
            }
            let rank = &mut self.ranks[r];
            rank.state = State::Runnable;
            if let Some(reduction) = rank.machine.complete(id) {
                rank.did.push(Did::Reduced(reduction));
                rank.reduce(call, reduction)?;
            }
            return Ok(());
        }
        let w = self.world_size();
        let rank = &mut self.ranks[r];
        let completed = &rank.completed;
        let action = rank
            .machine
            .next(call.steps[r].as_slice(), |&id| completed[id as usize])?;
        rank.actions += 1;
        rank.did.extend(Did::act(action));
        if self.fail_at == Some((r, rank.actions - 1)) {
            return Err(Error::Internal(format!("failure injected into {action:?}")));
        }
        let needs_peers = matches!(action, Action::Send { .. } | Action::Recv { .. });
        if self.aborted && needs_peers {
            return Err(self.peer_failed(r));
        }
        match action {
            Action::Send { id, peer, from } => {
                rank.post(id);
                self.sends[r * w + peer].push_back(Posted {
                    id,
                    region: from,
                    slot: None,
                });
            }
            Action::Recv { id, peer, into } => {
                rank.post(id);
                let (region, slot) = match into {
                    Dest::Region(region) => (region, None),
                    Dest::Slot { slot, len } => {
                        rank.slots_used[slot] = true;
                        rank.staged += 1;
                        let region = Region {
                            buf: Buf::Scratch,
                            start: 0,
                            len,
                        };
                        (region, Some(slot))
                    }
                };
                self.recvs[peer * w + r].push_back(Posted { id, region, slot });
            }
            Action::Wait { id } => {
                assert_eq!(*rank.machine.waiting(), id, "the request waited for");
                rank.state = State::Blocked(id);
            }
            Action::Copy { from, into } => {
                let data = rank.bytes(from).to_vec();
                rank.bytes_mut(into).copy_from_slice(&data);
            }
            Action::Finish { at } => finish_avg(call.dtype, rank.bytes_mut(at), w)?,
            Action::Done => rank.state = State::Done,
        }
        Ok(())
    }

    fn outcome(self) -> Outcome {
        let mut outcome = Outcome {
            results: Vec::new(),
            slots: Vec::new(),
            actions: Vec::new(),
            did: Vec::new(),
        };
        for rank in self.ranks {
            let used = rank.slots_used.iter().filter(|&&u| u).count();
            outcome.slots.push((used, rank.staged));
            outcome.actions.push(rank.actions);
            outcome.did.push(rank.did);
            outcome.results.push(match rank.error {
                Some(error) => Err(error),
                None => Ok(rank.output),
            });
        }
        outcome
    }
}

impl Rank {
    fn post(&mut self, id: u64) {
        let id = id as usize;
        if self.completed.len() <= id {
            self.completed.resize(id + 1, false);
        }
        self.machine.posted(id as u64);
    }

    fn bytes(&self, region: Region) -> &[u8] {
        let buf = match region.buf {
            Buf::Input if self.in_place => &self.output,
            Buf::Input => &self.input,
            Buf::Output => &self.output,
            Buf::Scratch => &self.scratch,
        };
        &buf[region.start..region.start + region.len]
    }

    fn bytes_mut(&mut self, region: Region) -> &mut [u8] {
        let buf = match region.buf {
            Buf::Input => panic!("the machine let a step write the input"),
            Buf::Output => &mut self.output,
            Buf::Scratch => &mut self.scratch,
        };
        &mut buf[region.start..region.start + region.len]
    }

    fn reduce(&mut self, call: &Call, Reduce { into, with, slot }: Reduce) -> Result<(), Error> {
        let incoming = self.slots[slot][..into.len].to_vec();
        match with {
            None => reduce(call.op, call.dtype, self.bytes_mut(into), &incoming)?,
            Some(with) => {
                let operand = self.bytes(with).to_vec();
                reduce_into(
                    call.op,
                    call.dtype,
                    self.bytes_mut(into),
                    &operand,
                    &incoming,
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Algorithm, Collective};
    use crate::cost::simulate;
    use crate::cost::{EvalConfig, LinkModel, Network};
    use crate::executor::PIPELINE_DEPTH;
    use crate::schedule::plan::{self, Drive, Messages, Placement, Shape};
    use crate::schedule::{extent, recursive, ring, tree, Loc, Step};
    use crate::tuner::Tuner;

    type Generator = fn(usize, usize, usize, usize) -> Schedule;

    const ALL_REDUCE: [(&str, Generator); 6] = [
        ("ring", ring::all_reduce),
        ("tree", tree::all_reduce),
        ("doubling", |r, w, c, k| {
            recursive::doubling(r, w, c, k, usize::MAX)
        }),
        ("halving_doubling", |r, w, c, k| {
            recursive::halving_doubling(r, w, c, k, usize::MAX)
        }),
        // Handshakes before the rounds that send more than 2 elements.
        ("doubling, shaking hands", |r, w, c, k| {
            recursive::doubling(r, w, c, k, 2)
        }),
        ("halving_doubling, shaking hands", |r, w, c, k| {
            recursive::halving_doubling(r, w, c, k, 2)
        }),
    ];

    const ORDERS: [Order; 4] = [
        Order::First,
        Order::Last,
        Order::Random(1),
        Order::Random(0x9e37_79b9),
    ];

    const UNCHUNKED: usize = 1 << 40;

    fn value(rank: usize, i: usize) -> i32 {
        (rank * 131 + i * 7) as i32 - 50
    }

    /// A sum all-reduce of `count` i32 on `w` ranks by `generate`.
    fn all_reduce(
        generate: Generator,
        w: usize,
        count: usize,
        chunk: usize,
        depth: usize,
        in_place: bool,
    ) -> Call {
        Call {
            dtype: DType::I32,
            op: ReduceOp::Sum,
            depth,
            in_place,
            steps: (0..w).map(|r| generate(r, w, count, chunk)).collect(),
            inputs: (0..w)
                .map(|r| (0..count).flat_map(|i| value(r, i).to_ne_bytes()).collect())
                .collect(),
            output_len: 4 * count,
        }
    }

    fn sum(w: usize, count: usize) -> Vec<u8> {
        (0..count)
            .flat_map(|i| (0..w).map(|r| value(r, i)).sum::<i32>().to_ne_bytes())
            .collect()
    }

    #[test]
    fn all_reduce_schedules_sum_under_every_order() {
        for (name, generate) in ALL_REDUCE {
            for w in 1..=8 {
                for count in [1, 13, 67] {
                    for chunk in [3, UNCHUNKED] {
                        for in_place in [false, true] {
                            let call = all_reduce(generate, w, count, chunk, 2, in_place);
                            for order in ORDERS {
                                let outcome = run(&call, order, None, 1 << 20);
                                for (r, result) in outcome.results.into_iter().enumerate() {
                                    let what = format!(
                                        "{name} W={w} count={count} chunk={chunk} \
                                         in_place={in_place} {order:?} rank {r}"
                                    );
                                    let out = result.unwrap_or_else(|e| panic!("{what}: {e}"));
                                    assert!(out == sum(w, count), "{what}: wrong result");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn avg_is_finished_once() {
        for w in [2, 3, 5] {
            let count = 10;
            let input = |r: usize| -> Vec<u8> {
                (0..count)
                    .flat_map(|i| ((r + i) as f32).to_ne_bytes())
                    .collect()
            };
            let call = Call {
                dtype: DType::F32,
                op: ReduceOp::Avg,
                depth: 2,
                in_place: false,
                steps: (0..w).map(|r| ring::all_reduce(r, w, count, 3)).collect(),
                inputs: (0..w).map(input).collect(),
                output_len: 4 * count,
            };
            let mut want: Vec<u8> = (0..count)
                .flat_map(|i| (0..w).map(|r| (r + i) as f32).sum::<f32>().to_ne_bytes())
                .collect();
            finish_avg(DType::F32, &mut want, w).unwrap();
            for order in ORDERS {
                for result in run(&call, order, None, 1 << 20).results {
                    assert!(result.unwrap() == want, "W={w} {order:?}");
                }
            }
        }
    }

    #[test]
    fn a_failure_at_any_action_ends_every_rank() {
        for (name, generate) in [ALL_REDUCE[0], ALL_REDUCE[1]] {
            for w in [2, 3, 4] {
                let call = all_reduce(generate, w, 13, 3, 1, false);
                // Up to the failure, a run takes the moves of the clean run in the same order.
                for order in ORDERS {
                    let clean = run(&call, order, None, 1 << 20);
                    for (r, k) in (0..w).flat_map(|r| (0..clean.actions[r]).map(move |k| (r, k))) {
                        let outcome = run(&call, order, Some((r, k)), 1 << 20);
                        let what = format!("{name} W={w} {order:?} rank {r} failing at action {k}");
                        assert!(outcome.results[r].is_err(), "{what}: no error");
                        // Every other rank has ended (the run returned), and no rank that
                        // still needed the failed one claims success with wrong data.
                        // Those that failed name the failed rank.
                        for (q, result) in outcome.results.iter().enumerate() {
                            match result {
                                Ok(out) => assert!(*out == sum(w, 13), "{what}: rank {q} wrong"),
                                Err(Error::Aborted(fault)) => assert_eq!(
                                    (fault.cause, fault.culprit, fault.found_by),
                                    (Cause::PeerClosed, Some(r), q),
                                    "{what}"
                                ),
                                Err(e) => assert!(q == r, "{what}: rank {q} failed with {e}"),
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn staging_slots_are_reused() {
        for depth in [1, 2] {
            let (w, count) = (4, 4 * 64);
            let call = all_reduce(ring::all_reduce, w, count, 4, depth, false);
            for order in ORDERS {
                let outcome = run(&call, order, None, 1 << 20);
                for (r, result) in outcome.results.into_iter().enumerate() {
                    assert!(result.unwrap() == sum(w, count), "depth {depth} rank {r}");
                    let (used, staged) = outcome.slots[r];
                    assert_eq!(used, depth, "rank {r} used {used} of {depth} slots");
                    assert!(staged >= 10 * depth, "only {staged} staged receives");
                }
            }
        }
    }

    fn layout(depth: usize) -> Layout {
        Layout {
            elem: 1,
            input_len: 16,
            input_at: None,
            output_len: 16,
            depth,
            scratch_len: 0,
            finish: false,
        }
    }

    /// The machine's actions for `steps`, waits completing at once.
    fn trace(steps: &[Step], depth: usize) -> Vec<Action> {
        let mut m = Machine::default();
        m.start(&layout(depth));
        let mut trace = Vec::new();
        loop {
            let action = m.next(steps, |_| false).unwrap();
            trace.push(action);
            match action {
                Action::Send { id, .. } | Action::Recv { id, .. } => m.posted(id),
                Action::Wait { id } => {
                    m.complete(id);
                }
                Action::Done => return trace,
                _ => {}
            }
        }
    }

    fn region(buf: Buf, start: usize, len: usize) -> Region {
        Region { buf, start, len }
    }

    #[test]
    fn only_a_dependency_makes_the_machine_wait() {
        let out = |r: std::ops::Range<usize>| Loc::output(r);
        let steps = [
            Step::Send {
                peer: 1,
                from: out(0..4),
            },
            Step::Send {
                peer: 1,
                from: out(0..4),
            },
            Step::Recv {
                peer: 1,
                into: out(4..8),
            },
            Step::Recv {
                peer: 1,
                into: out(2..6),
            },
        ];
        let r = |s, l| region(Buf::Output, s, l);
        assert_eq!(
            trace(&steps, 1),
            vec![
                Action::Send {
                    id: 1,
                    peer: 1,
                    from: r(0, 4)
                },
                Action::Send {
                    id: 2,
                    peer: 1,
                    from: r(0, 4)
                },
                Action::Recv {
                    id: 3,
                    peer: 1,
                    into: Dest::Region(r(4, 4))
                },
                // 2..6 overlaps what both sends read and what the receive writes.
                Action::Wait { id: 1 },
                Action::Wait { id: 2 },
                Action::Wait { id: 3 },
                Action::Recv {
                    id: 4,
                    peer: 1,
                    into: Dest::Region(r(2, 4))
                },
                Action::Wait { id: 4 },
                Action::Done,
            ]
        );
    }

    #[test]
    fn a_full_staging_area_settles_the_oldest_reduction() {
        let steps: Vec<Step> = (0..3)
            .map(|i| Step::RecvReduce {
                peer: 1,
                with: Loc::input(4 * i..4 * i + 4),
                into: Loc::output(4 * i..4 * i + 4),
            })
            .collect();
        let mut m = Machine::default();
        m.start(&layout(2));
        let mut slots = Vec::new();
        let mut reduced = Vec::new();
        loop {
            match m.next(&steps[..], |_| false).unwrap() {
                Action::Recv {
                    id,
                    into: Dest::Slot { slot, len: 4 },
                    ..
                } => {
                    slots.push(slot);
                    m.posted(id);
                }
                Action::Wait { id } => {
                    let r = m.complete(id).expect("a reduction");
                    assert_eq!(r.with, Some(region(Buf::Input, r.into.start, 4)));
                    reduced.push((id, r.slot));
                }
                Action::Done => break,
                other => panic!("{other:?}"),
            }
        }
        // The third receive reuses the slot the first one's reduction freed.
        assert_eq!(slots, vec![1, 0, 1]);
        assert_eq!(reduced, vec![(1, 1), (2, 0), (3, 1)]);
    }

    #[test]
    fn finished_requests_leave_the_queue_early() {
        let steps = [
            Step::Send {
                peer: 1,
                from: Loc::output(0..4),
            },
            Step::Fence,
        ];
        let mut m = Machine::default();
        m.start(&layout(1));
        let Action::Send { id, .. } = m.next(&steps[..], |_| true).unwrap() else {
            panic!("a send first");
        };
        m.posted(id);
        // Looking at the fence, the machine learns the send is done: nothing to wait for.
        assert_eq!(m.next(&steps[..], |_| true).unwrap(), Action::Done);
    }

    #[test]
    fn malformed_steps_are_refused() {
        let bad = [
            Step::Send {
                peer: 1,
                from: Loc::output(8..17),
            },
            Step::Recv {
                peer: 1,
                into: Loc::input(0..4),
            },
            Step::RecvReduce {
                peer: 1,
                with: Loc::input(0..4),
                into: Loc::output(0..5),
            },
            Step::RecvReduce {
                peer: 1,
                with: Loc::output(0..4),
                into: Loc::output(2..6),
            },
            Step::Copy {
                from: Loc::output(0..4),
                into: Loc::input(0..4),
            },
            Step::Copy {
                from: Loc::input(0..4),
                into: Loc::output(0..3),
            },
        ];
        for step in bad {
            let steps = [step];
            let mut m: Machine<u64> = Machine::default();
            m.start(&layout(1));
            let got = m.next(&steps[..], |_| false);
            assert!(matches!(got, Err(Error::Internal(_))), "{steps:?}: {got:?}");
        }
    }

    /// Every plan's messages, as the communicator makes them on `w` ranks (hosts of two
    /// ranks, for the hierarchical all-reduce): a barrier, and each collective by each of
    /// its algorithms on a small size (exchanges, where the algorithm is made of them) and a
    /// chunked one.
    fn plans(w: usize) -> Vec<(String, Vec<Messages>)> {
        let hosts: Vec<Vec<usize>> = (0..w)
            .collect::<Vec<_>>()
            .chunks(2)
            .map(<[usize]>::to_vec)
            .collect();
        let mut routes: Vec<(Option<Collective>, Algorithm)> = vec![(None, Algorithm::Direct)];
        for c in Collective::ALL {
            routes.extend(Tuner::candidates(c).iter().map(|&a| (Some(c), a)));
        }
        routes.push((Some(Collective::AllReduce), Algorithm::Hierarchical));
        let mut plans = Vec::new();
        for (collective, a) in routes {
            for (count, chunk) in [(2 * w, 1 << 20), (24 * w, 8)] {
                let shape = Shape {
                    collective,
                    count,
                    elem: 4,
                    root: w / 2,
                    chunk,
                    counts: None,
                    on_windows: false,
                };
                let messages = (0..w)
                    .map(|rank| {
                        let at = Placement {
                            rank,
                            world: w,
                            hosts: &hosts,
                            machines: hosts.len(),
                            shared_memory: false,
                        };
                        plan::messages(&shape, a, &at)
                            .expect("a candidate implements its collective")
                    })
                    .collect();
                plans.push((
                    format!("{collective:?} by {a:?}, {count} elements in chunks of {chunk}"),
                    messages,
                ));
            }
        }
        plans
    }

    #[test]
    fn the_simulator_does_what_this_driver_does_for_every_plan() {
        let config = EvalConfig {
            elem_bytes: 4,
            depth: PIPELINE_DEPTH,
            ..EvalConfig::default()
        };
        let net = Network::flat(LinkModel::shared_memory());
        let mut drives = (0, 0);
        for w in [2, 3, 4, 5, 8] {
            for (what, messages) in plans(w) {
                let steps: Vec<Schedule> = messages.iter().map(|m| m.steps.clone()).collect();
                let len = |buf| steps.iter().map(|s| extent(s, buf) * 4).max().unwrap_or(0);
                let call = Call {
                    dtype: DType::F32,
                    op: ReduceOp::Sum,
                    depth: PIPELINE_DEPTH,
                    in_place: false,
                    inputs: vec![vec![0; len(Buf::Input)]; w],
                    output_len: len(Buf::Output),
                    steps: steps.clone(),
                };
                let simulated = simulate::trace(w, &net, &config, |r| steps[r].clone())
                    .unwrap_or_else(|e| panic!("{what} W={w}: {e}"));
                for order in ORDERS {
                    let driven = run(&call, order, None, 1 << 20);
                    for (r, result) in driven.results.iter().enumerate() {
                        assert!(result.is_ok(), "{what} W={w} rank {r}: {result:?}");
                        assert_eq!(
                            simulated[r], driven.did[r],
                            "{what} W={w} {order:?} rank {r}"
                        );
                    }
                }
                // The executor runs a program planned as exchanges pair by pair: a pair's
                // send is posted after the pair before has ended (reduced, if staged), as
                // the machine too runs it.
                for (r, m) in messages.iter().enumerate() {
                    match m.drive {
                        Drive::Machine => drives.0 += 1,
                        Drive::Exchanges => {
                            drives.1 += 1;
                            let mut open = false;
                            for did in &simulated[r] {
                                match did {
                                    Did::Act(Action::Send { .. }) => {
                                        assert!(
                                            !open,
                                            "{what} W={w} rank {r}: a send within a pair"
                                        );
                                        open = true;
                                    }
                                    Did::Act(Action::Recv {
                                        into: Dest::Region(_),
                                        ..
                                    })
                                    | Did::Reduced(_) => open = false,
                                    _ => {}
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(drives.0 > 0 && drives.1 > 0, "both drives: {drives:?}");
    }
}
