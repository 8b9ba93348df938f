//! The torch backend's Python suite (`python/tests`, pytest over real processes), run against
//! a fresh build of the `chorus-torch` extension, so `cargo test --workspace` covers it.
//!
//! Once on torch 1.13 (`CHORUS_TEST_PYTHON`, else Debian's `/usr/bin/python3`, else
//! `python3`) and once on current torch (`CHORUS_TORCH_PYTHON`), each where a Python with
//! torch and pytest is found; without one a test says so on stderr and checks nothing.

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
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir =
        std::env::temp_dir().join(format!("chorus-torch-test-{}-{label}", std::process::id()));
    chorus_tests::torch_package(&dir);
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/tests");
    let mut child = Command::new(python)
        .args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"])
        .arg(&tests)
        .env("PYTHONPATH", &dir)
        .env("PYTHONUNBUFFERED", "1")
        .spawn()
        .expect("pytest starts");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("pytest's status") {
            break status;
        }
        if start.elapsed() > SUITE_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_dir_all(&dir);
            panic!("the torch backend's suite ({python}) ran past {SUITE_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        status.success(),
        "the torch backend's suite failed under {python}: {status}"
    );
}
