//! The perf tools' flags: nccl-tests' names and meanings, plus `-np`, `-J` and `--plot`.

use std::ffi::OsString;
use std::path::PathBuf;

use chorus::{DType, ReduceOp};
use clap::Parser;

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
    /// Draw bus bandwidth and time against size into this PNG file.
    #[arg(long = "plot")]
    pub plot: Option<PathBuf>,
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
