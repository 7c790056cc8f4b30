"""The fleet's models: the union of the instances' ``GET /v1/models``, cached.

Used for ``GET /v1/models``, to refuse unknown models (404, as vLLM's
``NotFoundError``) and to learn each model's context length
(``max_model_len``, vLLM's field on every model card) without asking an
instance per request (the largest across instances serving the model). The cache is refreshed after ``ttl_s`` seconds, and at
most every ``min_refresh_s`` seconds when a request names a model it does not
know (an instance added since). When no instance answers, nothing is refused
on these grounds (the gateway cannot know better than the instances).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from pdgate.fleet import Fleet
from pdgate.gateway.errors import GatewayError


class ModelCatalog:
    """Cached union of the fleet's model cards.

    Args:
        fleet: the instances (read at every refresh).
        client: httpx client for ``/v1/models``.
        ttl_s: age (seconds) after which the cache is refreshed on use.
        min_refresh_s: shortest interval (seconds) between refreshes caused by unknown models.
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
        self.fetched_at = 0.0
        self._lock = asyncio.Lock()

    async def _fetch(self, url: str) -> list[dict[str, Any]]:
        try:
            r = await self.client.get(f"{url}/v1/models", timeout=self.timeout_s)
            data = r.json().get("data", []) if r.status_code == 200 else []
            return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (httpx.HTTPError, ValueError, AttributeError):
            return []

    async def refresh(self) -> dict[str, dict[str, Any]]:
        """Fetch every instance's models now (concurrently); returns the union by id."""
        async with self._lock:
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
            self.models = merged
            self.fetched_at = time.monotonic()
            return merged

    async def get(self) -> dict[str, dict[str, Any]]:
        """The cached union, refreshed if older than ``ttl_s`` or empty."""
        if not self.models or time.monotonic() - self.fetched_at > self.ttl_s:
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
                and time.monotonic() - self.fetched_at >= self.min_refresh_s:
            models = await self.refresh()
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
