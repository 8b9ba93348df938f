//! What loopback TCP itself allows on this machine, with no library in the way: the floor
//! under the perf tools' small-call times and the ceiling over their bandwidths.
//!
//! - `exchange`: W threads (2, then `-np`) in a full mesh of TCP_NODELAY sockets swap a
//!   48-byte frame (a Chorus header and 8 bytes) with rank XOR 2^k in each of log2(W)
//!   rounds, as a recursive-doubling all-reduce of 8 bytes does, waiting as Chorus's waiters
//!   do. Threads switch a little more cheaply than processes, so this floor is, if anything,
//!   optimistic.
//! - `stream`: one socket carries a 1 MiB buffer, which stays in cache (what `iperf3`
//!   measures), then a 64 MiB buffer into another (both far larger than the caches, as in a
//!   64 MiB collective), timing each end's CPU as well.
//! - `reduce`: one core sums 512 KiB pieces (just received, so in cache) into a 64 MiB float
//!   buffer with Chorus's kernel, as an all-reduce's receive-and-reduce steps do.
//! - `bound`: from those CPU costs, the most bus bandwidth a ring or halving-doubling
//!   all-reduce of 64 MiB could reach here, first counting only its kernel copies (reducing
//!   for free), then its reductions too; each rank keeps at most one core busy (as when ranks
//!   outnumber or equal the cores; softirq work charged elsewhere and memory contention only
//!   lower it); for a chain broadcast of 64 MiB, whose every byte is sent and received once
//!   on each of its W-1 links; and for a W=2 out-of-place broadcast, whose root also copies
//!   its input to its output (at `copy`'s rate, as the output is never in cache), at best on
//!   a thread of its own. Each bound comes from the 64 MiB stream's costs (cold: every copy
//!   from memory) and from the 1 MiB stream's (warm: every copy in cache, as a pipeline's
//!   chunk is when it is sent just after it arrived).
//! - `broadcast`: a bare W=2 broadcast of 64 MiB, written and read in 512 KiB pieces (the
//!   pipeline chunk); in place, and out of place, where the root also copies each piece of
//!   its input to its output just after writing it (so while it is still in cache).
//! - `chain`: a bare in-place broadcast of 64 MiB along a chain of `-np` ranks (W > 2), in
//!   512 KiB pieces, each relay with a thread that reads pieces from the rank before and
//!   one that sends each piece on as soon as it is read, so pieces are in flight on every
//!   link at once.
//!
//! `cargo run --release -p chorus-tools --bin tcp_ceiling -- -np 4`

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;

/// How long a reader polls before it sleeps.
const SPIN: Duration = Duration::from_micros(50);

/// Longest a socket read or write waits.
const PATIENCE: Duration = Duration::from_secs(60);

/// Bytes of one exchanged frame: a Chorus TCP header (40) and an 8-byte payload.
const FRAME: usize = 48;

#[derive(Parser)]
#[command(about = "Floor and ceiling of loopback TCP on this machine")]
struct Args {
    /// Threads in the exchange (a power of two).
    #[arg(long = "np", default_value_t = 2)]
    world: usize,
    /// Exchanges timed, after as many again for warm-up.
    #[arg(short = 'n', long, default_value_t = 20_000)]
    iters: usize,
    /// Large-buffer transfers timed (the median is printed).
    #[arg(long, default_value_t = 7)]
    streams: usize,
}

fn main() -> io::Result<()> {
    // mpirun's spelling, `-np W`, as the perf tools accept it.
    let args = Args::parse_from(std::env::args().map(|a| match a.as_str() {
        "-np" => "--np".to_string(),
        _ => a,
    }));
    if !args.world.is_power_of_two() || args.world < 2 {
        eprintln!(
            "tcp_ceiling: -np must be a power of two of at least 2, not {}",
            args.world
        );
        std::process::exit(2);
    }
    if args.iters == 0 || args.streams == 0 {
        eprintln!("tcp_ceiling: -n and --streams must be at least 1");
        std::process::exit(2);
    }
    let worlds = if args.world == 2 {
        vec![2]
    } else {
        vec![2, args.world]
    };
    for &w in &worlds {
        let us = exchange(w, args.iters)?;
        println!("exchange  W={w}  48 B frames, log2(W) rounds: {us:.2} us per call");
    }
    let hot = stream(1 << 20, 200)?;
    println!(
        "stream    one socket, 1 MiB buffers (in cache): {:.2} GB/s; a core sends {:.2} GB/s, receives {:.2} GB/s",
        hot.rate, hot.send_core, hot.recv_core
    );
    let cold = stream(64 << 20, args.streams)?;
    println!(
        "stream    one socket, 64 MiB buffers: {:.2} GB/s; a core sends {:.2} GB/s, receives {:.2} GB/s",
        cold.rate, cold.send_core, cold.recv_core
    );
    let in_place = broadcast(64 << 20, 512 << 10, args.streams, false)?;
    let out_of_place = broadcast(64 << 20, 512 << 10, args.streams, true)?;
    println!(
        "broadcast W=2 of 64 MiB in 512 KiB pieces: {in_place:.2} GB/s in place, {out_of_place:.2} out of place"
    );
    if args.world > 2 {
        let rate = chain(args.world, 64 << 20, 512 << 10, args.streams)?;
        println!(
            "chain     broadcast W={} of 64 MiB in 512 KiB pieces, relays reading and sending on threads of their own: {rate:.2} GB/s",
            args.world
        );
    }
    let summed = chorus_tools::reduce_rate(args.streams, false);
    println!("reduce    float sum of 512 KiB pieces into 64 MiB: {summed:.2} GB/s on one core");
    let copied = copy_rate(64 << 20, args.streams);
    println!("copy      memcpy of 64 MiB: {copied:.2} GB/s on one core");
    // A ring or halving-doubling all-reduce sends and receives 2(W-1)/W of the buffer per
    // rank and reduces (W-1)/W of it: W ranks' worth of that work shared by the cores (one
    // per rank at most). Per byte of bus bandwidth, a rank spends 1/send + 1/recv on copies
    // and 1/(2 reduce) on sums.
    let cores = thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    // Cold: every copy streams from memory. Warm: every copy finds its bytes in cache, as
    // a pipeline's do when each chunk is sent or reduced just after it arrived (so a
    // pipelined collective lands between the two).
    for &w in &worlds {
        let bound = |s: &Stream, sums: bool| {
            let per_byte = 1.0 / s.send_core + 1.0 / s.recv_core + f64::from(sums) * 0.5 / summed;
            cores.min(w as f64) / (w as f64 * per_byte)
        };
        println!(
            "bound     all-reduce W={w} of 64 MiB on {cores} cores: busbw <= {:.2} GB/s cold, {:.2} warm; {:.2} and {:.2} counting the sums",
            bound(&cold, false),
            bound(&hot, false),
            bound(&cold, true),
            bound(&hot, true)
        );
    }
    // No pass over the bytes goes faster than one core does it, and at most `threads` cores
    // share all the passes: `passes` GB/s rates, each made `times` over.
    let busiest = |passes: &[f64], times: f64, threads: f64| {
        let per_byte: f64 = passes.iter().map(|rate| times / rate).sum();
        passes
            .iter()
            .fold(cores.min(threads) / per_byte, |b, &r| b.min(r))
    };
    for &w in &worlds {
        // One core per rank at most, as for the all-reduce.
        let chain = |s: &Stream| busiest(&[s.send_core, s.recv_core], (w - 1) as f64, w as f64);
        println!(
            "bound     broadcast W={w} of 64 MiB: busbw <= {:.2} GB/s cold, {:.2} warm",
            chain(&cold),
            chain(&hot)
        );
    }
    // The root's sender and its copy on threads of their own, and the receiver.
    let out_of_place = |s: &Stream| busiest(&[s.send_core, s.recv_core, copied], 1.0, 3.0);
    println!(
        "bound     out-of-place broadcast W=2 of 64 MiB: busbw <= {:.2} GB/s cold, {:.2} warm",
        out_of_place(&cold),
        out_of_place(&hot)
    );
    Ok(())
}

/// GB/s one core copies a `len`-byte buffer into another, median of `reps` copies after one
/// that warms both up.
fn copy_rate(len: usize, reps: usize) -> f64 {
    let from = vec![3u8; len];
    let mut into = vec![0u8; len];
    let mut once = || {
        let start = Instant::now();
        into.copy_from_slice(std::hint::black_box(&from));
        std::hint::black_box(&into);
        len as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    once();
    chorus_tools::median((0..reps).map(|_| once()).collect())
}

/// A full mesh of connected loopback sockets: `mesh[r][p]` joins rank `r` to rank `p`.
fn mesh(world: usize) -> io::Result<Vec<Vec<Option<TcpStream>>>> {
    let mut mesh: Vec<Vec<Option<TcpStream>>> = (0..world)
        .map(|_| (0..world).map(|_| None).collect())
        .collect();
    for (r, p) in (0..world).flat_map(|r| (r + 1..world).map(move |p| (r, p))) {
        let (a, b) = pair()?;
        mesh[r][p] = Some(a);
        mesh[p][r] = Some(b);
    }
    Ok(mesh)
}

/// Two ends of one loopback connection, without Nagle's delay.
fn pair() -> io::Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let a = TcpStream::connect(listener.local_addr()?)?;
    let (b, _) = listener.accept()?;
    for s in [&a, &b] {
        s.set_nodelay(true)?;
        // A peer thread that failed leaves the other's reads and writes to time out.
        s.set_read_timeout(Some(PATIENCE))?;
        s.set_write_timeout(Some(PATIENCE))?;
    }
    Ok((a, b))
}

/// Microseconds per recursive-doubling exchange among `world` threads.
fn exchange(world: usize, iters: usize) -> io::Result<f64> {
    let threads: Vec<_> = mesh(world)?
        .into_iter()
        .enumerate()
        .map(|(rank, socks)| {
            thread::spawn(move || -> io::Result<f64> {
                for s in socks.iter().flatten() {
                    s.set_nonblocking(true)?;
                }
                let mut frame = [rank as u8; FRAME];
                let mut start = Instant::now();
                for i in 0..2 * iters {
                    if i == iters {
                        start = Instant::now();
                    }
                    let mut dist = 1;
                    while dist < world {
                        let mut sock = socks[rank ^ dist].as_ref().expect("a mesh socket");
                        sock.write_all(&frame)?;
                        read_spinning(&mut sock, &mut frame)?;
                        dist *= 2;
                    }
                }
                Ok(start.elapsed().as_secs_f64() * 1e6 / iters as f64)
            })
        })
        .collect();
    let mut worst: f64 = 0.0;
    for t in threads {
        worst = worst.max(t.join().expect("exchange thread")?);
    }
    Ok(worst)
}

/// Fills `buf` from a non-blocking socket, yielding the core while nothing has arrived, and
/// after 50 us sleeping in a blocking read (as Chorus's waiters do; spinning alone can leave
/// the thread that would send stuck behind spinning ones).
fn read_spinning(sock: &mut &TcpStream, buf: &mut [u8]) -> io::Result<()> {
    let start = Instant::now();
    let mut got = 0;
    while got < buf.len() {
        match sock.read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() != io::ErrorKind::WouldBlock => return Err(e),
            Err(_) if start.elapsed() < SPIN => thread::yield_now(),
            Err(_) => {
                sock.set_nonblocking(false)?;
                let n = sock.read(&mut buf[got..]);
                sock.set_nonblocking(true)?;
                match n? {
                    0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                    n => got += n,
                }
            }
        }
    }
    Ok(())
}

/// One socket's throughput, and what moving a byte through it costs each end's core.
struct Stream {
    /// Median GB/s over the timed transfers.
    rate: f64,
    /// Bytes per CPU-second spent by the sending thread (the kernel's send path, and on
    /// loopback its delivery too) and by the receiving thread.
    send_core: f64,
    recv_core: f64,
}

/// Times `reps` transfers of a `len`-byte buffer over one socket.
fn stream(len: usize, reps: usize) -> io::Result<Stream> {
    let (mut tx, mut rx) = pair()?;
    let receiver = thread::spawn(move || -> io::Result<f64> {
        let mut buf = vec![0u8; len];
        let mut cpu = 0.0;
        for rep in 0..=reps {
            let start = thread_cpu();
            rx.read_exact(&mut buf)?;
            if rep > 0 {
                cpu += thread_cpu() - start;
            }
            rx.write_all(&[1])?;
        }
        Ok(cpu)
    });
    let data = vec![7u8; len];
    let (mut rates, mut cpu) = (Vec::with_capacity(reps), 0.0);
    for rep in 0..=reps {
        let (start, start_cpu) = (Instant::now(), thread_cpu());
        tx.write_all(&data)?;
        tx.read_exact(&mut [0u8; 1])?;
        // The first transfer warms the connection up.
        if rep > 0 {
            rates.push(len as f64 / start.elapsed().as_secs_f64() / 1e9);
            cpu += thread_cpu() - start_cpu;
        }
    }
    let recv_cpu = receiver.join().expect("stream receiver")?;
    let bytes = (len * reps) as f64;
    Ok(Stream {
        rate: chorus_tools::median(rates),
        send_core: bytes / cpu / 1e9,
        recv_core: bytes / recv_cpu / 1e9,
    })
}

/// GB/s of a bare W=2 broadcast of `len` bytes over one socket, written and read in
/// `piece`-byte parts; with `copy`, the root copies each part of its input to its output
/// just after writing it. Median of `reps` broadcasts after one that warms up.
fn broadcast(len: usize, piece: usize, reps: usize, copy: bool) -> io::Result<f64> {
    let (mut tx, mut rx) = pair()?;
    let receiver = thread::spawn(move || -> io::Result<()> {
        let mut buf = vec![0u8; len];
        for _ in 0..=reps {
            for part in buf.chunks_mut(piece) {
                rx.read_exact(part)?;
            }
            rx.write_all(&[1])?;
        }
        Ok(())
    });
    let input = vec![7u8; len];
    let mut output = vec![0u8; if copy { len } else { 0 }];
    let mut rates = Vec::with_capacity(reps);
    for rep in 0..=reps {
        let start = Instant::now();
        // Without `copy` the output is empty and nothing is copied.
        let mut outputs = output.chunks_mut(piece);
        for part in input.chunks(piece) {
            tx.write_all(part)?;
            if let Some(into) = outputs.next() {
                into.copy_from_slice(part);
            }
        }
        tx.read_exact(&mut [0u8; 1])?;
        // The first broadcast warms the connection up.
        if rep > 0 {
            rates.push(len as f64 / start.elapsed().as_secs_f64() / 1e9);
        }
    }
    receiver.join().expect("broadcast receiver")?;
    Ok(chorus_tools::median(rates))
}

/// GB/s of a bare broadcast of `len` bytes from rank 0 along a chain of `world` ranks, in
/// `piece`-byte parts (see [`relay`]); the last rank tells the root when it has everything.
/// Median of `reps` broadcasts after one that warms up.
fn chain(world: usize, len: usize, piece: usize, reps: usize) -> io::Result<f64> {
    let (done, mut finished) = pair()?;
    let (mut root, mut from) = pair()?;
    let mut ranks = Vec::new();
    for _ in 2..world {
        let (to, next) = pair()?;
        ranks.push(thread::spawn(move || {
            relay(from, Link::Next(to), len, piece, reps)
        }));
        from = next;
    }
    ranks.push(thread::spawn(move || {
        relay(from, Link::Root(done), len, piece, reps)
    }));
    let input = vec![7u8; len];
    let mut rates = Vec::with_capacity(reps);
    for rep in 0..=reps {
        let start = Instant::now();
        for part in input.chunks(piece) {
            root.write_all(part)?;
        }
        finished.read_exact(&mut [0u8; 1])?;
        if rep > 0 {
            rates.push(len as f64 / start.elapsed().as_secs_f64() / 1e9);
        }
    }
    for rank in ranks {
        rank.join().expect("chain rank")?;
    }
    Ok(chorus_tools::median(rates))
}

/// Where a chain rank's bytes go: on to the next rank, or (the last) a byte to the root.
enum Link {
    Next(TcpStream),
    Root(TcpStream),
}

/// One non-root rank of [`chain`]: receives `reps + 1` broadcasts of `len` bytes from `from`
/// into its own `len` bytes, part by part. A relay's sender thread writes each part to the
/// next rank as soon as it has been read; the last rank acknowledges each broadcast.
fn relay(mut from: TcpStream, to: Link, len: usize, piece: usize, reps: usize) -> io::Result<()> {
    let parts = len.div_ceil(piece);
    // The rank's buffer, as parts that go round: read, sent on, free again.
    let (free, freed) = mpsc::channel::<Vec<u8>>();
    for _ in 0..parts {
        free.send(vec![0u8; piece]).expect("the pool is open");
    }
    let (read, sending) = mpsc::channel::<Vec<u8>>();
    let (sender, mut done) = match to {
        Link::Next(mut next) => {
            let free = free.clone();
            let sender = thread::spawn(move || -> io::Result<()> {
                for part in sending.iter() {
                    next.write_all(&part)?;
                    // The reader only stops taking parts once it has failed.
                    let _ = free.send(part);
                }
                Ok(())
            });
            (Some(sender), None)
        }
        Link::Root(done) => (None, Some(done)),
    };
    for _ in 0..=reps {
        for _ in 0..parts {
            let mut part = freed.recv().expect("a free part");
            from.read_exact(&mut part)?;
            let back = if sender.is_some() { &read } else { &free };
            back.send(part).expect("the part's next holder runs");
        }
        if let Some(done) = done.as_mut() {
            done.write_all(&[1])?;
        }
    }
    drop(read);
    match sender {
        Some(sender) => sender.join().expect("chain sender"),
        None => Ok(()),
    }
}

/// CPU seconds the calling thread has used.
fn thread_cpu() -> f64 {
    chorus_tools::cpu_seconds(libc::CLOCK_THREAD_CPUTIME_ID)
}
