//! Small calls on one host: each rank posts its bytes in its mailbox in the
//! shared region and meets its peers once (see [`ShmTransport::meet_posted`]);
//! then every rank reduces, in rank order, or copies the root's bytes. One
//! meeting replaces the rounds of messages a barrier, an all-reduce or a
//! broadcast of up to `MAILBOX_BYTES` would take. `prepare.rs` picks this
//! route from the tuner's table; `meeting.rs` runs it.

use std::time::Instant;

use chorus_transport::shm::{CallPlace, ShmTransport, Stall};
use chorus_transport::{Transport, TransportError};

use super::shared::reduce_all;
use super::{CallInfo, CallKind};
use crate::executor::Buffers;
use crate::{Error, Result};

/// Runs call `info` on `bufs` (at most `MAILBOX_BYTES`) with one meeting.
pub(super) fn run(
    shm: &ShmTransport,
    place: &CallPlace,
    (deadline, stall): (Instant, Option<Stall<'_>>),
    info: &CallInfo,
    bufs: &Buffers<'_>,
) -> Result<()> {
    let (kind, root, dtype, op) = (info.kind, info.root, info.dtype, info.op);
    let failed = |e: TransportError| Error::transport(shm.rank(), e);
    if kind == CallKind::Barrier {
        shm.meet(place, deadline, stall).map_err(failed)?;
        shm.check_places(place).map_err(failed)?;
        return Ok(());
    }
    // Posted (copied into the mailbox) before the output is written: in place, they are the
    // same memory.
    // SAFETY: the caller's borrow of the input lasts for the call, and only this thread
    // touches it (no request is posted); the slice ends with this statement.
    let posted = shm.post(unsafe { bufs.input() });
    // SAFETY: the caller's borrow of the output lasts for the call, and only this thread
    // touches it (no request is posted); no other slice of it lives from here on.
    let output = unsafe {
        let (at, len) = bufs.output_raw();
        std::slice::from_raw_parts_mut(at, len)
    };
    let local_root = shm.local_ranks().iter().position(|&r| r == root);
    shm.meet_posted(posted, place, deadline, stall, |posted| -> Result<()> {
        match kind {
            CallKind::Broadcast => {
                let root = local_root.expect("the root is a local rank");
                output.copy_from_slice(posted[root]);
            }
            _ => reduce_all(posted, output, dtype, op)?,
        }
        Ok(())
    })
    .map_err(failed)?
}
