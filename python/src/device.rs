//! Calls on CUDA tensors (cargo feature `cuda`), ordered on torch's streams as NCCL's are:
//! Chorus's device collectives on the tensors' memory, and the calls that run on the host
//! (all-to-all, gather, scatter, point-to-point) through page-locked copies of it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use chorus::cuda::cudarc::driver::{result, sys, CudaContext, CudaEvent, DevicePtrMut};
use chorus::cuda::{
    CallerStream, CudaCommunicator, CudaError, CudaSlice, CudaStream, Device, DeviceCall,
    DeviceMessage, DeviceWork, Staged,
};
use chorus::{CallKind, Communicator};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffer::Raw;
use crate::pending::{Outcome, Pending};
use crate::torch::{typed, Tensor};
use crate::{chorus_failed, Call};

/// A group's device communicator, made by its first call on CUDA tensors.
#[derive(Default)]
pub(crate) struct Devices(Mutex<Option<Arc<CudaCommunicator>>>);

impl Devices {
    /// Fails every call of the device communicator, if one was made, in flight and to come.
    /// Never waits for one being made (its set-up fails on the aborted host communicator).
    pub fn abort(&self) {
        let slot = match self.0.try_lock() {
            Ok(slot) => slot,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        if let Some(dev) = &*slot {
            dev.abort();
        }
    }

    /// The device communicator for GPU `ordinal`, made over a duplicate of `host` on the
    /// first call (collective: every rank's first call on CUDA tensors makes it). Later
    /// calls must be on the same device.
    pub fn get(
        &self,
        py: Python<'_>,
        host: &Communicator,
        ordinal: usize,
    ) -> PyResult<Arc<CudaCommunicator>> {
        py.detach(|| {
            let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(dev) = &*slot {
                let on = dev.device().ordinal();
                if on != ordinal {
                    return Err(PyValueError::new_err(format!(
                        "this group's CUDA calls run on cuda:{on}, got a tensor on cuda:{ordinal}"
                    )));
                }
                return Ok(Arc::clone(dev));
            }
            let dev = Arc::new(
                Device::open(ordinal)
                    .map_err(chorus::Error::from)
                    .and_then(|device| CudaCommunicator::new(host, device))
                    .map_err(chorus_failed)?,
            );
            *slot = Some(Arc::clone(&dev));
            Ok(dev)
        })
    }

    /// How device data moves between the ranks ("ipc", "staged" or "hierarchical"), once a
    /// call has chosen.
    pub fn path(&self) -> Option<&'static str> {
        let slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
        slot.as_ref().map(|dev| dev.path().name())
    }
}

/// Starts `call` from `input` into `output` on the device (`keep` owns both) and returns
/// once it is enqueued: it reads its input after the work queued on torch's stream `stream`
/// (its raw handle) before it, and `stream` runs on (the package orders torch's streams
/// after the call with [`DevicePending::wait_on`], or waits on the host). The collectives
/// the device runs go there; the rest run on the host through page-locked copies.
pub(crate) fn start(
    dev: &CudaCommunicator,
    call: &Call,
    (input, output): (Tensor, Tensor),
    stream: usize,
    keep: Py<PyAny>,
) -> PyResult<DevicePending> {
    let stream = issued_on(dev, stream)?;
    let on = (&stream, CallerStream::Free);
    let dtype = output.dtype;
    let world = dev.world_size();
    // An all-to-all of blocks that do not divide evenly takes the host's, which names the
    // lengths it refuses.
    let even = input.raw.bytes == output.raw.bytes && input.raw.bytes % (dtype.size() * world) == 0;
    let on_device = device_call(call, &output)?.filter(|c| *c != DeviceCall::AllToAll || even);
    Ok(match on_device {
        Some(device_call) => {
            let size = dtype.size();
            let count = match device_call {
                DeviceCall::ReduceScatter(_) => output.raw.bytes / size,
                DeviceCall::AllToAll => input.raw.bytes / size / world,
                _ => input.raw.bytes / size,
            };
            // What the call reads and writes, which the tensors must hold.
            let (reads, writes) = match device_call {
                DeviceCall::AllGather => (count * size, count * size * world),
                DeviceCall::ReduceScatter(_) => (count * size * world, count * size),
                DeviceCall::AllToAll => (count * size * world, count * size * world),
                _ => (count * size, count * size),
            };
            if input.raw.bytes < reads || output.raw.bytes < writes {
                return Err(PyValueError::new_err(format!(
                    "{} of {count} elements a rank on {world} ranks reads {reads} bytes and \
                     writes {writes}: the input holds {} and the output {}",
                    call.kind.name(),
                    input.raw.bytes,
                    output.raw.bytes
                )));
            }
            // NCCL's layouts in place: one buffer, or one rank's block of the other.
            let block = (count * size) as u64 * dev.rank() as u64;
            let (i, o) = (input.raw.addr(), output.raw.addr());
            let in_place = match device_call {
                DeviceCall::AllGather => i == o + block,
                DeviceCall::ReduceScatter(_) => o == i + block,
                _ => i == o,
            };
            // An input that overlaps a separate output is read from a copy.
            let copy = (!in_place && input.raw.overlaps(output.raw))
                .then(|| device_copy(dev, &stream, input.raw))
                .transpose()?;
            let from = copy.as_ref().map_or(i, |(_, at)| *at);
            // SAFETY: the package passes live CUDA tensors of these lengths on this device,
            // held by `keep` (and the copy, by the handle) until the call has ended; torch's
            // later work on them is ordered after the call by the package, as with NCCL.
            let work =
                unsafe { dev.start_raw(device_call, dtype, (from, o), count, on, (keep, copy)) };
            DevicePending::new(dev, work)
        }
        None => {
            let memory = vec![
                Staged::Input(input.raw.addr(), input.raw.bytes),
                Staged::Output(output.raw.addr(), output.raw.bytes),
            ];
            let (kind, root, counts) = (call.kind, call.root, call.counts.clone());
            // SAFETY: as above, for the host copies' lengths.
            let work = unsafe {
                dev.staged_call_raw(memory, on, keep, move |comm, pieces| {
                    let [i, o] = pieces else {
                        unreachable!("two pieces of memory were staged")
                    };
                    typed!(dtype, T => {
                            let (i, o) = (bytemuck::cast_slice::<u8, T>(i), bytemuck::cast_slice_mut::<u8, T>(o));
                        match (kind, counts) {
                            (CallKind::AllToAll, Some((send, recv))) => comm.all_to_all_v(i, &send, o, &recv),
                            (CallKind::AllToAll, None) => comm.all_to_all(i, o),
                            (CallKind::Gather, _) => comm.gather(i, o, root),
                            _ => comm.scatter(i, o, root),
                        }
                    })
                })
            };
            DevicePending::new(dev, work)
        }
    })
}

/// The device collective for `call` on tensors like `output`; `None` for the calls that run
/// on the host.
fn device_call(call: &Call, output: &Tensor) -> PyResult<Option<DeviceCall>> {
    let root = call.root;
    Ok(Some(match call.kind {
        CallKind::AllReduce => DeviceCall::AllReduce(output.op(call.op)?),
        CallKind::Broadcast => DeviceCall::Broadcast { root },
        CallKind::Reduce => DeviceCall::Reduce {
            op: output.op(call.op)?,
            root,
        },
        CallKind::AllGather => DeviceCall::AllGather,
        CallKind::ReduceScatter => DeviceCall::ReduceScatter(output.op(call.op)?),
        CallKind::AllToAll if call.counts.is_none() => DeviceCall::AllToAll,
        CallKind::AllToAll | CallKind::Gather | CallKind::Scatter => return Ok(None),
        kind => {
            return Err(PyValueError::new_err(format!(
                "chorus has no call {} from one tensor into another",
                kind.name()
            )))
        }
    }))
}

/// A copy of `raw` (device memory of `dev`'s device) and its address, made after the work
/// queued on torch's `stream` so far and before what comes next on it. The copy lives on a
/// stream of its own, so that freeing it never touches one of torch's streams.
fn device_copy(
    dev: &CudaCommunicator,
    stream: &CudaStream,
    raw: Raw,
) -> PyResult<(CudaSlice<u8>, u64)> {
    let failed =
        |e| chorus_failed(CudaError::driver("copying an input apart from its output")(e).into());
    let own = dev
        .device()
        .new_stream()
        .map_err(|e| chorus_failed(e.into()))?;
    own.join(stream).map_err(failed)?;
    // SAFETY: every byte is written by the copy below before the call reads it.
    let mut copy = unsafe { own.alloc::<u8>(raw.bytes.max(1)) }.map_err(failed)?;
    let at = {
        let (at, _written) = copy.device_ptr_mut(&own);
        // SAFETY: `raw` is live device memory of this context of `raw.bytes` bytes (the
        // package's promise), and `copy` a fresh allocation of as many, on `own`.
        unsafe { result::memcpy_dtod_async(at, raw.addr(), raw.bytes, own.cu_stream()) }
            .map_err(failed)?;
        at
    };
    stream.join(&own).map_err(failed)?;
    Ok((copy, at))
}

/// Starts the sends and receives of `ops` (`(is_send, memory, peer, tag)`, on this device)
/// together, ordered on torch's `stream` as [`start`] is (through CUDA IPC between ranks of
/// one host, else through page-locked copies); `keep` owns their memory.
pub(crate) fn exchange(
    dev: &CudaCommunicator,
    ops: Vec<(bool, Raw, usize, u32)>,
    stream: usize,
    keep: Py<PyAny>,
) -> PyResult<DevicePending> {
    let stream = issued_on(dev, stream)?;
    let messages = ops
        .iter()
        .map(|&(is_send, raw, peer, tag)| {
            DeviceMessage::new(is_send, peer, tag, (raw.addr(), raw.bytes))
        })
        .collect();
    // SAFETY: the package passes live CUDA tensors of these lengths on this device, held by
    // `keep` until the batch has ended; no receive shares memory with another op (checked
    // by the caller).
    let work = unsafe { dev.exchange_raw(messages, (&stream, CallerStream::Free), keep) };
    Ok(DevicePending::new(dev, work))
}

/// Receives `tensor` (on this device) from whichever rank sends a message with `tag` first,
/// through a page-locked copy, ordered on torch's `stream`; returns once it is in place,
/// with that rank.
pub(crate) fn recv_any(
    py: Python<'_>,
    dev: &CudaCommunicator,
    tensor: Tensor,
    tag: u32,
    stream: usize,
    keep: Py<PyAny>,
) -> PyResult<usize> {
    let stream = issued_on(dev, stream)?;
    let source = Arc::new(AtomicUsize::new(0));
    let found = Arc::clone(&source);
    let dtype = tensor.dtype;
    let memory = vec![Staged::Output(tensor.raw.addr(), tensor.raw.bytes)];
    // SAFETY: the package passes a live CUDA tensor of this length on this device, held by
    // `keep`; the call is waited for below, and torch's stream waits for it.
    let work = unsafe {
        dev.staged_call_raw(memory, (&stream, CallerStream::Ordered), keep, move |comm, pieces| {
            let from = typed!(dtype, T => comm.recv_any(bytemuck::cast_slice_mut::<u8, T>(&mut pieces[0][..]), tag))?;
            found.store(from, Ordering::Release);
            Ok(())
        })
    };
    DevicePending::new(dev, work).wait(py)?;
    Ok(source.load(Ordering::Acquire))
}

/// torch's stream with raw handle `stream` on `dev`'s device, checked for a call: one being
/// captured into a CUDA graph is refused before anything is enqueued.
fn issued_on(dev: &CudaCommunicator, stream: usize) -> PyResult<Arc<CudaStream>> {
    let stream = torch_stream(dev.device().context(), stream);
    dev.check_issue(&stream).map_err(chorus_failed)?;
    Ok(stream)
}

/// torch's stream with raw handle `stream`, in `context` (its device's primary context).
fn torch_stream(context: &Arc<CudaContext>, stream: usize) -> Arc<CudaStream> {
    // SAFETY: the package passes the handle of one of torch's streams on this device (torch
    // never destroys them), and the wrapper lives for one call.
    unsafe { context.wrap_borrowed_stream(stream as sys::CUstream) }
}

impl<K: Send + 'static> Outcome for DeviceWork<K> {
    fn wait(self: Box<Self>) -> chorus::Result<()> {
        (*self).wait().map(drop)
    }

    fn join(self: Box<Self>) -> chorus::Result<()> {
        (*self).wait().map(drop)
    }

    fn is_completed(&self) -> bool {
        DeviceWork::is_completed(self)
    }
}

/// A call on CUDA tensors in flight (see [`start`]).
#[pyclass(frozen, module = "chorus_torch._chorus")]
pub(crate) struct DevicePending {
    pending: Pending,
    /// Fires once the call has ended; `None` where streams cannot wait on memory.
    done: Option<Arc<CudaEvent>>,
    context: Arc<CudaContext>,
    ordinal: usize,
}

impl DevicePending {
    /// `work`, a call of `dev`'s, as Python holds it.
    fn new<K: Send + 'static>(dev: &CudaCommunicator, work: DeviceWork<K>) -> DevicePending {
        DevicePending {
            done: work.done_event(),
            context: Arc::clone(dev.device().context()),
            ordinal: dev.device().ordinal(),
            pending: Pending::from(Box::new(work) as Box<dyn Outcome>),
        }
    }
}

#[pymethods]
impl DevicePending {
    /// The ordinal of the call's device.
    #[getter]
    fn ordinal(&self) -> usize {
        self.ordinal
    }

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
