//! `--device cuda` (feature `cuda`): the measured buffers live on the GPU and the calls go
//! through [`CudaCommunicator`]; the host buffers are the source of the input and the
//! place the result is checked.

use std::sync::Arc;

use chorus::cuda::cudarc::driver::DevicePtr;
use chorus::cuda::{CudaCommunicator, CudaSlice, CudaStream, Device, DeviceCall};
use chorus::Communicator;

use super::collective::{Collective, Layout, Params};

/// One rank's GPU: its device communicator, a stream, and device input and output buffers.
pub struct Gpu {
    comm: CudaCommunicator,
    stream: Arc<CudaStream>,
    input: CudaSlice<u8>,
    output: CudaSlice<u8>,
}

impl Gpu {
    /// Opens GPU `LOCAL_RANK % count` with buffers of `bytes` bytes; collective.
    pub fn new(comm: &Communicator, bytes: usize) -> Result<Gpu, String> {
        let err = |e: chorus::cuda::CudaError| e.to_string();
        let count = Device::count().map_err(err)?;
        if count == 0 {
            return Err("--device cuda: the CUDA driver sees no GPU".into());
        }
        let device = Device::open(comm.local_rank() % count).map_err(err)?;
        let stream = device.new_stream().map_err(err)?;
        let alloc = |n: usize| {
            stream
                .alloc_zeros::<u8>(n.max(1))
                .map_err(|e| format!("--device cuda: cannot allocate {n} bytes on the GPU: {e}"))
        };
        let (input, output) = (alloc(bytes)?, alloc(bytes)?);
        let comm = CudaCommunicator::new(comm, device).map_err(|e| e.to_string())?;
        Ok(Gpu {
            comm,
            stream,
            input,
            output,
        })
    }

    /// The GPU's name and path, for the banner.
    pub fn describe(&self) -> String {
        let device = self.comm.device();
        format!(
            "device {} {} ({:?} path)",
            device.ordinal(),
            device.name().unwrap_or_default(),
            self.comm.path()
        )
    }

    /// Copies the host buffers' bytes to the device buffers.
    pub fn load(&mut self, input: &[u8], output: &[u8]) -> Result<(), String> {
        let err = |e: chorus::cuda::cudarc::driver::DriverError| e.to_string();
        let mut to = self.input.slice_mut(..input.len());
        self.stream.memcpy_htod(input, &mut to).map_err(err)?;
        let mut to = self.output.slice_mut(..output.len());
        self.stream.memcpy_htod(output, &mut to).map_err(err)?;
        self.stream.synchronize().map_err(err)
    }

    /// Copies the device output back into `output`.
    pub fn store(&mut self, output: &mut [u8]) -> Result<(), String> {
        let err = |e: chorus::cuda::cudarc::driver::DriverError| e.to_string();
        let from = self.output.slice(..output.len());
        self.stream.memcpy_dtoh(&from, output).map_err(err)?;
        self.stream.synchronize().map_err(err)
    }

    /// Runs `collective` once on the device buffers (in place: within the output buffer,
    /// at nccl-tests' offsets).
    pub fn once(
        &mut self,
        collective: &Collective,
        layout: &Layout,
        p: Params,
        in_place: bool,
    ) -> chorus::Result<()> {
        let call = device_call(collective.name, p).ok_or_else(|| {
            chorus::Error::InvalidArgument(format!(
                "--device cuda does not measure {} (all_reduce, broadcast, reduce, all_gather and reduce_scatter only)",
                collective.name
            ))
        })?;
        let rank = self.comm.rank();
        let elem = p.dtype.size() as u64;
        let base_out = self.output.device_ptr(&self.stream).0;
        let (input, output) = if in_place {
            (
                base_out + collective.in_place_input(layout, rank) as u64 * elem,
                base_out + collective.in_place_output(layout, rank).start as u64 * elem,
            )
        } else {
            (self.input.device_ptr(&self.stream).0, base_out)
        };
        // SAFETY: both buffers hold the largest layout's bytes (sized at `new`), the
        // offsets are nccl-tests' in-place layouts inside them, and they live in `self`,
        // on this communicator's device, for the whole (blocking) call.
        unsafe {
            self.comm
                .call_raw(call, p.dtype, (input, output), layout.block, &self.stream)
        }
    }
}

/// The device call a perf binary measures, for the collectives the device path has.
fn device_call(name: &str, p: Params) -> Option<DeviceCall> {
    Some(match name {
        "all_reduce" => DeviceCall::AllReduce(p.op),
        "broadcast" => DeviceCall::Broadcast { root: p.root },
        "reduce" => DeviceCall::Reduce {
            op: p.op,
            root: p.root,
        },
        "all_gather" => DeviceCall::AllGather,
        "reduce_scatter" => DeviceCall::ReduceScatter(p.op),
        _ => return None,
    })
}
