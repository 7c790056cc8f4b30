"""Client disconnects mid-prefill and mid-stream abort both legs on the
(simulated) instances: their ``vllm:num_requests_running`` is back to 0
within seconds, long before the work would have finished. The same on real
vLLM: ``tests/e2e/test_disconnect_vllm.py``."""

from __future__ import annotations

import time
from typing import Iterator

import httpx
import pytest

from pdgate.config import GatewayConfig
from pdgate.gateway import create_app
from pdgate.sim import SimFleet
from pdgate.state.scraper import parse_vllm_metrics
from tests.fakes import serve_app_in_thread
from tests.sim.conftest import FAST


@pytest.fixture(scope="module")
def env() -> Iterator[tuple[SimFleet, str]]:
    # prefill 1 ms/token: a 6000-token prompt takes ~6 s; decode ~5 ms/token
    with SimFleet(1, 1, profile=FAST.replace(prefill_token_s=1e-3), time_scale=1.0) as fleet:
        app = create_app(GatewayConfig(prefill=fleet.prefill_urls, decode=fleet.decode_urls,
                                       tokenizer={"words": True}))
        server, thread, url = serve_app_in_thread(app)
        yield fleet, url
        server.should_exit = True
        thread.join(10)


def running(url: str) -> float:
    return parse_vllm_metrics(httpx.get(url + "/metrics").text).get("num_requests_running", 0.0)


def wait_idle(fleet: SimFleet, within_s: float) -> float:
    t0 = time.monotonic()
    while any(running(u) for u in fleet.urls()):
        assert time.monotonic() - t0 < within_s, {u: running(u) for u in fleet.urls()}
        time.sleep(0.05)
    return time.monotonic() - t0


def test_disconnect_mid_prefill_aborts_prefill_leg(env: tuple[SimFleet, str]) -> None:
    fleet, url = env
    body = {"model": "sim-model", "prompt": "w1 " * 6000, "max_tokens": 50}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    assert fleet.stats()[0]["requests"] >= 1      # the prefill leg was dispatched
    assert wait_idle(fleet, 2.0) < 2.0            # the prompt alone needs ~5 more seconds
    assert not fleet.stats()[1]["requests"], "the decode leg started although the client had left"


def test_disconnect_mid_stream_aborts_decode_leg(env: tuple[SimFleet, str]) -> None:
    fleet, url = env
    body = {"model": "sim-model", "prompt": "w1 w2", "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        it = r.iter_lines()
        got = [next(it) for _ in range(6)]
        assert any(x.startswith("data: {") for x in got)
        assert running(fleet.decode_urls[0]) == 1
    assert wait_idle(fleet, 2.0) < 2.0            # 3000 tokens would take ~15 s
    health = httpx.get(url + "/health").json()
    assert all(i["in_flight"] == 0 for i in health["instances"])
