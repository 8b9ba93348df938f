//! Pipeline schedules as pure data: for each stage, the computations and the
//! exchanges with its neighbours, in order.
//!
//! Stage `s` receives activations from `s - 1` and sends its own to `s + 1`;
//! gradients of activations travel the other way. The transfers between two
//! computations are posted together as one exchange (like torch's
//! `batch_isend_irecv`), so a stage that sends an activation while waiting for
//! a gradient cannot deadlock against a neighbour doing the opposite.

/// Which schedule a pipeline runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    /// All forwards, then all backwards: holds up to `M` micro-batches' activations.
    GPipe,
    /// Warm-up forwards, then one forward and one backward at a time: holds at most `P`.
    OneFOneB,
}

impl ScheduleKind {
    /// Most micro-batches whose forward is done but backward is not, on any stage.
    pub fn activation_bound(self, stages: usize, micro_batches: usize) -> usize {
        match self {
            ScheduleKind::GPipe => micro_batches,
            ScheduleKind::OneFOneB => stages.min(micro_batches),
        }
    }
}

impl std::fmt::Display for ScheduleKind {
    /// The name [`FromStr`](std::str::FromStr) parses: `gpipe` or `1f1b`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
        })
    }
}

impl std::str::FromStr for ScheduleKind {
    type Err = crate::Error;

    /// Parses `gpipe` or `1f1b`; fails on anything else.
    fn from_str(s: &str) -> crate::Result<ScheduleKind> {
        match s {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            other => Err(crate::Error::InvalidArgument(format!(
                "unknown pipeline schedule '{other}' (expected gpipe or 1f1b)"
            ))),
        }
    }
}

/// One transfer between neighbouring stages, for micro-batch `.0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transfer {
    /// Send this stage's output activation to the next stage.
    SendActivation(usize),
    /// Receive this stage's input activation from the previous stage.
    RecvActivation(usize),
    /// Send the gradient of this stage's input to the previous stage.
    SendGradient(usize),
    /// Receive the gradient of this stage's output from the next stage.
    RecvGradient(usize),
}

impl Transfer {
    /// The micro-batch it carries.
    pub fn micro_batch(self) -> usize {
        match self {
            Transfer::SendActivation(m)
            | Transfer::RecvActivation(m)
            | Transfer::SendGradient(m)
            | Transfer::RecvGradient(m) => m,
        }
    }

    /// The stage at the other end, seen from `stage` (`None` past either end).
    pub fn peer(self, stage: usize, stages: usize) -> Option<usize> {
        match self {
            Transfer::SendActivation(_) | Transfer::RecvGradient(_) => {
                Some(stage + 1).filter(|&p| p < stages)
            }
            Transfer::RecvActivation(_) | Transfer::SendGradient(_) => stage.checked_sub(1),
        }
    }

    /// The transfer the peer must post to match this one.
    pub fn dual(self) -> Transfer {
        match self {
            Transfer::SendActivation(m) => Transfer::RecvActivation(m),
            Transfer::RecvActivation(m) => Transfer::SendActivation(m),
            Transfer::SendGradient(m) => Transfer::RecvGradient(m),
            Transfer::RecvGradient(m) => Transfer::SendGradient(m),
        }
    }

    /// Whether this stage sends (rather than receives).
    pub fn is_send(self) -> bool {
        matches!(
            self,
            Transfer::SendActivation(_) | Transfer::SendGradient(_)
        )
    }

    /// The point-to-point tag both ends use: activations even, gradients odd.
    pub fn tag(self) -> u32 {
        let gradient = matches!(self, Transfer::SendGradient(_) | Transfer::RecvGradient(_));
        (self.micro_batch() as u32) << 1 | gradient as u32
    }
}

/// One step of a stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Run the stage's forward on micro-batch `.0`.
    Forward(usize),
    /// Run the stage's backward on micro-batch `.0`.
    Backward(usize),
    /// Post these transfers together and wait for all of them.
    Exchange(Vec<Transfer>),
}

/// A whole pipeline's schedule: every stage's steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineSchedule {
    /// The schedule it was built as.
    pub kind: ScheduleKind,
    /// Number of stages `P`.
    pub stages: usize,
    /// Number of micro-batches `M` per step.
    pub micro_batches: usize,
    /// `steps[s]`: stage `s`'s steps in order.
    pub steps: Vec<Vec<Step>>,
}

impl PipelineSchedule {
    /// The `kind` schedule for `stages` stages and `micro_batches` micro-batches.
    ///
    /// Fails if either is zero.
    pub fn new(
        kind: ScheduleKind,
        stages: usize,
        micro_batches: usize,
    ) -> crate::Result<PipelineSchedule> {
        if stages == 0 || micro_batches == 0 {
            return Err(crate::Error::InvalidArgument(format!(
                "a pipeline needs at least one stage and one micro-batch, not {stages} and {micro_batches}"
            )));
        }
        let steps = (0..stages)
            .map(|s| stage_steps(&order(kind, s, stages, micro_batches), s, stages))
            .collect();
        Ok(PipelineSchedule {
            kind,
            stages,
            micro_batches,
            steps,
        })
    }

    /// The theoretical bubble of this schedule: see [`bubble`].
    pub fn bubble(&self) -> f64 {
        bubble(self.stages, self.micro_batches)
    }
}

/// The idle fraction of a pipeline of `stages` equal stages over `micro_batches`:
/// `(P - 1) / (M + P - 1)`, the same for GPipe and 1F1B.
pub fn bubble(stages: usize, micro_batches: usize) -> f64 {
    let idle = stages.saturating_sub(1) as f64;
    idle / (micro_batches as f64 + idle)
}

/// Stage `s`'s computations in order: `(forward?, micro-batch)`.
fn order(kind: ScheduleKind, s: usize, stages: usize, micro: usize) -> Vec<(bool, usize)> {
    match kind {
        ScheduleKind::GPipe => (0..micro)
            .map(|m| (true, m))
            .chain((0..micro).map(|m| (false, m)))
            .collect(),
        ScheduleKind::OneFOneB => {
            let warm = (stages - 1 - s).min(micro);
            let mut out: Vec<(bool, usize)> = (0..warm).map(|m| (true, m)).collect();
            for m in warm..micro {
                out.push((true, m));
                out.push((false, m - warm));
            }
            out.extend((micro - warm..micro).map(|m| (false, m)));
            out
        }
    }
}

/// Wraps each computation in its transfers and merges the transfers between two
/// computations into one exchange.
fn stage_steps(order: &[(bool, usize)], s: usize, stages: usize) -> Vec<Step> {
    let (first, last) = (s == 0, s + 1 == stages);
    let mut steps = Vec::new();
    let mut pending: Vec<Transfer> = Vec::new();
    for &(forward, m) in order {
        let (before, step, after) = if forward {
            let recv = (!first).then_some(Transfer::RecvActivation(m));
            let send = (!last).then_some(Transfer::SendActivation(m));
            (recv, Step::Forward(m), send)
        } else {
            let recv = (!last).then_some(Transfer::RecvGradient(m));
            let send = (!first).then_some(Transfer::SendGradient(m));
            (recv, Step::Backward(m), send)
        };
        pending.extend(before);
        if !pending.is_empty() {
            steps.push(Step::Exchange(std::mem::take(&mut pending)));
        }
        steps.push(step);
        pending.extend(after);
    }
    if !pending.is_empty() {
        steps.push(Step::Exchange(pending));
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_f_one_b_alternates_after_its_warm_up() {
        let s = PipelineSchedule::new(ScheduleKind::OneFOneB, 2, 2).unwrap();
        use Step::*;
        use Transfer::*;
        assert_eq!(
            s.steps[0],
            vec![
                Forward(0),
                Exchange(vec![SendActivation(0)]),
                Forward(1),
                Exchange(vec![SendActivation(1), RecvGradient(0)]),
                Backward(0),
                Exchange(vec![RecvGradient(1)]),
                Backward(1),
            ]
        );
        assert_eq!(
            s.steps[1],
            vec![
                Exchange(vec![RecvActivation(0)]),
                Forward(0),
                Backward(0),
                Exchange(vec![SendGradient(0), RecvActivation(1)]),
                Forward(1),
                Backward(1),
                Exchange(vec![SendGradient(1)]),
            ]
        );
    }

    #[test]
    fn the_bubble_is_p_minus_one_over_m_plus_p_minus_one() {
        assert_eq!(bubble(1, 8), 0.0);
        assert_eq!(bubble(4, 8), 3.0 / 11.0);
        assert_eq!(bubble(2, 1), 0.5);
    }

    #[test]
    fn names_parse_and_empty_pipelines_are_refused() {
        assert_eq!(
            "1f1b".parse::<ScheduleKind>().unwrap(),
            ScheduleKind::OneFOneB
        );
        assert_eq!(
            "gpipe".parse::<ScheduleKind>().unwrap(),
            ScheduleKind::GPipe
        );
        assert!("zb".parse::<ScheduleKind>().is_err());
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            assert_eq!(kind.to_string().parse::<ScheduleKind>().unwrap(), kind);
        }
        assert!(PipelineSchedule::new(ScheduleKind::GPipe, 0, 4).is_err());
        assert!(PipelineSchedule::new(ScheduleKind::GPipe, 4, 0).is_err());
    }
}
