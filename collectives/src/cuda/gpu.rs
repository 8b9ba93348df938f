//! What the device paths ask of a GPU: page-locked host buffers, device scratch memory
//! that other processes of the host can map (CUDA IPC), copies between them, the reduction
//! kernels, and queues of work ordered by events.
//!
//! [`Gpu`] is implemented for a CUDA [`Device`] (its streams are the queues) and, in the
//! tests, by a device made of host memory whose queues run only when the host waits for
//! them, so every path's data flow and its ordering are checked without a GPU.

use chorus_kernels::cuda::cudarc::driver::CudaEvent;
use chorus_kernels::cuda::memory::{
    copy_on_device, copy_to_device, copy_to_host, zero_on_device, DeviceAlloc, IpcHandle,
    IpcMapping, Pinned,
};
use chorus_kernels::cuda::{CudaError, CudaStream, Device};
use chorus_kernels::{DType, ReduceOp};

use crate::Result;

/// Host memory a [`Gpu`] copies to and from without staging it again.
pub(super) trait HostBuffer: Send {
    /// The address `offset` bytes in.
    fn at(&self, offset: usize) -> *mut u8;
    /// The first `len` bytes.
    fn bytes(&self, len: usize) -> &[u8];
    /// The first `len` bytes, to write.
    fn bytes_mut(&mut self, len: usize) -> &mut [u8];
}

/// Bytes of the handle through which another process maps device memory.
pub(super) const HANDLE: usize = IpcHandle::LEN;

/// The operations of a device the device paths run on. Device memory is named by its
/// address; work is enqueued on a queue and runs in that queue's order, after the events
/// the queue was told to wait for.
pub(super) trait Gpu: Sync {
    /// Page-locked host memory.
    type Pinned: HostBuffer;
    /// Device memory of the path's own.
    type Scratch: Send;
    /// A point in a queue's work that another queue, or the host, can wait for.
    type Event: Send;
    /// A queue of device work, run in order.
    type Queue: Send + Sync;
    /// Another process's device memory mapped into this one, unmapped on drop.
    type Mapping: Send;

    /// `len` bytes of page-locked host memory.
    fn pinned(&self, len: usize) -> Result<Self::Pinned>;
    /// `len` bytes of device memory.
    fn scratch(&self, len: usize) -> Result<Self::Scratch>;
    /// The device address of `scratch`.
    fn address(scratch: &Self::Scratch) -> u64;
    /// The handle through which other processes of the host map `scratch`.
    fn export(&self, scratch: &Self::Scratch) -> Result<[u8; HANDLE]>;
    /// Maps the memory another process exported as `handle`.
    fn open(&self, handle: &[u8; HANDLE]) -> Result<Self::Mapping>;
    /// The address of a mapping in this process.
    fn mapped(mapping: &Self::Mapping) -> u64;
    /// A new event, recorded nowhere yet.
    fn event(&self) -> Result<Self::Event>;
    /// A new queue.
    fn queue(&self) -> Result<std::sync::Arc<Self::Queue>>;
    /// Makes the device current on the calling thread (before it enqueues work).
    fn bind(&self) -> Result<()>;

    /// Marks `event` at the end of the work enqueued on `queue` so far.
    fn record(&self, event: &Self::Event, queue: &Self::Queue) -> Result<()>;
    /// Makes the work enqueued on `queue` from now on wait for `event`.
    fn wait(&self, queue: &Self::Queue, event: &Self::Event) -> Result<()>;
    /// Blocks the host until `event` has passed.
    fn wait_event(&self, event: &Self::Event) -> Result<()>;
    /// Blocks the host until every piece of work enqueued on `queue` has run.
    fn finish(&self, queue: &Self::Queue) -> Result<()>;

    /// Enqueues a copy of `len` bytes from device address `src` to host `dst`.
    ///
    /// # Safety
    /// `src` must hold `len` bytes of device memory and `dst` `len` bytes of page-locked
    /// host memory until the copy has run, and nothing may touch `dst` meanwhile.
    unsafe fn to_host(&self, dst: *mut u8, src: u64, len: usize, queue: &Self::Queue)
        -> Result<()>;
    /// Enqueues a copy of `len` bytes from host `src` to device address `dst`.
    ///
    /// # Safety
    /// As [`to_host`](Gpu::to_host), the directions swapped: nothing may write `src` until
    /// the copy has run.
    unsafe fn to_device(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
        queue: &Self::Queue,
    ) -> Result<()>;
    /// Enqueues a copy of `len` bytes between device addresses; nothing when they are equal.
    ///
    /// # Safety
    /// Both must hold `len` bytes of device memory until the copy has run, and not overlap
    /// unless equal.
    unsafe fn on_device(&self, dst: u64, src: u64, len: usize, queue: &Self::Queue) -> Result<()>;
    /// Enqueues the zeroing of `len` bytes at device address `dst`.
    ///
    /// # Safety
    /// `dst` must hold `len` bytes of device memory until the work has run, and nothing else
    /// may touch them meanwhile.
    unsafe fn zero(&self, dst: u64, len: usize, queue: &Self::Queue) -> Result<()>;
    /// Enqueues `dst = a op b` over `len` bytes of `dtype` elements, `ptrs` being `[dst, a, b]`.
    ///
    /// # Safety
    /// The three must hold `len` bytes of device memory until the kernel has run; `dst` may
    /// equal `a` or `b` but not otherwise overlap them.
    unsafe fn reduce(
        &self,
        op: ReduceOp,
        dtype: DType,
        ptrs: [u64; 3],
        len: usize,
        queue: &Self::Queue,
    ) -> Result<()>;
    /// Enqueues the division of `len` bytes of `dtype` elements at `buf` by `n` (the end of
    /// an average).
    ///
    /// # Safety
    /// `buf` must hold `len` bytes of device memory until the kernel has run.
    unsafe fn finish_avg(
        &self,
        dtype: DType,
        buf: u64,
        len: usize,
        n: usize,
        queue: &Self::Queue,
    ) -> Result<()>;
}

/// `ran`, a call's outcome, once every piece of work enqueued on `queues` has run, whatever
/// `ran` says: a call's copies and kernels read and write the caller's buffers and the
/// path's own, so none may outlive the call, not even one that failed halfway. The call's
/// own error comes first.
pub(super) fn settle<G: Gpu>(gpu: &G, ran: Result<()>, queues: &[&G::Queue]) -> Result<()> {
    queues.iter().map(|q| gpu.finish(q)).fold(ran, Result::and)
}

impl HostBuffer for Pinned {
    fn at(&self, offset: usize) -> *mut u8 {
        Pinned::at(self, offset)
    }

    fn bytes(&self, len: usize) -> &[u8] {
        Pinned::bytes(self, len)
    }

    fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        Pinned::bytes_mut(self, len)
    }
}

impl Gpu for Device {
    type Pinned = Pinned;
    type Scratch = DeviceAlloc;
    type Event = CudaEvent;
    type Queue = CudaStream;
    type Mapping = IpcMapping;

    fn pinned(&self, len: usize) -> Result<Pinned> {
        Ok(Pinned::new(len)?)
    }

    fn scratch(&self, len: usize) -> Result<DeviceAlloc> {
        Ok(DeviceAlloc::new(len)?)
    }

    fn address(scratch: &DeviceAlloc) -> u64 {
        scratch.ptr()
    }

    fn export(&self, scratch: &DeviceAlloc) -> Result<[u8; HANDLE]> {
        Ok(scratch.export()?.0)
    }

    fn open(&self, handle: &[u8; HANDLE]) -> Result<IpcMapping> {
        Ok(IpcHandle(*handle).open()?)
    }

    fn mapped(mapping: &IpcMapping) -> u64 {
        mapping.ptr()
    }

    fn bind(&self) -> Result<()> {
        self.context()
            .bind_to_thread()
            .map_err(CudaError::driver("binding the device's context"))?;
        Ok(())
    }

    fn event(&self) -> Result<CudaEvent> {
        let event = self.context().new_event(None);
        Ok(event.map_err(CudaError::driver("creating an event"))?)
    }

    fn queue(&self) -> Result<std::sync::Arc<CudaStream>> {
        Ok(self.new_stream()?)
    }

    fn record(&self, event: &CudaEvent, queue: &CudaStream) -> Result<()> {
        let recorded = event.record(queue);
        Ok(recorded.map_err(CudaError::driver("recording an event"))?)
    }

    fn wait(&self, queue: &CudaStream, event: &CudaEvent) -> Result<()> {
        let ordered = queue.wait(event);
        Ok(ordered.map_err(CudaError::driver("ordering a stream after an event"))?)
    }

    fn wait_event(&self, event: &CudaEvent) -> Result<()> {
        let passed = event.synchronize();
        Ok(passed.map_err(CudaError::driver("waiting for an event"))?)
    }

    fn finish(&self, queue: &CudaStream) -> Result<()> {
        let done = queue.synchronize();
        Ok(done.map_err(CudaError::driver("waiting for a stream"))?)
    }

    unsafe fn to_host(&self, dst: *mut u8, src: u64, len: usize, queue: &CudaStream) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { copy_to_host(dst, src, len, queue) }.map_err(Into::into)
    }

    unsafe fn to_device(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
        queue: &CudaStream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { copy_to_device(dst, src, len, queue) }.map_err(Into::into)
    }

    unsafe fn on_device(&self, dst: u64, src: u64, len: usize, queue: &CudaStream) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { copy_on_device(dst, src, len, queue) }.map_err(Into::into)
    }

    unsafe fn zero(&self, dst: u64, len: usize, queue: &CudaStream) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { zero_on_device(dst, len, queue) }.map_err(Into::into)
    }

    unsafe fn reduce(
        &self,
        op: ReduceOp,
        dtype: DType,
        ptrs: [u64; 3],
        len: usize,
        queue: &CudaStream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.reduce_into_raw(op, dtype, ptrs, len, queue) }.map_err(Into::into)
    }

    unsafe fn finish_avg(
        &self,
        dtype: DType,
        buf: u64,
        len: usize,
        n: usize,
        queue: &CudaStream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.finish_avg_raw(dtype, buf, len, n, queue) }.map_err(Into::into)
    }
}

/// A [`Gpu`] of host memory for tests, whose queues run their work as late or as early as
/// the events allow, so that a missing wait shows as a wrong result. Its ranks are threads
/// of one process, so exporting memory hands out its address, which every rank can read. A lazy queue (every
/// queue [`Gpu::queue`] makes) keeps its work until the host waits for an event or for the
/// queue, then runs it in order, running the queues it was told to wait for up to their
/// events first: what the host reads without having waited is stale. An eager queue
/// ([`Queue::eager`]) runs each piece of work as soon as the events before it have passed:
/// work on it that should have waited for a lazy queue runs too soon.
#[cfg(test)]
pub(super) mod lazy {
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    use chorus_kernels::{DType, ReduceOp};

    use super::{Gpu, HostBuffer, HANDLE};
    use crate::Result;

    /// The device: it holds nothing; memory and queues are made on request. Devices of
    /// different islands cannot map each other's memory (as GPUs without peer access).
    #[derive(Default)]
    pub struct LazyGpu {
        island: u8,
        /// The copies it still enqueues before it refuses them; `None`: no limit.
        copies_left: Mutex<Option<usize>>,
        /// Every queue it made.
        queues: Mutex<Vec<Queue>>,
    }

    impl LazyGpu {
        /// A device of island `island`.
        pub fn on_island(island: u8) -> LazyGpu {
            LazyGpu {
                island,
                ..LazyGpu::default()
            }
        }

        /// A device that enqueues `copies` copies and then fails to enqueue any more, as a
        /// device that has gone wrong.
        pub fn refusing_after(copies: usize) -> LazyGpu {
            LazyGpu {
                copies_left: Mutex::new(Some(copies)),
                ..LazyGpu::default()
            }
        }

        /// Whether every queue it made has run all its work.
        pub fn idle(&self) -> bool {
            self.queues.lock().unwrap().iter().all(Queue::idle)
        }
    }

    /// Host memory, 16-byte aligned, standing for pinned and for device memory alike.
    pub struct Buffer(Vec<u128>);

    impl Buffer {
        pub fn new(len: usize) -> Buffer {
            Buffer(vec![0; len.div_ceil(16)])
        }

        pub fn address(&self) -> u64 {
            self.0.as_ptr() as u64
        }
    }

    impl HostBuffer for Buffer {
        fn at(&self, offset: usize) -> *mut u8 {
            self.0.as_ptr().cast::<u8>().cast_mut().wrapping_add(offset)
        }

        fn bytes(&self, len: usize) -> &[u8] {
            &bytemuck::cast_slice(&self.0)[..len]
        }

        fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
            &mut bytemuck::cast_slice_mut(&mut self.0)[..len]
        }
    }

    enum Op {
        Run(Box<dyn FnOnce() + Send>),
        /// Wait for a queue to have run this many pieces of work.
        After(Queue, usize),
    }

    #[derive(Default)]
    struct Work {
        pending: VecDeque<Op>,
        enqueued: usize,
        ran: usize,
        eager: bool,
    }

    /// A queue; clones are the same queue.
    #[derive(Clone, Default)]
    pub struct Queue(Arc<Mutex<Work>>);

    impl Queue {
        /// A queue that runs its work as soon as the events it waits for have passed.
        pub fn eager() -> Queue {
            let work = Work {
                eager: true,
                ..Work::default()
            };
            Queue(Arc::new(Mutex::new(work)))
        }

        fn push(&self, op: Op) {
            let eager = {
                let mut work = self.0.lock().unwrap();
                work.pending.push_back(op);
                work.enqueued += 1;
                work.eager
            };
            if eager {
                self.run_ready();
            }
        }

        /// Runs the work at the front whose events have passed, up to the first that waits.
        fn run_ready(&self) {
            loop {
                let op = {
                    let mut work = self.0.lock().unwrap();
                    let ready = match work.pending.front() {
                        Some(Op::Run(_)) => true,
                        Some(Op::After(queue, upto)) => queue.0.lock().unwrap().ran >= *upto,
                        None => false,
                    };
                    if !ready {
                        return;
                    }
                    work.ran += 1;
                    work.pending.pop_front().expect("work enqueued")
                };
                if let Op::Run(run) = op {
                    run();
                }
            }
        }

        /// Runs the work enqueued until the queue has run `upto` pieces.
        fn run_to(&self, upto: usize) {
            loop {
                let op = {
                    let mut work = self.0.lock().unwrap();
                    if work.ran >= upto {
                        return;
                    }
                    work.ran += 1;
                    work.pending.pop_front().expect("work enqueued")
                };
                match op {
                    Op::Run(run) => run(),
                    Op::After(queue, upto) => queue.run_to(upto),
                }
            }
        }

        fn enqueued(&self) -> usize {
            self.0.lock().unwrap().enqueued
        }

        fn idle(&self) -> bool {
            self.0.lock().unwrap().pending.is_empty()
        }

        fn run(&self, work: impl FnOnce() + Send + 'static) {
            self.push(Op::Run(Box::new(work)));
        }
    }

    /// Where an event was last recorded: a queue and how much of its work came before.
    #[derive(Default)]
    pub struct Event(Mutex<Option<(Queue, usize)>>);

    /// `len` bytes at `address`, as a slice.
    ///
    /// # Safety
    /// The bytes must be valid and touched by no one else while the slice lives.
    unsafe fn at<'a>(address: usize, len: usize) -> &'a mut [u8] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(address as *mut u8, len) }
    }

    impl Gpu for LazyGpu {
        type Pinned = Buffer;
        type Scratch = Buffer;
        type Event = Event;
        type Queue = Queue;
        type Mapping = u64;

        fn pinned(&self, len: usize) -> Result<Buffer> {
            Ok(Buffer::new(len))
        }

        fn scratch(&self, len: usize) -> Result<Buffer> {
            Ok(Buffer::new(len))
        }

        fn address(scratch: &Buffer) -> u64 {
            scratch.address()
        }

        fn export(&self, scratch: &Buffer) -> Result<[u8; HANDLE]> {
            let mut handle = [0; HANDLE];
            handle[..8].copy_from_slice(&scratch.address().to_ne_bytes());
            handle[8] = self.island;
            Ok(handle)
        }

        fn open(&self, handle: &[u8; HANDLE]) -> Result<u64> {
            if handle[8] != self.island {
                return Err(crate::Error::Internal(format!(
                    "island {} cannot map island {}'s memory",
                    self.island, handle[8]
                )));
            }
            let address = handle[..8].try_into().expect("eight bytes");
            Ok(u64::from_ne_bytes(address))
        }

        fn mapped(mapping: &u64) -> u64 {
            *mapping
        }

        fn event(&self) -> Result<Event> {
            Ok(Event::default())
        }

        fn queue(&self) -> Result<Arc<Queue>> {
            let queue = Queue::default();
            self.queues.lock().unwrap().push(queue.clone());
            Ok(Arc::new(queue))
        }

        fn bind(&self) -> Result<()> {
            Ok(())
        }

        fn record(&self, event: &Event, queue: &Queue) -> Result<()> {
            *event.0.lock().unwrap() = Some((queue.clone(), queue.enqueued()));
            Ok(())
        }

        fn wait(&self, queue: &Queue, event: &Event) -> Result<()> {
            if let Some((recorded, upto)) = event.0.lock().unwrap().clone() {
                queue.push(Op::After(recorded, upto));
            }
            Ok(())
        }

        fn wait_event(&self, event: &Event) -> Result<()> {
            let recorded = event.0.lock().unwrap().clone();
            if let Some((queue, upto)) = recorded {
                queue.run_to(upto);
            }
            Ok(())
        }

        fn finish(&self, queue: &Queue) -> Result<()> {
            queue.run_to(queue.enqueued());
            Ok(())
        }

        unsafe fn to_host(&self, dst: *mut u8, src: u64, len: usize, queue: &Queue) -> Result<()> {
            if let Some(left) = self.copies_left.lock().unwrap().as_mut() {
                *left = left.checked_sub(1).ok_or_else(|| {
                    crate::Error::Internal("the lazy device refuses the copy".into())
                })?;
            }
            let (dst, src) = (dst as usize, src as usize);
            queue.run(move || {
                // SAFETY: the caller's contract, which holds until the copy has run.
                unsafe { at(dst, len).copy_from_slice(at(src, len)) }
            });
            Ok(())
        }

        unsafe fn to_device(
            &self,
            dst: u64,
            src: *const u8,
            len: usize,
            queue: &Queue,
        ) -> Result<()> {
            // SAFETY: as for `to_host`.
            unsafe { self.to_host(dst as *mut u8, src as u64, len, queue) }
        }

        unsafe fn on_device(&self, dst: u64, src: u64, len: usize, queue: &Queue) -> Result<()> {
            if dst != src {
                // SAFETY: as for `to_host`.
                unsafe { self.to_host(dst as *mut u8, src, len, queue)? };
            }
            Ok(())
        }

        unsafe fn zero(&self, dst: u64, len: usize, queue: &Queue) -> Result<()> {
            let dst = dst as usize;
            queue.run(move || {
                // SAFETY: the caller's contract.
                unsafe { at(dst, len).fill(0) }
            });
            Ok(())
        }

        unsafe fn reduce(
            &self,
            op: ReduceOp,
            dtype: DType,
            [dst, a, b]: [u64; 3],
            len: usize,
            queue: &Queue,
        ) -> Result<()> {
            let [dst, a, b] = [dst, a, b].map(|p| p as usize);
            queue.run(move || {
                // SAFETY: the caller's contract: `dst` equals `a` or `b`, or overlaps neither.
                let reduced = unsafe {
                    match (dst == a, dst == b) {
                        (true, _) => chorus_kernels::reduce(op, dtype, at(dst, len), at(b, len)),
                        (_, true) => chorus_kernels::reduce(op, dtype, at(dst, len), at(a, len)),
                        _ => chorus_kernels::reduce_into(
                            op,
                            dtype,
                            at(dst, len),
                            at(a, len),
                            at(b, len),
                        ),
                    }
                };
                reduced.expect("a valid reduction");
            });
            Ok(())
        }

        unsafe fn finish_avg(
            &self,
            dtype: DType,
            buf: u64,
            len: usize,
            n: usize,
            queue: &Queue,
        ) -> Result<()> {
            let buf = buf as usize;
            queue.run(move || {
                // SAFETY: the caller's contract.
                let finished = chorus_kernels::finish_avg(dtype, unsafe { at(buf, len) }, n);
                finished.expect("a valid average");
            });
            Ok(())
        }
    }
}
