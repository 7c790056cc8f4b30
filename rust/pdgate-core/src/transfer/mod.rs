//! KV block transfer engine over UCX (issue 3).
//!
//! Moves a request's KV cache blocks between a prefill engine's and a decode
//! engine's registered memory, zero-copy, with UCX one-sided GET/PUT (the
//! UCP `*_nbx` API). `libucp` is loaded at run time (see [`ffi`]), one
//! progress thread owns the UCP worker, callers talk to it over channels.
//!
//! - [`layout`]: region geometry, bounds checks, block coalescing.
//! - [`meta`]: peer metadata wire format and validation.
//! - [`engine`]: the public [`TransferEngine`] handle.
//! - leases: an owner pins blocks for a request; a reader whose read
//!   finishes after the lease expired gets `LeaseExpired`, never stale bytes.

pub mod engine;
pub mod ffi;
pub mod layout;
pub mod meta;
mod peer;
mod shared;
mod worker;
mod xfer;

pub use engine::{fetch_metadata, BlockTransfer, EngineConfig, TransferEngine};
pub use layout::{plan_segments, MemType, RegionLayout, Segment};
pub use meta::{compat_hash, PeerMeta, RegionDesc, PROTOCOL_VERSION};
pub use shared::Notification;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod fuzz;
