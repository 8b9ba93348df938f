//! CUDA tensors (cargo feature `cuda`): Chorus's device collectives on the tensors' device
//! memory, through [`CudaCommunicator::call_raw`].

use std::sync::Arc;

use chorus::cuda::{CudaCommunicator, CudaStream, Device, DeviceCall, DevicePath};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::{chorus_failed, dtype, reduce_op, Comm};

/// A communicator for one GPU's tensors, over a duplicate of a host [`Comm`].
#[pyclass(frozen, module = "chorus_torch._chorus")]
pub(crate) struct DeviceComm {
    comm: CudaCommunicator,
    /// Chorus's own stream on the device; the package waits for torch's stream before a call.
    stream: Arc<CudaStream>,
}

#[pymethods]
impl DeviceComm {
    /// Opens GPU `ordinal` (its primary context, the one torch uses) and joins the device
    /// communicator of `host`'s ranks: collective, as every rank's first call on CUDA tensors.
    #[new]
    fn new(py: Python<'_>, host: &Comm, ordinal: usize) -> PyResult<DeviceComm> {
        let (comm, stream) = py
            .detach(|| -> chorus::Result<_> {
                let device = Device::open(ordinal)?;
                let stream = device.new_stream()?;
                Ok((CudaCommunicator::new(&host.comm, device)?, stream))
            })
            .map_err(chorus_failed)?;
        Ok(DeviceComm { comm, stream })
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

    /// Runs the collective `kind` ("all_reduce", "broadcast", "reduce", "all_gather",
    /// "reduce_scatter") on `count` elements of data type `dtype` per rank block, from the
    /// device address `input` into `output` (the same address for in place), with reduce op
    /// `op` and root `root` where the collective has them. Returns once the result is in
    /// `output`, with the GIL released.
    fn call(
        &self,
        py: Python<'_>,
        kind: &str,
        dtype_code: usize,
        input: u64,
        output: u64,
        count: usize,
        op: u32,
        root: usize,
    ) -> PyResult<()> {
        let call = match kind {
            "all_reduce" => DeviceCall::AllReduce(reduce_op(op)?),
            "broadcast" => DeviceCall::Broadcast { root },
            "reduce" => DeviceCall::Reduce {
                op: reduce_op(op)?,
                root,
            },
            "all_gather" => DeviceCall::AllGather,
            "reduce_scatter" => DeviceCall::ReduceScatter(reduce_op(op)?),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "no device collective is called {kind:?}"
                )))
            }
        };
        let dtype = dtype(dtype_code)?;
        // SAFETY: the package passes the addresses of live CUDA tensors on this device of
        // the call's lengths, held until it returns, after the work torch queued on them.
        py.detach(|| unsafe {
            self.comm
                .call_raw(call, dtype, (input, output), count, &self.stream)
        })
        .map_err(chorus_failed)
    }
}
