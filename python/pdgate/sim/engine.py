"""The asynchronous step loop of a simulated instance, on a scaled clock.

:class:`SimClock` maps wall time to simulated time: ``sim = (wall - t0) *
time_scale`` (seconds), so ``time_scale=10`` runs ten times faster than real
time. :class:`SimEngine` repeatedly asks its :class:`Scheduler` for a step,
sleeps for the modeled step time (``duration / time_scale`` wall seconds),
then applies the step at the actual (possibly late) sim time; lateness is
recorded as *loop lag* (``pdgate_sim_loop_lag_seconds``) so overload of the
simulating host is visible instead of silently distorting results.

KV transfers into a consumer (decode) instance run one at a time per
instance (a single pull link): a transfer starts at ``max(now, link_free)``
and takes ``Profile.transfer_time(tokens)``. When it ends the consumer
resumes and the producer's held blocks are freed (the NixlConnector
"read done" notification); if the producer no longer holds them (expired,
unknown engine) the load fails and the consumer recomputes the prompt
(vLLM's ``kv_load_failure_policy=recompute``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import time
import zlib
from typing import Callable

from pdgate.sim.metrics import EngineMetrics
from pdgate.sim.profiles import Profile
from pdgate.sim.scheduler import Scheduler, SimRequest, Status
from pdgate.sim.trace import ENV as TRACE_ENV
from pdgate.sim.trace import EngineTrace

log = logging.getLogger("pdgate.sim")

#: Wall seconds an engine may run behind the clock before lag is kept (see ``_loop``).
CATCHUP_WALL_S = 0.02


class SimClock:
    """Simulated seconds since start, ``time_scale`` times faster than wall time."""

    def __init__(self, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = time_scale
        self.t0 = time.monotonic()

    def now(self) -> float:
        """Current simulated time, seconds."""
        return (time.monotonic() - self.t0) * self.time_scale

    def wall_delay(self, sim_t: float) -> float:
        """Wall seconds until simulated time ``sim_t`` (may be negative)."""
        return self.t0 + sim_t / self.time_scale - time.monotonic()

    async def sleep_until(self, sim_t: float) -> None:
        d = self.wall_delay(sim_t)
        if d > 0:
            await asyncio.sleep(d)


class SimEngine:
    """One simulated vLLM engine (scheduler + step loop + timers).

    Args:
        profile: instance profile.
        clock: shared simulated clock.
        engine_id: unique id, used as ``remote_engine_id`` in P/D params.
        policy: ``fcfs`` or ``priority``.
        registry: engine id -> engine, shared by the engines of one process
            (a consumer frees its producer's blocks through it).
        trace_dir: write step and request traces there (:mod:`pdgate.sim.trace`);
            default ``$PDGATE_SIM_TRACE_DIR``, unset: no trace.
    """

    def __init__(self, profile: Profile, clock: SimClock, engine_id: str, policy: str = "fcfs",
                 registry: dict[str, "SimEngine"] | None = None, enable_prefix_caching: bool = True,
                 trace_dir: str | None = None) -> None:
        self.profile = profile
        self.clock = clock
        self.engine_id = engine_id
        self.sched = Scheduler(profile, policy, enable_prefix_caching, seed=zlib.crc32(engine_id.encode()))
        self.registry = registry if registry is not None else {}
        self.registry[engine_id] = self
        self.metrics = EngineMetrics()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._tseq = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._link_free_s = 0.0
        self.steps = 0
        self.busy_s = 0.0
        trace_dir = trace_dir or os.environ.get(TRACE_ENV)
        self.trace = EngineTrace(trace_dir, engine_id) if trace_dir else None

    # -- control -------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-{self.engine_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.registry.pop(self.engine_id, None)
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    def call_at(self, sim_t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the step loop at simulated time ``sim_t``."""
        heapq.heappush(self._timers, (sim_t, next(self._tseq), fn))
        self._wake.set()

    def submit(self, req: SimRequest) -> None:
        """Hand a request to the scheduler (after the profile's API overhead)."""
        now = self.clock.now()
        req.arrival_s = now
        self.metrics.on_arrival(req)
        user_cb = req.on_token
        metrics = self.metrics

        def on_token(r: SimRequest, t: float) -> None:
            if self.trace is not None and r.seen_output == 0 and r.num_output >= 1:
                self.trace.first_token("pd" if r.kv_loaded_s is not None else "local", r.prompt_len, r.arrival_s,
                                       r.kv_loaded_s, t)
            if r.num_output > r.seen_output:
                metrics.on_tokens(r, t)
                r.seen_output = r.num_output
                r.prev_token_s = t
            if user_cb is not None:
                user_cb(r, t)

        req.on_token = on_token

        def add() -> None:
            if req.status == Status.ABORTED:
                return
            self.sched.add(req)

        if self.profile.request_overhead_s > 0:
            self.call_at(now + self.profile.request_overhead_s, add)
        else:
            add()
            self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """Abort a request (client disconnect)."""
        if req.status in (Status.FINISHED, Status.ABORTED, Status.HELD):
            return
        self.sched.abort(req, self.clock.now())
        self.metrics.aborted += 1
        self._wake.set()

    def release_held(self, request_id: str) -> bool:
        """Free a producer request's blocks (its consumer finished reading)."""
        ok = self.sched.release_held(request_id)
        if ok:
            self._wake.set()
        return ok

    # -- P/D -------------------------------------------------------------
    def _start_load(self, req: SimRequest, now: float) -> None:
        tokens = req.prompt_len - req.num_computed
        start = max(now, self._link_free_s)
        end = start + self.profile.transfer_time(tokens)
        self._link_free_s = end
        self.metrics.kv_transfers += 1
        self.metrics.kv_transfer_tokens += tokens

        def done() -> None:
            if req.status != Status.LOADING:
                return
            params = req.remote_prefill or {}
            producer = self.registry.get(str(params.get("remote_engine_id")))
            ok = producer is not None and producer.release_held(str(params.get("remote_request_id")))
            if ok:
                req.kv_loaded_s = self.clock.now()
                self.sched.kv_loaded(req)
            else:  # blocks gone on the prefill side: recompute locally
                self.metrics.kv_load_failures += 1
                req.status = Status.WAITING
            self.metrics.kv_transfer_time.observe(self.clock.now() - start)

        self.call_at(end, done)

    # -- loop ------------------------------------------------------------
    def _fire_timers(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, _, fn = heapq.heappop(self._timers)
            try:
                fn()
            except Exception:  # a timer bug must not kill the engine
                log.exception("sim timer failed in %s", self.engine_id)

    async def _run(self) -> None:
        while True:
            try:
                await self._loop()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep the instance alive; the bug shows in the log
                log.exception("sim engine %s step loop failed; restarting it", self.engine_id)
                await asyncio.sleep(0.01)

    async def _loop(self) -> None:
        next_expiry = 0.0
        self._t = self.clock.now()
        while True:
            now = self.clock.now()
            # Engine time runs behind the clock by at most CATCHUP_WALL_S: timer
            # granularity (epoll rounds sleeps up to 1 ms) is absorbed by
            # starting the next step at the previous step's modeled end;
            # beyond that the host is overloaded and the lag is kept (and counted).
            if now - self._t > CATCHUP_WALL_S * self.clock.time_scale:
                self._t = now
            else:
                now = max(self._t, now - CATCHUP_WALL_S * self.clock.time_scale)
            self._fire_timers(self.clock.now())
            if now >= next_expiry:
                self.sched.expire_held(now)
                next_expiry = now + 1.0
            plan = self.sched.schedule(now) if self.sched.has_work() else None
            if plan is not None:
                for r in plan.new_loads:
                    self._start_load(r, now)
                self.metrics.preemptions += len(plan.preempted)
            if plan is not None and plan.scheduled:
                # a step cannot start before its requests arrived (engine time may trail the clock)
                now = max(now, max(r.arrival_s for r, _ in plan.scheduled))
                end = now + plan.duration_s
                await self.clock.sleep_until(end)
                self.metrics.loop_lag.observe(max(0.0, self.clock.now() - end))
                self.steps += 1
                self.busy_s += plan.duration_s
                if self.trace is not None:
                    self.trace.step(now, plan.duration_s, plan.prefill_tokens, plan.decode_seqs,
                                    len(self.sched.waiting), len(self.sched.running))
                self._t = end
                for req in self.sched.finish_step(plan, end):
                    self.metrics.on_finish(req)
                continue
            self._wake.clear()
            timeout = None
            if self._timers:
                timeout = max(0.0, self.clock.wall_delay(self._timers[0][0]))
            if self.sched.held:
                t = max(0.0, self.clock.wall_delay(next_expiry))
                timeout = t if timeout is None else min(timeout, t)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self._t = self.clock.now()
