//! The nccl-tests-style measuring harness: flags, size sweep, timing, the
//! correctness check and the table, shared by every `*_perf` binary.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use chorus::launch::{launch, LaunchSpec, Output};
use chorus::{pattern, Communicator, DType, ReduceOp};
use clap::Parser;

/// Flags shared by the perf tools (the names and meanings of nccl-tests).
#[derive(Debug, Clone, Parser)]
#[command(version, about)]
pub struct Args {
    /// Smallest size in bytes (suffixes K, M, G).
    #[arg(short = 'b', long = "minbytes", default_value = "32M", value_parser = parse_size)]
    pub min_bytes: usize,
    /// Largest size in bytes (suffixes K, M, G).
    #[arg(short = 'e', long = "maxbytes", default_value = "32M", value_parser = parse_size)]
    pub max_bytes: usize,
    /// Multiply the size by this factor between steps.
    #[arg(short = 'f', long = "stepfactor")]
    pub step_factor: Option<usize>,
    /// Add this many bytes between steps (instead of -f).
    #[arg(short = 'i', long = "stepbytes", value_parser = parse_size)]
    pub step_bytes: Option<usize>,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    pub iters: usize,
    /// Untimed warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    pub warmup: usize,
    /// Check results (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    pub check: u8,
    /// Reduction operator: sum, prod, min, max, avg.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub op: ReduceOp,
    /// Data type: float, double, half, bfloat16, int8, uint8, int32, uint32, int64, uint64.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    pub dtype: DType,
    /// Start this many local ranks (`-np W`); without it, run as one rank of an existing job.
    #[arg(long = "np")]
    pub np: Option<usize>,
    /// Whole-job time limit in seconds when starting ranks with -np.
    #[arg(long = "job-timeout", default_value_t = 3600)]
    pub job_timeout: u64,
}

/// Parses `8`, `64K`, `256M`, `1G` (powers of 1024).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (digits, shift) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 10),
        Some('M') => (&s[..s.len() - 1], 20),
        Some('G') => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    let n: usize = digits.parse().map_err(|e| format!("bad size '{s}': {e}"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("size '{s}' is too large"))
}

impl Args {
    /// Parses the process's arguments, accepting mpirun-style `-np W`.
    pub fn from_env() -> Args {
        let argv = std::env::args_os().map(|a| {
            if a == "-np" {
                OsString::from("--np")
            } else {
                a
            }
        });
        Args::parse_from(argv)
    }

    /// The sizes to measure, in bytes, each a whole number of elements.
    ///
    /// Fails if the range or step is invalid.
    pub fn sizes(&self) -> Result<Vec<usize>, String> {
        if self.min_bytes > self.max_bytes {
            return Err(format!(
                "-b {} is larger than -e {}",
                self.min_bytes, self.max_bytes
            ));
        }
        let mut sizes = Vec::new();
        let mut size = self.min_bytes;
        loop {
            sizes.push(size / self.dtype.size() * self.dtype.size());
            let next = match (self.step_bytes, self.step_factor) {
                (Some(step), _) if step > 0 => size + step,
                (Some(_), _) => return Err("-i must be positive".into()),
                (None, Some(f)) if f > 1 => size * f,
                (None, Some(_)) => return Err("-f must be at least 2".into()),
                (None, None) => size * 2,
            };
            if next > self.max_bytes || self.min_bytes == self.max_bytes {
                return Ok(sizes);
            }
            size = next;
        }
    }
}

/// Runs one operation: communicator, input (`None` in place), output, type, operator.
pub type RunFn = fn(&Communicator, Option<&[u8]>, &mut [u8], DType, ReduceOp) -> chorus::Result<()>;

/// What a perf binary measures: its name, nccl-tests' bus-bandwidth factor,
/// and how to run one operation.
pub struct Collective {
    /// Shown in the banner, e.g. "all_reduce".
    pub name: &'static str,
    /// busbw = algbw * factor(world_size).
    pub bus_factor: fn(usize) -> f64,
    /// Runs the operation; `input` is `None` in place.
    pub run: RunFn,
}

/// The all-reduce: busbw = algbw * 2(W-1)/W.
pub const ALL_REDUCE: Collective = Collective {
    name: "all_reduce",
    bus_factor: |w| 2.0 * (w as f64 - 1.0) / w as f64,
    run: |comm, input, output, dtype, op| comm.all_reduce_bytes(input, output, dtype, op),
};

/// The main of a perf binary: starts local ranks for `-np`, or runs as one rank.
pub fn main(collective: &Collective) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("CHORUS_DEBUG"))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::from_env();
    let result = match args.np {
        Some(np) if std::env::var_os("RANK").is_none() => spawn_ranks(&args, np),
        _ => run_rank(collective, &args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}: {e}", collective.name);
            ExitCode::FAILURE
        }
    }
}

/// Starts `np` copies of this program on this host, each one rank; rank 0's output is shown.
fn spawn_ranks(args: &Args, np: usize) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let forwarded: Vec<OsString> = strip_np(std::env::args_os().skip(1).collect());
    let spec = LaunchSpec::new(exe, np)
        .args(forwarded)
        .output(Output::RankZero)
        .timeout(Duration::from_secs(args.job_timeout));
    let report = launch(&spec).map_err(|e| e.to_string())?;
    if report.success() {
        return Ok(());
    }
    if let Some(failed) = report.first_failure() {
        eprintln!(
            "--- rank {} stderr:\n{}",
            failed.rank,
            failed.stderr.trim_end()
        );
    }
    Err(report.summary())
}

/// Removes `-np W` / `--np W` / `--np=W` from an argument list.
fn strip_np(args: Vec<OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        if a == "-np" || a == "--np" {
            it.next();
        } else if !a.to_string_lossy().starts_with("--np=") {
            out.push(a);
        }
    }
    out
}

/// One rank's run: the sweep, timed and checked, with the table on rank 0.
fn run_rank(collective: &Collective, args: &Args) -> Result<(), String> {
    let sizes = args.sizes()?;
    let comm = Communicator::from_env().map_err(|e| e.to_string())?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let max = sizes.iter().copied().max().unwrap_or(0);
    let mut input = vec![0u8; max];
    let mut output = vec![0u8; max];
    pattern::fill(args.dtype, rank, args.op, &mut input);
    if rank == 0 {
        print_header(collective, args, world);
    }
    let mut bus_sum = 0.0;
    let mut wrong_total = 0;
    for &size in &sizes {
        let mut cols = Vec::new();
        for in_place in [false, true] {
            let m = measure(
                collective,
                &comm,
                args,
                &input[..size],
                &mut output[..size],
                in_place,
            )?;
            let algbw = size as f64 / m.seconds / 1e9;
            let busbw = algbw * (collective.bus_factor)(world);
            if !in_place {
                bus_sum += busbw;
            }
            wrong_total += m.wrong.unwrap_or(0);
            cols.push(format!(
                "{:>8} {:>7.2} {:>7.2} {:>6}",
                format_time(m.seconds * 1e6),
                algbw,
                busbw,
                m.wrong.map_or("N/A".to_string(), |w| w.to_string())
            ));
        }
        if rank == 0 {
            let count = size / args.dtype.size();
            println!(
                "{size:>12} {count:>12} {:>9} {:>7} {:>7}   {}   {}",
                args.dtype.name(),
                args.op.name(),
                -1,
                cols[0],
                cols[1]
            );
        }
    }
    if rank == 0 {
        println!(
            "# Out of bounds values : {wrong_total} {}",
            if wrong_total == 0 { "OK" } else { "FAILED" }
        );
        println!(
            "# Avg bus bandwidth    : {:.4} ",
            bus_sum / sizes.len() as f64
        );
        println!("#");
    }
    if wrong_total > 0 {
        return Err(format!("{wrong_total} wrong values"));
    }
    Ok(())
}

struct Measurement {
    /// Mean time per operation, averaged over ranks.
    seconds: f64,
    /// Wrong elements (summed over ranks), if checked.
    wrong: Option<usize>,
}

fn measure(
    collective: &Collective,
    comm: &Communicator,
    args: &Args,
    input: &[u8],
    output: &mut [u8],
    in_place: bool,
) -> Result<Measurement, String> {
    let err = |e: chorus::Error| e.to_string();
    let (dtype, op) = (args.dtype, args.op);
    let once = |output: &mut [u8]| -> Result<(), String> {
        if in_place {
            (collective.run)(comm, None, output, dtype, op).map_err(err)
        } else {
            (collective.run)(comm, Some(input), output, dtype, op).map_err(err)
        }
    };
    if in_place {
        output.copy_from_slice(input);
    }
    for _ in 0..args.warmup {
        once(output)?;
    }
    comm.barrier().map_err(err)?;
    let start = Instant::now();
    for _ in 0..args.iters {
        once(output)?;
    }
    let elapsed = start.elapsed().as_secs_f64() / args.iters.max(1) as f64;
    // Average the time over ranks, as nccl-tests does by default.
    let mut t = [elapsed];
    comm.all_reduce(&mut t, ReduceOp::Avg).map_err(err)?;
    let wrong = if args.check != 0 {
        if in_place {
            output.copy_from_slice(input);
        }
        once(output)?;
        let mut wrong = [pattern::count_wrong(dtype, comm.world_size(), op, output) as u64];
        comm.all_reduce(&mut wrong, ReduceOp::Sum).map_err(err)?;
        Some(wrong[0] as usize)
    } else {
        None
    };
    Ok(Measurement {
        seconds: t[0],
        wrong,
    })
}

fn format_time(us: f64) -> String {
    if us >= 10_000.0 {
        format!("{us:.0}")
    } else {
        format!("{us:.2}")
    }
}

fn print_header(collective: &Collective, args: &Args, world: usize) {
    println!(
        "# Chorus {} perf: minBytes {} maxBytes {} step: {} warmup iters: {} iters: {} validation: {}",
        collective.name,
        args.min_bytes,
        args.max_bytes,
        match (args.step_bytes, args.step_factor) {
            (Some(i), _) => format!("{i}(bytes)"),
            (None, f) => format!("{}(factor)", f.unwrap_or(2)),
        },
        args.warmup,
        args.iters,
        args.check
    );
    println!("#");
    println!("# Using devices");
    println!(
        "#  {world} ranks on {} (host memory, TCP)",
        chorus::hostname()
    );
    println!("#");
    println!(
        "# {:>10} {:>12} {:>9} {:>7} {:>7}   {:>8} {:>7} {:>7} {:>6}   {:>8} {:>7} {:>7} {:>6}",
        "", "", "", "", "", "out-of-place", "", "", "", "in-place", "", "", ""
    );
    println!(
        "# {:>10} {:>12} {:>9} {:>7} {:>7}   {:>8} {:>7} {:>7} {:>6}   {:>8} {:>7} {:>7} {:>6}",
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "time",
        "algbw",
        "busbw",
        "#wrong"
    );
    println!(
        "# {:>10} {:>12} {:>9} {:>7} {:>7}   {:>8} {:>7} {:>7} {:>6}   {:>8} {:>7} {:>7} {:>6}",
        "(B)",
        "(elements)",
        "",
        "",
        "",
        "(us)",
        "(GB/s)",
        "(GB/s)",
        "",
        "(us)",
        "(GB/s)",
        "(GB/s)",
        ""
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("256m"), Ok(256 << 20));
        assert!(parse_size("lots").is_err());
    }

    #[test]
    fn sweep_follows_the_factor_or_the_step() {
        let args = Args::parse_from(["x", "-b", "8", "-e", "128", "-f", "2"]);
        assert_eq!(args.sizes().unwrap(), vec![8, 16, 32, 64, 128]);
        let args = Args::parse_from(["x", "-b", "8", "-e", "30", "-i", "10", "-d", "double"]);
        assert_eq!(args.sizes().unwrap(), vec![8, 16, 24]);
        let args = Args::parse_from(["x", "-b", "64", "-e", "8"]);
        assert!(args.sizes().is_err());
    }

    #[test]
    fn np_is_stripped_for_the_workers() {
        let args: Vec<OsString> = ["-b", "8", "-np", "4", "--np=2", "-c", "1"]
            .iter()
            .map(OsString::from)
            .collect();
        let want: Vec<OsString> = ["-b", "8", "-c", "1"].iter().map(OsString::from).collect();
        assert_eq!(strip_np(args), want);
    }
}
