//! Set-up failures reach every rank at once, instead of as a timeout.
//!
//! While a rank sets up, it holds a key in the store that the store sets if the rank's
//! connection closes (its process died or exited), and a rank that fails posts its own
//! [`Fault`] under the same key; the first stays. A thread on every rank waits for that key
//! and, when it comes, closes the rank's set-up client, so the set-up's waits fail at once and
//! the rank reports that fault instead.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use chorus_transport::store::{PrefixStore, Presence, Store, StoreError};

use crate::communicator::{connect_store, lock};
use crate::{Cause, Config, Error, Fault, Result};

/// The key that names the first rank to fail or leave during set-up.
const LEFT: &str = "setup/left";
/// Counts the ranks that posted a failure; the first one writes [`LEFT`].
const FAILED: &str = "setup/failed";

/// One rank's watch over the others' set-up. See the [module documentation](self).
pub(super) struct Lookout {
    rank: usize,
    presence: Option<Presence>,
    /// The watching thread's own client, closed to stop it.
    own: Arc<dyn Store>,
    /// Set once this rank's set-up is over: the thread no longer closes the set-up client.
    over: Arc<Mutex<bool>>,
    thread: Option<JoinHandle<Option<Fault>>>,
}

impl Lookout {
    /// Starts watching the set-up under `prefix`, whose waits go through `setup`.
    pub fn start(config: &Config, prefix: &str, setup: &Arc<dyn Store>) -> Result<Lookout> {
        let rank = config.rank;
        let left = Fault::new(Cause::LeftDuringSetUp, Some(rank), rank).encode();
        let presence = PrefixStore::new(prefix, setup.clone()).presence(LEFT, left.as_bytes())?;
        let own = connect_store(config, config.timeout)?;
        let watched = PrefixStore::new(prefix, own.clone());
        let over = Arc::new(Mutex::new(false));
        let (setup, done) = (setup.clone(), over.clone());
        let thread = std::thread::Builder::new()
            .name(format!("chorus-lookout-{rank}"))
            .spawn(move || {
                let text = String::from_utf8_lossy(&watched.get(LEFT).ok()?).into_owned();
                if !*lock(&done) {
                    setup.shutdown();
                }
                Fault::decode(&text)
            })
            .map_err(|source| Error::Resource {
                what: "cannot start the set-up lookout thread",
                source: source.into(),
            })?;
        Ok(Lookout {
            rank,
            presence,
            own,
            over,
            thread: Some(thread),
        })
    }

    /// Ends the watch over a set-up that ended in `result`, through `store` (the set-up's,
    /// under its prefix). A failure caused by another rank's becomes
    /// [`Error::Aborted`] naming that rank; this rank's own failure is posted for the others.
    pub fn finish<T, S: Store>(mut self, store: &S, result: Result<T>) -> Result<T> {
        *lock(&self.over) = true;
        let heard = self.stop();
        let err = match result {
            Ok(value) => {
                if let Some(presence) = self.presence.take() {
                    if let Err(e) = presence.release() {
                        tracing::debug!(rank = self.rank, error = %e, "cannot withdraw the set-up presence");
                    }
                }
                return Ok(value);
            }
            Err(err) => err,
        };
        if let Some(fault) = heard.filter(|fault| fault.culprit != Some(self.rank)) {
            return Err(Error::Aborted(Box::new(fault)));
        }
        let failed =
            Fault::new(Cause::SetUpFailed, Some(self.rank), self.rank).saying(err.to_string());
        if let Err(e) = post(store, &failed) {
            tracing::debug!(rank = self.rank, error = %e, "cannot tell the other ranks why set-up failed");
        }
        Err(err)
    }

    /// Stops the thread; returns the fault it read, if any.
    fn stop(&mut self) -> Option<Fault> {
        self.own.shutdown();
        self.thread.take()?.join().ok().flatten()
    }
}

/// Posts `fault` as what failed the set-up under `store`'s prefix, unless a fault was posted
/// first: every rank's lookout then fails its set-up with it.
pub(crate) fn post<S: Store + ?Sized>(store: &S, fault: &Fault) -> Result<(), StoreError> {
    match store.add(FAILED, 1)? {
        1 => store.set(LEFT, fault.encode().as_bytes()),
        _ => Ok(()),
    }
}

impl Drop for Lookout {
    fn drop(&mut self) {
        *lock(&self.over) = true;
        self.stop();
    }
}
