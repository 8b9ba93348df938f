//! The TCP transport between threads of one process, over real loopback sockets.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use chorus_transport::store::{PrefixStore, Store, StoreServer, TcpStore};
use chorus_transport::tcp::{TcpConfig, TcpTransport};
use chorus_transport::{Transport, TransportError};

const TIMEOUT: Duration = Duration::from_secs(20);

fn deadline() -> Instant {
    Instant::now() + TIMEOUT
}

/// Runs `body(transport)` on `world` threads connected through a fresh store.
fn with_ranks<T: Send + 'static>(
    world: usize,
    nsocks: usize,
    body: impl Fn(TcpTransport) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = server.local_addr().port();
    let body = Arc::new(body);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let body = body.clone();
            thread::spawn(move || {
                let store = TcpStore::connect("127.0.0.1", port, TIMEOUT).unwrap();
                let store = PrefixStore::new("test", store);
                let config = TcpConfig {
                    nsocks,
                    min_stripe: 4096,
                    timeout: TIMEOUT,
                    ..TcpConfig::default()
                };
                let t = TcpTransport::connect(rank, world, &store as &dyn Store, &config).unwrap();
                body(t)
            })
        })
        .collect();
    let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
    drop(server);
    out
}

fn pattern(rank: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + rank * 7 + len) as u8).collect()
}

#[test]
fn ring_exchange_of_many_sizes() {
    for nsocks in [1, 3] {
        with_ranks(4, nsocks, |t| {
            let (rank, world) = (t.rank(), t.world_size());
            let right = (rank + 1) % world;
            let left = (rank + world - 1) % world;
            for (k, len) in [0usize, 1, 7, 4096, 3 * 4096 + 5, (1 << 20) + 7]
                .into_iter()
                .enumerate()
            {
                let data = pattern(rank, len);
                let mut got = vec![0u8; len];
                // SAFETY: both buffers outlive the waits below.
                let (s, r) = unsafe {
                    (
                        t.isend(right, k as u64, &data).unwrap(),
                        t.irecv(left, k as u64, &mut got).unwrap(),
                    )
                };
                r.wait(deadline()).unwrap();
                s.wait(deadline()).unwrap();
                assert_eq!(got, pattern(left, len), "rank {rank} len {len}");
            }
        });
    }
}

#[test]
fn many_messages_in_flight_keep_their_order() {
    with_ranks(2, 2, |t| {
        let peer = 1 - t.rank();
        let sends: Vec<Vec<u8>> = (0..64)
            .map(|i| pattern(t.rank() + i, 100 + i * 997))
            .collect();
        let mut recvs: Vec<Vec<u8>> = (0..64).map(|i| vec![0u8; 100 + i * 997]).collect();
        // SAFETY: the buffers live until every request is waited on below.
        let reqs: Vec<_> = unsafe {
            let mut reqs: Vec<_> = sends.iter().map(|d| t.isend(peer, 9, d).unwrap()).collect();
            reqs.extend(recvs.iter_mut().map(|b| t.irecv(peer, 9, b).unwrap()));
            reqs
        };
        chorus_transport::wait_all(&reqs, deadline()).unwrap();
        for (i, got) in recvs.iter().enumerate() {
            assert_eq!(got, &pattern(peer + i, 100 + i * 997));
        }
    });
}

#[test]
fn mismatched_length_is_a_protocol_error_naming_the_peer() {
    let errors = with_ranks(2, 1, |t| {
        if t.rank() == 0 {
            let data = vec![1u8; 64];
            // SAFETY: `data` outlives the wait.
            let s = unsafe { t.isend(1, 5, &data).unwrap() };
            let _ = s.wait(deadline());
            None
        } else {
            let mut buf = vec![0u8; 128];
            // SAFETY: `buf` outlives the wait.
            let r = unsafe { t.irecv(0, 5, &mut buf).unwrap() };
            Some(r.wait(deadline()).unwrap_err())
        }
    });
    let err = errors[1].clone().unwrap();
    assert!(
        matches!(err, TransportError::Protocol { peer: 0, .. }),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("64 bytes") && text.contains("128 bytes"),
        "{text}"
    );
}

#[test]
fn mismatched_tag_is_a_protocol_error() {
    let errors = with_ranks(2, 2, |t| {
        let peer = 1 - t.rank();
        let data = [0u8; 8];
        let mut buf = [0u8; 8];
        // SAFETY: both buffers outlive the waits.
        let (s, r) = unsafe {
            (
                t.isend(peer, t.rank() as u64, &data).unwrap(),
                t.irecv(peer, t.rank() as u64, &mut buf).unwrap(),
            )
        };
        let _ = s.wait(deadline());
        r.wait(deadline()).unwrap_err()
    });
    // The first rank to notice closes the connection, so the other may see that instead.
    for (rank, err) in errors.iter().enumerate() {
        let peer = 1 - rank;
        let named = matches!(err, TransportError::Protocol { peer: p, .. } | TransportError::PeerClosed { peer: p } if *p == peer);
        assert!(named, "{err}");
    }
    assert!(
        errors.iter().any(|e| e.to_string().contains("tag")),
        "{errors:?}"
    );
}

#[test]
fn a_departed_peer_fails_receives_with_its_rank() {
    let errors = with_ranks(3, 2, |t| {
        match t.rank() {
            2 => {
                drop(t);
                None
            }
            _ => {
                let mut buf = vec![0u8; 1 << 16];
                // SAFETY: `buf` outlives the wait.
                let r = unsafe { t.irecv(2, 0, &mut buf).unwrap() };
                Some(r.wait(deadline()).unwrap_err())
            }
        }
    });
    for err in errors.into_iter().flatten() {
        assert!(
            matches!(err, TransportError::PeerClosed { peer: 2 }),
            "{err}"
        );
    }
}

#[test]
fn abort_fails_pending_requests_and_peers_see_it() {
    let errors = with_ranks(2, 1, |t| {
        let peer = 1 - t.rank();
        let mut buf = vec![0u8; 32];
        // SAFETY: `buf` outlives the request: abort returns, or the wait ends, before it is dropped.
        let r = unsafe { t.irecv(peer, 1, &mut buf) };
        if t.rank() == 0 {
            t.abort("test abort");
            // SAFETY: fails at once, nothing is posted.
            let later = unsafe { t.isend(peer, 1, &buf) };
            assert!(matches!(later, Err(TransportError::Aborted(_))));
        }
        // Rank 1 may see rank 0 leave before or after it posts.
        r.and_then(|r| r.wait(deadline())).unwrap_err()
    });
    aborted_and_closed(&errors, "test abort");
}

/// Rank 0 aborted with `why`; rank 1 saw it leave.
fn aborted_and_closed(errors: &[TransportError], why: &str) {
    assert!(
        matches!(errors[0], TransportError::Aborted(ref w) if w == why),
        "{}",
        errors[0]
    );
    assert!(
        matches!(errors[1], TransportError::PeerClosed { peer: 0 }),
        "{}",
        errors[1]
    );
}

#[test]
fn invalid_peers_are_rejected() {
    with_ranks(2, 1, |t| {
        let data = [0u8; 1];
        // SAFETY: fails at once, nothing is posted.
        let err = unsafe { t.isend(t.rank(), 0, &data) }.unwrap_err();
        assert!(matches!(err, TransportError::InvalidPeer { .. }));
        // SAFETY: as above.
        let err = unsafe { t.isend(7, 0, &data) }.unwrap_err();
        assert!(err.to_string().contains("invalid peer rank 7"), "{err}");
    });
}

#[test]
fn a_sleeping_waiter_reads_what_another_peer_needs() {
    // Rank 0 waits for rank 2, which waits for rank 1, whose large send only finishes once
    // rank 0 reads it: rank 0's waiter, asleep on rank 2, must read rank 1's socket too.
    const BIG: usize = 64 << 20;
    with_ranks(3, 1, |t| match t.rank() {
        0 => {
            let mut big = vec![0u8; BIG];
            let mut small = [0u8; 8];
            // SAFETY: both buffers outlive the waits below.
            let (b, s) = unsafe {
                (
                    t.irecv(1, 1, &mut big).unwrap(),
                    t.irecv(2, 2, &mut small).unwrap(),
                )
            };
            s.wait(deadline()).unwrap();
            b.wait(deadline()).unwrap();
            assert_eq!(small, [2; 8]);
            assert!(big == pattern(1, BIG), "rank 1's message arrived changed");
        }
        1 => {
            let data = pattern(1, BIG);
            // SAFETY: `data` outlives the waits.
            let b = unsafe { t.isend(0, 1, &data).unwrap() };
            b.wait(deadline()).unwrap();
            let go = [1u8; 8];
            // SAFETY: as above.
            unsafe { t.isend(2, 3, &go).unwrap() }
                .wait(deadline())
                .unwrap();
        }
        _ => {
            let mut go = [0u8; 8];
            // SAFETY: `go` outlives the wait.
            unsafe { t.irecv(1, 3, &mut go).unwrap() }
                .wait(deadline())
                .unwrap();
            let small = [2u8; 8];
            // SAFETY: `small` outlives the wait.
            unsafe { t.isend(0, 2, &small).unwrap() }
                .wait(deadline())
                .unwrap();
        }
    });
}

#[test]
fn waiters_asleep_on_their_sends_read_each_others() {
    // Each rank waits on its 64 MiB send, more than the kernel buffers hold, before its receive:
    // the send only finishes if the peer, asleep on its own send, reads meanwhile.
    const LEN: usize = 64 << 20;
    with_ranks(2, 1, |t| {
        let peer = 1 - t.rank();
        let data = pattern(t.rank(), LEN);
        let mut got = vec![0u8; LEN];
        // SAFETY: both buffers outlive the waits below.
        let r = unsafe { t.irecv(peer, 4, &mut got).unwrap() };
        thread::sleep(Duration::from_millis(20 * (1 + t.rank() as u64)));
        // SAFETY: as above.
        let s = unsafe { t.isend(peer, 4, &data).unwrap() };
        s.wait(deadline()).unwrap();
        r.wait(deadline()).unwrap();
        assert!(
            got == pattern(peer, LEN),
            "rank {} got changed bytes",
            t.rank()
        );
    });
}

#[test]
fn an_abort_wakes_a_sleeping_waiter() {
    let errors = with_ranks(2, 1, |t| {
        let peer = 1 - t.rank();
        let mut buf = [0u8; 8];
        thread::scope(|scope| {
            // SAFETY: `buf` outlives the wait, which ends before the scope does.
            let r = unsafe { t.irecv(peer, 6, &mut buf).unwrap() };
            let waiter = scope.spawn(move || r.wait(deadline()).unwrap_err());
            if t.rank() == 0 {
                // Long past spinning: the waiter sleeps in poll(2) when the abort comes.
                thread::sleep(Duration::from_millis(100));
                t.abort("stopped by the test");
            }
            waiter.join().unwrap()
        })
    });
    aborted_and_closed(&errors, "stopped by the test");
}

/// Probes `peer` until the probe reports a message or fails (bounded by the test's timeout).
fn probe_until(t: &TcpTransport, peer: usize) -> Result<(u64, usize), TransportError> {
    let end = deadline();
    loop {
        if let Some(next) = t.probe(peer)? {
            return Ok(next);
        }
        assert!(
            Instant::now() < end,
            "nothing from rank {peer} within {TIMEOUT:?}"
        );
        thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn probe_shows_the_next_message_without_taking_it() {
    // Small, striped over every socket, empty, and striped in 4 KiB stripes.
    const MESSAGES: [(u64, usize); 4] = [(4, 10), (5, (1 << 20) + 7), (6, 0), (7, 3 * 4096)];
    for nsocks in [1, 3] {
        with_ranks(3, nsocks, move |t| match t.rank() {
            0 => {
                for (tag, len) in MESSAGES {
                    assert_eq!(probe_until(&t, 1).unwrap(), (tag, len), "nsocks {nsocks}");
                    // Looking again shows the same message: the probe took nothing.
                    assert_eq!(t.probe(1).unwrap(), Some((tag, len)));
                    let mut got = vec![0u8; len];
                    // SAFETY: `got` outlives the wait.
                    let r = unsafe { t.irecv(1, tag, &mut got).unwrap() };
                    r.wait(deadline()).unwrap();
                    assert_eq!(got, pattern(1, len), "nsocks {nsocks} tag {tag}");
                }
                // Rank 1 left once its sends were done, rank 2 without sending anything:
                // both are errors, not "nothing yet".
                for peer in [1, 2] {
                    let err = probe_until(&t, peer).unwrap_err();
                    assert!(
                        matches!(err, TransportError::PeerClosed { peer: p } if p == peer),
                        "{err}"
                    );
                }
                for peer in [0, 3] {
                    let err = t.probe(peer).unwrap_err();
                    assert!(matches!(err, TransportError::InvalidPeer { .. }), "{err}");
                }
            }
            1 => {
                let data: Vec<Vec<u8>> = MESSAGES.iter().map(|&(_, n)| pattern(1, n)).collect();
                // SAFETY: `data` outlives the waits.
                let reqs: Vec<_> = unsafe {
                    MESSAGES
                        .iter()
                        .zip(&data)
                        .map(|(&(tag, _), d)| t.isend(0, tag, d).unwrap())
                        .collect()
                };
                chorus_transport::wait_all(&reqs, deadline()).unwrap();
            }
            _ => {}
        });
    }
}

#[test]
fn sendrecv_numbers_its_messages_as_isend_and_irecv_do() {
    // Around a ring, exchanges of every size (small ones may skip requests, larger ones and
    // those whose socket is busy are posted) between plain sends and receives, on one
    // socket per peer and on three.
    for nsocks in [1, 3] {
        with_ranks(3, nsocks, |t| {
            let (rank, world) = (t.rank(), t.world_size());
            let (right, left) = ((rank + 1) % world, (rank + world - 1) % world);
            for (k, len) in [0usize, 1, 8, 216, 217, 5000].into_iter().enumerate() {
                let tag = k as u64;
                let (data, plain) = (pattern(rank, len), pattern(rank + 10, len + 1));
                let (mut got, mut got_plain) = (vec![0u8; len], vec![0u8; len + 1]);
                // SAFETY: every buffer outlives the waits below.
                unsafe {
                    // Every other time a receive posted first keeps the exchange's socket busy.
                    let busy = k % 2 == 0;
                    let early = t.irecv(left, tag, &mut got_plain).unwrap();
                    let s = t.isend(right, tag, &plain).unwrap();
                    if !busy {
                        early.wait(deadline()).unwrap();
                    }
                    let pending = t.sendrecv(right, left, tag, &data, &mut got).unwrap();
                    let reqs = [Some(early), Some(s), pending.send, pending.recv];
                    for req in reqs.iter().flatten() {
                        req.wait(deadline()).unwrap();
                    }
                }
                assert_eq!(got, pattern(left, len), "rank {rank} len {len}");
                assert_eq!(
                    got_plain,
                    pattern(left + 10, len + 1),
                    "rank {rank} len {len}"
                );
            }
        });
    }
}

#[test]
fn an_exchange_whose_reply_comes_later_returns_its_receive_pending() {
    with_ranks(2, 1, |t| {
        let mut buf = [0u8; 8];
        if t.rank() == 1 {
            // SAFETY: `buf` outlives the wait below.
            let pending = unsafe { t.sendrecv(0, 0, 1, &[1; 8], &mut buf).unwrap() };
            // Rank 0 answers only after this rank's next message, sent once the exchange
            // has returned: its receive must still be pending.
            let recv = pending.recv.expect("the reply cannot have come yet");
            // SAFETY: the data is static.
            let go = unsafe { t.isend(0, 2, &[0]).unwrap() };
            go.wait(deadline()).unwrap();
            recv.wait(deadline()).unwrap();
            assert_eq!(buf, [3; 8]);
        } else {
            let mut go = [0u8; 1];
            // SAFETY: both buffers outlive the waits below.
            unsafe {
                t.irecv(1, 1, &mut buf).unwrap().wait(deadline()).unwrap();
                t.irecv(1, 2, &mut go).unwrap().wait(deadline()).unwrap();
                t.isend(1, 1, &[3; 8]).unwrap().wait(deadline()).unwrap();
            }
            assert_eq!(buf, [1; 8]);
        }
    });
}
