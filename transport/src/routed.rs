//! The transport a communicator uses: shared memory to the ranks on this
//! host, TCP to the others, chosen per peer at set-up.
//!
//! Each rank publishes its host identity in the store (hostname, boot id and
//! the network, IPC and PID namespaces it runs in, or an explicit override)
//! and reads everyone else's; ranks with equal identities share a host.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::shm::{ShmConfig, ShmTransport};
use crate::store::{Store, StoreError};
use crate::tcp::{TcpConfig, TcpTransport};
use crate::{Exchange, LinkCost, Payload, Request, Transport, TransportError};

/// Which transports a job may use (`CHORUS_TRANSPORT`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TransportKind {
    /// Shared memory within a host, TCP across hosts.
    #[default]
    Auto,
    /// TCP to every peer.
    Tcp,
    /// Shared memory to every peer; set-up fails if a peer is on another host.
    Shm,
}

impl FromStr for TransportKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(TransportKind::Auto),
            "tcp" => Ok(TransportKind::Tcp),
            "shm" => Ok(TransportKind::Shm),
            other => Err(format!(
                "unknown transport '{other}' (expected auto, tcp or shm)"
            )),
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransportKind::Auto => "auto",
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
        })
    }
}

/// Settings of a [`RoutedTransport`].
#[derive(Debug, Clone, Default)]
pub struct RouteConfig {
    /// Which transports may be used.
    pub kind: TransportKind,
    /// This rank's host identity; [`host_identity`] when `None`.
    pub host_id: Option<String>,
    /// Settings of the TCP transport (used to ranks on other hosts).
    pub tcp: TcpConfig,
    /// Settings of the shared-memory transport (used to ranks on this host).
    pub shm: ShmConfig,
}

/// What identifies this host: ranks that report the same string can share memory.
///
/// The hostname and boot id, and the network, IPC and PID namespaces of this
/// process (so containers and network namespaces on one machine count as
/// separate hosts).
pub fn host_identity() -> String {
    let read = |path: &str| {
        std::fs::read_to_string(path).map_or_else(|_| "?".into(), |s| s.trim().to_string())
    };
    let ns = |name: &str| {
        std::fs::read_link(format!("/proc/self/ns/{name}"))
            .map_or_else(|_| "?".into(), |p| p.to_string_lossy().into_owned())
    };
    format!(
        "{} {} {} {} {}",
        read("/proc/sys/kernel/hostname"),
        read("/proc/sys/kernel/random/boot_id"),
        ns("net"),
        ns("ipc"),
        ns("pid")
    )
}

/// How one peer is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Shm,
    Tcp,
}

/// A [`Transport`] that reaches each peer through shared memory (same host)
/// or TCP (other hosts).
#[derive(Debug)]
pub struct RoutedTransport {
    rank: usize,
    world_size: usize,
    routes: Vec<Route>,
    /// Each rank's host, numbered in the order of each host's lowest rank.
    hosts: Vec<usize>,
    /// Distinct machines the ranks run on (ranks that take TCP only are each a host of
    /// their own, but one machine may hold several of them).
    machines: usize,
    shm: Option<ShmTransport>,
    tcp: Option<TcpTransport>,
}

/// The host identity that `rank`, taking TCP only, publishes: no other rank's.
fn tcp_only(rank: usize) -> String {
    format!("tcp-only rank {rank}")
}

/// The number of `id` among `seen` (ids numbered in the order they first come), adding it if
/// it is new.
fn number(seen: &mut Vec<Vec<u8>>, id: Vec<u8>) -> usize {
    match seen.iter().position(|i| *i == id) {
        Some(k) => k,
        None => {
            seen.push(id);
            seen.len() - 1
        }
    }
}

/// Waits until every rank has published its host, naming the ranks that never did.
fn wait_for_ranks(
    store: &dyn Store,
    world_size: usize,
    timeout: Duration,
) -> Result<(), TransportError> {
    let keys: Vec<String> = (0..world_size).map(|r| format!("host/{r}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    match store.wait(&keys, timeout) {
        Err(StoreError::Timeout { keys, waited }) => {
            let missing: Vec<&str> = keys.iter().filter_map(|k| k.rsplit('/').next()).collect();
            Err(TransportError::Setup(format!(
                "ranks [{}] did not join within {waited:?} (are they running, with the same MASTER_ADDR and MASTER_PORT?)",
                missing.join(", ")
            )))
        }
        other => Ok(other?),
    }
}

impl RoutedTransport {
    /// Finds which ranks share this rank's host and connects to every rank.
    ///
    /// Fails as [`ShmTransport::connect`] and [`TcpTransport::connect`] do,
    /// and, with [`TransportKind::Shm`], if some rank is on another host.
    pub fn connect(
        rank: usize,
        world_size: usize,
        store: &dyn Store,
        config: &RouteConfig,
    ) -> Result<RoutedTransport, TransportError> {
        if rank >= world_size {
            return Err(TransportError::Setup(format!(
                "rank {rank} is not below the world size {world_size}"
            )));
        }
        // A rank that wants TCP only publishes a host identity nobody else has, so every
        // rank agrees on who talks shared memory to whom, and its machine's apart (first, so
        // that it is there once the host is).
        let machine = config.host_id.clone().unwrap_or_else(host_identity);
        let host = match config.kind {
            TransportKind::Tcp => {
                store.set(&format!("machine/{rank}"), machine.as_bytes())?;
                tcp_only(rank)
            }
            _ => machine,
        };
        store.set(&format!("host/{rank}"), host.as_bytes())?;
        wait_for_ranks(store, world_size, config.tcp.timeout)?;
        let (mut host_ids, mut machine_ids) = (Vec::new(), Vec::new());
        let mut hosts = Vec::with_capacity(world_size);
        for r in 0..world_size {
            let id = store.get(&format!("host/{r}"))?;
            let machine = if id == tcp_only(r).as_bytes() {
                store.get(&format!("machine/{r}"))?
            } else {
                id.clone()
            };
            number(&mut machine_ids, machine);
            hosts.push(number(&mut host_ids, id));
        }
        let local: Vec<usize> = (0..world_size)
            .filter(|&r| hosts[r] == hosts[rank])
            .collect();
        if config.kind == TransportKind::Shm && local.len() < world_size {
            let others: Vec<usize> = (0..world_size).filter(|r| !local.contains(r)).collect();
            return Err(TransportError::Setup(format!(
                "CHORUS_TRANSPORT=shm, but ranks {others:?} are on other hosts than rank {rank} \
                 (use auto or tcp)"
            )));
        }
        let routes: Vec<Route> = (0..world_size)
            .map(|r| {
                if local.contains(&r) {
                    Route::Shm
                } else {
                    Route::Tcp
                }
            })
            .collect();
        let shm = if local.len() > 1 {
            Some(ShmTransport::connect(
                rank,
                world_size,
                &local,
                store,
                &config.shm,
            )?)
        } else {
            None
        };
        let tcp = if local.len() < world_size {
            Some(TcpTransport::connect(rank, world_size, store, &config.tcp)?)
        } else {
            None
        };
        let shm_peers: Vec<usize> = local.iter().copied().filter(|&r| r != rank).collect();
        tracing::info!(
            rank,
            ?shm_peers,
            tcp_peers = world_size - local.len(),
            "transport routes"
        );
        Ok(RoutedTransport {
            rank,
            world_size,
            routes,
            hosts,
            machines: machine_ids.len(),
            shm,
            tcp,
        })
    }

    /// The transport that reaches `peer`.
    fn to(&self, peer: usize) -> Result<&dyn Transport, TransportError> {
        let invalid = || TransportError::InvalidPeer {
            peer,
            rank: self.rank,
            world_size: self.world_size,
        };
        if peer == self.rank {
            return Err(invalid());
        }
        let t: Option<&dyn Transport> = match self.routes.get(peer).ok_or_else(invalid)? {
            Route::Shm => self.shm.as_ref().map(|t| t as &dyn Transport),
            Route::Tcp => self.tcp.as_ref().map(|t| t as &dyn Transport),
        };
        t.ok_or_else(invalid)
    }

    /// The cost of the slowest route any rank of the job uses: shared memory's
    /// when the whole job is on one host, TCP's otherwise. Every rank gets the same answer.
    pub fn link_cost(&self) -> LinkCost {
        if self.tcp.is_some() {
            crate::tcp::LINK_COST
        } else {
            crate::shm::LINK_COST
        }
    }

    /// Each rank's host, numbered in the order of each host's lowest rank (ranks on one
    /// host share memory; under `CHORUS_TRANSPORT=tcp` each rank counts as a host of its own).
    /// Every rank gets the same list.
    pub fn hosts(&self) -> &[usize] {
        &self.hosts
    }

    /// How many machines the ranks run on: as many as [`hosts`](Self::hosts) has, but for
    /// ranks that take TCP only, of which one machine may hold several.
    pub fn machines(&self) -> usize {
        self.machines
    }

    /// The shared-memory transport to this host's ranks, if there are others.
    pub fn shm(&self) -> Option<&ShmTransport> {
        self.shm.as_ref()
    }

    /// Whether every rank is reached through shared memory (one host, two or more ranks).
    pub fn all_shm(&self) -> bool {
        self.tcp.is_none() && self.shm.is_some()
    }

    /// Whether `peer` is reached through shared memory.
    pub fn uses_shm(&self, peer: usize) -> bool {
        peer != self.rank && self.routes.get(peer) == Some(&Route::Shm)
    }
}

impl Transport for RoutedTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    unsafe fn post(
        &self,
        peer: usize,
        tag: u64,
        payload: Payload<'_>,
    ) -> Result<Request, TransportError> {
        // SAFETY: the caller's guarantee is passed on unchanged.
        unsafe { self.to(peer)?.post(peer, tag, payload) }
    }

    fn probe(&self, peer: usize) -> Result<Option<(u64, usize)>, TransportError> {
        self.to(peer)?.probe(peer)
    }

    unsafe fn sendrecv(
        &self,
        to: usize,
        from: usize,
        tag: u64,
        data: &[u8],
        buf: &mut [u8],
    ) -> Result<Exchange, TransportError> {
        let (out, back) = (self.to(to)?, self.to(from)?);
        // SAFETY: the caller's guarantee, passed on.
        unsafe {
            match std::ptr::addr_eq(out, back) {
                true => out.sendrecv(to, from, tag, data, buf),
                false => Exchange::posted(self, to, from, tag, data, buf),
            }
        }
    }

    fn abort(&self, reason: &str) {
        if let Some(t) = &self.shm {
            t.abort(reason);
        }
        if let Some(t) = &self.tcp {
            t.abort(reason);
        }
    }

    fn unanswered(&self, peer: usize) -> Option<std::time::Duration> {
        self.to(peer).ok()?.unanswered(peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_and_print() {
        for kind in [TransportKind::Auto, TransportKind::Tcp, TransportKind::Shm] {
            assert_eq!(kind.to_string().parse::<TransportKind>(), Ok(kind));
        }
        assert_eq!(" SHM ".parse::<TransportKind>(), Ok(TransportKind::Shm));
        assert!("ib".parse::<TransportKind>().unwrap_err().contains("'ib'"));
    }

    /// What two ranks (threads here) of `kind`, with host identities `ids`, find: each
    /// one's hosts and machines.
    fn found(kind: TransportKind, ids: [&str; 2]) -> Vec<(Vec<usize>, usize)> {
        use crate::store::{StoreServer, TcpStore};
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let port = server.local_addr().port();
        let timeout = Duration::from_secs(20);
        let threads: Vec<_> = (0..2)
            .map(|rank| {
                let config = RouteConfig {
                    kind,
                    host_id: Some(ids[rank].to_string()),
                    tcp: TcpConfig {
                        timeout,
                        ..TcpConfig::default()
                    },
                    shm: ShmConfig {
                        timeout,
                        ..ShmConfig::default()
                    },
                };
                std::thread::spawn(move || {
                    let store = TcpStore::connect("127.0.0.1", port, timeout).unwrap();
                    let t = RoutedTransport::connect(rank, 2, &store, &config).unwrap();
                    (t.hosts().to_vec(), t.machines())
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn ranks_that_take_tcp_only_are_hosts_of_their_own_on_one_machine() {
        let one = found(TransportKind::Tcp, ["here", "here"]);
        assert_eq!(one, vec![(vec![0, 1], 1); 2]);
        let two = found(TransportKind::Tcp, ["here", "there"]);
        assert_eq!(two, vec![(vec![0, 1], 2); 2]);
        let auto = found(TransportKind::Auto, ["here", "there"]);
        assert_eq!(auto, vec![(vec![0, 1], 2); 2]);
    }

    #[test]
    fn the_host_identity_is_stable_and_names_the_boot() {
        let id = host_identity();
        assert_eq!(id, host_identity());
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
        assert!(id.contains(boot.trim()), "{id}");
    }
}
