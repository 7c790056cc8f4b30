//! One Python exception class per `PdgateError` variant, all subclasses of
//! `pdgate._native.PdgateError`.
use pdgate_core::PdgateError as CoreError;
use pyo3::create_exception;
use pyo3::prelude::*;

create_exception!(pdgate._native, PdgateError, pyo3::exceptions::PyException);
create_exception!(pdgate._native, InvalidArgumentError, PdgateError);
create_exception!(pdgate._native, NotFoundError, PdgateError);
create_exception!(pdgate._native, ClosedError, PdgateError);
create_exception!(pdgate._native, PeerUnreachableError, PdgateError);
create_exception!(pdgate._native, TransferTimeoutError, PdgateError);
create_exception!(pdgate._native, RejectedMetadataError, PdgateError);
create_exception!(pdgate._native, BlockOutOfRangeError, PdgateError);
create_exception!(pdgate._native, LeaseExpiredError, PdgateError);
create_exception!(pdgate._native, TransportError, PdgateError);

/// Convert a core error into the matching Python exception.
pub fn to_py(err: CoreError) -> PyErr {
    let msg = err.to_string();
    match err {
        CoreError::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
        CoreError::NotFound(_) => NotFoundError::new_err(msg),
        CoreError::Closed(_) => ClosedError::new_err(msg),
        CoreError::PeerUnreachable(_) => PeerUnreachableError::new_err(msg),
        CoreError::Timeout(_) => TransferTimeoutError::new_err(msg),
        CoreError::RejectedMetadata(_) => RejectedMetadataError::new_err(msg),
        CoreError::OutOfRange(_) => BlockOutOfRangeError::new_err(msg),
        CoreError::LeaseExpired(_) => LeaseExpiredError::new_err(msg),
        CoreError::Transport(_) => TransportError::new_err(msg),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("PdgateError", py.get_type::<PdgateError>())?;
    m.add("InvalidArgumentError", py.get_type::<InvalidArgumentError>())?;
    m.add("NotFoundError", py.get_type::<NotFoundError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    m.add("PeerUnreachableError", py.get_type::<PeerUnreachableError>())?;
    m.add("TransferTimeoutError", py.get_type::<TransferTimeoutError>())?;
    m.add("RejectedMetadataError", py.get_type::<RejectedMetadataError>())?;
    m.add("BlockOutOfRangeError", py.get_type::<BlockOutOfRangeError>())?;
    m.add("LeaseExpiredError", py.get_type::<LeaseExpiredError>())?;
    m.add("TransportError", py.get_type::<TransportError>())?;
    Ok(())
}
