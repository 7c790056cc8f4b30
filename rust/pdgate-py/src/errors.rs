//! One Python exception class per `PdgateError` variant, all subclasses of
//! `pdgate._native.PdgateError`.
use pdgate_core::PdgateError;
use pyo3::create_exception;
use pyo3::prelude::*;

create_exception!(_native, PdgateNativeError, pyo3::exceptions::PyException);
create_exception!(_native, InvalidArgumentError, PdgateNativeError);
create_exception!(_native, NotFoundError, PdgateNativeError);
create_exception!(_native, ClosedError, PdgateNativeError);
create_exception!(_native, PeerUnreachableError, PdgateNativeError);
create_exception!(_native, TransferTimeoutError, PdgateNativeError);
create_exception!(_native, RejectedMetadataError, PdgateNativeError);
create_exception!(_native, BlockOutOfRangeError, PdgateNativeError);
create_exception!(_native, LeaseExpiredError, PdgateNativeError);
create_exception!(_native, TransportError, PdgateNativeError);

/// Convert a core error into the matching Python exception.
pub fn to_py(err: PdgateError) -> PyErr {
    let msg = err.to_string();
    match err {
        PdgateError::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
        PdgateError::NotFound(_) => NotFoundError::new_err(msg),
        PdgateError::Closed(_) => ClosedError::new_err(msg),
        PdgateError::PeerUnreachable(_) => PeerUnreachableError::new_err(msg),
        PdgateError::Timeout(_) => TransferTimeoutError::new_err(msg),
        PdgateError::RejectedMetadata(_) => RejectedMetadataError::new_err(msg),
        PdgateError::OutOfRange(_) => BlockOutOfRangeError::new_err(msg),
        PdgateError::LeaseExpired(_) => LeaseExpiredError::new_err(msg),
        PdgateError::Transport(_) => TransportError::new_err(msg),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("PdgateError", py.get_type::<PdgateNativeError>())?;
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
