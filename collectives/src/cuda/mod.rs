//! Collectives on CUDA device buffers (cargo feature `cuda`).
//!
//! A [`CudaCommunicator`] runs all-reduce, broadcast, reduce, all-gather and
//! reduce-scatter on device memory: cudarc's [`CudaSlice`]
//! and views (what candle's CUDA tensors hold), or raw device pointers through
//! [`CudaCommunicator::call_raw`] for bindings. Reductions run on the GPU with the NVRTC
//! kernels of [`chorus_kernels::cuda`] or on the host with Chorus's host kernels, as the
//! path requires. Three paths, chosen once, by [`CudaCommunicator::new`]:
//!
//! * [`DevicePath::Ipc`], when every rank runs on one host: each rank exports a device
//!   scratch buffer allocated with `cuMemAlloc` through CUDA IPC and maps every peer's. A
//!   call copies its input into the scratch buffer, and each rank then reduces its slice
//!   of the result straight from the peers' scratch buffers (GPU kernels) and copies the
//!   other slices from theirs: nothing passes through host memory. Several ranks may share
//!   one GPU. Host barriers order the steps.
//! * [`DevicePath::Staged`], across hosts (or when IPC is unavailable): the data is cut
//!   into chunks that pass through pinned host buffers and the host transport, two chunks
//!   in flight so that one's copies and kernels overlap the other's time on the wire.
//!   Reductions run on the GPU: a ring whose steps copy a partial result to the host,
//!   send it on, copy the previous rank's partial to the device and reduce it there.
//! * [`DevicePath::Hierarchical`], across hosts of which some run several ranks: IPC
//!   within each host and the staged path between hosts, on shards of the data with one
//!   owner per host, so each byte crosses the network once per host, not once per rank
//!   (the module `tiered` describes the stages).
//!
//! Ranks share a host when their `CHORUS_HOST_ID` (the communicator's
//! [`Config::host_id`](crate::Config::host_id)) is equal, or, where it is unset, their
//! kernel's boot id: one machine can stand for several hosts. `CHORUS_CUDA_PATH` (`auto`,
//! `ipc`, `staged`, `hierarchical`) forces a path; `auto`, the default, takes IPC where
//! every rank shares the host, the hierarchical path where the ranks span hosts and some
//! host runs two or more, and the staged path otherwise or where the ranks of a host
//! cannot map each other's memory: of the paths the layout allows, the one the cost model
//! ([`crate::cost::device`]) prices cheapest. `CHORUS_DEBUG` logs the choice and why.
//!
//! # Ordering and completion
//!
//! Every call names a CUDA stream of the caller's (on the buffers' device). Every rank must
//! make the same calls in the same order, as with the host collectives.
//!
//! A blocking call (`all_reduce`, ...) first waits for the work queued on that stream
//! before it (and, through cudarc's event tracking, for pending writes to the buffers),
//! enqueues its copies and kernels on the stream, and returns only when they are complete:
//! when it returns `Ok`, the result is in the output buffer and visible to every stream.
//!
//! An asynchronous call (`all_reduce_async`, ...) takes its buffers by value and returns a
//! [`DeviceWork`] once it is enqueued, as NCCL's calls do. Its input is read after the work
//! queued on the stream before the call (an event recorded at the call), and the stream
//! waits for the call's completion, so work queued on it afterwards comes after the call.
//! The call itself runs on Chorus's thread and Chorus's own work stream; its completion is
//! signalled by a stream wait on a counter in mapped host memory that Chorus's thread
//! advances when the call ends, failed or not, so no stream waits forever on a failed call
//! (its error comes from [`DeviceWork::wait`]). [`DeviceWork::wait_on`] orders another
//! stream after the call without blocking the host. Where the device cannot make streams
//! wait on memory (`CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS` is 0), the caller's
//! stream is not ordered after the call (the buffers, which the call owns until `wait`
//! gives them back, are safe by ownership), `wait_on` blocks the host until the call has
//! ended, and a call on memory the caller keeps (the `*_raw` calls and
//! [`CudaCommunicator::host_call`]) whose stream should wait for it
//! ([`CallerStream::Ordered`]) returns once it has ended. A call on a stream that is being
//! captured into a CUDA graph fails with [`Error::InvalidArgument`]: the call is driven from
//! the host, so a graph could not replay it.

mod gpu;
mod host;
mod ipc;
mod local;
mod order;
mod pipes;
mod staged;
#[cfg(test)]
mod testing;
mod tiered;

use std::sync::{Arc, Mutex, PoisonError};

use chorus_kernels::cuda::cudarc::driver::CudaEvent;
use chorus_kernels::cuda::order::{is_capturing, stream_waits_supported, MappedCounter};
pub use chorus_kernels::cuda::{
    cudarc, CudaError, CudaSlice, CudaStream, CudaView, CudaViewMut, Device,
};
use chorus_kernels::cuda::{DevicePtr, DevicePtrMut};
use chorus_kernels::{DType, Element, ReduceOp};
pub use host::Staged;
pub use pipes::DeviceMessage;

pub use crate::algorithm::DevicePath;
use crate::communicator::{lock, CallKind, Queue};
use crate::cost::device::{self as cost, DeviceLayout, DeviceLinks};
use crate::cost::LinkModel;
use crate::env::CHORUS_CUDA_PATH;
use crate::{CallInfo, Cause, Communicator, Error, Result, Work};

/// One collective on device memory, for [`CudaCommunicator::call_raw`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceCall {
    /// Every rank gets the reduction of every rank's `count` elements.
    AllReduce(ReduceOp),
    /// Every rank gets `root`'s `count` elements.
    Broadcast {
        /// The rank whose input is sent.
        root: usize,
    },
    /// `root` gets the reduction of every rank's `count` elements; other outputs are untouched.
    Reduce {
        /// The operator.
        op: ReduceOp,
        /// The rank that receives the result.
        root: usize,
    },
    /// Every rank gets every rank's `count` elements, block `q` from rank `q` (output
    /// `world_size * count` elements).
    AllGather,
    /// Every rank's input holds `world_size` blocks of `count` elements; rank `q` gets the
    /// reduction of block `q` (output `count` elements).
    ReduceScatter(ReduceOp),
    /// Every rank's input holds `world_size` blocks of `count` elements; block `q` goes to
    /// rank `q`, and block `q` of the output (as long) comes from rank `q`.
    AllToAll,
}

impl DeviceCall {
    /// `(input, output)` elements per rank for a call of `count` on `world` ranks.
    fn lengths(self, count: usize, world: usize) -> Option<(usize, usize)> {
        match self {
            DeviceCall::AllGather => Some((count, count.checked_mul(world)?)),
            DeviceCall::ReduceScatter(_) => Some((count.checked_mul(world)?, count)),
            DeviceCall::AllToAll => {
                let all = count.checked_mul(world)?;
                Some((all, all))
            }
            _ => Some((count, count)),
        }
    }

    /// The call's name, as users write it.
    fn name(self) -> &'static str {
        self.host().0.name()
    }

    /// The host collective's description: kind, operator and root.
    fn host(self) -> (CallKind, ReduceOp, usize) {
        match self {
            DeviceCall::AllReduce(op) => (CallKind::AllReduce, op, 0),
            DeviceCall::Broadcast { root } => (CallKind::Broadcast, ReduceOp::Sum, root),
            DeviceCall::Reduce { op, root } => (CallKind::Reduce, op, root),
            DeviceCall::AllGather => (CallKind::AllGather, ReduceOp::Sum, 0),
            DeviceCall::ReduceScatter(op) => (CallKind::ReduceScatter, op, 0),
            DeviceCall::AllToAll => (CallKind::AllToAll, ReduceOp::Sum, 0),
        }
    }
}

/// One call in flight: what, on which bytes.
#[derive(Debug, Clone, Copy)]
struct Job {
    call: DeviceCall,
    dtype: DType,
    /// Bytes of one rank's block (`count * dtype.size()`).
    block: usize,
    input: u64,
    output: u64,
}

/// A communicator for device buffers: a duplicate of a host [`Communicator`], a
/// [`Device`], and the path's buffers. See the [module documentation](self).
pub struct CudaCommunicator {
    /// Dropped first: the queued operations finish before the path closes.
    queue: Queue,
    /// Dropped second: releases the streams still waiting on calls that never ran.
    order: Order,
    shared: Arc<Shared>,
}

/// What the calls run on, shared with the queue's worker thread.
struct Shared {
    comm: Communicator,
    device: Device,
    path: Mutex<Path>,
    /// Where asynchronous calls run their copies and kernels (Chorus's own stream).
    work: Arc<CudaStream>,
    /// Page-locked host memory of the staged host calls.
    host_stage: Mutex<host::HostStage>,
}

/// The stream order of asynchronous calls (see the `order` module).
struct Order {
    completions: Arc<order::Completions<MappedCounter>>,
    /// Where each call's completion event is recorded, behind a wait on the counter; `None`
    /// where the device cannot make streams wait on memory.
    stream: Option<Arc<CudaStream>>,
    /// Held while a call is issued, so that counter values, completion events and the
    /// queue agree on the order of calls.
    issuing: Mutex<()>,
}

enum Path {
    Ipc(ipc::Peers<Device>),
    Staged(staged::Staging<Device>),
    Hierarchical(tiered::Tiered<Device>),
}

impl Path {
    /// Which path this is.
    fn kind(&self) -> DevicePath {
        match self {
            Path::Ipc(_) => DevicePath::Ipc,
            Path::Staged(_) => DevicePath::Staged,
            Path::Hierarchical(_) => DevicePath::Hierarchical,
        }
    }
}

impl std::fmt::Debug for CudaCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCommunicator")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("device", self.device())
            .field("path", &self.path())
            .finish()
    }
}

impl CudaCommunicator {
    /// Makes a device communicator over a duplicate of `comm` for buffers on `device`.
    ///
    /// Collective: every rank of `comm` calls it. Chooses the path (see
    /// `CHORUS_CUDA_PATH`); with `ipc` forced, fails naming the rank that cannot take
    /// part. Fails with [`Error::Cuda`] when the device cannot be used.
    pub fn new(comm: &Communicator, device: Device) -> Result<CudaCommunicator> {
        let forced = forced_path()?;
        let comm = comm.dup()?;
        device
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("binding the device's context"))?;
        let completions = order::Completions::new(MappedCounter::new(device.context())?);
        let waits = stream_waits_supported(device.context());
        if !waits {
            tracing::info!(
                rank = comm.rank(),
                "the device cannot make streams wait on memory: DeviceWork::wait_on blocks \
                 the host until the call is done"
            );
        }
        let order = Order {
            completions,
            stream: waits.then(|| device.new_stream()).transpose()?,
            issuing: Mutex::new(()),
        };
        let work = device.new_stream()?;
        // Now, before any stream waits on a call: loading modules can wait for the device.
        if let Err(err) = device.load_kernels() {
            tracing::warn!(rank = comm.rank(), %err, "the reduction kernels cannot be loaded");
        }
        // Last: once its peers map this rank's memory, only `Shared`'s drop may free it.
        let path = choose(&comm, &device, forced)?;
        Ok(CudaCommunicator {
            queue: Queue::new(comm.rank()),
            order,
            shared: Arc::new(Shared {
                comm,
                work,
                device,
                path: Mutex::new(path),
                host_stage: Mutex::default(),
            }),
        })
    }

    /// Whether its asynchronous calls are ordered on the caller's streams and return once
    /// issued: false where the device cannot make streams wait on memory (see
    /// [`DeviceWork::stream_ordered`]).
    pub fn orders_streams(&self) -> bool {
        self.order.stream.is_some()
    }

    /// Fails every call in flight and to come, promptly, here and (through the store) on
    /// the other ranks, as [`Communicator::abort`] does for the host communicator
    /// underneath, this communicator's own duplicate.
    pub fn abort(&self) {
        self.shared.comm.abort();
    }

    /// A device communicator of this one's ranks less the dead and those in `exclude`, on
    /// the same device: [`Communicator::shrink`] of the host communicator underneath, then a
    /// new device path over the survivors (chosen again, as [`new`](Self::new) does).
    ///
    /// Every surviving rank calls it; fails as those two do.
    pub fn shrink(&self, exclude: &[usize]) -> Result<CudaCommunicator> {
        let survivors = self.shared.comm.shrink(exclude)?;
        CudaCommunicator::new(&survivors, self.shared.device.clone())
    }

    /// The path this communicator's calls take.
    pub fn path(&self) -> DevicePath {
        self.shared.lock().kind()
    }

    /// The device the buffers must be on.
    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// Checks that an asynchronous call could be issued on `stream` now: a stream of this
    /// device, not being captured into a CUDA graph. The calls check it themselves and fail
    /// their handle; a binding that must refuse before it hands out a handle asks first.
    pub fn check_issue(&self, stream: &CudaStream) -> Result<()> {
        self.shared.check_issue(stream)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.shared.comm.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.shared.comm.world_size()
    }

    /// Runs a blocking call after the asynchronous ones queued before it.
    fn now(&self, call: impl FnOnce(&Shared) -> Result<()>) -> Result<()> {
        self.queue.drain();
        call(&self.shared)
    }

    /// Starts `call` in place on the owned `buf`; it comes back through the handle.
    fn later_in_place<T, B>(
        &self,
        call: DeviceCall,
        mut buf: B,
        stream: &Arc<CudaStream>,
    ) -> DeviceWork<B>
    where
        T: Element,
        B: DevicePtrMut<T> + Send + 'static,
    {
        // The caller's stream waits for the buffer's pending work before the call's start
        // is recorded on it.
        let job = self
            .shared
            .check_issue(stream)
            .and_then(|()| self.shared.in_place_job(call, &mut buf, stream));
        self.start(job, buf, stream, CallerStream::Ordered)
    }

    /// Starts `call` from the owned `input` into the owned `output`; both come back
    /// through the handle.
    fn later_apart<T, I, O>(
        &self,
        call: DeviceCall,
        input: I,
        mut output: O,
        stream: &Arc<CudaStream>,
    ) -> DeviceWork<(I, O)>
    where
        T: Element,
        I: DevicePtr<T> + Send + 'static,
        O: DevicePtrMut<T> + Send + 'static,
    {
        let job = self
            .shared
            .check_issue(stream)
            .and_then(|()| self.shared.apart_job(call, &input, &mut output, stream));
        self.start(job, (input, output), stream, CallerStream::Ordered)
    }

    /// Issues the call `job` describes (or fails its handle with `job`'s error): records
    /// its start on `stream`, takes its place in the completion order, makes `stream` wait
    /// for its completion where `caller` says so, and queues it for Chorus's thread, which
    /// runs it on Chorus's work stream once the start has passed.
    fn start<B: Send + 'static>(
        &self,
        job: Result<Job>,
        buffers: B,
        stream: &Arc<CudaStream>,
        caller: CallerStream,
    ) -> DeviceWork<B> {
        let body =
            job.map(|job| move |shared: &Shared, start: &CudaEvent| shared.run_after(job, start));
        self.issue(body, buffers, (stream, caller))
    }

    /// Issues `body` in the stream order: records its start on `stream`, takes its place in
    /// the completion order, makes `stream` wait for its completion where `caller` says so,
    /// and queues it for Chorus's thread, which runs it with the start event; a `body` that
    /// is an error fails the handle with it.
    fn issue<B, F>(
        &self,
        body: Result<F>,
        buffers: B,
        (stream, caller): (&Arc<CudaStream>, CallerStream),
    ) -> DeviceWork<B>
    where
        B: Send + 'static,
        F: FnOnce(&Shared, &CudaEvent) -> Result<()> + Send + 'static,
    {
        let _issuing = lock(&self.order.issuing);
        let completion = self.order.completions.issue();
        let (begun, done) = match self.order.arm(completion.value()) {
            Ok(done) => {
                let wait = done.as_ref().filter(|_| caller == CallerStream::Ordered);
                (body.and_then(|body| begin(body, stream, wait)), done)
            }
            Err(e) => (Err(e), None),
        };
        let shared = Arc::clone(&self.shared);
        let work = self.queue.submit(move || {
            // Ends the call's place in the completion order however the call ends.
            let _completion = completion;
            let result = begun.and_then(|(body, start)| body(&shared, &start));
            (result, buffers)
        });
        DeviceWork {
            work,
            done: done.map(Arc::new),
        }
    }

    /// Runs `call`, collectives on host memory among this communicator's ranks (given this
    /// communicator's own duplicate of the host [`Communicator`] it was made from, so they
    /// run in issue order with its device calls), ordered on `stream` as a device call is: it starts once
    /// the work queued on `stream` before it has ended, and with [`CallerStream::Ordered`]
    /// work queued on `stream` afterwards waits for it. `keep` (the buffers `call` works on,
    /// say) comes back through the handle once it has ended. This is how host buffers take
    /// part in a stream's order (NCCL's calls on host pointers).
    ///
    /// ```no_run
    /// # fn demo(dev: &chorus::cuda::CudaCommunicator, stream: &std::sync::Arc<chorus::cuda::CudaStream>) -> chorus::Result<()> {
    /// use std::sync::{Arc, Mutex};
    /// use chorus::cuda::CallerStream;
    /// let grads = Arc::new(Mutex::new(vec![1.0f32; 1024]));
    /// let shared = Arc::clone(&grads);
    /// let work = dev.host_call((stream, CallerStream::Ordered), (), move |comm| {
    ///     let mut grads = shared.lock().unwrap();
    ///     comm.all_reduce(&mut grads, chorus::ReduceOp::Sum)
    /// });
    /// work.wait()?;
    /// assert_eq!(grads.lock().unwrap()[0], dev.world_size() as f32);
    /// # Ok(()) }
    /// ```
    pub fn host_call<K, F>(
        &self,
        (stream, caller): (&Arc<CudaStream>, CallerStream),
        keep: K,
        call: F,
    ) -> DeviceWork<K>
    where
        K: Send + 'static,
        F: FnOnce(&Communicator) -> Result<()> + Send + 'static,
    {
        self.on_host((stream, caller), keep, move |shared| call(&shared.comm))
    }

    /// Issues `run`, work of Chorus's thread, in the stream order: it starts once the work
    /// queued on `stream` before it has ended (see [`host_call`](Self::host_call)).
    fn on_host<K, F>(&self, on: (&Arc<CudaStream>, CallerStream), keep: K, run: F) -> DeviceWork<K>
    where
        K: Send + 'static,
        F: FnOnce(&Shared) -> Result<()> + Send + 'static,
    {
        let body = self.shared.check_issue(on.0).map(|()| {
            move |shared: &Shared, start: &CudaEvent| {
                start
                    .synchronize()
                    .map_err(CudaError::driver("waiting for the call's start"))?;
                run(shared)
            }
        });
        self.issue(body, keep, on).ordered(on.1)
    }

    /// Reduces `buf` across all ranks in place; every rank ends with the result.
    pub fn all_reduce<T: Element, B: DevicePtrMut<T>>(
        &self,
        buf: &mut B,
        op: ReduceOp,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.now(|s| s.in_place::<T, B>(DeviceCall::AllReduce(op), buf, stream))
    }

    /// Reduces every rank's `input` into every rank's `output` (same length).
    pub fn all_reduce_into<T: Element, I: DevicePtr<T>, O: DevicePtrMut<T>>(
        &self,
        input: &I,
        output: &mut O,
        op: ReduceOp,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.now(|s| s.apart::<T, I, O>(DeviceCall::AllReduce(op), input, output, stream))
    }

    /// Copies `root`'s `buf` into every other rank's `buf`.
    pub fn broadcast<T: Element, B: DevicePtrMut<T>>(
        &self,
        buf: &mut B,
        root: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.now(|s| s.in_place::<T, B>(DeviceCall::Broadcast { root }, buf, stream))
    }

    /// Copies `root`'s `input` into every rank's `output` (`input` is read on the root only).
    pub fn broadcast_into<T: Element, I: DevicePtr<T>, O: DevicePtrMut<T>>(
        &self,
        input: &I,
        output: &mut O,
        root: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.now(|s| s.apart::<T, I, O>(DeviceCall::Broadcast { root }, input, output, stream))
    }

    /// Reduces every rank's `buf` into `root`'s `buf`; other ranks' buffers are left as they were.
    pub fn reduce<T: Element, B: DevicePtrMut<T>>(
        &self,
        buf: &mut B,
        op: ReduceOp,
        root: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.now(|s| s.in_place::<T, B>(DeviceCall::Reduce { op, root }, buf, stream))
    }

    /// Reduces every rank's `input` into `root`'s `output` (same length); other outputs are untouched.
    pub fn reduce_into<T: Element, I: DevicePtr<T>, O: DevicePtrMut<T>>(
        &self,
        input: &I,
        output: &mut O,
        op: ReduceOp,
        root: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.now(|s| s.apart::<T, I, O>(DeviceCall::Reduce { op, root }, input, output, stream))
    }

    /// Gathers every rank's `input` into every rank's `output` (`world_size` blocks, block
    /// `q` from rank `q`).
    pub fn all_gather<T: Element, I: DevicePtr<T>, O: DevicePtrMut<T>>(
        &self,
        input: &I,
        output: &mut O,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.now(|s| s.apart::<T, I, O>(DeviceCall::AllGather, input, output, stream))
    }

    /// Reduces `input` (`world_size` blocks) across ranks; `output` gets block `rank` of
    /// the result.
    pub fn reduce_scatter<T: Element, I: DevicePtr<T>, O: DevicePtrMut<T>>(
        &self,
        input: &I,
        output: &mut O,
        op: ReduceOp,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.now(|s| s.apart::<T, I, O>(DeviceCall::ReduceScatter(op), input, output, stream))
    }

    /// Sends block `q` of `input` (`world_size` equal blocks) to rank `q`, and receives rank
    /// `q`'s block into block `q` of `output` (as long).
    pub fn all_to_all<T: Element, I: DevicePtr<T>, O: DevicePtrMut<T>>(
        &self,
        input: &I,
        output: &mut O,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.now(|s| s.apart::<T, I, O>(DeviceCall::AllToAll, input, output, stream))
    }

    /// Starts [`all_reduce`](Self::all_reduce) on an owned buffer and returns once it is
    /// enqueued; the buffer comes back from [`DeviceWork::wait`], once the result is in it.
    ///
    /// Asynchronous calls run in issue order on Chorus's thread, and blocking calls wait for
    /// them first; `stream` is ordered around the call as the
    /// [module documentation](self#ordering-and-completion) says.
    pub fn all_reduce_async<T, B>(
        &self,
        buf: B,
        op: ReduceOp,
        stream: &Arc<CudaStream>,
    ) -> DeviceWork<B>
    where
        T: Element,
        B: DevicePtrMut<T> + Send + 'static,
    {
        self.later_in_place(DeviceCall::AllReduce(op), buf, stream)
    }

    /// Starts [`broadcast`](Self::broadcast) on an owned buffer (see
    /// [`all_reduce_async`](Self::all_reduce_async)).
    pub fn broadcast_async<T, B>(
        &self,
        buf: B,
        root: usize,
        stream: &Arc<CudaStream>,
    ) -> DeviceWork<B>
    where
        T: Element,
        B: DevicePtrMut<T> + Send + 'static,
    {
        self.later_in_place(DeviceCall::Broadcast { root }, buf, stream)
    }

    /// Starts [`reduce`](Self::reduce) on an owned buffer (see
    /// [`all_reduce_async`](Self::all_reduce_async)).
    pub fn reduce_async<T, B>(
        &self,
        buf: B,
        op: ReduceOp,
        root: usize,
        stream: &Arc<CudaStream>,
    ) -> DeviceWork<B>
    where
        T: Element,
        B: DevicePtrMut<T> + Send + 'static,
    {
        self.later_in_place(DeviceCall::Reduce { op, root }, buf, stream)
    }

    /// Starts [`all_gather`](Self::all_gather) on owned buffers, given back as `(input,
    /// output)` (see [`all_reduce_async`](Self::all_reduce_async)).
    pub fn all_gather_async<T, I, O>(
        &self,
        input: I,
        output: O,
        stream: &Arc<CudaStream>,
    ) -> DeviceWork<(I, O)>
    where
        T: Element,
        I: DevicePtr<T> + Send + 'static,
        O: DevicePtrMut<T> + Send + 'static,
    {
        self.later_apart(DeviceCall::AllGather, input, output, stream)
    }

    /// Starts [`reduce_scatter`](Self::reduce_scatter) on owned buffers, given back as
    /// `(input, output)` (see [`all_reduce_async`](Self::all_reduce_async)).
    pub fn reduce_scatter_async<T, I, O>(
        &self,
        input: I,
        output: O,
        op: ReduceOp,
        stream: &Arc<CudaStream>,
    ) -> DeviceWork<(I, O)>
    where
        T: Element,
        I: DevicePtr<T> + Send + 'static,
        O: DevicePtrMut<T> + Send + 'static,
    {
        self.later_apart(DeviceCall::ReduceScatter(op), input, output, stream)
    }

    /// Starts [`all_to_all`](Self::all_to_all) on owned buffers, given back as `(input,
    /// output)` (see [`all_reduce_async`](Self::all_reduce_async)).
    pub fn all_to_all_async<T, I, O>(
        &self,
        input: I,
        output: O,
        stream: &Arc<CudaStream>,
    ) -> DeviceWork<(I, O)>
    where
        T: Element,
        I: DevicePtr<T> + Send + 'static,
        O: DevicePtrMut<T> + Send + 'static,
    {
        self.later_apart(DeviceCall::AllToAll, input, output, stream)
    }

    /// Runs `call` on raw device pointers: `count` elements of `dtype` per rank block (see
    /// [`DeviceCall`] for the input and output lengths), ordered on `stream` as the
    /// [module documentation](self) says. In place when `input == output` (all-reduce,
    /// broadcast, reduce), or with NCCL's in-place layouts (all-gather: `input` is block
    /// `rank` of `output`; reduce-scatter: `output` is block `rank` of `input`).
    ///
    /// # Safety
    /// `input` and `output` must address device memory of this communicator's device (or
    /// memory mapped into its context) of at least the call's input and output lengths,
    /// allocated until the call returns, and not otherwise overlapping; nothing else may
    /// write them during the call.
    pub unsafe fn call_raw(
        &self,
        call: DeviceCall,
        dtype: DType,
        (input, output): (u64, u64),
        count: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.now(|s| {
            let job = s.job(call, dtype, count, (input, output))?;
            s.check_stream(stream)?;
            s.run(job, stream)
        })
    }

    /// Starts `call` on raw device pointers, as [`call_raw`](Self::call_raw) describes them,
    /// and returns once it is enqueued: its input is read after the work queued on `stream`
    /// before the call. With [`CallerStream::Ordered`], `stream` waits for the call (NCCL's
    /// rule); with [`CallerStream::Free`] it runs on, and the caller orders streams after the
    /// call with [`DeviceWork::wait_on`] (torch's `Work.wait()`).
    ///
    /// The call holds `keep` (what owns the memory, say) until it ends, and gives it back
    /// through the handle.
    ///
    /// # Safety
    /// As for [`call_raw`](Self::call_raw), until the call has ended: until
    /// [`DeviceWork::wait`] returns, or a stream ordered after the call has passed it.
    pub unsafe fn start_raw<K: Send + 'static>(
        &self,
        call: DeviceCall,
        dtype: DType,
        (input, output): (u64, u64),
        count: usize,
        (stream, caller): (&Arc<CudaStream>, CallerStream),
        keep: K,
    ) -> DeviceWork<K> {
        let job = self
            .shared
            .check_issue(stream)
            .and_then(|()| self.shared.job(call, dtype, count, (input, output)));
        self.start(job, keep, stream, caller).ordered(caller)
    }
}

impl CudaCommunicator {
    /// Starts the sends and receives `messages` on device memory together (as a
    /// [`Group`](crate::Group) of host messages does) and returns once they are enqueued,
    /// ordered on `stream` as [`start_raw`](Self::start_raw) orders a call: they read and
    /// write their memory after the work queued on `stream` before them. A send to a peer
    /// is matched by that peer's receive from this rank of the same tag, in order; each
    /// pair must describe the same messages (bytes per tag), or both of its ranks fail
    /// naming the other. Between ranks of one host (on the IPC and hierarchical paths) the
    /// bytes move through CUDA IPC; others through page-locked copies and the host's
    /// messages. `keep` comes back through the handle.
    ///
    /// # Safety
    /// Every message's memory must be device memory of this communicator's device of its
    /// length, allocated until the call has ended (until [`DeviceWork::wait`] returns, or a
    /// stream ordered after the call has passed it); nothing else may write it meanwhile,
    /// and no receive may overlap another message's memory.
    pub unsafe fn exchange_raw<K: Send + 'static>(
        &self,
        messages: Vec<DeviceMessage>,
        (stream, caller): (&Arc<CudaStream>, CallerStream),
        keep: K,
    ) -> DeviceWork<K> {
        let world = self.world_size();
        let checked = match messages.iter().find(|m| m.peer() >= world) {
            Some(m) => Err(Error::InvalidArgument(format!(
                "{m:?}: rank {} is not a rank (world size {world})",
                m.peer()
            ))),
            None => self.shared.check_issue(stream),
        };
        let body = checked.map(|()| {
            move |shared: &Shared, start: &CudaEvent| {
                shared.work.wait(start).map_err(CudaError::driver(
                    "ordering the work stream after the call's start",
                ))?;
                shared.exchange(messages)
            }
        });
        self.issue(body, keep, (stream, caller)).ordered(caller)
    }
}

/// Whether an asynchronous call's stream waits for the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallerStream {
    /// The stream waits for the call: work queued on it afterwards comes after the call, as
    /// with NCCL.
    Ordered,
    /// The stream runs on; streams are ordered after the call through
    /// [`DeviceWork::wait_on`], as torch's `Work.wait()` does.
    Free,
}

impl Shared {
    fn in_place<T: Element, B: DevicePtrMut<T>>(
        &self,
        call: DeviceCall,
        buf: &mut B,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let job = self.in_place_job(call, buf, stream)?;
        self.run(job, stream)
    }

    /// Checks the buffer of a call in place on `buf` and describes it; `stream` waits for
    /// the buffer's pending work (cudarc's tracking).
    fn in_place_job<T: Element, B: DevicePtrMut<T>>(
        &self,
        call: DeviceCall,
        buf: &mut B,
        stream: &Arc<CudaStream>,
    ) -> Result<Job> {
        self.check_buffer("buffer", buf.stream())?;
        let count = buf.len();
        let (ptr, _write) = buf.device_ptr_mut(stream);
        self.job(call, T::DTYPE, count, (ptr, ptr))
    }

    fn apart<T: Element, I: DevicePtr<T>, O: DevicePtrMut<T>>(
        &self,
        call: DeviceCall,
        input: &I,
        output: &mut O,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let job = self.apart_job(call, input, output, stream)?;
        self.run(job, stream)
    }

    /// Checks the buffers of a call from `input` into `output` and describes it; `stream`
    /// waits for the buffers' pending work (cudarc's tracking).
    fn apart_job<T: Element, I: DevicePtr<T>, O: DevicePtrMut<T>>(
        &self,
        call: DeviceCall,
        input: &I,
        output: &mut O,
        stream: &Arc<CudaStream>,
    ) -> Result<Job> {
        self.check_buffer("input buffer", input.stream())?;
        self.check_buffer("output buffer", output.stream())?;
        let world = self.comm.world_size();
        let count = match call {
            DeviceCall::ReduceScatter(_) => output.len(),
            DeviceCall::AllToAll => input.len() / world.max(1),
            _ => input.len(),
        };
        let (inputs, outputs) = call
            .lengths(count, world)
            .ok_or_else(|| Error::InvalidArgument(format!("{}: too long", call.name())))?;
        if input.len() != inputs || output.len() != outputs {
            return Err(Error::InvalidArgument(format!(
                "{} on {world} ranks: the input has {} elements and the output {}; expected {inputs} and {outputs}",
                call.name(),
                input.len(),
                output.len()
            )));
        }
        let (pi, _read) = input.device_ptr(stream);
        let (po, _write) = output.device_ptr_mut(stream);
        self.job(call, T::DTYPE, count, (pi, po))
    }

    /// Checks a call's arguments and describes it.
    fn job(
        &self,
        call: DeviceCall,
        dtype: DType,
        count: usize,
        (input, output): (u64, u64),
    ) -> Result<Job> {
        let world = self.comm.world_size();
        match call {
            DeviceCall::AllReduce(op)
            | DeviceCall::Reduce { op, .. }
            | DeviceCall::ReduceScatter(op) => op.check(dtype)?,
            _ => {}
        }
        if let DeviceCall::Broadcast { root } | DeviceCall::Reduce { root, .. } = call {
            if root >= world {
                return Err(Error::InvalidArgument(format!(
                    "{}: root {root} is not a rank (world size {world})",
                    call.name()
                )));
            }
        }
        let block = count
            .checked_mul(dtype.size())
            .filter(|b| call.lengths(*b, world).is_some())
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{}: {count} elements is too many", call.name()))
            })?;
        Ok(Job {
            call,
            dtype,
            block,
            input,
            output,
        })
    }

    fn run(&self, job: Job, stream: &Arc<CudaStream>) -> Result<()> {
        self.device
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("binding the device's context"))?;
        let mut path = self.lock();
        match &mut *path {
            Path::Ipc(peers) => peers.run(&self.comm, &self.device, job, stream),
            Path::Staged(staging) => staging.run(&self.comm, &self.device, job, stream),
            Path::Hierarchical(tiered) => tiered.run(&self.comm, &self.device, job, stream),
        }
    }

    /// Runs `messages` on Chorus's work stream: through IPC to this host's ranks where the
    /// path maps their memory, the rest through page-locked copies.
    fn exchange(&self, messages: Vec<DeviceMessage>) -> Result<()> {
        self.device
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("binding the device's context"))?;
        let remote = match &*self.lock() {
            Path::Ipc(peers) => {
                peers.exchange(&self.comm, &self.device, &messages, &self.work)?;
                Vec::new()
            }
            Path::Hierarchical(tiered) => {
                tiered.exchange_local(&self.comm, &self.device, messages, &self.work)?
            }
            Path::Staged(_) => messages,
        };
        if remote.is_empty() {
            return Ok(());
        }
        let memory: Vec<Staged> = remote
            .iter()
            .map(|m| match *m {
                DeviceMessage::Send { at, bytes, .. } => Staged::Input(at, bytes),
                DeviceMessage::Recv { at, bytes, .. } => Staged::Output(at, bytes),
            })
            .collect();
        host::run_staged(self, &memory, |comm, pieces| {
            comm.group(|g| {
                for (piece, m) in pieces.iter_mut().zip(&remote) {
                    match *m {
                        DeviceMessage::Send { peer, tag, .. } => g.send::<u8>(piece, peer, tag),
                        DeviceMessage::Recv { peer, tag, .. } => g.recv::<u8>(piece, peer, tag),
                    }
                }
            })
        })
    }

    /// Runs an asynchronous call on Chorus's work stream once `start` has passed.
    fn run_after(&self, job: Job, start: &CudaEvent) -> Result<()> {
        self.work.wait(start).map_err(CudaError::driver(
            "ordering the work stream after the call's start",
        ))?;
        self.run(job, &self.work)
    }

    /// Checks a stream an asynchronous call is issued on: on this device, and not being
    /// captured into a CUDA graph (the call is driven from the host, so a graph could not
    /// replay it).
    fn check_issue(&self, stream: &CudaStream) -> Result<()> {
        self.check_stream(stream)?;
        if is_capturing(stream)? {
            return Err(Error::InvalidArgument(
                "the stream is being captured into a CUDA graph: Chorus's device calls are \
                 driven from the host and cannot be captured; make the call outside the capture"
                    .to_string(),
            ));
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Path> {
        self.path.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn check_stream(&self, stream: &CudaStream) -> Result<()> {
        self.check_buffer("stream", stream)
    }

    /// Fails unless `owner` (a stream, or the stream a buffer belongs to) is on this device.
    fn check_buffer(&self, what: &'static str, owner: &CudaStream) -> Result<()> {
        if **owner.context() != **self.device.context() {
            return Err(CudaError::WrongDevice {
                what,
                ordinal: self.device.ordinal(),
            }
            .into());
        }
        Ok(())
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let _ = self.device.context().bind_to_thread();
        match &mut *self.lock() {
            Path::Ipc(peers) => peers.close(&self.comm),
            Path::Hierarchical(tiered) => tiered.close(),
            Path::Staged(_) => {}
        }
    }
}

/// Records the start of the call `body` runs on the caller's `stream`, then makes `stream`
/// wait for `done`, the call's completion, where there is one.
fn begin<F>(body: F, stream: &CudaStream, done: Option<&CudaEvent>) -> Result<(F, CudaEvent)> {
    let start = stream
        .record_event(None)
        .map_err(CudaError::driver("recording the call's start"))?;
    if let Some(done) = done {
        stream
            .wait(done)
            .map_err(CudaError::driver("ordering the stream after the call"))?;
    }
    Ok((body, start))
}

impl Order {
    /// Records, on the completion stream, an event that fires once the counter reaches
    /// `value`; `None` where the device cannot make streams wait on memory.
    fn arm(&self, value: u64) -> Result<Option<CudaEvent>> {
        let Some(stream) = &self.stream else {
            return Ok(None);
        };
        // SAFETY: the counter lives in `self`, whose drop releases every value handed out
        // and synchronizes `stream` before the counter goes.
        unsafe { self.completions.memory().wait_at_least(stream, value) }?;
        let done = stream
            .record_event(None)
            .map_err(CudaError::driver("recording the call's completion"))?;
        Ok(Some(done))
    }
}

impl Drop for Order {
    fn drop(&mut self) {
        // Calls whose handles outlive the communicator never run: release every stream
        // that waits on them before the counter's memory can go.
        self.completions.release_all();
        if let Some(stream) = &self.stream {
            if let Err(err) = stream.synchronize() {
                tracing::warn!(%err, "waiting for the completion stream failed");
            }
        }
    }
}

/// A device call in flight: Chorus's [`Work`] for it, and its completion event.
///
/// The call was ordered after the work queued on the caller's stream before it; it runs
/// on Chorus's own stream. [`wait_on`](Self::wait_on) orders another stream after it
/// without blocking the host; [`wait`](Self::wait) blocks the host and gives the buffers
/// back.
#[must_use = "a device call's result is only seen through its handle"]
pub struct DeviceWork<B> {
    work: Work<B>,
    /// Fires once this call and every earlier one have ended (`None` where streams cannot
    /// wait on memory).
    done: Option<Arc<CudaEvent>>,
}

impl<B> std::fmt::Debug for DeviceWork<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceWork")
            .field("completed", &self.is_completed())
            .field("stream_ordered", &self.done.is_some())
            .finish()
    }
}

impl<B> DeviceWork<B> {
    /// Whether the call has ended (its result is in place, or it failed).
    pub fn is_completed(&self) -> bool {
        self.work.is_completed()
    }

    /// Whether the call is ordered on streams: the caller's stream waits for it, and
    /// [`wait_on`](Self::wait_on) orders others without blocking the host. False where the
    /// device cannot make streams wait on memory (the buffers, owned by the call, are then
    /// protected by ownership alone, and `wait_on` blocks the host).
    pub fn stream_ordered(&self) -> bool {
        self.done.is_some()
    }

    /// The event that fires once the call (and every call issued before it) has ended,
    /// successfully or not: a stream made to wait on it is ordered after the call, as
    /// [`wait_on`](Self::wait_on) orders one, and the event outlives the handle (for a
    /// binding whose waits and stream orders come from different threads). `None` where the
    /// call is not [stream-ordered](Self::stream_ordered).
    pub fn done_event(&self) -> Option<Arc<CudaEvent>> {
        self.done.clone()
    }

    /// Makes `stream` wait for the call without blocking the host: work queued on it
    /// afterwards sees the result. A call that fails still releases the stream; its error
    /// comes from [`wait`](Self::wait). Where the device cannot make streams wait on memory,
    /// this blocks the host until the call has ended instead.
    pub fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        match &self.done {
            Some(done) => stream
                .wait(done)
                .map_err(|e| CudaError::driver("ordering a stream after the call")(e).into()),
            None => {
                self.work.finished();
                Ok(())
            }
        }
    }

    /// The handle of a call on memory the caller keeps (a raw call's), once `caller`'s rule
    /// holds: where streams cannot wait on memory, a call whose stream should wait for it
    /// ([`CallerStream::Ordered`]) has ended before the caller goes on, since the caller may
    /// use the memory once the stream has passed the call.
    fn ordered(self, caller: CallerStream) -> DeviceWork<B> {
        if caller == CallerStream::Ordered && self.done.is_none() {
            self.work.finished();
        }
        self
    }

    /// Blocks until the call has ended and gives the buffers back, or its error. Chorus's
    /// thread runs the calls in issue order; a wait never runs one on the waiting thread.
    pub fn wait(self) -> Result<B> {
        self.work.join()
    }
}

/// Meets every rank and checks that all make the same call (for IPC the rounds, and so
/// the scratch halves, must match); fails naming the first rank that differs.
fn agree(comm: &Communicator, job: Job) -> Result<()> {
    let (kind, op, root) = job.call.host();
    let mine = [
        kind as u64,
        op as u64,
        root as u64,
        job.dtype as u64,
        job.block as u64,
    ];
    let mut all = vec![0u64; mine.len() * comm.world_size()];
    comm.all_gather(&mine, &mut all)?;
    match all.chunks(mine.len()).position(|theirs| theirs != mine) {
        None => Ok(()),
        Some(q) => {
            let dtype = job.dtype;
            let call = CallInfo::new(kind, dtype, op, root, job.block / dtype.size())?;
            let theirs = &all[q * mine.len()..(q + 1) * mine.len()];
            let fault = comm
                .found(Cause::Mismatch, Some(q))
                .in_call(call, 0)
                .saying(format!(
                    "rank {q} made another device call or passed another size ({} bytes of {})",
                    theirs[4],
                    DType::ALL
                        .get(theirs[3] as usize)
                        .map_or("an unknown type".to_string(), |d| d.to_string())
                ));
            Err(fault.into())
        }
    }
}

/// One round of a call: bytes `offset..offset + len` of each rank block, through one
/// half of every scratch buffer.
/// Rank `q`'s slice (byte range) of a round or chunk of `len` bytes: `world` slices of whole
/// elements, each a multiple of 16 bytes where the round allows, the last one shorter.
fn slice(len: usize, dtype: DType, world: usize, q: usize) -> (usize, usize) {
    let per = slice_width(len, dtype, world);
    let start = (q * per).min(len);
    (start, ((q + 1) * per).min(len))
}

/// The length of every slice of [`slice`] but the last ones (which may be shorter).
fn slice_width(len: usize, dtype: DType, world: usize) -> usize {
    let unit = 16.max(dtype.size());
    len.div_ceil(world).div_ceil(unit) * unit
}

/// Chooses and sets up the path of a device communicator over `comm` (see the
/// [module documentation](self)); collective. The device's context must be current.
fn choose(comm: &Communicator, device: &Device, forced: Option<DevicePath>) -> Result<Path> {
    let hosts = tiered::Hosts::gather(comm)?;
    let (rank, count, most) = (comm.rank(), hosts.count(), hosts.most_local());
    let layout = DeviceLayout {
        world: comm.world_size(),
        hosts: count,
        most_local: most,
    };
    // Every rank prices the same layout with the same figures, so all pick alike.
    let links = DeviceLinks::assumed(LinkModel::default());
    let cheapest = || {
        let c = crate::algorithm::Collective::AllReduce;
        cost::pick(&layout.paths(), c, cost::PICK_BYTES, layout, &links)
            .unwrap_or(DevicePath::Staged)
    };
    let wanted = forced.unwrap_or_else(cheapest);
    let refused = |why: String| -> Result<Path> {
        if forced.is_some() {
            return Err(Error::Config {
                var: CHORUS_CUDA_PATH,
                value: wanted.name().into(),
                reason: why,
            });
        }
        tracing::info!(rank, "device collectives take the staged path: {why}");
        Ok(Path::Staged(staged::Staging::new(
            device,
            comm.world_size(),
        )?))
    };
    // Where only some ranks of a host can map each other's memory, the islands of those
    // that can are the hierarchical path's hosts (unless IPC alone was asked for).
    let unmapped = |why: String| -> Result<Path> {
        if forced == Some(DevicePath::Ipc) {
            return refused(why);
        }
        match tiered::Tiered::on_islands(comm, device, &hosts)? {
            Ok(tiered) => Ok(Path::Hierarchical(tiered)),
            Err(_) => refused(why),
        }
    };
    let path = match wanted {
        DevicePath::Staged => Path::Staged(staged::Staging::new(device, comm.world_size())?),
        DevicePath::Ipc => match hosts.apart_from(rank) {
            Some(q) => return refused(format!("rank {q} runs on another host than rank {rank}")),
            None => match ipc::Peers::connect(comm, device)? {
                Ok(peers) => Path::Ipc(peers),
                Err(why) => unmapped(why)?,
            },
        },
        DevicePath::Hierarchical => match tiered::Tiered::connect(comm, device, hosts.clone())? {
            Ok(tiered) => Path::Hierarchical(tiered),
            Err(why) => unmapped(why)?,
        },
    };
    tracing::info!(
        rank,
        hosts = count,
        most_local = most,
        "device collectives take the {:?} path{}",
        path.kind(),
        if forced.is_some() {
            " (CHORUS_CUDA_PATH)"
        } else {
            ""
        }
    );
    Ok(path)
}

/// The path `CHORUS_CUDA_PATH` forces, if any.
fn forced_path() -> Result<Option<DevicePath>> {
    match std::env::var(CHORUS_CUDA_PATH) {
        Err(_) => Ok(None),
        Ok(v) => match v.trim() {
            "" | "auto" => Ok(None),
            "ipc" => Ok(Some(DevicePath::Ipc)),
            "staged" => Ok(Some(DevicePath::Staged)),
            "hierarchical" => Ok(Some(DevicePath::Hierarchical)),
            _ => Err(Error::Config {
                var: CHORUS_CUDA_PATH,
                value: v,
                reason: "expected auto, ipc, staged or hierarchical".into(),
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_follow_the_collective() {
        assert_eq!(DeviceCall::AllGather.lengths(3, 4), Some((3, 12)));
        assert_eq!(
            DeviceCall::ReduceScatter(ReduceOp::Sum).lengths(3, 4),
            Some((12, 3))
        );
        assert_eq!(
            DeviceCall::Broadcast { root: 1 }.lengths(3, 4),
            Some((3, 3))
        );
        assert_eq!(DeviceCall::AllGather.lengths(usize::MAX, 2), None);
    }

    #[test]
    fn slices_split_a_round_in_whole_aligned_pieces() {
        let pieces: Vec<_> = (0..4).map(|q| slice(100, DType::F32, 4, q)).collect();
        assert_eq!(pieces, [(0, 32), (32, 64), (64, 96), (96, 100)]);
        // More ranks than 16-byte units: the last ranks get nothing.
        assert_eq!(slice(16, DType::F64, 3, 1), (16, 16));
        assert_eq!(slice(0, DType::U8, 2, 0), (0, 0));
    }
}
