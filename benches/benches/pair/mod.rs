//! Two ranks for the benches, each a copy of the bench process started with
//! `CHORUS_BENCH_PEER` set (ranks live in separate processes, as in real
//! jobs). Both run the same step as many times as they are told; rank 0
//! reports how long that took.

use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use chorus::{env, Communicator};
use chorus_launch::PortReservation;

/// What both ranks do once per iteration.
pub type Step = fn(&Communicator, &mut [u8]);

/// Names the step and buffer size of a rank process: `name:bytes`.
const PEER_VAR: &str = "CHORUS_BENCH_PEER";

/// The two rank processes.
pub struct Pair {
    /// Rank 0's store port, held while the ranks live.
    _port: PortReservation,
    ranks: Vec<Child>,
    orders: Vec<ChildStdin>,
    reports: Lines<BufReader<ChildStdout>>,
}

/// The variables of `rank` in a 2-rank TCP job with `nsocks` sockets per peer.
fn vars(rank: usize, port: u16, nsocks: usize) -> Vec<(&'static str, String)> {
    vec![
        (env::RANK, rank.to_string()),
        (env::WORLD_SIZE, "2".into()),
        (env::LOCAL_RANK, rank.to_string()),
        (env::LOCAL_WORLD_SIZE, "2".into()),
        (env::MASTER_ADDR, chorus::DEFAULT_MASTER_ADDR.into()),
        (env::MASTER_PORT, port.to_string()),
        (env::CHORUS_NSOCKS, nsocks.to_string()),
        (env::CHORUS_TIMEOUT, "60".into()),
        // Both ranks share a host: keep them on TCP, which is what these benches measure.
        (env::CHORUS_TRANSPORT, "tcp".into()),
    ]
}

/// The bench's `main`: serves as a rank when started as one, else runs `benches`.
pub fn main(steps: &[(&str, Step)], benches: fn()) {
    let Ok(spec) = std::env::var(PEER_VAR) else {
        benches();
        return;
    };
    let (name, bytes) = spec.split_once(':').unwrap_or((&spec, "0"));
    let step = steps
        .iter()
        .find(|s| s.0 == name)
        .unwrap_or_else(|| panic!("{PEER_VAR}={spec}: no step named {name}"))
        .1;
    let comm = Communicator::from_env().unwrap_or_else(|e| panic!("cannot join: {e}"));
    let mut buf = vec![0u64; bytes.parse::<usize>().expect("a byte count").div_ceil(8)];
    let mut out = std::io::stdout();
    for line in BufReader::new(std::io::stdin()).lines() {
        let n: u64 = line
            .expect("orders")
            .trim()
            .parse()
            .expect("an iteration count");
        let start = Instant::now();
        for _ in 0..n {
            step(&comm, bytemuck::cast_slice_mut(&mut buf));
        }
        writeln!(out, "{}", start.elapsed().as_nanos()).expect("the bench reads reports");
        out.flush().expect("the bench reads reports");
    }
}

impl Pair {
    /// Starts two rank processes running the step registered in [`main`] as `name` on a
    /// `bytes`-long buffer, over TCP with `nsocks` sockets per peer.
    pub fn new(name: &str, nsocks: usize, bytes: usize) -> Pair {
        let reserved = PortReservation::new(chorus::DEFAULT_MASTER_ADDR).expect("a free port");
        let port = reserved.port();
        let exe = std::env::current_exe().expect("this bench's path");
        let mut ranks: Vec<Child> = (0..2)
            .map(|rank| {
                Command::new(&exe)
                    .envs(vars(rank, port, nsocks))
                    .env(PEER_VAR, format!("{name}:{bytes}"))
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .spawn()
                    .expect("a rank process starts")
            })
            .collect();
        let orders = ranks.iter_mut().filter_map(|r| r.stdin.take()).collect();
        let reports = BufReader::new(ranks[0].stdout.take().expect("rank 0's stdout")).lines();
        Pair {
            _port: reserved,
            ranks,
            orders,
            reports,
        }
    }

    /// Has both ranks run the step `iters` times; rank 0's time.
    pub fn time(&mut self, iters: u64) -> Duration {
        for orders in &mut self.orders {
            writeln!(orders, "{iters}").expect("the rank is alive");
            orders.flush().expect("the rank is alive");
        }
        let report = self
            .reports
            .next()
            .expect("rank 0 reports")
            .expect("rank 0 reports");
        Duration::from_nanos(report.trim().parse().expect("nanoseconds"))
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.orders.clear();
        for rank in &mut self.ranks {
            rank.wait().ok();
        }
    }
}
