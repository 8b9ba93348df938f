//! The TCP transport: several sockets per peer, striped, with a progress thread.

mod engine;
pub mod frame;
mod mesh;

use std::net::IpAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::auth::Auth;

use crate::store::Store;
use crate::{LinkCost, Request, Transport, TransportError};
use engine::Shared;

/// What a TCP message costs over loopback or a LAN, as measured with the perf
/// tools on a 2-core host: 10 us per message, 1.5 GB/s on one stream.
pub const LINK_COST: LinkCost = LinkCost {
    latency: 10e-6,
    bandwidth: 1.5e9,
};

/// Settings of the TCP transport.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Sockets per peer; large messages are striped over them.
    pub nsocks: usize,
    /// Smallest stripe in bytes; shorter messages use one socket.
    pub min_stripe: usize,
    /// The address other ranks reach this one at (the listener binds it).
    pub addr: IpAddr,
    /// Bound on connection set-up: waiting for peers to publish and connect.
    pub timeout: Duration,
    /// The job's identity and secret, proven on every socket.
    pub auth: Auth,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            nsocks: 1,
            min_stripe: 256 << 10,
            addr: IpAddr::from([127, 0, 0, 1]),
            timeout: Duration::from_secs(300),
            auth: Auth::default(),
        }
    }
}

/// A [`Transport`] over TCP sockets, fully connected between all ranks.
#[derive(Debug)]
pub struct TcpTransport {
    rank: usize,
    world_size: usize,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl TcpTransport {
    /// Connects `rank` to every other rank, exchanging addresses through `store`.
    ///
    /// Keys are written under the store as given (wrap it in a
    /// [`PrefixStore`](crate::store::PrefixStore) per communicator). Fails if
    /// a peer does not publish or connect within `config.timeout` (the error
    /// lists the missing ranks), or on any socket error.
    pub fn connect(
        rank: usize,
        world_size: usize,
        store: &dyn Store,
        config: &TcpConfig,
    ) -> Result<TcpTransport, TransportError> {
        if rank >= world_size {
            return Err(TransportError::Setup(format!(
                "rank {rank} is not below the world size {world_size}"
            )));
        }
        let sockets = mesh::connect_all(rank, world_size, store, config)?;
        let (shared, poll) = Shared::new(rank, sockets, config.min_stripe)
            .map_err(|e| TransportError::Setup(format!("cannot register sockets: {e}")))?;
        let runner = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("chorus-tcp-{rank}"))
            .spawn(move || runner.run(poll))
            .map_err(|e| TransportError::Setup(format!("cannot start the progress thread: {e}")))?;
        tracing::debug!(
            rank,
            world_size,
            nsocks = config.nsocks,
            "tcp transport connected"
        );
        Ok(TcpTransport {
            rank,
            world_size,
            shared,
            thread: Some(thread),
        })
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    unsafe fn isend(&self, peer: usize, tag: u64, data: &[u8]) -> Result<Request, TransportError> {
        let mut engine = self.shared.lock();
        // SAFETY: the caller keeps `data` valid until completion or abort (trait contract).
        let req = unsafe { engine.post_send(peer, tag, data.as_ptr(), data.len()) };
        self.shared.hand_over(&mut engine);
        req.map(|r| r.with_progress(self.shared.clone()))
    }

    unsafe fn irecv(
        &self,
        peer: usize,
        tag: u64,
        buf: &mut [u8],
    ) -> Result<Request, TransportError> {
        let mut engine = self.shared.lock();
        // SAFETY: the caller keeps `buf` valid and unaliased until completion or abort.
        let req = unsafe { engine.post_recv(peer, tag, buf.as_mut_ptr(), buf.len()) };
        self.shared.hand_over(&mut engine);
        req.map(|r| r.with_progress(self.shared.clone()))
    }

    fn probe(&self, peer: usize) -> Result<Option<(u64, usize)>, TransportError> {
        let mut engine = self.shared.lock();
        let next = engine.probe(peer);
        // A peer found failed has had its requests failed: their waiters are told.
        self.shared.tell_sleepers(&mut engine);
        next
    }

    fn abort(&self, reason: &str) {
        let mut engine = self.shared.lock();
        engine.abort(reason, true);
        self.shared.hand_over(&mut engine);
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.shared.stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let mut engine = self.shared.lock();
        engine.abort("transport dropped", false);
        self.shared.tell_sleepers(&mut engine);
    }
}
