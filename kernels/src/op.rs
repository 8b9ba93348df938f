//! Reduction operators.

use std::fmt;
use std::str::FromStr;

use crate::dtype::DType;
use crate::error::KernelError;

/// A reduction operator applied element-wise by the collectives.
///
/// The arithmetic operators ([`ReduceOp::ARITHMETIC`]) apply to every [`DType`]; the
/// bitwise ones ([`ReduceOp::BITWISE`]) to integer types only (see
/// [`ReduceOp::applies_to`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum of all contributions (wrapping for integers).
    Sum,
    /// Product of all contributions (wrapping for integers).
    Prod,
    /// Minimum of all contributions (NaN-propagating for floats).
    Min,
    /// Maximum of all contributions (NaN-propagating for floats).
    Max,
    /// Mean of all contributions: reduced as `Sum`, then divided once by [`finish_avg`](crate::finish_avg).
    Avg,
    /// Bitwise AND of all contributions (integer types only).
    BAnd,
    /// Bitwise OR of all contributions (integer types only).
    BOr,
    /// Bitwise exclusive OR of all contributions (integer types only).
    BXor,
}

impl ReduceOp {
    /// Every operator, in declaration order. Not every one applies to every data type:
    /// filter with [`ReduceOp::applies_to`].
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::BAnd,
        ReduceOp::BOr,
        ReduceOp::BXor,
    ];

    /// The arithmetic operators, which apply to every data type.
    pub const ARITHMETIC: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// The bitwise operators, which apply to integer types only.
    pub const BITWISE: [ReduceOp; 3] = [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor];

    /// Lower-case name: "sum", "prod", "min", "max", "avg" (as nccl-tests spells them),
    /// "band", "bor" or "bxor".
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
        }
    }

    /// Whether this is a bitwise operator (`BAnd`, `BOr` or `BXor`).
    pub fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor)
    }

    /// Whether the operator is defined on `dtype`: the arithmetic ones on every type, the
    /// bitwise ones on integer types only.
    pub fn applies_to(self, dtype: DType) -> bool {
        !(self.is_bitwise() && dtype.is_float())
    }

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

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = KernelError;

    /// Parses an operator name case-insensitively ("sum", "prod", "min", "max", "avg",
    /// "band", "bor", "bxor").
    /// Fails with [`KernelError::UnknownOp`] for anything else.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ReduceOp::ALL
            .into_iter()
            .find(|op| op.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| KernelError::UnknownOp(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_display_and_from_str() {
        for op in ReduceOp::ALL {
            assert_eq!(op.to_string(), op.name());
            assert_eq!(op.name().parse::<ReduceOp>().unwrap(), op);
            assert_eq!(op.name().to_uppercase().parse::<ReduceOp>().unwrap(), op);
        }
        assert_eq!("Max".parse::<ReduceOp>().unwrap(), ReduceOp::Max);
    }

    #[test]
    fn bitwise_names_are_torch_s() {
        let names = ReduceOp::BITWISE.map(ReduceOp::name);
        assert_eq!(names, ["band", "bor", "bxor"]);
        for (text, op) in [
            ("band", ReduceOp::BAnd),
            ("BOR", ReduceOp::BOr),
            ("BXor", ReduceOp::BXor),
        ] {
            assert_eq!(text.parse::<ReduceOp>().unwrap(), op);
        }
        assert_eq!(format!("[{:>5}]", ReduceOp::BOr), "[  bor]");
        for bad in ["and", "xor", "b_and", "bitwise_and"] {
            assert!(bad.parse::<ReduceOp>().is_err(), "{bad}");
        }
    }

    #[test]
    fn arithmetic_and_bitwise_split_all() {
        let mut joined = ReduceOp::ARITHMETIC.to_vec();
        joined.extend(ReduceOp::BITWISE);
        assert_eq!(joined, ReduceOp::ALL);
        assert!(ReduceOp::ARITHMETIC.iter().all(|op| !op.is_bitwise()));
        assert!(ReduceOp::BITWISE.iter().all(|op| op.is_bitwise()));
    }

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

    #[test]
    fn unknown_names_are_rejected() {
        for bad in ["", "add", "sum ", "mean"] {
            let err = bad.parse::<ReduceOp>().unwrap_err();
            assert_eq!(err, KernelError::UnknownOp(bad.to_owned()));
        }
        let msg = "mean".parse::<ReduceOp>().unwrap_err().to_string();
        assert!(msg.contains("'mean'"), "{msg}");
        for op in ReduceOp::ALL {
            assert!(msg.contains(op.name()), "{msg} lacks {op}");
        }
    }
}
