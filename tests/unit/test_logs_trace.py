"""Structured logs (request id on every line of a request, access log included)
and W3C trace context propagated to both legs (fake instances record headers)."""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from typing import Iterator

import httpx
import pytest
import uvicorn

from pdgate.config import GatewayConfig
from pdgate.gateway import create_app
from pdgate.gateway.context import new_traceparent, parse_traceparent, trace_context_from_headers
from pdgate.localfleet.vllm_server import free_port
from pdgate.logs import JsonFormatter, RequestContextFilter, configure_logging
from tests.fakes import FakeInstance

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Gw:
    """Gateway (uvicorn logging left to the root logger, as ``pdgate serve``) + 1P1D fakes."""

    def __init__(self) -> None:
        self.p, self.d = FakeInstance("p0").start(), FakeInstance("d0").start()
        app = create_app(GatewayConfig(prefill=[self.p.url], decode=[self.d.url]))
        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                                    log_level="info"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"

    def post(self, body: dict, **headers: str) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", json=body, headers=headers, timeout=10)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        self.p.stop()
        self.d.stop()


@pytest.fixture
def gw() -> Iterator[Gw]:
    g = Gw()
    yield g
    g.close()


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    handler = configure_logging("info", "json")
    buf = io.StringIO()
    handler.setStream(buf)
    yield buf
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def _lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def test_json_logs_carry_request_id_on_every_request_line(gw: Gw, json_logs: io.StringIO) -> None:
    gw.p.behaviour.status = 500                       # the proxy logs a warning for this request
    r = gw.post({"model": "m", "prompt": "a b", "max_tokens": 2}, **{"X-Request-Id": "req-42"})
    assert r.status_code == 200
    r = gw.post({"model": "m", "prompt": "a b", "max_tokens": 2, "stream": True},
                **{"X-Request-Id": "req-43", "traceparent": TP})
    assert r.status_code == 200
    time.sleep(0.2)
    lines = _lines(json_logs)
    for line in lines:
        assert {"timestamp", "level", "logger", "message", "request_id", "trace_id"} <= set(line)
    mine = [line for line in lines if line["request_id"] == "req-42"]
    assert any(line["logger"] == "pdgate.proxy" and "answered 500" in line["message"] for line in mine)
    access = [line for line in lines if line["logger"] == "uvicorn.access"]
    assert {a["request_id"] for a in access} >= {"req-42", "req-43"}
    assert all("/v1/completions" in a["message"] for a in access if a["request_id"])
    assert [a["trace_id"] for a in access if a["request_id"] == "req-43"] == [TP.split("-")[1]]
    # a line outside any request has no request id
    logging.getLogger("pdgate.test").warning("outside")
    assert _lines(json_logs)[-1]["request_id"] is None


def test_formatter_and_filter_outside_gateway() -> None:
    rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "boom %d", (7,), None)
    RequestContextFilter().filter(rec)
    out = json.loads(JsonFormatter().format(rec))
    assert out["message"] == "boom 7" and out["level"] == "ERROR" and out["request_id"] is None
    assert out["timestamp"].endswith("+00:00")


def test_client_traceparent_reaches_both_legs(gw: Gw) -> None:
    r = gw.post({"model": "m", "prompt": "a b", "max_tokens": 2}, traceparent=TP, tracestate="vendor=x1")
    assert r.status_code == 200
    [ph], [dh] = gw.p.headers, gw.d.headers
    assert ph["traceparent"] == dh["traceparent"] == TP
    assert ph["tracestate"] == dh["tracestate"] == "vendor=x1"
    assert ph["x-request-id"] == dh["x-request-id"]


def test_gateway_starts_a_trace_when_client_sends_none_or_garbage(gw: Gw) -> None:
    gw.post({"model": "m", "prompt": "a", "max_tokens": 2})
    gw.post({"model": "m", "prompt": "a", "max_tokens": 2}, traceparent="00-" + "0" * 32 + "-00f067aa0ba902b7-01",
            tracestate="dropped=1")
    assert len(gw.p.headers) == len(gw.d.headers) == 2
    ids = []
    for ph, dh in zip(gw.p.headers, gw.d.headers):
        assert ph["traceparent"] == dh["traceparent"]
        parsed = parse_traceparent(ph["traceparent"])
        assert parsed is not None and parsed[2] == "01"
        assert "tracestate" not in ph and "tracestate" not in dh
        ids.append(parsed[0])
    assert ids[0] != ids[1]


@pytest.mark.parametrize("value,ok", [
    (TP, True),
    (TP.upper(), True),                                    # normalized to lower case
    ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", True),  # future version
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", False),
    ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", False),
    ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", False),
    ("", False), (None, False),
])
def test_parse_traceparent(value: str | None, ok: bool) -> None:
    assert (parse_traceparent(value) is not None) is ok
    tp, _ = trace_context_from_headers(value, "a=b")
    assert parse_traceparent(tp) is not None
    if ok and value and value.startswith("00"):
        assert tp == value.lower()


def test_new_traceparent_is_valid_and_random() -> None:
    a, b = new_traceparent(), new_traceparent()
    assert parse_traceparent(a) and parse_traceparent(b) and a != b
