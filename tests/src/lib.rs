//! The loopback test harness: starts W real worker processes through
//! [`chorus::launch`] (the launcher the tools use), with the same environment
//! contract users use, and checks what they report.
//!
//! Also holds what the worker and the tests share: test cases, exactly
//! computable input values and their expected reductions, and the digest
//! that proves every rank holds identical bytes.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::time::Duration;

use chorus::launch::{launch, LaunchReport, LaunchSpec, Output};
use chorus::{bf16, f16, DType, ReduceOp};

/// Bound on one whole multi-process test.
pub const JOB_TIMEOUT: Duration = Duration::from_secs(240);

/// Starts `world` workers running `program args..` and waits for them.
///
/// Every worker gets `CHORUS_TIMEOUT=30` (so a broken collective fails in
/// seconds, not minutes) plus `env`. Panics only if the launch itself fails.
pub fn run(world: usize, program: &Path, args: &[&str], env: &[(&str, &str)]) -> LaunchReport {
    let mut spec = LaunchSpec::new(program, world)
        .args(args.iter().copied())
        .timeout(JOB_TIMEOUT)
        .output(Output::Capture)
        .env("CHORUS_TIMEOUT", "30");
    for (k, v) in env {
        spec = spec.env(*k, *v);
    }
    launch(&spec).unwrap_or_else(|e| panic!("cannot launch {}: {e}", program.display()))
}

/// Panics with the launcher's summary and every rank's stderr unless all ranks succeeded.
pub fn assert_success(report: &LaunchReport) {
    if report.success() {
        return;
    }
    let mut text = report.summary();
    for r in &report.ranks {
        text.push_str(&format!(
            "\n--- rank {} ({}) stderr:\n{}",
            r.rank,
            r.status,
            tail(&r.stderr, 30)
        ));
    }
    panic!("{text}");
}

fn tail(s: &str, lines: usize) -> String {
    let all: Vec<&str> = s.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Checks that every rank printed the same digest for every case; returns how many cases.
///
/// Panics naming the first case where ranks differ or a rank is missing it.
pub fn assert_identical_digests(report: &LaunchReport) -> usize {
    let mut cases: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for r in &report.ranks {
        for line in r.stdout.lines() {
            if let Some(rest) = line.strip_prefix("digest ") {
                let (case, hash) = rest
                    .split_once(' ')
                    .expect("digest line has a case and a hash");
                cases.entry(case).or_default().push(hash);
            }
        }
    }
    for (case, hashes) in &cases {
        assert_eq!(
            hashes.len(),
            report.ranks.len(),
            "{case}: not every rank reported it"
        );
        assert!(
            hashes.iter().all(|h| h == &hashes[0]),
            "{case}: ranks hold different bytes: {hashes:?}"
        );
    }
    cases.len()
}

/// One collective call of a test matrix.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    /// Element type.
    pub dtype: DType,
    /// Reduction operator.
    pub op: ReduceOp,
    /// Element count.
    pub count: usize,
    /// In place or into a separate output.
    pub in_place: bool,
    /// Root rank, for rooted collectives.
    pub root: usize,
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let place = if self.in_place {
            "inplace"
        } else {
            "outofplace"
        };
        write!(
            f,
            "{}/{}/{}/{}/root{}",
            self.dtype, self.op, self.count, place, self.root
        )
    }
}

/// FNV-1a over bytes: a cheap fingerprint of a whole output buffer.
pub fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// A small integer for (rank, index): products stay within +-2^8 and sums
/// within +-40, so float reductions are exact in every float type.
fn base(rank: usize, i: usize, op: ReduceOp, unsigned: bool) -> i64 {
    if op == ReduceOp::Prod {
        let k = (rank * 3 + i * 5) % 4;
        return if unsigned {
            [1, 2, 3, 1][k]
        } else {
            [1, 2, -1, -2][k]
        };
    }
    let v = ((rank * 7 + i * 13) % 9) as i64;
    if unsigned {
        v
    } else {
        v - 4
    }
}

/// Element types whose inputs and expected all-reduce results the tests can compute exactly.
pub trait Value: Copy + fmt::Debug {
    /// Rank `rank`'s input at index `i` for `op`.
    fn input(rank: usize, i: usize, op: ReduceOp) -> Self;
    /// A value no correct result has, to spot unwritten outputs.
    fn poison() -> Self;
    /// Checks an all-reduce result at index `i` over `world` ranks.
    fn check(got: Self, i: usize, world: usize, op: ReduceOp) -> Result<(), String>;
}

macro_rules! int_value {
    ($($t:ty),*) => {$(
        impl Value for $t {
            fn input(rank: usize, i: usize, op: ReduceOp) -> Self {
                // Scaled so that sums overflow narrow types and exercise wrapping.
                let scale = if op == ReduceOp::Prod { 1 } else { 37 };
                (base(rank, i, op, <$t>::MIN == 0) * scale) as $t
            }

            fn poison() -> Self {
                <$t>::MAX / 3
            }

            fn check(got: Self, i: usize, world: usize, op: ReduceOp) -> Result<(), String> {
                let mut want = Self::input(0, i, op);
                for r in 1..world {
                    let v = Self::input(r, i, op);
                    want = match op {
                        ReduceOp::Prod => want.wrapping_mul(v),
                        ReduceOp::Min => want.min(v),
                        ReduceOp::Max => want.max(v),
                        _ => want.wrapping_add(v),
                    };
                }
                if op == ReduceOp::Avg {
                    want /= world as $t;
                }
                if got == want { Ok(()) } else { Err(format!("got {got}, expected {want}")) }
            }
        }
    )*};
}

int_value!(i8, u8, i32, u32, i64, u64);

macro_rules! float_value {
    ($($t:ty: $to:expr, $from:expr, $tol:expr);*) => {$(
        impl Value for $t {
            fn input(rank: usize, i: usize, op: ReduceOp) -> Self {
                $from(base(rank, i, op, false) as f64)
            }

            fn poison() -> Self {
                $from(f64::NAN)
            }

            fn check(got: Self, i: usize, world: usize, op: ReduceOp) -> Result<(), String> {
                let values = (0..world).map(|r| $to(Self::input(r, i, op)));
                let want: f64 = match op {
                    ReduceOp::Prod => values.product(),
                    ReduceOp::Min => values.fold(f64::INFINITY, f64::min),
                    ReduceOp::Max => values.fold(f64::NEG_INFINITY, f64::max),
                    ReduceOp::Sum => values.sum(),
                    _ => values.sum::<f64>() / world as f64,
                };
                let got = $to(got);
                // Everything but Avg is exact (small integers); Avg rounds once.
                let tol = if op == ReduceOp::Avg { $tol * want.abs().max(1.0) } else { 0.0 };
                if (got - want).abs() <= tol { Ok(()) } else { Err(format!("got {got}, expected {want}")) }
            }
        }
    )*};
}

float_value!(
    f32: |v: f32| v as f64, |v: f64| v as f32, 1e-6;
    f64: |v: f64| v, |v: f64| v, 1e-12;
    f16: |v: f16| v.to_f64(), f16::from_f64, 1e-3;
    bf16: |v: bf16| v.to_f64(), bf16::from_f64, 8e-3
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expectations_catch_wrong_results() {
        assert!(f32::check(f32::input(0, 3, ReduceOp::Sum) * 2.0, 3, 2, ReduceOp::Sum).is_err());
        let right = (0..3).fold(0i8, |a, r| a.wrapping_add(i8::input(r, 5, ReduceOp::Sum)));
        assert!(i8::check(right, 5, 3, ReduceOp::Sum).is_ok());
        assert!(i8::check(right.wrapping_add(1), 5, 3, ReduceOp::Sum).is_err());
        assert!(f16::check(f16::poison(), 0, 4, ReduceOp::Max).is_err());
    }

    #[test]
    fn narrow_integer_sums_really_wrap() {
        let overflows = (0..64).any(|i| {
            let wide: i64 = (0..8).map(|r| i8::input(r, i, ReduceOp::Sum) as i64).sum();
            i8::try_from(wide).is_err()
        });
        assert!(overflows, "inputs must overflow i8 somewhere");
    }
}
