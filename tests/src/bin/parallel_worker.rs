//! The pipeline and ZeRO test worker: one rank of a `chorus::pipeline` or
//! `chorus::zero` test, checking its result against the same computation done
//! without the parallelism, and exiting non-zero with a message on a mismatch.
//!
//! Scenarios: `pipeline gpipe|1f1b M` (the world is one pipeline), `grid D P
//! gpipe|1f1b M` (D replicas of P stages, gradients averaged over replicas),
//! `zero 1|2` (ZeRO against DDP), `kill VICTIM` (VICTIM dies mid-pipeline;
//! survivors print `failed: ERROR` and exit 1), and `overlap FILE` (a stage
//! computes while its send waits for a busy neighbour).

use std::cell::RefCell;
use std::collections::HashMap;
use std::process::ExitCode;

use chorus::ddp::{Ddp, DdpOptions, ParamSpec};
use chorus::pipeline::{Grid, PipelineSchedule, ScheduleKind, Stage, StageTimes};
use chorus::zero::{Zero, ZeroOptions, ZeroStage};
use chorus::{Communicator, DType, ReduceOp};

/// Layers of the test network (divisible by 1, 2, 3 and 4 stages).
const LAYERS: usize = 12;
/// Width of every layer.
const WIDTH: usize = 8;
/// Rows per micro-batch.
const ROWS: usize = 3;
/// Elements of one activation: a micro-batch of `ROWS` rows.
const ACT: usize = ROWS * WIDTH;

fn main() -> ExitCode {
    chorus_tests::init_logging();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).map(String::as_str).unwrap_or("");
    let num = |i: usize| arg(i).parse::<usize>().unwrap_or(0);
    let comm = match Communicator::from_env() {
        Ok(comm) => comm,
        Err(e) => {
            eprintln!("failed: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match arg(0) {
        "pipeline" => pipeline(&comm, arg(1), num(2)),
        "grid" => grid(&comm, num(1), num(2), arg(3), num(4)),
        "zero" => zero(&comm, num(1)),
        "kill" => killed(&comm, num(1)),
        "overlap" => overlap(&comm, arg(1)),
        other => Err(Outcome::Wrong(format!("unknown scenario {other:?}"))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Outcome::Failed(e)) => {
            eprintln!("failed: {e}");
            ExitCode::FAILURE
        }
        Err(Outcome::Wrong(what)) => {
            eprintln!("WRONG: {what}");
            ExitCode::from(2)
        }
    }
}

/// Two stages, GPipe, activations of 4 MiB (too big to sit in a transport's buffers: a
/// send completes only once the receiver takes it). Stage 1's first forward waits until
/// stage 0 has begun its third, which stage 0 reaches only by computing while its send
/// of micro-batch 1 waits for stage 1: the overlap `Stage::run` promises.
fn overlap(comm: &Communicator, file: &str) -> Result<(), Outcome> {
    const BIG: usize = 1 << 20;
    let marker = std::path::Path::new(file);
    let schedule = PipelineSchedule::new(ScheduleKind::GPipe, 2, 3)?;
    let stage = Stage::new(comm, BIG, BIG);
    let mut waited = Ok(());
    stage.run(
        &schedule,
        |m, _x, out| match (comm.rank(), m) {
            (0, 2) => std::fs::write(marker, b"").expect("the marker file"),
            (0, _) => out.fill(m as f32),
            (_, 0) => {
                let start = std::time::Instant::now();
                while !marker.exists() {
                    if start.elapsed() > std::time::Duration::from_secs(20) {
                        waited = Err(Outcome::Wrong(
                            "stage 0 did not begin micro-batch 2 while its send of \
                             micro-batch 1 waited for stage 1"
                                .into(),
                        ));
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            _ => {}
        },
        |_, _, _, _| {},
    )?;
    waited?;
    println!("overlap ok");
    Ok(())
}

/// Why a scenario did not succeed.
enum Outcome {
    /// A library call failed (expected in the kill scenario).
    Failed(chorus::Error),
    /// A result differs from the reference.
    Wrong(String),
}

impl From<chorus::Error> for Outcome {
    fn from(e: chorus::Error) -> Outcome {
        Outcome::Failed(e)
    }
}

/// One layer `y = tanh(W x + b)`: `WIDTH x WIDTH` weights then `WIDTH` biases.
fn layer_params(l: usize) -> Vec<f32> {
    (0..WIDTH * WIDTH + WIDTH)
        .map(|k| (((l * 131 + k * 17) % 23) as f32 / 23.0 - 0.5) * 0.8)
        .collect()
}

/// Replica `d`'s input for micro-batch `m`.
fn input(d: usize, m: usize) -> Vec<f32> {
    (0..ACT)
        .map(|k| (d as f32 * 1.3 + m as f32 * 0.7 + k as f32 * 0.11).sin())
        .collect()
}

/// Runs `layers` on `x`; returns every activation, `x` first.
fn forward_layers(layers: &[Vec<f32>], x: Vec<f32>) -> Vec<Vec<f32>> {
    let mut acts = vec![x];
    for p in layers {
        let x = acts.last().expect("the input");
        let mut y = vec![0.0f32; ACT];
        for r in 0..ROWS {
            for i in 0..WIDTH {
                let z: f32 = (0..WIDTH)
                    .map(|j| p[i * WIDTH + j] * x[r * WIDTH + j])
                    .sum::<f32>()
                    + p[WIDTH * WIDTH + i];
                y[r * WIDTH + i] = z.tanh();
            }
        }
        acts.push(y);
    }
    acts
}

/// Backpropagates `g` (the gradient of the last activation) through `layers`,
/// adding into `grads`; returns the gradient of the input.
fn backward_layers(
    layers: &[Vec<f32>],
    acts: &[Vec<f32>],
    mut g: Vec<f32>,
    grads: &mut [Vec<f32>],
) -> Vec<f32> {
    for l in (0..layers.len()).rev() {
        let (x, y, p) = (&acts[l], &acts[l + 1], &layers[l]);
        let dz: Vec<f32> = g.iter().zip(y).map(|(g, y)| g * (1.0 - y * y)).collect();
        let mut dx = vec![0.0f32; ACT];
        for r in 0..ROWS {
            for i in 0..WIDTH {
                let d = dz[r * WIDTH + i];
                for j in 0..WIDTH {
                    grads[l][i * WIDTH + j] += d * x[r * WIDTH + j];
                    dx[r * WIDTH + j] += p[i * WIDTH + j] * d;
                }
                grads[l][WIDTH * WIDTH + i] += d;
            }
        }
        g = dx;
    }
    g
}

/// The gradients of layers `range` for replicas `replicas` over `micro`
/// micro-batches, averaged over the replicas, computed on this rank alone.
/// The loss is half the sum of squares of the last layer's output.
fn reference(range: std::ops::Range<usize>, replicas: usize, micro: usize) -> Vec<Vec<f32>> {
    let layers: Vec<Vec<f32>> = (0..LAYERS).map(layer_params).collect();
    let mut grads = vec![vec![0.0f32; WIDTH * WIDTH + WIDTH]; LAYERS];
    for d in 0..replicas {
        let mut mine = vec![vec![0.0f32; WIDTH * WIDTH + WIDTH]; LAYERS];
        for m in 0..micro {
            let acts = forward_layers(&layers, input(d, m));
            let last = acts.last().expect("an output").clone();
            backward_layers(&layers, &acts, last, &mut mine);
        }
        for (g, m) in grads.iter_mut().zip(mine) {
            g.iter_mut()
                .zip(m)
                .for_each(|(g, m)| *g += m / replicas as f32);
        }
    }
    grads[range].to_vec()
}

/// Runs replica `replica`'s data through `comm` as a pipeline; returns this
/// stage's layer gradients and its times.
fn run_stage(
    comm: &Communicator,
    replica: usize,
    kind: ScheduleKind,
    micro: usize,
    die_at: Option<usize>,
) -> Result<(Vec<Vec<f32>>, StageTimes), Outcome> {
    let (s, stages) = (comm.rank(), comm.world_size());
    let per = LAYERS / stages;
    let layers: Vec<Vec<f32>> = (s * per..(s + 1) * per).map(layer_params).collect();
    let grads = RefCell::new(vec![vec![0.0f32; WIDTH * WIDTH + WIDTH]; per]);
    let stash: RefCell<HashMap<usize, Vec<Vec<f32>>>> = RefCell::default();
    let schedule = PipelineSchedule::new(kind, stages, micro)?;
    let stage = Stage::new(comm, ACT, ACT);
    let times = stage.run(
        &schedule,
        |m, x, out| {
            if die_at == Some(m) {
                nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL).expect("SIGKILL");
            }
            let x = if s == 0 {
                input(replica, m)
            } else {
                x.to_vec()
            };
            let acts = forward_layers(&layers, x);
            if s + 1 < stages {
                out.copy_from_slice(acts.last().expect("an output"));
            }
            stash.borrow_mut().insert(m, acts);
        },
        |m, _x, grad_out, grad_in| {
            let acts = stash.borrow_mut().remove(&m).expect("forward ran first");
            let g = if s + 1 == stages {
                acts.last().expect("an output").clone()
            } else {
                grad_out.to_vec()
            };
            let dx = backward_layers(&layers, &acts, g, &mut grads.borrow_mut());
            if s > 0 {
                grad_in.copy_from_slice(&dx);
            }
        },
    )?;
    Ok((grads.into_inner(), times))
}

/// Fails unless `got` matches `want` to float tolerance.
fn compare(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) -> Result<(), Outcome> {
    for (l, (g, w)) in got.iter().zip(want).enumerate() {
        for (k, (a, b)) in g.iter().zip(w).enumerate() {
            if (a - b).abs() > 1e-5 * (1.0 + b.abs()) {
                return Err(Outcome::Wrong(format!(
                    "{what}: element {k} of layer {l} is {a}, not {b}"
                )));
            }
        }
    }
    Ok(())
}

fn pipeline(comm: &Communicator, kind: &str, micro: usize) -> Result<(), Outcome> {
    let kind: ScheduleKind = kind.parse()?;
    let (s, per) = (comm.rank(), LAYERS / comm.world_size());
    let (grads, times) = run_stage(comm, 0, kind, micro, None)?;
    compare(
        "stage gradients",
        &grads,
        &reference(s * per..(s + 1) * per, 1, micro),
    )?;
    println!(
        "pipeline ok: stage {s} bubble {:.3} (theory {:.3})",
        times.bubble(),
        chorus::pipeline::bubble(comm.world_size(), micro)
    );
    Ok(())
}

fn grid(
    comm: &Communicator,
    dp: usize,
    pp: usize,
    kind: &str,
    micro: usize,
) -> Result<(), Outcome> {
    let kind: ScheduleKind = kind.parse()?;
    let grid = Grid::new(comm, dp, pp)?;
    if grid.rank_of(grid.replica, grid.stage) != comm.rank() {
        return Err(Outcome::Wrong("rank_of disagrees with the layout".into()));
    }
    let (mut grads, _) = run_stage(&grid.pipeline, grid.replica, kind, micro, None)?;
    for g in &mut grads {
        grid.data.all_reduce(g, ReduceOp::Avg)?;
    }
    let per = LAYERS / pp;
    let range = grid.stage * per..(grid.stage + 1) * per;
    compare(
        "averaged stage gradients",
        &grads,
        &reference(range, dp, micro),
    )?;
    println!("grid ok: replica {} stage {}", grid.replica, grid.stage);
    Ok(())
}

fn killed(comm: &Communicator, victim: usize) -> Result<(), Outcome> {
    for step in 0..3 {
        let die_at = (step == 1 && comm.rank() == victim).then_some(2);
        run_stage(comm, 0, ScheduleKind::OneFOneB, 8, die_at)?;
    }
    Err(Outcome::Wrong(
        "the pipeline finished without its victim".into(),
    ))
}

/// Parameter lengths: several buckets with the small caps below.
const LENS: [usize; 6] = [300, 5, 1000, 7, 64, 200];
/// Optimizer steps compared.
const STEPS: usize = 5;

/// Rank `rank`'s gradient at `step` for element `j` of parameter `i` whose value is `p`.
fn grad(rank: usize, step: usize, i: usize, j: usize, p: f32) -> f32 {
    (p * 3.0 + (rank * 7 + step * 3 + i) as f32 + j as f32 * 0.01).sin()
}

fn zero(comm: &Communicator, stage: usize) -> Result<(), Outcome> {
    let stage = match stage {
        1 => ZeroStage::One,
        2 => ZeroStage::Two,
        other => return Err(Outcome::Wrong(format!("no ZeRO stage {other}"))),
    };
    let (lr, momentum) = (0.05, 0.9);
    let specs: Vec<ParamSpec> = LENS
        .iter()
        .enumerate()
        .map(|(i, &len)| ParamSpec::new(format!("p{i}"), len, DType::F32))
        .collect();
    let initial: Vec<Vec<f32>> = LENS
        .iter()
        .enumerate()
        .map(|(i, &len)| (0..len).map(|j| ((i * 31 + j) % 17) as f32 * 0.1).collect())
        .collect();
    let caps = (1.0 / 1024.0, 2.0 / 1024.0);
    // Plain DDP with SGD and momentum, as `train` steps.
    let options = DdpOptions {
        first_bucket_cap_mb: caps.0,
        bucket_cap_mb: caps.1,
        ..DdpOptions::default()
    };
    let mut ddp = Ddp::new(comm, specs.clone(), options)?;
    let mut want = initial.clone();
    let mut velocity: Vec<Vec<f32>> = LENS.iter().map(|&len| vec![0.0; len]).collect();
    for step in 0..STEPS {
        ddp.zero_grad()?;
        for i in (0..LENS.len()).rev() {
            let g = ddp.grad_mut::<f32>(i)?;
            for (j, (g, &p)) in g.iter_mut().zip(&want[i]).enumerate() {
                *g = grad(comm.rank(), step, i, j, p);
            }
            ddp.mark_ready(i)?;
        }
        ddp.finish()?;
        for (i, (p, v)) in want.iter_mut().zip(&mut velocity).enumerate() {
            for ((p, v), &g) in p.iter_mut().zip(v.iter_mut()).zip(ddp.grad::<f32>(i)?) {
                *v = momentum * *v + g;
                *p -= lr * *v;
            }
        }
    }
    let mut options = ZeroOptions::new(stage, lr, momentum);
    (options.first_bucket_cap_mb, options.bucket_cap_mb) = caps;
    let mut zero = Zero::new(comm, specs, options)?;
    if zero.buckets() != ddp.buckets() {
        return Err(Outcome::Wrong("ZeRO's buckets differ from DDP's".into()));
    }
    let mut got = initial;
    for step in 0..STEPS {
        for i in (0..LENS.len()).rev() {
            let g = zero.grad_mut(i)?;
            for (j, (g, &p)) in g.iter_mut().zip(&got[i]).enumerate() {
                *g = grad(comm.rank(), step, i, j, p);
            }
            zero.mark_ready(i)?;
        }
        let mut views: Vec<&mut [f32]> = got.iter_mut().map(|p| &mut p[..]).collect();
        zero.step(&mut views)?;
    }
    compare("ZeRO parameters against DDP", &got, &want)?;
    let memory = zero.memory();
    let total: usize = LENS.iter().sum::<usize>() * 4;
    if memory.params != total
        || memory.optimizer * comm.world_size() > total + 64 * comm.world_size()
    {
        return Err(Outcome::Wrong(format!(
            "memory {memory:?} for {total} bytes of parameters"
        )));
    }
    println!(
        "zero ok: params {} grads {} optimizer {} bytes",
        memory.params, memory.grads, memory.optimizer
    );
    Ok(())
}
