//! Calls ordered on the caller's CUDA stream (cargo feature `cuda`), as NCCL's are: each
//! call is issued on the stream and returns at once; it starts once the work queued on the
//! stream before it has ended, and work queued after it waits for it. Device memory moves
//! through Chorus's device communicator (CUDA IPC or pinned staging, its GPU kernels
//! reducing); the calls Chorus runs on the host (all-to-all, gather, scatter, messages,
//! pre-multiplied sums) take device memory through page-locked copies; host memory runs
//! the host collectives in the same order.
//!
//! A call that fails after it was issued is reported by `ncclCommGetAsyncError` (and by
//! `ncclCommFinalize`, which waits for every call); one whose arguments the device
//! communicator refuses fails at once.

use std::ffi::c_int;
use std::sync::{Arc, Mutex};

use chorus::cuda::cudarc::driver::sys;
use chorus::cuda::{
    CallerStream, CudaCommunicator, CudaStream, Device, DeviceCall, DeviceMessage, DeviceWork,
    Staged,
};
use chorus::{Communicator, DType, ReduceOp};

use crate::comm::{Failure, Outcome};
use crate::lock;

/// A communicator's device side: the device communicator, and its calls in flight.
pub struct Ordered {
    dev: CudaCommunicator,
    /// Calls issued whose end has not been looked at yet.
    in_flight: Mutex<Vec<DeviceWork<()>>>,
    /// The first failure of a call after it was issued.
    failed: Mutex<Option<Failure>>,
}

/// A host call, run on Chorus's thread in the stream's order.
pub type HostCall = Box<dyn FnOnce(&Communicator) -> chorus::Result<()> + Send>;

/// A host call on page-locked copies of device memory: one slice per piece, in order.
pub type StagedCall = Box<dyn FnOnce(&Communicator, &mut [&mut [u8]]) -> chorus::Result<()> + Send>;

impl Ordered {
    /// The device side of `comm` on `device` (the device current when the rank was made, or
    /// -1), where every rank has a driver and a device; `None` where any rank has none
    /// (every rank then runs its calls at once, on host memory only). Collective over
    /// `comm`'s ranks.
    pub fn make(comm: &Communicator, device: c_int) -> Outcome<Option<Ordered>> {
        let mut every = [u8::from(device >= 0 && crate::memory::has_driver())];
        comm.all_reduce(&mut every, ReduceOp::Min)?;
        if every[0] == 0 {
            return Ok(None);
        }
        let device = Device::open(device as usize).map_err(chorus::Error::from)?;
        Ok(Some(Ordered {
            dev: CudaCommunicator::new(comm, device)?,
            in_flight: Mutex::default(),
            failed: Mutex::default(),
        }))
    }

    /// The caller's stream `raw` (null: the default stream), on this communicator's device.
    fn stream(&self, raw: usize) -> Outcome<Arc<CudaStream>> {
        let context = self.dev.device().context();
        context.bind_to_thread().map_err(|e| {
            Failure::from(chorus::Error::from(chorus::cuda::CudaError::driver(
                "binding the device's context",
            )(e)))
        })?;
        // SAFETY: NCCL's callers pass a stream of the communicator's device (the device
        // communicator checks it) and keep it alive while calls on it are in flight; the
        // wrapper borrows it and never destroys it.
        Ok(unsafe { context.wrap_borrowed_stream(raw as sys::CUstream) })
    }

    /// Issues, through `issue`, one call on the first of `streams` (raw handles, each once),
    /// ordered on all of them: it starts once the work queued on each before it has ended,
    /// and work queued on any of them afterwards waits for it.
    pub fn across(&self, streams: &[usize], issue: impl FnOnce(usize) -> Outcome) -> Outcome {
        let Some((&first, rest)) = streams.split_first() else {
            return Ok(());
        };
        let driver = |what| {
            move |e| {
                Failure::from(chorus::Error::from(chorus::cuda::CudaError::driver(what)(
                    e,
                )))
            }
        };
        let primary = self.stream(first)?;
        for &raw in rest {
            let ahead = self.stream(raw)?.record_event(None);
            let ahead = ahead.map_err(driver("recording the work ahead on a stream"))?;
            primary
                .wait(&ahead)
                .map_err(driver("ordering the call after another stream"))?;
        }
        issue(first)?;
        let after = primary.record_event(None);
        let after = after.map_err(driver("recording the call's end"))?;
        for &raw in rest {
            let stream = self.stream(raw)?;
            stream
                .wait(&after)
                .map_err(driver("ordering another stream after the call"))?;
        }
        Ok(())
    }

    /// How many ranks the calls run on.
    pub fn world_size(&self) -> usize {
        self.dev.world_size()
    }

    /// Issues `call`, host collectives on host memory, on stream `raw`.
    pub fn host(&self, raw: usize, call: HostCall) -> Outcome {
        let stream = self.stream(raw)?;
        self.keep(
            self.dev
                .host_call((&stream, CallerStream::Ordered), (), call),
        )
    }

    /// Issues `call` on device memory at `input` and `output`, `count` elements of `dtype`
    /// per block, on stream `raw`.
    ///
    /// # Safety
    /// As [`CudaCommunicator::start_raw`]: device memory of this device, valid and written by
    /// nothing else until the call has ended.
    pub unsafe fn device(
        &self,
        call: DeviceCall,
        dtype: DType,
        (input, output): (usize, usize),
        count: usize,
        raw: usize,
    ) -> Outcome {
        let stream = self.stream(raw)?;
        let on = (&stream, CallerStream::Ordered);
        // SAFETY: as the function requires.
        let work = unsafe {
            self.dev
                .start_raw(call, dtype, (input as u64, output as u64), count, on, ())
        };
        self.keep(work)
    }

    /// Issues `call`, host collectives on page-locked copies of the device memory `memory`
    /// describes, on stream `raw`.
    ///
    /// # Safety
    /// As [`CudaCommunicator::staged_call_raw`].
    pub unsafe fn staged(&self, memory: Vec<Staged>, raw: usize, call: StagedCall) -> Outcome {
        let stream = self.stream(raw)?;
        let on = (&stream, CallerStream::Ordered);
        // SAFETY: as the function requires.
        let work = unsafe { self.dev.staged_call_raw(memory, on, (), call) };
        self.keep(work)
    }

    /// Issues the sends and receives `messages`, all on device memory, on stream `raw`.
    ///
    /// # Safety
    /// As [`CudaCommunicator::exchange_raw`].
    pub unsafe fn exchange(&self, messages: Vec<DeviceMessage>, raw: usize) -> Outcome {
        let stream = self.stream(raw)?;
        let on = (&stream, CallerStream::Ordered);
        // SAFETY: as the function requires.
        let work = unsafe { self.dev.exchange_raw(messages, on, ()) };
        self.keep(work)
    }

    /// Keeps `work` until its end is looked at; one that has ended already (refused at
    /// issue) reports its failure at once.
    fn keep(&self, work: DeviceWork<()>) -> Outcome {
        if work.is_completed() {
            return work.wait().map_err(Failure::from);
        }
        self.settle();
        lock(&self.in_flight).push(work);
        Ok(())
    }

    /// Looks at the calls that have ended, keeping the first failure.
    fn settle(&self) {
        let ended: Vec<_> = {
            let mut in_flight = lock(&self.in_flight);
            let (ended, running) = in_flight.drain(..).partition(DeviceWork::is_completed);
            *in_flight = running;
            ended
        };
        ended.into_iter().for_each(|w| self.note(w.wait()));
    }

    /// Remembers the first failure of a call that has ended.
    fn note(&self, ended: chorus::Result<()>) {
        if let Err(e) = ended {
            lock(&self.failed).get_or_insert_with(|| Failure::from(e));
        }
    }

    /// The first failure of a call that has ended since it was issued.
    pub fn failure(&self) -> Option<Failure> {
        self.settle();
        lock(&self.failed).clone()
    }

    /// Whether every call issued has ended.
    pub fn quiescent(&self) -> bool {
        self.settle();
        lock(&self.in_flight).is_empty()
    }

    /// Whether its calls return once issued, ordered on the caller's streams (false where
    /// the device cannot make streams wait on memory: calls then return once they end).
    pub fn orders_streams(&self) -> bool {
        self.dev.orders_streams()
    }

    /// Fails every call in flight and to come (the device communicator's own duplicate of
    /// the host communicator is aborted).
    pub fn abort(&self) {
        self.dev.abort();
    }

    /// Waits for every call issued to end; fails with the first failure.
    pub fn finish(&self) -> Outcome {
        let all = std::mem::take(&mut *lock(&self.in_flight));
        all.into_iter().for_each(|w| self.note(w.wait()));
        lock(&self.failed).clone().map_or(Ok(()), Err)
    }
}
