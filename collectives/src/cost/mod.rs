//! The cost model: what a schedule costs on a network of alpha-beta links.
//!
//! Every message costs `alpha + bytes / beta` seconds of link time: `alpha`
//! is a per-message latency (wire, stack, syscalls), `beta` the link
//! bandwidth in bytes/s. Each rank has one outgoing and one incoming link (a
//! NIC) that its sends and its receives share; a received chunk that is
//! reduced costs `bytes / gamma` more on the receiving rank (`gamma` is
//! infinite, reductions free, unless set).
//!
//! - [`closed`]: closed forms per collective and algorithm (what the
//!   [`crate::tuner`] uses at run time; no schedule is built).
//! - [`simulate`]: the evaluator, which runs the real schedules of every
//!   rank on the executor's own state machine, in simulated time.
//! - [`device`]: closed forms for the device paths (CUDA IPC, staging, hierarchical).

pub mod closed;
pub mod device;
mod fabric;
pub mod simulate;

pub(crate) use fabric::EAGER;
pub use simulate::{evaluate, EvalConfig, EvalError, Evaluation, DEFAULT_DEPTH};

/// Per-message latency assumed when nothing is measured: 10 us (TCP over loopback or a LAN).
pub const DEFAULT_ALPHA: f64 = chorus_transport::tcp::LINK_COST.latency;

/// Link bandwidth assumed when nothing is measured: 1.5 GB/s (loopback TCP, one stream).
pub const DEFAULT_BETA: f64 = chorus_transport::tcp::LINK_COST.bandwidth;

/// How many times as long a ring takes where one host's ranks outnumber its cores (see
/// [`crate::tuner::Tuner::estimate`]): fitted to all-reduces of 16 and 64 MiB by 4 ranks on 2
/// cores, where the ring took 1.15-1.3x as long as halving-doubling and the double binary
/// tree, which move as many bytes.
pub const CROWDED_RING: f64 = 1.25;

/// The alpha-beta(-gamma) link model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkModel {
    /// Seconds of link time every message costs, whatever its size.
    pub alpha: f64,
    /// Link bandwidth in bytes per second.
    pub beta: f64,
    /// Reduction bandwidth in bytes per second (infinite: reductions are free).
    pub gamma: f64,
}

impl Default for LinkModel {
    fn default() -> LinkModel {
        LinkModel::new(DEFAULT_ALPHA, DEFAULT_BETA)
    }
}

impl LinkModel {
    /// Links of `alpha` seconds per message and `beta` bytes/s; free reductions.
    pub fn new(alpha: f64, beta: f64) -> LinkModel {
        LinkModel {
            alpha,
            beta,
            gamma: f64::INFINITY,
        }
    }

    /// Shared memory between two ranks of one host, as the tuner assumes it.
    pub fn shared_memory() -> LinkModel {
        let shm = chorus_transport::shm::LINK_COST;
        LinkModel::new(shm.latency, shm.bandwidth)
    }

    /// This model with reductions at `gamma` bytes/s.
    pub fn with_gamma(mut self, gamma: f64) -> LinkModel {
        self.gamma = gamma;
        self
    }

    /// Link time of one message of `bytes`: `alpha + bytes / beta`.
    pub fn message(&self, bytes: f64) -> f64 {
        self.alpha + bytes / self.beta
    }

    /// Time to reduce `bytes` of received data: `bytes / gamma`.
    pub fn reduce(&self, bytes: f64) -> f64 {
        if self.gamma.is_finite() {
            bytes / self.gamma
        } else {
            0.0
        }
    }
}

/// The links of a simulated cluster: hosts of `per_host` consecutive ranks. Each host has
/// one outgoing and one incoming link to the others (`between`, shared by its ranks); ranks
/// on one host reach each other over links of their own (`within`, e.g. shared memory).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Network {
    /// Links between hosts (reductions cost its `gamma`).
    pub between: LinkModel,
    /// Links between two ranks of one host.
    pub within: LinkModel,
    /// Ranks per host (the last host may hold fewer).
    pub per_host: usize,
}

impl Network {
    /// Every rank on a host of its own, with `model`'s links.
    pub fn flat(model: LinkModel) -> Network {
        Network {
            between: model,
            within: model,
            per_host: 1,
        }
    }

    /// The host of `rank`.
    pub fn host(&self, rank: usize) -> usize {
        rank / self.per_host.max(1)
    }
}
