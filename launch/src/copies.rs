//! `-np W`: the running program started again as the `W` ranks of a job on this host.

use std::ffi::OsString;
use std::time::Duration;

use crate::{launch, LaunchError, LaunchSpec, Output};

/// Runs `np` copies of the running program on this host as one job and waits for them: the
/// `-np W` of the perf tools and `train`.
///
/// Every copy gets `args` and torchrun's variables, so it sees `RANK` and runs as one rank;
/// rank 0's output is shown unprefixed (one table, as nccl-tests under mpirun), the others'
/// is kept for the error. `timeout` bounds the whole job.
///
/// Fails with [`LaunchError::InvalidWorldSize`] when `np` is 0,
/// [`LaunchError::CurrentExe`] when the program cannot find its own file, as [`launch`]
/// fails, and with [`LaunchError::Failed`] when the job does not succeed (a rank failed, the
/// job timed out); its message is the launch's summary and the stderr of the rank that failed
/// first.
pub fn run_copies(
    np: usize,
    args: impl IntoIterator<Item = OsString>,
    timeout: Duration,
) -> Result<(), LaunchError> {
    if np == 0 {
        return Err(LaunchError::InvalidWorldSize(0));
    }
    let exe = std::env::current_exe().map_err(LaunchError::CurrentExe)?;
    let spec = LaunchSpec::new(exe, np)
        .args(args)
        .output(Output::RankZero)
        .timeout(timeout);
    let report = launch(&spec)?;
    if report.success() {
        Ok(())
    } else {
        Err(LaunchError::Failed(Box::new(report)))
    }
}
