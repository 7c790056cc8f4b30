"""ModelCatalog: a hung instance must not stall requests.

The instances are an ``httpx.MockTransport``; a "hung" instance answers only
when the test opens its gate (then with a read timeout, as a hung server
reached through the real client would), so every wait is the test's choice
and nothing depends on timing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from pdgate.fleet import Fleet, Instance
from pdgate.gateway.catalog import ModelCatalog
from pdgate.gateway.errors import GatewayError

URLS = ["http://p0:8000", "http://d0:8000"]


class Instances:
    """``/v1/models`` of two instances: each serves ``models[url]``, fails with 500 when
    listed in ``failing``, or hangs until ``gate`` is set when listed in ``hung``."""

    def __init__(self) -> None:
        self.models: dict[str, list[str]] = {u: ["m"] for u in URLS}
        self.hung: set[str] = set()
        self.failing: set[str] = set()
        self.gate = asyncio.Event()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        url = f"http://{request.url.host}:{request.url.port}"
        if url in self.hung:
            await self.gate.wait()
            raise httpx.ReadTimeout("hung instance", request=request)
        if url in self.failing:
            return httpx.Response(500)
        data = [{"id": m, "object": "model", "max_model_len": 4096} for m in self.models[url]]
        return httpx.Response(200, json={"object": "list", "data": data})


def catalog(inst: Instances, **kw: Any) -> ModelCatalog:
    fleet = Fleet([Instance(url=URLS[0], role="prefill"), Instance(url=URLS[1], role="decode")])
    return ModelCatalog(fleet, httpx.AsyncClient(transport=httpx.MockTransport(inst.handle)), **kw)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_concurrent_lookups_share_one_refresh_while_an_instance_hangs() -> None:
    """Ten requests arrive with an empty cache while the decode instance hangs: they all wait
    on one refresh (two GETs), not ten in turn, and all get the card once it ends."""
    async def run() -> None:
        inst = Instances()
        inst.hung.add(URLS[1])
        cat = catalog(inst)
        lookups = [asyncio.ensure_future(cat.lookup("m")) for _ in range(10)]
        await settle()
        assert not any(t.done() for t in lookups)
        assert cat.fetches == 2
        inst.gate.set()
        cards = await asyncio.wait_for(asyncio.gather(*lookups), 10)
        assert [c["id"] for c in cards] == ["m"] * 10 and cat.fetches == 2
        await cat.close()
    asyncio.run(run())


def test_stale_cache_is_served_while_refreshing_in_the_background() -> None:
    """Past ``ttl_s`` a request gets the cached card at once; the refresh (stuck on a hung
    instance) runs in the background, and further requests do not start another."""
    async def run() -> None:
        inst = Instances()
        cat = catalog(inst, ttl_s=0.0, min_refresh_s=0.0)
        assert (await cat.lookup("m"))["id"] == "m" and cat.fetches == 2
        inst.hung.add(URLS[1])
        for _ in range(5):
            card = await asyncio.wait_for(cat.lookup("m"), 10)   # would block on the gate if awaited
            assert card is not None and card["id"] == "m"
        await settle()
        assert cat.fetches == 4 and cat._inflight is not None and not cat._inflight.done()
        inst.gate.set()
        await settle()
        assert cat._inflight.done() and cat.models["m"]["max_model_len"] == 4096
        await cat.close()
    asyncio.run(run())


def test_no_answer_keeps_the_last_models_and_asks_again_at_most_every_min_refresh_s() -> None:
    async def run() -> None:
        inst = Instances()
        cat = catalog(inst, min_refresh_s=60.0)
        assert (await cat.refresh())["m"]["id"] == "m"
        inst.failing.update(URLS)
        assert await cat.refresh() == {}                   # GET /v1/models then answers 503
        assert (await cat.lookup("m"))["id"] == "m"        # the last answer still holds
        # an empty cache and a silent fleet: one refresh, then requests go on without refusals
        fresh = catalog(inst, min_refresh_s=60.0)
        assert [await fresh.lookup(m) for m in ("m", "x", None)] == [None, None, None]
        assert fresh.fetches == 2
        await cat.close()
        await fresh.close()
    asyncio.run(run())


def test_unknown_model_refreshes_at_most_every_min_refresh_s() -> None:
    async def run() -> None:
        inst = Instances()
        cat = catalog(inst, min_refresh_s=60.0)
        await cat.refresh()
        inst.models[URLS[1]].append("new")                 # an instance now serves a new model
        with pytest.raises(GatewayError) as e:
            await cat.lookup("new")                        # refreshed under 60 s ago: not again
        assert e.value.status == 404 and cat.fetches == 2
        cat.attempted_at -= 61.0
        assert (await cat.lookup("new"))["id"] == "new" and cat.fetches == 4
        await cat.close()
    asyncio.run(run())


def test_close_cancels_a_refresh_in_flight_and_waiters_are_not_cancelled_with_a_caller() -> None:
    async def run() -> None:
        inst = Instances()
        inst.hung.add(URLS[1])
        cat = catalog(inst)
        first, second = asyncio.ensure_future(cat.refresh()), asyncio.ensure_future(cat.refresh())
        await settle()
        first.cancel()                                     # one caller leaves (client disconnect)
        await settle()
        assert cat._inflight is not None and not cat._inflight.done() and not second.done()
        await cat.close()
        with pytest.raises(asyncio.CancelledError):
            await second
        assert cat._inflight is None
    asyncio.run(run())
