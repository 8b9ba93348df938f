//! Scenarios that lose ranks and go on by shrinking the communicator.
//!
//! - `shrink VICTIMS`: for each job rank in the comma-separated VICTIMS in turn, the ranks
//!   all-reduce until the victim kills itself; the survivors shrink, check the new
//!   communicator's shape and run every collective on it, then go on to the next victim.
//!   Every third rank computes (sleeps) between calls, so ranks notice a death in different
//!   calls. After the first shrink each survivor drops the old communicator and checks that
//!   it holds no more files and threads than when it joined.
//! - `shrink_late`: rank 3 of 4 dies; rank 2 comes to the shrink after the timeout and is
//!   told it was left out, while ranks 0 and 1 go on as two.
//! - `shrink_exclude`: no rank dies; rank 1 leaves the others without shrinking, ranks 0 and
//!   2 exclude 1 and 3, and rank 3, which excludes only 1, is told that rank 0's list named
//!   it.
//!
//! - `shrink_chaos SEED`: one or two ranks drawn from SEED die at moments drawn from it
//!   (before a step, as a shrink starts, as one ends); the others shrink after every
//!   failure until they have run 20 steps, each checking that the ranks agree on who is in
//!   and on an all-reduce of drawn size (`tools/shrink-chaos.sh` runs it by the hundred).
//!
//! Lines for the test: `shrunk ROUND: rank R of W` and `excluded: coordinator C named_by B`.

use std::time::Duration;

use chorus::{Communicator, Error, ReduceOp};
use chorus_tests::draw;
use nix::sys::signal::{raise, Signal};

use super::{all_reduce_matrix, broadcast_matrix, connect, more_collectives};

/// Element counts every collective runs with after a shrink.
const COUNTS: [usize; 3] = [1, 1000, 40_000];
/// All-reduces the victim runs before it dies.
const BEFORE_DEATH: usize = 5;

pub fn survive(victims: &str) -> Result<(), String> {
    let victims: Vec<usize> = victims
        .split(',')
        .map(|v| v.parse().map_err(|e| format!("bad victim {v}: {e}")))
        .collect::<Result<_, _>>()?;
    let me = job_rank()?;
    let mut comm = connect()?;
    let world = comm.world_size();
    let joined = holdings();
    let mut alive: Vec<usize> = (0..world).collect();
    for (round, &victim) in victims.iter().enumerate() {
        until_death(&comm, me, victim, &alive)?;
        alive.retain(|&r| r != victim);
        let shrunk = comm
            .shrink(&[])
            .map_err(|e| format!("shrink {round}: {e}"))?;
        let want = alive.iter().position(|&r| r == me);
        if (Some(shrunk.rank()), shrunk.world_size()) != (want, alive.len()) {
            return Err(format!(
                "shrink {round}: rank {} of {}, expected {want:?} of {} (survivors {alive:?})",
                shrunk.rank(),
                shrunk.world_size(),
                alive.len()
            ));
        }
        println!(
            "shrunk {round}: rank {} of {}",
            shrunk.rank(),
            shrunk.world_size()
        );
        comm = shrunk;
        every_collective(&comm).map_err(|e| format!("after shrink {round}: {e}"))?;
        if round == 0 {
            freed(&comm, joined)?;
        }
    }
    println!("survived {}", victims.len());
    Ok(())
}

pub fn late() -> Result<(), String> {
    let me = job_rank()?;
    let comm = connect()?;
    let timeout = comm.config().timeout;
    until_death(&comm, me, 3, &[0, 1, 2, 3])?;
    if me == 2 {
        std::thread::sleep(timeout + Duration::from_secs(1));
    }
    match comm.shrink(&[]) {
        Ok(shrunk) if me != 2 && shrunk.world_size() == 2 => {
            println!(
                "shrunk 0: rank {} of {}",
                shrunk.rank(),
                shrunk.world_size()
            );
            every_collective(&shrunk)
        }
        Ok(shrunk) => Err(format!(
            "rank {me} is in a shrunk communicator of {}",
            shrunk.world_size()
        )),
        Err(e) => excluded(e),
    }
}

pub fn exclude() -> Result<(), String> {
    let me = job_rank()?;
    let comm = connect()?;
    every_collective(&comm)?;
    let list: &[usize] = match me {
        1 => {
            // Left out alive: it stays a moment, so the others cannot take it for dead.
            std::thread::sleep(Duration::from_secs(2));
            return Ok(());
        }
        3 => &[1],
        _ => &[1, 3],
    };
    match comm.shrink(list) {
        Ok(shrunk) => {
            println!(
                "shrunk 0: rank {} of {}",
                shrunk.rank(),
                shrunk.world_size()
            );
            every_collective(&shrunk)
        }
        Err(e) => excluded(e),
    }
}

/// Steps every survivor completes in `shrink_chaos`.
const CHAOS_STEPS: usize = 20;
/// Shrinks one survivor tries in a row before it gives up.
const CHAOS_SHRINKS: usize = 8;

pub fn chaos(seed: &str) -> Result<(), String> {
    let seed: u64 = seed.parse().map_err(|e| format!("bad seed {seed}: {e}"))?;
    let me = job_rank()?;
    let mut comm = connect()?;
    let world = comm.world_size() as u64;
    // Rank 1 + draw(seed, 0) % (world - 1) past the first victim, so the two differ.
    let first = draw(seed, 0) % world;
    let second =
        (draw(seed, 1) % 2 == 0).then(|| (first + 1 + draw(seed, 2) % (world - 1)) % world);
    // The first dies before a step; the second as the shrink after it starts, as it ends, or
    // before the next step, a few milliseconds later (inside the shrink's agreement or set-up).
    let dies_at = draw(seed, 3) % CHAOS_STEPS as u64;
    let moment = match me as u64 {
        r if r == first => Some((dies_at, Duration::ZERO)),
        r if Some(r) == second => Some((
            dies_at + 1 + draw(seed, 4) % 3,
            Duration::from_micros(draw(seed, 5) % 5000),
        )),
        _ => None,
    };
    let mut ticks = 0u64;
    let mut tick = || {
        if let Some((_, after)) = moment.filter(|&(at, _)| at == ticks) {
            if after.is_zero() {
                let _ = raise(Signal::SIGKILL);
            }
            std::thread::spawn(move || {
                std::thread::sleep(after);
                let _ = raise(Signal::SIGKILL);
            });
        }
        ticks += 1;
    };
    let mut steps = 0;
    while steps < CHAOS_STEPS {
        tick();
        match chaos_step(&comm, me, seed, steps) {
            Ok(()) => steps += 1,
            Err(Some(wrong)) => return Err(format!("WRONG: {wrong}")),
            Err(None) => {
                let mut tries = 0;
                comm = loop {
                    tick();
                    match comm.shrink(&[]) {
                        Ok(shrunk) => break shrunk,
                        Err(e @ Error::Excluded { .. }) => return excluded(e),
                        Err(e) if tries + 1 < CHAOS_SHRINKS => {
                            eprintln!("shrink failed, again: {e}");
                            tries += 1;
                        }
                        Err(e) => return Err(format!("shrink: {e}")),
                    }
                };
                tick();
            }
        }
    }
    println!("chaos done: rank {} of {}", comm.rank(), comm.world_size());
    Ok(())
}

/// One step: the ranks gather who is in, which must be ascending with this rank in its
/// place, then all-reduce their job ranks plus one over a drawn size. `Err(None)` when a call
/// fails, `Err(Some(what))` when a result is wrong.
fn chaos_step(
    comm: &Communicator,
    me: usize,
    seed: u64,
    step: usize,
) -> Result<(), Option<String>> {
    let mut members = vec![0u64; comm.world_size()];
    if let Err(e) = comm.all_gather(&[me as u64], &mut members) {
        eprintln!("step {step}: {e}");
        return Err(None);
    }
    let ascending = members.windows(2).all(|w| w[0] < w[1]);
    if !ascending || members.get(comm.rank()) != Some(&(me as u64)) {
        return Err(Some(format!(
            "rank {} of {} sees members {members:?}",
            comm.rank(),
            comm.world_size()
        )));
    }
    let count = [1, 100, 4096, 70_000][(draw(seed, 100 + step as u64) % 4) as usize];
    let mut buf = vec![me as f64 + 1.0; count];
    if let Err(e) = comm.all_reduce(&mut buf, ReduceOp::Sum) {
        eprintln!("step {step}: {e}");
        return Err(None);
    }
    let want: f64 = members.iter().map(|&r| r as f64 + 1.0).sum();
    match buf.iter().position(|&x| x != want) {
        None => Ok(()),
        Some(i) => Err(Some(format!(
            "element {i} of {count} is {}, not {want} (members {members:?})",
            buf[i]
        ))),
    }
}

/// Reports how this rank was left out, or fails with any other error.
fn excluded(e: Error) -> Result<(), String> {
    match e {
        Error::Excluded {
            coordinator,
            named_by,
            ..
        } => {
            println!("excluded: coordinator {coordinator} named_by {named_by:?}");
            Ok(())
        }
        other => Err(format!("shrink: {other}")),
    }
}

/// All-reduces the sum of the job ranks in `alive` until one fails; `victim` kills itself
/// at its turn.
fn until_death(
    comm: &Communicator,
    me: usize,
    victim: usize,
    alive: &[usize],
) -> Result<(), String> {
    let want: f64 = alive.iter().map(|&r| r as f64 + 1.0).sum();
    for i in 0..100_000 {
        if me == victim && i == BEFORE_DEATH {
            raise(Signal::SIGKILL).map_err(|e| e.to_string())?;
        }
        if me % 3 == 1 {
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut buf = vec![me as f64 + 1.0; 1000];
        match comm.all_reduce(&mut buf, ReduceOp::Sum) {
            Ok(()) if buf.iter().all(|&x| x == want) => {}
            Ok(()) => return Err(format!("all-reduce {i}: {} where {want} was due", buf[0])),
            Err(e) => {
                eprintln!("noticed in all-reduce {i}: {e}");
                return Ok(());
            }
        }
    }
    Err(format!("rank {victim} never died"))
}

fn every_collective(comm: &Communicator) -> Result<(), String> {
    all_reduce_matrix(comm, &COUNTS)?;
    broadcast_matrix(comm, &COUNTS)?;
    more_collectives(comm, &COUNTS)?;
    comm.barrier().map_err(|e| e.to_string())?;
    // A communicator made from it works too.
    let dup = comm.dup().map_err(|e| format!("dup: {e}"))?;
    let mut ranks = [dup.rank() as u64];
    dup.all_reduce(&mut ranks, ReduceOp::Sum)
        .map_err(|e| format!("all-reduce on a dup: {e}"))?;
    let world = dup.world_size() as u64;
    match ranks[0] == world * (world - 1) / 2 {
        true => Ok(()),
        false => Err(format!("all-reduce on a dup gave {}", ranks[0])),
    }
}

fn job_rank() -> Result<usize, String> {
    let rank = std::env::var(chorus::env::RANK).map_err(|e| e.to_string())?;
    rank.parse().map_err(|e| format!("RANK={rank}: {e}"))
}

/// Checks that the old communicator let go of its shared-memory region, and that this
/// process holds no more files and threads than `joined` (what it held when it joined), once
/// the old communicator's threads have had up to ten seconds to end. The new communicator's
/// rank 0 also serves its store (the others' connections), so it is spared the count.
fn freed(comm: &Communicator, joined: (usize, usize)) -> Result<(), String> {
    let maps = std::fs::read_to_string("/proc/self/maps").map_err(|e| e.to_string())?;
    let mut regions: Vec<&str> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|path| {
            // Regions are named chorus-PID-...
            let name = path.rsplit('/').next().unwrap_or("");
            name.strip_prefix("chorus-")
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .collect();
    regions.sort_unstable();
    regions.dedup();
    if regions.len() > 1 {
        return Err(format!("shared-memory regions still mapped: {regions:?}"));
    }
    let start = std::time::Instant::now();
    loop {
        let now = holdings();
        if comm.rank() == 0 || (now.0 <= joined.0 && now.1 <= joined.1) {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(10) {
            return Err(format!(
                "after the first shrink, files and threads {now:?}; when joined {joined:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Open files and threads of this process.
fn holdings() -> (usize, usize) {
    let count = |dir: &str| std::fs::read_dir(dir).map_or(0, |d| d.count());
    (count("/proc/self/fd"), count("/proc/self/task"))
}
