"""``goodput`` route (pdgate's own): least predicted SLO violation per request.

For each request the policy scores every option with the latency predictor
(:mod:`pdgate.predictor`):

- every P/D pair (prefill instance, decode instance), across pools;
- deflection to every decode instance that has room for a deflected prefill
  (Kairos, arXiv 2607.02043).

An option's cost is::

    cost = [TTFT > TTFT SLO or TPOT > TPOT SLO]              (this request)
         + others_weight * (# requests decoding on the decode
           instance pushed past their TPOT SLO by it: their
           mean TPOT grows by the added step time x the steps
           affected / their output tokens)                    (the ones it slows)
         + 0.001 * (TTFT / TTFT SLO + TPOT / TPOT SLO)       (tie-break)
         + 0.01 if the instance's pool does not hold the prompt length

and the cheapest wins. Goodput, the rate of requests meeting both SLOs, is
the objective of DistServe (Zhong et al., OSDI'24); the per-request SLO class
comes from the ``x-slo-class`` header / ``slo_class`` field or the config's
default class.
"""

from __future__ import annotations

from typing import Any

from pdgate.fleet import Instance
from pdgate.policies.base import RequestInfo, RouteContext, RouteDecision
from pdgate.policies.predict import deflect_prediction, pd_prediction, slowed_past_slo
from pdgate.policies.registry import register


@register("goodput")
class GoodputRoute:
    name = "goodput"
    kind = "route"

    def __init__(self, config: Any = None) -> None:
        from pdgate.config import GoodputConfig

        self.cfg = config.goodput if config is not None else GoodputConfig()

    @staticmethod
    def _self_cost(pred: dict[str, float], req: RequestInfo) -> float:
        miss = pred["ttft_s"] > req.ttft_slo_s or pred["tpot_s"] > req.tpot_slo_s
        return float(miss) + 0.001 * (pred["ttft_s"] / req.ttft_slo_s + pred["tpot_s"] / req.tpot_slo_s)

    @staticmethod
    def _pool_penalty(ctx: RouteContext, insts: list[Instance], req: RequestInfo) -> float:
        pool = ctx.fleet.pool_for(req.prompt_tokens)
        if not ctx.fleet.pools:
            return 0.0
        return 0.01 * sum(1 for i in insts if i.pool is not None and i.pool != pool)

    def pd_option(self, ctx: RouteContext, p: Instance, d: Instance,
                  req: RequestInfo) -> tuple[float, int, RouteDecision]:
        """(cost, requests decoding on ``d`` pushed past their TPOT SLO, decision) of P/D on (``p``, ``d``)."""
        pr = pd_prediction(ctx, p, d, req)
        others = slowed_past_slo(d, pr["step_before_s"], pr["step_after_s"] - pr["step_before_s"])
        own = self._self_cost(pr, req)
        cost = own + self.cfg.others_weight * others + self._pool_penalty(ctx, [p, d], req)
        return cost, others, RouteDecision("pd", prefill=p, decode=d,
                                           predicted={**pr, "cost": cost, "miss": float(own >= 1.0)})

    def deflect_option(self, ctx: RouteContext, d: Instance, req: RequestInfo) -> tuple[float, int, RouteDecision]:
        """(cost, requests decoding on ``d`` pushed past their TPOT SLO, decision) of deflecting to ``d``."""
        pr = deflect_prediction(ctx, d, req)
        others = slowed_past_slo(d, pr["step_before_s"], pr["step_with_chunk_s"] - pr["step_before_s"],
                                 pr["prefill_steps"])
        own = self._self_cost(pr, req)
        cost = own + self.cfg.others_weight * others + self._pool_penalty(ctx, [d], req)
        return cost, others, RouteDecision("deflect", decode=d,
                                           predicted={**pr, "cost": cost, "miss": float(own >= 1.0)})

    def options(self, ctx: RouteContext, req: RequestInfo) -> list[tuple[float, RouteDecision]]:
        """Every option with its cost (unsorted)."""
        out: list[tuple[float, RouteDecision]] = []
        pre = ctx.fleet.candidates("prefill")
        for d in ctx.fleet.candidates("decode"):
            for p in pre:
                cost, _, dec = self.pd_option(ctx, p, d, req)
                out.append((cost, dec))
            if self.cfg.allow_deflection and d.deflected_in_flight < self.cfg.max_deflected_per_decode:
                cost, _, dec = self.deflect_option(ctx, d, req)
                out.append((cost, dec))
        return out

    def decide(self, ctx: RouteContext, request: RequestInfo) -> RouteDecision:
        opts = self.options(ctx, request)
        if not opts:
            return RouteDecision("decode_only")
        cost, best = min(opts, key=lambda o: (o[0], o[1].predicted["ttft_s"]))
        if not ctx.fleet.candidates("prefill") and best.kind == "deflect":
            best.kind = "decode_only"
            best.choice = "decode_only"
        return best
