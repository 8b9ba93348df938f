//! How every rank of a communicator learns of a failure, and whom it blames, at each stage
//! of the communicator's life:
//!
//! - Joining ([`SetUp`]): the roll call (`roll_call.rs`) fails at once a process that claims
//!   a rank another holds, or whose settings differ from rank 0's, naming what differs; the
//!   lookout (`lookout.rs`) turns the first rank to fail or leave during set-up into every
//!   rank's error, instead of a timeout on each.
//! - Running calls ([`Monitor`]): a listener on the store raises and hears alarms (the first
//!   [`Fault`](crate::Fault) found stays, and every rank fails with it), answers what its
//!   rank is doing, and watches a call that waits too long ([`Watcher`]), naming a rank gone
//!   from under it.
//!
//! Communicators made from another (split, shrunk) are placed in their job by a
//! [`Lineage`], so their faults name the job's ranks.

mod lookout;
mod monitor;
mod roll_call;

use std::sync::Arc;

use chorus_transport::store::Store;

use crate::{Config, Result};
use lookout::Lookout;

pub(crate) use lookout::post;
pub(crate) use monitor::{ranks, Lineage, Monitor, Watcher};

/// One rank's set-up, watched: see the [module documentation](self).
pub(super) struct SetUp(Lookout);

impl SetUp {
    /// Claims `config.rank` under `store` (a process that cannot is not of this job: it fails
    /// alone), then starts watching the other ranks' set-up under `prefix`, whose waits go
    /// through `client`.
    pub fn begin<S: Store>(
        store: &S,
        config: &Config,
        prefix: &str,
        client: &Arc<dyn Store>,
    ) -> Result<SetUp> {
        roll_call::claim(store, config)?;
        Ok(SetUp(Lookout::start(config, prefix, client)?))
    }

    /// Checks this rank's settings against rank 0's, then runs `connect`. This rank's
    /// failure in either is posted for the others; one caused by another rank's failure
    /// becomes [`Error::Aborted`](crate::Error::Aborted) naming that rank.
    pub fn run<S: Store, T>(
        self,
        store: &S,
        config: &Config,
        connect: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let outcome = roll_call::compare(store, config).and_then(|()| connect());
        self.0.finish(store, outcome)
    }
}
