//! The error type returned by every fallible function in this crate.

use crate::dtype::DType;
use crate::op::ReduceOp;

/// Why a kernel call or a name lookup was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// A data type name did not match any known [`DType`].
    #[error(
        "unknown data type '{0}' (expected one of: float, double, half, bfloat16, int8, uint8, \
         int32, uint32, int64, uint64)"
    )]
    UnknownDType(String),
    /// A reduction operator name did not match any known [`ReduceOp`](crate::ReduceOp).
    #[error(
        "unknown reduction operator '{0}' (expected one of: sum, prod, min, max, avg, band, \
         bor, bxor)"
    )]
    UnknownOp(String),
    /// The reduction operator is not defined on the data type: a bitwise operator on a
    /// floating-point type (see [`ReduceOp::applies_to`](crate::ReduceOp::applies_to)).
    #[error(
        "reduction operator {op} is not defined for {dtype} (bitwise operators need an integer \
         type)"
    )]
    UnsupportedOp {
        /// The operator asked for.
        op: ReduceOp,
        /// The data type it was asked for on.
        dtype: DType,
    },
    /// The buffers passed to a kernel have different byte lengths.
    #[error("buffer length mismatch: destination is {dst} bytes but source is {src} bytes")]
    LengthMismatch {
        /// Byte length of the destination (output) buffer.
        dst: usize,
        /// Byte length of the offending source buffer.
        src: usize,
    },
    /// A buffer's byte length is not a whole number of elements.
    #[error(
        "buffer length {len} bytes is not a multiple of the {} byte size of {dtype}",
        dtype.size()
    )]
    Misaligned {
        /// Byte length of the buffer.
        len: usize,
        /// Data type the buffer was to be interpreted as.
        dtype: DType,
    },
    /// [`finish_avg`](crate::finish_avg) was asked to divide by zero contributors.
    #[error("cannot average over zero contributors (n must be at least 1)")]
    ZeroCount,
}
