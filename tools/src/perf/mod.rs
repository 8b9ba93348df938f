//! The nccl-tests-style measuring harness shared by every `*_perf` binary:
//! flags, size sweep, timing, the correctness check, the table and its files.

pub mod args;
pub mod buffer;
pub mod collective;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod plot;
pub mod report;

use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime};

use chorus::{env, Communicator, Config, ReduceOp};

pub use args::{Args, Average};
use buffer::Buffer;
pub use chorus::env::parse_size;
use collective::{Bufs, Shape};
pub use collective::{
    Collective, Layout, Params, ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BARRIER, BROADCAST, REDUCE,
    REDUCE_SCATTER, SEND_RECV,
};
use report::{Device, Row, Timing};

/// The main of a perf binary: starts local ranks for `-np`, or runs as one rank.
pub fn main(collective: &Collective) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env(env::CHORUS_DEBUG))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::from_env();
    let program = program_name();
    let result = args
        .check_op(collective.reduces())
        .and_then(|()| args.check_device(collective.name))
        .and_then(|()| match args.np {
            Some(np) if std::env::var_os(env::RANK).is_none() => spawn_ranks(&args, np),
            _ => run_rank(collective, &args, &program),
        });
    crate::finish(&program, result)
}

/// This program's file name, e.g. "allreduce_perf".
fn program_name() -> String {
    std::env::args_os()
        .next()
        .map(std::path::PathBuf::from)
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "perf".into())
}

/// Starts `np` copies of this program on this host, each one rank (without `-np`); rank 0's
/// output is shown.
fn spawn_ranks(args: &Args, np: usize) -> Result<(), String> {
    let forwarded = args::strip_np(std::env::args_os().skip(1).collect());
    chorus_launch::run_copies(np, forwarded, Duration::from_secs(args.job_timeout))
        .map_err(|e| e.to_string())
}

/// One rank's run: every root and size, timed and checked, with the table on rank 0.
fn run_rank(collective: &Collective, args: &Args, program: &str) -> Result<(), String> {
    let start = SystemTime::now();
    let sizes = match collective.shape {
        Shape::Empty => vec![0],
        _ => args.sizes()?,
    };
    if args.iters == 0 || args.agg_iters == 0 {
        return Err("-n and -m must be at least 1".into());
    }
    let comm = communicator(args)?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let roots = if collective.rooted {
        args.roots(world)?
    } else {
        vec![0]
    };
    let devices = gather_devices(&comm)?;
    if rank == 0 {
        print!("{}", report::banner(program, args, &devices));
        print!("{}", report::column_header());
    }
    let elem = args.dtype.size();
    let largest = sizes
        .iter()
        .map(|&s| Layout::new(collective.shape, s / elem, elem, world))
        .fold(0, |m, l| m.max(l.size()))
        * elem;
    let make = |len| match args.register {
        0 => Ok(Buffer::zeroed(len, args.hugepages)),
        _ => Buffer::shared(&comm, len),
    };
    let mut bufs = Bench {
        input: make(largest)?,
        output: make(largest)?,
        scratch: Buffer::default(),
        #[cfg(feature = "cuda")]
        gpu: match args.device {
            args::Device::Cuda => Some(gpu::Gpu::new(&comm, largest, args.ngpus as usize)?),
            args::Device::Cpu => None,
        },
    };
    #[cfg(feature = "cuda")]
    if let (Some(gpu), 0) = (&bufs.gpu, rank) {
        println!("#  Buffers on the GPU: rank 0 on {}", gpu.describe());
    }
    let mut rows = Vec::new();
    for &root in &roots {
        let p = Params {
            dtype: args.dtype,
            op: args.op,
            root,
        };
        let cycles = (0..args.run_cycles).flat_map(|_| &sizes);
        for &size in cycles {
            let layout = Layout::new(collective.shape, size / elem, elem, world);
            let input = bufs.input.bytes_mut(layout.send * elem);
            collective.fill_input(p, &layout, rank, world, input);
            let mut timings = [None, None];
            for (slot, in_place) in timings.iter_mut().zip([false, true]) {
                let (seconds, wrong) =
                    measure(collective, &comm, args, p, &layout, &mut bufs, in_place)?;
                let algbw = if seconds.wall > 0.0 {
                    (layout.size() * elem) as f64 / seconds.wall / 1e9
                } else {
                    0.0
                };
                let time = if args.report_cputime {
                    seconds.cpu
                } else {
                    seconds.wall
                };
                *slot = Some(Timing {
                    time_us: time * 1e6,
                    algbw,
                    busbw: algbw * (collective.bus_factor)(world * bufs.gpus()),
                    wrong,
                });
            }
            let [Some(out_of_place), Some(in_place)] = timings else {
                unreachable!("both columns are measured")
            };
            let row = Row {
                size: layout.size() * elem,
                count: layout.block,
                dtype: args.dtype.name(),
                redop: if collective.reduces() {
                    args.op.name()
                } else {
                    "none"
                },
                root: if collective.rooted { root as i64 } else { -1 },
                out_of_place,
                in_place,
            };
            if rank == 0 {
                println!("{}", report::row_line(&row));
            }
            rows.push(row);
        }
    }
    let wrong: u64 = rows
        .iter()
        .flat_map(|r| [r.out_of_place.wrong, r.in_place.wrong])
        .map(|w| w.unwrap_or(0))
        .sum();
    if rank == 0 {
        print!(
            "{}",
            report::footer(program, wrong, report::average_busbw(&rows))
        );
        if let Some(path) = &args.json {
            report::write_json(path, &report::json(program, args, &devices, &rows, start))?;
        }
        if let Some(path) = &args.plot {
            let title = format!("{program}: {world} ranks, {}", args.dtype.name());
            plot::draw(path, &title, &rows)?;
        }
    }
    if wrong > 0 {
        return Err(format!("{wrong} wrong values"));
    }
    Ok(())
}

/// Joins the job the environment describes, with `-T` (if given) as its timeout.
fn communicator(args: &Args) -> Result<Communicator, String> {
    let timeout = args.comm_timeout().map(|t| t.as_secs().to_string());
    Config::from_lookup(|name| match &timeout {
        Some(t) if name == env::CHORUS_TIMEOUT => Some(t.clone()),
        _ => std::env::var(name).ok(),
    })
    .and_then(Communicator::new)
    .map_err(|e| e.to_string())
}

/// The time one operation took, combined over ranks as `-a` says.
struct Seconds {
    /// Elapsed.
    wall: f64,
    /// CPU time of the whole process, all its threads.
    cpu: f64,
}

/// The buffers of one rank's run.
struct Bench {
    input: Buffer,
    output: Buffer,
    scratch: Buffer,
    /// With `--device cuda`, the GPU the calls run on (the host buffers then hold the
    /// input before it is loaded and the result after it is stored).
    #[cfg(feature = "cuda")]
    gpu: Option<gpu::Gpu>,
}

impl Bench {
    /// The participants this rank holds: its GPUs with `-g`, else 1.
    fn gpus(&self) -> usize {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.gpu {
            return gpu.count();
        }
        1
    }

    /// Copies the prepared host buffers to GPU `_i`, where the calls run on GPUs.
    fn load(&mut self, _i: usize, _input_len: usize, _output_len: usize) -> Result<(), String> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &mut self.gpu {
            gpu.load(
                _i,
                self.input.bytes(_input_len),
                self.output.bytes(_output_len),
            )?;
        }
        Ok(())
    }

    /// Copies GPU `_i`'s result into the host output buffer, where the calls run on GPUs.
    fn store(&mut self, _i: usize, _output_len: usize) -> Result<(), String> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &mut self.gpu {
            gpu.store(_i, self.output.bytes_mut(_output_len))?;
        }
        Ok(())
    }

    /// Runs one operation on the host buffers, or on the device's.
    fn once(
        &mut self,
        collective: &Collective,
        comm: &Communicator,
        call: (&Layout, Params),
        (input_len, output_len, in_place): (usize, usize, bool),
    ) -> chorus::Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &mut self.gpu {
            return gpu.once(collective, call.0, call.1, in_place);
        }
        let output = self.output.bytes_mut(output_len);
        let b = if in_place {
            Bufs::InPlace {
                buf: output,
                scratch: &mut self.scratch,
            }
        } else {
            Bufs::Apart {
                input: self.input.bytes(input_len),
                output,
            }
        };
        (collective.run)(comm, b, call.1)
    }
}

/// Times `-n` iterations of `-m` operations after `-w` warm-up ones, then checks `-c` times.
///
/// Returns the time per operation and the wrong elements over all ranks.
fn measure(
    collective: &Collective,
    comm: &Communicator,
    args: &Args,
    p: Params,
    layout: &Layout,
    bufs: &mut Bench,
    in_place: bool,
) -> Result<(Seconds, Option<u64>), String> {
    let err = |e: chorus::Error| e.to_string();
    let (rank, world, elem) = (comm.rank(), comm.world_size(), p.dtype.size());
    let input_len = layout.send * elem;
    let output_len = if in_place { layout.size() } else { layout.recv } * elem;
    // With `-g`, every GPU of every rank is a participant, numbered as nccl-tests does.
    let gpus = bufs.gpus();
    let everyone = world * gpus;
    let participant = |i: usize| {
        let root = p.root * gpus;
        (rank * gpus + i, Params { root, ..p })
    };
    // Puts participant `i`'s input where an in-place call expects it, and on its GPU if
    // the calls run on GPUs (filling it first where a rank holds several participants).
    let prepare = |bufs: &mut Bench, i: usize| {
        let (me, p) = participant(i);
        if gpus > 1 {
            collective.fill_input(p, layout, me, everyone, bufs.input.bytes_mut(input_len));
        }
        if in_place {
            let at = collective.in_place_input(layout, rank) * elem;
            let (input, output) = (&bufs.input, &mut bufs.output);
            output.bytes_mut(output_len)[at..at + input_len]
                .copy_from_slice(input.bytes(input_len));
        }
        bufs.load(i, input_len, output_len)
    };
    let call = (layout, p);
    let lens = (input_len, output_len, in_place);
    (0..gpus).try_for_each(|i| prepare(bufs, i))?;
    for _ in 0..args.warmup {
        bufs.once(collective, comm, call, lens).map_err(err)?;
    }
    comm.barrier().map_err(err)?;
    let ops = (args.iters * args.agg_iters) as f64;
    let (start, start_cpu) = (
        Instant::now(),
        crate::cpu_seconds(libc::CLOCK_PROCESS_CPUTIME_ID),
    );
    for _ in 0..args.iters * args.agg_iters {
        bufs.once(collective, comm, call, lens).map_err(err)?;
    }
    let mine = [
        start.elapsed().as_secs_f64() / ops,
        (crate::cpu_seconds(libc::CLOCK_PROCESS_CPUTIME_ID) - start_cpu) / ops,
    ];
    let [wall, cpu] = combine_times(comm, mine, args.average).map_err(err)?;
    let seconds = Seconds { wall, cpu };
    if args.check == 0 {
        return Ok((seconds, None));
    }
    let result = if in_place {
        collective.in_place_output(layout, rank)
    } else {
        0..layout.recv
    };
    let mut wrong = [0u64];
    for _ in 0..args.check {
        // Stale results from the timed runs must not pass for fresh ones.
        for i in 0..gpus {
            bufs.output.bytes_mut(output_len).fill(0xa5);
            prepare(bufs, i)?;
        }
        bufs.once(collective, comm, call, lens).map_err(err)?;
        wrong[0] = 0;
        for i in 0..gpus {
            bufs.store(i, output_len)?;
            let region = &bufs.output.bytes(output_len)[result.start * elem..result.end * elem];
            let (me, p) = participant(i);
            wrong[0] += collective.count_wrong(p, layout, me, everyone, region) as u64;
        }
        comm.all_reduce(&mut wrong, ReduceOp::Sum).map_err(err)?;
        if wrong[0] > 0 {
            break;
        }
    }
    Ok((seconds, Some(wrong[0])))
}

/// Combines the ranks' times as `-a` asks.
fn combine_times(
    comm: &Communicator,
    mine: [f64; 2],
    average: Average,
) -> chorus::Result<[f64; 2]> {
    let mut t = mine;
    match average {
        Average::RankZero => comm.broadcast(&mut t, 0)?,
        Average::Mean => comm.all_reduce(&mut t, ReduceOp::Avg)?,
        Average::Min => comm.all_reduce(&mut t, ReduceOp::Min)?,
        Average::Max => comm.all_reduce(&mut t, ReduceOp::Max)?,
    }
    Ok(t)
}

/// Bytes of one rank's record in the device list: pid, name length, name.
const DEVICE_RECORD: usize = 72;

/// Every rank's pid and host name, in rank order.
fn gather_devices(comm: &Communicator) -> Result<Vec<Device>, String> {
    let mut mine = [0u8; DEVICE_RECORD];
    let host = chorus::hostname();
    let name = &host.as_bytes()[..host.len().min(DEVICE_RECORD - 5)];
    mine[..4].copy_from_slice(&std::process::id().to_le_bytes());
    mine[4] = name.len() as u8;
    mine[5..5 + name.len()].copy_from_slice(name);
    let mut all = vec![0u8; DEVICE_RECORD * comm.world_size()];
    comm.all_gather(&mine, &mut all)
        .map_err(|e| e.to_string())?;
    Ok(all
        .chunks_exact(DEVICE_RECORD)
        .enumerate()
        .map(|(rank, r)| Device {
            rank,
            pid: u32::from_le_bytes([r[0], r[1], r[2], r[3]]),
            hostname: String::from_utf8_lossy(&r[5..5 + r[4] as usize]).into_owned(),
        })
        .collect())
}
