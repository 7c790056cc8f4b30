"""``priority`` admission: priority classes, long-prompt penalty, aging.

A request's class is its body's integer ``priority`` (vLLM's field; lower
runs first) or the ``x-priority`` header, else ``default_priority``. Prompts
over ``long_threshold_tokens`` get ``long_penalty`` added per threshold
multiple, so long prompts yield to short ones of the same class. Prefill
legs wait in the Rust admission queue (``max_in_flight`` per prefill
instance); the queue ages waiting entries (``aging_rate`` priority units per
second) and serves any entry that waited over ``max_wait_s`` first, so none
starves. With ``forward_to_vllm`` the class goes to vLLM as ``priority``
for ``--scheduling-policy priority`` on the instances.
"""

from __future__ import annotations

from typing import Any

from pdgate.fleet import Instance
from pdgate.policies.base import AdmissionTicket, RequestInfo
from pdgate.policies.registry import register


@register("priority")
class PriorityAdmission:
    name = "priority"
    kind = "admission"

    def __init__(self, config: Any = None) -> None:
        from pdgate.config import PriorityConfig

        self.cfg = config.priority if config is not None else PriorityConfig()
        self.aging_rate = self.cfg.aging_rate
        self.max_wait_s = self.cfg.max_wait_s

    def effective_priority(self, request: RequestInfo) -> int:
        penalty = self.cfg.long_penalty * (request.tokens // self.cfg.long_threshold_tokens)
        return int(request.priority) + int(penalty)

    def ticket(self, request: RequestInfo, prefill: Instance) -> AdmissionTicket:
        return AdmissionTicket([(prefill.url, self.cfg.max_in_flight)], self.effective_priority(request))
