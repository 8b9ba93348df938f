//! NCCL's C API on host memory, called as a C program calls it: ranks are threads of this
//! process (one thread driving every rank inside a group, as `ncclCommInitAll` programs do,
//! or one thread a rank), every value checked exactly.

// Every unsafe block calls the C API with handles and buffers the test owns for the call
// (or its group), as NCCL's rules ask.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::ffi::{c_int, c_void, CStr};
use std::ptr::{null, null_mut};
use std::time::{Duration, Instant};

use nccl::abi::{NcclResult, UniqueId, API_MAGIC, UNDEF_INT, UNIQUE_ID_BYTES};
use nccl::api::*;
use nccl::comm::Comm;

const INT32: c_int = 2;
const FLOAT32: c_int = 7;
const FLOAT64: c_int = 8;
const FP8: c_int = 10;
const SUM: c_int = 0;
const PROD: c_int = 1;
const MAX: c_int = 2;
const MIN: c_int = 3;
const AVG: c_int = 4;

/// `n` ranks of one communicator, made by `ncclCommInitAll`.
struct Ranks(Vec<*mut Comm>);

impl Ranks {
    fn new(n: usize) -> Ranks {
        let mut comms = vec![null_mut(); n];
        assert_eq!(
            unsafe { ncclCommInitAll(comms.as_mut_ptr(), n as c_int, null()) },
            NcclResult::Success,
            "{}",
            last()
        );
        Ranks(comms)
    }

    /// Runs `call(rank, comm)` for every rank inside one group, as one thread driving them.
    fn group(&self, mut call: impl FnMut(usize, *mut Comm) -> NcclResult) {
        assert_eq!(ncclGroupStart(), NcclResult::Success);
        for (rank, &comm) in self.0.iter().enumerate() {
            assert_eq!(
                call(rank, comm),
                NcclResult::Success,
                "rank {rank}: {}",
                last()
            );
        }
        assert_eq!(ncclGroupEnd(), NcclResult::Success, "{}", last());
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in self.0.drain(..).filter(|c| !c.is_null()) {
            assert_eq!(unsafe { ncclCommDestroy(c) }, NcclResult::Success);
        }
    }
}

fn last() -> String {
    // SAFETY: the library returns a C string.
    unsafe { CStr::from_ptr(ncclGetLastError(null_mut())) }
        .to_string_lossy()
        .into_owned()
}

fn ptr<T>(v: &[T]) -> *const c_void {
    v.as_ptr().cast()
}

fn mut_ptr<T>(v: &mut [T]) -> *mut c_void {
    v.as_mut_ptr().cast()
}

/// Rank r's element i: small integers, exact in every type and operator.
fn value(rank: usize, i: usize) -> f64 {
    ((rank * 3 + i) % 5 + 1) as f64
}

#[test]
fn the_version_and_the_texts_are_nccls() {
    let mut v = 0;
    assert_eq!(unsafe { ncclGetVersion(&mut v) }, NcclResult::Success);
    assert_eq!(v, 23007);
    assert_eq!(
        unsafe { ncclGetVersion(null_mut()) },
        NcclResult::InvalidArgument
    );
    assert!(
        last().contains("ncclGetVersion: version is NULL"),
        "{}",
        last()
    );
    // SAFETY: the library returns C strings.
    let text = |r| {
        unsafe { CStr::from_ptr(ncclGetErrorString(r)) }
            .to_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(text(0), "no error");
    assert!(text(6).starts_with("remote process exited"));
    assert_eq!(text(42), "unknown result code");
}

#[test]
fn every_collective_gives_exact_values_at_every_width() {
    for n in 1..=4 {
        let ranks = Ranks::new(n);
        for rank in 0..n {
            let (mut count, mut me) = (0, 0);
            assert_eq!(
                unsafe { ncclCommCount(ranks.0[rank], &mut count) },
                NcclResult::Success
            );
            assert_eq!(
                unsafe { ncclCommUserRank(ranks.0[rank], &mut me) },
                NcclResult::Success
            );
            assert_eq!((count, me), (n as c_int, rank as c_int));
        }
        all_reduce(&ranks);
        broadcast_and_reduce(&ranks);
        gathers_and_scatters(&ranks);
        sends_and_receives(&ranks);
    }
}

#[test]
fn destroying_rank_0_first_waits_for_no_rank_of_this_process() {
    let mut ranks = Ranks::new(3);
    all_reduce(&ranks);
    // Rank 0 hosts the job's store. Its destroy once waited for the other ranks' goodbyes,
    // up to the grace of a few seconds (5 s at the default timeout), which ranks destroyed
    // after it on this thread could not say; the store now lives until the last of them goes.
    let start = Instant::now();
    let zero = ranks.0.remove(0);
    assert_eq!(unsafe { ncclCommDestroy(zero) }, NcclResult::Success);
    let took = start.elapsed();
    drop(ranks);
    assert!(
        took < Duration::from_millis(2500),
        "rank 0's destroy took {took:?}, waiting for ranks this thread has yet to destroy"
    );
}

fn all_reduce(ranks: &Ranks) {
    let n = ranks.0.len();
    let len = 1000;
    for (op, fold) in [
        (SUM, (|a, b| a + b) as fn(f64, f64) -> f64),
        (PROD, |a, b| a * b),
        (MAX, f64::max),
        (MIN, f64::min),
        (AVG, |a, b| a + b),
    ] {
        let want: Vec<f64> = (0..len)
            .map(|i| {
                let v = (1..n).fold(value(0, i), |acc, r| fold(acc, value(r, i)));
                if op == AVG {
                    v / n as f64
                } else {
                    v
                }
            })
            .collect();
        // Out of place in f64, in place in f32 and i32 (the integers' average, truncated, is
        // left to Chorus's own tests).
        let inputs: Vec<Vec<f64>> = (0..n)
            .map(|r| (0..len).map(|i| value(r, i)).collect())
            .collect();
        let mut outputs = vec![vec![0f64; len]; n];
        ranks.group(|r, c| unsafe {
            ncclAllReduce(
                ptr(&inputs[r]),
                mut_ptr(&mut outputs[r]),
                len,
                FLOAT64,
                op,
                c,
                null_mut(),
            )
        });
        assert!(outputs.iter().all(|o| *o == want), "f64 op {op} at W={n}");
        let mut bufs: Vec<Vec<f32>> = inputs
            .iter()
            .map(|v| v.iter().map(|&x| x as f32).collect())
            .collect();
        ranks.group(|r, c| {
            let p = mut_ptr(&mut bufs[r]);
            unsafe { ncclAllReduce(p, p, len, FLOAT32, op, c, null_mut()) }
        });
        let want32: Vec<f32> = want.iter().map(|&x| x as f32).collect();
        assert!(
            bufs.iter().all(|b| *b == want32),
            "f32 op {op} in place at W={n}"
        );
        if op != AVG {
            let mut ints: Vec<Vec<i32>> = inputs
                .iter()
                .map(|v| v.iter().map(|&x| x as i32).collect())
                .collect();
            ranks.group(|r, c| {
                let p = mut_ptr(&mut ints[r]);
                unsafe { ncclAllReduce(p, p, len, INT32, op, c, null_mut()) }
            });
            let want_i: Vec<i32> = want.iter().map(|&x| x as i32).collect();
            assert!(ints.iter().all(|b| *b == want_i), "i32 op {op} at W={n}");
        }
    }
}

fn broadcast_and_reduce(ranks: &Ranks) {
    let n = ranks.0.len();
    let len = 777;
    let root = n - 1;
    let data: Vec<Vec<i32>> = (0..n)
        .map(|r| (0..len).map(|i| value(r, i) as i32).collect())
        .collect();
    // Out of place: only the root's input is read; in place through ncclBcast.
    let mut outs = vec![vec![-1i32; len]; n];
    ranks.group(|r, c| {
        let input = if r == root { ptr(&data[r]) } else { null() };
        unsafe {
            ncclBroadcast(
                input,
                mut_ptr(&mut outs[r]),
                len,
                INT32,
                root as c_int,
                c,
                null_mut(),
            )
        }
    });
    assert!(outs.iter().all(|o| *o == data[root]));
    let mut bufs = data.clone();
    ranks.group(|r, c| unsafe { ncclBcast(mut_ptr(&mut bufs[r]), len, INT32, 0, c, null_mut()) });
    assert!(bufs.iter().all(|b| *b == data[0]));
    // Reduce to the last rank; the others pass no output.
    let want: Vec<i32> = (0..len).map(|i| data.iter().map(|d| d[i]).sum()).collect();
    let mut out = vec![0i32; len];
    ranks.group(|r, c| {
        let output = if r == root {
            mut_ptr(&mut out)
        } else {
            null_mut()
        };
        unsafe {
            ncclReduce(
                ptr(&data[r]),
                output,
                len,
                INT32,
                SUM,
                root as c_int,
                c,
                null_mut(),
            )
        }
    });
    assert_eq!(out, want);
}

fn gathers_and_scatters(ranks: &Ranks) {
    let n = ranks.0.len();
    let k = 300;
    let blocks: Vec<Vec<f32>> = (0..n)
        .map(|r| (0..k).map(|i| value(r, i) as f32).collect())
        .collect();
    let all: Vec<f32> = blocks.concat();
    // All-gather apart, and in place (each rank's block already in its slot).
    let mut outs = vec![vec![0f32; n * k]; n];
    ranks.group(|r, c| unsafe {
        ncclAllGather(
            ptr(&blocks[r]),
            mut_ptr(&mut outs[r]),
            k,
            FLOAT32,
            c,
            null_mut(),
        )
    });
    assert!(outs.iter().all(|o| *o == all));
    let mut bufs: Vec<Vec<f32>> = (0..n)
        .map(|r| {
            let mut b = vec![0f32; n * k];
            b[r * k..(r + 1) * k].copy_from_slice(&blocks[r]);
            b
        })
        .collect();
    ranks.group(|r, c| {
        let base = bufs[r].as_mut_ptr();
        // SAFETY: block r of the rank's buffer.
        let own = unsafe { base.add(r * k) };
        unsafe {
            ncclAllGather(
                own.cast_const().cast(),
                base.cast(),
                k,
                FLOAT32,
                c,
                null_mut(),
            )
        }
    });
    assert!(bufs.iter().all(|b| *b == all));
    // Reduce-scatter: every rank's input is `all` times (rank + 1); apart, and in place.
    let scale: f32 = (1..=n).map(|x| x as f32).sum();
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|r| all.iter().map(|&x| x * (r + 1) as f32).collect())
        .collect();
    let mut outs = vec![vec![0f32; k]; n];
    ranks.group(|r, c| unsafe {
        ncclReduceScatter(
            ptr(&inputs[r]),
            mut_ptr(&mut outs[r]),
            k,
            FLOAT32,
            SUM,
            c,
            null_mut(),
        )
    });
    for (r, o) in outs.iter().enumerate() {
        let want: Vec<f32> = blocks[r].iter().map(|&x| x * scale).collect();
        assert_eq!(*o, want, "reduce-scatter rank {r} at W={n}");
    }
    let mut bufs = inputs.clone();
    ranks.group(|r, c| {
        let base = bufs[r].as_mut_ptr();
        // SAFETY: block r of the rank's buffer.
        let own = unsafe { base.add(r * k) };
        unsafe {
            ncclReduceScatter(
                base.cast_const().cast(),
                own.cast(),
                k,
                FLOAT32,
                SUM,
                c,
                null_mut(),
            )
        }
    });
    for (r, b) in bufs.iter().enumerate() {
        let want: Vec<f32> = blocks[r].iter().map(|&x| x * scale).collect();
        assert_eq!(
            b[r * k..(r + 1) * k],
            want[..],
            "in-place reduce-scatter rank {r}"
        );
    }
    // All-to-all: block q of rank r's input holds r * 1000 + q.
    let a2a: Vec<Vec<f64>> = (0..n)
        .map(|r| (0..n * k).map(|i| (r * 1000 + i / k) as f64).collect())
        .collect();
    let mut outs = vec![vec![0f64; n * k]; n];
    ranks.group(|r, c| unsafe {
        ncclAlltoAll(
            ptr(&a2a[r]),
            mut_ptr(&mut outs[r]),
            k,
            FLOAT64,
            c,
            null_mut(),
        )
    });
    for (r, o) in outs.iter().enumerate() {
        let want: Vec<f64> = (0..n * k).map(|i| ((i / k) * 1000 + r) as f64).collect();
        assert_eq!(*o, want);
    }
    // Gather to rank 0 (the others pass no output), and scatter back from it.
    let mut gathered = vec![0f32; n * k];
    ranks.group(|r, c| {
        let output = if r == 0 {
            mut_ptr(&mut gathered)
        } else {
            null_mut()
        };
        unsafe { ncclGather(ptr(&blocks[r]), output, k, FLOAT32, 0, c, null_mut()) }
    });
    assert_eq!(gathered, all);
    let mut outs = vec![vec![0f32; k]; n];
    ranks.group(|r, c| {
        let input = if r == 0 { ptr(&gathered) } else { null() };
        unsafe { ncclScatter(input, mut_ptr(&mut outs[r]), k, FLOAT32, 0, c, null_mut()) }
    });
    assert_eq!(outs, blocks);
}

fn sends_and_receives(ranks: &Ranks) {
    let n = ranks.0.len();
    let k = 5000;
    // Every rank sends to the next and receives from the previous, made in either order.
    let data: Vec<Vec<i32>> = (0..n)
        .map(|r| (0..k).map(|i| (r * k + i) as i32).collect())
        .collect();
    let mut got = vec![vec![0i32; k]; n];
    assert_eq!(ncclGroupStart(), NcclResult::Success);
    for (r, &c) in ranks.0.iter().enumerate() {
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let send = || unsafe { ncclSend(ptr(&data[r]), k, INT32, next as c_int, c, null_mut()) };
        let recv = |buf: &mut Vec<i32>| unsafe {
            ncclRecv(mut_ptr(buf), k, INT32, prev as c_int, c, null_mut())
        };
        if r % 2 == 0 {
            assert_eq!(send(), NcclResult::Success);
            assert_eq!(recv(&mut got[r]), NcclResult::Success);
        } else {
            assert_eq!(recv(&mut got[r]), NcclResult::Success);
            assert_eq!(send(), NcclResult::Success);
        }
    }
    assert_eq!(ncclGroupEnd(), NcclResult::Success, "{}", last());
    for r in 0..n {
        assert_eq!(got[r], data[(r + n - 1) % n], "rank {r} at W={n}");
    }
}

#[test]
fn bad_arguments_fail_by_name_and_change_nothing() {
    let ranks = Ranks::new(1);
    let c = ranks.0[0];
    let mut buf = vec![1f32; 8];
    let p = mut_ptr(&mut buf);
    assert_eq!(
        unsafe { ncclAllReduce(p, p, 8, FP8, SUM, c, null_mut()) },
        NcclResult::InvalidArgument
    );
    assert!(last().contains("e4m3"), "{}", last());
    assert_eq!(
        unsafe { ncclAllReduce(p, p, 8, FLOAT32, 99, c, null_mut()) },
        NcclResult::InvalidArgument
    );
    assert!(last().contains("reduction operator 99"), "{}", last());
    assert_eq!(
        unsafe { ncclAllReduce(null(), p, 8, FLOAT32, SUM, c, null_mut()) },
        NcclResult::InvalidArgument
    );
    assert!(
        last().contains("ncclAllReduce: sendbuff is NULL"),
        "{}",
        last()
    );
    assert_eq!(
        unsafe { ncclAllReduce(p, p, 8, FLOAT32, SUM, null_mut(), null_mut()) },
        NcclResult::InvalidArgument
    );
    assert_eq!(
        unsafe { ncclBcast(p, 8, FLOAT32, 3, c, null_mut()) },
        NcclResult::InvalidArgument
    );
    assert!(last().contains("root 3 is not a rank"), "{}", last());
    // SAFETY: one float into the buffer: misaligned on purpose.
    let odd = unsafe { buf.as_mut_ptr().cast::<u8>().add(1) }.cast::<c_void>();
    assert_eq!(
        unsafe { ncclAllReduce(odd, odd, 2, FLOAT32, SUM, c, null_mut()) },
        NcclResult::InvalidArgument
    );
    assert!(last().contains("not aligned"), "{}", last());
    assert_eq!(buf, vec![1f32; 8]);
    assert_eq!(ncclGroupEnd(), NcclResult::InvalidUsage);
    // What the library cannot honour names itself.
    assert_eq!(ncclCommSuspend(c, 0), NcclResult::InvalidUsage);
    assert!(
        last().starts_with("ncclCommSuspend: not supported"),
        "{}",
        last()
    );
    // Memory ncclMemAlloc did not hand out is not freed.
    assert_eq!(unsafe { ncclMemFree(p) }, NcclResult::InvalidArgument);
    assert!(
        last().contains("not memory ncclMemAlloc returned"),
        "{}",
        last()
    );
    let zeros = UniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    let mut comm = null_mut();
    assert_eq!(
        unsafe { ncclCommInitRank(&mut comm, 2, zeros, 0) },
        NcclResult::InvalidArgument
    );
    assert!(last().contains("ncclGetUniqueId"), "{}", last());
}

/// A unique id from `ncclGetUniqueId`.
fn unique_id() -> UniqueId {
    let mut id = UniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, NcclResult::Success);
    id
}

/// Comm handles cross threads as the C API lets them.
#[derive(Clone, Copy)]
struct Handle(*mut Comm);
// SAFETY: NCCL's handles are used from any thread; the library's state is thread-safe.
unsafe impl Send for Handle {}

impl Handle {
    /// The handle (a method, so closures capture the whole `Handle`, which is `Send`).
    fn ptr(self) -> *mut Comm {
        self.0
    }
}

/// Rank `rank` of `n` joined on its own thread from a shared id, as multi-process programs do.
fn join_on_threads(n: usize, config: Option<&[u8; 96]>) -> Vec<(NcclResult, Handle)> {
    let id = unique_id();
    let threads: Vec<_> = (0..n)
        .map(|rank| {
            let mut config = config.copied();
            std::thread::spawn(move || {
                let mut comm = null_mut();
                let cfg = config
                    .as_mut()
                    .map_or(null_mut(), |c| c.as_mut_ptr().cast());
                let result = unsafe {
                    ncclCommInitRankConfig(&mut comm, n as c_int, id, rank as c_int, cfg)
                };
                (result, Handle(comm))
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// A config as NCCL_CONFIG_INITIALIZER writes it (2.30.7's 96 bytes), with `blocking`.
fn config(blocking: c_int) -> [u8; 96] {
    let mut c = [0u8; 96];
    c[..8].copy_from_slice(&96usize.to_ne_bytes());
    c[8..12].copy_from_slice(&API_MAGIC.to_ne_bytes());
    c[12..16].copy_from_slice(&23007u32.to_ne_bytes());
    for at in (16..96)
        .step_by(4)
        .filter(|at| ![32, 36, 48, 52].contains(at))
    {
        c[at..at + 4].copy_from_slice(&UNDEF_INT.to_ne_bytes());
    }
    c[16..20].copy_from_slice(&blocking.to_ne_bytes());
    c
}

fn wait_async(comm: *mut Comm, until: impl Fn(NcclResult) -> bool) -> NcclResult {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut state = NcclResult::InternalError;
        assert_eq!(
            unsafe { ncclCommGetAsyncError(comm, &mut state) },
            NcclResult::Success
        );
        if until(state) || Instant::now() > deadline {
            return state;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `n` ranks joined on threads of their own, every set-up successful.
fn joined(n: usize) -> Vec<Handle> {
    let joined = join_on_threads(n, None);
    assert!(
        joined.iter().all(|(r, _)| *r == NcclResult::Success),
        "{}",
        last()
    );
    joined.into_iter().map(|(_, h)| h).collect()
}

/// Each of `handles` all-reduces on a thread of its own: what each call returned, with the
/// thread's last error text.
fn all_reduce_on_threads(handles: &[Handle]) -> Vec<(NcclResult, String)> {
    let calls: Vec<_> = handles
        .iter()
        .map(|&h| {
            std::thread::spawn(move || {
                let mut v = [1f32; 64];
                let p = mut_ptr(&mut v);
                let result = unsafe { ncclAllReduce(p, p, 64, FLOAT32, SUM, h.ptr(), null_mut()) };
                (result, last())
            })
        })
        .collect();
    calls.into_iter().map(|c| c.join().unwrap()).collect()
}

#[test]
fn ranks_on_threads_join_blocking_or_not_and_split() {
    let joined = join_on_threads(3, None);
    assert!(
        joined.iter().all(|(r, _)| *r == NcclResult::Success),
        "{}",
        last()
    );
    // Split by parity, the odd ranks out, in reverse order of rank.
    let threads: Vec<_> = joined
        .iter()
        .enumerate()
        .map(|(rank, &(_, h))| {
            std::thread::spawn(move || {
                let mut sub = null_mut();
                let color = if rank % 2 == 0 { 0 } else { -1 };
                let result = unsafe {
                    ncclCommSplit(h.ptr(), color, -(rank as c_int), &mut sub, null_mut())
                };
                assert_eq!(result, NcclResult::Success, "{}", last());
                let (mut count, mut me) = (-1, -1);
                if !sub.is_null() {
                    unsafe { ncclCommCount(sub, &mut count) };
                    unsafe { ncclCommUserRank(sub, &mut me) };
                    let mut v = [rank as f64];
                    let p = mut_ptr(&mut v);
                    assert_eq!(
                        unsafe { ncclAllReduce(p, p, 1, FLOAT64, SUM, sub, null_mut()) },
                        NcclResult::Success
                    );
                    assert_eq!(v[0], 2.0);
                    assert_eq!(unsafe { ncclCommDestroy(sub) }, NcclResult::Success);
                }
                assert_eq!(unsafe { ncclCommDestroy(h.ptr()) }, NcclResult::Success);
                (sub.is_null(), count, me)
            })
        })
        .collect();
    let got: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(got, vec![(false, 2, 1), (true, -1, -1), (false, 2, 0)]);
    // Non-blocking: in progress, then ready.
    let joined = join_on_threads(2, Some(&config(0)));
    for &(result, h) in &joined {
        assert!(
            matches!(result, NcclResult::InProgress | NcclResult::Success),
            "{result:?}"
        );
        assert_eq!(
            wait_async(h.ptr(), |s| s != NcclResult::InProgress),
            NcclResult::Success
        );
    }
    for (_, h) in joined {
        assert_eq!(unsafe { ncclCommDestroy(h.ptr()) }, NcclResult::Success);
    }
}

#[test]
fn an_aborted_rank_fails_the_survivors_calls_by_name_and_they_shrink() {
    let handles = joined(3);
    assert_eq!(
        unsafe { ncclCommAbort(handles[2].ptr()) },
        NcclResult::Success
    );
    // The survivors' next call fails naming the rank, and so does their async error after.
    for (result, text) in all_reduce_on_threads(&handles[..2]) {
        assert_eq!(result, NcclResult::RemoteError, "{text}");
        assert!(
            text.contains("ncclAllReduce") && text.contains("rank 2"),
            "{text}"
        );
    }
    for h in &handles[..2] {
        let state = wait_async(h.ptr(), |s| s != NcclResult::Success);
        assert_eq!(state, NcclResult::RemoteError);
        assert!(last().contains("rank 2"), "{}", last());
    }
    let threads: Vec<_> = handles[..2]
        .iter()
        .map(|&h| {
            std::thread::spawn(move || {
                // The aborted rank is named: as a thread of this live process it cannot be
                // told from a slow rank but by the agreement's timeout.
                let (mut sub, mut exclude) = (null_mut(), [2]);
                let result = unsafe {
                    ncclCommShrink(h.ptr(), exclude.as_mut_ptr(), 1, &mut sub, null_mut(), 0)
                };
                assert_eq!(result, NcclResult::Success, "{}", last());
                let mut v = [1i32; 100];
                let p = mut_ptr(&mut v);
                assert_eq!(
                    unsafe { ncclAllReduce(p, p, 100, INT32, SUM, sub, null_mut()) },
                    NcclResult::Success
                );
                let mut count = 0;
                unsafe { ncclCommCount(sub, &mut count) };
                assert_eq!(unsafe { ncclCommDestroy(sub) }, NcclResult::Success);
                assert_eq!(unsafe { ncclCommDestroy(h.ptr()) }, NcclResult::Success);
                (count, v[0])
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), (2, 2));
    }
}

#[test]
fn an_abort_from_another_thread_ends_the_call_running_on_the_handle_and_frees_nothing_under_it() {
    let handles = joined(2);
    let h = handles[0];
    let (entering, entered) = std::sync::mpsc::channel();
    let caller = std::thread::spawn(move || {
        let mut v = [1f32; 64];
        let p = mut_ptr(&mut v);
        entering.send(()).unwrap();
        // Rank 1 never calls: this waits for the abort (or the 300 s timeout).
        let result = unsafe { ncclAllReduce(p, p, 64, FLOAT32, SUM, h.ptr(), null_mut()) };
        (result, v)
    });
    entered.recv().unwrap();
    // Most likely inside the call by now; an abort just before it is refused by name instead.
    std::thread::sleep(Duration::from_millis(100));
    let aborted = Instant::now();
    assert_eq!(unsafe { ncclCommAbort(h.ptr()) }, NcclResult::Success);
    let (result, v) = caller.join().unwrap();
    assert!(
        matches!(
            result,
            NcclResult::RemoteError | NcclResult::InvalidArgument
        ),
        "{result:?}"
    );
    assert!(aborted.elapsed() < Duration::from_secs(30));
    assert_eq!(v, [1f32; 64], "a failed call leaves its buffer as it was");
    // The handle is gone: calls on it, and a second abort, are refused rather than read
    // freed memory.
    let mut count = -1;
    assert_eq!(
        unsafe { ncclCommCount(h.ptr(), &mut count) },
        NcclResult::InvalidArgument
    );
    assert_eq!(count, -1);
    assert_eq!(
        unsafe { ncclCommAbort(h.ptr()) },
        NcclResult::InvalidArgument
    );
    assert_eq!(
        unsafe { ncclCommDestroy(handles[1].ptr()) },
        NcclResult::Success
    );
}

#[test]
fn an_abort_drops_what_its_own_open_group_queued_on_the_handle() {
    let handles = joined(2);
    // Rank 1: rank 0 hosts the store, and its drop waits a while for the others' goodbyes.
    let h = handles[1];
    let mut v = [1f32; 4];
    let p = mut_ptr(&mut v);
    assert_eq!(ncclGroupStart(), NcclResult::Success);
    assert_eq!(
        unsafe { ncclAllReduce(p, p, 4, FLOAT32, SUM, h.ptr(), null_mut()) },
        NcclResult::Success
    );
    // The group's queued call would hold the communicator: the abort must not wait for it
    // (its grace is 10 s), and the group's end runs nothing on it.
    let aborted = Instant::now();
    assert_eq!(unsafe { ncclCommAbort(h.ptr()) }, NcclResult::Success);
    assert!(aborted.elapsed() < Duration::from_secs(5));
    assert_eq!(ncclGroupEnd(), NcclResult::Success, "{}", last());
    assert_eq!(v, [1f32; 4]);
    // NULL is nothing to destroy or abort, as with NCCL (a NOCOLOR rank's split).
    assert_eq!(unsafe { ncclCommDestroy(null_mut()) }, NcclResult::Success);
    assert_eq!(unsafe { ncclCommAbort(null_mut()) }, NcclResult::Success);
    assert_eq!(
        unsafe { ncclCommDestroy(handles[0].ptr()) },
        NcclResult::Success
    );
}

#[test]
fn one_thread_splits_and_shrinks_every_rank_inside_a_group() {
    let ranks = Ranks::new(3);
    // Ranks 0 and 2 split off, in reverse order of key; rank 1 takes no part.
    let mut subs = vec![null_mut::<Comm>(); 3];
    let out = subs.as_mut_ptr();
    ranks.group(|rank, comm| {
        let color = if rank == 1 { -1 } else { 7 };
        unsafe { ncclCommSplit(comm, color, -(rank as c_int), out.add(rank), null_mut()) }
    });
    assert!(subs[1].is_null());
    let split = Ranks(vec![subs[0], subs[2]]);
    let mut me = [-1; 2];
    for (m, &c) in me.iter_mut().zip(&split.0) {
        assert_eq!(unsafe { ncclCommUserRank(c, m) }, NcclResult::Success);
    }
    assert_eq!(me, [1, 0]);
    let mut values = [[1.0f64, 2.0], [10.0, 20.0]];
    let at: Vec<*mut c_void> = values.iter_mut().map(|v| mut_ptr(v)).collect();
    split
        .group(|i, comm| unsafe { ncclAllReduce(at[i], at[i], 2, FLOAT64, SUM, comm, null_mut()) });
    assert_eq!(values, [[11.0, 22.0]; 2]);
    // A shrink excluding no one, by every rank from the one thread.
    let mut shrunk = vec![null_mut::<Comm>(); 3];
    let out = shrunk.as_mut_ptr();
    ranks.group(|rank, comm| unsafe {
        ncclCommShrink(comm, null_mut(), 0, out.add(rank), null_mut(), 0)
    });
    let shrunk = Ranks(shrunk);
    let mut values: Vec<[i32; 1]> = (1..=3).map(|r| [r]).collect();
    let at: Vec<*mut c_void> = values.iter_mut().map(|v| mut_ptr(v)).collect();
    shrunk.group(|i, comm| unsafe { ncclAllReduce(at[i], at[i], 1, INT32, SUM, comm, null_mut()) });
    assert_eq!(values, vec![[6]; 3]);
}

#[test]
fn a_revoked_communicator_takes_no_calls_and_splits_or_shrinks() {
    let handles = joined(3);
    assert_eq!(
        unsafe { ncclCommRevoke(handles[0].ptr(), 1) },
        NcclResult::InvalidArgument
    );
    assert!(last().contains("revokeFlags"), "{}", last());
    // Rank 2 revokes: the others' next call fails naming it, its own at once.
    assert_eq!(
        unsafe { ncclCommRevoke(handles[2].ptr(), 0) },
        NcclResult::Success
    );
    let mut v = [1f32; 8];
    let p = mut_ptr(&mut v);
    let own = unsafe { ncclAllReduce(p, p, 8, FLOAT32, SUM, handles[2].ptr(), null_mut()) };
    assert_eq!(own, NcclResult::InvalidUsage);
    assert!(last().contains("revoked"), "{}", last());
    assert_eq!(
        unsafe { ncclCommFinalize(handles[2].ptr()) },
        NcclResult::InvalidUsage
    );
    for (result, text) in all_reduce_on_threads(&handles[..2]) {
        assert_eq!(result, NcclResult::RemoteError, "{text}");
        assert!(text.contains("rank 2"), "{text}");
    }
    // The others revoke too; each reports success once quiescent (no calls on streams here),
    // whatever fault came before.
    for h in &handles[..2] {
        assert_eq!(unsafe { ncclCommRevoke(h.ptr(), 0) }, NcclResult::Success);
    }
    for h in &handles {
        assert_eq!(
            wait_async(h.ptr(), |s| s != NcclResult::InProgress),
            NcclResult::Success
        );
    }
    // Every rank splits the revoked communicator (the middle rank out, the others in
    // reverse order), then shrinks it; each new one carries calls.
    let threads: Vec<_> = handles
        .iter()
        .enumerate()
        .map(|(rank, &h)| {
            std::thread::spawn(move || {
                let mut sub = null_mut();
                let color = if rank == 1 { -1 } else { 7 };
                let split = unsafe {
                    ncclCommSplit(h.ptr(), color, -(rank as c_int), &mut sub, null_mut())
                };
                assert_eq!(split, NcclResult::Success, "rank {rank}: {}", last());
                let mut place = -1;
                if !sub.is_null() {
                    unsafe { ncclCommUserRank(sub, &mut place) };
                    let mut v = [rank as i32 + 1];
                    let p = mut_ptr(&mut v);
                    let summed = unsafe { ncclAllReduce(p, p, 1, INT32, SUM, sub, null_mut()) };
                    assert_eq!(summed, NcclResult::Success, "{}", last());
                    assert_eq!(v[0], 4);
                    assert_eq!(unsafe { ncclCommDestroy(sub) }, NcclResult::Success);
                }
                let mut all = null_mut();
                let shrunk =
                    unsafe { ncclCommShrink(h.ptr(), null_mut(), 0, &mut all, null_mut(), 0) };
                assert_eq!(shrunk, NcclResult::Success, "rank {rank}: {}", last());
                let (mut count, mut v) = (0, [rank as f64]);
                unsafe { ncclCommCount(all, &mut count) };
                let p = mut_ptr(&mut v);
                let summed = unsafe { ncclAllReduce(p, p, 1, FLOAT64, SUM, all, null_mut()) };
                assert_eq!(summed, NcclResult::Success, "{}", last());
                assert_eq!(unsafe { ncclCommDestroy(all) }, NcclResult::Success);
                assert_eq!(unsafe { ncclCommDestroy(h.ptr()) }, NcclResult::Success);
                (place, count, v[0])
            })
        })
        .collect();
    let got: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(got, vec![(1, 3, 3.0), (-1, 3, 3.0), (0, 3, 3.0)]);
}

#[test]
fn pre_multiplied_sums_scale_every_input_first() {
    let n = 3;
    let ranks = Ranks::new(n);
    let len = 500;
    // Every rank makes its operator: a half read now, and a scalar read by each call.
    let mut half = vec![0.5f32];
    let mut ops = vec![0; n];
    for (r, &c) in ranks.0.iter().enumerate() {
        let made =
            unsafe { ncclRedOpCreatePreMulSum(&mut ops[r], mut_ptr(&mut half), FLOAT32, 1, c) };
        assert_eq!(made, NcclResult::Success, "{}", last());
    }
    half[0] = 7.0; // read when made: no effect
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|r| (0..n * len).map(|i| value(r, i) as f32).collect())
        .collect();
    let sum = |i: usize| (0..n).map(|r| value(r, i)).sum::<f64>() as f32;
    let mut outs = vec![vec![0f32; n * len]; n];
    ranks.group(|r, c| unsafe {
        ncclAllReduce(
            ptr(&inputs[r]),
            mut_ptr(&mut outs[r]),
            n * len,
            FLOAT32,
            ops[r],
            c,
            null_mut(),
        )
    });
    let want: Vec<f32> = (0..n * len).map(|i| 0.5 * sum(i)).collect();
    assert!(outs.iter().all(|o| *o == want));
    let mut parts = vec![vec![0f32; len]; n];
    ranks.group(|r, c| unsafe {
        ncclReduceScatter(
            ptr(&inputs[r]),
            mut_ptr(&mut parts[r]),
            len,
            FLOAT32,
            ops[r],
            c,
            null_mut(),
        )
    });
    for (r, p) in parts.iter().enumerate() {
        assert_eq!(p[..], want[r * len..(r + 1) * len]);
    }
    // An operator of f32 serves f32 calls only, and is gone once destroyed.
    let mut doubles = vec![1f64; 4];
    let p = mut_ptr(&mut doubles);
    let c = ranks.0[0];
    assert_eq!(
        unsafe { ncclAllReduce(p, p, 4, FLOAT64, ops[0], c, null_mut()) },
        NcclResult::InvalidArgument
    );
    assert!(last().contains("made for F32"), "{}", last());
    for (r, &c) in ranks.0.iter().enumerate() {
        assert_eq!(unsafe { ncclRedOpDestroy(ops[r], c) }, NcclResult::Success);
    }
    let mut v = [1f32];
    let p = mut_ptr(&mut v);
    assert_eq!(
        unsafe { ncclAllReduce(p, p, 1, FLOAT32, ops[0], c, null_mut()) },
        NcclResult::InvalidArgument
    );
    assert!(
        last().contains(&format!("operator {} is not one", ops[0])),
        "{}",
        last()
    );
    // Read by each call: the scalar's value when the reduction runs.
    let mut scale = vec![1.0f64];
    let mut made = vec![0; n];
    for (r, &c) in ranks.0.iter().enumerate() {
        let at = mut_ptr(&mut scale);
        assert_eq!(
            unsafe { ncclRedOpCreatePreMulSum(&mut made[r], at, FLOAT64, 0, c) },
            NcclResult::Success
        );
    }
    scale[0] = 3.0;
    let mut root_out = vec![0f64; 2];
    let inputs: Vec<Vec<f64>> = (0..n).map(|r| vec![r as f64 + 1.0; 2]).collect();
    ranks.group(|r, c| unsafe {
        let out = if r == 1 {
            mut_ptr(&mut root_out)
        } else {
            null_mut()
        };
        ncclReduce(ptr(&inputs[r]), out, 2, FLOAT64, made[r], 1, c, null_mut())
    });
    assert_eq!(root_out, vec![3.0 * 6.0; 2]);
}

/// Without a CUDA device, ncclMemAlloc hands out zeroed, page-aligned host memory that the
/// calls take as buffers, and ncclMemFree gives it back.
#[test]
fn memory_from_nccl_mem_alloc_carries_calls() {
    let ranks = Ranks::new(2);
    let n = 1024;
    let mut bufs = [null_mut(); 2];
    for b in &mut bufs {
        assert_eq!(
            unsafe { ncclMemAlloc(b, n * 4) },
            NcclResult::Success,
            "{}",
            last()
        );
        assert_eq!(*b as usize % 4096, 0);
        let floats = unsafe { std::slice::from_raw_parts_mut(b.cast::<f32>(), n) };
        assert!(floats.iter().all(|&x| x == 0.0));
    }
    for (rank, b) in bufs.iter().enumerate() {
        let floats = unsafe { std::slice::from_raw_parts_mut(b.cast::<f32>(), n) };
        floats.iter_mut().for_each(|x| *x = rank as f32 + 1.0);
    }
    ranks.group(|rank, comm| unsafe {
        ncclAllReduce(bufs[rank], bufs[rank], n, FLOAT32, SUM, comm, null_mut())
    });
    for b in bufs {
        let floats = unsafe { std::slice::from_raw_parts(b.cast::<f32>(), n) };
        assert!(floats.iter().all(|&x| x == 3.0), "{:?}", &floats[..4]);
        assert_eq!(unsafe { ncclMemFree(b) }, NcclResult::Success, "{}", last());
    }
    let mut none = null_mut::<c_void>();
    assert_eq!(unsafe { ncclMemAlloc(&mut none, 0) }, NcclResult::Success);
    assert!(none.is_null());
    assert_eq!(unsafe { ncclMemFree(none) }, NcclResult::Success);
}

/// ncclCommInitRankScalable: several ids, passed alike by every rank, make one communicator;
/// a count of ids that is not positive is refused by name.
#[test]
fn ranks_join_through_several_ids() {
    let ids = [unique_id(), unique_id()];
    let n = 3;
    let threads: Vec<_> = (0..n)
        .map(|rank| {
            let mut ids = ids;
            std::thread::spawn(move || {
                let mut comm = null_mut();
                let result = unsafe {
                    ncclCommInitRankScalable(&mut comm, n, rank, 2, ids.as_mut_ptr(), null_mut())
                };
                assert_eq!(result, NcclResult::Success, "rank {rank}: {}", last());
                let mut x = [rank as f32 + 1.0; 4];
                let p = mut_ptr(&mut x);
                let sum = unsafe { ncclAllReduce(p, p, 4, FLOAT32, SUM, comm, null_mut()) };
                assert_eq!(sum, NcclResult::Success, "rank {rank}: {}", last());
                assert_eq!(x, [6.0; 4]);
                assert_eq!(unsafe { ncclCommDestroy(comm) }, NcclResult::Success);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut comm = null_mut();
    let mut ids = ids;
    assert_eq!(
        unsafe { ncclCommInitRankScalable(&mut comm, 2, 0, 0, ids.as_mut_ptr(), null_mut()) },
        NcclResult::InvalidArgument
    );
    assert!(
        last().starts_with("ncclCommInitRankScalable: nId 0"),
        "{}",
        last()
    );
}
