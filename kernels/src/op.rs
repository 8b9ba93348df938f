//! Reduction operators.

use std::fmt;
use std::str::FromStr;

use crate::error::KernelError;

/// A reduction operator applied element-wise by the collectives.
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
}

impl ReduceOp {
    /// Every operator, in declaration order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// Lower-case name as used by nccl-tests: "sum", "prod", "min", "max" or "avg".
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
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

    /// Parses an operator name case-insensitively ("sum", "prod", "min", "max", "avg").
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
    fn unknown_names_are_rejected() {
        for bad in ["", "add", "sum ", "mean"] {
            let err = bad.parse::<ReduceOp>().unwrap_err();
            assert_eq!(err, KernelError::UnknownOp(bad.to_owned()));
        }
        let msg = "mean".parse::<ReduceOp>().unwrap_err().to_string();
        assert!(msg.contains("'mean'") && msg.contains("sum, prod"), "{msg}");
    }
}
