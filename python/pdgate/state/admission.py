"""Asyncio front of the Rust :class:`pdgate._native.AdmissionQueue`.

A prefill leg that an admission policy gates calls :meth:`AsyncAdmission.wait`
with its lanes (each ``(name, limit)``) and priority; it returns once the
queue admits it. :meth:`release` frees its lanes when the leg ends. A waiter
cancelled (client disconnect) is removed with ``cancel()``, which also
covers the race where the queue admitted it just before the cancellation.
Every release or cancel re-runs ``try_admit``, so shorter entries pass a
blocked long one as soon as their lanes have room.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from pdgate._native import AdmissionQueue


class AsyncAdmission:
    """Priority admission with lanes, aging and a wait bound (lower priority value first).

    Args:
        aging_rate: priority units gained per second of waiting.
        max_wait_s: entries waiting longer than this go first.
        metrics: gateway metrics (``admission_waiting``, ``admission_wait``).
    """

    def __init__(self, aging_rate: float = 0.0, max_wait_s: float | None = None, metrics: Any = None) -> None:
        self.queue = AdmissionQueue(aging_rate=aging_rate, max_wait=max_wait_s)
        self.metrics = metrics
        self._ids = itertools.count(1)
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._lanes: dict[str, int] = {}

    def _lane(self, name: str, limit: int) -> None:
        if self._lanes.get(name) != limit:
            self.queue.add_lane(name, limit)
            self._lanes[name] = limit

    def _pump(self) -> None:
        for eid in self.queue.try_admit():
            fut = self._waiters.pop(eid, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
            elif fut is None or fut.cancelled():
                self.queue.cancel(eid)
        if self.metrics is not None:
            self.metrics.admission_waiting.set(len(self.queue))

    async def wait(self, lanes: list[tuple[str, int]], priority: int = 0) -> int:
        """Queue and wait for admission; returns the entry id to :meth:`release`.

        Raises:
            asyncio.CancelledError: cancelled while waiting (the entry is removed).
        """
        for name, limit in lanes:
            self._lane(name, limit)
        eid = next(self._ids)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[eid] = fut
        start = time.monotonic()
        self.queue.push(eid, [n for n, _ in lanes], priority=int(priority))
        self._pump()
        try:
            await fut
        except BaseException:
            self._waiters.pop(eid, None)
            self.queue.cancel(eid)
            self._pump()
            raise
        if self.metrics is not None:
            self.metrics.admission_wait.observe(time.monotonic() - start)
        return eid

    def release(self, entry_id: int) -> None:
        """The admitted leg ended: free its lanes and admit whoever fits (idempotent)."""
        self.queue.cancel(entry_id)
        self._pump()

    def in_flight(self, lane: str) -> int:
        return self.queue.in_flight(lane) if lane in self._lanes else 0

    def waiting(self) -> int:
        return len(self.queue)
