//! Scalar arithmetic of the natively computed element types, one impl per type.
//!
//! Every method is `#[inline(always)]` so that it vanishes into the vectorised loops of
//! the `reduce` module, including their AVX2 copies.

/// Scalar arithmetic of a natively supported element type.
pub(crate) trait Arith: bytemuck::Pod {
    /// `a + b`, wrapping for integers.
    fn sum(self, other: Self) -> Self;
    /// `a * b`, wrapping for integers.
    fn prod(self, other: Self) -> Self;
    /// The smaller operand; NaN if either is NaN; `-0.0` is smaller than `+0.0`.
    fn minimum(self, other: Self) -> Self;
    /// The larger operand; NaN if either is NaN; `+0.0` is larger than `-0.0`.
    fn maximum(self, other: Self) -> Self;
    /// `a & b` (bitwise AND).
    fn bit_and(self, other: Self) -> Self;
    /// `a | b` (bitwise OR).
    fn bit_or(self, other: Self) -> Self;
    /// `a ^ b` (bitwise exclusive OR).
    fn bit_xor(self, other: Self) -> Self;
    /// `buf[i] /= n` for `n >= 1` (integers truncate toward zero).
    fn divide(buf: &mut [Self], n: usize);
}

macro_rules! impl_int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn sum(self, other: Self) -> Self {
                self.wrapping_add(other)
            }

            #[inline(always)]
            fn prod(self, other: Self) -> Self {
                self.wrapping_mul(other)
            }

            #[inline(always)]
            fn minimum(self, other: Self) -> Self {
                Ord::min(self, other)
            }

            #[inline(always)]
            fn maximum(self, other: Self) -> Self {
                Ord::max(self, other)
            }

            #[inline(always)]
            fn bit_and(self, other: Self) -> Self {
                self & other
            }

            #[inline(always)]
            fn bit_or(self, other: Self) -> Self {
                self | other
            }

            #[inline(always)]
            fn bit_xor(self, other: Self) -> Self {
                self ^ other
            }

            #[inline(always)]
            fn divide(buf: &mut [Self], n: usize) {
                if let Ok(d) = <$t>::try_from(n) {
                    // `d >= 1`, so neither division by zero nor `MIN / -1` can occur.
                    for x in buf {
                        *x /= d;
                    }
                } else {
                    // `n` exceeds the type's range: divide in a type wide enough for both.
                    for x in buf {
                        *x = (*x as i128 / n as i128) as $t;
                    }
                }
            }
        }
    )*};
}
impl_int_arith!(i8, u8, i32, u32, i64, u64);

macro_rules! impl_float_arith {
    ($($t:ty: $bits:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn sum(self, other: Self) -> Self {
                self + other
            }

            #[inline(always)]
            fn prod(self, other: Self) -> Self {
                self * other
            }

            // Written as selects so the loop stays vectorised. When neither operand is
            // smaller they are equal (including -0.0 vs +0.0) or one is NaN: OR-ing the bits
            // then yields the equal value, -0.0, or a NaN respectively.
            #[inline(always)]
            fn minimum(self, other: Self) -> Self {
                let tie = <$t>::from_bits(self.to_bits() | other.to_bits());
                let m = if other < self { other } else { tie };
                if self < other { self } else { m }
            }

            // As `minimum`, but on ties the sign bit is AND-ed (so +0.0 wins) while the
            // other bits are still OR-ed (so a NaN stays a NaN).
            #[inline(always)]
            fn maximum(self, other: Self) -> Self {
                const SIGN: $bits = 1 << (<$bits>::BITS - 1);
                let (a, b) = (self.to_bits(), other.to_bits());
                let tie = <$t>::from_bits((a | b) & ((a & b) | !SIGN));
                let m = if other > self { other } else { tie };
                if self > other { self } else { m }
            }

            // The bitwise operators are not defined on floats: `reduce` and `reduce_into`
            // reject them before any kernel runs. These act on the bit patterns only so that
            // every element type has every operation (no panicking arm in the kernels).
            #[inline(always)]
            fn bit_and(self, other: Self) -> Self {
                <$t>::from_bits(self.to_bits() & other.to_bits())
            }

            #[inline(always)]
            fn bit_or(self, other: Self) -> Self {
                <$t>::from_bits(self.to_bits() | other.to_bits())
            }

            #[inline(always)]
            fn bit_xor(self, other: Self) -> Self {
                <$t>::from_bits(self.to_bits() ^ other.to_bits())
            }

            #[inline(always)]
            fn divide(buf: &mut [Self], n: usize) {
                let d = n as $t;
                for x in buf {
                    *x /= d;
                }
            }
        }
    )*};
}
impl_float_arith!(f32: u32, f64: u64);
