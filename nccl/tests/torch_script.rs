//! `tests/torch_collectives.py`, which tools/gpu-check.sh runs on CUDA tensors with backend
//! "nccl" on this library, checked on CPU tensors here: under torchrun with Gloo, and with
//! the chorus backend where the torch Python has it, both ranks ending with the same
//! parameters on both backends.

use std::path::Path;
use std::process::Command;

/// Each rank's "parameter norms" report of a run on `backend`, sorted by rank.
fn norms(python: &str, backend: &str) -> Vec<String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/torch_collectives.py");
    let out = Command::new(python)
        .args([
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
        ])
        .arg(&script)
        .args(["--backend", backend, "--steps", "5"])
        .env("CHORUS_TIMEOUT", "60")
        .output()
        .expect("run torchrun");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{backend}: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    for r in 0..2 {
        let ok = format!("rank {r}: every collective ok on {backend}");
        assert!(stdout.contains(&ok), "{backend}: {stdout}");
    }
    // Each rank prints its line in one write, but two may share a line of the output.
    let mut lines: Vec<String> = stdout
        .split("rank ")
        .filter(|l| l.contains("parameter norms"))
        .map(|l| format!("rank {}", l.trim_end()))
        .collect();
    lines.sort();
    assert_eq!(lines.len(), 2, "{backend}: {stdout}");
    lines
}

#[test]
fn the_gpu_checks_torch_script_runs_on_cpu_tensors() {
    let Ok(python) = std::env::var(chorus_env::CHORUS_TORCH_PYTHON) else {
        eprintln!("skipping: CHORUS_TORCH_PYTHON is not set (a Python with torch 2.x)");
        return;
    };
    let gloo = norms(&python, "gloo");
    // Both ranks hold the same model.
    let model = |line: &str| line.split_once(": ").map(|(_, m)| m.to_string());
    assert_eq!(model(&gloo[0]), model(&gloo[1]), "{gloo:?}");
    let has_chorus = Command::new(&python)
        .args(["-c", "import chorus_torch"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_chorus {
        eprintln!("skipping the chorus backend's run: {python} has no chorus_torch");
        return;
    }
    assert_eq!(norms(&python, "chorus"), gloo);
}
