"""A periodic background loop owned by the gateway's event loop (scraper, health checker)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

log = logging.getLogger("pdgate.background")


class BackgroundLoop:
    """Base of a component that runs one round of work every ``config.interval_s`` seconds.

    Subclasses set ``config`` (with ``enabled`` and ``interval_s``) and
    ``task_name`` and implement ``async run_round()``. Rounds start every
    ``interval_s`` seconds (the next one at once if a round took longer); an
    exception in a round is logged and the loop goes on. :meth:`start` is a
    no-op when disabled or already running, :meth:`stop` cancels the task and
    waits for it.
    """

    task_name = "pdgate-background"
    config: Any
    _task: asyncio.Task[None] | None = None

    async def run_round(self) -> None:  # pragma: no cover - overridden
        """One round of the component's work."""
        raise NotImplementedError

    async def _run(self) -> None:
        while True:
            start = time.monotonic()
            try:
                await self.run_round()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("%s round failed", self.task_name)
            await asyncio.sleep(max(0.0, self.config.interval_s - (time.monotonic() - start)))

    def start(self) -> None:
        """Start the loop on the running event loop (needs one)."""
        if self.config.enabled and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        """Cancel the loop and wait until it has ended; idempotent."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
