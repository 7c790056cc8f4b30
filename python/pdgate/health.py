"""Per-instance circuit breaker and the active health checker.

Each :class:`pdgate.fleet.Instance` owns a :class:`CircuitBreaker`:

- ``closed``: the instance gets requests; ``failures_to_eject`` consecutive
  failures (active ``GET /health`` probes, or passive: connect errors,
  timeouts, 5xx answers of request legs) open it (an *ejection*);
- ``open``: no requests (``Fleet.candidates`` skips it) for ``cooldown_s``;
- ``half_open``: still no requests; the health probes decide: a failure
  opens it again, ``successes_to_readmit`` consecutive successes close it.
  With active checks off (``health.enabled: false``), half-open instead lets
  requests through as trials.

:class:`HealthChecker` probes every instance each ``interval_s`` seconds
(timeout ``timeout_s``) and exports ``pdgate_instance_healthy{instance,role}``
(1 = closed) and ``pdgate_instance_ejections_total{instance,role}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import httpx

from pdgate.background import BackgroundLoop

from pdgate.config import HealthConfig

if TYPE_CHECKING:  # pragma: no cover
    from pdgate.fleet import Fleet, Instance

log = logging.getLogger("pdgate.health")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    """Consecutive-failure breaker of one instance (see module doc).

    Args:
        config: thresholds and cooldown (seconds).
        on_change: called as ``on_change(old_state, new_state)`` on every transition.
        clock: monotonic time source in seconds (tests pass a fake one).
    """

    def __init__(self, config: HealthConfig | None = None,
                 on_change: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or HealthConfig()
        self.on_change = on_change
        self.clock = clock
        self._state = CLOSED
        self.failures = 0
        self.successes = 0
        self.opened_at = 0.0
        self.ejections = 0

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half_open`` (open turns half-open after the cooldown)."""
        if self._state == OPEN and self.clock() - self.opened_at >= self.config.cooldown_s:
            self._set(HALF_OPEN)
            self.successes = 0
        return self._state

    def allows_requests(self) -> bool:
        """Whether new requests may go to the instance."""
        s = self.state
        return s == CLOSED or (s == HALF_OPEN and not self.config.enabled)

    def _set(self, new: str) -> None:
        old, self._state = self._state, new
        if old != new and self.on_change is not None:
            try:
                self.on_change(old, new)
            except Exception:  # noqa: BLE001 - a metrics hook must not break routing
                log.exception("breaker on_change hook failed")

    def record_success(self) -> None:
        """A probe or request leg succeeded."""
        s = self.state
        if s == CLOSED:
            self.failures = 0
        elif s == HALF_OPEN:
            self.successes += 1
            if self.successes >= self.config.successes_to_readmit:
                self.failures = 0
                self._set(CLOSED)

    def record_failure(self) -> None:
        """A probe or request leg failed (connect error, timeout, 5xx)."""
        s = self.state
        if s == CLOSED:
            self.failures += 1
            if self.failures >= self.config.failures_to_eject:
                self.ejections += 1
                self.opened_at = self.clock()
                self._set(OPEN)
        elif s == HALF_OPEN:
            self.opened_at = self.clock()
            self._set(OPEN)

    def snapshot(self) -> dict[str, Any]:
        return {"state": self.state, "consecutive_failures": self.failures, "ejections": self.ejections}


def breaker_for(inst: "Instance", config: HealthConfig | None, metrics: Any = None) -> CircuitBreaker:
    """A breaker for ``inst`` that logs transitions and updates the health metrics."""
    def on_change(old: str, new: str) -> None:
        if new == OPEN and old == CLOSED:
            log.warning("instance %s (%s) ejected after %d consecutive failures", inst.url, inst.role,
                        b.failures)
            if metrics is not None:
                metrics.ejections.labels(inst.url, inst.role).inc()
        elif new == CLOSED:
            log.info("instance %s (%s) re-admitted", inst.url, inst.role)
        if metrics is not None:
            metrics.instance_healthy.labels(inst.url, inst.role).set(1.0 if new == CLOSED else 0.0)

    b = CircuitBreaker(config, on_change)
    if metrics is not None:
        metrics.instance_healthy.labels(inst.url, inst.role).set(1.0)
    return b


class HealthChecker(BackgroundLoop):
    """Background task probing ``GET {url}/health`` of every instance.

    Args:
        fleet: the instances (re-read every round, so added ones are probed).
        client: httpx client for the probes.
        config: interval and timeout, seconds.
    """

    task_name = "pdgate-health"

    def __init__(self, fleet: "Fleet", client: httpx.AsyncClient, config: HealthConfig) -> None:
        self.fleet = fleet
        self.client = client
        self.config = config


    async def probe(self, inst: "Instance") -> bool:
        """Probe one instance once and feed its breaker; returns whether it answered 200."""
        try:
            r = await self.client.get(f"{inst.url}/health", timeout=self.config.timeout_s)
            ok = r.status_code == 200
        except (httpx.HTTPError, OSError):
            ok = False
        if ok:
            inst.breaker.record_success()
        else:
            inst.breaker.record_failure()
        return ok

    async def check_once(self) -> None:
        """Probe every instance once, concurrently."""
        await asyncio.gather(*(self.probe(i) for i in self.fleet.instances))

    async def run_round(self) -> None:
        await self.check_once()
