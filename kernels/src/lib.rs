//! Element types, reduction operators and host reduction kernels for Chorus.
//!
//! This crate holds the data-type vocabulary shared by the whole library ([`DType`],
//! [`Element`], [`ReduceOp`]) and the CPU kernels that combine buffers during reductions
//! ([`reduce`](fn@reduce), [`reduce_into`], [`reduce_typed`], [`finish_avg`]), and the
//! forms that write past the caches for outputs larger than them
//! ([`reduce_into_streaming`], [`copy_streaming`]).
//!
//! The kernels work on raw byte slices as they arrive from the network or from user
//! sub-slices. The slices need not be aligned for their element type: aligned buffers (the
//! common case) are processed in place, unaligned ones through small aligned stack blocks.
//! Bad input never panics; it is reported as a [`KernelError`].
//!
//! # Semantics
//!
//! * **Integers** (`i8`, `u8`, `i32`, `u32`, `i64`, `u64`): `Sum` and `Prod` wrap on
//!   overflow (two's complement, like NCCL and the hardware), so `100i8 + 100 == -56` and
//!   `i64::MAX + 1 == i64::MIN`. `Min` and `Max` are exact.
//! * **Floats** (`f32`, `f64`): IEEE 754 arithmetic for `Sum` and `Prod`. `Min` and `Max`
//!   propagate NaN, as NCCL does: if either operand is NaN the result is NaN (its payload
//!   is unspecified). Signed zeros are ordered `-0.0 < +0.0`, so `min(-0.0, +0.0)` is
//!   `-0.0` and `max(-0.0, +0.0)` is `+0.0` whichever operand comes first; the result
//!   therefore does not depend on reduction order.
//! * **`f16` / `bf16`**: widened exactly to `f32` a block of 256 elements at a time,
//!   combined with the `f32` rules above, and rounded back (to nearest, ties to even,
//!   overflowing to infinity) once per kernel call. Since `f32` has more than twice the
//!   precision of either type, one `Sum` or `Prod` step gives the correctly rounded
//!   half-precision result. NaN stays NaN, with an unspecified payload.
//! * **`BAnd`, `BOr`, `BXor`**: bitwise AND, OR and XOR of the integer types' (two's
//!   complement) bit patterns, so `-1i8 & 5 == 5` and `-1i32 ^ 1 == -2`. They are not defined
//!   on floats: every kernel rejects them there with [`KernelError::UnsupportedOp`] before
//!   touching a buffer ([`ReduceOp::applies_to`] tells beforehand).
//! * **`Avg`**: the kernels treat it as `Sum`; the collective divides once at the end with
//!   [`finish_avg`]. Floats divide by `n` (`f16`/`bf16` via `f32`). Integers divide the
//!   wrapped sum by `n`, truncating toward zero (`-7 / 2 == -3`), so an integer average is
//!   only meaningful when the sum did not overflow. `n == 0` is rejected with
//!   [`KernelError::ZeroCount`].
//!
//! # GPU kernels
//!
//! With the cargo feature `cuda` (off by default), the `cuda` module offers the same
//! operations on device memory, compiled at run time by NVRTC; the crate still builds and
//! its CPU tests still run on machines without CUDA.
//!
//! # Performance
//!
//! The inner loops are plain element-wise loops over typed slices, which LLVM vectorises.
//! On x86-64 the whole kernel is compiled twice, for the baseline target (SSE2) and for
//! AVX2 + F16C, and the variant is picked at run time; `f16` conversions use the F16C
//! instructions when available.
//!
//! # Example
//!
//! ```
//! use chorus_kernels::{reduce_typed, ReduceOp};
//!
//! let mut acc = [1.0f32, 5.0, -2.0];
//! reduce_typed(ReduceOp::Max, &mut acc, &[3.0, 4.0, -1.0])?;
//! assert_eq!(acc, [3.0, 5.0, -1.0]);
//! # Ok::<(), chorus_kernels::KernelError>(())
//! ```

mod arith;
mod convert;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dtype;
pub mod env;
mod error;
mod op;
mod parse;
mod reduce;
#[cfg(test)]
mod test_rng;

pub use dtype::{DType, Element};
pub use error::KernelError;
pub use half::{bf16, f16};
pub use op::ReduceOp;
pub use reduce::{
    copy_streaming, finish_avg, reduce, reduce_into, reduce_into_streaming, reduce_typed,
};
