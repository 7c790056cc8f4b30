"""Gateway behaviour against in-process fake vLLM instances (fast tier)."""

from __future__ import annotations

import json
import time
from typing import Iterator

import httpx
import pytest

from pdgate.config import GatewayConfig
from pdgate.gateway import create_app
from tests.fakes import FakeInstance, serve_app_in_thread


class Env:
    def __init__(self, n_prefill: int = 1, n_decode: int = 1, **cfg: object) -> None:
        self.prefill = [FakeInstance(f"p{i}").start() for i in range(n_prefill)]
        self.decode = [FakeInstance(f"d{i}").start() for i in range(n_decode)]
        config = GatewayConfig(prefill=[p.url for p in self.prefill],
                               decode=[d.url for d in self.decode], **cfg)
        self.app = create_app(config)
        self.server, self.thread, self.url = serve_app_in_thread(self.app)

    def post(self, path: str, body: object, **kw: object) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=10, **kw)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics").text

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        for f in self.prefill + self.decode:
            f.stop()


@pytest.fixture
def env() -> Iterator[Env]:
    e = Env()
    yield e
    e.close()


def req(**kw: object) -> dict:
    return {"model": "m", "prompt": "a b c", "max_tokens": 5, **kw}


def test_pd_flow_legs_are_exactly_as_nixl_expects(env: Env) -> None:
    r = env.post("/v1/completions", req(stream=False, min_tokens=2,
                                         stream_options={"include_usage": True}),
                 headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "abc-123"
    assert r.json()["choices"][0]["text"] == "t0 t1 t2 t3 t4"
    [p] = env.prefill[0].received
    assert p["max_tokens"] == 1 and p["stream"] is False
    assert "stream_options" not in p and "min_tokens" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert p["kv_transfer_params"]["do_remote_prefill"] is False
    [d] = env.decode[0].received
    # decode leg = the original request + exactly the returned params
    assert d["max_tokens"] == 5 and d["min_tokens"] == 2
    assert d["stream_options"] == {"include_usage": True}
    assert d["kv_transfer_params"]["remote_engine_id"] == "p0"
    assert d["kv_transfer_params"]["remote_request_id"] == "abc-123"
    assert env.prefill[0].headers[0]["x-request-id"] == "abc-123"
    assert env.decode[0].headers[0]["x-request-id"] == "abc-123"


def test_client_kv_transfer_params_are_dropped(env: Env) -> None:
    evil = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_block_ids": [[0]]}
    r = env.post("/v1/completions", req(kv_transfer_params=evil))
    assert r.status_code == 200
    p, d = env.prefill[0].received[0], env.decode[0].received[0]
    assert p["kv_transfer_params"].get("remote_host") is None
    assert d["kv_transfer_params"]["remote_host"] == "127.0.0.1"  # from prefill, not client
    assert "pdgate_client_kv_transfer_params_dropped_total 1.0" in env.metrics()


def test_streaming_is_sse_and_relayed(env: Env) -> None:
    with httpx.stream("POST", env.url + "/v1/completions",
                      json=req(stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [l for l in r.iter_lines() if l]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(l[6:]) for l in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "t0 t1 t2 t3 t4 "
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    m = env.metrics()
    assert "pdgate_time_to_first_token_seconds_count 1.0" in m
    assert "pdgate_time_per_output_token_seconds_count 1.0" in m
    assert 'pdgate_instance_requests_in_flight{instance="%s",role="decode"} 0.0' % env.decode[0].url in m


def test_chat_completions(env: Env) -> None:
    r = env.post("/v1/chat/completions",
                 {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                  "max_completion_tokens": 3})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "t0 t1 t2"
    p = env.prefill[0].received[0]
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1


@pytest.mark.parametrize("mode", ["status", "omit", "dead"])
def test_prefill_failure_falls_back_to_decode(mode: str) -> None:
    e = Env()
    try:
        if mode == "status":
            e.prefill[0].behaviour.status = 500
        elif mode == "omit":
            e.prefill[0].behaviour.omit_kv_params = True
        else:
            e.prefill[0].stop()
        r = e.post("/v1/completions", req())
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == "t0 t1 t2 t3 t4"
        d = e.decode[0].received[-1]
        assert "kv_transfer_params" not in d
        m = e.metrics()
        assert 'pdgate_requests_total{outcome="success",route="decode_only"} 1.0' in m
        assert "pdgate_prefill_fallbacks_total{reason=" in m
    finally:
        e.close()


def test_decode_retry_on_dead_instance() -> None:
    e = Env(n_decode=2)
    try:
        e.decode[0].stop()
        for _ in range(4):
            assert e.post("/v1/completions", req()).status_code == 200
        assert len(e.decode[1].received) == 4
    finally:
        e.close()


def test_decode_error_passes_through(env: Env) -> None:
    env.decode[0].behaviour.status = 400
    r = env.post("/v1/completions", req())
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "d0 fails"


def test_round_robin_over_instances() -> None:
    e = Env(n_prefill=2, n_decode=3)
    try:
        for _ in range(6):
            assert e.post("/v1/completions", req()).status_code == 200
        assert [len(p.received) for p in e.prefill] == [3, 3]
        assert [len(d.received) for d in e.decode] == [2, 2, 2]
    finally:
        e.close()


def test_in_flight_counts_until_stream_end(env: Env) -> None:
    env.decode[0].behaviour.token_delay_s = 0.05
    with httpx.stream("POST", env.url + "/v1/completions", json=req(stream=True, max_tokens=10)) as r:
        it = r.iter_lines()
        next(it)  # first chunk: headers long gone, stream still open
        h = httpx.get(env.url + "/health").json()
        dec = [i for i in h["instances"] if i["role"] == "decode"][0]
        assert dec["in_flight"] == 1
        list(it)
    h = httpx.get(env.url + "/health").json()
    assert all(i["in_flight"] == 0 for i in h["instances"])


def test_stream_breaking_mid_way_sends_sse_error(env: Env) -> None:
    env.decode[0].behaviour.die_after_tokens = 2
    with httpx.stream("POST", env.url + "/v1/completions", json=req(stream=True)) as r:
        assert r.status_code == 200
        lines = [l for l in r.iter_lines() if l]
    assert json.loads(lines[-1][6:])["error"]["code"] == 502
    assert 'outcome="upstream_error",route="pd"' in env.metrics()


@pytest.mark.parametrize("raw,status", [
    (b"{not json", 400),
    (b"[1,2]", 400),
    (b'{"model":"m"}', 400),
    (b'{"model":"m","prompt":""}', 400),
    (b'{"model":"m","prompt":"x","max_tokens":-1}', 400),
    (b'{"model":"m","prompt":"x","max_tokens":"5"}', 400),
    (b'{"model":"m","prompt":"x","n":2}', 400),
    (b'{"model":"m","prompt":"x","stream":"yes"}', 400),
    (b'\xff\xfe', 400),
])
def test_bad_input_gets_openai_error_and_never_reaches_instances(env: Env, raw: bytes, status: int) -> None:
    r = httpx.post(env.url + "/v1/completions", content=raw,
                   headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == status and err["type"] == "invalid_request_error" and err["message"]
    assert env.prefill[0].received == [] and env.decode[0].received == []


def test_oversized_body_is_413() -> None:
    e = Env(max_body_bytes=1000)
    try:
        r = e.post("/v1/completions", req(prompt="x" * 5000))
        assert r.status_code == 413
        assert r.json()["error"]["code"] == 413
    finally:
        e.close()


def test_unsafe_request_id_is_replaced(env: Env) -> None:
    r = env.post("/v1/completions", req(), headers={"X-Request-Id": "a b\tc" + "x" * 200})
    rid = r.headers["x-request-id"]
    assert rid != "a b\tc" + "x" * 200 and len(rid) == 32
    assert env.decode[0].headers[0]["x-request-id"] == rid


def test_models_health_metrics(env: Env) -> None:
    assert httpx.get(env.url + "/v1/models").json()["data"][0]["id"] == "fake-model"
    h = httpx.get(env.url + "/health").json()
    assert h["status"] == "ok" and len(h["instances"]) == 2
    r = httpx.get(env.url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    assert "# HELP pdgate_requests_total" in r.text


def test_non_streamed_decode_waits_decode_first_byte_s_not_decode_idle_s() -> None:
    """A non-streamed answer arrives whole after the last token: the wait is bounded by
    ``timeouts.decode_first_byte_s``; ``decode_idle_s`` (gaps of a stream) does not cut it."""
    e = Env(timeouts={"decode_idle_s": 0.5, "decode_first_byte_s": 3.0})
    try:
        e.decode[0].behaviour.hang_s = 1.2          # longer than decode_idle_s
        r = e.post("/v1/completions", req())
        assert r.status_code == 200, r.text
        e.decode[0].behaviour.hang_s = 5.0          # longer than decode_first_byte_s
        t0 = time.monotonic()
        r = e.post("/v1/completions", req())
        assert r.status_code == 504 and r.json()["error"]["code"] == 504
        assert 2.5 < time.monotonic() - t0 < 4.9
        e.decode[0].behaviour.hang_s = 1.2          # streamed: the first chunk is due within decode_idle_s
        t0 = time.monotonic()
        r = e.post("/v1/completions", req(stream=True))
        assert r.status_code == 504 and time.monotonic() - t0 < 1.1, r.text
    finally:
        e.close()
