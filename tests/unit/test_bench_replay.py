"""Open-loop replay against fake streaming servers (httpx.MockTransport and a
real uvicorn server on a loopback port), error accounting and the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time

import httpx
import pytest

from pdgate.bench.replay import ReplayResult, format_report, main, run_replay
from pdgate.bench.traces import ReplayPlan, TraceRequest

TRACES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "traces")
MOONCAKE = os.path.join(TRACES, "mooncake_fast25_conversation.jsonl")


def _plan(arrivals, out_tokens=3, prompt_tokens=4):
    reqs = [TraceRequest(a, prompt_tokens, out_tokens, index=i) for i, a in enumerate(arrivals)]
    return ReplayPlan("fake.csv", "azure", reqs, trace_rows=len(reqs))


def _chunk(text="x"):
    # raw non-ASCII, as vLLM sends it (U+2028 and U+0085 stay unescaped in JSON)
    return f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]}, ensure_ascii=False)}\n\n".encode()


def _usage(n_prompt, n_out):
    u = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    return f"data: {json.dumps({'choices': [], 'usage': u})}\n\n".encode()


UNICODE_BREAKS = ["a\u2028b", "\x85", "c\u2029", "\x1c\x1d\x1e", "\x0b\x0c"]


def fake_transport(behaviour, ttft=0.05, itl=0.02):
    """MockTransport streaming ``max_tokens`` chunks; ``behaviour[prompt[0]]``
    selects: "500", "stream_error", "hang", "empty", "unicode_breaks" (token
    texts holding Unicode line breaks that are not SSE line ends), ("slow", ttft_s)."""
    calls = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        key = body["prompt"][0]
        calls.append((time.perf_counter(), key, body))
        kind = behaviour.get(key)
        if kind == "500":
            return httpx.Response(500, json={"object": "error", "message": "boom"})
        first = kind[1] if isinstance(kind, tuple) else ttft

        async def gen():
            if kind == "hang":
                await asyncio.sleep(30)
            if kind == "empty":
                yield b"data: [DONE]\n\n"
                return
            await asyncio.sleep(first)
            yield b": ping\n\n"
            for k in range(body["max_tokens"]):
                if k:
                    await asyncio.sleep(itl)
                yield _chunk(UNICODE_BREAKS[k % len(UNICODE_BREAKS)] if kind == "unicode_breaks" else "x")
                if kind == "stream_error":
                    yield b'data: {"error": {"message": "oops", "code": 500}}\n\n'
                    return
            yield _usage(len(body["prompt"]), body["max_tokens"])
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=gen(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler), calls


async def test_payload_timing_and_metrics():
    transport, calls = fake_transport({})
    plan = _plan([0.0, 0.05, 0.1], out_tokens=4)
    prompts = [[i, 7, 7, 7] for i in range(3)]
    res = await run_replay("http://fake:1", "m", plan, prompts=prompts, transport=transport, slos={"ttft": 2.0})
    assert isinstance(res, ReplayResult) and len(calls) == 3
    body = calls[0][2]
    assert body["model"] == "m" and body["prompt"] == [0, 7, 7, 7] and body["max_tokens"] == 4
    assert body["ignore_eos"] is True and body["stream"] is True and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True}
    m = res.metrics
    assert (m.completed, m.failed, m.total_output_tokens, m.total_input_tokens) == (3, 0, 12, 12)
    for r in res.records:
        assert r.status == 200 and r.output_tokens == 4 and len(r.chunk_times_s) == 4
        assert 0.04 <= r.ttft_s < 0.3
        assert all(0.015 <= g < 0.2 for g in r.itl_s)
        assert r.tpot_s == pytest.approx((r.e2el_s - r.ttft_s) / 3)
    assert m.itl.median == pytest.approx(0.02, abs=0.015)
    assert m.good == 3 and m.slo_attainment == 1.0
    assert res.duration_s >= 0.1 + 0.05 + 3 * 0.02
    report = format_report(res)
    assert "Trace scaling: trace fake.csv" in report and "TTFT" in report


async def test_token_texts_with_unicode_line_breaks_are_one_chunk_each():
    """SSE lines end at CR, LF or CRLF only: a token text holding U+2028,
    U+0085, ... (raw inside vLLM's JSON) must not split its chunk."""
    transport, _ = fake_transport({0: "unicode_breaks"})
    res = await run_replay("http://fake", "m", _plan([0.0], out_tokens=5), prompts=[[0]], transport=transport)
    rec = res.records[0]
    assert not rec.error and rec.success, rec.error
    assert len(rec.chunk_times_s) == 5 and rec.output_tokens == 5


async def test_open_loop_sends_not_delayed_by_slow_responses():
    # Request 0 takes 0.6 s to its first token; 1-3 must still go out on time.
    transport, calls = fake_transport({0: ("slow", 0.6)})
    arrivals = [0.0, 0.1, 0.2, 0.3]
    res = await run_replay("http://fake", "m", _plan(arrivals), prompts=[[i] for i in range(4)], transport=transport)
    assert res.metrics.completed == 4
    for r in res.records:
        assert r.send_lag_s < 0.15, r
    t_first = min(t for t, _, _ in calls)
    assert [k for _, k, _ in sorted(calls)] == [0, 1, 2, 3]
    for t, k, _ in calls:
        assert t - t_first == pytest.approx(arrivals[k], abs=0.15)
    slow = res.records[0]
    assert all(r.send_s < slow.chunk_times_s[0] for r in res.records[1:])

    # With a concurrency cap of 1 the next send waits for request 0 to finish.
    transport, _ = fake_transport({0: ("slow", 0.4)})
    res = await run_replay("http://fake", "m", _plan(arrivals[:2]), prompts=[[0], [1]], transport=transport,
                           max_concurrency=1)
    assert res.records[1].send_s >= res.records[0].end_s - 1e-3
    assert res.metrics.send_lag.max > 0.25


async def test_error_accounting():
    behaviour = {1: "500", 2: "stream_error", 3: "hang", 4: "empty"}
    transport, _ = fake_transport(behaviour)
    plan = _plan([0.0, 0.0, 0.01, 0.02, 0.03])
    res = await run_replay("http://fake", "m", plan, prompts=[[i] for i in range(5)], transport=transport,
                           request_timeout_s=0.4, slos={"ttft": 10.0})
    r = res.records
    assert r[0].success and not any(x.success for x in r[1:])
    assert r[1].status == 500 and r[1].error == "HTTP 500: boom"
    assert r[2].error == "stream error: oops" and len(r[2].chunk_times_s) == 1
    assert r[3].error == "timeout after 0.4 s" and r[3].end_s == pytest.approx(0.42, abs=0.15)
    assert r[4].error == "no chunk with choices received"
    m = res.metrics
    assert (m.completed, m.failed, m.good) == (1, 4, 1)
    assert m.slo_attainment == pytest.approx(0.2)
    assert m.request_goodput == pytest.approx(1 / res.duration_s)
    assert sum(m.errors.values()) == 4
    d = res.to_dict(per_request=True)
    assert d["counts"] == {"requests": 5, "completed": 1, "failed": 4, "good": 1}
    assert len(d["requests"]) == 5 and d["requests"][1]["status"] == 500
    json.dumps(d)  # serializable
    assert not res.all_failed


async def test_connection_refused_counts_as_failure(free_port):
    res = await run_replay(f"http://127.0.0.1:{free_port}", "m", _plan([0.0, 0.01]), prompts=[[1], [2]])
    assert res.all_failed and all("Connect" in r.error for r in res.records)


# ---------------------------------------------------------------- real HTTP


async def _sse_app(scope, receive, send):
    """Raw ASGI app: a vLLM-like streaming /v1/completions (ttft 20 ms, itl 5 ms)."""
    assert scope["type"] == "http"
    raw = b""
    while True:
        msg = await receive()
        raw += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    body = json.loads(raw)
    if scope["path"] != "/v1/completions":
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"not found"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await asyncio.sleep(0.02)
    for k in range(body["max_tokens"]):
        if k:
            await asyncio.sleep(0.005)
        await send({"type": "http.response.body", "body": _chunk(), "more_body": True})
    n_prompt = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
    await send({"type": "http.response.body", "body": _usage(n_prompt, body["max_tokens"]), "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


@pytest.fixture
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sse_server():
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_sse_app, lifespan="off", log_level="warning", access_log=False))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    th.join(timeout=5)
    sock.close()


async def test_real_http_server(sse_server):
    plan = _plan([0.0, 0.02, 0.04, 0.06], out_tokens=5, prompt_tokens=8)
    res = await run_replay(sse_server, "m", plan, None, vocab_size=5000, slos={"ttft": 1.0})
    m = res.metrics
    assert m.completed == 4 and m.total_output_tokens == 20 and m.total_input_tokens == 32
    assert all(len(r.chunk_times_s) == 5 and r.ttft_s >= 0.015 for r in res.records)
    assert m.ttft.mean < 0.5 and m.good == 4


def _write_tiny_tokenizer(path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["prefill decode gateway token stream latency"] * 20, vocab_size=300,
                            min_frequency=1, show_progress=False)
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer).save_pretrained(str(path))


@pytest.fixture
def trace_slice(tmp_path):
    # First 6 rows of the Mooncake trace (kvcache-ai/Mooncake FAST25-release,
    # Apache-2.0), or a stand-in with the same shape when shared/ is absent.
    p = tmp_path / "slice.jsonl"
    if os.path.exists(MOONCAKE):
        with open(MOONCAKE) as f:
            p.write_text("".join(f.readline() for _ in range(6)))
    else:
        rows = [{"timestamp": 0, "input_length": 900 + i, "output_length": 3, "hash_ids": [0, i + 1]} for i in range(6)]
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_cli_success(sse_server, trace_slice, tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    _write_tiny_tokenizer(tok_dir)
    out = tmp_path / "out.json"
    rc = main([
        "--url", sse_server, "--model", "m", "--tokenizer", str(tok_dir), "--trace", str(trace_slice),
        "--max-requests", "3", "--time-scale", "0.01", "--max-prompt-tokens", "600", "--max-output-tokens", "4",
        "--slo", "ttft:2s", "--slo", "tpot:1000", "--json", str(out), "--per-request", "--progress-interval", "0",
    ])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Trace scaling: trace slice.jsonl (mooncake)" in text and "prompt cap 600 tok (3/3 capped)" in text
    d = json.loads(out.read_text())
    assert d["counts"]["completed"] == 3 and d["scaling_params"]["time_scale"] == 0.01
    assert d["metrics"]["slos_ms"] == {"ttft": 2000.0, "tpot": 1000.0}
    assert [r["server_prompt_tokens"] for r in d["requests"]] == [600, 600, 600]
    assert all(r["output_tokens"] == 4 for r in d["requests"])


def test_cli_exit_nonzero_when_all_fail(trace_slice, free_port, tmp_path):
    out = tmp_path / "fail.json"
    rc = main([
        "--url", f"http://127.0.0.1:{free_port}", "--model", "m", "--vocab-size", "1000",
        "--trace", str(trace_slice), "--max-requests", "2", "--time-scale", "0.01",
        "--max-prompt-tokens", "64", "--json", str(out), "--progress-interval", "0",
    ])
    assert rc == 1
    d = json.loads(out.read_text())
    assert d["counts"]["failed"] == 2 and d["scaling"].startswith("trace slice.jsonl")
    assert main(["--model", "m", "--trace", str(trace_slice), "--start", "1e6", "--vocab-size", "10"]) == 2


def test_local_fleet_checks_trace_window_and_slos_before_starting(trace_slice, tmp_path, monkeypatch, capsys):
    """A missing trace, an empty window or a bad SLO ends with exit 2 and a
    one-line error before the local fleet (minutes of vLLM start-up) starts."""
    import pdgate.localfleet as lf

    started = []
    monkeypatch.setattr(lf.LocalFleet, "__enter__", lambda self: started.append(self) or self)
    missing = str(tmp_path / "nope.csv")
    assert main(["--local-fleet", "--trace", missing]) == 2
    assert f"error: cannot read the trace {missing}: No such file or directory" in capsys.readouterr().err
    assert main(["--local-fleet", "--trace", str(trace_slice), "--start", "1e6"]) == 2
    assert "error: no request in the window" in capsys.readouterr().err
    assert main(["--local-fleet", "--trace", str(trace_slice), "--slo", "foo:1"]) == 2
    assert "error: bad SLO 'foo:1'" in capsys.readouterr().err
    assert started == []
    assert main(["--model", "m", "--vocab-size", "10", "--trace", missing]) == 2   # without the fleet too
