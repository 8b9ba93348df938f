//! Where a job's ranks meet: which launcher started this process, what it says about the job
//! (rank, world size, local rank and size, where rank 0's rendezvous store is), and carrying
//! that out (rank 0's store bound and its address published, or read).
//!
//! [`detect`] looks, in this order, at:
//!
//! 1. `CHORUS_INIT_METHOD`: `env://` (torchrun's variables, nothing else), `tcp://HOST:PORT`
//!    (the store's address; ranks from `RANK`/`WORLD_SIZE`, or from SLURM or MPI when those are
//!    absent) or `file:///shared/path` (ranks as for `tcp://`; the address goes through a file
//!    on a filesystem every node sees, see [`Master::File`]).
//! 2. torchrun's contract (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//!    `MASTER_ADDR`, `MASTER_PORT`), as set by `chorusrun`, torchrun or by hand.
//! 3. SLURM (`srun`): `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the tasks on this node
//!    from the step's `SLURM_STEP_TASKS_PER_NODE` (`2(x3),1`) at `SLURM_NODEID`, else
//!    `SLURM_NTASKS_PER_NODE`, else `SLURM_TASKS_PER_NODE` (a list like the step's);
//!    the store on the first host of the step's node list (`MASTER_ADDR` overrides) at port
//!    `10000 + SLURM_JOB_ID % 20000` (`MASTER_PORT` overrides).
//! 4. Open MPI (`OMPI_COMM_WORLD_*`), MPICH / Intel MPI (`PMI_RANK`, `PMI_SIZE`,
//!    `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`), MVAPICH2 (`MV2_COMM_WORLD_*`). Where rank 0 is:
//!    `MASTER_ADDR` and `MASTER_PORT` exported to every rank; else, under MPICH's hydra
//!    (`PMI_FD`, or `PMI_PORT` with `mpiexec -pmi-port`, which then gives the rank and size
//!    only through PMI), rank 0 publishes its store's address in hydra's PMI-1 key-value space
//!    ([`crate::pmi`]). Open MPI and MVAPICH2's `mpirun_rsh` need the two variables.
//!
//! SLURM and MPI together: `mpirun` inside an `sbatch` script hands every rank the batch
//! step's `SLURM_PROCID` (the same in every process), so when an MPI flavour's rank or size
//! disagrees with SLURM's, the MPI variables win; when they agree (`srun --mpi=pmi2` sets
//! both) SLURM is used, since it also names the master host.

//!
//! Detection ([`detect`](detect::detect), in `detect.rs`) only reads variables. SLURM's host
//! lists and tasks per node are parsed in `slurm.rs`; carrying a rendezvous out ([`Master::resolve`], in
//! `store.rs`) binds rank 0's store and publishes its address through a shared file
//! (`file.rs`) or MPICH's PMI (`chorus_transport::store::pmi`).

mod detect;
mod file;
mod slurm;
mod store;

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use chorus_transport::store::StoreServer;

use crate::env::{self, Lookup};
use crate::{Config, Error};

pub(crate) use detect::detect;
pub(crate) use store::store_kind;

/// The rendezvous store at `MASTER_ADDR:MASTER_PORT`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum StoreKind {
    /// Chorus's own store, which rank 0 hosts ([`Communicator::new`](crate::Communicator::new)).
    #[default]
    Chorus,
    /// torch's TCPStore that torchrun's elastic agent already serves there: no rank hosts a
    /// store, and communicators keep their keys under `torchelastic/{run}/` so that a
    /// restarted attempt never reads the last one's.
    TorchAgent {
        /// The attempt: `TORCHELASTIC_RUN_ID/TORCHELASTIC_RESTART_COUNT`.
        run: String,
    },
}

pub use crate::env::DEFAULT_MASTER_ADDR;

/// Which mechanism described the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Method {
    /// `CHORUS_INIT_METHOD=env://`.
    InitEnv,
    /// `CHORUS_INIT_METHOD=tcp://HOST:PORT`.
    InitTcp,
    /// `CHORUS_INIT_METHOD=file:///PATH`.
    InitFile,
    /// torchrun's variables (torchrun, chorusrun, by hand).
    Torchrun,
    /// SLURM's `srun`.
    Slurm,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// MPICH / Intel MPI (Hydra's PMI variables).
    Pmi,
    /// MVAPICH2.
    Mvapich2,
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Method::InitEnv => "CHORUS_INIT_METHOD=env://",
            Method::InitTcp => "CHORUS_INIT_METHOD=tcp://",
            Method::InitFile => "CHORUS_INIT_METHOD=file://",
            Method::Torchrun => "torchrun variables",
            Method::Slurm => "SLURM",
            Method::OpenMpi => "Open MPI",
            Method::Pmi => "MPICH/Intel MPI (PMI)",
            Method::Mvapich2 => "MVAPICH2",
        })
    }
}

/// This process's place in the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ranks {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
}

/// Where rank 0's store is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Master {
    /// At this host and port.
    Addr(String, u16),
    /// Published through a file on a shared filesystem (`file://`).
    ///
    /// Protocol: rank 0 picks its address (`CHORUS_SOCKET_ADDR`; else `127.0.0.1` when the
    /// whole job is on its host, else its host name), binds its store on `MASTER_PORT` (else
    /// on any free port: the port is bound before it is published), writes
    /// `chorus-rendezvous-v1 run=<run> addr=<host> port=<port>` into a temporary file beside
    /// the path and renames it over the path (atomic: readers see all of it or none). Every other rank polls the path until it holds a line for its own run, or
    /// `CHORUS_TIMEOUT` passes. `<run>` is `TORCHELASTIC_RUN_ID/TORCHELASTIC_RESTART_COUNT`,
    /// else `slurm-SLURM_JOB_ID.SLURM_STEP_ID`, else `PMIX_NAMESPACE`, else `-`, so a file left
    /// by an earlier attempt is not mistaken for this one's; with none of those set, use a path
    /// no earlier job used. The file is not removed.
    File {
        /// The shared path.
        path: PathBuf,
        /// The `CHORUS_INIT_METHOD` value, for messages.
        url: String,
    },
    /// Published in MPICH hydra's PMI-1 key-value space: rank 0 binds its store as for
    /// [`Master::File`] and puts `HOST:PORT` under [`STORE_KEY`](chorus_transport::store::pmi::STORE_KEY); after a PMI barrier
    /// the others get it.
    Pmi,
}

/// What [`detect`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Found {
    pub method: Method,
    pub ranks: Ranks,
    pub master: Master,
}

/// The variables carrying out a published rendezvous reads: where rank 0 says it is, the
/// store's port, the run's name, torchrun's agent store, and MPICH's PMI server.
const CARRY_OUT_VARS: [&str; 15] = [
    env::CHORUS_SOCKET_ADDR,
    env::MPIR_CVAR_CH3_INTERFACE_HOSTNAME,
    env::MASTER_ADDR,
    env::MASTER_PORT,
    env::TORCHELASTIC_USE_AGENT_STORE,
    env::TORCHELASTIC_RUN_ID,
    env::TORCHELASTIC_RESTART_COUNT,
    env::SLURM_JOB_ID,
    env::SLURM_JOBID,
    env::SLURM_STEP_ID,
    env::SLURM_STEPID,
    env::PMIX_NAMESPACE,
    env::PMI_FD,
    env::PMI_PORT,
    env::PMI_ID,
];

/// How the ranks of a job meet, as its environment describes it: rank 0's store at the
/// configuration's `master_addr` and `master_port` (the default), or published by rank 0 when
/// the communicator is made (a `file://` rendezvous, MPICH's PMI), when rank 0 binds its store
/// and publishes its address and the others read it.
///
/// [`Config::from_env`](crate::Config::from_env) describes it by reading variables only;
/// [`Communicator::new`](crate::Communicator::new) carries it out.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rendezvous {
    published: Option<Published>,
}

/// A rendezvous whose address rank 0 publishes, and the variables carrying it out reads.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Published {
    master: Master,
    vars: BTreeMap<&'static str, String>,
}

impl Rendezvous {
    /// The rendezvous `master` describes, with what carrying it out reads from `get`.
    pub(crate) fn new(master: Master, get: Lookup<'_>) -> Rendezvous {
        if matches!(master, Master::Addr(..)) {
            return Rendezvous::default();
        }
        let vars = CARRY_OUT_VARS
            .into_iter()
            .filter_map(|var| get(var).map(|value| (var, value)))
            .collect();
        Rendezvous {
            published: Some(Published { master, vars }),
        }
    }

    /// Whether rank 0 publishes its store's address when the communicator is made (and
    /// `master_addr` and `master_port` are filled in then).
    pub fn is_published(&self) -> bool {
        self.published.is_some()
    }

    /// Carries the rendezvous out for `config`, within its timeout: fills in the store's
    /// address and kind, and returns the store rank 0 bound to learn its port. Nothing to
    /// do where the store's address was given.
    pub(crate) fn carry_out(&self, config: &mut Config) -> Result<Option<StoreServer>, Error> {
        let Some(Published { master, vars }) = &self.published else {
            return Ok(None);
        };
        let get = |var: &str| vars.get(var).cloned();
        let ranks = Ranks {
            rank: config.rank,
            world_size: config.world_size,
            local_rank: config.local_rank,
            local_world_size: config.local_world_size,
        };
        let (addr, port, server) = master.resolve(&ranks, config.timeout, &get, &config.auth)?;
        config.store = store_kind(&get, &addr, port);
        tracing::info!(rank = ranks.rank, master = %format!("{addr}:{port}"), store = ?config.store, "rendezvous carried out");
        (config.master_addr, config.master_port) = (addr, port);
        Ok(server)
    }
}

/// The ranks of a process, for tests.
#[cfg(test)]
pub(crate) fn ranks(
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
) -> Ranks {
    Ranks {
        rank,
        world_size,
        local_rank,
        local_world_size,
    }
}

/// Fails unless `err` mentions every one of `needles`, for tests.
#[cfg(test)]
pub(crate) fn assert_mentions(err: &str, needles: &[&str]) {
    for needle in needles {
        assert!(err.contains(needle), "{err:?} should mention {needle:?}");
    }
}
