//! `chorus_sim`: predicted times of every algorithm of a collective on a
//! simulated cluster, and the tuner's pick, for a size sweep.
//!
//! `chorus_sim -w 1024 -b 8 -e 1G -f 4` runs the real schedules of all 1024
//! ranks through the cost model's discrete-event evaluator (alpha-beta
//! links, one NIC per rank; see `chorus::cost`), prints nccl-tests-style
//! time and bus bandwidth per algorithm, the tuner's pick from its closed
//! forms, the best simulated algorithm, and the sizes where the pick changes.
//! With `--ranks-per-host K` hosts of K ranks share one NIC and reach each
//! other over shared memory, and the hierarchical all-reduce joins the table.
//!
//! `--device` prices a GPU job's device paths instead (K GPUs per host): CUDA IPC on one
//! host, staging through pinned memory, and the hierarchical plan, from the closed forms
//! of `chorus::cost::device` (with `--peer-gbs` and `--pcie-gbs`; the defaults are
//! assumed, not measured), the path a device communicator picks, and, for the all-reduce,
//! the hierarchical plan's messages simulated on the links (PCIe copies not modelled).

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chorus::cost::device::{self, DeviceLayout, DeviceLinks, DevicePath};
use chorus::cost::{evaluate, EvalConfig, LinkModel, Network};
use chorus::schedule::hierarchical::sharded_all_reduce_on;
use chorus::schedule::plan::{self, Placement, Shape};
use chorus::tuner::{Algorithm, Collective, Forced, Path, Topology, Tuner, TIE_MARGIN};
use chorus_tools::perf::parse_size;
use clap::Parser;

/// Bytes per element: the schedules are built for `float`.
const ELEM: usize = 4;

/// Flags (sizes as in nccl-tests).
#[derive(Debug, Parser)]
#[command(
    version,
    about = "Predicted collective times on a simulated alpha-beta cluster"
)]
struct Args {
    /// Smallest size in bytes (suffixes K, M, G).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest size in bytes (suffixes K, M, G).
    #[arg(short = 'e', long = "maxbytes", default_value = "1G", value_parser = parse_size)]
    max_bytes: usize,
    /// Multiply the size by this factor between steps.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
    step_factor: usize,
    /// Number of ranks.
    #[arg(short = 'w', long = "world", default_value_t = 8)]
    world: usize,
    /// allreduce, broadcast, reduce, allgather, reducescatter, alltoall, gather or scatter.
    #[arg(long, default_value = "allreduce")]
    collective: Collective,
    /// Per-message latency in microseconds (alpha).
    #[arg(long = "alpha-us", default_value_t = 5.0)]
    alpha_us: f64,
    /// Link bandwidth in Gbit/s (beta).
    #[arg(long, default_value_t = 100.0)]
    gbps: f64,
    /// Ranks per host: they share the host's link to the others and reach each other over
    /// `--local-alpha-us` / `--local-gbps` links.
    #[arg(long = "ranks-per-host", default_value_t = 1)]
    ranks_per_host: usize,
    /// Cores of the host where every rank is on one: the tuner's pick prices a ring's
    /// stalls where the ranks outnumber them (the simulation does not); default: enough.
    #[arg(long)]
    cores: Option<usize>,
    /// Per-message latency between two ranks of one host, in microseconds (default: the
    /// tuner's shared memory).
    #[arg(long = "local-alpha-us")]
    local_alpha_us: Option<f64>,
    /// Bandwidth between two ranks of one host in Gbit/s (default: the tuner's shared memory).
    #[arg(long = "local-gbps")]
    local_gbps: Option<f64>,
    /// Reduction bandwidth in GB/s (gamma); reductions are free if unset.
    #[arg(long = "gamma-gbs")]
    gamma_gbs: Option<f64>,
    /// Pipeline chunk in bytes (CHORUS_CHUNK_BYTES; default 512K, with `--device` the
    /// staged path's 4M).
    #[arg(long = "chunk", value_parser = parse_size)]
    chunk_bytes: Option<usize>,
    /// Root of broadcast, reduce, gather and scatter.
    #[arg(long, default_value_t = 0)]
    root: usize,
    /// Staging slots per rank for receive-and-reduce (0: unlimited).
    #[arg(long, default_value_t = chorus::cost::DEFAULT_DEPTH)]
    depth: usize,
    /// Evaluate a schedule only if all ranks together have at most this many steps; else use the closed form.
    #[arg(long = "max-steps", default_value = "16M", value_parser = parse_size)]
    max_steps: usize,
    /// Only closed forms (no schedule is evaluated).
    #[arg(long)]
    closed: bool,
    /// Only these algorithms (comma-separated, e.g. `ring,rhd`); default: every candidate.
    #[arg(long, value_delimiter = ',')]
    algos: Vec<Algorithm>,
    /// Evaluations run in parallel on this many threads (default: the CPUs).
    #[arg(long)]
    threads: Option<usize>,
    /// Price the device paths of a GPU job (`--ranks-per-host` GPUs per host) instead of
    /// the host algorithms.
    #[arg(long)]
    device: bool,
    /// With `--device`: bandwidth between two GPUs of a host through CUDA IPC, in GB/s
    /// (default: assumed, 100).
    #[arg(long = "peer-gbs")]
    peer_gbs: Option<f64>,
    /// With `--device`: bandwidth between a GPU and pinned host memory, each way, in GB/s
    /// (default: assumed, 20).
    #[arg(long = "pcie-gbs")]
    pcie_gbs: Option<f64>,
}

impl Args {
    /// The pipeline chunk in bytes: the flag, else the host collectives' default, or with
    /// `--device` the staged path's pinned buffers (its chunks).
    fn chunk(&self) -> usize {
        match (self.chunk_bytes, self.device) {
            (Some(bytes), _) => bytes,
            (None, false) => 512 << 10,
            (None, true) => 4 << 20,
        }
    }
}

/// One cell of the table: a predicted time, and whether it is a closed form.
#[derive(Debug, Clone, Copy)]
struct Cell {
    time: f64,
    closed: bool,
    steps: u64,
    wall: Duration,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("chorus_sim: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The sizes of the sweep, rounded down to whole blocks where the collective has per-rank blocks.
fn sizes(args: &Args) -> Result<Vec<usize>, String> {
    if args.min_bytes > args.max_bytes {
        return Err(format!(
            "-b {} is larger than -e {}",
            args.min_bytes, args.max_bytes
        ));
    }
    if args.step_factor < 2 {
        return Err("-f must be at least 2".into());
    }
    let unit = unit(args.collective, args.world);
    let mut out = Vec::new();
    let mut size = args.min_bytes.max(1);
    while size <= args.max_bytes {
        let s = size / unit * unit;
        if s > 0 && out.last() != Some(&s) {
            out.push(s);
        }
        size = size.saturating_mul(args.step_factor);
    }
    if out.is_empty() {
        return Err(format!(
            "no size in -b..-e is a whole number of {unit}-byte units"
        ));
    }
    Ok(out)
}

/// Sizes must be whole elements, and whole blocks of W elements where every rank has a block.
fn unit(c: Collective, world: usize) -> usize {
    match c {
        Collective::AllReduce | Collective::Broadcast | Collective::Reduce => ELEM,
        _ => ELEM * world,
    }
}

fn run(args: &Args) -> Result<(), String> {
    let w = args.world;
    if w == 0 || w >= 1 << 25 {
        return Err(format!("-w {w}: the world size must be 1 to 2^25"));
    }
    if args.root >= w {
        return Err(format!("--root {} is not a rank of {w}", args.root));
    }
    let c = args.collective;
    let net = network(args)?;
    if args.device {
        return run_device(args, &net);
    }
    let local = args.ranks_per_host;
    let hosts = w.div_ceil(local);
    let mut tuner = Tuner::new(net.between.alpha, net.between.beta, Forced::none())
        .with_chunk_bytes(args.chunk())
        .with_topology(Topology {
            hosts,
            most_local: local.min(w),
            shared_memory: hosts == 1,
            cores: args.cores.unwrap_or(usize::MAX),
        });
    if let Some(g) = args.gamma_gbs {
        tuner = tuner.with_gamma(g * 1e9);
    }
    let sizes = sizes(args)?;
    // The hierarchical all-reduce is a column where the tuner has it (several hosts, several
    // ranks on one).
    let hierarchy = tuner
        .estimate(c, Algorithm::Hierarchical, sizes[0], w)
        .is_finite()
        .then_some(Algorithm::Hierarchical);
    let algos: Vec<Algorithm> = Tuner::candidates(c)
        .iter()
        .copied()
        .chain(hierarchy)
        .filter(|a| args.algos.is_empty() || args.algos.contains(a))
        .collect();
    if algos.is_empty() {
        return Err(format!("--algos: none of {:?} implements {c}", args.algos));
    }
    let algos = &algos[..];
    let config = EvalConfig {
        elem_bytes: ELEM,
        depth: args.depth,
        ..EvalConfig::default()
    };
    let chunk = (args.chunk() / ELEM).max(1);

    // Evaluate every (size, algorithm) on a few threads, largest first so the slowest start early.
    let jobs: Vec<(usize, usize)> = (0..sizes.len())
        .rev()
        .flat_map(|i| (0..algos.len()).map(move |j| (i, j)))
        .collect();
    let cells: Mutex<Vec<Vec<Option<Cell>>>> =
        Mutex::new(vec![vec![None; algos.len()]; sizes.len()]);
    let next = AtomicUsize::new(0);
    let error: Mutex<Option<String>> = Mutex::new(None);
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
        .max(1);
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(i, j)) = jobs.get(k) else { return };
                let (bytes, a) = (sizes[i], algos[j]);
                let result = cell(args, &net, &tuner, &config, a, bytes, chunk);
                match result {
                    Ok(cell) => cells.lock().unwrap()[i][j] = Some(cell),
                    Err(e) => {
                        error.lock().unwrap().get_or_insert(e);
                    }
                }
            });
        }
    });
    if let Some(e) = error.into_inner().unwrap() {
        return Err(e);
    }
    let cells = cells.into_inner().unwrap();
    let total_wall = started.elapsed();

    print_table(args, &net, &tuner, &sizes, algos, &cells);
    print_crossovers(args, &tuner, &sizes, algos, &cells);
    let steps: u64 = cells.iter().flatten().flatten().map(|c| c.steps).sum();
    println!(
        "# evaluated {steps} steps in {:.1} s ({threads} threads)",
        total_wall.as_secs_f64()
    );
    for (j, a) in algos.iter().enumerate() {
        let wall: Duration = cells.iter().filter_map(|row| row[j]).map(|c| c.wall).sum();
        let closed = cells
            .iter()
            .filter(|row| row[j].is_some_and(|c| c.closed))
            .count();
        print!("#   {a}: {:.1} s evaluating", wall.as_secs_f64());
        if closed > 0 {
            print!(
                ", {closed} of {} sizes from the closed form (over --max-steps {} or --closed)",
                sizes.len(),
                args.max_steps
            );
        }
        println!();
    }
    Ok(())
}

/// `--device`: each device path's predicted time per size, the pick, and the hierarchical
/// all-reduce's messages simulated.
fn run_device(args: &Args, net: &Network) -> Result<(), String> {
    let (c, w, per) = (args.collective, args.world, args.ranks_per_host);
    let mut links = DeviceLinks::assumed(net.between);
    let mut assumed = Vec::new();
    for (flag, value, link) in [
        ("--peer-gbs", args.peer_gbs, &mut links.peer),
        ("--pcie-gbs", args.pcie_gbs, &mut links.pcie),
    ] {
        match value {
            Some(g) if g > 0.0 => link.beta = g * 1e9,
            Some(_) => return Err(format!("{flag} must be > 0")),
            None => assumed.push(flag),
        }
    }
    let layout = DeviceLayout {
        world: w,
        hosts: w.div_ceil(per),
        most_local: per.min(w),
    };
    let hosts: Vec<Vec<usize>> = (0..w)
        .step_by(per)
        .map(|first| (first..(first + per).min(w)).collect())
        .collect();
    let simulated = |bytes: usize| -> Result<Option<f64>, String> {
        let count = bytes / ELEM;
        let chunk = (args.chunk() / ELEM).max(1);
        let make = |rank: usize| sharded_all_reduce_on(rank, &hosts, count, chunk);
        let longest = make(0).len().max(make(w - 1).len());
        let allowed = layout.paths().contains(&DevicePath::Hierarchical);
        if args.closed || c != Collective::AllReduce || !allowed {
            return Ok(None);
        }
        if longest.saturating_mul(w) > args.max_steps {
            return Ok(None);
        }
        let within = Network {
            within: links.peer,
            ..*net
        };
        let config = EvalConfig {
            elem_bytes: ELEM,
            depth: args.depth,
            ..EvalConfig::default()
        };
        let e = evaluate(w, &within, &config, make).map_err(|e| format!("{c} {bytes} B: {e}"))?;
        Ok(Some(e.time))
    };
    println!(
        "# chorus_sim --device: {c} on {w} GPUs, {} hosts of up to {per}; IPC {:.0} GB/s, PCIe {:.0} GB/s, network alpha {} us, {:.2} GB/s{}",
        layout.hosts,
        links.peer.beta / 1e9,
        links.pcie.beta / 1e9,
        args.alpha_us,
        net.between.beta / 1e9,
        if assumed.is_empty() {
            String::new()
        } else {
            format!(" ({} assumed, not measured)", assumed.join(", "))
        }
    );
    println!(
        "# time: us (closed forms; 'n/a' where the layout rules the path out); busbw: GB/s, nccl-tests' algbw * {:.4}; sim: the hierarchical all-reduce's messages simulated",
        c.bus_factor(w)
    );
    print!("# {:>12}", "size (B)");
    for p in DevicePath::ALL {
        print!("  {:>20}", format!("{p} time   busbw"));
    }
    println!("  {:>12}  {:>12}", "sim time", "pick");
    for bytes in sizes(args)? {
        print!("  {bytes:>12}");
        for p in DevicePath::ALL {
            let t = device::estimate(p, c, bytes, layout, &links);
            if t.is_finite() {
                let busbw = bytes as f64 / t * c.bus_factor(w) / 1e9;
                print!("  {:>12.1}{busbw:>8.2}", t * 1e6);
            } else {
                print!("  {:>20}", "n/a");
            }
        }
        let sim = simulated(bytes)?.map_or("-".to_string(), |t| format!("{:.1}", t * 1e6));
        let pick = device::pick(&layout.paths(), c, bytes, layout, &links)
            .map_or("-".to_string(), |p| p.to_string());
        println!("  {sim:>12}  {pick:>12}");
    }
    Ok(())
}

/// The links `args` describe: `--ranks-per-host` ranks share a host's link.
fn network(args: &Args) -> Result<Network, String> {
    if !(args.alpha_us >= 0.0 && args.gbps > 0.0) {
        return Err("--alpha-us must be >= 0 and --gbps > 0".into());
    }
    if args.ranks_per_host == 0 {
        return Err("--ranks-per-host must be at least 1".into());
    }
    let shm = LinkModel::shared_memory();
    let local_alpha = args.local_alpha_us.map_or(shm.alpha, |us| us * 1e-6);
    let local_beta = args.local_gbps.map_or(shm.beta, |g| g * 1e9 / 8.0);
    if !(local_alpha >= 0.0 && local_beta > 0.0) {
        return Err("--local-alpha-us must be >= 0 and --local-gbps > 0".into());
    }
    let gamma = args.gamma_gbs.map_or(f64::INFINITY, |g| g * 1e9);
    Ok(Network {
        between: LinkModel::new(args.alpha_us * 1e-6, args.gbps * 1e9 / 8.0).with_gamma(gamma),
        within: LinkModel::new(local_alpha, local_beta).with_gamma(gamma),
        per_host: args.ranks_per_host,
    })
}

/// The tuner's pick among the message algorithms for `bytes`.
fn pick(tuner: &Tuner, c: Collective, bytes: usize, w: usize) -> Algorithm {
    match tuner.pick(Some(c), bytes, w, false).path {
        Path::Messages(a) => a,
        // The mailbox (one host, small calls) is not simulated: the flat pick stands in.
        Path::Mailbox | Path::Window => tuner.choose(c, bytes, w),
    }
}

/// The predicted time of `a` on `bytes`: evaluated if small enough, else the closed form.
fn cell(
    args: &Args,
    net: &Network,
    tuner: &Tuner,
    config: &EvalConfig,
    a: Algorithm,
    bytes: usize,
    chunk: usize,
) -> Result<Cell, String> {
    let (c, w) = (args.collective, args.world);
    let count = bytes / ELEM;
    let hosts: Vec<Vec<usize>> = (0..w)
        .step_by(args.ranks_per_host)
        .map(|first| (first..(first + args.ranks_per_host).min(w)).collect())
        .collect();
    // The communicator's plan of the call, by `a`, on these hosts.
    let shape = Shape {
        collective: Some(c),
        count,
        elem: ELEM,
        root: args.root,
        chunk,
        counts: None,
        on_windows: false,
    };
    let make = |rank: usize| {
        let at = Placement {
            rank,
            world: w,
            hosts: &hosts,
            machines: hosts.len(),
            shared_memory: hosts.len() == 1 && w > 1,
        };
        plan::messages(&shape, a, &at)
            .expect("a candidate implements c")
            .steps
    };
    let closed = || Cell {
        time: tuner.estimate(c, a, bytes, w),
        closed: true,
        steps: 0,
        wall: Duration::ZERO,
    };
    if args.closed {
        return Ok(closed());
    }
    // Estimate the total from the longest of a few ranks' programs (the root's may be longest).
    let probe = [0, args.root, w / 2, w - 1];
    let longest = probe.iter().map(|&r| make(r).len()).max().unwrap_or(0);
    if longest.saturating_mul(w) > args.max_steps {
        return Ok(closed());
    }
    let t = Instant::now();
    let e = evaluate(w, net, config, make).map_err(|e| format!("{c} {a} {bytes} B: {e}"))?;
    Ok(Cell {
        time: e.time,
        closed: false,
        steps: e.steps,
        wall: t.elapsed(),
    })
}

fn print_table(
    args: &Args,
    net: &Network,
    tuner: &Tuner,
    sizes: &[usize],
    algos: &[Algorithm],
    cells: &[Vec<Option<Cell>>],
) {
    let (c, w) = (args.collective, args.world);
    let hosts = match args.ranks_per_host {
        1 => String::new(),
        k => format!(
            " ({k} per host, sharing its link; within a host alpha {:.1} us, {:.2} GB/s)",
            net.within.alpha * 1e6,
            net.within.beta / 1e9
        ),
    };
    println!(
        "# chorus_sim: {c} on {w} ranks{hosts}; alpha {} us, links {} Gbit/s ({:.2} GB/s){}; chunk {} B; staging depth {}",
        args.alpha_us,
        args.gbps,
        net.between.beta / 1e9,
        args.gamma_gbs
            .map_or(String::new(), |g| format!(", reductions {g} GB/s")),
        args.chunk(),
        args.depth
    );
    println!(
        "# time: us to the last rank's completion; busbw: GB/s, nccl-tests' algbw * {:.4}",
        c.bus_factor(w)
    );
    println!("# '*': closed form (schedule not evaluated); pick: the tuner (closed forms); best: the simulation ('!' where they differ; within 1% the earlier algorithm)");
    print!("# {:>12}", "size (B)");
    for a in algos {
        print!("  {:>20}", format!("{a} time   busbw"));
    }
    println!("  {:>8}  {:>8}", "pick", "best");
    for (i, &bytes) in sizes.iter().enumerate() {
        print!("  {bytes:>12}");
        let mut best: Option<(f64, Algorithm)> = None;
        for (j, &a) in algos.iter().enumerate() {
            let cell = cells[i][j].expect("every job ran");
            let busbw = if cell.time > 0.0 {
                bytes as f64 / cell.time * c.bus_factor(w) / 1e9
            } else {
                f64::INFINITY
            };
            let mark = if cell.closed { '*' } else { ' ' };
            print!("  {:>11.1}{mark}{busbw:>8.2}", cell.time * 1e6);
            if best.is_none_or(|(t, _)| cell.time < t * (1.0 - TIE_MARGIN)) {
                best = Some((cell.time, a));
            }
        }
        let pick = pick(tuner, c, bytes, w);
        let best = best.map(|(_, a)| a).unwrap_or(pick);
        let differ = if best == pick { ' ' } else { '!' };
        println!("  {pick:>8}  {best:>7}{differ}");
    }
}

/// Sizes where the tuner's pick changes (refined by bisection on the closed
/// forms), and where the simulation's best changes between sweep sizes.
fn print_crossovers(
    args: &Args,
    tuner: &Tuner,
    sizes: &[usize],
    algos: &[Algorithm],
    cells: &[Vec<Option<Cell>>],
) {
    let (c, w) = (args.collective, args.world);
    let unit = unit(c, w);
    let pick = |bytes: usize| pick(tuner, c, bytes, w);
    let (lo, hi) = (sizes[0], sizes[sizes.len() - 1]);
    let mut changes = Vec::new();
    // A fine geometric scan (32 points per doubling), each change refined to one unit.
    let mut prev = lo;
    let mut at = lo;
    while at < hi {
        let next = ((at as f64 * 2f64.powf(1.0 / 32.0)) as usize)
            .max(at + unit)
            .min(hi)
            / unit
            * unit;
        let next = next.max(at + unit).min(hi);
        if pick(next) != pick(prev) {
            let (mut a, mut b) = (prev / unit, next / unit);
            while b - a > 1 {
                let mid = (a + b) / 2;
                if pick(mid * unit) == pick(prev) {
                    a = mid;
                } else {
                    b = mid;
                }
            }
            changes.push((pick(prev), pick(b * unit), b * unit));
        }
        prev = next;
        at = next;
    }
    if changes.is_empty() {
        println!("# tuner crossovers: none, {} throughout", pick(lo));
    } else {
        println!("# tuner crossovers (closed forms):");
        const SHOWN: usize = 12;
        if changes.len() > SHOWN {
            println!("#   ({} changes; the first {SHOWN} shown)", changes.len());
        }
        for (from, to, bytes) in changes.into_iter().take(SHOWN) {
            println!(
                "#   {from} -> {to} at {bytes} B ({}); estimates there: {}",
                human(bytes),
                tuner.explain_call(Some(c), bytes, w, false)
            );
        }
    }
    let best = |i: usize| {
        let mut best: Option<(f64, Algorithm)> = None;
        for (j, &a) in algos.iter().enumerate() {
            let t = cells[i][j].map_or(f64::INFINITY, |c| c.time);
            if best.is_none_or(|(bt, _)| t < bt * (1.0 - TIE_MARGIN)) {
                best = Some((t, a));
            }
        }
        best.map(|(_, a)| a)
    };
    let mut any = false;
    for i in 1..sizes.len() {
        if best(i) != best(i - 1) {
            if !any {
                println!("# simulated crossovers (between sweep sizes):");
                any = true;
            }
            println!(
                "#   {} -> {} between {} and {}",
                best(i - 1).map_or("-".into(), |a| a.to_string()),
                best(i).map_or("-".into(), |a| a.to_string()),
                human(sizes[i - 1]),
                human(sizes[i])
            );
        }
    }
    if !any {
        println!(
            "# simulated crossovers: none, {} throughout",
            best(0).map_or("-".into(), |a| a.to_string())
        );
    }
}

/// `bytes` with a binary suffix (`1.5 KiB`).
fn human(bytes: usize) -> String {
    let b = bytes as f64;
    match bytes {
        _ if bytes >= 1 << 30 => format!("{:.2} GiB", b / f64::from(1u32 << 30)),
        _ if bytes >= 1 << 20 => format!("{:.2} MiB", b / f64::from(1u32 << 20)),
        _ if bytes >= 1 << 10 => format!("{:.2} KiB", b / 1024.0),
        _ => format!("{bytes} B"),
    }
}
