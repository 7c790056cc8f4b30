"""Graceful drain of a real ``pdgate serve`` process in front of a simulated
fleet (``pdgate sim-fleet``): SIGTERM -> new requests get 503 with
Retry-After, the in-flight stream completes, the process exits 0. Also: the
ops port serves ``/health`` and ``/metrics`` only there."""

from __future__ import annotations

import json
import threading
import time
from typing import Iterator

import httpx
import pytest

from pdgate.bench.procs import GatewayProcess, SimFleetProcess

TOKENS = 250


@pytest.fixture(scope="module")
def sim() -> Iterator[SimFleetProcess]:
    with SimFleetProcess(1, 1, profile="cpu-tiny") as f:
        yield f


def test_sigterm_drains_streams_and_exits_zero(sim: SimFleetProcess) -> None:
    gw = GatewayProcess(sim.config(drain={"deadline_s": 30, "retry_after_s": 7}), ops_port=True).start()
    try:
        # ops routes live on the ops port only
        assert httpx.get(gw.url + "/health").status_code == 404
        assert httpx.get(gw.url + "/metrics").status_code == 404
        assert "pdgate_requests_total" in httpx.get(gw.ops_url + "/metrics").text
        lines: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": "sim-model", "prompt": "w1 w2 w3", "max_tokens": TOKENS, "stream": True,
                    "ignore_eos": True}
            with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(20), "stream did not start"
        t_sig = time.monotonic()
        gw.terminate()
        deadline = time.monotonic() + 5
        while True:  # the signal is handled asynchronously: poll until refused
            r = httpx.post(gw.url + "/v1/completions", json={"model": "sim-model", "prompt": "w1", "max_tokens": 2},
                           timeout=10)
            if r.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert r.status_code == 503 and r.headers["retry-after"] == "7"
        assert r.json()["error"]["code"] == 503
        assert httpx.get(gw.ops_url + "/health").status_code == 503
        t.join(60)
        assert lines[-1] == "data: [DONE]", "the in-flight stream was cut"
        chunks = [json.loads(x[6:]) for x in lines[:-1]]
        assert sum(1 for c in chunks if c.get("choices")) == TOKENS
        assert not any("error" in c for c in chunks)
        assert gw.wait(20) == 0
        assert time.monotonic() - t_sig < 30
    finally:
        gw.kill()


def test_drain_deadline_bounds_shutdown(sim: SimFleetProcess) -> None:
    gw = GatewayProcess(sim.config(drain={"deadline_s": 1.0})).start()
    try:
        started = threading.Event()
        outcome: list[str] = []

        def stream() -> None:
            body = {"model": "sim-model", "prompt": "w1", "max_tokens": 3000, "stream": True}
            try:
                with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as r:
                    for _ in r.iter_lines():
                        started.set()
                outcome.append("ended")
            except httpx.HTTPError as e:
                outcome.append(type(e).__name__)

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(20)
        t0 = time.monotonic()
        gw.terminate()
        assert gw.wait(20) == 0
        assert time.monotonic() - t0 < 1.0 + 5 + 3   # deadline + uvicorn's graceful timeout + slack
        t.join(10)
        assert outcome, "client still hanging after shutdown"
    finally:
        gw.kill()
