//! Bindings for the admission queue: `pdgate._native.AdmissionQueue`.
//!
//! Every call into the core runs inside `py.allow_threads`, so a thread
//! waiting on the queue's mutex never holds the GIL.
use pdgate_core::admission::{AdmissionQueue as CoreQueue, EntryId};
use pdgate_core::PdgateError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_py;

/// Thread-safe priority admission queue with aging and per-lane limits.
///
/// AdmissionQueue(aging_rate=1.0, max_wait=None)
///
/// Requests wait here before being dispatched. Each entry names one or more
/// lanes (named concurrency limits, see `add_lane`) and is admitted only when
/// every one of them is below its limit. Priorities follow vLLM: LOWER is
/// more urgent. Order of consideration: entries that waited longer than
/// `max_wait` seconds first (longest wait first), then the rest by effective
/// priority `priority - aging_rate * waited_seconds`, FIFO on ties.
/// `try_admit` admits every entry that fits; one that does not fit does not
/// block later ones.
///
/// Args:
///     aging_rate: priority units gained per second of waiting (>= 0;
///         0 disables aging).
///     max_wait: starvation bound in seconds (>= 0), or None for no bound.
///
/// Times (`now` arguments) are seconds on a monotonic clock; the default is
/// the queue's internal clock, which reads like `time.monotonic()`.
/// Complexity: push/cancel/release O(log n); try_admit O((admitted +
/// distinct lane sets) * log n), independent of entries stuck behind full
/// lanes.
///
/// Raises:
///     InvalidArgumentError: aging_rate or max_wait negative or not finite.
#[pyclass(module = "pdgate._native", name = "AdmissionQueue", frozen)]
pub struct PyAdmissionQueue {
    inner: CoreQueue,
}

#[pymethods]
impl PyAdmissionQueue {
    #[new]
    // Keep the literal in sync with `DEFAULT_AGING_RATE` (a literal gives a
    // readable `__text_signature__`).
    #[pyo3(signature = (aging_rate = 1.0, max_wait = None))]
    fn new(py: Python<'_>, aging_rate: f64, max_wait: Option<f64>) -> PyResult<Self> {
        let origin: f64 = py.import("time")?.call_method0("monotonic")?.extract()?;
        let inner = CoreQueue::new(aging_rate, max_wait)
            .map_err(to_py)?
            .with_clock_origin(origin);
        Ok(Self { inner })
    }

    /// Aging rate, in priority units per second of waiting.
    #[getter]
    fn aging_rate(&self) -> f64 {
        self.inner.aging_rate()
    }

    /// Starvation bound in seconds, or None.
    #[getter]
    fn max_wait(&self) -> Option<f64> {
        self.inner.max_wait()
    }

    /// Current reading of the internal monotonic clock, in seconds (same
    /// scale as `time.monotonic()`).
    fn now(&self) -> f64 {
        self.inner.now()
    }

    /// Create lane `name` allowing `max_in_flight` concurrent entries, or
    /// update an existing lane's limit (lowering it evicts nothing; 0 stops
    /// admissions on the lane).
    ///
    /// Raises:
    ///     InvalidArgumentError: empty name or negative max_in_flight.
    fn add_lane(&self, py: Python<'_>, name: &str, max_in_flight: i64) -> PyResult<()> {
        let max = usize::try_from(max_in_flight).map_err(|_| {
            to_py(PdgateError::InvalidArgument(format!(
                "max_in_flight must be >= 0, got {max_in_flight}"
            )))
        })?;
        let q = &self.inner;
        py.allow_threads(|| q.add_lane(name, max)).map_err(to_py)
    }

    /// Queue `entry_id` (a signed 64-bit int, unique among waiting and
    /// in-flight entries) on `lanes` with `priority` (lower = more urgent),
    /// pushed at `now` seconds (None = internal clock). A lane named twice
    /// counts once.
    ///
    /// Raises:
    ///     InvalidArgumentError: duplicate entry_id, empty lanes, or
    ///         non-finite now.
    ///     NotFoundError: a lane that was never added.
    #[pyo3(signature = (entry_id, lanes, priority = 0, now = None))]
    fn push(
        &self,
        py: Python<'_>,
        entry_id: EntryId,
        lanes: Vec<String>,
        priority: i64,
        now: Option<f64>,
    ) -> PyResult<()> {
        let q = &self.inner;
        py.allow_threads(|| q.push(entry_id, &lanes, priority, now))
            .map_err(to_py)
    }

    /// Admit, at `now` seconds (None = internal clock), every waiting entry
    /// whose lanes all have capacity, in queue order; they count against
    /// their lanes until `release`d. Returns their ids in admission order.
    ///
    /// Raises:
    ///     InvalidArgumentError: non-finite now.
    #[pyo3(signature = (now = None))]
    fn try_admit(&self, py: Python<'_>, now: Option<f64>) -> PyResult<Vec<EntryId>> {
        let q = &self.inner;
        py.allow_threads(|| q.try_admit(now)).map_err(to_py)
    }

    /// Mark in-flight `entry_id` finished and free its lane slots.
    ///
    /// Raises:
    ///     NotFoundError: entry_id is not in flight (unknown, waiting, or
    ///         already released).
    fn release(&self, py: Python<'_>, entry_id: EntryId) -> PyResult<()> {
        let q = &self.inner;
        py.allow_threads(|| q.release(entry_id)).map_err(to_py)
    }

    /// Withdraw `entry_id`: remove it if waiting, release it if in flight.
    /// Returns True if it did either, False if the id is unknown (safe to
    /// call repeatedly, e.g. on client disconnect). Never raises.
    fn cancel(&self, py: Python<'_>, entry_id: EntryId) -> bool {
        let q = &self.inner;
        py.allow_threads(|| q.cancel(entry_id))
    }

    /// Number of admitted, unreleased entries using lane `lane`.
    ///
    /// Raises:
    ///     NotFoundError: a lane that was never added.
    fn in_flight(&self, py: Python<'_>, lane: &str) -> PyResult<usize> {
        let q = &self.inner;
        py.allow_threads(|| q.in_flight(lane)).map_err(to_py)
    }

    /// Waiting ids in the order `try_admit(now)` would consider them,
    /// ignoring capacity (None = internal clock). O(n log n): diagnostics.
    ///
    /// Raises:
    ///     InvalidArgumentError: non-finite now.
    #[pyo3(signature = (now = None))]
    fn waiting_ids(&self, py: Python<'_>, now: Option<f64>) -> PyResult<Vec<EntryId>> {
        let q = &self.inner;
        py.allow_threads(|| q.waiting_ids(now)).map_err(to_py)
    }

    /// Snapshot as a dict: waiting, in_flight (entries), pushed_total,
    /// admitted_total, released_total, cancelled_total (counters), and
    /// lanes: {name: {"max_in_flight", "in_flight", "waiting"}}.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let q = &self.inner;
        let s = py.allow_threads(|| q.stats());
        let d = PyDict::new(py);
        d.set_item("waiting", s.waiting)?;
        d.set_item("in_flight", s.in_flight)?;
        d.set_item("pushed_total", s.pushed_total)?;
        d.set_item("admitted_total", s.admitted_total)?;
        d.set_item("released_total", s.released_total)?;
        d.set_item("cancelled_total", s.cancelled_total)?;
        let lanes = PyDict::new(py);
        for l in s.lanes {
            let ld = PyDict::new(py);
            ld.set_item("max_in_flight", l.max_in_flight)?;
            ld.set_item("in_flight", l.in_flight)?;
            ld.set_item("waiting", l.waiting)?;
            lanes.set_item(l.name, ld)?;
        }
        d.set_item("lanes", lanes)?;
        Ok(d)
    }

    /// Number of waiting (not yet admitted) entries.
    fn __len__(&self, py: Python<'_>) -> usize {
        let q = &self.inner;
        py.allow_threads(|| q.len())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let q = &self.inner;
        let s = py.allow_threads(|| q.stats());
        format!(
            "AdmissionQueue(aging_rate={:?}, max_wait={}, waiting={}, in_flight={}, lanes={})",
            q.aging_rate(),
            q.max_wait()
                .map_or("None".to_string(), |w| format!("{w:?}")),
            s.waiting,
            s.in_flight,
            s.lanes.len()
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyAdmissionQueue>()?;
    Ok(())
}
