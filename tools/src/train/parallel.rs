//! How a `train` run splits the work: `--dp` replicas of `--pp` pipeline stages
//! ([`Layout`]), each stage holding a contiguous run of layers, and the
//! gradients of each stage averaged over its replicas by DDP or ZeRO ([`Reducer`]).

use std::ops::Range;

use chorus::ddp::{Compression, Ddp, DdpOptions, ParamSpec};
use chorus::pipeline::{Grid, ScheduleKind};
use chorus::zero::{Memory, Zero, ZeroOptions, ZeroStage};
use chorus::Communicator;

use super::mlp::{Gradients, Sgd};
use super::{Args, Device};

/// The checked parallel layout of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    /// Replicas (data-parallel ranks per stage).
    pub dp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Micro-batches per step (`--micro-batches`, or `--accumulate` without a pipeline).
    pub micro_batches: usize,
    /// The pipeline schedule.
    pub schedule: ScheduleKind,
    /// ZeRO stage: 0 (DDP), 1 or 2.
    pub zero: u8,
    /// Each stage's layers, in order.
    pub stages: Vec<Range<usize>>,
}

impl Layout {
    /// The layout `args` ask for on a world of `world` ranks, for layers of
    /// `layer_params` parameters each.
    ///
    /// Fails naming the flags that do not fit together.
    pub fn new(args: &Args, world: usize, layer_params: &[usize]) -> Result<Layout, String> {
        let (pp, micro) = (args.pp, args.micro_batches);
        if pp == 0 || micro == 0 || args.dp == Some(0) {
            return Err("--pp, --dp and --micro-batches must be at least 1".into());
        }
        let layers = layer_params.len();
        if pp > layers {
            return Err(format!(
                "--pp {pp} asks for more stages than the network's {layers} layers \
                 (give --hidden more widths)"
            ));
        }
        let dp = match args.dp {
            Some(dp) if dp * pp != world => {
                return Err(format!(
                    "--dp {dp} x --pp {pp} is {} ranks, but the job has {world}",
                    dp * pp
                ))
            }
            Some(dp) => dp,
            None if world % pp != 0 => {
                return Err(format!("--pp {pp} does not divide the job's {world} ranks"))
            }
            None => world / pp,
        };
        if args.batch_size % micro != 0 {
            return Err(format!(
                "--micro-batches {micro} does not divide --batch-size {}",
                args.batch_size
            ));
        }
        if args.accumulate > 1 && (pp > 1 || micro > 1) {
            return Err(
                "--accumulate splits the batch as --micro-batches does: give only one".into(),
            );
        }
        if args.zero > 2 {
            return Err(format!("--zero {}: the stages are 0, 1 and 2", args.zero));
        }
        if args.zero > 0 && args.compression != Compression::None {
            return Err(format!(
                "--zero {} reduces gradients in f32: use --compression none",
                args.zero
            ));
        }
        let parallel = pp > 1 || micro > 1 || args.zero > 0;
        if parallel && args.device == Device::Cuda {
            return Err("--device cuda trains without --pp, --micro-batches or --zero".into());
        }
        if args.resume && (pp > 1 || args.zero > 0) {
            return Err("--resume continues runs of --pp 1 --zero 0 only".into());
        }
        Ok(Layout {
            dp,
            pp,
            micro_batches: micro.max(args.accumulate),
            schedule: args.schedule,
            zero: args.zero,
            stages: split_layers(layer_params, pp),
        })
    }
}

/// Splits layers of these sizes into `stages` contiguous runs of at least one
/// layer each, as equal in parameters as the boundaries allow.
pub fn split_layers(sizes: &[usize], stages: usize) -> Vec<Range<usize>> {
    let total: usize = sizes.iter().sum();
    let cumulative: Vec<usize> = sizes
        .iter()
        .scan(0, |sum, &n| {
            *sum += n;
            Some(*sum)
        })
        .collect();
    let mut ranges = Vec::with_capacity(stages);
    let mut start = 0;
    for s in 1..stages {
        let target = (total * s) as f64 / stages as f64;
        // The end of stage s-1: after layer `end - 1`, leaving a layer for each later stage.
        let end = (start + 1..=sizes.len() - (stages - s))
            .min_by(|&a, &b| {
                let far = |e: usize| (cumulative[e - 1] as f64 - target).abs();
                far(a).total_cmp(&far(b))
            })
            .unwrap_or(start + 1);
        ranges.push(start..end);
        start = end;
    }
    ranges.push(start..sizes.len());
    ranges
}

/// How a stage's gradients are averaged over its replicas and applied.
#[derive(Debug)]
pub enum Reducer<'c> {
    /// DDP buckets all-reduced, then SGD with momentum on every rank.
    Ddp(Ddp<'c>, Sgd),
    /// ZeRO stage 1 or 2: each rank updates its shard.
    Zero(Zero<'c>),
}

impl<'c> Reducer<'c> {
    /// The reducer `layout` asks for over the replicas' communicator `data`.
    ///
    /// Fails as [`Ddp::new`] or [`Zero::new`] do.
    pub fn new(
        data: &'c Communicator,
        args: &Args,
        zero: u8,
        specs: Vec<ParamSpec>,
        params: &[Vec<f32>],
    ) -> chorus::Result<Reducer<'c>> {
        let stage = match zero {
            0 => {
                let options = DdpOptions {
                    bucket_cap_mb: args.bucket_cap_mb,
                    first_bucket_cap_mb: args.first_bucket_cap_mb,
                    compression: args.compression,
                    ..DdpOptions::from_env()?
                };
                let sgd = Sgd::new(args.lr, args.momentum, params);
                return Ok(Reducer::Ddp(Ddp::new(data, specs, options)?, sgd));
            }
            1 => ZeroStage::One,
            _ => ZeroStage::Two,
        };
        let mut options = ZeroOptions::new(stage, args.lr, args.momentum);
        options.bucket_cap_mb = args.bucket_cap_mb;
        options.first_bucket_cap_mb = args.first_bucket_cap_mb;
        Ok(Reducer::Zero(Zero::new(data, specs, options)?))
    }

    /// Starts a step: gradients at zero.
    pub fn zero_grad(&mut self) -> chorus::Result<()> {
        match self {
            Reducer::Ddp(ddp, _) => ddp.zero_grad(),
            Reducer::Zero(_) => Ok(()), // ZeRO starts each step at zero itself.
        }
    }

    /// One micro-batch's backward `run`, accumulating; the `last` of the step
    /// also marks the gradients ready, so they are reduced as backward goes.
    ///
    /// Fails as `run` or the reduction does.
    pub fn backward(
        &mut self,
        last: bool,
        run: impl FnOnce(&mut dyn Gradients) -> chorus::Result<()>,
    ) -> chorus::Result<()> {
        match (self, last) {
            (Reducer::Ddp(ddp, _), true) => run(ddp).and_then(|()| ddp.finish()),
            (Reducer::Ddp(ddp, _), false) => ddp.no_sync(|ddp| {
                run(ddp)?;
                ddp.finish()
            }),
            (Reducer::Zero(zero), true) => run(zero),
            (Reducer::Zero(zero), false) => run(&mut Unmarked(zero)),
        }
    }

    /// Applies the averaged gradients to `params`, the same on every replica.
    ///
    /// Fails as the reduction or the all-gather does.
    pub fn step(&mut self, params: &mut [Vec<f32>]) -> chorus::Result<()> {
        match self {
            Reducer::Ddp(ddp, sgd) => sgd.step(params, ddp),
            Reducer::Zero(zero) => {
                let mut views: Vec<&mut [f32]> = params.iter_mut().map(|p| &mut p[..]).collect();
                zero.step(&mut views)
            }
        }
    }

    /// Bytes this rank holds for `params`, their gradients and the momentum.
    pub fn memory(&self, params: &[Vec<f32>]) -> Memory {
        match self {
            Reducer::Ddp(..) => {
                let bytes = params.iter().map(Vec::len).sum::<usize>() * size_of::<f32>();
                Memory {
                    params: bytes,
                    grads: bytes,
                    optimizer: bytes,
                }
            }
            Reducer::Zero(zero) => zero.memory(),
        }
    }

    /// The whole momentum of this stage's parameters (gathered from the replicas under ZeRO).
    ///
    /// A collective over the replicas; fails as the all-gather does.
    pub fn momentum(&self) -> chorus::Result<Vec<Vec<f32>>> {
        match self {
            Reducer::Ddp(_, sgd) => Ok(sgd.buffers.clone()),
            Reducer::Zero(zero) => zero.momentum(),
        }
    }
}

/// ZeRO's gradients for a micro-batch before the last: accumulated, not yet marked ready.
struct Unmarked<'a, 'c>(&'a mut Zero<'c>);

impl Gradients for Unmarked<'_, '_> {
    fn grad_mut(&mut self, param: usize) -> chorus::Result<&mut [f32]> {
        self.0.grad_mut(param)
    }
    fn mark_ready(&mut self, _param: usize) -> chorus::Result<()> {
        Ok(())
    }
}

/// One of a [`Grid`]'s two communicators.
#[derive(Debug, Clone, Copy)]
pub enum Group {
    /// This replica's stages.
    Pipeline,
    /// The replicas of this stage.
    Data,
}

/// `e`, from `grid`'s `group`, which names ranks within that group: with the job's ranks
/// they are, where the two differ.
pub fn in_group(grid: &Grid, group: Group, e: chorus::Error) -> String {
    let (what, ranks): (String, Vec<usize>) = match group {
        Group::Pipeline => (
            format!("replica {}'s pipeline", grid.replica),
            (0..grid.pp)
                .map(|s| grid.rank_of(grid.replica, s))
                .collect(),
        ),
        Group::Data => (
            format!("stage {}'s replicas", grid.stage),
            (0..grid.dp).map(|d| grid.rank_of(d, grid.stage)).collect(),
        ),
    };
    if ranks.iter().enumerate().all(|(i, &r)| i == r) {
        return e.to_string();
    }
    let list = |v: Vec<String>| v.join(", ");
    format!(
        "{e} (ranks {} of {what} are ranks {} of the job)",
        list((0..ranks.len()).map(|i| i.to_string()).collect()),
        list(ranks.iter().map(|r| r.to_string()).collect())
    )
}

/// `batch` split into `micro` contiguous parts whose lengths differ by at most one.
pub fn micro_batches(batch: &[usize], micro: usize) -> Vec<&[usize]> {
    let (base, extra) = (batch.len() / micro, batch.len() % micro);
    let mut rest = batch;
    (0..micro)
        .map(|m| {
            let (chunk, tail) = rest.split_at(base + usize::from(m < extra));
            rest = tail;
            chunk
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_split_contiguously_and_balanced_by_parameters() {
        // --hidden 1024,1024,1024,1024 on Fashion-MNIST.
        let sizes = [784 * 1024, 1024 * 1024, 1024 * 1024, 1024 * 1024, 10 * 1024];
        assert_eq!(split_layers(&sizes, 1), vec![0..5]);
        assert_eq!(split_layers(&sizes, 2), vec![0..2, 2..5]);
        assert_eq!(split_layers(&sizes, 5), vec![0..1, 1..2, 2..3, 3..4, 4..5]);
        // Every stage keeps a layer even where the parameters say otherwise.
        assert_eq!(split_layers(&[1, 1, 1000], 3), vec![0..1, 1..2, 2..3]);
        assert_eq!(split_layers(&[1000, 1, 1], 2), vec![0..1, 1..3]);
    }

    #[test]
    fn a_batch_splits_into_exactly_m_near_equal_micro_batches() {
        let batch: Vec<usize> = (0..10).collect();
        let lens = |m| -> Vec<usize> { micro_batches(&batch, m).iter().map(|c| c.len()).collect() };
        assert_eq!(lens(4), vec![3, 3, 2, 2]);
        assert_eq!(lens(1), vec![10]);
        // A short last batch leaves some micro-batches empty: every stage still runs M.
        assert_eq!(lens(12), [vec![1; 10], vec![0; 2]].concat());
        assert_eq!(micro_batches(&batch, 4).concat(), batch);
    }
}
