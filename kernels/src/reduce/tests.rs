//! Kernel tests against a scalar reference on pseudo-random data, plus edge cases.

use std::fmt::Debug;

use super::*;
use crate::test_rng::Rng;

impl Rng {
    /// A float in [-range, range), with about 1 in 16 draws a special value.
    fn float(&mut self, range: f64) -> f64 {
        let r = self.next();
        if r % 16 == 0 {
            const SPECIAL: [f64; 6] = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, 1.0];
            return SPECIAL[(r >> 8) as usize % SPECIAL.len()];
        }
        ((r >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * range
    }
}

/// Independent scalar model of each element type.
trait Reference: Element + Debug {
    fn random(rng: &mut Rng) -> Self;
    fn reference(op: ReduceOp, a: Self, b: Self) -> Self;
    fn reference_div(a: Self, n: usize) -> Self;
    /// Equal bit patterns, or both NaN.
    fn same(a: Self, b: Self) -> bool;
}

macro_rules! int_reference {
    ($($t:ty),*) => {$(
        impl Reference for $t {
            fn random(rng: &mut Rng) -> Self {
                rng.next() as $t
            }
            fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => if a <= b { a } else { b },
                    ReduceOp::Max => if a >= b { a } else { b },
                    ReduceOp::BAnd => a & b,
                    ReduceOp::BOr => a | b,
                    ReduceOp::BXor => a ^ b,
                }
            }
            fn reference_div(a: Self, n: usize) -> Self {
                (a as i128 / n as i128) as $t
            }
            fn same(a: Self, b: Self) -> bool {
                a == b
            }
        }
    )*};
}
int_reference!(i8, u8, i32, u32, i64, u64);

macro_rules! float_reference {
    ($($t:ty),*) => {$(
        impl Reference for $t {
            fn random(rng: &mut Rng) -> Self {
                rng.float(1000.0) as $t
            }
            fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
                let either_nan = a.is_nan() || b.is_nan();
                match op {
                    ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => {
                        unreachable!("{op} is not defined on floats")
                    }
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Prod => a * b,
                    _ if either_nan => <$t>::NAN,
                    // Signed zeros: -0.0 is the minimum, +0.0 the maximum.
                    ReduceOp::Min if a == b => if a.is_sign_negative() { a } else { b },
                    ReduceOp::Max if a == b => if a.is_sign_positive() { a } else { b },
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            fn reference_div(a: Self, n: usize) -> Self {
                a / n as $t
            }
            fn same(a: Self, b: Self) -> bool {
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
            }
        }
    )*};
}
float_reference!(f32, f64);

macro_rules! half_reference {
    ($($t:ty),*) => {$(
        impl Reference for $t {
            fn random(rng: &mut Rng) -> Self {
                <$t>::from_f64(rng.float(16.0))
            }
            fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
                <$t>::from_f32(f32::reference(op, a.to_f32(), b.to_f32()))
            }
            fn reference_div(a: Self, n: usize) -> Self {
                <$t>::from_f32(a.to_f32() / n as f32)
            }
            fn same(a: Self, b: Self) -> bool {
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
            }
        }
    )*};
}
half_reference!(f16, bf16);

const LENGTHS: [usize; 6] = [0, 1, 3, 17, 1000, 4099];

/// A byte buffer holding `values`, starting `offset` bytes past an 8-byte aligned address.
struct Bytes {
    storage: Vec<u64>,
    offset: usize,
    len: usize,
}

impl Bytes {
    fn new<T: Element>(values: &[T], offset: usize) -> Self {
        let len = std::mem::size_of_val(values);
        let mut storage = vec![0u64; (len + offset).div_ceil(8)];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut storage);
        bytes[offset..offset + len].copy_from_slice(bytemuck::cast_slice(values));
        Bytes {
            storage,
            offset,
            len,
        }
    }

    fn get(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.storage)[self.offset..self.offset + self.len]
    }

    fn get_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.storage)[self.offset..self.offset + self.len]
    }

    fn values<T: Element>(&self) -> Vec<T> {
        from_bytes(self.get())
    }
}

/// Copies possibly unaligned bytes into a vector of elements.
fn from_bytes<T: Element>(bytes: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
    v
}

fn random_vec<T: Reference>(rng: &mut Rng, len: usize) -> Vec<T> {
    (0..len).map(|_| T::random(rng)).collect()
}

fn assert_same<T: Reference>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            T::same(*g, *w),
            "{what}: element {i}: got {g:?}, want {w:?}"
        );
    }
}

/// Every op (that applies to `T`), length and alignment combination of `reduce` and
/// `reduce_into` for `T`, both through the public functions (the AVX2 build where the CPU
/// has it) and through the baseline build of the loops.
fn check_against_reference<T: Reference>() {
    let mut rng = Rng(T::DTYPE.size() as u64 * 7919 + T::DTYPE as u64);
    let ops = ReduceOp::ALL
        .into_iter()
        .filter(|op| op.applies_to(T::DTYPE));
    assert_eq!(ops.clone().count(), if T::DTYPE.is_float() { 5 } else { 8 });
    for op in ops {
        for len in LENGTHS {
            let a = random_vec::<T>(&mut rng, len);
            let b = random_vec::<T>(&mut rng, len);
            let want: Vec<T> = a
                .iter()
                .zip(&b)
                .map(|(x, y)| T::reference(op, *x, *y))
                .collect();
            for (off_a, off_b) in [(0, 0), (1, 1), (1, 0), (0, 3)] {
                let what = format!("{} {op} len {len} offsets {off_a}/{off_b}", T::DTYPE);

                let src = Bytes::new(&b, off_b);
                let (x, y) = (Bytes::new(&a, off_a), Bytes::new(&b, 0));
                for baseline in [false, true] {
                    let what = format!("{what} baseline {baseline}");
                    let mut dst = Bytes::new(&a, off_a);
                    if baseline {
                        let stores = Stores::Cached;
                        run_inline(T::DTYPE, dst.get_mut(), [src.get()], Combine(op), stores);
                    } else {
                        reduce(op, T::DTYPE, dst.get_mut(), src.get()).unwrap();
                    }
                    assert_same(&dst.values::<T>(), &want, &format!("reduce {what}"));

                    for stores in [Stores::Cached, Stores::Streaming] {
                        let mut out = Bytes::new(&vec![T::zeroed(); len], off_b);
                        let (into, x, y) = (out.get_mut(), x.get(), y.get());
                        match (baseline, stores) {
                            (true, _) => {
                                run_inline(T::DTYPE, into, [x, y], CombineInto(op), stores)
                            }
                            (false, Stores::Cached) => {
                                reduce_into(op, T::DTYPE, into, x, y).unwrap()
                            }
                            (false, Stores::Streaming) => {
                                reduce_into_streaming(op, T::DTYPE, into, x, y).unwrap()
                            }
                        }
                        let what = format!("reduce_into {what} {stores:?}");
                        assert_same(&out.values::<T>(), &want, &what);
                    }
                }
            }
            let mut typed = a.clone();
            reduce_typed(op, &mut typed, &b).unwrap();
            assert_same(
                &typed,
                &want,
                &format!("reduce_typed {} {op} len {len}", T::DTYPE),
            );
        }
    }
}

fn check_finish_avg<T: Reference>() {
    let mut rng = Rng(42 + T::DTYPE as u64);
    for len in LENGTHS {
        for n in [1, 2, 3, 7, 300] {
            let values = random_vec::<T>(&mut rng, len);
            let want: Vec<T> = values.iter().map(|v| T::reference_div(*v, n)).collect();
            for (offset, baseline) in [(0, false), (1, false), (0, true), (1, true)] {
                let mut buf = Bytes::new(&values, offset);
                if baseline {
                    run_inline(T::DTYPE, buf.get_mut(), [], Divide(n), Stores::Cached);
                } else {
                    finish_avg(T::DTYPE, buf.get_mut(), n).unwrap();
                }
                let what = format!(
                    "finish_avg {} len {len} n {n} offset {offset} baseline {baseline}",
                    T::DTYPE
                );
                assert_same(&buf.values::<T>(), &want, &what);
            }
        }
    }
}

macro_rules! per_dtype_tests {
    ($($name:ident: $t:ty),*) => {$(
        mod $name {
            use super::*;

            #[test]
            fn reduce_matches_reference() {
                check_against_reference::<$t>();
            }

            #[test]
            fn finish_avg_matches_reference() {
                check_finish_avg::<$t>();
            }
        }
    )*};
}
per_dtype_tests!(
    f32_: f32, f64_: f64, f16_: f16, bf16_: bf16, i8_: i8,
    u8_: u8, i32_: i32, u32_: u32, i64_: i64, u64_: u64
);

/// Reduces `a` with `b` element-wise through `reduce_typed` and returns the result.
fn apply<T: Element>(op: ReduceOp, a: &[T], b: &[T]) -> Vec<T> {
    let mut dst = a.to_vec();
    reduce_typed(op, &mut dst, b).unwrap();
    dst
}

macro_rules! float_special_tests {
    ($($name:ident: $t:ty, $from:path),*) => {$(
        #[test]
        fn $name() {
            let f = |x: f64| -> $t { $from(x) };
            let (nan, inf, one, zero) = (f(f64::NAN), f(f64::INFINITY), f(1.0), f(0.0));
            let (ninf, nzero, two) = (f(f64::NEG_INFINITY), f(-0.0), f(2.0));

            // NaN in either position propagates through every (arithmetic) op.
            for op in ReduceOp::ARITHMETIC {
                let r = apply(op, &[nan, one, nan, inf], &[one, nan, nan, nan]);
                assert!(r.iter().all(|x| x.is_nan()), "{op}: {r:?}");
            }
            // Infinities.
            assert_eq!(apply(ReduceOp::Min, &[ninf, one, inf], &[one, inf, ninf]), [ninf, one, ninf]);
            assert_eq!(apply(ReduceOp::Max, &[ninf, one, inf], &[one, inf, ninf]), [one, inf, inf]);
            assert_eq!(apply(ReduceOp::Sum, &[inf, ninf], &[one, one]), [inf, ninf]);
            assert!(apply(ReduceOp::Sum, &[inf], &[ninf])[0].is_nan());
            assert_eq!(apply(ReduceOp::Prod, &[inf, ninf], &[two, two]), [inf, ninf]);
            assert!(apply(ReduceOp::Prod, &[inf], &[zero])[0].is_nan());
            // Signed zeros: -0.0 < +0.0 regardless of operand order.
            let min = apply(ReduceOp::Min, &[nzero, zero], &[zero, nzero]);
            assert!(min.iter().all(|x| *x == zero && x.is_sign_negative()), "{min:?}");
            let max = apply(ReduceOp::Max, &[nzero, zero], &[zero, nzero]);
            assert!(max.iter().all(|x| *x == zero && x.is_sign_positive()), "{max:?}");
            // Ordinary values.
            assert_eq!(apply(ReduceOp::Min, &[one, two], &[two, one]), [one, one]);
            assert_eq!(apply(ReduceOp::Max, &[one, two], &[two, one]), [two, two]);
        }
    )*};
}
float_special_tests!(
    f32_nan_inf_and_signed_zero: f32, f32_from,
    f64_nan_inf_and_signed_zero: f64, std::convert::identity,
    f16_nan_inf_and_signed_zero: f16, f16::from_f64,
    bf16_nan_inf_and_signed_zero: bf16, bf16::from_f64
);

fn f32_from(x: f64) -> f32 {
    x as f32
}

#[test]
fn integer_sum_and_prod_wrap() {
    assert_eq!(
        apply(ReduceOp::Sum, &[100i8, -100, 127], &[100, -100, 1]),
        [-56, 56, -128]
    );
    assert_eq!(apply(ReduceOp::Prod, &[200u8, 16], &[2, 16]), [144, 0]);
    assert_eq!(
        apply(ReduceOp::Sum, &[i64::MAX, i64::MIN], &[1, -1]),
        [i64::MIN, i64::MAX]
    );
    assert_eq!(apply(ReduceOp::Sum, &[u64::MAX], &[2]), [1]);
    assert_eq!(apply(ReduceOp::Prod, &[i32::MAX], &[2]), [-2]);
    assert_eq!(
        apply(ReduceOp::Sum, &[u32::MAX], &[u32::MAX]),
        [u32::MAX - 1]
    );
    // Avg reduces as Sum.
    assert_eq!(apply(ReduceOp::Avg, &[100i8], &[100]), [-56]);
}

#[test]
fn integer_min_max_are_exact() {
    let a = [i64::MIN, i64::MAX, -1, 0];
    let b = [i64::MAX, i64::MIN, 1, 0];
    assert_eq!(apply(ReduceOp::Min, &a, &b), [i64::MIN, i64::MIN, -1, 0]);
    assert_eq!(apply(ReduceOp::Max, &a, &b), [i64::MAX, i64::MAX, 1, 0]);
    assert_eq!(apply(ReduceOp::Min, &[0u8, 255], &[255, 128]), [0, 128]);
    assert_eq!(
        apply(ReduceOp::Max, &[u64::MAX - 1], &[u64::MAX]),
        [u64::MAX]
    );
}

/// Checks rows of `[a, b, a & b, a | b, a ^ b]`: `BAnd`, `BOr` and `BXor` of the `a` and `b`
/// columns through `reduce_typed`, `reduce_into` and the unaligned path of `reduce`.
fn check_bitwise<T: Element + Debug + PartialEq>(rows: &[[T; 5]]) {
    let column = |k: usize| rows.iter().map(|row| row[k]).collect::<Vec<T>>();
    let (a, b) = (column(0), column(1));
    for (op, want) in ReduceOp::BITWISE
        .into_iter()
        .zip([column(2), column(3), column(4)])
    {
        assert_eq!(apply(op, &a, &b), want, "{} {op}", T::DTYPE);
        let mut out = vec![T::zeroed(); a.len()];
        let (x, y) = (bytemuck::cast_slice(&a), bytemuck::cast_slice(&b));
        reduce_into(op, T::DTYPE, bytemuck::cast_slice_mut(&mut out), x, y).unwrap();
        assert_eq!(out, want, "{} {op}: reduce_into", T::DTYPE);
        let mut dst = Bytes::new(&a, 1);
        reduce(op, T::DTYPE, dst.get_mut(), Bytes::new(&b, 3).get()).unwrap();
        assert_eq!(
            dst.values::<T>(),
            want,
            "{} {op}: unaligned reduce",
            T::DTYPE
        );
    }
}

// Rows: a, b, a & b, a | b, a ^ b. All ones against a value, all ones against all ones,
// zero against all ones, the sign bit against the rest, alternating patterns, then mixed
// signs and magnitudes. Tables, so laid out by hand.

#[test]
#[rustfmt::skip]
fn bitwise_i8() {
    check_bitwise::<i8>(&[
        [-1,          5,           5,           -1,          -6],
        [-1,          -1,          -1,          -1,          0],
        [0,           -1,          0,           -1,          -1],
        [i8::MIN,     i8::MAX,     0,           -1,          -1],
        [0b0101_0101, 0b0011_0011, 0b0001_0001, 0b0111_0111, 0b0110_0110],
        [-86,         -1,          -86,         -1,          85],
        [-6,          3,           2,           -5,          -7],
        [-7,          -3,          -7,          -3,          4],
    ]);
}

#[test]
#[rustfmt::skip]
fn bitwise_u8() {
    check_bitwise::<u8>(&[
        [0xFF, 0x05, 0x05, 0xFF, 0xFA],
        [0xFF, 0xFF, 0xFF, 0xFF, 0x00],
        [0x00, 0xFF, 0x00, 0xFF, 0xFF],
        [0x80, 0x7F, 0x00, 0xFF, 0xFF],
        [0x55, 0x33, 0x11, 0x77, 0x66],
        [0xAA, 0xFF, 0xAA, 0xFF, 0x55],
        [0x0F, 0x3C, 0x0C, 0x3F, 0x33],
        [0xF0, 0x3C, 0x30, 0xFC, 0xCC],
    ]);
}

#[test]
#[rustfmt::skip]
fn bitwise_i32() {
    check_bitwise::<i32>(&[
        [-1,          5,           5,           -1,          -6],
        [-1,          -1,          -1,          -1,          0],
        [0,           -1,          0,           -1,          -1],
        [i32::MIN,    i32::MAX,    0,           -1,          -1],
        [0x5555_5555, 0x3333_3333, 0x1111_1111, 0x7777_7777, 0x6666_6666],
        [-6,          3,           2,           -5,          -7],
        [12,          10,          8,           14,          6],
        [-7,          -3,          -7,          -3,          4],
    ]);
}

#[test]
#[rustfmt::skip]
fn bitwise_u32() {
    const MAX: u32 = u32::MAX;
    check_bitwise::<u32>(&[
        [MAX,         5,           5,           MAX,         0xFFFF_FFFA],
        [MAX,         MAX,         MAX,         MAX,         0],
        [0,           MAX,         0,           MAX,         MAX],
        [0x8000_0000, 0x7FFF_FFFF, 0,           MAX,         MAX],
        [0x5555_5555, 0x3333_3333, 0x1111_1111, 0x7777_7777, 0x6666_6666],
        [0xAAAA_AAAA, 0xFFFF_0000, 0xAAAA_0000, 0xFFFF_AAAA, 0x5555_AAAA],
        [0xDEAD_BEEF, 0x0000_FFFF, 0x0000_BEEF, 0xDEAD_FFFF, 0xDEAD_4110],
        [12,          10,          8,           14,          6],
    ]);
}

#[test]
#[rustfmt::skip]
fn bitwise_i64() {
    check_bitwise::<i64>(&[
        [-1,                    5,                     5,                     -1,                    -6],
        [-1,                    -1,                    -1,                    -1,                    0],
        [0,                     -1,                    0,                     -1,                    -1],
        [i64::MIN,              i64::MAX,              0,                     -1,                    -1],
        [0x5555_5555_5555_5555, 0x3333_3333_3333_3333, 0x1111_1111_1111_1111, 0x7777_7777_7777_7777, 0x6666_6666_6666_6666],
        [-6,                    3,                     2,                     -5,                    -7],
        [i64::MIN,              -1,                    i64::MIN,              -1,                    i64::MAX],
        [-7,                    -3,                    -7,                    -3,                    4],
    ]);
}

#[test]
#[rustfmt::skip]
fn bitwise_u64() {
    const MAX: u64 = u64::MAX;
    check_bitwise::<u64>(&[
        [MAX,                   5,                     5,                     MAX,                   0xFFFF_FFFF_FFFF_FFFA],
        [MAX,                   MAX,                   MAX,                   MAX,                   0],
        [0,                     MAX,                   0,                     MAX,                   MAX],
        [0x8000_0000_0000_0000, 0x7FFF_FFFF_FFFF_FFFF, 0,                     MAX,                   MAX],
        [0x5555_5555_5555_5555, 0x3333_3333_3333_3333, 0x1111_1111_1111_1111, 0x7777_7777_7777_7777, 0x6666_6666_6666_6666],
        [0xAAAA_AAAA_AAAA_AAAA, 0xFFFF_FFFF_0000_0000, 0xAAAA_AAAA_0000_0000, 0xFFFF_FFFF_AAAA_AAAA, 0x5555_5555_AAAA_AAAA],
        [0xDEAD_BEEF_0000_0000, 0xFFFF_0000_FFFF_0000, 0xDEAD_0000_0000_0000, 0xFFFF_BEEF_FFFF_0000, 0x2152_BEEF_FFFF_0000],
        [12,                    10,                    8,                     14,                    6],
    ]);
}

#[test]
fn bitwise_reductions_fold_over_many_buffers() {
    // Three "ranks": AND keeps the bits all share, OR any bit one has, XOR the bits an odd
    // number of them have.
    let ranks = [
        [0x7000_0001i32, 0b1100, -8],
        [-2, 0b1010, -3],
        [i32::MIN, 0b0110, -1],
    ];
    let fold = |op| {
        let mut acc = ranks[0];
        for r in &ranks[1..] {
            reduce_typed(op, &mut acc, r).unwrap();
        }
        acc
    };
    assert_eq!(fold(ReduceOp::BAnd), [0, 0, -8]);
    assert_eq!(fold(ReduceOp::BOr), [-1, 0b1110, -1]);
    assert_eq!(fold(ReduceOp::BXor), [0x0FFF_FFFF, 0, -6]);
}

#[test]
fn bitwise_ops_on_floats_are_rejected_without_touching_buffers() {
    for dtype in DType::ALL.into_iter().filter(|d| d.is_float()) {
        for op in ReduceOp::BITWISE {
            let want = Err(KernelError::UnsupportedOp { op, dtype });
            let mut dst = [0x3Cu8; 16];
            assert_eq!(reduce(op, dtype, &mut dst, &[0xFF; 16]), want);
            // The operator is checked first, even when the lengths are wrong too.
            assert_eq!(reduce(op, dtype, &mut dst, &[0xFF; 3]), want);
            let mut out = [0x3Cu8; 16];
            assert_eq!(reduce_into(op, dtype, &mut out, &dst, &[0xFF; 16]), want);
            assert_eq!((dst, out), ([0x3C; 16], [0x3C; 16]), "{op} {dtype}");
        }
    }
    let mut acc = [1.5f32, -2.0];
    assert_eq!(
        reduce_typed(ReduceOp::BOr, &mut acc, &[0.0, 0.0]),
        Err(KernelError::UnsupportedOp {
            op: ReduceOp::BOr,
            dtype: DType::F32
        })
    );
    assert_eq!(acc, [1.5, -2.0]);
    let mut halves = [f16::ONE; 4];
    let err = reduce_typed(ReduceOp::BXor, &mut halves, &[f16::ONE; 4]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "reduction operator bxor is not defined for half (bitwise operators need an integer \
         type)"
    );
    assert_eq!(halves, [f16::ONE; 4]);
}

fn avg<T: Element>(values: &[T], n: usize) -> Vec<T> {
    let mut bytes = bytemuck::cast_slice::<T, u8>(values).to_vec();
    finish_avg(T::DTYPE, &mut bytes, n).unwrap();
    from_bytes(&bytes)
}

#[test]
fn finish_avg_divides_floats() {
    assert_eq!(avg(&[3.0f32, -4.5, 1.0, 0.0], 2), [1.5, -2.25, 0.5, 0.0]);
    assert_eq!(avg(&[1.0f64, 9.0], 3), [1.0 / 3.0, 3.0]);
    assert_eq!(
        avg(&[f16::from_f32(6.0), f16::from_f32(-1.0)], 4),
        [f16::from_f32(1.5), f16::from_f32(-0.25)]
    );
    assert_eq!(avg(&[bf16::from_f32(10.0)], 5), [bf16::from_f32(2.0)]);
    assert!(avg(&[f32::NAN], 2)[0].is_nan());
    assert_eq!(avg(&[f64::INFINITY], 2), [f64::INFINITY]);
}

#[test]
fn finish_avg_truncates_integers_toward_zero() {
    assert_eq!(avg(&[7i32, -7, 8, -8, 1, -1], 2), [3, -3, 4, -4, 0, 0]);
    assert_eq!(avg(&[7u32, 8], 3), [2, 2]);
    assert_eq!(avg(&[i64::MIN, i64::MAX], 4), [i64::MIN / 4, i64::MAX / 4]);
    assert_eq!(avg(&[u64::MAX], 3), [u64::MAX / 3]);
    // Counts beyond the type's range divide exactly in a wider type.
    assert_eq!(avg(&[-128i8, 127, -100], 128), [-1, 0, 0]);
    assert_eq!(avg(&[255u8, 10], 300), [0, 0]);
    assert_eq!(avg(&[255u8, 10], 255), [1, 0]);
    assert_eq!(avg(&[-5i8], 1), [-5]);
}

#[test]
fn finish_avg_rejects_zero_count_and_partial_elements() {
    let mut buf = [1u8, 2, 3, 4];
    assert_eq!(
        finish_avg(DType::I32, &mut buf, 0),
        Err(KernelError::ZeroCount)
    );
    assert_eq!(
        finish_avg(DType::F64, &mut buf, 2),
        Err(KernelError::Misaligned {
            len: 4,
            dtype: DType::F64
        })
    );
    assert_eq!(buf, [1, 2, 3, 4], "buffer must be untouched on error");
}

#[test]
fn length_errors_are_reported_without_touching_dst() {
    let mut dst = [1u8; 8];
    let err = reduce(ReduceOp::Sum, DType::F32, &mut dst, &[2u8; 4]).unwrap_err();
    assert_eq!(err, KernelError::LengthMismatch { dst: 8, src: 4 });
    assert_eq!(
        reduce(ReduceOp::Sum, DType::I32, &mut dst[..6], &[2u8; 6]),
        Err(KernelError::Misaligned {
            len: 6,
            dtype: DType::I32
        })
    );
    assert_eq!(
        reduce(ReduceOp::Max, DType::F16, &mut dst[..3], &[2u8; 3]),
        Err(KernelError::Misaligned {
            len: 3,
            dtype: DType::F16
        })
    );
    assert_eq!(dst, [1u8; 8]);
    let mut out = [0u8; 8];
    assert_eq!(
        reduce_into(ReduceOp::Sum, DType::U8, &mut out, &[1u8; 8], &[1u8; 7]),
        Err(KernelError::LengthMismatch { dst: 8, src: 7 })
    );
    assert_eq!(
        reduce_into(ReduceOp::Sum, DType::U8, &mut out, &[1u8; 9], &[1u8; 8]),
        Err(KernelError::LengthMismatch { dst: 8, src: 9 })
    );
    assert_eq!(
        reduce_into(
            ReduceOp::Sum,
            DType::U64,
            &mut out[..4],
            &[1u8; 4],
            &[1u8; 4]
        ),
        Err(KernelError::Misaligned {
            len: 4,
            dtype: DType::U64
        })
    );
    assert_eq!(out, [0u8; 8]);
    let err = reduce_typed(ReduceOp::Sum, &mut [1.0f64; 2], &[1.0; 3]).unwrap_err();
    assert_eq!(err, KernelError::LengthMismatch { dst: 16, src: 24 });
}

#[test]
fn error_messages_are_readable() {
    let msg = KernelError::LengthMismatch { dst: 8, src: 4 }.to_string();
    assert_eq!(
        msg,
        "buffer length mismatch: destination is 8 bytes but source is 4 bytes"
    );
    let msg = KernelError::Misaligned {
        len: 6,
        dtype: DType::I32,
    }
    .to_string();
    assert_eq!(
        msg,
        "buffer length 6 bytes is not a multiple of the 4 byte size of int32"
    );
}

#[test]
fn streaming_copies_match_copies_at_every_offset_and_length() {
    let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
    for len in [0, 1, 63, 64, 65, 200, 4099] {
        for (off_dst, off_src) in [(0, 0), (1, 0), (0, 5), (17, 33)] {
            let mut dst = vec![0u8; len + off_dst + 1];
            copy_streaming(
                &mut dst[off_dst..off_dst + len],
                &src[off_src..off_src + len],
            )
            .unwrap();
            let what = format!("len {len} offsets {off_dst}/{off_src}");
            assert_eq!(
                dst[off_dst..off_dst + len],
                src[off_src..off_src + len],
                "{what}"
            );
            assert!(dst[..off_dst].iter().all(|&b| b == 0), "{what}: before");
            assert_eq!(dst[off_dst + len], 0, "{what}: after");
        }
    }
    assert_eq!(
        copy_streaming(&mut [0u8; 8], &[1u8; 7]),
        Err(KernelError::LengthMismatch { dst: 8, src: 7 })
    );
}
