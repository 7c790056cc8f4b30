"""Gateway-wide queue of a late-binding route policy (``pooled``).

A route policy with ``late_binding = True`` does not bind a request at
arrival. :meth:`LateBinding.place` queues the request and resolves it with a
:class:`~pdgate.policies.base.RouteDecision` once the policy finds an
executor with room for it (:meth:`LateBindingPolicy.place`). Dispatch rounds
run on arrival, whenever an instance finishes a prefill or a decode (the
instances' ``listener``), and every ``tick_s`` while anything waits, so a
missed event delays a request by one tick, never forever.

The chosen instance's prompt is recorded at once (``add_prefill``) so that
the next request of the same round sees the executor taken; the legs
record it again under the same request id (idempotent), and release it.

Metrics: ``pdgate_admission_waiting_requests`` (queued requests) and
``pdgate_admission_wait_seconds`` (time queued), as for admission queues.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any, Protocol

from pdgate.policies.base import RequestInfo, RouteContext, RouteDecision


class LateBindingPolicy(Protocol):
    """What :class:`LateBinding` needs of a route policy."""

    def has_capacity(self, ctx: RouteContext) -> bool:
        """Whether any executor could take a request now."""
        ...

    def order_key(self, req: RequestInfo, waited_s: float, seq: int) -> Any:
        """Sort key of a waiting request (smallest goes first)."""
        ...

    def place(self, ctx: RouteContext, req: RequestInfo) -> RouteDecision | None:
        """A decision among the free executors, or ``None`` to keep waiting."""
        ...


@dataclass
class _Entry:
    info: RequestInfo
    fut: "asyncio.Future[RouteDecision]"
    t0: float
    seq: int


class LateBinding:
    """One queue of requests waiting for their route (see the module docstring).

    Args:
        ctx: the route context (fleet, predictor, config).
        policy: a late-binding route policy.
        scan: entries tried per dispatch round.
        tick_s: dispatch period while requests wait (seconds).
        metrics: gateway metrics (optional).
    """

    def __init__(self, ctx: RouteContext, policy: LateBindingPolicy, *, scan: int = 8, tick_s: float = 0.02,
                 metrics: Any = None) -> None:
        self.ctx = ctx
        self.policy = policy
        self.scan = scan
        self.tick_s = tick_s
        self.metrics = metrics
        self._waiting: dict[int, _Entry] = {}
        self._seq = itertools.count()
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ticker: asyncio.Task[None] | None = None

    def waiting(self) -> int:
        """Requests queued now."""
        return len(self._waiting)

    async def place(self, info: RequestInfo) -> RouteDecision:
        """Wait until the policy routes ``info``; returns the decision.

        With nobody queued and an executor free, this returns without
        waiting. Cancelling the caller removes the request from the queue
        (and releases an executor already chosen for it).

        Raises:
            asyncio.CancelledError: cancelled while queued.
        """
        self._loop = asyncio.get_running_loop()
        for inst in self.ctx.fleet.instances:
            if inst.listener is None:
                inst.listener = self.kick
        if not self._waiting:
            d = self.policy.place(self.ctx, info)
            if d is not None:
                self._reserve(d, info)
                return d
        seq = next(self._seq)
        entry = _Entry(info, self._loop.create_future(), time.monotonic(), seq)
        self._waiting[seq] = entry
        self._pump()
        if not entry.fut.done() and (self._ticker is None or self._ticker.done()):
            self._ticker = asyncio.ensure_future(self._tick())
        try:
            d = await entry.fut
        except BaseException:
            self._waiting.pop(seq, None)
            if entry.fut.done() and not entry.fut.cancelled():
                self._unreserve(entry.fut.result(), info)
            self._gauge()
            raise
        if self.metrics is not None:
            self.metrics.admission_wait.observe(time.monotonic() - entry.t0)
        return d

    def kick(self) -> None:
        """Capacity may have freed: run a dispatch round soon (coalesced; any thread)."""
        if self._scheduled or not self._waiting or self._loop is None or self._loop.is_closed():
            return
        self._scheduled = True
        self._loop.call_soon_threadsafe(self._pump)

    async def _tick(self) -> None:
        while self._waiting:
            await asyncio.sleep(self.tick_s)
            self._pump()

    def _pump(self) -> None:
        """One dispatch round: the first ``scan`` waiting requests in the policy's
        order each take a free executor the policy accepts for them."""
        self._scheduled = False
        if self._waiting and self.policy.has_capacity(self.ctx):
            now = time.monotonic()
            key = self.policy.order_key
            order = sorted(self._waiting.values(), key=lambda e: key(e.info, now - e.t0, e.seq))
            for e in order[:self.scan]:
                if e.fut.done():
                    self._waiting.pop(e.seq, None)
                    continue
                if e is not order[0] and not self.policy.has_capacity(self.ctx):
                    break
                try:
                    d = self.policy.place(self.ctx, e.info)
                except ValueError:  # no candidates of some role: let the legs fail clearly
                    d = RouteDecision("decode_only")
                if d is None:
                    continue
                self._reserve(d, e.info)
                del self._waiting[e.seq]
                e.fut.set_result(d)
        self._gauge()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.admission_waiting.set(len(self._waiting))

    @staticmethod
    def _executor(d: RouteDecision) -> Any:
        return d.prefill if d.kind == "pd" else d.decode

    def _reserve(self, d: RouteDecision, info: RequestInfo) -> None:
        inst = self._executor(d)
        if inst is not None:
            inst.add_prefill(info.request_id, info.tokens)

    def _unreserve(self, d: RouteDecision, info: RequestInfo) -> None:
        inst = self._executor(d)
        if inst is not None:
            inst.done_prefill(info.request_id)
