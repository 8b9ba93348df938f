//! What to launch: the [`LaunchSpec`], how output is treated, how GPUs are shared out, and the
//! [`Interrupt`] a signal handler raises.

use std::ffi::OsString;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::{DEFAULT_JOB_TIMEOUT, DEFAULT_RUN_ID, DEFAULT_STOP_GRACE};

/// How the launcher treats each worker's stdout/stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Output {
    /// Capture both streams in memory (returned in the report); nothing printed. For tests.
    Capture,
    /// Stream both to the launcher's stdout/stderr line by line, each line prefixed
    /// `[rank{r}]: ` (the global rank), and also keep them in the report. The default.
    #[default]
    Prefixed,
    /// Stream rank 0's lines unprefixed to the launcher's stdout/stderr (like nccl-tests under
    /// mpirun: one table); keep every rank's output in the report.
    RankZero,
}

/// The GPUs local rank `local_rank` of `nproc_per_node` gets on a node of `gpus` GPUs: indices
/// into the node's GPU list.
///
/// With `nproc_per_node <= gpus` the GPUs are split into contiguous blocks,
/// `[r*G/L, (r+1)*G/L)`: every GPU goes to exactly one rank, and the blocks differ in size by at
/// most one when `L` does not divide `G`. With more ranks than GPUs, ranks share GPUs: rank `r`
/// gets the single GPU `r*G/L`, so neighbouring local ranks share one (4 ranks on 2 GPUs:
/// ranks 0 and 1 on GPU 0, ranks 2 and 3 on GPU 1). With no GPUs the range is empty.
///
/// Panics if `local_rank >= nproc_per_node`.
pub fn gpus_for_local_rank(local_rank: usize, nproc_per_node: usize, gpus: usize) -> Range<usize> {
    assert!(
        local_rank < nproc_per_node,
        "local rank {local_rank} is not below nproc_per_node {nproc_per_node}"
    );
    let first = local_rank * gpus / nproc_per_node;
    if gpus == 0 {
        0..0
    } else if nproc_per_node <= gpus {
        first..(local_rank + 1) * gpus / nproc_per_node
    } else {
        first..first + 1
    }
}

/// A request from outside the launch (a signal handler's thread) to stop the job with a
/// signal: [`launch`](crate::launch) forwards the signal to every worker, waits up to
/// [`LaunchSpec::stop_grace`] for them to exit, then kills the rest; a second request kills
/// them at once. No restart follows. Cloning shares the request.
#[derive(Debug, Clone, Default)]
pub struct Interrupt {
    inner: Arc<InterruptState>,
}

#[derive(Debug, Default)]
struct InterruptState {
    signal: AtomicI32,
    count: AtomicU32,
}

impl Interrupt {
    /// A request not raised yet.
    pub fn new() -> Interrupt {
        Interrupt::default()
    }

    /// Asks the launch to forward `signal` (e.g. 15 for SIGTERM) to the workers and stop.
    pub fn raise(&self, signal: i32) {
        self.inner.signal.store(signal, Ordering::SeqCst);
        self.inner.count.fetch_add(1, Ordering::SeqCst);
    }

    /// The last signal raised, if any.
    pub fn signal(&self) -> Option<i32> {
        (self.count() > 0).then(|| self.inner.signal.load(Ordering::SeqCst))
    }

    pub(crate) fn count(&self) -> u32 {
        self.inner.count.load(Ordering::SeqCst)
    }
}

/// What to launch: `nproc_per_node` copies of `program args..` on this host.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Worker executable (a bare name is looked up in `PATH`).
    pub program: PathBuf,
    /// Arguments passed to every worker.
    pub args: Vec<OsString>,
    /// Number of workers to start on this node (must be at least 1): `LOCAL_WORLD_SIZE`.
    pub nproc_per_node: usize,
    /// Number of nodes in the job (default 1): `GROUP_WORLD_SIZE`.
    pub nnodes: usize,
    /// This node's rank, `0..nnodes` (default 0): `GROUP_RANK`.
    pub node_rank: usize,
    /// Value of `MASTER_ADDR` (default `127.0.0.1`).
    pub master_addr: String,
    /// Value of `MASTER_PORT`; `None` (or `Some(0)`) reserves a free one for the whole launch
    /// (single node only; see [`PortReservation`](crate::PortReservation)).
    pub master_port: Option<u16>,
    /// Extra variables for every worker; the contract variables (`RANK`, ...) take precedence.
    pub env: Vec<(String, String)>,
    /// Whole-job limit, counted from the start of [`launch`](crate::launch) over all restarts;
    /// `Duration::MAX` means none.
    pub timeout: Duration,
    /// What happens to the workers' output.
    pub output: Output,
    /// How many times a failed local group is restarted (default 0).
    pub max_restarts: u32,
    /// `TORCHELASTIC_RUN_ID` (default `none`).
    pub run_id: String,
    /// When set, every rank's stdout and stderr are also written, unprefixed, to
    /// `<log_dir>/attempt_<restart>/rank<RANK>.{stdout,stderr}.log`.
    pub log_dir: Option<PathBuf>,
    /// The node's GPU ids (as CUDA numbers them without `CUDA_VISIBLE_DEVICES`); when not
    /// empty each worker gets its share ([`gpus_for_local_rank`]) in `CUDA_VISIBLE_DEVICES`
    /// and `CHORUS_DEVICE_IDS`.
    pub devices: Vec<String>,
    /// A stop request to watch (see [`Interrupt`]).
    pub interrupt: Option<Interrupt>,
    /// Start each worker in a process group of its own (Unix), so that a terminal's Ctrl-C
    /// reaches only the launcher (which forwards it through an [`Interrupt`]) and signals and
    /// kills reach the worker's children too. Default false: workers share the launcher's
    /// group, so a launcher without a signal handler still has its workers stopped by Ctrl-C.
    pub own_process_group: bool,
    /// After an interrupt's signal, how long workers may take to exit before they are killed.
    pub stop_grace: Duration,
    /// After a worker fails, let the others run until they end by themselves (or the
    /// timeout) instead of stopping them: for watching how the survivors fail.
    pub wait_all: bool,
}

impl LaunchSpec {
    /// A spec for `nproc_per_node` copies of `program` on a single node, with no arguments and
    /// the defaults.
    pub fn new(program: impl Into<PathBuf>, nproc_per_node: usize) -> Self {
        LaunchSpec {
            program: program.into(),
            args: Vec::new(),
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: chorus_env::DEFAULT_MASTER_ADDR.to_string(),
            master_port: None,
            env: Vec::new(),
            timeout: DEFAULT_JOB_TIMEOUT,
            output: Output::default(),
            max_restarts: 0,
            run_id: DEFAULT_RUN_ID.to_string(),
            log_dir: None,
            devices: Vec::new(),
            interrupt: None,
            own_process_group: false,
            stop_grace: DEFAULT_STOP_GRACE,
            wait_all: false,
        }
    }

    /// The job's `WORLD_SIZE`: `nnodes * nproc_per_node`.
    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    /// Appends one argument.
    #[must_use]
    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Appends several arguments.
    #[must_use]
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Adds an environment variable for every worker.
    #[must_use]
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Sets the whole-job time limit.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets how the workers' output is handled.
    #[must_use]
    pub fn output(mut self, output: Output) -> Self {
        self.output = output;
        self
    }

    /// Uses a fixed `MASTER_PORT` instead of reserving a free one.
    #[must_use]
    pub fn master_port(mut self, port: u16) -> Self {
        self.master_port = Some(port);
        self
    }

    /// Sets `MASTER_ADDR`.
    #[must_use]
    pub fn master_addr(mut self, addr: impl Into<String>) -> Self {
        self.master_addr = addr.into();
        self
    }

    /// Makes this launch node `node_rank` of a job of `nnodes` nodes.
    #[must_use]
    pub fn nodes(mut self, nnodes: usize, node_rank: usize) -> Self {
        self.nnodes = nnodes;
        self.node_rank = node_rank;
        self
    }

    /// Allows `max_restarts` restarts of the local group after failures.
    #[must_use]
    pub fn max_restarts(mut self, max_restarts: u32) -> Self {
        self.max_restarts = max_restarts;
        self
    }

    /// Sets `TORCHELASTIC_RUN_ID`.
    #[must_use]
    pub fn run_id(mut self, run_id: impl Into<String>) -> Self {
        self.run_id = run_id.into();
        self
    }

    /// Also writes every rank's output to files under `dir`.
    #[must_use]
    pub fn log_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.log_dir = Some(dir.into());
        self
    }

    /// Sets the node's GPU ids, shared out among the local ranks.
    #[must_use]
    pub fn devices<I, S>(mut self, ids: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.devices = ids.into_iter().map(Into::into).collect();
        self
    }

    /// Watches `interrupt` for stop requests.
    #[must_use]
    pub fn interrupt(mut self, interrupt: Interrupt) -> Self {
        self.interrupt = Some(interrupt);
        self
    }

    /// Starts each worker in a process group of its own (see the field).
    #[must_use]
    pub fn own_process_group(mut self, own: bool) -> Self {
        self.own_process_group = own;
        self
    }

    /// Sets how long workers may take to exit after an interrupt's signal.
    #[must_use]
    pub fn stop_grace(mut self, grace: Duration) -> Self {
        self.stop_grace = grace;
        self
    }

    /// Lets the other workers run on after one fails (see the field).
    #[must_use]
    pub fn wait_all(mut self, wait_all: bool) -> Self {
        self.wait_all = wait_all;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_mapping() {
        let all = |l: usize, g: usize| -> Vec<Range<usize>> {
            (0..l).map(|r| gpus_for_local_rank(r, l, g)).collect()
        };
        // Fewer ranks than GPUs: contiguous blocks (the seeds' 2 ranks on 8 GPUs).
        assert_eq!(all(2, 8), [0..4, 4..8]);
        assert_eq!(all(1, 4)[0], 0..4);
        // Uneven: every GPU used once, block sizes differ by at most one.
        assert_eq!(all(2, 3), [0..1, 1..3]);
        assert_eq!(all(3, 8), [0..2, 2..5, 5..8]);
        // One rank per GPU.
        assert_eq!(all(4, 4), [0..1, 1..2, 2..3, 3..4]);
        // More ranks than GPUs: neighbours share one GPU.
        assert_eq!(all(4, 2), [0..1, 0..1, 1..2, 1..2]);
        assert_eq!(all(3, 2), [0..1, 0..1, 1..2]);
        assert_eq!(all(5, 1), vec![0..1; 5]);
        // No GPUs: nothing.
        assert_eq!(all(3, 0), vec![0..0; 3]);
        // Every GPU is used by some rank, and ranges stay in bounds.
        for l in 1..=9 {
            for g in 1..=9 {
                let ranges = all(l, g);
                let mut used = vec![false; g];
                for r in &ranges {
                    assert!(!r.is_empty() && r.end <= g, "L={l} G={g}: {ranges:?}");
                    used[r.clone()].iter_mut().for_each(|u| *u = true);
                }
                assert!(used.iter().all(|&u| u), "L={l} G={g}: {ranges:?}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "local rank 2 is not below nproc_per_node 2")]
    fn gpu_mapping_rejects_a_bad_rank() {
        let _ = gpus_for_local_rank(2, 2, 4);
    }
}
