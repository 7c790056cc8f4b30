"""Property-based fuzzing of the gateway's API: schemathesis generates
requests from the gateway's own OpenAPI document (valid and invalid bodies,
headers, paths) and every answer must be a non-5xx; hypothesis feeds
arbitrary bytes and JSON to the body checks, which may only refuse (400)."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdgate.config import GatewayConfig
from pdgate.gateway import create_app
from pdgate.gateway.errors import GatewayError
from pdgate.gateway.validation import parse_body, validate_request
from tests.backend import FakeBackend
from tests.fakes import serve_app_in_thread

CONFIG = GatewayConfig(prefill=["http://p0:8000"], decode=["http://d0:8000"], scrape={"enabled": False},
                       health={"enabled": False}, tokenizer={"words": True}, max_body_bytes=256 * 1024)
BACKEND = FakeBackend(models=("m",), max_model_len=4096)
APP = create_app(CONFIG, transport=BACKEND.transport())
schema = schemathesis.openapi.from_dict(APP.openapi())


@pytest.fixture(scope="module")
def gateway_url() -> Iterator[str]:
    server, thread, url = serve_app_in_thread(APP)
    yield url
    server.should_exit = True
    thread.join(10)


@schema.parametrize()
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_never_answers_5xx(case: Any, gateway_url: str) -> None:
    r = case.call(base_url=gateway_url, timeout=30)
    assert r.status_code < 500, f"{case.method} {case.path} -> {r.status_code}: {r.text[:500]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["code"] == r.status_code and err["message"]


def test_schema_declares_request_bodies() -> None:
    spec = APP.openapi()
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        props = body["content"]["application/json"]["schema"]["properties"]
        assert "prompt" in props or "messages" in props


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                    max_leaves=20)
FIELDS = st.sampled_from(["model", "prompt", "messages", "max_tokens", "n", "stream", "stream_options",
                          "temperature", "stop", "priority", "slo_class", "best_of", "max_completion_tokens",
                          "kv_transfer_params", "top_p", "seed", "min_tokens", "prompt_embeds"])


@given(raw=st.binary(max_size=512))
@settings(max_examples=300, deadline=None)
def test_body_checks_only_refuse_arbitrary_bytes(raw: bytes) -> None:
    try:
        body = parse_body(raw)
        validate_request("completions", body)
    except GatewayError as e:
        assert 400 <= e.status < 500


@given(body=st.dictionaries(FIELDS, JSON, max_size=8), endpoint=st.sampled_from(["completions",
                                                                                 "chat/completions"]))
@settings(max_examples=500, deadline=None)
def test_body_checks_only_refuse_arbitrary_json(body: dict[str, Any], endpoint: str) -> None:
    try:
        validate_request(endpoint, parse_body(json.dumps(body).encode()))
    except GatewayError as e:
        assert 400 <= e.status < 500


@given(body=st.dictionaries(FIELDS, JSON, max_size=6))
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_gateway_never_5xx_on_mutated_bodies(body: dict[str, Any], gateway_url: str) -> None:
    body = {"model": "m", "prompt": "a b", **body}
    r = httpx.post(gateway_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code < 500, r.text


def test_fuzzing_exercised_the_proxy_path() -> None:
    """Runs after the fuzzers (file order): some generated requests were valid
    and went through both legs, so the fuzzers tested more than refusals."""
    assert BACKEND.completion_calls > 0
