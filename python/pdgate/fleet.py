"""Fleet state as the gateway sees it: instances, their roles and load.

The gateway keeps its own per-instance counters, updated on every dispatch and
completion (a request counts against an instance until its response stream
ends, not when headers arrive). Later policies read richer state from here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from pdgate.config import GatewayConfig, Role


@dataclass
class Instance:
    """One vLLM instance and the gateway's live view of it.

    Attributes:
        url: base URL (no ``/v1``).
        role: ``prefill``, ``decode`` or ``both``.
        in_flight: requests (legs) dispatched to it and not yet finished.
        healthy: last known health (instances marked unhealthy are skipped
            while any healthy candidate exists).
    """

    url: str
    role: Role
    in_flight: int = 0
    healthy: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def acquire(self) -> None:
        """Count one more leg in flight on this instance."""
        with self._lock:
            self.in_flight += 1

    def release(self) -> None:
        """Count one leg as finished (never below zero)."""
        with self._lock:
            self.in_flight = max(0, self.in_flight - 1)


class Fleet:
    """The set of instances behind the gateway, grouped by role."""

    def __init__(self, instances: list[Instance]) -> None:
        self.instances = instances

    @classmethod
    def from_config(cls, config: GatewayConfig) -> "Fleet":
        """Build the fleet from a validated config."""
        return cls([Instance(url=i.url, role=i.role) for i in config.instances()])

    def by_role(self, role: Role) -> list[Instance]:
        """Instances that can serve ``role`` (``both`` serves either)."""
        return [i for i in self.instances if i.role == role or i.role == "both"]

    def candidates(self, role: Role) -> list[Instance]:
        """Healthy instances for ``role``; all of them if none is healthy."""
        pool = self.by_role(role)
        healthy = [i for i in pool if i.healthy]
        return healthy or pool
