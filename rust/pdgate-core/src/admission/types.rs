//! Small value types of the admission queue.
use std::cmp::Ordering;

/// `f64` with a total order (values are validated finite before use).
#[derive(Debug, Clone, Copy)]
pub(super) struct Key(pub(super) f64);

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Key {}
impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// Sort key inside a B-tree: a float key, then the push sequence number.
pub(super) type SortKey = (Key, u64);

/// Snapshot of one lane, as returned in [`AdmissionStats::lanes`].
#[derive(Debug, Clone, PartialEq)]
pub struct LaneStats {
    /// Lane name.
    pub name: String,
    /// Concurrency limit (entries).
    pub max_in_flight: usize,
    /// Admitted, not yet released entries that use this lane.
    pub in_flight: usize,
    /// Waiting entries that name this lane.
    pub waiting: usize,
}

/// Snapshot of the queue, as returned by [`AdmissionQueue::stats`](super::AdmissionQueue::stats).
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionStats {
    /// Entries waiting for admission.
    pub waiting: usize,
    /// Entries admitted and not yet released/cancelled.
    pub in_flight: usize,
    /// Total entries ever pushed.
    pub pushed_total: u64,
    /// Total entries ever admitted.
    pub admitted_total: u64,
    /// Total in-flight entries released (by `release` or `cancel`).
    pub released_total: u64,
    /// Total waiting entries removed by `cancel`.
    pub cancelled_total: u64,
    /// Per-lane state, in lane creation order.
    pub lanes: Vec<LaneStats>,
}
