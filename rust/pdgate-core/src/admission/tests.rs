//! Unit and property tests for the admission queue.
use super::*;
use proptest::prelude::*;
use std::collections::{BTreeSet, HashMap};

fn q(rate: f64, max_wait: Option<f64>) -> AdmissionQueue {
    AdmissionQueue::new(rate, max_wait).unwrap()
}

#[test]
fn queue_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<AdmissionQueue>();
}

#[test]
fn rejects_bad_config() {
    assert!(matches!(
        AdmissionQueue::new(-1.0, None),
        Err(PdgateError::InvalidArgument(_))
    ));
    assert!(matches!(
        AdmissionQueue::new(f64::NAN, None),
        Err(PdgateError::InvalidArgument(_))
    ));
    assert!(matches!(
        AdmissionQueue::new(1.0, Some(-0.5)),
        Err(PdgateError::InvalidArgument(_))
    ));
    assert!(matches!(
        AdmissionQueue::new(1.0, Some(f64::INFINITY)),
        Err(PdgateError::InvalidArgument(_))
    ));
}

#[test]
fn push_errors() {
    let q = q(1.0, None);
    q.add_lane("a", 1).unwrap();
    assert!(matches!(
        q.push(1, &["nope"], 0, Some(0.0)),
        Err(PdgateError::NotFound(_))
    ));
    let none: [&str; 0] = [];
    assert!(matches!(
        q.push(1, &none, 0, Some(0.0)),
        Err(PdgateError::InvalidArgument(_))
    ));
    assert!(matches!(
        q.push(1, &["a"], 0, Some(f64::NAN)),
        Err(PdgateError::InvalidArgument(_))
    ));
    q.push(1, &["a"], 0, Some(0.0)).unwrap();
    assert!(matches!(
        q.push(1, &["a"], 0, Some(0.0)),
        Err(PdgateError::InvalidArgument(_))
    ));
    assert_eq!(q.try_admit(Some(0.0)).unwrap(), vec![1]);
    // Still a duplicate while in flight; reusable once released.
    assert!(matches!(
        q.push(1, &["a"], 0, Some(0.0)),
        Err(PdgateError::InvalidArgument(_))
    ));
    q.release(1).unwrap();
    q.push(1, &["a"], 0, Some(0.0)).unwrap();
    assert!(matches!(
        q.add_lane("", 1),
        Err(PdgateError::InvalidArgument(_))
    ));
}

#[test]
fn priority_then_fifo() {
    let q = q(0.0, None);
    q.add_lane("a", 1).unwrap();
    q.push(1, &["a"], 5, Some(0.0)).unwrap();
    q.push(2, &["a"], 0, Some(1.0)).unwrap();
    q.push(3, &["a"], 5, Some(2.0)).unwrap();
    q.push(4, &["a"], 0, Some(3.0)).unwrap();
    assert_eq!(q.waiting_ids(Some(3.0)).unwrap(), vec![2, 4, 1, 3]);
    let mut order = Vec::new();
    for _ in 0..4 {
        let got = q.try_admit(Some(4.0)).unwrap();
        assert_eq!(got.len(), 1);
        order.push(got[0]);
        q.release(got[0]).unwrap();
    }
    assert_eq!(order, vec![2, 4, 1, 3]);
    assert!(q.is_empty());
}

#[test]
fn short_passes_blocked_long() {
    let q = q(1.0, None);
    q.add_lane("p0", 4).unwrap();
    q.add_lane("p0/long", 1).unwrap();
    q.push(1, &["p0", "p0/long"], 0, Some(0.0)).unwrap();
    q.push(2, &["p0", "p0/long"], 0, Some(0.0)).unwrap();
    for id in 3..8 {
        q.push(id, &["p0"], 0, Some(0.0)).unwrap();
    }
    // 4 prefills, at most 1 long: long 1 then shorts 3, 4, 5.
    assert_eq!(q.try_admit(Some(0.0)).unwrap(), vec![1, 3, 4, 5]);
    assert_eq!(q.in_flight("p0").unwrap(), 4);
    assert_eq!(q.in_flight("p0/long").unwrap(), 1);
    q.release(1).unwrap();
    // Long 2 fits on p0/long again and is ahead of short 6.
    assert_eq!(q.try_admit(Some(0.0)).unwrap(), vec![2]);
    q.release(3).unwrap();
    assert_eq!(q.try_admit(Some(0.0)).unwrap(), vec![6]);
    assert_eq!(q.len(), 1);
}

#[test]
fn aging_lets_low_priority_overtake() {
    let q = q(1.0, None);
    q.add_lane("a", 1).unwrap();
    q.push(99, &["a"], 0, Some(0.0)).unwrap();
    assert_eq!(q.try_admit(Some(0.0)).unwrap(), vec![99]); // occupy the lane
    q.push(1, &["a"], 10, Some(0.0)).unwrap();
    q.push(2, &["a"], 0, Some(5.0)).unwrap(); // at t=5: 1 has 10-5=5, 2 has 0
    assert_eq!(q.waiting_ids(Some(5.0)).unwrap(), vec![2, 1]);
    q.cancel(2);
    q.push(3, &["a"], 0, Some(20.0)).unwrap(); // at t=20: 1 has -10, 3 has 0
    q.release(99).unwrap();
    assert_eq!(q.try_admit(Some(20.0)).unwrap(), vec![1]);
}

#[test]
fn zero_aging_never_overtakes() {
    let q = q(0.0, None);
    q.add_lane("a", 1).unwrap();
    q.push(1, &["a"], 10, Some(0.0)).unwrap();
    q.push(2, &["a"], 0, Some(1e6)).unwrap();
    assert_eq!(q.try_admit(Some(1e6)).unwrap(), vec![2]);
}

#[test]
fn max_wait_puts_starved_first() {
    let q = q(0.0, Some(30.0));
    q.add_lane("a", 1).unwrap();
    q.push(1, &["a"], 100, Some(0.0)).unwrap();
    q.push(2, &["a"], 50, Some(5.0)).unwrap();
    q.push(3, &["a"], 0, Some(10.0)).unwrap();
    assert_eq!(q.waiting_ids(Some(20.0)).unwrap(), vec![3, 2, 1]);
    // At t=36 entries 1 (waited 36s) and 2 (31s) are past the bound.
    assert_eq!(q.waiting_ids(Some(36.0)).unwrap(), vec![1, 2, 3]);
    assert_eq!(q.try_admit(Some(36.0)).unwrap(), vec![1]);
}

#[test]
fn expired_entry_that_does_not_fit_does_not_block() {
    let q = q(0.0, Some(1.0));
    q.add_lane("a", 1).unwrap();
    q.add_lane("b", 1).unwrap();
    q.push(9, &["a"], 0, Some(0.0)).unwrap();
    assert_eq!(q.try_admit(Some(0.0)).unwrap(), vec![9]);
    q.push(1, &["a", "b"], 0, Some(0.0)).unwrap(); // expired, blocked on a
    q.push(2, &["b"], 0, Some(0.0)).unwrap(); // expired, fits
    q.push(3, &["b"], 0, Some(9.0)).unwrap();
    assert_eq!(q.try_admit(Some(10.0)).unwrap(), vec![2]);
}

#[test]
fn release_and_cancel() {
    let q = q(1.0, None);
    q.add_lane("a", 1).unwrap();
    q.push(1, &["a"], 0, Some(0.0)).unwrap();
    q.push(2, &["a"], 0, Some(0.0)).unwrap();
    assert!(matches!(q.release(1), Err(PdgateError::NotFound(_)))); // waiting
    assert!(matches!(q.release(7), Err(PdgateError::NotFound(_))));
    assert_eq!(q.try_admit(Some(0.0)).unwrap(), vec![1]);
    assert!(q.cancel(2)); // waiting -> removed
    assert!(!q.cancel(2));
    assert!(q.cancel(1)); // in flight -> released
    assert!(!q.cancel(1));
    assert!(matches!(q.release(1), Err(PdgateError::NotFound(_))));
    assert_eq!(q.in_flight("a").unwrap(), 0);
    assert!(matches!(q.in_flight("zz"), Err(PdgateError::NotFound(_))));
    let s = q.stats();
    assert_eq!(
        (
            s.pushed_total,
            s.admitted_total,
            s.released_total,
            s.cancelled_total
        ),
        (2, 1, 1, 1)
    );
    assert_eq!((s.waiting, s.in_flight), (0, 0));
}

#[test]
fn lane_limit_update_and_duplicate_lane_names() {
    let q = q(1.0, None);
    q.add_lane("a", 2).unwrap();
    q.push(1, &["a", "a"], 0, Some(0.0)).unwrap();
    q.push(2, &["a"], 0, Some(0.0)).unwrap();
    q.push(3, &["a"], 0, Some(0.0)).unwrap();
    assert_eq!(q.try_admit(Some(0.0)).unwrap(), vec![1, 2]);
    assert_eq!(q.in_flight("a").unwrap(), 2);
    q.add_lane("a", 1).unwrap();
    q.release(1).unwrap();
    assert_eq!(q.try_admit(Some(0.0)).unwrap(), Vec::<EntryId>::new());
    q.add_lane("a", 3).unwrap();
    assert_eq!(q.try_admit(Some(0.0)).unwrap(), vec![3]);
    let s = q.stats();
    assert_eq!(
        s.lanes,
        vec![LaneStats {
            name: "a".into(),
            max_in_flight: 3,
            in_flight: 2,
            waiting: 0
        }]
    );
}

#[test]
fn internal_clock_origin() {
    let q = q(1.0, None).with_clock_origin(1000.0);
    let t = q.now();
    assert!((1000.0..1001.0).contains(&t));
    q.add_lane("a", 1).unwrap();
    q.push(1, &["a"], 0, None).unwrap();
    assert_eq!(q.try_admit(None).unwrap(), vec![1]);
}

#[test]
fn many_entries_behind_full_lane_are_cheap() {
    let q = q(1.0, None);
    q.add_lane("a", 1).unwrap();
    q.add_lane("b", 100_000).unwrap();
    for id in 0..50_000 {
        q.push(id, &["a"], id % 7, Some(id as f64 * 1e-3)).unwrap();
    }
    assert_eq!(q.try_admit(Some(100.0)).unwrap().len(), 1);
    let t = Instant::now();
    for _ in 0..1000 {
        assert!(q.try_admit(Some(100.0)).unwrap().is_empty());
    }
    assert!(
        t.elapsed().as_secs_f64() < 1.0,
        "try_admit should not scan blocked entries"
    );
    assert_eq!(q.len(), 49_999);
}

// ---------------------------------------------------------------- proptest

const LANES: [&str; 3] = ["x", "y", "z"];

#[derive(Debug, Clone)]
enum Op {
    Limit(usize, usize),
    Push(EntryId, Vec<usize>, i64),
    Admit,
    Release(EntryId),
    Cancel(EntryId),
    Tick(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0..3usize, 0..4usize).prop_map(|(l, m)| Op::Limit(l, m)),
        4 => (0..24i64, proptest::collection::vec(0..3usize, 1..3), -3..4i64)
            .prop_map(|(id, l, p)| Op::Push(id, l, p)),
        3 => Just(Op::Admit),
        2 => (0..24i64).prop_map(Op::Release),
        1 => (0..24i64).prop_map(Op::Cancel),
        2 => (0..8u8).prop_map(Op::Tick),
    ]
}

/// Naive reference: a full sort of the waiting entries on every admit.
#[derive(Default)]
struct Model {
    limits: [usize; 3],
    in_flight: [usize; 3],
    waiting: Vec<(EntryId, BTreeSet<usize>, i64, f64, u64)>,
    running: HashMap<EntryId, BTreeSet<usize>>,
    seq: u64,
}

impl Model {
    /// Waiting ids in consideration order at `now` (expired first, longest
    /// wait first; then effective priority; FIFO on ties).
    fn order(&self, now: f64, rate: f64, max_wait: Option<f64>) -> Vec<usize> {
        let expired = |t: f64| max_wait.is_some_and(|w| now - t > w);
        let key = |e: &(EntryId, BTreeSet<usize>, i64, f64, u64)| {
            if expired(e.3) {
                (0, e.3)
            } else {
                (1, e.2 as f64 - rate * (now - e.3))
            }
        };
        let mut order: Vec<usize> = (0..self.waiting.len()).collect();
        order.sort_by(|&a, &b| {
            let (ea, eb) = (&self.waiting[a], &self.waiting[b]);
            key(ea).partial_cmp(&key(eb)).unwrap().then(ea.4.cmp(&eb.4))
        });
        order
    }

    fn admit(&mut self, now: f64, rate: f64, max_wait: Option<f64>) -> Vec<EntryId> {
        let mut out = Vec::new();
        for i in self.order(now, rate, max_wait) {
            let lanes = &self.waiting[i].1;
            if lanes.iter().all(|&l| self.in_flight[l] < self.limits[l]) {
                lanes.iter().for_each(|&l| self.in_flight[l] += 1);
                out.push(self.waiting[i].0);
            }
        }
        self.waiting.retain(|e| !out.contains(&e.0));
        out
    }
}

#[test]
fn concurrent_push_admit_release_is_consistent() {
    use std::sync::Arc;
    let q = Arc::new(AdmissionQueue::new(1.0, None).unwrap());
    q.add_lane("a", 3).unwrap();
    let threads: Vec<_> = (0..4i64)
        .map(|t| {
            let q = Arc::clone(&q);
            std::thread::spawn(move || {
                let mut mine = 0;
                for i in 0..2000 {
                    q.push(t * 1_000_000 + i, &["a"], i % 3, None).unwrap();
                    for id in q.try_admit(None).unwrap() {
                        assert!(q.in_flight("a").unwrap() <= 3);
                        q.release(id).unwrap();
                        mine += 1;
                    }
                }
                mine
            })
        })
        .collect();
    let admitted: u64 = threads.into_iter().map(|h| h.join().unwrap()).sum();
    let rest = q.try_admit(None).unwrap().len() as u64;
    let s = q.stats();
    assert_eq!(s.pushed_total, 8000);
    assert_eq!(s.admitted_total, admitted + rest);
    assert_eq!(q.in_flight("a").unwrap() as u64, rest);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The queue matches a naive full-sort model op by op, never pushes a
    /// lane over its limit, and every pushed entry ends admitted or
    /// cancelled exactly once.
    #[test]
    fn matches_reference_model(
        ops in proptest::collection::vec(op(), 1..80),
        rate in prop_oneof![Just(0.0), Just(0.5), Just(1.0), Just(2.0)],
        max_wait in prop_oneof![Just(None), Just(Some(1.0)), Just(Some(3.0))],
    ) {
        let q = AdmissionQueue::new(rate, max_wait).unwrap();
        let mut m = Model::default();
        for l in LANES { q.add_lane(l, 0).unwrap(); }
        let mut now = 0.0f64;
        let mut pushed: Vec<EntryId> = Vec::new();
        let mut finished: Vec<EntryId> = Vec::new(); // admitted or cancelled while waiting
        for op in ops {
            match op {
                Op::Limit(l, n) => { q.add_lane(LANES[l], n).unwrap(); m.limits[l] = n; }
                Op::Tick(d) => now += d as f64 * 0.5,
                Op::Push(id, lanes, p) => {
                    let names: Vec<&str> = lanes.iter().map(|&l| LANES[l]).collect();
                    let dup = m.running.contains_key(&id) || m.waiting.iter().any(|e| e.0 == id);
                    let r = q.push(id, &names, p, Some(now));
                    prop_assert_eq!(r.is_err(), dup);
                    if !dup {
                        m.waiting.push((id, lanes.into_iter().collect(), p, now, m.seq));
                        m.seq += 1;
                        pushed.push(id);
                    }
                }
                Op::Admit => {
                    let want_order: Vec<EntryId> =
                        m.order(now, rate, max_wait).into_iter().map(|i| m.waiting[i].0).collect();
                    prop_assert_eq!(q.waiting_ids(Some(now)).unwrap(), want_order);
                    let before: Vec<usize> = LANES.iter().map(|l| q.in_flight(l).unwrap()).collect();
                    let lanes_of: HashMap<EntryId, BTreeSet<usize>> =
                        m.waiting.iter().map(|e| (e.0, e.1.clone())).collect();
                    let want = m.admit(now, rate, max_wait);
                    let got = q.try_admit(Some(now)).unwrap();
                    prop_assert_eq!(&got, &want);
                    for id in got {
                        m.running.insert(id, lanes_of[&id].clone());
                        finished.push(id);
                    }
                    for (i, l) in LANES.iter().enumerate() {
                        let after = q.in_flight(l).unwrap();
                        prop_assert!(after <= m.limits[i].max(before[i]));
                        prop_assert_eq!(after, m.in_flight[i]);
                    }
                }
                Op::Release(id) => {
                    let r = q.release(id);
                    match m.running.remove(&id) {
                        Some(ls) => { prop_assert!(r.is_ok()); ls.iter().for_each(|&l| m.in_flight[l] -= 1); }
                        None => prop_assert!(matches!(r, Err(PdgateError::NotFound(_)))),
                    }
                }
                Op::Cancel(id) => {
                    let r = q.cancel(id);
                    if let Some(ls) = m.running.remove(&id) {
                        prop_assert!(r);
                        ls.iter().for_each(|&l| m.in_flight[l] -= 1);
                    } else if let Some(pos) = m.waiting.iter().position(|e| e.0 == id) {
                        prop_assert!(r);
                        m.waiting.remove(pos);
                        finished.push(id);
                    } else {
                        prop_assert!(!r);
                    }
                }
            }
            prop_assert_eq!(q.len(), m.waiting.len());
        }
        // Drain: open every lane wide and release everything.
        for l in LANES { q.add_lane(l, usize::MAX).unwrap(); }
        for id in m.running.keys() { q.release(*id).unwrap(); }
        finished.extend(q.try_admit(Some(now)).unwrap());
        prop_assert!(q.is_empty());
        let mut a = pushed.clone(); a.sort_unstable();
        let mut b = finished.clone(); b.sort_unstable();
        // Multiset equality: ids may be reused after they finish, so each
        // push must be matched by exactly one admission or cancellation.
        prop_assert_eq!(a, b);
    }

    /// With a single wide-open lane, admission order is sorted by effective
    /// priority at admission time, FIFO among equals.
    #[test]
    fn admission_order_respects_effective_priority(
        entries in proptest::collection::vec((-5..5i64, 0..10u8), 1..40),
        rate in prop_oneof![Just(0.0), Just(0.5), Just(1.0)],
    ) {
        let q = AdmissionQueue::new(rate, None).unwrap();
        q.add_lane("a", usize::MAX).unwrap();
        let mut t = 0.0;
        let mut pushed = Vec::new();
        for (i, (p, dt)) in entries.iter().enumerate() {
            t += *dt as f64;
            q.push(i as EntryId, &["a"], *p, Some(t)).unwrap();
            pushed.push((*p as f64, t));
        }
        let now = t + 1.0;
        let got = q.try_admit(Some(now)).unwrap();
        prop_assert_eq!(got.len(), entries.len());
        let eff = |id: EntryId| { let (p, t) = pushed[id as usize]; p - rate * (now - t) };
        for w in got.windows(2) {
            prop_assert!(eff(w[0]) < eff(w[1]) || (eff(w[0]) == eff(w[1]) && w[0] < w[1]));
        }
    }
}
