//! Types and operators by name, as the perf tools' flags, the environment and the bindings
//! give them: nccl-tests' names, a few aliases, any case.

use std::str::FromStr;

use crate::dtype::DType;
use crate::error::KernelError;
use crate::op::ReduceOp;

impl DType {
    /// Extra accepted spellings besides [`DType::name`] (all matched case-insensitively).
    fn aliases(self) -> &'static [&'static str] {
        match self {
            DType::F32 => &["f32", "float32"],
            DType::F64 => &["f64", "float64"],
            DType::F16 => &["f16", "float16"],
            DType::BF16 => &["bf16"],
            DType::I8 => &["i8"],
            DType::U8 => &["u8"],
            DType::I32 => &["i32", "int"],
            DType::U32 => &["u32"],
            DType::I64 => &["i64"],
            DType::U64 => &["u64"],
        }
    }
}

impl FromStr for DType {
    type Err = KernelError;

    /// Parses an nccl-tests name or an alias (`f32`, `float32`, `bf16`, `int`, ...), ignoring case.
    /// Fails with [`KernelError::UnknownDType`] for anything else.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::ALL
            .into_iter()
            .find(|d| {
                d.name().eq_ignore_ascii_case(s)
                    || d.aliases().iter().any(|a| a.eq_ignore_ascii_case(s))
            })
            .ok_or_else(|| KernelError::UnknownDType(s.to_owned()))
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
    fn dtype_names_round_trip_through_display_and_from_str() {
        for d in DType::ALL {
            assert_eq!(d.to_string(), d.name());
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert_eq!(d.name().to_uppercase().parse::<DType>().unwrap(), d);
            for alias in d.aliases() {
                assert_eq!(alias.parse::<DType>().unwrap(), d, "{alias}");
            }
        }
    }

    #[test]
    fn aliases_parse_to_expected_types() {
        let cases = [
            ("f32", DType::F32),
            ("Float32", DType::F32),
            ("F64", DType::F64),
            ("float64", DType::F64),
            ("f16", DType::F16),
            ("FLOAT16", DType::F16),
            ("BF16", DType::BF16),
            ("i8", DType::I8),
            ("u8", DType::U8),
            ("int", DType::I32),
            ("I32", DType::I32),
            ("u32", DType::U32),
            ("i64", DType::I64),
            ("u64", DType::U64),
        ];
        for (s, d) in cases {
            assert_eq!(s.parse::<DType>().unwrap(), d, "{s}");
        }
    }

    #[test]
    fn unknown_dtype_names_are_rejected() {
        for bad in ["", "foo", "int16", "float ", "uint"] {
            assert_eq!(
                bad.parse::<DType>().unwrap_err(),
                KernelError::UnknownDType(bad.to_owned())
            );
        }
        let msg = "foo".parse::<DType>().unwrap_err().to_string();
        assert!(
            msg.starts_with("unknown data type 'foo' (expected one of: float, double"),
            "{msg}"
        );
    }

    #[test]
    fn op_names_round_trip_through_display_and_from_str() {
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
    fn unknown_op_names_are_rejected() {
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
