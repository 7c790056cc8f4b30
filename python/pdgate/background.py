"""A background loop owned by the gateway's event loop (scraper, health checker)."""

from __future__ import annotations

import asyncio
from typing import Any


class BackgroundLoop:
    """Base of a component that runs ``_run()`` as one task while the gateway runs.

    Subclasses set ``config`` (with a boolean ``enabled``), ``task_name`` and
    implement ``async _run()``; :meth:`start` is a no-op when disabled or
    already running, :meth:`stop` cancels the task and waits for it.
    """

    task_name = "pdgate-background"
    config: Any
    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

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
