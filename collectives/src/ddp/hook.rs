//! Communication hooks: gradients all-reduced as they are, or cast to 16 bits for the wire.

use std::str::FromStr;

use half::slice::HalfFloatSliceExt;

use super::bucket::Flat;
use crate::{bf16, f16, DType, Error};

/// How a bucket's gradients travel (the `f32` buckets; others always go as they are).
///
/// `Bf16` and `F16` are PyTorch's compression hooks: divide by the world
/// size, cast to 16 bits, all-reduce by sum, cast back. Half the bytes on
/// the wire, at the cost of 16-bit rounding (about 3 decimal digits for
/// `F16`, 2 for `Bf16`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// Full precision: all-reduce with [`ReduceOp::Avg`](crate::ReduceOp::Avg).
    #[default]
    None,
    /// Cast to bfloat16 (the range of f32, 8 bits of mantissa).
    Bf16,
    /// Cast to IEEE half (11 bits of mantissa, range up to 65504).
    F16,
}

impl FromStr for Compression {
    type Err = Error;

    /// Parses `none`, `bf16` or `fp16`/`f16`, ignoring case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "none" => Ok(Compression::None),
            "bf16" | "bfloat16" => Ok(Compression::Bf16),
            "fp16" | "f16" | "half" => Ok(Compression::F16),
            _ => Err(Error::InvalidArgument(format!(
                "unknown gradient compression '{s}' (expected none, bf16 or fp16)"
            ))),
        }
    }
}

impl Compression {
    /// The wire type for a bucket of `dtype`, if this hook compresses it.
    pub(crate) fn wire(self, dtype: DType) -> Option<DType> {
        match (self, dtype) {
            (Compression::Bf16, DType::F32) => Some(DType::BF16),
            (Compression::F16, DType::F32) => Some(DType::F16),
            _ => None,
        }
    }

    /// Scales `grads` (an `f32` bucket) by `1 / world_size` and casts it to `wire`.
    pub(crate) fn compress(grads: &mut Flat, wire: DType, world_size: usize) -> Flat {
        let g = grads.typed_mut::<f32>();
        let scale = 1.0 / world_size as f32;
        g.iter_mut().for_each(|v| *v *= scale);
        let mut out = Flat::zeros(wire, g.len());
        match wire {
            DType::BF16 => out.typed_mut::<bf16>().convert_from_f32_slice(g),
            _ => out.typed_mut::<f16>().convert_from_f32_slice(g),
        }
        out
    }

    /// Casts the reduced `wire` buffer back into the `f32` bucket `grads`.
    pub(crate) fn decompress(wire: &Flat, grads: &mut Flat) {
        let g = grads.typed_mut::<f32>();
        match wire.dtype() {
            DType::BF16 => wire.typed::<bf16>().convert_to_f32_slice(g),
            _ => wire.typed::<f16>().convert_to_f32_slice(g),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compression_scales_casts_and_casts_back() {
        let mut grads = Flat::zeros(DType::F32, 3);
        grads
            .typed_mut::<f32>()
            .copy_from_slice(&[2.0, -4.0, 1000.0]);
        for c in [Compression::Bf16, Compression::F16] {
            let mut g = Flat::zeros(DType::F32, 3);
            g.typed_mut::<f32>().copy_from_slice(grads.typed());
            let wire = c.wire(DType::F32).unwrap();
            let sent = Compression::compress(&mut g, wire, 2);
            assert_eq!(sent.dtype(), wire);
            Compression::decompress(&sent, &mut g);
            assert_eq!(g.typed::<f32>(), &[1.0, -2.0, 500.0]);
        }
        assert_eq!(Compression::None.wire(DType::F32), None);
        assert_eq!(Compression::Bf16.wire(DType::F64), None);
    }

    #[test]
    fn hooks_parse_by_name() {
        assert_eq!("BF16".parse::<Compression>().unwrap(), Compression::Bf16);
        assert_eq!("fp16".parse::<Compression>().unwrap(), Compression::F16);
        assert_eq!("none".parse::<Compression>().unwrap(), Compression::None);
        let e = "int4".parse::<Compression>().unwrap_err().to_string();
        assert!(e.contains("int4"), "{e}");
    }
}
