"""The proxy's SSE scanner (hot path) against vLLM-shaped chunks."""

from __future__ import annotations

import json

from pdgate.gateway.legs import StreamStats, scan_sse_events


def ev(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def test_counts_content_chunks_and_reads_usage() -> None:
    chunks = [ev({"choices": [{"index": 0, "text": " a"}]}),
              ev({"choices": [{"index": 0, "delta": {"content": "b"}}]}),
              b'data: {"choices": [{"index": 0, "text": "c"}]}\n\n',           # spaced JSON
              ev({"choices": [], "usage": {"completion_tokens": 3}}),
              b"data: [DONE]\n\n"]
    stats = StreamStats(arrival=0.0)
    buf = bytearray(b"".join(chunks))
    assert scan_sse_events(buf, stats, 1.5) == 3
    assert stats.tokens == 3 and stats.usage_tokens == 3 and stats.first_token == 1.5 and not buf


def test_partial_events_wait_for_the_rest() -> None:
    stats = StreamStats(arrival=0.0)
    whole = ev({"choices": [{"index": 0, "text": "x"}]})
    buf = bytearray(whole[:10])
    assert scan_sse_events(buf, stats, 1.0) == 0
    buf += whole[10:]
    assert scan_sse_events(buf, stats, 2.0) == 1 and stats.first_token == 2.0


def test_usage_with_content_in_one_chunk() -> None:
    stats = StreamStats(arrival=0.0)
    buf = bytearray(ev({"choices": [{"index": 0, "text": "x"}], "usage": {"completion_tokens": 1}}))
    assert scan_sse_events(buf, stats, 1.0) == 1 and stats.usage_tokens == 1


def test_unicode_line_breaks_inside_token_text_do_not_split_events() -> None:
    """vLLM leaves U+2028, U+2029 and U+0085 raw in its JSON; only a blank
    line (LF LF) ends an SSE event."""
    texts = ["a\u2028b", "\x85", "c\u2029"]
    raw = b"".join(b"data: " + json.dumps({"choices": [{"index": 0, "text": t}]},
                                          ensure_ascii=False).encode() + b"\n\n" for t in texts)
    stats = StreamStats(arrival=0.0)
    buf = bytearray(raw)
    assert scan_sse_events(buf, stats, 1.0) == 3
    assert stats.tokens == 3 and not buf


def test_null_usage_is_no_usage_and_a_real_one_is_still_read() -> None:
    """Servers that write ``"usage": null`` on every content chunk (vLLM's continuous-usage
    off, other OpenAI-compatible servers) take the byte fast path; the final usage still counts."""
    chunks = [ev({"choices": [{"index": 0, "text": "a"}], "usage": None}),
              b'data: {"choices": [{"index": 0, "text": "\\"usage\\": 7"}], "usage": null}\n\n',
              ev({"choices": [{"index": 0, "text": "c", "finish_reason": "length"}],
                  "usage": {"completion_tokens": 3}}),
              b"data: [DONE]\n\n"]
    stats = StreamStats(arrival=0.0)
    buf = bytearray(b"".join(chunks))
    assert scan_sse_events(buf, stats, 1.0) == 3
    assert stats.tokens == 3 and stats.usage_tokens == 3 and not buf
