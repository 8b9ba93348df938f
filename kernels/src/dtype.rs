//! Data types: the runtime [`DType`] tag and the compile-time [`Element`] trait.

use std::fmt;

use half::{bf16, f16};

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
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
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
    fn is_float_only_for_floating_types() {
        let floats: Vec<_> = DType::ALL.into_iter().filter(|d| d.is_float()).collect();
        assert_eq!(floats, [DType::F32, DType::F64, DType::F16, DType::BF16]);
    }
}
