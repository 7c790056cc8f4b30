"""Bad-input corpus: every malformed request gets the right 4xx in OpenAI
error JSON and never reaches an instance (counted by the fake transport).

The corpus table is also what ``bench/reliability.py`` replays for the
reliability report (``CORPUS``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest
from starlette.testclient import TestClient

from pdgate.config import GatewayConfig
from pdgate.gateway import create_app
from tests.backend import FakeBackend

MAX_MODEL_LEN = 4096


@dataclass
class Case:
    id: str
    body: Any                     # dict (sent as JSON) or raw bytes
    status: int
    endpoint: str = "completions"
    headers: dict[str, str] = field(default_factory=dict)
    param: str | None = None


def _c(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "a b c", "max_tokens": 4, **kw}


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


CORPUS: list[Case] = [
    # not JSON / not an object
    Case("invalid_json", b"{not json", 400),
    Case("truncated_json", b'{"model":"m","prompt":"a', 400),
    Case("json_array", b"[1,2]", 400),
    Case("json_string", b'"hello"', 400),
    Case("empty_body", b"", 400),
    Case("nan_literal", b'{"model":"m","prompt":"x","temperature":NaN}', 400),
    Case("deep_nesting", b'{"model":"m","prompt":' + b"[" * 20000 + b"]" * 20000 + b"}", 400),
    Case("huge_integer_literal", b'{"model":"m","prompt":"x","max_tokens":' + b"9" * 5000 + b"}", 400),
    # encoding
    Case("invalid_utf8_body", b"\xff\xfe\xfd", 400),
    Case("invalid_utf8_in_string", b'{"model":"m","prompt":"a\xffb"}', 400),
    Case("lone_surrogate", b'{"model":"m","prompt":"a\\ud800b"}', 400),
    # missing fields
    Case("missing_prompt", {"model": "m", "max_tokens": 4}, 400, param="prompt"),
    Case("missing_messages", {"model": "m"}, 400, "chat/completions", param="messages"),
    # wrong types
    Case("prompt_number", _c(prompt=5), 400, param="prompt"),
    Case("prompt_object", _c(prompt={"a": 1}), 400, param="prompt"),
    Case("prompt_mixed_list", _c(prompt=[1, "a"]), 400, param="prompt"),
    Case("prompt_bool_ids", _c(prompt=[True, False]), 400, param="prompt"),
    Case("model_number", _c(model=5), 400, param="model"),
    Case("model_empty", _c(model=""), 400, param="model"),
    Case("stream_string", _c(stream="yes"), 400, param="stream"),
    Case("stream_options_string", _c(stream_options="x"), 400, param="stream_options"),
    Case("include_usage_string", _c(stream=True, stream_options={"include_usage": "y"}), 400,
         param="stream_options"),
    Case("max_tokens_string", _c(max_tokens="5"), 400, param="max_tokens"),
    Case("max_tokens_float", _c(max_tokens=5.5), 400, param="max_tokens"),
    Case("max_tokens_bool", _c(max_tokens=True), 400, param="max_tokens"),
    Case("temperature_string", _c(temperature="hot"), 400, param="temperature"),
    Case("top_p_out_of_range", _c(top_p=3), 400, param="top_p"),
    Case("stop_number", _c(stop=5), 400, param="stop"),
    Case("priority_string", _c(priority="high"), 400, param="priority"),
    Case("messages_string", _chat(messages="hi"), 400, "chat/completions", param="messages"),
    Case("messages_of_numbers", _chat(messages=[1, 2]), 400, "chat/completions", param="messages"),
    Case("message_without_role", _chat(messages=[{"content": "hi"}]), 400, "chat/completions",
         param="messages"),
    Case("message_content_number", _chat(messages=[{"role": "user", "content": 5}]), 400,
         "chat/completions", param="messages"),
    # ranges
    Case("max_tokens_negative", _c(max_tokens=-1), 400, param="max_tokens"),
    Case("max_tokens_zero", _c(max_tokens=0), 400, param="max_tokens"),
    Case("max_tokens_huge", _c(max_tokens=10**30), 400, param="max_tokens"),
    Case("max_tokens_over_context", _c(max_tokens=MAX_MODEL_LEN + 1), 400, param="max_tokens"),
    Case("max_completion_tokens_negative", _chat(max_completion_tokens=-5), 400, "chat/completions",
         param="max_completion_tokens"),
    Case("token_id_negative", _c(prompt=[1, -1]), 400, param="prompt"),
    Case("token_id_huge", _c(prompt=[1, 2**40]), 400, param="prompt"),
    # empty / oversized prompts
    Case("prompt_empty_string", _c(prompt=""), 400, param="prompt"),
    Case("prompt_empty_list", _c(prompt=[]), 400, param="prompt"),
    Case("prompt_list_of_empty", _c(prompt=[[]]), 400, param="prompt"),
    Case("messages_empty", _chat(messages=[]), 400, "chat/completions", param="messages"),
    Case("prompt_over_context_ids", _c(prompt=[7] * (MAX_MODEL_LEN + 10)), 400, param="prompt"),
    Case("prompt_over_context_text", _c(prompt="w " * (MAX_MODEL_LEN + 10)), 400, param="prompt"),
    Case("prompt_plus_output_over_context", _c(prompt=[7] * 4000, max_tokens=200), 400, param="max_tokens"),
    Case("chat_over_context", _chat(messages=[{"role": "user", "content": "w " * (MAX_MODEL_LEN + 10)}]),
         400, "chat/completions", param="prompt"),
    Case("oversized_body", _c(prompt="x" * 70_000), 413),
    # semantics the P/D path cannot serve
    Case("n_2", _c(n=2), 400, param="n"),
    Case("best_of_3", _c(best_of=3), 400, param="best_of"),
    Case("batched_prompts", _c(prompt=["a", "b"]), 400, param="prompt"),
    Case("prompt_embeds", _c(prompt_embeds="AAAA"), 400, param="prompt_embeds"),
    Case("unknown_model", _c(model="nope"), 404, param="model"),
    Case("unknown_model_chat", _chat(model="gpt-nope"), 404, "chat/completions", param="model"),
    Case("unknown_field", _c(foo=1), 400, param="foo"),
    Case("unknown_field_typo", _c(max_token=5), 400, param="max_token"),
    Case("unknown_slo_class", _c(slo_class="nope"), 400, param="slo_class"),
    # headers
    Case("oversized_headers", _c(), 431, headers={"x-big": "a" * 9000}),
    Case("many_headers", _c(), 431, headers={f"x-h{i}": "v" * 40 for i in range(300)}),
    Case("crlf_in_request_id", _c(), 400, headers={"x-request-id": "a\r\nx-evil: 1"}),
    Case("lf_in_traceparent", _c(), 400, headers={"traceparent": "00-a\nset-cookie: x"}),
    Case("nul_in_authorization", _c(), 400, headers={"authorization": "Bearer a\x00b"}),
]


def gateway_config(**kw: Any) -> GatewayConfig:
    return GatewayConfig(prefill=["http://p0:8000"], decode=["http://d0:8000"], max_body_bytes=64 * 1024,
                         limits={"max_header_bytes": 8 * 1024}, tokenizer={"words": True},
                         scrape={"enabled": False}, health={"enabled": False}, **kw)


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[TestClient, FakeBackend]]:
    backend = FakeBackend(max_model_len=MAX_MODEL_LEN)
    app = create_app(gateway_config(), transport=backend.transport())
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, backend


def send(client: TestClient, case: Case) -> Any:
    raw = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    return client.post(f"/v1/{case.endpoint}", content=raw,
                       headers={"content-type": "application/json", **case.headers})


@pytest.mark.parametrize("case", CORPUS, ids=[c.id for c in CORPUS])
def test_bad_input_is_refused_before_any_instance(gw: tuple[TestClient, FakeBackend], case: Case) -> None:
    client, backend = gw
    before = backend.completion_calls
    r = send(client, case)
    assert r.status_code == case.status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == case.status and isinstance(err["message"], str) and err["message"]
    assert err["type"] == {404: "not_found_error"}.get(case.status, "invalid_request_error")
    if case.param is not None:
        assert err["param"] == case.param
    assert backend.completion_calls == before, "a refused request reached an instance"


def test_corpus_refusals_are_counted(gw: tuple[TestClient, FakeBackend]) -> None:
    client, _ = gw
    for case in CORPUS[:3]:
        send(client, case)
    m = client.get("/metrics").text
    assert 'pdgate_rejected_requests_total{reason="invalid_json"}' in m


def test_valid_requests_still_pass(gw: tuple[TestClient, FakeBackend]) -> None:
    """The control group: the same gateway serves good requests (P/D legs)."""
    client, backend = gw
    before = backend.completion_calls
    for body, ep in ((_c(), "completions"), (_chat(max_completion_tokens=3), "chat/completions"),
                     (_c(prompt=[7] * 4000, max_tokens=96), "completions"),
                     (_c(prompt=[[1, 2, 3]], stream=True, stream_options={"include_usage": True}), "completions")):
        r = client.post(f"/v1/{ep}", json=body)
        assert r.status_code == 200, r.text
    assert backend.completion_calls == before + 8  # prefill + decode each


def test_client_kv_transfer_params_are_dropped_never_forwarded(gw: tuple[TestClient, FakeBackend]) -> None:
    client, backend = gw
    n = len(backend.bodies)
    evil = {"do_remote_prefill": True, "remote_host": "169.254.169.254", "remote_port": 80,
            "remote_engine_id": "evil", "remote_block_ids": [[0]]}
    r = client.post("/v1/completions", json=_c(kv_transfer_params=evil))
    assert r.status_code == 200
    for _, body in backend.bodies[n:]:
        kv = body.get("kv_transfer_params") or {}
        assert kv.get("remote_host") != "169.254.169.254" and kv.get("remote_engine_id") != "evil"
    assert "pdgate_client_kv_transfer_params_dropped_total 1.0" in client.get("/metrics").text


def test_context_check_uses_the_largest_instance_context() -> None:
    """Instances differ in ``max_model_len`` (prefill started with a smaller
    one): a prompt that only the decode instance can hold is served (the
    prefill instance would refuse it, which is a fallback), one that no
    instance can hold is refused with 400 before reaching any."""
    backend = FakeBackend(max_model_len=4096)
    backend.max_model_len_of["p0:8000"] = 512
    app = create_app(gateway_config(), transport=backend.transport())
    with TestClient(app, raise_server_exceptions=False) as client:
        ok = client.post("/v1/completions", json=_c(prompt=[7] * 1000, max_tokens=8))
        assert ok.status_code == 200, ok.text
        before = backend.completion_calls
        too_long = client.post("/v1/completions", json=_c(prompt=[7] * 4090, max_tokens=8))
        assert too_long.status_code == 400 and "4096" in too_long.json()["error"]["message"], too_long.text
        assert backend.completion_calls == before
