//! Priority admission queue with aging, a starvation bound and per-lane
//! concurrency limits.
//!
//! Requests wait in an [`AdmissionQueue`] before the gateway dispatches them
//! to an instance. Each entry names one or more *lanes* (named concurrency
//! limits such as `"p0"` = "prefills on instance p0" and `"p0/long"` = "long
//! prefills on instance p0"); it can be admitted only when every one of its
//! lanes is below its `max_in_flight`.
//!
//! # Ordering
//!
//! Priorities follow vLLM's convention: **lower is more urgent**. Waiting
//! entries are considered in this order:
//!
//! 1. entries that have waited longer than `max_wait` seconds (if set),
//!    longest wait first (ties: push order);
//! 2. all other entries by *effective priority*
//!    `priority - aging_rate * waited_seconds` (lowest first), ties broken
//!    by push order (FIFO).
//!
//! [`AdmissionQueue::try_admit`] walks that order and admits **every** entry
//! whose lanes all have capacity; an entry that does not fit does not block
//! later ones (short prompts pass a queued long one).
//!
//! # Complexity
//!
//! Because every waiting entry ages at the same rate, the effective-priority
//! order never changes over time: it equals the order of the static key
//! `priority + aging_rate * push_time`. Entries are therefore kept in
//! B-trees, one pair (by static key, by push time) per distinct *lane set*.
//! Entries sharing a lane set compete for the same capacity, so once the head
//! of a lane set does not fit, nothing behind it does either, and the whole
//! set is skipped for the rest of that scan. Hence, with `N` waiting entries,
//! `G` distinct lane sets in use and `A` entries admitted by the call:
//!
//! - `push`, `cancel`, `release`: `O(log N + lanes per entry)`;
//! - `try_admit`: `O((A + G) * log N)`, independent of how many entries
//!   wait behind full lanes;
//! - `waiting_ids`: `O(N log N)` (diagnostics only).
//!
//! All methods take `&self`; state lives behind one `parking_lot::Mutex`, so
//! the queue is `Send + Sync` and can be shared across threads.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashSet};
use std::time::Instant;

use parking_lot::Mutex;

use crate::error::{PdgateError, Result};

mod state;
#[cfg(test)]
mod tests;
mod types;

use state::{EntryState, Group, Inner, Lane};
pub use types::{AdmissionStats, LaneStats};
use types::{Key, SortKey};

/// Identifier of a queued request, chosen by the caller. Unique among the
/// entries currently waiting or in flight; reusable after release/cancel.
pub type EntryId = i64;

/// Default aging rate in priority units per second of waiting.
pub const DEFAULT_AGING_RATE: f64 = 1.0;

/// Thread-safe priority admission queue. See the [module docs](self).
pub struct AdmissionQueue {
    aging_rate: f64,
    max_wait: Option<f64>,
    origin: Instant,
    origin_secs: f64,
    inner: Mutex<Inner>,
}

fn check_time(now: f64) -> Result<f64> {
    if now.is_finite() {
        Ok(now)
    } else {
        Err(PdgateError::InvalidArgument(format!(
            "now must be a finite number of seconds, got {now}"
        )))
    }
}

impl AdmissionQueue {
    /// Create an empty queue.
    ///
    /// - `aging_rate`: priority units subtracted per second of waiting
    ///   (`>= 0`, `0` disables aging).
    /// - `max_wait`: starvation bound in seconds (`>= 0`); entries waiting
    ///   longer are ordered ahead of all others. `None` disables it.
    ///
    /// The internal clock (used when `now` is `None`) counts seconds since
    /// this call; see [`AdmissionQueue::with_clock_origin`].
    ///
    /// # Errors
    /// [`PdgateError::InvalidArgument`] if `aging_rate` or `max_wait` is
    /// negative or not finite.
    pub fn new(aging_rate: f64, max_wait: Option<f64>) -> Result<Self> {
        if !(aging_rate.is_finite() && aging_rate >= 0.0) {
            return Err(PdgateError::InvalidArgument(format!(
                "aging_rate must be finite and >= 0 (priority units per second), got {aging_rate}"
            )));
        }
        if let Some(w) = max_wait {
            if !(w.is_finite() && w >= 0.0) {
                return Err(PdgateError::InvalidArgument(format!(
                    "max_wait must be finite and >= 0 seconds, got {w}"
                )));
            }
        }
        Ok(Self {
            aging_rate,
            max_wait,
            origin: Instant::now(),
            origin_secs: 0.0,
            inner: Mutex::new(Inner::default()),
        })
    }

    /// Make the internal clock read `origin_secs` at the moment of this call
    /// (e.g. Python's `time.monotonic()`), so explicit and default `now`
    /// values can be mixed.
    pub fn with_clock_origin(mut self, origin_secs: f64) -> Self {
        self.origin = Instant::now();
        self.origin_secs = origin_secs;
        self
    }

    /// Aging rate, in priority units per second.
    pub fn aging_rate(&self) -> f64 {
        self.aging_rate
    }

    /// Starvation bound in seconds, if any.
    pub fn max_wait(&self) -> Option<f64> {
        self.max_wait
    }

    /// Current reading of the internal monotonic clock, in seconds.
    pub fn now(&self) -> f64 {
        self.origin_secs + self.origin.elapsed().as_secs_f64()
    }

    fn resolve(&self, now: Option<f64>) -> Result<f64> {
        match now {
            Some(t) => check_time(t),
            None => Ok(self.now()),
        }
    }

    /// Create lane `name` with a limit of `max_in_flight` concurrent entries,
    /// or update the limit of an existing lane. Lowering a limit below the
    /// current in-flight count evicts nothing; the lane just admits no more
    /// until it drains below the new limit. `0` closes the lane.
    ///
    /// # Errors
    /// [`PdgateError::InvalidArgument`] if `name` is empty.
    pub fn add_lane(&self, name: &str, max_in_flight: usize) -> Result<()> {
        if name.is_empty() {
            return Err(PdgateError::InvalidArgument(
                "lane name must not be empty".into(),
            ));
        }
        let mut g = self.inner.lock();
        if let Some(&i) = g.lane_index.get(name) {
            g.lanes[i].max_in_flight = max_in_flight;
        } else {
            let i = g.lanes.len();
            g.lanes.push(Lane {
                name: name.to_owned(),
                max_in_flight,
                in_flight: 0,
                waiting: 0,
            });
            g.lane_index.insert(name.to_owned(), i);
        }
        Ok(())
    }

    /// Queue entry `id` on `lanes` (a lane named twice counts once) with
    /// `priority` (lower = more urgent), pushed at time `now` (seconds;
    /// `None` = internal clock).
    ///
    /// # Errors
    /// - [`PdgateError::InvalidArgument`]: `id` already waiting or in
    ///   flight, `lanes` empty, or `now` not finite.
    /// - [`PdgateError::NotFound`]: a lane was never added.
    pub fn push<S: AsRef<str>>(
        &self,
        id: EntryId,
        lanes: &[S],
        priority: i64,
        now: Option<f64>,
    ) -> Result<()> {
        let now = self.resolve(now)?;
        if lanes.is_empty() {
            return Err(PdgateError::InvalidArgument(format!(
                "entry {id} names no lane"
            )));
        }
        let mut g = self.inner.lock();
        if g.entries.contains_key(&id) {
            return Err(PdgateError::InvalidArgument(format!(
                "entry {id} is already queued or in flight"
            )));
        }
        let mut idx = Vec::with_capacity(lanes.len());
        for l in lanes {
            let l = l.as_ref();
            match g.lane_index.get(l) {
                Some(&i) => idx.push(i),
                None => return Err(PdgateError::NotFound(format!("lane {l:?}"))),
            }
        }
        idx.sort_unstable();
        idx.dedup();
        let idx = idx.into_boxed_slice();
        let inner = &mut *g;
        let gid = match inner.group_index.get(&idx) {
            Some(&gid) => gid,
            None => {
                let gid = inner.next_group;
                inner.next_group += 1;
                inner.group_index.insert(idx.clone(), gid);
                inner.groups.insert(
                    gid,
                    Group {
                        lanes: idx.clone(),
                        by_prio: BTreeMap::new(),
                        by_time: BTreeMap::new(),
                    },
                );
                gid
            }
        };
        let seq = inner.next_seq;
        inner.next_seq += 1;
        // `+ 0.0` folds -0.0 into 0.0 so the total order matches `<`.
        let prio = (Key(priority as f64 + self.aging_rate * now + 0.0), seq);
        let time = (Key(now + 0.0), seq);
        let group = inner.groups.get_mut(&gid).expect("group exists");
        group.by_prio.insert(prio, id);
        group.by_time.insert(time, id);
        for &l in idx.iter() {
            inner.lanes[l].waiting += 1;
        }
        inner.entries.insert(
            id,
            EntryState::Waiting {
                group: gid,
                prio,
                time,
            },
        );
        inner.waiting += 1;
        inner.pushed_total += 1;
        Ok(())
    }

    /// Admit, at time `now` (seconds; `None` = internal clock), every waiting
    /// entry whose lanes all have capacity, walking the queue in order (see
    /// the [module docs](self)). Admitted entries count against their lanes
    /// until [`release`](Self::release)d. Returns their ids in admission
    /// order.
    ///
    /// # Errors
    /// [`PdgateError::InvalidArgument`] if `now` is not finite.
    pub fn try_admit(&self, now: Option<f64>) -> Result<Vec<EntryId>> {
        let now = self.resolve(now)?;
        let mut g = self.inner.lock();
        let inner = &mut *g;
        let mut admitted = Vec::new();
        let mut dead: HashSet<u64> = HashSet::new();
        // Phase 1: entries past the starvation bound, longest wait first.
        if let Some(max_wait) = self.max_wait {
            let cutoff = now - max_wait;
            let expired_head = |grp: &Group| {
                grp.by_time
                    .first_key_value()
                    .filter(|((t, _), _)| t.0 < cutoff)
                    .map(|(k, _)| *k)
            };
            let mut heap: BinaryHeap<Reverse<(SortKey, u64)>> = inner
                .groups
                .iter()
                .filter_map(|(&gid, grp)| expired_head(grp).map(|k| Reverse((k, gid))))
                .collect();
            while let Some(Reverse((_, gid))) = heap.pop() {
                let grp = &inner.groups[&gid];
                if !grp.lanes.iter().all(|&l| inner.lanes[l].has_room()) {
                    dead.insert(gid);
                    continue;
                }
                let (_, &id) = grp.by_time.first_key_value().expect("non-empty");
                inner.admit(id);
                admitted.push(id);
                if let Some(k) = inner.groups.get(&gid).and_then(expired_head) {
                    heap.push(Reverse((k, gid)));
                }
            }
        }
        // Phase 2: by effective priority, FIFO on ties. Live groups hold no
        // expired entries any more (phase 1 drained them or killed the group).
        let mut heap: BinaryHeap<Reverse<(SortKey, u64)>> = inner
            .groups
            .iter()
            .filter(|(gid, _)| !dead.contains(gid))
            .filter_map(|(&gid, grp)| {
                grp.by_prio
                    .first_key_value()
                    .map(|(k, _)| Reverse((*k, gid)))
            })
            .collect();
        while let Some(Reverse((_, gid))) = heap.pop() {
            let grp = &inner.groups[&gid];
            if !grp.lanes.iter().all(|&l| inner.lanes[l].has_room()) {
                continue;
            }
            let (_, &id) = grp.by_prio.first_key_value().expect("non-empty");
            inner.admit(id);
            admitted.push(id);
            if let Some((k, _)) = inner
                .groups
                .get(&gid)
                .and_then(|grp| grp.by_prio.first_key_value())
            {
                heap.push(Reverse((*k, gid)));
            }
        }
        Ok(admitted)
    }

    /// Mark in-flight entry `id` finished and free its lane slots.
    ///
    /// # Errors
    /// [`PdgateError::NotFound`] if `id` is not in flight (unknown, still
    /// waiting, or already released).
    pub fn release(&self, id: EntryId) -> Result<()> {
        let mut g = self.inner.lock();
        match g.entries.get(&id) {
            Some(EntryState::InFlight { .. }) => {
                g.release_in_flight(id);
                Ok(())
            }
            Some(EntryState::Waiting { .. }) => Err(PdgateError::NotFound(format!(
                "entry {id} is waiting, not in flight"
            ))),
            None => Err(PdgateError::NotFound(format!("entry {id}"))),
        }
    }

    /// Withdraw entry `id`: remove it if waiting, release it if in flight.
    /// Returns `true` if it did either, `false` if `id` is unknown (so it is
    /// safe to call more than once, e.g. on client disconnect).
    pub fn cancel(&self, id: EntryId) -> bool {
        let mut g = self.inner.lock();
        match g.entries.get(&id) {
            Some(EntryState::InFlight { .. }) => {
                g.release_in_flight(id);
                true
            }
            Some(EntryState::Waiting { .. }) => {
                g.remove_waiting(id);
                g.cancelled_total += 1;
                true
            }
            None => false,
        }
    }

    /// Number of waiting (not yet admitted) entries.
    pub fn len(&self) -> usize {
        self.inner.lock().waiting
    }

    /// Whether no entry is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of admitted, unreleased entries that use lane `name`.
    ///
    /// # Errors
    /// [`PdgateError::NotFound`] if the lane was never added.
    pub fn in_flight(&self, name: &str) -> Result<usize> {
        let g = self.inner.lock();
        match g.lane_index.get(name) {
            Some(&i) => Ok(g.lanes[i].in_flight),
            None => Err(PdgateError::NotFound(format!("lane {name:?}"))),
        }
    }

    /// Ids of the waiting entries in the order `try_admit` at time `now`
    /// (seconds; `None` = internal clock) would consider them, ignoring
    /// capacity. `O(N log N)`; meant for diagnostics and tests.
    ///
    /// # Errors
    /// [`PdgateError::InvalidArgument`] if `now` is not finite.
    pub fn waiting_ids(&self, now: Option<f64>) -> Result<Vec<EntryId>> {
        let now = self.resolve(now)?;
        let g = self.inner.lock();
        let cutoff = self.max_wait.map(|w| now - w);
        let mut expired = Vec::new();
        let mut rest = Vec::new();
        for grp in g.groups.values() {
            for (&(t, seq), &id) in &grp.by_time {
                if cutoff.is_some_and(|c| t.0 < c) {
                    expired.push(((t, seq), id));
                }
            }
            for (&k, &id) in &grp.by_prio {
                if let Some(EntryState::Waiting { time, .. }) = g.entries.get(&id) {
                    if !cutoff.is_some_and(|c| time.0 .0 < c) {
                        rest.push((k, id));
                    }
                }
            }
        }
        expired.sort_unstable();
        rest.sort_unstable();
        Ok(expired.into_iter().chain(rest).map(|(_, id)| id).collect())
    }

    /// Snapshot of counters and per-lane state.
    pub fn stats(&self) -> AdmissionStats {
        let g = self.inner.lock();
        AdmissionStats {
            waiting: g.waiting,
            in_flight: g.entries.len() - g.waiting,
            pushed_total: g.pushed_total,
            admitted_total: g.admitted_total,
            released_total: g.released_total,
            cancelled_total: g.cancelled_total,
            lanes: g
                .lanes
                .iter()
                .map(|l| LaneStats {
                    name: l.name.clone(),
                    max_in_flight: l.max_in_flight,
                    in_flight: l.in_flight,
                    waiting: l.waiting,
                })
                .collect(),
        }
    }
}
