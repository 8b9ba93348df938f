//! Chorus's errors as Python sees them: `ChorusError`, a RuntimeError carrying the fault.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

pyo3::create_exception!(
    _chorus,
    ChorusError,
    PyRuntimeError,
    "A Chorus call failed. Where a fault stopped it (a rank that died, a timeout, mismatched \
     calls, an abort), `cause` names it (`PeerClosed`, `Timeout`, `Mismatch`, ...), `culprit` \
     is the rank held responsible, `found_by` the rank that found it, and `call` and `seq` the \
     call it was found in; each is None where it does not apply."
);

/// `error` raised as a [`ChorusError`] with its fault's fields.
pub(crate) fn raised(error: &chorus::Error) -> PyErr {
    let err = ChorusError::new_err(error.to_string());
    Python::attach(|py| {
        let fault = error.fault();
        let value = err.value(py);
        let fields = [
            (
                "cause",
                fault.map(|f| format!("{:?}", f.cause)).into_pyobject(py)?,
            ),
            ("culprit", fault.and_then(|f| f.culprit).into_pyobject(py)?),
            ("found_by", fault.map(|f| f.found_by).into_pyobject(py)?),
            (
                "call",
                fault
                    .and_then(|f| f.call)
                    .map(|c| c.to_string())
                    .into_pyobject(py)?,
            ),
            (
                "seq",
                fault
                    .filter(|f| f.call.is_some())
                    .map(|f| f.seq)
                    .into_pyobject(py)?,
            ),
        ];
        for (name, field) in fields {
            value.setattr(name, field)?;
        }
        PyResult::Ok(())
    })
    .map_or_else(|e| e, |()| err)
}
