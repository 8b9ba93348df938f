//! `chorus_torch._chorus`: a Chorus communicator driven from Python over tensors' own memory.
//!
//! The Python package (`chorus_torch`) turns each of torch's process-group calls into one
//! call of `Comm`: which collective, the tensors, torch's op and root, and torch's current
//! stream for CUDA tensors. This module reads the tensors (memory, dtype, device), decides
//! where the call runs (the host collectives for CPU tensors; for CUDA tensors the device
//! collectives, or the host ones through page-locked copies, in the stream's order), starts
//! it and hands back a `Pending` or `DevicePending` call, which holds the tensors until the
//! call is done. It is private to that package: the tensors it is given must be left
//! untouched until the call is done.

// The Python-facing calls take one argument per field of torch's call.
#![allow(clippy::too_many_arguments)]

mod buffer;
#[cfg(feature = "cuda")]
mod device;
mod error;
mod host;
mod pending;
mod torch;

use std::time::Duration;

use chorus::{Auth, CallKind, Communicator, Config, StoreServer};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use buffer::{Held, Raw};
use error::{raised, ChorusError};
use pending::Pending;
use torch::{typed, Place, Tensor};

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
    /// The device communicator, made by the first call on CUDA tensors.
    #[cfg(feature = "cuda")]
    devices: device::Devices,
}

/// One of torch's collectives, as the package describes it.
pub(crate) struct Call {
    pub kind: CallKind,
    /// torch's `ReduceOp.RedOpType` value (reductions only).
    pub op: u32,
    pub root: usize,
    /// All-to-all's elements per peer, sent and received; equal blocks without.
    pub counts: Option<(Vec<usize>, Vec<usize>)>,
}

/// Chorus's collective for torch's call `name`.
fn call_kind(name: &str) -> PyResult<CallKind> {
    Ok(match name {
        "all_reduce" => CallKind::AllReduce,
        "broadcast" => CallKind::Broadcast,
        "reduce" => CallKind::Reduce,
        "all_gather" => CallKind::AllGather,
        "reduce_scatter" => CallKind::ReduceScatter,
        "all_to_all" => CallKind::AllToAll,
        "gather" => CallKind::Gather,
        "scatter" => CallKind::Scatter,
        _ => {
            return Err(PyValueError::new_err(format!(
                "chorus has no collective called {name:?}"
            )))
        }
    })
}

/// The error for a CUDA tensor given to a build without the cargo feature `cuda`.
#[cfg(not(feature = "cuda"))]
fn no_cuda() -> PyErr {
    PyValueError::new_err(
        "this build of chorus_torch has no CUDA support (build it with the cargo feature cuda, \
         as pip install does)",
    )
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
        let mut config = Config::new(rank, size, addr, port);
        config.local_rank = local_rank;
        config.local_world_size = local_size;
        // Torch's timeout (init_process_group's, 30 minutes by default) unless CHORUS_TIMEOUT says.
        if timeout.is_finite() && timeout > 0.0 {
            config.timeout = Duration::from_secs_f64(timeout);
        }
        let mut config = config
            .tuned_from(|k| std::env::var(k).ok())
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        config.auth = Auth::new(job_id, token).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let server = match host {
            Some(h) => h.server.lock().map_err(failed)?.take(),
            None => None,
        };
        let comm = py
            .detach(|| Communicator::with_store_server(config, server, "torch"))
            .map_err(chorus_failed)?;
        Ok(Comm {
            comm,
            #[cfg(feature = "cuda")]
            devices: device::Devices::default(),
        })
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
        #[cfg(feature = "cuda")]
        self.devices.abort();
    }

    /// The error that broke this communicator, as a `ChorusError` (not raised), or None while
    /// it works.
    fn failure(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        let error = self.comm.failure()?;
        Some(raised(&error).into_value(py).into_any())
    }

    /// A communicator of this one's ranks less the dead and those in `exclude` (see
    /// `Communicator::shrink`): every surviving rank calls it.
    fn shrink(&self, py: Python<'_>, exclude: Vec<usize>) -> PyResult<Comm> {
        let comm = py
            .detach(|| self.comm.shrink(&exclude))
            .map_err(chorus_failed)?;
        Ok(Comm {
            comm,
            #[cfg(feature = "cuda")]
            devices: device::Devices::default(),
        })
    }

    /// How CUDA tensors' data moves between the ranks ("ipc", "staged" or "hierarchical"),
    /// once a call on CUDA tensors has chosen; None before, or in a build without CUDA.
    /// Waits, without the GIL, for a device set-up another thread is running.
    #[getter]
    fn device_path(&self, py: Python<'_>) -> Option<&'static str> {
        #[cfg(feature = "cuda")]
        return py.detach(|| self.devices.path());
        #[cfg(not(feature = "cuda"))]
        {
            let _ = py;
            None
        }
    }

    /// Starts the collective `kind` ("all_reduce", "broadcast", "reduce", "all_gather",
    /// "reduce_scatter", "all_to_all", "gather", "scatter") from the contiguous tensor
    /// `input` into `output` (the same tensor for the calls in place; for all-gather and
    /// reduce-scatter, one may be this rank's block of the other), with torch's reduce op
    /// value `op`, `root`, and all-to-all's `counts` (elements per peer, sent and received)
    /// where the call has them.
    ///
    /// On CPU tensors it returns a [`Pending`] call, run in issue order on Chorus's worker;
    /// with `now`, one run on this thread and ended (a call the caller waits on at once,
    /// which then wakes no other thread). On CUDA tensors it returns a `DevicePending` once
    /// enqueued, as NCCL's calls do: it reads its input after the work queued on torch's
    /// stream `stream` (its raw handle) before it; `stream` runs on, and the package orders
    /// torch's streams after it.
    #[pyo3(signature = (kind, input, output, op=0, root=0, stream=0, counts=None, now=false))]
    fn call(
        &self,
        py: Python<'_>,
        kind: &str,
        input: Bound<'_, PyAny>,
        output: Bound<'_, PyAny>,
        op: u32,
        root: usize,
        stream: usize,
        counts: Option<(Vec<usize>, Vec<usize>)>,
        now: bool,
    ) -> PyResult<Py<PyAny>> {
        let call = Call {
            kind: call_kind(kind)?,
            op,
            root,
            counts,
        };
        let i = Tensor::read(&input, "the input")?;
        // The calls in place pass one tensor twice: it is read once.
        let o = match input.is(&output) {
            true => i,
            false => Tensor::read(&output, "the output")?,
        };
        if i.place != o.place {
            return Err(PyValueError::new_err(format!(
                "chorus {kind}: tensors on {} and {} cannot be mixed in one call",
                i.place, o.place
            )));
        }
        if i.dtype != o.dtype || i.boolean != o.boolean {
            return Err(PyValueError::new_err(format!(
                "chorus {kind}: the input holds {} and the output {} elements",
                i.dtype, o.dtype
            )));
        }
        let keep = PyTuple::new(py, [input, output])?.into_any().unbind();
        match i.place {
            Place::Host if now => {
                let pending =
                    Pending::ended(py, &self.comm, |c| host::start(c, &call, i, o, keep))?;
                Ok(Py::new(py, pending)?.into_any())
            }
            Place::Host => Ok(Py::new(py, host::start(&self.comm, &call, i, o, keep)?)?.into_any()),
            #[cfg(feature = "cuda")]
            Place::Cuda(ordinal) => {
                let dev = self.devices.get(py, &self.comm, ordinal)?;
                let pending = device::start(&dev, &call, (i, o), stream, keep)?;
                Ok(Py::new(py, pending)?.into_any())
            }
            #[cfg(not(feature = "cuda"))]
            Place::Cuda(_) => {
                let _ = stream;
                Err(no_cuda())
            }
        }
    }

    /// Starts every send and receive of `ops` together (torch's `isend`/`irecv` batched, so
    /// two ranks exchanging large messages both ways cannot wait on each other). Each op is
    /// `(is_send, tensor, peer, tag)`, the tensors contiguous and on one device; CUDA
    /// tensors' messages go through page-locked copies, ordered on torch's `stream`.
    ///
    /// A receive's memory may overlap no other op's: that is a `ValueError` before anything
    /// is sent.
    fn exchange(
        &self,
        py: Python<'_>,
        ops: Vec<(bool, Bound<'_, PyAny>, usize, u32)>,
        stream: usize,
    ) -> PyResult<Py<PyAny>> {
        let mut checked: Vec<(bool, Raw, usize, u32)> = Vec::with_capacity(ops.len());
        let mut place = None;
        for (i, (is_send, tensor, peer, tag)) in ops.iter().enumerate() {
            let (is_send, peer, tag) = (*is_send, *peer, *tag);
            let t = Tensor::read(tensor, &format!("point-to-point call {i}'s tensor"))?;
            if *place.get_or_insert(t.place) != t.place {
                return Err(PyValueError::new_err(format!(
                    "point-to-point call {i} (to or from rank {peer}, tag {tag}) is on {}, another of the same batch on {}",
                    t.place,
                    place.unwrap_or(t.place)
                )));
            }
            if let Some(j) = checked.iter().position(|&(other_send, other, ..)| {
                (!is_send || !other_send) && t.raw.overlaps(other)
            }) {
                return Err(PyValueError::new_err(format!(
                    "point-to-point call {i} (to or from rank {peer}, tag {tag}) shares memory with call {j} of the same batch, and one of them receives into it"
                )));
            }
            checked.push((is_send, t.raw, peer, tag));
        }
        let keep = PyTuple::new(py, ops.into_iter().map(|(_, t, ..)| t))?
            .into_any()
            .unbind();
        match place.unwrap_or(Place::Host) {
            Place::Host => {
                let (mut sends, mut recvs) = (Vec::new(), Vec::new());
                let mut keep = Some(keep);
                for (is_send, raw, peer, tag) in checked {
                    // SAFETY: the package passes live tensors, owned by `keep` (held by the
                    // first buffer) and not touched until the batch is done; no receive shares
                    // memory with another op (checked above).
                    let held = unsafe { Held::<u8>::new(raw, keep.take()) };
                    if is_send {
                        sends.push((held, peer, tag));
                    } else {
                        recvs.push((held, peer, tag));
                    }
                }
                Ok(Py::new(py, Pending::new(self.comm.group_async(sends, recvs)))?.into_any())
            }
            #[cfg(feature = "cuda")]
            Place::Cuda(ordinal) => {
                let dev = self.devices.get(py, &self.comm, ordinal)?;
                Ok(Py::new(py, device::exchange(&dev, checked, stream, keep)?)?.into_any())
            }
            #[cfg(not(feature = "cuda"))]
            Place::Cuda(_) => {
                let _ = stream;
                Err(no_cuda())
            }
        }
    }

    /// Receives exactly the contiguous `tensor`'s length from whichever rank sends a message
    /// with `tag` first, and returns that rank once the message is in the tensor (a CUDA
    /// tensor's through a page-locked copy, ordered on torch's `stream`).
    #[pyo3(signature = (tensor, tag, stream=0))]
    fn recv_any(
        &self,
        py: Python<'_>,
        tensor: Bound<'_, PyAny>,
        tag: u32,
        stream: usize,
    ) -> PyResult<usize> {
        let t = Tensor::read(&tensor, "the tensor")?;
        match t.place {
            Place::Host => {
                let comm = &self.comm;
                py.detach(|| {
                    // SAFETY: the package passes a live tensor, held by the caller for the
                    // call.
                    typed!(t.dtype, T => comm.recv_any(unsafe { t.raw.slice::<T>() }, tag))
                })
                .map_err(chorus_failed)
            }
            #[cfg(feature = "cuda")]
            Place::Cuda(ordinal) => {
                let dev = self.devices.get(py, &self.comm, ordinal)?;
                device::recv_any(py, &dev, t, tag, stream, tensor.unbind())
            }
            #[cfg(not(feature = "cuda"))]
            Place::Cuda(_) => {
                let _ = stream;
                Err(no_cuda())
            }
        }
    }

    /// Starts a barrier; with `now`, runs it on this thread and returns it ended (see
    /// [`Comm::call`]).
    #[pyo3(signature = (now=false))]
    fn barrier(&self, py: Python<'_>, now: bool) -> PyResult<Pending> {
        if !now {
            return Ok(Pending::new(self.comm.barrier_async()));
        }
        Pending::ended(py, &self.comm, |c| Ok(Pending::new(c.barrier_async())))
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
    m.add_class::<device::DevicePending>()?;
    Ok(())
}
