//! Reduction operators.

use std::fmt;

use crate::dtype::DType;

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
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_and_bitwise_split_all() {
        let mut joined = ReduceOp::ARITHMETIC.to_vec();
        joined.extend(ReduceOp::BITWISE);
        assert_eq!(joined, ReduceOp::ALL);
        assert!(ReduceOp::ARITHMETIC.iter().all(|op| !op.is_bitwise()));
        assert!(ReduceOp::BITWISE.iter().all(|op| op.is_bitwise()));
    }
}
