//! The device paths' test harness: ranks as threads of this process, each with its own
//! communicator over loopback TCP and a host of the layout's choosing, running a path on
//! the lazy device (see `gpu::lazy`) and checking every rank's output against a
//! reference computed on the host.

use std::sync::Arc;
use std::time::Duration;

use chorus_kernels::{DType, ReduceOp};

use super::gpu::lazy::{Buffer, LazyGpu, Queue};
use super::gpu::{Gpu, HostBuffer};
use super::ipc::Peers;
use super::staged::Staging;
use super::tiered::{Hosts, Tiered};
use super::{DeviceCall, Job};
use crate::{Communicator, Config, Result, StoreServer, TransportKind};

/// A device path as the harness drives it.
pub(super) trait Runs {
    /// Runs `job` on `comm`'s ranks after the work enqueued on `stream`.
    fn run(&mut self, comm: &Communicator, gpu: &LazyGpu, job: Job, stream: &Queue) -> Result<()>;

    /// Waits, where peers read this rank's memory, until none will any more (before it is
    /// freed).
    fn close(&mut self, _comm: &Communicator) {}
}

impl Runs for Staging<LazyGpu> {
    fn run(&mut self, comm: &Communicator, gpu: &LazyGpu, job: Job, stream: &Queue) -> Result<()> {
        Staging::run(self, comm, gpu, job, stream)
    }
}

impl Runs for Peers<LazyGpu> {
    fn run(&mut self, comm: &Communicator, gpu: &LazyGpu, job: Job, stream: &Queue) -> Result<()> {
        Peers::run(self, comm, gpu, job, stream)
    }

    fn close(&mut self, comm: &Communicator) {
        Peers::close(self, comm);
    }
}

impl Runs for Tiered<LazyGpu> {
    fn run(&mut self, comm: &Communicator, gpu: &LazyGpu, job: Job, stream: &Queue) -> Result<()> {
        Tiered::run(self, comm, gpu, job, stream)
    }

    fn close(&mut self, _comm: &Communicator) {
        Tiered::close(self);
    }
}

/// Runs `each` on the ranks of one job, rank `r` on a thread with its own communicator
/// over loopback TCP whose host identity is `host{hosts[r]}`; what each gave, in rank
/// order.
pub(super) fn on_ranks<T: Send>(
    hosts: &[usize],
    each: impl Fn(&Communicator, &Hosts) -> T + Sync,
) -> Vec<T> {
    let world = hosts.len();
    let server = StoreServer::bind(([127, 0, 0, 1], 0).into()).expect("a store");
    let port = server.local_addr().port();
    let mut server = Some(server);
    std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let (server, each) = (server.take().filter(|_| rank == 0), &each);
                scope.spawn(move || {
                    let mut config = Config::new(rank, world, "127.0.0.1", port);
                    config.transport = TransportKind::Tcp;
                    config.timeout = Duration::from_secs(60);
                    config.host_id = Some(format!("host{}", hosts[rank]));
                    let comm =
                        Communicator::with_store_server(config, server, "device").expect("joined");
                    let layout = Hosts::gather(&comm).expect("the hosts");
                    each(&comm, &layout)
                })
            })
            .collect();
        let done = ranks.into_iter().map(|r| r.join().expect("a rank"));
        done.collect()
    })
}

/// Rank `rank`'s input element `i`: small whole numbers, exact in every type used.
fn element(rank: usize, i: usize) -> i64 {
    (rank as i64 + 1) * 100 + (i % 97) as i64
}

fn encode(values: impl IntoIterator<Item = i64>, dtype: DType) -> Vec<u8> {
    let mut bytes = Vec::new();
    for v in values {
        match dtype {
            DType::I32 => bytes.extend_from_slice(&(v as i32).to_ne_bytes()),
            DType::F64 => bytes.extend_from_slice(&(v as f64).to_ne_bytes()),
            _ => unreachable!("the tests use i32 and f64"),
        }
    }
    bytes
}

/// What rank `rank`'s output holds after `call` on `world` ranks of `count` elements
/// each (sums, maxima, minima and averages); `None` where it is left as it was.
fn expected(
    call: DeviceCall,
    dtype: DType,
    world: usize,
    rank: usize,
    count: usize,
) -> Option<Vec<u8>> {
    let fold = |op: ReduceOp, i: usize| {
        let each = (0..world).map(|r| element(r, i));
        match op {
            ReduceOp::Max => each.max().expect("a rank"),
            ReduceOp::Min => each.min().expect("a rank"),
            _ => each.sum::<i64>(),
        }
    };
    let values: Vec<i64> = match call {
        DeviceCall::AllReduce(ReduceOp::Avg) => {
            return Some(
                (0..count)
                    .flat_map(|i| (fold(ReduceOp::Sum, i) as f64 / world as f64).to_ne_bytes())
                    .collect(),
            )
        }
        DeviceCall::AllReduce(op) => (0..count).map(|i| fold(op, i)).collect(),
        DeviceCall::Reduce { op, root } if root == rank => {
            (0..count).map(|i| fold(op, i)).collect()
        }
        DeviceCall::Reduce { .. } => return None,
        DeviceCall::Broadcast { root } => (0..count).map(|i| element(root, i)).collect(),
        DeviceCall::AllGather => (0..world * count)
            .map(|i| element(i / count, i % count))
            .collect(),
        DeviceCall::ReduceScatter(op) => (0..count).map(|i| fold(op, rank * count + i)).collect(),
        // Block `q` of the output is block `rank` of rank `q`'s input.
        DeviceCall::AllToAll => (0..world * count)
            .map(|i| element(i / count, rank * count + i % count))
            .collect(),
    };
    Some(encode(values, dtype))
}

/// One call of a check: what, of which type, how many elements per rank block.
pub(super) type Case = (DeviceCall, DType, usize);

/// For every layout of hosts (rank `r` on host `layout[r]`), sets a path up on every rank
/// with `setup` and runs every case through it, in place and apart, the caller's queue
/// lazy and eager, then checks every rank's output.
pub(super) fn check<P: Runs>(
    layouts: &[&[usize]],
    cases: &[Case],
    setup: impl Fn(&Communicator, &LazyGpu, &Hosts) -> P + Sync,
) {
    check_on(layouts, cases, |_| LazyGpu::default(), setup);
}

/// As [`check`], rank `r`'s device made by `device(r)`.
pub(super) fn check_on<P: Runs>(
    layouts: &[&[usize]],
    cases: &[Case],
    device: impl Fn(usize) -> LazyGpu + Sync,
    setup: impl Fn(&Communicator, &LazyGpu, &Hosts) -> P + Sync,
) {
    let ways = [(false, false), (true, false), (false, true), (true, true)];
    for hosts in layouts {
        let world = hosts.len();
        let outputs = on_ranks(hosts, |comm, layout| {
            let gpu = device(comm.rank());
            let mut path = setup(comm, &gpu, layout);
            let runs = cases.iter().flat_map(|case| ways.map(|way| (*case, way)));
            let results: Vec<_> = runs
                .map(|(case, way)| run_one(&mut path, comm, &gpu, case, way))
                .collect();
            path.close(comm);
            results
        });
        for (rank, results) in outputs.into_iter().enumerate() {
            let runs = cases.iter().flat_map(|case| ways.map(|way| (*case, way)));
            for (((call, dtype, count), (in_place, eager)), (got, before)) in runs.zip(results) {
                let want = expected(call, dtype, world, rank, count).unwrap_or(before);
                assert!(
                    got == want,
                    "{call:?} of {count} {dtype} on hosts {hosts:?}, {} place, caller's queue \
                     {}: rank {rank} got a wrong result ({got:?} for {want:?})",
                    if in_place { "in" } else { "out of" },
                    if eager { "eager" } else { "lazy" }
                );
            }
        }
    }
}

/// Runs one case on this rank: the output it got, and what it held before.
fn run_one<P: Runs>(
    path: &mut P,
    comm: &Communicator,
    gpu: &LazyGpu,
    (call, dtype, count): Case,
    (in_place, eager): (bool, bool),
) -> (Vec<u8>, Vec<u8>) {
    let (rank, world) = (comm.rank(), comm.world_size());
    let (inputs, outputs) = match call {
        DeviceCall::AllGather => (1, world),
        DeviceCall::ReduceScatter(_) => (world, 1),
        DeviceCall::AllToAll => (world, world),
        _ => (1, 1),
    };
    let size = dtype.size();
    let input = encode((0..inputs * count).map(|i| element(rank, i)), dtype);
    // Untouched outputs keep this pattern.
    let mut output = Buffer::new(outputs * count * size);
    output.bytes_mut(outputs * count * size).fill(0xA5);
    let mut input_buf = Buffer::new(input.len());
    input_buf.bytes_mut(input.len()).copy_from_slice(&input);
    let block = count * size;
    let (input_at, output_at) = match (in_place, call) {
        (false, _) => (input_buf.address(), output.address()),
        (true, DeviceCall::AllGather) => {
            let mine = &mut output.bytes_mut(world * block)[rank * block..];
            mine[..block].copy_from_slice(&input);
            (output.address() + (rank * block) as u64, output.address())
        }
        (true, DeviceCall::ReduceScatter(_)) => (
            input_buf.address(),
            input_buf.address() + (rank * block) as u64,
        ),
        (true, _) => {
            output.bytes_mut(input.len()).copy_from_slice(&input);
            (output.address(), output.address())
        }
    };
    let job = Job {
        call,
        dtype,
        block,
        input: input_at,
        output: output_at,
    };
    let stream = match eager {
        true => Arc::new(Queue::eager()),
        false => gpu.queue().expect("a queue"),
    };
    let before = output.bytes(outputs * block).to_vec();
    // The input is written by work on the caller's queue, enqueued before the call: the
    // call must read it after that work.
    let len = inputs * block;
    let mut source = Buffer::new(len);
    // SAFETY: `input_at` addresses `len` bytes of this rank's buffers, which nothing
    // borrows while these lines run.
    let input_bytes = unsafe { std::slice::from_raw_parts_mut(input_at as *mut u8, len) };
    source.bytes_mut(len).copy_from_slice(input_bytes);
    input_bytes.fill(0x5A);
    // SAFETY: both hold `len` bytes and live until the call has ended.
    unsafe { gpu.to_device(input_at, source.at(0), len, &stream) }.expect("a copy");
    path.run(comm, gpu, job, &stream).expect("the call");
    let got = match (in_place, call) {
        (true, DeviceCall::ReduceScatter(_)) => {
            input_buf.bytes(world * block)[rank * block..][..block].to_vec()
        }
        _ => output.bytes(outputs * block).to_vec(),
    };
    (got, before)
}
