//! Data types: the runtime [`DType`] tag and the compile-time [`Element`] trait.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::error::KernelError;

/// The element type of a buffer, as a runtime tag.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float (`f32`).
    F32,
    /// 64-bit IEEE float (`f64`).
    F64,
    /// 16-bit IEEE half float ([`f16`](struct@f16)).
    F16,
    /// 16-bit brain float ([`bf16`](struct@bf16)).
    BF16,
    /// Signed 8-bit integer (`i8`).
    I8,
    /// Unsigned 8-bit integer (`u8`).
    U8,
    /// Signed 32-bit integer (`i32`).
    I32,
    /// Unsigned 32-bit integer (`u32`).
    U32,
    /// Signed 64-bit integer (`i64`).
    I64,
    /// Unsigned 64-bit integer (`u64`).
    U64,
}

impl DType {
    /// Every data type, in declaration order.
    pub const ALL: [DType; 10] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
    ];

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// The nccl-tests name of the type ("float", "double", "half", "bfloat16", "int8", ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F64 => "double",
            DType::F16 => "half",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::U32 => "uint32",
            DType::I64 => "int64",
            DType::U64 => "uint64",
        }
    }

    /// Whether the type is a floating-point type (f32, f64, f16 or bf16).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

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

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
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

/// Element types the library accepts in typed APIs.
///
/// Implemented for `f32`, `f64`, [`f16`](struct@f16), [`bf16`](struct@bf16), `i8`, `u8`,
/// `i32`, `u32`, `i64` and `u64`.
/// `DTYPE` must describe the exact in-memory layout of `Self`; the typed APIs reinterpret
/// `&[Self]` as bytes of that type.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The runtime tag describing `Self`.
    const DTYPE: DType;
}

macro_rules! impl_element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(impl Element for $t {
            const DTYPE: DType = DType::$d;
        })*
    };
}

impl_element! {
    f32 => F32, f64 => F64, f16 => F16, bf16 => BF16, i8 => I8,
    u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size_of_dtype<T: Element>() -> (DType, usize) {
        (T::DTYPE, std::mem::size_of::<T>())
    }

    #[test]
    fn element_dtypes_match_rust_sizes() {
        let all = [
            size_of_dtype::<f32>(),
            size_of_dtype::<f64>(),
            size_of_dtype::<f16>(),
            size_of_dtype::<bf16>(),
            size_of_dtype::<i8>(),
            size_of_dtype::<u8>(),
            size_of_dtype::<i32>(),
            size_of_dtype::<u32>(),
            size_of_dtype::<i64>(),
            size_of_dtype::<u64>(),
        ];
        for (i, (dtype, size)) in all.into_iter().enumerate() {
            assert_eq!(dtype, DType::ALL[i]);
            assert_eq!(dtype.size(), size, "{dtype}");
        }
    }

    #[test]
    fn names_round_trip_through_display_and_from_str() {
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
    fn is_float_only_for_floating_types() {
        let floats: Vec<_> = DType::ALL.into_iter().filter(|d| d.is_float()).collect();
        assert_eq!(floats, [DType::F32, DType::F64, DType::F16, DType::BF16]);
    }

    #[test]
    fn unknown_names_are_rejected() {
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
}
