//! Calls that meet through shared memory instead of sending messages: the
//! mailbox route (`mailbox.rs`) and the shared buffers' route (`shared.rs`),
//! picked in `prepare.rs`. Both write which call each rank is in beside its
//! meeting counter, so ranks that disagree fail naming each other; a call that
//! runs as messages announces itself there too.

use std::cell::Cell;
use std::time::Instant;

use chorus_transport::shm::{CallPlace, Stall};

use super::shared::WindowCall;
use super::{mailbox, CallInfo, Inner};
use crate::executor::{Buffers, Watch};
use crate::Result;

impl Inner {
    /// Tells the other ranks that call `tag` (`len` bytes, `root`) runs on
    /// messages (a rank that meets in it then fails at once instead of waiting).
    pub(super) fn announce_messages(&self, tag: u64, len: usize, root: usize) {
        if let Some(shm) = self.all_shm() {
            shm.announce(&CallPlace {
                tag,
                len,
                root,
                ..CallPlace::default()
            });
        }
    }

    /// Runs call `info`, tagged `tag`, on `bufs` through meetings: on the shared buffers
    /// `window` names, or through the mailboxes when `None`, failing at `deadline`. A
    /// meeting that outlasts `watch`'s warning time is reported to it, once.
    pub(super) fn run_meeting(
        &self,
        window: Option<&WindowCall>,
        bufs: &Buffers<'_>,
        tag: u64,
        info: &CallInfo,
        (deadline, watch): (Instant, Option<&dyn Watch>),
    ) -> Result<()> {
        let shm = self.all_shm().expect("meetings need shared memory");
        let warned = Cell::new(false);
        let tell = || {
            if let Some(w) = watch.filter(|_| !warned.replace(true)) {
                // Meetings join the ranks of one host, none of which can lose its host alone.
                let _ = w.stalled();
            }
        };
        let stall = watch
            .and_then(|w| w.warn_at())
            .filter(|&at| at < deadline)
            .map(|at| Stall { at, tell: &tell });
        let place = CallPlace {
            tag,
            meets: true,
            len: info.count * info.dtype.size(),
            root: info.root,
            ..CallPlace::default()
        };
        match window {
            None => mailbox::run(shm, &place, (deadline, stall), info, bufs),
            Some(window) => self.run_windows(shm, &window.place(place), (deadline, stall), info),
        }
    }
}
