//! Sharded data parallelism (ZeRO stages 1 and 2) for SGD with momentum.
//!
//! Gradients are grouped into the same buckets as [`Ddp`](crate::ddp::Ddp)'s
//! (same caps, same ready order). Each bucket is split into `W` equal shards
//! (the last padded); rank `r` owns shard `r` of every bucket: it keeps the
//! momentum for it alone, updates those parameters, and an all-gather gives
//! every rank the whole updated bucket. Each gradient bucket's reduction
//! starts asynchronously as soon as the bucket is ready, overlapping the rest
//! of backward as DDP's does: stage 1 all-reduces it; stage 2 reduce-scatters
//! it, so a rank keeps only its shard of the averaged gradients and frees the
//! bucket once it is reduced. The update is
//! element for element the one [`Ddp`](crate::ddp::Ddp) plus SGD makes:
//! `v = momentum * v + g; p -= lr * v`.
//!
//! ```no_run
//! use chorus::ddp::ParamSpec;
//! use chorus::zero::{Zero, ZeroOptions, ZeroStage};
//! use chorus::{Communicator, DType};
//!
//! let comm = Communicator::from_env()?;
//! let specs = vec![ParamSpec::new("w", 1000, DType::F32), ParamSpec::new("b", 10, DType::F32)];
//! let mut zero = Zero::new(&comm, specs, ZeroOptions::new(ZeroStage::Two, 0.1, 0.9))?;
//! let (mut w, mut b) = (vec![0.5f32; 1000], vec![0.0f32; 10]);
//! zero.grad_mut(1)?.fill(0.1); // backward: the last parameter's gradient first
//! zero.mark_ready(1)?;
//! zero.grad_mut(0)?.fill(0.2);
//! zero.mark_ready(0)?;
//! zero.step(&mut [&mut w[..], &mut b[..]])?; // every rank now holds the updated parameters
//! println!("{:?}", zero.memory());
//! # Ok::<(), chorus::Error>(())
//! ```

use std::ops::Range;

use crate::ddp::{DdpOptions, ParamSpec};
use crate::{Communicator, DType, Error, ReduceOp, Result, Work};

/// Which ZeRO stage: what is sharded across the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroStage {
    /// Optimizer state (momentum) sharded; gradients all-reduced whole.
    One,
    /// Optimizer state and gradients sharded: gradients reduce-scattered.
    Two,
}

/// How [`Zero`] buckets gradients and updates parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct ZeroOptions {
    /// What is sharded.
    pub stage: ZeroStage,
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor.
    pub momentum: f32,
    /// Bucket size in MiB, as [`DdpOptions::bucket_cap_mb`].
    pub bucket_cap_mb: f64,
    /// Size of the first bucket in MiB, as [`DdpOptions::first_bucket_cap_mb`].
    pub first_bucket_cap_mb: f64,
}

impl ZeroOptions {
    /// `stage` with SGD's `lr` and `momentum`, and DDP's default bucket caps.
    pub fn new(stage: ZeroStage, lr: f32, momentum: f32) -> ZeroOptions {
        let ddp = DdpOptions::default();
        ZeroOptions {
            stage,
            lr,
            momentum,
            bucket_cap_mb: ddp.bucket_cap_mb,
            first_bucket_cap_mb: ddp.first_bucket_cap_mb,
        }
    }
}

/// Bytes one rank holds for training state, between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Memory {
    /// The parameters (held whole by every rank in stages 1 and 2).
    pub params: usize,
    /// The gradients: every bucket in stage 1, this rank's shards in stage 2.
    pub grads: usize,
    /// The optimizer state: this rank's shards of the momentum.
    pub optimizer: usize,
}

/// One bucket and this rank's shard of it.
#[derive(Debug)]
struct Bucket {
    members: Vec<usize>,
    /// Elements in each rank's shard: the bucket's length over the world size, rounded up.
    shard: usize,
    /// The whole gradient bucket, padded to `shard * world`: kept in stage 1
    /// (away during its all-reduce), held in stage 2 only from the first
    /// `grad_mut` until its reduce-scatter completes.
    grads: Vec<f32>,
    /// The bucket's reduction, in flight until [`Zero::step`].
    away: Option<Away>,
    /// Stage 2: this rank's shard of the averaged gradient, once reduced.
    reduced: Vec<f32>,
    /// This rank's shard of the momentum.
    momentum: Vec<f32>,
    /// Members not yet marked ready in this step.
    waiting: usize,
}

/// A bucket's reduction in flight.
#[derive(Debug)]
enum Away {
    /// Stage 1: the whole bucket's all-reduce.
    Whole(Work<Vec<f32>>),
    /// Stage 2: the bucket's reduce-scatter into this rank's shard (bucket, shard).
    Shard(Work<(Vec<f32>, Vec<f32>)>),
}

/// ZeRO stage 1 or 2 data parallelism with SGD and momentum over `f32` parameters.
#[derive(Debug)]
pub struct Zero<'c> {
    comm: &'c Communicator,
    options: ZeroOptions,
    specs: Vec<ParamSpec>,
    /// Per parameter: its bucket and its range in the bucket.
    slots: Vec<(usize, Range<usize>)>,
    ready: Vec<bool>,
    buckets: Vec<Bucket>,
    /// The next bucket to reduce: buckets are reduced in index order only.
    next: usize,
}

impl<'c> Zero<'c> {
    /// Registers `params` (in the order the model uses them) and builds the buckets and shards.
    ///
    /// A collective: every rank calls it with the same list, which is checked.
    /// Fails naming a parameter that is not `f32` or differs between ranks,
    /// or on bad bucket caps.
    pub fn new(
        comm: &'c Communicator,
        params: Vec<ParamSpec>,
        options: ZeroOptions,
    ) -> Result<Zero<'c>> {
        if let Some(p) = params.iter().find(|p| p.dtype != DType::F32) {
            return Err(Error::InvalidArgument(format!(
                "parameter {p}: ZeRO updates f32 parameters only"
            )));
        }
        let (first_cap, cap) =
            crate::ddp::caps_in_bytes(options.first_bucket_cap_mb, options.bucket_cap_mb)?;
        crate::ddp::check_same_params(comm, &params)?;
        let groups = crate::ddp::assign_buckets(&params, first_cap, cap);
        let world = comm.world_size();
        let mut slots = vec![(0, 0..0); params.len()];
        let buckets = groups
            .into_iter()
            .enumerate()
            .map(|(b, members)| {
                let mut len = 0;
                for &i in &members {
                    slots[i] = (b, len..len + params[i].len);
                    len += params[i].len;
                }
                let shard = len.div_ceil(world);
                Bucket {
                    waiting: members.len(),
                    members,
                    shard,
                    grads: match options.stage {
                        ZeroStage::One => vec![0.0; shard * world],
                        ZeroStage::Two => Vec::new(),
                    },
                    away: None,
                    reduced: Vec::new(),
                    momentum: vec![0.0; shard],
                }
            })
            .collect();
        Ok(Zero {
            comm,
            options,
            ready: vec![false; params.len()],
            specs: params,
            slots,
            buckets,
            next: 0,
        })
    }

    /// The buckets as parameter indices, in reduction order.
    pub fn buckets(&self) -> Vec<Vec<usize>> {
        self.buckets.iter().map(|b| b.members.clone()).collect()
    }

    /// Parameter `param`'s gradient for this step, to write or accumulate into
    /// (zero at the start of each step).
    ///
    /// Fails if there is no such parameter or it was already marked ready.
    pub fn grad_mut(&mut self, param: usize) -> Result<&mut [f32]> {
        self.check_open(param)?;
        let (b, range) = self.slots[param].clone();
        let world = self.comm.world_size();
        let bucket = &mut self.buckets[b];
        if bucket.grads.is_empty() {
            bucket.grads = vec![0.0; bucket.shard * world];
        }
        Ok(&mut bucket.grads[range])
    }

    /// Says that backward has finished `param`'s gradient; a bucket whose
    /// gradients are all ready starts its reduction now, asynchronously, in
    /// bucket order (stage 1 an all-reduce, stage 2 a reduce-scatter).
    ///
    /// Fails if there is no such parameter or it was already marked ready in
    /// this step; the reduction's own errors surface in [`step`](Self::step).
    pub fn mark_ready(&mut self, param: usize) -> Result<()> {
        self.check_open(param)?;
        self.ready[param] = true;
        let world = self.comm.world_size();
        self.buckets[self.slots[param].0].waiting -= 1;
        while let Some(bucket) = self.buckets.get_mut(self.next) {
            if bucket.waiting > 0 {
                break;
            }
            if bucket.grads.is_empty() {
                bucket.grads = vec![0.0; bucket.shard * world];
            }
            let grads = std::mem::take(&mut bucket.grads);
            bucket.away = Some(match self.options.stage {
                ZeroStage::One => Away::Whole(self.comm.all_reduce_async(grads, ReduceOp::Avg)),
                ZeroStage::Two => {
                    let shard = vec![0.0; bucket.shard];
                    Away::Shard(self.comm.reduce_scatter_async(grads, shard, ReduceOp::Avg))
                }
            });
            self.next += 1;
        }
        Ok(())
    }

    /// Updates this rank's shard of every parameter with the averaged
    /// gradients and gathers the others' shards, so every rank ends with the
    /// same updated `params` (in registration order); then starts a new step.
    ///
    /// Fails naming a parameter not marked ready, if `params` do not match the
    /// registered lengths, or as the reductions and the all-gather do.
    pub fn step(&mut self, params: &mut [&mut [f32]]) -> Result<()> {
        if let Some(i) = self.ready.iter().position(|r| !r) {
            return Err(Error::InvalidArgument(format!(
                "parameter {} was not marked ready before the step",
                self.specs[i]
            )));
        }
        if params.len() != self.specs.len()
            || params
                .iter()
                .zip(&self.specs)
                .any(|(p, s)| p.len() != s.len)
        {
            return Err(Error::InvalidArgument(format!(
                "step got {} parameters that differ from the {} registered",
                params.len(),
                self.specs.len()
            )));
        }
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let ZeroOptions { lr, momentum, .. } = self.options;
        for bucket in &mut self.buckets {
            match bucket.away.take() {
                Some(Away::Whole(work)) => bucket.grads = work.wait()?,
                // The whole bucket is dropped here: only the shard stays.
                Some(Away::Shard(work)) => bucket.reduced = work.wait()?.1,
                None => {}
            }
            let mut flat = vec![0.0f32; bucket.shard * world];
            for &i in &bucket.members {
                let range = &self.slots[i].1;
                flat[range.clone()].copy_from_slice(params[i]);
            }
            let mine = rank * bucket.shard..(rank + 1) * bucket.shard;
            let grads = match self.options.stage {
                ZeroStage::One => &bucket.grads[mine.clone()],
                ZeroStage::Two => &bucket.reduced[..],
            };
            let shard: Vec<f32> = flat[mine]
                .iter()
                .zip(bucket.momentum.iter_mut())
                .zip(grads)
                .map(|((&p, v), &g)| {
                    *v = momentum * *v + g;
                    p - lr * *v
                })
                .collect();
            self.comm.all_gather(&shard, &mut flat)?;
            for &i in &bucket.members {
                params[i].copy_from_slice(&flat[self.slots[i].1.clone()]);
            }
            bucket.grads.fill(0.0);
            bucket.waiting = bucket.members.len();
        }
        self.ready.fill(false);
        self.next = 0;
        Ok(())
    }

    /// Bytes this rank holds for parameters, gradients and momentum between steps.
    pub fn memory(&self) -> Memory {
        let f32s = |n: usize| n * std::mem::size_of::<f32>();
        let world = self.comm.world_size();
        Memory {
            params: f32s(self.specs.iter().map(|s| s.len).sum()),
            grads: f32s(
                self.buckets
                    .iter()
                    .map(|b| match self.options.stage {
                        ZeroStage::One => b.shard * world,
                        ZeroStage::Two => b.shard,
                    })
                    .sum(),
            ),
            optimizer: f32s(self.buckets.iter().map(|b| b.shard).sum()),
        }
    }

    /// Every parameter's whole momentum buffer (in registration order), gathered
    /// from the ranks' shards: for checkpoints.
    ///
    /// A collective: every rank calls it. Fails as the all-gather does.
    pub fn momentum(&self) -> Result<Vec<Vec<f32>>> {
        let mut out: Vec<Vec<f32>> = self.specs.iter().map(|s| vec![0.0; s.len]).collect();
        for bucket in &self.buckets {
            let mut flat = vec![0.0f32; bucket.shard * self.comm.world_size()];
            self.comm.all_gather(&bucket.momentum, &mut flat)?;
            for &i in &bucket.members {
                out[i].copy_from_slice(&flat[self.slots[i].1.clone()]);
            }
        }
        Ok(out)
    }

    fn check_open(&self, param: usize) -> Result<()> {
        match self.ready.get(param) {
            None => Err(Error::InvalidArgument(format!(
                "no parameter {param}: {} are registered",
                self.specs.len()
            ))),
            Some(true) => Err(Error::InvalidArgument(format!(
                "parameter {} was already marked ready in this step",
                self.specs[param]
            ))),
            Some(false) => Ok(()),
        }
    }
}
