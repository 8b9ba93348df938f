//! `f16`/`bf16` ⇄ `f32` block conversions for the half-precision kernels.
//!
//! `half`'s slice conversions convert `bf16` one element at a time and call an out-of-line
//! F16C routine per 8 `f16` values, which dominated the kernels' run time. Here `bf16` and
//! (without F16C) `f16` use branch-free scalar conversions that LLVM vectorises, and `f16`
//! uses the F16C instructions directly on x86-64 CPUs that have them.
//!
//! Widening is exact. Narrowing rounds to nearest, ties to even, overflowing to infinity,
//! exactly like `half`'s `from_f32`; a NaN stays a NaN (its payload may change).

use half::{bf16, f16};

/// A 16-bit float type computed on as `f32`.
pub(crate) trait HalfFloat: bytemuck::Pod {
    /// Exact conversion to `f32`.
    fn widen(self) -> f32;
    /// Round-to-nearest-even conversion from `f32`.
    fn narrow(value: f32) -> Self;

    /// `out[i] = src[i].widen()`; the slices have equal lengths.
    #[inline(always)]
    fn widen_slice(out: &mut [f32], src: &[Self]) {
        for (o, h) in out.iter_mut().zip(src) {
            *o = h.widen();
        }
    }

    /// `out[i] = narrow(src[i])`; the slices have equal lengths.
    #[inline(always)]
    fn narrow_slice(out: &mut [Self], src: &[f32]) {
        for (o, f) in out.iter_mut().zip(src) {
            *o = Self::narrow(*f);
        }
    }
}

impl HalfFloat for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }

    #[inline(always)]
    fn narrow(value: f32) -> Self {
        let x = value.to_bits();
        // Adding 0x7FFF plus the lowest kept bit rounds to nearest even; finite values
        // that round past the largest bf16 carry into the exponent and become infinity.
        let rounded = x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16;
        // NaN: keep the top of the payload and set the quiet bit so it stays a NaN.
        let quiet_nan = (x >> 16) | 0x40;
        let is_nan = x & 0x7FFF_FFFF > 0x7F80_0000;
        bf16::from_bits(if is_nan { quiet_nan } else { rounded } as u16)
    }
}

impl HalfFloat for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        // After F. Giesen's `half_to_float`, with every branch turned into a select and
        // no arithmetic on subnormal f32 values (which would be slow on x86).
        let h = u32::from(self.to_bits());
        let sign = (h & 0x8000) << 16;
        // Exponent and mantissa moved to their f32 positions and rebiased by 127 - 15.
        let shifted = (h & 0x7FFF) << 13;
        let exponent = shifted & (0x7C00 << 13);
        let normal = shifted + ((127 - 15) << 23);
        // Infinity and NaN: all-ones exponent, mantissa (NaN payload) kept.
        let special = normal + ((128 - 16) << 23);
        // Zero and subnormals: build 2^-14 * (1 + m / 1024) and subtract 2^-14, exactly.
        const MIN_NORMAL: u32 = 113 << 23;
        let subnormal = (f32::from_bits(normal + (1 << 23)) - f32::from_bits(MIN_NORMAL)).to_bits();
        let bits = if exponent == 0x7C00 << 13 {
            special
        } else if exponent == 0 {
            subnormal
        } else {
            normal
        };
        f32::from_bits(bits | sign)
    }

    #[inline(always)]
    fn narrow(value: f32) -> Self {
        // After F. Giesen's `float_to_half_fast3_rtne`, with every branch turned into a select.
        let x = value.to_bits();
        let sign = (x >> 16) & 0x8000;
        let abs = x & 0x7FFF_FFFF;
        // |value| >= 65520 (rounds to infinity), infinity or NaN.
        let special = if abs > 0x7F80_0000 { 0x7E00 } else { 0x7C00 };
        // |value| < 2^-14: the result is subnormal or zero. Adding a magic constant puts the
        // 10 mantissa bits at the bottom, rounded to nearest even by the FPU.
        const DENORM_MAGIC: u32 = ((127 - 15) + (23 - 10) + 1) << 23;
        let sub = (f32::from_bits(abs) + f32::from_bits(DENORM_MAGIC))
            .to_bits()
            .wrapping_sub(DENORM_MAGIC);
        // Normal: rebias the exponent (15 - 127) and round to nearest even by adding just
        // under half an ulp plus the lowest kept bit; a carry may reach infinity.
        const REBIAS_AND_HALF: u32 = (15u32.wrapping_sub(127) << 23).wrapping_add(0xFFF);
        let odd = (abs >> 13) & 1;
        let normal = abs.wrapping_add(REBIAS_AND_HALF + odd) >> 13;
        let bits = if abs >= (127 + 16) << 23 {
            special
        } else if abs < 113 << 23 {
            sub
        } else {
            normal
        };
        f16::from_bits((bits | sign) as u16)
    }

    #[inline(always)]
    fn widen_slice(out: &mut [f32], src: &[Self]) {
        #[cfg(target_arch = "x86_64")]
        let done = if std::is_x86_feature_detected!("f16c") {
            // SAFETY: the CPU supports F16C (and therefore AVX), checked just above.
            unsafe { f16c::widen(out, src) }
        } else {
            0
        };
        #[cfg(not(target_arch = "x86_64"))]
        let done = 0;
        for (o, h) in out[done..].iter_mut().zip(&src[done..]) {
            *o = h.widen();
        }
    }

    #[inline(always)]
    fn narrow_slice(out: &mut [Self], src: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        let done = if std::is_x86_feature_detected!("f16c") {
            // SAFETY: the CPU supports F16C (and therefore AVX), checked just above.
            unsafe { f16c::narrow(out, src) }
        } else {
            0
        };
        #[cfg(not(target_arch = "x86_64"))]
        let done = 0;
        for (o, f) in out[done..].iter_mut().zip(&src[done..]) {
            *o = Self::narrow(*f);
        }
    }
}

/// `f16` conversions with the x86 F16C instructions, 8 lanes at a time.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::{
        __m128i, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps,
        _mm_loadu_si128, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
    };

    use half::f16;

    /// Widens the longest multiple-of-8 prefix of `src` into `out`; returns its length.
    ///
    /// # Safety
    /// The CPU must support AVX and F16C.
    #[target_feature(enable = "avx,f16c")]
    #[inline]
    pub(super) unsafe fn widen(out: &mut [f32], src: &[f16]) -> usize {
        let n = out.len().min(src.len()) / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: `i + 8 <= n`, so 16 bytes of `src` and 32 bytes of `out` at `i` are in
            // bounds; both accesses are unaligned; the caller guarantees F16C.
            unsafe {
                let halves = _mm_loadu_si128(src.as_ptr().add(i).cast::<__m128i>());
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(halves));
            }
        }
        n
    }

    /// Narrows (round to nearest even) the longest multiple-of-8 prefix of `src` into
    /// `out`; returns its length.
    ///
    /// # Safety
    /// The CPU must support AVX and F16C.
    #[target_feature(enable = "avx,f16c")]
    #[inline]
    pub(super) unsafe fn narrow(out: &mut [f16], src: &[f32]) -> usize {
        let n = out.len().min(src.len()) / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: `i + 8 <= n`, so 32 bytes of `src` and 16 bytes of `out` at `i` are in
            // bounds; both accesses are unaligned; the caller guarantees F16C.
            unsafe {
                let singles = _mm256_loadu_ps(src.as_ptr().add(i));
                let halves = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(singles);
                _mm_storeu_si128(out.as_mut_ptr().add(i).cast::<__m128i>(), halves);
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Equal bits, or both NaN (NaN payloads are not specified).
    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    /// f32 values around every rounding boundary of a 16-bit type: each representable
    /// value, each midpoint between neighbours, and the f32 values just either side.
    fn boundary_values<H: HalfFloat>() -> Vec<f32> {
        let mut values = Vec::new();
        for bits in 0..=u16::MAX {
            let lo = H::widen(bytemuck::cast(bits));
            let hi = H::widen(bytemuck::cast(bits.wrapping_add(1)));
            let mut push_around = |v: f32| {
                if v.is_finite() {
                    values.extend([v, f32::from_bits(v.to_bits() + 1)]);
                    if v.to_bits() & 0x7FFF_FFFF != 0 {
                        values.push(f32::from_bits(v.to_bits() - 1));
                    }
                }
            };
            push_around(lo);
            if lo.is_finite() && hi.is_finite() && lo.is_sign_negative() == hi.is_sign_negative() {
                push_around(((f64::from(lo) + f64::from(hi)) / 2.0) as f32);
            }
        }
        // Pseudo-random bit patterns (xorshift32), covering NaNs, infinities and huge values.
        let mut x = 0x1234_5678u32;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            values.push(f32::from_bits(x));
        }
        values.extend([
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            65520.0,
        ]);
        values.extend([65519.996, f32::MIN_POSITIVE, 1e-30, -1e-30, 0.0, -0.0]);
        values
    }

    #[test]
    fn bf16_widen_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let h = bf16::from_bits(bits);
            assert!(same(h.widen(), h.to_f32()), "{bits:#06x}");
        }
    }

    #[test]
    fn f16_widen_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            assert!(same(h.widen(), h.to_f32()), "{bits:#06x}");
        }
    }

    #[test]
    fn bf16_narrow_matches_half() {
        for v in boundary_values::<bf16>() {
            let (got, want) = (bf16::narrow(v), bf16::from_f32(v));
            let ok = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
            assert!(
                ok,
                "{v:e} ({:#010x}): got {got:?}, want {want:?}",
                v.to_bits()
            );
        }
    }

    #[test]
    fn f16_narrow_matches_half() {
        for v in boundary_values::<f16>() {
            let (got, want) = (f16::narrow(v), f16::from_f32(v));
            let ok = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
            assert!(
                ok,
                "{v:e} ({:#010x}): got {got:?}, want {want:?}",
                v.to_bits()
            );
        }
    }

    /// The slice conversions (F16C for `f16` where available) agree with the scalar ones,
    /// including on lengths that leave a tail of fewer than 8 elements.
    fn check_slices<H: HalfFloat + std::fmt::Debug>() {
        let all: Vec<H> = (0..=u16::MAX).map(bytemuck::cast).collect();
        for len in [0, 1, 7, 8, 9, 65536] {
            let mut wide = vec![0f32; len];
            H::widen_slice(&mut wide, &all[..len]);
            for (h, w) in all.iter().zip(&wide) {
                assert!(same(*w, h.widen()), "widen {h:?}");
            }
        }
        let values = boundary_values::<H>();
        let mut narrow = vec![H::zeroed(); values.len()];
        H::narrow_slice(&mut narrow, &values);
        for (v, n) in values.iter().zip(&narrow) {
            let want = H::narrow(*v);
            assert!(
                same(n.widen(), want.widen()),
                "narrow {v:e}: got {n:?}, want {want:?}"
            );
        }
    }

    #[test]
    fn f16_slice_conversions_match_scalar() {
        check_slices::<f16>();
    }

    #[test]
    fn bf16_slice_conversions_match_scalar() {
        check_slices::<bf16>();
    }
}
