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

use std::fmt;
use std::path::PathBuf;

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
pub(crate) struct Rendezvous {
    pub method: Method,
    pub ranks: Ranks,
    pub master: Master,
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
