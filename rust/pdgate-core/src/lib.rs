//! pdgate's pure-Rust core. No PyO3 here: the `pdgate-py` crate binds it.
//!
//! - [`admission`]: priority admission queues with aging and per-lane
//!   concurrency limits (request-parallel prefill, priority penalization).
//! - [`transfer`]: the KV block transfer engine over UCX.
//! - [`error`]: the one error type every fallible call returns.

pub mod admission;
pub mod error;
pub mod transfer;

pub use error::{PdgateError, Result};
