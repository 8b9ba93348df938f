//! The torch backend's Python suite (`python/tests`, pytest over real processes), run against
//! a fresh build of the `chorus-torch` extension, so `cargo test --workspace` covers it.
//!
//! Once on torch 1.13 (`CHORUS_TEST_PYTHON`, else Debian's `/usr/bin/python3`, else
//! `python3`) and once on current torch (`CHORUS_TORCH_PYTHON`), each where a Python with
//! torch and pytest is found; without one a test says so on stderr and checks nothing.

use std::ffi::OsString;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The whole suite takes about two minutes on two cores; this bounds a hang.
const SUITE_TIMEOUT: Duration = Duration::from_secs(1200);

/// Whether `python` imports torch and pytest.
fn has_torch_and_pytest(python: &str) -> bool {
    Command::new(python)
        .args(["-c", "import torch, pytest"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Says on stderr (past the harness, which hides what a passing test prints) why a suite
/// checks nothing.
fn skip(why: &str) {
    let _ = writeln!(std::io::stderr(), "skipping: {why}");
}

/// The suite on Debian's torch (1.13: calls complete before they return), or the Python that
/// `CHORUS_TEST_PYTHON` names.
#[test]
fn torch_backend_python_suite() {
    let candidates = std::env::var(chorus::env::CHORUS_TEST_PYTHON)
        .ok()
        .into_iter()
        .chain(["/usr/bin/python3".to_string(), "python3".to_string()]);
    match candidates.into_iter().find(|p| has_torch_and_pytest(p)) {
        Some(python) => run_suite(&python, "debian"),
        None => skip(
            "no Python with torch and pytest (torch_backend_python_suite; install \
             python3-torch and python3-pytest, or set CHORUS_TEST_PYTHON)",
        ),
    }
}

/// The suite on current torch (2.7 on: the backend registered under torch's ProcessGroup, its
/// calls in the background), from the Python `CHORUS_TORCH_PYTHON` names.
#[test]
fn torch_backend_python_suite_on_current_torch() {
    match std::env::var(chorus::env::CHORUS_TORCH_PYTHON) {
        Ok(python) if has_torch_and_pytest(&python) => run_suite(&python, "current"),
        _ => skip(
            "no current torch with pytest (torch_backend_python_suite_on_current_torch; set \
             CHORUS_TORCH_PYTHON to a Python that has them, as .ci/run does)",
        ),
    }
}

/// Runs `python/tests` with `python` against a fresh build of the extension, one suite at a
/// time (each takes both cores of a small machine); `label` names its package folder.
fn run_suite(python: &str, label: &str) {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/tests");
    run_on_package(python, label, "the torch backend's suite", |_| {
        let args = ["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"];
        args.iter()
            .map(OsString::from)
            .chain([tests.into()])
            .collect()
    });
}

/// A chosen subset of torch's own distributed suite (`DistributedTest._DistTestBase`, listed
/// in `tools/torch_suite/ci-subset.txt`) against chorus on current torch: every test of it
/// must pass. `tools/torch_suite/run.py` runs the whole suite by hand.
#[test]
fn torch_distributed_suite_subset_on_current_torch() {
    let Some(python) = std::env::var(chorus::env::CHORUS_TORCH_PYTHON)
        .ok()
        .filter(|p| has_torch_and_pytest(p))
    else {
        return skip(
            "no current torch (torch_distributed_suite_subset_on_current_torch; set \
             CHORUS_TORCH_PYTHON to a Python that has torch and pytest, as .ci/run does)",
        );
    };
    let tools = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/torch_suite");
    let subset = std::fs::read_to_string(tools.join("ci-subset.txt")).expect("the subset's list");
    let names: Vec<&str> = subset
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    assert!(!names.is_empty(), "ci-subset.txt names no test");
    run_on_package(
        &python,
        "subset",
        "torch's distributed suite (subset)",
        |dir| {
            let out = dir.join("outcomes.json");
            let args = [
                tools.join("run.py").into(),
                "--backend".into(),
                "chorus".into(),
            ];
            args.into_iter()
                .chain([OsString::from("--out"), out.into()])
                .chain([
                    OsString::from("--tests"),
                    names.join(",").into(),
                    "--strict".into(),
                ])
                .collect()
        },
    );
}

/// Runs `python` with the arguments `args` gives for a fresh build of the package in a
/// folder of its own (on PYTHONPATH), one such run at a time; fails unless it succeeds.
fn run_on_package(
    python: &str,
    label: &str,
    what: &str,
    args: impl FnOnce(&Path) -> Vec<OsString>,
) {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir =
        std::env::temp_dir().join(format!("chorus-torch-test-{}-{label}", std::process::id()));
    chorus_tests::torch_package(&dir);
    let mut child = Command::new(python)
        .args(args(&dir))
        .env("PYTHONPATH", &dir)
        .env("PYTHONUNBUFFERED", "1")
        .spawn()
        .expect("python starts");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("python's status") {
            break status;
        }
        if start.elapsed() > SUITE_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_dir_all(&dir);
            panic!("{what} ({python}) ran past {SUITE_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "{what} failed under {python}: {status}");
}
