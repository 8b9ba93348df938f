//! Calls on CPU tensors: Chorus's host collectives, started on the tensors' own memory.

use chorus::{CallKind, Communicator};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffer::{held_apart, Held, Raw};
use crate::pending::Pending;
use crate::torch::{typed, Tensor};
use crate::Call;

/// Starts `call` from `input` into `output` (the same tensor for the calls in place), which
/// `keep` owns.
pub(crate) fn start(
    comm: &Communicator,
    call: &Call,
    input: Tensor,
    output: Tensor,
    keep: Py<PyAny>,
) -> PyResult<Pending> {
    let dtype = output.dtype;
    let c = comm;
    match call.kind {
        CallKind::AllReduce | CallKind::Broadcast | CallKind::Reduce => {
            if input.raw != output.raw {
                return Err(PyValueError::new_err(format!(
                    "chorus {} runs in place: its input and output are one tensor",
                    call.kind.name()
                )));
            }
            let op = output.op(call.op)?;
            Ok(typed!(dtype, T => {
                // SAFETY: the package passes a live tensor of this type and length, owned by
                // `keep` and not touched until the call is done.
                let buf = unsafe { Held::<T>::new(output.raw, Some(keep)) };
                match call.kind {
                    CallKind::AllReduce => Pending::new(c.all_reduce_async(buf, op)),
                    CallKind::Broadcast => Pending::new(c.broadcast_async(buf, call.root)),
                    _ => Pending::new(c.reduce_async(buf, op, call.root)),
                }
            }))
        }
        CallKind::AllGather if output.raw.block(c.rank(), input.raw.bytes) == Some(input.raw) => {
            Ok(typed!(dtype, T => {
                // SAFETY: as above; only the output is referenced.
                let buf = unsafe { Held::<T>::new(output.raw, Some(keep)) };
                Pending::new(c.all_gather_in_place_async(buf))
            }))
        }
        _ => apart(comm, call, (input.raw, output.raw), output, keep),
    }
}

/// Starts `call` from `input` into a separate `output` (an input that overlaps it is
/// copied first).
fn apart(
    c: &Communicator,
    call: &Call,
    (input, output): (Raw, Raw),
    out: Tensor,
    keep: Py<PyAny>,
) -> PyResult<Pending> {
    let op = match call.kind {
        CallKind::ReduceScatter => Some(out.op(call.op)?),
        _ => None,
    };
    Ok(typed!(out.dtype, T => {
        // SAFETY: the package passes live tensors of these lengths, owned by `keep` and not
        // touched until the call is done; an input that overlaps the output is copied.
        let (i, o) = unsafe { held_apart::<T>(input, output, keep) };
        match (call.kind, op, call.counts.clone()) {
            (CallKind::AllGather, ..) => Pending::new(c.all_gather_async::<T, _, _>(i, o)),
            (CallKind::ReduceScatter, Some(op), _) => {
                Pending::new(c.reduce_scatter_async::<T, _, _>(i, o, op))
            }
            (CallKind::AllToAll, _, Some((send, recv))) => {
                Pending::new(c.all_to_all_v_async::<T, _, _>(i, send, o, recv))
            }
            (CallKind::AllToAll, ..) => Pending::new(c.all_to_all_async::<T, _, _>(i, o)),
            (CallKind::Gather, ..) => Pending::new(c.gather_async::<T, _, _>(i, o, call.root)),
            (CallKind::Scatter, ..) => Pending::new(c.scatter_async::<T, _, _>(i, o, call.root)),
            _ => return Err(PyValueError::new_err(format!(
                "chorus has no call {} from one tensor into another", call.kind.name()
            ))),
        }
    }))
}
