//! The test worker: one rank of a multi-process test, started by the harness
//! with torchrun's environment contract. It runs a scenario, checks every
//! result against exactly computed expectations, prints a digest of each
//! output (so the harness can check that all ranks hold identical bytes),
//! and exits non-zero with a message on the first mismatch or error.

use std::process::ExitCode;

use chorus::pattern::{digest, Value};
use chorus::{Communicator, DType, Element, ReduceOp};
use chorus_tests::Case;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("CHORUS_DEBUG"))
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("worker error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<(), String> {
    let scenario = args.first().map(String::as_str).unwrap_or("");
    let counts = || -> Result<Vec<usize>, String> {
        let list = args.get(1).ok_or("missing count list")?;
        list.split(',')
            .map(|c| c.parse().map_err(|e| format!("bad count {c}: {e}")))
            .collect()
    };
    match scenario {
        "all_reduce" => all_reduce_matrix(&connect()?, &counts()?),
        "broadcast" => broadcast_matrix(&connect()?, &counts()?),
        "barrier" => barrier_rounds(&connect()?, args.get(1).ok_or("missing directory")?),
        "connect" => connect().map(|_| ()),
        "mismatched_length" => mismatched_length(&connect()?),
        other => Err(format!("unknown scenario '{other}'")),
    }
}

fn connect() -> Result<Communicator, String> {
    Communicator::from_env().map_err(|e| e.to_string())
}

/// Every dtype x op x count, in place and out of place.
fn all_reduce_matrix(comm: &Communicator, counts: &[usize]) -> Result<(), String> {
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            for &count in counts {
                for in_place in [true, false] {
                    let case = Case {
                        dtype,
                        op,
                        count,
                        in_place,
                        root: 0,
                    };
                    dispatch(comm, &case)?;
                }
            }
        }
    }
    Ok(())
}

fn broadcast_matrix(comm: &Communicator, counts: &[usize]) -> Result<(), String> {
    for root in 0..comm.world_size() {
        for dtype in [DType::F32, DType::U8, DType::BF16, DType::I64] {
            for &count in counts {
                for in_place in [true, false] {
                    let case = Case {
                        dtype,
                        op: ReduceOp::Sum,
                        count,
                        in_place,
                        root,
                    };
                    broadcast_case(comm, &case)?;
                }
            }
        }
    }
    Ok(())
}

fn dispatch(comm: &Communicator, case: &Case) -> Result<(), String> {
    chorus::with_dtype!(case.dtype, all_reduce_case, comm, case)
}

fn broadcast_case(comm: &Communicator, case: &Case) -> Result<(), String> {
    chorus::with_dtype!(case.dtype, broadcast_typed, comm, case)
}

fn all_reduce_case<T: Element + Value>(comm: &Communicator, case: &Case) -> Result<(), String> {
    let world = comm.world_size();
    exercise(
        comm,
        case,
        |input, output| match input {
            None => comm.all_reduce(output, case.op),
            Some(input) => comm.all_reduce_into(input, output, case.op),
        },
        |i, got: T| T::check(got, i, world, case.op),
    )
}

fn broadcast_typed<T: Element + Value>(comm: &Communicator, case: &Case) -> Result<(), String> {
    exercise(
        comm,
        case,
        |input, output| match input {
            None => comm.broadcast(output, case.root),
            Some(input) => comm.broadcast_into(input, output, case.root),
        },
        |i, got: T| {
            let want = T::input(case.root, i, ReduceOp::Sum);
            match bytemuck::bytes_of(&got) == bytemuck::bytes_of(&want) {
                true => Ok(()),
                false => Err(format!("got {got:?}, root has {want:?}")),
            }
        },
    )
}

/// Runs one case: this rank's input (in place, or into a poisoned output),
/// the call, a check of every element, and the output's digest.
fn exercise<T: Element + Value>(
    comm: &Communicator,
    case: &Case,
    call: impl FnOnce(Option<&[T]>, &mut [T]) -> chorus::Result<()>,
    check: impl Fn(usize, T) -> Result<(), String>,
) -> Result<(), String> {
    let input: Vec<T> = (0..case.count)
        .map(|i| T::input(comm.rank(), i, case.op))
        .collect();
    let mut output = if case.in_place {
        input.clone()
    } else {
        vec![T::poison(); case.count]
    };
    let input = (!case.in_place).then_some(input.as_slice());
    call(input, &mut output).map_err(|e| format!("{case}: {e}"))?;
    for (i, got) in output.iter().enumerate() {
        check(i, *got).map_err(|why| format!("{case}: element {i}: {why}"))?;
    }
    println!(
        "digest {case} {:016x}",
        digest(bytemuck::cast_slice(&output))
    );
    Ok(())
}

/// Each round every rank marks its arrival in `dir`, enters the barrier, and
/// checks on leaving that every rank's mark is there.
fn barrier_rounds(comm: &Communicator, dir: &str) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    for round in 0..5 {
        // Stagger arrivals so that some ranks reach the barrier well before others.
        std::thread::sleep(std::time::Duration::from_millis(
            ((rank * 7 + round * 3) % 5) as u64 * 20,
        ));
        let mark = std::path::Path::new(dir).join(format!("round{round}-rank{rank}"));
        std::fs::write(&mark, b"").map_err(|e| format!("cannot write {}: {e}", mark.display()))?;
        comm.barrier().map_err(|e| e.to_string())?;
        for peer in 0..world {
            let theirs = std::path::Path::new(dir).join(format!("round{round}-rank{peer}"));
            if !theirs.exists() {
                return Err(format!(
                    "round {round}: left the barrier before rank {peer} arrived"
                ));
            }
        }
    }
    println!("barrier ok");
    Ok(())
}

/// Rank 0 passes one element more than the others: every rank must fail with
/// an error, and the error seen by a receiver of rank 0's data names the sizes.
fn mismatched_length(comm: &Communicator) -> Result<(), String> {
    let count = if comm.rank() == 0 { 1001 } else { 1000 };
    let mut buf = vec![1.0f32; count];
    match comm.all_reduce(&mut buf, ReduceOp::Sum) {
        Ok(()) => Err("a mismatched all-reduce succeeded".into()),
        Err(e) => {
            println!("expected error: {e}");
            Ok(())
        }
    }
}
