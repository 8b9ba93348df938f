//! What one host's memory itself allows, with no library in the way: the ceilings over the
//! shared-memory bandwidths of the perf tools, as `tcp_ceiling` gives them for TCP.
//!
//! A second process of this program (started with `--peer`) holds a 64 MiB buffer; this
//! one times, median of `-n` rounds:
//!
//! - `copy`: one `memcpy` of 64 MiB on one core, then one on each of two cores at once
//!   (this process and the peer), which shows how much the cores share the memory's rate.
//! - `read`: `process_vm_readv` of the peer's 64 MiB into this process, in pieces of
//!   64 KiB, 1 MiB and 4 MiB (each call pins and unpins the pages it copies).
//! - `split`: the same message copied by both cores at once, as Chorus's single-copy
//!   messages are when the sender has nothing else to do (a broadcast's root): this process
//!   reads the first half from the peer while the peer writes the second half into it.
//! - `relay`: the same message through a ring in shared memory shaped as the shared-memory
//!   transport's (8 slots of 128 KiB by default), as the transport moves it: the peer copies pieces in while this process
//!   copies them out, so each byte is copied twice, the second time from cache; copied out
//!   through the caches, then with streaming stores.
//! - `reduce`: one core sums 512 KiB pieces into a 64 MiB float buffer with Chorus's kernel,
//!   then into a 64 MiB output apart from a 64 MiB input (with streaming stores), as an
//!   out-of-place reduction writes it.
//! - `bound`: from those rates, the fastest a broadcast or an all-reduce of 64 MiB could run,
//!   each message moved the fastest way (`split` or `relay`, both of which keep both cores
//!   busy), the two cores sharing all the work (W ranks on two cores). A broadcast copies the
//!   message W-1 times; out of place, the root also copies its input to its output (at the
//!   `memcpy` rate of two cores at once). An all-reduce (ring or halving-doubling) copies
//!   2(W-1)/W of the buffer into each rank and sums (W-1)/W of it there, in place or, out of
//!   place, into the output apart from the input (at that rate). A pipeline's chunks,
//!   found in cache, can beat these.
//! - `meet`: a bare barrier of two and of four processes (this one and the others), each
//!   bumping its round counter on a page they share and polling the others' until all have
//!   caught up, giving its core away at every poll when the processes outnumber the cores:
//!   the floor under a W=2 and a W=4 barrier on this host, which Chorus's meeting of a
//!   single-host job makes with the same memory traffic and more bookkeeping. Two processes
//!   time one round trip of a cache line between two cores, which depends on where the
//!   host put this machine's cores (on one die or two) as much as on the processor.
//! - `syscall`: what entering the kernel costs here, the median of `-n` rounds of 200 000
//!   `getppid(2)` calls (the kernel does nothing else for it) and of `sched_yield(2)` with
//!   nothing else to run: what every message's send, receive and futex pay on top of their work.
//!
//! `cargo run --release -p chorus-tools --bin shm_ceiling [-- --hugepages]`

use std::fs::OpenOptions;
use std::io::{self, BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use std::time::Instant;

use chorus_kernels::copy_streaming;
use chorus_transport::shm::ShmConfig;
use clap::Parser;

/// Bytes of every buffer.
const LEN: usize = 64 << 20;

#[derive(Parser)]
#[command(about = "Ceilings of shared-memory copies on this machine")]
struct Args {
    /// Rounds of each measurement (the median is printed).
    #[arg(short = 'n', long, default_value_t = 7)]
    rounds: usize,
    /// Every buffer on transparent huge pages (`madvise(MADV_HUGEPAGE)`), as numpy
    /// allocates its arrays and the perf tools' `--hugepages` do.
    #[arg(long)]
    hugepages: bool,
    /// Rounds of the bare barrier timed, after as many again for warm-up.
    #[arg(long, default_value_t = 20_000)]
    meetings: usize,
    /// Run as the peer process (internal).
    #[arg(long, hide = true)]
    peer: bool,
    /// Run as rank N of the bare barrier (internal), on the page in `--meet-file`.
    #[arg(long, hide = true)]
    meet_rank: Option<usize>,
    /// Processes in the bare barrier (internal, with `--meet-rank`).
    #[arg(long, hide = true, default_value_t = 2)]
    meet_processes: usize,
    #[arg(long, hide = true)]
    meet_file: Option<std::path::PathBuf>,
}

/// Bytes between two processes' round counters (one cache line each).
const LINE: usize = 64;

/// Longest a process of the bare barrier waits for the others.
const PATIENCE: Duration = Duration::from_secs(30);

fn main() -> io::Result<()> {
    let args = Args::parse();
    if args.peer {
        return peer(args.hugepages);
    }
    if let (Some(rank), Some(path)) = (args.meet_rank, &args.meet_file) {
        println!("{}", meet(path, rank, args.meet_processes, args.meetings)?);
        return Ok(());
    }
    if args.rounds == 0 || args.meetings == 0 {
        eprintln!("shm_ceiling: -n and --meetings must be at least 1");
        std::process::exit(2);
    }
    let mut peer = Peer::start(args.hugepages)?;
    let src = buffer(1, args.hugepages);
    let mut dst = buffer(2, args.hugepages);
    let advice = match args.hugepages {
        true => "advised onto huge pages",
        false => "not advised",
    };
    let got = match chorus::pages::huge_bytes(&src) {
        Ok(bytes) => format!("{} MiB of the source on huge pages", bytes >> 20),
        Err(e) => format!("pages unknown: {e}"),
    };
    println!("buffers   64 MiB each, {advice}; {got}");
    let n = args.rounds;
    let rate = |seconds: f64| LEN as f64 / seconds / 1e9;
    let one = rate(median(n, || Ok(timed(|| dst.copy_from_slice(&src))))?);
    let two = rate(median(n, || {
        peer.ask("copy")?;
        let mine = timed(|| dst.copy_from_slice(&src));
        Ok(mine.max(peer.seconds()?))
    })?);
    println!("copy      memcpy of 64 MiB: {one:.2} GB/s on one core; {two:.2} GB/s per core on two at once");
    let mut read = Vec::new();
    for piece in [64 << 10, 1 << 20, 4 << 20] {
        let r = rate(median(n, || {
            let whole = peer.src..peer.src + LEN as u64;
            timed_io(|| copy(peer.pid, Way::Read, whole, &mut dst, piece))
        })?);
        println!(
            "read      process_vm_readv of 64 MiB in {} KiB pieces: {r:.2} GB/s",
            piece >> 10
        );
        read.push(r);
    }
    let half = LEN / 2;
    let mut split = Vec::new();
    for piece in [64 << 10, 1 << 20, 4 << 20] {
        let r = rate(median(n, || {
            let dst_at = dst.as_ptr() as u64 + half as u64;
            peer.ask(&format!("write {dst_at} {piece}"))?;
            let first = peer.src..peer.src + half as u64;
            let mine = timed_io(|| copy(peer.pid, Way::Read, first, &mut dst[..half], piece))?;
            Ok(mine.max(peer.seconds()?))
        })?);
        println!(
            "split     64 MiB copied by both cores at once, {} KiB pieces: {r:.2} GB/s",
            piece >> 10
        );
        split.push(r);
    }
    let ring_path = shm_path("relay");
    let relayed = Ring::create(&ring_path).and_then(|ring| {
        let mut relay = |streamed| {
            median(n, || {
                ring.reset();
                peer.ask(&format!("relay {}", ring_path.display()))?;
                let mine = ring.drain(&mut dst, streamed);
                peer.seconds()?;
                mine
            })
        };
        Ok([relay(false)?, relay(true)?])
    });
    // A failed measurement's error comes first; then the file's removal's.
    let removed = std::fs::remove_file(&ring_path);
    let [relay, streamed] = relayed?.map(rate);
    removed?;
    let (slots, slot) = Ring::shape();
    println!(
        "relay     64 MiB through {slots} slots of {} KiB in shared memory, copied in and out: {relay:.2} GB/s; {streamed:.2} copied out with streaming stores",
        slot >> 10
    );
    let best = split.iter().copied().fold(relay.max(streamed), f64::max);
    let summed = chorus_tools::reduce_rate(n, false);
    let summed_apart = chorus_tools::reduce_rate(n, true);
    println!(
        "reduce    float sum of 512 KiB pieces into 64 MiB: {summed:.2} GB/s on one core; {summed_apart:.2} into an output apart from the input"
    );
    // Core-seconds per byte: 2 / best for a message copied, 1 / two for a memcpy, 1 / summed
    // for a byte summed; the two cores (those `split` and `two` measured) share them.
    for w in [2.0, 4.0] {
        let in_place = best / (w - 1.0);
        let out_of_place = 2.0 / ((w - 1.0) * 2.0 / best + 1.0 / two);
        println!(
            "bound     W={w} broadcast of 64 MiB on two cores: busbw <= {in_place:.2} GB/s in place, {out_of_place:.2} out of place"
        );
    }
    for w in [2.0, 4.0] {
        // Per byte of bus bandwidth each rank copies one byte in and sums half of one.
        let bound = |summed: f64| 2.0 / (w * (2.0 / best + 0.5 / summed));
        println!(
            "bound     W={w} all-reduce of 64 MiB on two cores: busbw <= {:.2} GB/s in place, {:.2} out of place",
            bound(summed),
            bound(summed_apart)
        );
    }
    peer.finish()?;
    for processes in [2, 4] {
        let us = meeting(processes, args.meetings)?;
        println!(
            "meet      W={processes} processes, a bare barrier on one shared page: {us:.2} us per round"
        );
    }
    // SAFETY: getppid takes no arguments and touches no memory.
    let getppid = median(n, || Ok(per_call(|| unsafe { libc::getppid() })))?;
    // SAFETY: as getppid.
    let yield_ = median(n, || Ok(per_call(|| unsafe { libc::sched_yield() })))?;
    println!(
        "syscall   one call into the kernel: getppid {:.0} ns, sched_yield {:.0} ns",
        getppid * 1e9,
        yield_ * 1e9
    );
    Ok(())
}

/// Seconds per call of `f`, over 200 000 calls.
fn per_call(mut f: impl FnMut() -> libc::c_int) -> f64 {
    const CALLS: u32 = 200_000;
    let start = Instant::now();
    for _ in 0..CALLS {
        std::hint::black_box(f());
    }
    start.elapsed().as_secs_f64() / f64::from(CALLS)
}

/// The peer process, answering this program's requests on stdin with seconds on stdout.
fn peer(hugepages: bool) -> io::Result<()> {
    let src = buffer(3, hugepages);
    let mut dst = buffer(4, hugepages);
    let mut out = io::stdout().lock();
    writeln!(out, "{} {}", std::process::id(), src.as_ptr() as u64)?;
    out.flush()?;
    for line in io::stdin().lock().lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let seconds = match words[..] {
            ["copy"] => timed(|| dst.copy_from_slice(&src)),
            ["write", at, piece] => {
                let (at, piece) = (number(at)?, number(piece)? as usize);
                let parent = std::os::unix::process::parent_id();
                let half = LEN / 2;
                // What the peer writes does not matter: `dst` is as big, and writable here.
                let second = &mut dst[half..];
                timed_io(|| copy(parent, Way::Write, at..at + half as u64, second, piece))?
            }
            ["relay", path] => {
                let ring = Ring::open(std::path::Path::new(path))?;
                timed_io(|| ring.fill(&src))?
            }
            ["exit"] => return Ok(()),
            _ => return Err(io::Error::other(format!("unknown request {line:?}"))),
        };
        writeln!(out, "{seconds}")?;
        out.flush()?;
    }
    Ok(())
}

/// Microseconds per round of the bare barrier, the slowest process's: this one is rank 0,
/// and starts the others on a fresh file in `/dev/shm`.
fn meeting(processes: usize, rounds: usize) -> io::Result<f64> {
    let path = shm_path("meet");
    let outcome =
        create_shared(&path, processes * LINE).and_then(|_| meet_all(&path, processes, rounds));
    // Rank 0 removed the name once all had mapped the page, unless something failed first.
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => outcome,
    }
}

/// Starts ranks 1.. of the bare barrier on the page at `path`, takes part as rank 0, and
/// returns the slowest rank's microseconds per round.
fn meet_all(path: &std::path::Path, processes: usize, rounds: usize) -> io::Result<f64> {
    let mut others = Vec::new();
    let spawned = (1..processes).try_for_each(|rank| {
        let child = Command::new(std::env::current_exe()?)
            .args(["--meet-rank", &rank.to_string()])
            .args(["--meet-processes", &processes.to_string()])
            .args(["--meetings", &rounds.to_string()])
            .arg("--meet-file")
            .arg(path)
            .stdout(Stdio::piped())
            .spawn()?;
        others.push(child);
        Ok(())
    });
    let mine = spawned.and_then(|()| meet(path, 0, processes, rounds));
    let mut slowest = match mine {
        Ok(us) => us,
        Err(e) => {
            for mut child in others {
                child.kill().ok();
                child.wait().ok();
            }
            return Err(e);
        }
    };
    for child in others {
        let out = child.wait_with_output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let us: f64 = text
            .trim()
            .parse()
            .map_err(|_| io::Error::other(format!("a barrier process answered {text:?}")))?;
        slowest = slowest.max(us);
    }
    Ok(slowest)
}

/// Rank `rank`'s part in `rounds` timed rounds (after as many untimed) of the bare barrier on
/// the page in `path`; microseconds per round.
fn meet(path: &std::path::Path, rank: usize, processes: usize, rounds: usize) -> io::Result<f64> {
    let file = OpenOptions::new().read(true).write(true).open(path)?;
    // Raw: the page is only ever reached through pointers to atomics (below), never as bytes.
    let map = memmap2::MmapRaw::map_raw(&file)?;
    if map.len() < processes * LINE {
        return Err(io::Error::other("the barrier's page is too short"));
    }
    // SAFETY: the mapping is page-aligned, lives as long as `map` and holds `processes` lines,
    // each starting with a u64 that every process changes only atomically.
    let counter = |r: usize| unsafe { &*map.as_mut_ptr().add(r * LINE).cast::<AtomicU64>() };
    // With more processes than cores, a waiter gives its core away at every look, as the
    // process it waits for may need it.
    let crowded = processes > std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut start = Instant::now();
    for round in 1..=2 * rounds as u64 {
        if round == rounds as u64 + 1 {
            start = Instant::now();
        }
        counter(rank).store(round, Ordering::Release);
        let since = Instant::now();
        for r in 0..processes {
            while counter(r).load(Ordering::Acquire) < round {
                if since.elapsed() > PATIENCE {
                    return Err(io::Error::other(format!("barrier rank {r} did not come")));
                }
                std::hint::spin_loop();
                if crowded {
                    std::thread::yield_now();
                }
            }
        }
        // Every process has mapped the page: its name is no longer needed.
        if round == 1 && rank == 0 {
            std::fs::remove_file(path)?;
        }
    }
    Ok(start.elapsed().as_secs_f64() * 1e6 / rounds as f64)
}

/// A fresh name in `/dev/shm` for this process's `what`.
fn shm_path(what: &str) -> std::path::PathBuf {
    format!("/dev/shm/chorus-shm-ceiling-{what}-{}", std::process::id()).into()
}

/// A new file of `len` bytes at `path` (which must not exist yet), for processes to map.
fn create_shared(path: &std::path::Path, len: usize) -> io::Result<std::fs::File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)?;
    file.set_len(len as u64)?;
    Ok(file)
}

/// The relay's ring in a file both processes map, shaped as the shared-memory transport's
/// rings are by default: the writer's count of slots filled and the reader's count of
/// slots emptied, a line each, then the slots.
struct Ring {
    map: memmap2::MmapRaw,
    slots: usize,
    slot: usize,
}

impl Ring {
    const FILLED: usize = 0;
    const EMPTIED: usize = LINE;
    const SLOTS_AT: usize = 2 * LINE;

    /// The transport's default ring: slots and bytes per slot.
    fn shape() -> (usize, usize) {
        let config = ShmConfig::default();
        (config.slots, config.slot_bytes)
    }

    fn create(path: &std::path::Path) -> io::Result<Ring> {
        let (slots, slot) = Self::shape();
        create_shared(path, Self::SLOTS_AT + slots * slot)?;
        Self::open(path)
    }

    fn open(path: &std::path::Path) -> io::Result<Ring> {
        let (slots, slot) = Self::shape();
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let map = memmap2::MmapRaw::map_raw(&file)?;
        if map.len() < Self::SLOTS_AT + slots * slot {
            return Err(io::Error::other("the relay's ring is too short"));
        }
        Ok(Ring { map, slots, slot })
    }

    fn count(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is one of the two counters' offsets, 8-aligned inside the page-aligned
        // mapping `open` checked; both processes change them only atomically.
        unsafe { &*self.map.as_mut_ptr().add(at).cast::<AtomicU64>() }
    }

    fn slot(&self, k: usize) -> *mut u8 {
        // SAFETY: slot `k % slots` lies inside the mapping (checked in `open`).
        unsafe {
            self.map
                .as_mut_ptr()
                .add(Self::SLOTS_AT + (k % self.slots) * self.slot)
        }
    }

    fn reset(&self) {
        self.count(Self::FILLED).store(0, Ordering::Release);
        self.count(Self::EMPTIED).store(0, Ordering::Release);
    }

    /// The writer: copies `src` into the slots as the reader frees them.
    fn fill(&self, src: &[u8]) -> io::Result<()> {
        for (k, piece) in src.chunks(self.slot).enumerate() {
            let free =
                || self.count(Self::EMPTIED).load(Ordering::Acquire) + self.slots as u64 > k as u64;
            wait_for(free, "the relay's reader")?;
            // SAFETY: the slot holds `slot` >= piece.len() bytes and the reader is done with
            // it (its count of emptied slots passed it); it reads it only after the store below.
            unsafe { std::ptr::copy_nonoverlapping(piece.as_ptr(), self.slot(k), piece.len()) };
            self.count(Self::FILLED)
                .store(k as u64 + 1, Ordering::Release);
        }
        Ok(())
    }

    /// The reader: copies the slots out into `dst` as the writer fills them; seconds from the
    /// first slot's arrival to the last one's copy.
    fn drain(&self, dst: &mut [u8], streamed: bool) -> io::Result<f64> {
        let mut start = None;
        for (k, piece) in dst.chunks_mut(self.slot).enumerate() {
            wait_for(
                || self.count(Self::FILLED).load(Ordering::Acquire) > k as u64,
                "the relay's writer",
            )?;
            start.get_or_insert_with(Instant::now);
            // SAFETY: the writer filled the slot (its count passed it) and leaves it alone
            // until the store below frees it.
            let filled = unsafe { std::slice::from_raw_parts(self.slot(k), piece.len()) };
            match streamed {
                true => copy_streaming(piece, filled).expect("equal lengths"),
                false => piece.copy_from_slice(filled),
            }
            self.count(Self::EMPTIED)
                .store(k as u64 + 1, Ordering::Release);
        }
        Ok(start.map_or(0.0, |s| s.elapsed().as_secs_f64()))
    }
}

/// Spins until `ready`, failing after `PATIENCE`.
fn wait_for(ready: impl Fn() -> bool, whom: &str) -> io::Result<()> {
    let since = Instant::now();
    while !ready() {
        if since.elapsed() > PATIENCE {
            return Err(io::Error::other(format!("{whom} did not come")));
        }
        std::hint::spin_loop();
    }
    Ok(())
}

/// The peer process as this one sees it: its pid, its buffer's address, its pipes.
struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pid: u32,
    src: u64,
}

impl Peer {
    fn start(hugepages: bool) -> io::Result<Peer> {
        let mut child = Command::new(std::env::current_exe()?)
            .arg("--peer")
            .args(hugepages.then_some("--hugepages"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take().expect("piped");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        let mut hello = String::new();
        stdout.read_line(&mut hello)?;
        let mut words = hello.split_whitespace();
        let pid = number(words.next().unwrap_or(""))? as u32;
        let src = number(words.next().unwrap_or(""))?;
        Ok(Peer {
            child,
            stdin,
            stdout,
            pid,
            src,
        })
    }

    fn ask(&mut self, request: &str) -> io::Result<()> {
        writeln!(self.stdin, "{request}")?;
        self.stdin.flush()
    }

    /// The seconds the peer's last request took.
    fn seconds(&mut self) -> io::Result<f64> {
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        line.trim()
            .parse()
            .map_err(|_| io::Error::other(format!("the peer answered {line:?}")))
    }

    fn finish(mut self) -> io::Result<()> {
        self.ask("exit")?;
        self.child.wait()?;
        Ok(())
    }
}

/// Which way a copy between processes goes.
#[derive(Clone, Copy)]
enum Way {
    /// From the other process into `local`.
    Read,
    /// From `local` into the other process.
    Write,
}

/// Copies between `local` and the other process's `remote` range, `piece` bytes per call.
fn copy(
    pid: u32,
    way: Way,
    remote: std::ops::Range<u64>,
    local: &mut [u8],
    piece: usize,
) -> io::Result<()> {
    assert_eq!(remote.end - remote.start, local.len() as u64);
    for (k, part) in local.chunks_mut(piece).enumerate() {
        let here = libc::iovec {
            iov_base: part.as_mut_ptr().cast(),
            iov_len: part.len(),
        };
        let there = libc::iovec {
            iov_base: (remote.start + (k * piece) as u64) as *mut libc::c_void,
            iov_len: part.len(),
        };
        // SAFETY: `here` is memory this process owns for the call; the kernel checks
        // `there` against the other process's mappings and fails rather than fault.
        let n = unsafe {
            match way {
                Way::Read => libc::process_vm_readv(pid as i32, &here, 1, &there, 1, 0),
                Way::Write => libc::process_vm_writev(pid as i32, &here, 1, &there, 1, 0),
            }
        };
        if n != part.len() as isize {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// `LEN` bytes of `fill`; with `huge_pages`, advised onto transparent huge pages before
/// anything touches them (zeroed memory this big comes fresh from the kernel).
fn buffer(fill: u8, huge_pages: bool) -> Vec<u8> {
    let mut v = vec![0u8; LEN];
    if huge_pages {
        chorus::pages::advise_huge(&v);
    }
    v.fill(fill);
    v
}

fn number(word: &str) -> io::Result<u64> {
    word.parse()
        .map_err(|_| io::Error::other(format!("not a number: {word:?}")))
}

fn timed(f: impl FnOnce()) -> f64 {
    let start = Instant::now();
    f();
    start.elapsed().as_secs_f64()
}

fn timed_io(f: impl FnOnce() -> io::Result<()>) -> io::Result<f64> {
    let start = Instant::now();
    f()?;
    Ok(start.elapsed().as_secs_f64())
}

/// The median of `n` samples (one more, first, for warm-up).
fn median(n: usize, mut sample: impl FnMut() -> io::Result<f64>) -> io::Result<f64> {
    sample()?;
    let samples = (0..n.max(1)).map(|_| sample()).collect::<io::Result<_>>()?;
    Ok(chorus_tools::median(samples))
}
