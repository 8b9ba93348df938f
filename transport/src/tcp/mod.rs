//! The TCP transport: several sockets per peer, striped, with a progress thread.

mod conn;
mod engine;
pub mod frame;
mod mesh;
mod poller;

use std::net::IpAddr;
use std::time::Duration;

use crate::auth::Auth;
use crate::endpoint::{through_endpoint, Endpoint};
use crate::store::Store;
use crate::{LinkCost, TransportError};
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
    /// How long a peer may leave an idle connection silent before it is taken for gone, when
    /// its host stops answering without closing anything (a pulled link, a machine that
    /// froze): the kernel probes idle connections (TCP keepalive) and the connection fails
    /// naming the peer within about half of this. A process that is alive but stopped or busy
    /// keeps its kernel answering, so it is not taken for gone. `None`: the kernel's default
    /// (no probes).
    pub dead_after: Option<Duration>,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            nsocks: 1,
            min_stripe: 256 << 10,
            addr: IpAddr::from([127, 0, 0, 1]),
            timeout: Duration::from_secs(300),
            auth: Auth::default(),
            dead_after: None,
        }
    }
}

/// A [`Transport`](crate::Transport) over TCP sockets, fully connected between all ranks.
#[derive(Debug)]
pub struct TcpTransport {
    endpoint: Endpoint<Shared>,
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
        let engine = Shared::new(rank, sockets, config.min_stripe)
            .map_err(|e| TransportError::resource("cannot set up the sockets", e))?;
        let endpoint = Endpoint::start(rank, world_size, "tcp", engine)?;
        tracing::debug!(
            rank,
            world_size,
            nsocks = config.nsocks,
            "tcp transport connected"
        );
        Ok(TcpTransport { endpoint })
    }
}

through_endpoint!(TcpTransport, endpoint);
