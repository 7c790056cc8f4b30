//! Internal state of the admission queue (behind its mutex).
use std::collections::{BTreeMap, HashMap};

use super::types::SortKey;
use super::EntryId;

pub(super) struct Lane {
    pub(super) name: String,
    pub(super) max_in_flight: usize,
    pub(super) in_flight: usize,
    pub(super) waiting: usize,
}

impl Lane {
    pub(super) fn has_room(&self) -> bool {
        self.in_flight < self.max_in_flight
    }
}

/// Waiting entries that share one lane set.
pub(super) struct Group {
    pub(super) lanes: Box<[usize]>,
    pub(super) by_prio: BTreeMap<SortKey, EntryId>,
    pub(super) by_time: BTreeMap<SortKey, EntryId>,
}

pub(super) enum EntryState {
    Waiting {
        group: u64,
        prio: SortKey,
        time: SortKey,
    },
    InFlight {
        lanes: Box<[usize]>,
    },
}

#[derive(Default)]
pub(super) struct Inner {
    pub(super) lanes: Vec<Lane>,
    pub(super) lane_index: HashMap<String, usize>,
    pub(super) groups: HashMap<u64, Group>,
    pub(super) group_index: HashMap<Box<[usize]>, u64>,
    pub(super) next_group: u64,
    pub(super) entries: HashMap<EntryId, EntryState>,
    pub(super) waiting: usize,
    pub(super) next_seq: u64,
    pub(super) pushed_total: u64,
    pub(super) admitted_total: u64,
    pub(super) released_total: u64,
    pub(super) cancelled_total: u64,
}

impl Inner {
    /// Remove waiting entry `id` from its group; returns its lane set.
    pub(super) fn remove_waiting(&mut self, id: EntryId) -> Box<[usize]> {
        let Some(EntryState::Waiting { group, prio, time }) = self.entries.remove(&id) else {
            unreachable!("remove_waiting on a non-waiting entry");
        };
        let grp = self.groups.get_mut(&group).expect("group exists");
        grp.by_prio.remove(&prio);
        grp.by_time.remove(&time);
        let lanes = grp.lanes.clone();
        if grp.by_prio.is_empty() {
            self.groups.remove(&group);
            self.group_index.remove(&lanes);
        }
        for &l in lanes.iter() {
            self.lanes[l].waiting -= 1;
        }
        self.waiting -= 1;
        lanes
    }

    /// Move waiting entry `id` to in flight.
    pub(super) fn admit(&mut self, id: EntryId) {
        let lanes = self.remove_waiting(id);
        for &l in lanes.iter() {
            self.lanes[l].in_flight += 1;
        }
        self.entries.insert(id, EntryState::InFlight { lanes });
        self.admitted_total += 1;
    }

    pub(super) fn release_in_flight(&mut self, id: EntryId) {
        let Some(EntryState::InFlight { lanes }) = self.entries.remove(&id) else {
            unreachable!("release_in_flight on a non-in-flight entry");
        };
        for &l in lanes.iter() {
            self.lanes[l].in_flight -= 1;
        }
        self.released_total += 1;
    }
}
