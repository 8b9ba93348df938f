//! Joining the job: the rendezvous carried out, the roll call, the transport connected
//! through the store, and the communicator assembled (its tuner, topology and monitor).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use chorus_transport::pages::Pagemap;
use chorus_transport::shm::{ShmConfig, SingleCopy};
use chorus_transport::store::{PrefixStore, Store, StoreError, StoreServer, TcpStore, TorchStore};
use chorus_transport::tcp::TcpConfig;
use chorus_transport::{RouteConfig, RoutedTransport};

use super::faults::{Lineage, Monitor, SetUp};
use super::lifeline::Lifeline;
use super::servers::Servers;
use super::shared::Windows;
use super::{prepare, Communicator, Inner, Issue, State};
use crate::config::MAX_WORLD_SIZE;
use crate::executor::Workspace;
use crate::streaming::last_level_cache;
use crate::tuner::{Topology, Tuner};
use crate::{env, Auth, Config, Error, Result, StoreKind};

/// How long rank 0 keeps the store up after its own set-up failed.
const SETUP_LINGER: Duration = Duration::from_secs(1);

/// Communicators created from scratch by this process, so each gets its own store keys.
static CREATED: AtomicU64 = AtomicU64::new(0);

/// The rendezvous stores this process hosts, by the address its ranks reach them at and the
/// job's secret. A rank of the job in this process holds the store it joined through, so the
/// store outlives the hosting rank's communicator while ranks here still use it: a program
/// that drives several ranks and destroys rank 0 first does not wait for the goodbyes of
/// ranks it has yet to destroy (see `Drop for Communicator`).
static HOSTED: Servers<(String, u16, Auth)> = Servers::new();

/// Where `config`'s ranks reach the job's store, and its secret: a key of [`HOSTED`].
fn store_key(config: &Config) -> (String, u16, Auth) {
    let c = config;
    (c.master_addr.clone(), c.master_port, c.auth.clone())
}

impl Communicator {
    /// Joins the job described by the environment (torchrun's contract).
    ///
    /// Fails as [`Config::from_env`] and [`Communicator::new`] do.
    pub fn from_env() -> Result<Communicator> {
        Communicator::new(Config::from_env()?)
    }

    /// Joins the job: rendezvous through rank 0's store (or torchrun's agent store, as
    /// `config.store` says), then connect to every peer. Rank 0 binds its store at
    /// `config.master_port`; where `config.rendezvous` is published (`file://`, MPICH's PMI),
    /// rank 0 binds it first and publishes its address, and the others read it.
    ///
    /// Fails with a clear error if the store's port is busy (rank 0), the
    /// store cannot be reached or its address is not published, or a peer does not show up,
    /// all within `config.timeout`.
    pub fn new(mut config: Config) -> Result<Communicator> {
        check_shape(&config)?;
        let bound = std::mem::take(&mut config.rendezvous).carry_out(&mut config)?;
        let (space, hosted) = match &config.store {
            StoreKind::Chorus => ("chorus".to_string(), true),
            StoreKind::TorchAgent { run } => (format!("torchelastic/{run}/chorus"), false),
        };
        let server = match bound {
            Some(bound) => Some(bound),
            None if hosted && config.rank == 0 && config.world_size > 1 => {
                let addr = SocketAddr::from(([0, 0, 0, 0], config.master_port));
                Some(StoreServer::bind_with_auth(addr, config.auth.clone())?)
            }
            None => None,
        };
        let prefix = format!("{space}/{}", CREATED.fetch_add(1, Ordering::Relaxed));
        Communicator::with_store_server(config, server, &prefix)
    }

    /// Joins the job through the store already listening at `config.master_addr` and
    /// `config.master_port` (of the kind `config.store` names); `server` is that store when
    /// this process hosts it.
    ///
    /// For a job whose rank 0 binds its store first (on any free port) and tells the others
    /// where through some other channel, as the torch backend does through torch's store.
    /// `prefix` is the communicator's key space in the store: every rank passes the same one,
    /// and no other communicator on that store uses it. The hosting process keeps the store
    /// up until every rank is done with it. Fails as [`Communicator::new`] does.
    pub fn with_store_server(
        config: Config,
        server: Option<StoreServer>,
        prefix: &str,
    ) -> Result<Communicator> {
        check_shape(&config)?;
        if config.world_size == 1 {
            return Ok(Communicator::assemble(config, None, None));
        }
        let hosting = server.is_some();
        let server = server.map(|server| {
            let server = Arc::new(server);
            HOSTED.keep(store_key(&config), &server);
            server
        });
        let client = connect_store(&config, config.timeout)?;
        let joined = Communicator::join(
            config,
            client,
            prefix.to_string(),
            server.clone(),
            None,
            None,
        );
        if joined.is_err() && hosting {
            // The others are failing too: keep the store up a moment so they read their own
            // errors (naming the missing ranks) rather than "the store closed".
            std::thread::sleep(SETUP_LINGER);
        }
        joined
    }

    /// Connects `config.rank` to the other ranks through the store under `prefix`;
    /// `lineage` places a communicator made from another (split, shrunk) in its job, and
    /// `lifeline` holds its ranks' lifelines (exchanged here when absent).
    pub(super) fn join(
        config: Config,
        client: Arc<dyn Store>,
        prefix: String,
        server: Option<Arc<StoreServer>>,
        lineage: Option<Lineage>,
        lifeline: Option<Lifeline>,
    ) -> Result<Communicator> {
        let rank = config.rank;
        let store = PrefixStore::new(prefix.clone(), client.clone());
        let addr = advertised_addr(&config)?;
        let routes = RouteConfig {
            kind: config.transport,
            host_id: config.host_id.clone(),
            tcp: TcpConfig {
                nsocks: config.nsocks,
                addr,
                timeout: config.timeout,
                auth: config.auth.clone(),
                dead_after: Some(config.dead_after()),
                ..TcpConfig::default()
            },
            shm: ShmConfig {
                timeout: config.timeout,
                single_copy: config.shm_single_copy,
                ..ShmConfig::default()
            },
        };
        let set_up = SetUp::begin(&store, &config, &prefix, &client)?;
        let links = set_up.run(&store, &config, || {
            let own = match &lifeline {
                None => Some(Lifeline::server(&config.auth)?),
                Some(_) => None,
            };
            if let Some(server) = &own {
                Lifeline::publish(&store, rank, addr, server)?;
            }
            let transport = RoutedTransport::connect(rank, config.world_size, &store, &routes)
                .map_err(|e| Error::transport(rank, e))?;
            let lifeline = match (lifeline, own) {
                (Some(lifeline), _) => lifeline,
                (None, Some(server)) => Lifeline::gather(&store, config.world_size, server)?,
                (None, None) => unreachable!("a server is started where no lifeline is given"),
            };
            // The store's host keeps it up until every rank is done with it.
            store.set(&format!("ready/{rank}"), b"1")?;
            if rank == 0 {
                let keys: Vec<String> = (0..config.world_size)
                    .map(|r| format!("ready/{r}"))
                    .collect();
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                store.wait(&keys, config.timeout)?;
            }
            // The store this process hosts for the job, if another rank here hosts it: looked
            // up once every rank has connected, so after the hosting rank kept it (first thing).
            let server = server.or_else(|| HOSTED.find(&store_key(&config)));
            Ok(Links {
                transport,
                store: (client.clone(), prefix.clone()),
                server,
                lifeline,
            })
        })?;
        tracing::info!(rank, world_size = config.world_size, nsocks = config.nsocks, %prefix, "communicator ready");
        Ok(Communicator::assemble(config, Some(links), lineage))
    }

    /// The communicator of `config`, linked to its peers by `links` (none for one rank).
    pub(super) fn assemble(
        config: Config,
        links: Option<Links>,
        lineage: Option<Lineage>,
    ) -> Communicator {
        let (transport, store, server, lifeline) = match links {
            Some(l) => (Some(l.transport), Some(l.store), l.server, Some(l.lifeline)),
            None => (None, None, None, None),
        };
        let state = State {
            seq: 0,
            serving: 0,
            waiting: 0,
            work: Workspace::default(),
            splits: 0,
            shrinks: 0,
            any_from: 0,
        };
        // The transport's figures (shared memory's on one host, TCP's across hosts) unless
        // configured; every rank reaches the same ones.
        let link = transport
            .as_ref()
            .map_or(chorus_transport::tcp::LINK_COST, RoutedTransport::link_cost);
        let alpha = config.alpha.unwrap_or(link.latency);
        let beta = config.beta.unwrap_or(link.bandwidth);
        let hosts = match &transport {
            Some(t) => {
                let mut hosts: Vec<Vec<usize>> = Vec::new();
                for (rank, &host) in t.hosts().iter().enumerate() {
                    match hosts.get_mut(host) {
                        Some(ranks) => ranks.push(rank),
                        None => hosts.push(vec![rank]),
                    }
                }
                hosts
            }
            None => vec![(0..config.world_size).collect()],
        };
        let shm = transport.as_ref().and_then(RoutedTransport::shm);
        let topology = Topology {
            hosts: hosts.len(),
            most_local: hosts.iter().map(Vec::len).max().unwrap_or(1),
            shared_memory: transport.as_ref().is_some_and(RoutedTransport::all_shm),
            // Only where every rank counted the same cores: on one host.
            cores: match (hosts.len(), shm) {
                (1, Some(shm)) => shm.cores(),
                _ => usize::MAX,
            },
        };
        if transport.is_some() {
            let round = |x: f64| (x * 1e3).round() / 1e3;
            tracing::info!(
                rank = config.rank,
                cores = topology.cores,
                "tuner link model: {} us per message, {} GB/s",
                round(alpha * 1e6),
                round(beta / 1e9)
            );
        }
        let tuner = Tuner::new(alpha, beta, config.algo)
            .with_chunk_bytes(config.chunk_bytes)
            .with_topology(topology);
        // Opened for the communicator's life, not for each call: a file and a syscall less
        // a call, and no descriptor outlives the communicator.
        let lends = matches!(config.shm_single_copy, SingleCopy::Lent(_));
        let pagemap = match lends && transport.as_ref().is_some_and(|t| t.shm().is_some()) {
            true => Pagemap::open().ok(),
            false => None,
        };
        let local = hosts
            .iter()
            .find(|h| h.contains(&config.rank))
            .map_or(1, Vec::len);
        let stream_from = config.streaming.per_rank(local, last_level_cache());
        let inner = Arc::new_cyclic(|weak| {
            let monitor = store.as_ref().and_then(|(_, prefix)| {
                Monitor::start(&config, prefix, weak.clone(), lineage)
                    .map_err(|e| {
                        tracing::warn!(rank = config.rank, "no watchdog or fault reports: {e}")
                    })
                    .ok()
            });
            Inner {
                tuner,
                hosts,
                pagemap,
                stream_from,
                picks: Mutex::new(HashMap::new()),
                decisions: prepare::Decisions::default(),
                config,
                transport,
                state: Mutex::new(state),
                turn: Condvar::new(),
                issue: Mutex::new(Issue::default()),
                store,
                server,
                lifeline,
                fault: Mutex::new(None),
                monitor,
                windows: Mutex::new(Windows::default()),
                has_windows: AtomicBool::new(false),
                children: Mutex::new(Vec::new()),
            }
        });
        Communicator { inner }
    }
}

/// What links a communicator to its peers, made by joining them.
pub(super) struct Links {
    transport: RoutedTransport,
    /// The store's client and the communicator's key prefix.
    store: (Arc<dyn Store>, String),
    /// The store server, when this process hosts it.
    server: Option<Arc<StoreServer>>,
    lifeline: Lifeline,
}

/// A new client of the job's store at `config.master_addr:config.master_port`, of the kind
/// `config.store` names, `timeout` bounding its requests.
pub(super) fn connect_store(config: &Config, timeout: Duration) -> Result<Arc<dyn Store>> {
    let (host, port) = (config.master_addr.as_str(), config.master_port);
    Ok(match config.store {
        StoreKind::Chorus => Arc::new(TcpStore::connect_with_auth(
            host,
            port,
            timeout,
            config.auth.clone(),
        )?),
        StoreKind::TorchAgent { .. } => match TorchStore::connect(host, port, timeout) {
            Ok(store) => Arc::new(store),
            Err(e @ StoreError::Connect { .. })
                if loopback(host) && config.world_size > config.local_world_size =>
            {
                return Err(Error::Config {
                    var: env::MASTER_ADDR,
                    value: host.to_string(),
                    reason: format!(
                        "{e}. The job spans nodes ({} ranks, {} on this one), but torchrun's \
                         agents named a loopback address for the store on the first node, \
                         as they do where that node's name resolves to 127.0.0.1: start \
                         torchrun with --local-addr set to an address of its node that the \
                         others reach, on every node",
                        config.world_size, config.local_world_size
                    ),
                });
            }
            Err(e) => return Err(e.into()),
        },
    })
}

/// Whether `host` names this machine's loopback interface.
fn loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Fails unless `config`'s rank is below its world size, and the world size within bounds.
fn check_shape(config: &Config) -> Result<()> {
    if config.world_size == 0 || config.rank >= config.world_size {
        return Err(Error::InvalidArgument(format!(
            "rank {} is not below world size {}",
            config.rank, config.world_size
        )));
    }
    if config.world_size > MAX_WORLD_SIZE {
        return Err(Error::InvalidArgument(format!(
            "world size {} is above the largest Chorus supports, {MAX_WORLD_SIZE}",
            config.world_size
        )));
    }
    Ok(())
}

/// The address other ranks reach this one at: configured, or the local end
/// of the route to MASTER_ADDR (no packet is sent).
fn advertised_addr(config: &Config) -> Result<IpAddr> {
    if let Some(addr) = config.socket_addr {
        return Ok(addr);
    }
    let route = || -> std::io::Result<IpAddr> {
        let probe = UdpSocket::bind("0.0.0.0:0")?;
        probe.connect((config.master_addr.as_str(), config.master_port.max(1)))?;
        Ok(probe.local_addr()?.ip())
    };
    route().map_err(|e| Error::Config {
        var: crate::env::MASTER_ADDR,
        value: config.master_addr.clone(),
        reason: format!("no route to it from this host ({e}); set CHORUS_SOCKET_ADDR"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_world_size_out_of_bounds_fails_before_anything_is_allocated() {
        let config = |world| Config::new(0, world, "127.0.0.1", 1);
        let err = Communicator::new(config(MAX_WORLD_SIZE + 1)).unwrap_err();
        assert!(err.to_string().contains("world size 1048577"), "{err}");
        let err = Communicator::new(config(0)).unwrap_err();
        assert!(err.to_string().contains("not below world size 0"), "{err}");
    }
}
