"""``dedicated`` route: long prompts to a long-context pool, short ones to the short pool.

Pools are prompt-length ranges in the config (``pools: {short: {max_tokens:
8192}, long: {min_tokens: 8192}}``) and each instance names its pool
(``instances: [{url, role, pool}]``). A request's prefill and decode
instances are chosen by the per-role policies among the instances of the
pool whose range holds its prompt length (pool-less instances serve every
pool; an empty pool falls back to every instance).
"""

from __future__ import annotations

from typing import Any

from pdgate.policies.base import RequestInfo, RouteContext, RouteDecision
from pdgate.policies.predict import least_loaded, pd_prediction
from pdgate.policies.registry import register


@register("dedicated")
class DedicatedRoute:
    name = "dedicated"
    kind = "route"

    def __init__(self, config: Any = None) -> None:
        pass

    def decide(self, ctx: RouteContext, request: RequestInfo) -> RouteDecision:
        fleet = ctx.fleet
        pool = fleet.pool_for(request.prompt_tokens)
        choice = f"pool:{pool}" if pool else "pool:none"
        dec = fleet.in_pool(fleet.candidates("decode"), pool)
        pre = fleet.in_pool(fleet.candidates("prefill"), pool) if fleet.candidates("prefill") else []
        if not pre:
            return RouteDecision("decode_only", decode=ctx.decode_policy.select(dec, request),
                                 choice=choice)
        p = ctx.prefill_policy.select(pre, request)
        pred = pd_prediction(ctx, p, least_loaded(dec), request)
        return RouteDecision("pd", prefill=p, decode_candidates=dec, choice=choice, predicted=pred)
