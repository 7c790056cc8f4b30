"""``deadline`` admission: on-time requests first, doomed ones deferred.

Under overload, first-come-first-served makes every request late. This
admission policy (pdgate's, used with the ``goodput`` route) runs the
``request_parallel`` lanes per prefill instance (``max_in_flight`` prefills,
at most ``max_long`` long ones) but gives priority 1 to requests the route
policy predicts will miss their SLO whatever it does (``RequestInfo.doomed``:
the best option's cost >= 1), and 0 to the others. Doomed requests wait
behind on-time ones, so the capacity goes where it still buys goodput
(DistServe's objective); ``priority.max_wait_s`` (served first past it) and
``priority.aging_rate`` bound how long a deferred request waits. The
prediction of a new request's queue skips deferred prompts
(:meth:`pdgate.fleet.Instance.queue_ahead`).
"""

from __future__ import annotations

from typing import Any

from pdgate.fleet import Instance
from pdgate.policies.base import AdmissionTicket, RequestInfo
from pdgate.policies.registry import register


@register("deadline")
class DeadlineAdmission:
    name = "deadline"
    kind = "admission"

    def __init__(self, config: Any = None) -> None:
        from pdgate.config import PriorityConfig, RequestParallelConfig

        self.lanes = config.request_parallel if config is not None else RequestParallelConfig()
        prio = config.priority if config is not None else PriorityConfig()
        self.aging_rate = prio.aging_rate
        self.max_wait_s = prio.max_wait_s

    def ticket(self, request: RequestInfo, prefill: Instance) -> AdmissionTicket:
        lanes = [(prefill.url, self.lanes.max_in_flight)]
        if request.tokens > self.lanes.long_threshold_tokens:
            lanes.append((prefill.url + "#long", self.lanes.max_long))
        return AdmissionTicket(lanes, 1 if request.doomed else 0)
