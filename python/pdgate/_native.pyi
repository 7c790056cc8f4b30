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

# --- transfer ---
# KV block transfer engine over UCX (rust/pdgate-py/src/transfer.rs).

__all__ += ["TransferEngine", "fetch_metadata", "compat_hash"]

class _Notification(TypedDict):
    peer: str
    msg: bytes
    released_lease: str | None

@final
class TransferEngine:
    """KV block transfer engine over UCX (one-sided GET/PUT, zero-copy).

    A progress thread owns the UCX worker; no method does UCX work under the
    GIL. Sizes are bytes, times seconds. ``pdgate.transfer.create_engine``
    finds UCX in the libucx-cu12 wheel.

    Raises ``TransportError`` if UCX cannot be loaded or started,
    ``InvalidArgumentError`` for a bad engine_id or UCX option.
    """

    def __new__(
        cls,
        engine_id: str,
        compat: str = "",
        *,
        ucp_lib: str | None = None,
        transports: str | None = None,
        ucx_options: dict[str, str] | None = None,
        lease_slots: int = 4096,
    ) -> TransferEngine: ...
    @property
    def engine_id(self) -> str:
        """This engine's id."""
    @property
    def ucx_version(self) -> str:
        """Version of the loaded UCX, e.g. "1.22.0"."""
    def register(
        self,
        addr: int,
        length: int,
        block_len: int,
        block_stride: int = 0,
        block_count: int = 0,
        mem_type: str = "host",
    ) -> int:
        """Register caller-owned memory holding blocks; returns the region id.
        Raises InvalidArgumentError / TransportError."""
    def deregister(self, region: int) -> None:
        """Unregister. Raises NotFoundError, InvalidArgumentError (in use)."""
    def metadata(self) -> bytes:
        """Serialized metadata for peers."""
    def add_peer(self, metadata: bytes) -> str:
        """Validate and connect; returns the peer's engine id. Raises
        RejectedMetadataError, PeerUnreachableError."""
    def connect(self, addr: str, timeout_s: float = 5.0) -> str:
        """fetch_metadata(addr) + add_peer. Raises PeerUnreachableError,
        TransferTimeoutError, RejectedMetadataError."""
    def remove_peer(self, peer: str) -> None:
        """Disconnect a peer. Raises NotFoundError."""
    def read_blocks(
        self,
        peer: str,
        local_blocks: list[int],
        remote_blocks: list[int],
        *,
        regions: list[int] | None = None,
        remote_regions: list[int] | None = None,
        notify: bytes | str | None = None,
        lease: bytes | None = None,
        timeout_s: float = 30.0,
    ) -> int:
        """Pull blocks; returns a transfer id. Raises BlockOutOfRangeError,
        NotFoundError, PeerUnreachableError, InvalidArgumentError."""
    def write_blocks(
        self,
        peer: str,
        local_blocks: list[int],
        remote_blocks: list[int],
        *,
        regions: list[int] | None = None,
        remote_regions: list[int] | None = None,
        notify: bytes | str | None = None,
        timeout_s: float = 30.0,
    ) -> int:
        """Push blocks; returns a transfer id (same errors as read_blocks)."""
    def poll(self) -> tuple[list[int], list[tuple[int, PdgateError]]]:
        """Finished transfers since the last call: (done, [(id, error)])."""
    def wait(self, xfer_id: int, timeout_s: float | None = None) -> None:
        """Block until the transfer finishes; raises its error."""
    def get_notifications(self) -> list[_Notification]:
        """Notifications received since the last call."""
    def grant_lease(self, request_id: str, ttl_s: float) -> bytes:
        """Owner side: pin a request's blocks; returns the lease token."""
    def release_lease(self, request_id: str) -> bool:
        """Owner side: end a lease now; True if it was held."""
    def expired_leases(self) -> list[str]:
        """Owner side: request ids whose leases expired since the last call."""
    def listen(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve metadata over TCP; returns the bound port."""
    def event_fd(self) -> int:
        """Readable when transfers finish or notifications arrive."""
    def drain_event_fd(self) -> None:
        """Empty the event fd."""
    def close(self) -> None:
        """Stop the engine (idempotent)."""

def fetch_metadata(addr: str, timeout_s: float = 5.0) -> bytes:
    """Fetch a peer's metadata from its listen address ("host:port")."""

def compat_hash(desc: str) -> int:
    """64-bit hash of a KV layout description."""
