"""Several gateway replicas over one simulated fleet (README: "Deployment:
Kubernetes, several replicas").

Two claims, each with a check that fails without it:

- correctness: requests split over two replicas all complete in full, each
  served entirely by the replica that received it: every request id reaches
  the prefill instance once and exactly one decode instance once, and each
  replica counts exactly its own requests;
- routing from scraped state: load sent through replica A only is seen by
  replica B in its ``/metrics`` scrape of the instances, and B's
  ``least_load`` decode policy sends its requests to the other decode
  instance; a replica with scraping off (same policy) does not avoid it.

The fleet runs in real time (5 ms steps); nothing asserts on latency.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any, Iterator

import httpx
import pytest

from pdgate.config import GatewayConfig
from pdgate.gateway import create_app
from pdgate.sim import SimFleet
from tests.fakes import serve_app_in_thread
from tests.sim.conftest import FAST

#: Output tokens of the requests whose completeness is checked.
OUT = 12
#: Output tokens of replica A's long streams (>= 10 s at 5 ms a step: far
#: longer than the test needs them; they are cancelled at the end).
LONG = 2000
#: Long streams pinned through replica A.
N_LONG = 4


class Replica:
    """One gateway replica (in-process uvicorn) over ``fleet``; ``cfg`` overrides."""

    def __init__(self, fleet: SimFleet, **cfg: Any) -> None:
        cfg.setdefault("prefill", fleet.prefill_urls)
        cfg.setdefault("decode", fleet.decode_urls)
        cfg.setdefault("decode_policy", "least_load")
        self.server, self.thread, self.url = serve_app_in_thread(create_app(GatewayConfig(**cfg)))

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def counter(self, prefix: str) -> float:
        """Sum of the ``/metrics`` samples whose line starts with ``prefix``."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(prefix))

    def instances(self) -> dict[str, dict[str, Any]]:
        """This replica's view of each instance (``/health``), by URL."""
        return {i["url"]: i for i in httpx.get(self.url + "/health", timeout=10).json()["instances"]}


@pytest.fixture
def fleet() -> Iterator[SimFleet]:
    """1 prefill + 2 decode instances."""
    with SimFleet(1, 2, profile=FAST) as f:
        yield f


def seen(fleet: SimFleet) -> dict[str, Counter[str]]:
    """Instance URL -> X-Request-Id -> requests accepted with it."""
    return fleet.call(lambda: {i.url: Counter(i.request_ids) for i in fleet.instances})


def body(k: int, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": [1 + (k * 7 + j) % 997 for j in range(64)],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def wait_until(cond: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


async def complete(c: httpx.AsyncClient, gw: Replica, rid: str, k: int, stream: bool) -> str:
    """Send one request with ``X-Request-Id: rid``; check the whole answer; return rid."""
    h = {"X-Request-Id": rid}
    if not stream:
        r = await c.post(gw.url + "/v1/completions", json=body(k, OUT, False), headers=h, timeout=60)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] == "length" and len(ch["text"].split()) == OUT
        assert r.json()["usage"]["completion_tokens"] == OUT
    else:
        async with c.stream("POST", gw.url + "/v1/completions", json=body(k, OUT, True), headers=h,
                            timeout=60) as r:
            assert r.status_code == 200, await r.aread()
            data = [l[6:] async for l in r.aiter_lines() if l.startswith("data: ")]
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        text = "".join(ch["text"] for e in chunks for ch in e.get("choices", []))
        assert len(text.split()) == OUT
        assert [ch["finish_reason"] for e in chunks for ch in e.get("choices", [])][-1] == "length"
    assert r.headers["x-request-id"] == rid
    return rid


def test_split_traffic_each_request_served_whole_by_its_replica(fleet: SimFleet) -> None:
    a, b = Replica(fleet), Replica(fleet)
    try:
        async def go() -> list[str]:
            async with httpx.AsyncClient() as c:
                jobs = [complete(c, gw, f"{name}-{k}", k + (100 if name == "B" else 0), stream=k % 2 == 0)
                        for name, gw in (("A", a), ("B", b)) for k in range(10)]
                return await asyncio.gather(*jobs)
        rids = asyncio.run(go())
        assert len(set(rids)) == 20

        per = seen(fleet)
        (p,), (d0, d1) = fleet.prefill_urls, fleet.decode_urls
        # Every request: one prefill leg, one decode leg on exactly one decode
        # instance; nothing lost, nothing sent twice.
        assert per[p] == Counter({r: 1 for r in rids})
        assert per[d0] + per[d1] == Counter({r: 1 for r in rids})
        for gw, name in ((a, "A"), (b, "B")):
            assert gw.counter('pdgate_requests_total{outcome="success",route="pd"}') == 10, name
            assert gw.counter("pdgate_requests_total") == 10, name
            assert gw.counter("pdgate_prefill_fallbacks_total") == 0
            assert gw.counter("pdgate_decode_retries_total") == 0
            wait_until(lambda g=gw: all(i["in_flight"] == 0 for i in g.instances().values()), "legs released")
    finally:
        a.close()
        b.close()


def test_replica_routes_around_load_sent_through_another(fleet: SimFleet) -> None:
    d_busy, d_free = fleet.decode_urls
    a = Replica(fleet, decode=[d_busy])                       # A's traffic lands on d_busy only
    b = Replica(fleet, scrape={"interval_s": 0.05, "stale_after_s": 5.0})
    blind = Replica(fleet, scrape={"enabled": False})         # same policy, no scraped state

    def running(gw: Replica, url: str) -> float:
        return gw.instances()[url]["scraped"].get("num_requests_running", 0.0)

    def sequential(gw: Replica, name: str, n: int) -> dict[str, int]:
        """``n`` requests one after another (the replica's own counters back at
        zero before each); decode instance URL -> how many it served."""
        for k in range(n):
            r = httpx.post(gw.url + "/v1/completions", json=body(500 + k, 4, False),
                           headers={"X-Request-Id": f"{name}-{k}"}, timeout=60)
            assert r.status_code == 200, r.text
            wait_until(lambda: all(i["in_flight"] == 0 and i["decode_batch"] == 0
                                   for i in gw.instances().values()), "legs released")
        per = seen(fleet)
        got = {u: sum(per[u][f"{name}-{k}"] for k in range(n)) for u in (d_busy, d_free)}
        assert sum(got.values()) == n
        return got

    async def long_stream(c: httpx.AsyncClient, k: int) -> None:
        async with c.stream("POST", a.url + "/v1/completions", json=body(k, LONG, True),
                            headers={"X-Request-Id": f"long-{k}"}, timeout=120) as r:
            assert r.status_code == 200
            async for _ in r.aiter_lines():
                pass

    async def go() -> tuple[dict[str, int], dict[str, int]]:
        async with httpx.AsyncClient() as c:
            streams = [asyncio.create_task(long_stream(c, k)) for k in range(N_LONG)]
            try:
                # B has never carried a request, yet its scrape shows A's streams.
                await asyncio.to_thread(wait_until, lambda: running(b, d_busy) >= N_LONG,
                                        "B to scrape A's streams on the busy decode instance")
                assert b.instances()[d_busy]["in_flight"] == 0
                to_b = await asyncio.to_thread(sequential, b, "B", 6)
                to_blind = await asyncio.to_thread(sequential, blind, "blind", 6)
                # A's streams were still running throughout (the count only falls).
                assert running(b, d_busy) >= N_LONG
                assert not any(s.done() for s in streams)
                return to_b, to_blind
            finally:
                for s in streams:
                    s.cancel()
                await asyncio.gather(*streams, return_exceptions=True)

    try:
        to_b, to_blind = asyncio.run(go())
        assert to_b == {d_busy: 0, d_free: 6}                 # B avoided A's load
        assert to_blind[d_busy] >= 2                          # without the scrape it did not
        assert seen(fleet)[d_free].keys().isdisjoint(f"long-{k}" for k in range(N_LONG))
    finally:
        for gw in (a, b, blind):
            gw.close()
