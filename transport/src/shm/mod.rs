//! The shared-memory transport, for ranks on one host: per ordered pair of
//! ranks a ring of chunk slots in a mapping of a file in `/dev/shm`
//! (unlinked once every rank has mapped it), futex sleeps, and pidfds to
//! notice a peer process that died.

mod cma;
mod cores;
mod engine;
mod meet;
mod region;
mod setup;
mod wake;
mod window;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::endpoint::{through_endpoint, Endpoint};
use crate::store::Store;
use crate::{LinkCost, TransportError};
use engine::{PeerInfo, Shared};
pub use meet::{CallPlace, Posted, Stall};
pub use region::MAILBOX_BYTES;
pub use window::Window;

/// What a shared-memory message costs through the slots or in one copy, as the
/// all-reduces of the perf tools measure it on a 2-core host: 2 us per message
/// (a slot's hand-over), 3 GB/s (the two copies through the slots, or the single
/// copy out of a buffer on huge pages, with the reduction; 64 MiB by 2 ranks' ring
/// in 21-25 ms, and by 3, 4 and 8 ranks, which outnumber the cores, as the tuner
/// prices crowded hosts).
pub const LINK_COST: LinkCost = LinkCost {
    latency: 2e-6,
    bandwidth: 3e9,
};

/// Settings of the shared-memory transport.
#[derive(Debug, Clone)]
pub struct ShmConfig {
    /// Slots per ring (one ring per ordered pair of local ranks).
    pub slots: usize,
    /// Payload bytes per slot; messages are moved in chunks of this size.
    pub slot_bytes: usize,
    /// Directory of the shared file (a tmpfs).
    pub dir: PathBuf,
    /// Bound on set-up: waiting for the other local ranks to map the file.
    pub timeout: Duration,
    /// Which sends receivers read straight from the sender's memory, where every local rank
    /// is allowed to: by default those lent from buffers on huge pages.
    pub single_copy: SingleCopy,
}

/// Which sends a receiver copies straight out of the sender's memory (`process_vm_readv`,
/// one copy) instead of through the slots (two copies, which stay in cache).
///
/// One copy pins every page it touches: on 4 KiB pages that costs more than the slots'
/// second copy, on 2 MiB pages far less. A sender that finds its buffer on huge pages
/// posts it as [`Payload::Lend`](crate::Payload::Lend).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SingleCopy {
    /// None: every message goes through the slots.
    Never,
    /// Lent sends of at least this many bytes (the default, from [`LENT_MIN`] bytes).
    Lent(usize),
    /// Every send of at least this many bytes (at least one), lent or not.
    From(usize),
}

/// The smallest lent send read in one copy by default: smaller ones cost more to set up
/// (publishing the address, pinning the pages) than the slots' second copy.
pub const LENT_MIN: usize = 64 << 10;

impl Default for SingleCopy {
    fn default() -> SingleCopy {
        SingleCopy::Lent(LENT_MIN)
    }
}

impl SingleCopy {
    /// Whether a send of `len` bytes, `lent` or not, goes in one copy.
    pub(crate) fn takes(self, len: usize, lent: bool) -> bool {
        match self {
            SingleCopy::Never => false,
            SingleCopy::Lent(min) => lent && len >= min,
            SingleCopy::From(min) => len >= min.max(1),
        }
    }
}

/// `0`: never; a size in bytes: every send of that many bytes or more; `huge`: the default.
impl std::str::FromStr for SingleCopy {
    type Err = String;

    fn from_str(s: &str) -> Result<SingleCopy, String> {
        match s.trim() {
            "huge" => Ok(SingleCopy::default()),
            "0" => Ok(SingleCopy::Never),
            bytes => match bytes.parse() {
                Ok(min) => Ok(SingleCopy::From(min)),
                Err(_) => Err("expected 0, a size in bytes, or huge".to_string()),
            },
        }
    }
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            slots: 8,
            slot_bytes: 128 << 10,
            dir: PathBuf::from("/dev/shm"),
            timeout: Duration::from_secs(300),
            single_copy: SingleCopy::default(),
        }
    }
}

/// A [`Transport`](crate::Transport) through shared memory between the ranks of one host.
///
/// Connects `rank` to the other ranks of its host only; posting to a rank
/// elsewhere fails with `InvalidPeer` (see [`RoutedTransport`](crate::RoutedTransport)
/// for a transport that reaches every rank).
#[derive(Debug)]
pub struct ShmTransport {
    rank: usize,
    /// Global ranks of this host, by local rank.
    local: Vec<usize>,
    own_local: usize,
    config: ShmConfig,
    /// The engine, for windows and meetings.
    shared: Arc<Shared>,
    endpoint: Endpoint<Shared>,
    /// The cores the local ranks share.
    cores: usize,
}

impl ShmTransport {
    /// Links `rank` to the ranks in `local` (global ranks on this host,
    /// including `rank`), exchanging the file's name and process ids through `store`.
    ///
    /// Fails if `rank` is not in `local`, if the file cannot be created,
    /// sized or mapped, or if a local rank does not map it within `config.timeout`.
    pub fn connect(
        rank: usize,
        world_size: usize,
        local: &[usize],
        store: &dyn Store,
        config: &ShmConfig,
    ) -> Result<ShmTransport, TransportError> {
        let mut local = local.to_vec();
        local.sort_unstable();
        local.dedup();
        let own_local = local.iter().position(|&r| r == rank).ok_or_else(|| {
            TransportError::Setup(format!(
                "rank {rank} is not among the local ranks {local:?}"
            ))
        })?;
        if let Some(&r) = local.iter().find(|&&r| r >= world_size) {
            return Err(TransportError::Setup(format!(
                "local rank list names rank {r}, not below the world size {world_size}"
            )));
        }
        let joined = setup::join(rank, &local, store, config)?;
        let peers: Vec<PeerInfo> = local
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != own_local)
            .map(|(i, &r)| PeerInfo {
                rank: r,
                local: i,
                pid: joined.pids[i],
                single_copy: joined.reads_peers[i],
                writable: joined.reads_peers[own_local],
            })
            .collect();
        let region = Arc::new(joined.region);
        let shared = Arc::new(Shared::new(
            rank,
            world_size,
            region,
            own_local,
            &peers,
            config.single_copy,
            joined.cores,
        ));
        let endpoint = Endpoint::start(rank, world_size, "shm", shared.clone())?;
        let single_copies = peers.iter().any(|p| p.single_copy);
        let cores = joined.cores;
        tracing::debug!(
            rank,
            ?local,
            single_copies,
            cores,
            "shm transport connected"
        );
        Ok(ShmTransport {
            rank,
            local,
            own_local,
            config: config.clone(),
            shared,
            endpoint,
            cores,
        })
    }

    /// The cores this host's ranks may run on between them (the union of their
    /// affinity masks, bounded by a CPU quota that binds); every local rank gets the same.
    pub fn cores(&self) -> usize {
        self.cores
    }
}

through_endpoint!(ShmTransport, endpoint);

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::store::{StoreServer, TcpStore};
    use crate::{Payload, Transport};

    /// `n` transports on one host, one per thread's rank, small slots so messages span several.
    pub(super) fn pair(n: usize) -> Vec<ShmTransport> {
        pair_with(n, small_slots())
    }

    /// Four slots of 256 bytes, and single copies from 1000 bytes.
    fn small_slots() -> ShmConfig {
        ShmConfig {
            slots: 4,
            slot_bytes: 256,
            timeout: Duration::from_secs(20),
            single_copy: SingleCopy::From(1000),
            ..ShmConfig::default()
        }
    }

    /// Like `pair`, with `config`.
    fn pair_with(n: usize, config: ShmConfig) -> Vec<ShmTransport> {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let port = server.local_addr().port();
        let local: Vec<usize> = (0..n).collect();
        let threads: Vec<_> = (0..n)
            .map(|rank| {
                let (config, local) = (config.clone(), local.clone());
                std::thread::spawn(move || {
                    let store =
                        TcpStore::connect("127.0.0.1", port, Duration::from_secs(20)).unwrap();
                    ShmTransport::connect(rank, n, &local, &store, &config).unwrap()
                })
            })
            .collect();
        let out = threads.into_iter().map(|t| t.join().unwrap()).collect();
        drop(server);
        out
    }

    pub(super) fn deadline() -> Instant {
        Instant::now() + Duration::from_secs(20)
    }

    #[test]
    fn local_ranks_agree_on_the_cores_they_share() {
        // Ranks that are threads of this process share its cores, no more.
        let mine = cores::Cores::shared(&[cores::Cores::of_this_process()]);
        assert!(pair(3).iter().all(|t| t.cores() == mine));
    }

    #[test]
    fn messages_of_every_size_arrive_in_order() {
        let t = pair(3);
        let sizes = [0usize, 1, 255, 256, 257, 1000, 4096, 10_000];
        let data: Vec<Vec<u8>> = sizes
            .iter()
            .map(|&n| (0..n).map(|i| (i * 7 + n) as u8).collect())
            .collect();
        let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
        let mut reqs = Vec::new();
        // SAFETY: buffers outlive the requests, which are all waited for below.
        unsafe {
            for (i, b) in bufs.iter_mut().enumerate() {
                reqs.push(t[2].irecv(0, i as u64, b).unwrap());
            }
            for (i, d) in data.iter().enumerate() {
                reqs.push(t[0].isend(2, i as u64, d).unwrap());
            }
        }
        crate::wait_all(&reqs, deadline()).unwrap();
        assert_eq!(bufs, data);
    }

    #[test]
    fn a_wrong_tag_or_length_fails_naming_the_peer() {
        let t = pair(2);
        let data = [1u8; 100];
        let mut buf = [0u8; 100];
        // SAFETY: both buffers outlive the waits.
        let (s, r) = unsafe {
            (
                t[0].isend(1, 7, &data).unwrap(),
                t[1].irecv(0, 8, &mut buf).unwrap(),
            )
        };
        let err = r.wait(deadline()).unwrap_err();
        assert!(
            matches!(err, TransportError::Protocol { peer: 0, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("tag 0x7"), "{err}");
        s.wait(deadline()).unwrap();
        // The link stays failed: later receives from rank 0 fail at once.
        // SAFETY: as above.
        assert!(unsafe { t[1].irecv(0, 9, &mut buf) }.is_err());
    }

    #[test]
    fn abort_fails_waiters_here_and_on_the_peer() {
        let t = pair(2);
        let mut buf = [0u8; 10_000];
        let mut other = [0u8; 8];
        // SAFETY: the buffers outlive the requests; abort ends them.
        let (mine, theirs) = unsafe {
            (
                t[0].irecv(1, 1, &mut buf).unwrap(),
                t[1].irecv(0, 1, &mut other).unwrap(),
            )
        };
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                t[0].abort("test abort");
            });
            let err = mine.wait(deadline()).unwrap_err();
            assert!(
                matches!(err, TransportError::Aborted(ref why) if why == "test abort"),
                "{err}"
            );
        });
        let err = theirs.wait(deadline()).unwrap_err();
        assert!(
            matches!(err, TransportError::PeerClosed { peer: 0 }),
            "{err}"
        );
        // SAFETY: fails before touching the buffer.
        let late = unsafe { t[0].isend(1, 2, &other) };
        assert!(matches!(late, Err(TransportError::Aborted(_))));
    }

    #[test]
    fn data_sent_before_a_peer_leaves_is_still_received() {
        let mut t = pair(2);
        let data = [3u8; 600];
        // SAFETY: `data` outlives the send, which completes (fits the ring) before the drop.
        let s = unsafe { t[0].isend(1, 5, &data).unwrap() };
        s.wait(deadline()).unwrap();
        drop(t.remove(0));
        let mut buf = [0u8; 600];
        let mut more = [0u8; 1];
        // SAFETY: the buffers outlive the waits.
        let (r, r2) = unsafe {
            (
                t[0].irecv(0, 5, &mut buf).unwrap(),
                t[0].irecv(0, 6, &mut more).unwrap(),
            )
        };
        r.wait(deadline()).unwrap();
        assert_eq!(buf, data);
        assert!(matches!(
            r2.wait(deadline()),
            Err(TransportError::PeerClosed { peer: 0 })
        ));
    }

    #[test]
    fn probe_shows_the_next_message_without_taking_it() {
        let mut t = pair(3);
        assert_eq!(t[0].probe(1).unwrap(), None);
        // One chunk, a single copy, empty, and three chunks (slots hold 256 bytes).
        let messages = [(4u64, 10usize), (5, 5000), (6, 0), (7, 600)];
        let data: Vec<Vec<u8>> = messages
            .iter()
            .map(|&(tag, n)| (0..n).map(|i| (i as u64 * 3 + tag) as u8).collect())
            .collect();
        // SAFETY: `data` outlives the sends, waited for below.
        let sends: Vec<_> = unsafe {
            messages
                .iter()
                .zip(&data)
                .map(|(&(tag, _), d)| t[1].isend(0, tag, d).unwrap())
                .collect()
        };
        std::thread::scope(|scope| {
            scope.spawn(|| crate::wait_all(&sends, deadline()).unwrap());
            for (&(tag, len), want) in messages.iter().zip(&data) {
                let end = deadline();
                let next = loop {
                    match t[0].probe(1).unwrap() {
                        Some(next) => break next,
                        None => assert!(Instant::now() < end, "tag {tag} never arrived"),
                    }
                    std::thread::yield_now();
                };
                assert_eq!(next, (tag, len));
                // Looking again shows the same message: the probe took nothing.
                assert_eq!(t[0].probe(1).unwrap(), Some((tag, len)));
                let mut got = vec![0u8; len];
                // SAFETY: `got` outlives the wait.
                let r = unsafe { t[0].irecv(1, tag, &mut got).unwrap() };
                r.wait(deadline()).unwrap();
                assert_eq!(&got, want, "tag {tag}");
            }
        });
        // What a peer published before it left is still shown, then its leaving is an error.
        let nine = [9u8; 3];
        // SAFETY: `nine` outlives the wait.
        let last = unsafe { t[2].isend(0, 9, &nine).unwrap() };
        last.wait(deadline()).unwrap();
        drop(t.pop());
        assert_eq!(t[0].probe(2).unwrap(), Some((9, 3)));
        let mut got = [0u8; 3];
        // SAFETY: `got` outlives the wait.
        let r = unsafe { t[0].irecv(2, 9, &mut got).unwrap() };
        r.wait(deadline()).unwrap();
        assert_eq!(got, nine);
        let err = t[0].probe(2).unwrap_err();
        assert!(
            matches!(err, TransportError::PeerClosed { peer: 2 }),
            "{err}"
        );
        for peer in [0, 3] {
            let err = t[0].probe(peer).unwrap_err();
            assert!(matches!(err, TransportError::InvalidPeer { .. }), "{err}");
        }
    }

    #[test]
    fn large_messages_copied_by_both_sides_arrive_intact() {
        let t = pair(2);
        let sizes: Vec<usize> = (0..40).map(|i| 1000 + i * 37_111).collect();
        let data: Vec<Vec<u8>> = sizes
            .iter()
            .map(|&n| (0..n).map(|i| (i * 13 + n) as u8).collect())
            .collect();
        let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
        // SAFETY: every buffer outlives the waits below.
        let (recvs, sends): (Vec<_>, Vec<_>) = unsafe {
            let recvs = bufs
                .iter_mut()
                .enumerate()
                .map(|(i, b)| t[1].irecv(0, i as u64, b).unwrap())
                .collect();
            let sends = data
                .iter()
                .enumerate()
                .map(|(i, d)| t[0].isend(1, i as u64, d).unwrap())
                .collect();
            (recvs, sends)
        };
        // The sender waits (and so helps) on its own thread while this one reads.
        std::thread::scope(|scope| {
            scope.spawn(|| crate::wait_all(&sends, deadline()).unwrap());
            crate::wait_all(&recvs, deadline()).unwrap();
        });
        assert_eq!(bufs, data);
    }

    #[test]
    fn sends_go_in_one_copy_as_configured_and_lent() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        let cases = [
            (SingleCopy::Lent(1000), false, false),
            (SingleCopy::Lent(1000), true, true),
            (SingleCopy::Lent(10_000), true, false),
            (SingleCopy::Never, true, false),
            (SingleCopy::From(1000), false, true),
        ];
        for (single_copy, lent, one_copy) in cases {
            let t = pair_with(
                2,
                ShmConfig {
                    single_copy,
                    ..small_slots()
                },
            );
            let mut buf = vec![0u8; data.len()];
            let payload = match lent {
                true => Payload::Lend(&data),
                false => Payload::Send(&data),
            };
            // This thread's next read of the sender's memory fails: only a single copy
            // makes one.
            cma::FAIL_READ_AFTER.set(1);
            // SAFETY: both buffers outlive the transports, declared after them.
            let received = unsafe {
                let r = t[1].irecv(0, 3, &mut buf).unwrap();
                Transport::post(&t[0], 1, 3, payload).unwrap();
                r.wait(deadline())
            };
            cma::FAIL_READ_AFTER.set(0);
            let case = format!("{single_copy:?}, lent: {lent}");
            match received {
                Err(TransportError::Io {
                    peer: 0,
                    op,
                    source,
                    ..
                }) if one_copy => {
                    assert_eq!(
                        (op, source.raw_os_error()),
                        ("recv", Some(libc::EPERM)),
                        "{case}"
                    )
                }
                Ok(()) if !one_copy => assert_eq!(buf, data, "{case}"),
                other => panic!("{case}: {other:?}"),
            }
        }
    }

    #[test]
    fn single_copy_settings_read_from_text() {
        let parse = |text: &str| text.parse::<SingleCopy>();
        assert_eq!(parse("huge"), Ok(SingleCopy::Lent(LENT_MIN)));
        assert_eq!(parse("0"), Ok(SingleCopy::Never));
        assert_eq!(parse(" 65536 "), Ok(SingleCopy::From(65536)));
        assert!(parse("always").is_err());
    }

    #[test]
    fn a_failed_single_copy_receive_is_never_written_afterwards() {
        let t = pair(2);
        let len = 16 * cma::PIECE;
        let data = vec![0xABu8; len];
        let mut buf = vec![0u8; len];
        // This thread's first read of the sender's memory fails.
        cma::FAIL_READ_AFTER.set(1);
        // SAFETY: both buffers outlive the waits (the send's ends in a timeout
        // while the transports are still alive).
        let (r, s) = unsafe {
            (
                t[1].irecv(0, 3, &mut buf).unwrap(),
                t[0].isend(1, 3, &data).unwrap(),
            )
        };
        let err = r.wait(deadline()).unwrap_err();
        assert!(
            err.to_string().contains("read the sender's memory"),
            "{err}"
        );
        // The buffer is the caller's again: the sender, still waiting to be
        // read, must not write a piece into it.
        buf.fill(0x11);
        let sent = s.wait(Instant::now() + Duration::from_millis(200));
        assert!(
            matches!(sent, Err(TransportError::Timeout { .. })),
            "{sent:?}"
        );
        assert!(
            buf.iter().all(|&b| b == 0x11),
            "the sender wrote into a failed receive"
        );
    }

    #[test]
    fn a_single_copy_read_by_a_peer_that_then_leaves_completes() {
        let mut t = pair(2);
        let data: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        let mut buf = vec![0u8; data.len()];
        // SAFETY: both buffers outlive the waits.
        let (s, r) = unsafe {
            (
                t[0].isend(1, 3, &data).unwrap(),
                t[1].irecv(0, 3, &mut buf).unwrap(),
            )
        };
        r.wait(deadline()).unwrap();
        drop(t.remove(1));
        s.wait(deadline()).unwrap();
        assert_eq!(buf, data);
    }

    /// Runs `f(rank, transport, store)` for each transport on its own thread.
    fn each<R: Send>(
        t: &[ShmTransport],
        f: impl Fn(usize, &ShmTransport, &TcpStore) -> R + Sync,
    ) -> Vec<R> {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let port = server.local_addr().port();
        std::thread::scope(|s| {
            let f = &f;
            let threads: Vec<_> = t
                .iter()
                .enumerate()
                .map(|(rank, tr)| {
                    s.spawn(move || {
                        let store =
                            TcpStore::connect("127.0.0.1", port, Duration::from_secs(20)).unwrap();
                        f(rank, tr, &store)
                    })
                })
                .collect();
            threads.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn windows_are_mapped_by_every_rank_and_meetings_order_their_writes() {
        let t = pair(3);
        let sums = each(&t, |rank, tr, store| {
            let w = tr.allocate_window(0, 1000, store).unwrap();
            let place = CallPlace {
                tag: 9 << 32,
                meets: true,
                len: 1,
                root: 0,
                input: Some((0, 8)),
                output: Some((0, 8)),
            };
            let mut sum = 0u64;
            for round in 0..50u8 {
                // SAFETY: own segment, 1000 bytes; peers read it only between meetings.
                unsafe { w.own().add(8 + rank).write(round + rank as u8) };
                tr.meet(&place, deadline(), None).unwrap();
                for peer in 0..3 {
                    // SAFETY: in bounds; every rank wrote its byte before the meeting.
                    sum += u64::from(unsafe { w.segment(peer).add(8 + peer).read() });
                }
                tr.meet(&place, deadline(), None).unwrap();
            }
            assert_eq!(tr.places(&place).unwrap(), vec![place; 3]);
            sum
        });
        // Each round every rank sees 3 * round + 0 + 1 + 2.
        let want: u64 = (0..50u64).map(|r| 3 * r + 3).sum();
        assert_eq!(sums, vec![want; 3]);
    }

    /// Call number `seq` of `len` bytes, met in, on no windows.
    fn meeting_in(seq: u64, len: usize) -> CallPlace {
        CallPlace {
            tag: seq << 32,
            meets: true,
            len,
            ..CallPlace::default()
        }
    }

    #[test]
    fn every_rank_reads_every_ranks_posted_bytes_meeting_after_meeting() {
        // Two bytes between three ranks ride in their turns; a hundred go through mailboxes,
        // gathered on the stack; ten ranks' go through mailboxes gathered in a vector.
        for (n, len) in [(3, 2), (3, 100), (10, 2)] {
            let t = pair(n);
            let place = meeting_in(5, len);
            let bytes = |rank: usize, round: u8| -> Vec<u8> {
                (0..len).map(|i| (rank * 31 + i) as u8 ^ round).collect()
            };
            each(&t, |rank, tr, _| {
                for round in 0..20u8 {
                    let posted = tr.post(&bytes(rank, round));
                    let seen = tr.meet_posted(posted, &place, deadline(), None, |posted| {
                        posted.iter().map(|p| p.to_vec()).collect::<Vec<_>>()
                    });
                    let want: Vec<Vec<u8>> = (0..n).map(|r| bytes(r, round)).collect();
                    assert_eq!(seen.unwrap(), want, "rank {rank}, round {round}");
                    // Posted bytes leave the call's windows empty.
                    assert_eq!(tr.places(&place).unwrap(), vec![place; n]);
                }
            });
        }
    }

    #[test]
    fn posted_bytes_cannot_be_read_after_another_meeting() {
        let t = pair(2);
        let place = meeting_in(6, 100);
        each(&t, |rank, tr, _| {
            let posted = tr.post(&[rank as u8; 100]);
            tr.meet(&place, deadline(), None).unwrap();
            let late = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                tr.meet_posted(posted, &place, deadline(), None, |_| ())
            }));
            let why = late.expect_err("a late read of posted bytes must panic");
            let why = why.downcast_ref::<String>().expect("a formatted message");
            assert!(why.contains("are read by that meeting"), "{why}");
        });
    }

    #[test]
    fn a_meeting_past_its_stall_time_says_so_once_and_goes_on() {
        let t = pair(2);
        let place = meeting_in(3, 0);
        let told = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            s.spawn(|| {
                // Arrives only once the other rank has reported the stall.
                while told.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                t[1].meet(&place, deadline(), None).unwrap();
            });
            let tell = || {
                told.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            };
            let stall = Stall {
                at: Instant::now(),
                tell: &tell,
            };
            t[0].meet(&place, deadline(), Some(stall)).unwrap();
        });
        assert_eq!(told.into_inner(), 1);
    }

    #[test]
    fn windows_of_different_sizes_fail_naming_both() {
        let t = pair(2);
        let errors = each(&t, |rank, tr, store| {
            tr.allocate_window(0, 4096 * (rank + 1), store)
                .unwrap_err()
                .to_string()
        });
        assert!(
            errors[1].contains("8192 bytes, rank 0 for 4096"),
            "{errors:?}"
        );
        assert!(errors[0].contains("ranks [1] could not map"), "{errors:?}");
    }

    #[test]
    fn a_meeting_fails_when_a_peer_runs_the_call_on_messages_or_aborts() {
        let t = pair(2);
        let place = CallPlace {
            tag: 5 << 32,
            meets: true,
            len: 8,
            root: 0,
            input: Some((0, 0)),
            output: Some((0, 0)),
        };
        t[1].announce(&CallPlace {
            meets: false,
            ..place
        });
        let err = t[0].meet(&place, deadline(), None).unwrap_err();
        assert!(
            matches!(err, TransportError::Protocol { peer: 1, .. }),
            "{err}"
        );
        // The same call number but another call (here another length).
        let t = pair(2);
        t[1].announce(&CallPlace {
            tag: 6 << 32,
            len: 16,
            meets: false,
            ..place
        });
        let err = t[0]
            .meet(
                &CallPlace {
                    tag: 6 << 32,
                    ..place
                },
                deadline(),
                None,
            )
            .unwrap_err();
        assert!(err.to_string().contains("rank 1 is in call #6"), "{err}");
        let t = pair(2);
        t[1].abort("gone");
        let err = t[0]
            .meet(
                &CallPlace {
                    tag: 7 << 32,
                    ..place
                },
                deadline(),
                None,
            )
            .unwrap_err();
        assert!(
            matches!(err, TransportError::PeerClosed { peer: 1 }),
            "{err}"
        );
    }

    #[test]
    fn the_file_is_gone_once_connected() {
        let dir = std::env::temp_dir().join(format!("chorus-shm-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let t = pair_with(
            2,
            ShmConfig {
                dir: dir.clone(),
                ..small_slots()
            },
        );
        let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        // The mapping still works without the file.
        let mut buf = [0u8; 4];
        // SAFETY: both buffers outlive the waits.
        let reqs = unsafe {
            [
                t[0].isend(1, 1, b"ring").unwrap(),
                t[1].irecv(0, 1, &mut buf).unwrap(),
            ]
        };
        crate::wait_all(&reqs, deadline()).unwrap();
        assert_eq!(&buf, b"ring");
        std::fs::remove_dir(&dir).unwrap();
    }
}
