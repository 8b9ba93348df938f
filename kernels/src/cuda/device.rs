//! [`Device`]: a GPU with its reduction kernels, loaded once per process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::driver::sys::{CUdevice_attribute, CUresult};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice,
    DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::compile::{self, Origin};
use super::error::CudaError;
use super::source::{self, BLOCK_THREADS, KERNEL_OPS};
use super::{cache, load};
use crate::reduce::check_lengths;
use crate::{DType, KernelError, ReduceOp};

/// A CUDA device (its primary context) and the reduction kernels compiled for it.
///
/// Cheap to clone, and `Send + Sync`; [`Device::open`] on an ordinal already opened in
/// this process returns the same context and kernels. The kernels are compiled by NVRTC for the device's
/// compute capability on first use (or [`Device::load_kernels`]), and the compiled image is
/// cached on disk (see the [module documentation](super)), so later processes skip NVRTC.
///
/// The kernel methods take raw bytes ([`CudaSlice<u8>`], or a [`CudaView`](super::CudaView)
/// / [`CudaViewMut`](super::CudaViewMut) of one at any byte offset), validate them like the
/// host kernels do, and enqueue one kernel on the given stream without waiting for it.
#[derive(Clone)]
pub struct Device {
    shared: Arc<Shared>,
}

/// What every [`Device`] handle of one ordinal shares.
struct Shared {
    ctx: Arc<CudaContext>,
    capability: (i32, i32),
    /// Blocks that fill the device once (multiprocessors x resident blocks each).
    max_blocks: u32,
    /// The kernels once loaded, or why they could not be.
    kernels: Mutex<Option<Result<Arc<Kernels>, CudaError>>>,
}

/// The loaded kernel functions.
struct Kernels {
    /// `reduce[dtype_index * KERNEL_OPS.len() + op_index]`, in [`DType::ALL`] and
    /// [`KERNEL_OPS`] order; `None` where the operator does not apply to the type.
    reduce: Vec<Option<CudaFunction>>,
    /// `avg[dtype_index]`.
    avg: Vec<CudaFunction>,
}

impl Kernels {
    /// The reduce kernel for `op` on `dtype`; [`KernelError::UnsupportedOp`] where there is
    /// none (a bitwise operator on a float type).
    fn reduce_fn(&self, op: ReduceOp, dtype: DType) -> Result<&CudaFunction, KernelError> {
        self.reduce[reduce_index(op, dtype)]
            .as_ref()
            .ok_or(KernelError::UnsupportedOp { op, dtype })
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ordinal())
            .field("compute_capability", &self.shared.capability)
            .finish()
    }
}

impl Device {
    /// The number of CUDA devices; `Ok(0)` when the driver is installed but sees no GPU.
    ///
    /// Fails with [`CudaError::NoCuda`] when there is no CUDA driver library.
    pub fn count() -> Result<usize, CudaError> {
        load::driver()?;
        load::guarded("initialising the CUDA driver", count_devices)
    }

    /// Opens device `ordinal` (its primary context). Fails with [`CudaError::NoCuda`]
    /// when there is no CUDA driver and [`CudaError::NoDevice`] when there is no such
    /// device. Does not compile anything yet.
    pub fn open(ordinal: usize) -> Result<Device, CudaError> {
        static OPEN: OnceLock<Mutex<HashMap<usize, Arc<Shared>>>> = OnceLock::new();
        load::driver()?;
        let mut open = lock(OPEN.get_or_init(Default::default));
        if let Some(shared) = open.get(&ordinal) {
            return Ok(Device {
                shared: shared.clone(),
            });
        }
        let shared = load::guarded("opening the CUDA device", || {
            let count = count_devices()?;
            if ordinal >= count {
                return Err(CudaError::NoDevice { ordinal, count });
            }
            let ctx = CudaContext::new(ordinal).map_err(CudaError::driver("creating a context"))?;
            let attribute = |attr| {
                ctx.attribute(attr)
                    .map_err(CudaError::driver("querying device attributes"))
            };
            let capability = ctx
                .compute_capability()
                .map_err(CudaError::driver("querying the compute capability"))?;
            let sms = attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            let threads =
                attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)?;
            let per_sm = u32::try_from(threads).unwrap_or(0) / BLOCK_THREADS;
            let max_blocks = u32::try_from(sms).unwrap_or(1).max(1) * per_sm.max(1);
            Ok(Arc::new(Shared {
                ctx,
                capability,
                max_blocks,
                kernels: Mutex::new(None),
            }))
        })?;
        open.insert(ordinal, shared.clone());
        Ok(Device { shared })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.shared.ctx.ordinal()
    }

    /// The compute capability, (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.shared.capability
    }

    /// The device's name, as the driver reports it.
    pub fn name(&self) -> Result<String, CudaError> {
        self.shared
            .ctx
            .name()
            .map_err(CudaError::driver("querying the device name"))
    }

    /// The device's primary CUDA context, for anything this API does not cover.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.shared.ctx
    }

    /// A new (non-blocking) stream on this device.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>, CudaError> {
        self.shared
            .ctx
            .new_stream()
            .map_err(CudaError::driver("creating a stream"))
    }

    /// Compiles (or loads from the disk cache) the kernels now rather than on the first
    /// kernel call.
    pub fn load_kernels(&self) -> Result<(), CudaError> {
        self.kernels().map(drop)
    }

    /// Copies `bytes` into a new device buffer, in order on `stream`.
    pub fn upload(
        &self,
        stream: &Arc<CudaStream>,
        bytes: &[u8],
    ) -> Result<CudaSlice<u8>, CudaError> {
        self.check_stream(stream)?;
        stream
            .clone_htod(bytes)
            .map_err(CudaError::driver("copying to the device"))
    }

    /// Copies a device buffer to the host, waiting for `stream` to get there.
    pub fn download<S: DevicePtr<u8>>(
        &self,
        stream: &Arc<CudaStream>,
        src: &S,
    ) -> Result<Vec<u8>, CudaError> {
        self.check_stream(stream)?;
        self.check_buffer("source buffer", src)?;
        let bytes = stream
            .clone_dtoh(src)
            .map_err(CudaError::driver("copying from the device"))?;
        stream
            .synchronize()
            .map_err(CudaError::driver("waiting for the copy from the device"))?;
        Ok(bytes)
    }

    /// `dst[i] = dst[i] op src[i]` for every element, on device bytes of `dtype`, enqueued
    /// on `stream` (the GPU form of [`reduce`](crate::reduce)).
    ///
    /// `Avg` runs as `Sum`; divide once at the end with [`Device::finish_avg`]. Fails with
    /// [`KernelError::UnsupportedOp`] (a bitwise operator on a float type),
    /// [`KernelError::LengthMismatch`] or [`KernelError::Misaligned`] (inside
    /// [`CudaError::Kernel`]) like the host kernel, and with [`CudaError::WrongDevice`] if a
    /// buffer or the stream belongs to another device.
    pub fn reduce<D, S>(
        &self,
        op: ReduceOp,
        dtype: DType,
        dst: &mut D,
        src: &S,
        stream: &CudaStream,
    ) -> Result<(), CudaError>
    where
        D: DevicePtrMut<u8>,
        S: DevicePtr<u8>,
    {
        op.check(dtype)?;
        check_lengths(dtype, dst.len(), &[src.len()])?;
        self.check_stream(stream)?;
        self.check_buffer("destination buffer", dst)?;
        self.check_buffer("source buffer", src)?;
        let bytes = dst.len();
        {
            let (out, _write) = dst.device_ptr_mut(stream);
            let (b, _read) = src.device_ptr(stream);
            self.enqueue_reduce(op, dtype, [out, out, b], bytes, stream)?;
        }
        self.check_async()
    }

    /// `out[i] = a[i] op b[i]` for every element (the out-of-place form of
    /// [`Device::reduce`], and the GPU form of [`reduce_into`](crate::reduce_into)).
    pub fn reduce_into<O, A, B>(
        &self,
        op: ReduceOp,
        dtype: DType,
        out: &mut O,
        a: &A,
        b: &B,
        stream: &CudaStream,
    ) -> Result<(), CudaError>
    where
        O: DevicePtrMut<u8>,
        A: DevicePtr<u8>,
        B: DevicePtr<u8>,
    {
        op.check(dtype)?;
        check_lengths(dtype, out.len(), &[a.len(), b.len()])?;
        self.check_stream(stream)?;
        self.check_buffer("output buffer", out)?;
        self.check_buffer("first source buffer", a)?;
        self.check_buffer("second source buffer", b)?;
        let bytes = out.len();
        {
            let (po, _write) = out.device_ptr_mut(stream);
            let (pa, _read_a) = a.device_ptr(stream);
            let (pb, _read_b) = b.device_ptr(stream);
            self.enqueue_reduce(op, dtype, [po, pa, pb], bytes, stream)?;
        }
        self.check_async()
    }

    /// [`Device::reduce_into`] on raw device pointers `[out, a, b]`: `out = a op b` over
    /// `bytes` bytes, enqueued on `stream`. `out` may equal `a` (in place).
    ///
    /// Fails as [`Device::reduce_into`] does on the operator, the length or the stream.
    ///
    /// # Safety
    /// Each pointer must address `bytes` bytes of device memory usable in this device's
    /// context (its own allocations, or peers' memory mapped into it) that stay allocated
    /// until the kernel has run; nothing else may write them meanwhile, and `out` may
    /// overlap `a` or `b` only by being equal to it.
    pub unsafe fn reduce_into_raw(
        &self,
        op: ReduceOp,
        dtype: DType,
        ptrs: [u64; 3],
        bytes: usize,
        stream: &CudaStream,
    ) -> Result<(), CudaError> {
        op.check(dtype)?;
        check_lengths(dtype, bytes, &[])?;
        self.check_stream(stream)?;
        self.enqueue_reduce(op, dtype, ptrs, bytes, stream)
    }

    /// [`Device::finish_avg`] on a raw device pointer to `bytes` bytes.
    ///
    /// # Safety
    /// `buf` must address `bytes` bytes of device memory usable in this device's context
    /// that stay allocated until the kernel has run, and nothing else may touch them meanwhile.
    pub unsafe fn finish_avg_raw(
        &self,
        dtype: DType,
        buf: u64,
        bytes: usize,
        n: usize,
        stream: &CudaStream,
    ) -> Result<(), CudaError> {
        if n == 0 {
            return Err(KernelError::ZeroCount.into());
        }
        check_lengths(dtype, bytes, &[])?;
        self.check_stream(stream)?;
        self.enqueue_avg(dtype, buf, bytes, n, stream)
    }

    /// Enqueues the `op` kernel on `ptrs` (`out, a, b`) over `bytes` bytes (checked by the caller).
    fn enqueue_reduce(
        &self,
        op: ReduceOp,
        dtype: DType,
        ptrs: [u64; 3],
        bytes: usize,
        stream: &CudaStream,
    ) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        let kernels = self.kernels()?;
        let func = kernels.reduce_fn(op, dtype)?;
        self.launch(stream, func, dtype, bytes / dtype.size(), ptrs, None)
    }

    /// Enqueues the average kernel on `buf` (`bytes` bytes, checked by the caller).
    fn enqueue_avg(
        &self,
        dtype: DType,
        buf: u64,
        bytes: usize,
        n: usize,
        stream: &CudaStream,
    ) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        let kernels = self.kernels()?;
        let func = &kernels.avg[dtype_index(dtype)];
        let len = bytes / dtype.size();
        self.launch(stream, func, dtype, len, [buf, buf, buf], Some(n as u64))
    }

    /// Divides every element by `n`, the finishing step of [`ReduceOp::Avg`] (the GPU form
    /// of [`finish_avg`](crate::finish_avg)): floats divide (`f16`/`bf16` via `f32`),
    /// integers truncate toward zero. Fails with [`KernelError::ZeroCount`] if `n == 0`.
    pub fn finish_avg<D: DevicePtrMut<u8>>(
        &self,
        dtype: DType,
        buf: &mut D,
        n: usize,
        stream: &CudaStream,
    ) -> Result<(), CudaError> {
        if n == 0 {
            return Err(KernelError::ZeroCount.into());
        }
        check_lengths(dtype, buf.len(), &[])?;
        self.check_stream(stream)?;
        self.check_buffer("buffer", buf)?;
        let bytes = buf.len();
        {
            let (p, _write) = buf.device_ptr_mut(stream);
            self.enqueue_avg(dtype, p, bytes, n, stream)?;
        }
        self.check_async()
    }

    /// Launches a reduce kernel (`n == None`: arguments `out, a, b, len`) or an average
    /// kernel (arguments `buf, len, n`, with `ptrs` all equal).
    fn launch(
        &self,
        stream: &CudaStream,
        func: &CudaFunction,
        dtype: DType,
        len: usize,
        ptrs: [u64; 3],
        n: Option<u64>,
    ) -> Result<(), CudaError> {
        let blocks = grid_blocks(len, dtype.size(), ptrs, self.shared.max_blocks);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (BLOCK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let len = len as u64;
        let mut args = stream.launch_builder(func);
        match &n {
            None => args.arg(&ptrs[0]).arg(&ptrs[1]).arg(&ptrs[2]).arg(&len),
            Some(n) => args.arg(&ptrs[0]).arg(&len).arg(n),
        };
        // SAFETY: the arguments match the kernel's signature (see `source::reduce_kernel`
        // and `source::avg_kernel`): device pointers and 64-bit counts. Each pointer is the
        // start of a buffer of at least `len * dtype.size()` bytes (checked by the caller)
        // in this device's context, as is the stream; the kernel touches only those bytes.
        // The safe callers hold the buffers' borrows and sync guards until after this returns,
        // so the buffers outlive the enqueued work (cudarc's event tracking orders the frees);
        // the raw callers' contracts demand the same.
        unsafe { args.launch(cfg) }.map_err(CudaError::driver("launching a kernel"))?;
        Ok(())
    }

    /// The loaded kernels, compiling or reading them from the disk cache on first use; a
    /// failure is kept, so later calls fail at once rather than compile again.
    fn kernels(&self) -> Result<Arc<Kernels>, CudaError> {
        let mut slot = lock(&self.shared.kernels);
        slot.get_or_insert_with(|| {
            load::guarded("loading the CUDA kernels", || self.build_kernels()).map(Arc::new)
        })
        .clone()
    }

    fn build_kernels(&self) -> Result<Kernels, CudaError> {
        let ctx = &self.shared.ctx;
        let target = compile::target_for(
            self.shared.capability,
            &compile::supported_archs()?,
            compile::nvrtc_version()?,
        )?;
        let dir = cache::dir();
        let (image, origin) = compile::image(target, dir.as_deref(), false)?;
        let module = match ctx.load_module(Ptx::from_binary(image)) {
            Ok(module) => module,
            Err(err) if origin == Origin::Disk => {
                tracing::warn!(%err, "cached CUDA kernels did not load; recompiling");
                let (image, _) = compile::image(target, dir.as_deref(), true)?;
                ctx.load_module(Ptx::from_binary(image))
                    .map_err(CudaError::driver("loading the kernels"))?
            }
            Err(err) => return Err(CudaError::driver("loading the kernels")(err)),
        };
        let function = |name: String| {
            module
                .load_function(&name)
                .map_err(CudaError::driver("finding a kernel in the module"))
        };
        let mut reduce = Vec::with_capacity(DType::ALL.len() * KERNEL_OPS.len());
        let mut avg = Vec::with_capacity(DType::ALL.len());
        for dtype in DType::ALL {
            for op in KERNEL_OPS {
                let kernel = op.applies_to(dtype);
                reduce.push(
                    kernel
                        .then(|| function(source::reduce_kernel(op, dtype)))
                        .transpose()?,
                );
            }
            avg.push(function(source::avg_kernel(dtype))?);
        }
        Ok(Kernels { reduce, avg })
    }

    fn check_stream(&self, stream: &CudaStream) -> Result<(), CudaError> {
        if **stream.context() != *self.shared.ctx {
            return Err(CudaError::WrongDevice {
                what: "stream",
                ordinal: self.ordinal(),
            });
        }
        Ok(())
    }

    fn check_buffer<T: DeviceSlice<u8>>(
        &self,
        what: &'static str,
        buf: &T,
    ) -> Result<(), CudaError> {
        if **buf.stream().context() != *self.shared.ctx {
            return Err(CudaError::WrongDevice {
                what,
                ordinal: self.ordinal(),
            });
        }
        Ok(())
    }

    /// Reports an error cudarc recorded while tracking the buffers' events.
    fn check_async(&self) -> Result<(), CudaError> {
        self.shared
            .ctx
            .check_err()
            .map_err(CudaError::driver("ordering the buffers' accesses"))
    }
}

/// Devices the driver reports, 0 for "no device".
fn count_devices() -> Result<usize, CudaError> {
    match CudaContext::device_count() {
        Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
        Err(DriverError(CUresult::CUDA_ERROR_NO_DEVICE)) => Ok(0),
        Err(err) => Err(CudaError::driver("initialising the CUDA driver")(err)),
    }
}

fn dtype_index(dtype: DType) -> usize {
    DType::ALL.iter().position(|&d| d == dtype).unwrap_or(0)
}

fn reduce_index(op: ReduceOp, dtype: DType) -> usize {
    let op = source::kernel_op(op);
    let op_index = KERNEL_OPS.iter().position(|&o| o == op).unwrap_or(0);
    dtype_index(dtype) * KERNEL_OPS.len() + op_index
}

/// Blocks to launch for `len` elements of `size` bytes at `ptrs` (out, a, b): one thread per
/// 16-byte vector when the kernel can vectorise, else one per element, at most one full
/// device (`max_blocks`; the kernels loop over the rest), at least one.
pub(crate) fn grid_blocks(len: usize, size: usize, ptrs: [u64; 3], max_blocks: u32) -> u32 {
    let [o, a, b] = ptrs;
    let size = size as u64;
    let vectorised = (o | a | b) % size == 0 && (o ^ a) % 16 == 0 && (o ^ b) % 16 == 0;
    let units = if vectorised {
        (len as u64 * size).div_ceil(16)
    } else {
        len as u64
    };
    let blocks = units.div_ceil(u64::from(BLOCK_THREADS));
    blocks.clamp(1, u64::from(max_blocks.max(1))) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_covers_the_work_up_to_one_device() {
        let aligned = [0x1000, 0x2000, 0x3000];
        // 1 Mi f32 = 4 MiB = 256 Ki vectors = 1024 blocks of 256.
        assert_eq!(grid_blocks(1 << 20, 4, aligned, 100_000), 1024);
        assert_eq!(grid_blocks(1 << 20, 4, aligned, 528), 528);
        assert_eq!(grid_blocks(1, 8, aligned, 528), 1);
        // Not co-aligned: one thread per element.
        assert_eq!(
            grid_blocks(1 << 20, 4, [0x1004, 0x2000, 0x3000], 100_000),
            4096
        );
        // Not element-aligned.
        assert_eq!(grid_blocks(1000, 2, [0x1001, 0x2001, 0x3001], 100_000), 4);
        assert_eq!(grid_blocks(0, 4, aligned, 0), 1);
    }

    #[test]
    fn kernel_indices_are_distinct_and_avg_is_sum() {
        let mut seen = std::collections::HashSet::new();
        for dtype in DType::ALL {
            for op in KERNEL_OPS {
                assert!(seen.insert(reduce_index(op, dtype)));
            }
            assert_eq!(
                reduce_index(ReduceOp::Avg, dtype),
                reduce_index(ReduceOp::Sum, dtype)
            );
        }
        assert_eq!(seen.len(), 70);
        assert!(seen.iter().all(|&i| i < 70));
    }
}
