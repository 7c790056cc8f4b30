"""``pooled`` route (pdgate's own): late binding of the goodput route's options.

Every other route policy binds a request at arrival: it picks a prefill
instance (or a decode instance to deflect to), and the request then waits in
that instance's queue even when another instance frees up first. Under a
burst that strands work: the decode instances' spare compute (Kairos,
arXiv 2607.02043) sits idle while prefill queues grow.

``pooled`` keeps one gateway-wide queue instead
(:class:`pdgate.state.dispatch.LateBinding`) and routes a request only when
an executor has room for it:

- a prefill instance is *free* while the prefill work the gateway sent
  there is predicted to drain within ``pooled.max_queue_s`` (and fewer than
  ``pooled.max_in_flight`` prefills are in flight);
- a decode instance is free for a deflected prefill while it prefills fewer
  than ``pooled.max_local_prefills`` prompts itself and those are predicted
  to be done (at its chunked-prefill budget) within ``pooled.max_queue_s``.

While a prefill instance is free, requests take the P/D path; only while
every prefill instance is busy (the Kairos condition: the prefill path is
congested) do free decode instances take deflected prefills. The waiting
request at the head of the queue (``fcfs``, or ``sjf`` with aging) takes
the cheapest option among the free executors, costed as the
``goodput`` route costs them (own SLO miss, requests pushed past their TPOT
SLO, tie-break on predicted TTFT and TPOT). A deflection that would push a
request already decoding there past its TPOT SLO is not taken; the request
waits for a prefill instance instead. This is the pooling the fluid bound
in ``bench/results/goodput_tail_analysis.md`` asks for: no executor idles
while a request it could start waits elsewhere.
"""

from __future__ import annotations

from typing import Any

from pdgate.fleet import Instance
from pdgate.policies.base import RequestInfo, RouteContext, RouteDecision
from pdgate.policies.goodput import GoodputRoute
from pdgate.policies.registry import register


@register("pooled")
class PooledRoute(GoodputRoute):
    """Late-binding goodput route (see the module docstring).

    ``late_binding = True`` tells the gateway to queue requests in
    :class:`pdgate.state.dispatch.LateBinding` and call :meth:`place` when
    capacity frees; :meth:`decide` (binding at once) is the ``goodput`` route's.
    """

    name = "pooled"
    kind = "route"
    late_binding = True

    def __init__(self, config: Any = None) -> None:
        from pdgate.config import PooledConfig

        super().__init__(config)
        self.pcfg = config.pooled if config is not None else PooledConfig()

    # -- capacity ------------------------------------------------------------
    def prefill_free(self, ctx: RouteContext, p: Instance) -> bool:
        """Whether prefill instance ``p`` may take one more prompt now."""
        jobs = p.queue_ahead()
        if not jobs:
            return True
        if len(p.prefill_jobs) >= self.pcfg.max_in_flight:
            return False
        return ctx.predictor.prefill_time(jobs) < self.pcfg.max_queue_s

    def decode_free(self, ctx: RouteContext, d: Instance) -> bool:
        """Whether decode instance ``d`` may prefill one more prompt itself now."""
        if not self.cfg.allow_deflection:
            return False
        jobs = list(d.prefill_jobs.values())
        if not jobs:
            return True
        if len(jobs) >= self.pcfg.max_local_prefills:
            return False
        return ctx.predictor.prefill_time(jobs, d.decode_batch, on_decode=True) < self.pcfg.max_queue_s

    def has_capacity(self, ctx: RouteContext) -> bool:
        """Whether any executor (prefill instance, or decode instance for a deflection) is free."""
        return (any(self.prefill_free(ctx, p) for p in ctx.fleet.candidates("prefill"))
                or any(self.decode_free(ctx, d) for d in ctx.fleet.candidates("decode")))

    # -- order ---------------------------------------------------------------
    def order_key(self, req: RequestInfo, waited_s: float, seq: int) -> tuple[float, float, int]:
        """Sort key of a waiting request (smallest first): starved ones (waited over
        ``max_wait_s``) first, then by priority class (plus, for ``sjf``, one unit per
        ``long_threshold_tokens`` prompt tokens; for ``long_last``, one unit for a prompt
        over ``long_threshold_tokens``) minus ``aging_rate`` x seconds waited, then
        arrival order ``seq``. Under ``long_last`` a long prompt thus waits for the
        shorter ones until it has waited ``1 / aging_rate`` seconds longer than the
        oldest of them."""
        c = self.pcfg
        if waited_s > c.max_wait_s:
            return (0.0, -waited_s, seq)
        prio = float(req.priority)
        if c.order == "sjf":
            prio += req.tokens // c.long_threshold_tokens
        elif c.order == "long_last" and req.tokens > c.long_threshold_tokens:
            prio += 1.0
        return (1.0, prio - c.aging_rate * waited_s, seq)

    # -- placement -----------------------------------------------------------
    def place(self, ctx: RouteContext, req: RequestInfo) -> RouteDecision | None:
        """The cheapest option for ``req`` among the free executors, or ``None``
        to keep it waiting (no free executor, or only deflections that would push
        requests decoding there past their TPOT SLO). With no routable prefill
        instance it is ``decode_only`` at once (the decode policy picks); with no
        routable decode instance too, so that the request fails at once (503)
        instead of waiting for capacity that cannot come."""
        dec = ctx.fleet.candidates("decode")
        if not ctx.fleet.candidates("prefill") or not dec:  # nothing to wait for: the legs fail or go decode-only
            return RouteDecision("decode_only")
        pre = [p for p in ctx.fleet.candidates("prefill") if self.prefill_free(ctx, p)]
        best: tuple[float, float, RouteDecision] | None = None
        for d in dec:
            opts = [self.pd_option(ctx, p, d, req) for p in pre]
            if not pre and self.decode_free(ctx, d):  # deflect only while no prefill instance is free
                opts.append(self.deflect_option(ctx, d, req))
            for cost, others, decision in opts:
                if decision.kind == "deflect" and others > 0:
                    continue
                key = (cost, decision.predicted["ttft_s"])
                if best is None or key < best[:2]:
                    best = (*key, decision)
        return None if best is None else best[2]
