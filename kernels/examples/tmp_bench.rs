#![allow(missing_docs)]
use chorus_kernels::*;
use std::hint::black_box;
use std::time::Instant;

fn time(bytes: usize, iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..40 {
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        best = best.min(t.elapsed().as_secs_f64() / iters as f64);
    }
    bytes as f64 / best / 1e9
}

fn main() {
    let filter = std::env::args().nth(1).unwrap_or_default();
    for &size in &[256usize << 10, 64 << 20] {
        let iters = if size > 1 << 20 { 2 } else { 50 };
        let mut dst = vec![1u64; size / 8];
        let src = vec![2u64; size / 8];
        let dst_b: &mut [u8] = bytemuck::cast_slice_mut(&mut dst);
        // init with valid floats for all types: bytes 0 fine.
        dst_b.fill(0x3C);
        let mut src = src;
        bytemuck::cast_slice_mut::<u64, u8>(&mut src).fill(0x3D);
        let src_b: &[u8] = bytemuck::cast_slice(&src);
        let mut out = vec![0u8; size];
        let g = time(size, iters, || {
            out.copy_from_slice(black_box(&src_b));
            black_box(&mut out);
        });
        println!(
            "size {:>6} KiB memcpy                {:6.2} GB/s",
            size >> 10,
            g
        );
        for (dt, op) in [
            (DType::F32, ReduceOp::Sum),
            (DType::F32, ReduceOp::Max),
            (DType::F64, ReduceOp::Sum),
            (DType::F64, ReduceOp::Min),
            (DType::F16, ReduceOp::Sum),
            (DType::BF16, ReduceOp::Sum),
            (DType::I32, ReduceOp::Sum),
            (DType::I64, ReduceOp::Prod),
            (DType::U8, ReduceOp::Max),
        ] {
            if !dt.name().contains(filter.as_str()) {
                continue;
            }
            let g = time(size, iters, || {
                reduce(op, dt, black_box(&mut *dst_b), black_box(src_b)).unwrap()
            });
            let g2 = time(size, iters, || {
                reduce_into(
                    op,
                    dt,
                    black_box(&mut out),
                    black_box(&*dst_b),
                    black_box(src_b),
                )
                .unwrap()
            });
            let g3 = time(size, iters / 4 + 1, || {
                reduce(
                    op,
                    dt,
                    black_box(&mut dst_b[1..size - 7]),
                    black_box(&src_b[2..size - 6]),
                )
                .unwrap_or(())
            });
            println!(
                "size {:>6} KiB {:>8} {:>4} reduce {:6.2} GB/s  into {:6.2} GB/s  unaligned {:6.2} GB/s",
                size >> 10, dt, op, g, g2, g3
            );
        }
    }
}
