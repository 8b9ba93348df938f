//! Host reduction kernels against a plain copy of the same bytes.
//!
//! `cargo bench -p chorus-benches --bench reduce`

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

use chorus_kernels::{reduce, DType, ReduceOp};

fn kernels(c: &mut Criterion) {
    let mut group = c.benchmark_group("reduce");
    for bytes in [256 << 10, 64 << 20] {
        let src = vec![1u8; bytes];
        let mut dst = vec![2u8; bytes];
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_with_input(BenchmarkId::new("memcpy", bytes), &bytes, |b, _| {
            b.iter(|| dst.copy_from_slice(&src));
        });
        for (dtype, op) in [
            (DType::F32, ReduceOp::Sum),
            (DType::F32, ReduceOp::Max),
            (DType::BF16, ReduceOp::Sum),
            (DType::F16, ReduceOp::Sum),
            (DType::I32, ReduceOp::Sum),
            (DType::I32, ReduceOp::BXor),
        ] {
            let id = BenchmarkId::new(format!("{dtype}-{op}"), bytes);
            group.bench_with_input(id, &bytes, |b, _| {
                b.iter(|| reduce(op, dtype, &mut dst, &src).expect("equal lengths"));
            });
        }
    }
    group.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
