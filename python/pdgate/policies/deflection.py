"""``deflection`` route: Kairos prefill deflection (arXiv 2607.02043).

Under a prefill burst, a decode instance with spare compute can prefill a
prompt itself (chunked prefill beside its running decodes, Sarathi-Serve
style) instead of queueing behind the prefill instance: no KV transfer, no
prefill queue. The request is deflected to the decode instance ``d`` with the
smallest predicted deflected TTFT when all hold:

1. the prefill path is congested: its predicted queueing delay exceeds
   ``deflection.min_prefill_wait_s`` (an idle fleet always uses P/D);
2. ``TTFT_deflect(d) <= alpha * TTFT_pd`` (alpha default 1.3) and
   ``TTFT_deflect(d) <=`` the request's TTFT SLO;
3. ``d`` has no other deflected prefill in flight;
4. the decode step with its prefill chunk fits the TBT headroom of the
   requests already decoding on ``d`` (at most their strictest TPOT SLO).

Otherwise the request takes the P/D path (prefill policy, decode policy).
Predictions come from :mod:`pdgate.predictor`.
"""

from __future__ import annotations

import logging
from typing import Any

from pdgate.policies.base import RequestInfo, RouteContext, RouteDecision
from pdgate.policies.predict import deflect_prediction, least_loaded, pd_prediction, tbt_headroom_s
from pdgate.policies.registry import register

log = logging.getLogger("pdgate.policies.deflection")


@register("deflection")
class DeflectionRoute:
    name = "deflection"
    kind = "route"

    def __init__(self, config: Any = None) -> None:
        from pdgate.config import DeflectionConfig

        self.cfg = config.deflection if config is not None else DeflectionConfig()

    def decide(self, ctx: RouteContext, request: RequestInfo) -> RouteDecision:
        pre = ctx.fleet.candidates("prefill")
        dec = ctx.fleet.candidates("decode")
        if not pre:
            return RouteDecision("decode_only")
        p = ctx.prefill_policy.select(pre, request)
        pd = pd_prediction(ctx, p, least_loaded(dec), request)
        if pd["queue_s"] <= self.cfg.min_prefill_wait_s or request.tokens > self.cfg.max_prompt_tokens:
            return RouteDecision("pd", prefill=p, predicted=pd)
        best = None
        for d in dec:
            if d.deflected_in_flight > 0:
                continue
            pr = deflect_prediction(ctx, d, request)
            if pr["step_with_chunk_s"] > tbt_headroom_s(d):
                continue
            if best is None or pr["ttft_s"] < best[1]["ttft_s"]:
                best = (d, pr)
        if best is not None:
            d, pr = best
            if pr["ttft_s"] <= self.cfg.alpha * pd["ttft_s"] and pr["ttft_s"] <= request.ttft_slo_s:
                pr = {**pr, "pd_ttft_s": pd["ttft_s"]}
                return RouteDecision("deflect", decode=d, predicted=pr)
        return RouteDecision("pd", prefill=p, predicted=pd)
