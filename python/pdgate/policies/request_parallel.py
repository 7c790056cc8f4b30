"""``request_parallel`` admission: several prefills per instance, few long ones.

Per prefill instance at most ``max_in_flight`` prefill legs run at once
(default 4), at most ``max_long`` of them long (prompt over
``long_threshold_tokens``, defaults 1 and 10000). Each leg holds the lane
``<url>`` and, if long, ``<url>#long`` in the Rust admission queue; the
queue admits every waiting entry whose lanes have room, in FIFO order, so a
short prompt passes a long one blocked on the long lane. vLLM V1 lost the
V0 concurrent-partial-prefill knobs (FIELD_NOTES), so the gateway provides
"short prefills beside one long one" itself.
"""

from __future__ import annotations

from typing import Any

from pdgate.fleet import Instance
from pdgate.policies.base import AdmissionTicket, RequestInfo
from pdgate.policies.registry import register


@register("request_parallel")
class RequestParallelAdmission:
    name = "request_parallel"
    kind = "admission"
    aging_rate = 0.0
    max_wait_s: float | None = None

    def __init__(self, config: Any = None) -> None:
        from pdgate.config import RequestParallelConfig

        self.cfg = config.request_parallel if config is not None else RequestParallelConfig()

    def is_long(self, request: RequestInfo) -> bool:
        return request.tokens > self.cfg.long_threshold_tokens

    def ticket(self, request: RequestInfo, prefill: Instance) -> AdmissionTicket:
        lanes = [(prefill.url, self.cfg.max_in_flight)]
        if self.is_long(request):
            lanes.append((prefill.url + "#long", self.cfg.max_long))
        return AdmissionTicket(lanes, 0)
