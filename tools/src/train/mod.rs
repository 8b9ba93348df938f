//! `train`: data-, pipeline- and sharded-parallel training of an MLP on
//! Fashion-MNIST, built only on Chorus's public API ([`chorus::ddp`],
//! [`chorus::pipeline`], [`chorus::zero`] and the [`Communicator`]).
//!
//! `train -np 2` starts two local ranks; under chorusrun, torchrun, SLURM or
//! mpirun it runs as one rank of the job.

pub mod checkpoint;
mod file;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod idx;
pub mod mlp;
pub mod parallel;
pub mod report;

use std::cell::RefCell;
use std::io::IsTerminal;
use std::ops::Range;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use chorus::ddp::{Compression, DdpOptions, DistributedSampler};
use chorus::pipeline::{Grid, PipelineSchedule, ScheduleKind, Stage, StageTimes};
use chorus::{env, Communicator, Config, ReduceOp};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

use checkpoint::{Checkpoint, Header};
use idx::{FashionMnist, Split};
use mlp::{Mlp, Score, Workspace};
use parallel::{in_group, micro_batches, Group, Layout, Reducer};
use report::{EpochLog, RankLog};

pub use crate::perf::args::Device;

/// The trainer's flags.
#[derive(Debug, Clone, Parser)]
#[command(
    version,
    about = "Data-, pipeline- and sharded-parallel MLP training on Fashion-MNIST"
)]
pub struct Args {
    /// Directory holding the four Fashion-MNIST IDX files (plain or .gz).
    #[arg(long, default_value = idx::DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// Where the checkpoint, the JSON log and the curves go.
    #[arg(long, default_value = "train-out")]
    pub out_dir: PathBuf,
    /// Epochs to train (in total, counting those of a resumed checkpoint).
    #[arg(long, default_value_t = 3)]
    pub epochs: u64,
    /// Samples per batch on each replica (each rank without --pp; a pipeline's stages share it).
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.05)]
    pub lr: f32,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f32,
    /// Hidden layer widths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "256,128")]
    pub hidden: Vec<usize>,
    /// Seed of the initial parameters and of the shuffling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// DDP bucket size in MiB.
    #[arg(long, default_value_t = 25.0)]
    pub bucket_cap_mb: f64,
    /// Size of the first DDP bucket in MiB.
    #[arg(long, default_value_t = 1.0)]
    pub first_bucket_cap_mb: f64,
    /// Gradient compression on the wire: none, bf16 or fp16.
    #[arg(long, default_value = "none")]
    pub compression: Compression,
    /// Micro-batches per optimizer step (all but the last without synchronisation).
    #[arg(long, default_value_t = 1)]
    pub accumulate: usize,
    /// Pipeline stages: the layers split across this many ranks.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Data-parallel replicas of the pipeline (default: ranks / --pp).
    #[arg(long)]
    pub dp: Option<usize>,
    /// Micro-batches each batch is split into for the pipeline (must divide --batch-size).
    #[arg(long, default_value_t = 1)]
    pub micro_batches: usize,
    /// Pipeline schedule: gpipe or 1f1b.
    #[arg(long, default_value = "1f1b")]
    pub schedule: ScheduleKind,
    /// ZeRO stage over the replicas: 0 (DDP), 1 (momentum sharded) or 2 (gradients too).
    #[arg(long, default_value_t = 0)]
    pub zero: u8,
    /// Where the MLP runs: `cpu`, or `cuda` (the GPU, gradients all-reduced in device
    /// memory as one bucket; needs the `cuda` feature).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// Continue from the checkpoint in --out-dir.
    #[arg(long)]
    pub resume: bool,
    /// Stop after this many optimizer steps in total (the last epoch is cut short).
    #[arg(long)]
    pub max_steps: Option<u64>,
    /// Measure throughput over this many steps instead of training (no evaluation, no files).
    #[arg(long)]
    pub bench: Option<u64>,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Start this many local ranks (`-np W`); without it, run as one rank of an existing job.
    #[arg(long = "np")]
    pub np: Option<usize>,
    /// Whole-job time limit in seconds when starting ranks with -np.
    #[arg(long, default_value_t = 86_400)]
    pub job_timeout: u64,
}

/// File names under `--out-dir`.
const CHECKPOINT: &str = "checkpoint.bin";
const LOG: &str = "train_log.json";
const CURVES: &str = "curves.png";

/// Untimed steps before a `--bench` measurement.
const BENCH_WARMUP: u64 = 20;

/// Test images per evaluation batch.
const EVAL_BATCH: usize = 500;

/// The `train` binary: starts local ranks for `-np`, or runs as one rank.
pub fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env(env::CHORUS_DEBUG))
        .with_writer(std::io::stderr)
        .init();
    let argv = std::env::args_os().map(|a| if a == "-np" { "--np".into() } else { a });
    let args = Args::parse_from(argv);
    let result = match args.np {
        Some(np) if std::env::var_os(env::RANK).is_none() => spawn_ranks(&args, np),
        _ => run_rank(&args),
    };
    crate::finish("train", result)
}

/// Starts `np` ranks of this program on this host (they see `RANK` and ignore `-np`); rank
/// 0's output is shown.
fn spawn_ranks(args: &Args, np: usize) -> Result<(), String> {
    let forwarded = std::env::args_os().skip(1);
    chorus_launch::run_copies(np, forwarded, Duration::from_secs(args.job_timeout))
        .map_err(|e| e.to_string())
}

/// Progress through an epoch: an indicatif bar, or plain lines.
struct Progress {
    bar: ProgressBar,
    /// Print a line at each quarter of the epoch (stderr is not a terminal).
    lines: bool,
    epoch: u64,
    steps: usize,
    start: Instant,
}

impl Progress {
    /// One step of `samples` samples (all ranks) done.
    fn step(&self, samples: usize) {
        self.bar.inc(1);
        let done = self.bar.position() as usize;
        if self.lines
            && done < self.steps
            && (done * 4 / self.steps) > ((done - 1) * 4 / self.steps)
        {
            let rate = (done * samples) as f64 / self.start.elapsed().as_secs_f64().max(1e-9);
            eprintln!(
                "epoch {}  step {done}/{}  {rate:.0} samples/s",
                self.epoch, self.steps
            );
        }
    }
}

/// Everything one rank trains with.
struct Trainer<'c> {
    args: &'c Args,
    comm: &'c Communicator,
    grid: &'c Grid,
    layout: Layout,
    data: FashionMnist,
    /// The whole network, for evaluation.
    mlp: Mlp,
    /// This rank's stage of it: the layers `layers`.
    stage: Mlp,
    layers: Range<usize>,
    schedule: PipelineSchedule,
    reducer: Reducer<'c>,
    /// This stage's parameters.
    params: Vec<Vec<f32>>,
    /// Evaluation's scratch.
    ws: Workspace,
    /// Each micro-batch's samples and scratch.
    micros: Vec<Micro>,
    steps: u64,
    /// Where this stage's time went since the last report.
    times: StageTimes,
    /// `--device cuda`: the MLP's state on the GPU (`params` and `sgd` are then the host
    /// copies, brought up to date for evaluation and checkpoints).
    #[cfg(feature = "cuda")]
    gpu: Option<gpu::Gpu>,
}

/// One `f32` buffer per parameter.
type Tensors = Vec<Vec<f32>>;

/// One micro-batch's samples (the first stage's pixels, the last stage's labels) and the
/// activations its backward needs.
#[derive(Debug, Default)]
struct Micro {
    x: Vec<f32>,
    y: Vec<u8>,
    ws: Workspace,
}

fn run_rank(args: &Args) -> Result<(), String> {
    if args.batch_size == 0 || args.accumulate == 0 {
        return Err("--batch-size and --accumulate must be at least 1".into());
    }
    check_device(args)?;
    let comm = join()?;
    let data =
        FashionMnist::load(&args.data_dir).map_err(|e| format!("rank {}: {e}", comm.rank()))?;
    let mut widths = vec![data.train.features];
    widths.extend(&args.hidden);
    widths.push(data.classes);
    let mlp = Mlp::new(widths)?;
    let sizes: Vec<usize> = mlp
        .widths()
        .windows(2)
        .map(|w| w[0] * w[1] + w[1])
        .collect();
    let layout = Layout::new(args, comm.world_size(), &sizes)?;
    let err = |e: chorus::Error| e.to_string();
    let grid = Grid::new(&comm, layout.dp, layout.pp).map_err(err)?;
    let layers = layout.stages[grid.stage].clone();
    let stage = mlp.stage(layers.clone());
    let specs = mlp.params()[Mlp::param_range(layers.clone())].to_vec();
    let params = mlp.init(args.seed)[Mlp::param_range(layers.clone())].to_vec();
    let reducer = Reducer::new(&grid.data, args, layout.zero, specs, &params).map_err(err)?;
    let schedule =
        PipelineSchedule::new(layout.schedule, layout.pp, layout.micro_batches).map_err(err)?;
    let mut t = Trainer {
        args,
        comm: &comm,
        grid: &grid,
        micros: (0..layout.micro_batches)
            .map(|_| Micro::default())
            .collect(),
        layout,
        data,
        mlp,
        stage,
        layers,
        schedule,
        reducer,
        params,
        ws: Workspace::default(),
        steps: 0,
        times: StageTimes::default(),
        #[cfg(feature = "cuda")]
        gpu: None,
    };
    let history = t.start()?;
    #[cfg(feature = "cuda")]
    if args.device == Device::Cuda {
        let Reducer::Ddp(_, sgd) = &t.reducer else {
            return Err("--device cuda trains with --zero 0".into());
        };
        let gpu = gpu::Gpu::new(&comm, &t.mlp, &t.params, sgd)?;
        if comm.rank() == 0 {
            eprintln!("train: rank 0 on the GPU, {}", gpu.describe());
        }
        t.gpu = Some(gpu);
    }
    match args.bench {
        Some(steps) => t.bench(steps),
        None => t.train(history),
    }
}

/// Fails for a `--device` this build or these flags cannot train on.
fn check_device(args: &Args) -> Result<(), String> {
    match args.device {
        Device::Cpu => Ok(()),
        Device::Cuda if !cfg!(feature = "cuda") => {
            Err("`--device cuda` needs train built with the `cuda` feature \
             (cargo build --release -p chorus-tools --features cuda)"
                .into())
        }
        Device::Cuda if args.compression != Compression::None => {
            Err("`--device cuda` all-reduces the gradients in f32: use --compression none".into())
        }
        Device::Cuda => Ok(()),
    }
}

/// Joins the job the environment describes, or, with no launcher at all, runs as the only rank.
fn join() -> Result<Communicator, String> {
    let config = match Config::from_env() {
        Err(chorus::Error::Config {
            var: env::RANK,
            value,
            ..
        }) if value.is_empty() => Config::new(0, 1, chorus::DEFAULT_MASTER_ADDR, 0),
        other => other.map_err(|e| e.to_string())?,
    };
    Communicator::new(config).map_err(|e| e.to_string())
}

impl Trainer<'_> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Rank 0's parameters (and, resuming, its checkpoint) on every replica; the history so far.
    ///
    /// Resuming needs `--pp 1 --zero 0` ([`Layout::new`] checks): this rank's stage is then the
    /// whole network and its momentum the SGD buffers.
    fn start(&mut self) -> Result<Vec<EpochLog>, String> {
        let err = |e: chorus::Error| e.to_string();
        // Rank 0 reads the checkpoint and tells everyone how it went, so all fail together.
        let mut loaded = None;
        let mut status = [0u64];
        let mut problem = String::new();
        if self.args.resume && self.rank() == 0 {
            match self.load_checkpoint() {
                Ok(c) => loaded = Some(c),
                Err(e) => {
                    status[0] = 1;
                    problem = e;
                }
            }
        }
        self.comm.broadcast(&mut status, 0).map_err(err)?;
        if status[0] != 0 {
            return Err(if problem.is_empty() {
                "rank 0 could not resume from its checkpoint".into()
            } else {
                problem
            });
        }
        let mut history = Vec::new();
        if let Some(c) = loaded {
            self.params = c.params;
            if let Reducer::Ddp(_, sgd) = &mut self.reducer {
                sgd.buffers = c.momentum;
            }
            history = c.header.history;
        }
        for p in &mut self.params {
            self.grid.data.broadcast(p, 0).map_err(err)?;
        }
        if let (true, Reducer::Ddp(_, sgd)) = (self.args.resume, &mut self.reducer) {
            for buf in &mut sgd.buffers {
                self.comm.broadcast(buf, 0).map_err(err)?;
            }
        }
        let mut done = [history.len() as u64];
        self.comm.broadcast(&mut done, 0).map_err(err)?;
        if self.rank() != 0 {
            // Only the number of epochs matters off rank 0.
            history = (1..=done[0])
                .map(|epoch| EpochLog {
                    epoch,
                    train_loss: 0.0,
                    train_acc: 0.0,
                    test_loss: 0.0,
                    test_acc: 0.0,
                    train_seconds: 0.0,
                    samples_per_sec: 0.0,
                    ranks: Vec::new(),
                })
                .collect();
        }
        Ok(history)
    }

    fn load_checkpoint(&self) -> Result<Checkpoint, String> {
        let path = self.args.out_dir.join(CHECKPOINT);
        if !path.exists() {
            return Err(format!(
                "--resume: no checkpoint at {} (train without --resume first)",
                path.display()
            ));
        }
        let c = Checkpoint::load(&path)?;
        let lens: Vec<usize> = self.params.iter().map(Vec::len).collect();
        if c.header.lens != lens {
            return Err(format!(
                "{}: saved for a network of widths {:?}, this one is {:?}",
                path.display(),
                c.header.widths,
                self.mlp.widths()
            ));
        }
        if c.header.world_size != self.comm.world_size()
            || c.header.batch_size != self.args.batch_size
        {
            tracing::warn!(
                "resuming a run of {} ranks x batch {} with {} x {}: it will not match an uninterrupted run bit for bit",
                c.header.world_size,
                c.header.batch_size,
                self.comm.world_size(),
                self.args.batch_size
            );
        }
        Ok(c)
    }

    /// One optimizer step over `batch`, split into micro-batches run through the pipeline
    /// (one stage without `--pp`); the score is the last stage's (zero on the others).
    fn step(&mut self, batch: &[usize]) -> Result<Score, String> {
        let chunks = micro_batches(batch, self.layout.micro_batches);
        let mut total = Score::default();
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &mut self.gpu {
            gpu.zero_grad()?;
            let Micro { x, y, .. } = &mut self.micros[0];
            for chunk in &chunks {
                gather_for(&self.data.train, chunk, true, true, x, y);
                let score = gpu.forward_backward(x, y, batch.len() as f32)?;
                total.loss += score.loss;
                total.correct += score.correct;
            }
            gpu.step()?;
            self.steps += 1;
            return Ok(total);
        }
        let grid = self.grid;
        let data_err = |e| in_group(grid, Group::Data, e);
        self.reducer.zero_grad().map_err(data_err)?;
        let (first, last) = (grid.stage == 0, grid.stage + 1 == grid.pp);
        let (mlp, params, data) = (&self.stage, &self.params, &self.data.train);
        let (w_in, w_out) = (mlp.widths()[0], mlp.widths()[mlp.layers()]);
        let rows_max = chunks.iter().map(|c| c.len()).max().unwrap_or(0);
        let micros = RefCell::new(&mut self.micros);
        let reducer = &mut self.reducer;
        let (mut failed, mut backwards) = (None, 0);
        // Activations are `rows_max` rows long; a short micro-batch uses the front of them.
        let stage = Stage::new(&grid.pipeline, rows_max * w_in, rows_max * w_out);
        let times = stage
            .run(
                &self.schedule,
                |m, input, output| {
                    let (chunk, rows) = (chunks[m], chunks[m].len());
                    let Micro { x, y, ws } = &mut micros.borrow_mut()[m];
                    gather_for(data, chunk, first, last, x, y);
                    let x = if first { &x[..] } else { &input[..rows * w_in] };
                    mlp.forward(params, x, rows, ws);
                    if last {
                        let s = mlp.loss(y, batch.len() as f32, ws);
                        total.loss += s.loss;
                        total.correct += s.correct;
                    } else {
                        output[..rows * w_out].copy_from_slice(mlp.output(ws, rows));
                    }
                },
                |m, input, grad_out, grad_in| {
                    backwards += 1;
                    if failed.is_some() {
                        return;
                    }
                    let rows = chunks[m].len();
                    let Micro { x, ws, .. } = &mut micros.borrow_mut()[m];
                    if !last {
                        mlp.output_grad(&grad_out[..rows * w_out], ws);
                    }
                    let x = if first { &x[..] } else { &input[..rows * w_in] };
                    let grad_in = (!first).then(|| &mut grad_in[..rows * w_in]);
                    let done = backwards == chunks.len();
                    if let Err(e) = reducer.backward(done, |grads| {
                        mlp.backward(params, x, rows, ws, grads, grad_in)
                    }) {
                        failed = Some(e);
                    }
                },
            )
            .map_err(|e| in_group(grid, Group::Pipeline, e))?;
        if let Some(e) = failed {
            return Err(data_err(e));
        }
        self.times += times;
        self.reducer.step(&mut self.params).map_err(data_err)?;
        self.steps += 1;
        Ok(total)
    }

    /// This rank's replica's batches for `epoch` (every stage of a replica takes the same).
    fn batches(&self, epoch: u64) -> Result<Vec<Vec<usize>>, String> {
        let mut sampler =
            DistributedSampler::new(self.data.train.len(), self.grid.dp, self.grid.replica)
                .map_err(|e| e.to_string())?
                .seed(self.args.seed);
        sampler.set_epoch(epoch);
        Ok(sampler
            .indices()
            .chunks(self.args.batch_size)
            .map(<[usize]>::to_vec)
            .collect())
    }

    fn train(&mut self, mut history: Vec<EpochLog>) -> Result<(), String> {
        let out = self.args.out_dir.clone();
        if self.rank() == 0 {
            std::fs::create_dir_all(&out)
                .map_err(|e| format!("cannot create --out-dir {}: {e}", out.display()))?;
        }
        let first = history.len() as u64;
        for epoch in first..self.args.epochs {
            if self.args.max_steps.is_some_and(|m| self.steps >= m) {
                break;
            }
            let batches = self.batches(epoch)?;
            let bar = self.progress(epoch, batches.len());
            let (mut score, mut seen) = (Score::default(), 0usize);
            let start = Instant::now();
            for batch in &batches {
                if self.args.max_steps.is_some_and(|m| self.steps >= m) {
                    break;
                }
                let s = self.step(batch)?;
                score.loss += s.loss;
                score.correct += s.correct;
                seen += batch.len();
                bar.step(self.args.batch_size * self.grid.dp);
            }
            let seconds = start.elapsed().as_secs_f64();
            bar.bar.finish_and_clear();
            let ranks = self.rank_logs(seen as f64 / seconds.max(1e-9))?;
            self.sync_host()?;
            let (params, momentum) = self.whole()?;
            let test = self.evaluate(&params);
            // Each replica's samples count once: on its last stage, which scores them.
            let scored = if self.grid.stage + 1 == self.grid.pp {
                seen
            } else {
                0
            };
            let mut sums = [
                score.loss,
                score.correct as f64,
                scored as f64,
                test.loss,
                test.correct as f64,
                self.test_share() as f64,
            ];
            self.comm
                .all_reduce(&mut sums, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            let mut slowest = [seconds];
            self.comm
                .all_reduce(&mut slowest, ReduceOp::Max)
                .map_err(|e| e.to_string())?;
            let log = EpochLog {
                epoch: epoch + 1,
                train_loss: sums[0] / sums[2].max(1.0),
                train_acc: sums[1] / sums[2].max(1.0),
                test_loss: sums[3] / sums[5].max(1.0),
                test_acc: sums[4] / sums[5].max(1.0),
                train_seconds: slowest[0],
                samples_per_sec: sums[2] / slowest[0].max(1e-9),
                ranks,
            };
            history.push(log);
            if self.rank() == 0 {
                self.save(&history, params, momentum)?;
                let log = &history[history.len() - 1];
                log.ranks.iter().for_each(|r| println!("{}", r.line()));
                println!("{}", log.line());
            }
        }
        if self.rank() == 0 {
            println!(
                "checkpoint {}  log {}  curves {}",
                out.join(CHECKPOINT).display(),
                out.join(LOG).display(),
                out.join(CURVES).display()
            );
        }
        Ok(())
    }

    /// With `--device cuda`, copies the GPU's parameters and momentum into the host copies.
    fn sync_host(&mut self) -> Result<(), String> {
        #[cfg(feature = "cuda")]
        if let (Some(gpu), Reducer::Ddp(_, sgd)) = (&self.gpu, &mut self.reducer) {
            self.params = gpu.params()?;
            sgd.buffers = gpu.momentum()?;
        }
        Ok(())
    }

    /// The whole network's parameters and momentum on every rank, each stage's
    /// broadcast by the stage that holds them (for evaluation and checkpoints).
    fn whole(&self) -> Result<(Tensors, Tensors), String> {
        let err = |e| in_group(self.grid, Group::Pipeline, e);
        let mine = self
            .reducer
            .momentum()
            .map_err(|e| in_group(self.grid, Group::Data, e))?;
        let specs = self.mlp.params();
        let mut params: Vec<Vec<f32>> = specs.iter().map(|p| vec![0.0; p.len]).collect();
        let mut momentum = params.clone();
        for (stage, layers) in self.layout.stages.iter().enumerate() {
            let range = Mlp::param_range(layers.clone());
            for (k, i) in range.enumerate() {
                if stage == self.grid.stage {
                    params[i].copy_from_slice(&self.params[k]);
                    momentum[i].copy_from_slice(&mine[k]);
                }
                if self.grid.pp > 1 {
                    self.grid
                        .pipeline
                        .broadcast(&mut params[i], stage)
                        .map_err(err)?;
                    self.grid
                        .pipeline
                        .broadcast(&mut momentum[i], stage)
                        .map_err(err)?;
                }
            }
        }
        Ok((params, momentum))
    }

    /// Every rank's figures since the last call (rank 0 gets them all), this
    /// rank's stage having passed `samples_per_sec`; starts the next period.
    fn rank_logs(&mut self, samples_per_sec: f64) -> Result<Vec<RankLog>, String> {
        let memory = self.reducer.memory(&self.params);
        let mine = [
            self.grid.replica as f64,
            self.grid.stage as f64,
            self.layers.start as f64,
            self.layers.end as f64,
            samples_per_sec,
            self.times.bubble(),
            memory.params as f64,
            memory.grads as f64,
            memory.optimizer as f64,
        ];
        self.times = StageTimes::default();
        let mut all = vec![0.0; mine.len() * self.comm.world_size()];
        self.comm
            .all_gather(&mine, &mut all)
            .map_err(|e| e.to_string())?;
        Ok(all
            .chunks_exact(mine.len())
            .enumerate()
            .map(|(rank, f)| RankLog {
                rank,
                replica: f[0] as usize,
                stage: f[1] as usize,
                layers: [f[2] as usize, f[3] as usize],
                samples_per_sec: f[4],
                bubble: f[5],
                bubble_theory: self.schedule.bubble(),
                param_bytes: f[6] as u64,
                grad_bytes: f[7] as u64,
                optimizer_bytes: f[8] as u64,
            })
            .collect())
    }

    /// Test images this rank scores: `rank, rank + W, ...`.
    fn test_share(&self) -> usize {
        let (n, w, r) = (self.data.test.len(), self.comm.world_size(), self.rank());
        n.saturating_sub(r).div_ceil(w)
    }

    /// This rank's share of the test set, scored with the whole network's `params`
    /// (summed, not averaged).
    fn evaluate(&mut self, params: &[Vec<f32>]) -> Score {
        let split = &self.data.test;
        let mine: Vec<usize> = (self.comm.rank()..split.len())
            .step_by(self.comm.world_size())
            .collect();
        let mut total = Score::default();
        let mut x = Vec::new();
        for chunk in mine.chunks(EVAL_BATCH) {
            x.clear();
            chunk
                .iter()
                .for_each(|&i| x.extend_from_slice(split.image(i)));
            let labels: Vec<u8> = chunk.iter().map(|&i| split.labels[i]).collect();
            self.mlp.forward(params, &x, chunk.len(), &mut self.ws);
            let s = self.mlp.loss(&labels, 1.0, &mut self.ws);
            total.loss += s.loss;
            total.correct += s.correct;
        }
        total
    }

    /// Rank 0: checkpoint, JSON log and curves for the epochs so far.
    fn save(
        &self,
        history: &[EpochLog],
        params: Vec<Vec<f32>>,
        momentum: Vec<Vec<f32>>,
    ) -> Result<(), String> {
        let out = &self.args.out_dir;
        Checkpoint {
            header: Header {
                epochs_done: history.len() as u64,
                widths: self.mlp.widths().to_vec(),
                seed: self.args.seed,
                world_size: self.comm.world_size(),
                batch_size: self.args.batch_size,
                lens: params.iter().map(Vec::len).collect(),
                history: history.to_vec(),
            },
            params,
            momentum,
        }
        .save(&out.join(CHECKPOINT))?;
        let config = serde_json::json!({
            "world_size": self.comm.world_size(),
            "batch_size_per_rank": self.args.batch_size,
            "lr": self.args.lr,
            "momentum": self.args.momentum,
            "hidden": self.args.hidden,
            "seed": self.args.seed,
            "bucket_cap_mb": self.args.bucket_cap_mb,
            "compression": format!("{:?}", self.args.compression).to_lowercase(),
            "accumulate": self.args.accumulate,
            "device": format!("{:?}", self.args.device).to_lowercase(),
            "dp": self.layout.dp,
            "pp": self.layout.pp,
            "micro_batches": self.layout.micro_batches,
            "schedule": self.layout.schedule.to_string(),
            "zero": self.layout.zero,
            "stages": self.layout.stages.iter().map(|l| [l.start, l.end]).collect::<Vec<_>>(),
        });
        report::write_log(&out.join(LOG), &config, history)?;
        report::plot(&out.join(CURVES), history)
    }

    /// Rank 0's progress over an epoch's steps: a bar on a terminal, else a line
    /// every quarter (which passes through `-np`'s and other launchers' pipes).
    fn progress(&self, epoch: u64, steps: usize) -> Progress {
        let shown = self.rank() == 0 && !self.args.no_progress;
        if !shown || !std::io::stderr().is_terminal() {
            return Progress {
                bar: ProgressBar::hidden(),
                lines: shown,
                epoch: epoch + 1,
                steps,
                start: Instant::now(),
            };
        }
        let bar = ProgressBar::new(steps as u64);
        if let Ok(style) =
            ProgressStyle::with_template("epoch {msg} [{bar:40}] {pos}/{len} steps  eta {eta}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message((epoch + 1).to_string());
        Progress {
            bar,
            lines: false,
            epoch: epoch + 1,
            steps,
            start: Instant::now(),
        }
    }

    /// The gradient buckets and whether their all-reduces overlap the backward pass: the
    /// GPU all-reduces one bucket after it.
    fn buckets(&self) -> Result<(usize, bool), String> {
        #[cfg(feature = "cuda")]
        if self.gpu.is_some() {
            return Ok((1, false));
        }
        Ok(match &self.reducer {
            Reducer::Ddp(ddp, _) => {
                let options = DdpOptions::from_env().map_err(|e| e.to_string())?;
                (ddp.buckets().len(), options.overlap)
            }
            // Both stages start each bucket's reduction as soon as backward fills it.
            Reducer::Zero(zero) => (zero.buckets().len(), true),
        })
    }

    /// Times `steps` training steps after a warm-up; rank 0 prints step time and samples per
    /// second, and each rank's figures.
    fn bench(&mut self, steps: u64) -> Result<(), String> {
        let batches = self.batches(0)?;
        let full: Vec<&Vec<usize>> = batches
            .iter()
            .filter(|b| b.len() == self.args.batch_size)
            .collect();
        if full.is_empty() {
            return Err("--bench: no full batch in the data set".into());
        }
        let err = |e: chorus::Error| e.to_string();
        let mut start = Instant::now();
        for i in 0..BENCH_WARMUP + steps {
            if i == BENCH_WARMUP {
                self.comm.barrier().map_err(err)?;
                self.times = StageTimes::default();
                start = Instant::now();
            }
            let batch = full[i as usize % full.len()];
            self.step(batch)?;
        }
        let mine = (self.args.batch_size * steps as usize) as f64 / start.elapsed().as_secs_f64();
        self.comm.barrier().map_err(err)?;
        let mut seconds = [start.elapsed().as_secs_f64()];
        self.comm
            .all_reduce(&mut seconds, ReduceOp::Max)
            .map_err(err)?;
        let ranks = self.rank_logs(mine)?;
        let (world, layout) = (self.comm.world_size(), &self.layout);
        let samples = (layout.dp * self.args.batch_size) as f64 * steps as f64;
        if self.rank() == 0 {
            let (buckets, overlap) = self.buckets()?;
            println!(
                "bench  world {world}  dp {}  pp {}  micro {}  schedule {}  zero {}  batch/replica {}  buckets {}  overlap {}  steps {steps}  step_ms {:.3}  samples/s {:.0}",
                layout.dp,
                layout.pp,
                layout.micro_batches,
                layout.schedule,
                layout.zero,
                self.args.batch_size,
                buckets,
                if overlap { "on" } else { "off" },
                seconds[0] * 1e3 / steps.max(1) as f64,
                samples / seconds[0]
            );
            ranks.iter().for_each(|r| println!("{}", r.line()));
        }
        Ok(())
    }
}

/// What a pipeline stage needs of the samples `indices`: the first stage their
/// pixels, the last their labels.
fn gather_for(
    split: &Split,
    indices: &[usize],
    first: bool,
    last: bool,
    x: &mut Vec<f32>,
    y: &mut Vec<u8>,
) {
    x.clear();
    y.clear();
    for &i in indices {
        if first {
            x.extend_from_slice(split.image(i));
        }
        if last {
            y.push(split.labels[i]);
        }
    }
}
