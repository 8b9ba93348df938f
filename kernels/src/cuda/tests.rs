//! Tests of the CUDA kernels.
//!
//! * CPU only, run everywhere: the generated source and the choice of NVRTC target.
//! * NVRTC, no GPU needed: compiling the source and the disk cache; they print
//!   "skipping: no NVRTC library found" where NVRTC cannot be loaded.
//! * GPU: every dtype x op against the host kernels; they print
//!   "skipping: no CUDA driver/GPU found" where there is no usable GPU.
//!
//! Skip lines go to the process's stderr directly, which the test harness does not
//! capture, so they show in a plain `cargo test`. With `CHORUS_REQUIRE_CUDA=1` a test
//! fails instead of skipping (for GPU machines, where a skip would hide a problem).

use std::io::Write as _;
use std::sync::Arc;

use super::compile::{self, Origin, Target};
use super::source;
use super::*;
use crate::test_rng::Rng;
use crate::{bf16, f16, DType, KernelError, ReduceOp};

// ---------------------------------------------------------------- skipping

/// Reports a skipped test, or fails it when `CHORUS_REQUIRE_CUDA=1`.
fn skip(test: &str, what: &str, err: &CudaError) {
    if std::env::var(crate::env::CHORUS_REQUIRE_CUDA).as_deref() == Ok("1") {
        panic!("{test}: CHORUS_REQUIRE_CUDA=1 but {err}");
    }
    // Straight to the file descriptor, in one write: `eprintln!` output of a passing test
    // is captured by the harness.
    let line = format!("skipping: {what} ({test}: {err})\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Device 0 with its kernels loaded, or `None` (after the skip message) without CUDA.
/// Any other failure fails the test.
fn gpu(test: &str) -> Option<Device> {
    let no_gpu = "no CUDA driver/GPU found";
    let device = match Device::open(0) {
        Ok(device) => device,
        Err(err @ (CudaError::NoCuda(_) | CudaError::NoDevice { .. })) => {
            skip(test, no_gpu, &err);
            return None;
        }
        Err(err) => panic!("{test}: opening CUDA device 0 failed: {err}"),
    };
    match device.load_kernels() {
        Ok(()) => Some(device),
        Err(err @ CudaError::NoCuda(_)) => {
            skip(test, no_gpu, &err);
            None
        }
        Err(err) => panic!("{test}: loading the kernels failed: {err}"),
    }
}

/// Whether NVRTC can be loaded (no GPU needed); prints the skip message if not.
fn nvrtc(test: &str) -> bool {
    match compile::nvrtc_version() {
        Ok(_) => true,
        Err(err @ CudaError::NoCuda(_)) => {
            skip(test, "no NVRTC library found", &err);
            false
        }
        Err(err) => panic!("{test}: querying NVRTC failed: {err}"),
    }
}

// ---------------------------------------------------------------- CPU only

#[test]
fn source_defines_every_kernel_exactly_once() {
    let src = source::source();
    let define = |name: &str| format!("__launch_bounds__({}) {name}(", source::BLOCK_THREADS);
    let mut names = std::collections::HashSet::new();
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            let name = source::reduce_kernel(op, dtype);
            let want = usize::from(op.applies_to(dtype));
            assert_eq!(src.matches(&define(&name)).count(), want, "{name}");
            if want == 1 {
                names.insert(name);
            }
        }
        let avg = source::avg_kernel(dtype);
        assert_eq!(src.matches(&define(&avg)).count(), 1, "{avg}");
        names.insert(avg);
        assert_eq!(
            source::reduce_kernel(ReduceOp::Avg, dtype),
            source::reduce_kernel(ReduceOp::Sum, dtype)
        );
    }
    // 10 dtypes x (4 arithmetic operators + finish_avg) + 6 integer types x 3 bitwise
    // operators, all distinct, and nothing else.
    assert_eq!(names.len(), 68);
    assert_eq!(src.matches("__global__").count(), 68);
    assert!(names.contains("chorus_reduce_bf16_max"));
    assert!(names.contains("chorus_finish_avg_u64"));
    assert!(names.contains("chorus_reduce_i8_band"));
    assert!(names.contains("chorus_reduce_u64_bxor"));
    assert!(!src.contains("chorus_reduce_f32_bor"));
    assert!(src
        .contains("chorus::run<chorus::Plain<long long>, false>(out, a, b, len, chorus::BOr());"));
}

#[test]
fn source_is_self_contained() {
    let src = source::source();
    assert!(!src.contains("#include"), "NVRTC gets no include path");
    assert!(!src.contains("@BLOCK@"));
    assert!(src.contains("struct alignas(16) Vec16"));
    assert!(src.contains("cvt.rn.f16.f32"));
    assert!(!src.contains('\0'));
}

#[test]
fn target_is_the_device_arch_when_nvrtc_knows_it() {
    let archs = [75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121];
    let nvrtc = (13, 0);
    assert_eq!(
        compile::target_for((9, 0), &archs, nvrtc),
        Ok(Target::Cubin(90))
    );
    assert_eq!(
        compile::target_for((8, 0), &archs, nvrtc),
        Ok(Target::Cubin(80))
    );
    // Newer than NVRTC: PTX for the newest architecture it knows, JIT-compiled by the driver.
    assert_eq!(
        compile::target_for((13, 0), &archs, nvrtc),
        Ok(Target::Ptx(121))
    );
    // Unknown in-between variant: PTX for the closest older one.
    assert_eq!(
        compile::target_for((8, 8), &[80, 86, 89], nvrtc),
        Ok(Target::Ptx(86))
    );
    // Older than anything NVRTC supports (CUDA 13 dropped Volta and older).
    let err = compile::target_for((7, 0), &archs, nvrtc).unwrap_err();
    assert!(matches!(
        err,
        CudaError::UnsupportedArch {
            major: 7,
            minor: 0,
            ..
        }
    ));
    assert!(err.to_string().contains("sm_75, sm_80"), "{err}");

    assert_eq!(Target::Cubin(90).to_string(), "sm_90");
    assert_eq!(Target::Ptx(120).to_string(), "compute_120");
    let opts = compile::options(Target::Cubin(90));
    assert!(
        opts.contains(&"--gpu-architecture=sm_90".to_owned()),
        "{opts:?}"
    );
    assert!(opts.contains(&"--ftz=false".to_owned()), "{opts:?}");
}

#[test]
fn device_and_error_can_cross_threads() {
    fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<Device>();
    send_sync::<CudaError>();
}

// ---------------------------------------------------------------- NVRTC, no GPU

/// The newest real architecture NVRTC supports, preferring sm_90 (H100) when listed.
fn some_arch() -> i32 {
    let archs = compile::supported_archs().expect("NVRTC lists its architectures");
    if archs.contains(&90) {
        90
    } else {
        *archs
            .iter()
            .max()
            .expect("NVRTC supports some architecture")
    }
}

#[test]
fn nvrtc_compiles_vectorised_ptx_with_every_entry_point() {
    if !nvrtc("nvrtc_compiles_vectorised_ptx_with_every_entry_point") {
        return;
    }
    let target = Target::Ptx(some_arch());
    let image = compile::compile(source::source(), target, &compile::options(target))
        .unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(
        image.last(),
        Some(&0),
        "PTX must be NUL-terminated for the driver"
    );
    let ptx = String::from_utf8_lossy(&image[..image.len() - 1]);
    for dtype in DType::ALL {
        for op in source::KERNEL_OPS
            .into_iter()
            .filter(|op| op.applies_to(dtype))
        {
            let entry = format!(".entry {}(", source::reduce_kernel(op, dtype));
            assert!(ptx.contains(&entry), "missing {entry}");
        }
        let entry = format!(".entry {}(", source::avg_kernel(dtype));
        assert!(ptx.contains(&entry), "missing {entry}");
    }
    // Every kernel has a 16-byte load and store path (the head and tail are scalar).
    let wide = |body: &str, access: &str| {
        [
            "v4.u32", "v4.b32", "v4.s32", "v4.f32", "v2.u64", "v2.b64", "v2.s64", "v2.f64",
        ]
        .iter()
        .any(|shape| body.contains(&format!("{access}.global.{shape}")))
    };
    let bodies: Vec<&str> = ptx.split(".entry ").skip(1).collect();
    assert_eq!(bodies.len(), 68);
    for body in bodies {
        let name = body.split('(').next().unwrap_or_default();
        assert!(
            wide(body, "ld") && wide(body, "st"),
            "{name}: no 16-byte loads and stores"
        );
    }
    // Half conversions are the hardware ones; floats keep subnormals.
    assert!(ptx.contains("cvt.rn.f16.f32") && ptx.contains("cvt.f32.f16"));
    assert!(
        !ptx.contains(".ftz"),
        "flush-to-zero instructions in the PTX"
    );
}

#[test]
fn nvrtc_image_is_cached_on_disk() {
    if !nvrtc("nvrtc_image_is_cached_on_disk") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("chorus-cuda-cache-{}", std::process::id()));
    let target = Target::Cubin(some_arch());

    let (first, origin) = compile::image(target, Some(&dir), false).unwrap();
    assert_eq!(origin, Origin::Compiled);
    assert_eq!(&first[..4], b"\x7fELF", "a CUBIN is an ELF file");
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(files.len(), 1, "one cache file, no temporary left behind");
    let name = files[0].file_name().into_string().unwrap();
    assert!(name.starts_with(&format!("kernels-{target}-")), "{name}");

    // A second start reads the file instead of compiling.
    let (second, origin) = compile::image(target, Some(&dir), false).unwrap();
    assert_eq!(origin, Origin::Disk);
    assert_eq!(first, second);

    // A damaged file is ignored, recompiled and rewritten.
    let path = files[0].path();
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(&path, &bytes).unwrap();
    let (third, origin) = compile::image(target, Some(&dir), false).unwrap();
    assert_eq!(origin, Origin::Compiled);
    assert_eq!(third.len(), first.len());
    assert_eq!(
        compile::image(target, Some(&dir), false).unwrap().1,
        Origin::Disk
    );

    // Without a cache folder every call compiles.
    assert_eq!(
        compile::image(target, None, false).unwrap().1,
        Origin::Compiled
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- GPU

impl Rng {
    /// Uniform in [-range, range).
    fn uniform(&mut self, range: f64) -> f64 {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * range
    }
}

/// `len` random elements of `dtype` as bytes. About 1 in 16 is a special value: NaN,
/// infinities, signed zeros, one, a subnormal (floats); extremes and one (integers).
fn random(dtype: DType, len: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::with_capacity(len * dtype.size());
    for _ in 0..len {
        let r = rng.next();
        let special = r % 16 == 0;
        let pick = (r >> 8) as usize;
        let float = |rng: &mut Rng, range: f64, tiny: f64| {
            const SPECIAL: [f64; 6] = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, 1.0];
            if special {
                if pick % 7 == 6 {
                    tiny
                } else {
                    SPECIAL[pick % 6]
                }
            } else {
                rng.uniform(range)
            }
        };
        match dtype {
            DType::F32 => out.extend((float(rng, 1000.0, 1e-40) as f32).to_le_bytes()),
            DType::F64 => out.extend(float(rng, 1000.0, 1e-310).to_le_bytes()),
            DType::F16 => out.extend(f16::from_f64(float(rng, 200.0, 1e-6)).to_le_bytes()),
            DType::BF16 => out.extend(bf16::from_f64(float(rng, 1000.0, 1e-40)).to_le_bytes()),
            _ => {
                let bits = 8 * dtype.size() as u32;
                let value = if special {
                    let top = 1u64 << (bits - 1);
                    [u64::MAX, top, top - 1, 1][pick % 4]
                } else {
                    rng.next()
                };
                out.extend(&value.to_le_bytes()[..dtype.size()]);
            }
        }
    }
    out
}

/// Whether the element bits `x` is a NaN of `dtype`.
fn is_nan(dtype: DType, x: &[u8]) -> bool {
    match dtype {
        DType::F32 => f32::from_le_bytes(x.try_into().unwrap()).is_nan(),
        DType::F64 => f64::from_le_bytes(x.try_into().unwrap()).is_nan(),
        DType::F16 => f16::from_le_bytes(x.try_into().unwrap()).is_nan(),
        DType::BF16 => bf16::from_le_bytes(x.try_into().unwrap()).is_nan(),
        _ => false,
    }
}

/// Bytes that mark memory a kernel must not write, or must overwrite.
const POISON: u8 = 0xA5;
/// Poisoned bytes after each buffer, to catch writes past the end.
const GUARD: usize = 64;

/// `bytes` at offset `off` in a poisoned allocation.
fn padded(bytes: &[u8], off: usize) -> Vec<u8> {
    let mut v = vec![POISON; off + bytes.len() + GUARD];
    v[off..off + bytes.len()].copy_from_slice(bytes);
    v
}

/// Checks that the device allocation `got` holds `want` at `off` and poison elsewhere.
fn check(dtype: DType, got: &[u8], off: usize, want: &[u8], what: &dyn Fn() -> String) {
    let end = off + want.len();
    assert_eq!(got.len(), end + GUARD, "{}", what());
    if let Some(i) = got[..off]
        .iter()
        .chain(&got[end..])
        .position(|&b| b != POISON)
    {
        panic!(
            "{}: wrote outside the buffer (byte {i} of the padding)",
            what()
        );
    }
    let size = dtype.size();
    for (i, (g, w)) in got[off..end]
        .chunks_exact(size)
        .zip(want.chunks_exact(size))
        .enumerate()
    {
        if g != w && !(is_nan(dtype, g) && is_nan(dtype, w)) {
            panic!("{}: element {i}: got {g:02x?}, want {w:02x?}", what());
        }
    }
}

/// Element counts: odd tails around the 16-byte vector width of every element size.
const LENS: [usize; 13] = [1, 2, 3, 5, 8, 15, 16, 17, 31, 33, 100, 257, 4099];
/// More elements than one grid covers, so every thread loops.
const BIG: usize = 3_000_017;

/// Byte offsets (out/dst, a, b/src) into the allocations, which are 256-byte aligned:
/// all 16-byte aligned; co-aligned but not 16-byte aligned (scalar head); element aligned
/// but not co-aligned (scalar path); not element-aligned (byte path, for multi-byte types).
fn offsets(size: usize) -> [[usize; 3]; 6] {
    let s = size;
    [
        [0, 0, 0],
        [s, s, s],
        [3 * s, 3 * s, 3 * s],
        [0, s, 2 * s],
        [1, 3, 2],
        [5, 5, 5],
    ]
}

fn cases(size: usize, op: ReduceOp) -> Vec<(usize, [usize; 3])> {
    let mut cases: Vec<_> = LENS
        .iter()
        .flat_map(|&len| offsets(size).map(|offs| (len, offs)))
        .collect();
    if matches!(op, ReduceOp::Sum | ReduceOp::Max | ReduceOp::BXor) {
        cases.push((BIG, [0, 0, 0]));
        cases.push((BIG, [size, size, size]));
    }
    cases
}

#[test]
fn reduce_into_matches_host_for_every_dtype_and_op() {
    let Some(device) = gpu("reduce_into_matches_host_for_every_dtype_and_op") else {
        return;
    };
    let stream = device.new_stream().unwrap();
    let mut rng = Rng(1);
    for dtype in DType::ALL {
        let size = dtype.size();
        for op in ReduceOp::ALL.into_iter().filter(|op| op.applies_to(dtype)) {
            for (len, [oo, oa, ob]) in cases(size, op) {
                let n = len * size;
                let (a, b) = (random(dtype, len, &mut rng), random(dtype, len, &mut rng));
                let mut want = vec![0u8; n];
                crate::reduce_into(op, dtype, &mut want, &a, &b).unwrap();

                let mut d_out = device
                    .upload(&stream, &vec![POISON; oo + n + GUARD])
                    .unwrap();
                let d_a = device.upload(&stream, &padded(&a, oa)).unwrap();
                let d_b = device.upload(&stream, &padded(&b, ob)).unwrap();
                let what = || format!("reduce_into {dtype} {op} len {len} offsets {oo}/{oa}/{ob}");
                let mut out = d_out.slice_mut(oo..oo + n);
                device
                    .reduce_into(
                        op,
                        dtype,
                        &mut out,
                        &d_a.slice(oa..oa + n),
                        &d_b.slice(ob..ob + n),
                        &stream,
                    )
                    .unwrap_or_else(|err| panic!("{}: {err}", what()));
                check(
                    dtype,
                    &device.download(&stream, &d_out).unwrap(),
                    oo,
                    &want,
                    &what,
                );
            }
        }
    }
}

#[test]
fn reduce_in_place_matches_host_for_every_dtype_and_op() {
    let Some(device) = gpu("reduce_in_place_matches_host_for_every_dtype_and_op") else {
        return;
    };
    let stream = device.new_stream().unwrap();
    let mut rng = Rng(2);
    for dtype in DType::ALL {
        let size = dtype.size();
        for op in ReduceOp::ALL.into_iter().filter(|op| op.applies_to(dtype)) {
            for (len, [od, _, os]) in cases(size, op) {
                let n = len * size;
                let (dst, src) = (random(dtype, len, &mut rng), random(dtype, len, &mut rng));
                let mut want = dst.clone();
                crate::reduce(op, dtype, &mut want, &src).unwrap();

                let mut d_dst = device.upload(&stream, &padded(&dst, od)).unwrap();
                let d_src = device.upload(&stream, &padded(&src, os)).unwrap();
                let what = || format!("reduce {dtype} {op} len {len} offsets {od}/{os}");
                let mut view = d_dst.slice_mut(od..od + n);
                device
                    .reduce(op, dtype, &mut view, &d_src.slice(os..os + n), &stream)
                    .unwrap_or_else(|err| panic!("{}: {err}", what()));
                check(
                    dtype,
                    &device.download(&stream, &d_dst).unwrap(),
                    od,
                    &want,
                    &what,
                );
            }
        }
    }
}

#[test]
fn finish_avg_matches_host_for_every_dtype() {
    let Some(device) = gpu("finish_avg_matches_host_for_every_dtype") else {
        return;
    };
    let stream = device.new_stream().unwrap();
    let mut rng = Rng(3);
    // Counts around the ranges of the integer types, and beyond all of them.
    let counts = [
        1,
        2,
        3,
        7,
        127,
        128,
        255,
        256,
        1000,
        1 << 31,
        (1 << 32) + 5,
        usize::MAX,
    ];
    for dtype in DType::ALL {
        let size = dtype.size();
        let mut cases: Vec<(usize, usize, usize)> = Vec::new();
        for len in [1, 3, 17, 33, 257, 4099] {
            for off in [0, size, 3 * size, 1] {
                cases.extend(counts.map(|n| (len, off, n)));
            }
        }
        cases.push((BIG, 0, 3));
        for (len, off, count) in cases {
            let bytes = random(dtype, len, &mut rng);
            let mut want = bytes.clone();
            crate::finish_avg(dtype, &mut want, count).unwrap();

            let mut d_buf = device.upload(&stream, &padded(&bytes, off)).unwrap();
            let what = || format!("finish_avg {dtype} len {len} offset {off} n {count}");
            let mut view = d_buf.slice_mut(off..off + bytes.len());
            device
                .finish_avg(dtype, &mut view, count, &stream)
                .unwrap_or_else(|err| panic!("{}: {err}", what()));
            check(
                dtype,
                &device.download(&stream, &d_buf).unwrap(),
                off,
                &want,
                &what,
            );
        }
    }
}

#[test]
fn bad_arguments_are_rejected_like_the_host_kernels() {
    let Some(device) = gpu("bad_arguments_are_rejected_like_the_host_kernels") else {
        return;
    };
    let stream = device.new_stream().unwrap();
    let mut a = device.upload(&stream, &[1u8; 8]).unwrap();
    let b = device.upload(&stream, &[2u8; 12]).unwrap();
    let c = device.upload(&stream, &[3u8; 6]).unwrap();
    let a2 = a.clone();
    let mismatch = CudaError::Kernel(KernelError::LengthMismatch { dst: 8, src: 12 });
    assert_eq!(
        device.reduce(ReduceOp::Sum, DType::F32, &mut a, &b, &stream),
        Err(mismatch.clone())
    );
    assert_eq!(
        device.reduce_into(ReduceOp::Sum, DType::F32, &mut a, &a2, &b, &stream),
        Err(mismatch)
    );
    let mut c2 = c.clone();
    assert_eq!(
        device.reduce(ReduceOp::Min, DType::F32, &mut c2, &c, &stream),
        Err(CudaError::Kernel(KernelError::Misaligned {
            len: 6,
            dtype: DType::F32
        }))
    );
    assert_eq!(
        device.finish_avg(DType::I32, &mut a, 0, &stream),
        Err(CudaError::Kernel(KernelError::ZeroCount))
    );
    // Bitwise operators on floats, before the lengths are looked at.
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for op in ReduceOp::BITWISE {
            let unsupported = Err(CudaError::Kernel(KernelError::UnsupportedOp { op, dtype }));
            assert_eq!(device.reduce(op, dtype, &mut a, &b, &stream), unsupported);
            assert_eq!(
                device.reduce_into(op, dtype, &mut a, &a2, &a2, &stream),
                unsupported
            );
        }
    }
    // ... which integer types have.
    device
        .reduce(ReduceOp::BXor, DType::U8, &mut a, &a2, &stream)
        .unwrap();
    assert_eq!(device.download(&stream, &a).unwrap(), [0u8; 8]);
    device
        .reduce_into(ReduceOp::BOr, DType::I32, &mut a, &a2, &a2, &stream)
        .unwrap();
    // Empty buffers are fine and launch nothing.
    let mut e = a.slice_mut(0..0);
    device
        .reduce(ReduceOp::Prod, DType::F64, &mut e, &b.slice(0..0), &stream)
        .unwrap();
    device.finish_avg(DType::F64, &mut e, 3, &stream).unwrap();
    assert_eq!(device.download(&stream, &a).unwrap(), [1u8; 8]);

    // A stream or buffer of another context is refused.
    let other = CudaContext::new_non_primary(0, 0).unwrap();
    let other_stream = other.new_stream().unwrap();
    assert!(matches!(
        device.reduce(ReduceOp::Sum, DType::U8, &mut a, &a2, &other_stream),
        Err(CudaError::WrongDevice { what: "stream", .. })
    ));
    let foreign = other_stream.clone_htod(&[0u8; 8]).unwrap();
    assert!(matches!(
        device.reduce(ReduceOp::Sum, DType::U8, &mut a, &foreign, &stream),
        Err(CudaError::WrongDevice {
            what: "source buffer",
            ..
        })
    ));
}

#[test]
fn devices_are_shared_and_streams_are_independent() {
    let Some(device) = gpu("devices_are_shared_and_streams_are_independent") else {
        return;
    };
    let again = Device::open(0).unwrap();
    assert!(Arc::ptr_eq(device.context(), again.context()));
    assert!(Device::count().unwrap() >= 1);
    assert!(matches!(
        Device::open(usize::MAX),
        Err(CudaError::NoDevice {
            ordinal: usize::MAX,
            ..
        })
    ));
    assert!(!device.name().unwrap().is_empty());

    // Average over "ranks" on two streams at once: sum three buffers, then divide.
    let (s1, s2) = (device.new_stream().unwrap(), again.new_stream().unwrap());
    let values = |k: f32| {
        (0..1001)
            .flat_map(|i| (i as f32 * k).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    for stream in [&s1, &s2] {
        let mut acc = device.upload(stream, &values(1.0)).unwrap();
        for k in [2.0, 3.0] {
            let other = device.upload(stream, &values(k)).unwrap();
            device
                .reduce(ReduceOp::Avg, DType::F32, &mut acc, &other, stream)
                .unwrap();
        }
        again.finish_avg(DType::F32, &mut acc, 3, stream).unwrap();
        assert_eq!(device.download(stream, &acc).unwrap(), values(2.0));
    }
}
