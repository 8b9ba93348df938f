//! `chorus_sim` as a user runs it: hosts of several ranks, which bring the hierarchical
//! all-reduce into the table, and bad flags.

use std::process::{Command, Output};

fn chorus_sim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_chorus_sim"))
        .args(args)
        .output()
        .expect("chorus_sim starts")
}

/// The table's rows: size, then the remaining columns.
fn rows(stdout: &str) -> Vec<Vec<String>> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

#[test]
fn hosts_of_two_ranks_bring_the_hierarchical_all_reduce_and_the_tuner_picks_it() {
    // Two hosts of two ranks on 100 Mbit/s links: the ring crosses a host's link in each of
    // its 2(W-1) = 6 steps of S/4, the hierarchical all-reduce only twice with S/2, over
    // shared memory within the hosts.
    let out = chorus_sim(&[
        "-w",
        "4",
        "--ranks-per-host",
        "2",
        "--alpha-us",
        "20",
        "--gbps",
        "0.1",
        "-b",
        "4M",
        "-e",
        "4M",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("(2 per host, sharing its link"), "{stdout}");
    let header = stdout
        .lines()
        .find(|l| l.contains("size (B)"))
        .expect("a header");
    assert!(header.contains("hier time"), "{header}");
    let rows = rows(&stdout);
    assert_eq!(rows.len(), 1, "{stdout}");
    // size, then (time, busbw) for ring, tree, rd, rhd and hier, then pick and best.
    let row = &rows[0];
    assert_eq!(row.len(), 13, "{row:?}");
    let time = |i: usize| row[1 + 2 * i].trim_end_matches('*').parse::<f64>().unwrap();
    let (ring, hier) = (time(0), time(4));
    // Microseconds to move the whole buffer once over one link.
    let wire = 4.0 * 1048576.0 * 8.0 / 0.1e9 * 1e6;
    assert!((ring / (1.5 * wire) - 1.0).abs() < 0.02, "ring {ring} us");
    assert!((hier / wire - 1.0).abs() < 0.03, "hier {hier} us");
    assert_eq!(&row[11..], ["hier", "hier"], "{row:?}");
}

#[test]
fn one_rank_per_host_has_no_hierarchical_row() {
    let out = chorus_sim(&["-w", "4", "-b", "1M", "-e", "1M"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(!stdout.contains("hier"), "{stdout}");
}

#[test]
fn a_zero_host_size_is_refused_by_name() {
    let out = chorus_sim(&["-w", "4", "--ranks-per-host", "0"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--ranks-per-host must be at least 1"),
        "{stderr}"
    );
}

#[test]
fn device_paths_are_priced_and_the_hierarchical_plan_simulated_alike() {
    // Two hosts of eight GPUs: IPC is ruled out, the hierarchical plan beats staging, and
    // its messages simulated on the links land within 5% of its closed form at 64 MiB.
    let out = chorus_sim(&[
        "--device",
        "-w",
        "16",
        "--ranks-per-host",
        "8",
        "-b",
        "64M",
        "-e",
        "64M",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("assumed, not measured"), "{stdout}");
    let table = rows(&stdout);
    // size, ipc "n/a", staged time and busbw, hierarchical time and busbw, sim, pick.
    let row = &table[0];
    assert_eq!(row.len(), 8, "{row:?}");
    assert_eq!(row[1], "n/a");
    let (staged, tiered, sim) = (
        row[2].parse::<f64>().unwrap(),
        row[4].parse::<f64>().unwrap(),
        row[6].parse::<f64>().unwrap(),
    );
    assert!(tiered < staged, "{row:?}");
    assert!((sim / tiered - 1.0).abs() < 0.05, "{row:?}");
    assert_eq!(row[7], "hierarchical");
    // One host: IPC, and no hierarchical plan to simulate.
    let out = chorus_sim(&[
        "--device",
        "-w",
        "4",
        "--ranks-per-host",
        "4",
        "-b",
        "1M",
        "-e",
        "1M",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let row = &rows(&stdout)[0];
    assert_eq!(
        (row[5].as_str(), row[6].as_str(), row[7].as_str()),
        ("n/a", "-", "ipc"),
        "{row:?}"
    );
}
