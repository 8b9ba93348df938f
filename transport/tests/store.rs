//! Integration tests of the rendezvous store over real sockets on 127.0.0.1.
//!
//! Every blocking step is bounded: threads are joined through `finish_within`, raw sockets
//! have read timeouts, and clients have timeouts. Sleeps only make the interesting
//! interleaving likely; no assertion depends on them.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use chorus_transport::auth::Auth;
use chorus_transport::store::{
    handshake, PrefixStore, Store, StoreError, StoreLimits, StoreServer, TcpStore, MAX_VALUE_LEN,
};
use socket2::{Domain, Socket, Type};

/// Long enough never to pass on a working machine; only a hang would reach it.
const BOUND: Duration = Duration::from_secs(30);
const SHORT: Duration = Duration::from_millis(200);

fn start_server() -> StoreServer {
    StoreServer::bind("127.0.0.1:0".parse().unwrap()).expect("bind on port 0")
}

fn client(server: &StoreServer, timeout: Duration) -> TcpStore {
    TcpStore::connect("127.0.0.1", server.local_addr().port(), timeout).expect("connect")
}

/// Runs `f` on a thread and returns its result, failing the test if it takes over `BOUND`.
fn finish_within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(BOUND)
        .expect("operation did not finish in time")
}

/// A port on which nothing listens, reserved while the socket lives: bound with SO_REUSEADDR
/// and never listening, it keeps the port from every other process, yet a store (which sets
/// SO_REUSEADDR too) may bind it (see chorus-launch's `PortReservation`).
fn reserved_port() -> (Socket, u16) {
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    socket.set_reuse_address(true).unwrap();
    let any: SocketAddr = "0.0.0.0:0".parse().unwrap();
    socket.bind(&any.into()).unwrap();
    let port = socket.local_addr().unwrap().as_socket().unwrap().port();
    (socket, port)
}

#[test]
fn set_get_round_trip() {
    let server = start_server();
    let store = client(&server, BOUND);
    store.set("addr", b"10.0.0.1:4000").unwrap();
    assert_eq!(store.get("addr").unwrap(), b"10.0.0.1:4000");
    store.set("addr", b"replaced").unwrap();
    assert_eq!(store.get("addr").unwrap(), b"replaced");
    store.set("empty", b"").unwrap();
    assert_eq!(store.get("empty").unwrap(), b"");
    let binary: Vec<u8> = (0..=255).collect();
    store.set("binary", &binary).unwrap();
    assert_eq!(store.get("binary").unwrap(), binary);
}

#[test]
fn large_values_round_trip_and_oversized_ones_are_refused() {
    let server = start_server();
    let store = client(&server, BOUND);
    let big: Vec<u8> = (0..16 << 20).map(|i: u32| (i % 251) as u8).collect();
    store.set("big", &big).unwrap();
    assert_eq!(store.get("big").unwrap(), big);
    let too_big = vec![0u8; MAX_VALUE_LEN + 1];
    assert!(matches!(
        store.set("too-big", &too_big),
        Err(StoreError::Protocol(_))
    ));
    let long_key = "k".repeat(4097);
    assert!(matches!(
        store.set(&long_key, b"v"),
        Err(StoreError::Protocol(_))
    ));
    assert_eq!(store.get("big").unwrap().len(), big.len());
}

#[test]
fn get_blocks_until_another_thread_sets_the_key() {
    let server = start_server();
    let waiter = client(&server, BOUND);
    let setter = client(&server, BOUND);
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(waiter.get("rank1/addr"));
    });
    thread::sleep(Duration::from_millis(50)); // Lets the get park first (not required).
    setter.set("rank1/addr", b"10.0.0.2:4000").unwrap();
    let value = rx.recv_timeout(BOUND).expect("get did not return").unwrap();
    assert_eq!(value, b"10.0.0.2:4000");
}

#[test]
fn a_presence_sets_its_key_when_its_connection_closes_unless_released() {
    let server = start_server();
    let store = PrefixStore::new("job", client(&server, BOUND));
    let waiter = client(&server, BOUND);
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(waiter.get("job/left"));
    });
    // Released: the key is never set, even once the connection is gone.
    let kept = store
        .presence("kept", b"never")
        .unwrap()
        .expect("a presence");
    kept.release().unwrap();
    // Dropped (as when the process dies): the waiter wakes with the value.
    let gone = store.presence("left", b"rank 1 is gone").unwrap();
    drop(gone);
    let value = rx.recv_timeout(BOUND).expect("get did not return").unwrap();
    assert_eq!(value, b"rank 1 is gone");
    // A key set before the connection closes keeps its value.
    let late = store.presence("left", b"rank 2 is gone").unwrap();
    drop(late);
    assert_eq!(store.get("left").unwrap(), b"rank 1 is gone");
    assert!(matches!(
        store.wait(&["kept"], SHORT),
        Err(StoreError::Timeout { .. })
    ));
    let bare = client(&server, BOUND);
    assert!(bare.presence("", b"x").is_err());
}

#[test]
fn one_client_shared_by_a_blocked_getter_and_a_setter() {
    let server = start_server();
    let store = Arc::new(client(&server, BOUND));
    let getter = Arc::clone(&store);
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(getter.get("late"));
    });
    thread::sleep(Duration::from_millis(50)); // Lets the get take the connection first.
    store.set("late", b"here").unwrap();
    assert_eq!(rx.recv_timeout(BOUND).unwrap().unwrap(), b"here");
}

#[test]
fn wait_returns_once_every_key_is_set() {
    let server = start_server();
    let waiter = client(&server, BOUND);
    let setter = client(&server, BOUND);
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(waiter.wait(&["a", "b", "c"], BOUND));
    });
    // A wait that returned early has had every chance to say so during the pause: only a
    // broken wait can fail this check, however slow the machine.
    for key in ["c", "a"] {
        setter.set(key, key.as_bytes()).unwrap();
        match rx.recv_timeout(SHORT) {
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            returned => panic!("wait returned before key 'b' was set: {returned:?}"),
        }
    }
    setter.set("b", b"b").unwrap();
    rx.recv_timeout(BOUND)
        .expect("wait did not return once every key was set")
        .unwrap();
    setter.wait(&["a", "b", "c"], SHORT).unwrap();
    setter.wait(&[], SHORT).unwrap();
}

#[test]
fn wait_timeout_names_the_missing_keys() {
    let server = start_server();
    let store = client(&server, BOUND);
    store.set("present", b"1").unwrap();
    let result = store.wait(&["present", "missing1", "missing2"], SHORT);
    match result {
        Err(StoreError::Timeout { keys, waited }) => {
            assert_eq!(keys, ["missing1", "missing2"]);
            assert_eq!(waited, SHORT);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    let message = store.wait(&["missing1"], SHORT).unwrap_err().to_string();
    assert!(message.contains("missing1"), "{message}");
    // The timed-out connection was replaced: the client keeps working.
    store.set("missing1", b"1").unwrap();
    assert_eq!(store.get("missing1").unwrap(), b"1");
}

#[test]
fn get_times_out_with_the_store_timeout_then_recovers() {
    let server = start_server();
    let store = client(&server, SHORT);
    match store.get("never") {
        Err(StoreError::Timeout { keys, waited }) => {
            assert_eq!(keys, ["never"]);
            assert_eq!(waited, SHORT);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    store.set("after", b"ok").unwrap();
    assert_eq!(store.get("after").unwrap(), b"ok");
}

#[test]
fn add_from_eight_threads_is_atomic() {
    let server = start_server();
    let shared = Arc::new(client(&server, BOUND));
    let port = server.local_addr().port();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let shared = Arc::clone(&shared);
            thread::spawn(move || {
                // Half the threads share one client, half have their own.
                let own = TcpStore::connect("127.0.0.1", port, BOUND).unwrap();
                let store: &dyn Store = if t % 2 == 0 { &*shared } else { &own };
                for _ in 0..100 {
                    store.add("counter", 1).unwrap();
                }
            })
        })
        .collect();
    finish_within(move || threads.into_iter().for_each(|t| t.join().unwrap()));
    assert_eq!(shared.add("counter", 0).unwrap(), 800);
    assert_eq!(shared.get("counter").unwrap(), b"800");
    assert_eq!(shared.add("counter", -801).unwrap(), -1);
}

#[test]
fn add_on_a_non_integer_value_is_refused_and_the_client_keeps_working() {
    let server = start_server();
    let store = client(&server, BOUND);
    store.set("text", b"not a number").unwrap();
    assert!(matches!(store.add("text", 1), Err(StoreError::Protocol(_))));
    store.set("max", i64::MAX.to_string().as_bytes()).unwrap();
    assert!(matches!(store.add("max", 1), Err(StoreError::Protocol(_))));
    assert_eq!(store.add("fresh", 5).unwrap(), 5);
}

#[test]
fn prefix_store_isolates_keys() {
    let server = start_server();
    let root: Arc<dyn Store> = Arc::new(client(&server, BOUND));
    let comm_a = PrefixStore::new("a", Arc::clone(&root));
    let comm_b = PrefixStore::new("b", Arc::clone(&root));
    comm_a.set("rank0", b"A").unwrap();
    comm_b.set("rank0", b"B").unwrap();
    assert_eq!(comm_a.get("rank0").unwrap(), b"A");
    assert_eq!(comm_b.get("rank0").unwrap(), b"B");
    assert_eq!(root.get("a/rank0").unwrap(), b"A");
    assert_eq!(comm_a.add("n", 2).unwrap(), 2);
    assert_eq!(comm_b.add("n", 3).unwrap(), 3);
    comm_a.wait(&["rank0", "n"], SHORT).unwrap();

    let nested = PrefixStore::new("sub", PrefixStore::new("a", Arc::clone(&root)));
    nested.set("k", b"v").unwrap();
    assert_eq!(root.get("a/sub/k").unwrap(), b"v");
    match comm_b.wait(&["k"], SHORT) {
        Err(StoreError::Timeout { keys, .. }) => assert_eq!(keys, ["b/k"]),
        other => panic!("expected a timeout, got {other:?}"),
    }
}

#[test]
fn binding_a_busy_port_names_the_address() {
    let server = start_server();
    let busy = server.local_addr();
    match StoreServer::bind(busy) {
        Err(StoreError::Bind { addr, source }) => {
            assert_eq!(addr, busy);
            assert_eq!(source.kind(), ErrorKind::AddrInUse);
            let message = StoreError::Bind { addr, source }.to_string();
            assert!(message.contains(&busy.to_string()), "{message}");
        }
        other => panic!("expected a bind error, got {other:?}"),
    }
}

#[test]
fn connecting_where_nothing_listens_times_out() {
    let (_reserved, port) = reserved_port();
    let start = Instant::now();
    match TcpStore::connect("127.0.0.1", port, SHORT) {
        Err(StoreError::Connect { addr, waited, .. }) => {
            assert_eq!(addr, format!("127.0.0.1:{port}"));
            assert!(waited >= SHORT, "gave up after {waited:?}");
        }
        other => panic!("expected a connect error, got {other:?}"),
    }
    assert!(start.elapsed() < BOUND);
}

#[test]
fn an_unresolvable_host_is_a_connect_error() {
    match TcpStore::connect("no-such-host.invalid", 29500, SHORT) {
        Err(e @ StoreError::Connect { .. }) => {
            assert!(e.to_string().contains("no-such-host.invalid"), "{e}");
        }
        other => panic!("expected a connect error, got {other:?}"),
    }
}

#[test]
fn a_client_started_before_the_server_retries_until_it_is_up() {
    let (_reserved, port) = reserved_port();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(TcpStore::connect("localhost", port, BOUND));
    });
    thread::sleep(Duration::from_millis(100)); // Lets the client fail a few times (not required).
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let server = StoreServer::bind(addr).expect("the store binds the reserved port");
    let store = rx
        .recv_timeout(BOUND)
        .expect("connect did not return")
        .unwrap();
    store.set("up", b"yes").unwrap();
    assert_eq!(client(&server, BOUND).get("up").unwrap(), b"yes");
}

/// A raw connection that has passed the handshake (no job id, no secret).
fn admitted(addr: SocketAddr) -> TcpStream {
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.set_read_timeout(Some(BOUND)).unwrap();
    handshake::client(&mut raw, &Auth::default()).expect("handshake");
    raw
}

/// Sends `bytes` on a fresh raw connection (admitted first, or not) and reports whether the
/// server closed it, reading past the challenge and anything else it sent first.
fn server_closes_after(addr: SocketAddr, admit: bool, bytes: &[u8]) -> bool {
    let mut raw = if admit {
        admitted(addr)
    } else {
        TcpStream::connect(addr).unwrap()
    };
    raw.set_read_timeout(Some(SHORT * 10)).unwrap();
    // The server may close before everything is written; that is what we test for.
    let _ = raw.write_all(bytes);
    let mut buf = [0u8; 64];
    let mut unanswered = 0;
    loop {
        match raw.read(&mut buf) {
            Ok(0) => return true,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
            Ok(n) => unanswered += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(e) => panic!("no answer from the server after {unanswered} bytes: {e}"),
        }
    }
}

fn frame_header(op: u8, a: u32, b: u32) -> Vec<u8> {
    let mut frame = b"CHS1".to_vec();
    frame.push(op);
    frame.extend_from_slice(&a.to_le_bytes());
    frame.extend_from_slice(&b.to_le_bytes());
    frame
}

#[test]
fn garbage_connections_are_dropped_while_good_clients_keep_working() {
    let server = start_server();
    let addr = server.local_addr();
    let good = client(&server, BOUND);
    good.set("before", b"1").unwrap();

    // Held open for the whole test: a silent stranger and a half-sent 1 MiB value.
    let _silent = TcpStream::connect(addr).unwrap();
    let mut half_sent = TcpStream::connect(addr).unwrap();
    half_sent.write_all(&frame_header(1, 1, 1 << 20)).unwrap();
    half_sent.write_all(b"k0123456789").unwrap();

    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let random: Vec<u8> = (0..4096)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 24) as u8
        })
        .collect();
    let mut random = random;
    random[0] = b'G'; // Never a valid magic, whatever the generator gives.
    let garbage: [(&str, Vec<u8>); 5] = [
        ("random bytes", random),
        ("wrong magic", b"HTTP/1.1 GET /\r\n\r\n".to_vec()),
        ("huge key length", frame_header(1, u32::MAX, 0)),
        ("huge value length", frame_header(1, 1, u32::MAX)),
        ("unknown opcode", frame_header(42, 1, 1)),
    ];
    for (what, bytes) in garbage {
        for admit in [false, true] {
            assert!(
                server_closes_after(addr, admit, &bytes),
                "{what} was not dropped (admitted: {admit})"
            );
            good.set(what, b"ok").unwrap();
            assert_eq!(good.get(what).unwrap(), b"ok");
        }
    }

    // A truncated frame, then close.
    let mut truncated = TcpStream::connect(addr).unwrap();
    truncated.write_all(&frame_header(1, 3, 5)[..7]).unwrap();
    drop(truncated);

    good.set("after", b"2").unwrap();
    good.wait(&["before", "after"], BOUND).unwrap();
    let other = client(&server, BOUND);
    assert_eq!(other.get("after").unwrap(), b"2");
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let server = start_server();
    let mut raw = admitted(server.local_addr());
    let mut requests = Vec::new();
    for key in ["p", "q"] {
        requests.extend_from_slice(&frame_header(2, 1, 0));
        requests.extend_from_slice(key.as_bytes());
    }
    raw.write_all(&requests).unwrap();
    let setter = client(&server, BOUND);
    setter.set("q", b"Q").unwrap();
    setter.set("p", b"P").unwrap();
    for value in [b"P", b"Q"] {
        let mut response = [0u8; 10];
        raw.read_exact(&mut response).unwrap();
        assert_eq!(&response[..4], b"CHS1");
        assert_eq!(response[4], 0, "status OK");
        assert_eq!(response[5..9], 1u32.to_le_bytes());
        assert_eq!(response[9], value[0]);
    }
}

#[test]
fn dropping_the_server_fails_a_waiting_get_promptly() {
    let server = start_server();
    let store = client(&server, BOUND);
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(store.get("never"));
    });
    thread::sleep(Duration::from_millis(50)); // Lets the get park first (not required).
    finish_within(move || drop(server));
    match rx.recv_timeout(BOUND).expect("get did not return") {
        Err(StoreError::Closed) => {}
        other => panic!("expected Closed, got {other:?}"),
    }
}

#[test]
fn a_request_after_the_server_has_gone_fails_at_once_rather_than_at_the_timeout() {
    let server = start_server();
    let port = server.local_addr().port();
    // A timeout the test's bound can tell apart from failing at once.
    let store = Arc::new(client(&server, 3 * BOUND));
    store.set("k", b"v").expect("set while the server is up");
    drop(server);
    // The pooled connection is closed now, and nothing listens on the port any more: the
    // server has gone for good, not "not up yet", so requests do not retry to their timeout.
    let first = finish_within({
        let store = Arc::clone(&store);
        move || store.get("k")
    });
    assert!(matches!(first, Err(StoreError::Closed)), "{first:?}");
    match finish_within(move || store.get("k")) {
        Err(StoreError::Connect { addr, .. }) => {
            assert!(addr.ends_with(&format!(":{port}")), "{addr}")
        }
        other => panic!("expected the store to be gone, got {other:?}"),
    }
}

#[test]
fn many_clients_share_one_server_thread() {
    const CLIENTS: usize = 256;
    let server = start_server();
    let clients: Vec<TcpStore> = (0..CLIENTS).map(|_| client(&server, BOUND)).collect();
    for (rank, store) in clients.iter().enumerate() {
        store
            .set(&format!("rank{rank}"), rank.to_string().as_bytes())
            .unwrap();
    }
    let keys: Vec<String> = (0..CLIENTS).map(|rank| format!("rank{rank}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    for (rank, store) in clients.iter().enumerate() {
        store.wait(&keys, BOUND).unwrap();
        let peer = (rank + 1) % CLIENTS;
        assert_eq!(store.get(keys[peer]).unwrap(), peer.to_string().as_bytes());
    }
}

#[test]
fn only_clients_of_the_same_job_with_the_secret_are_admitted() {
    let job = |id: &str, token: &str| Auth::new(id, token).unwrap();
    let server =
        StoreServer::bind_with_auth("127.0.0.1:0".parse().unwrap(), job("job-a", "s3cret"))
            .unwrap();
    let port = server.local_addr().port();
    let member =
        TcpStore::connect_with_auth("127.0.0.1", port, BOUND, job("job-a", "s3cret")).unwrap();
    member.set("k", b"v").unwrap();
    let refusals = [
        (job("job-a", "wrong"), "CHORUS_AUTH_TOKEN"),
        (job("job-b", "s3cret"), "job-b"),
        (Auth::default(), "job-a"),
    ];
    for (auth, needle) in refusals {
        let start = Instant::now();
        let err = TcpStore::connect_with_auth("127.0.0.1", port, BOUND, auth.clone()).unwrap_err();
        assert!(matches!(err, StoreError::Refused(_)), "{auth:?}: {err}");
        assert!(err.to_string().contains(needle), "{auth:?}: {err}");
        assert!(start.elapsed() < BOUND / 2, "a refusal is not retried");
    }
    assert_eq!(member.get("k").unwrap(), b"v");
}

fn start_limited(limits: StoreLimits) -> StoreServer {
    StoreServer::bind_with_limits("127.0.0.1:0".parse().unwrap(), Auth::default(), limits)
        .expect("bind on port 0")
}

/// A raw connection that has read the challenge (so the server has accepted it) and sends
/// one byte of its answer, and no more.
fn stranger(addr: SocketAddr) -> TcpStream {
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.set_read_timeout(Some(BOUND)).unwrap();
    let mut challenge = [0u8; handshake::CHALLENGE_LEN];
    raw.read_exact(&mut challenge).unwrap();
    raw.write_all(&handshake::MAGIC[..1]).unwrap();
    raw
}

#[test]
fn a_set_past_the_stores_limit_is_refused_saying_so() {
    let server = start_limited(StoreLimits {
        max_bytes: 1 << 20,
        ..StoreLimits::default()
    });
    let store = client(&server, BOUND);
    store.set("a", &vec![1u8; 600 << 10]).unwrap();
    let err = store.set("b", &vec![2u8; 600 << 10]).unwrap_err();
    assert!(
        matches!(&err, StoreError::Protocol(m) if m.contains("store is full") && m.contains("limit of 1048576")),
        "{err}"
    );
    // The client keeps working, and a replaced value counts once.
    assert_eq!(store.get("a").unwrap().len(), 600 << 10);
    store.set("a", &vec![3u8; 900 << 10]).unwrap();
    assert_eq!(store.get("a").unwrap(), vec![3u8; 900 << 10]);
}

#[test]
fn clients_past_the_connection_limit_are_refused_saying_so() {
    let server = start_limited(StoreLimits {
        max_connections: 1,
        ..StoreLimits::default()
    });
    let _held = stranger(server.local_addr());
    let port = server.local_addr().port();
    let err = TcpStore::connect("127.0.0.1", port, BOUND).unwrap_err();
    assert!(matches!(err, StoreError::Refused(_)), "{err}");
    assert!(
        err.to_string()
            .contains("already serves 1 connections, its limit"),
        "{err}"
    );
}

#[test]
fn a_connection_that_never_answers_the_challenge_is_dropped_at_its_deadline() {
    let server = start_limited(StoreLimits {
        handshake_deadline: SHORT,
        ..StoreLimits::default()
    });
    let mut raw = stranger(server.local_addr());
    // Meanwhile a good client is served: the stranger is never waited on.
    let store = client(&server, BOUND);
    finish_within(move || {
        store.set("k", b"v").unwrap();
        assert_eq!(store.get("k").unwrap(), b"v");
    });
    let mut rest = Vec::new();
    match raw.read_to_end(&mut rest) {
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the silent connection was not dropped: {e}"),
    }
}
