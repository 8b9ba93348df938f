//! Which launcher started this process, read from its variables alone (see the
//! [parent module](super) for the order).

use std::path::PathBuf;

use crate::env::{self, bad, optional, Lookup};
use chorus_transport::store::pmi;

use crate::Error;

use super::slurm::{first_host, slurm_port, tasks_on_node};
use super::{Found, Master, Method, Ranks, DEFAULT_MASTER_ADDR};

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
const SLURM_VARS: [&str; 16] = [
    env::SLURM_PROCID,
    env::SLURM_NTASKS,
    env::SLURM_NPROCS,
    env::SLURM_LOCALID,
    env::SLURM_NODEID,
    env::SLURM_STEP_TASKS_PER_NODE,
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
pub(crate) fn detect(get: Lookup<'_>) -> Result<Found, Error> {
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
    Ok(Found {
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
pub(super) fn pmi_error(get: Lookup<'_>, reason: &str) -> Error {
    let (var, value) = pmi::server(get).unwrap_or((env::PMI_FD, String::new()));
    bad(
        var,
        &value,
        &format!("MPICH hydra's PMI rendezvous failed: {reason}"),
    )
}

/// `CHORUS_INIT_METHOD`: `env://`, `tcp://HOST:PORT` or `file:///PATH`.
fn init_method(url: &str, get: Lookup<'_>) -> Result<Found, Error> {
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
        return Ok(Found {
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
    Ok(Found {
        method,
        ranks,
        master: master_of,
    })
}

/// `HOST:PORT` or `[V6]:PORT`.
pub(super) fn parse_host_port(s: &str) -> Result<(String, u16), String> {
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
    // The step's own layout first: a step smaller than its job (`srun -n 2` in an
    // `sbatch --ntasks-per-node=4` job) keeps the job's SLURM_NTASKS_PER_NODE.
    let at_node = |var: &'static str| -> Result<Option<usize>, Error> {
        let Some(list) = value(get, var) else {
            return Ok(None);
        };
        let node = need(env::SLURM_NODEID)?;
        tasks_on_node(&list, node)
            .map(Some)
            .map_err(|reason| bad(var, &list, &format!("{reason} (SLURM_NODEID={node})")))
    };
    let (local_world_size, local_var) = if let Some(n) = at_node(env::SLURM_STEP_TASKS_PER_NODE)? {
        (n, env::SLURM_STEP_TASKS_PER_NODE)
    } else if let Some(n) = optional(get, env::SLURM_NTASKS_PER_NODE)? {
        (n, env::SLURM_NTASKS_PER_NODE)
    } else if let Some(n) = at_node(env::SLURM_TASKS_PER_NODE)? {
        (n, env::SLURM_TASKS_PER_NODE)
    } else {
        return Err(bad(
            env::SLURM_TASKS_PER_NODE,
            "",
            &format!(
                "found {} but none of SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE and \
                 SLURM_TASKS_PER_NODE is set ({method})",
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
pub(super) fn value(get: Lookup<'_>, var: &str) -> Option<String> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::{assert_mentions, ranks};
    use std::collections::HashMap;

    fn detect_in(vars: &[(&str, &str)]) -> Result<Found, Error> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        detect(&|k: &str| map.get(k).cloned())
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

        // The step's layout wins over the job's --ntasks-per-node (as real srun sets them for
        // `srun -n 2` in an `sbatch --ntasks-per-node=4` job).
        let vars = [
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "0"),
            ("SLURM_NTASKS_PER_NODE", "4"),
            ("SLURM_STEP_TASKS_PER_NODE", "2"),
            ("SLURM_TASKS_PER_NODE", "2"),
            ("SLURM_JOB_NODELIST", "localhost"),
            ("SLURM_JOB_ID", "5"),
        ];
        assert_eq!(detect_in(&vars).unwrap().ranks, ranks(1, 2, 1, 2));

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
            &["none of SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE and SLURM_TASKS_PER_NODE is set"],
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
}
