//! `ncclRedOpCreatePreMulSum`: an operator of one communicator that sums every rank's input
//! multiplied first by a scalar (PyTorch's `ReduceOp.PREMUL_SUM`, and its averages of
//! gradients); run as Chorus's sum over a scaled copy of the input.

use std::ffi::c_int;
use std::sync::Mutex;

use chorus::{bf16, f16, DType, Element};

use crate::comm::{Failure, Outcome};
use crate::lock;

/// `ncclNumOps`: the first value of an operator a communicator makes.
const FIRST: c_int = 5;

/// Where the scalar is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scalar {
    /// Its bytes, read when the operator was made (`ncclScalarHostImmediate`).
    Value([u8; 8]),
    /// Its address in host memory, read by each call (`ncclScalarDevice`).
    At(usize),
    /// Its address in device memory, read by each call (`ncclScalarDevice`).
    OnDevice(usize),
}

impl Scalar {
    /// A scalar of `bytes` (at most 8), read now.
    pub fn value(bytes: &[u8]) -> Scalar {
        let mut value = [0u8; 8];
        value[..bytes.len()].copy_from_slice(bytes);
        Scalar::Value(value)
    }
}

/// One operator: its element type and scalar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreMulSum {
    /// The type of the calls it serves, and of its scalar.
    pub dtype: DType,
    /// The scalar.
    pub scalar: Scalar,
}

impl PreMulSum {
    /// The scalar as a `T` (the operator's own type, checked when the call was made); fails
    /// if device memory cannot be read.
    ///
    /// # Safety
    /// A scalar read at each call lies at its address, valid, as NCCL requires.
    pub unsafe fn scalar<T: Element>(&self) -> Result<T, String> {
        let bytes = match self.scalar {
            Scalar::Value(bytes) => bytes,
            // SAFETY: as the function requires.
            Scalar::At(at) => return Ok(unsafe { (at as *const T).read_unaligned() }),
            Scalar::OnDevice(at) => {
                let mut bytes = [0u8; 8];
                crate::memory::read_device(at, &mut bytes[..size_of::<T>()])
                    .map_err(|e| format!("reading the scalar at {at:#x}: {e}"))?;
                bytes
            }
        };
        Ok(bytemuck::pod_read_unaligned(&bytes[..size_of::<T>()]))
    }
}

/// The operators a communicator's rank made, by their value less `ncclNumOps` (5).
#[derive(Debug, Default)]
pub struct Ops(Mutex<Vec<Option<PreMulSum>>>);

impl Ops {
    /// A new operator's value.
    pub fn create(&self, op: PreMulSum) -> c_int {
        let mut ops = lock(&self.0);
        let slot = match ops.iter().position(Option::is_none) {
            Some(free) => free,
            None => {
                ops.push(None);
                ops.len() - 1
            }
        };
        ops[slot] = Some(op);
        FIRST + slot as c_int
    }

    /// The operator of value `raw`, for a call on elements of `dtype`.
    pub fn get(&self, raw: c_int, dtype: DType) -> Outcome<PreMulSum> {
        let op = self.find(raw)?;
        match op.dtype == dtype {
            true => Ok(op),
            false => Err(Failure::argument(format!(
                "reduction operator {raw} was made for {:?} elements, not {dtype:?}",
                op.dtype
            ))),
        }
    }

    /// Forgets the operator of value `raw`.
    pub fn destroy(&self, raw: c_int) -> Outcome {
        self.find(raw)?;
        let mut ops = lock(&self.0);
        ops[(raw - FIRST) as usize] = None;
        Ok(())
    }

    fn find(&self, raw: c_int) -> Outcome<PreMulSum> {
        let ops = lock(&self.0);
        usize::try_from(raw - FIRST)
            .ok()
            .and_then(|i| ops.get(i).copied().flatten())
            .ok_or_else(|| {
                Failure::argument(format!(
                    "reduction operator {raw} is not one this communicator knows"
                ))
            })
    }
}

/// Multiplication by a scalar, as NCCL's pre-multiplied sum does it for each type.
pub trait Scale: Element {
    /// `self * by` (wrapping for integers).
    fn times(self, by: Self) -> Self;
}

macro_rules! scale {
    (float: $($t:ty),*; int: $($i:ty),*; half: $($h:ty),*) => {
        $(impl Scale for $t { fn times(self, by: Self) -> Self { self * by } })*
        $(impl Scale for $i { fn times(self, by: Self) -> Self { self.wrapping_mul(by) } })*
        $(impl Scale for $h {
            fn times(self, by: Self) -> Self { <$h>::from_f32(self.to_f32() * by.to_f32()) }
        })*
    };
}

scale!(float: f32, f64; int: i8, u8, i32, u32, i64, u64; half: f16, bf16);

/// `input`, every element multiplied by `by`.
pub fn scaled<T: Scale>(input: &[T], by: T) -> Vec<T> {
    input.iter().map(|&x| x.times(by)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operators_are_made_found_and_forgotten_by_value() {
        let ops = Ops::default();
        let half = PreMulSum {
            dtype: DType::F32,
            scalar: Scalar::value(&0.5f32.to_ne_bytes()),
        };
        let a = ops.create(half);
        let b = ops.create(half);
        assert_eq!((a, b), (5, 6));
        assert_eq!(ops.get(a, DType::F32), Ok(half));
        let op = ops.get(a, DType::F32).unwrap();
        // SAFETY: a value read when made.
        let scalar = unsafe { op.scalar::<f32>() };
        assert_eq!(scalar, Ok(0.5));
        assert!(ops
            .get(a, DType::F64)
            .unwrap_err()
            .text
            .contains("made for F32"));
        ops.destroy(a).unwrap();
        assert!(ops.get(a, DType::F32).is_err());
        assert!(ops.destroy(a).is_err());
        assert!(ops.get(4, DType::F32).is_err());
        // A freed value is made again.
        assert_eq!(ops.create(half), 5);
    }

    #[test]
    fn every_type_scales_as_nccl_does() {
        assert_eq!(scaled(&[1.5f32, -2.0], 2.0), vec![3.0, -4.0]);
        assert_eq!(scaled(&[100u8, 3], 3), vec![44, 9]);
        assert_eq!(
            scaled(&[f16::from_f32(1.5)], f16::from_f32(0.5)),
            vec![f16::from_f32(0.75)]
        );
        assert_eq!(scaled(&[-7i64], -3), vec![21]);
    }
}
