//! The perf tools' flags: nccl-tests' names and meanings, plus `-np`, `--plot` and `--device`.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use chorus::env::parse_size;
use chorus::{DType, ReduceOp};
use clap::{ArgAction, Parser, ValueEnum};

/// How the per-rank times of one measurement become the reported time (`-a`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Average {
    /// Rank 0's time (`-a 0`).
    RankZero,
    /// The mean over ranks (`-a 1`, the default).
    Mean,
    /// The fastest rank's time (`-a 2`).
    Min,
    /// The slowest rank's time (`-a 3`).
    Max,
}

fn parse_average(s: &str) -> Result<Average, String> {
    match s.trim() {
        "0" => Ok(Average::RankZero),
        "1" => Ok(Average::Mean),
        "2" => Ok(Average::Min),
        "3" => Ok(Average::Max),
        _ => Err(format!(
            "bad -a '{s}': expected 0 (rank 0), 1 (average), 2 (min) or 3 (max)"
        )),
    }
}

/// Where the measured buffers live, or where `train` runs (`--device`). [`Args::check_device`]
/// refuses `Cuda` in a build without the `cuda` feature.
///
/// Not to be confused with [`report::Device`](super::report::Device), a rank's line under
/// "Using devices".
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// Host memory (the default).
    Cpu,
    /// CUDA device memory (needs the `cuda` feature).
    Cuda,
}

/// Longest `-T`, in seconds: a year, the bound Chorus puts on `CHORUS_TIMEOUT`.
const MAX_TIMEOUT_SECS: u64 = 365 * 24 * 3600;

/// Parses a whole number given to `flag`.
fn number(flag: &str, s: &str) -> Result<u64, String> {
    s.trim()
        .parse()
        .map_err(|e| format!("bad {flag} '{s}': {e}"))
}

/// A parser for an nccl-tests switch: `0` or `1`.
fn switch(flag: &'static str) -> impl Fn(&str) -> Result<bool, String> + Clone + Send + Sync {
    move |s| match s.trim() {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(format!("bad {flag} '{s}': expected 0 or 1")),
    }
}

fn parse_ngpus(s: &str) -> Result<u64, String> {
    match number("-g", s)? {
        0 => Err("bad -g '0': a process drives at least one GPU".into()),
        n => Ok(n),
    }
}

fn parse_nthreads(s: &str) -> Result<u64, String> {
    match number("-t", s)? {
        1 => Ok(1),
        n => Err(format!(
            "-t {n}: Chorus runs one rank per process, on one thread, so -t is 1; \
             start more processes with -np instead"
        )),
    }
}

fn parse_cudagraph(s: &str) -> Result<u64, String> {
    match number("-G", s)? {
        0 => Ok(0),
        n => Err(format!(
            "-G {n}: Chorus has no CUDA graph capture, so -G is 0"
        )),
    }
}

fn parse_timeout(s: &str) -> Result<u64, String> {
    match number("-T", s)? {
        t if t <= MAX_TIMEOUT_SECS => Ok(t),
        t => Err(format!(
            "-T {t}: at most {MAX_TIMEOUT_SECS} seconds (a year); 0 keeps the default"
        )),
    }
}

fn parse_run_cycles(s: &str) -> Result<u64, String> {
    match number("-N", s)? {
        0 => Err(
            "-N 0 (run forever) is not supported here: give a number of sweeps, at least 1".into(),
        ),
        n => Ok(n),
    }
}

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
    /// Operations per timed iteration (Chorus calls block, so they run back to back).
    #[arg(short = 'm', long = "agg_iters", default_value_t = 1)]
    pub agg_iters: usize,
    /// Untimed warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    pub warmup: usize,
    /// Check results this many times per size (0: no check).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    pub check: u32,
    /// Reduction operator: sum, prod, min, max, avg; band, bor, bxor (integer types only).
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub op: ReduceOp,
    /// Data type: float, double, half, bfloat16, int8, uint8, int32, uint32, int64, uint64.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    pub dtype: DType,
    /// Root of rooted collectives; -1 measures every rank as root in turn.
    #[arg(
        short = 'r',
        long = "root",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    pub root: i64,
    /// Reported time: 0 rank 0's, 1 the average over ranks, 2 the minimum, 3 the maximum.
    #[arg(short = 'a', long = "average", default_value = "1", value_parser = parse_average)]
    pub average: Average,
    /// Also write the results as JSON (nccl-tests' layout) to this file.
    #[arg(short = 'J', long = "output_file")]
    pub json: Option<PathBuf>,
    /// Buffer registration (nccl-tests' `-R`): 0 private buffers; 1 or 2 buffers
    /// every rank maps (`alloc_shared`), which all-reduce and broadcast on one host
    /// read and write directly.
    #[arg(short = 'R', long = "local_register", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub register: u8,
    /// Private buffers on transparent huge pages (`madvise(MADV_HUGEPAGE)`), as numpy
    /// allocates its arrays; kernel copies between processes run about twice as fast on them.
    #[arg(long = "hugepages")]
    pub hugepages: bool,
    /// Draw bus bandwidth and time against size into this PNG file.
    #[arg(long = "plot")]
    pub plot: Option<PathBuf>,
    /// GPUs per process: above 1, each rank's calls take one buffer per GPU (`--device cuda`;
    /// all_reduce and broadcast).
    #[arg(short = 'g', long = "ngpus", default_value = "1", value_parser = parse_ngpus)]
    pub ngpus: u64,
    /// Threads per process: 1, as Chorus runs one rank per process (start more with -np).
    #[arg(short = 't', long = "nthreads", default_value = "1", value_parser = parse_nthreads)]
    pub nthreads: u64,
    /// Wait for each operation before the next (0 or 1): every Chorus call already blocks
    /// until it is done, so both run alike.
    #[arg(short = 'z', long = "blocking", default_value = "0", value_parser = switch("-z"), action = ArgAction::Set)]
    pub blocking: bool,
    /// CUDA graph launches: 0, as Chorus has no CUDA graph capture.
    #[arg(short = 'G', long = "cudagraph", default_value = "0", value_parser = parse_cudagraph)]
    pub cudagraph: u64,
    /// Bound on every wait of the communicator, in seconds, as `CHORUS_TIMEOUT` (which it
    /// overrides); 0 keeps the default.
    #[arg(short = 'T', long = "timeout", default_value = "0", value_parser = parse_timeout)]
    pub timeout: u64,
    /// Run the whole sweep this many times, printing each row every time.
    #[arg(short = 'N', long = "run_cycles", default_value = "1", value_parser = parse_run_cycles)]
    pub run_cycles: u64,
    /// Report the process's CPU time per operation (all its threads) in the time columns
    /// instead of the elapsed time (0 or 1); the bandwidths stay from the elapsed time.
    #[arg(short = 'C', long = "report_cputime", default_value = "0", value_parser = switch("-C"), action = ArgAction::Set)]
    pub report_cputime: bool,
    /// Initialise in parallel (0 or 1): the ranks, one per process, always do, so both run alike.
    #[arg(short = 'p', long = "parallel_init", default_value = "0", value_parser = switch("-p"), action = ArgAction::Set)]
    pub parallel_init: bool,
    /// Where the buffers live: `cpu` (host memory) or `cuda` (device memory; needs the `cuda`
    /// feature).
    #[arg(long = "device", value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// Start this many local ranks (`-np W`); without it, run as one rank of an existing job.
    #[arg(long = "np")]
    pub np: Option<usize>,
    /// Whole-job time limit in seconds when starting ranks with -np.
    #[arg(long = "job-timeout", default_value_t = 3600)]
    pub job_timeout: u64,
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

    /// Fails when `-o` is not defined on `-d` (a bitwise operator on a float type) and the
    /// collective reduces; the others ignore `-o`.
    pub fn check_op(&self, reduces: bool) -> Result<(), String> {
        if reduces && !self.op.applies_to(self.dtype) {
            return Err(format!(
                "-o {} needs an integer -d (int8, uint8, int32, uint32, int64 or uint64), not {}",
                self.op, self.dtype
            ));
        }
        Ok(())
    }

    /// Fails for a `--device` these tools cannot measure on, or a `-g` above 1 where the
    /// calls cannot take one buffer per GPU (`collective`: the tool's collective).
    pub fn check_device(&self, collective: &str) -> Result<(), String> {
        match self.device {
            Device::Cpu if self.ngpus > 1 => {
                return Err(format!(
                    "-g {0}: several GPUs per process need --device cuda (or start {0} processes with -np {0})",
                    self.ngpus
                ))
            }
            Device::Cuda if !cfg!(feature = "cuda") => {
                return Err(
                    "`--device cuda` needs the perf tools built with the `cuda` feature".into(),
                )
            }
            _ => {}
        }
        if self.ngpus > 1 && !matches!(collective, "all_reduce" | "broadcast") {
            return Err(format!(
                "-g {}: {collective} takes one GPU per process; one buffer per GPU is measured for all_reduce and broadcast",
                self.ngpus
            ));
        }
        Ok(())
    }

    /// The communicator's timeout `-T` asks for; `None` for `-T 0` (keep the default).
    pub fn comm_timeout(&self) -> Option<Duration> {
        (self.timeout > 0).then(|| Duration::from_secs(self.timeout))
    }

    /// The sizes to measure, in bytes, as nccl-tests steps them.
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
            sizes.push(size);
            let next = match (self.step_bytes, self.step_factor) {
                (Some(step), _) if step > 0 => size + step,
                (Some(_), _) => return Err("-i must be positive".into()),
                (None, Some(f)) if f > 1 => size * f,
                (None, Some(_)) => return Err("-f must be at least 2".into()),
                (None, None) => size * 2,
            };
            if next > self.max_bytes || next <= size {
                return Ok(sizes);
            }
            size = next;
        }
    }

    /// The roots to measure for a rooted collective over `world` ranks (`-r`).
    ///
    /// Fails if `-r` names no rank.
    pub fn roots(&self, world: usize) -> Result<Vec<usize>, String> {
        match usize::try_from(self.root) {
            Ok(r) if r < world => Ok(vec![r]),
            _ if self.root == -1 => Ok((0..world).collect()),
            _ => Err(format!(
                "-r {} is not a rank of this {world}-rank job (use 0..{} or -1 for every root)",
                self.root,
                world - 1
            )),
        }
    }

    /// The step as nccl-tests' banner shows it: `2(factor)` or `1024(bytes)`.
    pub fn step_label(&self) -> String {
        match (self.step_bytes, self.step_factor) {
            (Some(i), _) => format!("{i}(bytes)"),
            (None, f) => format!("{}(factor)", f.unwrap_or(2)),
        }
    }
}

/// Removes `-np W` / `--np W` / `--np=W` from an argument list.
pub fn strip_np(args: Vec<OsString>) -> Vec<OsString> {
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
        let args = Args::parse_from(["x", "-b", "8", "-e", "30", "-i", "10"]);
        assert_eq!(args.sizes().unwrap(), vec![8, 18, 28]);
        let args = Args::parse_from(["x", "-b", "0", "-e", "0"]);
        assert_eq!(args.sizes().unwrap(), vec![0]);
        let args = Args::parse_from(["x", "-b", "64", "-e", "8"]);
        assert!(args.sizes().is_err());
    }

    #[test]
    fn roots_come_from_r() {
        let args = Args::parse_from(["x", "-r", "-1"]);
        assert_eq!(args.roots(3).unwrap(), vec![0, 1, 2]);
        let args = Args::parse_from(["x", "-r", "2"]);
        assert_eq!(args.roots(3).unwrap(), vec![2]);
        let err = Args::parse_from(["x", "-r", "3"]).roots(3).unwrap_err();
        assert!(err.contains("-r 3"), "{err}");
    }

    #[test]
    fn average_takes_the_nccl_tests_codes() {
        assert_eq!(Args::parse_from(["x"]).average, Average::Mean);
        assert_eq!(Args::parse_from(["x", "-a", "3"]).average, Average::Max);
        assert!(Args::try_parse_from(["x", "-a", "4"]).is_err());
    }

    #[test]
    fn bitwise_ops_need_an_integer_type_where_they_apply() {
        let args = Args::parse_from(["x", "-o", "bxor", "-d", "int8"]);
        assert_eq!((args.op, args.dtype), (ReduceOp::BXor, DType::I8));
        assert_eq!(args.check_op(true), Ok(()));
        let args = Args::parse_from(["x", "-o", "BAND"]);
        assert_eq!(args.op, ReduceOp::BAnd);
        assert_eq!(
            args.check_op(true),
            Err(
                "-o band needs an integer -d (int8, uint8, int32, uint32, int64 or uint64), \
                 not float"
                    .into()
            )
        );
        // Collectives that do not reduce ignore -o.
        assert_eq!(args.check_op(false), Ok(()));
        assert_eq!(Args::parse_from(["x", "-d", "half"]).check_op(true), Ok(()));
    }

    /// The error clap reports for `argv`, as text.
    fn refused(argv: &[&str]) -> String {
        let argv = ["x"].iter().chain(argv);
        Args::try_parse_from(argv).unwrap_err().to_string()
    }

    #[test]
    fn the_first_line_of_an_nccl_tests_recipe_parses() {
        let args = Args::parse_from(["x", "-b", "8", "-e", "128M", "-f", "2", "-g", "1"]);
        assert_eq!(
            (args.min_bytes, args.max_bytes, args.ngpus),
            (8, 128 << 20, 1)
        );
        let long = ["x", "--ngpus", "1", "--nthreads", "1", "--blocking", "1"];
        let args = Args::parse_from(long);
        assert_eq!((args.ngpus, args.nthreads, args.blocking), (1, 1, true));
    }

    #[test]
    fn several_gpus_per_process_need_the_device_path() {
        assert_eq!(Args::parse_from(["x"]).ngpus, 1);
        let host = Args::parse_from(["x", "-g", "8"]);
        assert_eq!(host.ngpus, 8);
        let err = host.check_device("all_reduce").unwrap_err();
        assert!(
            err.contains("-g 8: several GPUs per process need --device cuda"),
            "{err}"
        );
        let gpu = Args::parse_from(["x", "-g", "2", "--device", "cuda"]);
        if cfg!(feature = "cuda") {
            assert_eq!(gpu.check_device("broadcast"), Ok(()));
            let err = gpu.check_device("all_gather").unwrap_err();
            assert!(
                err.contains("all_gather takes one GPU per process"),
                "{err}"
            );
        }
        assert!(refused(&["-g", "0"]).contains("bad -g '0'"));
        assert!(refused(&["-g", "two"]).contains("bad -g 'two'"));
    }

    #[test]
    fn one_thread_per_process() {
        assert_eq!(Args::parse_from(["x", "-t", "1"]).nthreads, 1);
        let err = refused(&["--nthreads", "4"]);
        assert!(
            err.contains("-t 4: Chorus runs one rank per process"),
            "{err}"
        );
        assert!(err.contains("-np"), "{err}");
    }

    #[test]
    fn switches_take_0_or_1() {
        let args = Args::parse_from(["x"]);
        assert_eq!(
            (args.blocking, args.report_cputime, args.parallel_init),
            (false, false, false)
        );
        let args = Args::parse_from(["x", "-z", "1", "-C", "1", "-p", "1"]);
        assert_eq!(
            (args.blocking, args.report_cputime, args.parallel_init),
            (true, true, true)
        );
        let args = Args::parse_from(["x", "-z", "0", "-C", "0", "-p", "0"]);
        assert!(!args.blocking && !args.report_cputime && !args.parallel_init);
        for flag in ["-z", "-C", "-p"] {
            let err = refused(&[flag, "2"]);
            assert!(
                err.contains(&format!("bad {flag} '2': expected 0 or 1")),
                "{err}"
            );
        }
    }

    #[test]
    fn no_cuda_graphs() {
        assert_eq!(Args::parse_from(["x", "-G", "0"]).cudagraph, 0);
        let err = refused(&["--cudagraph", "10"]);
        assert!(
            err.contains("-G 10: Chorus has no CUDA graph capture"),
            "{err}"
        );
    }

    #[test]
    fn timeout_overrides_the_default_unless_0() {
        assert_eq!(Args::parse_from(["x"]).comm_timeout(), None);
        assert_eq!(Args::parse_from(["x", "-T", "0"]).comm_timeout(), None);
        let args = Args::parse_from(["x", "--timeout", "90"]);
        assert_eq!(args.comm_timeout(), Some(Duration::from_secs(90)));
        let err = refused(&["-T", "99999999999"]);
        assert!(
            err.contains("-T 99999999999: at most 31536000 seconds"),
            "{err}"
        );
        assert!(refused(&["-T", "1.5"]).contains("bad -T '1.5'"));
    }

    #[test]
    fn run_cycles_are_counted_from_1() {
        assert_eq!(Args::parse_from(["x"]).run_cycles, 1);
        assert_eq!(Args::parse_from(["x", "-N", "3"]).run_cycles, 3);
        let err = refused(&["--run_cycles", "0"]);
        assert!(err.contains("-N 0 (run forever) is not supported"), "{err}");
    }

    #[test]
    fn device_is_cpu_and_cuda_needs_the_feature() {
        let args = Args::parse_from(["x"]);
        assert_eq!(args.device, Device::Cpu);
        assert_eq!(args.check_device("all_reduce"), Ok(()));
        let args = Args::parse_from(["x", "--device", "cuda"]);
        assert_eq!(args.device, Device::Cuda);
        let want = match cfg!(feature = "cuda") {
            true => Ok(()),
            false => {
                Err("`--device cuda` needs the perf tools built with the `cuda` feature".into())
            }
        };
        assert_eq!(args.check_device("all_reduce"), want);
        assert!(refused(&["--device", "tpu"]).contains("possible values: cpu, cuda"));
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
