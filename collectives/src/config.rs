//! Configuration: one typed `Config`, read from the environment or built in code.

use std::net::IpAddr;
use std::time::Duration;

use chorus_transport::auth::Auth;
use chorus_transport::shm::SingleCopy;
use chorus_transport::TransportKind;

use crate::env::{bad, optional, Lookup};
use crate::rendezvous::{self, Master, Method, Ranks};
pub use crate::rendezvous::{Rendezvous, StoreKind, DEFAULT_MASTER_ADDR};
use crate::streaming::Streaming;
use crate::tuner::Forced;
use crate::{env, Error};

/// Everything a communicator needs to know before it starts.
#[derive(Debug, Clone)]
pub struct Config {
    /// This process's rank, `0..world_size` (`RANK`).
    pub rank: usize,
    /// Number of processes in the job (`WORLD_SIZE`).
    pub world_size: usize,
    /// Rank within this host (`LOCAL_RANK`).
    pub local_rank: usize,
    /// Number of processes on this host (`LOCAL_WORLD_SIZE`).
    pub local_world_size: usize,
    /// Host of rank 0's rendezvous store (`MASTER_ADDR`); for a published rendezvous, filled
    /// in when the communicator is made.
    pub master_addr: String,
    /// Port of the rendezvous store (`MASTER_PORT`); as `master_addr`.
    pub master_port: u16,
    /// How the ranks meet: at `master_addr` and `master_port`, or through an address rank 0
    /// publishes when the communicator is made (`CHORUS_INIT_METHOD=file://`, MPICH's PMI).
    pub rendezvous: Rendezvous,
    /// Bound on every blocking wait (`CHORUS_TIMEOUT`, seconds).
    pub timeout: Duration,
    /// TCP sockets per peer (`CHORUS_NSOCKS`).
    pub nsocks: usize,
    /// Algorithms forced per collective; the tuner picks the rest (`CHORUS_ALGO`).
    pub algo: Forced,
    /// Per-message latency the tuner assumes, in seconds (`CHORUS_ALPHA_US`, microseconds);
    /// the transport's own figure if unset.
    pub alpha: Option<f64>,
    /// Link bandwidth the tuner assumes, in bytes/s (`CHORUS_BANDWIDTH_GBS`, GB/s); the
    /// transport's own figure if unset.
    pub beta: Option<f64>,
    /// Pipeline chunk size in bytes (`CHORUS_CHUNK_BYTES`).
    pub chunk_bytes: usize,
    /// Address peers use to reach this rank (`CHORUS_SOCKET_ADDR`); derived from the route to MASTER_ADDR if unset.
    pub socket_addr: Option<IpAddr>,
    /// Shared memory within a host and TCP across, or one of them only (`CHORUS_TRANSPORT`).
    pub transport: TransportKind,
    /// This rank's host identity: ranks with equal ones use shared memory (`CHORUS_HOST_ID`);
    /// hostname, boot id and namespaces if unset.
    pub host_id: Option<String>,
    /// Which sends shared memory moves in one copy, read straight from the sender's memory
    /// (`CHORUS_SHM_SINGLE_COPY`): by default, those from caller buffers on huge pages.
    pub shm_single_copy: SingleCopy,
    /// Which calls write their outputs with streaming stores (`CHORUS_STREAMING_STORES`): by
    /// default, those whose buffers over the host fill half its last-level cache.
    pub streaming: Streaming,
    /// Fraction of `timeout` after which a waiting collective reports which ranks hold it
    /// up (`CHORUS_WATCHDOG`; 0 turns the report off).
    pub watchdog: f64,
    /// The job's id and shared secret, proven on every connection (`CHORUS_JOB_ID`, else
    /// `TORCHELASTIC_RUN_ID` or `SLURM_JOB_ID`; `CHORUS_AUTH_TOKEN`).
    pub auth: Auth,
    /// The rendezvous store ranks meet through: torchrun's agent store when
    /// `TORCHELASTIC_USE_AGENT_STORE` is `True`, else Chorus's own.
    pub store: StoreKind,
}

/// Defaults shared by `Config::new` and `Config::from_env`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Default TCP sockets per peer (striping gained nothing on loopback; raise it on fast NICs).
pub const DEFAULT_NSOCKS: usize = 1;
/// Default pipeline chunk in bytes.
pub const DEFAULT_CHUNK_BYTES: usize = 512 << 10;
/// Default fraction of the timeout after which the watchdog reports a stalled collective.
pub const DEFAULT_WATCHDOG: f64 = 0.5;
/// Largest world size read from the environment: rendezvous and transports keep state per
/// rank, so a typo such as `WORLD_SIZE=1000000000` must fail before anything is allocated.
pub const MAX_WORLD_SIZE: usize = 1 << 20;
/// Longest `CHORUS_TIMEOUT` (a year): longer ones cannot be added to the clock.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);
/// Largest `CHORUS_CHUNK_BYTES` (1 GiB).
pub const MAX_CHUNK_BYTES: usize = 1 << 30;

impl Config {
    /// A configuration for `rank` of `world_size` on one host, with defaults.
    pub fn new(
        rank: usize,
        world_size: usize,
        master_addr: impl Into<String>,
        master_port: u16,
    ) -> Config {
        Config {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            master_addr: master_addr.into(),
            master_port,
            timeout: DEFAULT_TIMEOUT,
            nsocks: DEFAULT_NSOCKS,
            algo: Forced::none(),
            alpha: None,
            beta: None,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            socket_addr: None,
            transport: TransportKind::Auto,
            host_id: None,
            shm_single_copy: SingleCopy::default(),
            streaming: Streaming::default(),
            watchdog: DEFAULT_WATCHDOG,
            auth: Auth::default(),
            store: StoreKind::Chorus,
            rendezvous: Rendezvous::default(),
        }
    }

    /// Reads the job's shape from the launcher's variables, and the `CHORUS_*` variables.
    ///
    /// The launcher is detected in this order, and the one used is logged (`tracing` info):
    /// `CHORUS_INIT_METHOD` (`env://`, `tcp://HOST:PORT`, `file:///shared/path`), torchrun's
    /// contract (`RANK`, `WORLD_SIZE`, ..., as chorusrun sets it), SLURM (`srun`), Open MPI,
    /// MPICH/Intel MPI (PMI) and MVAPICH2; see `docs/launching.md`.
    ///
    /// It only reads variables. Where rank 0 publishes its store's address
    /// (`CHORUS_INIT_METHOD=file://...`, MPICH's PMI), [`rendezvous`](Config::rendezvous)
    /// says so, and [`Communicator::new`](crate::Communicator::new) carries it out: rank 0
    /// binds its store (on `MASTER_PORT`, else on any free port) before it publishes the port,
    /// and the others read it.
    ///
    /// Fails naming the variable when one is missing, malformed or contradicts another (listing
    /// the related variables found), or when RANK is not below WORLD_SIZE.
    pub fn from_env() -> Result<Config, Error> {
        Config::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like `from_env`, reading variables through `get` (for tests and launchers).
    ///
    /// Reads variables and nothing else: a `file://` or PMI rendezvous is carried out (the
    /// file written or read, the store bound) when the communicator is made.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, Error> {
        let get: Lookup<'_> = &get;
        let tuned = Config::new(0, 1, DEFAULT_MASTER_ADDR, 0).tuned_from(get)?;
        let found = rendezvous::detect(get)?;
        if found.ranks.world_size > MAX_WORLD_SIZE {
            return Err(bad(
                size_var(found.method),
                &found.ranks.world_size.to_string(),
                &format!(
                    "must be at most {MAX_WORLD_SIZE} (read through {})",
                    found.method
                ),
            ));
        }
        let auth = job_auth(get)?;
        // A published address is filled in when the communicator carries the rendezvous out.
        let (master_addr, master_port) = match &found.master {
            Master::Addr(addr, port) => (addr.clone(), *port),
            Master::File { .. } | Master::Pmi => (DEFAULT_MASTER_ADDR.to_string(), 0),
        };
        let store = rendezvous::store_kind(get, &master_addr, master_port);
        let Ranks {
            rank,
            world_size,
            local_rank,
            local_world_size,
        } = found.ranks;
        tracing::info!(
            rank,
            world_size,
            local_rank,
            local_world_size,
            master = %match &found.master {
                Master::Addr(..) => format!("{master_addr}:{master_port}"),
                Master::File { .. } | Master::Pmi => "published by rank 0".to_string(),
            },
            ?store,
            "rendezvous through {}",
            found.method
        );
        Ok(Config {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            auth,
            store,
            rendezvous: Rendezvous::new(found.master, get),
            ..tuned
        })
    }

    /// How long a peer whose host answers nothing (a pulled link, a frozen machine) may stay
    /// silent before it is taken for gone: the watchdog's time (`timeout * watchdog`), or the
    /// whole timeout with the watchdog off.
    pub fn dead_after(&self) -> Duration {
        if self.watchdog > 0.0 {
            self.timeout.mul_f64(self.watchdog)
        } else {
            self.timeout
        }
    }

    /// `self` with the `CHORUS_*` tuning variables read through `get` applied: the timeout,
    /// sockets per peer, chunk size, forced algorithms, the tuner's link figures, the
    /// advertised address, the transport, the host identity, single copy and the watchdog.
    /// The job's shape, rendezvous and identity stay as they are: for a program that learns
    /// those elsewhere (a framework's binding) and takes only the tuning from the environment.
    /// Reads variables only.
    ///
    /// Fails naming the variable when one is malformed or out of range.
    pub fn tuned_from(self, get: impl Fn(&str) -> Option<String>) -> Result<Config, Error> {
        let get: Lookup<'_> = &get;
        let timeout = match optional::<f64>(get, env::CHORUS_TIMEOUT)? {
            Some(s) if s > 0.0 && s <= MAX_TIMEOUT.as_secs_f64() => Duration::from_secs_f64(s),
            Some(s) => {
                return Err(bad(
                    env::CHORUS_TIMEOUT,
                    &s.to_string(),
                    &format!(
                        "must be a positive number of seconds, at most {} (a year)",
                        MAX_TIMEOUT.as_secs()
                    ),
                ))
            }
            None => self.timeout,
        };
        let nsocks = optional(get, env::CHORUS_NSOCKS)?.unwrap_or(self.nsocks);
        if !(1..=64).contains(&nsocks) {
            return Err(bad(
                env::CHORUS_NSOCKS,
                &nsocks.to_string(),
                "must be between 1 and 64",
            ));
        }
        let chunk_bytes = optional(get, env::CHORUS_CHUNK_BYTES)?.unwrap_or(self.chunk_bytes);
        if !(64..=MAX_CHUNK_BYTES).contains(&chunk_bytes) {
            return Err(bad(
                env::CHORUS_CHUNK_BYTES,
                &chunk_bytes.to_string(),
                &format!("must be between 64 and {MAX_CHUNK_BYTES}"),
            ));
        }
        let watchdog = match optional::<f64>(get, env::CHORUS_WATCHDOG)? {
            Some(f) if (0.0..1.0).contains(&f) => f,
            Some(f) => {
                return Err(bad(
                    env::CHORUS_WATCHDOG,
                    &f.to_string(),
                    "must be a fraction of CHORUS_TIMEOUT, at least 0 and below 1",
                ))
            }
            None => self.watchdog,
        };
        Ok(Config {
            timeout,
            nsocks,
            chunk_bytes,
            algo: optional(get, env::CHORUS_ALGO)?.unwrap_or(self.algo),
            alpha: positive(get, env::CHORUS_ALPHA_US)?
                .map(|us| us * 1e-6)
                .or(self.alpha),
            beta: positive(get, env::CHORUS_BANDWIDTH_GBS)?
                .map(|gbs| gbs * 1e9)
                .or(self.beta),
            socket_addr: optional(get, env::CHORUS_SOCKET_ADDR)?.or(self.socket_addr),
            transport: optional(get, env::CHORUS_TRANSPORT)?.unwrap_or(self.transport),
            host_id: get(env::CHORUS_HOST_ID)
                .filter(|h| !h.trim().is_empty())
                .or(self.host_id),
            shm_single_copy: optional(get, env::CHORUS_SHM_SINGLE_COPY)?
                .unwrap_or(self.shm_single_copy),
            streaming: optional(get, env::CHORUS_STREAMING_STORES)?.unwrap_or(self.streaming),
            watchdog,
            ..self
        })
    }
}

/// The variable that gives the world size under `method`, for messages.
fn size_var(method: Method) -> &'static str {
    match method {
        Method::Slurm => env::SLURM_NTASKS,
        Method::OpenMpi => env::OMPI_COMM_WORLD_SIZE,
        Method::Pmi => env::PMI_SIZE,
        Method::Mvapich2 => env::MV2_COMM_WORLD_SIZE,
        Method::InitEnv | Method::InitTcp | Method::InitFile | Method::Torchrun => env::WORLD_SIZE,
    }
}

/// The job's identity from the environment; every rank of a job reads the same values.
fn job_auth(get: Lookup<'_>) -> Result<Auth, Error> {
    let (var, job_id) = [
        env::CHORUS_JOB_ID,
        env::TORCHELASTIC_RUN_ID,
        env::SLURM_JOB_ID,
    ]
    .into_iter()
    .find_map(|var| get(var).filter(|v| !v.is_empty()).map(|v| (var, v)))
    .unwrap_or((env::CHORUS_JOB_ID, String::new()));
    let token = get(env::CHORUS_AUTH_TOKEN).unwrap_or_default();
    Auth::new(job_id.clone(), token).map_err(|reason| bad(var, &job_id, &reason.to_string()))
}

/// This machine's name (it decides which ranks share a host).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map_or_else(|_| "localhost".into(), |h| h.trim().to_string())
}

/// An optional positive, finite number.
fn positive(get: Lookup<'_>, var: &'static str) -> Result<Option<f64>, Error> {
    match optional::<f64>(get, var)? {
        Some(v) if v > 0.0 && v.is_finite() => Ok(Some(v)),
        Some(v) => Err(bad(var, &v.to_string(), "must be a positive number")),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(vars: &[(&str, &str)]) -> Result<Config, Error> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    const BASE: [(&str, &str); 4] = [
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn reads_the_torchrun_contract() {
        let c = from(&BASE).unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (1, 4, 1, 4)
        );
        assert_eq!((c.master_addr.as_str(), c.master_port), ("10.0.0.1", 29500));
        assert_eq!(c.timeout, DEFAULT_TIMEOUT);
        let mut vars = BASE.to_vec();
        vars.extend([
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("CHORUS_TIMEOUT", "2.5"),
            ("CHORUS_ALGO", "tree"),
        ]);
        let c = from(&vars).unwrap();
        assert_eq!((c.local_rank, c.local_world_size), (0, 2));
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(c.algo, "tree".parse::<Forced>().unwrap());
        assert_eq!((c.transport, c.host_id), (TransportKind::Auto, None));
        vars.extend([
            ("CHORUS_TRANSPORT", "tcp"),
            ("CHORUS_HOST_ID", "rack1-node7"),
        ]);
        let c = from(&vars).unwrap();
        assert_eq!(c.transport, TransportKind::Tcp);
        assert_eq!(c.host_id.as_deref(), Some("rack1-node7"));
    }

    #[test]
    fn errors_name_the_variable() {
        let cases: [(&[(&str, &str)], &str); 6] = [
            (&[("WORLD_SIZE", "4")], "RANK"),
            (&[("RANK", "x"), ("WORLD_SIZE", "4")], "RANK=\"x\""),
            (&[("RANK", "4"), ("WORLD_SIZE", "4")], "below WORLD_SIZE=4"),
            (&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE"),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")],
                "MASTER_ADDR",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "99999"),
                ],
                "MASTER_PORT",
            ),
        ];
        for (vars, needle) in cases {
            let err = from(vars).unwrap_err().to_string();
            assert!(err.contains(needle), "{err} should mention {needle}");
        }
        let mut vars = BASE.to_vec();
        vars.push(("CHORUS_ALGO", "spiral"));
        assert!(from(&vars).unwrap_err().to_string().contains("CHORUS_ALGO"));
        let mut vars = BASE.to_vec();
        vars.push(("CHORUS_TRANSPORT", "carrier-pigeon"));
        let err = from(&vars).unwrap_err().to_string();
        assert!(
            err.contains("CHORUS_TRANSPORT") && err.contains("auto, tcp or shm"),
            "{err}"
        );
    }

    #[test]
    fn values_at_the_edges_are_refused_naming_the_limit() {
        let cases = [
            ("CHORUS_TIMEOUT", "1e300", "at most 31536000"),
            ("CHORUS_TIMEOUT", "1.8e19", "at most 31536000"),
            ("CHORUS_TIMEOUT", "inf", "at most 31536000"),
            (
                "CHORUS_CHUNK_BYTES",
                "18446744073709551615",
                "between 64 and 1073741824",
            ),
            (
                "CHORUS_CHUNK_BYTES",
                "1073741825",
                "between 64 and 1073741824",
            ),
            ("WORLD_SIZE", "1000000000", "at most 1048576"),
            ("WORLD_SIZE", "4294967296", "at most 1048576"),
        ];
        for (var, value, needle) in cases {
            let mut vars = BASE.to_vec();
            vars.retain(|(k, _)| *k != var);
            vars.push((var, value));
            let err = from(&vars).unwrap_err().to_string();
            assert!(
                err.contains(var) && err.contains(needle),
                "{var}={value}: {err}"
            );
        }
        let mut vars = BASE.to_vec();
        vars.extend([
            ("CHORUS_TIMEOUT", "31536000"),
            ("CHORUS_CHUNK_BYTES", "1073741824"),
        ]);
        let c = from(&vars).unwrap();
        assert_eq!((c.timeout, c.chunk_bytes), (MAX_TIMEOUT, MAX_CHUNK_BYTES));
        let slurm = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2000000"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_TASKS_PER_NODE", "1"),
            ("SLURM_JOB_NODELIST", "n1"),
            ("SLURM_JOB_ID", "7"),
        ];
        let err = from(&slurm).unwrap_err().to_string();
        assert!(
            err.contains("SLURM_NTASKS") && err.contains("1048576"),
            "{err}"
        );
    }

    #[test]
    fn torchruns_agent_store_is_used_where_torchrun_serves_it() {
        let mut vars = BASE.to_vec();
        assert_eq!(from(&vars).unwrap().store, StoreKind::Chorus);
        vars.extend([
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RUN_ID", "job7"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ]);
        let run = "job7/2".to_string();
        assert_eq!(from(&vars).unwrap().store, StoreKind::TorchAgent { run });
        // Not announced, or a store elsewhere than the agent's: Chorus's own.
        for extra in [
            ("TORCHELASTIC_USE_AGENT_STORE", "False"),
            ("CHORUS_INIT_METHOD", "tcp://10.0.0.2:29501"),
        ] {
            let mut vars = vars.clone();
            vars.push(extra);
            assert_eq!(from(&vars).unwrap().store, StoreKind::Chorus, "{extra:?}");
        }
    }

    #[test]
    fn tuning_alone_keeps_the_shape_and_reads_no_launcher() {
        let tuning: HashMap<&str, &str> = [
            ("CHORUS_TIMEOUT", "7"),
            ("CHORUS_NSOCKS", "3"),
            ("CHORUS_TRANSPORT", "tcp"),
            // A launcher's variables and a rendezvous are not read.
            ("RANK", "5"),
            ("CHORUS_INIT_METHOD", "file:///nonexistent/dir/rdzv"),
        ]
        .into_iter()
        .collect();
        let get = |k: &str| tuning.get(k).map(|v| v.to_string());
        let c = Config::new(2, 4, "head", 1234).tuned_from(get).unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.master_addr.as_str(), c.master_port),
            (2, 4, "head", 1234)
        );
        assert_eq!(
            (c.timeout, c.nsocks, c.transport),
            (Duration::from_secs(7), 3, TransportKind::Tcp)
        );
        assert_eq!(c.chunk_bytes, DEFAULT_CHUNK_BYTES);
        // Unset variables keep what the configuration had.
        let mut before = Config::new(0, 2, "head", 1);
        before.timeout = Duration::from_secs(9);
        assert_eq!(
            before.tuned_from(|_| None).unwrap().timeout,
            Duration::from_secs(9)
        );
        let err = Config::new(0, 2, "head", 1)
            .tuned_from(|k| (k == "CHORUS_NSOCKS").then(|| "0".to_string()))
            .unwrap_err();
        assert!(
            matches!(&err, Error::Config { var: "CHORUS_NSOCKS", value, .. } if value == "0"),
            "{err:?}"
        );
    }

    #[test]
    fn a_single_process_needs_no_master() {
        let c = from(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap();
        assert_eq!(c.world_size, 1);
    }

    #[test]
    fn reads_slurm_and_mpi_too() {
        let c = from(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_TASKS_PER_NODE", "2(x4)"),
            ("SLURM_JOB_NODELIST", "gpu[08-11]"),
            ("SLURM_JOB_ID", "31337"),
            ("CHORUS_TIMEOUT", "7"),
        ])
        .unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (5, 8, 1, 2)
        );
        assert_eq!((c.master_addr.as_str(), c.master_port), ("gpu08", 21_337));
        assert_eq!(c.timeout, Duration::from_secs(7));
        let err = from(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("but MPI_LOCALRANKID is missing"), "{err}");
    }

    #[test]
    fn reading_a_published_rendezvous_writes_nothing() {
        let dir = std::env::temp_dir().join(format!("chorus-config-file-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rdzv");
        let url = format!("file://{}", path.display());
        let vars = [
            ("CHORUS_INIT_METHOD", url.as_str()),
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("CHORUS_NSOCKS", "0"),
        ];
        assert!(matches!(
            from(&vars).unwrap_err(),
            Error::Config {
                var: "CHORUS_NSOCKS",
                ..
            }
        ));
        let c = from(&vars[..3]).unwrap();
        assert!(c.rendezvous.is_published());
        assert!(!path.exists(), "reading the configuration wrote the file");
        // A clone carries no live store: the communicator binds and publishes it.
        let _ = c.clone();
        assert!(!from(&BASE).unwrap().rendezvous.is_published());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
