//! Runs a [`PipelineSchedule`] for all stages at once in memory and checks it.
//!
//! Transfers complete only as a rendezvous (a send waits for its receive to be
//! posted, and the other way round), the strictest semantics a transport can
//! have, so a schedule that passes here cannot deadlock over any transport.

use super::schedule::{PipelineSchedule, Step, Transfer};

/// Simulates `schedule` and returns, per stage, the most micro-batches it held
/// at once (forward done, backward not yet).
///
/// Fails, describing the first problem, if a stage computes a micro-batch twice,
/// out of order (backward before forward, forward before its input arrived,
/// backward before its gradient arrived), sends something not yet computed,
/// exchanges with a stage that does not exist, posts two transfers of one
/// direction in one exchange, deadlocks, or ends with a micro-batch not run
/// forward and backward exactly once.
pub fn verify(schedule: &PipelineSchedule) -> Result<Vec<usize>, String> {
    let (stages, micro) = (schedule.stages, schedule.micro_batches);
    if schedule.steps.len() != stages {
        return Err(format!(
            "{} step lists for {stages} stages",
            schedule.steps.len()
        ));
    }
    let mut sim = Sim {
        schedule,
        pc: vec![0; stages],
        done: vec![Vec::new(); stages],
        forward: vec![vec![false; micro]; stages],
        backward: vec![vec![false; micro]; stages],
        input: vec![vec![false; micro]; stages],
        grad: vec![vec![false; micro]; stages],
        live: vec![0; stages],
        peak: vec![0; stages],
    };
    for s in 0..stages {
        sim.check_exchanges(s)?;
    }
    loop {
        let mut progress = false;
        for s in 0..stages {
            progress |= sim.advance(s)?;
        }
        if (0..stages).all(|s| sim.pc[s] == schedule.steps[s].len()) {
            break;
        }
        if !progress {
            let waits: Vec<String> = (0..stages)
                .filter(|&s| sim.pc[s] < schedule.steps[s].len())
                .map(|s| format!("stage {s} at {:?}", schedule.steps[s][sim.pc[s]]))
                .collect();
            return Err(format!("deadlock: {}", waits.join(", ")));
        }
    }
    for s in 0..stages {
        for m in 0..micro {
            if !sim.forward[s][m] || !sim.backward[s][m] {
                return Err(format!("stage {s} never finished micro-batch {m}"));
            }
        }
    }
    Ok(sim.peak)
}

struct Sim<'a> {
    schedule: &'a PipelineSchedule,
    /// Each stage's current step.
    pc: Vec<usize>,
    /// Which transfers of each stage's current exchange have completed.
    done: Vec<Vec<bool>>,
    forward: Vec<Vec<bool>>,
    backward: Vec<Vec<bool>>,
    /// Input activation received, per stage and micro-batch.
    input: Vec<Vec<bool>>,
    /// Output gradient received, per stage and micro-batch.
    grad: Vec<Vec<bool>>,
    live: Vec<usize>,
    peak: Vec<usize>,
}

impl Sim<'_> {
    /// Checks every exchange of stage `s` on its own: peers exist, micro-batches
    /// are in range, and no direction appears twice.
    fn check_exchanges(&self, s: usize) -> Result<(), String> {
        let (stages, micro) = (self.schedule.stages, self.schedule.micro_batches);
        for step in &self.schedule.steps[s] {
            match step {
                Step::Forward(m) | Step::Backward(m) if *m >= micro => {
                    return Err(format!("stage {s}: {step:?} is past {micro} micro-batches"));
                }
                Step::Forward(_) | Step::Backward(_) => {}
                Step::Exchange(ts) => {
                    for (i, t) in ts.iter().enumerate() {
                        if t.peer(s, stages).is_none() || t.micro_batch() >= micro {
                            return Err(format!("stage {s}: {t:?} has no peer or micro-batch"));
                        }
                        let same =
                            |u: &Transfer| std::mem::discriminant(u) == std::mem::discriminant(t);
                        if ts[..i].iter().any(same) {
                            return Err(format!("stage {s}: two transfers like {t:?} in {ts:?}"));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Runs stage `s` as far as it can go; returns whether it moved.
    fn advance(&mut self, s: usize) -> Result<bool, String> {
        let stages = self.schedule.stages;
        let steps = &self.schedule.steps[s];
        let mut moved = false;
        while let Some(step) = steps.get(self.pc[s]) {
            match *step {
                Step::Forward(m) => {
                    if self.forward[s][m] {
                        return Err(format!("stage {s} runs forward {m} twice"));
                    }
                    if s > 0 && !self.input[s][m] {
                        return Err(format!(
                            "stage {s} runs forward {m} before its input arrived"
                        ));
                    }
                    self.forward[s][m] = true;
                    self.live[s] += 1;
                    self.peak[s] = self.peak[s].max(self.live[s]);
                }
                Step::Backward(m) => {
                    if !self.forward[s][m] || self.backward[s][m] {
                        return Err(format!(
                            "stage {s} runs backward {m} before forward, or twice"
                        ));
                    }
                    if s + 1 < stages && !self.grad[s][m] {
                        return Err(format!(
                            "stage {s} runs backward {m} before its gradient arrived"
                        ));
                    }
                    self.backward[s][m] = true;
                    self.live[s] -= 1;
                }
                Step::Exchange(ref ts) => {
                    if self.done[s].len() != ts.len() {
                        self.done[s] = vec![false; ts.len()];
                    }
                    for (i, &t) in ts.iter().enumerate() {
                        if !self.done[s][i] {
                            moved |= self.try_match(s, i, t)?;
                        }
                    }
                    if !self.done[s].iter().all(|&d| d) {
                        return Ok(moved);
                    }
                    self.done[s].clear();
                }
            }
            self.pc[s] += 1;
            moved = true;
        }
        Ok(moved)
    }

    /// Completes transfer `i` (`t`) of stage `s` if its peer has the dual posted now.
    fn try_match(&mut self, s: usize, i: usize, t: Transfer) -> Result<bool, String> {
        let peer = t.peer(s, self.schedule.stages).expect("checked peers");
        let Some(Step::Exchange(theirs)) = self.schedule.steps[peer].get(self.pc[peer]) else {
            return Ok(false);
        };
        let Some(j) = theirs.iter().position(|&u| u == t.dual()) else {
            return Ok(false);
        };
        if self.done[peer].len() != theirs.len() {
            self.done[peer] = vec![false; theirs.len()];
        }
        if self.done[peer][j] {
            return Ok(false);
        }
        let (sender, m) = if t.is_send() {
            (s, t.micro_batch())
        } else {
            (peer, t.micro_batch())
        };
        let computed = match t {
            Transfer::SendActivation(_) | Transfer::RecvActivation(_) => self.forward[sender][m],
            Transfer::SendGradient(_) | Transfer::RecvGradient(_) => self.backward[sender][m],
        };
        if !computed {
            return Err(format!(
                "stage {sender} sends micro-batch {m} before computing it"
            ));
        }
        let receiver = if t.is_send() { peer } else { s };
        match t {
            Transfer::SendActivation(_) | Transfer::RecvActivation(_) => {
                self.input[receiver][m] = true
            }
            Transfer::SendGradient(_) | Transfer::RecvGradient(_) => self.grad[receiver][m] = true,
        }
        self.done[s][i] = true;
        self.done[peer][j] = true;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::ScheduleKind;

    #[test]
    fn every_schedule_up_to_8_stages_and_32_micro_batches_is_correct_and_within_its_bound() {
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            for stages in 1..=8 {
                for micro in 1..=32 {
                    let schedule = PipelineSchedule::new(kind, stages, micro).unwrap();
                    let peak = verify(&schedule)
                        .unwrap_or_else(|e| panic!("{kind:?} P={stages} M={micro}: {e}"));
                    let bound = kind.activation_bound(stages, micro);
                    assert!(
                        peak.iter().all(|&p| p <= bound),
                        "{kind:?} P={stages} M={micro}: peaks {peak:?} over {bound}"
                    );
                    // The bound is reached: GPipe holds all M, 1F1B's first stage holds P.
                    assert_eq!(peak[0], bound, "{kind:?} P={stages} M={micro}");
                }
            }
        }
    }

    fn broken(edit: impl FnOnce(&mut Vec<Vec<Step>>)) -> String {
        let mut s = PipelineSchedule::new(ScheduleKind::OneFOneB, 3, 4).unwrap();
        edit(&mut s.steps);
        verify(&s).unwrap_err()
    }

    #[test]
    fn the_verifier_catches_deadlocks_repeats_and_missing_work() {
        use Transfer::*;
        // Blocking sends posted one by one deadlock 1F1B: both neighbours send first.
        let mut s = PipelineSchedule::new(ScheduleKind::OneFOneB, 2, 2).unwrap();
        for steps in &mut s.steps {
            *steps = steps
                .drain(..)
                .flat_map(|step| match step {
                    Step::Exchange(ts) => ts.into_iter().map(|t| Step::Exchange(vec![t])).collect(),
                    other => vec![other],
                })
                .collect();
        }
        assert!(verify(&s).unwrap_err().starts_with("deadlock"));
        let e = broken(|steps| steps[1].push(Step::Forward(0)));
        assert!(e.contains("twice"), "{e}");
        let e = broken(|steps| steps[0].retain(|s| *s != Step::Backward(3)));
        assert!(e.contains("stage 0 never finished micro-batch 3"), "{e}");
        let e = broken(|steps| steps[0].insert(0, Step::Exchange(vec![SendActivation(0)])));
        assert!(e.contains("before computing"), "{e}");
        let e = broken(|steps| steps[0].push(Step::Exchange(vec![RecvActivation(0)])));
        assert!(e.contains("no peer"), "{e}");
    }
}
