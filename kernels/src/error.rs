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

impl ReduceOp {
    /// `Ok` if the operator is defined on `dtype`, else [`KernelError::UnsupportedOp`]
    /// naming both.
    pub fn check(self, dtype: DType) -> Result<(), KernelError> {
        if self.applies_to(dtype) {
            Ok(())
        } else {
            Err(KernelError::UnsupportedOp { op: self, dtype })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitwise_ops_apply_to_integers_only() {
        for dtype in DType::ALL {
            for op in ReduceOp::ARITHMETIC {
                assert!(op.applies_to(dtype), "{op} {dtype}");
                assert_eq!(op.check(dtype), Ok(()));
            }
            for op in ReduceOp::BITWISE {
                assert_eq!(op.applies_to(dtype), !dtype.is_float(), "{op} {dtype}");
                let want = if dtype.is_float() {
                    Err(KernelError::UnsupportedOp { op, dtype })
                } else {
                    Ok(())
                };
                assert_eq!(op.check(dtype), want);
            }
        }
        let msg = ReduceOp::BXor.check(DType::BF16).unwrap_err().to_string();
        assert_eq!(
            msg,
            "reduction operator bxor is not defined for bfloat16 (bitwise operators need an \
             integer type)"
        );
    }
}
