//! The loopback test harness: starts W real worker processes through
//! [`chorus_launch`] (the launcher the tools use), with the same environment
//! contract users use, and checks what they report.
//!
//! Also holds the test case description the worker and the tests share.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use chorus::{env, DType, ReduceOp};
use chorus_launch::{launch, LaunchReport, LaunchSpec, Output};

/// splitmix64: draw `i` of `seed`, the same on every rank.
pub fn draw(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Sends `tracing` output to stderr, filtered by `CHORUS_DEBUG` (for the test binaries).
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env(env::CHORUS_DEBUG))
        .with_writer(std::io::stderr)
        .init();
}

/// The test worker's variable: `1` makes it allocate its buffers with `alloc_shared`.
pub const CHORUS_TEST_SHARED: &str = "CHORUS_TEST_SHARED";
/// The test worker's variable: `huge` makes it advise its private buffers onto transparent
/// huge pages (`madvise(MADV_HUGEPAGE)`) and say, for each buffer of 2 MiB or more, how many
/// of its bytes are on them (a line `pages <huge bytes> of <bytes>`, or `pages unknown: why`
/// where the kernel cannot tell).
pub const CHORUS_TEST_PAGES: &str = "CHORUS_TEST_PAGES";
/// The test worker's variable: ranks per simulated host (each group of this many consecutive
/// ranks gets a host id of its own).
pub const CHORUS_TEST_RANKS_PER_HOST: &str = "CHORUS_TEST_RANKS_PER_HOST";

/// Where tests look for their worker binaries instead of cargo's build folder (set by
/// `tools/gpu-check.sh`, which carries prebuilt binaries to a GPU machine).
pub const CHORUS_TEST_BIN_DIR: &str = "CHORUS_TEST_BIN_DIR";

/// Bound on one whole multi-process test.
pub const JOB_TIMEOUT: Duration = Duration::from_secs(240);

/// Starts `world` workers running `program args..` and waits for them.
///
/// Every worker gets `CHORUS_TIMEOUT=30` (so a broken collective fails in
/// seconds, not minutes) plus `env`. Panics only if the launch itself fails.
/// The launcher reserves rank 0's port until the job ends, so no other process
/// can take it before rank 0 binds it.
pub fn run(world: usize, program: &Path, args: &[&str], env: &[(&str, &str)]) -> LaunchReport {
    let mut spec = LaunchSpec::new(program, world)
        .args(args.iter().copied())
        .timeout(JOB_TIMEOUT)
        .output(Output::Capture)
        .env(env::CHORUS_TIMEOUT, "30");
    for (k, v) in env {
        spec = spec.env(*k, *v);
    }
    launch(&spec).unwrap_or_else(|e| panic!("cannot launch {}: {e}", program.display()))
}

/// The launcher's summary and every rank's output, for a failed assertion's message.
pub fn dump(report: &LaunchReport) -> String {
    let mut text = report.summary();
    for r in &report.ranks {
        text.push_str(&format!(
            "\n--- rank {} ({}):\n{}{}",
            r.rank, r.status, r.stdout, r.stderr
        ));
    }
    text
}

/// Panics with the launcher's summary and every rank's stderr unless all ranks succeeded.
pub fn assert_success(report: &LaunchReport) {
    if report.success() {
        return;
    }
    let mut text = report.summary();
    for r in &report.ranks {
        text.push_str(&format!(
            "\n--- rank {} ({}) stderr:\n{}",
            r.rank,
            r.status,
            tail(&r.stderr, 30)
        ));
    }
    panic!("{text}");
}

fn tail(s: &str, lines: usize) -> String {
    let all: Vec<&str> = s.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Checks that every rank printed the same digest for every case; returns how many cases.
///
/// Panics naming the first case where ranks differ or a rank is missing it.
pub fn assert_identical_digests(report: &LaunchReport) -> usize {
    let mut cases: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for r in &report.ranks {
        for line in r.stdout.lines() {
            if let Some(rest) = line.strip_prefix("digest ") {
                let (case, hash) = rest
                    .split_once(' ')
                    .expect("digest line has a case and a hash");
                cases.entry(case).or_default().push(hash);
            }
        }
    }
    for (case, hashes) in &cases {
        assert_eq!(
            hashes.len(),
            report.ranks.len(),
            "{case}: not every rank reported it"
        );
        assert!(
            hashes.iter().all(|h| h == &hashes[0]),
            "{case}: ranks hold different bytes: {hashes:?}"
        );
    }
    cases.len()
}

/// The (dtype, operator) pairs a reduction matrix covers: every operator on every type it
/// applies to (the bitwise ones on integer types only).
pub fn reduction_pairs() -> impl Iterator<Item = (DType, ReduceOp)> + Clone {
    DType::ALL.into_iter().flat_map(|dtype| {
        ReduceOp::ALL
            .into_iter()
            .filter(move |op| op.applies_to(dtype))
            .map(move |op| (dtype, op))
    })
}

/// One collective call of a test matrix.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    /// Element type.
    pub dtype: DType,
    /// Reduction operator.
    pub op: ReduceOp,
    /// Element count.
    pub count: usize,
    /// In place or into a separate output.
    pub in_place: bool,
    /// Root rank, for rooted collectives.
    pub root: usize,
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let place = if self.in_place {
            "inplace"
        } else {
            "outofplace"
        };
        write!(
            f,
            "{}/{}/{}/{}/root{}",
            self.dtype, self.op, self.count, place, self.root
        )
    }
}

/// How a single directly started process ended.
#[derive(Debug)]
pub struct Finished {
    /// Whether it exited with code 0.
    pub success: bool,
    /// Its standard error.
    pub stderr: String,
    /// How long it ran.
    pub elapsed: Duration,
}

/// Starts `program args..` with exactly the torchrun variables in `env`
/// (others of that contract removed), waits at most `limit`, and kills it after.
///
/// For tests that need environments the launcher would never produce.
pub fn run_one(program: &Path, args: &[&str], env: &[(&str, &str)], limit: Duration) -> Finished {
    use std::process::{Command, Stdio};
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for var in [
        env::RANK,
        env::WORLD_SIZE,
        env::LOCAL_RANK,
        env::LOCAL_WORLD_SIZE,
        env::MASTER_ADDR,
        env::MASTER_PORT,
    ] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    let start = std::time::Instant::now();
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
    let mut stderr = child.stderr.take().expect("piped stderr");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut text).ok();
        text
    });
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait on child") {
            break status;
        }
        if start.elapsed() > limit {
            child.kill().ok();
            let _ = child.wait();
            panic!("{} did not finish within {limit:?}", program.display());
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Finished {
        success: status.success(),
        stderr: reader.join().unwrap_or_default(),
        elapsed: start.elapsed(),
    }
}

/// Builds the `chorus-torch` extension with the calling test's profile and lays out an
/// importable `chorus_torch` package in `dir` (for `PYTHONPATH`), as `pip install ./python`
/// would install it.
pub fn torch_package(dir: &Path) {
    // The calling test lives in <target>/<profile>/deps.
    let exe = std::env::current_exe().expect("the test's own path");
    let profile: PathBuf = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test lives in <target>/<profile>/deps")
        .to_path_buf();
    let mut build = Command::new(env!("CARGO"));
    // With CUDA support, as pip builds it: the CUDA tests skip where there is no GPU.
    build.args(["build", "-p", "chorus-torch", "--lib", "--features", "cuda"]);
    if profile.file_name().is_some_and(|n| n == "release") {
        build.arg("--release");
    }
    let status = build.status().expect("cargo runs");
    assert!(status.success(), "building chorus-torch failed: {status}");
    let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/chorus_torch");
    let package = dir.join("chorus_torch");
    std::fs::create_dir_all(&package).expect("package directory");
    for entry in std::fs::read_dir(sources).expect("python sources") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "py") {
            std::fs::copy(&path, package.join(path.file_name().expect("name"))).expect("copy");
        }
    }
    std::fs::copy(
        profile.join("lib_chorus.so"),
        package.join("_chorus.abi3.so"),
    )
    .expect("the built extension");
}
