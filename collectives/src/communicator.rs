//! The communicator: a group of ranks and the collectives they run together.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use chorus_kernels::{DType, Element, ReduceOp};
use chorus_transport::store::{PrefixStore, Store, StoreServer, TcpStore};
use chorus_transport::tcp::{TcpConfig, TcpTransport};
use chorus_transport::Transport;

use crate::executor::{self, Buffers, Job, Workspace};
use crate::schedule::{barrier, broadcast, ring, tree, Schedule};
use crate::tuner::{self, Algorithm};
use crate::{Config, Error, Result};

/// Receive-and-reduce chunks in flight per call.
const PIPELINE_DEPTH: usize = 4;

/// Communicators created by this process, so each gets its own store keys.
static CREATED: AtomicU64 = AtomicU64::new(0);

/// The kinds of collective, as carried in message tags.
#[derive(Debug, Clone, Copy)]
enum Kind {
    AllReduce = 1,
    Broadcast = 2,
    Barrier = 3,
}

/// A group of ranks that run collectives together, like an NCCL communicator
/// or a torch.distributed process group.
///
/// Calls block until this rank's part is done; all ranks must issue the
/// same collectives in the same order with matching arguments. Calls from
/// several threads are serialised. After a failure (a timeout, a dead peer)
/// the communicator is broken and every later call fails.
pub struct Communicator {
    config: Config,
    transport: Option<TcpTransport>,
    state: Mutex<State>,
    /// The rendezvous store, when this rank hosts it (rank 0).
    _server: Option<StoreServer>,
}

struct State {
    seq: u64,
    work: Workspace,
    broken: Option<String>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.config.rank)
            .field("world_size", &self.config.world_size)
            .finish_non_exhaustive()
    }
}

impl Communicator {
    /// Joins the job described by the environment (torchrun's contract).
    ///
    /// Fails as [`Config::from_env`] and [`Communicator::new`] do.
    pub fn from_env() -> Result<Communicator> {
        Communicator::new(Config::from_env()?)
    }

    /// Joins the job: rendezvous through rank 0's store, then connect to every peer.
    ///
    /// Fails with a clear error if the store's port is busy (rank 0), the
    /// store cannot be reached, or a peer does not show up, all within
    /// `config.timeout`.
    pub fn new(config: Config) -> Result<Communicator> {
        if config.world_size == 0 || config.rank >= config.world_size {
            return Err(Error::InvalidArgument(format!(
                "rank {} is not below world size {}",
                config.rank, config.world_size
            )));
        }
        let state = Mutex::new(State {
            seq: 0,
            work: Workspace::default(),
            broken: None,
        });
        if config.world_size == 1 {
            return Ok(Communicator {
                config,
                transport: None,
                state,
                _server: None,
            });
        }
        let rank = config.rank;
        let server = if rank == 0 {
            let addr = SocketAddr::from(([0, 0, 0, 0], config.master_port));
            Some(StoreServer::bind(addr)?)
        } else {
            None
        };
        let client = TcpStore::connect(&config.master_addr, config.master_port, config.timeout)?;
        let generation = CREATED.fetch_add(1, Ordering::Relaxed);
        let store = PrefixStore::new(format!("chorus/{generation}"), client);
        let tcp = TcpConfig {
            nsocks: config.nsocks,
            addr: advertised_addr(&config)?,
            timeout: config.timeout,
            ..TcpConfig::default()
        };
        let transport = TcpTransport::connect(rank, config.world_size, &store, &tcp)
            .map_err(|e| Error::from(e).on_rank(rank))?;
        // Rank 0 keeps the store up until every rank is done with it.
        store.set(&format!("ready/{rank}"), b"1")?;
        if rank == 0 {
            let keys: Vec<String> = (0..config.world_size)
                .map(|r| format!("ready/{r}"))
                .collect();
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            store.wait(&keys, config.timeout)?;
        }
        tracing::info!(
            rank,
            world_size = config.world_size,
            nsocks = config.nsocks,
            "communicator ready"
        );
        Ok(Communicator {
            config,
            transport: Some(transport),
            state,
            _server: server,
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.config.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.config.world_size
    }

    /// This process's rank among those on its host.
    pub fn local_rank(&self) -> usize {
        self.config.local_rank
    }

    /// Number of ranks on this host.
    pub fn local_world_size(&self) -> usize {
        self.config.local_world_size
    }

    /// The configuration this communicator was built from.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Reduces `buf` across all ranks in place; every rank ends with the result.
    ///
    /// Fails on a transport error or timeout, or if ranks pass different lengths.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_bytes(None, bytemuck::cast_slice_mut(buf), T::DTYPE, op)
    }

    /// Reduces `input` across all ranks into `output` (same length).
    ///
    /// Fails as [`all_reduce`](Self::all_reduce) does, or if the lengths differ.
    pub fn all_reduce_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let input = bytemuck::cast_slice(input);
        self.all_reduce_bytes(Some(input), bytemuck::cast_slice_mut(output), T::DTYPE, op)
    }

    /// All-reduce on raw bytes holding elements of `dtype`; in place when `input` is `None`.
    ///
    /// Fails as [`all_reduce`](Self::all_reduce) does, or if a length is not a
    /// whole number of elements.
    pub fn all_reduce_bytes(
        &self,
        input: Option<&[u8]>,
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let count = elements(output.len(), dtype)?;
        let (w, rank, chunk) = (self.world_size(), self.rank(), self.chunk_elems(dtype));
        let algo = tuner::choose(self.config.algo, output.len(), w);
        tracing::debug!(count, %dtype, %op, %algo, "all_reduce");
        let steps = match algo {
            Algorithm::Ring => ring::all_reduce(rank, w, count, chunk),
            Algorithm::Tree => tree::all_reduce(rank, w, count, chunk),
        };
        self.run(Kind::AllReduce, dtype, op, 0, input, output, &steps)
    }

    /// Copies `root`'s `buf` into every other rank's `buf`.
    ///
    /// Fails on a transport error or timeout, if `root` is out of range, or
    /// if ranks pass different lengths.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_bytes(None, bytemuck::cast_slice_mut(buf), T::DTYPE, root)
    }

    /// Broadcast from `root`'s `input` into every rank's `output` (`input` is read on the root only).
    ///
    /// Fails as [`broadcast`](Self::broadcast) does, or if the lengths differ.
    pub fn broadcast_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        let input = bytemuck::cast_slice(input);
        self.broadcast_bytes(
            Some(input),
            bytemuck::cast_slice_mut(output),
            T::DTYPE,
            root,
        )
    }

    /// Broadcast on raw bytes holding elements of `dtype`; in place when `input` is `None`.
    ///
    /// Fails as [`broadcast`](Self::broadcast) does.
    pub fn broadcast_bytes(
        &self,
        input: Option<&[u8]>,
        output: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        let count = elements(output.len(), dtype)?;
        let (w, rank, chunk) = (self.world_size(), self.rank(), self.chunk_elems(dtype));
        if root >= w {
            return Err(Error::InvalidArgument(format!(
                "root {root} is not a rank (world size {w})"
            )));
        }
        let algo = tuner::choose(self.config.algo, output.len(), w);
        tracing::debug!(count, %dtype, root, %algo, "broadcast");
        let steps = match algo {
            Algorithm::Ring => broadcast::chain(rank, w, root, count, chunk),
            Algorithm::Tree => broadcast::tree(rank, w, root, count, chunk),
        };
        self.run(
            Kind::Broadcast,
            dtype,
            ReduceOp::Sum,
            root,
            input,
            output,
            &steps,
        )
    }

    /// Returns only after every rank has entered the barrier.
    ///
    /// Fails on a transport error or timeout.
    pub fn barrier(&self) -> Result<()> {
        let steps = barrier::dissemination(self.rank(), self.world_size());
        self.run(
            Kind::Barrier,
            DType::U8,
            ReduceOp::Sum,
            0,
            None,
            &mut [],
            &steps,
        )
    }

    fn chunk_elems(&self, dtype: DType) -> usize {
        (self.config.chunk_bytes / dtype.size()).max(1)
    }

    /// Runs one collective's schedule; a failure breaks the communicator.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        kind: Kind,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        input: Option<&[u8]>,
        output: &mut [u8],
        steps: &Schedule,
    ) -> Result<()> {
        let bufs = Buffers::same_len(input, output)?;
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &state.broken {
            return Err(Error::Broken(why.clone()));
        }
        state.seq += 1;
        let job = Job {
            transport: self.transport.as_ref().map(|t| t as &dyn Transport),
            tag: tag(state.seq, kind, dtype, op, root),
            dtype,
            op,
            world_size: self.world_size(),
            deadline: Instant::now() + self.config.timeout,
            depth: PIPELINE_DEPTH,
        };
        let result = executor::execute(&job, &bufs, steps, &mut state.work)
            .map_err(|e| e.on_rank(self.rank()));
        if let Err(e) = &result {
            state.broken = Some(e.to_string());
        }
        result
    }
}

/// Number of `dtype` elements in `bytes` bytes; fails if not a whole number.
fn elements(bytes: usize, dtype: DType) -> Result<usize> {
    if bytes % dtype.size() != 0 {
        return Err(Error::InvalidArgument(format!(
            "{bytes} bytes is not a whole number of {dtype} elements ({} bytes each)",
            dtype.size()
        )));
    }
    Ok(bytes / dtype.size())
}

/// The message tag: sequence number and a fingerprint of the call, so ranks
/// that disagree on what they are running fail instead of mixing data.
fn tag(seq: u64, kind: Kind, dtype: DType, op: ReduceOp, root: usize) -> u64 {
    let dtype = DType::ALL.iter().position(|&d| d == dtype).unwrap_or(0) as u64;
    let op = ReduceOp::ALL.iter().position(|&o| o == op).unwrap_or(0) as u64;
    (seq << 32) | (kind as u64) << 28 | dtype << 24 | op << 20 | (root as u64 & 0xF_FFFF)
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
        var: "MASTER_ADDR",
        value: config.master_addr.clone(),
        reason: format!("no route to it from this host ({e}); set CHORUS_SOCKET_ADDR"),
    })
}
