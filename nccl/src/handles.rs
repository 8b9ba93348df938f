//! The `ncclComm_t` handles this library has handed out and not yet taken back.
//!
//! A handle is a number the table below maps to its communicator, dressed as a pointer and
//! never dereferenced: a call looks it up and holds its own reference for as long as it
//! runs. So `ncclCommAbort` from one thread while another is inside a call on the same
//! handle (what NCCL allows it for) frees nothing under that call: the communicator goes
//! when its last call ends. No number is handed out twice, so a handle destroyed or aborted
//! already (or never made here) is always refused by name.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::comm::{Comm, Failure, Outcome};

/// The live communicators, by handle.
static LIVE: RwLock<BTreeMap<usize, Arc<Comm>>> = RwLock::new(BTreeMap::new());

/// The number of the next handle.
static NEXT: AtomicUsize = AtomicUsize::new(1);

/// Hands `comm` out: the handle the caller will pass back.
pub fn publish(comm: Arc<Comm>) -> *mut Comm {
    // Aligned as a pointer to a communicator would be, for callers that look.
    let handle = NEXT.fetch_add(1, Ordering::Relaxed) * std::mem::align_of::<Comm>();
    LIVE.write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(handle, comm);
    std::ptr::without_provenance_mut(handle)
}

/// The communicator behind `handle`, kept alive by the reference returned.
pub fn get(handle: *const Comm) -> Outcome<Arc<Comm>> {
    let live = LIVE
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    live.get(&checked(handle)?)
        .cloned()
        .ok_or_else(|| stale(handle))
}

/// Takes `handle` back: later calls on it are refused; the communicator goes once the
/// reference returned and those of the calls still running on it are dropped.
pub fn take(handle: *const Comm) -> Outcome<Arc<Comm>> {
    let mut live = LIVE
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    live.remove(&checked(handle)?).ok_or_else(|| stale(handle))
}

/// Drops `comm` here once it is the last reference, waiting up to `grace` for the calls
/// still holding it to end (they free it as they end should they take longer).
pub fn release(mut comm: Arc<Comm>, grace: Duration) {
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        match Arc::try_unwrap(comm) {
            Ok(last) => return drop(last),
            Err(shared) => comm = shared,
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn checked(handle: *const Comm) -> Outcome<usize> {
    match handle.is_null() {
        true => Err(Failure::argument("comm is NULL")),
        false => Ok(handle.addr()),
    }
}

fn stale(handle: *const Comm) -> Failure {
    Failure::argument(format!(
        "comm {handle:p} is not a communicator of this library: destroyed or aborted already, \
         or never made"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handle_taken_back_is_refused_and_its_communicator_outlives_the_calls_on_it() {
        use crate::abi::NcclResult;
        let handle = publish(Arc::new(Comm::unjoined(0, 1)));
        let in_call = get(handle).unwrap();
        let taken = take(handle).unwrap();
        assert!(Arc::ptr_eq(&in_call, &taken));
        drop(taken);
        // The call still running holds the only reference: its communicator is still there.
        assert_eq!(Arc::strong_count(&in_call), 1);
        assert_eq!(in_call.nranks(), 1);
        for refused in [get(handle).err(), take(handle).err()] {
            assert_eq!(refused.map(|f| f.code), Some(NcclResult::InvalidArgument));
        }
        assert_eq!(
            get(std::ptr::null()).err().map(|f| f.code),
            Some(NcclResult::InvalidArgument)
        );
    }
}
