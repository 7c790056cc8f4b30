//! The single error type of the core. The binding crate maps each variant to
//! one Python exception class (see `python/pdgate/_native.pyi`).

/// Every failure the core reports. Variants are stable: the Python binding
/// maps each to an exception class.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum PdgateError {
    /// A caller passed an argument outside its documented domain.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A lane, entry or peer id that the engine does not know.
    #[error("not found: {0}")]
    NotFound(String),
    /// The engine or queue was closed/shut down.
    #[error("closed: {0}")]
    Closed(String),
    /// A transfer peer could not be reached (connect refused, endpoint error).
    #[error("peer unreachable: {0}")]
    PeerUnreachable(String),
    /// An operation did not complete within its deadline.
    #[error("timed out: {0}")]
    Timeout(String),
    /// Peer metadata bytes failed validation (version, hash, truncation).
    #[error("rejected metadata: {0}")]
    RejectedMetadata(String),
    /// A block id outside the registered region.
    #[error("block out of range: {0}")]
    OutOfRange(String),
    /// The owner's lease on the blocks expired before the read.
    #[error("lease expired: {0}")]
    LeaseExpired(String),
    /// Any other transport-level failure (UCX status text inside).
    #[error("transport error: {0}")]
    Transport(String),
}

/// Result alias used across the core.
pub type Result<T> = std::result::Result<T, PdgateError>;
