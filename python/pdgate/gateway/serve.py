"""Running the gateway: uvicorn with graceful drain and an optional ops port.

On the first SIGTERM or SIGINT the gateway drains: new API requests get 503
with ``Retry-After`` (``/health`` answers 503 too, so load balancers stop
sending), in-flight requests and streams run to their end for at most
``drain.deadline_s`` seconds, then the servers stop and :func:`serve`
returns 0. A second SIGINT forces an immediate exit.

With ``metrics_port`` set, ``/metrics`` and ``/health`` are served by a
second uvicorn server in the same event loop, on that port only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from types import FrameType
from typing import Any, Callable, Coroutine, Iterator

import uvicorn
from fastapi import FastAPI

from pdgate.config import GatewayConfig
from pdgate.gateway.app import create_app, create_ops_app
from pdgate.gateway.limits import Gate

log = logging.getLogger("pdgate.serve")


#: Seconds an idle client connection is kept open. Longer than clients' own
#: pool expiry (httpx 5 s, OpenAI SDK 5 s; load balancers up to 60 s), so a
#: client never sends on a connection the gateway is closing at that moment
#: (uvicorn's default, 5 s, races httpx's and loses requests as ReadError).
KEEPALIVE_S = 75


def _uvicorn_config(app: Any, config: GatewayConfig, port: int, **kw: Any) -> uvicorn.Config:
    # h11 must accept headers up to our own limit so the gateway answers 431 itself.
    return uvicorn.Config(app, host=config.host, port=port, log_level=config.log_level,
                          h11_max_incomplete_event_size=config.limits.max_header_bytes + 64 * 1024,
                          timeout_keep_alive=KEEPALIVE_S, timeout_graceful_shutdown=5,
                          log_config=None, **kw)  # logging is set up by pdgate.logs


class _OpsServer(uvicorn.Server):
    """The ops-port server: the main server owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal starts a drain instead of stopping.

    Args:
        config: uvicorn config of the API app.
        gate: the app's :class:`Gate` (drain flag, in-flight count).
        deadline_s: longest drain, seconds.
        others: servers to stop with this one (the ops server).
    """

    def __init__(self, config: uvicorn.Config, gate: Gate, deadline_s: float,
                 others: list[uvicorn.Server] | None = None) -> None:
        super().__init__(config)
        self.gate = gate
        self.deadline_s = deadline_s
        self.others = list(others or [])
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after
        # shutdown and the process would die by the signal instead of exiting 0.
        if self._drain_task is not None or self._loop is None:
            if sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        """Refuse new requests, wait for in-flight ones (at most the deadline), then stop."""
        self.gate.start_drain()
        log.warning("draining: %d request(s) in flight, deadline %.1f s", self.gate.in_flight, self.deadline_s)
        idle = await self.gate.wait_idle(self.deadline_s)
        if not idle:
            log.warning("drain deadline passed with %d request(s) in flight; closing them", self.gate.in_flight)
        else:
            log.info("drained; shutting down")
        self.should_exit = True
        for s in self.others:
            s.should_exit = True


async def serve_async(config: GatewayConfig, app: FastAPI | None = None) -> None:
    """Serve ``config`` (``app``: a prebuilt gateway app) until drained after a signal."""
    app = app or create_app(config)
    others: list[uvicorn.Server] = []
    if config.metrics_port is not None:
        others.append(_OpsServer(_uvicorn_config(create_ops_app(app), config, config.metrics_port,
                                                 lifespan="off")))
    main = DrainingServer(_uvicorn_config(app, config, config.port), app.state.gate, config.drain.deadline_s,
                          others)
    await asyncio.gather(main.serve(), *(s.serve() for s in others))


def event_loop_runner(name: str) -> Callable[[Coroutine[Any, Any, None]], None]:
    """What runs the gateway's main coroutine for ``config.event_loop``: ``uvloop.run``
    (``uvloop`` or ``auto`` with uvloop installed) or ``asyncio.run``.

    Raises:
        ValueError: ``uvloop`` asked for and not installed.
    """
    if name != "asyncio":
        try:
            import uvloop
        except ImportError:
            if name == "uvloop":
                raise ValueError("event_loop: uvloop is not installed (pip install uvloop)") from None
        else:
            return uvloop.run
    return asyncio.run


def serve(config: GatewayConfig) -> int:
    """Run the gateway until drained after SIGTERM/SIGINT; returns the exit code (0).

    Raises:
        ValueError: ``event_loop: uvloop`` without uvloop installed.
    """
    event_loop_runner(config.event_loop)(serve_async(config))
    return 0
