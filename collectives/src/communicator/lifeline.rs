//! Lifelines: a small store server in every process, whose address each rank of a job learns
//! when it joins, so that the survivors of a death can reach one another without the
//! rendezvous store, which may have died with rank 0 (see [`shrink`](super::shrink)).
//!
//! One server serves every communicator of a process that shares the job's secret; keys are
//! spaced by the communicators' store prefixes. Communicators made from another (split,
//! shrunk) take their ranks' addresses from it, so only a job's first communicator exchanges
//! them.

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use chorus_transport::auth::Auth;
use chorus_transport::store::{Store, StoreServer, TcpStore};

use super::servers::Servers;
use crate::{Error, Result};

/// How long a rank's host has to answer a probe before the rank is taken for gone.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// This process's servers, one per job secret, each living while a communicator uses it.
static SERVERS: Servers<Auth> = Servers::new();

/// This process's lifeline server and where every rank of one communicator has its own.
pub(crate) struct Lifeline {
    /// This process's server.
    pub server: Arc<StoreServer>,
    /// Each rank's server, by rank.
    pub addrs: Vec<SocketAddr>,
}

impl Lifeline {
    /// Starts this process's server for the job `auth` proves membership of, unless one runs.
    pub fn server(auth: &Auth) -> Result<Arc<StoreServer>> {
        SERVERS.find_or(auth.clone(), || {
            let any = SocketAddr::from(([0, 0, 0, 0], 0));
            Ok(Arc::new(StoreServer::bind_with_auth(any, auth.clone())?))
        })
    }

    /// Publishes where `rank`'s server listens (`ip`, which the others reach it at).
    pub fn publish(store: &dyn Store, rank: usize, ip: IpAddr, server: &StoreServer) -> Result<()> {
        let addr = SocketAddr::new(ip, server.local_addr().port());
        store.set(&format!("lifeline/{rank}"), addr.to_string().as_bytes())?;
        Ok(())
    }

    /// Reads every rank's published address (each rank publishes before it connects, so none
    /// is waited for once the transport is up).
    pub fn gather(store: &dyn Store, world_size: usize, server: Arc<StoreServer>) -> Result<Self> {
        let addrs = (0..world_size)
            .map(|r| {
                let raw = store.get(&format!("lifeline/{r}"))?;
                let text = String::from_utf8_lossy(&raw);
                text.parse().map_err(|_| {
                    Error::Internal(format!("rank {r} published a malformed address {text:?}"))
                })
            })
            .collect::<Result<_>>()?;
        Ok(Lifeline { server, addrs })
    }

    /// The lifeline of a communicator of `ranks` (ranks of this one, in its order).
    pub fn subset(&self, ranks: &[usize]) -> Lifeline {
        Lifeline {
            server: Arc::clone(&self.server),
            addrs: ranks.iter().map(|&r| self.addrs[r]).collect(),
        }
    }

    /// Whether rank `rank`'s process is still there: its host completes a connection to its
    /// server within [`PROBE_TIMEOUT`] (a process that died has no listener left; a host
    /// that vanished does not answer; a stopped or busy process's kernel still does).
    pub fn answers(&self, rank: usize) -> bool {
        TcpStream::connect_timeout(&self.addrs[rank], PROBE_TIMEOUT).is_ok()
    }

    /// A client of rank `rank`'s server whose requests wait up to `timeout`.
    pub fn client(&self, rank: usize, timeout: Duration, auth: &Auth) -> Result<TcpStore> {
        let addr = self.addrs[rank];
        let host = addr.ip().to_string();
        Ok(TcpStore::connect_with_auth(
            &host,
            addr.port(),
            timeout,
            auth.clone(),
        )?)
    }
}
