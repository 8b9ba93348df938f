//! One TCP stream against a message striped over several sockets per peer.
//!
//! `cargo bench -p chorus-benches --bench stripes`

// criterion's generated functions are undocumented.
#![allow(missing_docs)]

mod pair;

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};

use pair::Pair;

const BYTES: usize = 64 << 20;

fn send_or_recv(comm: &chorus::Communicator, buf: &mut [u8]) {
    if comm.rank() == 0 {
        comm.send(buf, 1, 0).expect("send");
    } else {
        comm.recv(buf, 0, 0).expect("recv");
    }
}

fn stripes(c: &mut Criterion) {
    let mut group = c.benchmark_group("tcp_send_64MiB");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(BYTES as u64));
    for nsocks in [1, 2, 4] {
        let mut pair = Pair::new("send_or_recv", nsocks, BYTES);
        group.bench_with_input(BenchmarkId::new("sockets", nsocks), &nsocks, |b, _| {
            b.iter_custom(|iters| pair.time(iters));
        });
    }
    group.finish();
}

criterion_group!(benches, stripes);

fn main() {
    pair::main(&[("send_or_recv", send_or_recv)], || {
        benches();
        Criterion::default().configure_from_args().final_summary();
    });
}
