//! `chorus_torch._chorus`: a Chorus communicator driven from Python over tensors' own memory.
//!
//! The Python package (`chorus_torch`) turns torch's process-group calls into calls of
//! `Comm` with each tensor's address and length in bytes and the Python objects that own
//! them; this module starts them on the tensors' memory and hands back a `Pending` call,
//! which holds those objects until the call is done. It is private to that package: the
//! addresses it is given must be those of live tensors of the given type and length, owned
//! by the objects passed with them and left untouched until the call is done.

// The Python-facing calls take one argument per field of torch's call.
#![allow(clippy::too_many_arguments)]

mod buffer;
#[cfg(feature = "cuda")]
mod device;
mod error;
mod pending;

use std::time::Duration;

use chorus::{env, Auth, Communicator, Config, DType, ReduceOp};
use chorus_transport::store::StoreServer;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use buffer::{held_apart, Held, Raw};
use error::{raised, ChorusError};
use pending::Pending;

/// Runs `$body` with `$t` standing for the Rust element type of `$dtype`.
macro_rules! typed {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::F16 => {
                type $t = chorus::f16;
                $body
            }
            DType::BF16 => {
                type $t = chorus::bf16;
                $body
            }
            DType::I8 => {
                type $t = i8;
                $body
            }
            DType::U8 => {
                type $t = u8;
                $body
            }
            DType::I32 => {
                type $t = i32;
                $body
            }
            DType::U32 => {
                type $t = u32;
                $body
            }
            DType::I64 => {
                type $t = i64;
                $body
            }
            DType::U64 => {
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

/// Chorus's data type and operator for a reduction with torch's op `op` (its
/// `ReduceOp.RedOpType` value) on tensors of torch's dtype `dtype`; a clear error where none
/// fits. On bool tensors every operator is a logical one, as Gloo computes them.
fn torch_types(dtype: &str, op: u32) -> PyResult<(DType, ReduceOp)> {
    let chorus_dtype = torch_dtype(dtype)?;
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
    if dtype == "torch.bool" {
        let logical = match reduce {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => ReduceOp::Max,
            ReduceOp::Prod | ReduceOp::Min | ReduceOp::BAnd => ReduceOp::Min,
            ReduceOp::BXor => ReduceOp::BXor,
            ReduceOp::Avg => {
                return Err(PyValueError::new_err(format!(
                    "ReduceOp.{name} is not defined on bool tensors"
                )))
            }
        };
        return Ok((chorus_dtype, logical));
    }
    if reduce.is_bitwise() && chorus_dtype.is_float() {
        return Err(PyValueError::new_err(format!(
            "ReduceOp.{name} needs integer or bool tensors, got {dtype}"
        )));
    }
    Ok((chorus_dtype, reduce))
}

fn failed(e: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

/// A Chorus call's error, raised as a [`ChorusError`].
fn chorus_failed(e: chorus::Error) -> PyErr {
    raised(&e)
}

/// Rank 0's rendezvous store for one communicator, listening on a free port.
#[pyclass(frozen, module = "chorus_torch._chorus")]
struct StoreHost {
    server: std::sync::Mutex<Option<StoreServer>>,
    port: u16,
}

#[pymethods]
impl StoreHost {
    /// Listens on every interface at a port the system picks; peers must prove `token`.
    #[new]
    fn new(job_id: &str, token: &str) -> PyResult<StoreHost> {
        let auth = Auth::new(job_id, token).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let server = StoreServer::bind_with_auth(([0, 0, 0, 0], 0).into(), auth).map_err(failed)?;
        Ok(StoreHost {
            port: server.local_addr().port(),
            server: std::sync::Mutex::new(Some(server)),
        })
    }

    /// The port the store listens on.
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }
}

/// One Chorus communicator. A collective returns a [`Pending`] call at once; the call runs
/// in issue order on Chorus's worker, or on the thread that first waits for it.
#[pyclass(frozen, module = "chorus_torch._chorus")]
struct Comm {
    comm: Communicator,
}

#[pymethods]
impl Comm {
    /// Joins a communicator of `size` ranks through the store at `addr:port` (hosted by
    /// rank 0's `host`), proving `job_id` and `token`.
    #[new]
    #[pyo3(signature = (rank, size, addr, port, job_id, token, timeout, local_rank, local_size, host=None))]
    fn new(
        py: Python<'_>,
        rank: usize,
        size: usize,
        addr: String,
        port: u16,
        job_id: &str,
        token: &str,
        timeout: f64,
        local_rank: usize,
        local_size: usize,
        host: Option<&StoreHost>,
    ) -> PyResult<Comm> {
        // Torch gives the job's shape; of the environment only the CHORUS_* tuning applies.
        let mut config = Config::from_lookup(|k| match k {
            env::RANK | env::LOCAL_RANK => Some("0".into()),
            env::WORLD_SIZE | env::LOCAL_WORLD_SIZE => Some("1".into()),
            env::CHORUS_INIT_METHOD => None,
            _ if k.starts_with(env::CHORUS_PREFIX) => std::env::var(k).ok(),
            _ => None,
        })
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
        config.rank = rank;
        config.world_size = size;
        config.local_rank = local_rank;
        config.local_world_size = local_size;
        config.master_addr = addr;
        config.master_port = port;
        // Torch's timeout (init_process_group's, 30 minutes by default) unless CHORUS_TIMEOUT says.
        if timeout.is_finite() && timeout > 0.0 && std::env::var_os(env::CHORUS_TIMEOUT).is_none() {
            config.timeout = Duration::from_secs_f64(timeout);
        }
        config.auth = Auth::new(job_id, token).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let server = match host {
            Some(h) => h.server.lock().map_err(failed)?.take(),
            None => None,
        };
        let comm = py
            .detach(|| Communicator::with_store_server(config, server, "torch"))
            .map_err(chorus_failed)?;
        Ok(Comm { comm })
    }

    /// This process's rank.
    #[getter]
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of ranks.
    #[getter]
    fn size(&self) -> usize {
        self.comm.world_size()
    }

    /// Fails every call in flight and later, promptly, here and (through the store) on peers.
    fn abort(&self) {
        self.comm.abort();
    }

    /// Starts an in-place all-reduce of `bytes` bytes at `ptr`, which `keep` owns.
    fn all_reduce(
        &self,
        ptr: usize,
        bytes: usize,
        dtype: &str,
        op: u32,
        keep: Py<PyAny>,
    ) -> PyResult<Pending> {
        let (dtype, op) = torch_types(dtype, op)?;
        let buf = Raw::new(ptr, bytes, dtype)?;
        let c = &self.comm;
        Ok(typed!(dtype, T => {
            // SAFETY: the package passes a live tensor of this type and length, owned by
            // `keep` and not touched until the call is done.
            let buf = unsafe { Held::<T>::new(buf, Some(keep)) };
            Pending::new(c.all_reduce_async(buf, op))
        }))
    }

    /// Starts an in-place broadcast from `root`.
    fn broadcast(
        &self,
        ptr: usize,
        bytes: usize,
        dtype: &str,
        root: usize,
        keep: Py<PyAny>,
    ) -> PyResult<Pending> {
        let dtype = torch_dtype(dtype)?;
        let buf = Raw::new(ptr, bytes, dtype)?;
        let c = &self.comm;
        Ok(typed!(dtype, T => {
            // SAFETY: as in `all_reduce`.
            let buf = unsafe { Held::<T>::new(buf, Some(keep)) };
            Pending::new(c.broadcast_async(buf, root))
        }))
    }

    /// Starts an in-place reduce to `root` (other ranks' buffers become scratch).
    fn reduce(
        &self,
        ptr: usize,
        bytes: usize,
        dtype: &str,
        op: u32,
        root: usize,
        keep: Py<PyAny>,
    ) -> PyResult<Pending> {
        let (dtype, op) = torch_types(dtype, op)?;
        let buf = Raw::new(ptr, bytes, dtype)?;
        let c = &self.comm;
        Ok(typed!(dtype, T => {
            // SAFETY: as in `all_reduce`.
            let buf = unsafe { Held::<T>::new(buf, Some(keep)) };
            Pending::new(c.reduce_async(buf, op, root))
        }))
    }

    /// Starts an all-gather of `input` into `output` (world-size blocks); `input` may be
    /// `output`'s own block of this rank (in place).
    fn all_gather(
        &self,
        input: usize,
        input_bytes: usize,
        output: usize,
        output_bytes: usize,
        dtype: &str,
        keep: Py<PyAny>,
    ) -> PyResult<Pending> {
        let dtype = torch_dtype(dtype)?;
        let (input, output) = Raw::pair(input, input_bytes, output, output_bytes, dtype)?;
        let c = &self.comm;
        if output.block(c.rank(), input.bytes) == Some(input) {
            return Ok(typed!(dtype, T => {
                // SAFETY: as in `all_reduce`; only the output is referenced.
                let buf = unsafe { Held::<T>::new(output, Some(keep)) };
                Pending::new(c.all_gather_in_place_async(buf))
            }));
        }
        Ok(typed!(dtype, T => {
            // SAFETY: the package passes live tensors of these lengths, owned by `keep` and
            // not touched until the call is done; an input that overlaps the output is copied.
            let (i, o) = unsafe { held_apart(input, output, keep) };
            Pending::new(c.all_gather_async::<T, _, _>(i, o))
        }))
    }

    /// Starts a reduce-scatter of `input` (world-size blocks) into `output`.
    fn reduce_scatter(
        &self,
        input: usize,
        input_bytes: usize,
        output: usize,
        output_bytes: usize,
        dtype: &str,
        op: u32,
        keep: Py<PyAny>,
    ) -> PyResult<Pending> {
        let (dtype, op) = torch_types(dtype, op)?;
        let (input, output) = Raw::pair(input, input_bytes, output, output_bytes, dtype)?;
        let c = &self.comm;
        Ok(typed!(dtype, T => {
            // SAFETY: as in `all_gather`.
            let (i, o) = unsafe { held_apart(input, output, keep) };
            Pending::new(c.reduce_scatter_async::<T, _, _>(i, o, op))
        }))
    }

    /// Starts an all-to-all; with counts (elements per peer) when given, else equal blocks.
    #[pyo3(signature = (input, input_bytes, output, output_bytes, dtype, send_counts, recv_counts, keep))]
    fn all_to_all(
        &self,
        input: usize,
        input_bytes: usize,
        output: usize,
        output_bytes: usize,
        dtype: &str,
        send_counts: Option<Vec<usize>>,
        recv_counts: Option<Vec<usize>>,
        keep: Py<PyAny>,
    ) -> PyResult<Pending> {
        let dtype = torch_dtype(dtype)?;
        let (input, output) = Raw::pair(input, input_bytes, output, output_bytes, dtype)?;
        let c = &self.comm;
        Ok(typed!(dtype, T => {
            // SAFETY: as in `all_gather`.
            let (i, o) = unsafe { held_apart(input, output, keep) };
            Pending::new(match (send_counts, recv_counts) {
                (Some(s), Some(r)) => c.all_to_all_v_async::<T, _, _>(i, s, o, r),
                _ => c.all_to_all_async::<T, _, _>(i, o),
            })
        }))
    }

    /// Starts a gather of every rank's `input` into `root`'s `output` (ignored elsewhere).
    fn gather(
        &self,
        input: usize,
        input_bytes: usize,
        output: usize,
        output_bytes: usize,
        dtype: &str,
        root: usize,
        keep: Py<PyAny>,
    ) -> PyResult<Pending> {
        let dtype = torch_dtype(dtype)?;
        let (input, output) = Raw::pair(input, input_bytes, output, output_bytes, dtype)?;
        let c = &self.comm;
        Ok(typed!(dtype, T => {
            // SAFETY: as in `all_gather`.
            let (i, o) = unsafe { held_apart(input, output, keep) };
            Pending::new(c.gather_async::<T, _, _>(i, o, root))
        }))
    }

    /// Starts a scatter of `root`'s `input` (ignored elsewhere) into every rank's `output`.
    fn scatter(
        &self,
        input: usize,
        input_bytes: usize,
        output: usize,
        output_bytes: usize,
        dtype: &str,
        root: usize,
        keep: Py<PyAny>,
    ) -> PyResult<Pending> {
        let dtype = torch_dtype(dtype)?;
        let (input, output) = Raw::pair(input, input_bytes, output, output_bytes, dtype)?;
        let c = &self.comm;
        Ok(typed!(dtype, T => {
            // SAFETY: as in `all_gather`.
            let (i, o) = unsafe { held_apart(input, output, keep) };
            Pending::new(c.scatter_async::<T, _, _>(i, o, root))
        }))
    }

    /// Starts every send and receive of `ops` together (torch's `isend`/`irecv` batched, so
    /// two ranks exchanging large messages both ways cannot wait on each other). Each op is
    /// `(is_send, ptr, bytes, dtype, peer, tag)` (dtype as torch's name); `keep` owns their memory.
    ///
    /// A receive's memory may overlap no other op's: that is a `ValueError` before anything
    /// is sent.
    fn exchange(
        &self,
        ops: Vec<(bool, usize, usize, String, usize, u32)>,
        keep: Py<PyAny>,
    ) -> PyResult<Pending> {
        let mut checked: Vec<(bool, Raw)> = Vec::with_capacity(ops.len());
        for (i, (is_send, ptr, bytes, dtype, peer, tag)) in ops.iter().enumerate() {
            let (is_send, peer, tag) = (*is_send, *peer, *tag);
            let raw = Raw::new(*ptr, *bytes, torch_dtype(dtype)?)?;
            if let Some(j) = checked
                .iter()
                .position(|&(other_send, other)| (!is_send || !other_send) && raw.overlaps(other))
            {
                return Err(PyValueError::new_err(format!(
                    "point-to-point call {i} (to or from rank {peer}, tag {tag}) shares memory with call {j} of the same batch, and one of them receives into it"
                )));
            }
            checked.push((is_send, raw));
        }
        let (mut sends, mut recvs) = (Vec::new(), Vec::new());
        let mut keep = Some(keep);
        for (&(is_send, raw), &(_, _, _, _, peer, tag)) in checked.iter().zip(&ops) {
            // SAFETY: the package passes live tensors of these lengths, owned by `keep` (held
            // by the first buffer) and not touched until the batch is done; no receive shares
            // memory with another op (checked above).
            let held = unsafe { Held::<u8>::new(raw, keep.take()) };
            if is_send {
                sends.push((held, peer, tag));
            } else {
                recvs.push((held, peer, tag));
            }
        }
        Ok(Pending::new(self.comm.group_async(sends, recvs)))
    }

    /// Receives exactly the buffer's length from whichever rank sends a message with `tag`
    /// first; returns that rank.
    fn recv_any(
        &self,
        py: Python<'_>,
        ptr: usize,
        bytes: usize,
        dtype: &str,
        tag: u32,
    ) -> PyResult<usize> {
        let dtype = torch_dtype(dtype)?;
        let buf = Raw::new(ptr, bytes, dtype)?;
        let comm = &self.comm;
        py.detach(|| {
            // SAFETY: the package passes a live tensor of this type and length, held for the
            // call.
            typed!(dtype, T => comm.recv_any(unsafe { buf.slice::<T>() }, tag))
        })
        .map_err(chorus_failed)
    }

    /// Starts a barrier.
    fn barrier(&self) -> Pending {
        Pending::new(self.comm.barrier_async())
    }
}

/// The extension module.
#[pymodule]
fn _chorus(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<StoreHost>()?;
    m.add_class::<Comm>()?;
    m.add_class::<Pending>()?;
    m.add("ChorusError", m.py().get_type::<ChorusError>())?;
    #[cfg(feature = "cuda")]
    m.add_class::<device::DeviceComm>()?;
    #[cfg(feature = "cuda")]
    m.add_class::<device::DevicePending>()?;
    Ok(())
}
