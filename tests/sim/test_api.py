"""The simulator's HTTP surface: OpenAI API, SSE, metrics, P/D handshake, aborts."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from pdgate.sim import SimFleet
from tests.sim.conftest import FAST


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def sse(resp: httpx.Response) -> list[dict]:
    events = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            events.append({"done": True} if data == "[DONE]" else json.loads(data))
    return events


def test_health_models_version(pd_fleet: SimFleet) -> None:
    u = pd_fleet.both_urls[0]
    assert httpx.get(u + "/health").status_code == 200
    models = httpx.get(u + "/v1/models").json()
    assert models["data"][0]["id"] == "sim-model" and models["data"][0]["max_model_len"] == 8192


def test_completion_non_stream_counts_and_usage(pd_fleet: SimFleet) -> None:
    u = pd_fleet.both_urls[0]
    r = httpx.post(u + "/v1/completions", json={"model": "sim-model", "prompt": list(range(100, 300)),
                                                "max_tokens": 7, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ch = body["choices"][0]
    assert ch["finish_reason"] == "length" and len(ch["token_ids"]) == 7 and len(ch["text"].split()) == 7
    assert body["usage"] == {"prompt_tokens": 200, "completion_tokens": 7, "total_tokens": 207,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert "kv_transfer_params" not in body


def test_stream_completion_one_chunk_per_token_then_usage_and_done(pd_fleet: SimFleet) -> None:
    u = pd_fleet.both_urls[0]
    with httpx.stream("POST", u + "/v1/completions", json={
            "model": "sim-model", "prompt": "hello world " * 20, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        r.read()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = sse(r)
    content = [e for e in ev if e.get("choices")]
    assert len(content) == 5 and content[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    assert ev[-2]["usage"]["completion_tokens"] == 5 and ev[-2]["choices"] == []
    assert ev[-1] == {"done": True}


def test_chat_stream_and_non_stream(pd_fleet: SimFleet) -> None:
    u = pd_fleet.both_urls[0]
    msgs = [{"role": "user", "content": "write a poem"}]
    r = httpx.post(u + "/v1/chat/completions", json={"model": "sim-model", "messages": msgs, "max_tokens": 3})
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    assert r.json()["object"] == "chat.completion" and r.json()["usage"]["completion_tokens"] == 3
    r = httpx.post(u + "/v1/chat/completions", json={"model": "sim-model", "messages": msgs, "max_tokens": 3,
                                                     "stream": True})
    content = [e for e in sse(r) if e.get("choices")]
    assert len(content) == 3 and content[0]["choices"][0]["delta"]["role"] == "assistant"
    assert content[0]["object"] == "chat.completion.chunk"


@pytest.mark.parametrize("body,status", [
    ({"prompt": list(range(8190)), "max_tokens": 10}, 400),          # over max_model_len
    ({"prompt": "x", "max_tokens": 0}, 400),
    ({"prompt": "", "max_tokens": 3}, 400),
    ({"prompt": "x", "max_tokens": 3, "priority": 2}, 400),           # fcfs instance rejects priority
    ({"model": "other", "prompt": "x", "max_tokens": 3}, 404),
])
def test_bad_requests_get_openai_errors(pd_fleet: SimFleet, body: dict, status: int) -> None:
    r = httpx.post(pd_fleet.both_urls[0] + "/v1/completions", json={"model": "sim-model", **body})
    assert r.status_code == status and "message" in r.json()["error"]


def test_pd_handshake_transfers_and_frees_prefill_blocks(pd_fleet: SimFleet) -> None:
    p, d = pd_fleet.prefill_urls[0], pd_fleet.decode_urls[0]
    prompt = list(range(1000, 1640))  # 640 tokens = 40 blocks
    r = httpx.post(p + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "stream": False,
                                                "kv_transfer_params": {"do_remote_decode": True}})
    kv = r.json()["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["remote_engine_id"].startswith("sim-prefill")
    assert len(kv["remote_block_ids"][0]) == 40 and kv["remote_num_tokens"] == 640
    held = metric(httpx.get(p + "/metrics").text, "pdgate_sim_held_requests")
    assert held == 1
    t = time.perf_counter()
    r = httpx.post(d + "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "kv_transfer_params": kv})
    took = time.perf_counter() - t
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    # transfer 10 ms + 640 kB / 10 MB/s = 74 ms, then three ~5 ms steps; a local prefill would be 64 ms more
    assert 0.08 < took < 1.0
    dm = httpx.get(d + "/metrics").text
    assert metric(dm, "pdgate_sim_kv_transfers_total") == 1
    assert metric(dm, "vllm:prompt_tokens_total") == 640
    assert metric(httpx.get(p + "/metrics").text, "pdgate_sim_held_requests") == 0


def test_decode_without_params_computes_locally_and_bad_params_fall_back(pd_fleet: SimFleet) -> None:
    d = pd_fleet.decode_urls[0]
    before = metric(httpx.get(d + "/metrics").text, "pdgate_sim_kv_load_failures_total")
    r = httpx.post(d + "/v1/completions", json={"prompt": list(range(5000, 5100)), "max_tokens": 2})
    assert r.status_code == 200
    bogus = {"do_remote_prefill": True, "remote_engine_id": "nope", "remote_request_id": "x",
             "remote_block_ids": [[1]]}
    r = httpx.post(d + "/v1/completions", json={"prompt": list(range(6000, 6100)), "max_tokens": 2,
                                                "kv_transfer_params": bogus})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert metric(httpx.get(d + "/metrics").text, "pdgate_sim_kv_load_failures_total") == before + 1


def test_prefix_cache_reports_cached_tokens(pd_fleet: SimFleet) -> None:
    u = pd_fleet.both_urls[0]
    prompt = list(range(7000, 7100))  # 6 full blocks + 4
    httpx.post(u + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    r = httpx.post(u + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert metric(httpx.get(u + "/metrics").text, "vllm:prefix_cache_hits_total") >= 96


def test_metrics_use_vllm_names(pd_fleet: SimFleet) -> None:
    text = httpx.get(pd_fleet.both_urls[0] + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_sum", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:prefix_cache_hits_total", "pdgate_sim_time_scale"):
        assert name in text, name
    assert 'model_name="sim-model"' in text


def test_client_disconnect_aborts_request(pd_fleet: SimFleet) -> None:
    u = pd_fleet.both_urls[0]
    with httpx.Client() as c:
        with c.stream("POST", u + "/v1/completions", json={"prompt": "abc", "max_tokens": 2000,
                                                           "stream": True}) as r:
            it = r.iter_lines()
            got = 0
            for line in it:
                got += line.startswith("data:")
                if got >= 2:
                    break
    deadline = time.time() + 5
    while time.time() < deadline:
        m = httpx.get(u + "/metrics").text
        if metric(m, "pdgate_sim_aborted_requests_total") >= 1 and metric(m, "vllm:num_requests_running") == 0:
            break
        time.sleep(0.05)
    assert metric(m, "pdgate_sim_aborted_requests_total") >= 1
    assert metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:kv_cache_usage_perc") == 0


def test_time_scale_runs_faster_than_real_time() -> None:
    # 20 decode steps of ~5.1 ms sim each = ~0.1 s sim; at x20 that is ~5 ms wall
    with SimFleet(0, 0, 1, profile=FAST, time_scale=20.0) as f:
        u = f.both_urls[0]
        httpx.post(u + "/v1/completions", json={"prompt": "warm", "max_tokens": 1})
        t = time.perf_counter()
        r = httpx.post(u + "/v1/completions", json={"prompt": list(range(100, 1100)), "max_tokens": 100})
        wall = time.perf_counter() - t
        assert r.status_code == 200
        sim_e2e = metric(httpx.get(u + "/metrics").text, "vllm:e2e_request_latency_seconds_sum")
    # sim e2e of the second request ~ 0.105 (prefill) + 99 * 0.0051 = 0.61 s; wall should be ~1/20 of it
    assert 0.5 < sim_e2e < 1.2
    assert wall < 0.61 / 2  # at least twice faster than real time, even on a loaded host


def test_role_overrides_change_only_that_roles_instances() -> None:
    """``--decode-set`` / ``role_overrides``: e.g. a decode pool with a small step budget."""
    with SimFleet(1, 1, profile=FAST, role_overrides={"decode": {"max_num_batched_tokens": 256}}) as f:
        budgets = {i.role: i.engine.profile.max_num_batched_tokens for i in f.instances}
        assert budgets == {"prefill": 2048, "decode": 256}
        assert f.describe()["role_overrides"] == {"decode": {"max_num_batched_tokens": 256}}
        r = httpx.post(f.decode_urls[0] + "/v1/completions", json={"prompt": list(range(1000)), "max_tokens": 2})
        assert r.status_code == 200
    with pytest.raises(ValueError, match="unknown roles"):
        SimFleet(1, 1, profile=FAST, role_overrides={"router": {"max_num_seqs": 1}})


def test_cli_rejects_a_bad_role_override() -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pdgate", "sim-fleet", "--decode-set", "no_such_field=1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "bad profile" in r.stderr


def test_trace_records_steps_and_the_pd_requests_waits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``trace_dir``: each engine writes its steps and first tokens; :func:`summarize` reads them
    back (the P/D request's KV loaded after it arrived, its first token after that)."""
    from pdgate.sim.trace import main as trace_main
    from pdgate.sim.trace import summarize

    with SimFleet(1, 1, profile=FAST, trace_dir=str(tmp_path)) as f:
        p, d = f.prefill_urls[0], f.decode_urls[0]
        prompt = list(range(2000, 2320))
        kv = httpx.post(p + "/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                                     "kv_transfer_params": {"do_remote_decode": True}}
                        ).json()["kv_transfer_params"]
        r = httpx.post(d + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "kv_transfer_params": kv})
        assert r.status_code == 200
        r = httpx.post(d + "/v1/completions", json={"prompt": list(range(50)), "max_tokens": 2})
        assert r.status_code == 200
    pre = (tmp_path / "sim-prefill-0.steps.csv").read_text().splitlines()
    assert pre[0] == "start_s,duration_s,prefill_tokens,decode_seqs,waiting,running"
    assert sum(int(line.split(",")[2]) for line in pre[1:]) == 320  # the whole prompt, prefilled there
    reqs = (tmp_path / "sim-decode-1.requests.csv").read_text().splitlines()[1:]
    kinds = sorted(line.split(",")[0] for line in reqs)
    assert kinds == ["local", "pd"]
    s = summarize(str(tmp_path))
    assert s["pd_requests"] == 1 and s["arrival_to_loaded_s"]["p50"] > 0 and s["loaded_to_first_s"]["p50"] > 0
    assert s["engines"]["sim-decode-1"]["prefill_tokens_per_s"] > 0  # the local request's 50 tokens
    assert trace_main([str(tmp_path)]) == 0
    with pytest.raises(FileNotFoundError):
        summarize(str(tmp_path / "empty"))
