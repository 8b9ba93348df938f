//! Carrying a rendezvous out: rank 0's store bound and its address published (a shared
//! file, MPICH's PMI), or read by the other ranks; and which store the ranks meet through.

use std::net::SocketAddr;
use std::time::Duration;

use chorus_transport::auth::Auth;
use chorus_transport::store::StoreServer;

use crate::env::{self, bad, optional, Lookup};
use chorus_transport::store::pmi;

use crate::Error;

use super::detect::{parse_host_port, pmi_error, value};
use super::file::{publish, wait_for_file};
use super::{Master, Ranks, StoreKind, DEFAULT_MASTER_ADDR};

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
    use crate::rendezvous::{assert_mentions, ranks};
    use std::collections::HashMap;
    use std::path::{Path, PathBuf};
    use std::time::Duration;

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
    fn one_process_publishes_nothing() {
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
