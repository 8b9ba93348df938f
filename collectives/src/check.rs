//! Data to check collectives with: deterministic inputs whose all-reduce results can be
//! computed exactly, their expected values, and a digest of whole buffers.
//!
//! Used by the perf tools' `-c` check and by the multi-process test harness.
//! Inputs are small integers (products stay within +-2^8, sums within
//! +-40), so float reductions are exact in every float type regardless of
//! order; integer inputs lie in 60..=124 so that sums overflow 8-bit types
//! and exercise wrapping. For the bitwise operators (integers only), inputs
//! are full-width bit patterns (all ones and zero among them) shared by the
//! ranks with a few bits of each rank's own flipped, so AND, OR and XOR
//! results neither vanish nor saturate at the world sizes tests use.

use std::fmt;

use crate::{bf16, f16, DType, Element, ReduceOp};

/// FNV-1a over bytes: a cheap fingerprint of a whole output buffer.
pub fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// A small integer for (rank, index).
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

/// splitmix64's finaliser: well-mixed bits from a counter.
fn mix(x: u64) -> u64 {
    let mut z = x ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Rank `rank`'s bitwise-operator input at index `i` for a type of `width` bits: a pattern
/// every rank shares (all ones at every fifth index, zero at every seventh, else mixed bits
/// that rank 0 differs from in about half the places), with two bits of the rank's own
/// flipped.
fn bits(rank: usize, i: usize, width: u32) -> u64 {
    let w = width as usize;
    let flip = 1u64 << ((rank * 7 + i * 3) % w) | 1u64 << ((rank * 13 + i * 5 + 1) % w);
    let pattern = if i % 5 == 0 {
        u64::MAX
    } else if i % 7 == 0 {
        0
    } else if rank == 0 {
        mix(i as u64) ^ mix(!(i as u64))
    } else {
        mix(i as u64)
    };
    pattern ^ flip
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
                if op == ReduceOp::Prod {
                    return base(rank, i, op, <$t>::MIN == 0) as $t;
                }
                if op.is_bitwise() {
                    // Truncated to the type's width; negative for signed types when the
                    // top bit is set.
                    return bits(rank, i, <$t>::BITS) as $t;
                }
                // 60..=124: a handful of ranks overflows 8-bit sums and exercises wrapping.
                (60 + 8 * base(rank, i, op, true)) as $t
            }

            fn poison() -> Self {
                <$t>::MAX / 3
            }

            fn check(got: Self, i: usize, world: usize, op: ReduceOp) -> Result<(), String> {
                let mut want = Self::input(0, i, op);
                for r in 1..world {
                    let v = Self::input(r, i, op);
                    want = match op {
                        ReduceOp::Sum | ReduceOp::Avg => want.wrapping_add(v),
                        ReduceOp::Prod => want.wrapping_mul(v),
                        ReduceOp::Min => want.min(v),
                        ReduceOp::Max => want.max(v),
                        ReduceOp::BAnd => want & v,
                        ReduceOp::BOr => want | v,
                        ReduceOp::BXor => want ^ v,
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
                    ReduceOp::Avg => values.sum::<f64>() / world as f64,
                    ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => {
                        return Err(format!("{op} is not defined on floats"));
                    }
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

/// Calls `$f::<T>($args..)` with `T` the Rust type of the `DType` value `$dtype`.
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $f:ident, $($arg:expr),*) => {
        match $dtype {
            $crate::DType::F32 => $f::<f32>($($arg),*),
            $crate::DType::F64 => $f::<f64>($($arg),*),
            $crate::DType::F16 => $f::<$crate::f16>($($arg),*),
            $crate::DType::BF16 => $f::<$crate::bf16>($($arg),*),
            $crate::DType::I8 => $f::<i8>($($arg),*),
            $crate::DType::U8 => $f::<u8>($($arg),*),
            $crate::DType::I32 => $f::<i32>($($arg),*),
            $crate::DType::U32 => $f::<u32>($($arg),*),
            $crate::DType::I64 => $f::<i64>($($arg),*),
            $crate::DType::U64 => $f::<u64>($($arg),*),
        }
    };
}

/// Fills `buf` (elements of `dtype`) with rank `rank`'s input pattern for `op`.
///
/// A trailing partial element is left as it is.
pub fn fill(dtype: DType, rank: usize, op: ReduceOp, buf: &mut [u8]) {
    fn typed<T: Element + Value>(rank: usize, op: ReduceOp, buf: &mut [u8]) {
        for (i, chunk) in buf.chunks_exact_mut(std::mem::size_of::<T>()).enumerate() {
            chunk.copy_from_slice(bytemuck::bytes_of(&T::input(rank, i, op)));
        }
    }
    crate::with_dtype!(dtype, typed, rank, op, buf)
}

/// Counts the elements of an all-reduce result over `world` ranks that differ from the expected value.
pub fn count_wrong(dtype: DType, world: usize, op: ReduceOp, buf: &[u8]) -> usize {
    fn typed<T: Element + Value>(world: usize, op: ReduceOp, buf: &[u8]) -> usize {
        buf.chunks_exact(std::mem::size_of::<T>())
            .enumerate()
            .filter(|(i, chunk)| {
                T::check(bytemuck::pod_read_unaligned(chunk), *i, world, op).is_err()
            })
            .count()
    }
    crate::with_dtype!(dtype, typed, world, op, buf)
}

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

    #[test]
    fn bitwise_expectations_are_exact_and_keep_bits() {
        // Two ranks, index 1: mixed bits, rank 0's different in places, with bits 3 and 6
        // (rank 0) or 10 and 19 (rank 1) flipped.
        let (shared, differ) = (mix(1) as u32, mix(!1) as u32);
        let (r0, r1) = (
            u32::input(0, 1, ReduceOp::BAnd),
            u32::input(1, 1, ReduceOp::BAnd),
        );
        assert_eq!((r0, r1), (shared ^ differ ^ 0x48, shared ^ 0x80400));
        for (op, want) in [
            (ReduceOp::BAnd, r0 & r1),
            (ReduceOp::BOr, r0 | r1),
            (ReduceOp::BXor, differ ^ 0x80448),
        ] {
            assert!(u32::check(want, 1, 2, op).is_ok(), "{op}");
            assert!(u32::check(want ^ 1 << 31, 1, 2, op).is_err(), "{op}");
        }
        // All ones at index 0 (bits 0 and 1 flipped on rank 0), negative for signed types.
        assert_eq!(i8::input(0, 0, ReduceOp::BOr), -4);
        assert!(f32::check(0.0, 0, 2, ReduceOp::BXor).is_err());
        // Results are neither mostly zeros nor mostly ones, at small and large world sizes.
        for world in [2, 3, 8, 16] {
            let fold = |op: ReduceOp, i: usize| {
                let mut acc = u64::input(0, i, op);
                for r in 1..world {
                    let v = u64::input(r, i, op);
                    acc = match op {
                        ReduceOp::BAnd => acc & v,
                        ReduceOp::BOr => acc | v,
                        _ => acc ^ v,
                    };
                }
                acc
            };
            for op in ReduceOp::BITWISE {
                let results: Vec<u64> = (0..64).map(|i| fold(op, i)).collect();
                let ones: u32 = results.iter().map(|x| x.count_ones()).sum();
                assert!(
                    ones > 64 * 64 / 8 && ones < 64 * 64 * 7 / 8,
                    "{op} W={world}: {ones}"
                );
            }
        }
    }

    #[test]
    fn byte_level_fill_and_check_agree() {
        for dtype in DType::ALL {
            for op in ReduceOp::ALL.into_iter().filter(|op| op.applies_to(dtype)) {
                let world = 3;
                let mut acc = vec![0u8; 40 * dtype.size()];
                let mut other = acc.clone();
                fill(dtype, 0, op, &mut acc);
                for r in 1..world {
                    fill(dtype, r, op, &mut other);
                    chorus_kernels::reduce(op, dtype, &mut acc, &other).unwrap();
                }
                if op == ReduceOp::Avg {
                    chorus_kernels::finish_avg(dtype, &mut acc, world).unwrap();
                }
                assert_eq!(count_wrong(dtype, world, op, &acc), 0, "{dtype} {op}");
                acc[..dtype.size()].fill(0x7f);
                assert_eq!(count_wrong(dtype, world, op, &acc), 1, "{dtype} {op}");
            }
        }
    }
}
