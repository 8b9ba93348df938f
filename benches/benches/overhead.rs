//! What an 8-byte all-reduce costs besides the wire: the tuner's pick, building its schedule,
//! running it with no peer (one rank), and the same call between two ranks
//! over loopback TCP for scale.
//!
//! `cargo bench -p chorus-benches --bench overhead`

// criterion's generated functions are undocumented.
#![allow(missing_docs)]

mod pair;

use criterion::{criterion_group, Criterion};

use chorus::schedule::{recursive, ring};
use chorus::tuner::{Collective, Forced, Tuner, DEFAULT_ALPHA, DEFAULT_BETA};
use chorus::{Communicator, Config, ReduceOp, DEFAULT_CHUNK_BYTES};
use pair::Pair;

fn all_reduce_8b(comm: &Communicator, buf: &mut [u8]) {
    let floats: &mut [f32] = bytemuck::cast_slice_mut(&mut buf[..8]);
    comm.all_reduce(floats, ReduceOp::Sum).expect("all-reduce");
}

fn overhead(c: &mut Criterion) {
    let mut group = c.benchmark_group("all_reduce_8B");
    let chunk = DEFAULT_CHUNK_BYTES / 4;
    group.bench_function("schedule_ring_w8", |b| {
        b.iter(|| ring::all_reduce(3, 8, 2, chunk))
    });
    group.bench_function("schedule_doubling_w8", |b| {
        b.iter(|| recursive::doubling(3, 8, 2, chunk, usize::MAX))
    });
    let tuner = Tuner::new(DEFAULT_ALPHA, DEFAULT_BETA, Forced::none());
    group.bench_function("tuner_decide_w8", |b| {
        b.iter(|| tuner.decide(Collective::AllReduce, std::hint::black_box(8), 8))
    });
    // One rank needs no store, and so no port.
    let solo =
        Communicator::new(Config::new(0, 1, chorus::DEFAULT_MASTER_ADDR, 0)).expect("one rank");
    let mut floats = [1.0f32; 2];
    group.bench_function("call_w1", |b| {
        b.iter(|| {
            solo.all_reduce(&mut floats, ReduceOp::Sum)
                .expect("all-reduce")
        })
    });
    let mut pair = Pair::new("all_reduce_8b", 1, 8);
    group.bench_function("call_w2_tcp", |b| b.iter_custom(|iters| pair.time(iters)));
    group.finish();
}

criterion_group!(benches, overhead);

fn main() {
    pair::main(&[("all_reduce_8b", all_reduce_8b)], || {
        benches();
        Criterion::default().configure_from_args().final_summary();
    });
}
