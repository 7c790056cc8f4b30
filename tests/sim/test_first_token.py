"""``first_token.from_prefill`` through the gateway on a simulated 1P1D fleet.

The KV transfer is made slow (0.6 s), so a P/D request's first token from the
decode instance comes at least that long after its prefill: the client's
first token must come well before that, and the whole stream must equal the
same request's answer without the option (the simulator answers the same
tokens for the same prompt, as greedy vLLM does).
"""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest

from pdgate.config import GatewayConfig
from pdgate.gateway import create_app
from pdgate.sim import SimFleet
from tests.fakes import serve_app_in_thread
from tests.sim.conftest import FAST
from tests.sse import read_stream

SLOW_KV = FAST.replace(kv_transfer_latency_s=0.6)


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(1, 1, profile=SLOW_KV, time_scale=1.0) as f:
        yield f


class Gateway:
    def __init__(self, fleet: SimFleet, **cfg: Any) -> None:
        config = GatewayConfig(prefill=fleet.prefill_urls, decode=fleet.decode_urls, tokenizer={"words": True},
                               health={"enabled": False}, **cfg)
        self.server, self.thread, self.url = serve_app_in_thread(create_app(config))

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def counter(self, prefix: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(prefix))


@pytest.fixture(scope="module")
def gateways(fleet: SimFleet) -> Iterator[tuple[Gateway, Gateway]]:
    on, off = Gateway(fleet, first_token={"from_prefill": True}), Gateway(fleet)
    yield on, off
    on.close()
    off.close()


def req(n: int, **kw: Any) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": " ".join(f"w{7 * n + i}" for i in range(n)), "max_tokens": 6,
            "temperature": 0, "stream": True, "return_token_ids": True, "ignore_eos": True, **kw}


def test_first_token_comes_from_prefill_and_the_stream_is_unchanged(gateways: tuple[Gateway, Gateway]) -> None:
    on, off = gateways
    for n in (20, 300):
        r = req(n, stream_options={"include_usage": True})
        s_on, s_off = read_stream(on.url, r, timeout=30), read_stream(off.url, r, timeout=30)
        assert s_on.first_s is not None and s_off.first_s is not None
        assert s_off.first_s >= 0.6 and s_on.first_s < 0.4, (s_on.first_s, s_off.first_s)  # before the KV transfer
        assert (s_on.text, s_on.ids) == (s_off.text, s_off.ids) and len(s_on.ids) == 6
        assert s_on.events[-1]["usage"]["completion_tokens"] == 6
        assert sum(1 for e in s_on.events if e.get("choices")) == 6  # one event per token, the first not twice
        assert not s_on.errors
    assert on.counter('pdgate_prefill_first_tokens_total{outcome="sent"}') == 2
    assert on.counter('pdgate_prefill_first_tokens_total{outcome="mismatch"}') == 0
    assert on.counter('pdgate_requests_total{outcome="success",route="pd"}') == 2


def test_chat_first_token_from_prefill(gateways: tuple[Gateway, Gateway]) -> None:
    on, off = gateways
    r = {"model": "sim-model", "messages": [{"role": "user", "content": "w1 w2 w3 w4"}], "max_tokens": 5,
         "temperature": 0, "stream": True, "ignore_eos": True}
    sent = on.counter('pdgate_prefill_first_tokens_total{outcome="sent"}')
    s_on = read_stream(on.url, r, "chat/completions", timeout=30)
    s_off = read_stream(off.url, r, "chat/completions", timeout=30)
    assert s_on.first_s is not None and s_off.first_s is not None
    assert s_on.first_s < 0.4 <= 0.6 <= s_off.first_s
    assert s_on.text == s_off.text and len(s_on.text.split()) == 5
    assert s_on.events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(1 for e in s_on.events if e["choices"][0]["delta"].get("role")) == 1
    assert on.counter('pdgate_prefill_first_tokens_total{outcome="sent"}') == sent + 1


def test_not_eligible_or_not_waited_long_enough_keeps_the_decode_first_token(fleet: SimFleet,
                                                                             gateways: tuple[Gateway, Gateway]) -> None:
    on, _ = gateways
    sent = on.counter('pdgate_prefill_first_tokens_total{outcome="sent"}')
    t = read_stream(on.url, req(30, temperature=0.5), timeout=30).first_s  # sampled: the decode leg samples its own
    assert t is not None and t >= 0.6
    late = Gateway(fleet, first_token={"from_prefill": True, "min_wait_s": 5.0})
    try:
        t = read_stream(late.url, req(31), timeout=30).first_s
        assert t is not None and t >= 0.6 and late.counter("pdgate_prefill_first_tokens_total{") == 0
    finally:
        late.close()
    assert on.counter('pdgate_prefill_first_tokens_total{outcome="sent"}') == sent


def test_decode_failure_after_the_first_token_ends_with_an_sse_error(fleet: SimFleet,
                                                                     gateways: tuple[Gateway, Gateway]) -> None:
    on, _ = gateways
    dec = fleet.decode_urls[0]
    assert httpx.post(dec + "/sim/fault", json={"mode": "status", "status": 500, "count": 1}).status_code == 200
    try:
        s = read_stream(on.url, req(40), timeout=30)
    finally:
        httpx.post(dec + "/sim/fault", json={"mode": None})
    assert len(s.text.split()) == 1                     # the first token, then the error
    assert s.errors == s.events[-1:] and s.events[-1]["error"]["code"] == 500
    # the instance counters are back to idle
    inst = httpx.get(on.url + "/health").json()["instances"]
    assert all(i["in_flight"] == 0 for i in inst)
