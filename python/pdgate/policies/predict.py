"""Shared prediction helpers for route policies (not a policy itself).

Turns the live state of an instance into the latency predictor's inputs:
the gateway's own queue of prompts on a prefill (or deflecting decode)
instance, and the decode batch and KV tokens of a decode instance.
"""

from __future__ import annotations

from pdgate.fleet import Instance
from pdgate.policies.base import RequestInfo, RouteContext


def pd_prediction(ctx: RouteContext, p: Instance, d: Instance, req: RequestInfo) -> dict[str, float]:
    """Predicted ``queue_s``, ``prefill_s``, ``transfer_s``, ``ttft_s`` and
    ``tpot_s`` of ``req`` on the pair (``p``, ``d``), plus ``step_before_s``
    and ``step_after_s`` of ``d``'s decode step without and with it."""
    pr = ctx.predictor
    n = req.tokens
    out = pr.ttft_pd(p.queue_ahead(), n, d.decode_batch, d.kv_tokens)
    out["step_before_s"] = pr.decode_step(d.decode_batch, d.kv_tokens)
    out["step_after_s"] = pr.decode_step(d.decode_batch + 1, d.kv_tokens + n)
    out["tpot_s"] = out["step_after_s"] + local_prefill_drag_s(ctx, d, req)
    out["decode_wait_s"] = local_prefill_wait_s(ctx, d)
    out["ttft_s"] += out["decode_wait_s"]
    out["ttft_model_s"] = out["ttft_s"]
    out["ttft_s"] += pr.ttft_offset("pd")
    return out


def local_prefill_wait_s(ctx: RouteContext, d: Instance) -> float:
    """Extra delay before a P/D request's first decode step on ``d`` caused by
    prompts ``d`` prefills itself: vLLM schedules running requests first, so
    a request whose KV just arrived gets budget only once those prefills leave
    room; at least its first step carries their chunk."""
    if not d.prefill_jobs:
        return 0.0
    pr = ctx.predictor
    jobs = list(d.prefill_jobs.values())
    budget = pr.base.budget(on_decode=True)[0] - d.decode_batch
    if sum(jobs) >= budget:
        return pr.prefill_time(jobs, d.decode_batch, on_decode=True)
    chunk = pr.chunk_tokens(sum(jobs), d.decode_batch)
    return pr.decode_step(d.decode_batch, d.kv_tokens, chunk) - pr.decode_step(d.decode_batch, d.kv_tokens)


def local_prefill_drag_s(ctx: RouteContext, d: Instance, req: RequestInfo) -> float:
    """Mean TPOT added to a request decoding on ``d`` by the prompts ``d`` still
    has to prefill itself (deflected or decode-only): their prefill time
    spread over the request's output tokens (at most all of it)."""
    if not d.prefill_jobs:
        return 0.0
    pf = ctx.predictor.prefill_time(list(d.prefill_jobs.values()), d.decode_batch + 1, on_decode=True)
    return pf / max(1, req.output_tokens or 16)


def deflect_prediction(ctx: RouteContext, d: Instance, req: RequestInfo) -> dict[str, float]:
    """Predicted ``ttft_s`` if ``d`` prefills ``req`` itself, its ``tpot_s``,
    the chunk size and ``step_with_chunk_s`` its decodes see meanwhile."""
    pr = ctx.predictor
    n = req.tokens
    out = pr.ttft_deflect(list(d.prefill_jobs.values()), n, d.decode_batch, d.kv_tokens)
    out["step_before_s"] = pr.decode_step(d.decode_batch, d.kv_tokens)
    out["tpot_s"] = pr.decode_step(d.decode_batch + 1, d.kv_tokens + n)
    out["ttft_model_s"] = out["ttft_s"]
    out["ttft_s"] += pr.ttft_offset("deflect")
    return out


def slowed_past_slo(d: Instance, before_s: float, extra_s: float, steps: float | None = None) -> int:
    """Requests decoding on ``d`` that meet their TPOT SLO at ``before_s`` per
    step and would miss it when ``steps`` of their steps (all, if ``None``)
    take ``extra_s`` longer: their mean TPOT grows by ``extra_s * steps / output tokens``."""
    n = 0
    for slo, out in d.decode_targets():
        grow = extra_s if steps is None else extra_s * min(1.0, steps / out)
        if before_s <= slo < before_s + grow:
            n += 1
    return n


def tbt_headroom_s(d: Instance) -> float:
    """The strictest TPOT SLO of the requests decoding on ``d`` (inf if none)."""
    slos = d.decode_tpot_slos()
    return min(slos) if slos else float("inf")


def least_loaded(instances: list[Instance]) -> Instance:
    return min(instances, key=lambda i: (i.load_tokens(), i.in_flight))
