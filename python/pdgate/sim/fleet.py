"""A fleet of simulated vLLM instances in one process, each on its own port.

Example::

    with SimFleet(n_prefill=2, n_decode=2, profile="h100-llama3-8b", time_scale=10) as fleet:
        fleet.prefill_urls, fleet.decode_urls   # hand these to a router

All instances share one event loop (a background thread for ``start()``,
or the caller's loop with ``astart()``) and one :class:`SimClock`.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from pdgate.sim.engine import SimClock, SimEngine
from pdgate.sim.http import start_server
from pdgate.sim.profiles import Profile, load_profile
from pdgate.sim.server import SimInstance

DEFAULT_MODEL = "sim-model"


class SimFleet:
    """``n_prefill`` prefill, ``n_decode`` decode and ``n_both`` aggregated instances.

    Args:
        n_prefill / n_decode / n_both: instance counts per role.
        profile: a :class:`Profile` or the name/path of one.
        time_scale: simulated seconds per wall second (10 = ten times faster).
        model: served model name.
        policy: scheduling policy, ``fcfs`` or ``priority``.
        host: listen address (loopback by default).
        ports: fixed ports in instance order (prefill, decode, both); default free ports.
        enable_prefix_caching: as vLLM's flag.
        role_overrides: per role (``prefill``, ``decode``, ``both``), profile
            fields replaced for that role's instances only, e.g. a decode
            pool with a smaller ``max_num_batched_tokens`` so a prefill
            chunk beside its decodes fits their TBT budget (Kairos).
        trace_dir: every engine writes its step and request traces there
            (:mod:`pdgate.sim.trace`); default ``$PDGATE_SIM_TRACE_DIR``.
        profile_overrides: fields replaced in the loaded profile.
    """

    def __init__(self, n_prefill: int = 1, n_decode: int = 1, n_both: int = 0, *,
                 profile: Profile | str = "cpu-tiny", time_scale: float = 1.0, model: str = DEFAULT_MODEL,
                 policy: str = "fcfs", host: str = "127.0.0.1", ports: list[int] | None = None,
                 enable_prefix_caching: bool = True, role_overrides: dict[str, dict[str, Any]] | None = None,
                 trace_dir: str | None = None, **profile_overrides: Any) -> None:
        if isinstance(profile, str):
            profile = load_profile(profile)
        if profile_overrides:
            profile = profile.replace(**profile_overrides)
        self.profile = profile
        self.role_overrides = {r: dict(v) for r, v in (role_overrides or {}).items() if v}
        unknown = set(self.role_overrides) - {"prefill", "decode", "both"}
        if unknown:
            raise ValueError(f"role_overrides: unknown roles {sorted(unknown)}")
        self.role_profiles = {r: profile.replace(**self.role_overrides.get(r, {}))
                              for r in ("prefill", "decode", "both")}
        self.time_scale = time_scale
        self.model = model
        self.policy = policy
        self.host = host
        self.roles = ["prefill"] * n_prefill + ["decode"] * n_decode + ["both"] * n_both
        self.ports = list(ports or [])
        if self.ports and len(self.ports) != len(self.roles):
            raise ValueError("need one port per instance")
        self.enable_prefix_caching = enable_prefix_caching
        self.trace_dir = trace_dir
        self.instances: list[SimInstance] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.clock: SimClock | None = None

    # -- urls ------------------------------------------------------------
    def urls(self, role: str | None = None) -> list[str]:
        return [i.url for i in self.instances if role is None or i.role == role]

    @property
    def prefill_urls(self) -> list[str]:
        return self.urls("prefill")

    @property
    def decode_urls(self) -> list[str]:
        return self.urls("decode")

    @property
    def both_urls(self) -> list[str]:
        return self.urls("both")

    # -- lifecycle in the caller's loop -------------------------------------
    async def astart(self) -> "SimFleet":
        self.clock = SimClock(self.time_scale)
        registry: dict[str, SimEngine] = {}
        for k, role in enumerate(self.roles):
            eng = SimEngine(self.role_profiles[role], self.clock, f"sim-{role}-{k}", self.policy, registry,
                            self.enable_prefix_caching, self.trace_dir)
            inst = SimInstance(eng, self.model, role, self.host)
            server = await start_server(inst.handle, self.host, self.ports[k] if self.ports else 0)
            inst.port = server.sockets[0].getsockname()[1]
            eng.start()
            self.instances.append(inst)
            self._servers.append(server)
        return self

    async def astop(self) -> None:
        for s in self._servers:
            s.close()
        for inst in self.instances:
            await inst.engine.stop()
        self._servers = []

    # -- lifecycle in a background thread ---------------------------------
    def start(self) -> "SimFleet":
        """Run the fleet in a daemon thread with its own event loop."""
        ready = threading.Event()
        err: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.astart())
            except BaseException as e:  # surface start errors to the caller
                err.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.astop())
            pending = asyncio.all_tasks(loop)
            for t in pending:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=main, name="sim-fleet", daemon=True)
        self._thread.start()
        ready.wait(30)
        if err:
            raise err[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = None

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` in the fleet's loop thread and return its result (thread-safe)."""
        if self._loop is None:
            return fn(*args)

        async def go() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(go(), self._loop).result(10)

    def __enter__(self) -> "SimFleet":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- reporting ------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Fleet shape, profile and time scale (print it with every result)."""
        return {"profile": self.profile.name, "time_scale": self.time_scale,
                "n_prefill": self.roles.count("prefill"), "n_decode": self.roles.count("decode"),
                "n_both": self.roles.count("both"), "policy": self.policy, "model": self.model,
                "role_overrides": self.role_overrides,
                "urls": {r: self.urls(r) for r in ("prefill", "decode", "both") if self.urls(r)}}

    def stats(self) -> list[dict[str, Any]]:
        """Per instance: steps, busy fraction, preemptions, loop lag (sim seconds)."""
        def snap() -> list[dict[str, Any]]:
            out = []
            for inst in self.instances:
                e = inst.engine
                m = e.metrics
                lag = m.loop_lag
                out.append({"url": inst.url, "role": inst.role, "engine_id": e.engine_id,
                            "requests": inst.requests_total, "steps": e.steps,
                            "busy_sim_s": round(e.busy_s, 3), "preemptions": m.preemptions,
                            "kv_transfers": m.kv_transfers, "kv_load_failures": m.kv_load_failures,
                            "prefix_hit_tokens": e.sched.pool.hits, "prefix_query_tokens": e.sched.pool.queries,
                            "mean_loop_lag_sim_s": (lag.sum / lag.count) if lag.count else 0.0,
                            "unknown_paths": dict(inst.unknown_paths)})
            return out

        return self.call(snap)
