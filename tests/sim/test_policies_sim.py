"""Each routing policy's defining behaviour on a simulated vLLM fleet (real time).

The gateway runs in-process in front of :class:`pdgate.sim.SimFleet`
instances whose step-time model is :data:`PROF`; the gateway's predictor is
seeded with the same coefficients.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Iterator

import httpx
import pytest

from pdgate.config import GatewayConfig
from pdgate.gateway import create_app
from pdgate.sim import SimFleet
from pdgate.sim.profiles import Profile
from tests.fakes import serve_app_in_thread

#: 5 ms steps, 0.1 ms per prompt token (4000 tokens = 0.4 s), 1 ms per decode sequence.
PROF = Profile(name="policy-test", num_gpu_blocks=8192, max_num_seqs=64, max_num_batched_tokens=4096,
               max_model_len=16384, step_base_s=0.005, prefill_token_s=1e-4, prefill_attn_s=0.0,
               decode_seq_s=1e-3, decode_kv_token_s=0.0, kv_bytes_per_token=100,
               kv_transfer_bandwidth_Bps=1e9, kv_transfer_latency_s=0.002, request_overhead_s=0.0,
               vocab_size=1000, sources=("test",))

PREDICTOR = {k: getattr(PROF, k) for k in (
    "step_base_s", "prefill_token_s", "prefill_attn_s", "decode_seq_s", "decode_kv_token_s",
    "kv_bytes_per_token", "kv_transfer_bandwidth_Bps", "kv_transfer_latency_s", "max_num_batched_tokens",
    "long_prefill_token_threshold")}


class Gateway:
    def __init__(self, fleet: SimFleet, **cfg: Any) -> None:
        cfg.setdefault("predictor", PREDICTOR)
        cfg.setdefault("prefill", fleet.prefill_urls)
        cfg.setdefault("decode", fleet.decode_urls)
        self.config = GatewayConfig(**cfg)
        self.server, self.thread, self.url = serve_app_in_thread(create_app(self.config))

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics").text


def counter(text: str, prefix: str) -> float:
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(prefix))


_SALT = iter(range(1, 1_000_000))


def body(n: int, seed: int, max_tokens: int = 4, **kw: Any) -> dict[str, Any]:
    """A fresh random prompt every call (no prefix-cache hits between requests)."""
    rng = random.Random(seed * 1_000_003 + next(_SALT))
    return {"model": "sim-model", "prompt": [rng.randrange(1, 999) for _ in range(n)],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True, **kw}


async def timed(client: httpx.AsyncClient, url: str, b: dict[str, Any], headers: dict[str, str] | None = None,
                delay: float = 0.0) -> tuple[float, float]:
    """(first token time, end time) of a streamed request, monotonic seconds."""
    await asyncio.sleep(delay)
    first = None
    async with client.stream("POST", url + "/v1/completions", json=b, headers=headers or {}, timeout=60) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and first is None:
                first = time.monotonic()
    return first or time.monotonic(), time.monotonic()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def fleet_1p1d() -> Iterator[SimFleet]:
    with SimFleet(1, 1, profile=PROF) as f:
        yield f


@pytest.fixture
def fleet_1p2d() -> Iterator[SimFleet]:
    with SimFleet(1, 2, profile=PROF) as f:
        yield f


def first_tokens(url: str) -> tuple[float, float, float]:
    """First-token times of: long1, long2 (20 ms later), short (50 ms later)."""
    async def go() -> tuple[float, float, float]:
        async with httpx.AsyncClient() as c:
            res = await asyncio.gather(timed(c, url, body(8000, 1)), timed(c, url, body(8000, 2), delay=0.02),
                                       timed(c, url, body(100, 3), delay=0.05))
        return res[0][0], res[1][0], res[2][0]
    return run(go())


def test_request_parallel_short_overtakes_queued_long(fleet_1p1d: SimFleet) -> None:
    base = Gateway(fleet_1p1d)
    try:
        long1, long2, short = first_tokens(base.url)
        assert short > long1 + 0.3               # plain P/D: FCFS, the short waits for long2 (0.8 s)
    finally:
        base.close()
    gw = Gateway(fleet_1p1d, admission_policy="request_parallel",
                 request_parallel={"max_in_flight": 4, "max_long": 1, "long_threshold_tokens": 5000})
    try:
        long1, long2, short = first_tokens(gw.url)
        assert short < long2 - 0.3               # the short prompt passed the queued long one
        assert short < long1 + 0.2
        assert counter(gw.metrics(), "pdgate_admission_wait_seconds_count") == 3
    finally:
        gw.close()


def test_dedicated_long_prompt_lands_in_long_pool() -> None:
    with SimFleet(2, 2, profile=PROF) as f:
        p_short, p_long = f.prefill_urls
        d_short, d_long = f.decode_urls
        gw = Gateway(f, prefill=[], decode=[], route_policy="dedicated",
                     pools={"short": {"max_tokens": 3000}, "long": {"min_tokens": 3000}},
                     instances=[{"url": p_short, "role": "prefill", "pool": "short"},
                                {"url": p_long, "role": "prefill", "pool": "long"},
                                {"url": d_short, "role": "decode", "pool": "short"},
                                {"url": d_long, "role": "decode", "pool": "long"}])
        try:
            for i, n in enumerate([5000, 200, 4000, 100, 300]):
                assert httpx.post(gw.url + "/v1/completions", json=body(n, i, stream=False), timeout=30).status_code == 200
            per = {s["url"]: s["requests"] for s in f.stats()}
            assert per[p_long] == 2 and per[d_long] == 2
            assert per[p_short] == 3 and per[d_short] == 3
            m = gw.metrics()
            assert counter(m, 'pdgate_route_decisions_total{choice="pool:long"') == 2
        finally:
            gw.close()


def test_deflection_under_burst_not_when_idle(fleet_1p2d: SimFleet) -> None:
    gw = Gateway(fleet_1p2d, route_policy="deflection")
    try:
        for i in range(4):                                # idle: one at a time
            assert httpx.post(gw.url + "/v1/completions", json=body(1500, i, stream=False), timeout=30).status_code == 200
        m = gw.metrics()
        assert counter(m, 'pdgate_route_decisions_total{choice="deflect"') == 0
        assert counter(m, 'pdgate_route_decisions_total{choice="pd"') == 4

        async def burst() -> None:
            async with httpx.AsyncClient() as c:
                await asyncio.gather(*(timed(c, gw.url, body(1500, 10 + i), delay=0.01 * i) for i in range(12)))
        run(burst())
        m = gw.metrics()
        deflected = counter(m, 'pdgate_route_decisions_total{choice="deflect"')
        assert deflected >= 2
        assert counter(m, 'pdgate_requests_total{outcome="success",route="deflect"}') == deflected
        h = httpx.get(gw.url + "/health").json()["instances"]
        assert all(i["in_flight"] == 0 and i["deflected_in_flight"] == 0 for i in h)
    finally:
        gw.close()


def test_priorities_order_dispatch(fleet_1p1d: SimFleet) -> None:
    gw = Gateway(fleet_1p1d, admission_policy="priority",
                 priority={"max_in_flight": 1, "aging_rate": 0.0, "max_wait_s": None})

    async def go() -> list[tuple[float, float]]:
        async with httpx.AsyncClient() as c:
            blocker = timed(c, gw.url, body(8000, 1))    # 0.8 s of prefill holds the only slot
            rest = [timed(c, gw.url, body(500, 10 + p), headers={"x-priority": str(p)}, delay=0.05 + 0.02 * k)
                    for k, p in enumerate([5, 1, 3, 0])]
            return await asyncio.gather(blocker, *rest)
    try:
        res = run(go())
        firsts = {p: res[k + 1][0] for k, p in enumerate([5, 1, 3, 0])}
        assert sorted(firsts, key=firsts.get) == [0, 1, 3, 5]
    finally:
        gw.close()


def test_aging_bounds_the_wait(fleet_1p1d: SimFleet) -> None:
    """A low-priority request under a stream of urgent ones waits about max_wait_s, not until they stop."""
    def low_wait(max_wait: float | None) -> float:
        gw = Gateway(fleet_1p1d, admission_policy="priority",
                     priority={"max_in_flight": 1, "aging_rate": 0.0, "max_wait_s": max_wait})

        async def go() -> float:
            async with httpx.AsyncClient() as c:
                t0 = time.monotonic()
                urgent = [timed(c, gw.url, body(1000, 100 + i), headers={"x-priority": "0"}, delay=0.05 * i)
                          for i in range(30)]                # 30 x ~0.1 s of prefill, arriving every 50 ms
                low = timed(c, gw.url, body(200, 7), headers={"x-priority": "9"}, delay=0.12)
                res = await asyncio.gather(low, *urgent)
                return res[0][0] - t0 - 0.12
        try:
            return run(go())
        finally:
            gw.close()

    bounded = low_wait(0.4)
    unbounded = low_wait(None)
    assert bounded < 1.0 < unbounded


def test_pooled_holds_a_burst_at_the_gateway_and_routes_it_as_capacity_frees(fleet_1p2d: SimFleet) -> None:
    """Late binding: idle requests go P/D at once; a burst waits in the gateway's queue and each
    request goes to whichever executor frees first (the prefill instance, or a decode instance
    for a deflected prefill while the prefill instance is busy). None is lost or left counted."""
    gw = Gateway(fleet_1p2d, route_policy="pooled",
                 pooled={"max_queue_s": 0.2, "max_local_prefills": 1, "tick_s": 0.01})
    try:
        for i in range(3):                                # idle: one at a time, no waiting
            assert httpx.post(gw.url + "/v1/completions", json=body(1500, i, stream=False), timeout=30).status_code == 200
        m = gw.metrics()
        assert counter(m, 'pdgate_route_decisions_total{choice="pd"') == 3
        assert counter(m, "pdgate_admission_wait_seconds_count") == 0

        async def burst() -> list[tuple[float, float]]:
            async with httpx.AsyncClient() as c:
                return await asyncio.gather(*(timed(c, gw.url, body(1500, 10 + i), delay=0.01 * i)
                                              for i in range(12)))
        res = run(burst())
        assert len(res) == 12
        m = gw.metrics()
        assert counter(m, "pdgate_admission_wait_seconds_count") >= 3    # held at the gateway, then routed
        deflected = counter(m, 'pdgate_route_decisions_total{choice="deflect"')
        assert deflected >= 2
        assert counter(m, 'pdgate_requests_total{outcome="success",route="deflect"}') == deflected
        assert counter(m, 'pdgate_requests_total{outcome="success",route="pd"}') == 15 - deflected
        assert counter(m, "pdgate_admission_waiting_requests") == 0
        h = httpx.get(gw.url + "/health").json()["instances"]
        assert all(i["in_flight"] == 0 and i["prefill_jobs"] == 0 and i["deflected_in_flight"] == 0 for i in h)
    finally:
        gw.close()
