//! The torch backend's Python suite (`python/tests`, pytest over real processes), run against
//! a fresh build of the `chorus-torch` extension, so `cargo test --workspace` covers it.
//!
//! It needs a Python with torch and pytest: `CHORUS_TEST_PYTHON`, else Debian's
//! `/usr/bin/python3`, else `python3`. Without one it says so on stderr and checks nothing.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The whole suite takes about two minutes on two cores; this bounds a hang.
const SUITE_TIMEOUT: Duration = Duration::from_secs(1200);

/// A Python that imports torch and pytest, if one is found.
fn python() -> Option<String> {
    let candidates = std::env::var(chorus::env::CHORUS_TEST_PYTHON)
        .ok()
        .into_iter()
        .chain(["/usr/bin/python3".to_string(), "python3".to_string()]);
    candidates.into_iter().find(|python| {
        Command::new(python)
            .args(["-c", "import torch, pytest"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

#[test]
fn torch_backend_python_suite() {
    let Some(python) = python() else {
        // Past the harness, which hides what a passing test prints with `eprintln!`.
        let _ = writeln!(
            std::io::stderr(),
            "skipping: no Python with torch and pytest (torch_backend_python_suite; \
             install python3-torch and python3-pytest, or set CHORUS_TEST_PYTHON)"
        );
        return;
    };
    let dir = std::env::temp_dir().join(format!("chorus-torch-test-{}", std::process::id()));
    chorus_tests::torch_package(&dir);
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/tests");
    let mut child = Command::new(&python)
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
            panic!("the torch backend's suite ran past {SUITE_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        status.success(),
        "the torch backend's suite failed: {status}"
    );
}
