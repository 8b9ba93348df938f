//! The test worker: one rank of a multi-process test, started by the harness
//! with torchrun's environment contract. It runs a scenario, checks every
//! result against exactly computed expectations, prints a digest of each
//! output (so the harness can check that all ranks hold identical bytes),
//! and exits non-zero with a message on the first mismatch or error.

mod shrink;
mod started;

use std::process::ExitCode;

use chorus::check::{digest, Value};
use chorus::{env, Cause, Communicator, DType, Element, Error, ReduceOp, SharedBuffer};
use chorus_tests::{reduction_pairs, Case};

fn main() -> ExitCode {
    chorus_tests::init_logging();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("worker error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<(), String> {
    let scenario = args.first().map(String::as_str).unwrap_or("");
    let counts = || -> Result<Vec<usize>, String> {
        let list = args.get(1).ok_or("missing count list")?;
        list.split(',')
            .map(|c| c.parse().map_err(|e| format!("bad count {c}: {e}")))
            .collect()
    };
    match scenario {
        "all_reduce" => all_reduce_matrix(&connect()?, &counts()?),
        "broadcast" => broadcast_matrix(&connect()?, &counts()?),
        "barrier" => barrier_rounds(&connect()?, args.get(1).ok_or("missing directory")?),
        "connect" => connect().map(|_| ()),
        "connect_until" => connect_until(args.get(1).ok_or("missing file")?),
        "mismatched_length" => mismatched_length(&connect()?),
        "bitwise_floats" => bitwise_on_floats(&connect()?),
        "async" => async_in_order(&connect()?),
        "async_every" => started::every_call(&connect()?),
        "async_vanish" => started::rank_leaves(&connect()?),
        "more" => more_collectives(&connect()?, &counts()?),
        "split" => split_and_dup(&connect()?),
        "p2p" => point_to_point(&connect()?),
        "any_source" => any_source(&connect()?),
        "any_source_timeout" => any_source_timeout(&connect()?),
        "any_source_length" => any_source_length(&connect()?),
        "any_source_left" => any_source_left(&connect()?),
        "hold" => hold(&connect()?),
        "shared_mismatch" => shared_mismatch(&connect()?),
        "shared_async" => shared_async(&connect()?),
        "shared_dropped" => shared_dropped(&connect()?),
        "shared_alloc_mismatch" => shared_alloc_mismatch(&connect()?),
        "shrink" => shrink::survive(args.get(1).ok_or("missing victims")?),
        "shrink_late" => shrink::late(),
        "shrink_exclude" => shrink::exclude(),
        "shrink_chaos" => shrink::chaos(args.get(1).ok_or("missing seed")?),
        other => Err(format!("unknown scenario '{other}'")),
    }
}

/// Joins the job; with `CHORUS_TEST_RANKS_PER_HOST=k`, ranks `k*h..k*(h+1)` claim to share
/// host `h` (a host-identity override, so one machine can stand in for several hosts).
fn connect() -> Result<Communicator, String> {
    let mut config = chorus::Config::from_env().map_err(|e| e.to_string())?;
    if let Ok(k) = std::env::var(chorus_tests::CHORUS_TEST_RANKS_PER_HOST) {
        let k: usize = k
            .parse()
            .map_err(|e| format!("CHORUS_TEST_RANKS_PER_HOST={k}: {e}"))?;
        config.host_id = Some(format!("test-host-{}", config.rank / k.max(1)));
    }
    Communicator::new(config).map_err(|e| e.to_string())
}

/// Joins the job and keeps the communicator until `file` exists (at most a minute), so that
/// a test can have a rank join while the job is still up.
fn connect_until(file: &str) -> Result<(), String> {
    let _comm = connect()?;
    let start = std::time::Instant::now();
    while !std::path::Path::new(file).exists() {
        if start.elapsed() > std::time::Duration::from_secs(60) {
            return Err(format!("{file} did not appear within 60 s"));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Ok(())
}

/// All-reduces until a peer fails (or for at most a minute), saying when the first one is done;
/// for tests that kill a rank mid-job.
fn hold(comm: &Communicator) -> Result<(), String> {
    use std::io::Write;
    let mut buf = buffer::<f32>(comm, 1 << 18)?;
    buf.fill(1.0);
    let start = std::time::Instant::now();
    let mut rounds = 0u64;
    while start.elapsed() < std::time::Duration::from_secs(60) {
        comm.all_reduce(&mut buf, ReduceOp::Max)
            .map_err(|e| format!("all-reduce {rounds} failed: {e}"))?;
        if rounds == 0 {
            println!("ready rank={} pid={}", comm.rank(), std::process::id());
            std::io::stdout().flush().map_err(|e| e.to_string())?;
        }
        rounds += 1;
    }
    Ok(())
}

/// Every dtype x op (that applies to it) x count, in place and out of place.
fn all_reduce_matrix(comm: &Communicator, counts: &[usize]) -> Result<(), String> {
    for (dtype, op) in reduction_pairs() {
        for &count in counts {
            for in_place in [true, false] {
                let case = Case {
                    dtype,
                    op,
                    count,
                    in_place,
                    root: 0,
                };
                dispatch(comm, &case)?;
            }
        }
    }
    Ok(())
}

fn broadcast_matrix(comm: &Communicator, counts: &[usize]) -> Result<(), String> {
    for root in 0..comm.world_size() {
        for dtype in [DType::F32, DType::U8, DType::BF16, DType::I64] {
            for &count in counts {
                for in_place in [true, false] {
                    let case = Case {
                        dtype,
                        op: ReduceOp::Sum,
                        count,
                        in_place,
                        root,
                    };
                    broadcast_case(comm, &case)?;
                }
            }
        }
    }
    Ok(())
}

fn dispatch(comm: &Communicator, case: &Case) -> Result<(), String> {
    chorus::with_dtype!(case.dtype, all_reduce_case, comm, case)
}

fn broadcast_case(comm: &Communicator, case: &Case) -> Result<(), String> {
    chorus::with_dtype!(case.dtype, broadcast_typed, comm, case)
}

fn all_reduce_case<T: Element + Value>(comm: &Communicator, case: &Case) -> Result<(), String> {
    let world = comm.world_size();
    exercise(
        comm,
        case,
        |input, output| match input {
            None => comm.all_reduce(output, case.op),
            Some(input) => comm.all_reduce_into(input, output, case.op),
        },
        |i, got: T| T::check(got, i, world, case.op),
    )
}

fn broadcast_typed<T: Element + Value>(comm: &Communicator, case: &Case) -> Result<(), String> {
    exercise(
        comm,
        case,
        |input, output| match input {
            None => comm.broadcast(output, case.root),
            Some(input) => comm.broadcast_into(input, output, case.root),
        },
        |i, got: T| {
            let want = T::input(case.root, i, ReduceOp::Sum);
            match bytemuck::bytes_of(&got) == bytemuck::bytes_of(&want) {
                true => Ok(()),
                false => Err(format!("got {got:?}, root has {want:?}")),
            }
        },
    )
}

/// Runs one case: this rank's input (in place, or into a poisoned output),
/// the call, a check of every element, and the output's digest.
fn exercise<T: Element + Value>(
    comm: &Communicator,
    case: &Case,
    call: impl FnOnce(Option<&[T]>, &mut [T]) -> chorus::Result<()>,
    check: impl Fn(usize, T) -> Result<(), String>,
) -> Result<(), String> {
    let mut input = buffer::<T>(comm, case.count)?;
    for (i, x) in input.iter_mut().enumerate() {
        *x = T::input(comm.rank(), i, case.op);
    }
    let mut output = buffer::<T>(comm, case.count)?;
    if case.in_place {
        output.copy_from_slice(&input);
    } else {
        output.fill(T::poison());
    }
    let input = (!case.in_place).then_some(&input[..]);
    call(input, &mut output).map_err(|e| format!("{case}: {e}"))?;
    for (i, got) in output.iter().enumerate() {
        check(i, *got).map_err(|why| format!("{case}: element {i}: {why}"))?;
    }
    println!(
        "digest {case} {:016x}",
        digest(bytemuck::cast_slice(&output))
    );
    Ok(())
}

/// `len` zeroed elements: with `CHORUS_TEST_SHARED=1` from `alloc_shared`
/// (failing unless shared when all ranks are on one shared-memory host), else a vector.
fn buffer<T: Element>(comm: &Communicator, len: usize) -> Result<Buffer<T>, String> {
    if std::env::var(chorus_tests::CHORUS_TEST_SHARED).as_deref() != Ok("1") {
        let mut private = vec![T::zeroed(); len];
        if std::env::var(chorus_tests::CHORUS_TEST_PAGES).as_deref() == Ok("huge") {
            on_huge_pages(&mut private)?;
        }
        return Ok(Buffer::Private(private));
    }
    let buf = comm.alloc_shared(len).map_err(|e| e.to_string())?;
    let one_host = std::env::var_os(chorus_tests::CHORUS_TEST_RANKS_PER_HOST).is_none()
        && std::env::var(env::CHORUS_TRANSPORT).as_deref() != Ok("tcp");
    if buf.is_shared() != one_host {
        return Err(format!(
            "a shared buffer on rank {} is {}shared",
            comm.rank(),
            if buf.is_shared() { "" } else { "not " }
        ));
    }
    Ok(Buffer::Shared(buf))
}

/// Advises `memory` (zeroed, untouched) onto huge pages, touches it, and for 2 MiB or more
/// says how much of it the kernel put on them.
fn on_huge_pages<T: Element>(memory: &mut [T]) -> Result<(), String> {
    chorus::pages::advise_huge(memory);
    memory.fill(T::zeroed());
    let bytes = std::mem::size_of_val(memory);
    if bytes >= 2 << 20 {
        match chorus::pages::huge_bytes(memory) {
            Ok(huge) => println!("pages {huge} of {bytes}"),
            Err(e) if e.kind() == std::io::ErrorKind::Unsupported => println!("pages unknown: {e}"),
            Err(e) => return Err(format!("cannot tell the pages of {bytes} bytes: {e}")),
        }
    }
    Ok(())
}

/// A test's memory: a vector, or a buffer every rank maps.
enum Buffer<T: Element> {
    Private(Vec<T>),
    Shared(SharedBuffer<T>),
}

impl<T: Element> std::ops::Deref for Buffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            Buffer::Private(v) => v,
            Buffer::Shared(s) => s,
        }
    }
}

impl<T: Element> std::ops::DerefMut for Buffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Buffer::Private(v) => v,
            Buffer::Shared(s) => s,
        }
    }
}

/// Asynchronous averages of a shared buffer, queued behind one another.
fn shared_async(comm: &Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut buf = comm
        .alloc_shared::<f64>(100_003)
        .map_err(|e| e.to_string())?;
    if !buf.is_shared() {
        return Err(format!("rank {rank}: the buffer is not shared"));
    }
    for (i, x) in buf.iter_mut().enumerate() {
        *x = (rank * 1000 + i % 1000) as f64;
    }
    let first = comm.all_reduce_async(buf, ReduceOp::Avg);
    let mut second = comm.alloc_shared::<f64>(10).map_err(|e| e.to_string())?;
    second.fill(rank as f64);
    let second = comm.all_reduce_async(second, ReduceOp::Max);
    let buf = first.wait().map_err(|e| e.to_string())?;
    let mean_rank = (world - 1) as f64 / 2.0;
    for (i, &x) in buf.iter().enumerate() {
        let want = mean_rank * 1000.0 + (i % 1000) as f64;
        if (x - want).abs() > 1e-9 {
            return Err(format!("rank {rank}: element {i} is {x}, want {want}"));
        }
    }
    let second = second.wait().map_err(|e| e.to_string())?;
    if second.iter().any(|&x| x != (world - 1) as f64) {
        return Err(format!("rank {rank}: max gave {:?}", &second[..]));
    }
    println!(
        "digest shared_async {:016x}",
        digest(bytemuck::cast_slice(&buf))
    );
    Ok(())
}

/// Rank 0 all-reduces one shared buffer, the others another, and each drops
/// the one it does not use while the call may run: depending on when the
/// drop lands the call fails naming the freed buffer or completes, but the
/// peers' memory must stay mapped while it is read (no crash).
fn shared_dropped(comm: &Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let n = 1 << 22;
    let mut a = comm.alloc_shared::<f32>(n).map_err(|e| e.to_string())?;
    let mut b = comm.alloc_shared::<f32>(n).map_err(|e| e.to_string())?;
    a.fill(rank as f32);
    b.fill(rank as f32);
    let (mine, other) = if rank == 0 { (a, b) } else { (b, a) };
    let work = comm.all_reduce_async(mine, ReduceOp::Sum);
    std::thread::sleep(std::time::Duration::from_millis(1));
    drop(other);
    match work.wait() {
        Err(e) if e.to_string().contains("has freed") => println!("outcome: freed ({e})"),
        Err(e) => return Err(e.to_string()),
        Ok(sum) => {
            let want = (world * (world - 1) / 2) as f32;
            if let Some(i) = sum.iter().position(|&x| x != want) {
                return Err(format!(
                    "rank {rank}: element {i} is {}, want {want}",
                    sum[i]
                ));
            }
            println!("outcome: summed");
        }
    }
    Ok(())
}

/// Rank 1 asks for a shared buffer of another size: every rank must fail to
/// allocate, and the communicator must go on working.
fn shared_alloc_mismatch(comm: &Communicator) -> Result<(), String> {
    let rank = comm.rank();
    let len = if rank == 1 { 2000 } else { 1000 };
    match comm.alloc_shared::<f32>(len) {
        Ok(_) => return Err(format!("rank {rank} allocated a mismatched shared buffer")),
        Err(e) => println!("allocation failed as expected: {e}"),
    }
    let mut v = vec![1f32; 1000];
    comm.all_reduce(&mut v, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    if v.iter().any(|&x| x != comm.world_size() as f32) {
        return Err(format!("rank {rank}: wrong sum after a failed allocation"));
    }
    Ok(())
}

/// Rank 1 all-reduces a vector while the others pass shared buffers: every
/// rank must fail promptly, the shared ones saying why.
fn shared_mismatch(comm: &Communicator) -> Result<(), String> {
    let mut shared = comm.alloc_shared::<f32>(4096).map_err(|e| e.to_string())?;
    let mut private = vec![0f32; 4096];
    let buf: &mut [f32] = if comm.rank() == 1 {
        &mut private
    } else {
        &mut shared
    };
    match comm.all_reduce(buf, ReduceOp::Sum) {
        Ok(()) => Err(format!(
            "rank {} finished a mismatched all-reduce",
            comm.rank()
        )),
        Err(e) => {
            println!("failed as expected: {e}");
            Ok(())
        }
    }
}

/// Each round every rank marks its arrival in `dir`, enters the barrier, and
/// checks on leaving that every rank's mark is there.
fn barrier_rounds(comm: &Communicator, dir: &str) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    for round in 0..5 {
        // Stagger arrivals so that some ranks reach the barrier well before others.
        std::thread::sleep(std::time::Duration::from_millis(
            ((rank * 7 + round * 3) % 5) as u64 * 20,
        ));
        let mark = std::path::Path::new(dir).join(format!("round{round}-rank{rank}"));
        std::fs::write(&mark, b"").map_err(|e| format!("cannot write {}: {e}", mark.display()))?;
        comm.barrier().map_err(|e| e.to_string())?;
        for peer in 0..world {
            let theirs = std::path::Path::new(dir).join(format!("round{round}-rank{peer}"));
            if !theirs.exists() {
                return Err(format!(
                    "round {round}: left the barrier before rank {peer} arrived"
                ));
            }
        }
    }
    println!("barrier ok");
    Ok(())
}

/// Rank 0 passes one element more than the others: every rank must fail with
/// an error, and the error seen by a receiver of rank 0's data names the sizes.
fn mismatched_length(comm: &Communicator) -> Result<(), String> {
    let count = if comm.rank() == 0 { 1001 } else { 1000 };
    let mut buf = vec![1.0f32; count];
    match comm.all_reduce(&mut buf, ReduceOp::Sum) {
        Ok(()) => Err("a mismatched all-reduce succeeded".into()),
        Err(e) => {
            println!("expected error: {e}");
            Ok(())
        }
    }
}

/// Bitwise operators on a float type fail on every rank before anything is sent: the
/// all-reduce after them still meets its peers and sums correctly.
fn bitwise_on_floats(comm: &Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut buf = vec![rank as f32; 1000];
    let input = vec![1.0f64; 4 * world];
    let mut out = vec![0.0f64; 4];
    for op in ReduceOp::BITWISE {
        let calls = [
            ("all_reduce", comm.all_reduce(&mut buf, op)),
            ("reduce", comm.reduce(&mut buf, op, world - 1)),
            ("reduce_scatter", comm.reduce_scatter(&input, &mut out, op)),
        ];
        for (what, result) in calls {
            match result {
                Err(Error::InvalidArgument(why)) if why.contains(&format!("operator {op} ")) => {
                    println!("refused: {what}: {why}")
                }
                other => return Err(format!("{what} with {op} on floats: {other:?}")),
            }
        }
    }
    // Only rank 0 tries once more: had the call sent anything, the sum below would fail.
    if rank == 0 && comm.all_reduce(&mut buf, ReduceOp::BXor).is_ok() {
        return Err("an all-reduce with bxor on floats succeeded".into());
    }
    comm.all_reduce(&mut buf, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    let want = (0..world).sum::<usize>() as f32;
    if buf.iter().any(|&x| x != want) {
        return Err(format!("rank {rank}: wrong sum {} (want {want})", buf[0]));
    }
    println!("bitwise on floats ok");
    Ok(())
}

fn check<T: PartialEq + std::fmt::Debug>(what: &str, got: T, want: T) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?}, expected {want:?}"))
    }
}

/// The sum over ranks 0..world of `rank + i`, for element i.
fn rank_sum(world: usize, i: usize) -> f64 {
    (0..world).map(|r| (r + i) as f64).sum()
}

/// Asynchronous all-reduces interleaved with blocking ones complete in issue
/// order and give correct results; a dup'ed communicator runs concurrently.
fn async_in_order(comm: &Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let err = |e: chorus::Error| e.to_string();
    let make = |n: usize| -> Vec<f64> { (0..n).map(|i| (rank + i) as f64).collect() };
    let side = comm.dup().map_err(err)?;
    let concurrent = std::thread::spawn(move || -> Result<(), String> {
        for round in 0..20 {
            let mut v = vec![round as f64 + rank as f64; 1000];
            side.all_reduce(&mut v, ReduceOp::Max)
                .map_err(|e| e.to_string())?;
            check("dup all_reduce", v[0], round as f64 + (world - 1) as f64)?;
        }
        Ok(())
    });
    let mut handles = Vec::new();
    for k in 0..8 {
        handles.push(comm.all_reduce_async(make(1 + k * 40_000), ReduceOp::Sum));
    }
    // A blocking call issued after them runs after them.
    let mut small = make(3);
    comm.all_reduce(&mut small, ReduceOp::Sum).map_err(err)?;
    for (i, v) in small.iter().enumerate() {
        check("blocking all_reduce", *v, rank_sum(world, i))?;
    }
    if !handles.iter().all(|h| h.is_completed()) {
        return Err("a blocking call returned before earlier asynchronous ones completed".into());
    }
    for handle in handles {
        let v = handle.wait().map_err(err)?;
        for (i, x) in v.iter().enumerate().step_by(997) {
            check("async all_reduce", *x, rank_sum(world, i))?;
        }
    }
    let b = comm
        .broadcast_async(make(10), world - 1)
        .wait()
        .map_err(err)?;
    check("async broadcast", b[0], (world - 1) as f64)?;
    concurrent
        .join()
        .map_err(|_| "the concurrent thread panicked".to_string())??;
    println!("async ok");
    Ok(())
}

/// Split by parity with reversed keys; rank 0 opts out when it can; the
/// halves run collectives concurrently with the parent.
fn split_and_dup(comm: &Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let err = |e: chorus::Error| e.to_string();
    let opt_out = world >= 3 && rank == 0;
    let color = (!opt_out).then_some((rank % 2) as u32);
    let sub = comm.split(color, -(rank as i64)).map_err(err)?;
    let Some(sub) = sub else {
        check("opted out", opt_out, true)?;
        let mut v = vec![1u32; 4];
        comm.all_reduce(&mut v, ReduceOp::Sum).map_err(err)?;
        println!("split ok");
        return Ok(());
    };
    let members: Vec<usize> = (0..world)
        .filter(|&r| r % 2 == rank % 2 && !(world >= 3 && r == 0))
        .collect();
    check("sub world size", sub.world_size(), members.len())?;
    // Keys are -rank: the highest parent rank comes first.
    let position = members
        .iter()
        .rev()
        .position(|&r| r == rank)
        .expect("member");
    check("sub rank", sub.rank(), position)?;
    let parent_sum = std::thread::scope(|s| {
        let parent = s.spawn(|| {
            let mut v = vec![1u32; 4];
            comm.all_reduce(&mut v, ReduceOp::Sum).map(|()| v[0])
        });
        let mut v = vec![rank as u64; 1000];
        sub.all_reduce(&mut v, ReduceOp::Sum).map_err(err)?;
        check(
            "sub all_reduce",
            v[999],
            members.iter().map(|&r| r as u64).sum(),
        )?;
        parent
            .join()
            .map_err(|_| "parent thread panicked".to_string())?
            .map_err(err)
    })?;
    check("parent all_reduce", parent_sum, world as u32)?;
    println!("split ok");
    Ok(())
}

/// A ring shift with a group (empty messages too), pairwise blocking send/recv, and self-messages.
fn point_to_point(comm: &Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let err = |e: chorus::Error| e.to_string();
    let right = (rank + 1) % world;
    let left = (rank + world - 1) % world;
    let mine: Vec<i32> = (0..5000).map(|i| (rank * 10_000 + i) as i32).collect();
    let mut from_left = vec![0i32; 5000];
    let mut echo = vec![0i32; 3];
    // Empty messages keep their place in the ring's order, as the device path's ring sends them.
    let mut nothing: [i32; 0] = [];
    comm.group(|g| {
        g.send(&mine[..0], right, 6);
        g.recv(&mut nothing, left, 6);
    })
    .map_err(err)?;
    comm.group(|g| {
        g.send(&mine, right, 7);
        g.recv(&mut from_left, left, 7);
        g.send(&mine[..3], rank, 9);
        g.recv(&mut echo, rank, 9);
    })
    .map_err(err)?;
    check("from left", from_left[4999], (left * 10_000 + 4999) as i32)?;
    check("echo", echo, vec![mine[0], mine[1], mine[2]])?;
    if world >= 2 && rank < world / 2 * 2 {
        let peer = rank ^ 1;
        let mut got = [0u8; 2];
        if rank % 2 == 0 {
            comm.send(&[rank as u8, 1], peer, 1).map_err(err)?;
            comm.recv(&mut got, peer, 2).map_err(err)?;
        } else {
            comm.recv(&mut got, peer, 1).map_err(err)?;
            comm.send(&[rank as u8, 2], peer, 2).map_err(err)?;
        }
        check("pair", got[0], peer as u8)?;
    }
    // Point-to-point traffic leaves the collective sequence in step.
    comm.barrier().map_err(err)?;
    println!("p2p ok");
    Ok(())
}

/// Rank 0 receives from any source: every other rank's message exactly once (small, then
/// large: striped, read in place, or in chunks), and a message with another tag at the front of
/// one rank's stream is passed over for another rank's. In a world of one, a clear error.
fn any_source(comm: &Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let err = |e: chorus::Error| e.to_string();
    if world == 1 {
        return match comm.recv_any(&mut [0u8; 4], 1) {
            Err(Error::InvalidArgument(why)) if why.contains("one rank") => {
                println!("any_source ok");
                Ok(())
            }
            other => Err(format!("recv_any in a world of one: {other:?}")),
        };
    }
    let message = |from: usize, len: usize| -> Vec<i32> {
        (0..len).map(|i| (from * 1_000_000 + i) as i32).collect()
    };
    for (tag, len) in [(1u32, 5usize), (2, 300_000)] {
        if rank == 0 {
            let mut senders = Vec::new();
            for _ in 1..world {
                let mut buf = vec![0i32; len];
                let from = comm.recv_any(&mut buf, tag).map_err(err)?;
                check(
                    &format!("tag {tag} from rank {from}"),
                    buf == message(from, len),
                    true,
                )?;
                senders.push(from);
            }
            senders.sort_unstable();
            check(
                &format!("senders of tag {tag}"),
                senders,
                (1..world).collect(),
            )?;
        } else {
            comm.send(&message(rank, len), 0, tag).map_err(err)?;
        }
    }
    // Rank 1's next message has tag 31, so the first receive of tag 32 takes rank 2's, and
    // rank 1's own comes once its tag-31 message is out of the way.
    match rank {
        0 => {
            let mut buf = [0i32; 2];
            let first = comm.recv_any(&mut buf, 32).map_err(err)?;
            check("first tag 32", (first, buf), (2, [2, 32]))?;
            comm.recv(&mut buf, 1, 31).map_err(err)?;
            check("tag 31", buf, [1, 31])?;
            let second = comm.recv_any(&mut buf, 32).map_err(err)?;
            check("second tag 32", (second, buf), (1, [1, 32]))?;
        }
        1 => {
            comm.send(&[1i32, 31], 0, 31).map_err(err)?;
            comm.send(&[1i32, 32], 0, 32).map_err(err)?;
        }
        2 => comm.send(&[2i32, 32], 0, 32).map_err(err)?,
        _ => {}
    }
    // Receiving from any source leaves the collective sequence in step.
    comm.barrier().map_err(err)?;
    println!("any_source ok");
    Ok(())
}

/// Rank 0 waits for a message with tag 6 that no rank sends (rank 1 sends tag 5) and times
/// out; the others wait on rank 0 until it gives up.
fn any_source_timeout(comm: &Communicator) -> Result<(), String> {
    if comm.rank() == 0 {
        let mut buf = [0u8; 4];
        return match comm.recv_any(&mut buf, 6) {
            Err(Error::Timeout(fault)) if (fault.cause, fault.found_by) == (Cause::Timeout, 0) => {
                println!("expected error: {}", Error::Timeout(fault));
                Ok(())
            }
            other => Err(format!("recv_any of a tag nobody sends: {other:?}")),
        };
    }
    if comm.rank() == 1 {
        comm.send(&[5u8; 4], 0, 5).map_err(|e| e.to_string())?;
    }
    wait_for_rank_0_to_fail(comm)
}

/// Rank 0 receives 4 elements from any source, but rank 1 sends 8; the others wait on rank 0
/// until it gives up.
fn any_source_length(comm: &Communicator) -> Result<(), String> {
    if comm.rank() == 0 {
        let mut buf = [0i32; 4];
        return match comm.recv_any(&mut buf, 3) {
            Err(e @ Error::Transport { .. }) => {
                println!("expected error: {e}");
                Ok(())
            }
            other => Err(format!("recv_any of the wrong length: {other:?}")),
        };
    }
    if comm.rank() == 1 {
        comm.send(&[7i32; 8], 0, 3).map_err(|e| e.to_string())?;
    }
    wait_for_rank_0_to_fail(comm)
}

/// Ranks leave once they have sent: rank 0 receives from any source past rank 1, which has
/// (most likely) left by then, and fails once every other rank has left.
fn any_source_left(comm: &Communicator) -> Result<(), String> {
    let err = |e: chorus::Error| e.to_string();
    let mut got = [0i32; 1];
    match comm.rank() {
        0 => {
            let first = comm.recv_any(&mut got, 1).map_err(err)?;
            check("first sender", (first, got), (1, [1]))?;
            // Time for rank 1 to leave; the receive below works whether it has or not.
            std::thread::sleep(std::time::Duration::from_millis(300));
            comm.send(&[0i32], 2, 9).map_err(err)?;
            let second = comm.recv_any(&mut got, 1).map_err(err)?;
            check("second sender", (second, got), (2, [2]))?;
            match comm.recv_any(&mut got, 1) {
                Err(e @ Error::Transport { .. }) if e.to_string().contains("closed") => {
                    println!("expected error: {e}")
                }
                other => return Err(format!("recv_any with every other rank gone: {other:?}")),
            }
        }
        1 => comm.send(&[1i32], 0, 1).map_err(err)?,
        _ => {
            comm.recv(&mut got, 0, 9).map_err(err)?;
            comm.send(&[2i32], 0, 1).map_err(err)?;
        }
    }
    println!("any_source_left ok");
    Ok(())
}

/// Waits for a message rank 0 never sends: the wait ends when rank 0 fails (or it times out).
fn wait_for_rank_0_to_fail(comm: &Communicator) -> Result<(), String> {
    match comm.recv(&mut [0u8; 1], 0, 99) {
        Ok(()) => Err("rank 0 sent a message it should not have".into()),
        Err(e) => {
            println!("rank {} saw: {e}", comm.rank());
            Ok(())
        }
    }
}

/// Reduce, reduce-scatter (every dtype x op that applies to it), all-gather, all-to-all(v),
/// gather and scatter (every root), checked element by element.
fn more_collectives(comm: &Communicator, counts: &[usize]) -> Result<(), String> {
    for (dtype, op) in reduction_pairs() {
        for &count in counts {
            let case = Case {
                dtype,
                op,
                count,
                in_place: false,
                root: 0,
            };
            chorus::with_dtype!(dtype, rooted_reductions, comm, &case)?;
        }
    }
    for &count in counts {
        for dtype in [DType::F32, DType::U8, DType::I64] {
            let case = Case {
                dtype,
                op: ReduceOp::Sum,
                count,
                in_place: false,
                root: 0,
            };
            chorus::with_dtype!(dtype, data_movement, comm, &case)?;
        }
    }
    println!("more ok");
    Ok(())
}

fn same<T: Element + std::fmt::Debug>(what: &str, got: T, want: T) -> Result<(), String> {
    match bytemuck::bytes_of(&got) == bytemuck::bytes_of(&want) {
        true => Ok(()),
        false => Err(format!("{what}: got {got:?}, expected {want:?}")),
    }
}

fn rooted_reductions<T: Element + Value>(comm: &Communicator, case: &Case) -> Result<(), String> {
    let (rank, world, n, op) = (comm.rank(), comm.world_size(), case.count, case.op);
    let fail = |e: chorus::Error| format!("{case}: {e}");
    for root in 0..world {
        let input: Vec<T> = (0..n).map(|i| T::input(rank, i, op)).collect();
        let mut buf = input.clone();
        comm.reduce(&mut buf, op, root).map_err(fail)?;
        let mut out = vec![T::poison(); n];
        comm.reduce_into(&input, &mut out, op, root).map_err(fail)?;
        if rank == root {
            for i in 0..n {
                T::check(buf[i], i, world, op)
                    .map_err(|w| format!("{case} reduce root {root} [{i}]: {w}"))?;
                T::check(out[i], i, world, op)
                    .map_err(|w| format!("{case} reduce_into root {root} [{i}]: {w}"))?;
            }
        }
    }
    let input: Vec<T> = (0..world * n).map(|j| T::input(rank, j, op)).collect();
    let mut out = vec![T::poison(); n];
    comm.reduce_scatter(&input, &mut out, op).map_err(fail)?;
    for (i, got) in out.iter().enumerate() {
        T::check(*got, rank * n + i, world, op)
            .map_err(|w| format!("{case} reduce_scatter [{i}]: {w}"))?;
    }
    Ok(())
}

fn data_movement<T: Element + Value>(comm: &Communicator, case: &Case) -> Result<(), String> {
    let (rank, world, n) = (comm.rank(), comm.world_size(), case.count);
    let fail = |e: chorus::Error| format!("{case}: {e}");
    let value = |r: usize, j: usize| T::input(r, j, ReduceOp::Sum);
    // All-gather, apart and in place.
    let mine: Vec<T> = (0..n).map(|i| value(rank, i)).collect();
    let mut all = vec![T::poison(); world * n];
    comm.all_gather(&mine, &mut all).map_err(fail)?;
    let mut in_place = vec![T::poison(); world * n];
    in_place[rank * n..(rank + 1) * n].copy_from_slice(&mine);
    comm.all_gather_in_place(&mut in_place).map_err(fail)?;
    for j in 0..world * n {
        same("all_gather", all[j], value(j / n.max(1), j % n.max(1)))?;
        same("all_gather_in_place", in_place[j], all[j])?;
    }
    // All-to-all: block q of rank r's input is element (q*n + i) of r's pattern.
    let send: Vec<T> = (0..world * n).map(|j| value(rank, j)).collect();
    let mut recv = vec![T::poison(); world * n];
    comm.all_to_all(&send, &mut recv).map_err(fail)?;
    for q in 0..world {
        for i in 0..n {
            same("all_to_all", recv[q * n + i], value(q, rank * n + i))?;
        }
    }
    // Variable counts: rank r sends (r + q + n) % 4 elements to rank q.
    let size = |from: usize, to: usize| (from + to + n) % 4;
    let send_counts: Vec<usize> = (0..world).map(|q| size(rank, q)).collect();
    let recv_counts: Vec<usize> = (0..world).map(|q| size(q, rank)).collect();
    let send: Vec<T> = (0..send_counts.iter().sum())
        .map(|j| value(rank, j))
        .collect();
    let mut recv = vec![T::poison(); recv_counts.iter().sum()];
    comm.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)
        .map_err(fail)?;
    let mut at = 0;
    for (q, &count) in recv_counts.iter().enumerate() {
        let offset: usize = (0..rank).map(|p| size(q, p)).sum();
        for i in 0..count {
            same("all_to_all_v", recv[at + i], value(q, offset + i))?;
        }
        at += count;
    }
    // Gather and scatter from every root.
    for root in 0..world {
        let mut gathered = vec![T::poison(); if rank == root { world * n } else { 0 }];
        comm.gather(&mine, &mut gathered, root).map_err(fail)?;
        for (j, got) in gathered.iter().enumerate() {
            same("gather", *got, value(j / n.max(1), j % n.max(1)))?;
        }
        let source: Vec<T> = if rank == root {
            (0..world * n).map(|j| value(root, j)).collect()
        } else {
            Vec::new()
        };
        let mut part = vec![T::poison(); n];
        comm.scatter(&source, &mut part, root).map_err(fail)?;
        for (i, got) in part.iter().enumerate() {
            same("scatter", *got, value(root, rank * n + i))?;
        }
    }
    Ok(())
}
