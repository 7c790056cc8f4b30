"""Request limits and drain as a pure ASGI middleware (:class:`GuardMiddleware`).

Order of checks for every HTTP request:

1. header injection: a CR, LF or NUL in any header name or value -> 400;
2. header size: names + values + 4 bytes per header over
   ``limits.max_header_bytes`` -> 431;

and for API requests (``POST /v1/completions``, ``POST /v1/chat/completions``):

3. draining (SIGTERM received) -> 503 with ``Retry-After``;
4. per-client rate limit (token bucket keyed by peer IP or API key) -> 429
   with ``Retry-After`` (seconds until the bucket holds a token again);
5. concurrency (``limits.max_concurrent_requests``) -> 429 with ``Retry-After``.

An admitted API request counts in :attr:`Gate.in_flight` until its response
(a stream included) ends; the drain waits on that. Every refusal is counted
in ``pdgate_rejected_requests_total{reason}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable

from pdgate.config import DrainConfig, LimitsConfig
from pdgate.gateway.errors import error_response

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

API_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_BAD_HEADER_BYTES = re.compile(rb"[\r\n\x00]")  # CR, LF, NUL: header injection


class TokenBuckets:
    """Per-key token buckets (``rate`` tokens per second, ``burst`` at most),
    the ``max_keys`` most recently used kept."""

    def __init__(self, rate: float, burst: int, max_keys: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()

    def take(self, key: str) -> float:
        """Take one token for ``key``; returns 0 if granted, else the seconds until one is available."""
        now = self.clock()
        b = self._buckets.get(key)
        if b is None:
            b = [self.burst, now]
            self._buckets[key] = b
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            b[0] = min(self.burst, b[0] + (now - b[1]) * self.rate)
            b[1] = now
        if b[0] >= 1.0:
            b[0] -= 1.0
            return 0.0
        return (1.0 - b[0]) / self.rate


class Gate:
    """Shared admission state of one gateway: drain flag, in-flight count, buckets.

    Args:
        limits: limit settings.
        drain: drain settings (``Retry-After`` while draining).
        metrics: gateway metrics (``rejected``, ``api_in_flight``, ``draining``), optional.
    """

    def __init__(self, limits: LimitsConfig, drain: DrainConfig | None = None, metrics: Any = None) -> None:
        self.limits = limits
        self.drain = drain or DrainConfig()
        self.metrics = metrics
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.buckets = (TokenBuckets(limits.rate_limit_rps, limits.rate_limit_burst, limits.max_tracked_clients)
                        if limits.rate_limit_rps else None)

    def reject(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()

    def start_drain(self) -> None:
        """Refuse new API requests from now on (503)."""
        self.draining = True
        if self.metrics is not None:
            self.metrics.draining.set(1)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no API request is in flight, at most ``timeout_s`` seconds; returns whether idle."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return self.in_flight == 0

    def _enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()
        if self.metrics is not None:
            self.metrics.api_in_flight.set(self.in_flight)

    def _exit(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        if self.in_flight == 0:
            self._idle.set()
        if self.metrics is not None:
            self.metrics.api_in_flight.set(self.in_flight)

    def client_key(self, scope: Scope, headers: list[tuple[bytes, bytes]]) -> str:
        """The rate-limit key: the API key (``api_key`` mode, when sent) or the peer IP."""
        if self.limits.rate_limit_key == "api_key":
            for k, v in headers:
                if k.lower() == b"authorization" and v:  # hashed: no credentials kept in memory
                    return "key:" + hashlib.blake2b(v, digest_size=16).hexdigest()
        client = scope.get("client")
        return "ip:" + (client[0] if client else "unknown")


class GuardMiddleware:
    """ASGI middleware applying :class:`Gate` (see module doc)."""

    def __init__(self, app: ASGIApp, gate: Gate) -> None:
        self.app = app
        self.gate = gate

    async def _refuse(self, scope: Scope, receive: Any, send: Any, status: int, message: str, reason: str,
                      retry_after: float | None = None) -> None:
        self.gate.reject(reason)
        headers = {"Retry-After": str(max(0, math.ceil(retry_after)))} if retry_after is not None else None
        await error_response(status, message, headers=headers)(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gate = self.gate
        headers: list[tuple[bytes, bytes]] = scope.get("headers") or []
        size = 0
        for k, v in headers:
            size += len(k) + len(v) + 4
            if _BAD_HEADER_BYTES.search(k) or _BAD_HEADER_BYTES.search(v):
                await self._refuse(scope, receive, send, 400, "header with CR, LF or NUL refused",
                                   "header_injection")
                return
        if size > gate.limits.max_header_bytes:
            await self._refuse(scope, receive, send, 431,
                               f"request headers over {gate.limits.max_header_bytes} bytes", "header_too_large")
            return
        if scope.get("method") != "POST" or scope.get("path") not in API_PATHS:
            await self.app(scope, receive, send)
            return
        if gate.draining:
            await self._refuse(scope, receive, send, 503, "gateway is shutting down; retry on another replica",
                               "draining", gate.drain.retry_after_s)
            return
        if gate.buckets is not None:
            wait = gate.buckets.take(gate.client_key(scope, headers))
            if wait > 0:
                await self._refuse(scope, receive, send, 429, "rate limit exceeded for this client",
                                   "rate_limited", wait)
                return
        cap = gate.limits.max_concurrent_requests
        if cap is not None and gate.in_flight >= cap:
            await self._refuse(scope, receive, send, 429, f"gateway at its limit of {cap} concurrent requests",
                               "concurrency", gate.limits.retry_after_s)
            return
        gate._enter()
        try:
            await self.app(scope, receive, send)
        finally:
            gate._exit()
