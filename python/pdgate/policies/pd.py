"""``pd`` route: every request takes the P/D path (prefill leg, then decode leg).

The prefill instance comes from ``prefill_policy``; the decode instance is
picked by ``decode_policy`` when the decode leg starts. With no prefill
instance the decode instance serves the request whole (``decode_only``).
"""

from __future__ import annotations

from typing import Any

from pdgate.policies.base import RequestInfo, RouteContext, RouteDecision
from pdgate.policies.predict import least_loaded, pd_prediction
from pdgate.policies.registry import register


@register("pd")
class PDRoute:
    name = "pd"
    kind = "route"

    def __init__(self, config: Any = None) -> None:
        pass

    def decide(self, ctx: RouteContext, request: RequestInfo) -> RouteDecision:
        pre = ctx.fleet.candidates("prefill")
        if not pre:
            return RouteDecision("decode_only")
        p = ctx.prefill_policy.select(pre, request)
        pred = pd_prediction(ctx, p, least_loaded(ctx.fleet.candidates("decode")), request)
        return RouteDecision("pd", prefill=p, predicted=pred)
