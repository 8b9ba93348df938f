//! `chorusrun`: starts the workers of a Chorus job on this node, with torchrun's flags and
//! environment contract, on top of [`chorus_launch`].
//!
//! ```text
//! chorusrun --standalone --nproc-per-node 4 ./train --epochs 3
//! chorusrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr node0 --master-port 29500 ./train
//! ```
//!
//! Each worker gets `RANK = node_rank * nproc_per_node + LOCAL_RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `GROUP_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`, `TORCHELASTIC_RESTART_COUNT`, `TORCHELASTIC_MAX_RESTARTS`,
//! `TORCHELASTIC_RUN_ID`, `OMP_NUM_THREADS=1` unless it is set, and its share of the node's GPUs
//! in `CUDA_VISIBLE_DEVICES` and `CHORUS_DEVICE_IDS`. Output lines are prefixed `[rank3]: `.
//! SIGINT, SIGTERM, SIGHUP and SIGQUIT are forwarded to the workers (each runs in a process
//! group of its own, so a terminal's Ctrl-C reaches them once, through chorusrun); a second
//! signal kills them. When a worker fails the others are stopped and, while restarts remain,
//! the group starts again. The exit code is the first failed rank's (`128 + signal` if a signal
//! killed it or interrupted the job, 124 on `--timeout`), and a summary line names the rank.
//! With `--survive` the others run on after a worker dies (for jobs that shrink their
//! communicator and go on), and the job succeeds when every worker no signal killed exited 0.

use std::ffi::OsString;
use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use chorus::env;
use chorus_launch::{launch, Interrupt, LaunchSpec, Output, DEFAULT_RUN_ID};
use clap::Parser;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::EnvFilter;

/// torchrun's default `--master-port`.
const DEFAULT_MASTER_PORT: u16 = 29_500;
/// The longest `nvidia-smi -L` may take.
const NVIDIA_SMI_LIMIT: Duration = Duration::from_secs(10);
/// torchrun's notice when it sets `OMP_NUM_THREADS`.
const OMP_NOTICE: &str = "Setting OMP_NUM_THREADS environment variable for each process to be 1 \
     in default, to avoid your system being overloaded, please further tune the variable for \
     optimal performance in your application as needed.";

/// Starts the workers of a Chorus job on this node (torchrun's flags and environment).
#[derive(Debug, Parser)]
#[command(name = "chorusrun", version)]
struct Args {
    /// Number of nodes in the job (`N`, or `N:N`; elastic `MIN:MAX` ranges are not supported).
    #[arg(long, default_value = "1", value_parser = parse_nnodes)]
    nnodes: usize,

    /// This node's rank, `0..nnodes`.
    #[arg(long = "node-rank", alias = "node_rank", default_value_t = 0)]
    node_rank: usize,

    /// Workers on this node: a number, `gpu` (one per GPU), `cpu` (one per core) or `auto`
    /// (`gpu` if there are GPUs, else `cpu`).
    #[arg(long = "nproc-per-node", alias = "nproc_per_node", default_value = "1")]
    nproc_per_node: String,

    /// Host of rank 0 (where the rendezvous store listens); ignored with --standalone.
    #[arg(
        long = "master-addr",
        alias = "master_addr",
        default_value = chorus::DEFAULT_MASTER_ADDR
    )]
    master_addr: String,

    /// Port of the rendezvous store, the same on every node [default: 29500]; ignored with
    /// --standalone.
    #[arg(long = "master-port", alias = "master_port")]
    master_port: Option<u16>,

    /// Single-node job on 127.0.0.1 with a free port that chorusrun reserves for rank 0's store
    /// until the job ends.
    #[arg(long)]
    standalone: bool,

    /// Restarts of this node's worker group after a failure.
    #[arg(long = "max-restarts", alias = "max_restarts", default_value_t = 0)]
    max_restarts: u32,

    /// Job id, given to the workers as TORCHELASTIC_RUN_ID.
    #[arg(long = "run-id", alias = "run_id", default_value = DEFAULT_RUN_ID)]
    run_id: String,

    /// Also write each rank's output to DIR/attempt_N/rankR.{stdout,stderr}.log (attempt N, rank R).
    #[arg(long = "log-dir", alias = "log_dir", value_name = "DIR")]
    log_dir: Option<PathBuf>,

    /// GPUs on this node [default: the CUDA_VISIBLE_DEVICES entries, else `nvidia-smi -L`].
    #[arg(long = "gpus-per-node", alias = "gpus_per_node")]
    gpus_per_node: Option<usize>,

    /// Let the other workers go on when one dies (not a torchrun flag): for jobs whose
    /// survivors shrink their communicator and finish without it. The exit code is then 0
    /// when every worker that no signal killed exited with 0.
    #[arg(long, conflicts_with = "max_restarts")]
    survive: bool,

    /// Stop every worker after this many seconds (not a torchrun flag) [default: no limit].
    #[arg(long, value_name = "SECONDS", value_parser = parse_seconds)]
    timeout: Option<Duration>,

    /// The worker program and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM [ARGS]"
    )]
    command: Vec<OsString>,
}

fn main() -> ExitCode {
    let filter = EnvFilter::builder()
        .with_default_directive(LevelFilter::WARN.into())
        .with_env_var(env::CHORUS_DEBUG)
        .from_env_lossy();
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .without_time()
        .init();
    match run(Args::parse()) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("chorusrun: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the job; returns chorusrun's exit code.
fn run(args: Args) -> Result<u8, String> {
    if args.standalone && args.nnodes != 1 {
        return Err(format!(
            "--standalone runs a single node, but --nnodes is {}",
            args.nnodes
        ));
    }
    if args.node_rank >= args.nnodes {
        return Err(format!(
            "--node-rank {} is not below --nnodes {}",
            args.node_rank, args.nnodes
        ));
    }
    let devices = node_devices(args.gpus_per_node)?;
    let nproc = nproc_per_node(&args.nproc_per_node, devices.len())?;
    let (program, program_args) = args.command.split_first().ok_or("no program to run")?;

    let interrupt = Interrupt::new();
    forward_signals(interrupt.clone())?;
    let mut spec = LaunchSpec::new(program, nproc)
        .args(program_args)
        .nodes(args.nnodes, args.node_rank)
        .max_restarts(args.max_restarts)
        .run_id(&args.run_id)
        .devices(devices)
        .output(Output::Prefixed)
        .own_process_group(true)
        .wait_all(args.survive)
        .interrupt(interrupt)
        .timeout(args.timeout.unwrap_or(Duration::MAX));
    if args.standalone {
        if args.master_port.is_some() {
            tracing::warn!("--standalone reserves a free port: --master-port is ignored");
        }
        spec = spec.master_addr(chorus::DEFAULT_MASTER_ADDR);
    } else {
        spec = spec
            .master_addr(&args.master_addr)
            .master_port(args.master_port.unwrap_or(DEFAULT_MASTER_PORT));
    }
    if let Some(dir) = &args.log_dir {
        spec = spec.log_dir(dir);
    }
    if std::env::var_os(env::OMP_NUM_THREADS).is_none() {
        eprintln!("{OMP_NOTICE}");
        spec = spec.env(env::OMP_NUM_THREADS, "1");
    }

    let report = launch(&spec).map_err(|e| e.to_string())?;
    if args.survive && !report.success() && report.survived() {
        eprintln!(
            "chorusrun: the job went on without ranks {:?}, which a signal killed; the others \
             succeeded in {:.2}s",
            report.lost(),
            report.elapsed.as_secs_f64()
        );
        return Ok(0);
    }
    if !report.success() {
        eprintln!("chorusrun: {}", report.summary());
    }
    Ok(u8::try_from(report.exit_code()).unwrap_or(1))
}

/// Forwards SIGINT, SIGTERM, SIGHUP and SIGQUIT to the workers through `interrupt`.
///
/// `signal-hook` installs the handlers safely (its handler only writes to a pipe that a
/// thread reads), so chorusrun needs no `unsafe`; the launcher signals the workers.
fn forward_signals(interrupt: Interrupt) -> Result<(), String> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM};
    use signal_hook::iterator::Signals;
    let mut signals = Signals::new([SIGINT, SIGTERM, SIGHUP, SIGQUIT])
        .map_err(|e| format!("cannot install signal handlers: {e}"))?;
    std::thread::Builder::new()
        .name("chorusrun-signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                interrupt.raise(sig);
            }
        })
        .map_err(|e| format!("cannot start the signal thread: {e}"))?;
    Ok(())
}

/// `--nnodes N` or `N:N`.
fn parse_nnodes(s: &str) -> Result<usize, String> {
    let (min, max) = s.split_once(':').unwrap_or((s, s));
    let parse = |v: &str| v.trim().parse::<usize>().map_err(|e| format!("{v:?}: {e}"));
    let (min, max) = (parse(min)?, parse(max)?);
    if min != max {
        return Err(format!(
            "elastic ranges ({s}) are not supported: give a fixed number of nodes"
        ));
    }
    if min == 0 {
        return Err("need at least one node".into());
    }
    Ok(min)
}

/// `--timeout SECONDS`.
fn parse_seconds(s: &str) -> Result<Duration, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(Duration::from_secs_f64(v)),
        _ => Err(format!("{s:?} is not a positive number of seconds")),
    }
}

/// `--nproc-per-node`: a number, `gpu`, `cpu` or `auto`.
fn nproc_per_node(spec: &str, gpus: usize) -> Result<usize, String> {
    let cpus = || std::thread::available_parallelism().map_or(1, usize::from);
    let n = match spec {
        "gpu" if gpus == 0 => {
            return Err("--nproc-per-node gpu, but no GPU was found (see --gpus-per-node)".into())
        }
        "gpu" => gpus,
        "cpu" => cpus(),
        "auto" if gpus > 0 => gpus,
        "auto" => cpus(),
        n => n.parse().map_err(|e| {
            format!("--nproc-per-node {n:?}: {e} (expected a number, gpu, cpu or auto)")
        })?,
    };
    if n == 0 {
        return Err("--nproc-per-node must be at least 1".into());
    }
    Ok(n)
}

/// The GPU ids of this node: the first `--gpus-per-node` entries of `CUDA_VISIBLE_DEVICES` (or
/// `0..N` when it is unset), else all of its entries, else one per GPU `nvidia-smi -L` lists.
fn node_devices(gpus_per_node: Option<usize>) -> Result<Vec<String>, String> {
    let visible = std::env::var(env::CUDA_VISIBLE_DEVICES)
        .ok()
        .map(|v| visible_devices(&v));
    match (gpus_per_node, visible) {
        (Some(n), Some(ids)) if ids.len() < n => Err(format!(
            "--gpus-per-node {n}, but CUDA_VISIBLE_DEVICES lists only {} GPUs ({})",
            ids.len(),
            ids.join(",")
        )),
        (Some(n), Some(ids)) => Ok(ids[..n].to_vec()),
        (Some(n), None) => Ok((0..n).map(|i| i.to_string()).collect()),
        (None, Some(ids)) => Ok(ids),
        (None, None) => Ok((0..count_gpus()).map(|i| i.to_string()).collect()),
    }
}

/// The entries of a `CUDA_VISIBLE_DEVICES` value that CUDA uses: up to the first invalid one
/// (`-1`, `NoDevFiles`, an empty entry).
fn visible_devices(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(str::trim)
        .take_while(|id| {
            !id.is_empty()
                && (id.bytes().all(|b| b.is_ascii_digit())
                    || id.starts_with("GPU-")
                    || id.starts_with("MIG-"))
        })
        .map(String::from)
        .collect()
}

/// The number of GPUs `nvidia-smi -L` lists; 0 when it is missing, fails or hangs.
fn count_gpus() -> usize {
    let child = Command::new("nvidia-smi")
        .arg("-L")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn();
    let Ok(mut child) = child else {
        tracing::debug!("nvidia-smi not found: no GPUs");
        return 0;
    };
    let mut stdout = child.stdout.take();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(out) = stdout.as_mut() {
            let _ = out.read_to_string(&mut text);
        }
        text
    });
    let deadline = Instant::now() + NVIDIA_SMI_LIMIT;
    let ok = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status.success(),
            Ok(None) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            _ => {
                tracing::warn!("nvidia-smi -L did not finish: assuming no GPUs");
                let _ = child.kill();
                let _ = child.wait();
                break false;
            }
        }
    };
    let text = reader.join().unwrap_or_default();
    if !ok {
        return 0;
    }
    text.lines().filter(|l| l.starts_with("GPU ")).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_like_torchrun() {
        let args = Args::try_parse_from([
            "chorusrun",
            "--nnodes=2",
            "--node_rank",
            "1",
            "--nproc_per_node=4",
            "--master_addr",
            "10.0.0.1",
            "--master-port",
            "29400",
            "--max-restarts",
            "3",
            "--run_id",
            "job",
            "train",
            "--lr",
            "0.1",
            "-v",
        ])
        .unwrap();
        assert_eq!((args.nnodes, args.node_rank), (2, 1));
        assert_eq!(args.nproc_per_node, "4");
        assert_eq!(args.master_addr, "10.0.0.1");
        assert_eq!(args.master_port, Some(29_400));
        assert_eq!((args.max_restarts, args.run_id.as_str()), (3, "job"));
        assert_eq!(args.command, ["train", "--lr", "0.1", "-v"]);

        let args = Args::try_parse_from(["chorusrun", "--standalone", "prog", "--nnodes", "9"]);
        let args = args.unwrap();
        assert!(args.standalone);
        assert_eq!(args.nnodes, 1, "flags after the program belong to it");
        assert_eq!(args.command, ["prog", "--nnodes", "9"]);

        assert!(Args::try_parse_from(["chorusrun", "--standalone"]).is_err());
        assert!(Args::try_parse_from(["chorusrun", "--nnodes", "1:4", "p"]).is_err());
        assert_eq!(
            Args::try_parse_from(["chorusrun", "--nnodes", "3:3", "p"])
                .unwrap()
                .nnodes,
            3
        );
        assert!(Args::try_parse_from(["chorusrun", "--timeout", "-1", "p"]).is_err());
    }

    #[test]
    fn nproc_specs() {
        assert_eq!(nproc_per_node("3", 0), Ok(3));
        assert_eq!(nproc_per_node("gpu", 8), Ok(8));
        assert_eq!(nproc_per_node("auto", 2), Ok(2));
        assert!(nproc_per_node("auto", 0).unwrap() >= 1);
        assert!(nproc_per_node("cpu", 8).unwrap() >= 1);
        assert!(nproc_per_node("gpu", 0).unwrap_err().contains("no GPU"));
        assert!(nproc_per_node("0", 0).unwrap_err().contains("at least 1"));
        assert!(nproc_per_node("many", 0).unwrap_err().contains("many"));
    }

    #[test]
    fn visible_device_lists() {
        assert_eq!(visible_devices("0,1,2"), ["0", "1", "2"]);
        assert_eq!(visible_devices(" 4, 5 "), ["4", "5"]);
        assert_eq!(visible_devices("GPU-1a2b,MIG-3c"), ["GPU-1a2b", "MIG-3c"]);
        assert_eq!(visible_devices("2,-1,3"), ["2"]);
        assert!(visible_devices("").is_empty());
        assert!(visible_devices("NoDevFiles").is_empty());
    }
}
