//! The device-collectives test worker: one rank of `chorus::cuda` checks on a GPU.
//!
//! `check PATH` runs every collective on device buffers (all-to-all included), and sends
//! and receives (several types, operators and
//! sizes, in and out of place, rounds and chunks included) and compares each rank's output
//! with the result computed on the host; the communicator must have taken PATH (`ipc`,
//! `staged` or `hierarchical`, for which ranks `2h` and `2h + 1` count as host `h`), and that
//! ranks passing different sizes all fail. `bench PATH MIB` times a MIB all-reduce of f32 on device buffers, the same
//! all-reduce on host buffers, and a device-to-device copy, and prints one `bench` line.
//! `shrink PATH`: the last rank leaves (exits without a word) after three all-reduces; the
//! others notice, shrink the device communicator and check it as `check` does.
//! Prints `skipping: ...` and exits 0 where there is no GPU, unless
//! `CHORUS_REQUIRE_CUDA=1`. Exits 2 with `WRONG: ...` on a wrong result.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use chorus::cuda::cudarc::driver::DeviceRepr;
use chorus::cuda::{
    CallerStream, CudaCommunicator, CudaError, CudaSlice, CudaStream, Device, DevicePath,
};
use chorus::{bf16, Communicator, Config, Element, ReduceOp};

type Outcome = Result<(), String>;

fn main() -> ExitCode {
    chorus_tests::init_logging();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).map(String::as_str).unwrap_or("");
    let device = match Device::count().and_then(|n| match n {
        0 => Err(CudaError::NoDevice {
            ordinal: 0,
            count: 0,
        }),
        n => Device::open(local_rank() % n),
    }) {
        Ok(device) => device,
        Err(e) if std::env::var("CHORUS_REQUIRE_CUDA").as_deref() != Ok("1") => {
            println!("skipping: no usable GPU ({e})");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("failed: CHORUS_REQUIRE_CUDA=1 but {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = Config::from_env()
        .and_then(|mut config| {
            if arg(1) == "hierarchical" {
                config.host_id = Some(format!("host{}", config.rank / 2));
            }
            Communicator::new(config)
        })
        .and_then(|comm| {
            let dev = CudaCommunicator::new(&comm, device.clone())?;
            Ok((comm, dev))
        })
        .map_err(|e| e.to_string())
        .and_then(|(comm, dev)| {
            let want = match arg(1) {
                "ipc" => DevicePath::Ipc,
                "hierarchical" => DevicePath::Hierarchical,
                _ => DevicePath::Staged,
            };
            if dev.path() != want {
                return Err(format!("WRONG: took {:?}, expected {want:?}", dev.path()));
            }
            let stream = device.new_stream().map_err(|e| e.to_string())?;
            match arg(0) {
                "check" => check(&dev, &stream),
                "bench" => bench(&comm, &dev, &stream, arg(2).parse().unwrap_or(64)),
                "shrink" => shrink(&dev, &stream),
                other => Err(format!("WRONG: unknown scenario {other:?}")),
            }
        });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.starts_with("WRONG") => {
            eprintln!("{e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("failed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn local_rank() -> usize {
    std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Rank `r`'s element `i`: small integers, exact in every type and in any summation order.
fn value(r: usize, i: usize) -> f64 {
    ((r + 1) * (i % 7 + 1)) as f64 - 3.0
}

/// A host element from an exact small integer.
trait Exact: Element + DeviceRepr + PartialEq + std::fmt::Debug {
    fn from_f64(x: f64) -> Self;
}
impl Exact for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}
impl Exact for bf16 {
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
}
impl Exact for i32 {
    fn from_f64(x: f64) -> Self {
        x as i32
    }
}

const POISON: f64 = 99.0;

fn check(dev: &CudaCommunicator, stream: &Arc<CudaStream>) -> Outcome {
    // 17 Mi + 3 f32 elements: more than one IPC round (64 MiB) and many staging chunks.
    for count in [1, 1027, (17 << 20) + 3] {
        check_type::<f32>(
            dev,
            stream,
            count,
            &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max],
        )?;
    }
    if dev.path() == DevicePath::Hierarchical {
        // 256 MiB and a few bytes a rank: a call cut into rounds that overlap.
        check_type::<f32>(dev, stream, (64 << 20) + 5, &[ReduceOp::Sum])?;
    }
    for count in [5, 100_003] {
        check_type::<bf16>(dev, stream, count, &[ReduceOp::Sum, ReduceOp::Min])?;
        check_type::<i32>(dev, stream, count, &[ReduceOp::Sum, ReduceOp::BXor])?;
    }
    check_async(dev, stream)?;
    check_messages(dev, stream)?;
    check_stream_order(dev)?;
    check_local(dev, stream)?;
    if dev.world_size() > 1 {
        // Ranks passing different sizes fail, every one of them, rather than hang or corrupt.
        let mut buf = stream
            .clone_htod(&vec![1.0f32; 1000 + dev.rank()])
            .map_err(|e| e.to_string())?;
        match dev.all_reduce(&mut buf, ReduceOp::Sum, stream) {
            Ok(()) => return Err("WRONG: an all-reduce of mismatched sizes succeeded".into()),
            Err(e) => println!("mismatched sizes refused: {e}"),
        }
    }
    println!("device collectives ok on {:?}", dev.path());
    Ok(())
}

fn shrink(dev: &CudaCommunicator, stream: &Arc<CudaStream>) -> Outcome {
    let leaver = dev.world_size() - 1;
    let mut buf = stream
        .clone_htod(&vec![1.0f32; 1 << 16])
        .map_err(|e| e.to_string())?;
    for round in 0..100_000 {
        if dev.rank() == leaver && round == 3 {
            println!("shrunk ok: this rank left");
            std::process::exit(0);
        }
        if let Err(e) = dev.all_reduce(&mut buf, ReduceOp::Sum, stream) {
            println!("noticed in all-reduce {round}: {e}");
            let survivors = dev.shrink(&[]).map_err(|e| e.to_string())?;
            if (survivors.rank(), survivors.world_size()) != (dev.rank(), leaver) {
                return Err(format!(
                    "WRONG: rank {} of {} after the shrink",
                    survivors.rank(),
                    survivors.world_size()
                ));
            }
            check_type::<f32>(&survivors, stream, 1027, &[ReduceOp::Sum, ReduceOp::Max])?;
            check_type::<i32>(&survivors, stream, 100_003, &[ReduceOp::Sum])?;
            check_async(&survivors, stream)?;
            println!(
                "shrunk ok: rank {} of {leaver} on {:?}",
                survivors.rank(),
                survivors.path()
            );
            return Ok(());
        }
    }
    Err(format!("WRONG: rank {leaver} never left"))
}

fn check_type<T: Exact>(
    dev: &CudaCommunicator,
    stream: &Arc<CudaStream>,
    count: usize,
    ops: &[ReduceOp],
) -> Outcome {
    let (w, me) = (dev.world_size(), dev.rank());
    let what = |name: &str| format!("{name} {} x {count}", T::DTYPE);
    let input =
        |r: usize, n: usize| -> Vec<T> { (0..n).map(|i| T::from_f64(value(r, i))).collect() };
    let poison = |n: usize| vec![T::from_f64(POISON); n];
    let up = |v: &[T]| stream.clone_htod(v).map_err(|e| e.to_string());
    let down = |s: &CudaSlice<T>| {
        let v = stream.clone_dtoh(s).map_err(|e| e.to_string())?;
        stream.synchronize().map_err(|e| e.to_string())?;
        Ok::<_, String>(v)
    };
    let cuda = |e: chorus::Error| e.to_string();
    for &op in ops {
        let expect: Vec<T> = (0..count)
            .map(|i| T::from_f64(reduce(op, w, |r| value(r, i))))
            .collect();
        // All-reduce, in place and apart.
        let mut buf = up(&input(me, count))?;
        dev.all_reduce(&mut buf, op, stream).map_err(cuda)?;
        same(&down(&buf)?, &expect, &what(&format!("all_reduce {op}")))?;
        let src = up(&input(me, count))?;
        let mut out = up(&poison(count))?;
        dev.all_reduce_into(&src, &mut out, op, stream)
            .map_err(cuda)?;
        same(
            &down(&out)?,
            &expect,
            &what(&format!("all_reduce_into {op}")),
        )?;
        // Reduce to the last rank: other outputs untouched.
        let root = w - 1;
        let mut out = up(&poison(count))?;
        dev.reduce_into(&src, &mut out, op, root, stream)
            .map_err(cuda)?;
        let want = if me == root {
            expect.clone()
        } else {
            poison(count)
        };
        same(&down(&out)?, &want, &what(&format!("reduce_into {op}")))?;
        // Reduce-scatter: block q of the input is `input(me)` shifted by q.
        let blocks: Vec<T> = (0..w * count).map(|i| T::from_f64(value(me, i))).collect();
        let src = up(&blocks)?;
        let mut out = up(&poison(count))?;
        dev.reduce_scatter(&src, &mut out, op, stream)
            .map_err(cuda)?;
        let want: Vec<T> = (0..count)
            .map(|i| T::from_f64(reduce(op, w, |r| value(r, me * count + i))))
            .collect();
        same(&down(&out)?, &want, &what(&format!("reduce_scatter {op}")))?;
    }
    // Broadcast from the last rank, in place and apart.
    let root = w - 1;
    let mut buf = up(&input(me, count))?;
    dev.broadcast(&mut buf, root, stream).map_err(cuda)?;
    same(&down(&buf)?, &input(root, count), &what("broadcast"))?;
    let src = up(&input(me, count))?;
    let mut out = up(&poison(count))?;
    dev.broadcast_into(&src, &mut out, root, stream)
        .map_err(cuda)?;
    same(&down(&out)?, &input(root, count), &what("broadcast_into"))?;
    // All-gather.
    let mut out = up(&poison(w * count))?;
    dev.all_gather(&src, &mut out, stream).map_err(cuda)?;
    let want: Vec<T> = (0..w).flat_map(|r| input(r, count)).collect();
    same(&down(&out)?, &want, &what("all_gather"))?;
    // All-to-all: block q of the input goes to rank q.
    let blocks = up(&input(me, w * count))?;
    let mut out = up(&poison(w * count))?;
    dev.all_to_all(&blocks, &mut out, stream).map_err(cuda)?;
    let want: Vec<T> = (0..w)
        .flat_map(|q| input(q, w * count).split_off(me * count)[..count].to_vec())
        .collect();
    same(&down(&out)?, &want, &what("all_to_all"))?;
    Ok(())
}

/// Asynchronous calls on owned buffers, with a blocking call queued behind them: each
/// result as the blocking form gives it.
fn check_async(dev: &CudaCommunicator, stream: &Arc<CudaStream>) -> Outcome {
    let (w, me, count) = (dev.world_size(), dev.rank(), 4099);
    let input = |r: usize| -> Vec<f32> { (0..count).map(|i| value(r, i) as f32).collect() };
    let up = |v: &[f32]| stream.clone_htod(v).map_err(|e| e.to_string());
    let down = |s: &CudaSlice<f32>| {
        let v = stream.clone_dtoh(s).map_err(|e| e.to_string())?;
        stream.synchronize().map_err(|e| e.to_string())?;
        Ok::<_, String>(v)
    };
    let summed = dev.all_reduce_async(up(&input(me))?, ReduceOp::Sum, stream);
    let gathered = dev.all_gather_async(
        up(&input(me))?,
        up(&vec![POISON as f32; w * count])?,
        stream,
    );
    let mut root = up(&input(me))?;
    dev.broadcast(&mut root, 0, stream)
        .map_err(|e| e.to_string())?;
    let sum: Vec<f32> = (0..count)
        .map(|i| reduce(ReduceOp::Sum, w, |r| value(r, i)) as f32)
        .collect();
    same(
        &down(&summed.wait().map_err(|e| e.to_string())?)?,
        &sum,
        "all_reduce_async",
    )?;
    let (_, out) = gathered.wait().map_err(|e| e.to_string())?;
    let all: Vec<f32> = (0..w).flat_map(input).collect();
    same(&down(&out)?, &all, "all_gather_async")?;
    same(
        &down(&root)?,
        &input(0),
        "broadcast after asynchronous calls",
    )
}

/// Sends and receives on device memory: every rank sends the next rank 5 MiB + 3 bytes
/// (several slots of the IPC path) with tag 7 and the previous one 1 KiB with tag 2, and
/// itself 100 bytes, the receives posted in another order; every byte lands.
fn check_messages(dev: &CudaCommunicator, stream: &Arc<CudaStream>) -> Outcome {
    use chorus::cuda::cudarc::driver::{DevicePtr, DevicePtrMut};
    use chorus::cuda::DeviceMessage;
    let text = |e: &dyn std::fmt::Display| e.to_string();
    let (w, me) = (dev.world_size(), dev.rank());
    let (next, prev) = ((me + 1) % w, (me + w - 1) % w);
    let pattern = |from: usize, to: usize, tag: u32, n: usize| -> Vec<u8> {
        (0..n)
            .map(|i| (from * 31 + to * 7 + tag as usize + i) as u8)
            .collect()
    };
    // (peer, tag, bytes) of each send, and of each receive.
    let sends = [(next, 7, (5 << 20) + 3), (prev, 2, 1024), (me, 9, 100)];
    let recvs = [(me, 9, 100), (next, 2, 1024), (prev, 7, (5 << 20) + 3)];
    let mut keep = Vec::new();
    let mut messages = Vec::new();
    for &(peer, tag, bytes) in &sends {
        let buf = stream
            .clone_htod(&pattern(me, peer, tag, bytes))
            .map_err(|e| text(&e))?;
        let at = buf.device_ptr(stream).0;
        messages.push(DeviceMessage::Send {
            peer,
            tag,
            at,
            bytes,
        });
        keep.push(buf);
    }
    let mut landed = Vec::new();
    for &(peer, tag, bytes) in &recvs {
        let mut buf = stream.alloc_zeros::<u8>(bytes).map_err(|e| text(&e))?;
        let at = buf.device_ptr_mut(stream).0;
        messages.push(DeviceMessage::Recv {
            peer,
            tag,
            at,
            bytes,
        });
        landed.push((peer, tag, buf));
    }
    // SAFETY: every address is a live allocation of its length on this device, held in
    // `keep` and `landed` until the call has ended (waited for below); no receive overlaps
    // another message's memory.
    let work = unsafe { dev.exchange_raw(messages, (stream, CallerStream::Ordered), ()) };
    work.wait().map_err(|e| text(&e))?;
    for (peer, tag, buf) in landed {
        let got = stream.clone_dtoh(&buf).map_err(|e| text(&e))?;
        stream.synchronize().map_err(|e| text(&e))?;
        if got != pattern(peer, me, tag, got.len()) {
            return Err(format!(
                "WRONG: rank {me}'s message from rank {peer} with tag {tag}"
            ));
        }
    }
    drop(keep);
    Ok(())
}

/// Stream order of asynchronous calls: a call returns before long work queued ahead of it
/// on its stream has ended, and reads its input after that work; work queued on the stream
/// after the call sees its result; a failed call releases the stream; a call on a stream
/// being captured into a graph fails clearly.
fn check_stream_order(dev: &CudaCommunicator) -> Outcome {
    use chorus::cuda::cudarc::driver::{sys, DevicePtr, DevicePtrMut};
    let text = |e: &dyn std::fmt::Display| e.to_string();
    let stream = dev.device().new_stream().map_err(|e| text(&e))?;
    let (w, me, count) = (dev.world_size(), dev.rank(), 1 << 20);
    let sum: Vec<f32> = (0..count)
        .map(|i| reduce(ReduceOp::Sum, w, |r| value(r, i)) as f32)
        .collect();
    // Long work ahead: copies through 1 GiB, then the input written last, on the stream.
    let big = stream.alloc_zeros::<u8>(1 << 30).map_err(|e| text(&e))?;
    let mut copy = stream.alloc_zeros::<u8>(1 << 30).map_err(|e| text(&e))?;
    let mut buf = stream.alloc_zeros::<f32>(count).map_err(|e| text(&e))?;
    let mut after = stream.alloc_zeros::<f32>(count).map_err(|e| text(&e))?;
    let mine: Vec<f32> = (0..count).map(|i| value(me, i) as f32).collect();
    let staged = stream.clone_htod(&mine).map_err(|e| text(&e))?;
    stream.synchronize().map_err(|e| text(&e))?;
    for _ in 0..200 {
        stream.memcpy_dtod(&big, &mut copy).map_err(|e| text(&e))?;
    }
    stream
        .memcpy_dtod(&staged, &mut buf)
        .map_err(|e| text(&e))?;
    let ahead = stream.record_event(None).map_err(|e| text(&e))?;
    let address = buf.device_ptr(&stream).0;
    let issued = Instant::now();
    let work = dev.all_reduce_async(buf, ReduceOp::Sum, &stream);
    let returned = issued.elapsed();
    let still_running = !ahead.is_complete();
    println!(
        "stream order: all_reduce_async returned in {} us, the work ahead {}",
        returned.as_micros(),
        if still_running {
            "still running"
        } else {
            "already done"
        }
    );
    if !still_running {
        return Err("WRONG: the asynchronous call waited for the work queued ahead of it".into());
    }
    // Work queued after the call on its stream sees the result (where streams can wait on
    // memory; elsewhere only the handle orders it).
    let ordered = work.stream_ordered();
    if ordered {
        let (dst, _write) = after.device_ptr_mut(&stream);
        // SAFETY: both addresses are live allocations of `count` f32 on this stream's
        // device (`address` is the call's buffer, which the handle holds until `wait`).
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst, address, count * 4, stream.cu_stream()) }
            .result()
            .map_err(|e| text(&e))?;
    } else {
        println!("stream order: streams cannot wait on memory here; the stream is not ordered after the call");
    }
    let result = work.wait().map_err(|e| text(&e))?;
    let got = stream.clone_dtoh(&result).map_err(|e| text(&e))?;
    same(&got, &sum, "all_reduce_async behind long work")?;
    if ordered {
        let seen = stream.clone_dtoh(&after).map_err(|e| text(&e))?;
        same(&seen, &sum, "work queued after the call on its stream")?;
    }
    // A call on host memory in the same order: it starts once the work queued ahead of it
    // on the stream has ended, and its handle gives back the result.
    for _ in 0..200 {
        stream.memcpy_dtod(&big, &mut copy).map_err(|e| text(&e))?;
    }
    let ahead = Arc::new(stream.record_event(None).map_err(|e| text(&e))?);
    let seen = Arc::clone(&ahead);
    let host = Arc::new(std::sync::Mutex::new(mine.clone()));
    let held = Arc::clone(&host);
    let work = dev.host_call((&stream, CallerStream::Ordered), (), move |comm| {
        if !seen.is_complete() {
            return Err(chorus::Error::Internal(
                "the host call started before the work ahead of it ended".into(),
            ));
        }
        let mut values = held.lock().unwrap_or_else(|p| p.into_inner());
        comm.all_reduce(&mut values, ReduceOp::Sum)
    });
    let early = !ahead.is_complete();
    work.wait()
        .map_err(|e| format!("WRONG: the host call: {e}"))?;
    same(
        &host.lock().unwrap_or_else(|p| p.into_inner()),
        &sum,
        "host_call's all_reduce",
    )?;
    println!(
        "stream order: a host call ordered on the stream, returned {}",
        if early {
            "while the work ahead ran"
        } else {
            "after the work ahead"
        }
    );
    // A call that fails (its root is no rank) releases the stream that waits on it.
    let zeros = stream.alloc_zeros::<f32>(4).map_err(|e| text(&e))?;
    let failing = dev.broadcast_async(zeros, w, &stream);
    let released = stream.record_event(None).map_err(|e| text(&e))?;
    let waited = Instant::now();
    while !released.is_complete() {
        if waited.elapsed().as_secs() > 30 {
            return Err("WRONG: a failed call left its stream waiting".into());
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    match failing.wait() {
        Err(chorus::Error::InvalidArgument(why)) => {
            println!("stream order: a failed call released its stream ({why})")
        }
        other => return Err(format!("WRONG: a broadcast from root {w} gave {other:?}")),
    }
    // A call on a stream being captured into a graph fails, saying so.
    let capturing = dev.device().new_stream().map_err(|e| text(&e))?;
    let zeros = capturing.alloc_zeros::<f32>(4).map_err(|e| text(&e))?;
    capturing.synchronize().map_err(|e| text(&e))?;
    let relaxed = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: a live stream, captured until `cuStreamEndCapture` below.
    unsafe { sys::cuStreamBeginCapture_v2(capturing.cu_stream(), relaxed) }
        .result()
        .map_err(|e| text(&e))?;
    let captured = dev
        .all_reduce_async(zeros, ReduceOp::Sum, &capturing)
        .wait();
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above; the (empty) graph is destroyed at once.
    unsafe {
        sys::cuStreamEndCapture(capturing.cu_stream(), &mut graph)
            .result()
            .map_err(|e| text(&e))?;
        if !graph.is_null() {
            sys::cuGraphDestroy(graph).result().map_err(|e| text(&e))?;
        }
    }
    match captured {
        Err(chorus::Error::InvalidArgument(why)) if why.contains("captured") => {
            println!("stream order: a call under graph capture refused ({why})");
            Ok(())
        }
        other => Err(format!("WRONG: a call under graph capture gave {other:?}")),
    }
}

/// Calls over two buffers per process (on the next GPU where there is one, else both on
/// this one): every buffer of every rank is one participant, number `rank * 2 + i`.
fn check_local(dev: &CudaCommunicator, stream: &Arc<CudaStream>) -> Outcome {
    let (w, me, count, g) = (dev.world_size(), dev.rank(), 3001, 2);
    let gpus = Device::count().map_err(|e| e.to_string())?;
    let other = Device::open((dev.device().ordinal() + 1) % gpus).map_err(|e| e.to_string())?;
    let streams = [
        stream.clone(),
        other.new_stream().map_err(|e| e.to_string())?,
    ];
    let input = |v: usize| -> Vec<f32> { (0..count).map(|i| value(v, i) as f32).collect() };
    let load = || -> Result<Vec<CudaSlice<f32>>, String> {
        (0..g)
            .map(|i| {
                streams[i]
                    .clone_htod(&input(me * g + i))
                    .map_err(|e| e.to_string())
            })
            .collect()
    };
    let down = |i: usize, s: &CudaSlice<f32>| {
        let v = streams[i].clone_dtoh(s).map_err(|e| e.to_string())?;
        streams[i].synchronize().map_err(|e| e.to_string())?;
        Ok::<_, String>(v)
    };
    for op in [ReduceOp::Sum, ReduceOp::Avg] {
        let mut bufs = load()?;
        dev.all_reduce_local(&mut bufs, op, &streams)
            .map_err(|e| e.to_string())?;
        let want: Vec<f32> = (0..count)
            .map(|i| reduce(op, w * g, |v| value(v, i)) as f32)
            .collect();
        for (i, buf) in bufs.iter().enumerate() {
            same(
                &down(i, buf)?,
                &want,
                &format!("all_reduce_local {op} buffer {i}"),
            )?;
        }
    }
    let mut bufs = load()?;
    dev.broadcast_local(&mut bufs, w - 1, &streams)
        .map_err(|e| e.to_string())?;
    for (i, buf) in bufs.iter().enumerate() {
        same(
            &down(i, buf)?,
            &input((w - 1) * g),
            &format!("broadcast_local buffer {i}"),
        )?;
    }
    Ok(())
}

/// `op` over ranks `0..w` of `x(r)`, in f64.
fn reduce(op: ReduceOp, w: usize, x: impl Fn(usize) -> f64) -> f64 {
    let all = (0..w).map(&x);
    match op {
        ReduceOp::Sum => all.sum(),
        ReduceOp::Avg => all.sum::<f64>() / w as f64,
        ReduceOp::Max => all.fold(f64::MIN, f64::max),
        ReduceOp::Min => all.fold(f64::MAX, f64::min),
        ReduceOp::BXor => all.fold(0i64, |a, v| a ^ v as i64) as f64,
        other => panic!("no host form for {other}"),
    }
}

fn same<T: Exact>(got: &[T], want: &[T], what: &str) -> Outcome {
    if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
        return Err(format!(
            "WRONG: {what}: element {i} of {}: got {:?}, want {:?}",
            want.len(),
            got[i],
            want[i]
        ));
    }
    Ok(())
}

/// Median of `runs` timings of `f`, in seconds.
fn median(runs: usize, mut f: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[runs / 2])
}

fn bench(
    comm: &Communicator,
    dev: &CudaCommunicator,
    stream: &Arc<CudaStream>,
    mib: usize,
) -> Outcome {
    let (w, bytes) = (comm.world_size(), mib << 20);
    let n = bytes / 4;
    let cuda = |e: chorus::Error| e.to_string();
    let mut buf = stream
        .clone_htod(&vec![1.0f32; n])
        .map_err(|e| e.to_string())?;
    let mut copy = stream.alloc_zeros::<f32>(n).map_err(|e| e.to_string())?;
    let warm = 3;
    let runs = 15;
    for _ in 0..warm {
        dev.all_reduce(&mut buf, ReduceOp::Sum, stream)
            .map_err(cuda)?;
    }
    let device = median(runs, || {
        comm.barrier().map_err(cuda)?;
        dev.all_reduce(&mut buf, ReduceOp::Sum, stream)
            .map_err(cuda)
    })?;
    let mut host = vec![1.0f32; n];
    comm.all_reduce(&mut host, ReduceOp::Sum).map_err(cuda)?;
    let on_host = median(runs, || {
        comm.barrier().map_err(cuda)?;
        comm.all_reduce(&mut host, ReduceOp::Sum).map_err(cuda)
    })?;
    // The copy bandwidth of the device, each rank timing its copies alone.
    let mut copy_time = 0.0;
    for r in 0..w {
        comm.barrier().map_err(cuda)?;
        if r == comm.rank() {
            copy_time = median(runs, || {
                stream
                    .memcpy_dtod(&buf, &mut copy)
                    .map_err(|e| e.to_string())?;
                stream.synchronize().map_err(|e| e.to_string())
            })?;
        }
    }
    let bus = |t: f64| 2.0 * (w - 1) as f64 / w as f64 * bytes as f64 / t / 1e9;
    // Bytes the IPC all-reduce moves through device memory per rank, in units of the
    // buffer: the input into scratch (2), then on two ranks one pass over both inputs into
    // the output (3, or a copy of 2 on one rank); on more, reducing its slice (W - 1
    // passes of 3/W), the slice into scratch (2/W) and the other slices out (2/W each).
    let wf = w as f64;
    let units = match w {
        1 => 4.0,
        2 => 5.0,
        _ => 2.0 + (3.0 * (wf - 1.0) + 2.0 + 2.0 * (wf - 1.0)) / wf,
    };
    // Ranks sharing this rank's GPU (spread evenly over the GPUs) share its bandwidth.
    let gpus = Device::count().map_err(|e| e.to_string())?.max(1);
    let sharing = w.div_ceil(gpus) as f64;
    let copy_bw = 2.0 * bytes as f64 / copy_time;
    let floor = sharing * units * bytes as f64 / copy_bw;
    println!(
        "bench path={:?} W={w} MiB={mib} device_us={:.1} busbw={:.1} host_us={:.1} host_busbw={:.1} \
         copy_GBps={:.0} ranks_per_gpu={sharing} ipc_floor_us={:.1} ipc_of_floor={:.0}% staged_of_host={:.0}%",
        dev.path(),
        device * 1e6,
        bus(device),
        on_host * 1e6,
        bus(on_host),
        copy_bw / 1e9,
        floor * 1e6,
        floor / device * 100.0,
        on_host / device * 100.0,
    );
    Ok(())
}
