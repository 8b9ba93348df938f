//! Host reduction kernels on raw byte buffers.
//!
//! Every public function validates the operator for the dtype and the lengths, then
//! describes its work as a [`Job`] and hands it to [`run`], which picks the element type
//! from the [`DType`], views the bytes as typed slices (copying through small aligned stack
//! blocks when a buffer is not aligned for the type) and runs plain element-wise zip loops
//! that LLVM vectorises. `f16`/`bf16` are widened to `f32` a block at a time.
//!
//! All of that is `#[inline(always)]` down to the scalar operations, so on x86-64 [`run`]
//! can offer a second copy of the same code compiled for AVX2 (256-bit vectors) and F16C,
//! chosen at run time.

use bytemuck::Pod;
use half::{bf16, f16};

use crate::arith::Arith;
use crate::convert::HalfFloat;
use crate::dtype::{DType, Element};
use crate::error::KernelError;
use crate::op::ReduceOp;

#[cfg(test)]
mod tests;

/// Elements per stack block, for the `f16`/`bf16` widening and the unaligned fallback.
const BLOCK: usize = 256;

/// Runs `$body` with the type alias `$T` bound to the Rust type of `$dtype`.
macro_rules! with_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => with_type!(@ f32, $T, $body),
            DType::F64 => with_type!(@ f64, $T, $body),
            DType::F16 => with_type!(@ f16, $T, $body),
            DType::BF16 => with_type!(@ bf16, $T, $body),
            DType::I8 => with_type!(@ i8, $T, $body),
            DType::U8 => with_type!(@ u8, $T, $body),
            DType::I32 => with_type!(@ i32, $T, $body),
            DType::U32 => with_type!(@ u32, $T, $body),
            DType::I64 => with_type!(@ i64, $T, $body),
            DType::U64 => with_type!(@ u64, $T, $body),
        }
    };
    (@ $ty:ty, $T:ident, $body:expr) => {{
        type $T = $ty;
        $body
    }};
}

/// `dst[i] = dst[i] op src[i]` for every element, on raw bytes of the given dtype.
///
/// `Avg` behaves as `Sum` here; the collective divides once at the end with [`finish_avg`].
/// Fails with [`KernelError::UnsupportedOp`] for a bitwise operator on a float type,
/// [`KernelError::LengthMismatch`] if the byte lengths differ and
/// [`KernelError::Misaligned`] if they are not a multiple of the element size.
pub fn reduce(op: ReduceOp, dtype: DType, dst: &mut [u8], src: &[u8]) -> Result<(), KernelError> {
    op.check(dtype)?;
    check_lengths(dtype, dst.len(), &[src.len()])?;
    run(dtype, dst, [src], Combine(op), Stores::Cached);
    Ok(())
}

/// `out[i] = a[i] op b[i]` for every element (the out-of-place form of [`reduce`]).
///
/// Fails with [`KernelError::UnsupportedOp`] for a bitwise operator on a float type,
/// [`KernelError::LengthMismatch`] unless all three byte lengths are equal and
/// [`KernelError::Misaligned`] if they are not a multiple of the element size.
pub fn reduce_into(
    op: ReduceOp,
    dtype: DType,
    out: &mut [u8],
    a: &[u8],
    b: &[u8],
) -> Result<(), KernelError> {
    combine_into(op, dtype, out, [a, b], Stores::Cached)
}

/// [`reduce_into`], writing `out` with streaming stores: for an output nothing reads again
/// while it could still be in the caches.
///
/// Each whole 64-byte line of `out` is written with streaming (non-temporal) stores, which
/// go to memory without first reading the line into the caches: one transfer less per line
/// (a quarter of a reduction's memory traffic, a third of a copy's) for an output of many
/// megabytes that nothing reads before it would have left the caches anyway, but an output
/// read right after comes from memory. The stores are fenced before the function returns.
/// Off x86-64, for `f16` and `bf16` (whose conversions, not the memory, bound the rate),
/// and where a buffer is not aligned for the element type, `out` is written as
/// [`reduce_into`] writes it.
///
/// Fails as [`reduce_into`] does.
pub fn reduce_into_streaming(
    op: ReduceOp,
    dtype: DType,
    out: &mut [u8],
    a: &[u8],
    b: &[u8],
) -> Result<(), KernelError> {
    combine_into(op, dtype, out, [a, b], Stores::Streaming)
}

/// [`reduce_into`] with the given stores.
fn combine_into(
    op: ReduceOp,
    dtype: DType,
    out: &mut [u8],
    [a, b]: [&[u8]; 2],
    stores: Stores,
) -> Result<(), KernelError> {
    op.check(dtype)?;
    check_lengths(dtype, out.len(), &[a.len(), b.len()])?;
    run(dtype, out, [a, b], CombineInto(op), stores);
    Ok(())
}

/// `dst.copy_from_slice(src)` with streaming stores (see [`reduce_into_streaming`]).
///
/// Fails with [`KernelError::LengthMismatch`] if the lengths differ.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) -> Result<(), KernelError> {
    check_lengths(DType::U8, dst.len(), &[src.len()])?;
    run(DType::U8, dst, [src], Assign, Stores::Streaming);
    Ok(())
}

/// Typed convenience for [`reduce`]: `dst[i] = dst[i] op src[i]`.
///
/// Fails with [`KernelError::UnsupportedOp`] for a bitwise operator on a float type and
/// [`KernelError::LengthMismatch`] (reported in bytes) if the lengths differ.
pub fn reduce_typed<T: Element>(op: ReduceOp, dst: &mut [T], src: &[T]) -> Result<(), KernelError> {
    reduce(
        op,
        T::DTYPE,
        bytemuck::cast_slice_mut(dst),
        bytemuck::cast_slice(src),
    )
}

/// Divides every element by `n`, the finishing step of [`ReduceOp::Avg`].
///
/// Floats divide (`f16`/`bf16` via `f32`); integers divide the (wrapped) sum, truncating
/// toward zero. Fails with [`KernelError::ZeroCount`] if `n == 0` and
/// [`KernelError::Misaligned`] if the length is not a multiple of the element size.
pub fn finish_avg(dtype: DType, buf: &mut [u8], n: usize) -> Result<(), KernelError> {
    if n == 0 {
        return Err(KernelError::ZeroCount);
    }
    check_lengths(dtype, buf.len(), &[])?;
    run(dtype, buf, [], Divide(n), Stores::Cached);
    Ok(())
}

/// Checks that every source length equals `dst_len` and that it is a whole number of elements.
pub(crate) fn check_lengths(
    dtype: DType,
    dst_len: usize,
    srcs: &[usize],
) -> Result<(), KernelError> {
    if let Some(&src) = srcs.iter().find(|&&s| s != dst_len) {
        return Err(KernelError::LengthMismatch { dst: dst_len, src });
    }
    if dst_len % dtype.size() != 0 {
        return Err(KernelError::Misaligned {
            len: dst_len,
            dtype,
        });
    }
    Ok(())
}

/// An element-wise operation on a destination slice and `N` equally long source slices.
trait Job<const N: usize>: Copy {
    /// Whether the operation reads the destination's previous contents.
    const READS_DST: bool;
    /// Applies the operation to equally long slices of a natively computed type.
    fn apply<T: Arith>(self, dst: &mut [T], srcs: [&[T]; N]);
}

/// `dst[i] = dst[i] op src[i]`, with `Avg` treated as `Sum`.
#[derive(Clone, Copy)]
struct Combine(ReduceOp);

impl Job<1> for Combine {
    const READS_DST: bool = true;

    #[inline(always)]
    fn apply<T: Arith>(self, dst: &mut [T], [src]: [&[T]; 1]) {
        match self.0 {
            ReduceOp::Sum | ReduceOp::Avg => zip_in_place(dst, src, T::sum),
            ReduceOp::Prod => zip_in_place(dst, src, T::prod),
            ReduceOp::Min => zip_in_place(dst, src, T::minimum),
            ReduceOp::Max => zip_in_place(dst, src, T::maximum),
            ReduceOp::BAnd => zip_in_place(dst, src, T::bit_and),
            ReduceOp::BOr => zip_in_place(dst, src, T::bit_or),
            ReduceOp::BXor => zip_in_place(dst, src, T::bit_xor),
        }
    }
}

/// `out[i] = a[i] op b[i]`, with `Avg` treated as `Sum`.
#[derive(Clone, Copy)]
struct CombineInto(ReduceOp);

impl Job<2> for CombineInto {
    const READS_DST: bool = false;

    #[inline(always)]
    fn apply<T: Arith>(self, out: &mut [T], [a, b]: [&[T]; 2]) {
        match self.0 {
            ReduceOp::Sum | ReduceOp::Avg => zip_into(out, a, b, T::sum),
            ReduceOp::Prod => zip_into(out, a, b, T::prod),
            ReduceOp::Min => zip_into(out, a, b, T::minimum),
            ReduceOp::Max => zip_into(out, a, b, T::maximum),
            ReduceOp::BAnd => zip_into(out, a, b, T::bit_and),
            ReduceOp::BOr => zip_into(out, a, b, T::bit_or),
            ReduceOp::BXor => zip_into(out, a, b, T::bit_xor),
        }
    }
}

/// `dst[i] = src[i]`.
#[derive(Clone, Copy)]
struct Assign;

impl Job<1> for Assign {
    const READS_DST: bool = false;

    #[inline(always)]
    fn apply<T: Arith>(self, dst: &mut [T], [src]: [&[T]; 1]) {
        dst.copy_from_slice(src);
    }
}

/// `buf[i] /= n` for `n >= 1`.
#[derive(Clone, Copy)]
struct Divide(usize);

impl Job<0> for Divide {
    const READS_DST: bool = true;

    #[inline(always)]
    fn apply<T: Arith>(self, buf: &mut [T], []: [&[T]; 0]) {
        T::divide(buf, self.0);
    }
}

/// The in-place hot loop: a plain zip so LLVM vectorises it.
#[inline(always)]
fn zip_in_place<T: Copy>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f(*d, *s);
    }
}

/// The out-of-place hot loop: a plain zip so LLVM vectorises it.
#[inline(always)]
fn zip_into<T: Copy>(out: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    for (o, (x, y)) in out.iter_mut().zip(a.iter().zip(b)) {
        *o = f(*x, *y);
    }
}

/// How a kernel writes its destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stores {
    /// Through the caches, as every store does.
    Cached,
    /// Whole cache lines with streaming stores ([`reduce_into_streaming`]).
    Streaming,
}

/// Runs `job` on validated buffers of `dtype`, through the AVX2 + F16C build of the loops
/// when the CPU supports it.
fn run<J: Job<N>, const N: usize>(
    dtype: DType,
    dst: &mut [u8],
    srcs: [&[u8]; N],
    job: J,
    stores: Stores,
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c") {
        // SAFETY: both features were detected on this CPU just above.
        unsafe { run_avx2(dtype, dst, srcs, job, stores) };
        return;
    }
    run_inline(dtype, dst, srcs, job, stores);
}

/// [`run_inline`] compiled with AVX2 and F16C enabled.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn run_avx2<J: Job<N>, const N: usize>(
    dtype: DType,
    dst: &mut [u8],
    srcs: [&[u8]; N],
    job: J,
    stores: Stores,
) {
    run_inline(dtype, dst, srcs, job, stores);
}

/// Runs `job` on validated buffers of `dtype`; inlined into each instruction-set variant.
#[inline(always)]
fn run_inline<J: Job<N>, const N: usize>(
    dtype: DType,
    dst: &mut [u8],
    srcs: [&[u8]; N],
    job: J,
    stores: Stores,
) {
    match stores {
        Stores::Cached => with_type!(dtype, T => drive::<T, J, N>(dst, srcs, job)),
        Stores::Streaming => with_type!(dtype, T => stream::<T, J, N>(dst, srcs, job)),
    }
}

/// Views `dst` and `srcs` (equal lengths, whole elements) as `[T]` and applies `job`.
///
/// When any buffer is not aligned for `T`, the job instead runs block by block on aligned
/// stack copies; `dst` is copied in only if the job reads it, and always copied back.
#[inline(always)]
fn drive<T: Kernel, J: Job<N>, const N: usize>(dst: &mut [u8], srcs: [&[u8]; N], job: J) {
    let typed_srcs = srcs.map(|s| bytemuck::try_cast_slice::<u8, T>(s).ok());
    if typed_srcs.iter().all(Option::is_some) {
        if let Ok(d) = bytemuck::try_cast_slice_mut::<u8, T>(dst) {
            T::apply(job, d, typed_srcs.map(|s| s.unwrap_or_default()));
            return;
        }
    }
    let size = std::mem::size_of::<T>();
    let mut dst_buf = [T::zeroed(); BLOCK];
    let mut src_bufs = [[T::zeroed(); BLOCK]; N];
    for (i, d) in dst.chunks_mut(BLOCK * size).enumerate() {
        let n = d.len() / size;
        let bytes = i * BLOCK * size..i * BLOCK * size + d.len();
        for (buf, src) in src_bufs.iter_mut().zip(srcs) {
            bytemuck::cast_slice_mut(&mut buf[..n]).copy_from_slice(&src[bytes.clone()]);
        }
        let dst_buf = &mut dst_buf[..n];
        if J::READS_DST {
            bytemuck::cast_slice_mut(&mut *dst_buf).copy_from_slice(d);
        }
        T::apply(job, dst_buf, std::array::from_fn(|j| &src_bufs[j][..n]));
        d.copy_from_slice(bytemuck::cast_slice(dst_buf));
    }
}

/// As [`drive`], with [`Stores::Streaming`].
#[inline(always)]
fn stream<T: Kernel, J: Job<N>, const N: usize>(dst: &mut [u8], srcs: [&[u8]; N], job: J) {
    #[cfg(target_arch = "x86_64")]
    if stream_lines::<T, J, N>(dst, srcs, job) {
        return;
    }
    drive::<T, J, N>(dst, srcs, job);
}

/// Runs `job`, writing every whole, aligned cache line of `dst` with streaming stores: each
/// line is computed on the stack, then streamed out, and the ends of `dst` outside whole
/// lines go through [`drive`]. Does nothing and returns false for a job that reads `dst`
/// (its lines come into the caches anyway), for a `T` that does not stream
/// ([`Kernel::STREAMS`]), and when `dst` or a source is not aligned for `T`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn stream_lines<T: Kernel, J: Job<N>, const N: usize>(
    dst: &mut [u8],
    srcs: [&[u8]; N],
    job: J,
) -> bool {
    use std::arch::x86_64::{__m128i, _mm_load_si128, _mm_sfence, _mm_stream_si128};

    /// Bytes of a cache line.
    const LINE: usize = 64;
    /// One cache line's worth of elements, computed on the stack before being streamed out.
    #[repr(C, align(64))]
    struct Line([u8; LINE]);

    let size = std::mem::size_of::<T>();
    let head = dst.as_ptr().align_offset(LINE).min(dst.len());
    let body = (dst.len() - head) / LINE * LINE;
    let typed = srcs.map(|s| bytemuck::try_cast_slice::<u8, T>(&s[head..head + body]).ok());
    if J::READS_DST || !T::STREAMS || head % size != 0 || typed.iter().any(Option::is_none) {
        return false;
    }
    let (front, rest) = dst.split_at_mut(head);
    let (lines, back) = rest.split_at_mut(body);
    drive::<T, J, N>(front, srcs.map(|s| &s[..head]), job);
    let typed = typed.map(|s| s.unwrap_or_default());
    let per_line = LINE / size;
    let mut line = Line([0; LINE]);
    for (i, out) in lines.chunks_exact_mut(LINE).enumerate() {
        let values: &mut [T] = bytemuck::cast_slice_mut(&mut line.0);
        let at = i * per_line..(i + 1) * per_line;
        T::apply(job, values, typed.map(|s| &s[at.clone()]));
        let to = out.as_mut_ptr().cast::<__m128i>();
        let from = line.0.as_ptr().cast::<__m128i>();
        // SAFETY: SSE2 is part of x86-64; `out` is a whole line at a 64-byte boundary (the
        // split above) and so is `line` (`Line`'s alignment): four aligned 16-byte parts.
        unsafe {
            for k in 0..LINE / 16 {
                _mm_stream_si128(to.add(k), _mm_load_si128(from.add(k)));
            }
        }
    }
    // Streaming stores are weakly ordered: fence them before any later store (a flag that
    // tells another process the data is there).
    // SAFETY: SSE is part of x86-64; a fence touches no memory.
    unsafe { _mm_sfence() };
    drive::<T, J, N>(back, srcs.map(|s| &s[head + body..]), job);
    true
}

/// How a job runs on slices of one element type (which always have equal lengths).
trait Kernel: Pod {
    /// Whether streaming kernels stream this type: not `f16` and `bf16`, whose widening
    /// bounds a core's rate below what the memory allows, so that computing a line at a
    /// time only adds work.
    const STREAMS: bool = true;

    /// Applies `job` to `dst` and `srcs`.
    fn apply<J: Job<N>, const N: usize>(job: J, dst: &mut [Self], srcs: [&[Self]; N]);
}

impl<T: Arith> Kernel for T {
    #[inline(always)]
    fn apply<J: Job<N>, const N: usize>(job: J, dst: &mut [T], srcs: [&[T]; N]) {
        job.apply(dst, srcs);
    }
}

macro_rules! impl_half_kernel {
    ($($h:ty),*) => {$(
        impl Kernel for $h {
            const STREAMS: bool = false;

            #[inline(always)]
            fn apply<J: Job<N>, const N: usize>(job: J, dst: &mut [Self], srcs: [&[Self]; N]) {
                via_f32(job, dst, srcs);
            }
        }
    )*};
}
impl_half_kernel!(f16, bf16);

/// Applies `job` in `f32` to `dst` and `srcs` widened one stack block at a time, rounding
/// each block of `dst` back once.
#[inline(always)]
fn via_f32<H: HalfFloat, J: Job<N>, const N: usize>(job: J, dst: &mut [H], srcs: [&[H]; N]) {
    let mut dst_buf = [0f32; BLOCK];
    let mut src_bufs = [[0f32; BLOCK]; N];
    for (i, d) in dst.chunks_mut(BLOCK).enumerate() {
        let n = d.len();
        let range = i * BLOCK..i * BLOCK + n;
        for (buf, src) in src_bufs.iter_mut().zip(srcs) {
            H::widen_slice(&mut buf[..n], &src[range.clone()]);
        }
        let dst_buf = &mut dst_buf[..n];
        if J::READS_DST {
            H::widen_slice(dst_buf, d);
        }
        job.apply(dst_buf, std::array::from_fn(|j| &src_bufs[j][..n]));
        H::narrow_slice(d, dst_buf);
    }
}
