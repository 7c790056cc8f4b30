"""The fleet's models: the union of the instances' ``GET /v1/models``, cached.

Used for ``GET /v1/models``, to refuse unknown models (404, as vLLM's
``NotFoundError``) and to learn each model's context length
(``max_model_len``, vLLM's field on every model card) without asking an
instance per request (the largest across instances serving the model).

A hung instance must not stall requests: refreshes are single-flight (every
caller joins the one in progress, so N requests arriving while an instance
hangs wait one ``timeout_s``, not N of them in turn); a cache older than
``ttl_s`` is served as is while it is refreshed in the background
(stale-while-revalidate); a request naming a model the cache lacks (an
instance added since) waits for a refresh at most every ``min_refresh_s``
seconds; and when no instance answers, the last answer is kept and requests
go on without refusals on these grounds (the gateway cannot know better than
the instances), asking again at most every ``min_refresh_s`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from pdgate.fleet import Fleet
from pdgate.gateway.errors import GatewayError

log = logging.getLogger(__name__)


class ModelCatalog:
    """Cached union of the fleet's model cards.

    Args:
        fleet: the instances (read at every refresh).
        client: httpx client for ``/v1/models``.
        ttl_s: age (seconds) after which the cache is refreshed in the background on use.
        min_refresh_s: shortest interval (seconds) between two refreshes started by
            requests (an unknown model, an empty or stale cache).
        timeout_s: per-instance timeout of a refresh (seconds).
    """

    def __init__(self, fleet: Fleet, client: httpx.AsyncClient, ttl_s: float = 30.0,
                 min_refresh_s: float = 2.0, timeout_s: float = 5.0) -> None:
        self.fleet = fleet
        self.client = client
        self.ttl_s = ttl_s
        self.min_refresh_s = min_refresh_s
        self.timeout_s = timeout_s
        self.models: dict[str, dict[str, Any]] = {}
        self.fetched_at = 0.0               # last refresh that some instance answered (monotonic s)
        self.attempted_at = -float("inf")   # last refresh started (monotonic s)
        self.fetches = 0                    # GET /v1/models sent, all instances (for tests and debugging)
        self._inflight: asyncio.Task[dict[str, dict[str, Any]]] | None = None

    async def _fetch(self, url: str) -> list[dict[str, Any]]:
        self.fetches += 1
        try:
            r = await self.client.get(f"{url}/v1/models", timeout=self.timeout_s)
            data = r.json().get("data", []) if r.status_code == 200 else []
            return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (httpx.HTTPError, ValueError, AttributeError):
            return []

    async def _refresh(self) -> dict[str, dict[str, Any]]:
        self.attempted_at = time.monotonic()
        results = await asyncio.gather(*(self._fetch(i.url) for i in self.fleet.instances))
        merged: dict[str, dict[str, Any]] = {}
        for data in results:
            for m in data:
                card = merged.setdefault(m["id"], dict(m))
                # Instances may differ in context length (e.g. prefill
                # started with a smaller --max-model-len): the fleet can
                # serve up to the largest one; a prefill instance that
                # refuses a longer prompt (400) is a fallback, not an error.
                mine, theirs = self.max_model_len(card), self.max_model_len(m)
                if theirs is not None and (mine is None or theirs > mine):
                    card["max_model_len"] = theirs
        if merged:  # no answer at all: keep what the fleet said last
            self.models = merged
            self.fetched_at = time.monotonic()
        else:
            log.warning("no instance answered GET /v1/models (%d instances)", len(self.fleet.instances))
        return merged

    def _due(self, now: float) -> bool:
        """Whether a request may start a refresh (none started under ``min_refresh_s`` ago)."""
        return now - self.attempted_at >= self.min_refresh_s

    def _start(self) -> asyncio.Task[dict[str, dict[str, Any]]]:
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(self._refresh())
        return self._inflight

    async def refresh(self) -> dict[str, dict[str, Any]]:
        """Fetch every instance's models now (concurrently), or join the refresh already
        in flight; returns the union by id (empty if no instance answered). A caller
        cancelled while waiting does not cancel the refresh."""
        return await asyncio.shield(self._start())

    async def close(self) -> None:
        """Cancel a refresh in flight (at gateway shutdown, before its client closes)."""
        task, self._inflight = self._inflight, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def get(self) -> dict[str, dict[str, Any]]:
        """The cached union: as is while fresh; as is, with a background refresh
        started, when older than ``ttl_s``; when empty, after a refresh (joined if
        in flight, skipped if one started under ``min_refresh_s`` ago)."""
        now = time.monotonic()
        due = self._due(now)
        if self.models:
            if now - self.fetched_at > self.ttl_s and due:
                self._start()
            return self.models
        if (self._inflight is not None and not self._inflight.done()) or due:
            await self.refresh()
        return self.models

    async def lookup(self, model: str | None) -> dict[str, Any] | None:
        """The model card of ``model`` (``None`` model: the only model, if exactly one).

        Returns ``None`` when the fleet's models are unknown (no instance answered).

        Raises:
            GatewayError(404): the fleet answered and does not serve ``model``.
        """
        models = await self.get()
        if model is not None and models and model not in models \
                and self._due(time.monotonic()):
            await self.refresh()
            models = self.models
        if not models:
            return None
        if model is None:
            return next(iter(models.values())) if len(models) == 1 else None
        card = models.get(model)
        if card is None:
            raise GatewayError(404, f"The model `{model[:200]}` does not exist.", "model",
                               reason="unknown_model")
        return card

    @staticmethod
    def max_model_len(card: dict[str, Any] | None) -> int | None:
        """The card's ``max_model_len`` (tokens) if it states a positive integer."""
        v = (card or {}).get("max_model_len")
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
