//! Bandwidth of the GPU sum kernels against a device-to-device copy of the same bytes.
//!
//! ```text
//! cargo run -p chorus-kernels --features cuda --example cuda_bench [-- MIB]
//! ```
//!
//! For f32 and bf16 buffers of MIB mebibytes (default 256) on device 0, times with CUDA
//! events, after warm-up runs, the median of several runs of:
//! * `copy`: `cuMemcpyDtoDAsync` of the buffer (reads and writes it once: 2 x MIB moved);
//! * `reduce sum`: `dst += src` in place (reads dst and src, writes dst: 3 x MIB);
//! * `reduce_into sum`: `out = a + b` (3 x MIB),
//!
//! and prints GB/s (bytes read + written, 1 GB = 1e9 bytes). The kernels' fraction of the
//! copy's bandwidth is the figure of merit: both are bound by memory bandwidth. Exits with
//! "skipping: no CUDA driver/GPU found" (status 0) where there is no usable GPU, and fails
//! there instead with `CHORUS_REQUIRE_CUDA=1`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use chorus_kernels::cuda::cudarc::driver::sys::CUevent_flags;
use chorus_kernels::cuda::{CudaError, CudaSlice, CudaStream, Device};
use chorus_kernels::env::CHORUS_REQUIRE_CUDA;
use chorus_kernels::{bf16, DType, ReduceOp};

const WARMUP: usize = 5;
const RUNS: usize = 30;

fn main() -> ExitCode {
    let mib: usize = match std::env::args().nth(1).map(|a| a.parse()) {
        None => 256,
        Some(Ok(mib)) if mib > 0 => mib,
        Some(_) => {
            eprintln!("usage: cuda_bench [MIB]  (buffer size in MiB, default 256)");
            return ExitCode::FAILURE;
        }
    };
    match run(mib << 20) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err @ (CudaError::NoCuda(_) | CudaError::NoDevice { .. })) => {
            if std::env::var(CHORUS_REQUIRE_CUDA).as_deref() == Ok("1") {
                eprintln!("cuda_bench: {CHORUS_REQUIRE_CUDA}=1 but {err}");
                return ExitCode::FAILURE;
            }
            eprintln!("skipping: no CUDA driver/GPU found ({err})");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("cuda_bench: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run(bytes: usize) -> Result<(), CudaError> {
    let device = &Device::open(0)?;
    let start = Instant::now();
    device.load_kernels()?;
    let ready = start.elapsed().as_secs_f64();
    let (major, minor) = device.compute_capability();
    println!(
        "device 0: {} (sm_{major}{minor}); buffers of {} MiB; median of {RUNS} runs after \
         {WARMUP} warm-up runs",
        device.name()?,
        bytes >> 20
    );
    println!("kernels ready in {ready:.3} s (NVRTC on a cold cache, a file read on a warm one)");
    let stream = device.new_stream()?;
    println!(
        "{:<6} {:<16} {:>10} {:>9} {:>8}",
        "dtype", "operation", "median ms", "GB/s", "of copy"
    );
    for dtype in [DType::F32, DType::BF16] {
        let a = device.upload(&stream, &pattern(dtype, bytes, 1))?;
        let b = device.upload(&stream, &pattern(dtype, bytes, 2))?;
        let mut out = device.upload(&stream, &pattern(dtype, bytes, 3))?;

        let copy = time(device, &stream, || {
            stream
                .memcpy_dtod(&a, &mut out)
                .map_err(|source| CudaError::Driver {
                    during: "copying",
                    source,
                })
        })?;
        let copy = Rate::new(bytes * 2, copy);
        report(dtype, "copy (D2D)", copy, copy);

        let mut dst = device.upload(&stream, &pattern(dtype, bytes, 4))?;
        let ms = time(device, &stream, || {
            device.reduce(ReduceOp::Sum, dtype, &mut dst, &b, &stream)
        })?;
        report(dtype, "reduce sum", Rate::new(bytes * 3, ms), copy);

        let ms = time(device, &stream, || {
            device.reduce_into(ReduceOp::Sum, dtype, &mut out, &a, &b, &stream)
        })?;
        report(dtype, "reduce_into sum", Rate::new(bytes * 3, ms), copy);
        drop::<[CudaSlice<u8>; 4]>([a, b, out, dst]);
    }
    Ok(())
}

/// Median milliseconds of `op` on `stream`, each run between two events.
fn time(
    device: &Device,
    stream: &Arc<CudaStream>,
    mut op: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    let driver = |during| move |source| CudaError::Driver { during, source };
    let ctx = device.context();
    let start = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(driver("creating an event"))?;
    let end = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(driver("creating an event"))?;
    for _ in 0..WARMUP {
        op()?;
    }
    stream.synchronize().map_err(driver("synchronising"))?;
    let mut ms = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        start.record(stream).map_err(driver("recording an event"))?;
        op()?;
        end.record(stream).map_err(driver("recording an event"))?;
        ms.push(f64::from(start.elapsed_ms(&end).map_err(driver("timing"))?));
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[RUNS / 2])
}

/// A timed operation: median milliseconds and the resulting GB/s.
#[derive(Clone, Copy)]
struct Rate {
    ms: f64,
    gbps: f64,
}

impl Rate {
    /// `moved` bytes (read + written) in `ms` milliseconds.
    fn new(moved: usize, ms: f64) -> Rate {
        Rate {
            ms,
            gbps: moved as f64 / (ms * 1e-3) / 1e9,
        }
    }
}

/// Prints one row, with the operation's bandwidth as a fraction of the copy's.
fn report(dtype: DType, what: &str, rate: Rate, copy: Rate) {
    println!(
        "{:<6} {what:<16} {:>10.3} {:>9.1} {:>7.0}%",
        dtype.name(),
        rate.ms,
        rate.gbps,
        rate.gbps / copy.gbps * 100.0
    );
}

/// `bytes` of small finite values of `dtype` (a repeated pseudo-random block).
fn pattern(dtype: DType, bytes: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9) | 1;
    let mut block = Vec::with_capacity(1 << 16);
    while block.len() < 1 << 16 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let v = (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
        match dtype {
            DType::BF16 => block.extend(bf16::from_f32(v).to_le_bytes()),
            _ => block.extend(v.to_le_bytes()),
        }
    }
    block.iter().copied().cycle().take(bytes).collect()
}
