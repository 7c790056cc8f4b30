"""The first token from the prefill leg: eligibility, the client's first event, and the
splice that removes that token from the decode stream (:mod:`pdgate.gateway.first_token`)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, strategies as st

from pdgate.gateway.first_token import SpliceFirstToken, eligible, first_event, first_text

GREEDY = {"model": "m", "prompt": "x", "stream": True, "temperature": 0, "max_tokens": 8}


@pytest.mark.parametrize("extra, ok", [
    ({}, True),
    ({"temperature": 0.0}, True),
    ({"temperature": 0.7, "top_k": 1}, True),
    ({"temperature": 0.7}, False),
    ({"temperature": None}, False),
    ({"stream": False}, False),
    ({"n": 2}, False),
    ({"best_of": 3}, False),
    ({"stop": ["\n"]}, False),
    ({"stop": "x"}, False),
    ({"stop": []}, True),
    ({"logprobs": 2}, False),
    ({"logprobs": True, "top_logprobs": 3}, False),
    ({"echo": True}, False),
    ({"min_tokens": 3}, False),
    ({"max_tokens": 1}, False),
    ({"max_tokens": None}, True),
    ({"max_completion_tokens": 1}, False),
    ({"stream_options": {"include_usage": True}}, True),
    ({"stream_options": {"continuous_usage_stats": True}}, False),
])
def test_eligible(extra: dict[str, Any], ok: bool) -> None:
    assert eligible({**GREEDY, **extra}) is ok


def answer(text: str, chat: bool = False, finish: str = "length", ids: bool = False) -> dict[str, Any]:
    c: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        c["message"] = {"role": "assistant", "content": text}
    else:
        c["text"] = text
    if ids:
        c["token_ids"] = [42]
        c["prompt_token_ids"] = [1, 2, 3]
    return {"id": "cmpl-r1", "created": 7, "model": "m", "choices": [c]}


def test_first_text() -> None:
    assert first_text(answer(" the"), chat=False) == " the"
    assert first_text(answer(" the", chat=True), chat=True) == " the"
    assert first_text(answer(" the", finish="stop"), chat=False) is None  # the decode leg may stop there
    assert first_text(answer(""), chat=False) is None
    assert first_text(answer("\ufffd"), chat=False) is None  # half a UTF-8 character
    assert first_text({"choices": []}, chat=False) is None
    assert first_text({"choices": [answer("a")["choices"][0]] * 2}, chat=False) is None
    assert first_text("garbage", chat=False) is None


def parse(event: bytes) -> dict[str, Any]:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    return json.loads(event[6:])


def test_first_event_completion_and_chat() -> None:
    e = parse(first_event(answer(" a", ids=True), chat=False, text=" a"))
    assert e["id"] == "cmpl-r1" and e["object"] == "text_completion" and e["model"] == "m"
    c = e["choices"][0]
    assert c["text"] == " a" and c["token_ids"] == [42] and c["prompt_token_ids"] == [1, 2, 3]
    assert c["finish_reason"] is None
    e = parse(first_event(answer(" a", chat=True), chat=True, text=" a"))
    assert e["object"] == "chat.completion.chunk"
    assert e["choices"][0]["delta"] == {"role": "assistant", "content": " a"}


def comp(text: str, ids: list[int] | None = None, finish: str | None = None, **kw: Any) -> bytes:
    c: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, **kw}
    if ids is not None:
        c["token_ids"] = ids
    return b"data: " + json.dumps({"id": "cmpl-r1", "choices": [c]}).encode() + b"\n\n"


def chat(delta: dict[str, Any], finish: str | None = None) -> bytes:
    c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return b"data: " + json.dumps({"id": "chatcmpl-r1", "choices": [c]}).encode() + b"\n\n"


def texts(stream: bytes, chat_mode: bool = False) -> tuple[str, list[int]]:
    text, ids = "", []
    for ev in stream.split(b"\n\n"):
        if not ev.startswith(b"data: {"):
            continue
        obj = json.loads(ev[6:])
        for c in obj.get("choices", []):
            text += (c["delta"].get("content") or "") if chat_mode else c["text"]
            ids += c.get("token_ids") or []
    return text, ids


def test_splice_drops_the_first_token_event_then_passes_bytes_through() -> None:
    s = SpliceFirstToken(chat=False, text=" a", had_ids=True)
    first = comp(" a", [42], prompt_token_ids=[1, 2, 3])
    assert s.feed(first, 1.0) == b"" and not s.active and s.seen_at == 1.0
    rest = comp(" b", [43]) + comp(" c", [44], finish="length") + b"data: [DONE]\n\n"
    assert s.feed(rest, 2.0) == rest  # untouched once spliced
    assert not s.mismatch


def test_splice_across_chunk_boundaries() -> None:
    s = SpliceFirstToken(chat=False, text=" a", had_ids=False)
    stream = comp(" a") + comp(" b") + comp(" c", finish="length") + b"data: [DONE]\n\n"
    out = b"".join(s.feed(stream[i:i + 7], float(i)) for i in range(0, len(stream), 7))
    assert texts(out) == (" b c", [])
    assert out.endswith(b"data: [DONE]\n\n")


def test_splice_held_back_text_and_merged_tokens() -> None:
    # the decode stream sends token one's text late (detokenizer holdback), merged with token two's
    s = SpliceFirstToken(chat=False, text="ab", had_ids=True)
    out = s.feed(comp("", [42]) + comp("abc", [43]) + comp("d", [44]), 0.0)
    assert texts(out) == ("cd", [43, 44])
    # or splits it over two events
    s = SpliceFirstToken(chat=False, text="ab", had_ids=False)
    assert texts(s.feed(comp("a") + comp("bc") + comp("d"), 0.0)) == ("cd", [])


def test_splice_chat_drops_role_and_first_content() -> None:
    s = SpliceFirstToken(chat=True, text=" hi", had_ids=False)
    out = s.feed(chat({"role": "assistant", "content": ""}) + chat({"content": " hi"}) + chat({"content": " there"})
                 + chat({}, finish="length"), 0.0)
    assert texts(out, chat_mode=True) == (" there", [])
    assert b'"role"' not in out and b'"length"' in out


def test_splice_mismatch_relays_the_rest_and_says_so() -> None:
    s = SpliceFirstToken(chat=False, text=" a", had_ids=False)
    out = s.feed(comp(" z") + comp(" b"), 0.0)
    assert s.mismatch and texts(out) == (" z b", [])


def test_splice_keeps_usage_and_error_events() -> None:
    s = SpliceFirstToken(chat=False, text=" a", had_ids=False)
    err = b'data: {"error":{"message":"x","code":502}}\n\n'
    assert s.feed(err, 0.0) == err and s.active


@given(st.lists(st.text(min_size=1, max_size=4), min_size=2, max_size=8), st.integers(1, 40))
def test_splice_property_client_sees_every_token_once(tokens: list[str], cut: int) -> None:
    """Whatever the chunking, first event + spliced decode stream == the decode stream's text."""
    s = SpliceFirstToken(chat=False, text=tokens[0], had_ids=True)
    stream = b"".join(comp(t, [i]) for i, t in enumerate(tokens))
    out = b"".join(s.feed(stream[i:i + cut], 0.0) for i in range(0, len(stream), cut))
    text, ids = texts(out)
    assert tokens[0] + text == "".join(tokens) and ids == list(range(1, len(tokens)))
    assert not s.mismatch
