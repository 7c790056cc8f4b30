"""Type stubs for ``pdgate._native``, the Rust extension built from
``rust/pdgate-py`` (checked against the compiled module by
``tests/unit/test_native_stub.py`` with ``mypy.stubtest``).

Sections: errors, admission, then the transfer engine (appended by its
owner). Keep each section self-contained.
"""

from typing import TypedDict, final

__version__: str

# PyO3 builds the runtime ``__all__`` from every ``m.add``/``add_class``; each
# section extends this list with ``__all__ += [...]`` for its own names.
__all__ = [
    "__version__",
    "PdgateError",
    "InvalidArgumentError",
    "NotFoundError",
    "ClosedError",
    "PeerUnreachableError",
    "TransferTimeoutError",
    "RejectedMetadataError",
    "BlockOutOfRangeError",
    "LeaseExpiredError",
    "TransportError",
]

# --- errors ---
# One class per ``pdgate_core::PdgateError`` variant (rust/pdgate-py/src/errors.rs).

class PdgateError(Exception):
    """Base class of every error raised by ``pdgate._native``."""

class InvalidArgumentError(PdgateError):
    """An argument outside its documented domain."""

class NotFoundError(PdgateError):
    """A lane, entry or peer id that is not known."""

class ClosedError(PdgateError):
    """The engine or queue was closed/shut down."""

class PeerUnreachableError(PdgateError):
    """A transfer peer could not be reached."""

class TransferTimeoutError(PdgateError):
    """An operation did not complete within its deadline."""

class RejectedMetadataError(PdgateError):
    """Peer metadata bytes failed validation."""

class BlockOutOfRangeError(PdgateError):
    """A block id outside the registered region."""

class LeaseExpiredError(PdgateError):
    """The owner's lease on the blocks expired before the read."""

class TransportError(PdgateError):
    """Any other transport-level failure."""

# --- admission ---

__all__ += ["AdmissionQueue"]

class _LaneStats(TypedDict):
    max_in_flight: int
    in_flight: int
    waiting: int

class _AdmissionStats(TypedDict):
    waiting: int
    in_flight: int
    pushed_total: int
    admitted_total: int
    released_total: int
    cancelled_total: int
    lanes: dict[str, _LaneStats]

@final
class AdmissionQueue:
    """Thread-safe priority admission queue with aging and per-lane limits.

    Priorities: LOWER is more urgent. Order: entries that waited longer than
    ``max_wait`` seconds first (longest wait first), then by effective
    priority ``priority - aging_rate * waited_seconds``, FIFO on ties.
    ``try_admit`` admits every entry whose lanes all have capacity. Times are
    seconds on a monotonic clock (default: the internal clock, on the scale
    of ``time.monotonic()``).

    Raises ``InvalidArgumentError`` if ``aging_rate`` (priority units per
    second) or ``max_wait`` (seconds) is negative or not finite.
    """

    def __new__(cls, aging_rate: float = 1.0, max_wait: float | None = None) -> AdmissionQueue: ...
    @property
    def aging_rate(self) -> float:
        """Priority units gained per second of waiting."""
    @property
    def max_wait(self) -> float | None:
        """Starvation bound in seconds, or None."""
    def now(self) -> float:
        """Internal monotonic clock, in seconds."""
    def add_lane(self, name: str, max_in_flight: int) -> None:
        """Create or update a lane's limit. Raises InvalidArgumentError."""
    def push(
        self, entry_id: int, lanes: list[str], priority: int = 0, now: float | None = None
    ) -> None:
        """Queue an entry. Raises InvalidArgumentError (duplicate id, no
        lanes, bad now) or NotFoundError (unknown lane)."""
    def try_admit(self, now: float | None = None) -> list[int]:
        """Admit every entry that fits; returns ids in admission order."""
    def release(self, entry_id: int) -> None:
        """Free an in-flight entry's lanes. Raises NotFoundError."""
    def cancel(self, entry_id: int) -> bool:
        """Remove if waiting / release if in flight; False if unknown."""
    def in_flight(self, lane: str) -> int:
        """In-flight entries on ``lane``. Raises NotFoundError."""
    def waiting_ids(self, now: float | None = None) -> list[int]:
        """Waiting ids in consideration order (diagnostics, O(n log n))."""
    def stats(self) -> _AdmissionStats:
        """Counters and per-lane state."""
    def __len__(self) -> int:
        """Number of waiting entries."""
