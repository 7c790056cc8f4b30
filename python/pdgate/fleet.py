"""Fleet state as the gateway sees it: instances, their roles, pools and load.

The gateway keeps its own per-instance counters, updated on every dispatch and
completion (a request counts against an instance until its response stream
ends, not when headers arrive):

- ``in_flight``: legs dispatched and not finished;
- ``outstanding_prefill_tokens``: prompt tokens dispatched for prefill (a
  prefill leg, or a deflected/decode-only request) and not yet prefilled;
- ``decode_batch`` and ``kv_tokens``: requests decoding there and the KV
  tokens they hold (prompt + tokens generated so far);
- ``deflected_in_flight``: deflected prefills not yet past their first token.

Scraped vLLM ``/metrics`` (:mod:`pdgate.state.scraper`) complement them in
:attr:`Instance.scraped`, with the time of the last good scrape so policies
can tell stale data (:meth:`Instance.scrape_fresh`).

Everything runs on the gateway's event loop; the lock only guards the
counters against use from other threads (tests, metrics rendering).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pdgate.config import GatewayConfig, HealthConfig, PoolRange, Role
from pdgate.health import CircuitBreaker, breaker_for


@dataclass
class Instance:
    """One vLLM instance and the gateway's live view of it.

    Attributes:
        url: base URL (no ``/v1``).
        role: ``prefill``, ``decode`` or ``both``.
        pool: context-length pool name or ``None``.
        in_flight: legs dispatched to it and not yet finished.
        healthy: last known health (instances marked unhealthy are skipped
            while any healthy candidate exists).
        outstanding_prefill_tokens: prompt tokens queued or being prefilled.
        prefill_jobs: request id -> prompt tokens of those prefills.
        deferred: ids among them held back in the admission queue behind
            every on-time request (predicted to miss their SLO anyway).
        decode_batch: requests decoding on it.
        decode_jobs: request id -> [KV tokens, TPOT SLO, output tokens] of those.
        kv_tokens: KV tokens held by the decoding requests.
        deflected_in_flight: deflected prefills not yet at their first token.
        scraped: last scraped vLLM gauges (``num_requests_running``,
            ``num_requests_waiting``, ``kv_cache_usage_perc``).
        scraped_at: ``time.monotonic()`` of the last good scrape (0 = never).
        breaker: circuit breaker (:mod:`pdgate.health`); an open one ejects
            the instance from routing.
        draining: set through the admin API: no new requests, in-flight ones finish.
        listener: called (no arguments, outside the lock) when a prefill or a
            decode here ends: capacity may have freed (late-binding dispatch).
    """

    url: str
    role: Role
    pool: str | None = None
    in_flight: int = 0
    healthy: bool = True
    outstanding_prefill_tokens: int = 0
    prefill_jobs: dict[str, int] = field(default_factory=dict)
    deferred: set[str] = field(default_factory=set)
    decode_batch: int = 0
    kv_tokens: int = 0
    decode_jobs: dict[str, list[Any]] = field(default_factory=dict)
    deflected_in_flight: int = 0
    scraped: dict[str, float] = field(default_factory=dict)
    scraped_at: float = 0.0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker, repr=False, compare=False)
    draining: bool = False
    listener: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def routable(self) -> bool:
        """Whether new requests may go here: not draining and the breaker closed."""
        return not self.draining and self.breaker.allows_requests()

    def acquire(self) -> None:
        """Count one more leg in flight on this instance."""
        with self._lock:
            self.in_flight += 1

    def release(self) -> None:
        """Count one leg as finished (never below zero)."""
        with self._lock:
            self.in_flight = max(0, self.in_flight - 1)

    # -- prefill work --------------------------------------------------------
    def add_prefill(self, request_id: str, tokens: int) -> None:
        """A prompt of ``tokens`` tokens was dispatched here for prefill."""
        with self._lock:
            tokens = max(0, int(tokens))
            self.outstanding_prefill_tokens += tokens - self.prefill_jobs.get(request_id, 0)
            self.prefill_jobs[request_id] = tokens

    def done_prefill(self, request_id: str) -> None:
        """That prompt is prefilled (or abandoned); idempotent."""
        with self._lock:
            self.deferred.discard(request_id)
            n = self.prefill_jobs.pop(request_id, None)
            if n is not None:
                self.outstanding_prefill_tokens = max(0, self.outstanding_prefill_tokens - n)
        if n is not None and self.listener is not None:
            self.listener()

    def queue_ahead(self) -> list[int]:
        """Prompt tokens a new on-time request would wait behind (deferred ones excluded)."""
        with self._lock:
            if not self.deferred:
                return list(self.prefill_jobs.values())
            return [n for r, n in self.prefill_jobs.items() if r not in self.deferred]

    # -- decode work ----------------------------------------------------------
    def add_decode(self, request_id: str, kv_tokens: int, tpot_slo_s: float | None = None,
                   output_tokens: int | None = None) -> None:
        """Request ``request_id`` holding ``kv_tokens`` KV tokens starts decoding here.

        ``tpot_slo_s`` is its time-per-output-token target (for TBT headroom),
        ``output_tokens`` the tokens it may generate (``max_tokens``).
        """
        with self._lock:
            if request_id in self.decode_jobs:
                return
            kv = max(0, int(kv_tokens))
            self.decode_jobs[request_id] = [kv, tpot_slo_s, output_tokens]
            self.decode_batch += 1
            self.kv_tokens += kv

    def grow_decode(self, request_id: str, tokens: int) -> None:
        """A decoding request generated ``tokens`` more tokens."""
        with self._lock:
            job = self.decode_jobs.get(request_id)
            if job is not None:
                job[0] += tokens
                self.kv_tokens += tokens

    def done_decode(self, request_id: str) -> None:
        """A decoding request finished; idempotent."""
        with self._lock:
            job = self.decode_jobs.pop(request_id, None)
            if job is not None:
                self.decode_batch = max(0, self.decode_batch - 1)
                self.kv_tokens = max(0, self.kv_tokens - int(job[0]))
        if job is not None and self.listener is not None:
            self.listener()

    def decode_tpot_slos(self) -> list[float]:
        """TPOT targets (seconds) of the requests decoding here that stated one."""
        with self._lock:
            return [float(j[1]) for j in self.decode_jobs.values() if j[1] is not None]

    def decode_targets(self) -> list[tuple[float, int]]:
        """(TPOT target, output tokens) of the decoding requests that stated both."""
        with self._lock:
            return [(float(j[1]), max(1, int(j[2]))) for j in self.decode_jobs.values()
                    if j[1] is not None and j[2] is not None]

    # -- scraped state ---------------------------------------------------------
    def scrape_fresh(self, stale_after_s: float, now: float | None = None) -> bool:
        """Whether the scraped gauges are younger than ``stale_after_s`` seconds."""
        now = time.monotonic() if now is None else now
        return self.scraped_at > 0 and now - self.scraped_at <= stale_after_s

    def load_tokens(self) -> int:
        """Outstanding work in tokens: prompt tokens to prefill plus KV held."""
        return self.outstanding_prefill_tokens + self.kv_tokens

    def waiting_requests(self, stale_after_s: float = 1.0) -> int:
        """Queued requests: scraped ``num_requests_waiting`` when fresh, else the
        gateway's own prefill jobs."""
        own = len(self.prefill_jobs)
        if self.scrape_fresh(stale_after_s):
            return max(own, int(self.scraped.get("num_requests_waiting", 0)))
        return own

    def running_requests(self, stale_after_s: float = 1.0) -> int:
        """Requests in the instance's batch: scraped ``num_requests_running`` when
        fresh (it includes other gateway replicas' requests), else the
        gateway's own legs in flight here."""
        own = self.in_flight
        if self.scrape_fresh(stale_after_s):
            return max(own, int(self.scraped.get("num_requests_running", 0)))
        return own

    def snapshot(self) -> dict[str, object]:
        """A JSON-able view (``/health``, debug logs)."""
        return {"url": self.url, "role": self.role, "pool": self.pool, "healthy": self.healthy,
                "breaker": self.breaker.state, "draining": self.draining,
                "in_flight": self.in_flight,
                "outstanding_prefill_tokens": self.outstanding_prefill_tokens,
                "prefill_jobs": len(self.prefill_jobs), "decode_batch": self.decode_batch,
                "kv_tokens": self.kv_tokens, "deflected_in_flight": self.deflected_in_flight,
                "scraped": dict(self.scraped),
                "scrape_age_s": (round(time.monotonic() - self.scraped_at, 3)
                                 if self.scraped_at else None)}


class Fleet:
    """The set of instances behind the gateway, grouped by role and pool."""

    def __init__(self, instances: list[Instance], pools: dict[str, PoolRange] | None = None,
                 health: HealthConfig | None = None, metrics: Any = None) -> None:
        self.instances = instances
        self.pools = dict(pools or {})
        self.health = health
        self.metrics = metrics
        for i in instances:
            i.breaker = breaker_for(i, health, metrics)

    @classmethod
    def from_config(cls, config: GatewayConfig, metrics: Any = None) -> "Fleet":
        """Build the fleet from a validated config (``metrics``: the gateway's, for
        the health gauges)."""
        return cls([Instance(url=i.url, role=i.role, pool=i.pool) for i in config.instances()],
                   config.pools, config.health, metrics)

    def get(self, url: str) -> Instance | None:
        """The instance with base URL ``url`` (normalized as in the config), or ``None``."""
        for i in self.instances:
            if i.url == url:
                return i
        return None

    def add(self, url: str, role: Role, pool: str | None = None) -> Instance:
        """Add an instance at run time (admin API, discovery); returns it.

        The instance list is replaced, not mutated, so a request iterating
        the old list is unaffected.

        Raises:
            ValueError: an instance with that URL already exists.
        """
        if self.get(url) is not None:
            raise ValueError(f"instance {url} already in the fleet")
        inst = Instance(url=url, role=role, pool=pool)
        inst.breaker = breaker_for(inst, self.health, self.metrics)
        self.instances = [*self.instances, inst]
        return inst

    def remove(self, url: str) -> Instance | None:
        """Remove the instance at ``url`` from routing; returns it (``None`` if absent).

        Requests already dispatched to it finish normally; new ones no longer
        see it.
        """
        inst = self.get(url)
        if inst is not None:
            self.instances = [i for i in self.instances if i is not inst]
        return inst

    def by_role(self, role: Role) -> list[Instance]:
        """Instances that can serve ``role`` (``both`` serves either)."""
        return [i for i in self.instances if i.role == role or i.role == "both"]

    def candidates(self, role: Role) -> list[Instance]:
        """Routable instances for ``role`` (not ejected by their breaker, not
        draining), the healthy-by-scrape ones first: all routable ones if none
        of them is; empty if none is routable (callers fail fast)."""
        pool = [i for i in self.by_role(role) if i.routable()]
        healthy = [i for i in pool if i.healthy]
        return healthy or pool

    def pool_for(self, tokens: int | None) -> str | None:
        """Name of the first pool whose range holds ``tokens`` (``None`` if none or unknown)."""
        if tokens is None:
            return None
        for name, rng in self.pools.items():
            if rng.contains(tokens):
                return name
        return None

    def in_pool(self, candidates: list[Instance], pool: str | None) -> list[Instance]:
        """Candidates of ``pool`` plus pool-less ones; all candidates if that leaves none."""
        if pool is None:
            return candidates
        chosen = [i for i in candidates if i.pool == pool or i.pool is None]
        return chosen or candidates
