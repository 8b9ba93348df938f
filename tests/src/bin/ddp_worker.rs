//! The data-parallel test worker: one rank of a `chorus::ddp` test, checking
//! every averaged gradient against the exact expectation and exiting
//! non-zero with a message on the first mismatch.

use std::process::ExitCode;

use chorus::ddp::{Compression, Ddp, DdpOptions, ParamSpec};
use chorus::{Communicator, DType};

fn main() -> ExitCode {
    chorus_tests::init_logging();
    let scenario = std::env::args().nth(1).unwrap_or_default();
    let result = Communicator::from_env()
        .map_err(|e| e.to_string())
        .and_then(|comm| match scenario.as_str() {
            "reduce" => reduce(&comm),
            "mismatch" => mismatch(&comm),
            other => Err(format!("unknown scenario '{other}'")),
        });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ddp worker error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Parameter lengths: three buckets with the small caps below ([5, 4], [3, 2], [1, 0]).
const LENS: [usize; 6] = [300, 5, 1000, 7, 64, 200];

fn specs() -> Vec<ParamSpec> {
    LENS.iter()
        .enumerate()
        .map(|(i, &len)| ParamSpec::new(format!("p{i}"), len, DType::F32))
        .collect()
}

/// Caps of 1 KiB (first) and 2 KiB.
fn small_buckets() -> DdpOptions {
    DdpOptions {
        bucket_cap_mb: 2.0 / 1024.0,
        first_bucket_cap_mb: 1.0 / 1024.0,
        ..DdpOptions::from_env().unwrap_or_default()
    }
}

/// Rank `rank`'s gradient element `j` of parameter `p`: `(rank + 1) * base`.
fn grad_value(rank: usize, p: usize, j: usize) -> f32 {
    ((rank + 1) * ((p + 1) * 10 + j % 13)) as f32
}

/// The average over `world` ranks of `grad_value` (times `scale` micro-steps).
fn mean_value(world: usize, p: usize, j: usize, scale: f32) -> f32 {
    let sum: f32 = (0..world).map(|r| grad_value(r, p, j)).sum();
    scale * sum / world as f32
}

/// One backward pass: every parameter in `order` gets `grad_value` added and is marked ready.
fn backward(ddp: &mut Ddp<'_>, rank: usize, order: &[usize]) -> Result<(), String> {
    for &p in order {
        let g = ddp.grad_mut::<f32>(p).map_err(|e| e.to_string())?;
        for (j, v) in g.iter_mut().enumerate() {
            *v += grad_value(rank, p, j);
        }
        ddp.mark_ready(p).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Compares every gradient with `want(p, j)` to a relative tolerance; unlisted parameters must be zero.
fn expect(
    ddp: &Ddp<'_>,
    what: &str,
    tol: f32,
    want: impl Fn(usize, usize) -> f32,
) -> Result<(), String> {
    for p in 0..LENS.len() {
        let g = ddp.grad::<f32>(p).map_err(|e| e.to_string())?;
        for (j, &v) in g.iter().enumerate() {
            let w = want(p, j);
            if (v - w).abs() > tol * w.abs().max(1.0) {
                return Err(format!("{what}: p{p}[{j}] = {v}, expected {w}"));
            }
        }
    }
    Ok(())
}

fn reduce(comm: &Communicator) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let err = |e: chorus::Error| e.to_string();
    let mut ddp = Ddp::new(comm, specs(), small_buckets()).map_err(err)?;
    if ddp.buckets() != [vec![5, 4], vec![3, 2], vec![1, 0]] {
        return Err(format!("unexpected buckets {:?}", ddp.buckets()));
    }
    // Parameters: every rank ends with rank 0's values.
    let mut values: Vec<Vec<f32>> = LENS.iter().map(|&n| vec![rank as f32 + 0.5; n]).collect();
    let mut views: Vec<&mut [f32]> = values.iter_mut().map(|v| &mut v[..]).collect();
    ddp.broadcast_parameters(&mut views).map_err(err)?;
    if values.iter().flatten().any(|&v| v != 0.5) {
        return Err("broadcast_parameters did not copy rank 0's values".into());
    }
    // Ranks produce gradients in different orders; buckets still launch in one order.
    let forward: Vec<usize> = (0..LENS.len()).collect();
    let reverse: Vec<usize> = forward.iter().rev().copied().collect();
    let order = if rank % 2 == 0 { &forward } else { &reverse };
    for step in 0..3 {
        ddp.zero_grad().map_err(err)?;
        backward(&mut ddp, rank, order)?;
        ddp.finish().map_err(err)?;
        expect(&ddp, &format!("step {step}"), 1e-6, |p, j| {
            mean_value(world, p, j, 1.0)
        })?;
    }
    // Three micro-steps, two without synchronisation: the sum is averaged once.
    ddp.zero_grad().map_err(err)?;
    for _ in 0..2 {
        ddp.no_sync(|ddp| {
            backward(ddp, rank, order)?;
            ddp.finish().map_err(err)
        })?;
    }
    backward(&mut ddp, rank, order)?;
    ddp.finish().map_err(err)?;
    expect(&ddp, "no_sync", 1e-6, |p, j| mean_value(world, p, j, 3.0))?;
    // A parameter never marked ready is named.
    ddp.zero_grad().map_err(err)?;
    backward(&mut ddp, rank, &[0, 2, 3, 4, 5])?;
    match ddp.finish() {
        Err(e)
            if e.to_string()
                .contains("never marked ready in this step: p1 ") => {}
        other => {
            return Err(format!(
                "unused p1: expected an error naming it, got {other:?}"
            ))
        }
    }
    drop(ddp);
    // ... or, with find_unused_parameters, taken as zero.
    let options = DdpOptions {
        find_unused_parameters: true,
        ..small_buckets()
    };
    let mut ddp = Ddp::new(comm, specs(), options).map_err(err)?;
    ddp.grad_mut::<f32>(1).map_err(err)?.fill(99.0);
    backward(&mut ddp, rank, &[5, 4, 3, 2, 0])?;
    ddp.finish().map_err(err)?;
    expect(&ddp, "find_unused", 1e-6, |p, j| {
        if p == 1 {
            0.0
        } else {
            mean_value(world, p, j, 1.0)
        }
    })?;
    drop(ddp);
    // 16-bit compression: the same averages to the hooks' precision.
    for (compression, tol) in [(Compression::Bf16, 1e-2), (Compression::F16, 2e-3)] {
        let options = DdpOptions {
            compression,
            ..small_buckets()
        };
        let mut ddp = Ddp::new(comm, specs(), options).map_err(err)?;
        backward(&mut ddp, rank, order)?;
        ddp.finish().map_err(err)?;
        expect(&ddp, &format!("{compression:?}"), tol, |p, j| {
            mean_value(world, p, j, 1.0)
        })?;
    }
    println!("ddp reduce ok");
    Ok(())
}

/// Rank `world - 1` names parameter 3 differently: every rank's `Ddp::new` fails naming it.
fn mismatch(comm: &Communicator) -> Result<(), String> {
    let mut specs = specs();
    if comm.rank() + 1 == comm.world_size() {
        specs[3].name = "other".into();
    }
    match Ddp::new(comm, specs, DdpOptions::default()) {
        Ok(_) => Err("different parameter lists were accepted".into()),
        Err(e) => {
            let text = e.to_string();
            let last = comm.world_size() - 1;
            let want = [
                "parameter #3".to_string(),
                "rank 0 has 'p3' (7 x float)".to_string(),
                format!("rank {last} has 'other' (7 x float)"),
            ];
            match want.iter().find(|w| !text.contains(w.as_str())) {
                None => {
                    println!("mismatch reported: {text}");
                    Ok(())
                }
                Some(missing) => Err(format!("error lacks \"{missing}\": {text}")),
            }
        }
    }
}
