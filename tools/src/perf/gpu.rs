//! `--device cuda` (feature `cuda`): the measured buffers live on the GPU and the calls go
//! through [`CudaCommunicator`]; the host buffers are the source of the input and the
//! place the result is checked.
//!
//! With `-g N` a rank drives N GPUs (devices `LOCAL_RANK * N .. + N`, modulo the GPUs
//! there are): one buffer pair per GPU, each GPU a participant of its own (number
//! `rank * N + i`, as nccl-tests counts them), and the calls go through
//! [`CudaCommunicator::call_local_raw`].

use std::sync::Arc;

use chorus::cuda::cudarc::driver::{DevicePtr, DriverError};
use chorus::cuda::{CudaCommunicator, CudaError, CudaSlice, CudaStream, Device, DeviceCall};
use chorus::Communicator;

use super::collective::{Collective, Layout, Params};

/// One rank's GPUs: its device communicator (on the first) and a buffer pair per GPU.
pub struct Gpu {
    comm: CudaCommunicator,
    locals: Vec<Local>,
}

/// One GPU's stream and device input and output buffers.
struct Local {
    stream: Arc<CudaStream>,
    input: CudaSlice<u8>,
    output: CudaSlice<u8>,
}

impl Gpu {
    /// Opens `ngpus` GPUs for this rank with buffers of `bytes` bytes on each; collective.
    pub fn new(comm: &Communicator, bytes: usize, ngpus: usize) -> Result<Gpu, String> {
        let err = |e: CudaError| e.to_string();
        let mut devices = Vec::with_capacity(ngpus);
        let mut locals = Vec::with_capacity(ngpus);
        for i in 0..ngpus {
            let device = local_device(comm, i, ngpus)?;
            let stream = device.new_stream().map_err(err)?;
            let alloc = |n: usize| {
                stream.alloc_zeros::<u8>(n.max(1)).map_err(|e| {
                    format!("--device cuda: cannot allocate {n} bytes on the GPU: {e}")
                })
            };
            let (input, output) = (alloc(bytes)?, alloc(bytes)?);
            locals.push(Local {
                stream,
                input,
                output,
            });
            devices.push(device);
        }
        let comm =
            CudaCommunicator::new(comm, devices.swap_remove(0)).map_err(|e| e.to_string())?;
        Ok(Gpu { comm, locals })
    }

    /// The GPUs this rank drives (`-g`).
    pub fn count(&self) -> usize {
        self.locals.len()
    }

    /// The first GPU's name and the path, for the banner.
    pub fn describe(&self) -> String {
        format!(
            "{}, {} GPU(s) per rank",
            describe(&self.comm),
            self.locals.len()
        )
    }

    /// Copies the host buffers' bytes to GPU `i`'s buffers.
    pub fn load(&mut self, i: usize, input: &[u8], output: &[u8]) -> Result<(), String> {
        let err = |e: DriverError| e.to_string();
        let local = &mut self.locals[i];
        let mut to = local.input.slice_mut(..input.len());
        local.stream.memcpy_htod(input, &mut to).map_err(err)?;
        let mut to = local.output.slice_mut(..output.len());
        local.stream.memcpy_htod(output, &mut to).map_err(err)?;
        local.stream.synchronize().map_err(err)
    }

    /// Copies GPU `i`'s output back into `output`.
    pub fn store(&mut self, i: usize, output: &mut [u8]) -> Result<(), String> {
        let err = |e: DriverError| e.to_string();
        let local = &self.locals[i];
        let from = local.output.slice(..output.len());
        local.stream.memcpy_dtoh(&from, output).map_err(err)?;
        local.stream.synchronize().map_err(err)
    }

    /// Runs `collective` once on the device buffers (in place: within the output buffers,
    /// at nccl-tests' offsets). With several GPUs an out-of-place call first copies each
    /// input to its output (timed with the call), as the calls over local GPUs are in place.
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
        let elem = p.dtype.size();
        if let [local] = &self.locals[..] {
            let base_out = local.output.device_ptr(&local.stream).0;
            let (input, output) = if in_place {
                (
                    base_out + (collective.in_place_input(layout, rank) * elem) as u64,
                    base_out + (collective.in_place_output(layout, rank).start * elem) as u64,
                )
            } else {
                (local.input.device_ptr(&local.stream).0, base_out)
            };
            // SAFETY: both buffers hold the largest layout's bytes (sized at `new`), the
            // offsets are nccl-tests' in-place layouts inside them, and they live in `self`,
            // on this communicator's device, for the whole (blocking) call.
            return unsafe {
                self.comm
                    .call_raw(call, p.dtype, (input, output), layout.block, &local.stream)
            };
        }
        let bytes = layout.block * elem;
        let mut outputs = Vec::with_capacity(self.locals.len());
        for local in &mut self.locals {
            if !in_place {
                let from = local.input.slice(..bytes);
                let mut to = local.output.slice_mut(..bytes);
                local
                    .stream
                    .memcpy_dtod(&from, &mut to)
                    .map_err(|e| CudaError::driver("copying the input")(e))?;
            }
            outputs.push(local.output.device_ptr(&local.stream).0);
        }
        let streams: Vec<_> = self.locals.iter().map(|l| l.stream.clone()).collect();
        // SAFETY: each output holds at least `bytes` bytes on its stream's device, and lives
        // in `self` for the whole (blocking) call.
        unsafe {
            self.comm
                .call_local_raw(call, p.dtype, &outputs, layout.block, &streams)
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

/// GPU `i` of the `per_rank` this rank drives: device `LOCAL_RANK * per_rank + i`, modulo
/// the GPUs there are (ranks share GPUs when there are fewer).
pub fn local_device(comm: &Communicator, i: usize, per_rank: usize) -> Result<Device, String> {
    let err = |e: CudaError| format!("--device cuda: {e}");
    let count = Device::count().map_err(err)?;
    if count == 0 {
        return Err("--device cuda: the CUDA driver sees no GPU".into());
    }
    Device::open((comm.local_rank() * per_rank + i) % count).map_err(err)
}

/// `comm`'s GPU and path, for a banner: `device 0 NAME (Ipc path)`.
pub fn describe(comm: &CudaCommunicator) -> String {
    let device = comm.device();
    format!(
        "device {} {} ({:?} path)",
        device.ordinal(),
        device.name().unwrap_or_default(),
        comm.path()
    )
}
