"""Instance faults on a simulated fleet, each with its expected outcome.

The fleet runs in-process (:class:`pdgate.sim.SimFleet`); faults are injected
through each instance's ``POST /sim/fault``. Every case must end within its
bound: a full answer (through fallback or retry) or a clear error; never a
hang, never stale KV. ``FAULTS`` is replayed by ``bench/reliability.py``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Iterator

import httpx
import pytest

from pdgate.config import GatewayConfig
from pdgate.gateway import create_app
from pdgate.sim import SimFleet
from tests.fakes import serve_app_in_thread
from tests.sim.conftest import FAST

TOKENS = 8


@dataclass
class Fault:
    id: str
    target: str            # "prefill" or "decode" (first instance of the role)
    spec: dict[str, Any]   # body of POST /sim/fault
    stream: bool
    expect: str            # "ok", "sse_error", "504"
    bound_s: float         # the request ends within this many seconds


FAULTS = [
    Fault("prefill_crash_before_answer", "prefill", {"mode": "crash"}, False, "ok", 5),
    Fault("prefill_crash_before_answer_stream", "prefill", {"mode": "crash"}, True, "ok", 5),
    Fault("prefill_crash_after_answer", "prefill", {"mode": "lose_kv"}, True, "ok", 5),
    Fault("prefill_hang", "prefill", {"mode": "hang"}, False, "ok", 1.0 + 4),
    Fault("prefill_500", "prefill", {"mode": "status", "status": 500}, True, "ok", 5),
    Fault("prefill_503", "prefill", {"mode": "status", "status": 503}, False, "ok", 5),
    Fault("prefill_400", "prefill", {"mode": "status", "status": 400}, False, "ok", 5),
    Fault("prefill_no_kv_params", "prefill", {"mode": "no_kv_params"}, True, "ok", 5),
    Fault("decode_crash_before_first_token", "decode", {"mode": "crash"}, True, "ok", 5),
    Fault("decode_crash_before_first_token_json", "decode", {"mode": "crash"}, False, "ok", 5),
    Fault("decode_503_before_first_token", "decode", {"mode": "status", "status": 503, "count": 1}, True,
          "ok", 5),
    Fault("decode_crash_mid_stream", "decode", {"mode": "crash_mid_stream", "after_tokens": 3}, True,
          "sse_error", 5),
    Fault("decode_hang", "decode", {"mode": "hang"}, False, "504", 1.0 + 4),
]


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(1, 2, profile=FAST, time_scale=1.0) as f:
        yield f


class Gateway:
    def __init__(self, fleet: SimFleet, **cfg: Any) -> None:
        config = GatewayConfig(prefill=fleet.prefill_urls, decode=fleet.decode_urls, tokenizer={"words": True},
                               timeouts={"prefill_s": 1.0, "decode_idle_s": 1.0, "decode_first_byte_s": 1.0,
                                         "connect_s": 1.0},
                               health={"enabled": False, "failures_to_eject": 100}, **cfg)
        self.app = create_app(config)
        self.server, self.thread, self.url = serve_app_in_thread(self.app)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def inject(url: str, spec: dict[str, Any] | None) -> None:
    r = httpx.post(url + "/sim/fault", json=spec or {"mode": None}, timeout=5)
    assert r.status_code == 200, r.text


def run_request(url: str, stream: bool, tokens: int = TOKENS) -> tuple[int, list[str], Any]:
    body = {"model": "sim-model", "prompt": "w1 w2 w3 w4 w5", "max_tokens": tokens, "stream": stream}
    if stream:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            return r.status_code, [x for x in r.iter_lines() if x], None
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    return r.status_code, [], r.json()


def check_outcome(f: Fault, status: int, lines: list[str], data: Any) -> None:
    if f.expect == "ok":
        assert status == 200, data
        if f.stream:
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(x[6:]) for x in lines[:-1]]
            assert sum(1 for c in chunks if c.get("choices")) == TOKENS
        else:
            assert len(data["choices"][0]["text"].split()) == TOKENS
    elif f.expect == "sse_error":
        assert status == 200
        last = json.loads(lines[-1][6:])
        assert last["error"]["code"] == 502 and last["error"]["message"]
        assert "data: [DONE]" not in lines
    else:
        assert status == int(f.expect) and data["error"]["code"] == int(f.expect)


@pytest.mark.parametrize("f", FAULTS, ids=[f.id for f in FAULTS])
def test_fault_has_defined_outcome(fleet: SimFleet, f: Fault) -> None:
    gw = Gateway(fleet)
    target = fleet.urls(f.target)[0]
    try:
        inject(target, f.spec)
        t0 = time.monotonic()
        status, lines, data = run_request(gw.url, f.stream)
        elapsed = time.monotonic() - t0
        check_outcome(f, status, lines, data)
        assert elapsed < f.bound_s, f"took {elapsed:.2f} s"
        m = httpx.get(gw.url + "/metrics").text
        if f.target == "prefill" and f.id != "prefill_crash_after_answer":
            assert "pdgate_prefill_fallbacks_total{reason=" in m, "the fault did not hit the prefill leg"
        if f.target == "decode" and f.expect == "ok":
            assert "pdgate_decode_retries_total{reason=" in m, "no transparent retry happened"
        inject(target, None)
        assert run_request(gw.url, f.stream)[0] == 200     # and the gateway is fine afterwards
        health = httpx.get(gw.url + "/health").json()
        assert all(i["in_flight"] == 0 for i in health["instances"])
    finally:
        inject(target, None)
        gw.close()


def test_prefill_crash_after_answer_never_uses_stale_kv(fleet: SimFleet) -> None:
    """The decode side finds the blocks gone and recomputes (vLLM's
    kv_load_failure_policy=recompute); it never reads freed blocks."""
    gw = Gateway(fleet)
    try:
        before = sum(s["kv_load_failures"] for s in fleet.stats())
        inject(fleet.prefill_urls[0], {"mode": "lose_kv"})
        status, lines, _ = run_request(gw.url, True)
        assert status == 200 and lines[-1] == "data: [DONE]"
        assert sum(s["kv_load_failures"] for s in fleet.stats()) == before + 1
    finally:
        inject(fleet.prefill_urls[0], None)
        gw.close()


def test_dead_instance_ejected_and_readmitted_on_sim(fleet: SimFleet) -> None:
    h = {"enabled": True, "interval_s": 0.1, "timeout_s": 0.3, "failures_to_eject": 2, "cooldown_s": 0.5}
    config = GatewayConfig(prefill=fleet.prefill_urls, decode=fleet.decode_urls, tokenizer={"words": True},
                           health=h)
    app = create_app(config)
    server, thread, url = serve_app_in_thread(app)
    d0 = fleet.decode_urls[0]
    try:
        inject(d0, {"mode": "down"})
        t0 = time.monotonic()
        while app.state.fleet.get(d0).routable():
            assert time.monotonic() - t0 < 2 * (0.1 + 0.3) + 0.5
            time.sleep(0.02)
        served = [s["requests"] for s in fleet.stats() if s["url"] == d0][0]
        for _ in range(4):
            assert run_request(url, False)[0] == 200
        assert [s["requests"] for s in fleet.stats() if s["url"] == d0][0] == served
        inject(d0, None)
        t0 = time.monotonic()
        while not app.state.fleet.get(d0).routable():
            assert time.monotonic() - t0 < 0.5 + (0.1 + 0.3) + 0.5
            time.sleep(0.02)
        m = httpx.get(url + "/metrics").text
        assert f'pdgate_instance_ejections_total{{instance="{d0}",role="decode"}} 1.0' in m
        assert f'pdgate_instance_healthy{{instance="{d0}",role="decode"}} 1.0' in m
    finally:
        inject(d0, None)
        server.should_exit = True
        thread.join(10)
