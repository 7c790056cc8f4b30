"""pdgate and vllm-router in front of a simulated fleet: the P/D path is taken
(KV transferred into the decode instance, no local recompute), streams are intact."""

from __future__ import annotations

import json
import tempfile
from typing import Iterator

import httpx
import pytest

from pdgate.config import GatewayConfig
from pdgate.gateway import create_app
from pdgate.sim import SimFleet
from pdgate.sim.harness import RouterSpec, start_router, vllm_router_bin
from tests.fakes import serve_app_in_thread
from tests.sim.conftest import FAST


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture
def fleet() -> Iterator[SimFleet]:
    with SimFleet(1, 1, profile=FAST, time_scale=1.0) as f:
        yield f


def exercise(url: str, fleet: SimFleet) -> None:
    d = fleet.decode_urls[0]
    before = metric(d, "pdgate_sim_kv_transfers_total")
    prompt = list(range(300, 812))
    r = httpx.post(url + "/v1/completions", json={"model": "sim-model", "prompt": prompt, "max_tokens": 6},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6 and r.json()["usage"]["prompt_tokens"] == 512
    with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
            "model": "sim-model", "prompt": "a b c d e f g", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    chunks = [json.loads(ln[6:]) for ln in lines if ln != "data: [DONE]"]
    assert sum(1 for c in chunks if c.get("choices")) == 4 and lines[-1] == "data: [DONE]"
    assert metric(d, "pdgate_sim_kv_transfers_total") == before + 2  # both went P -> D
    assert metric(d, "pdgate_sim_kv_load_failures_total") == 0
    assert metric(fleet.prefill_urls[0], "pdgate_sim_held_requests") == 0  # decode read and freed them


def test_pdgate_gateway_in_front_of_sim(fleet: SimFleet) -> None:
    app = create_app(GatewayConfig(prefill=fleet.prefill_urls, decode=fleet.decode_urls))
    server, thread, url = serve_app_in_thread(app)
    try:
        exercise(url, fleet)
    finally:
        server.should_exit = True
        thread.join(5)


@pytest.mark.skipif(vllm_router_bin() is None, reason="vllm-router not installed (pdgate[bench])")
def test_vllm_router_in_front_of_sim(fleet: SimFleet) -> None:
    proc, url = start_router(RouterSpec("vllm-router", "vllm-router", "pd", {"policy": "round_robin"}),
                             {"prefill": fleet.prefill_urls, "decode": fleet.decode_urls}, tempfile.mkdtemp())
    try:
        exercise(url, fleet)
    finally:
        proc.stop()
