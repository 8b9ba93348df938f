//! `ncclComm`: a Chorus communicator behind NCCL's handle, set up at once or in the
//! background (a non-blocking config, or inside a group), and the errors its calls report.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;

use chorus::{Communicator, Config};

use crate::abi::NcclResult;
use crate::id::Rendezvous;
use crate::lock;
use crate::premul::Ops;

/// An error as NCCL reports it: the result code and the text `ncclGetLastError` gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The code the call returns.
    pub code: NcclResult,
    /// What went wrong, naming the call and what was wrong with it.
    pub text: String,
}

impl Failure {
    /// A failure of `code` saying `text`.
    pub fn new(code: NcclResult, text: impl Into<String>) -> Failure {
        Failure {
            code,
            text: text.into(),
        }
    }

    /// An argument the caller got wrong.
    pub fn argument(text: impl Into<String>) -> Failure {
        Failure::new(NcclResult::InvalidArgument, text)
    }

    /// A call this library cannot honour, or one made at the wrong time.
    pub fn usage(text: impl Into<String>) -> Failure {
        Failure::new(NcclResult::InvalidUsage, text)
    }
}

impl From<chorus::Error> for Failure {
    fn from(e: chorus::Error) -> Failure {
        Failure::new(code(&e), e.to_string())
    }
}

/// The NCCL result closest to Chorus's error.
fn code(e: &chorus::Error) -> NcclResult {
    use chorus::Error::*;
    match e {
        InvalidArgument(_) | Config { .. } | Kernel(_) => NcclResult::InvalidArgument,
        Mismatch(_) => NcclResult::InvalidUsage,
        Timeout(_) => NcclResult::Timeout,
        Transport { .. } | Store(_) | Aborted(_) | Excluded { .. } => NcclResult::RemoteError,
        Resource { .. } => NcclResult::SystemError,
        Internal(_) => NcclResult::InternalError,
        #[cfg(feature = "cuda")]
        Cuda(chorus::cuda::CudaError::WrongDevice { .. }) => NcclResult::InvalidArgument,
        #[cfg(feature = "cuda")]
        Cuda(_) => NcclResult::UnhandledCudaError,
        Broken(inner) => code(inner),
        #[allow(unreachable_patterns)]
        _ => NcclResult::InternalError,
    }
}

/// A call's outcome at the C boundary.
pub type Outcome<T = ()> = Result<T, Failure>;

/// A communicator once set up: Chorus's, and where every rank has a CUDA device (and the
/// library was built with the `cuda` feature), the device communicator that orders calls on
/// the caller's streams.
pub struct Joined {
    /// The host communicator.
    pub communicator: Communicator,
    /// Calls ordered on CUDA streams, where every rank had a device when it was made.
    #[cfg(feature = "cuda")]
    pub(crate) ordered: Option<crate::ordered::Ordered>,
}

impl Joined {
    /// Sets `communicator` up for calls on `device`'s streams where every rank has a
    /// device (collective: every rank of `communicator` calls it).
    fn new(communicator: Communicator, device: c_int) -> Outcome<Joined> {
        #[cfg(feature = "cuda")]
        let ordered = crate::ordered::Ordered::make(&communicator, device)?;
        #[cfg(not(feature = "cuda"))]
        let _ = device;
        Ok(Joined {
            communicator,
            #[cfg(feature = "cuda")]
            ordered,
        })
    }

    /// Fails every call in flight and to come, the host communicator's and those on
    /// streams.
    fn abort(&self) {
        self.communicator.abort();
        #[cfg(feature = "cuda")]
        if let Some(ordered) = &self.ordered {
            ordered.abort();
        }
    }

    /// The first failure of a call issued on a stream that has ended since (none without
    /// streams).
    fn stream_failure(&self) -> Option<Failure> {
        #[cfg(feature = "cuda")]
        if let Some(ordered) = &self.ordered {
            return ordered.failure();
        }
        None
    }

    /// Whether every call issued on a stream has ended (true without streams).
    fn quiescent(&self) -> bool {
        #[cfg(feature = "cuda")]
        if let Some(ordered) = &self.ordered {
            return ordered.quiescent();
        }
        true
    }

    /// Waits for every call issued on a stream to end; fails with the first that failed.
    pub fn finish(&self) -> Outcome {
        #[cfg(feature = "cuda")]
        if let Some(ordered) = &self.ordered {
            return ordered.finish();
        }
        Ok(())
    }
}

/// The handle `ncclComm_t` points to.
pub struct Comm {
    rank: usize,
    nranks: usize,
    /// The CUDA device current when the communicator was made, or -1 without one.
    device: c_int,
    /// The communicator once set up (or why it could not be).
    ready: OnceLock<Outcome<Joined>>,
    /// Its set-up, while it runs in the background.
    joining: Mutex<Option<JoinHandle<Outcome<Joined>>>>,
    /// The reduction operators made on it.
    ops: Ops,
    /// Whether `ncclCommRevoke` stopped it.
    revoked: AtomicBool,
}

impl Comm {
    /// Starts joining rank `rank` of `nranks` to the job `id` describes, in the background.
    pub fn join(id: Rendezvous, nranks: usize, rank: usize, device: c_int) -> Outcome<Comm> {
        if nranks == 0 || rank >= nranks {
            return Err(Failure::argument(format!(
                "rank {rank} is not a rank of a communicator of {nranks}"
            )));
        }
        let mut config = Config::new(rank, nranks, id.addr.ip().to_string(), id.addr.port())
            .tuned_from(|k| std::env::var(k).ok())
            .map_err(Failure::from)?;
        config.auth = id.auth().map_err(Failure::argument)?;
        let server = id.take_server();
        let prefix = format!("nccl/{}", id.job_name());
        let joining = std::thread::Builder::new()
            .name(format!("nccl-init-{rank}"))
            .spawn(move || {
                let communicator = Communicator::with_store_server(config, server, &prefix)?;
                Joined::new(communicator, device)
            })
            .map_err(|e| Failure::new(NcclResult::SystemError, format!("no thread: {e}")))?;
        Ok(Comm {
            rank,
            nranks,
            device,
            ready: OnceLock::new(),
            joining: Mutex::new(Some(joining)),
            ops: Ops::default(),
            revoked: AtomicBool::new(false),
        })
    }

    /// A handle for `communicator`, set up already (a split or a shrink); collective over
    /// its ranks where they have devices.
    pub fn made(communicator: Communicator, device: c_int) -> Outcome<Comm> {
        let comm = Comm {
            rank: communicator.rank(),
            nranks: communicator.world_size(),
            device,
            ready: OnceLock::new(),
            joining: Mutex::new(None),
            ops: Ops::default(),
            revoked: AtomicBool::new(false),
        };
        let _ = comm.ready.set(Ok(Joined::new(communicator, device)?));
        Ok(comm)
    }

    /// A handle whose set-up failed before it began (for tests of the handle table).
    #[cfg(test)]
    pub(crate) fn unjoined(rank: usize, nranks: usize) -> Comm {
        Comm {
            rank,
            nranks,
            device: -1,
            ready: OnceLock::from(Err(Failure::usage("never set up"))),
            joining: Mutex::new(None),
            ops: Ops::default(),
            revoked: AtomicBool::new(false),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// The reduction operators made on it.
    pub fn ops(&self) -> &Ops {
        &self.ops
    }

    /// The CUDA device it was made on, or -1.
    pub fn device(&self) -> c_int {
        self.device
    }

    /// The host communicator, waiting for its set-up if it still runs.
    pub fn communicator(&self) -> Outcome<&Communicator> {
        self.joined().map(|j| &j.communicator)
    }

    /// The communicator set up, waiting for its set-up if it still runs.
    pub fn joined(&self) -> Outcome<&Joined> {
        if let Some(ready) = self.ready.get() {
            return ready.as_ref().map_err(Clone::clone);
        }
        // Held while the set-up is joined, so that another thread here waits for its end.
        let mut joining = lock(&self.joining);
        if let Some(set_up) = joining.take() {
            let joined = set_up.join().unwrap_or_else(|_| {
                Err(Failure::new(
                    NcclResult::InternalError,
                    "the communicator's set-up panicked",
                ))
            });
            let _ = self.ready.set(joined);
        }
        drop(joining);
        // Another thread joined it meanwhile, or it was joined above.
        match self.ready.get() {
            Some(ready) => ready.as_ref().map_err(Clone::clone),
            None => Err(Failure::new(
                NcclResult::InternalError,
                "the communicator has no set-up",
            )),
        }
    }

    /// Whether its calls return once issued, ordered on CUDA streams, waiting for its set-up
    /// if it still runs; false where the set-up failed.
    pub fn on_streams(&self) -> bool {
        #[cfg(feature = "cuda")]
        let on = self.joined().is_ok_and(|j| {
            j.ordered
                .as_ref()
                .is_some_and(crate::ordered::Ordered::orders_streams)
        });
        #[cfg(not(feature = "cuda"))]
        let on = false;
        on
    }

    /// Whether its set-up still runs (or another thread is joining it).
    pub fn in_progress(&self) -> bool {
        if self.ready.get().is_some() {
            return false;
        }
        match self.joining.try_lock() {
            Ok(joining) => joining.as_ref().is_some_and(|j| !j.is_finished()),
            Err(std::sync::TryLockError::WouldBlock) => true,
            Err(std::sync::TryLockError::Poisoned(p)) => {
                p.into_inner().as_ref().is_some_and(|j| !j.is_finished())
            }
        }
    }

    /// What `ncclCommGetAsyncError` reports: the set-up still running, its failure, or the
    /// fault that broke the communicator since (a dead peer, a mismatched call, a stall, a
    /// call on a stream that failed after it was issued).
    /// A revoked communicator reports `ncclInProgress` until its calls on streams have
    /// ended, then `ncclSuccess`: the faults behind the revocation are not its to report.
    pub fn async_error(&self) -> Outcome<NcclResult> {
        if self.in_progress() {
            return Ok(NcclResult::InProgress);
        }
        let joined = self.joined()?;
        if self.revoked() {
            return Ok(match joined.quiescent() {
                true => NcclResult::Success,
                false => NcclResult::InProgress,
            });
        }
        let found = joined
            .communicator
            .failure()
            .map(Failure::from)
            .or_else(|| joined.stream_failure());
        Ok(match found {
            Some(failure) => {
                crate::api::remember(&failure.text);
                failure.code
            }
            None => NcclResult::Success,
        })
    }

    /// Fails every call in flight and to come, on every rank (`ncclCommAbort`); whether it
    /// was set up. Never waits for a set-up that still runs (another thread may be joining
    /// it): such a communicator has no calls to fail, and its set-up runs to its end.
    pub fn abort(&self) -> bool {
        let set_up = self.ready.get().is_some()
            || matches!(self.joining.try_lock(), Ok(j) if j.as_ref().is_some_and(|h| h.is_finished()));
        if !set_up {
            return false;
        }
        if let Ok(joined) = self.joined() {
            joined.abort();
        }
        true
    }

    /// Stops the communicator for good but keeps its handle (`ncclCommRevoke`): calls in
    /// flight fail, here and on every rank (as an abort's do); later calls fail at once;
    /// split, shrink and destroy remain.
    pub fn revoke(&self) -> Outcome {
        self.revoked.store(true, Ordering::SeqCst);
        self.joined()?.abort();
        Ok(())
    }

    /// Whether `ncclCommRevoke` stopped it.
    pub fn revoked(&self) -> bool {
        self.revoked.load(Ordering::SeqCst)
    }

    /// Fails where the communicator no longer takes calls (it was revoked).
    pub fn usable(&self) -> Outcome {
        match self.revoked() {
            true => Err(Failure::usage(
                "the communicator was revoked (ncclCommRevoke): only ncclCommSplit, \
                 ncclCommShrink, ncclCommDestroy and ncclCommAbort take it now",
            )),
            false => Ok(()),
        }
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use chorus::cuda::CudaError;

    #[test]
    fn cuda_errors_map_to_nccls_codes() {
        let wrong = CudaError::WrongDevice {
            what: "stream",
            ordinal: 1,
        };
        assert_eq!(
            code(&chorus::Error::Cuda(wrong)),
            NcclResult::InvalidArgument
        );
        let missing = CudaError::NoCuda("no driver".into());
        assert_eq!(
            code(&chorus::Error::Cuda(missing)),
            NcclResult::UnhandledCudaError
        );
    }
}
