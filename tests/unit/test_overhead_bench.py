"""bench/overhead.py's parts: the fixed-response backend (JSON, the P/D handshake, SSE streams)
and the report's streamed rows."""

from __future__ import annotations

import json

import httpx

from pdgate.bench.overhead import _with_tokens, stream_body
from pdgate.sim import fixed
from pdgate.sim.http import start_server
from pdgate.sim.report import overhead_markdown


async def test_fixed_backend_answers_json_the_handshake_and_a_stream_of_max_tokens_events() -> None:
    server = await start_server(fixed.handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    async with server, httpx.AsyncClient() as c:
        pre = (await c.post(url, json={"prompt": "x", "max_tokens": 1,
                                       "kv_transfer_params": {"do_remote_decode": True}})).json()
        assert pre["kv_transfer_params"]["do_remote_prefill"] is True
        plain = (await c.post(url, json={"prompt": "x", "max_tokens": 5})).json()
        assert "kv_transfer_params" not in plain and plain["choices"][0]["finish_reason"] == "length"
        r = await c.post(url, content=stream_body(5))
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]" and len(events) == 6
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(ch["choices"][0]["text"] == " ok" for ch in chunks)
        assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None] * 4 + ["length"]
        assert all("usage" not in ch for ch in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] >= 1


def test_report_has_a_row_per_mode_with_tokens_per_second() -> None:
    point = {"concurrency": 32, "requests": 100, "rps": 50.0, "p50_ms": 10.0, "p99_ms": 20.0, "mean_ms": 11.0,
             "errors": 0}
    doc = {"meta": {"command": "bench/overhead.py --quick", "started_utc": "now", "backend": "fixed", "ncpu": 2,
                    "cpus": {"router": "0", "backends": "1", "client": "1"}, "duration_s": 3.0,
                    "stream_tokens": 16, "itl_ms": 2.0},
           "runs": [{"router": "pdgate", **_with_tokens(dict(point), "json", 16)},
                    {"router": "pdgate", **_with_tokens(dict(point), "stream 16 tok", 16)}]}
    md = overhead_markdown(doc)
    assert "| pdgate | json | 32 | 50 | - |" in md
    assert "| pdgate | stream 16 tok | 32 | 50 | 800 |" in md
