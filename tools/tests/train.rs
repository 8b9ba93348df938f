//! The trainer across real processes: data-parallel runs match one-rank runs
//! of the same global batch, a resumed run matches an uninterrupted one bit
//! for bit, and 3 epochs on Fashion-MNIST reach the accuracy PyTorch does.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use chorus_tests::{assert_success, run};
use chorus_tools::train::checkpoint::Checkpoint;
use chorus_tools::train::idx::{encode, DEFAULT_DATA_DIR};
use chorus_tools::train::mlp::Mlp;

const TRAIN: &str = env!("CARGO_BIN_EXE_train");

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("chorus-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes a small Fashion-MNIST-shaped data set (28x28 images, 10 classes): each
/// class lights its own band of rows, over deterministic noise.
fn synthetic(dir: &Path, train: usize, test: usize) {
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut noise = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % 96) as u8
    };
    for (prefix, n) in [("train", train), ("t10k", test)] {
        let labels: Vec<u8> = (0..n).map(|i| ((i * 7 + i / 3) % 10) as u8).collect();
        let mut pixels = Vec::with_capacity(n * 784);
        for &label in &labels {
            for p in 0..784 {
                let band = p / 28 / 3 == label as usize;
                pixels.push(noise() + if band { 150 } else { 0 });
            }
        }
        std::fs::write(
            dir.join(format!("{prefix}-images-idx3-ubyte")),
            encode(&[n, 28, 28], &pixels),
        )
        .unwrap();
        std::fs::write(
            dir.join(format!("{prefix}-labels-idx1-ubyte")),
            encode(&[n], &labels),
        )
        .unwrap();
    }
}

/// Runs `world` ranks of `train` with `args`; returns the checkpoint they left.
fn train(world: usize, data: &Path, out: &Path, args: &[&str]) -> Checkpoint {
    let (data, out) = (data.to_str().unwrap(), out.to_str().unwrap());
    let mut all = vec!["--data-dir", data, "--out-dir", out, "--no-progress"];
    all.extend_from_slice(args);
    assert_success(&run(world, Path::new(TRAIN), &all, &[]));
    Checkpoint::load(&Path::new(out).join("checkpoint.bin")).unwrap()
}

/// Largest per-tensor relative L2 difference between two checkpoints' parameters.
fn relative_difference(a: &Checkpoint, b: &Checkpoint) -> f64 {
    a.params
        .iter()
        .zip(&b.params)
        .map(|(x, y)| {
            let diff: f64 = x.iter().zip(y).map(|(p, q)| f64::from(p - q).powi(2)).sum();
            let norm: f64 = y.iter().map(|q| f64::from(*q).powi(2)).sum();
            (diff / norm).sqrt()
        })
        .fold(0.0, f64::max)
}

/// W=4 x 16 against W=1 x 64 for 50 steps: the same samples per step, so the same parameters.
fn equivalence(compression: &str, tolerance: f64) {
    let dir = scratch(&format!("equiv-{compression}"));
    synthetic(&dir, 3200, 100);
    let common = ["--epochs", "1", "--max-steps", "50", "--seed", "3"];
    let flags = |batch: &'static str| {
        let mut f = common.to_vec();
        f.extend(["--batch-size", batch, "--compression", compression]);
        f
    };
    let one = train(1, &dir, &dir.join("w1"), &flags("64"));
    let four = train(4, &dir, &dir.join("w4"), &flags("16"));
    let initial = Checkpoint {
        params: Mlp::new(vec![784, 256, 128, 10]).unwrap().init(3),
        ..one.clone()
    };
    let diff = relative_difference(&four, &one);
    eprintln!(
        "{compression}: W=4 x 16 vs W=1 x 64 after 50 steps: relative L2 difference {diff:e}"
    );
    // The runs moved the parameters far more than they disagree.
    let moved = relative_difference(&one, &initial);
    assert!(
        moved > 0.05,
        "training barely moved the parameters: {moved}"
    );
    assert!(
        diff <= tolerance,
        "W=4 x 16 and W=1 x 64 differ by {diff:e} (relative L2), more than {tolerance:e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn four_ranks_of_16_match_one_rank_of_64() {
    equivalence("none", 1e-5);
}

#[test]
fn four_ranks_of_16_match_one_rank_of_64_with_bf16_compression() {
    // bf16 keeps 8 bits of mantissa: each step's gradient is off by up to 2^-9 relative.
    equivalence("bf16", 1e-2);
}

#[test]
fn a_resumed_run_matches_an_uninterrupted_one_bit_for_bit() {
    let dir = scratch("resume");
    synthetic(&dir, 640, 100);
    let whole = train(2, &dir, &dir.join("whole"), &["--epochs", "3"]);
    let split = dir.join("split");
    train(2, &dir, &split, &["--epochs", "1"]);
    let resumed = train(2, &dir, &split, &["--epochs", "3", "--resume"]);
    assert_eq!(resumed.header.epochs_done, 3);
    assert_eq!(resumed.header.history.len(), 3);
    let bits = |c: &Checkpoint| -> Vec<u32> {
        c.params
            .iter()
            .chain(&c.momentum)
            .flatten()
            .map(|v| v.to_bits())
            .collect()
    };
    assert!(bits(&resumed) == bits(&whole), "resumed run differs");
    // The same losses and accuracies per epoch (the timings differ).
    let metrics = |c: &Checkpoint| -> Vec<[f64; 4]> {
        c.header
            .history
            .iter()
            .map(|e| [e.train_loss, e.train_acc, e.test_loss, e.test_acc])
            .collect()
    };
    assert_eq!(metrics(&resumed), metrics(&whole));
    for file in ["train_log.json", "curves.png"] {
        assert!(split.join(file).is_file(), "{file} missing");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn missing_data_says_how_to_get_it() {
    let dir = scratch("missing");
    let out = Command::new(TRAIN)
        .args(["--data-dir", dir.to_str().unwrap(), "--no-progress"])
        .env_remove("RANK")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("apt-get install dataset-fashion-mnist"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The recipe PyTorch reaches 84-86% with: 3 epochs, W=2, 64 per rank, SGD 0.05 momentum 0.9.
#[test]
fn three_epochs_at_w2_reach_84_percent_on_fashion_mnist() {
    if !Path::new(DEFAULT_DATA_DIR)
        .join("t10k-labels-idx1-ubyte.gz")
        .is_file()
    {
        // Past the harness, which hides what a passing test prints with `eprintln!`.
        let _ = writeln!(
            std::io::stderr(),
            "skipping: Fashion-MNIST is not in {DEFAULT_DATA_DIR} (apt-get install dataset-fashion-mnist)"
        );
        return;
    }
    let out_dir = scratch("accuracy");
    let out = Command::new(TRAIN)
        .args(["-np", "2", "--epochs", "3", "--batch-size", "64"])
        .args(["--lr", "0.05", "--momentum", "0.9", "--job-timeout", "600"])
        .args(["--out-dir", out_dir.to_str().unwrap()])
        .env_remove("RANK")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout
        .lines()
        .rfind(|l| l.starts_with("epoch 3 "))
        .unwrap_or_else(|| panic!("no epoch 3 line in:\n{stdout}"));
    let acc: f64 = last
        .rsplit_once("test_acc ")
        .and_then(|(_, a)| a.trim().parse().ok())
        .unwrap_or_else(|| panic!("no test accuracy in '{last}'"));
    eprintln!("{last}");
    assert!(acc >= 0.84, "test accuracy {acc} after 3 epochs: {last}");
    std::fs::remove_dir_all(&out_dir).unwrap();
}
