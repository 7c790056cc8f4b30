"""Periodic scraping of each instance's vLLM ``/metrics``.

Every ``scrape.interval_s`` seconds (default 0.1) each instance's
``/metrics`` is fetched and the load gauges vLLM exports are stored on
:attr:`pdgate.fleet.Instance.scraped`: ``num_requests_running``,
``num_requests_waiting``, ``kv_cache_usage_perc`` (summed over engines).
An instance whose last good scrape is older than ``stale_after_s`` is
flagged stale (``pdgate_instance_scrape_stale``); policies then rely on the
gateway's own counters only. Consecutive connection failures mark the
instance unhealthy until a scrape succeeds again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from pdgate.background import BackgroundLoop

from pdgate.config import ScrapeConfig
from pdgate.fleet import Fleet, Instance

log = logging.getLogger("pdgate.scraper")

_GAUGES = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage_perc",
}

_PREFIXES = tuple(_GAUGES)

#: Consecutive connection failures before an instance is marked unhealthy.
UNHEALTHY_AFTER = 3


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The load gauges out of a Prometheus text exposition (labels summed)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(_PREFIXES):
            continue
        name_end = len(line)
        for sep in ("{", " "):
            k = line.find(sep)
            if 0 <= k < name_end:
                name_end = k
        key = _GAUGES.get(line[:name_end])
        if key is None:
            continue
        try:
            v = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[key] = out.get(key, 0.0) + v
    return out


class MetricsScraper(BackgroundLoop):
    """Background task scraping every instance of ``fleet``.

    Args:
        fleet: the instances.
        client: an ``httpx.AsyncClient``, or a :class:`pdgate.gateway.upstream.AiohttpLegClient`
            (same ``get`` surface, raises httpx's errors).
        config: interval and staleness.
        metrics: gateway metrics (errors and staleness export), optional.
    """

    task_name = "pdgate-scraper"

    def __init__(self, fleet: Fleet, client: Any, config: ScrapeConfig,
                 metrics: Any = None) -> None:
        self.fleet = fleet
        self.client = client
        self.config = config
        self.metrics = metrics
        self._failures: dict[str, int] = {}


    async def scrape_once(self) -> None:
        """Scrape every instance once, concurrently."""
        await asyncio.gather(*(self._scrape(i) for i in self.fleet.instances))

    async def _scrape(self, inst: Instance) -> None:
        timeout = max(0.05, min(1.0, self.config.stale_after_s))
        try:
            r = await self.client.get(f"{inst.url}/metrics", timeout=timeout)
            if r.status_code == 200:
                inst.scraped = parse_vllm_metrics(r.text)
                inst.scraped_at = time.monotonic()
            elif self.metrics is not None:
                self.metrics.scrape_errors.labels(inst.url).inc()
            self._failures[inst.url] = 0
            if not inst.healthy:
                log.info("instance %s answers again", inst.url)
            inst.healthy = True
        except httpx.HTTPError as e:
            if self.metrics is not None:
                self.metrics.scrape_errors.labels(inst.url).inc()
            n = self._failures.get(inst.url, 0) + 1
            self._failures[inst.url] = n
            if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)) and n >= UNHEALTHY_AFTER and inst.healthy:
                log.warning("instance %s unreachable (%d scrapes): marked unhealthy", inst.url, n)
                inst.healthy = False
        if self.metrics is not None:
            stale = not inst.scrape_fresh(self.config.stale_after_s)
            self.metrics.scrape_stale.labels(inst.url).set(1.0 if stale else 0.0)

    async def run_round(self) -> None:
        await self.scrape_once()
