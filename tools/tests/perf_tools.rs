//! Runs every perf binary over real local ranks with the check on, and parses
//! its output back the way an nccl-tests parser would.

use std::path::Path;
use std::process::{Command, Output};

/// The table columns, in nccl-tests' order.
const COLUMNS: [&str; 13] = [
    "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw",
    "busbw", "#wrong",
];

/// A small sweep that still moves enough bytes for nonzero bandwidth.
const SWEEP: [&str; 12] = [
    "-b", "8", "-e", "512K", "-f", "16", "-n", "3", "-w", "1", "-c", "1",
];

/// One parsed row: numbers of the out-of-place and in-place groups.
#[derive(Debug)]
struct Row {
    size: usize,
    count: usize,
    dtype: String,
    redop: String,
    root: i64,
    /// (time us, algbw, busbw, wrong) out of place, then in place.
    groups: [(f64, f64, f64, u64); 2],
}

struct Parsed {
    rows: Vec<Row>,
    wrong_total: u64,
    avg_busbw: f64,
}

fn run(exe: &str, args: &[&str]) -> Output {
    Command::new(exe)
        .args(args)
        .args(["--job-timeout", "60"])
        .env_remove("RANK")
        .output()
        .unwrap_or_else(|e| panic!("cannot start {exe}: {e}"))
}

fn run_ok(exe: &str, args: &[&str]) -> String {
    let out = run(exe, args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{exe} {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Parses the table and footer of nccl-tests-format output.
fn parse(text: &str) -> Parsed {
    let header = text
        .lines()
        .find(|l| l.starts_with('#') && l.contains("redop"))
        .expect("a column header line");
    let names: Vec<&str> = header.trim_start_matches('#').split_whitespace().collect();
    assert_eq!(names, COLUMNS, "header: {header}");
    let rows = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 13, "row: {l}");
            let num = |i: usize| -> f64 { f[i].parse().unwrap_or_else(|_| panic!("{l}")) };
            let group = |i: usize| (num(i), num(i + 1), num(i + 2), num(i + 3) as u64);
            Row {
                size: f[0].parse().unwrap(),
                count: f[1].parse().unwrap(),
                dtype: f[2].into(),
                redop: f[3].into(),
                root: f[4].parse().unwrap(),
                groups: [group(5), group(9)],
            }
        })
        .collect();
    let footer = |key: &str| -> String {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("# {key}")))
            .unwrap_or_else(|| panic!("no '{key}' line in:\n{text}"));
        line.split(':').nth(1).unwrap().trim().to_string()
    };
    let oob = footer("Out of bounds values");
    let (count, verdict) = oob.split_once(' ').unwrap();
    let wrong_total: u64 = count.parse().unwrap();
    assert_eq!(verdict, if wrong_total == 0 { "OK" } else { "FAILED" });
    Parsed {
        rows,
        wrong_total,
        avg_busbw: footer("Avg bus bandwidth").parse().unwrap(),
    }
}

/// Checks a run of `program` over `world` ranks: sizes and counts as nccl-tests lays
/// them out, no wrong values, bandwidths consistent with the times and the bus factor.
fn check(parsed: &Parsed, world: usize, shape: Shape, redop: &str, root: i64) {
    let sizes: Vec<usize> = (0..5).map(|i| 8 << (4 * i)).collect();
    assert_eq!(parsed.rows.len(), sizes.len());
    assert_eq!(parsed.wrong_total, 0);
    let mut busbw_sum = 0.0;
    for (row, size) in parsed.rows.iter().zip(sizes) {
        let count = size / 4;
        let block = (count / world) / 4 * 4;
        let (want_size, want_count, factor) = match shape {
            Shape::Whole(factor) => (size, count, factor),
            Shape::Blocks => (block * world * 4, block, (world - 1) as f64 / world as f64),
        };
        assert_eq!((row.size, row.count), (want_size, want_count), "{row:?}");
        assert_eq!(
            (row.dtype.as_str(), row.redop.as_str(), row.root),
            ("float", redop, root)
        );
        for (time, algbw, busbw, wrong) in row.groups {
            assert_eq!(wrong, 0, "{row:?}");
            assert!(time > 0.0, "{row:?}");
            let exact = row.size as f64 / time / 1e3;
            let close = |got: f64, want: f64| (got - want).abs() <= 0.006 + 0.01 * want;
            assert!(close(algbw, exact), "algbw {algbw} vs {exact}: {row:?}");
            assert!(close(busbw, exact * factor), "busbw {busbw}: {row:?}");
            busbw_sum += busbw;
        }
    }
    let mean = busbw_sum / (2 * parsed.rows.len()) as f64;
    assert!(
        (parsed.avg_busbw - mean).abs() <= 0.006,
        "{} vs {mean}",
        parsed.avg_busbw
    );
}

#[derive(Clone, Copy)]
enum Shape {
    /// Same size in and out, with this bus factor.
    Whole(f64),
    /// World-size blocks of count/W elements (rounded to 16 bytes), factor (W-1)/W.
    Blocks,
}

fn sweep(exe: &str, np: usize, extra: &[&str]) -> Parsed {
    let np = np.to_string();
    let mut args = SWEEP.to_vec();
    args.extend(["-np", &np]);
    args.extend(extra);
    parse(&run_ok(exe, &args))
}

#[test]
fn allreduce_perf_reports_and_checks() {
    let parsed = sweep(env!("CARGO_BIN_EXE_allreduce_perf"), 2, &[]);
    check(&parsed, 2, Shape::Whole(1.0), "sum", -1);
}

#[test]
fn broadcast_perf_from_a_chosen_root() {
    let parsed = sweep(env!("CARGO_BIN_EXE_broadcast_perf"), 2, &["-r", "1"]);
    check(&parsed, 2, Shape::Whole(1.0), "none", 1);
}

#[test]
fn reduce_perf_over_every_root_in_turn() {
    let exe = env!("CARGO_BIN_EXE_reduce_perf");
    let parsed = parse(&run_ok(
        exe,
        &[
            "-b", "1K", "-e", "1K", "-n", "2", "-w", "1", "-r", "-1", "-o", "max", "-np", "2",
        ],
    ));
    let roots: Vec<i64> = parsed.rows.iter().map(|r| r.root).collect();
    assert_eq!(roots, [0, 1]);
    assert!(parsed
        .rows
        .iter()
        .all(|r| r.redop == "max" && r.count == 256));
    assert_eq!(parsed.wrong_total, 0);
}

#[test]
fn bitwise_ops_are_checked_on_integers_and_refused_on_floats() {
    let exe = env!("CARGO_BIN_EXE_allreduce_perf");
    for (op, dtype) in [("bxor", "int32"), ("band", "uint8"), ("bor", "int64")] {
        let mut args = SWEEP.to_vec();
        args.extend(["-o", op, "-d", dtype, "-np", "3"]);
        let parsed = parse(&run_ok(exe, &args));
        assert_eq!(parsed.rows.len(), 5);
        assert!(
            parsed
                .rows
                .iter()
                .all(|r| r.redop == op && r.dtype == dtype),
            "{:?}",
            parsed.rows
        );
        assert_eq!(parsed.wrong_total, 0, "{op} {dtype}");
    }
    let out = run(exe, &["-b", "8", "-e", "8", "-o", "band", "-np", "2"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("-o band needs an integer -d") && stderr.contains("not float"),
        "{stderr}"
    );
    // Collectives that do not reduce ignore -o.
    let out = run_ok(
        env!("CARGO_BIN_EXE_broadcast_perf"),
        &["-b", "8", "-e", "8", "-o", "band", "-np", "2"],
    );
    assert_eq!(parse(&out).wrong_total, 0);
}

#[test]
fn all_gather_perf_reports_and_checks() {
    let parsed = sweep(env!("CARGO_BIN_EXE_all_gather_perf"), 2, &[]);
    check(&parsed, 2, Shape::Blocks, "none", -1);
}

#[test]
fn reduce_scatter_perf_over_three_ranks() {
    let parsed = sweep(env!("CARGO_BIN_EXE_reduce_scatter_perf"), 3, &[]);
    check(&parsed, 3, Shape::Blocks, "sum", -1);
}

#[test]
fn alltoall_perf_reports_and_checks() {
    let parsed = sweep(env!("CARGO_BIN_EXE_alltoall_perf"), 2, &[]);
    check(&parsed, 2, Shape::Blocks, "none", -1);
}

#[test]
fn sendrecv_perf_reports_and_checks() {
    let parsed = sweep(env!("CARGO_BIN_EXE_sendrecv_perf"), 2, &["-a", "3"]);
    check(&parsed, 2, Shape::Whole(1.0), "none", -1);
}

#[test]
fn barrier_perf_reports_one_latency_row() {
    let exe = env!("CARGO_BIN_EXE_barrier_perf");
    let parsed = parse(&run_ok(exe, &["-n", "50", "-w", "5", "-np", "2"]));
    assert_eq!(parsed.rows.len(), 1);
    let row = &parsed.rows[0];
    assert_eq!((row.size, row.count, row.redop.as_str()), (0, 0, "none"));
    assert!(row.groups.iter().all(|g| g.0 > 0.0 && g.2 == 0.0));
}

#[test]
fn json_results_match_the_table() {
    let dir = std::env::temp_dir().join(format!("chorus-perf-json-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("results.json");
    let exe = env!("CARGO_BIN_EXE_allreduce_perf");
    let text = run_ok(
        exe,
        &[
            &SWEEP[..],
            &["-np", "2", "-m", "2", "-J", file.to_str().unwrap()],
        ]
        .concat(),
    );
    let parsed = parse(&text);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(json["config"]["aggregated_iterations"], 2);
    assert_eq!(json["config"]["devices"].as_array().unwrap().len(), 2);
    let results = json["results"].as_array().unwrap();
    assert_eq!(results.len(), parsed.rows.len());
    for (r, row) in results.iter().zip(&parsed.rows) {
        assert_eq!(r["size"].as_u64().unwrap() as usize, row.size);
        assert_eq!(r["redop"], "sum");
        let busbw = r["out_of_place"]["bus_bw"].as_f64().unwrap();
        assert!((busbw - row.groups[0].2).abs() <= 0.006, "{r} vs {row:?}");
        assert_eq!(r["in_place"]["nwrong"], 0);
    }
    assert_eq!(json["out_of_bounds"]["okay"], true);
}

#[test]
fn a_root_outside_the_job_is_a_clear_error() {
    let out = run(
        env!("CARGO_BIN_EXE_broadcast_perf"),
        &["-b", "8", "-e", "8", "-r", "2", "-np", "2"],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("-r 2 is not a rank"), "{stderr}");
    assert!(Path::new(env!("CARGO_BIN_EXE_broadcast_perf")).exists());
}

#[test]
fn plot_draws_a_png_with_or_without_a_font() {
    let dir = std::env::temp_dir().join(format!("chorus-perf-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = env!("CARGO_BIN_EXE_all_gather_perf");
    for font in ["", "none"] {
        let file = dir.join(format!("plot{font}.png"));
        let args = [&SWEEP[..], &["-np", "2", "--plot", file.to_str().unwrap()]].concat();
        let mut cmd = Command::new(exe);
        cmd.args(&args).env_remove("RANK");
        if !font.is_empty() {
            cmd.env("CHORUS_PLOT_FONT", font);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let png = std::fs::read(&file).unwrap();
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
        assert!(png.len() > 4096, "{} bytes: nothing drawn?", png.len());
    }
    let out = run(
        env!("CARGO_BIN_EXE_barrier_perf"),
        &["-np", "2", "--plot", dir.join("none.png").to_str().unwrap()],
    );
    std::fs::remove_dir_all(&dir).ok();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing to draw"));
}

/// The numbers after the last ": " of the line of `text` that starts with `prefix`.
fn figures(text: &str, prefix: &str) -> Vec<f64> {
    let line = text
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?} in:\n{text}"));
    let after = line.rsplit(": ").next().unwrap();
    after
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect()
}

/// The first of [`figures`].
fn figure(text: &str, prefix: &str) -> f64 {
    let numbers = figures(text, prefix);
    *numbers
        .first()
        .unwrap_or_else(|| panic!("no number after {prefix:?} in:\n{text}"))
}

#[test]
fn shm_ceiling_reports_copies_bounds_and_the_bare_barrier() {
    let exe = env!("CARGO_BIN_EXE_shm_ceiling");
    let out = Command::new(exe)
        .args(["-n", "1", "--meetings", "200"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        // Reading another process's memory may be forbidden here (ptrace scope, seccomp).
        if err.contains("Operation not permitted") {
            eprintln!("SKIPPED: shm_ceiling may not read its peer's memory here: {err}");
            return;
        }
        panic!("shm_ceiling failed: {err}\n{text}");
    }
    let figure = |prefix: &str| figure(&text, prefix);
    // Each message moves the faster way: the W=2 in-place broadcast's bound is at least the
    // relay through the slots (both printed to 0.01).
    let relay = figure("relay     64 MiB through");
    assert!(relay > 0.0, "{text}");
    assert!(
        figure("bound     W=2 broadcast") >= relay - 0.0051,
        "{text}"
    );
    for w in [2, 4] {
        let numbers = figures(&text, &format!("bound     W={w} broadcast"));
        // The root's own copy can only lower the bound.
        assert!(
            matches!(numbers[..], [in_place, out_of_place] if 0.0 < out_of_place && out_of_place < in_place),
            "{text}"
        );
    }
    let all_reduce = [2, 4].map(|w| figure(&format!("bound     W={w} all-reduce")));
    // Twice the ranks on the same two cores: half the bus bandwidth (both printed to 0.01).
    assert!(
        (all_reduce[0] / 2.0 - all_reduce[1]).abs() <= 0.0051,
        "{text}"
    );
    assert!(figure("meet      W=2") > 0.0, "{text}");
    assert!(figure("meet      W=4") > 0.0, "{text}");
    let syscalls = figures(&text, "syscall");
    assert!(
        matches!(syscalls[..], [getppid, sched_yield] if getppid > 0.0 && sched_yield > 0.0),
        "{text}"
    );
}

#[test]
fn tcp_ceiling_reports_floor_streams_and_bounds() {
    let exe = env!("CARGO_BIN_EXE_tcp_ceiling");
    let out = Command::new(exe)
        .args(["-np", "4", "-n", "200", "--streams", "1"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let figure = |prefix: &str| figure(&text, prefix);
    assert!(figure("exchange  W=2") > 0.0);
    assert!(figure("exchange  W=4") > 0.0);
    assert!(figure("stream    one socket, 1 MiB") > 0.0);
    assert!(figure("reduce    float sum") > 0.0);
    assert!(figure("copy      memcpy") > 0.0);
    assert!(figure("broadcast W=2 of 64 MiB in 512 KiB pieces") > 0.0);
    assert!(figure("bound     broadcast W=4") > 0.0);
    assert!(figure("chain     broadcast W=4 of 64 MiB") > 0.0);
    // The root's copy can only lower the bound.
    let in_place = figure("bound     broadcast W=2");
    let out_of_place = figure("bound     out-of-place broadcast W=2");
    assert!(out_of_place > 0.0 && out_of_place <= in_place, "{text}");
    for w in [2, 4] {
        let numbers = figures(&text, &format!("bound     all-reduce W={w} "));
        // Cold and warm copies alone, then both with the sums: the sums can only lower a bound.
        assert!(
            matches!(numbers[..], [cold, warm, cold_sums, warm_sums]
                if cold > cold_sums && warm > warm_sums && cold_sums > 0.0 && warm_sums > 0.0),
            "{text}"
        );
    }
    let bad = Command::new(exe).args(["-np", "3"]).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("power of two"));
}

#[test]
fn nccl_tests_recipes_run_as_written_under_both_names() {
    let recipe = [
        "-b", "8", "-e", "64K", "-f", "4", "-g", "1", "-n", "2", "-w", "1", "-np", "2",
    ];
    for (exe, name) in [
        (env!("CARGO_BIN_EXE_allreduce_perf"), "allreduce_perf"),
        (env!("CARGO_BIN_EXE_all_reduce_perf"), "all_reduce_perf"),
    ] {
        let text = run_ok(exe, &recipe);
        assert!(
            text.contains(&format!("# Collective test starting: {name}\n")),
            "{text}"
        );
        assert!(text.contains("# nThread 1 nGpus 1 minBytes 8 maxBytes 65536"));
        let parsed = parse(&text);
        let sizes: Vec<usize> = parsed.rows.iter().map(|r| r.size).collect();
        assert_eq!(sizes, [8, 32, 128, 512, 2048, 8192, 32768], "{name}");
        assert_eq!(parsed.wrong_total, 0);
    }
}

#[test]
fn nccl_tests_switches_and_cycles() {
    let exe = env!("CARGO_BIN_EXE_allreduce_perf");
    let args = [
        "-b", "1K", "-e", "4K", "-f", "4", "-n", "2", "-w", "1", "-np", "2", "-t", "1", "-z", "1",
        "-p", "1", "-G", "0", "-C", "1", "-N", "2",
    ];
    let parsed = parse(&run_ok(exe, &args));
    let sizes: Vec<usize> = parsed.rows.iter().map(|r| r.size).collect();
    assert_eq!(sizes, [1024, 4096, 1024, 4096]);
    assert_eq!(parsed.wrong_total, 0);
    assert!(parsed
        .rows
        .iter()
        .all(|r| r.groups.iter().all(|g| g.0 > 0.0)));
}

#[test]
fn timeout_flag_sets_the_communicators_timeout() {
    let exe = env!("CARGO_BIN_EXE_allreduce_perf");
    let sweep = ["-b", "8", "-e", "8", "-n", "1", "-w", "0", "-np", "2"];
    // -T stands for CHORUS_TIMEOUT: a bad value there fails, unless -T replaces it.
    let with = |extra: &[&str]| {
        Command::new(exe)
            .args(sweep)
            .args(extra)
            .args(["--job-timeout", "60"])
            .env_remove("RANK")
            .env("CHORUS_TIMEOUT", "-5")
            .output()
            .unwrap()
    };
    let out = with(&[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("CHORUS_TIMEOUT"));
    let out = with(&["-T", "30"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(parse(&String::from_utf8_lossy(&out.stdout)).wrong_total, 0);
}

#[test]
fn more_than_one_gpu_or_thread_per_process_is_a_clear_error() {
    let exe = env!("CARGO_BIN_EXE_all_reduce_perf");
    for (args, want) in [
        (
            &["-g", "8"][..],
            "-g 8: several GPUs per process need --device cuda",
        ),
        (&["-t", "2"], "-t 2: Chorus runs one rank per process"),
        (&["-G", "5"], "-G 5: Chorus has no CUDA graph capture"),
        (&["-N", "0"], "-N 0 (run forever) is not supported"),
        (
            &["--device", "cuda"],
            "`--device cuda` needs the perf tools built with the `cuda` feature",
        ),
    ]
    .into_iter()
    // Built with the feature, --device cuda is accepted (and runs where there is a GPU).
    .filter(|(args, _)| !(cfg!(feature = "cuda") && args.contains(&"--device")))
    {
        let out = run(exe, &[args, &["-np", "2"]].concat());
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
}

/// Runs `every_row_table.py` on `rounds` (texts of `every_row.sh` rounds), returning its output.
fn every_row_table(rounds: &[&str]) -> String {
    table("every_row_table.py", rounds)
}

/// Runs `script` of benches/baselines on `rounds` (texts of rounds), returning its output.
fn table(script: &str, rounds: &[&str]) -> String {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("chorus-every-row-{}-{call}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let paths: Vec<_> = rounds
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let path = dir.join(format!("round-{i}.txt"));
            std::fs::write(&path, text).unwrap();
            path
        })
        .collect();
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../benches/baselines")
        .join(script);
    let out = Command::new("python3")
        .arg(script)
        .args(&paths)
        .output()
        .expect("python3 runs");
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn every_row_table_puts_each_row_beside_the_other_library_and_its_ceiling() {
    let round = include_str!("../../benches/baselines/testdata/round.txt");
    let table = every_row_table(&[round, round]);
    for line in [
        "- round 2: 20:01:11, load average 0.70; memcpy 64 MiB 20.7 GB/s alone, 10.3 each on two",
        // Times: the other's over Chorus's, and the floor over Chorus's.
        "| shm barrier W=4 (us) | 4.41 | 2.74 | x1.61 | 1.97 | 72% |",
        "| TCP all-reduce W=2, 8 B (us) | 10.1 (Open MPI) | 7.57 / 7.37 | x1.34 / x1.38 | 6.29 | 83% / 85% |",
        // Bandwidths: Chorus's over the other's (the better of Gloo and Open MPI) and the bound's.
        "| shm all-reduce W=4, 64 MiB (GB/s) | 1.16 | 2.39 / 2.65 | x2.06 / x2.28 | 3.22 | 74% / 82% |",
        "| TCP broadcast W=4, 64 MiB (GB/s) | 1.64 (Gloo) | 2 / 2.15 | x1.22 / x1.31 | 1.54 / 4.04 (cold share) | 130% / 140% |",
        "| all-reduce W=4, 64 MiB (GB/s) | 1.16 | 3 | 3.2 | x2.58 / x2.75 |",
    ] {
        assert!(table.contains(line), "no {line:?} in\n{table}");
    }
    // A round of the shared-memory part alone: its rows stay, the TCP and torch rows go.
    let shm_only = &round[..round.find("-- tcp_ceiling").unwrap()];
    let table = every_row_table(&[shm_only]);
    assert!(
        table.contains("| shm all-reduce W=2, 8 B (us) | 0.69 | 0.26 / 0.25 |"),
        "{table}"
    );
    assert!(
        !table.contains("TCP") && !table.contains("torch"),
        "{table}"
    );
    assert!(!table.contains("huge pages"), "{table}");
}

#[test]
fn every_row_table_sets_the_page_sizes_side_by_side() {
    let round = include_str!("../../benches/baselines/testdata/pages-round.txt");
    let table = every_row_table(&[round]);
    for line in [
        "| shm broadcast W=2, 64 MiB on huge pages (GB/s) | 5.72 | 4.25 / 9.45 | x0.74 / x1.65 | 3.86 / 7.69 | 110% / 123% |",
        "| 64 MiB row: Chorus against vader (share of bound) | 4 KiB pages | huge pages |",
        "| broadcast W=2 | x0.92 / x1.89 (90% / 106%) | x0.74 / x1.65 (110% / 123%) |",
        "| all-reduce W=4 | x1.53 / x2.19 (72% / 102%) | x1.98 / x2.47 (92% / 114%) |",
    ] {
        assert!(table.contains(line), "no {line:?} in\n{table}");
    }
}

#[test]
fn picks_table_sets_the_tuners_pick_against_the_fastest_forced() {
    let round = |tree_oop: &str| {
        format!(
            "== pages=small W=4 algo=ring\n16777216 20000.0 1.26 11500.0 2.19\n\
             == pages=small W=4 algo=tree\n16777216 {tree_oop} 1.50 12000.0 2.10\n\
             == pages=small W=4 algo=auto\n16777216 16800.0 1.50 12600.0 2.00\n\
             pick 16777216 tree\n\
             == pages=huge W=4 algo=ring\n16777216 10000.0 2.52 8000.0 3.1\n\
             -- failed: allreduce_perf W=4 algo=tree\n"
        )
    };
    let rounds = [round("16000.0"), round("15000.0"), round("17000.0")];
    let rounds: Vec<&str> = rounds.iter().map(String::as_str).collect();
    let out = table("picks_table.py", &rounds);
    for line in [
        "| pages | W | size | ring | tree | pick | its own run | pick / fastest |",
        // Medians of the three rounds; the pick, forced, is the fastest out of place and 4%
        // behind in place (its own run is a run apart).
        "| small | 4 | 16 MiB | 20.0 / **11.5** | **16.0** / 12.0 | tree | 16.8 / 12.6 | x1.04 |",
        // A row whose tuner's run is missing says so rather than rating it.
        "| huge | 4 | 16 MiB | **10.0** / **8.0** |  | ? |  |  |",
        "Medians of 3 rounds",
    ] {
        assert!(out.contains(line), "no {line:?} in\n{out}");
    }
}

#[test]
fn gpu_table_sets_each_run_of_the_gpu_checks_in_a_column() {
    let run = |gpu: &str, sum: &str| {
        format!(
            "# {gpu}, 2026-12-01 10:00 UTC\nkernels cold cache\tok\ttest result: ok. 17 passed\n\
             sum f32 / bf16\t{sum}\n"
        )
    };
    let h100 = run("NVIDIA H100 80GB HBM3", "ok\t2778 / 2759 GB/s | 96%");
    let h200 = run("NVIDIA H200", "FAIL(124)\ttimed out");
    let out = table("gpu_table.py", &[&h100, &h200]);
    for line in [
        "| check | NVIDIA H100 80GB HBM3, 2026-12-01 10:00 UTC | NVIDIA H200, 2026-12-01 10:00 UTC |",
        "| kernels cold cache | test result: ok. 17 passed | test result: ok. 17 passed |",
        // A result's own bars do not split the table; a check that failed says so.
        "| sum f32 / bf16 | 2778 / 2759 GB/s / 96% | **FAIL(124)** timed out |",
        "2 run(s); 1 check(s) did not pass.",
    ] {
        assert!(out.contains(line), "no {line:?} in\n{out}");
    }
}
