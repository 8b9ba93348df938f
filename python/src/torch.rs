//! What torch hands the backend, in Chorus's terms: dtypes, reduce ops, and tensors as
//! memory on a device.

use chorus::{DType, ReduceOp};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::buffer::Raw;

/// Runs `$body` with `$t` standing for the Rust element type of `$dtype`.
macro_rules! typed {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            chorus::DType::F32 => {
                type $t = f32;
                $body
            }
            chorus::DType::F64 => {
                type $t = f64;
                $body
            }
            chorus::DType::F16 => {
                type $t = chorus::f16;
                $body
            }
            chorus::DType::BF16 => {
                type $t = chorus::bf16;
                $body
            }
            chorus::DType::I8 => {
                type $t = i8;
                $body
            }
            chorus::DType::U8 => {
                type $t = u8;
                $body
            }
            chorus::DType::I32 => {
                type $t = i32;
                $body
            }
            chorus::DType::U32 => {
                type $t = u32;
                $body
            }
            chorus::DType::I64 => {
                type $t = i64;
                $body
            }
            chorus::DType::U64 => {
                type $t = u64;
                $body
            }
        }
    };
}

/// Chorus's data type for torch's dtype `name` (as `str(dtype)` spells it); bool travels as
/// u8.
fn torch_dtype(name: &str) -> PyResult<DType> {
    Ok(match name {
        "torch.float32" => DType::F32,
        "torch.float64" => DType::F64,
        "torch.float16" => DType::F16,
        "torch.bfloat16" => DType::BF16,
        "torch.int8" => DType::I8,
        "torch.uint8" | "torch.bool" => DType::U8,
        "torch.int32" => DType::I32,
        "torch.uint32" => DType::U32,
        "torch.int64" => DType::I64,
        "torch.uint64" => DType::U64,
        _ => {
            return Err(PyTypeError::new_err(format!(
                "the chorus backend does not support tensors of {name}"
            )))
        }
    })
}

pub(crate) use typed;

/// torch's `ReduceOp.RedOpType` names, by value.
const TORCH_OPS: [&str; 9] = [
    "SUM",
    "AVG",
    "PRODUCT",
    "MIN",
    "MAX",
    "BAND",
    "BOR",
    "BXOR",
    "PREMUL_SUM",
];

/// Chorus's operator for torch's reduce op `op` (its `ReduceOp.RedOpType` value) on
/// elements of `dtype` (`boolean`: torch's bool, carried as u8); a clear error where none
/// fits. On bool tensors every operator is a logical one, as Gloo computes them.
pub(crate) fn reduce_op(dtype: DType, boolean: bool, op: u32) -> PyResult<ReduceOp> {
    let name = TORCH_OPS.get(op as usize).copied().unwrap_or("(unknown)");
    let reduce = match op {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Avg,
        2 => ReduceOp::Prod,
        3 => ReduceOp::Min,
        4 => ReduceOp::Max,
        5 => ReduceOp::BAnd,
        6 => ReduceOp::BOr,
        7 => ReduceOp::BXor,
        _ => {
            return Err(PyValueError::new_err(format!(
                "the chorus backend does not support ReduceOp.{name}"
            )))
        }
    };
    if boolean {
        return match reduce {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => Ok(ReduceOp::Max),
            ReduceOp::Prod | ReduceOp::Min | ReduceOp::BAnd => Ok(ReduceOp::Min),
            ReduceOp::BXor => Ok(ReduceOp::BXor),
            ReduceOp::Avg => Err(PyValueError::new_err(format!(
                "ReduceOp.{name} is not defined on bool tensors"
            ))),
        };
    }
    if reduce.is_bitwise() && dtype.is_float() {
        return Err(PyValueError::new_err(format!(
            "ReduceOp.{name} needs integer or bool tensors, got {dtype} ones"
        )));
    }
    Ok(reduce)
}

/// Where a tensor's memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    /// Host memory (a CPU tensor).
    Host,
    /// Memory of the CUDA device with this ordinal.
    Cuda(usize),
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::Host => write!(f, "cpu"),
            Place::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// A contiguous tensor's memory, element type and device, read from the tensor.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tensor {
    pub raw: Raw,
    pub dtype: DType,
    /// Whether torch's dtype is bool (a u8 in Chorus, whose reductions are logical).
    pub boolean: bool,
    pub place: Place,
}

impl Tensor {
    /// Reads `tensor`'s memory; `what` names it in errors. Refuses other devices than CPU and
    /// CUDA, dtypes Chorus does not carry, and non-contiguous tensors (the package passes
    /// contiguous stand-ins).
    pub fn read(tensor: &Bound<'_, PyAny>, what: &str) -> PyResult<Tensor> {
        let device = tensor.getattr("device")?;
        let place = match device.getattr("type")?.extract::<String>()?.as_str() {
            "cpu" => Place::Host,
            "cuda" => Place::Cuda(
                device
                    .getattr("index")?
                    .extract::<Option<usize>>()?
                    .unwrap_or(0),
            ),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "the chorus backend takes CPU and CUDA tensors, got {what} on {device}"
                )))
            }
        };
        if !tensor.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(PyValueError::new_err(format!("{what} is not contiguous")));
        }
        let name = tensor.getattr("dtype")?.str()?.to_string();
        let dtype = torch_dtype(&name)?;
        let numel: usize = tensor.call_method0("numel")?.extract()?;
        let ptr: usize = tensor.call_method0("data_ptr")?.extract()?;
        Ok(Tensor {
            raw: Raw::new(ptr, numel * dtype.size(), dtype)?,
            dtype,
            boolean: name == "torch.bool",
            place,
        })
    }

    /// The reduce op torch's `op` (its `ReduceOp.RedOpType` value) means on this tensor.
    pub fn op(&self, op: u32) -> PyResult<ReduceOp> {
        reduce_op(self.dtype, self.boolean, op)
    }
}
