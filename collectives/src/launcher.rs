//! Which launcher started this process, and what it says about the job: rank, world size,
//! local rank and size, and where rank 0's rendezvous store is.
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
//!    from `SLURM_NTASKS_PER_NODE` or `SLURM_TASKS_PER_NODE` (`2(x3),1`) at `SLURM_NODEID`;
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

use std::fmt;
use std::io::{self, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use chorus_transport::auth::Auth;
use chorus_transport::store::StoreServer;

use crate::env::{self, bad, optional, Lookup};
use crate::{pmi, Error};

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

/// Default of `MASTER_ADDR` where it may be left out (a job of one rank) and the launchers'
/// default address of rank 0.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
/// Offset of the store port derived from `SLURM_JOB_ID`.
const SLURM_PORT_BASE: u16 = 10_000;
/// Number of distinct ports derived from `SLURM_JOB_ID`.
const SLURM_PORT_SPAN: u64 = 20_000;
/// First pause between two reads of a rendezvous file.
const FILE_FIRST_POLL: Duration = Duration::from_millis(10);
/// Longest pause between two reads of a rendezvous file.
const FILE_MAX_POLL: Duration = Duration::from_millis(250);
/// First word of a rendezvous file's content (names the format's version).
const FILE_MAGIC: &str = "chorus-rendezvous-v1";

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
    /// [`Master::File`] and puts `HOST:PORT` under [`pmi::STORE_KEY`]; after a PMI barrier
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

/// The variables one launcher sets for rank, size, local rank and local size.
struct Vars {
    method: Method,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    local_size: &'static str,
}

const TORCHRUN: Vars = Vars {
    method: Method::Torchrun,
    rank: env::RANK,
    size: env::WORLD_SIZE,
    local_rank: env::LOCAL_RANK,
    local_size: env::LOCAL_WORLD_SIZE,
};

/// The MPI flavours, in detection order.
const MPI: [Vars; 3] = [
    Vars {
        method: Method::OpenMpi,
        rank: env::OMPI_COMM_WORLD_RANK,
        size: env::OMPI_COMM_WORLD_SIZE,
        local_rank: env::OMPI_COMM_WORLD_LOCAL_RANK,
        local_size: env::OMPI_COMM_WORLD_LOCAL_SIZE,
    },
    Vars {
        method: Method::Pmi,
        rank: env::PMI_RANK,
        size: env::PMI_SIZE,
        local_rank: env::MPI_LOCALRANKID,
        local_size: env::MPI_LOCALNRANKS,
    },
    Vars {
        method: Method::Mvapich2,
        rank: env::MV2_COMM_WORLD_RANK,
        size: env::MV2_COMM_WORLD_SIZE,
        local_rank: env::MV2_COMM_WORLD_LOCAL_RANK,
        local_size: env::MV2_COMM_WORLD_LOCAL_SIZE,
    },
];

/// Every SLURM variable read, in the order error messages list them.
const SLURM_VARS: [&str; 15] = [
    env::SLURM_PROCID,
    env::SLURM_NTASKS,
    env::SLURM_NPROCS,
    env::SLURM_LOCALID,
    env::SLURM_NODEID,
    env::SLURM_NTASKS_PER_NODE,
    env::SLURM_TASKS_PER_NODE,
    env::SLURM_STEP_NODELIST,
    env::SLURM_JOB_NODELIST,
    env::SLURM_NODELIST,
    env::SLURM_JOB_ID,
    env::SLURM_JOBID,
    env::SLURM_STEP_ID,
    env::MASTER_ADDR,
    env::MASTER_PORT,
];

/// Works out the job from the environment (see the module docs for the order).
///
/// Fails naming the variable when one is missing, malformed or contradicts another, listing
/// the related variables that were found.
pub(crate) fn detect(get: Lookup<'_>) -> Result<Rendezvous, Error> {
    if let Some(url) = value(get, env::CHORUS_INIT_METHOD) {
        return init_method(&url, get);
    }
    let (method, ranks) = launcher_ranks(get)?.ok_or_else(|| {
        bad(
            env::RANK,
            "",
            "no launcher found: set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (as chorusrun \
             and torchrun do), start the processes with srun or mpirun, or set \
             CHORUS_INIT_METHOD",
        )
    })?;
    let master = if method == Method::Slurm {
        slurm_master(get, &ranks)?
    } else {
        given_master(get, &ranks, method)?
    };
    Ok(Rendezvous {
        method,
        ranks,
        master,
    })
}

/// The ranks from torchrun's variables, SLURM or MPI (in that order); `None` if none is set.
fn launcher_ranks(get: Lookup<'_>) -> Result<Option<(Method, Ranks)>, Error> {
    if value(get, TORCHRUN.rank).is_some() || value(get, TORCHRUN.size).is_some() {
        return standard_ranks(get, &TORCHRUN, false).map(|r| Some((Method::Torchrun, r)));
    }
    let mpi = MPI.iter().find(|v| value(get, v.rank).is_some());
    let slurm = value(get, env::SLURM_PROCID).is_some();
    match (slurm, mpi) {
        (false, None) => pmi_port_ranks(get),
        (true, None) => slurm_ranks(get).map(|r| Some((Method::Slurm, r))),
        (false, Some(vars)) => standard_ranks(get, vars, true).map(|r| Some((vars.method, r))),
        (true, Some(vars)) => {
            // srun --mpi=pmi2 sets PMI_RANK and PMI_SIZE (not the local ones) equal to SLURM's.
            let mpi_rank = optional::<usize>(get, vars.rank)?;
            let mpi_size = optional::<usize>(get, vars.size)?;
            if let Ok(s) = slurm_ranks(get) {
                if (Some(s.rank), Some(s.world_size)) == (mpi_rank, mpi_size) {
                    tracing::debug!(mpi = %vars.method, "SLURM and MPI variables agree");
                    return Ok(Some((Method::Slurm, s)));
                }
            }
            let mpi = standard_ranks(get, vars, true)?;
            tracing::info!(
                "{} says rank {} of {} but SLURM_PROCID={}: started by mpirun inside a SLURM \
                 allocation, using {} (the SLURM variables are the batch step's)",
                vars.method,
                mpi.rank,
                mpi.world_size,
                value(get, env::SLURM_PROCID).unwrap_or_default(),
                vars.method
            );
            Ok(Some((vars.method, mpi)))
        }
    }
}

/// Under `mpiexec -pmi-port` hydra gives the rank and size through PMI only (this connects to
/// it); `None` when `PMI_PORT` is not set.
fn pmi_port_ranks(get: Lookup<'_>) -> Result<Option<(Method, Ranks)>, Error> {
    let assigned = pmi::assigned_ranks(get).map_err(|reason| pmi_error(get, &reason))?;
    let Some((rank, world_size)) = assigned else {
        return Ok(None);
    };
    let locals = [env::MPI_LOCALRANKID, env::MPI_LOCALNRANKS];
    let need = |var: &'static str| -> Result<usize, Error> {
        optional(get, var)?.ok_or_else(|| missing(get, var, &locals, Method::Pmi))
    };
    let ranks = Ranks {
        rank,
        world_size,
        local_rank: need(env::MPI_LOCALRANKID)?,
        local_world_size: need(env::MPI_LOCALNRANKS)?,
    };
    check(
        &ranks,
        env::PMI_ID,
        env::PMI_PORT,
        env::MPI_LOCALRANKID,
        env::MPI_LOCALNRANKS,
    )?;
    Ok(Some((Method::Pmi, ranks)))
}

/// An error of the PMI exchange, naming the variable that named the server.
fn pmi_error(get: Lookup<'_>, reason: &str) -> Error {
    let (var, value) = pmi::server(get).unwrap_or((env::PMI_FD, String::new()));
    bad(
        var,
        &value,
        &format!("MPICH hydra's PMI rendezvous failed: {reason}"),
    )
}

/// `CHORUS_INIT_METHOD`: `env://`, `tcp://HOST:PORT` or `file:///PATH`.
fn init_method(url: &str, get: Lookup<'_>) -> Result<Rendezvous, Error> {
    const VAR: &str = env::CHORUS_INIT_METHOD;
    if url == "env://" {
        if value(get, TORCHRUN.rank).is_none() && value(get, TORCHRUN.size).is_none() {
            return Err(bad(
                VAR,
                url,
                &format!(
                    "env:// needs RANK and WORLD_SIZE; found {}",
                    found(
                        get,
                        &[
                            env::RANK,
                            env::WORLD_SIZE,
                            env::MASTER_ADDR,
                            env::MASTER_PORT
                        ]
                    )
                ),
            ));
        }
        let ranks = standard_ranks(get, &TORCHRUN, false)?;
        let master = given_master(get, &ranks, Method::InitEnv)?;
        return Ok(Rendezvous {
            method: Method::InitEnv,
            ranks,
            master,
        });
    }
    let (method, master_of) = if let Some(rest) = url.strip_prefix("tcp://") {
        let (host, port) = parse_host_port(rest.trim_end_matches('/'))
            .map_err(|reason| bad(VAR, url, &format!("{reason} (expected tcp://HOST:PORT)")))?;
        (Method::InitTcp, Master::Addr(host, port))
    } else if let Some(path) = url.strip_prefix("file://") {
        if !path.starts_with('/') {
            return Err(bad(
                VAR,
                url,
                "needs an absolute path: file:///shared/path (three slashes)",
            ));
        }
        let master = Master::File {
            path: PathBuf::from(path),
            url: url.to_string(),
        };
        (Method::InitFile, master)
    } else {
        return Err(bad(
            VAR,
            url,
            "expected env://, tcp://HOST:PORT or file:///shared/path",
        ));
    };
    let (source, ranks) = launcher_ranks(get)?.ok_or_else(|| {
        bad(
            env::RANK,
            "",
            &format!(
                "CHORUS_INIT_METHOD={url} says where rank 0 is but not which rank this is: set \
                 RANK and WORLD_SIZE, or start the processes with srun or mpirun"
            ),
        )
    })?;
    tracing::debug!(%source, "ranks for {method}");
    Ok(Rendezvous {
        method,
        ranks,
        master: master_of,
    })
}

/// `HOST:PORT` or `[V6]:PORT`.
fn parse_host_port(s: &str) -> Result<(String, u16), String> {
    let (host, port) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("no port in {s:?}"))?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() {
        return Err("empty host".into());
    }
    match port.parse::<u16>() {
        Ok(p) if p != 0 => Ok((host.to_string(), p)),
        _ => Err(format!("bad port {port:?}")),
    }
}

/// Rank, size, local rank and local size from one launcher's four variables.
///
/// `locals_required`: whether a missing local variable is an error (MPI always sets them);
/// otherwise they default to the global ones (torchrun's contract, single node).
fn standard_ranks(get: Lookup<'_>, vars: &Vars, locals_required: bool) -> Result<Ranks, Error> {
    let all = [vars.rank, vars.size, vars.local_rank, vars.local_size];
    let need = |var: &'static str| -> Result<usize, Error> {
        optional(get, var)?.ok_or_else(|| missing(get, var, &all, vars.method))
    };
    let rank = need(vars.rank)?;
    let world_size = need(vars.size)?;
    let (local_rank, local_world_size) = if locals_required {
        (need(vars.local_rank)?, need(vars.local_size)?)
    } else {
        (
            optional(get, vars.local_rank)?.unwrap_or(rank),
            optional(get, vars.local_size)?.unwrap_or(world_size),
        )
    };
    let ranks = Ranks {
        rank,
        world_size,
        local_rank,
        local_world_size,
    };
    check(
        &ranks,
        vars.rank,
        vars.size,
        vars.local_rank,
        vars.local_size,
    )?;
    Ok(ranks)
}

/// SLURM's ranks (see the module docs).
fn slurm_ranks(get: Lookup<'_>) -> Result<Ranks, Error> {
    let method = Method::Slurm;
    let need = |var: &'static str| -> Result<usize, Error> {
        optional(get, var)?.ok_or_else(|| missing(get, var, &SLURM_VARS, method))
    };
    let rank = need(env::SLURM_PROCID)?;
    let world_size = match optional(get, env::SLURM_NTASKS)? {
        Some(n) => n,
        None => optional(get, env::SLURM_NPROCS)?
            .ok_or_else(|| missing(get, env::SLURM_NTASKS, &SLURM_VARS, method))?,
    };
    let local_rank = need(env::SLURM_LOCALID)?;
    let (local_world_size, local_var) = if let Some(n) = optional(get, env::SLURM_NTASKS_PER_NODE)?
    {
        (n, env::SLURM_NTASKS_PER_NODE)
    } else if let Some(list) = value(get, env::SLURM_TASKS_PER_NODE) {
        let node = need(env::SLURM_NODEID)?;
        let n = tasks_on_node(&list, node).map_err(|reason| {
            bad(
                env::SLURM_TASKS_PER_NODE,
                &list,
                &format!("{reason} (SLURM_NODEID={node})"),
            )
        })?;
        (n, env::SLURM_TASKS_PER_NODE)
    } else {
        return Err(bad(
            env::SLURM_TASKS_PER_NODE,
            "",
            &format!(
                "found {} but neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set \
                 ({method})",
                found(get, &SLURM_VARS)
            ),
        ));
    };
    let ranks = Ranks {
        rank,
        world_size,
        local_rank,
        local_world_size,
    };
    check(
        &ranks,
        env::SLURM_PROCID,
        env::SLURM_NTASKS,
        env::SLURM_LOCALID,
        local_var,
    )?;
    Ok(ranks)
}

/// SLURM's master: `MASTER_ADDR` or the first host of the node list, `MASTER_PORT` or a port
/// derived from the job id.
fn slurm_master(get: Lookup<'_>, ranks: &Ranks) -> Result<Master, Error> {
    let single = ranks.world_size == 1;
    let addr = match value(get, env::MASTER_ADDR) {
        Some(addr) => addr,
        None => {
            let list = [
                env::SLURM_STEP_NODELIST,
                env::SLURM_JOB_NODELIST,
                env::SLURM_NODELIST,
            ]
            .into_iter()
            .find_map(|var| value(get, var).map(|list| (var, list)));
            match list {
                Some((var, list)) => {
                    first_host(&list).map_err(|reason| bad(var, &list, &reason))?
                }
                None if single => DEFAULT_MASTER_ADDR.to_string(),
                None => {
                    return Err(missing(
                        get,
                        env::SLURM_JOB_NODELIST,
                        &SLURM_VARS,
                        Method::Slurm,
                    ))
                }
            }
        }
    };
    let job_id = match optional::<u64>(get, env::SLURM_JOB_ID)? {
        Some(id) => Some(id),
        None => optional::<u64>(get, env::SLURM_JOBID)?,
    };
    let port = match (optional::<u16>(get, env::MASTER_PORT)?, job_id) {
        (Some(port), _) => port,
        (None, Some(id)) => slurm_port(id),
        (None, None) if single => 0,
        (None, None) => return Err(missing(get, env::SLURM_JOB_ID, &SLURM_VARS, Method::Slurm)),
    };
    Ok(Master::Addr(addr, port))
}

/// The store port of a SLURM job: `10000 + job_id % 20000`.
pub(crate) fn slurm_port(job_id: u64) -> u16 {
    // The remainder is below 20000, so the sum fits in a u16.
    SLURM_PORT_BASE + (job_id % SLURM_PORT_SPAN) as u16
}

/// `MASTER_ADDR` and `MASTER_PORT`, required unless the job has one rank or MPICH's hydra
/// serves PMI (then [`Master::Pmi`] when `MASTER_ADDR` is not set).
fn given_master(get: Lookup<'_>, ranks: &Ranks, method: Method) -> Result<Master, Error> {
    let single = ranks.world_size == 1;
    let mpi = MPI.iter().find(|v| v.method == method);
    let hydra = method == Method::Pmi || method == Method::Mvapich2;
    if hydra && !single && value(get, env::MASTER_ADDR).is_none() && pmi::server(get).is_some() {
        return Ok(Master::Pmi);
    }
    let hint = |var: &'static str| -> Error {
        let reason = match mpi {
            Some(vars) => format!(
                "not set: {method} (found {}) does not say where rank 0 is; export MASTER_ADDR \
                 and MASTER_PORT to every rank ({}), or set CHORUS_INIT_METHOD=tcp://HOST:PORT \
                 or file:///shared/path",
                found(
                    get,
                    &[vars.rank, vars.size, vars.local_rank, vars.local_size]
                ),
                export_advice(method)
            ),
            None if var == env::MASTER_ADDR => "not set (the host of rank 0)".to_string(),
            None => "not set (the port of rank 0's store)".to_string(),
        };
        bad(var, "", &reason)
    };
    let addr = match value(get, env::MASTER_ADDR) {
        Some(addr) => addr,
        None if single => DEFAULT_MASTER_ADDR.to_string(),
        None => return Err(hint(env::MASTER_ADDR)),
    };
    let port = match optional::<u16>(get, env::MASTER_PORT)? {
        Some(port) => port,
        None if single => 0,
        None => return Err(hint(env::MASTER_PORT)),
    };
    Ok(Master::Addr(addr, port))
}

/// How `method`'s launcher exports the two variables to every rank.
fn export_advice(method: Method) -> &'static str {
    match method {
        Method::OpenMpi => "mpirun -x MASTER_ADDR=HOST -x MASTER_PORT=PORT",
        Method::Mvapich2 => "mpirun_rsh ... MASTER_ADDR=HOST MASTER_PORT=PORT prog",
        _ => {
            "mpiexec -genv MASTER_ADDR HOST -genv MASTER_PORT PORT; under MPICH's hydra \
             mpiexec, PMI_FD carries rank 0's address without them"
        }
    }
}

/// Range checks shared by every launcher, naming the launcher's variables.
fn check(
    r: &Ranks,
    rank_var: &'static str,
    size_var: &'static str,
    local_rank_var: &'static str,
    local_size_var: &'static str,
) -> Result<(), Error> {
    if r.world_size == 0 {
        return Err(bad(size_var, "0", "must be at least 1"));
    }
    if r.rank >= r.world_size {
        return Err(bad(
            rank_var,
            &r.rank.to_string(),
            &format!("must be below {size_var}={}", r.world_size),
        ));
    }
    if r.local_world_size == 0 || r.local_world_size > r.world_size {
        return Err(bad(
            local_size_var,
            &r.local_world_size.to_string(),
            &format!("must be between 1 and {size_var}={}", r.world_size),
        ));
    }
    if r.local_rank >= r.local_world_size {
        return Err(bad(
            local_rank_var,
            &r.local_rank.to_string(),
            &format!(
                "must be below {local_size_var}={} (the processes on this node)",
                r.local_world_size
            ),
        ));
    }
    Ok(())
}

/// A variable's trimmed value, `None` when unset or blank.
fn value(get: Lookup<'_>, var: &str) -> Option<String> {
    get(var)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// `A=1, B=2` for those of `vars` that are set, or `no related variables`.
fn found(get: Lookup<'_>, vars: &[&str]) -> String {
    let set: Vec<String> = vars
        .iter()
        .filter_map(|var| value(get, var).map(|v| format!("{var}={v}")))
        .collect();
    if set.is_empty() {
        "no related variables".to_string()
    } else {
        set.join(", ")
    }
}

/// "not set: found A=1, B=2 but C is missing (launcher)".
fn missing(get: Lookup<'_>, var: &'static str, family: &[&str], method: Method) -> Error {
    bad(
        var,
        "",
        &format!(
            "not set: found {} but {var} is missing ({method})",
            found(get, family)
        ),
    )
}

/// The number of tasks on node `node` of a `SLURM_TASKS_PER_NODE` list like `2(x3),1`.
pub(crate) fn tasks_on_node(list: &str, node: usize) -> Result<usize, String> {
    let mut first = 0usize;
    for item in list.split(',') {
        let item = item.trim();
        let (count, repeat) = match item.split_once("(x") {
            Some((count, rest)) => {
                let repeat = rest
                    .strip_suffix(')')
                    .ok_or_else(|| format!("unclosed repeat in {item:?}"))?;
                (count, repeat)
            }
            None => (item, "1"),
        };
        let count: usize = count
            .parse()
            .map_err(|_| format!("bad task count {count:?} in {item:?}"))?;
        let repeat: usize = repeat
            .parse()
            .map_err(|_| format!("bad repeat {repeat:?} in {item:?}"))?;
        if node < first.saturating_add(repeat) {
            return Ok(count);
        }
        first = first.saturating_add(repeat);
    }
    Err(format!("lists only {first} nodes"))
}

/// One piece of a host expression: literal text or a bracketed set of numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    /// Inclusive ranges, each with its zero-padded width.
    Numbers(Vec<(u64, u64, usize)>),
}

/// Splits a SLURM host list into host expressions (commas outside brackets) and parses each.
fn parse_hostlist(list: &str) -> Result<Vec<Vec<Piece>>, String> {
    let list = list.trim();
    if list.is_empty() {
        return Err("empty host list".into());
    }
    let mut exprs = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(format!("nested '[' at byte {i}")),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(format!("unmatched ']' at byte {i}")),
            ',' if depth == 0 => {
                exprs.push(parse_host_expr(&list[start..i])?);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("unclosed '['".into());
    }
    exprs.push(parse_host_expr(&list[start..])?);
    Ok(exprs)
}

/// Parses `rack[1-2]-node[01-04,07]` into pieces.
fn parse_host_expr(expr: &str) -> Result<Vec<Piece>, String> {
    let expr = expr.trim();
    if expr.is_empty() {
        return Err("empty host name".into());
    }
    let mut pieces = Vec::new();
    let mut rest = expr;
    while !rest.is_empty() {
        match rest.find('[') {
            Some(0) => {
                let close = rest.find(']').ok_or("unclosed '['")?;
                pieces.push(Piece::Numbers(parse_ranges(&rest[1..close])?));
                rest = &rest[close + 1..];
            }
            Some(open) => {
                pieces.push(Piece::Text(rest[..open].to_string()));
                rest = &rest[open..];
            }
            None => {
                pieces.push(Piece::Text(rest.to_string()));
                rest = "";
            }
        }
    }
    Ok(pieces)
}

/// `01-04,07` into `[(1, 4, 2), (7, 7, 2)]`.
fn parse_ranges(spec: &str) -> Result<Vec<(u64, u64, usize)>, String> {
    let number = |s: &str| -> Result<u64, String> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("bad number {s:?} in [{spec}]"));
        }
        s.parse().map_err(|_| format!("number {s:?} too large"))
    };
    spec.split(',')
        .map(|part| {
            let part = part.trim();
            let (lo, hi) = part.split_once('-').unwrap_or((part, part));
            let (a, b) = (number(lo)?, number(hi)?);
            if a > b {
                return Err(format!("range {part:?} runs backwards"));
            }
            Ok((a, b, lo.len()))
        })
        .collect()
}

/// Every host of a SLURM host list, lazily: `node[01-03,07],login1` gives `node01`, `node02`,
/// `node03`, `node07`, `login1`; several brackets in one name vary leftmost-slowest
/// (`r[1-2]n[1-2]`: `r1n1`, `r1n2`, `r2n1`, `r2n2`).
///
/// Fails on a malformed list (empty names, unclosed or nested brackets, bad ranges).
pub(crate) fn hosts(list: &str) -> Result<impl Iterator<Item = String>, String> {
    Ok(parse_hostlist(list)?.into_iter().flat_map(expand_expr))
}

/// The names one host expression stands for.
fn expand_expr(pieces: Vec<Piece>) -> Box<dyn Iterator<Item = String>> {
    let start: Box<dyn Iterator<Item = String>> = Box::new(std::iter::once(String::new()));
    pieces.into_iter().fold(start, |names, piece| match piece {
        Piece::Text(text) => Box::new(names.map(move |name| name + &text)),
        Piece::Numbers(ranges) => Box::new(names.flat_map(move |name| {
            ranges.clone().into_iter().flat_map(move |(a, b, width)| {
                let name = name.clone();
                (a..=b).map(move |i| format!("{name}{i:0width$}"))
            })
        })),
    })
}

/// The first host of a SLURM host list (the rest is not expanded).
pub(crate) fn first_host(list: &str) -> Result<String, String> {
    hosts(list)?
        .next()
        .ok_or_else(|| "empty host list".to_string())
}

impl Master {
    /// The store's host and port, and the store itself when this process had to bind it to
    /// learn its port; for `file://` this writes (rank 0) or waits for (others) the shared
    /// file, within `timeout`.
    ///
    /// Rank 0 of a `file://` rendezvous binds its store (with `auth`) before it publishes the
    /// port, on `MASTER_PORT` or else on any free port, so that the port it publishes is
    /// already its own; only where torchrun's agent serves its store at `MASTER_PORT` (see
    /// [`store_kind`]) does it publish that one without binding anything.
    pub(crate) fn resolve(
        &self,
        ranks: &Ranks,
        timeout: Duration,
        get: Lookup<'_>,
        auth: &Auth,
    ) -> Result<(String, u16, Option<StoreServer>), Error> {
        match self {
            Master::Addr(addr, port) => Ok((addr.clone(), *port, None)),
            Master::File { .. } | Master::Pmi if ranks.world_size == 1 => {
                Ok((DEFAULT_MASTER_ADDR.to_string(), 0, None))
            }
            Master::Pmi => {
                // Rank 0's store, and its own error (a busy MASTER_PORT) if it cannot bind it.
                let (mut server, mut failed) = (None, None);
                let publish = || match host_store(get, ranks, auth) {
                    Ok((addr, port, bound)) => {
                        server = bound;
                        Ok(join_host_port(&addr, port))
                    }
                    Err(e) => {
                        let reason = e.to_string();
                        failed = Some(e);
                        Err(reason)
                    }
                };
                let at = pmi::rendezvous(get, ranks.rank, timeout, publish).map_err(|reason| {
                    failed.take().unwrap_or_else(|| {
                        pmi_error(
                            get,
                            &format!("rank {} of {}: {reason}", ranks.rank, ranks.world_size),
                        )
                    })
                })?;
                let (addr, port) = parse_host_port(&at).map_err(|reason| {
                    pmi_error(get, &format!("rank 0 published {at:?}: {reason}"))
                })?;
                tracing::info!(%addr, port, rank = ranks.rank, "store address through PMI");
                Ok((addr, port, server))
            }
            Master::File { path, url } => {
                let run = run_token(get);
                if ranks.rank == 0 {
                    let (addr, port, server) = host_store(get, ranks, auth)?;
                    publish(path, &run, &addr, port).map_err(|e| {
                        bad(
                            env::CHORUS_INIT_METHOD,
                            url,
                            &format!("rank 0 cannot write {}: {e}", path.display()),
                        )
                    })?;
                    tracing::info!(path = %path.display(), %addr, port, %run, "published the store address");
                    Ok((addr, port, server))
                } else {
                    let (addr, port) = wait_for_file(path, &run, timeout).map_err(|reason| {
                        bad(
                            env::CHORUS_INIT_METHOD,
                            url,
                            &format!("rank {} of {}: {reason}", ranks.rank, ranks.world_size),
                        )
                    })?;
                    Ok((addr, port, None))
                }
            }
        }
    }
}

/// Rank 0's side of a published rendezvous (`file://`, PMI): the address the others reach it
/// at (`CHORUS_SOCKET_ADDR`; else `127.0.0.1` when the whole job is on this host, else the
/// name hydra's `mpiexec` reached this host by, else the host name) and its store, bound on `MASTER_PORT` or else on any free port, so that the
/// port published is already its own; only where torchrun's agent serves its store at
/// `MASTER_PORT` is that one published without binding anything.
///
/// Fails when the store cannot be bound.
fn host_store(
    get: Lookup<'_>,
    ranks: &Ranks,
    auth: &Auth,
) -> Result<(String, u16, Option<StoreServer>), Error> {
    let addr = match value(get, env::CHORUS_SOCKET_ADDR) {
        Some(addr) => addr,
        None if ranks.local_world_size == ranks.world_size => "127.0.0.1".to_string(),
        None => value(get, env::MPIR_CVAR_CH3_INTERFACE_HOSTNAME).unwrap_or_else(host_name),
    };
    let given = optional::<u16>(get, env::MASTER_PORT)?.unwrap_or(0);
    if given != 0 && store_kind(get, &addr, given) != StoreKind::Chorus {
        return Ok((addr, given, None));
    }
    let any = SocketAddr::from(([0, 0, 0, 0], given));
    let server = StoreServer::bind_with_auth(any, auth.clone())?;
    Ok((addr, server.local_addr().port(), Some(server)))
}

/// `HOST:PORT`, with an IPv6 address in brackets.
fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// torchrun's agent store when `TORCHELASTIC_USE_AGENT_STORE` is `True` and the store found is
/// the one the agent names in `MASTER_ADDR` and `MASTER_PORT` (torch decides alike), else
/// Chorus's own.
pub(crate) fn store_kind(get: Lookup<'_>, master_addr: &str, master_port: u16) -> StoreKind {
    let agent = value(get, env::TORCHELASTIC_USE_AGENT_STORE).as_deref() == Some("True")
        && value(get, env::MASTER_ADDR).as_deref() == Some(master_addr)
        && value(get, env::MASTER_PORT).and_then(|p| p.parse().ok()) == Some(master_port);
    if agent {
        StoreKind::TorchAgent {
            run: run_token(get),
        }
    } else {
        StoreKind::Chorus
    }
}

/// The run a rendezvous file, or torchrun's agent store, holds keys of (see [`Master::File`]).
fn run_token(get: Lookup<'_>) -> String {
    let token = if let Some(id) = value(get, env::TORCHELASTIC_RUN_ID) {
        let restart = value(get, env::TORCHELASTIC_RESTART_COUNT).unwrap_or_else(|| "0".into());
        format!("{id}/{restart}")
    } else if let Some(job) = value(get, env::SLURM_JOB_ID).or_else(|| value(get, env::SLURM_JOBID))
    {
        let step = value(get, env::SLURM_STEP_ID)
            .or_else(|| value(get, env::SLURM_STEPID))
            .unwrap_or_else(|| "-".into());
        format!("slurm-{job}.{step}")
    } else if let Some(ns) = value(get, env::PMIX_NAMESPACE) {
        ns
    } else {
        "-".to_string()
    };
    token.split_whitespace().collect::<Vec<_>>().join("_")
}

/// Writes the file atomically: a temporary file beside it, then a rename.
fn publish(path: &Path, run: &str, addr: &str, port: u16) -> io::Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path names no file"))?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let write = || -> io::Result<()> {
        let mut file = std::fs::File::create(&tmp)?;
        writeln!(file, "{FILE_MAGIC} run={run} addr={addr} port={port}")?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Parses a rendezvous file's content into (run, addr, port).
fn parse_published(text: &str) -> Option<(String, String, u16)> {
    let mut words = text.split_whitespace();
    if words.next()? != FILE_MAGIC {
        return None;
    }
    let (mut run, mut addr, mut port) = (None, None, None);
    for word in words {
        match word.split_once('=')? {
            ("run", v) => run = Some(v.to_string()),
            ("addr", v) => addr = Some(v.to_string()),
            ("port", v) => port = v.parse().ok(),
            _ => {}
        }
    }
    Some((run?, addr?, port?))
}

/// Polls `path` until it holds an address for `run`, or `timeout` passes.
fn wait_for_file(path: &Path, run: &str, timeout: Duration) -> Result<(String, u16), String> {
    let deadline = Instant::now() + timeout;
    let mut pause = FILE_FIRST_POLL;
    loop {
        let state = match std::fs::read_to_string(path) {
            Ok(text) => match parse_published(&text) {
                Some((r, addr, port)) if r == run => {
                    tracing::info!(path = %path.display(), %addr, port, "read the store address");
                    return Ok((addr, port));
                }
                Some((r, ..)) => format!("it holds an address for run {r:?}, not {run:?}"),
                None => format!("its content is not a Chorus rendezvous line: {text:?}"),
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => "it does not exist".to_string(),
            Err(e) => format!("it cannot be read: {e}"),
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(format!(
                "rank 0 did not publish its address in {} within {:?} ({state})",
                path.display(),
                timeout
            ));
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(FILE_MAX_POLL);
    }
}

/// This host's name (what other nodes resolve), or 127.0.0.1 if it cannot be found.
fn host_name() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var(env::HOSTNAME).ok())
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty());
    name.unwrap_or_else(|| {
        tracing::warn!(
            "cannot find this host's name; publishing 127.0.0.1 (set CHORUS_SOCKET_ADDR)"
        );
        "127.0.0.1".to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn detect_in(vars: &[(&str, &str)]) -> Result<Rendezvous, Error> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        detect(&|k: &str| map.get(k).cloned())
    }

    fn ranks(rank: usize, world_size: usize, local_rank: usize, local_world_size: usize) -> Ranks {
        Ranks {
            rank,
            world_size,
            local_rank,
            local_world_size,
        }
    }

    fn addr(host: &str, port: u16) -> Master {
        Master::Addr(host.to_string(), port)
    }

    /// The error's text; panics if detection succeeded.
    fn error(vars: &[(&str, &str)]) -> String {
        match detect_in(vars) {
            Ok(found) => panic!("expected an error for {vars:?}, got {found:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn assert_mentions(err: &str, needles: &[&str]) {
        for needle in needles {
            assert!(err.contains(needle), "{err:?} should mention {needle:?}");
        }
    }

    /// What srun sets for task 3 of `srun -N2 --ntasks-per-node=2` (second node, second task).
    const SRUN_2X2: [(&str, &str); 8] = [
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "1"),
        ("SLURM_TASKS_PER_NODE", "2(x2)"),
        ("SLURM_JOB_NODELIST", "node[07-08]"),
        ("SLURM_NODELIST", "node[07-08]"),
        ("SLURM_JOB_ID", "123456"),
    ];

    #[test]
    fn slurm_srun() {
        let found = detect_in(&SRUN_2X2).unwrap();
        assert_eq!(found.method, Method::Slurm);
        assert_eq!(found.ranks, ranks(3, 4, 1, 2));
        // 10000 + 123456 % 20000
        assert_eq!(found.master, addr("node07", 13_456));
    }

    #[test]
    fn slurm_overrides_and_variants() {
        let mut vars = SRUN_2X2.to_vec();
        vars.extend([("MASTER_ADDR", "10.1.2.3"), ("MASTER_PORT", "29400")]);
        assert_eq!(detect_in(&vars).unwrap().master, addr("10.1.2.3", 29_400));

        // --ntasks-per-node wins over the per-node list; the step's node list over the job's;
        // old names SLURM_NPROCS and SLURM_JOBID still work.
        let vars = [
            ("SLURM_PROCID", "5"),
            ("SLURM_NPROCS", "6"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NTASKS_PER_NODE", "3"),
            ("SLURM_TASKS_PER_NODE", "1(x6)"),
            ("SLURM_STEP_NODELIST", "gpu[3-4]"),
            ("SLURM_JOB_NODELIST", "gpu[1-4]"),
            ("SLURM_JOBID", "40001"),
        ];
        let found = detect_in(&vars).unwrap();
        assert_eq!(found.ranks, ranks(5, 6, 2, 3));
        assert_eq!(found.master, addr("gpu3", 10_001));

        // Uneven nodes: 3 tasks on node 0, 2 on nodes 1 and 2, 1 on node 3.
        for (node, local_size) in [(0, 3), (1, 2), (2, 2), (3, 1)] {
            let node = node.to_string();
            let vars = [
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "8"),
                ("SLURM_LOCALID", "0"),
                ("SLURM_NODEID", node.as_str()),
                ("SLURM_TASKS_PER_NODE", "3,2(x2),1"),
                ("SLURM_NODELIST", "a[1-2],b3,c"),
                ("SLURM_JOB_ID", "7"),
            ];
            let found = detect_in(&vars).unwrap();
            assert_eq!(found.ranks.local_world_size, local_size, "node {node}");
            assert_eq!(found.master, addr("a1", 10_007));
        }

        // One task needs no node list or job id.
        let vars = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NTASKS_PER_NODE", "1"),
        ];
        assert_eq!(detect_in(&vars).unwrap().master, addr("127.0.0.1", 0));
    }

    #[test]
    fn slurm_errors_list_what_was_found() {
        let err = error(&[("SLURM_PROCID", "3"), ("SLURM_LOCALID", "1")]);
        assert_mentions(
            &err,
            &[
                "SLURM_NTASKS=\"\"",
                "found SLURM_PROCID=3, SLURM_LOCALID=1 but SLURM_NTASKS is missing (SLURM)",
            ],
        );

        let err = error(&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4")]);
        assert_mentions(&err, &["but SLURM_LOCALID is missing"]);

        let err = error(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
        ]);
        assert_mentions(
            &err,
            &["neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set"],
        );

        let err = error(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
        ]);
        assert_mentions(&err, &["but SLURM_NODEID is missing"]);

        let mut vars = SRUN_2X2.to_vec();
        vars[0] = ("SLURM_PROCID", "4");
        assert_mentions(
            &error(&vars),
            &["SLURM_PROCID=\"4\"", "must be below SLURM_NTASKS=4"],
        );

        let mut vars = SRUN_2X2.to_vec();
        vars[2] = ("SLURM_LOCALID", "2");
        assert_mentions(
            &error(&vars),
            &["SLURM_LOCALID=\"2\"", "below SLURM_TASKS_PER_NODE=2"],
        );

        let mut vars = SRUN_2X2.to_vec();
        vars[3] = ("SLURM_NODEID", "2");
        assert_mentions(
            &error(&vars),
            &[
                "SLURM_TASKS_PER_NODE=\"2(x2)\"",
                "lists only 2 nodes (SLURM_NODEID=2)",
            ],
        );

        let mut vars = SRUN_2X2.to_vec();
        vars[1] = ("SLURM_NTASKS", "four");
        assert_mentions(&error(&vars), &["SLURM_NTASKS=\"four\""]);

        let vars: Vec<_> = SRUN_2X2
            .iter()
            .copied()
            .filter(|(k, _)| !k.ends_with("NODELIST"))
            .collect();
        assert_mentions(
            &error(&vars),
            &[
                "SLURM_JOB_NODELIST=\"\"",
                "SLURM_PROCID=3",
                "but SLURM_JOB_NODELIST is missing",
            ],
        );

        let vars: Vec<_> = SRUN_2X2
            .iter()
            .copied()
            .filter(|(k, _)| *k != "SLURM_JOB_ID")
            .collect();
        assert_mentions(&error(&vars), &["but SLURM_JOB_ID is missing"]);

        let mut vars = SRUN_2X2.to_vec();
        vars[5] = ("SLURM_JOB_NODELIST", "node[07-");
        vars[6] = ("SLURM_NODELIST", "");
        assert_mentions(
            &error(&vars),
            &["SLURM_JOB_NODELIST=\"node[07-\"", "unclosed"],
        );
    }

    #[test]
    fn mpi_flavours() {
        let flavours = [
            (
                Method::OpenMpi,
                MPI[0].rank,
                MPI[0].size,
                MPI[0].local_rank,
                MPI[0].local_size,
            ),
            (
                Method::Pmi,
                "PMI_RANK",
                "PMI_SIZE",
                "MPI_LOCALRANKID",
                "MPI_LOCALNRANKS",
            ),
            (
                Method::Mvapich2,
                "MV2_COMM_WORLD_RANK",
                "MV2_COMM_WORLD_SIZE",
                "MV2_COMM_WORLD_LOCAL_RANK",
                "MV2_COMM_WORLD_LOCAL_SIZE",
            ),
        ];
        for (method, rank, size, local_rank, local_size) in flavours {
            let advice = match method {
                Method::OpenMpi => "mpirun -x MASTER_ADDR=HOST -x MASTER_PORT=PORT",
                Method::Pmi => "mpiexec -genv MASTER_ADDR HOST -genv MASTER_PORT PORT",
                _ => "mpirun_rsh ... MASTER_ADDR=HOST MASTER_PORT=PORT prog",
            };
            let vars = [
                (rank, "5"),
                (size, "8"),
                (local_rank, "1"),
                (local_size, "4"),
                ("MASTER_ADDR", "head"),
                ("MASTER_PORT", "29500"),
            ];
            let found = detect_in(&vars).unwrap();
            assert_eq!(found.method, method);
            assert_eq!(found.ranks, ranks(5, 8, 1, 4));
            assert_eq!(found.master, addr("head", 29_500));

            // Without MASTER_*: a clear error listing what MPI gave.
            let err = error(&vars[..4]);
            assert_mentions(
                &err,
                &[
                    "MASTER_ADDR=\"\"",
                    &format!("{method} (found {rank}=5, {size}=8, {local_rank}=1, {local_size}=4)"),
                    advice,
                    "CHORUS_INIT_METHOD",
                ],
            );
            let err = error(&[vars[0], vars[1], vars[2], vars[3], vars[4]]);
            assert_mentions(&err, &["MASTER_PORT=\"\"", "does not say where rank 0 is"]);

            // Missing and contradictory values.
            let err = error(&[(rank, "5"), (size, "8"), (local_rank, "1")]);
            assert_mentions(
                &err,
                &[&format!(
                    "found {rank}=5, {size}=8, {local_rank}=1 but {local_size} is missing"
                )],
            );
            let err = error(&[
                (rank, "8"),
                (size, "8"),
                (local_rank, "1"),
                (local_size, "4"),
            ]);
            assert_mentions(
                &err,
                &[&format!("{rank}=\"8\""), &format!("below {size}=8")],
            );
            let err = error(&[
                (rank, "1"),
                (size, "2"),
                (local_rank, "0"),
                (local_size, "4"),
            ]);
            assert_mentions(&err, &[&format!("{local_size}=\"4\""), "between 1 and"]);
        }
    }

    #[test]
    fn hydra_pmi_carries_the_address() {
        let hydra = [
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "4"),
            ("PMI_FD", "6"),
        ];
        let found = detect_in(&hydra).unwrap();
        assert_eq!(found.method, Method::Pmi);
        assert_eq!(found.ranks, ranks(1, 4, 1, 4));
        assert_eq!(found.master, Master::Pmi);
        // MASTER_ADDR exported (mpiexec -genv) wins over PMI.
        let mut vars = hydra.to_vec();
        vars.extend([("MASTER_ADDR", "head"), ("MASTER_PORT", "29500")]);
        assert_eq!(detect_in(&vars).unwrap().master, addr("head", 29_500));
        // Open MPI has no PMI-1 server: it keeps asking for the variables.
        let vars = [
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("PMI_FD", "6"),
        ];
        assert_mentions(&error(&vars), &["-x MASTER_ADDR=HOST"]);
        // One process needs no exchange.
        let (host, port, server) = Master::Pmi
            .resolve(
                &ranks(0, 1, 0, 1),
                Duration::from_millis(1),
                &|_: &str| None,
                &Auth::default(),
            )
            .unwrap();
        assert_eq!(
            (host.as_str(), port, server.is_none()),
            ("127.0.0.1", 0, true)
        );
        assert_eq!(join_host_port("10.0.0.1", 5), "10.0.0.1:5");
        assert_eq!(join_host_port("fe80::1", 5), "[fe80::1]:5");
        assert_eq!(parse_host_port("[fe80::1]:5"), Ok(("fe80::1".into(), 5)));
    }

    #[test]
    fn mpirun_inside_sbatch_uses_mpi() {
        // The batch step's SLURM variables are inherited by every rank mpirun starts.
        let vars = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_JOB_NODELIST", "node[1-2]"),
            ("SLURM_JOB_ID", "99"),
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("MASTER_ADDR", "node1"),
            ("MASTER_PORT", "29500"),
        ];
        let found = detect_in(&vars).unwrap();
        assert_eq!(found.method, Method::OpenMpi);
        assert_eq!(found.ranks, ranks(3, 4, 1, 2));
        assert_eq!(found.master, addr("node1", 29_500));

        // srun --mpi=pmi2 sets PMI variables that agree: SLURM is used (and names the master).
        let mut vars = SRUN_2X2.to_vec();
        vars.extend([("PMI_RANK", "3"), ("PMI_SIZE", "4")]);
        let found = detect_in(&vars).unwrap();
        assert_eq!(found.method, Method::Slurm);
        assert_eq!(found.master, addr("node07", 13_456));
    }

    #[test]
    fn order_of_detection() {
        // torchrun's variables (chorusrun inside an allocation) win over SLURM and MPI.
        let mut vars = SRUN_2X2.to_vec();
        vars.extend([
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1234"),
        ]);
        let found = detect_in(&vars).unwrap();
        assert_eq!(found.method, Method::Torchrun);
        assert_eq!(found.ranks, ranks(1, 2, 1, 2));
        // CHORUS_INIT_METHOD wins over everything.
        vars.push(("CHORUS_INIT_METHOD", "tcp://store:4000"));
        let found = detect_in(&vars).unwrap();
        assert_eq!(found.method, Method::InitTcp);
        assert_eq!(found.ranks, ranks(1, 2, 1, 2));
        assert_eq!(found.master, addr("store", 4000));
        // Open MPI before PMI (Intel MPI under Hydra may set both).
        let found = detect_in(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "1"),
            ("MPI_LOCALRANKID", "0"),
            ("MPI_LOCALNRANKS", "1"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "1"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
        ])
        .unwrap();
        assert_eq!(found.method, Method::OpenMpi);
        assert_eq!(found.master, addr("127.0.0.1", 0));
        // Nothing at all.
        assert_mentions(&error(&[]), &["no launcher found", "CHORUS_INIT_METHOD"]);
    }

    #[test]
    fn init_methods() {
        let torch = [("RANK", "2"), ("WORLD_SIZE", "3")];
        let with = |url: &'static str| {
            let mut vars = torch.to_vec();
            vars.push(("CHORUS_INIT_METHOD", url));
            vars
        };
        let found = detect_in(&with("tcp://[fe80::1]:29500/")).unwrap();
        assert_eq!(found.master, addr("fe80::1", 29_500));
        let found = detect_in(&with("file:///shared/job/rdzv")).unwrap();
        assert_eq!(found.method, Method::InitFile);
        assert_eq!(
            found.master,
            Master::File {
                path: PathBuf::from("/shared/job/rdzv"),
                url: "file:///shared/job/rdzv".into()
            }
        );
        // tcp:// and file:// take the ranks from SLURM or MPI when RANK is absent.
        let mut vars = SRUN_2X2.to_vec();
        vars.push(("CHORUS_INIT_METHOD", "tcp://head:7000"));
        let found = detect_in(&vars).unwrap();
        assert_eq!(
            (found.ranks, found.master),
            (ranks(3, 4, 1, 2), addr("head", 7000))
        );
        let vars = [
            ("CHORUS_INIT_METHOD", "file:///tmp/x"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ];
        assert_eq!(detect_in(&vars).unwrap().ranks, ranks(1, 2, 1, 2));

        let mut vars = with("env://");
        vars.extend([("MASTER_ADDR", "m"), ("MASTER_PORT", "5")]);
        let found = detect_in(&vars).unwrap();
        assert_eq!(
            (found.method, found.master),
            (Method::InitEnv, addr("m", 5))
        );

        for (url, needle) in [
            ("tcp://head", "no port"),
            ("tcp://head:0", "bad port"),
            ("tcp://:80", "empty host"),
            ("file://relative/path", "absolute path"),
            (
                "udp://x:1",
                "expected env://, tcp://HOST:PORT or file:///shared/path",
            ),
        ] {
            assert_mentions(&error(&with(url)), &["CHORUS_INIT_METHOD", needle]);
        }
        assert_mentions(
            &error(&[("CHORUS_INIT_METHOD", "env://")]),
            &["env:// needs RANK and WORLD_SIZE; found no related variables"],
        );
        assert_mentions(
            &error(&[("CHORUS_INIT_METHOD", "tcp://h:1")]),
            &["RANK=\"\"", "says where rank 0 is but not which rank"],
        );
        assert_mentions(
            &error(&[
                ("CHORUS_INIT_METHOD", "env://"),
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
            ]),
            &["MASTER_ADDR"],
        );
    }

    #[test]
    fn torchrun_partial() {
        assert_mentions(
            &error(&[("RANK", "1")]),
            &["WORLD_SIZE=\"\"", "found RANK=1 but WORLD_SIZE is missing"],
        );
        assert_mentions(
            &error(&[
                ("RANK", "1"),
                ("WORLD_SIZE", "4"),
                ("LOCAL_WORLD_SIZE", "8"),
            ]),
            &["LOCAL_WORLD_SIZE=\"8\"", "between 1 and WORLD_SIZE=4"],
        );
    }

    #[test]
    fn host_lists() {
        let expand = |list: &str| hosts(list).map(|h| h.collect::<Vec<_>>());
        let cases: [(&str, &[&str]); 9] = [
            ("node01", &["node01"]),
            (
                "node[01-04,07]",
                &["node01", "node02", "node03", "node04", "node07"],
            ),
            ("a[1-2],b3", &["a1", "a2", "b3"]),
            ("n[8-10]", &["n8", "n9", "n10"]),
            ("n[098-100]", &["n098", "n099", "n100"]),
            ("r[1-2]n[1-2]", &["r1n1", "r1n2", "r2n1", "r2n2"]),
            ("[1-2]x", &["1x", "2x"]),
            (" gpu[3],login ", &["gpu3", "login"]),
            ("a-b[0-1].c,d[5]", &["a-b0.c", "a-b1.c", "d5"]),
        ];
        for (list, want) in cases {
            assert_eq!(expand(list).unwrap(), want, "{list}");
            assert_eq!(first_host(list).unwrap(), want[0], "{list}");
        }
        // The first host of a huge list without expanding it.
        assert_eq!(first_host("n[0000001-9999999]").unwrap(), "n0000001");
        for (list, needle) in [
            ("", "empty host list"),
            ("a,,b", "empty host name"),
            ("a,", "empty host name"),
            ("n[1-", "unclosed"),
            ("n[]", "bad number \"\""),
            ("n[3-1]", "backwards"),
            ("n[1-2]]", "unmatched ']'"),
            ("n[[1]]", "nested"),
            ("n[a-b]", "bad number \"a\""),
            ("n[1-99999999999999999999]", "too large"),
        ] {
            let err = expand(list).unwrap_err();
            assert!(
                err.contains(needle),
                "{list:?}: {err:?} should mention {needle:?}"
            );
        }
    }

    #[test]
    fn tasks_per_node_lists() {
        assert_eq!(tasks_on_node("4", 0), Ok(4));
        assert_eq!(tasks_on_node("2(x3)", 2), Ok(2));
        assert_eq!(tasks_on_node("2(x3),1", 3), Ok(1));
        assert_eq!(
            tasks_on_node("2(x3),1", 4),
            Err("lists only 4 nodes".into())
        );
        assert!(tasks_on_node("2(x3", 0).unwrap_err().contains("unclosed"));
        assert!(tasks_on_node("x", 0)
            .unwrap_err()
            .contains("bad task count"));
        assert!(tasks_on_node("2(xy)", 0)
            .unwrap_err()
            .contains("bad repeat"));
        assert_eq!(slurm_port(0), 10_000);
        assert_eq!(slurm_port(19_999), 29_999);
        assert_eq!(slurm_port(u64::MAX), 10_000 + (u64::MAX % 20_000) as u16);
    }

    /// A fresh path in a scratch directory for one test.
    fn scratch_file(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("chorus-rdzv-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("rendezvous")
    }

    fn file_master(path: &Path) -> Master {
        Master::File {
            path: path.to_path_buf(),
            url: format!("file://{}", path.display()),
        }
    }

    #[test]
    fn file_protocol() {
        let path = scratch_file("ok");
        let master = file_master(&path);
        let auth = Auth::default();
        let env = |k: &str| (k == "TORCHELASTIC_RUN_ID").then(|| "job7".to_string());
        // Rank 1 starts waiting first; rank 0 binds its store, then publishes its port; rank 1
        // reads what rank 0 wrote.
        let reader = {
            let master = master.clone();
            std::thread::spawn(move || {
                let auth = Auth::default();
                master.resolve(&ranks(1, 2, 1, 2), Duration::from_secs(20), &env, &auth)
            })
        };
        let (host, port, server) = master
            .resolve(&ranks(0, 2, 0, 2), Duration::from_secs(20), &env, &auth)
            .unwrap();
        assert_eq!(host, "127.0.0.1");
        assert_eq!(server.expect("rank 0's store").local_addr().port(), port);
        let (read_host, read_port, none) = reader.join().unwrap().unwrap();
        assert_eq!((read_host.as_str(), read_port), ("127.0.0.1", port));
        assert!(none.is_none());
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            format!("chorus-rendezvous-v1 run=job7/0 addr=127.0.0.1 port={port}\n")
        );
        // No temporary file left beside it.
        assert_eq!(
            std::fs::read_dir(path.parent().unwrap()).unwrap().count(),
            1
        );

        // Rank 0 of a multi-node job publishes CHORUS_SOCKET_ADDR.
        let get = |k: &str| (k == "CHORUS_SOCKET_ADDR").then(|| "10.9.8.7".to_string());
        let (host, port, server) = master
            .resolve(&ranks(0, 4, 0, 2), Duration::from_secs(1), &get, &auth)
            .unwrap();
        assert_eq!(host, "10.9.8.7");
        assert_eq!(server.expect("rank 0's store").local_addr().port(), port);

        // A MASTER_PORT in use is rank 0's error, unless torchrun's agent serves its store
        // there: then that is the store, and rank 0 publishes it without binding anything.
        let agent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let busy = agent.local_addr().unwrap().port().to_string();
        let given = |k: &str| (k == "MASTER_PORT").then(|| busy.clone());
        let err = master
            .resolve(&ranks(0, 2, 0, 2), Duration::from_secs(1), &given, &auth)
            .unwrap_err()
            .to_string();
        assert_mentions(&err, &[&busy, "rendezvous store"]);
        let torchrun = |k: &str| match k {
            "MASTER_PORT" => Some(busy.clone()),
            "MASTER_ADDR" => Some("127.0.0.1".to_string()),
            "TORCHELASTIC_USE_AGENT_STORE" => Some("True".to_string()),
            _ => None,
        };
        let (host, port, server) = master
            .resolve(&ranks(0, 2, 0, 2), Duration::from_secs(1), &torchrun, &auth)
            .unwrap();
        assert_eq!(
            (host.as_str(), port.to_string()),
            ("127.0.0.1", busy.clone())
        );
        assert!(server.is_none());
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn file_protocol_errors() {
        let path = scratch_file("errors");
        let master = file_master(&path);
        let none = |_: &str| None;
        let auth = Auth::default();
        let wait = |get: &dyn Fn(&str) -> Option<String>| {
            master
                .resolve(&ranks(2, 3, 2, 3), Duration::from_millis(100), get, &auth)
                .unwrap_err()
                .to_string()
        };
        assert_mentions(
            &wait(&none),
            &[
                "CHORUS_INIT_METHOD",
                "rank 2 of 3",
                "did not publish",
                "it does not exist",
            ],
        );
        // A file from another run (an earlier restart) is not taken for this one's.
        std::fs::write(
            &path,
            "chorus-rendezvous-v1 run=job7/0 addr=10.0.0.1 port=5\n",
        )
        .unwrap();
        let restarted = |k: &str| match k {
            "TORCHELASTIC_RUN_ID" => Some("job7".to_string()),
            "TORCHELASTIC_RESTART_COUNT" => Some("1".to_string()),
            _ => None,
        };
        assert_mentions(
            &wait(&restarted),
            &["holds an address for run \"job7/0\", not \"job7/1\""],
        );
        std::fs::write(&path, "garbage").unwrap();
        assert_mentions(&wait(&none), &["not a Chorus rendezvous line"]);
        // Rank 0 cannot write into a missing directory.
        let bad_dir = file_master(&path.join("missing/dir/file"));
        let err = bad_dir
            .resolve(&ranks(0, 2, 0, 2), Duration::from_millis(100), &none, &auth)
            .unwrap_err()
            .to_string();
        assert_mentions(&err, &["rank 0 cannot write"]);
        // One process needs no file at all.
        let single = file_master(Path::new("/nonexistent/never"));
        assert_eq!(
            single
                .resolve(&ranks(0, 1, 0, 1), Duration::from_millis(1), &none, &auth)
                .map(|(host, port, server)| (host, port, server.is_none()))
                .unwrap(),
            ("127.0.0.1".to_string(), 0, true)
        );
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn run_tokens() {
        let token = |vars: &[(&str, &str)]| {
            let map: HashMap<&str, &str> = vars.iter().copied().collect();
            run_token(&|k: &str| map.get(k).map(|v| v.to_string()))
        };
        assert_eq!(token(&[]), "-");
        assert_eq!(token(&[("TORCHELASTIC_RUN_ID", "a b")]), "a_b/0");
        assert_eq!(
            token(&[("SLURM_JOB_ID", "12"), ("SLURM_STEP_ID", "3")]),
            "slurm-12.3"
        );
        assert_eq!(token(&[("PMIX_NAMESPACE", "ns1")]), "ns1");
    }
}
