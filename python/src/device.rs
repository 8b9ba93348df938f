//! CUDA tensors (cargo feature `cuda`): Chorus's device collectives on the tensors' device
//! memory, ordered on torch's streams.

use std::sync::Arc;

use chorus::cuda::cudarc::driver::{sys, CudaContext, CudaEvent};
use chorus::cuda::{
    CallerStream, CudaCommunicator, CudaError, CudaStream, Device, DeviceCall, DevicePath,
};
use chorus::DType;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::pending::{Outcome, Pending};
use crate::{chorus_failed, torch_types, Comm};

/// A communicator for one GPU's tensors, over a duplicate of a host [`Comm`].
#[pyclass(frozen, module = "chorus_torch._chorus")]
pub(crate) struct DeviceComm {
    comm: CudaCommunicator,
}

#[pymethods]
impl DeviceComm {
    /// Opens GPU `ordinal` (its primary context, the one torch uses) and joins the device
    /// communicator of `host`'s ranks: collective, as every rank's first call on CUDA tensors.
    #[new]
    fn new(py: Python<'_>, host: &Comm, ordinal: usize) -> PyResult<DeviceComm> {
        let comm = py
            .detach(|| -> chorus::Result<_> {
                CudaCommunicator::new(&host.comm, Device::open(ordinal)?)
            })
            .map_err(chorus_failed)?;
        Ok(DeviceComm { comm })
    }

    /// The device's ordinal.
    #[getter]
    fn ordinal(&self) -> usize {
        self.comm.device().ordinal()
    }

    /// How device data moves between the ranks: "ipc" or "staged".
    #[getter]
    fn path(&self) -> &'static str {
        match self.comm.path() {
            DevicePath::Ipc => "ipc",
            DevicePath::Staged => "staged",
        }
    }

    /// Starts the collective `kind` ("all_reduce", "broadcast", "reduce", "all_gather",
    /// "reduce_scatter") on `count` elements of torch's `dtype` (its name, "torch.float32")
    /// per rank block, from the device address `input` into `output` (the same address for
    /// in place), with torch's reduce op code `op` and root `root` where the collective has
    /// them, and returns once it is enqueued, as NCCL's calls do: it reads its input after
    /// the work queued on torch's stream `stream` (its raw handle) before it, and holds `keep`
    /// (the tensors) until it has ended. `stream` runs on: the package orders torch's streams
    /// after the call with [`DevicePending::wait_on`], or waits for it on the host (a
    /// blocking call) with [`DevicePending::wait`].
    fn start(
        &self,
        kind: &str,
        dtype: &str,
        input: u64,
        output: u64,
        count: usize,
        op: u32,
        root: usize,
        stream: usize,
        keep: Py<PyAny>,
    ) -> PyResult<DevicePending> {
        let (call, dtype) = device_call(kind, dtype, op, root)?;
        let stream = torch_stream(self.comm.device().context(), stream);
        // SAFETY: the package passes the addresses of live CUDA tensors on this device of
        // the call's lengths, held by `keep` until the call has ended, and the handle of a
        // stream of torch's on it; torch's later work on them is ordered after the call by
        // the package's `wait_on` or `wait`, as with NCCL.
        let work = unsafe {
            self.comm.start_raw(
                call,
                dtype,
                (input, output),
                count,
                (&stream, CallerStream::Free),
                keep,
            )
        };
        Ok(DevicePending {
            done: work.done_event(),
            pending: Pending::from(Box::new(work) as Box<dyn Outcome>),
            context: Arc::clone(self.comm.device().context()),
        })
    }
}

/// torch's stream with raw handle `stream`, in `context` (its device's primary context).
fn torch_stream(context: &Arc<CudaContext>, stream: usize) -> Arc<CudaStream> {
    // SAFETY: the package passes the handle of one of torch's streams on this device (torch
    // never destroys them), and the wrapper lives for one call.
    unsafe { context.wrap_borrowed_stream(stream as sys::CUstream) }
}

/// The device call `kind` on torch's `dtype`, with torch's reduce op `op` and root `root`.
fn device_call(kind: &str, dtype: &str, op: u32, root: usize) -> PyResult<(DeviceCall, DType)> {
    let (dtype, op) = torch_types(dtype, op)?;
    let call = match kind {
        "all_reduce" => DeviceCall::AllReduce(op),
        "broadcast" => DeviceCall::Broadcast { root },
        "reduce" => DeviceCall::Reduce { op, root },
        "all_gather" => DeviceCall::AllGather,
        "reduce_scatter" => DeviceCall::ReduceScatter(op),
        _ => {
            return Err(PyValueError::new_err(format!(
                "no device collective is called {kind:?}"
            )))
        }
    };
    Ok((call, dtype))
}

impl<K: Send + 'static> Outcome for chorus::cuda::DeviceWork<K> {
    fn wait(self: Box<Self>) -> chorus::Result<()> {
        (*self).wait().map(drop)
    }

    fn join(self: Box<Self>) -> chorus::Result<()> {
        (*self).join().map(drop)
    }

    fn is_completed(&self) -> bool {
        chorus::cuda::DeviceWork::is_completed(self)
    }
}

/// A device call in flight (see [`DeviceComm::start`]).
#[pyclass(frozen, module = "chorus_torch._chorus")]
pub(crate) struct DevicePending {
    pending: Pending,
    /// Fires once the call has ended; `None` where streams cannot wait on memory.
    done: Option<Arc<CudaEvent>>,
    context: Arc<CudaContext>,
}

#[pymethods]
impl DevicePending {
    /// Makes torch's stream `stream` (its raw handle) wait for the call without blocking the
    /// host, so that work queued on it afterwards sees the result (where the device cannot
    /// make streams wait on memory, blocks until the call has ended instead). Raises the
    /// call's error if it has failed by now.
    fn wait_on(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        let Some(done) = &self.done else {
            return self.pending.join(py);
        };
        let stream = torch_stream(&self.context, stream);
        stream.wait(done).map_err(|e| {
            chorus_failed(CudaError::driver("ordering torch's stream after the call")(e).into())
        })?;
        if self.pending.is_completed() {
            self.pending.join(py)?;
        }
        Ok(())
    }

    /// Blocks until the call has ended, its result in place for every stream; raises
    /// ChorusError if it failed.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        self.pending.wait(py)
    }

    /// Blocks until Chorus's worker has ended the call (a completion thread's wait); raises
    /// as `wait` does.
    fn join(&self, py: Python<'_>) -> PyResult<()> {
        self.pending.join(py)
    }

    /// Whether the call has ended, successfully or not.
    fn is_completed(&self) -> bool {
        self.pending.is_completed()
    }
}
