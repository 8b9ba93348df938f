//! The names of the environment variables Chorus reads or sets, and the launchers' default
//! address of rank 0: what the library (`chorus::env`) and the launcher (`chorus-launch`)
//! share, in a crate of its own so that starting processes needs no communicator.
//!
//! Each constant is named for its variable and holds the variable's name, so code reads
//! `std::env::var(env::CHORUS_TIMEOUT)` and a search for the name finds every use. The
//! defaults live beside the code that applies them; the table of environment variables in
//! `docs/environment.md` lists every name here (and the GPU kernels' own, in
//! `chorus_kernels::env`), with its meaning and default.

/// Default of `MASTER_ADDR` where it may be left out (a job of one rank) and the launchers'
/// default address of rank 0.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";

/// The prefix of Chorus's own variables (the torch backend and the perf tools' `-J` file
/// take every variable that starts with it).
pub const CHORUS_PREFIX: &str = "CHORUS_";

/// Which path the device collectives take: `auto` (default), `ipc`, `staged` or
/// `hierarchical` (feature `cuda`; module `chorus::cuda`).
pub const CHORUS_CUDA_PATH: &str = "CHORUS_CUDA_PATH";

// torchrun's contract (set by chorusrun, torchrun, or by hand).

/// Global rank of the process, `0..WORLD_SIZE`.
pub const RANK: &str = "RANK";
/// Number of processes in the job.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Rank of the process among those on its node.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Number of processes on the process's node.
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Rank of the process's node, `0..GROUP_WORLD_SIZE` (set by the launchers; not read).
pub const GROUP_RANK: &str = "GROUP_RANK";
/// Number of nodes in the job (set by the launchers; not read).
pub const GROUP_WORLD_SIZE: &str = "GROUP_WORLD_SIZE";
/// Host of rank 0's rendezvous store.
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// TCP port of rank 0's rendezvous store.
pub const MASTER_PORT: &str = "MASTER_PORT";
/// How many times the node's workers have been restarted (0 at first).
pub const TORCHELASTIC_RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";
/// How many restarts the launcher allows (set by the launchers; not read).
pub const TORCHELASTIC_MAX_RESTARTS: &str = "TORCHELASTIC_MAX_RESTARTS";
/// The job's run id.
pub const TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
/// `True` when torchrun's agent serves torch's TCPStore at `MASTER_ADDR:MASTER_PORT` for its
/// workers (set by torchrun only).
pub const TORCHELASTIC_USE_AGENT_STORE: &str = "TORCHELASTIC_USE_AGENT_STORE";
/// Where a failing worker records its error for torchrun's summary (set by torchrun only; see
/// `chorus::torchrun::write_error_file`).
pub const TORCHELASTIC_ERROR_FILE: &str = "TORCHELASTIC_ERROR_FILE";
/// Threads of OpenMP and of torch's CPU kernels; chorusrun sets it to 1 when it is unset, as
/// torchrun does.
pub const OMP_NUM_THREADS: &str = "OMP_NUM_THREADS";
/// The GPUs CUDA lets a process see (comma list); chorusrun sets each worker's share, and
/// reads its own to know the node's GPUs.
pub const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";

// SLURM (`srun`).

/// The task's global rank.
pub const SLURM_PROCID: &str = "SLURM_PROCID";
/// Number of tasks in the step.
pub const SLURM_NTASKS: &str = "SLURM_NTASKS";
/// Older name of [`SLURM_NTASKS`].
pub const SLURM_NPROCS: &str = "SLURM_NPROCS";
/// The task's rank on its node.
pub const SLURM_LOCALID: &str = "SLURM_LOCALID";
/// The node's index in the step.
pub const SLURM_NODEID: &str = "SLURM_NODEID";
/// Tasks per node of the step, as a list like [`SLURM_TASKS_PER_NODE`]; read first.
pub const SLURM_STEP_TASKS_PER_NODE: &str = "SLURM_STEP_TASKS_PER_NODE";
/// Tasks on every node (`--ntasks-per-node`; the job's, also in a smaller step).
pub const SLURM_NTASKS_PER_NODE: &str = "SLURM_NTASKS_PER_NODE";
/// Tasks per node as a list, `2(x3),1`.
pub const SLURM_TASKS_PER_NODE: &str = "SLURM_TASKS_PER_NODE";
/// The step's nodes (a host list); the first one hosts the store.
pub const SLURM_STEP_NODELIST: &str = "SLURM_STEP_NODELIST";
/// The job's nodes, read when [`SLURM_STEP_NODELIST`] is unset.
pub const SLURM_JOB_NODELIST: &str = "SLURM_JOB_NODELIST";
/// Older name of [`SLURM_JOB_NODELIST`].
pub const SLURM_NODELIST: &str = "SLURM_NODELIST";
/// The job's id: the store port is `10000 + SLURM_JOB_ID % 20000`.
pub const SLURM_JOB_ID: &str = "SLURM_JOB_ID";
/// Older name of [`SLURM_JOB_ID`].
pub const SLURM_JOBID: &str = "SLURM_JOBID";
/// The step's id (names the run of a `file://` rendezvous).
pub const SLURM_STEP_ID: &str = "SLURM_STEP_ID";
/// Older name of [`SLURM_STEP_ID`].
pub const SLURM_STEPID: &str = "SLURM_STEPID";

// MPI launchers.

/// Open MPI: the process's rank.
pub const OMPI_COMM_WORLD_RANK: &str = "OMPI_COMM_WORLD_RANK";
/// Open MPI: the number of processes.
pub const OMPI_COMM_WORLD_SIZE: &str = "OMPI_COMM_WORLD_SIZE";
/// Open MPI: the rank on the node.
pub const OMPI_COMM_WORLD_LOCAL_RANK: &str = "OMPI_COMM_WORLD_LOCAL_RANK";
/// Open MPI: the processes on the node.
pub const OMPI_COMM_WORLD_LOCAL_SIZE: &str = "OMPI_COMM_WORLD_LOCAL_SIZE";
/// MPICH / Intel MPI (Hydra's PMI): the process's rank.
pub const PMI_RANK: &str = "PMI_RANK";
/// MPICH / Intel MPI: the number of processes.
pub const PMI_SIZE: &str = "PMI_SIZE";
/// MPICH / Intel MPI: the rank on the node.
pub const MPI_LOCALRANKID: &str = "MPI_LOCALRANKID";
/// MPICH / Intel MPI: the processes on the node.
pub const MPI_LOCALNRANKS: &str = "MPI_LOCALNRANKS";
/// MPICH's hydra: the inherited socket of its PMI-1 server (rank 0's address goes through it
/// when `MASTER_ADDR` is unset).
pub const PMI_FD: &str = "PMI_FD";
/// MPICH's hydra under `mpiexec -pmi-port`: `host:port` of its PMI-1 server.
pub const PMI_PORT: &str = "PMI_PORT";
/// MPICH's hydra under `mpiexec -pmi-port`: the process's id for the PMI server.
pub const PMI_ID: &str = "PMI_ID";
/// MPICH's hydra: the name `mpiexec` reached the process's host by (its `-hosts` entry); rank 0
/// of a job across hosts publishes it as its address unless `CHORUS_SOCKET_ADDR` is set.
pub const MPIR_CVAR_CH3_INTERFACE_HOSTNAME: &str = "MPIR_CVAR_CH3_INTERFACE_HOSTNAME";
/// MVAPICH2: the process's rank.
pub const MV2_COMM_WORLD_RANK: &str = "MV2_COMM_WORLD_RANK";
/// MVAPICH2: the number of processes.
pub const MV2_COMM_WORLD_SIZE: &str = "MV2_COMM_WORLD_SIZE";
/// MVAPICH2: the rank on the node.
pub const MV2_COMM_WORLD_LOCAL_RANK: &str = "MV2_COMM_WORLD_LOCAL_RANK";
/// MVAPICH2: the processes on the node.
pub const MV2_COMM_WORLD_LOCAL_SIZE: &str = "MV2_COMM_WORLD_LOCAL_SIZE";
/// PMIx's namespace of the job (names the run of a `file://` rendezvous).
pub const PMIX_NAMESPACE: &str = "PMIX_NAMESPACE";

// Chorus's own.

/// How ranks find each other: `env://`, `tcp://HOST:PORT` or `file:///shared/path`.
pub const CHORUS_INIT_METHOD: &str = "CHORUS_INIT_METHOD";
/// Seconds any blocking step may take.
pub const CHORUS_TIMEOUT: &str = "CHORUS_TIMEOUT";
/// TCP sockets per peer.
pub const CHORUS_NSOCKS: &str = "CHORUS_NSOCKS";
/// Algorithms forced for every collective or per collective.
pub const CHORUS_ALGO: &str = "CHORUS_ALGO";
/// Per-message latency the tuner assumes, in microseconds.
pub const CHORUS_ALPHA_US: &str = "CHORUS_ALPHA_US";
/// Link bandwidth the tuner assumes, in GB/s.
pub const CHORUS_BANDWIDTH_GBS: &str = "CHORUS_BANDWIDTH_GBS";
/// Pipeline chunk size in bytes.
pub const CHORUS_CHUNK_BYTES: &str = "CHORUS_CHUNK_BYTES";
/// The IP address peers use to reach this rank.
pub const CHORUS_SOCKET_ADDR: &str = "CHORUS_SOCKET_ADDR";
/// `auto`, `tcp` or `shm`.
pub const CHORUS_TRANSPORT: &str = "CHORUS_TRANSPORT";
/// This rank's host identity (ranks with equal ones use shared memory, and their device
/// collectives CUDA IPC).
pub const CHORUS_HOST_ID: &str = "CHORUS_HOST_ID";
/// Which sends shared memory moves in one copy: `huge` (from buffers on huge pages), a size
/// in bytes (every send that large), or `0` (never).
pub const CHORUS_SHM_SINGLE_COPY: &str = "CHORUS_SHM_SINGLE_COPY";
/// Which calls write their outputs with streaming stores: `cache` (those whose buffers over
/// the host fill half its last-level cache), a size in bytes (those whose buffers over the
/// host span that many), or `0` (none).
pub const CHORUS_STREAMING_STORES: &str = "CHORUS_STREAMING_STORES";
/// Fraction of the timeout after which a waiting collective reports who holds it up.
pub const CHORUS_WATCHDOG: &str = "CHORUS_WATCHDOG";
/// The job's shared secret (single-node launches generate one).
pub const CHORUS_AUTH_TOKEN: &str = "CHORUS_AUTH_TOKEN";
/// The job's id, bound into every handshake.
pub const CHORUS_JOB_ID: &str = "CHORUS_JOB_ID";
/// The node's GPU ids a worker was given (set by the launchers, like
/// [`CUDA_VISIBLE_DEVICES`]).
pub const CHORUS_DEVICE_IDS: &str = "CHORUS_DEVICE_IDS";
/// `0`: `ddp` starts every bucket's all-reduce only in `finish()`.
pub const CHORUS_DDP_OVERLAP: &str = "CHORUS_DDP_OVERLAP";
/// The tools' log filter (`tracing` directives).
pub const CHORUS_DEBUG: &str = "CHORUS_DEBUG";
/// The perf tools' `--plot` font file (`none`: no text).
pub const CHORUS_PLOT_FONT: &str = "CHORUS_PLOT_FONT";
/// Tests only: a Python with torch 2.x for the torchrun tests.
pub const CHORUS_TORCH_PYTHON: &str = "CHORUS_TORCH_PYTHON";
/// Tests only: the Python (with torch and pytest) for the torch backend's suite.
pub const CHORUS_TEST_PYTHON: &str = "CHORUS_TEST_PYTHON";
/// Tests only: `1` makes the NCCL library's C tests fail, not skip, where NVIDIA's header,
/// a C compiler or `nm` is missing.
pub const CHORUS_REQUIRE_NCCL_HEADER: &str = "CHORUS_REQUIRE_NCCL_HEADER";

// NCCL's, as the NCCL library (`chorus-nccl`) reads them.

/// `host:port` where `ncclGetUniqueId` starts the job's rendezvous store.
pub const NCCL_COMM_ID: &str = "NCCL_COMM_ID";
/// Which interfaces' addresses a unique id may carry (prefixes; `^` excludes, `=` exact).
pub const NCCL_SOCKET_IFNAME: &str = "NCCL_SOCKET_IFNAME";
/// `WARN` or `INFO`: the NCCL library prints every failure to standard error.
pub const NCCL_DEBUG: &str = "NCCL_DEBUG";

// The system's.

/// This host's name, read when `/proc/sys/kernel/hostname` cannot be (rank 0 publishes it
/// for a `file://` rendezvous across hosts).
pub const HOSTNAME: &str = "HOSTNAME";
