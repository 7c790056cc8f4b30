"""Soak: a real gateway in front of a simulated fleet under steady load plus
bursts from the Azure code trace, watched for lost requests and leaks.

Load: Poisson arrivals at ``rate_rps`` (seeded) plus, every ``burst_every_s``
seconds, the densest ``burst_window_s`` seconds of the Azure 2023 code trace
(arrival times as in the trace, each request kept with probability
``burst_keep``). Prompt/output lengths come from the trace, capped. Half the
requests stream.

Each request ends as one of:

- ``ok``: a full answer (JSON with a choice, or an SSE stream ending in
  ``[DONE]`` with ``max_tokens`` content chunks);
- ``error``: a clear error (an HTTP error status with OpenAI error JSON, or
  an SSE ``error`` event that ends the stream);
- ``lost``: anything else (connection reset, timeout, a truncated stream,
  a body that is neither). Must be 0.

Also sampled: the gateway's RSS and open file descriptors (``/proc``) every
``sample_every_s``; the gateway-added latency p50/p99 per ``window_s``
window, from the gateway's own ``pdgate_added_latency_seconds`` histogram
(arrival to sending the decode leg, prefill leg excluded; scraped at every
window boundary); and, as an outside check, probes every ``probe_every_s``
(a 1-token request sent directly as the two P/D legs, then through the
gateway; their difference, noisy under load, as ``probe_p50_ms``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import EventSource
import numpy as np

from pdgate.bench.procs import GatewayProcess, SimFleetProcess
from pdgate.bench.traces import load_azure_csv
from pdgate.gateway.bodies import PREFILL_KV_PARAMS

MODEL = "sim-model"


@dataclass
class SoakConfig:
    """Soak parameters (seconds, requests per second, tokens)."""

    duration_s: float = 600.0
    rate_rps: float = 4.0
    burst_every_s: float = 60.0
    burst_window_s: float = 8.0
    burst_keep: float = 0.4
    trace: str = "../shared/traces/azure2023_code.csv"
    max_prompt_tokens: int = 512
    max_output_tokens: int = 16
    n_prefill: int = 1
    n_decode: int = 2
    profile: str = "cpu-tiny"
    warmup_s: float = 60.0
    sample_every_s: float = 2.0
    probe_every_s: float = 1.0
    window_s: float = 60.0
    request_timeout_s: float = 120.0
    seed: int = 0


@dataclass
class Outcomes:
    ok: int = 0
    error: int = 0
    lost: int = 0
    status_5xx: int = 0
    errors_by_status: dict[str, int] = field(default_factory=dict)
    lost_examples: list[str] = field(default_factory=list)

    def add_error(self, status: int) -> None:
        self.error += 1
        self.errors_by_status[str(status)] = self.errors_by_status.get(str(status), 0) + 1
        if status >= 500:
            self.status_5xx += 1

    def add_lost(self, why: str) -> None:
        self.lost += 1
        if len(self.lost_examples) < 10:
            self.lost_examples.append(why[:300])


def _prompt(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1, 30000)}" for _ in range(max(1, n)))


def _is_error_json(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("error"), dict) and "message" in data["error"]


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], out: Outcomes,
                      timeout_s: float) -> None:
    """Send one request and classify its outcome into ``out``."""
    try:
        if body.get("stream"):
            async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as r:
                if r.status_code != 200:
                    data = json.loads(await r.aread())
                    if _is_error_json(data):
                        out.add_error(r.status_code)
                    else:
                        out.add_lost(f"status {r.status_code} without error JSON")
                    return
                chunks = 0
                last = None
                async for event in EventSource(r).aiter_sse():   # CR/LF lines only
                    line = "data: " + event.data
                    last = line
                    if event.data.startswith("{"):
                        obj = json.loads(event.data)
                        if _is_error_json(obj):
                            out.add_error(int(obj["error"].get("code") or 502))
                            return
                        if obj.get("choices"):
                            chunks += 1
                if last == "data: [DONE]" and chunks == body["max_tokens"]:
                    out.ok += 1
                else:
                    out.add_lost(f"stream ended after {chunks} chunks, last line {last!r}")
            return
        r = await client.post(url + "/v1/completions", json=body, timeout=timeout_s)
        data = r.json()
        if r.status_code == 200 and isinstance(data, dict) and data.get("choices"):
            out.ok += 1
        elif r.status_code != 200 and _is_error_json(data):
            out.add_error(r.status_code)
        else:
            out.add_lost(f"status {r.status_code}: {str(data)[:200]}")
    except (httpx.HTTPError, ValueError) as e:
        out.add_lost(repr(e))


def schedule(cfg: SoakConfig) -> list[tuple[float, int, int]]:
    """(send time s, prompt tokens, output tokens) of every request, sorted."""
    rng = random.Random(cfg.seed)
    trace = load_azure_csv(cfg.trace).requests
    lengths = [(min(r.prompt_tokens, cfg.max_prompt_tokens), max(1, min(r.output_tokens, cfg.max_output_tokens)))
               for r in trace]
    out: list[tuple[float, int, int]] = []
    t = 0.0
    while True:
        t += rng.expovariate(cfg.rate_rps)
        if t >= cfg.duration_s:
            break
        out.append((t, *lengths[rng.randrange(len(lengths))]))
    # the densest burst_window_s of the trace
    arr = np.array([r.arrival_s for r in trace])
    counts = np.searchsorted(arr, arr + cfg.burst_window_s) - np.arange(len(arr))
    k0 = int(np.argmax(counts))
    burst = [r for r in trace[k0:k0 + int(counts[k0])]]
    start = cfg.burst_every_s / 2
    while start + cfg.burst_window_s < cfg.duration_s:
        for r in burst:
            if rng.random() < cfg.burst_keep:
                pt = min(r.prompt_tokens, cfg.max_prompt_tokens)
                out.append((start + r.arrival_s - burst[0].arrival_s, pt,
                            max(1, min(r.output_tokens, cfg.max_output_tokens))))
        start += cfg.burst_every_s
    out.sort()
    return out


async def probe(client: httpx.AsyncClient, gw: str, prefill: str, decode: str, rng: random.Random) -> float | None:
    """Gateway-added latency of one 1-token request (seconds), or ``None`` if a path failed.

    The direct path (prefill leg, then decode leg with the returned
    ``kv_transfer_params``) runs first, then the gateway path, back to back
    with prompts of equal length (run concurrently, the two would contend for
    the decode instance's KV link and skew each other)."""
    async def direct() -> tuple[float, bool]:
        body = {"model": MODEL, "prompt": _prompt(rng, 16), "max_tokens": 1}
        t0 = time.perf_counter()
        p = await client.post(prefill + "/v1/completions", timeout=30,
                              json={**body, "stream": False, "kv_transfer_params": dict(PREFILL_KV_PARAMS)})
        kv = p.json().get("kv_transfer_params")
        d = await client.post(decode + "/v1/completions", json={**body, "kv_transfer_params": kv}, timeout=30)
        return time.perf_counter() - t0, p.status_code == 200 and d.status_code == 200

    async def via() -> tuple[float, bool]:
        body = {"model": MODEL, "prompt": _prompt(rng, 16), "max_tokens": 1}
        t0 = time.perf_counter()
        g = await client.post(gw + "/v1/completions", json=body, timeout=30)
        return time.perf_counter() - t0, g.status_code == 200

    try:
        td, ok_d = await direct()
        tg, ok_g = await via()
    except (httpx.HTTPError, ValueError):
        return None
    return tg - td if ok_d and ok_g else None


def _trend(samples: list[tuple[float, int, int]], idx: int, warmup_s: float, window_s: float) -> dict[str, Any]:
    """Per-window mean and floor (minimum) of sample column ``idx`` after
    warm-up; growth = last whole window vs the first (windows span whole burst
    periods). The floor is the value with the fewest connections open: a leak
    raises it, load alone does not."""
    vals = [(x[0], x[1 + idx]) for x in samples if x[0] >= warmup_s]
    means: list[float] = []
    floors: list[float] = []
    w = warmup_s
    while vals and w + window_s <= vals[-1][0] + 1e-9:
        v = [x for t, x in vals if w <= t < w + window_s]
        if v:
            means.append(float(np.mean(v)))
            floors.append(float(min(v)))
        w += window_s
    out: dict[str, Any] = {"windows": len(means), "window_means": [round(m, 1) for m in means],
                           "window_floors": floors}
    if len(means) >= 2 and means[0] and floors[0]:
        out.update({
            "growth_pct": 100.0 * (means[-1] - means[0]) / means[0],
            "max_dev_pct": 100.0 * max(abs(m - means[0]) for m in means) / means[0],
            "floor_growth_pct": 100.0 * (floors[-1] - floors[0]) / floors[0],
            "floor_max_dev_pct": 100.0 * max(abs(f - floors[0]) for f in floors) / floors[0]})
    return out


def _added_buckets(text: str) -> list[tuple[float, float]]:
    """Cumulative (le, count) buckets of ``pdgate_added_latency_seconds`` in a /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        if fam.name == "pdgate_added_latency_seconds":
            return sorted((float(smp.labels["le"]), smp.value) for smp in fam.samples
                          if smp.name.endswith("_bucket"))
    return []


def hist_quantile(a: list[tuple[float, float]], b: list[tuple[float, float]], q: float) -> float | None:
    """Quantile ``q`` (seconds) of the observations between cumulative bucket
    snapshots ``a`` (earlier) and ``b``, interpolated within a bucket as
    Prometheus' ``histogram_quantile`` does; ``None`` if no observation."""
    if not b:
        return None
    prev = dict(a)
    d = [(le, c - prev.get(le, 0.0)) for le, c in b]
    total = d[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lo_le, lo_c = 0.0, 0.0
    for le, c in d:
        if c >= rank:
            if le == float("inf"):
                return lo_le
            return lo_le + (le - lo_le) * ((rank - lo_c) / (c - lo_c) if c > lo_c else 1.0)
        lo_le, lo_c = le, c
    return lo_le


async def _run(cfg: SoakConfig, gw: GatewayProcess, fleet: SimFleetProcess) -> dict[str, Any]:
    plan = schedule(cfg)
    out = Outcomes()
    rng = random.Random(cfg.seed + 1)
    samples: list[tuple[float, int, int]] = []
    probes: list[tuple[float, float]] = []
    snaps: list[tuple[float, list[tuple[float, float]]]] = []
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(limits=limits) as client, httpx.AsyncClient() as probe_client:
        t_start = time.monotonic()
        stop = asyncio.Event()

        async def sampler() -> None:
            while not stop.is_set():
                samples.append((time.monotonic() - t_start, gw.rss_bytes(), gw.open_fds()))
                await asyncio.sleep(cfg.sample_every_s)

        async def prober() -> None:
            while not stop.is_set():
                a = await probe(probe_client, gw.url, fleet.prefill_urls[0], fleet.decode_urls[0], rng)
                if a is not None:
                    probes.append((time.monotonic() - t_start, a))
                await asyncio.sleep(cfg.probe_every_s)

        async def hist() -> None:
            while not stop.is_set():
                try:
                    r = await probe_client.get(gw.url + "/metrics", timeout=10)
                    snaps.append((time.monotonic() - t_start, _added_buckets(r.text)))
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(cfg.window_s)

        bg = [asyncio.create_task(sampler()), asyncio.create_task(prober()), asyncio.create_task(hist())]
        tasks = []
        for k, (t, pt, ot) in enumerate(plan):
            delay = t - (time.monotonic() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            body = {"model": MODEL, "prompt": _prompt(rng, pt), "max_tokens": ot, "ignore_eos": True,
                    "stream": k % 2 == 0}
            tasks.append(asyncio.create_task(one_request(client, gw.url, body, out, cfg.request_timeout_s)))
        await asyncio.gather(*tasks)
        snaps.append((time.monotonic() - t_start, _added_buckets((await probe_client.get(gw.url + "/metrics")).text)))
        stop.set()
        for task in bg:
            task.cancel()
        await asyncio.gather(*bg, return_exceptions=True)
        elapsed = time.monotonic() - t_start
    windows: list[dict[str, Any]] = []
    for (t0, a), (t1, b) in zip(snaps, snaps[1:]):
        p50, p99 = hist_quantile(a, b, 0.5), hist_quantile(a, b, 0.99)
        vals = [x for t, x in probes if t0 <= t < t1]
        windows.append({"start_s": round(t0, 1), "end_s": round(t1, 1),
                        "requests": int(b[-1][1] - dict(a).get(b[-1][0], 0.0)) if b else 0,
                        "p50_ms": round(1000 * p50, 3) if p50 is not None else None,
                        "p99_ms": round(1000 * p99, 3) if p99 is not None else None,
                        "probes": len(vals),
                        "probe_p50_ms": round(1000 * float(np.percentile(vals, 50)), 2) if vals else None})
    steady = [x["p99_ms"] for x in windows if x["start_s"] >= cfg.warmup_s and x["p99_ms"] is not None]
    return {
        "config": cfg.__dict__, "elapsed_s": round(elapsed, 1), "requests": len(plan), "ok": out.ok,
        "error": out.error, "lost": out.lost, "status_5xx": out.status_5xx, "errors_by_status": out.errors_by_status,
        "lost_examples": out.lost_examples,
        "rss_bytes": _trend(samples, 0, cfg.warmup_s, cfg.burst_every_s),
        "open_fds": _trend(samples, 1, cfg.warmup_s, cfg.burst_every_s),
        "added_latency_windows": windows,
        "added_latency_p99_ms": {"min": min(steady) if steady else None, "max": max(steady) if steady else None},
        "samples": [{"t_s": round(t, 1), "rss_bytes": r, "fds": f} for t, r, f in samples],
    }


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    """Start a simulated fleet and a gateway process, run the soak, stop both; returns the figures."""
    with SimFleetProcess(cfg.n_prefill, cfg.n_decode, profile=cfg.profile) as fleet:
        with GatewayProcess(fleet.config(log_level="warning")) as gw:
            res = asyncio.run(_run(cfg, gw, fleet))
            gw.terminate()
            res["gateway_exit_code"] = gw.wait(60)
    res["fleet"] = fleet.info
    return res
